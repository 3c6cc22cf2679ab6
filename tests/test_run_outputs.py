"""What a run leaves behind: nothing when it is refused or only prints; a log with the
result table when it tunes; no registry or study file before the inputs are valid."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from tuner import study_storage
from tuner.__main__ import CONF_DIR
from tuner.app import run
from tuner.config import typed_config, validate
from tuner.errors import ConfigError
from tuner.run_directory import remove_if_unused

SHAPE = ("seq_len=512", "head_dim=64", "backend=model", "search.n_trials=2")


def tune(cwd: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tuner", *SHAPE, *arguments],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_refused_value_creates_no_run_directory_and_no_database(
    tmp_path: Path, private_data_dir: Path
) -> None:
    done = tune(tmp_path, "search.n_trials=0")
    assert done.returncode == 1 and done.stderr.startswith("error: search.n_trials=0")
    assert list(tmp_path.iterdir()) == []
    assert not private_data_dir.exists()


def test_plan_mode_creates_no_run_directory(tmp_path: Path) -> None:
    done = tune(tmp_path, "mode=plan")
    assert done.returncode == 0 and "feasible:" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_bad_study_storage_leaves_no_registry_and_no_study_file(
    tmp_path: Path, private_data_dir: Path
) -> None:
    (tmp_path / "bad.sqlite").write_text("garbage " * 100)
    done = tune(tmp_path, f"search.storage=sqlite:///{tmp_path / 'bad.sqlite'}")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().endswith("cannot be opened: file is not a database")
    assert not private_data_dir.exists()  # the registry was checked, not created
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.sqlite"]


def test_a_tune_run_logs_its_result_table(tmp_path: Path) -> None:
    done = tune(tmp_path, f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "run" / "tuner.log").read_text()
    assert "rank  plan" in log and "registry: " in log and "study: " in log


def test_an_interrupt_while_the_study_opens_leaves_no_database(
    tmp_path: Path, private_data_dir: Path, monkeypatch
) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(study_storage, "RDBStorage", interrupted)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*SHAPE])
    with pytest.raises(KeyboardInterrupt):
        run(validate(typed_config(cfg)), output_dir=tmp_path / "run", out=io.StringIO())
    assert not private_data_dir.exists()  # neither plans.sqlite nor studies.sqlite (nor dir)


def test_a_study_storage_that_fails_to_open_is_removed(tmp_path: Path, monkeypatch) -> None:
    def refused(*args, **kwargs):
        raise RuntimeError("no")

    monkeypatch.setattr(study_storage, "RDBStorage", refused)
    with pytest.raises(ConfigError):
        study_storage.open_storage(f"sqlite:///{tmp_path / 'a' / 'b' / 's.sqlite'}")
    assert list(tmp_path.iterdir()) == []


def test_a_used_run_directory_is_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "outputs" / "day" / "time"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("x: 1\n")
    (run_dir / "tuner.log").write_text("")
    (run_dir / "plot.png").write_bytes(b"png")
    assert not remove_if_unused(run_dir, "tuner.log") and run_dir.is_dir()
    (run_dir / "plot.png").unlink()
    assert remove_if_unused(run_dir, "tuner.log")
    assert list(tmp_path.iterdir()) == []  # the empty outputs/day/ went too


def test_an_uncreatable_run_directory_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    done = tune(tmp_path, f"hydra.run.dir={blocker / 'run'}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: cannot create {blocker / 'run'}") and "hydra.run.dir" in line


def test_a_removed_working_directory_is_one_line(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    script = (
        "import os, runpy, sys; os.chdir(sys.argv[1]); os.rmdir(sys.argv[1]); "
        "sys.argv = ['tuner', *sys.argv[2:]]; runpy.run_module('tuner', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(gone), *SHAPE],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "error: the working directory no longer exists: cd to an existing directory and rerun"
    )


def test_a_launcher_without_its_scheduler_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    done = subprocess.run(
        [sys.executable, "-m", "tuner", "-m", *SHAPE, "hydra/launcher=slurm_h200"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode == 0:
        pytest.skip("srun is here: a SLURM cluster")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: hydra/launcher=slurm_h200 cannot run the sweep: ")
    assert 'Could not detect "srun"' in line


def test_progress_is_a_line_per_tenth_of_the_trials_off_a_terminal(tmp_path: Path) -> None:
    # All 20 trials (no stopping rule), so that every tenth has its line.
    done = tune(
        tmp_path, "search.n_trials=20", "search.stop=false", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("trials: ")]
    assert [line.split(",")[0] for line in lines] == [f"trials: {n}/20" for n in range(2, 21, 2)]
    assert all(" ms" in line for line in lines) and "\r" not in done.stderr
