"""The composed configuration: defaults, group options, typing and validation, in-process."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import DictConfig

from tuner.config import (
    BACKENDS,
    RULES,
    SAMPLERS,
    SECTIONS,
    BackendConfig,
    DeviceConfig,
    RegistryConfig,
    SearchConfig,
    TunerConfig,
    ValidatedConfig,
    device_profile_from,
    format_value,
    problem_from,
    rejection_summary,
    space_axes_from,
    typed_config,
    validate,
)
from tuner.device import H200
from tuner.errors import ConfigError
from tuner.planner.fixed_width import U32_MAX
from tuner.planner.space import SpaceAxes, candidate_space
from tuner.problem import Problem

CONF_DIR = Path(__file__).resolve().parents[1] / "tuner" / "conf"
SHAPE = ("seq_len=4096", "head_dim=128")


@pytest.fixture(scope="module", autouse=True)
def hydra_conf_dir() -> Iterator[None]:
    # Initialised once: each compose then costs milliseconds, not a Hydra start.
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def compose_config(*overrides: str) -> DictConfig:
    # The float32 families are what these tests plan for (the default dtype is bfloat16).
    if not any(o.startswith("dtype=") for o in overrides):
        overrides = ("dtype=float32", *overrides)
    return compose(config_name="config", overrides=list(overrides))


def load(*overrides: str) -> TunerConfig:
    return typed_config(compose_config(*overrides))


def group_options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


# --- Composition ------------------------------------------------------------------------------


def test_defaults_compose_to_the_schema_defaults() -> None:
    config = typed_config(compose(config_name="config", overrides=list(SHAPE)))
    assert isinstance(config, TunerConfig)
    assert (config.seq_len, config.head_dim) == (4096, 128)
    assert (config.batch, config.heads, config.causal, config.dtype) == (1, 1, False, "bfloat16")
    assert (config.mode, config.plan_rows) == ("tune", 20)
    assert config.search == SearchConfig()
    assert config.backend == BackendConfig()
    assert config.registry == RegistryConfig(url=None)  # validate() resolves the data directory
    assert config.device == DeviceConfig()


def test_to_object_gives_typed_sections_not_dictconfigs() -> None:
    config = load(*SHAPE, "search.tile_sizes=[32]")
    assert isinstance(config.search, SearchConfig)
    assert isinstance(config.backend, BackendConfig)
    assert isinstance(config.registry, RegistryConfig)
    assert isinstance(config.device, DeviceConfig)
    assert type(config.search.tile_sizes) is list
    assert type(config.device.compute_capability) is list


def test_mandatory_shape_is_missing_until_given() -> None:
    cfg = compose_config()
    assert cfg.batch == 1
    with pytest.raises(ConfigError, match=r"^seq_len is missing: give seq_len=<an integer"):
        typed_config(cfg)
    with pytest.raises(ConfigError, match=r"^head_dim is missing"):
        typed_config(compose_config("seq_len=64"))


@pytest.mark.parametrize(
    ("option", "sampler"),
    [("default", "model"), ("tpe", "tpe"), ("random", "random"), ("grid", "grid")],
)
def test_search_option_selects_sampler(option: str, sampler: str) -> None:
    assert load(*SHAPE, f"search={option}").search.sampler == sampler


def test_sampler_is_also_a_plain_override() -> None:
    assert load(*SHAPE, "search.sampler=random").search.sampler == "random"


def test_search_options_cover_every_sampler() -> None:
    samplers = {
        load(*SHAPE, f"search={option}").search.sampler
        for option in ["default", "tpe", "random", "grid"]
    }
    assert samplers == set(SAMPLERS)
    assert group_options("search") == ["default", "grid", "random", "tpe"]


@pytest.mark.parametrize("option", BACKENDS)
def test_backend_option_names_itself(option: str) -> None:
    assert load(*SHAPE, f"backend={option}").backend.name == option


def test_backend_options_are_the_known_backends() -> None:
    assert group_options("backend") == sorted(BACKENDS)


def test_registry_and_device_options() -> None:
    assert group_options("registry") == ["sqlite"]
    assert group_options("device") == ["h200"]
    assert load(*SHAPE, "registry.url=sqlite:////tmp/x.sqlite").registry.url == (
        "sqlite:////tmp/x.sqlite"
    )


def test_h200_yaml_schema_default_and_profile_agree() -> None:
    assert device_profile_from(load(*SHAPE, "device=h200").device) == H200
    assert device_profile_from(DeviceConfig()) == H200


def test_nested_overrides_are_typed_by_the_schema() -> None:
    config = load(*SHAPE, "search.n_trials=7", "search.timeout_s=30", "backend.flush_l2=false")
    assert config.search.n_trials == 7
    assert config.search.timeout_s == 30.0 and isinstance(config.search.timeout_s, float)
    assert config.backend.flush_l2 is False


def test_interpolation_resolves_once() -> None:
    config = load("seq_len=${head_dim}", "head_dim=64")
    assert config.seq_len == 64


def test_forced_unknown_key_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^foo=1 is invalid: no such key; allowed: seq_len"):
        load(*SHAPE, "+foo=1")
    with pytest.raises(ConfigError, match=r"^search\.bar=x is invalid: search has no key 'bar'"):
        load(*SHAPE, "+search.bar=x")


def test_unresolvable_interpolation_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^seq_len=\$\{nope\} is invalid: Interpolation key"):
        load("seq_len=${nope}", "head_dim=128")


def test_every_schema_field_has_a_rule_and_every_rule_a_field() -> None:
    keys = set()
    for f in fields(TunerConfig):
        if f.name in SECTIONS:
            section = SECTIONS[f.name]
            assert is_dataclass(section)
            keys |= {f"{f.name}.{g.name}" for g in fields(section)}
        else:
            keys.add(f.name)
    assert keys == set(RULES)


# --- Validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("mode=plan",),
        ("seq_len=1024", "head_dim=64", "batch=2", "heads=8", "causal=true"),
        ("seq_len=4096", "head_dim=3"),
        ("search=random", "search.n_trials=1", "search.timeout_s=0.5", "search.seed=4294967295"),
        ("search.families=[tiled]", "search.tile_sizes=[32]", "search.split_targets=[4]"),
        ("search.storage=postgresql+psycopg://u@db/studies", "search.study_name=x"),
        ("search.stop=false", "search.stop_margin=0", "search.stop_probability=0.5"),
        ("search.min_trials=50", "search.n_trials=10"),  # the cap wins; not an error
        ("backend=replay", "backend.replay_path=bench/h200.json"),
        ("backend=model", "backend.repetitions=1", "backend.warmup=0", "backend.compile_jobs=0"),
        ("registry.url=sqlite:////tmp/plans.sqlite", "plan_rows=0"),
        ("device.sm_count=66",),
    ],
)
def test_validate_accepts(overrides: tuple[str, ...]) -> None:
    validated = validate(load(*SHAPE, *overrides))
    assert isinstance(validated, ValidatedConfig)
    config = validated.config
    assert validated.problem == Problem(
        config.seq_len, config.head_dim, config.batch, config.heads, config.causal, config.dtype
    )
    assert validated.device.sm_count == config.device.sm_count


@pytest.mark.parametrize(
    ("override", "named", "allowed"),
    [
        ("seq_len=0", "seq_len=0", "an integer in 1..4294967295"),
        ("seq_len=-3", "seq_len=-3", "an integer in 1..4294967295"),
        ("seq_len=abc", "seq_len=abc", "an integer in 1..4294967295"),
        ("seq_len=1.5", "seq_len=1.5", "an integer in 1..4294967295"),
        ("seq_len=true", "seq_len=true", "an integer in 1..4294967295"),
        ("seq_len=4294967296", "seq_len=4294967296", "an integer in 1..4294967295"),
        ("seq_len=null", "seq_len=null", "an integer"),
        ("head_dim=0", "head_dim=0", "an integer in 1..4294967295"),
        ("batch=0", "batch=0", "an integer in 1..4294967295"),
        ("heads=[1]", "heads=[1]", "an integer in 1..4294967295"),
        ("causal=maybe", "causal=maybe", "true or false"),
        ("causal=1", "causal=1", "true or false"),
        ("dtype=int8", "dtype=int8", "one of bfloat16, float16, float32"),
        ("mode=banana", "mode=banana", "one of tune, plan"),
        ("plan_rows=-1", "plan_rows=-1", "an integer >= 0"),
        ("search.sampler=annealing", "search.sampler=annealing", "one of model, tpe, random, grid"),
        ("search.n_trials=0", "search.n_trials=0", "an integer >= 1"),
        ("search.n_trials=-1", "search.n_trials=-1", "an integer >= 1"),
        ("search.stop_margin=-0.1", "search.stop_margin=-0.1", "a number >= 0 and < 1"),
        ("search.stop_margin=1", "search.stop_margin=1", "a number >= 0 and < 1"),
        ("search.stop_probability=0", "search.stop_probability=0", "a number > 0 and < 1"),
        ("search.stop_probability=1", "search.stop_probability=1", "a number > 0 and < 1"),
        ("search.min_trials=0", "search.min_trials=0", "an integer >= 1"),
        ("search.timeout_s=-5", "search.timeout_s=-5", "a number > 0 or null"),
        ("search.timeout_s=0", "search.timeout_s=0", "a number > 0 or null"),
        ("search.seed=-1", "search.seed=-1", "an integer in 0..4294967295"),
        ("search.storage=nonsense", "search.storage=nonsense", "a SQLAlchemy URL"),
        ("search.study_name=''", "search.study_name=''", "a non-empty string or null"),
        ("search.enqueue_top=-1", "search.enqueue_top=-1", "an integer >= 0"),
        ("search.traffic_cutoff=0.5", "search.traffic_cutoff=0.5", "a number >= 1"),
        ("search.trial_timeout_s=0", "search.trial_timeout_s=0", "a number > 0"),
        ("search.families=[fast]", "search.families=[fast]", "scalar_online, tiled"),
        ("search.families=[]", "search.families=[]", "a non-empty list"),
        ("search.tile_sizes=[0]", "search.tile_sizes=[0]", "integers >= 1"),
        ("+search.axes.wgmma_f16_overlap=[-1]", "search.axes={'wgmma_f16_overlap': [-1]}",
         "lists of integers >= 0"),
        ("search.split_targets=[]", "search.split_targets=[]", "a non-empty list"),
        ("backend.name=xyz", "backend.name=xyz", "one of auto, pycuda, model, replay"),
        ("backend=replay", "backend.replay_path=null", "backend.replay_path=<file>"),
        ("backend.repetitions=0", "backend.repetitions=0", "an integer >= 1"),
        ("backend.warmup=-1", "backend.warmup=-1", "an integer >= 0"),
        ("backend.cache_dir=''", "backend.cache_dir=''", "a non-empty string"),
        ("registry.url=notaurl", "registry.url=notaurl", "a SQLAlchemy URL"),
        ("device.sm_count=0", "device.sm_count=0", "an integer >= 1"),
        ("device.clock_ghz=0", "device.clock_ghz=0", "a number > 0"),
        ("device.compute_capability=[9]", "device.compute_capability=[9]", "two integers"),
        ("device.name=''", "device.name=''", "a non-empty string"),
        ("head_dim=4096", "head_dim=4096", "no candidate plan is feasible"),
        (
            "seq_len=4294967295",
            "batch*heads*seq_len*head_dim=1*1*4294967295*128",
            "at most 4294967295 elements",
        ),
        ("head_dim=3 search.families=[tiled]", "head_dim=3", "no candidate plan is feasible"),
    ],
)
def test_validate_refuses(override: str, named: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as caught:
        validate(load(*SHAPE, *override.split()))
    message = str(caught.value)
    assert "\n" not in message
    # The key=value as a whole word: seq_len=1 must not pass for seq_len=1.5.
    assert re.search(rf"(^| ){re.escape(named)}( |$)", message), message
    assert allowed in message


def test_no_feasible_plan_gives_the_commonest_reason() -> None:
    with pytest.raises(ConfigError, match=r"all \d+ rejected; most often: shared memory \d+ B"):
        validate(load("seq_len=4096", "head_dim=4096"))


@given(st.integers(min_value=-(2**40), max_value=2**40))
def test_seq_len_range_is_exactly_u32(seq_len: int) -> None:
    config = TunerConfig(seq_len=seq_len, head_dim=1)
    if 1 <= seq_len <= U32_MAX:
        assert problem_from(config).seq_len == seq_len
    else:
        with pytest.raises(ConfigError, match=rf"^seq_len={seq_len} is invalid"):
            problem_from(config)


def test_problem_from_copies_the_shape() -> None:
    config = TunerConfig(seq_len=7, head_dim=32, batch=2, heads=3, causal=True)
    assert problem_from(config) == Problem(7, 32, 2, 3, True, "bfloat16")


def test_space_axes_from_search_settings() -> None:
    axes = space_axes_from(SearchConfig())
    assert axes == SpaceAxes()
    narrowed = space_axes_from(SearchConfig(families=["tiled"], tile_sizes=[64]))
    assert narrowed.families == ("tiled",) and narrowed.tile_sizes == (64,)


def test_a_switch_narrowed_to_zero_leaves_its_mechanism_out_of_the_space() -> None:
    # the Hopper ping-pong and staged epilogue are 0/1 switches: [0] is a valid narrowing
    search = SearchConfig(axes={"wgmma_f16_pingpong": [0], "wgmma_f16_staged_store": [0]})
    problem = Problem(4096, 128, batch=4, heads=16, dtype="bfloat16")
    keys = [plan.key() for plan in candidate_space(problem, H200, space_axes_from(search)).feasible]
    wide = [plan.key() for plan in candidate_space(problem, H200).feasible]
    assert keys and not any("/p1" in key or "/ss" in key for key in keys)
    assert any("/p1" in key for key in wide) and any("/ss" in key for key in wide)


def test_rejection_summary_accounts_for_every_rejected_plan() -> None:
    space = candidate_space(Problem(4096, 128), H200)
    summary = rejection_summary(space)
    assert sum(kind.count for kind in summary) == len(space.rejected)
    assert [kind.count for kind in summary] == sorted((k.count for k in summary), reverse=True)
    reasons = {plan.reason for plan in space.rejected}
    assert all(kind.example in reasons for kind in summary)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (True, "true"),
        (None, "null"),
        ("", "''"),
        ("abc", "abc"),
        ([1, "a"], "[1, a]"),
        (1.5, "1.5"),
    ],
)
def test_format_value_writes_command_line_syntax(value: object, text: str) -> None:
    assert format_value(value) == text
