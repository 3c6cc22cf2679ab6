"""Run a plan's launches on the CPU emulator of the CUDA execution model (``emulator.hpp``).

``build(main, defines)`` compiles a kernel source's harness (``<family>_main.cpp``, which
includes the real ``kernels/<family>.cu``) with g++ and the plan's defines, once per define
set; ``run(executable, buffers, launches, addresses)`` sends the launches a family built with
marker addresses (``addresses``: buffer name -> marker) and returns every buffer's bytes after
them. Slow (a thread per CUDA thread): for problems of a few hundred rows.
``emulate_forward(plan)`` runs a forward plan (with its LSE) on seeded inputs;
``emulate_backward(forward, backward)`` a forward plan and then a backward plan, as the GPU
backend does. Tensor-map arguments go to the emulated TMA (``include/fa/hopper.cuh``).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from kernels import precision
from kernels.attention_variants import alibi_slopes
from tuner.planner.launches import BackwardBuffers, DeviceBuffers, KernelLaunch, TensorMap
from tuner.planner.plan import KernelPlan

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CUDA_INCLUDE = Path("/usr/local/cuda/include")
BUILD_DIR = Path(tempfile.gettempdir()) / "fa-device-emulation"


def cuda_include() -> Path | None:
    """The CUDA toolkit's include directory (cuda_bf16.h), or None."""
    nvcc = shutil.which("nvcc")
    candidates = [CUDA_INCLUDE]
    if nvcc:
        candidates.insert(0, Path(nvcc).resolve().parent.parent / "include")
    return next((path for path in candidates if (path / "cuda_bf16.h").is_file()), None)


def available() -> str:
    """Why the emulator cannot be built here ("" when it can)."""
    if shutil.which("g++") is None:
        return "no g++"
    if cuda_include() is None:
        return "no CUDA headers (cuda_bf16.h)"
    return ""


