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
        if _unbuilt_checkout():
            return  # `import torch` from a source checkout's root: its portable_zip has no extension, by design
        import warnings

        warnings.warn(f"portable_zip: the 'pz' torch.distributed backend is not registered: {type(e).__name__}: {e}",
                      RuntimeWarning, stacklevel=2)


def _unbuilt_checkout() -> bool:
    """portable_zip resolved to a folder without its built extension (a checkout on sys.path)."""
    import glob
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("portable_zip")
    except (ImportError, ValueError):
        return False
    path = os.path.dirname(spec.origin or "") if spec is not None else ""
    return bool(path) and not glob.glob(os.path.join(path, "_C*"))
