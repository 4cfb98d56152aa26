"""What a chosen_logprob call should take on a CUDA device, from its FLOPs and bytes: the kernels
its chunk loop launches (csrc/vocab_parallel/chunk_loop.h) at the tiling fused_rl_ops.chosen_logprob
picks for the shape, each counted by its GEMM FLOPs and the bytes it moves in device memory.

Two figures per call, bounds of what the design allows on the device:
  - roofline_ms: each kernel at the larger of its GEMM time (FLOPs over the device's matrix rate
    for the GEMM's input dtype) and its memory time (bytes over the device's copy bandwidth),
    kernels one after another, plus a gap per launch;
  - roofline_serial_ms: the same, with each GEMM's epilogue (its output written, and read too where
    it accumulates) after its main loop instead of under it.
Bytes are counted as if nothing stayed in L2 between kernels (a chunk of fp32 logits may, and the
row kernel then reads it faster), and the small per-token kernels of the Python wrapper (about a
dozen, each moving O(tokens) bytes) are left out."""
import math
from dataclasses import dataclass

import torch

from fused_rl_ops._vocab_parallel.tiling import default_workspace_bytes, tiling_for


@dataclass(frozen=True)
class Ceilings:
    """A device's ceilings: dense matrix TFLOP/s by the GEMM's input dtype (bf16 and fp16 on tensor
    cores with fp32 accumulation; tf32; fp32 on CUDA cores, torch's default for fp32 GEMMs),
    device-to-device copy bandwidth (bytes read plus written per second), the gap between two
    kernels on a stream, and where the figures come from."""
    name: str
    tflops: dict
    copy_gbs: float
    launch_gap_us: float
    source: str


# By the name torch.cuda.get_device_name() gives (a substring of it).
DEVICES = {
    "H200": Ceilings(
        "NVIDIA H200", {"bf16": 790.0, "fp16": 790.0, "tf32": 494.0, "fp32": 67.0}, 4300.0, 2.0,
        "bf16: an 8192^3 torch.mm measured at 769-798 TFLOP/s (989 dense peak); fp16 taken as bf16; tf32 and fp32: "
        "the datasheet's dense peaks (494, 67); copy: a device-to-device copy measured at 4.3 TB/s; the launch gap "
        "is an assumption"),
}


def ceilings_for(device: str):
    """The Ceilings of the current CUDA device, or None (the CPU, a GPU not in DEVICES)."""
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((c for key, c in DEVICES.items() if key in name), None)


def gemm_rate_key(dtype: torch.dtype) -> str:
    """The rate a GEMM with inputs of dtype runs at: fp32 GEMMs use tf32 only where torch allows it."""
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


@dataclass(frozen=True)
class Kernel:
    """One kind of kernel of a call: its launches, GEMM FLOPs (0: not a GEMM), the bytes it moves
    in all, and of those the GEMM epilogue's (output written, and read where it accumulates)."""
    name: str
    launches: int
    flops: float
    bytes: float
    epilogue_bytes: float = 0.0


