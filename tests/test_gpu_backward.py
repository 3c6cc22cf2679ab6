"""The backward pass on a real GPU, in seconds.

* Through the PyCUDA backend, as a tuning trial: dtype x head_dim (64, 128) x odd lengths x
  causal x GQA/MQA x kv_len != seq_len, three plans each (the default-like 16 keys a warp,
  32 keys a warp, single-buffered deterministic with the group split in shares), and the
  variants (window, softcap + ALiBi + sinks): dQ, dK, dV against float64 by FlashAttention's
  rule (``kernels.precision``), the detail naming every gradient's error on failure.
* Through ``kernels.attention(...).backward()``: gradients against torch's float64 autograd
  (twice torch's own error in the dtype plus a floor), the registry's backward plan served,
  deterministic mode bit-identical across runs, a ``torch.compile(fullgraph=True)`` training
  step, and a CUDA graph of forward + backward replayed on new data.

Skipped where torch, pycuda or a CUDA device is missing. Run with ``-s`` for the
``[backward]`` lines (each trial's errors and limits).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import pytest

from db import PlanRecord, PlanRegistry
from kernels import build, precision
from kernels.backends.pycuda_backend import DEFAULT_CACHE_DIR, PyCudaBackend
from kernels.build import CompileFailure
from tuner.errors import BackendError
from tuner.planner.families import family_named
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan
from tuner.problem import Problem

pytestmark = pytest.mark.gpu

CACHE_DIR = os.environ.get("FLASH_ATTENTION_TUNER_CUBIN_CACHE", DEFAULT_CACHE_DIR)
FAMILY = family_named("mma_f16_bwd")
#: (seq_len, kv_len, causal, heads, kv_heads): odd lengths, GQA and MQA, both kv_len sides
SHAPES = [
    (77, 77, False, 4, 4),
    (200, 200, True, 4, 2),
    (129, 300, True, 4, 1),
    (150, 100, False, 2, 2),
]


def problems() -> list[Problem]:
    return [
        Problem(n, d, batch=2, heads=h, kv_heads=kvh, kv_len=m, causal=c, dtype=dtype,
                direction="backward")
        for dtype in ("bfloat16", "float16")
        for d in (64, 128)
        for n, m, c, h, kvh in SHAPES
    ]  # fmt: skip


VARIANTS = [
    Problem(300, 64, batch=1, heads=2, causal=True, window_left=70, kv_len=350,
            dtype="bfloat16", direction="backward"),
    Problem(190, 64, batch=2, heads=2, causal=True, softcap=20.0, alibi=True, sinks=True,
            dtype="bfloat16", direction="backward"),
]  # fmt: skip


def plans_for(problem: Problem, profile: Any) -> list[KernelPlan]:
    wide = {"block_m": 64, "block_n": 128, "warps": 4} if problem.head_dim == 64 else {
        "block_m": 128, "block_n": 128, "warps": 8, "stages": 1}  # fmt: skip
    choices = [
        {"block_m": 64, "block_n": 128, "warps": 8, "stages": 2, "q_chunk": 16},
        # (at head_dim 128 the ordered dQ of 32-row chunks spills under a causal mask)
        {"block_m": 32, "block_n": 64, "warps": 4, "stages": 1,
         "q_chunk": 32 if problem.head_dim == 64 else 16, "deterministic": 1,
         "group_split": problem.group},
        wide,
    ]  # fmt: skip
    plans = []
    for tunables in choices:
        plan = FAMILY.plan(problem, KernelParams("mma_f16_bwd", **tunables), profile)
        if not plan.feasible:
            assert "larger than needed" in plan.reason, plan.reason
            plan = dataclasses.replace(plan, feasible=True, reason="")
        plans.append(plan)
    return plans


@pytest.fixture(scope="module")
def backend():
    pytest.importorskip("pycuda.driver")
    gpu = PyCudaBackend(cache_dir=CACHE_DIR, repetitions=2, warmup=1, seed=3)
    try:
        profile = gpu.device_profile()
    except BackendError as error:
        pytest.skip(f"no GPU to run on: {error}")
    plans = [plan for problem in problems() + VARIANTS for plan in plans_for(problem, profile)]
    results = gpu.precompile(plans)
    failures = {k: r.reason for k, r in results.items() if isinstance(r, CompileFailure)}
    assert not failures
    yield gpu
    gpu.close()


def say(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(f"\n[backward] {line}")


@pytest.mark.parametrize(
    "problem", problems() + VARIANTS, ids=lambda p: p.label().replace(" ", "-")
)
def test_backward_matches_float64_through_the_backend(backend, problem, capsys) -> None:
    wrong = []
    for plan in plans_for(problem, backend.device_profile()):
        result = backend.measure(plan, problem)
        say(capsys, f"{problem.label()} {plan.key()}: {result.failure or 'ok'} {result.detail}")
        if not result.ok:
            wrong.append(f"{plan.key()}: {result.failure} {result.detail}")
            continue
        assert result.forward_ms and result.median_ms and result.tflops
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------- torch


@pytest.fixture(scope="module")
def torch() -> Any:
    torch = pytest.importorskip("torch")
    pytest.importorskip("pycuda.driver")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device answers torch")
    return torch


@pytest.fixture
def no_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # conftest: an empty data directory, so registry=None is none


def leaves(torch: Any, shape: tuple[int, ...], kv_shape: tuple[int, ...], dtype: Any, seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda s: torch.randn(s, device="cuda", dtype=dtype, generator=generator)  # noqa: E731
    q, k, v, dout = make(shape), make(kv_shape), make(kv_shape), make(shape)
    return [t.requires_grad_() for t in (q, k, v)], dout


def eager_attention(torch: Any, q: Any, k: Any, v: Any, causal: bool) -> Any:
    """The textbook attention in q's dtype (GQA by repeating k and v; causal bottom-right)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q * (1 / math.sqrt(q.shape[-1]))) @ k.transpose(-1, -2)
    if causal:
        n, m = q.shape[-2], k.shape[-2]
        hidden = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(m - n + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def gradients(torch: Any, function: Any, inputs: list[Any], dout: Any) -> list[Any]:
    leaves_ = [t.detach().clone().requires_grad_() for t in inputs]
    function(*leaves_).backward(dout.to(leaves_[0].dtype))
    return [t.grad for t in leaves_]


def check_against_float64(torch: Any, ours: list[Any], inputs: list[Any], dout: Any,
                          causal: bool) -> str:  # fmt: skip
    """Each gradient within 2x torch's own error in the dtype (eager attention with autograd)
    plus half an ulp at its scale, against float64 autograd of the same inputs; the errors."""
    wide = [t.detach().to(torch.float64) for t in inputs]
    exact = gradients(torch, lambda *x: eager_attention(torch, *x, causal), wide, dout)
    theirs = gradients(torch, lambda *x: eager_attention(torch, *x, causal), inputs, dout)
    floor = precision.FLOOR[str(inputs[0].dtype).removeprefix("torch.")]
    lines, wrong = [], []
    for name, mine, peer, ref in zip(("dq", "dk", "dv"), ours, theirs, exact, strict=True):
        error = float((mine.to(torch.float64) - ref).abs().max())
        peer_error = float((peer.to(torch.float64) - ref).abs().max())
        limit = 2 * peer_error + floor * max(1.0, float(ref.abs().max()))
        lines.append(f"{name} {error:.3g} (limit {limit:.3g})")
        if not error <= limit:  # NaN fails
            wrong.append(name)
    assert not wrong, f"{', '.join(wrong)} past the limit: {'; '.join(lines)}"
    return "; ".join(lines)


TORCH_CASES = [
    ((2, 4, 200, 64), (2, 2, 200, 64), True, "bfloat16"),
    ((1, 8, 333, 128), (1, 8, 500, 128), False, "float16"),
    ((1, 4, 129, 128), (1, 1, 257, 128), True, "bfloat16"),
]


@pytest.mark.parametrize(("shape", "kv_shape", "causal", "dtype"), TORCH_CASES)
def test_attention_backward_matches_torch_float64_autograd(
    torch, no_registry, capsys, shape, kv_shape, causal, dtype
) -> None:
    import kernels

    inputs, dout = leaves(torch, shape, kv_shape, getattr(torch, dtype), seed=1)
    out = kernels.attention(*inputs, causal=causal)
    assert out.requires_grad and out.dtype == inputs[0].dtype
    out.backward(dout)
    ours = [t.grad for t in inputs]
    assert [g.shape for g in ours] == [t.shape for t in inputs]
    say(capsys, f"{shape} {kv_shape} {dtype} causal={causal}: "
        f"{check_against_float64(torch, ours, inputs, dout, causal)}")  # fmt: skip


def test_deterministic_mode_is_bit_identical_and_agrees_with_atomic(torch, no_registry) -> None:
    import kernels

    inputs, dout = leaves(torch, (2, 8, 1000, 64), (2, 2, 1000, 64), torch.bfloat16, seed=2)
    runs = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            runs.append(gradients(torch, lambda *x: kernels.attention(*x, causal=True), inputs,
                                  dout))  # fmt: skip
    finally:
        torch.use_deterministic_algorithms(False)
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)
    atomic = gradients(torch, lambda *x: kernels.attention(*x, causal=True), inputs, dout)
    for deterministic, other in zip(runs[0], atomic, strict=True):
        assert float((deterministic.float() - other.float()).abs().max()) < 0.05


