"""A roofline cost model: predicted time of a kernel plan on a device profile.

Pure (stdlib, numpy, ``tuner.planner``/``device``/``problem``). The search uses
it to rank the candidate space, to measure the best predictions first and to
steer its sampler (``tuner.model_sampler``); without a GPU it is the
"measurement" itself (``kernels.backends.model``), always labelled a
prediction. ``rank_correlation`` against real timings says how far to trust it;
``tuner.calibration`` fits its constants (``CostParams``) to recorded grids.

A plan's time is its attention kernel (times its ``CostTerms.imbalance``: a persistent
grid ends with its busiest block), the split merge (a second, streaming
launch: partials read and output written at DRAM bandwidth) and
``LAUNCH_OVERHEAD_MS`` per launch. The kernel has two sides, each the time of
the busiest part of the device, combined by a p-norm (``overlap`` for kernels
whose loads run ahead through a cp.async ring, ``overlap_synchronous`` for
those that load, wait and compute: a large p is "the slower side alone", 1 is
"they add up"):

* memory: at full throughput, the larger of the compulsory bytes (Q, K and V
  once per KV head, the output or split partials written) over the sustained
  DRAM bandwidth (``dram_efficiency`` x ``dram_bandwidth_gbps``) and the bytes
  requested (``KernelPlan.global_read_bytes`` + ``global_write_bytes``, which
  count the K/V re-reads per block of query rows) over the L2's bandwidth
  (``l2_over_dram`` x that). The launch runs in rounds of resident blocks, and
  by Little's law a round draws at most (blocks x ``CostTerms.bytes_in_flight``)
  / ``dram_latency_us``: a round of fewer blocks than it takes to cover the
  latency is latency bound (few large decode blocks, a ragged last wave).
* SM: the larger of compute and shared memory at full throughput, times a
  slowdown for latency hiding and waves (``_sm_slowdown``). Compute is the
  executed matmul flops (padded to whole tiles and blocks) at the rate of the
  pipe the family runs them on (``matmul_rate``: FP32 FFMA, bf16/fp16
  ``mma.sync``, TF32 ``mma.sync`` at half that; each times its calibrated
  efficiency), times the family's ``matmul_passes``, plus the other
  instructions (one op per lane-instruction, an FFMA counts two flops, and
  every shared-memory load and store) and ``exp2`` on the SFU (16 per clock per
  SM against 128 FP32 lanes, CUDA C++ Programming Guide, compute capability
  9.0), at ``issue_efficiency`` of the FP32 issue rate. Shared memory is the
  bytes a warp really moves through the banks over 128 B per clock per SM.
  Latency is hidden by warps *and* by independent instructions within a warp
  (``CostTerms.ilp``): a scheduler is busy when warps x min(ilp, ``max_ilp``)
  cover ``latency_cycles``.

What a family's kernel executes (padded pairs, exp2 count, shared-memory bytes
and instructions, independent instructions per warp, bytes in flight) are the
family's ``CostTerms`` (``KernelFamily.cost_terms``); this module turns them
into time and never names a family. The arithmetic is written once, on numpy
arrays (``model_times``), so calibration evaluates thousands of plans at once
and ``predict`` is the same formula on one.

Monotone by construction: more bytes, more flops, lower bandwidth or clock,
lower occupancy or an extra launch never make a plan faster (tests check).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from tuner.device import DeviceProfile
from tuner.planner.families import CostTerms, MatmulPipe
from tuner.planner.plan import KernelPlan, blocks_per_sm_of

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
WARP_SCHEDULERS_PER_SM = 4
#: the pipes, in the order of ``CostParams.matmul_efficiency``
PIPES: tuple[MatmulPipe, ...] = ("ffma", "mma_sync_f16", "mma_sync_tf32", "wgmma_f16")
#: the calibrated constants shipped with the package (``bench/calibrate_costmodel.py``)
CALIBRATION_FILE = Path(__file__).with_name("costmodel_calibration.json")


@dataclass(frozen=True, slots=True)
class CostParams:
    """The model's constants: each a physical quantity, fitted by ``tuner.calibration``.

    The defaults are the datasheet's and the earlier hand-picked values; the
    package ships fitted ones (``calibrated()``).
    """

    #: sustained fraction of ``DeviceProfile.dram_bandwidth_gbps``
    dram_efficiency: float = 1.0
    #: L2 bandwidth over DRAM bandwidth: what K/V re-reads that hit L2 cost
    l2_over_dram: float = 1.0
    #: DRAM latency a block's bytes in flight must cover (Little's law), microseconds
    dram_latency_us: float = 0.0
    #: achieved fraction of each pipe's peak (``PIPES`` order)
    ffma_efficiency: float = 1.0
    mma_f16_efficiency: float = 1.0
    mma_tf32_efficiency: float = 1.0
    wgmma_f16_efficiency: float = 1.0
    #: achieved fraction of the FP32 issue rate for the non-matmul instructions
    issue_efficiency: float = 1.0
    #: cycles of latency a scheduler must cover with warps x independent instructions
    latency_cycles: float = 48.0
    #: independent accumulators per thread beyond which more do not help
    max_ilp: float = 32.0
    #: p of the p-norm that combines the memory and SM sides (large: max; 1: sum) for
    #: pipelined kernels (``CostTerms.pipelined``: loads run ahead through a cp.async ring)
    overlap: float = 64.0
    #: the same for kernels that load, wait at a barrier, then compute
    overlap_synchronous: float = 64.0
    #: the share of the shorter of softmax and matmul time that a second independent
    #: stream hides under the other (``CostTerms.softmax_streams``: s streams hide
    #: 1 - (1 - this)^(s - 1) of it); 0: they add up whatever the streams
    softmax_hiding: float = 0.0
    #: p of the p-norm that combines compute and shared-memory time where the matmuls read
    #: their operands from shared memory (``CostTerms.shared_operands``); large: the slower
    shared_contention: float = 64.0

    def efficiency_of(self, pipe: MatmulPipe) -> float:
        return (
            self.ffma_efficiency,
            self.mma_f16_efficiency,
            self.mma_tf32_efficiency,
            self.wgmma_f16_efficiency,
        )[PIPES.index(pipe)]

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, float]) -> CostParams:
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown cost-model constants: {', '.join(sorted(unknown))}")
        return cls(**{name: float(value) for name, value in values.items()})


#: the hand-picked model before calibration (LATENCY_CYCLES 48, MAX_ILP 32, no
#: L2 or latency term, every pipe at its peak): what ``calibrated()`` falls back to
UNCALIBRATED = CostParams()


@functools.cache
def calibrated() -> CostParams:
    """The fitted constants shipped in ``costmodel_calibration.json`` (its ``params``)."""
    try:
        data = json.loads(CALIBRATION_FILE.read_text())
    except FileNotFoundError:
        return UNCALIBRATED
    return CostParams.from_dict(data["params"])


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
    slowdown: float  # >= 1: kernel_ms / the largest bound (occupancy, tail, idle SMs, latency)
    latency_efficiency: float  # 0..1: throughput of an SM holding blocks_per_sm blocks
    waves: float  # blocks / (blocks_per_sm x SMs)
    read_bytes: int  # global traffic of the whole plan (both kernels)
    write_bytes: int
    executed_flops: int  # matmul flops actually executed (padding included)
    shared_bytes: int

    @property
    def traffic_bytes(self) -> int:
        return self.read_bytes + self.write_bytes


# ---------------------------------------------------------------------- features

#: what the model reads off a plan: independent of ``CostParams``, so calibration
#: computes them once per plan
FEATURES = (
    "compulsory_bytes",  # Q, K/V once per KV head, kernel writes
    "request_bytes",  # the attention kernel's global traffic as requested
    "merge_bytes",  # the split merge's traffic (0 without splits)
    "launches",
    "matmul_flops",  # executed x passes
    "pipe",  # index into PIPES
    "instructions",  # one-op lane instructions besides exp2
    "exps",
    "shared_bytes",
    "blocks",
    "resident",  # blocks per SM
    "warps",  # per block
    "ilp",
    "bytes_in_flight",  # per block
    "pipelined",  # 1: loads overlap the math (CostTerms.pipelined)
    "imbalance",  # the busiest block's work over the mean (CostTerms.imbalance)
    "softmax_streams",  # streams whose softmax runs under another's matmuls
    "shared_operands",  # 1: the matmuls read shared memory themselves (wgmma)
)


def plan_features(plan: KernelPlan, device: DeviceProfile) -> tuple[float, ...]:
    """``FEATURES`` of one plan."""
    terms = plan.kernel_family.cost_terms(plan)
    problem = plan.problem
    partial_bytes = F32_BYTES * plan.partial_elements
    output_bytes = problem.tensor_bytes
    split = plan.reduce_launch is not None
    # The merge reads the partials and writes the output; the attention kernel
    # reads the rest and writes the partials (or the output without splits).
    merge_bytes = partial_bytes + output_bytes if split else 0
    # (a plan that does not count its partials in its traffic moves no kernel bytes for them)
    request = max(plan.global_bytes - merge_bytes, 0)
    kernel_writes = plan.global_write_bytes - (output_bytes if split else 0)
    compulsory = problem.tensor_bytes + 2 * problem.kv_tensor_bytes + kernel_writes
    executed_flops = _executed_flops(plan, terms)
    return (
        float(max(min(compulsory, request), 0)),
        float(request),
        float(merge_bytes),
        float(1 + split),
        float(executed_flops * terms.matmul_passes),
        float(PIPES.index(terms.matmul_pipe)),
        float(max(plan.non_matmul_flops - terms.exps, 0) + terms.shared_lane_ops),
        float(terms.exps),
        float(terms.shared_bytes),
        float(plan.launch.blocks),
        float(resident_blocks(plan, terms, device)),
        float(plan.threads / 32),
        float(terms.ilp),
        float(terms.bytes_in_flight),
        float(terms.pipelined),
        float(terms.imbalance),
        float(terms.softmax_streams),
        float(terms.shared_operands),
    )


def resident_blocks(plan: KernelPlan, terms: CostTerms, device: DeviceProfile) -> int:
    """Blocks an SM holds: the plan's figure, which counts registers once the compiler has
    reported them (``KernelPlan.with_resources``); before that, the family's estimate
    of its registers (``CostTerms.registers``) bounds it too."""
    if plan.resources is not None or not terms.registers:
        return plan.blocks_per_sm
    by_registers = blocks_per_sm_of(plan.threads, plan.launch.shared_bytes, terms.registers, device)
    return min(plan.blocks_per_sm, max(by_registers, 1 if plan.blocks_per_sm else 0))


def feature_table(plans: Sequence[KernelPlan], device: DeviceProfile) -> dict[str, np.ndarray]:
    """``FEATURES`` of many plans, one numpy column each."""
    rows = np.array([plan_features(plan, device) for plan in plans], dtype=float)
    rows = rows.reshape(-1, len(FEATURES))
    return {name: rows[:, i] for i, name in enumerate(FEATURES)}


def _executed_flops(plan: KernelPlan, terms: CostTerms) -> int:
    pairs = plan.problem.batch_heads * terms.executed_pairs
    return 2 * terms.matmuls_per_pair * plan.problem.head_dim * pairs


def matmul_rate(pipe: MatmulPipe, device: DeviceProfile) -> float:
    """Peak FLOP/s of the pipe a family's matmuls run on (``CostTerms.matmul_pipe``)."""
    if pipe == "ffma":
        return device.peak_fp32_tflops * 1e12
    if pipe == "mma_sync_f16":
        return device.peak_mma_f16_tflops * 1e12
    if pipe == "mma_sync_tf32":
        return TF32_RATE_OF_F16 * device.peak_mma_f16_tflops * 1e12
    if pipe == "wgmma_f16":
        return WGMMA_RATE_OF_MMA_SYNC * device.peak_mma_f16_tflops * 1e12
    raise ValueError(f"unknown matmul pipe {pipe!r}")


