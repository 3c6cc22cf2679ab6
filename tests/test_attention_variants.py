"""``kernels.attention`` with the variants, without a GPU: the argument checks (all before any
CUDA call), the problem the registry is asked for, handles per (shape, variants) and never per
slope, sink or scale value, and the per-call path writing the caller's slopes, sinks and scale.

The launch path runs on ``test_attention``'s fake GPU with ``tests/variant_family.py``'s toy
family on the variant ABI standing in for the float32 families (whose kernels do not take the
variants yet), its kernel emulated by the float64 reference on the values the launch passes.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest
from test_attention import (
    CountingRegistry,
    FakeArray,
    FakeTensor,
    ReachedCuda,
    fake_torch_module,
    torch_on_fake_gpu,
)
from test_attention import gpu as gpu  # noqa: PLC0414 - the fake GPU's fixture
from test_attention import registry as registry  # noqa: PLC0414
from test_pycuda_backend import KERNELS, FakeGpu
from variant_family import ENTRY, NAME, ToyVariants, emulated_attention, toy_variants_only

import kernels.deploy as ka
from kernels import attention_args
from kernels.attention_variants import VariantValues, alibi_slopes
from kernels.backends import attention_handle
from kernels.kv_buckets import bucket_of
from kernels.launch import launch_sequence
from kernels.reference import attention_reference
from tuner.errors import BackendError, TunerError
from tuner.planner.launches import DeviceBuffers, KernelLaunch, kernel_launch, scale_log2
from tuner.planner.plan import KernelPlan
from tuner.problem import Problem

HEADS = 4
SHAPE = (2, HEADS, 64, 32)


# ---------------------------------------------------------------------------- the checks


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def reached(*args: Any, **kwargs: Any) -> Any:
        raise ReachedCuda

    monkeypatch.setattr(ka, "interface_device", reached)
    monkeypatch.setattr(ka.Attention, "_runner", reached)


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    torch = fake_torch_module()
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


def qkv() -> list[FakeTensor]:
    return [FakeTensor(SHAPE, pointer=(1 << 40) + i * (1 << 30)) for i in range(3)]


def per_head(shape: tuple[int, ...] = (HEADS,), **fields: Any) -> FakeTensor:
    fields.setdefault("pointer", 1 << 45)
    return FakeTensor(shape, **fields)


BAD_VARIANTS = {
    "window-int": (
        {"window": 4096},
        ka.AttentionInputTypeError,
        r"^window must be a pair \(left, right\), got the single number 4096: pass "
        r"window=\(4096, -1\) for 4096 keys before each query",
    ),
    "window-triple": ({"window": (1, 2, 3)}, TypeError, r"^window must be a pair \(left, right"),
    "window-none": ({"window": None}, TypeError, r"^window must be a pair"),
    "window-float": ({"window": (4.0, -1)}, TypeError, r"the left bound must be an int"),
    "window-bool": ({"window": (True, -1)}, TypeError, r"the left bound must be an int"),
    "window-low": ({"window": (-2, 0)}, ka.AttentionInputError, r"left bound must be in 0\.\."),
    "window-high": ({"window": (0, 2**31)}, ka.AttentionInputError, r"right bound must be in"),
    "softcap-negative": ({"softcap": -1.0}, ka.AttentionInputError, r"^softcap must be a fini"),
    "softcap-nan": ({"softcap": float("nan")}, ka.AttentionInputError, r"^softcap must be"),
    "softcap-bool": ({"softcap": True}, TypeError, r"^softcap must be a number >= 0"),
    "softcap-text": ({"softcap": "50"}, TypeError, r"^softcap must be a number >= 0"),
    "scale-zero": ({"scale": 0.0}, ka.AttentionInputError, r"^scale must be a finite number > 0"),
    "scale-inf": ({"scale": float("inf")}, ka.AttentionInputError, r"^scale must be a finite"),
    "scale-text": ({"scale": "0.1"}, TypeError, r"^scale must be a number > 0 or None"),
    "slopes-dtype": (
        {"alibi_slopes": per_head(dtype="bfloat16")},
        TypeError,
        r"^alibi_slopes has dtype bfloat16; expected torch.float32 \(whatever q's dtype\)$",
    ),
    "slopes-shape": (
        {"alibi_slopes": per_head((2 * HEADS,))},
        ka.AttentionInputError,
        r"^alibi_slopes has shape \(8,\); expected \(4,\): one value per query head",
    ),
    "slopes-2d": (
        {"alibi_slopes": per_head((2, HEADS))},
        ka.AttentionInputError,
        r"^alibi_slopes has shape \(2, 4\); expected \(4,\)",
    ),
    "slopes-device": (
        {"alibi_slopes": per_head(index=1)},
        ka.AttentionInputError,
        r"^alibi_slopes is on cuda:1 but q is on cuda:0",
    ),
    "slopes-cpu": (
        {"alibi_slopes": per_head(device="cpu")},
        TypeError,
        r"^alibi_slopes is a torch tensor on .*; expected a float32 CUDA tensor of shape \(4,\)",
    ),
    "slopes-strided": (
        {"alibi_slopes": per_head(contiguous=False)},
        ka.AttentionInputError,
        r"^alibi_slopes is not contiguous",
    ),
    "slopes-grad": (
        {"alibi_slopes": per_head(requires_grad=True)},
        ka.AttentionInputError,
        r"^alibi_slopes requires grad",
    ),
    "slopes-list": (
        {"alibi_slopes": [0.5] * HEADS},
        TypeError,
        r"^alibi_slopes is a builtins.list; expected a float32 CUDA tensor of shape \(4,\)",
    ),
    "slopes-interface": (
        {"alibi_slopes": FakeArray((HEADS,))},
        TypeError,
        r"^alibi_slopes is a test_attention.FakeArray; expected a float32 CUDA tensor",
    ),
    "sinks-dtype": (
        {"sinks": per_head(dtype="float16")},
        TypeError,
        r"^sinks has dtype float16; expected torch.float32",
    ),
    "sinks-shape": (
        {"sinks": per_head((1,))},
        ka.AttentionInputError,
        r"^sinks has shape \(1,\); expected \(4,\)",
    ),
    "sinks-device": ({"sinks": per_head(index=2)}, ka.AttentionInputError, r"^sinks is on cuda:2"),
}


@pytest.mark.parametrize("case", sorted(BAD_VARIANTS))
def test_bad_variant_arguments_are_refused_before_any_cuda_call(
    case: str, fake_torch: Any, no_cuda: None
) -> None:
    arguments, error, message = BAD_VARIANTS[case]
    with pytest.raises(error, match=message) as raised:
        ka.attention(*qkv(), **arguments)
    assert isinstance(raised.value, TunerError) and isinstance(raised.value, ValueError)
    assert "\n" not in str(raised.value)


def test_good_variant_arguments_reach_the_gpu(fake_torch: Any, no_cuda: None) -> None:
    for arguments in (
        {"window": (4096, 0)},
        {"window": [128, 128]},
        {"window": (np.int64(7), -1), "softcap": np.float32(30.0)},
        {"softcap": 50, "scale": 0.125},
        {"scale": np.float64(0.3)},
        {"alibi_slopes": per_head(), "sinks": per_head(pointer=1 << 46)},
    ):
        with pytest.raises(ReachedCuda):
            ka.attention(*qkv(), True, **arguments)


def test_out_may_not_overlap_the_slopes(fake_torch: Any, no_cuda: None) -> None:
    q, k, v = qkv()
    out = FakeTensor(SHAPE, pointer=1 << 44)
    with pytest.raises(ka.AttentionInputError, match=r"^out overlaps sinks in memory"):
        ka.attention(q, k, v, out=out, sinks=per_head(pointer=(1 << 44) + 64))


def test_interface_arrays_take_interface_slopes_and_sinks(no_cuda: None) -> None:
    arrays = [FakeArray(SHAPE) for _ in range(3)]
    with pytest.raises(ReachedCuda):
        ka.attention(*arrays, alibi_slopes=FakeArray((HEADS,)), sinks=FakeArray((HEADS,)))
    for bad, message in [
        (FakeArray((HEADS,), typestr="<f2"), r"^sinks has typestr '<f2'; expected '<f4'"),
        (FakeArray((HEADS + 1,)), r"^sinks has shape \(5,\); expected \(4,\)"),
        (FakeArray((HEADS,), strides=(8,)), r"^sinks is not contiguous"),
        (FakeArray((HEADS,), pointer=0), r"^sinks has a null data pointer"),
        (np.zeros(HEADS, np.float32), r"^sinks is a numpy.ndarray; expected a float32 device"),
    ]:
        with pytest.raises(ka.AttentionInputError, match=message):
            ka.attention(*arrays, sinks=bad)


def test_the_problem_has_the_variants_never_their_values() -> None:
    inputs = attention_args.check_inputs(*[FakeArray(SHAPE) for _ in range(3)])
    from kernels.variant_args import check_variants

    given = check_variants(
        inputs, (16, -1), 30.0, FakeArray((HEADS,)), FakeArray((HEADS,)), scale=0.2
    )
    problem = attention_args.problem_of(inputs, True, "tf32x3", given)
    assert problem == Problem(
        64, 32, batch=2, heads=HEADS, causal=True, window_left=16, softcap=30.0, alibi=True,
        sinks=True,
    )
    assert given.scale_log2 == pytest.approx(0.2 / np.log(2))
    plain = Problem(64, 32, batch=2, heads=HEADS, causal=True)
    assert attention_args.problem_of(inputs, True) == plain


# ---------------------------------------------------------------------------- on the fake GPU


PROBLEM_SHAPE = (2, 6, 40, 16)  # batch 2, 6 query heads on 3 KV heads, 40 queries, 56 keys
KV_SHAPE = (2, 3, 56, 16)


@pytest.fixture
def toy(gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(KERNELS, ENTRY, emulated_attention)
    monkeypatch.setitem(sys.modules, "torch", torch_on_fake_gpu(gpu))
    with toy_variants_only() as family:
        yield family


def device_tensor(gpu: FakeGpu, values: np.ndarray) -> FakeTensor:
    stored = np.ascontiguousarray(values, dtype=np.float32)
    return FakeTensor(stored.shape, pointer=int(gpu.driver.to_device(stored)))


def inputs_on(gpu: FakeGpu, seed: int = 0):
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(s).astype(np.float32) for s in (PROBLEM_SHAPE, KV_SHAPE, KV_SHAPE)]
    return host, [device_tensor(gpu, array) for array in host]


def expected(host, causal: bool, **values: Any) -> np.ndarray:
    q, k, v = (a.reshape(-1, *a.shape[2:]) for a in host)
    return attention_reference(q, k, v, causal, 2, VariantValues(**values)).reshape(PROBLEM_SHAPE)


def result(gpu: FakeGpu, out: FakeTensor) -> np.ndarray:
    return gpu.floats(out.data_ptr(), int(np.prod(PROBLEM_SHAPE))).reshape(PROBLEM_SHAPE)


def test_every_variant_runs_with_the_callers_values(toy: Any, gpu: FakeGpu, registry) -> None:
    host, (q, k, v) = inputs_on(gpu)
    slopes, sinks = alibi_slopes(6), np.array([0.5, 3.0, -1.0, 2.0, 6.0, 0.0])
    asked: list[Problem] = []

    class Asked(CountingRegistry):
        def cached_best(self, problem: Problem, *args: Any, **kwargs: Any) -> Any:
            asked.append(problem)
            return super().cached_best(problem, *args, **kwargs)

    attend = ka.Attention(Asked(registry))
    out = attend(
        q, k, v, True, window=(9, 0), softcap=4.0, alibi_slopes=device_tensor(gpu, slopes),
        sinks=device_tensor(gpu, sinks), scale=0.3,
    )
    want = expected(
        host, True, window_left=9, softcap=4.0, alibi_slopes=slopes.astype(np.float32),
        sinks=sinks, scale=0.3,
    )
    np.testing.assert_allclose(result(gpu, out), want, atol=1e-5)
    (problem,) = attend._runners[0]._handles
    # The registry was asked for this problem's KV bucket only (56 keys: the bucket of 64)
    assert set(asked) == {bucket_of(problem)} and bucket_of(problem).kv_len == 64
    assert problem == Problem(
        40, 16, batch=2, heads=6, kv_heads=3, kv_len=56, causal=True, window_left=9,
        softcap=4.0, alibi=True, sinks=True,
    )
    assert attend.plan_for(problem).plan.family == NAME


def test_the_fast_path_writes_each_calls_slopes_sinks_and_scale(
    toy: Any, gpu: FakeGpu, registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, (q, k, v) = inputs_on(gpu, seed=1)
    counting = CountingRegistry(registry)
    attend = ka.Attention(counting)
    checked: list[int] = []
    check = ka.check_inputs
    monkeypatch.setattr(ka, "check_inputs", lambda *a: checked.append(1) or check(*a))
    calls = [
        (np.full(6, 2.0), None),
        (np.linspace(-2, 5, 6), 0.5),
        (np.full(6, -30.0), 0.05),  # sinks too small to matter
        (np.full(6, 40.0), None),  # sinks that take every row's weight
    ]
    for sink_values, scale in calls:
        sinks = device_tensor(gpu, sink_values)
        out = attend(q, k, v, False, window=(12, 3), sinks=sinks, scale=scale)
        want = expected(
            host, False, window_left=12, window_right=3, sinks=sink_values, scale=scale
        )
        np.testing.assert_allclose(result(gpu, out), want, atol=1e-5)
    assert np.abs(result(gpu, out)).max() < 1e-12  # the last call's dominating sinks
    assert checked == [1]  # one checked call; the others took the fast path
    # per problem: this GPU, its model, any GPU (kernels.plan_choice), once
    assert len(attend._runners[0]._handles) == 1 and counting.calls == 3
    # Another window or softcap is another problem: its own handle, its own registry lookup.
    attend(q, k, v, False, window=(12, 4), sinks=sinks)
    attend(q, k, v, False, window=(12, 3), softcap=20.0, sinks=sinks)
    attend(q, k, v, False, window=(12, 3))  # no sinks: another problem too
    assert len(attend._runners[0]._handles) == 4 and counting.calls == 12
    assert len(checked) == 4


def test_a_window_that_cuts_nothing_and_causal_bounds_share_a_handle(
    toy: Any, gpu: FakeGpu, registry
) -> None:
    _, (q, k, v) = inputs_on(gpu)
    attend = ka.Attention(registry)
    for window in ((-1, -1), (100, -1), (-1, 100), (80, 80)):  # 56 keys: nothing cut
        attend(q, k, v, False, window=window)
    for window in ((9, -1), (9, 0), (9, 40)):  # causal: the right bound is the diagonal
        attend(q, k, v, True, window=window)
    handles = attend._runners[0]._handles
    assert len(handles) == 2
    assert {p.window_left for p in handles} == {-1, 9} and {p.window_right for p in handles} == {-1}


def test_interface_arrays_run_with_slopes_and_sinks(toy: Any, gpu: FakeGpu, registry) -> None:
    host, tensors = inputs_on(gpu, seed=2)
    arrays = [FakeArray(t.shape, pointer=t.pointer) for t in tensors]
    out_at = int(gpu.driver.mem_alloc(4 * int(np.prod(PROBLEM_SHAPE))))
    out = FakeArray(PROBLEM_SHAPE, pointer=out_at)
    slopes = alibi_slopes(6)
    sinks = np.linspace(-1, 4, 6)
    on_device = [
        FakeArray((6,), pointer=device_tensor(gpu, values).pointer) for values in (slopes, sinks)
    ]
    ka.Attention(registry)(
        *arrays, False, out=out, alibi_slopes=on_device[0], sinks=on_device[1], scale=0.2
    )
    pointer = out.__cuda_array_interface__["data"][0]
    got = gpu.floats(pointer, int(np.prod(PROBLEM_SHAPE))).reshape(PROBLEM_SHAPE)
    want = expected(
        host, False, alibi_slopes=slopes.astype(np.float32), sinks=sinks, scale=0.2
    )
    np.testing.assert_allclose(got, want, atol=1e-5)


# ---------------------------------------------------------------------------- the handle


def test_the_handle_packs_every_role_and_writes_the_call_values() -> None:
    """A launch on the variant ABI with a merge that takes the sinks and the LSE: each pointer
    named by its role, the scale found by value, each call's values what the driver reads."""
    from test_attention_handle import Recording

    problem = Problem(300, 64, heads=8, kv_heads=2, causal=True, window_left=100, alibi=True,
                      sinks=True, softcap=30.0)
    default = np.float32(scale_log2(64))
    markers = attention_handle.BUFFER_MARKERS
    attention = KernelLaunch(
        "attention", (5, 2, 8), (128, 1, 1), 0,
        tuple(np.uintp(getattr(markers, role)) for role in attention_handle.ROLES[:6])
        + (np.int32(300), np.int32(300), np.int32(4), np.int32(160), default, np.int32(8),
           np.int32(100), np.int32(-1), np.float32(30.0), np.uintp(markers.alibi_slopes),
           np.uintp(markers.sinks), np.uintp(0)),
    )
    merge = KernelLaunch(
        "merge", (19, 1, 1), (128, 1, 1), 0,
        (np.uintp(markers.partial_o), np.uintp(markers.partial_ml), np.uintp(markers.out),
         np.int32(300), np.int32(2), np.int32(8 * 300), np.int32(8), np.uintp(markers.sinks),
         np.uintp(markers.lse)),
    )
    templates = attention_handle.launch_templates((attention, merge), {"attention": 1, "merge": 2},
                                                  float(default))
    roles = [[a for a in t.arguments if isinstance(a, str)] for t in templates]
    assert roles[0] == [*attention_handle.ROLES[:6], "scale_log2", "alibi_slopes", "sinks"]
    assert roles[1] == ["partial_o", "partial_ml", "out", "sinks", "lse"]
    assert templates[0].arguments[-1] == np.uintp(0)  # a null pointer stays a constant
    assert templates[0].arguments[14] == np.float32(30.0)  # the softcap is not the scale

    plan = types.SimpleNamespace(key=lambda: "toy/plan")
    driver = Recording()
    handle = attention_handle.AttentionHandle(
        problem, 0, types.SimpleNamespace(plan=plan), templates,
        types.SimpleNamespace(tensor_bytes=1, partial_o=1, partial_o_bytes=4, partial_ml_bytes=4),
        driver, None,
    )
    assert handle.takes_scale and handle.default_scale_log2 == pytest.approx(float(default))
    scratch = iter([7000, 9000])
    slot = handle.slot(3, lambda nbytes: (None, next(scratch)))
    handle.launch(slot, 11, 12, 13, 14, 15, 16, 0.5)
    handle.launch(slot, 21, 22, 23, 24, 25, 26)
    first, second = (launch.values() for launch, _ in driver.launched[0:2])
    pointers = [int(first[i]) for i in (0, 1, 2, 3, 4, 5, 15, 16)]
    assert pointers == [11, 12, 13, 14, 7000, 9000, 15, 16]
    assert first[10] == np.float32(0.5)  # the call's scale
    # merge: partial_o, partial_ml, out, then the sinks and a null LSE (none asked for)
    assert [int(second[i]) for i in (0, 1, 2, 7, 8)] == [7000, 9000, 14, 16, 0]
    third, fourth = (launch.values() for launch, _ in driver.launched[2:4])
    assert [int(third[i]) for i in (0, 3, 15, 16)] == [21, 24, 25, 26]
    assert third[10] == default  # no scale: the default again, not the last call's
    assert [int(fourth[i]) for i in (2, 7, 8)] == [24, 26, 0]  # merge: out, sinks, no LSE


