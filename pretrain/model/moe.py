"""A routed mixture of SwiGLU experts (Mixtral's and Qwen3-MoE's form; `model.num_experts` > 0).

A decoder layer's MLP becomes `MoE` where its family says so (`Family.moe_layer`: Mixtral every
layer, Qwen3-MoE every `moe_layer_interval`-th): a router (`gate`, a bias-free h -> E linear)
gives every token softmax probabilities over the E experts in fp32; the token goes to its
`experts_per_token` (k) most likely experts, whose outputs are summed with the k probabilities
renormalised to sum to 1 (Mixtral, `moe_norm_topk_prob`; with k = 1 the weight is 1 and the
router learns from the auxiliary losses only) or as they are (Qwen3-MoE's `norm_topk_prob`
false). Each expert is a SwiGLU MLP, down(silu(gate(x)) * up(x)), of `expert_ffn_hidden_size`
inner features (Qwen3-MoE's fine-grained experts: `moe_ffn_hidden_size`).

Parameter names (Hugging Face `MixtralForCausalLM` keeps the router as `mlp.gate.weight`; its
experts are stacked 3-D tensors, which `pretrain.model.hf` splits and stacks):

    model.layers.N.mlp.gate.weight                         (E, h)  router, replicated over tp
    model.layers.N.mlp.experts.M.{gate_proj,up_proj}.weight  (f, h)  column-parallel
    model.layers.N.mlp.experts.M.down_proj.weight            (h, f)  row-parallel

so every expert matrix is a 2-D parameter with the dense MLP's projection names: seeded block
init, tensor-parallel sharding, muP groups, ZeRO partitioning and checkpoint resharding treat it
like the dense model's.

Compute: the (token, expert) assignments are sorted by expert (a stable argsort), the tokens of
each expert gathered with one `index_select`, each expert runs one matmul (gate/up fused) over
its tokens, and the weighted outputs go back with one `index_add`; the Python loop is over
experts, never tokens. Every expert runs on every call, with zero tokens too: under ZeRO-3 each
rank must gather the same parameters in the same order.

Grouped matmul (`grouped_outputs`): where torch has a grouped kernel for the tokens' device and
dtype (`grouped_mm_runs`: CUDA from Hopper on, bf16, rows a multiple of 16 bytes), all experts
run as two `torch._grouped_mm` calls instead of the loop: gate/up of every expert stacked
(E, 2f, h), then down (E, h, f), each group's rows given by the device's running sum of the
counts, so the forward needs no host read at all (dropped assignments, sorted last, ride in the
last group with combine weight 0). Under ZeRO-3 the weights are read without calling the
experts, which DeepSpeed gathers as the reading module's external parameters (as
`fused_projections`' are; the ZeRO-3 MoE training tests passed with it forced). The weights
are copied into the stacks once per forward (and the gradient split back in backward), as
`fused_projections` does. torch 2.13's CPU build runs `_grouped_mm` too (fp32, and bf16 with
aligned rows), as one matmul per group: bitwise the loop's result and a little slower (the
stacks), so CPUs keep the loop; the tests run both and compare them. `MoE.grouped` (None: by device) forces either.
Under `train.fp8` the grouped matmul still multiplies in the run's precision (it takes no FP8
scales); the loop calls each expert's three projections through their own FP8 matmuls
(`Expert.fp8`), and an expert without rows casts nothing.

Host reads: a looped forward reads the device once, the rows of each expert its split needs (one
`tolist` of the counts; under expert parallelism of the counts sent and received, grouped or
looped); a grouped forward without expert parallelism reads nothing. Everything
else stays on the device: the counts without `bincount` (which reads the largest index back),
capacity's dropped assignments sorted after the kept ones instead of removed by a boolean mask
(whose size the host would read), `repeat_interleave` told its output size, and the router
statistics summed in device tensors that `collect_stats` reads once per step.

Tensor parallelism: tokens are routed on the whole (gathered) sequence, the same on every rank
of the group. Each rank's experts hold f/tp inner features, so its output is a partial sum,
reduced ONCE after the combine (all-reduce, or reduce-scatter under sequence parallelism), as
the dense MLP does. The combine weights then get partial gradients on each rank: the router's
weight gradient is summed over the group once per step (`SequenceShardedWeightGrad`), and the
auxiliary losses, the same on every rank, add 1/tp of their gradient on each.

Auxiliary losses (per layer, summed over the layers into the back-propagated loss):

- load balancing (Switch Transformer; Megatron-Core's normalisation):
  E * sum_i f_i * P_i, f_i the fraction of the N*k assignments given to expert i (before any
  drop), P_i the mean router probability of expert i: 1.0 when perfectly balanced;
  x `model.moe_aux_loss_coeff`,
- router z-loss (ST-MoE): mean over tokens of logsumexp(router logits)^2;
  x `model.moe_z_loss_coeff`.

They are added by `AuxLossGradient`, which passes the layer's output through and hands the
auxiliary loss its gradient in backward: the flat model and a pipeline stage (whose loss lives
on the last stage) alike, and the loss the model returns stays the language-model loss. Both are
computed over the tokens of one micro-batch, as one process does: where its tokens are split
(each context rank holds a chunk of every sequence, each expert rank routes a chunk of that),
the sums behind the losses are all-reduced over those ranks (`_group_aux_losses`), so every
rank holds the micro-batch's losses and differentiates them through its own tokens only. The
context ranks' gradients are then averaged by the data-parallel reduction (data x context
ranks), so each context rank scales its auxiliary gradient by N, as its language-model loss is.

Capacity (`model.moe_capacity_factor` > 0): each expert takes at most
ceil(factor * N * k / E) of a forward's N tokens, first come (token order, then choice order);
the assignments over it are dropped (they add nothing; the residual carries the token) and
counted. 0 is dropless.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from pretrain.config import ModelConfig
from pretrain.families import family_of
from pretrain.model.context_parallel import cp_world_size
from pretrain.model.expert_parallel import (ExpertGroups, count_rows, gather_tokens, run_experts,
                                             scatter_tokens)
from pretrain.model.layers import column_linear, row_linear
from pretrain.model.tensor_parallel import (SequenceShardedWeightGrad, column_parallel_input,
                                            reduce_from_tp, reduce_scatter_to_sequence,
                                            tp_rank, tp_world_size)


STAT_FIELDS = 5  # `MoE.stats`: the sums before the per-expert counts


class AuxLossGradient(torch.autograd.Function):
    """Identity on `output`; in backward, `aux_loss` gets gradient `scale` (a float).

    `scale` is d(back-propagated loss)/d(aux_loss): the engine divides the loss by the
    gradient-accumulation steps (and multiplies it by an fp16 loss scale) before backward, so
    the trainer sets the same factor with `set_aux_loss_grad_scale` before each step.
    """

    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


_AUX_GRAD_SCALE = [1.0]


def set_aux_loss_grad_scale(scale: float) -> None:
    """The factor the engine applies to the loss before backward (1 / gradient-accumulation
    steps, times an fp16 loss scale), for the auxiliary losses' gradients."""
    _AUX_GRAD_SCALE[0] = float(scale)


