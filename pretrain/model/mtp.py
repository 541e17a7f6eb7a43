"""Multi-token prediction (DeepSeek-V3, sec. 2.2; `model.mtp_depth` modules, deepseek_v3 only).

After the decoder, D modules predict further ahead, one after the other. Module k (1..D) takes
the hidden state h^{k-1}_i of position i (k = 1: the decoder's last layer output, before the
final norm) and the embedding of token t_{i+k}:

    h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])      (2C -> C)
    h^k_i = a decoder layer of the model's own kind (latent attention; the mixture of experts
            when the model has experts), at position i's rotary angle
    CE_k  = the cross entropy of lm_head(shared_head.norm(h^k_i)) against t_{i+k+1}

The embedding and the lm_head are the model's own (shared, as in DeepSeek-V3); each module has
its own head norm, `shared_head.norm`. The embedding comes first in the concatenation, as
DeepSeek-V3's released weights (and Megatron-Core, vLLM) have it. Position i of depth k has no
target where i + k + 1 runs past the sample (its last k positions): those labels are ignored
(-100), so CE_k is the mean over the sample's other T - k positions. Document masking
(`pretrain.model.documents`) leaves the main loss' labels as they are (the prediction made at an
end-of-document counts), and so does this: the module's attention stays inside each document
like every layer's, its targets are not masked at the boundaries.

The modules are `MultiTokenPrediction` decoder layers appended to the decoder's layer list as
layers num_layers .. num_layers + D - 1: their parameters are named as DeepSeek-V3's
checkpoints name them (`model.layers.{num_layers + k - 1}.{enorm,hnorm,eh_proj,shared_head.norm,
self_attn,mlp,...}`), so initialisation, tensor-parallel sharding, checkpoints, resharding and
the Hugging Face export follow the decoder layers' rules by name (`pretrain.families`); the
decoder runs only its first num_layers.

The loss the model returns stays the language-model loss (the logged `loss`, comparable with a
run without the modules): `with_gradient_of` adds lambda / D x sum_k CE_k (`model.mtp_loss_weight`)
to what is back-propagated, with the gradient the returned loss gets (1 / gradient-accumulation
steps, an fp16 loss scale). Each module sums its CE_k of a step's training forwards on the device;
`collect_losses` reads them once per step (`mtp_loss`, `mtp_losses` in metrics.jsonl). Only a
training forward with labels runs the modules: evaluation and generation use the main head.

Tensor parallelism: the projection's input is the whole hidden state on every rank, its
output enters the layer as the residual stream does, so its gradient is whole there; under
sequence parallelism each rank holds T/tp positions of it (the shifted tokens' embedding comes
out of the vocab-parallel embedding in the same shards) and the projection's and the norms'
gradients are summed over the group once per step (`SequenceShardedWeightGrad`).

Context parallelism (Ulysses' contiguous chunks): a rank's last k positions need the tokens
after its chunk, the first k of the next rank's (`context_parallel.lookahead`: one all-gather of
the chunks' first D input ids and labels; past the sequence's end 0 and ignored, as one process
fills them), and each module's loss is its chunk's share of the sequence's as the main loss is
(`chunk_loss_scale`). The module's decoder layer attends over the whole sequence as every layer
does. Pipeline parallelism is refused (`pretrain.resolve.layout`).
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn

from pretrain.config import ModelConfig
from pretrain.model.hf import EMBED, LM_HEAD
from pretrain.model.layers import RMSNorm
from pretrain.model.llama import DecoderLayer
from pretrain.model.tensor_parallel import SequenceShardedWeightGrad, column_parallel_input


class SharedHead(nn.Module):
    """The module's head: its own norm (`shared_head.norm`); the projection is the model's
    lm_head."""

    def __init__(self, cfg: ModelConfig, *, sequence_parallel_group=None) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps,
                            sequence_parallel_group=sequence_parallel_group)


class MultiTokenPrediction(DecoderLayer):
    """Multi-token prediction module `depth` (0-based): a decoder layer (its parameters under
    the decoder layer's names, numbered `num_layers + depth`) with the module's norms, input
    projection and head norm."""

    def __init__(self, cfg: ModelConfig, *, depth: int, tp_group=None,
                 sequence_parallel: bool = False, cp_group=None, expert_parallel=False,
                 context_kind: str = "ulysses") -> None:
        super().__init__(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         cp_group=cp_group, expert_parallel=expert_parallel,
                         layer_index=cfg.num_layers + depth, context_kind=context_kind)
        self.depth = depth
        group = tp_group if sequence_parallel else None  # the positions split over it
        self.enorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel_group=group)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel_group=group)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.eh_proj.weight_grad = SequenceShardedWeightGrad(group)
        self.eh_proj.weight_grad.attach(self.eh_proj.weight)
        self.shared_head = SharedHead(cfg, sequence_parallel_group=group)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.reset_losses()

    def reset_losses(self) -> None:
        """Forget the step's sums (`collect_losses`)."""
        self.loss_sum: torch.Tensor | None = None  # (CE_k summed, training forwards)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, document_ids: torch.Tensor | None = None,
                boundaries=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h^k, the lm_head's input of h^k) of h^{k-1} (`hidden`) and the embedding of the
        tokens k ahead (`embedded`). The head's input is normed by the module's own norm and
        whole on every tensor rank. One call of the module, so that whatever wraps its
        forward (fsdp2's gathers, compilation, recomputation) covers all of it."""
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        x = super().forward(x, cos, sin, None, document_ids, boundaries)
        return x, column_parallel_input(self.shared_head.norm(x), self.tp_group,
                                        sequence_parallel=self.sequence_parallel)

    def count(self, loss: torch.Tensor) -> None:
        """Add a training forward's CE_k to the step's sums, on the device (nothing read)."""
        row = torch.stack((loss.detach().double(), loss.new_ones((), dtype=torch.float64)))
        self.loss_sum = row if self.loss_sum is None else self.loss_sum + row


def mtp_modules(module: nn.Module) -> list[MultiTokenPrediction]:
    return sorted((m for m in module.modules() if isinstance(m, MultiTokenPrediction)),
                  key=lambda m: m.depth)


def reset_losses(module: nn.Module) -> None:
    """Forget the step's sums of every module of `module` (a step abandoned part way)."""
    for m in mtp_modules(module):
        m.reset_losses()


def collect_losses(module: nn.Module, *, depth: int, device, group=None) -> dict:
    """The step's mean cross entropy of each module over its training forwards on every rank
    of `group` (the data-parallel ranks: collective), as the logged loss is averaged; resets the
    sums. `mtp_losses`: per depth (unweighted); `mtp_loss`: their mean, what
    `model.mtp_loss_weight` multiplies into the back-propagated loss."""
    import torch.distributed as dist

    table = torch.zeros(depth, 2, dtype=torch.float64, device=device)
    for m in mtp_modules(module):
        if m.loss_sum is not None:
            table[m.depth] += m.loss_sum.to(device)
        m.reset_losses()
    if dist.is_initialized() and group is not None:
        dist.all_reduce(table, group=group)
    table = table.cpu()
    losses = (table[:, 0] / table[:, 1].clamp(min=1.0)).tolist()
    return {"mtp_loss": sum(losses) / max(depth, 1), "mtp_losses": losses}


# ---- checkpoints ---------------------------------------------------------------------------------

# DeepSeek-V3's checkpoints carry each module's copy of the shared embedding and head
_COPY = re.compile(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")


def checkpoint_copies(cfg: ModelConfig) -> dict[str, str]:
    """{a module's copy in a DeepSeek-V3 checkpoint: the model's tensor it holds} (the export
    writes them, as DeepSeek-V3's checkpoints and the engines serving them have them)."""
    head = EMBED if cfg.tie_embeddings else LM_HEAD
    return {name: source for k in range(cfg.mtp_depth) for name, source in (
        (f"model.layers.{cfg.num_layers + k}.embed_tokens.weight", EMBED),
        (f"model.layers.{cfg.num_layers + k}.shared_head.head.weight", head))}


def is_checkpoint_copy(name: str) -> bool:
    """Whether `name` is a module's copy of the shared embedding or head (skipped on import:
    the model's own are the ones trained)."""
    return _COPY.match(name) is not None


def depth_present(names, cfg: ModelConfig) -> int:
    """The modules of `cfg.mtp_depth` whose weights `names` holds, from the first: transformers'
    config.json counts one by default and its checkpoints hold none."""
    depth = 0
    while depth < cfg.mtp_depth and \
            f"model.layers.{cfg.num_layers + depth}.eh_proj.weight" in names:
        depth += 1
    return depth
