"""Direction as part of the problem: validation, labels and study names (forward ones as they
were), FLOPs (backward 2.5x the forward's), the ``direction`` config key, and the planner's
refusals across directions."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from tuner.config import ConfigError, problem_from, typed_config, validate
from tuner.environment import Environment
from tuner.problem import Problem
from tuner.study_names import study_name

CONF_DIR = Path(__file__).resolve().parents[1] / "tuner" / "conf"
H200 = Environment("NVIDIA H200", "9.0", 132, "580.159", "13.0", "13.0.88", "2026.1")


@pytest.fixture(scope="module", autouse=True)
def hydra_conf_dir() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def test_direction_defaults_to_forward_and_is_checked() -> None:
    assert Problem(64, 64).direction == "forward" and not Problem(64, 64).backward
    assert Problem(64, 64, direction="backward").backward
    with pytest.raises(ValueError, match="direction='sideways' is not one of forward, backward"):
        Problem(64, 64, direction="sideways")


def test_forward_labels_and_names_are_unchanged_backward_ones_say_so() -> None:
    forward = Problem(4096, 128, batch=4, heads=16, causal=True, dtype="bfloat16")
    backward = dataclasses.replace(forward, direction="backward")
    assert forward.label() == "4x16x4096x128 bfloat16 causal"
    assert backward.label() == "4x16x4096x128 bfloat16 causal backward"
    hashes = {"mma_f16": "a", "mma_f16_bwd": "b"}
    name = study_name(forward, H200, hashes, sampler="model")
    assert name.startswith("4x16x4096x128-bfloat16-causal@nvidia-h200-")
    backward_name = study_name(backward, H200, hashes, sampler="model")
    assert backward_name == name.replace("-causal@", "-causal-backward@")


def test_backward_flops_are_two_and_a_half_forwards() -> None:
    forward = Problem(1000, 64, batch=2, heads=4, causal=True, dtype="float16")
    backward = dataclasses.replace(forward, direction="backward")
    assert forward.useful_flops == 4 * 8 * forward.attended_pairs * 64
    assert 2 * backward.useful_flops == 5 * forward.useful_flops


def test_the_direction_key_reaches_the_problem() -> None:
    shape = ["seq_len=4096", "head_dim=128"]
    config = typed_config(compose(config_name="config", overrides=shape))
    assert config.direction == "forward" and problem_from(config).direction == "forward"
    config = typed_config(compose(config_name="config", overrides=[*shape, "direction=backward"]))
    assert problem_from(config) == Problem(4096, 128, dtype="bfloat16", direction="backward")
    validated = validate(config)
    assert validated.problem.backward


def test_a_bad_direction_and_a_backward_dtype_without_a_family_are_one_line() -> None:
    shape = ["seq_len=64", "head_dim=64"]
    config = typed_config(compose(config_name="config", overrides=[*shape, "direction=up"]))
    with pytest.raises(ConfigError, match=r"^direction=up is invalid: must be one of forward"):
        problem_from(config)
    config = typed_config(
        compose(config_name="config", overrides=[*shape, "direction=backward", "dtype=float32"])
    )
    with pytest.raises(ConfigError) as caught:
        validate(config)
    message = str(caught.value)
    assert "no registered kernel family takes it in the backward direction" in message
    assert "\n" not in message and "mma_f16_bwd (bfloat16/float16, backward)" in message


def test_the_run_table_of_a_backward_study_adds_the_forward_and_the_sum() -> None:
    from tuner.report import best_table
    from tuner.trials import SearchResult, TrialOutcome

    def trial(number: int, key: str, ms: float, forward_ms: float | None) -> TrialOutcome:
        return TrialOutcome(number, "COMPLETE", "measured", key, {}, measured=True,
                            median_ms=ms, forward_ms=forward_ms)  # fmt: skip

    backward = SearchResult("s", "sqlite://", [trial(0, "a", 2.0, 1.25), trial(1, "b", 3.0, 1.25)])
    lines = best_table(backward).splitlines()
    assert lines[0].split()[:6] == ["rank", "plan", "median", "ms", "forward", "ms"]
    assert "fwd+bwd ms" in lines[0]
    assert lines[2].split()[2:5] == ["2.0000", "1.2500", "3.2500"]
    forward = SearchResult("s", "sqlite://", [trial(0, "a", 2.0, None)])
    assert "fwd+bwd" not in best_table(forward)