def test_the_registry_serves_the_backward_plan(torch, tmp_path, capsys) -> None:
    import kernels

    shape, kv_shape = (1, 4, 256, 64), (1, 2, 256, 64)
    problem = Problem(256, 64, heads=4, kv_heads=2, causal=True, dtype="bfloat16",
                      direction="backward")  # fmt: skip
    params = {"block_m": 32, "block_n": 64, "warps": 4, "stages": 1, "q_chunk": 16,
              "deterministic": 0, "group_split": 2}  # fmt: skip
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    environment = kernels.Attention().environment()  # the live GPU's, as the registry is asked
    with PlanRegistry.open(url) as registry:
        record = PlanRecord("mma_f16_bwd", params, build.source_hash("mma_f16_bwd"), True,
                            median_ms=0.1)  # fmt: skip
        registry.record(problem, environment, record)
    inputs, dout = leaves(torch, shape, kv_shape, torch.bfloat16, seed=4)
    ours = gradients(torch, lambda *x: kernels.attention(*x, causal=True, registry=url), inputs,
                     dout)  # fmt: skip
    handle = kernels.deploy.default_instance(url)._runner(0).backward_handle(problem)
    assert handle.chosen.origin == "registry" and handle.plan.params.group_split == 2
    say(capsys, f"registry plan {handle.plan.key()}: "
        f"{check_against_float64(torch, ours, inputs, dout, True)}")  # fmt: skip


