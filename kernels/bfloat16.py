"""bfloat16 in numpy, which has no such type: uint16 bit patterns and exact conversions.

A bfloat16 is the upper 16 bits of a float32. ``to_bfloat16`` rounds to
nearest, ties to even (what CUDA's ``__float2bfloat16_rn`` and torch do);
NaN stays a quiet NaN (its payload's top bit set, so rounding can never carry
it into infinity), infinities stay infinities, and a finite value past the
largest bfloat16 rounds to infinity as IEEE rounding says. ``from_bfloat16``
is exact.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

#: the quiet-NaN bfloat16 a NaN of any payload becomes
BFLOAT16_NAN = np.uint16(0x7FC0)


def to_bfloat16(values: npt.ArrayLike) -> np.ndarray:
    """float32 (or anything castable) -> bfloat16 bit patterns (uint16), round-to-nearest-even."""
    as_float = np.array(values, dtype=np.float32, order="C")
    bits = as_float.view(np.uint32)
    # Add 0x7FFF plus the lowest kept bit: halfway cases round to the even neighbour.
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    rounded = ((bits + rounding) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(as_float), BFLOAT16_NAN, rounded).astype(np.uint16)


def from_bfloat16(bits: npt.ArrayLike) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    patterns = np.array(bits, dtype=np.uint16, order="C")
    return (patterns.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to_bfloat16(values: npt.ArrayLike) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16, as float32."""
    return from_bfloat16(to_bfloat16(values))
