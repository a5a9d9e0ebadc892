"""gradtrace's version, importable without torch (``gradtrace --version``)."""

__version__ = "0.1.0"
