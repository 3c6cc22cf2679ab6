"""Typed configuration: the dataclass schemas Hydra composes into.

``tuner/conf/`` holds the YAML that builds on these schemas; ``tuner.__main__``
converts the composed config with ``OmegaConf.to_object`` once, validates it
with ``validate``, and the rest of the code sees only these dataclasses.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tuner import lengths as length_distributions
from tuner.data_dir import default_registry_url
from tuner.device import DeviceProfile
from tuner.errors import ConfigError
from tuner.llm.hf_config import LAYER_TYPES
from tuner.planner.errors import PlanError
from tuner.planner.families import families_for, family_names, registered
from tuner.planner.fixed_width import U32_MAX
from tuner.planner.space import CandidateSpace, SpaceAxes, candidate_space
from tuner.problem import (
    DIRECTIONS,
    FLOAT32_PRECISIONS,
    MAX_PAGE_SIZE,
    SUPPORTED_DTYPES,
    Problem,
)


@dataclass
class SearchConfig:
    #: "model" (default: the cost model's ranking corrected by the measurements),
    #: "tpe", "random" or "grid"
    sampler: str = "model"
    #: trials to finish in this study (a resumed study counts the finished ones); with
    #: ``stop`` the cap: the stopping rule usually ends the search well before it
    n_trials: int = 40
    #: end the search once the model sampler's posterior gives no unmeasured plan more
    #: than ``stop_probability`` chance of beating the best by ``stop_margin``
    #: (``tuner.stopping``); model sampler only (tpe, random and grid run n_trials)
    stop: bool = True
    #: improvement (a fraction of the best time) too small to go on measuring for; also
    #: the improvement the model sampler's proposals aim at
    stop_margin: float = 0.02
    #: a plan with at least this chance of beating the best by stop_margin keeps the
    #: search going
    stop_probability: float = 0.05
    #: counted trials before the stopping rule may end the search (n_trials, the cap,
    #: wins where it is smaller)
    min_trials: int = 4
    #: wall-clock limit of the whole search in seconds; null for none
    timeout_s: float | None = None
    seed: int = 0
    #: Optuna storage URL; null: a SQLite file next to the registry's
    storage: str | None = None
    #: null: derived from the problem and the environment
    study_name: str | None = None
    #: the cost model's best predictions measured first
    enqueue_top: int = 8
    #: skip plans whose predicted traffic exceeds this multiple of the best candidate's
    traffic_cutoff: float = 16.0
    #: a single measurement (compile + launch + check + time) past this is a TIMEOUT
    trial_timeout_s: float = 120.0
    #: seconds between heartbeats of a running trial (whole seconds, as Optuna takes them)
    heartbeat_interval_s: int = 30
    #: a running trial silent this long belongs to a dead worker: it is failed and
    #: retried; null: twice heartbeat_interval_s
    grace_period_s: int | None = None
    #: kernel families to search; null: every registered family that takes the dtype
    families: list[str] | None = None
    # Narrowing of the built-in families' tunables (null: the family's own values).
    tile_sizes: list[int] | None = None
    rows_per_block: list[int] | None = None
    tiled_threads: list[int] | None = None
    scalar_threads: list[int] | None = None
    split_targets: list[int] | None = None
    #: any family's tunable by its axis name, ``<family>_<tunable>`` unless the
    #: family names it otherwise: ``+search.axes.mma_f16_block_m=[64]``
    axes: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class BackendConfig:
    #: "auto" (pycuda when a CUDA device answers, else model), "pycuda", "model", "replay"
    name: str = "auto"
    #: JSON file of recorded timings, for name=replay
    replay_path: str | None = None
    #: timed repetitions per candidate (median and interquartile range reported)
    repetitions: int = 30
    warmup: int = 3
    flush_l2: bool = True
    #: compiled cubins, keyed by family, constants, source hash and nvcc version
    cache_dir: str = "~/.cache/flash-attention-tuner/cubins"
    #: run each GPU measurement in a worker process that a crash cannot take down
    isolate: bool = True
    #: parallel nvcc processes when precompiling the space; 0 = CPU count
    compile_jobs: int = 0


@dataclass
class RegistryConfig:
    #: any SQLAlchemy URL; null: plans.sqlite in the per-user data directory (tuner.data_dir)
    url: str | None = None


@dataclass
class DeviceConfig:
    """Named limits of the GPU the planner plans for when none answers (see tuner.device)."""

    profile: str = "h200"
    name: str = "NVIDIA H200"
    compute_capability: list[int] = field(default_factory=lambda: [9, 0])
    sm_count: int = 132
    max_threads_per_block: int = 1024
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    max_shared_memory_per_block_optin: int = 232448
    shared_memory_per_sm: int = 233472
    reserved_shared_memory_per_block: int = 1024
    registers_per_sm: int = 65536
    registers_per_block: int = 65536
    max_registers_per_thread: int = 255
    register_allocation_unit: int = 256
    warp_size: int = 32
    l2_bytes: int = 62914560
    peak_fp32_tflops: float = 67.0
    peak_mma_f16_tflops: float = 660.0
    dram_bandwidth_gbps: float = 4300.0
    shared_bandwidth_bytes_per_clock_per_sm: int = 128
    clock_ghz: float = 1.98


@dataclass
class ModelConfig:
    """A model to tune all the attention problems of (``model=<option>`` or
    ``model.config_json=<file>``), and the serving buckets that shape them.

    The attention fields carry the names of a Hugging Face ``config.json`` and mean
    what they mean there (``tuner.llm.hf_config`` reads both alike); null is a field
    the config does not have. Each ``tuner/conf/model/`` option writes the published
    values; ``config_json`` reads them from a file instead (then these stay null).
    """

    #: the option's name, written by each tuner/conf/model/ file; null: no model option
    name: str | None = None
    #: a Hugging Face config.json (or a directory holding one) to read the fields from
    config_json: str | None = None
    model_type: str | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_hidden_layers: int | None = None
    sliding_window: int | None = None
    use_sliding_window: bool | None = None
    max_window_layers: int | None = None
    layer_types: list[str] | None = None
    sliding_window_pattern: int | None = None
    attn_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    # Serving buckets: prefill of each length (one sequence per batch row, causal),
    # and decode (one query row per sequence) of each batch at each KV length.
    prefill_lengths: list[int] = field(default_factory=lambda: [1024, 4096, 8192])
    prefill_batch: int = 1
    decode_batches: list[int] = field(default_factory=lambda: [1, 16, 64])
    decode_kv_lengths: list[int] = field(default_factory=lambda: [2048, 8192])


@dataclass
class TunerConfig:
    seq_len: Any = MISSING
    head_dim: Any = MISSING
    batch: Any = 1
    heads: Any = 1
    causal: Any = False
    #: bfloat16 by default: what LLM users run attention in
    dtype: Any = "bfloat16"
    #: KV heads (grouped-query attention; divides heads); null: heads
    kv_heads: Any = None
    #: key/value length (decode against a KV cache); null: seq_len
    kv_len: Any = None
    #: float32 only: "tf32x3" (null means it: float32-class error) or "tf32" (one-pass
    #: TF32 tensor-core plans allowed too); null for bfloat16/float16
    precision: Any = None
    #: sliding window: query row r sees keys in [r + off - window_left, r + off +
    #: window_right], off = kv_len - seq_len; -1: no bound on that side
    window_left: Any = -1
    window_right: Any = -1
    #: logit softcap: scaled logits s become softcap * tanh(s / softcap); 0: none
    softcap: Any = 0
    #: an ALiBi bias per query head (tuned with the standard slopes)
    alibi: Any = False
    #: one sink logit per query head in the softmax's denominator (tuned with random ones)
    sinks: Any = False
    #: "forward" (the attention) or "backward" (its gradients dQ, dK, dV: training)
    direction: Any = "forward"
    #: a serving bucket's paged KV cache: tokens a page (1..256); null: contiguous
    page_size: Any = None
    #: a serving bucket's KV lengths over its `batch` requests, up to kv_len: equal (all at
    #: kv_len), uniform, skewed (one at kv_len, the rest at kv_len/32), or file:PATH (observed
    #: lengths, whitespace-separated)
    lengths: Any = "equal"
    #: "tune" (search, measure, store) or "plan" (print the candidate space; no GPU)
    mode: str = "tune"
    #: rows of the plan-mode table, best predicted first; 0 prints every feasible candidate
    plan_rows: int = 20
    #: worker processes sharing the study on this host (one GPU each, round-robin),
    #: or "auto": one per visible GPU
    workers: Any = 1
    search: SearchConfig = field(default_factory=SearchConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    #: a model instead of a shape (tuner/conf/model/, or model.config_json=<file>)
    model: ModelConfig = field(default_factory=ModelConfig)


def register_configs() -> None:
    """Store the schema in Hydra's ConfigStore, where ``tuner/conf/`` builds on it.

    ``tuner/conf/config.yaml`` starts from ``base_config``; its typed sections
    (``search: SearchConfig``, ...) type-check every group option merged into them,
    and overrides alike. The sections are not stored as group options of their
    own: ``--help`` would list them as choices (``search: base_search, ...``).
    Called on import: every composer of ``tuner/conf/`` imports this module first.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=TunerConfig)


