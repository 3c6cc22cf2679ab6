"""What a plan launches: buffer sizes, grids, blocks, shared bytes and kernel arguments.

Pure (numpy scalars only, no CUDA): the PyCUDA backend allocates what
``buffer_elements`` says and launches exactly what ``launch_sequence``
returns, so tests check the launch configuration against the plan on a
machine without a GPU. Both are the plan's family's (``KernelFamily.buffer_elements``,
``KernelFamily.launches``); the value types live in ``tuner.planner.launches``.
"""

from __future__ import annotations

from tuner.planner.launches import (
    DEFAULT_DYNAMIC_SHARED_LIMIT,
    BufferElements,
    DeviceBuffers,
    KernelArgument,
    KernelLaunch,
)
from tuner.planner.plan import KernelPlan

__all__ = [
    "DEFAULT_DYNAMIC_SHARED_LIMIT",
    "BufferElements",
    "DeviceBuffers",
    "KernelArgument",
    "KernelLaunch",
    "buffer_elements",
    "launch_sequence",
]


def buffer_elements(plan: KernelPlan) -> BufferElements:
    """Elements of q, k, v, out (the problem's dtype) and of the float32 split scratch."""
    return plan.kernel_family.buffer_elements(plan)


def launch_sequence(plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
    """The launches of one run of ``plan``, in order (e.g. attention, then the split merge)."""
    return plan.kernel_family.launches(plan, buffers)
