"""One resolved attention problem on one GPU: what every call of that shape reuses.

``AttentionHandle`` is made once per (``Problem``, device) by ``DeviceRunner.handle`` and holds
the chosen plan, the loaded kernels, the launch geometry and, per stream, a ``StreamSlot``: the
split scratch and the arguments packed once (``kernels.cuda_driver``). A call then writes the
addresses of q, k, v, out and of the caller's ALiBi slopes and sinks (0 when off) and the
softmax scale into the slot's objects and launches: no plan lookup, no argument packing, no
allocation (but the output where none is given), no host synchronisation.

The scale is a run-time value, not part of the problem: one handle serves every scale. The
kernels take ``scale_log2 = scale * log2(e)``; the family builds it from ``1/sqrt(head_dim)``,
so the argument holding that value (the first float32 argument of a launch equal to it: the
ABI puts ``scale_log2`` before ``softcap``) is the role ``scale_log2``, written per call with
the caller's scale, or the default. A plan whose launches hold no such argument refuses a
scale of the caller's rather than ignore it; a problem with ALiBi or sinks is refused at
resolution by a plan whose launches take no slopes or sinks pointer.

Why per stream: the split scratch is written by the attention kernel and read by the merge
kernel; two calls on one stream are ordered, on two streams they would race on one scratch. A
call inside a CUDA-graph capture gets scratch of its own from torch's allocator (the graph's
private pool), so a graph never shares scratch with eager calls. The scratch of a stream is a
``SplitScratch``'s: the handles of one KV bucket (``kernels.kv_buckets``: one per KV length a
decode meets) share one, sized for the bucket's plan, which no length of the bucket exceeds.

The roles of the pointer arguments are found by building the family's launches with marker
addresses (``BUFFER_MARKERS``): any family, any argument order, with no family named here.
TMA descriptor arguments (``TensorMap``) are encoded once a slot and re-pointed at the call's
q, k, v or out only when that address moved (``cuTensorMapReplaceAddress``, one host call a map).
Import-safe without CUDA or torch: the driver is injected, torch is the caller's module.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kernels.cuda_driver import (
    CUDA_ERROR_INVALID_CONTEXT,
    PackedLaunch,
    ctypes_argument,
    pack_launch,
)
from kernels.launch import BufferElements, DeviceBuffers, KernelLaunch
from kernels.plan_choice import ChosenPlan
from tuner.errors import BackendError
from tuner.planner.launches import TensorMap
from tuner.planner.launches import scale_log2 as head_dim_scale_log2
from tuner.problem import Problem

#: buffer roles, in ``DeviceBuffers`` order
ROLES = ("q", "k", "v", "out", "partial_o", "partial_ml", "alibi_slopes", "sinks", "lse")
#: the float32 argument a call writes its softmax scale into (``scale * log2(e)``)
SCALE_ROLE = "scale_log2"
#: addresses no allocation has (above 2**63), one per role: where a launch built with these has
#: one, that argument is that buffer's pointer
BUFFER_MARKERS = DeviceBuffers(**{role: (0xF1A5 << 48) + index for index, role in enumerate(ROLES)})

#: where a slot's tensor maps point until the first call re-points them: 16-byte aligned (the
#: encoder checks alignment, not the memory) and far below any CUDA device allocation
UNBOUND_TENSOR_MAP_ADDRESS = 1 << 20

#: ``allocate(nbytes) -> (owner, address)``: device memory that lives as long as ``owner``
Allocate = Callable[[int], tuple[Any, int]]


@dataclass(frozen=True, slots=True)
class LaunchTemplate:
    """A launch with its arguments as roles (a buffer's name) or constants."""

    name: str
    function: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    arguments: tuple[str | TensorMap | np.int32 | np.float32 | np.uintp, ...]


def launch_templates(
    launches: tuple[KernelLaunch, ...],
    functions: dict[str, int],
    scale_log2: float | None = None,
    markers: dict[int, str] | None = None,
) -> tuple[LaunchTemplate, ...]:
    """``launches`` (built with ``BUFFER_MARKERS``, or with the addresses of ``markers``:
    address -> role) with each pointer argument named by role; a null pointer stays a
    constant. With ``scale_log2`` (the value the family built the launches with), the first
    float32 argument of a launch equal to it is ``SCALE_ROLE``."""
    if markers is None:
        addresses = _addresses(BUFFER_MARKERS)
        markers = {int(address): role for role, address in zip(ROLES, addresses, strict=True)}
    roles = tuple(markers.values())
    scale = None if scale_log2 is None else np.float32(scale_log2)
    templates = []
    for launch in launches:
        scaled = scale is None
        arguments: list[str | TensorMap | np.int32 | np.float32 | np.uintp] = []
        for position, value in enumerate(launch.args):
            if isinstance(value, TensorMap):
                if markers.get(value.address) != value.buffer or value.buffer not in ROLES[:4]:
                    raise BackendError(
                        f"{launch.function} argument {position} is a tensor map over "
                        f"{value.buffer!r} at an address that is not q's, k's, v's or out's; "
                        "the deploy path re-points maps over q, k, v and out only"
                    )
                arguments.append(value)
            elif isinstance(value, np.uintp) and int(value) == 0:
                arguments.append(value)  # a null pointer: an optional buffer not used
            elif isinstance(value, np.uintp):
                role = markers.get(int(value))
                if role is None and int(value) != 0:
                    raise BackendError(
                        f"{launch.function} argument {position} is a pointer that is none of "
                        f"the buffers {', '.join(roles)}; the deploy path cannot pack it"
                    )
                arguments.append(value if role is None else role)
            elif not scaled and isinstance(value, np.float32) and value == scale:
                arguments.append(SCALE_ROLE)
                scaled = True
            else:
                arguments.append(value)
        templates.append(
            LaunchTemplate(
                launch.function,
                functions[launch.function],
                launch.grid,
                launch.block,
                launch.shared_bytes,
                tuple(arguments),
            )
        )
    return tuple(templates)


def _addresses(buffers: DeviceBuffers) -> tuple[int, ...]:
    return tuple(getattr(buffers, role) for role in ROLES)


def roles_taken(templates: tuple[LaunchTemplate, ...]) -> frozenset[str]:
    """The roles (buffers and the scale) some launch of ``templates`` takes."""
    return frozenset(
        value for template in templates for value in template.arguments if isinstance(value, str)
    )


class SplitScratch:
    """Split scratch per stream, of ``needed``'s sizes, shared by the handles given it.

    Handles of one KV bucket run one at a time on a stream (a stream orders its launches), so
    they may write and read the same partials; their plans need no more than ``needed``.
    """

    def __init__(self, needed: BufferElements) -> None:
        self.needed = needed
        self._streams: dict[int, tuple[tuple[Any, ...], int, int]] = {}
        self._lock = threading.Lock()

    def of_stream(self, stream: int, allocate: Allocate) -> tuple[tuple[Any, ...], int, int]:
        """``(owners, partial_o address, partial_ml address)`` of ``stream``, allocated once."""
        found = self._streams.get(stream)
        if found is None:
            with self._lock:
                found = self._streams.get(stream)
                if found is None:
                    found = self._streams[stream] = allocate_scratch(self.needed, allocate)
        return found

    def close(self) -> None:
        with self._lock:
            self._streams.clear()


def allocate_scratch(
    needed: BufferElements, allocate: Allocate, what: str = ""
) -> tuple[tuple[Any, ...], int, int]:
    """The float32 partials of ``needed``: ``(owners, partial_o address, partial_ml address)``."""
    owners, addresses = [], []
    for role, nbytes in (
        ("partial_o", needed.partial_o_bytes),
        ("partial_ml", needed.partial_ml_bytes),
    ):
        try:
            owner, address = allocate(nbytes)
        except Exception as error:
            raise BackendError(
                f"{what or 'a plan'}: its split scratch ({nbytes} B of {role}) does not fit: "
                f"{error}"
            ) from error
        owners.append(owner)
        addresses.append(address)
    return tuple(owners), addresses[0], addresses[1]


class StreamSlot:
    """One stream's packed launches and split scratch; ``lock`` makes write + launch atomic."""

    def __init__(
        self,
        pointers: dict[str, Any],
        packed: tuple[PackedLaunch, ...],
        calls: tuple[Callable[[], int], ...],
        owners: tuple[Any, ...],
        tensor_maps: tuple[Any, ...] = (),
    ) -> None:
        self.q, self.k, self.v, self.out = (pointers[role] for role in ROLES[:4])
        self.alibi_slopes, self.sinks = pointers["alibi_slopes"], pointers["sinks"]
        self.lse = pointers["lse"]
        self.scale_log2 = pointers[SCALE_ROLE]
        #: the encoded TMA descriptors the packed launches point at (re-pointed per call)
        self.tensor_maps = tensor_maps
        # The argument objects live here: the drivers' ``void*[]`` hold only their addresses.
        self.packed = packed
        self.calls = calls
        self.owners = owners  # the scratch allocations: alive as long as the slot
        self.lock = threading.Lock()


class AttentionHandle:
    """A problem resolved on one GPU; ``run_torch`` and ``launch`` are the per-call path."""

    def __init__(
        self,
        problem: Problem,
        device: int,
        chosen: ChosenPlan,
        templates: tuple[LaunchTemplate, ...],
        needed: BufferElements,
        driver: Any,
        context: int | None,
        scratch: SplitScratch | None = None,
    ) -> None:
        self.problem = problem
        self.device = device
        self.chosen = chosen
        self.templates = templates
        self.needed = needed
        #: bytes of q and of out
        self.tensor_bytes = needed.tensor_bytes
        #: bytes of k and of v (fewer heads with GQA, another length with a KV cache)
        self.kv_tensor_bytes = problem.kv_tensor_bytes
        self.driver = driver
        self.context = context  # the primary context (torch's); None where unknown
        self.has_scratch = needed.partial_o > 0
        #: this handle's split scratch per stream, or its KV bucket's (shared)
        self.scratch = scratch if scratch is not None else SplitScratch(needed)
        taken = roles_taken(templates)
        for wanted, role in ((problem.alibi, "alibi_slopes"), (problem.sinks, "sinks")):
            if wanted and role not in taken:
                raise BackendError(
                    f"{chosen.plan.key()} for {problem.label()}: its launches take no {role} "
                    f"pointer, so its kernels would ignore the {role}; tune a family that "
                    "takes them"
                )
        #: whether a launch takes the scale (else only the default scale can run)
        self.takes_scale = SCALE_ROLE in taken
        #: the scale the family built the launches with: ``log2(e) / sqrt(head_dim)``
        self.default_scale_log2 = head_dim_scale_log2(problem.head_dim)
        self._slots: dict[int, StreamSlot] = {}
        self._lock = threading.Lock()

    @property
    def plan(self) -> Any:
        return self.chosen.plan

    # ------------------------------------------------------------------ slots

    def slot(self, stream: int, allocate: Allocate) -> StreamSlot:
        """The slot of ``stream``, made (scratch allocated, arguments packed) on first use."""
        found = self._slots.get(stream)
        if found is None:
            with self._lock:
                found = self._slots.get(stream)
                if found is None:
                    found = self._slots[stream] = self.new_slot(stream, allocate)
        return found

    def new_slot(self, stream: int, allocate: Allocate, private: bool = False) -> StreamSlot:
        """The packed launches of ``stream``, on the stream's shared scratch, or on scratch of
        their own (``private``: a CUDA-graph capture)."""
        owners: tuple[Any, ...] = ()
        addresses = {"partial_o": 0, "partial_ml": 0}
        if self.has_scratch:
            what = f"{self.plan.key()} for {self.problem.label()}"
            owners, partial_o, partial_ml = (
                allocate_scratch(self.needed, allocate, what)
                if private
                else self.scratch.of_stream(stream, allocate)
            )
            addresses = {"partial_o": partial_o, "partial_ml": partial_ml}
        pointers: dict[str, Any] = {
            role: ctypes.c_void_p(addresses.get(role, 0)) for role in ROLES
        }
        pointers[SCALE_ROLE] = ctypes.c_float(self.default_scale_log2)
        maps: list[Any] = []
        packed = tuple(self._pack(template, pointers, maps) for template in self.templates)
        calls = tuple(self.driver.bind_launch(launch, stream) for launch in packed)
        return StreamSlot(pointers, packed, calls, owners, tuple(maps))

    def _pack(
        self, template: LaunchTemplate, pointers: dict[str, Any], maps: list[Any]
    ) -> PackedLaunch:
        arguments = []
        for value in template.arguments:
            if isinstance(value, str):
                arguments.append(pointers[value])
            elif isinstance(value, TensorMap):
                encoded = self.driver.encode_tensor_map(
                    replace(value, address=UNBOUND_TENSOR_MAP_ADDRESS)
                )
                maps.append(encoded)
                arguments.append(encoded.value)
            else:
                arguments.append(ctypes_argument(value))
        return pack_launch(
            template.name,
            template.function,
            template.grid,
            template.block,
            template.shared_bytes,
            arguments,
        )

    # ------------------------------------------------------------------ per call

    def launch(
        self,
        slot: StreamSlot,
        q: int,
        k: int,
        v: int,
        out: int,
        alibi_slopes: int = 0,
        sinks: int = 0,
        scale_log2: float | None = None,
        lse: int = 0,
    ) -> None:
        """The plan's launches on the slot's stream, in the current context; no waiting.

        ``alibi_slopes``, ``sinks``: the caller's ``[heads]`` float32 arrays (0 when off);
        ``scale_log2``: the caller's ``scale * log2(e)``, None for ``1/sqrt(head_dim)``'s;
        ``lse``: where the rows' log-sum-exps go (0: nowhere).
        """
        if scale_log2 is None:
            scale_log2 = self.default_scale_log2
        elif not self.takes_scale and np.float32(scale_log2) != np.float32(
            self.default_scale_log2
        ):
            raise BackendError(
                f"{self.plan.key()} for {self.problem.label()} takes no scale argument (its "
                "kernels use 1/sqrt(head_dim)); a scale of the caller's cannot run with it"
            )
        with slot.lock:  # another thread must not rewrite the addresses before the launch
            slot.q.value, slot.k.value, slot.v.value, slot.out.value = q, k, v, out
            slot.alibi_slopes.value, slot.sinks.value = alibi_slopes, sinks
            slot.scale_log2.value = scale_log2
            slot.lse.value = lse or None
            addresses = {"q": q, "k": k, "v": v, "out": out}
            for encoded in slot.tensor_maps:
                self.driver.replace_tensor_map_address(encoded, addresses[encoded.spec.buffer])
            for call in slot.calls:
                status = call()
                if status:
                    self._retry(call, status)

    def _retry(self, call: Callable[[], int], status: int) -> None:
        if status == CUDA_ERROR_INVALID_CONTEXT and self.context:
            # A thread that never made a CUDA call has no current context: torch's is ours.
            self.driver.set_context(self.context)
            status = call()
        self.driver.check(status, f"{self.plan.key()} on cuda:{self.device}")

    def run_torch(
        self,
        like: Any,
        q: int,
        k: int,
        v: int,
        out: Any,
        torch: Any,
        alibi_slopes: int = 0,
        sinks: int = 0,
        scale_log2: float | None = None,
        lse: Any = None,
    ) -> Any:
        """Launch on torch's current stream of this GPU; the result is ``out`` or a new tensor
        like ``like`` (q). The caller checked the tensors (``kernels.attention_args``).
        ``lse``: a float32 tensor of ``[batch, heads, seq_len]`` the rows' natural-log
        log-sum-exps go to (the forward of a training step), or None."""
        native = torch._C
        if native._cuda_getDevice() != self.device:
            with torch.cuda.device(self.device):  # run under this GPU, as torch's ops do
                return self.run_torch(
                    like, q, k, v, out, torch, alibi_slopes, sinks, scale_log2, lse
                )
        stream = native._cuda_getCurrentRawStream(self.device)
        result = torch.empty_like(like) if out is None else out
        if self.has_scratch and native._cuda_isCurrentStreamCapturing():
            # In a graph capture: scratch from the graph's pool, never an eager slot's.
            slot = self.new_slot(stream, _torch_allocator(torch, like.device), private=True)
        else:
            slot = self._slots.get(stream)
            if slot is None:
                slot = self.slot(stream, _torch_allocator(torch, like.device))
        lse_address = 0 if lse is None else lse.data_ptr()
        self.launch(
            slot, q, k, v, result.data_ptr(), alibi_slopes, sinks, scale_log2, lse_address
        )
        return result

    def close(self) -> None:
        with self._lock:
            self._slots.clear()
        self.scratch.close()


def _torch_allocator(torch: Any, device: Any) -> Allocate:
    def allocate(nbytes: int) -> tuple[Any, int]:
        # On the current stream (torch's caching allocator is stream-ordered) and, inside a
        # capture, from the graph's private pool.
        owner = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return owner, int(owner.data_ptr())

    return allocate
