"""``python -m db verify``: re-measure the stored plans on this GPU, take the bad ones out.

After a driver, CUDA or GPU change a stored plan may have become slower, or wrong.
``verify`` re-measures every measured plan served for this GPU model (its parity
and median time, the tuner's own measurement: ``measure`` is a backend as
``python -m tuner`` builds it), and reports each plan's drift, the time now over
the time stored. A plan that fails (wrong answer, no longer compiles or launches)
or has become slower than ``threshold`` x its stored time is disabled in the
registry with the reason (``PlanRegistry.disable``, migration 0007): it is no
longer served, and the next best plan of its problem is, which is verified in
turn. The backend is injected, so the logic is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from db.records import StoredPlan
from db.registry import PlanRegistry
from kernels.backends.base import Backend
from tuner.device import DeviceProfile
from tuner.environment import Environment
from tuner.planner.errors import PlanError
from tuner.planner.params import KernelParams
from tuner.planner.tunable import KernelPlan, plan_kernel

#: a plan this many times slower than its stored time is disabled (``--threshold``)
DEFAULT_THRESHOLD = 1.25

#: the plan of a stored row on this GPU, judged as a tune run judges it (compiler included)
Prepare = Callable[[KernelPlan], "KernelPlan | str"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What verifying one stored plan found."""

    stored: StoredPlan
    key: str
    now_ms: float | None  # the median measured now; None when it failed
    failure: str  # "" when it measured and passed parity
    disabled: str  # the reason it was disabled; "" when it is still served

    @property
    def stored_ms(self) -> float:
        return self.stored.record.ranking_ms

    @property
    def drift(self) -> float | None:
        return None if self.now_ms is None else self.now_ms / self.stored_ms

    @property
    def ok(self) -> bool:
        return not self.disabled


def same_gpu_model(one: Environment, other: Environment) -> bool:
    return (one.gpu_name, one.compute_capability, one.sm_count) == (
        other.gpu_name,
        other.compute_capability,
        other.sm_count,
    )


def verify(
    registry: PlanRegistry,
    backend: Backend,
    device: DeviceProfile,
    environment: Environment,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    dtype: str | None = None,
    source_hashes: Mapping[str, str] | None = None,
    prepare: Prepare | None = None,
) -> list[Verdict]:
    """Verify the served measured plans of ``environment``'s GPU model (of ``dtype``, if
    given), disabling those that fail; returns one verdict per plan measured."""
    if not threshold > 1:
        raise ValueError(f"threshold {threshold} must be above 1")
    verdicts: list[Verdict] = []
    seen: set[int] = set()
    queue = _served(registry, environment, dtype, source_hashes)
    while queue:
        stored = queue.pop(0)
        if stored.plan_id in seen:
            continue
        seen.add(stored.plan_id)
        verdict = _verify_one(stored, backend, device, threshold, prepare)
        verdicts.append(verdict)
        if verdict.disabled:
            registry.disable(stored.plan_id, verdict.disabled, source_hashes=source_hashes)
            # What is served now for that problem is verified in turn.
            queue[:0] = [
                plan
                for plan in _served(registry, environment, dtype, source_hashes)
                if plan.problem == stored.problem and plan.plan_id not in seen
            ]
    return verdicts


def _served(
    registry: PlanRegistry,
    environment: Environment,
    dtype: str | None,
    source_hashes: Mapping[str, str] | None,
) -> list[StoredPlan]:
    return [
        stored
        for stored in registry.list_best(source_hashes=source_hashes)
        if same_gpu_model(stored.environment, environment)
        and stored.record.measured
        and (dtype is None or stored.problem.dtype == dtype)
    ]


