"""LEGACY import path of `VllmCore` (engined/core/legacy.py), kept for the daemon.

Removed with legacy.py when the shell builds `engined.core.engine.Engine` itself (issue 11,
phase B). The scheduler proper is engined/core/scheduling.py.
"""

from engined.core.legacy import VllmCore

__all__ = ["VllmCore"]
