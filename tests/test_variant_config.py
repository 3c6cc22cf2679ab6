"""The attention variants as configuration: keys, one-line refusals, the problem they make,
what ``mode=plan`` shows, and study names (plain problems keep theirs exactly)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from tuner.config import problem_from, typed_config, validate
from tuner.dry_run import print_plan_space
from tuner.environment import Environment
from tuner.errors import ConfigError
from tuner.problem import Problem
from tuner.study_names import study_name

CONF_DIR = Path(__file__).resolve().parents[1] / "tuner" / "conf"
ENVIRONMENT = Environment("NVIDIA H200", "9.0", 132, "580", "13.0", "13.0.1", "2026.1")
SHAPE = ("seq_len=4096", "head_dim=128", "heads=8", "kv_heads=2", "causal=true")


@pytest.fixture(scope="module", autouse=True)
def hydra_conf_dir() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def load(*overrides: str):
    return typed_config(compose(config_name="config", overrides=[*SHAPE, *overrides]))


def test_the_defaults_are_no_variant() -> None:
    problem = problem_from(load())
    assert not problem.has_variant
    assert problem == Problem(4096, 128, heads=8, kv_heads=2, causal=True, dtype="bfloat16")


def test_every_variant_key_reaches_the_problem() -> None:
    problem = problem_from(
        load("window_left=1024", "softcap=50", "alibi=true", "sinks=true", "dtype=float16")
    )
    assert problem == Problem(
        4096, 128, heads=8, kv_heads=2, causal=True, dtype="float16",
        window_left=1024, softcap=50.0, alibi=True, sinks=True,
    )
    assert problem.softcap == 50.0 and isinstance(problem.softcap, float)
    both = problem_from(load("causal=false", "window_left=128", "window_right=64"))
    assert (both.window_left, both.window_right) == (128, 64)
    # A window that cuts nothing at this length is no window (one identity per visible set).
    assert not problem_from(load("window_left=8192")).windowed


@pytest.mark.parametrize(
    ("override", "allowed"),
    [
        ("window_left=-2", "an integer in 0..2147483647, or -1 for no bound on that side"),
        ("window_right=1.5", "an integer in 0..2147483647, or -1 for no bound on that side"),
        ("window_left=true", "an integer in 0..2147483647, or -1"),
        ("window_left=2147483648", "an integer in 0..2147483647"),
        ("window_right=abc", "an integer in 0..2147483647"),
        ("softcap=-1", "a number >= 0 (0: no cap)"),
        ("softcap=abc", "a number >= 0 (0: no cap)"),
        ("softcap=inf", "a number >= 0 (0: no cap)"),
        ("softcap=true", "a number >= 0"),
        ("alibi=1", "true or false"),
        ("sinks=maybe", "true or false"),
    ],
)
def test_bad_variant_values_are_one_line_naming_key_value_and_what_is_allowed(
    override: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        validate(load(override))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{override} is invalid: must be {allowed}"), message


def test_plan_mode_shows_the_variants(capsys: pytest.CaptureFixture[str]) -> None:
    print_plan_space(validate(load("window_left=1024", "softcap=30", "sinks=true", "plan_rows=2")))
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(
        "problem: 1x8/2x4096x128 bfloat16 causal window=1024 softcap=30 sinks (batch=1 heads=8 "
    )
    assert re.search(r" window_left=1024 window_right=-1 softcap=30 sinks=true\); ", first), first
    windowed = Problem(4096, 128, heads=8, kv_heads=2, causal=True, window_left=1024)
    gflop = 4 * 8 * windowed.attended_pairs * 128 / 1e9
    assert f"; {gflop:.3g} GFLOP," in first  # the window's pairs only


def test_study_names_of_plain_problems_are_unchanged() -> None:
    sources = {"mma_f16": "h"}
    for problem, start in [
        (Problem(4096, 128, batch=4, heads=16, causal=True, dtype="bfloat16"),
         "4x16x4096x128-bfloat16-causal@nvidia-h200-"),
        (Problem(1, 128, heads=32, kv_heads=8, kv_len=8192, dtype="bfloat16"),
         "1x32kv8x1kv8192x128-bfloat16-full@nvidia-h200-"),
        (Problem(1000, 128, heads=16, precision="tf32"), "1x16x1000x128-float32-tf32-full@"),
        # a window that cuts nothing is no window: the plain name
        (Problem(2048, 128, causal=True, window_left=4096), "1x1x2048x128-float32-causal@"),
    ]:
        name = study_name(problem, ENVIRONMENT, sources, sampler="model")
        assert name.startswith(start) and name.endswith("-model"), name
        assert re.fullmatch(r"[^@]+@nvidia-h200-[0-9a-f]{12}-model", name), name


@pytest.mark.parametrize(
    ("variants", "suffix"),
    [
        ({"window_left": 4096}, "-w4096"),
        ({"window_left": 256, "window_right": 0}, "-w256-wr0"),
        ({"window_right": 128}, "-wr128"),
        ({"softcap": 50.0}, "-cap50"),
        ({"softcap": 2.5}, "-cap2.5"),
        ({"window_left": 4096, "softcap": 50.0, "alibi": True, "sinks": True},
         "-w4096-cap50-alibi-sinks"),
    ],
)
def test_study_names_carry_a_readable_variant_suffix(variants: dict, suffix: str) -> None:
    problem = Problem(16384, 128, heads=32, kv_heads=8, dtype="bfloat16", **variants)
    name = study_name(problem, ENVIRONMENT, {"mma_f16": "h"}, sampler="tpe")
    assert name.startswith(f"1x32kv8x16384x128-bfloat16-full{suffix}@nvidia-h200-"), name
    plain = study_name(
        Problem(16384, 128, heads=32, kv_heads=8, dtype="bfloat16"), ENVIRONMENT, {"mma_f16": "h"}
    )
    assert name.replace(suffix, "", 1) == plain