register_configs()


# --- What each key accepts -------------------------------------------------------------------
# One table serves the checks below and the messages for values Hydra itself rejects
# (a typed field given text), so a key's error reads the same whichever layer catches it.

MODES = ("tune", "plan")
SAMPLERS = ("model", "tpe", "random", "grid")
BACKENDS = ("auto", "pycuda", "model", "replay")
SECTIONS: dict[str, type] = {
    "search": SearchConfig,
    "backend": BackendConfig,
    "registry": RegistryConfig,
    "device": DeviceConfig,
    "model": ModelConfig,
}


@dataclass(frozen=True, slots=True)
class Rule:
    """The values one key accepts, in words (for messages) and as a test."""

    allowed: str
    accepts: Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    # YAML's true/false are Python bools, which are ints: never a count or a size.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _int_in(low: int, high: int | None = None) -> Rule:
    allowed = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"
    return Rule(allowed, lambda v: _is_int(v) and v >= low and (high is None or v <= high))


def _optional_int_in(low: int, high: int, null_means: str) -> Rule:
    return Rule(
        f"an integer in {low}..{high} or {null_means}",
        lambda v: v is None or (_is_int(v) and low <= v <= high),
    )


def number_above(low: float, *, optional: bool = False) -> Rule:
    allowed = f"a number > {low:g}" + (" or null" if optional else "")
    return Rule(allowed, lambda v: (optional and v is None) or (_is_number(v) and v > low))


