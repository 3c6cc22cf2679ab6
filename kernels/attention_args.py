"""The arguments of ``kernels.attention``, checked before any launch.

Inputs: q (and out) ``[batch, heads, seq_len, head_dim]``, k and v ``[batch, kv_heads, kv_len,
head_dim]``, C-contiguous device arrays of one dtype on one GPU. ``kv_heads`` must divide ``heads``
(grouped-query attention: query head ``h`` reads KV head ``h // (heads // kv_heads)``; MQA at 1),
``kv_len`` is the key/value length (decode against a KV cache); ``problem_of`` infers both from
k's shape. Causal masking is bottom-right aligned (query row ``r`` sees keys
``k <= r + kv_len - seq_len``, as FlashAttention and a KV cache do), so causal calls need
``kv_len >= seq_len``. The arrays are torch CUDA tensors, PyCUDA ``GPUArray``s, or anything with
``__cuda_array_interface__``. The dtypes are ``tuner.problem.SUPPORTED_DTYPES``: torch's
``float32``, ``bfloat16`` and ``float16``; through the interface typestr ``'<f4'`` (float32) and
``'<f2'`` (float16) only. The interface has no name for bfloat16 (producers give it as ``'<V2'``
or as ``'<u2'`` bit patterns, which may as well be integers), so 2-byte typestrs other than
``'<f2'`` are refused, and a ``'<f2'`` array is always read as float16: pass bfloat16 as torch
tensors.

``check_inputs`` checks every argument (kind, dtype, rank, contiguity) and their agreement
(kind, dtype, shape, torch device, ``out`` writable and apart from the inputs) without a CUDA call;
``AttentionInputError`` (a ``TunerError`` and a ``ValueError``; ``AttentionInputTypeError`` also
a ``TypeError``) names the argument, what it was and what is expected. The variants' arguments
(window, softcap, ALiBi slopes, sinks, scale) are ``kernels.variant_args``'s to check;
``problem_of`` takes what that made of them.

The interface carries no device, so for non-torch arrays ``interface_device`` asks the driver
for the device, memory type and owning context of each pointer (``cuPointerGetAttributes`` in
libcuda, through ctypes: no pycuda here) and refuses host memory and arrays on two GPUs.
torch is never imported here: a torch tensor exists only if the caller imported torch.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kernels.cuda_driver import libcuda
from tuner.errors import TunerError
from tuner.problem import (
    DEFAULT_FLOAT32_PRECISION,
    DTYPE_BYTES,
    FLOAT32_PRECISIONS,
    SUPPORTED_DTYPES,
    Problem,
    shape_error,
)

if TYPE_CHECKING:
    from kernels.variant_args import VariantArgs

LAYOUT = "[batch, heads, seq_len, head_dim]"
#: device types a tensor without storage may be on while torch traces (``check_traced``): CUDA;
#: the CPU tests add "meta", on which a CPU-only torch can run autograd
TRACED_DEVICE_TYPES = frozenset({"cuda"})
#: the dtypes whose calls are differentiable: those a backward family takes
DIFFERENTIABLE_DTYPES = ("bfloat16", "float16")
KV_LAYOUT = "[batch, kv_heads, kv_len, head_dim]"
#: the interface typestrs taken, as numpy dtypes, and the problem dtype each one is
INTERFACE_DTYPES = {np.dtype("<f4"): "float32", np.dtype("<f2"): "float16"}
#: the numpy dtype of an array allocated for a result (interface arrays: no bfloat16)
NUMPY_DTYPES = {name: dtype for dtype, name in INTERFACE_DTYPES.items()}
# CUpointer_attribute and CUmemorytype values (cuda.h)
_CONTEXT, _MEMORY_TYPE, _DEVICE_ORDINAL = 1, 2, 9
_HOST, _DEVICE, _UNIFIED = 1, 2, 4


class AttentionInputError(TunerError, ValueError):
    """An argument of ``attention`` is not what it must be; the message names it."""


class AttentionInputTypeError(AttentionInputError, TypeError):
    """An argument of the wrong kind or dtype."""


class DeviceArray(NamedTuple):
    """What the checks learned about one argument (a tuple: cheap to make on every call)."""

    name: str
    value: Any
    is_torch: bool
    shape: tuple[int, ...]
    pointer: int
    device: int | None  # torch's device index; None for interface arrays (the pointer says)
    dtype: str  # one of tuner.problem.SUPPORTED_DTYPES
    stream: int | None = None  # interface v3 "stream": the producer's stream
    readonly: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


class Inputs(NamedTuple):
    q: DeviceArray
    k: DeviceArray
    v: DeviceArray
    out: DeviceArray | None

    @property
    def arrays(self) -> tuple[DeviceArray, ...]:
        given = (self.q, self.k, self.v)
        return given if self.out is None else (*given, self.out)


def _type_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def _kind(array: DeviceArray) -> str:
    return "torch tensor" if array.is_torch else f"device array ({_type_name(array.value)})"


def _check_shape(name: str, shape: tuple[int, ...]) -> None:
    if len(shape) != 4:
        raise AttentionInputError(
            f"{name} has {len(shape)} dimensions (shape {shape}); expected 4: {LAYOUT}"
        )
    if 0 in shape:
        raise AttentionInputError(
            f"{name} has shape {shape} with an empty dimension; each of {LAYOUT} must be > 0"
        )


def _c_strides(shape: tuple[int, ...], itemsize: int = 4) -> tuple[int, ...]:
    strides, step = [], itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    # A dimension of size 1 is never stepped over, so its stride does not matter (numpy's rule).
    return all(
        size == 1 or stride == want
        for size, stride, want in zip(shape, strides, _c_strides(shape, itemsize), strict=True)
    )


def describe(name: str, value: Any, *, allow_grad: bool = False) -> DeviceArray:
    """Check one argument on its own (kind, dtype, rank, contiguity); no CUDA call.
    ``allow_grad``: a tensor that requires grad is fine (the differentiable path's ops)."""
    torch = sys.modules.get("torch")  # a torch tensor exists only if torch was imported
    if torch is not None and isinstance(value, torch.Tensor):
        return _describe_tensor(name, value, torch, allow_grad=allow_grad)
    try:
        interface = value.__cuda_array_interface__
    except AttributeError:
        interface = None
    except Exception as error:  # some producers raise their own errors from the property
        raise AttentionInputTypeError(
            f"{name}: its __cuda_array_interface__ cannot be read: {error}"
        ) from error
    if not isinstance(interface, Mapping):
        host = " in host memory" if hasattr(value, "__array_interface__") else ""
        raise AttentionInputTypeError(
            f"{name} is a {_type_name(value)}{host}; expected a device array: a torch CUDA "
            "tensor, a pycuda GPUArray or an object with __cuda_array_interface__"
        )
    return _describe_interface(name, value, interface)


def _describe_tensor(
    name: str, value: Any, torch: Any, pointer: bool = True, allow_grad: bool = False
) -> DeviceArray:
    device = value.device
    if device.type != "cuda" and (pointer or device.type not in TRACED_DEVICE_TYPES):
        raise AttentionInputTypeError(
            f"{name} is a torch tensor on {device}; expected a CUDA tensor ({name}.cuda())"
        )
    dtype = _torch_dtypes(torch).get(value.dtype)
    if dtype is None:
        allowed = ", ".join(f"torch.{name}" for name in SUPPORTED_DTYPES)
        raise AttentionInputTypeError(f"{name} has dtype {value.dtype}; expected one of {allowed}")
    shape = tuple(value.shape)  # torch.Size: ints already
    _check_shape(name, shape)
    if not value.is_contiguous():
        raise AttentionInputError(
            f"{name} is not C-contiguous (shape {shape}, strides {tuple(value.stride())} "
            f"elements); pass {name}.contiguous()"
        )
    if pointer and not allow_grad and value.requires_grad and torch.is_grad_enabled():
        # The differentiable calls never get here (kernels.deploy routes them to the autograd
        # op first): what is left has no backward pass.
        raise AttentionInputError(
            f"{name} requires grad, but kernels.attention differentiates only torch "
            f"{' and '.join(DIFFERENTIABLE_DTYPES)} calls without out= (the dtypes a backward "
            f"family takes; this one is {dtype}); call it under torch.no_grad() or pass "
            f"{name}.detach()"
        )
    address = value.data_ptr() if pointer else 0
    return DeviceArray(name, value, True, shape, address, device.index or 0, dtype)


@functools.lru_cache(maxsize=4)
def _torch_dtypes(torch: Any) -> dict[Any, str]:
    """torch's dtype objects of ``SUPPORTED_DTYPES``, to their names (once per torch module)."""
    return {getattr(torch, name): name for name in SUPPORTED_DTYPES}


def _describe_interface(name: str, value: Any, interface: Mapping[str, Any]) -> DeviceArray:
    try:
        shape = tuple(int(size) for size in interface["shape"])
        typestr = interface["typestr"]
        pointer, readonly = interface["data"]
    except (KeyError, TypeError, ValueError) as error:
        raise AttentionInputTypeError(
            f"{name}'s __cuda_array_interface__ is malformed ({error!r}); it needs shape, "
            "typestr and data"
        ) from error
    dtype = _interface_dtype(name, typestr)
    itemsize = DTYPE_BYTES[dtype]
    _check_shape(name, shape)
    strides = interface.get("strides")
    if strides is not None and len(strides) != len(shape):
        raise AttentionInputTypeError(f"{name} has {len(strides)} strides for shape {shape}")
    if strides is not None and not _c_contiguous(shape, tuple(int(s) for s in strides), itemsize):
        raise AttentionInputError(
            f"{name} is not C-contiguous (shape {shape}, strides {tuple(strides)} bytes; "
            f"C order is {_c_strides(shape, itemsize)})"
        )
    if interface.get("mask") is not None:
        raise AttentionInputError(f"{name} has a mask; masked arrays are not supported")
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
        dtype,
        stream=None if stream is None else int(stream),
        readonly=bool(readonly),
    )


