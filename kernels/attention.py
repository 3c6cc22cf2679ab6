"""Deploy-time attention: the tuned plan of a shape, looked up once, run on the caller's arrays.

    import kernels
    out = kernels.attention(q, k, v, causal=True)            # torch CUDA tensors or GPUArrays
    kernels.attention(q, k, v, registry="sqlite:///plans.sqlite", out=buffer)

    attend = kernels.Attention("postgresql+psycopg://host/plans")   # a service keeps its own
    out = attend(q, k, v, causal=True)

``kernels.attention`` is this module, made callable (it forwards to ``attention``): the import
system binds the package attribute to the submodule, so the function could not keep the name.

Inputs: ``[batch, heads, seq_len, head_dim]`` float32 C-contiguous device arrays of one shape on
one GPU: torch CUDA tensors, PyCUDA ``GPUArray``s, or anything with ``__cuda_array_interface__``.
Every argument is checked before any CUDA call; ``AttentionInputError`` (a ``TunerError`` and a
``ValueError``; ``AttentionInputTypeError`` also a ``TypeError``) names the argument, what it was
and what is expected. The interface carries no device, so for non-torch arrays the device,
memory type and owning context come from ``cuPointerGetAttributes`` (libcuda, through ctypes).

Plans (``PlanChooser``): once per (shape, causal, dtype) and GPU the registry is asked with the
live GPU's ``Environment`` and the current kernel source hashes; a stale (source changed) or
predicted-only plan is used with a warning, a plan tuned on the same GPU model under another
toolchain too; a plan from another GPU is not used. Without one, the planner's default plan (the
feasible candidate with the lowest predicted time on the live device) is used, with a warning.
Warnings go to the ``kernels.attention`` logger, once per shape.

Contexts and streams: launches run in the device's primary context (torch's), retained and
pushed/popped around each call by ``PyCudaBackend``. PyCUDA launches only on its own ``Stream``
objects or on the legacy default stream (it cannot wrap a foreign stream handle), so:

* torch's current stream is the default (legacy) stream: the kernels go there directly;
* any other torch stream: they go on one PyCUDA stream per GPU, fenced by torch events on both
  sides (that stream waits for the caller's, the caller's waits for it), so the call stays
  asynchronous and ordered;
* other arrays: the legacy default stream (PyCUDA's default). An interface that names a producer
  stream other than the default ones is waited for with a context synchronise (the interface
  gives a raw handle PyCUDA cannot wait on).

The PyCUDA stream is blocking, so every launch of an ``Attention`` on one GPU is ordered with
every other: the split scratch, allocated once per shape, is never used by two launches at once.

Caches: plans per shape, modules per compile key (in the backend), scratch per shape, and the
launch arguments of the last pointers seen per shape; after the first call for a shape a call is
the argument checks, dict lookups, and one or two launches, with no host synchronisation (on an
H200: about 26 us per call from torch, of which 9 us is PyCUDA's own launch call).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import math
import os
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kernels import build
from kernels.launch import DeviceBuffers, KernelLaunch, buffer_elements, launch_sequence
from tuner.costmodel import predict_time_ms
from tuner.device import DeviceProfile
from tuner.environment import Environment
from tuner.errors import BackendError, TunerError
from tuner.planner.space import candidate_space
from tuner.planner.tunable import FAMILIES, KernelParams, KernelPlan, plan_kernel
from tuner.problem import Problem

if TYPE_CHECKING:
    from db import PlanRegistry, StoredPlan

logger = logging.getLogger("kernels.attention")

#: the file of ``db.DEFAULT_URL`` (sqlite:///db/plans.sqlite), relative to the working directory
DEFAULT_REGISTRY_FILE = Path("db") / "plans.sqlite"
#: where compiled cubins are cached when ``cache_dir`` is not given (else the backend's default)
CACHE_DIR_VARIABLE = "FLASH_ATTENTION_TUNER_CUBIN_CACHE"
LAYOUT = "[batch, heads, seq_len, head_dim]"
FLOAT32 = np.dtype(np.float32)
#: default-plan candidates tried (best prediction first) before giving up on a shape
DEFAULT_PLAN_TRIES = 16
#: stream handles that mean the legacy default stream (0, cudaStreamLegacy)
LEGACY_STREAMS = (0, 1)
#: interface stream values our legacy-stream launch is already ordered after (None: no producer
#: stream; 1: legacy default; 2: per-thread default, which syncs with the legacy one)
ORDERED_STREAMS = (None, 1, 2)
# CUpointer_attribute and CUmemorytype values (cuda.h)
_CONTEXT, _MEMORY_TYPE, _DEVICE_ORDINAL = 1, 2, 9
_HOST, _DEVICE, _UNIFIED = 1, 2, 4

Key = tuple[tuple[int, ...], bool]  # (shape, causal); dtype is always float32


class AttentionInputError(TunerError, ValueError):
    """An argument of ``attention`` is not what it must be; the message names it."""


class AttentionInputTypeError(AttentionInputError, TypeError):
    """An argument of the wrong kind or dtype."""


# ---------------------------------------------------------------------------- argument checks


class DeviceArray(NamedTuple):
    """What the checks learned about one argument (a tuple: cheap to make on every call)."""

    name: str
    value: Any
    is_torch: bool
    shape: tuple[int, ...]
    pointer: int
    device: int | None  # torch's device index; None for interface arrays (the pointer says)
    stream: int | None = None  # interface v3 "stream": the producer's stream
    readonly: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * FLOAT32.itemsize


class Inputs(NamedTuple):
    q: DeviceArray
    k: DeviceArray
    v: DeviceArray
    out: DeviceArray | None

    @property
    def arrays(self) -> tuple[DeviceArray, ...]:
        given = (self.q, self.k, self.v)
        return given if self.out is None else (*given, self.out)


def _type_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def _kind(array: DeviceArray) -> str:
    return "torch tensor" if array.is_torch else f"device array ({_type_name(array.value)})"


def _check_shape(name: str, shape: tuple[int, ...]) -> None:
    if len(shape) != 4:
        raise AttentionInputError(
            f"{name} has {len(shape)} dimensions (shape {shape}); expected 4: {LAYOUT}"
        )
    if 0 in shape:
        raise AttentionInputError(
            f"{name} has shape {shape} with an empty dimension; each of {LAYOUT} must be > 0"
        )


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], FLOAT32.itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    # A dimension of size 1 is never stepped over, so its stride does not matter (numpy's rule).
    return all(
        size == 1 or stride == want
        for size, stride, want in zip(shape, strides, _c_strides(shape), strict=True)
    )


def describe(name: str, value: Any) -> DeviceArray:
    """Check one argument on its own (kind, dtype, rank, contiguity); no CUDA call."""
    torch = sys.modules.get("torch")  # a torch tensor exists only if torch was imported
    if torch is not None and isinstance(value, torch.Tensor):
        return _describe_tensor(name, value, torch)
    try:
        interface = value.__cuda_array_interface__
    except AttributeError:
        interface = None
    except Exception as error:  # some producers raise their own errors from the property
        raise AttentionInputTypeError(
            f"{name}: its __cuda_array_interface__ cannot be read: {error}"
        ) from error
    if not isinstance(interface, Mapping):
        host = " in host memory" if hasattr(value, "__array_interface__") else ""
        raise AttentionInputTypeError(
            f"{name} is a {_type_name(value)}{host}; expected a device array: a torch CUDA "
            "tensor, a pycuda GPUArray or an object with __cuda_array_interface__"
        )
    return _describe_interface(name, value, interface)


def _describe_tensor(name: str, value: Any, torch: Any) -> DeviceArray:
    device = value.device
    if device.type != "cuda":
        raise AttentionInputTypeError(
            f"{name} is a torch tensor on {device}; expected a CUDA tensor ({name}.cuda())"
        )
    if value.dtype != torch.float32:
        raise AttentionInputTypeError(f"{name} has dtype {value.dtype}; expected torch.float32")
    shape = tuple(value.shape)  # torch.Size: ints already
    _check_shape(name, shape)
    if not value.is_contiguous():
        raise AttentionInputError(
            f"{name} is not C-contiguous (shape {shape}, strides {tuple(value.stride())} "
            f"elements); pass {name}.contiguous()"
        )
    if value.requires_grad and torch.is_grad_enabled():
        raise AttentionInputError(
            f"{name} requires grad, but kernels.attention has no backward pass; call it under "
            f"torch.no_grad() or pass {name}.detach()"
        )
    return DeviceArray(name, value, True, shape, value.data_ptr(), device.index or 0)


def _describe_interface(name: str, value: Any, interface: Mapping[str, Any]) -> DeviceArray:
    try:
        shape = tuple(int(size) for size in interface["shape"])
        typestr = interface["typestr"]
        pointer, readonly = interface["data"]
    except (KeyError, TypeError, ValueError) as error:
        raise AttentionInputTypeError(
            f"{name}'s __cuda_array_interface__ is malformed ({error!r}); it needs shape, "
            "typestr and data"
        ) from error
    try:
        dtype: np.dtype | None = np.dtype(typestr)
    except (TypeError, ValueError):
        dtype = None
    if dtype != FLOAT32:
        raise AttentionInputTypeError(
            f"{name} has dtype {dtype if dtype is not None else '?'} (typestr {typestr!r}); "
            "expected float32 ('<f4')"
        )
    _check_shape(name, shape)
    strides = interface.get("strides")
    if strides is not None and len(strides) != len(shape):
        raise AttentionInputTypeError(f"{name} has {len(strides)} strides for shape {shape}")
    if strides is not None and not _c_contiguous(shape, tuple(int(s) for s in strides)):
        raise AttentionInputError(
            f"{name} is not C-contiguous (shape {shape}, strides {tuple(strides)} bytes; "
            f"C order is {_c_strides(shape)})"
        )
    if interface.get("mask") is not None:
        raise AttentionInputError(f"{name} has a mask; masked arrays are not supported")
    if not pointer:
        raise AttentionInputError(f"{name} has a null data pointer")
    stream = interface.get("stream")
    return DeviceArray(
        name,
        value,
        False,
        shape,
        int(pointer),
        None,
        stream=None if stream is None else int(stream),
        readonly=bool(readonly),
    )


def check_inputs(q: Any, k: Any, v: Any, out: Any = None) -> Inputs:
    """Check every argument and their agreement; no CUDA call (the pointer checks come later)."""
    first, *given = describe("q", q), describe("k", k), describe("v", v)
    result = describe("out", out) if out is not None else None
    for other in given if result is None else (*given, result):
        if other.is_torch != first.is_torch:
            raise AttentionInputTypeError(
                f"{other.name} is a {_kind(other)} but q is a {_kind(first)}; pass q, k, v "
                "(and out) of one kind"
            )
        if other.shape != first.shape:
            which = "out" if other.name == "out" else "k and v"
            raise AttentionInputError(
                f"{other.name} has shape {other.shape} but q has shape {first.shape}; {which} "
                "must have q's shape"
            )
        if other.device != first.device:
            raise AttentionInputError(
                f"{other.name} is on cuda:{other.device} but q is on cuda:{first.device}; all "
                "arrays must be on one GPU"
            )
    if result is not None:
        if result.readonly:
            raise AttentionInputError("out is read-only (its __cuda_array_interface__ says so)")
        nbytes = result.nbytes  # every array has q's shape by now
        for array in (first, *given):
            if array.pointer < result.pointer + nbytes and result.pointer < array.pointer + nbytes:
                raise AttentionInputError(
                    f"out overlaps {array.name} in memory; the kernels read {array.name} while "
                    "writing out: pass a separate array"
                )
    return Inputs(first, *given, result)


def _check_causal(causal: Any) -> bool:
    if not isinstance(causal, bool | np.bool_):
        raise AttentionInputTypeError(f"causal must be a bool, got {causal!r}")
    return bool(causal)


# ---------------------------------------------------------------------------- pointer facts


class PointerFacts(NamedTuple):
    """What the driver says about a pointer (``cuPointerGetAttributes``)."""

    memory_type: int  # CUmemorytype; 0: not memory CUDA knows
    device: int
    context: int  # the owning CUcontext; 0 when the allocation has none (pools, VMM)


@functools.cache
def _libcuda() -> Any | None:
    """The driver library (loaded already where pycuda or torch run); None where absent."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll", ctypes.util.find_library("cuda")):
        if not name:
            continue
        with contextlib.suppress(OSError):
            library = ctypes.CDLL(name)
            library.cuPointerGetAttributes.argtypes = [
                ctypes.c_uint,
                ctypes.POINTER(ctypes.c_int),
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_ulonglong,
            ]
            library.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            library.cuInit(0)  # idempotent; pointer queries need an initialised driver
            return library
    return None


