"""bench_chosen_logprob's distillation case (--distillation; issue 37 point 5): chosen_logprob with k
tokens per position (k = 1, 8, 64: a teacher's top-k ids) and top_logprobs (a model's own top k),
forward+backward, against the naive path (materialised logits, log_softmax, then gather / topk); and
the rollout sampler's kept set (chosen_logprob(kept_ids [N, 63]): the sampled token and 63 kept ids,
64 entries) against chosen_logprob with those 64 tokens (kept/k64: the renormalisation's cost) and
the naive kept set (log_softmax over the set on materialised logits, fused_rl_ops.reference.kept_set)."""
import torch

import fused_rl_ops
from fused_rl_ops.reference.kept_set import kept_set_log_softmax

from . import goals
from .chosen_logprob_paths import make_inputs, run_once
from .tables import print_row, summary_table
from .timing import record_times, time_paths

TOKENS_PER_POSITION = (1, 8, 64)
TOP_K = 64
KEPT = max(TOKENS_PER_POSITION) - 1  # with the sampled token, as many entries as the largest k
DISTILLATION_GOALS = {  # column -> (what it checks, its verdict on a row): CPU goals of issue 37
    "goal_k64": ("chosen_logprob with k = 64 at most 1.15x k = 1 (fwd+bwd)", lambda r: r["k64/k1"] <= 1.15),
    "goal_top": ("top_logprobs with k = 64 at most 1.3x chosen_logprob with one token (fwd+bwd)",
                 lambda r: r["top/k1"] <= 1.3),
}


def naive_many(hidden, weight, tokens):
    return (torch.log_softmax((hidden @ weight.T).float(), -1).gather(-1, tokens),)


def naive_top(hidden, weight, tokens):
    logp = torch.log_softmax((hidden @ weight.T).float(), -1)
    return (logp.gather(-1, logp.detach().topk(TOP_K, -1).indices),)


def naive_kept(hidden, weight, tokens):
    return (kept_set_log_softmax((hidden @ weight.T).float(), tokens[:, 0], tokens[:, 1:])[0],)


def fused_kept(hidden, weight, tokens):
    return (fused_rl_ops.chosen_logprob(hidden, weight, tokens[:, 0], kept_ids=tokens[:, 1:]),)


def measure_distillation(N, H, V, dtype, dev, reps, log) -> list:
    """One row per shape: fwd+bwd time of the fused and naive paths for each k and for top_logprobs,
    in the same rounds, and the ratios the goals read."""
    hidden, weight, _ = make_inputs(N, H, V, dtype, dev)
    g = torch.Generator().manual_seed(1)
    many = torch.randint(0, V, (N, max(TOKENS_PER_POSITION)), generator=g).to(dev)
    runs = {}
    for k in TOKENS_PER_POSITION:
        tokens = many[:, :k]
        runs[f"fused_k{k}"] = run_once(lambda h, w, t: (fused_rl_ops.chosen_logprob(h, w, t),), "fwd+bwd", hidden,
                                       weight, tokens)
        runs[f"naive_k{k}"] = run_once(naive_many, "fwd+bwd", hidden, weight, tokens)
    runs["fused_top"] = run_once(lambda h, w, t: (fused_rl_ops.top_logprobs(h, w, TOP_K)[1],), "fwd+bwd", hidden,
                                 weight, None)
    runs["naive_top"] = run_once(naive_top, "fwd+bwd", hidden, weight, None)
    # The sampled token (column 0) and its kept set: 1 + KEPT entries, the sampled token among them.
    sampled_and_kept = torch.cat([many[:, 1:2], many[:, 1:1 + KEPT]], 1)
    runs["fused_kept"] = run_once(fused_kept, "fwd+bwd", hidden, weight, sampled_and_kept)
    runs["naive_kept"] = run_once(naive_kept, "fwd+bwd", hidden, weight, sampled_and_kept)
    row = {"N": N, "H": H, "V": V, "dtype": str(dtype).replace("torch.", ""), "mode": "fwd+bwd"}
    record_times(row, time_paths(runs, dev, reps=reps))
    row["k64/k1"] = row["fused_k64_ms"] / row["fused_k1_ms"]
    row["top/k1"] = row["fused_top_ms"] / row["fused_k1_ms"]
    row["kept/k64"] = row["fused_kept_ms"] / row[f"fused_k{KEPT + 1}_ms"]
    log("distillation", row)
    print_row(row, ["N", "H", "V"] + [f"{name}_ms" for name in runs] + ["k64/k1", "top/k1", "kept/k64"])
    return [row]


def distillation_table(rows):
    names = [f"{path}_k{k}" for k in TOKENS_PER_POSITION for path in ("fused", "naive")] + [
        "fused_top", "naive_top", "fused_kept", "naive_kept"]
    return summary_table("Distillation: fwd+bwd time (ms) of chosen_logprob with k tokens per position and of "
                         f"top_logprobs (k = {TOP_K}), and of the kept set ({KEPT} ids), fused and naive; goals: "
                         + "; ".join(f"{c}: {what}" for c, (what, _) in DISTILLATION_GOALS.items()),
                         rows, ["N", "H", "V"] + [f"{n}_ms" for n in names] + ["k64/k1", "top/k1", "kept/k64"]
                         + goals.judged_columns(rows, DISTILLATION_GOALS))


def distillation_headline(rows) -> list:
    return [{"metric": f"{column} fused time, fwd+bwd, N={r['N']} H={r['H']} V={r['V']}", "value": r[column],
             "busy": r["busy"]} for r in rows for column in ("k64/k1", "top/k1", "kept/k64")]