def _fraction_below(high: float, *, open_low: bool) -> Rule:
    low = "> 0" if open_low else ">= 0"
    return Rule(
        f"a number {low} and < {high:g}",
        lambda v: _is_number(v) and (v > 0 if open_low else v >= 0) and v < high,
    )


def number_at_least(low: float) -> Rule:
    return Rule(f"a number >= {low:g}", lambda v: _is_number(v) and v >= low)


def _one_of(options: Sequence[str]) -> Rule:
    return Rule(f"one of {', '.join(options)}", lambda v: isinstance(v, str) and v in options)


def _text(*, optional: bool = False) -> Rule:
    allowed = "a non-empty string" + (" or null" if optional else "")
    return Rule(allowed, lambda v: (optional and v is None) or (isinstance(v, str) and v != ""))


def _url(*, optional: bool = False) -> Rule:
    allowed = "a SQLAlchemy URL such as sqlite:////path/to/plans.sqlite" + (
        " or null" if optional else ""
    )
    return Rule(allowed, lambda v: (optional and v is None) or _is_url(v))


def _is_url(value: Any) -> bool:
    # Only the syntax: whether the database answers is the registry's and the study's business.
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    if not isinstance(value, str):
        return False
    try:
        make_url(value)
    except ArgumentError:
        return False
    return True


def _workers() -> Rule:
    return Rule(
        "a positive integer or auto",
        lambda v: (_is_int(v) and v >= 1) or v == "auto",
    )


def _is_int_list(value: Any, minimum: int = 1) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(_is_int(x) and x >= minimum for x in value)
    )


def _int_list(*, optional: bool = False) -> Rule:
    allowed = "a non-empty list of integers >= 1" + (" or null" if optional else "")
    return Rule(allowed, lambda v: (optional and v is None) or _is_int_list(v))


def _subset_of(options: Sequence[str], *, optional: bool = False) -> Rule:
    return Rule(
        f"a non-empty list drawn from {', '.join(options)}" + (" or null" if optional else ""),
        lambda v: (optional and v is None)
        or (isinstance(v, list) and bool(v) and all(x in options for x in v)),
    )


def _axes() -> Rule:
    # >= 0, not >= 1: the switches (overlap, pingpong, staged_store, deterministic, ...)
    # are 0 or 1, and narrowing one to [0] is how a search leaves a mechanism out
    known = sorted(SpaceAxes().values())
    return Rule(
        f"a mapping of tunable axes ({', '.join(known)}) to non-empty lists of integers >= 0",
        lambda v: isinstance(v, dict)
        and all(k in known and _is_int_list(x, minimum=0) for k, x in v.items()),
    )


def _length_list() -> Rule:
    return Rule(
        "a list of integers >= 1 ([] for none)",
        lambda v: isinstance(v, list) and all(_is_int(x) and 1 <= x <= U32_MAX for x in v),
    )


