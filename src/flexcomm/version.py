"""The package version, in one place (the hook exchanges it in its configuration fingerprint)."""

__version__ = "0.1.0"
