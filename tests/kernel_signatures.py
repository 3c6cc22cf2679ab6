"""Parameter types of the ``extern "C" __global__`` functions in CUDA source text.

What a launch packs must match what the kernel declares, type for type: a kernel
handed more argument bytes than its parameters take is refused by the driver
("too many resources requested for launch"), one handed fewer reads garbage. The
launch tests compare each family's launches with its source
(``tests/test_launch_config.py``); the fault tests compare the broken stand-ins
with the kernel they replace (``tests/test_reliability_faults.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from kernels import build
from tuner.planner.launches import TensorMap

#: elem_t is the half-precision family's 16-bit element type (bf16 or fp16)
C_TYPES = {
    "float*": np.uintp,
    "elem_t*": np.uintp,
    "int*": np.uintp,
    "int": np.int32,
    "float": np.float32,
    "CUtensorMap": TensorMap,
}
_ENTRY = re.compile(
    r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)'
)
_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"$', re.MULTILINE)
#: a compile-time constant's default: ``#ifndef NAME`` then ``#define NAME value``
_DEFAULT = re.compile(r"^#ifndef (\w+)\n#define \1 (-?\d+)", re.MULTILINE)
_CONDITION = re.compile(r"#if\s+(\w+)\s*(?:==\s*(-?\d+))?\s*$")


def _kept_lines(params: str, constants: Mapping[str, int]) -> str:
    """A parameter list with its ``#if NAME == value`` / ``#if NAME`` ... ``#else`` ...
    ``#endif`` blocks resolved against ``constants`` (a parameter a variant alone takes)."""
    kept, taking = [], [True]
    for line in params.splitlines():
        directive = line.strip()
        if directive.startswith("#if"):
            match = _CONDITION.fullmatch(directive)
            if match is None:
                raise ValueError(f"a parameter list's directive this parser cannot read: {line!r}")
            value = constants.get(match.group(1), 0)
            holds = value == int(match.group(2)) if match.group(2) is not None else bool(value)
            taking.append(taking[-1] and holds)
        elif directive == "#else":
            taking[-1] = not taking[-1] and taking[-2]
        elif directive == "#endif":
            taking.pop()
        elif taking[-1]:
            kept.append(line)
    return "\n".join(kept)


def signatures_in(text: str, defines: Mapping[str, int] | None = None) -> dict[str, list[type]]:
    """Entry function name -> its parameters' types (``C_TYPES``), in order, for a variant
    compiled with ``defines`` (the rest at the source's defaults)."""
    constants = {name: int(value) for name, value in _DEFAULT.findall(text)} | dict(
        defines or {}
    )
    signatures: dict[str, list[type]] = {}
    for name, params in _ENTRY.findall(text):
        types = []
        for param in _kept_lines(params, constants).split(","):
            words = (
                param.replace("__restrict__", "")
                .replace("__grid_constant__", "")
                .replace("const", "")
                .split()
            )
            c_type = " ".join(words[:-1]).replace(" *", "*")
            if words[-1].startswith("*"):
                c_type += "*"
            types.append(C_TYPES[c_type])
        signatures[name] = types
    return signatures


def with_local_includes(path: Path) -> str:
    """The file's text with its ``#include "..."`` of files beside it spliced in."""

    def splice(match: re.Match[str]) -> str:
        included = path.parent / match.group(1)
        return with_local_includes(included) if included.is_file() else match.group(0)

    return _LOCAL_INCLUDE.sub(splice, path.read_text())


def kernel_signatures(defines: Mapping[str, int] | None = None) -> dict[str, list[type]]:
    """The signatures of every registered family's source (each variant's with ``defines``:
    a plan's ``compile_defines``, or the sources' defaults)."""
    signatures: dict[str, list[type]] = {}
    for family in build.SOURCES:
        signatures |= signatures_in(with_local_includes(build.source_path(family)), defines)
    return signatures
