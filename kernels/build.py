"""Kernel sources plus compile-time constants -> cubins, compiled in parallel and cached on disk.

A kernel variant is its family, its constants (``KernelPlan.compile_defines``),
the hash of its source (the ``.cu`` and every header it includes from the shared device
layer under ``kernels/include/``, transitively), the target arch and the nvcc that
compiled it.
``seq_len`` and the split partition are launch arguments, so many plans share
one variant: ``compile_many`` compiles each variant once.

The cache holds, per variant, ``<name>.cubin`` and ``<name>.json`` (ptxas's
parsed report, the cubin's sha256 and the nvcc version). Both are written to a
temporary file and moved into place with ``os.replace``, so tuners sharing a
cache directory never read half a file; the JSON is written last and names the
cubin's hash, so a JSON without its matching cubin is a miss, never a bad hit.
A hit runs no nvcc at all: where nvcc is absent, an entry compiled by any nvcc
for the same source, constants and arch is served (deployment machines carry
cubins, not compilers).

Compile errors are values (``CompileFailure``); only a missing nvcc is an
exception (``tuner.errors.BackendError``), since then nothing can be compiled.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuner.errors import BackendError
from tuner.planner.errors import PlanError
from tuner.planner.families import KernelFamily, family_named, family_names, registered
from tuner.planner.plan import ResourceUsage

if TYPE_CHECKING:
    from tuner.planner.plan import KernelPlan

KERNEL_DIR = Path(__file__).resolve().parent
#: the shared device layer (``fa/*.cuh``), on nvcc's include path
INCLUDE_DIR = KERNEL_DIR / "include"
DEFAULT_ARCH = "sm_90"
#: bumped when the flags or the cache layout change, so old entries are never served
CACHE_FORMAT = 1
#: ``-lineinfo`` stays off: it can change register allocation, and timings
#: must describe the cubin that is deployed.
NVCC_FLAGS: tuple[str, ...] = ("-cubin", "-O3", "-Xptxas", "-v")



def entry_functions(family: str) -> tuple[str, ...]:
    """The family's entry functions; the first is the one whose resources judge the plan."""
    return _family(family).entry_functions


def sources() -> dict[str, str]:
    """Family -> its ``.cu`` file under ``kernels/``, for every registered family."""
    return {family.name: family.source for family in registered()}


class _FamilyTable(Mapping[str, Any]):
    """A read-only view over the registered families (one attribute of each)."""

    def __init__(self, attribute: str) -> None:
        self._attribute = attribute

    def __getitem__(self, name: str) -> Any:
        return getattr(_family(name), self._attribute)

    def __iter__(self) -> Iterator[str]:
        return iter(family_names())

    def __len__(self) -> int:
        return len(family_names())


#: family -> ``.cu`` file name and family -> entry functions, live over the registry
SOURCES: Mapping[str, str] = _FamilyTable("source")
ENTRY_FUNCTIONS: Mapping[str, tuple[str, ...]] = _FamilyTable("entry_functions")


