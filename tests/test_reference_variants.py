"""The references know every variant: the float64 reference against formulas written out one
row and one key at a time, and the numpy emulation of the kernels' online softmax against it.

Cases the kernels must get right too: a window smaller than a key tile, window + causal + GQA
with kv_len != seq_len, rows that see no key (output 0), softcap with logits in the hundreds,
ALiBi over 64 heads (and a head count that is no power of two), sinks that dominate, a scale
of the caller's, and the natural-log log-sum-exp a backward pass will read.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention_variants import VariantValues, alibi_slopes
from kernels.reference import attention_reference, emulate_online, reference_rows
from tuner.problem import Problem


def brute_force(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    problem: Problem,
    variants: VariantValues,
) -> tuple[np.ndarray, np.ndarray]:
    """Output and natural-log LSE straight from the definitions, in Python floats.

    q ``[batch*heads, seq_len, d]``, k and v ``[batch*kv_heads, kv_len, d]``.
    """
    bh, n, d = q.shape
    m, off = problem.kv_len, problem.kv_len - problem.seq_len
    scale = 1 / math.sqrt(d) if variants.scale is None else variants.scale
    out, lse = np.zeros((bh, n, d)), np.zeros((bh, n))
    for head in range(bh):
        query_head = head % problem.heads
        kv = head // problem.group
        for r in range(n):
            logits, values = [], []
            for key in range(m):
                if problem.causal and key > r + off:
                    continue
                if variants.window_left >= 0 and key < r + off - variants.window_left:
                    continue
                if variants.window_right >= 0 and key > r + off + variants.window_right:
                    continue
                s = float(np.dot(q[head, r].astype(np.float64), k[kv, key])) * scale
                if variants.softcap > 0:
                    s = variants.softcap * math.tanh(s / variants.softcap)
                if variants.alibi_slopes is not None:
                    s -= variants.alibi_slopes[query_head] * abs(r + off - key)
                logits.append(s)
                values.append(v[kv, key].astype(np.float64))
            sink = None if variants.sinks is None else float(variants.sinks[query_head])
            everything = logits + ([sink] if sink is not None else [])
            if not everything:
                lse[head, r] = math.inf
                continue
            top = max(everything)
            weights = [math.exp(s - top) for s in logits]
            total = sum(weights) + (math.exp(sink - top) if sink is not None else 0.0)
            for weight, value in zip(weights, values, strict=True):
                out[head, r] += weight / total * value
            lse[head, r] = top + math.log(total)
    return out, lse


def draw(problem: Problem, seed: int = 0, spread: float = 1.0):
    rng = np.random.default_rng(seed)
    shape = (problem.batch_heads, problem.seq_len, problem.head_dim)
    kv_shape = (problem.batch_kv_heads, problem.kv_len, problem.head_dim)
    q = rng.standard_normal(shape) * spread
    k = rng.standard_normal(kv_shape) * spread
    v = rng.standard_normal(kv_shape)
    return q, k, v


def reference(q, k, v, problem: Problem, variants: VariantValues):
    return attention_reference(q, k, v, problem.causal, problem.group, variants, lse=True)


def assert_matches_brute_force(problem: Problem, variants: VariantValues, spread: float = 1.0):
    q, k, v = draw(problem, spread=spread)
    out, lse = reference(q, k, v, problem, variants)
    want_out, want_lse = brute_force(q, k, v, problem, variants)
    np.testing.assert_allclose(out, want_out, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
    return out, lse


def test_window_causal_gqa_and_a_kv_cache_match_the_definition() -> None:
    problem = Problem(
        13, 16, batch=2, heads=6, kv_heads=2, kv_len=29, causal=True, window_left=5
    )
    assert problem.windowed and problem.causal_offset == 16
    out, _ = assert_matches_brute_force(problem, VariantValues.of(problem))
    dense = attention_reference(*draw(problem), True, problem.group)
    assert not np.allclose(out, dense)  # the window changed what rows see


def test_a_two_sided_window_and_rows_that_see_no_key() -> None:
    # Not causal, right bound 0 and 4 more queries than keys: rows 0-3 see no key at all.
    problem = Problem(12, 8, heads=2, kv_len=8, window_left=2, window_right=0)
    out, lse = assert_matches_brute_force(problem, VariantValues.of(problem))
    assert np.all(out[:, :4] == 0) and np.all(np.isinf(lse[:, :4])) and np.all(lse[:, :4] > 0)
    assert np.all(np.isfinite(lse[:, 4:]))


def test_softcap_with_logits_in_the_hundreds() -> None:
    problem = Problem(9, 32, heads=2, causal=True, softcap=30.0)
    q, k, _ = draw(problem, spread=12.0)
    raw = np.abs(q @ k.transpose(0, 2, 1)).max() / math.sqrt(32)
    assert raw > 300  # the cap has work to do
    out, lse = assert_matches_brute_force(problem, VariantValues.of(problem), spread=12.0)
    assert np.all(lse <= 30.0 + math.log(problem.kv_len) + 1e-9)  # every logit below the cap


def test_alibi_over_64_heads() -> None:
    problem = Problem(7, 8, heads=64, kv_heads=8, kv_len=20, alibi=True)
    slopes = alibi_slopes(64)
    assert_matches_brute_force(problem, VariantValues.of(problem, alibi_slopes=slopes))


def test_sinks_that_dominate_take_the_weight_and_the_lse() -> None:
    problem = Problem(6, 16, batch=2, heads=3, causal=True, kv_len=10, sinks=True)
    sinks = np.array([40.0, 0.5, -3.0])  # head 0's sink far above every logit
    out, lse = assert_matches_brute_force(problem, VariantValues.of(problem, sinks=sinks))
    for batch in range(2):
        assert np.abs(out[3 * batch]).max() < 1e-12
        np.testing.assert_allclose(lse[3 * batch], 40.0, rtol=1e-12)
    plain = reference(*draw(problem), problem, VariantValues.of(problem, sinks=[-1e9] * 3))
    assert np.abs(out[1] - plain[0][1]).max() > 1e-2  # a sink near the logits matters


def test_every_variant_at_once_with_a_scale_of_the_callers() -> None:
    problem = Problem(
        11, 16, batch=2, heads=4, kv_heads=2, kv_len=17, causal=True,
        window_left=6, softcap=5.0, alibi=True, sinks=True,
    )
    values = VariantValues.of(
        problem, alibi_slopes=alibi_slopes(4), sinks=[0.3, 2.0, -1.0, 4.0], scale=0.4
    )
    out, _ = assert_matches_brute_force(problem, values, spread=3.0)
    default_scale = VariantValues.of(problem, alibi_slopes=alibi_slopes(4), sinks=values.sinks)
    other = reference(*draw(problem, spread=3.0), problem, default_scale)[0]
    assert np.abs(out - other).max() > 1e-3


def test_sampled_rows_carry_the_variants_of_their_heads() -> None:
    problem = Problem(
        40, 16, batch=2, heads=4, kv_heads=1, kv_len=50, causal=True,
        window_left=7, alibi=True, sinks=True,
    )
    values = VariantValues.of(problem, alibi_slopes=alibi_slopes(4), sinks=[1.0, 2.0, 3.0, 4.0])
    q, k, v = draw(problem)
    whole, whole_lse = reference(q, k, v, problem, values)
    heads, rows = np.array([1, 6]), np.array([0, 17, 39])
    part, part_lse = reference_rows(
        q, k, v, True, heads, rows, problem.group, values, lse=True
    )
    np.testing.assert_allclose(part, whole[np.ix_(heads, rows)], atol=1e-14)
    np.testing.assert_allclose(part_lse, whole_lse[np.ix_(heads, rows)], rtol=1e-14)


@pytest.mark.parametrize(
    ("heads", "expected"),
    [
        (1, [2.0**-8]),
        (8, [2.0 ** -(h + 1) for h in range(8)]),
        # 12 heads: the 8-head slopes, then 16-head slopes 1, 3, 5, 7 (BLOOM)
        (12, [2.0 ** -(h + 1) for h in range(8)] + [2.0 ** -(p / 2) for p in (1, 3, 5, 7)]),
    ],
)
def test_alibi_slopes_are_the_standard_ones(heads: int, expected: list[float]) -> None:
    np.testing.assert_allclose(alibi_slopes(heads), expected, rtol=0)


def bloom_slopes(heads: int) -> list[float]:
    """BLOOM's ``build_alibi_tensor`` slopes, as transformers writes them."""
    closest = 2 ** math.floor(math.log2(heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base**power for power in range(1, 1 + closest)]
    if closest != heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, heads - closest)
        slopes += [extra_base**power for power in range(1, 1 + 2 * remaining, 2)]
    return slopes


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 12, 20, 32, 40, 64, 96, 100])
def test_alibi_slopes_follow_bloom_for_any_head_count(heads: int) -> None:
    np.testing.assert_allclose(alibi_slopes(heads), bloom_slopes(heads), rtol=1e-13)
    assert heads & (heads - 1) or np.allclose(
        alibi_slopes(heads), [2.0 ** (-8 * (h + 1) / heads) for h in range(heads)]
    )


