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


def signatures_in(text: str) -> dict[str, list[type]]:
    """Entry function name -> its parameters' types (``C_TYPES``), in order."""
    signatures: dict[str, list[type]] = {}
    for name, params in _ENTRY.findall(text):
        types = []
        for param in params.split(","):
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


def kernel_signatures() -> dict[str, list[type]]:
    """The signatures of every registered family's source."""
    signatures: dict[str, list[type]] = {}
    for family in build.SOURCES:
        signatures |= signatures_in(with_local_includes(build.source_path(family)))
    return signatures
