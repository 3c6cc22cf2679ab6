"""float32's precision key: the problem, config validation, names, parity rules and call checks.

``tf32x3`` (the default: float32-class error) and ``tf32`` (one-pass TF32 plans
allowed) are float32's precisions; the half dtypes refuse both. The accurate
precision never shows in a label or study name, so every problem from before
the key keeps its identity.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from kernels.attention_args import AttentionInputError, check_precision
from kernels.precision import (
    FALLBACK_TOLERANCE,
    FLOOR,
    TF32_FLOOR,
    round_to_tf32,
    tf32_emulation_error,
    tolerance_for,
)
from kernels.reference import reference_rows
from tuner.config import typed_config, validate
from tuner.environment import Environment
from tuner.errors import ConfigError
from tuner.planner.seed import FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
from tuner.problem import Problem
from tuner.study_names import study_name

CONF_DIR = Path(__file__).resolve().parents[1] / "tuner" / "conf"
H200 = Environment("NVIDIA H200", "9.0", 132, "580.159", "13.0", "13.0.88", "2026.1")


@pytest.fixture(scope="module")
def hydra_conf_dir() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def validated(*overrides: str):
    config = compose(config_name="config", overrides=["seq_len=1000", "head_dim=128", *overrides])
    return validate(typed_config(config))


# ---------------------------------------------------------------------------- the problem


def test_float32_defaults_to_the_accurate_precision_and_half_types_have_none() -> None:
    assert Problem(64, 64).precision == "tf32x3"
    assert Problem(64, 64) == Problem(64, 64, precision="tf32x3")
    assert Problem(64, 64, precision="tf32") != Problem(64, 64)
    assert Problem(64, 64, dtype="bfloat16").precision == ""
    with pytest.raises(ValueError, match="applies to float32 only"):
        Problem(64, 64, dtype="float16", precision="tf32")
    with pytest.raises(ValueError, match="is not one of tf32x3, tf32"):
        Problem(64, 64, precision="fp32")


def test_labels_and_study_names_of_existing_problems_are_unchanged() -> None:
    assert Problem(1000, 128, 1, 16).label() == "1x16x1000x128 float32 full"
    assert Problem(4096, 128, dtype="bfloat16", causal=True).label() == (
        "1x1x4096x128 bfloat16 causal"
    )
    assert Problem(1000, 128, 1, 16, precision="tf32").label() == (
        "1x16x1000x128 float32-tf32 full"
    )
    sources = {"mma_tf32": "abc"}
    accurate = study_name(Problem(1000, 128, 1, 16), H200, sources)
    fast = study_name(Problem(1000, 128, 1, 16, precision="tf32"), H200, sources)
    assert accurate.startswith("1x16x1000x128-float32-full@nvidia-h200-")
    assert fast.startswith("1x16x1000x128-float32-tf32-full@nvidia-h200-")


# ---------------------------------------------------------------------------- config


def test_config_precision_reaches_the_problem(hydra_conf_dir: None) -> None:
    assert validated("dtype=float32").problem.precision == "tf32x3"
    assert validated("dtype=float32", "precision=tf32x3").problem.precision == "tf32x3"
    assert validated("dtype=float32", "precision=tf32").problem.precision == "tf32"
    assert validated().problem.precision == ""  # bfloat16, the default dtype


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (("precision=tf32",), "precision=tf32 is invalid: it applies to dtype=float32 only"),
        (("dtype=float16", "precision=tf32x3"), "precision=tf32x3 is invalid"),
        (("dtype=float32", "precision=fp64"), "precision=fp64 is invalid: must be one of"),
    ],
)
def test_config_refuses_a_precision_that_does_not_apply(
    hydra_conf_dir: None, overrides: tuple[str, ...], words: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        validated(*overrides)
    message = str(caught.value)
    assert words in message and "\n" not in message


# ---------------------------------------------------------------------------- calls


def test_attention_calls_check_the_precision_against_the_dtype() -> None:
    assert check_precision(None, "float32") == "tf32x3"
    assert check_precision("tf32", "float32") == "tf32"
    assert check_precision(None, "bfloat16") == ""
    with pytest.raises(AttentionInputError, match="applies to float32 inputs only"):
        check_precision("tf32x3", "bfloat16")
    with pytest.raises(AttentionInputError, match="must be one of tf32x3, tf32"):
        check_precision("fast", "float32")


# ---------------------------------------------------------------------------- parity rules


def test_round_to_tf32_keeps_ten_bits_rounding_to_nearest_ties_away() -> None:
    one_ulp = 2.0**-10
    values = np.array(
        [1.0, 1 + one_ulp / 2, 1 + one_ulp / 2 - 2**-20, -(1 + one_ulp / 2), 3.14159265], np.float32
    )
    rounded = round_to_tf32(values)
    assert rounded[0] == 1.0
    assert rounded[1] == 1 + one_ulp  # a tie goes away from zero
    assert rounded[2] == 1.0
    assert rounded[3] == -(1 + one_ulp)
    assert (rounded.view(np.uint32) & 0x1FFF == 0).all()
    assert abs(rounded[4] - values[4]) <= 2.0 ** -11 * abs(values[4])


def test_tolerances_per_precision() -> None:
    accurate, fast = Problem(1000, 128), Problem(1000, 128, precision="tf32")
    assert tolerance_for(accurate, 3e-7) == pytest.approx(6e-7 + FLOOR["float32"])
    assert tolerance_for(accurate, None) == FALLBACK_TOLERANCE["float32"]
    assert tolerance_for(accurate, 0.1) == FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS  # the seed's cap
    assert tolerance_for(fast, 3e-7, 4e-4) == pytest.approx(8e-4 + TF32_FLOOR)
    with pytest.raises(ValueError):
        tolerance_for(fast, 3e-7)
    assert tolerance_for(Problem(64, 64, dtype="bfloat16"), 1e-3) == 2e-3 + FLOOR["bfloat16"]


def test_tf32_emulation_errs_about_a_thousand_times_more_than_float32() -> None:
    """The classes the rules keep apart: a TF32 pass errs by ~2e-4 on unit normals, far
    above the float32 floor and fallback (float32-class kernels err by ~5e-7)."""
    rng = np.random.default_rng(3)
    problem = Problem(300, 64, heads=2, precision="tf32")
    q, k, v = (rng.standard_normal((2, 300, 64), dtype=np.float32) for _ in range(3))
    heads, rows = np.arange(2), np.arange(0, 300, 7)
    expected = reference_rows(q, k, v, False, heads, rows)
    error = tf32_emulation_error(problem, q, k, v, expected, heads, rows)
    assert 1e-4 < error < 1e-2
    assert error > 30 * FALLBACK_TOLERANCE["float32"] > 90 * FLOOR["float32"]
    causal = Problem(300, 64, heads=2, causal=True, precision="tf32")
    expected_causal = reference_rows(q, k, v, True, heads, rows)
    assert 0 < tf32_emulation_error(causal, q, k, v, expected_causal, heads, rows) < 1e-2


def _gqa_kv_cache_case() -> tuple[Problem, tuple[np.ndarray, ...], np.ndarray, np.ndarray]:
    """4 query heads on 2 KV heads, 40 query rows against 97 keys, bottom-right causal."""
    problem = Problem(40, 32, heads=4, causal=True, kv_heads=2, kv_len=97, precision="tf32")
    rng = np.random.default_rng(11)
    q = rng.standard_normal((4, 40, 32), dtype=np.float32)
    k, v = (rng.standard_normal((2, 97, 32), dtype=np.float32) for _ in range(2))
    return problem, (q, k, v), np.arange(4), np.array([0, 1, 17, 39])


def test_tf32_emulation_follows_grouped_heads_and_bottom_right_causal() -> None:
    """Query head h reads KV head h // group, row r sees keys <= r + kv_len - seq_len: the
    emulation's error against the float64 reference of that problem is TF32-sized, while
    against the reference of K/V read by the wrong head (or top-left masking) it is O(1)."""
    problem, (q, k, v), heads, rows = _gqa_kv_cache_case()
    expected = reference_rows(q, k, v, True, heads, rows, group=2)
    assert 1e-6 < tf32_emulation_error(problem, q, k, v, expected, heads, rows) < 1e-2
    wrong_heads = reference_rows(q, k[::-1].copy(), v[::-1].copy(), True, heads, rows, group=2)
    assert tf32_emulation_error(problem, q, k, v, wrong_heads, heads, rows) > 0.05


def test_torch_float32_error_follows_grouped_heads_and_bottom_right_causal() -> None:
    torch = pytest.importorskip("torch")
    from kernels.precision import sdpa_error

    problem, (q, k, v), heads, rows = _gqa_kv_cache_case()
    accurate = Problem(40, 32, heads=4, causal=True, kv_heads=2, kv_len=97)
    expected = reference_rows(q, k, v, True, heads, rows, group=2)
    assert torch is not None
    assert sdpa_error(accurate, q, k, v, expected, heads, rows) < 1e-5
