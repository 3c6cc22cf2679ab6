"""Reading a model's attention from a Hugging Face config.json (``tuner.llm.hf_config``)
and from a file (``tuner.llm.validation.read_config_json``): the real models' shapes,
then absent, odd and unusable fields, each named in one error line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tuner.errors import ConfigError
from tuner.llm.config_json import read_config_json
from tuner.llm.hf_config import (
    ConfigFieldError,
    attention_from_fields,
    language_model_fields,
    layer_windows,
)

CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"


def fixture(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / f"{name}.json").read_text())


# --- The published configs -------------------------------------------------------------------


def test_llama_3_1_8b_derives_head_dim_from_hidden_size() -> None:
    attention = read_config_json(str(CONFIGS / "llama-3.1-8b.json"))
    assert (attention.heads, attention.kv_heads, attention.head_dim) == (32, 8, 128)
    assert attention.layer_windows == (None,) * 32
    assert (attention.softcap, attention.sinks) == (0.0, False)
    assert attention.scale == pytest.approx(1 / math.sqrt(128))
    assert attention.name == str(CONFIGS / "llama-3.1-8b.json")


def test_mistral_slides_every_layer() -> None:
    attention = read_config_json(str(CONFIGS / "mistral-7b-v0.1.json"))
    assert (attention.heads, attention.kv_heads, attention.head_dim) == (32, 8, 128)
    assert attention.layer_windows == (4096,) * 32
    # A token sees the 4096 keys up to itself: 4095 before it (FlashAttention's bound).
    assert attention.window_left(0) == 4095


def test_qwen2_5_use_sliding_window_false_switches_the_window_off() -> None:
    attention = read_config_json(str(CONFIGS / "qwen2.5-7b.json"))
    assert (attention.heads, attention.kv_heads, attention.head_dim) == (28, 4, 128)
    assert attention.layer_windows == (None,) * 28


def test_qwen2_with_the_window_on_slides_from_max_window_layers() -> None:
    config = fixture("qwen2.5-7b") | {"use_sliding_window": True, "max_window_layers": 21}
    windows = layer_windows(config)
    assert windows == (None,) * 21 + (131072,) * 7


def test_gemma_2_alternates_from_layer_0_with_softcap_and_its_own_scale() -> None:
    attention = read_config_json(str(CONFIGS / "gemma-2-9b.json"))
    assert (attention.heads, attention.kv_heads, attention.head_dim) == (16, 8, 256)
    assert attention.layers == 42
    assert attention.sliding_layers == tuple(range(0, 42, 2))
    assert {attention.layer_windows[i] for i in range(1, 42, 2)} == {None}
    assert attention.softcap == 50.0
    assert attention.scale == 1 / 16  # 1/sqrt(query_pre_attn_scalar=256)


def test_gemma_2_27b_scale_is_not_head_dim_s() -> None:
    config = fixture("gemma-2-9b") | {
        "hidden_size": 4608,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "query_pre_attn_scalar": 144,
    }
    attention = attention_from_fields(config, "gemma-2-27b")
    assert attention.scale == pytest.approx(1 / 12)
    assert attention.scale != pytest.approx(1 / math.sqrt(attention.head_dim))


def test_gpt_oss_layer_types_and_sinks() -> None:
    attention = read_config_json(str(CONFIGS / "gpt-oss-20b.json"))
    assert (attention.heads, attention.kv_heads, attention.head_dim) == (64, 8, 64)
    assert attention.layer_windows == (128, None) * 12
    assert attention.sinks and attention.softcap == 0.0
    assert attention.scale == 1 / 8


def test_gemma_3_reads_text_config_and_its_pattern() -> None:
    attention = read_config_json(str(CONFIGS / "gemma-3-4b.json"))
    assert (attention.heads, attention.kv_heads, attention.head_dim) == (8, 4, 256)
    # Every sixth layer is global: 5, 11, 17, 23, 29.
    assert [i for i, w in enumerate(attention.layer_windows) if w is None] == [5, 11, 17, 23, 29]
    assert set(attention.layer_windows) == {1024, None}


def test_a_directory_holding_config_json_is_read(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((CONFIGS / "llama-3.1-8b.json").read_text())
    assert read_config_json(str(tmp_path)).head_dim == 128


# --- Absent fields take their documented defaults --------------------------------------------


def minimal(**fields: Any) -> dict[str, Any]:
    return {"num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 4} | fields


def test_absent_fields_take_their_defaults() -> None:
    attention = attention_from_fields(minimal(), "m")
    assert attention.kv_heads == 8  # num_key_value_heads: num_attention_heads (MHA)
    assert attention.head_dim == 64  # hidden_size / num_attention_heads
    assert attention.layer_windows == (None,) * 4  # no sliding_window: no layer slides
    assert attention.softcap == 0.0 and not attention.sinks
    assert attention.scale == 1 / 8  # query_pre_attn_scalar: head_dim


def test_null_is_absent() -> None:
    nulls = dict.fromkeys(
        ("num_key_value_heads", "head_dim", "sliding_window", "attn_logit_softcapping"), None
    )
    assert attention_from_fields(minimal(**nulls), "m") == attention_from_fields(minimal(), "m")


def test_layer_types_alone_give_the_layer_count() -> None:
    fields = minimal(sliding_window=64, layer_types=["full_attention", "sliding_attention"])
    del fields["num_hidden_layers"]
    assert attention_from_fields(fields, "m").layer_windows == (None, 64)


def test_language_model_fields_prefers_the_top_level() -> None:
    config = minimal(text_config={"num_attention_heads": 2})
    assert language_model_fields(config) is config


# --- Unusable fields: one line naming the field ----------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field", "why"),
    [
        ({"num_attention_heads": None}, "num_attention_heads", "is missing"),
        ({"num_attention_heads": 0}, "num_attention_heads", "must be an integer >= 1"),
        ({"num_attention_heads": "32"}, "num_attention_heads", "must be an integer >= 1"),
        ({"num_attention_heads": True}, "num_attention_heads", "must be an integer >= 1"),
        ({"num_attention_heads": 32.0}, "num_attention_heads", "must be an integer >= 1"),
        ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide num_attention_heads=8"),
        ({"hidden_size": 500}, "hidden_size", "must be a multiple of num_attention_heads=8"),
        ({"hidden_size": None}, "head_dim", "is missing, and so is hidden_size"),
        ({"num_hidden_layers": None}, "num_hidden_layers", "is missing"),
        ({"sliding_window": -1}, "sliding_window", "must be an integer >= 1"),
        ({"sliding_window": 0}, "sliding_window", "must be an integer >= 1"),
        ({"use_sliding_window": "yes"}, "use_sliding_window", "must be true or false"),
        ({"sliding_window": 8, "max_window_layers": -2}, "max_window_layers", ">= 0"),
        ({"layer_types": "sliding"}, "layer_types", "must be a non-empty list"),
        ({"layer_types": []}, "layer_types", "must be a non-empty list"),
        (
            {"layer_types": ["full_attention"] * 3},
            "layer_types",
            "must have one entry per layer (num_hidden_layers=4)",
        ),
        (
            {"layer_types": ["full_attention", "chunked_attention"] * 2},
            "layer_types[1]",
            "must be one of full_attention, sliding_attention",
        ),
        (
            {"layer_types": ["sliding_attention", "full_attention"] * 2},
            "layer_types[0]",
            "needs a sliding_window, which is null",
        ),
        ({"attn_logit_softcapping": -5}, "attn_logit_softcapping", "must be a number >= 0"),
        ({"attn_logit_softcapping": "50"}, "attn_logit_softcapping", "must be a number >= 0"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar", "must be a number > 0"),
        ({"model_type": 7}, "model_type", "must be a string"),
    ],
)
def test_unusable_fields_are_named(fields: dict[str, Any], field: str, why: str) -> None:
    with pytest.raises(ConfigFieldError) as caught:
        attention_from_fields(minimal(**fields), "m")
    assert caught.value.field == field
    assert why in caught.value.why


def file_error(tmp_path: Path, text: str | bytes) -> str:
    path = tmp_path / "config.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        read_config_json(str(path))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"model.config_json={path} is invalid: ")
    return message.removeprefix(f"model.config_json={path} is invalid: ")


def test_a_field_error_names_the_file_the_field_and_its_value(tmp_path: Path) -> None:
    config = fixture("llama-3.1-8b") | {"num_key_value_heads": 5}
    assert file_error(tmp_path, json.dumps(config)) == (
        "num_key_value_heads=5 must divide num_attention_heads=32"
    )
    config = fixture("mistral-7b-v0.1") | {"sliding_window": -4096}
    assert file_error(tmp_path, json.dumps(config)) == (
        "sliding_window=-4096 must be an integer >= 1"
    )
    config = fixture("llama-3.1-8b")
    del config["num_attention_heads"]
    assert file_error(tmp_path, json.dumps(config)) == "num_attention_heads is missing"


def test_a_text_config_field_is_named_as_such(tmp_path: Path) -> None:
    config = fixture("gemma-3-4b")
    config["text_config"]["sliding_window_pattern"] = 0
    assert file_error(tmp_path, json.dumps(config)) == (
        "text_config.sliding_window_pattern=0 must be an integer >= 1"
    )


def test_a_long_layer_types_list_is_shown_by_its_length(tmp_path: Path) -> None:
    config = fixture("gpt-oss-20b") | {"num_hidden_layers": 20}
    assert file_error(tmp_path, json.dumps(config)).startswith(
        "layer_types=[24 entries] must have one entry per layer (num_hidden_layers=20)"
    )


def test_unreadable_files(tmp_path: Path) -> None:
    file = tmp_path / "config.json"
    assert file_error(tmp_path, "{'heads': 32}").startswith(f"{file} is not JSON (Expecting")
    assert file_error(tmp_path, "[1, 2]") == (
        f"{file} holds a JSON list, not an object of config fields"
    )
    assert file_error(tmp_path, b"\xff\xfe{") == f"{file} is not UTF-8 text"
    assert file_error(tmp_path, "{}") == "num_attention_heads is missing"
    missing = tmp_path / "nowhere" / "config.json"
    with pytest.raises(ConfigError, match=r"^model\.config_json=.* is invalid: no such file "):
        read_config_json(str(missing))
    empty = tmp_path / "snapshot"
    empty.mkdir()
    with pytest.raises(ConfigError, match=f"no such file {empty}/config.json$"):
        read_config_json(str(empty))  # a directory: its config.json is meant