# ---------------------------------------------------------------------- the model


def model_times(
    table: Mapping[str, np.ndarray], device: DeviceProfile, params: CostParams
) -> dict[str, np.ndarray]:
    """The model on a ``feature_table``: time and parts per plan, in milliseconds."""
    f = table
    with np.errstate(divide="ignore", invalid="ignore"):
        dram_rate = params.dram_efficiency * device.dram_bandwidth_gbps * 1e9
        memory_full = np.maximum(
            f["compulsory_bytes"] / dram_rate,
            f["request_bytes"] / (params.l2_over_dram * dram_rate),
        )
        pipe_rates = np.array(
            [matmul_rate(pipe, device) * params.efficiency_of(pipe) for pipe in PIPES]
        )
        issue_rate = params.issue_efficiency * device.peak_fp32_tflops * 1e12 / 2
        matmul = f["matmul_flops"] / pipe_rates[f["pipe"].astype(int)]
        softmax = f["instructions"] / issue_rate + f["exps"] / (issue_rate / SFU_SLOWDOWN)
        # the shorter side runs under the longer to the extent independent streams hide it
        hidden = 1.0 - (1.0 - params.softmax_hiding) ** (f["softmax_streams"] - 1.0)
        compute = np.maximum(matmul, softmax) + (1.0 - hidden) * np.minimum(matmul, softmax)
        shared_rate = (
            device.shared_bandwidth_bytes_per_clock_per_sm
            * device.sm_count
            * device.clock_ghz
            * 1e9
        )
        shared = f["shared_bytes"] / shared_rate
        efficiency = latency_efficiency_of(f["resident"], f["warps"], f["ilp"], params)
        sm_slowdown = _sm_slowdown(f, device, params)
        memory = memory_full * _memory_slowdown(f, device, params, dram_rate)
        busier = np.maximum(compute, shared)
        q = params.shared_contention
        contended = busier * ((compute / busier) ** q + (shared / busier) ** q) ** (1 / q)
        sm_side = np.where(f["shared_operands"] > 0, contended, busier) * sm_slowdown
        p = np.where(f["pipelined"] > 0, params.overlap, params.overlap_synchronous)
        scale = np.maximum(memory, sm_side)
        kernel = scale * ((memory / scale) ** p + (sm_side / scale) ** p) ** (1 / p)
        kernel = kernel * f["imbalance"]  # the busiest block of a persistent grid ends last
        kernel = np.where(f["resident"] > 0, kernel, np.inf)
        merge = f["merge_bytes"] / dram_rate
        launch = f["launches"] * LAUNCH_OVERHEAD_MS * 1e-3
        return {
            "time_ms": 1e3 * (kernel + merge) + launch * 1e3,
            "kernel_ms": 1e3 * kernel,
            "merge_ms": 1e3 * merge,
            "launch_ms": 1e3 * launch,
            "dram_ms": 1e3 * memory_full,
            "compute_ms": 1e3 * compute,
            "shared_ms": 1e3 * shared,
            "latency_efficiency": efficiency,
        }


