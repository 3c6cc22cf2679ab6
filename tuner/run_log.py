"""The run's log file gets what the terminal got.

Hydra's job logging writes ``<job>.log`` in the run directory, but the tune
run talks to the terminal with ``print`` (its table would read badly with
log prefixes, twice). ``to_log_file(line)`` sends a line to the log files of
the root logger only (Hydra's file handler), so the run's log holds the
backend line, the study, the best-plan table and where the plan was stored.
Outside Hydra (a test, a script) there is no such handler and nothing happens.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "tuner"


def to_log_file(text: str) -> None:
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not handlers:
        return
    record = logging.getLogger(LOGGER_NAME).makeRecord(
        LOGGER_NAME, logging.INFO, __file__, 0, text, None, None
    )
    for handler in handlers:
        if record.levelno >= handler.level:
            handler.handle(record)
