"""``kernels.attention`` in training, on the CPU: the autograd formula of
``flash_attention_tuner::attention_with_lse`` and the ``attention_backward`` op, eager and under
``torch.compile(fullgraph=True)`` (the joint graph AOTAutograd traces), on tensors of the
"meta" device (a CPU-only torch runs no autograd on fake CUDA tensors; the ops' fake
implementations are their meta kernels, and ``attention_args.TRACED_DEVICE_TYPES`` lets them
take meta tensors here). The refusals of what has no backward are ``test_attention``'s.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from functorch.compile import make_boxed_func  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

import kernels  # noqa: E402
from kernels import attention_args, torch_op  # noqa: E402
from kernels.attention_args import AttentionInputTypeError  # noqa: E402

OPS = torch.ops.flash_attention_tuner


@pytest.fixture(autouse=True)
def meta_is_traceable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_args, "TRACED_DEVICE_TYPES", frozenset({"cuda", "meta"}))


def meta(*shape: int, dtype: Any = torch.bfloat16, grad: bool = False) -> Any:
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def test_the_fake_kernels_give_the_output_lse_and_gradient_shapes() -> None:
    q, k, v = meta(2, 8, 100, 64), meta(2, 2, 130, 64), meta(2, 2, 130, 64)
    out, lse = OPS.attention_with_lse(q, k, v, True, None, False)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32
    dq, dk, dv = OPS.attention_backward(out, q, k, v, out, lse, True, None, False, True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    with pytest.raises(AttentionInputTypeError, match="gradients are computed for bfloat16"):
        OPS.attention_with_lse(*(meta(1, 1, 8, 16, dtype=torch.float32),) * 3, False, None, False)


class Captured:
    """AOTAutograd's forward and backward graphs of a compiled training step."""

    def __init__(self) -> None:
        self.graphs: dict[str, Any] = {}
        self.backend = aot_autograd(
            fw_compiler=self.keep("forward"), bw_compiler=self.keep("backward")
        )

    def keep(self, name: str) -> Any:
        def compiler(graph: Any, example_inputs: Any) -> Any:
            self.graphs[name] = graph
            return make_boxed_func(graph.forward)

        return compiler

    def calls(self, name: str) -> list[Any]:
        return [
            node
            for node in self.graphs[name].graph.nodes
            if node.op == "call_function" and "flash_attention_tuner" in str(node.target)
        ]


class Block(torch.nn.Module):
    """A projection, attention with GQA (4 query heads on 2 KV heads), a sum."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(meta(64, 64))

    def forward(self, x: Any) -> Any:
        batch, length, _ = x.shape
        q = torch.nn.functional.linear(x, self.weight).view(batch, length, 4, 16).transpose(1, 2)
        kv = x[..., :32].reshape(batch, length, 2, 16).transpose(1, 2).contiguous()
        out = kernels.attention(q.contiguous(), kv, kv, causal=True)
        return out.float().square().sum()


def test_eager_backward_runs_the_formula_through_the_backward_op(monkeypatch) -> None:
    seen: list[tuple[Any, ...]] = []
    real = torch_op.attention_backward_op

    def recording(*args: Any) -> Any:
        seen.append(args)
        return real(*args)

    monkeypatch.setattr(torch_op, "attention_backward_op", recording)
    block, x = Block(), meta(2, 40, 64, grad=True)
    block(x).backward()
    assert x.grad.shape == x.shape and block.weight.grad.shape == (64, 64)
    (args,) = seen
    dout, q, k, v, out, lse = args[:6]
    assert dout.is_contiguous() and q.shape == (2, 4, 40, 16) and k.shape == (2, 2, 40, 16)
    assert lse.shape == (2, 4, 40) and args[6:] == (True, None, False, False)


def test_deterministic_algorithms_reach_the_backward(monkeypatch) -> None:
    seen: list[bool] = []
    real = torch_op.attention_backward_op
    monkeypatch.setattr(
        torch_op, "attention_backward_op", lambda *a: seen.append(a[-1]) or real(*a)
    )
    torch.use_deterministic_algorithms(True)
    try:
        Block()(meta(1, 16, 64, grad=True)).backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen == [True]


def test_a_compiled_training_step_has_the_forward_and_backward_ops_and_no_break() -> None:
    captured = Captured()
    block, x = Block(), meta(2, 40, 64, grad=True)
    step = torch.compile(block, fullgraph=True, backend=captured.backend)
    step(x).backward()
    assert x.grad.shape == x.shape and block.weight.grad.shape == (64, 64)
    (forward,) = captured.calls("forward")
    assert forward.target == OPS.attention_with_lse.default
    assert forward.args[3:] == (True, None, False)  # causal, registry, nearest
    (backward,) = captured.calls("backward")
    assert backward.target == OPS.attention_backward.default
    assert backward.args[6:] == (True, None, False, False)  # ..., deterministic


def test_a_compiled_step_with_a_registry_url_carries_it() -> None:
    captured = Captured()
    attend = kernels.Attention("sqlite:///plans.sqlite")

    def step(q: Any, k: Any, v: Any) -> Any:
        return attend(q, k, v).float().sum()

    q, k, v = (meta(1, 2, 32, 16, grad=True) for _ in range(3))
    torch.compile(step, fullgraph=True, backend=captured.backend)(q, k, v).backward()
    assert captured.calls("forward")[0].args[3:] == (False, "sqlite:///plans.sqlite", False)
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_a_registry_handle_cannot_train() -> None:
    class Registry:
        def cached_best(self, *args: Any, **kwargs: Any) -> None:
            return None

    q = meta(1, 2, 32, 16, grad=True)
    with pytest.raises(AttentionInputTypeError, match="registry as a URL or None"):
        kernels.attention(q, q, q, registry=Registry())  # type: ignore[arg-type]
