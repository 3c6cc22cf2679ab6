"""The ``model/`` config group, the serving-bucket overrides and a model run's one-line
refusals (``tuner.llm.validation``), composed in-process as Hydra composes them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import tuner.__main__ as entry
from tuner.config import ModelConfig, TunerConfig, model_selected, typed_config, validate
from tuner.errors import ConfigError
from tuner.llm.config_json import read_config_json
from tuner.llm.problems import DECODE, PREFILL, Bucket
from tuner.llm.validation import ValidatedModel, model_attention, validate_model

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "tuner" / "conf"
CONFIGS = ROOT / "tests" / "data" / "hf_configs"
OPTIONS = ["gemma-2-9b", "gpt-oss-20b", "llama-3.1-70b", "llama-3.1-8b", "mistral-7b", "qwen2.5-7b"]


@pytest.fixture(scope="module", autouse=True)
def hydra_conf_dir() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def load(*overrides: str) -> TunerConfig:
    return typed_config(compose(config_name="config", overrides=list(overrides)))


def validated(*overrides: str) -> ValidatedModel:
    return validate_model(load(*overrides))


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        validate_model(load(*overrides))
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- The group ---------------------------------------------------------------------------------


def test_the_group_ships_the_six_models() -> None:
    assert sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")) == OPTIONS


def test_no_model_by_default_and_the_shape_command_is_unchanged() -> None:
    config = load("seq_len=4096", "head_dim=128")
    assert config.model == ModelConfig() and not model_selected(config)
    assert validate(config).problem.seq_len == 4096


@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_names_itself_and_leaves_the_shape_unset(option: str) -> None:
    config = load(f"model={option}")
    assert config.model.name == option and model_selected(config)
    assert (config.seq_len, config.head_dim) == (None, None)
    assert isinstance(config.model, ModelConfig)


@pytest.mark.parametrize(
    ("option", "published"),
    [
        ("llama-3.1-8b", "llama-3.1-8b"),
        ("mistral-7b", "mistral-7b-v0.1"),
        ("qwen2.5-7b", "qwen2.5-7b"),
        ("gemma-2-9b", "gemma-2-9b"),
        ("gpt-oss-20b", "gpt-oss-20b"),
    ],
)
def test_an_option_is_its_config_json(option: str, published: str) -> None:
    from_option = model_attention(load(f"model={option}").model)
    from_file = read_config_json(str(CONFIGS / f"{published}.json"))
    assert from_option == dataclasses.replace(from_file, name=option)


def test_the_brief_s_geometries() -> None:
    geometry = {}
    for option in OPTIONS:
        a = model_attention(load(f"model={option}").model)
        windows = sorted({w for w in a.layer_windows if w is not None})
        geometry[option] = (a.heads, a.kv_heads, a.head_dim, a.layers, windows, a.softcap, a.sinks)
    assert geometry == {
        "llama-3.1-8b": (32, 8, 128, 32, [], 0.0, False),
        "llama-3.1-70b": (64, 8, 128, 80, [], 0.0, False),
        "mistral-7b": (32, 8, 128, 32, [4096], 0.0, False),
        "qwen2.5-7b": (28, 4, 128, 28, [], 0.0, False),
        "gemma-2-9b": (16, 8, 256, 42, [4096], 50.0, False),
        "gpt-oss-20b": (64, 8, 64, 24, [128], 0.0, True),
    }


def test_the_default_buckets_and_their_overrides() -> None:
    llama = validated("model=llama-3.1-8b")
    assert len(llama.buckets) == 9 and len(llama.problems) == 9 and not llama.skipped
    assert llama.config.dtype == "bfloat16"
    assert llama.config.registry.url is not None  # resolved, as for a shape
    narrowed = validated(
        "model=llama-3.1-8b",
        "model.prefill_lengths=[2048]",
        "model.prefill_batch=4",
        "model.decode_batches=[8]",
        "model.decode_kv_lengths=[4096,32768]",
        "dtype=float16",
    )
    assert narrowed.buckets == (
        Bucket(PREFILL, 4, 2048),
        Bucket(DECODE, 8, 4096),
        Bucket(DECODE, 8, 32768),
    )
    assert {p.problem.dtype for p in narrowed.problems} == {"float16"}
    decode_only = validated("model=llama-3.1-8b", "model.prefill_lengths=[]")
    assert {p.kind for p in decode_only.problems} == {DECODE}


def test_a_config_json_run(tmp_path: Path) -> None:
    run = validated(f"model.config_json={CONFIGS / 'gemma-2-9b.json'}")
    assert run.attention.softcap == 50.0 and len(run.problems) == 13
    assert run.config.model.name is None


def test_the_candidate_spaces_come_with_the_problems() -> None:
    run = validated("model=gpt-oss-20b", "model.prefill_lengths=[1024]", "model.decode_batches=[]")
    assert [p.problem for p in run.problems] == list(run.spaces)
    assert all(space.feasible for space in run.spaces.values())


# --- One line for each mistake -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "starts"),
    [
        (("seq_len=4096",), "seq_len=4096 is invalid with model=llama-3.1-8b: a model run takes"),
        (("head_dim=64",), "head_dim=64 is invalid with model=llama-3.1-8b"),
        (("batch=4",), "batch=4 is invalid with model=llama-3.1-8b"),
        (("heads=32",), "heads=32 is invalid with model=llama-3.1-8b"),
        (("kv_len=8192",), "kv_len=8192 is invalid with model=llama-3.1-8b"),
        (("causal=true",), "causal=true is invalid with model=llama-3.1-8b"),
        (("search.study_name=mine",), "search.study_name=mine is invalid with model=llama-3.1-8b"),
        (("precision=tf32",), "precision=tf32 is invalid: it applies to dtype=float32 only"),
        (
            ("model.prefill_lengths=[]", "model.decode_batches=[]"),
            "model.prefill_lengths=[] is invalid with no decode bucket",
        ),
        (("model.prefill_lengths=[0]",), "model.prefill_lengths=[0] is invalid: must be a list"),
        (
            ("model.num_key_value_heads=5",),
            "model.num_key_value_heads=5 is invalid: must divide num_attention_heads=32",
        ),
        (
            ("model.sliding_window=-1",),
            "model.sliding_window=-1 is invalid: must be an integer in 1..4294967295 or null",
        ),
        (
            ("model.layer_types=[sliding_attention]",),
            "model.layer_types=[sliding_attention] is invalid: must have one entry per layer",
        ),
        (
            ("model.config_json=/x/config.json",),
            "model.config_json=/x/config.json is invalid with model=llama-3.1-8b: give a model",
        ),
        (
            ("search.families=[tiled]",),
            "model=llama-3.1-8b is invalid on NVIDIA H200: none of its 9 problems can be served",
        ),
    ],
)
def test_a_model_run_refuses_in_one_line(overrides: tuple[str, ...], starts: str) -> None:
    assert refused("model=llama-3.1-8b", *overrides).startswith(starts)


def test_a_missing_field_of_an_option_is_named() -> None:
    message = refused("model=llama-3.1-8b", "model.num_attention_heads=null")
    assert message.startswith("model.num_attention_heads is missing: model=llama-3.1-8b")


def test_config_json_beside_attention_fields_is_refused() -> None:
    message = refused(
        f"model.config_json={CONFIGS / 'llama-3.1-8b.json'}", "model.num_attention_heads=4"
    )
    assert message.startswith("model.num_attention_heads=4 is invalid with model.config_json=")


def test_a_bad_config_json_is_one_line() -> None:
    message = refused("model.config_json=/nowhere/config.json")
    assert message == (
        "model.config_json=/nowhere/config.json is invalid: no such file /nowhere/config.json"
    )


def test_model_keys_without_a_model_are_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        validate(load("seq_len=4096", "head_dim=128", "model.prefill_lengths=[2048]"))
    assert str(caught.value).startswith(
        "model.prefill_lengths=[2048] is invalid without a model: give model=<name>"
    )


def test_plan_mode_lists_a_model_nothing_can_serve() -> None:
    run = validated("model=llama-3.1-8b", "search.families=[tiled]", "mode=plan")
    assert not run.problems and len(run.skipped) == 9


def test_an_unknown_option_names_the_group_s_options() -> None:
    with pytest.raises(Exception) as caught:
        compose(config_name="config", overrides=["model=llama-4"])
    message = entry.describe_composition_error(caught.value, ["model=llama-4"])
    assert message == (
        "model=llama-4 is invalid: no such model option; allowed: gemma-2-9b, gpt-oss-20b, "
        "llama-3.1-70b, llama-3.1-8b, mistral-7b, qwen2.5-7b"
    )


def test_a_typed_model_key_given_text_is_described() -> None:
    overrides = ["model=llama-3.1-8b", "model.prefill_batch=two"]
    with pytest.raises(Exception) as caught:
        compose(config_name="config", overrides=overrides)
    message = entry.describe_composition_error(caught.value, overrides)
    assert message == "model.prefill_batch=two is invalid: must be an integer in 1..4294967295"
