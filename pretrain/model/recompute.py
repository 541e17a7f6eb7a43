"""Selective activation recompute (`model.activation_checkpointing: selective`): per operator,
as torchtitan's "op" policy does.

A recomputed decoder layer normally keeps only its input and runs its whole forward again in
backward (`full`): every matmul twice. Selective recompute keeps what is expensive to compute
- the outputs of matmuls (the projections, the fused q/k/v and gate/up products, attention's
batched products) and of the attention kernels - and recomputes only what is cheap: norms,
rotary embeddings, SwiGLU's activation and product, residual adds, dtype casts, the views in
between. Its backward recomputes no matmul; the activations it keeps are about the matmul
outputs of a layer, against every intermediate tensor autograd would keep without recompute.

It is `torch.utils.checkpoint` with `create_selective_checkpoint_contexts` and the policy
`policy` below, the same call signature as `llama.torch_checkpoint`, so `LlamaModel.checkpoint_fn`
and a pipeline's `activation_checkpoint_func` take it as they take full recompute. Recomputing
an operator gives bitwise its first result (same inputs, same kernel), so in fp32 a selective
run's losses and gradients are bitwise those of no recompute.
"""
from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten

# Kept in forward for backward: products and attention. Everything else is recomputed.
SAVED_OPS = frozenset(op for op in (
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_mm.default,  # FP8 matmuls on GPUs (train.fp8)
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None) and
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    getattr(_aten, "_flash_attention_forward", None) and _aten._flash_attention_forward.default,
) if op is not None)


def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save the outputs of matmuls and attention; recompute every other operator."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint(function, *args):
    """`function(*args)` under selective recompute (`policy`); `llama.torch_checkpoint`'s
    signature, non-reentrant like it."""
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
