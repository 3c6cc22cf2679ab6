"""Inputs, storage and the pass rule of a problem's dtype.

Inputs are random normal values rounded to the dtype (float16 natively,
bfloat16 as uint16 bit patterns, ``kernels.bfloat16``); the float64 reference
is computed from the *rounded* inputs, so a kernel is judged on its own
arithmetic, not on the input rounding.

Half types follow FlashAttention's tests: a kernel passes when
``max|out - ref| <= 2 * max|sdpa - ref| + floor``, with ``sdpa`` torch's
``scaled_dot_product_attention`` on the same inputs in the same dtype (torch
imported lazily, only if installed). Without torch the limit is
``FALLBACK_TOLERANCE``.

float32 depends on the problem's precision:

* ``tf32x3`` (the default): the same rule against torch's float32 SDPA (its
  error on the sampled rows), with a floor of ``FLOOR["float32"]``, capped by the
  seed's absolute 1e-3. float32-class kernels (FFMA, 3xTF32) err by about 1e-6
  on unit-normal inputs; one TF32 pass errs by about 1e-3 and fails, which is
  the point: a plan that passes here gives float32-class answers.
* ``tf32``: one TF32 pass rounds Q, K, P and V to 11 significant bits. The
  limit is FlashAttention's rule with that arithmetic as the peer: twice the
  error of a float64 attention whose Q, K, P and V are rounded to TF32 exactly
  as the kernel rounds them (``tf32_emulation_error``), plus half a TF32 ulp
  of 1.0 (``TF32_FLOOR``).

Variants (``kernels.attention_variants``): a sliding window is a boolean mask, as causal
masking is, so torch's SDPA stays the peer. Softcap, ALiBi and sinks are not: SDPA takes a
bias only in the inputs' dtype (a softcap's correction of a logit in the hundreds, rounded to
bfloat16, errs by more than the whole kernel), so their peer is the arithmetic of a flash
kernel emulated on the CPU (``flash_peer_error``: float32 logits and statistics from the
rounded inputs, P rounded to the dtype before P V, the output rounded to the dtype; float32
problems round nothing). The rule is the same: twice the peer's error plus the floor.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from kernels.attention_variants import VariantValues, transform_logits, visible_keys
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
FLOOR = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-20}
#: float32's floor is 8 float32 ulps of 1.0 (2**-20, about 1e-6) rather than half
#: of one: the kernels' exp2 is the SFU's ex2.approx (2 ulps), 3xTF32 keeps about
#: 22 of float32's 24 significant bits, and torch's error on sampled rows can
#: be a few 1e-7, so half an ulp would fail float32-class kernels on rounding
#: noise. It stays three orders of magnitude below one TF32 pass's error.
#: one TF32 pass: half an ulp of 1.0 with 10 explicit significand bits
TF32_FLOOR = 2.0**-11
#: Without torch: outputs of unit-normal inputs are convex combinations of V rows,
#: so |out| stays below ~4 up to head_dim 256; the output's own rounding costs
#: half an ulp there (bf16 2**-9 * 4 = 8e-3, fp16 2**-12 * 4 = 1e-3), and the
#: probabilities rounded to the dtype before P.V add about as much again (their
#: errors are independent, so they grow with sqrt(keys), not keys). The limits
#: leave about 2x over that sum.
FALLBACK_TOLERANCE = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 2.0**-18}
#: float32 without torch: 2**-18 (3.8e-6) is about ten times the float32-class
#: errors measured on the H200 (4.4e-7 at 1x1x4096x128, tiled) and still a
#: fiftieth of a one-pass TF32 error (about 2e-4 at 300 keys x 64 on unit normals,
#: ``tests/test_precision_float32.py``), so the fallback keeps the two classes apart too.


def storage_type(dtype: str) -> type[np.generic]:
    return STORAGE[dtype]


def to_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to ``dtype``, in its storage type."""
    if dtype == "bfloat16":
        return to_bfloat16(values)
    return np.asarray(values, dtype=STORAGE[dtype])


