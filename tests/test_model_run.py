"""``python -m tuner model=...`` end to end on the cost model (no GPU): every problem
tuned in one run, one table, each best plan in the registry, a rerun that tunes nothing
again, skipped problems listed with their reason; in-process and at the command line.

Each test has its own registry and study storage under tmp_path, read back through
their own APIs. The buckets are small overrides, so each run takes seconds.
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from hydra import compose, initialize_config_dir
from interrupted_tuner import interrupt_tuner

from db import PlanRegistry
from tuner.config import typed_config
from tuner.llm.run import run_model
from tuner.llm.validation import validate_model
from tuner.problem import Problem

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "tuner" / "conf"
CONFIGS = ROOT / "tests" / "data" / "hf_configs"
#: Llama 3.1 8B at one small prefill and one small decode bucket
LLAMA = [
    "model=llama-3.1-8b",
    "backend=model",
    "model.prefill_lengths=[512]",
    "model.decode_batches=[2]",
    "model.decode_kv_lengths=[1024]",
]
LLAMA_PROBLEMS = [
    Problem(512, 128, heads=32, kv_heads=8, causal=True, dtype="bfloat16"),
    Problem(1, 128, batch=2, heads=32, kv_heads=8, kv_len=1024, causal=True, dtype="bfloat16"),
]


def urls(tmp_path: Path) -> list[str]:
    return [
        f"registry.url=sqlite:///{tmp_path / 'r.sqlite'}",
        f"search.storage=sqlite:///{tmp_path / 's.sqlite'}",
    ]


def counted_trials(tmp_path: Path) -> dict[str, int]:
    """Trials the backend evaluated, per study."""
    storage = f"sqlite:///{tmp_path / 's.sqlite'}"
    return {
        name: sum(
            1
            for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
            if t.user_attrs.get("outcome") in ("measured", "failed")
        )
        for name in optuna.get_all_study_names(storage)
    }


def registry_history(tmp_path: Path) -> list:
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'r.sqlite'}", readonly=True) as registry:
        return registry.history(limit=None)


@pytest.fixture(scope="module")
def hydra_conf() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def run_in_process(tmp_path: Path, *overrides: str) -> tuple[int, str, str]:
    """(exit status, stdout, the progress display) of a model run."""
    config = typed_config(compose(config_name="config", overrides=[*overrides, *urls(tmp_path)]))
    out, progress = io.StringIO(), io.StringIO()
    status = run_model(validate_model(config), out=out, stream=progress)
    return status, out.getvalue(), progress.getvalue()


def table_rows(output: str) -> list[list[str]]:
    """The summary table's rows, split on its column gaps."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#  problem"))
    rows = []
    for line in lines[start + 2 :]:
        if not line[:1].isdigit():
            break
        rows.append(line.split("  ") and [cell for cell in line.split("  ") if cell.strip()])
    return [[cell.strip() for cell in row] for row in rows]


# ---------------------------------------------------------------- in-process


