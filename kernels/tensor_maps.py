"""TMA descriptors: a plan's ``TensorMap`` values encoded by the driver into ``CUtensorMap``s.

A kernel that loads with the tensor memory accelerator (``cp.async.bulk.tensor``) takes its
descriptors as ``const __grid_constant__ CUtensorMap`` parameters: 128 opaque bytes that
``cuTensorMapEncodeTiled`` writes on the host (no context needed) from the buffer's address,
shape, strides, box and swizzle. ``EncodedTensorMap`` holds them 64-byte aligned, as the
driver requires; the launches pass the ctypes array itself by value: its address goes into
``cuLaunchKernel``'s ``kernelParams`` (the deploy handle's and, for TMA plans, the PyCUDA
backend's launches alike). ``cuTensorMapReplaceAddress``
re-points an encoded map at another buffer of the same shape (the deploy path's per-call
q, k, v), which costs a host call, not a re-encode.
"""

from __future__ import annotations

import ctypes
from typing import Any

from tuner.errors import BackendError
from tuner.planner.launches import TensorMap

TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGNMENT = 64
#: CUtensorMapDataType (cuda.h)
DATA_TYPES = {"float16": 6, "bfloat16": 9}
#: CUtensorMapSwizzle by swizzle span in bytes
SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}
INTERLEAVE_NONE = 0
#: CU_TENSOR_MAP_L2_PROMOTION_L2_256B: K/V tiles are read whole
L2_PROMOTION_256B = 3
#: CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read as zeros
OOB_FILL_ZEROS = 0


class EncodedTensorMap:
    """One encoded ``CUtensorMap`` in 64-byte aligned host memory that lives with the object."""

    def __init__(self, spec: TensorMap) -> None:
        self.spec = spec
        self._backing = ctypes.create_string_buffer(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGNMENT)
        base = ctypes.addressof(self._backing)
        aligned = (base + TENSOR_MAP_ALIGNMENT - 1) // TENSOR_MAP_ALIGNMENT * TENSOR_MAP_ALIGNMENT
        #: the kernel parameter: its address is what ``cuLaunchKernel`` copies 128 bytes from
        self.value = (ctypes.c_uint64 * (TENSOR_MAP_BYTES // 8)).from_address(aligned)
        self.address = spec.address


def encode(spec: TensorMap, library: Any) -> EncodedTensorMap:
    """``cuTensorMapEncodeTiled`` of ``spec`` through ``library`` (libcuda, see
    ``kernels.cuda_driver.libcuda``); a refusal is a ``BackendError`` naming the map."""
    encoded = EncodedTensorMap(spec)
    rank = len(spec.dims)
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    status = library.cuTensorMapEncodeTiled(
        ctypes.c_void_p(ctypes.addressof(encoded.value)),
        ctypes.c_int(DATA_TYPES[spec.dtype]),
        u32(rank),
        ctypes.c_void_p(spec.address),
        (u64 * rank)(*spec.dims),
        (u64 * max(rank - 1, 1))(*spec.strides_bytes),
        (u32 * rank)(*spec.box),
        (u32 * rank)(*([1] * rank)),
        ctypes.c_int(INTERLEAVE_NONE),
        ctypes.c_int(SWIZZLES[spec.swizzle_bytes]),
        ctypes.c_int(L2_PROMOTION_256B),
        ctypes.c_int(OOB_FILL_ZEROS),
    )
    if status != 0:
        raise BackendError(
            f"cuTensorMapEncodeTiled refused the {spec.buffer} map (dims {spec.dims}, strides "
            f"{spec.strides_bytes} B, box {spec.box}, swizzle {spec.swizzle_bytes} B): "
            f"CUDA error {status}"
        )
    return encoded


def replace_address(encoded: EncodedTensorMap, address: int, library: Any) -> None:
    """Point ``encoded`` at ``address`` (a buffer of the same shape), when it moved."""
    if address == encoded.address:
        return
    status = library.cuTensorMapReplaceAddress(
        ctypes.c_void_p(ctypes.addressof(encoded.value)), ctypes.c_void_p(address)
    )
    if status != 0:
        raise BackendError(
            f"cuTensorMapReplaceAddress refused {address:#x} for the {encoded.spec.buffer} map "
            f"(TMA needs 16-byte aligned addresses): CUDA error {status}"
        )
    encoded.address = address
