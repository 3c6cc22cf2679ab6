"""Command-line entry: ``python -m tuner seq_len=4096 head_dim=128 [key=value ...]``, or
``python -m tuner model=llama-3.1-8b [key=value ...]`` for every problem of a model.

Any error the user can fix is printed as one line, ``error: <message>``, on
stderr, and the run exits with status 1, writing nothing. There are
three sources of such errors:

* Hydra's composition of ``tuner/conf/`` (unknown key, unknown group option, a value
  a typed field cannot take, a malformed override). Hydra's ``run_and_report``
  would print these over several lines with a hint about ``HYDRA_FULL_ERROR``;
  with that variable set to 1 it re-raises them instead, so ``main`` sets it
  for the duration of the run, catches them and renders them here.
* ``tuner.config`` (missing value, value out of range, no feasible plan).
* ``TunerError`` from the tune run itself (unreachable registry, ...).

The last two are caught inside the job, so a multirun sweep goes on with its
other jobs; the exit status is the worst of all jobs run in this process. A
job that a launcher runs in another process (joblib, submitit) raises
``tuner.sweeps.JobFailed`` instead, which Hydra carries back, so the exit
status is non-zero there too.
Set ``HYDRA_FULL_ERROR=1`` yourself to get tracebacks instead of one-liners.
Errors that are bugs (anything else) keep their traceback.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path


def _drop_working_directory() -> None:
    """Take the working directory off ``sys.path`` unless the tuner runs from there.

    ``python -m`` puts it first; a ``db/`` or ``kernels/`` directory of the user's
    there (an old run's ``db/plans.sqlite``, say) would then shadow the installed
    package of that name. Kept when the packages themselves live there (a checkout
    run in place).
    """
    here = Path(__file__).resolve().parent.parent
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the working directory was removed: it can shadow nothing
        cwd = None
    if cwd == here:
        return
    sys.path[:] = [
        entry for entry in sys.path if entry != "" and (cwd is None or _resolved(entry) != cwd)
    ]


def _resolved(entry: str) -> Path | None:
    try:
        return Path(entry).resolve()
    except OSError:
        return None


_drop_working_directory()

import hydra
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from tuner import run_directory, termination
from tuner.broken_pipe import quiet_exit_status
from tuner.config import (
    ValidatedConfig,
    allowed_values,
    format_value,
    invalid_message,
    model_selected,
    typed_config,
    unknown_key_message,
    validate,
)
from tuner.dry_run import print_plan_space
from tuner.errors import TunerError
from tuner.llm.listing import print_model_plan
from tuner.llm.validation import ValidatedModel, validate_model
from tuner.sweeps import JobFailed, in_launcher_process, job_overrides, mark_main_process, restore
from tuner.termination import sigterm_as_ctrl_c

#: ``tuner/conf``, shipped inside the package (package data), made absolute: Hydra resolves a
#: relative path against the file only when this module runs as ``__main__``; imported (a
#: console script, a test) it would look for a ``conf`` package instead.
CONF_DIR = str(Path(__file__).resolve().parent / "conf")
_FULL_ERROR = "HYDRA_FULL_ERROR"
#: exit status of each job this process ran (several under ``--multirun``)
_job_statuses: list[int] = []
#: the user asked for tracebacks (HYDRA_FULL_ERROR=1 before we set it)
_tracebacks_wanted = False
#: jobs this process started (an error before the first is Hydra's set-up or the launcher's)
_jobs_started = 0
#: the sweep directories of the jobs run here: removed at the end if no job used them
_sweep_directories: set[Path] = set()
#: packages whose errors are a sweep launcher's (its scheduler missing, ...), not the tuner's
_LAUNCHER_PACKAGES = ("submitit", "hydra_plugins", "joblib")


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def run_job(cfg: DictConfig) -> int:
    """One Hydra job: validate the composed config, then plan or tune.

    The run directory Hydra made for the job goes again when the job put
    nothing in it (refused values, ``mode=plan``; see ``tuner.run_directory``).
    """
    global _jobs_started
    _jobs_started += 1
    refused = True
    try:
        config = typed_config(cfg)
        if model_selected(config):
            status = dispatch_model(validate_model(config))
        else:
            status = dispatch(validate(config))
        refused = False
    except TunerError as error:
        if _tracebacks_wanted:
            raise
        report(str(error))
        status = 1
    except BrokenPipeError:
        # The reader of stdout went away (``| head -1``): quiet, as a Unix tool.
        status = quiet_exit_status()
        refused = False
    finally:
        job = run_directory.current()
        if job is not None:
            run_directory.remove_if_unused(*job, failed=refused)
        sweep = run_directory.current_sweep()
        if sweep is not None and not in_launcher_process():
            _sweep_directories.add(sweep.resolve())
    _job_statuses.append(status)
    if status != 0 and in_launcher_process():
        raise JobFailed(status, job_overrides())
    return status


def dispatch(validated: ValidatedConfig) -> int:
    if validated.config.mode == "plan":
        print_plan_space(validated)
        return 0
    # Imported here: the tune run pulls in Optuna, the database and the backends,
    # none of which validation or plan mode needs.
    from tuner.app import run
    from tuner.phases import PhaseClock, process_age_s

    # The first job's clock starts with the process (imports, composition); a later
    # job of a sweep in this process starts with its own run.
    clock = PhaseClock(start_up_s=process_age_s() if _jobs_started == 1 else None)
    return run(validated, clock=clock)


def dispatch_model(validated: ValidatedModel) -> int:
    if validated.config.mode == "plan":
        print_model_plan(validated)
        return 0
    from tuner.llm.run import run_model

    return run_model(validated)


def report(message: str) -> None:
    """Print ``message`` as the one ``error:`` line on stderr, whatever it contains."""
    line = " ".join(message.split()) or "unknown error"
    print(f"error: {line}", file=sys.stderr, flush=True)


def main() -> int:
    global _tracebacks_wanted, _jobs_started
    _job_statuses.clear()
    _jobs_started = 0
    previous = os.environ.get(_FULL_ERROR)
    _tracebacks_wanted = previous == "1"
    os.environ[_FULL_ERROR] = "1"
    main_pid = mark_main_process()
    try:
        with sigterm_as_ctrl_c():
            run_job()
    except JobFailed as failed:
        return max([failed.status, *_job_statuses])
    except (HydraException, OmegaConfBaseException) as error:
        if _tracebacks_wanted:
            raise
        report(describe_composition_error(error, sys.argv[1:]))
        return 1
    except KeyboardInterrupt:
        report(f"interrupted ({termination.cause()})")
        return termination.exit_status()
    except BrokenPipeError:
        return quiet_exit_status()
    except OSError as error:
        # Before any job: Hydra could not create the run directory or its log, or
        # the working directory is gone. Inside a job an OSError is a bug.
        if _tracebacks_wanted or _jobs_started:
            raise
        report(describe_setup_error(error))
        return 1
    except Exception as error:
        if _tracebacks_wanted or not _raised_by_launcher(error):
            raise
        report(describe_launcher_error(error, sys.argv[1:]))
        return 1
    finally:
        for sweep in _sweep_directories:
            run_directory.remove_sweep_if_unused(sweep)
        _sweep_directories.clear()
        restore(main_pid)
        if previous is None:
            os.environ.pop(_FULL_ERROR, None)
        else:
            os.environ[_FULL_ERROR] = previous
    return max(_job_statuses, default=0)


def describe_composition_error(error: Exception, arguments: Sequence[str]) -> str:
    """One line for an error Hydra or OmegaConf raised while composing the config.

    ``arguments`` are the command-line arguments, searched for the text the user
    gave for the key at fault (Hydra's exceptions carry the key, not always the value).
    """
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        group, _, option = error.missing_cfg_file.rpartition("/")
        # base_* are the schemas the options build on, not options to pick.
        options = [o for o in error.options or [] if not o.startswith("base_")]
        if group and options:
            return (
                f"{group}={option} is invalid: no such {group} option; "
                f"allowed: {', '.join(options)}"
            )
        return _first_line(error)
    if isinstance(error, OverrideParseException):
        return f"{error.override} is not a valid override: {_first_line(error.message)}"
    cause = error.__cause__ if isinstance(error.__cause__, OmegaConfBaseException) else error
    full_key = getattr(cause, "full_key", None)
    if not isinstance(cause, OmegaConfBaseException) or not full_key:
        return _first_line(error)
    key = re.sub(r"(\[\d+\])+$", "", full_key)
    given = _given_values(arguments)
    if allowed_values(key) is None and key not in given:
        # An unknown section (``serach.n_trials=5``): Hydra names the section only;
        # the user wrote, and may have misspelt, the whole key.
        written = next((k for k in given if k.startswith(f"{key}.")), None)
        if written is not None:
            return unknown_key_message(written, given[written])
    value = getattr(cause, "value", None)
    # A list element's value alone would misquote the list the user wrote.
    if key != full_key or value is None:
        text = given.get(key, format_value(value))
    else:
        text = format_value(value)
    if allowed_values(key) is None:
        return unknown_key_message(key, text)
    return invalid_message(key, text)


def describe_setup_error(error: OSError) -> str:
    """One line for a file-system error Hydra met while setting up the run."""
    if isinstance(error, FileNotFoundError) and error.filename is None:
        return "the working directory no longer exists: cd to an existing directory and rerun"
    where = error.filename or "the run directory"
    return (
        f"cannot create {where}: {error.strerror or error}; run from a writable directory "
        "or set hydra.run.dir=<writable directory> (hydra.sweep.dir for -m)"
    )


def describe_launcher_error(error: Exception, arguments: Sequence[str]) -> str:
    """One line for a sweep launcher that could not run the jobs (its scheduler is absent)."""
    launcher = _given_values(arguments).get("hydra/launcher", "the launcher")
    return (
        f"hydra/launcher={launcher} cannot run the sweep: {_first_line(error)} "
        "(leave hydra/launcher out to run the jobs here, one after another)"
    )


def _raised_by_launcher(error: BaseException) -> bool:
    """Whether ``error`` was raised inside a launcher plugin or the scheduler client."""
    traceback = error.__traceback__
    innermost = None
    while traceback is not None:
        innermost = traceback.tb_frame
        traceback = traceback.tb_next
    if innermost is None:
        return False
    module = innermost.f_globals.get("__name__", "")
    return module.split(".")[0] in _LAUNCHER_PACKAGES


def _given_values(arguments: Sequence[str]) -> dict[str, str]:
    """``key -> value text`` of the ``key=value`` overrides among ``arguments``."""
    given: dict[str, str] = {}
    for argument in arguments:
        if argument.startswith("-") or "=" not in argument:
            continue
        key, _, value = argument.partition("=")
        key = key.lstrip("+~").split("@")[0]
        given[key] = value
    return given


def _first_line(error: object) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
