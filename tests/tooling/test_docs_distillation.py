"""docs/distillation.md runs as written: its python blocks, one program, inside a Megatron step at TP 2
(gloo) with tiny student and teacher GPTModels, against float64 over their materialised logits:
forward KL on the teacher's top k plus the tail, reverse KL on the student's top k, losses and the
student's gradients; at k = the whole vocabulary both equal the full KL."""
import re
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from fused_rl_ops.megatron import attach, rl_output_processor  # noqa: E402
from fused_rl_ops.testing.distributed import run_distributed  # noqa: E402
from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees, tiny_config, tiny_model  # noqa: E402
from fused_rl_ops.testing.ppo import model_inputs  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "distillation.md"
B, S, VOCAB = 2, 8, 200  # the models' vocabulary padded to 256


def recipe():
    namespace = {}
    for block in re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), flags=re.DOTALL | re.MULTILINE):
        exec(block, namespace)
    return namespace


class FullLogprobs:
    """A processor returning the float64 log-softmax of the materialised, TP-gathered logits [b, s, V]."""
    value_head = None
    output_names = ("logp",)

    def __call__(self, *, hidden_states, output_layer, output_weight=None, **unused):
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=False)
        full = gather_from_tensor_model_parallel_region(logits, group=output_layer.tp_group)
        return {"logp": full.transpose(0, 1).double()[..., :VOCAB].log_softmax(-1)}


def models(config, top):
    """(student, its naive copy, teacher, its naive copy); the fused student's processor gives its top."""
    pair = []
    for seed, processor in ((0, rl_output_processor(return_entropy=False, top_logprobs=top, vocab_size=VOCAB)),
                            (1, rl_output_processor(return_entropy=False, top_logprobs=top, vocab_size=VOCAB))):
        fused, naive = tiny_model("gpt", config, seed=seed), tiny_model("gpt", config, seed=seed)
        naive.load_state_dict(fused.state_dict())
        attach(fused, processor)
        attach(naive, FullLogprobs())
        pair += [fused, naive]
    return pair


def student_grads(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def _checks(rank, world_size):
    set_parallel_degrees(tp=2)
    ns = recipe()
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    loss_mask = (torch.rand(B, S, generator=g) > 0.25).float()
    inputs = model_inputs(tokens)
    kept = loss_mask.bool()[..., None]
    for k in (5, VOCAB):
        student, naive_student, teacher, naive_teacher = models(tiny_config(init_method_std=0.3), k)
        with torch.no_grad():  # the teacher server's answer
            served = teacher(tokens, *inputs, loss_mask=loss_mask, output_processor_context={"tokens": tokens})
            teacher_logp = naive_teacher(tokens, *inputs, output_processor_context={"tokens": tokens})["logp"]
        ids, logprobs = served["top_ids"].clamp(min=0), served["top_logprobs"]

        # Forward KL on the teacher's top k.
        loss = ns["forward_kl_step"](student, tokens, inputs, loss_mask, ids, logprobs)
        loss.backward()
        ours = student_grads(student)
        student_logp = naive_student(tokens, *inputs, output_processor_context={"tokens": tokens})["logp"]
        want = ns["forward_kl_top_k"](logprobs.double(), student_logp.gather(-1, ids), loss_mask).sum() / loss_mask.sum()
        assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
        want.backward()
        for name, grad in student_grads(naive_student).items():
            assert_close(ours[name].double(), grad.double(), rtol=1e-4, atol=2e-5 * grad.abs().max().item() + 1e-9)
        if k == VOCAB:  # the full KL(teacher || student)
            full = (teacher_logp.exp() * (teacher_logp - student_logp.detach())).sum(-1)
            assert_close(loss.double(), (full * loss_mask).sum() / loss_mask.sum(), rtol=1e-5, atol=1e-6)

        # Reverse KL on the student's own top k.
        loss = ns["reverse_kl_step"](student, teacher, tokens, inputs, loss_mask)
        loss.backward()
        ours = student_grads(student)
        student_logp = naive_student(tokens, *inputs, output_processor_context={"tokens": tokens})["logp"]
        top = student_logp.detach().sort(dim=-1, descending=True, stable=True).indices[..., :k]
        want = ns["reverse_kl_top_k"](torch.where(kept, student_logp.gather(-1, top), 0.0),
                                      teacher_logp.gather(-1, top), loss_mask).sum() / loss_mask.sum()
        assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
        want.backward()
        for name, grad in student_grads(naive_student).items():
            assert_close(ours[name].double(), grad.double(), rtol=1e-4, atol=2e-5 * grad.abs().max().item() + 1e-9)
        if k == VOCAB:  # the full KL(student || teacher)
            p = student_logp.detach().exp()
            full = (p * (student_logp.detach() - teacher_logp)).sum(-1)
            assert_close(loss.double(), (full * loss_mask).sum() / loss_mask.sum(), rtol=1e-5, atol=1e-6)


def test_distillation_recipes_match_float64_at_tp2():
    run_distributed(_checks, 2)
