"""kernels.build: the ptxas report parser, variant keys, the cubin cache, compiling the space.

Tests that run nvcc skip themselves, with the reason, where nvcc is absent;
the parser and key tests run everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernels import build
from kernels.build import (
    CompiledKernel,
    CompileFailure,
    KernelSpec,
    compile_kernel,
    compile_many,
    entry_functions,
    parse_ptxas_report,
    source_hash,
)
from tuner.device import H200
from tuner.errors import BackendError
from tuner.planner.space import candidate_space
from tuner.planner.tunable import KernelParams, ResourceUsage, plan_kernel
from tuner.problem import Problem

needs_nvcc = pytest.mark.skipif(
    build.find_nvcc() is None, reason="nvcc not found on PATH or under CUDA_HOME"
)

# nvcc 13.0 -Xptxas -v on tiled.cu (HEAD_DIM=128 TILE_SIZE=128 ROWS_PER_BLOCK=128
# THREADS=64 THREADS_PER_ROW=8): two entries, the second spilling.
PTXAS_TILED = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'split_merge' for 'sm_90'
ptxas info    : Function properties for split_merge
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
ptxas info    : Compile time = 21.055 ms
ptxas info    : Compiling entry function 'tiled_attention' for 'sm_90'
ptxas info    : Function properties for tiled_attention
    2320 bytes stack frame, 7528 bytes spill stores, 8648 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 2320 bytes cumulative stack size
ptxas info    : Compile time = 1448.425 ms
"""

# Older ptxas wording, static shared memory, and a non-inlined device function
# whose properties block must not be taken for an entry's.
PTXAS_OLDER = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for _Z6helperPf
    16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Compiling entry function 'f' for 'sm_80'
