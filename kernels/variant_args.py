"""The variant arguments of ``kernels.attention``, checked before any launch.

    kernels.attention(q, k, v, causal=False, *, window=(-1, -1), softcap=0.0,
                      alibi_slopes=None, sinks=None, scale=None)

* ``window``: a pair ``(left, right)`` of ints, FlashAttention's ``window_size``: query row
  ``r`` sees keys in ``[r + off - left, r + off + right]`` (``off = kv_len - seq_len``), -1 for
  no bound on that side; with ``causal`` the right side is the diagonal. A single int is
  refused: whether it bounds the left side only or both is exactly what a reader cannot tell.
* ``softcap``: a number >= 0 (0: none); logits ``s`` become ``softcap * tanh(s / softcap)``.
* ``alibi_slopes``, ``sinks``: float32 arrays of ``[heads]`` (one per query head) on q's GPU,
  of q's kind (torch CUDA tensors with torch tensors, ``__cuda_array_interface__`` arrays
  otherwise), contiguous; None when off. Their values are data: the problem (the plan the
  registry is asked for) knows only whether they are given.
* ``scale``: the softmax scale, a number > 0; None for ``1/sqrt(head_dim)``. Run-time data
  too: one problem and one handle serve every scale.

Every refusal is one ``AttentionInputError`` (``AttentionInputTypeError`` for a wrong kind
or dtype) naming the argument, what it was and what is expected. No CUDA call here.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from kernels.attention_args import (
    AttentionInputError,
    AttentionInputTypeError,
    DeviceArray,
    Inputs,
    _c_contiguous,
    _type_name,
)
from kernels.attention_variants import LOG2E
from tuner.problem import UNBOUNDED

#: ``window``'s default: no bound on either side
NO_WINDOW = (UNBOUNDED, UNBOUNDED)
#: the largest bound the kernels' int32 arguments hold
I32_MAX = 2**31 - 1
#: the per-head arrays' element type, whatever q's dtype
HEAD_VALUES_DTYPE = "float32"


class VariantArgs(NamedTuple):
    """What the checks made of the variant arguments."""

    window_left: int = UNBOUNDED
    window_right: int = UNBOUNDED
    softcap: float = 0.0
    alibi_slopes: DeviceArray | None = None
    sinks: DeviceArray | None = None
    #: the caller's ``scale * log2(e)``; None: the default scale
    scale_log2: float | None = None

    @property
    def arrays(self) -> tuple[DeviceArray, ...]:
        return tuple(array for array in (self.alibi_slopes, self.sinks) if array is not None)

    @property
    def pointers(self) -> tuple[int, int]:
        """The slopes' and the sinks' addresses, 0 for those not given."""
        return (
            0 if self.alibi_slopes is None else self.alibi_slopes.pointer,
            0 if self.sinks is None else self.sinks.pointer,
        )


def check_window(window: Any) -> tuple[int, int]:
    """``(left, right)``, each an int >= 0 or -1; a bare int, or anything else, is refused."""
    if isinstance(window, int | np.integer) and not isinstance(window, bool):
        raise AttentionInputTypeError(
            f"window must be a pair (left, right), got the single number {window!r}: pass "
            f"window=({int(window)}, -1) for {int(window)} keys before each query (with "
            f"causal=True, Mistral's sliding window), or ({int(window)}, {int(window)}) for as "
            "many on both sides; -1 is no bound"
        )
    if not isinstance(window, tuple | list) or len(window) != 2:
        raise AttentionInputTypeError(
            f"window must be a pair (left, right) of ints, -1 for no bound on that side; "
            f"got {window!r}"
        )
    bounds = []
    for side, bound in zip(("left", "right"), window, strict=True):
        if isinstance(bound, bool) or not isinstance(bound, int | np.integer):
            raise AttentionInputTypeError(
                f"window={tuple(window)!r}: the {side} bound must be an int (-1 for no bound), "
                f"got {bound!r}"
            )
        if not UNBOUNDED <= bound <= I32_MAX:
            raise AttentionInputError(
                f"window={tuple(window)!r}: the {side} bound must be in 0..{I32_MAX}, or -1 for "
                f"no bound, got {int(bound)}"
            )
        bounds.append(int(bound))
    return bounds[0], bounds[1]


def check_softcap(softcap: Any) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, int | float | np.integer | np.floating):
        raise AttentionInputTypeError(f"softcap must be a number >= 0 (0: none), got {softcap!r}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0:
        raise AttentionInputError(f"softcap must be a finite number >= 0 (0: none), got {value}")
    return value


def check_scale(scale: Any) -> float | None:
    """The caller's ``scale * log2(e)`` (what the kernels take), or None for the default."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.integer | np.floating):
        raise AttentionInputTypeError(
            f"scale must be a number > 0 or None (1/sqrt(head_dim)), got {scale!r}"
        )
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        raise AttentionInputError(f"scale must be a finite number > 0, got {value}")
    return value * LOG2E


