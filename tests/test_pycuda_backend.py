"""The PyCUDA backend's control flow, on a fake ``pycuda.driver`` (no GPU needed).

The fake keeps device memory in numpy arrays and runs the kernels' numpy
emulations, and it behaves like the driver where the backend depends on it:
a launch above 48 KiB of dynamic shared memory fails unless the function's
limit was raised, launch refusals and device faults raise ``Error``
subclasses with the driver's messages. This checks what the GPU tests cannot
isolate: buffers kept across candidates, NaN poisoning, the parity paths
(whole, sampled, scalar kernel), timing with L2 flushes, and each failure
becoming the right ``Failure``.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels import build
from kernels.backends.base import Failure
from kernels.backends.pycuda_backend import DeviceContextLost, PyCudaBackend, launch_refused
from kernels.build import CompiledKernel, CompileFailure, KernelSpec
from kernels.reference import _merge_splits, _online_partials, attention_reference
from tuner.device import H200
from tuner.planner.tunable import KernelParams, KernelPlan, ResourceUsage, plan_kernel
from tuner.problem import Problem

# ----------------------------------------------------------------------------- the fake driver


class FakeError(Exception):
    pass


class FakeLaunchError(FakeError):
    pass


class FakeLogicError(FakeError):
    pass


class FakeMemoryError(FakeError, MemoryError):
    pass


class Allocation:
    def __init__(self, gpu: FakeGpu, nbytes: int) -> None:
        self.address = gpu.next_address
        gpu.next_address += (nbytes + 255) // 256 * 256 + 256
        gpu.memory[self.address] = np.zeros(nbytes, dtype=np.uint8)

    def __int__(self) -> int:
        return self.address


class FakeGpu:
    """State shared by the fake module's functions; ``mode`` injects failures."""

    def __init__(self) -> None:
        self.memory: dict[int, np.ndarray] = {}
        self.next_address = 1 << 20
        self.allocations = 0
        self.flushes: list[int] = []
        self.stack_depth = 0
        self.mode = ""
        self.pending_fault = False
        self.launched: list[str] = []

    def floats(self, address: Any, count: int) -> np.ndarray:
        return self.memory[int(address)][: 4 * count].view(np.float32)


