"""The whole tune run: ``tuner.app.run`` in-process, and ``python -m tuner`` in a subprocess.

No GPU: the model and replay backends. Each test has its own registry and
study storage under tmp_path, checked through their own APIs afterwards.
"""

from __future__ import annotations

import importlib.util
import io
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from hydra import compose, initialize_config_dir
from interrupted_tuner import interrupt_tuner

from db import PlanRegistry
from kernels import build
from kernels.backends.replay import load_recordings
from tuner.app import run
from tuner.config import typed_config, validate
from tuner.problem import Problem

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "tuner" / "conf"
FIXTURE = ROOT / "tests" / "data" / "replay_model_512x64.json"
PROBLEM = Problem(512, 64)
HEADER = "rank  plan"


def urls(tmp_path: Path) -> list[str]:
    return [
        f"registry.url=sqlite:///{tmp_path / 'r.sqlite'}",
        f"search.storage=sqlite:///{tmp_path / 's.sqlite'}",
    ]


def stored(tmp_path: Path, problem: Problem = PROBLEM):
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'r.sqlite'}", readonly=True) as registry:
        return registry.best(problem)


def study_trials(tmp_path: Path) -> list[optuna.trial.FrozenTrial]:
    storage = f"sqlite:///{tmp_path / 's.sqlite'}"
    (name,) = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)


def evaluated_keys(tmp_path: Path) -> list[str]:
    return [
        t.user_attrs["plan_key"]
        for t in study_trials(tmp_path)
        if t.user_attrs.get("outcome") in ("measured", "failed")
    ]


# ---------------------------------------------------------------- in-process


@pytest.fixture(scope="module")
def hydra_conf() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def run_in_process(tmp_path: Path, *overrides: str) -> tuple[int, str]:
    cfg = compose(
        config_name="config", overrides=["seq_len=512", "head_dim=64", "dtype=float32", *overrides]
    )
    out = io.StringIO()
    status = run(validate(typed_config(cfg)), output_dir=tmp_path / "run", out=out)
    return status, out.getvalue()


def test_model_run_stores_a_predicted_plan_with_its_evidence(tmp_path, hydra_conf):
    status, output = run_in_process(
        tmp_path, "backend=model", "search.n_trials=12", *urls(tmp_path)
    )
    assert status == 0
    lines = output.splitlines()
    assert lines[0] == ("backend: model (asked for) - results are predictions, stored as predicted")
    assert HEADER in output and "stopped: n_trials=12 reached" in output
    best = stored(tmp_path)
    assert best is not None and not best.record.measured
    assert best.environment.gpu_name == "model"
    record = best.record
    assert record.source_hash == build.source_hash(record.family)
    assert record.median_ms == record.predicted_ms
    assert record.predicted_read_bytes and record.predicted_write_bytes
    assert record.study_name and record.trial_number is not None
    assert set(record.params) == {"threads", "tile_size", "rows_per_block", "split_target"}
    assert f"registry: {_key(record)}" in output
    # Without GPU timings: predicted times shown once, and only the plot that says something.
    plots = sorted(p.name for p in (tmp_path / "run").glob("*.png"))
    assert plots == ["search_history.png"]
    assert "no heatmap or predicted-vs-measured plot" in output
    row = next(line for line in lines if line.startswith("   1  "))
    cells = row.split()
    assert cells[2:4] == ["-", "-"] and cells[-1] == "predicted"  # median and spread


def _key(record) -> str:
    params = record.params
    if record.family == "scalar_online":
        return f"scalar_online/t{params['threads']}"
    return f"tiled/b{params['tile_size']}/r{params['rows_per_block']}/t{params['threads']}/"


def test_rerunning_the_same_command_continues_the_study(tmp_path, hydra_conf):
    run_in_process(tmp_path, "backend=model", "search.n_trials=5", *urls(tmp_path))
    first = evaluated_keys(tmp_path)
    status, output = run_in_process(tmp_path, "backend=model", "search.n_trials=9", *urls(tmp_path))
    assert status == 0 and "4 in this run" in output
    keys = evaluated_keys(tmp_path)
    assert len(keys) == 9 == len(set(keys)) and keys[:5] == first
    _, output = run_in_process(tmp_path, "backend=model", "search.n_trials=9", *urls(tmp_path))
    assert "n_trials=9 already reached" in output and len(evaluated_keys(tmp_path)) == 9
    assert "study: continuing " in output and "(9 trials done of search.n_trials=9;" in output