class WithoutVariants(ToyVariants):
    """The toy with the old ABI's arguments only: no scale, slopes or sinks."""

    name = "toy_without_variants"

    def launches(self, plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
        (attention,) = super().launches(plan, buffers)
        return (kernel_launch(plan.launch, ENTRY, attention.args[:10]),)


def test_a_plan_without_the_variant_arguments_is_refused_not_run_wrong() -> None:
    from tuner.device import H200
    from tuner.planner import families
    from tuner.planner.params import KernelParams
    from tuner.planner.tunable import plan_kernel

    family = families.register(WithoutVariants())
    try:
        for problem, role in [
            (Problem(64, 32, heads=4, alibi=True), "alibi_slopes"),
            (Problem(64, 32, heads=4, sinks=True), "sinks"),
        ]:
            plan = plan_kernel(problem, KernelParams(family.name), H200)
            launches = launch_sequence(plan, attention_handle.BUFFER_MARKERS)
            templates = attention_handle.launch_templates(
                launches, {ENTRY: 1}, scale_log2(problem.head_dim)
            )
            with pytest.raises(BackendError, match=rf"its launches take no {role} pointer"):
                attention_handle.AttentionHandle(
                    problem, 0, types.SimpleNamespace(plan=plan), templates,
                    types.SimpleNamespace(tensor_bytes=1, partial_o=0), None, None,
                )
        plain = Problem(64, 32, heads=4)
        plan = plan_kernel(plain, KernelParams(family.name), H200)
        launches = launch_sequence(plan, attention_handle.BUFFER_MARKERS)
        templates = attention_handle.launch_templates(launches, {ENTRY: 1}, scale_log2(32))
        handle = attention_handle.AttentionHandle(
            plain, 0, types.SimpleNamespace(plan=plan), templates,
            types.SimpleNamespace(tensor_bytes=1, partial_o=0), None, None,
        )
        assert not handle.takes_scale
        with pytest.raises(BackendError, match=r"takes no scale argument"):
            handle.launch(types.SimpleNamespace(), 1, 2, 3, 4, scale_log2=0.5)
    finally:
        families.unregister(family.name)
