"""Each op's contract is declared once per language: its options come in groups (the logit map, the
vocab shard, the tiling every vocab-parallel op takes, vocab_divergence's teacher's map, then the
op's own), each declared in C++ (csrc/vocab_parallel/logit_map.h, csrc/vocab_parallel/options.h,
csrc/<op>/options.h, which make the registered schema) and in Python (an options dataclass per
group), and its tensor checks in csrc/<op>/entry.h and the op's Python module. These tests hold the two languages to one contract:
every op's schema takes its groups in order, each group's fields as declared, and every op, called
directly through torch.ops (on real and on meta tensors, where the fake kernels check), accepts and
refuses exactly what each group's Python declaration accepts and refuses, with the same error. The
operators and their groups come from the op table (tests/helpers/op_table.py): a new op with
options adds its tensors to op_calls, or these tests fail."""
import dataclasses
import math
import re
import typing
from pathlib import Path

import pytest
import torch

from fused_rl_ops._vocab_parallel.sampler_filter import SEARCH_BINS
from fused_rl_ops._vocab_parallel.shard import VocabShard
from fused_rl_ops._vocab_parallel.tiling import Tiling
from fused_rl_ops.chosen_logprob import OP_GROUPS, ChosenLogprobOptions
from fused_rl_ops.clamped_swiglu import ClampedSwigluOptions
from fused_rl_ops.logit_options import LogitMap, TeacherLogitMap
from tests.helpers import op_table
from fused_rl_ops.top_logprobs import TopLogprobsOptions
from fused_rl_ops.vocab_divergence import VocabDivergenceOptions

ops = torch.ops.fused_rl_ops

# Valid values of every group.
VALID = {LogitMap: LogitMap(0.9, None), TeacherLogitMap: TeacherLogitMap(1.3, 2.0), VocabShard: VocabShard(0, None),
         Tiling: Tiling(128),
         ChosenLogprobOptions: ChosenLogprobOptions(), TopLogprobsOptions: TopLogprobsOptions(3),
         ClampedSwigluOptions: ClampedSwigluOptions(7.0, 1.702, 1.0, False), VocabDivergenceOptions: VocabDivergenceOptions()}


# Every operator of the table with its option groups (in the schema's order).
GROUPS_OF = {name: groups for op in op_table.OPS for name, groups in op.operators.items()}
OPS = [name for name, groups in GROUPS_OF.items() if groups]
GROUPS = list(dict.fromkeys(group for name in OPS for group in GROUPS_OF[name]))


def op_calls(device):
    """Per operator that takes options: its option groups (the table's) and its tensors before and
    after the options."""
    hidden, weight = torch.randn(5, 8, device=device), torch.randn(20, 8, device=device)
    tokens = torch.tensor([0, 19, 3, 7, 12], device=device)
    per_token = [torch.zeros(5, device=device) for _ in range(5)]
    threshold = torch.full((5,), -1.0, device=device)
    # A search window of the 32 logits below 0 (sigma 16, hi 0), its histogram and a top of 4.
    window = torch.tensor([[16.0, 0.0]] * 5, dtype=torch.float64, device=device)
    hist, top = torch.zeros(5, SEARCH_BINS, dtype=torch.int64, device=device), torch.zeros(5, 7, device=device)
    x, scale = torch.randn(3, 8, device=device), torch.rand(3, device=device)
    grad_out = torch.randn(3, 4, device=device)
    # vocab_divergence: a teacher of hidden size 6, no mask, the merged rows of its stats.
    pair = (hidden, weight, torch.randn(5, 6, device=device), torch.randn(20, 6, device=device), None)
    rows = torch.zeros(5, 6, device=device)
    tensors = {"chosen_logprob_stats": ((hidden, weight, tokens), (threshold,)),
               "chosen_logprob_backward": ((hidden, weight, tokens, *per_token, None), (threshold,)),
               "chosen_logprob_search": ((hidden, weight, per_token[0], window, hist, top), ()),
               "top_logprobs_stats": ((hidden, weight, tokens != 3), ()),
               "vocab_divergence_stats": (pair, ()), "vocab_divergence_mixture": ((*pair, rows), ()),
               "vocab_divergence_backward": ((*pair, rows, *per_token[:2], None), ()),
               "clamped_swiglu": ((x,), (scale,)), "clamped_swiglu_backward": ((grad_out, x), ()),
               "clamped_swiglu_scaled_backward": ((grad_out, x, scale), ())}
    return {name: (GROUPS_OF[name], *tensors[name]) for name in OPS}


