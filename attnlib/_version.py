"""attnlib's version, in a module of its own so that no part needs the package root for it."""

__version__ = "0.1.0"
