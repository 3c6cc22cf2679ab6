"""``kernels.attention`` without a GPU: argument checks, plan choice, handles and their caches,
and the launch path on the fake PyCUDA driver of ``test_pycuda_backend`` with a fake
``kernels.cuda_driver`` (numpy emulations of the kernels run on the packed arguments).

Argument checks use small fakes exposing ``__cuda_array_interface__`` and a fake ``torch``
module; a test that reaches CUDA where it should not fails with ``ReachedCuda``.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_pycuda_backend import FakeGpu, make_driver

import kernels.deploy as ka
from db import PlanRecord, PlanRegistry, default_registry_url
from kernels import attention_args, build, cuda_driver, plan_choice
from kernels.backends import pycuda_attention
from kernels.bfloat16 import from_bfloat16, to_bfloat16
from kernels.build import CompiledKernel, KernelSpec
from kernels.launch import buffer_elements
from kernels.reference import attention_reference
from tuner.costmodel import predict_time_ms
from tuner.data_dir import DATA_DIR_VARIABLE
from tuner.device import H200
from tuner.environment import Environment
from tuner.errors import BackendError, TunerError
from tuner.planner.families import families_for
from tuner.planner.space import candidate_space
from tuner.planner.tunable import KernelParams, ResourceUsage
from tuner.problem import Problem

ENV = Environment("NVIDIA H200", "9.0", 132, "580.159.04", "13.0", "13.0.88", "2026.1")
HASHES = {"tiled": "t" * 64, "scalar_online": "s" * 64, "mma_f16": "m" * 64}
#: the family of the cost model's best half-precision plan for PROBLEM on the H200 profile:
#: the Hopper family (head_dim 64 and 128 on sm_90; smaller head dims fall to mma_f16)
HALF_DEFAULT_FAMILY = "wgmma_f16"
SHAPE = (2, 4, 64, 32)
PROBLEM = Problem(1000, 64, batch=2, heads=4, causal=True)
STORED = {"threads": 128, "tile_size": 32, "rows_per_block": 32, "split_target": 4}
#: an mma_f16 plan unlike the default one: 8 key splits on PROBLEM
HALF_STORED = {
    "block_m": 64,
    "block_n": 32,
    "warps": 4,
    "stages": 2,
    "q_in_registers": 0,
    "s_groups": 1,
    "split_target": 4,
}


class ReachedCuda(Exception):
    pass


class FakeArray:
    """A device array as the CUDA Array Interface describes it; nothing behind the pointer."""

    _next = 1 << 32

    def __init__(self, shape: tuple[int, ...] = SHAPE, pointer: int | None = None, **fields: Any):
        if pointer is None:
            pointer = FakeArray._next
            FakeArray._next += 1 << 28  # far apart: fakes never overlap by accident
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": "<f4",
            "data": (pointer, fields.pop("readonly", False)),
            "version": 3,
            "strides": None,
        } | fields


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def reached(*args: Any, **kwargs: Any) -> Any:
        raise ReachedCuda

    monkeypatch.setattr(ka, "interface_device", reached)
    monkeypatch.setattr(ka.Attention, "_runner", reached)


def test_importing_kernels_loads_no_pycuda_torch_or_database() -> None:
    code = (
        "import sys, kernels\n"
        "heavy = lambda: [m for m in ('pycuda', 'torch', 'sqlalchemy') if m in sys.modules]\n"
        "assert not heavy(), heavy()\n"
        "assert callable(kernels.attention) and kernels.Attention.__name__ == 'Attention'\n"
        "import kernels.deploy\n"
        "from kernels import attention, Attention\n"
        "from kernels.backends import attention_handle\n"
        "assert not heavy(), heavy()\n"
        "print('clean')\n"
    )
    root = Path(build.__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "clean"


def pycuda_imports(source: str) -> list[str]:
    """The pycuda modules a source file imports: import statements, wherever they are (a lazy
    import inside a function counts), and ``importlib.import_module``/``__import__`` calls.

    Parsed, not grepped: a program held in a string (the CUDA probe ``kernels.backends`` runs in
    a subprocess) imports nothing into this process.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else ""
            name = function.id if isinstance(function, ast.Name) else name
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append(node.args[0].value)
    return [name for name in found if name == "pycuda" or name.startswith("pycuda.")]


def test_only_the_pycuda_backend_modules_import_pycuda() -> None:
    # DESIGN: nothing outside kernels/backends/pycuda* imports pycuda.
    root = Path(build.__file__).resolve().parents[1]
    importers = {
        path.relative_to(root).as_posix()
        for package in ("kernels", "tuner")
        for path in sorted((root / package).rglob("*.py"))
        if pycuda_imports(path.read_text(encoding="utf-8"))
    }
    assert "kernels/backends/pycuda_backend.py" in importers  # the check sees lazy imports
    assert "kernels/backends/pycuda_attention.py" in importers
    outside = sorted(p for p in importers if not re.fullmatch(r"kernels/backends/pycuda\w*\.py", p))
    assert outside == []
    probe = "x = 'import pycuda.driver'\nimportlib.import_module('pycuda.gpuarray')\n"
    assert pycuda_imports(probe) == ["pycuda.gpuarray"]


def test_kernels_attention_is_a_plain_function_and_attention_a_class() -> None:
    import kernels

    assert kernels.attention is ka.attention and kernels.Attention is ka.Attention
    assert isinstance(kernels.attention, types.FunctionType)
    assert isinstance(kernels.Attention, type)
    assert "kernels.attention" not in sys.modules  # no module of that name shadows it


# ------------------------------------------------------------------------ argument checks


