"""Full-vocabulary divergence between a student's and a teacher's softmax, vocab-parallel, from both
models' hidden states and output-layer shards, without a [tokens, vocab] tensor: the public function,
the resolution of its arguments into the ops' options, and the ops' fake kernels. How it works, and
what every argument does in full: docs/vocab_divergence.md."""
from typing import Optional

import torch
import torch.distributed as dist

from ._checks import check_hidden_size, check_mask, values_readable
from ._library import acc_dtype, check_device, check_float_dtype
from ._options import Rule, check_options, groups_from_arguments, option, options_dataclass
from ._vocab_divergence_function import KINDS, VocabDivergenceFunction
from ._vocab_parallel import agreement
from ._vocab_parallel.agreement import AgreedCall, agreed, agreed_dataclass, agreed_options
from ._vocab_parallel.call import ResolvedCall, check_output_layer, resolve_call
from ._vocab_parallel.group import TensorParallelGroup
from ._vocab_parallel.kernel_options import SHARED_GROUPS, KernelOptions
from ._vocab_parallel.main_grad import check_main_grad, weight_placeholder
from ._vocab_parallel.pieces import VocabPieces, check_virtual_shards
from ._vocab_parallel.shard import resolve_shard
from ._vocab_parallel.tiling import default_workspace_bytes, tiling_for
from .logit_options import LogitMap, LogitOptions, TeacherLogitMap, given_once

__all__ = ["VocabDivergenceOptions", "vocab_divergence"]

# As the C++ declaration's rules DivergenceKind, OpenUnitInterval.
DIVERGENCE_KIND = Rule("0 (forward_kl), 1 (reverse_kl) or 2 (jsd)", lambda v: 0 <= v <= 2)
OPEN_UNIT_INTERVAL = Rule("a number in (0, 1)", lambda v: 0 < v < 1)


@options_dataclass
class VocabDivergenceOptions:
    """vocab_divergence's own option group (declared for C++ as FRL_VOCAB_DIVERGENCE_OPTIONS), after
    the student's LogitMap, the teacher's TeacherLogitMap, VocabShard and Tiling in every op of it:
    the divergence's kind (KINDS' code) and jsd's beta (the teacher's weight in the mixture)."""
    kind: int = option(DIVERGENCE_KIND, default=0)
    beta: float = option(OPEN_UNIT_INTERVAL, default=0.5)

    def __post_init__(self):
        check_options(type(self).__name__, self)


# The option groups of every op of it, in their schemas' order: both models' maps first.
OP_GROUPS = (LogitMap, TeacherLogitMap, *SHARED_GROUPS[1:], VocabDivergenceOptions)

_FLOAT = agreement.option_codec(float)


@agreed_dataclass
class _Agreed(AgreedCall):
    """What every rank of tp_group must pass alike besides its shard, each by the name its error uses:
    the call's own arguments (token_count: hidden's rows; hidden_size and dtype: the student's), then
    both logit maps."""
    teacher_hidden_size: int = agreed("teacher hidden size", agreement.INTEGER)
    teacher_dtype: torch.dtype = agreed("teacher dtype", agreement.DTYPE)
    reduce_hidden_grad: bool = agreed("reduce_hidden_grad", agreement.INTEGER)
    kind: int = agreed("kind", agreement.INTEGER)
    beta: float = agreed("beta", _FLOAT)
    mask: Optional[torch.Tensor] = agreed("mask", agreement.FINGERPRINT)
    logit_map: LogitMap = agreed_options()
    teacher_logit_map: TeacherLogitMap = agreed_options()


def _check_tensors(hidden, weight, teacher_hidden, teacher_weight, mask):
    """The student's hidden and weight as every vocab-parallel op checks them, then the teacher's
    against them."""
    op = "vocab_divergence"
    check_output_layer(op, hidden, weight)
    teacher = dict(teacher_hidden=teacher_hidden, teacher_weight=teacher_weight)
    for name, t in teacher.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    check_mask(op, mask, hidden)
    check_device(op, hidden=hidden, weight=weight, **teacher, mask=mask)
    for name, t in teacher.items():
        check_float_dtype(op, name, t, allow_float64=hidden.device.type == "cpu")
    if teacher_weight.dtype != teacher_hidden.dtype:
        raise TypeError(f"{op}: teacher_weight must have teacher_hidden's dtype {teacher_hidden.dtype}, got "
                        f"{teacher_weight.dtype}")
    if (hidden.dtype == torch.float64) != (teacher_hidden.dtype == torch.float64):
        raise TypeError(f"{op}: float64 inputs must be float64 for both models, got {hidden.dtype} and "
                        f"{teacher_hidden.dtype}")
    if teacher_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"{op}: teacher_hidden must have hidden's leading shape {tuple(hidden.shape[:-1])}, got "
                         f"{tuple(teacher_hidden.shape)}")
    if teacher_weight.dim() != 2 or teacher_weight.shape != (weight.shape[0], teacher_hidden.shape[-1]):
        raise ValueError(f"{op}: teacher_weight must be [V_local, H_t] = [{weight.shape[0]}, "
                         f"{teacher_hidden.shape[-1]}] (weight's vocab rows, teacher_hidden's size), got "
                         f"{tuple(teacher_weight.shape)}")
    check_hidden_size(op, teacher_hidden)


