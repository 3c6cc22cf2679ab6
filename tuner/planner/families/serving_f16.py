"""``serving_f16`` (``kernels/serving_f16.cu``): serving batches on a work list, bf16/fp16.

A serving problem (``Problem.serving``: a paged KV cache of ``page_size`` tokens a page,
and/or requests of unequal lengths drawn from ``Problem.lengths``) runs as one persistent
grid of ``ctas_per_sm`` CTAs per SM over the work list ``tuner.planner.work_list`` plans
from the batch's actual lengths: items of ``16 * m_tiles * row_warps`` packed query rows
(a request's tokens x the query heads of one KV head, GQA-packed as in ``decode_f16``)
against a key range, heaviest first, a long request's keys split when the batch leaves SMs
idle. The kernel gathers K and V rows through the page table (any page size) or from a
ragged tensor, and a second launch merges the split requests' rows.

Tunables: the kernel's tile (``block_n`` keys, ``warps`` as ``row_warps`` row groups times
key warps, ``m_tiles`` m16 tiles a warp, ``stages`` of the cp.async ring) and the work
planner's decisions (``ctas_per_sm`` persistent CTAs, ``items_per_cta``: the work slots the
split target aims at, ``min_chunk_tiles``: the smallest split, ``max_splits``: the split
cap). A plan is judged on the seeded sample of the problem's length distribution
(``Problem.request_lengths``): its traffic counts the keys the items really load, its cost
model the busiest CTA.

The launch arguments and the shared-memory formula here and the kernel's layout are one
contract (the head of ``kernels/serving_f16.cu``).
"""

from __future__ import annotations

import functools

import numpy as np

from tuner.device import DeviceProfile
from tuner.planner.errors import PlanError
from tuner.planner.families.base import (
    CostTerms,
    KernelFamily,
    Tunable,
    launch_verdict,
    variant_defines,
    variant_sfu_ops,
)
from tuner.planner.fixed_width import div_ceil
from tuner.planner.launches import (
    BufferElements,
    DeviceBuffers,
    KernelLaunch,
    scale_log2,
    variant_arguments,
)
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch, blocks_per_sm_of, occupancy_and_waves
from tuner.planner.work_list import (
    Capacity,
    WorkLayout,
    WorkList,
    WorkParams,
    plan_work,
    problem_batch,
)
from tuner.problem import Problem

ELEMENT_BYTES = 2
F32_BYTES = 4
#: 16-byte pad per shared row: conflict-free ldmatrix (as in mma_f16)
SHARED_ROW_PAD = 8
#: float pad per row of the warps' merge scratch
MERGE_ROW_PAD = 4
MMA_M, MMA_K = 16, 16
MAX_HEAD_DIM = 256
#: threads of a merge block (``fa::kMergeThreads``)
MERGE_THREADS = 128
#: non-matmul work per executed (row, key) pair: scaled subtract, max, sum, pack, exp2
NON_MATMUL_FLOPS_PER_PAIR = 5
#: registers a thread needs besides its accumulators (addresses, the item, the softmax
#: state, fragments): fitted to ptxas on sm_90 (CUDA 13.0; within 25 of 8 reported configs)
BASE_REGISTERS = 96


