"""Launch a plan's kernels from a compiled cubin on torch's current stream, through the CUDA
driver (``kernels.cuda_driver``): what the bench scripts that compare cubins use instead of
a backend. Torch owns the memory and the stream; no pycuda.

    launcher = DriverLauncher(cubin_bytes, launches)   # KernelLaunch values, any arguments
    launcher()                                          # queues them; raises on a refusal
"""

from __future__ import annotations

from typing import Any

from kernels.cuda_driver import CudaDriver, ctypes_argument, pack_launch
from tuner.planner.launches import KernelLaunch, TensorMap


class DriverLauncher:
    """The launches of one run, loaded and packed once; calling it queues them."""

    def __init__(self, driver: CudaDriver, cubin: bytes, launches: tuple[KernelLaunch, ...],
                 stream: int) -> None:
        self.driver = driver
        self.module = driver.load_module(cubin)
        self._alive: list[Any] = []  # the ctypes objects the bound calls point at
        self._calls = []
        for launch in launches:
            function = driver.get_function(self.module, launch.function)
            if launch.needs_shared_opt_in:
                driver.set_max_dynamic_shared(function, launch.shared_bytes)
            arguments = []
            for value in launch.args:
                if isinstance(value, TensorMap):
                    self._alive.append(driver.encode_tensor_map(value))
                    arguments.append(self._alive[-1].value)
                else:
                    arguments.append(ctypes_argument(value))
            packed = pack_launch(launch.function, function, launch.grid, launch.block,
                                 launch.shared_bytes, arguments)
            self._alive.append(packed)
            self._calls.append((launch.function, driver.bind_launch(packed, stream)))

    def __call__(self) -> None:
        for name, call in self._calls:
            status = call()
            if status:
                raise RuntimeError(f"{name}: {self.driver.error_string(status)}")

    def close(self) -> None:
        self.driver.unload_module(self.module)
