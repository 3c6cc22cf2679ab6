"""A backward trial on the GPU: the forward once (with its LSE), then the backward plan
checked against float64 gradients and timed alone. Used by ``PyCudaBackend.measure`` for
problems whose direction is backward; like it, pycuda only through the backend.

Per problem (not per candidate): seeded inputs rounded to the dtype (the forward problem's,
as the forward backend draws them) and dO, the standard ALiBi slopes and random sinks where
the variant has them, the float64 reference and each gradient's limit
(``kernels.backward_parity``), and one forward run: the cost model's best forward plan that
compiles without spills (what ``kernels.attention`` falls back to), whose output and LSE are
checked against the reference (a wrong forward fails the problem, not the candidates) and
timed, so the run's table can show forward + backward. Per candidate: its scratch, outputs
and scratch poisoned (NaN; counters garbage), one run, the check (non-finite fails, the
detail names each gradient's error and limit), then the timing of the backward launches.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kernels import build, precision
from kernels.attention_variants import alibi_slopes
from kernels.backends.base import Failure, Measurement
from kernels.backward_parity import BackwardReference
from kernels.timing import throughput
from tuner.costmodel import predict_time_ms
from tuner.errors import BackendError
from tuner.planner.launches import BackwardBuffers, DeviceBuffers
from tuner.planner.space import candidate_space
from tuner.planner.tunable import KernelPlan
from tuner.problem import Problem

if TYPE_CHECKING:
    from kernels.backends.pycuda_backend import PyCudaBackend

#: forward candidates tried, best prediction first, before the problem is given up
FORWARD_TRIES = 16
#: poison of the int32 counters (the preprocess must zero them)
COUNTER_POISON = 0x5EED5EED
NAN_BITS = 0x7FC00000


@dataclass
class BackwardState:
    """What one backward problem keeps on the device and host across candidates."""

    problem: Problem
    buffers: dict[str, Any]  # role -> device allocation (inputs, outputs, run-time data)
    reference: BackwardReference
    forward_plan: KernelPlan
    forward_ms: float
    scratch: dict[str, Any] = field(default_factory=dict)  # role -> allocation
    scratch_bytes: dict[str, int] = field(default_factory=dict)


def _address(allocation: Any) -> int:
    return int(allocation) if allocation is not None else 0


def prepare(backend: PyCudaBackend, drv: Any, problem: Problem) -> BackwardState:
    """The problem's inputs, reference and forward run (once per problem)."""
    from kernels.backends.pycuda_backend import _DeviceFault, _LaunchRefused

    found = backend._backward_state
    if found is not None and found.problem == problem:
        return found
    backend._backward_state = backend._state = None  # free the previous problem's buffers
    forward_problem = dataclasses.replace(problem, direction="forward")
    rng = np.random.default_rng([backend.seed, *_identity(problem)])
    stored, (q, k, v) = precision.random_inputs(forward_problem, rng)
    drawn = rng.standard_normal(q.shape, dtype=np.float32)
    dout_stored = precision.to_storage(drawn, problem.dtype)
    dout = precision.from_storage(dout_stored, problem.dtype).astype(np.float32)
    slopes = alibi_slopes(problem.heads).astype(np.float32)
    sinks = rng.standard_normal(problem.heads).astype(np.float32)
    storage = precision.storage_type(problem.dtype)
    try:
        buffers = {
            "q": drv.to_device(stored[0]),
            "k": drv.to_device(stored[1]),
            "v": drv.to_device(stored[2]),
            "dout": drv.to_device(dout_stored),
            "out": drv.mem_alloc(stored[0].nbytes),
            "lse": drv.mem_alloc(4 * problem.batch_heads * problem.seq_len),
            "dq": drv.mem_alloc(stored[0].nbytes),
            "dk": drv.mem_alloc(stored[1].nbytes),
            "dv": drv.mem_alloc(stored[1].nbytes),
            "alibi_slopes": drv.to_device(slopes) if problem.alibi else None,
            "sinks": drv.to_device(sinks) if problem.sinks else None,
            "d_sinks": drv.mem_alloc(4 * problem.heads) if problem.sinks else None,
        }
    except drv.MemoryError as error:
        raise BackendError(f"{problem.label()} does not fit in device memory: {error}") from error
    reference = BackwardReference.compute(
        problem,
        q,
        k,
        v,
        dout,
        slopes if problem.alibi else None,
        sinks if problem.sinks else None,
    )
    try:
        forward, run = _forward(backend, drv, forward_problem, buffers)
        run()
        drv.Context.synchronize()
        out = np.empty(q.shape, dtype=storage)
        lse = np.empty(problem.batch_heads * problem.seq_len, dtype=np.float32)
        drv.memcpy_dtoh(out, buffers["out"])
        drv.memcpy_dtoh(lse, buffers["lse"])
        checked = reference.check_forward(
            precision.from_storage(out, problem.dtype),
            lse,
            precision.FALLBACK_TOLERANCE[problem.dtype],
        )
        if not checked.ok:
            raise BackendError(
                f"the forward {forward.key()} the backward of {problem.label()} runs on is "
                f"wrong: {checked.detail}"
            )
        forward_ms = backend._time(drv, run).median_ms
    except _LaunchRefused as refused:
        raise BackendError(f"the forward of {problem.label()} cannot launch: {refused}") from None
    except (_DeviceFault, drv.Error) as fault:
        backend._lose(fault)
        raise BackendError(f"the forward of {problem.label()} faulted: {fault}") from None
    state = BackwardState(problem, buffers, reference, forward, forward_ms)
    backend._backward_state = state
    return state


