"""Where the tuner keeps its databases unless told otherwise: a per-user data directory.

    $FLASH_ATTENTION_TUNER_DATA_DIR                         when set (any platform)
    $XDG_DATA_HOME/flash-attention-tuner                    when XDG_DATA_HOME is an absolute path
    ~/.local/share/flash-attention-tuner                    Linux and other POSIX systems
    ~/Library/Application Support/flash-attention-tuner     macOS
    %LOCALAPPDATA%\\flash-attention-tuner                    Windows

The registry is ``plans.sqlite`` there and the Optuna studies ``studies.sqlite``
beside it; ``registry.url`` and ``search.storage`` (or ``--url`` for
``python -m db``) point elsewhere. Not the working directory: a ``db/``
directory created there would shadow the installed ``db`` package for the
next run started from it, and results would scatter over wherever the tuner
happened to be started. The rules follow the XDG base directory spec (as the
``platformdirs`` package does) without depending on it. The directory is
created by the first writer, never by a reader.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

APP_DIR_NAME = "flash-attention-tuner"
#: overrides every other rule: the directory the databases live in
DATA_DIR_VARIABLE = "FLASH_ATTENTION_TUNER_DATA_DIR"
REGISTRY_FILE = "plans.sqlite"
STUDIES_FILE = "studies.sqlite"


def data_dir() -> Path:
    """The per-user data directory (absolute; not created here)."""
    override = os.environ.get(DATA_DIR_VARIABLE, "")
    if override:
        return Path(override).expanduser().absolute()
    xdg = os.environ.get("XDG_DATA_HOME", "")
    # The spec says a relative XDG_DATA_HOME is invalid and must be ignored.
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / APP_DIR_NAME
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / APP_DIR_NAME
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / APP_DIR_NAME
    return Path.home() / ".local" / "share" / APP_DIR_NAME


def sqlite_url(path: Path) -> str:
    """``sqlite:///`` + the absolute POSIX path (four slashes on POSIX)."""
    return f"sqlite:///{path.absolute().as_posix()}"


def default_registry_file() -> Path:
    return data_dir() / REGISTRY_FILE


def default_registry_url() -> str:
    """The registry's default SQLAlchemy URL: ``plans.sqlite`` in ``data_dir()``."""
    return sqlite_url(default_registry_file())


def default_studies_url() -> str:
    """Optuna storage for a registry that is not a local SQLite file."""
    return sqlite_url(data_dir() / STUDIES_FILE)
