"""The shared device layer (``kernels/include/fa/``): what every family includes, and what the
build, the cubin cache and the registry's source hash make of it.

* the source hash covers a family's ``.cu`` and every header it includes, transitively:
  editing one header changes the hash of every family that includes it and of no other;
* the ``#ifndef`` defaults of each ``.cu`` are the planner's default tunables;
* the generated wgmma wrappers are what ``kernels/wgmma_ops.py`` writes;
* every header compiles on its own (nvcc, where installed): it includes what it uses.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels import build, wgmma_ops
from tuner.planner.families import registered

KERNELS = Path(build.__file__).resolve().parent
HEADERS = sorted((KERNELS / "include" / "fa").glob("*.cuh"))


@pytest.fixture()
def kernel_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of kernels/ (sources and headers) that the build reads instead."""
    copy = tmp_path / "kernels"
    shutil.copytree(KERNELS, copy, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    monkeypatch.setattr(build, "KERNEL_DIR", copy)
    monkeypatch.setattr(build, "INCLUDE_DIR", copy / "include")
    return copy


def test_every_family_includes_the_device_layer() -> None:
    for family in registered():
        included = build.included_files(build.source_path(family.name))
        headers = [path for path in included if path.suffix == ".cuh"]
        assert headers, f"{family.name} includes no shared header"
        assert all(path.is_relative_to(KERNELS / "include") for path in headers)


@pytest.mark.parametrize("header", HEADERS, ids=lambda path: path.name)
def test_editing_a_header_changes_exactly_the_hashes_of_its_includers(
    header: Path, kernel_copy: Path
) -> None:
    families = [family.name for family in registered()]
    before = {name: build.source_hash(name) for name in families}
    includers = {
        name
        for name in families
        if header.name in {path.name for path in build.included_files(build.source_path(name))}
    }
    edited = kernel_copy / "include" / "fa" / header.name
    edited.write_text(edited.read_text() + "\n// an edit\n")
    after = {name: build.source_hash(name) for name in families}
    changed = {name for name in families if after[name] != before[name]}
    assert changed == includers


def test_the_forward_families_share_every_forward_header() -> None:
    # mask, softmax, split contract and merge are written once: each tensor-core family
    # includes them, so a change to any is a change to all four.
    for name in ("mma_f16", "decode_f16", "mma_tf32", "wgmma_f16"):
        included = {path.name for path in build.included_files(build.source_path(name))}
        assert {"mask.cuh", "softmax.cuh", "split_kv.cuh", "split_merge.cuh"} <= included


_IFNDEF_DEFAULT = re.compile(r"#ifndef (\w+)\s*\n#define \1 (\d+)")


@pytest.mark.parametrize("family", registered(), ids=lambda family: family.name)
def test_source_defaults_are_the_planners_defaults(family) -> None:  # noqa: ANN001
    defaults = {
        name: int(value)
        for name, value in _IFNDEF_DEFAULT.findall(build.source_path(family.name).read_text())
    }
    for tunable in family.tunables:
        define = tunable.name.upper()
        if define in defaults:
            assert defaults[define] == tunable.default, (
                f"{family.source} says {define} {defaults[define]}, the planner "
                f"{tunable.default}"
            )
    for variant in ("WINDOW", "SOFTCAP", "ALIBI", "SINKS"):
        assert defaults.get(variant, 0) == 0, f"{family.source}: {variant} must default to off"


def test_the_wgmma_wrappers_are_generated() -> None:
    assert wgmma_ops.HEADER.read_text() == wgmma_ops.header_text()
    assert wgmma_ops.main(["--check"]) == 0


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("header", HEADERS, ids=lambda path: path.name)
def test_each_header_compiles_on_its_own(header: Path, tmp_path: Path) -> None:
    source = tmp_path / "one_header.cu"
    source.write_text(f'#include "fa/{header.name}"\n')
    result = subprocess.run(
        [build.find_nvcc(), "-c", "-arch=sm_90a", f"-I{build.INCLUDE_DIR}", "-o",
         str(tmp_path / "one_header.o"), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
