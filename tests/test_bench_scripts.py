"""bench/evidence.py and bench/plot_evidence.py without a GPU: arguments, the tuning step
through the real CLI on recorded timings, result assembly, the budget, and the plot."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import evidence  # noqa: E402
import plot_evidence  # noqa: E402

from tuner.problem import Problem  # noqa: E402

RECORDING = BENCH / "data" / "h200_1x8x2048x128_1x4x1024x64.json"


# ---------------------------------------------------------------- arguments and the command


def test_defaults_are_the_five_shapes_and_the_projects_own_search_settings(tmp_path):
    args = evidence.parse_args(["--out", str(tmp_path / "e.json")])
    assert [evidence.shape_name(p) for p in args.shapes] == list(evidence.SHAPES)
    assert set(evidence.SHAPES) == {
        "1x1x4096x128",
        "1x1x16384x128",
        "4x16x4096x128",
        "1x32x8192x128",
        "4x16x4096x128-causal",
    }
    assert args.n_trials is None and args.override == [] and not args.no_measure
    command = evidence.tune_command(args.shapes[0], tmp_path, tmp_path / "cubins")
    # Nothing about the search is overridden: only the shape and where things are written.
    assert not any(part.startswith(("search.n_trials", "search.sampler")) for part in command)
    assert command[1:3] == ["-m", "tuner"]
    assert f"registry.url=sqlite:///{tmp_path / 'plans.sqlite'}" in command
    assert f"search.storage=sqlite:///{tmp_path / 'studies.sqlite'}" in command
    assert f"hydra.run.dir={tmp_path / 'run-1x1x4096x128'}" in command
    assert f"backend.cache_dir={tmp_path / 'cubins'}" in command


def test_shape_names_parse_both_ways_and_bad_ones_are_refused(tmp_path, capsys):
    causal = evidence.parse_shape("4x16x4096x128-causal")
    assert causal == Problem(4096, 128, batch=4, heads=16, causal=True)
    assert evidence.shape_name(causal) == "4x16x4096x128-causal"
    args = evidence.parse_args(
        ["--out", "x.json", "--shapes", "1x1x4096x128", "2x3x64x32-causal", "--n-trials", "7"]
    )
    assert args.shapes == [Problem(4096, 128), Problem(64, 32, batch=2, heads=3, causal=True)]
    command = evidence.tune_command(args.shapes[1], tmp_path, tmp_path / "c", 7, ["a=b"])
    assert "causal=true" in command and "search.n_trials=7" in command
    assert command[-1] == "a=b"
    for bad in (["--shapes", "4096x128"], ["--n-trials", "0"]):
        with pytest.raises(SystemExit):
            evidence.parse_args(["--out", "x.json", *bad])
    capsys.readouterr()


# ---------------------------------------------------------------- assembling the figures


def synthetic_gpu(tuned: float, repeat: float, math_ms: float, efficient: float) -> dict:
    def timing(ms: float) -> dict:
        return {"ok": True, "median_ms": ms, "spread_ms": ms / 100, "samples_ms": [ms]}

    return {
        "tuned": timing(tuned),
        "tuned_repeat": timing(repeat),
        "torch": {"math": {"median_ms": math_ms}, "efficient": {"median_ms": efficient}},
        "tuned_vs_torch_efficient_max_abs": 4e-7,
    }


def test_ratios_use_the_slower_run_of_the_plan_and_torchs_fastest_backend():
    problem = Problem(4096, 128)
    numbers = evidence.figures(problem, synthetic_gpu(0.25, 0.26, 0.46, 0.40))
    assert numbers["tuned_ms"] == 0.26
    assert numbers["torch_best"] == {"backend": "efficient", "ms": 0.40}
    assert numbers["ratios"]["torch_best_over_tuned"] == pytest.approx(0.40 / 0.26)
    assert numbers["ratios"]["torch_math_over_tuned"] == pytest.approx(0.46 / 0.26)
    assert numbers["tuned_tflops"] == pytest.approx(4 * 4096**2 * 128 / 0.26e-3 / 1e12)
    # A failed repeat does not count; a missing torch leaves no ratio, and no crash.
    gpu = synthetic_gpu(0.25, 0.26, 0.46, 0.40)
    gpu["tuned_repeat"] = {"ok": False, "median_ms": None}
    del gpu["torch"]
    numbers = evidence.figures(problem, gpu)
    assert numbers["tuned_ms"] == 0.25 and "ratios" in numbers
    assert numbers["ratios"] == {} and "torch_best" not in numbers
    assert evidence.figures(problem, {}) == {"tuned_ms": None, "torch_ms": {}}


def verdicts(name: str, problem: Problem, gpu: dict, tuning: dict | None = None) -> dict:
    numbers = evidence.figures(problem, gpu)
    return {v.target: v.as_json() for v in evidence.judge(name, problem, tuning, numbers, gpu)}


def test_each_target_passes_or_misses_on_its_own_figure():
    small = Problem(4096, 128)
    cold = {"cache_cold": True, "wall_s": 71.0, "returncode": 0, "on_gpu": True}
    judged = verdicts("1x1x4096x128", small, synthetic_gpu(0.25, 0.25, 0.46, 0.40), cold)
    assert judged["faster than torch's fastest fp32 SDPA"]["result"] == "pass"
    assert judged[">= 1.5x torch's fastest"] == {
        "target": ">= 1.5x torch's fastest",
        "value": pytest.approx(1.6),
        "result": "pass",
    }
    assert judged["tuning with compilation < 90 s"]["result"] == "pass"
    assert judged["parity with torch efficient <= 0.001"]["result"] == "pass"
    assert ">= 33 TFLOP/s (batched)" not in judged  # one head is not a batched shape

    judged = verdicts(
        "1x1x4096x128", small, synthetic_gpu(0.30, 0.30, 0.46, 0.40), cold | {"wall_s": 95.0}
    )
    assert judged[">= 1.5x torch's fastest"]["result"] == "miss"
    assert judged["faster than torch's fastest fp32 SDPA"]["result"] == "pass"
    assert judged["tuning with compilation < 90 s"]["result"] == "miss"
    # A warm cache says nothing about "with compilation": not judged.
    warm = verdicts("1x1x4096x128", small, synthetic_gpu(0.3, 0.3, 0.4, 0.4), {"cache_cold": False})
    assert "tuning with compilation < 90 s" not in warm

    batched = Problem(4096, 128, batch=4, heads=16)
    judged = verdicts("4x16x4096x128", batched, synthetic_gpu(16.7, 16.6, 20.1, 11.9))
    assert judged["faster than torch's fastest fp32 SDPA"]["result"] == "miss"
    assert judged[">= 33 TFLOP/s (batched)"]["value"] == pytest.approx(32.9, abs=0.1)
    assert judged[">= 33 TFLOP/s (batched)"]["result"] == "miss"
    assert ">= 1.5x torch's fastest" not in judged

    bad = synthetic_gpu(0.25, 0.25, 0.46, 0.40) | {"tuned_vs_torch_efficient_max_abs": 2e-3}
    judged = verdicts("1x1x4096x128", small, bad)
    assert judged["parity with torch efficient <= 0.001"]["result"] == "miss"
    # Nothing measured: every timing target is an error, never a pass.
    judged = verdicts("1x1x4096x128", small, {})
    assert {v["result"] for v in judged.values()} == {"error"}


def test_the_overall_table_and_the_summary_cover_skipped_and_failed_shapes():
    problem = Problem(4096, 128)
    good = {
        "shape": "1x1x4096x128",
        "tuning": {"wall_s": 70.2, "interrupted_at_budget": False},
        "search": {"counted": 40},
        "best_plan": {"family": "tiled", "params": {"tile_size": 64, "rows_per_block": 128}},
        "gpu": synthetic_gpu(0.25, 0.25, 0.46, 0.40),
        "errors": [],
    }
    good["figures"] = evidence.figures(problem, good["gpu"])
    good["targets"] = [
        v.as_json()
        for v in evidence.judge("1x1x4096x128", problem, None, good["figures"], good["gpu"])
    ]
    failed = {
        "shape": "1x32x8192x128",
        "tuning": {"wall_s": 200.0, "interrupted_at_budget": True},
        "errors": ["gpu: BackendError: no CUDA device answers"],
        "figures": {},
        "targets": [{"target": "faster than torch's fastest fp32 SDPA", "result": "error"}],
    }
    skipped = {"shape": "1x1x16384x128", "skipped": "budget: 3 s left", "targets": []}
    report = {"shapes": [good, failed, skipped]}
    report["targets"] = evidence.overall(report["shapes"])
    assert report["targets"]["faster than torch's fastest fp32 SDPA"] == {
        "1x1x4096x128": "pass",
        "1x32x8192x128": "error",
    }
    text = evidence.format_summary(report)
    assert "0.2500" in text and "1.60" in text and "skipped" in text
    assert "200.0*" in text and "interrupted at the budget" in text
    assert "error 1x32x8192x128: gpu: BackendError" in text


# ---------------------------------------------------------------- the budget and the subprocess


def test_a_tuning_run_past_its_time_gets_sigint_then_sigkill(tmp_path, monkeypatch):
    # Python turns SIGINT into KeyboardInterrupt: the run ends at once, like the tuner's Ctrl-C.
    sleeper = [sys.executable, "-c", "import time; print('backend: pycuda (x)'); time.sleep(60)"]
    began = time.monotonic()
    result = evidence.run_tuning(sleeper, tmp_path / "a.log", timeout_s=1.0, cwd=tmp_path)
    assert result["interrupted_at_budget"] and not result["killed"]
    assert result["returncode"] != 0 and result["on_gpu"]
    assert time.monotonic() - began < 30
    # One that ignores SIGINT is killed after the grace period.
    monkeypatch.setattr(evidence, "INTERRUPT_GRACE_S", 1.0)
    stubborn = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)",
    ]
    result = evidence.run_tuning(stubborn, tmp_path / "b.log", timeout_s=1.0, cwd=tmp_path)
    assert result["killed"] and result["returncode"] < 0 and not result["on_gpu"]


def test_a_shape_that_no_longer_fits_the_budget_is_recorded_as_skipped(tmp_path):
    run = evidence.Run(
        work_dir=tmp_path,
        cache_dir=tmp_path / "cubins",
        n_trials=None,
        overrides=[],
        repetitions=3,
        warmup=1,
        measure=True,
        deadline=time.monotonic() + 5,
    )
    shape = evidence.evidence_for(Problem(4096, 128), run)
    assert shape["skipped"].startswith("budget:") and shape["targets"] == []


@pytest.mark.skipif(not RECORDING.exists(), reason="no H200 recording in bench/data")
def test_tune_read_back_and_a_failing_gpu_step_on_recorded_timings(tmp_path, monkeypatch):
    """The real CLI tunes (replay backend), the plan and the study are read back, and a
    GPU step that fails is recorded while the report is still written."""

    def no_gpu(*args: object, **kwargs: object) -> dict:
        raise RuntimeError("no CUDA device here")

    monkeypatch.setattr(evidence, "measure_on_gpu", no_gpu)
    out = tmp_path / "evidence.json"
    argv = [
        "--out",
        str(out),
        "--shapes",
        "1x4x1024x64",
        "1x1x4096x128",  # not in this recording: the tuner fails, the script goes on
        "--n-trials",
        "6",
        "--work-dir",
        str(tmp_path / "work"),
        "--override",
        "backend=replay",
        "--override",
        f"backend.replay_path={RECORDING}",
    ]
    assert evidence.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python bench/evidence.py --out")
    first, second = report["shapes"]

    tuning = first["tuning"]
    assert tuning["returncode"] == 0 and tuning["cache_cold"] and not tuning["on_gpu"]
    assert tuning["wall_s"] > 0 and "search.n_trials=6" in tuning["command"]
    assert first["best_plan"]["family"] in ("tiled", "scalar_online")
    assert first["best_plan"]["key"].startswith(first["best_plan"]["family"] + "/")
    # GPU timings, but replayed: stored as predicted, not as measured on this machine
    assert not first["best_plan"]["measured"]
    search = first["search"]
    assert search["counted"] == 6 and 1 <= search["within_5pct_of_its_best_at"] <= 6
    assert search["best_ms"] == pytest.approx(first["best_plan"]["median_ms"])
    assert first["errors"] == ["gpu: RuntimeError: no CUDA device here"]
    assert {t["result"] for t in first["targets"]} == {"error"}

    assert second["tuning"]["returncode"] == 1
    assert any("registry: no plan stored" in e for e in second["errors"])
    assert set(report["targets"]["faster than torch's fastest fp32 SDPA"]) == {
        "1x4x1024x64",
        "1x1x4096x128",
    }


# ---------------------------------------------------------------- the plot


def test_plot_evidence_draws_every_shape_from_synthetic_json(tmp_path):
    pytest.importorskip("matplotlib")
    shapes = []
    for name, gpu in (
        ("1x1x4096x128", synthetic_gpu(0.25, 0.25, 0.46, 0.40)),
        ("4x16x4096x128", synthetic_gpu(16.7, 16.7, 20.1, 11.9)),
        ("1x32x8192x128", {}),
    ):
        problem = evidence.parse_shape(name)
        shapes.append({"shape": name, "figures": evidence.figures(problem, gpu)})
    shapes.append({"shape": "1x1x16384x128", "skipped": "budget"})
    report = {"date": "2026-12-02T18:00:00+00:00", "nvidia_smi": {"gpu": "H200"}, "shapes": shapes}
    source = tmp_path / "evidence.json"
    source.write_text(json.dumps(report))
    out = tmp_path / "plots" / "evidence.png"
    assert plot_evidence.main([str(source), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    values = plot_evidence.bar_values(shapes[0])
    assert values == {"tuned": 0.25, "math": 0.46, "efficient": 0.40}
    assert plot_evidence.bar_values(shapes[3]) == {"tuned": None, "math": None, "efficient": None}
    assert math.isclose(shapes[1]["figures"]["ratios"]["torch_best_over_tuned"], 11.9 / 16.7)
    with pytest.raises(ValueError):
        plot_evidence.write_plot({"shapes": []}, out)