def _optional_number(low: float, *, inclusive: bool, null_means: str) -> Rule:
    sign = ">=" if inclusive else ">"
    return Rule(
        f"a number {sign} {low:g} or {null_means}",
        lambda v: v is None or (_is_number(v) and (v >= low if inclusive else v > low)),
    )


_BOOL = Rule("true or false", lambda v: isinstance(v, bool))
#: the largest value of the kernels' int32 arguments
I32_MAX = 2**31 - 1


def _window_bound() -> Rule:
    return Rule(
        f"an integer in 0..{I32_MAX}, or -1 for no bound on that side",
        lambda v: _is_int(v) and -1 <= v <= I32_MAX,
    )

_SHAPE_KEYS = (
    "seq_len", "head_dim", "batch", "heads", "causal", "dtype", "kv_heads", "kv_len", "precision",
    "window_left", "window_right", "softcap", "alibi", "sinks",
    "direction", "page_size", "lengths",
)
#: the mandatory shape keys a model run leaves unset
_MODEL_FREE_KEYS = {"seq_len", "head_dim"}
#: the keys that make a run a model run (model_selected)
_MODEL_KEYS = ("name", "config_json")
_AXIS_KEYS = (
    "families",
    "tile_sizes",
    "rows_per_block",
    "tiled_threads",
    "scalar_threads",
    "split_targets",
    "axes",
)

RULES: dict[str, Rule] = {
    # The kernels index with u32, so no dimension may exceed its maximum.
    "seq_len": _int_in(1, U32_MAX),
    "head_dim": _int_in(1, U32_MAX),
    "batch": _int_in(1, U32_MAX),
    "heads": _int_in(1, U32_MAX),
    "causal": _BOOL,
    "dtype": _one_of(SUPPORTED_DTYPES),
    "kv_heads": _optional_int_in(1, U32_MAX, "null (= heads)"),
    "kv_len": _optional_int_in(1, U32_MAX, "null (= seq_len)"),
    "precision": Rule(
        f"one of {', '.join(FLOAT32_PRECISIONS)} or null (float32 only)",
        lambda v: v is None or (isinstance(v, str) and v in FLOAT32_PRECISIONS),
    ),
    # The kernels take the bounds as int32.
    "window_left": _window_bound(),
    "window_right": _window_bound(),
    "softcap": Rule("a number >= 0 (0: no cap)", lambda v: _is_number(v) and v >= 0),
    "alibi": _BOOL,
    "sinks": _BOOL,
    "direction": _one_of(DIRECTIONS),
    "page_size": _optional_int_in(1, MAX_PAGE_SIZE, "null (contiguous)"),
    "lengths": Rule(
        f"one of {', '.join(length_distributions.NAMED)} or file:PATH (a file of lengths)",
        lambda v: isinstance(v, str)
        and (v in length_distributions.NAMED or (v.startswith("file:") and len(v) > 5)),
    ),
    "mode": _one_of(MODES),
    "plan_rows": _int_in(0),
    "workers": _workers(),
    "search.sampler": _one_of(SAMPLERS),
    "search.n_trials": _int_in(1),
    "search.stop": _BOOL,
    # A margin of 1 (100%) would ask for plans twice as fast: nothing stops on that.
    "search.stop_margin": _fraction_below(1, open_low=False),
    "search.stop_probability": _fraction_below(1, open_low=True),
    "search.min_trials": _int_in(1),
    "search.timeout_s": number_above(0, optional=True),
    # numpy's and Optuna's samplers take seeds in 0..2**32-1.
    "search.seed": _int_in(0, U32_MAX),
    "search.storage": _url(optional=True),
    "search.study_name": _text(optional=True),
    "search.enqueue_top": _int_in(0),
    # Below 1 the cut-off would discard the best candidate itself.
    "search.traffic_cutoff": number_at_least(1),
    "search.trial_timeout_s": number_above(0),
    "search.heartbeat_interval_s": _int_in(1),
    "search.grace_period_s": Rule(
        "an integer >= 1 or null", lambda v: v is None or (_is_int(v) and v >= 1)
    ),
    "search.families": _subset_of(family_names(), optional=True),
    "search.tile_sizes": _int_list(optional=True),
    "search.rows_per_block": _int_list(optional=True),
    "search.tiled_threads": _int_list(optional=True),
    "search.scalar_threads": _int_list(optional=True),
    "search.split_targets": _int_list(optional=True),
    "search.axes": _axes(),
    "backend.name": _one_of(BACKENDS),
    "backend.replay_path": _text(optional=True),
    "backend.repetitions": _int_in(1),
    "backend.warmup": _int_in(0),
    "backend.flush_l2": _BOOL,
    "backend.cache_dir": _text(),
    "backend.isolate": _BOOL,
    "backend.compile_jobs": _int_in(0),
    "registry.url": _url(optional=True),
    "device.profile": _text(),
    "device.name": _text(),
    "device.compute_capability": Rule(
        "[major, minor], two integers >= 0",
        lambda v: isinstance(v, list) and len(v) == 2 and all(_is_int(x) and x >= 0 for x in v),
    ),
    # A device may reserve no shared memory per block; every other limit is a positive count.
    "device.reserved_shared_memory_per_block": _int_in(0),
    **{
        f"device.{f.name}": _int_in(1) if f.type == "int" else number_above(0)
        for f in fields(DeviceConfig)
        if f.type in ("int", "float") and f.name != "reserved_shared_memory_per_block"
    },
    "model.name": _text(optional=True),
    "model.config_json": _text(optional=True),
    "model.model_type": _text(optional=True),
    "model.hidden_size": _optional_int_in(1, U32_MAX, "null (not in the config)"),
    "model.num_attention_heads": _optional_int_in(1, U32_MAX, "null (not in the config)"),
    "model.num_key_value_heads": _optional_int_in(1, U32_MAX, "null (= num_attention_heads)"),
    "model.head_dim": _optional_int_in(
        1, U32_MAX, "null (= hidden_size / num_attention_heads)"
    ),
    "model.num_hidden_layers": _optional_int_in(1, U32_MAX, "null (= len(layer_types))"),
    "model.sliding_window": _optional_int_in(1, U32_MAX, "null (no sliding window)"),
    "model.use_sliding_window": Rule(
        "true, false or null (= true)", lambda v: v is None or isinstance(v, bool)
    ),
    "model.max_window_layers": _optional_int_in(0, U32_MAX, "null (not in the config)"),
    "model.layer_types": Rule(
        f"a list of {' or '.join(LAYER_TYPES)}, one per layer, or null",
        lambda v: v is None or (isinstance(v, list) and all(x in LAYER_TYPES for x in v)),
    ),
    "model.sliding_window_pattern": _optional_int_in(1, U32_MAX, "null (not in the config)"),
    "model.attn_logit_softcapping": _optional_number(0, inclusive=True, null_means="null (= 0)"),
    "model.query_pre_attn_scalar": _optional_number(
        0, inclusive=False, null_means="null (= head_dim)"
    ),
    "model.prefill_lengths": _length_list(),
    "model.prefill_batch": _int_in(1, U32_MAX),
    "model.decode_batches": _length_list(),
    "model.decode_kv_lengths": _length_list(),
}


