"""chosen_logprob vs the naive path (materialised logits + log_softmax + gather) and Megatron's
vocab_parallel_cross_entropy (TP=1; it also materialises the logits, and has no entropy).
fused_invariant is chosen_logprob(batch_invariant=True); invariant/fused is its time over the
default's (the cost of batch invariance), both timed in the same interleaved rounds.

Reports time (forward, forward+backward; with and without entropy), extra peak memory beyond the
inputs (CPU: peak RSS growth in a fresh process; CUDA: max_memory_allocated), the max error of the
logprob against float64 on the first tokens, effective TFLOP/s counting 2*N*H*V forward and
8*N*H*V forward+backward, and a PNG of peak memory and time against V."""
import json
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

import fused_rl_ops
from fused_rl_ops import reference
from common import parse_args, print_table, synchronize, time_paths, write_json


def extra_args(parser):
    parser.add_argument("--peak-of", help=argparse_suppress(), nargs=6)
    parser.add_argument("--no-plot", action="store_true")


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def make_inputs(N, H, V, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(device, dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 2).to(device, dtype)
    tokens = torch.randint(0, V, (N,), generator=g).to(device)
    return hidden, weight, tokens


def init_megatron(device):
    from megatron.core import parallel_state

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1)


def megatron_logprob(hidden, weight, tokens):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = (hidden @ weight.T).float()
    return -vocab_parallel_cross_entropy(logits[:, None], tokens[:, None]).squeeze(1)


def path_fn(path, entropy):
    """fn(hidden, weight, tokens) -> tuple of differentiable outputs."""
    if path in ("fused", "fused_invariant"):
        kw = dict(batch_invariant=path == "fused_invariant")
        return lambda h, w, t: fused_rl_ops.chosen_logprob(h, w, t, return_entropy=True, **kw) if entropy else (
            fused_rl_ops.chosen_logprob(h, w, t, **kw),)
    if path == "naive":
        return lambda h, w, t: reference.chosen_logprob(h, w, t) if entropy else reference.chosen_logprob(h, w, t)[:1]
    return lambda h, w, t: (megatron_logprob(h, w, t),)


def run_once(path, entropy, mode, hidden, weight, tokens):
    fn = path_fn(path, entropy)

    def run():
        if mode == "fwd":
            with torch.no_grad():
                fn(hidden, weight, tokens)
            return
        h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        outs = fn(h, w, tokens)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return run


