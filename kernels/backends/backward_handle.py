"""One resolved backward problem on one GPU: what every gradient call of that shape reuses.

``BackwardHandle`` is made once per (backward ``Problem``, deterministic, device) by
``DeviceRunner.backward_handle``: the chosen plan, the loaded kernels and the launches as
templates whose pointer arguments are named by role (``BackwardBuffers``' fields, found by
building the family's launches with marker addresses, as ``attention_handle`` does). A call
allocates dq, dk, dv and the scratch from torch's caching allocator on the current stream
(stream-ordered; inside a CUDA-graph capture, from the graph's pool), packs the arguments and
launches on torch's current stream: no plan lookup, no host synchronisation. A backward call
costs milliseconds, so packing per call (a few microseconds) buys the simplicity of no
per-stream state. Import-safe without CUDA or torch: the driver is injected, torch is the
caller's module.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

from kernels.backends.attention_handle import LaunchTemplate
from kernels.cuda_driver import CUDA_ERROR_INVALID_CONTEXT, ctypes_argument, pack_launch
from kernels.plan_choice import ChosenPlan
from tuner.errors import BackendError
from tuner.planner.launches import BackwardBuffers, BackwardScratch
from tuner.problem import Problem

#: buffer roles of a backward run, in ``BackwardBuffers`` order
BACKWARD_ROLES = tuple(f.name for f in dataclasses.fields(BackwardBuffers))
#: a marker address per role (above 2**63, as ``attention_handle.BUFFER_MARKERS``)
BACKWARD_MARKERS = BackwardBuffers(
    **{role: (0xBAC4 << 48) + index for index, role in enumerate(BACKWARD_ROLES)}
)


def backward_marker_roles() -> dict[int, str]:
    return {getattr(BACKWARD_MARKERS, role): role for role in BACKWARD_ROLES}


class BackwardHandle:
    """A backward problem resolved on one GPU; ``run_torch`` is the per-call path."""

    def __init__(
        self,
        problem: Problem,
        device: int,
        chosen: ChosenPlan,
        templates: tuple[LaunchTemplate, ...],
        scratch: BackwardScratch,
        driver: Any,
        context: int | None,
    ) -> None:
        self.problem = problem
        self.device = device
        self.chosen = chosen
        self.templates = templates
        self.scratch = scratch
        self.driver = driver
        self.context = context

    @property
    def plan(self) -> Any:
        return self.chosen.plan

    def run_torch(
        self, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, torch: Any
    ) -> tuple[Any, Any, Any]:
        """dq, dk, dv of checked contiguous CUDA tensors of this problem: ``out`` and ``lse``
        (float32 ``[batch, heads, seq_len]``) the forward's."""
        native = torch._C
        if native._cuda_getDevice() != self.device:
            with torch.cuda.device(self.device):
                return self.run_torch(dout, q, k, v, out, lse, torch)
        stream = native._cuda_getCurrentRawStream(self.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # Alive until the launches are enqueued; the caching allocator orders their reuse
        # after this stream's work, so dropping them afterwards is safe.
        scratch = {
            role: torch.empty(nbytes, dtype=torch.uint8, device=q.device)
            for role, nbytes in self.scratch.sizes().items()
            if nbytes
        }
        addresses = {role: tensor.data_ptr() for role, tensor in scratch.items()}
        addresses |= {
            "q": q.data_ptr(),
            "k": k.data_ptr(),
            "v": v.data_ptr(),
            "out": out.data_ptr(),
            "dout": dout.data_ptr(),
            "lse": lse.data_ptr(),
            "dq": dq.data_ptr(),
            "dk": dk.data_ptr(),
            "dv": dv.data_ptr(),
        }
        self.launch(addresses, stream)
        return dq, dk, dv

    def launch(self, addresses: dict[str, int], stream: int) -> None:
        """The plan's launches on ``stream`` with the roles' ``addresses`` (0: unused)."""
        for template in self.templates:
            arguments = [
                ctypes.c_void_p(addresses.get(value) or None)
                if isinstance(value, str)
                else ctypes_argument(value)
                for value in template.arguments
            ]
            packed = pack_launch(
                template.name,
                template.function,
                template.grid,
                template.block,
                template.shared_bytes,
                arguments,
            )
            call = self.driver.bind_launch(packed, stream)
            status = call()
            if status == CUDA_ERROR_INVALID_CONTEXT and self.context:
                # A thread that never made a CUDA call has no current context: torch's is ours.
                self.driver.set_context(self.context)
                status = call()
            if status:
                raise BackendError(
                    f"{self.plan.key()} ({template.name}) on cuda:{self.device}: "
                    f"{self.driver.error_string(status)}"
                )
