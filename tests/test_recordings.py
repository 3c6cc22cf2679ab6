"""The recorder's shapes, file names and family filter, and the recordings under bench/data.

Every committed recording must load through the replay backend, carry a whole
problem (kv_heads, kv_len and precision; files written before those fields
read as self-attention and tf32x3), hold every plan the planner makes for the
families it names (a whole grid: the search benchmarks replay the whole
space), and each of its plans must be the plan the planner makes from the
recorded params, under the same key.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kernels import build
from kernels.backends.base import Failure
from kernels.backends.replay import ReplayBackend, load_recordings
from tuner.device import H200
from tuner.planner import KernelParams, candidate_space, plan_kernel
from tuner.planner.families import families_for
from tuner.planner.space import SpaceAxes
from tuner.problem import Problem
from tuner.recorded_space import choice_added_since, recorded_tunables, unrecorded_reason

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import record_replay as recorder  # noqa: E402

DATA = sorted((BENCH / "data").glob("*.json"))


# ---------------------------------------------------------------- shapes and names


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096x128", Problem(4096, 128)),
        ("4x16x4096x128", Problem(4096, 128, batch=4, heads=16)),
        ("4x16x4096x128:bf16", Problem(4096, 128, batch=4, heads=16, dtype="bfloat16")),
        (
            "2x32/8x4096x128c:bf16",
            Problem(4096, 128, batch=2, heads=32, kv_heads=8, causal=True, dtype="bfloat16"),
        ),
        (
            "16x32/1x1:8192x128:fp16",
            Problem(1, 128, batch=16, heads=32, kv_heads=1, kv_len=8192, dtype="float16"),
        ),
        ("1x16x1000x128:tf32", Problem(1000, 128, batch=1, heads=16, precision="tf32")),
        ("1x16x1000x128:fp32", Problem(1000, 128, batch=1, heads=16, precision="tf32x3")),
        ("2x2x64:256x32c:bfloat16", Problem(64, 32, 2, 2, True, "bfloat16", kv_len=256)),
    ],
)
def test_shapes_read_gqa_kv_length_causal_and_dtype(text, expected):
    assert recorder.parse_shape(text) == expected


def test_the_causal_flag_still_applies_to_every_shape():
    assert recorder.parse_shape("1x8x2048x64", causal=True) == Problem(
        2048, 64, batch=1, heads=8, causal=True
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("4x16x4096", "is not"),
        ("4x16x4096x128:int8", "dtype 'int8' is not one of"),
        ("2x32/7x4096x128:bf16", "kv_heads=7 must divide heads=32"),
        ("1x4x512:64x64c:bf16", "causal with seq_len=512 > kv_len=64"),
    ],
)
def test_a_bad_shape_is_refused_with_the_reason(text, message):
    with pytest.raises(Exception, match=message):
        recorder.parse_shape(text)


@pytest.mark.parametrize(
    ("shape", "token"),
    [
        ("4x16x4096x128:bf16", "4x16x4096x128_bf16"),
        ("2x32/8x4096x128c:bf16", "2x32-8x4096x128c_bf16"),
        ("16x32/8x1:8192x128:bf16", "16x32-8x1-8192x128_bf16"),
        ("1x1x4096x128", "1x1x4096x128_fp32"),
        ("1x1x4096x128:tf32", "1x1x4096x128_tf32"),
        ("1x1x4096x128:fp16", "1x1x4096x128_fp16"),
    ],
)
def test_file_names_say_shape_and_dtype(shape, token):
    assert recorder.shape_token(recorder.parse_shape(shape)) == token


# ---------------------------------------------------------------- the recorder


def test_the_family_filter_records_whole_grids_of_those_families_and_splits(tmp_path, capsys):
    shapes = ["16x32/8x1:8192x128:bf16", "1x4x300x64:tf32"]
    argv = ["--backend", "model", "--family", "decode_f16", "--family", "mma_tf32"]
    argv += [arg for shape in shapes for arg in ("--shape", shape)]
    out, out_dir = tmp_path / "all.json", tmp_path / "one_per_shape"
    assert recorder.main([*argv, "--out", str(out), "--out-dir", str(out_dir)]) == 0
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == [
        "model_decode_f16_16x32-8x1-8192x128_bf16.json",
        "model_mma_tf32_1x4x300x64_tf32.json",
    ]
    recordings = load_recordings(out)
    assert [r.problem for r in recordings] == [recorder.parse_shape(s) for s in shapes]
    for recording, family in zip(recordings, ("decode_f16", "mma_tf32"), strict=True):
        assert recording.source_hashes == {family: build.source_hash(family)}
        grid = candidate_space(recording.problem, H200, SpaceAxes(families=(family,)))
        assert set(recording.entries) == {plan.key() for plan in grid.feasible}
        assert {entry.params["family"] for entry in recording.entries.values()} == {family}
    # tf32 admits one-pass and 3xTF32 plans: both are in its grid.
    passes = {e.params["passes"] for e in recordings[1].entries.values()}
    assert passes == {1, 3}
    split_dir = tmp_path / "split"
    assert recorder.main(["--split", str(out), "--out-dir", str(split_dir)]) == 0
    for name in names:
        assert (split_dir / name).read_text() == (out_dir / name).read_text()
    printed = capsys.readouterr().out
    assert "16x32/8x1:8192x128 bfloat16 full: " in printed and " timed, best decode_f16/" in printed


def test_a_shape_no_chosen_family_takes_is_refused(capsys):
    with pytest.raises(SystemExit):
        recorder.main(
            ["--backend", "model", "--family", "mma_f16", "--shape", "1x4x300x64", "--out", "x"]
        )
    assert "no family of ['mma_f16'] takes 1x4x300x64 float32 full" in capsys.readouterr().err


def test_files_from_before_gqa_and_precision_read_as_self_attention_tf32x3(tmp_path):
    block = json.loads((Path(__file__).parent / "data" / "replay_model_512x64.json").read_text())
    for name in ("kv_heads", "kv_len", "precision"):
        block["problem"].pop(name, None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(block))
    (recording,) = load_recordings(path)
    assert recording.problem == Problem(512, 64)
    assert recording.problem.self_attention and recording.problem.precision == "tf32x3"
    assert ReplayBackend(path).recording_for(Problem(512, 64, precision="tf32x3"))


# ---------------------------------------------------------------- the committed recordings


@pytest.mark.skipif(not DATA, reason="no recordings under bench/data/")
@pytest.mark.parametrize("path", DATA, ids=lambda p: p.name)
def test_each_recording_replays_whole_grids_of_plans_the_planner_makes(path):
    backend = ReplayBackend(path)
    assert backend.measured and backend.environment()["gpu_name"] == "NVIDIA H200"
    for recording in backend.recordings:
        problem = recording.problem
        assert problem.kv_heads is not None and problem.kv_len is not None
        families = set(recording.source_hashes) & set(families_for(problem.dtype))
        assert families, f"{problem.label()} names no family that takes {problem.dtype}"
        grid = candidate_space(problem, H200, SpaceAxes(families=tuple(sorted(families))))
        # the grid of the tunables the recording knows: a tunable added since (e.g. the
        # Hopper ping-pong) is recorded at the value its plans ran, its others not at all
        known = recorded_tunables(recording)
        in_recorded_space = {
            p.key(): p for p in grid.feasible if not unrecorded_reason(p, known)
        }
        # the planner still makes every recorded plan, and each plan of its space that the
        # recording lacks takes a choice added since (e.g. a key tile of 176 keys)
        assert set(recording.entries) <= set(in_recorded_space)
        for key in set(in_recorded_space) - set(recording.entries):
            assert choice_added_since(in_recorded_space[key], recording), key
        timed = 0
        for key, entry in recording.entries.items():
            params = KernelParams.from_stored(entry.params["family"], entry.params)
            plan = plan_kernel(problem, params, H200)
            assert plan.key() == key and plan.feasible, key
            replayed = backend.measure(plan, problem)
            if entry.failure is None:
                timed += 1
                assert replayed.ok and replayed.measured and replayed.median_ms == entry.median_ms
                assert entry.median_ms is not None and entry.median_ms > 0
            else:
                assert replayed.failure == entry.failure and entry.detail, key
                assert entry.failure in set(Failure)
        assert timed, f"{problem.label()} has no timed plan"
