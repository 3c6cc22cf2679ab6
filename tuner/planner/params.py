"""The tunables of one candidate: a family name and an ordered mapping name -> int.

Which tunables exist, in which order, and their defaults are the family's
(``tuner.planner.families``), so a new family brings its own (``block_m``,
``warps``, ``stages`` ...) without touching this type. The value is frozen and
hashable; ``KernelParams("tiled", 256, 64, 64, 4)`` and keyword forms fill the
family's tunables in its declared order, missing ones from its defaults.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tuner.planner.errors import PlanError


@dataclass(frozen=True, init=False)
class KernelParams:
    """Each tunable is also a plain instance attribute (``params.block_n``): the planner
    reads them by the hundred thousand while it enumerates a space, and an attribute found
    in the instance is an order of magnitude faster than one ``__getattr__`` resolves.
    Equality, hashing and the repr are the fields' (family, values) only."""

    family: str
    values: tuple[tuple[str, int], ...]

    def __init__(self, family: str, *positional: int, **named: int) -> None:
        from tuner.planner.families import family_named

        spec = family_named(family)
        names = [tunable.name for tunable in spec.tunables]
        if len(positional) > len(names):
            raise PlanError(
                f"{family} takes {len(names)} tunables ({', '.join(names)}), "
                f"got {len(positional)} positional values"
            )
        given = dict(zip(names, positional, strict=False))
        for name, value in named.items():
            if name not in names:
                raise PlanError(
                    f"{family} has no tunable {name!r}; its tunables: {', '.join(names)}"
                )
            if name in given:
                raise PlanError(f"{family}: tunable {name!r} given twice")
            given[name] = value
        values = []
        for tunable in spec.tunables:
            value = given.get(tunable.name, tunable.default)
            if isinstance(value, bool) or not isinstance(value, int):
                raise PlanError(f"{family}: {tunable.name}={value!r} is not an integer")
            values.append((tunable.name, int(value)))
        self._set(family, tuple(values))

    def _set(self, family: str, values: tuple[tuple[str, int], ...]) -> None:
        object.__setattr__(self, "family", family)
        object.__setattr__(self, "values", values)
        for name, value in values:  # (no tunable shadows an attribute: families.register)
            object.__setattr__(self, name, value)

    @classmethod
    def of_checked(cls, family: str, values: tuple[tuple[str, int], ...]) -> KernelParams:
        """Params from (name, int) pairs already in the family's tunable order, every tunable
        present: what a family's own enumeration builds, by the ten thousand, without the
        checks ``__init__`` makes of a caller's values."""
        params = object.__new__(cls)
        params._set(family, values)
        return params

    @classmethod
    def from_stored(cls, family: str, stored: Mapping[str, Any]) -> KernelParams:
        """Params as the registry or a recording holds them.

        Tunables the family has retired (``KernelFamily.retired_tunables``:
        rows written before tunables became per-family carry ``tile_size``,
        ``rows_per_block`` and ``split_target`` for every family) are dropped;
        any other unknown name is refused with ``PlanError``. A tunable added since the
        row was written takes its ``stored_before`` value (what the row's kernel ran with)
        where it declares one, else its default.
        """
        from tuner.planner.families import family_named

        spec = family_named(family)
        retired = spec.retired_tunables
        kept = {k: int(v) for k, v in stored.items() if k != "family" and k not in retired}
        for tunable in spec.tunables:
            if tunable.name not in kept and tunable.stored_before is not None:
                kept[tunable.name] = tunable.stored_before
        return cls(family, **kept)

    @property
    def tunables(self) -> dict[str, int]:
        """Tunable name -> value, in the family's order."""
        return dict(self.values)

    def as_dict(self) -> dict[str, int | str]:
        return {"family": self.family, **self.tunables}

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self.values)

    def __getattr__(self, name: str) -> int:
        # Only reached when normal lookup fails: a tunable by name (params.threads).
        for key, value in object.__getattribute__(self, "values"):
            if key == name:
                return value
        raise AttributeError(
            f"{object.__getattribute__(self, 'family')} params have no tunable {name!r}"
        )