def query_pointer(pointer: int) -> PointerFacts | None:
    """The pointer's memory type, device and context; None where the driver cannot be asked."""
    library = _libcuda()
    if library is None:
        return None
    context, memory_type, ordinal = ctypes.c_void_p(), ctypes.c_uint(0), ctypes.c_int(-1)
    attributes = (ctypes.c_int * 3)(_CONTEXT, _MEMORY_TYPE, _DEVICE_ORDINAL)
    data = (ctypes.c_void_p * 3)(
        ctypes.addressof(context), ctypes.addressof(memory_type), ctypes.addressof(ordinal)
    )
    # Unlike the singular call, this one reports unknown (host) pointers as type 0, not an error.
    if library.cuPointerGetAttributes(3, attributes, data, pointer) != 0:
        return None
    return PointerFacts(memory_type.value, ordinal.value, context.value or 0)


def current_context() -> int | None:
    library = _libcuda()
    handle = ctypes.c_void_p()
    if library is None or library.cuCtxGetCurrent(ctypes.byref(handle)) != 0:
        return None
    return handle.value or 0


def device_of(arrays: Sequence[DeviceArray], facts: Sequence[PointerFacts | None]) -> int:
    """The one GPU the interface arrays are on, from their pointers (device 0 if none says)."""
    device, first = None, ""
    for array, fact in zip(arrays, facts, strict=True):
        if fact is None:
            continue
        if fact.memory_type not in (_DEVICE, _UNIFIED):
            what = {0: "not memory CUDA knows (host memory?)", _HOST: "page-locked host memory"}
            raise AttentionInputError(
                f"{array.name}'s data pointer {array.pointer:#x} is "
                f"{what.get(fact.memory_type, 'a CUDA array')}; expected device memory"
            )
        if device is None:
            device, first = fact.device, array.name
        elif fact.device != device:
            raise AttentionInputError(
                f"{array.name} is on cuda:{fact.device} but {first} is on cuda:{device}; all "
                "arrays must be on one GPU"
            )
    return device if device is not None else 0