def test_variant_values_must_match_the_problem() -> None:
    problem = Problem(8, 16, heads=4, alibi=True)
    with pytest.raises(ValueError, match=r"has alibi but no alibi_slopes"):
        VariantValues.of(problem)
    with pytest.raises(ValueError, match=r"alibi_slopes has 3 values; the problem has 4"):
        VariantValues.of(problem, alibi_slopes=[1, 2, 3])
    with pytest.raises(ValueError, match=r"sinks given for a problem without"):
        VariantValues.of(problem, alibi_slopes=alibi_slopes(4), sinks=[0, 0, 0, 0])


# ---------------------------------------------------------------------------- the emulation


def emulated(problem: Problem, values: VariantValues, tile: int, keys_per_split: int, **kw):
    q, k, v = draw(problem, spread=kw.pop("spread", 1.0))
    out = emulate_online(
        q, k, v, problem.causal, tile_size=tile, keys_per_split=keys_per_split,
        dtype=np.float64, variants=values, **kw,
    )
    return out, reference(q, k, v, problem, values)[0]


def test_the_emulation_takes_a_window_smaller_than_a_tile() -> None:
    # A 3-key band inside 16-key tiles: most tiles hold no visible key for most rows.
    problem = Problem(70, 16, heads=2, causal=True, window_left=2)
    for keys_per_split in (70, 32, 16):
        out, want = emulated(problem, VariantValues.of(problem), 16, keys_per_split)
        np.testing.assert_allclose(out, want, atol=1e-12)


