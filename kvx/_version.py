"""The kvx release version (single source for pyproject and `kvx.__version__`)."""

__version__ = "0.1.0"
