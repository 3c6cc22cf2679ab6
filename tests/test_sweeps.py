"""Hydra multirun sweeps: every shape tuned into the registry, one by one or with joblib,
a failing job reaching the exit status, and the SLURM launcher config composing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import tuner.config  # noqa: F401  (registers the schema tuner/conf/ builds on)
from db import PlanRegistry

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "replay_model_512x64.json"
SHAPES = {(s, d) for s in (1024, 2048, 4096) for d in (64, 128)}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported; False also when its parent package is absent
    (``find_spec("a.b")`` imports ``a`` and raises ModuleNotFoundError without it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


needs_joblib = pytest.mark.skipif(
    not installed("hydra_plugins.hydra_joblib_launcher"),
    reason="hydra-joblib-launcher is not installed (pip install -e '.[sweep]')",
)
#: Runs Python with every ``hydra_plugins`` module missing, as without the sweep extra.
WITHOUT_PLUGINS = """
import sys


class HidePlugins:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "hydra_plugins":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, HidePlugins())
import pytest

sys.exit(pytest.main(sys.argv[1:]))
"""


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
        tmp_path,
        "seq_len=1024,2048,4096",
        "head_dim=64,128",
        "dtype=float32",
        "backend=model",
        "search.n_trials=3",
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
        "dtype=float32",
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
        "dtype=float32",
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


def test_installed_is_false_when_the_parent_package_is_missing():
    assert installed("importlib.util")
    assert not installed("no_such_package_anywhere.launcher")


@pytest.mark.slow
def test_the_suite_collects_and_skips_without_the_launcher_plugins():
    def without_plugins(*arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", WITHOUT_PLUGINS, "-p", "no:cacheprovider", *arguments],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    collected = without_plugins("--collect-only", "-q", "tests")
    assert collected.returncode == 0, collected.stdout[-3000:]
    ran = without_plugins("-q", "-rs", "tests/test_sweeps.py", "-k", "joblib or slurm")
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert "3 skipped" in ran.stdout and "hydra-joblib-launcher is not installed" in ran.stdout


def test_the_slurm_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    with initialize_config_dir(config_dir=str(ROOT / "tuner" / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "seq_len=4096",
                "head_dim=128",
                "dtype=float32",
                "hydra/launcher=slurm_h200",
            ],
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