def test_the_dashboard_is_an_extra_named_only_where_installed(tmp_path, hydra_conf):
    import importlib.util
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(
        requirement.startswith("optuna-dashboard")
        for requirement in project["optional-dependencies"]["dashboard"]
    )
    _, output = run_in_process(tmp_path, "backend=model", "search.n_trials=2", *urls(tmp_path))
    installed = importlib.util.find_spec("optuna_dashboard") is not None
    assert ("optuna-dashboard" in output) == installed


def test_a_rerun_of_a_finished_study_adds_no_history_row(tmp_path, hydra_conf):
    run_in_process(tmp_path, "backend=model", "search.n_trials=4", *urls(tmp_path))
    for _ in range(2):
        status, output = run_in_process(
            tmp_path, "backend=model", "search.n_trials=4", *urls(tmp_path)
        )
        assert status == 0 and "already stored by an earlier run of this study" in output
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'r.sqlite'}", readonly=True) as registry:
        assert len(registry.history(limit=None)) == 1
    # A study that goes on and finds a better plan still adds its row.
    run_in_process(tmp_path, "backend=model", "search.n_trials=40", *urls(tmp_path))
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'r.sqlite'}", readonly=True) as registry:
        history = registry.history(limit=None)
    assert len(history) in (1, 2)
    assert len({(h.record.study_name, h.record.trial_number) for h in history}) == len(history)


def test_another_sampler_starts_its_own_study(tmp_path, hydra_conf):
    status, output = run_in_process(
        tmp_path, "backend=model", "search=random", "search.n_trials=6", *urls(tmp_path)
    )
    assert status == 0 and "continuing" not in output
    status, output = run_in_process(
        tmp_path, "backend=model", "search=grid", "search.n_trials=4", *urls(tmp_path)
    )
    assert status == 0, output
    assert "continuing" not in output and "already reached" not in output
    assert "4 in this run" in output
    names = optuna.get_all_study_names(f"sqlite:///{tmp_path / 's.sqlite'}")
    assert sorted(name.rsplit("-", 1)[1] for name in names) == ["grid", "random"]


def test_replay_run_serves_the_recording(tmp_path, hydra_conf):
    status, output = run_in_process(
        tmp_path,
        "backend=replay",
        f"backend.replay_path={FIXTURE}",
        "search.n_trials=10",
        *urls(tmp_path),
    )
    assert status == 0
    assert output.splitlines()[0] == (
        f"backend: replay (asked for; file {FIXTURE}) - results are predictions, "
        "stored as predicted"
    )
    best = stored(tmp_path)
    assert best is not None and not best.record.measured  # the fixture is model-made


GPU_RECORDING = ROOT / "bench" / "data" / "h200_1x1x4096x128.json"


@pytest.mark.skipif(not GPU_RECORDING.exists(), reason="no H200 recording in bench/data")
def test_replay_of_gpu_timings_is_stored_as_predicted_under_the_recorded_sources(
    tmp_path, hydra_conf
):
    (recording,) = load_recordings(GPU_RECORDING)
    cfg = compose(
        config_name="config",
        overrides=[
            "seq_len=4096",
            "head_dim=128",
            "dtype=float32",
            "backend=replay",
            f"backend.replay_path={GPU_RECORDING}",
            "search.n_trials=30",
            *urls(tmp_path),
        ],
    )
    out = io.StringIO()
    assert run(validate(typed_config(cfg)), output_dir=tmp_path / "run", out=out) == 0
    output = out.getvalue()
    # Timings recorded on another machine's GPU: never stored or served as measured here.
    assert "stored as predicted" in output.splitlines()[0]
    assert "replayed, stored as predicted" in output
    best = stored(tmp_path, Problem(4096, 128))
    assert best is not None and not best.record.measured and not best.served_as_measured
    assert best.environment == recording.environment
    assert best.record.source_hash == recording.source_hashes[best.record.family]
    assert best.record.study_name.endswith("-replay")
    # The recording machine's compiler verdicts are dropped before the search.
    rejected = [k for k in recording.entries if recording.rejection(k)]
    assert rejected and not set(rejected) & set(evaluated_keys(tmp_path))
    fastest = min(e.median_ms for e in recording.entries.values() if e.median_ms)
    assert best.record.median_ms <= 1.1 * fastest


