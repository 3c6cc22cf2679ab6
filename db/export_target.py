"""Where ``python -m db export PATH`` writes: a file (through any links), a stream, or stdout.

* ``-`` is standard output, as for other Unix tools;
* a symbolic link is followed: its target is written, the link stays a link
  (``/dev/stdout`` is a link to ``/proc/self/fd/1``);
* a regular file, or a missing one, is written to a temporary file beside the
  target and renamed over it, so a reader never sees half a file and a failed
  write leaves the old one as it was and no temporary file behind;
* anything else that can be opened for writing (a terminal, a pipe, a FIFO,
  ``/dev/null``) is written directly: it cannot be renamed over, and must not be;
* a directory is refused before anything is written.

Failures are one-line ``RegistryError``s naming the path.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path

from tuner.errors import RegistryError

STDOUT = "-"


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` as the module doc says."""
    if str(path) == STDOUT:
        _write_stream(text)
        return
    given = Path(path)
    try:
        mode = given.stat().st_mode  # through every link, /proc's magic ones included
    except FileNotFoundError:
        mode = None  # missing, or a link to a missing file: created (at the link's target)
    except OSError as error:
        raise _cannot(given, error) from error
    if mode is not None and stat.S_ISDIR(mode):
        raise RegistryError(f"cannot write export {given}: it is a directory; name a file in it")
    if mode is not None and not stat.S_ISREG(mode):
        _write_device(given, text)
        return
    # realpath only here: a pipe behind /proc/self/fd/1 has no path to resolve to.
    _replace_file(given, Path(os.path.realpath(given)), text, mode)


def is_standard_output(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is this process's standard output (``-``, ``/dev/stdout``, or its file):
    a summary printed there would land inside the export."""
    if str(path) == STDOUT:
        return True
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError):
        return False


def _write_stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _write_device(given: Path, text: str) -> None:
    try:
        with open(given, "w") as stream:
            stream.write(text)
    except OSError as error:
        raise _cannot(given, error) from error


def _replace_file(given: Path, target: Path, text: str, mode: int | None) -> None:
    directory = target.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(
            dir=directory, prefix=f".{target.name}.", suffix=".partial"
        )
    except OSError as error:
        raise _cannot(given, error) from error
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
        # mkstemp makes the file private (0600): give it the mode the file had, or the
        # mode a plain new file would get.
        os.chmod(temporary, stat.S_IMODE(mode) if mode is not None else _new_file_mode())
        os.replace(temporary, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise _cannot(given, error) from error
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _cannot(given: Path, error: OSError) -> RegistryError:
    return RegistryError(f"cannot write export {given}: {error.strerror or error}")
