"""The CPU references: float64 attention, sampled rows, and the kernels' numpy emulations.

The emulation replays ``kernels/tiled.cu`` with a plan's exact partition, so
agreement with the float64 reference here (1e-5 in float64, the seed's 1e-3 in
float32) says the kernel's algorithm (online softmax in the log2 domain, the
-inf handling of fully masked tiles and splits, the split merge) is right
before a GPU runs it.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.reference import (
    attention_reference,
    emulate_online,
    emulate_scalar,
    emulate_tiled,
    reference_rows,
    scale_log2,
)
from tuner.device import H200
from tuner.planner.tunable import KernelParams, plan_kernel
from tuner.problem import Problem

FLOAT64_TOLERANCE = 1e-5
FLOAT32_TOLERANCE = 1e-3


def inputs(problem: Problem, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (problem.batch_heads, problem.seq_len, problem.head_dim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    return q, k, v


def naive_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    """Straight from the definition, one head and one row at a time."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    heads, n, d = q.shape
    out = np.zeros((heads, n, d))
    for h in range(heads):
        for i in range(n):
            keys = range(i + 1) if causal else range(n)
            scores = [float(np.dot(q[h, i], k[h, j])) / math.sqrt(d) for j in keys]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for w, j in zip(weights, keys, strict=True):
                out[h, i] += w / total * v[h, j]
    return out


def tiled_plan(problem: Problem, tile: int, rows: int, threads: int, target: int):
    params = KernelParams(
        "tiled", threads=threads, tile_size=tile, rows_per_block=rows, split_target=target
    )
    return plan_kernel(problem, params, H200)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d", [(1, 4), (7, 32), (33, 12)])
def test_reference_matches_the_definition(n: int, d: int, causal: bool) -> None:
    q, k, v = inputs(Problem(n, d, batch=1, heads=2))
    np.testing.assert_allclose(
        attention_reference(q, k, v, causal), naive_attention(q, k, v, causal), atol=1e-12
    )


def test_reference_is_stable_for_large_scores() -> None:
    q, k, v = inputs(Problem(64, 32, heads=2))
    out = attention_reference(q * 300, k * 300, v, causal=True)
    assert np.isfinite(out).all()
    # Scores this large make softmax a hard max: each row picks one value row.
    assert np.abs(out).max() <= np.abs(v).max() + 1e-9


def test_reference_keeps_leading_dimensions_and_returns_float64() -> None:
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 9, 8), dtype=np.float32) for _ in range(3))
    out = attention_reference(q, k, v, causal=False)
    assert out.shape == q.shape and out.dtype == np.float64
    flat = attention_reference(q.reshape(6, 9, 8), k.reshape(6, 9, 8), v.reshape(6, 9, 8), False)
    np.testing.assert_array_equal(out.reshape(6, 9, 8), flat)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_rows_match_the_whole_output(causal: bool) -> None:
    q, k, v = inputs(Problem(300, 16, batch=2, heads=2))
    whole = attention_reference(q, k, v, causal)
    heads, rows = np.array([0, 3]), np.array([0, 1, 150, 299])
    np.testing.assert_allclose(
        reference_rows(q, k, v, causal, heads, rows), whole[np.ix_(heads, rows)], atol=1e-13
    )


def test_first_causal_row_is_its_own_value() -> None:
    q, k, v = inputs(Problem(17, 8))
    out = attention_reference(q, k, v, causal=True)
    np.testing.assert_allclose(out[:, 0], v[:, 0], atol=1e-12)


def test_scale_log2_folds_the_softmax_scale_into_base_two() -> None:
    assert scale_log2(128) == pytest.approx(1 / math.sqrt(128) / math.log(2))