def _family(name: str) -> KernelFamily:
    try:
        return family_named(name)
    except PlanError as error:
        raise ValueError(str(error)) from None


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One kernel variant before the toolchain: family and compile-time constants."""

    family: str
    defines: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, family: str, defines: Mapping[str, int]) -> KernelSpec:
        _family(family)
        return cls(family, tuple(sorted((name, int(value)) for name, value in defines.items())))

    @classmethod
    def from_plan(cls, plan: KernelPlan) -> KernelSpec:
        return cls.of(plan.family, plan.compile_defines())

    @property
    def key(self) -> str:
        """A readable name built from every constant, so two variants never share one."""
        return self.family + "".join(f"_{name}{value}" for name, value in self.defines)

    @property
    def primary_function(self) -> str:
        return entry_functions(self.family)[0]

    @property
    def nvcc_flags(self) -> tuple[str, ...]:
        """The build's flags and the family's own."""
        return NVCC_FLAGS + _family(self.family).nvcc_flags

    def arch(self, device_arch: str) -> str:
        """The family's pinned arch (``sm_90a``), else the device's."""
        return _family(self.family).arch_for(device_arch)


@dataclass(frozen=True, slots=True)
class CompiledKernel:
    spec: KernelSpec
    cubin_path: Path
    #: the bytes checked against the report's hash (the file may be replaced meanwhile)
    cubin: bytes = field(repr=False)
    #: ptxas's report for every entry function of the cubin
    resources: dict[str, ResourceUsage]
    source_hash: str
    arch: str
    nvcc_version: str
    ptxas_log: str = field(default="", repr=False)
    cache_hit: bool = False

    @property
    def key(self) -> str:
        return self.spec.key

    @property
    def primary_resources(self) -> ResourceUsage:
        return self.resources[self.spec.primary_function]


@dataclass(frozen=True, slots=True)
class CompileFailure:
    spec: KernelSpec
    reason: str  # the first error line, for a trial's one-line record
    stderr: str = field(default="", repr=False)

    @property
    def key(self) -> str:
        return self.spec.key


CompileResult = CompiledKernel | CompileFailure
Progress = Callable[[int, int, CompileResult], None]


def source_path(family: str) -> Path:
    return KERNEL_DIR / _family(family).source


#: ``#include "path"`` (quoted: the project's own headers; <system> headers are the toolkit's)
_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def included_files(source: Path) -> tuple[Path, ...]:
    """``source`` and every file it includes with quotes, transitively, each once, in the
    order first reached: what its compiled code depends on besides the toolkit. A quoted
    include resolves as nvcc resolves it: beside the including file, then in ``INCLUDE_DIR``;
    one found in neither is left out here (nvcc reports it when compiling)."""
    seen: dict[Path, None] = {}
    pending = [source.resolve()]
    while pending:
        path = pending.pop(0)
        if path in seen:
            continue
        seen[path] = None
        for name in _QUOTED_INCLUDE.findall(path.read_text()):
            for directory in (path.parent, INCLUDE_DIR):
                candidate = (directory / name).resolve()
                if candidate.is_file():
                    pending.append(candidate)
                    break
    return tuple(seen)


def source_hash(family: str) -> str:
    """sha256 over the family's ``.cu`` and every header it includes (names relative to
    ``kernels/`` and bytes): the registry never serves a plan of other source, and a change
    to a shared header changes the hash of exactly the families that include it."""
    digest = hashlib.sha256()
    for path in included_files(source_path(family)):
        inside = path.is_relative_to(KERNEL_DIR)
        name = path.relative_to(KERNEL_DIR).as_posix() if inside else path.name
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


# ---------------------------------------------------------------------------- nvcc


def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME or $CUDA_PATH; None where there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home and os.access(Path(home) / "bin" / "nvcc", os.X_OK):
            return str(Path(home) / "bin" / "nvcc")
    return None


def _missing_nvcc() -> BackendError:
    return BackendError(
        "nvcc not found: put the CUDA toolkit's bin directory on PATH (or set CUDA_HOME) "
        "to compile kernels; only cached cubins can be used without it"
    )


@functools.lru_cache(maxsize=8)
def _nvcc_version_of(nvcc: str) -> str:
    result = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"release \S+, V(\S+)", result.stdout)
    if result.returncode or not match:
        raise BackendError(f"cannot read the version of {nvcc}: {result.stderr.strip()}")
    return match.group(1)


def nvcc_version() -> str | None:
    """nvcc's full version ("13.0.88"), or None where no nvcc is installed."""
    nvcc = find_nvcc()
    return None if nvcc is None else _nvcc_version_of(nvcc)


def nvcc_command(nvcc: str, spec: KernelSpec, arch: str, output: Path) -> list[str]:
    defines = [f"-D{name}={value}" for name, value in spec.defines]
    return [
        nvcc,
        *spec.nvcc_flags,
        f"-arch={spec.arch(arch)}",
        f"-I{INCLUDE_DIR}",
        *defines,
        "-o",
        str(output),
        str(source_path(spec.family)),
    ]


# ---------------------------------------------------------------------------- ptxas report

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized.*function '([^']+)'")