def interface_device(inputs: Inputs) -> tuple[int, list[PointerFacts | None]]:
    facts = [query_pointer(array.pointer) for array in inputs.arrays]
    return device_of(inputs.arrays, facts), facts


# ---------------------------------------------------------------------------- plan choice


@dataclass(frozen=True, slots=True)
class ChosenPlan:
    plan: KernelPlan
    origin: str  # "registry" (a stored plan) or "default" (the planner's best prediction)
    stored: StoredPlan | None = None
    warnings: tuple[str, ...] = ()


PlanCheck = Callable[[KernelPlan], "KernelPlan | str"]


def current_source_hashes() -> dict[str, str]:
    return {family: build.source_hash(family) for family in build.SOURCES}


def _same_gpu(one: Environment, other: Environment) -> bool:
    return (one.gpu_name, one.compute_capability, one.sm_count) == (
        other.gpu_name,
        other.compute_capability,
        other.sm_count,
    )


def _toolchain(environment: Environment) -> str:
    e = environment
    return (
        f"driver {e.driver_version or '?'}, CUDA {e.cuda_version or '?'}, "
        f"nvcc {e.nvcc_version or '?'}, pycuda {e.pycuda_version or '?'}"
    )


class PlanChooser:
    """The plan of each shape on one GPU, chosen once; pure (``check`` compiles on a GPU).

    ``registry`` is anything with ``PlanRegistry.cached_best``'s signature, or None.
    ``check(plan)`` returns the plan judged with the compiler's resources, or why it cannot run.
    """

    def __init__(
        self,
        registry: Any,
        environment: Environment,
        device: DeviceProfile,
        *,
        source_hashes: Mapping[str, str] | None = None,
        nearest: bool = False,
        check: PlanCheck | None = None,
        registry_label: str = "",
    ) -> None:
        self.registry = registry
        self.environment = environment
        self.device = device
        hashes = current_source_hashes() if source_hashes is None else source_hashes
        self.source_hashes = dict(hashes)
        self.nearest = nearest
        self._check: PlanCheck = check or (lambda plan: plan)
        self._label = registry_label or str(getattr(registry, "url", "")) or "(unnamed)"
        self._plans: dict[Problem, ChosenPlan] = {}
        self._lock = threading.Lock()

    def plan_for(self, problem: Problem) -> ChosenPlan:
        chosen = self._plans.get(problem)
        if chosen is None:
            with self._lock:  # one thread chooses (and compiles); the others wait for it
                chosen = self._plans.get(problem)
                if chosen is None:
                    chosen = self._plans[problem] = self._choose(problem)
        return chosen

    def _choose(self, problem: Problem) -> ChosenPlan:
        stored, why = self._lookup(problem)
        if stored is not None:
            plan = self._replan(problem, stored)
            if isinstance(plan, KernelPlan):
                notes = self._doubts(problem, stored, plan)
                for note in notes:
                    logger.warning(note)
                if stored.fallback:
                    logger.info(
                        "no plan for %s; using the one tuned for the nearest shape %s",
                        problem.label(),
                        stored.problem.label(),
                    )
                return ChosenPlan(plan, "registry", stored, notes)
            why = f"the registry's plan for {problem.label()} cannot run here: {plan}"
        plan = self._default(problem)
        note = (
            f"{why}; using the planner's default plan {plan.key()} (predicted "
            f"{predict_time_ms(plan, self.device):.3f} ms on {self.device.name})"
        )
        logger.warning(note)
        return ChosenPlan(plan, "default", None, (note,))

    def _lookup(self, problem: Problem) -> tuple[StoredPlan | None, str]:
        label = problem.label()
        if self.registry is None:
            return None, f"no plan registry (none given, no {DEFAULT_REGISTRY_FILE} here)"
        ask = {"nearest": self.nearest, "source_hashes": self.source_hashes}
        found = self.registry.cached_best(problem, self.environment, **ask)
        if found is not None:
            return found, ""
        # Plans of the same GPU model under another driver/nvcc/pycuda are still good plans.
        anywhere = self.registry.cached_best(problem, None, **ask)
        if anywhere is None:
            return None, f"no plan for {label} in registry {self._label}"
        if _same_gpu(anywhere.environment, self.environment):
            return anywhere, ""
        other = anywhere.environment
        return None, (
            f"registry {self._label} holds a plan for {label} only for another GPU "
            f"({other.gpu_name}, {other.sm_count} SMs), not this {self.environment.gpu_name}"
        )

    def _replan(self, problem: Problem, stored: StoredPlan) -> KernelPlan | str:
        record = stored.record
        names = {f.name for f in fields(KernelParams)} - {"family"}
        if record.family not in FAMILIES or "threads" not in record.params:
            return f"{record.family} {record.params} is not a kernel this version knows"
        if not set(record.params) <= names:
            return f"unknown tunables {sorted(set(record.params) - names)}"
        params = KernelParams(record.family, **record.params)  # type: ignore[arg-type]
        plan = plan_kernel(problem, params, self.device)
        return self._check(plan) if plan.feasible else plan.reason

    def _doubts(self, problem: Problem, stored: StoredPlan, plan: KernelPlan) -> tuple[str, ...]:
        record, where = stored.record, f"registry plan {plan.key()} for {problem.label()}"
        notes = []
        if stored.stale:
            current = self.source_hashes.get(record.family, "")
            notes.append(
                f"{where} was measured under an older {record.family} kernel source "
                f"({record.source_hash[:12] or '?'}, now {current[:12]}); using it, but its "
                "timing says nothing about today's kernel: re-tune"
            )
        elif not record.measured:
            notes.append(
                f"{where} is only predicted by the cost model, never timed; using it: tune on "
                "this GPU for a measured plan"
            )
        if stored.environment != self.environment:
            notes.append(
                f"{where} was tuned on this GPU model under another toolchain "
                f"({_toolchain(stored.environment)}; here {_toolchain(self.environment)}); "
                "using it"
            )
        return tuple(notes)

    def _default(self, problem: Problem) -> KernelPlan:
        label, space = problem.label(), candidate_space(problem, self.device)
        if not space.feasible:
            first = space.rejected[0].reason if space.rejected else "none planned"
            raise BackendError(
                f"no feasible kernel plan for {label} on {self.device.name}: all "
                f"{len(space.rejected)} candidates rejected (first: {first})"
            )
        ranked = sorted(space.feasible, key=lambda plan: predict_time_ms(plan, self.device))
        failures = []
        for plan in ranked[:DEFAULT_PLAN_TRIES]:
            checked = self._check(plan)
            if isinstance(checked, KernelPlan):
                return checked
            failures.append(f"{plan.key()}: {checked}")
        raise BackendError(
            f"no runnable kernel plan for {label} on {self.device.name}: the "
            f"{len(failures)} best predictions failed (first: {failures[0]})"
        )


