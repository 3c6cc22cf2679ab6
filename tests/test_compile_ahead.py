"""tuner.precompile.CompileAhead: compiling only what the search is about to measure.

With a stand-in compiler (``kernels.build.compile_kernel`` replaced) for the search's
bookkeeping, and with nvcc itself where it is installed.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from worker_backends import SlowFactory

from kernels import build
from kernels.backends.replay import ReplayBackend, load_recordings
from tuner.config import SearchConfig
from tuner.costmodel import predict
from tuner.device import H200
from tuner.planner import SpaceAxes, candidate_space
from tuner.planner.plan import ResourceUsage
from tuner.precompile import CompileAhead, precompile
from tuner.problem import Problem
from tuner.recorded_space import within_recording
from tuner.search import COMPILED_OUT, run_search
from tuner.study_space import StudySpace

ROOT = Path(__file__).resolve().parent.parent
GRID = ROOT / "bench" / "data" / "h200_mma_f16_wgmma_f16_4x16x4096x128_bf16.json"


class StandInCompiler:
    """``compile_kernel`` that spills on the variants in ``spill`` and counts its calls."""

    def __init__(self, spill: set[str]) -> None:
        self.spill = spill
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, spec: build.KernelSpec, cache_dir: str, arch: str) -> build.CompileResult:
        with self.lock:
            self.calls.append(spec.key)
        if spec.key in self.spill:
            return build.CompileFailure(spec, "ptxas error: too many resources")
        usage = ResourceUsage(registers=64)
        return build.CompiledKernel(
            spec=spec,
            cubin_path=Path(cache_dir) / f"{spec.key}.cubin",
            cubin=b"",
            resources={name: usage for name in build.entry_functions(spec.family)},
            source_hash="",
            arch=arch,
            nvcc_version="stand-in",
        )


def model_space(problem: Problem) -> tuple[StudySpace, dict]:
    planned = candidate_space(problem, H200, SpaceAxes())
    predictions = {p.key(): predict(p, H200) for p in planned.feasible}
    space = StudySpace(problem, H200, planned.feasible, planned.rejected, encoding="candidate")
    return space, predictions


def test_judged_waits_for_the_variant_and_rules_out_what_the_compiler_rejects(
    tmp_path, monkeypatch
):
    space, _ = model_space(Problem(512, 64))
    good, bad = space.feasible[0], space.feasible[-1]
    bad_key = build.KernelSpec.from_plan(bad).key
    assert build.KernelSpec.from_plan(good).key != bad_key
    compiler = StandInCompiler({bad_key})
    monkeypatch.setattr(build, "compile_kernel", compiler)
    ahead = CompileAhead(H200, str(tmp_path), jobs=2)
    try:
        ahead.request([good, good, bad])
        assert ahead.judged(good).feasible
        judged = ahead.judged(bad)
        assert not judged.feasible and judged.reason.startswith("nvcc rejects it: ptxas error")
        assert sorted(compiler.calls) == sorted({build.KernelSpec.from_plan(good).key, bad_key})
        assert ahead.variants == (2, 0)
    finally:
        ahead.close()


def test_the_search_compiles_a_window_ahead_and_skips_a_rejected_plan_for_free(
    tmp_path, monkeypatch
):
    space, predictions = model_space(Problem(512, 64))
    ranked = sorted(space.feasible, key=lambda p: predictions[p.key()].time_ms)
    # The model's second-best plan spills: it is never measured, and costs no trial.
    spilled = ranked[1]
    spill_key = build.KernelSpec.from_plan(spilled).key
    compiler = StandInCompiler({spill_key})
    monkeypatch.setattr(build, "compile_kernel", compiler)
    measured: list[str] = []
    backend = SlowFactory(0.0, str(tmp_path / "log"))()
    original = backend.measure

    def measure(plan, problem):  # type: ignore[no-untyped-def]
        measured.append(plan.key())
        return original(plan, problem)

    backend.measure = measure  # type: ignore[method-assign]
    ahead = CompileAhead(H200, str(tmp_path), jobs=2, window=4)
    try:
        result = run_search(
            space,
            backend,
            SearchConfig(n_trials=12, traffic_cutoff=1e9),
            storage=f"sqlite:///{tmp_path / 's.sqlite'}",
            study_name="ahead",
            predictions=predictions,
            compile_ahead=ahead,
        )
    finally:
        ahead.close()
    with_spill = {p.key() for p in space.feasible if build.KernelSpec.from_plan(p).key == spill_key}
    assert not with_spill & set(measured)
    rejected = [t for t in result.trials if t.failure == COMPILED_OUT]
    assert rejected and all(t.outcome == "infeasible" and not t.counted for t in rejected)
    assert spilled.key() in {t.key for t in rejected}
    # Only what the search reached (and the window ahead of it) was compiled.
    variants = {build.KernelSpec.from_plan(p).key for p in space.feasible}
    asked, _ = ahead.variants
    assert len(set(compiler.calls)) == asked < len(variants)
    assert {build.KernelSpec.from_plan(space.by_key[k]).key for k in measured} <= set(
        compiler.calls
    )


needs_nvcc = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not found")


@needs_nvcc
def test_a_replayed_default_search_compiles_a_fraction_of_the_space(tmp_path):
    """nvcc for real: the recorded H200 grid's default search with compile-ahead compiles
    the variants it measures and a window more, not the space's 108 (about 20 s here)."""
    recording = load_recordings(GRID)[0]
    planned = candidate_space(recording.problem, H200, SpaceAxes())
    feasible, _ = within_recording(list(planned.feasible), recording)
    predictions = {p.key(): predict(p, H200) for p in feasible}
    space = StudySpace(recording.problem, H200, feasible, (), encoding="candidate")
    ahead = CompileAhead(H200, str(tmp_path / "cubins"), jobs=2, window=2)
    try:
        result = run_search(
            space,
            ReplayBackend(GRID),
            SearchConfig(),
            storage=f"sqlite:///{tmp_path / 's.sqlite'}",
            study_name="replayed",
            predictions=predictions,
            compile_ahead=ahead,
        )
    finally:
        ahead.close()
    variants = {build.KernelSpec.from_plan(p).key for p in feasible}
    asked, cached = ahead.variants
    measured = {
        build.KernelSpec.from_plan(space.by_key[t.key]).key for t in result.trials if t.counted
    }
    assert result.stopped_by_rule is not None and cached == 0
    assert len(measured) <= asked < len(variants) / 3
    # Everything measured was compiled by then, and the cache holds it for the backend.
    accepted, _ = precompile(
        [space.by_key[t.key] for t in result.trials if t.counted], H200, str(tmp_path / "cubins")
    )
    assert accepted
