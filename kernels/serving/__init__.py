"""Serving batches: ragged queries against a paged (or ragged) KV cache, planned on the host
and run on the GPU (``BatchAttention``: ``plan`` outside a CUDA graph, ``run`` inside).

``BatchAttention`` (``kernels.serving.batch_attention``) imports torch and is loaded on first
use, so ``import kernels.serving`` (and its ``checks``) loads neither torch nor pycuda.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernels.serving.batch_attention import BatchAttention
    from kernels.serving.checks import ServingInputError, ServingInputTypeError

__all__ = ["BatchAttention", "ServingInputError", "ServingInputTypeError"]
_HOMES = {
    "BatchAttention": "kernels.serving.batch_attention",
    "ServingInputError": "kernels.serving.checks",
    "ServingInputTypeError": "kernels.serving.checks",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kernels.serving' has no attribute {name!r}")
