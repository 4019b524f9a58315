"""pcppass's version, apart from the package so that modules below ``pcppass/__init__.py`` (the
rewrite's cache key) can read it without importing the whole public API."""

__version__ = "0.1.0"
