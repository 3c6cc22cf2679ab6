"""transformers models on the project's attention against torch SDPA (and eager), one process.

    python bench/transformers_bench.py --out $OUT/transformers_bench.json
    python bench/transformers_bench.py --out x.json --registry sqlite:////srv/plans.sqlite
    python bench/transformers_bench.py --precompile .cache/transformers-cubins   # no GPU

Two architectures built from config with seeded random weights (no hub download; four
layers, 16 query heads on 4 KV heads, head_dim 128, bfloat16; ``ARCHITECTURES``): a
Llama-style model and a Gemma-2-style one (sliding window of 128 keys on every other layer,
logit softcap, a softmax scale of ``query_pre_attn_scalar**-0.5`` other than
``1/sqrt(head_dim)``). For each, with the project's attention registered
(``kernels.transformers_attention``) and the peers transformers ships:

* logits of one forward pass (batch 2, 512-token prompt) against a float32 eager model of the
  same weights, next to the peer's (SDPA for Llama; eager for Gemma 2, whose softcap SDPA
  cannot express): ``max|ours - ref| <= 2 max|peer - ref| + 2**-8 max|ref|``
  (``logits_bound``, the attention parity rule lifted to the model);
* a greedy ``generate()`` of 64 tokens, its per-step logits against the same rule (the peer
  decoding the same tokens step by step against its own cache, the reference one float32
  forward over them);
* time: per implementation, a warm-up generate (16-token prompt, 8 tokens), then three
  passes of the 512-token prompt and 64 tokens; the first meets every KV length for the first
  time, the next two know them. Per step (a synchronising stopping criterion notes each
  token's time): the prefill (step 0) and the decode steps 1..63; per token, the decode mean
  and median. ``new_vs_known``: the first pass's decode per token over the third's.

``--registry URL``: plans from that registry (``nearest`` on); without it, no registry (the
planner's default plans, what a deployment with no tuning runs). The JSON says which, and for
every problem the model posed, the plan served and its origin.

``--precompile DIR`` (no GPU): resolves, on the H200's profile, the plans the runs above will
choose (the same chooser, in the same order) and compiles their kernels into DIR, a cubin
cache to carry to the device (``FLASH_ATTENTION_TUNER_CUBIN_CACHE=DIR``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.kv_buckets import bucket_of  # noqa: E402
from tuner.problem import Problem  # noqa: E402

BATCH, PROMPT, NEW_TOKENS = 2, 512, 64
WARM_UP_PROMPT, WARM_UP_TOKENS = 16, 8
SEED = 0
#: the project's attention is registered under this name here
NAME = "tuned_attention"

#: model configurations: four layers of 16 query heads on 4 KV heads, head_dim 128
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        dict(
            vocab_size=4096, hidden_size=2048, intermediate_size=4096, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=4, head_dim=128,
            max_position_embeddings=4096, initializer_range=0.02,
        ),
    ),
    # Larger initial weights than the default 0.02: attention logits of tens, so the softcap
    # of 20 changes the logits by several times the bfloat16 noise (at 0.02 it would not).
    "gemma2": (
        "Gemma2Config",
        dict(
            vocab_size=4096, hidden_size=2048, intermediate_size=4096, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=4, head_dim=128, sliding_window=128,
            query_pre_attn_scalar=144, attn_logit_softcapping=20.0,
            final_logit_softcapping=30.0, max_position_embeddings=4096, initializer_range=0.06,
        ),
    ),
}
#: transformers' own implementation each architecture's outputs are compared with
PEERS = {"llama": "sdpa", "gemma2": "eager"}
#: bfloat16's rounding of values near 1 (``kernels.precision.FLOOR``)
BF16_FLOOR = 2.0**-8


def model_config(architecture: str) -> Any:
    import transformers

    class_name, fields = ARCHITECTURES[architecture]
    return getattr(transformers, class_name)(**fields)


def logits_bound(peer_error: float, reference: Any) -> float:
    """The attention parity rule (twice the peer's error plus bfloat16's floor) lifted to a
    model's logits: the floor scales with the largest reference logit."""
    return 2 * peer_error + BF16_FLOOR * max(1.0, float(reference.abs().max()))


