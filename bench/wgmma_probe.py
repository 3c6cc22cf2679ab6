"""Probe the wgmma_f16 kernel (kernels/wgmma_f16.cu, issue 14): build its variants, then test them.

    python bench/wgmma_probe.py build --out DIR [--only D128_C2]          # here: nvcc, no GPU
    python bench/wgmma_probe.py run --cubins DIR --out $OUT/probe.json    # on the H200, torch

``build`` compiles the variant grid (head_dim 64/128, bf16/fp16, 1 or 2 consumer warpgroups,
key tiles 64/128, 2-4 stages, causal or not, where the ring fits in shared memory) with
``nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -Xptxas -v`` into ``DIR`` as
``wgmma_f16_D{d}_C{consumers}_N{block_n}_S{stages}_K{causal}_H{is_fp16}_B{blocks_per_sm}.cubin``
and writes ``DIR/ptxas.json``: registers, spill bytes, stack frame, the HGMMA count of the SASS
and any ptxas warning, per variant.

``run`` loads each cubin through the driver API (``kernels.cuda_driver``, in torch's context),
builds the three tensor maps per shape with ``cuTensorMapEncodeTiled`` (3-D: head_dim, rows,
heads; box {64, rows, 1}; 128-byte swizzle; out-of-bounds rows read as zeros), launches it on
random normal inputs, and checks sampled query rows against a float64 reference computed on the
GPU from the same rounded inputs (bottom-right causal mask, GQA kv head = head // group), with
FlashAttention's rule: max error <= 2 x torch SDPA's own error on those rows + 1e-5. Variants
that pass are timed next to torch SDPA's flash and cuDNN backends with the same loop (CUDA
events around each call, an L2 flush before each, median of ``--repetitions`` after warm-up).
A hang shows as the command's time limit; each shape prints its line as it finishes and the
JSON is rewritten after every shape, so a late failure keeps the early results.

Shapes: ``BxHxNxD[c][:bf16|:fp16][:g<group>][:kv<kv_len>]``, e.g. ``4x16x4096x128``,
``2x16x1000x128c:g4:kv1500`` (16 query heads over 4 kv heads, 1500 keys, bottom-right causal).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "wgmma_f16.cu"
NAME = re.compile(
    r"wgmma_f16_D(?P<D>\d+)_C(?P<C>\d)_N(?P<N>\d+)_S(?P<S>\d)_K(?P<K>\d)_H(?P<H>\d)_B(?P<B>\d)"
    r"(?:_O(?P<O>\d))?(?P<G>_dbgS)?"
)
SMEM_PER_BLOCK = 232448  # 227 KB, sm_90's opt-in limit a block
SMEM_PER_SM = 233472  # 228 KB

# cuda.h enums (CUDA 12/13)
TENSOR_MAP_BFLOAT16, TENSOR_MAP_FLOAT16 = 9, 6
INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_ZERO = 0, 3, 3, 0


@dataclass(frozen=True)
class Variant:
    head_dim: int
    consumers: int
    block_n: int
    stages: int
    causal: bool
    fp16: bool
    blocks_per_sm: int
    debug_s: bool = False  # DEBUG_S=1: tile 0's raw scores also go to partial_o
    overlap: bool = False  # OVERLAP=1: FA3's softmax(t) under P V(t-1)

    @property
    def name(self) -> str:
        return (f"wgmma_f16_D{self.head_dim}_C{self.consumers}_N{self.block_n}_S{self.stages}"
                f"_K{int(self.causal)}_H{int(self.fp16)}_B{self.blocks_per_sm}"
                + ("_O1" if self.overlap else "") + ("_dbgS" if self.debug_s else ""))

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def consumer_registers(self) -> int:
        """setmaxnreg's target for consumers: what 64K / blocks leaves after 24 for the producer."""
        per_block = 65536 // self.blocks_per_sm
        return min(240, (per_block // 128 - 24) // self.consumers // 8 * 8)

    @property
    def shared_bytes(self) -> int:
        """SMEM_BYTES of kernels/wgmma_f16.cu: Q tiles, the K and V ring, barriers, 1024 slack."""
        q_tiles = self.consumers * 64 * self.head_dim * 2
        ring = 2 * self.stages * self.block_n * self.head_dim * 2
        tiles = q_tiles + ring
        return tiles + 8 * (1 + 3 * self.stages) + 1024

    def fits(self) -> bool:
        return (self.shared_bytes <= SMEM_PER_BLOCK
                and self.blocks_per_sm * self.shared_bytes <= SMEM_PER_SM)

    def defines(self) -> list[str]:
        return [f"-DHEAD_DIM={self.head_dim}", f"-DCONSUMERS={self.consumers}",
                f"-DBLOCK_N={self.block_n}", f"-DSTAGES={self.stages}",
                f"-DCAUSAL={int(self.causal)}", f"-DIS_FP16={int(self.fp16)}",
                f"-DBLOCKS_PER_SM={self.blocks_per_sm}",
                f"-DCONSUMER_REGISTERS={self.consumer_registers}", f"-DDEBUG_S={int(self.debug_s)}",
                f"-DOVERLAP={int(self.overlap)}"]

    @classmethod
    def parse(cls, stem: str) -> Variant | None:
        match = NAME.fullmatch(stem)
        if not match:
            return None
        debug_s = match.group("G") is not None
        overlap = match.group("O") == "1"
        g = {k: int(v) for k, v in match.groupdict().items() if k not in ("G", "O")}
        return cls(g["D"], g["C"], g["N"], g["S"], bool(g["K"]), bool(g["H"]), g["B"], debug_s,
                   overlap)


def variant_grid(overlap: bool = False) -> list[Variant]:
    grid = []
    for d, c, n, s, k, h, b in itertools.product(
        (64, 128), (1, 2), (64, 128), (2, 3, 4), (False, True), (False, True), (1, 2)
    ):
        variant = Variant(d, c, n, s, k, h, b, overlap=overlap)
        if b == 2 and c == 2:
            continue  # two 3-warpgroup blocks leave consumers too few registers
        if variant.fits():
            grid.append(variant)
    return grid


def diagnosis_grid() -> list[Variant]:
    """One DEBUG_S build per head_dim x consumers x key tile x overlap (bf16, non-causal,
    2 stages). (The first device run also had eight builds with V's descriptor offsets
    exchanged: they faulted, which settled the layout; see the kernel's mn_major_descriptor.)"""
    return [Variant(d, c, n, 2, False, False, 1, debug_s=True, overlap=o)
            for d, c, n, o in itertools.product((64, 128), (1, 2), (64, 128), (False, True))]


# ---------------------------------------------------------------- build (here)


def build(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    report_path = out / "ptxas.json"
    if report_path.exists():
        report = json.loads(report_path.read_text())
    grid = diagnosis_grid() if args.debug_s else variant_grid(overlap=args.overlap)
    chosen = [v for v in grid if not args.only or all(token in v.name for token in args.only)]

    def compile_one(variant: Variant) -> tuple[Variant, list[str], Any]:
        cubin = out / f"{variant.name}.cubin"
        command = ["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3",
                   "-Xptxas", "-v", *variant.defines(), str(SOURCE), "-o", str(cubin)]
        return variant, command, subprocess.run(command, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        compiled = pool.map(compile_one, chosen)
        for variant, command, done in compiled:
            record(out, report, variant, command, done)
            report_path.write_text(json.dumps(report, indent=1, sort_keys=True))
    return 0


def record(out: Path, report: dict[str, Any], variant: Variant, command: list[str],
           done: Any) -> None:
    """ptxas's report of one variant and what its SASS holds, into ``report``."""
    cubin = out / f"{variant.name}.cubin"
    text = done.stdout + done.stderr
    entry: dict[str, Any] = {"command": " ".join(shlex.quote(a) for a in command),
                             "returncode": done.returncode,
                             "shared_bytes": variant.shared_bytes}
    attention = text.split("Compiling entry function 'wgmma_f16_attention'")[-1]
    if m := re.search(r"Used (\d+) registers", attention):
        entry["registers"] = int(m.group(1))
    frame = r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
    if m := re.search(frame, attention):
        entry.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                     spill_loads=int(m.group(3)))
    entry["warnings"] = [line for line in text.splitlines() if "warning" in line.lower()]
    if done.returncode == 0:
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True,
                              text=True).stdout
        entry["hgmma"] = len(re.findall(r"\bHGMMA\.", sass))
        entry["setmaxnreg"] = len(re.findall(r"USETMAXREG", sass))
        entry["local_memory_ops"] = len(re.findall(r"\b(LDL|STL)\b", sass))
    else:
        entry["error"] = text[-2000:]
    report[variant.name] = entry
    print(f"{variant.name}: rc {done.returncode} regs {entry.get('registers')} "
          f"spills {entry.get('spill_stores')}/{entry.get('spill_loads')} "
          f"hgmma {entry.get('hgmma')} warnings {len(entry['warnings'])}", flush=True)


# ---------------------------------------------------------------- run (device)


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    causal: bool
    dtype: str
    group: int
    kv_len: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        body, *options = text.split(":")
        causal = body.endswith("c")
        b, h, n, d = (int(x) for x in body.rstrip("c").split("x"))
        dtype, group, kv_len = "bf16", 1, n
        for option in options:
            if option in ("bf16", "fp16"):
                dtype = option
            elif option.startswith("g"):
                group = int(option[1:])
            elif option.startswith("kv"):
                kv_len = int(option[2:])
            else:
                raise SystemExit(f"shape {text!r}: unknown option {option!r}")
        if h % group:
            raise SystemExit(f"shape {text!r}: {h} heads do not split into groups of {group}")
        return cls(b, h, n, d, causal, dtype, group, kv_len)


def encode_tensor_map(library: Any, tensor: Any, rows: int, heads: int, box_rows: int,
                      fp16: bool) -> Any:
    """A CUtensorMap (128 bytes, 64-byte aligned) over ``tensor`` [heads][rows][head_dim]."""
    head_dim = tensor.shape[-1]
    backing = ctypes.create_string_buffer(128 + 64)
    address = (ctypes.addressof(backing) + 63) // 64 * 64
    tensor_map = (ctypes.c_uint64 * 16).from_address(address)
    tensor_map._backing = backing  # type: ignore[attr-defined]  # keep the storage alive
    u64x3, u64x2, u32x3 = ctypes.c_uint64 * 3, ctypes.c_uint64 * 2, ctypes.c_uint32 * 3
    status = library.cuTensorMapEncodeTiled(
        ctypes.c_void_p(address),
        ctypes.c_int(TENSOR_MAP_FLOAT16 if fp16 else TENSOR_MAP_BFLOAT16),
        ctypes.c_uint32(3),
        ctypes.c_void_p(tensor.data_ptr()),
        u64x3(head_dim, rows, heads),
        u64x2(head_dim * 2, rows * head_dim * 2),
        u32x3(64, box_rows, 1),
        u32x3(1, 1, 1),
        ctypes.c_int(INTERLEAVE_NONE),
        ctypes.c_int(SWIZZLE_128B),
        ctypes.c_int(L2_PROMOTION_256B),
        ctypes.c_int(OOB_FILL_ZERO),
    )
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: CUDA error {status}")
    return tensor_map


def run(args: argparse.Namespace) -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from kernels.cuda_driver import CudaDriver, libcuda, pack_launch

    torch.cuda.init()
    if torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit(f"sm_90a cubins need a Hopper GPU, not {torch.cuda.get_device_name()}")
    torch.zeros(1, device="cuda")  # torch's primary context exists from here
    library = libcuda()
    driver = CudaDriver(library)
    context = ctypes.c_void_p()  # ... and is made current for the driver calls below
    driver.check(library.cuDevicePrimaryCtxRetain(ctypes.byref(context), 0), "primary context")
    driver.set_context(int(context.value or 0))
    stream = torch.cuda.current_stream().cuda_stream
    flush = torch.empty(2 * 60 * 2**20, dtype=torch.uint8, device="cuda")

    ptxas_path = Path(args.cubins) / "ptxas.json"
    ptxas = json.loads(ptxas_path.read_text()) if ptxas_path.exists() else {}
    variants = [(v, p) for p in sorted(Path(args.cubins).glob("wgmma_f16_*.cubin"))
                if (v := Variant.parse(p.stem)) is not None and v.debug_s == args.diagnose]
    functions: dict[str, tuple[int, int]] = {}

    def load(variant: Variant, path: Path) -> tuple[int, int]:
        if variant.name not in functions:
            module = driver.load_module(path.read_bytes())
            attention = driver.get_function(module, "wgmma_f16_attention")
            driver.set_max_dynamic_shared(attention, variant.shared_bytes)
            merge = driver.get_function(module, "wgmma_f16_split_merge")
            functions[variant.name] = (attention, merge)
        return functions[variant.name]

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

    def finish_or_exit(name: str, results: dict[str, Any], shape_text: str,
                       runs: list[dict[str, Any]]) -> None:
        """Wait for the launch at most ``--hang-seconds``: a kernel that deadlocks on an
        mbarrier would hold the device until the command's limit. On a hang, record it and
        leave the process (its context goes with it, and the device with it)."""
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + args.hang_seconds
        while not done.query():
            if time.monotonic() > deadline:
                runs.append({"variant": name, "error": f"no completion in {args.hang_seconds} s"})
                results["shapes"][shape_text] = {"variants": runs, "fatal": f"{name} hangs"}
                Path(args.out).write_text(json.dumps(results, indent=1))
                print(f"   HANG {name}: no completion in {args.hang_seconds} s", flush=True)
                os._exit(3)
            time.sleep(0.01)
        torch.cuda.synchronize()

    results: dict[str, Any] = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {},
    }
    for shape_text in args.shapes:
        shape = Shape.parse(shape_text)
        b, h, n, d, lk = shape.batch, shape.heads, shape.seq_len, shape.head_dim, shape.kv_len
        kv_heads = h // shape.group
        dtype = torch.float16 if shape.dtype == "fp16" else torch.bfloat16
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(b, kv_heads, lk, d, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(b, kv_heads, lk, d, device="cuda", dtype=dtype, generator=gen)
        # Sampled query rows: random ones plus both ends (the last block is the ragged one).
        picked = torch.randperm(n, generator=torch.Generator().manual_seed(1))[: args.rows]
        ends = [torch.arange(min(8, n)), torch.arange(max(0, n - 8), n)]
        rows = torch.unique(torch.cat([picked, *ends])).to("cuda")
        k64 = k.double().repeat_interleave(shape.group, dim=1)
        v64 = v.double().repeat_interleave(shape.group, dim=1)
        scores = q[:, :, rows].double() @ k64.transpose(-1, -2) / math.sqrt(d)
        mask = None
        if shape.causal:  # bottom-right: row r sees keys <= r + (kv_len - seq_len)
            mask = torch.arange(lk, device="cuda")[None, :] <= (rows[:, None] + (lk - n))
            scores = scores.masked_fill(~mask, float("-inf"))
        ref = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v64
        del scores, k64, v64

        def torch_attention(q=q, k=k, v=v, shape=shape) -> Any:
            if shape.causal and shape.kv_len != shape.seq_len:
                full = (torch.arange(shape.kv_len, device="cuda")[None, :]
                        <= torch.arange(shape.seq_len, device="cuda")[:, None]
                        + (shape.kv_len - shape.seq_len))
                return sdpa(q, k, v, attn_mask=full, enable_gqa=shape.group > 1)
            return sdpa(q, k, v, is_causal=shape.causal, enable_gqa=shape.group > 1)

        torch_err = float((torch_attention()[:, :, rows].double() - ref).abs().max())
        peers: dict[str, Any] = {}
        if not args.parity_only:
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                  ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(backend):
                        torch_attention()
                        peers[name] = time_ms(torch_attention)
                except RuntimeError as error:
                    peers[name] = str(error).splitlines()[0]
        flops = 4 * b * h * n * lk * d * (0.5 if shape.causal and n == lk else 1.0)

        def scores_check(part_o: Any, variant: Variant, q=q, k=k, shape=shape, rows=rows) -> str:
            """DEBUG_S: tile 0's raw scores against q @ k[:block_n]^T in float64; where they
            differ, which row % 8 and 8-column groups (a swizzle or descriptor error shows as
            a pattern there)."""
            width = variant.block_n
            batch, heads, length, dim = q.shape
            got = part_o[: q.numel() // dim * width].view(batch, heads, length, width)
            got = got[:, :, rows].double()
            keys = torch.zeros(batch, k.shape[1], width, dim, device="cuda", dtype=torch.float64)
            keys[:, :, : min(width, k.shape[2])] = k[:, :, :width].double()
            keys = keys.repeat_interleave(shape.group, 1)
            want = q[:, :, rows].double() @ keys.transpose(-1, -2)
            diff = (got - want).abs().nan_to_num(float("inf"))
            bad = diff > 1e-3 * max(1.0, float(want.abs().max()))
            if not bool(bad.any()):
                return f"ok (max err {float(diff.max()):.2e})"
            where = bad.nonzero()
            row_mod8 = sorted({int(r) % 8 for r in rows[where[:, 2]].tolist()})
            col_groups = sorted({int(c) // 8 for c in where[:, 3].tolist()})
            return (f"WRONG: {float(bad.double().mean()):.1%} of scores, max err "
                    f"{float(diff.max()):.2e}; rows % 8 {row_mod8}; "
                    f"column groups of 8 {col_groups}")

        runs: list[dict[str, Any]] = []
        for variant, path in variants:
            fp16 = shape.dtype == "fp16"
            if (variant.head_dim, variant.causal, variant.fp16) != (d, shape.causal, fp16):
                continue
            try:
                attention, merge = load(variant, path)
                q_map = encode_tensor_map(library, q, n, b * h, 64, variant.fp16)
                kv_box = variant.block_n
                k_map = encode_tensor_map(library, k, lk, b * kv_heads, kv_box, variant.fp16)
                v_map = encode_tensor_map(library, v, lk, b * kv_heads, kv_box, variant.fp16)
            except Exception as error:  # noqa: BLE001 - a failing variant is a row of the report
                runs.append({"variant": variant.name, "error": str(error)})
                continue
            for splits in args.splits:
                tiles = math.ceil(lk / variant.block_n)
                per_split = math.ceil(tiles / splits) * variant.block_n
                if math.ceil(lk / per_split) != splits:
                    continue
                out = torch.full_like(q, float("nan"))
                width = max(d, variant.block_n)  # DEBUG_S writes block_n scores a row
                part_o = torch.full((b * h * splits * n * width,), float("nan"), device="cuda")
                part_l = torch.full((b * h * splits * n,), float("nan"), device="cuda")
                arguments = (
                    q_map, k_map, v_map,
                    *(ctypes.c_void_p(t.data_ptr()) for t in (q, k, v, out, part_o, part_l)),
                    ctypes.c_int32(n), ctypes.c_int32(lk), ctypes.c_int32(shape.group),
                    ctypes.c_int32(per_split), ctypes.c_float(math.log2(math.e) / math.sqrt(d)),
                )
                launch = driver.bind_launch(pack_launch(
                    variant.name, attention, (math.ceil(n / variant.block_m), splits, b * h),
                    (variant.threads, 1, 1), variant.shared_bytes, arguments), stream)
                total_rows = b * h * n
                merge_launch = driver.bind_launch(pack_launch(
                    "merge", merge, (math.ceil(total_rows * d // 4 / 128), 1, 1), (128, 1, 1), 0,
                    (ctypes.c_void_p(part_o.data_ptr()), ctypes.c_void_p(part_l.data_ptr()),
                     ctypes.c_void_p(out.data_ptr()), ctypes.c_int32(n), ctypes.c_int32(splits),
                     ctypes.c_int32(total_rows))), stream)

                def call(launch=launch, merge_launch=merge_launch, splits=splits) -> None:
                    status = launch()
                    if status == 0 and splits > 1:
                        status = merge_launch()
                    if status != 0:
                        raise RuntimeError(driver.error_string(status))

                name = f"{variant.name}_x{splits}"
                try:
                    call()
                    finish_or_exit(name, results, shape_text, runs)
                except RuntimeError as error:
                    runs.append({"variant": name, "error": str(error)})
                    if "illegal" in str(error) or "launch failed" in str(error):
                        # The context is lost: record what failed and stop.
                        results["shapes"][shape_text] = {"variants": runs, "fatal": str(error)}
                        Path(args.out).write_text(json.dumps(results, indent=1))
                        raise
                    continue
                err = float((out[:, :, rows].double() - ref).abs().max())
                ok = bool(err == err and err <= 2 * torch_err + 1e-5)
                if variant.debug_s and splits == 1:
                    print(f"   {name} S check: {scores_check(part_o, variant)}", flush=True)
                    # With Q = 0 every visible key has P = 1: O is the mean of V's rows, which
                    # tests V's MN-major descriptor apart from S and the P fragment layout.
                    saved = q.clone()
                    q.zero_()
                    call()
                    finish_or_exit(name, results, shape_text, runs)
                    mean = v.double().mean(dim=2, keepdim=True).repeat_interleave(shape.group, 1)
                    diff = (out.double() - mean).abs().nan_to_num(float("inf"))
                    bad = diff > 5e-3
                    verdict = f"ok (max err {float(diff.max()):.2e})"
                    if bool(bad.any()):
                        groups = sorted({int(c) // 8 for c in bad.nonzero()[:, 3].tolist()})
                        verdict = (f"WRONG: {float(bad.double().mean()):.1%} of outputs, max err "
                                   f"{float(diff.max()):.2e}; column groups of 8 {groups}")
                    print(f"   {name} P = 1 (Q = 0) check: {verdict}", flush=True)
                    q.copy_(saved)
                row: dict[str, Any] = {"variant": name, "max_err": err, "ok": ok,
                                       "ptxas": {key: ptxas.get(variant.name, {}).get(key)
                                                 for key in ("registers", "spill_stores", "hgmma")}}
                if ok and not args.parity_only:
                    median, iqr = time_ms(call)
                    row.update(ms=median, iqr=iqr, tflops=flops / median / 1e9)
                runs.append(row)
        results["shapes"][shape_text] = {"torch_err": torch_err, "sampled_rows": int(rows.numel()),
                                         "peers": peers, "variants": runs}
        Path(args.out).write_text(json.dumps(results, indent=1))
        bad = [r for r in runs if not r.get("ok")]
        print(f"== {shape_text}: torch err {torch_err:.2e}; peers "
              + ", ".join(f"{k} {v[0]:.4f} ms" if isinstance(v, tuple) else f"{k} n/a"
                          for k, v in peers.items())
              + f"; {len(runs)} runs, {len(bad)} failed", flush=True)
        for r in bad[:12]:
            print(f"   FAIL {r['variant']} {r.get('max_err', r.get('error'))}")
        cudnn = peers.get("cudnn")
        for r in sorted((r for r in runs if "ms" in r), key=lambda r: r["ms"])[: args.top]:
            ratio = f" {cudnn[0] / r['ms']:.2f}x cudnn" if isinstance(cudnn, tuple) else ""
            print(f"   {r['variant']:44s} {r['ms']:.4f} ms {r['tflops']:6.1f} TF"
                  f" err {r['max_err']:.1e}{ratio}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="compile the variant grid here (nvcc)")
    build_parser.add_argument("--out", required=True)
    build_parser.add_argument("--only", nargs="*", default=[],
                              help="keep variants whose name holds every token, e.g. D128 K0")
    build_parser.add_argument("--jobs", type=int, default=1, help="nvcc processes at once")
    build_parser.add_argument("--debug-s", action="store_true",
                              help="build the 24 DEBUG_S variants `run --diagnose` reads instead")
    build_parser.add_argument("--overlap", action="store_true",
                              help="build the grid with OVERLAP=1 (names end in _O1)")
    run_parser = commands.add_parser("run", help="parity and timing on the GPU (torch)")
    run_parser.add_argument("--cubins", required=True)
    run_parser.add_argument("--out", required=True)
    run_parser.add_argument(
        "--shapes", nargs="+",
        default=["1x2x256x64", "1x2x300x128c", "2x16x1000x128:g4:kv1500",
                 "2x16x1000x128c:g4:kv1500", "1x4x512x64:fp16", "4x16x4096x128",
                 "4x16x4096x128c", "1x32x8192x128", "8x32x1024x64"],
    )
    run_parser.add_argument("--splits", nargs="+", type=int, default=[1, 3])
    run_parser.add_argument("--rows", type=int, default=192, help="sampled query rows a head")
    run_parser.add_argument("--repetitions", type=int, default=30)
    run_parser.add_argument("--warmup", type=int, default=5)
    run_parser.add_argument("--parity-only", action="store_true")
    run_parser.add_argument("--diagnose", action="store_true",
                            help="run the DEBUG_S cubins (build --debug-s) and check S alone too")
    run_parser.add_argument("--top", type=int, default=6, help="variants to print per shape")
    run_parser.add_argument("--hang-seconds", type=float, default=10.0,
                            help="a launch not done after this long is a hang: record, exit 3")
    args = parser.parse_args()
    return build(args) if args.command == "build" else run(args)


if __name__ == "__main__":
    sys.exit(main())
