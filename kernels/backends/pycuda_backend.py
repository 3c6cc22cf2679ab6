"""The PyCUDA backend: compile (cached), launch, parity-check and time one plan on a real GPU.

With ``pycuda_attention`` (the deploy path) the only modules that import
pycuda, and only inside functions, so the package imports on machines without
CUDA. It works in the device's *primary* context (``retain_primary_context``),
the one the CUDA runtime and torch use, so pycuda and torch share one process
(``bench/speed_check.py``); the context is pushed around each call and popped
after, so the backend can be used from any thread and leaves the caller's
context stack as it found it.

Per problem (not per candidate) it allocates the device buffers, draws fresh
seeded random-normal inputs (``kernels.tuning_inputs``: with the ALiBi slopes and
sink logits a variant problem needs, uploaded once, and logits in the hundreds for a
softcap), computes the float64 CPU reference on the same values (whole or
sampled, ``kernels.parity``) and, for float32 problems too large to check whole on the
CPU, the scalar kernel's output on the same inputs where that kernel takes the
problem; each candidate then costs a cache lookup, a module load and its launches.

A backward problem's trial (``kernels.backends.pycuda_backward``) runs the forward once with
its LSE, checks dQ, dK, dV against float64 gradients and times the backward launches alone.

Failures are values (``Measurement.failed``): INFEASIBLE (the planner or
ptxas's register/spill report rules it out), COMPILE, RESOURCES (the launch
itself is refused), WRONG_ANSWER, and RUNTIME_DEVICE. A RUNTIME_DEVICE failure
(illegal address, misaligned access, any error once a kernel has run) leaves
the CUDA context unusable for the rest of the process: the backend sets
``context_lost`` and every later ``measure`` raises ``DeviceContextLost``, so
the isolation layer must end this worker process and start a fresh one.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kernels import build, precision, tuning_inputs
from kernels.attention_variants import VariantValues
from kernels.backends.base import Backend, Failure, Measurement
from kernels.cuda_driver import CudaDriver, ctypes_argument, pack_launch
from kernels.launch import (
    BufferElements,
    DeviceBuffers,
    KernelLaunch,
    buffer_elements,
    launch_sequence,
)
from kernels.parity import CpuReference, ParityResult, compare, full_check
from kernels.serving_inputs import ServingCheck
from kernels.timing import TimingStats, throughput, time_repetitions
from tuner.device import H200, PROFILES, DeviceProfile
from tuner.environment import Environment
from tuner.errors import BackendError
from tuner.planner.launches import TensorMap
from tuner.planner.seed import FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
from tuner.planner.tunable import KernelParams, KernelPlan, plan_kernel, scalar_shared_bytes
from tuner.problem import Problem

#: a quiet-NaN bit pattern: outputs are filled with it so unwritten elements fail parity
NAN_BITS = 0x7FC00000
#: block size of the scalar kernel that serves as the GPU reference for large problems
SCALAR_REFERENCE_THREADS = 128
DEFAULT_CACHE_DIR = "~/.cache/flash-attention-tuner/cubins"

# cuGetErrorString texts of a launch the driver refuses before running it
# (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, CUDA_ERROR_INVALID_VALUE); the context survives these.
_REFUSED_LAUNCH = ("too many resources", "out of resources", "invalid argument", "invalid value")


class DeviceContextLost(BackendError):
    """A kernel faulted earlier; this process's CUDA context is unusable. Start a new worker."""


def launch_refused(message: str) -> bool:
    """Whether a launch-time error means "this configuration cannot launch" (RESOURCES)."""
    text = message.lower()
    return any(marker in text for marker in _REFUSED_LAUNCH)


class _LaunchRefused(Exception):
    pass


class _DeviceFault(Exception):
    pass


