"""Which query blocks the blocks of a backward kernel visit: the planner's half of the
contract whose device half is ``kernels/include/fa/backward.cuh`` (``visiting_query_blocks``,
``dq_turn``).

A backward block owns key tile ``n`` (keys ``[n * block_n, (n + 1) * block_n)`` below
``kv_len``) of one KV head and visits the query blocks of ``block_m`` rows whose rows see some
of its keys. Row ``r`` sees keys ``[r + low, r + high]`` (``Problem.visible_offsets``), so the
rows that see the tile are ``[key0 - high, key_last - low]``, one interval: tile ``n`` visits
query blocks ``[begin(n), end(n))``. Seen from a query block ``m``, the tiles that visit it are
one interval too, starting at ``first_key(m * block_m) // block_n`` (``first_key``: the first
key its first row sees); the deterministic dQ mode lets tile ``n`` add to block ``m`` when
``n - that`` tiles have added before it.

Pure: numpy and the problem; vectorised over key tiles, so long sequences cost nothing.
"""

from __future__ import annotations

import numpy as np

from tuner.planner.fixed_width import div_ceil
from tuner.problem import Problem


def key_tiles(problem: Problem, block_n: int) -> int:
    """Key tiles of a KV head: the backward grid's x."""
    return div_ceil(problem.kv_len, block_n)


def query_blocks(problem: Problem, block_m: int) -> int:
    return div_ceil(problem.seq_len, block_m)


def visiting_query_blocks(
    problem: Problem, block_m: int, block_n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per key tile: ``(begin, end)`` of the query blocks it visits (empty: ``begin == end``)."""
    tiles = key_tiles(problem, block_n)
    blocks = query_blocks(problem, block_m)
    key0 = np.arange(tiles, dtype=np.int64) * block_n
    low, high = problem.visible_offsets
    if low is None and high is None:
        return np.zeros(tiles, dtype=np.int64), np.full(tiles, blocks, dtype=np.int64)
    key_last = np.minimum(key0 + block_n, problem.kv_len) - 1
    first_row = np.zeros(tiles, dtype=np.int64) if high is None else np.maximum(0, key0 - high)
    last_row = np.full(tiles, problem.seq_len - 1, dtype=np.int64)
    if low is not None:
        last_row = np.minimum(last_row, key_last - low)
    empty = first_row > last_row
    begin = np.where(empty, 0, first_row // block_m)
    end = np.where(empty, 0, last_row // block_m + 1)
    return begin, end


def visited_blocks_per_kv_head(problem: Problem, block_m: int, block_n: int) -> int:
    """(key tile, query block) steps of one query head: what each of the group's heads adds
    to its KV head's blocks (a step computes block_m x block_n score pairs)."""
    begin, end = visiting_query_blocks(problem, block_m, block_n)
    return int((end - begin).sum())


def first_visiting_tile(problem: Problem, m_block: int, block_m: int, block_n: int) -> int:
    """The lowest key tile that visits query block ``m_block`` (when any does): the device's
    ``mask.first_key(m * block_m) / block_n``, where the deterministic order starts."""
    low, _ = problem.visible_offsets
    if low is None or not problem.windowed:
        return 0
    return max(0, m_block * block_m + low) // block_n
