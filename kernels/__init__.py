"""CUDA kernels for flash attention: sources, build, launch configuration, backends, and the
deploy-time ``attention`` (``kernels.attention``).

``attention`` and ``Attention`` are loaded on first use, so ``import kernels`` loads no pycuda,
torch or database code (a test checks). ``kernels.attention`` is the submodule, made callable:
``kernels.attention(q, k, v, causal=True)`` calls the function of the same name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernels import attention
    from kernels.attention import Attention

__all__ = ["Attention", "attention"]


def __getattr__(name: str) -> Any:
    if name == "attention":
        # The submodule itself (callable): importing it binds this name to it anyway.
        return importlib.import_module("kernels.attention")
    if name == "Attention":
        return importlib.import_module("kernels.attention").Attention
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
