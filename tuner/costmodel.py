"""A roofline cost model: predicted time of a kernel plan on a device profile.

Pure (stdlib + ``tuner.planner``/``device``/``problem``). The search uses it to
rank the candidate space, to measure the best predictions first, and, without
a GPU, as the "measurement" itself (``kernels.backends.model``), always labelled
a prediction. It is deliberately simple; ``rank_correlation`` against real
timings says how far to trust it.

The attention kernel's time is the slowest of three throughput bounds, each
taken against the whole device:

* DRAM: the plan's global bytes (``KernelPlan.global_read_bytes`` +
  ``global_write_bytes``, which already count K/V re-reads per block of query
  rows) over ``dram_bandwidth_gbps``. Re-reads that hit L2 make this
  pessimistic for small ``rows_per_block``; that is the direction we want.
* compute: executed matmul flops (padded to whole tiles and blocks) at the
  rate of the pipe the family runs them on (``matmul_rate``: FP32 FFMA at
  ``peak_fp32_tflops``, bf16/fp16 ``mma.sync`` at ``peak_mma_f16_tflops``,
  TF32 ``mma.sync`` at half that), times the family's ``matmul_passes``,
  plus the other instructions: one-op instructions (max, add, compare, and
    every shared-memory load and store) at half the flop rate (one op per lane-
  instruction, an FFMA counts two flops), and
  ``exp2`` on the SFU, which issues 16 per clock per SM against 128 FP32
  lanes (CUDA C++ Programming Guide, arithmetic-instruction throughput table,
  compute capability 9.0). The three are summed: they share the warp
  schedulers' issue slots.
* shared memory: bytes a warp really moves through the shared-memory banks
  (broadcasts counted once) over ``shared_bandwidth_bytes_per_clock_per_sm``
  x SMs x clock.

What a family's kernel executes (padded pairs, exp2 count, shared-memory
bytes and instructions, independent instructions per warp) are the family's
``CostTerms`` (``KernelFamily.cost_terms`` in ``tuner.planner.families``);
this module only turns them into time and never names a family.

That bound is then multiplied by a slowdown for the part of the device the
launch leaves idle: latency hiding and waves (see ``_slowdown``). Latency is
hidden by warps *and* by independent instructions within a warp
(``CostTerms.ilp``, e.g. a register micro-tile of accumulators): a
scheduler is kept busy when warps x independent instructions per warp cover
``LATENCY_CYCLES``, and below that throughput falls linearly. With several
latency-bound waves the tail costs
``ceil(waves) / waves``; with less than one wave on fewer blocks than SMs the
idle SMs cost their share. The split
merge is a second, streaming launch: the partials it reads and the output it
writes at DRAM bandwidth. Every launch adds ``LAUNCH_OVERHEAD_MS``.

Monotone by construction: more bytes, more flops, lower bandwidth or clock,
lower occupancy or an extra launch never make a plan faster (tests check).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tuner.device import DeviceProfile
from tuner.planner.families import CostTerms, MatmulPipe
from tuner.planner.plan import KernelPlan

#: split scratch (partials) is float32 whatever the problem's dtype
F32_BYTES = 4

#: host-side cost of one kernel launch on the critical path (CUDA driver
#: launch latency is about 3-5 us for back-to-back launches).
LAUNCH_OVERHEAD_MS = 0.004
#: TF32 mma.sync over bf16/fp16 mma.sync, per flop: an m16n8k8 TF32 instruction
#: takes as long as an m16n8k16 half one with half the flops (sm_80/sm_90 tensor
#: cores: dense TF32 is half the dense FP16 rate, the datasheets' 495 vs 990 TFLOP/s).
TF32_RATE_OF_F16 = 0.5
#: wgmma (sm_90a warpgroup MMA) over mma.sync, per bf16/fp16 flop: the datasheet's dense
#: 990 TFLOP/s is wgmma's, mma.sync reaches about 2/3 of it (``tuner.device``'s H200 note).
WGMMA_RATE_OF_MMA_SYNC = 1.5
#: FP32 lanes per SM over SFU (exp2, rcp) lanes per SM on sm_90: 128 / 16.
SFU_SLOWDOWN = 8.0
#: cycles of latency a warp scheduler must cover with independent instructions
#: (warps x instruction-level parallelism) to issue every cycle: between a
#: shared-memory load's latency on sm_90 (~30; FFMA's is 4) and a barrier's.
LATENCY_CYCLES = 48
WARP_SCHEDULERS_PER_SM = 4
#: independent accumulators per thread beyond which more do not help (the
#: compiler's scheduling window); 32 is a 4 x 8 register micro-tile.
MAX_ILP = 32


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted time of one plan and the parts it is made of (milliseconds)."""

    time_ms: float
    kernel_ms: float  # the attention kernel, after derating, without launch overhead
    merge_ms: float  # the split-merge kernel (0 without splits)
    launch_ms: float  # launch overhead of every launch
    dram_ms: float  # the attention kernel's bounds at full device throughput...
    compute_ms: float
    shared_ms: float
    bound: str  # "dram", "compute" or "shared": the largest of the three
    slowdown: float  # >= 1: kernel_ms / the largest bound (occupancy, tail, idle SMs)
    latency_efficiency: float  # 0..1: throughput of an SM holding blocks_per_sm blocks
    waves: float  # blocks / (blocks_per_sm x SMs)
    read_bytes: int  # global traffic of the whole plan (both kernels)
    write_bytes: int
    executed_flops: int  # matmul flops actually executed (padding included)
    shared_bytes: int

    @property
    def traffic_bytes(self) -> int:
        return self.read_bytes + self.write_bytes


