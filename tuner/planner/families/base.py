"""What a kernel family is: one description, from which planning, build and launch follow.

Like CUTLASS's and FlashAttention-3's kernel traits, a family says everything
about its kernel in one place: its tunables and their value ranges, the
dtypes it supports, how a candidate is planned and judged (one-line reasons),
its compile defines and plan key, its source file, entry functions, arch and
extra nvcc flags, the buffers and kernel arguments of a launch, and its
cost-model terms. Nothing else in the project names a family: planner, search
space, cost model, build, backends, reference emulation, registry and plots
ask the families registered in ``tuner.planner.families``.

Pure: stdlib, numpy scalars and the planner's own types.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from tuner.device import DeviceProfile
from tuner.planner.errors import PlanError
from tuner.planner.fixed_width import U32_MAX, div_ceil
from tuner.planner.key_span import span_tiles, visible_padded_pairs_per_head
from tuner.planner.launches import (
    BufferElements,
    DeviceBuffers,
    KernelArgument,
    KernelLaunch,
    kernel_launch,
    pointers,
    scale_log2,
    variant_arguments,
)
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch
from tuner.planner.seed import sequence_parallel_splits
from tuner.problem import Problem

#: the pipes a family's matmul flops can run on; the cost model knows each one's rate
#: (``tuner.costmodel.matmul_rate``): FP32 FFMA on the SIMT lanes, dense
#: bf16/fp16 ``mma.sync`` with fp32 accumulate on the tensor cores, or TF32
#: ``mma.sync`` (m16n8k8, fp32 accumulate) on them.
MatmulPipe = Literal["ffma", "mma_sync_f16", "mma_sync_tf32", "wgmma_f16"]


@dataclass(frozen=True, slots=True)
class Tunable:
    """One tunable: its name (a compile define or launch choice), default and searched values.

    ``axis`` is the name under which the search settings can narrow it
    (``search.<axis>=[...]`` for the built-in families' historical keys, or
    ``search.axes.<axis>``); it defaults to ``<family>_<name>``.
    """

    name: str
    default: int
    values: tuple[int, ...]
    axis: str = ""
    #: the Optuna parameter the sampler proposes it as; default ``<family>.<name>``
    sampler: str = ""
    #: the value a plan stored before this tunable existed ran with (its kernel compiled
    #: the same as with this value); ``None``: such a plan is refused as incomplete
    stored_before: int | None = None


@dataclass(frozen=True, slots=True)
class CostTerms:
    """A family's share of the cost model: what its kernel executes besides the useful work.

    ``executed_pairs``: (query, key) score pairs computed per (batch, head),
    padding included; the matmul flops are ``2 * matmuls_per_pair * head_dim`` per pair
    on ``matmul_pipe`` (2 products a pair forward, 5 backward: ``matmuls_per_pair``).
    ``exps``: exp2 on the SFU (whole problem). The other non-matmul flops
    (``KernelPlan.non_matmul_flops - exps``) and ``shared_lane_ops`` issue at one op per
    lane-instruction.
    ``shared_bytes``: bytes through the shared-memory banks. ``ilp``:
    independent instructions per warp that hide latency. ``matmul_passes``:
    products the pipe executes per useful one (3 for the 3xTF32 split).
    ``bytes_in_flight``: global-memory bytes one block keeps requested ahead of
    its use (a ``cp.async`` ring's prefetched stages, or the tile a block loads
    before its barrier): by Little's law, blocks x these bytes over the DRAM
    latency bound the bandwidth a launch can draw. 0: not modelled (no limit).
    ``pipelined``: the kernel's global loads run ahead of their use (a ``cp.async``
    ring), so memory time overlaps the math; without it a block loads, waits at its
    barrier, then computes, and the two add up more.
    ``registers``: an estimate of the registers a thread takes (what ``ptxas``
    would report), for occupancy where the compiler's report is not at hand (a
    replay, the model backend); 0: no estimate (shared memory and threads alone).
    ``imbalance``: the busiest block's work over the mean block's (>= 1; a persistent
    grid whose blocks carry unequal shares of a work list), which the kernel's time scales by.
    ``softmax_streams``: independent instruction streams of an SM whose softmax can run
    while another's matmuls are in the tensor cores (asynchronous ``wgmma``: one a consumer
    warpgroup, two with the intra-warpgroup overlap); 1: the softmax and the matmuls add up.
    ``shared_operands``: the matmuls read their operands from shared memory themselves
    (``wgmma`` descriptors), so the bank traffic contends with the math rather than only
    bounding it.
    """

    matmul_pipe: MatmulPipe
    executed_pairs: int
    exps: int
    shared_bytes: int
    shared_lane_ops: int
    ilp: int
    matmul_passes: int = 1
    bytes_in_flight: int = 0
    pipelined: bool = False
    registers: int = 0
    matmuls_per_pair: int = 2
    imbalance: float = 1.0
    softmax_streams: int = 1
    shared_operands: bool = False


@dataclass(frozen=True, slots=True)
class OnlinePartition:
    """The online-softmax partition a kernel follows, for the numpy emulation."""

    tile_size: int
    keys_per_split: int
    rows_per_block: int
    splits: int


class KernelFamily(ABC):
    """One kernel family. Subclass, fill the class attributes, implement the abstract methods,
    and register an instance in ``tuner/planner/families/__init__.py``."""

    #: the family's name: plan keys, registry rows and the ``search.families`` setting use it
    name: ClassVar[str]
    #: the CUDA source, a file name under ``kernels/``
    source: ClassVar[str]
    #: entry functions in the cubin; the first is the one whose resources judge the plan
    entry_functions: ClassVar[tuple[str, ...]]
    #: problem dtypes the kernel reads and writes
    dtypes: ClassVar[tuple[str, ...]]
    #: tunables in the order ``KernelParams`` takes them positionally
    tunables: ClassVar[tuple[Tunable, ...]]
    #: the order candidates are enumerated in (outermost first); default: ``tunables``
    enumeration_order: ClassVar[tuple[str, ...]] = ()
    #: names stored params may carry that the family no longer has (ignored when read)
    retired_tunables: ClassVar[frozenset[str]] = frozenset()
    #: nvcc target; None compiles for the device's own arch (``sm_90``); "sm_90a" pins it
    arch: ClassVar[str | None] = None
    #: nvcc flags beyond the build's own
    nvcc_flags: ClassVar[tuple[str, ...]] = ()
    #: two tunables (x, y) the results heatmap plots the best time over, or None
    heatmap_axes: ClassVar[tuple[str, str] | None] = None
    #: whether the kernel takes the attention variants (window, softcap, ALiBi, sinks) of
    #: the shared device layer; a family that does not refuses such problems with a reason
    takes_variants: ClassVar[bool] = True
    #: what the kernel computes: "forward" (the attention) or "backward" (its gradients);
    #: a family plans only problems of its direction (``tuner.problem.DIRECTIONS``)
    direction: ClassVar[str] = "forward"
    #: whether the kernel runs serving batches (``Problem.serving``: a paged KV cache or
    #: ragged lengths, ``[total_q, heads, head_dim]`` queries) instead of dense problems;
    #: a family runs one kind only
    serving: ClassVar[bool] = False

    # ------------------------------------------------------------------ candidates

    def tunable(self, name: str) -> Tunable:
        for tunable in self.tunables:
            if tunable.name == name:
                return tunable
        raise PlanError(f"{self.name} has no tunable {name!r}")

    def axis_name(self, tunable: Tunable) -> str:
        return tunable.axis or f"{self.name}_{tunable.name}"

    def sampler_name(self, tunable: Tunable) -> str:
        return tunable.sampler or f"{self.name}.{tunable.name}"

    def ordered_tunables(self) -> tuple[Tunable, ...]:
        """The tunables in enumeration order (the order the sampler proposes them, too)."""
        order = self.enumeration_order or tuple(t.name for t in self.tunables)
        return tuple(self.tunable(name) for name in order)

    def enumerate_params(
        self, problem: Problem, values: Mapping[str, Sequence[int]]
    ) -> Iterable[KernelParams]:
        """Every coherent combination of the tunables' values (``values``: axis -> values,
        the search settings' narrowing; a tunable without an entry takes its own values),
        less those that differ from an earlier one only in a split target that gives the
        same number of splits (the same plan key: the space keeps the first of a key).
        """
        order = self.enumeration_order or tuple(t.name for t in self.tunables)
        choices = [
            tuple(values.get(self.axis_name(self.tunable(name)), self.tunable(name).values))
            for name in order
        ]
        defaults = tuple((t.name, t.default) for t in self.tunables)  # the params' order
        for name, options in zip(order, choices, strict=True):
            if any(isinstance(v, bool) or not isinstance(v, int) for v in options):
                raise PlanError(f"{self.name}: {name} values {options} are not all integers")
        seen_splits: set[tuple[tuple[int, ...], int]] = set()
        # coherence is a rule over the structural tunables, never the split target: judged
        # once for each combination of the others (the split targets multiply the product)
        split = order.index("split_target") if "split_target" in order else len(order)
        coherent: dict[tuple[int, ...], bool] = {}
        for combination in itertools.product(*choices):
            structure = combination[:split] + combination[split + 1 :]
            known = coherent.get(structure)
            if known is False:
                continue
            chosen = dict(zip(order, combination, strict=True))
            if known is None and not coherent.setdefault(structure, self.coherent(chosen)):
                continue
            splits = self.split_count(problem, chosen)
            if splits is not None:
                others = tuple(v for name, v in chosen.items() if name != "split_target")
                if (others, splits) in seen_splits:
                    continue
                seen_splits.add((others, splits))
            yield KernelParams.of_checked(
                self.name, tuple((n, chosen.get(n, default)) for n, default in defaults)
            )

    def coherent(self, values: Mapping[str, int]) -> bool:
        """Whether a combination of tunable values names a kernel at all, whatever the
        problem (the ping-pong without the overlap it orders does not); a rule over the
        structural tunables that never reads ``split_target``. The space enumerates
        coherent ones only: the others would be rejected for every problem, by the
        thousand, drowning the reasons that matter. ``plan`` still refuses one asked for
        directly, with its reason. Default: every combination is."""
        return True

    def split_count(self, problem: Problem, values: Mapping[str, int]) -> int | None:
        """The sequence splits ``values`` give ``problem``, for a family whose plan key
        names its splits rather than its ``split_target`` (None: not known before
        planning, every target is planned)."""
        return None

    # ------------------------------------------------------------------ planning

    @abstractmethod
    def plan(self, problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
        """The plan of one candidate, feasible or with a one-line reason. ``PlanError`` only
        for parameters no problem could take (a zero tile)."""

    @abstractmethod
    def compile_defines(self, plan: KernelPlan) -> dict[str, int]:
        """The compile-time constants of the plan's kernel."""

    @abstractmethod
    def key(self, plan: KernelPlan) -> str:
        """A name that identifies the candidate within one problem; starts with the family."""

    def arch_for(self, device_arch: str) -> str:
        return self.arch or device_arch

    def takes(self, problem: Problem) -> bool:
        """Whether the problem's dtype and direction are this family's (else it is no
        candidate at all)."""
        return problem.dtype in self.dtypes and problem.direction == self.direction

    def direction_verdict(self, problem: Problem) -> str:
        """Why this family cannot run the problem's direction ("" when it can)."""
        if problem.direction != self.direction:
            return (
                f"{self.name} computes the {self.direction} pass, not the {problem.direction} pass"
            )
        return ""

    def takes_layout(self, problem: Problem) -> bool:
        """Whether the problem's layout (serving batch or dense) is this family's."""
        return problem.serving == self.serving

    def variant_verdict(self, problem: Problem) -> str:
        """Why this family cannot run the problem's layout or attention variant ("" when
        it can)."""
        if not self.takes_layout(problem):
            if problem.serving:
                return (
                    f"{problem.serving_text()} is a serving batch: the work-list family "
                    f"runs it, not {self.name}"
                )
            return f"{self.name} runs serving batches (page_size, lengths), not dense problems"
        if problem.has_variant and not self.takes_variants:
            return (
                f"{self.name} takes no attention variants ({problem.variant_text()}); the "
                "tensor-core families do"
            )
        return ""

    # ------------------------------------------------------------------ launch

    def buffer_elements(self, plan: KernelPlan) -> BufferElements:
        """q, k, v, out in the problem's dtype; float32 split scratch when splits > 1."""
        p = plan.problem
        tensor = p.batch_heads * p.seq_len * p.head_dim
        if plan.sequence_splits == 1:
            return BufferElements(tensor, 0, 0, p.element_bytes)
        rows = p.batch_heads * plan.sequence_splits * p.seq_len
        # The shared split merge's contract: one log2-sum-exp per row and split.
        return BufferElements(tensor, rows * p.head_dim, rows, p.element_bytes)

    @abstractmethod
    def launches(self, plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
        """The launches of one run of the plan, in order, with their arguments."""

    def work_buffer(self, plan: KernelPlan) -> np.ndarray | None:
        """The int32 work list a serving family's launches read from ``buffers.work`` (the
        plan's, on its problem's sample), or None for a family without one."""
        return None

    # ------------------------------------------------------------------ models

    @abstractmethod
    def cost_terms(self, plan: KernelPlan) -> CostTerms:
        """The family's terms of the cost model (see ``CostTerms``)."""

    def online_partition(self, plan: KernelPlan) -> OnlinePartition:
        return OnlinePartition(
            plan.tile_size, plan.keys_per_sequence_split, plan.rows_per_block, plan.sequence_splits
        )


# ---------------------------------------------------------------------- shared rules


def variant_sfu_ops(problem: Problem, executed_pairs: int) -> int:
    """SFU operations a variant adds per (batch, head) besides the exp2s: the softcap's tanh
    on every computed score."""
    return executed_pairs if problem.softcap > 0 else 0


def variant_defines(problem: Problem) -> dict[str, int]:
    """The compile-time half of the problem's variant (``kernels/include/fa/variant.cuh``):
    a define for each that is on, none for a plain problem (whose kernels, cache keys and
    variant names stay what they were)."""
    flags = {
        "WINDOW": problem.windowed,
        "SOFTCAP": problem.softcap > 0,
        "ALIBI": problem.alibi,
        "SINKS": problem.sinks,
    }
    return {name: 1 for name, on in flags.items() if on}


def checked_u32(value: int, what: str) -> int:
    if value > U32_MAX:
        raise PlanError(f"Fix: {what} overflows u32: {value} > {U32_MAX}.")
    return value


def splits_over_key_tiles(problem: Problem, values: Mapping[str, int]) -> int | None:
    """``split_count`` of a family that splits the key span's ``block_n``-key tiles by its
    ``split_target`` (``sequence_parallel_splits``), as ``plan`` does (None for
    values that ``plan`` refuses: it says why)."""
    block_n, target = values["block_n"], values["split_target"]
    if block_n <= 0 or target <= 0 or target > U32_MAX:
        return None
    return sequence_parallel_splits(span_tiles(problem, block_n), target=target)


def launch_verdict(threads: int, shared_bytes: int, device: DeviceProfile) -> str:
    """Thread count and shared memory against the device's block limits ("" when fine)."""
    if threads <= 0 or threads % device.warp_size:
        return f"threads={threads} is not a positive multiple of {device.warp_size}"
    if threads > device.max_threads_per_block:
        return f"threads={threads} exceeds the {device.max_threads_per_block}-thread block limit"
    if shared_bytes > device.max_shared_memory_per_block_optin:
        return (
            f"shared memory {shared_bytes} B exceeds the device's per-block opt-in limit "
            f"{device.max_shared_memory_per_block_optin} B"
        )
    return ""


def larger_than_needed(size: int, seq_len: int, smallest: int) -> bool:
    """A size is wasteful when half of it already covers the sequence.

    ``smallest`` keeps the smallest useful size feasible for tiny sequences,
    so every problem has at least one candidate of each family.
    """
    return size // 2 >= seq_len and size // 2 >= smallest


def key_rows_read_per_head(
    n: int, rows_per_block: int, causal: bool, kv_len: int | None = None
) -> int:
    """Key rows all blocks of one query head read: once per block of query rows.

    This is the reuse ``rows_per_block`` buys: K and V cross the memory bus
    once per block, not once per query row. ``kv_len`` (default ``n``) keys;
    causal masking is bottom-right aligned (row ``r`` sees ``r + kv_len - n + 1``).
    """
    m = n if kv_len is None else kv_len
    offset = m - n
    blocks = div_ceil(n, rows_per_block)
    if not causal:
        return blocks * m
    # Block b attends keys [0, min(m, (b+1)*rows_per_block + offset)): the first
    # `full` blocks end inside the keys, the rest (at most one) read all m keys.
    full = n // rows_per_block
    return rows_per_block * full * (full + 1) // 2 + full * offset + (blocks - full) * m


def executed_pairs(plan: KernelPlan, rows: int) -> int:
    """(query, key) pairs whose scores the kernel computes, per (batch, head).

    Query rows are padded to whole blocks of ``rows`` and keys to whole tiles
    (masked scores are computed, then discarded). Causal blocks stop at their
    last row's tile: block ``b`` of ``R`` rows computes about
    ``(b + 1) R + kv_len - seq_len + T / 2`` keys; the closed form avoids a loop
    over blocks for long sequences. A window's blocks visit only their band's tiles
    (``tuner.planner.key_span``).
    """
    if plan.problem.windowed:
        return visible_padded_pairs_per_head(plan.problem, rows, plan.tile_size)
    n = plan.problem.seq_len
    tile = plan.tile_size
    row_blocks = -(-n // rows)
    padded_rows = row_blocks * rows
    padded_keys = plan.tile_count * tile
    if not plan.problem.causal:
        return padded_rows * padded_keys
    offset = plan.problem.causal_offset
    causal = rows * (rows * row_blocks * (row_blocks + 1) // 2 + row_blocks * (tile // 2 + offset))
    return min(causal, padded_rows * padded_keys)


#: threads a block of the float4 split merge (``*_split_merge`` of the tensor-core families)
MERGE_THREADS = 128


def float4_merge_launch(
    batch_heads: int, seq_len: int, head_dim: int, splits: int
) -> Launch | None:
    """The split merge's launch for kernels whose merge gives a thread one float4 of output
    (mma_f16, mma_tf32, decode_f16, wgmma_f16); None without splits."""
    if splits <= 1:
        return None
    blocks = div_ceil(batch_heads * seq_len * (head_dim // 4), MERGE_THREADS)
    return Launch(grid=(blocks, 1, 1), block=(MERGE_THREADS, 1, 1), shared_bytes=0)


def split_kv_launches(
    plan: KernelPlan,
    buffers: DeviceBuffers,
    attention_function: str,
    merge_function: str,
    leading: tuple[KernelArgument, ...] = (),
    trailing: tuple[KernelArgument, ...] = (),
) -> tuple[KernelLaunch, ...]:
    """The launches of a family on the split-KV contract, which every tiled and tensor-core
    family keeps: ``attention_function(q, k, v, out, partial_o, partial_stats, seq_len,
    kv_len, group, keys_per_split, scale_log2, heads, window_left, window_right, softcap,
    alibi_slopes, sinks, lse)`` on ``plan.launch``, then the split merge
    (``with_split_merge``) when there are splits. ``leading`` arguments come first (a TMA
    family's tensor maps), ``trailing`` ones last (a persistent family's queue length)."""
    p = plan.problem
    attention = kernel_launch(
        plan.launch,
        attention_function,
        (
            *leading,
            *pointers(buffers),
            np.int32(p.seq_len),
            np.int32(p.kv_len),
            np.int32(p.group),
            np.int32(plan.keys_per_sequence_split),
            np.float32(scale_log2(p.head_dim)),
            *variant_arguments(p, buffers),
            *trailing,
        ),
    )
    return with_split_merge(plan, attention, merge_function, buffers)


def with_split_merge(
    plan: KernelPlan, attention: KernelLaunch, merge_function: str, buffers: DeviceBuffers
) -> tuple[KernelLaunch, ...]:
    """``attention`` alone without splits; with them, followed by the split merge.

    Every family's merge kernel (``kernels/include/fa/split_merge.cuh``) takes
    ``(partial_o, partial_lse, out, seq_len, splits, batch_heads * seq_len, heads, sinks,
    lse)`` and runs on ``plan.reduce_launch``; the sinks join there, and the merged rows'
    log-sum-exps are written there.
    """
    if plan.sequence_splits == 1:
        return (attention,)
    if not (buffers.partial_o and buffers.partial_ml):
        raise ValueError(f"{plan.key()} needs split buffers; none were given")
    if plan.reduce_launch is None:
        raise ValueError(f"{plan.key()} has {plan.sequence_splits} splits but no merge launch")
    p = plan.problem
    merge = kernel_launch(
        plan.reduce_launch,
        merge_function,
        (
            np.uintp(buffers.partial_o),
            np.uintp(buffers.partial_ml),
            np.uintp(buffers.out),
            np.int32(p.seq_len),
            np.int32(plan.sequence_splits),
            np.int32(p.batch_heads * p.seq_len),
            np.int32(p.heads),
            np.uintp(buffers.sinks),
            np.uintp(buffers.lse),
        ),
    )
    return (attention, merge)