# ---------------------------------------------------------------------- models


def build(architecture: str, implementations: list[str], device: str = "cuda") -> dict[str, Any]:
    """One model per implementation, same seeded random weights, bfloat16, eval mode; and
    ``"reference"``: those weights in float32 with eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(architecture)
    torch.manual_seed(SEED)
    models: dict[str, Any] = {}
    with torch.device(device):
        for name in [*implementations, "reference"]:
            attention = "eager" if name == "reference" else name
            dtype = torch.float32 if name == "reference" else torch.bfloat16
            model = AutoModelForCausalLM.from_config(
                copy.deepcopy(config), attn_implementation=attention, dtype=dtype
            )
            if models:  # the first model's weights, everywhere
                model.load_state_dict(next(iter(models.values())).state_dict())
            models[name] = model.to(device).eval()
    for name, model in models.items():
        wanted = "eager" if name == "reference" else name
        if model.config._attn_implementation != wanted:
            raise RuntimeError(
                f"{architecture} built with {model.config._attn_implementation!r}, not {wanted!r}"
            )
    return models


def prompt_ids(vocab: int, length: int, seed: int = SEED + 1, device: str = "cuda") -> Any:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (BATCH, length), generator=generator).to(device)


# ---------------------------------------------------------------------- parity


@dataclass
class Parity:
    ours: float
    peer: float
    bound: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.ours) and self.ours <= self.bound

    def as_dict(self) -> dict[str, Any]:
        return {"ours": self.ours, "peer": self.peer, "bound": self.bound, "ok": self.ok}


def forward_parity(models: dict[str, Any], peer: str, ids: Any) -> Parity:
    """One forward pass's logits, ours and the peer's against the float32 reference."""
    import torch

    with torch.no_grad():
        reference = models["reference"](ids).logits.float()
        ours = models[NAME](ids).logits.float()
        theirs = models[peer](ids).logits.float()
    peer_error = float((theirs - reference).abs().max())
    ours_error = float((ours - reference).abs().max())
    return Parity(ours_error, peer_error, logits_bound(peer_error, reference))


def decode_logits(model: Any, sequences: Any, prompt: int) -> Any:
    """The logits ``model`` gives each generated position decoding ``sequences`` step by step
    against its own cache: ``[steps, batch, vocab]``."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    steps = []
    with torch.no_grad():
        out = model(sequences[:, :prompt], past_key_values=cache, use_cache=True)
        steps.append(out.logits[:, -1].float())
        for position in range(prompt, sequences.shape[1] - 1):
            token = sequences[:, position : position + 1]
            out = model(token, past_key_values=cache, use_cache=True)
            steps.append(out.logits[:, -1].float())
    return torch.stack(steps)


def generate_parity(models: dict[str, Any], peer: str, ids: Any) -> tuple[Parity, Any, float]:
    """A greedy generate of ``NEW_TOKENS`` with ours: its step logits against the float32
    reference over the same tokens, next to the peer decoding them; the sequences; and the
    fraction of tokens the peer's own greedy generate agrees on."""
    import torch

    prompt = ids.shape[1]
    with torch.no_grad():
        generated = models[NAME].generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0,
        )
        sequences = generated.sequences
        ours = torch.stack(generated.logits).float()
        full = models["reference"](sequences[:, :-1]).logits.float()
        reference = full[:, prompt - 1 :].transpose(0, 1)
        theirs = decode_logits(models[peer], sequences, prompt)
        their_tokens = models[peer].generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
        )
    agreement = float((their_tokens[:, prompt:] == sequences[:, prompt:]).float().mean())
    peer_error = float((theirs - reference).abs().max())
    parity = Parity(
        float((ours - reference).abs().max()), peer_error, logits_bound(peer_error, reference)
    )
    return parity, sequences, agreement


# ---------------------------------------------------------------------- timing


class StepClock:
    """A stopping criterion that never stops: the time of each generated token (after a
    device synchronisation), from ``start``."""

    def __init__(self) -> None:
        self.start = 0.0
        self.marks: list[float] = []

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        torch.cuda.synchronize()
        self.marks.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def __deepcopy__(self, memo: dict[int, Any]) -> StepClock:
        return self  # generate may copy its criteria: the marks must land here

    def steps_ms(self) -> list[float]:
        points = [self.start, *self.marks]
        return [1e3 * (b - a) for a, b in zip(points, points[1:], strict=False)]


