"""The host half of ``BatchAttention``: check a batch, plan its work list, stage the words.

``BatchPlanner`` holds the fixed capacity a ``BatchAttention``'s device buffer was made for
and turns each batch (lengths and a block table, FlashInfer's CSR page table, or ragged
``cu_seqlens``) into the int32 words of that buffer: the work list at
``tuner.planner.work_list.WorkLayout``'s offsets, then the used page lists at
``pages_offset``. Every offset depends on the capacity only, so the kernels' pointers never
move; only the words change. Pure numpy: the GPU half copies ``words`` of the staging array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.serving import checks
from kernels.serving.checks import ServingInputError
from tuner.planner.errors import PlanError
from tuner.planner.work_list import (
    BatchShape,
    Capacity,
    WorkLayout,
    WorkList,
    WorkParams,
    plan_work,
)
from tuner.problem import Problem

#: the split-scratch budget (query tokens' worth of partial rows, times heads) by default:
#: 8 per query token, at most 2048 tokens' worth; splits beyond it are not planned
PARTIAL_TOKENS_PER_QUERY_TOKEN = 8
PARTIAL_TOKENS_LIMIT = 2048


@dataclass(frozen=True, slots=True)
class PlannedBatch:
    """One planned batch: its work list, how many staged words to copy, its query rows and
    the largest cache index it reads (a page, or a ragged row)."""

    work: WorkList
    words: int
    total_q: int
    largest_index: int


class BatchPlanner:
    """Checks and plans batches of a bucket into a staging array of ``words`` int32s.

    ``bucket``: the serving problem (heads, head_dim, mask, page size; ``batch`` is the
    requests' capacity, ``kv_len`` the keys a request may have). ``work_params``: the work
    planner's tunables and the kernel's tile. Capacities: ``max_query_tokens`` query rows a
    batch, ``max_partial_rows`` float32 split rows (default ``heads * min(8 *
    max_query_tokens, 2048)``); the items follow from them (every row block of the most
    query rows unsplit, plus twice the split slots the grid aims at).
    """

    def __init__(
        self,
        bucket: Problem,
        work_params: WorkParams,
        *,
        max_query_tokens: int,
        max_partial_rows: int | None = None,
    ) -> None:
        self.bucket = bucket
        self.work_params = work_params
        self.max_requests = bucket.batch
        self.max_query_tokens = max_query_tokens
        self.max_kv_len = bucket.kv_len
        self.page_size = bucket.page_size
        self.max_pages = -(-bucket.kv_len // bucket.page_size) if bucket.page_size else 0
        row_blocks = -(-max_query_tokens * bucket.group // work_params.block_rows)
        items = bucket.kv_heads * (row_blocks + self.max_requests)
        items += 2 * work_params.ctas * work_params.items_per_cta
        if max_partial_rows is None:
            budget = min(PARTIAL_TOKENS_PER_QUERY_TOKEN * max_query_tokens, PARTIAL_TOKENS_LIMIT)
            max_partial_rows = bucket.heads * budget
        if max_partial_rows < 0:
            raise ServingInputError(f"max_partial_rows={max_partial_rows} must be >= 0")
        self.capacity = Capacity(
            requests=self.max_requests,
            query_tokens=max_query_tokens,
            items=items,
            partial_rows=max_partial_rows,
            merge_tokens=min(max_query_tokens, max_partial_rows // bucket.heads),
            ctas=work_params.ctas,
        )
        self.layout = WorkLayout(self.capacity)
        self.pages_offset = -(-self.layout.words // 4) * 4
        self.words = self.pages_offset + self.max_requests * self.max_pages

    def staging(self) -> np.ndarray:
        return np.zeros(self.words, dtype=np.int32)

    def plan(
        self,
        query_lens: Any,
        kv_lens: Any,
        block_table: Any = None,
        *,
        kv_offsets: Any = None,
        into: np.ndarray,
    ) -> PlannedBatch:
        """Lengths with a block table (paged) or optional first rows (ragged)."""
        q, kv = self._lengths(query_lens, kv_lens)
        if self.page_size is None:
            if block_table is not None:
                raise ServingInputError("block_table is given but page_size is None (ragged K/V)")
            self._check_kv_len(kv, "kv_lens")
            offsets, largest = checks.check_ragged_offsets(kv, kv_offsets)
            return self._write(q, kv, offsets, None, largest, into)
        if block_table is None:
            raise ServingInputError(f"block_table is required with page_size={self.page_size}")
        if kv_offsets is not None:
            raise ServingInputError("kv_offsets applies to ragged K/V only; pass block_table")
        self._check_kv_len(kv, "kv_lens")
        pages, offsets, largest = checks.check_block_table(
            block_table, kv, self.page_size, max_pages=self.max_pages
        )
        return self._write(q, kv, offsets, pages, largest, into)

    def plan_csr(
        self,
        query_lens: Any,
        kv_indptr: Any,
        kv_indices: Any,
        kv_last_page_len: Any,
        *,
        into: np.ndarray,
    ) -> PlannedBatch:
        """FlashInfer's CSR page table: the adapter is the page lists' offsets."""
        if self.page_size is None:
            raise ServingInputError("plan_csr needs a paged cache (page_size is None)")
        kv, pages, offsets, largest = checks.check_csr(
            kv_indptr, kv_indices, kv_last_page_len, self.page_size, max_pages=self.max_pages
        )
        q, kv = self._lengths(query_lens, kv)
        self._check_kv_len(kv, "kv_indptr/kv_last_page_len")
        return self._write(q, kv, offsets, pages, largest, into)

    def plan_varlen(
        self, cu_seqlens_q: Any, cu_seqlens_k: Any, *, into: np.ndarray
    ) -> PlannedBatch:
        """``flash_attn_varlen_func``'s cumulative offsets (ragged K/V packed alike)."""
        q = checks.cu_seqlens_lengths("cu_seqlens_q", cu_seqlens_q)
        kv = checks.cu_seqlens_lengths("cu_seqlens_k", cu_seqlens_k)
        first = checks.host_integers("cu_seqlens_k", cu_seqlens_k)[:-1]
        return self.plan(q, kv, kv_offsets=first, into=into)

    def _lengths(self, query_lens: Any, kv_lens: Any) -> tuple[np.ndarray, np.ndarray]:
        return checks.check_lengths(
            query_lens,
            kv_lens,
            max_requests=self.max_requests,
            max_query_tokens=self.max_query_tokens,
            causal=self.bucket.causal,
        )

    def _check_kv_len(self, kv: np.ndarray, name: str) -> None:
        if kv.size and int(kv.max()) > self.max_kv_len:
            bad = int(np.argmax(kv))
            raise ServingInputError(
                f"{name}: request {bad} has {int(kv[bad])} keys; the buffers were made for "
                f"max_kv_len={self.max_kv_len}"
            )

    def _write(
        self,
        query_lens: np.ndarray,
        kv_lens: np.ndarray,
        offsets: np.ndarray,
        pages: np.ndarray | None,
        largest: int,
        into: np.ndarray,
    ) -> PlannedBatch:
        p = self.bucket
        batch = BatchShape(
            query_lens,
            kv_lens,
            offsets,
            p.heads,
            p.kv_heads,
            p.causal,
            p.window_left,
            p.window_right,
        )
        try:
            work = plan_work(batch, self.work_params, self.capacity)
        except PlanError as error:
            raise ServingInputError(f"the batch does not fit the buffers: {error}") from error
        if into.dtype != np.int32 or into.size < self.words:
            raise ServingInputError(f"the staging array must hold {self.words} int32 words")
        self.layout.pack(work, into=into)
        words = self.layout.words
        if pages is not None:
            into[self.pages_offset : self.pages_offset + pages.size] = pages
            words = self.pages_offset + pages.size
        return PlannedBatch(work, words, int(query_lens.sum()), largest)
