"""The host half of ``kernels.serving.BatchAttention``: every argument checked before anything
is written (one error naming it), the block-table, CSR and cu_seqlens adapters agreeing, the
page lists staged where the kernel reads them, and fixed offsets across re-plans (what keeps
a captured CUDA graph valid). No GPU: ``BatchPlanner`` is pure numpy."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kernels.serving.checks import ServingInputError, ServingInputTypeError
from kernels.serving.planning import BatchPlanner
from kernels.serving_inputs import UNUSED_PAGE, build_inputs
from tuner.device import H200
from tuner.planner.families.serving_f16 import work_params
from tuner.planner.params import KernelParams
from tuner.planner.work_list import BatchShape
from tuner.problem import Problem

PAGE = 16


def planner(page_size: int | None = PAGE, causal: bool = False, **capacity) -> BatchPlanner:
    bucket = Problem(
        1,
        128,
        batch=capacity.pop("max_requests", 8),
        heads=8,
        kv_heads=2,
        kv_len=4096,
        dtype="bfloat16",
        causal=causal,
        page_size=page_size,
        lengths="uniform",
    )
    params = KernelParams("serving_f16")
    return BatchPlanner(
        bucket, work_params(params, H200), max_query_tokens=capacity.pop("tokens", 64), **capacity
    )


def table(kv: list[int], width: int = 256, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pages = rng.permutation(len(kv) * width + 5)[: len(kv) * width].reshape(len(kv), width)
    needed = -(-np.array(kv) // PAGE)
    pages[np.arange(width)[None, :] >= needed[:, None]] = UNUSED_PAGE  # never read
    return pages.astype(np.int32)


def test_the_block_table_is_staged_where_the_kernel_reads_it() -> None:
    p = planner()
    kv = [100, 4096, 1, 33]
    block_table = table(kv)
    staging = p.staging()
    planned = p.plan([1, 1, 1, 1], kv, block_table, into=staging)
    work = planned.work
    widest = -(-4096 // PAGE)
    assert list(work.requests[:, 3]) == [0, widest, 2 * widest, 3 * widest]
    pages = staging[p.pages_offset : planned.words]
    for b, length in enumerate(kv):
        used = -(-length // PAGE)
        start = int(work.requests[b, 3])
        assert np.array_equal(pages[start : start + used], block_table[b, :used])
    assert planned.largest_index == int(block_table[block_table != UNUSED_PAGE].max())
    assert planned.total_q == 4
    assert list(staging[:3]) == [work.item_count, work.merge_count, 4]


def test_csr_and_block_table_describe_the_same_batch() -> None:
    p = planner()
    kv = np.array([100, 4096, 1, 33, 0])
    block_table = table(kv.tolist())
    needed = -(-kv // PAGE)
    indptr = np.concatenate([[0], np.cumsum(needed)])
    indices = np.concatenate([block_table[b, : needed[b]] for b in range(len(kv))])
    last = np.where(needed > 0, kv - (needed - 1) * PAGE, 0)
    q = [1, 1, 1, 1, 0]
    from_table = p.plan(q, kv, block_table, into=p.staging())
    staged = p.staging()
    from_csr = p.plan_csr(q, indptr, indices, last, into=staged)
    assert np.array_equal(from_csr.work.requests[:, :3], from_table.work.requests[:, :3])
    assert np.array_equal(from_csr.work.items, from_table.work.items)
    assert list(from_csr.work.requests[:, 3]) == list(indptr[:-1])
    assert np.array_equal(staged[p.pages_offset : p.pages_offset + indices.size], indices)


def test_varlen_offsets_come_from_cu_seqlens() -> None:
    p = planner(page_size=None, causal=True)
    planned = p.plan_varlen([0, 5, 5, 12], [0, 5, 9, 20], into=p.staging())
    assert list(planned.work.requests[:, 1]) == [5, 0, 7]
    assert list(planned.work.requests[:, 2]) == [5, 4, 11]
    assert list(planned.work.requests[:, 3]) == [0, 5, 9]
    assert planned.largest_index == 19


def test_the_staged_batch_gathers_the_keys_of_each_request() -> None:
    """The layout the kernel reads (page lists at their offsets in the staged words) gathers
    exactly the keys ``kernels.serving_inputs`` put there, pages in random order."""
    p = planner()
    kv = np.array([300, 17, 4096])
    widest = int((-(-kv // PAGE)).max())
    batch = BatchShape(np.ones(3), kv, np.arange(3) * widest, 8, 2)
    inputs = build_inputs(batch, 16, "bfloat16", PAGE, np.random.default_rng(3))
    assert inputs.pages is not None
    block_table = inputs.pages.reshape(3, widest)
    staged = p.staging()
    planned = p.plan([1, 1, 1], kv, block_table, into=staged)
    pages = staged[p.pages_offset : planned.words]
    flat_k = inputs.k.reshape(-1, 2, 16)
    for b in range(3):
        keys = np.arange(int(kv[b]))
        offset = int(planned.work.requests[b, 3])
        rows = pages[offset + keys // PAGE].astype(np.int64) * PAGE + keys % PAGE
        assert np.array_equal(flat_k[rows], inputs.keys_of(b)[0])
        assert np.isfinite(flat_k[rows]).all()


def test_replanning_moves_no_offset_a_graph_holds() -> None:
    p = planner()
    first = p.staging()
    p.plan([1] * 8, [4096] * 8, table([4096] * 8), into=first)
    second = p.staging()
    p.plan([1], [7], table([7]), into=second)
    layout = p.layout
    offsets = (layout.requests_offset, layout.items_offset, layout.ctas_offset)
    assert offsets == (p.layout.requests_offset, p.layout.items_offset, p.layout.ctas_offset)
    # The CTA offsets are rewritten whole: a CTA past the new items runs nothing.
    ctas = second[layout.ctas_offset : layout.ctas_offset + p.capacity.ctas + 1]
    assert ctas[-1] == second[0] and np.all(np.diff(ctas) >= 0)


def error(function, *arguments, **named):
    with pytest.raises(ServingInputError) as raised:
        function(*arguments, **named)
    return str(raised.value)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p, s: p.plan([1, 1], [5], table([5]), into=s), r"^query_lens has 2 requests"),
        (lambda p, s: p.plan([-1], [5], table([5]), into=s), r"^query_lens\[0\] = -1"),
        (lambda p, s: p.plan([1.5], [5], table([5]), into=s), r"^query_lens has dtype float"),
        (lambda p, s: p.plan([[1]], [[5]], table([5]), into=s), r"^query_lens has 2 dimensions"),
        (lambda p, s: p.plan([1] * 9, [5] * 9, table([5] * 9), into=s), r"max_requests=8"),
        (lambda p, s: p.plan([40, 40], [50, 50], table([50, 50]), into=s), r"max_query_tokens"),
        (lambda p, s: p.plan([1], [4097], table([4097], 300), into=s), r"max_kv_len=4096"),
        (lambda p, s: p.plan([1], [5], into=s), r"^block_table is required"),
        (lambda p, s: p.plan([1], [100], table([100], 3), into=s), r"block_table has 3 columns"),
        (lambda p, s: p.plan([1, 1], [5, 5], table([5]), into=s), r"^block_table has 1 rows"),
        (
            lambda p, s: p.plan([1], [5], np.array([[-3, 1]]), into=s),
            r"^block_table\[0, 0\] = -3; page indices",
        ),
        (
            lambda p, s: p.plan_csr([1], [0, 2], [4, 5], [17], into=s),
            r"^kv_last_page_len\[0\] = 17",
        ),
        (lambda p, s: p.plan_csr([1], [1, 2], [4, 5], [3], into=s), r"^kv_indptr must start"),
        (lambda p, s: p.plan_csr([1], [0, 3], [4, 5], [3], into=s), r"kv_indices holds 2"),
        (lambda p, s: p.plan_csr([1, 1], [0, 1], [4], [3], into=s), r"one of each per request"),
    ],
)
def test_each_bad_argument_is_named_before_anything_is_written(call, message) -> None:
    p = planner()
    staging = p.staging()
    staging[:] = 7
    text = error(call, p, staging)
    assert re.search(message, text), text
    assert np.all(staging == 7), "nothing is staged for a refused batch"


def test_causal_requests_need_as_many_keys_as_rows() -> None:
    p = planner(causal=True)
    text = error(p.plan, [4], [3], table([3]), into=p.staging())
    assert text.startswith("request 0 has 4 query rows against kv_lens[0] = 3 keys")


def test_ragged_and_paged_arguments_do_not_mix() -> None:
    ragged = planner(page_size=None)
    assert "page_size is None" in error(ragged.plan, [1], [5], table([5]), into=ragged.staging())
    assert "paged cache" in error(ragged.plan_csr, [1], [0, 1], [0], [5], into=ragged.staging())
    paged = planner()
    assert "ragged K/V only" in error(
        paged.plan, [1], [5], table([5]), kv_offsets=[0], into=paged.staging()
    )


def test_without_split_scratch_nothing_is_split() -> None:
    p = planner(max_partial_rows=0)
    # Without split scratch nothing is split; the batch still fits unsplit.
    work = p.plan([1] * 8, [4096] * 8, table([4096] * 8), into=p.staging()).work
    assert work.merge_count == 0 and work.splits.max() == 1


def test_torch_tensors_on_the_host_are_lengths_too() -> None:
    torch = pytest.importorskip("torch")
    p = planner()
    planned = p.plan(
        torch.ones(2, dtype=torch.int32),
        torch.tensor([16, 17]),
        torch.from_numpy(table([16, 17])),
        into=p.staging(),
    )
    assert list(planned.work.requests[:, 2]) == [16, 17]
    with pytest.raises(ServingInputTypeError, match=r"^query_lens has dtype torch.float32"):
        p.plan(torch.ones(2), [16, 17], table([16, 17]), into=p.staging())


def test_the_bench_picks_the_defaults_and_the_best_predictions() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import serving_bench

    bucket = Problem(
        1,
        128,
        batch=16,
        heads=32,
        kv_heads=8,
        kv_len=8192,
        dtype="bfloat16",
        page_size=16,
        lengths="equal",
    )
    picks = serving_bench.serving_candidates(bucket, H200, 3)
    assert picks[0] == KernelParams("serving_f16").tunables
    assert len(picks) == 3 and len({tuple(p.items()) for p in picks}) == 3