def allowed_values(key: str) -> str | None:
    """What ``key`` (dotted; a list element's ``[i]`` ignored) accepts, or None if no such key."""
    rule = RULES.get(_without_index(key))
    return rule.allowed if rule else None


def _without_index(key: str) -> str:
    return re.sub(r"(\[\d+\])+$", "", key)


def format_value(value: Any) -> str:
    """A value as it would be written on the command line (``true``, ``null``, ``[1, 2]``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_value(item) for item in value) + "]"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        # Typed float fields turn -5 into -5.0; quote the number as the user wrote it.
        return str(int(value))
    return str(value)


def invalid_message(key: str, value_text: str) -> str:
    allowed = allowed_values(key)
    return f"{_without_index(key)}={value_text} is invalid: must be {allowed}"


def unknown_key_message(key: str, value_text: str) -> str:
    section, _, name = key.rpartition(".")
    closest = closest_key(key)
    hint = f" (did you mean {closest}?)" if closest else ""
    if section in SECTIONS:
        known = ", ".join(f.name for f in fields(SECTIONS[section]))
        return (
            f"{key}={value_text} is invalid: {section} has no key {name!r}{hint}; "
            f"allowed: {known}"
        )
    known = ", ".join(f"{f.name}.*" if f.name in SECTIONS else f.name for f in fields(TunerConfig))
    return f"{key}={value_text} is invalid: no such key{hint}; allowed: {known}"


def closest_key(key: str) -> str | None:
    """The known key ``key`` is most likely a typo of (difflib), or None.

    Within a known section only that section's keys compete (their shared
    ``search.`` prefix would make any two of them look alike).
    """
    section, _, name = key.rpartition(".")
    if section in SECTIONS:
        names = [f.name for f in fields(SECTIONS[section])]
        matches = difflib.get_close_matches(name, names, n=1, cutoff=0.7)
        return f"{section}.{matches[0]}" if matches else None
    matches = difflib.get_close_matches(key, list(RULES), n=1, cutoff=0.7)
    return matches[0] if matches else None


def missing_message(key: str) -> str:
    return f"{key} is missing: give {key}=<{allowed_values(key) or 'a value'}>"


def check_value(key: str, value: Any) -> None:
    """``ConfigError`` naming ``key``, ``value`` and what is allowed, unless its rule accepts it."""
    rule = RULES[key]
    if not rule.accepts(value):
        raise ConfigError(invalid_message(key, format_value(value)))


def check_section(section: str, values: Any) -> None:
    """``check_value`` for every key of a section (``search``, ``model``, ...)."""
    for f in fields(values):
        check_value(f"{section}.{f.name}", getattr(values, f.name))


# --- From Hydra's composed config to typed, validated values ----------------------------------


@dataclass(frozen=True, slots=True)
class ValidatedConfig:
    """A configuration every later stage can trust: checked values, and the typed views
    of them that the planner, the search and the registry work with."""

    problem: Problem
    device: DeviceProfile
    config: TunerConfig


def typed_config(cfg: DictConfig) -> TunerConfig:
    """The composed config as a ``TunerConfig``: the one ``OmegaConf.to_object`` of a run.

    Raises ``ConfigError`` (one line) for keys forced in with ``+key=``, missing
    mandatory values and interpolations that do not resolve. A model run takes its
    shapes from the model: there ``seq_len`` and ``head_dim`` may stay unset (None).
    """
    raw = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    assert isinstance(raw, dict)
    _reject_unknown_keys(raw)
    try:
        missing = OmegaConf.missing_keys(cfg)
        model = raw.get("model")
        if isinstance(model, dict) and any(model.get(k) is not None for k in _MODEL_KEYS):
            cfg = copy.deepcopy(cfg)
            for key in _MODEL_FREE_KEYS & missing:
                cfg[key] = None
            missing -= _MODEL_FREE_KEYS
        if missing:
            order = list(RULES)
            first = min(missing, key=lambda k: order.index(k) if k in order else len(order))
            raise ConfigError(missing_message(first))
        config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as error:
        # Interpolations resolve here (``seq_len=${nope}``); name the key and its text.
        key = _without_index(getattr(error, "full_key", "") or "")
        lines = str(error).splitlines()
        text = lines[0] if lines else type(error).__name__
        where = f"{key}={format_value(_lookup(raw, key))}" if key else "the configuration"
        raise ConfigError(f"{where} is invalid: {text}") from error
    if not isinstance(config, TunerConfig):
        raise ConfigError(f"the configuration is a {type(config).__name__}, not a TunerConfig")
    return config


def _reject_unknown_keys(raw: dict[str, Any]) -> None:
    # Struct mode stops ``foo=1``; ``+foo=1`` forces the key in, and to_object would drop
    # or choke on it, so it is named here instead.
    sections: list[tuple[str, type, dict[str, Any]]] = [("", TunerConfig, raw)]
    sections += [
        (f"{name}.", schema, raw[name])
        for name, schema in SECTIONS.items()
        if isinstance(raw.get(name), dict)
    ]
    for prefix, schema, values in sections:
        known = {f.name for f in fields(schema)}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(unknown_key_message(f"{prefix}{key}", format_value(value)))


def _lookup(raw: dict[str, Any], key: str) -> Any:
    node: Any = raw
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def problem_from(config: TunerConfig) -> Problem:
    """The attention problem of ``config``; ``ConfigError`` names a bad shape value."""
    return checked_problem(**{key: getattr(config, key) for key in _SHAPE_KEYS})


def checked_problem(**shape: Any) -> Problem:
    """The problem of the shape keys' values (``seq_len=...``, the config's names; a
    missing key takes the schema's default), checked as a run's config is checked:
    ``ConfigError`` names the first bad value. Also what ``python -m db import`` holds
    every exported problem to: a row no tuner run could have made is refused."""
    unknown = set(shape) - set(_SHAPE_KEYS)
    if unknown:
        raise ConfigError(
            f"{sorted(unknown)[0]} is not a problem key; allowed: {', '.join(_SHAPE_KEYS)}"
        )
    defaults = {f.name: f.default for f in fields(TunerConfig) if f.name in _SHAPE_KEYS}
    config = _ShapeValues(**(defaults | shape))
    for key in _SHAPE_KEYS:
        check_value(key, getattr(config, key))
    if config.precision is not None and config.dtype != "float32":
        raise ConfigError(
            f"precision={config.precision} is invalid: it applies to dtype=float32 only, "
            f"and {config.dtype} has no TF32 variants (leave precision unset)"
        )
    elements = config.batch * config.heads * config.seq_len * config.head_dim
    if elements > U32_MAX:
        raise ConfigError(
            f"batch*heads*seq_len*head_dim={config.batch}*{config.heads}*{config.seq_len}*"
            f"{config.head_dim} is invalid: must be at most {U32_MAX} elements "
            "(the kernels index each tensor with 32-bit integers)"
        )
    kv_heads = config.heads if config.kv_heads is None else config.kv_heads
    kv_len = config.seq_len if config.kv_len is None else config.kv_len
    if config.heads % kv_heads:
        raise ConfigError(
            f"kv_heads={kv_heads} is invalid: must divide heads={config.heads} (each KV head "
            "serves heads/kv_heads query heads)"
        )
    if config.causal and config.seq_len > kv_len:
        raise ConfigError(
            f"kv_len={kv_len} is invalid with causal=true and seq_len={config.seq_len}: causal "
            "masking is bottom-right aligned (query row r sees keys k <= r + kv_len - seq_len), "
            "so kv_len must be >= seq_len"
        )
    kv_elements = config.batch * kv_heads * kv_len * config.head_dim
    if kv_elements > U32_MAX:
        raise ConfigError(
            f"batch*kv_heads*kv_len*head_dim={config.batch}*{kv_heads}*{kv_len}*"
            f"{config.head_dim} is invalid: must be at most {U32_MAX} elements "
            "(the kernels index each tensor with 32-bit integers)"
        )
    lengths = _distribution(config.lengths, kv_len)
    return Problem(
        seq_len=config.seq_len,
        head_dim=config.head_dim,
        batch=config.batch,
        heads=config.heads,
        causal=config.causal,
        dtype=config.dtype,
        kv_heads=kv_heads,
        kv_len=kv_len,
        precision=config.precision or "",
        window_left=config.window_left,
        window_right=config.window_right,
        softcap=float(config.softcap),
        alibi=config.alibi,
        sinks=config.sinks,
        direction=config.direction,
        page_size=config.page_size,
        lengths=lengths,
    )


@dataclass(frozen=True, slots=True)
class _ShapeValues:
    seq_len: Any
    head_dim: Any
    batch: Any
    heads: Any
    causal: Any
    dtype: Any
    kv_heads: Any
    kv_len: Any
    precision: Any
    window_left: Any
    window_right: Any
    softcap: Any
    alibi: Any
    sinks: Any
    direction: Any
    page_size: Any
    lengths: Any


def _distribution(lengths: str, kv_len: int) -> str:
    """``lengths`` as the problem holds it: a named distribution, or a file's lengths as an
    empirical one (``tuner.lengths.values_from_lengths``); ``ConfigError`` names the file."""
    if not lengths.startswith("file:"):
        return lengths
    path = Path(lengths[len("file:") :]).expanduser()
    try:
        observed = [int(word) for word in path.read_text().split()]
        values = length_distributions.values_from_lengths(observed)
    except OSError as error:
        raise ConfigError(f"lengths={lengths} is invalid: {error.strerror or error}") from error
    except ValueError as error:
        raise ConfigError(
            f"lengths={lengths} is invalid: the file must hold positive integer lengths "
            f"separated by whitespace ({error})"
        ) from error
    if length_distributions.values_of(values)[-1] > kv_len:
        raise ConfigError(
            f"lengths={lengths} is invalid: it holds lengths up to "
            f"{length_distributions.values_of(values)[-1]}, more than kv_len={kv_len} (the "
            "bucket's longest request)"
        )
    return values


def device_profile_from(device_config: DeviceConfig) -> DeviceProfile:
    """The planner's view of the configured device limits; ``ConfigError`` names a bad one."""
    check_section("device", device_config)
    values = {
        f.name: getattr(device_config, f.name) for f in fields(DeviceConfig) if f.name != "profile"
    }
    major, minor = device_config.compute_capability
    values["compute_capability"] = (major, minor)
    return DeviceProfile(**values)