def _interface_dtype(name: str, typestr: Any) -> str:
    """The problem dtype of an interface typestr: '<f4' float32, '<f2' float16, else refused."""
    try:
        found: np.dtype | None = np.dtype(typestr)
    except (TypeError, ValueError):
        found = None
    dtype = INTERFACE_DTYPES.get(found) if found is not None else None
    if dtype is not None:
        return dtype
    if found is not None and found.itemsize == 2 and found.kind in "uiV":
        raise AttentionInputTypeError(
            f"{name} has typestr {typestr!r}: 2-byte elements that are not float16 (bfloat16 "
            "bit patterns?), which __cuda_array_interface__ cannot name; pass bfloat16 as "
            "torch.bfloat16 tensors, float16 as '<f2'"
        )
    raise AttentionInputTypeError(
        f"{name} has dtype {found if found is not None else '?'} (typestr {typestr!r}); "
        "expected one of float32 ('<f4'), float16 ('<f2'); bfloat16 as torch tensors"
    )


def check_inputs(q: Any, k: Any, v: Any, out: Any = None, *, allow_grad: bool = False) -> Inputs:
    """Check every argument and their agreement; no CUDA call (the pointer checks come later).
    ``allow_grad``: tensors that require grad pass (the differentiable path's ops)."""
    named = (("q", q), ("k", k), ("v", v))
    first, *given = (describe(name, value, allow_grad=allow_grad) for name, value in named)
    result = describe("out", out, allow_grad=allow_grad) if out is not None else None
    _check_agreement(first, *(given if result is None else (*given, result)))
    if result is not None:
        if result.readonly:
            raise AttentionInputError("out is read-only (its __cuda_array_interface__ says so)")
        nbytes = result.nbytes  # out has q's shape by now
        for array in (first, *given):
            if (
                array.pointer < result.pointer + nbytes
                and result.pointer < array.pointer + array.nbytes
            ):
                raise AttentionInputError(
                    f"out overlaps {array.name} in memory; the kernels read {array.name} while "
                    "writing out: pass a separate array"
                )
    return Inputs(first, *given, result)


