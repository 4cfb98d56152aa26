"""The kernels-on-CPU harness itself (tests/helpers/kernels_on_cpu.py): the host model's checks of
synchronisation, and proof that the cases catch bugs planted in the kernels and launchers."""
import os
import re
import shutil
import subprocess

import pytest
import torch

from tests.helpers.background import background_compiles
from tests.helpers.kernels_on_cpu import (BUILDS, CSRC, SANITIZER_ENV, ServingDriver, build_drivers, drivers,  # noqa: F401
                                          pytestmark)
from tests.kernels_on_cpu import test_chosen_logprob as chosen_logprob_cases
from tests.kernels_on_cpu import test_chosen_logprob_entries as entries_cases
from tests.kernels_on_cpu import test_clamped_swiglu as clamped_swiglu_cases
from tests.kernels_on_cpu import test_sampler_filter as sampler_filter_cases
from tests.kernels_on_cpu import test_top_logprobs as top_logprobs_cases
from tests.kernels_on_cpu import test_value_head as value_head_cases
from tests.kernels_on_cpu import test_vocab_divergence as vocab_divergence_cases


# ---------------------------------------------------------------------------------------------
# The model itself: its checks of synchronisation, and the launch shapes of common/cuda_utils.cuh


# The report each scenario must give (a regex). A thread returning before a barrier or a shuffle its
# block or warp still waits at is reported by whichever comes second: the thread that returns, or
# one that then reaches the wait.
@pytest.mark.parametrize("scenario,error", [
    ("good_exchanges", None),
    ("bad_launch_configs_are_errors", None),
    ("device_sizes", None),
    ("concurrent_blocks", None),
    ("bad_barrier_after_return", r"returned while \d+ threads wait at __syncthreads\(\)|"
                                 r"__syncthreads\(\) at \S+ reached after \d+ of \d+ threads returned"),
    ("bad_barriers_at_two_places", r"threads wait at different __syncthreads\(\)"),
    ("bad_shuffle_absent_lanes", "names lanes absent from this warp"),
    ("bad_shuffle_returned_lanes", r"returned while its warp waits|\*_sync mask at \S+ names lanes that returned"),
    ("bad_deadlock", "deadlock: timed out"),
])
def test_harness_selftest(drivers, scenario, error):
    # A short deadlock timeout where one is expected; elsewhere the default, as a loaded machine needs.
    env = {**os.environ, **SANITIZER_ENV, **({"CUDA_ON_HOST_TIMEOUT_S": "2"} if scenario == "bad_deadlock" else {})}
    for variant in BUILDS:
        r = subprocess.run([str(drivers / variant / "harness_selftest"), scenario], capture_output=True, text=True,
                           env=env, timeout=120)
        if error is None:
            assert r.returncode == 0 and r.stdout == "ok\n" and not r.stderr, f"[{variant}] {r.stderr[:4000]}"
        else:
            assert r.returncode == 70 and re.search(error, r.stderr) and "Sanitizer" not in r.stderr, \
                f"[{variant}] {r.stderr[:4000]}"


# A stand-in for a driver serving cases (tests/kernels_on_cpu/driver.h's protocol): each case file
# says what the case does.
STAND_IN_DRIVER = """#!/bin/bash
while IFS=$'\\t' read -r case out; do
  exec 2>>"$out/stderr.txt"
  case "$(cat "$case")" in
    pass) echo done ;;
    fail) echo "cuda_on_host error: planted" >&2; exit 70 ;;
    hang) sleep 600 ;;
    print) echo "a kernel's printf" ;;
  esac
done
"""