def test_a_model_run_tunes_every_problem_and_stores_each_best(tmp_path, hydra_conf):
    status, output, progress = run_in_process(tmp_path, *LLAMA, "search.n_trials=4")
    assert status == 0, output
    lines = output.splitlines()
    assert lines[0] == "backend: model (asked for) - results are predictions, stored as predicted"
    assert lines[1] == (
        "model: llama-3.1-8b: 32 layers, 32 query heads on 8 KV heads, head_dim 128"
    )
    assert lines[2].startswith("softmax scale 0.0883883 = 1/sqrt(128): run-time data")
    assert lines[3].startswith(
        "problems: 2 distinct from 2 buckets x 32 layers (bfloat16), 2 to tune with "
        "search.n_trials=4 each, 0 skipped; studies in sqlite:///"
    )
    assert lines[4] == (
        "problem 1/2: 1x32/8x512x128 bfloat16 causal (prefill 1x512, layers all 32): new study"
    )
    assert lines[5] == (
        "problem 2/2: 2x32/8x1:1024x128 bfloat16 causal (decode 2x1024, layers all 32): new study"
    )
    # One display over both problems: a line per problem off a terminal.
    assert progress.splitlines()[0].startswith("problem 1/2: trials 4/4, best ")
    assert progress.splitlines()[1].startswith("problem 2/2: trials 4/4, best ")
    assert sorted(counted_trials(tmp_path).values()) == [4, 4]

    rows = table_rows(output)
    assert [row[:5] for row in rows] == [
        ["1", "1x32/8x512x128", "prefill 1x512", "all 32", "none"],
        ["2", "2x32/8x1:1024x128", "decode 2x1024", "all 32", "none"],
    ]
    assert output.splitlines()[-1].startswith(
        "registry: the best plans of 2 problems (predicted) in sqlite:///"
    )
    assert output.splitlines()[-1].endswith("for model: 2 new")
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'r.sqlite'}", readonly=True) as registry:
        stored = [registry.best(problem) for problem in LLAMA_PROBLEMS]
    for row, best in zip(rows, stored, strict=True):
        assert best is not None and not best.record.measured
        assert best.environment.gpu_name == "model"
        record = best.record
        assert row[6] == f"{record.median_ms:.4f}"  # the table's time is the stored plan's
        assert record.study_name in counted_trials(tmp_path)
    prefill, decode = rows
    # TFLOP/s for the prefill, TB/s of K and V for the decode.
    seconds = stored[0].record.median_ms * 1e-3
    assert prefill[7] == f"{LLAMA_PROBLEMS[0].useful_flops / seconds / 1e12:.1f}"
    assert prefill[8] == "-" and decode[7] == "-"
    kv_bytes = 2 * LLAMA_PROBLEMS[1].kv_tensor_bytes
    assert decode[8] == f"{kv_bytes / (stored[1].record.median_ms * 1e-3) / 1e12:.2f}"
    # The zero-trial pick is what the search measured first: on the cost model, the best.
    assert prefill[9] == prefill[6] and prefill[10] == "1.00"


def test_a_rerun_tunes_nothing_again_and_stores_nothing_twice(tmp_path, hydra_conf):
    _, first, _ = run_in_process(tmp_path, *LLAMA, "search.n_trials=4")
    trials, history = counted_trials(tmp_path), registry_history(tmp_path)
    started = time.monotonic()
    status, again, progress = run_in_process(tmp_path, *LLAMA, "search.n_trials=4")
    assert status == 0 and time.monotonic() - started < 30
    assert counted_trials(tmp_path) == trials
    assert len(registry_history(tmp_path)) == len(history) == 2
    assert "problem 1/2: 1x32/8x512x128 bfloat16 causal (prefill 1x512, layers all 32): " in again
    assert again.count("tuned before (4 trials)") == 2
    assert progress == ""  # nothing was searched
    assert table_rows(again) == table_rows(first)
    assert again.splitlines()[-1].endswith(": 2 already stored")
    # More trials continue each study where it stopped.
    status, more, _ = run_in_process(tmp_path, *LLAMA, "search.n_trials=6")
    assert status == 0 and more.count("continuing (4 of 6 trials done)") == 2
    assert sorted(counted_trials(tmp_path).values()) == [6, 6]


def test_problems_the_planner_cannot_serve_are_listed_with_the_reason(tmp_path, hydra_conf):
    status, output, _ = run_in_process(
        tmp_path, *LLAMA, "model.prefill_lengths=[1048576]", "search.n_trials=2"
    )
    assert status == 0
    assert "1 to tune with search.n_trials=2 each, 1 skipped" in output
    (skipped,) = [line for line in output.splitlines() if line.startswith("skipped: ")]
    assert skipped.startswith(
        "skipped: 1x32/8x1048576x128 bfloat16 causal (prefill 1x1048576; layers all 32): "
        "cannot be planned: "
    )
    assert "overflows u32" in skipped
    assert [row[2] for row in table_rows(output)] == ["decode 2x1024"]
    assert output.splitlines()[-1].endswith(": 1 new")