def _check_agreement(first: DeviceArray, *others: DeviceArray) -> None:
    """k, v (and out) against q (``others`` start with k): one kind, one dtype, one GPU;
    out of q's shape, k and v of one ``[batch, kv_heads, kv_len, head_dim]`` shape."""
    for other in others:
        if other.is_torch != first.is_torch:
            raise AttentionInputTypeError(
                f"{other.name} is a {_kind(other)} but q is a {_kind(first)}; pass q, k, v "
                "(and out) of one kind"
            )
        if other.dtype != first.dtype:
            which = (
                "out must have q's dtype"
                if other.name == "out"
                else "q, k and v must share one dtype"
            )
            raise AttentionInputTypeError(
                f"{other.name} has dtype {other.dtype} but q has dtype {first.dtype}; {which}"
            )
        _check_agreeing_shape(first, others[0], other)
        if other.device != first.device:
            raise AttentionInputError(
                f"{other.name} is on cuda:{other.device} but q is on cuda:{first.device}; all "
                "arrays must be on one GPU"
            )


def _check_agreeing_shape(q: DeviceArray, k: DeviceArray, other: DeviceArray) -> None:
    """out has q's shape; k is ``[batch, kv_heads, kv_len, head_dim]`` of q's batch and
    head_dim with kv_heads dividing q's heads; v has k's shape."""
    if other.name == "out":
        if other.shape != q.shape:
            raise AttentionInputError(
                f"out has shape {other.shape} but q has shape {q.shape}; out must have q's shape"
            )
        return
    if other.name == "v":
        if other.shape != k.shape:
            raise AttentionInputError(
                f"v has shape {other.shape} but k has shape {k.shape}; v must have k's shape "
                f"{KV_LAYOUT}"
            )
        return
    (batch, heads, _, head_dim), (kv_batch, kv_heads, _, kv_head_dim) = q.shape, k.shape
    if kv_batch != batch or kv_head_dim != head_dim:
        raise AttentionInputError(
            f"k has shape {k.shape} but q has shape {q.shape}; k must be {KV_LAYOUT} with q's "
            f"batch ({batch}) and head_dim ({head_dim})"
        )
    if heads % kv_heads:
        raise AttentionInputError(
            f"k has {kv_heads} heads but q has {heads}; kv_heads must divide heads (each KV "
            "head serves heads // kv_heads query heads)"
        )


