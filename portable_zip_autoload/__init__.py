"""Registers the "pz" torch.distributed backend when torch is imported.

torch loads the "torch.backends" entry points at the end of `import torch`
(unless TORCH_DEVICE_BACKEND_AUTOLOAD=0), and turns any error there into a
failure of `import torch` itself. So this package is tiny and never raises:
if portable_zip cannot be imported, it warns, and `import portable_zip`
later gives the real error."""


def register() -> None:
    try:
        import portable_zip  # noqa: F401  (portable_zip.c10d registers the backend)
    except Exception as e:  # noqa: BLE001 - torch must import whatever happens here
        import warnings

        warnings.warn(f"portable_zip: the 'pz' torch.distributed backend is not registered: {type(e).__name__}: {e}",
                      RuntimeWarning, stacklevel=2)