def test_the_emulation_gives_rows_without_keys_a_zero_output() -> None:
    problem = Problem(40, 8, heads=2, window_left=3, window_right=-1)
    values = VariantValues(window_left=3, window_right=0)  # each row: its 3 keys before, itself
    out, want = emulated(problem, values, 8, 16)
    np.testing.assert_allclose(out, want, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 48),
    tile=st.sampled_from([1, 4, 16]),
    split_tiles=st.integers(1, 4),
    causal=st.booleans(),
    window_left=st.integers(-1, 20),
    window_right=st.integers(-1, 20),
    softcap=st.sampled_from([0.0, 2.0, 40.0]),
    alibi=st.booleans(),
    sinks=st.booleans(),
)
def test_the_emulation_follows_the_reference_for_any_variant_and_partition(
    n, tile, split_tiles, causal, window_left, window_right, softcap, alibi, sinks
) -> None:
    problem = Problem(
        n, 8, heads=3, causal=causal, window_left=window_left, window_right=window_right,
        softcap=softcap, alibi=alibi, sinks=sinks,
    )
    values = VariantValues.of(
        problem,
        alibi_slopes=alibi_slopes(3) if alibi else None,
        sinks=[0.5, 3.0, -2.0] if sinks else None,
        scale=0.7,
    )
    out, want = emulated(problem, values, tile, tile * split_tiles, rows_per_block=4, spread=3.0)
    np.testing.assert_allclose(out, want, atol=1e-11)