def check_variants(
    inputs: Inputs,
    window: Any = NO_WINDOW,
    softcap: Any = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    scale: Any = None,
    *,
    pointers: bool = True,
) -> VariantArgs:
    """Check every variant argument against the checked ``inputs``; no CUDA call.
    ``pointers=False``: for tensors without storage (torch.compile's fake tensors), no
    address or gradient checks."""
    left, right = check_window(window)
    slopes, sink_values = (
        None if value is None else describe_head_values(name, value, inputs, pointers)
        for name, value in (("alibi_slopes", alibi_slopes), ("sinks", sinks))
    )
    return VariantArgs(left, right, check_softcap(softcap), slopes, sink_values, check_scale(scale))


def describe_head_values(
    name: str, value: Any, inputs: Inputs, pointer: bool = True
) -> DeviceArray:
    """Check ``alibi_slopes`` or ``sinks``: of q's kind, float32, ``[heads]``, contiguous, on q's
    GPU (torch; for interface arrays the pointer says, later), apart from ``out``."""
    q = inputs.q
    heads = q.shape[1]
    expected = f"a float32 {'CUDA tensor' if q.is_torch else 'device array'} of shape ({heads},)"
    torch = sys.modules.get("torch")
    if q.is_torch:
        array = _describe_tensor(name, value, torch, q, expected, pointer)
    else:
        array = _describe_interface(name, value, expected)
    if array.shape != (heads,):
        raise AttentionInputError(
            f"{name} has shape {array.shape}; expected ({heads},): one value per query head "
            f"(q has {heads} heads)"
        )
    out = inputs.out
    if (
        out is not None
        and array.pointer
        and out.pointer
        and array.pointer < out.pointer + out.nbytes
        and out.pointer < array.pointer + 4 * heads
    ):
        raise AttentionInputError(
            f"out overlaps {name} in memory; the kernels read {name} while writing out: pass a "
            "separate array"
        )
    return array


def _describe_tensor(
    name: str, value: Any, torch: Any, q: DeviceArray, expected: str, pointer: bool
) -> DeviceArray:
    if torch is None or not isinstance(value, torch.Tensor):
        raise AttentionInputTypeError(
            f"{name} is a {_type_name(value)}; expected {expected} (q is a torch tensor)"
        )
    device = value.device
    if device.type != "cuda":
        raise AttentionInputTypeError(
            f"{name} is a torch tensor on {device}; expected {expected} on q's cuda:{q.device}"
        )
    if (device.index or 0) != q.device:
        raise AttentionInputError(
            f"{name} is on cuda:{device.index or 0} but q is on cuda:{q.device}; all arrays "
            "must be on one GPU"
        )
    if value.dtype != torch.float32:
        raise AttentionInputTypeError(
            f"{name} has dtype {value.dtype}; expected torch.float32 (whatever q's dtype)"
        )
    shape = tuple(value.shape)
    if len(shape) == 1 and not value.is_contiguous():
        raise AttentionInputError(
            f"{name} is not contiguous (stride {tuple(value.stride())}); pass "
            f"{name}.contiguous()"
        )
    if pointer and value.requires_grad and torch.is_grad_enabled():
        raise AttentionInputError(
            f"{name} requires grad, but kernels.attention has no backward pass; call it under "
            f"torch.no_grad() or pass {name}.detach()"
        )
    address = value.data_ptr() if pointer else 0
    return DeviceArray(name, value, True, shape, address, device.index or 0, HEAD_VALUES_DTYPE)


def _describe_interface(name: str, value: Any, expected: str) -> DeviceArray:
    try:
        interface = value.__cuda_array_interface__
    except AttributeError:
        interface = None
    if not isinstance(interface, Mapping):
        raise AttentionInputTypeError(
            f"{name} is a {_type_name(value)}; expected {expected} (q is a device array)"
        )
    try:
        shape = tuple(int(size) for size in interface["shape"])
        typestr = interface["typestr"]
        pointer, _ = interface["data"]
    except (KeyError, TypeError, ValueError) as error:
        raise AttentionInputTypeError(
            f"{name}'s __cuda_array_interface__ is malformed ({error!r}); it needs shape, "
            "typestr and data"
        ) from error
    try:
        found: np.dtype | None = np.dtype(typestr)
    except (TypeError, ValueError):
        found = None
    if found != np.dtype("<f4"):
        raise AttentionInputTypeError(
            f"{name} has typestr {typestr!r}; expected '<f4' (float32, whatever q's dtype)"
        )
    strides = interface.get("strides")
    if strides is not None and not _c_contiguous(shape, tuple(int(s) for s in strides), 4):
        raise AttentionInputError(f"{name} is not contiguous (strides {tuple(strides)} bytes)")
    if not pointer:
        raise AttentionInputError(f"{name} has a null data pointer")
    stream = interface.get("stream")
    return DeviceArray(
        name,
        value,
        False,
        shape,
        int(pointer),
        None,
        HEAD_VALUES_DTYPE,
        stream=None if stream is None else int(stream),
    )
