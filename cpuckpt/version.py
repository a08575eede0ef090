"""The package version, alone in a module so that any layer can read it without importing the package."""

__all__ = ["__version__"]

__version__ = "0.1.0"
