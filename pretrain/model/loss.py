"""The language-model loss: the lm_head's logits and their cross entropy, whole or in chunks.

The model's last step is logits = hidden @ W^T over the whole (padded) vocabulary, then a mean
cross entropy in fp32. Done at once (`lm_loss` on whole logits), a micro-batch of N = B*T tokens
holds N x V/tp logits in the compute dtype, their fp32 copy, the log-softmax autograd keeps for
backward, and in backward a gradient of each: at 16k tokens and a 128k vocabulary one fp32 copy
is 8 GiB, far more than any other activation of the model (a 8B layer's input is N x 4096).

`fused_linear_cross_entropy` (`model.loss_chunk_tokens` > 0; the idea of Liger-Kernel's fused
linear cross entropy, written here for vocabulary shards) never holds more than one chunk of
logits. For `chunk_tokens` tokens of the flattened micro-batch at a time, its forward computes
the logits in the weight's dtype, upcasts them, takes the log-sum-exp and the loss, and at once
the gradients: d loss/d logits = (softmax - onehot(label)) / n_labels in fp32 (zero for ignored
labels), d hidden = that @ W, d W += that^T @ hidden (summed over the chunks in fp32). The loss
ends the graph, so its backward only scales the two saved gradients by the incoming scalar
(1 / gradient-accumulation steps, a loss scale). What it keeps from forward to backward is one
(N, C) and one (V/tp, C) gradient instead of (N, V/tp) tensors; the matmuls are the same three
as the unchunked forward and backward, moved into the forward.

- Padded vocabulary: the lm_head has `cfg.padded_vocab_size(tp)` rows; rows >= vocab_size
  (a suffix of the vocabulary: only the last tensor-parallel rank(s) hold any) are left out of
  the matmul, so whatever they hold never enters the softmax, and their gradient is 0, exactly
  as `causal_lm_loss` and `vocab_parallel_cross_entropy` slice the padded columns off.
- Tensor parallelism: each rank holds V/tp rows of W and computes its columns of each chunk's
  logits; the cross entropy of a block of logits over vocabulary shards (Megatron-LM's) is
  written once, `_shard_cross_entropy`, for a chunk here and for whole logits in
  `vocab_parallel_cross_entropy`: the row max all-reduced (MAX), then the sum of exponentials
  together with the label's logit (SUM, one collective), and d loss/d logits from the softmax.
  d hidden is then this rank's partial sum over its columns: `column_parallel_input`
  (the hidden states' entry into the head; `copy_to_tp`, or the sequence all-gather) sums it
  over the group in its backward. The backward here needs no collective.
- Without gradients (evaluation, `torch.no_grad`) the same chunks compute the loss alone.
- `LMHead` is the lm_head module of both model forms: its only parameter is `weight`, so the
  name stays `lm_head.weight` (a tied head shares the embedding's). Under ZeRO-3 DeepSpeed
  gathers a module's parameters in its pre-forward hook, so the fused loss runs inside
  `LMHead.forward(hidden, labels)`, never on the weight outside a forward.

`chunk_tokens` = 0 is the unchunked path (`lm_loss` of `F.linear`), the reference in tests.
In fp32 both give the loss and every gradient within rounding (tests/test_chunked_loss.py).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from pretrain.model.tensor_parallel import mark_tensor_parallel, tp_rank, tp_world_size

IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean next-token cross-entropy over all labels that are not -100, computed in fp32.

    `logits` (B, T, V_padded) may carry padded vocabulary columns: they are sliced off so that
    whatever the padded lm_head rows hold cannot change the softmax. `labels` (B, T) are already
    shifted by the caller (labels[:, t] is the token after input_ids[:, t]). The upcast follows
    Hugging Face: a bf16 log-softmax over 32k+ classes loses digits of the loss.
    Under tensor parallelism `vocab_parallel_cross_entropy` replaces this function.
    """
    if logits.shape[-1] > vocab_size:
        logits = logits[..., :vocab_size]
    logits = logits.float().reshape(-1, vocab_size)  # (B*T, V)
    return F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
            tp_group=None) -> torch.Tensor:
    """The loss of whole logits (this rank's vocabulary shard under tensor parallelism): the
    plain cross entropy, or the vocab-parallel one. `lm_head_loss` with chunk_tokens=0."""
    if tp_world_size(tp_group) == 1:
        return causal_lm_loss(logits, labels, vocab_size)
    return vocab_parallel_cross_entropy(logits, labels, vocab_size=vocab_size, tp_group=tp_group)