def timed_generate(model: Any, ids: Any, tokens: int) -> list[float]:
    """Milliseconds of each step of a greedy generate: step 0 is the prefill."""
    import torch
    from transformers import StoppingCriteriaList

    clock = StepClock()
    torch.cuda.synchronize()
    clock.start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
            min_new_tokens=tokens, do_sample=False, pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    return clock.steps_ms()


def pass_summary(steps: list[float]) -> dict[str, Any]:
    decode = steps[1:]
    return {
        "prefill_ms": steps[0],
        "decode_mean_ms": statistics.fmean(decode),
        "decode_median_ms": statistics.median(decode),
        "decode_max_ms": max(decode),
        "steps_ms": [round(s, 4) for s in steps],
    }


def time_implementation(model: Any, vocab: int) -> dict[str, Any]:
    timed_generate(model, prompt_ids(vocab, WARM_UP_PROMPT, seed=7), WARM_UP_TOKENS)
    ids = prompt_ids(vocab, PROMPT)
    passes = [pass_summary(timed_generate(model, ids, NEW_TOKENS)) for _ in range(3)]
    first, known = passes[0], passes[2]
    return {
        "passes": passes,
        "new_vs_known_mean": first["decode_mean_ms"] / known["decode_mean_ms"],
        "new_vs_known_median": first["decode_median_ms"] / known["decode_median_ms"],
    }


# ---------------------------------------------------------------------- plans served


def served_plans() -> list[dict[str, Any]]:
    """Every problem the project's attention chose a plan for in this process."""
    from kernels.deploy import _instances

    rows = []
    for instance in _instances.values():
        for runner in instance._runners.values():
            for problem, chosen in runner.chooser._plans.items():
                rows.append(
                    {
                        "problem": problem.label(),
                        "plan": chosen.plan.key(),
                        "origin": chosen.origin,
                    }
                )
    return rows


# ---------------------------------------------------------------------- precompile


def posed_problems(architecture: str, warm_up: bool = True) -> list[Problem]:
    """The attention problems a run above poses, in the order it poses them: per pass
    (warm-up, then the timed prompt) the prefill of each layer kind, the decode problem each
    prefill prepares, then every decode step's. ``warm_up=False``: the order of
    ``tests/test_gpu_transformers.py``, which has no warm-up pass."""
    config = model_config(architecture)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.head_dim
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
    kinds = sorted({kind == "sliding_attention" for kind in layer_types})
    problems: list[Problem] = []

    def problem(rows: int, keys: int, sliding: bool) -> Problem:
        return Problem(
            rows, head_dim, batch=BATCH, heads=heads, kv_heads=kv_heads, kv_len=keys,
            causal=True, dtype="bfloat16", window_left=window - 1 if sliding else -1,
            softcap=softcap,
        )

    passes = [(WARM_UP_PROMPT, WARM_UP_TOKENS)] if warm_up else []
    for prompt, tokens in [*passes, (PROMPT, NEW_TOKENS)]:
        for sliding in kinds:
            kept = min(prompt, window - 1) if sliding else prompt
            problems += [problem(prompt, prompt, sliding), problem(1, kept + 1, sliding)]
        for step in range(1, tokens):
            for sliding in kinds:
                seen = prompt + step
                keys = min(seen - 1, window - 1) + 1 if sliding else seen
                problems.append(problem(1, keys, sliding))
    return problems