def test_a_serving_driver_fails_the_case_that_ends_it_and_starts_again(tmp_path):
    """ServingDriver: a case that ends the process fails with its exit status and standard error,
    and the next case starts a new process; a case that hangs past the timeout, or prints anything
    but the reply, fails and its process is killed; a process still serving ends cleanly."""
    script = tmp_path / "driver"
    script.write_text(STAND_IN_DRIVER)
    script.chmod(0o755)
    driver = ServingDriver(script)

    def run(n, kind, timeout=60):
        (tmp_path / f"{n}.case").write_text(kind)
        (tmp_path / f"{n}.out").mkdir()
        result = driver.run(tmp_path / f"{n}.case", tmp_path / f"{n}.out", timeout=timeout)
        return result.returncode, result.stderr, driver.process.pid

    code, stderr, first = run(0, "pass")
    assert (code, stderr) == (0, "")
    assert run(1, "pass")[::2] == (0, first)  # the same process
    code, stderr, _ = run(2, "fail")
    assert code == 70 and "planted" in stderr
    code, stderr, second = run(3, "pass")
    assert (code, stderr) == (0, "") and second != first
    code, stderr, _ = run(4, "hang", timeout=1)
    assert code == -9 and "timed out after 1 s" in stderr
    code, stderr, _ = run(5, "print")
    assert code == -9 and "a kernel's printf" in stderr
    run(6, "pass")
    driver.stop()
    assert driver.process.returncode == 0


# ---------------------------------------------------------------------------------------------
# Proof that the harness catches bugs: known defects planted in a copy of the sources, one at a
# time, each reported by a case above. Each entry: (file, the code the defect changes, the
# defective code, the op whose driver runs the case, case, the report expected, the one build that
# gives it); only that build is compiled and run, which keeps the rebuilds inside CI's time budget.
# The code is found by its tokens in order, whatever the whitespace and line breaks between them
# (code_pattern), so reformatting the sources moves no defect.

