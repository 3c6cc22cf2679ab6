"""Grouped-query attention, MQA and decode against a KV cache on a real GPU.

Every family that takes the dtype runs a few of its plans (the cost model's best,
the best with several key splits, and for ``decode_f16`` the best packing 32
rows) through the PyCUDA backend's own check: the output against the float64
reference of the same rounded inputs (bottom-right causal, query head ``h``
reading KV head ``h // group``), half precision within twice torch SDPA's own
error plus a floor, float32 within 1e-3, NaN-poisoned outputs. Decode covers
query lengths 1, 7 and 16 against key lengths from 1 to thousands, including
lengths that are no multiple of any tile. ``kernels.attention`` then runs GQA
torch tensors, inferring kv_heads and kv_len from k's shape.

Skipped where pycuda (or, for the last test, torch) or a CUDA device is missing.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

import pytest

from kernels.backends.base import Failure
from tuner.costmodel import predict_time_ms
from tuner.device import DeviceProfile
from tuner.planner.families import families_for, family_named
from tuner.planner.space import candidate_space
from tuner.planner.tunable import KernelPlan
from tuner.problem import Problem

pytestmark = pytest.mark.gpu


def half_problems(dtype: str) -> list[Problem]:
    return [
        # GQA prefill, causal with queries and keys of one length
        Problem(300, 64, batch=2, heads=8, causal=True, dtype=dtype, kv_heads=2),
        # chunked prefill against a cache: the queries are the last 200 of 1000 keys
        Problem(200, 128, heads=4, causal=True, dtype=dtype, kv_heads=2, kv_len=1000),
        # MQA decode
        Problem(1, 128, batch=2, heads=8, dtype=dtype, kv_heads=1, kv_len=1000),
        # decode, one query row: a single key, an odd length, a long cache past a tile
        Problem(1, 128, batch=2, heads=32, dtype=dtype, kv_heads=8, kv_len=1),
        Problem(1, 128, batch=2, heads=32, dtype=dtype, kv_heads=8, kv_len=37),
        Problem(1, 128, heads=32, dtype=dtype, kv_heads=8, kv_len=4097),
        # speculative decode: 7 and 16 query rows, bottom-right causal
        Problem(7, 128, heads=8, causal=True, dtype=dtype, kv_heads=2, kv_len=300),
        Problem(16, 128, heads=32, causal=True, dtype=dtype, kv_heads=8, kv_len=4100),
        Problem(16, 64, heads=4, causal=True, dtype=dtype, kv_heads=4, kv_len=16),
    ]


FLOAT32_PROBLEMS = [
    Problem(50, 32, heads=4, causal=True, kv_heads=2, kv_len=130),
    Problem(1, 64, batch=2, heads=8, kv_heads=1, kv_len=1000),
    Problem(7, 64, heads=4, causal=True, kv_heads=2, kv_len=300),
]
PROBLEMS = half_problems("bfloat16") + half_problems("float16")[2::3] + FLOAT32_PROBLEMS


def parity_plans(problem: Problem, device: DeviceProfile) -> list[KernelPlan]:
    """Per family taking the dtype: the best prediction, the best with splits, and for
    decode_f16 the best with 32 packed rows and the best whose warps score 32+ keys of a
    tile (deduplicated, in that order)."""
    space = candidate_space(problem, device)
    chosen: dict[str, KernelPlan] = {}
    for family in families_for(problem.dtype):
        ranked = sorted(
            (p for p in space.feasible if p.family == family),
            key=lambda p: predict_time_ms(p, device),
        )
        picks = [
            ranked[:1],
            [p for p in ranked if p.sequence_splits > 1][:1],
            [p for p in ranked if p.params.tunables.get("m_tiles") == 2][:1],
            # a decode warp scoring 32 or more keys a tile (two k16 steps of P V)
            [p for p in ranked if family == "decode_f16" and p.params.warps * 32 <= p.tile_size][
                :1
            ],
        ]
        for plan in (p for pick in picks for p in pick):
            chosen.setdefault(plan.key(), plan)
    return list(chosen.values())


@pytest.fixture(scope="module")
def gpu() -> Any:
    if importlib.util.find_spec("pycuda") is None:
        pytest.skip("pycuda is not installed")
    from kernels.backends.pycuda_backend import DEFAULT_CACHE_DIR, PyCudaBackend

    try:
        backend = PyCudaBackend(
            0,
            cache_dir=os.environ.get("FLASH_ATTENTION_TUNER_CUBIN_CACHE", DEFAULT_CACHE_DIR),
            repetitions=3,
            warmup=1,
        )
        backend.device_profile()
    except Exception as error:  # no device, no driver
        pytest.skip(f"no CUDA device answers: {error}")
    yield backend
    backend.close()


@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.label() for p in PROBLEMS])
def test_every_family_matches_the_float64_reference(gpu: Any, problem: Problem) -> None:
    plans = parity_plans(problem, gpu.device_profile())
    assert plans, f"no feasible plan for {problem.label()}"
    assert {p.family for p in plans} == set(families_for(problem.dtype)) - _rejecting(problem)
    failures, ran = [], set()
    for plan in plans:
        result = gpu.measure(plan, problem)
        error = "-" if result.max_abs_error is None else f"{result.max_abs_error:.2e}"
        print(
            f"[gqa] {problem.label()} {plan.key()}: {result.failure or 'ok'} {error} "
            f"{result.detail}"
        )
        if result.failure == Failure.INFEASIBLE and not result.measured:
            continue  # the compiler's report rules it out (spills), as in a tune run
        if result.ok:
            ran.add(plan.family)
        else:
            failures.append(f"{plan.key()}: {result.failure} {result.detail}")
    assert not failures, failures
    assert ran == {p.family for p in plans}, f"only {ran} ran"


def _rejecting(problem: Problem) -> set[str]:
    """Families that reject every candidate of ``problem`` (decode_f16 past 16 query rows;
    a serving family plans serving batches only: ``tests/test_gpu_serving.py``'s)."""
    serving = {name for name in families_for(problem.dtype) if family_named(name).serving}
    return serving | ({"decode_f16"} if problem.seq_len > 16 else set())


def test_attention_infers_kv_heads_and_kv_len_from_torch_tensors(tmp_path, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device answers torch")
    monkeypatch.chdir(tmp_path)  # an empty data directory: the default plan serves
    from kernels.deploy import Attention

    attend = Attention()
    generator = torch.Generator(device="cuda").manual_seed(3)
    for b, h, n, kvh, m, causal in ((2, 32, 1, 8, 3000, False), (1, 8, 5, 2, 77, True)):
        q = torch.randn(b, h, n, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
        k, v = (
            torch.randn(b, kvh, m, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
            for _ in range(2)
        )
        with torch.no_grad():
            out = attend(q, k, v, causal)
        problem = Problem(
            n, 128, batch=b, heads=h, causal=causal, dtype="bfloat16", kv_heads=kvh, kv_len=m
        )
        assert attend.plan_for(problem).plan.problem == problem
        k64, v64 = (t.to(torch.float64).repeat_interleave(h // kvh, dim=1) for t in (k, v))
        scores = q.to(torch.float64) @ k64.transpose(-1, -2) / math.sqrt(128)
        mask = torch.ones(n, m, dtype=torch.bool, device="cuda").tril(m - n)
        if causal:
            scores = scores.masked_fill(~mask, float("-inf"))
        want = torch.softmax(scores, dim=-1) @ v64
        theirs = torch.nn.functional.scaled_dot_product_attention(
            q,
            k.repeat_interleave(h // kvh, dim=1),
            v.repeat_interleave(h // kvh, dim=1),
            attn_mask=mask if causal else None,
        )
        ours_error = float((out.to(torch.float64) - want).abs().max())
        torch_error = float((theirs.to(torch.float64) - want).abs().max())
        print(
            f"[gqa] attention {problem.label()}: {attend.plan_for(problem).plan.key()} "
            f"error {ours_error:.2e} (torch {torch_error:.2e})"
        )
        assert ours_error <= 2 * torch_error + 2.0**-8
    attend.close()