def latency_efficiency_of(
    resident: np.ndarray | float,
    warps: np.ndarray | float,
    ilp: np.ndarray | float,
    params: CostParams,
) -> np.ndarray:
    """Fraction of an SM's issue rate that ``resident`` blocks of ``warps`` warps keep busy."""
    in_flight = (
        np.asarray(resident, dtype=float)
        * np.asarray(warps, dtype=float)
        / WARP_SCHEDULERS_PER_SM
        * np.minimum(np.asarray(ilp, dtype=float), params.max_ilp)
    )
    return np.minimum(1.0, in_flight / params.latency_cycles)


def _sm_slowdown(
    f: Mapping[str, np.ndarray], device: DeviceProfile, params: CostParams
) -> np.ndarray:
    """The busiest SM's time over a perfectly spread, fully efficient launch's (>= 1).

    Blocks go round-robin to SMs, so the busiest SM runs ``ceil(blocks / SMs)``
    of them, ``resident`` at a time; a round of ``r`` blocks runs at
    ``latency_efficiency(r)`` of the SM's throughput. With several latency-bound
    waves this is the classic tail factor ``ceil(waves) / waves``; less than a
    wave on fewer SMs than the device has costs the idle SMs.
    """
    resident = np.maximum(f["resident"], 1.0)
    per_sm = f["blocks"] / device.sm_count
    busiest = np.ceil(per_sm)
    full_rounds = np.floor(busiest / resident)
    last = busiest - full_rounds * resident

    def round_time(blocks: np.ndarray) -> np.ndarray:
        efficiency = latency_efficiency_of(blocks, f["warps"], f["ilp"], params)
        return np.where(blocks > 0, blocks / np.maximum(efficiency, 1e-12), 0.0)

    return (full_rounds * round_time(resident) + round_time(last)) / per_sm


