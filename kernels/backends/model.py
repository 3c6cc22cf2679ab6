"""The model backend: the cost model's prediction in place of a measurement.

For machines without a GPU (``backend=auto`` falls back to it, saying so) and
for tests. Every result is ``measured=False``: the registry stores it as
predicted, and it never stands in for a GPU timing. There is no spread, no
parity check (nothing runs) and no failure other than an infeasible plan.
"""

from __future__ import annotations

import math

from kernels.backends.base import Backend, Failure, Measurement
from tuner.costmodel import predict_time_ms
from tuner.device import H200, DeviceProfile
from tuner.environment import Environment
from tuner.planner.tunable import KernelPlan
from tuner.problem import Problem

#: ``Environment.gpu_name`` of predictions: the registry keeps them apart from GPU timings.
MODEL_GPU_NAME = "model"


class ModelBackend(Backend):
    name = "model"

    def __init__(self, device: DeviceProfile = H200) -> None:
        self.device = device

    def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
        if not plan.feasible:
            return Measurement.failed(Failure.INFEASIBLE, plan.reason, measured=False)
        time_ms = predict_time_ms(plan, self.device)
        if not math.isfinite(time_ms):
            return Measurement.failed(
                Failure.INFEASIBLE, "the cost model says it cannot run", measured=False
            )
        seconds = time_ms * 1e-3
        return Measurement(
            measured=False,
            median_ms=time_ms,
            tflops=problem.useful_flops / seconds / 1e12,
            gbps=plan.global_bytes / seconds / 1e9,
        )

    def environment(self) -> dict[str, str | int]:
        major, minor = self.device.compute_capability
        return Environment(
            gpu_name=MODEL_GPU_NAME,
            compute_capability=f"{major}.{minor}",
            sm_count=self.device.sm_count,
        ).as_dict()

    def device_profile(self) -> DeviceProfile:
        return self.device