def _shard_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, start: int, tp_group,
                         grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cross entropy of a block of logits over vocabulary shards (Megatron-LM), per token.

    `logits` (n, n_real) fp32: this rank's unpadded columns [start, start + n_real) of n tokens'
    logits, overwritten (its buffer becomes the gradient); `labels` (n,) global ids, -100
    ignored. Per token, loss = log(sum_v exp(z_v - m)) - (z_label - m), m = max_v z_v: the max
    all-reduced (MAX) over the group, the local sum of exponentials and the label's logit
    together (SUM, one collective). Returns the per-token losses (0 where ignored) and, with
    `grad`, d loss_token/d logits = softmax - onehot(label) in the same buffer (None without).
    """
    n, n_real = logits.shape
    parallel = tp_world_size(tp_group) > 1
    if n_real:
        row_max = logits.max(dim=-1).values
    else:
        row_max = logits.new_full((n,), float("-inf"))
    if parallel:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    logits.sub_(row_max.unsqueeze(-1))
    in_shard = (labels >= start) & (labels < start + n_real)  # -100 is never in a shard
    local = (labels - start).masked_fill(~in_shard, 0)
    target = torch.zeros(n, dtype=torch.float32, device=logits.device)
    if n_real:
        target = logits.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~in_shard, 0.0)
    exp = logits.exp_()  # in place: the logits are not needed again
    stats = torch.stack((exp.sum(dim=-1), target))  # (2, n)
    if parallel:
        dist.all_reduce(stats, group=tp_group)
    sum_exp, target = stats[0], stats[1]
    per_token = (sum_exp.log() - target).masked_fill(labels == IGNORE_INDEX, 0.0)
    if not grad:
        return per_token, None
    if n_real:  # softmax in the same buffer, minus the one-hot of the labels this shard holds
        exp.div_(sum_exp.unsqueeze(-1))
        exp.scatter_add_(1, local.unsqueeze(1), -in_shard.float().unsqueeze(1))
    return per_token, exp


def _token_scales(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the number of labels, 1/that for each kept token and 0 for ignored ones): one multiply
    of d loss_token/d logits by these scales the mean's gradient and masks the ignored tokens."""
    kept = labels != IGNORE_INDEX
    count = kept.sum()  # the same on every TP rank (same labels)
    return count, kept.float() / count  # nan without any label, like F.cross_entropy


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of whole logits over vocabulary shards (`_shard_cross_entropy`).
    Padded columns (global index >= vocab_size) are a suffix of the vocabulary and are left out;
    the gradient, computed in forward from the softmax, is scaled in backward."""

    @staticmethod
    def forward(ctx, logits_shard, labels, vocab_size, group):
        shard = logits_shard.shape[-1]
        start = tp_rank(group) * shard
        n_real = max(0, min(shard, vocab_size - start))  # real (unpadded) columns here
        # a copy: the caller's logits stay as they are (fp32 logits' .float() would be them)
        logits = logits_shard.reshape(-1, shard)[:, :n_real].to(torch.float32, copy=True)
        labels = labels.reshape(-1)
        count, token_scale = _token_scales(labels)
        per_token, grad = _shard_cross_entropy(logits, labels, start=start, tp_group=group,
                                               grad=True)
        ctx.save_for_backward(grad, token_scale)
        ctx.shape, ctx.dtype, ctx.shard = logits_shard.shape, logits_shard.dtype, shard
        return per_token.sum() / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad, token_scale = ctx.saved_tensors
        # in place: the saved buffer is not needed again (a second backward fails on its
        # version counter)
        grad.mul_((token_scale * grad_loss).unsqueeze(-1))
        if grad.shape[-1] < ctx.shard:  # padded columns get zero gradient
            grad = F.pad(grad, (0, ctx.shard - grad.shape[-1]))
        return grad.reshape(ctx.shape).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, *,
                                 vocab_size: int, tp_group) -> torch.Tensor:
    """Mean next-token cross entropy (fp32 scalar) from this rank's vocabulary shard of logits.

    `logits_shard` (..., V_padded / tp) holds columns [rank * V_padded/tp, ...) of the logits;
    `labels` (...) are global token ids, -100 ignored. Columns >= `vocab_size` (padding) never
    enter the softmax. Every TP rank returns the same loss; its backward gives each rank the
    gradient of its own logit columns. With a one-rank group this is plain cross entropy.
    """
    return _VocabParallelCrossEntropy.apply(logits_shard, labels, vocab_size, tp_group)


def _chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                           vocab_size: int, tp_group, chunk_tokens: int, grad_hidden: bool,
                           grad_weight: bool):
    """(mean loss, d loss/d hidden or None, d loss/d weight or None), one chunk at a time.

    hidden (N, C), weight (V_padded/tp, C) this rank's rows, labels (N,) global ids.
    """
    n_tokens, width = hidden.shape
    shard = weight.shape[0]
    start = tp_rank(tp_group) * shard
    n_real = max(0, min(shard, vocab_size - start))  # unpadded rows of this shard
    w = weight[:n_real]  # the padded rows never enter a logit
    count, token_scale = _token_scales(labels)
    hidden = hidden.to(weight.dtype)  # a no-op unless autocast made them differ
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    d_hidden = torch.empty_like(hidden) if grad_hidden else None  # weight dtype
    if grad_hidden and n_real == 0:
        d_hidden.zero_()
    d_weight = torch.zeros(shard, width, dtype=torch.float32, device=weight.device) \
        if grad_weight else None
    grads = grad_hidden or grad_weight
    for first in range(0, n_tokens, chunk_tokens):
        h = hidden[first:first + chunk_tokens]  # (n, C)
        n = h.shape[0]
        logits = (h @ w.T).float()  # (n, n_real): the only (tokens, vocabulary) buffer
        per_token, grad = _shard_cross_entropy(logits, labels[first:first + n], start=start,
                                               tp_group=tp_group, grad=grads)
        loss_sum += per_token.sum()
        if grads and n_real:
            grad.mul_(token_scale[first:first + n].unsqueeze(-1))
            grad = grad.to(weight.dtype)  # the matmuls in the weight's dtype
            if grad_hidden:
                torch.mm(grad, w, out=d_hidden[first:first + n])
            if grad_weight:
                if grad.dtype == torch.float32:
                    d_weight[:n_real].addmm_(grad.T, h)
                else:  # each chunk's product in the weight's dtype, their sum in fp32
                    d_weight[:n_real].add_(grad.T @ h)
        logits = grad = None  # one buffer: freed before the next chunk's
    loss = loss_sum / count
    if d_weight is not None:
        d_weight = d_weight.to(weight.dtype)
    return loss, d_hidden, d_weight


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """mean CE(hidden @ weight^T, labels), its gradients computed in forward (see the module
    docstring); backward scales them by the loss's incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size, tp_group, chunk_tokens):
        grad_hidden, grad_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, d_hidden, d_weight = _chunked_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
            vocab_size=vocab_size, tp_group=tp_group, chunk_tokens=chunk_tokens,
            grad_hidden=grad_hidden, grad_weight=grad_weight)
        if d_hidden is not None:
            d_hidden = d_hidden.view(hidden.shape).to(hidden.dtype)
        ctx.save_for_backward(d_hidden, d_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        d_hidden, d_weight = ctx.saved_tensors
        # not in place: a zero-bubble pipeline schedule runs this backward twice, once for the
        # input gradient and once for the weight's (`torch.distributed.pipelining`'s split
        # backward); the saved buffers are freed with the graph
        if d_hidden is not None:
            d_hidden = d_hidden * grad_loss.to(d_hidden.dtype)
        if d_weight is not None:
            d_weight = d_weight * grad_loss.to(d_weight.dtype)
        return d_hidden, d_weight, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               *, vocab_size: int, tp_group=None,
                               chunk_tokens: int) -> torch.Tensor:
    """Mean cross entropy (fp32 scalar) of hidden @ weight^T against `labels`, `chunk_tokens`
    tokens at a time, never materialising the logits of more than one chunk.

    `hidden` (..., C): the full hidden states of every token on every tensor-parallel rank
    (after `column_parallel_input`); `weight` (V_padded/tp, C): this rank's lm_head rows;
    `labels` (...): global token ids, -100 ignored. Equals `lm_loss(F.linear(hidden, weight),
    labels, ...)`, gradients included.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens}: a chunk has at least one token")
    if not torch.is_grad_enabled():  # evaluation: the loss alone, chunk by chunk
        loss, _, _ = _chunked_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
            vocab_size=vocab_size, tp_group=tp_group, chunk_tokens=chunk_tokens,
            grad_hidden=False, grad_weight=False)
        return loss
    return _FusedLinearCrossEntropy.apply(hidden, weight, labels, vocab_size, tp_group,
                                          chunk_tokens)


def lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                 vocab_size: int, tp_group=None, chunk_tokens: int) -> torch.Tensor:
    """The training loss from the head's input: `fused_linear_cross_entropy` when
    `chunk_tokens` > 0 (`model.loss_chunk_tokens`), else the whole logits' `lm_loss`."""
    if chunk_tokens > 0:
        return fused_linear_cross_entropy(hidden, weight, labels, vocab_size=vocab_size,
                                          tp_group=tp_group, chunk_tokens=chunk_tokens)
    return lm_loss(F.linear(hidden, weight), labels, vocab_size=vocab_size, tp_group=tp_group)


