"""Which kernel plan a shape runs with at deploy time, chosen once per shape and GPU.

``PlanChooser.plan_for(problem)`` asks the registry once per problem (shape, causal, dtype,
direction: a backward problem gets a backward plan) with the live GPU's ``Environment`` and
the current kernel source hashes. A stale (source changed) or
predicted-only plan is used with a warning, a plan tuned on the same GPU model under another
toolchain too; a plan from another GPU is not used, nor one tuned without a GPU (filed
under the GPU name "model": cost-model predictions), nor one stored for another dtype or of a
family that does not take the problem's dtype. Without one, the planner's default plan (among
the families that take the dtype, the feasible candidate with the lowest predicted time on the
live device that passes ``check``) is used as a fallback, marked ``origin="default"``, with a
warning that says so; so is a registry that was asked for but could not be opened (a missing
file, a server that does not answer: ``registry_unavailable`` says why). Warnings go to the
``kernels.attention`` logger, once per shape (and dtype).

Problems that differ only in ``kv_len`` (the KV buckets of one layer's decode steps,
``kernels.kv_buckets.length_family``) share kernels: a problem with no registry plan whose
family has a plan chosen at half or twice its ``kv_len`` (the bucket a growing cache has just
left) keeps that plan's kernel (no compile, no full candidate space) and takes the split
partition the cost model ranks best among that kernel's launch choices at its length
(``tuner.planner.kernel_variant.launch_choices``: a handful of plans, about a millisecond),
falling back to the whole space when there is no such neighbour or none of its choices is
feasible. A kernel chosen for 64 keys is not kept for 4096: only a neighbour's is.

Pure apart from the injected ``check`` (on a GPU: compile and judge the compiler's resources)
and the registry handle, so it is tested without a GPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernels import build
from kernels.kv_buckets import length_family
from tuner.costmodel import predict_time_ms
from tuner.data_dir import default_registry_file
from tuner.device import DeviceProfile
from tuner.environment import Environment
from tuner.errors import BackendError
from tuner.planner.errors import PlanError
from tuner.planner.families import families_for, family_named, family_names
from tuner.planner.kernel_variant import launch_choices
from tuner.planner.space import candidate_space
from tuner.planner.tunable import KernelParams, KernelPlan, plan_kernel
from tuner.problem import Problem

if TYPE_CHECKING:
    from db import StoredPlan

#: the deploy helper's logger: its users filter on this name, whichever module logs
logger = logging.getLogger("kernels.attention")

#: default-plan candidates tried (best prediction first) before giving up on a shape
DEFAULT_PLAN_TRIES = 16


@dataclass(frozen=True, slots=True)
class ChosenPlan:
    plan: KernelPlan
    origin: str  # "registry" (a stored plan) or "default" (the planner's best prediction)
    stored: StoredPlan | None = None
    warnings: tuple[str, ...] = ()


PlanCheck = Callable[[KernelPlan], "KernelPlan | str"]


def current_source_hashes() -> dict[str, str]:
    return {family: build.source_hash(family) for family in build.sources()}


def _kind(problem: Problem) -> tuple[object, ...]:
    """What a stored plan must share with the problem it serves, whatever the shape."""
    p = problem
    return (
        p.dtype, p.precision, p.direction, p.window_left, p.window_right, p.softcap, p.alibi,
        p.sinks,
    )


def _same_gpu(one: Environment, other: Environment) -> bool:
    return (one.gpu_name, one.compute_capability, one.sm_count) == (
        other.gpu_name,
        other.compute_capability,
        other.sm_count,
    )


def _gpu_model(environment: Environment) -> tuple[tuple[str, str | int], ...]:
    """The GPU model's fields of ``environment``, as a partial match for the registry."""
    return (
        ("gpu_name", environment.gpu_name),
        ("compute_capability", environment.compute_capability),
        ("sm_count", environment.sm_count),
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
        registry_unavailable: str = "",
    ) -> None:
        self.registry = registry
        self.environment = environment
        self.device = device
        hashes = current_source_hashes() if source_hashes is None else source_hashes
        self.source_hashes = dict(hashes)
        self.nearest = nearest
        self._check: PlanCheck = check or (lambda plan: plan)
        self._label = registry_label or str(getattr(registry, "url", "")) or "(unnamed)"
        #: why the registry asked for could not be opened (then ``registry`` is None)
        self.registry_unavailable = registry_unavailable
        self._plans: dict[Problem, ChosenPlan] = {}
        #: the plans chosen in each length family (problems differing only in kv_len), by kv_len
        self._families: dict[tuple[object, ...], dict[int, ChosenPlan]] = {}
        self._lock = threading.Lock()

    def plan_for(self, problem: Problem) -> ChosenPlan:
        chosen = self._plans.get(problem)
        if chosen is None:
            with self._lock:  # one thread chooses (and compiles); the others wait for it
                chosen = self._plans.get(problem)
                if chosen is None:
                    chosen = self._plans[problem] = self._choose(problem)
                    family = self._families.setdefault(length_family(problem), {})
                    family[problem.kv_len] = chosen
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
        sibling = self._neighbour(problem)
        plan = self._same_kernel_default(problem, sibling) if sibling else None
        if plan is not None and sibling is not None:
            how = (
                f"the kernel of {sibling.plan.key()} (chosen for {sibling.plan.problem.label()}) "
                f"with the cost model's best split partition at kv_len={problem.kv_len}"
            )
        else:
            plan = self._default(problem)
            how = f"the cost model's best for {problem.dtype}"
        note = (
            f"{why}; falling back to the planner's default plan {plan.key()}, {how} (predicted "
            f"{predict_time_ms(plan, self.device):.3f} ms on {self.device.name})"
        )
        logger.warning(note)
        return ChosenPlan(plan, "default", None, (note,))

    def _lookup(self, problem: Problem) -> tuple[StoredPlan | None, str]:
        label = problem.label()
        if self.registry is None and self.registry_unavailable:
            return None, f"plan registry unavailable ({self.registry_unavailable})"
        if self.registry is None:
            return None, f"no plan registry (none given, no {default_registry_file()})"
        ask = {"nearest": self.nearest, "source_hashes": self.source_hashes}
        found = self.registry.cached_best(problem, self.environment, **ask)
        if found is not None and found.disabled_reason:
            # The registry never serves a disabled plan; a handle that did is not trusted.
            return None, f"registry {self._label} answered {label} with a disabled plan"
        if found is not None:
            return self._of_dtype(problem, found)
        # Plans of the same GPU model under another driver/nvcc/pycuda are still good plans.
        # Asked by the GPU's name too: a plan of another GPU, or one tuned without a GPU
        # (gpu_name "model", cost-model predictions), must never shadow them.
        same_gpu = self.registry.cached_best(problem, _gpu_model(self.environment), **ask)
        if same_gpu is not None:
            same_gpu, why = self._of_dtype(problem, same_gpu)
            if same_gpu is None:
                return None, why
            if _same_gpu(same_gpu.environment, self.environment):
                return same_gpu, ""
        anywhere = self.registry.cached_best(problem, None, **ask)
        if anywhere is None:
            return None, f"no plan for {label} in registry {self._label}"
        other = anywhere.environment
        return None, (
            f"registry {self._label} holds a plan for {label} only for another GPU "
            f"({other.gpu_name}, {other.sm_count} SMs), not this {self.environment.gpu_name}"
        )

    def _of_dtype(self, problem: Problem, stored: StoredPlan) -> tuple[StoredPlan | None, str]:
        """``stored`` if it was stored for ``problem``'s dtype, precision, direction and
        variants; a plan is never served across them (the registry asks by all of them
        already: this guards against a handle that does not; re-planning then refuses
        one-pass TF32 for a tf32x3 problem too)."""
        if _kind(stored.problem) == _kind(problem):
            return stored, ""
        stored_for = stored.problem.dtype_label
        variants = stored.problem.variant_text()
        if variants:
            stored_for += f" {variants}"
        if stored.problem.direction != problem.direction:
            stored_for += f" {stored.problem.direction}"
        return None, (
            f"registry {self._label} answered {problem.label()} with a plan stored for "
            f"{stored_for}; not used"
        )

    def _replan(self, problem: Problem, stored: StoredPlan) -> KernelPlan | str:
        record = stored.record
        if record.family not in family_names():
            return f"{record.family} {record.params} is not a kernel this version knows"
        family = family_named(record.family)
        if problem.dtype not in family.dtypes:
            takes = ", ".join(family.dtypes)
            return f"{record.family} kernels take {takes}, not {problem.dtype}"
        if reason := family.direction_verdict(problem):
            return reason
        # a tunable added since the row was written: fine where it says what such rows
        # ran with (Tunable.stored_before), an incomplete plan otherwise
        missing = [
            tunable.name
            for tunable in family_named(record.family).tunables
            if tunable.name not in record.params and tunable.stored_before is None
        ]
        if missing:
            return f"{record.family} {record.params} lacks tunables {', '.join(missing)}"
        try:
            params = KernelParams.from_stored(record.family, record.params)
        except PlanError as error:
            return str(error)
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

    def _neighbour(self, problem: Problem) -> ChosenPlan | None:
        """The plan chosen for ``problem`` at half or twice its ``kv_len``, if any."""
        family = self._families.get(length_family(problem), {})
        return family.get(problem.kv_len // 2) or family.get(problem.kv_len * 2)

    def _same_kernel_default(self, problem: Problem, sibling: ChosenPlan) -> KernelPlan | None:
        """The best-predicted plan of ``problem`` launching ``sibling``'s kernel that passes
        ``check`` (a compile cache hit), or None."""
        choices = launch_choices(problem, sibling.plan, self.device)
        for plan in sorted(choices, key=lambda plan: predict_time_ms(plan, self.device)):
            checked = self._check(plan)
            if isinstance(checked, KernelPlan):
                return checked
        return None

    def best_default(
        self, problem: Problem, accept: Callable[[KernelPlan], bool]
    ) -> KernelPlan | None:
        """The best-predicted planned plan of ``problem`` that ``accept`` takes and that
        passes ``check`` (among the ``DEFAULT_PLAN_TRIES`` best it takes), or None."""
        space = candidate_space(problem, self.device)
        taken = sorted(
            (plan for plan in space.feasible if accept(plan)),
            key=lambda plan: predict_time_ms(plan, self.device),
        )
        for plan in taken[:DEFAULT_PLAN_TRIES]:
            checked = self._check(plan)
            if isinstance(checked, KernelPlan):
                return checked
        return None

    def _default(self, problem: Problem) -> KernelPlan:
        label, space = problem.label(), candidate_space(problem, self.device)
        if not families_for(problem.dtype, problem.direction):
            backward = " in the backward direction" if problem.backward else ""
            raise BackendError(
                f"no registered kernel family takes {problem.dtype}{backward} ({label})"
            )
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
