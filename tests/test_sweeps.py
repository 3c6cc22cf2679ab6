"""Hydra multirun sweeps: every shape tuned into the registry, one by one or with joblib,
a failing job reaching the exit status, and the SLURM launcher config composing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import tuner.config  # noqa: F401  (registers the schemas conf/ builds on)
from db import PlanRegistry

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "replay_model_512x64.json"
SHAPES = {(s, d) for s in (1024, 2048, 4096) for d in (64, 128)}
needs_joblib = pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is None,
    reason="hydra-joblib-launcher is not installed (pip install -e '.[sweep]')",
)


def sweep(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tuner",
            "-m",
            *arguments,
            f"registry.url=sqlite:///{tmp_path / 'r.sqlite'}",
            f"hydra.sweep.dir={tmp_path / 'multirun'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )


def stored_shapes(tmp_path: Path) -> set[tuple[int, int]]:
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'r.sqlite'}", readonly=True) as registry:
        return {(p.problem.seq_len, p.problem.head_dim) for p in registry.list_best()}


def test_a_sweep_tunes_every_shape_into_the_registry(tmp_path):
    done = sweep(
        tmp_path, "seq_len=1024,2048,4096", "head_dim=64,128", "backend=model", "search.n_trials=3"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("registry: ") == 6
    assert stored_shapes(tmp_path) == SHAPES
    # One study per shape, all in the default storage next to the registry.
    import optuna

    assert len(optuna.get_all_study_names(f"sqlite:///{tmp_path / 'studies.sqlite'}")) == 6


@needs_joblib
def test_a_joblib_sweep_runs_the_jobs_in_parallel_processes(tmp_path):
    done = sweep(
        tmp_path,
        "seq_len=1024,2048,4096",
        "head_dim=64,128",
        "backend=model",
        "search.n_trials=3",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
    )
    assert done.returncode == 0, done.stderr
    assert "Joblib.Parallel(n_jobs=2" in done.stdout + done.stderr
    assert stored_shapes(tmp_path) == SHAPES


@needs_joblib
def test_a_failed_joblib_job_makes_the_sweep_fail(tmp_path):
    done = sweep(
        tmp_path,
        "seq_len=512,1024",
        "head_dim=64",
        "backend=replay",
        f"backend.replay_path={FIXTURE}",
        "search.n_trials=3",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
    )
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: replay file {FIXTURE} has no recording of 1x1x1024x64 float32 full "
        "(it holds: 1x1x512x64 float32 full)"
    ]
    assert "Error executing job with overrides: ['seq_len=1024'" in done.stderr
    assert "Traceback" not in done.stderr
    assert stored_shapes(tmp_path) == {(512, 64)}  # the good job ran and stored its plan


def test_the_slurm_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    with initialize_config_dir(config_dir=str(ROOT / "tuner" / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["seq_len=4096", "head_dim=128", "hydra/launcher=slurm_h200"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_ == (
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    )
    assert launcher.gpus_per_node == 1 and launcher.tasks_per_node == 1 and launcher.nodes == 1
    assert launcher.timeout_min == 120 and launcher.cpus_per_task == 16
    assert launcher.max_num_timeout == 0 and launcher.array_parallelism == 16
    assert launcher.submitit_folder.endswith("/.submitit/%j")
    assert cfg.hydra.runtime.choices["hydra/launcher"] == "slurm_h200"