def check_causal(causal: Any) -> bool:
    if not isinstance(causal, bool | np.bool_):
        raise AttentionInputTypeError(f"causal must be a bool, got {causal!r}")
    return bool(causal)


def problem_of(
    inputs: Inputs, causal: bool, precision: str = "", variants: VariantArgs | None = None
) -> Problem:
    """The problem checked inputs pose: what a handle is resolved (and cached) for; kv_heads
    and kv_len from k's shape; ``precision`` as ``check_precision`` returned it; ``variants``
    (``kernels.variant_args.VariantArgs``, None for none): the window, the softcap, and
    whether ALiBi slopes and sinks are given (never their values, nor the scale)."""
    if variants is None:
        return problem_from_shapes(
            inputs.q.shape, inputs.k.shape, inputs.q.dtype, causal, precision
        )
    return problem_from_shapes(
        inputs.q.shape,
        inputs.k.shape,
        inputs.q.dtype,
        causal,
        precision,
        window_left=variants.window_left,
        window_right=variants.window_right,
        softcap=variants.softcap,
        alibi=variants.alibi_slopes is not None,
        sinks=variants.sinks is not None,
    )


def problem_from_shapes(
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    dtype: str,
    causal: bool,
    precision: str = "",
    **variants: Any,
) -> Problem:
    """The problem of q's and k's (checked) shapes and the variants (``Problem``'s
    ``window_left``, ``window_right``, ``softcap``, ``alibi``, ``sinks``); an
    ``AttentionInputError`` when causal masking leaves query rows without a key
    (``seq_len > kv_len``)."""
    batch, heads, seq_len, head_dim = q_shape
    _, kv_heads, kv_len, _ = kv_shape
    reason = shape_error(seq_len, heads, causal, kv_heads, kv_len)
    if reason:
        raise AttentionInputError(f"q {tuple(q_shape)} with k {tuple(kv_shape)}: {reason}")
    return Problem(
        seq_len,
        head_dim,
        batch=batch,
        heads=heads,
        causal=causal,
        dtype=dtype,
        kv_heads=kv_heads,
        kv_len=kv_len,
        precision=precision,
        **variants,
    )


# ---------------------------------------------------------------------------- torch, per call


def torch_signature(
    q: Any,
    k: Any,
    v: Any,
    causal: bool,
    precision: str | None = None,
    window: Any = (-1, -1),
    softcap: Any = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
) -> tuple[Any, ...]:
    """What a call on torch tensors (``type(q) is type(k) is type(v) is torch.Tensor``) is
    keyed by: every property of q, k and v the problem and device follow from, and of the
    variants (the window and softcap as given; the slopes' and sinks' dtype, shape and device,
    not their values; never the scale). A signature seen before passed ``check_inputs`` and
    ``kernels.variant_args.check_variants`` then; ``torch_pointers`` checks what it does not
    cover. The caller makes sure ``window`` is hashable (a tuple of ints)."""
    return (
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        k.dtype,
        v.dtype,
        q.get_device(),
        k.get_device(),
        v.get_device(),
        causal,
        precision,
        window,
        softcap,
        None if alibi_slopes is None else _vector_signature(alibi_slopes),
        None if sinks is None else _vector_signature(sinks),
    )