def test_variant_problems_are_tuned_apart(tmp_path, hydra_conf):
    status, output, _ = run_in_process(
        tmp_path,
        "model=gemma-2-9b",
        "backend=model",
        "model.prefill_lengths=[8192]",
        "model.decode_batches=[]",
        "search.n_trials=2",
    )
    assert status == 0, output
    assert "softmax scale 0.0625 = 1/sqrt(256)" in output
    rows = table_rows(output)
    assert [row[2:5] for row in rows] == [
        ["prefill 1x8192", "even (21)", "window 4096, softcap 50"],
        ["prefill 1x8192", "odd (21)", "softcap 50"],
    ]
    names = sorted(counted_trials(tmp_path))
    assert len(names) == 2
    assert names[0].startswith("1x16kv8x8192x256-bfloat16-causal-cap50@model-")
    assert names[1].startswith("1x16kv8x8192x256-bfloat16-causal-w4095-cap50@model-")


def test_a_config_json_model_run(tmp_path, hydra_conf):
    status, output, _ = run_in_process(
        tmp_path,
        f"model.config_json={CONFIGS / 'gpt-oss-20b.json'}",
        "backend=model",
        "model.prefill_lengths=[]",
        "model.decode_batches=[1]",
        "model.decode_kv_lengths=[4096]",
        "search.n_trials=2",
    )
    assert status == 0, output
    assert output.splitlines()[1].startswith(f"model: {CONFIGS / 'gpt-oss-20b.json'}: 24 layers")
    assert [row[2:5] for row in table_rows(output)] == [
        ["decode 1x4096", "even (12)", "window 128, sinks"],
        ["decode 1x4096", "odd (12)", "sinks"],
    ]


GQA_PREFILL_RECORDING = (
    ROOT / "bench" / "data" / "h200_mma_f16_wgmma_f16_2x32-8x4096x128c_bf16.json"
)


@pytest.mark.skipif(not GQA_PREFILL_RECORDING.exists(), reason="no H200 recording in bench/data")
def test_a_replay_serves_the_problems_it_recorded_and_skips_the_others(tmp_path, hydra_conf):
    status, output, _ = run_in_process(
        tmp_path,
        "model=llama-3.1-8b",
        "backend=replay",
        f"backend.replay_path={GQA_PREFILL_RECORDING}",
        "model.prefill_lengths=[4096,1024]",
        "model.prefill_batch=2",
        "model.decode_batches=[]",
        "search.n_trials=6",
    )
    assert status == 0, output
    assert [row[1] for row in table_rows(output)] == ["2x32/8x4096x128"]
    (skipped,) = [line for line in output.splitlines() if line.startswith("skipped: ")]
    assert skipped.startswith(
        "skipped: 2x32/8x1024x128 bfloat16 causal (prefill 2x1024; layers all 32): replay file "
    )
    assert "has no recording of 2x32/8x1024x128 bfloat16 causal" in skipped
    assert "(replayed, stored as predicted)" in output.splitlines()[-1]
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'r.sqlite'}", readonly=True) as registry:
        best = registry.best(
            Problem(4096, 128, batch=2, heads=32, kv_heads=8, causal=True, dtype="bfloat16")
        )
    assert best is not None and not best.record.measured
    assert best.environment.gpu_name == "NVIDIA H200"


@pytest.mark.skipif(not GQA_PREFILL_RECORDING.exists(), reason="no H200 recording in bench/data")
def test_a_replay_that_holds_none_of_the_problems_fails_the_run(tmp_path, hydra_conf):
    status, output, _ = run_in_process(
        tmp_path,
        *LLAMA,
        "backend=replay",
        f"backend.replay_path={GQA_PREFILL_RECORDING}",
    )
    assert status == 1
    assert "0 to tune with search.n_trials=40 each, 2 skipped" in output
    assert len([line for line in output.splitlines() if line.startswith("skipped: ")]) == 2
    assert "no problem was tuned" in output
    assert output.splitlines()[-1] == "registry: nothing stored (no problem produced a time)"
    assert not (tmp_path / "r.sqlite").exists()


