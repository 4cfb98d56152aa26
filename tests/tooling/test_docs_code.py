"""Every python block of README.md and docs/*.md runs as written, so none goes stale.

A page's python blocks run in order, as one program, given the inputs the page names (a config,
tokens, models): the Megatron pages on 2 gloo ranks at TP 2 (megatron.md's context-parallel block at
CP 2), transformers.md in process; what the blocks compute is checked against float64 or the models'
own logits. docs/rl_recipe.md, docs/distillation.md and docs/verl.md are run by their own tests. A
block that is not meant to run is fenced so: "python signature" (a signature), "bash" (shell commands);
test_every_python_block_is_run_or_marked holds every page to it."""
import os
import re
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from fused_rl_ops import reference
from fused_rl_ops.testing.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```$", flags=re.DOTALL | re.MULTILINE)
FENCES = {"python": "run by a test", "python signature": "a signature, not run", "bash": "shell commands, not run"}
RUN_HERE = {"README.md", "checkpoint.md", "megatron.md", "transformers.md", "vocab_divergence.md"}
RUN_ELSEWHERE = {"rl_recipe.md": "tooling/test_docs_recipe.py", "distillation.md": "tooling/test_docs_distillation.py",
                 "verl.md": "integrations/test_verl.py"}
B, S, VOCAB, PADDED_VOCAB = 2, 8, 200, 256


def python_blocks(name):
    text = next(page for page in PAGES if page.name == name).read_text()
    return [code for fence, code in FENCE.findall(text) if fence == "python"]


def run_page(name, prepare):
    """Runs page name's python blocks in order, as one program; prepare(index, namespace), called
    before block index runs, may check what the blocks before it left in namespace and returns the
    inputs block index reads. Returns the program's namespace."""
    namespace = {}
    for index, code in enumerate(python_blocks(name)):
        namespace.update(prepare(index, namespace))
        exec(compile(code, f"{name}, python block {index}", "exec"), namespace)
    return namespace


def test_every_python_block_is_run_or_marked():
    for page in PAGES:
        fences = [fence for fence, _ in FENCE.findall(page.read_text())]
        assert set(fences) <= FENCES.keys(), f"{page.name}: a code block fenced {set(fences) - FENCES.keys()}; " \
                                             f"the fences are {FENCES}"
        runs = page.name in RUN_HERE or page.name in RUN_ELSEWHERE
        assert ("python" in fences) == runs, f"{page.name}: its python blocks are run by no test" if not runs \
            else f"{page.name} has no python block to run"
    assert all((ROOT / "tests" / test).is_file() for test in RUN_ELSEWHERE.values())


def test_transformers_page():
    pytest.importorskip("transformers", reason="transformers is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=97)).double()
    input_ids = torch.randint(3, 97, (B, S))
    completion_mask = (torch.arange(S) >= S // 2).long().expand(B, S)
    given = dict(model=model, input_ids=input_ids, attention_mask=torch.ones(B, S, dtype=torch.long),
                 completion_mask=completion_mask, sampling_temperature=0.7, eps=0.2,
                 old_logprob=torch.zeros(B, S - 1, dtype=torch.float64), advantages=torch.randn(B, dtype=torch.float64))
    ns = run_page("transformers.md", lambda index, ns: given)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids).logits[:, :-1] / 0.7, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    assert_close(ns["logprob"].detach(), logp * completion_mask[:, 1:], atol=1e-10, rtol=1e-10)
    assert all(p.grad is not None for p in model.parameters())


def _megatron_inputs(config):
    from fused_rl_ops.testing.ppo import model_inputs

    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    position_ids, attention_mask = model_inputs(tokens)
    position_ids = position_ids.contiguous()  # Megatron's context-parallel split views it
    response_mask = (torch.arange(S) >= S // 2).long().repeat(B, 1)
    return dict(config=config, padded_vocab=PADDED_VOCAB, max_seq_len=S, tokenizer_vocab_size=VOCAB,
                tokenizer_vocab=VOCAB, tokens=tokens, position_ids=position_ids, attention_mask=attention_mask,
                response_mask=response_mask, completion_mask=response_mask, loss_mask=response_mask.float())


def _packed_inputs(lengths):
    """megatron.md's packed-rows block's inputs: one THD row of documents of these lengths."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    response_mask = torch.cat([(torch.arange(n) >= n // 2).long() for n in lengths])[None]
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    return dict(tokens=tokens, position_ids=position_ids, response_mask=response_mask, cu_seqlens=cu_seqlens,
                packed_seq_params=packed, cp_size=parallel_state.get_context_parallel_world_size(),
                cp_rank=parallel_state.get_context_parallel_rank())


def _clamped_config(**overrides):
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from fused_rl_ops.testing.megatron_cpu import tiny_config

    return tiny_config(gated_linear_unit=True, activation_func=quick_gelu, activation_func_clamp_value=7.0,
                       glu_linear_offset=1.0, init_method_std=0.3, **overrides)


def _model_logprobs(model, tokens, labels):
    """float64 logprobs of labels ([b, s], -100: 0) from the model's own logits over the tokenizer's
    vocabulary, the processor detached."""
    from fused_rl_ops.megatron import detach
    from fused_rl_ops.testing.megatron_cpu import full_vocab_logits

    detach(model)
    with torch.no_grad():
        logp = torch.log_softmax(full_vocab_logits(model, tokens)[..., :VOCAB].double(), -1)
    return logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0].masked_fill(labels == -100, 0)


def _check_megatron_example(ns):
    """The README's and megatron.md's first Megatron block: the logprobs of the shifted labels."""
    expected = _model_logprobs(ns["model"], ns["tokens"], ns["labels"]) * ns["loss_mask"]
    assert_close(ns["out"]["logprobs"].double(), expected, atol=1e-5, rtol=1e-5)
    assert ns["out"]["values"].shape == (B, S) and ns["out"]["values"].isfinite().all()


def _readme():
    def prepare(index, ns):
        if index == 0:
            return {}
        expected, _ = reference.chosen_logprob(ns["hidden"].double(), ns["weight"].double(), ns["labels"],
                                               temperature=0.7)
        assert_close(ns["logprob"].double(), expected, atol=1e-5, rtol=1e-5)
        return _megatron_inputs(_clamped_config())

    _check_megatron_example(run_page("README.md", prepare))


def _megatron_page():
    from fused_rl_ops.megatron import attach, rl_output_processor
    from fused_rl_ops.testing.megatron_cpu import (set_parallel_degrees, tiny_config, tiny_model,
                                                   with_self_only_attention)

    def prepare(index, ns):
        if index == 1:  # context parallel: a model whose positions attend to themselves alone
            _check_megatron_example(ns)
            set_parallel_degrees(tp=1, cp=2)
            model = tiny_model("gpt", tiny_config(), seq_length=S, edit_spec=with_self_only_attention)
            attach(model, rl_output_processor(vocab_size=VOCAB))
            return {**_megatron_inputs(model.config), "model": model}
        if index == 2:  # packed rows: two documents of 4 tokens in one row, on the same CP 2 model
            assert ns["out"]["logprobs"].shape == (B, S // 2) and ns["out"]["logprobs"].le(0).all()
            return _packed_inputs([4, 4])
        if index == 3:  # gpt-oss's MoE layers
            assert ns["out"]["logprobs"].shape == (1, S // 2) and ns["out"]["logprobs"].le(0).all()
            set_parallel_degrees(tp=2)
            return _megatron_inputs(_clamped_config(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                                                    moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
                                                    add_bias_linear=False))
        return _megatron_inputs(_clamped_config())

    ns = run_page("megatron.md", prepare)
    experts = {type(m).__name__ for m in ns["model"].modules() if type(m).__name__.endswith("SequentialMLP")}
    assert experts == {"ClampedSwiGLUSequentialMLP"}


def _checkpoint_page(root):
    from tests.helpers.checkpoint import megatron_training_state, same_bits
    from fused_rl_ops.testing.megatron_cpu import tiny_config

    config = tiny_config(bf16=True, params_dtype=torch.bfloat16)
    ns = run_page("checkpoint.md", lambda index, ns: {**_megatron_inputs(config), "path": f"{root}/checkpoint"})
    assert os.path.isfile(f"{root}/checkpoint/.metadata")
    state = megatron_training_state(ns["model"], ns["optimizer"])
    assert all(same_bits(s["param"], s["main_param"].to(torch.bfloat16)) for s in state.values())


def _vocab_divergence_page():
    from fused_rl_ops.testing.megatron_cpu import full_vocab_logits, tiny_config, tiny_model

    models = {}

    def prepare(index, ns):
        if index == 0:
            return {}
        expected = reference.vocab_divergence(ns["hidden"].double(), ns["weight"].double(),
                                              ns["teacher_hidden"].double(), ns["teacher_weight"].double(),
                                              kind="forward_kl", mask=ns["loss_mask"].bool())
        assert_close(ns["divergence"].double(), expected, atol=1e-5, rtol=1e-5)
        models["student"] = tiny_model("gpt", tiny_config(init_method_std=0.3), seed=0)
        models["teacher"] = tiny_model("gpt", tiny_config(hidden_size=48, init_method_std=0.3), seed=1)
        inputs = _megatron_inputs(models["student"].config)
        with torch.no_grad():  # before the block's optimizer step
            models.update({f"{name}_logits": full_vocab_logits(models[name], inputs["tokens"])[..., :VOCAB].double()
                           for name in ("student", "teacher")})
        optimizer = torch.optim.SGD(models["student"].parameters(), lr=0.1)
        return {**inputs, "student": models["student"], "teacher": models["teacher"], "optimizer": optimizer}

    ns = run_page("vocab_divergence.md", prepare)
    eye = torch.eye(VOCAB, dtype=torch.float64)
    outputs, labels, loss_mask = ns["outputs"], ns["labels"], ns["loss_mask"]
    expected = reference.vocab_divergence(models["student_logits"], eye, models["teacher_logits"], eye,
                                          kind="forward_kl", mask=loss_mask.bool())
    assert_close(outputs["divergence"].double(), expected, atol=1e-5, rtol=1e-5)
    logp = torch.log_softmax(models["student_logits"], -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    assert_close(outputs["logprobs"].double(), logp * loss_mask, atol=1e-5, rtol=1e-5)  # each next token's


def _megatron_pages(rank, world_size, root):
    from fused_rl_ops.testing.megatron_cpu import set_parallel_degrees

    set_parallel_degrees(tp=2)
    torch.manual_seed(0)  # the plain blocks' tensors: the same on both ranks
    _readme()
    _vocab_divergence_page()
    _checkpoint_page(root)
    _megatron_page()


@pytest.mark.usefixtures("checkpoint_dependencies")
def test_megatron_pages_on_two_ranks(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    run_distributed(_megatron_pages, 2, str(tmp_path))
