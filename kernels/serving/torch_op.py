"""``BatchAttention.run`` as a torch custom op, so ``torch.compile`` traces a model calling it.

``flash_attention_tuner::serving_attention_into(q, k_cache, v_cache, out, handle) -> ()``
fills ``out`` (declared mutated) with the attention of the batch planned on the
``BatchAttention`` whose ``handle`` it is (an op takes values torch knows: the plan object
itself cannot be an argument). Plan outside the compiled region, as outside a CUDA graph.
The fake implementation checks shapes and dtypes only (no storage, no plan needed).
"""

from __future__ import annotations

import torch

from kernels.attention_args import AttentionInputError

NAMESPACE = "flash_attention_tuner"


@torch.library.custom_op(
    f"{NAMESPACE}::serving_attention_into", mutates_args=("out",), device_types="cuda"
)
def serving_attention_into(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, handle: int
) -> None:
    from kernels.serving.batch_attention import instance

    instance(handle).run(q, k_cache, v_cache, out)


@serving_attention_into.register_fake
def _serving_attention_into_fake(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, handle: int
) -> None:
    if q.dim() != 3 or tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
        raise AttentionInputError(
            f"out has shape {list(out.shape)} ({out.dtype}); expected q's {list(q.shape)} "
            f"({q.dtype}), q [total_q, heads, head_dim]"
        )
    if k_cache.dtype != q.dtype or v_cache.shape != k_cache.shape or k_cache.dim() not in (3, 4):
        raise AttentionInputError(
            "k_cache and v_cache must share a shape ([pages, page_size, kv_heads, head_dim] or "
            "[rows, kv_heads, head_dim]) and q's dtype"
        )