def _identity(problem: Problem) -> tuple[int, ...]:
    """What seeds a problem's inputs: the forward backend's identity, so a backward problem
    sees its forward's q, k and v (dO comes after them)."""
    identity = (problem.batch, problem.heads, problem.seq_len, problem.head_dim)
    if not problem.self_attention:
        identity += (problem.kv_heads, problem.kv_len)
    return (*identity, int(problem.causal))


def _forward(
    backend: PyCudaBackend, drv: Any, problem: Problem, buffers: dict[str, Any]
) -> tuple[KernelPlan, Any]:
    """The best predicted forward plan that compiles without spills, bound to ``buffers``
    (its split scratch allocated here), as a callable that launches it."""
    from kernels.backends.pycuda_backend import _has_tensor_maps

    device = backend.device_profile()
    space = candidate_space(problem, device)
    ranked = sorted(space.feasible, key=lambda plan: predict_time_ms(plan, device))
    reasons = []
    for plan in ranked[:FORWARD_TRIES]:
        compiled = build.compile_kernel(plan, backend.cache_dir, arch=device.arch)
        if isinstance(compiled, build.CompileFailure):
            reasons.append(f"{plan.key()}: {compiled.reason}")
            continue
        judged = plan.with_resources(compiled.primary_resources, device)
        if not judged.feasible:
            reasons.append(f"{plan.key()}: {judged.reason}")
            continue
        elements = judged.kernel_family.buffer_elements(judged)
        scratch = {
            "partial_o": drv.mem_alloc(elements.partial_o_bytes) if elements.partial_o else None,
            "partial_ml": drv.mem_alloc(elements.partial_ml_bytes) if elements.partial_o else None,
        }
        buffers.update({f"forward_{role}": value for role, value in scratch.items()})
        addresses = DeviceBuffers(
            q=_address(buffers["q"]),
            k=_address(buffers["k"]),
            v=_address(buffers["v"]),
            out=_address(buffers["out"]),
            partial_o=_address(scratch["partial_o"]),
            partial_ml=_address(scratch["partial_ml"]),
            alibi_slopes=_address(buffers["alibi_slopes"]),
            sinks=_address(buffers["sinks"]),
            lse=_address(buffers["lse"]),
        )
        launches = judged.kernel_family.launches(judged, addresses)
        if _has_tensor_maps(launches):
            return judged, backend._driver_launcher(compiled, launches)
        return judged, functools.partial(
            backend._launch, drv, backend.functions(drv, compiled), launches
        )
    raise BackendError(
        f"no forward plan of {problem.label()} runs here (first: {reasons[0] if reasons else '-'})"
    )


