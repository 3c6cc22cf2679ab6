"""KV lengths as run-time data at deploy time, on the fake GPU of ``test_attention``.

A decode meets a new ``kv_len`` at every step. Over a sweep of lengths crossing buckets, the
counts that matter: plan resolutions and registry lookups once per KV bucket
(``kernels.kv_buckets``), one full candidate space (the first bucket; later ones pick among the
launch choices of the kernel already chosen), one compile and one module load for the whole
sweep, split scratch once per bucket and stream; and every length's output right, computed by
a numpy emulation of ``decode_f16`` that reads the packed launch arguments (``kv_len``,
``keys_per_split``, the split count as ``gridDim.y``) as the kernel does.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from test_attention import (
    ENV,
    HALF_KERNELS,
    CountingRegistry,
    FakeTensor,
    fake_mma_f16_merge,
    half_values,
    store_half,
    torch_on_fake_gpu,
    warnings_of,
)
from test_attention import gpu as gpu  # noqa: PLC0414 - the fake GPU's fixture
from test_attention import registry as registry  # noqa: PLC0414
from test_pycuda_backend import FakeGpu

import kernels.deploy as ka
from db import PlanRecord
from kernels import build, plan_choice
from kernels.backends import pycuda_attention
from kernels.bfloat16 import from_bfloat16, to_bfloat16
from kernels.kv_buckets import bucket_of
from kernels.reference import attention_reference
from tuner.device import H200
from tuner.problem import Problem

#: 8 query heads on 2 KV heads, one query row: the decode step of a small GQA layer
STEP = Problem(1, 64, batch=2, heads=8, causal=True, dtype="bfloat16", kv_heads=2, kv_len=500)
#: 500..529 (buckets 512 and 1024) and 1020..1029 (1024 and 2048)
SWEEP = [*range(500, 530), *range(1020, 1030)]


def fake_decode_f16(
    device, defines, grid, q, k, v, out, po, lse, seq_len, kv_len, group, keys_per_split,
    scale_log2, heads, window_left, window_right, softcap, alibi_slopes, sinks, row_lse,
):
    """``decode_f16_attention`` in float64 on the split-KV contract: split ``s`` (``gridDim.y``
    of them) covers keys ``[s * keys_per_split, min(kv_len, (s + 1) * keys_per_split))``, each
    holding keys; the group's query heads share a KV head; bottom-right causal."""
    n, m, g, d = int(seq_len), int(kv_len), int(group), defines["HEAD_DIM"]
    splits, kv_heads, span, fp16 = grid[1], grid[2], int(keys_per_split), defines["IS_FP16"]
    assert grid[0] == -(-g * n // (16 * defines["M_TILES"]))
    assert span % defines["BLOCK_N"] == 0 and (splits - 1) * span < m <= splits * span
    assert (int(window_left), float(softcap), int(alibi_slopes), int(sinks)) == (-1, 0, 0, 0)
    q3 = half_values(device, q, (kv_heads * g, n, d), fp16)
    k3, v3 = (np.repeat(half_values(device, a, (kv_heads, m, d), fp16), g, 0) for a in (k, v))
    scores = np.einsum("bqd,bkd->bqk", q3, k3) * float(scale_log2)
    if defines["CAUSAL"]:
        scores[:, np.arange(m)[None, :] > np.arange(n)[:, None] + m - n] = -np.inf
    if splits == 1:
        weights = np.exp2(scores - scores.max(-1, keepdims=True))
        store_half(device, out, weights @ v3 / weights.sum(-1, keepdims=True), fp16)
        return
    po4 = device.floats(po, kv_heads * g * splits * n * d).reshape(kv_heads * g, splits, n, d)
    lse3 = device.floats(lse, kv_heads * g * splits * n).reshape(kv_heads * g, splits, n)
    for s in range(splits):
        part = scores[..., s * span : (s + 1) * span]
        top = part.max(-1, keepdims=True)
        weights = np.exp2(part - top)
        total = weights.sum(-1)
        po4[:, s] = weights @ v3[:, s * span : (s + 1) * span] / total[..., None]
        lse3[:, s] = np.log2(total) + top[..., 0]


@pytest.fixture
def decode_gpu(gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    monkeypatch.setitem(HALF_KERNELS, "decode_f16_attention", fake_decode_f16)
    monkeypatch.setitem(HALF_KERNELS, "decode_f16_split_merge", fake_mma_f16_merge)
    monkeypatch.setitem(sys.modules, "torch", torch_on_fake_gpu(gpu))
    return gpu


def step_tensors(device: FakeGpu, kv_len: int, rng: np.random.Generator) -> tuple[list, list]:
    """q, k, v of one decode step (bfloat16 on the fake GPU) and their float64 values."""
    p = replace(STEP, kv_len=kv_len)
    shapes = [(p.batch, p.heads, 1, p.head_dim), *[(p.batch, p.kv_heads, kv_len, p.head_dim)] * 2]
    values, tensors = [], []
    for shape in shapes:
        bits = to_bfloat16(rng.standard_normal(shape, dtype=np.float32))
        values.append(from_bfloat16(bits).astype(np.float64))
        pointer = int(device.driver.to_device(bits))
        tensors.append(FakeTensor(shape, pointer=pointer, dtype="bfloat16"))
    return values, tensors


def expected_step(values: list[np.ndarray]) -> np.ndarray:
    q, k, v = values
    batch, heads, _, d = q.shape
    kv_heads, m = k.shape[1], k.shape[2]
    flat = attention_reference(
        q.reshape(batch * heads, 1, d),
        k.reshape(batch * kv_heads, m, d),
        v.reshape(batch * kv_heads, m, d),
        causal=True,
        group=heads // kv_heads,
    )
    return flat.reshape(q.shape)


class Counts:
    """What the sweep costs: plan resolutions, full candidate spaces, handles made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.resolutions, self.spaces, self.handles = 0, 0, 0
        choose, space = plan_choice.PlanChooser._choose, plan_choice.candidate_space
        resolve = pycuda_attention.DeviceRunner._resolve

        def counted_choose(chooser: Any, problem: Problem) -> Any:
            self.resolutions += 1
            return choose(chooser, problem)

        def counted_space(*args: Any, **kwargs: Any) -> Any:
            self.spaces += 1
            return space(*args, **kwargs)

        def counted_resolve(runner: Any, problem: Problem, exact: bool) -> Any:
            self.handles += 1
            return resolve(runner, problem, exact)

        monkeypatch.setattr(plan_choice.PlanChooser, "_choose", counted_choose)
        monkeypatch.setattr(plan_choice, "candidate_space", counted_space)
        monkeypatch.setattr(pycuda_attention.DeviceRunner, "_resolve", counted_resolve)


def test_a_sweep_of_new_kv_lengths_resolves_and_compiles_once_per_bucket(
    decode_gpu: FakeGpu, registry: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    counts = Counts(monkeypatch)
    counting = CountingRegistry(registry)
    attend = ka.Attention(counting)
    rng = np.random.default_rng(0)
    for kv_len in SWEEP:
        values, (q, k, v) = step_tensors(decode_gpu, kv_len, rng)
        out = attend(q, k, v, True)
        result = half_values(decode_gpu, out.data_ptr(), q.shape, fp16=False)
        error = np.abs(result - expected_step(values)).max()
        assert error < 2e-2, f"kv_len={kv_len}: max error {error}"
    buckets = {bucket_of(replace(STEP, kv_len=n)) for n in SWEEP}
    assert [b.kv_len for b in sorted(buckets, key=lambda b: b.kv_len)] == [512, 1024, 2048]
    assert counts.resolutions == 3 and counting.calls == 3 * 3  # this GPU, its model, any
    assert counts.spaces == 1  # the first bucket; the others re-partition its kernel
    assert counts.handles == len(SWEEP)  # one cheap handle a length (plan_at, packing)
    assert len(set(decode_gpu.compiled)) == 1 and decode_gpu.loads == 1
    plans = [attend.plan_for(bucket) for bucket in buckets]
    assert len({build.KernelSpec.from_plan(c.plan).key for c in plans}) == 1
    assert {c.plan.params.family for c in plans} == {"decode_f16"}
    notes = warnings_of(caplog)
    assert len(notes) == 3 and sum("the kernel of decode_f16" in note for note in notes) == 2
    # The split scratch: per bucket whose plan splits, on the one stream used; never per length.
    runner = attend._runners[0]
    split_buckets = [b for b in buckets if attend.plan_for(b).plan.sequence_splits > 1]
    assert split_buckets and set(runner._buckets) == buckets
    for bucket in split_buckets:
        assert list(runner._buckets[bucket]._streams) == [0]
    # A second pass: every length known, no handle made, no lookup, the fast path.
    before = (counts.handles, counting.calls, decode_gpu.loads, decode_gpu.allocations)
    for kv_len in SWEEP[::7]:
        _, (q, k, v) = step_tensors(decode_gpu, kv_len, rng)
        attend(q, k, v, True)
    assert (counts.handles, counting.calls, decode_gpu.loads) == before[:3]
    # q, k, v of each step and the output: no scratch, no packing buffers
    assert decode_gpu.allocations == before[3] + 4 * len(SWEEP[::7])


def test_a_bucket_with_a_registry_plan_serves_it_at_every_length(
    decode_gpu: FakeGpu, registry: Any
) -> None:
    stored = {"block_n": 64, "warps": 4, "stages": 2, "m_tiles": 1, "splits": 4}
    bucket = replace(STEP, kv_len=1024)
    current = build.source_hash("decode_f16")
    plan = PlanRecord(
        family="decode_f16", params=stored, source_hash=current, measured=True, median_ms=0.01
    )
    counting = CountingRegistry(registry)
    attend = ka.Attention(counting)
    registry.record(bucket, attend.environment(), plan)
    rng = np.random.default_rng(1)
    for kv_len in (513, 700, 1024):
        values, (q, k, v) = step_tensors(decode_gpu, kv_len, rng)
        out = attend(q, k, v, True)
        result = half_values(decode_gpu, out.data_ptr(), q.shape, fp16=False)
        assert np.abs(result - expected_step(values)).max() < 2e-2
        chosen = attend.plan_for(replace(STEP, kv_len=kv_len))
        assert chosen.origin == "registry" and chosen.plan.params.tunables == stored
        assert chosen.plan.problem.kv_len == kv_len and chosen.plan.sequence_splits <= 4
    assert counting.calls == 1  # the bucket, found for this GPU: once


def test_only_a_neighbouring_bucket_lends_its_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket at half or twice a chosen one's kv_len keeps that kernel; one further away
    gets the whole candidate space (a kernel chosen for 64 keys is not one for 1024)."""
    counts = Counts(monkeypatch)
    chooser = plan_choice.PlanChooser(None, ENV, H200)
    for kv_len, spaces in ((64, 1), (1024, 2), (2048, 2), (512, 2), (8192, 3)):
        chosen = chooser.plan_for(replace(STEP, kv_len=kv_len))
        assert counts.spaces == spaces, kv_len
        assert chosen.origin == "default" and chosen.plan.problem.kv_len == kv_len
    defines = {
        n: chooser.plan_for(replace(STEP, kv_len=n)).plan.compile_defines()
        for n in (512, 1024, 2048)
    }
    assert defines[512] == defines[1024] == defines[2048]
