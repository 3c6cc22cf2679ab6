"""The attention problem a plan is tuned for."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tuner import lengths as length_distributions

#: element types of q, k, v and out; the half types are 2-byte elements
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: how float32 inputs may be multiplied: "tf32x3" (the default, float32-class
#: error: SIMT FFMA or the 3xTF32 split on tensor cores) or "tf32" (one TF32
#: pass allowed too: 10-bit significands, faster). Most precise first.
FLOAT32_PRECISIONS = ("tf32x3", "tf32")
#: the precision a float32 problem gets when none is asked for
DEFAULT_FLOAT32_PRECISION = "tf32x3"
#: a window bound that cuts nothing (FlashAttention's convention)
UNBOUNDED = -1
#: what a plan computes: the attention (forward) or its gradients dQ, dK, dV (backward)
DIRECTIONS = ("forward", "backward")
#: matrix products per (query, key) pair: Q K^T and P V forward; the backward recomputes
#: S = Q K^T and computes dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ += dS K (2.5x the
#: forward's flops, as FlashAttention counts them)
MATMULS_PER_PAIR = {"forward": 2, "backward": 5}
#: page sizes of a paged KV cache (tokens per page) a serving problem may have
MAX_PAGE_SIZE = 256


def visible_keys_total(seq_len: int, kv_len: int, lowest: int | None, highest: int | None) -> int:
    """Sum over query rows ``r`` of the keys ``k`` in ``[0, kv_len)`` with
    ``r + lowest <= k <= r + highest`` (``None``: that side unbounded).

    The closed form of what a mask leaves visible, in exact integers: the count per row is
    piecewise linear in ``r`` (it grows, stays flat, shrinks as the band enters and leaves
    the key range), so the total is a few arithmetic series, whatever the lengths.
    """
    n, m = seq_len, kv_len
    # An open side, or a bound beyond every row's reach, is the same as n + m keys away.
    lo = -n - m if lowest is None else max(lowest, -n - m)
    hi = n + m if highest is None else min(highest, n + m)
    if n <= 0 or m <= 0 or lo > hi:
        return 0

    def count(r: int) -> int:
        return max(0, min(m - 1, r + hi) - max(0, r + lo) + 1)

    # Where the count changes its linear piece: r + lo reaches 0 (the band's low end enters
    # the keys), r + hi reaches m - 1 (its high end leaves them), and the first row that
    # sees a key (r + hi = 0) and the first that sees none again (r + lo = m).
    cuts = sorted({0, n, *(c for c in (-lo, m - 1 - hi, -hi, m - lo) if 0 < c < n)})
    total = 0
    for start, stop in zip(cuts, cuts[1:], strict=False):
        # Linear on [start, stop - 1] (each piece's ends decide; zero pieces included).
        first, last = count(start), count(stop - 1)
        total += (first + last) * (stop - start) // 2
    return total


def variant_error(window_left: int, window_right: int, softcap: float) -> str:
    """Why variant settings cannot make a problem ("" when they can)."""
    for name, value in (("window_left", window_left), ("window_right", window_right)):
        if isinstance(value, bool) or not isinstance(value, int) or value < UNBOUNDED:
            return f"{name}={value!r} must be an integer >= 0, or -1 for no bound"
    if isinstance(softcap, bool) or not isinstance(softcap, int | float):
        return f"softcap={softcap!r} must be a number >= 0 (0: no cap)"
    if not math.isfinite(softcap) or softcap < 0:
        return f"softcap={softcap!r} must be a finite number >= 0 (0: no cap)"
    return ""


def serving_error(page_size: object, lengths: object, kv_len: int | None) -> str:
    """Why a page size or length distribution cannot make a problem ("" when they can)."""
    if page_size is not None and (
        isinstance(page_size, bool)
        or not isinstance(page_size, int)
        or not 0 <= page_size <= MAX_PAGE_SIZE
    ):
        return (
            f"page_size={page_size!r} must be an integer in 1..{MAX_PAGE_SIZE} "
            "(tokens per page), or None (0) for a contiguous KV layout"
        )
    return length_distributions.distribution_error(lengths, kv_len)


def shape_error(
    seq_len: int, heads: int, causal: bool, kv_heads: int | None, kv_len: int | None
) -> str:
    """Why query/key shapes cannot make one problem ("" when they can).

    ``kv_heads`` must divide ``heads`` (grouped-query attention: query head ``h``
    reads KV head ``h // (heads // kv_heads)``). Causal masking is bottom-right
    aligned (query row ``r`` sees keys ``k <= r + kv_len - seq_len``, as
    FlashAttention and a KV cache do), so with ``seq_len > kv_len`` the first
    ``seq_len - kv_len`` query rows would see no key at all: refused rather than
    given an output no softmax defines.
    """
    if kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
        return f"kv_heads={kv_heads} must divide heads={heads}"
    if kv_len is not None and kv_len < 1:
        return f"kv_len={kv_len} must be >= 1"
    if causal and kv_len is not None and seq_len > kv_len:
        return (
            f"causal with seq_len={seq_len} > kv_len={kv_len}: causal masking is bottom-right "
            "aligned, so the first seq_len - kv_len query rows would see no key"
        )
    return ""


@dataclass(frozen=True, slots=True)
class Problem:
    """One attention shape: ``out = softmax(q k^T / sqrt(head_dim)) v`` per (batch, head).

    q and out are contiguous ``[batch, heads, seq_len, head_dim]``, k and v
    ``[batch, kv_heads, kv_len, head_dim]``, all of ``dtype``. ``seq_len`` is the
    query length. ``kv_heads`` (default: ``heads``) divides ``heads``: query
    head ``h`` reads KV head ``h // group``, ``group = heads // kv_heads``
    (grouped-query attention; MQA at ``kv_heads=1``). ``kv_len`` (default:
    ``seq_len``) is the key/value length; causal masking is bottom-right
    aligned (see ``shape_error``). ``dtype`` defaults to float32 here (the seed's
    type; the Hydra entry's default is bfloat16), so code that builds problems
    by hand keeps its meaning.

    ``precision`` is the least precise arithmetic a plan may use: for float32
    one of ``FLOAT32_PRECISIONS`` ("" means the accurate default, "tf32x3");
    for the half dtypes it does not apply and is "". The accurate precision is
    left out of labels and names, so every problem from before the field
    existed keeps its label, study name and registry row.

    The variants real models run (FlashAttention's conventions), all off by default:

    * ``window_left``, ``window_right``: query row ``r`` sees keys in ``[r + off -
      window_left, r + off + window_right]`` with ``off = kv_len - seq_len`` (the
      bottom-right alignment of causal masking), ``-1`` for no bound on that side; with
      ``causal`` the right bound is the diagonal. A bound that cuts no key of this shape is
      stored as ``-1`` (Mistral's 4096 window at a 2048-token prefill is plain causal), so
      a problem has one identity whatever window was asked for;
    * ``softcap``: logits ``s = q.k * scale`` become ``softcap * tanh(s / softcap)``
      (Gemma 2's 50.0); 0 for none;
    * ``alibi``: a bias ``-slope_h * |r + off - k|`` per query head ``h`` (BLOOM, MPT);
      the slopes are run-time data (tuning uses the standard ``2^(-8(h+1)/heads)``);
    * ``sinks``: one logit per query head that joins the softmax's denominator only
      (gpt-oss); the values are run-time data.

    ``direction`` is ``"forward"`` (the attention) or ``"backward"`` (dQ, dK, dV from dO,
    the forward's output and its log-sum-exp); forward and backward plans are tuned and
    stored apart. Only backward problems say so in their label and names, so every forward
    problem keeps the ones it had.

    Serving batches (``kernels.serving``), both off by default:

    * ``page_size``: K and V live in a paged cache of pages of this many tokens (1 to
      ``MAX_PAGE_SIZE``; ``None``, or 0, for a contiguous layout);
    * ``lengths``: the requests' KV lengths are drawn from this distribution up to ``kv_len``
      (``tuner.lengths``: ``equal``, ``uniform``, ``skewed`` or ``values:...``), each request
      with ``min(seq_len, its length)`` query rows. ``batch`` counts requests.

    A problem with either is a *serving* problem: q and out are ragged ``[total_q, heads,
    head_dim]``, the work is that of the seeded sample of the distribution
    (``request_lengths``), and only the work-list family (``serving_f16``) runs it. Labels,
    study names and registry keys show them only when set, so dense problems keep theirs.
    """

    seq_len: int
    head_dim: int
    batch: int = 1
    heads: int = 1
    causal: bool = False
    dtype: str = "float32"
    kv_heads: int = None  # type: ignore[assignment]  # None: heads
    kv_len: int = None  # type: ignore[assignment]  # None: seq_len
    precision: str = ""
    window_left: int = UNBOUNDED
    window_right: int = UNBOUNDED
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    direction: str = "forward"
    page_size: int | None = None
    lengths: str = length_distributions.EQUAL

    def __post_init__(self) -> None:
        kv_len = self.seq_len if self.kv_len is None else self.kv_len
        reason = (
            shape_error(self.seq_len, self.heads, self.causal, self.kv_heads, self.kv_len)
            or variant_error(self.window_left, self.window_right, self.softcap)
            or serving_error(self.page_size, self.lengths, kv_len)
        )
        if reason:
            raise ValueError(reason)
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction={self.direction!r} is not one of {', '.join(DIRECTIONS)}")
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.kv_len is None:
            object.__setattr__(self, "kv_len", self.seq_len)
        if self.page_size == 0:  # the registry's spelling of "contiguous"
            object.__setattr__(self, "page_size", None)
        object.__setattr__(self, "softcap", float(self.softcap))
        object.__setattr__(self, "alibi", bool(self.alibi))
        object.__setattr__(self, "sinks", bool(self.sinks))
        # One identity per visible set: bounds that cut nothing are no bounds.
        if self.causal or self.window_right >= self.seq_len - 1:
            object.__setattr__(self, "window_right", UNBOUNDED)
        if self.window_left >= self.kv_len - 1:
            object.__setattr__(self, "window_left", UNBOUNDED)
        if self.dtype == "float32":
            if not self.precision:
                object.__setattr__(self, "precision", DEFAULT_FLOAT32_PRECISION)
            elif self.precision not in FLOAT32_PRECISIONS:
                raise ValueError(
                    f"precision={self.precision!r} is not one of {', '.join(FLOAT32_PRECISIONS)}"
                )
        elif self.precision:
            raise ValueError(
                f"precision={self.precision!r} applies to float32 only, not {self.dtype}"
            )

    @property
    def fast_tf32(self) -> bool:
        """One-pass TF32 plans may serve this problem (``precision="tf32"``)."""
        return self.precision == "tf32"

    @property
    def batch_heads(self) -> int:
        """Query (batch, head) pairs."""
        return self.batch * self.heads

    @property
    def batch_kv_heads(self) -> int:
        return self.batch * self.kv_heads

    @property
    def group(self) -> int:
        """Query heads sharing one KV head."""
        return self.heads // self.kv_heads

    @property
    def self_attention(self) -> bool:
        """Whether k and v have q's shape (every problem before GQA and KV caches)."""
        return self.kv_heads == self.heads and self.kv_len == self.seq_len

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def causal_offset(self) -> int:
        """Keys a causal query row sees beyond its own index: ``kv_len - seq_len``."""
        return self.kv_len - self.seq_len

    @property
    def windowed(self) -> bool:
        """Whether a sliding window bounds what a row sees (besides causal masking)."""
        return self.window_left != UNBOUNDED or self.window_right != UNBOUNDED

    @property
    def has_variant(self) -> bool:
        """Whether any of the variants (window, softcap, ALiBi, sinks) is on."""
        return self.windowed or self.softcap > 0 or self.alibi or self.sinks

    @property
    def visible_offsets(self) -> tuple[int | None, int | None]:
        """The keys row ``r`` sees, as offsets from ``r``: ``[r + low, r + high]`` (None: no
        bound on that side), from the causal diagonal and the window together."""
        off = self.causal_offset
        low = None if self.window_left == UNBOUNDED else off - self.window_left
        if self.causal:
            high: int | None = off
        elif self.window_right != UNBOUNDED:
            high = off + self.window_right
        else:
            high = None
        return low, high

    @property
    def serving(self) -> bool:
        """Whether this is a serving batch (a paged cache, or unequal request lengths)."""
        return self.page_size is not None or self.lengths != length_distributions.EQUAL

    def request_lengths(self) -> length_distributions.RequestLengths:
        """Query rows and KV length of each request: the seeded sample of ``lengths``
        (all ``seq_len`` and ``kv_len`` for ``equal``)."""
        return length_distributions.request_lengths(
            self.lengths, self.batch, self.seq_len, self.kv_len
        )

    def request_offsets(self, query_len: int, kv_len: int) -> tuple[int | None, int | None]:
        """``visible_offsets`` of one request of a serving batch."""
        off = kv_len - query_len
        low = None if self.window_left == UNBOUNDED else off - self.window_left
        if self.causal:
            high: int | None = off
        elif self.window_right != UNBOUNDED:
            high = off + self.window_right
        else:
            high = None
        return low, high

    @property
    def attended_pairs_total(self) -> int:
        """(query, key) pairs that contribute per query head, summed over the requests."""
        if not self.serving:
            return self.batch * self.attended_pairs
        sample = self.request_lengths()
        return sum(
            visible_keys_total(int(n), int(m), *self.request_offsets(int(n), int(m)))
            for n, m in zip(sample.query, sample.kv, strict=True)
        )

    @property
    def attended_pairs(self) -> int:
        """(query, key) pairs that contribute, per (batch, query head) (a serving batch: the
        mean over its requests, rounded down).

        Causal keeps ``k <= r + kv_len - seq_len`` (bottom-right): row ``r`` sees
        ``r + 1 + kv_len - seq_len`` keys; a window keeps its band of those.
        """
        if self.serving:
            return self.attended_pairs_total // self.batch
        n, m = self.seq_len, self.kv_len
        if not self.windowed:
            return n * (m - n) + n * (n + 1) // 2 if self.causal else n * m
        return visible_keys_total(n, m, *self.visible_offsets)

    @property
    def backward(self) -> bool:
        return self.direction == "backward"

    @property
    def useful_flops(self) -> int:
        """Matmul flops of the attention itself: 2 products of 2*D flops per pair forward
        (4*B*H*N^2*D non-causal, about half of it causal), 5 backward (2.5x: FlashAttention's
        count, which leaves out the recomputation's extra exp).

        This is the figure TFLOP/s is quoted against, whatever a kernel actually executes.
        """
        products = MATMULS_PER_PAIR[self.direction]
        return 2 * products * self.heads * self.attended_pairs_total * self.head_dim

    @property
    def query_rows_total(self) -> int:
        """Query rows of one head over the batch (``batch * seq_len`` unless serving)."""
        if not self.serving:
            return self.batch * self.seq_len
        return int(self.request_lengths().query.sum())

    @property
    def kv_rows_total(self) -> int:
        """KV rows of one KV head over the batch (``batch * kv_len`` unless serving)."""
        if not self.serving:
            return self.batch * self.kv_len
        return int(self.request_lengths().kv.sum())

    @property
    def tensor_bytes(self) -> int:
        """Bytes of q or of out."""
        return self.query_rows_total * self.heads * self.head_dim * self.element_bytes

    @property
    def kv_tensor_bytes(self) -> int:
        """Bytes of k or of v: ``kv_heads`` heads of ``kv_len`` rows (a serving batch: of its
        requests' actual lengths; a paged cache's unused page slots are not read)."""
        return self.kv_rows_total * self.kv_heads * self.head_dim * self.element_bytes

    def shape_text(self, heads_separator: str = "/", rows_separator: str = ":") -> str:
        """``BxHxNxD``; with GQA the heads read ``H/KVH``, with a KV length the rows ``N:KVLEN``
        (``16x32/8x1:8192x128``: batch 16, 32 query heads on 8 KV heads, one query row
        against 8192 keys, head_dim 128).

        Self-attention shapes keep the text they always had, so the labels, study
        names and registry rows of problems tuned before GQA still match.
        """
        heads = str(self.heads)
        if self.kv_heads != self.heads:
            heads += f"{heads_separator}{self.kv_heads}"
        rows = str(self.seq_len)
        if self.kv_len != self.seq_len:
            rows += f"{rows_separator}{self.kv_len}"
        return f"{self.batch}x{heads}x{rows}x{self.head_dim}"

    def variant_text(self, separator: str = " ") -> str:
        """The variants that are on, e.g. ``window=4096 softcap=50`` ("" for none; a window
        reads ``window=L`` with the left bound only, ``window=L,R`` with both, ``-1`` for
        an open side)."""
        parts = []
        if self.windowed:
            window = str(self.window_left)
            if self.window_right != UNBOUNDED:
                window += f",{self.window_right}"
            parts.append(f"window={window}")
        if self.softcap > 0:
            parts.append(f"softcap={self.softcap:g}")
        if self.alibi:
            parts.append("alibi")
        if self.sinks:
            parts.append("sinks")
        return separator.join(parts)

    def serving_text(self, separator: str = " ") -> str:
        """``page=16 lengths=uniform``: what is set of the serving fields ("" for none)."""
        parts = []
        if self.page_size is not None:
            parts.append(f"page={self.page_size}")
        if self.lengths != length_distributions.EQUAL:
            parts.append(f"lengths={length_distributions.short_name(self.lengths)}")
        return separator.join(parts)

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        extra = " ".join(part for part in (self.variant_text(), self.serving_text()) if part)
        label = f"{self.shape_text()} {self.dtype_label} {mask}"
        label = f"{label} {extra}" if extra else label
        return f"{label} backward" if self.backward else label

    @property
    def dtype_label(self) -> str:
        """``dtype``, with ``-tf32`` for the fast float32 precision (the accurate one is
        the default and shows nothing, so existing labels and names are unchanged)."""
        return f"{self.dtype}-tf32" if self.fast_tf32 else self.dtype