def peak_bytes(path, N, H, V, dtype, device):
    """Extra peak memory of one forward+backward with entropy (CPU: in a fresh process)."""
    if device == "cuda":
        hidden, weight, tokens = make_inputs(N, H, V, dtype, device)
        synchronize(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run_once(path, path != "megatron", "fwd+bwd", hidden, weight, tokens)()
        synchronize(device)
        return torch.cuda.max_memory_allocated() - base
    out = subprocess.run([sys.executable, __file__, "--peak-of", path, str(N), str(H), str(V), str(dtype), device],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def rss_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_in_this_process(path, N, H, V, dtype, device):
    if path == "megatron":
        init_megatron(device)
    dtype = getattr(torch, dtype.replace("torch.", ""))
    run_once(path, path != "megatron", "fwd+bwd", *make_inputs(64, H, 256, dtype, device))()  # one-time costs
    hidden, weight, tokens = make_inputs(N, H, V, dtype, device)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
    before = rss_kib("VmRSS")
    run_once(path, path != "megatron", "fwd+bwd", hidden, weight, tokens)()
    print((rss_kib("VmHWM") - before) * 1024)


def max_error(path, hidden, weight, tokens, rows=256):
    h, t = hidden[:rows], tokens[:rows]
    ref, _ = reference.chosen_logprob(h.double(), weight.double(), t)
    with torch.no_grad():
        got = path_fn(path, False)(h, weight, t)[0]
    return (got.double() - ref).abs().max().item()


def optional_baselines(device):
    """Liger-Kernel / cut-cross-entropy on CUDA when importable (logprob = -per-token CE)."""
    found = {}
    if device != "cuda":
        return found
    try:
        from cut_cross_entropy import linear_cross_entropy

        found["cce"] = lambda h, w, t: (-linear_cross_entropy(h, w, t, reduction="none"),)
    except ImportError:
        pass
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        found["liger"] = lambda h, w, t: (-liger_fused_linear_cross_entropy(h, w, t, reduction="none"),)
    except ImportError:
        pass
    return found


def main():
    args = parse_args(__doc__, extra_args)
    if args.peak_of:
        path, N, H, V, dtype, device = args.peak_of
        peak_in_this_process(path, int(N), int(H), int(V), dtype, device)
        return
    dev = args.device
    if dev == "cpu":
        shapes = [(256, 128, 8192)] if args.quick else [(2048, 512, 32768), (4096, 1024, 65536)]
        dtype, sweep = torch.float32, (1024, 256, [4096, 8192, 16384, 32768])
    else:
        shapes = [(2048, 1024, 32768)] if args.quick else [(8192, 4096, 131072)]
        dtype, sweep = torch.bfloat16, (4096, 4096, [32768, 65536, 131072, 262144])
    reps = 1 if dev == "cpu" else 5
    init_megatron(dev)
    extra = optional_baselines(dev)

    rows = []
    for N, H, V in shapes:
        hidden, weight, tokens = make_inputs(N, H, V, dtype, dev)
        for entropy in (False, True):
            for mode in ("fwd", "fwd+bwd"):
                row = {"N": N, "H": H, "V": V, "dtype": str(dtype).replace("torch.", ""), "entropy": entropy,
                       "mode": mode}
                paths = {path: run_once(path, entropy, mode, hidden, weight, tokens)
                         for path in ["fused", "fused_invariant", "naive"] + ([] if entropy else ["megatron"])}
                for name, fn in ({} if entropy else extra).items():
                    paths[name] = lambda fn=fn: fn(hidden, weight, tokens)
                for name, t in time_paths(paths, dev, reps=reps).items():
                    row[f"{name}_ms"] = t * 1e3
                flops = (2 if mode == "fwd" else 8) * N * H * V
                row["fused_TFLOP/s"] = flops / (row["fused_ms"] * 1e-3) / 1e12
                row["naive/fused"] = row["naive_ms"] / row["fused_ms"]
                row["invariant/fused"] = row["fused_invariant_ms"] / row["fused_ms"]
                if "megatron_ms" in row:
                    row["megatron/fused"] = row["megatron_ms"] / row["fused_ms"]
                rows.append(row)
                print_table([row], list(row))
        memory = {"N": N, "H": H, "V": V, "mode": "peak fwd+bwd"}
        for path in ("fused", "naive", "megatron"):
            memory[f"{path}_MiB"] = peak_bytes(path, N, H, V, dtype, dev) / 2**20
            memory[f"{path}_max_err"] = max_error(path, hidden, weight, tokens)
        memory["fused/naive_mem"] = memory["fused_MiB"] / memory["naive_MiB"]
        rows.append(memory)
        print_table([memory], list(memory))
        del hidden, weight, tokens

    print("\nchosen_logprob: times in ms; ratios are baseline time / fused time")
    for keys in (["N", "H", "V", "entropy", "mode", "fused_ms", "naive_ms", "megatron_ms", "fused_TFLOP/s",
                  "naive/fused", "megatron/fused"],
                 ["N", "H", "V", "entropy", "mode", "fused_ms", "fused_invariant_ms", "invariant/fused"],
                 ["N", "H", "V", "fused_MiB", "naive_MiB", "megatron_MiB", "fused/naive_mem", "fused_max_err",
                  "naive_max_err"]):
        print_table([r for r in rows if keys[-1] in r], keys)

    curve = []
    if not args.no_plot and not args.quick:
        N, H, Vs = sweep
        for V in Vs:
            hidden, weight, tokens = make_inputs(N, H, V, dtype, dev)
            point = {"N": N, "H": H, "V": V}
            times = time_paths({path: run_once(path, True, "fwd+bwd", hidden, weight, tokens)
                                for path in ("fused", "naive")}, dev, reps=reps)
            for path, t in times.items():
                point[f"{path}_ms"] = t * 1e3
                point[f"{path}_MiB"] = peak_bytes(path, N, H, V, dtype, dev) / 2**20
            curve.append(point)
        print_table(curve, list(curve[0]))
        if args.json:
            plot(curve, os.path.splitext(args.json)[0] + ".png", dev)
    write_json(args.json, "chosen_logprob", dev, rows, sweep=curve)


def plot(curve, path, device):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
    V = [p["V"] for p in curve]
    for name in ("fused", "naive"):
        ax_mem.plot(V, [p[f"{name}_MiB"] for p in curve], marker="o", label=name)
        ax_time.plot(V, [p[f"{name}_ms"] for p in curve], marker="o", label=name)
    ax_mem.set(xlabel="vocab size V", ylabel="extra peak memory (MiB)", xscale="log", title="peak memory, fwd+bwd")
    ax_time.set(xlabel="vocab size V", ylabel="time (ms)", xscale="log", title="time, fwd+bwd with entropy")
    for ax in (ax_mem, ax_time):
        ax.legend()
    fig.suptitle(f"chosen_logprob on {device}, N={curve[0]['N']}, H={curve[0]['H']}")
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