# ---------------------------------------------------------------------------- one GPU


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


class _DeviceRunner:
    """One GPU: its primary context (through ``PyCudaBackend``), plans, kernels, scratch."""

    def __init__(self, index: int, registry: Any, nearest: bool, cache_dir: Path | None) -> None:
        from kernels.backends.pycuda_backend import PyCudaBackend

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
        with self.backend._active():
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
        (batch, heads, seq_len, head_dim), causal = key
        problem = Problem(seq_len, head_dim, batch=batch, heads=heads, causal=causal)
        plan = self.chooser.plan_for(problem).plan
        compiled = self._compiled.get(build.KernelSpec.from_plan(plan).key)
        if compiled is None:  # the chooser's check keeps it; compile (a cache hit) if not
            checked = self._check(plan)
            if isinstance(checked, str):
                raise BackendError(f"{plan.key()} for {problem.label()}: {checked}")
            compiled = self._compiled[build.KernelSpec.from_plan(plan).key]
        needed = buffer_elements(plan)
        with self.backend._active() as drv:
            try:
                # Private in the backend: loads each cubin once per compile key.
                functions = self.backend._functions(drv, compiled)
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
                    scratch = (drv.mem_alloc(needed.partial_o * 4), None)
                    scratch = (scratch[0], drv.mem_alloc(needed.partial_ml * 4))
                except drv.Error as error:
                    raise BackendError(
                        f"{plan.key()}: the split scratch of {problem.label()} "
                        f"({(needed.partial_o + needed.partial_ml) * 4} B) does not fit: {error}"
                    ) from error
        return _Prepared(plan, functions, scratch)

    def _launch(self, prepared: _Prepared, launches: Sequence[KernelLaunch], stream: Any) -> None:
        with self.backend._active() as drv:
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

    def run_torch(self, inputs: Inputs, causal: bool, torch: Any) -> Any:
        prepared = self.prepared((inputs.q.shape, causal))
        # torch work (allocation, stream and event calls) stays outside our pushed context.
        if inputs.out is None:
            result = torch.empty_like(inputs.q.value)
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
        with self.backend._active() as drv:
            own = drv.Stream()  # blocking: ordered with the legacy default stream too
        external = torch.cuda.ExternalStream(own.handle, device=torch.device("cuda", self.index))
        self._bridge = _StreamBridge(own, external, torch.cuda.Event(), torch.cuda.Event())
        return self._bridge

    def run_arrays(self, inputs: Inputs, causal: bool, facts: Sequence[PointerFacts | None]) -> Any:
        for array, fact in zip(inputs.arrays, facts, strict=True):
            # 0: pool and VMM allocations belong to no context; None: the driver was not asked.
            if fact and fact.context and self.context and fact.context != self.context:
                raise AttentionInputError(
                    f"{array.name} belongs to another CUDA context than cuda:{self.index}'s "
                    "primary context, which kernels.attention (and torch) use: allocate it "
                    "there (pycuda.autoprimaryctx, not pycuda.autoinit)"
                )
        prepared = self.prepared((inputs.q.shape, causal))
        with self.backend._active() as drv:
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
        with contextlib.suppress(Exception), self.backend._active():
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
        return gpuarray.empty_like(like.value)  # keeps the caller's allocator (a pool, say)
    return gpuarray.empty(like.shape, FLOAT32)


