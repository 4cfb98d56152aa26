"""The op table (tests.helpers.op_table) against what it describes: every operator the
extension registers is in exactly one entry; every op's CUDA kernel sources run in the
kernels-on-CPU harness through a driver of the table, with case files; every op's sanitizer cases
reach each of its operators (on the CPU here, as in gpu_check.sh's rehearsal), chosen_logprob's
with a softcap, top_k and top_p alone (the search, whose hist_rows kernel is the one with shared
memory and barriers); and gpu_check.sh's benchmark stages are the table's, in its order."""
import collections
import importlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fused_rl_ops
from tests.helpers import op_table
from tests.helpers.kernel_calls import KernelCalls

ROOT = Path(__file__).resolve().parents[2]


def test_every_registered_operator_is_in_one_entry():
    registered = sorted(name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                        if name.startswith("fused_rl_ops::"))
    listed = [name for op in op_table.OPS for name in op.torch_ops]
    assert sorted(listed) == registered
    assert [name for name, count in collections.Counter(listed).items() if count > 1] == []


def test_every_kernel_source_runs_in_the_harness_through_a_driver_of_the_table():
    with_kernels = sorted(path.parent.name for path in (ROOT / "csrc").glob("*/kernel.cu"))
    drivers = {op.name: op.kernels_on_cpu_driver for op in op_table.OPS if op.kernels_on_cpu_driver}
    assert sorted(drivers) == with_kernels
    assert sorted(drivers.values()) == sorted(path.stem for path in (ROOT / "tests" / "kernels_on_cpu").glob("*_driver.cpp"))
    for name in drivers:
        assert (ROOT / "tests" / "kernels_on_cpu" / f"test_{name}.py").exists(), name


@pytest.mark.parametrize("op", op_table.OPS, ids=lambda op: op.name)
def test_sanitizer_cases_reach_every_operator_of_their_op(op):
    """Each of its operators, and perhaps another op's (top_logprobs' backward is chosen_logprob's)."""
    with KernelCalls() as calls:
        op.sanitizer_cases("cpu")
    assert set(op.torch_ops) <= {call.op for call in calls.calls}


def test_chosen_logprob_sanitizer_cases_use_softcap_and_the_sampler_filter(monkeypatch):
    """top_k, top_p (alone: the search) and softcap each reach the ops in some call."""
    settings, real_chosen_logprob = [], fused_rl_ops.chosen_logprob

    def recording_chosen_logprob(*args, **kwargs):
        settings.append({name: kwargs.get(name) for name in ("softcap", "top_k", "top_p")})
        return real_chosen_logprob(*args, **kwargs)

    monkeypatch.setattr(fused_rl_ops, "chosen_logprob", recording_chosen_logprob)
    with KernelCalls() as calls:
        op_table.BY_NAME["chosen_logprob"].sanitizer_cases("cpu")
    assert any(s["softcap"] is not None for s in settings)
    assert any(s["top_k"] is not None for s in settings)
    assert any(s["top_p"] is not None and s["top_k"] is None for s in settings)
    assert any(call.op == "chosen_logprob_search" for call in calls.calls)


def test_the_benchmark_runs_are_the_tables_in_order_the_headline_first():
    printed = subprocess.run([sys.executable, "-m", "tests.helpers.op_table", "benchmark-runs"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert [line.split() for line in printed] == [[run.stage, str(run.budget_s), op.benchmark, *run.args]
                                                  for op in op_table.OPS for run in op.gpu_runs]
    assert printed[0].split()[:3:2] == ["bench_chosen_logprob", "bench_chosen_logprob"]


def test_the_gpu_test_stage_runs_every_ops_first_file_before_any_second():
    printed = subprocess.run([sys.executable, "-m", "tests.helpers.op_table", "test-files", "tests"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert sorted(printed) == sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py"))
    firsts = [f"tests/ops/test_{op.name}.py" for op in op_table.OPS]
    assert printed[:len(firsts)] == firsts
    assert printed.index("tests/ops/test_vocab_divergence_tp.py") < printed.index("tests/ops/test_chosen_logprob_sweep.py")


def test_sanitizer_cases_walk_several_chunks_at_the_cuda_tiling(monkeypatch):
    """Every call of the vocab-parallel ops in the sanitizer cases, at the tiling the op would choose
    on CUDA (its tiling_for given a CUDA device; the CPU kernels take any tiling), walks at least 3
    chunks of its vocabulary rows, the last one partial and not a multiple of the kernels' vector
    width (4), and every backward at least 2 gradient groups; top_logprobs asks for more ids than a
    warp has lanes."""
    for name in ("chosen_logprob", "vocab_divergence", "top_logprobs"):
        module = importlib.import_module(f"fused_rl_ops.{name}")
        monkeypatch.setattr(module, "tiling_for", lambda *args, real=module.tiling_for: real(
            *args[:4], torch.device("cuda"), *args[5:]))
    with KernelCalls() as calls:
        for op in ("chosen_logprob", "top_logprobs", "vocab_divergence"):
            op_table.BY_NAME[op].sanitizer_cases("cpu")
    tiled = [call for call in calls.calls if "chunk_size" in call.args]
    assert {call.op for call in tiled} >= {"chosen_logprob_stats", "chosen_logprob_backward", "chosen_logprob_search",
                                         "top_logprobs_stats", "vocab_divergence_stats", "vocab_divergence_mixture",
                                         "vocab_divergence_backward"}
    for call in tiled:
        rows, chunk = call.args["valid_rows"] or call.args["weight"].shape[0], call.args["chunk_size"]
        assert rows // chunk >= 2 and rows % chunk % 4 != 0, (call.op, rows, chunk)
        if call.op.endswith("_backward"):
            assert math.ceil(rows / (chunk * call.args["grad_chunks"])) >= 2, (call.op, rows, chunk)
    assert min(call.args["k"] for call in tiled if call.op == "top_logprobs_stats") > 32
