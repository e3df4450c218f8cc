"""The engine: one model on one device running many sequence coroutines. `Engine` (facade.py)
composes the roles: intake (admission), core (the step loop), outputs (stops, detokenizing),
swap (host KV), migration (suspend / resume) and report (load, stats, progress figures).
"""
from __future__ import annotations

from .device import device_class
from .facade import Engine

__all__ = ["Engine", "device_class"]
