"""The attention variants as part of the problem: validation, one identity per visible set,
labels, and the visible-pair count every traffic and FLOP figure builds on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.problem import UNBOUNDED, Problem, visible_keys_total


def brute_force_visible(seq_len: int, kv_len: int, low: int | None, high: int | None) -> int:
    return sum(
        1
        for r in range(seq_len)
        for k in range(kv_len)
        if (low is None or k >= r + low) and (high is None or k <= r + high)
    )


bounds = st.one_of(st.none(), st.integers(-90, 90))


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), bounds, bounds)
def test_visible_keys_total_is_the_count_of_the_band(
    seq_len: int, kv_len: int, low: int | None, high: int | None
) -> None:
    assert visible_keys_total(seq_len, kv_len, low, high) == brute_force_visible(
        seq_len, kv_len, low, high
    )


def test_visible_keys_total_of_long_sequences_is_exact_and_cheap() -> None:
    # 2**20 rows: a loop over rows would take seconds; the closed form is a few series.
    n = 1 << 20
    assert visible_keys_total(n, n, None, 0) == n * (n + 1) // 2
    assert visible_keys_total(n, n, -4096, 0) == 4097 * n - 4096 * 4097 // 2


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 24),
    st.integers(0, 24),
    st.booleans(),
    st.integers(-1, 30),
    st.integers(-1, 30),
)
def test_attended_pairs_counts_what_causal_masking_and_the_window_leave(
    seq_len: int, extra_keys: int, causal: bool, window_left: int, window_right: int
) -> None:
    kv_len = seq_len + extra_keys
    problem = Problem(
        seq_len,
        64,
        causal=causal,
        kv_len=kv_len,
        window_left=window_left,
        window_right=window_right,
    )
    off = kv_len - seq_len
    expected = sum(
        1
        for r in range(seq_len)
        for k in range(kv_len)
        if (not causal or k <= r + off)
        and (window_left < 0 or k >= r + off - window_left)
        and (window_right < 0 or k <= r + off + window_right)
    )
    assert problem.attended_pairs == expected


def test_mistral_window_sees_under_half_of_causal_at_16k() -> None:
    windowed = Problem(16384, 128, heads=32, kv_heads=8, causal=True, window_left=4096)
    dense = Problem(16384, 128, heads=32, kv_heads=8, causal=True)
    assert windowed.attended_pairs / dense.attended_pairs == pytest.approx(0.4376, abs=1e-4)
    assert windowed.useful_flops < dense.useful_flops


def test_a_window_that_cuts_nothing_is_no_window() -> None:
    # Mistral's 4096 window over a 2048-token prefill is plain causal attention.
    assert Problem(2048, 128, causal=True, window_left=4096) == Problem(2048, 128, causal=True)
    # The right bound of a causal problem is the diagonal.
    assert Problem(64, 64, causal=True, window_right=3) == Problem(64, 64, causal=True)
    # Row 0 sees key 0 + 100 at most: a right bound of seq_len - 1 reaches every key.
    assert Problem(100, 64, window_right=99).window_right == UNBOUNDED
    assert Problem(100, 64, window_right=98).window_right == 98
    # A left bound of kv_len - 1 keeps key 0 for the last row.
    assert Problem(100, 64, kv_len=300, window_left=299).window_left == UNBOUNDED
    assert Problem(100, 64, kv_len=300, window_left=298).window_left == 298


def test_labels_name_the_variants_and_leave_plain_problems_as_they_were() -> None:
    assert Problem(4096, 128, dtype="bfloat16").label() == "1x1x4096x128 bfloat16 full"
    gpt_oss = Problem(
        4096,
        64,
        batch=4,
        heads=64,
        kv_heads=8,
        causal=True,
        dtype="bfloat16",
        window_left=128,
        sinks=True,
    )
    assert gpt_oss.label() == "4x64/8x4096x64 bfloat16 causal window=128 sinks"
    gemma = Problem(8192, 128, causal=True, window_left=4096, softcap=50.0, dtype="bfloat16")
    assert gemma.label().endswith("causal window=4096 softcap=50")
    both_sides = Problem(1000, 64, window_left=10, window_right=5)
    assert both_sides.variant_text() == "window=10,5"
    assert Problem(100, 64, window_right=5).variant_text() == "window=-1,5"
    assert Problem(2048, 128, alibi=True).variant_text() == "alibi"


def test_has_variant_and_windowed() -> None:
    assert not Problem(128, 64).has_variant
    assert Problem(128, 64, softcap=30.0).has_variant
    assert not Problem(128, 64, softcap=30.0).windowed
    assert Problem(128, 64, window_left=3).windowed


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"window_left": -2}, "window_left=-2 must be an integer >= 0, or -1"),
        ({"window_right": -5}, "window_right=-5 must be an integer >= 0, or -1"),
        ({"window_left": 1.5}, "window_left=1.5 must be an integer"),
        ({"window_left": True}, "window_left=True must be an integer"),
        ({"softcap": -1.0}, "softcap=-1.0 must be a finite number >= 0"),
        ({"softcap": float("inf")}, "softcap=inf must be a finite number >= 0"),
        ({"softcap": float("nan")}, "softcap=nan must be a finite number >= 0"),
        ({"softcap": "50"}, "softcap='50' must be a number >= 0"),
    ],
)
def test_bad_variant_settings_are_refused_with_their_reason(
    arguments: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        Problem(128, 64, **arguments)  # type: ignore[arg-type]
