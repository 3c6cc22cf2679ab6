"""bench/hopper_bench.py and bench/model_bench.py without a GPU: the candidates each times,
the problems a model run covers, and the arguments they refuse."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import hopper_bench  # noqa: E402
import model_bench  # noqa: E402

from tuner.costmodel import predict_time_ms  # noqa: E402
from tuner.device import H200  # noqa: E402
from tuner.planner.space import candidate_space  # noqa: E402


def test_the_evidence_shapes_cover_every_hopper_head_dim_both_dtypes_causal_and_gqa():
    shapes = hopper_bench.SHAPES.values()
    assert {p.head_dim for p in shapes} == {64, 96, 128, 192, 256}
    assert {p.dtype for p in shapes} == {"bfloat16", "float16"}
    assert any(p.causal for p in shapes) and any(p.group > 1 for p in shapes)
    assert any(p.seq_len % 64 for p in shapes)  # an odd length


@pytest.mark.parametrize("name", ["4x16x4096x96", "4x16x4096x256"])
def test_candidates_are_each_familys_best_predicted_feasible_plans(name):
    problem = hopper_bench.SHAPES[name]
    plans = hopper_bench.candidates(problem, H200, 4, 2)
    assert [p.family for p in plans] == ["wgmma_f16"] * 4 + ["mma_f16"] * 2
    assert all(p.feasible for p in plans)
    feasible = [p for p in candidate_space(problem, H200).feasible if p.family == "wgmma_f16"]
    best = min(predict_time_ms(p, H200) for p in feasible)
    assert predict_time_ms(plans[0], H200) == best
    predicted = [predict_time_ms(p, H200) for p in plans[:4]]
    assert predicted == sorted(predicted)


def test_hopper_bench_refuses_a_plan_without_one_shape_and_a_run_without_out(capsys):
    with pytest.raises(SystemExit):
        hopper_bench.main(["--out", "x.json", "--plan", "wgmma_f16/c2/n128/st2/b1/o0/s1"])
    assert "--plan times one plan of one shape" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        hopper_bench.main([])
    assert "give --out (a run) or --precompile DIR" in capsys.readouterr().err


def test_a_model_run_covers_the_problems_the_model_command_tunes():
    labels = [p.label() for p in model_bench.model_problems("llama-3.1-8b")]
    assert labels[:3] == [f"1x32/8x{n}x128 bfloat16 causal" for n in (1024, 4096, 8192)]
    assert "64x32/8x1:8192x128 bfloat16 causal" in labels and len(labels) == 9


def test_model_bench_refuses_a_run_without_out_or_work_dir(capsys):
    with pytest.raises(SystemExit):
        model_bench.main(["--out", "x.json"])
    assert "give --out and --work-dir" in capsys.readouterr().err


def test_twins_add_each_hopper_candidates_flipped_tunable_once():
    problem = hopper_bench.SHAPES["4x16x4096x128"]
    plain = hopper_bench.candidates(problem, H200, 4, 1)
    with_twins = hopper_bench.candidates(problem, H200, 4, 1, ("persistent",))
    assert with_twins[: len(plain)] == plain
    added = with_twins[len(plain):]
    keys = [p.key() for p in with_twins]
    assert len(keys) == len(set(keys)) and all(p.feasible for p in added)
    # every Hopper candidate has its twin in the list, persistent flipped, all else kept
    for plan in plain[:4]:
        flipped = plan.params.tunables | {"persistent": 1 - plan.params.persistent}
        assert any(p.params.tunables == flipped for p in with_twins), plan.key()
