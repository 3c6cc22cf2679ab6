"""Are a backward pass's gradients right? The per-problem float64 reference and the check.

``BackwardReference.compute`` runs the float64 forward and backward
(``kernels.reference.attention_backward_reference``) on the problem's rounded inputs and dO,
and derives each gradient's limit from torch's own error in the dtype
(``kernels.precision.gradient_tolerances``). Small problems are checked whole; larger ones on
the query heads of the last batch-KV-head (every query head of its group, so its dK and dV are
complete), which keeps the CPU side to seconds. The sinks' gradient sums over the batch, so it
is checked on whole checks only.

``check`` fails on any non-finite element anywhere (outputs are poisoned with NaN before a
run, so an unwritten one fails) and on any gradient past its limit; its detail names every
gradient's error and limit, and where the worst one is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kernels import precision
from kernels.parity import FULL_CHECK_WORK, ParityResult, non_finite
from kernels.reference import Gradients, attention_backward_reference
from tuner.problem import Problem


def full_backward_check(problem: Problem) -> bool:
    work = problem.batch_heads * problem.seq_len * problem.kv_len * problem.head_dim
    return work <= FULL_CHECK_WORK


@dataclass
class BackwardReference:
    problem: Problem
    gradients: Gradients
    #: the reference values each check compares against: dq, dk, dv (selected heads) and
    #: d_sinks (summed over the batch, whole checks only)
    references: dict[str, np.ndarray]
    tolerances: dict[str, float]
    #: torch's own errors in the dtype (None without torch)
    peer_errors: dict[str, float] | None = None
    full: bool = True
    axes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def compute(
        cls,
        problem: Problem,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        dout: np.ndarray,
        alibi_slopes: np.ndarray | None = None,
        sinks: np.ndarray | None = None,
    ) -> BackwardReference:
        """q, dout ``[batch * heads, seq_len, head_dim]``, k, v ``[batch * kv_heads, kv_len,
        head_dim]``: the values of the rounded inputs (float32)."""
        full = full_backward_check(problem)
        last = problem.batch_kv_heads - 1
        kv_heads = np.arange(problem.batch_kv_heads) if full else np.array([last])
        gradients = attention_backward_reference(
            problem, q, k, v, dout, kv_heads, alibi_slopes=alibi_slopes, sinks=sinks
        )
        references = {"dq": gradients.dq, "dk": gradients.dk, "dv": gradients.dv}
        if full and gradients.d_sinks is not None:
            references["d_sinks"] = gradients.d_sinks.reshape(problem.batch, problem.heads).sum(0)
        peer = precision.torch_gradient_errors(
            problem, q, k, v, dout, references, kv_heads, alibi_slopes, sinks
        )
        tolerances = precision.gradient_tolerances(problem, references, peer)
        axes = {
            "dq": "query head, row, column",
            "dk": "KV head, key, column",
            "dv": "KV head, key, column",
            "d_sinks": "head",
        }
        return cls(problem, gradients, references, tolerances, peer, full, axes)

    def select(self, name: str, values: np.ndarray) -> np.ndarray:
        """The part of a whole gradient that the reference covers."""
        p = self.problem
        if name == "dq":
            return values.reshape(p.batch_heads, p.seq_len, p.head_dim)[self.gradients.heads]
        if name in ("dk", "dv"):
            whole = values.reshape(p.batch_kv_heads, p.kv_len, p.head_dim)
            return whole[self.gradients.kv_heads]
        return values.reshape(-1)

    def check(self, outputs: dict[str, np.ndarray]) -> ParityResult:
        """``outputs``: the kernel's whole dq, dk, dv (and d_sinks) as float32 values."""
        for name in precision.GRADIENTS:
            if name in outputs and (failure := non_finite(outputs[name])) is not None:
                return ParityResult(False, math.inf, f"{name}: {failure.detail}")
        errors: dict[str, float] = {}
        worst_name, worst_ratio, where = "", -1.0, ()
        for name, reference in self.references.items():
            got = self.select(name, outputs[name]).astype(np.float64)
            error = np.abs(got - reference)
            errors[name] = float(error.max()) if error.size else 0.0
            ratio = errors[name] / self.tolerances[name]
            if ratio > worst_ratio and error.size:
                worst_name, worst_ratio = name, ratio
                where = tuple(int(i) for i in np.unravel_index(int(np.argmax(error)), error.shape))
        summary = ", ".join(
            f"{name} {errors[name]:.3g} (limit {self.tolerances[name]:.3g})" for name in errors
        )
        kv_heads = ",".join(map(str, self.gradients.kv_heads))
        scope = "whole" if self.full else f"KV head(s) {kv_heads}"
        ok = worst_ratio <= 1.0
        detail = f"max |error| vs float64 ({scope}): {summary}"
        if not ok:
            detail += (
                f"; worst {worst_name} at [{self.axes[worst_name]}] = {list(where)} "
                f"(reference {self.references[worst_name][where]:.4g})"
            )
        return ParityResult(ok, max(errors.values(), default=0.0), detail)

    def check_forward(self, out: np.ndarray, lse: np.ndarray, tolerance: float) -> ParityResult:
        """The forward's output and log-sum-exps the backward runs on, against the reference
        (rows that see no key: lse +inf on both sides)."""
        p = self.problem
        heads = self.gradients.heads
        got_out = out.reshape(p.batch_heads, p.seq_len, p.head_dim)[heads].astype(np.float64)
        got_lse = lse.reshape(p.batch_heads, p.seq_len)[heads].astype(np.float64)
        out_error = float(np.abs(got_out - self.gradients.out).max())
        same_inf = np.isinf(got_lse) & np.isinf(self.gradients.lse)
        with np.errstate(invalid="ignore"):  # inf - inf where both are +inf: masked out
            lse_error = float(np.where(same_inf, 0.0, np.abs(got_lse - self.gradients.lse)).max())
        if not np.isfinite(lse_error) or np.isnan(got_out).any():
            return ParityResult(False, math.inf, "the forward's output or LSE is not finite")
        # The LSE is an fp32 sum of exp2 terms: its error is a few fp32 ulps of |lse|; under a
        # softcap every logit carries the SFU tanh's error too (2^-11 of the cap, at most).
        finite = np.abs(np.where(same_inf, 0, self.gradients.lse))
        lse_limit = 1e-4 * max(1.0, float(finite.max())) + p.softcap * 2.0**-10
        ok = out_error <= tolerance and lse_error <= lse_limit
        detail = (
            f"forward out {out_error:.3g} (limit {tolerance:.3g}), lse {lse_error:.3g} "
            f"(limit {lse_limit:.3g})"
        )
        return ParityResult(ok, out_error, detail)
