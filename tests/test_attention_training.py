"""``kernels.attention``'s training path without a GPU: ``Attention.attention_with_lse`` and
``Attention.attention_backward`` on ``test_attention``'s fake GPU and fake torch, their
launches run by the real kernel sources on the CPU emulator (``tests/device_emulation``). What
is checked: the forward handle's LSE role, the registry's backward plan chosen for the
backward problem, its deterministic variant on request, the backward handle's buffers and
scratch from torch's allocator on the caller's stream, and the gradients against float64.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import pytest
from device_emulation import emulate
from test_attention import (  # noqa: F401 - fixtures
    FakeCudaDriver,
    FakeTensor,
    gpu,
    half_values,
    registry,
    torch_on_fake_gpu,
)

import kernels.deploy as ka
from db import PlanRecord
from kernels import build, precision
from kernels.backends import pycuda_attention
from kernels.backward_parity import BackwardReference
from tuner.planner.launches import KernelLaunch
from tuner.problem import Problem

pytestmark = pytest.mark.skipif(bool(emulate.available()), reason=emulate.available() or "ok")

PROBLEM = Problem(70, 64, batch=1, heads=4, kv_heads=2, causal=True, dtype="bfloat16", kv_len=90)
BACKWARD = dataclasses.replace(PROBLEM, direction="backward")
FORWARD_PLAN = {"block_m": 64, "block_n": 32, "warps": 4, "stages": 2, "q_in_registers": 0,
                "s_groups": 1, "split_target": 1 << 16}  # fmt: skip
BACKWARD_PLAN = {"block_m": 32, "block_n": 64, "warps": 4, "stages": 2, "q_chunk": 16,
                 "deterministic": 0, "group_split": 2}  # fmt: skip


class EmulatingDriver(FakeCudaDriver):
    """The fake driver whose launches run the kernels on the emulator over the fake GPU."""

    def get_function(self, module: int, name: str) -> int:
        defines = self.modules[module].defines
        self.functions[id(name)] = (name, defines)
        return id(name)

    def set_max_dynamic_shared(self, function: int, nbytes: int) -> None:
        pass

    def bind_launch(self, launch: Any, stream: int) -> Any:
        def call() -> int:
            name, defines = self.functions[launch.function]
            self.gpu.log.append(("launch", name, stream))
            family = "mma_f16_bwd" if name.startswith("mma_f16_bwd") else "mma_f16"
            args = launch.values()
            pointers = {int(a) for a in args if isinstance(a, np.uintp) and int(a)}
            assert pointers <= set(self.gpu.memory), f"{name}: pointers to no allocation"
            addresses = {f"b{address}": address for address in pointers}
            kernel = KernelLaunch(name, launch.grid, launch.block, launch.shared_bytes, args)
            executable = emulate.build(f"{family}_main.cpp", defines)
            buffers = {name: self.gpu.memory[address] for name, address in addresses.items()}
            done = emulate.run(executable, buffers, [kernel], addresses)
            for name, address in addresses.items():
                self.gpu.memory[address][:] = np.frombuffer(done[name], dtype=np.uint8)
            return 0

        return call


@pytest.fixture
def emulated(gpu, registry, monkeypatch):  # noqa: F811 - the imported fixtures
    driver = EmulatingDriver(gpu)
    monkeypatch.setattr(pycuda_attention, "CudaDriver", lambda: driver)
    torch = torch_on_fake_gpu(gpu, stream=5)
    torch.float32 = "float32"

    def empty(shape: Any, *, dtype: str, device: Any) -> FakeTensor:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        element = {"uint8": 1, "float32": 4}[dtype]
        allocation = gpu.driver.mem_alloc(int(np.prod(shape)) * element)
        return FakeTensor(shape, pointer=int(allocation), dtype=dtype)

    torch.empty = empty
    monkeypatch.setitem(sys.modules, "torch", torch)
    attend = ka.Attention(registry)
    environment = attend.environment()
    for problem, family, params in (
        (PROBLEM, "mma_f16", FORWARD_PLAN),
        (BACKWARD, "mma_f16_bwd", BACKWARD_PLAN),
    ):
        stored = PlanRecord(family, params, build.source_hash(family), True, median_ms=0.5)
        registry.record(problem, environment, stored)
    return attend, gpu


def tensors(fake_gpu: Any, seed: int = 0) -> tuple[list[np.ndarray], list[FakeTensor]]:
    rng = np.random.default_rng(seed)
    shapes = [(1, 4, 70, 64), (1, 2, 90, 64), (1, 2, 90, 64), (1, 4, 70, 64)]
    stored = [precision.to_storage(rng.standard_normal(s, dtype=np.float32), "bfloat16")
              for s in shapes]  # fmt: skip
    values = [precision.from_storage(x, "bfloat16") for x in stored]
    fakes = [
        FakeTensor(x.shape, dtype="bfloat16", pointer=int(fake_gpu.driver.to_device(x)),
                   requires_grad=i < 3)
        for i, x in enumerate(stored)
    ]  # fmt: skip
    return values, fakes


def test_a_training_step_runs_the_registry_plans_and_its_gradients_are_right(
    emulated, monkeypatch
) -> None:
    attend, fake_gpu = emulated
    # sys.modules holds the fake torch: the check's limits are the no-torch ones here
    monkeypatch.setattr(precision, "torch_available", lambda: False)
    values, (q, k, v, dout) = tensors(fake_gpu)
    out, lse = attend.attention_with_lse(q, k, v, True)
    assert lse.shape == (1, 4, 70) and lse.dtype == "float32"
    dq, dk, dv = attend.attention_backward(dout, q, k, v, out, lse, True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    runner = attend._runners[0]
    handle = runner.backward_handle(BACKWARD)
    assert handle.chosen.origin == "registry" and handle.plan.params.group_split == 2
    launched = [(name, stream) for _, name, stream in fake_gpu.log]
    assert launched == [
        ("mma_f16_attention", 5), ("mma_f16_bwd_preprocess", 5), ("mma_f16_bwd_attention", 5),
        ("mma_f16_bwd_dq", 5), ("mma_f16_bwd_dkv", 5),
    ]  # fmt: skip
    q3, dout3 = (x.reshape(4, 70, 64) for x in (values[0], values[3]))
    k3, v3 = (x.reshape(2, 90, 64) for x in values[1:3])
    reference = BackwardReference.compute(BACKWARD, q3, k3, v3, dout3)
    row_lse = fake_gpu.floats(lse.data_ptr(), 4 * 70)
    out_values = half_values(fake_gpu, out.data_ptr(), (4, 70, 64), fp16=False)
    forward = reference.check_forward(out_values, row_lse, precision.FALLBACK_TOLERANCE["bfloat16"])
    assert forward.ok, forward.detail
    grads = {
        name: half_values(fake_gpu, tensor.data_ptr(), tensor.shape, fp16=False).astype(np.float32)
        for name, tensor in (("dq", dq), ("dk", dk), ("dv", dv))
    }
    checked = reference.check(grads)
    assert checked.ok, checked.detail


def test_deterministic_calls_get_the_plans_deterministic_variant(emulated) -> None:
    attend, fake_gpu = emulated
    values, (q, k, v, dout) = tensors(fake_gpu, seed=1)
    out, lse = attend.attention_with_lse(q, k, v, True)
    first = attend.attention_backward(dout, q, k, v, out, lse, True, deterministic=True)
    second = attend.attention_backward(dout, q, k, v, out, lse, True, deterministic=True)
    handle = attend._runners[0].backward_handle(BACKWARD, deterministic=True)
    assert handle.plan.params.deterministic == 1 and handle.scratch.counters > 0
    assert handle is not attend._runners[0].backward_handle(BACKWARD)
    for a, b in zip(first, second, strict=True):
        size = int(np.prod(a.shape)) * 2
        memory = fake_gpu.memory
        assert bytes(memory[a.data_ptr()][:size]) == bytes(memory[b.data_ptr()][:size])


def test_a_deterministic_variant_that_cannot_run_gives_way_to_another_deterministic_plan(
    emulated, monkeypatch, caplog
) -> None:
    attend, _ = emulated
    runner = attend._runner(0)
    check = runner._check
    twin = BACKWARD_PLAN | {"deterministic": 1}

    def spills_for_the_twin(plan: Any) -> Any:
        if plan.params.tunables == {**plan.params.tunables, **twin}:
            return "compiler spills registers to local memory (32 B stores, 36 B loads)"
        return check(plan)

    monkeypatch.setattr(runner, "_check", spills_for_the_twin)
    monkeypatch.setattr(runner.chooser, "_check", spills_for_the_twin)
    handle = runner.backward_handle(BACKWARD, deterministic=True)
    tunables = handle.plan.params.tunables
    assert tunables["deterministic"] == 1 and tunables != {**tunables, **twin}
    assert "cannot run (compiler spills" in caplog.text and "serves instead" in caplog.text


def test_a_backward_call_with_a_wrong_lse_is_refused(emulated) -> None:
    attend, fake_gpu = emulated
    _, (q, k, v, dout) = tensors(fake_gpu)
    out, lse = attend.attention_with_lse(q, k, v, True)
    wrong = FakeTensor((1, 4, 71), dtype="float32", pointer=lse.data_ptr())
    with pytest.raises(ka.AttentionInputError, match=r"^lse has shape \(1, 4, 71\); expected"):
        attend.attention_backward(dout, q, k, v, out, wrong, True)
    with pytest.raises(ka.AttentionInputError, match=r"^dout has shape"):
        attend.attention_backward(k, q, k, v, out, lse, True)
