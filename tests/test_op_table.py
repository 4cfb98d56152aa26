"""The op table (fused_rl_ops.testing.op_table) against what it describes: every operator the
extension registers is in exactly one entry; every op's CUDA kernel sources run in the
kernels-on-CPU harness through a driver of the table, with case files; every op's sanitizer cases
reach each of its operators (on the CPU here, as in gpu_check.sh's rehearsal), chosen_logprob's
with a softcap, top_k and top_p alone (the search, whose hist_rows kernel is the one with shared
memory and barriers); and gpu_check.sh's benchmark stages are the table's, in its order."""
import collections
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fused_rl_ops
from fused_rl_ops.testing import op_table
from fused_rl_ops.testing.kernel_calls import KernelCalls

ROOT = Path(__file__).resolve().parent.parent


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
        assert (ROOT / "tests" / f"test_kernels_on_cpu_{name}.py").exists(), name


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
    printed = subprocess.run([sys.executable, "-m", "fused_rl_ops.testing.op_table", "benchmark-runs"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert [line.split() for line in printed] == [[run.stage, str(run.budget_s), op.benchmark, *run.args]
                                                  for op in op_table.OPS for run in op.gpu_runs]
    assert printed[0].split()[:3:2] == ["bench_chosen_logprob", "bench_chosen_logprob"]