def strided(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    c_order = attention_args._c_strides(tuple(shape[i] for i in order))
    strides = [0] * len(shape)
    for position, axis in enumerate(order):
        strides[axis] = c_order[position]
    return tuple(strides)


def numpy_q() -> Any:
    return np.zeros(SHAPE, np.float32)


BAD_ARRAYS = {
    "rank": (lambda: [FakeArray((4, 64, 32))], ka.AttentionInputError, r"q has 3 dimensions"),
    # k may be shorter (a KV cache) or have fewer heads (GQA), never another head_dim
    "shapes": (
        lambda: [FakeArray(), FakeArray((2, 4, 64, 16))],
        ka.AttentionInputError,
        r"k has shape \(2, 4, 64, 16\) but q has shape \(2, 4, 64, 32\)",
    ),
    "dtype": (
        lambda: [FakeArray(), FakeArray(), FakeArray(typestr="<f2")],
        TypeError,
        r"^v has dtype float16 but q has dtype float32; q, k and v must share one dtype$",
    ),
    "dtype-k": (
        lambda: [FakeArray(typestr="<f2"), FakeArray()],
        TypeError,
        r"^k has dtype float32 but q has dtype float16; q, k and v must share one dtype$",
    ),
    "double": (
        lambda: [FakeArray(typestr="<f8")],
        TypeError,
        r"q has dtype float64 \(typestr '<f8'\); expected one of float32 \('<f4'\), float16 "
        r"\('<f2'\); bfloat16 as torch tensors",
    ),
    "bf16-void": (
        lambda: [FakeArray(typestr="<V2")] * 3,
        TypeError,
        r"q has typestr '<V2': 2-byte elements that are not float16 \(bfloat16 bit patterns\?\)"
        r".*pass bfloat16 as torch.bfloat16 tensors",
    ),
    "bf16-bits": (lambda: [FakeArray(typestr="<u2")], TypeError, r"q has typestr '<u2': 2-byte"),
    "big-endian": (lambda: [FakeArray(typestr=">f4")], TypeError, r"typestr '>f4'"),
    "transposed": (
        lambda: [FakeArray(strides=strided(SHAPE, (0, 1, 3, 2)))],
        ka.AttentionInputError,
        r"q is not C-contiguous \(shape \(2, 4, 64, 32\), strides \(32768, 8192, 4, 256\)",
    ),
    "host numpy": (lambda: [numpy_q()], TypeError, r"q is a numpy.ndarray in host memory"),
    "not an array": (lambda: [[1.0]], TypeError, r"q is a builtins.list; expected a device"),
    "empty": (lambda: [FakeArray((2, 4, 0, 32))], ka.AttentionInputError, r"empty dimension"),
    "null": (lambda: [FakeArray(pointer=0)], ka.AttentionInputError, r"q has a null data"),
    "malformed": (lambda: [FakeArray(data=None)], TypeError, r"q's __cuda_array_interface__ is"),
    "masked": (lambda: [FakeArray(mask=object())], ka.AttentionInputError, r"q has a mask"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARRAYS))
def test_bad_arrays_are_refused_before_any_cuda_call(case: str, no_cuda: None) -> None:
    build_arrays, error, message = BAD_ARRAYS[case]
    arrays = build_arrays()
    arrays += [FakeArray() for _ in range(3 - len(arrays))]
    with pytest.raises(error, match=message) as raised:
        ka.attention(*arrays)
    assert isinstance(raised.value, TunerError) and isinstance(raised.value, ValueError)
    assert "\n" not in str(raised.value)


def test_bad_out_and_causal_are_refused(no_cuda: None) -> None:
    q, k, v = FakeArray(), FakeArray(), FakeArray()
    cases = [
        ({"out": FakeArray((2, 4, 64, 16))}, r"out has shape \(2, 4, 64, 16\) but q has shape"),
        ({"out": FakeArray(readonly=True)}, r"out is read-only"),
        ({"out": FakeArray(pointer=q.__cuda_array_interface__["data"][0] + 64)}, "overlaps q"),
        ({"out": numpy_q()}, r"out is a numpy.ndarray in host memory"),
        (
            {"out": FakeArray(typestr="<f2")},
            r"^out has dtype float16 but q has dtype float32; out must have q's dtype$",
        ),
        ({"causal": "yes"}, r"causal must be a bool, got 'yes'"),
    ]
    for arguments, message in cases:
        with pytest.raises(ka.AttentionInputError, match=message):
            ka.attention(q, k, v, **arguments)


def test_good_arrays_pass_the_checks(no_cuda: None) -> None:
    size_one_axis = (2, 1, 64, 32)  # a size-1 axis may have any stride
    odd = FakeArray(size_one_axis, strides=(8192, 12345, 128, 4))
    for shape, arrays in [
        (SHAPE, [FakeArray() for _ in range(3)]),
        (size_one_axis, [odd, FakeArray(size_one_axis), odd]),
    ]:
        with pytest.raises(ReachedCuda):
            ka.attention(*arrays, causal=np.bool_(True), out=FakeArray(shape))


def test_float16_interface_arrays_pass_the_checks_with_two_byte_strides(no_cuda: None) -> None:
    half = lambda **fields: FakeArray(typestr="<f2", **fields)  # noqa: E731
    inputs = attention_args.check_inputs(half(), half(), half(), half())
    assert [array.dtype for array in inputs.arrays] == ["float16"] * 4
    assert inputs.q.nbytes == 2 * 64 * 32 * 2 * 4
    c_order = attention_args._c_strides(SHAPE, 2)
    assert c_order == (16384, 4096, 64, 2)
    with pytest.raises(ReachedCuda):
        ka.attention(half(strides=c_order), half(), half(), out=half(strides=c_order))
    with pytest.raises(ka.AttentionInputError, match=r"q is not C-contiguous .*C order is \(16384"):
        ka.attention(half(strides=attention_args._c_strides(SHAPE, 4)), half(), half())
    # out right after q: apart for 2-byte elements (it would overlap float32 ones)
    q = half()
    after = q.__cuda_array_interface__["data"][0] + inputs.q.nbytes
    with pytest.raises(ReachedCuda):
        ka.attention(q, half(), half(), out=half(pointer=after))


# a fake torch: just what kernels.attention touches before CUDA


class FakeTensor:
    def __init__(self, shape=SHAPE, *, device="cuda", index=0, dtype="float32", **flags: Any):
        self.shape, self.dtype = shape, dtype
        self.device = types.SimpleNamespace(type=device, index=index)
        self._contiguous = flags.get("contiguous", True)
        self.requires_grad = flags.get("requires_grad", False)
        self.pointer = flags.get("pointer", 1 << 40)

    def __str__(self) -> str:
        return "tensor"

    def is_contiguous(self) -> bool:
        return self._contiguous

    def stride(self) -> tuple[int, ...]:
        return (1, 2, 3, 4)

    def data_ptr(self) -> int:
        return self.pointer

    def get_device(self) -> int:
        return self.device.index if self.device.type == "cuda" else -1


def fake_torch_module() -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.Tensor, torch.float32 = FakeTensor, "float32"
    torch.bfloat16, torch.float16 = "bfloat16", "float16"
    torch.is_grad_enabled = lambda: True
    torch.compiler = types.SimpleNamespace(is_compiling=lambda: False)
    return torch


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    torch = fake_torch_module()
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


def tensors(*changed: FakeTensor) -> list[FakeTensor]:
    base = [FakeTensor(pointer=(1 << 40) + i * (1 << 30)) for i in range(3)]
    return [*changed, *base[len(changed) :]]


BAD_TENSORS = {
    "cpu": (
        lambda: tensors(FakeTensor(device="cpu")),
        r"q is a torch tensor on .*; expected a CUDA",
    ),
    "dtype": (
        lambda: tensors(FakeTensor(), FakeTensor(dtype="float16")),
        r"^k has dtype float16 but q has dtype float32; q, k and v must share one dtype$",
    ),
    "dtype-v": (
        lambda: tensors(FakeTensor(dtype="bfloat16"), FakeTensor(dtype="bfloat16")),
        r"^v has dtype float32 but q has dtype bfloat16; q, k and v must share one dtype$",
    ),
    "unsupported": (
        lambda: tensors(*[FakeTensor(dtype="float64") for _ in range(3)]),
        r"^q has dtype float64; expected one of torch.bfloat16, torch.float16, torch.float32$",
    ),
    "int8": (
        lambda: tensors(FakeTensor(), FakeTensor(dtype="int8")),
        r"^k has dtype int8; expected one of torch.bfloat16",
    ),
    "devices": (
        lambda: tensors(FakeTensor(), FakeTensor(index=1, pointer=1 << 50)),
        r"k is on cuda:1 but q is on cuda:0",
    ),
    "strides": (lambda: tensors(FakeTensor(contiguous=False)), r"q is not C-contiguous"),
    "grad": (
        lambda: tensors(FakeTensor(requires_grad=True)),
        r"^q requires grad, but kernels.attention differentiates only torch bfloat16 and "
        r"float16 calls without out= \(the dtypes a backward family takes; this one is float32\)",
    ),

    "rank": (lambda: tensors(FakeTensor((64, 32))), r"q has 2 dimensions"),
    "mixed": (lambda: [FakeTensor(), FakeArray(), FakeArray()], r"k is a device array .* q is"),
}


@pytest.mark.parametrize("case", sorted(BAD_TENSORS))
def test_bad_torch_tensors_are_refused(case: str, fake_torch: Any, no_cuda: None) -> None:
    build_arrays, message = BAD_TENSORS[case]
    with pytest.raises(ka.AttentionInputError, match=message):
        ka.attention(*build_arrays())


def test_a_differentiable_dtype_with_out_is_refused(fake_torch: Any, no_cuda: None) -> None:
    """bfloat16 calls train (``test_torch_training``), but not into a given ``out``."""
    q, k, v, out = (
        FakeTensor(dtype="bfloat16", pointer=(1 << 40) + i * (1 << 30), requires_grad=i == 0)
        for i in range(4)
    )
    with pytest.raises(
        ka.AttentionInputError,
        match=r"^q requires grad, but kernels.attention differentiates only .* without out=",
    ):
        ka.attention(q, k, v, out=out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_torch_tensors_of_each_dtype_pass_the_checks(fake_torch: Any, dtype: str) -> None:
    half = [FakeTensor(dtype=dtype, pointer=(1 << 40) + i * (1 << 30)) for i in range(4)]
    inputs = attention_args.check_inputs(*half)
    assert {array.dtype for array in inputs.arrays} == {dtype}
    assert inputs.q.nbytes == 2 * 4 * 64 * 32 * (4 if dtype == "float32" else 2)


def test_a_torch_out_of_another_dtype_is_refused(fake_torch: Any, no_cuda: None) -> None:
    q, k, v = (FakeTensor(dtype="bfloat16", pointer=(1 << 40) + i * (1 << 30)) for i in range(3))
    out = FakeTensor(dtype="float16", pointer=1 << 45)
    with pytest.raises(
        ka.AttentionInputTypeError,
        match=r"^out has dtype float16 but q has dtype bfloat16; out must have q's dtype$",
    ):
        ka.attention(q, k, v, out=out)


def test_good_torch_tensors_reach_their_gpu(fake_torch: Any, monkeypatch) -> None:
    asked = []
    monkeypatch.setattr(ka.Attention, "_runner", lambda self, index: asked.append(index) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ka.Attention()(*tensors(*[FakeTensor(index=3, pointer=i << 40) for i in (1, 2, 3)]))
    assert asked == [3]


def test_pointer_facts_give_the_device_and_refuse_host_memory() -> None:
    inputs = attention_args.check_inputs(FakeArray(), FakeArray(), FakeArray())
    on = lambda device, kind=2: attention_args.PointerFacts(kind, device, 0)  # noqa: E731
    device_of = attention_args.device_of
    assert device_of(inputs.arrays, [on(1), on(1), on(1)]) == 1
    assert device_of(inputs.arrays, [None, None, None]) == 0  # driver not asked: device 0
    with pytest.raises(ka.AttentionInputError, match=r"v is on cuda:2 but q is on cuda:1"):
        device_of(inputs.arrays, [on(1), on(1), on(2)])
    with pytest.raises(ka.AttentionInputError, match=r"k's data pointer .* page-locked host"):
        device_of(inputs.arrays, [on(0), on(0, kind=1), on(0)])
    with pytest.raises(ka.AttentionInputError, match=r"not memory CUDA knows"):
        device_of(inputs.arrays, [on(0, kind=0), on(0), on(0)])


# ------------------------------------------------------------------------ plan choice


def record(family: str = "tiled", params: dict | None = None, **fields: Any) -> PlanRecord:
    values = {"source_hash": HASHES[family], "measured": True, "median_ms": 0.5} | fields
    return PlanRecord(family=family, params=dict(params or STORED), **values)


@pytest.fixture
def registry(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    with PlanRegistry.open(url) as writer:
        yield writer


class CountingRegistry:
    """A registry handle that counts the lookups that reach it."""

    def __init__(self, inner: PlanRegistry) -> None:
        self.inner, self.url, self.calls = inner, inner.url, 0

    def cached_best(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.cached_best(*args, **kwargs)


def chooser(registry: Any, **options: Any) -> plan_choice.PlanChooser:
    return plan_choice.PlanChooser(registry, ENV, H200, source_hashes=HASHES, **options)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def default_plan_key(problem: Problem) -> str:
    space = candidate_space(problem, H200)
    return min(space.feasible, key=lambda plan: predict_time_ms(plan, H200)).key()


def test_a_stored_plan_is_used_without_warnings(registry, caplog) -> None:
    registry.record(PROBLEM, ENV, record())
    chosen = chooser(registry).plan_for(PROBLEM)
    assert chosen.origin == "registry" and chosen.stored is not None
    assert chosen.plan.params == KernelParams("tiled", **STORED)
    assert chosen.plan.problem == PROBLEM and warnings_of(caplog) == []


def test_an_empty_registry_gives_the_default_plan_and_one_warning_per_shape(
    registry, caplog
) -> None:
    choosing = chooser(registry)
    chosen = choosing.plan_for(PROBLEM)
    assert chosen.origin == "default" and chosen.plan.key() == default_plan_key(PROBLEM)
    assert choosing.plan_for(PROBLEM) is chosen
    other = Problem(4096, 128, heads=2)
    assert choosing.plan_for(other).plan.key() == default_plan_key(other)
    notes = warnings_of(caplog)
    assert len(notes) == 2 and notes[0] == chosen.warnings[0]
    assert notes[0].startswith(f"no plan for {PROBLEM.label()} in registry ")
    assert (
        f"falling back to the planner's default plan {chosen.plan.key()}, the cost model's "
        "best for float32 (predicted"
    ) in notes[0]
    assert all(r.name == "kernels.attention" for r in caplog.records)


def test_no_registry_gives_the_default_plan(caplog) -> None:
    chosen = chooser(None).plan_for(PROBLEM)
    assert chosen.origin == "default"
    assert warnings_of(caplog)[0].startswith("no plan registry (none given, no /")


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        (record(source_hash="old"), r"measured under an older tiled kernel source \(old, now tttt"),
        (record(measured=False, median_ms=None, predicted_ms=0.4), r"only predicted"),
    ],
)
def test_stale_and_predicted_plans_are_used_with_one_warning(registry, caplog, stored, message):
    registry.record(PROBLEM, ENV, stored)
    choosing = chooser(registry)
    chosen = choosing.plan_for(PROBLEM)
    choosing.plan_for(PROBLEM)
    assert chosen.origin == "registry" and chosen.plan.params == KernelParams("tiled", **STORED)
    notes = warnings_of(caplog)
    assert len(notes) == 1 and chosen.warnings == tuple(notes)
    assert re.search(message, notes[0]), notes[0]


def test_a_plan_of_another_toolchain_is_used_one_of_another_gpu_is_not(registry, caplog) -> None:
    registry.record(PROBLEM, Environment("NVIDIA H200", "9.0", 132, "570.1", "12.8"), record())
    chosen = chooser(registry).plan_for(PROBLEM)
    assert chosen.origin == "registry" and "another toolchain (driver 570.1" in chosen.warnings[0]
    other_gpu = Problem(512, 64)
    registry.record(other_gpu, Environment("NVIDIA A100-SXM4-80GB", "8.0", 108), record())
    chosen = chooser(registry).plan_for(other_gpu)
    assert chosen.origin == "default"
    assert "only for another GPU (NVIDIA A100-SXM4-80GB, 108 SMs)" in chosen.warnings[0]


def test_a_plan_tuned_without_a_gpu_is_never_served_on_one(registry, caplog) -> None:
    """Plans a CPU-only run stores are filed under the GPU name "model" (cost-model
    predictions): on a GPU they are never used, not even when they are the fastest
    predictions in the registry and a plan of this GPU model is only predicted too."""
    cpu_only = Environment("model", "9.0", 132)
    registry.record(PROBLEM, cpu_only, record(measured=False, median_ms=0.001))
    chosen = chooser(registry).plan_for(PROBLEM)
    assert chosen.origin == "default"
    assert "only for another GPU (model, 132 SMs), not this NVIDIA H200" in chosen.warnings[0]
    this_gpu_model = Environment("NVIDIA H200", "9.0", 132, "570.1", "12.8")
    other = STORED | {"tile_size": 64}
    registry.record(PROBLEM, this_gpu_model, record(params=other, measured=False, median_ms=0.9))
    chosen = chooser(registry).plan_for(PROBLEM)
    assert chosen.origin == "registry" and chosen.stored is not None
    assert chosen.stored.environment == this_gpu_model
    assert chosen.plan.tile_size == 64


def test_a_stored_plan_that_cannot_run_here_falls_back(registry, caplog) -> None:
    registry.record(PROBLEM, ENV, record(params=STORED | {"threads": 2048}))
    chosen = chooser(registry).plan_for(PROBLEM)
    assert chosen.origin == "default"
    assert (
        "the registry's plan for 2x4x1000x64 float32 causal cannot run here: threads=2048"
        in (chosen.warnings[0])
    )


def test_the_nearest_shape_is_used_when_asked(registry) -> None:
    registry.record(Problem(1024, 64, batch=2, heads=4, causal=True), ENV, record())
    assert chooser(registry).plan_for(PROBLEM).origin == "default"
    chosen = chooser(registry, nearest=True).plan_for(PROBLEM)
    assert chosen.origin == "registry" and chosen.stored.fallback
    assert chosen.plan.problem == PROBLEM  # re-planned for the shape asked


def test_a_default_candidate_that_does_not_compile_is_skipped() -> None:
    best = default_plan_key(PROBLEM)
    check = lambda plan: "does not compile: boom" if plan.key() == best else plan  # noqa: E731
    chosen = chooser(None, check=check).plan_for(PROBLEM)
    assert chosen.origin == "default" and chosen.plan.key() != best
    with pytest.raises(BackendError, match=r"no runnable kernel plan .*: boom"):
        chooser(None, check=lambda plan: "boom").plan_for(PROBLEM)


def test_the_registry_is_asked_once_per_shape(registry) -> None:
    registry.record(PROBLEM, ENV, record())
    counting = CountingRegistry(registry)
    choosing = chooser(counting)
    for _ in range(5):
        choosing.plan_for(PROBLEM)
    assert counting.calls == 1
    for _ in range(5):
        # not stored: this GPU, this GPU model under any toolchain, then any GPU (to say why)
        choosing.plan_for(Problem(256, 64))
    assert counting.calls == 4


def of_dtype(problem: Problem, dtype: str) -> Problem:
    return Problem(
        problem.seq_len, problem.head_dim, problem.batch, problem.heads, problem.causal, dtype
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_each_dtype_gets_a_default_plan_of_a_family_that_takes_it(dtype: str, caplog) -> None:
    problem = of_dtype(PROBLEM, dtype)
    chosen = chooser(None).plan_for(problem)
    family = chosen.plan.params.family
    assert chosen.origin == "default" and chosen.plan.problem == problem
    assert family in families_for(dtype)
    if dtype == "float32":
        # The calibrated model (issue 18) ranks three-pass mma_tf32 first here, as the
        # H200 grids measure it: a float32-class plan under the default tf32x3 precision.
        assert family in ("scalar_online", "tiled", "mma_tf32")
        assert family != "mma_tf32" or chosen.plan.params.passes == 3
    else:
        assert family == HALF_DEFAULT_FAMILY
    assert chosen.plan.key() == default_plan_key(problem)
    (note,) = warnings_of(caplog)
    assert f"falling back to the planner's default plan {chosen.plan.key()}" in note
    assert f"the cost model's best for {dtype}" in note


def test_a_stored_plan_is_served_for_its_own_dtype_only(registry, caplog) -> None:
    bf16, fp16 = of_dtype(PROBLEM, "bfloat16"), of_dtype(PROBLEM, "float16")
    registry.record(PROBLEM, ENV, record())  # float32: tiled
    choosing = chooser(registry)
    fallback = choosing.plan_for(bf16)  # only a float32 row for this shape: never served
    assert fallback.origin == "default" and fallback.plan.params.family == HALF_DEFAULT_FAMILY
    assert fallback.warnings[0].startswith(f"no plan for {bf16.label()} in registry")
    registry.record(bf16, ENV, record("mma_f16", HALF_STORED))
    choosing = chooser(registry)
    half = choosing.plan_for(bf16)
    assert half.origin == "registry" and half.plan.params == KernelParams("mma_f16", **HALF_STORED)
    assert half.plan.problem == bf16 and half.plan.sequence_splits > 1
    assert half.stored is not None and half.stored.problem.dtype == "bfloat16"
    assert choosing.plan_for(fp16).origin == "default"  # the bfloat16 row is not float16's
    single = choosing.plan_for(PROBLEM)
    assert single.origin == "registry" and single.plan.params == KernelParams("tiled", **STORED)


def test_a_registry_answering_with_another_dtype_is_not_served(registry, caplog) -> None:
    registry.record(PROBLEM, ENV, record())

    class FloatOnly:  # a handle that ignores the dtype asked
        url = "float-only"

        def cached_best(self, problem: Problem, *args: Any, **kwargs: Any) -> Any:
            return registry.cached_best(of_dtype(problem, "float32"), *args, **kwargs)

    bf16 = of_dtype(PROBLEM, "bfloat16")
    chosen = chooser(FloatOnly()).plan_for(bf16)
    assert chosen.origin == "default" and chosen.plan.params.family == HALF_DEFAULT_FAMILY
    assert chosen.warnings[0].startswith(
        f"registry float-only answered {bf16.label()} with a plan stored for float32; not used"
    )


def test_a_stored_plan_of_a_family_that_does_not_take_the_dtype_falls_back(registry) -> None:
    bf16 = of_dtype(PROBLEM, "bfloat16")
    registry.record(bf16, ENV, record())  # a tiled (float32) plan under a bfloat16 shape
    chosen = chooser(registry).plan_for(bf16)
    assert chosen.origin == "default" and chosen.plan.params.family == HALF_DEFAULT_FAMILY
    assert "cannot run here: tiled kernels take float32, not bfloat16" in chosen.warnings[0]


def test_the_fallback_warns_once_per_shape_and_dtype(registry, caplog) -> None:
    counting = CountingRegistry(registry)
    choosing = chooser(counting)
    bf16, fp16 = of_dtype(PROBLEM, "bfloat16"), of_dtype(PROBLEM, "float16")
    other = Problem(4096, 128, heads=2, dtype="bfloat16")
    for _ in range(3):
        for problem in (bf16, fp16, other):
            assert choosing.plan_for(problem).origin == "default"
    notes = warnings_of(caplog)
    assert len(notes) == 3 and all("falling back" in note for note in notes)
    assert [note.split(" in registry")[0] for note in notes] == [
        f"no plan for {problem.label()}" for problem in (bf16, fp16, other)
    ]
    assert counting.calls == 9  # per shape and dtype: this GPU, its model, any GPU; once


def test_a_dtype_no_family_takes_is_one_error(monkeypatch) -> None:
    monkeypatch.setattr(plan_choice, "families_for", lambda dtype, direction="forward": ())
    with pytest.raises(BackendError, match=r"^no registered kernel family takes bfloat16 \(2x4"):
        chooser(None).plan_for(of_dtype(PROBLEM, "bfloat16"))


# ------------------------------------------------------------------------ default instances


def test_default_instances_per_registry(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(DATA_DIR_VARIABLE, str(tmp_path / "data"))
    monkeypatch.setattr(ka, "_instances", {})
    monkeypatch.chdir(tmp_path)
    first = ka.default_instance()
    assert first.registry_url is None and ka.default_instance() is first
    assert ka.default_instance(nearest=True) is not first
    url = f"sqlite:///{tmp_path / 'x.sqlite'}"
    assert ka.default_instance(url) is ka.default_instance(url) is not first
    handle = object()
    assert ka.default_instance(handle)._registry is handle  # type: ignore[arg-type]
    PlanRegistry.open(default_registry_url()).close()  # the tuner's default registry exists now
    found = ka.Attention()
    expected = (tmp_path / "data" / "plans.sqlite").resolve().as_posix()
    assert found.registry_url == f"sqlite:///{expected}"
    assert not (tmp_path / "db").exists()  # nothing in the working directory


# ------------------------------------------------------------------------ on the fake driver


def half_values(gpu: FakeGpu, address: Any, shape: tuple[int, ...], fp16: bool) -> np.ndarray:
    raw = gpu.memory[int(address)][: 2 * int(np.prod(shape))]
    values = raw.view(np.float16) if fp16 else from_bfloat16(raw.view(np.uint16))
    return values.astype(np.float64).reshape(shape)


def store_half(gpu: FakeGpu, address: Any, values: np.ndarray, fp16: bool) -> None:
    bits = values.astype(np.float16) if fp16 else to_bfloat16(values.astype(np.float32))
    target = gpu.memory[int(address)]
    assert target.nbytes == bits.nbytes  # out is allocated in the inputs' 2-byte dtype
    target[:] = np.frombuffer(bits.tobytes(), dtype=np.uint8)


def fake_mma_f16(
    gpu, defines, grid, q, k, v, out, po, lse, seq_len, kv_len, group, span, scale_log2,
    heads, window_left, window_right, softcap, alibi_slopes, sinks, row_lse,
):
    """``mma_f16_attention`` in float64: per split, normalised partials and a log2-sum-exp."""
    n, d, splits, bh, fp16 = int(seq_len), defines["HEAD_DIM"], grid[1], grid[2], defines["IS_FP16"]
    assert int(kv_len) == n and int(group) == 1 and grid[0] == -(-n // defines["BLOCK_M"])
    q3, k3, v3 = (half_values(gpu, a, (bh, n, d), fp16) for a in (q, k, v))
    scores = np.einsum("bqd,bkd->bqk", q3, k3) * float(scale_log2)
    if defines["CAUSAL"]:
        scores[:, np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]] = -np.inf
    if splits == 1:
        weights = np.exp2(scores - scores.max(-1, keepdims=True))
        store_half(gpu, out, weights @ v3 / weights.sum(-1, keepdims=True), fp16)
        return
    po4 = gpu.floats(po, bh * splits * n * d).reshape(bh, splits, n, d)
    lse3 = gpu.floats(lse, bh * splits * n).reshape(bh, splits, n)
    for s in range(splits):
        part = scores[..., s * int(span) : (s + 1) * int(span)]
        top = part.max(-1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        weights = np.exp2(part - top)
        total = weights.sum(-1)
        po4[:, s] = (
            weights
            @ v3[:, s * int(span) : (s + 1) * int(span)]
            / np.maximum(total, 1e-300)[..., None]
        )
        lse3[:, s] = np.where(total > 0, np.log2(np.maximum(total, 1e-300)) + top[..., 0], -np.inf)


def fake_mma_f16_merge(
    gpu, defines, grid, po, lse, out, seq_len, splits, total_rows, heads, sinks, row_lse
):
    n, s, d = int(seq_len), int(splits), defines["HEAD_DIM"]
    bh = int(total_rows) // n
    po4 = gpu.floats(po, bh * s * n * d).reshape(bh, s, n, d).astype(np.float64)
    lse3 = gpu.floats(lse, bh * s * n).reshape(bh, s, n).astype(np.float64)
    weights = np.exp2(lse3 - lse3.max(1, keepdims=True))
    merged = (weights[..., None] * po4).sum(1) / weights.sum(1)[..., None]
    store_half(gpu, out, merged, bool(defines["IS_FP16"]))


#: the half-precision family's entries, emulated here (the shared fake driver knows float32's)
HALF_KERNELS = {"mma_f16_attention": fake_mma_f16, "mma_f16_split_merge": fake_mma_f16_merge}


class StreamAwareFunction:
    """The fake's kernels with the stream they were launched on, logged."""

    def __init__(self, function: Any, gpu: FakeGpu) -> None:
        self.function, self.gpu, self.log = function, gpu, gpu.log

    def set_attribute(self, *args: Any) -> None:
        self.function.set_attribute(*args)

    def __call__(self, *args: Any, grid: Any, block: Any, shared: int, stream: Any = None):
        self.log.append(("launch", self.function.name, stream))
        half = HALF_KERNELS.get(self.function.name)
        if half is None:
            self.function(*args, grid=grid, block=block, shared=shared)
            return
        defines = self.function.defines
        merge = self.function.name.endswith("merge")
        assert block == ((128 if merge else defines["WARPS"] * 32), 1, 1)
        assert shared <= self.function.max_dynamic
        half(self.gpu, defines, grid, *args)


class FakeCudaDriver:
    """``kernels.cuda_driver.CudaDriver`` on the fake GPU: modules from the fake pycuda driver,
    launches that run the emulated kernels on the values the packed arguments hold then."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu, self.modules, self.functions, self.unloaded = gpu, {}, {}, []
        self.load = make_driver(gpu).module_from_buffer

    def load_module(self, image: bytes) -> int:
        self.gpu.loads += 1
        module = self.load(image)
        self.modules[id(module)] = module
        return id(module)

    def get_function(self, module: int, name: str) -> int:
        function = StreamAwareFunction(self.modules[module].get_function(name), self.gpu)
        self.functions[id(function)] = function
        return id(function)

    def set_max_dynamic_shared(self, function: int, nbytes: int) -> None:
        self.functions[function].set_attribute("MAXDYN", nbytes)

    def unload_module(self, module: int) -> None:
        self.unloaded.append(module)

    def bind_launch(self, launch: cuda_driver.PackedLaunch, stream: int) -> Any:
        def call() -> int:
            function = self.functions[launch.function]
            function(
                *launch.values(),
                grid=launch.grid,
                block=launch.block,
                shared=launch.shared_bytes,
                stream=stream,
            )
            return 0

        return call

    def check(self, status: int, what: str) -> None:
        if status:
            raise BackendError(f"{what}: CUDA error {status}")
@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    state = FakeGpu()
    state.log, state.compiled, state.loads = [], [], 0
    driver = make_driver(state)
    package = types.ModuleType("pycuda")
    package.VERSION_TEXT, package.driver = "2026.1", driver
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.setitem(sys.modules, "pycuda.driver", driver)

    def fake_compile(variant: Any, cache_dir: Any, arch: str = "sm_90") -> CompiledKernel:
        spec = variant if isinstance(variant, KernelSpec) else KernelSpec.from_plan(variant)
        state.compiled.append(spec.key)
        cubin = json.dumps({"defines": dict(spec.defines)}).encode()
        resources = {name: ResourceUsage(64) for name in build.ENTRY_FUNCTIONS[spec.family]}
        return CompiledKernel(spec, Path("x.cubin"), cubin, resources, "h", arch, "13.0.88")

    monkeypatch.setattr(build, "compile_kernel", fake_compile)
    # Never the real driver from this process: the suite forks CUDA workers elsewhere.
    monkeypatch.setattr(pycuda_attention, "current_context", lambda: None)
    state.cuda = FakeCudaDriver(state)
    monkeypatch.setattr(pycuda_attention, "CudaDriver", lambda: state.cuda)
    facts = attention_args.PointerFacts(2, 0, 0)
    monkeypatch.setattr(attention_args, "query_pointer", lambda pointer: facts)
    state.driver = driver
    return state


SMALL = Problem(200, 32, batch=1, heads=2, causal=True)
SPLIT = {"threads": 64, "tile_size": 16, "rows_per_block": 16, "split_target": 2}


def on_fake_gpu(gpu: FakeGpu, problem: Problem, seed: int = 0) -> tuple[list, list]:
    shape = (problem.batch, problem.heads, problem.seq_len, problem.head_dim)
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]
    buffers = [gpu.driver.to_device(array) for array in host]
    buffers.append(gpu.driver.mem_alloc(host[0].nbytes))
    return host, buffers


def read(gpu: FakeGpu, buffer: Any, shape: tuple[int, ...]) -> np.ndarray:
    return gpu.floats(buffer, int(np.prod(shape))).reshape(shape).copy()


def test_interface_arrays_run_the_stored_plan_with_everything_cached(gpu, registry) -> None:
    attend = ka.Attention(registry)
    current = build.source_hash("tiled")
    registry.record(SMALL, attend.environment(), record(params=SPLIT, source_hash=current))
    chosen = attend.plan_for(SMALL)
    assert chosen.origin == "registry" and chosen.plan.sequence_splits > 1
    host, buffers = on_fake_gpu(gpu, SMALL)
    shape = host[0].shape
    arrays = [FakeArray(shape, pointer=int(b)) for b in buffers]
    allocations = gpu.allocations
    for _ in range(3):
        result = attend(*arrays[:3], True, out=arrays[3])
        assert result is arrays[3]
        expected = attention_reference(*(a.reshape(2, 200, 32) for a in host), causal=True)
        assert np.abs(read(gpu, buffers[3], shape).reshape(2, 200, 32) - expected).max() < 1e-4
    assert gpu.allocations == allocations + 2  # split scratch (partials, max/sum), once
    assert gpu.loads == 1 and len(set(gpu.compiled)) == 1 and gpu.stack_depth == 0
    assert [name for _, name, _ in gpu.log] == ["tiled_attention", "split_merge"] * 3
    assert all(stream == 0 for _, _, stream in gpu.log)  # the legacy default stream
    assert attend.handle(SMALL) is attend.handle(SMALL)  # one handle, one slot: stream 0
    assert list(attend.handle(SMALL)._slots) == [0]


def half_on_fake_gpu(
    gpu: FakeGpu, problem: Problem, seed: int = 0
) -> tuple[list[np.ndarray], list[Any]]:
    """q, k, v rounded to the problem's dtype (float64 values) and their device buffers."""
    shape = (problem.batch, problem.heads, problem.seq_len, problem.head_dim)
    rng = np.random.default_rng(seed)
    drawn = [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]
    if problem.dtype == "float16":
        stored = [x.astype(np.float16) for x in drawn]
        values = [x.astype(np.float64) for x in stored]
    else:
        stored = [to_bfloat16(x) for x in drawn]
        values = [from_bfloat16(x).astype(np.float64) for x in stored]
    return values, [gpu.driver.to_device(x) for x in stored]


HALF_SMALL = Problem(200, 32, batch=1, heads=2, causal=True, dtype="float16")
HALF_SPLIT = HALF_STORED | {"split_target": 2}  # 200 keys in 7 tiles of 32: 4 splits


def test_float16_arrays_run_the_stored_half_plan_with_float32_scratch(gpu, registry) -> None:
    attend = ka.Attention(registry)
    current = build.source_hash("mma_f16")
    registry.record(
        HALF_SMALL, attend.environment(), record("mma_f16", HALF_SPLIT, source_hash=current)
    )
    registry.record(of_dtype(HALF_SMALL, "float32"), attend.environment(), record(params=SPLIT))
    values, buffers = half_on_fake_gpu(gpu, HALF_SMALL)
    shape = values[0].shape
    out = gpu.driver.mem_alloc(int(np.prod(shape)) * 2)
    arrays = [FakeArray(shape, pointer=int(b), typestr="<f2") for b in (*buffers, out)]
    allocations = gpu.allocations
    for _ in range(2):
        assert attend(*arrays[:3], True, out=arrays[3]) is arrays[3]
    result = half_values(gpu, out, shape, fp16=True).reshape(2, 200, 32)
    expected = attention_reference(*(a.reshape(2, 200, 32) for a in values), causal=True)
    assert np.abs(result - expected).max() < 2e-3  # float16's rounding of the output
    chosen = attend.plan_for(HALF_SMALL)
    assert chosen.origin == "registry" and chosen.plan.params == KernelParams(
        "mma_f16", **HALF_SPLIT
    )
    assert chosen.plan.sequence_splits == 4
    assert [name for _, name, _ in gpu.log] == ["mma_f16_attention", "mma_f16_split_merge"] * 2
    # The split scratch: allocated once, float32, in the sizes the family's buffer_elements says.
    assert gpu.allocations == allocations + 2
    runner = attend._runners[0]
    handle = runner.handle(HALF_SMALL)
    needed = buffer_elements(chosen.plan)
    assert needed.partial_ml == 2 * 4 * 200  # one log-sum-exp per row and split
    sizes = [gpu.memory[int(scratch)].nbytes for scratch in handle._slots[0].owners]
    assert sizes == [needed.partial_o * 4, needed.partial_ml * 4]
    assert set(runner._handles) == {HALF_SMALL}


def test_a_producer_stream_is_waited_for(gpu, registry, monkeypatch) -> None:
    synchronised = []
    monkeypatch.setattr(gpu.driver.Context, "synchronize", lambda: synchronised.append(1))
    _, buffers = on_fake_gpu(gpu, SMALL)
    shape = (1, 2, 200, 32)
    arrays = [
        FakeArray(shape, pointer=int(b), stream=7 if i == 0 else None)
        for i, b in enumerate(buffers)
    ]
    ka.Attention(registry)(*arrays[:3], True, out=arrays[3])
    assert synchronised == [1]


def torch_on_fake_gpu(gpu: FakeGpu, stream: int = 0) -> types.ModuleType:
    """The fake torch with what the handle's torch path calls: torch's current device, stream
    and capture state (``torch._C``), and allocations on the fake GPU."""
    torch = fake_torch_module()
    torch.uint8 = "uint8"
    state = types.SimpleNamespace(stream=stream, capturing=False, device=0)
    torch.fake_state = state

    def empty_like(tensor: FakeTensor) -> FakeTensor:
        element = 4 if tensor.dtype == "float32" else 2
        allocation = gpu.driver.mem_alloc(int(np.prod(tensor.shape)) * element)
        return FakeTensor(tensor.shape, pointer=int(allocation), dtype=tensor.dtype)

    def empty(nbytes: int, *, dtype: str, device: Any) -> FakeTensor:
        assert dtype == "uint8" and device.type == "cuda"
        return FakeTensor((nbytes,), pointer=int(gpu.driver.mem_alloc(nbytes)), dtype=dtype)

    torch.empty_like, torch.empty = empty_like, empty
    torch._C = types.SimpleNamespace(
        _cuda_getDevice=lambda: state.device,
        _cuda_getCurrentRawStream=lambda index: state.stream,
        _cuda_isCurrentStreamCapturing=lambda: state.capturing,
    )
    return torch


def fake_tensors(gpu: FakeGpu, problem: Problem, seed: int = 0) -> tuple[list, list]:
    """q, k, v drawn on the fake GPU and an output buffer, as torch tensors."""
    host, buffers = on_fake_gpu(gpu, problem, seed)
    return host, [FakeTensor(host[0].shape, pointer=int(b)) for b in buffers]


def store_split_plan(attend: ka.Attention, registry: PlanRegistry) -> None:
    """A measured plan for SMALL with key splits (so split scratch and the merge kernel)."""
    current = build.source_hash("tiled")
    registry.record(SMALL, attend.environment(), record(params=SPLIT, source_hash=current))


def expected_small(host: list[np.ndarray]) -> np.ndarray:
    return attention_reference(*(a.reshape(2, 200, 32) for a in host), causal=True)


@pytest.mark.parametrize("caller_stream", [0, 99])
def test_torch_tensors_run_on_the_callers_stream(gpu, registry, monkeypatch, caller_stream):
    monkeypatch.setitem(sys.modules, "torch", torch_on_fake_gpu(gpu, caller_stream))
    host, (q, k, v, _) = fake_tensors(gpu, SMALL)
    attend = ka.Attention(registry)
    for _ in range(2):
        out = attend(q, k, v, causal=True)
        result = read(gpu, out.data_ptr(), host[0].shape).reshape(2, 200, 32)
        assert np.abs(result - expected_small(host)).max() < 1e-4
    launches = [entry for entry in gpu.log if entry[0] == "launch"]
    assert launches and all(stream == caller_stream for *_, stream in launches)
    assert len(gpu.log) == len(launches)  # no events, no fences: straight onto that stream


def test_the_fast_path_skips_the_checks_and_the_plan_lookup(gpu, registry, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", torch_on_fake_gpu(gpu))
    host, (q, k, v, out) = fake_tensors(gpu, SMALL)
    counting = CountingRegistry(registry)
    attend = ka.Attention(counting)
    store_split_plan(attend, registry)
    checked = []
    check = ka.check_inputs
    monkeypatch.setattr(ka, "check_inputs", lambda *a: checked.append(1) or check(*a))
    allocations = gpu.allocations
    for _ in range(4):
        assert attend(q, k, v, True, out=out) is out
    assert checked == [1] and counting.calls == 1  # found for this GPU: once
    assert gpu.allocations == allocations + 2  # the split scratch of stream 0, once
    result = read(gpu, out.data_ptr(), host[0].shape).reshape(2, 200, 32)
    assert np.abs(result - expected_small(host)).max() < 1e-4
    # Declined by the fast path, refused by the full checks with the usual message:
    with pytest.raises(ka.AttentionInputError, match=r"^out overlaps q in memory"):
        attend(q, k, v, True, out=FakeTensor(q.shape, pointer=q.pointer + 64))
    with pytest.raises(ka.AttentionInputError, match=r"^k is not C-contiguous"):
        attend(q, FakeTensor(q.shape, pointer=k.pointer, contiguous=False), v, True)
    with pytest.raises(ka.AttentionInputError, match=r"^v requires grad"):
        attend(q, k, FakeTensor(q.shape, pointer=v.pointer, requires_grad=True), True)
    with pytest.raises(ka.AttentionInputTypeError, match=r"^causal must be a bool, got 1$"):
        attend(q, k, v, 1, out=out)  # equal to True as a key, but not a bool
    assert len(checked) == 5


def test_one_handle_per_problem_and_device(gpu, registry, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", torch_on_fake_gpu(gpu))
    counting = CountingRegistry(registry)
    attend = ka.Attention(counting)
    _, (q, k, v, _) = fake_tensors(gpu, SMALL)
    attend(q, k, v, True)
    handle = attend.handle(SMALL)
    assert attend.handle(Problem(200, 32, batch=1, heads=2, causal=True)) is handle  # equal
    assert handle.problem == SMALL and handle.device == 0 and handle.chosen.origin == "default"
    others = {
        "dtype": of_dtype(SMALL, "float16"),
        "causal": Problem(200, 32, batch=1, heads=2, causal=False),
        "shape": Problem(256, 32, batch=1, heads=2, causal=True),
    }
    handles = {name: attend.handle(problem) for name, problem in others.items()}
    assert len({id(h) for h in (handle, *handles.values())}) == 4
    assert all(handles[name].problem == others[name] for name in others)
    for _ in range(3):
        for problem in (SMALL, *others.values()):
            attend.handle(problem)
    assert counting.calls == 3 * 4  # per problem: this GPU, its model, any GPU; once
    # q, k, v of another signature (shape) reach another handle; the same problem, the same
    _, (q2, k2, v2, _) = fake_tensors(gpu, others["shape"])
    attend(q2, k2, v2, True)
    assert set(attend._torch_handles.values()) == {handle, handles["shape"]}


def test_scratch_per_stream_and_per_capture(gpu, registry, monkeypatch) -> None:
    torch = torch_on_fake_gpu(gpu)
    monkeypatch.setitem(sys.modules, "torch", torch)
    host, (q, k, v, out) = fake_tensors(gpu, SMALL)
    attend = ka.Attention(registry)
    store_split_plan(attend, registry)
    attend(q, k, v, True, out=out)
    handle = attend.handle(SMALL)
    assert handle.has_scratch and handle.chosen.origin == "registry"
    torch.fake_state.stream = 7
    attend(q, k, v, True, out=out)
    assert sorted(handle._slots) == [0, 7]
    scratch = [{owner.pointer for owner in handle._slots[s].owners} for s in (0, 7)]
    assert len(scratch[0]) == 2 and not scratch[0] & scratch[1]  # streams never share scratch
    allocations = gpu.allocations
    torch.fake_state.capturing = True  # a CUDA-graph capture: scratch of its own, not kept
    for _ in range(2):
        attend(q, k, v, True, out=out)
    assert gpu.allocations == allocations + 4 and sorted(handle._slots) == [0, 7]
    result = read(gpu, out.data_ptr(), host[0].shape).reshape(2, 200, 32)
    assert np.abs(result - expected_small(host)).max() < 1e-4


def test_another_current_device_is_switched_to(gpu, registry, monkeypatch) -> None:
    torch = torch_on_fake_gpu(gpu)
    switched = []

    class DeviceGuard:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            switched.append(self.index)
            torch.fake_state.device = self.index

        def __exit__(self, *exc: Any) -> None:
            torch.fake_state.device = 1

    torch.cuda = types.SimpleNamespace(device=DeviceGuard)
    torch.fake_state.device = 1
    monkeypatch.setitem(sys.modules, "torch", torch)
    host, (q, k, v, _) = fake_tensors(gpu, SMALL)
    out = ka.Attention(registry)(q, k, v, True)
    assert switched == [0] and torch.fake_state.device == 1
    result = read(gpu, out.data_ptr(), host[0].shape).reshape(2, 200, 32)
    assert np.abs(result - expected_small(host)).max() < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_torch_tensors_get_the_default_half_plan_and_an_output_of_their_dtype(
    gpu, registry, monkeypatch, caplog, dtype
) -> None:
    monkeypatch.setitem(sys.modules, "torch", torch_on_fake_gpu(gpu))
    problem = of_dtype(HALF_SMALL, dtype)
    registry.record(of_dtype(problem, "float32"), ENV, record(params=SPLIT))  # never served
    values, buffers = half_on_fake_gpu(gpu, problem, seed=1)
    q, k, v = (FakeTensor(values[0].shape, pointer=int(b), dtype=dtype) for b in buffers)
    attend = ka.Attention(registry)
    outputs = [attend(q, k, v, causal=True) for _ in range(3)]
    assert all(out.dtype == dtype and out.shape == q.shape for out in outputs)
    fp16 = dtype == "float16"
    result = half_values(gpu, outputs[0].data_ptr(), q.shape, fp16).reshape(2, 200, 32)
    expected = attention_reference(*(a.reshape(2, 200, 32) for a in values), causal=True)
    assert np.abs(result - expected).max() < (2e-3 if fp16 else 2e-2)
    chosen = attend.plan_for(problem)
    assert chosen.origin == "default" and chosen.plan.params.family == "mma_f16"
    notes = warnings_of(caplog)
    assert len(notes) == 1 and "falling back to the planner's default plan" in notes[0]
    launched = {name for entry, name, _ in gpu.log if entry == "launch"}
    assert launched <= set(HALF_KERNELS) and "mma_f16_attention" in launched


# ------------------------------------------------------------------------ registry at deploy time


def test_a_registry_that_cannot_be_opened_gives_the_fallback_and_one_warning(
    gpu, tmp_path, caplog
) -> None:
    missing = f"sqlite:///{tmp_path / 'nowhere' / 'plans.sqlite'}"
    attend = ka.Attention(missing)
    _, buffers = on_fake_gpu(gpu, SMALL)
    arrays = [FakeArray((1, 2, 200, 32), pointer=int(b)) for b in buffers]
    for _ in range(3):
        attend(*arrays[:3], True, out=arrays[3])
    chosen = attend.plan_for(SMALL)
    assert chosen.origin == "default"  # the mark: not a registry plan
    (note,) = warnings_of(caplog)
    assert note.startswith("plan registry unavailable (no plan registry at ")
    assert "falling back to the planner's default plan" in note
    assert not (tmp_path / "nowhere").exists()  # a read-only open creates nothing


def test_a_read_only_registry_url_serves_its_plans(gpu, tmp_path, caplog) -> None:
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    attend = ka.Attention(url)
    with PlanRegistry.open(url) as writer:
        current = build.source_hash("tiled")
        writer.record(SMALL, attend.environment(), record(params=SPLIT, source_hash=current))
    (tmp_path / "plans.sqlite").chmod(0o444)
    _, buffers = on_fake_gpu(gpu, SMALL)
    arrays = [FakeArray((1, 2, 200, 32), pointer=int(b)) for b in buffers]
    attend(*arrays[:3], True, out=arrays[3])
    chosen = attend.plan_for(SMALL)
    assert chosen.origin == "registry" and chosen.plan.params == KernelParams("tiled", **SPLIT)
    assert attend._registry.readonly and warnings_of(caplog) == []


def test_each_float32_precision_gets_a_handle_of_its_own(gpu, registry, monkeypatch) -> None:
    """precision=None and "tf32x3" are the accurate problem (one handle); "tf32" is another
    problem with a handle of its own, on the checked path and on the fast path's signature;
    a precision a dtype does not take is refused before any launch."""
    monkeypatch.setitem(sys.modules, "torch", torch_on_fake_gpu(gpu))
    attend = ka.Attention(registry)
    _, (q, k, v, _) = fake_tensors(gpu, SMALL)
    accurate = attend.handle(SMALL)
    fast = attend.handle(
        Problem(200, 32, batch=1, heads=2, causal=True, precision="tf32")
    )
    assert accurate is not fast
    assert (accurate.problem.precision, fast.problem.precision) == ("tf32x3", "tf32")
    accurate_params = accurate.chosen.plan.params
    assert accurate_params.family != "mma_tf32" or accurate_params.passes == 3  # never one pass
    for precision, handle in ((None, accurate), ("tf32x3", accurate), ("tf32", fast)):
        signature = attention_args.torch_signature(q, k, v, True, precision)
        for _ in range(2):  # the first call resolves, the second takes the fast path
            calls = len(gpu.log)
            attend(q, k, v, True, precision=precision)
            assert len(gpu.log) > calls
        assert attend._torch_handles[signature] is handle
    with pytest.raises(attention_args.AttentionInputError, match="precision must be one of"):
        attend(q, k, v, True, precision="fp64")
    with pytest.raises(attention_args.AttentionInputError, match="precision must be one of"):
        attend(q, k, v, True, precision=["tf32"])  # not a str: the checks, not a dict key