@dataclass
class _ProblemState:
    """What one problem keeps on the device and host across candidates."""

    problem: Problem
    host_q: np.ndarray
    host_k: np.ndarray
    host_v: np.ndarray
    q: Any
    k: Any
    v: Any
    out: Any
    reference: CpuReference | ServingCheck
    #: the pass limit on max|out - ref| (``kernels.precision``: FlashAttention's rule
    #: against torch for half types and float32 tf32x3, against TF32 rounding for tf32)
    tolerance: float
    #: q, k, v as stored on the device (float32, float16, or bfloat16 bit patterns)
    stored: tuple[np.ndarray, ...] = ()
    partial_o: Any = None
    partial_ml: Any = None
    partial_capacity: BufferElements | None = None
    scalar_output: np.ndarray | None = None
    #: the variants' values the kernels get and the reference uses
    variants: VariantValues = VariantValues()
    #: device copies of the float32 ALiBi slopes and sink logits (None when off)
    alibi_slopes: Any = None
    sinks: Any = None
    #: float32 ``[batch*heads*seq_len]`` for the log-sum-exp, made when first asked for
    lse: Any = None
    #: a serving batch's page lists (paged KV cache) and the last plan's work list
    pages: Any = None
    work: Any = None


def _has_tensor_maps(launches: tuple[KernelLaunch, ...]) -> bool:
    return any(isinstance(a, TensorMap) for launch in launches for a in launch.args)


