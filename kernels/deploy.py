"""Deploy-time attention: the tuned plan of a shape, resolved once, launched on the caller's arrays.

    import kernels
    out = kernels.attention(q, k, v, causal=True)   # torch CUDA tensors or GPUArrays, any of
                                                    # float32, bfloat16, float16: out likewise
    kernels.attention(q, k, v, registry="sqlite:///plans.sqlite", out=buffer)

    attend = kernels.Attention("postgresql+psycopg://host/plans")   # a service keeps its own
    out = attend(q, k, v, causal=True)

``kernels.attention`` is the function ``attention`` here (``kernels`` loads this module on first
use). The first call of a problem (shape, dtype, causal, variants) on a GPU resolves it into a
handle (``kernels.backends.attention_handle``): the plan, asked of the registry once, the loaded
kernels, launch geometry, split scratch and packed arguments. Against a KV cache
(``kv_len != seq_len``) the plan is chosen once per KV bucket (``kernels.kv_buckets``: lengths
rounded up to a power of two) and a new length only re-partitions the bucket's plan on the
host (``tuner.planner.kernel_variant.plan_at``), so decode steps, each at a new length, reuse
one plan, one compiled kernel and one split scratch per bucket. A later call with torch tensors is
a dictionary hit on the call's signature (shapes, dtypes, devices, causal, window, softcap,
whether slopes and sinks are given), a few attribute reads that stand for the argument checks,
the output's allocation (none with ``out=``) and the launch on torch's current stream: no host
synchronisation, so it is captured by ``torch.cuda.graph``
(call it once before capturing: the first call compiles and loads). Under ``torch.compile`` the
call becomes the custom op ``flash_attention_tuner::attention`` (``kernels.torch_op``), so a
compiled model has no graph break.

Training: a call on bfloat16/float16 torch tensors of which one requires grad (grad mode on)
goes through ``flash_attention_tuner::attention_with_lse``, whose autograd formula keeps q, k,
v, the output and the rows' log-sum-exps and runs ``flash_attention_tuner::attention_backward``
for dq, dk, dv: the backward plan tuned for the problem (``direction=backward``), else the
planner's default, deterministic when ``torch.use_deterministic_algorithms(True)`` is on.

The pieces:

* ``kernels.attention_args``: the argument checks, done before any CUDA call, and the device of
  interface arrays (``AttentionInputError`` names the argument, what it was and what is
  expected); q, k, v (and ``out``) share one dtype: float32, bfloat16 or float16 (bfloat16 only
  as torch tensors: ``__cuda_array_interface__`` has no name for it); k and v may have fewer
  heads (GQA) and another length (a KV cache; causal is bottom-right aligned), inferred there;
* ``kernels.variant_args``: the variants' arguments (``window=(left, right)``, ``softcap``,
  ``alibi_slopes`` and ``sinks`` as float32 ``[heads]`` arrays, ``scale``), checked alike; the
  problem asked of the registry has the window, the softcap and whether slopes and sinks are
  given, never their values nor the scale, which the handle writes per call;
* ``kernels.plan_choice``: the plan of each problem, asked of the registry once per problem and
  GPU, with the planner's default plan for that dtype as a fallback (``origin="default"``) and
  one warning (logger ``kernels.attention``) where none fits or the registry cannot be opened;
* ``kernels.backends.pycuda_attention``: one GPU (context, plans, kernels, handles), imported on
  the first call, so importing this module loads no pycuda, torch or database code.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernels.attention_args import (
    AttentionInputError,
    AttentionInputTypeError,
    check_causal,
    check_differentiable_dtype,
    check_inputs,
    check_lse,
    check_precision,
    describe,
    differentiable,
    interface_device,
    problem_of,
    torch_pointers,
    torch_signature,
    wants_grad,
)
from kernels.attention_variants import LOG2E
from kernels.plan_choice import ChosenPlan
from kernels.variant_args import NO_WINDOW, check_variants
from tuner.data_dir import default_registry_file
from tuner.environment import Environment
from tuner.errors import TunerError
from tuner.problem import Problem

if TYPE_CHECKING:
    from db import PlanRegistry
    from kernels.backends.attention_handle import AttentionHandle
    from kernels.backends.pycuda_attention import DeviceRunner

__all__ = [
    "Attention",
    "AttentionInputError",
    "AttentionInputTypeError",
    "attention",
    "clear_default_instances",
    "default_instance",
]

#: where compiled cubins are cached when ``cache_dir`` is not given (else the backend's default)
CACHE_DIR_VARIABLE = "FLASH_ATTENTION_TUNER_CUBIN_CACHE"
#: torch call signatures kept for the fast path (those met last): a decode meets a new KV
#: length, hence a new signature, at every step
SIGNATURE_CACHE = 1024


class Attention:
    """A registry, its handles per problem and GPU; call it like ``attention``.

    ``registry``: None (the tuner's default registry, ``plans.sqlite`` in the per-user data
    directory of ``tuner.data_dir``, when it exists, else none), a SQLAlchemy URL (opened
    read-only on first use; one that cannot be opened, e.g. a missing file, means no registry:
    every problem gets the fallback plan, with one warning per problem saying why), or an open
    ``PlanRegistry`` (or anything with its ``cached_best``). ``nearest``: fall back to the
    nearest tuned shape. ``cache_dir``: the cubin cache (default: the directory in
    ``$FLASH_ATTENTION_TUNER_CUBIN_CACHE``, else the PyCUDA backend's). ``driver``: what loads
    and launches kernels (default ``kernels.cuda_driver.CudaDriver``).
    """

    def __init__(
        self,
        registry: str | PlanRegistry | None = None,
        *,
        nearest: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        driver: Any = None,
    ) -> None:
        default_file = default_registry_file()
        if registry is None and default_file.exists():
            registry = f"sqlite:///{default_file.resolve().as_posix()}"
        self.registry_url = registry if isinstance(registry, str) else None
        self._registry = None if isinstance(registry, str) else registry
        self._registry_unavailable = ""
        self.nearest = nearest
        directory = cache_dir or os.environ.get(CACHE_DIR_VARIABLE)
        self.cache_dir = Path(directory).expanduser() if directory else None
        self._driver = driver
        self._runners: dict[int, DeviceRunner] = {}
        #: torch call signature (``attention_args.torch_signature``) -> its handle
        self._torch_handles: dict[tuple[Any, ...], AttentionHandle] = {}
        self._lock = threading.Lock()

    def __call__(
        self,
        q: Any,
        k: Any,
        v: Any,
        causal: bool = False,
        *,
        out: Any = None,
        precision: str | None = None,
        window: tuple[int, int] = NO_WINDOW,
        softcap: float = 0.0,
        alibi_slopes: Any = None,
        sinks: Any = None,
        scale: float | None = None,
    ) -> Any:
        variants = (window, softcap, alibi_slopes, sinks, scale)
        torch = sys.modules.get("torch")  # a torch tensor exists only if torch was imported
        if torch is not None and torch.compiler.is_compiling():
            # torch.compile traces this: the custom op stands for the call in the graph.
            from kernels import torch_op

            named = self.registry_url, self._registry, self.nearest
            return torch_op.traced_call(*named, q, k, v, causal, out, precision, *variants)
        return self.call_eager(q, k, v, causal, out, precision, *variants)

    def call_eager(
        self,
        q: Any,
        k: Any,
        v: Any,
        causal: Any,
        out: Any,
        precision: str | None = None,
        window: Any = NO_WINDOW,
        softcap: Any = 0.0,
        alibi_slopes: Any = None,
        sinks: Any = None,
        scale: Any = None,
    ) -> Any:
        """The call outside torch.compile's tracing (``__call__`` less that check)."""
        torch = sys.modules.get("torch")
        plain = torch is not None and type(q) is torch.Tensor and type(k) is type(q) is type(v)
        # 1 == True: refused, not a key hit; a precision other than None or a str goes to
        # the checks too (which refuse it) rather than into a dict key; so do variants of
        # any but their plain types.
        if (
            plain
            and (causal is True or causal is False)
            and (precision is None or type(precision) is str)
            and _plain_variants(torch, window, softcap, alibi_slopes, sinks, scale)
        ):
            signature = torch_signature(
                q, k, v, causal, precision, window, softcap, alibi_slopes, sinks
            )
            handle = self._torch_handles.get(signature)
            if handle is not None:
                pointers = torch_pointers(
                    q, k, v, out, handle.tensor_bytes, torch, handle.kv_tensor_bytes,
                    alibi_slopes, sinks,
                )
                if pointers is not None:
                    q_at, k_at, v_at, slopes_at, sinks_at = pointers
                    return handle.run_torch(
                        q, q_at, k_at, v_at, out, torch, slopes_at, sinks_at,
                        None if scale is None else scale * LOG2E,
                    )
        if (
            torch is not None
            and isinstance(q, torch.Tensor)
            and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)
            and wants_grad(q, k, v, torch)
            and differentiable(q, out, precision, torch)
        ):
            if _variant_given(window, softcap, alibi_slopes, sinks, scale):
                raise AttentionInputError(
                    "gradients through a window, softcap, ALiBi, sinks or a custom scale are "
                    "not implemented yet (the backward kernels take them; the autograd op "
                    "does not): call it under torch.no_grad() or without them"
                )
            return self._differentiable_call(q, k, v, causal)
        return self._checked_call(
            q, k, v, causal, out, precision, window, softcap, alibi_slopes, sinks, scale
        )

    def _differentiable_call(self, q: Any, k: Any, v: Any, causal: Any) -> Any:
        """A call autograd differentiates: the op with an autograd formula
        (``torch_op.attention_with_lse``, which keeps the LSE for the backward), its output."""
        from kernels import torch_op

        named = self.registry_url, self._registry, self.nearest
        return torch_op.differentiable_call(*named, q, k, v, causal)

    def attention_with_lse(self, q: Any, k: Any, v: Any, causal: bool) -> tuple[Any, Any]:
        """The forward of a training step on torch tensors: the output and each row's
        natural-log log-sum-exp (float32 ``[batch, heads, seq_len]``, +inf for a row that sees
        no key), which the backward reads. What the autograd op runs."""
        torch = sys.modules["torch"]
        inputs = check_inputs(q, k, v, allow_grad=True)
        check_differentiable_dtype(inputs.q.dtype)
        problem = problem_of(inputs, check_causal(causal))
        # a training shape is fixed: its own tuned plan, not its KV bucket's
        handle = self._runner(inputs.q.device or 0).handle(problem, exact=True)
        lse = torch.empty(inputs.q.shape[:3], dtype=torch.float32, device=q.device)
        pointers = (inputs.q.pointer, inputs.k.pointer, inputs.v.pointer)
        return handle.run_torch(q, *pointers, None, torch, lse=lse), lse

    def attention_backward(
        self,
        dout: Any,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        causal: bool,
        deterministic: bool = False,
    ) -> tuple[Any, Any, Any]:
        """dq, dk, dv of the attention of q, k, v (torch tensors) whose output ``out`` and
        log-sum-exps ``lse`` the forward gave, for the output's gradient ``dout``; the backward
        plan stored for the problem (direction backward), else the planner's default.
        ``deterministic``: dQ summed in a fixed order (bit-identical reruns)."""
        torch = sys.modules["torch"]
        inputs = check_inputs(q, k, v, out, allow_grad=True)
        gradient = describe("dout", dout, allow_grad=True)
        if gradient.shape != inputs.q.shape or gradient.dtype != inputs.q.dtype:
            raise AttentionInputError(
                f"dout has shape {gradient.shape} and dtype {gradient.dtype}; expected q's "
                f"{inputs.q.shape} {inputs.q.dtype}"
            )
        check_lse(lse, inputs.q)
        forward = problem_of(inputs, check_causal(causal))
        problem = dataclasses.replace(forward, direction="backward")
        handle = self._runner(inputs.q.device or 0).backward_handle(problem, deterministic)
        return handle.run_torch(dout, q, k, v, out, lse, torch)

    def _checked_call(
        self,
        q: Any,
        k: Any,
        v: Any,
        causal: Any,
        out: Any,
        precision: str | None,
        window: Any,
        softcap: Any,
        alibi_slopes: Any,
        sinks: Any,
        scale: Any,
    ) -> Any:
        """The first call of a signature, and any call the fast path declines: every check."""
        inputs = check_inputs(q, k, v, out)
        causal = check_causal(causal)
        variants = check_variants(inputs, window, softcap, alibi_slopes, sinks, scale)
        precision_asked = check_precision(precision, inputs.q.dtype)
        problem = problem_of(inputs, causal, precision_asked, variants)
        if inputs.q.is_torch:
            torch = sys.modules["torch"]
            handle = self._runner(inputs.q.device or 0).handle(problem)
            plain = type(q) is torch.Tensor and type(k) is type(q) is type(v)
            # What the fast path looks up (the plain types it takes, as given).
            if (
                plain
                and type(causal) is bool
                and _plain_variants(torch, window, softcap, alibi_slopes, sinks, scale)
            ):
                signature = torch_signature(
                    q, k, v, causal, precision, window, softcap, alibi_slopes, sinks
                )
                self._torch_handles[signature] = handle
                if len(self._torch_handles) > SIGNATURE_CACHE:
                    self._torch_handles.pop(next(iter(self._torch_handles)), None)  # the oldest
            pointers = (inputs.q.pointer, inputs.k.pointer, inputs.v.pointer)
            return handle.run_torch(
                q, *pointers, out, torch, *variants.pointers, variants.scale_log2
            )
        device, facts = interface_device(inputs, variants.arrays)
        return self._runner(device).run_arrays(inputs, problem, facts, variants)

    def handle(self, problem: Problem, device: int = 0) -> AttentionHandle:
        """The handle ``problem`` runs with on GPU ``device`` (resolved now if not yet)."""
        return self._runner(device).handle(problem)

    def plan_for(self, problem: Problem, device: int = 0) -> ChosenPlan:
        """The plan ``problem`` runs with on GPU ``device`` (chosen now if not yet)."""
        return self.handle(problem, device).chosen

    def device_runner(self, device: int = 0) -> DeviceRunner:
        """GPU ``device``'s runner (plans, compiled and loaded kernels): what
        ``kernels.serving`` builds its work-list launches on."""
        return self._runner(device)

    def environment(self, device: int = 0) -> Environment:
        """GPU ``device``'s environment: what the registry is asked with."""
        return self._runner(device).environment

    def _runner(self, index: int) -> DeviceRunner:
        runner = self._runners.get(index)
        if runner is None:
            with self._lock:
                runner = self._runners.get(index)
                if runner is None:
                    # Here, not at the top: the GPU half loads only when a call needs a GPU.
                    from kernels.backends.pycuda_attention import DeviceRunner

                    registry = self._open_registry()
                    runner = DeviceRunner(
                        index,
                        registry,
                        self.nearest,
                        self.cache_dir,
                        driver=self._driver,
                        registry_unavailable=self._registry_unavailable,
                    )
                    self._runners[index] = runner
        return runner

    def _open_registry(self) -> Any:
        """The registry, opened read-only once; None (and why) where it cannot be opened."""
        if self._registry is None and self.registry_url is not None:
            from db import PlanRegistry

            try:
                self._registry = PlanRegistry.open(self.registry_url, readonly=True)
            except TunerError as error:  # RegistryError: missing file, no server, old schema
                self._registry_unavailable = str(error)
        return self._registry

    def close(self) -> None:
        """Free device state; close the registry if this object opened it.

        GPUArrays it returned belong to the context it retained: free them first.
        """
        with self._lock:
            self._torch_handles.clear()
            for runner in self._runners.values():
                runner.close()
            self._runners.clear()
            if self.registry_url is not None and self._registry is not None:
                self._registry.close()
                self._registry = None