def make_driver(gpu: FakeGpu) -> types.ModuleType:
    drv = types.ModuleType("pycuda.driver")
    drv.Error, drv.LaunchError, drv.LogicError = FakeError, FakeLaunchError, FakeLogicError
    drv.MemoryError = FakeMemoryError
    attributes = {
        "MULTIPROCESSOR_COUNT": 132,
        "MAX_THREADS_PER_BLOCK": 1024,
        "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
        "MAX_BLOCKS_PER_MULTIPROCESSOR": 32,
        "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448,
        "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 233472,
        "RESERVED_SHARED_MEMORY_PER_BLOCK": 1024,
        "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536,
        "MAX_REGISTERS_PER_BLOCK": 65536,
        "WARP_SIZE": 32,
        "L2_CACHE_SIZE": 1 << 16,  # small, so the flush buffer is cheap here
    }
    drv.device_attribute = types.SimpleNamespace(**{name: name for name in attributes})
    drv.function_attribute = types.SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES="MAXDYN")

    class Context:
        def push(self) -> None:
            gpu.stack_depth += 1

        @staticmethod
        def pop() -> None:
            gpu.stack_depth -= 1

        @staticmethod
        def synchronize() -> None:
            if gpu.pending_fault:
                raise FakeLogicError(
                    "cuCtxSynchronize failed: an illegal memory access was encountered"
                )

        def detach(self) -> None:
            pass

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        @staticmethod
        def count() -> int:
            return 1

        def name(self) -> str:
            return "NVIDIA H200"

        def compute_capability(self) -> tuple[int, int]:
            return (9, 0)

        def get_attribute(self, name: str) -> int:
            return attributes[name]

        def retain_primary_context(self) -> Context:
            return Context()

    def mem_alloc(nbytes: int) -> Allocation:
        gpu.allocations += 1
        return Allocation(gpu, nbytes)

    def to_device(array: np.ndarray) -> Allocation:
        allocation = mem_alloc(array.nbytes)
        gpu.memory[allocation.address][:] = np.frombuffer(array.tobytes(), dtype=np.uint8)
        return allocation

    def memset_d32(dest: Any, value: int, count: int) -> None:
        gpu.memory[int(dest)][: 4 * count].view(np.uint32)[:] = value

    def memset_d8_async(dest: Any, value: int, count: int) -> None:
        gpu.memory[int(dest)][:count] = value
        gpu.flushes.append(count)

    def memcpy_dtoh(host: np.ndarray, source: Any) -> None:
        host.view(np.uint8).reshape(-1)[:] = gpu.memory[int(source)][: host.nbytes]

    class Event:
        ticks = 0

        def record(self) -> None:
            Event.ticks += 1
            self.at = Event.ticks

        def synchronize(self) -> None:
            Context.synchronize()

        def time_since(self, start: Event) -> float:
            return 0.25 * (self.at - start.at)

    class Function:
        def __init__(self, name: str, defines: dict[str, int]) -> None:
            self.name, self.defines, self.max_dynamic = name, defines, 48 * 1024

        def set_attribute(self, attribute: str, value: int) -> None:
            assert attribute == "MAXDYN"
            self.max_dynamic = value

        def __call__(self, *args: Any, grid: tuple, block: tuple, shared: int) -> None:
            if gpu.mode == "refuse":
                raise FakeLaunchError(
                    "cuLaunchKernel failed: too many resources requested for launch"
                )
            if shared > self.max_dynamic:
                raise FakeLogicError("cuLaunchKernel failed: invalid argument")
            threads = 128 if self.name == "split_merge" else self.defines["THREADS"]
            assert block == (threads, 1, 1)
            gpu.launched.append(self.name)
            KERNELS[self.name](gpu, self.defines, grid, *args)

    class Module:
        def __init__(self, defines: dict[str, int]) -> None:
            self.defines = defines

        def get_function(self, name: str) -> Function:
            return Function(name, self.defines)

    def module_from_buffer(cubin: bytes) -> Module:
        return Module(json.loads(cubin)["defines"])

    drv.init = lambda: None
    drv.get_driver_version = lambda: 13000
    drv.Device, drv.Context, drv.Event = Device, Context, Event
    drv.mem_alloc, drv.to_device, drv.memset_d32 = mem_alloc, to_device, memset_d32
    drv.memset_d8_async, drv.memcpy_dtoh = memset_d8_async, memcpy_dtoh
    drv.module_from_buffer = module_from_buffer
    return drv


def _tensors(gpu: FakeGpu, defines: dict[str, int], bh: int, n: int, *addresses: Any):
    d = defines["HEAD_DIM"]
    return [gpu.floats(a, bh * n * d).reshape(bh, n, d) for a in addresses]


