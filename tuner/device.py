"""Named limits and ceilings of a GPU, as the planner and cost model see it.

Pure data: nothing here talks to a GPU. ``kernels.backends.pycuda_backend``
reads the same fields off a live device; ``H200`` is used when none answers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    max_threads_per_block: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    max_shared_memory_per_block_optin: int
    shared_memory_per_sm: int
    reserved_shared_memory_per_block: int
    registers_per_sm: int
    registers_per_block: int
    max_registers_per_thread: int
    register_allocation_unit: int
    warp_size: int
    l2_bytes: int
    peak_fp32_tflops: float
    #: dense bf16/fp16 mma.sync (fp32 accumulate) rate of the tensor cores
    peak_mma_f16_tflops: float
    dram_bandwidth_gbps: float
    shared_bandwidth_bytes_per_clock_per_sm: int
    clock_ghz: float

    @property
    def arch(self) -> str:
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"


# Limits read off the lent H200 (../shared/DEVICE.md, 2026-12-02) and the CUDA
# programming guide's table for compute capability 9.0: 232448 B opt-in shared
# memory per block, 233472 B per SM, 1 KiB reserved per block, 65536 registers,
# 2048 threads and 32 blocks per SM, 255 registers per thread allocated in
# units of 256 per warp. FP32 peak: 132 SMs * 128 FFMA lanes * 2 * 1.98 GHz
# = 67 TFLOP/s (datasheet). Bandwidth: 4.8 TB/s datasheet HBM3e; a
# device-to-device copy measured 4.3 TB/s, which is the ceiling used here.
# Tensor cores: the datasheet's 990 TFLOP/s dense bf16/fp16 is wgmma's
# (sm_90a warpgroup MMA); mma.sync m16n8k16 with fp32 accumulate reaches
# roughly 2/3 of it, so 660e12 FLOP/s is the rate a family running mma.sync
# is held to. Shared memory: 128 B per clock per SM (32 banks x 4 B).
H200 = DeviceProfile(
    name="NVIDIA H200",
    compute_capability=(9, 0),
    sm_count=132,
    max_threads_per_block=1024,
    max_threads_per_sm=2048,
    max_blocks_per_sm=32,
    max_shared_memory_per_block_optin=232448,
    shared_memory_per_sm=233472,
    reserved_shared_memory_per_block=1024,
    registers_per_sm=65536,
    registers_per_block=65536,
    max_registers_per_thread=255,
    register_allocation_unit=256,
    warp_size=32,
    l2_bytes=60 * 1024 * 1024,
    peak_fp32_tflops=67.0,
    peak_mma_f16_tflops=660.0,
    dram_bandwidth_gbps=4300.0,
    shared_bandwidth_bytes_per_clock_per_sm=128,
    clock_ghz=1.98,
)

PROFILES: dict[str, DeviceProfile] = {"h200": H200}
