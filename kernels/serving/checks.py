"""The arguments of a serving batch, checked on the host before anything is launched.

``plan`` takes lengths and page tables on the host (Python sequences, numpy arrays, or torch
tensors: a CUDA tensor is copied to the host, one synchronisation) and checks them whole:
lengths are non-negative integers, at most the capacity the buffers were made for, causal
requests have at least as many keys as query rows, every page a request uses lies in its
block-table row (or CSR slice) and is a non-negative index. ``run`` checks the tensors
against the plan without touching their data: CUDA tensors of the plan's dtype on its GPU,
contiguous, of the planned shapes; a cache with at least as many pages (or rows) as the
plan's largest index. Each failure is one ``ServingInputError`` naming the argument, what it
was and what is expected; nothing has been launched or written when it is raised.

No CUDA call and no torch import here: a torch tensor exists only if the caller has torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.attention_args import AttentionInputError, AttentionInputTypeError

INT32_MAX = 2**31 - 1


class ServingInputError(AttentionInputError):
    """An argument of a serving batch is not what it must be; the message names it."""


class ServingInputTypeError(ServingInputError, AttentionInputTypeError):
    """An argument of the wrong kind or dtype."""


def _torch() -> Any:
    return sys.modules.get("torch")


def host_integers(name: str, values: Any, *, dims: int = 1) -> np.ndarray:
    """``values`` as an int64 array of ``dims`` dimensions on the host."""
    torch = _torch()
    if torch is not None and isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ServingInputTypeError(f"{name} has dtype {values.dtype}; expected integers")
        values = values.detach().to("cpu").numpy()
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:
        raise ServingInputTypeError(f"{name} is not an array of integers: {error}") from error
    if array.dtype == object or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise ServingInputTypeError(f"{name} has dtype {array.dtype}; expected integers")
    if array.ndim != dims:
        raise ServingInputError(
            f"{name} has {array.ndim} dimensions (shape {array.shape}); expected {dims}"
        )
    return array.astype(np.int64)


def check_lengths(
    query_lens: Any, kv_lens: Any, *, max_requests: int, max_query_tokens: int, causal: bool
) -> tuple[np.ndarray, np.ndarray]:
    q = host_integers("query_lens", query_lens)
    kv = host_integers("kv_lens", kv_lens)
    if q.size != kv.size:
        raise ServingInputError(
            f"query_lens has {q.size} requests and kv_lens {kv.size}; one of each per request"
        )
    if q.size > max_requests:
        raise ServingInputError(
            f"query_lens has {q.size} requests; the buffers were made for max_requests="
            f"{max_requests}"
        )
    for name, array in (("query_lens", q), ("kv_lens", kv)):
        if array.size and array.min() < 0:
            bad = int(np.argmin(array))
            raise ServingInputError(f"{name}[{bad}] = {int(array[bad])}; lengths must be >= 0")
        if array.size and array.max() > INT32_MAX:
            raise ServingInputError(f"{name} holds {int(array.max())}, beyond int32")
    if int(q.sum()) > max_query_tokens:
        raise ServingInputError(
            f"query_lens sum to {int(q.sum())} query rows; the buffers were made for "
            f"max_query_tokens={max_query_tokens}"
        )
    if causal and np.any(q > kv):
        bad = int(np.argmax(q > kv))
        raise ServingInputError(
            f"request {bad} has {int(q[bad])} query rows against kv_lens[{bad}] = {int(kv[bad])} "
            "keys; causal masking is bottom-right aligned, so a request needs at least as many "
            "keys as query rows"
        )
    return q, kv


def pages_needed(kv_lens: np.ndarray, page_size: int) -> np.ndarray:
    return -(-kv_lens // page_size)


def check_block_table(
    block_table: Any, kv_lens: np.ndarray, page_size: int, *, max_pages: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """(flat page lists, each request's offset in them, the largest page used) of a block
    table ``[batch, pages per request]`` (vLLM / FlashAttention's ``block_table``)."""
    table = host_integers("block_table", block_table, dims=2)
    batch = kv_lens.size
    needed = pages_needed(kv_lens, page_size)
    if table.shape[0] < batch:
        raise ServingInputError(
            f"block_table has {table.shape[0]} rows for {batch} requests; expected one per request"
        )
    widest = int(needed.max(initial=0))
    if widest > table.shape[1]:
        bad = int(np.argmax(needed))
        raise ServingInputError(
            f"kv_lens[{bad}] = {int(kv_lens[bad])} keys need {widest} pages of {page_size}; "
            f"block_table has {table.shape[1]} columns"
        )
    if widest > max_pages:
        raise ServingInputError(
            f"a request needs {widest} pages; the buffers were made for max_kv_len / page_size "
            f"= {max_pages} pages a request"
        )
    used = table[:batch, :widest]
    in_use = np.arange(widest)[None, :] < needed[:, None]
    _check_page_values("block_table", used, in_use)
    pages = np.where(in_use, used, 0).reshape(-1)
    offsets = np.arange(batch, dtype=np.int64) * widest
    largest = int(used[in_use].max(initial=-1))
    return pages, offsets, largest


def check_csr(
    kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any, page_size: int, *, max_pages: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(KV lengths, flat page lists, each request's offset, the largest page used) of
    FlashInfer's CSR page table: request ``b`` holds pages ``kv_indices[kv_indptr[b] :
    kv_indptr[b + 1]]``, the last of them ``kv_last_page_len[b]`` tokens full."""
    indptr = host_integers("kv_indptr", kv_indptr)
    indices = host_integers("kv_indices", kv_indices)
    last = host_integers("kv_last_page_len", kv_last_page_len)
    if indptr.size != last.size + 1:
        raise ServingInputError(
            f"kv_indptr has {indptr.size} entries for {last.size} requests (kv_last_page_len); "
            "expected one more than the requests"
        )
    if indptr.size and (indptr[0] != 0 or np.any(np.diff(indptr) < 0)):
        raise ServingInputError("kv_indptr must start at 0 and never decrease")
    if indptr.size and indptr[-1] > indices.size:
        raise ServingInputError(
            f"kv_indptr ends at {int(indptr[-1])}; kv_indices holds {indices.size} pages"
        )
    counts = np.diff(indptr)
    if np.any(counts > max_pages):
        bad = int(np.argmax(counts))
        raise ServingInputError(
            f"request {bad} holds {int(counts[bad])} pages; the buffers were made for "
            f"max_kv_len / page_size = {max_pages} pages a request"
        )
    bad_last = (last < 0) | (last > page_size) | ((counts > 0) & (last == 0))
    bad_last |= (counts == 0) & (last != 0)
    if np.any(bad_last):
        bad = int(np.argmax(bad_last))
        raise ServingInputError(
            f"kv_last_page_len[{bad}] = {int(last[bad])} with {int(counts[bad])} pages; expected "
            f"1..{page_size} tokens in a request's last page (0 for a request without pages)"
        )
    kv_lens = np.where(counts > 0, (counts - 1) * page_size + last, 0)
    used = indices[: int(indptr[-1])] if indptr.size else indices[:0]
    _check_page_values("kv_indices", used, np.ones(used.shape, dtype=bool))
    largest = int(used.max(initial=-1))
    return kv_lens, used, indptr[:-1].copy(), largest


def _check_page_values(name: str, values: np.ndarray, in_use: np.ndarray) -> None:
    bad = in_use & ((values < 0) | (values > INT32_MAX))
    if np.any(bad):
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ServingInputError(
            f"{name}{list(where)} = {int(values[where])}; page indices must be in 0..{INT32_MAX}"
        )


def check_ragged_offsets(kv_lens: np.ndarray, kv_offsets: Any | None) -> tuple[np.ndarray, int]:
    """Each request's first row of a ragged K/V tensor (default: packed, the running sum of
    ``kv_lens``, i.e. ``cu_seqlens_k[:-1]``) and the largest row used."""
    if kv_offsets is None:
        offsets = np.cumsum(kv_lens) - kv_lens
    else:
        offsets = host_integers("kv_offsets", kv_offsets)
        if offsets.size != kv_lens.size or (offsets.size and offsets.min() < 0):
            raise ServingInputError(
                f"kv_offsets has {offsets.size} entries (min {int(offsets.min(initial=0))}); "
                f"expected {kv_lens.size} first rows >= 0, one per request"
            )
    ends = offsets + kv_lens
    if ends.size and ends.max() > INT32_MAX:
        raise ServingInputError("a request's keys end beyond row 2**31 - 1 of the K/V tensor")
    largest = int((ends[kv_lens > 0] - 1).max(initial=-1))
    return offsets, largest


def cu_seqlens_lengths(name: str, cu_seqlens: Any) -> np.ndarray:
    """Lengths from cumulative offsets (``cu_seqlens_q``/``cu_seqlens_k``: ``[batch + 1]``,
    starting at 0, never decreasing)."""
    cu = host_integers(name, cu_seqlens)
    if cu.size < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ServingInputError(
            f"{name} must start at 0 and never decrease ([batch + 1] cumulative offsets)"
        )
    return np.diff(cu)


# ---------------------------------------------------------------------- run-time tensors


@dataclass(frozen=True, slots=True)
class Expected:
    """What ``run``'s tensors must be for the current plan."""

    dtype: Any  # torch dtype
    device: int
    total_q: int
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int | None
    largest_index: int  # the largest page (paged) or row (ragged) the plan reads


def _check_tensor(name: str, value: Any, expected: Expected, shape: Sequence[int | None]) -> None:
    torch = _torch()
    if torch is None or not isinstance(value, torch.Tensor):
        raise ServingInputTypeError(
            f"{name} is a {type(value).__module__}.{type(value).__qualname__}; expected a "
            "torch CUDA tensor"
        )
    if value.device.type != "cuda" or (value.device.index or 0) != expected.device:
        raise ServingInputError(
            f"{name} is on {value.device}; the plan runs on cuda:{expected.device}"
        )
    if value.dtype != expected.dtype:
        raise ServingInputTypeError(f"{name} has dtype {value.dtype}; expected {expected.dtype}")
    actual = tuple(value.shape)
    if len(actual) != len(shape) or any(
        want is not None and have != want for have, want in zip(actual, shape, strict=False)
    ):
        wanted = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ServingInputError(f"{name} has shape {list(actual)}; expected {wanted}")
    if not value.is_contiguous():
        raise ServingInputError(f"{name} is not contiguous; pass {name}.contiguous()")


def _is_fake(value: Any) -> bool:
    """A tensor without storage (torch.compile's fake tensors): no address to compare."""
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(value, fake.FakeTensor)


def check_run(q: Any, k_cache: Any, v_cache: Any, out: Any, lse: Any, expected: Expected) -> None:
    """The tensors of one run against the plan (see the module doc)."""
    e = expected
    _check_tensor("q", q, e, (e.total_q, e.heads, e.head_dim))
    if e.page_size is None:
        kv_shape: tuple[int | None, ...] = (None, e.kv_heads, e.head_dim)
        what = "rows"
    else:
        kv_shape = (None, e.page_size, e.kv_heads, e.head_dim)
        what = "pages"
    _check_tensor("k_cache", k_cache, e, kv_shape)
    _check_tensor("v_cache", v_cache, e, kv_shape)
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ServingInputError(
            f"v_cache has shape {list(v_cache.shape)}; expected k_cache's {list(k_cache.shape)}"
        )
    if k_cache.shape[0] <= e.largest_index:
        raise ServingInputError(
            f"k_cache has {k_cache.shape[0]} {what}; the plan reads {what[:-1]} "
            f"{e.largest_index} (re-plan, or pass the cache the page table points into)"
        )
    if out is not None:
        _check_tensor("out", out, e, (e.total_q, e.heads, e.head_dim))
        if not _is_fake(out) and out.data_ptr() in (
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        ):
            raise ServingInputError("out shares memory with an input; pass a separate tensor")
    if lse is not None:
        torch = _torch()
        lse_expected = Expected(
            torch.float32,
            e.device,
            e.total_q,
            e.heads,
            e.kv_heads,
            e.head_dim,
            e.page_size,
            e.largest_index,
        )
        _check_tensor("lse", lse, lse_expected, (e.total_q, e.heads))