def _variant_given(
    window: Any, softcap: Any, alibi_slopes: Any, sinks: Any, scale: Any
) -> bool:
    """Whether a call asks for any variant or a scale of its own."""
    return (
        not (isinstance(window, tuple | list) and tuple(window) == NO_WINDOW)
        or softcap != 0
        or alibi_slopes is not None
        or sinks is not None
        or scale is not None
    )


_instances: dict[tuple[Any, bool], Attention] = {}
_instances_lock = threading.Lock()


def _instance_key(registry: Any, nearest: bool) -> tuple[Any, bool]:
    if registry is None or isinstance(registry, str):
        return registry, nearest
    return ("handle", id(registry)), nearest


def default_instance(
    registry: str | PlanRegistry | None = None, *, nearest: bool = False
) -> Attention:
    """The shared ``Attention`` of a registry: one per URL (or handle) and ``nearest``.

    For ``registry=None`` whether the default registry file exists is decided at the first call.
    A handle is kept alive by its instance, so its ``id`` is never reused for another.
    """
    key = _instance_key(registry, nearest)
    found = _instances.get(key)
    if found is None:
        with _instances_lock:
            found = _instances.get(key)
            if found is None:
                found = _instances[key] = Attention(registry, nearest=nearest)
    return found


def clear_default_instances() -> None:
    with _instances_lock:
        for instance in _instances.values():
            instance.close()
        _instances.clear()