def _vector_signature(values: Any) -> tuple[Any, ...]:
    return (values.dtype, values.shape, values.get_device())


def torch_pointers(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    nbytes: int,
    torch: Any,
    kv_nbytes: int | None = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
) -> tuple[int, int, int, int, int] | None:
    """q, k, v's, the slopes' and the sinks' addresses (0 for those not given) when a call
    with a known signature needs no other check, else None (the caller then runs the checks,
    which say what is wrong): each contiguous, no gradient asked for, ``out`` (if given) a
    contiguous tensor like q apart from the inputs. ``nbytes``: the bytes of q and of out;
    ``kv_nbytes`` of k and of v (default ``nbytes``)."""
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return None
    if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        return None
    slopes_at = sinks_at = 0
    for values in (alibi_slopes, sinks):
        if values is not None and (
            not values.is_contiguous() or (values.requires_grad and torch.is_grad_enabled())
        ):
            return None
    if alibi_slopes is not None:
        slopes_at = alibi_slopes.data_ptr()
    if sinks is not None:
        sinks_at = sinks.data_ptr()
    q_at, k_at, v_at = q.data_ptr(), k.data_ptr(), v.data_ptr()
    if out is None:
        return q_at, k_at, v_at, slopes_at, sinks_at
    if (
        type(out) is not type(q)
        or out.shape != q.shape
        or out.dtype != q.dtype
        or out.get_device() != q.get_device()
        or not out.is_contiguous()
    ):
        return None
    out_at = out.data_ptr()
    out_end = out_at + nbytes
    kv_nbytes = nbytes if kv_nbytes is None else kv_nbytes
    if (
        (q_at < out_end and out_at < q_at + nbytes)
        or (k_at < out_end and out_at < k_at + kv_nbytes)
        or (v_at < out_end and out_at < v_at + kv_nbytes)
    ):
        return None
    heads_bytes = 4 * q.shape[1]  # the float32 [heads] arrays
    for at in (slopes_at, sinks_at):
        if at and at < out_end and out_at < at + heads_bytes:
            return None
    return q_at, k_at, v_at, slopes_at, sinks_at