ptxas info    : Function properties for f
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, 1024 bytes smem, 352 bytes cmem[0]
ptxas info    : Compiling entry function 'g' for 'sm_80'
ptxas info    : Used 10 registers, used 1 barriers, 4096 bytes smem, 360 bytes cmem[0]
"""

SMALL_TILED = {
    "HEAD_DIM": 32,
    "TILE_SIZE": 16,
    "ROWS_PER_BLOCK": 16,
    "THREADS": 64,
    "THREADS_PER_ROW": 4,
    "CAUSAL": 0,
}


def test_parser_reads_every_entry_function() -> None:
    report = parse_ptxas_report(PTXAS_TILED)
    assert report == {
        "split_merge": ResourceUsage(registers=40),
        "tiled_attention": ResourceUsage(
            registers=255, spill_store_bytes=7528, spill_load_bytes=8648, stack_bytes=2320
        ),
    }


def test_parser_reads_static_shared_memory_and_skips_device_functions() -> None:
    report = parse_ptxas_report(PTXAS_OLDER)
    assert report == {
        "f": ResourceUsage(registers=32, static_shared_bytes=1024),
        "g": ResourceUsage(registers=10, static_shared_bytes=4096),
    }


def test_spills_in_the_report_make_the_plan_infeasible() -> None:
    problem = Problem(4096, 128)
    params = KernelParams("tiled", threads=64, tile_size=64, rows_per_block=128, split_target=8)
    plan = plan_kernel(problem, params, H200)
    judged = plan.with_resources(parse_ptxas_report(PTXAS_TILED)["tiled_attention"], H200)
    assert not judged.feasible and "spills" in judged.reason


# ptxas (nvcc 13.0) on kernels/wgmma_f16.cu with two P sets at 176-key tiles, head_dim 128
PTXAS_SERIALIZED = """\
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized \
due to insufficient register resources for the function 'wgmma_f16_attention'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'wgmma_f16_split_merge' for 'sm_90a'
ptxas info    : Function properties for wgmma_f16_split_merge
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
ptxas info    : Compiling entry function 'wgmma_f16_attention' for 'sm_90a'
ptxas info    : Function properties for wgmma_f16_attention
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
"""


def test_serialised_wgmma_makes_the_plan_infeasible() -> None:
    # Correct but slow: every product waits for the last. No spill shows it; ptxas's note does.
    report = parse_ptxas_report(PTXAS_SERIALIZED)
    assert report["wgmma_f16_attention"] == ResourceUsage(registers=168, serialized_wgmma=True)
    assert not report["wgmma_f16_split_merge"].serialized_wgmma
    plan = plan_kernel(
        Problem(4096, 128, dtype="bfloat16"),
        KernelParams("wgmma_f16", block_n=128, overlap=1),
        H200,
    )
    assert plan.feasible, plan.reason
    judged = plan.with_resources(report["wgmma_f16_attention"], H200)
    assert not judged.feasible and "serialises the wgmma products" in judged.reason


def test_a_cached_entry_reports_what_its_log_says(tmp_path) -> None:
    # entries cached before serialized_wgmma was parsed carry no such field: the log does
    record = {
        "resources": {"wgmma_f16_attention": {"registers": 168}},
        "ptxas_log": PTXAS_SERIALIZED,
    }
    resources = build._recorded_resources(record)
    assert resources["wgmma_f16_attention"].serialized_wgmma
    assert build._recorded_resources({**record, "ptxas_log": ""}) == {
        "wgmma_f16_attention": ResourceUsage(registers=168)
    }


def test_first_error_line_is_the_reason() -> None:
    stderr = "tiled.cu(42): error: static assertion failed\n  static_assert(...)\n"
    assert build.first_error_line(stderr) == "tiled.cu(42): error: static assertion failed"
    assert build.first_error_line("") == "nvcc failed without a message"


def test_source_hash_is_the_sha256_of_the_source_and_its_headers() -> None:
    kernels = Path(build.__file__).parent
    digest = hashlib.sha256()
    for path in build.included_files(kernels / "tiled.cu"):
        name = path.relative_to(kernels).as_posix()
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    assert source_hash("tiled") == digest.hexdigest()
    assert build.included_files(kernels / "tiled.cu")[0] == (kernels / "tiled.cu").resolve()
    assert source_hash("tiled") != source_hash("scalar_online")
    with pytest.raises(ValueError, match="unknown kernel family"):
        source_hash("nope")


def test_plans_differing_only_in_runtime_arguments_share_a_variant() -> None:
    params = KernelParams("tiled", threads=128, tile_size=64, rows_per_block=64, split_target=1)
    short = plan_kernel(Problem(1024, 64), params, H200)
    long = plan_kernel(Problem(8192, 64, batch=2), params, H200)
    assert short.sequence_splits != long.sequence_splits
    assert KernelSpec.from_plan(short) == KernelSpec.from_plan(long)
    causal = plan_kernel(Problem(1024, 64, causal=True), params, H200)
    assert KernelSpec.from_plan(causal).key != KernelSpec.from_plan(short).key


def test_spec_key_names_every_constant_in_a_fixed_order() -> None:
    spec = KernelSpec.of("tiled", dict(reversed(list(SMALL_TILED.items()))))
    assert spec == KernelSpec.of("tiled", SMALL_TILED)
    assert spec.key == (
        "tiled_CAUSAL0_HEAD_DIM32_ROWS_PER_BLOCK16_THREADS64_THREADS_PER_ROW4_TILE_SIZE16"
    )
    assert spec.primary_function == "tiled_attention"


def test_missing_nvcc_and_no_cache_is_a_backend_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(BackendError, match="nvcc not found"):
        compile_kernel(("tiled", SMALL_TILED), tmp_path)


@needs_nvcc
def test_compile_reports_resources_and_writes_a_cubin(tmp_path: Path) -> None:
    result = compile_kernel(("tiled", SMALL_TILED), tmp_path)
    assert isinstance(result, CompiledKernel), result
    assert result.cubin[:4] == b"\x7fELF"
    assert set(result.resources) == {"tiled_attention", "split_merge"}
    assert result.primary_resources.registers > 0
    assert result.arch == "sm_90" and result.nvcc_version == build.nvcc_version()
    assert not result.cache_hit
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert record["source_hash"] == source_hash("tiled")
    assert record["cubin_sha256"] == hashlib.sha256(result.cubin).hexdigest()


@needs_nvcc
def test_a_cache_hit_runs_no_nvcc(tmp_path: Path, monkeypatch) -> None:
    first = compile_kernel(
        ("scalar_online", {"HEAD_DIM": 64, "THREADS": 64, "CAUSAL": 1}), tmp_path
    )
    assert isinstance(first, CompiledKernel)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"a cache hit ran a subprocess: {args}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert build.find_nvcc() is None
    hit = compile_kernel(("scalar_online", {"CAUSAL": 1, "THREADS": 64, "HEAD_DIM": 64}), tmp_path)
    assert isinstance(hit, CompiledKernel) and hit.cache_hit
    assert hit.cubin == first.cubin and hit.resources == first.resources
    assert hit.nvcc_version == first.nvcc_version


@needs_nvcc
def test_a_cubin_that_does_not_match_its_report_is_recompiled(tmp_path: Path) -> None:
    first = compile_kernel(("tiled", SMALL_TILED), tmp_path)
    assert isinstance(first, CompiledKernel)
    first.cubin_path.write_bytes(b"half a file")
    again = compile_kernel(("tiled", SMALL_TILED), tmp_path)
    assert isinstance(again, CompiledKernel) and not again.cache_hit
    assert again.cubin == first.cubin


@needs_nvcc
def test_concurrent_writers_leave_one_whole_entry(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        from kernels.build import compile_kernel, CompiledKernel
        result = compile_kernel(("tiled", {SMALL_TILED!r}), {str(tmp_path)!r})
        assert isinstance(result, CompiledKernel), result
        """
    )
    root = Path(build.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    writers = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
        for _ in range(4)
    ]
    for writer in writers:
        _, stderr = writer.communicate(timeout=300)
        assert writer.returncode == 0, stderr.decode()
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert len(list(tmp_path.glob("*.cubin"))) == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left"
    hit = compile_kernel(("tiled", SMALL_TILED), tmp_path)
    assert isinstance(hit, CompiledKernel) and hit.cache_hit


