"""The bfloat16 conversions: exact round trips, ties to even, NaN and infinities."""

from __future__ import annotations

import numpy as np

from kernels.bfloat16 import from_bfloat16, round_to_bfloat16, to_bfloat16


def bits_of(value: float) -> int:
    return int(np.array(value, dtype=np.float32).view(np.uint32))


def test_every_bfloat16_round_trips_exactly() -> None:
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = from_bfloat16(patterns)
    finite = ~np.isnan(values)
    assert np.array_equal(to_bfloat16(values)[finite], patterns[finite])


def test_ties_round_to_even_and_others_to_nearest() -> None:
    one = bits_of(1.0)  # 0x3F800000, bfloat16 0x3F80 (even)
    tie_down = np.array(one + 0x8000, dtype=np.uint32).view(np.float32)  # halfway to 0x3F81
    tie_up = np.array(one + 0x18000, dtype=np.uint32).view(np.float32)  # 0x3F81 + half
    above = np.array(one + 0x8001, dtype=np.uint32).view(np.float32)
    below = np.array(one + 0x7FFF, dtype=np.uint32).view(np.float32)
    assert to_bfloat16(tie_down) == 0x3F80  # to the even 0x3F80
    assert to_bfloat16(tie_up) == 0x3F82  # to the even 0x3F82
    assert to_bfloat16(above) == 0x3F81
    assert to_bfloat16(below) == 0x3F80


def test_nan_stays_nan_and_infinities_stay_infinite() -> None:
    payload_nan = np.array(0x7FFFFFFF, dtype=np.uint32).view(np.float32)
    converted = to_bfloat16(np.array([np.nan, -np.nan, payload_nan, np.inf, -np.inf]))
    back = from_bfloat16(converted)
    assert np.isnan(back[:3]).all()
    assert back[3] == np.inf and back[4] == -np.inf
    # Past the largest finite bfloat16 (0x7F7F), rounding reaches infinity.
    largest = float(from_bfloat16(np.uint16(0x7F7F)))
    assert to_bfloat16(np.float32(largest * 1.0)) == 0x7F7F
    assert to_bfloat16(np.float32(3.4e38)) == 0x7F80


def test_rounding_error_is_at_most_half_an_ulp() -> None:
    values = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    rounded = round_to_bfloat16(values)
    # 8 significant bits: half an ulp is 2**-8 relative to the value's binade.
    assert (np.abs(rounded - values) <= np.abs(values) * 2.0**-8).all()
    assert rounded.dtype == np.float32 and rounded.shape == values.shape


def test_stored_outputs_read_back_as_exact_float32() -> None:
    # The backend reads every measured output through from_storage: float32 (not a
    # float64 copy of a whole large output), and not a bit lost for any dtype.
    from kernels.precision import from_storage, to_storage

    values = np.random.default_rng(1).standard_normal(4096).astype(np.float32) * 100
    expected = {
        "bfloat16": round_to_bfloat16(values),
        "float16": values.astype(np.float16).astype(np.float32),
        "float32": values,
    }
    for dtype, rounded in expected.items():
        back = from_storage(to_storage(values, dtype), dtype)
        assert back.dtype == np.float32, dtype
        assert np.array_equal(back, rounded), dtype
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    every = from_storage(patterns, "bfloat16")
    assert np.array_equal(every.view(np.uint32) >> 16, patterns.astype(np.uint32))
