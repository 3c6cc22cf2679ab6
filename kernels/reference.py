"""CPU references: exact float64 attention, and numpy emulations of the CUDA kernels.

``attention_reference`` is the ground truth parity checks compare against.
``reference_rows`` computes only chosen rows of chosen heads, so checking a
4x16x4096x128 output costs milliseconds. ``emulate_tiled`` replays the tiled
kernel's algorithm with exactly a plan's partition (key tiles, splits,
log2-domain online softmax, the -inf handling, the split merge), so the
algorithm is tested on the CPU before any GPU runs it; ``emulate_scalar``
does the same for the scalar kernel (the online update with one-key tiles).
``attention_backward_reference`` is the float64 forward and backward (dQ, dK, dV, the sinks'
gradient) of a problem with its mask, softcap, ALiBi and sinks, on chosen KV heads.

Arrays are ``[batch*heads, seq_len, head_dim]`` (any leading dimensions are
accepted and kept). The references also take grouped-query and KV-cache
inputs: k and v ``[batch*kv_heads, kv_len, head_dim]``, query head ``h`` reading
KV head ``h // group``, causal masking bottom-right aligned (row ``r`` sees keys
``k <= r + kv_len - seq_len``); the emulations are self-attention only.

Both know every variant (sliding window, softcap, ALiBi, sinks, a scale of the caller's),
given as ``kernels.attention_variants.VariantValues`` and applied as that module says; the
float64 reference also returns each row's natural-log log-sum-exp when asked (``lse=True``),
what a backward pass needs from the forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kernels.attention_variants import (
    LOG2E,
    VariantValues,
    problem_visible_keys,
    transform_logits,
    visible_keys,
)
from tuner.planner.launches import scale_log2
from tuner.problem import UNBOUNDED

if TYPE_CHECKING:
    from tuner.planner.plan import KernelPlan
    from tuner.problem import Problem

FloatArray = npt.NDArray[np.floating]
#: scores of one chunk of rows are kept below this many float64s (about 32 MiB)
_CHUNK_ELEMENTS = 1 << 22
#: plain attention: no window, softcap, ALiBi or sinks, the default scale
PLAIN = VariantValues()


def _heads_view(array: npt.ArrayLike) -> np.ndarray:
    values = np.asarray(array)
    if values.ndim < 2:
        raise ValueError(f"expected [..., seq_len, head_dim], got shape {values.shape}")
    return values.reshape(-1, *values.shape[-2:])


def _check_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v shapes differ: {q.shape}, {k.shape}, {v.shape}")


def _check_kv_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray, group: int) -> None:
    if k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0] * group:
        raise ValueError(
            f"q {q.shape} with k {k.shape}, v {v.shape}: k and v must share a shape, with "
            f"q's head_dim and q's heads / {group} heads"
        )


def _softmax_rows(
    q_rows: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    rows: np.ndarray,
    causal: bool,
    causal_offset: int = 0,
    head: int = 0,
    variants: VariantValues = PLAIN,
) -> tuple[np.ndarray, np.ndarray]:
    """(output, natural-log LSE) of the given query rows of one head, in float64, with every
    variant (``kernels.attention_variants``, in its order).

    Causal: row ``r`` sees keys ``k <= r + causal_offset`` (``kv_len - seq_len``). ``head``:
    the flattened (batch, query head) index, for the per-head slopes and sinks.
    """
    scores = (q_rows @ k.T) * variants.scale_for(q_rows.shape[-1])
    scores = transform_logits(scores, rows, causal_offset, head, variants)
    if causal or variants.window_left != UNBOUNDED or variants.window_right != UNBOUNDED:
        seen = visible_keys(
            rows, k.shape[0], causal_offset, causal, variants.window_left, variants.window_right
        )
        scores = np.where(seen, scores, -np.inf)
    top = scores.max(axis=-1, initial=-np.inf)
    sink = variants.sink(head)
    if sink is not None:
        top = np.maximum(top, sink)
    # A row that sees no key (and has no sink) keeps max -inf: shifting by 0 keeps
    # exp(-inf) = 0 and its output 0, instead of inf - inf = NaN.
    shift = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(scores - shift[:, None])
    total = weights.sum(axis=-1)
    if sink is not None:
        total = total + np.exp(sink - shift)
    out = (weights @ v) / np.where(total > 0, total, 1.0)[:, None]
    lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1.0)), np.inf)
    return out, lse


def reference_rows(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    causal: bool,
    heads_idx: npt.ArrayLike,
    rows_idx: npt.ArrayLike,
    group: int = 1,
    variants: VariantValues | None = None,
    *,
    lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """float64 attention output for rows ``rows_idx`` of heads ``heads_idx``: ``[H, R, D]``;
    with ``lse``, also each row's natural-log log-sum-exp ``[H, R]`` (sinks included).

    ``group``: query heads per KV head (k and v have ``heads / group`` heads). ``variants``:
    window, softcap, ALiBi slopes, sinks and scale (``kernels.attention_variants``); the
    heads of ``heads_idx`` are flattened (batch, query head) indices, so slopes and sinks of
    ``[heads]`` are indexed by ``head % heads``.
    """
    variants = PLAIN if variants is None else variants
    q3, k3, v3 = _heads_view(q), _heads_view(k), _heads_view(v)
    _check_kv_shapes(q3, k3, v3, group)
    heads = np.asarray(heads_idx, dtype=np.int64).reshape(-1)
    rows = np.asarray(rows_idx, dtype=np.int64).reshape(-1)
    n, d = q3.shape[1:]
    kv_len = k3.shape[1]
    out = np.empty((heads.size, rows.size, d), dtype=np.float64)
    sums = np.empty((heads.size, rows.size), dtype=np.float64)
    chunk = max(1, _CHUNK_ELEMENTS // max(kv_len, 1))
    for slot, head in enumerate(heads):
        k64 = k3[head // group].astype(np.float64)
        v64 = v3[head // group].astype(np.float64)
        for start in range(0, rows.size, chunk):
            part = rows[start : start + chunk]
            out[slot, start : start + chunk], sums[slot, start : start + chunk] = _softmax_rows(
                q3[head, part].astype(np.float64),
                k64,
                v64,
                part,
                causal,
                kv_len - n,
                int(head),
                variants,
            )
    return (out, sums) if lse else out


def attention_reference(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    causal: bool,
    group: int = 1,
    variants: VariantValues | None = None,
    *,
    lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Exact float64 attention, ``softmax(q k^T / sqrt(d)) v`` with ``variants``, shaped like
    ``q``; with ``lse``, also the natural-log log-sum-exp of each row (q's shape less
    head_dim)."""
    q_in = np.asarray(q)
    q3 = _heads_view(q_in)
    out, sums = reference_rows(
        q3, k, v, causal, np.arange(q3.shape[0]), np.arange(q3.shape[1]), group, variants,
        lse=True,
    )
    out = out.reshape(q_in.shape)
    return (out, sums.reshape(q_in.shape[:-1])) if lse else out


