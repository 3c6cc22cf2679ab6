"""The float64 backward reference (against torch's float64 autograd of the same attention,
variants included), the gradients' pass rule (FlashAttention's: twice torch's own error in
the dtype plus a floor at the gradient's scale) and the check's diagnostics."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kernels import precision
from kernels.attention_variants import alibi_slopes, problem_visible_keys
from kernels.backward_parity import BackwardReference, full_backward_check
from kernels.reference import attention_backward_reference, attention_reference
from tuner.problem import Problem

torch = pytest.importorskip("torch")


def torch_float64_gradients(problem: Problem, q, k, v, dout, slopes, sinks):
    """Autograd of the textbook attention in float64 (sinks as an extra softmax column)."""
    p = problem
    qt, kt, vt = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    st = torch.tensor(sinks, dtype=torch.float64, requires_grad=True) if p.sinks else None
    shape = (p.batch, p.heads, p.seq_len, p.head_dim)
    kv_shape = (p.batch, p.kv_heads, p.kv_len, p.head_dim)
    keys = kt.view(kv_shape).repeat_interleave(p.group, 1)
    values = vt.view(kv_shape).repeat_interleave(p.group, 1)
    scores = qt.view(shape) @ keys.transpose(-1, -2) / math.sqrt(p.head_dim)
    if p.softcap:
        scores = p.softcap * torch.tanh(scores / p.softcap)
    if p.alibi:
        rows, cols = np.arange(p.seq_len)[:, None], np.arange(p.kv_len)[None, :]
        distance = torch.tensor(np.abs(rows + p.causal_offset - cols), dtype=torch.float64)
        scores = scores - torch.tensor(slopes, dtype=torch.float64)[None, :, None, None] * distance
    seen = problem_visible_keys(p, np.arange(p.seq_len))
    if seen is not None:
        scores = scores.masked_fill(~torch.tensor(seen), -math.inf)
    if st is not None:
        scores = torch.cat([scores, st[None, :, None, None].expand(*shape[:3], 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1)
    if st is not None:
        weights = weights[..., :-1]
    out = weights @ values
    out.backward(torch.tensor(dout).view(shape))
    sink_grad = st.grad.numpy() if st is not None else None
    grads = (qt.grad.numpy(), kt.grad.numpy(), vt.grad.numpy())
    return (out.detach().numpy().reshape(q.shape), *grads, sink_grad)


CASES = [
    Problem(37, 16, batch=2, heads=4, kv_heads=2, causal=True, kv_len=45),
    Problem(20, 16, heads=3, kv_heads=1, kv_len=29),
    Problem(30, 16, heads=2, softcap=5.0, alibi=True, sinks=True, window_left=7, window_right=3,
            kv_len=33),
    Problem(24, 16, batch=2, heads=2, causal=True, window_left=4, sinks=True, kv_len=30),
]  # fmt: skip


@pytest.mark.parametrize("problem", CASES, ids=[p.label() for p in CASES])
def test_the_reference_is_torchs_float64_autograd(problem: Problem) -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((problem.batch_heads, problem.seq_len, problem.head_dim))
    k = rng.standard_normal((problem.batch_kv_heads, problem.kv_len, problem.head_dim))
    v, dout = rng.standard_normal(k.shape), rng.standard_normal(q.shape)
    slopes = alibi_slopes(problem.heads).astype(np.float32)
    sinks = rng.standard_normal(problem.heads)
    got = attention_backward_reference(
        problem, q, k, v, dout, alibi_slopes=slopes, sinks=sinks if problem.sinks else None
    )
    out, dq, dk, dv, d_sinks = torch_float64_gradients(problem, q, k, v, dout, slopes, sinks)
    for mine, theirs in ((got.out, out), (got.dq, dq), (got.dk, dk), (got.dv, dv)):
        np.testing.assert_allclose(mine, theirs, atol=1e-12)
    if problem.sinks:
        per_head = got.d_sinks.reshape(problem.batch, problem.heads).sum(axis=0)
        np.testing.assert_allclose(per_head, d_sinks, atol=1e-12)
    plain = not (problem.windowed or problem.softcap or problem.alibi or problem.sinks)
    if plain:  # and the forward is the forward reference's
        expected = attention_reference(q, k, v, problem.causal, problem.group)
        np.testing.assert_allclose(got.out, expected, atol=1e-12)


def test_a_selection_of_kv_heads_gives_those_heads_groups() -> None:
    problem = Problem(20, 16, batch=2, heads=4, kv_heads=2)
    rng = np.random.default_rng(2)
    q, dout = (rng.standard_normal((8, 20, 16)) for _ in range(2))
    k, v = (rng.standard_normal((4, 20, 16)) for _ in range(2))
    whole = attention_backward_reference(problem, q, k, v, dout)
    part = attention_backward_reference(problem, q, k, v, dout, kv_heads=[3])
    assert part.heads.tolist() == [6, 7] and part.kv_heads.tolist() == [3]
    np.testing.assert_array_equal(part.dq, whole.dq[6:8])
    np.testing.assert_array_equal(part.dk, whole.dk[3:4])


def test_the_pass_rule_is_twice_torchs_error_plus_a_floor_at_the_gradients_scale() -> None:
    problem = Problem(64, 64, dtype="bfloat16", direction="backward")
    references = {"dq": np.full(3, 0.5), "dk": np.full(3, -6.0)}
    limits = precision.gradient_tolerances(problem, references, {"dq": 0.01, "dk": 0.02})
    assert limits == {"dq": 0.02 + 2.0**-8, "dk": 0.04 + 6 * 2.0**-8}
    fallback = precision.gradient_tolerances(problem, references, None)
    assert fallback == {"dq": 2.0**-5, "dk": 6 * 2.0**-5}


def inputs(problem: Problem, seed: int = 3):
    rng = np.random.default_rng(seed)
    stored, (q, k, v) = precision.random_inputs(problem, rng)
    drawn = rng.standard_normal(q.shape, dtype=np.float32)
    dout = precision.from_storage(precision.to_storage(drawn, problem.dtype), problem.dtype)
    return q, k, v, dout


def test_torchs_error_in_the_dtype_is_that_of_bfloat16_rounding() -> None:
    problem = Problem(64, 64, heads=2, causal=True, dtype="bfloat16", direction="backward")
    reference = BackwardReference.compute(problem, *inputs(problem))
    assert reference.full and reference.peer_errors is not None
    for name in ("dq", "dk", "dv"):
        scale = precision.gradient_scale(reference.references[name])
        assert 2.0**-12 * scale < reference.peer_errors[name] < 2.0**-4 * scale, name


def test_the_check_names_every_gradient_and_where_the_worst_is() -> None:
    problem = Problem(48, 32, heads=2, kv_heads=1, dtype="float16", direction="backward")
    reference = BackwardReference.compute(problem, *inputs(problem))
    exact = {
        "dq": reference.references["dq"].astype(np.float32),
        "dk": reference.references["dk"].astype(np.float32),
        "dv": reference.references["dv"].astype(np.float32),
    }
    passed = reference.check(exact)
    assert passed.ok and "dq" in passed.detail and "limit" in passed.detail
    wrong = dict(exact, dv=exact["dv"].copy())
    wrong["dv"][0, 5, 7] += 1.0
    failed = reference.check(wrong)
    assert not failed.ok
    assert "worst dv at [KV head, key, column] = [0, 5, 7]" in failed.detail
    unwritten = dict(exact, dq=exact["dq"].copy())
    unwritten["dq"][1, 3, 0] = np.nan
    nan = reference.check(unwritten)
    assert not nan.ok and nan.detail.startswith("dq: 1 non-finite elements")


def test_large_problems_are_checked_on_the_last_kv_heads_group() -> None:
    big = Problem(4096, 128, batch=2, heads=32, kv_heads=8, dtype="bfloat16", direction="backward")
    assert not full_backward_check(big)
    small = dataclasses.replace(big, seq_len=256, kv_len=256, batch=1)
    assert full_backward_check(small)