@needs_nvcc
def test_a_compile_error_is_a_value(tmp_path: Path) -> None:
    broken = {**SMALL_TILED, "TILE_SIZE": 6}
    result = compile_kernel(("tiled", broken), tmp_path)
    assert isinstance(result, CompileFailure)
    assert "static assertion failed" in result.reason and "error" in result.reason
    assert "\n" not in result.reason and "static_assert" in result.stderr
    assert not list(tmp_path.glob("*.json"))


@needs_nvcc
def test_compile_many_dedupes_variants_and_reports_progress(tmp_path: Path) -> None:
    params = KernelParams("tiled", threads=64, tile_size=16, rows_per_block=16, split_target=1)
    plans = [plan_kernel(Problem(n, 32), params, H200) for n in (64, 100, 1000)]
    seen: list[tuple[int, int]] = []
    results = compile_many(plans, tmp_path, jobs=2, progress=lambda d, t, r: seen.append((d, t)))
    assert list(results) == [KernelSpec.from_plan(plans[0]).key]
    assert seen == [(1, 1)]


def space_variants() -> list:
    plans = []
    for causal in (False, True):
        plans += candidate_space(Problem(4096, 128, causal=causal), H200).feasible
    return plans


@needs_nvcc
def test_every_variant_of_the_default_space_compiles(tmp_path: Path) -> None:
    """Problem(4096, 128), full and causal: every float32 family's variants (SIMT and TF32)."""
    plans = space_variants()
    results = compile_many(plans, tmp_path)
    failures = {key: r.reason for key, r in results.items() if isinstance(r, CompileFailure)}
    assert not failures
    assert len(results) == len({KernelSpec.from_plan(p).key for p in plans})
    for plan in plans:
        compiled = results[KernelSpec.from_plan(plan).key]
        assert isinstance(compiled, CompiledKernel)
        attention, *merges = entry_functions(plan.family)
        assert compiled.resources[attention].registers > 0
        for merge in merges:
            assert compiled.resources.get(merge, ResourceUsage(1)).registers > 0
        # Dynamic shared memory only: the planner's byte count is the whole story.
        assert compiled.primary_resources.static_shared_bytes == 0
        plan.with_resources(compiled.primary_resources, H200)  # judged without error


@needs_nvcc
def test_a_variant_with_every_switch_on_caches_under_a_short_name(tmp_path: Path) -> None:
    # a Hopper plan with a window, softcap and sinks spells a key that, with the cache's
    # suffixes, passes the longest file name (255): the cache names it by a cut key and the
    # digest
    problem = Problem(300, 128, heads=8, kv_heads=2, kv_len=1500, causal=True,
                      dtype="bfloat16", window_left=200, softcap=30.0, sinks=True)  # fmt: skip
    params = KernelParams("wgmma_f16", block_n=176, overlap=1, pingpong=1, late_pack=1)
    plan = plan_kernel(problem, params, H200)
    assert plan.feasible, plan.reason
    spec = build.KernelSpec.from_plan(plan)
    # the temporary cubin's name once was "." + key + "-" + 20 + "-" + 8 + ".cubin.XXXXXXXX.tmp"
    assert len(spec.key) + 50 > 255
    first = compile_kernel(plan, tmp_path)
    assert isinstance(first, CompiledKernel), first
    assert not first.primary_resources.serialized_wgmma
    assert all(len(path.name) < 255 - 20 for path in tmp_path.iterdir())
    assert compile_kernel(plan, tmp_path).cache_hit
    # a variant differing past the cut is another entry
    staged = params.tunables | {"staged_store": 1}
    other = plan_kernel(problem, KernelParams("wgmma_f16", **staged), H200)
    assert not compile_kernel(other, tmp_path).cache_hit