# ---------------------------------------------------------------------------- emulation


def _online_partials(
    q_scaled: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    causal: bool,
    key_begin: int,
    key_end: int,
    tile_size: int,
    variants: VariantValues = PLAIN,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One split's (max, sum, unnormalised accumulator) for every row, as the kernel keeps them.

    Vectorised over heads and all row blocks at once: a row block's causal
    key bound (``row0 + rows_per_block``) is implied by the per-row mask
    ``key <= query``, and a tile whose keys are all masked leaves (max, sum,
    acc) unchanged exactly (correction 1, or 0 times zeros), so running every
    tile for every block gives the kernel's values. So do a window's bounds. In the
    log2 domain the softcap is ``softcap * log2(e)`` and the ALiBi slopes are scaled
    by ``log2(e)`` alike (the same logits in base two).
    """
    heads, n_rows, d = q_scaled.shape
    dtype = q_scaled.dtype
    n = k.shape[1]
    row_max = np.full((heads, n_rows), -np.inf, dtype=dtype)
    row_sum = np.zeros((heads, n_rows), dtype=dtype)
    acc = np.zeros((heads, n_rows, d), dtype=dtype)
    queries = np.arange(n_rows)
    zero = dtype.type(0)
    slopes = None
    if variants.alibi_slopes is not None:
        per_head = variants.alibi_slopes[np.arange(heads) % len(variants.alibi_slopes)]
        slopes = (per_head * LOG2E).astype(dtype)[:, None, None]
    for tile_start in range(key_begin, key_end, tile_size):
        keys = np.arange(tile_start, tile_start + tile_size)
        # Key rows past seq_len are loaded as zeros, then masked.
        k_tile = np.zeros((heads, tile_size, d), dtype=dtype)
        v_tile = np.zeros((heads, tile_size, d), dtype=dtype)
        present = keys < n
        k_tile[:, present] = k[:, keys[present]]
        v_tile[:, present] = v[:, keys[present]]
        valid = np.broadcast_to(keys[None, :] < key_end, (n_rows, tile_size))
        valid = valid & visible_keys(
            queries, tile_size, -tile_start, causal, variants.window_left, variants.window_right
        )
        raw = q_scaled @ k_tile.transpose(0, 2, 1)
        if variants.softcap > 0:
            cap = dtype.type(variants.softcap * LOG2E)
            raw = cap * np.tanh(raw / cap)
        if slopes is not None:
            raw = raw - slopes * np.abs(queries[:, None] - keys[None, :]).astype(dtype)
        score = np.where(valid, raw, -np.inf).astype(dtype)
        new_max = np.maximum(row_max, score.max(axis=-1))
        # A row that has seen only masked keys keeps max -inf: shifting by 0
        # keeps exp2(-inf) = 0 and avoids inf - inf = NaN, as the kernel does.
        shift = np.where(new_max == -np.inf, zero, new_max)
        correction = np.exp2(row_max - shift)
        p = np.exp2(score - shift[..., None])
        row_sum = row_sum * correction + p.sum(axis=-1, dtype=dtype)
        row_max = new_max
        acc = acc * correction[..., None] + p @ v_tile
    return row_max, row_sum, acc


def _merge_splits(maxes: np.ndarray, sums: np.ndarray, accs: np.ndarray) -> np.ndarray:
    """``split_merge``: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    dtype = accs.dtype
    merged_max = maxes.max(axis=0)
    shift = np.where(merged_max == -np.inf, dtype.type(0), merged_max)
    weights = np.exp2(maxes - shift[None])
    total = (weights * sums).sum(axis=0)
    value = (weights[..., None] * accs).sum(axis=0)
    inverse = np.where(total > 0, dtype.type(1) / np.where(total > 0, total, 1), 0).astype(dtype)
    return value * inverse[..., None]


def emulate_online(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    causal: bool,
    *,
    tile_size: int,
    keys_per_split: int,
    rows_per_block: int = 1,
    splits: int | None = None,
    dtype: npt.DTypeLike = np.float32,
    variants: VariantValues | None = None,
) -> np.ndarray:
    """The tiled kernel's algorithm for an explicit partition; see ``emulate_tiled``.

    ``splits`` defaults to the splits needed to cover the keys; a plan may
    launch more (empty splits only add zero-weight partials). ``variants`` as the
    reference takes them; the sinks join as one more partial per row (max the sink,
    sum 1, accumulator 0), which the split merge folds into the denominator only.
    """
    variants = PLAIN if variants is None else variants
    q_in = np.asarray(q)
    work = np.dtype(dtype)
    q3, k3, v3 = (_heads_view(a).astype(work) for a in (q, k, v))
    _check_shapes(q3, k3, v3)
    if tile_size <= 0 or keys_per_split <= 0 or rows_per_block <= 0:
        raise ValueError("tile_size, keys_per_split and rows_per_block must be > 0")
    heads, n, d = q3.shape
    # The kernel loads whole row blocks, zero-filling rows past seq_len; those
    # rows are computed and never written, so they are padded and dropped here.
    padded_rows = -(-n // rows_per_block) * rows_per_block
    q_scaled = np.zeros((heads, padded_rows, d), dtype=work)
    scale = scale_log2(d) if variants.scale is None else variants.scale * LOG2E
    q_scaled[:, :n] = q3 * work.type(scale)
    if splits is None:
        splits = max(1, -(-n // keys_per_split))
    partials = [
        _online_partials(
            q_scaled,
            k3,
            v3,
            causal,
            key_begin=min(n, s * keys_per_split),
            key_end=min(n, (s + 1) * keys_per_split),
            tile_size=tile_size,
            variants=variants,
        )
        for s in range(splits)
    ]
    if variants.sinks is not None:
        sinks = variants.sinks[np.arange(heads) % len(variants.sinks)] * LOG2E
        sink_max = np.broadcast_to(sinks.astype(work)[:, None], (heads, padded_rows))
        partials.append((sink_max, np.ones_like(sink_max), np.zeros_like(q_scaled)))
    if len(partials) == 1:
        row_max, row_sum, acc = partials[0]
        inverse = np.where(row_sum > 0, work.type(1) / np.where(row_sum > 0, row_sum, 1), 0)
        out = acc * inverse.astype(work)[..., None]
    else:
        out = _merge_splits(
            np.stack([p[0] for p in partials]),
            np.stack([p[1] for p in partials]),
            np.stack([p[2] for p in partials]),
        )
    return out[:, :n].reshape(q_in.shape)


def emulate_plan(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    causal: bool,
    plan: KernelPlan,
    dtype: npt.DTypeLike = np.float32,
    variants: VariantValues | None = None,
) -> np.ndarray:
    """A plan's kernel replayed in numpy with the partition its family follows.

    Row blocks of ``rows_per_block``, key tiles of ``tile_size``, splits of
    ``keys_per_sequence_split`` keys (one launch column each), then the split
    merge when there is more than one (``KernelFamily.online_partition``).
    ``dtype`` float32 mimics the kernel's arithmetic (up to summation order);
    float64 checks the algorithm itself. ``variants``: the plan's problem's (window,
    softcap) when None; its slopes and sinks must be given when it has them.
    """
    variants = VariantValues.of(plan.problem) if variants is None else variants
    partition = plan.kernel_family.online_partition(plan)
    return emulate_online(
        q,
        k,
        v,
        causal,
        tile_size=partition.tile_size,
        keys_per_split=partition.keys_per_split,
        rows_per_block=partition.rows_per_block,
        splits=partition.splits,
        dtype=dtype,
        variants=variants,
    )


#: ``emulate_plan`` under the name the tiled kernel's tests know
emulate_tiled = emulate_plan


def emulate_scalar(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    causal: bool,
    dtype: npt.DTypeLike = np.float32,
) -> np.ndarray:
    """``kernels/scalar_online.cu``: the same online update, one key at a time, no splits."""
    n = np.asarray(q).shape[-2]
    return emulate_online(q, k, v, causal, tile_size=1, keys_per_split=n, dtype=dtype)


# ---------------------------------------------------------------------------- backward


@dataclass(frozen=True)
class Gradients:
    """float64 attention of chosen heads and its gradients for a given dO.

    ``out``, ``lse`` (natural log, +inf for a row that sees nothing) and ``dq`` of the query
    heads ``heads``; ``dk`` and ``dv`` of the KV heads ``kv_heads`` (each summed over its
    group's query heads, all of which ``heads`` holds); ``d_sinks`` per query head of
    ``heads`` (this selection's share of the sum over the batch), or None without sinks.
    """

    heads: np.ndarray
    kv_heads: np.ndarray
    out: np.ndarray
    lse: np.ndarray
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    d_sinks: np.ndarray | None = None


def attention_backward_reference(
    problem: Problem,
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    dout: npt.ArrayLike,
    kv_heads: npt.ArrayLike | None = None,
    *,
    alibi_slopes: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
) -> Gradients:
    """Exact float64 forward and backward of ``problem`` (its mask, softcap, ALiBi and sinks)
    for the query heads of the batch-KV-heads ``kv_heads`` (default: all).

    q, dout ``[batch * heads, seq_len, head_dim]``, k, v ``[batch * kv_heads, kv_len,
    head_dim]`` (any float type; taken as float64). ``alibi_slopes`` and ``sinks``: one per
    query head (``problem.heads``), needed when the problem has those variants. The math:
    logits ``L = scale * q.k`` (softcap: ``c * tanh(L / c)``; ALiBi: ``- slope |r + off - k|``),
    ``P = exp(L - lse)`` with the sink in the denominator, ``dP = dO V^T``, ``D = rowsum(dO *
    O)``, ``dL = P (dP - D)``, ``dS = dL * dL/ds`` (the softcap's ``1 - tanh^2``),
    ``dQ = scale dS K``, ``dK = scale dS^T Q``, ``dV = P^T dO``, ``d sink = -sum P_sink D``.
    """
    p = problem
    q3, k3, v3, do3 = (_heads_view(a) for a in (q, k, v, dout))
    _check_kv_shapes(q3, k3, v3, p.group)
    if do3.shape != q3.shape:
        raise ValueError(f"dout {do3.shape} must have q's shape {q3.shape}")
    if p.alibi and alibi_slopes is None:
        raise ValueError("an ALiBi problem needs its slopes")
    if p.sinks and sinks is None:
        raise ValueError("a problem with sinks needs their values")
    kv_idx = np.arange(k3.shape[0]) if kv_heads is None else np.asarray(kv_heads).reshape(-1)
    heads = np.array([kv * p.group + g for kv in kv_idx for g in range(p.group)], dtype=np.int64)
    n, m, d = p.seq_len, p.kv_len, p.head_dim
    scale = 1.0 / math.sqrt(d)
    rows = np.arange(n)
    visible = problem_visible_keys(p, rows)
    distance = np.abs(rows[:, None] + p.causal_offset - np.arange(m)[None, :]) if p.alibi else None
    out = np.empty((heads.size, n, d))
    lse = np.empty((heads.size, n))
    dq = np.empty((heads.size, n, d))
    dk = np.zeros((kv_idx.size, m, d))
    dv = np.zeros((kv_idx.size, m, d))
    d_sinks = np.zeros(heads.size) if p.sinks else None
    for slot, bh in enumerate(heads):
        kv_slot, head = slot // p.group, bh % p.heads
        qh, doh = q3[bh].astype(np.float64), do3[bh].astype(np.float64)
        kh, vh = k3[kv_idx[kv_slot]].astype(np.float64), v3[kv_idx[kv_slot]].astype(np.float64)
        logits = qh @ kh.T * scale
        tanh = None
        if p.softcap > 0:
            tanh = np.tanh(logits / p.softcap)
            logits = p.softcap * tanh
        if distance is not None:
            logits = logits - float(alibi_slopes[head]) * distance  # type: ignore[index]
        if visible is not None:
            logits = np.where(visible, logits, -np.inf)
        sink = float(sinks[head]) if sinks is not None else -np.inf
        top = np.maximum(logits.max(axis=-1), sink)
        shift = np.where(np.isfinite(top), top, 0.0)
        weights = np.exp(logits - shift[:, None])
        total = weights.sum(axis=-1) + np.exp(sink - shift)
        with np.errstate(divide="ignore"):
            lse[slot] = np.where(total > 0, shift + np.log(total), np.inf)
        probs = np.where(total[:, None] > 0, weights / np.where(total > 0, total, 1)[:, None], 0)
        out[slot] = probs @ vh
        dp = doh @ vh.T
        delta = (doh * out[slot]).sum(axis=-1)
        ds = probs * (dp - delta[:, None])
        if tanh is not None:
            ds = ds * (1 - tanh**2)
        dq[slot] = scale * ds @ kh
        dk[kv_slot] += scale * ds.T @ qh
        dv[kv_slot] += probs.T @ doh
        if d_sinks is not None:
            d_sinks[slot] = -(np.exp(sink - lse[slot]) * delta).sum()
    return Gradients(heads, kv_idx, out, lse, dq, dk, dv, d_sinks)