def schema_type(annotation) -> str:
    """The schema's name of a dataclass field's type: float, int, bool, Optional[...]."""
    args = typing.get_args(annotation)
    if type(None) in args:
        return f"Optional[{schema_type(next(a for a in args if a is not type(None)))}]"
    return {float: "float", int: "int", bool: "bool"}[annotation]


@pytest.mark.parametrize("op", OPS)
def test_the_schema_takes_its_groups_in_order(op):
    """The registered schema's options (the arguments between the op's tensors) are its groups'
    fields, group after group: names, order, types and defaults; every other argument is a tensor."""
    groups, before, after = op_calls("meta")[op]
    arguments = getattr(ops, op).default._schema.arguments
    options = arguments[len(before):len(arguments) - len(after)]
    fields = [(f, typing.get_type_hints(group)[f.name]) for group in groups for f in dataclasses.fields(group)]
    assert [a.name for a in options] == [f.name for f, _ in fields]
    for argument, (field, hint) in zip(options, fields):
        assert str(argument.type) == schema_type(hint), field.name
        has_default = field.default is not dataclasses.MISSING
        assert argument.has_default_value() == has_default, field.name
        if has_default:
            assert argument.default_value == field.default, field.name
    for argument in arguments[:len(before)] + arguments[len(arguments) - len(after):]:
        assert "Tensor" in str(argument.type), argument.name


@pytest.mark.parametrize("op", [name for name, groups in GROUPS_OF.items() if not groups])
def test_operators_without_groups_take_no_options(op):
    """An operator the table lists without option groups takes tensors (and a dtype) only."""
    assert all(str(a.real_type) in ("Tensor", "Optional[Tensor]", "ScalarType")
               for a in getattr(ops, op).default._schema.arguments), op


def test_every_group_has_valid_values_to_probe_from():
    assert set(GROUPS) == set(VALID)


PROBES = {float: [-1.0, 0.0, 1e-300, 0.5, 3.0, math.inf, -math.inf, math.nan],
          int: [-1, 0, 1, 3], bool: [True, False]}


def outcome(call):
    """None when call() returns; else the error's type and its message between the name of who
    raised it (the op, or the group) and the offending value (", got ..."), which each language
    writes its own way."""
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as error:
        return type(error), str(error).split("\n")[0].split(", got")[0].split(": ", 1)[-1]
    return None


@pytest.mark.parametrize("tensors_on", ["cpu", "meta"], ids=["cpu_kernels", "fake_kernels"])
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.__name__)
def test_ops_accept_and_refuse_what_the_declaration_does(group, tensors_on):
    """Every option of every group, at values on both sides of its rule (None too where the schema
    takes it), in every op that takes the group: the op called directly (CPU kernels; meta: the fake
    kernels) raises exactly when the declaration does, with the same error type and words."""
    calls = {op: call for op, call in op_calls(tensors_on).items() if group in call[0]}
    assert calls
    for declared in group.OPTIONS:
        for value in PROBES[declared.kind] + [None] * declared.optional:
            changed = dict(dataclasses.asdict(VALID[group]), **{declared.name: value})
            expected = outcome(lambda: group(**changed))
            for op, (groups, before, after) in calls.items():
                values = [v for g in groups for v in (changed if g is group else dataclasses.asdict(VALID[g])).values()]
                got = outcome(lambda: getattr(ops, op)(*before, *values, *after))
                assert got == expected, f"{op}({declared.name}={value!r}) on {tensors_on}"


def test_the_docs_name_every_declared_option():
    """docs/chosen_logprob.md's section on the ops lists the options of the stats and backward ops'
    groups, docs/vocab_divergence.md's its op's own and the teacher's map; docs/clamped_swiglu.md
    names its op's."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    ops_section = (docs / "chosen_logprob.md").read_text().split("## The ops underneath")[1].split("\n## ")[0]
    for declared in (o for group in OP_GROUPS for o in group.OPTIONS):
        assert re.search(rf"`{declared.name}\b", ops_section), declared.name
    divergence_section = (docs / "vocab_divergence.md").read_text().split("## The ops underneath")[1].split("\n## ")[0]
    for declared in VocabDivergenceOptions.OPTIONS + TeacherLogitMap.OPTIONS:
        assert re.search(rf"`{declared.name}\b", divergence_section), declared.name
    for declared in ClampedSwigluOptions.OPTIONS:
        assert re.search(rf"\b{declared.name}\b", (docs / "clamped_swiglu.md").read_text()), declared.name
