"""vocab_divergence: fused against the naive path (both models' logits materialised,
fused_rl_ops.reference.vocab_divergence), torch.compile of it, Liger's LigerFusedLinearJSDLoss (jsd,
weight_hard_loss=0, compiled=False: its chunks in eager torch) and the op's six GEMMs run plainly
(two logits forward; both logits again, the hidden and weight gradients backward), forward+backward,
and the fused path at masked fractions of positions. Memory: the peak resident growth of forward +
backward of fused and naive, each in a fresh process (CPU).

The main shape: (2048, 512, 32768) fp32 on the CPU; on CUDA the training shape (8192, 4096, 131072)
bf16, without torch.compile of the naive path (its compile would take the GPU run's budget), with
each path's extra peak memory (torch.cuda.max_memory_allocated beyond the inputs, the gradients
included) beside its time. The issue's goals are goal_* columns of the rows, printed as MET / NOT
MET at the end and described in the JSON ("goals"): fused at most 1.1x the six GEMMs and 1.3x
naive (forward_kl), with 3/4 of positions masked at most 0.45x of none masked, extra memory at
most 1/8 of naive's. --quick runs a tiny shape (256, 64, 2048), where fixed costs dominate: it
reports the same figures and judges no goal (goals.py). The plot (--json PATH -> PATH.png) draws
every path's time per kind and the two paths' extra memory. --contention runs alone: the CPU path
(forward_kl) against its six GEMMs with a core taken (benchmarks/contention.py). --tp N runs alone:
forward+backward (forward_kl) with batch_invariant=True against the default path over N gloo ranks
of one thread each on the CPU (benchmarks/tensor_parallel.py)."""
import torch

import fused_rl_ops
from fused_rl_ops import reference

from . import contention, goals, tensor_parallel
from .plots import bars_figure
from .results import RowLog, find_peers, parse_args, png_path, write_json
from .tables import summary_table
from .timing import fwd_bwd, record_times, time_paths

GOALS = {  # column -> (what it checks, its verdict on a row): the goals of issue 38
    "goal_six_gemms<=1.1x": ("forward_kl: fused time at most 1.1x the op's six GEMMs run plainly",
                             lambda r: r["x_six_gemms"] <= 1.1 if r.get("kind") == "forward_kl" else None),
    "goal_naive<=1.3x": ("forward_kl: fused time at most 1.3x the naive path's",
                         lambda r: r["x_naive"] <= 1.3 if r.get("kind") == "forward_kl" else None),
    "goal_75%masked<=0.45x": ("forward_kl: fused time with 3/4 of positions masked at most 0.45x of none masked",
                              lambda r: r["masked_0.75/none"] <= 0.45 if r.get("kind") == "forward_kl" else None),
    "goal_mem<=naive/8": ("fused extra peak memory at most 1/8 of naive's",
                          lambda r: r["fused/naive_mem"] <= 1 / 8 if "fused/naive_mem" in r else None),
}
HEADLINE = (("fused / six GEMMs time", "x_six_gemms"), ("fused / naive time", "x_naive"),
            ("3/4 masked / none masked fused time", "masked_0.75/none"),
            ("fused / naive extra memory", "fused/naive_mem"))
MASKED_FRACTIONS = (0.0, 0.5, 0.75)


