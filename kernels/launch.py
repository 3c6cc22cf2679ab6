"""What a plan launches: buffer sizes, grids, blocks, shared bytes and kernel arguments.

Pure (numpy scalars only, no CUDA): the PyCUDA backend launches exactly what
``launch_sequence`` returns, so tests check the launch configuration against
the plan on a machine without a GPU. Argument types follow the kernels'
signatures in ``kernels/*.cu``: pointers as ``np.uintp``, ints as
``np.int32``, the scale as ``np.float32``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.reference import scale_log2
from tuner.planner.tunable import KernelPlan, Launch

#: dynamic shared memory a kernel may use without opting in
#: (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES); the CUDA default on every arch.
DEFAULT_DYNAMIC_SHARED_LIMIT = 48 * 1024

KernelArgument = np.uintp | np.int32 | np.float32


@dataclass(frozen=True, slots=True)
class BufferElements:
    """float32 elements of each device buffer a plan needs."""

    tensor: int  # each of q, k, v, out
    partial_o: int  # split accumulators (0 without splits)
    partial_ml: int  # split (max, sum) pairs (0 without splits)


def buffer_elements(plan: KernelPlan) -> BufferElements:
    p = plan.problem
    tensor = p.batch_heads * p.seq_len * p.head_dim
    if plan.sequence_splits == 1:
        return BufferElements(tensor=tensor, partial_o=0, partial_ml=0)
    rows = p.batch_heads * plan.sequence_splits * p.seq_len
    return BufferElements(tensor=tensor, partial_o=rows * p.head_dim, partial_ml=rows * 2)


@dataclass(frozen=True, slots=True)
class DeviceBuffers:
    """Device addresses of the buffers (0 for a partial buffer a plan does not use)."""

    q: int
    k: int
    v: int
    out: int
    partial_o: int = 0
    partial_ml: int = 0


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


def _from(launch: Launch, function: str, args: tuple[KernelArgument, ...]) -> KernelLaunch:
    return KernelLaunch(function, launch.grid, launch.block, launch.shared_bytes, args)


def launch_sequence(plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
    """The launches of one run of ``plan``, in order (attention, then the split merge)."""
    p = plan.problem
    seq_len = np.int32(p.seq_len)
    scale = np.float32(scale_log2(p.head_dim))
    q, k, v, out = (np.uintp(b) for b in (buffers.q, buffers.k, buffers.v, buffers.out))
    if plan.family == "scalar_online":
        return (_from(plan.launch, "scalar_online_attention", (q, k, v, out, seq_len, scale)),)
    if plan.family != "tiled":
        raise ValueError(f"unknown kernel family {plan.family!r}")
    if plan.sequence_splits > 1 and not (buffers.partial_o and buffers.partial_ml):
        raise ValueError(f"{plan.key()} needs split buffers; none were given")
    if plan.launch.grid[1] != plan.sequence_splits:
        # The kernel tells one split from several by gridDim.y.
        raise ValueError(
            f"{plan.key()}: grid {plan.launch.grid} does not launch one column per split"
        )
    partial_o, partial_ml = np.uintp(buffers.partial_o), np.uintp(buffers.partial_ml)
    attention = _from(
        plan.launch,
        "tiled_attention",
        (
            q,
            k,
            v,
            out,
            partial_o,
            partial_ml,
            seq_len,
            np.int32(plan.keys_per_sequence_split),
            scale,
        ),
    )
    if plan.sequence_splits == 1:
        return (attention,)
    if plan.reduce_launch is None:
        raise ValueError(f"{plan.key()} has {plan.sequence_splits} splits but no merge launch")
    merge = _from(
        plan.reduce_launch,
        "split_merge",
        (
            partial_o,
            partial_ml,
            out,
            seq_len,
            np.int32(plan.sequence_splits),
            np.int32(p.batch_heads * p.seq_len),
        ),
    )
    return (attention, merge)
