"""The shared device layer against the kernels it replaced: the same plans, old and new cubins,
timed side by side in one process on the GPU.

Issue 24 asks that moving every family onto ``kernels/include/fa/`` costs no more than 3% at
four evidence shapes per family. The plans are the recorded H200 grids' best of each family
at each shape (``bench/data``; the scalar family, whose grid shapes take seconds a run, at
smaller ones). Both cubins are compiled here, on the CPU, with the same nvcc and constants:
the old from the source at ``--old-rev``, the new from the working tree (its variant switches
off, as a plain problem compiles it). On the GPU both run on the same inputs, alternating old
and new over several rounds (so drift hits both alike), L2 flushed before every repetition;
the result is each plan's median ratio new / old, and whether the two outputs agree.

    python bench/device_layer_regression.py prepare --old-rev 227041d --dir scratch/regression
    python bench/device_layer_regression.py run --dir scratch/regression --out result.json

``--set hopper --old-args same`` compares a later change instead: the Hopper bench's best
plans (and two mma.sync ones) against an old revision that already takes today's arguments
(a kernel reads only its own parameters: ``cuLaunchKernel`` ignores the trailing ones an
old signature lacks). The old cubins are built from that revision's sources and headers.

``run`` needs torch (allocation, events) and the CUDA driver (kernels.cuda_driver); no pycuda.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from record_replay import parse_shape  # noqa: E402

from kernels import build  # noqa: E402
from tuner.device import H200  # noqa: E402
from tuner.planner import candidate_space  # noqa: E402
from tuner.planner.launches import DeviceBuffers, KernelLaunch, TensorMap  # noqa: E402
from tuner.planner.plan import KernelPlan  # noqa: E402

#: family -> (shape, plan key): the best recorded plan of the family at the shape
PLANS: dict[str, list[tuple[str, str]]] = {
    "mma_f16": [
        ("4x16x4096x128:bf16", "mma_f16/m128/n48/w4/st2/qsmem/g1/s1"),
        ("2x32/8x4096x128c:bf16", "mma_f16/m128/n32/w4/st3/qsmem/g1/s1"),
        ("1x16x1000x128:bf16", "mma_f16/m128/n128/w8/st2/qreg/g1/s1"),
        ("8x32x1024x64:bf16", "mma_f16/m128/n64/w4/st3/qreg/g1/s1"),
    ],
    "wgmma_f16": [
        ("4x16x4096x128:bf16", "wgmma_f16/c2/n128/st3/b1/o1/s1"),
        ("2x32/8x4096x128c:bf16", "wgmma_f16/c2/n128/st3/b1/o1/s1"),
        ("1x16x1000x128:bf16", "wgmma_f16/c2/n128/st3/b1/o1/s1"),
        ("8x32x1024x64:bf16", "wgmma_f16/c1/n128/st2/b2/o0/s1"),
    ],
    "decode_f16": [
        ("16x32/1x1:8192x128:bf16", "decode_f16/n128/w4/st3/m32/s8"),
        ("16x32/8x1:8192x128:bf16", "decode_f16/n128/w4/st3/m16/s1"),
        ("1x32/8x1:32768x128:bf16", "decode_f16/n64/w4/st3/m16/s16"),
        ("64x32/8x1:2048x128:bf16", "decode_f16/n64/w2/st3/m16/s1"),
    ],
    "mma_tf32": [
        ("1x16x1000x128:fp32", "mma_tf32/x3/m128/n32/w8/st2/s1"),
        ("1x1x4096x128:tf32", "mma_tf32/x1/m128/n64/w8/st2/s4"),
        ("2x16/4x2048x128c:fp32", "mma_tf32/x3/m128/n32/w8/st2/s1"),
        ("4x16x4096x128:tf32", "mma_tf32/x1/m128/n64/w8/st2/s1"),
    ],
    "tiled": [
        ("1x1x4096x128:fp32", "tiled/b64/r128/t256/s4"),
        ("1x8x2048x128:fp32", "tiled/b64/r128/t256/s1"),
        ("4x16x4096x128:fp32", "tiled/b64/r128/t256/s1"),
        ("2x16/4x2048x128c:fp32", "tiled/b64/r128/t256/s1"),
    ],
    "scalar_online": [
        ("1x1x1024x64:fp32", "scalar_online/t64"),
        ("1x4x1024x64c:fp32", "scalar_online/t64"),
        ("1x8x512x128:fp32", "scalar_online/t64"),
        ("2x8/2x512x128:fp32", "scalar_online/t64"),
    ],
}
#: ``--set hopper``: the Hopper bench's best plans at 93a14f6 and two mma.sync plans (the
#: shared softmax), none persistent (a plan both revisions compile)
HOPPER_PLANS: dict[str, list[tuple[str, str]]] = {
    "wgmma_f16": [
        ("4x16x4096x64:bf16", "wgmma_f16/c2/n128/st4/b1/o0/ss/s1"),
        ("4x16x4096x96:bf16", "wgmma_f16/c2/n128/st2/b1/o1/p1/s1"),
        ("4x16x4096x128:bf16", "wgmma_f16/c2/n128/st3/b1/o1/p1/ss/s1"),
        ("4x16x4096x128c:bf16", "wgmma_f16/c2/n128/st3/b1/o1/p1/s1"),
        ("1x32x8192x128:bf16", "wgmma_f16/c2/n128/st3/b1/o1/s1"),
        ("2x16x3001x128c:bf16", "wgmma_f16/c2/n128/st2/b1/o1/p1/ss/s1"),
        ("4x16x4096x256:bf16", "wgmma_f16/c2/n64/st2/b1/o1/s1"),
    ],
    "mma_f16": [
        ("4x16x4096x128:bf16", "mma_f16/m128/n48/w4/st2/qsmem/g1/s1"),
        ("8x32x1024x64:bf16", "mma_f16/m128/n64/w4/st3/qreg/g1/s1"),
    ],
}
SETS = {"device-layer": PLANS, "hopper": HOPPER_PLANS}
#: the arguments the old kernels took: the split-KV contract (after any tensor maps) and
#: the merge's first six; the new ones append the variant arguments
OLD_ATTENTION_ARGS = 11
OLD_MERGE_ARGS = 6
OLD_SCALAR_ARGS = 8


def find_plan(shape: str, key: str) -> KernelPlan:
    problem = parse_shape(shape)
    for plan in candidate_space(problem, H200).feasible:
        if plan.key() == key:
            return plan
    raise SystemExit(f"{key} is not a feasible plan of {problem.label()} today")


def old_kernels(old_rev: str, into: Path) -> Path:
    """The ``kernels/`` tree of ``old_rev`` (sources, and the shared headers where the
    revision has them) extracted under ``into``, once for every plan."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", old_rev, "kernels"], capture_output=True, check=True
    )
    subprocess.run(["tar", "x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "kernels"


def compile_old(plan: KernelPlan, kernels: Path, out: Path) -> None:
    """The plan's constants compiled from the family's source in the old ``kernels`` tree."""
    spec = build.KernelSpec.from_plan(plan)
    includes = [f"-I{kernels / 'include'}"] if (kernels / "include").is_dir() else []
    command = [
        build.find_nvcc() or "nvcc", *spec.nvcc_flags, f"-arch={spec.arch(build.DEFAULT_ARCH)}",
        *includes, *(f"-D{name}={value}" for name, value in spec.defines), "-o", str(out),
        str(kernels / plan.kernel_family.source),
    ]
    subprocess.run(command, capture_output=True, text=True, check=True)


def prepare(old_rev: str, directory: Path, plan_set: str = "device-layer",
            old_args: str = "contract") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    with tempfile.TemporaryDirectory() as scratch:
        kernels = old_kernels(old_rev, Path(scratch))
        for family, plans in SETS[plan_set].items():
            for shape, key in plans:
                plan = find_plan(shape, key)
                new = build.compile_kernel(plan, directory / "cache")
                if isinstance(new, build.CompileFailure):
                    raise SystemExit(f"{key}: {new.reason}")
                name = key.replace("/", "_") + "_" + shape.replace("/", "-").replace(":", "_")
                old_path = directory / f"{name}.old.cubin"
                new_path = directory / f"{name}.new.cubin"
                compile_old(plan, kernels, old_path)
                new_path.write_bytes(new.cubin)
                entries.append({"family": family, "shape": shape, "key": key, "name": name})
                print(f"compiled {family} {shape} {key}", flush=True)
    (directory / "manifest.json").write_text(
        json.dumps({"old_rev": old_rev, "old_args": old_args, "plans": entries}, indent=1)
    )


# ---------------------------------------------------------------------------- the GPU side


def old_launches(launches: tuple[KernelLaunch, ...]) -> tuple[KernelLaunch, ...]:
    """The same launches with the old kernels' argument lists (no variant arguments)."""
    trimmed = []
    for launch in launches:
        maps = sum(isinstance(value, TensorMap) for value in launch.args)
        if launch.function.endswith("merge"):
            keep = OLD_MERGE_ARGS
        elif launch.function.startswith("scalar_online"):
            keep = OLD_SCALAR_ARGS
        else:
            keep = maps + OLD_ATTENTION_ARGS
        trimmed.append(
            KernelLaunch(launch.function, launch.grid, launch.block, launch.shared_bytes,
                         launch.args[:keep])
        )
    return tuple(trimmed)


def run(directory: Path, out: Path, rounds: int, repetitions: int) -> None:
    import torch
    from driver_launch import DriverLauncher

    from kernels.cuda_driver import CudaDriver
    from kernels.launch import buffer_elements, launch_sequence

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the primary context, current for the driver calls
    driver = CudaDriver()
    manifest = json.loads((directory / "manifest.json").read_text())
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    results = []
    for entry in manifest["plans"]:
        plan = find_plan(entry["shape"], entry["key"])
        p = plan.problem
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(p.dtype, torch.float32)
        generator = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(p.batch_heads * p.seq_len * p.head_dim, device="cuda",
                        generator=generator).to(dtype)
        k = torch.randn(p.batch_kv_heads * p.kv_len * p.head_dim, device="cuda",
                        generator=generator).to(dtype)
        v = torch.randn_like(k, dtype=torch.float32).to(dtype)
        sizes = buffer_elements(plan)
        outputs = {}
        # Old tiled kept a (max, sum) pair per row and split: twice the statistics.
        partial_o = torch.empty(max(sizes.partial_o, 1), device="cuda")
        partial_ml = torch.empty(max(2 * sizes.partial_ml, 1), device="cuda")
        timings: dict[str, list[float]] = {"old": [], "new": []}
        launchers, outputs_of = {}, {}
        for version in ("old", "new"):
            out_tensor = torch.empty_like(q)
            buffers = DeviceBuffers(
                q.data_ptr(), k.data_ptr(), v.data_ptr(), out_tensor.data_ptr(),
                partial_o.data_ptr() if sizes.partial_o else 0,
                partial_ml.data_ptr() if sizes.partial_ml else 0,
            )
            launches = launch_sequence(plan, buffers)
            if version == "old" and manifest.get("old_args", "contract") == "contract":
                launches = old_launches(launches)
            cubin = (directory / f"{entry['name']}.{version}.cubin").read_bytes()
            launchers[version] = DriverLauncher(driver, cubin, launches, stream)
            outputs_of[version] = out_tensor

        def launch_all(version: str, launchers: dict = launchers) -> None:
            launchers[version]()

        for version in ("old", "new"):
            launch_all(version)
        torch.cuda.synchronize()
        for version in ("old", "new"):
            outputs[version] = outputs_of[version].float()
        difference = (outputs["old"] - outputs["new"]).abs().max().item()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(rounds):
            for version in ("old", "new"):
                for _ in range(3):
                    launch_all(version)
                for _ in range(repetitions):
                    flush.zero_()
                    start.record()
                    launch_all(version)
                    stop.record()
                    stop.synchronize()
                    timings[version].append(start.elapsed_time(stop))
        old_ms, new_ms = statistics.median(timings["old"]), statistics.median(timings["new"])
        result = {
            **entry,
            "old_ms": old_ms,
            "new_ms": new_ms,
            "ratio_new_over_old": new_ms / old_ms,
            "max_abs_difference": difference,
            "finite": bool(torch.isfinite(outputs["new"]).all().item()),
        }
        results.append(result)
        for launcher in launchers.values():
            launcher.close()
        print(f"{entry['family']:14s} {entry['shape']:24s} {entry['key']:40s} old {old_ms:.4f} ms "
              f"new {new_ms:.4f} ms ratio {new_ms / old_ms:.3f} diff {difference:.2e}", flush=True)
    out.write_text(json.dumps({"old_rev": manifest["old_rev"], "rounds": rounds,
                               "repetitions": repetitions, "results": results}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_parser = commands.add_parser("prepare", help="compile old and new cubins (CPU)")
    prepare_parser.add_argument("--old-rev", required=True)
    prepare_parser.add_argument("--dir", type=Path, required=True)
    prepare_parser.add_argument("--set", choices=list(SETS), default="device-layer",
                                help="which plans (default: issue 24's)")
    prepare_parser.add_argument("--old-args", choices=["contract", "same"], default="contract",
                                help="the old kernels' arguments: the pre-device-layer "
                                     "contract, or today's (a later revision)")
    run_parser = commands.add_parser("run", help="time them side by side (GPU)")
    run_parser.add_argument("--dir", type=Path, required=True)
    run_parser.add_argument("--out", type=Path, required=True)
    run_parser.add_argument("--rounds", type=int, default=4)
    run_parser.add_argument("--repetitions", type=int, default=10)
    arguments = parser.parse_args(argv)
    if arguments.command == "prepare":
        prepare(arguments.old_rev, arguments.dir, arguments.set, arguments.old_args)
    else:
        run(arguments.dir, arguments.out, arguments.rounds, arguments.repetitions)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
