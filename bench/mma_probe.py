"""Probe the mma_f16 kernel on the GPU: parity and speed of precompiled variants next to torch.

    python bench/mma_probe.py --cubins DIR --out $OUT/probe.json [--parity-only] [--shapes ...]

``DIR`` holds cubins named ``mma_f16_D{head_dim}_M{block_m}_N{block_n}_W{warps}_S{stages}
_C{causal}_H{is_fp16}_Q{q_in_registers}.cubin`` compiled here with
``nvcc -cubin -arch=sm_90 -O3`` from ``kernels/mma_f16.cu``. For each shape it
launches every matching variant (with the split counts given by ``--splits``)
on random normal inputs in the dtype, checks the output against a float64
reference computed on the GPU from the same rounded inputs, with
FlashAttention's rule (max error <= 2 x torch SDPA's own error + 1e-5), and times it
next to torch SDPA's flash, cuDNN and efficient backends with the same loop:
CUDA events around each call, an L2 flush (a 2x-L2 buffer zeroed) before each,
median of ``--repetitions`` after warm-up. A stand-alone probe for developing
the kernel; the tuner's own backend does the same through the family seam.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import re
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

NAME = re.compile(
    r"mma_f16_D(?P<D>\d+)_M(?P<M>\d+)_N(?P<N>\d+)_W(?P<W>\d+)_S(?P<S>\d+)"
    r"_C(?P<C>\d)_H(?P<H>\d)_Q(?P<Q>\d)\.cubin"
)


def parse_shape(text: str) -> tuple[int, int, int, int, bool, str]:
    """``BxHxNxD[c][:dtype]`` e.g. ``4x16x4096x128c:bf16``."""
    body, _, dtype = text.partition(":")
    causal = body.endswith("c")
    b, h, n, d = (int(x) for x in body.rstrip("c").split("x"))
    return b, h, n, d, causal, dtype or "bf16"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cubins", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["1x1x4096x128", "4x16x4096x128", "4x16x4096x128c", "1x16x1000x128",
                 "8x32x1024x64", "1x32x8192x128"],
    )
    parser.add_argument("--splits", nargs="+", type=int, default=[1])
    parser.add_argument("--repetitions", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--parity-only", action="store_true")
    parser.add_argument("--peers", action="store_true", help="also time torch backends")
    parser.add_argument("--top", type=int, default=8, help="variants to print per shape")
    args = parser.parse_args()

    import pycuda.driver as drv
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    torch.cuda.init()
    drv.init()
    context = drv.Device(0).retain_primary_context()
    context.push()
    atexit.register(context.pop)
    flush = torch.empty(2 * 60 * 2**20, dtype=torch.uint8, device="cuda")

    def time_ms(fn: Any) -> tuple[float, float]:
        for _ in range(args.warmup):
            fn()
        samples = []
        for _ in range(args.repetitions):
            flush.zero_()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop))
        q1, _, q3 = statistics.quantiles(samples, n=4)
        return statistics.median(samples), q3 - q1

    variants = []
    for path in sorted(Path(args.cubins).glob("mma_f16_*.cubin")):
        match = NAME.fullmatch(path.name)
        if match:
            variants.append(({k: int(v) for k, v in match.groupdict().items()}, path))
    modules: dict[Path, Any] = {}

    def functions(path: Path) -> tuple[Any, Any]:
        if path not in modules:
            modules[path] = drv.module_from_buffer(path.read_bytes())
        module = modules[path]
        return module.get_function("mma_f16_attention"), module.get_function("mma_f16_split_merge")

    results: dict[str, Any] = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shapes": {},
    }
    # Launches go to the legacy default stream, torch's current stream here.
    for shape_text in args.shapes:
        b, h, n, d, causal, dtype_name = parse_shape(shape_text)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
                   for _ in range(3))
        ref = sdpa(q.double(), k.double(), v.double(), is_causal=causal)
        peer_out = {}
        peers: dict[str, Any] = {}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    peer_out[name] = sdpa(q, k, v, is_causal=causal)
                    if args.peers and not args.parity_only:
                        peers[name] = time_ms(
                            lambda q=q, k=k, v=v, c=causal: sdpa(q, k, v, is_causal=c)
                        )
            except RuntimeError as error:
                peers[name] = str(error).splitlines()[0]
        torch_err = float((peer_out["flash"].double() - ref).abs().max())
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        rows = []
        for cfg, path in variants:
            if (cfg["D"], cfg["C"], cfg["H"]) != (d, int(causal), int(dtype_name == "fp16")):
                continue
            attention, merge = functions(path)
            smem = 2 * (d + 8) * (cfg["M"] + 2 * cfg["S"] * cfg["N"])
            try:
                attention.set_attribute(
                    drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, smem
                )
            except drv.Error as error:
                rows.append({"variant": path.stem, "error": f"{smem} B shared: {error}"})
                continue
            for splits in args.splits:
                tiles = math.ceil(n / cfg["N"])
                per_split = math.ceil(tiles / splits) * cfg["N"]
                real_splits = math.ceil(n / per_split)
                if real_splits != splits:
                    continue
                out = torch.full_like(q, float("nan"))
                part_o = torch.full((b * h * splits * n * d,), float("nan"), device="cuda")
                part_l = torch.full((b * h * splits * n,), float("nan"), device="cuda")
                grid = (math.ceil(n / cfg["M"]), splits, b * h)
                block = (32 * cfg["W"], 1, 1)
                scale = np.float32(math.log2(math.e) / math.sqrt(d))
                total_rows = b * h * n
                merge_grid = (math.ceil(total_rows * d // 4 / 128), 1, 1)

                def run(
                    attention=attention, merge=merge, out=out, part_o=part_o, part_l=part_l,
                    grid=grid, block=block, smem=smem, splits=splits, per_split=per_split,
                    scale=scale, total_rows=total_rows, merge_grid=merge_grid, q=q, k=k, v=v, n=n,
                ) -> None:
                    attention(
                        np.uintp(q.data_ptr()), np.uintp(k.data_ptr()), np.uintp(v.data_ptr()),
                        np.uintp(out.data_ptr()), np.uintp(part_o.data_ptr()),
                        np.uintp(part_l.data_ptr()), np.int32(n), np.int32(n),
                        np.int32(per_split), scale, grid=grid, block=block, shared=smem,
                    )
                    if splits > 1:
                        merge(
                            np.uintp(part_o.data_ptr()), np.uintp(part_l.data_ptr()),
                            np.uintp(out.data_ptr()), np.int32(n), np.int32(splits),
                            np.int32(total_rows), grid=merge_grid, block=(128, 1, 1),
                        )

                name = path.stem + f"_x{splits}"
                try:
                    run()
                    torch.cuda.synchronize()
                except drv.Error as error:
                    rows.append({"variant": name, "error": str(error)})
                    continue
                err = float((out.double() - ref).abs().max())
                ok = bool(err == err and err <= 2 * torch_err + 1e-5)
                row: dict[str, Any] = {"variant": name, "max_err": err, "ok": ok}
                if ok and not args.parity_only:
                    median, iqr = time_ms(run)
                    row.update(ms=median, iqr=iqr, tflops=flops / median / 1e9)
                rows.append(row)
        timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        results["shapes"][shape_text] = {
            "torch_flash_err": torch_err, "peers": peers, "variants": rows,
        }
        print(f"== {shape_text}: torch flash err {torch_err:.2e}; peers "
              + ", ".join(f"{k} {v[0]:.4f} ms" if isinstance(v, tuple) else f"{k} n/a"
                          for k, v in peers.items()))
        bad = [r for r in rows if not r.get("ok")]
        print(f"   {len(rows)} runs, {len(bad)} failed parity/launch"
              + ("".join(f"\n   FAIL {r['variant']} {r.get('max_err', r.get('error'))}"
                         for r in bad[:10])))
        flash = peers.get("flash")
        for r in timed[: args.top]:
            ratio = f" {flash[0] / r['ms']:.2f}x flash" if isinstance(flash, tuple) else ""
            print(f"   {r['variant']:58s} {r['ms']:.4f} ms {r['tflops']:6.1f} TF"
                  f" err {r['max_err']:.1e}{ratio}")
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
