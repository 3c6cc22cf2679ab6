"""The CUDA driver calls of the deploy path, through ctypes: load a cubin, launch on any stream.

Why not PyCUDA here: PyCUDA launches only on its own ``Stream`` objects (not on a raw handle
such as torch's current stream, so not inside a torch CUDA-graph capture either), and its
``Function.__call__`` packs the arguments on every call (about 9 us per launch on an H200).
``cuLaunchKernel`` through ctypes takes a raw stream and arguments packed once:
``PackedLaunch`` keeps one ctypes object per kernel argument and the ``void**`` array that points
at them, so a call writes the addresses that changed (q, k, v, out) into their objects and calls
the driver with objects made once (``CudaDriver.bind_launch``), converting nothing.

Import-safe anywhere (no CUDA call until a ``CudaDriver`` is made); the library is loaded once.
Kernels launch in the calling thread's current context; ``kernels.backends.pycuda_attention``
loads the modules in the device's primary context (torch's) and makes it current where needed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels import tensor_maps
from tuner.errors import BackendError
from tuner.planner.launches import TensorMap

#: CUfunction_attribute CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (cuda.h)
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
#: CUresult CUDA_ERROR_INVALID_CONTEXT: no context is current in the calling thread
CUDA_ERROR_INVALID_CONTEXT = 201


@functools.cache
def libcuda() -> Any | None:
    """The driver library, initialised (loaded already where pycuda or torch run); None where
    absent."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll", ctypes.util.find_library("cuda")):
        if not name:
            continue
        with contextlib.suppress(OSError):
            library = ctypes.CDLL(name)
            library.cuInit(0)  # idempotent; every other call needs an initialised driver
            return library
    return None


@dataclass(frozen=True, slots=True)
class PackedLaunch:
    """One kernel launch with its arguments packed for ``cuLaunchKernel``.

    ``arguments``: one ctypes object per kernel parameter (pointer arguments may be shared
    between launches: writing one object's ``value`` changes every launch that points at it);
    ``params``: the ``void*[]`` of their addresses, what ``cuLaunchKernel`` reads.
    """

    name: str
    function: int  # CUfunction
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    arguments: tuple[Any, ...]
    params: Any

    def values(self) -> tuple[np.uintp | np.int32 | np.float32 | bytes, ...]:
        """The arguments as the kernel sees them, typed like ``KernelLaunch.args`` (a TMA
        descriptor as its 128 bytes)."""
        typed = {ctypes.c_void_p: np.uintp, ctypes.c_int32: np.int32, ctypes.c_float: np.float32}
        return tuple(
            bytes(a) if isinstance(a, ctypes.Array) else typed[type(a)](a.value or 0)
            for a in self.arguments
        )


def ctypes_argument(value: Any) -> Any:
    """A kernel argument of ``KernelLaunch.args`` as the ctypes object the kernel reads."""
    if isinstance(value, np.uintp):
        return ctypes.c_void_p(int(value))
    if isinstance(value, np.int32):
        return ctypes.c_int32(int(value))
    if isinstance(value, np.float32):
        return ctypes.c_float(float(value))
    raise TypeError(f"kernel argument {value!r} of type {type(value).__name__} is not packable")


def pack_launch(
    name: str,
    function: int,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    shared_bytes: int,
    arguments: Sequence[Any],
) -> PackedLaunch:
    params = (ctypes.c_void_p * max(len(arguments), 1))(
        *(ctypes.addressof(argument) for argument in arguments)
    )
    return PackedLaunch(name, function, grid, block, shared_bytes, tuple(arguments), params)


class CudaDriver:
    """The few driver calls the deploy path makes; every failure is a ``BackendError``."""

    def __init__(self, library: Any | None = None) -> None:
        library = library if library is not None else libcuda()
        if library is None:
            raise BackendError("the CUDA driver library (libcuda) is not on this machine")
        self._library = library
        self._launch = library.cuLaunchKernel  # no argtypes: every argument is a ctypes object

    def error_string(self, status: int) -> str:
        text = ctypes.c_char_p()
        if self._library.cuGetErrorString(int(status), ctypes.byref(text)) != 0 or not text.value:
            return f"CUDA error {status}"
        return f"{text.value.decode(errors='replace')} (CUDA error {status})"

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise BackendError(f"{what}: {self.error_string(status)}")

    def load_module(self, image: bytes) -> int:
        """``cuModuleLoadData`` in the current context; the module's CUmodule."""
        module = ctypes.c_void_p()
        self.check(
            self._library.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(image)),
            "the cubin does not load",
        )
        return int(module.value or 0)

    def get_function(self, module: int, name: str) -> int:
        function = ctypes.c_void_p()
        status = self._library.cuModuleGetFunction(
            ctypes.byref(function), ctypes.c_void_p(module), name.encode()
        )
        self.check(status, f"no kernel {name} in the cubin")
        return int(function.value or 0)

    def set_max_dynamic_shared(self, function: int, nbytes: int) -> None:
        status = self._library.cuFuncSetAttribute(
            ctypes.c_void_p(function), MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(nbytes)
        )
        self.check(status, f"{nbytes} B of dynamic shared memory refused")

    def encode_tensor_map(self, spec: TensorMap) -> tensor_maps.EncodedTensorMap:
        """A TMA descriptor argument (``EncodedTensorMap.value`` is what the kernel takes)."""
        return tensor_maps.encode(spec, self._library)

    def replace_tensor_map_address(
        self, encoded: tensor_maps.EncodedTensorMap, address: int
    ) -> None:
        tensor_maps.replace_address(encoded, address, self._library)

    def unload_module(self, module: int) -> None:
        self._library.cuModuleUnload(ctypes.c_void_p(module))

    def bind_launch(self, launch: PackedLaunch, stream: int) -> Callable[[], int]:
        """A call that launches ``launch`` on ``stream`` and returns the CUresult (0: queued).

        Every argument is a ctypes object made here, once: calling it converts nothing.
        """
        uint = ctypes.c_uint
        return functools.partial(
            self._launch,
            ctypes.c_void_p(launch.function),
            *(uint(size) for size in launch.grid),
            *(uint(size) for size in launch.block),
            uint(launch.shared_bytes),
            ctypes.c_void_p(stream),
            launch.params,
            None,
        )

    def set_context(self, context: int) -> None:
        self.check(self._library.cuCtxSetCurrent(ctypes.c_void_p(context)), "cuCtxSetCurrent")

    def push_context(self, context: int) -> None:
        self.check(self._library.cuCtxPushCurrent_v2(ctypes.c_void_p(context)), "cuCtxPushCurrent")

    def pop_context(self) -> None:
        popped = ctypes.c_void_p()
        self.check(self._library.cuCtxPopCurrent_v2(ctypes.byref(popped)), "cuCtxPopCurrent")
