"""``kernels.attention`` on one GPU: plans, kernels and handles, and the path of non-torch arrays.

With ``pycuda_backend``, the only modules that import pycuda, and only inside functions, so
importing this one loads no pycuda. ``DeviceRunner`` owns one GPU: its ``PyCudaBackend`` (the
primary context, retained; the environment and limits the registry is asked with), a
``PlanChooser``, the loaded kernels and one ``AttentionHandle`` per ``Problem``
(``kernels.backends.attention_handle``): plan, functions, geometry, packed arguments and split
scratch per stream, made once; every later call of that problem is the handle's launch. A
backward problem (the gradients of a training step) gets a ``BackwardHandle``
(``kernels.backends.backward_handle``) the same way.

Kernels are loaded and launched through the driver API (``kernels.cuda_driver``), in the
device's primary context, the one torch and the CUDA runtime use:

* torch tensors: the launches go on torch's current stream of the tensors' GPU, whatever it is
  (the default stream, a side stream, a CUDA-graph capture), in torch's current context;
* other arrays: the legacy default stream, the primary context pushed around the call. An
  interface that names a producer stream other than the default ones is waited for with a
  context synchronise (the interface gives a raw handle that may belong to another library).

Every dtype takes the same path: the problem carries the inputs' dtype, the chooser picks among
the families that take it, and the plan's family says the buffers (``buffer_elements``: the
split scratch is float32 whatever the dtype) and the launches (``launch_sequence``).

KV lengths are run-time data (``kernels.kv_buckets``): a problem against a KV cache has its
plan chosen for its bucket (the registry asked once per bucket, the kernels compiled and loaded
once per kernel variant), and its handle is that plan at the exact length
(``tuner.planner.kernel_variant.plan_at``: the family's split rule, about 15 us, no cost model)
with the launches packed for it and the bucket's split scratch; a new length costs about a
tenth of a millisecond on the host, once. Handles are kept for the ``HANDLE_CACHE`` problems met
last, so a server meeting every length of a long cache holds a bounded number.

"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kernels import build
from kernels.attention_args import (
    NUMPY_DTYPES,
    AttentionInputError,
    DeviceArray,
    Inputs,
    PointerFacts,
    current_context,
)
from kernels.backends.attention_handle import (
    BUFFER_MARKERS,
    AttentionHandle,
    SplitScratch,
    launch_templates,
)
from kernels.backends.backward_handle import (
    BACKWARD_MARKERS,
    BackwardHandle,
    backward_marker_roles,
)
from kernels.backends.pycuda_backend import PyCudaBackend
from kernels.cuda_driver import CudaDriver
from kernels.kv_buckets import bucket_of
from kernels.launch import KernelLaunch, buffer_elements, launch_sequence
from kernels.plan_choice import ChosenPlan, PlanChooser, logger
from kernels.variant_args import VariantArgs
from tuner.environment import Environment
from tuner.errors import BackendError
from tuner.planner.kernel_variant import plan_at
from tuner.planner.launches import scale_log2
from tuner.planner.tunable import KernelParams, KernelPlan, plan_kernel
from tuner.problem import Problem

#: the legacy default stream: where non-torch arrays run
LEGACY_STREAM = 0
#: interface stream values our legacy-stream launch is already ordered after (None: no producer
#: stream; 1: legacy default; 2: per-thread default, which syncs with the legacy one)
ORDERED_STREAMS = (None, 1, 2)
#: handles a runner keeps (the problems met last); an older one is made again if met again
HANDLE_CACHE = 1024


class DeviceRunner:
    """One GPU: its primary context (through ``PyCudaBackend``), plans, kernels, handles.

    ``driver``: the ``kernels.cuda_driver.CudaDriver`` that loads and launches (injected by
    tests without a GPU).
    """

    def __init__(
        self,
        index: int,
        registry: Any,
        nearest: bool,
        cache_dir: Path | None,
        *,
        driver: Any = None,
        registry_unavailable: str = "",
    ) -> None:
        options = {} if cache_dir is None else {"cache_dir": cache_dir}
        self.index = index
        self.backend = PyCudaBackend(index, **options)  # type: ignore[arg-type]
        self.profile = self.backend.device_profile()  # retains the primary context
        self.environment = Environment(**self.backend.environment())  # type: ignore[arg-type]
        label = str(getattr(registry, "url", ""))
        self.chooser = PlanChooser(
            registry,
            self.environment,
            self.profile,
            nearest=nearest,
            check=self._check,
            registry_label=label,
            registry_unavailable=registry_unavailable,
        )
        self.driver = driver if driver is not None else CudaDriver()
        self._compiled: dict[str, build.CompiledKernel] = {}
        self._modules: dict[str, tuple[int, dict[str, int]]] = {}  # compile key -> functions
        self._handles: dict[Problem, AttentionHandle] = {}
        #: handles of problems asked ``exact`` whose KV bucket is another problem
        self._exact_handles: dict[Problem, AttentionHandle] = {}
        self._backward_handles: dict[tuple[Problem, bool], BackwardHandle] = {}
        #: each KV bucket's split scratch, for its handles (``kernels.kv_buckets``)
        self._buckets: dict[Problem, SplitScratch] = {}
        #: (function, bytes) whose dynamic shared memory was opted in: a function attribute
        self._opted_in: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        with self.backend.active():
            self.context = current_context()

    def _check(self, plan: KernelPlan) -> KernelPlan | str:
        known = self._compiled.get(build.KernelSpec.from_plan(plan).key)
        if known is not None:  # a variant compiled here before: judged without the disk
            judged = plan.with_resources(known.primary_resources, self.profile)
            return judged if judged.feasible else judged.reason
        try:
            compiled = build.compile_kernel(plan, self.backend.cache_dir, arch=self.profile.arch)
        except BackendError as error:  # not cached and no nvcc: another plan may be cached
            return str(error)
        if isinstance(compiled, build.CompileFailure):
            return f"does not compile: {compiled.reason}"
        judged = plan.with_resources(compiled.primary_resources, self.profile)
        if not judged.feasible:
            return judged.reason
        self._compiled[compiled.key] = compiled
        return judged

    def handle(self, problem: Problem, *, exact: bool = False) -> AttentionHandle:
        """The handle of ``problem`` on this GPU: resolved (plan, kernels) on first use.

        ``exact``: the plan of ``problem`` itself, not of its KV bucket: a training step's
        forward, whose shape is fixed and whose tuned plan (and backward) is the exact
        problem's."""
        exact = exact and bucket_of(problem) != problem
        handles = self._exact_handles if exact else self._handles
        found = handles.get(problem)
        if found is None:
            with self._lock:
                found = handles.get(problem)
                if found is None:
                    found = handles[problem] = self._resolve(problem, exact)
                    if len(handles) > HANDLE_CACHE:
                        del handles[next(iter(handles))]  # the oldest
        return found

    def _chosen(self, problem: Problem, exact: bool) -> tuple[ChosenPlan, SplitScratch | None]:
        """The plan of ``problem``: its bucket's at its exact KV length, with the bucket's
        split scratch (``None`` for a problem that is its own bucket, or asked ``exact``: a
        scratch of its own)."""
        bucket = bucket_of(problem)
        if exact or bucket == problem:
            return self.chooser.plan_for(problem), None
        chosen = self.chooser.plan_for(bucket)
        exact = plan_at(chosen.plan, problem, self.profile)
        if isinstance(exact, str):  # a kernel that changes with kv_len: a plan of its own
            logger.warning(
                "the plan of KV bucket %s cannot serve %s (%s); choosing one for it alone",
                bucket.label(),
                problem.label(),
                exact,
            )
            return self.chooser.plan_for(problem), None
        scratch = self._buckets.get(bucket)
        if scratch is None:
            scratch = self._buckets[bucket] = SplitScratch(buffer_elements(chosen.plan))
        return dataclasses.replace(chosen, plan=exact), scratch

    def _resolve(self, problem: Problem, exact: bool) -> AttentionHandle:
        chosen, scratch = self._chosen(problem, exact)
        return self.handle_of(chosen, scratch)

    def handle_of(
        self, chosen: ChosenPlan, scratch: SplitScratch | None = None
    ) -> AttentionHandle:
        """A handle of the given forward plan (compiled and loaded now; not cached): what
        ``handle`` resolves to, and what a benchmark times plan by plan. ``scratch``: a KV
        bucket's shared split scratch (``None``: the handle's own)."""
        problem = chosen.plan.problem
        launches = launch_sequence(chosen.plan, BUFFER_MARKERS)
        functions = self.load(chosen.plan, launches)
        return AttentionHandle(
            problem,
            self.index,
            chosen,
            launch_templates(launches, functions, scale_log2(problem.head_dim)),
            buffer_elements(chosen.plan),
            self.driver,
            self.context,
            scratch,
        )

    def checked(self, plan: KernelPlan) -> KernelPlan:
        """``plan`` compiled (or found in the cache) and judged with the compiler's report;
        ``BackendError`` when it cannot run here."""
        checked = self._check(plan)
        if isinstance(checked, str):
            raise BackendError(f"{plan.key()} for {plan.problem.label()}: {checked}")
        return checked

    def load(self, plan: KernelPlan, launches: Sequence[KernelLaunch]) -> dict[str, int]:
        """The plan's kernels loaded once in this GPU's primary context (once per variant),
        with the dynamic shared memory of ``launches`` opted in: entry name -> CUfunction
        (what the forward, backward and serving handles launch)."""
        key = build.KernelSpec.from_plan(plan).key
        compiled = self._compiled.get(key)
        if compiled is None:  # the chooser's check keeps it; compile (a cache hit) if not
            self.checked(plan)
            compiled = self._compiled[key]
        with self.backend.active():  # modules and attributes belong to the primary context
            loaded = self._modules.get(key)
            if loaded is None:
                module = self.driver.load_module(compiled.cubin)
                names = build.entry_functions(compiled.spec.family)
                functions = {name: self.driver.get_function(module, name) for name in names}
                loaded = self._modules[key] = (module, functions)
            functions = loaded[1]
            for launch in launches:
                function = functions[launch.function]
                opt_in = (function, launch.shared_bytes)
                if launch.needs_shared_opt_in and opt_in not in self._opted_in:
                    # a function attribute: set once, kept
                    self.driver.set_max_dynamic_shared(function, launch.shared_bytes)
                    self._opted_in.add(opt_in)
        return functions

    def backward_handle(self, problem: Problem, deterministic: bool = False) -> BackwardHandle:
        """The handle of a backward ``problem`` on this GPU (resolved on first use): the
        registry's backward plan, else the planner's default; ``deterministic`` asks for the
        key-tile-ordered dQ whatever the plan chose (a variant of the same plan)."""
        key = (problem, deterministic)
        found = self._backward_handles.get(key)
        if found is None:
            with self._lock:
                found = self._backward_handles.get(key)
                if found is None:
                    found = self._backward_handles[key] = self._resolve_backward(
                        problem, deterministic
                    )
        return found

    def _resolve_backward(self, problem: Problem, deterministic: bool) -> BackwardHandle:
        chosen = self.chooser.plan_for(problem)
        params = chosen.plan.params.tunables
        if deterministic and params.get("deterministic") == 0:
            plan = plan_kernel(
                problem,
                KernelParams(chosen.plan.family, **(params | {"deterministic": 1})),
                self.profile,
            )
            checked = self._check(plan) if plan.feasible else plan.reason
            if isinstance(checked, str):
                # e.g. the ordered dQ spills where the atomic one fits: the best-predicted
                # deterministic plan that compiles cleanly serves instead
                other = self.chooser.best_default(
                    problem, lambda plan: plan.params.tunables.get("deterministic") == 1
                )
                if other is None:
                    raise BackendError(
                        f"the deterministic variant of {chosen.plan.key()} for "
                        f"{problem.label()} cannot run ({checked}) and no other deterministic "
                        "plan compiles without spills"
                    )
                logger.warning(
                    "the deterministic variant of %s for %s cannot run (%s); %s serves instead",
                    chosen.plan.key(),
                    problem.label(),
                    checked,
                    other.key(),
                )
                checked = other
            chosen = dataclasses.replace(chosen, plan=checked)
        return self.backward_handle_of(chosen)

    def backward_handle_of(self, chosen: ChosenPlan) -> BackwardHandle:
        """A handle of the given backward plan (compiled and loaded now; not cached): what
        ``backward_handle`` resolves to, and what a benchmark times plan by plan."""
        launches = launch_sequence(chosen.plan, BACKWARD_MARKERS)  # type: ignore[arg-type]
        functions = self.load(chosen.plan, launches)
        family = chosen.plan.kernel_family
        return BackwardHandle(
            chosen.plan.problem,
            self.index,
            chosen,
            launch_templates(launches, functions, markers=backward_marker_roles()),
            family.backward_scratch(chosen.plan),  # type: ignore[attr-defined]
            self.driver,
            self.context,
        )

    def run_arrays(
        self,
        inputs: Inputs,
        problem: Problem,
        facts: Sequence[PointerFacts | None],
        variants: VariantArgs | None = None,
    ) -> Any:
        """Launch on interface arrays; ``facts``: the driver's, on ``inputs.arrays`` then the
        variants' per-head arrays."""
        variants = VariantArgs() if variants is None else variants
        for array, fact in zip((*inputs.arrays, *variants.arrays), facts, strict=True):
            # 0: pool and VMM allocations belong to no context; None: the driver was not asked.
            if fact and fact.context and self.context and fact.context != self.context:
                raise AttentionInputError(
                    f"{array.name} belongs to another CUDA context than cuda:{self.index}'s "
                    "primary context, which kernels.attention (and torch) use: allocate it "
                    "there (pycuda.autoprimaryctx, not pycuda.autoinit)"
                )
        handle = self.handle(problem)
        with self.backend.active() as drv:
            given = (*inputs.arrays, *variants.arrays)
            if any(array.stream not in ORDERED_STREAMS for array in given):
                drv.Context.synchronize()  # a producer stream we cannot wait on otherwise
            if inputs.out is not None:
                result, out = inputs.out.value, inputs.out.pointer
            else:
                result = _new_gpuarray(inputs.q)
                out = int(result.gpudata)

            def allocate(nbytes: int) -> tuple[Any, int]:
                owner = drv.mem_alloc(nbytes)
                return owner, int(owner)

            slot = handle.slot(LEGACY_STREAM, allocate)
            handle.launch(
                slot,
                inputs.q.pointer,
                inputs.k.pointer,
                inputs.v.pointer,
                out,
                *variants.pointers,
                variants.scale_log2,
            )
        return result

    def close(self) -> None:
        with contextlib.suppress(Exception), self.backend.active():
            for handle in self._handles.values():
                handle.close()  # frees scratch while the context is current
            self._handles.clear()
            for handle in self._exact_handles.values():
                handle.close()
            self._exact_handles.clear()
            self._backward_handles.clear()
            for scratch in self._buckets.values():
                scratch.close()
            self._buckets.clear()
            self._opted_in.clear()
            for module, _ in self._modules.values():
                self.driver.unload_module(module)
            self._modules.clear()
        self.backend.close()


def _new_gpuarray(like: DeviceArray) -> Any:
    from pycuda import gpuarray

    if isinstance(like.value, gpuarray.GPUArray):
        return gpuarray.empty_like(like.value)  # q's dtype; keeps the caller's allocator (a pool)
    return gpuarray.empty(like.shape, NUMPY_DTYPES[like.dtype])
