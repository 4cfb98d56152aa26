"""How options are declared in Python: a frozen dataclass per group of options, made by
@options_dataclass, each field made by option() with the rule its value must meet. An op's schema
takes its groups one after the other (LogitMap, VocabShard, Tiling, then the op's own), each group's
fields in order (each group is declared once for C++ too, as an FRL_<GROUP> list;
tests/tooling/test_op_contract.py checks that the two declarations agree). Constructing one (its
__post_init__ calls check_options) is where these values are checked, in the words the C++ op uses
for the same rule; each value is then stored as the op takes it (float, int, bool). The checks read
only plain records made when the class is defined, so that torch.compile traces them."""
import dataclasses
import math
import typing
from numbers import Integral, Real
from typing import Callable, NamedTuple


class Rule(NamedTuple):
    requirement: str  # what the value must be, in the words of the error
    holds: Callable  # the test, on a value of the option's type


# As the C++ rules PositiveFinite, Positive, Finite, PositiveInteger, NonNegativeInteger,
# Integer, AnyBool; PROBABILITY is LogitOptions' alone (no op takes top_p).
POSITIVE_FINITE = Rule("a positive finite number", lambda v: 0 < v < math.inf)
POSITIVE = Rule("a positive number", lambda v: v > 0)  # +inf included
FINITE = Rule("a finite number", math.isfinite)
POSITIVE_INTEGER = Rule("a positive integer", lambda v: v > 0)
NON_NEGATIVE_INTEGER = Rule("a non-negative integer", lambda v: v >= 0)
INTEGER = Rule("an integer", lambda v: True)
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


def options_dataclass(cls=None, *, kw_only: bool = False):
    """cls as a frozen dataclass (keyword-only with kw_only), with OPTIONS: its fields as Option
    records, in order."""
    if cls is None:
        return lambda cls: options_dataclass(cls, kw_only=kw_only)
    cls = dataclasses.dataclass(frozen=True, kw_only=kw_only)(cls)
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


def check_options(op: str, options) -> None:
    """Checks every field of an options dataclass (from its __post_init__) and stores each value as
    the op takes it."""
    for declared in type(options).OPTIONS:
        value = getattr(options, declared.name)
        _check(op, declared, value)
        if value is not None:
            object.__setattr__(options, declared.name, declared.kind(value))


def op_arguments(*groups) -> tuple:
    """The values of an op's option groups, in the schema's order, to follow the op's tensors."""
    return tuple(getattr(group, declared.name) for group in groups for declared in type(group).OPTIONS)


def groups_from_arguments(declarations, args: tuple, kwargs: dict) -> tuple:
    """(groups, rest): the option groups of the given declarations built from an op's arguments
    after its tensors (as a fake kernel gets them: by position, the ones with defaults perhaps by
    name), and the arguments after the options (a tuple of those by position, then kwargs less the
    options)."""
    kwargs, groups, position = dict(kwargs), [], 0
    for declaration in declarations:
        values = {}
        for declared in declaration.OPTIONS:
            if position < len(args):
                values[declared.name] = args[position]
                position += 1
            elif declared.name in kwargs:
                values[declared.name] = kwargs.pop(declared.name)
        groups.append(declaration(**values))
    return tuple(groups), (args[position:], kwargs)


def prefixed_options(declaration, prefix: str, name: str, doc: str) -> type:
    """An options dataclass `name` of declaration's options named prefix + each name, with their
    rules, defaults and agreement: a group that a schema takes twice (vocab_divergence's teacher's
    logit map beside the student's), made from its declaration so that an option added there is
    here too. Its of(options, **changes) makes one from an instance of declaration, changes by the
    prefixed names."""
    hints = typing.get_type_hints(declaration)
    namespace = {"__annotations__": {}, "__module__": declaration.__module__, "__doc__": doc,
                 "__post_init__": lambda self: check_options(type(self).__name__, self)}
    for f in dataclasses.fields(declaration):
        namespace["__annotations__"][prefix + f.name] = hints[f.name]
        namespace[prefix + f.name] = dataclasses.field(default=f.default, metadata=f.metadata)

    def of(cls, options, **changes):
        return cls(**{prefix + o.name: getattr(options, o.name) for o in declaration.OPTIONS} | changes)

    namespace["of"] = classmethod(of)
    return options_dataclass(type(name, (), namespace))
