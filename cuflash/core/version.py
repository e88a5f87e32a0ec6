"""The package version (one place: the tuning cache keys by it)."""

__version__ = "0.1.0"
