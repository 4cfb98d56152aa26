"""Each op's contract is declared once per language: its options in C++ (csrc/<op>/options.h, which
makes the registered schema) and in Python (the op's options dataclass), and its tensor checks in
csrc/<op>/entry.h and the op's Python module. These tests hold the two languages to one contract:
the schema's options are the dataclass's fields, and every op, called directly through torch.ops (on
real and on meta tensors, where the fake kernels check), accepts and refuses exactly what the
Python declaration accepts and refuses, with the same error."""
import dataclasses
import math
import re
import typing
from pathlib import Path

import pytest
import torch

from fused_rl_ops._sampler_filter import SEARCH_BINS
from fused_rl_ops.chosen_logprob import ChosenLogprobOptions
from fused_rl_ops.clamped_swiglu import ClampedSwigluOptions

ops = torch.ops.fused_rl_ops


def chosen_logprob_tensors(device):
    hidden, weight = torch.randn(5, 8, device=device), torch.randn(20, 8, device=device)
    tokens = torch.tensor([0, 19, 3, 7, 12], device=device)
    per_token = [torch.zeros(5, device=device) for _ in range(5)]
    threshold = torch.full((5,), -1.0, device=device)
    # A search window of the 32 logits below 0 (sigma 16, hi 0), its histogram and a top of 4.
    window = torch.tensor([[16.0, 0.0]] * 5, dtype=torch.float64, device=device)
    hist, top = torch.zeros(5, SEARCH_BINS, dtype=torch.int64, device=device), torch.zeros(5, 7, device=device)
    return {"chosen_logprob_stats": ((hidden, weight, tokens), (threshold,)),
            "chosen_logprob_backward": ((hidden, weight, tokens, *per_token, None), (threshold,)),
            "chosen_logprob_search": ((hidden, weight, per_token[0], window, hist, top), ())}


def clamped_swiglu_tensors(device):
    x, scale = torch.randn(3, 8, device=device), torch.rand(3, device=device)
    grad_out = torch.randn(3, 4, device=device)
    return {"clamped_swiglu": ((x,), (scale,)), "clamped_swiglu_backward": ((grad_out, x), ()),
            "clamped_swiglu_scaled_backward": ((grad_out, x, scale), ())}


# Per declaration: valid options, and the ops that take them with their tensors (before, after the options).
DECLARATIONS = {
    ChosenLogprobOptions: (ChosenLogprobOptions(0.9, 0, 128), chosen_logprob_tensors),
    ClampedSwigluOptions: (ClampedSwigluOptions(7.0, 1.702, 1.0, False), clamped_swiglu_tensors),
}
OPS = [(declaration, op) for declaration, (_, tensors) in DECLARATIONS.items() for op in tensors("meta")]


def schema_type(annotation) -> str:
    """The schema's name of a dataclass field's type: float, int, bool, Optional[...]."""
    args = typing.get_args(annotation)
    if type(None) in args:
        return f"Optional[{schema_type(next(a for a in args if a is not type(None)))}]"
    return {float: "float", int: "int", bool: "bool"}[annotation]


@pytest.mark.parametrize("declaration, op", OPS, ids=[op for _, op in OPS])
def test_the_schema_takes_the_declared_options(declaration, op):
    """The registered schema's options (the arguments between the op's tensors) are the declaration's
    fields: names, order, types and defaults; every other argument is a tensor."""
    before, after = DECLARATIONS[declaration][1]("meta")[op]
    arguments = getattr(ops, op).default._schema.arguments
    options = arguments[len(before):len(arguments) - len(after)]
    fields = dataclasses.fields(declaration)
    hints = typing.get_type_hints(declaration)
    assert [a.name for a in options] == [f.name for f in fields]
    for argument, field in zip(options, fields):
        assert str(argument.type) == schema_type(hints[field.name]), field.name
        has_default = field.default is not dataclasses.MISSING
        assert argument.has_default_value() == has_default, field.name
        if has_default:
            assert argument.default_value == field.default, field.name
    for argument in arguments[:len(before)] + arguments[len(arguments) - len(after):]:
        assert "Tensor" in str(argument.type), argument.name


def test_value_head_ops_take_no_options():
    """value_head has no options to declare: its op takes tensors only."""
    assert [str(a.type) for a in ops.value_head.default._schema.arguments] == ["Tensor", "Tensor", "Optional[Tensor]"]


PROBES = {float: [-1.0, 0.0, 1e-300, 0.5, 3.0, math.inf, -math.inf, math.nan],
          int: [-1, 0, 1, 3], bool: [True, False]}


def outcome(call):
    """None when call() returns; else the error's type and its message up to the offending value
    (", got ..."), which each language writes its own way."""
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as error:
        return type(error), str(error).split("\n")[0].split(", got")[0]
    return None


@pytest.mark.parametrize("tensors_on", ["cpu", "meta"], ids=["cpu_kernels", "fake_kernels"])
@pytest.mark.parametrize("declaration", list(DECLARATIONS), ids=lambda d: d.__name__)
def test_ops_accept_and_refuse_what_the_declaration_does(declaration, tensors_on):
    """Every option of every op, at values on both sides of its rule (None too where the schema
    takes it): the op called directly (CPU kernels; meta: the fake kernels) raises exactly when the
    declaration does, with the same error type and words."""
    valid, tensors = DECLARATIONS[declaration]
    for declared in declaration.OPTIONS:
        for value in PROBES[declared.kind] + [None] * declared.optional:
            args = dict(dataclasses.asdict(valid), **{declared.name: value})
            expected = outcome(lambda: declaration(**args))
            for op, (before, after) in tensors(tensors_on).items():
                got = outcome(lambda: getattr(ops, op)(*before, *args.values(), *after))
                assert got == expected, f"{op}({declared.name}={value!r}) on {tensors_on}"


def test_the_docs_name_every_declared_option():
    """docs/chosen_logprob.md's section on the ops lists the stats and backward ops' options;
    docs/clamped_swiglu.md names its op's."""
    docs = Path(__file__).resolve().parent.parent / "docs"
    ops_section = (docs / "chosen_logprob.md").read_text().split("## The ops underneath")[1].split("\n## ")[0]
    for declared in ChosenLogprobOptions.OPTIONS:
        assert re.search(rf"`{declared.name}\b", ops_section), declared.name
    for declared in ClampedSwigluOptions.OPTIONS:
        assert re.search(rf"\b{declared.name}\b", (docs / "clamped_swiglu.md").read_text()), declared.name