def fake_tiled(
    gpu, defines, grid, q, k, v, out, po, plse, seq_len, kv_len, group, keys_per_split, scale,
    heads, window_left, window_right, softcap, alibi_slopes, sinks, lse,
):
    assert (int(kv_len), int(group)) == (int(seq_len), 1)  # the fakes do self-attention
    n, splits, bh, d = int(seq_len), grid[1], grid[2], defines["HEAD_DIM"]
    assert grid[0] == -(-n // defines["ROWS_PER_BLOCK"])
    q3, k3, v3, o3 = _tensors(gpu, defines, bh, n, q, k, v, out)
    causal = bool(defines["CAUSAL"])
    parts = [
        _online_partials(
            q3 * np.float32(scale),
            k3,
            v3,
            causal,
            key_begin=s * int(keys_per_split),
            key_end=min(n, (s + 1) * int(keys_per_split)),
            tile_size=defines["TILE_SIZE"],
        )
        for s in range(splits)
    ]
    if splits == 1:
        row_max, row_sum, acc = parts[0]
        result = acc / row_sum[..., None]
        if gpu.mode == "skip_last_row":
            result = result[:, :-1]
        if gpu.mode == "off_by":
            result = result.copy()
            result[-1, n // 2 + 1, 0] += 2e-3  # a row the sampled check may miss
        o3[:, : result.shape[1]] = result
        if gpu.mode == "fault":
            gpu.pending_fault = True
        return
    # The shared merge's contract: outputs normalised per split, and their log2-sum-exps.
    po4 = gpu.floats(po, bh * splits * n * d).reshape(bh, splits, n, d)
    lse3 = gpu.floats(plse, bh * splits * n).reshape(bh, splits, n)
    with np.errstate(divide="ignore", invalid="ignore"):
        for s, (row_max, row_sum, acc) in enumerate(parts):
            seen = row_sum > 0
            po4[:, s] = np.where(seen[..., None], acc / np.where(seen, row_sum, 1)[..., None], 0)
            lse3[:, s] = np.where(seen, row_max + np.log2(np.where(seen, row_sum, 1)), -np.inf)


def fake_merge(
    gpu, defines, grid, po, plse, out, seq_len, splits, total_rows, heads, sinks, lse
):
    n, s, d = int(seq_len), int(splits), defines["HEAD_DIM"]
    bh = int(total_rows) // n
    po4 = gpu.floats(po, bh * s * n * d).reshape(bh, s, n, d)
    lse3 = gpu.floats(plse, bh * s * n).reshape(bh, s, n)
    # Each split's sum is 2^lse at max 0: the (max, sum) merge of the seed's reduction.
    merged = _merge_splits(
        np.zeros_like(lse3).transpose(1, 0, 2),
        np.exp2(lse3).transpose(1, 0, 2),
        (po4 * np.exp2(lse3)[..., None]).transpose(1, 0, 2, 3),
    )
    (o3,) = _tensors(gpu, defines, bh, n, out)
    o3[:] = merged


def fake_scalar(gpu, defines, grid, q, k, v, out, seq_len, kv_len, group, scale):
    assert (int(kv_len), int(group)) == (int(seq_len), 1)  # the fakes do self-attention
    n, bh = int(seq_len), grid[2]
    q3, k3, v3, o3 = _tensors(gpu, defines, bh, n, q, k, v, out)
    o3[:] = attention_reference(q3, k3, v3, bool(defines["CAUSAL"]))


KERNELS: dict[str, Callable[..., None]] = {
    "tiled_attention": fake_tiled,
    "split_merge": fake_merge,
    "scalar_online_attention": fake_scalar,
}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    state = FakeGpu()
    package = types.ModuleType("pycuda")
    package.VERSION_TEXT = "2026.1"
    package.driver = make_driver(state)
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.setitem(sys.modules, "pycuda.driver", package.driver)
    compiled: list[str] = []

    def fake_compile(variant, cache_dir, arch="sm_90"):
        spec = variant if isinstance(variant, KernelSpec) else KernelSpec.from_plan(variant)
        compiled.append(spec.key)
        if dict(spec.defines).get("TILE_SIZE") == 8:
            return CompileFailure(spec, "tiled.cu(42): error: static assertion failed", "...")
        cubin = json.dumps({"defines": dict(spec.defines)}).encode()
        # 300 registers (over the 255 limit) for one marked variant.
        usage = ResourceUsage(registers=300 if dict(spec.defines).get("TILE_SIZE") == 128 else 64)
        resources = {name: usage for name in build.ENTRY_FUNCTIONS[spec.family]}
        return CompiledKernel(spec, Path("fake.cubin"), cubin, resources, "hash", arch, "13.0.88")

    monkeypatch.setattr(build, "compile_kernel", fake_compile)
    state.compiled = compiled
    return state


def backend(**overrides: Any) -> PyCudaBackend:
    options = {"cache_dir": "unused", "repetitions": 5, "warmup": 2} | overrides
    return PyCudaBackend(**options)


def tiled(problem: Problem, tile: int, rows: int, threads: int, target: int) -> KernelPlan:
    params = KernelParams(
        "tiled", threads=threads, tile_size=tile, rows_per_block=rows, split_target=target
    )
    return plan_kernel(problem, params, H200)


# ----------------------------------------------------------------------------- tests


def test_a_correct_plan_is_measured(gpu: FakeGpu) -> None:
    problem = Problem(100, 32, batch=2, heads=3, causal=True)
    plan = tiled(problem, 16, 32, 64, 2)
    assert plan.sequence_splits > 1
    result = backend().measure(plan, problem)
    assert result.ok, result.detail
    assert result.measured and result.failure is None
    assert result.max_abs_error is not None and result.max_abs_error < 1e-5
    assert result.repetitions == 5 and len(result.samples_ms) == 5
    assert result.median_ms == pytest.approx(0.25) and result.spread_ms == 0
    assert result.tflops and result.gbps
    assert gpu.flushes == [2 * (1 << 16)] * 7  # warm-up and timed runs, 2x L2 each
    assert gpu.stack_depth == 0
    assert gpu.launched[:2] == ["tiled_attention", "split_merge"]


def test_buffers_and_modules_are_kept_across_candidates(gpu: FakeGpu) -> None:
    problem = Problem(64, 32, heads=2)
    measuring = backend(flush_l2=False)
    first = tiled(problem, 16, 16, 64, 1)
    assert measuring.measure(first, problem).ok
    allocations = gpu.allocations
    assert measuring.measure(tiled(problem, 32, 16, 64, 2**16), problem).ok
    assert measuring.measure(first, problem).ok
    assert gpu.allocations == allocations  # same problem: no new device buffers
    assert measuring.measure(tiled(Problem(64, 64), 16, 16, 64, 1), Problem(64, 64)).ok
    assert gpu.allocations > allocations  # a new problem gets its own


def test_shared_memory_above_48k_is_opted_in(gpu: FakeGpu) -> None:
    problem = Problem(1024, 128)
    plan = tiled(problem, 64, 64, 256, 4)
    assert plan.launch.shared_bytes > 48 * 1024
    assert backend().measure(plan, problem).ok


def test_an_unwritten_row_is_a_wrong_answer(gpu: FakeGpu) -> None:
    problem = Problem(50, 32, heads=2)
    gpu.mode = "skip_last_row"
    result = backend().measure(tiled(problem, 16, 16, 64, 2**16), problem)
    assert result.failure is Failure.WRONG_ANSWER
    assert "non-finite" in result.detail and result.median_ms is None


def test_an_error_above_tolerance_is_a_wrong_answer_with_its_size(gpu: FakeGpu) -> None:
    problem = Problem(50, 32, heads=2)
    gpu.mode = "off_by"
    result = backend().measure(tiled(problem, 16, 16, 64, 2**16), problem)
    assert result.failure is Failure.WRONG_ANSWER
    assert result.max_abs_error == pytest.approx(2e-3, rel=0.05)


def test_large_problems_are_also_checked_against_the_scalar_kernel(gpu: FakeGpu) -> None:
    problem = Problem(2048, 64, heads=2)  # above the whole-check limit: sampled on the CPU
    plan = tiled(problem, 64, 64, 128, 2**16)
    measuring = backend()
    assert measuring.measure(plan, problem).ok
    assert "scalar_online_attention" in gpu.launched
    # Row n/2 + 1 of the last head is wrong: the scalar comparison sees it even
    # where the sampled CPU rows do not.
    gpu.mode = "off_by"
    result = measuring.measure(plan, problem)
    assert result.failure is Failure.WRONG_ANSWER
    assert gpu.launched.count("scalar_online_attention") == 1  # computed once per problem


def test_a_refused_launch_is_a_resources_failure(gpu: FakeGpu) -> None:
    problem = Problem(64, 32)
    gpu.mode = "refuse"
    measuring = backend()
    result = measuring.measure(tiled(problem, 16, 16, 64, 1), problem)
    assert result.failure is Failure.RESOURCES and "too many resources" in result.detail
    assert not measuring.context_lost and gpu.stack_depth == 0


def test_a_device_fault_loses_the_context_for_good(gpu: FakeGpu) -> None:
    problem = Problem(64, 32)
    gpu.mode = "fault"
    measuring = backend()
    result = measuring.measure(tiled(problem, 16, 16, 64, 2**16), problem)
    assert result.failure is Failure.RUNTIME_DEVICE and "illegal memory access" in result.detail
    assert measuring.context_lost and gpu.stack_depth == 0
    with pytest.raises(DeviceContextLost, match="illegal memory access"):
        measuring.measure(tiled(problem, 16, 16, 64, 2**16), problem)


def test_compile_errors_and_infeasible_plans_never_launch(gpu: FakeGpu) -> None:
    problem = Problem(64, 32)
    measuring = backend()
    failed = measuring.measure(tiled(problem, 8, 16, 64, 1), problem)
    assert failed.failure is Failure.COMPILE and not failed.measured
    assert "static assertion" in failed.detail
    too_big = tiled(Problem(4096, 128), 128, 128, 64, 1)
    assert not too_big.feasible
    verdict = measuring.measure(too_big, Problem(4096, 128))
    assert verdict.failure is Failure.INFEASIBLE and verdict.detail == too_big.reason
    # ptxas's report (300 registers here) makes a planner-feasible plan infeasible.
    marked = tiled(Problem(512, 32), 128, 32, 128, 1)
    assert marked.feasible
    registers = measuring.measure(marked, Problem(512, 32))
    assert registers.failure is Failure.INFEASIBLE and "registers" in registers.detail
    assert gpu.launched == []


def test_a_plan_for_another_problem_is_a_caller_error(gpu: FakeGpu) -> None:
    with pytest.raises(ValueError, match="planned for"):
        backend().measure(tiled(Problem(64, 32), 16, 16, 64, 1), Problem(65, 32))


def test_profile_and_environment_come_from_the_device(gpu: FakeGpu) -> None:
    measuring = backend()
    profile = measuring.device_profile()
    assert profile.l2_bytes == 1 << 16 and profile.sm_count == 132
    assert profile.peak_fp32_tflops == H200.peak_fp32_tflops  # a known GPU keeps its ceilings
    environment = measuring.environment()
    assert environment["gpu_name"] == "NVIDIA H200"
    assert environment["compute_capability"] == "9.0"
    assert environment["cuda_version"] == "13.0"
    assert environment["pycuda_version"] == "2026.1"
    assert set(environment) >= {"sm_count", "driver_version", "nvcc_version"}


def test_launch_refusals_are_told_from_faults_by_the_drivers_message() -> None:
    assert launch_refused("cuLaunchKernel failed: too many resources requested for launch")
    assert launch_refused("cuLaunchKernel failed: invalid argument")
    assert not launch_refused("cuCtxSynchronize failed: an illegal memory access was encountered")
    assert not launch_refused("cuLaunchKernel failed: unspecified launch failure")


def test_inputs_and_a_single_output_for_peers(gpu: FakeGpu) -> None:
    problem = Problem(40, 16, batch=2, heads=1, causal=True)
    measuring = backend()
    q, k, v = measuring.inputs(problem)
    assert q.shape == (2, 40, 16) and q.dtype == np.float32
    assert q.std() > 0.5  # random normal, never zeros
    again = measuring.inputs(problem)[0]
    assert again is q  # the same arrays every candidate runs on
    out = measuring.output(tiled(problem, 16, 16, 64, 1), problem)
    np.testing.assert_allclose(out, attention_reference(q, k, v, True), atol=1e-5)
    assert gpu.flushes == []  # no timing
