"""A serving batch on the host: ragged queries, a paged or ragged KV cache, and its check.

``build_inputs`` draws one batch for a ``BatchShape`` (``tuner.planner.work_list``):
q ``[total_q, heads, head_dim]`` of unit normals rounded to the dtype, and either a paged
cache ``[num_pages, page_size, kv_heads, head_dim]`` whose pages are handed out in a random
order (request ``b``'s page list at ``pages[kv_offsets[b]:]``), or a ragged tensor
``[rows, kv_heads, head_dim]`` (request ``b``'s keys from row ``kv_offsets[b]``). Whatever
no request owns (a last page's tail, spare pages, the rows between ragged requests) holds
NaN, and block-table entries past a request's pages hold ``UNUSED_PAGE``, an index far
outside the cache: a kernel that reads one key too many shows it as a non-finite output or
an illegal address, never as a quiet error.

``ServingCheck`` compares a kernel's output with the float64 attention of each request
gathered densely (``kernels.serving_reference``), on every request of a small batch and on
sampled requests and rows of a large one, after checking that every output element is
finite; the limit is FlashAttention's rule (``kernels.precision``): twice torch SDPA's error
on the same rows plus the dtype's floor (a fallback without torch).

Pure numpy (torch, when installed, only for SDPA's error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kernels import precision
from kernels.parity import ParityResult, compare, non_finite
from kernels.serving_reference import Variant, request_attention, visible
from tuner.planner.work_list import BatchShape

#: block-table entries past a request's pages: an index no cache has
UNUSED_PAGE = 2**30
#: requests whose rows are all checked when the batch's work is below this (multiply-adds)
FULL_CHECK_WORK = 2**28
SAMPLED_REQUESTS = 4
SAMPLED_ROWS = 48


@dataclass
class ServingInputs:
    """One batch's host arrays: ``*_stored`` in the dtype's storage type (what the device
    holds), the rest float32 values of the rounded inputs (NaN where no request reads)."""

    batch: BatchShape
    head_dim: int
    dtype: str
    page_size: int | None
    q_stored: np.ndarray
    k_stored: np.ndarray
    v_stored: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    pages: np.ndarray | None  # int32 page lists (paged)
    query_starts: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        lens = self.batch.query_lens
        self.query_starts = np.cumsum(lens) - lens

    def cache_rows(self, request: int) -> np.ndarray:
        """The cache rows (``[rows, kv_heads, head_dim]`` view of k) of a request's keys."""
        kv_len, offset = int(self.batch.kv_lens[request]), int(self.batch.kv_offsets[request])
        keys = np.arange(kv_len)
        if self.page_size is None:
            return offset + keys
        assert self.pages is not None
        page = self.pages[offset + keys // self.page_size].astype(np.int64)
        return page * self.page_size + keys % self.page_size

    def keys_of(self, request: int) -> tuple[np.ndarray, np.ndarray]:
        """A request's keys and values gathered densely: ``[kv_len, kv_heads, head_dim]``."""
        rows = self.cache_rows(request)
        kv_heads = self.batch.kv_heads
        flat_k = self.k.reshape(-1, kv_heads, self.head_dim)
        flat_v = self.v.reshape(-1, kv_heads, self.head_dim)
        return flat_k[rows], flat_v[rows]

    def queries_of(self, request: int) -> np.ndarray:
        start = int(self.query_starts[request])
        return self.q[start : start + int(self.batch.query_lens[request])]


def build_inputs(
    batch: BatchShape,
    head_dim: int,
    dtype: str,
    page_size: int | None,
    rng: np.random.Generator,
    *,
    spare_pages: int = 3,
) -> ServingInputs:
    """A batch of random inputs laid out as ``batch.kv_offsets`` says (see the module doc)."""
    heads, kv_heads = batch.heads, batch.kv_heads
    total_q = int(batch.query_lens.sum())
    q = rng.standard_normal((total_q, heads, head_dim), dtype=np.float32)
    pages = None
    if page_size is None:
        rows = int((batch.kv_offsets + batch.kv_lens).max(initial=0)) + 1
        owned = np.zeros(rows, dtype=bool)
        for offset, length in zip(batch.kv_offsets, batch.kv_lens, strict=True):
            owned[int(offset) : int(offset + length)] = True
        shape = (rows, kv_heads, head_dim)
    else:
        counts = -(-batch.kv_lens // page_size)
        used = int(counts.sum())
        num_pages = used + spare_pages
        physical = rng.permutation(num_pages)[:used].astype(np.int64)
        size = int((batch.kv_offsets + counts).max(initial=0))
        pages = np.full(size, UNUSED_PAGE, dtype=np.int64)
        owned = np.zeros(num_pages * page_size, dtype=bool)
        start = 0
        for offset, count, length in zip(batch.kv_offsets, counts, batch.kv_lens, strict=True):
            mine = physical[start : start + int(count)]
            start += int(count)
            pages[int(offset) : int(offset + count)] = mine
            keys = np.arange(int(length))
            owned[mine[keys // page_size] * page_size + keys % page_size] = True
        pages = pages.astype(np.int32)
        shape = (num_pages, page_size, kv_heads, head_dim)
    k = np.full(shape, np.nan, dtype=np.float32)
    v = np.full(shape, np.nan, dtype=np.float32)
    flat = (-1, kv_heads, head_dim)
    k.reshape(flat)[owned] = rng.standard_normal((int(owned.sum()), kv_heads, head_dim))
    v.reshape(flat)[owned] = rng.standard_normal((int(owned.sum()), kv_heads, head_dim))
    stored = [precision.to_storage(x, dtype) for x in (q, k, v)]
    values = [precision.from_storage(s, dtype).astype(np.float32) for s in stored]
    return ServingInputs(batch, head_dim, dtype, page_size, *stored, *values, pages)


def checked_requests(inputs: ServingInputs, rng: np.random.Generator) -> list[int]:
    """Every request of a small batch; of a large one the first, the last, the one with
    the most keys, the one with the most query rows and a few drawn at random."""
    batch = inputs.batch
    live = [b for b in range(batch.batch) if batch.query_lens[b] > 0]
    work = int((batch.query_lens * batch.kv_lens).sum()) * batch.heads * inputs.head_dim
    if work <= FULL_CHECK_WORK or len(live) <= SAMPLED_REQUESTS:
        return live
    picks = {live[0], live[-1], int(np.argmax(batch.kv_lens)), int(np.argmax(batch.query_lens))}
    picks |= set(rng.choice(live, size=SAMPLED_REQUESTS, replace=False).tolist())
    return sorted(b for b in picks if batch.query_lens[b] > 0)


def checked_rows(query_len: int, rng: np.random.Generator) -> np.ndarray:
    if query_len <= SAMPLED_ROWS:
        return np.arange(query_len)
    drawn = rng.choice(query_len, size=SAMPLED_ROWS, replace=False)
    return np.unique(np.concatenate([[0, query_len - 1], drawn]))


class ServingCheck:
    """The float64 reference of a batch's checked rows and the pass limit, computed once."""

    def __init__(self, inputs: ServingInputs, variant: Variant, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.inputs = inputs
        self.variant = variant
        self.requests = checked_requests(inputs, rng)
        self.rows: dict[int, np.ndarray] = {}
        self.expected: dict[int, np.ndarray] = {}
        worst_sdpa: float | None = 0.0
        for b in self.requests:
            q = inputs.queries_of(b)
            k, v = inputs.keys_of(b)
            rows = checked_rows(q.shape[0], rng)
            out, _ = request_attention(q, k, v, variant, rows)
            self.rows[b], self.expected[b] = rows, out
            error = sdpa_error(q, k, v, rows, out, variant, inputs.dtype)
            worst_sdpa = None if error is None or worst_sdpa is None else max(worst_sdpa, error)
        self.tolerance = (
            precision.FALLBACK_TOLERANCE[inputs.dtype]
            if worst_sdpa is None
            else 2 * worst_sdpa + precision.FLOOR[inputs.dtype]
        )

    def check(self, output: np.ndarray, tolerance: float | None = None) -> ParityResult:
        """``output`` (``[total_q, heads, head_dim]`` values) against the reference."""
        limit = self.tolerance if tolerance is None else tolerance
        if (failure := non_finite(output)) is not None:
            return failure
        worst = ParityResult(True, 0.0)
        starts = self.inputs.query_starts
        for b in self.requests:
            got = output[int(starts[b]) + self.rows[b]]
            result = compare(got, self.expected[b], limit, f"float64 reference of request {b}")
            if not result.ok:
                return result
            if result.max_abs_error > worst.max_abs_error:
                worst = result
        checked = sum(len(rows) for rows in self.rows.values())
        detail = f"{len(self.requests)} requests, {checked} query rows checked"
        return ParityResult(True, worst.max_abs_error, detail)


def sdpa_error(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    rows: np.ndarray,
    expected: np.ndarray,
    variant: Variant,
    dtype: str,
) -> float | None:
    """max|torch SDPA - reference| on a request's checked rows in ``dtype`` (None without
    torch, or for a variant SDPA has no mask or bias for: softcap, sinks)."""
    if not precision.torch_available() or variant.softcap > 0 or variant.sinks is not None:
        return None
    if not rows.size or k.shape[0] == 0:
        return 0.0
    import torch

    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    heads, kv_heads = q.shape[1], k.shape[1]
    seen = visible(q.shape[0], k.shape[0], np.arange(k.shape[0]), variant, rows)
    keep = seen.any(axis=1)  # SDPA has no answer for a row that sees nothing
    if not keep.any():
        return 0.0
    mask = torch.from_numpy(seen[keep])
    bias = None
    if variant.alibi_slopes is not None:
        distance = np.abs(rows[keep, None] + k.shape[0] - q.shape[0] - np.arange(k.shape[0]))
        bias = torch.from_numpy(-variant.alibi_slopes[:, None, None] * distance[None])
        bias = bias.masked_fill(~mask, -math.inf).to(torch_dtype)

    def tensor(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values)).to(torch_dtype)

    q_t = tensor(q[rows[keep]].transpose(1, 0, 2))
    group = heads // kv_heads
    k_t = tensor(k.transpose(1, 0, 2)).repeat_interleave(group, dim=0)
    v_t = tensor(v.transpose(1, 0, 2)).repeat_interleave(group, dim=0)
    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(
            q_t, k_t, v_t, attn_mask=bias if bias is not None else mask
        )
    got = out.to(torch.float64).numpy().transpose(1, 0, 2)
    return float(np.abs(got - expected[keep]).max())
