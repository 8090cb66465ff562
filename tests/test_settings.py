"""portable_zip/settings.py: every run-time PZ_* variable read in one place,
each listed in docs/SETTINGS.md, and bad values rejected with the name."""
import pathlib

import pytest

from portable_zip.comm import settings

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "SETTINGS.md"


def test_every_setting_is_documented():
    text = DOC.read_text()
    missing = [v for v in settings.NAMES.values() if f"`{v}`" not in text]
    assert not missing, f"docs/SETTINGS.md does not list {missing}"


def test_defaults_and_values_from_the_given_environment():
    assert settings.Settings.from_env({}) == settings.Settings()
    s = settings.Settings.from_env({"PZ_TIMEOUT": "7.5", "PZ_CHECK_PLANS": "1", "PZ_WAVE_BYTES": "65536",
                                    "PZ_PIECE_BYTES": "4096", "PZ_MAX_SMS": "3", "PZ_FABRIC_RAILS": "4",
                                    "PZ_LINK_GBPS": "0.5", "PZ_FABRIC_STAGE": "1", "PZ_TRACE": "0"})
    assert (s.timeout, s.check_plans, s.wave_bytes, s.piece_bytes, s.max_sms, s.link_gbps, s.fabric_stage,
            s.trace) == ("7.5", True, 65536, 4096, 3, 0.5, True, False)
    # 0 (-1 for the window): the engine's default for the provider it finds
    # (push over tcp;ofi_rxm: 256 KiB chunks; else 2 MiB; depth max(4, 2 x rails))
    assert s.fabric() == ("", 4, 0, 0, True, 2000, -1)
    assert settings.Settings.from_env({"PZ_FABRIC_DEPTH": "3"}).fabric()[3] == 3


@pytest.mark.parametrize("name, value", [("PZ_WAVE_BYTES", "big"), ("PZ_WAVE_BYTES", "0"), ("PZ_MAX_SMS", "-1"),
                                         ("PZ_PIECE_BYTES", "-5"), ("PZ_LINK_GBPS", "fast")])
def test_bad_values_name_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        settings.Settings.from_env({name: value})


@pytest.mark.parametrize("name", ["PZ_FABRIC_RAILS", "PZ_FABRIC_CHUNK", "PZ_FABRIC_DEPTH", "PZ_FABRIC_SPIN",
                                  "PZ_FABRIC_WINDOW"])
def test_bad_fabric_values_raise_only_where_a_fabric_is_made(name):
    s = settings.Settings.from_env({name: "two"})  # a Communicator without the fabric never parses them
    with pytest.raises(ValueError, match=name):
        s.fabric()


@pytest.mark.parametrize("name", ["PZ_FABRIC_RAILS", "PZ_FABRIC_CHUNK", "PZ_FABRIC_DEPTH"])
def test_a_zero_fabric_size_is_no_default(name):
    with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
        settings.Settings.from_env({name: "0"}).fabric()


@pytest.mark.parametrize("name, value, arg", [("PZ_LINK_GBPS", "-5", "link_gbps"), ("PZ_LINK_GBPS", "inf", "link_gbps"),
                                              ("PZ_CODEC_GBPS", "0", "codec_gbps"),
                                              ("PZ_LINK_LATENCY_US", "-1", "latency_us"),
                                              ("PZ_POLICY_MARGIN", "1.5", "margin"),
                                              ("PZ_POLICY_MARGIN", "nan", "margin")])
def test_policy_overrides_out_of_range_name_argument_and_variable(monkeypatch, name, value, arg):
    """Numbers settings.py parses but the policy cannot use: the Communicator
    rejects them before it touches torch.distributed, naming both."""
    import portable_zip as pz
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^{arg} \(from {name}\) must be None or a number"):
        pz.Communicator()
    monkeypatch.delenv(name)
    with pytest.raises(ValueError, match=rf"^{arg} must be None or a number"):
        pz.Communicator(**{arg: float(value)})


@pytest.mark.parametrize("value", ["abc", "-1", "0", "inf"])
def test_a_bad_pz_timeout_names_the_variable(value):
    from portable_zip.comm.setup import timeout_of

    with pytest.raises(ValueError, match="PZ_TIMEOUT"):
        timeout_of(None, settings.Settings.from_env({"PZ_TIMEOUT": value}))
    assert timeout_of(None, settings.Settings.from_env({"PZ_TIMEOUT": "7.5"})) == 7.5
    with pytest.raises(TypeError, match=r"^timeout must"):
        timeout_of([1], settings.Settings.from_env({}))
