"""A Hugging Face ``config.json`` file -> the model's ``ModelAttention``, or one error line.

``model.config_json=PATH`` names the file, or a directory holding ``config.json`` (a
downloaded model's snapshot). A file that is missing, unreadable, not JSON, not an
object, or has an unusable field is one ``ConfigError`` naming the file and the field
(``model.config_json=PATH is invalid: num_key_value_heads=5 must divide
num_attention_heads=32``). The fields are read by ``tuner.llm.hf_config``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tuner.config import format_value
from tuner.errors import ConfigError
from tuner.llm.attention import ModelAttention
from tuner.llm.hf_config import ConfigFieldError, attention_from_fields, language_model_fields

#: a list this long or longer is shown by its length in an error line
_LONG_LIST = 6


def read_config_json(path_text: str) -> ModelAttention:
    """The attention of the Hugging Face ``config.json`` at ``path_text`` (or in that
    directory); every problem with the file is one ``ConfigError`` naming it."""
    where = f"model.config_json={path_text}"
    path = Path(path_text).expanduser()
    file = path / "config.json" if path.is_dir() else path
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise ConfigError(f"{where} is invalid: no such file {file}") from error
    except UnicodeDecodeError as error:
        raise ConfigError(f"{where} is invalid: {file} is not UTF-8 text") from error
    except OSError as error:
        raise ConfigError(
            f"{where} is invalid: cannot read {file}: {error.strerror or error}"
        ) from error
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{where} is invalid: {file} is not JSON ({error.msg} at line {error.lineno} "
            f"column {error.colno})"
        ) from error
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where} is invalid: {file} holds a JSON {type(data).__name__}, not an object "
            "of config fields"
        )
    language_model = language_model_fields(data)
    prefix = "" if language_model is data else "text_config."
    try:
        return attention_from_fields(language_model, str(file))
    except ConfigFieldError as error:
        field = f"{prefix}{error.field}"
        described = (
            f"{field} {error.why}"
            if error.value is None
            else f"{field}={shown_value(error.value, json_text=True)} {error.why}"
        )
        raise ConfigError(f"{where} is invalid: {described}") from error


def shown_value(value: Any, *, json_text: bool = False) -> str:
    """A field's value in an error line: as JSON (``json_text``) or as an override
    would write it; a long list by its length."""
    if isinstance(value, list | tuple) and len(value) >= _LONG_LIST:
        return f"[{len(value)} entries]"
    return json.dumps(value) if json_text else format_value(value)
