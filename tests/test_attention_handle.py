"""The deploy handle's launch packing without a GPU: pointer arguments named by role, ctypes
arguments packed once per stream and kept alive, what the driver would read.

``AttentionHandle`` runs here with a driver that records its launches (``Recording``) or with
the real ``CudaDriver`` over a library that never launches; the handle's calls on the fake GPU
(kernels emulated on the packed values) are in ``test_attention.py``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import types
from typing import Any

import numpy as np
import pytest

from kernels import cuda_driver, plan_choice
from kernels.backends import attention_handle
from kernels.launch import DeviceBuffers, buffer_elements, launch_sequence
from tuner.device import H200
from tuner.errors import BackendError
from tuner.planner.tunable import KernelParams, plan_kernel
from tuner.problem import Problem

#: a tiled plan with key splits on PROBLEM: two launches, split scratch
STORED = {"threads": 128, "tile_size": 32, "rows_per_block": 32, "split_target": 4}
PROBLEM = Problem(1000, 64, batch=2, heads=4, causal=True)


def test_launch_arguments_are_packed_once_by_role() -> None:
    problem = PROBLEM
    split = plan_kernel(problem, KernelParams("tiled", **STORED), H200)
    assert split.sequence_splits > 1
    launches = launch_sequence(split, attention_handle.BUFFER_MARKERS)
    functions = {launch.function: 100 + i for i, launch in enumerate(launches)}
    templates = attention_handle.launch_templates(launches, functions)
    named = [(t.name, t.function) for t in templates]
    assert named == [("tiled_attention", 100), ("split_merge", 101)]
    roles = [[a for a in t.arguments if isinstance(a, str)] for t in templates]
    assert roles[0] == [
        "q", "k", "v", "out", "partial_o", "partial_ml", "alibi_slopes", "sinks", "lse"
    ]
    assert sorted(roles[1]) == ["lse", "out", "partial_ml", "partial_o", "sinks"]
    # Packed once per stream; a launch reads the addresses the last call wrote.
    chosen = plan_choice.ChosenPlan(split, "default")
    driver = Recording()
    handle = attention_handle.AttentionHandle(
        problem, 0, chosen, templates, buffer_elements(split), driver, None
    )
    scratch = iter([7000, 9000])
    slot = handle.slot(5, lambda nbytes: (bytearray(1), next(scratch)))
    assert handle.slot(5, lambda nbytes: 1 / 0) is slot  # made once
    for call in ((11, 12, 13, 14), (21, 22, 23, 24)):
        handle.launch(slot, *call)
    buffers = DeviceBuffers(21, 22, 23, 24, 7000, 9000)
    expected = launch_sequence(split, buffers)
    assert [stream for _, stream in driver.launched] == [5] * 4
    assert [launch.values() for launch, _ in driver.launched[2:]] == [e.args for e in expected]
    alien = launches[0].__class__("tiled_attention", (1, 1, 1), (32, 1, 1), 0, (np.uintp(64),))
    with pytest.raises(BackendError, match=r"argument 0 is a pointer that is none of the buff"):
        attention_handle.launch_templates((alien,), functions)


class Recording:
    """A driver that records what it is asked to launch."""

    def __init__(self) -> None:
        self.launched: list[tuple[cuda_driver.PackedLaunch, int]] = []

    def bind_launch(self, launch: cuda_driver.PackedLaunch, stream: int) -> Any:
        def call() -> int:
            # A snapshot: the objects are rewritten by the next call.
            frozen = cuda_driver.pack_launch(
                launch.name, launch.function, launch.grid, launch.block, launch.shared_bytes,
                [cuda_driver.ctypes_argument(value) for value in launch.values()],
            )
            self.launched.append((frozen, stream))
            return 0

        return call


def test_packed_arguments_hold_the_kernels_types() -> None:
    values = (np.uintp(1 << 40), np.int32(-3), np.float32(0.125))
    arguments = [cuda_driver.ctypes_argument(value) for value in values]
    packed = cuda_driver.pack_launch("f", 1, (1, 2, 3), (32, 1, 1), 0, arguments)
    assert packed.values() == values
    assert [type(v) for v in packed.values()] == [np.uintp, np.int32, np.float32]
    assert [packed.params[i] for i in range(3)] == [ctypes_address(a) for a in arguments]
    with pytest.raises(TypeError, match=r"not packable"):
        cuda_driver.ctypes_argument(3)


def ctypes_address(argument: Any) -> int:
    return ctypes.addressof(argument)


def test_a_slot_keeps_what_its_packed_pointers_point_at() -> None:
    problem = PROBLEM
    split = plan_kernel(problem, KernelParams("tiled", **STORED), H200)
    launches = launch_sequence(split, attention_handle.BUFFER_MARKERS)
    functions = {"tiled_attention": 1, "split_merge": 2}
    templates = attention_handle.launch_templates(launches, functions)
    handle = attention_handle.AttentionHandle(
        problem,
        0,
        plan_choice.ChosenPlan(split, "default"),
        templates,
        buffer_elements(split),
        cuda_driver.CudaDriver(library=types.SimpleNamespace(cuLaunchKernel=lambda *a: 0)),
        None,
    )
    slot = handle.new_slot(0, lambda nbytes: (None, 1 << 33))
    params = [launch.params for launch in slot.packed]
    held = {ctypes.addressof(a) for launch in slot.packed for a in launch.arguments}
    pointed = {
        params[i][j] for i, launch in enumerate(slot.packed) for j in range(len(launch.arguments))
    }
    assert pointed <= held  # every address the driver reads is an object the slot holds
    slot.q.value = 4096
    del handle
    gc.collect()
    # What cuLaunchKernel would read: each void* dereferenced as the kernel's parameter type.
    read = {np.uintp: ctypes.c_void_p, np.int32: ctypes.c_int32, np.float32: ctypes.c_float}
    first = launches[0].args
    seen = [
        ctypes.cast(params[0][i], ctypes.POINTER(read[type(value)])).contents.value or 0
        for i, value in enumerate(first)
    ]
    assert seen[0] == 4096 and seen[4:6] == [1 << 33, 1 << 33]
    # seq_len .. softcap as built; the slopes, sinks and lse pointers: none given (null)
    assert seen[6:15] == pytest.approx([float(value) for value in first[6:15]])
    assert seen[15:] == [0, 0, 0]


class TensorMapLibrary:
    """libcuda's tensor-map calls as this test needs them: the 'encoding' writes the global
    address and the three dims into the map's first 32 bytes; every call is counted."""

    def __init__(self) -> None:
        self.encoded = 0
        self.replaced = 0

    def cuLaunchKernel(self, *args: Any) -> int:  # noqa: N802 - the driver's name
        return 0

    def cuTensorMapEncodeTiled(self, out, dtype, rank, address, dims, strides, box, *rest):  # noqa: N802
        self.encoded += 1
        words = (ctypes.c_uint64 * 4)(address.value or 0, *dims[: rank.value])
        ctypes.memmove(out.value, words, ctypes.sizeof(words))
        return 0

    def cuTensorMapReplaceAddress(self, tensor_map, address) -> int:  # noqa: N802
        self.replaced += 1
        ctypes.c_uint64.from_address(tensor_map.value).value = address.value or 0
        return 0


