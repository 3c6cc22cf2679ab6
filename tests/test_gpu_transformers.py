"""transformers models on the project's attention, on a real GPU: the real client of issue 27.

The two architectures of ``bench/transformers_bench.py`` (a Llama-style model and a
Gemma-2-style one with a sliding window on every other layer, a logit softcap and a softmax
scale of its own; 16 query heads on 4 KV heads, head_dim 128, bfloat16, seeded random weights,
built from config), with ``kernels.transformers_attention`` registered:

* every layer's attention, at a 512-token prefill and at decode steps against the cache, passes
  the project's parity rule on the very tensors transformers hands it: ``max|ours - ref| <=
  2 max|peer - ref| + 2**-8`` with ``ref`` a float64 attention computed from the layer's own
  attributes (``scaling``, ``sliding_window``, ``attn_logit_softcapping``), ``peer``
  transformers' output for that call (SDPA; eager for Gemma 2);
* one forward pass's logits and a greedy ``generate()`` of 64 tokens (batch 2) follow the
  float32 model within ``logits_bound`` (the rule lifted to the logits), every call on the
  kernels (no fallback logged), the decode steps' 64 new KV lengths served by one plan per KV
  bucket.

Run with the cubins of ``python bench/transformers_bench.py --precompile DIR`` in
``FLASH_ATTENTION_TUNER_CUBIN_CACHE=DIR`` to spend no device time compiling.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

BENCH = Path(__file__).resolve().parent.parent / "bench"
#: the name the recording peer is registered under
RECORDED = "recorded_peer"
#: forward passes recorded: the prefill, then decode steps
RECORDED_PASSES = 3


@pytest.fixture(scope="module")
def bench() -> Any:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("pycuda.driver")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device answers torch")
    sys.path.insert(0, str(BENCH))
    import transformers_bench

    import kernels.transformers_attention as tuned

    tuned.register(transformers_bench.NAME, nearest=True)
    return transformers_bench


class Recorder:
    """An attention implementation that records each call and answers with the peer's."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.calls: list[tuple[Any, Any, Any, Any, dict[str, Any], Any]] = []

    def __call__(self, module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.peer == "sdpa":
            function = sdpa_attention_forward
        else:
            function = sys.modules[type(module).__module__].eager_attention_forward
        out, weights = function(module, query, key, value, mask, **kwargs)
        self.calls.append((module, query.clone(), key.clone(), value.clone(), kwargs, out.clone()))
        return out, weights


def register_recorder(peer: str) -> Recorder:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    recorder = Recorder(peer)
    AttentionInterface.register(RECORDED, recorder)
    AttentionMaskInterface.register(RECORDED, ALL_MASK_ATTENTION_FUNCTIONS[peer])
    return recorder


def float64_attention(module: Any, query: Any, key: Any, value: Any) -> Any:
    """The layer's attention in float64 from its own attributes (not from the call's
    arguments): bottom-right causal, its sliding window, softcap and scale; GQA by
    repeating the KV heads. ``[batch, q_len, heads, head_dim]`` like transformers' outputs."""
    import torch

    group = query.shape[1] // key.shape[1]
    q = query.double()
    k = key.double().repeat_interleave(group, 1)
    v = value.double().repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * module.scaling
    cap = getattr(module, "attn_logit_softcapping", None)
    if cap:
        scores = cap * torch.tanh(scores / cap)
    n, m = scores.shape[-2:]
    diagonal = torch.arange(n, device=q.device)[:, None] + (m - n)
    keys = torch.arange(m, device=q.device)[None, :]
    visible = keys <= diagonal
    window = getattr(module, "sliding_window", None)
    if window:
        visible &= keys > diagonal - window
    scores = scores.masked_fill(~visible, -math.inf)
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


def chosen_plans() -> dict[Any, Any]:
    """The plans the project's attention (registry None, nearest) has chosen, by problem."""
    from kernels.deploy import default_instance

    runners = default_instance(None, nearest=True)._runners
    return dict(runners[0].chooser._plans) if runners else {}


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def architecture(request: pytest.FixtureRequest, bench: Any) -> Any:
    """The architecture's models (ours, the peer, the recording peer, the float32 reference),
    its peer's name and the plans chosen before it was built."""
    import torch

    import kernels.transformers_attention as tuned

    name = request.param
    peer = bench.PEERS[name]
    tuned.register(bench.NAME, nearest=True)  # a fresh instance: it logs each fallback anew
    recorder = register_recorder(peer)
    models = bench.build(name, [bench.NAME, peer, RECORDED])
    models[RECORDED].recorder = recorder
    yield name, models, peer, set(chosen_plans())
    del models
    torch.cuda.empty_cache()


def test_every_layers_attention_passes_the_parity_rule(
    bench: Any, architecture: tuple[str, dict[str, Any], str, set[Any]]
) -> None:
    """Prefill and decode calls as transformers makes them, through the registered function."""
    import torch

    from kernels.transformers_attention import TransformersAttention

    name, models, _, _ = architecture
    recorded = models[RECORDED]
    recorder = recorded.recorder
    recorder.calls.clear()
    vocab = recorded.config.vocab_size
    ids = bench.prompt_ids(vocab, bench.PROMPT + RECORDED_PASSES)
    bench.decode_logits(recorded, ids, bench.PROMPT)  # the prefill, then the decode steps
    assert len(recorder.calls) == recorded.config.num_hidden_layers * RECORDED_PASSES
    ours = TransformersAttention()
    failures, worst = [], 0.0
    with torch.no_grad():
        for index, (module, q, k, v, kwargs, theirs) in enumerate(recorder.calls):
            out, _ = ours(module, q, k, v, None, **kwargs)
            reference = float64_attention(module, q, k, v)
            error = float((out.double() - reference).abs().max())
            peer_error = float((theirs.double() - reference).abs().max())
            bound = 2 * peer_error + bench.BF16_FLOOR
            worst = max(worst, error / bound)
            if not error <= bound:
                failures.append(
                    f"call {index} (layer {module.layer_idx}, q_len {q.shape[2]}, kv_len "
                    f"{k.shape[2]}, window {getattr(module, 'sliding_window', None)}): "
                    f"max |ours - ref| {error:.3g} > {bound:.3g} (peer {peer_error:.3g})"
                )
    assert not failures, f"{name}: " + "; ".join(failures)
    print(f"{name}: {len(recorder.calls)} attention calls, worst error / bound {worst:.3f}")


def test_logits_and_a_greedy_generate_follow_the_float32_model(
    bench: Any,
    architecture: tuple[str, dict[str, Any], str, set[Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kernels.deploy import default_instance

    name, models, peer, before = architecture
    vocab = models[bench.NAME].config.vocab_size
    ids = bench.prompt_ids(vocab, bench.PROMPT)
    with caplog.at_level(logging.WARNING, logger="kernels.transformers"):
        forward = bench.forward_parity(models, peer, ids)
        decoded, sequences, agreement = bench.generate_parity(models, peer, ids)
    assert forward.ok, f"{name}: forward logits {forward.as_dict()}"
    assert decoded.ok, f"{name}: generate logits {decoded.as_dict()}"
    assert sequences.shape == (bench.BATCH, bench.PROMPT + bench.NEW_TOKENS)
    fallbacks = [r.getMessage() for r in caplog.records if r.name == "kernels.transformers"]
    assert not fallbacks, f"{name}: calls fell back: {fallbacks}"
    # 64 decode steps, each at a KV length never seen: a handle per length, but plans chosen
    # per KV bucket only (one for the global layers' 513..576 keys, one for the sliding ones').
    chosen = set(chosen_plans()) - before
    decode = sorted((p for p in chosen if p.seq_len == 1), key=lambda p: p.label())
    assert all(problem.kv_len & (problem.kv_len - 1) == 0 for problem in decode), decode
    kinds = 1 + bool(getattr(models[bench.NAME].config, "sliding_window", None))
    assert len(decode) <= kinds, [problem.label() for problem in decode]
    handles = default_instance(None, nearest=True)._runners[0]._handles
    lengths = {problem.kv_len for problem in handles if problem.seq_len == 1}
    assert lengths >= set(range(bench.PROMPT + 1, bench.PROMPT + bench.NEW_TOKENS))
    print(
        f"{name}: forward {forward.as_dict()}, generate {decoded.as_dict()}, tokens as the "
        f"peer's own generate: {agreement:.2%}"
    )
