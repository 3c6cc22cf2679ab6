"""The torch custom ops of ``kernels.attention`` on the CPU: the fake implementations, and what
``torch.compile(fullgraph=True)`` makes of a model that calls ``kernels.attention``.

torch's fake CUDA tensors (``FakeTensorMode``) carry shape, dtype and device without memory or
a GPU, so dynamo traces a model on them here exactly as it does on a GPU machine, up to the
graph handed to the backend (captured here instead of compiled). Skipped without torch (CI
installs the CPU build: the ``torch-cpu`` extra).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import kernels  # noqa: E402
from kernels import torch_op  # noqa: E402
from kernels.attention_args import AttentionInputError, AttentionInputTypeError  # noqa: E402

OPS = torch.ops.flash_attention_tuner
SHAPE = (2, 4, 64, 32)
#: the ops' variant arguments of a plain call: window_left, window_right, softcap,
#: alibi_slopes, sinks, scale
NO_VARIANTS = (-1, -1, 0.0, None, None, None)


def fake(shape: tuple[int, ...] = SHAPE, dtype: Any = None, device: str = "cuda") -> Any:
    return torch.empty(shape, dtype=dtype or torch.bfloat16, device=device)


@pytest.fixture
def fake_mode() -> Any:
    with FakeTensorMode() as mode:
        yield mode


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_fake_implementation_propagates_shape_dtype_and_device(fake_mode, dtype) -> None:
    q, k, v = (fake(dtype=getattr(torch, dtype)) for _ in range(3))
    out = OPS.attention(q, k, v, True, None, False)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert OPS.attention_into(q, k, v, fake(dtype=q.dtype), False, "sqlite:///x", True) is None


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        # k may be longer than q (a KV cache) but v must match it
        (lambda: (fake(), fake((2, 4, 65, 32)), fake()), AttentionInputError, r"^v has shape"),
        (
            lambda: (fake(), fake((2, 4, 64, 16)), fake((2, 4, 64, 16))),
            AttentionInputError,
            r"head_dim",
        ),
        (
            lambda: (fake(), fake(), fake(dtype=torch.float16)),
            AttentionInputTypeError,
            r"^v has dtype float16 but q has dtype bfloat16",
        ),
        (lambda: (fake(device="cpu"),) * 3, AttentionInputTypeError, r"q is a torch tensor on cpu"),
        (lambda: (fake((4, 64, 32)),) * 3, AttentionInputError, r"^q has 3 dimensions"),
        (
            lambda: (fake(), fake(), fake(dtype=torch.float64)),
            AttentionInputTypeError,
            r"^v has dtype torch.float64; expected one of",
        ),
    ],
)
def test_the_fake_implementation_refuses_what_the_op_would(fake_mode, arguments, error, message):
    with pytest.raises(error, match=message):
        OPS.attention(*arguments(), False, None, False)


def test_the_fake_into_checks_out(fake_mode) -> None:
    q = fake()
    with pytest.raises(AttentionInputError, match=r"^out has shape \(2, 4, 64, 16\)"):
        OPS.attention_into(q, q, q, fake((2, 4, 64, 16)), False, None, False)
    with pytest.raises(AttentionInputTypeError, match=r"^out has dtype float32 but q has"):
        OPS.attention_into(q, q, q, fake(dtype=torch.float32), False, None, False)


class Captured:
    """A torch.compile backend that keeps the graph dynamo hands it and runs it as traced."""

    def __init__(self) -> None:
        self.graphs: list[Any] = []

    def __call__(self, graph: Any, example_inputs: Any) -> Any:
        self.graphs.append(graph)
        return graph.forward

    def targets(self) -> list[Any]:
        (graph,) = self.graphs  # one graph: no graph break
        return [node.target for node in graph.graph.nodes if node.op == "call_function"]


class Block(torch.nn.Module):
    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options

    def forward(self, q: Any, k: Any, v: Any) -> Any:
        return kernels.attention(q, k, v, True, **self.options) * 2 + q


def test_compile_fullgraph_puts_one_op_where_the_call_was(fake_mode) -> None:
    backend = Captured()
    q, k, v = fake(), fake(), fake()
    out = torch.compile(Block(), fullgraph=True, backend=backend)(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    targets = backend.targets()
    assert targets.count(OPS.attention.default) == 1 and len(targets) == 3
    (node,) = [n for n in backend.graphs[0].graph.nodes if n.target == OPS.attention.default]
    assert node.args[3:7] == (True, None, False, None)  # causal, registry, nearest, precision
    assert node.args[7:] == NO_VARIANTS


def test_compile_fullgraph_of_out_and_of_an_instance(fake_mode) -> None:
    backend = Captured()
    attend = kernels.Attention("sqlite:///plans.sqlite", nearest=True)

    def into(q: Any, k: Any, v: Any, out: Any) -> Any:
        return attend(q, k, v, False, out=out) + 1

    q, k, v, out = fake(), fake(), fake(), fake()
    result = torch.compile(into, fullgraph=True, backend=backend)(q, k, v, out)
    assert result.shape == q.shape
    (graph,) = backend.graphs
    (node,) = [n for n in graph.graph.nodes if n.target == OPS.attention_into.default]
    assert node.args[4:8] == (False, "sqlite:///plans.sqlite", True, None)
    assert node.args[8:] == NO_VARIANTS


def test_compile_fullgraph_carries_the_precision(fake_mode) -> None:
    backend = Captured()
    q, k, v = (fake(dtype=torch.float32) for _ in range(3))
    torch.compile(Block(precision="tf32"), fullgraph=True, backend=backend)(q, k, v)
    (node,) = [n for n in backend.graphs[0].graph.nodes if n.target == OPS.attention.default]
    assert node.args[3:7] == (True, None, False, "tf32")


def test_compile_refuses_an_open_registry_handle_and_bad_causal(fake_mode) -> None:
    class Handle:
        def cached_best(self, *args: Any, **kwargs: Any) -> None:
            return None

    compiled = torch.compile(Block(registry=Handle()), fullgraph=True, backend=Captured())
    with pytest.raises(Exception, match=r"registry must be a URL or None, not an open registry"):
        compiled(fake(), fake(), fake())
    with pytest.raises(AttentionInputTypeError, match=r"causal must be a bool, got 1"):
        torch_op.traced_call(None, None, False, fake(), fake(), fake(), 1, None)


def test_the_ops_are_registered_for_cuda_only() -> None:
    q = torch.zeros(SHAPE)
    with pytest.raises(NotImplementedError):
        OPS.attention(q, q, q, False, None, False)


# ---------------------------------------------------------------------------- variants


def heads_fake(heads: int = SHAPE[1], dtype: Any = None, device: str = "cuda") -> Any:
    return torch.empty((heads,), dtype=dtype or torch.float32, device=device)


def test_the_fake_implementations_take_and_check_the_variants(fake_mode) -> None:
    q, k, v = fake(), fake((2, 2, 80, 32)), fake((2, 2, 80, 32))
    out = OPS.attention(
        q, k, v, True, None, False, None, 16, -1, 30.0, heads_fake(), heads_fake(), 0.1
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    into = fake()
    assert OPS.attention_into(q, k, v, into, False, None, False, None, 4, 4, 0.0, None,
                              heads_fake(), None) is None
    for slopes, error, message in [
        (heads_fake(8), AttentionInputError, r"^alibi_slopes has shape \(8,\); expected \(4,\)"),
        (heads_fake(dtype=torch.bfloat16), AttentionInputTypeError, r"^alibi_slopes has dtype"),
        (heads_fake(device="cpu"), AttentionInputTypeError, r"^alibi_slopes is a torch tensor on"),
    ]:
        with pytest.raises(error, match=message):
            OPS.attention(q, k, v, False, None, False, None, -1, -1, 0.0, slopes, None, None)
    with pytest.raises(AttentionInputError, match=r"^window=\(-5, -1\): the left bound"):
        OPS.attention(q, k, v, False, None, False, None, -5, -1, 0.0, None, None, None)


def test_compile_fullgraph_carries_the_variants(fake_mode) -> None:
    backend = Captured()

    class Windowed(torch.nn.Module):
        def forward(self, q: Any, k: Any, v: Any, slopes: Any, sinks: Any) -> Any:
            return kernels.attention(
                q, k, v, True, window=(1024, 0), softcap=50.0, alibi_slopes=slopes, sinks=sinks,
                scale=0.0625,
            )

    q, k, v = fake(), fake(), fake()
    slopes, sinks = heads_fake(), heads_fake()
    torch.compile(Windowed(), fullgraph=True, backend=backend)(q, k, v, slopes, sinks)
    (node,) = [n for n in backend.graphs[0].graph.nodes if n.target == OPS.attention.default]
    assert node.args[3:10] == (True, None, False, None, 1024, 0, 50.0)
    placeholders = [n for n in backend.graphs[0].graph.nodes if n.op == "placeholder"]
    assert list(node.args[10:12]) == placeholders[3:5]  # the slopes and sinks inputs
    assert node.args[12] == 0.0625
    with pytest.raises(AttentionInputTypeError, match=r"^window must be a pair"):
        torch_op.traced_call(None, None, False, q, k, v, False, None, None, 1024)
    with pytest.raises(AttentionInputError, match=r"^softcap must be a finite number >= 0"):
        torch_op.traced_call(None, None, False, q, k, v, False, None, None, (-1, -1), -2.0)
    with pytest.raises(AttentionInputError, match=r"^scale must be a finite number > 0"):
        torch_op.traced_call(
            None, None, False, q, k, v, False, None, None, (-1, -1), 0.0, None, None, -1.0
        )