def space_axes_from(search_config: SearchConfig) -> SpaceAxes:
    """The values each tunable may take, as the search settings restrict them."""
    for name in _AXIS_KEYS:
        check_value(f"search.{name}", getattr(search_config, name))
    values = {
        name: tuple(getattr(search_config, name))
        for name in _AXIS_KEYS
        if name not in ("families", "axes") and getattr(search_config, name) is not None
    }
    values |= {name: tuple(given) for name, given in dict(search_config.axes).items()}
    families = search_config.families
    return SpaceAxes(families=None if families is None else tuple(families), values=values)


def validate(config: TunerConfig) -> ValidatedConfig:
    """Check every value of ``config`` before anything is planned, built or written.

    Raises ``ConfigError`` whose message is one line naming the key, the value
    given and what is allowed; also when no candidate plan is feasible at all,
    since a search over an empty space could only fail later and less clearly.
    A model run (``model_selected``) is validated by ``tuner.llm.validation`` instead.
    """
    problem = problem_from(config)
    _refuse_model_settings(config.model)
    check_settings(config)
    device = device_profile_from(config.device)
    _require_feasible_plan(problem, device, space_axes_from(config.search))
    return ValidatedConfig(problem=problem, device=device, config=with_registry_url(config))


def check_settings(config: TunerConfig) -> None:
    """Check what a shape run and a model run share: mode, workers, search, backend, registry."""
    for key in ("mode", "plan_rows", "workers"):
        check_value(key, getattr(config, key))
    check_section("search", config.search)
    check_section("backend", config.backend)
    check_section("registry", config.registry)
    if config.backend.name == "replay" and config.backend.replay_path is None:
        raise ConfigError(
            "backend.replay_path=null is invalid: backend=replay needs the JSON file of "
            "recorded timings (backend.replay_path=<file>)"
        )


