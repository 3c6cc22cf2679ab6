"""Rust's u32/u64 integer semantics, for reproducing the seed planner exactly.

``checked_*`` return ``None`` where Rust's ``checked_*`` return ``None``;
``saturating_*`` clamp at the type's maximum.
"""

from __future__ import annotations

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


def checked_mul_u32(lhs: int, rhs: int) -> int | None:
    product = lhs * rhs
    return product if product <= U32_MAX else None


def checked_add_u32(lhs: int, rhs: int) -> int | None:
    total = lhs + rhs
    return total if total <= U32_MAX else None


def checked_mul_u64(lhs: int, rhs: int) -> int | None:
    product = lhs * rhs
    return product if product <= U64_MAX else None


def saturating_mul_u64(lhs: int, rhs: int) -> int:
    return min(lhs * rhs, U64_MAX)


def saturating_add_u64(lhs: int, rhs: int) -> int:
    return min(lhs + rhs, U64_MAX)


def saturating_sub_u32(lhs: int, rhs: int) -> int:
    return max(lhs - rhs, 0)


def div_ceil(lhs: int, rhs: int) -> int:
    return -(-lhs // rhs)
