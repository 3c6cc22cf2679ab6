"""The work planner of serving batches (``tuner.planner.work_list``): every key of every
(request, query head, query row) covered exactly once, splits from the actual lengths,
partial rows and merge entries that agree, CTAs balanced within the list-scheduling bound,
capacities kept; and the whole contract replayed in float64 against dense attention."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.serving_reference import Variant, emulate_work_list, request_attention, visible
from tuner.planner.errors import PlanError
from tuner.planner.work_list import (
    DIRECT,
    ITEM_OVERHEAD_TILES,
    BatchShape,
    Capacity,
    WorkLayout,
    WorkList,
    WorkParams,
    plan_work,
)

HEADS = [(1, 1), (4, 1), (8, 2), (6, 2), (32, 8), (12, 4)]


def roomy(batch: BatchShape, ctas: int) -> Capacity:
    tokens = int(batch.query_lens.sum())
    return Capacity(
        requests=max(batch.batch, 1),
        query_tokens=max(tokens, 1),
        items=1_000_000,
        partial_rows=10_000_000,
        merge_tokens=max(tokens, 1),
        ctas=ctas,
    )


@st.composite
def batches(draw: st.DrawFn) -> tuple[BatchShape, WorkParams]:
    heads, kv_heads = draw(st.sampled_from(HEADS))
    causal = draw(st.booleans())
    size = draw(st.integers(1, 9))
    kv = draw(st.lists(st.integers(0, 900), min_size=size, max_size=size))
    q = [draw(st.integers(0, 20 if not causal else min(20, n))) for n in kv]
    window_left = draw(st.sampled_from([-1, -1, 0, 5, 100]))
    window_right = -1 if causal else draw(st.sampled_from([-1, -1, 0, 7]))
    batch = BatchShape(
        np.array(q),
        np.array(kv),
        np.arange(size) * 1000,
        heads,
        kv_heads,
        causal,
        window_left,
        window_right,
    )
    params = WorkParams(
        block_n=draw(st.sampled_from([16, 32, 64])),
        block_rows=draw(st.sampled_from([16, 32, 64])),
        ctas=draw(st.integers(1, 40)),
        items_per_cta=draw(st.integers(1, 4)),
        min_chunk_tiles=draw(st.integers(1, 6)),
        max_splits=draw(st.integers(1, 32)),
    )
    return batch, params


def covered_keys(work: WorkList, request: int, kv_head: int, packed_row: int, block_rows: int):
    items = work.items
    mine = items[
        (items[:, 0] == request)
        & (items[:, 1] == kv_head)
        & (items[:, 2] <= packed_row)
        & (packed_row < items[:, 2] + block_rows)
    ]
    return mine


@settings(max_examples=250, deadline=None)
@given(batches())
def test_every_visible_key_of_every_row_is_covered_exactly_once(case) -> None:
    batch, params = case
    work = plan_work(batch, params, roomy(batch, params.ctas))
    group = batch.group
    for b in range(batch.batch):
        q_len, kv_len = int(batch.query_lens[b]), int(batch.kv_lens[b])
        variant = Variant(batch.causal, batch.window_left, batch.window_right)
        seen = visible(q_len, kv_len, np.arange(kv_len), variant)
        for kv_head in range(batch.kv_heads):
            for packed in range(q_len * group):
                mine = covered_keys(work, b, kv_head, packed, params.block_rows)
                # One item per split of the request covers the row, with disjoint ranges.
                assert len(mine) == work.splits[b]
                counts = np.zeros(kv_len, dtype=int)
                for _, _, _, begin, end, *_ in mine:
                    assert 0 <= begin <= end <= kv_len
                    counts[begin:end] += 1
                assert counts.max(initial=0) <= 1
                # Every key the row sees is in exactly one item.
                assert np.all(counts[seen[packed // group]] == 1)
    # No item covers rows the request does not have.
    assert np.all(work.items[:, 2] < work.requests[work.items[:, 0], 1] * group)


@settings(max_examples=250, deadline=None)
@given(batches())
def test_partial_rows_and_merge_entries_agree(case) -> None:
    batch, params = case
    work = plan_work(batch, params, roomy(batch, params.ctas))
    group, heads = batch.group, batch.heads
    written: dict[int, tuple[int, int, int]] = {}  # partial row -> (token, head, item)
    for index, item in enumerate(work.items):
        request, kv_head, row0, _, _, partial0 = (int(x) for x in item[:6])
        q_start, q_len = (int(x) for x in work.requests[request][:2])
        if work.splits[request] == 1:
            assert partial0 == DIRECT
            continue
        assert partial0 >= 0
        for packed in range(row0, min(row0 + params.block_rows, q_len * group)):
            token, head = packed // group, kv_head * group + packed % group
            row = partial0 + token * heads + head
            assert 0 <= row < work.partial_rows
            assert row not in written, "two items write one partial row"
            written[row] = (q_start + token, head, index)
    # The merge list: one entry per token of a split request, naming the rows written above.
    split_tokens = {
        int(work.requests[b, 0]) + r
        for b in np.flatnonzero(work.splits > 1)
        for r in range(int(work.requests[b, 1]))
    }
    assert sorted(int(t) for t in work.merges[:, 0]) == sorted(split_tokens)
    for token, splits, first, stride in work.merges:
        for head in range(heads):
            rows = [int(first + head + s * stride) for s in range(int(splits))]
            assert [written[row][:2] for row in rows] == [(int(token), head)] * int(splits)
    assert len(written) == work.partial_rows


@settings(max_examples=250, deadline=None)
@given(batches())
def test_ctas_are_balanced_within_the_list_scheduling_bound(case) -> None:
    batch, params = case
    work = plan_work(batch, params, roomy(batch, params.ctas))
    offsets = work.cta_offsets
    assert offsets[0] == 0 and offsets[-1] == work.item_count
    assert np.all(np.diff(offsets) >= 0)
    costs = work.item_costs
    for cta in range(params.ctas):
        mine = costs[offsets[cta] : offsets[cta + 1]]
        assert np.all(np.diff(mine) <= 0), "a CTA runs its heaviest item first"
        assert mine.sum() == work.cta_costs[cta]
    assert work.cta_costs.sum() == costs.sum()
    assert work.cta_costs.max(initial=0) <= work.balance_bound()


@settings(max_examples=150, deadline=None)
@given(batches())
def test_splits_follow_the_actual_lengths_within_the_caps(case) -> None:
    batch, params = case
    work = plan_work(batch, params, roomy(batch, params.ctas))
    assert np.all(work.splits >= 1) and np.all(work.splits <= params.max_splits)
    # A request is split only when its work exceeds the chunk the batch aims at.
    tiles = -(-batch.kv_lens // params.block_n)
    assert np.all(work.splits[tiles <= work.chunk_tiles] == 1)
    # Where the KV rows sit (page lists, allocations) changes nothing but the requests rows.
    moved = BatchShape(
        batch.query_lens,
        batch.kv_lens,
        batch.kv_offsets[::-1] + 7,
        batch.heads,
        batch.kv_heads,
        batch.causal,
        batch.window_left,
        batch.window_right,
    )
    again = plan_work(moved, params, roomy(batch, params.ctas))
    assert np.array_equal(again.items, work.items)
    assert np.array_equal(again.requests[:, 3], moved.kv_offsets)


@settings(max_examples=120, deadline=None)
@given(batches(), st.integers(1, 6))
def test_the_work_list_replays_to_dense_attention(case, seed: int) -> None:
    batch, params = case
    work = plan_work(batch, params, roomy(batch, params.ctas))
    rng = np.random.default_rng(seed)
    d = 8
    total = int(batch.query_lens.sum())
    q = rng.standard_normal((total, batch.heads, d))
    keys = [rng.standard_normal((2, int(n), batch.kv_heads, d)) for n in batch.kv_lens]
    sinks = rng.standard_normal(batch.heads) if seed % 2 else None
    variant = Variant(
        batch.causal,
        batch.window_left,
        batch.window_right,
        softcap=5.0 * (seed % 3 == 0),
        sinks=sinks,
    )
    out, lse = emulate_work_list(
        work, q, lambda b: (keys[b][0], keys[b][1]), batch.heads, params.block_rows, variant
    )
    start = 0
    for b, q_len in enumerate(batch.query_lens):
        want, want_lse = request_attention(q[start : start + q_len], *keys[b], variant)
        np.testing.assert_allclose(out[start : start + q_len], want, atol=1e-12, rtol=1e-9)
        np.testing.assert_allclose(lse[start : start + q_len], want_lse, atol=1e-12, rtol=1e-9)
        start += int(q_len)


def decode(kv: list[int], heads: int = 32, kv_heads: int = 8) -> BatchShape:
    return BatchShape(np.ones(len(kv), int), np.array(kv), np.zeros(len(kv), int), heads, kv_heads)


def test_a_skewed_batch_splits_its_long_request_only() -> None:
    batch = decode([32768] + [1024] * 63)
    params = WorkParams(block_n=64, block_rows=16, ctas=264, min_chunk_tiles=4)
    work = plan_work(batch, params, roomy(batch, 264))
    assert work.splits[0] > 1 and np.all(work.splits[1:] == 1)
    # 8 KV heads x (splits of the long request + 63 short ones)
    assert work.item_count == 8 * (int(work.splits[0]) + 63)
    assert work.cta_costs.max() <= work.balance_bound()
    # the long request's chunks hold about the batch's mean work a CTA
    chunk = work.items[work.items[:, 0] == 0][:, 6]
    assert chunk.max() - chunk.min() <= 1


def test_split_counts_never_follow_an_allocated_length() -> None:
    # FlashAttention #1000: splits from the padded length over-split short requests. Here a
    # request's lengths are all the planner sees: a 10-key request is never split.
    batch = decode([10, 131072, 10])
    work = plan_work(batch, WorkParams(64, 16, 132), roomy(batch, 132))
    assert list(work.splits[[0, 2]]) == [1, 1] and work.splits[1] > 1


def test_empty_requests_get_no_items_and_zero_key_requests_write_their_rows() -> None:
    batch = BatchShape(np.array([0, 3, 2]), np.array([50, 0, 9]), np.zeros(3, int), 4, 2)
    work = plan_work(batch, WorkParams(16, 16, 4), roomy(batch, 4))
    assert 0 not in set(work.items[:, 0].tolist())
    no_keys = work.items[work.items[:, 0] == 1]
    assert len(no_keys) == 2 and np.all(no_keys[:, 3] == no_keys[:, 4])
    assert list(work.requests[:, 0]) == [0, 0, 3]


def test_capacities_lower_the_splits_and_refuse_what_cannot_fit() -> None:
    batch = decode([8192] * 4)
    params = WorkParams(block_n=64, block_rows=16, ctas=132, items_per_cta=4, min_chunk_tiles=1)
    free = plan_work(batch, params, roomy(batch, 132))
    tight = Capacity(4, 4, items=8 * 4 * 4, partial_rows=10**6, merge_tokens=4, ctas=132)
    fitted = plan_work(batch, params, tight)
    assert free.splits.max() > 4 and fitted.splits.max() <= 4
    assert fitted.item_count <= tight.items
    with pytest.raises(PlanError, match="capacity"):
        plan_work(batch, params, Capacity(4, 4, items=16, partial_rows=0, merge_tokens=0, ctas=132))
    with pytest.raises(PlanError, match="requests"):
        plan_work(batch, params, Capacity(3, 4, 10**6, 10**6, 4, 132))


def test_causal_prefill_rows_see_their_own_diagonal_only() -> None:
    batch = BatchShape(np.array([300]), np.array([300]), np.zeros(1, int), 8, 2, causal=True)
    work = plan_work(batch, WorkParams(64, 64, 8), roomy(batch, 8))
    first = work.items[(work.items[:, 2] == 0)]
    assert np.all(first[:, 4] == 16)  # 64 packed rows = tokens 0..15 of 4 heads
    assert work.tiles == 2 * sum(-(-min(300, (r // 4 + 16)) // 64) for r in range(0, 1200, 64))


def test_the_layout_packs_every_array_at_fixed_aligned_offsets() -> None:
    batch = decode([100, 5000, 7])
    capacity = Capacity(8, 8, 500, 10**5, 8, 132)
    work = plan_work(batch, WorkParams(64, 16, 132, 2), capacity)
    layout = WorkLayout(capacity)
    buffer = layout.pack(work)
    for offset in (layout.requests_offset, layout.items_offset, layout.merges_offset):
        assert offset % 4 == 0
    assert buffer.size == layout.words
    assert list(buffer[:3]) == [work.item_count, work.merge_count, 3]
    at = layout.items_offset
    assert np.array_equal(buffer[at : at + work.items.size].reshape(-1, 8), work.items)
    at = layout.ctas_offset
    assert np.array_equal(buffer[at : at + 133], work.cta_offsets)
    at = layout.merges_offset
    assert np.array_equal(buffer[at : at + work.merges.size].reshape(-1, 4), work.merges)
    # Re-planning new lengths into the same buffer moves nothing the kernels point at.
    other = plan_work(decode([1, 1]), WorkParams(64, 16, 132, 2), capacity)
    layout.pack(other, into=buffer)
    assert list(buffer[:3]) == [other.item_count, other.merge_count, 2]
    assert ITEM_OVERHEAD_TILES >= 0