# ---------------------------------------------------------------------------- the API


class Attention:
    """A registry handle, caches and per-GPU state; call it like ``attention``.

    ``registry``: None (``sqlite:///db/plans.sqlite`` when ``db/plans.sqlite`` exists in the
    working directory, else none), a SQLAlchemy URL (opened read-only on first use), or an open
    ``PlanRegistry`` (or anything with its ``cached_best``). ``nearest``: fall back to the
    nearest tuned shape. ``cache_dir``: the cubin cache (default: the directory in
    ``$FLASH_ATTENTION_TUNER_CUBIN_CACHE``, else the PyCUDA backend's).
    """

    def __init__(
        self,
        registry: str | PlanRegistry | None = None,
        *,
        nearest: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if registry is None and DEFAULT_REGISTRY_FILE.exists():
            registry = f"sqlite:///{DEFAULT_REGISTRY_FILE.resolve().as_posix()}"
        self.registry_url = registry if isinstance(registry, str) else None
        self._registry = None if isinstance(registry, str) else registry
        self.nearest = nearest
        directory = cache_dir or os.environ.get(CACHE_DIR_VARIABLE)
        self.cache_dir = Path(directory).expanduser() if directory else None
        self._runners: dict[int, _DeviceRunner] = {}
        self._lock = threading.Lock()

    def __call__(self, q: Any, k: Any, v: Any, causal: bool = False, *, out: Any = None) -> Any:
        inputs = check_inputs(q, k, v, out)
        causal = _check_causal(causal)
        if inputs.q.is_torch:
            runner = self._runner(inputs.q.device or 0)
            return runner.run_torch(inputs, causal, sys.modules["torch"])
        device, facts = interface_device(inputs)
        return self._runner(device).run_arrays(inputs, causal, facts)

    def plan_for(self, problem: Problem, device: int = 0) -> ChosenPlan:
        """The plan ``problem`` runs with on GPU ``device`` (chosen now if not yet)."""
        return self._runner(device).chooser.plan_for(problem)

    def environment(self, device: int = 0) -> Environment:
        """GPU ``device``'s environment: what the registry is asked with."""
        return self._runner(device).environment

    def _runner(self, index: int) -> _DeviceRunner:
        runner = self._runners.get(index)
        if runner is None:
            with self._lock:
                runner = self._runners.get(index)
                if runner is None:
                    registry = self._open_registry()
                    runner = _DeviceRunner(index, registry, self.nearest, self.cache_dir)
                    self._runners[index] = runner
        return runner

    def _open_registry(self) -> Any:
        if self._registry is None and self.registry_url is not None:
            from db import PlanRegistry

            self._registry = PlanRegistry.open(self.registry_url, readonly=True)
        return self._registry

    def close(self) -> None:
        """Free device state; close the registry if this object opened it.

        GPUArrays it returned belong to the context it retained: free them first.
        """
        with self._lock:
            for runner in self._runners.values():
                runner.close()
            self._runners.clear()
            if self.registry_url is not None and self._registry is not None:
                self._registry.close()
                self._registry = None


_instances: dict[tuple[Any, bool], Attention] = {}
_instances_lock = threading.Lock()


def default_instance(
    registry: str | PlanRegistry | None = None, *, nearest: bool = False
) -> Attention:
    """The shared ``Attention`` of a registry: one per URL (or handle) and ``nearest``.

    For ``registry=None`` whether ``db/plans.sqlite`` exists is decided at the first call.
    A handle is kept alive by its instance, so its ``id`` is never reused for another.
    """
    if registry is None:
        name: tuple[str, Any] = ("default", None)
    elif isinstance(registry, str):
        name = ("url", registry)
    else:
        name = ("handle", id(registry))
    key = (name, nearest)
    found = _instances.get(key)
    if found is None:
        with _instances_lock:
            found = _instances.get(key)
            if found is None:
                found = _instances[key] = Attention(registry, nearest=nearest)
    return found


def clear_default_instances() -> None:
    with _instances_lock:
        for instance in _instances.values():
            instance.close()
        _instances.clear()


def attention(
    q: Any,
    k: Any,
    v: Any,
    causal: bool = False,
    registry: str | PlanRegistry | None = None,
    *,
    out: Any = None,
    nearest: bool = False,
) -> Any:
    """softmax(q k^T / sqrt(head_dim)) v with the tuned plan of this shape; see the module doc.

    Returns a new array of q's kind (a torch tensor, else a GPUArray), or ``out`` filled.
    """
    return default_instance(registry, nearest=nearest)(q, k, v, causal, out=out)


class _CallableModule(types.ModuleType):
    """``kernels.attention`` is this module once imported; calling it calls ``attention``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return attention(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
