"""The kernel families, registered in one place.

Every module that needs to know which kernels exist (planner, search space,
cost model, build, launch, backends, reference emulation, registry, plots)
iterates over ``registered()`` or asks ``family_named(name)``; none names a
family. Adding a family is its planning module (a ``KernelFamily`` subclass,
``base.py``), its ``.cu`` source under ``kernels/``, and one ``register``
line below.
"""

from __future__ import annotations

import dataclasses
from importlib import import_module

from tuner.planner.errors import PlanError
from tuner.planner.families.base import (
    CostTerms,
    KernelFamily,
    MatmulPipe,
    OnlinePartition,
    Tunable,
)
from tuner.planner.params import KernelParams

_FAMILIES: dict[str, KernelFamily] = {}


def register(family: KernelFamily) -> KernelFamily:
    """Add ``family``; a second family under the same name is refused, and so is a tunable
    named like an attribute of ``KernelParams`` (which holds each tunable as one)."""
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise PlanError(f"a kernel family named {family.name!r} is already registered")
    taken = {f.name for f in dataclasses.fields(KernelParams)}
    shadowing = [
        t.name for t in family.tunables if t.name in taken or hasattr(KernelParams, t.name)
    ]
    if shadowing:
        raise PlanError(f"{family.name}: a tunable may not be named {shadowing[0]!r}")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove a family (tests that register a throwaway one)."""
    _FAMILIES.pop(name, None)


def registered() -> tuple[KernelFamily, ...]:
    return tuple(_FAMILIES.values())


def family_names() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def family_named(name: str) -> KernelFamily:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise PlanError(f"unknown kernel family {name!r}; known: {', '.join(_FAMILIES)}") from None


def families_for(dtype: str, direction: str = "forward") -> tuple[str, ...]:
    """The families whose kernels take ``dtype`` in ``direction`` (forward or backward)."""
    return tuple(
        name
        for name, family in _FAMILIES.items()
        if dtype in family.dtypes and family.direction == direction
    )


# One line per family: the module under tuner/planner/families/ that defines FAMILY.
for _module in (
    "scalar_online",
    "tiled",
    "mma_f16",
    "decode_f16",
    "mma_tf32",
    "wgmma_f16",
    "mma_f16_bwd",
    "wgmma_f16_bwd",
    "serving_f16",
):
    register(import_module(f"{__name__}.{_module}").FAMILY)

__all__ = [
    "CostTerms",
    "KernelFamily",
    "MatmulPipe",
    "OnlinePartition",
    "Tunable",
    "families_for",
    "family_named",
    "family_names",
    "register",
    "registered",
    "unregister",
]
