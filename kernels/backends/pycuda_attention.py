"""``kernels.attention`` on one GPU through PyCUDA: kernels, scratch, launches, streams.

With ``pycuda_backend``, the only modules that import pycuda, and only inside functions, so
importing this one loads no pycuda. ``DeviceRunner`` owns one GPU: its ``PyCudaBackend`` (the
primary context, retained, pushed and popped around each call), a ``PlanChooser``, the loaded
kernels and the split scratch of each shape.

Every dtype takes the same path: the problem carries the inputs' dtype, the chooser picks among
the families that take it, and the plan's family says the buffers (``buffer_elements``: the
split scratch is float32 whatever the dtype) and the launches (``launch_sequence``). Results are
allocated in the inputs' dtype.

Contexts and streams: launches run in the device's primary context (torch's). PyCUDA launches
only on its own ``Stream`` objects or on the legacy default stream (it cannot wrap a foreign
stream handle), so:

* torch's current stream is the default (legacy) stream: the kernels go there directly;
* any other torch stream: they go on one PyCUDA stream per GPU, fenced by torch events on both
  sides (that stream waits for the caller's, the caller's waits for it), so the call stays
  asynchronous and ordered;
* other arrays: the legacy default stream (PyCUDA's default). An interface that names a producer
  stream other than the default ones is waited for with a context synchronise (the interface
  gives a raw handle PyCUDA cannot wait on).

The PyCUDA stream is blocking, so every launch of an ``Attention`` on one GPU is ordered with
every other: the split scratch, allocated once per shape, is never used by two launches at once.

Caches: plans per shape (the chooser), modules per compile key (the backend), scratch per shape,
and the launch arguments of the last pointers seen per shape; after the first call for a shape a
call is dict lookups and one or two launches, with no host synchronisation.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
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
from kernels.backends.pycuda_backend import PyCudaBackend
from kernels.launch import DeviceBuffers, KernelLaunch, buffer_elements, launch_sequence
from kernels.plan_choice import PlanChooser
from tuner.environment import Environment
from tuner.errors import BackendError
from tuner.planner.tunable import KernelPlan
from tuner.problem import Problem

#: stream handles that mean the legacy default stream (0, cudaStreamLegacy)
LEGACY_STREAMS = (0, 1)
#: interface stream values our legacy-stream launch is already ordered after (None: no producer
#: stream; 1: legacy default; 2: per-thread default, which syncs with the legacy one)
ORDERED_STREAMS = (None, 1, 2)

Key = tuple[tuple[int, ...], str, bool, str]  # (shape, dtype, causal, precision)


class _Prepared:
    """One shape on one GPU: plan, loaded kernels and split scratch, reused by every call."""

    def __init__(self, plan: KernelPlan, functions: dict[str, Any], scratch: tuple[Any, Any]):
        self.plan = plan
        self.functions = functions
        self.scratch = scratch  # keeps the allocations alive
        self.partials = tuple(0 if s is None else int(s) for s in scratch)
        self._last: tuple[tuple[int, ...], tuple[KernelLaunch, ...]] = ((), ())

    def launches(self, *pointers: int) -> tuple[KernelLaunch, ...]:
        """The launches for these q, k, v, out; rebuilt only when the pointers change."""
        last = self._last  # one read: another thread may replace it meanwhile
        if last[0] != pointers:
            buffers = DeviceBuffers(*pointers, *self.partials)
            last = self._last = (pointers, launch_sequence(self.plan, buffers))
        return last[1]


@dataclass(frozen=True, slots=True)
class _StreamBridge:
    stream: Any  # pycuda Stream: where the kernels run when torch's stream is not the default
    torch_stream: Any  # the same stream as torch sees it (ExternalStream)
    inputs_ready: Any  # torch events: caller's stream -> ours, ours -> caller's
    done: Any


class DeviceRunner:
    """One GPU: its primary context (through ``PyCudaBackend``), plans, kernels, scratch."""

    def __init__(self, index: int, registry: Any, nearest: bool, cache_dir: Path | None) -> None:
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
        )
        self._compiled: dict[str, build.CompiledKernel] = {}
        self._prepared: dict[Key, _Prepared] = {}
        self._lock = threading.Lock()
        self._bridge: _StreamBridge | None = None
        self._bridge_lock = threading.Lock()
        with self.backend.active():
            self.context = current_context()

    def _check(self, plan: KernelPlan) -> KernelPlan | str:
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

    def prepared(self, key: Key) -> _Prepared:
        found = self._prepared.get(key)
        if found is None:
            with self._lock:
                found = self._prepared.get(key)
                if found is None:
                    found = self._prepared[key] = self._prepare(key)
        return found

    def _prepare(self, key: Key) -> _Prepared:
        (batch, heads, seq_len, head_dim), dtype, causal, precision = key
        problem = Problem(
            seq_len,
            head_dim,
            batch=batch,
            heads=heads,
            causal=causal,
            dtype=dtype,
            precision=precision,
        )
        plan = self.chooser.plan_for(problem).plan
        compiled = self._compiled.get(build.KernelSpec.from_plan(plan).key)
        if compiled is None:  # the chooser's check keeps it; compile (a cache hit) if not
            checked = self._check(plan)
            if isinstance(checked, str):
                raise BackendError(f"{plan.key()} for {problem.label()}: {checked}")
            compiled = self._compiled[build.KernelSpec.from_plan(plan).key]
        needed = buffer_elements(plan)
        with self.backend.active() as drv:
            try:
                functions = self.backend.functions(drv, compiled)  # one load per compile key
            except Exception as error:
                raise BackendError(f"{plan.key()}: the cubin does not load: {error}") from error
            with_partials = 1 if needed.partial_o else 0
            placeholder = DeviceBuffers(1, 1, 1, 1, with_partials, with_partials)
            for launch in launch_sequence(plan, placeholder):
                if launch.needs_shared_opt_in:  # a function attribute: set once, kept
                    functions[launch.function].set_attribute(
                        drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, launch.shared_bytes
                    )
            scratch: tuple[Any, Any] = (None, None)
            if needed.partial_o:
                try:
                    scratch = (drv.mem_alloc(needed.partial_o_bytes), None)
                    scratch = (scratch[0], drv.mem_alloc(needed.partial_ml_bytes))
                except drv.Error as error:
                    nbytes = needed.partial_o_bytes + needed.partial_ml_bytes
                    raise BackendError(
                        f"{plan.key()}: the split scratch of {problem.label()} ({nbytes} B) "
                        f"does not fit: {error}"
                    ) from error
        return _Prepared(plan, functions, scratch)

    def _launch(self, prepared: _Prepared, launches: Sequence[KernelLaunch], stream: Any) -> None:
        with self.backend.active() as drv:
            self._launch_in(drv, prepared, launches, stream)

    def _launch_in(
        self, drv: Any, prepared: _Prepared, launches: Sequence[KernelLaunch], stream: Any
    ) -> None:
        """The launches, in order, in the current (pushed) context; no synchronisation."""
        for launch in launches:
            try:
                prepared.functions[launch.function](
                    *launch.args,
                    grid=launch.grid,
                    block=launch.block,
                    shared=launch.shared_bytes,
                    stream=stream,
                )
            except drv.Error as error:
                raise BackendError(
                    f"{prepared.plan.key()}: {launch.function} on cuda:{self.index}: {error}"
                ) from error

    def run_torch(self, inputs: Inputs, causal: bool, torch: Any, precision: str = "") -> Any:
        prepared = self.prepared((inputs.q.shape, inputs.q.dtype, causal, precision))
        # torch work (allocation, stream and event calls) stays outside our pushed context.
        if inputs.out is None:
            result = torch.empty_like(inputs.q.value)  # q's dtype
            out = int(result.data_ptr())
        else:
            result, out = inputs.out.value, inputs.out.pointer
        launches = prepared.launches(inputs.q.pointer, inputs.k.pointer, inputs.v.pointer, out)
        if _current_stream_handle(torch, self.index) in LEGACY_STREAMS:
            self._launch(prepared, launches, None)  # PyCUDA's default stream is this stream
            return result
        stream = torch.cuda.current_stream(self.index)
        with self._bridge_lock:  # the events are reused: one fenced launch at a time
            bridge = self._bridge or self._open_bridge(torch)
            bridge.inputs_ready.record(stream)
            bridge.torch_stream.wait_event(bridge.inputs_ready)
            self._launch(prepared, launches, bridge.stream)
            bridge.done.record(bridge.torch_stream)
            stream.wait_event(bridge.done)
        return result

    def _open_bridge(self, torch: Any) -> _StreamBridge:
        with self.backend.active() as drv:
            own = drv.Stream()  # blocking: ordered with the legacy default stream too
        external = torch.cuda.ExternalStream(own.handle, device=torch.device("cuda", self.index))
        self._bridge = _StreamBridge(own, external, torch.cuda.Event(), torch.cuda.Event())
        return self._bridge

    def run_arrays(
        self,
        inputs: Inputs,
        causal: bool,
        facts: Sequence[PointerFacts | None],
        precision: str = "",
    ) -> Any:
        for array, fact in zip(inputs.arrays, facts, strict=True):
            # 0: pool and VMM allocations belong to no context; None: the driver was not asked.
            if fact and fact.context and self.context and fact.context != self.context:
                raise AttentionInputError(
                    f"{array.name} belongs to another CUDA context than cuda:{self.index}'s "
                    "primary context, which kernels.attention (and torch) use: allocate it "
                    "there (pycuda.autoprimaryctx, not pycuda.autoinit)"
                )
        prepared = self.prepared((inputs.q.shape, inputs.q.dtype, causal, precision))
        with self.backend.active() as drv:
            if any(array.stream not in ORDERED_STREAMS for array in inputs.arrays):
                drv.Context.synchronize()  # a producer stream PyCUDA cannot wait on
            if inputs.out is not None:
                result, out = inputs.out.value, inputs.out.pointer
            else:
                result = _new_gpuarray(inputs.q)
                out = int(result.gpudata)
            launches = prepared.launches(inputs.q.pointer, inputs.k.pointer, inputs.v.pointer, out)
            self._launch_in(drv, prepared, launches, None)
        return result

    def close(self) -> None:
        with contextlib.suppress(Exception), self.backend.active():
            self._prepared.clear()  # frees scratch and kernels while the context is current
            self._bridge = None
        self.backend.close()


def _current_stream_handle(torch: Any, index: int) -> int:
    """torch's current stream on GPU ``index``, as a raw handle."""
    # torch's own raw query (the one Triton launches with) returns a plain int; the public
    # API builds a Stream object on every call, several microseconds on this hot path.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None) if hasattr(torch, "_C") else None
    if raw is not None:
        return int(raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def _new_gpuarray(like: DeviceArray) -> Any:
    from pycuda import gpuarray

    if isinstance(like.value, gpuarray.GPUArray):
        return gpuarray.empty_like(like.value)  # q's dtype; keeps the caller's allocator (a pool)
    return gpuarray.empty(like.shape, NUMPY_DTYPES[like.dtype])
