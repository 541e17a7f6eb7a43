"""Tolerances of bf16 comparisons derived from bf16's rounding, and fp64 reference losses: one
derivation for every test that compares a bf16 forward pass with another."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BF16_U = 2.0 ** -8  # bf16's unit roundoff: 8 significant bits, round to nearest


def bf16_logits_tolerance(ref_logits: torch.Tensor, *, roundings: int) -> float:
    """The largest |difference| between two bf16 forward passes of the same model's logits that
    bf16 rounding explains, when the passes differ in `roundings` roundings of activations.

    - Each pass rounds its logits to bf16 once, by at most half an ulp: one ulp of bf16 at the
      logits' largest magnitude M (ulp = 2^(floor(log2 M) - 7)) between the two.
    - Any other rounding changes an activation by at most u = 2^-8 of its magnitude, uniformly
      within that (standard deviation u / sqrt(3)), with a sign that follows no pattern. Counted
      as a rounding of the whole hidden state (an overestimate where the rounded sublayer output
      is smaller than the residual stream it joins; the final norm keeps relative errors), it
      moves a logit z = w . h, a sum over the hidden size, by ~u / sqrt(3) * rms(z); n such
      roundings by sqrt(n) of that. 4 u sqrt(n) rms(z) is 7 of those standard deviations:
      beyond the largest of the few 10^4 logits compared (~4.5 standard deviations).
    """
    z = ref_logits.float()
    ulp = 2.0 ** (math.floor(math.log2(z.abs().max().item())) - 7)
    rms = z.pow(2).mean().sqrt().item()
    tol = ulp + 4 * math.sqrt(roundings) * BF16_U * rms
    # could fail: logits off by their own scale (all zero, a dropped norm weight, a shard in the
    # wrong place, a missing reduction) differ by more than rms / 8 on most elements
    assert tol < rms / 8, (tol, rms)
    return tol


def cross_entropy64(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross entropy of (B, T, V) logits over the labels that are not -100, in fp64."""
    return F.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-100)


VOCAB_MATRICES = ("model.embed_tokens.weight", "lm_head.weight")  # rows padded under tp


def full_grads(model) -> dict[str, torch.Tensor]:
    """A tensor-parallel `LlamaModel`'s gradients gathered to whole, unpadded tensors by Hugging
    Face name (collective over its tp group), to compare with a one-process model's; the padded
    vocabulary rows must have received no gradient."""
    from pretrain.model import tensor_partition_dim
    from pretrain.model.tensor_parallel import all_gather_along

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        dim = tensor_partition_dim(name)
        if dim is not None:
            g = all_gather_along(g, model.tp_group, dim)
        if name in VOCAB_MATRICES:
            assert bool((g[model.cfg.vocab_size:] == 0).all()), f"{name}: padded rows got grads"
            g = g[:model.cfg.vocab_size]
        grads[name] = g
    return grads


def replica_mean_loss_and_grads(model, loss: torch.Tensor, *, topology, groups) -> dict:
    """After `loss.backward()` on this rank: the loss and the whole gradients (`full_grads` under
    tensor parallelism) averaged over the data x context replicas as DeepSpeed averages them
    (`groups` None: one process, taken as they are), to compare with one process's."""
    import torch.distributed as dist

    grads = full_grads(model) if model.tp_group is not None else {
        name: p.grad.clone() for name, p in model.named_parameters()}
    if groups is not None:
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=groups.data)
        loss = mean / topology.replicas
        for g in grads.values():
            dist.all_reduce(g, group=groups.data)
            g /= topology.replicas
    return {"loss": float(loss.detach()), "grads": grads}


def assert_ranks_match_one_process(single: dict, results: list[dict], *,
                                   rtol: float = 1e-6) -> None:
    """Each rank's `replica_mean_loss_and_grads` equals one process's: the loss, and every
    gradient to `rtol` of its largest element (fp64 models but for the fp32 cross entropy:
    ~1e-7; a key at the wrong position, a misplaced head or a gradient not reduced is O(1));
    and no gradient of the single run is all zero (the comparison would prove nothing)."""
    for rank, result in enumerate(results):
        assert abs(result["loss"] - single["loss"]) <= rtol * abs(single["loss"]), rank
        for name, g in single["grads"].items():
            err = float((result["grads"][name] - g).abs().max())
            assert err <= rtol * float(g.abs().max()), (rank, name, err)
    assert min(float(g.abs().max()) for g in single["grads"].values()) > 0
