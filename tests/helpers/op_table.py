"""The package's ops, one entry each, with what the tooling needs about them: the one place that
scripts/gpu_check.sh (the benchmark runs), scripts/sanitizer_cases.py, the kernels-on-CPU harness
(tests/helpers/kernels_on_cpu.py) and the contract test (tests/tooling/test_op_contract.py) read the ops
from; tests/tooling/test_op_table.py holds the table to the extension and the sources (every registered
operator in one entry, every kernel source with a harness driver, every op's sanitizer cases
reaching each of its operators).

A new op adds its entry here (and its sanitizer cases in tests/helpers/sanitizer_cases.py).

`python -m tests.helpers.op_table benchmark-runs` prints gpu_check.sh's benchmark stages in
order, one a line: STAGE BUDGET_S MODULE [ARGUMENT...]; `... test-files TESTS_DIR` the test files
in the order its test stage runs them, one a line."""
import dataclasses
import itertools
import pathlib
import sys
from typing import Callable, Optional

from fused_rl_ops.chosen_logprob import OP_GROUPS as CHOSEN_LOGPROB_GROUPS, SEARCH_GROUPS as CHOSEN_LOGPROB_SEARCH_GROUPS
from fused_rl_ops.clamped_swiglu import ClampedSwigluOptions
from fused_rl_ops.top_logprobs import TOP_LOGPROBS_GROUPS
from fused_rl_ops.vocab_divergence import OP_GROUPS as VOCAB_DIVERGENCE_GROUPS
from . import sanitizer_cases


@dataclasses.dataclass(frozen=True)
class BenchmarkRun:
    """A run of an op's benchmark on a GPU machine: a stage of scripts/gpu_check.sh (its log,
    JSON and summary entry take the stage's name), within budget_s seconds there (cut to what the
    run has left; a stage's budget is overridden by the variable <STAGE>_S in capitals)."""
    stage: str
    budget_s: int
    args: tuple = ()


@dataclasses.dataclass(frozen=True)
class Op:
    """name: the public function, its C++ op folder and its tests/ops/test_<name>.py.
    operators: its operators (torch.ops.fused_rl_ops.<each>), each with its option groups
        (dataclasses mirroring the C++ X-macro lists) in the order its schema takes them; () for an
        operator that takes tensors only.
    benchmark: its module in benchmarks/ (python -m benchmarks.<benchmark>); None: none.
    gpu_runs: the runs of that benchmark on a GPU machine (scripts/gpu_check.sh).
    kernels_on_cpu_driver: tests/kernels_on_cpu/<driver>.cpp, which runs its CUDA launchers on the
        CPU (the harness builds it; its cases are in
        tests/kernels_on_cpu/test_<name>*.py); None: the op launches no kernels of its own.
    sanitizer_cases: small calls of its CUDA kernels for compute-sanitizer, (device) -> None."""
    name: str
    operators: dict
    benchmark: Optional[str]
    gpu_runs: tuple
    kernels_on_cpu_driver: Optional[str]
    sanitizer_cases: Callable[[str], None]

    @property
    def torch_ops(self):
        return tuple(self.operators)


# In the order gpu_check.sh runs the benchmarks: the headline (chosen_logprob's main shape) first,
# then by what a first GPU run most needs; clamped_swiglu's, the longest (28 torch.compile
# graphs), last: it is the one cut when the run's time is short.
OPS = (
    Op("chosen_logprob",
       operators={"chosen_logprob_stats": CHOSEN_LOGPROB_GROUPS, "chosen_logprob_combine": (),
                  "chosen_logprob_backward": CHOSEN_LOGPROB_GROUPS,
                  "chosen_logprob_search": CHOSEN_LOGPROB_SEARCH_GROUPS},
       benchmark="bench_chosen_logprob",
       # The V and N sweeps do not fit in the run: a later one.
       gpu_runs=(BenchmarkRun("bench_chosen_logprob", 120, ("--no-sweeps",)),
                 BenchmarkRun("bench_chosen_logprob_sampler_filter", 30, ("--sampler-filter",)),
                 BenchmarkRun("bench_chosen_logprob_distillation", 30, ("--distillation",))),
       kernels_on_cpu_driver="chosen_logprob_driver",
       sanitizer_cases=sanitizer_cases.chosen_logprob),
    # Its benchmark is chosen_logprob's distillation run; its backward is chosen_logprob's.
    Op("top_logprobs",
       operators={"top_logprobs_stats": TOP_LOGPROBS_GROUPS},
       benchmark=None,
       gpu_runs=(),
       kernels_on_cpu_driver="top_logprobs_driver",
       sanitizer_cases=sanitizer_cases.top_logprobs),
    Op("vocab_divergence",
       operators={"vocab_divergence_stats": VOCAB_DIVERGENCE_GROUPS, "vocab_divergence_combine": (),
                  "vocab_divergence_mixture": VOCAB_DIVERGENCE_GROUPS,
                  "vocab_divergence_backward": VOCAB_DIVERGENCE_GROUPS},
       benchmark="bench_vocab_divergence",
       gpu_runs=(BenchmarkRun("bench_vocab_divergence", 60),),
       kernels_on_cpu_driver="vocab_divergence_driver",
       sanitizer_cases=sanitizer_cases.vocab_divergence),
    Op("value_head",
       operators={"value_head": (), "value_head_backward_hidden": (), "value_head_backward_params": ()},
       benchmark="bench_value_head",
       gpu_runs=(BenchmarkRun("bench_value_head", 40),),
       kernels_on_cpu_driver="value_head_driver",
       sanitizer_cases=sanitizer_cases.value_head),
    Op("clamped_swiglu",
       operators={name: (ClampedSwigluOptions,) for name in
                  ("clamped_swiglu", "clamped_swiglu_backward", "clamped_swiglu_scaled_backward")},
       benchmark="bench_clamped_swiglu",
       gpu_runs=(BenchmarkRun("bench_clamped_swiglu", 30),),
       kernels_on_cpu_driver="clamped_swiglu_driver",
       sanitizer_cases=sanitizer_cases.clamped_swiglu),
)
BY_NAME = {op.name: op for op in OPS}


def benchmark_runs():
    """(stage, budget_s, module, args) of every op's GPU benchmark runs, in gpu_check.sh's order."""
    return [(run.stage, run.budget_s, op.benchmark, run.args) for op in OPS for run in op.gpu_runs]


def test_files(tests_dir) -> list:
    """The test files under tests_dir in gpu_check.sh's order, so that a cut test stage has run
    every op's first: each op's ops/test_<name>.py, then each op's second file (ops/test_<name>_*.py),
    and so on, then the other files."""
    paths = sorted(pathlib.Path(tests_dir).rglob("test_*.py"))
    op_files = [path for path in paths if path.parent.name == "ops"]
    per_op = [[path for path in op_files if path.stem == f"test_{op.name}"]
              + [path for path in op_files if path.stem.startswith(f"test_{op.name}_")] for op in OPS]
    rounds = [path for files in itertools.zip_longest(*per_op) for path in files if path is not None]
    return [str(path) for path in dict.fromkeys(rounds + paths)]


if __name__ == "__main__":
    if sys.argv[1:] == ["benchmark-runs"]:
        for stage, budget_s, module, args in benchmark_runs():
            print(stage, budget_s, module, *args)
    elif sys.argv[1:2] == ["test-files"] and len(sys.argv) == 3:
        print(*test_files(sys.argv[2]), sep="\n")
    else:
        sys.exit("usage: python -m tests.helpers.op_table benchmark-runs | test-files TESTS_DIR")
