"""The real PyCUDA backend, running deliberately broken kernels for chosen plan keys.

How a broken kernel enters the system (``tests/test_gpu_faults.py``):

* *Source faults* (``illegal_address``, ``hang``, ``compile_error``,
  ``wrong_answer``, ``nan``, and ``naive``, the fault-free control): for the
  plan's measurement, ``kernels.build`` compiles one of the small files in
  ``tests/broken_kernels/`` in place of ``kernels/tiled.cu``. They share the
  tiled family's entry points and arguments, and get the plan's own constants
  through the same ``-D`` flags, so the candidate goes through the product's
  whole path unchanged: nvcc and the ptxas report (``COMPILE``), the resource
  verdict, module load, the plan's launch, the NaN-poisoned parity check, the
  timing, and the backend's own mapping of driver errors to failures.
* *Launch faults* (``too_many_threads``: a block of 2048 threads;
  ``too_much_shared``: 1 KiB more dynamic shared memory than the device's
  opt-in limit): the real kernel, with its first launch changed just before
  the driver sees it, past the planner, which would have refused the plan.

The swap is made in the worker process that measures (``IsolatedBackend``
builds the backend there from the picklable ``FaultInjectingFactory``), only
for the one ``measure`` call, and undone after it; broken cubins go to their
own cache directory, and a module loaded for a broken plan is dropped, so a
good plan with the same constants never gets the broken code (nor the reverse).
Only plans with one sequence split take source faults (the broken files have
no split merge).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernels import build
from kernels.backends.base import Backend, Failure, Measurement
from kernels.backends.pycuda_backend import PyCudaBackend
from kernels.launch import KernelLaunch
from tuner.planner.families import family_named
from tuner.planner.tunable import KernelPlan
from tuner.problem import Problem

BROKEN_DIR = Path(__file__).resolve().parent / "broken_kernels"

#: fault -> the file compiled in place of kernels/tiled.cu
SOURCE_FAULTS: dict[str, str] = {
    "naive": "naive.cu",
    "illegal_address": "illegal_address.cu",
    "hang": "hang.cu",
    "compile_error": "compile_error.cu",
    "wrong_answer": "wrong_answer.cu",
    "nan": "nan_output.cu",
}
LAUNCH_FAULTS = ("too_many_threads", "too_much_shared")
#: the failure each fault must end its trial with (None: the control measures normally)
EXPECTED: dict[str, Failure | None] = {
    "naive": None,
    "illegal_address": Failure.RUNTIME_DEVICE,
    "hang": Failure.TIMEOUT,
    "compile_error": Failure.COMPILE,
    "too_many_threads": Failure.RESOURCES,
    "too_much_shared": Failure.RESOURCES,
    "wrong_answer": Failure.WRONG_ANSWER,
    "nan": Failure.WRONG_ANSWER,
}
#: faults after which the worker's CUDA context cannot be trusted: the worker is replaced
REPLACES_WORKER = frozenset({"illegal_address", "hang"})
TOO_MANY_THREADS = 2048


def check_fault(plan: KernelPlan, fault: str) -> None:
    """ValueError unless ``fault`` is known and can be planted in ``plan``."""
    if fault not in EXPECTED:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(EXPECTED)}")
    if fault in SOURCE_FAULTS and (plan.family != "tiled" or plan.sequence_splits != 1):
        raise ValueError(
            f"{plan.key()}: source faults replace the tiled kernel of one-split plans only"
        )


@contextlib.contextmanager
def broken_source(family: str, fault: str) -> Iterator[Path]:
    """While inside, ``kernels.build`` compiles ``family`` from the fault's file."""
    path = BROKEN_DIR / SOURCE_FAULTS[fault]
    kernel_family = family_named(family)
    # build.source_path is KERNEL_DIR / family.source: an absolute path replaces the folder.
    # The family's own source is a class attribute; the swap shadows it on the instance.
    kernel_family.source = str(path)  # type: ignore[misc]
    try:
        yield path
    finally:
        del kernel_family.source


def compile_broken(
    plan: KernelPlan, fault: str, cache_dir: str | Path, arch: str = build.DEFAULT_ARCH
) -> build.CompileResult:
    """The plan compiled from the fault's source, through the product's build (cached)."""
    check_fault(plan, fault)
    with broken_source(plan.family, fault):
        return build.compile_kernel(plan, cache_dir, arch)


def break_launches(
    launches: tuple[KernelLaunch, ...], fault: str, shared_optin_bytes: int
) -> tuple[KernelLaunch, ...]:
    """The launches with the first one made unlaunchable by ``fault`` (a launch fault)."""
    first = launches[0]
    if fault == "too_many_threads":
        broken = dataclasses.replace(first, block=(TOO_MANY_THREADS, 1, 1))
    elif fault == "too_much_shared":
        broken = dataclasses.replace(first, shared_bytes=shared_optin_bytes + 1024)
    else:
        raise ValueError(f"{fault!r} is not a launch fault; those are {', '.join(LAUNCH_FAULTS)}")
    return (broken, *launches[1:])


class FaultInjectingBackend(PyCudaBackend):
    """``PyCudaBackend`` that plants ``faults[plan.key()]`` in those plans' measurements."""

    name = "pycuda-faults"

    def __init__(
        self, faults: Mapping[str, str], *, fault_cache_dir: str | Path, **options: Any
    ) -> None:
        super().__init__(**options)
        unknown = sorted(set(faults.values()) - set(EXPECTED))
        if unknown:
            raise ValueError(f"unknown faults {unknown}; known: {', '.join(EXPECTED)}")
        self.faults = dict(faults)
        self.fault_cache_dir = Path(fault_cache_dir)
        self._launch_fault: str | None = None

    def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
        fault = self.faults.get(plan.key())
        if fault is None:
            return super().measure(plan, problem)
        check_fault(plan, fault)
        if fault in LAUNCH_FAULTS:
            self._launch_fault = fault
            try:
                return super().measure(plan, problem)
            finally:
                self._launch_fault = None
        constants = build.KernelSpec.from_plan(plan).key
        real_cache = self.cache_dir
        # Modules are cached by constants only: drop a good plan's before and the broken after.
        self._modules.pop(constants, None)
        self.cache_dir = self.fault_cache_dir
        try:
            with broken_source(plan.family, fault):
                return super().measure(plan, problem)
        finally:
            self.cache_dir = real_cache
            self._modules.pop(constants, None)

    def _launch(
        self, drv: Any, functions: dict[str, Any], launches: tuple[KernelLaunch, ...]
    ) -> None:
        if self._launch_fault is not None:
            optin = self.device_profile().max_shared_memory_per_block_optin
            launches = break_launches(launches, self._launch_fault, optin)
        super()._launch(drv, functions, launches)


@dataclass(frozen=True)
class FaultInjectingFactory:
    """Picklable: builds a ``FaultInjectingBackend`` inside the measurement worker."""

    #: broken cubins' cache: a fresh directory per run (the shared header is not in the
    #: cache key, only the file that includes it)
    fault_cache_dir: str
    faults: Mapping[str, str] = field(default_factory=dict)
    cache_dir: str = "~/.cache/flash-attention-tuner/cubins"
    repetitions: int = 5
    warmup: int = 1
    seed: int = 0
    name: str = "pycuda-faults"

    def __call__(self) -> Backend:
        return FaultInjectingBackend(
            self.faults,
            fault_cache_dir=self.fault_cache_dir,
            cache_dir=self.cache_dir,
            repetitions=self.repetitions,
            warmup=self.warmup,
            seed=self.seed,
        )
