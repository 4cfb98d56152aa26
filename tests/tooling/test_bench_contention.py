"""--contention (benchmarks/contention.py) at a tiny shape: its rows, ratios and goal columns, the
busy process it starts and stops itself, and vocab_divergence's mode from its arguments to its JSON
(--quick: no verdicts). No timing is asserted."""
import argparse
import json
import os

import torch

from benchmarks import bench_vocab_divergence, contention, goals
from benchmarks.results import RowLog


def test_the_busy_process_runs_on_the_two_cores_while_the_block_runs():
    cpus = contention.two_cores()
    with contention.busy_process(cpus) as proc:
        assert proc.poll() is None
        assert os.sched_getaffinity(proc.pid) == set(cpus)
    assert proc.poll() is not None
    with contention.busy_process(cpus, on=False) as none:
        assert none is None


def test_pinning_restores_every_thread():
    before = os.sched_getaffinity(0)
    with contention.pinned(contention.two_cores()[:1]):
        assert len(os.sched_getaffinity(0)) == 1
    assert os.sched_getaffinity(0) == before


def test_the_mode_at_a_tiny_shape(capsys):
    threads = torch.get_num_threads()
    rows = contention.measure_contention(64, 32, 512, torch.float32, 1, RowLog(None),
                                         contention.chosen_logprob_paths(64, 32, 512, torch.float32))
    assert torch.get_num_threads() == threads
    assert not any(c in row for row in rows for c in contention.GOALS)  # judged apart, unless the run is quick
    goals.judge(rows, contention.GOALS, quick=False)
    assert [(r["contention"], r["threads"]) for r in rows] == [("quiet", 1), ("quiet", 2), ("busy", 1), ("busy", 2)]
    for row in rows:
        assert row["fused_ms"] > 0 and row["gemms_ms"] > 0
        assert row["fused/gemms"] == row["fused_ms"] / row["gemms_ms"]
        assert ("goal_busy<=1.2x_gemms" in row) == (row["contention"] == "busy")
        assert ("goal_2threads<=1thread" in row) == (row["threads"] == 2)
    for one, two in (rows[:2], rows[2:]):
        assert two["fused_2/1_threads"] == two["fused_ms"] / one["fused_ms"]
        assert two["goal_2threads<=1thread"] == (two["fused_2/1_threads"] <= 1.0)
    assert rows[3]["goal_busy<=1.2x_gemms"] == (rows[3]["fused/gemms"] <= 1.2)
    table = contention.contention_table("chosen_logprob", rows)
    assert set(contention.GOALS) <= set(table["columns"])
    goals.print_verdicts(rows, contention.GOALS, quick=False)
    printed = capsys.readouterr().out
    assert printed.count("MET: ") == len(contention.GOALS)


def test_vocab_divergences_mode_writes_its_rows(tmp_path, capsys):
    path = tmp_path / "contention.json"
    args = argparse.Namespace(quick=True, json=str(path))
    contention.run_contention("vocab_divergence", args, RowLog(args.json), bench_vocab_divergence.contention_paths)
    written = json.loads(path.read_text())
    assert written["benchmark"] == "vocab_divergence" and set(written["goals"]) == set(contention.GOALS)
    rows = written["results"]
    assert [(r["contention"], r["threads"], r["V"]) for r in rows] == [
        ("quiet", 1, 8192), ("quiet", 2, 8192), ("busy", 1, 8192), ("busy", 2, 8192)]
    # --quick: tiny shapes, no verdicts.
    assert not any(c in row for row in rows for c in contention.GOALS)
    printed = capsys.readouterr().out
    assert goals.UNJUDGED in printed and "MET" not in printed
