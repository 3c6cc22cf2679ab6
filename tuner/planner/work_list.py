"""The work planner of a serving batch: its lengths -> a balanced list of work items.

The seed splits one shape's key range into ``ceil(tiles / target)`` splits
(``tuner.planner.seed.sequence_parallel_splits``). A serving batch has a length per request,
so the rule is generalised from one shape to the batch (FlashDecoding, FlashInfer's
scheduler, FlashAttention's num_splits heuristic without its padded-length bug,
FlashAttention #1000):

1. A request's query rows times the heads of a KV-head group are its *packed rows* (token-major:
   packed row ``p`` is token ``p // group``, head ``kv_head * group + p % group``, the GQA
   packing of ``decode_f16``); they are cut into row blocks of ``block_rows``. A row block of
   one KV head sees the key span its tokens' masks leave (causal bottom-right per request,
   the window), ``tiles`` key tiles of ``block_n``: the unit of work.
2. The batch's work ``W`` (tiles over every row block and KV head) over the
   ``ctas * items_per_cta`` item slots the grid should hold gives the chunk a split aims at
   (at least ``min_chunk_tiles``); a request is split in ``ceil(its tiles / chunk)`` (at most
   ``max_splits``, at most its shortest row block's tiles, so no split is empty), each split
   an even share of every row block's tiles. Counts follow the actual lengths only: the
   planner never sees an allocated length.
3. Items are ordered heaviest first (tiles + ``ITEM_OVERHEAD_TILES``) and dealt to the
   ``ctas`` persistent CTAs in rounds of ``ctas``, each round's heaviest to the least loaded
   CTA. Every CTA gets at most one item of each round, and rounds shrink, so the most loaded
   CTA carries at most ``W_items / ctas + heaviest item`` (``balance_bound``), the bound of
   Graham's list scheduling, checked by the property tests.
4. A split request's rows are merged from its splits' float32 partials: partial row of
   (split ``s``, token ``r``, query head ``h``) is ``base + (s * q_len + r) * heads + h``;
   the merge list holds one entry per token of a split request.

``WorkLayout`` places every array in one int32 buffer of fixed capacity, so a CUDA graph that
captured the launches (grid = ``ctas``) replays correctly after the buffer is re-planned for
new lengths. The kernel side of this contract is ``kernels/serving_f16.cu``.

Pure: numpy and the planner's errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tuner.planner.errors import PlanError
from tuner.problem import Problem

#: a work item's fixed cost in key tiles: its Q load, the warps' merge and its epilogue
ITEM_OVERHEAD_TILES = 1
#: int32 words of one work item: request, kv_head, row0, key_begin, key_end, partial_row0,
#: tiles, (unused)
ITEM_WORDS = 8
#: int32 words of one request: q_start, q_len, kv_len, kv_offset
REQUEST_WORDS = 4
#: int32 words of one merge entry: token, splits, first partial row, split stride
MERGE_WORDS = 4
#: header words: items, merge entries, requests, (unused)
HEADER_WORDS = 4
#: a direct item's partial_row0: it writes the output itself
DIRECT = -1
INT32_MAX = 2**31 - 1
#: rows left between the requests of the tuner's ragged KV tensor (``problem_batch``): the
#: inputs put NaN there, so a kernel reading past a request's keys shows it
RAGGED_GAP = 1


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What the work planner reads of a batch: per request its query rows, its KV length and
    where its keys start (a page-list offset for a paged cache, the first KV row for a
    contiguous ragged one), and the heads and mask every request shares."""

    query_lens: np.ndarray
    kv_lens: np.ndarray
    kv_offsets: np.ndarray
    heads: int
    kv_heads: int
    causal: bool = False
    window_left: int = -1
    window_right: int = -1

    def __post_init__(self) -> None:
        q, kv, offsets = (
            np.asarray(x, dtype=np.int64).reshape(-1)
            for x in (self.query_lens, self.kv_lens, self.kv_offsets)
        )
        object.__setattr__(self, "query_lens", q)
        object.__setattr__(self, "kv_lens", kv)
        object.__setattr__(self, "kv_offsets", offsets)
        if not (q.size == kv.size == offsets.size):
            raise PlanError(
                f"{q.size} query lengths, {kv.size} KV lengths and {offsets.size} KV offsets: "
                "one of each per request"
            )
        if q.size and (q.min() < 0 or kv.min() < 0):
            raise PlanError("query and KV lengths must be >= 0")
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise PlanError(f"kv_heads={self.kv_heads} must divide heads={self.heads}")
        if self.causal and np.any(q > kv):
            bad = int(np.argmax(q > kv))
            raise PlanError(
                f"request {bad}: {int(q[bad])} query rows against {int(kv[bad])} keys under "
                "causal masking (bottom-right aligned: the first rows would see no key)"
            )

    @property
    def batch(self) -> int:
        return int(self.query_lens.size)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0