def chosen_logprob_kernels(N: int, H: int, V: int, dtype: torch.dtype, mode: str, workspace_bytes=None) -> list:
    """The kernels of one chosen_logprob call on CUDA (default path: one GEMM of the pass's tokens per
    chunk, all N tokens in one pass or equal passes at long context) at (N, H, V) with inputs of
    dtype; mode "fwd" or "fwd+bwd"."""
    if workspace_bytes is None:
        workspace_bytes = default_workspace_bytes(torch.empty(N, H, dtype=dtype, device="meta"),
                                                  device=torch.device("cuda"))
    e = torch.empty(0, dtype=dtype).element_size()
    tiling = tiling_for(N, H, e, workspace_bytes, torch.device("cuda"), False)
    chunk, grad_chunks = tiling.chunk_size, tiling.grad_chunks
    group = chunk * grad_chunks
    # Passes of pass_rows rows (the padding rows of a last pass computed too): each GEMM kind once
    # per chunk or group and pass; the weight gradient's fp32 [group, H] sum read and written per pass.
    passes = math.ceil(N / tiling.pass_rows) if tiling.pass_rows else 1
    rows = tiling.pass_rows or N
    N = passes * rows
    chunks, groups = passes * math.ceil(V / chunk), passes * math.ceil(V / group)
    weights = passes * e * V * H  # the weight read once per pass
    weight_sums = 8 * V * H * passes if passes > 1 else 0
    # The logit gradients: written over the fp32 logits in place, or in the inputs' dtype into
    # their own buffer (chunk_loop_bytes).
    g = 4 if e == 4 and grad_chunks == 1 else e
    logits_gemm = Kernel("logits GEMM", chunks, 2 * N * H * V, chunks * e * rows * H + weights + 4 * N * V, 4 * N * V)
    kernels = [
        logits_gemm,
        # fp32 logits read once (a warp's second pass over its row hits L1 / L2); stats [N, 4] fp32
        # read and written and the tokens read, per chunk.
        Kernel("stats_rows", chunks, 0, 4 * N * V + chunks * rows * (32 + 8)),
    ]
    if mode == "fwd":
        return kernels
    return kernels + [
        Kernel("logits GEMM, recomputed", logits_gemm.launches, logits_gemm.flops, logits_gemm.bytes,
               logits_gemm.epilogue_bytes),
        # fp32 logits read, gradients written; five fp32 per-token values and the tokens per chunk.
        Kernel("grad_rows", chunks, 0, 4 * N * V + g * N * V + chunks * rows * (20 + 8)),
        # grad_h [N, H] fp32 += d [N, group] w [group, H]: the fp32 accumulator read and written per group.
        Kernel("hidden-gradient GEMM", groups, 2 * N * H * V, g * N * V + weights + groups * 8 * rows * H,
               groups * 8 * rows * H),
        # grad_w [group, H] = d^T h: hidden read per group.
        Kernel("weight-gradient GEMM", groups, 2 * N * H * V,
               g * N * V + groups * e * rows * H + e * V * H + weight_sums, e * V * H + weight_sums),
        # grad_h zeroed at the start; cast to the inputs' dtype at the end.
        Kernel("hidden gradient: zero, cast", 2 if e < 4 else 1, 0, 4 * N * H + (4 + e) * N * H * (e < 4)),
    ]


def kernel_times(kernels: list, dtype: torch.dtype, ceilings: Ceilings) -> list:
    """Per kernel: (kernel, GEMM ms, memory ms, epilogue ms)."""
    rate = ceilings.tflops[gemm_rate_key(dtype)] * 1e12
    bandwidth = ceilings.copy_gbs * 1e9
    return [(k, 1e3 * k.flops / rate, 1e3 * k.bytes / bandwidth, 1e3 * k.epilogue_bytes / bandwidth) for k in kernels]


def expected_ms(kernels: list, dtype: torch.dtype, ceilings: Ceilings) -> dict:
    """roofline_ms and roofline_serial_ms (module docstring) of a call's kernels, with its launches."""
    times = kernel_times(kernels, dtype, ceilings)
    launches = sum(k.launches for k in kernels)
    gaps = launches * ceilings.launch_gap_us * 1e-3
    return {
        "roofline_ms": sum(max(gemm, memory) for _, gemm, memory, _ in times) + gaps,
        "roofline_serial_ms": sum(max(gemm, memory - epilogue) + epilogue for _, gemm, memory, epilogue in times)
        + gaps,
        "launches": launches,
    }


BREAKDOWN_COLUMNS = ["kernel", "launches", "GFLOP", "GB", "epilogue_GB", "gemm_ms", "memory_ms", "roofline_ms"]


def breakdown(kernels: list, dtype: torch.dtype, ceilings: Ceilings) -> list:
    """The kernels as table rows: launches, GFLOP, GB moved, and their times."""
    return [{"kernel": k.name, "launches": k.launches, "GFLOP": k.flops / 1e9, "GB": k.bytes / 1e9,
             "epilogue_GB": k.epilogue_bytes / 1e9, "gemm_ms": gemm, "memory_ms": memory,
             "roofline_ms": max(gemm, memory)} for k, gemm, memory, _ in kernel_times(kernels, dtype, ceilings)]


def main():
    """python -m benchmarks.roofline [N H V ...]: the roofline of chosen_logprob forward and
    forward+backward, bf16, on each known device (default shape: the CUDA benchmark's)."""
    import sys

    from .tables import print_table

    numbers = [int(a) for a in sys.argv[1:]] or [8192, 4096, 131072]
    for ceilings in DEVICES.values():
        for N, H, V in zip(numbers[::3], numbers[1::3], numbers[2::3]):
            for mode in ("fwd", "fwd+bwd"):
                kernels = chosen_logprob_kernels(N, H, V, torch.bfloat16, mode)
                print(f"\n{ceilings.name}, N={N} H={H} V={V} bf16 {mode}: "
                      + ", ".join(f"{k} {v:.4g}" for k, v in expected_ms(kernels, torch.bfloat16, ceilings).items()))
                print_table(breakdown(kernels, torch.bfloat16, ceilings), BREAKDOWN_COLUMNS)


if __name__ == "__main__":
    main()
