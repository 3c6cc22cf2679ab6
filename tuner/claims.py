"""Claims: how workers sharing one study measure exactly ``n_trials`` candidates, each once.

Any number of worker processes (one host or many, one GPU each) run the same
study on one storage. Before a trial sends its plan to the backend it
*claims* a slot by writing the user attribute ``claim = [number, plan_key]``
(one committed storage transaction), then reads the study back:

* a finished trial that counts (measured or failed) has the same plan:
  the trial reuses its result (``duplicate``), the backend is not asked;
* another running trial holds a claim on the same plan: the plan is being
  measured right now; the trial ends as a ``duplicate`` of it (FAIL, no
  value: the sampler learns nothing false) and the worker moves on;
* slots held (finished trials that count + live claims, its own included)
  are at most ``n_trials``: it measures;
* otherwise it withdraws its claim; if the finished trials already count
  ``n_trials`` the study is done (``surplus``), else it waits (randomised
  back-off) for a slot to free up and tries again.

Why this is exact. A claim is written, and committed, before the read that
decides on it, and every storage here is linearizable for these operations
(SQLite serialises its writers; PostgreSQL's READ COMMITTED shows a statement
every commit before it). Of any two trials that go ahead at the same time,
the later claimer's read therefore sees the earlier one's claim, so

* never more than ``n_trials`` trials hold a slot, hence at most
  ``n_trials`` ever count: a slot is only given up by a trial that ends
  without counting (interrupted, its worker died, withdrawn), and a trial
  that counts keeps its slot for good;
* never two trials measure the same plan unless one had finished first
  (then the other is a duplicate that reuses its result);
* workers stop only when the finished trials count ``n_trials`` (or on
  timeout, Ctrl-C, or when every candidate is evaluated), so a run that is
  not cut short ends with exactly ``n_trials``. Two trials that claim the
  same plan, or the last slot, at the same instant may both step back: the
  plan is proposed again later, the slot is retried after a back-off.

A claim is valid only in a RUNNING trial whose number it names: Optuna's
retry of a dead worker's trial copies the user attributes, and the copy must
claim its slot itself. A claim also names its owner (host, boot, PID
namespace, PID and the process's start time): a claim whose owner is on this
host and gone (a killed tuner, rerun at once) is dead at once. One from
another host stays until the heartbeat grace period fails its trial (see
``tuner.study_storage``); a worker waiting for a slot fails stale trials
itself, so the slot comes back. Either way the trial itself is failed, and
queued again, by the heartbeat check.
Trial numbers are Optuna's: assigned under a lock on the study row (RDB
storage), never twice.
"""

from __future__ import annotations

import enum
import functools
import os
import random
import socket
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import optuna
from optuna.storages import fail_stale_trials
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import bindparam, text

from tuner.trials import COUNTED_OUTCOMES

CLAIM_ATTR = "claim"
#: first back-off (seconds) of a trial waiting for a slot; doubles up to MAX_WAIT_S
FIRST_WAIT_S = 0.05
MAX_WAIT_S = 2.0


@dataclass
class Snapshot:
    """What the shared study says right now about slots and plans."""

    #: finished trials that count (measured or failed by the backend)
    counted: int = 0
    #: the first finished trial that counts, per plan key
    evaluated: dict[str, FrozenTrial] = field(default_factory=dict)
    #: plan key -> number of a running trial (other than the asker) holding a claim on it
    in_flight: dict[str, int] = field(default_factory=dict)
    #: running trials with a valid claim (the asker's own included)
    live_claims: int = 0

    @property
    def held(self) -> int:
        return self.counted + self.live_claims


def claim_of(trial: FrozenTrial) -> str | None:
    """The plan key ``trial`` holds a live claim on, if it is running and holds one."""
    if trial.state != TrialState.RUNNING:
        return None
    value = trial.user_attrs.get(CLAIM_ATTR)
    if not (isinstance(value, list) and len(value) >= 2 and value[0] == trial.number):
        return None
    if len(value) > 2 and owner_is_gone(str(value[2])):
        return None
    return str(value[1])


@functools.cache
def owner() -> str:
    """This process, as a claim names it: ``host|boot id|pid namespace|pid|start time``."""
    return "|".join((socket.gethostname(), *_machine(), str(os.getpid()), _started(os.getpid())))


def owner_is_gone(claimant: str) -> bool:
    """Whether ``claimant`` (see ``owner``) is a process of this machine that has ended.

    Only a process in this PID namespace of this boot of this host can be
    looked up; any other is taken to be alive (its heartbeat tells).
    """
    parts = claimant.split("|")
    if len(parts) != 5 or not parts[3].isdigit():
        return False
    host, boot, namespace, pid, started = parts
    if (host, boot, namespace) != (socket.gethostname(), *_machine()) or not boot:
        return False
    return _started(int(pid)) != started  # gone, a zombie, or the PID reused since


@functools.cache
def _machine() -> tuple[str, str]:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "", ""  # not Linux: no process is ever declared gone
    return boot, namespace


