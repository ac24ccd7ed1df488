"""The ``rankwatch`` command line: one module per command, shared options and parser."""

from .main import main

__all__ = ["main"]
