"""The planner: pure functions from a problem to kernel plans.

``seed`` reproduces the Rust seed planner exactly; ``families`` holds one
planning module per kernel family, registered in one place; ``tunable``
plans a candidate through its family; ``space`` enumerates candidates.
Imports no GPU, database or Optuna code (a test checks).
"""

from tuner.planner.errors import PlanError
from tuner.planner.families import KernelFamily, family_named, family_names, registered
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch, ResourceUsage
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
from tuner.planner.tunable import plan_kernel

__all__ = [
    "FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS",
    "FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT",
    "CandidateSpace",
    "FlashAttentionBenchMetrics",
    "FlashAttentionKernelKind",
    "FlashAttentionMemoryTraffic",
    "FlashAttentionWorkPlan",
    "KernelFamily",
    "KernelParams",
    "KernelPlan",
    "Launch",
    "PlanError",
    "ResourceUsage",
    "SpaceAxes",
    "candidate_space",
    "family_named",
    "family_names",
    "plan_flash_attention_scalar",
    "plan_flash_attention_tiled",
    "plan_kernel",
    "registered",
]
