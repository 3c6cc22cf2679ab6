"""Serving batches on a real GPU: ``kernels.serving.BatchAttention`` against the float64
attention of every request gathered densely (``kernels.serving_inputs.ServingCheck``:
FlashAttention's limit, twice torch SDPA's error plus the dtype's floor).

Covered: paged decode at page sizes 1, 12, 16 and 256 with pages in random order, last pages
of one token, requests with no query rows and requests with no keys; one request of 131072
keys among short ones (split, merged); speculative verification and chunked prefill
(bottom-right causal per request); varlen causal prefill on ragged K/V; FlashInfer's CSR page
table giving the very same output as the block table; a CUDA graph captured once and
replayed after re-planning new lengths and pages; float16; windows, softcap, ALiBi and sinks
with the log-sum-exp; and the tuner measuring a serving bucket through the PyCUDA backend.

Every cache slot no request owns holds NaN and every unused block-table entry points far
outside the cache, so a read past a request's keys fails loudly. On failure the test prints,
per request, its lengths, its splits and its largest error. Skipped without torch + CUDA (or
pycuda for the runner).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from kernels.serving_inputs import (  # noqa: E402
    UNUSED_PAGE,
    ServingCheck,
    ServingInputs,
    build_inputs,
)
from kernels.serving_reference import Variant, request_attention  # noqa: E402
from tuner.planner.work_list import BatchShape  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DECODE = {
    "block_n": 64,
    "warps": 4,
    "row_warps": 1,
    "m_tiles": 1,
    "stages": 3,
    "ctas_per_sm": 2,
    "items_per_cta": 2,
    "min_chunk_tiles": 2,
    "max_splits": 64,
}
PREFILL = DECODE | {"row_warps": 4, "stages": 2}
PLAIN = Variant()


@pytest.fixture(scope="module", autouse=True)
def gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device answers torch")
    if importlib.util.find_spec("pycuda") is None:
        pytest.skip("pycuda is not installed (the runner loads kernels through it)")


def device_tensor(stored: np.ndarray, dtype: str) -> Any:
    if dtype == "bfloat16":
        return torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(stored).cuda()


def attention(page_size: int | None, params: dict[str, int], **options: Any) -> Any:
    from kernels.serving import BatchAttention

    options.setdefault("max_requests", 64)
    options.setdefault("max_query_tokens", 4096)
    options.setdefault("max_kv_len", 8192)
    heads, kv_heads = options.pop("heads", HEADS), options.pop("kv_heads", KV_HEADS)
    return BatchAttention(heads, kv_heads, HEAD_DIM, page_size=page_size, params=params, **options)


def batch_inputs(
    query_lens: list[int],
    kv_lens: list[int],
    page_size: int | None,
    dtype: str = "bfloat16",
    seed: int = 0,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
) -> ServingInputs:
    kv = np.array(kv_lens)
    if page_size is None:
        offsets = np.cumsum(kv + 1) - (kv + 1)  # a NaN row between requests
    else:
        width = max(1, int((-(-kv // page_size)).max()))
        offsets = np.arange(len(kv)) * width
    batch = BatchShape(np.array(query_lens), kv, offsets, heads, kv_heads)
    return build_inputs(batch, HEAD_DIM, dtype, page_size, np.random.default_rng(seed))


def block_table(inputs: ServingInputs) -> np.ndarray:
    """The inputs' page lists as a block table ``[batch, width]`` (request b's at b * width),
    unused entries far outside the cache."""
    batch = inputs.batch
    assert inputs.pages is not None and inputs.page_size is not None
    width = max(1, int((-(-batch.kv_lens // inputs.page_size)).max()))
    table = np.full(batch.batch * width, UNUSED_PAGE, dtype=np.int32)
    table[: inputs.pages.size] = inputs.pages
    return table.reshape(batch.batch, width)


def plan(attn: Any, inputs: ServingInputs) -> None:
    batch = inputs.batch
    if inputs.page_size is None:
        attn.plan(batch.query_lens, batch.kv_lens, kv_offsets=batch.kv_offsets)
    else:
        attn.plan(batch.query_lens, batch.kv_lens, block_table(inputs))


def tensors(inputs: ServingInputs) -> tuple[Any, Any, Any]:
    return tuple(
        device_tensor(x, inputs.dtype) for x in (inputs.q_stored, inputs.k_stored, inputs.v_stored)
    )


def values(out: Any) -> np.ndarray:
    return out.float().cpu().numpy()


def check(attn: Any, inputs: ServingInputs, out: Any, variant: Variant = PLAIN, label=""):
    checker = ServingCheck(inputs, variant)
    got = values(out)
    result = checker.check(got)
    if not result.ok:
        report(attn, inputs, got, variant, label)
    assert result.ok, f"{label}: {result.detail}"
    print(
        f"[serving] {label} {attn.plan_key}: max |error| {result.max_abs_error:.2e} "
        f"(limit {checker.tolerance:.2e}; {result.detail})"
    )


def report(attn: Any, inputs: ServingInputs, got: np.ndarray, variant: Variant, label: str):
    """Per request: lengths, splits, the largest error and where (all rows, float64)."""
    batch = inputs.batch
    work = attn.work
    print(f"[serving] FAILED {label} {attn!r}")
    for b in range(batch.batch):
        q_len = int(batch.query_lens[b])
        if q_len == 0:
            continue
        want, _ = request_attention(inputs.queries_of(b), *inputs.keys_of(b), variant)
        start = int(inputs.query_starts[b])
        part = got[start : start + q_len]
        error = np.abs(part - want)
        worst = np.unravel_index(
            int(np.nanargmax(np.where(np.isfinite(error), error, np.inf))), error.shape
        )
        splits = int(work.splits[b]) if work is not None else -1
        print(
            f"  request {b}: q={q_len} kv={int(batch.kv_lens[b])} splits={splits} "
            f"max|err|={np.nanmax(error):.3e} non-finite={int((~np.isfinite(part)).sum())} "
            f"worst at (row, head, dim)={tuple(int(i) for i in worst)}"
        )


# ------------------------------------------------------------------ decode


@pytest.mark.parametrize("page_size", [1, 12, 16, 256])
def test_paged_decode_matches_every_request(page_size: int) -> None:
    # lengths: one key, a last page of one token, whole pages, a request without query rows,
    # a query row against no keys, long ones
    kv = [1, page_size + 1, 4 * page_size, 50, 0, 1000, 4097, 2 * page_size + 1, 8192, 333]
    q = [1, 1, 1, 0, 1, 1, 1, 1, 1, 1]
    inputs = batch_inputs(q, kv, page_size, seed=page_size)
    attn = attention(page_size, DECODE)
    plan(attn, inputs)
    q_t, k_t, v_t = tensors(inputs)
    out = attn.run(q_t, k_t, v_t)
    torch.cuda.synchronize()
    check(attn, inputs, out, label=f"decode page={page_size}")


def test_a_131072_key_request_among_short_ones_is_split_and_merged() -> None:
    kv = [131072] + [int(x) for x in np.random.default_rng(1).integers(1, 2000, 31)]
    inputs = batch_inputs([1] * 32, kv, 16, seed=3, heads=8, kv_heads=2)
    attn = attention(16, DECODE, heads=8, kv_heads=2, max_requests=32, max_kv_len=131072)
    plan(attn, inputs)
    work = attn.work
    assert work is not None and work.splits[0] == DECODE["max_splits"], work.splits[:4]
    assert work.splits[1:].max() < work.splits[0]  # the short ones: a few splits at most
    q_t, k_t, v_t = tensors(inputs)
    out = attn.run(q_t, k_t, v_t)
    torch.cuda.synchronize()
    check(attn, inputs, out, label="131072 among short")


def test_speculative_verification_and_chunked_prefill_are_causal_per_request() -> None:
    kv = [17, 300, 5000, 64, 2049, 4096]
    q = [16, 7, 300, 1, 13, 2]  # draft tokens, a prefill chunk, plain decode
    inputs = batch_inputs(q, kv, 16, seed=5)
    variant = Variant(causal=True)
    for params in (DECODE, PREFILL):
        attn = attention(16, params, causal=True, max_query_len=16)
        plan(attn, inputs)
        q_t, k_t, v_t = tensors(inputs)
        out = attn.run(q_t, k_t, v_t)
        torch.cuda.synchronize()
        check(attn, inputs, out, variant, label=f"verify/chunk row_warps={params['row_warps']}")


def test_varlen_causal_prefill_on_ragged_keys() -> None:
    lengths = [1, 15, 64, 300, 1000, 2500]
    inputs = batch_inputs(lengths, lengths, None, seed=7)
    attn = attention(None, PREFILL, causal=True, max_query_len=2500)
    plan(attn, inputs)
    q_t, k_t, v_t = tensors(inputs)
    out = attn.run(q_t, k_t, v_t)
    torch.cuda.synchronize()
    check(attn, inputs, out, Variant(causal=True), label="varlen prefill")
    # cu_seqlens, packed K/V: the flash_attn_varlen_func form of the same batch
    packed = np.concatenate([inputs.keys_of(b)[0] for b in range(len(lengths))])
    packed_v = np.concatenate([inputs.keys_of(b)[1] for b in range(len(lengths))])
    cu = np.concatenate([[0], np.cumsum(lengths)])
    attn.plan_varlen(cu, cu)
    k_p = torch.from_numpy(packed).to(torch.bfloat16).cuda()
    v_p = torch.from_numpy(packed_v).to(torch.bfloat16).cuda()
    again = attn.run(q_t, k_p, v_p)
    torch.cuda.synchronize()
    assert torch.equal(again, out)


def test_csr_pages_give_the_block_tables_output_bit_for_bit() -> None:
    kv = [1, 33, 4000, 16, 700]
    inputs = batch_inputs([1] * 5, kv, 16, seed=9)
    attn = attention(16, DECODE)
    plan(attn, inputs)
    q_t, k_t, v_t = tensors(inputs)
    from_table = attn.run(q_t, k_t, v_t).clone()
    counts = -(-np.array(kv) // 16)
    table = block_table(inputs)
    indptr = np.concatenate([[0], np.cumsum(counts)])
    indices = np.concatenate([table[b, : counts[b]] for b in range(5)])
    last = np.array(kv) - (counts - 1) * 16
    attn.plan_csr([1] * 5, indptr, indices, last)
    from_csr = attn.run(q_t, k_t, v_t)
    torch.cuda.synchronize()
    assert torch.equal(from_csr, from_table)
    check(attn, inputs, from_csr, label="csr")


def test_a_cuda_graph_replays_correctly_after_replanning() -> None:
    """Captured once with short requests (no split, no merge); replayed after re-planning
    longer ones on other pages (splits and the merge now run inside the graph)."""
    batch = 8
    first = batch_inputs([1] * batch, [5, 9, 17, 1, 40, 3, 64, 2], 16, seed=11)
    second = batch_inputs([1] * batch, [8000, 1, 7000, 33, 16, 4500, 1, 2], 16, seed=12)
    q1, k1, v1 = tensors(first)
    q2, k2, v2 = tensors(second)
    pages = max(k1.shape[0], k2.shape[0])
    k_static = torch.full((pages, *k1.shape[1:]), float("nan"), dtype=k1.dtype, device="cuda")
    v_static = torch.full_like(k_static, float("nan"))
    k_static[: k1.shape[0]].copy_(k1)
    v_static[: v1.shape[0]].copy_(v1)
    q_static, out_static = q1.clone(), torch.empty_like(q1)
    attn = attention(16, DECODE, max_requests=batch, max_query_tokens=batch)
    plan(attn, first)
    assert attn.work is not None and attn.work.merge_count == 0
    attn.run(q_static, k_static, v_static, out_static)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q_static, k_static, v_static, out_static)
    out_static.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(attn, first, out_static, label="graph, as captured")
    # New values into the captured tensors, new lengths and pages planned outside the graph.
    q_static.copy_(q2)
    k_static.fill_(float("nan"))
    v_static.fill_(float("nan"))
    k_static[: k2.shape[0]].copy_(k2)
    v_static[: v2.shape[0]].copy_(v2)
    plan(attn, second)
    assert attn.work is not None and attn.work.merge_count > 0
    out_static.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(attn, second, out_static, label="graph, replayed after re-planning")


def test_float16_decode() -> None:
    inputs = batch_inputs([1, 1, 1], [100, 4097, 16], 16, dtype="float16", seed=13)
    attn = attention(16, DECODE, dtype=torch.float16)
    plan(attn, inputs)
    out = attn.run(*tensors(inputs))
    torch.cuda.synchronize()
    check(attn, inputs, out, label="float16 decode")


def test_window_softcap_alibi_and_sinks_with_the_lse() -> None:
    rng = np.random.default_rng(17)
    slopes = (2.0 ** (-8.0 * (np.arange(HEADS) + 1) / HEADS)).astype(np.float32)
    sinks = rng.standard_normal(HEADS).astype(np.float32)
    variant = Variant(
        causal=True,
        window_left=200,
        softcap=30.0,
        alibi_slopes=slopes.astype(np.float64),
        sinks=sinks.astype(np.float64),
    )
    q, kv = [4, 1, 9, 2], [1000, 3, 4500, 260]
    inputs = batch_inputs(q, kv, 16, seed=19)
    attn = attention(
        16,
        DECODE,
        causal=True,
        window_left=200,
        softcap=30.0,
        max_query_len=16,
        alibi_slopes=torch.from_numpy(slopes),
        sinks=torch.from_numpy(sinks),
    )
    plan(attn, inputs)
    q_t, k_t, v_t = tensors(inputs)
    lse = torch.empty(q_t.shape[0], HEADS, dtype=torch.float32, device="cuda")
    out = attn.run(q_t, k_t, v_t, lse=lse)
    torch.cuda.synchronize()
    check(attn, inputs, out, variant, label="window+softcap+alibi+sinks")
    got = lse.cpu().numpy()
    for b in range(len(q)):
        _, want = request_attention(inputs.queries_of(b), *inputs.keys_of(b), variant)
        start = int(inputs.query_starts[b])
        np.testing.assert_allclose(got[start : start + q[b]], want, rtol=2e-3, atol=2e-2)


def test_run_refuses_a_cache_the_plan_does_not_fit_before_launching() -> None:
    from kernels.serving import ServingInputError

    inputs = batch_inputs([1, 1], [40, 4000], 16, seed=23)
    attn = attention(16, DECODE)
    plan(attn, inputs)
    q_t, k_t, v_t = tensors(inputs)
    with pytest.raises(ServingInputError, match=r"^k_cache has \d+ pages; the plan reads page"):
        attn.run(q_t, k_t[:2], v_t[:2])
    with pytest.raises(ServingInputError, match=r"^q has shape \[1, 32, 128\]"):
        attn.run(q_t[:1], k_t, v_t)


def test_the_tuner_measures_a_serving_bucket() -> None:
    from kernels.backends.pycuda_backend import DEFAULT_CACHE_DIR, PyCudaBackend
    from tuner.costmodel import predict_time_ms
    from tuner.planner.space import candidate_space
    from tuner.problem import Problem

    problem = Problem(
        1,
        128,
        batch=16,
        heads=32,
        kv_heads=8,
        kv_len=4096,
        dtype="bfloat16",
        page_size=16,
        lengths="skewed",
    )
    backend = PyCudaBackend(
        0,
        cache_dir=os.environ.get("FLASH_ATTENTION_TUNER_CUBIN_CACHE", DEFAULT_CACHE_DIR),
        repetitions=5,
        warmup=1,
    )
    try:
        device = backend.device_profile()
        ranked = sorted(
            candidate_space(problem, device).feasible,
            key=lambda plan: predict_time_ms(plan, device),
        )
        picks = [ranked[0]] + [p for p in ranked if p.sequence_splits > 1][:1]
        for plan in picks:
            result = backend.measure(plan, problem)
            print(
                f"[serving] tuner {problem.label()} {plan.key()}: {result.failure or 'ok'} "
                f"{result.median_ms} ms, error {result.max_abs_error} {result.detail}"
            )
            assert result.failure is None, result.detail
    finally:
        backend.close()