DEFECTS = {
    # value_head stage 1 without the barrier between writing and reading the group sums.
    "syncthreads_deleted": (
        "value_head/kernel.cuh", "  __syncthreads();\n  if (threadIdx.y != 0 || c >= H) return;",
        "  if (threadIdx.y != 0 || c >= H) return;", "value_head",
        lambda d, tmp: value_head_cases.test_value_head_backward_params(d, tmp, 130, 40, 0, torch.float32),
        "ThreadSanitizer: data race", "tsan"),
    # The same barrier placed after threads return: reached by part of the block.
    "barrier_after_return": (
        "value_head/kernel.cuh", "  __syncthreads();\n  if (threadIdx.y != 0 || c >= H) return;",
        "  if (threadIdx.y != 0 || c >= H) return;\n  __syncthreads();", "value_head",
        lambda d, tmp: value_head_cases.test_value_head_backward_params(d, tmp, 130, 40, 0, torch.float32),
        "cuda_on_host error", "plain"),
    # stats_rows' column loop reads one column past the row (45 columns, the scalar path).
    "loop_bound_le": (
        "vocab_parallel/stats_rows.cuh", "k < C; k += kWarp * kWidth", "k <= C; k += kWarp * kWidth", "chosen_logprob",
        lambda d, tmp: chosen_logprob_cases.test_chosen_logprob_stats_rows(d, tmp, 21, 45, "several", 1.0),
        "AddressSanitizer: heap-buffer-overflow", "asan_ubsan"),
    # The online pass raising a lane's maximum without moving its sums to it (rows in ascending
    # order raise it at every access).
    "stats_online_rescale_skipped": (
        "vocab_parallel/row_stats.h", "if (!(m == r.max)) stats_rescale(r, m);", "r.max = m;", "chosen_logprob",
        lambda d, tmp: chosen_logprob_cases.test_chosen_logprob_stats_rows_online(d, tmp, "ascending", 520, 0),
        "lse: ", "plain"),
    # The warp-per-row kernels' butterfly (warp_partial) merging only within each half-warp: lane 0
    # writes half the row's stats.
    "stats_rows_butterfly_halved": (
        "vocab_parallel/warp_partial.cuh", "for (int o = kWarp / 2; o > 0; o /= 2) {\n    Partial other = p;",
        "for (int o = kWarp / 4; o > 0; o /= 2) {\n    Partial other = p;", "chosen_logprob",
        lambda d, tmp: chosen_logprob_cases.test_chosen_logprob_stats_rows(d, tmp, 9, 520, "one", 0.7),
        "lse: ", "plain"),
    # grad_rows' column loop one pack past the row (thread 0 reaches k = C with 16 packs a row).
    "grad_rows_loop_bound_le": (
        "chosen_logprob/kernel.cuh", "k < int(C); k += int(blockDim.x) * kWidth",
        "k <= int(C); k += int(blockDim.x) * kWidth", "chosen_logprob",
        lambda d, tmp: chosen_logprob_cases.test_chosen_logprob_grad_rows_into_a_gradient_buffer(
            d, tmp, 20, 64, 128, 64, (0, 0), "one", "vector", None),
        "AddressSanitizer: heap-buffer-overflow", "asan_ubsan"),
    # A race between blocks: grad_rows' grid-stride loop stepping one block's rows, so every block
    # also writes the rows of the blocks after it (the same values: only ThreadSanitizer, with
    # the blocks running at once, sees two blocks write one element). 20 rows: 2 blocks of 16.
    "grad_rows_blocks_overlap": (
        "chosen_logprob/kernel.cuh", "r += int64_t(gridDim.x) * blockDim.y", "r += blockDim.y", "chosen_logprob",
        lambda d, tmp: chosen_logprob_cases.test_chosen_logprob_grad_rows_into_a_gradient_buffer(
            d, tmp, 20, 64, 128, 64, (0, 0), "one", "vector", None),
        "ThreadSanitizer: data race", "tsan"),
    # hist_rows without the barrier between clearing the shared bins and adding to them.
    "hist_rows_clear_barrier_deleted": (
        "chosen_logprob/kernel.cuh", "bins[j] = 0;\n    __syncthreads();", "bins[j] = 0;", "chosen_logprob",
        lambda d, tmp: sampler_filter_cases.test_hist_rows(d, tmp, 5, 300, "one", 1.0),
        "ThreadSanitizer: data race", "tsan"),
    # hist_rows' warp sums per bin taking the values of the lanes of even rank into those of odd rank:
    # the lowest lane of a bin adds less than the bin's total (many lanes a bin).
    "hist_rows_tree_from_the_wrong_ranks": (
        "chosen_logprob/kernel.cuh", "if (rank % 2 == 0 && above != 0) value += next;",
        "if (rank % 2 == 1 && above != 0) value += next;", "chosen_logprob",
        lambda d, tmp: sampler_filter_cases.test_hist_rows_hot_bins(d, tmp, 300, "several"),
        "search histogram", "plain"),
    # top_rows reading one column past the row (45 columns: lane 13 of the last 32 reaches k = C).
    "top_rows_loop_bound_le": (
        "chosen_logprob/kernel.cuh", "const float z = k < C ? logit(x[k])", "const float z = k <= C ? logit(x[k])",
        "chosen_logprob", lambda d, tmp: sampler_filter_cases.test_top_rows(d, tmp, 21, 45, 5, "one", 1.0),
        "AddressSanitizer: heap-buffer-overflow", "asan_ubsan"),
    # top_rows taking each given logit from the next lane: the tops hold other values.
    "top_rows_shuffle_lane_off_by_one": (
        "chosen_logprob/kernel.cuh", "__shfl_sync(0xffffffffu, z, __ffs(rest) - 1)",
        "__shfl_sync(0xffffffffu, z, __ffs(rest))", "chosen_logprob",
        lambda d, tmp: sampler_filter_cases.test_top_rows_threshold_and_window(d, tmp, "several"),
        "top values", "plain"),
    # Several tokens per position: the scatter of the chosen columns' gradients writing every entry's,
    # those of tokens outside the chunk too (row 0's id col0 - 1: one element before its row; row 1's
    # ignore_index -100: 119 elements before the buffer, inside SANITIZER_ENV's redzone).
    "scatter_chosen_grads_unchecked": (
        "chosen_logprob/math.h", "if (target >= 0 && target < C) d[target] = round(values[j]);",
        "d[target] = round(values[j]);", "chosen_logprob",
        lambda d, tmp: entries_cases.test_grad_rows_many_tokens(d, tmp, 20, 45, "several", None),
        "AddressSanitizer: heap-buffer-overflow", "asan_ubsan"),
    # top_logprobs' kernel taking each given logit from the next lane: the tops hold other values.
    "top_ids_shuffle_lane_off_by_one": (
        "top_logprobs/kernel.cuh", "const float v = __shfl_sync(0xffffffffu, z[i], from);",
        "const float v = __shfl_sync(0xffffffffu, z[i], from + 1);", "top_logprobs",
        lambda d, tmp: top_logprobs_cases.test_stats_top_ids_rows(d, tmp, 40, 200, 64, "several"),
        "top ids", "plain"),
    # top_logprobs' kernel reading its shared top before every lane's copy of the row's is seen: the
    # lanes read the root lane 0 writes.
    "top_ids_copy_barrier_deleted": (
        "top_logprobs/kernel.cuh", "__syncwarp();  // the copy seen by every lane", "", "top_logprobs",
        lambda d, tmp: top_logprobs_cases.test_stats_top_ids_rows(d, tmp, 21, 45, 5, "one"),
        "ThreadSanitizer: data race", "tsan"),
    # grad_rows' launcher taking the vector path without checking the buffer's alignment.
    "grad_rows_alignment_unchecked": (
        "chosen_logprob/kernel.cu", "is_aligned(p.grads, sizeof(Pack<G, kGradWidth>))", "true", "chosen_logprob",
        lambda d, tmp: chosen_logprob_cases.test_chosen_logprob_grad_rows_into_a_gradient_buffer(
            d, tmp, 20, 64, 128, 64, (0, 1), "several", "scalar", None),
        "misaligned address", "asan_ubsan"),
    # warp_sum's butterfly starting at offset 8: each half-warp sums only itself (a row of more
    # than 16 packs).
    "shuffle_offset_halved": (
        "common/cuda_utils.cuh", "for (int offset = kWarp / 2; offset > 0; offset /= 2)",
        "for (int offset = kWarp / 4; offset > 0; offset /= 2)", "value_head",
        lambda d, tmp: value_head_cases.test_value_head_forward_and_backward_hidden(
            d, tmp, 9, 640, "several", 0, True, torch.float32),
        "forward: ", "plain"),
    # row_sum without the barrier that keeps a row's next totals from overwriting ones still read
    # (rows of 256 threads, two rows in turn on one block).
    "row_sum_first_barrier_deleted": (
        "clamped_swiglu/kernel.cuh", "  __syncthreads();  // the previous call's totals are read\n", "",
        "clamped_swiglu",
        lambda d, tmp: clamped_swiglu_cases.test_clamped_swiglu_weighted_forward_and_backward(
            d, tmp, 2, 2080, "several", 0, "vector", False, torch.float32),
        "ThreadSanitizer: data race", "tsan"),
    # row_sum's warp_sum over the whole warp when a row has fewer threads (8 here): rows mix.
    "row_sum_width_ignored": (
        "clamped_swiglu/kernel.cuh", "const int width = blockDim.x < kWarp ? blockDim.x : kWarp;",
        "const int width = kWarp;", "clamped_swiglu",
        lambda d, tmp: clamped_swiglu_cases.test_clamped_swiglu_weighted_forward_and_backward(
            d, tmp, 40, 64, "one", 0, "vector", False, torch.bfloat16),
        "dscale: ", "plain"),
    # The launchers' grid arithmetic, each ceil-division turned into a floor division. Grid-stride
    # kernels still cover every row with too few blocks, so the launch shape itself is checked: on
    # the large stand-in device a block per row tile, one pass (21 rows: 2 blocks of 8 rows).
    "stats_rows_grid_floor": (
        "vocab_parallel/stats_rows.cuh", "(N + kStatsRowsPerBlock - 1) / kStatsRowsPerBlock,",
        "N / kStatsRowsPerBlock,", "chosen_logprob",
        lambda d, tmp: chosen_logprob_cases.test_chosen_logprob_stats_rows(d, tmp, 21, 45, "one", 1.0),
        "vocab_parallel_stats_rows_kernel: 2 grid-stride passes", "plain"),
    # 300 rows: 1 block of 256.
    "combine_grid_floor": (
        "chosen_logprob/kernel.cu", "(N + kCombineThreads - 1) / kCombineThreads,",
        "N / kCombineThreads,", "chosen_logprob",
        lambda d, tmp: chosen_logprob_cases.test_chosen_logprob_combine(d, tmp, 3, 300, "one"),
        "chosen_logprob_combine_kernel: 2 grid-stride passes", "plain"),
    # row_launch (grad_rows, clamped_swiglu, value_head backward_hidden): 70 rows in tiles of 16.
    "row_launch_grid_floor": (
        "common/cuda_utils.cuh", "(rows + ty - 1) / ty}", "rows / ty}", "value_head",
        lambda d, tmp: value_head_cases.test_value_head_forward_and_backward_hidden(
            d, tmp, 70, 40, "one", 0, True, torch.float32),
        "value_head_backward_hidden_kernel: 2 grid-stride passes", "plain"),
    # 70 rows: 8 blocks of 8.
    "value_head_forward_grid_floor": (
        "value_head/kernel.cu", "(rows + kForwardWarps - 1) / kForwardWarps,",
        "rows / kForwardWarps,", "value_head",
        lambda d, tmp: value_head_cases.test_value_head_forward_and_backward_hidden(
            d, tmp, 70, 40, "one", 0, True, torch.float32),
        "value_head_forward_kernel: 2 grid-stride passes", "plain"),
    # vocab_divergence's stats loop reading one column past both models' rows (45 columns, the scalar path).
    "divergence_stats_loop_bound_le": (
        "vocab_divergence/kernel.cuh",
        "k < C; k += kWarp * kWidth) {\n      float zs[kWidth], zt[kWidth];\n"
        "      mapped_pair(xs, xt, k, student, teacher, zs, zt);\n      side_add_online",
        "k <= C; k += kWarp * kWidth) {\n      float zs[kWidth], zt[kWidth];\n"
        "      mapped_pair(xs, xt, k, student, teacher, zs, zt);\n      side_add_online",
        "vocab_divergence",
        lambda d, tmp: vocab_divergence_cases.test_vocab_divergence_stats_rows(d, tmp, 21, 45, "several",
                                                                               vocab_divergence_cases.MAPS[0]),
        "AddressSanitizer: heap-buffer-overflow", "asan_ubsan"),
    # grad_rows taking the slope of the teacher's logit map for the student's: wrong gradients where
    # the maps differ (the case caps the student's logits only).
    "divergence_grad_slope_of_the_wrong_map": (
        "vocab_divergence/kernel.cuh", "* g * student.slope(x)", "* g * teacher.slope(x)", "vocab_divergence",
        lambda d, tmp: vocab_divergence_cases.test_vocab_divergence_grad_rows(d, tmp, 20, 45, "several", 4, 0, None),
        "logit gradients", "plain"),
    # vocab_divergence's online pass raising a Side's maximum without moving its sums to it (rows in
    # ascending order raise it at every access).
    "divergence_online_rescale_skipped": (
        "vocab_divergence/math.h", "const T a = Math<T>::exp(side.max - m);", "const T a = T(1);", "vocab_divergence",
        lambda d, tmp: vocab_divergence_cases.test_vocab_divergence_stats_rows_online(d, tmp, "ascending", 520, 0),
        "lse: ", "plain"),
    # vocab_divergence's grad_rows launcher taking the vector path without checking the buffer's
    # alignment (bf16 gradients from column 6: 12 bytes past a boundary).
    "divergence_grad_alignment_unchecked": (
        "vocab_divergence/kernel.cu", "is_aligned(p.grads, sizeof(Pack<G, kPackWidth>))", "true", "vocab_divergence",
        lambda d, tmp: vocab_divergence_cases.test_vocab_divergence_grad_rows(d, tmp, 20, 64, "one", 6, 0,
                                                                              torch.bfloat16),
        "misaligned address", "asan_ubsan"),
    # The warp-per-row kernels' grid (21 rows: 3 blocks of 8).
    "divergence_rows_grid_floor": (
        "vocab_divergence/kernel.cu", "(p.rows + kRowsPerBlock - 1) / kRowsPerBlock,", "p.rows / kRowsPerBlock,",
        "vocab_divergence",
        lambda d, tmp: vocab_divergence_cases.test_vocab_divergence_stats_rows(d, tmp, 21, 45, "one",
                                                                               vocab_divergence_cases.MAPS[0]),
        "vocab_divergence_stats_rows_kernel: 2 grid-stride passes", "plain"),
    # grid_for taking the occupancy calculator's 0 blocks per SM (the "several" stand-in device holds
    # one thread per SM) as is: a grid of no blocks, a launch error.
    "occupancy_of_zero_kept": (
        "common/cuda_utils.cuh", "(per_sm > 0 ? per_sm : 1)", "per_sm", "chosen_logprob",
        lambda d, tmp: chosen_logprob_cases.test_chosen_logprob_stats_rows(d, tmp, 21, 45, "several", 1.0),
        "launch returned error", "plain"),
    # Stage 1's column tiles: 300 columns (the scalar path) in 9 tiles of 32, the last 12 lost.
    "partials_columns_floor": (
        "value_head/kernel.cu", "(H / N + kWarp - 1) / kWarp", "H / N / kWarp", "value_head",
        lambda d, tmp: value_head_cases.test_value_head_backward_params(d, tmp, 130, 300, 1, torch.float32),
        "stage 1 weight partials", "plain"),
    # Stage 2's column tiles: the bias's one column gets a grid of 0 blocks, a launch error.
    "sum_partials_columns_floor": (
        "value_head/kernel.cu", "(cols + kWarp - 1) / kWarp", "cols / kWarp", "value_head",
        lambda d, tmp: value_head_cases.test_value_head_backward_params(d, tmp, 130, 40, 0, torch.float32),
        "launch returned error", "plain"),
}