def parse_ptxas_report(text: str) -> dict[str, ResourceUsage]:
    """Per entry function: registers, spills, stack frame, static shared memory, and
    whether ptxas serialised its wgmma products (C7512).

    ``Function properties`` blocks also appear for non-inlined device
    functions; only entry functions are kept, since those are what launches.
    """
    frames: dict[str, tuple[int, int, int]] = {}
    used: dict[str, tuple[int, int]] = {}
    entries: list[str] = []
    entry: str | None = None
    properties_of: str | None = None
    serialized: set[str] = set()
    for line in text.splitlines():
        if match := _SERIALIZED.search(line):
            serialized.add(match.group(1))
        elif match := _ENTRY.search(line):
            entry = match.group(1)
            entries.append(entry)
        elif match := _PROPERTIES.search(line):
            properties_of = match.group(1)
        elif (match := _FRAME.search(line)) and properties_of is not None:
            frames[properties_of] = (int(match[1]), int(match[2]), int(match[3]))
            properties_of = None
        elif (match := _USED.search(line)) and entry is not None:
            smem = _SMEM.search(line)
            used[entry] = (int(match[1]), int(smem[1]) if smem else 0)
    report: dict[str, ResourceUsage] = {}
    for name in entries:
        if name not in used:
            continue
        stack, spill_stores, spill_loads = frames.get(name, (0, 0, 0))
        registers, static_shared = used[name]
        report[name] = ResourceUsage(
            registers=registers,
            spill_store_bytes=spill_stores,
            spill_load_bytes=spill_loads,
            static_shared_bytes=static_shared,
            stack_bytes=stack,
            serialized_wgmma=name in serialized,
        )
    return report


def first_error_line(stderr: str) -> str:
    for line in stderr.splitlines():
        if "error" in line.lower():
            return line.strip()
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[0] if lines else "nvcc failed without a message"


# ---------------------------------------------------------------------------- cache