def _kind_code(kind) -> int:
    if kind not in KINDS:
        raise ValueError(f"vocab_divergence: kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    return KINDS[kind]


def _resolve(hidden, weight, teacher_hidden, teacher_weight, mask, rank, world, *, kind, beta, logit_map,
             teacher_softcap, reduce_hidden_grad, vocab_start, vocab_size, main_grad, workspace_bytes,
             batch_invariant) -> ResolvedCall:
    """The call on this rank, after its checks. The workspace holds both models' chunk buffers (the
    student's, chunk_loop_bytes: two logits workspaces in the CPU's backward; the teacher's logits
    workspace and, on the CPU, its fp32 weight rows): the tiling is planned for half of it with both
    hidden sizes' weight rows, twice of which bounds them all."""
    own = VocabDivergenceOptions(_kind_code(kind), beta)
    # The teacher's map is the student's with its own softcap.
    teacher_logit_map = TeacherLogitMap.of(logit_map, teacher_softcap=teacher_softcap)
    _check_tensors(hidden, weight, teacher_hidden, teacher_weight, mask)
    shard, vocab_size = resolve_shard("vocab_divergence", weight.shape[0], rank, world, vocab_start, vocab_size)
    check_main_grad("vocab_divergence", main_grad, weight)
    if batch_invariant:
        check_virtual_shards("vocab_divergence", weight.shape[0], rank, world, shard.vocab_start)
    rows = hidden.numel() // hidden.shape[-1]
    if workspace_bytes is None:
        workspace_bytes = default_workspace_bytes(hidden)
    element_size = max(hidden.element_size(), teacher_hidden.element_size())
    tiling = tiling_for(rows, hidden.shape[-1] + teacher_hidden.shape[-1], element_size, max(workspace_bytes // 2, 1),
                        hidden.device, batch_invariant)
    agreed_values = _Agreed(token_count=rows, hidden_size=hidden.shape[-1],
                            teacher_hidden_size=teacher_hidden.shape[-1],
                            dtype=hidden.dtype, teacher_dtype=teacher_hidden.dtype, vocab_size=vocab_size,
                            reduce_hidden_grad=reduce_hidden_grad, kind=own.kind, beta=own.beta,
                            mask=mask, logit_map=logit_map, teacher_logit_map=teacher_logit_map)
    return ResolvedCall(KernelOptions(logit_map, shard, tiling, own, teacher_logit_map), weight.shape[0],
                        agreed_values)


def vocab_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    kind: str,
    beta: float = 0.5,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_map: Optional[LogitMap] = None,
    teacher_softcap: Optional[float] = None,
    mask: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    reduce_hidden_grad: bool = True,
    check_group: bool = True,
    main_grad: Optional[torch.Tensor] = None,
    workspace_bytes: Optional[int] = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The divergence between the teacher's and the student's softmax at each position, over the
    whole (vocab-parallel) vocabulary, without a [tokens, vocab] tensor (docs/vocab_divergence.md).

    Logits: hidden @ weight.T for the student, teacher_hidden @ teacher_weight.T for the teacher,
    each capped by its own softcap (None: none; c: c * tanh(x / c)), both divided by temperature.
    logit_map=LogitMap(...) gives the student's map (temperature, softcap) as one object instead
    (not both); the teacher's is the same with teacher_softcap.
    kind: "forward_kl" KL(teacher || student), "reverse_kl" KL(student || teacher), or "jsd"
    beta KL(teacher || M) + (1 - beta) KL(student || M) with M = beta p_teacher + (1 - beta)
    p_student, beta in (0, 1).
    hidden [..., H] and weight [V_local, H] share a dtype, teacher_hidden [..., H_t] (hidden's leading
    shape) and teacher_weight [V_local, H_t] (the same vocab rows) share one: float32, bfloat16 or
    float16 (float64 on CPU, then for both). Global ids of the rows from vocab_start (default rank *
    V_local in tp_group); vocab_size: the real vocabulary, the rows past it padding, in neither softmax.
    mask bool [...]: False positions get 0 and no gradient, and are not computed.
    Returns fp32 [...] (float64 for float64 inputs), differentiable in hidden and weight only (the
    teacher's tensors are constants, even when they require a gradient); with tp_group the hidden
    gradient is summed over the group unless reduce_hidden_grad=False (a sequence-parallel gather's
    backward sums it). check_group makes every rank of tp_group raise the same error on bad
    arguments (skipped under torch.compile, CUDA graph capture and for meta tensors).
    main_grad ([V_local, H], Megatron's gradient-accumulation buffer) takes the weight gradient
    instead of returning one. workspace_bytes bounds the chunk loop's buffers, both models' (default:
    the size of hidden, within [1 MiB, fused_rl_ops.DEFAULT_WORKSPACE_BYTES]; on CUDA up to 256 MiB,
    where long inputs take passes of rows). batch_invariant=True: each
    position's divergence and hidden gradient are bitwise independent of the other positions.
    """
    def resolve(rank, world):
        given_map = given_once("vocab_divergence", "logit_map", logit_map,
                               LogitOptions(temperature=temperature, softcap=softcap).logit_map,
                               LogitOptions().logit_map)
        return _resolve(hidden, weight, teacher_hidden, teacher_weight, mask, rank, world, kind=kind, beta=beta,
                        logit_map=given_map, teacher_softcap=teacher_softcap, reduce_hidden_grad=reduce_hidden_grad,
                        vocab_start=vocab_start, vocab_size=vocab_size, main_grad=main_grad,
                        workspace_bytes=workspace_bytes, batch_invariant=batch_invariant)

    readable = values_readable(hidden, weight, teacher_hidden, teacher_weight, mask)
    call = resolve_call("vocab_divergence", tp_group, check_group and readable, _Agreed, resolve)

    mask1d = None if mask is None else mask.reshape(-1)
    divergence = VocabDivergenceFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]),
        teacher_weight.detach(), mask1d, main_grad, call.kernel_options,
        VocabPieces.of(TensorParallelGroup(tp_group), call.local_rows, batch_invariant), bool(reduce_hidden_grad), weight_placeholder(weight, main_grad))
    return divergence.reshape(hidden.shape[:-1])


def _fake_check(hidden, weight, teacher_hidden, teacher_weight, mask, args, kwargs, **more):
    """The fake kernels check the options (building their groups) and the devices as the ops do."""
    groups_from_arguments(OP_GROUPS, args, kwargs)
    check_device("vocab_divergence", hidden=hidden, weight=weight, teacher_hidden=teacher_hidden,
                 teacher_weight=teacher_weight, mask=mask, **more)


@torch.library.register_fake("fused_rl_ops::vocab_divergence_stats")
def _(hidden, weight, teacher_hidden, teacher_weight, mask, *args, **kwargs):
    _fake_check(hidden, weight, teacher_hidden, teacher_weight, mask, args, kwargs)
    return hidden.new_empty(hidden.shape[0], 6, dtype=acc_dtype(hidden.dtype))


@torch.library.register_fake("fused_rl_ops::vocab_divergence_combine")
def _(partials):
    return partials.new_empty(partials.shape[1], 6)


@torch.library.register_fake("fused_rl_ops::vocab_divergence_mixture")
def _(hidden, weight, teacher_hidden, teacher_weight, mask, rows, *args, **kwargs):
    _fake_check(hidden, weight, teacher_hidden, teacher_weight, mask, args, kwargs, rows=rows)
    return hidden.new_empty(hidden.shape[0], 2, dtype=acc_dtype(hidden.dtype))


@torch.library.register_fake("fused_rl_ops::vocab_divergence_backward")
def _(hidden, weight, teacher_hidden, teacher_weight, mask, rows, row_term, grad, main_grad, *args, **kwargs):
    _fake_check(hidden, weight, teacher_hidden, teacher_weight, mask, args, kwargs, rows=rows, row_term=row_term,
                grad=grad, main_grad=main_grad)
    grad_weight = weight.new_empty(0, weight.shape[1]) if main_grad is not None else torch.empty_like(weight)
    return hidden.new_empty(hidden.shape, dtype=acc_dtype(hidden.dtype)), grad_weight