def build(main: str, defines: Mapping[str, int]) -> Path:
    """The harness ``main`` (a file beside this module) compiled with ``defines``."""
    include = cuda_include()
    assert include is not None
    flags = [f"-D{name}={value}" for name, value in sorted(defines.items())]
    sources = sorted((ROOT / "kernels").rglob("*.cu*")) + sorted(HERE.glob("**/*.[hc]*"))
    digest = hashlib.sha256(" ".join([main, *flags]).encode())
    for path in sources:
        digest.update(path.read_bytes())
    executable = BUILD_DIR / f"{Path(main).stem}-{digest.hexdigest()[:16]}"
    if executable.exists():
        return executable
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    partial = executable.with_suffix(".partial")
    command = [
        "g++", "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas",
        f"-I{HERE / 'include'}", f"-I{HERE}", f"-I{ROOT / 'kernels'}",
        f"-I{ROOT / 'kernels' / 'include'}", f"-I{include}",
        *flags, str(HERE / main), "-o", str(partial),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    partial.replace(executable)
    return executable


def _argument(value: object, names: Mapping[int, str]) -> str:
    if isinstance(value, TensorMap):
        # harness.hpp's tensor_map(): the buffer, element bytes, swizzle, dims, strides, box
        if len(value.dims) != 3:
            raise ValueError(f"the emulated TMA takes 3-D maps, not {len(value.dims)}-D")
        element_bytes = np.dtype(precision.storage_type(value.dtype)).itemsize
        fields_ = (
            names[value.address],
            str(element_bytes),
            str(value.swizzle_bytes),
            ",".join(map(str, value.dims)),
            ",".join(map(str, value.strides_bytes)),
            ",".join(map(str, value.box)),
        )
        return "t:" + ":".join(fields_)
    if isinstance(value, np.uintp):
        return f"p:{names.get(int(value), '0')}" if int(value) else "p:0"
    if isinstance(value, np.floating):
        return f"f:{float(value)!r}"
    return f"i:{int(value)}"  # type: ignore[call-overload]


def run(
    executable: Path,
    buffers: Mapping[str, np.ndarray | int],
    launches: Sequence[KernelLaunch],
    addresses: Mapping[str, int],
) -> dict[str, bytes]:
    """``buffers``: name -> initial contents, or a byte count (zero-filled)."""
    names = {address: name for name, address in addresses.items()}
    with tempfile.TemporaryDirectory(prefix="fa-emulate-") as scratch:
        directory = Path(scratch)
        lines = []
        for name, value in buffers.items():
            if isinstance(value, np.ndarray):
                path = directory / f"{name}.in"
                np.ascontiguousarray(value).tofile(path)
                lines.append(f"buffer {name} {value.nbytes} {path}")
            else:
                lines.append(f"buffer {name} {max(int(value), 4)}")
        for launch in launches:
            arguments = " ".join(_argument(value, names) for value in launch.args)
            geometry = " ".join(str(x) for x in (*launch.grid, *launch.block))
            lines.append(f"launch {launch.function} {geometry} {launch.shared_bytes} {arguments}")
        for name in buffers:
            lines.append(f"dump {name} {directory / (name + '.out')}")
        result = subprocess.run(
            [str(executable)], input="\n".join(lines) + "\n", capture_output=True, text=True
        )
        if result.returncode:
            raise RuntimeError(f"the emulated launches failed: {result.stderr.strip()}")
        return {name: (directory / f"{name}.out").read_bytes() for name in buffers}


# ---------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class EmulatedBackward:
    """One emulated forward + backward: the inputs (float32 values of the rounded ones), the
    forward's output and LSE, and the gradients, all as float32."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    alibi_slopes: np.ndarray
    sinks: np.ndarray
    out: np.ndarray
    lse: np.ndarray
    gradients: dict[str, np.ndarray]


def marker_addresses(buffers: type) -> dict[str, int]:
    """A marker address for every field of a buffers dataclass (none is a real address)."""
    return {f.name: (0xF1A5 << 48) + i for i, f in enumerate(fields(buffers))}


@dataclass(frozen=True)
class EmulatedForward:
    """One emulated forward (with its LSE): the inputs (float32 values of the rounded ones),
    the output (float32 values) and the LSE."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    alibi_slopes: np.ndarray
    sinks: np.ndarray
    out: np.ndarray
    lse: np.ndarray


def _run_forward(
    plan: KernelPlan, stored: Sequence[np.ndarray], slopes: np.ndarray, sinks: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """A forward plan's launches on the stored q, k, v, the outputs poisoned (NaN) first:
    (the output in its storage type, the LSE). The ALiBi and sinks pointers are null where
    the problem has none, as the GPU backend passes them (the split merge adds a sink
    wherever its pointer is set)."""
    problem = plan.problem
    storage = precision.storage_type(problem.dtype)
    nan = precision.NAN_PATTERN[problem.dtype]
    buffers: dict[str, np.ndarray | int] = {
        "q": stored[0], "k": stored[1], "v": stored[2],
        "out": np.full(stored[0].size, nan, dtype=storage),
        "lse": np.full(problem.batch_heads * problem.seq_len, np.nan, dtype=np.float32),
    }  # fmt: skip
    scratch = plan.kernel_family.buffer_elements(plan)
    if scratch.partial_o:
        buffers["partial_o"] = np.full(scratch.partial_o, np.nan, dtype=np.float32)
        buffers["partial_ml"] = np.full(scratch.partial_ml, np.nan, dtype=np.float32)
    for name, values, used in (
        ("alibi_slopes", slopes, problem.alibi),
        ("sinks", sinks, problem.sinks),
    ):
        if used:
            buffers[name] = values
    addresses = {
        name: address if name in buffers else 0
        for name, address in marker_addresses(DeviceBuffers).items()
    }
    done = run(
        build(f"{plan.family}_main.cpp", plan.compile_defines()),
        buffers,
        plan.kernel_family.launches(plan, DeviceBuffers(**addresses)),
        {name: address for name, address in addresses.items() if address},
    )
    return np.frombuffer(done["out"], dtype=storage), np.frombuffer(done["lse"], dtype=np.float32)


def emulate_forward(plan: KernelPlan, seed: int = 0) -> EmulatedForward:
    """A forward plan's launches (with LSE) on seeded inputs."""
    problem = plan.problem
    rng = np.random.default_rng(seed)
    stored, (q, k, v) = precision.random_inputs(problem, rng)
    slopes = alibi_slopes(problem.heads).astype(np.float32)
    sinks = rng.standard_normal(problem.heads).astype(np.float32)
    out_stored, lse = _run_forward(plan, stored, slopes, sinks)
    out = precision.from_storage(out_stored, problem.dtype).reshape(q.shape)
    return EmulatedForward(q, k, v, slopes, sinks, out, lse)


def emulate_backward(forward: KernelPlan, backward: KernelPlan, seed: int = 0) -> EmulatedBackward:
    """The forward plan's launches (with LSE), then the backward plan's, on seeded inputs;
    every output poisoned (NaN, counters garbage) first."""
    problem = forward.problem
    rng = np.random.default_rng(seed)
    stored, (q, k, v) = precision.random_inputs(problem, rng)
    drawn = rng.standard_normal(q.shape, dtype=np.float32)
    dout_stored = precision.to_storage(drawn, problem.dtype)
    slopes = alibi_slopes(problem.heads).astype(np.float32)
    sinks = rng.standard_normal(problem.heads).astype(np.float32)
    storage = precision.storage_type(problem.dtype)
    nan = precision.NAN_PATTERN[problem.dtype]
    out_stored, lse = _run_forward(forward, stored, slopes, sinks)

    addresses = marker_addresses(BackwardBuffers)
    family = backward.kernel_family
    sizes = family.backward_scratch(backward).sizes()  # type: ignore[attr-defined]
    buffers: dict[str, np.ndarray | int] = {
        "q": stored[0], "k": stored[1], "v": stored[2], "out": out_stored, "dout": dout_stored,
        "lse": lse, "dq": np.full(q.size, nan, dtype=storage),
        "dk": np.full(k.size, nan, dtype=storage), "dv": np.full(k.size, nan, dtype=storage),
        "alibi_slopes": slopes, "sinks": sinks,
        "d_sinks": np.full(problem.heads, np.nan, dtype=np.float32),
    }  # fmt: skip
    for name, nbytes in sizes.items():
        if nbytes:
            poison = 0x5EED5EED if name == "counters" else 0x7FC00000
            buffers[name] = np.full(nbytes // 4, poison, dtype=np.uint32)
    done = run(
        build(f"{backward.family}_main.cpp", backward.compile_defines()),
        buffers,
        family.launches(backward, BackwardBuffers(**addresses)),
        addresses,
    )

    def values(name: str) -> np.ndarray:
        return precision.from_storage(np.frombuffer(done[name], dtype=storage), problem.dtype)

    gradients = {"dq": values("dq"), "dk": values("dk"), "dv": values("dv")}
    if problem.sinks:
        gradients["d_sinks"] = np.frombuffer(done["d_sinks"], dtype=np.float32)
    dout = precision.from_storage(dout_stored, problem.dtype).astype(np.float32)
    out = precision.from_storage(out_stored, problem.dtype).reshape(q.shape)
    return EmulatedBackward(q, k, v, dout, slopes, sinks, out, lse, gradients)
