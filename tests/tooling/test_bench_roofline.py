"""The roofline expectation of benchmarks/bench_chosen_logprob.py (benchmarks/roofline.py): its
arithmetic at the CUDA benchmark's shape against a count by hand and the figures
docs/chosen_logprob.md gives, and the benchmark printing it beside each timed row, run on the CPU
with an H200's ceilings standing in for a CUDA device's."""
import re
from pathlib import Path

import pytest
import torch

from benchmarks import bench_chosen_logprob as bench
from benchmarks.results import RowLog
from benchmarks import roofline

H200 = roofline.DEVICES["H200"]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "chosen_logprob.md"


def test_the_roofline_at_the_cuda_benchmark_shape():
    """(8192, 4096, 131072) bf16 forward+backward with the default 64 MiB workspace: chunks of 1024
    (128), gradient GEMMs over two (64); four GEMM kinds of 2NHV FLOPs at 790 TFLOP/s; the memory
    kernels' bytes at 4.3 TB/s; 2 us per launch."""
    N, H, V = 8192, 4096, 131072
    kernels = roofline.chosen_logprob_kernels(N, H, V, torch.bfloat16, "fwd+bwd")
    gemm_ms = 2 * N * H * V / 790e12 * 1e3
    memory_ms = {  # fp32 logits read by stats_rows; read, and bf16 gradients written, by grad_rows
        "stats_rows": (4 * N * V + 128 * N * 40) / 4.3e12 * 1e3,
        "grad_rows": (4 * N * V + 2 * N * V + 128 * N * 28) / 4.3e12 * 1e3,
        "hidden gradient: zero, cast": (4 * N * H + 6 * N * H) / 4.3e12 * 1e3,
    }
    launches = 4 * 128 + 2 * 64 + 2
    expected = 4 * gemm_ms + sum(memory_ms.values()) + launches * 2e-3
    got = roofline.expected_ms(kernels, torch.bfloat16, H200)
    assert got["launches"] == launches
    assert got["roofline_ms"] == pytest.approx(expected, rel=1e-12)
    # Serial: each GEMM's epilogue after its main loop: the logits written twice, the fp32 hidden
    # gradient read and written by each of 64 GEMMs, the bf16 weight gradient written once.
    epilogue_ms = (2 * 4 * N * V + 64 * 8 * N * H + 2 * V * H) / 4.3e12 * 1e3
    assert got["roofline_serial_ms"] == pytest.approx(expected + epilogue_ms, rel=1e-12)
    # The figures docs/chosen_logprob.md gives ("roofline 50.9 / 48.4 ms, serial 61.2 / 54.7 ms").
    row = re.search(r"\| forward \+ backward \| 898 / (\d+) \| \| roofline [\d.]+ / ([\d.]+) ms, serial [\d.]+ / "
                    r"([\d.]+) ms \|", DOCS.read_text())
    assert row, "the docs' row of totals"
    assert (int(row[1]), float(row[2]), float(row[3])) == (
        got["launches"], round(got["roofline_ms"], 1), round(got["roofline_serial_ms"], 1))


def test_fp32_gemms_run_at_the_rate_torch_allows():
    assert roofline.gemm_rate_key(torch.bfloat16) == "bf16"
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert roofline.gemm_rate_key(torch.float32) == "fp32"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert roofline.gemm_rate_key(torch.float32) == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_no_ceilings_off_a_known_gpu():
    assert roofline.ceilings_for("cpu") is None


def test_the_benchmark_prints_the_roofline_beside_each_timed_row(capsys):
    """The CUDA path of the benchmark's rows, on the CPU with an H200's ceilings standing in: every
    timed row carries the fused kernels' expected times and the measured one over them, printed
    beside the measured time, and the summary and breakdown tables carry them too."""
    N, H, V = 64, 32, 512
    rows = bench.timed_rows(N, H, V, torch.float32, "cpu", {}, 1, RowLog(None), ceilings=H200)
    printed = capsys.readouterr().out
    assert len(rows) == 4
    for row in rows:
        expected = roofline.expected_ms(roofline.chosen_logprob_kernels(N, H, V, torch.float32, row["mode"]),
                                        torch.float32, H200)
        assert row["fused_roofline_ms"] == expected["roofline_ms"] > 0
        assert row["fused_roofline_serial_ms"] == expected["roofline_serial_ms"] >= expected["roofline_ms"]
        assert row["fused/roofline"] == row["fused_ms"] / expected["roofline_ms"]
    headers = [line.split() for line in printed.splitlines() if line.split()[:3] == ["N", "H", "V"]]
    assert len(headers) == 4
    for header in headers:
        assert header[5:9] == ["fused_ms", "fused_roofline_ms", "fused_roofline_serial_ms", "fused/roofline"]
    time_table = bench.summary_tables(rows, ["fused", "naive"])[0]
    assert {"fused_roofline_ms", "fused_roofline_serial_ms", "fused/roofline"} <= set(time_table["columns"])
    breakdown = bench.roofline_table(N, H, V, torch.float32, H200)
    assert [r["kernel"] for r in breakdown["rows"]] == [k.name for k in roofline.chosen_logprob_kernels(
        N, H, V, torch.float32, "fwd+bwd")]
    # Without ceilings (the CPU, an unknown GPU) no roofline column.
    assert not any("roofline" in c for c in bench.timed_rows(N, H, V, torch.float32, "cpu", {}, 1, RowLog(None))[0])
