"""``python -m db export PATH``: through links, ``-`` as standard output, nothing left on failure.

A new user ran ``python -m db export /dev/stdout`` as root and the system's
``/dev/stdout`` link became a regular file: the export was written beside the
path and renamed over it. These tests make links of their own (to a file, to a
missing file, to ``/proc/self/fd/1``) and check that the link stays a link.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from db import PlanRecord, PlanRegistry
from db.cli import main
from tuner.environment import Environment
from tuner.problem import Problem

ENV = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "2025.1.2")


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'registry' / 'plans.sqlite'}"
    with PlanRegistry.open(url) as registry:
        for seq_len, tile in ((1024, 32), (2048, 64)):
            record = PlanRecord("tiled", {"tile_size": tile}, "x", False, 0.1)
            registry.record(Problem(seq_len, 64), ENV, record)
    return url


def plans_in(text: str) -> int:
    document = json.loads(text)
    assert document["format"] == "flash-attention-tuner/plan-registry"
    return len(document["plans"])


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_link_to_a_file_is_written_through_and_stays_a_link(url: str, tmp_path: Path) -> None:
    target = tmp_path / "out" / "real.json"
    target.parent.mkdir()
    target.write_text("old\n")
    os.chmod(target, 0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert main(["export", str(link), "--url", url]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert plans_in(target.read_text()) == 2
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the file keeps its mode
    assert listing(target.parent) == ["real.json"]  # no temporary file left


def test_a_dangling_link_creates_its_target(url: str, tmp_path: Path) -> None:
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "made.json")
    assert main(["export", str(link), "--url", url]) == 0
    assert link.is_symlink() and plans_in((tmp_path / "made.json").read_text()) == 2


def test_a_dash_is_standard_output(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["export", "-", "--url", url]) == 0
    captured = capsys.readouterr()
    assert plans_in(captured.out) == 2
    assert captured.err == "exported 2 plans\n"  # the summary stays out of the export
    assert not (tmp_path / "-").exists()


def test_a_link_to_the_process_s_stdout_streams_into_the_pipe(url: str, tmp_path: Path) -> None:
    """What ``/dev/stdout`` is: a link to ``/proc/self/fd/1``, here a pipe."""
    if not Path("/proc/self/fd/1").exists():
        pytest.skip("no /proc/self/fd")
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")
    done = subprocess.run(
        [sys.executable, "-m", "db", "export", str(link), "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert plans_in(done.stdout) == 2
    assert done.stderr == "exported 2 plans\n"
    assert link.is_symlink() and os.readlink(link) == "/proc/self/fd/1"
    assert listing(tmp_path) == ["registry", "stdout"]


def test_a_character_device_is_written_not_replaced(url: str, tmp_path: Path) -> None:
    link = tmp_path / "null"
    link.symlink_to(os.devnull)
    assert main(["export", str(link), "--url", url]) == 0
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    assert link.is_symlink()


def test_an_existing_file_is_replaced_whole(url: str, tmp_path: Path) -> None:
    out = tmp_path / "plans.json"
    out.write_text("x" * 100_000)
    assert main(["export", str(out), "--url", url]) == 0
    assert plans_in(out.read_text()) == 2
    assert listing(tmp_path) == ["plans.json", "registry"]
