"""The attention variants on a real GPU: sliding window, softcap, ALiBi, sinks and a caller's scale.

Three paths, each judged against the float64 reference of the same rounded inputs
(``kernels.reference``, the variants as ``kernels.attention_variants`` defines them) by the
project's pass rule (``kernels.precision``: twice the peer's error plus the dtype's floor; the
peer is torch's SDPA for windows, a flash kernel's emulated arithmetic for softcap, ALiBi and
sinks):

* ``kernels.attention`` on torch CUDA tensors, bfloat16 and float16, one case per variant and
  the hard corners: a window smaller than one key tile, window + causal + GQA with
  ``kv_len != seq_len``, rows that see no key (output 0), softcap with logits in the hundreds,
  ALiBi over 64 heads (and 12), sinks that dominate, decode (1-4 query rows, GQA), a scale of
  the caller's, everything at once; then the per-call values (slopes, sinks, scale) through
  one cached handle;
* ``PyCudaBackend.measure`` of variant problems: the default plan (the cost model's best) of
  every family that takes the problem passes parity; families that cannot run a variant must
  say so through the planner's reasons (they are then not candidates); at least one runs;
* the log-sum-exp a backward pass will read (``DeviceBuffers.lse``): natural log of the scaled
  logits' sum with the sinks, ``+inf`` for a row that sees no key.

These expect the kernels of the variant ABI (``tests/variant_family.py`` spells it out).
Skipped where torch, pycuda or a CUDA device is missing. Run with ``-s`` for the lines printed
as ``[variants]``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels import precision
from kernels.attention_variants import VariantValues, alibi_slopes
from kernels.backends.base import Failure
from kernels.parity import CpuReference
from kernels.reference import reference_rows
from kernels.tuning_inputs import SINK_OFFSETS, typical_row_lse
from tuner.costmodel import predict_time_ms
from tuner.planner.families import families_for
from tuner.planner.space import candidate_space
from tuner.problem import Problem

pytestmark = pytest.mark.gpu

HALF_DTYPES = ["bfloat16", "float16"]


@dataclass(frozen=True)
class Case:
    """One call: shapes, variants, and how the inputs are drawn."""

    name: str
    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    kv_len: int
    head_dim: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    #: "" none, "typical" (27-95% of a row's weight, as tuning draws them), "dominating"
    sinks: str = ""
    scale: float | None = None
    #: standard deviation of q's and k's elements (10: logits with a deviation of 100)
    spread: float = 1.0

    def problem(self, dtype: str) -> Problem:
        return Problem(
            self.seq_len,
            self.head_dim,
            batch=self.batch,
            heads=self.heads,
            causal=self.causal,
            dtype=dtype,
            kv_heads=self.kv_heads,
            kv_len=self.kv_len,
            window_left=self.window[0],
            window_right=self.window[1],
            softcap=self.softcap,
            alibi=self.alibi,
            sinks=bool(self.sinks),
        )


CASES = [
    Case("window-inside-one-tile", 2, 8, 8, 300, 300, 128, causal=True, window=(5, 0)),
    Case("window-causal-gqa-cache", 1, 8, 2, 200, 1000, 128, causal=True, window=(64, -1)),
    Case("window-two-sided", 1, 4, 4, 256, 256, 64, window=(32, 16)),
    # 64 queries against 48 keys, right bound 0: rows 0-15 see no key and must be 0
    Case("window-rows-without-keys", 1, 4, 4, 64, 48, 64, window=(8, 0)),
    Case("softcap-logits-in-the-hundreds", 2, 4, 4, 512, 512, 128, causal=True, softcap=50.0,
         spread=10.0),
    Case("softcap-gqa-d64", 1, 8, 2, 1000, 1000, 64, softcap=30.0, spread=10.0),
    Case("alibi-64-heads", 1, 64, 8, 256, 256, 128, causal=True, alibi=True),
    Case("alibi-12-heads-cache", 2, 12, 4, 100, 700, 64, causal=True, alibi=True),
    Case("sinks-dominating", 1, 8, 2, 128, 512, 128, causal=True, sinks="dominating"),
    Case("sinks-typical", 2, 16, 4, 300, 300, 64, sinks="typical"),
    Case("decode-window", 4, 32, 8, 1, 8192, 128, causal=True, window=(4096, 0)),
    Case("decode-softcap-sinks", 2, 64, 8, 4, 4000, 64, causal=True, softcap=30.0,
         sinks="typical", spread=10.0),
    Case("decode-alibi", 8, 16, 2, 2, 1500, 128, causal=True, alibi=True),
    Case("scale-with-window", 1, 8, 8, 512, 512, 128, causal=True, window=(100, 0), scale=0.05),
    Case("scale-alone", 1, 4, 4, 384, 384, 64, scale=0.3),
    Case("everything", 2, 8, 2, 160, 400, 128, causal=True, window=(64, 0), softcap=20.0,
         alibi=True, sinks="typical", scale=0.1, spread=3.0),
]


@pytest.fixture(scope="module")
def torch() -> Any:
    torch = pytest.importorskip("torch")
    pytest.importorskip("pycuda.driver")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device answers torch")
    return torch


@pytest.fixture
def no_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # conftest: an empty data directory, so the default plan serves


def say(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(f"\n[variants] {line}")


@dataclass
class Drawn:
    """A case's tensors on the device and what the reference needs on the host."""

    q: Any
    k: Any
    v: Any
    alibi_slopes: Any
    sinks: Any
    host: tuple[np.ndarray, np.ndarray, np.ndarray]  # [b*h, n, d] float32 of the rounded inputs
    variants: VariantValues


