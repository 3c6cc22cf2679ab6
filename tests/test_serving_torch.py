"""``BatchAttention.run``'s checks and its torch custom op on the CPU: torch's fake CUDA
tensors carry shape, dtype and device without a GPU, so every refusal ``run`` makes before a
launch, and the op's fake implementation, are exercised here."""

from __future__ import annotations

import re
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from kernels.serving import torch_op  # noqa: E402
from kernels.serving.checks import (  # noqa: E402
    Expected,
    ServingInputError,
    ServingInputTypeError,
    check_run,
)

OPS = torch.ops.flash_attention_tuner
EXPECTED = Expected(torch.bfloat16, 0, 5, 8, 2, 64, 16, 9)


def cuda(*shape: int, dtype: Any = torch.bfloat16) -> Any:
    return torch.empty(shape, dtype=dtype, device="cuda")


@pytest.fixture
def fake() -> Any:
    with FakeTensorMode() as mode:
        yield mode


def test_a_run_that_matches_the_plan_passes(fake) -> None:
    check_run(cuda(5, 8, 64), cuda(10, 16, 2, 64), cuda(10, 16, 2, 64), None, None, EXPECTED)
    check_run(
        cuda(5, 8, 64),
        cuda(12, 16, 2, 64),
        cuda(12, 16, 2, 64),
        cuda(5, 8, 64),
        cuda(5, 8, dtype=torch.float32),
        EXPECTED,
    )


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (
            lambda: (cuda(4, 8, 64),) + (cuda(10, 16, 2, 64),) * 2,
            ServingInputError,
            r"^q has shape \[4, 8, 64\]; expected \[5, 8, 64\]",
        ),
        (
            lambda: (cuda(5, 8, 64, dtype=torch.float16),) + (cuda(10, 16, 2, 64),) * 2,
            ServingInputTypeError,
            r"^q has dtype torch.float16; expected torch.bfloat16",
        ),
        (
            lambda: (cuda(5, 8, 64), cuda(10, 8, 2, 64), cuda(10, 8, 2, 64)),
            ServingInputError,
            r"^k_cache has shape \[10, 8, 2, 64\]; expected \[\*, 16, 2, 64\]",
        ),
        (
            lambda: (cuda(5, 8, 64), cuda(10, 16, 2, 64), cuda(11, 16, 2, 64)),
            ServingInputError,
            r"^v_cache has shape \[11, 16, 2, 64\]; expected k_cache's",
        ),
        (
            lambda: (cuda(5, 8, 64), cuda(9, 16, 2, 64), cuda(9, 16, 2, 64)),
            ServingInputError,
            r"^k_cache has 9 pages; the plan reads page 9",
        ),
        (
            lambda: (
                torch.empty(5, 8, 64, dtype=torch.bfloat16),
                cuda(10, 16, 2, 64),
                cuda(10, 16, 2, 64),
            ),
            ServingInputError,
            r"^q is on cpu",
        ),
        (
            lambda: (cuda(5, 64, 8).transpose(1, 2), cuda(10, 16, 2, 64), cuda(10, 16, 2, 64)),
            ServingInputError,
            r"^q is not contiguous",
        ),
        (
            lambda: ([1, 2], cuda(10, 16, 2, 64), cuda(10, 16, 2, 64)),
            ServingInputTypeError,
            r"^q is a builtins.list; expected a torch CUDA tensor",
        ),
    ],
)
def test_run_refuses_what_does_not_match_the_plan(fake, arguments, error, message) -> None:
    with pytest.raises(error, match=message):
        check_run(*arguments(), None, None, EXPECTED)


def test_out_and_lse_are_checked_too(fake) -> None:
    q, k = cuda(5, 8, 64), cuda(10, 16, 2, 64)
    with pytest.raises(ServingInputError, match=r"^out has shape \[5, 8, 32\]"):
        check_run(q, k, k, cuda(5, 8, 32), None, EXPECTED)
    with pytest.raises(ServingInputTypeError, match=r"^lse has dtype torch.bfloat16"):
        check_run(q, k, k, None, cuda(5, 8), EXPECTED)


def test_ragged_caches_are_rows() -> None:
    ragged = Expected(torch.bfloat16, 0, 5, 8, 2, 64, None, 99)
    with FakeTensorMode():
        check_run(cuda(5, 8, 64), cuda(100, 2, 64), cuda(100, 2, 64), None, None, ragged)
        with pytest.raises(ServingInputError, match=re.escape("k_cache has 99 rows")):
            check_run(cuda(5, 8, 64), cuda(99, 2, 64), cuda(99, 2, 64), None, None, ragged)


def test_the_op_is_registered_with_a_fake_implementation(fake) -> None:
    assert torch_op.serving_attention_into is not None
    q = cuda(5, 8, 64)
    assert (
        OPS.serving_attention_into(q, cuda(10, 16, 2, 64), cuda(10, 16, 2, 64), cuda(5, 8, 64), 3)
        is None
    )
    with pytest.raises(Exception, match="out has shape"):
        OPS.serving_attention_into(q, cuda(10, 16, 2, 64), cuda(10, 16, 2, 64), cuda(5, 8, 32), 3)