def aux_loss_grad_scale(engine) -> float:
    """`set_aux_loss_grad_scale`'s factor for a DeepSpeed engine (flat or pipeline): it divides
    the loss by its gradient-accumulation steps, and under fp16 multiplies it by the optimizer's
    current loss scale."""
    scale = 1.0 / engine.gradient_accumulation_steps()
    if engine.fp16_enabled():
        scale *= float(getattr(engine.optimizer, "cur_scale", 1.0))
    return scale


class Expert(nn.Module):
    """One SwiGLU expert; its forward is this rank's partial sum under tensor parallelism (the
    down projection's input features are sharded, and `MoE` reduces once for all experts)."""

    def __init__(self, cfg: ModelConfig, *, tp_group=None, project: Callable) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.expert_ffn_hidden_size
        self.gate_proj = column_linear(h, f, tp_group=tp_group)
        self.up_proj = column_linear(h, f, tp_group=tp_group)
        # row-parallel weight (h, f/tp); read directly so that no all-reduce runs per expert
        self.down_proj = row_linear(f, h, tp_group=tp_group)
        self.fused = cfg.fused_projections
        self.project = project  # `compile_blocks` swaps in an eager one at ZeRO-3
        self.gate_up_sizes = [f // tp_world_size(tp_group)] * 2
        self.fp8 = False  # `fp8.convert_to_fp8`: each projection through its own FP8 matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 and x.shape[0]:
            # the layers' own matmuls (the tensor-parallel ones' local product, no collective:
            # `MoE` reduces once); each casts its input and weight with a scale of its own
            gate, up = _local_product(self.gate_proj, x), _local_product(self.up_proj, x)
            return _local_product(self.down_proj, F.silu(gate) * up)
        # an expert no row went to computes nothing and, under FP8, casts nothing: a dynamic
        # scale of an empty tensor has no maximum (torchao raises) and no product needs one;
        # its weights are still read, in the same order on every rank (ZeRO-3's gathers)
        if self.fused and not self.fp8:
            gate, up = self.project(x, [self.gate_proj, self.up_proj], self.gate_up_sizes)
        else:
            gate, up = F.linear(x, self.gate_proj.weight), F.linear(x, self.up_proj.weight)
        return F.linear(F.silu(gate) * up, self.down_proj.weight)


def _local_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s matmul of `x` on this rank: a tensor-parallel layer's local product (`linear`,
    FP8's when converted) without its collective, a plain (or torchao's FP8) linear called."""
    linear = getattr(layer, "linear", None)
    return linear(x, layer.weight) if linear is not None else layer(x)


def grouped_mm_runs(tokens: torch.Tensor, experts: list[Expert]) -> bool:
    """Whether `experts` run over `tokens` as one grouped matmul on this device: torch's grouped
    kernel is CUDA's from compute capability 9.0 (Hopper) on, in bf16, every row and weight row
    a multiple of 16 bytes; elsewhere the loop is as fast (module docstring)."""
    if not hasattr(torch, "_grouped_mm") or tokens.device.type != "cuda" \
            or torch.cuda.get_device_capability(tokens.device) < (9, 0):
        return False
    align = 16 // tokens.element_size()
    inner = experts[0].gate_up_sizes[0]  # this rank's f, without reading a (ZeRO-3) weight
    return (tokens.dtype == experts[0].down_proj.weight.dtype == torch.bfloat16
            and tokens.shape[-1] % align == 0 and inner % align == 0)


def grouped_outputs(experts: list[Expert], rows: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
    """The outputs (M, C) of `rows` (M, C), grouped by expert, `counts[i]` rows (a device tensor,
    summing to M) for `experts[i]`: two `torch._grouped_mm` calls, no host read."""
    ends = torch.cumsum(counts, 0).to(torch.int32)
    f = experts[0].gate_up_sizes[0]  # this rank's inner features
    # [gate_0; up_0; gate_1; ...] in one copy -> (E, 2f, h), read as (E, h, 2f)
    gate_up = torch.stack([w for e in experts for w in (e.gate_proj.weight, e.up_proj.weight)])
    gate_up = gate_up.view(len(experts), 2 * f, -1).transpose(1, 2)
    gate, up = torch._grouped_mm(rows, gate_up, offs=ends).split(f, dim=-1)
    down = torch.stack([e.down_proj.weight for e in experts]).transpose(1, 2)  # (E, f, h)
    return torch._grouped_mm(F.silu(gate) * up, down, offs=ends)


def looped_outputs(experts: list[Expert], rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """`grouped_outputs` as a loop over the experts, `sizes` (host ints) rows each."""
    return torch.cat([expert(part) for expert, part in zip(experts, rows.split(sizes))])


class LocalExperts(nn.ModuleDict):
    """An expert-parallel rank's experts under their global indices (`experts.M`, so the
    parameter names are the layer's own), whose forward runs them all over the rows it is
    given: the unit `fully_shard` shards apart from the rest of its layer on the expert grid
    (`pretrain.training.fsdp2`), whose hooks fire on a module's forward."""

    # set by `_local_experts`: the gradients are reduced over the expert-data ranks
    reduced_apart = False

    def forward(self, rows: torch.Tensor, sizes: list[int], counts: torch.Tensor,
                grouped: bool) -> torch.Tensor:
        """The outputs of `rows` grouped by local expert: `sizes` (host ints) or `counts` (the
        same on the device) rows each, as `grouped_outputs` or `looped_outputs`."""
        experts = list(self.values())
        if grouped:
            return grouped_outputs(experts, rows, counts)
        return looped_outputs(experts, rows, sizes)


