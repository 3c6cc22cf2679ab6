"""``kernels.transformers_attention`` with transformers on the CPU (no kernels run here).

Registration, the mask function's decisions against transformers' own SDPA masks, the window
mapping against transformers' sliding-window mask, the arguments real transformers layers
pass (Llama, Gemma 2, gpt-oss) as ``kernels.attention`` takes them, and whole models whose
every call falls back (CPU tensors, padding) giving exactly transformers' own outputs. The
kernels' side of a call runs in ``tests/test_gpu_transformers.py``. Skipped without
transformers (``pip install '.[transformers]'``).
"""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AttentionInterface,
    AutoModelForCausalLM,
    Gemma2Config,
    GptOssConfig,
    LlamaConfig,
)
from transformers.masking_utils import (  # noqa: E402
    ALL_MASK_ATTENTION_FUNCTIONS,
    bidirectional_mask_function,
    causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

import kernels.transformers_attention as tuned  # noqa: E402
from kernels.variant_args import NO_WINDOW  # noqa: E402
from tuner.errors import TunerError  # noqa: E402

SMALL = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
)
CONFIGS = {
    "llama": (LlamaConfig(**SMALL), "sdpa"),
    "gemma2": (
        Gemma2Config(**SMALL, sliding_window=8, query_pre_attn_scalar=48,
                     attn_logit_softcapping=5.0),
        "eager",
    ),
    "gpt_oss": (
        GptOssConfig(**SMALL | {"intermediate_size": 128}, sliding_window=8,
                     num_local_experts=4, num_experts_per_tok=2),
        "eager",
    ),
}


@pytest.fixture(scope="module")
def name() -> str:
    return tuned.register()


def test_register_puts_the_attention_and_its_mask_under_one_name(name: str) -> None:
    assert name == tuned.ATTENTION_NAME == "tuned_attention"
    assert isinstance(AttentionInterface()[name], tuned.TransformersAttention)
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is tuned.unmasked_when_expressible
    assert tuned.transformers_version() >= tuned.OLDEST_TRANSFORMERS


@pytest.mark.parametrize("taken", ["flash_attention_tuner", "kernels-community/x", "sdpa"])
def test_names_transformers_takes_are_refused_in_one_line(taken: str) -> None:
    with pytest.raises(tuned.IntegrationError, match=r"^attention name .* is taken") as error:
        tuned.register(taken)
    assert isinstance(error.value, TunerError) and "\n" not in str(error.value)


# ---------------------------------------------------------------------- the mask


def sdpa_materialised(**arguments: Any) -> torch.Tensor:
    return sdpa_mask(allow_is_causal_skip=False, **arguments)


MASK_CASES = {
    # (arguments, whether the attention function's own arguments say the whole mask)
    "prefill": (dict(q_length=8, kv_length=8), True),
    "prefill, all-ones mask": (dict(q_length=8, kv_length=8, pad=0), True),
    "decode against a cache": (dict(q_length=1, kv_length=9, q_offset=8), True),
    "chunk against a cache": (dict(q_length=4, kv_length=12, q_offset=8), True),
    "left padding": (dict(q_length=8, kv_length=8, pad=3), False),
    "a static cache's empty slots": (dict(q_length=8, kv_length=32), False),
    "decode in a static cache": (dict(q_length=1, kv_length=32, q_offset=8), False),
    "sliding-window cache": (
        dict(q_length=1, kv_length=8, q_offset=20, kv_offset=13, local_size=8), True
    ),
    "a custom mask function": (dict(q_length=8, kv_length=8, allow_is_causal_skip=False), False),
}


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_the_mask_is_none_exactly_where_the_arguments_say_it_all(case: str) -> None:
    arguments, expressible = MASK_CASES[case]
    arguments = dict(arguments)
    pad = arguments.pop("pad", None)
    allow = arguments.pop("allow_is_causal_skip", True)
    total = arguments.get("kv_offset", 0) + arguments["kv_length"]
    attention_mask = None
    if pad is not None:
        attention_mask = torch.ones(2, total, dtype=torch.bool)
        attention_mask[0, :pad] = False
    common = dict(batch_size=2, attention_mask=attention_mask, **arguments)
    if "local_size" in arguments:
        common["mask_function"] = sliding_window_causal_mask_function(arguments["local_size"])
    else:
        common["mask_function"] = causal_mask_function
    found = tuned.unmasked_when_expressible(allow_is_causal_skip=allow, **common)
    if expressible:
        assert found is None
        # and what the arguments say is what transformers' mask says
        q, kv = arguments["q_length"], arguments["kv_length"]
        window = arguments.get("local_size", 0) - 1
        said = tuned.visible_mask(q, kv, True, window, torch.device("cpu"))
        assert torch.equal(said[0, 0], sdpa_materialised(**common)[0, 0])
    else:
        assert torch.equal(found, sdpa_materialised(**common))


def test_a_bidirectional_mask_is_none_without_padding_or_window() -> None:
    full = dict(batch_size=1, q_length=6, kv_length=6, mask_function=bidirectional_mask_function)
    assert tuned.unmasked_when_expressible(
        allow_is_causal_skip=False, allow_is_bidirectional_skip=True, **full
    ) is None
    windowed = tuned.unmasked_when_expressible(
        allow_is_causal_skip=False, allow_is_bidirectional_skip=True, local_size=2, **full
    )
    assert windowed is not None


