"""``... | head -1``: a reader that stops reading ends the command quietly, as Unix tools end.

Both commands write more than a pipe holds (64 KiB on Linux), so the write after
the reader has gone fails for certain: status 141 (128 + SIGPIPE, what a shell
reports for a tool SIGPIPE killed), nothing on stderr, no run directory left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from db import PlanRecord, PlanRegistry
from db.transfer import FORMAT_NAME, FORMAT_VERSION, plan_to_dict
from tuner.broken_pipe import EXIT_BROKEN_PIPE
from tuner.environment import Environment
from tuner.problem import Problem

PIPE_BYTES = 64 * 1024


def first_line_then_close(arguments: list[str], cwd: Path) -> tuple[int, str, str]:
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)
    process = subprocess.Popen(
        [sys.executable, *arguments],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stderr is not None
    line = process.stdout.readline()
    process.stdout.close()  # the reader goes away, as head does after its line
    stderr = process.stderr.read()
    return process.wait(timeout=120), line, stderr


def test_plan_mode_into_head_exits_quietly(tmp_path: Path) -> None:
    arguments = ["-m", "tuner", "mode=plan", "seq_len=4096", "head_dim=128", "plan_rows=0"]
    status, line, stderr = first_line_then_close(arguments, tmp_path)
    assert line.startswith("problem: 1x1x4096x128 bfloat16 full")
    assert stderr == ""
    assert status == EXIT_BROKEN_PIPE == 141
    assert list(tmp_path.iterdir()) == []  # no run directory


def test_the_plan_table_is_more_than_a_pipe_holds(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tuner", "mode=plan", "seq_len=4096", "head_dim=128", "plan_rows=0"],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0 and len(done.stdout) > PIPE_BYTES


def test_db_list_into_head_exits_quietly(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    environment = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61")
    created = datetime(2026, 12, 1, tzinfo=UTC)
    plans = [
        plan_to_dict(
            Problem(16 * (n + 1), 64),
            environment,
            PlanRecord("scalar_online", {"threads": 128}, "x", True, median_ms=0.5 + n),
            created,
        )
        for n in range(1200)
    ]
    export = tmp_path / "plans.json"
    document = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "plans": plans}
    export.write_text(json.dumps(document))
    with PlanRegistry.open(url) as registry:
        assert registry.import_(export).added == 1200
    listed = subprocess.run(
        [sys.executable, "-m", "db", "list", "--url", url], capture_output=True, timeout=120
    )
    assert listed.returncode == 0 and len(listed.stdout) > PIPE_BYTES
    status, line, stderr = first_line_then_close(["-m", "db", "list", "--url", url], tmp_path)
    assert line.startswith("#1 1x1x16x64 float32 full on NVIDIA H200: scalar_online")
    assert stderr == ""
    assert status == EXIT_BROKEN_PIPE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans.json", "plans.sqlite"]