def test_workers_share_each_problem_s_study(tmp_path, hydra_conf):
    status, output, _ = run_in_process(tmp_path, *LLAMA, "workers=2", "search.n_trials=4")
    assert status == 0, output
    assert output.count("workers: 2 processes share the study") == 1
    assert sorted(counted_trials(tmp_path).values()) == [4, 4]
    assert output.splitlines()[-1].endswith(": 2 new")


# ---------------------------------------------------------------- the CLI


def tuner_cli(tmp_path: Path, *overrides: str, **popen) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tuner", *overrides, f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        **popen,
    )


def test_cli_model_run_then_plan_mode(tmp_path):
    done = tuner_cli(tmp_path, *LLAMA, "search.n_trials=3", *urls(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "#  problem" in done.stdout and "registry: the best plans of 2 problems" in done.stdout
    log = (tmp_path / "run" / "tuner.log").read_text()
    assert "best plan per problem, predicted for model (2 tuned, 0 skipped; bfloat16" in log
    plan = tuner_cli(
        tmp_path, "model=gemma-2-9b", "mode=plan", "model.decode_batches=[]", *urls(tmp_path)
    )
    assert plan.returncode == 0, plan.stderr
    assert "problems: 4 distinct from 3 buckets x 42 layers (bfloat16): 4 to tune" in plan.stdout
    assert "1x16/8x8192x256  prefill 1x8192  even (21)  window 4096, softcap 50" in plan.stdout
    # Plan mode tunes and stores nothing.
    assert sorted(counted_trials(tmp_path).values()) == [3, 3]
    assert len(registry_history(tmp_path)) == 2


def test_cli_plan_mode_lists_the_skip_reasons(tmp_path):
    plan = tuner_cli(tmp_path, "model=llama-3.1-8b", "mode=plan", "search.families=[tiled]")
    assert plan.returncode == 0, plan.stderr
    skipped = [line for line in plan.stdout.splitlines() if line.startswith("skipped: ")]
    assert len(skipped) == 9
    assert all("no feasible candidate on NVIDIA H200" in line for line in skipped)
    assert "0 to tune, 9 skipped" in plan.stdout


def test_cli_ctrl_c_stores_the_best_so_far_and_the_rerun_goes_on(tmp_path):
    overrides = [
        "model=llama-3.1-8b",
        "backend=model",
        "model.prefill_lengths=[4096]",
        "model.decode_batches=[1]",
        "model.decode_kv_lengths=[2048]",
        *urls(tmp_path),
    ]
    done = interrupt_tuner(
        [*overrides, "search.n_trials=300", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
        tmp_path / "s.sqlite",
        signal.SIGINT,
    )
    stdout, stderr = done.stdout, done.stderr
    assert done.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "not reached: 1 of the problems (rerun the command to continue)" in stdout
    assert len(table_rows(stdout)) == 1
    (done,) = counted_trials(tmp_path).values()
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'r.sqlite'}", readonly=True) as registry:
        assert (
            registry.best(Problem(4096, 128, heads=32, kv_heads=8, causal=True, dtype="bfloat16"))
            is not None
        )
    rerun = tuner_cli(tmp_path, *overrides, f"search.n_trials={done + 2}")
    assert rerun.returncode == 0, rerun.stderr
    assert f"continuing ({done} of {done + 2} trials done)" in rerun.stdout
    assert "problem 2/2: 1x32/8x1:2048x128 bfloat16 causal" in rerun.stdout
    assert sorted(counted_trials(tmp_path).values()) == [done + 2, done + 2]
