"""Which keys the blocks of a tiled kernel visit: the planner's half of the split-KV
contract whose device half is ``kernels/include/fa/split_kv.cuh`` (and ``mask.cuh``).

Row ``r`` sees keys in ``[r + low, r + high]`` (``Problem.visible_offsets``) below
``kv_len``. The keys any row sees form the span ``[base, end)``: ``base`` is row 0's first
visible key, ``end`` one past row ``seq_len - 1``'s last. Splits partition the span in whole
tiles from ``base`` (so a window's splits cover only what it leaves), and a block of rows
``[first, last]`` visits the tiles from the one holding ``first``'s first visible key to
``last``'s last key: whole tiles before its window are never loaded or computed.

Without a window these are the formulas the families always had (``base = 0``, ``end =
kv_len``, causal blocks ending at their last row's diagonal), computed in closed form; with
one, a vectorised sum over row blocks. Pure: numpy and the problem.
"""

from __future__ import annotations

import numpy as np

from tuner.planner.fixed_width import div_ceil
from tuner.problem import Problem


def key_span(problem: Problem) -> tuple[int, int]:
    """``(base, end)``: the keys some row of the problem sees are ``[base, end)``."""
    low, high = problem.visible_offsets
    base = 0 if low is None or not problem.windowed else max(0, low)
    end = problem.kv_len if high is None else min(problem.kv_len, problem.seq_len - 1 + high + 1)
    return base, max(base, end)


def span_tiles(problem: Problem, tile: int) -> int:
    """Tiles of ``tile`` keys covering the span (at least 1: an empty span still has a
    split, whose rows see nothing)."""
    base, end = key_span(problem)
    return max(1, div_ceil(end - base, tile))


def _block_ranges(problem: Problem, rows_per_block: int, tile: int) -> tuple[np.ndarray, ...]:
    """Per row block: the first key loaded (tile-aligned from the span's base) and one past
    the last, as ``kernels/include/fa/split_kv.cuh``'s ``key_tiles`` (one split)."""
    base, _ = key_span(problem)
    low, high = problem.visible_offsets
    blocks = div_ceil(problem.seq_len, rows_per_block)
    first_rows = np.arange(blocks, dtype=np.int64) * rows_per_block
    last_rows = first_rows + rows_per_block - 1
    kv_len = problem.kv_len
    if low is None or not problem.windowed:
        starts = np.full(blocks, base, dtype=np.int64)
    else:
        first_keys = np.maximum(0, first_rows + low)
        starts = base + np.maximum(0, first_keys - base) // tile * tile
    if high is None:
        ends = np.full(blocks, kv_len, dtype=np.int64)
    else:
        ends = np.minimum(kv_len, last_rows + high + 1)
    return starts, np.maximum(starts, ends)


def visible_keys_read_per_head(problem: Problem, rows_per_block: int, tile: int) -> int:
    """K (or V) rows all blocks of one query head load: once per block of query rows, from
    its first visible tile to its last visible key."""
    from tuner.planner.families.base import key_rows_read_per_head

    if not problem.windowed:
        return key_rows_read_per_head(
            problem.seq_len, rows_per_block, problem.causal, problem.kv_len
        )
    starts, ends = _block_ranges(problem, rows_per_block, tile)
    return int((ends - starts).sum())


def visible_padded_pairs_per_head(problem: Problem, rows_per_block: int, tile: int) -> int:
    """(query, key) score pairs a windowed kernel computes per (batch, head): every row of a
    block (padding included) against the whole tiles the block visits."""
    starts, ends = _block_ranges(problem, rows_per_block, tile)
    tiles = -(-(ends - starts) // tile)
    return int(rows_per_block * tile * tiles.sum())


def row_block_tiles(problem: Problem, rows_per_block: int, tile: int) -> np.ndarray:
    """Tiles of ``tile`` keys each block of ``rows_per_block`` rows visits (one split), in
    row-block order: a block's share of the work."""
    starts, ends = _block_ranges(problem, rows_per_block, tile)
    return -(-(ends - starts) // tile)


def persistent_imbalance(
    problem: Problem, rows_per_block: int, tile: int, blocks: int, heaviest_first: bool
) -> float:
    """The busiest block's key tiles over the mean block's when ``blocks`` persistent blocks
    walk the row blocks x batch-heads queue statically (block b takes items b, b + blocks,
    ...; row blocks fastest, or heaviest first: ``fa::work_coordinates``). 1.0 when every
    block carries as much; ``ceil(items / blocks) / (items / blocks)`` when every item does."""
    tiles = row_block_tiles(problem, rows_per_block, tile)
    row_blocks, heads = len(tiles), problem.batch_heads
    items = np.arange(row_blocks * heads, dtype=np.int64)
    rows = row_blocks - 1 - items // heads if heaviest_first else items % row_blocks
    work = np.zeros(-(-len(items) // blocks) * blocks, dtype=np.int64)
    work[: len(items)] = tiles[rows] + 1  # + 1: the item's prologue and epilogue
    per_block = work.reshape(-1, blocks).sum(axis=0)
    mean = per_block.mean()
    return float(per_block.max() / mean) if mean > 0 else 1.0
