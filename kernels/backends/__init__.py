"""Backends: what turns a kernel plan into a ``Measurement`` (see ``base``).

``make_backend`` builds one by name; ``choose_backend`` resolves ``auto`` (PyCUDA
when a CUDA device answers, else the cost model) and says why in one line.
Importing this package loads no GPU code: ``pycuda_backend`` is imported only
when a PyCUDA backend is built, and ``detect_cuda`` asks a short-lived
subprocess, because a parent that initialised CUDA could no longer start
measurement workers safely (a forked CUDA context is unusable, and the device
would hold one context per process).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernels.backends.base import Backend, Failure, Measurement
from tuner.device import H200, DeviceProfile
from tuner.errors import BackendError, ConfigError

if TYPE_CHECKING:
    # Only the type: a deployment imports kernels without Hydra's config stack.
    from tuner.config import BackendConfig

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "BackendChoice",
    "BackendFactory",
    "Failure",
    "Measurement",
    "choose_backend",
    "detect_cuda",
    "make_backend",
]

BACKEND_NAMES = ("pycuda", "model", "replay")
#: seconds the CUDA probe may take (driver start-up on a cold machine is a few seconds)
PROBE_TIMEOUT_S = 60.0

_PROBE = """
import sys
import pycuda.driver as drv
drv.init()
count = drv.Device.count()
ordinal = int(sys.argv[1])
if ordinal >= count:
    print(f"NO CUDA device {ordinal} requested but {count} visible")
else:
    print("OK " + drv.Device(ordinal).name())
"""


def detect_cuda(device_ordinal: int = 0, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when pycuda imports and CUDA device ``device_ordinal`` answers; else why not.

    The probe runs in a subprocess so that this process never initialises CUDA.
    """
    if importlib.util.find_spec("pycuda") is None:
        return "pycuda not installed"
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, str(device_ordinal)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"the CUDA probe did not answer within {timeout_s:.0f} s"
    except OSError as error:
        return f"cannot start the CUDA probe: {error}"
    answer = probe.stdout.strip().splitlines()[-1:] or [""]
    if probe.returncode == 0 and answer[0].startswith("OK "):
        return None
    if answer[0].startswith("NO "):
        return answer[0][3:]
    errors = [line.strip() for line in probe.stderr.splitlines() if line.strip()]
    last = errors[-1] if errors else f"probe exited with status {probe.returncode}"
    # "pycuda._driver.LogicError: cuInit failed: no CUDA-capable device is detected"
    return last.split(": ", 1)[1] if ": " in last and "Error" in last.split(": ")[0] else last


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """The backend a run uses and why, for the one line the run prints about it."""

    name: str
    reason: str

    def line(self, measured: bool) -> str:
        if measured:
            what = "results are GPU timings, stored as measured"
        else:
            what = "results are predictions, stored as predicted"
        return f"backend: {self.name} ({self.reason}) - {what}"


def choose_backend(config: BackendConfig, device_ordinal: int = 0) -> BackendChoice:
    """Resolve ``config.name`` (``auto`` probes for a CUDA device) to a concrete backend."""
    if config.name == "auto":
        missing = detect_cuda(device_ordinal)
        if missing is None:
            return BackendChoice("pycuda", f"auto: CUDA device {device_ordinal} answers")
        return BackendChoice("model", f"auto: no CUDA device: {missing}")
    if config.name == "replay":
        return BackendChoice("replay", f"asked for; file {config.replay_path}")
    if config.name in BACKEND_NAMES:
        return BackendChoice(config.name, "asked for")
    raise ConfigError(
        f"backend={config.name} is invalid: allowed: auto, {', '.join(BACKEND_NAMES)}"
    )


def make_backend(
    name: str, config: BackendConfig, device_ordinal: int = 0, *, device: DeviceProfile = H200
) -> Backend:
    """Build the backend ``name`` (not ``auto``: see ``choose_backend``).

    ``device`` is the profile the model backend predicts for; the PyCUDA
    backend reads the live device instead.
    """
    if name == "model":
        from kernels.backends.model import ModelBackend

        return ModelBackend(device)
    if name == "replay":
        from kernels.backends.replay import ReplayBackend

        if not config.replay_path:
            raise ConfigError("backend=replay needs backend.replay_path=<recorded JSON file>")
        return ReplayBackend(config.replay_path)
    if name == "pycuda":
        if importlib.util.find_spec("pycuda") is None:
            raise BackendError(
                "backend=pycuda: pycuda is not installed "
                "(pip install 'flash-attention-tuner[cuda]')"
            )
        from kernels.backends.pycuda_backend import PyCudaBackend

        return PyCudaBackend(
            device_ordinal,
            cache_dir=config.cache_dir,
            repetitions=config.repetitions,
            warmup=config.warmup,
            flush_l2=config.flush_l2,
        )
    raise ConfigError(f"backend={name} is invalid: allowed: {', '.join(BACKEND_NAMES)}")


@dataclass(frozen=True)
class BackendFactory:
    """A picklable recipe for a backend: what an isolated worker process builds its own from."""

    name: str
    config: BackendConfig
    device_ordinal: int = 0
    device: DeviceProfile = H200

    def __call__(self) -> Backend:
        return make_backend(self.name, self.config, self.device_ordinal, device=self.device)