class Routing:
    """The router's decisions for N tokens: which expert each kept assignment goes to."""

    def __init__(self, logits: torch.Tensor, *, top_k: int, capacity_factor: float,
                 renormalise: bool = True, sigmoid: dict | None = None) -> None:
        """`sigmoid`: `sigmoid_choice`'s options (bias, groups, topk_groups, scaling): DeepSeek-V3's
        choice instead of the softmax's; the balance loss then reads the scores normalised over
        the experts (its sequence-wise loss's affinities)."""
        N, E = logits.shape
        if sigmoid is None:
            self.probs = torch.softmax(logits.float(), dim=-1)  # (N, E) fp32
            top_p, top_e = torch.topk(self.probs, top_k, dim=-1)  # (N, k)
            # renormalised over the k (Mixtral; Qwen3-MoE's norm_topk_prob), or the softmax's own
            weights = top_p / top_p.sum(dim=-1, keepdim=True) if renormalise else top_p
        else:
            top_e, weights, scores = sigmoid_choice(logits, top_k=top_k,
                                                    renormalise=renormalise, **sigmoid)
            self.probs = scores / scores.sum(dim=-1, keepdim=True)
        self.top_experts = top_e
        expert_of = top_e.reshape(-1)  # (N*k,) token-major: token 0's choices first
        # (E,) before any drop; a scatter, not bincount, which reads the largest index back
        self.selected = torch.zeros(E, dtype=torch.long, device=logits.device).scatter_add_(
            0, expert_of, torch.ones_like(expert_of))
        order = torch.argsort(expert_of, stable=True)  # grouped by expert, token order inside
        if capacity_factor > 0:
            capacity = math.ceil(capacity_factor * N * top_k / E)
            starts = torch.cumsum(self.selected, 0) - self.selected
            sorted_experts = expert_of[order]
            rank_in_expert = torch.arange(order.numel(), device=order.device) \
                - starts[sorted_experts]
            # the kept first, still grouped by expert, the dropped after them: the same
            # number of rows whatever the router chose (a mask would make the host read it)
            order = order[torch.argsort((rank_in_expert >= capacity).int(), stable=True)]
            self.kept = torch.clamp(self.selected, max=capacity)
        else:
            self.kept = self.selected
        self.assignments = N * top_k
        self.dropped = self.assignments - self.kept.sum()  # on the device
        # (N*k,) token of each assignment, the kept ones first and grouped by expert: the first
        # sum(kept) are computed (the caller knows how many once it has read `kept`)
        self.token = order // top_k
        self.weight = weights.reshape(-1)[order]  # (N*k,) fp32 combine weight, same order

    def balance_loss(self) -> torch.Tensor:
        """E * sum_i f_i * P_i (1.0 when balanced); differentiable through P."""
        E = self.probs.shape[1]
        fraction = self.selected.float() / self.assignments  # f_i, sums to 1
        return E * torch.sum(fraction * self.probs.mean(dim=0))


