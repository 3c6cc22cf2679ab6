"""Where a plan was tuned: the facts that make a timing comparable."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Environment:
    """GPU and toolchain identity. Plans are stored and served per environment.

    ``gpu_name`` is "model" for cost-model predictions made without a GPU (the
    compute capability and SM count are then the device profile's); string
    fields are "" when unknown.
    """

    gpu_name: str
    compute_capability: str  # "9.0"
    sm_count: int
    driver_version: str = ""
    cuda_version: str = ""
    nvcc_version: str = ""
    pycuda_version: str = ""

    def as_dict(self) -> dict[str, str | int]:
        return asdict(self)
