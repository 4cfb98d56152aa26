"""The distribution the tokens are scored under, as one options object: LogitOptions.

The output layer gives raw logits x = h . w; the scores are those of the softmax of z = map(x)
(the logit map: temperature, softcap), restricted to the tokens the sampler's filter keeps (top_k,
top_p) and renormalised over them. chosen_logprob takes this one object (logit_options=),
top_logprobs and vocab_divergence its map (logit_map=), and every integration passes them; the ops
take the map as an option group, LogitMap, and the filter through per-token thresholds
(_vocab_parallel.sampler_filter).
"""
from typing import Optional

from ._options import (POSITIVE_FINITE, POSITIVE_INTEGER, PROBABILITY, check_options, option, options_dataclass,
                       prefixed_options)


@options_dataclass
class LogitMap:
    """The logit map the ops apply to each raw logit x, an option group of their schemas (declared
    for C++ as FRL_LOGIT_MAP): z = x / temperature, or with a softcap
    z = softcap * tanh(x / softcap) / temperature (LogitOptions documents both fields). The ranks of
    a tensor-parallel group must agree on it."""
    temperature: float = option(POSITIVE_FINITE, agreed=True)
    softcap: Optional[float] = option(POSITIVE_FINITE, agreed=True)

    def __post_init__(self):
        check_options(type(self).__name__, self)


TeacherLogitMap = prefixed_options(
    LogitMap, "teacher_", "TeacherLogitMap",
    """A second model's logit map (vocab_divergence's teacher's), an option group of its own in the
    schema: LogitMap's options named teacher_<name> (FRL_TEACHER_LOGIT_MAP); TeacherLogitMap.of(map,
    teacher_softcap=...) makes one from a LogitMap.""")


@options_dataclass(kw_only=True)
class LogitOptions:
    """The scored distribution (module docstring), checked and normalised once, here.

    temperature: a positive finite number; the softmax takes the (capped) logits divided by it.
    softcap: None (no cap) or a positive finite c: the logits are capped to c * tanh(x / c) first
        (Gemma 2's final_logit_softcapping); 0 or below is an error, not "no cap".
    top_k, top_p: the rollout sampler's filter (pass its values; None: none): a positive integer,
        a number in (0, 1]. The scores are those of the distribution it drew from: its top_k
        largest logits (ties included), then the most likely of those up to a cumulative
        probability of top_p (ties decided together), renormalised. top_p = 1 is stored as None.
    The ranks of a tensor-parallel group must agree on every field (agreed).
    """
    temperature: float = option(POSITIVE_FINITE, default=1.0, agreed=True)
    softcap: Optional[float] = option(POSITIVE_FINITE, default=None, agreed=True)
    top_k: Optional[int] = option(POSITIVE_INTEGER, default=None, agreed=True)
    top_p: Optional[float] = option(PROBABILITY, default=None, agreed=True)

    def __post_init__(self):
        check_options(type(self).__name__, self)
        if self.top_p == 1:
            object.__setattr__(self, "top_p", None)  # keeps every token: no filter

    @property
    def logit_map(self) -> LogitMap:
        """The ops' part: the fields LogitMap declares."""
        return LogitMap(**{declared.name: getattr(self, declared.name) for declared in LogitMap.OPTIONS})


def given_once(op: str, name: str, given, keywords, defaults):
    """The call's logit options (a LogitOptions or a LogitMap): given, the object passed as `name`
    (None: none), else keywords, the one the call's keywords make; a ValueError when both are given,
    keywords differing from defaults (what the keywords' defaults make)."""
    if given is None:
        return keywords
    declaration = type(keywords)
    if not isinstance(given, declaration):
        raise TypeError(f"{op}: {name} must be a {declaration.__name__}, got {type(given).__name__}")
    if keywords != defaults:
        listed = ", ".join(declared.name for declared in declaration.OPTIONS)
        raise ValueError(f"{op}: give the logit options either as keywords ({listed}) or as {name}, not both")
    return given