def sigmoid_choice(logits: torch.Tensor, *, top_k: int, bias: torch.Tensor | None = None,
                   groups: int = 1, topk_groups: int = 1, renormalise: bool = True,
                   scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router choice for logits (N, E): (experts (N, k), combine weights (N, k)
    fp32, scores (N, E) fp32), as transformers' `DeepseekV3TopkRouter` (the k in no order).

    Scores are sigmoid(logits); the choice adds the per-expert `bias` (auxiliary-loss-free
    balancing: it steers which experts are chosen, never the weights, and is updated outside the
    gradient, `updated_expert_bias`); with `groups` > 1 the E experts form that many groups, a
    group's score is the sum of its 2 best biased scores, and each token chooses among the
    experts of its `topk_groups` best groups only (group-limited routing). The weights are the
    chosen experts' unbiased scores, renormalised to 1 (`renormalise`), times `scaling`
    (transformers' `routed_scaling_factor`). `MoE` runs it with `model.moe_router: sigmoid`."""
    scores = torch.sigmoid(logits.float())
    choice = scores if bias is None else scores + bias.float()
    if groups > 1:
        N, E = choice.shape
        group_scores = choice.view(N, groups, E // groups).topk(2, dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, topk_groups, dim=-1, sorted=False).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(E // groups, dim=1),
                                    float("-inf"))
    top_e = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, top_e)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return top_e, weights * scaling, scores


def updated_expert_bias(bias: torch.Tensor, expert_tokens: torch.Tensor,
                        rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing step (its paper, section 2.1.2): after a step
    whose assignments per expert were `expert_tokens` (E,), each expert's bias rises by `rate`
    if it was underloaded (below the mean), falls by `rate` if overloaded, outside the
    gradient."""
    load = expert_tokens.to(bias.dtype)
    return bias + rate * torch.sign(load.mean() - load)


class MoE(nn.Module):
    """A routed mixture of SwiGLU experts in place of a decoder layer's MLP (module docstring)."""

    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 project: Callable, expert_parallel: bool = False, cp_group=None,
                 layer_index: int = 0) -> None:
        """`layer_index`: the decoder layer's (0-based), for the per-layer statistics.
        `project`: `llama.fused_projections`, gate and up of an expert as one matmul.
        `expert_parallel`: True: the tensor-parallel ranks hold whole experts, an equal share
        each (`pretrain.model.expert_parallel`), instead of 1/tp of every expert; an
        `ExpertGroups`: the expert grid's ranks hold them (whole, or split over the tensor
        group), tokens swapped over its `group`.
        `cp_group`: the context-parallel group (`pretrain.model.context_parallel`): the layer
        gets this rank's chunk of each sequence, and the auxiliary losses sum over the group."""
        super().__init__()
        self.layer_index, self.num_experts = layer_index, cfg.num_experts
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.tensor_parallel = tp_world_size(tp_group)
        self.context_parallel = cp_world_size(cp_group)
        self.cp_group = cp_group if self.context_parallel > 1 else None
        self.top_k = cfg.experts_per_token
        self.renormalise = cfg.moe_norm_topk_prob  # the k probabilities summed to 1 (Mixtral)
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # replicated
        self.sigmoid = cfg.moe_router == "sigmoid"
        self.scaling = cfg.moe_routed_scaling_factor
        self.groups, self.topk_groups = cfg.moe_groups, cfg.moe_topk_groups
        if self.sigmoid:  # the choice's per-expert bias: a buffer, moved outside the gradient
            # (`update_expert_bias`), fp32 whatever the model's dtype; transformers' name
            self.gate.register_buffer("e_score_correction_bias",
                                      torch.zeros(cfg.num_experts, dtype=torch.float32))
        # each rank's router gradient is a partial sum (see the module docstring)
        self.weight_grad = SequenceShardedWeightGrad(tp_group)
        self.weight_grad.attach(self.gate.weight)
        grid = expert_parallel if isinstance(expert_parallel, ExpertGroups) else None
        # the all-to-all's ranks; whether each expert is split over the tensor group (then every
        # tensor rank routes the same, whole sequence); the ranks routing the other chunks of
        # this rank's micro-batch (None: it routes its whole local sequence)
        self.split_experts = grid.split if grid is not None else not (
            expert_parallel and self.tensor_parallel > 1)
        if grid is not None:
            self.expert_group = grid.group
            self.token_group = None if grid.split or self.tensor_parallel == 1 else tp_group
            self.experts = _local_experts(cfg, rank=grid.rank, size=grid.size, project=project,
                                          tp_group=tp_group if grid.split else None,
                                          reduced_apart=True)
        elif expert_parallel and self.tensor_parallel > 1:
            self.expert_group = self.token_group = tp_group
            self.experts = _local_experts(cfg, rank=tp_rank(tp_group), size=self.tensor_parallel,
                                          project=project)
        else:
            self.expert_group = self.token_group = None
            self.experts = nn.ModuleList(Expert(cfg, tp_group=tp_group, project=project)
                                         for _ in range(cfg.num_experts))
        # how many ranks route each token (tensor ranks routing the same tokens count 1/tp)
        self.token_copies = self.tensor_parallel if self.split_experts else 1
        self.grouped: bool | None = None  # the experts as one grouped matmul; None: by device
        # DeepSeek-V3's shared experts: one dense SwiGLU every token goes through, added
        self.shared_experts = None
        if cfg.num_shared_experts:
            shared = dataclasses.replace(
                cfg, ffn_hidden_size=cfg.num_shared_experts * cfg.expert_ffn_hidden_size)
            self.shared_experts = family_of(cfg).module("mlp")(  # the family's dense MLP
                shared, tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Forget the sums `stats` reports (the trainer calls it once per step); the first
        training forward starts them again on its device."""
        # forwards, balance loss, z-loss, dropped assignments, assignments
        self.stats: torch.Tensor | None = None
        # the assignments each expert was selected for (before any drop)
        self.expert_tokens: torch.Tensor | None = None

    def _count(self, routing: Routing, balance: torch.Tensor, z_loss: torch.Tensor) -> None:
        """Add a forward to the statistics, on the device (no value is read back here)."""
        one = balance.new_ones((), dtype=torch.float64)
        row = torch.stack([one, balance.detach().double(), z_loss.detach().double(),
                           routing.dropped.double(), one * routing.assignments])
        if self.stats is None:
            self.stats = torch.zeros_like(row)
            self.expert_tokens = torch.zeros(self.num_experts, dtype=torch.float64,
                                             device=row.device)
        self.stats += row
        self.expert_tokens += routing.selected.double()

    def _grouped(self, tokens: torch.Tensor, experts: list[Expert]) -> bool:
        return grouped_mm_runs(tokens, experts) if self.grouped is None else self.grouped

    def route(self, flat: torch.Tensor) -> tuple[Routing, torch.Tensor, torch.Tensor]:
        """(routing, router logits (N, E) fp32, the weighted auxiliary loss) of tokens (N, h)."""
        logits = self.gate(flat).float()
        sigmoid = None if not self.sigmoid else dict(
            bias=self.gate.e_score_correction_bias, groups=self.groups,
            topk_groups=self.topk_groups, scaling=self.scaling)
        routing = Routing(logits, top_k=self.top_k, capacity_factor=self.capacity_factor,
                          renormalise=self.renormalise, sigmoid=sigmoid)
        # the ranks routing other tokens of this micro-batch: the tensor ranks when each routes
        # a chunk of the same tokens (tensor ranks routing the same tokens share nothing), the
        # context ranks; never the data ranks (other micro-batches) an expert group may span
        sharing = [g for g in (self.token_group, self.cp_group) if g is not None]
        if not sharing:
            balance = routing.balance_loss()
            z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        else:  # over the tokens of every such rank: the micro-batch one process sees
            balance, z_loss = _group_aux_losses(routing, logits, sharing)
        if self.training and torch._C._current_graph_task_id() == -1:  # not a recompute
            self._count(routing, balance, z_loss)
        return routing, logits, self.aux_coeff * balance + self.z_coeff * z_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._routed(x)
        if self.shared_experts is not None:  # reduced (or reduce-scattered) as the dense MLP
            out = out + self.shared_experts(x)
        return out

    def _apply(self, fn, recurse=True):
        """The expert bias stays fp32 when the model is cast (bf16 would lose the rate's
        steps), as transformers keeps it."""
        super()._apply(fn, recurse)
        if self.sigmoid:
            buffers = self.gate._buffers
            buffers["e_score_correction_bias"] = buffers["e_score_correction_bias"].float()
        return self

    @torch.no_grad()
    def update_expert_bias(self, expert_tokens: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's balancing step (`updated_expert_bias`) from the step's assignments per
        expert over every rank (E,): the same on every rank when they are."""
        bias = self.gate.e_score_correction_bias
        bias.copy_(updated_expert_bias(bias, expert_tokens.to(bias.device), rate))

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        if self.expert_group is not None and not self.split_experts:
            return self._forward_expert_parallel(x)
        x = column_parallel_input(x, self.tp_group, sequence_parallel=self.sequence_parallel)
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        routing, _, aux_loss = self.route(flat)
        if self.expert_group is not None:  # split experts on the expert grid's ranks
            out = self._dispatch(flat, routing).view(B, T, C)
        else:
            out = self._local_combine(flat, routing, x.dtype).view(B, T, C)
        if self.sequence_parallel:  # partial sums -> this rank's (B, T/tp, C) of the total
            out = reduce_scatter_to_sequence(out, self.tp_group)
        else:
            out = reduce_from_tp(out, self.tp_group)
        if out.requires_grad and (self.aux_coeff or self.z_coeff):
            # identical on every tp rank, and the input/router gradients are summed over them;
            # x N: the data-parallel reduction averages over the context ranks' chunks
            scale = _AUX_GRAD_SCALE[0] * self.context_parallel / self.tensor_parallel
            out = AuxLossGradient.apply(out, aux_loss, scale)
        return out

    def _local_combine(self, flat: torch.Tensor, routing: Routing, dtype) -> torch.Tensor:
        """(N, C): every expert on this rank, each token's outputs weighted and summed."""
        experts = list(self.experts)
        if self._grouped(flat, experts):
            # every assignment, the dropped ones last: no host read of how many were kept
            token, weight = routing.token, routing.weight
            counts = routing.kept
            if self.capacity_factor > 0:  # the dropped rows join the last group, weight 0
                kept = torch.arange(token.numel(), device=token.device) < routing.kept.sum()
                weight = weight * kept
                counts = torch.cat([counts[:-1], (token.numel() - counts[:-1].sum())[None]])
            outputs = grouped_outputs(experts, flat.index_select(0, token), counts)
        else:
            sizes = routing.kept.tolist()  # the forward's one host read: each expert's rows
            kept = sum(sizes)
            token, weight = routing.token[:kept], routing.weight[:kept]
            tokens = flat.index_select(0, token)  # (M, C) grouped by expert
            outputs = looped_outputs(experts, tokens, sizes)
        weighted = (outputs * weight[:, None]).to(dtype)  # (M, C)
        return torch.zeros_like(flat).index_add(0, token, weighted)

    def _dispatch(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """(N, C): the tokens `flat` (N, C) sent to the ranks of the expert group holding their
        experts, computed there and combined back here (`pretrain.model.expert_parallel`)."""
        group = self.expert_group
        counts = count_rows(routing.kept, group)  # the forward's one host read
        kept = sum(counts.kept)
        token, weight = routing.token[:kept], routing.weight[:kept]
        tokens = flat.index_select(0, token)  # (M, C) grouped by expert
        grouped = self._grouped(flat, list(self.experts.values()))

        def compute(rows, sizes, on_device):  # through the container's forward (FSDP2's unit)
            return self.experts(rows, sizes, on_device, grouped)
        outputs = run_experts(compute, tokens, counts, group)
        weighted = (outputs * weight[:, None]).to(flat.dtype)
        return torch.zeros_like(flat).index_add(0, token, weighted)

    def _forward_expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """Route this rank's token chunk, send each assignment to the rank holding its expert
        and combine what comes back (`pretrain.model.expert_parallel`)."""
        # this rank's chunk of the tokens its tensor group holds (all of them at tensor 1)
        chunks = self.token_group
        chunk = x if self.sequence_parallel or chunks is None else scatter_tokens(x, chunks)
        B, T, C = chunk.shape
        flat = chunk.reshape(-1, C)
        routing, _, aux_loss = self.route(flat)
        out = self._dispatch(flat, routing).view(B, T, C)
        if out.requires_grad and (self.aux_coeff or self.z_coeff):
            # the micro-batch's value on every rank routing part of it, each differentiating it
            # through its own tokens' probabilities only: no share to divide (x N as above)
            out = AuxLossGradient.apply(out, aux_loss, _AUX_GRAD_SCALE[0] * self.context_parallel)
        return out if self.sequence_parallel or chunks is None else gather_tokens(out, chunks)


def expert_group_name(size: int) -> str:
    """DeepSpeed's name of the expert groups of `size` expert ranks (`param.group_name`; its
    `deepspeed.utils.groups` looks the largest up by this form)."""
    return f"ep_size_{size}"


def _local_experts(cfg: ModelConfig, *, rank: int, size: int, project: Callable, tp_group=None,
                   reduced_apart: bool = False) -> LocalExperts:
    """Expert rank `rank` of `size`'s experts under their global indices (`experts.M.*`):
    whole (tagged so the initialisation, gradient norm and checkpoints treat them as this
    rank's own shard), or split over `tp_group` like the dense MLP. `reduced_apart`: their
    gradients are reduced over the expert-data ranks, not the data group (DeepSpeed's MoE
    parameters: `allreduce` False, `group_name`)."""
    local = cfg.num_experts // size
    experts = LocalExperts({str(rank * local + j): Expert(cfg, tp_group=tp_group,
                                                          project=project)
                            for j in range(local)})
    experts.reduced_apart = reduced_apart
    for param in experts.parameters():
        if tp_group is None:
            param.expert_parallel = True  # whole, on one rank of the group
        param.tensor_model_parallel = True  # DeepSpeed's grad norm counts it on its rank
        if reduced_apart:
            param.allreduce = False
            param.group_name = expert_group_name(size)
    return experts


def _group_aux_losses(routing: Routing, logits: torch.Tensor,
                      groups: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The balance loss and z-loss over the tokens of every rank of `groups` (the expert group,
    then the context group: disjoint splits of one micro-batch), the same on each: the local
    sums are all-reduced (backward: identity, each rank's tokens get their own part)."""
    E = logits.shape[1]
    total = torch.cat([routing.probs.sum(dim=0), torch.logsumexp(logits, dim=-1).pow(2).sum()[None],
                       routing.selected.to(logits.dtype),
                       logits.new_full((1,), float(logits.shape[0]))])  # no host copy
    for group in groups:
        total = reduce_from_tp(total, group)
    probs_sum, z_sum, selected, tokens = total[:E], total[E], total[E + 1:2 * E + 1], total[-1]
    fraction = selected / selected.sum()
    return E * torch.sum(fraction * probs_sum / tokens), z_sum / tokens


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def reset_stats(module: nn.Module) -> None:
    """Forget the router statistics of `module`'s MoE layers (a step abandoned part way)."""
    for layer in moe_layers(module):
        layer.reset_stats()


def collect_stats(module: nn.Module, *, device, num_layers: int, num_experts: int,
                  group=None, bias_update_rate: float | None = None) -> dict:
    """The step's router statistics over every rank of `group` (collective); resets the sums.
    `bias_update_rate` (sigmoid routers; None for softmax ones): when > 0, each layer's expert
    bias then takes its balancing step from the layer's loads over every rank
    (`MoE.update_expert_bias`): the same counts, so the same bias, on every rank; the biases
    after it are reported per MoE layer (`moe_expert_bias`, every stage's layers).

    Overall: the mean balance loss and z-loss per layer forward and the fraction of assignments
    dropped. Per MoE layer, in layer order: the assignments each expert was selected for
    (`moe_expert_tokens`, over the whole global batch, before any drop), their max/mean
    (`moe_load_max_mean`; 1.0 is perfectly balanced), the dropped assignments and the mean
    auxiliary losses; `moe_load_max_mean_worst` is the largest over the layers.

    Every rank calls it: a pipeline stage adds its own layers' rows (zeros elsewhere), data and
    expert ranks their own tokens' counts; tensor ranks without expert parallelism, which route
    the same tokens, each count 1/tp here. The result is the same on every rank. The layers'
    sums live on their device; the table is read back once."""
    import torch.distributed as dist

    table = torch.zeros(num_layers, STAT_FIELDS + num_experts, dtype=torch.float64,
                        device=device)
    for layer in moe_layers(module):
        if layer.stats is not None:  # a layer that ran a training forward this step
            # tensor ranks without expert parallelism route the same tokens: 1/tp each
            copies = layer.token_copies
            table[layer.layer_index] += torch.cat([layer.stats, layer.expert_tokens]).to(
                device) / copies
        layer.reset_stats()
    if dist.is_initialized():
        dist.all_reduce(table, group=group)
    if bias_update_rate:
        for layer in moe_layers(module):
            if layer.sigmoid and table[layer.layer_index, 0] > 0:
                # whole counts (tensor ranks' 1/tp shares summed back)
                layer.update_expert_bias(table[layer.layer_index, STAT_FIELDS:].round(),
                                         bias_update_rate)
    bias = None
    if bias_update_rate is not None:  # each layer's bias on every rank (a stage's: its own)
        bias = torch.full((num_layers, num_experts), float("-inf"), dtype=torch.float64,
                          device=device)
        for layer in moe_layers(module):
            if layer.sigmoid:
                bias[layer.layer_index] = layer.gate.e_score_correction_bias.to(device).double()
        if dist.is_initialized():
            dist.all_reduce(bias, op=dist.ReduceOp.MAX, group=group)
        bias = bias.cpu()
    table = table.cpu()
    forwards, balance, z_loss, dropped, assignments = table[:, :STAT_FIELDS].sum(dim=0).tolist()
    record = {"moe_aux_loss": balance / max(forwards, 1.0),
              "moe_z_loss": z_loss / max(forwards, 1.0),
              "moe_dropped_fraction": dropped / max(assignments, 1.0)}
    rows = table[table[:, 0] > 0]  # the layers that ran (MoE layers)
    if len(rows):
        counts = rows[:, STAT_FIELDS:]
        load = (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-12)).tolist()
        record.update({
            "moe_expert_tokens": counts.round().long().tolist(),
            "moe_load_max_mean": load, "moe_load_max_mean_worst": max(load),
            "moe_dropped": rows[:, 3].round().long().tolist(),
            "moe_layer_aux_loss": (rows[:, 1] / rows[:, 0]).tolist(),
            "moe_layer_z_loss": (rows[:, 2] / rows[:, 0]).tolist()})
        if bias is not None:
            record["moe_expert_bias"] = bias[table[:, 0] > 0].tolist()
    return record
