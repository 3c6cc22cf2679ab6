"""Serving buckets as problems: page_size and the length distribution in the problem, its
label, its study name, the config and the registry key (migration 0006 reads old rows as the
dense problems they are); the nearest tuned bucket serves a bucket that was never tuned."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine

from db import PlanRecord, PlanRegistry, upgrade_registry
from db.schema import HEAD_REVISION, alembic_config
from tuner import lengths
from tuner.environment import Environment
from tuner.problem import Problem, visible_keys_total
from tuner.study_names import study_name

FROZEN_0001 = Path(__file__).parent / "data" / "registry_0001.sqlite"
#: the revision before the serving fields (0006): the one constant to change when re-chained
PREVIOUS_REVISION = "0008"
H200 = Environment("NVIDIA H200", "9.0", 132, "580.159", "13.0", "13.0.88", "2026.1")


def decode(**fields) -> Problem:
    base = dict(seq_len=1, head_dim=128, batch=64, heads=32, kv_heads=8, kv_len=4096)
    return Problem(dtype="bfloat16", **(base | fields))


# ------------------------------------------------------------------ distributions


def test_the_named_distributions_draw_what_they_say() -> None:
    assert list(lengths.kv_lengths("equal", 3, 100)) == [100, 100, 100]
    assert list(lengths.kv_lengths("skewed", 4, 32768)) == [32768, 1024, 1024, 1024]
    drawn = lengths.kv_lengths("uniform", 1000, 50)
    assert drawn.min() >= 1 and drawn.max() <= 50 and len(set(drawn.tolist())) > 40
    # seeded by the distribution, the batch and kv_len only: a problem is one batch
    assert np.array_equal(drawn, lengths.kv_lengths("uniform", 1000, 50))
    assert not np.array_equal(drawn[:10], lengths.kv_lengths("uniform", 10, 51))


def test_an_empirical_distribution_keeps_quantiles_of_a_long_file() -> None:
    values = lengths.values_from_lengths(list(range(1, 1001)))
    kept = lengths.values_of(values)
    assert len(kept) == lengths.MAX_VALUES and kept[0] == 1 and kept[-1] == 1000
    assert lengths.distribution_error(values) == ""
    assert set(lengths.kv_lengths(values, 50, 1000).tolist()) <= set(kept)
    assert lengths.values_of(lengths.values_from_lengths([9, 3, 3])) == (3, 3, 9)
    with pytest.raises(ValueError):
        lengths.values_from_lengths([0, 5])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("zipf", "must be one of equal, uniform, skewed"),
        ("values:3,x", "integers separated by commas"),
        ("values:5,3", "sorted and >= 1"),
        ("values:0,3", "sorted and >= 1"),
        ("values:3,9000", "exceeds kv_len=4096"),
        (7, "must be a string"),
    ],
)
def test_a_bad_distribution_is_refused_by_the_problem(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        decode(lengths=value)


def test_query_rows_follow_the_keys_of_each_request() -> None:
    chunked = Problem(512, 64, batch=50, heads=4, kv_len=4096, causal=True, lengths="uniform")
    sample = chunked.request_lengths()
    assert np.array_equal(sample.query, np.minimum(512, sample.kv))
    equal = Problem(512, 64, batch=2, heads=4, kv_len=300, lengths="equal", page_size=8)
    assert list(equal.request_lengths().query) == [512, 512]  # the dense meaning


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 24),
    st.integers(1, 90),
    st.booleans(),
    st.sampled_from(["uniform", "skewed", "values:1,7,30"]),
    st.integers(-1, 20),
)
def test_work_counts_sum_over_the_requests(seq_len, kv_len, causal, distribution, window) -> None:
    kv_len = max(kv_len, seq_len, 30)
    problem = Problem(
        seq_len,
        16,
        batch=5,
        heads=2,
        causal=causal,
        kv_len=kv_len,
        lengths=distribution,
        window_left=window,
        dtype="float16",
    )
    sample = problem.request_lengths()
    pairs = 0
    for n, m in zip(sample.query, sample.kv, strict=True):
        low, high = problem.request_offsets(int(n), int(m))
        pairs += visible_keys_total(int(n), int(m), low, high)
    assert problem.attended_pairs_total == pairs
    assert problem.useful_flops == 4 * 2 * pairs * 16
    assert problem.tensor_bytes == int(sample.query.sum()) * 2 * 16 * 2
    assert problem.kv_tensor_bytes == int(sample.kv.sum()) * 2 * 16 * 2


# ------------------------------------------------------------------ names


def test_labels_and_study_names_show_the_serving_fields_only_when_set() -> None:
    dense = decode()
    assert dense.label() == "64x32/8x1:4096x128 bfloat16 full" and not dense.serving
    assert decode(page_size=0) == dense  # the registry's spelling of contiguous
    bucket = decode(page_size=16, lengths="skewed")
    assert bucket.serving
    assert bucket.label() == "64x32/8x1:4096x128 bfloat16 full page=16 lengths=skewed"
    name = study_name(bucket, H200, {})
    assert name.startswith("64x32kv8x1kv4096x128-bfloat16-full-page16-skewed@nvidia-h200-")
    assert study_name(dense, H200, {}).startswith("64x32kv8x1kv4096x128-bfloat16-full@")
    empirical = decode(lengths="values:10,20,4000")
    assert "lengths=values3-" in empirical.label()
    with pytest.raises(ValueError, match=r"page_size=300 must be an integer in 1..256"):
        decode(page_size=300)


# ------------------------------------------------------------------ config


def test_the_config_reads_a_file_of_lengths(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    from tuner.config import problem_from, typed_config
    from tuner.errors import ConfigError

    observed = tmp_path / "lengths.txt"
    observed.write_text("100 2000\n4000\n 7 7\n")
    conf = Path(__file__).resolve().parents[1] / "tuner" / "conf"
    shape = ["seq_len=1", "head_dim=128", "kv_len=4096", "batch=16", "page_size=16"]
    with initialize_config_dir(version_base=None, config_dir=str(conf)):
        config = typed_config(compose("config", [*shape, f"lengths=file:{observed}"]))
        problem = problem_from(config)
        assert problem.lengths == "values:7,7,100,2000,4000" and problem.page_size == 16
        too_long = typed_config(
            compose(
                "config", [*shape[:2], "kv_len=1000", "page_size=16", f"lengths=file:{observed}"]
            )
        )
        with pytest.raises(ConfigError, match=r"more than kv_len=1000"):
            problem_from(too_long)
        missing = typed_config(compose("config", [*shape, "lengths=file:/no/such/file"]))
        with pytest.raises(ConfigError, match=r"^lengths=file:/no/such/file is invalid"):
            problem_from(missing)
        bad = typed_config(compose("config", [*shape, "lengths=zipf"]))
        with pytest.raises(ConfigError, match=r"^lengths=zipf is invalid: must be one of"):
            problem_from(bad)
        page = typed_config(compose("config", [*shape[:4], "page_size=512"]))
        with pytest.raises(ConfigError, match=r"^page_size=512 is invalid"):
            problem_from(page)


# ------------------------------------------------------------------ registry


def record(median_ms: float) -> PlanRecord:
    params = {
        "block_n": 64,
        "warps": 4,
        "row_warps": 1,
        "m_tiles": 1,
        "stages": 3,
        "ctas_per_sm": 2,
        "items_per_cta": 2,
        "min_chunk_tiles": 4,
        "max_splits": 128,
    }
    return PlanRecord("serving_f16", params, "h", True, median_ms=median_ms, max_abs_error=1e-3)


@pytest.fixture
def registry(tmp_path: Path):
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'plans.sqlite'}") as handle:
        yield handle


def test_buckets_keep_plans_of_their_own_and_the_nearest_serves_an_unseen_one(
    registry: PlanRegistry,
) -> None:
    skewed = decode(page_size=16, lengths="skewed")
    uniform = decode(page_size=16, lengths="uniform")
    registry.record(skewed, H200, record(0.1))
    registry.record(uniform, H200, record(0.2))
    registry.record(decode(), H200, record(0.05))  # dense: another family's world
    assert registry.best(skewed, H200).record.median_ms == 0.1  # type: ignore[union-attr]
    assert registry.best(uniform, H200).record.median_ms == 0.2  # type: ignore[union-attr]
    # An untuned batch size: the same distribution's bucket first, marked as a fallback.
    unseen = decode(batch=48, page_size=16, lengths="skewed")
    assert registry.best(unseen, H200) is None
    near = registry.best(unseen, H200, nearest=True)
    assert near is not None and near.fallback and near.problem == skewed
    # Another page size, or a dense shape, is never served for a serving bucket.
    assert registry.best(decode(page_size=32, lengths="skewed"), H200, nearest=True) is None
    dense = registry.best(decode(batch=48), H200, nearest=True)
    assert dense is not None and dense.problem == decode()


def test_a_registry_from_before_the_serving_fields_reads_its_rows_as_dense(
    tmp_path: Path,
) -> None:
    from alembic import command

    path = tmp_path / "registry_before.sqlite"
    shutil.copy(FROZEN_0001, path)
    url = f"sqlite:///{path}"
    engine = create_engine(url)
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, PREVIOUS_REVISION)
    engine.dispose()
    assert upgrade_registry(url) == (PREVIOUS_REVISION, HEAD_REVISION)
    connection = sqlite3.connect(path)
    rows = set(connection.execute("SELECT page_size, lengths FROM problems").fetchall())
    connection.close()
    assert rows == {(0, "equal")}
    h200_0001 = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "")
    with PlanRegistry.open(url) as registry:
        best = registry.best(Problem(4096, 128), h200_0001)
        assert best is not None and best.record.median_ms == 0.8125
        assert best.problem.page_size is None and not best.problem.serving
        # a serving bucket of the same shape is a new row beside the old one
        bucket = Problem(4096, 128, dtype="bfloat16", page_size=16)
        registry.record(bucket, h200_0001, record(0.3))
        assert registry.best(Problem(4096, 128), h200_0001).record.median_ms == 0.8125  # type: ignore[union-attr]
        assert registry.best(bucket, h200_0001).problem == bucket  # type: ignore[union-attr]
