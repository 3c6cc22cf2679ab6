"""An LRU of ``best()`` answers for the deploy path.

A service asks for the plan of the same few shapes on every call; the answer
only changes when someone tunes again. One database round trip per shape, then
a dict lookup (about a microsecond) instead of a query (hundreds of them).
Misses (``None``) are cached too, so an untuned shape does not hit the
database on every call. ``clear()`` after the registry may have changed;
a ``PlanRegistry`` clears its own cache when it writes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from db.records import StoredPlan
from tuner.environment import Environment
from tuner.problem import Problem

EnvironmentKey = Environment | tuple[tuple[str, Any], ...] | None
CacheKey = tuple[Problem, EnvironmentKey, bool, frozenset[tuple[str, str]] | None]


class BestLookup(Protocol):
    def __call__(
        self,
        problem: Problem,
        environment: EnvironmentKey = None,
        *,
        nearest: bool = False,
        source_hashes: Mapping[str, str] | None = None,
    ) -> StoredPlan | None: ...


class BestPlanCache:
    """LRU of ``lookup`` results keyed by every argument that changes the answer."""

    def __init__(self, lookup: BestLookup | Callable[..., StoredPlan | None], maxsize: int = 4096):
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self._lookup = lookup
        self._maxsize = maxsize
        self._entries: OrderedDict[CacheKey, StoredPlan | None] = OrderedDict()
        # Deploy services call from many threads; OrderedDict reordering is not atomic.
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(
        self,
        problem: Problem,
        environment: EnvironmentKey = None,
        *,
        nearest: bool = False,
        source_hashes: Mapping[str, str] | None = None,
    ) -> StoredPlan | None:
        hashes = frozenset(source_hashes.items()) if source_hashes is not None else None
        key: CacheKey = (problem, environment, nearest, hashes)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                return self._entries[key]
        # Outside the lock: a slow query must not stall other threads' hits.
        answer = self._lookup(problem, environment, nearest=nearest, source_hashes=source_hashes)
        with self._lock:
            self.misses += 1
            self._entries[key] = answer
            self._entries.move_to_end(key)
            while len(self._entries) > self._maxsize:
                self._entries.popitem(last=False)
        return answer

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