def _allocate_scratch(drv: Any, state: BackwardState, plan: KernelPlan) -> dict[str, int]:
    """The plan's scratch, grown where an earlier candidate's was smaller; role -> address."""
    from kernels.backends.pycuda_backend import _LaunchRefused

    needed = plan.kernel_family.backward_scratch(plan).sizes()  # type: ignore[attr-defined]
    addresses = {}
    for role, nbytes in needed.items():
        if not nbytes:
            addresses[role] = 0
            continue
        if state.scratch_bytes.get(role, 0) < nbytes:
            state.scratch.pop(role, None)
            try:
                state.scratch[role] = drv.mem_alloc(nbytes)
            except drv.MemoryError as error:
                raise _LaunchRefused(f"backward scratch does not fit: {error}") from error
            state.scratch_bytes[role] = nbytes
        addresses[role] = int(state.scratch[role])
    return addresses


def measure(
    backend: PyCudaBackend, drv: Any, plan: KernelPlan, compiled: build.CompiledKernel
) -> Measurement:
    """One backward candidate: poisoned run, check, then timing (``_LaunchRefused`` and
    ``_DeviceFault`` propagate to the backend's handlers)."""
    from kernels.backends.pycuda_backend import _DeviceFault

    problem = plan.problem
    state = prepare(backend, drv, problem)
    scratch = _allocate_scratch(drv, state, plan)
    roles = {role: _address(value) for role, value in state.buffers.items()}
    buffers = BackwardBuffers(
        **{
            name: roles.get(name, scratch.get(name, 0))
            for name in (f.name for f in dataclasses.fields(BackwardBuffers))
        }
    )
    launches = plan.kernel_family.launches(plan, buffers)
    functions = backend.functions(drv, compiled)

    def run() -> None:
        backend._launch(drv, functions, launches)

    storage = precision.storage_type(problem.dtype)
    nan16 = precision.NAN_PATTERN[problem.dtype]
    try:
        for role in ("dq", "dk", "dv"):
            count = _elements(problem, role)
            if problem.dtype == "float32":
                drv.memset_d32(state.buffers[role], NAN_BITS, count)
            else:
                drv.memset_d16(state.buffers[role], nan16, count)
        if problem.sinks:
            drv.memset_d32(state.buffers["d_sinks"], NAN_BITS, problem.heads)
        for role, allocation in state.scratch.items():
            poison = COUNTER_POISON if role == "counters" else NAN_BITS
            drv.memset_d32(allocation, poison, state.scratch_bytes[role] // 4)
        run()
        drv.Context.synchronize()
        outputs = {}
        for role in ("dq", "dk", "dv"):
            host = np.empty(_elements(problem, role), dtype=storage)
            drv.memcpy_dtoh(host, state.buffers[role])
            outputs[role] = precision.from_storage(host, problem.dtype)
        if problem.sinks:
            host = np.empty(problem.heads, dtype=np.float32)
            drv.memcpy_dtoh(host, state.buffers["d_sinks"])
            outputs["d_sinks"] = host
    except drv.Error as error:
        raise _DeviceFault(str(error)) from error
    parity = state.reference.check(outputs)
    if not parity.ok:
        return Measurement(
            measured=True,
            max_abs_error=parity.max_abs_error,
            failure=Failure.WRONG_ANSWER,
            detail=parity.detail,
            forward_ms=state.forward_ms,
        )
    stats = backend._time(drv, run)
    tflops, gbps = throughput(problem, plan, stats.median_ms)
    return Measurement(
        measured=True,
        median_ms=stats.median_ms,
        spread_ms=stats.spread_ms,
        repetitions=len(stats.samples_ms),
        max_abs_error=parity.max_abs_error,
        tflops=tflops,
        gbps=gbps,
        detail=f"{parity.detail}; forward {state.forward_plan.key()} {state.forward_ms:.4f} ms",
        samples_ms=stats.samples_ms,
        forward_ms=state.forward_ms,
    )


def _elements(problem: Problem, role: str) -> int:
    if role == "dq":
        return problem.batch_heads * problem.seq_len * problem.head_dim
    return problem.batch_kv_heads * problem.kv_len * problem.head_dim
