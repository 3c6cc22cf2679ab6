"""``mode=plan``: print the candidate space of a problem without a GPU or a database.

Shows what the search would explore: the problem, the device limits planned
against, the feasible candidates ranked by the cost model's predicted time
(the order the search starts from: the model sampler measures the first, then
corrects the ranking as times arrive; TPE's queue takes the top ones in this
order) and how many candidates were rejected for which reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from tuner.config import ValidatedConfig, format_value, rejection_summary, space_axes_from
from tuner.costmodel import Prediction, predict
from tuner.device import DeviceProfile
from tuner.planner.space import candidate_space
from tuner.planner.tunable import KernelPlan
from tuner.problem import Problem

_KIB = 1024
_MB = 1e6
_HEADERS = (
    "rank",
    "key",
    "grid",
    "block",
    "shared KiB",
    "blocks/SM",
    "occupancy",
    "waves",
    "read MB",
    "write MB",
    "pred ms",
    "bound",
)


def print_plan_space(validated: ValidatedConfig) -> None:
    """Print the candidate space of ``validated`` to stdout."""
    problem, device, config = validated.problem, validated.device, validated.config
    space = candidate_space(problem, device, space_axes_from(config.search))
    ranked = rank_by_prediction(space.feasible, device)
    shown = ranked[: config.plan_rows] if config.plan_rows else ranked
    total = len(space.feasible) + len(space.rejected)

    print(f"problem: {describe_problem(problem)}")
    print(f"device:  {describe_device(device, config.device.profile)}")
    print(
        f"candidates: {total} distinct, {len(space.feasible)} feasible, "
        f"{len(space.rejected)} rejected"
    )
    print()
    print(
        f"feasible: best {len(shown)} of {len(ranked)} by predicted time "
        "(plan_rows=N to change, 0 for all)"
    )
    rows = [_row(rank, plan, prediction) for rank, (plan, prediction) in enumerate(shown, 1)]
    print(_format_table(_HEADERS, rows))
    print()
    print(f"rejected: {len(space.rejected)}")
    for kind in rejection_summary(space):
        print(f"  {kind.count:>6}  {kind.kind}  (e.g. {kind.example})")


def rank_by_prediction(
    plans: Sequence[KernelPlan], device: DeviceProfile
) -> list[tuple[KernelPlan, Prediction]]:
    """Fastest predicted first; less global traffic, then the key, break ties."""
    predicted = [(plan, predict(plan, device)) for plan in plans]
    return sorted(
        predicted, key=lambda pair: (pair[1].time_ms, pair[0].global_bytes, pair[0].key())
    )


def describe_problem(problem: Problem) -> str:
    variants = variant_keys(problem)
    if problem.self_attention:
        return (
            f"{problem.label()} (batch={problem.batch} heads={problem.heads} "
            f"seq_len={problem.seq_len} head_dim={problem.head_dim} "
            f"causal={format_value(problem.causal)} dtype={problem.dtype}{variants}); "
            f"{problem.useful_flops / 1e9:.3g} GFLOP, "
            f"{problem.tensor_bytes / _MB:.3g} MB per tensor"
        )
    return (
        f"{problem.label()} (batch={problem.batch} heads={problem.heads} "
        f"kv_heads={problem.kv_heads} seq_len={problem.seq_len} kv_len={problem.kv_len} "
        f"head_dim={problem.head_dim} causal={format_value(problem.causal)} "
        f"dtype={problem.dtype}{variants}); {problem.useful_flops / 1e9:.3g} GFLOP, "
        f"{problem.tensor_bytes / _MB:.3g} MB of q, {problem.kv_tensor_bytes / _MB:.3g} MB "
        "of k and of v"
    )


def variant_keys(problem: Problem) -> str:
    """The variant keys that are on, as configured (`` window_left=4096 softcap=50``; "" for
    none). GFLOP count the window's visible pairs only."""
    keys = []
    if problem.windowed:
        keys += [f"window_left={problem.window_left}", f"window_right={problem.window_right}"]
    if problem.softcap > 0:
        keys.append(f"softcap={format_value(problem.softcap)}")
    keys += [f"{name}=true" for name in ("alibi", "sinks") if getattr(problem, name)]
    return "".join(f" {key}" for key in keys)


def describe_device(device: DeviceProfile, profile: str) -> str:
    return (
        f"{device.name} (profile {profile}, {device.arch}, {device.sm_count} SMs, "
        f"{device.max_shared_memory_per_block_optin / _KIB:g} KiB shared/block, "
        f"{device.max_threads_per_block} threads/block, "
        f"{device.dram_bandwidth_gbps:g} GB/s, {device.peak_fp32_tflops:g} TFLOP/s fp32)"
    )


def _row(rank: int, plan: KernelPlan, prediction: Prediction) -> tuple[str, ...]:
    launch = plan.launch
    return (
        str(rank),
        plan.key(),
        "x".join(map(str, launch.grid)),
        str(launch.threads_per_block),
        f"{launch.shared_bytes / _KIB:.1f}",
        str(plan.blocks_per_sm),
        f"{plan.occupancy:.0%}",
        f"{plan.waves:.2f}",
        f"{plan.global_read_bytes / _MB:.1f}",
        f"{plan.global_write_bytes / _MB:.1f}",
        f"{prediction.time_ms:.4f}",
        prediction.bound,
    )


def _format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    # The key column reads best left-aligned; numbers right-aligned.
    lines = []
    for cells in (headers, *rows):
        padded = [
            cell.ljust(width) if index == 1 else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)
