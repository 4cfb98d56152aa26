"""How an op's options (its non-tensor arguments) are declared in Python: one frozen dataclass per
op, made by @options_dataclass, its fields in the order of the op's schema, each made by option()
with the rule its value must meet. Constructing it (its __post_init__ calls check_options) is where
these arguments are checked: every field, in the words the C++ op uses for the same rule
(csrc/common/options.h and csrc/<op>/options.h declare the options for C++; tests/test_op_contract.py
checks that the two declarations agree). Each value is then stored as the op takes it (float, int,
bool). The checks read only plain records made when the class is defined, so that torch.compile
traces them."""
import dataclasses
import math
import typing
from numbers import Integral, Real
from typing import Callable, NamedTuple


class Rule(NamedTuple):
    requirement: str  # what the value must be, in the words of the error
    holds: Callable  # the test, on a value of the option's type


# As csrc/common/options.h: PositiveFinite, Positive, Finite, PositiveInteger, NonNegativeInteger,
# Probability, AnyBool.
POSITIVE_FINITE = Rule("a positive finite number", lambda v: 0 < v < math.inf)
POSITIVE = Rule("a positive number", lambda v: v > 0)  # +inf included
FINITE = Rule("a finite number", math.isfinite)
POSITIVE_INTEGER = Rule("a positive integer", lambda v: v > 0)
NON_NEGATIVE_INTEGER = Rule("a non-negative integer", lambda v: v >= 0)
PROBABILITY = Rule("a number in (0, 1]", lambda v: 0 < v <= 1)
ANY_BOOL = Rule("True or False", lambda v: True)


class Option(NamedTuple):
    """A declared option, as the checks read it."""
    name: str
    kind: type  # float, int or bool: what the op takes
    optional: bool  # None is allowed
    rule: Rule
    agreed: bool  # the ranks of a tensor-parallel group must all pass the same value


def option(rule: Rule, *, default=dataclasses.MISSING, agreed: bool = False):
    """A field of an options dataclass; its type annotation (float, int, bool, Optional[...]) says
    what the op takes."""
    return dataclasses.field(default=default, metadata={"rule": rule, "agreed": agreed})


def options_dataclass(cls):
    """cls as a frozen dataclass, with OPTIONS: its fields as Option records, in order."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    hints = typing.get_type_hints(cls)
    options = []
    for f in dataclasses.fields(cls):
        args = typing.get_args(hints[f.name])
        optional = type(None) in args
        kind = next(a for a in args if a is not type(None)) if optional else hints[f.name]
        options.append(Option(f.name, kind, optional, f.metadata["rule"], f.metadata["agreed"]))
    cls.OPTIONS = tuple(options)
    return cls


def _accepts(kind: type, rule: Rule, value) -> bool:
    if kind is bool:
        return True  # anything, taken as bool(value)
    if isinstance(value, bool) or not isinstance(value, Integral if kind is int else Real):
        return False
    return bool(rule.holds(value))


def is_positive_finite(value) -> bool:
    """A positive finite real number: a Python or NumPy scalar, not a bool (the kernels take their
    options by value, so not a tensor)."""
    return _accepts(float, POSITIVE_FINITE, value)


def _check(op: str, declared: Option, value) -> None:
    if (value is None and declared.optional) or (value is not None and _accepts(declared.kind, declared.rule, value)):
        return
    none = "None or " if declared.optional else ""
    raise ValueError(f"{op}: {declared.name} must be {none}{declared.rule.requirement}, got {value!r}")


def check_option(op: str, declaration, name: str, value) -> None:
    """Raises ValueError "op: name must be <requirement>, got value" when value breaks the rule of
    the option `name` of the options dataclass `declaration` (an optional one may also be None)."""
    _check(op, next(o for o in declaration.OPTIONS if o.name == name), value)


def check_options(op: str, options) -> None:
    """Checks every field of an options dataclass (from its __post_init__) and stores each value as
    the op takes it."""
    for declared in type(options).OPTIONS:
        value = getattr(options, declared.name)
        _check(op, declared, value)
        if value is not None:
            object.__setattr__(options, declared.name, declared.kind(value))


def op_arguments(options) -> tuple:
    """The options' values in the op schema's order, to follow the op's tensors."""
    return tuple(getattr(options, declared.name) for declared in type(options).OPTIONS)
