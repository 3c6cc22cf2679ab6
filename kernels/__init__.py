"""CUDA kernels for flash attention: sources, build, launch configuration, backends, and the
deploy-time ``attention`` (``kernels.attention``).

``attention`` (a function) and ``Attention`` (a class) live in ``kernels.deploy`` and are loaded
on first use, so ``import kernels`` loads no pycuda, torch or database code (a test checks).
``kernels.torch_op`` registers them with torch (``torch.library``) and imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernels.deploy import Attention, attention

__all__ = ["Attention", "attention"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("kernels.deploy"), name)
        globals()[name] = value  # found directly from now on
        return value
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
