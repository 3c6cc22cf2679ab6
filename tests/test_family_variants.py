"""Every registered family either takes each variant to its kernels or refuses it.

A family that plans a variant problem as if it were plain attention would run the plain kernel:
a wrong answer that parity catches in tuning, but that a deploy-time default plan would serve.
So for each family and each variant, either no candidate is feasible (the planner's reasons
say why), or the feasible plans' launches carry the variant on the ABI
(``tests/variant_family.py``): the ALiBi slopes' and sinks' pointers, the window's bounds and
the softcap's value (given here as values no other argument has: 37, 11 and 13.5).

The tensor-core families take every variant; the SIMT families (scalar_online, tiled) refuse
them (``KernelFamily.takes_variants``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from variant_family import toy_variants_only

from kernels.backends.attention_handle import BUFFER_MARKERS
from kernels.backends.backward_handle import BACKWARD_MARKERS
from kernels.launch import launch_sequence
from tuner.device import H200
from tuner.planner.families import registered
from tuner.planner.space import candidate_space
from tuner.problem import Problem

#: to take off family by family as their launches take the variants (or refuse them)
VARIANTS = {
    "window": {"window_left": 37, "window_right": 11},
    "softcap": {"softcap": 13.5},
    "alibi": {"alibi": True},
    "sinks": {"sinks": True},
}


def variant_problem(
    dtype: str, variant: str, direction: str = "forward", serving: bool = False
) -> Problem:
    # 16 query rows against 128 keys: a shape every family plans (decode_f16 included); a
    # serving family's as a paged bucket
    return Problem(16, 64, batch=2, heads=4, kv_heads=2, kv_len=128, dtype=dtype,
                   direction=direction, page_size=16 if serving else None,
                   **VARIANTS[variant])


def carries(variant: str, args: tuple, markers=BUFFER_MARKERS) -> bool:  # noqa: ANN001
    """Whether a launch's arguments carry ``variant`` (pointers as the markers' roles)."""
    values = [a for a in args if isinstance(a, np.int32 | np.float32 | np.uintp)]
    if variant == "window":
        return np.int32(37) in values and np.int32(11) in values
    if variant == "softcap":
        return np.float32(13.5) in values
    pointer = markers.alibi_slopes if variant == "alibi" else markers.sinks
    return np.uintp(pointer) in values


CASES = [
    pytest.param(family.name, variant, id=f"{family.name}-{variant}")
    for family in registered()
    for variant in VARIANTS
]


@pytest.mark.parametrize(("family", "variant"), CASES)
def test_a_family_takes_a_variant_or_refuses_it(family: str, variant: str) -> None:
    check_family(family, variant)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_family_on_the_variant_abi_passes_the_check(variant: str) -> None:
    with toy_variants_only() as toy:
        check_family(toy.name, variant)


def check_family(family: str, variant: str) -> None:
    (taker,) = [f for f in registered() if f.name == family]
    problem = variant_problem(taker.dtypes[0], variant, taker.direction, taker.serving)
    assert problem.has_variant
    space = candidate_space(problem, H200)
    feasible = [plan for plan in space.feasible if plan.family == family]
    if not feasible:
        reasons = {plan.reason for plan in space.rejected if plan.family == family}
        assert reasons and all(reasons), f"{family} refuses {variant} without a reason"
        return
    # A backward family's launches take the backward buffers (q, k, v, out, dout, lse, ...).
    markers = BACKWARD_MARKERS if taker.direction == "backward" else BUFFER_MARKERS
    if taker.serving:  # the work list and the page lists too
        markers = dataclasses.replace(markers, work=0xABC0 << 40, pages=0xABC1 << 40)
    for plan in feasible[:8]:
        launches = launch_sequence(plan, markers)
        assert any(carries(variant, launch.args, markers) for launch in launches), (
            f"{plan.key()} plans {problem.label()} but its launches do not pass the {variant}"
        )