def _memory_slowdown(
    f: Mapping[str, np.ndarray], device: DeviceProfile, params: CostParams, dram_rate: float
) -> np.ndarray:
    """The memory side's time over its full-throughput time (>= 1): Little's law per round.

    A round of ``c`` concurrent blocks (``resident`` x SMs at most) draws at most
    ``c x bytes_in_flight / latency``; it takes ``saturating = rate x latency /
    bytes_in_flight`` blocks to reach the sustained rate. Each block moves an equal
    share of the bytes, so a round of ``c`` blocks costs ``max(c, saturating)``
    block-shares.
    """
    blocks = f["blocks"]
    concurrent = np.maximum(f["resident"], 1.0) * device.sm_count
    latency_bytes = dram_rate * params.dram_latency_us * 1e-6
    saturating = np.where(f["bytes_in_flight"] > 0, latency_bytes / f["bytes_in_flight"], 0.0)
    full_rounds = np.floor(blocks / concurrent)
    last = blocks - full_rounds * concurrent
    shares = full_rounds * np.maximum(concurrent, saturating) + np.where(
        last > 0, np.maximum(last, saturating), 0.0
    )
    return shares / blocks


def predict(
    plan: KernelPlan, device: DeviceProfile, params: CostParams | None = None
) -> Prediction:
    """The predicted time of ``plan`` on ``device``. ``inf`` for a plan that cannot run.

    ``params``: the model's constants; default the calibrated ones (``calibrated()``).
    """
    params = params or calibrated()
    times = {
        name: float(value[0])
        for name, value in model_times(feature_table([plan], device), device, params).items()
    }
    terms = plan.kernel_family.cost_terms(plan)
    bounds = {
        "dram": times["dram_ms"],
        "compute": times["compute_ms"],
        "shared": times["shared_ms"],
    }
    bound = max(bounds, key=lambda name: bounds[name])
    kernel_ms = times["kernel_ms"]
    slowdown = kernel_ms / bounds[bound] if bounds[bound] > 0 else math.inf
    return Prediction(
        time_ms=times["time_ms"],
        kernel_ms=kernel_ms,
        merge_ms=times["merge_ms"],
        launch_ms=times["launch_ms"],
        dram_ms=times["dram_ms"],
        compute_ms=times["compute_ms"],
        shared_ms=times["shared_ms"],
        bound=bound,
        slowdown=max(slowdown, 1.0),
        latency_efficiency=times["latency_efficiency"] if plan.blocks_per_sm else 0.0,
        waves=plan.waves,
        read_bytes=plan.global_read_bytes,
        write_bytes=plan.global_write_bytes,
        executed_flops=_executed_flops(plan, terms),
        shared_bytes=terms.shared_bytes,
    )


def predict_time_ms(
    plan: KernelPlan, device: DeviceProfile, params: CostParams | None = None
) -> float:
    return predict(plan, device, params).time_ms


def predict_many(
    plans: Sequence[KernelPlan], device: DeviceProfile, params: CostParams | None = None
) -> list[float]:
    """Predicted times of many plans in one vectorised pass (the search's ranking)."""
    if not plans:
        return []
    times = model_times(feature_table(plans, device), device, params or calibrated())["time_ms"]
    return [float(t) for t in times]


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
