"""A --quick benchmark run (benchmarks/goals.py, benchmarks/plots.py): at its tiny shapes it reports
its figures, judges no goal and draws its plot; the same rows judged as a working-shape run would be
get the verdicts their figures give. bench_vocab_divergence's quick run end to end, on the CPU, and
the --tp 2 quick runs of bench_chosen_logprob and bench_vocab_divergence (benchmarks/tensor_parallel.py:
batch_invariant=True against the default path over two gloo ranks). No timing is asserted."""
import ast
import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_chosen_logprob, bench_vocab_divergence, goals, plots, tensor_parallel

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_a_quick_run_reports_its_figures_judges_no_goal_and_draws_them(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    # torch.compile of the naive path stays eager: inductor's C++ build would be most of the test.
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    drawn = []

    def recording_save_figure(fig, path):
        drawn.append([patch.get_height() for ax in fig.axes for patch in ax.patches])
        real_save_figure(fig, path)

    real_save_figure = plots.save_figure
    monkeypatch.setattr(plots, "save_figure", recording_save_figure)
    out = tmp_path / "bench_vocab_divergence.json"
    monkeypatch.setattr(sys, "argv", ["bench_vocab_divergence", "--quick", "--device", "cpu", "--json", str(out)])
    bench_vocab_divergence.main()

    written = json.loads(out.read_text())
    rows = written["results"]
    timed, (memory,) = rows[:2], rows[2:]
    assert [r["kind"] for r in timed] == ["forward_kl", "jsd"]
    for row in timed:
        assert row["fused_ms"] > 0 and row["x_naive"] == row["fused_ms"] / row["naive_ms"]
        assert row["masked_0.75/none"] == row["masked_0.75_ms"] / row["fused_ms"]
    assert memory["fused/naive_mem"] == memory["fused_peak_MiB"] / memory["naive_peak_MiB"]
    # No verdict anywhere: not in the rows, the tables, the JSON's goals or what was printed.
    assert not any(column.startswith("goal_") for row in rows for column in row)
    assert not any(column.startswith("goal_") for table in written["tables"] for column in table["columns"])
    assert set(written["goals"]) == set(bench_vocab_divergence.GOALS)
    assert all(goals.UNJUDGED in what for what in written["goals"].values())
    printed = capsys.readouterr().out
    assert goals.UNJUDGED in printed and "MET" not in printed
    assert {h["value"] for h in written["headline"]} == {timed[0]["x_six_gemms"], timed[0]["x_naive"],
                                                         timed[0]["masked_0.75/none"], memory["fused/naive_mem"]}
    # The plot: every path's time per kind and both paths' extra memory, as measured.
    assert written["plot"] == "bench_vocab_divergence.png"
    assert (tmp_path / written["plot"]).read_bytes().startswith(b"\x89PNG")
    times = [r[c] for r in timed for c in r if c.endswith("_ms") and not c.endswith("_iqr_ms")]
    assert sorted(drawn[0]) == pytest.approx(sorted(times + [memory["fused_peak_MiB"], memory["naive_peak_MiB"]]))

    # The same rows judged as a run at the working shape judges them.
    judged = goals.judge([dict(row) for row in rows], bench_vocab_divergence.GOALS, quick=False)
    forward_kl, jsd, memory = judged
    assert forward_kl["goal_six_gemms<=1.1x"] == (forward_kl["x_six_gemms"] <= 1.1)
    assert forward_kl["goal_naive<=1.3x"] == (forward_kl["x_naive"] <= 1.3)
    assert forward_kl["goal_75%masked<=0.45x"] == (forward_kl["masked_0.75/none"] <= 0.45)
    assert memory["goal_mem<=naive/8"] == (memory["fused/naive_mem"] <= 1 / 8)
    assert not any(column.startswith("goal_") for column in jsd)
    goals.print_verdicts(judged, bench_vocab_divergence.GOALS, quick=False)
    verdicts = capsys.readouterr().out.splitlines()
    assert len(verdicts) == len(bench_vocab_divergence.GOALS)
    assert verdicts[1].startswith("MET: " if forward_kl["goal_naive<=1.3x"] else "NOT MET: ")


@pytest.mark.parametrize("benchmark,ops", [(bench_chosen_logprob, ["chosen_logprob", "top_logprobs"]),
                                           (bench_vocab_divergence, ["vocab_divergence"])])
def test_a_quick_tensor_parallel_run_reports_the_cost_of_batch_invariance(tmp_path, monkeypatch, capsys, benchmark,
                                                                          ops):
    """--tp 2 --quick: each op at both quick shapes over two ranks of one thread each, both paths'
    times and peak memory, the ratios and growths its columns name, no verdict, the plot; the same
    rows judged as a working-shape run gets the verdicts their figures give."""
    pytest.importorskip("matplotlib")
    name = benchmark.__name__.rpartition(".")[2]
    out = tmp_path / f"{name}_tp2.json"
    monkeypatch.setattr(sys, "argv", [name, "--tp", "2", "--quick", "--device", "cpu", "--json", str(out)])
    benchmark.main()

    written = json.loads(out.read_text())
    rows = written["results"]
    assert [(r["op"], r["V"]) for r in rows] == [(op, V) for op in ops for _, _, V in tensor_parallel.QUICK_SHAPES]
    for row in rows:
        assert row["tp"] == 2 and row["threads_per_rank"] == 1
        assert row["default_ms"] > 0 and row["invariant/default"] == row["invariant_ms"] / row["default_ms"]
        assert row["default_MiB"] > 0 and row["extra_MiB"] == row["invariant_MiB"] - row["default_MiB"]
    for smaller, larger in zip(rows[::2], rows[1::2]):
        assert "extra_MiB_growth" not in smaller
        assert larger["extra_MiB_growth"] == larger["extra_MiB"] - smaller["extra_MiB"]
        assert larger["weight_shard_MiB_growth"] == larger["weight_shard_MiB"] - smaller["weight_shard_MiB"] > 0
    assert not any(column.startswith("goal_") for row in rows for column in row)
    assert goals.UNJUDGED in capsys.readouterr().out
    assert (tmp_path / written["plot"]).read_bytes().startswith(b"\x89PNG")
    judged = goals.judge([dict(row) for row in rows], tensor_parallel.GOALS, quick=False)
    for row in judged:
        assert row["goal_invariant<=1.10x"] == (row["invariant/default"] <= 1.10)
        if "extra_MiB_growth" in row:
            assert row["goal_extra_mem_flat_in_V"] == (row["extra_MiB_growth"] <= row["weight_shard_MiB_growth"] / 16)
        else:
            assert "goal_extra_mem_flat_in_V" not in row


def test_every_benchmark_writes_a_plot():
    """scripts/bench.sh runs every benchmarks/bench_*.py: each hands write_json the plot it drew."""
    for module in sorted(BENCHMARKS.glob("bench_*.py")):
        calls = [node for node in ast.walk(ast.parse(module.read_text())) if isinstance(node, ast.Call)
                 and getattr(node.func, "id", None) == "write_json"]
        assert any(keyword.arg == "plot" for call in calls for keyword in call.keywords), module.name
