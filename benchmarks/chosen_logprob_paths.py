"""The paths bench_chosen_logprob compares (fused_rl_ops.chosen_logprob, the naive path and the
peers), the plain GEMMs it measures the machine's GEMM rate with, and each path's extra peak memory."""
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fused_rl_ops
from fused_rl_ops import reference
from .peak_memory import in_fresh_process, peak_rss_growth

from .results import find_peers
from .timing import synchronize


SEQUENCE = 512  # positions per sequence of an RL-shaped batch (make_inputs' masked)


def make_inputs(N, H, V, dtype, device, seed=0, masked=0.0):
    """hidden [N, H], weight [V, H] and tokens [N]. masked: the share of positions ignored (-100),
    shaped as an RL batch: the first `masked` of each run of SEQUENCE positions (its prompt)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(device, dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 2).to(device, dtype)
    tokens = torch.randint(0, V, (N,), generator=g)
    tokens[torch.arange(N) % SEQUENCE < round(masked * min(N, SEQUENCE))] = -100
    return hidden, weight, tokens.to(device)


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


def load_megatron(device):
    init_megatron(device)
    return megatron_logprob


def load_torch_lce(device):
    """torch's chunked linear_cross_entropy (options given: the chunked path, not the reference one)."""
    options = torch.nn.LinearCrossEntropyOptions()
    return lambda h, w, t: -F.linear_cross_entropy(h, w, t, reduction="none", options=options)


def load_cce(device):
    from cut_cross_entropy import linear_cross_entropy

    impl = "cce" if device == "cuda" else "torch_compile"
    return lambda h, w, t: -linear_cross_entropy(h, w, t, reduction="none", impl=impl)


def load_liger(device):
    if device != "cuda":
        raise RuntimeError("Liger-Kernel's Triton kernels run on CUDA only")
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return lambda h, w, t: -liger_fused_linear_cross_entropy(h, w, t, reduction="none")


def naive_logprob(hidden, weight, tokens):
    """The naive path as trainers run it: every row computed (the logprob of ignored tokens then
    zeroed); fused_rl_ops.reference.chosen_logprob's default leaves those rows out instead."""
    return reference.chosen_logprob(hidden, weight, tokens, skip_ignored=False)


def load_compile(device):
    torch._dynamo.config.recompile_limit = 64  # one graph per mode; dynamic shapes cover the sweeps
    return torch.compile(naive_logprob, dynamic=True)


PEERS = {  # name -> (distribution, None for torch itself; loader(device) -> fn(hidden, weight, tokens))
    "compile": (None, load_compile),
    "torch_lce": (None, load_torch_lce),
    "megatron": ("megatron-core", load_megatron),
    "cce": ("cut-cross-entropy", load_cce),
    "liger": ("liger-kernel", load_liger),
}
ENTROPY_PEERS = {"compile"}  # peers that also give the entropy


def load_peers(device):
    return find_peers({name: (dist_name, lambda loader=loader: loader(device))
                       for name, (dist_name, loader) in PEERS.items()})


def path_fn(path, entropy, peers):
    """fn(hidden, weight, tokens) -> tuple of differentiable outputs (logprob[, entropy]).
    fused_compiled: the fused call under torch.compile(fullgraph=True), as a trainer's compiled
    step would make it (a new compilation per call of path_fn)."""
    if path == "fused_compiled":
        return torch.compile(path_fn("fused", entropy, peers), fullgraph=True)
    if path in ("fused", "fused_invariant"):
        kw = dict(batch_invariant=path == "fused_invariant")
        return lambda h, w, t: fused_rl_ops.chosen_logprob(h, w, t, return_entropy=True, **kw) if entropy else (
            fused_rl_ops.chosen_logprob(h, w, t, **kw),)
    if path in ("naive", "compile"):
        fn = naive_logprob if path == "naive" else peers["compile"]
        return lambda h, w, t: fn(h, w, t) if entropy else fn(h, w, t)[:1]
    fn = peers[path]
    return lambda h, w, t: (fn(h, w, t),)


def paths_for(entropy, peers):
    return ["fused", "naive"] + [p for p in peers if p in ENTROPY_PEERS or not entropy]


def run_once(fn, mode, hidden, weight, tokens):
    def run():
        if mode == "fwd":
            with torch.no_grad():
                fn(hidden, weight, tokens)
            return
        h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        outs = fn(h, w, tokens)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return run


def gemm_runs(hidden, weight) -> dict:
    """mode -> a closure running the plain GEMMs of a path that keeps the logits, into outputs
    allocated here: forward the logits [N, H] x [H, V]; forward+backward also the hidden gradient
    [N, V] x [V, H] and the weight gradient [V, N] x [N, H] (the logits buffer standing in for their
    gradient); "fused fwd+bwd", the fused op's four, the logits computed again as its backward does."""
    logits = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.empty_like(weight)

    def forward():
        torch.mm(hidden, weight.T, out=logits)

    def forward_backward():
        forward()
        torch.mm(logits, weight, out=grad_hidden)
        torch.mm(logits.T, hidden, out=grad_weight)

    def recomputed():
        forward()
        forward_backward()

    return {"fwd": forward, "fwd+bwd": forward_backward, "fused fwd+bwd": recomputed}


def peak_mib(path, shapes, dtype, device, peers, entropy=False, masked=0.0) -> list:
    """Extra peak memory (MiB) of one forward+backward (logprob only, or with entropy) per (N, H, V)
    in shapes, beyond the inputs (the gradients included), with `masked` of the positions ignored
    (make_inputs): CUDA's max_memory_allocated, or on the CPU the peak resident memory growth in
    one fresh process per path."""
    if device != "cuda":
        return [b / 2**20 for b in in_fresh_process(peak_bytes_in_this_process, path, shapes, dtype, device,
                                                    entropy, masked)]
    peaks = []
    for N, H, V in shapes:
        hidden, weight, tokens = make_inputs(N, H, V, dtype, device, masked=masked)
        synchronize(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run_once(path_fn(path, entropy, peers), "fwd+bwd", hidden, weight, tokens)()
        synchronize(device)
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
        del hidden, weight, tokens
    return peaks


def peak_bytes_in_this_process(path, shapes, dtype, device, entropy=False, masked=0.0) -> list:
    """The peak resident memory growth (bytes) of each shape's forward+backward, after a small call
    that pays the one-time costs (thread pools, BLAS buffers, compiling)."""
    peers = {path: PEERS[path][1](device)} if path in PEERS else {}
    fn = path_fn(path, entropy, peers)
    peaks = []
    for N, H, V in shapes:
        run_once(fn, "fwd+bwd", *make_inputs(64, H, 256, dtype, device, masked=masked))()
        hidden, weight, tokens = make_inputs(N, H, V, dtype, device, masked=masked)
        peaks.append(peak_rss_growth(run_once(fn, "fwd+bwd", hidden, weight, tokens)))
        del hidden, weight, tokens
    return peaks