def test_plots_are_skipped_with_a_line_without_a_run_directory(tmp_path, hydra_conf):
    cfg = compose(
        config_name="config",
        overrides=[
            "seq_len=512",
            "head_dim=64",
            "dtype=float32",
            "backend=model",
            "search.n_trials=3",
        ]
        + urls(tmp_path),
    )
    out = io.StringIO()
    assert run(validate(typed_config(cfg)), out=out) == 0
    assert "plots: none (no run directory" in out.getvalue()


# ---------------------------------------------------------------- the CLI


def tuner_cli(tmp_path: Path, *overrides: str, **popen) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tuner", *overrides, f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        **popen,
    )


def test_cli_model_backend(tmp_path):
    done = tuner_cli(
        tmp_path,
        "seq_len=512",
        "head_dim=64",
        "dtype=float32",
        "backend=model",
        "search.n_trials=12",
        *urls(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    assert "backend: model (asked for) - results are predictions, stored as predicted" in (
        done.stdout
    )
    assert HEADER in done.stdout and "registry: " in done.stdout
    best = stored(tmp_path)
    assert best is not None and not best.record.measured
    assert len(evaluated_keys(tmp_path)) == 12
    assert (tmp_path / "run" / "search_history.png").exists()


@pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="pycuda installed")
def test_cli_auto_falls_back_to_the_model_and_says_why(tmp_path):
    done = tuner_cli(
        tmp_path,
        "seq_len=512",
        "head_dim=64",
        "dtype=float32",
        "search.n_trials=3",
        *urls(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("backend:")]
    assert line == (
        "backend: model (auto: no CUDA device: pycuda not installed) - results are "
        "predictions, stored as predicted"
    )


def test_cli_replay_backend(tmp_path):
    done = tuner_cli(
        tmp_path,
        "seq_len=512",
        "head_dim=64",
        "dtype=float32",
        "backend=replay",
        f"backend.replay_path={FIXTURE}",
        "search.n_trials=12",
        *urls(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    assert "backend: replay" in done.stdout and HEADER in done.stdout
    assert stored(tmp_path) is not None


def test_cli_replay_of_another_problem_is_one_error_line(tmp_path):
    done = tuner_cli(
        tmp_path,
        "seq_len=1024",
        "head_dim=64",
        "dtype=float32",
        "backend=replay",
        f"backend.replay_path={FIXTURE}",
        *urls(tmp_path),
    )
    assert done.returncode == 1
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: replay file {FIXTURE} has no recording of 1x1x1024x64 float32 full")
    )


def test_cli_ctrl_c_keeps_the_best_so_far_and_the_rerun_continues(tmp_path):
    # No stopping rule: a search long enough to interrupt, and a rerun that runs its 3.
    overrides = [
        "seq_len=4096",
        "head_dim=128",
        "dtype=float32",
        "backend=model",
        "search.stop=false",
        *urls(tmp_path),
    ]
    done = interrupt_tuner(
        [*overrides, "search.n_trials=400", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
        tmp_path / "s.sqlite",
        signal.SIGINT,
    )
    stdout, stderr = done.stdout, done.stderr
    assert done.returncode == 130, stderr
    assert "interrupted (Ctrl-C): the study keeps its finished trials" in stdout
    assert HEADER in stdout and "registry: best so far " in stdout
    assert stored(tmp_path, Problem(4096, 128)) is not None
    before = evaluated_keys(tmp_path)
    assert before and "Traceback" not in stderr

    done = tuner_cli(tmp_path, *overrides, f"search.n_trials={len(before) + 3}")
    assert done.returncode == 0, done.stderr
    after = evaluated_keys(tmp_path)
    assert len(after) == len(before) + 3 == len(set(after))
    assert after[: len(before)] == before
