"""The persistent wgmma_f16 grid's work queue, as the planner models it
(``tuner.planner.key_span.persistent_imbalance``) and the kernel walks it
(``fa::work_coordinates`` in ``kernels/include/fa/split_kv.cuh``). Pure: no GPU.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.planner.key_span import persistent_imbalance, row_block_tiles
from tuner.problem import Problem

SPLIT_KV = Path(__file__).resolve().parent.parent / "kernels" / "include" / "fa" / "split_kv.cuh"


def walked(problem: Problem, rows: int, tile: int, blocks: int, heaviest_first: bool):
    """Each block's items (row block, batch-head) as the kernel walks them: block b takes
    linear items b, b + blocks, ... and maps them as fa::work_coordinates does."""
    tiles = row_block_tiles(problem, rows, tile)
    row_blocks, heads = len(tiles), problem.batch_heads
    per_block = []
    for b in range(blocks):
        items = []
        for linear in range(b, row_blocks * heads, blocks):
            if heaviest_first:
                items.append((row_blocks - 1 - linear // heads, linear % heads))
            else:
                items.append((linear % row_blocks, linear // row_blocks))
        per_block.append(items)
    return tiles, per_block


def test_the_kernel_maps_items_as_the_planner_does() -> None:
    text = SPLIT_KV.read_text()
    assert "return {row_blocks - 1 - linear / bh_count, linear % bh_count};" in text
    assert "return {linear % row_blocks, linear / row_blocks};" in text


@settings(max_examples=120, deadline=None)
@given(
    seq_len=st.integers(1, 6000),
    extra_keys=st.integers(0, 3000),
    heads=st.integers(1, 12),
    causal=st.booleans(),
    rows=st.sampled_from([64, 128]),
    tile=st.sampled_from([64, 128]),
    blocks=st.integers(1, 300),
)
def test_the_queue_is_a_partition_and_the_imbalance_is_its_busiest_share(
    seq_len: int, extra_keys: int, heads: int, causal: bool, rows: int, tile: int, blocks: int
) -> None:
    problem = Problem(seq_len, 128, batch=2, heads=heads, causal=causal, dtype="bfloat16",
                      kv_len=seq_len + extra_keys)
    tiles, per_block = walked(problem, rows, tile, blocks, heaviest_first=causal)
    # every (row block, batch-head) is walked exactly once
    items = [item for block in per_block for item in block]
    assert len(items) == len(set(items)) == len(tiles) * problem.batch_heads
    assert all(0 <= r < len(tiles) and 0 <= h < problem.batch_heads for r, h in items)
    # the imbalance is the busiest block's work (key tiles + 1 a row block) over the mean
    work = [sum(int(tiles[r]) + 1 for r, _ in block) for block in per_block]
    expected = max(work) / (sum(work) / blocks)
    imbalance = persistent_imbalance(problem, rows, tile, blocks, heaviest_first=causal)
    assert math.isclose(imbalance, expected, rel_tol=1e-12)
    assert imbalance >= 1.0 - 1e-12
    # heaviest first: a block's items never get heavier along its walk
    if causal:
        for block in per_block:
            loads = [int(tiles[r]) for r, _ in block]
            assert loads == sorted(loads, reverse=True)


@given(row_blocks=st.integers(1, 64), heads=st.integers(1, 32), blocks=st.integers(1, 200))
def test_equal_items_give_the_ceil_of_items_per_block(
    row_blocks: int, heads: int, blocks: int
) -> None:
    # no mask: every row block sees every key, so every item weighs the same
    problem = Problem(64 * row_blocks, 128, batch=1, heads=heads, dtype="bfloat16")
    assert np.all(row_block_tiles(problem, 64, 128) == row_block_tiles(problem, 64, 128)[0])
    items = row_blocks * heads
    imbalance = persistent_imbalance(problem, 64, 128, blocks, heaviest_first=False)
    assert math.isclose(imbalance, math.ceil(items / blocks) / (items / blocks), rel_tol=1e-12)
