"""chosen_logprob's Python code synchronises with the host only in its two checks: with
check_tokens=False and check_group=False no op it dispatches in a forward and backward reads a
tensor's value on the host or shapes its output by values (what would wait for a CUDA stream).
Inside its ops, leaving out the ignored rows reads their count (a synchronisation on CUDA), except
while a CUDA graph is captured, where every row is computed: so a CUDA graph can capture the call."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_rl_ops
from tests.ops.test_chosen_logprob import make_inputs, reference_outputs_and_grads

HOST_READS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


class FlagHostReads(TorchDispatchMode):
    """Records every op dispatched under it whose result depends on tensor values read on the host:
    .item(), bool(), int(), equal, nonzero, boolean-mask indexing and the like."""

    def __init__(self):
        super().__init__()
        self.flagged = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(tag in func.tags for tag in HOST_READS):
            self.flagged.append(str(func))
        return func(*args, **(kwargs or {}))


def forward_backward(hidden, weight, tokens, grads, **kw):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = fused_rl_ops.chosen_logprob(h, w, tokens, return_entropy=True, check_group=False, **kw)
    (lp * grads[0] + ent * grads[1]).sum().backward()
    return lp, ent, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(), dict(batch_invariant=True), dict(softcap=2.0, vocab_size=290)])
def test_no_host_reads_without_the_checks(device, dtype, kw):
    hidden, weight, tokens = make_inputs(20, 16, 300, dtype, device, vocab_size=kw.get("vocab_size"))
    grads = torch.randn(20, device=device), torch.randn(20, device=device)
    with FlagHostReads() as mode:
        forward_backward(hidden, weight, tokens, grads, check_tokens=False, workspace_bytes=1, **kw)
    assert mode.flagged == []
    # The mode flags what the token-range check does.
    with FlagHostReads() as mode:
        forward_backward(hidden, weight, tokens, grads, check_tokens=True, workspace_bytes=1, **kw)
    assert "aten._local_scalar_dense.default" in mode.flagged


@pytest.mark.per_device
@pytest.mark.skipif(not (torch.cuda.is_available() and fused_rl_ops.has_cuda_kernels()), reason="needs a GPU")
def test_a_cuda_graph_captures_forward_and_backward():
    """Captured once after a warm-up (as torch.cuda.graph asks), replayed with new hidden states,
    weights and tokens copied into the captured tensors: the float64 reference's results."""
    N, H, V = 64, 32, 1000
    hidden, weight, tokens = make_inputs(N, H, V, torch.float32, "cuda")
    grads = torch.randn(N, device="cuda"), torch.randn(N, device="cuda")
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)

    def step():
        lp, ent = fused_rl_ops.chosen_logprob(h, w, tokens, return_entropy=True, check_tokens=False, workspace_bytes=1)
        (lp * grads[0] + ent * grads[1]).sum().backward()
        return lp, ent

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    h.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lp, ent = step()
    new_hidden, new_weight, new_tokens = make_inputs(N, H, V, torch.float32, "cuda", seed=1)
    with torch.no_grad():
        h.copy_(new_hidden)
        w.copy_(new_weight)
        tokens.copy_(new_tokens)
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_outputs_and_grads(new_hidden, new_weight, new_tokens, *grads)
    for got, want in zip((lp, ent, h.grad, w.grad), ref):
        torch.testing.assert_close(got.double().cpu(), want, atol=2e-5, rtol=2e-5)