def wants_grad(q: Any, k: Any, v: Any, torch: Any) -> bool:
    """Whether a call on torch tensors asks autograd for gradients."""
    return bool(
        (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()
    )


def differentiable(q: Any, out: Any, precision: Any, torch: Any) -> bool:
    """Whether a call that wants gradients can have them: torch tensors of a differentiable
    dtype, no ``out=`` (autograd needs an output of its own), no precision (float32's)."""
    dtypes = tuple(getattr(torch, name) for name in DIFFERENTIABLE_DTYPES)
    return out is None and precision is None and q.dtype in dtypes


def check_differentiable_dtype(dtype: str) -> None:
    """A differentiable op's inputs: of a dtype some backward family takes."""
    if dtype not in DIFFERENTIABLE_DTYPES:
        raise AttentionInputTypeError(
            f"q has dtype {dtype}; gradients are computed for "
            f"{', '.join(DIFFERENTIABLE_DTYPES)} (the dtypes a backward family takes)"
        )


def check_lse(lse: Any, q: DeviceArray) -> None:
    """The forward's log-sum-exps a backward call takes: a contiguous float32 CUDA tensor of
    ``[batch, heads, seq_len]`` on q's device."""
    torch = sys.modules["torch"]
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32:
        raise AttentionInputTypeError(f"lse must be a float32 torch tensor, got {lse!r:.60}")
    if tuple(lse.shape) != q.shape[:3] or not lse.is_contiguous():
        raise AttentionInputError(
            f"lse has shape {tuple(lse.shape)}; expected a contiguous {q.shape[:3]} "
            "([batch, heads, seq_len] of q)"
        )
    if (lse.device.index or 0) != q.device or lse.device.type != "cuda":
        raise AttentionInputError(f"lse is on {lse.device} but q is on cuda:{q.device}")


def check_traced(q: Any, k: Any, v: Any, out: Any = None) -> Inputs:
    """``check_inputs`` for tensors without storage (torch's fake tensors, while
    ``torch.compile`` traces): every check but those of addresses and gradients."""
    arrays = [("q", q), ("k", k), ("v", v)] + ([("out", out)] if out is not None else [])
    torch = sys.modules["torch"]  # fake tensors exist only where torch was imported
    described = []
    for name, value in arrays:
        if not isinstance(value, torch.Tensor):
            raise AttentionInputTypeError(
                f"{name} is a {_type_name(value)}; under torch.compile pass torch CUDA tensors"
            )
        described.append(_describe_tensor(name, value, torch, pointer=False))
    _check_agreement(*described)
    return Inputs(*described[:3], described[3] if out is not None else None)


def check_precision(precision: Any, dtype: str) -> str:
    """The problem precision of a call: "tf32x3" (the float32 default: float32-class
    error) or "tf32" (one-pass TF32 plans may serve it) for float32; "" for half dtypes,
    which refuse any TF32 precision. A plan stored for "tf32" never serves "tf32x3"."""
    if dtype != "float32":
        if precision is not None:
            raise AttentionInputError(
                f"precision={precision!r} applies to float32 inputs only, not {dtype}; "
                "leave it unset"
            )
        return ""
    if precision is None:
        return DEFAULT_FLOAT32_PRECISION
    if precision not in FLOAT32_PRECISIONS:
        raise AttentionInputError(
            f"precision must be one of {', '.join(FLOAT32_PRECISIONS)}, got {precision!r}"
        )
    return str(precision)


# ---------------------------------------------------------------------------- pointer facts


class PointerFacts(NamedTuple):
    """What the driver says about a pointer (``cuPointerGetAttributes``)."""

    memory_type: int  # CUmemorytype; 0: not memory CUDA knows
    device: int
    context: int  # the owning CUcontext; 0 when the allocation has none (pools, VMM)


@functools.cache
def _libcuda() -> Any | None:
    """The driver library with the pointer query's argument types; None where absent."""
    library = libcuda()
    if library is not None:
        library.cuPointerGetAttributes.argtypes = [
            ctypes.c_uint,
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_ulonglong,
        ]
        library.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    return library


def query_pointer(pointer: int) -> PointerFacts | None:
    """The pointer's memory type, device and context; None where the driver cannot be asked."""
    library = _libcuda()
    if library is None:
        return None
    context, memory_type, ordinal = ctypes.c_void_p(), ctypes.c_uint(0), ctypes.c_int(-1)
    attributes = (ctypes.c_int * 3)(_CONTEXT, _MEMORY_TYPE, _DEVICE_ORDINAL)
    data = (ctypes.c_void_p * 3)(
        ctypes.addressof(context), ctypes.addressof(memory_type), ctypes.addressof(ordinal)
    )
    # Unlike the singular call, this one reports unknown (host) pointers as type 0, not an error.
    if library.cuPointerGetAttributes(3, attributes, data, pointer) != 0:
        return None
    return PointerFacts(memory_type.value, ordinal.value, context.value or 0)


def current_context() -> int | None:
    library = _libcuda()
    handle = ctypes.c_void_p()
    if library is None or library.cuCtxGetCurrent(ctypes.byref(handle)) != 0:
        return None
    return handle.value or 0


def device_of(arrays: Sequence[DeviceArray], facts: Sequence[PointerFacts | None]) -> int:
    """The one GPU the interface arrays are on, from their pointers (device 0 if none says)."""
    device, first = None, ""
    for array, fact in zip(arrays, facts, strict=True):
        if fact is None:
            continue
        if fact.memory_type not in (_DEVICE, _UNIFIED):
            what = {0: "not memory CUDA knows (host memory?)", _HOST: "page-locked host memory"}
            raise AttentionInputError(
                f"{array.name}'s data pointer {array.pointer:#x} is "
                f"{what.get(fact.memory_type, 'a CUDA array')}; expected device memory"
            )
        if device is None:
            device, first = fact.device, array.name
        elif fact.device != device:
            raise AttentionInputError(
                f"{array.name} is on cuda:{fact.device} but {first} is on cuda:{device}; all "
                "arrays must be on one GPU"
            )
    return device if device is not None else 0


def interface_device(
    inputs: Inputs, extra: Sequence[DeviceArray] = ()
) -> tuple[int, list[PointerFacts | None]]:
    """The GPU of the interface arrays (``extra``: the variants' per-head arrays too) and the
    driver's facts on each, in ``(*inputs.arrays, *extra)`` order."""
    arrays = (*inputs.arrays, *extra)
    facts = [query_pointer(array.pointer) for array in arrays]
    return device_of(arrays, facts), facts
