"""Which plan wins, and which tuned shape is nearest: the registry's rules, pure.

Plan order (used both when recording and when serving):

1. measured with a current kernel source  (tier 2)
2. measured under a stale source          (tier 1; its timing is for an old kernel)
3. predicted by the cost model            (tier 0)

and within a tier the lower time (``PlanRecord.ranking_ms``) wins; a tie keeps
the plan already there. A plan is *stale* when it was measured and the caller's
``source_hashes`` maps its family to a different hash. Families missing from
``source_hashes`` (or no mapping at all) count as current: without the hash
there is nothing to judge by.

Nearest shape (``best(..., nearest=True)`` with no exact match): candidates
share head_dim, dtype, precision, causal, the group size (query heads per
KV head), the attention variants (window bounds, softcap, ALiBi, sinks: a
windowed problem is never served a dense plan, nor a dense one a windowed plan) and
the page size (a serving bucket is served by a serving bucket, a dense shape by a
dense one) with the asked problem. They are ordered by

0. the length distribution: the asked one first (a serving bucket tuned on
   ``skewed`` lengths before one tuned on ``uniform``),
1. |log2(seq_len / asked seq_len)|, ties to the larger seq_len (query length:
   a decode plan never stands in for a prefill one while a nearer length exists),
2. |log2(kv_len / asked kv_len)|, ties to the larger,
3. |log2(batch*heads / asked batch*heads)|, ties to the larger,
4. batch, then heads (only so that the answer is deterministic).

A larger shape wins ties because its plan was tuned with at least as much work
per launch, which over-provisions parallelism rather than starving it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from db.records import PlanRecord
from tuner.problem import Problem

TIER_MEASURED = 2
TIER_STALE = 1
TIER_PREDICTED = 0


def is_stale(record: PlanRecord, source_hashes: Mapping[str, str] | None) -> bool:
    if not record.measured or not source_hashes:
        return False
    current = source_hashes.get(record.family)
    return current is not None and current != record.source_hash


def tier(record: PlanRecord, source_hashes: Mapping[str, str] | None) -> int:
    if not record.measured:
        return TIER_PREDICTED
    return TIER_STALE if is_stale(record, source_hashes) else TIER_MEASURED


def plan_rank(record: PlanRecord, source_hashes: Mapping[str, str] | None) -> tuple[int, float]:
    """Larger is better."""
    return tier(record, source_hashes), -record.ranking_ms


def beats(
    challenger: PlanRecord, incumbent: PlanRecord, source_hashes: Mapping[str, str] | None
) -> bool:
    """Whether ``challenger`` should replace ``incumbent`` as the best plan."""
    return plan_rank(challenger, source_hashes) > plan_rank(incumbent, source_hashes)


def shape_distance(
    asked: Problem, candidate: Problem
) -> tuple[bool, float, int, float, int, float, int, int, int]:
    """Sort key of a candidate shape; smaller is nearer. See the module doc."""
    return (
        candidate.lengths != asked.lengths,
        abs(math.log2(candidate.seq_len / asked.seq_len)),
        -candidate.seq_len,
        abs(math.log2(candidate.kv_len / asked.kv_len)),
        -candidate.kv_len,
        abs(math.log2(candidate.batch_heads / asked.batch_heads)),
        -candidate.batch_heads,
        candidate.batch,
        candidate.heads,
    )


def same_family_of_shapes(asked: Problem, candidate: Problem) -> bool:
    """Whether a plan tuned for ``candidate`` may stand in for ``asked``."""
    return (
        candidate.head_dim == asked.head_dim
        and candidate.dtype == asked.dtype
        and candidate.precision == asked.precision
        and candidate.direction == asked.direction
        and candidate.causal == asked.causal
        and candidate.group == asked.group
        and candidate.window_left == asked.window_left
        and candidate.window_right == asked.window_right
        and candidate.softcap == asked.softcap
        and candidate.alibi == asked.alibi
        and candidate.sinks == asked.sinks
        and candidate.page_size == asked.page_size
    )