@pytest.mark.parametrize(("q_length", "kv_length", "window"), [(7, 7, 3), (1, 40, 8), (5, 30, 16)])
def test_a_window_of_w_minus_one_is_transformers_sliding_window_of_w(
    q_length: int, kv_length: int, window: int
) -> None:
    ours = tuned.visible_mask(q_length, kv_length, True, window - 1, torch.device("cpu"))
    theirs = sdpa_materialised(
        batch_size=1, q_length=q_length, kv_length=kv_length, q_offset=kv_length - q_length,
        mask_function=sliding_window_causal_mask_function(window),
    )
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------- real layers


def build(config: Any, attention: str, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=attention, dtype=torch.float32
    )
    assert model.config._attn_implementation == attention
    return model.eval()


class Recording:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def __call__(self, module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any):
        self.calls.append((module, kwargs))
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, mask, **kwargs)


@pytest.mark.parametrize("architecture", list(CONFIGS))
def test_each_layers_arguments_reach_the_kernels_as_they_take_them(architecture: str) -> None:
    config, _ = CONFIGS[architecture]
    recording = Recording()
    AttentionInterface.register("recording", recording)
    transformers.masking_utils.AttentionMaskInterface.register(
        "recording", ALL_MASK_ATTENTION_FUNCTIONS["eager"]
    )
    model = build(config, "recording")
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 12)))
    assert len(recording.calls) == config.num_hidden_layers
    for module, kwargs in recording.calls:
        layer = tuned.layer_arguments(
            module, kwargs.get("is_causal"), kwargs.get("sliding_window"),
            kwargs.get("softcap"), kwargs.get("scaling"),
        )
        sliding = getattr(module, "sliding_window", None)
        assert layer.causal and layer.scale == pytest.approx(module.scaling)
        assert layer.window == (NO_WINDOW if not sliding else (sliding - 1, -1))
        assert layer.softcap == (getattr(module, "attn_logit_softcapping", None) or 0.0)
        if architecture == "gpt_oss":
            assert kwargs["s_aux"] is module.sinks  # one logit per query head
    windows = {tuned.layer_arguments(m, None, k.get("sliding_window"), None, None).window
               for m, k in recording.calls}
    assert len(windows) == (2 if architecture != "llama" else 1)  # sliding and full layers


def test_sinks_are_copied_to_float32_once_per_change(name: str) -> None:
    attention = tuned.TransformersAttention()
    sinks = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    first = attention._float_sinks(sinks)
    assert first.dtype == torch.float32 and torch.equal(first, sinks.float())
    assert attention._float_sinks(sinks) is first
    with torch.no_grad():
        sinks.add_(1)
    again = attention._float_sinks(sinks)
    assert again is not first and torch.equal(again, sinks.float())


# ---------------------------------------------------------------------- whole models


@pytest.mark.parametrize("architecture", list(CONFIGS))
def test_a_model_whose_calls_fall_back_gives_transformers_own_outputs(
    name: str, architecture: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On the CPU every call falls back (to SDPA, or to the model's eager attention where
    the layer has a softcap or sinks), with the causal and window mask the kernels would
    apply built from the call's arguments: the outputs are transformers' own, left-padded
    batches (a mask the kernels' arguments cannot say) included."""
    config, peer = CONFIGS[architecture]
    assert tuned.register() == name  # a fresh instance: it logs each reason once
    ours, theirs = build(config, name), build(config, peer)
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    padded = torch.ones_like(ids)
    padded[0, :5] = 0
    with caplog.at_level(logging.WARNING, logger="kernels.transformers"), torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
        for mask in (torch.ones_like(ids), padded):
            settings = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert torch.equal(ours.generate(ids, **settings), theirs.generate(ids, **settings))
    reasons = {r.getMessage() for r in caplog.records if r.name == "kernels.transformers"}
    assert any("tensors on cpu, not a CUDA GPU" in reason for reason in reasons)


def test_the_benchmarks_parity_pipeline_runs_on_the_fallback(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/transformers_bench.py's parity steps on a tiny Llama on the CPU: every call falls
    back to SDPA, so ours and the peer err alike and both rules hold."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import transformers_bench as bench

    monkeypatch.setattr(bench, "PROMPT", 24)
    monkeypatch.setattr(bench, "NEW_TOKENS", 4)
    monkeypatch.setitem(bench.ARCHITECTURES, "llama", ("LlamaConfig", SMALL))
    models = bench.build("llama", [bench.NAME, "sdpa"], device="cpu")
    ids = bench.prompt_ids(SMALL["vocab_size"], bench.PROMPT, device="cpu")
    forward = bench.forward_parity(models, "sdpa", ids)
    assert forward.ok and forward.ours == forward.peer
    decoded, sequences, agreement = bench.generate_parity(models, "sdpa", ids)
    assert decoded.ok and sequences.shape == (bench.BATCH, 28) and agreement == 1.0
    problems = bench.posed_problems("gemma2")
    assert {p.kv_len for p in problems if p.seq_len == 1 and p.window_left >= 0} == set()
