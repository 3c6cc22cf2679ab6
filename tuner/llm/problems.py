"""A model x serving buckets -> the distinct attention problems it runs (pure).

A bucket is one kind of call a deployment makes: a prefill of ``length`` tokens per
sequence (``seq_len = kv_len = length``), or a decode step (one query row per sequence
against a KV cache of ``length`` keys), each for ``batch`` sequences, causal. Every
layer of the model makes one problem per bucket; layers whose problems are equal after
``Problem``'s canonicalisation (a window that cuts nothing is no window) share it, so
Gemma 2's sliding and global layers at a 4096-token prefill are one problem, and at
8192 two.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import product

from tuner.llm.attention import ModelAttention
from tuner.problem import Problem

PREFILL = "prefill"
DECODE = "decode"


@dataclass(frozen=True, slots=True)
class Bucket:
    """One kind of call: ``kind`` (prefill or decode) of ``batch`` sequences of ``length``."""

    kind: str
    batch: int
    #: prefill: tokens per sequence; decode: keys in each sequence's KV cache
    length: int

    def label(self) -> str:
        """``prefill 1x8192`` or ``decode 16x8192`` (batch x length)."""
        return f"{self.kind} {self.batch}x{self.length}"

    def problem(
        self, attention: ModelAttention, layer: int, dtype: str, precision: str = ""
    ) -> Problem:
        """The attention problem ``layer`` of the model computes in this bucket."""
        seq_len = self.length if self.kind == PREFILL else 1
        return Problem(
            seq_len=seq_len,
            head_dim=attention.head_dim,
            batch=self.batch,
            heads=attention.heads,
            causal=True,
            dtype=dtype,
            kv_heads=attention.kv_heads,
            kv_len=self.length,
            precision=precision,
            window_left=attention.window_left(layer),
            softcap=attention.softcap,
            sinks=attention.sinks,
        )


def serving_buckets(
    prefill_lengths: Sequence[int],
    prefill_batch: int,
    decode_batches: Sequence[int],
    decode_kv_lengths: Sequence[int],
) -> tuple[Bucket, ...]:
    """Prefill of each length, then decode of each batch at each KV length; each once."""
    buckets = [Bucket(PREFILL, prefill_batch, length) for length in prefill_lengths]
    buckets += [
        Bucket(DECODE, batch, length)
        for batch, length in product(decode_batches, decode_kv_lengths)
    ]
    return tuple(dict.fromkeys(buckets))


@dataclass(frozen=True, slots=True)
class ProblemUse:
    """Where a problem is run: in ``bucket``, by ``layers``."""

    bucket: Bucket
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ModelProblem:
    """One distinct attention problem of a model, and what it serves.

    ``scale`` is the softmax scale the model's layers use (pass it to
    ``kernels.attention(..., scale=)``); like the sink values, it is run-time data and
    not part of the problem that is tuned.
    """

    problem: Problem
    uses: tuple[ProblemUse, ...]
    scale: float

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        return tuple(use.bucket for use in self.uses)

    @property
    def kind(self) -> str:
        """What the problem is measured as: decode when its first bucket is a decode."""
        return self.uses[0].bucket.kind


def expand_problems(
    attention: ModelAttention,
    buckets: Iterable[Bucket],
    dtype: str,
    precision: str = "",
) -> tuple[ModelProblem, ...]:
    """The distinct problems of ``attention`` in ``buckets``, in bucket then layer order."""
    uses: dict[Problem, dict[Bucket, list[int]]] = {}
    for bucket in buckets:
        for layer in range(attention.layers):
            problem = bucket.problem(attention, layer, dtype, precision)
            uses.setdefault(problem, {}).setdefault(bucket, []).append(layer)
    return tuple(
        ModelProblem(
            problem=problem,
            uses=tuple(ProblemUse(bucket, tuple(layers)) for bucket, layers in by_bucket.items()),
            scale=attention.scale,
        )
        for problem, by_bucket in uses.items()
    )
