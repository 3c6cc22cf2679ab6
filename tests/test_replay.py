"""The replay format, its loader and backend, the recorder that writes it, and backend choice.

``tests/data/replay_model_512x64.json`` was written by
``python bench/record_replay.py --backend model --shape 512x64 --out ...``: the
cost model's figures, so it says ``"measured": false``; it tests the format,
not the search's quality (``test_search`` does that on ``bench/data/`` files).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import build
from kernels.backends import BackendFactory, choose_backend, detect_cuda, make_backend
from kernels.backends.base import Failure, Measurement
from kernels.backends.replay import (
    FORMAT,
    ReplayBackend,
    load_recordings,
    recording_from,
    write_recordings,
)
from tuner.config import BackendConfig
from tuner.device import H200
from tuner.environment import Environment
from tuner.errors import BackendError
from tuner.planner import KernelParams, candidate_space, plan_kernel
from tuner.planner.families import families_for
from tuner.problem import Problem

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "replay_model_512x64.json"
PROBLEM = Problem(512, 64)
H200_ENVIRONMENT = Environment("NVIDIA H200", "9.0", 132, driver_version="580.159")


def tiled(tile: int = 32, rows: int = 32, threads: int = 128, split: int = 4, problem=PROBLEM):
    return plan_kernel(problem, KernelParams("tiled", threads, tile, rows, split), H200)


def gpu_recording(path: Path, *, measured: bool = True, environment=H200_ENVIRONMENT) -> Path:
    ok, failed = tiled(), tiled(tile=16)
    results = [
        (
            ok,
            Measurement(True, 0.25, 0.01, 30, 2e-7, tflops=1.0, gbps=100.0),
            0.2,
        ),
        (failed, Measurement.failed(Failure.WRONG_ANSWER, "max |err| 0.5 > 0.001"), 0.3),
    ]
    recording = recording_from(
        PROBLEM, environment, measured, "cmd", "2026-12-02", results, {"tiled": "abc"}
    )
    write_recordings(path, [recording])
    return path


def test_the_fixture_replays_every_feasible_plan_as_a_prediction():
    backend = ReplayBackend(FIXTURE)
    assert not backend.measured
    assert backend.environment()["gpu_name"] == "model"
    recording = backend.recording_for(PROBLEM)
    assert recording.command.startswith("python bench/record_replay.py --backend model")
    for plan in candidate_space(PROBLEM, H200).feasible:
        result = backend.measure(plan, PROBLEM)
        assert result.ok and not result.measured, plan.key()
        assert result.median_ms == recording.entries[plan.key()].median_ms
        assert result.tflops and result.gbps


def test_gpu_timings_are_served_as_measured_with_their_evidence(tmp_path):
    backend = ReplayBackend(gpu_recording(tmp_path / "gpu.json"))
    assert backend.measured
    assert backend.environment() == H200_ENVIRONMENT.as_dict()
    result = backend.measure(tiled(), PROBLEM)
    assert result.measured and result.ok
    assert (result.median_ms, result.spread_ms, result.max_abs_error) == (0.25, 0.01, 2e-7)
    assert result.repetitions == 30


def test_a_recorded_failure_is_replayed_as_that_failure(tmp_path):
    backend = ReplayBackend(gpu_recording(tmp_path / "gpu.json"))
    result = backend.measure(tiled(tile=16), PROBLEM)
    assert result.failure == Failure.WRONG_ANSWER
    assert result.detail == "max |err| 0.5 > 0.001" and result.median_ms is None


def test_the_compilers_verdicts_are_kept_as_rejections(tmp_path):
    path = tmp_path / "gpu.json"
    spilled = tiled(tile=64)
    verdict = Measurement.failed(Failure.INFEASIBLE, "compiler spills registers", measured=False)
    recording = recording_from(
        PROBLEM, H200_ENVIRONMENT, True, "cmd", "d", [(spilled, verdict, None)]
    )
    write_recordings(path, [recording])
    (loaded,) = load_recordings(path)
    assert loaded.rejection(spilled.key()) == "compiler spills registers"
    assert loaded.rejection(tiled().key()) is None
    assert loaded.source_hashes == {}


def test_a_plan_missing_from_the_file_is_a_failure_saying_so(tmp_path):
    backend = ReplayBackend(gpu_recording(tmp_path / "gpu.json"))
    result = backend.measure(tiled(tile=64), PROBLEM)
    assert result.failure == Failure.INFEASIBLE and not result.measured
    assert "tiled/b64/r32/t128/s2 is not in replay file gpu.json (2 plans recorded)" in (
        result.detail
    )


def test_a_problem_missing_from_the_file_is_a_run_level_error_or_a_failure():
    backend = ReplayBackend(FIXTURE)
    other = Problem(1024, 64)
    with pytest.raises(BackendError, match="has no recording of 1x1x1024x64 float32 full"):
        backend.recording_for(other)
    result = backend.measure(tiled(problem=other), other)
    assert result.failure == Failure.INFEASIBLE


def test_measured_needs_both_the_flag_and_a_gpu(tmp_path):
    unflagged = ReplayBackend(gpu_recording(tmp_path / "a.json", measured=False))
    assert not unflagged.measure(tiled(), PROBLEM).measured
    model = Environment("model", "9.0", 132)
    with pytest.raises(BackendError, match="says measured but its environment is the cost model"):
        ReplayBackend(gpu_recording(tmp_path / "b.json", environment=model))


def test_a_file_may_hold_several_problems(tmp_path):
    path = gpu_recording(tmp_path / "one.json")
    first = load_recordings(path)[0]
    other = Problem(512, 64, causal=True)
    second = recording_from(
        other,
        H200_ENVIRONMENT,
        True,
        "cmd",
        "2026-12-02",
        [(tiled(problem=other), Measurement(True, 0.125), None)],
    )
    write_recordings(tmp_path / "two.json", [first, second])
    assert isinstance(json.loads((tmp_path / "two.json").read_text()), list)
    backend = ReplayBackend(tmp_path / "two.json")
    assert backend.measure(tiled(problem=other), other).median_ms == 0.125
    assert backend.measure(tiled(), PROBLEM).median_ms == 0.25


def test_round_trip_keeps_every_field(tmp_path):
    path = gpu_recording(tmp_path / "gpu.json")
    (recording,) = load_recordings(path)
    assert recording.source_hashes == {"tiled": "abc"}
    write_recordings(tmp_path / "again.json", [recording])
    assert load_recordings(tmp_path / "again.json") == [recording]
    assert recording.entries[tiled().key()].predicted_ms == 0.2


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format=FORMAT + 1), "format 2 is not supported"),
        (lambda d: d.pop("environment"), "missing field 'environment'"),
        (lambda d: d.update(measured="yes"), "'measured' must be true or false"),
        (lambda d: d["measurements"][0].update(median_ms=None), "no failure and no positive"),
        (lambda d: d["measurements"][1].update(failure="MELTED"), "'MELTED' is not a valid"),
        (lambda d: d["measurements"].append(d["measurements"][0]), "recorded twice"),
    ],
)
def test_a_malformed_file_is_refused_with_a_reason(tmp_path, edit, message):
    data = json.loads(gpu_recording(tmp_path / "gpu.json").read_text())
    edit(data)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(BackendError, match=message):
        ReplayBackend(tmp_path / "bad.json")


def test_unreadable_files_are_refused_with_a_reason(tmp_path):
    with pytest.raises(BackendError, match="cannot read replay file"):
        ReplayBackend(tmp_path / "missing.json")
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(BackendError, match="is not JSON"):
        ReplayBackend(tmp_path / "text.json")


def test_make_backend_builds_the_replay_backend_from_the_config():
    config = BackendConfig(name="replay", replay_path=str(FIXTURE))
    backend = make_backend("replay", config)
    assert isinstance(backend, ReplayBackend)
    assert isinstance(BackendFactory("replay", config)(), ReplayBackend)


def test_the_recorder_writes_and_appends_recordings(tmp_path):
    out = tmp_path / "model.json"
    script = str(ROOT / "bench" / "record_replay.py")
    for shape in ("256x64", "1x2x256x32"):
        done = subprocess.run(
            [sys.executable, script, "--backend", "model", "--shape", shape, "--out", str(out)]
            + (["--append"] if shape != "256x64" else []),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert f"written: {out}" in done.stdout
    recordings = load_recordings(out)
    assert [r.problem for r in recordings] == [Problem(256, 64), Problem(256, 32, heads=2)]
    for recording in recordings:
        feasible = candidate_space(recording.problem, H200).feasible
        assert set(recording.entries) == {plan.key() for plan in feasible}
        assert not recording.measured and recording.environment.gpu_name == "model"
        # The hashes name the families the recording holds: the float32 ones with a plan.
        held = {plan.params.family for plan in feasible}
        assert held and held <= set(families_for("float32"))
        assert recording.source_hashes == {f: build.source_hash(f) for f in held}
        assert "--backend model" in recording.command and recording.date.startswith("20")


# ---------------------------------------------------------------- backend choice


def test_importing_the_backends_and_the_app_loads_no_pycuda():
    code = (
        "import sys, kernels.backends, tuner.app, tuner.isolation; "
        "assert 'pycuda' not in sys.modules, sorted(m for m in sys.modules if 'cuda' in m)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


FAKE_DRIVER = """
class Error(Exception):
    pass
