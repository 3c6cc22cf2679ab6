"""A tune run of a variant problem names the variants wherever it names the problem: the study,
the registry line, the stored row and the plots' titles (the model backend; no GPU)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from db import PlanRegistry
from tuner import plots
from tuner.app import run
from tuner.config import typed_config, validate
from tuner.problem import Problem

CONF_DIR = Path(__file__).resolve().parents[1] / "tuner" / "conf"
LABEL = "1x8/2x1024x64 bfloat16 causal window=128 softcap=30 alibi sinks"


@pytest.fixture(scope="module")
def hydra_conf() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def test_a_variant_run_names_its_variants(
    tmp_path: Path, hydra_conf: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    titles: list[str] = []
    history = plots.history_figure

    def titled(result: Any, title: str) -> Any:
        figure = history(result, title)
        titles.append(figure.axes[0].get_title())
        return figure

    monkeypatch.setattr(plots, "history_figure", titled)
    overrides = [
        "seq_len=1024", "head_dim=64", "heads=8", "kv_heads=2", "causal=true",
        "window_left=128", "softcap=30", "alibi=true", "sinks=true",
        "backend=model", "search.n_trials=3",
        f"registry.url=sqlite:///{tmp_path / 'r.sqlite'}",
        f"search.storage=sqlite:///{tmp_path / 's.sqlite'}",
    ]
    out = io.StringIO()
    config = validate(typed_config(compose(config_name="config", overrides=overrides)))
    assert run(config, output_dir=tmp_path / "run", out=out) == 0
    output = out.getvalue()
    assert "study: 1x8kv2x1024x64-bfloat16-causal-w128-cap30-alibi-sinks@model-" in output
    assert f"stored in sqlite:///{tmp_path / 'r.sqlite'} for {LABEL} on model" in output
    problem = Problem(
        1024, 64, heads=8, kv_heads=2, causal=True, dtype="bfloat16", window_left=128,
        softcap=30.0, alibi=True, sinks=True,
    )
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'r.sqlite'}", readonly=True) as registry:
        (best,) = registry.list_best()
        assert best.problem == problem and best.problem.label() == LABEL
        assert registry.best(Problem(1024, 64, heads=8, kv_heads=2, causal=True,
                                     dtype="bfloat16")) is None
    assert titles == [f"search history: {LABEL}"]
