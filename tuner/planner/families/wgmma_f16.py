"""``wgmma_f16`` (``kernels/wgmma_f16.cu``): Hopper FlashAttention forward on ``wgmma.mma_async``.

A block is one producer warpgroup (one thread issues TMA loads) and ``consumers`` (1 to 3)
consumer warpgroups of 64 query rows each (``block_m = 64 * consumers``: three make
FlashAttention-3's 192-row blocks of head_dim 64, at 160 registers a consumer); with
``overlap`` a consumer runs the softmax of tile t while P V of tile t-1 is in the tensor cores
(FlashAttention-3's intra-warpgroup overlap), and with ``pingpong`` as well the consumers take
turns issuing their GEMMs, round robin (FlashAttention-3's inter-warpgroup ping-pong: one
group's softmax under the others' GEMMs); with ``staged_store`` a consumer's output goes out
through its (dead) Q tile instead of from the fragments: 1 in whole 16-byte rows by the
consumer's threads, 2 by TMA stores (FlashAttention-3's epilogue) one thread issues; with
``persistent`` a grid of one block per SM slot walks a static queue of row blocks (heaviest
first under causal), its producer loading the next row block's K, V and Q while the consumers
finish the last (FlashAttention-3's static persistent scheduler); with ``late_pack`` (and
``overlap``) P(t) is packed to 16 bits only once P V(t-1) has landed, into one register set
(FlashAttention-3's order: S + P + O live at the peak, not S + 2P + O, what 176-key tiles at
head_dim 128 and 80-key ones at 256 need); with ``rescale_slack`` (and ``overlap``) a row's
running max moves only when a tile's passes it by more than that many (log2 units), so most
tiles skip the output's rescale (FlashAttention-4's conditional rescaling; exact, as the sum
and the output share the max). K/V tiles of ``block_n`` keys (64 to 192, whole
k16 steps) stream through a ``stages``-deep ring in shared memory in the 128-byte swizzle
(the 64-byte one at head_dim 96); S = Q K^T and O += P V are ``wgmma`` m64nNk16 products with
fp32 accumulators in the consumers' registers; ``setmaxnreg`` gives the producer 24
registers a thread and the consumers the rest of 64K / ``blocks_per_sm``. Long key ranges
split over blocks as in ``mma_f16`` (same split contract and merge).

Feasibility (one-line reasons): sm_90 only (wgmma, setmaxnreg: sm_90a); head_dim 64, 96,
128, 192 or 256 (whole swizzled rows: 64 two-byte elements in the 128-byte swizzle, 32 in
the 64-byte one that head_dim 96 takes); the shared-memory ring against the block and SM
limits; the register split (the consumers' accumulators fit the setmaxnreg target, the
targets fit the register file); the TMA's box and stride limits; and the swizzle atom's
alignment of every tile.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tuner.device import DeviceProfile
from tuner.planner.errors import PlanError
from tuner.planner.families.base import (
    CostTerms,
    KernelFamily,
    Tunable,
    checked_u32,
    executed_pairs,
    float4_merge_launch,
    larger_than_needed,
    launch_verdict,
    split_kv_launches,
    splits_over_key_tiles,
    variant_defines,
    variant_sfu_ops,
)
from tuner.planner.families.mma_f16 import DEFAULT_SPLIT_TARGETS
from tuner.planner.fixed_width import U32_MAX, div_ceil
from tuner.planner.key_span import (
    persistent_imbalance,
    span_tiles,
    visible_keys_read_per_head,
)
from tuner.planner.launches import DeviceBuffers, KernelLaunch, TensorMap
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch, occupancy_and_waves
from tuner.planner.seed import sequence_parallel_splits, split_reduce_scratch_elements
from tuner.problem import Problem

ELEMENT_BYTES = 2
F32_BYTES = 4
#: rows a consumer warpgroup owns: the M of wgmma m64nNk16
WARPGROUP_ROWS = 64
WARPGROUP_THREADS = 128
#: the 128-byte swizzle: a row of 64 two-byte elements; the pattern repeats every 8 rows.
#: head_dims that are not whole 128-byte rows (96) take the 64-byte swizzle (32 elements).
SWIZZLE_ROW_BYTES = 128
NARROW_SWIZZLE_ROW_BYTES = 64
SWIZZLE_ATOM_ROWS = 8
#: TMA limits (cuTensorMapEncodeTiled): box dimensions, global strides, global dimensions
TMA_MAX_BOX = 256
TMA_STRIDE_ALIGN = 16
TMA_MAX_GLOBAL_DIM = 1 << 32
#: setmaxnreg: the producer's count, the largest count, and its granularity
PRODUCER_REGISTERS = 24
MAX_CONSUMER_REGISTERS = 240
SETMAXNREG_STEP = 8
SM90_REGISTERS_PER_SM = 65536
#: a consumer thread's registers besides its accumulators and P fragments (addresses, row
#: statistics, loop state, and what ptxas spends on scheduling: more where it has more):
#: 16 and a tenth of its setmaxnreg target. Calibrated on ptxas (nvcc 13.0, sm_90a):
#: at 240 a consumer (overhead 40), late-packed 176-key tiles at head_dim 128 (S + P + O =
#: 196) and 80-key tiles at 256 (188) compile clean, 192-key tiles at 128 (208) spill; two-set
#: 128-key tiles at 128 (192) compile clean, 80-key ones at 256 (208) spill. At 160 (three
#: consumers, overhead 32), late-packed 128-key tiles at head_dim 64 (128) and 96-key ones at
#: 96 (120) compile clean, 112-key ones at 96 (132) spill 24-156 B, 144-key ones at 64 (140)
#: 192 B. The compiler's report (spills, serialised wgmma) is the final word; this screens
#: the rest.
CONSUMER_OVERHEAD_REGISTERS = 16
CONSUMER_OVERHEAD_PER_TARGET = 10
#: the kernel's head dims (whole swizzle rows) and key tiles (wgmma N of the S product)
HEAD_DIMS = (64, 96, 128, 192, 256)
#: (any whole number of k16 steps for P V; FlashAttention-3 takes 176 at head_dim 128, 144
#: at 96, 112 at 192 and 80 at 256, where shared memory or registers stop 128)
BLOCK_NS = (64, 80, 96, 112, 128, 144, 160, 176, 192)
GRID_YZ_LIMIT = 65535
#: as mma_f16: scaled subtract, max, sum, pack, exp2 per (query, key) pair
NON_MATMUL_FLOPS_PER_PAIR = 5
#: mbarriers: q_full and q_empty, then k_full, v_full, k_empty and v_empty per stage; 8 B each
BARRIER_BYTES = 8
#: the kernel rounds its dynamic shared base up to 1024 bytes: it asks for that much more
ALIGNMENT_SLACK = 1024
#: ``staged_store``'s value for the epilogue by TMA stores (1: the threads' 16-byte rows)
TMA_STORE = 2
#: the plan key's mark of each ``staged_store`` (none when off: keys from before stay valid)
STORE_KEYS = ("", "/ss", "/ts")
#: ``rescale_slack``'s on value, log2 units (FlashAttention-4's threshold): the running max
#: moves only when a tile's passes it by more, so most tiles skip the output's rescale
RESCALE_SLACK = 8


def wgmma_f16_shared_bytes(consumers: int, block_n: int, stages: int, head_dim: int) -> int:
    """Dynamic shared memory of ``kernels/wgmma_f16.cu`` (its SMEM_BYTES): each consumer's Q
    tile, the K and V ring, the mbarriers, and the alignment slack."""
    q_tiles = consumers * WARPGROUP_ROWS * head_dim * ELEMENT_BYTES
    ring = 2 * stages * block_n * head_dim * ELEMENT_BYTES
    return q_tiles + ring + BARRIER_BYTES * (2 + 4 * stages) + ALIGNMENT_SLACK


def consumer_registers(consumers: int, blocks_per_sm: int, registers_per_sm: int) -> int:
    """The consumers' setmaxnreg target: what the SM's registers leave a consumer thread
    once the producer has its 24 (rounded down to 8, at most 240): 240 with one or two
    consumers, 160 with three."""
    per_thread = registers_per_sm // blocks_per_sm // WARPGROUP_THREADS
    share = (per_thread - PRODUCER_REGISTERS) // consumers
    return min(MAX_CONSUMER_REGISTERS, share // SETMAXNREG_STEP * SETMAXNREG_STEP)


def consumer_registers_needed(
    block_n: int,
    head_dim: int,
    overlap: bool = False,
    late_pack: bool = False,
    target: int = MAX_CONSUMER_REGISTERS,
) -> int:
    """S and O accumulators (m64nN f32: N / 2 a thread), P's 16-bit pairs (block_n / 4;
    two sets with ``overlap``, where P(t) is packed while P V(t-1) still reads P(t-1), one
    with ``late_pack``, where it is packed once that product has landed), and the rest at a
    setmaxnreg ``target`` (``CONSUMER_OVERHEAD_REGISTERS``)."""
    p_sets = 2 if overlap and not late_pack else 1
    accumulators = block_n // 2 + head_dim // 2 + p_sets * block_n // 4
    return accumulators + CONSUMER_OVERHEAD_REGISTERS + target // CONSUMER_OVERHEAD_PER_TARGET


def swizzle_row_bytes(head_dim: int) -> int:
    """The kernel's swizzle span for ``head_dim`` (its SWIZZLE_BYTES): 128 bytes where rows
    are whole 64-element chunks, else 64 (head_dim 96: chunks of 32 elements)."""
    if head_dim * ELEMENT_BYTES % SWIZZLE_ROW_BYTES == 0:
        return SWIZZLE_ROW_BYTES
    return NARROW_SWIZZLE_ROW_BYTES


def tma_verdict(head_dim: int, rows: int, heads: int, box_rows: int) -> str:
    """A 3-D tensor map {head_dim, rows, heads} with a box {swizzle row, box_rows, 1}
    ("" when fine)."""
    if box_rows > TMA_MAX_BOX:
        return f"a TMA box of {box_rows} rows exceeds the {TMA_MAX_BOX}-element box limit"
    row_bytes = head_dim * ELEMENT_BYTES
    if row_bytes % TMA_STRIDE_ALIGN or (rows * row_bytes) % TMA_STRIDE_ALIGN:
        return f"TMA strides of {row_bytes} B are not multiples of {TMA_STRIDE_ALIGN}"
    if max(rows, heads) >= TMA_MAX_GLOBAL_DIM:
        return f"{rows} rows x {heads} heads exceed the TMA's 2^32 global dimension"
    return ""


def swizzle_verdict(consumers: int, block_n: int, stages: int, head_dim: int) -> str:
    """Every tile's column chunks start on a swizzle atom (8 rows of the swizzle span) and
    the rows are whole chunks ("" when they do)."""
    row = swizzle_row_bytes(head_dim)
    atom = SWIZZLE_ATOM_ROWS * row
    if head_dim * ELEMENT_BYTES % row:
        return f"head_dim={head_dim} is not whole {row}-byte swizzle rows"
    chunks = head_dim * ELEMENT_BYTES // row
    offsets = [c * WARPGROUP_ROWS * row for c in range(chunks * consumers)]
    ring = consumers * WARPGROUP_ROWS * head_dim * ELEMENT_BYTES
    offsets += [ring + c * block_n * row for c in range(2 * stages * chunks)]
    misaligned = [o for o in offsets if o % atom]
    if misaligned:
        return f"tiles at {misaligned[:3]} B miss the {row}-byte swizzle's {atom}-byte atoms"
    return ""


def structure_verdict(values: Mapping[str, int]) -> str:
    """Why a combination of tunables names no kernel, whatever the problem ("" when it does):
    the ping-pong orders two or three overlapped consumers, late packing and the rescale slack
    change the overlapped loop, and two blocks share an SM only with one consumer each.
    ``plan`` refuses with this reason; the enumeration skips these (``coherent``)."""
    consumers, overlapped = values["consumers"], values["overlap"] == 1
    if values["pingpong"] == 1 and (consumers < 2 or not overlapped):
        return "the ping-pong takes turns between two or three consumers, with overlap=1"
    if values["late_pack"] == 1 and not overlapped:
        return "late_pack orders the overlapped loop's packing: it needs overlap=1"
    if values["rescale_slack"] != 0 and not overlapped:
        return "rescale_slack skips the overlapped loop's rescales: it needs overlap=1"
    if values["blocks_per_sm"] == 2 and consumers != 1:
        return f"blocks_per_sm=2 with {consumers} consumers: 2 only with 1"
    return ""


def wgmma_tensor_maps(plan: KernelPlan, buffers: DeviceBuffers) -> tuple[TensorMap, ...]:
    """The kernel's Q, K and V maps, and with ``staged_store=2`` (TMA stores) the output's:
    3-D ``{head_dim, rows, heads}`` (row-major ``[heads][rows][head_dim]``), a box of one
    swizzle row (64 columns in the 128-byte swizzle, 32 in the 64-byte one at head_dim 96) by
    a consumer's 64 query rows or a ``block_n``-key tile. Rows past a head's end read as
    zeros, which the kernel masks (keys) or does not store (queries); the TMA does not write
    them."""
    p = plan.problem
    d, row_bytes = p.head_dim, p.head_dim * ELEMENT_BYTES
    swizzle = swizzle_row_bytes(d)

    def map_over(buffer: str, address: int, rows: int, heads: int, box_rows: int) -> TensorMap:
        return TensorMap(
            buffer=buffer,
            address=address,
            dtype=p.dtype,
            dims=(d, rows, heads),
            strides_bytes=(row_bytes, rows * row_bytes),
            box=(swizzle // ELEMENT_BYTES, box_rows, 1),
            swizzle_bytes=swizzle,
        )

    kv_heads = p.batch * p.kv_heads
    block_n = plan.params.block_n
    maps = (
        map_over("q", buffers.q, p.seq_len, p.batch_heads, WARPGROUP_ROWS),
        map_over("k", buffers.k, p.kv_len, kv_heads, block_n),
        map_over("v", buffers.v, p.kv_len, kv_heads, block_n),
    )
    if plan.params.staged_store == TMA_STORE:
        maps += (map_over("out", buffers.out, p.seq_len, p.batch_heads, WARPGROUP_ROWS),)
    return maps


class WgmmaF16(KernelFamily):
    name = "wgmma_f16"
    source = "wgmma_f16.cu"
    entry_functions = ("wgmma_f16_attention", "wgmma_f16_split_merge")
    dtypes = ("bfloat16", "float16")
    arch = "sm_90a"
    tunables = (
        Tunable("consumers", 2, (1, 2, 3)),
        Tunable("block_n", 128, BLOCK_NS),
        Tunable("stages", 2, (2, 3, 4)),
        Tunable("blocks_per_sm", 1, (1, 2)),
        Tunable("overlap", 0, (0, 1)),
        Tunable("split_target", 1 << 16, DEFAULT_SPLIT_TARGETS),
        # plans stored before the ping-pong existed ran without it (the same SASS)
        Tunable("pingpong", 0, (0, 1), stored_before=0),
        # 1: through shared memory in 16-byte rows; 2 (TMA_STORE): by TMA stores
        Tunable("staged_store", 0, (0, 1, TMA_STORE), stored_before=0),
        Tunable("persistent", 0, (0, 1), stored_before=0),
        Tunable("late_pack", 0, (0, 1), stored_before=0),
        Tunable("rescale_slack", 0, (0, RESCALE_SLACK), stored_before=0),
    )
    heatmap_axes = ("block_n", "consumers")

    def plan(self, problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
        n, d, bh, kv_len = problem.seq_len, problem.head_dim, problem.batch_heads, problem.kv_len
        consumers, block_n, stages = params.consumers, params.block_n, params.stages
        blocks_per_sm, target = params.blocks_per_sm, params.split_target
        if min(consumers, block_n, stages, blocks_per_sm, target) <= 0:
            raise PlanError(
                f"consumers={consumers}, block_n={block_n}, stages={stages}, "
                f"blocks_per_sm={blocks_per_sm}, split_target={target}: each must be > 0"
            )
        block_m = WARPGROUP_ROWS * consumers
        threads = WARPGROUP_THREADS * (consumers + 1)
        tile_count = span_tiles(problem, block_n)
        splits = sequence_parallel_splits(tile_count, target=target)
        tiles_per_split = div_ceil(tile_count, splits)
        keys_per_split = checked_u32(block_n * tiles_per_split, "split key span")
        shared = wgmma_f16_shared_bytes(consumers, block_n, stages, d)
        registers = consumer_registers(consumers, blocks_per_sm, device.registers_per_sm)
        needed = consumer_registers_needed(
            block_n, d, bool(params.overlap), bool(params.late_pack), registers
        )
        row_blocks = div_ceil(n, block_m)
        slots = device.sm_count * blocks_per_sm  # blocks resident at once

        reason = ""
        if problem.dtype not in self.dtypes:
            reason = f"dtype {problem.dtype} is not one of {', '.join(self.dtypes)}"
        elif device.compute_capability != (9, 0):
            reason = f"wgmma and setmaxnreg need sm_90a; the device is {device.arch}"
        elif d not in HEAD_DIMS:
            reason = f"head_dim={d} is not one of {HEAD_DIMS} (whole swizzle rows)"
        elif consumers not in (1, 2, 3):
            reason = f"consumers={consumers}: one to three consumer warpgroups"
        elif block_n not in BLOCK_NS:
            reason = f"block_n={block_n} is not one of {BLOCK_NS}"
        elif not 2 <= stages <= 4:
            reason = f"stages={stages}: the ring holds 2 to 4 stages"
        elif params.overlap not in (0, 1):
            reason = f"overlap={params.overlap}: 0 or 1"
        elif params.pingpong not in (0, 1):
            reason = f"pingpong={params.pingpong}: 0 or 1"
        elif params.late_pack not in (0, 1):
            reason = f"late_pack={params.late_pack}: 0 or 1"
        elif params.rescale_slack not in (0, RESCALE_SLACK):
            reason = f"rescale_slack={params.rescale_slack}: 0 or {RESCALE_SLACK}"
        elif params.staged_store not in (0, 1, TMA_STORE):
            reason = (
                f"staged_store={params.staged_store}: 0, 1 (16-byte rows) or {TMA_STORE} "
                "(TMA stores)"
            )
        elif blocks_per_sm not in (1, 2):
            reason = f"blocks_per_sm={blocks_per_sm}: 1 or 2"
        elif structural := structure_verdict(params.tunables):
            reason = structural
        elif params.staged_store and splits > 1:
            reason = f"staged_store stores a whole output; {splits} splits store partials"
        elif params.persistent not in (0, 1):
            reason = f"persistent={params.persistent}: 0 or 1"
        elif params.persistent and splits > 1:
            reason = f"a persistent block walks whole row blocks; {splits} splits store partials"
        elif params.persistent and row_blocks * bh <= slots:
            reason = (
                f"{row_blocks * bh} row blocks fill at most one wave of {slots} SM slots: "
                "nothing for a persistent block to walk"
            )
        if not reason:
            reason = self.variant_verdict(problem) or launch_verdict(threads, shared, device)
        if not reason and blocks_per_sm * (shared + device.reserved_shared_memory_per_block) > (
            device.shared_memory_per_sm
        ):
            reason = (
                f"{blocks_per_sm} blocks of {shared} B shared memory exceed the SM's "
                f"{device.shared_memory_per_sm} B"
            )
        if not reason and registers < needed:
            reason = (
                f"a consumer thread needs about {needed} registers; setmaxnreg can give "
                f"{registers} with {consumers} consumers and {blocks_per_sm} blocks an SM"
            )
        if not reason:
            reason = (
                tma_verdict(d, n, bh, WARPGROUP_ROWS)
                or tma_verdict(d, kv_len, problem.batch * problem.kv_heads, block_n)
                or swizzle_verdict(consumers, block_n, stages, d)
            )
        if not reason and larger_than_needed(block_m, n, WARPGROUP_ROWS):
            reason = f"block_m={block_m} is larger than needed for seq_len={n}"
        if not reason and larger_than_needed(block_n, kv_len, min(BLOCK_NS)):
            reason = f"block_n={block_n} is larger than needed for kv_len={kv_len}"
        if not reason and (splits > GRID_YZ_LIMIT or bh > GRID_YZ_LIMIT):
            reason = f"{splits} splits x {bh} batch-heads exceed the grid's y/z limit"
        partial = bh * splits * n * (d + 1) if splits > 1 else 0
        if not reason and partial > U32_MAX:
            reason = f"split scratch of {partial} floats overflows u32"

        # the work's grid; a persistent plan launches one block per SM slot to walk it
        work = Launch(grid=(row_blocks, splits, bh), block=(threads, 1, 1), shared_bytes=shared)
        launch = work
        if params.persistent == 1:
            persistent_blocks = min(slots, row_blocks * bh)
            launch = Launch(grid=(persistent_blocks, 1, 1), block=work.block, shared_bytes=shared)
        reduce_launch = float4_merge_launch(bh, n, d, splits)
        element = problem.element_bytes
        key_rows = visible_keys_read_per_head(problem, block_m, block_n)
        read = element * bh * (n * d + 2 * key_rows * d)
        write = element * bh * n * d
        if splits > 1:
            read += F32_BYTES * partial
            write += F32_BYTES * partial
        non_matmul = bh * (
            problem.attended_pairs * NON_MATMUL_FLOPS_PER_PAIR
            + n * tile_count * (d + 4)
            + n * (splits - 1) * d * 3
        )
        # __launch_bounds__(threads, blocks_per_sm) and the setmaxnreg split hold the SM to
        # blocks_per_sm blocks, whatever shared memory would allow.
        # (waves count the work's row blocks, which a persistent grid walks in as many)
        occupancy, waves = occupancy_and_waves(work, threads, blocks_per_sm, device)
        return KernelPlan(
            problem=problem,
            params=params,
            tile_size=block_n,
            tile_count=tile_count,
            sequence_splits=splits,
            tiles_per_sequence_split=tiles_per_split,
            keys_per_sequence_split=keys_per_split,
            split_reduce_scratch_elements=split_reduce_scratch_elements(splits, d),
            parallel_workgroups_per_row=splits,
            rows_per_block=block_m,
            threads_per_row=4,  # a row's scores live in a quad of lanes, as with mma.sync
            rows_per_thread=2,
            launch=launch,
            reduce_launch=reduce_launch,
            global_read_bytes=read,
            global_write_bytes=write,
            matmul_flops=problem.useful_flops,
            non_matmul_flops=non_matmul,
            blocks_per_sm=blocks_per_sm,
            occupancy=occupancy,
            waves=waves,
            feasible=not reason,
            reason=reason,
        )

    def coherent(self, values: Mapping[str, int]) -> bool:
        return not structure_verdict(values)

    def split_count(self, problem: Problem, values: Mapping[str, int]) -> int | None:
        return splits_over_key_tiles(problem, values)

    def compile_defines(self, plan: KernelPlan) -> dict[str, int]:
        p, params = plan.problem, plan.params
        return {
            "HEAD_DIM": p.head_dim,
            "CONSUMERS": params.consumers,
            "BLOCK_N": params.block_n,
            "STAGES": params.stages,
            "CAUSAL": int(p.causal),
            "IS_FP16": int(p.dtype == "float16"),
            "BLOCKS_PER_SM": params.blocks_per_sm,
            "OVERLAP": params.overlap,
            "PINGPONG": params.pingpong,
            "STAGED_STORE": params.staged_store,
            "PERSISTENT": params.persistent,
            "LATE_PACK": params.late_pack,
            "PRODUCER_REGISTERS": PRODUCER_REGISTERS,
            # Every sm_90 part has 64K registers an SM (plans carry no device profile).
            "CONSUMER_REGISTERS": consumer_registers(
                params.consumers, params.blocks_per_sm, SM90_REGISTERS_PER_SM
            ),
            **variant_defines(p),
            # only when on: the variants (and cached cubins) of plans without it keep their keys
            **({"FA_RESCALE_SLACK": params.rescale_slack} if params.rescale_slack else {}),
        }

    def key(self, plan: KernelPlan) -> str:
        params = plan.params
        # "/p1", "/ss" (or "/ts": TMA stores), "/ps", "/lp" and "/r8" (the rescale slack)
        # only when on: the keys registries hold from before stay valid
        extras = (
            ("/p1" if params.pingpong else "")
            + STORE_KEYS[params.staged_store]
            + ("/ps" if params.persistent else "")
            + ("/lp" if params.late_pack else "")
            + (f"/r{params.rescale_slack}" if params.rescale_slack else "")
        )
        return (
            f"wgmma_f16/c{params.consumers}/n{params.block_n}/st{params.stages}"
            f"/b{params.blocks_per_sm}/o{params.overlap}{extras}/s{plan.sequence_splits}"
        )

    def launches(self, plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
        """The split-KV contract's launches, the attention kernel's led by its tensor maps
        (Q, K, V; and O with TMA stores) and ended by ``batch_heads`` (the persistent queue's
        second factor)."""
        return split_kv_launches(
            plan,
            buffers,
            *self.entry_functions,
            leading=wgmma_tensor_maps(plan, buffers),
            trailing=(np.int32(plan.problem.batch_heads),),
        )

    def cost_terms(self, plan: KernelPlan) -> CostTerms:
        """Shared traffic per K/V tile: each consumer's wgmma reads its Q rows and the K tile
        (S) and the V tile (P V) from shared memory; the TMA writes K and V once a block.
        ``ilp``: wgmma chains are asynchronous, one S and one O accumulator set a consumer.
        """
        p, params = plan.problem, plan.params
        d, bh, n = p.head_dim, p.batch_heads, p.seq_len
        block_n, consumers = params.block_n, params.consumers
        block_m = WARPGROUP_ROWS * consumers
        per_block = consumers * (WARPGROUP_ROWS * d + 2 * block_n * d) + 2 * block_n * d
        executed = executed_pairs(plan, block_m)
        block_tiles = executed // (block_m * block_n)
        imbalance = 1.0
        if params.persistent:
            # the launch is one round of blocks; the busiest block's share of the queue sets
            # the time (the tail a one-block-per-tile grid shows as its last wave)
            imbalance = persistent_imbalance(
                p, block_m, block_n, plan.launch.blocks, heaviest_first=p.causal
            )
        return CostTerms(
            matmul_pipe="wgmma_f16",
            executed_pairs=executed,
            exps=bh * (executed + variant_sfu_ops(p, executed)) + bh * n * plan.tile_count,
            shared_bytes=ELEMENT_BYTES * per_block * block_tiles * bh,
            # wgmma reads shared memory through descriptors, not lane instructions; the
            # TMA writes a tile per instruction: no lane ops to count.
            shared_lane_ops=0,
            ilp=consumers * (block_n // 8 + d // 8),
            # The TMA ring fetches stages - 1 (K, V) tile pairs ahead of the consumers.
            pipelined=True,
            bytes_in_flight=(params.stages - 1) * 2 * block_n * d * ELEMENT_BYTES,
            imbalance=imbalance,
            # each consumer's softmax can run under another's GEMMs, and with the overlap
            # under its own P V as well; the S and P V products read Q, K and V from shared
            # memory through their descriptors
            softmax_streams=consumers * (1 + params.overlap),
            shared_operands=True,
        )


FAMILY = WgmmaF16()
