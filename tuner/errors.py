"""The project's one root exception for run-level errors.

A run-level error is something the user can fix (a bad value, an unreachable
registry, a database from a newer schema). The CLI prints ``str(error)`` as one
line on stderr and exits non-zero; it never prints a traceback for these.
Per-trial failures are *values* (see ``kernels.backends.base.Failure``), never
exceptions of this class.
"""

from __future__ import annotations


class TunerError(Exception):
    """Root of every error the tuner raises on purpose."""


class ConfigError(TunerError):
    """A configuration value is missing, malformed or out of range."""


class RegistryError(TunerError):
    """The plan registry cannot be opened, read or written."""


class BackendError(TunerError):
    """A backend cannot start at all (not a per-candidate failure)."""
