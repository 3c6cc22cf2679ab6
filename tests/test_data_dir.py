"""Default data locations: the per-user data directory, never the working directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tuner import data_dir
from tuner.data_dir import DATA_DIR_VARIABLE
from tuner.study_names import default_storage_url

SHAPE = ("seq_len=512", "head_dim=64", "backend=model", "search.n_trials=2")


def test_the_variable_wins(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(DATA_DIR_VARIABLE, str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert data_dir.data_dir() == tmp_path / "mine"
    assert data_dir.default_registry_url() == f"sqlite:///{tmp_path / 'mine' / 'plans.sqlite'}"


def test_xdg_data_home_then_the_home_directory(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(DATA_DIR_VARIABLE)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert data_dir.data_dir() == tmp_path / "xdg" / "flash-attention-tuner"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/xdg")  # invalid per the spec: ignored
    expected = tmp_path / "home" / ".local" / "share" / "flash-attention-tuner"
    assert data_dir.data_dir() == expected
    monkeypatch.delenv("XDG_DATA_HOME")
    assert data_dir.data_dir() == expected


def test_studies_of_a_server_registry_go_to_the_data_directory(private_data_dir: Path) -> None:
    url = default_storage_url("postgresql+psycopg://u@h/plans")
    assert url == f"sqlite:///{private_data_dir / 'studies.sqlite'}"


def tune(cwd: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tuner", *SHAPE, *arguments],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_runs_from_any_directory_share_the_default_registry(
    tmp_path: Path, private_data_dir: Path
) -> None:
    """Twice from one empty directory, once from another: no ``db/`` anywhere, one registry."""
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir()
    second.mkdir()
    for cwd in (first, first, second):
        done = tune(cwd, f"hydra.run.dir={tmp_path / 'run'}")
        assert done.returncode == 0, done.stderr
        assert f"stored in sqlite:///{private_data_dir / 'plans.sqlite'}" in done.stdout
    assert sorted(p.name for p in private_data_dir.iterdir() if "-" not in p.name) == [
        "plans.sqlite",
        "studies.sqlite",
    ]
    assert list(first.iterdir()) == [] and list(second.iterdir()) == []


@pytest.mark.slow
def test_directories_named_like_the_packages_do_not_shadow_them(tmp_path: Path) -> None:
    # An old run's ./db/plans.sqlite (the former default), and a stray kernels/.
    (tmp_path / "db").mkdir()
    (tmp_path / "db" / "plans.sqlite").write_bytes(b"")
    (tmp_path / "kernels").mkdir()
    done = tune(tmp_path, "mode=plan")
    assert done.returncode == 0, done.stderr
    done = tune(tmp_path, f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr
    assert "registry: " in done.stdout
