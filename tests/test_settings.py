"""portable_zip/settings.py: every run-time PZ_* variable read in one place,
each listed in docs/SETTINGS.md, and bad values rejected with the name."""
import pathlib

import pytest

from portable_zip import settings

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
    assert (s.timeout, s.check_plans, s.wave_bytes, s.piece_bytes, s.max_sms, s.fabric_rails, s.link_gbps,
            s.fabric_stage, s.trace) == (7.5, True, 65536, 4096, 3, 4, 0.5, True, False)


@pytest.mark.parametrize("name, value", [("PZ_WAVE_BYTES", "big"), ("PZ_WAVE_BYTES", "0"), ("PZ_MAX_SMS", "-1"),
                                         ("PZ_PIECE_BYTES", "-5"), ("PZ_LINK_GBPS", "fast"),
                                         ("PZ_FABRIC_RAILS", "two")])
def test_bad_values_name_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        settings.Settings.from_env({name: value})
