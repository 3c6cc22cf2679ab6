"""One compiled kernel serves every KV length of a bucket (``tuner.planner.kernel_variant``).

For every registered family that takes the dtype, feasible candidates of a KV-cache problem
at a bucket's length keep their compile defines, block and shared memory at every shorter
length of the bucket, and the re-planned partition there keeps the split-KV contract (whole
tiles per split, every split holding keys, every visible key in some split). New buckets pick
among the launch choices of a kernel already chosen. Pure: no GPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kernels.kv_buckets import MIN_KV_BUCKET, bucket_of, kv_bucket, length_family
from tuner.device import H200
from tuner.planner.families import families_for
from tuner.planner.kernel_variant import launch_choices, launch_tunables, plan_at, same_kernel
from tuner.planner.key_span import key_span
from tuner.planner.space import candidate_space
from tuner.problem import Problem

DECODE = Problem(1, 128, batch=2, heads=16, causal=True, dtype="bfloat16", kv_heads=4, kv_len=1024)
#: chunked prefill against a cache, a sliding window that cuts keys, softcap and sinks
CHUNKED = Problem(
    64, 64, heads=4, causal=True, dtype="float16", kv_heads=2, kv_len=512, window_left=200,
    softcap=30.0, sinks=True,
)
FLOAT32 = Problem(1, 64, batch=2, heads=8, kv_heads=2, kv_len=256)


def test_kv_buckets_round_up_to_powers_of_two_from_the_smallest() -> None:
    assert [kv_bucket(n) for n in (1, 63, 64, 65, 513, 1024, 1025)] == [
        MIN_KV_BUCKET, 64, 64, 128, 1024, 1024, 2048
    ]
    with pytest.raises(ValueError, match="kv_len=0"):
        kv_bucket(0)


def test_self_attention_is_its_own_bucket_and_a_cache_is_rounded_up() -> None:
    prefill = Problem(500, 128, heads=4, causal=True, dtype="bfloat16")
    assert bucket_of(prefill) is prefill
    decode = replace(DECODE, kv_len=513)
    assert bucket_of(decode) == replace(DECODE, kv_len=1024)
    assert length_family(decode) == length_family(DECODE)
    assert length_family(decode) != length_family(replace(decode, batch=4))


def test_a_window_keeps_its_canonical_form_in_the_bucket() -> None:
    """A window that cuts nothing at the exact length is none in the bucket either; one
    that cuts keeps its bound (the bucket's kernel has the exact problem's variant)."""
    uncut = Problem(1, 64, causal=True, dtype="bfloat16", kv_len=600, window_left=700)
    assert uncut.window_left == -1 and bucket_of(uncut).window_left == -1
    cut = replace(uncut, window_left=300)
    assert bucket_of(cut) == replace(cut, kv_len=1024) and bucket_of(cut).window_left == 300


def sampled(plans: tuple, per_family: int = 8) -> list:
    """Up to ``per_family`` plans of each family, spread over its candidates."""
    picked = []
    for family in {plan.params.family for plan in plans}:
        own = [plan for plan in plans if plan.params.family == family]
        picked += own[:: max(1, len(own) // per_family)]
    return picked


@pytest.mark.parametrize(
    ("problem", "families"),
    [(DECODE, 3), (CHUNKED, 2), (FLOAT32, 3)],  # decode_f16 takes up to 16 query rows
    ids=["decode", "chunked", "f32"],
)
def test_every_family_serves_every_length_of_a_bucket_with_one_kernel(
    problem: Problem, families: int
) -> None:
    space = candidate_space(problem, H200)
    assert len({plan.params.family for plan in space.feasible}) == families
    assert families_for(problem.dtype)
    lengths = sorted({problem.kv_len // 2 + 1, problem.kv_len // 2 + 37, problem.kv_len - 1})
    for plan in sampled(space.feasible):
        for kv_len in lengths:
            exact = replace(problem, kv_len=kv_len)
            at = plan_at(plan, exact, H200)
            assert not isinstance(at, str), f"{plan.key()} at kv_len={kv_len}: {at}"
            assert at.problem == exact and same_kernel(at, plan) and at.feasible
            base, end = key_span(exact)
            splits, keys = at.sequence_splits, at.keys_per_sequence_split
            assert keys % at.tile_size == 0 or keys == exact.kv_len, plan.key()
            assert (splits - 1) * keys < max(end - base, 1) <= splits * keys, plan.key()
            assert splits <= plan.sequence_splits and at.launch.grid[1] == splits
            assert at.partial_elements <= plan.partial_elements


def test_a_plan_serves_only_its_own_problem_at_no_longer_length() -> None:
    plan = min(candidate_space(DECODE, H200).feasible, key=lambda p: p.key())
    assert plan_at(plan, DECODE, H200) is plan
    longer = plan_at(plan, replace(DECODE, kv_len=2048), H200)
    assert longer == "kv_len=2048 is longer than the plan's 1024"
    other = plan_at(plan, replace(DECODE, kv_len=600, heads=8), H200)
    assert isinstance(other, str) and "is not" in other


def test_a_new_bucket_picks_among_the_launch_choices_of_a_chosen_kernel() -> None:
    space = candidate_space(DECODE, H200)
    split = next(p for p in space.feasible if p.family == "decode_f16" and p.sequence_splits > 2)
    assert [t.name for t in launch_tunables(split, H200)] == ["splits"]
    longer = replace(DECODE, kv_len=8192)
    choices = launch_choices(longer, split, H200)
    assert len(choices) >= 5 and all(same_kernel(c, split) and c.feasible for c in choices)
    assert {c.params.tunables["splits"] for c in choices} >= {1, 2, 4, 8, 16}
    others = {k: v for k, v in split.params.tunables.items() if k != "splits"}
    assert all(
        {k: v for k, v in c.params.tunables.items() if k != "splits"} == others for c in choices
    )