def estimated_registers(m_tiles: int, keys_per_warp: int, head_dim: int) -> int:
    """Registers a thread needs: the O accumulators (``m_tiles x head_dim / 2``) and the
    scores of a warp's key slice (``m_tiles x keys_per_warp / 2``) on top of the rest."""
    return BASE_REGISTERS + m_tiles * (head_dim // 2 + keys_per_warp // 2)


def serving_f16_shared_bytes(
    block_rows: int,
    block_n: int,
    stages: int,
    warps: int,
    m_tiles: int,
    head_dim: int,
    paged: bool,
) -> int:
    """Dynamic shared memory of ``kernels/serving_f16.cu``: Q's packed rows, the K/V ring
    (which the warps' float32 merge scratch reuses after the key loop) and, paged, the
    ring's row slots."""
    row_bytes = ELEMENT_BYTES * (head_dim + SHARED_ROW_PAD)
    ring = row_bytes * 2 * stages * block_n
    merge = F32_BYTES * warps * MMA_M * m_tiles * (head_dim + MERGE_ROW_PAD)
    slots = 4 * stages * block_n if paged else 0
    return row_bytes * block_rows + max(ring, merge) + slots


def work_params(params: KernelParams, device: DeviceProfile) -> WorkParams:
    return WorkParams(
        block_n=params.block_n,
        block_rows=MMA_M * params.m_tiles * params.row_warps,
        ctas=device.sm_count * params.ctas_per_sm,
        items_per_cta=params.items_per_cta,
        min_chunk_tiles=params.min_chunk_tiles,
        max_splits=params.max_splits,
    )


@functools.lru_cache(maxsize=512)
def tuning_work(problem: Problem, work: WorkParams) -> WorkList:
    """The work list of a problem's sample (exact buffers): what the tuner launches."""
    batch = problem_batch(problem)
    tokens = int(batch.query_lens.sum())
    roomy = Capacity(
        requests=batch.batch,
        query_tokens=tokens,
        items=2**31 - 1,
        partial_rows=2**31 - 1,
        merge_tokens=tokens,
        ctas=work.ctas,
    )
    return plan_work(batch, work, roomy)


def exact_capacity(work: WorkList) -> Capacity:
    """Buffers that hold ``work`` exactly."""
    return Capacity(
        requests=work.requests.shape[0],
        query_tokens=int(work.requests[:, 1].sum()) if work.requests.size else 0,
        items=work.item_count,
        partial_rows=work.partial_rows,
        merge_tokens=work.merge_count,
        ctas=len(work.cta_costs),
    )


def merge_launch(merge_entries: int, heads: int, head_dim: int) -> Launch | None:
    """The merge's fixed grid over ``merge_entries`` entries (None for none)."""
    if merge_entries <= 0:
        return None
    blocks = div_ceil(merge_entries * heads * (head_dim // 4), MERGE_THREADS)
    return Launch(grid=(blocks, 1, 1), block=(MERGE_THREADS, 1, 1), shared_bytes=0)


def serving_launches(
    problem: Problem,
    launch: Launch,
    merge: Launch | None,
    layout: WorkLayout,
    buffers: DeviceBuffers,
) -> tuple[KernelLaunch, ...]:
    """The attention launch over the work list in ``buffers.work`` (laid out as ``layout``)
    and, with ``merge``, the split merge: the argument lists of ``kernels/serving_f16.cu``."""
    attention = KernelLaunch(
        "serving_f16_attention",
        launch.grid,
        launch.block,
        launch.shared_bytes,
        (
            *(
                np.uintp(address)
                for address in (
                    buffers.q,
                    buffers.k,
                    buffers.v,
                    buffers.out,
                    buffers.partial_o,
                    buffers.partial_ml,
                    buffers.work,
                    buffers.pages,
                )
            ),
            np.int32(layout.requests_offset),
            np.int32(layout.items_offset),
            np.int32(layout.ctas_offset),
            np.int32(problem.kv_heads),
            np.int32(problem.page_size or 0),
            np.float32(scale_log2(problem.head_dim)),
            *variant_arguments(problem, buffers),
        ),
    )
    if merge is None:
        return (attention,)
    merged = KernelLaunch(
        "serving_f16_split_merge",
        merge.grid,
        merge.block,
        merge.shared_bytes,
        (
            np.uintp(buffers.partial_o),
            np.uintp(buffers.partial_ml),
            np.uintp(buffers.out),
            np.uintp(buffers.work),
            np.int32(layout.merges_offset),
            np.int32(problem.heads),
            np.uintp(buffers.sinks),
            np.uintp(buffers.lse),
        ),
    )
    return (attention, merged)


class ServingF16(KernelFamily):
    name = "serving_f16"
    source = "serving_f16.cu"
    entry_functions = ("serving_f16_attention", "serving_f16_split_merge")
    dtypes = ("bfloat16", "float16")
    serving = True
    tunables = (
        Tunable("block_n", 64, (32, 64, 128)),
        Tunable("warps", 4, (4, 8)),
        Tunable("row_warps", 1, (1, 2, 4, 8)),
        Tunable("m_tiles", 1, (1, 2)),
        Tunable("stages", 3, (2, 3, 4)),
        Tunable("ctas_per_sm", 2, (1, 2, 4)),
        Tunable("items_per_cta", 2, (1, 2, 4)),
        Tunable("min_chunk_tiles", 4, (2, 8)),
        Tunable("max_splits", 128, (16, 128)),
    )
    heatmap_axes = ("block_n", "items_per_cta")

    def plan(self, problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
        d = problem.head_dim
        block_n, warps, row_warps = params.block_n, params.warps, params.row_warps
        m_tiles, stages, ctas_per_sm = params.m_tiles, params.stages, params.ctas_per_sm
        if min(block_n, warps, row_warps, m_tiles, stages, ctas_per_sm) <= 0:
            raise PlanError(f"{params}: every tunable must be > 0")
        threads = warps * device.warp_size
        key_warps = warps // row_warps if warps % row_warps == 0 else 0
        keys_per_warp = block_n // key_warps if key_warps and block_n % key_warps == 0 else 0
        block_rows = MMA_M * m_tiles * row_warps
        paged = problem.page_size is not None
        shared = serving_f16_shared_bytes(block_rows, block_n, stages, warps, m_tiles, d, paged)
        sample = problem.request_lengths()
        longest_rows = int(sample.query.max()) * problem.group
        longest_keys = int(sample.kv.max())

        reason = ""
        if problem.dtype not in self.dtypes:
            reason = f"dtype {problem.dtype} is not one of {', '.join(self.dtypes)}"
        elif d % MMA_K or d > MAX_HEAD_DIM:
            reason = f"head_dim={d} is not a multiple of {MMA_K} up to {MAX_HEAD_DIM}"
        elif not key_warps:
            reason = f"row_warps={row_warps} does not divide warps={warps}"
        elif keys_per_warp % MMA_K or keys_per_warp == 0:
            reason = f"block_n={block_n} over {key_warps} key warps is not whole k16 steps a warp"
        elif m_tiles not in (1, 2):
            reason = f"m_tiles={m_tiles}: a warp owns 16 or 32 packed rows"
        elif stages < 2:
            reason = f"stages={stages}: the cp.async ring needs at least 2"
        if not reason:
            reason = self.variant_verdict(problem) or launch_verdict(threads, shared, device)
        registers = estimated_registers(m_tiles, keys_per_warp, d)
        if not reason and registers > device.max_registers_per_thread:
            reason = (
                f"about {registers} registers a thread ({m_tiles} m16 tiles of head_dim {d} "
                f"and {keys_per_warp} keys): over {device.max_registers_per_thread}, it would spill"
            )
        if not reason and block_rows > MMA_M and block_rows // 2 >= longest_rows:
            reason = (
                f"{block_rows} packed rows a work item are more than needed for the longest "
                f"request's {longest_rows} ({problem.group} heads x its query rows)"
            )
        if not reason and block_n > 32 and block_n // 2 >= longest_keys:
            reason = f"block_n={block_n} is larger than needed for the longest {longest_keys} keys"
        blocks_per_sm = blocks_per_sm_of(threads, shared, None, device)
        if not reason and blocks_per_sm < ctas_per_sm:
            reason = (
                f"ctas_per_sm={ctas_per_sm} persistent CTAs of {threads} threads and {shared} B "
                f"shared memory do not fit on one SM ({blocks_per_sm} do)"
            )

        work = tuning_work(problem, work_params(params, device))
        launch = Launch(
            grid=(device.sm_count * ctas_per_sm, 1, 1), block=(threads, 1, 1), shared_bytes=shared
        )
        merge = merge_launch(work.merge_count, problem.heads, d)
        element = problem.element_bytes
        loaded_keys = int((work.items[:, 4] - work.items[:, 3]).sum()) if work.item_count else 0
        # Q once per item's rows (their KV head's group), K and V rows each item loads.
        read = problem.tensor_bytes + 2 * element * loaded_keys * d
        write = problem.tensor_bytes
        partial = work.partial_rows * (d + 1)
        if partial:
            read += F32_BYTES * partial
            write += F32_BYTES * partial
        executed = block_rows * block_n * work.tiles
        non_matmul = executed * NON_MATMUL_FLOPS_PER_PAIR + work.tiles * block_rows * (d + 4)
        occupancy, waves = occupancy_and_waves(launch, threads, blocks_per_sm, device)
        splits = int(work.splits.max()) if work.splits.size else 1
        return KernelPlan(
            problem=problem,
            params=params,
            tile_size=block_n,
            tile_count=max(work.tiles, 1),
            sequence_splits=splits,
            tiles_per_sequence_split=work.chunk_tiles,
            keys_per_sequence_split=work.chunk_tiles * block_n,
            split_reduce_scratch_elements=work.partial_rows * d,
            parallel_workgroups_per_row=splits,
            rows_per_block=block_rows,
            threads_per_row=4,  # an mma row's scores live in a quad of lanes
            rows_per_thread=max(block_rows // 8 // warps, 1),
            launch=launch,
            reduce_launch=merge,
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

    def work_list(self, plan: KernelPlan, device_sm_count: int) -> WorkList:
        """The work list ``plan`` launches on its problem's sample (``device_sm_count``: the
        SMs the plan was made for, ``launch.grid[0] // ctas_per_sm``)."""
        params = plan.params
        work = WorkParams(
            block_n=params.block_n,
            block_rows=plan.rows_per_block,
            ctas=device_sm_count * params.ctas_per_sm,
            items_per_cta=params.items_per_cta,
            min_chunk_tiles=params.min_chunk_tiles,
            max_splits=params.max_splits,
        )
        return tuning_work(plan.problem, work)

    def tuning_buffer(self, plan: KernelPlan) -> tuple[WorkLayout, np.ndarray]:
        """The layout and contents of the work buffer the tuner uploads for ``plan``."""
        work = self.work_list(plan, plan.launch.grid[0] // plan.params.ctas_per_sm)
        layout = WorkLayout(exact_capacity(work))
        return layout, layout.pack(work)

    def work_buffer(self, plan: KernelPlan) -> np.ndarray:
        return self.tuning_buffer(plan)[1]

    def compile_defines(self, plan: KernelPlan) -> dict[str, int]:
        p, params = plan.problem, plan.params
        return {
            "HEAD_DIM": p.head_dim,
            "BLOCK_N": params.block_n,
            "WARPS": params.warps,
            "ROW_WARPS": params.row_warps,
            "M_TILES": params.m_tiles,
            "STAGES": params.stages,
            "PAGED": int(p.page_size is not None),
            "CTAS_PER_SM": params.ctas_per_sm,
            "CAUSAL": int(p.causal),
            "IS_FP16": int(p.dtype == "float16"),
            **variant_defines(p),
        }

    def key(self, plan: KernelPlan) -> str:
        """The kernel's tile, the CTAs, and what the work planner's tunables decided on the
        problem's sample: the split target (``chunk`` tiles) and the most splits a request
        got. Planner settings that decide alike are one candidate (the work list is a
        function of these)."""
        params = plan.params
        return (
            f"serving_f16/n{params.block_n}/w{params.warps}r{params.row_warps}"
            f"/m{MMA_M * params.m_tiles}/st{params.stages}/c{params.ctas_per_sm}"
            f"/chunk{plan.tiles_per_sequence_split}/s{plan.sequence_splits}"
        )

    def buffer_elements(self, plan: KernelPlan) -> BufferElements:
        """q and out (ragged, the sample's rows); the split scratch of the sample's work list
        (K and V are the serving inputs' own: a paged cache or a ragged tensor)."""
        p = plan.problem
        rows = plan.split_reduce_scratch_elements // p.head_dim
        tensor = p.query_rows_total * p.heads * p.head_dim
        return BufferElements(tensor, rows * p.head_dim, rows, p.element_bytes)

    def launches(self, plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
        if not buffers.work:
            raise ValueError(f"{plan.key()} needs a work buffer (buffers.work); none was given")
        if plan.problem.page_size is not None and not buffers.pages:
            raise ValueError(f"{plan.key()} reads a paged cache: buffers.pages is missing")
        layout, _ = self.tuning_buffer(plan)
        return serving_launches(plan.problem, plan.launch, plan.reduce_launch, layout, buffers)

    def cost_terms(self, plan: KernelPlan) -> CostTerms:
        """Per tile and CTA: the cp.async stores of K and V, every warp's ldmatrix reads of
        its K/V slice and of its Q rows (re-read per k16 step). Pairs per query head: an
        item's packed rows are its group's heads. The busiest CTA sets the imbalance."""
        p, params = plan.problem, plan.params
        d, block_n, warps = p.head_dim, params.block_n, params.warps
        rows = plan.rows_per_block
        key_warps = warps // params.row_warps
        keys_per_warp = block_n // key_warps
        work = self.work_list(plan, plan.launch.grid[0] // params.ctas_per_sm)
        tiles = work.tiles
        executed = rows * block_n * tiles  # (packed row, key) pairs, padding included
        per_tile = 2 * 2 * block_n * d + warps * (2 * keys_per_warp + MMA_M * params.m_tiles) * d
        cp_async_ops = 2 * block_n * d * ELEMENT_BYTES // 16
        ldmatrix_bytes = warps * (2 * keys_per_warp + MMA_M * params.m_tiles) * d * ELEMENT_BYTES
        ldmatrix_ops = ldmatrix_bytes // 512 * 32
        costs = work.cta_costs
        imbalance = float(costs.max() / costs.mean()) if costs.size and costs.sum() else 1.0
        return CostTerms(
            matmul_pipe="mma_sync_f16",
            executed_pairs=div_ceil(executed, max(p.batch_heads, 1)),
            exps=executed + tiles * rows + variant_sfu_ops(p, executed),
            shared_bytes=ELEMENT_BYTES * per_tile * tiles,
            shared_lane_ops=(cp_async_ops + ldmatrix_ops) * tiles,
            ilp=params.m_tiles * (keys_per_warp // 8) + d // 8,
            pipelined=True,
            bytes_in_flight=(params.stages - 1) * 2 * block_n * d * p.element_bytes,
            # __launch_bounds__(threads, ctas_per_sm) caps what the compiler may use
            registers=min(
                estimated_registers(params.m_tiles, keys_per_warp, d),
                registers_cap(plan.threads, params.ctas_per_sm),
            ),
            imbalance=max(imbalance, 1.0),
        )


def registers_cap(threads: int, ctas_per_sm: int, registers_per_sm: int = 65536) -> int:
    """The most registers a thread may take for ``ctas_per_sm`` blocks to be resident."""
    return min(255, registers_per_sm // (threads * ctas_per_sm) // 8 * 8)


FAMILY = ServingF16()
