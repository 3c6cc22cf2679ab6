"""A model x serving buckets -> its distinct attention problems (``tuner.llm.problems``),
which of them the planner serves (``tuner.llm.servable``), and how the table names the
layers they serve (``tuner.llm.summary``)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from tuner.device import H200
from tuner.llm.attention import ModelAttention
from tuner.llm.config_json import read_config_json
from tuner.llm.problems import (
    DECODE,
    PREFILL,
    Bucket,
    expand_problems,
    serving_buckets,
)
from tuner.llm.servable import sort_by_planner
from tuner.llm.summary import kv_bytes_read, layers_text
from tuner.planner.space import SpaceAxes
from tuner.problem import Problem

CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"
DEFAULT_BUCKETS = serving_buckets([1024, 4096, 8192], 1, [1, 16, 64], [2048, 8192])


def model(name: str) -> ModelAttention:
    return read_config_json(str(CONFIGS / f"{name}.json"))


def test_default_buckets() -> None:
    assert [b.label() for b in DEFAULT_BUCKETS] == [
        "prefill 1x1024",
        "prefill 1x4096",
        "prefill 1x8192",
        "decode 1x2048",
        "decode 1x8192",
        "decode 16x2048",
        "decode 16x8192",
        "decode 64x2048",
        "decode 64x8192",
    ]
    assert serving_buckets([2048, 2048], 2, [], [8192]) == (Bucket(PREFILL, 2, 2048),)


def test_a_bucket_makes_the_layer_s_problem() -> None:
    llama = model("llama-3.1-8b")
    assert Bucket(PREFILL, 2, 4096).problem(llama, 0, "bfloat16") == Problem(
        4096, 128, batch=2, heads=32, kv_heads=8, causal=True, dtype="bfloat16"
    )
    # Decode: one query row per sequence against the KV cache, bottom-right causal.
    assert Bucket(DECODE, 16, 8192).problem(llama, 5, "float16") == Problem(
        1, 128, batch=16, heads=32, kv_heads=8, kv_len=8192, causal=True, dtype="float16"
    )


def test_llama_is_one_problem_per_bucket_served_by_every_layer() -> None:
    problems = expand_problems(model("llama-3.1-8b"), DEFAULT_BUCKETS, "bfloat16")
    assert [p.buckets for p in problems] == [(b,) for b in DEFAULT_BUCKETS]
    assert all(p.uses[0].layers == tuple(range(32)) for p in problems)
    assert {p.problem.kv_heads for p in problems} == {8}
    assert [p.kind for p in problems] == [PREFILL] * 3 + [DECODE] * 6
    assert all(p.scale == pytest.approx(1 / math.sqrt(128)) for p in problems)


def test_gemma_2_layers_share_a_problem_where_the_window_cuts_nothing() -> None:
    gemma = model("gemma-2-9b")
    problems = expand_problems(gemma, DEFAULT_BUCKETS, "bfloat16")
    by_bucket: dict[str, list] = {}
    for p in problems:
        (use,) = p.uses
        by_bucket.setdefault(use.bucket.label(), []).append((p.problem, use.layers))
    # At 4096 tokens the 4096-key window cuts nothing: sliding and global layers are one.
    ((prefill_4096, layers),) = by_bucket["prefill 1x4096"]
    assert layers == tuple(range(42)) and not prefill_4096.windowed
    assert prefill_4096.softcap == 50.0
    # At 8192 they are two problems, the sliding one with FlashAttention's bound 4095.
    (sliding, even), (full, odd) = by_bucket["prefill 1x8192"]
    assert (sliding.window_left, even) == (4095, tuple(range(0, 42, 2)))
    assert (full.window_left, odd) == (-1, tuple(range(1, 42, 2)))
    assert dataclasses.replace(sliding, window_left=-1) == full
    # Decode at 2048 keys: one problem; at 8192: two.
    assert len(by_bucket["decode 16x2048"]) == 1 and len(by_bucket["decode 16x8192"]) == 2
    assert len(problems) == 13
    # The scale is 1/sqrt(query_pre_attn_scalar), carried for the deployment, not tuned.
    assert {p.scale for p in problems} == {1 / 16}


def test_mistral_at_a_short_prefill_is_the_plain_causal_problem() -> None:
    mistral, llama_like = model("mistral-7b-v0.1"), model("llama-3.1-8b")
    buckets = serving_buckets([2048, 8192], 1, [1], [2048])
    problems = expand_problems(mistral, buckets, "bfloat16")
    assert [p.problem for p in problems][0] == (
        expand_problems(llama_like, buckets, "bfloat16")[0].problem
    )
    assert [p.problem.window_left for p in problems] == [-1, 4095, -1]


def test_gpt_oss_sliding_and_full_layers_with_sinks() -> None:
    problems = expand_problems(model("gpt-oss-20b"), serving_buckets([1024], 1, [], []), "bfloat16")
    sliding, full = problems
    assert (sliding.problem.window_left, sliding.uses[0].layers) == (127, tuple(range(0, 24, 2)))
    assert (full.problem.window_left, full.uses[0].layers) == (-1, tuple(range(1, 24, 2)))
    assert sliding.problem.sinks and full.problem.sinks


def test_a_problem_served_by_two_buckets_records_both() -> None:
    # A prefill of one token is the decode step against one key.
    buckets = serving_buckets([1], 4, [4], [1])
    (only,) = expand_problems(model("llama-3.1-8b"), buckets, "bfloat16")
    assert only.buckets == (Bucket(PREFILL, 4, 1), Bucket(DECODE, 4, 1))


def test_the_planner_decides_what_is_skipped_and_says_why() -> None:
    attention = ModelAttention(
        "odd", heads=8, kv_heads=8, head_dim=1000, layer_windows=(None,), scale=1.0
    )
    buckets = serving_buckets([512], 1, [], [])
    problems = expand_problems(attention, buckets, "bfloat16")
    spaces, skipped = sort_by_planner(problems, H200, SpaceAxes())
    assert not spaces
    (entry,) = skipped
    assert entry.reason.startswith("no feasible candidate on NVIDIA H200 (all ")
    assert "first: " in entry.reason


def test_a_problem_past_the_kernels_indexing_is_skipped_with_the_planner_s_error() -> None:
    llama = model("llama-3.1-8b")
    problems = expand_problems(llama, serving_buckets([4096, 1048576], 1, [], []), "bfloat16")
    spaces, skipped = sort_by_planner(problems, H200, SpaceAxes())
    assert list(spaces) == [problems[0].problem] and spaces[problems[0].problem].feasible
    (entry,) = skipped
    assert entry.model_problem is problems[1]
    assert entry.reason.startswith("cannot be planned: ") and "overflows u32" in entry.reason


def test_search_settings_narrow_what_the_planner_serves() -> None:
    problems = expand_problems(model("llama-3.1-8b"), DEFAULT_BUCKETS[:1], "bfloat16")
    _, skipped = sort_by_planner(problems, H200, SpaceAxes(families=("tiled",)))
    (entry,) = skipped
    assert "no feasible candidate" in entry.reason


@pytest.mark.parametrize(
    ("layers", "total", "text"),
    [
        (range(32), 32, "all 32"),
        (range(0, 42, 2), 42, "even (21)"),
        (range(1, 42, 2), 42, "odd (21)"),
        ((0, 1, 2, 3, 8, 10, 11, 12), 16, "0-3,8,10-12"),
        ((5, 11, 17), 34, "5,11,17"),
        ((0,), 2, "0"),
    ],
)
def test_layers_text(layers: range | tuple[int, ...], total: int, text: str) -> None:
    assert layers_text(tuple(layers), total) == text


def test_kv_bytes_read_counts_the_window_s_keys() -> None:
    full = Problem(
        1, 128, batch=16, heads=32, kv_heads=8, kv_len=8192, causal=True, dtype="bfloat16"
    )
    assert kv_bytes_read(full) == 2 * 16 * 8 * 8192 * 128 * 2 == 2 * full.kv_tensor_bytes
    windowed = dataclasses.replace(full, window_left=4095)
    assert kv_bytes_read(windowed) == kv_bytes_read(full) // 2