def draw(torch: Any, case: Case, dtype: str, seed: int = 0, device: str = "cuda") -> Drawn:
    """q, k scaled by the case's spread and v, rounded to ``dtype``; the standard slopes;
    sinks near (or far above) a typical row's log-sum-exp; all as the caller passes them."""
    problem = case.problem(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    torch_dtype = getattr(torch, dtype)

    def randn(heads: int, rows: int, spread: float) -> Any:
        shape = (case.batch, heads, rows, case.head_dim)
        values = torch.randn(shape, device=device, generator=generator) * spread
        return values.to(torch_dtype)

    q = randn(case.heads, case.seq_len, case.spread)
    k = randn(case.kv_heads, case.kv_len, case.spread)
    v = randn(case.kv_heads, case.kv_len, 1.0)
    host = tuple(
        t.float().cpu().numpy().reshape(-1, *t.shape[2:]) for t in (q, k, v)
    )
    slopes = None
    if case.alibi:
        slopes = torch.tensor(alibi_slopes(case.heads), dtype=torch.float32, device=device)
    slope_values = None if slopes is None else slopes.cpu().numpy().astype(np.float64)
    sinks = None
    if case.sinks:
        without = VariantValues(
            problem.window_left, problem.window_right, case.softcap, slope_values, None,
            case.scale,
        )
        typical = typical_row_lse(problem, *host, without)
        rng = np.random.default_rng(seed)
        offsets = rng.uniform(*SINK_OFFSETS, size=case.heads)
        if case.sinks == "dominating":
            offsets = offsets + 20.0  # e^20 times a row's own weight: the output all but 0
        sinks = torch.tensor(typical + offsets, dtype=torch.float32, device=device)
    sink_values = None if sinks is None else sinks.cpu().numpy().astype(np.float64)
    variants = VariantValues.of(problem, slope_values, sink_values, case.scale)
    return Drawn(q, k, v, slopes, sinks, host, variants)  # type: ignore[arg-type]


def judge(problem: Problem, drawn: Drawn, output: np.ndarray) -> tuple[bool, float, float, str]:
    """(passed, max error, limit, detail) of ``output`` (``[b*h, n, d]`` float32) by the
    project's rule, against the float64 reference of the drawn values."""
    reference = CpuReference(problem, *drawn.host, variants=drawn.variants)
    sampled = (reference.expected, reference.heads, reference.rows)
    peer = precision.sdpa_error(problem, *drawn.host, *sampled, drawn.variants)
    limit = precision.tolerance_for(problem, peer)
    result = reference.check(output, limit)
    return result.ok, result.max_abs_error, limit, result.detail


def call(attend: Any, case: Case, drawn: Drawn) -> Any:
    return attend(
        drawn.q,
        drawn.k,
        drawn.v,
        case.causal,
        window=case.window,
        softcap=case.softcap,
        alibi_slopes=drawn.alibi_slopes,
        sinks=drawn.sinks,
        scale=case.scale,
    )


# ---------------------------------------------------------------- kernels.attention


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_attention_runs_each_variant_within_the_half_precision_rule(
    torch, no_registry, capsys, case: Case, dtype: str
) -> None:
    from kernels.deploy import Attention

    problem = case.problem(dtype)
    drawn = draw(torch, case, dtype)
    attend = Attention()
    with torch.no_grad():
        out = call(attend, case, drawn)
    assert out.dtype == drawn.q.dtype and out.shape == drawn.q.shape
    chosen = attend.plan_for(problem, drawn.q.device.index)
    assert chosen.plan.problem == problem  # the problem with its variants, never a dense one
    output = out.float().cpu().numpy().reshape(drawn.host[0].shape)
    ok, error, limit, detail = judge(problem, drawn, output)
    say(
        capsys,
        f"{case.name} {problem.label()}: {chosen.plan.key()} error {error:.2e} (limit {limit:.2e})",
    )
    assert ok, f"{chosen.plan.key()}: {detail}"
    if case.name == "window-rows-without-keys":
        assert torch.count_nonzero(out[:, :, :16]) == 0
    if case.sinks == "dominating":
        assert float(out.float().abs().max()) < 1e-2
    attend.close()


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_one_handle_takes_each_calls_slopes_sinks_and_scale(
    torch, no_registry, capsys, dtype: str
) -> None:
    """The fast path's launches read the values of this call: new slopes, sinks and scales
    through one cached handle, each output within the rule for its own values."""
    from kernels.deploy import Attention

    case = Case("per-call", 2, 8, 2, 128, 600, 128, causal=True, window=(256, 0), alibi=True,
                sinks="typical")
    problem = case.problem(dtype)
    attend = Attention()
    for seed, scale in ((0, None), (1, 0.2), (2, 0.02), (3, None)):
        drawn = draw(torch, case, dtype, seed=seed)
        slopes = drawn.alibi_slopes * (1 + seed)  # other slopes, as the next layer's
        with torch.no_grad():
            out = attend(
                drawn.q, drawn.k, drawn.v, True, window=case.window, alibi_slopes=slopes,
                sinks=drawn.sinks, scale=scale,
            )
        drawn.variants = VariantValues.of(
            problem, slopes.cpu().numpy().astype(np.float64), drawn.variants.sinks, scale
        )
        ok, error, limit, detail = judge(
            problem, drawn, out.float().cpu().numpy().reshape(drawn.host[0].shape)
        )
        say(capsys, f"per-call seed {seed} scale {scale}: error {error:.2e} (limit {limit:.2e})")
        assert ok, detail
    runner = attend._runners[drawn.q.device.index]
    assert list(runner._handles) == [problem]  # one handle for every slope, sink and scale
    attend.close()


# ---------------------------------------------------------------- the tuning backend


BACKEND_PROBLEMS = [
    Problem(300, 128, heads=8, kv_heads=2, kv_len=900, causal=True, window_left=40,
            dtype="bfloat16"),
    Problem(256, 64, batch=2, heads=4, window_left=16, window_right=16, dtype="float16"),
    Problem(512, 128, heads=8, causal=True, softcap=50.0, dtype="bfloat16"),
    Problem(200, 128, heads=64, kv_heads=8, causal=True, alibi=True, dtype="bfloat16"),
    Problem(160, 64, heads=8, kv_heads=2, kv_len=700, causal=True, sinks=True, dtype="float16"),
    Problem(1, 128, batch=4, heads=32, kv_heads=8, kv_len=4096, window_left=1024,
            dtype="bfloat16"),
    Problem(4, 64, batch=2, heads=64, kv_heads=8, kv_len=3000, causal=True, softcap=30.0,
            sinks=True, dtype="bfloat16"),
    Problem(128, 128, heads=8, kv_heads=2, kv_len=384, causal=True, window_left=100,
            softcap=20.0, alibi=True, sinks=True, dtype="bfloat16"),
    Problem(200, 64, heads=4, causal=True, window_left=30, softcap=20.0, alibi=True, sinks=True),
]


@pytest.fixture(scope="module")
def backend() -> Any:
    if importlib.util.find_spec("pycuda") is None:
        pytest.skip("pycuda is not installed")
    from kernels.backends.pycuda_backend import DEFAULT_CACHE_DIR, PyCudaBackend

    try:
        measuring = PyCudaBackend(
            0,
            cache_dir=os.environ.get("FLASH_ATTENTION_TUNER_CUBIN_CACHE", DEFAULT_CACHE_DIR),
            repetitions=3,
            warmup=1,
        )
        measuring.device_profile()
    except Exception as error:  # no device, no driver
        pytest.skip(f"no CUDA device answers: {error}")
    yield measuring
    measuring.close()


def default_plans(problem: Problem, device: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """Per family taking the dtype: its best predicted feasible plan; and for the families
    with none, the first reason the planner gave."""
    space = candidate_space(problem, device)
    plans: dict[str, Any] = {}
    refused: dict[str, str] = {}
    for family in families_for(problem.dtype):
        feasible = [p for p in space.feasible if p.family == family]
        if feasible:
            plans[family] = min(feasible, key=lambda p: predict_time_ms(p, device))
        else:
            reasons = [p.reason for p in space.rejected if p.family == family]
            refused[family] = reasons[0] if reasons else "no candidate planned"
    return plans, refused


@pytest.mark.parametrize("problem", BACKEND_PROBLEMS, ids=[p.label() for p in BACKEND_PROBLEMS])
def test_the_default_plan_of_every_family_that_takes_the_variant_passes_parity(
    backend: Any, capsys, problem: Problem
) -> None:
    plans, refused = default_plans(problem, backend.device_profile())
    for family, reason in refused.items():
        say(capsys, f"{problem.label()}: {family} refuses: {reason}")
    assert plans, f"no family takes {problem.label()}: {refused}"
    failures, ran = [], []
    for family, plan in plans.items():
        result = backend.measure(plan, problem)
        error = "-" if result.max_abs_error is None else f"{result.max_abs_error:.2e}"
        say(capsys, f"{problem.label()} {plan.key()}: {result.failure or 'ok'} {error}")
        if result.failure == Failure.INFEASIBLE and not result.measured:
            continue  # the compiler's report rules it out (spills), as in a tune run
        if result.ok:
            ran.append(family)
        else:
            failures.append(f"{plan.key()}: {result.failure} {result.detail}")
    assert not failures, failures
    assert ran, f"no default plan of {sorted(plans)} ran for {problem.label()}"


LSE_PROBLEMS = [
    BACKEND_PROBLEMS[0],
    BACKEND_PROBLEMS[4],
    BACKEND_PROBLEMS[7],
    # not causal, right bound 0, 16 more queries than keys: rows without a key get +inf
    Problem(64, 64, heads=4, kv_len=48, window_left=8, window_right=0, dtype="bfloat16"),
]


@pytest.mark.parametrize("problem", LSE_PROBLEMS, ids=[p.label() for p in LSE_PROBLEMS])
def test_kernels_asked_for_the_lse_write_the_natural_log_sum_with_the_sinks(
    backend: Any, capsys, problem: Problem
) -> None:
    plans, _ = default_plans(problem, backend.device_profile())
    assert plans, f"no family takes {problem.label()}"
    q, k, v = backend.inputs(problem)
    variants = backend.variants(problem)
    heads, rows = np.arange(problem.batch_heads), np.arange(problem.seq_len)
    _, want = reference_rows(
        q, k, v, problem.causal, heads, rows, problem.group, variants, lse=True
    )
    for plan in plans.values():
        _, lse = backend.output(plan, problem, lse=True)
        empty = np.isinf(want)
        assert np.array_equal(np.isposinf(lse), empty), f"{plan.key()}: +inf rows differ"
        finite = ~empty
        error = np.abs(lse[finite].astype(np.float64) - want[finite])
        limit = 2e-3 + 1e-4 * np.abs(want[finite])
        worst = float(error.max()) if error.size else 0.0
        say(capsys, f"{problem.label()} {plan.key()}: LSE error {worst:.2e}")
        assert np.all(error <= limit), f"{plan.key()}: LSE off by {worst:.2e}"