# Shapes from the brief: odd lengths, every head_dim the kernels are tuned for,
# and partitions with one split, several, and tiles or row blocks past the end.
PARTITIONS = [
    # (tile_size, rows_per_block, threads, split_target)
    (16, 16, 64, 1),
    (32, 64, 128, 2),
    (64, 32, 256, 4),
    (128, 128, 512, 2**16),
]
SHAPES = list(itertools.product([1, 7, 65, 1000], [32, 64, 96, 128]))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n,d", SHAPES, ids=[f"n{n}-d{d}" for n, d in SHAPES])
def test_emulated_tiled_kernel_matches_reference(n: int, d: int, causal: bool) -> None:
    problem = Problem(n, d, batch=1 if n >= 1000 else 2, heads=2, causal=causal)
    q, k, v = inputs(problem, seed=n * d)
    expected = attention_reference(q, k, v, causal)
    # A different partition per shape keeps the matrix fast and still covers each one.
    tile, rows, threads, target = PARTITIONS[(n + d // 32 + causal) % len(PARTITIONS)]
    plan = tiled_plan(problem, tile, rows, threads, target)
    for dtype, tolerance in ((np.float64, FLOAT64_TOLERANCE), (np.float32, FLOAT32_TOLERANCE)):
        got = emulate_tiled(q, k, v, causal, plan, dtype=dtype)
        assert got.dtype == dtype
        assert np.isfinite(got).all()
        assert np.abs(got - expected).max() <= tolerance, (plan.key(), dtype)


def test_matrix_covers_splits_and_partial_tiles() -> None:
    splits, ragged = set(), False
    for (n, d), partition in itertools.product(SHAPES, PARTITIONS):
        plan = tiled_plan(Problem(n, d), *partition)
        splits.add(plan.sequence_splits)
        ragged |= n % plan.tile_size != 0 and plan.sequence_splits > 1
    assert max(splits) > 1 and 1 in splits
    assert ragged


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 80),
    d=st.sampled_from([4, 8, 32, 64]),
    heads=st.integers(1, 3),
    causal=st.booleans(),
    tile=st.sampled_from([4, 8, 16, 32, 64]),
    rows=st.sampled_from([1, 4, 16, 64]),
    target=st.sampled_from([1, 2, 3, 4, 1000]),
    seed=st.integers(0, 2**16),
)
def test_emulation_matches_reference_for_any_partition(
    n: int, d: int, heads: int, causal: bool, tile: int, rows: int, target: int, seed: int
) -> None:
    problem = Problem(n, d, heads=heads, causal=causal)
    q, k, v = inputs(problem, seed)
    plan = tiled_plan(problem, tile, rows, 64, target)
    expected = attention_reference(q, k, v, causal)
    got64 = emulate_tiled(q, k, v, causal, plan, dtype=np.float64)
    assert np.abs(got64 - expected).max() <= FLOAT64_TOLERANCE
    got32 = emulate_tiled(q, k, v, causal, plan, dtype=np.float32)
    assert np.abs(got32 - expected).max() <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("causal", [False, True])
def test_more_splits_than_needed_add_only_empty_partials(causal: bool) -> None:
    q, k, v = inputs(Problem(20, 16, heads=2))
    expected = attention_reference(q, k, v, causal)
    got = emulate_online(
        q,
        k,
        v,
        causal,
        tile_size=4,
        keys_per_split=8,
        rows_per_block=4,
        splits=5,
        dtype=np.float64,
    )
    assert np.abs(got - expected).max() <= FLOAT64_TOLERANCE


@pytest.mark.parametrize("causal", [False, True])
def test_causal_rows_that_see_no_key_in_a_split_do_not_poison_the_merge(causal: bool) -> None:
    # Rows 0..15 see no key of the later splits: their partials are (-inf, 0, 0).
    q, k, v = inputs(Problem(64, 8))
    got = emulate_online(q, k, v, causal, tile_size=16, keys_per_split=16, dtype=np.float32)
    assert np.isfinite(got).all()
    assert np.abs(got - attention_reference(q, k, v, causal)).max() <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d", [(1, 7), (9, 7), (65, 32)])
def test_emulated_scalar_kernel_matches_reference(n: int, d: int, causal: bool) -> None:
    q, k, v = inputs(Problem(n, d, heads=2))
    expected = attention_reference(q, k, v, causal)
    assert np.abs(emulate_scalar(q, k, v, causal, np.float64) - expected).max() <= 1e-12
    assert np.abs(emulate_scalar(q, k, v, causal) - expected).max() <= FLOAT32_TOLERANCE


def test_emulation_follows_any_familys_partition() -> None:
    # The emulation asks the plan's family for its partition: a scalar plan is the
    # one-key-tile online update, i.e. emulate_scalar.
    problem = Problem(64, 32)
    plan = plan_kernel(problem, KernelParams("scalar_online", threads=64), H200)
    q, k, v = inputs(problem)
    assert np.array_equal(emulate_tiled(q, k, v, False, plan), emulate_scalar(q, k, v, False))