def with_registry_url(config: TunerConfig) -> TunerConfig:
    """``config`` with the registry URL resolved (null: the data directory's plans.sqlite),
    once, here: every later stage sees the URL it writes to."""
    if config.registry.url is not None:
        return config
    return replace(config, registry=RegistryConfig(url=default_registry_url()))


def model_selected(config: TunerConfig) -> bool:
    """Whether ``config`` asks to tune a model (``model=<option>`` or ``model.config_json=``)."""
    return any(getattr(config.model, key) is not None for key in _MODEL_KEYS)


def _refuse_model_settings(model: ModelConfig) -> None:
    # A model's keys without a model (model.prefill_lengths=[2048] alone) would be ignored.
    defaults = ModelConfig()
    for f in fields(ModelConfig):
        value = getattr(model, f.name)
        if value != getattr(defaults, f.name):
            raise ConfigError(
                f"model.{f.name}={format_value(value)} is invalid without a model: give "
                "model=<name> (tuner/conf/model/) or model.config_json=<config.json>, "
                "or leave it out to tune the one shape"
            )


def _require_feasible_plan(problem: Problem, device: DeviceProfile, axes: SpaceAxes) -> None:
    kv = "" if problem.self_attention else (
        f" kv_heads={problem.kv_heads} kv_len={problem.kv_len}"
    )
    variants = problem.variant_text()
    shape = (
        f"seq_len={problem.seq_len} head_dim={problem.head_dim} (batch={problem.batch} "
        f"heads={problem.heads}{kv} causal={format_value(problem.causal)}"
        f"{' ' + variants if variants else ''})"
    )
    try:
        space = candidate_space(problem, device, axes)
    except PlanError as error:
        raise ConfigError(f"{shape} is invalid: cannot be planned: {error}") from error
    if space.feasible:
        return
    if not families_for(problem.dtype, problem.direction):
        takers = ", ".join(
            f"{family.name} ({'/'.join(family.dtypes)}, {family.direction})"
            for family in registered()
        )
        raise ConfigError(
            f"dtype={problem.dtype} is invalid: no registered kernel family takes it in the "
            f"{problem.direction} direction, so pruning left nothing to search "
            f"(families: {takers})"
        )
    summary = rejection_summary(space)
    example = f"; most often: {summary[0].example}" if summary else ""
    raise ConfigError(
        f"{shape} is invalid: no candidate plan is feasible on {device.name} "
        f"(all {len(space.rejected)} rejected{example})"
    )


@dataclass(frozen=True, slots=True)
class RejectionKind:
    """One kind of reason candidates were rejected for, with one reason in full."""

    kind: str
    count: int
    example: str


def rejection_summary(space: CandidateSpace) -> list[RejectionKind]:
    """``space.rejection_counts()``, commonest first, each with an example reason.

    The planner's kinds show each number as N (``tile_size=N``); the example
    keeps them. It is found by the same grouping as ``rejection_counts``, applied
    per plan, so the two cannot disagree.
    """
    examples: dict[str, str] = {}
    for plan in space.rejected:
        (kind,) = CandidateSpace(feasible=(), rejected=(plan,)).rejection_counts()
        examples.setdefault(kind, plan.reason)
    return [
        RejectionKind(kind, count, examples.get(kind, kind))
        for kind, count in space.rejection_counts().most_common()
    ]
