"""Registers the "pz" torch.distributed backend when torch is imported.

torch loads the "torch.backends" entry points at the end of `import torch`
(unless TORCH_DEVICE_BACKEND_AUTOLOAD=0), and turns any error there into a
failure of `import torch` itself. So this package is tiny and never raises:
if portable_zip cannot be imported, it warns once, saying what failed and
how to fix it, and `import portable_zip` later gives the real error."""

_warned = False


def register() -> None:
    try:
        import portable_zip  # noqa: F401  (portable_zip.c10d registers the backend)
    except Exception as e:  # noqa: BLE001 - torch must import whatever happens here
        _warn(e)


def _warn(e: Exception) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    import warnings

    msg = (f"portable_zip: the 'pz' torch.distributed backend is not registered, as `import portable_zip` "
           f"failed: {type(e).__name__}: {e} (fix that, or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to skip "
           "registering it at `import torch`)")
    try:
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    except Exception:  # noqa: BLE001 - warnings made errors (-W error): torch must still import, and say it
        import sys

        print(f"RuntimeWarning: {msg}", file=sys.stderr)