class LogicError(Error):
    pass
def init():
    if {fail!r}:
        raise LogicError("cuInit failed: no CUDA-capable device is detected")
class Device:
    def __init__(self, ordinal):
        self.ordinal = ordinal
    @staticmethod
    def count():
        return 1
    def name(self):
        return "Fake GPU"
"""


@pytest.mark.parametrize(
    ("fail", "ordinal", "expected"),
    [
        (True, 0, "cuInit failed: no CUDA-capable device is detected"),
        (False, 0, None),
        (False, 3, "CUDA device 3 requested but 1 visible"),
    ],
)
def test_detect_cuda_asks_a_subprocess_and_says_why_not(
    tmp_path, monkeypatch, fail, ordinal, expected
):
    package = tmp_path / "pycuda"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "driver.py").write_text(FAKE_DRIVER.format(fail=fail))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert detect_cuda(ordinal) == expected
    assert "pycuda" not in sys.modules  # this process never imported it


def test_auto_falls_back_to_the_model_with_the_reason(monkeypatch):
    monkeypatch.setattr("kernels.backends.detect_cuda", lambda ordinal=0: "pycuda not installed")
    choice = choose_backend(BackendConfig(name="auto"))
    assert choice.line(measured=False) == (
        "backend: model (auto: no CUDA device: pycuda not installed) - results are "
        "predictions, stored as predicted"
    )
    monkeypatch.setattr("kernels.backends.detect_cuda", lambda ordinal=0: None)
    choice = choose_backend(BackendConfig(name="auto"))
    assert choice.name == "pycuda"
    assert choice.line(measured=True) == (
        "backend: pycuda (auto: CUDA device 0 answers) - results are GPU timings, "
        "stored as measured"
    )


def test_a_recording_of_another_dtype_is_one_error_naming_both() -> None:
    float32 = ReplayBackend(ROOT / "bench" / "data" / "h200_1x1x4096x128.json")
    with pytest.raises(BackendError) as caught:
        float32.recording_for(Problem(4096, 128, dtype="bfloat16"))
    assert str(caught.value).endswith(
        "records 1x1x4096x128 in float32, but the problem asks for dtype=bfloat16: "
        "replay it with dtype=float32"
    )
    tf32 = ReplayBackend(ROOT / "bench" / "data" / "h200_mma_tf32_1x1x4096x128_tf32.json")
    with pytest.raises(BackendError) as caught:
        tf32.recording_for(Problem(4096, 128, dtype="float32"))
    assert str(caught.value).endswith(
        "records 1x1x4096x128 in float32-tf32, but the problem asks for dtype=float32: "
        "replay it with dtype=float32 precision=tf32"
    )
    with pytest.raises(BackendError, match=r"has no recording of 1x1x2048x128 float32 full"):
        float32.recording_for(Problem(2048, 128))  # another shape: the list of what it holds


def test_the_readme_s_replay_example_runs_from_a_checkout(tmp_path: Path) -> None:
    (example,) = [
        line.split("#")[0].split()
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("python -m tuner ") and "backend=replay" in line
    ]
    assert example[:3] == ["python", "-m", "tuner"]
    done = subprocess.run(
        [
            sys.executable,
            *example[1:],
            "search.n_trials=2",
            f"registry.url=sqlite:///{tmp_path / 'r.sqlite'}",
            f"search.storage=sqlite:///{tmp_path / 's.sqlite'}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "replayed, stored as predicted" in done.stdout