def _variant_digest(spec: KernelSpec, arch: str) -> str:
    identity = {
        "format": CACHE_FORMAT,
        "family": spec.family,
        "defines": spec.defines,
        "source": source_hash(spec.family),
        "arch": spec.arch(arch),
        "flags": spec.nvcc_flags,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


#: characters of a variant's readable key kept in its cache file names: a file name may have
#: 255 bytes, and a plan with every variant switch on spells more (the digest after it
#: identifies the variant either way)
CACHE_NAME_KEY_CHARS = 160


def _cache_prefix(spec: KernelSpec, arch: str) -> str:
    return f"{spec.key[:CACHE_NAME_KEY_CHARS]}-{_variant_digest(spec, arch)}"


def _toolchain_digest(version: str) -> str:
    return hashlib.sha256(version.encode()).hexdigest()[:8]


def _write_atomically(path: Path, data: bytes) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _recorded_resources(record: dict) -> dict[str, ResourceUsage]:
    """An entry's resources, read again from its ptxas log (so entries cached before a field
    was parsed, such as ``serialized_wgmma``, still report it); the recorded numbers where
    the log names none of them."""
    reparsed = parse_ptxas_report(record.get("ptxas_log") or "")
    recorded = {name: ResourceUsage(**usage) for name, usage in record["resources"].items()}
    return reparsed if set(reparsed) >= set(recorded) else recorded


def _load_entry(report_path: Path, spec: KernelSpec) -> CompiledKernel | None:
    try:
        record = json.loads(report_path.read_text())
        cubin_path = report_path.with_suffix(".cubin")
        cubin = cubin_path.read_bytes()
        if hashlib.sha256(cubin).hexdigest() != record["cubin_sha256"]:
            return None  # another writer is replacing the cubin; compile our own
        return CompiledKernel(
            spec=spec,
            cubin_path=cubin_path,
            cubin=cubin,
            resources=_recorded_resources(record),
            source_hash=record["source_hash"],
            arch=record["arch"],
            nvcc_version=record["nvcc_version"],
            ptxas_log=record["ptxas_log"],
            cache_hit=True,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cached(
    spec: KernelSpec, cache_dir: Path, arch: str, version: str | None
) -> CompiledKernel | None:
    prefix = _cache_prefix(spec, arch)
    if version is not None:
        return _load_entry(cache_dir / f"{prefix}-{_toolchain_digest(version)}.json", spec)
    # No nvcc here: any toolchain's entry for this exact source will do; newest first.
    candidates = sorted(cache_dir.glob(f"{prefix}-*.json"), key=_mtime, reverse=True)
    for report_path in candidates:
        if (hit := _load_entry(report_path, spec)) is not None:
            return hit
    return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def compile_kernel(
    variant: KernelPlan | KernelSpec | tuple[str, Mapping[str, int]],
    cache_dir: str | os.PathLike[str],
    arch: str = DEFAULT_ARCH,
) -> CompileResult:
    """The cubin of one variant: from the cache, else compiled with nvcc and cached.

    Raises ``BackendError`` only when the variant is not cached and no nvcc is installed.
    """
    spec = _as_spec(variant)
    directory = Path(cache_dir).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    nvcc = find_nvcc()
    version = None if nvcc is None else _nvcc_version_of(nvcc)
    if (hit := _cached(spec, directory, arch, version)) is not None:
        return hit
    if nvcc is None or version is None:
        raise _missing_nvcc()
    return _compile(spec, directory, arch, nvcc, version)


def _compile(
    spec: KernelSpec, directory: Path, arch: str, nvcc: str, version: str
) -> CompileResult:
    source = source_hash(spec.family)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".nvcc-") as scratch:
        output = Path(scratch) / "kernel.cubin"
        result = subprocess.run(
            nvcc_command(nvcc, spec, arch, output), capture_output=True, text=True, check=False
        )
        # ptxas -v writes its report on stderr, with or without errors.
        log = result.stderr
        if result.returncode != 0 or not output.exists():
            reason = first_error_line(log).replace(f"{KERNEL_DIR}{os.sep}", "")
            return CompileFailure(spec=spec, reason=reason, stderr=log)
        cubin = output.read_bytes()
    resources = parse_ptxas_report(log)
    missing = [name for name in entry_functions(spec.family) if name not in resources]
    if missing:
        return CompileFailure(
            spec=spec, reason=f"ptxas reported no resources for {', '.join(missing)}", stderr=log
        )
    prefix = f"{_cache_prefix(spec, arch)}-{_toolchain_digest(version)}"
    cubin_path = directory / f"{prefix}.cubin"
    record = {
        "family": spec.family,
        "defines": dict(spec.defines),
        "source_hash": source,
        "arch": spec.arch(arch),
        "nvcc_version": version,
        "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
        "resources": {
            name: {
                "registers": usage.registers,
                "spill_store_bytes": usage.spill_store_bytes,
                "spill_load_bytes": usage.spill_load_bytes,
                "static_shared_bytes": usage.static_shared_bytes,
                "stack_bytes": usage.stack_bytes,
                "serialized_wgmma": usage.serialized_wgmma,
            }
            for name, usage in resources.items()
        },
        "ptxas_log": log,
    }
    # Cubin first, report last: a reader that finds the report finds its cubin.
    _write_atomically(cubin_path, cubin)
    _write_atomically(directory / f"{prefix}.json", json.dumps(record, indent=1).encode())
    return CompiledKernel(
        spec=spec,
        cubin_path=cubin_path,
        cubin=cubin,
        resources=resources,
        source_hash=source,
        arch=spec.arch(arch),
        nvcc_version=version,
        ptxas_log=log,
    )


def _as_spec(variant: KernelPlan | KernelSpec | tuple[str, Mapping[str, int]]) -> KernelSpec:
    if isinstance(variant, KernelSpec):
        return variant
    if isinstance(variant, tuple):
        family, defines = variant
        return KernelSpec.of(family, defines)
    return KernelSpec.from_plan(variant)


def compile_many(
    plans: Iterable[KernelPlan | KernelSpec],
    cache_dir: str | os.PathLike[str],
    jobs: int | None = None,
    arch: str = DEFAULT_ARCH,
    progress: Progress | None = None,
) -> dict[str, CompileResult]:
    """Every distinct variant of ``plans``, keyed by ``KernelSpec.key``, compiled in parallel.

    Threads suffice: each job waits on an nvcc subprocess. ``progress(done,
    total, result)`` is called from the calling thread as variants finish.
    """
    specs: dict[str, KernelSpec] = {}
    for plan in plans:
        spec = _as_spec(plan)
        specs.setdefault(spec.key, spec)
    results: dict[str, CompileResult] = {}
    if not specs:
        return results
    workers = max(1, min(jobs or os.cpu_count() or 1, len(specs)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nvcc") as pool:
        futures = {
            pool.submit(compile_kernel, spec, cache_dir, arch): key for key, spec in specs.items()
        }
        for future in as_completed(futures):
            result = future.result()
            results[futures[future]] = result
            if progress is not None:
                progress(len(results), len(specs), result)
    return results
