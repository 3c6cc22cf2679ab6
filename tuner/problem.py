"""The attention problem a plan is tuned for."""

from __future__ import annotations

from dataclasses import dataclass

#: element types of q, k, v and out; the half types are 2-byte elements
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: how float32 inputs may be multiplied: "tf32x3" (the default, float32-class
#: error: SIMT FFMA or the 3xTF32 split on tensor cores) or "tf32" (one TF32
#: pass allowed too: 10-bit significands, faster). Most precise first.
FLOAT32_PRECISIONS = ("tf32x3", "tf32")
#: the precision a float32 problem gets when none is asked for
DEFAULT_FLOAT32_PRECISION = "tf32x3"


@dataclass(frozen=True, slots=True)
class Problem:
    """One attention shape: ``out = softmax(q k^T / sqrt(head_dim)) v`` per (batch, head).

    Tensors are contiguous ``[batch, heads, seq_len, head_dim]`` of ``dtype``.
    ``dtype`` defaults to float32 here (the seed's type; the Hydra entry's default
    is bfloat16), so code that builds problems by hand keeps its meaning.

    ``precision`` is the least precise arithmetic a plan may use: for float32
    one of ``FLOAT32_PRECISIONS`` ("" means the accurate default, "tf32x3");
    for the half dtypes it does not apply and is "". The accurate precision is
    left out of labels and names, so every problem from before the field
    existed keeps its label, study name and registry row.
    """

    seq_len: int
    head_dim: int
    batch: int = 1
    heads: int = 1
    causal: bool = False
    dtype: str = "float32"
    precision: str = ""

    def __post_init__(self) -> None:
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
        return self.batch * self.heads

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def attended_pairs(self) -> int:
        """(query, key) pairs that contribute, per (batch, head): causal keeps k <= q."""
        n = self.seq_len
        return n * (n + 1) // 2 if self.causal else n * n

    @property
    def useful_flops(self) -> int:
        """Matmul flops of the attention itself: 2 products of 2*D flops per pair.

        This is the figure TFLOP/s is quoted against (4*B*H*N^2*D non-causal,
        about half of it causal), whatever a kernel actually executes.
        """
        return 4 * self.batch_heads * self.attended_pairs * self.head_dim

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one of q, k, v or out."""
        return self.batch_heads * self.seq_len * self.head_dim * self.element_bytes

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{self.batch}x{self.heads}x{self.seq_len}x{self.head_dim} {self.dtype_label} {mask}"

    @property
    def dtype_label(self) -> str:
        """``dtype``, with ``-tf32`` for the fast float32 precision (the accurate one is
        the default and shows nothing, so existing labels and names are unchanged)."""
        return f"{self.dtype}-tf32" if self.fast_tf32 else self.dtype