def make_inputs(N, H, V, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(device, dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(device, dtype).requires_grad_(True)
    teacher_hidden = (hidden.detach() + 0.3 * torch.randn(N, H, generator=g).to(device, dtype))
    teacher_weight = (weight.detach() + 0.3 / H**0.5 * torch.randn(V, H, generator=g).to(device, dtype))
    return hidden, weight, teacher_hidden, teacher_weight


def mask_of(N, fraction, device):
    """Positions masked out at the given fraction, spread through the rows."""
    return (torch.arange(N, device=device) * fraction) % 1 >= fraction if fraction else None


def six_gemms(hidden, weight, teacher_hidden, teacher_weight):
    """The op's GEMMs run plainly, fp32 logits: two forward, four backward."""
    grads = torch.empty(hidden.shape[0], weight.shape[0], device=hidden.device, dtype=hidden.dtype)

    def run():
        with torch.no_grad():
            for _ in range(2):
                hidden @ weight.T
                teacher_hidden @ teacher_weight.T
            grads @ weight
            grads.T @ hidden

    return run


def liger_loader(kind):
    def load():
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        if kind != "jsd":
            raise RuntimeError("Liger's fused linear distillation loss is a JSD")
        loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5, compiled=False)
        return lambda h, w, th, tw: loss(h, w, th, tw, torch.zeros(h.shape[0], dtype=torch.long, device=h.device))
    return load


def paths_for(kind, inputs, grad, compiled=True):
    """name -> a forward+backward closure of each path at this kind (compiled: with torch.compile of
    the naive path)."""
    fused = lambda h, w, th, tw: fused_rl_ops.vocab_divergence(h, w, th, tw, kind=kind)  # noqa: E731
    naive = lambda h, w, th, tw: reference.vocab_divergence(h, w, th, tw, kind=kind)  # noqa: E731
    peers, versions = find_peers({"liger": ("liger-kernel", liger_loader(kind))})
    fns = {"fused": fused, "naive": naive, **({"compiled": torch.compile(naive)} if compiled else {}), **peers}
    # fwd_bwd passes only the student's tensors: the teacher's ride in the closure.
    runs = {name: fwd_bwd(lambda h, w, fn=fn: fn(h, w, *inputs[2:]), list(inputs[:2]),
                          None if name == "liger" else [grad]) for name, fn in fns.items()}
    runs["six_gemms"] = six_gemms(*inputs)
    return runs, versions


def contention_paths(N, H, V, dtype) -> dict:
    """--contention's "fused" forward+backward (forward_kl) and "gemms", the op's six GEMMs."""
    inputs = make_inputs(N, H, V, dtype, "cpu")
    fused = fwd_bwd(lambda h, w: fused_rl_ops.vocab_divergence(h, w, *inputs[2:], kind="forward_kl"),
                    list(inputs[:2]), [torch.randn(N)])
    return {"fused": fused, "gemms": six_gemms(*inputs)}


def cuda_peak_mib(run) -> float:
    """Extra peak CUDA memory (MiB) of one call of run, beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _peak_growth(path, N, H, V, kind):
    """Peak resident growth of one forward+backward of a path, in this (fresh) process."""
    from .peak_memory import peak_rss_growth

    fn = fused_rl_ops.vocab_divergence if path == "fused" else reference.vocab_divergence
    small = make_inputs(16, H, 256, torch.float32, "cpu")
    fwd_bwd(lambda h, w: fn(h, w, *small[2:], kind=kind), list(small[:2]), [torch.ones(16)])()  # pools, BLAS
    inputs = make_inputs(N, H, V, torch.float32, "cpu")
    return peak_rss_growth(fwd_bwd(lambda h, w: fn(h, w, *inputs[2:], kind=kind), list(inputs[:2]),
                                   [torch.ones(N)]))


def figure(rows: list, device: str, path):
    """forward+backward time of every path for each kind, and the extra peak memory of fused and
    naive where it was measured (CPU)."""
    timed = [r for r in rows if "kind" in r]
    paths = list(dict.fromkeys(c[:-len("_ms")] for r in timed for c in r
                               if c.endswith("_ms") and not c.endswith("_iqr_ms")))
    panels = [{"title": "forward+backward time", "ylabel": "ms",
               "groups": [r["kind"] + (" !" if r.get("busy") else "") for r in timed],
               "values": {p: [r.get(f"{p}_ms") for r in timed] for p in paths}}]
    panels += [{"title": "extra peak memory of forward+backward", "ylabel": "MiB", "groups": ["forward_kl"],
                "values": {p: [r[f"{p}_peak_MiB"]] for p in ("fused", "naive")}} for r in rows if "fused_peak_MiB" in r]
    shape = "N={N} H={H} V={V}".format(**timed[0])
    bars_figure(panels, f"vocab_divergence, {shape} fp32, on {device}", path, busy=any(r.get("busy") for r in timed))


def options(parser):
    parser.add_argument("--contention", action="store_true",
                        help="the CPU path with a core taken only (benchmarks/contention.py)")
    parser.add_argument("--tp", type=int, metavar="N",
                        help="only the cost of batch_invariant=True at tensor-parallel degree N (N gloo ranks of one "
                             "thread each on the CPU; benchmarks/tensor_parallel.py)")


def main():
    from .peak_memory import in_fresh_process

    args = parse_args(__doc__, options)
    log, dev = RowLog(args.json), args.device
    if args.contention:
        return contention.run_contention("vocab_divergence", args, log, contention_paths)
    if args.tp:
        return tensor_parallel.run_tensor_parallel("vocab_divergence", ("vocab_divergence",), args, log)
    training = dev == "cuda" and not args.quick
    N, H, V = (256, 64, 2048) if args.quick else (8192, 4096, 131072) if training else (2048, 512, 32768)
    dtype, reps = torch.bfloat16 if training else torch.float32, 2 if args.quick else 5
    inputs = make_inputs(N, H, V, dtype, dev)
    grad = torch.randn(N, device=dev)
    rows, versions = [], {}
    for kind in ("forward_kl", "jsd"):
        runs, versions = paths_for(kind, inputs, grad, compiled=not training)
        for fraction in MASKED_FRACTIONS[1:]:
            mask = mask_of(N, fraction, dev)
            runs[f"masked_{fraction}"] = fwd_bwd(
                lambda h, w, mask=mask: fused_rl_ops.vocab_divergence(h, w, *inputs[2:], kind=kind, mask=mask),
                list(inputs[:2]), [grad])
        times = time_paths(runs, dev, reps=reps)
        row = record_times({"N": N, "H": H, "V": V, "dtype": str(dtype).removeprefix("torch."), "kind": kind,
                            "mode": "fwd+bwd"}, times)
        for name in times:
            row[f"x_{name}"] = row["fused_ms"] / row[f"{name}_ms"]
        row["masked_0.75/none"] = row["masked_0.75_ms"] / row["fused_ms"]
        if dev == "cuda":
            for name in ("fused", "naive", "liger"):
                if name in runs:
                    for t in inputs[:2]:  # the gradients count as extra memory, as the run makes them anew
                        t.grad = None
                    row[f"{name}_MiB"] = cuda_peak_mib(runs[name])
            row["fused/naive_mem"] = row["fused_MiB"] / row["naive_MiB"]
        rows.append(log("results", row))
    if dev == "cpu":
        memory = {path: in_fresh_process(_peak_growth, path, N, H, V, "forward_kl") for path in ("fused", "naive")}
        rows.append(log("memory", {**{f"{path}_peak_MiB": b / 2**20 for path, b in memory.items()},
                                   "fused/naive_mem": memory["fused"] / memory["naive"]}))
    goals.judge(rows, GOALS, args.quick)
    timed, memory = rows[:2], rows[2:]
    tables = [summary_table("vocab_divergence, forward+backward (x_<path> = fused time / path time)", timed,
                            ["kind", "fused_ms", "naive_ms", "compiled_ms", "six_gemms_ms", "x_naive", "x_six_gemms"]
                            + [c for c in ("liger_ms", "x_liger") if c in timed[1]]
                            + [f"masked_{f}_ms" for f in MASKED_FRACTIONS[1:]] + ["masked_0.75/none"]
                            + [c for c in ("fused_MiB", "naive_MiB", "liger_MiB", "fused/naive_mem") if c in timed[0]]
                            + goals.judged_columns(timed, GOALS))]
    if memory:
        tables.append(summary_table("vocab_divergence, extra peak memory of forward+backward (forward_kl, MiB)",
                                    memory, ["fused_peak_MiB", "naive_peak_MiB", "fused/naive_mem"]
                                    + goals.judged_columns(memory, GOALS)))
    goals.print_verdicts(rows, GOALS, args.quick)
    plot_file = png_path(args.json)
    if plot_file:
        figure(rows, dev, plot_file)
    headline = [{"metric": f"forward_kl: {what}, N={N} H={H} V={V}", "value": r[column], "busy": r.get("busy", False)}
                for what, column in HEADLINE for r in (timed[0], *memory) if column in r]
    write_json(args.json, "vocab_divergence", dev, rows, headline=headline, tables=tables, peers=versions,
               goals=goals.described(GOALS, args.quick), plot=plot_file, quick=args.quick)


if __name__ == "__main__":
    main()