def from_storage(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values (any of ``STORAGE``) as float32, exactly: every bfloat16, float16
    and float32 value is a float32 value. Not float64: a whole output of a large
    problem (32M elements at 4x16x4096x128) would take 256 MB and about half a second
    per measured plan to convert; the parity check widens only the rows it compares."""
    if dtype == "bfloat16":
        return from_bfloat16(stored)
    return np.asarray(stored).astype(np.float32)


def random_inputs(
    problem: Problem, rng: np.random.Generator, spread: float = 1.0
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """(q, k, v in storage type, q, k, v as float32 values of the rounded inputs);
    q ``[batch*heads, seq_len, head_dim]``, k and v ``[batch*kv_heads, kv_len, head_dim]``.
    q and k are normal with standard deviation ``spread`` (the scaled logits ``spread**2``),
    v standard normal."""
    shape = (problem.batch_heads, problem.seq_len, problem.head_dim)
    kv_shape = (problem.batch_kv_heads, problem.kv_len, problem.head_dim)
    drawn = [rng.standard_normal(s, dtype=np.float32) for s in (shape, kv_shape, kv_shape)]
    if spread != 1.0:
        drawn[0] *= np.float32(spread)
        drawn[1] *= np.float32(spread)
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
    variants: VariantValues | None = None,
) -> float | None:
    """max|peer - reference| on the sampled heads and rows, in the problem's dtype: torch's
    SDPA (None without torch), or for softcap, ALiBi and sinks ``flash_peer_error``."""
    variants = VariantValues.of(problem) if variants is None else variants
    if needs_flash_peer(variants):
        return flash_peer_error(problem, q, k, v, expected, heads, rows, variants)
    if not torch_available():
        return None
    import torch

    if problem.dtype == "float32":
        return _sdpa_rows_error(torch, problem, q, k, v, expected, heads, rows, variants)

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[problem.dtype]

    def tensor(values: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values[rows])).to(dtype)

    kv_heads = heads // problem.group  # the KV head each sampled query head reads
    # Bottom-right aligned, as the kernels: torch's is_causal is top-left for kv_len > seq_len.
    mask = _visible_mask(torch, problem, np.arange(problem.seq_len), variants)
    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(
            tensor(q, heads), tensor(k, kv_heads), tensor(v, kv_heads), attn_mask=mask,
            scale=variants.scale,
        )
    got = np.nan_to_num(out.to(torch.float64).numpy()[:, rows])  # rows that see no key: 0
    return float(np.abs(got - expected).max()) if expected.size else 0.0


def _visible_mask(
    torch: Any, problem: Problem, rows: np.ndarray, variants: VariantValues
) -> Any:
    """The boolean mask of causal masking and the window for ``rows``; None when there is
    neither."""
    if not (problem.causal or problem.windowed):
        return None
    seen = visible_keys(
        rows,
        problem.kv_len,
        problem.causal_offset,
        problem.causal,
        variants.window_left,
        variants.window_right,
    )
    return torch.from_numpy(seen)


def _sdpa_rows_error(
    torch: Any,
    problem: Problem,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    expected: np.ndarray,
    heads: np.ndarray,
    rows: np.ndarray,
    variants: VariantValues,
) -> float:
    """float32: torch's SDPA on the sampled query rows only (an explicit mask stands in
    for causal), so a 32768-key check costs the sampled rows, not the whole head."""
    if not expected.size:
        return 0.0
    kv_heads = heads // problem.group  # the KV head each sampled query head reads
    mask = _visible_mask(torch, problem, rows, variants)  # bottom-right aligned, as the kernels

    def tensor(values: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(
            tensor(q[heads][:, rows]), tensor(k[kv_heads]), tensor(v[kv_heads]), attn_mask=mask,
            scale=variants.scale,
        )
    got = np.nan_to_num(out.to(torch.float64).numpy())  # rows that see no key: 0
    return float(np.abs(got - expected).max())


def needs_flash_peer(variants: VariantValues) -> bool:
    """Whether torch's SDPA cannot be the peer: softcap, ALiBi or sinks (module doc)."""
    return variants.softcap > 0 or variants.alibi_slopes is not None or variants.sinks is not None


def flash_peer_error(
    problem: Problem,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    expected: np.ndarray,
    heads: np.ndarray,
    rows: np.ndarray,
    variants: VariantValues | None = None,
) -> float:
    """max|peer - reference| on the sampled rows, the peer being a flash kernel's own
    arithmetic: float32 logits, variants and softmax statistics from the rounded inputs, P
    rounded to the dtype before P V (accumulated in float32), the output rounded to the dtype.
    For float32 nothing is rounded: float32 arithmetic throughout."""
    def to_dtype(values: np.ndarray) -> np.ndarray:
        if problem.dtype == "float32":
            return values.astype(np.float32)
        return from_storage(to_storage(values.astype(np.float32), problem.dtype), problem.dtype)

    return _emulated_error(
        problem, q, k, v, expected, heads, rows, variants, np.float32,
        round_operands=lambda values: values, round_p=to_dtype, round_out=to_dtype,
    )


