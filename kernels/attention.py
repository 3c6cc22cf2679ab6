"""Deploy-time attention: the tuned plan of a shape, looked up once, run on the caller's arrays.

    import kernels
    out = kernels.attention(q, k, v, causal=True)   # torch CUDA tensors or GPUArrays, any of
                                                    # float32, bfloat16, float16: out likewise
    kernels.attention(q, k, v, registry="sqlite:///plans.sqlite", out=buffer)

    attend = kernels.Attention("postgresql+psycopg://host/plans")   # a service keeps its own
    out = attend(q, k, v, causal=True)

``kernels.attention`` is this module, made callable (it forwards to ``attention``): the import
system binds the package attribute to the submodule, so the function could not keep the name.

This module is the API: the registry handle, one shared ``Attention`` per registry, and the
path of a call. The pieces live beside it:

* ``kernels.attention_args``: the argument checks, done before any CUDA call, and the device of
  interface arrays (``AttentionInputError`` names the argument, what it was and what is
  expected); q, k, v (and ``out``) share one dtype: float32, bfloat16 or float16 (bfloat16 only
  as torch tensors: ``__cuda_array_interface__`` has no name for it);
* ``kernels.plan_choice``: the plan of each shape and dtype, asked of the registry once per
  shape, dtype and GPU, with the planner's default plan for that dtype as a fallback and a
  warning (logger ``kernels.attention``) where none fits;
* ``kernels.backends.pycuda_attention``: one GPU through PyCUDA (kernels, split scratch,
  launches, contexts and streams), imported on the first call, so importing this module loads
  no pycuda, torch or database code.

After the first call for a shape a call is the argument checks, dict lookups, and one or two
launches, with no host synchronisation (on an H200: about 26 us per call from torch, of which
9 us is PyCUDA's own launch call).
"""

from __future__ import annotations

import os
import sys
import threading
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernels.attention_args import (
    AttentionInputError,
    AttentionInputTypeError,
    check_causal,
    check_inputs,
    check_precision,
    interface_device,
)
from kernels.plan_choice import ChosenPlan
from tuner.data_dir import default_registry_file
from tuner.environment import Environment
from tuner.problem import Problem

if TYPE_CHECKING:
    from db import PlanRegistry
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


class Attention:
    """A registry handle, caches and per-GPU state; call it like ``attention``.

    ``registry``: None (the tuner's default registry, ``plans.sqlite`` in the per-user data
    directory of ``tuner.data_dir``, when it exists, else none), a SQLAlchemy URL (opened
    read-only on first use), or an open ``PlanRegistry`` (or anything with its
    ``cached_best``). ``nearest``: fall back to the nearest tuned shape. ``cache_dir``: the
    cubin cache (default: the directory in ``$FLASH_ATTENTION_TUNER_CUBIN_CACHE``, else the
    PyCUDA backend's).
    """

    def __init__(
        self,
        registry: str | PlanRegistry | None = None,
        *,
        nearest: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        default_file = default_registry_file()
        if registry is None and default_file.exists():
            registry = f"sqlite:///{default_file.resolve().as_posix()}"
        self.registry_url = registry if isinstance(registry, str) else None
        self._registry = None if isinstance(registry, str) else registry
        self.nearest = nearest
        directory = cache_dir or os.environ.get(CACHE_DIR_VARIABLE)
        self.cache_dir = Path(directory).expanduser() if directory else None
        self._runners: dict[int, DeviceRunner] = {}
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
    ) -> Any:
        inputs = check_inputs(q, k, v, out)
        causal = check_causal(causal)
        asked = check_precision(precision, inputs.q.dtype)
        if inputs.q.is_torch:
            runner = self._runner(inputs.q.device or 0)
            return runner.run_torch(inputs, causal, sys.modules["torch"], asked)
        device, facts = interface_device(inputs)
        return self._runner(device).run_arrays(inputs, causal, facts, asked)

    def plan_for(self, problem: Problem, device: int = 0) -> ChosenPlan:
        """The plan ``problem`` runs with on GPU ``device`` (chosen now if not yet)."""
        return self._runner(device).chooser.plan_for(problem)

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
                    runner = DeviceRunner(index, registry, self.nearest, self.cache_dir)
                    self._runners[index] = runner
        return runner

    def _open_registry(self) -> Any:
        if self._registry is None and self.registry_url is not None:
            from db import PlanRegistry

            self._registry = PlanRegistry.open(self.registry_url, readonly=True)
        return self._registry

    def close(self) -> None:
        """Free device state; close the registry if this object opened it.

        GPUArrays it returned belong to the context it retained: free them first.
        """
        with self._lock:
            for runner in self._runners.values():
                runner.close()
            self._runners.clear()
            if self.registry_url is not None and self._registry is not None:
                self._registry.close()
                self._registry = None


_instances: dict[tuple[Any, bool], Attention] = {}
_instances_lock = threading.Lock()


def default_instance(
    registry: str | PlanRegistry | None = None, *, nearest: bool = False
) -> Attention:
    """The shared ``Attention`` of a registry: one per URL (or handle) and ``nearest``.

    For ``registry=None`` whether the default registry file exists is decided at the first call.
    A handle is kept alive by its instance, so its ``id`` is never reused for another.
    """
    if registry is None:
        name: tuple[str, Any] = ("default", None)
    elif isinstance(registry, str):
        name = ("url", registry)
    else:
        name = ("handle", id(registry))
    key = (name, nearest)
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
) -> Any:
    """softmax(q k^T / sqrt(head_dim)) v with the tuned plan of this shape; see the module doc.

    Returns a new array of q's kind and dtype (a torch tensor, else a GPUArray), or ``out``
    filled. bfloat16 and float16 run the best plan stored for that dtype (tensor-core kernels).
    float32 runs the plan stored for ``precision``: "tf32x3" (None means it: float32-class
    error, SIMT or 3xTF32 plans) or "tf32" (one-pass TF32 plans too); a plan tuned under
    "tf32" is never served to a "tf32x3" call.
    """
    return default_instance(registry, nearest=nearest)(
        q, k, v, causal, out=out, precision=precision
    )


class _CallableModule(types.ModuleType):
    """``kernels.attention`` is this module once imported; calling it calls ``attention``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return attention(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
