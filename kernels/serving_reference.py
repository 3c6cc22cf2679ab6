"""float64 ground truth of a serving batch, and the work list's contract replayed in numpy.

``request_attention`` is one request's attention, computed densely from its gathered keys
(what every serving parity check compares against): query rows ``[q_len, heads, head_dim]``,
keys and values ``[kv_len, kv_heads, head_dim]``, causal masking bottom-right aligned per
request, the sliding window, the logit softcap, ALiBi and attention sinks with the shared
device layer's conventions (``kernels/include/fa/``).

``emulate_work_list`` runs a planned ``WorkList`` as ``kernels/serving_f16.cu`` does, item by
item (each item's rows against its key range, writing the output directly or a float32-style
partial and its log-sum-exp) and then the merge list, in float64: what the CPU tests hold the
planner's partition, partial-row layout and merge entries to, before any GPU runs them.

Pure numpy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tuner.planner.work_list import DIRECT, WorkList


@dataclass(frozen=True, slots=True)
class Variant:
    """The attention variant of a batch (FlashAttention's conventions, ``tuner.problem``)."""

    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: np.ndarray | None = None  # [heads]
    sinks: np.ndarray | None = None  # [heads], natural-log logits


def visible(
    query_len: int, kv_len: int, keys: np.ndarray, variant: Variant, rows: np.ndarray | None = None
) -> np.ndarray:
    """``[rows, keys.size]``: whether each query row (default: all ``query_len``) sees each key."""
    rows = (np.arange(query_len) if rows is None else np.asarray(rows))[:, None]
    off = kv_len - query_len
    in_range = (keys[None, :] < kv_len) & (keys[None, :] >= 0)
    seen = np.broadcast_to(in_range, (rows.shape[0], keys.size)).copy()
    if variant.causal:
        seen &= keys[None, :] <= rows + off
    elif variant.window_right >= 0:
        seen &= keys[None, :] <= rows + off + variant.window_right
    if variant.window_left >= 0:
        seen &= keys[None, :] >= rows + off - variant.window_left
    return seen


def _logits(
    q: np.ndarray,
    rows: np.ndarray,
    query_len: int,
    k: np.ndarray,
    keys: np.ndarray,
    kv_len: int,
    heads: int,
    variant: Variant,
) -> np.ndarray:
    """``[heads, rows, keys]`` natural-log logits of query rows ``rows`` (values ``q``
    ``[rows, heads, d]``) of a request of ``query_len`` rows against ``k`` ``[keys, kv_heads,
    d]`` (key ``keys[j]`` of the request), hidden ones -inf."""
    d = q.shape[-1]
    kv_heads = k.shape[1]
    grouped = q.astype(np.float64).reshape(q.shape[0], kv_heads, heads // kv_heads, d)
    # query head h = kv_head * group + g reads KV head h // group
    scores = np.einsum("rkgd,nkd->kgrn", grouped, k.astype(np.float64))
    scores = scores.reshape(heads, q.shape[0], k.shape[0]) / math.sqrt(d)
    if variant.softcap > 0:
        scores = variant.softcap * np.tanh(scores / variant.softcap)
    if variant.alibi_slopes is not None:
        distance = np.abs(rows[:, None] + kv_len - query_len - keys[None, :])
        scores = scores - variant.alibi_slopes[:, None, None] * distance[None]
    seen = visible(query_len, kv_len, keys, variant, rows)
    return np.where(seen[None], scores, -np.inf)


def _softmax_parts(logits: np.ndarray, v: np.ndarray, heads: int) -> tuple[np.ndarray, ...]:
    """(unnormalised output [q_len, heads, d], row max [heads, q_len], row sum) of logits
    ``[heads, q_len, keys]`` with values ``[keys, kv_heads, d]``; rows that see nothing have
    max -inf, sum 0, output 0."""
    kv_heads = v.shape[1]
    top = logits.max(axis=-1, initial=-np.inf)
    base = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(logits - base[..., None])
    total = weights.sum(axis=-1)
    rows, keys = logits.shape[1:]
    grouped = weights.reshape(kv_heads, heads // kv_heads, rows, keys)
    out = np.einsum("kgrn,nkd->rkgd", grouped, v.astype(np.float64))
    return out.reshape(rows, heads, v.shape[2]), top, total


def request_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    variant: Variant = Variant(),
    rows: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One request (``q`` ``[q_len, heads, d]``, ``k``, ``v`` ``[kv_len, kv_heads, d]``):
    (output ``[rows, heads, d]``, natural-log LSE ``[rows, heads]``) of query rows ``rows``
    (default all). A row that sees no key (and no sink) is 0 with LSE +inf (FlashAttention's
    convention)."""
    q_len, heads, _ = q.shape
    rows = np.arange(q_len) if rows is None else np.asarray(rows, dtype=np.int64)
    kv_len = k.shape[0]
    keys = np.arange(kv_len)
    logits = _logits(q[rows], rows, q_len, k, keys, kv_len, heads, variant)
    out, top, total = _softmax_parts(logits, v, heads)
    return _finish(out, top, total, variant.sinks)


def _finish(
    out: np.ndarray, top: np.ndarray, total: np.ndarray, sinks: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Normalise with the sink joining the denominator: (output, LSE [q_len, heads])."""
    if sinks is not None:
        sink = sinks[:, None]
        new_top = np.maximum(top, sink)
        total = total * np.exp(np.where(np.isfinite(top), top - new_top, -np.inf)) + np.exp(
            sink - new_top
        )
        out = out * np.exp(np.where(np.isfinite(top), top - new_top, -np.inf)).T[..., None]
        top = new_top
    with np.errstate(divide="ignore", invalid="ignore"):
        normalised = np.where(total.T[..., None] > 0, out / total.T[..., None], 0.0)
        lse = np.where(total > 0, top + np.log(total), np.inf)
    return normalised, lse.T


def emulate_work_list(
    work: WorkList,
    q: np.ndarray,
    keys_of: Callable[[int], tuple[np.ndarray, np.ndarray]],
    heads: int,
    block_rows: int,
    variant: Variant = Variant(),
) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's contract in float64: (output ``[total_q, heads, d]``, LSE
    ``[total_q, heads]``). ``keys_of(b)``: request ``b``'s dense (k, v) ``[kv_len, kv_heads,
    d]``. Rows no item writes stay NaN, so a gap in the work list shows."""
    total_q, _, d = q.shape
    out = np.full((total_q, heads, d), np.nan)
    lse = np.full((total_q, heads), np.nan)
    partial_o = np.full((max(work.partial_rows, 1), d), np.nan)
    partial_lse = np.full(max(work.partial_rows, 1), np.nan)
    for item in work.items.astype(np.int64):
        request, kv_head, row0, key_begin, key_end, partial0 = (int(x) for x in item[:6])
        q_start, q_len, kv_len, _ = (int(x) for x in work.requests[request])
        k, v = keys_of(request)
        group = heads // k.shape[1]
        packed = np.arange(row0, min(row0 + block_rows, q_len * group))
        tokens, members = packed // group, packed % group
        head_ids = kv_head * group + members
        keys = np.arange(key_begin, key_end)
        # This item's tokens (their row index in the request: the masks need it) ...
        rows, local = np.unique(tokens, return_inverse=True)
        logits = _logits(q[q_start + rows], rows, q_len, k[keys], keys, kv_len, heads, variant)
        rows_out, top, total = _softmax_parts(logits, v[keys], heads)
        # ... of which it owns the (token, head) pairs ``tokens, head_ids``.
        o = rows_out[local, head_ids]
        m, s = top[head_ids, local], total[head_ids, local]
        if partial0 == DIRECT:
            full_o, full_lse = _finish(rows_out, top, total, variant.sinks)
            out[q_start + tokens, head_ids] = full_o[local, head_ids]
            lse[q_start + tokens, head_ids] = full_lse[local, head_ids]
        else:
            rows = partial0 + tokens * heads + head_ids
            with np.errstate(divide="ignore", invalid="ignore"):
                partial_o[rows] = np.where(s[:, None] > 0, o / s[:, None], 0.0)
                partial_lse[rows] = np.where(s > 0, m + np.log(s), -np.inf)
    for token, splits, first, stride in work.merges.astype(np.int64):
        for head in range(heads):
            rows = first + head + np.arange(splits) * stride
            parts = partial_lse[rows]
            sink = -np.inf if variant.sinks is None else float(variant.sinks[head])
            top = max(float(parts.max()), sink)
            if top == -np.inf:
                out[token, head], lse[token, head] = 0.0, np.inf
                continue
            weights = np.exp(parts - top)
            total = weights.sum() + math.exp(sink - top)
            out[token, head] = (weights[:, None] * partial_o[rows]).sum(axis=0) / total
            lse[token, head] = top + math.log(total)
    return out, lse