def attention(
    q: Any,
    k: Any,
    v: Any,
    causal: bool = False,
    registry: str | PlanRegistry | None = None,
    *,
    out: Any = None,
    nearest: bool = False,
    precision: str | None = None,
    window: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    scale: float | None = None,
) -> Any:
    """softmax(q k^T * scale) v with the tuned plan of this problem; see the module doc.

    Returns a new array of q's kind and dtype (a torch tensor, else a GPUArray), or ``out``
    filled. bfloat16 and float16 run the best plan stored for that dtype (tensor-core kernels).
    float32 runs the plan stored for ``precision``: "tf32x3" (None means it: float32-class
    error, SIMT or 3xTF32 plans) or "tf32" (one-pass TF32 plans too); a plan tuned under
    "tf32" is never served to a "tf32x3" call.

    Variants (``kernels.variant_args``; FlashAttention's conventions): ``window=(left,
    right)``, -1 for no bound on a side (a single int is refused); ``softcap`` >= 0;
    ``alibi_slopes`` and ``sinks``: float32 ``[heads]`` arrays of q's kind on q's GPU;
    ``scale``: the softmax scale, None for ``1/sqrt(head_dim)``. The plan is the one tuned
    for the window, softcap, ALiBi and sinks as given (never another variant's); slopes,
    sinks and the scale are read per call.
    Under ``torch.compile``, ``registry`` must be None or a URL.
    """
    variants = (window, softcap, alibi_slopes, sinks, scale)
    torch = sys.modules.get("torch")  # a torch tensor exists only if torch was imported
    if torch is not None and torch.compiler.is_compiling():
        # torch.compile traces this: the custom op stands for the call in the graph.
        from kernels import torch_op

        url = registry if isinstance(registry, str) else None
        return torch_op.traced_call(
            url, registry, nearest, q, k, v, causal, out, precision, *variants
        )
    shared = registry is None or type(registry) is str
    found = _instances.get((registry, nearest)) if shared else None
    if found is None:
        found = default_instance(registry, nearest=nearest)
    return found.call_eager(q, k, v, causal, out, precision, *variants)


def _plain_variants(
    torch: Any, window: Any, softcap: Any, alibi_slopes: Any, sinks: Any, scale: Any
) -> bool:
    """Whether the variant arguments are of the types the fast path keys on as given: a tuple
    of two ints, a float or int softcap (not a bool), tensors or None, a float scale > 0 or
    None. Anything else takes the checks, which refuse it or take it on their path."""
    return (
        (
            window is NO_WINDOW
            or (
                type(window) is tuple
                and len(window) == 2
                and type(window[0]) is int
                and type(window[1]) is int
            )
        )
        and (type(softcap) is float or type(softcap) is int)
        and (alibi_slopes is None or type(alibi_slopes) is torch.Tensor)
        and (sinks is None or type(sinks) is torch.Tensor)
        and (scale is None or (type(scale) is float and 0 < scale < math.inf))
    )