def test_tensor_map_arguments_are_encoded_once_and_follow_the_call() -> None:
    """A TMA family's maps over q, k and v: encoded once a slot, re-pointed at the call's
    buffers only when they moved, and what cuLaunchKernel reads is the re-pointed map."""
    problem = Problem(1000, 128, batch=2, heads=8, kv_heads=2, kv_len=1500, dtype="bfloat16")
    params = KernelParams("wgmma_f16", consumers=2, block_n=128, stages=2)
    plan = plan_kernel(problem, params, H200)
    assert plan.feasible, plan.reason
    launches = launch_sequence(plan, attention_handle.BUFFER_MARKERS)
    templates = attention_handle.launch_templates(launches, {"wgmma_f16_attention": 1})
    assert [t.buffer for t in templates[0].arguments[:3]] == ["q", "k", "v"]
    assert templates[0].arguments[3:7] == ("q", "k", "v", "out")
    library = TensorMapLibrary()
    handle = attention_handle.AttentionHandle(
        problem, 0, plan_choice.ChosenPlan(plan, "default"), templates,
        buffer_elements(plan), cuda_driver.CudaDriver(library=library), None,
    )
    slot = handle.new_slot(0, lambda nbytes: (None, 0))
    assert library.encoded == 3 and len(slot.tensor_maps) == 3
    (packed,) = slot.packed

    def map_read(index: int) -> list[int]:
        """The first four words of the 128 bytes the driver would copy for parameter index."""
        return list((ctypes.c_uint64 * 4).from_address(packed.params[index]))

    assert map_read(1)[1:] == [128, 1500, 4]  # k's dims: head_dim, kv_len, batch x kv heads
    handle.launch(slot, 0x10000, 0x20000, 0x30000, 0x40000)
    assert [map_read(i)[0] for i in range(3)] == [0x10000, 0x20000, 0x30000]
    assert library.replaced == 3
    handle.launch(slot, 0x10000, 0x20000, 0x30000, 0x50000)  # only out moved
    assert library.replaced == 3
    handle.launch(slot, 0x10000, 0x60000, 0x30000, 0x50000)  # k moved
    assert library.replaced == 4 and map_read(1)[0] == 0x60000
    alien = launches[0].__class__(
        "wgmma_f16_attention", (1, 1, 1), (32, 1, 1), 0,
        (dataclasses.replace(launches[0].args[0], address=64),),
    )
    with pytest.raises(BackendError, match=r"tensor map over 'q' at an address"):
        attention_handle.launch_templates((alien,), {"wgmma_f16_attention": 1})


def test_an_output_map_follows_the_call_s_output() -> None:
    """TMA stores (staged_store=2): the fourth map, over out, is re-pointed at each call's
    output as the others are at q, k and v."""
    problem = Problem(1000, 128, batch=2, heads=8, kv_heads=2, kv_len=1500, dtype="bfloat16")
    params = KernelParams("wgmma_f16", consumers=2, block_n=128, stages=2, overlap=1,
                          staged_store=2)
    plan = plan_kernel(problem, params, H200)
    assert plan.feasible, plan.reason
    launches = launch_sequence(plan, attention_handle.BUFFER_MARKERS)
    templates = attention_handle.launch_templates(launches, {"wgmma_f16_attention": 1})
    assert [t.buffer for t in templates[0].arguments[:4]] == ["q", "k", "v", "out"]
    library = TensorMapLibrary()
    handle = attention_handle.AttentionHandle(
        problem, 0, plan_choice.ChosenPlan(plan, "default"), templates,
        buffer_elements(plan), cuda_driver.CudaDriver(library=library), None,
    )
    slot = handle.new_slot(0, lambda nbytes: (None, 0))
    (packed,) = slot.packed
    assert library.encoded == 4

    def map_address(index: int) -> int:
        return (ctypes.c_uint64 * 4).from_address(packed.params[index])[0]

    handle.launch(slot, 0x10000, 0x20000, 0x30000, 0x40000)
    assert [map_address(i) for i in range(4)] == [0x10000, 0x20000, 0x30000, 0x40000]
    handle.launch(slot, 0x10000, 0x20000, 0x30000, 0x50000)  # only out moved
    assert library.replaced == 5 and map_address(3) == 0x50000
