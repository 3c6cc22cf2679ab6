"""Grouped-query attention and KV caches in the problem model, the config, the names and keys,
the deploy-time shape inference, and the planners' traffic and partitions (CPU only)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given
from hypothesis import strategies as st

from db.models import problem_identity
from db.ranking import same_family_of_shapes, shape_distance
from kernels.attention_args import (
    AttentionInputError,
    check_inputs,
    problem_from_shapes,
    problem_of,
)
from tuner.config import problem_from, typed_config
from tuner.device import H200
from tuner.environment import Environment
from tuner.errors import ConfigError
from tuner.planner.families.base import key_rows_read_per_head
from tuner.planner.families.decode_f16 import (
    MAX_QUERY_ROWS,
    decode_f16_shared_bytes,
    split_partition,
)
from tuner.planner.params import KernelParams
from tuner.planner.space import candidate_space
from tuner.planner.tunable import plan_kernel
from tuner.problem import Problem
from tuner.study_names import study_name

CONF_DIR = Path(__file__).resolve().parents[1] / "tuner" / "conf"
ENVIRONMENT = Environment("NVIDIA H200", "9.0", 132, "580", "13.0", "13.0.1", "2026.1")
DECODE = Problem(1, 128, batch=16, heads=32, dtype="bfloat16", kv_heads=8, kv_len=8192)


# ------------------------------------------------------------------ the problem


def test_defaults_are_self_attention_and_equal_to_explicit_values() -> None:
    plain = Problem(4096, 128, batch=2, heads=16)
    explicit = Problem(4096, 128, batch=2, heads=16, kv_heads=16, kv_len=4096)
    assert plain == explicit and hash(plain) == hash(explicit)
    assert (plain.kv_heads, plain.kv_len, plain.group) == (16, 4096, 1)
    assert plain.self_attention and not DECODE.self_attention


def test_labels_study_names_and_registry_keys_of_old_problems_are_unchanged() -> None:
    old = Problem(4096, 128, batch=4, heads=16, causal=True, dtype="bfloat16")
    assert old.label() == "4x16x4096x128 bfloat16 causal"
    name = study_name(old, ENVIRONMENT, {"mma_f16": "h"})
    assert name.startswith("4x16x4096x128-bfloat16-causal@nvidia-h200-")
    assert problem_identity(old) == {
        "seq_len": 4096,
        "head_dim": 128,
        "batch": 4,
        "heads": 16,
        "causal": True,
        "dtype": "bfloat16",
        "kv_heads": 16,
        "kv_len": 4096,
        "precision": "",  # half dtypes: precision does not apply
        # no variant: what migration 0006's defaults give every row from before it
        "window_left": -1,
        "window_right": -1,
        "softcap": 0.0,
        "alibi": False,
        "sinks": False,
        "direction": "forward",  # revision 0008: every row from before it reads forward
        # dense: what revision 0009 gives every row from before it
        "page_size": 0,
        "lengths": "equal",
    }


def test_gqa_and_kv_cache_problems_have_names_of_their_own() -> None:
    assert DECODE.label() == "16x32/8x1:8192x128 bfloat16 full"
    assert Problem(4096, 128, heads=32, kv_heads=8).label() == "1x32/8x4096x128 float32 full"
    assert Problem(16, 64, kv_len=100).label() == "1x1x16:100x64 float32 full"
    name = study_name(DECODE, ENVIRONMENT, {})
    assert name.startswith("16x32kv8x1kv8192x128-bfloat16-full@")
    names = {
        study_name(p, ENVIRONMENT, {})
        for p in (
            DECODE,
            Problem(1, 128, batch=16, heads=32, dtype="bfloat16"),
            Problem(1, 128, batch=16, heads=32, dtype="bfloat16", kv_len=8192),
        )
    }
    assert len(names) == 3


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(heads=32, kv_heads=5), "kv_heads=5 must divide heads=32"),
        (dict(heads=4, kv_heads=0), "kv_heads=0 must divide heads=4"),
        (dict(kv_len=0), "kv_len=0 must be >= 1"),
        (dict(causal=True, kv_len=8), "causal with seq_len=16 > kv_len=8"),
    ],
)
def test_inconsistent_shapes_are_refused(kwargs: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        Problem(16, 64, **kwargs)


@given(
    n=st.integers(1, 300),
    extra=st.integers(0, 300),
    causal=st.booleans(),
    rows=st.sampled_from([1, 16, 64, 128]),
)
def test_attended_pairs_and_key_rows_count_the_bottom_right_mask(
    n: int, extra: int, causal: bool, rows: int
) -> None:
    m = n + extra
    problem = Problem(n, 8, causal=causal, kv_len=m)
    visible = [min(m, r + extra + 1) if causal else m for r in range(n)]
    assert problem.attended_pairs == sum(visible)
    blocks = range(0, n, rows)
    expected = sum(min(m, b + rows + extra) if causal else m for b in blocks)
    assert key_rows_read_per_head(n, rows, causal, m) == expected


def test_bytes_use_the_kv_heads_and_the_kv_length() -> None:
    assert DECODE.tensor_bytes == 16 * 32 * 1 * 128 * 2
    assert DECODE.kv_tensor_bytes == 16 * 8 * 8192 * 128 * 2
    assert DECODE.useful_flops == 4 * 16 * 32 * 8192 * 128


# ------------------------------------------------------------------ config


@pytest.fixture(scope="module")
def hydra_conf_dir() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def config_problem(*overrides: str) -> Problem:
    cfg = compose(config_name="config", overrides=["seq_len=1", "head_dim=128", *overrides])
    return problem_from(typed_config(cfg))


def test_config_takes_kv_heads_and_kv_len(hydra_conf_dir: None) -> None:
    assert config_problem() == Problem(1, 128, dtype="bfloat16")
    got = config_problem("batch=16", "heads=32", "kv_heads=8", "kv_len=8192")
    assert got == DECODE


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("heads=32", "kv_heads=5"), "kv_heads=5 is invalid: must divide heads=32"),
        (("kv_heads=0",), "kv_heads=0 is invalid: must be an integer in 1..4294967295 or null"),
        (("kv_len=-1",), "kv_len=-1 is invalid: must be an integer in 1..4294967295 or null"),
        (("seq_len=16", "kv_len=8", "causal=true"), "kv_len=8 is invalid with causal=true"),
        (
            ("kv_len=4294967295", "batch=2"),
            "batch*kv_heads*kv_len*head_dim=2*1*4294967295*128 is invalid",
        ),
    ],
)
def test_config_refuses_inconsistent_kv_shapes_in_one_line(
    hydra_conf_dir: None, overrides: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        config_problem(*overrides)
    text = str(caught.value)
    assert message in text and "\n" not in text


# ------------------------------------------------------------------ registry ranking


def test_nearest_shapes_keep_the_group_size_and_prefer_the_nearer_kv_length() -> None:
    mha = Problem(1, 128, batch=16, heads=32, dtype="bfloat16", kv_len=8192)
    assert same_family_of_shapes(DECODE, DECODE.__class__(**{**vars_of(DECODE), "batch": 8}))
    assert not same_family_of_shapes(DECODE, mha)
    near = Problem(1, 128, batch=16, heads=32, dtype="bfloat16", kv_heads=8, kv_len=4096)
    far = Problem(1, 128, batch=16, heads=32, dtype="bfloat16", kv_heads=8, kv_len=512)
    assert shape_distance(DECODE, near) < shape_distance(DECODE, far)


def vars_of(problem: Problem) -> dict[str, Any]:
    return {name: getattr(problem, name) for name in problem.__slots__}


# ------------------------------------------------------------------ deploy-time inference


class FakeDeviceArray:
    """An object with ``__cuda_array_interface__`` (no CUDA call is made by the checks)."""

    def __init__(self, shape: tuple[int, ...], pointer: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": "<f2",
            "data": (pointer, False),
            "version": 3,
        }


def arrays(q: tuple[int, ...], kv: tuple[int, ...], v: tuple[int, ...] | None = None) -> Any:
    return (
        FakeDeviceArray(q, 1 << 32),
        FakeDeviceArray(kv, 2 << 32),
        FakeDeviceArray(v or kv, 3 << 32),
    )


def test_attention_infers_kv_heads_and_kv_len_from_k() -> None:
    inputs = check_inputs(*arrays((16, 32, 1, 128), (16, 8, 8192, 128)))
    assert problem_of(inputs, False) == Problem(
        1, 128, batch=16, heads=32, dtype="float16", kv_heads=8, kv_len=8192
    )
    assert problem_from_shapes((2, 4, 7, 64), (2, 4, 7, 64), "float16", True) == Problem(
        7, 64, batch=2, heads=4, causal=True, dtype="float16"
    )


@pytest.mark.parametrize(
    ("q", "k", "v", "message"),
    [
        ((16, 32, 1, 128), (8, 8, 8192, 128), None, "k must be [batch, kv_heads, kv_len"),
        ((16, 32, 1, 128), (16, 8, 8192, 64), None, "with q's batch (16) and head_dim (128)"),
        ((16, 32, 1, 128), (16, 5, 8192, 128), None, "kv_heads must divide heads"),
        ((16, 32, 1, 128), (16, 8, 8192, 128), (16, 8, 4096, 128), "v must have k's shape"),
    ],
)
def test_inconsistent_k_and_v_shapes_are_named(
    q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...] | None, message: str
) -> None:
    with pytest.raises(AttentionInputError, match=re.escape(message)):
        check_inputs(*arrays(q, k, v))


def test_causal_queries_longer_than_the_cache_are_refused_at_the_call() -> None:
    inputs = check_inputs(*arrays((1, 4, 16, 64), (1, 4, 8, 64)))
    assert problem_of(inputs, False).kv_len == 8  # fine without the mask
    with pytest.raises(AttentionInputError, match="causal with seq_len=16 > kv_len=8"):
        problem_of(inputs, True)


# ------------------------------------------------------------------ planners


def plan(problem: Problem, family: str, **tunables: int) -> Any:
    return plan_kernel(problem, KernelParams(family, **tunables), H200)


def test_decode_reads_each_kv_head_once_per_split_and_row_block() -> None:
    decode = plan(DECODE, "decode_f16", block_n=64, warps=4, stages=4, m_tiles=1, splits=16)
    assert decode.feasible, decode.reason
    kv = 2 * DECODE.kv_tensor_bytes
    q = DECODE.tensor_bytes
    partials = 4 * DECODE.batch_heads * 16 * 1 * (128 + 1)
    assert decode.global_read_bytes == q + kv + partials
    assert decode.launch.grid == (1, 16, 16 * 8)  # 32/8 heads x 1 row: 4 rows of one m16
    # mma_f16 loads the KV head once per query head: group times the K/V requests
    prefill = plan(DECODE, "mma_f16", block_m=64, block_n=64, warps=4, split_target=1 << 16)
    assert prefill.feasible, prefill.reason
    assert prefill.global_read_bytes - q == 4 * kv


def test_tiled_and_scalar_count_kv_requests_per_query_head() -> None:
    problem = Problem(100, 32, heads=4, causal=True, kv_heads=2, kv_len=250)
    scalar = plan(problem, "scalar_online", threads=64)
    rows = key_rows_read_per_head(100, 64, True, 250)
    assert scalar.global_read_bytes == 4 * 4 * (100 * 32 + 2 * rows * 32)
    assert scalar.tile_count == 250


@given(
    kv_len=st.integers(1, 100_000),
    block_n=st.sampled_from([32, 64, 128, 256]),
    splits=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256, 512]),
)
def test_decode_splits_cover_the_keys_in_whole_tiles(
    kv_len: int, block_n: int, splits: int
) -> None:
    keys_per_split, used = split_partition(kv_len, block_n, splits)
    assert keys_per_split % block_n == 0
    assert used <= splits and (used - 1) * keys_per_split < kv_len <= used * keys_per_split


def test_split_counts_that_leave_empty_splits_are_rejected_so_keys_are_distinct() -> None:
    problem = Problem(1, 128, heads=32, dtype="bfloat16", kv_heads=8, kv_len=1000)
    # 1000 keys are 16 tiles of 64: 32 splits would leave half of them empty
    empty = plan(problem, "decode_f16", block_n=64, splits=32)
    assert not empty.feasible and "leaves splits without keys" in empty.reason
    space = candidate_space(problem, H200)
    decode = [p for p in space.feasible if p.family == "decode_f16"]
    keys = [p.key() for p in decode]
    assert decode and len(keys) == len(set(keys))
    assert {p.sequence_splits for p in decode} >= {1, 2, 4, 8, 16}


@pytest.mark.parametrize(
    ("seq_len", "heads", "kv_heads", "m_tiles", "row_blocks"),
    [
        (1, 32, 8, 1, 1),  # 4 packed rows in one m16 tile
        (1, 32, 1, 2, 1),  # MQA: 32 heads fill two m16 tiles
        (7, 8, 2, 2, 1),  # 28 rows
        (16, 32, 8, 2, 2),  # 64 rows: two blocks of 32
        (16, 32, 8, 1, 4),
    ],
)
def test_a_groups_query_rows_are_packed_into_the_m_tiles(
    seq_len: int, heads: int, kv_heads: int, m_tiles: int, row_blocks: int
) -> None:
    problem = Problem(seq_len, 128, heads=heads, dtype="bfloat16", kv_heads=kv_heads, kv_len=4096)
    p = plan(problem, "decode_f16", block_n=64, warps=4, m_tiles=m_tiles, splits=8)
    assert p.feasible, p.reason
    assert p.rows_per_block == 16 * m_tiles and p.launch.grid == (row_blocks, 8, kv_heads)


def test_decode_packing_and_query_length_rules_give_one_line_reasons() -> None:
    few_rows = Problem(1, 128, heads=32, dtype="bfloat16", kv_heads=8, kv_len=4096)
    assert "larger than needed for 4 packed rows" in plan(few_rows, "decode_f16", m_tiles=2).reason
    prefill = Problem(MAX_QUERY_ROWS + 1, 128, dtype="bfloat16", kv_len=4096)
    assert "decode_f16 serves up to 16" in plan(prefill, "decode_f16").reason
    uneven = plan(few_rows, "decode_f16", block_n=32, warps=4)
    assert "not whole k16 steps a warp" in uneven.reason
    assert plan(few_rows, "decode_f16", splits=4).feasible
    float32 = Problem(1, 128, kv_len=4096)
    assert "not float32" in plan(float32, "decode_f16").reason


def test_decode_shared_memory_follows_the_kernels_layout() -> None:
    # Q's rows and the ring of (head_dim + 8)-element rows; the merge scratch reuses the ring
    assert decode_f16_shared_bytes(16, 64, 4, 4, 128) == 2 * 136 * (16 + 2 * 4 * 64)
    merge = 4 * 8 * 32 * (128 + 4)
    assert decode_f16_shared_bytes(32, 32, 2, 8, 128) == 2 * 136 * 32 + merge
    p = plan(DECODE, "decode_f16", block_n=64, warps=4, stages=4, m_tiles=1, splits=16)
    assert p.launch.shared_bytes == decode_f16_shared_bytes(16, 64, 4, 4, 128)


# ------------------------------------------------------------------ export


def test_exports_carry_kv_heads_and_kv_len_and_old_exports_read_as_self_attention(
    tmp_path: Path,
) -> None:
    import json

    from db import PlanRecord, PlanRegistry

    source = f"sqlite:///{tmp_path / 'a.sqlite'}"
    record = PlanRecord("decode_f16", {"splits": 8}, "h", measured=True, median_ms=0.14)
    old = Problem(4096, 128, dtype="bfloat16")
    with PlanRegistry.open(source) as registry:
        registry.record(DECODE, ENVIRONMENT, record)
        registry.record(old, ENVIRONMENT, record)
        registry.export(tmp_path / "plans.json")
    document = json.loads((tmp_path / "plans.json").read_text())
    problems = [entry["problem"] for entry in document["plans"]]
    assert {(p["kv_heads"], p["kv_len"]) for p in problems} == {(8, 8192), (1, 4096)}
    # an export written before GQA has no kv fields: its problems are self-attention
    document["plans"] = [e for e in document["plans"] if e["problem"]["seq_len"] == 4096]
    for entry in document["plans"]:
        del entry["problem"]["kv_heads"], entry["problem"]["kv_len"]
    (tmp_path / "old.json").write_text(json.dumps(document))
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'b.sqlite'}") as target:
        target.import_(tmp_path / "old.json")
        served = target.best(old, ENVIRONMENT)
        assert served is not None and served.problem == old
    with PlanRegistry.open(source, readonly=True) as registry:
        served = registry.best(DECODE, ENVIRONMENT)
        assert served is not None and served.problem == DECODE
