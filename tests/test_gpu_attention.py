"""``kernels.attention`` on a real GPU: torch tensors, GPUArrays and interface arrays against
torch's ``scaled_dot_product_attention`` (1e-3 absolute), with a registry plan and with the
default-plan fallback, on torch's default and a side stream; and the per-call overhead, printed.

bfloat16 and float16 torch tensors: the same two paths (default plan, a plan stored for the
dtype), judged by FlashAttention's rule: the error against a float64 reference of the same
inputs is at most twice torch SDPA's own (the flash backend where it runs) plus 1e-5; the output
has the inputs' dtype and the call does not wait for its kernels.

Skipped where torch, pycuda, SQLAlchemy or a CUDA device is missing. Cubins are cached in
``$FLASH_ATTENTION_TUNER_CUBIN_CACHE`` (else the PyCUDA backend's default), so a second run
compiles nothing. Run with ``-s`` or read the lines printed as ``[attention]``.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import pytest

import kernels
import kernels.attention as ka
from kernels import build
from kernels.attention import Attention
from tuner.planner.families import families_for
from tuner.planner.tunable import KernelParams
from tuner.problem import Problem

pytestmark = pytest.mark.gpu

TOLERANCE = 1e-3
SHAPES = [((2, 4, 1000, 64), True), ((1, 2, 4096, 128), False)]
IDS = ["2x4x1000x64-causal", "1x2x4096x128-full"]
#: a stored plan unlike the default one: 8 and 32 sequence splits on the two shapes, so the
#: merge kernel and the split scratch run too
STORED = {"threads": 256, "tile_size": 32, "rows_per_block": 64, "split_target": 4}
HALF_DTYPES = ["bfloat16", "float16"]
#: a stored half-precision plan unlike the default one: 4 and 16 key splits on the two shapes
#: (merge kernel and float32 scratch), 64.5 and 119 KiB of shared memory (opt-in), no spills
#: under nvcc 13.0 for sm_90a (161 and 214 registers)
HALF_STORED = {
    "block_m": 64,
    "block_n": 64,
    "warps": 4,
    "stages": 3,
    "q_in_registers": 1,
    "s_groups": 1,
    "split_target": 4,
}
#: FlashAttention's floor on top of twice torch's own error
HALF_FLOOR = 1e-5


@pytest.fixture(scope="module")
def torch() -> Any:
    torch = pytest.importorskip("torch")
    pytest.importorskip("pycuda.driver")
    pytest.importorskip("sqlalchemy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device answers torch")
    return torch


@pytest.fixture
def no_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # conftest: an empty data directory, so registry=None is none


def say(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(f"\n[attention] {line}")


def inputs(torch: Any, shape: tuple[int, ...], seed: int = 0) -> list[Any]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(shape, device="cuda", dtype=torch.float32, generator=generator)
        for _ in range(3)
    ]


def error_vs_sdpa(torch: Any, out: Any, q: Any, k: Any, v: Any, causal: bool) -> float:
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.cuda.synchronize()
    return float((out - want).abs().max().item())


def problem_of(shape: tuple[int, ...], causal: bool, dtype: str = "float32") -> Problem:
    batch, heads, seq_len, head_dim = shape
    return Problem(seq_len, head_dim, batch=batch, heads=heads, causal=causal, dtype=dtype)


def half_inputs(torch: Any, shape: tuple[int, ...], dtype: str, seed: int = 0) -> list[Any]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(shape, device="cuda", dtype=getattr(torch, dtype), generator=generator)
        for _ in range(3)
    ]


def reference64(torch: Any, q: Any, k: Any, v: Any, causal: bool) -> Any:
    """softmax(q k^T / sqrt(d)) v in float64 from the (rounded) inputs themselves."""
    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    scores = q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:  # queries and keys of one length: top-left and bottom-right alignment agree
        n = q.shape[-2]
        above = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v64


def sdpa_flash(torch: Any, q: Any, k: Any, v: Any, causal: bool) -> tuple[Any, str]:
    """torch's SDPA on the flash backend where it runs, else torch's own choice."""
    attend = torch.nn.functional.scaled_dot_product_attention
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return attend(q, k, v, is_causal=causal), "sdpa"
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return attend(q, k, v, is_causal=causal), "sdpa flash"
    except RuntimeError:  # no flash kernel for these inputs here
        return attend(q, k, v, is_causal=causal), "sdpa"


def half_errors(torch: Any, out: Any, q: Any, k: Any, v: Any, causal: bool) -> tuple[float, ...]:
    """(our max error, torch's max error, our limit) against the float64 reference."""
    with torch.no_grad():
        want = reference64(torch, q, k, v, causal)
        theirs, _ = sdpa_flash(torch, q, k, v, causal)
        ours_error = float((out.to(torch.float64) - want).abs().max().item())
        torch_error = float((theirs.to(torch.float64) - want).abs().max().item())
    return ours_error, torch_error, 2 * torch_error + HALF_FLOOR


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


class CountingRegistry:
    def __init__(self, inner: Any) -> None:
        self.inner, self.url, self.calls = inner, inner.url, 0

    def cached_best(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.cached_best(*args, **kwargs)


@pytest.mark.parametrize(("shape", "causal"), SHAPES, ids=IDS)
def test_default_plan_on_torch_tensors_matches_sdpa(
    torch, no_registry, caplog, capsys, shape, causal
) -> None:
    attend = Attention()
    q, k, v = inputs(torch, shape)
    with torch.no_grad():
        out = attend(q, k, v, causal)
        again = attend(q, k, v, causal)
    chosen = attend.plan_for(problem_of(shape, causal))
    assert chosen.origin == "default"
    assert len(warnings_of(caplog)) == 1 and "default plan" in warnings_of(caplog)[0]
    assert out.shape == q.shape and out.dtype == torch.float32 and out.device == q.device
    error = error_vs_sdpa(torch, out, q, k, v, causal)
    assert error < TOLERANCE
    assert torch.equal(out, again)
    say(capsys, f"{chosen.plan.problem.label()}: default {chosen.plan.key()}, error {error:.1e}")
    attend.close()


@pytest.mark.parametrize(("shape", "causal"), SHAPES, ids=IDS)
def test_registry_plan_on_torch_tensors_matches_sdpa(
    torch, tmp_path, caplog, capsys, shape, causal
) -> None:
    from db import PlanRecord, PlanRegistry

    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    problem = problem_of(shape, causal)
    with PlanRegistry.open(url) as writer:
        probe = Attention(writer)
        stored = PlanRecord(
            "tiled", dict(STORED), build.source_hash("tiled"), measured=True, median_ms=1.0
        )
        writer.record(problem, probe.environment(), stored)
        probe.close()
    q, k, v = inputs(torch, shape, seed=1)
    out = kernels.attention(q, k, v, causal, registry=url)  # the shared instance of this URL
    chosen = ka.default_instance(url).plan_for(problem)
    assert chosen.origin == "registry" and chosen.plan.params == KernelParams("tiled", **STORED)
    assert chosen.plan.sequence_splits > 1 and warnings_of(caplog) == []
    error = error_vs_sdpa(torch, out, q, k, v, causal)
    assert error < TOLERANCE
    # Given out, reused: filled in place; the registry is asked once for the shape.
    counting = CountingRegistry(PlanRegistry.open(url, readonly=True))
    attend, given = Attention(counting), torch.full_like(q, float("nan"))
    for _ in range(5):
        assert attend(q, k, v, causal, out=given) is given
    assert counting.calls == 1 and torch.equal(given, out)
    say(capsys, f"{problem.label()}: registry {chosen.plan.key()}, error {error:.1e}")
    attend.close()
    counting.inner.close()
    ka.clear_default_instances()


def test_gpuarrays_and_interface_arrays_match_sdpa(torch, no_registry, capsys) -> None:
    import numpy as np
    import pycuda.driver as drv
    from pycuda import gpuarray

    shape, causal = (2, 4, 1000, 64), True
    q, k, v = inputs(torch, shape, seed=2)
    attend = Attention()
    # GPUArrays in the device's primary context (the one torch and kernels.attention use).
    drv.init()
    context = drv.Device(q.device.index).retain_primary_context()
    context.push()
    try:
        arrays = [gpuarray.to_gpu(t.cpu().numpy()) for t in (q, k, v)]
        out = attend(*arrays, causal)
        assert isinstance(out, gpuarray.GPUArray) and out.shape == shape
        given = gpuarray.empty_like(arrays[0])
        assert attend(*arrays, causal, out=given) is given
        result, again = out.get(), given.get()
        del arrays, out, given  # freed while their context is current
    finally:
        context.pop()
    assert np.array_equal(result, again)
    error = error_vs_sdpa(torch, torch.from_numpy(result).cuda(), q, k, v, causal)
    assert error < TOLERANCE

    class InterfaceOnly:  # what CuPy, Numba or JAX hand over: the interface and nothing else
        def __init__(self, tensor: Any) -> None:
            self.tensor = tensor
            self.__cuda_array_interface__ = tensor.__cuda_array_interface__

    out = attend(*(InterfaceOnly(t) for t in (q, k, v)), causal)
    assert isinstance(out, gpuarray.GPUArray)
    interface_error = error_vs_sdpa(torch, torch.as_tensor(out, device="cuda"), q, k, v, causal)
    assert interface_error < TOLERANCE
    say(capsys, f"GPUArray error {error:.1e}, interface-only arrays error {interface_error:.1e}")
    del out  # before close: a GPUArray it returned is freed in the context it retained
    attend.close()


def test_a_torch_side_stream_is_followed(torch, no_registry) -> None:
    attend = Attention()
    shape = (1, 16, 4096, 128)  # milliseconds of work: an unfenced launch would race visibly
    base = inputs(torch, shape, seed=3)
    want = torch.nn.functional.scaled_dot_product_attention(*base)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for _ in range(3):
        with torch.cuda.stream(side):
            q, k, v = (t * 1.0 for t in base)  # written on the side stream just before the call
            out = attend(q, k, v, False)
            result = out.clone()  # read on the side stream just after it
            q.fill_(float("nan"))  # and q overwritten: the kernels must have finished with it
        side.synchronize()
        assert float((result - want).abs().max().item()) < TOLERANCE
    attend.close()


def test_per_call_overhead_is_small_and_the_call_does_not_wait(torch, no_registry, capsys):
    attend = Attention()
    shape = (1, 1, 128, 64)
    q, k, v = inputs(torch, shape, seed=4)
    out = torch.empty_like(q)
    for _ in range(20):  # first call: plan, compile, module, scratch; then warm
        attend(q, k, v, False, out=out)
    torch.cuda.synchronize()
    calls = 2000

    def per_call_us(run: Any) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            run()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed / calls * 1e6

    given_us = per_call_us(lambda: attend(q, k, v, False, out=out))
    allocating_us = per_call_us(lambda: attend(q, k, v, False))
    # The floor: the same kernels launched straight through PyCUDA (the runner's own objects).
    runner = attend._runners[q.device.index]
    prepared = runner.prepared((shape, "float32", False, "tf32x3"))
    launches = prepared.launches(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())

    def bare() -> None:
        for launch in launches:
            prepared.functions[launch.function](
                *launch.args, grid=launch.grid, block=launch.block, shared=launch.shared_bytes
            )

    with runner.backend.active():
        bare_us = per_call_us(bare)
    # No host synchronisation: a call whose kernels take milliseconds returns long before.
    big = inputs(torch, (1, 16, 4096, 128), seed=5)
    attend(*big, False)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    began = time.perf_counter()
    attend(*big, False)
    returned_ms = (time.perf_counter() - began) * 1e3
    end.record()
    end.synchronize()
    kernel_ms = start.elapsed_time(end)
    say(
        capsys,
        f"per call ({len(launches)} launch(es), {calls} calls, 1x1x128x64): {given_us:.1f} us "
        f"with out=, {allocating_us:.1f} us allocating out; bare PyCUDA launches {bare_us:.1f} us "
        f"-> overhead {given_us - bare_us:.1f} us. 1x16x4096x128: the call returns after "
        f"{returned_ms:.3f} ms, its kernels take {kernel_ms:.3f} ms",
    )
    assert returned_ms < 0.5 * kernel_ms
    assert given_us < 200  # generous: catches a query or a synchronisation per call, not noise
    attend.close()


# ---------------------------------------------------------------- bfloat16 and float16


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize(("shape", "causal"), SHAPES, ids=IDS)
def test_half_default_plan_on_torch_tensors_matches_sdpa(
    torch, no_registry, caplog, capsys, shape, causal, dtype
) -> None:
    attend = Attention()
    q, k, v = half_inputs(torch, shape, dtype)
    with torch.no_grad():
        out = attend(q, k, v, causal)
        again = attend(q, k, v, causal)
    chosen = attend.plan_for(problem_of(shape, causal, dtype))
    assert chosen.origin == "default" and chosen.plan.params.family in families_for(dtype)
    notes = warnings_of(caplog)
    assert len(notes) == 1 and "falling back to the planner's default plan" in notes[0]
    assert out.shape == q.shape and out.dtype == q.dtype == getattr(torch, dtype)
    assert out.device == q.device
    ours, theirs, limit = half_errors(torch, out, q, k, v, causal)
    assert ours <= limit, f"error {ours:.2e} > 2 x torch's {theirs:.2e} + {HALF_FLOOR}"
    assert torch.equal(out, again)
    say(
        capsys,
        f"{chosen.plan.problem.label()}: default {chosen.plan.key()}, error {ours:.1e} "
        f"(torch {theirs:.1e})",
    )
    attend.close()


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize(("shape", "causal"), SHAPES, ids=IDS)
def test_half_registry_plan_on_torch_tensors_matches_sdpa(
    torch, tmp_path, caplog, capsys, shape, causal, dtype
) -> None:
    from db import PlanRecord, PlanRegistry

    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    problem = problem_of(shape, causal, dtype)
    with PlanRegistry.open(url) as writer:
        probe = Attention(writer)
        stored = PlanRecord(
            "mma_f16", dict(HALF_STORED), build.source_hash("mma_f16"), True, median_ms=1.0
        )
        writer.record(problem, probe.environment(), stored)
        # the same shape in float32: a row of another dtype, never served for this one
        other = PlanRecord("tiled", dict(STORED), build.source_hash("tiled"), True, median_ms=0.1)
        writer.record(problem_of(shape, causal), probe.environment(), other)
        probe.close()
    q, k, v = half_inputs(torch, shape, dtype, seed=1)
    with torch.no_grad():
        out = kernels.attention(q, k, v, causal, registry=url)  # the shared instance of this URL
    chosen = ka.default_instance(url).plan_for(problem)
    assert chosen.origin == "registry"
    assert chosen.plan.params == KernelParams("mma_f16", **HALF_STORED)
    assert chosen.plan.sequence_splits > 1 and warnings_of(caplog) == []
    assert out.dtype == q.dtype and out.shape == q.shape
    ours, theirs, limit = half_errors(torch, out, q, k, v, causal)
    assert ours <= limit, f"error {ours:.2e} > 2 x torch's {theirs:.2e} + {HALF_FLOOR}"
    # Given out, reused: filled in place; the registry is asked once for the shape.
    counting = CountingRegistry(PlanRegistry.open(url, readonly=True))
    attend, given = Attention(counting), torch.full_like(q, float("nan"))
    for _ in range(5):
        assert attend(q, k, v, causal, out=given) is given
    assert counting.calls == 1 and torch.equal(given, out)
    say(
        capsys,
        f"{problem.label()}: registry {chosen.plan.key()}, error {ours:.1e} (torch {theirs:.1e})",
    )
    attend.close()
    counting.inner.close()
    ka.clear_default_instances()


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_a_half_call_does_not_wait_for_its_kernels(torch, no_registry, capsys, dtype) -> None:
    attend = Attention()
    # tensor cores: milliseconds of work need a larger problem than float32's 1x16x4096x128
    big = half_inputs(torch, (4, 16, 8192, 128), dtype, seed=5)
    out = attend(*big, False)  # first call: plan, compile, module
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    began = time.perf_counter()
    attend(*big, False, out=out)
    returned_ms = (time.perf_counter() - began) * 1e3
    end.record()
    end.synchronize()
    kernel_ms = start.elapsed_time(end)
    say(
        capsys,
        f"4x16x8192x128 {dtype}: the call returns after {returned_ms:.3f} ms, its kernels "
        f"take {kernel_ms:.3f} ms",
    )
    assert out.dtype == big[0].dtype
    assert returned_ms < 0.5 * kernel_ms
    attend.close()