class PyCudaBackend(Backend):
    name = "pycuda"

    def __init__(
        self,
        device_index: int = 0,
        *,
        cache_dir: str | Path = DEFAULT_CACHE_DIR,
        repetitions: int = 30,
        warmup: int = 3,
        flush_l2: bool = True,
        seed: int = 0,
        tolerance: float = FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS,
        judge_resources: bool = True,
    ) -> None:
        self.device_index = device_index
        self.cache_dir = Path(cache_dir).expanduser()
        self.repetitions = repetitions
        self.warmup = warmup
        self.flush_l2 = flush_l2
        self.seed = seed
        self.tolerance = tolerance
        #: False runs plans ptxas reports as spilling (correctness tests; never for tuning)
        self.judge_resources = judge_resources
        self.context_lost = False
        self._lost_reason = ""
        self._drv: Any = None
        self._device: Any = None
        self._context: Any = None
        self._profile: DeviceProfile | None = None
        self._modules: dict[str, Any] = {}
        #: cubins loaded through the driver for TMA launches: compile key -> CUmodule
        self._driver_modules: dict[str, int] = {}
        self._driver: CudaDriver | None = None
        self._state: _ProblemState | None = None
        #: the backward problem's buffers, reference and forward (``pycuda_backward``)
        self._backward_state: Any = None
        self._flush_buffer: Any = None
        self._flush_bytes = 0

    # ------------------------------------------------------------------ context

    def _open(self) -> None:
        if self._context is not None:
            return
        try:
            import pycuda.driver as drv
        except ImportError as error:
            raise BackendError(
                "pycuda is not installed: pip install 'flash-attention-tuner[cuda]'"
            ) from error
        try:
            drv.init()
            count = drv.Device.count()
            if self.device_index >= count:
                raise BackendError(
                    f"CUDA device {self.device_index} requested but {count} visible "
                    "(CUDA_VISIBLE_DEVICES renumbers them from 0)"
                )
            device = drv.Device(self.device_index)
            context = device.retain_primary_context()
        except drv.Error as error:
            raise BackendError(f"no CUDA device answers: {error}") from error
        self._drv, self._device, self._context = drv, device, context

    @contextlib.contextmanager
    def active(self) -> Iterator[Any]:
        """The device's primary context pushed for the block; yields ``pycuda.driver``."""
        self._open()
        self._context.push()
        try:
            yield self._drv
        finally:
            with contextlib.suppress(Exception):
                self._drv.Context.pop()

    def close(self) -> None:
        if self._context is None:
            return
        with contextlib.suppress(Exception), self.active():
            # Free device memory while the context is current.
            self._state = None
            self._backward_state = None
            self._flush_buffer = None
            self._modules.clear()
            for module in self._driver_modules.values():
                self._driver.unload_module(module)  # type: ignore[union-attr]
            self._driver_modules.clear()
        with contextlib.suppress(Exception):
            self._context.detach()
        self._context = None

    # ------------------------------------------------------------------ facts

    def device_profile(self) -> DeviceProfile:
        """The live device's limits; ceilings (peak FLOP/s, bandwidth) from a named
        profile of the same GPU where there is one, else derived from its clocks."""
        if self._profile is not None:
            return self._profile
        self._open()
        drv, device = self._drv, self._device

        def attribute(name: str, default: int) -> int:
            enum = getattr(drv.device_attribute, name, None)
            if enum is None:
                return default
            try:
                return int(device.get_attribute(enum))
            except drv.Error:
                return default

        name = device.name()
        template = next((p for p in PROFILES.values() if p.name == name), None)
        base = template or H200
        sm_count = attribute("MULTIPROCESSOR_COUNT", base.sm_count)
        profile = replace(
            base,
            name=name,
            compute_capability=tuple(device.compute_capability()),
            sm_count=sm_count,
            max_threads_per_block=attribute("MAX_THREADS_PER_BLOCK", base.max_threads_per_block),
            max_threads_per_sm=attribute("MAX_THREADS_PER_MULTIPROCESSOR", base.max_threads_per_sm),
            max_blocks_per_sm=attribute("MAX_BLOCKS_PER_MULTIPROCESSOR", base.max_blocks_per_sm),
            max_shared_memory_per_block_optin=attribute(
                "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", base.max_shared_memory_per_block_optin
            ),
            shared_memory_per_sm=attribute(
                "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR", base.shared_memory_per_sm
            ),
            reserved_shared_memory_per_block=attribute(
                "RESERVED_SHARED_MEMORY_PER_BLOCK", base.reserved_shared_memory_per_block
            ),
            registers_per_sm=attribute("MAX_REGISTERS_PER_MULTIPROCESSOR", base.registers_per_sm),
            registers_per_block=attribute("MAX_REGISTERS_PER_BLOCK", base.registers_per_block),
            warp_size=attribute("WARP_SIZE", base.warp_size),
            l2_bytes=attribute("L2_CACHE_SIZE", base.l2_bytes),
        )
        if template is None:
            # Unknown GPU: 128 FP32 lanes per SM (sm_86 and later), 2 flops per FMA;
            # DRAM: double data rate over the bus. Clocks are reported in kHz.
            clock_ghz = attribute("CLOCK_RATE", int(base.clock_ghz * 1e6)) / 1e6
            memory_khz = attribute("MEMORY_CLOCK_RATE", 0)
            bus_bits = attribute("GLOBAL_MEMORY_BUS_WIDTH", 0)
            bandwidth = 2 * memory_khz * 1e3 * bus_bits / 8 / 1e9
            profile = replace(
                profile,
                clock_ghz=clock_ghz,
                peak_fp32_tflops=sm_count * 128 * 2 * clock_ghz / 1e3,
                # Scaled from the H200's mma.sync rate by SMs x clock (same
                # tensor-core width per SM assumed).
                peak_mma_f16_tflops=base.peak_mma_f16_tflops
                * sm_count
                * clock_ghz
                / (base.sm_count * base.clock_ghz),
                dram_bandwidth_gbps=bandwidth or base.dram_bandwidth_gbps,
            )
        self._profile = profile
        return profile

    def environment(self) -> dict[str, str | int]:
        self._open()
        import pycuda

        profile = self.device_profile()
        cuda = int(self._drv.get_driver_version())
        major, minor = profile.compute_capability
        return Environment(
            gpu_name=profile.name,
            compute_capability=f"{major}.{minor}",
            sm_count=profile.sm_count,
            driver_version=_driver_version(),
            cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
            nvcc_version=build.nvcc_version() or "",
            pycuda_version=str(pycuda.VERSION_TEXT),
        ).as_dict()

    # ------------------------------------------------------------------ measure

    def precompile(
        self,
        plans: Iterable[KernelPlan],
        jobs: int | None = None,
        progress: build.Progress | None = None,
    ) -> dict[str, build.CompileResult]:
        """Compile every distinct variant of ``plans`` into the cache, in parallel."""
        return build.compile_many(
            plans, self.cache_dir, jobs=jobs, arch=self.device_profile().arch, progress=progress
        )

    def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
        self._check_usable(plan, problem)
        if not plan.feasible:
            return Measurement.failed(Failure.INFEASIBLE, plan.reason, measured=False)
        device = self.device_profile()
        compiled = build.compile_kernel(plan, self.cache_dir, arch=device.arch)
        if isinstance(compiled, build.CompileFailure):
            return Measurement.failed(Failure.COMPILE, compiled.reason, measured=False)
        judged = plan.with_resources(compiled.primary_resources, device)
        if not judged.feasible and self.judge_resources:
            return Measurement.failed(Failure.INFEASIBLE, judged.reason, measured=False)
        with self.active() as drv:
            try:
                return self._measure_loaded(drv, judged, compiled)
            except _LaunchRefused as refused:
                return Measurement.failed(Failure.RESOURCES, str(refused))
            except _DeviceFault as fault:
                self._lose(fault)
                return Measurement.failed(Failure.RUNTIME_DEVICE, str(fault))

    def prepare(self, problem: Problem) -> None:
        """Inputs on the device and the CPU reference of ``problem``, built now: the first
        measurement of a large problem otherwise spends seconds on them."""
        with self.active() as drv:
            self._problem_state(drv, problem)

    def inputs(self, problem: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The host copies of the problem's inputs (q as ``[batch*heads, seq_len, head_dim]``,
        k and v as ``[batch*kv_heads, kv_len, head_dim]``, float32: the values of the inputs
        as rounded to the dtype) that every
        candidate runs on, so peers can be timed on them too."""
        with self.active() as drv:
            state = self._problem_state(drv, problem)
        return state.host_q, state.host_k, state.host_v

    def variants(self, problem: Problem) -> VariantValues:
        """The variants' values every candidate of ``problem`` runs with (the ALiBi slopes and
        sinks uploaded, as float32 values) and the reference uses."""
        with self.active() as drv:
            return self._problem_state(drv, problem).variants

    def output(
        self, plan: KernelPlan, problem: Problem, *, lse: bool = False
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """One run of ``plan`` on ``inputs(problem)``, its output copied back: no checks, no timing.
        With ``lse``, the run is asked for each row's log-sum-exp too (``DeviceBuffers.lse``,
        NaN-poisoned first) and returns (output, LSE ``[batch*heads, seq_len]``).

        Raises ``BackendError`` when the plan cannot run (``DeviceContextLost`` on a fault).
        """
        self._check_usable(plan, problem)
        compiled = build.compile_kernel(plan, self.cache_dir, arch=self.device_profile().arch)
        if isinstance(compiled, build.CompileFailure):
            raise BackendError(f"{plan.key()} does not compile: {compiled.reason}")
        with self.active() as drv:
            try:
                state, run = self._prepare(drv, plan, compiled, lse=lse)
                output = self._run_once(drv, state, run)
                return (output, self._read_lse(drv, state)) if lse else output
            except _LaunchRefused as refused:
                raise BackendError(f"{plan.key()} cannot launch: {refused}") from refused
            except _DeviceFault as fault:
                self._lose(fault)
                raise DeviceContextLost(f"{plan.key()} faulted: {fault}") from fault

    def _check_usable(self, plan: KernelPlan, problem: Problem) -> None:
        if self.context_lost:
            raise DeviceContextLost(
                f"the CUDA context was lost earlier ({self._lost_reason}); "
                "measure in a fresh process"
            )
        if plan.problem != problem:
            raise ValueError(
                f"{plan.key()} was planned for {plan.problem.label()}, not {problem.label()}"
            )

    def _lose(self, fault: Exception) -> None:
        self.context_lost = True
        self._lost_reason = str(fault)

    def _prepare(
        self, drv: Any, plan: KernelPlan, compiled: build.CompiledKernel, lse: bool = False
    ) -> tuple[_ProblemState, Callable[[], None]]:
        """The problem's state and a closure launching ``plan`` once (nothing run yet); with
        ``lse`` the launches write the log-sum-exp too."""
        state = self._problem_state(drv, plan.problem)
        functions = self.functions(drv, compiled)
        launches = launch_sequence(plan, self._buffers(drv, state, plan, lse))
        if _has_tensor_maps(launches):
            return state, self._driver_launcher(compiled, launches)

        def run() -> None:
            self._launch(drv, functions, launches)

        return state, run

    def _driver_launcher(
        self, compiled: build.CompiledKernel, launches: tuple[KernelLaunch, ...]
    ) -> Callable[[], None]:
        """Launches with TMA descriptors go through ``cuLaunchKernel``'s ``kernelParams``
        (``kernels.cuda_driver``, as the deploy handle launches them) on the legacy default
        stream of the current context, where PyCUDA's launches and timing events run. Not
        through PyCUDA: its ``Function`` takes one packed argument buffer and exposes no
        ``CUfunction`` handle; the descriptors are encoded once here."""
        if self._driver is None:
            self._driver = CudaDriver()
        driver = self._driver
        module = self._driver_modules.get(compiled.key)
        try:
            if module is None:
                module = self._driver_modules[compiled.key] = driver.load_module(compiled.cubin)
            encoded, packed = [], []
            for launch in launches:
                function = driver.get_function(module, launch.function)
                if launch.needs_shared_opt_in:
                    driver.set_max_dynamic_shared(function, launch.shared_bytes)
                arguments = []
                for value in launch.args:
                    if isinstance(value, TensorMap):
                        encoded.append(driver.encode_tensor_map(value))
                        arguments.append(encoded[-1].value)
                    else:
                        arguments.append(ctypes_argument(value))
                packed.append(
                    pack_launch(
                        launch.function,
                        function,
                        launch.grid,
                        launch.block,
                        launch.shared_bytes,
                        arguments,
                    )
                )
        except BackendError as error:
            raise _LaunchRefused(str(error)) from error
        calls = [(launch.name, driver.bind_launch(launch, 0)) for launch in packed]

        def run() -> None:
            _alive = (encoded, packed)  # the argument objects the bound calls point at
            for name, call in calls:
                status = call()
                if status:
                    message = f"{name}: {driver.error_string(status)}"
                    if launch_refused(message):
                        raise _LaunchRefused(message)
                    raise _DeviceFault(message)
            del _alive

        return run

    def _measure_loaded(
        self, drv: Any, plan: KernelPlan, compiled: build.CompiledKernel
    ) -> Measurement:
        if plan.problem.backward:
            from kernels.backends import pycuda_backward

            return pycuda_backward.measure(self, drv, plan, compiled)
        state, run = self._prepare(drv, plan, compiled)
        output = self._run_once(drv, state, run)
        parity = state.reference.check(output, state.tolerance)
        # The scalar kernel (float32) is the GPU reference of large float32 problems;
        # half problems are checked on the CPU reference's sampled rows only.
        if parity.ok and not full_check(plan.problem) and plan.problem.dtype == "float32":
            scalar = self._scalar_output(drv, state)
            if scalar is not None:
                # Both outputs carry their own error: the difference may reach the sum.
                against_scalar = compare(output, scalar, 2 * state.tolerance, "the scalar kernel")
                parity = _worse(parity, against_scalar)
        if not parity.ok:
            return Measurement(
                measured=True,
                max_abs_error=parity.max_abs_error,
                failure=Failure.WRONG_ANSWER,
                detail=parity.detail,
            )
        stats = self._time(drv, run)
        tflops, gbps = throughput(plan.problem, plan, stats.median_ms)
        return Measurement(
            measured=True,
            median_ms=stats.median_ms,
            spread_ms=stats.spread_ms,
            repetitions=len(stats.samples_ms),
            max_abs_error=parity.max_abs_error,
            tflops=tflops,
            gbps=gbps,
            detail=parity.detail,
            samples_ms=stats.samples_ms,
        )

    # ------------------------------------------------------------------ pieces

    def _problem_state(self, drv: Any, problem: Problem) -> _ProblemState:
        if self._state is not None and self._state.problem == problem:
            return self._state
        self._state = self._backward_state = None  # free the previous problem's buffers first
        if problem.serving:
            self._state = self._serving_state(drv, problem)
            return self._state
        # Seeded per problem: reruns see the same inputs, other problems other ones.
        identity = (problem.batch, problem.heads, problem.seq_len, problem.head_dim)
        if not problem.self_attention:  # self-attention problems keep the inputs they had
            identity += (problem.kv_heads, problem.kv_len)
        rng = np.random.default_rng([self.seed, *identity, int(problem.causal)])
        # Random normals rounded to the dtype; the reference sees the rounded values.
        inputs = tuning_inputs.tuning_inputs(problem, rng)
        stored, host, variants = inputs.stored, inputs.values, inputs.variants
        try:
            q, k, v = (drv.to_device(array) for array in stored)
            out = drv.mem_alloc(stored[0].nbytes)
            slopes, sinks = (
                None if values is None else drv.to_device(values)
                for values in (inputs.alibi_slopes, inputs.sinks)
            )
        except drv.MemoryError as error:
            raise BackendError(
                f"{problem.label()} does not fit in device memory: {error}"
            ) from error
        reference = CpuReference(problem, *host, seed=self.seed, variants=variants)
        sampled = (reference.expected, reference.heads, reference.rows)
        sdpa = precision.sdpa_error(problem, *host, *sampled, variants)
        tf32 = None
        if problem.fast_tf32:
            tf32 = precision.tf32_emulation_error(problem, *host, *sampled, variants)
        tolerance = precision.tolerance_for(problem, sdpa, tf32)
        self._state = _ProblemState(
            problem, *host, q, k, v, out, reference, tolerance, tuple(stored),
            variants=variants, alibi_slopes=slopes, sinks=sinks,
        )
        return self._state

    def _serving_state(self, drv: Any, problem: Problem) -> _ProblemState:
        """A serving batch: the problem's sample of lengths, ragged q, a paged (pages in a
        random order) or ragged KV cache with NaN wherever no request reads, and the float64
        reference of every request gathered densely (``kernels.serving_inputs``)."""
        from kernels.serving_inputs import build_inputs
        from kernels.serving_reference import Variant
        from tuner.planner.work_list import problem_batch

        if problem.alibi or problem.sinks:
            # The per-request float64 reference knows the mask and the softcap, not the
            # per-head ALiBi slopes or sinks: such a bucket cannot be judged here (yet).
            raise BackendError(
                f"{problem.label()}: serving buckets with ALiBi or sinks are not measured yet "
                "(kernels.serving_reference has no slopes or sinks)"
            )
        identity = (problem.batch, problem.heads, problem.kv_heads, problem.seq_len)
        identity += (problem.kv_len, problem.head_dim, problem.page_size or 0)
        rng = np.random.default_rng([self.seed, *identity, int(problem.causal)])
        inputs = build_inputs(
            problem_batch(problem), problem.head_dim, problem.dtype, problem.page_size, rng
        )
        variant = Variant(
            problem.causal, problem.window_left, problem.window_right, problem.softcap
        )
        check = ServingCheck(inputs, variant, seed=self.seed)
        stored = (inputs.q_stored, inputs.k_stored, inputs.v_stored)
        try:
            q, k, v = (drv.to_device(array) for array in stored)
            out = drv.mem_alloc(max(inputs.q_stored.nbytes, 1))
            pages = None if inputs.pages is None else drv.to_device(inputs.pages)
        except drv.MemoryError as error:
            raise BackendError(
                f"{problem.label()} does not fit in device memory: {error}"
            ) from error
        state = _ProblemState(
            problem, inputs.q, inputs.k, inputs.v, q, k, v, out, check, check.tolerance, stored
        )
        state.pages = pages
        return state

    def _buffers(
        self, drv: Any, state: _ProblemState, plan: KernelPlan, lse: bool = False
    ) -> DeviceBuffers:
        needed = buffer_elements(plan)
        if lse and state.lse is None:
            try:
                state.lse = drv.mem_alloc(4 * state.problem.batch_heads * state.problem.seq_len)
            except drv.MemoryError as error:
                raise _LaunchRefused(f"the LSE buffer does not fit: {error}") from error
        capacity = state.partial_capacity
        if needed.partial_o and (capacity is None or capacity.partial_o < needed.partial_o):
            state.partial_o = state.partial_ml = state.partial_capacity = None
            try:
                state.partial_o = drv.mem_alloc(needed.partial_o_bytes)
                state.partial_ml = drv.mem_alloc(needed.partial_ml_bytes)
            except drv.MemoryError as error:
                raise _LaunchRefused(
                    f"split buffers do not fit in device memory: {error}"
                ) from error
            state.partial_capacity = needed
        with_partials = needed.partial_o > 0
        work = plan.kernel_family.work_buffer(plan)
        if work is not None:
            state.work = None  # the previous plan's
            try:
                state.work = drv.to_device(work)
            except drv.MemoryError as error:
                raise _LaunchRefused(
                    f"the work list does not fit in device memory: {error}"
                ) from error
        return DeviceBuffers(
            q=int(state.q),
            k=int(state.k),
            v=int(state.v),
            out=int(state.out),
            partial_o=int(state.partial_o) if with_partials else 0,
            partial_ml=int(state.partial_ml) if with_partials else 0,
            alibi_slopes=0 if state.alibi_slopes is None else int(state.alibi_slopes),
            sinks=0 if state.sinks is None else int(state.sinks),
            lse=int(state.lse) if lse else 0,
            work=int(state.work) if work is not None else 0,
            pages=int(state.pages) if state.pages is not None else 0,
        )

    def functions(self, drv: Any, compiled: build.CompiledKernel) -> dict[str, Any]:
        """The entry functions of ``compiled``, its cubin loaded once per compile key.

        Call inside ``active()``; a cubin that does not load raises (``_LaunchRefused``).
        """
        module = self._modules.get(compiled.key)
        if module is None:
            try:
                module = drv.module_from_buffer(compiled.cubin)
            except drv.Error as error:
                raise _LaunchRefused(f"cubin does not load: {error}") from error
            self._modules[compiled.key] = module
        return {
            name: module.get_function(name) for name in build.entry_functions(compiled.spec.family)
        }

    def _launch(
        self, drv: Any, functions: dict[str, Any], launches: tuple[KernelLaunch, ...]
    ) -> None:
        for launch in launches:
            function = functions[launch.function]
            try:
                if launch.needs_shared_opt_in:
                    function.set_attribute(
                        drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, launch.shared_bytes
                    )
                function(
                    *launch.args, grid=launch.grid, block=launch.block, shared=launch.shared_bytes
                )
            except drv.Error as error:
                # Refused launches fail synchronously; anything else here is an
                # earlier kernel's fault surfacing at this call.
                if launch_refused(str(error)):
                    raise _LaunchRefused(f"{launch.function}: {error}") from error
                raise _DeviceFault(f"{launch.function}: {error}") from error

    def _run_once(self, drv: Any, state: _ProblemState, run: Callable[[], None]) -> np.ndarray:
        """One run on NaN-poisoned outputs (and partials); the output copied back."""
        elements = state.host_q.size
        dtype = state.problem.dtype
        try:
            if dtype == "float32":
                drv.memset_d32(state.out, NAN_BITS, elements)
            else:
                drv.memset_d16(state.out, precision.NAN_PATTERN[dtype], elements)
            if state.partial_capacity is not None:
                drv.memset_d32(state.partial_o, NAN_BITS, state.partial_capacity.partial_o)
                drv.memset_d32(state.partial_ml, NAN_BITS, state.partial_capacity.partial_ml)
            if state.lse is not None:
                rows = state.problem.batch_heads * state.problem.seq_len
                drv.memset_d32(state.lse, NAN_BITS, rows)
        except drv.Error as error:
            raise _DeviceFault(f"poisoning the output: {error}") from error
        run()
        output = np.empty(state.host_q.shape, dtype=precision.storage_type(dtype))
        try:
            drv.Context.synchronize()
            drv.memcpy_dtoh(output, state.out)
        except drv.Error as error:
            raise _DeviceFault(str(error)) from error
        if dtype == "float32":
            return output
        return precision.from_storage(output, dtype)

    def _read_lse(self, drv: Any, state: _ProblemState) -> np.ndarray:
        """The LSE buffer after a run, ``[batch*heads, seq_len]`` float32."""
        lse = np.empty((state.problem.batch_heads, state.problem.seq_len), dtype=np.float32)
        try:
            drv.memcpy_dtoh(lse, state.lse)
        except drv.Error as error:
            raise _DeviceFault(str(error)) from error
        return lse

    def _scalar_output(self, drv: Any, state: _ProblemState) -> np.ndarray | None:
        """The scalar kernel's output on this problem's inputs: the GPU reference, computed once;
        None for a variant problem the scalar family refuses (the sampled CPU rows decide)."""
        if state.scalar_output is not None:
            return state.scalar_output
        problem, device = state.problem, self.device_profile()
        # Its accumulators live in shared memory: a smaller block for very wide heads.
        threads = SCALAR_REFERENCE_THREADS
        while threads > device.warp_size and (
            scalar_shared_bytes(threads, problem.head_dim)
            > device.max_shared_memory_per_block_optin
        ):
            threads //= 2
        plan = plan_kernel(problem, KernelParams("scalar_online", threads=threads), device)
        if problem.has_variant and not plan.feasible:
            return None
        compiled = build.compile_kernel(plan, self.cache_dir, arch=device.arch)
        if isinstance(compiled, build.CompileFailure):
            raise BackendError(f"the scalar reference kernel does not compile: {compiled.reason}")
        try:
            _, run = self._prepare(drv, plan, compiled)
            output = self._run_once(drv, state, run)
        except _LaunchRefused as refused:
            raise BackendError(f"the scalar reference kernel cannot launch: {refused}") from refused
        check = state.reference.check(output, self.tolerance)
        if not check.ok:
            raise BackendError(
                f"the scalar reference kernel disagrees with the CPU: {check.detail}"
            )
        state.scalar_output = output
        return output

    def _time(self, drv: Any, run: Callable[[], None]) -> TimingStats:
        flush = None
        if self.flush_l2:
            if self._flush_buffer is None:
                self._flush_bytes = 2 * self.device_profile().l2_bytes
                self._flush_buffer = drv.mem_alloc(self._flush_bytes)
            counter = iter(range(1 << 62))

            def flush() -> None:
                # A changing byte value, so the driver cannot skip a repeated memset.
                drv.memset_d8_async(self._flush_buffer, next(counter) & 0xFF, self._flush_bytes)

        try:
            return time_repetitions(
                run, _EventTimer(drv), repetitions=self.repetitions, warmup=self.warmup, flush=flush
            )
        except drv.Error as error:
            raise _DeviceFault(f"while timing: {error}") from error


class _EventTimer:
    """CUDA events on the default stream, the stream the launches and the flush use."""

    def __init__(self, drv: Any) -> None:
        self._start = drv.Event()
        self._end = drv.Event()

    def start(self) -> None:
        self._start.record()

    def stop(self) -> float:
        self._end.record()
        self._end.synchronize()
        return float(self._end.time_since(self._start))


def _worse(first: ParityResult, second: ParityResult) -> ParityResult:
    if not first.ok:
        return first
    if not second.ok:
        return second
    return ParityResult(True, max(first.max_abs_error, second.max_abs_error), second.detail)


def _driver_version() -> str:
    """The kernel driver's version ("580.159"); the driver API only reports its CUDA version."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return ""
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else ""