def _verify_one(
    stored: StoredPlan,
    backend: Backend,
    device: DeviceProfile,
    threshold: float,
    prepare: Prepare | None,
) -> Verdict:
    record = stored.record
    try:
        params = KernelParams.from_stored(record.family, record.params)
    except PlanError as error:
        return _failed(stored, f"{record.family} {record.params}", f"not a plan: {error}")
    plan = plan_kernel(stored.problem, params, device)
    key = plan.key()
    if not plan.feasible:
        return _failed(stored, key, f"infeasible on {device.name}: {plan.reason}")
    if prepare is not None:
        prepared = prepare(plan)
        if isinstance(prepared, str):
            return _failed(stored, key, prepared)
        plan = prepared
    measurement = backend.measure(plan, stored.problem)
    if not measurement.ok:
        return _failed(stored, key, f"{measurement.failure}: {measurement.detail}")
    assert measurement.median_ms is not None
    drift = measurement.median_ms / record.ranking_ms
    if drift > threshold:
        reason = (
            f"db verify: {measurement.median_ms:.4g} ms now, {record.ranking_ms:.4g} ms stored: "
            f"{drift:.2f}x slower (threshold {threshold:g}x)"
        )
        return Verdict(stored, key, measurement.median_ms, "", reason)
    return Verdict(stored, key, measurement.median_ms, "", "")


def _failed(stored: StoredPlan, key: str, failure: str) -> Verdict:
    line = " ".join(failure.split())
    return Verdict(stored, key, None, line, f"db verify: {line}")


def table(verdicts: list[Verdict]) -> str:
    """The verdicts as the table ``python -m db verify`` prints at the end."""
    from tuner.report import format_table

    headers = ("plan", "problem", "kernel plan", "stored ms", "now ms", "drift", "verdict")
    rows = [
        [
            f"#{v.stored.plan_id}",
            v.stored.problem.label().replace(" ", "/"),
            v.key,
            f"{v.stored_ms:.4f}",
            "-" if v.now_ms is None else f"{v.now_ms:.4f}",
            "-" if v.drift is None else f"{v.drift:.2f}x",
            "ok" if v.ok else ("FAILED" if v.failure else "SLOWER") + ": disabled",
        ]
        for v in verdicts
    ]
    return format_table(headers, rows) if rows else "no measured plan of this GPU to verify"


@dataclass(frozen=True)
class Measuring:
    """What ``verify`` measures with: a backend, and where it runs."""

    backend: Backend
    device: DeviceProfile
    environment: Environment
    prepare: Prepare | None = None


def gpu_measuring() -> Measuring:
    """The tuner's own measurement on this machine's GPU, as ``python -m tuner`` builds it:
    PyCUDA in an isolated worker process with the default backend settings, each plan
    compiled first and judged by ptxas's report. ``BackendError`` (one line) without a GPU."""
    import importlib.util

    from kernels.backends import BackendFactory, detect_cuda
    from tuner.config import BackendConfig, DeviceConfig, SearchConfig, device_profile_from
    from tuner.errors import BackendError
    from tuner.isolation import IsolatedBackend
    from tuner.precompile import precompile

    if importlib.util.find_spec("pycuda") is None:
        raise BackendError(
            "db verify re-measures plans on a GPU: pycuda is not installed "
            "(pip install 'flash-attention-tuner[cuda]')"
        )
    missing = detect_cuda()
    if missing is not None:
        raise BackendError(
            f"db verify re-measures plans on a GPU: no CUDA device answers ({missing})"
        )
    config = BackendConfig(name="pycuda")
    configured = device_profile_from(DeviceConfig())
    factory = BackendFactory("pycuda", config, device=configured)
    backend = IsolatedBackend(factory, SearchConfig().trial_timeout_s, name="pycuda")
    try:
        device = backend.device_profile() or configured
        environment = Environment(**backend.environment())  # type: ignore[arg-type]
    except BaseException:
        backend.close()
        raise

    def prepare(plan: KernelPlan) -> KernelPlan | str:
        accepted, rejected = precompile([plan], device, config.cache_dir, config.compile_jobs)
        return accepted[0] if accepted else rejected[0].reason

    return Measuring(backend, device, environment, prepare)