def precompile(cache_dir: Path) -> list[dict[str, Any]]:
    """Choose, as a GPU-less H200 would, the plans of every posed problem's bucket, and
    compile their kernels into ``cache_dir``."""
    from kernels import build
    from kernels.plan_choice import PlanChooser
    from tuner.device import H200
    from tuner.environment import Environment
    from tuner.errors import BackendError
    from tuner.planner.tunable import KernelPlan

    def check(plan: KernelPlan) -> KernelPlan | str:
        try:
            compiled = build.compile_kernel(plan, cache_dir, arch=H200.arch)
        except BackendError as error:
            return str(error)
        if isinstance(compiled, build.CompileFailure):
            return f"does not compile: {compiled.reason}"
        judged = plan.with_resources(compiled.primary_resources, H200)
        return judged if judged.feasible else judged.reason

    environment = Environment("NVIDIA H200", "9.0", H200.sm_count, "", "", "", "")
    rows = []
    for architecture in ARCHITECTURES:
        for warm_up in (True, False):  # the benchmark's order, then the GPU test's
            chooser = PlanChooser(None, environment, H200, check=check)
            seen: set[Problem] = set()
            for problem in posed_problems(architecture, warm_up):
                bucket = bucket_of(problem)
                if bucket in seen:
                    continue
                seen.add(bucket)
                chosen = chooser.plan_for(bucket)
                row = {"architecture": architecture, "bucket": bucket.label()}
                rows.append(row | {"plan": chosen.plan.key(), "warm_up": warm_up})
    return rows


# ---------------------------------------------------------------------- main


def run(architectures: list[str], registry: str | None) -> dict[str, Any]:
    import torch
    import transformers

    import kernels.transformers_attention as tuned

    tuned.register(NAME, registry=registry, nearest=True)
    results: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "registry": registry or "none: the planner's default plans",
        "batch": BATCH,
        "prompt": PROMPT,
        "new_tokens": NEW_TOKENS,
        "architectures": {},
    }
    for architecture in architectures:
        began = time.perf_counter()
        peer = PEERS[architecture]
        implementations = list(dict.fromkeys([NAME, peer, "sdpa"]))
        models = build(architecture, implementations)
        vocab = models[NAME].config.vocab_size
        ids = prompt_ids(vocab, PROMPT)
        built_s = time.perf_counter() - began
        timing = {name: time_implementation(models[name], vocab) for name in implementations}
        forward = forward_parity(models, peer, ids)
        decoded, _, agreement = generate_parity(models, peer, ids)
        ours, sdpa = timing[NAME]["passes"][2], timing["sdpa"]["passes"][2]
        results["architectures"][architecture] = {
            "config": ARCHITECTURES[architecture][1],
            "peer": peer,
            "build_s": built_s,
            "forward_logits": forward.as_dict(),
            "generate_logits": decoded.as_dict(),
            "token_agreement_with_peer": agreement,
            "timing": timing,
            "decode_per_token_vs_sdpa": ours["decode_mean_ms"] / sdpa["decode_mean_ms"],
            "prefill_vs_sdpa": ours["prefill_ms"] / sdpa["prefill_ms"],
            "wall_s": time.perf_counter() - began,
        }
        del models
        torch.cuda.empty_cache()
    results["plans_served"] = served_plans()
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where the JSON goes")
    parser.add_argument("--registry", help="a plan registry URL (default: none)")
    parser.add_argument(
        "--architectures", nargs="+", default=list(ARCHITECTURES), choices=list(ARCHITECTURES)
    )
    parser.add_argument("--precompile", type=Path, metavar="DIR", help="compile only (no GPU)")
    args = parser.parse_args(argv)
    if args.out is None and args.precompile is None:
        parser.error("give --out (a run) or --precompile DIR")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.precompile is not None:
        for row in precompile(args.precompile):
            order = "benchmark" if row["warm_up"] else "GPU test"
            print(f"{row['architecture']} ({order}): {row['bucket']}: {row['plan']}")
        return 0
    results = run(args.architectures, args.registry)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for architecture, found in results["architectures"].items():
        timing = found["timing"]
        print(
            f"{architecture}: logits {found['forward_logits']['ours']:.4g} "
            f"(bound {found['forward_logits']['bound']:.4g}), generate "
            f"{found['generate_logits']['ours']:.4g} (bound "
            f"{found['generate_logits']['bound']:.4g}); decode per token vs sdpa "
            f"{found['decode_per_token_vs_sdpa']:.3f}; new/known "
            f"{timing[NAME]['new_vs_known_mean']:.3f} (sdpa "
            f"{timing['sdpa']['new_vs_known_mean']:.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
