"""Hydra's run directory: kept only when the run put something in it.

Hydra creates ``outputs/DATE/TIME/`` (its ``.hydra/`` copy of the config and
the job's log file) before the job starts, so a run refused for a bad value,
or one that only prints (``mode=plan``), would leave a directory of nothing
behind. ``remove_if_unused`` takes it away again when it holds nothing but
those (the log empty, unless the run was refused), and the parents it leaves
empty, up to (never including) the working directory. A sweep (``-m``) has a
directory of its own above its jobs' (``multirun/DATE/TIME/``, with Hydra's
``multirun.yaml``): ``remove_sweep_if_unused`` takes it away once every job's
has gone (``-m seq_len=1024,-5 mode=plan``).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

HYDRA_SUBDIR = ".hydra"
SWEEP_RECORD = "multirun.yaml"


def current() -> tuple[Path, str] | None:
    """(the run directory, the job's log file name) of the Hydra job running now, or None."""
    try:
        from hydra.core.hydra_config import HydraConfig

        config = HydraConfig.get()
    except (ImportError, ValueError):  # ValueError: no Hydra job is running
        return None
    return Path(config.runtime.output_dir), f"{config.job.name}.log"


def current_sweep() -> Path | None:
    """The sweep directory of the multirun job running now, or None (not a sweep)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        config = HydraConfig.get()
    except (ImportError, ValueError):
        return None
    if config.mode != RunMode.MULTIRUN:
        return None
    return Path(config.sweep.dir)


def remove_sweep_if_unused(directory: Path) -> bool:
    """Remove a sweep directory that holds nothing but Hydra's ``multirun.yaml``; True if so."""
    try:
        if {entry.name for entry in directory.iterdir()} - {SWEEP_RECORD}:
            return False
        (directory / SWEEP_RECORD).unlink(missing_ok=True)
        directory.rmdir()
    except OSError:
        return False
    _remove_empty_parents(directory.parent)
    return True


def remove_if_unused(directory: Path, log_name: str, *, failed: bool = False) -> bool:
    """Remove ``directory`` if it holds only Hydra's config copy and an empty log; True if so.

    ``failed``: the job was refused (a ``TunerError``); its log holds only lines the
    terminal showed before the error, and goes with the directory.
    """
    for handler in logging.getLogger().handlers:
        handler.flush()
    try:
        entries = {entry.name: entry for entry in directory.iterdir()}
        if not set(entries) <= {HYDRA_SUBDIR, log_name}:
            return False
        log = entries.get(log_name)
        if log is not None and (not log.is_file() or (log.stat().st_size > 0 and not failed)):
            return False
        hydra_copy = entries.get(HYDRA_SUBDIR)
        if hydra_copy is not None:
            if not hydra_copy.is_dir() or any(p.is_dir() for p in hydra_copy.iterdir()):
                return False
            shutil.rmtree(hydra_copy)
        if log is not None:
            log.unlink()
        directory.rmdir()
    except OSError:
        return False  # someone else's files, or no permission: leave it as it is
    _remove_empty_parents(directory.parent)
    return True


def _remove_empty_parents(directory: Path) -> None:
    try:
        cwd = Path.cwd().resolve()
        directory = directory.resolve()
    except OSError:
        return
    while directory != cwd and cwd in directory.parents:
        try:
            directory.rmdir()  # fails, and stops here, unless it is empty
        except OSError:
            return
        directory = directory.parent
