"""``BatchAttention``: plan a serving batch on the host, run it on the GPU, CUDA-graph safe.

    attn = BatchAttention(32, 8, 128, page_size=16, max_requests=64, max_query_tokens=64,
                          max_kv_len=32768)
    attn.plan(query_lens, kv_lens, block_table)      # host: checks, work list, one H2D copy
    out = attn.run(q, k_cache, v_cache)              # GPU: two launches, no host sync

Construction fixes everything a captured CUDA graph depends on: the kernel (the tuned plan of
the nearest registry bucket, ``kernels.serving.bucket``, or ``params``), the persistent grid
(``ctas_per_sm`` x SMs), and one int32 device buffer holding the work list
(``tuner.planner.work_list.WorkLayout`` of a fixed capacity) followed by the page lists, plus
the float32 split scratch. ``plan`` checks the batch (``kernels.serving.checks``), plans its
work list from the actual lengths, writes it and the used block-table rows (or CSR page
lists) into a pinned staging buffer and copies that into the device buffer on the current
stream. ``run`` checks the tensors against the plan and launches the attention kernel and,
when a request was split (always inside a capture), the merge, on torch's current stream. A
graph captured around ``run`` therefore replays correctly after ``plan`` is called again with
new lengths, pages or batch size, as long as q, the caches and out keep their addresses.

Layouts: q and out ``[total_q, heads, head_dim]`` (requests' rows back to back, in order);
paged caches ``[num_pages, page_size, kv_heads, head_dim]`` (vLLM's and FlashInfer's NHD);
ragged ``[total_kv, kv_heads, head_dim]`` (``flash_attn_varlen_func``'s), request ``b``'s
keys from row ``cu_seqlens_k[b]``. Causal masking is bottom-right aligned per request.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from kernels.cuda_driver import CUDA_ERROR_INVALID_CONTEXT, ctypes_argument, pack_launch
from kernels.plan_choice import ChosenPlan
from kernels.serving import checks
from kernels.serving.checks import Expected, ServingInputError
from kernels.serving.planning import BatchPlanner, PlannedBatch
from tuner.planner.errors import PlanError
from tuner.planner.families.serving_f16 import merge_launch, serving_launches, work_params
from tuner.planner.launches import DeviceBuffers, KernelLaunch
from tuner.planner.params import KernelParams
from tuner.planner.tunable import plan_kernel
from tuner.planner.work_list import WorkList
from tuner.problem import Problem

FAMILY = "serving_f16"
#: pointer roles rewritten per call; each a marker address no allocation has
_PER_CALL = ("q", "k", "v", "out", "lse")
_MARKERS = {role: (0xF1A6 << 48) + index for index, role in enumerate(_PER_CALL)}

_instances: weakref.WeakValueDictionary[int, BatchAttention] = weakref.WeakValueDictionary()
_numbers = itertools.count(1)


def instance(handle: int) -> BatchAttention:
    """The live ``BatchAttention`` of a handle (what the torch op carries)."""
    found = _instances.get(handle)
    if found is None:
        raise ServingInputError(f"no BatchAttention with handle {handle} is alive")
    return found


def _dtype_name(dtype: Any) -> str:
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype in names:
        return names[dtype]
    if dtype in ("bfloat16", "float16"):
        return str(dtype)
    raise checks.ServingInputTypeError(
        f"dtype={dtype!r}: serving batches run in torch.bfloat16 or torch.float16"
    )


class BatchAttention:
    """A serving batch's attention: buffers of a fixed capacity, ``plan`` then ``run``.

    ``heads``/``kv_heads``/``head_dim`` and ``dtype`` describe q and the caches;
    ``page_size`` the paged cache's tokens a page (None: contiguous ragged K/V).
    Capacities: ``max_requests`` per batch, ``max_query_tokens`` query rows per batch,
    ``max_kv_len`` keys per request (pages a request may hold: ``max_kv_len / page_size``).
    ``max_query_len`` (query rows of a request: 1 for decode) and ``lengths`` (the expected
    KV-length distribution: ``uniform``, ``skewed``, ``equal``) choose the tuned bucket.
    Variants: ``causal`` (bottom-right per request), ``window_left``/``window_right``,
    ``softcap``, ``alibi_slopes`` and ``sinks`` (float32 CUDA tensors ``[heads]``).
    ``params``: the serving family's tunables (a mapping or ``KernelParams``) instead of the
    registry's plan; ``registry``/``nearest``: as ``kernels.attention``'s. ``device``: the GPU
    (default torch's current). ``max_partial_rows``: float32 split-scratch rows (default
    ``heads * min(8 * max_query_tokens, 2048)``).
    """

    def __init__(
        self,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        page_size: int | None = 16,
        dtype: Any = torch.bfloat16,
        max_requests: int,
        max_query_tokens: int,
        max_kv_len: int,
        max_query_len: int = 1,
        lengths: str = "uniform",
        causal: bool = False,
        window_left: int = -1,
        window_right: int = -1,
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        params: Mapping[str, int] | KernelParams | None = None,
        registry: str | None = None,
        nearest: bool = True,
        device: Any = None,
        max_partial_rows: int | None = None,
    ) -> None:
        from kernels.deploy import default_instance

        self.dtype = getattr(torch, _dtype_name(dtype))
        if device is None:
            self.device = torch.cuda.current_device()
        elif isinstance(device, int):
            self.device = device
        else:
            index = torch.device(device).index
            self.device = torch.cuda.current_device() if index is None else index
        for name, value in (
            ("max_requests", max_requests),
            ("max_query_tokens", max_query_tokens),
            ("max_kv_len", max_kv_len),
            ("max_query_len", max_query_len),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ServingInputError(f"{name}={value!r} must be an integer >= 1")
        self.alibi_slopes = self._per_head("alibi_slopes", alibi_slopes, heads)
        self.sinks = self._per_head("sinks", sinks, heads)
        try:
            self.bucket = Problem(
                seq_len=min(max_query_len, max_kv_len),
                head_dim=head_dim,
                batch=max_requests,
                heads=heads,
                causal=causal,
                dtype=_dtype_name(dtype),
                kv_heads=kv_heads,
                kv_len=max_kv_len,
                window_left=window_left,
                window_right=window_right,
                softcap=softcap,
                alibi=alibi_slopes is not None,
                sinks=sinks is not None,
                page_size=page_size,
                lengths=lengths,
            )
        except ValueError as error:
            raise ServingInputError(str(error)) from error
        self.page_size = page_size

        runner = default_instance(registry, nearest=nearest).device_runner(self.device)
        self._runner = runner
        self.chosen = self._choose(runner, params)
        plan = self.chosen.plan
        self.plan_key = plan.key()
        self.planner = BatchPlanner(
            self.bucket,
            work_params(plan.params, runner.profile),
            max_query_tokens=max_query_tokens,
            max_partial_rows=max_partial_rows,
        )
        self.capacity = self.planner.capacity
        self.layout = self.planner.layout
        words = self.planner.words
        self._buffer = torch.zeros(words, dtype=torch.int32, device=self.device)
        self._staging = torch.zeros(words, dtype=torch.int32, pin_memory=True)
        self._staging_values = self._staging.numpy()
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        partial_rows = max(self.capacity.partial_rows, 1)
        self._partial_o = torch.empty(
            partial_rows * head_dim, dtype=torch.float32, device=self.device
        )
        self._partial_lse = torch.empty(partial_rows, dtype=torch.float32, device=self.device)

        launch = plan.launch
        merge = merge_launch(max(self.capacity.merge_tokens, 1), heads, head_dim)
        buffers = DeviceBuffers(
            q=_MARKERS["q"],
            k=_MARKERS["k"],
            v=_MARKERS["v"],
            out=_MARKERS["out"],
            partial_o=self._partial_o.data_ptr(),
            partial_ml=self._partial_lse.data_ptr(),
            alibi_slopes=0 if self.alibi_slopes is None else self.alibi_slopes.data_ptr(),
            sinks=0 if self.sinks is None else self.sinks.data_ptr(),
            lse=_MARKERS["lse"],
            work=self._buffer.data_ptr(),
            pages=self._buffer.data_ptr() + 4 * self.planner.pages_offset if page_size else 0,
        )
        launches = serving_launches(self.bucket, launch, merge, self.layout, buffers)
        functions = runner.load(plan, launches)
        self._pointers = {role: ctypes.c_void_p(0) for role in _PER_CALL}
        self._packed = tuple(self._pack(item, functions) for item in launches)
        self._calls: dict[int, tuple[Any, ...]] = {}
        self._lock = threading.Lock()
        self._expected: Expected | None = None
        self._merges = 0
        #: the last planned work list (host values; for inspection and tests)
        self.work: WorkList | None = None
        self.handle = next(_numbers)
        _instances[self.handle] = self

    # ------------------------------------------------------------------ construction

    def _per_head(self, name: str, value: torch.Tensor | None, heads: int) -> Any:
        if value is None:
            return None
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            raise checks.ServingInputTypeError(f"{name} must be a float32 tensor of [heads]")
        if tuple(value.shape) != (heads,):
            raise ServingInputError(f"{name} has shape {list(value.shape)}; expected [{heads}]")
        return value.to(device=torch.device("cuda", self.device)).contiguous()

    def _choose(self, runner: Any, params: Mapping[str, int] | KernelParams | None) -> ChosenPlan:
        if params is None:
            return runner.chooser.plan_for(self.bucket)
        if not isinstance(params, KernelParams):
            try:
                params = KernelParams(FAMILY, **dict(params))
            except PlanError as error:
                raise ServingInputError(f"params: {error}") from error
        plan = plan_kernel(self.bucket, params, runner.profile)
        if not plan.feasible:
            raise ServingInputError(f"params {params.as_dict()} cannot run: {plan.reason}")
        return ChosenPlan(runner.checked(plan), "given")

    def _pack(self, launch: KernelLaunch, functions: dict[str, int]) -> Any:
        markers = {address: role for role, address in _MARKERS.items()}
        arguments = []
        for value in launch.args:
            role = markers.get(int(value)) if isinstance(value, np.uintp) else None
            arguments.append(self._pointers[role] if role else ctypes_argument(value))
        return pack_launch(
            launch.function,
            functions[launch.function],
            launch.grid,
            launch.block,
            launch.shared_bytes,
            arguments,
        )

    # ------------------------------------------------------------------ plan

    @property
    def origin(self) -> str:
        """Where the plan came from: "registry" (a tuned bucket; ``chosen.stored.fallback``
        when the nearest one), "default" (the cost model's pick), or "given" (``params``)."""
        return self.chosen.origin

    def plan(
        self,
        query_lens: Any,
        kv_lens: Any,
        block_table: Any = None,
        *,
        kv_offsets: Any = None,
    ) -> WorkList:
        """Plan a batch: per request its query rows and KV length (host integers), with a
        paged cache the block table ``[batch, pages]`` (host; a CUDA tensor is copied to the
        host, one synchronisation), with a ragged one optionally each request's first K/V
        row (default: packed back to back). Returns the work list."""
        self._copied.synchronize()  # the last upload has left the staging buffer
        return self._upload(
            self.planner.plan(
                query_lens, kv_lens, block_table, kv_offsets=kv_offsets, into=self._staging_values
            )
        )

    def plan_csr(
        self, query_lens: Any, kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any
    ) -> WorkList:
        """Plan a batch given FlashInfer's CSR page table (host ``kv_indptr [batch + 1]``,
        ``kv_indices``, ``kv_last_page_len [batch]``)."""
        self._copied.synchronize()
        return self._upload(
            self.planner.plan_csr(
                query_lens, kv_indptr, kv_indices, kv_last_page_len, into=self._staging_values
            )
        )

    def plan_varlen(self, cu_seqlens_q: Any, cu_seqlens_k: Any) -> WorkList:
        """Plan ragged attention as ``flash_attn_varlen_func`` takes it: ``cu_seqlens_q`` and
        ``cu_seqlens_k`` ``[batch + 1]`` (host), K/V packed likewise."""
        self._copied.synchronize()
        return self._upload(
            self.planner.plan_varlen(cu_seqlens_q, cu_seqlens_k, into=self._staging_values)
        )

    def _upload(self, planned: PlannedBatch) -> WorkList:
        """The staged words to the device buffer, on the current stream."""
        stream = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device):
            self._buffer[: planned.words].copy_(self._staging[: planned.words], non_blocking=True)
        self._copied.record(stream)
        p = self.bucket
        self._expected = Expected(
            self.dtype,
            self.device,
            planned.total_q,
            p.heads,
            p.kv_heads,
            p.head_dim,
            self.page_size,
            planned.largest_index,
        )
        self._merges = planned.work.merge_count
        self.work = planned.work
        return planned.work

    # ------------------------------------------------------------------ run

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The planned batch's attention into ``out`` (default: a new tensor like q);
        ``lse`` (float32 ``[total_q, heads]``) receives each row's natural-log LSE."""
        if torch.compiler.is_compiling():
            from kernels.serving import torch_op

            if lse is not None:
                raise ServingInputError("lse is not taken under torch.compile")
            result = torch.empty_like(q) if out is None else out
            torch_op.serving_attention_into(q, k_cache, v_cache, result, self.handle)
            return result
        if self._expected is None:
            raise ServingInputError("run before plan: call plan(...) with the batch first")
        checks.check_run(q, k_cache, v_cache, out, lse, self._expected)
        result = torch.empty_like(q) if out is None else out
        if torch.cuda.current_device() != self.device:
            with torch.cuda.device(self.device):
                self._launch(q, k_cache, v_cache, result, lse)
        else:
            self._launch(q, k_cache, v_cache, result, lse)
        return result

    def _launch(self, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        calls = self._calls.get(stream)
        if calls is None:
            driver = self._runner.driver
            calls = self._calls[stream] = tuple(
                driver.bind_launch(packed, stream) for packed in self._packed
            )
        merge = len(calls) > 1 and (self._merges > 0 or torch.cuda.is_current_stream_capturing())
        with self._lock:  # another thread must not rewrite the pointers before the launch
            pointers = self._pointers
            pointers["q"].value, pointers["k"].value = q.data_ptr(), k.data_ptr()
            pointers["v"].value, pointers["out"].value = v.data_ptr(), out.data_ptr()
            pointers["lse"].value = 0 if lse is None else lse.data_ptr()
            for call in calls if merge else calls[:1]:
                status = call()
                if status == CUDA_ERROR_INVALID_CONTEXT and self._runner.context:
                    # A thread that never made a CUDA call has no current context: torch's.
                    self._runner.driver.set_context(self._runner.context)
                    status = call()
                self._runner.driver.check(status, f"{self.plan_key} on cuda:{self.device}")

    def __repr__(self) -> str:
        return (
            f"BatchAttention({self.bucket.label()}, {self.plan_key}, origin={self.origin}, "
            f"rows a work item={self.planner.work_params.block_rows})"
        )
