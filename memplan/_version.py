"""The version of memplan, in a module of its own so that the plan's provenance can read it
without importing the package that imports the plan."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