def round_to_tf32(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 as the kernel does (to nearest, ties away from
    zero: half a TF32 ulp added to the bit pattern, the 13 low bits cleared)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def tf32_emulation_error(
    problem: Problem,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    expected: np.ndarray,
    heads: np.ndarray,
    rows: np.ndarray,
    variants: VariantValues | None = None,
) -> float:
    """max|tf32 attention - reference| on the sampled rows: float64 attention whose Q
    and K (before the product) and P and V (before the second) are rounded to TF32;
    the row sums use the unrounded P, as the kernel's do."""
    def p_to_tf32(p: np.ndarray) -> np.ndarray:
        return round_to_tf32(p.astype(np.float32)).astype(np.float64)

    return _emulated_error(
        problem, q, k, v, expected, heads, rows, variants, np.float64,
        round_operands=round_to_tf32, round_p=p_to_tf32, round_out=lambda values: values,
    )


def _emulated_error(
    problem: Problem,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    expected: np.ndarray,
    heads: np.ndarray,
    rows: np.ndarray,
    variants: VariantValues | None,
    work: type[np.floating],
    *,
    round_operands: Callable[[np.ndarray], np.ndarray],
    round_p: Callable[[np.ndarray], np.ndarray],
    round_out: Callable[[np.ndarray], np.ndarray],
) -> float:
    """max|emulated attention - reference| on the sampled rows: logits and softmax in
    ``work`` (the variants applied as the reference applies them), Q, K and V through
    ``round_operands``, P through ``round_p`` before P V, the output through ``round_out``."""
    if not expected.size:
        return 0.0
    variants = VariantValues.of(problem) if variants is None else variants
    worst = 0.0
    seen = visible_keys(
        rows, problem.kv_len, problem.causal_offset, problem.causal,
        variants.window_left, variants.window_right,
    )
    for index, head in enumerate(heads):
        kv_head = head // problem.group  # grouped-query attention
        q_rows = round_operands(q[head][rows]).astype(work)
        k_head = round_operands(k[kv_head]).astype(work)
        if variants.scale is None:
            scores = q_rows @ k_head.T / work(math.sqrt(problem.head_dim))
        else:
            scores = q_rows @ k_head.T * work(variants.scale)
        scores = transform_logits(scores, rows, problem.causal_offset, int(head), variants)
        scores = np.where(seen, scores, -np.inf)
        top = scores.max(axis=-1)
        sink = variants.sink(int(head))
        if sink is not None:
            top = np.maximum(top, work(sink))
        shift = np.where(np.isfinite(top), top, 0).astype(work)
        p = np.exp(scores - shift[:, None])
        total = p.sum(axis=-1)
        if sink is not None:
            total = total + np.exp(work(sink) - shift)
        v_head = round_operands(v[kv_head]).astype(work)
        out = (round_p(p).astype(work) @ v_head) / np.where(total > 0, total, 1)[:, None]
        worst = max(worst, float(np.abs(round_out(out) - expected[index]).max()))
    return worst


def float32_tolerance(
    problem: Problem, sdpa_max_error: float | None, tf32_max_error: float | None = None
) -> float:
    """float32's limit under the problem's precision (see the module docstring)."""
    if problem.fast_tf32:
        if tf32_max_error is None:
            raise ValueError("precision=tf32 needs the TF32 emulation's error")
        return 2 * tf32_max_error + TF32_FLOOR
    if sdpa_max_error is None:
        return FALLBACK_TOLERANCE["float32"]
    return min(FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS, 2 * sdpa_max_error + FLOOR["float32"])


def tolerance_for(
    problem: Problem, sdpa_max_error: float | None, tf32_max_error: float | None = None
) -> float:
    """The absolute limit on max|out - ref| for ``problem`` (see the module docstring)."""
    if problem.dtype == "float32":
        return float32_tolerance(problem, sdpa_max_error, tf32_max_error)
    if sdpa_max_error is None:
        return FALLBACK_TOLERANCE[problem.dtype]
    return 2 * sdpa_max_error + FLOOR[problem.dtype]


# ---------------------------------------------------------------------------- gradients
#
# The backward pass is judged the way FlashAttention's tests judge theirs: per gradient
# (dQ, dK, dV, and the sinks' gradient where there are sinks),
#     max|grad - ref| <= 2 * max|torch grad - ref| + floor,
# ``ref`` the float64 gradients of the same rounded inputs (``kernels.reference.
# attention_backward_reference``) and ``torch grad`` those of an eager torch attention run
# in the problem's dtype with autograd (FlashAttention's ``attention_ref`` without upcast:
# scores, softmax and products in the dtype; ``torch_gradient_errors``). As the forward's, the
# floor is half an ulp of the dtype, here at the gradient's own scale: gradients are not O(1)
# (a causal dV row sums P over up to seq_len queries), so the floor is FLOOR[dtype] times
# max(1, max|ref|), the last rounding a kernel cannot beat. Without torch the limit is
# FALLBACK_GRADIENT_RELATIVE[dtype] times the same scale.

#: the gradients a backward pass produces, in the order they are reported
GRADIENTS = ("dq", "dk", "dv", "d_sinks")
#: without torch: about 4x the errors the half kernels show on unit normals (bf16 dQ/dK/dV
#: within 2-3 ulps of max|ref|, the CPU emulation of mma_f16_bwd)
FALLBACK_GRADIENT_RELATIVE = {"bfloat16": 2.0**-5, "float16": 2.0**-8}


def gradient_scale(reference: np.ndarray) -> float:
    """max(1, max|ref|): the magnitude a gradient's floor is relative to."""
    return max(1.0, float(np.abs(reference).max())) if reference.size else 1.0


def gradient_tolerances(
    problem: Problem,
    references: dict[str, np.ndarray],
    peer_errors: dict[str, float] | None,
) -> dict[str, float]:
    """The limit on max|grad - ref| for each gradient in ``references`` (see above)."""
    limits = {}
    for name, reference in references.items():
        scale = gradient_scale(reference)
        if peer_errors is None:
            limits[name] = FALLBACK_GRADIENT_RELATIVE[problem.dtype] * scale
        else:
            limits[name] = 2 * peer_errors[name] + FLOOR[problem.dtype] * scale
    return limits


def torch_gradient_errors(
    problem: Problem,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dout: np.ndarray,
    references: dict[str, np.ndarray],
    kv_heads: np.ndarray,
    alibi_slopes: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
) -> dict[str, float] | None:
    """max|torch grad - ref| per gradient of ``references`` (their float64 values on the query
    heads of the batch-KV-heads ``kv_heads``), torch's autograd of an eager attention in the
    problem's dtype on the CPU; None without torch."""
    if not torch_available():
        return None
    import torch

    from kernels.attention_variants import problem_visible_keys

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[problem.dtype]
    p, group = problem, problem.group
    rows = np.arange(p.seq_len)
    visible = problem_visible_keys(p, rows)
    keep = None if visible is None else torch.from_numpy(visible)
    grads: dict[str, list[np.ndarray]] = {name: [] for name in ("dq", "dk", "dv", "d_sinks")}
    for kv in np.asarray(kv_heads).reshape(-1):
        heads = kv * group + np.arange(group)

        def leaf(values: np.ndarray) -> Any:
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)

        qt = leaf(q[heads]).requires_grad_()
        kt = leaf(k[kv][None]).requires_grad_()
        vt = leaf(v[kv][None]).requires_grad_()
        scores = (qt * (1 / math.sqrt(p.head_dim))) @ kt.transpose(-1, -2)
        if p.softcap > 0:
            scores = p.softcap * torch.tanh(scores / p.softcap)
        if p.alibi:
            distance = np.abs(rows[:, None] + p.causal_offset - np.arange(p.kv_len)[None, :])
            slopes = alibi_slopes[heads % p.heads][:, None, None]  # type: ignore[index]
            scores = scores - torch.from_numpy((slopes * distance).astype(np.float32)).to(dtype)
        if keep is not None:
            scores = scores.masked_fill(~keep, -1e4)  # finite: rows that see nothing stay finite
        sink = None
        if p.sinks:
            sink = leaf(sinks[heads % p.heads]).requires_grad_()  # type: ignore[index]
            column = sink[:, None, None].expand(group, p.seq_len, 1)
            scores = torch.cat([scores, column], dim=-1)
        weights = torch.softmax(scores, dim=-1)
        if sink is not None:
            weights = weights[..., :-1]
        if keep is not None:
            weights = weights * keep.to(dtype)
        out = weights @ vt
        out.backward(leaf(dout[heads]))
        grads["dq"].append(qt.grad.double().numpy())
        grads["dk"].append(kt.grad.double().numpy()[0])
        grads["dv"].append(vt.grad.double().numpy()[0])
        if sink is not None:
            grads["d_sinks"].append(sink.grad.double().numpy())
    errors = {}
    for name, reference in references.items():
        if name == "d_sinks":  # every KV head was given: the per-head sums over the batch
            got = np.concatenate(grads[name]).reshape(p.batch, p.heads).sum(axis=0)
        else:
            got = np.stack(grads[name]).reshape(reference.shape)
        errors[name] = float(np.abs(got - reference).max()) if reference.size else 0.0
    return errors
