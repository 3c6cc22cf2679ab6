"""KV-length buckets: what a deploy-time plan is chosen for when k and v are a KV cache.

A decode step meets a KV length it has never seen at almost every call (a cache grows by one
key a step), so the length cannot be what a plan, a registry lookup or a compiled kernel is
keyed by. ``bucket_of(problem)`` is the problem a plan is chosen for: a problem whose keys are
its queries (self-attention, a prefill) is its own bucket; any other (``kv_len != seq_len``:
decode, chunked prefill against a cache) has its ``kv_len`` rounded up to a power of two, at
least ``MIN_KV_BUCKET``. The plan chosen for the bucket (the registry asked once per bucket,
with the deployment's ``nearest``) serves every length of it: its kernel's compile-time
constants never depend on ``kv_len`` (``tuner.planner.kernel_variant``), and the split
partition of a length follows from the plan's tunables by the family's own rule, a pure
computation of microseconds (``kernel_variant.plan_at``).

A bucket keeps the exact problem's window as its canonical form at that length has it: a
window that cuts no key at ``kv_len`` is no window in the bucket either, and one that cuts
keys at ``kv_len`` cuts them at every longer length, so the bucket's kernel has the variant
the exact problem needs.

``length_family(problem)`` names the problems that differ only in ``kv_len``: the buckets of
one layer's decode steps. A bucket the registry has no plan for reuses the kernel of a plan
already chosen for another bucket of its family (``kernels.plan_choice``).

Pure: no CUDA, no torch, no database.
"""

from __future__ import annotations

from dataclasses import replace

from tuner.planner.kernel_variant import length_family
from tuner.problem import Problem

__all__ = ["MIN_KV_BUCKET", "bucket_of", "kv_bucket", "length_family"]

#: the smallest KV bucket: shorter caches share the plan of 64 keys
MIN_KV_BUCKET = 64


def kv_bucket(kv_len: int) -> int:
    """The smallest power of two >= ``kv_len``, at least ``MIN_KV_BUCKET``."""
    if kv_len < 1:
        raise ValueError(f"kv_len={kv_len} must be >= 1")
    return max(MIN_KV_BUCKET, 1 << (kv_len - 1).bit_length())


def bucket_of(problem: Problem) -> Problem:
    """The problem a plan is chosen for: ``problem`` itself when its keys are its queries
    (``kv_len == seq_len``), else ``problem`` with ``kv_len`` rounded up to its bucket."""
    if problem.kv_len == problem.seq_len:
        return problem
    bucket = kv_bucket(problem.kv_len)
    return problem if bucket == problem.kv_len else replace(problem, kv_len=bucket)
