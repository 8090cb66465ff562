"""The package version, in one place (pyproject.toml holds the same)."""
__version__ = "0.1.0"