def predict(plan: KernelPlan, device: DeviceProfile) -> Prediction:
    """The predicted time of ``plan`` on ``device``. ``inf`` for a plan that cannot run."""
    partial_bytes = F32_BYTES * plan.partial_elements
    output_bytes = plan.problem.tensor_bytes
    # The merge reads the partials and writes the output; the attention kernel
    # reads the rest and writes the partials (or the output without splits).
    merge_bytes = partial_bytes + output_bytes if plan.reduce_launch is not None else 0
    kernel_bytes = plan.global_bytes - merge_bytes
    dram_ms = _ms(kernel_bytes, device.dram_bandwidth_gbps * 1e9)

    terms = plan.kernel_family.cost_terms(plan)
    executed_flops = 4 * plan.problem.head_dim * plan.problem.batch_heads * terms.executed_pairs
    shared_bytes = terms.shared_bytes
    compute_ms = _compute_ms(plan, terms, device)

    shared_rate = device.shared_bandwidth_bytes_per_clock_per_sm * device.sm_count
    shared_ms = _ms(shared_bytes, shared_rate * device.clock_ghz * 1e9)

    bounds = {"dram": dram_ms, "compute": compute_ms, "shared": shared_ms}
    bound = max(bounds, key=lambda name: bounds[name])
    slowdown, efficiency = _slowdown(plan, device)
    kernel_ms = bounds[bound] * slowdown

    merge_ms = _ms(merge_bytes, device.dram_bandwidth_gbps * 1e9)
    launches = 1 + (plan.reduce_launch is not None)
    launch_ms = launches * LAUNCH_OVERHEAD_MS
    return Prediction(
        time_ms=kernel_ms + merge_ms + launch_ms,
        kernel_ms=kernel_ms,
        merge_ms=merge_ms,
        launch_ms=launch_ms,
        dram_ms=dram_ms,
        compute_ms=compute_ms,
        shared_ms=shared_ms,
        bound=bound,
        slowdown=slowdown,
        latency_efficiency=efficiency,
        waves=plan.waves,
        read_bytes=plan.global_read_bytes,
        write_bytes=plan.global_write_bytes,
        executed_flops=executed_flops,
        shared_bytes=shared_bytes,
    )


def predict_time_ms(plan: KernelPlan, device: DeviceProfile) -> float:
    return predict(plan, device).time_ms


def _ms(amount: float, per_second: float) -> float:
    return 1e3 * amount / per_second


def matmul_rate(pipe: MatmulPipe, device: DeviceProfile) -> float:
    """FLOP/s of the pipe a family's matmuls run on (``CostTerms.matmul_pipe``)."""
    if pipe == "ffma":
        return device.peak_fp32_tflops * 1e12
    if pipe == "mma_sync_f16":
        return device.peak_mma_f16_tflops * 1e12
    if pipe == "mma_sync_tf32":
        return TF32_RATE_OF_F16 * device.peak_mma_f16_tflops * 1e12
    if pipe == "wgmma_f16":
        return WGMMA_RATE_OF_MMA_SYNC * device.peak_mma_f16_tflops * 1e12
    raise ValueError(f"unknown matmul pipe {pipe!r}")


