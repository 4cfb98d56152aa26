"""vocab_divergence's autograd Function: the stats pass, the tensor-parallel merge, jsd's second pass
and the backward, over every row (the ops leave out the masked ones themselves). The teacher's
tensors come in detached: they are constants."""
import torch

from ._library import ops
from ._vocab_parallel.main_grad import placeholder_gradient

# The ops' kind codes (the C++ Kind), by name.
KINDS = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}
# The columns of vocab_divergence_combine's [N, 6] output (the C++ combined_column).
FORWARD_KL_COLUMN, REVERSE_KL_COLUMN = 4, 5


def divergence_and_term(hidden, weight, teacher_hidden, teacher_weight, mask, kernel_options, pieces):
    """(rows, divergence, row_term), [N, 6] and [N] each: the merged rows of both models over the
    pieces of every rank's shard (pieces: VocabPieces), the divergence (NaN at masked rows: the
    caller zeroes them) and the row term its backward takes (reverse_kl: the divergence; jsd:
    KL(student || M); forward_kl: none, zeros)."""
    each = list(pieces.each(kernel_options, weight, teacher_weight))
    partials = torch.stack([ops.vocab_divergence_stats(hidden, w, teacher_hidden, t, mask, *o.arguments())
                            for o, w, t in each])
    rows = ops.vocab_divergence_combine(pieces.gather(partials))
    kind, beta = kernel_options.own.kind, kernel_options.own.beta
    if kind == KINDS["forward_kl"]:
        return rows, rows[:, FORWARD_KL_COLUMN], torch.zeros_like(rows[:, 0])
    if kind == KINDS["reverse_kl"]:
        return rows, rows[:, REVERSE_KL_COLUMN], rows[:, REVERSE_KL_COLUMN].contiguous()
    sums = pieces.sum(ops.vocab_divergence_mixture(hidden, w, teacher_hidden, t, mask, rows, *o.arguments())
                      for o, w, t in each)
    teacher_to_mixture, student_to_mixture = sums.unbind(1)
    return rows, beta * teacher_to_mixture + (1 - beta) * student_to_mixture, student_to_mixture.contiguous()


class VocabDivergenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, mask, main_grad, kernel_options, pieces,
                reduce_hidden_grad, weight_placeholder):
        """hidden [N, H], teacher_hidden [N, H_t], mask [N] bool or None (True: computed);
        kernel_options the ops' (vocab_divergence.KernelOptions), pieces its VocabPieces.
        Returns the divergence [N], 0 at masked rows."""
        rows, divergence, row_term = divergence_and_term(hidden, weight, teacher_hidden, teacher_weight, mask,
                                                         kernel_options, pieces)
        if mask is not None:
            divergence = torch.where(mask, divergence, 0.0)
        ctx.save_for_backward(hidden, weight, teacher_hidden, teacher_weight, mask, rows, row_term)
        ctx.kernel_options, ctx.pieces = kernel_options, pieces
        ctx.reduce_hidden_grad, ctx.weight_placeholder = reduce_hidden_grad, weight_placeholder
        # main_grad is the backward's output buffer, not an input of its math (chosen_logprob's note).
        ctx.main_grad = main_grad
        return divergence

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, teacher_hidden, teacher_weight, mask, rows, row_term = ctx.saved_tensors
        grad = grad.to(rows.dtype)
        if mask is not None:
            grad = torch.where(mask, grad, 0.0)
        grad, grad_weights = grad.contiguous(), []
        buffer = ctx.pieces.weight_grad_buffer(weight, ctx.main_grad)

        def hidden_grads():  # per piece; its weight gradient kept, or added into main_grad or the buffer
            for o, w, t, g in ctx.pieces.each(ctx.kernel_options, weight, teacher_weight, buffer):
                grad_hidden, grad_weight = ops.vocab_divergence_backward(
                    hidden, w, teacher_hidden, t, mask, rows, row_term, grad, g, *o.arguments())
                grad_weights.append(grad_weight)
                yield grad_hidden

        grad_hidden = ctx.pieces.sum(hidden_grads(), ctx.reduce_hidden_grad)
        if ctx.main_grad is not None:
            grad_weight = placeholder_gradient(weight, ctx.weight_placeholder)
        else:
            grad_weight = ctx.pieces.weight_grad(buffer, grad_weights)
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None, None, None
