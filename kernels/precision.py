"""Inputs, storage and the pass rule of a problem's dtype.

Inputs are random normal values rounded to the dtype (float16 natively,
bfloat16 as uint16 bit patterns, ``kernels.bfloat16``); the float64 reference
is computed from the *rounded* inputs, so a kernel is judged on its own
arithmetic, not on the input rounding.

float32 keeps the seed's absolute 1e-3. Half types follow FlashAttention's
tests: a kernel passes when ``max|out - ref| <= 2 * max|sdpa - ref| + floor``,
with ``sdpa`` torch's ``scaled_dot_product_attention`` on the same inputs in
the same dtype (torch imported lazily, only if installed). Without torch the
limit is ``FALLBACK_TOLERANCE``.
"""

from __future__ import annotations

import importlib.util

import numpy as np

from kernels.bfloat16 import from_bfloat16, to_bfloat16
from tuner.planner.seed import FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
from tuner.problem import Problem

#: numpy type the device buffers of each dtype are read and written as
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
#: a quiet NaN of each storage type: outputs are filled with it before a run
NAN_PATTERN = {"float32": 0x7FC00000, "float16": 0x7E00, "bfloat16": 0x7FC0}
#: FlashAttention's floor: the dtype's own rounding of values near 1 (half an
#: ulp of 1.0: 2**-8 for bfloat16's 8 significant bits, 2**-11 for float16's 11),
#: so a kernel is never asked to beat the output's last rounding.
FLOOR = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
#: Without torch: outputs of unit-normal inputs are convex combinations of V rows,
#: so |out| stays below ~4 up to head_dim 256; the output's own rounding costs
#: half an ulp there (bf16 2**-9 * 4 = 8e-3, fp16 2**-12 * 4 = 1e-3), and the
#: probabilities rounded to the dtype before P.V add about as much again (their
#: errors are independent, so they grow with sqrt(keys), not keys). The limits
#: leave about 2x over that sum.
FALLBACK_TOLERANCE = {"bfloat16": 2e-2, "float16": 4e-3}


def storage_type(dtype: str) -> type[np.generic]:
    return STORAGE[dtype]


def to_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to ``dtype``, in its storage type."""
    if dtype == "bfloat16":
        return to_bfloat16(values)
    return np.asarray(values, dtype=STORAGE[dtype])


def from_storage(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values (any of ``STORAGE``) as float64."""
    if dtype == "bfloat16":
        return from_bfloat16(stored).astype(np.float64)
    return np.asarray(stored).astype(np.float64)


def random_inputs(
    problem: Problem, rng: np.random.Generator
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """(q, k, v in storage type, q, k, v as float32 values of the rounded inputs);
    q ``[batch*heads, seq_len, head_dim]``, k and v ``[batch*kv_heads, kv_len, head_dim]``."""
    shape = (problem.batch_heads, problem.seq_len, problem.head_dim)
    kv_shape = (problem.batch_kv_heads, problem.kv_len, problem.head_dim)
    drawn = [rng.standard_normal(s, dtype=np.float32) for s in (shape, kv_shape, kv_shape)]
    stored = tuple(to_storage(x, problem.dtype) for x in drawn)
    values = tuple(
        x if problem.dtype == "float32" else from_storage(s, problem.dtype).astype(np.float32)
        for x, s in zip(drawn, stored, strict=True)
    )
    return stored, values


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def sdpa_error(
    problem: Problem,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    expected: np.ndarray,
    heads: np.ndarray,
    rows: np.ndarray,
) -> float | None:
    """max|torch sdpa - reference| on the sampled heads and rows, in the problem's dtype;
    None without torch."""
    if not torch_available():
        return None
    import torch

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[problem.dtype]

    def tensor(values: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values[rows])).to(dtype)

    kv_heads = heads // problem.group  # the KV head each sampled query head reads
    mask = None
    if problem.causal:
        # Bottom-right aligned, as the kernels: torch's is_causal is top-left for kv_len > seq_len.
        mask = torch.ones(problem.seq_len, problem.kv_len, dtype=torch.bool).tril(
            problem.causal_offset
        )
    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(
            tensor(q, heads), tensor(k, kv_heads), tensor(v, kv_heads), attn_mask=mask
        )
    got = out.to(torch.float64).numpy()[:, rows]
    return float(np.abs(got - expected).max()) if expected.size else 0.0


def tolerance_for(problem: Problem, sdpa_max_error: float | None) -> float:
    """The absolute limit on max|out - ref| for ``problem`` (see the module docstring)."""
    if problem.dtype == "float32":
        return FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
    if sdpa_max_error is None:
        return FALLBACK_TOLERANCE[problem.dtype]
    return 2 * sdpa_max_error + FLOOR[problem.dtype]
