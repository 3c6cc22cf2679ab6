"""The planner: pure functions from a problem to kernel plans.

``seed`` reproduces the Rust seed planner exactly; ``tunable`` generalises its
partition to the kernels that are launched; ``space`` enumerates candidates.
Imports no GPU, database or Optuna code (a test checks).
"""

from tuner.planner.errors import PlanError
from tuner.planner.seed import (
    FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS,
    FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT,
    FlashAttentionBenchMetrics,
    FlashAttentionKernelKind,
    FlashAttentionMemoryTraffic,
    FlashAttentionWorkPlan,
    plan_flash_attention_scalar,
    plan_flash_attention_tiled,
)
from tuner.planner.space import CandidateSpace, SpaceAxes, candidate_space
from tuner.planner.tunable import (
    FAMILIES,
    KernelParams,
    KernelPlan,
    Launch,
    ResourceUsage,
    plan_kernel,
)

__all__ = [
    "FAMILIES",
    "FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS",
    "FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT",
    "CandidateSpace",
    "FlashAttentionBenchMetrics",
    "FlashAttentionKernelKind",
    "FlashAttentionMemoryTraffic",
    "FlashAttentionWorkPlan",
    "KernelParams",
    "KernelPlan",
    "Launch",
    "PlanError",
    "ResourceUsage",
    "SpaceAxes",
    "candidate_space",
    "plan_flash_attention_scalar",
    "plan_flash_attention_tiled",
    "plan_kernel",
]
