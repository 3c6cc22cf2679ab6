"""The pass rule of variant problems: twice the peer's error plus the dtype's floor.

A window is a boolean mask, so torch's SDPA stays the peer (rows that see no key count as 0);
softcap, ALiBi and sinks are not SDPA's to compute in a half dtype, so the peer is a flash
kernel's arithmetic emulated on the CPU. Either way the rule must pass a kernel that computes
the variant with flash arithmetic and fail one that ignores it.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels import precision
from kernels.attention_variants import VariantValues
from kernels.parity import CpuReference
from kernels.reference import attention_reference, emulate_online
from kernels.tuning_inputs import tuning_inputs
from tuner.problem import Problem


def flash_like(problem: Problem, values: tuple, variants: VariantValues) -> np.ndarray:
    """What a correct kernel returns: the online softmax in float32 over 32-key tiles and two
    splits, the output rounded to the dtype."""
    q, k, v = values
    out = emulate_online(
        q, k, v, problem.causal, tile_size=32, keys_per_split=64, rows_per_block=16,
        dtype=np.float32, variants=variants,
    )
    return precision.from_storage(precision.to_storage(out, problem.dtype), problem.dtype)


def without(variants: VariantValues, name: str) -> VariantValues:
    fields = {
        "window_left": variants.window_left,
        "window_right": variants.window_right,
        "softcap": variants.softcap,
        "alibi_slopes": variants.alibi_slopes,
        "sinks": variants.sinks,
    }
    off = {"softcap": 0.0, "window_left": -1, "window_right": -1}
    fields[name] = off.get(name)
    return VariantValues(**fields)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("ignored", ["softcap", "alibi_slopes", "sinks"])
def test_the_flash_peer_passes_flash_arithmetic_and_fails_an_ignored_variant(
    dtype: str, ignored: str
) -> None:
    problem = Problem(
        160, 64, heads=4, causal=True, window_left=70, softcap=30.0, alibi=True, sinks=True,
        dtype=dtype,
    )
    inputs = tuning_inputs(problem, np.random.default_rng(3))
    reference = CpuReference(problem, *inputs.values, variants=inputs.variants)
    sampled = (reference.expected, reference.heads, reference.rows)
    assert precision.needs_flash_peer(inputs.variants)
    peer = precision.sdpa_error(problem, *inputs.values, *sampled, inputs.variants)
    assert peer == precision.flash_peer_error(problem, *inputs.values, *sampled, inputs.variants)
    tolerance = precision.tolerance_for(problem, peer)
    assert 0 < peer < tolerance < (2e-2 if dtype != "float32" else 1e-4)
    right = reference.check(flash_like(problem, inputs.values, inputs.variants), tolerance)
    assert right.ok, right.detail
    wrong = flash_like(problem, inputs.values, without(inputs.variants, ignored))
    caught = reference.check(wrong, tolerance)
    assert not caught.ok and caught.max_abs_error > 5 * tolerance, caught.detail


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_window_keeps_sdpa_as_the_peer_and_rows_without_keys_count_as_zero(dtype: str) -> None:
    pytest.importorskip("torch")
    # Not causal, right bound 0, 20 more queries than keys: rows 0-19 see no key.
    problem = Problem(100, 32, heads=2, kv_len=80, window_left=10, window_right=0, dtype=dtype)
    inputs = tuning_inputs(problem, np.random.default_rng(0))
    reference = CpuReference(problem, *inputs.values)
    assert np.all(reference.expected[:, :20] == 0)
    sampled = (reference.expected, reference.heads, reference.rows)
    assert not precision.needs_flash_peer(inputs.variants)
    peer = precision.sdpa_error(problem, *inputs.values, *sampled, inputs.variants)
    assert peer is not None and 0 < peer < 1e-2
    tolerance = precision.tolerance_for(problem, peer)

    def rounded(variants: VariantValues) -> np.ndarray:  # the emulation is self-attention only
        out = attention_reference(*inputs.values, False, 1, variants).astype(np.float32)
        return precision.from_storage(precision.to_storage(out, dtype), dtype)

    assert reference.check(rounded(inputs.variants), tolerance).ok
    assert not reference.check(rounded(without(inputs.variants, "window_right")), tolerance).ok


def test_the_tf32_emulation_applies_the_variants() -> None:
    problem = Problem(96, 64, heads=2, causal=True, window_left=20, alibi=True, precision="tf32")
    inputs = tuning_inputs(problem, np.random.default_rng(5))
    reference = CpuReference(problem, *inputs.values, variants=inputs.variants)
    sampled = (reference.expected, reference.heads, reference.rows)
    error = precision.tf32_emulation_error(problem, *inputs.values, *sampled, inputs.variants)
    assert 1e-6 < error < 1e-2  # TF32's rounding, not a variant left out
    dense = precision.tf32_emulation_error(problem, *inputs.values, *sampled, VariantValues())
    assert dense > 1e-1