def _started(pid: int) -> str:
    """The process's start time in clock ticks since boot; "" if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return ""
    return "" if fields[0] in ("Z", "X") else fields[19]


def snapshot(trials: Iterable[FrozenTrial], own: int | None = None) -> Snapshot:
    result = Snapshot()
    for trial in trials:
        if trial.state.is_finished():
            # A FAIL trial never counts, whatever its attributes say (a worker that
            # died between writing its outcome and finishing the trial).
            if (
                trial.state != TrialState.FAIL
                and trial.user_attrs.get("outcome") in COUNTED_OUTCOMES
            ):
                result.counted += 1
                result.evaluated.setdefault(str(trial.user_attrs.get("plan_key")), trial)
            continue
        key = claim_of(trial)
        if key is None:
            continue
        result.live_claims += 1
        if trial.number != own:
            result.in_flight.setdefault(key, trial.number)
    return result


def read(study: optuna.Study, own: int | None = None) -> Snapshot:
    return snapshot(study.get_trials(deepcopy=False), own)


class Verdict(enum.Enum):
    GO = "go"  # measure: the trial holds a slot
    DUPLICATE = "duplicate"  # evaluated already: reuse ``earlier``
    IN_FLIGHT = "in_flight"  # trial ``other`` is measuring this plan now
    FULL = "full"  # the finished trials count n_trials: nothing left to do
    STOPPED = "stopped"  # asked to stop (Ctrl-C, timeout) while waiting for a slot


@dataclass(frozen=True)
class Claim:
    verdict: Verdict
    earlier: FrozenTrial | None = None
    other: int | None = None
    waited_s: float = 0.0


def acquire(
    study: optuna.Study,
    trial: optuna.Trial,
    key: str,
    n_trials: int,
    *,
    should_stop: Callable[[], bool] = lambda: False,
    deadline: float | None = None,
) -> Claim:
    """Claim a slot for measuring ``key`` in ``trial`` (see the module doc)."""
    started = time.monotonic()
    wait = FIRST_WAIT_S
    while True:
        trial.set_user_attr(CLAIM_ATTR, [trial.number, key, owner()])
        now = read(study, trial.number)
        waited = time.monotonic() - started
        earlier = now.evaluated.get(key)
        if earlier is not None:
            return Claim(Verdict.DUPLICATE, earlier=earlier, waited_s=waited)
        if key in now.in_flight:
            return Claim(Verdict.IN_FLIGHT, other=now.in_flight[key], waited_s=waited)
        if now.held <= n_trials:
            return Claim(Verdict.GO, waited_s=waited)
        trial.set_user_attr(CLAIM_ATTR, None)
        if now.counted >= n_trials:
            return Claim(Verdict.FULL, waited_s=waited)
        if should_stop() or (deadline is not None and time.monotonic() >= deadline):
            return Claim(Verdict.STOPPED, waited_s=waited)
        # A slot is held by a trial in flight; if its worker died, the heartbeat
        # grace period ends it, and someone has to look: waiting workers do.
        fail_stale(study)
        time.sleep(wait * random.uniform(0.5, 1.5))
        wait = min(2 * wait, MAX_WAIT_S)


def fail_stale(study: optuna.Study) -> None:
    """Fail (and queue retries of) trials whose heartbeat stopped, as Optuna does per trial,
    and trials that never recorded one (``fail_silent``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        fail_stale_trials(study)
        fail_silent(study)


def fail_silent(study: optuna.Study) -> list[int]:
    """Fail RUNNING trials that never recorded a heartbeat and started longer ago than the
    grace period; returns their numbers.

    Optuna's check looks only at trials with a heartbeat row. A worker killed between
    ``study.ask()`` and its heartbeat thread's first beat (milliseconds) leaves a trial
    with none, which it would keep RUNNING forever. Such a trial never reached the
    objective (the heartbeat starts first), so it measured nothing; it is failed and
    queued again as a stale one would be.
    """
    storage = study._storage
    # A study's storage is Optuna's cache in front of the RDB storage that has the settings.
    rdb = getattr(storage, "_backend", storage)
    interval = getattr(rdb, "heartbeat_interval", None)
    engine = getattr(rdb, "engine", None)
    if interval is None or engine is None:
        return []
    grace = timedelta(seconds=getattr(rdb, "grace_period", None) or 2 * interval)
    # Optuna stamps datetime_start with the writing host's local clock, as this is.
    now = datetime.now()
    old = {
        trial._trial_id: trial
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if trial.datetime_start is not None and now - trial.datetime_start > grace
    }
    if not old:
        return []
    with engine.connect() as connection:
        beating = {
            row[0]
            for row in connection.execute(
                text("SELECT trial_id FROM trial_heartbeats WHERE trial_id IN :ids").bindparams(
                    bindparam("ids", expanding=True)
                ),
                {"ids": list(old)},
            )
        }
    failed = []
    callback = storage.get_heartbeat_stale_trial_callback()
    for trial_id, trial in old.items():
        if trial_id in beating:
            continue  # Optuna's own check judges it by its heartbeat
        try:
            if not storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another worker failed it first
        failed.append(trial.number)
        if callback is not None:
            callback(study, storage.get_trial(trial_id))
    return failed
