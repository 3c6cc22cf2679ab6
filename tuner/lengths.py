"""The request lengths of a serving batch: the distributions a serving bucket is tuned on.

A serving problem (``tuner.problem.Problem`` with ``lengths`` other than ``equal`` or a
``page_size``) describes a batch of ``batch`` requests whose KV lengths are drawn from a
distribution bounded by the problem's ``kv_len``:

* ``equal``: every request at ``kv_len`` (what a dense problem means);
* ``uniform``: integers uniform in ``[1, kv_len]``;
* ``skewed``: request 0 at ``kv_len``, the rest at ``max(1, kv_len // 32)`` (one long
  context among many short ones, the batch FlashDecoding-style planners mis-split);
* ``values:L1,L2,...``: an empirical distribution (a file of observed lengths reduced to at
  most ``MAX_VALUES`` quantiles by ``values_from_lengths``), each request drawing one value.

A request's query rows are ``min(seq_len, its KV length)`` (``seq_len`` under ``equal``,
the dense meaning): decode and speculative verification (``seq_len`` up to 16 against longer
caches) keep ``seq_len`` rows, varlen self-attention (``seq_len == kv_len``) gives each request
as many rows as keys, and chunked prefill caps the chunk at the request's length. Draws are
seeded by the distribution, the batch and ``kv_len`` only, so a problem always stands for the
same batch: the tuner measures that sample, the planner counts its work, the registry keys it
by the distribution's name.

Pure: stdlib and numpy.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

EQUAL = "equal"
UNIFORM = "uniform"
SKEWED = "skewed"
NAMED = (EQUAL, UNIFORM, SKEWED)
VALUES_PREFIX = "values:"
#: an empirical distribution keeps at most this many values (quantiles of a longer file), so
#: a problem's identity stays a short string (a registry key, a study name)
MAX_VALUES = 64
#: skewed: the short requests' share of kv_len
SKEW_RATIO = 32
#: the seed of every draw (with the distribution, batch and kv_len mixed in)
SAMPLE_SEED = 25


def distribution_error(lengths: object, kv_len: int | None = None) -> str:
    """Why ``lengths`` is not a distribution ("" when it is); values must lie in
    ``[1, kv_len]`` when ``kv_len`` is given."""
    if not isinstance(lengths, str):
        return f"lengths={lengths!r} must be a string"
    if lengths in NAMED:
        return ""
    if not lengths.startswith(VALUES_PREFIX):
        return (
            f"lengths={lengths!r} must be one of {', '.join(NAMED)} or "
            f"{VALUES_PREFIX}L1,L2,... (a file of lengths: lengths=file:PATH in the config)"
        )
    try:
        values = [int(text) for text in lengths[len(VALUES_PREFIX) :].split(",")]
    except ValueError:
        return f"lengths={lengths!r}: the values must be integers separated by commas"
    if not values or len(values) > MAX_VALUES:
        return f"lengths={lengths!r}: between 1 and {MAX_VALUES} values"
    if values != sorted(values) or values[0] < 1:
        return f"lengths={lengths!r}: the values must be sorted and >= 1"
    if kv_len is not None and values[-1] > kv_len:
        return f"lengths={lengths!r}: the value {values[-1]} exceeds kv_len={kv_len}"
    return ""


def values_of(lengths: str) -> tuple[int, ...]:
    """The values of an empirical distribution (``values:...``)."""
    return tuple(int(text) for text in lengths[len(VALUES_PREFIX) :].split(","))


def values_from_lengths(observed: list[int] | np.ndarray) -> str:
    """An empirical distribution of observed KV lengths: all of them when there are at most
    ``MAX_VALUES``, else that many evenly spaced quantiles (nearest rank), sorted."""
    array = np.sort(np.asarray(observed, dtype=np.int64).reshape(-1))
    if array.size == 0:
        raise ValueError("no lengths given")
    if array[0] < 1:
        raise ValueError(f"lengths must be >= 1, got {int(array[0])}")
    if array.size > MAX_VALUES:
        picks = np.round(np.linspace(0, array.size - 1, MAX_VALUES)).astype(np.int64)
        array = array[picks]
    return VALUES_PREFIX + ",".join(str(int(x)) for x in array)


def short_name(lengths: str) -> str:
    """A name for labels and study names: the distribution, or ``values<n>-<digest>``."""
    if lengths in NAMED:
        return lengths
    digest = hashlib.sha256(lengths.encode()).hexdigest()[:8]
    return f"values{len(values_of(lengths))}-{digest}"


def kv_lengths(lengths: str, batch: int, kv_len: int) -> np.ndarray:
    """The KV length of each of ``batch`` requests (int64), drawn from ``lengths``."""
    if lengths == EQUAL:
        return np.full(batch, kv_len, dtype=np.int64)
    if lengths == SKEWED:
        drawn = np.full(batch, max(1, kv_len // SKEW_RATIO), dtype=np.int64)
        drawn[0] = kv_len
        return drawn
    digest = hashlib.sha256(f"{lengths}|{batch}|{kv_len}".encode()).digest()
    rng = np.random.default_rng([SAMPLE_SEED, int.from_bytes(digest[:8], "little")])
    if lengths == UNIFORM:
        return rng.integers(1, kv_len, size=batch, endpoint=True, dtype=np.int64)
    values = np.asarray(values_of(lengths), dtype=np.int64)
    return values[rng.integers(0, values.size, size=batch)]


@dataclass(frozen=True, slots=True)
class RequestLengths:
    """Per request: query rows and KV length (int64 arrays of one length)."""

    query: np.ndarray
    kv: np.ndarray

    @property
    def batch(self) -> int:
        return int(self.kv.size)


def request_lengths(lengths: str, batch: int, seq_len: int, kv_len: int) -> RequestLengths:
    """KV lengths drawn from ``lengths``; query rows ``min(seq_len, kv)`` per request
    (``seq_len`` for ``equal``)."""
    kv = kv_lengths(lengths, batch, kv_len)
    if lengths == EQUAL:
        return RequestLengths(np.full(batch, seq_len, dtype=np.int64), kv)
    return RequestLengths(np.minimum(kv, seq_len), kv)
