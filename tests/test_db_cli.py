"""``python -m db`` in subprocesses: output, exit codes, one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from db import PlanRecord, PlanRegistry
from db.cli import main
from db.schema import HEAD_REVISION
from tuner.environment import Environment
from tuner.problem import Problem

FROZEN_0001 = Path(__file__).parent / "data" / "registry_0001.sqlite"
H200 = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "2025.1.2")


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "db", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def url(tmp_path: Path) -> str:
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'plans.sqlite'}") as registry:
        problem = Problem(seq_len=4096, head_dim=128, batch=2, heads=8, causal=True)
        registry.record(
            problem,
            H200,
            PlanRecord(
                "tiled",
                {"tile_size": 64, "rows_per_block": 64},
                "sha256:abc",
                True,
                median_ms=0.8125,
                spread_ms=0.004,
                tflops=42.5,
                study_name="fa",
                trial_number=7,
            ),
        )
        registry.record(
            Problem(1024, 64), H200, PlanRecord("tiled", {"tile_size": 32}, "x", False, 0.1)
        )
        return registry.url


def test_best_json_is_the_stored_plan(url: str, tmp_path: Path) -> None:
    result = run_cli(
        "best",
        "--url",
        url,
        "--seq-len=4096",
        "--head-dim=128",
        "--dtype=float32",
        "--batch=2",
        "--heads=8",
        "--causal",
        "--json",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["plan"]["params"] == {"tile_size": 64, "rows_per_block": 64}
    assert answer["plan"]["median_ms"] == 0.8125 and answer["plan"]["trial_number"] == 7
    assert answer["problem"]["causal"] is True and answer["environment"]["sm_count"] == 132
    assert answer["served_as_measured"] is True and answer["fallback"] is False

    stale = run_cli(
        "best",
        *("--url", url, "--seq-len", "4096", "--head-dim", "128", "--batch", "2"),
        "--dtype=float32",
        *("--heads", "8", "--causal", "--source-hash", "tiled=sha256:new", "--json"),
        cwd=tmp_path,
    )
    assert json.loads(stale.stdout)["served_as_measured"] is False


def test_best_nearest_and_not_found(url: str, tmp_path: Path) -> None:
    missing = run_cli(
        "best", "--url", url, "--seq-len", "2000", "--head-dim", "64", "--dtype=float32",
        cwd=tmp_path,
    )
    assert missing.returncode == 3 and "no plan" in missing.stdout
    nearest = run_cli(
        "best",
        *("--url", url, "--seq-len", "2000", "--head-dim", "64", "--nearest", "--json"),
        "--dtype=float32",
        cwd=tmp_path,
    )
    assert nearest.returncode == 0
    answer = json.loads(nearest.stdout)
    assert answer["fallback"] is True and answer["problem"]["seq_len"] == 1024


def test_list_history_export_import(url: str, tmp_path: Path) -> None:
    listed = run_cli("list", "--url", url, cwd=tmp_path)
    assert listed.returncode == 0 and len(listed.stdout.strip().splitlines()) == 2
    assert "tile_size=64" in listed.stdout and "predicted" in listed.stdout
    history = run_cli("history", "--url", url, "--json", "--limit", "1", cwd=tmp_path)
    assert len(json.loads(history.stdout)) == 1

    export = tmp_path / "plans.json"
    assert run_cli("export", str(export), "--url", url, cwd=tmp_path).returncode == 0
    fresh = f"sqlite:///{tmp_path / 'copy' / 'plans.sqlite'}"
    imported = run_cli("import", str(export), "--url", fresh, "--json", cwd=tmp_path)
    assert json.loads(imported.stdout) == {"added": 2, "skipped": 0}
    again = run_cli("import", str(export), "--url", fresh, "--json", cwd=tmp_path)
    assert json.loads(again.stdout) == {"added": 0, "skipped": 2}


def test_default_url_is_the_per_user_data_directory(tmp_path: Path, private_data_dir) -> None:
    created = run_cli("upgrade", cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    assert (private_data_dir / "plans.sqlite").is_file()
    assert list(tmp_path.iterdir()) == []  # nothing in the working directory
    assert run_cli("list", cwd=tmp_path).stdout == ""
    helped = "".join(run_cli("list", "--help", cwd=tmp_path).stdout.split())  # argparse wraps
    assert str(private_data_dir / "plans.sqlite") in helped


def test_upgrade_migrates_the_frozen_0001_file(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    shutil.copy(FROZEN_0001, path)
    url = f"sqlite:///{path}"
    refused = run_cli("list", "--url", url, cwd=tmp_path)
    assert f"python -m db upgrade --url {url}" in assert_one_line_error(refused)
    upgraded = run_cli("upgrade", "--url", url, "--json", cwd=tmp_path)
    assert json.loads(upgraded.stdout) == {"url": url, "from": "0001", "to": HEAD_REVISION}
    assert run_cli("list", "--url", url, cwd=tmp_path).returncode == 0


ERROR_CASES = [
    ("best", "--url", "sqlite:///{tmp}/missing/plans.sqlite", "--seq-len=1", "--head-dim=1"),
    ("best", "--url", "sqlite:///{tmp}/notes.txt", "--seq-len=1", "--head-dim=1"),
    ("best", "--url", "nosuchdriver://x", "--seq-len=1", "--head-dim=1"),
    ("best", "--seq-len", "4096"),  # no head_dim
    ("best", "--seq-len", "-5", "--head-dim", "64"),  # an argparse error, also one line
    ("import", "{tmp}/missing.json", "--url", "sqlite:///{tmp}/x.sqlite"),
    ("history", "--url", "sqlite:///{tmp}/x.sqlite", "--source-hash", "no-equals-sign"),
    ("frobnicate",),
]


def _fill(args: tuple[str, ...], tmp_path: Path) -> list[str]:
    (tmp_path / "notes.txt").write_text("not a database\n" * 100)
    return [a.replace("{tmp}", str(tmp_path)) for a in args]


@pytest.mark.parametrize("args", [ERROR_CASES[0], ERROR_CASES[4]])
def test_errors_in_a_subprocess_are_one_line_without_traceback(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    line = assert_one_line_error(run_cli(*_fill(args, tmp_path), cwd=tmp_path))
    assert "error" in line
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("args", ERROR_CASES)
def test_every_error_is_one_line_on_stderr_and_exits_non_zero(
    tmp_path: Path, args: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process (fast) for the whole list; the subprocess test above covers the real exit.
    try:
        status = main(_fill(args, tmp_path))
    except SystemExit as exit_:  # argparse exits itself
        status = exit_.code
    assert status not in (0, None)
    stderr = capsys.readouterr().err.strip().splitlines()
    assert len(stderr) == 1 and "error" in stderr[0]


def test_a_partial_environment_matches_on_the_fields_given(url: str, tmp_path: Path) -> None:
    shape = ("--seq-len=1024", "--head-dim=64", "--dtype=float32", "--url", url)
    found = run_cli("best", *shape, "--gpu-name", "NVIDIA H200", cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    assert "on NVIDIA H200: tiled tile_size=32" in found.stdout
    assert found.stderr.strip() == (
        "matching environments on gpu_name='NVIDIA H200'; the other 6 fields: any"
    )
    narrower = run_cli(
        "best", *shape, "--gpu-name", "NVIDIA H200", "--sm-count", "132", "--json", cwd=tmp_path
    )
    assert json.loads(narrower.stdout)["environment"]["gpu_name"] == "NVIDIA H200"
    assert "gpu_name='NVIDIA H200', sm_count=132; the other 5" in narrower.stderr
    other = run_cli("best", *shape, "--gpu-name", "NVIDIA H100", cwd=tmp_path)
    assert other.returncode == 3 and "no plan for 1x1x1024x64" in other.stdout
    history = run_cli("history", "--url", url, "--gpu-name", "NVIDIA H200", "--json", cwd=tmp_path)
    assert len(json.loads(history.stdout)) == 2


def test_import_of_a_missing_file_creates_no_registry(tmp_path: Path) -> None:
    done = run_cli(
        "import", str(tmp_path / "missing.json"), "--url", "sqlite:///x.sqlite", cwd=tmp_path
    )
    assert "cannot read export" in assert_one_line_error(done)
    assert list(tmp_path.iterdir()) == []


def test_best_looks_for_the_tuners_default_dtype(url: str, tmp_path: Path) -> None:
    # The tuner's default problem is bfloat16, so is `db best`'s: the float32 rows
    # here are found only with --dtype=float32.
    shape = ("--url", url, "--seq-len=1024", "--head-dim=64")
    assert run_cli("best", *shape, cwd=tmp_path).returncode == 3
    assert run_cli("best", *shape, "--dtype=float32", cwd=tmp_path).returncode == 0
    refused = run_cli("best", *shape, "--dtype=float64", cwd=tmp_path)
    assert refused.returncode != 0 and "float64" in refused.stderr