def code_pattern(code):
    """A regex of code's tokens (words, and each other character but whitespace) in order, with any
    whitespace between them (at least some between two words)."""
    tokens = re.findall(r"\w+|[^\w\s]", code)
    pattern = re.escape(tokens[0])
    for before, token in zip(tokens, tokens[1:]):
        two_words = re.fullmatch(r"\w+", before) and re.fullmatch(r"\w+", token)
        pattern += (r"\s+" if two_words else r"\s*") + re.escape(token)
    return pattern


def plant(text, good, bad, path):
    """text with the one place that holds the code good replaced by bad."""
    planted, count = re.subn(code_pattern(good), lambda _: bad, text)
    assert count == 1, f"{path} holds the code this defect changes {count} times, not once"
    return planted


def build_planted(defect, out_dir):
    """The driver of the defect's op, built in its one build from a copy of csrc holding the defect."""
    path, good, bad, op, _, _, variant = DEFECTS[defect]
    csrc = out_dir / "csrc"
    shutil.copytree(CSRC, csrc)
    (csrc / path).write_text(plant((csrc / path).read_text(), good, bad, path))
    return build_drivers(csrc, out_dir / "build", drivers=(op,), variants=(variant,))


@pytest.fixture(scope="module")
def planted_drivers(request, tmp_path_factory):
    """The drivers of the defects this session runs, built in the background (tests.helpers.background)."""
    root = tmp_path_factory.mktemp("planted")
    with background_compiles(request.session, "test_planted_defect_is_caught",
                             lambda params: (params["defect"], build_planted, params["defect"],
                                             root / params["defect"])) as compiles:
        yield compiles


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_planted_defect_is_caught(tmp_path, planted_drivers, defect):
    case, report = DEFECTS[defect][4:6]
    drivers = planted_drivers.result(defect)
    with pytest.raises(AssertionError, match=re.escape(report)):
        case(drivers, tmp_path)


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_planted_defects_survive_a_reformat(defect):
    """The code of each defect is still found, once, in its file laid out otherwise: all on one line,
    or broken after every bracket and comma."""
    path, good, bad, *_ = DEFECTS[defect]
    text = (CSRC / path).read_text()
    for reformatted in (re.sub(r"\s+", " ", text), re.sub(r"([(\[{,])\s*", "\\1\n      ", text)):
        assert bad in plant(reformatted, good, bad, path)