@dataclass(frozen=True, slots=True)
class WorkParams:
    """The work planner's tunables (with the kernel's tile shape it plans for)."""

    block_n: int
    block_rows: int
    ctas: int
    items_per_cta: int = 1
    min_chunk_tiles: int = 4
    max_splits: int = 64

    def __post_init__(self) -> None:
        for name in ("block_n", "block_rows", "ctas", "items_per_cta", "min_chunk_tiles"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_splits < 1:
            raise PlanError(f"max_splits={self.max_splits} must be >= 1")


@dataclass(frozen=True, slots=True)
class Capacity:
    """The fixed sizes of the device buffers a plan is written into."""

    requests: int
    query_tokens: int
    items: int
    partial_rows: int
    merge_tokens: int
    ctas: int


@dataclass(frozen=True, slots=True)
class WorkList:
    """One planned batch: the arrays ``WorkLayout.pack`` writes (int32 rows as documented
    at ``ITEM_WORDS``, ``REQUEST_WORDS``, ``MERGE_WORDS``) and what the planner decided."""

    requests: np.ndarray  # [batch, REQUEST_WORDS]
    items: np.ndarray  # [items, ITEM_WORDS], grouped by CTA, heaviest first within each
    cta_offsets: np.ndarray  # [ctas + 1]: CTA c runs items cta_offsets[c] .. cta_offsets[c+1]
    merges: np.ndarray  # [merge tokens, MERGE_WORDS]
    splits: np.ndarray  # [batch] splits of each request (1: its items write the output)
    partial_rows: int  # float32 partial rows the split items write
    cta_costs: np.ndarray  # [ctas] planned cost of each CTA (tiles + overhead)
    chunk_tiles: int  # the split target the batch's work gave

    @property
    def item_count(self) -> int:
        return int(self.items.shape[0])

    @property
    def merge_count(self) -> int:
        return int(self.merges.shape[0])

    @property
    def tiles(self) -> int:
        """Key tiles over every item (the work, in the planner's unit)."""
        return int(self.items[:, 6].sum()) if self.item_count else 0

    @property
    def item_costs(self) -> np.ndarray:
        return self.items[:, 6].astype(np.int64) + ITEM_OVERHEAD_TILES

    def balance_bound(self) -> float:
        """What no CTA's cost may exceed: the mean load plus the heaviest item."""
        if not self.item_count:
            return 0.0
        costs = self.item_costs
        return float(costs.sum()) / len(self.cta_costs) + float(costs.max())


def table_width(problem: Problem) -> int:
    """Pages a request may hold in the tuner's block table: ``ceil(kv_len / page_size)``."""
    return -(-problem.kv_len // problem.page_size) if problem.page_size else 0


def problem_batch(problem: Problem) -> BatchShape:
    """The batch a serving problem stands for (what the tuner plans, launches and checks):
    the seeded sample of its lengths (``Problem.request_lengths``), request ``b``'s pages
    at ``b * table_width`` of a block table (paged), or its keys from row
    ``sum(kv_len + RAGGED_GAP of the requests before it)`` of a ragged tensor."""
    sample = problem.request_lengths()
    if problem.page_size:
        offsets = np.arange(sample.batch, dtype=np.int64) * table_width(problem)
    else:
        offsets = np.cumsum(sample.kv + RAGGED_GAP) - (sample.kv + RAGGED_GAP)
    return BatchShape(
        sample.query,
        sample.kv,
        offsets,
        problem.heads,
        problem.kv_heads,
        problem.causal,
        problem.window_left,
        problem.window_right,
    )


def _row_block_spans(batch: BatchShape, block_rows: int, block_n: int) -> tuple[np.ndarray, ...]:
    """Per row block of every request: (request, row0, key_begin, key_end, tiles)."""
    group = batch.group
    packed = batch.query_lens * group
    blocks = -(-packed // block_rows)
    request = np.repeat(np.arange(batch.batch, dtype=np.int64), blocks)
    starts = np.cumsum(blocks) - blocks
    index = np.arange(request.size, dtype=np.int64) - np.repeat(starts, blocks)
    row0 = index * block_rows
    q_len = batch.query_lens[request]
    kv_len = batch.kv_lens[request]
    first_token = row0 // group
    last_token = np.minimum(row0 + block_rows, packed[request]) - 1
    last_token //= group
    offset = kv_len - q_len  # bottom-right alignment
    begin = np.zeros_like(row0)
    end = kv_len.copy()
    if batch.window_left >= 0:
        begin = np.maximum(0, first_token + offset - batch.window_left)
    if batch.causal:
        end = np.minimum(kv_len, last_token + offset + 1)
    elif batch.window_right >= 0:
        end = np.minimum(kv_len, last_token + offset + batch.window_right + 1)
    end = np.maximum(begin, end)
    tiles = -(-(end - begin) // block_n)
    return request, row0, begin, end, tiles


def plan_work(batch: BatchShape, params: WorkParams, capacity: Capacity) -> WorkList:
    """The work list of ``batch`` (see the module doc); ``PlanError`` when it cannot fit
    ``capacity`` even unsplit."""
    if batch.batch > capacity.requests:
        raise PlanError(f"{batch.batch} requests exceed the capacity of {capacity.requests}")
    tokens = int(batch.query_lens.sum())
    if tokens > capacity.query_tokens:
        raise PlanError(
            f"{tokens} query rows exceed the capacity of {capacity.query_tokens} query tokens"
        )
    if params.ctas != capacity.ctas:
        raise PlanError(f"ctas={params.ctas} differs from the buffers' {capacity.ctas} CTAs")
    kv_heads, heads = batch.kv_heads, batch.heads
    request, row0, begin, end, tiles = _row_block_spans(batch, params.block_rows, params.block_n)
    work = int(tiles.sum()) * kv_heads
    chunk = max(params.min_chunk_tiles, -(-work // (params.ctas * params.items_per_cta)))

    # Splits per request: from its longest row block's tiles, capped so no split is empty.
    longest = np.zeros(batch.batch, dtype=np.int64)
    shortest = np.full(batch.batch, np.iinfo(np.int64).max, dtype=np.int64)
    np.maximum.at(longest, request, tiles)
    np.minimum.at(shortest, request, tiles)
    wanted = np.maximum(1, -(-longest // chunk))
    cap = np.where(shortest == np.iinfo(np.int64).max, 1, np.maximum(shortest, 1))
    splits = np.minimum(np.minimum(wanted, cap), params.max_splits)
    splits = _within_capacity(batch, request, splits, capacity)

    split_requests = splits > 1
    partial_per_request = np.where(split_requests, splits * batch.query_lens * heads, 0)
    partial_base = np.cumsum(partial_per_request) - partial_per_request
    q_start = np.cumsum(batch.query_lens) - batch.query_lens

    # Items: row block x KV head x split, each split an even share of the block's tiles.
    item_splits = splits[request]
    block = np.repeat(np.arange(request.size), item_splits)
    split = np.arange(block.size) - np.repeat(np.cumsum(item_splits) - item_splits, item_splits)
    block_tiles = tiles[block]
    share = item_splits[block] if block.size else block
    first_tile = split * block_tiles // np.maximum(share, 1)
    last_tile = (split + 1) * block_tiles // np.maximum(share, 1)
    key_begin = begin[block] + first_tile * params.block_n
    key_end = np.minimum(end[block], begin[block] + last_tile * params.block_n)
    key_end = np.maximum(key_begin, key_end)
    item_request = request[block]
    partial0 = np.where(
        split_requests[item_request],
        partial_base[item_request] + split * batch.query_lens[item_request] * heads,
        DIRECT,
    )
    per_head = np.stack(
        [
            item_request,
            np.zeros_like(block),
            row0[block],
            key_begin,
            key_end,
            partial0,
            last_tile - first_tile,
            np.zeros_like(block),
        ],
        axis=1,
    )
    items = np.repeat(per_head, kv_heads, axis=0)
    items[:, 1] = np.tile(np.arange(kv_heads, dtype=np.int64), per_head.shape[0])

    order, cta_of, cta_costs = _deal(items[:, 6] + ITEM_OVERHEAD_TILES, params.ctas)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    items = items[np.lexsort((rank, cta_of))]  # by CTA, then heaviest first
    cta_offsets = np.zeros(params.ctas + 1, dtype=np.int64)
    cta_offsets[1:] = np.cumsum(np.bincount(cta_of, minlength=params.ctas))

    merged = np.flatnonzero(split_requests)
    merge_q = batch.query_lens[merged]
    merge_request = np.repeat(merged, merge_q)
    local = np.arange(merge_request.size) - np.repeat(np.cumsum(merge_q) - merge_q, merge_q)
    merges = np.stack(
        [
            q_start[merge_request] + local,
            splits[merge_request],
            partial_base[merge_request] + local * heads,
            batch.query_lens[merge_request] * heads,
        ],
        axis=1,
    ).reshape(-1, MERGE_WORDS)

    requests = np.stack(
        [q_start, batch.query_lens, batch.kv_lens, batch.kv_offsets], axis=1
    ).reshape(-1, REQUEST_WORDS)
    partial_rows = int(partial_per_request.sum())
    for name, array in (("requests", requests), ("items", items), ("merges", merges)):
        if array.size and (array.max() > INT32_MAX or array.min() < DIRECT):
            raise PlanError(f"the work list's {name} overflow int32")
    return WorkList(
        requests=requests.astype(np.int32),
        items=items.astype(np.int32),
        cta_offsets=cta_offsets.astype(np.int32),
        merges=merges.astype(np.int32),
        splits=splits,
        partial_rows=partial_rows,
        cta_costs=cta_costs,
        chunk_tiles=int(chunk),
    )


def _within_capacity(
    batch: BatchShape, request: np.ndarray, splits: np.ndarray, capacity: Capacity
) -> np.ndarray:
    """``splits`` with the largest counts lowered (halving a common cap) until the items,
    partial rows and merge tokens fit the buffers; ``PlanError`` if unsplit does not."""
    blocks = np.bincount(request, minlength=batch.batch).astype(np.int64)

    def needs(counts: np.ndarray) -> tuple[int, int, int]:
        split = counts > 1
        items = int((blocks * counts).sum()) * batch.kv_heads
        partial = int((np.where(split, counts, 0) * batch.query_lens).sum()) * batch.heads
        merge = int(batch.query_lens[split].sum())
        return items, partial, merge

    limit = int(splits.max()) if splits.size else 1
    while True:
        items, partial, merge = needs(splits)
        fits = (
            items <= capacity.items
            and partial <= capacity.partial_rows
            and merge <= capacity.merge_tokens
        )
        if fits:
            return splits
        if limit == 1:
            raise PlanError(
                f"the batch needs {items} work items unsplit, more than the capacity of "
                f"{capacity.items}: plan with larger buffers"
            )
        limit = max(1, limit // 2)
        splits = np.minimum(splits, limit)


def _deal(costs: np.ndarray, ctas: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Items dealt to CTAs heaviest first: rounds of ``ctas`` items (in descending cost), the
    round's k-th heaviest to its k-th least loaded CTA. Returns the descending order, the CTA
    of each item (indexed like ``costs``) and each CTA's total cost."""
    order = np.argsort(-costs, kind="stable")
    cta_of = np.empty(costs.size, dtype=np.int64)
    loads = np.zeros(ctas, dtype=np.int64)
    for start in range(0, costs.size, ctas):
        chunk = order[start : start + ctas]
        least_loaded = np.argsort(loads, kind="stable")[: chunk.size]
        cta_of[chunk] = least_loaded
        loads[least_loaded] += costs[chunk]
    return order, cta_of, loads


@dataclass(frozen=True, slots=True)
class WorkLayout:
    """Where each array of a ``WorkList`` lies in the int32 work buffer of a capacity.

    Word offsets, each a multiple of 4 (16 bytes: the kernel reads requests, items and merge
    entries as ``int4``): header (items, merge entries, requests), requests, items, CTA
    offsets, merge entries. The offsets depend on the capacity only, so a buffer allocated once
    serves every plan (a CUDA graph keeps its addresses)."""

    capacity: Capacity

    @property
    def requests_offset(self) -> int:
        return HEADER_WORDS

    @property
    def items_offset(self) -> int:
        return self.requests_offset + REQUEST_WORDS * self.capacity.requests

    @property
    def ctas_offset(self) -> int:
        return self.items_offset + ITEM_WORDS * self.capacity.items

    @property
    def merges_offset(self) -> int:
        end = self.ctas_offset + self.capacity.ctas + 1
        return -(-end // 4) * 4

    @property
    def words(self) -> int:
        return self.merges_offset + MERGE_WORDS * max(self.capacity.merge_tokens, 1)

    def pack(self, work: WorkList, into: np.ndarray | None = None) -> np.ndarray:
        """The buffer's contents for ``work`` (written into ``into`` when given: a pinned
        staging array). Regions past the counts keep what they held: no kernel reads them."""
        cap = self.capacity
        if (
            work.requests.shape[0] > cap.requests
            or work.item_count > cap.items
            or work.merge_count > cap.merge_tokens
            or work.cta_offsets.size != cap.ctas + 1
            or work.partial_rows > cap.partial_rows
        ):
            raise PlanError("the work list does not fit the buffer's capacity")
        buffer = np.zeros(self.words, dtype=np.int32) if into is None else into
        if buffer.dtype != np.int32 or buffer.size < self.words:
            raise PlanError(f"the work buffer needs {self.words} int32 words")
        buffer[:HEADER_WORDS] = (work.item_count, work.merge_count, work.requests.shape[0], 0)
        at = self.requests_offset
        buffer[at : at + work.requests.size] = work.requests.reshape(-1)
        at = self.items_offset
        buffer[at : at + work.items.size] = work.items.reshape(-1)
        at = self.ctas_offset
        buffer[at : at + work.cta_offsets.size] = work.cta_offsets
        at = self.merges_offset
        buffer[at : at + work.merges.size] = work.merges.reshape(-1)
        return buffer
