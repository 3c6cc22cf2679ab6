"""The GPU backend's backward trial without a GPU: ``PyCudaBackend.measure`` of a backward plan
on a fake ``pycuda.driver`` (``test_pycuda_backend``'s) whose kernel launches run the real
kernel sources on the CPU emulator (``tests/device_emulation``). What is checked: the forward
run once with its LSE and timed, the backward's buffers and scratch, the poisoning, the
gradient check and its verdicts, the timing of the backward alone.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from device_emulation import emulate
from test_pycuda_backend import FakeGpu, make_driver

from kernels import build
from kernels.backends import pycuda_backward
from kernels.backends.base import Failure
from kernels.backends.pycuda_backend import PyCudaBackend
from kernels.build import CompiledKernel, KernelSpec
from tuner.device import H200
from tuner.planner.launches import KernelLaunch
from tuner.planner.space import CandidateSpace
from tuner.planner.tunable import KernelParams, ResourceUsage, plan_kernel
from tuner.problem import Problem

pytestmark = pytest.mark.skipif(bool(emulate.available()), reason=emulate.available() or "ok")

PROBLEM = Problem(70, 64, heads=2, kv_heads=1, causal=True, dtype="bfloat16", kv_len=90,
                  direction="backward")  # fmt: skip
PARAMS = {"block_m": 32, "block_n": 64, "warps": 4, "q_chunk": 16, "deterministic": 1}


def emulated_driver(gpu: FakeGpu, skipped: set[str]) -> types.ModuleType:
    """The fake driver, its launches run on the emulator over the fake GPU's memory."""
    drv = make_driver(gpu)

    def memset_d16(dest: Any, value: int, count: int) -> None:
        gpu.memory[int(dest)][: 2 * count].view(np.uint16)[:] = value

    class Function:
        def __init__(self, name: str, family: str, defines: dict[str, int]) -> None:
            self.name, self.family, self.defines = name, family, defines

        def set_attribute(self, attribute: str, value: int) -> None:
            pass

        def __call__(self, *args: Any, grid: tuple, block: tuple, shared: int) -> None:
            gpu.launched.append(self.name)
            if self.name in skipped:
                return
            pointers = {int(a) for a in args if isinstance(a, np.uintp) and int(a)}
            unknown = pointers - set(gpu.memory)
            assert not unknown, f"{self.name} gets pointers to no allocation: {unknown}"
            addresses = {f"b{address}": address for address in pointers}
            executable = emulate.build(f"{self.family}_main.cpp", self.defines)
            launch = KernelLaunch(self.name, grid, block, shared, args)
            buffers = {name: gpu.memory[address] for name, address in addresses.items()}
            done = emulate.run(executable, buffers, [launch], addresses)
            for name, address in addresses.items():
                gpu.memory[address][:] = np.frombuffer(done[name], dtype=np.uint8)

    class Module:
        def __init__(self, family: str, defines: dict[str, int]) -> None:
            self.family, self.defines = family, defines

        def get_function(self, name: str) -> Function:
            return Function(name, self.family, self.defines)

    def module_from_buffer(cubin: bytes) -> Module:
        spec = json.loads(cubin)
        return Module(spec["family"], spec["defines"])

    drv.memset_d16 = memset_d16
    drv.module_from_buffer = module_from_buffer
    return drv


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeGpu, set[str]]:
    gpu, skipped = FakeGpu(), set()
    package = types.ModuleType("pycuda")
    package.VERSION_TEXT = "2026.1"
    package.driver = emulated_driver(gpu, skipped)
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.setitem(sys.modules, "pycuda.driver", package.driver)

    def fake_compile(variant: Any, cache_dir: Any, arch: str = "sm_90") -> CompiledKernel:
        spec = variant if isinstance(variant, KernelSpec) else KernelSpec.from_plan(variant)
        cubin = json.dumps({"family": spec.family, "defines": dict(spec.defines)}).encode()
        resources = {name: ResourceUsage(64) for name in build.ENTRY_FUNCTIONS[spec.family]}
        return CompiledKernel(spec, Path("fake.cubin"), cubin, resources, "hash", arch, "13.0.88")

    monkeypatch.setattr(build, "compile_kernel", fake_compile)
    space = pycuda_backward.candidate_space

    def small_forward(problem: Problem, device: Any) -> CandidateSpace:
        # A forward the emulator runs quickly (and no TMA): one mma_f16 plan.
        chosen = "mma_f16/m64/n32/w4/st2/qsmem/g1/s1"
        feasible = [p for p in space(problem, device).feasible if p.key() == chosen]
        return CandidateSpace(tuple(feasible), ())

    monkeypatch.setattr(pycuda_backward, "candidate_space", small_forward)
    return gpu, skipped


def measure(**params: int) -> Any:
    plan = plan_kernel(PROBLEM, KernelParams("mma_f16_bwd", **(PARAMS | params)), H200)
    assert plan.feasible, plan.reason
    backend = PyCudaBackend(cache_dir="unused", repetitions=1, warmup=0, flush_l2=False)
    return backend.measure(plan, PROBLEM)


def test_a_correct_backward_plan_is_measured_with_its_forward(emulated) -> None:
    gpu, _ = emulated
    measured = measure()
    assert measured.ok, measured.detail
    assert measured.measured and measured.median_ms is not None and measured.forward_ms
    assert "dq" in measured.detail and "dk" in measured.detail and "dv" in measured.detail
    assert "forward mma_f16/m64/n32/w4" in measured.detail
    forward = [name for name in gpu.launched if name == "mma_f16_attention"]
    backward = ["mma_f16_bwd_preprocess", "mma_f16_bwd_attention", "mma_f16_bwd_dq"]
    assert len(forward) == 2  # the checked run and one timed repetition
    assert [name for name in gpu.launched if name != "mma_f16_attention"] == backward * 2


def test_an_unwritten_gradient_is_a_wrong_answer_naming_it(emulated) -> None:
    _, skipped = emulated
    skipped.add("mma_f16_bwd_dq")  # the dQ cast never runs: dq keeps its NaN poison
    measured = measure(deterministic=0)
    assert measured.failure is Failure.WRONG_ANSWER
    assert measured.detail.startswith("dq: ") and "non-finite" in measured.detail
