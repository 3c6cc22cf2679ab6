"""Bad input at the real command line: one ``error:`` line, non-zero exit, nothing written.

Each case runs ``python -m tuner`` in its own temporary directory, with the
registry and the study pointed there, so anything the run wrongly created would
be found. The runs are started in parallel (each is a Python + Hydra start).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import tuner.__main__ as entry
from tuner.config import ValidatedConfig
from tuner.errors import RegistryError

CONF_DIR = Path(__file__).resolve().parents[1] / "tuner" / "conf"


@dataclass(frozen=True)
class Case:
    overrides: tuple[str, ...]
    #: text the error line must contain: the key and the value given
    names: str
    #: text saying what is allowed
    allowed: str
    #: shape keys the case leaves out instead of giving
    drop: tuple[str, ...] = ()


CASES = {
    "seq_len zero": Case(("seq_len=0",), "seq_len=0", "1..4294967295"),
    "seq_len negative": Case(("seq_len=-3",), "seq_len=-3", "1..4294967295"),
    "seq_len text": Case(("seq_len=abc",), "seq_len=abc", "1..4294967295"),
    "seq_len fraction": Case(("seq_len=1.5",), "seq_len=1.5", "1..4294967295"),
    "seq_len over u32": Case(("seq_len=4294967296",), "seq_len=4294967296", "1..4294967295"),
    "head_dim zero": Case(("head_dim=0",), "head_dim=0", "1..4294967295"),
    "dtype": Case(("dtype=int8",), "dtype=int8", "float32"),
    "unknown key": Case(("foo=1",), "foo=1", "allowed: seq_len, head_dim"),
    "unknown nested key": Case(("search.foo=1",), "search.foo=1", "allowed: sampler, n_trials"),
    "forced unknown key": Case(("+foo=1",), "foo=1", "allowed: seq_len, head_dim"),
    "unknown backend option": Case(("backend=cuda9",), "backend=cuda9", "auto, model, pycuda"),
    "missing seq_len": Case((), "seq_len is missing", "1..4294967295", drop=("seq_len",)),
    "causal": Case(("causal=maybe",), "causal=maybe", "true or false"),
    "batch zero": Case(("batch=0",), "batch=0", "1..4294967295"),
    "n_trials zero": Case(("search.n_trials=0",), "search.n_trials=0", ">= 1"),
    "n_trials negative": Case(("search.n_trials=-1",), "search.n_trials=-1", ">= 1"),
    "n_trials text": Case(("search.n_trials=abc",), "search.n_trials=abc", ">= 1"),
    "timeout negative": Case(("search.timeout_s=-5",), "search.timeout_s=-5", "> 0 or null"),
    "sampler": Case(("search.sampler=annealing",), "search.sampler=annealing", "model, tpe"),
    "backend name": Case(("backend.name=xyz",), "backend.name=xyz", "auto, pycuda, model"),
    "unknown device": Case(("device=a100",), "device=a100", "allowed: h200"),
    "nothing feasible": Case(("head_dim=4096",), "head_dim=4096", "no candidate plan"),
    "mode": Case(("mode=banana",), "mode=banana", "tune, plan"),
    "bad override syntax": Case(("seq_len=[1,",), "seq_len=[1,", "not a valid override"),
    "bad interpolation": Case(("seq_len=${nope}",), "seq_len=${nope}", "not found"),
    "list element": Case(("search.tile_sizes=[a]",), "search.tile_sizes=[a]", "integers >= 1"),
    "seq_len with a model": Case(
        ("model=llama-3.1-8b",),
        "seq_len=4096 is invalid with model=llama-3.1-8b",
        "leave seq_len out",
        drop=("head_dim",),
    ),
    "unknown model": Case(
        ("model=llama-4",), "model=llama-4", "llama-3.1-8b", drop=("seq_len", "head_dim")
    ),
    "model config_json missing": Case(
        ("model.config_json=/nowhere/config.json",),
        "model.config_json=/nowhere/config.json",
        "no such file",
        drop=("seq_len", "head_dim"),
    ),
    "model bucket": Case(
        ("model=llama-3.1-8b", "model.decode_batches=[0]"),
        "model.decode_batches=[0]",
        "integers >= 1",
        drop=("seq_len", "head_dim"),
    ),
    "bucket without a model": Case(
        ("model.prefill_lengths=[2048]",), "model.prefill_lengths=[2048]", "without a model"
    ),
}


def clean_env() -> dict[str, str]:
    env = dict(os.environ)
    # A developer's own HYDRA_FULL_ERROR=1 would (by design) bring tracebacks back.
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def run_cli(workdir: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    storage = (
        f"registry.url=sqlite:///{workdir}/r.sqlite",
        f"search.storage=sqlite:///{workdir}/s.sqlite",
    )
    return subprocess.run(
        [sys.executable, "-m", "tuner", *arguments, *storage],
        cwd=workdir,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def case_arguments(case: Case) -> list[str]:
    shape = {"seq_len": "4096", "head_dim": "128", "dtype": "float32"}
    for override in case.overrides:
        shape.pop(override.lstrip("+").partition("=")[0], None)
    for key in case.drop:
        shape.pop(key)
    return [f"{key}={value}" for key, value in shape.items()] + list(case.overrides)


@pytest.fixture(scope="module")
def results(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    workdirs = {name: tmp_path_factory.mktemp("cli") for name in CASES}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        futures = {
            name: pool.submit(run_cli, workdirs[name], *case_arguments(case))
            for name, case in CASES.items()
        }
        return {name: (workdirs[name], future.result()) for name, future in futures.items()}


def assert_nothing_stored(workdir: Path) -> None:
    assert not (workdir / "r.sqlite").exists()
    assert not (workdir / "s.sqlite").exists()
    assert not (workdir / "db").exists()
    assert not [p for p in workdir.rglob("*") if ".sqlite" in p.name or p.suffix == ".db"]


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_error_line(
    name: str, results: dict[str, tuple[Path, subprocess.CompletedProcess[str]]]
) -> None:
    case = CASES[name]
    workdir, result = results[name]
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    (line,) = lines
    assert line.startswith("error: ")
    assert case.names in line
    assert case.allowed in line
    assert "Traceback" not in result.stderr + result.stdout
    assert "HYDRA_FULL_ERROR" not in result.stderr
    assert_nothing_stored(workdir)


def test_multirun_sweep_keeps_going_past_a_bad_job(tmp_path: Path) -> None:
    result = run_cli(
        tmp_path,
        "-m",
        "mode=plan",
        "plan_rows=1",
        "seq_len=1024,abc,2048",
        "head_dim=64",
        "dtype=float32",
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: seq_len=abc is invalid: must be an integer in 1..4294967295"
    ]
    assert result.stdout.count("problem: ") == 2
    assert_nothing_stored(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no multirun/ directory either


def test_a_sweep_with_one_bad_value_leaves_no_multirun_directory(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "-m", "seq_len=1024,-5", "head_dim=64", "dtype=float32",
                     "mode=plan", "plan_rows=1")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: seq_len=-5 is invalid: must be an integer in 1..4294967295"
    ]
    assert list(tmp_path.iterdir()) == []


def test_multirun_sweep_of_good_shapes(tmp_path: Path) -> None:
    result = run_cli(
        tmp_path,
        "-m",
        "mode=plan",
        "plan_rows=1",
        "seq_len=64,128",
        "head_dim=32,64",
        "dtype=float32",
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.count("problem: ") == 4
    assert_nothing_stored(tmp_path)
    assert list(tmp_path.iterdir()) == []


# --- In-process: the entry's own handling, with a stand-in for tuner.app --------------------


@pytest.fixture
def fake_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[types.ModuleType]:
    module = types.ModuleType("tuner.app")
    monkeypatch.setitem(sys.modules, "tuner.app", module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    yield module


def run_main(monkeypatch: pytest.MonkeyPatch, *arguments: str) -> int:
    monkeypatch.setattr(sys, "argv", ["tuner", *arguments])
    return entry.main()


def test_tuner_error_from_the_app_is_one_line(
    fake_app: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(validated: ValidatedConfig, **_: object) -> int:
        raise RegistryError("registry sqlite:///x cannot be opened: disk I/O error")

    fake_app.run = run  # type: ignore[attr-defined]
    assert run_main(monkeypatch, "seq_len=256", "head_dim=64", "dtype=float32") == 1
    assert capsys.readouterr().err == (
        "error: registry sqlite:///x cannot be opened: disk I/O error\n"
    )
    assert "HYDRA_FULL_ERROR" not in os.environ


def test_exit_status_is_the_app_s(
    fake_app: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[ValidatedConfig] = []

    def run(validated: ValidatedConfig, **_: object) -> int:
        seen.append(validated)
        return 3

    fake_app.run = run  # type: ignore[attr-defined]
    assert run_main(monkeypatch, "seq_len=256", "head_dim=64", "dtype=float32", "batch=2") == 3
    (validated,) = seen
    assert validated.problem.batch == 2 and validated.config.mode == "tune"


def test_a_bug_keeps_its_traceback(
    fake_app: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(validated: ValidatedConfig, **_: object) -> int:
        raise RuntimeError("a bug")

    fake_app.run = run  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="a bug"):
        run_main(monkeypatch, "seq_len=256", "head_dim=64", "dtype=float32")


def test_user_s_hydra_full_error_brings_tracebacks_back(
    fake_app: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(Exception, match="Could not override 'foo'"):
        run_main(monkeypatch, "seq_len=256", "head_dim=64", "dtype=float32", "foo=1")
    assert os.environ["HYDRA_FULL_ERROR"] == "1"


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["foo=1"], "foo=1 is invalid: no such key; allowed: seq_len, head_dim,"),
        (["search.n_trials=1.5"], "search.n_trials=1.5 is invalid: must be an integer >= 1"),
        (["backend.flush_l2=maybe"], "backend.flush_l2=maybe is invalid: must be true or false"),
        (["search.stop=maybe"], "search.stop=maybe is invalid: must be true or false"),
        (
            ["search.stop_probability=x"],
            "search.stop_probability=x is invalid: must be a number > 0 and < 1",
        ),
        (
            ["serach.n_trials=5"],
            "serach.n_trials=5 is invalid: no such key (did you mean search.n_trials?); allowed:",
        ),
        (
            ["search.n_trails=5"],
            "search.n_trails=5 is invalid: search has no key 'n_trails' "
            "(did you mean search.n_trials?); allowed: sampler,",
        ),
        (["seqlen=5"], "seqlen=5 is invalid: no such key (did you mean seq_len?)"),
        (["search=annealing"], "search=annealing is invalid: no such search option; allowed:"),
        (["device=a100"], "device=a100 is invalid: no such device option; allowed: h200"),
    ],
)
def test_composition_errors_are_described_in_one_line(overrides: list[str], line: str) -> None:
    with (
        initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"),
        pytest.raises(Exception) as caught,
    ):
        compose(config_name="config", overrides=overrides)
    message = entry.describe_composition_error(caught.value, overrides)
    assert message.startswith(line)
    assert "\n" not in message
    assert "base_" not in message


def test_help_lists_only_the_options_a_user_can_pick() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tuner", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "search: default, grid, random" in done.stdout
    assert "backend: auto, model, pycuda, replay" in done.stdout
    assert "base_" not in done.stdout
