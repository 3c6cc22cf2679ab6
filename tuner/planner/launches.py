"""What a plan launches, as values: buffer sizes, launch geometry and kernel arguments.

Pure (numpy scalars only, no CUDA). Each family builds its launches from these
(``KernelFamily.launches``); the PyCUDA backend allocates what
``BufferElements`` says and launches exactly what the family returns, so tests
check both on a machine without a GPU. Argument types follow the kernels'
signatures: pointers as ``np.uintp``, ints as ``np.int32``, floats as ``np.float32``, and
TMA descriptors (``const __grid_constant__ CUtensorMap``) as ``TensorMap`` values, which the
backends encode with the driver (``kernels.tensor_maps``) over the buffer they name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tuner.planner.plan import Launch
from tuner.problem import Problem

#: dynamic shared memory a kernel may use without opting in
#: (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES); the CUDA default on every arch.
DEFAULT_DYNAMIC_SHARED_LIMIT = 48 * 1024
#: split scratch is float32 whatever the problem's dtype: partials are accumulators
SCRATCH_BYTES = 4

#: the TMA's element types a tensor map may name (CUtensorMapDataType)
TENSOR_MAP_DTYPES = ("bfloat16", "float16")
#: the shared-memory swizzles a tensor map may ask for, in bytes (0: none)
TENSOR_MAP_SWIZZLES = (0, 32, 64, 128)


@dataclass(frozen=True, slots=True)
class TensorMap:
    """A kernel's by-value TMA descriptor over one of the plan's buffers, as a value.

    ``buffer`` names the ``DeviceBuffers`` field the map covers and ``address`` is that
    buffer's address; the map is row-major with ``dims`` innermost first (elements),
    ``strides_bytes`` for every dimension but the innermost, and a box of ``box`` elements
    landing in shared memory with a ``swizzle_bytes`` swizzle. Reads outside ``dims`` fill
    zeros. Pure: the backend turns it into the 128-byte ``CUtensorMap`` the kernel takes.
    """

    buffer: str
    address: int
    dtype: str
    dims: tuple[int, ...]
    strides_bytes: tuple[int, ...]
    box: tuple[int, ...]
    swizzle_bytes: int = 128

    def __post_init__(self) -> None:
        if self.dtype not in TENSOR_MAP_DTYPES:
            raise ValueError(f"tensor map dtype {self.dtype!r} is not one of {TENSOR_MAP_DTYPES}")
        if len(self.strides_bytes) != len(self.dims) - 1 or len(self.box) != len(self.dims):
            raise ValueError(
                f"tensor map of {len(self.dims)} dims needs {len(self.dims) - 1} strides and "
                f"{len(self.dims)} box sizes, got {self.strides_bytes} and {self.box}"
            )
        if self.swizzle_bytes not in TENSOR_MAP_SWIZZLES:
            raise ValueError(
                f"swizzle of {self.swizzle_bytes} B is not one of {TENSOR_MAP_SWIZZLES}"
            )


KernelArgument = np.uintp | np.int32 | np.float32 | TensorMap


@dataclass(frozen=True, slots=True)
class BufferElements:
    """Elements of each device buffer a plan needs.

    ``tensor`` elements of ``element_bytes`` each (the problem's dtype) for each
    of q, k, v and out; the split scratch is float32: ``partial_o`` accumulators
    and ``partial_ml`` per-row statistics (a (max, sum) pair per row for one
    family, one log-sum-exp per row for another: the family says how many).
    """

    tensor: int
    partial_o: int
    partial_ml: int
    element_bytes: int = 4

    @property
    def tensor_bytes(self) -> int:
        return self.tensor * self.element_bytes

    @property
    def partial_o_bytes(self) -> int:
        return self.partial_o * SCRATCH_BYTES

    @property
    def partial_ml_bytes(self) -> int:
        return self.partial_ml * SCRATCH_BYTES


@dataclass(frozen=True, slots=True)
class DeviceBuffers:
    """Device addresses of the buffers (0 for a buffer a plan or a call does not use).

    Besides q, k, v, out and the split scratch: ``alibi_slopes`` and ``sinks`` (float32,
    one per query head) for problems with those variants, and ``lse`` (float32, one per
    query row of every head) where the row log-sum-exps are asked for (the backward pass).
    Serving batches add ``work`` (the int32 work list, ``tuner.planner.work_list``) and
    ``pages`` (the int32 page lists of a paged KV cache).
    """

    q: int
    k: int
    v: int
    out: int
    partial_o: int = 0
    partial_ml: int = 0
    alibi_slopes: int = 0
    sinks: int = 0
    lse: int = 0
    work: int = 0
    pages: int = 0


@dataclass(frozen=True, slots=True)
class BackwardBuffers:
    """Device addresses of one backward run's buffers (0 for a buffer a plan does not use).

    Inputs: q, k, v as forward, ``out`` the forward's output, ``dout`` its gradient and ``lse``
    the forward's natural-log log-sum-exps (float32, ``[batch * heads][seq_len]``); outputs
    ``dq`` (q's shape), ``dk`` and ``dv`` (k's). The scratch (``BackwardScratch`` says how
    much) and the per-head run-time data of the variants (``alibi_slopes``, ``sinks``) and the
    sinks' gradient ``d_sinks`` (float32, one per query head) follow.
    """

    q: int
    k: int
    v: int
    out: int
    dout: int
    lse: int
    dq: int
    dk: int
    dv: int
    lse_log2: int = 0
    delta: int = 0
    dq_accum: int = 0
    counters: int = 0
    dkv_partial: int = 0
    alibi_slopes: int = 0
    sinks: int = 0
    d_sinks: int = 0


#: the scratch buffers of a backward run, in ``BackwardBuffers`` order
BACKWARD_SCRATCH = ("lse_log2", "delta", "dq_accum", "counters", "dkv_partial")


@dataclass(frozen=True, slots=True)
class BackwardScratch:
    """Bytes of each scratch buffer of a backward plan (0: the plan does not use it); the
    backward family's ``backward_scratch`` says them, the backend and the deploy handle
    allocate them. Uninitialised memory is fine: the kernels write before they read."""

    lse_log2: int
    delta: int
    dq_accum: int
    counters: int = 0
    dkv_partial: int = 0

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in BACKWARD_SCRATCH}


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    function: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple[KernelArgument, ...]

    @property
    def needs_shared_opt_in(self) -> bool:
        """Above 48 KiB of dynamic shared memory the launch fails unless the
        function's maximum is raised first."""
        return self.shared_bytes > DEFAULT_DYNAMIC_SHARED_LIMIT


def kernel_launch(launch: Launch, function: str, args: tuple[KernelArgument, ...]) -> KernelLaunch:
    return KernelLaunch(function, launch.grid, launch.block, launch.shared_bytes, args)


def scale_log2(head_dim: int) -> float:
    """The kernels' ``scale_log2`` argument: scores in the log2 domain, ``log2(e)/sqrt(d)``."""
    return math.log2(math.e) / math.sqrt(head_dim)


def variant_arguments(problem: Problem, buffers: DeviceBuffers) -> tuple[KernelArgument, ...]:
    """The arguments every forward entry takes after its scale (``kernels/include/fa/
    variant.cuh``): ``heads, window_left, window_right, softcap, alibi_slopes, sinks, lse``."""
    return (
        np.int32(problem.heads),
        np.int32(problem.window_left),
        np.int32(problem.window_right),
        np.float32(problem.softcap),
        np.uintp(buffers.alibi_slopes),
        np.uintp(buffers.sinks),
        np.uintp(buffers.lse),
    )


def pointers(buffers: DeviceBuffers) -> tuple[np.uintp, ...]:
    """q, k, v, out, partial_o, partial_ml as kernel pointer arguments."""
    return tuple(
        np.uintp(address)
        for address in (
            buffers.q,
            buffers.k,
            buffers.v,
            buffers.out,
            buffers.partial_o,
            buffers.partial_ml,
        )
    )
