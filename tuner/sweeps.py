"""Hydra multirun sweeps: every job's failure reaches the command's exit status.

    python -m tuner -m seq_len=1024,2048,4096 head_dim=64,128                   # one by one
    python -m tuner -m seq_len=1024,2048,4096 head_dim=64,128 hydra/launcher=joblib
    python -m tuner -m seq_len=1024,2048,4096 head_dim=64,128 hydra/launcher=slurm_h200

Each job tunes one shape into the registry (its own study). The basic
launcher runs the jobs in this process, where ``tuner.__main__`` collects
their exit statuses. Other launchers run them elsewhere (joblib: worker
processes; submitit: SLURM jobs), and Hydra hands the main process only the
jobs' return values, which ``hydra.main`` drops. So a job that fails in
another process raises ``JobFailed``: the launcher carries the exception back,
Hydra's sweeper re-raises the first one after the batch (every job has run by
then; Hydra prints ``Error executing job with overrides: [...]``), and the
main process exits with its status. The job itself has already printed its
one ``error:`` line.
"""

from __future__ import annotations

import os

#: the pid of the process that ran ``tuner.__main__.main``; launchers' worker
#: processes inherit it through the environment
MAIN_PID_VARIABLE = "TUNER_MAIN_PID"


class JobFailed(Exception):
    """A sweep job, run outside the main process, ended with a non-zero status."""

    def __init__(self, status: int, overrides: str = "") -> None:
        super().__init__(status, overrides)
        self.status = status
        self.overrides = overrides

    def __str__(self) -> str:
        return f"job {self.overrides or '(no overrides)'} ended with status {self.status}"


def mark_main_process() -> str | None:
    """Note this process as the main one; returns the previous value to restore."""
    previous = os.environ.get(MAIN_PID_VARIABLE)
    os.environ[MAIN_PID_VARIABLE] = str(os.getpid())
    return previous


def restore(previous: str | None) -> None:
    if previous is None:
        os.environ.pop(MAIN_PID_VARIABLE, None)
    else:
        os.environ[MAIN_PID_VARIABLE] = previous


def in_launcher_process() -> bool:
    """Whether this job runs outside the main process (a joblib worker, a SLURM job)."""
    main = os.environ.get(MAIN_PID_VARIABLE)
    return main is not None and main != str(os.getpid())


def job_overrides() -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        return " ".join(HydraConfig.get().overrides.task)
    except (ImportError, ValueError):
        return ""
