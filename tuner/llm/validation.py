"""A model run's configuration -> the model's problems, checked before anything runs.

``validate_model(config)`` is ``tuner.config.validate`` for ``model=<option>`` or
``model.config_json=<file>``: the shared settings, the model's attention (from the
option's fields or the file, ``tuner.llm.hf_config``), the serving buckets, the
distinct problems, and which of them the planner can serve. Each refusal is one
``ConfigError`` line naming the key (or the file and its field) and what is wrong:

* a shape key (``seq_len=``, ``head_dim=``, ``batch=``, ``heads=``, ``kv_heads=``,
  ``kv_len=``, ``causal=``) beside a model: the model's buckets are the shapes;
* ``search.study_name``: every problem has a study of its own;
* ``model.config_json`` beside a model option or attention fields: one source each;
* a config.json that is missing, not JSON, or has an unusable field;
* no serving bucket, or no problem the planner can serve (``mode=plan`` lists why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tuner.config import (
    ModelConfig,
    TunerConfig,
    check_section,
    check_settings,
    check_value,
    device_profile_from,
    format_value,
    space_axes_from,
    with_registry_url,
)
from tuner.device import DeviceProfile
from tuner.errors import ConfigError
from tuner.llm.attention import ModelAttention
from tuner.llm.config_json import read_config_json, shown_value
from tuner.llm.hf_config import FIELDS, ConfigFieldError, attention_from_fields
from tuner.llm.problems import Bucket, ModelProblem, expand_problems, serving_buckets
from tuner.llm.servable import SkippedProblem, sort_by_planner
from tuner.planner.space import CandidateSpace
from tuner.problem import Problem

#: top-level keys that describe one shape, with the value that means "not given"
SHAPE_KEYS: dict[str, Any] = {
    "seq_len": None,
    "head_dim": None,
    "batch": 1,
    "heads": 1,
    "kv_heads": None,
    "kv_len": None,
    "causal": False,
}


@dataclass(frozen=True, slots=True)
class ValidatedModel:
    """A model run every later stage can trust: the model's attention, its buckets, the
    problems the planner can serve, and those it cannot with the reason."""

    attention: ModelAttention
    buckets: tuple[Bucket, ...]
    problems: tuple[ModelProblem, ...]
    skipped: tuple[SkippedProblem, ...]
    #: the planner's candidate space of each problem in ``problems``
    spaces: dict[Problem, CandidateSpace]
    device: DeviceProfile
    config: TunerConfig

    @property
    def total(self) -> int:
        return len(self.problems) + len(self.skipped)


def validate_model(config: TunerConfig) -> ValidatedModel:
    """Check a model run's settings and expand the model into its problems (see module doc)."""
    model_option = _model_option(config.model)
    _refuse_shape_keys(config, model_option)
    for key in ("dtype", "precision"):
        check_value(key, getattr(config, key))
    if config.precision is not None and config.dtype != "float32":
        raise ConfigError(
            f"precision={config.precision} is invalid: it applies to dtype=float32 only, "
            f"and {config.dtype} has no TF32 variants (leave precision unset)"
        )
    check_settings(config)
    check_section("model", config.model)
    if config.search.study_name is not None:
        raise ConfigError(
            f"search.study_name={config.search.study_name} is invalid with {model_option}: "
            "each of the model's problems has a study of its own, named after it"
        )
    attention = model_attention(config.model)
    buckets = serving_buckets(
        config.model.prefill_lengths,
        config.model.prefill_batch,
        config.model.decode_batches,
        config.model.decode_kv_lengths,
    )
    if not buckets:
        raise ConfigError(
            "model.prefill_lengths=[] is invalid with no decode bucket "
            f"(model.decode_batches={format_value(config.model.decode_batches)}, "
            f"model.decode_kv_lengths={format_value(config.model.decode_kv_lengths)}): "
            "nothing is left to tune"
        )
    problems = expand_problems(attention, buckets, config.dtype, config.precision or "")
    device = device_profile_from(config.device)
    spaces, skipped = sort_by_planner(problems, device, space_axes_from(config.search))
    servable = tuple(p for p in problems if p.problem in spaces)
    if not servable and config.mode == "tune":
        first = skipped[0]
        raise ConfigError(
            f"{model_option} is invalid on {device.name}: none of its {len(skipped)} problems "
            f"can be served (first: {first.model_problem.problem.label()}: {first.reason}); "
            "mode=plan lists them all"
        )
    return ValidatedModel(
        attention=attention,
        buckets=buckets,
        problems=servable,
        skipped=skipped,
        spaces=spaces,
        device=device,
        config=with_registry_url(config),
    )


def model_attention(model: ModelConfig) -> ModelAttention:
    """The attention of the model option's fields, or of ``model.config_json``'s file."""
    if model.config_json is None:
        assert model.name is not None
        given = {name: getattr(model, name) for name in FIELDS}
        try:
            return attention_from_fields(given, model.name)
        except ConfigFieldError as error:
            if error.value is None:
                raise ConfigError(
                    f"model.{error.field} {error.why}: model={model.name} does not give it "
                    f"(model.{error.field}=<value>)"
                ) from error
            raise ConfigError(
                f"model.{error.field}={shown_value(error.value)} is invalid: {error.why}"
            ) from error
    if model.name is not None:
        raise ConfigError(
            f"model.config_json={model.config_json} is invalid with model={model.name}: "
            "give a model option or a config.json, not both"
        )
    written = [name for name in FIELDS if getattr(model, name) is not None]
    if written:
        value = getattr(model, written[0])
        raise ConfigError(
            f"model.{written[0]}={shown_value(value)} is invalid with model.config_json="
            f"{model.config_json}: the attention fields come from the file"
        )
    return read_config_json(model.config_json)


def _model_option(model: ModelConfig) -> str:
    """How the user named the model, for messages: ``model=<name>`` or the config.json."""
    if model.name is not None:
        return f"model={model.name}"
    return f"model.config_json={model.config_json}"


def _refuse_shape_keys(config: TunerConfig, model_option: str) -> None:
    for key, unset in SHAPE_KEYS.items():
        value = getattr(config, key)
        if value != unset or isinstance(value, bool) != isinstance(unset, bool):
            raise ConfigError(
                f"{key}={format_value(value)} is invalid with {model_option}: a model run takes "
                "its shapes from the model and its serving buckets (model.prefill_lengths, "
                "model.prefill_batch, model.decode_batches, model.decode_kv_lengths); leave "
                f"{key} out, or leave the model out to tune one shape"
            )
