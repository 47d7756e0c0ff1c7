"""Code generation: target registry and per-target packages (cpu/ today)."""
from .targets import TARGETS, Target, get_target

__all__ = ["TARGETS", "Target", "get_target"]
