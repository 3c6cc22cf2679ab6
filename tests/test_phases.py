"""tuner.phases: the wall time of a run by phase, and the line it prints."""

from __future__ import annotations

import time

from tuner.phases import PhaseClock, process_age_s


def test_phases_add_up_in_the_order_they_first_ran():
    clock = PhaseClock(start_up_s=1.25)
    with clock.phase("planning"):
        time.sleep(0.02)
    clock.add("search", 3.0)
    clock.add("planning", 0.5)
    clock.note("search", "9 trials, 0.33 s each")
    assert list(clock.seconds) == ["start-up", "planning", "search"]
    assert 0.52 <= clock.seconds["planning"] < 1.0
    assert clock.total == sum(clock.seconds.values())
    line = clock.line()
    assert line.startswith(f"time: {clock.total:.1f} s: 1.2 s start-up, 0.5 s planning, ")
    assert line.endswith("3.0 s search (9 trials, 0.33 s each)")


def test_without_a_start_up_the_clock_starts_with_the_run():
    assert PhaseClock().line() == "time: 0.0 s: "
    assert "start-up" not in PhaseClock().seconds


def test_this_process_has_an_age():
    age = process_age_s()
    assert age is None or 0.0 < age < 24 * 3600
