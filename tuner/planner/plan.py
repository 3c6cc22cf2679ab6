"""A planned candidate: what every family's plan holds, whatever the family.

``KernelPlan`` carries the seed's partition fields, the launches, traffic and
flops, occupancy and the verdict. What differs per family (compile defines,
the plan key, the split scratch, registers judged against the thread count)
is asked of the family registered under ``plan.family``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tuner.device import DeviceProfile
from tuner.planner.fixed_width import div_ceil
from tuner.planner.params import KernelParams
from tuner.problem import Problem

if TYPE_CHECKING:
    from tuner.planner.families.base import KernelFamily


@dataclass(frozen=True, slots=True)
class ResourceUsage:
    """What the compiler reports for a kernel (``ptxas -v``)."""

    registers: int
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    static_shared_bytes: int = 0
    stack_bytes: int = 0
    #: ptxas could not keep wgmma.mma_async products in flight for want of registers and
    #: waits after each (its C7512 "Potential Performance Loss" note): correct, but slow
    serialized_wgmma: bool = False


@dataclass(frozen=True, slots=True)
class Launch:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int

    @property
    def blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """Everything the build, the launch, the cost model and the registry need."""

    problem: Problem
    params: KernelParams
    # Partition (the seed's fields, generalised): tile_size is the key tile,
    # rows_per_block the query rows one block owns.
    tile_size: int
    tile_count: int
    sequence_splits: int
    tiles_per_sequence_split: int
    keys_per_sequence_split: int
    split_reduce_scratch_elements: int
    parallel_workgroups_per_row: int
    rows_per_block: int
    # Thread layout inside a block (lanes per query row, rows per thread; 1 where unused).
    threads_per_row: int
    rows_per_thread: int
    # Launches: the attention kernel, and the split merge when splits > 1.
    launch: Launch
    reduce_launch: Launch | None
    # Work and traffic.
    global_read_bytes: int
    global_write_bytes: int
    matmul_flops: int
    non_matmul_flops: int
    # Occupancy on the device profile (registers taken into account once known).
    blocks_per_sm: int
    occupancy: float
    waves: float
    # Verdict.
    feasible: bool
    reason: str = ""
    resources: ResourceUsage | None = field(default=None)

    @property
    def family(self) -> str:
        return self.params.family

    @property
    def kernel_family(self) -> KernelFamily:
        from tuner.planner.families import family_named

        return family_named(self.params.family)

    @property
    def threads(self) -> int:
        return self.launch.threads_per_block

    @property
    def global_bytes(self) -> int:
        return self.global_read_bytes + self.global_write_bytes

    @property
    def partial_elements(self) -> int:
        """float32 elements of split scratch: accumulators plus the per-row statistics."""
        scratch = self.kernel_family.buffer_elements(self)
        return scratch.partial_o + scratch.partial_ml

    def compile_defines(self) -> dict[str, int]:
        """The compile-time constants of this plan's kernel; the rest are launch arguments."""
        return self.kernel_family.compile_defines(self)

    def key(self) -> str:
        """A name that identifies the candidate within one problem."""
        return self.kernel_family.key(self)

    def with_resources(self, usage: ResourceUsage, device: DeviceProfile) -> KernelPlan:
        """This plan re-judged with the compiler's register and spill report."""
        reason = self.reason
        if self.feasible:
            reason = resource_verdict(usage, self.threads, device)
        blocks_per_sm = blocks_per_sm_of(
            self.threads, self.launch.shared_bytes, usage.registers, device
        )
        occupancy, waves = occupancy_and_waves(self.launch, self.threads, blocks_per_sm, device)
        return replace(
            self,
            resources=usage,
            feasible=self.feasible and not reason,
            reason=reason,
            blocks_per_sm=blocks_per_sm,
            occupancy=occupancy,
            waves=waves,
        )


def resource_verdict(usage: ResourceUsage, threads: int, device: DeviceProfile) -> str:
    if usage.spill_store_bytes or usage.spill_load_bytes:
        return (
            f"compiler spills registers to local memory ({usage.spill_store_bytes} B stores, "
            f"{usage.spill_load_bytes} B loads)"
        )
    if usage.serialized_wgmma:
        return "compiler serialises the wgmma products for want of registers (ptxas C7512)"
    if usage.registers > device.max_registers_per_thread:
        return f"{usage.registers} registers per thread exceed {device.max_registers_per_thread}"
    if allocated_registers(usage.registers, device) * threads > device.registers_per_block:
        return (
            f"{usage.registers} registers x {threads} threads exceed the "
            f"{device.registers_per_block}-register block file"
        )
    return ""


def allocated_registers(registers: int, device: DeviceProfile) -> int:
    """Registers a thread really takes: warps allocate in units of 256."""
    per_warp = registers * device.warp_size
    unit = device.register_allocation_unit
    return div_ceil(per_warp, unit) * unit // device.warp_size


def blocks_per_sm_of(
    threads: int, shared_bytes: int, registers: int | None, device: DeviceProfile
) -> int:
    limit = min(device.max_blocks_per_sm, device.max_threads_per_sm // max(threads, 1))
    per_block_shared = shared_bytes + device.reserved_shared_memory_per_block
    limit = min(limit, device.shared_memory_per_sm // per_block_shared)
    if registers:
        limit = min(
            limit, device.registers_per_sm // (allocated_registers(registers, device) * threads)
        )
    return max(limit, 0)


def occupancy_and_waves(
    launch: Launch, threads: int, blocks_per_sm: int, device: DeviceProfile
) -> tuple[float, float]:
    if blocks_per_sm == 0:
        return 0.0, math.inf
    occupancy = blocks_per_sm * threads / device.max_threads_per_sm
    waves = launch.blocks / (blocks_per_sm * device.sm_count)
    return occupancy, waves