def _compute_ms(plan: KernelPlan, terms: CostTerms, device: DeviceProfile) -> float:
    executed_flops = 4 * plan.problem.head_dim * plan.problem.batch_heads * terms.executed_pairs
    peak = device.peak_fp32_tflops * 1e12
    other_ops = max(plan.non_matmul_flops - terms.exps, 0) + terms.shared_lane_ops
    # An FFMA is 2 flops per lane-instruction; everything else is 1 op per instruction.
    instruction_rate = peak / 2
    return (
        _ms(executed_flops * terms.matmul_passes, matmul_rate(terms.matmul_pipe, device))
        + _ms(other_ops, instruction_rate)
        + _ms(terms.exps, instruction_rate / SFU_SLOWDOWN)
    )


def _slowdown(plan: KernelPlan, device: DeviceProfile) -> tuple[float, float]:
    """(slowdown >= 1, latency efficiency of an SM holding ``blocks_per_sm`` blocks).

    Blocks go round-robin to SMs, so the busiest SM runs ``ceil(blocks /
    SMs)`` of them, ``blocks_per_sm`` at a time. A round of ``r`` resident
    blocks runs at ``latency_efficiency`` of the SM's throughput, so it takes
    ``r / efficiency(r)`` block-times. The slowdown is
    the busiest SM's time over the time of a perfectly spread, fully efficient
    launch. With several latency-bound waves this is the classic tail factor
    ``ceil(waves) / waves``; a partial last wave that saturates the SM anyway
    costs only its share, and less than a wave on fewer SMs than the device
    has costs the idle SMs.
    """
    if plan.blocks_per_sm == 0:
        return math.inf, 0.0
    per_sm = plan.launch.blocks / device.sm_count
    busiest = math.ceil(per_sm)
    resident = plan.blocks_per_sm

    def round_time(blocks: int) -> float:
        return blocks / latency_efficiency(plan, blocks, device)

    full_rounds, last_round = divmod(busiest, resident)
    busiest_time = full_rounds * round_time(resident)
    if last_round:
        busiest_time += round_time(last_round)
    return busiest_time / per_sm, resident / round_time(resident)


def latency_efficiency(plan: KernelPlan, resident_blocks: int, device: DeviceProfile) -> float:
    """Fraction of an SM's issue rate that ``resident_blocks`` blocks of ``plan`` keep busy.

    Chosen against H200 recordings of every feasible plan of three problems
    (``bench/data``: 1x1x4096x128, 1x8x2048x128, 1x4x1024x64): counting warps
    alone (16 per SM to saturate) ranked them with Spearman 0.32, 0.20 and
    0.31; crediting the micro-tile's independent accumulators, with 0.86,
    0.90 and 0.85, and the predicted best is the measured best (or within 3%).
    ``LATENCY_CYCLES`` and ``MAX_ILP`` were picked from a small grid on those
    three: revisit them as recordings of other shapes arrive.
    """
    ilp = plan.kernel_family.cost_terms(plan).ilp
    warps = resident_blocks * plan.threads / device.warp_size
    in_flight = warps / WARP_SCHEDULERS_PER_SM * min(ilp, MAX_ILP)
    return min(1.0, in_flight / LATENCY_CYCLES)


def rank_correlation(
    predictions: Sequence[float | None], measurements: Sequence[float | None]
) -> float:
    """Spearman's rank correlation of paired values (ties get their average rank).

    Pairs where either value is missing or not finite (a failed candidate) are
    dropped. ``nan`` when fewer than two pairs remain or one side is constant.
    """
    if len(predictions) != len(measurements):
        raise ValueError(f"{len(predictions)} predictions but {len(measurements)} measurements")
    pairs = [
        (float(p), float(m))
        for p, m in zip(predictions, measurements, strict=True)
        if p is not None and m is not None and math.isfinite(p) and math.isfinite(m)
    ]
    if len(pairs) < 2:
        return math.nan
    x = _ranks([p for p, _ in pairs])
    y = _ranks([m for _, m in pairs])
    mean = (len(pairs) + 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(x, y, strict=True))
    var_x = sum((a - mean) ** 2 for a in x)
    var_y = sum((b - mean) ** 2 for b in y)
    if var_x == 0 or var_y == 0:
        return math.nan
    return cov / math.sqrt(var_x * var_y)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        average = (start + end) / 2 + 1
        for i in range(start, end + 1):
            ranks[order[i]] = average
        start = end + 1
    return ranks