class Block:
    """Two pre-norm transformer layers of d_model 256, 4 heads of 64 (bf16)."""

    def __init__(self, torch: Any, attention: Any) -> None:
        self.torch, self.attention = torch, attention
        generator = torch.Generator(device="cuda").manual_seed(7)
        self.weights = [
            (torch.randn(256, 256 * 3, device="cuda", generator=generator) / 16,
             torch.randn(256, 256, device="cuda", generator=generator) / 16)
            for _ in range(2)
        ]  # fmt: skip
        self.weights = [
            tuple(w.to(torch.bfloat16).requires_grad_() for w in pair) for pair in self.weights
        ]

    def __call__(self, x: Any) -> Any:
        torch = self.torch
        batch, length, width = x.shape
        for qkv_weight, out_weight in self.weights:
            h = torch.nn.functional.layer_norm(x, (width,))
            q, k, v = (h @ qkv_weight).view(batch, length, 3, 4, 64).permute(2, 0, 3, 1, 4)
            attended = self.attention(q.contiguous(), k.contiguous(), v.contiguous())
            x = x + attended.transpose(1, 2).reshape(batch, length, width) @ out_weight
        return x.float().square().mean()


def test_a_compiled_training_step_matches_eager(torch, no_registry) -> None:
    import kernels

    def ours(q, k, v):
        return kernels.attention(q, k, v, causal=True)

    x = torch.randn(2, 384, 256, device="cuda", dtype=torch.bfloat16)
    eager = Block(torch, ours)
    eager(x).backward()
    compiled_block = Block(torch, ours)
    step = torch.compile(compiled_block.__call__, fullgraph=True)
    step(x).backward()
    for (a, b), (c, d) in zip(eager.weights, compiled_block.weights, strict=True):
        for mine, theirs in ((a, c), (b, d)):
            scale = max(1e-3, float(mine.grad.float().abs().max()))
            assert float((mine.grad.float() - theirs.grad.float()).abs().max()) < 0.05 * scale


def test_a_cuda_graph_captures_forward_and_backward(torch, no_registry) -> None:
    import kernels

    shape, kv_shape = (1, 8, 512, 128), (1, 8, 512, 128)
    (q, k, v), dout = leaves(torch, shape, kv_shape, torch.bfloat16, seed=5)

    def step() -> None:
        kernels.attention(q, k, v, causal=True).backward(dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # the first call of each direction compiles and loads: not captured
            q.grad = k.grad = v.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    q.grad = k.grad = v.grad = None
    with torch.cuda.graph(graph):
        step()
    (new_q, new_k, new_v), new_dout = leaves(torch, shape, kv_shape, torch.bfloat16, seed=6)
    with torch.no_grad():
        for static, new in ((q, new_q), (k, new_k), (v, new_v), (dout, new_dout)):
            static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    expected = gradients(torch, lambda *x: kernels.attention(*x, causal=True), [q, k, v], dout)
    for replayed, eager in zip((q.grad, k.grad, v.grad), expected, strict=True):
        assert torch.equal(replayed, eager) or float((replayed - eager).abs().max()) < 0.05
