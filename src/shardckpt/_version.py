"""The package's version (a leaf: every layer may import it without importing the package root)."""

__version__ = "0.1.0"