class _WithGradient(torch.autograd.Function):
    """`loss` itself; in backward `extra` gets the gradient `loss` gets."""

    @staticmethod
    def forward(ctx, loss, extra):
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def with_gradient_of(loss: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """`loss`, bitwise, whose backward also back-propagates `extra` (same incoming gradient):
    multi-token prediction's losses ride on the language-model loss (`pretrain.model.mtp`)."""
    return _WithGradient.apply(loss, extra)


def scaled_head_input(hidden: torch.Tensor, output_multiplier: float) -> torch.Tensor:
    """`hidden` x `output_multiplier`: logits of the result are the logits x the multiplier
    (muP's 1/m on the output layer); 1 returns `hidden` itself (the standard model, bitwise)."""
    return hidden if output_multiplier == 1.0 else hidden * output_multiplier


class LMHead(nn.Module):
    """The output projection: `weight` (V_padded/tp, C), this rank's rows of the padded
    vocabulary (`tensor_model_parallel`, partition dim 0, under tensor parallelism, like a
    `ColumnParallelLinear`; a plain parameter like `nn.Linear`'s otherwise).

    `forward(hidden)` gives this rank's logits (..., V_padded/tp); `forward(hidden, labels)` the
    loss (`lm_head_loss`, chunked by `chunk_tokens`). `hidden` is the full (B, T, C) of every
    tensor-parallel rank: the caller takes it through `column_parallel_input`.
    `output_multiplier` (muP's 1/m, `pretrain.model.mup`; 1: none) multiplies the logits, as a
    factor on `hidden` (`scaled_head_input`) before the product.
    """

    def __init__(self, in_features: int, padded_vocab_size: int, *, vocab_size: int,
                 tp_group=None, chunk_tokens: int = 0, output_multiplier: float = 1.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        tensor_parallel = tp_world_size(tp_group)
        if padded_vocab_size % tensor_parallel:
            raise ValueError(f"padded vocabulary {padded_vocab_size} is not divisible by the "
                             f"{tensor_parallel} tensor-parallel ranks")
        self.in_features, self.padded_vocab_size = in_features, padded_vocab_size
        self.vocab_size, self.tp_group, self.chunk_tokens = vocab_size, tp_group, chunk_tokens
        self.output_multiplier = output_multiplier
        self.weight = nn.Parameter(torch.empty(padded_vocab_size // tensor_parallel, in_features,
                                               device=device, dtype=dtype))
        if tensor_parallel > 1:
            mark_tensor_parallel(self.weight, partition_dim=0)
        bound = 1.0 / math.sqrt(in_features)  # nn.Linear's default; init_weights replaces it
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        hidden = scaled_head_input(hidden, self.output_multiplier)
        if labels is None:
            return F.linear(hidden, self.weight)  # (..., V_padded/tp)
        return lm_head_loss(hidden, self.weight, labels, vocab_size=self.vocab_size,
                            tp_group=self.tp_group, chunk_tokens=self.chunk_tokens)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.padded_vocab_size}, "
                f"local={tuple(self.weight.shape)}, chunk_tokens={self.chunk_tokens}"
                + (f", output_multiplier={self.output_multiplier:g}"
                   if self.output_multiplier != 1.0 else ""))
