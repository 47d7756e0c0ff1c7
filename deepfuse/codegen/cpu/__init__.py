"""The CPU target: fused graph -> launch plan of torch kernels (see kernels.py)."""
from .executor import CpuExecutor
from .kernels import FACTORIES
from .plan import build_plan

__all__ = ["FACTORIES", "CpuExecutor", "build_plan"]
