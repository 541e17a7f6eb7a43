"""FP8 training of the decoder blocks' projections (`train.fp8`), with torchao's float8 recipes.

Each projection of a decoder block - q/k/v and o of attention, gate/up and down of the MLP and
of every expert - multiplies in float8 (torchao's `matmul_with_hp_or_float8_args`): its input
and weight are cast to e4m3 with a dynamic scale (per tensor: `tensorwise`; per row of each
operand, scales rounded to powers of two: `rowwise`), its output gradient to e5m2 (tensorwise)
or e4m3 (rowwise), and the three matmuls of forward and backward run on the scaled operands.
The parameters stay as they were (bf16 or fp32 masters, same names, same checkpoints): FP8 is
how the matmuls compute, not what the model holds.

Which layers and why:
- a plain `nn.Linear` (tensor parallel size 1) becomes torchao's `Float8Linear` (the same
  `weight` parameter);
- this stack's `ColumnParallelLinear` / `RowParallelLinear` keep their collectives and class;
  their local matmul (`module.linear`, `F.linear` by default) becomes `Float8Matmul`, the same
  function `Float8Linear` calls, so a tensor-parallel (and sequence-parallel) block computes
  the same FP8 products on its shard;
- the fused q/k/v and gate/up matmul (`model.fused_projections`) is unfused: each projection
  casts its own weight with its own scale, as torchtitan's float8 blocks do;
- a mixture's experts (`moe.Expert.fp8`): on the loop over the experts each expert with rows
  calls its gate, up and down layers (the tensor-parallel ones' local FP8 product), one without
  rows casts nothing (a dynamic scale of an empty tensor has no maximum); the grouped matmul
  (`moe.grouped_outputs`, Hopper GPUs in bf16) multiplies in bf16, FP8 or not;
- they stay in the run's precision: the embedding (a lookup, no matmul), the lm_head (its
  logits feed the softmax directly; torchtitan and torchao's recipes leave the output layer
  out for the loss's accuracy), the mixture of experts' router (a few outputs, far below the
  16-multiple FP8 kernels need, and which expert a token goes to is a discrete decision a
  rounding can flip), and any projection whose local dimensions are not multiples of 16
  (`torch._scaled_mm`'s requirement; torchao's auto filter skips them too).

Under `train.engine: fsdp2` with the tensorwise recipe the weights are all-gathered in FP8
(torchao's `WeightWithDynamicFloat8CastTensor`: each shard cast with the scale of the whole
weight, half of bf16's all-gather bytes); rowwise scales need the whole row, so its all-gather
stays in the parameter dtype (torchao refuses the combination).

On a CPU torchao emulates: the scaled operands are the same FP8 values, multiplied in fp32 after
scaling back (`emulate=True`), so tests see FP8's rounding without FP8 hardware.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from pretrain.config import Fp8Recipe

FP8_DIVISOR = 16  # torch._scaled_mm: both dimensions of an FP8 operand multiples of 16


def import_torchao() -> None:
    """Import torchao, quietly where it can only emulate. Its package import loads every kernel
    library it ships and logs a warning for each one that cannot load: on a machine without
    CUDA that is all of its GPU kernels (`_C_cutlass_90a`, `_C_mxfp8`), never used there (FP8 is
    emulated). Those warnings are dropped without CUDA only; on a GPU a kernel that fails to
    load matters, and its warning stays."""
    import logging
    import sys

    if "torchao" in sys.modules:
        return
    quiet = not torch.cuda.is_available()
    logger = logging.getLogger("torchao")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    finally:
        logger.setLevel(level)


def float8_config(recipe: Fp8Recipe, *, emulate: bool, fsdp_all_gather: bool = False):
    """torchao's `Float8LinearConfig` of `recipe`; `emulate` on devices without FP8 matmuls;
    `fsdp_all_gather`: FSDP2 all-gathers the weights in FP8 (tensorwise only)."""
    import_torchao()
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(Fp8Recipe(recipe).value)
    # from_recipe_name builds a frozen dataclass: rebuild it with the two switches set
    fields = {f: getattr(config, f) for f in config.__dataclass_fields__}
    fields.update(emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather
                  and Fp8Recipe(recipe) is Fp8Recipe.TENSORWISE)
    return Float8LinearConfig(**fields)


class Float8Matmul:
    """`F.linear(x, weight)` (no bias) through torchao's FP8 matmul: the swap-in for a
    tensor-parallel layer's `linear`. The same arithmetic as `Float8Linear.forward`."""

    def __init__(self, config) -> None:
        from torchao.float8.float8_linear import Float8Linear

        self.config = config
        with torch.device("meta"):  # only for its matmul configuration (LinearMMConfig)
            self.linear_mm_config = Float8Linear(FP8_DIVISOR, FP8_DIVISOR, bias=False,
                                                 config=config).linear_mm_config

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        if torch.is_autocast_enabled():
            x = x.to(torch.get_autocast_gpu_dtype())
        return matmul_with_hp_or_float8_args.apply(x, weight.t(), self.linear_mm_config,
                                                   self.config)


def separate_projections(x: torch.Tensor, layers: list[nn.Module],
                         sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """The unfused stand-in of `llama.fused_projections`: each layer called on `x` (so each
    computes through its own FP8 matmul and scale); `sizes` is the fused call's, unused."""
    return tuple(layer(x) for layer in layers)


@dataclass
class Fp8Conversion:
    """What `convert_to_fp8` did: the projections that compute in FP8 and those kept, with why."""

    recipe: Fp8Recipe
    fp8: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # name -> reason

    def line(self) -> str:
        """The run log's line: FP8 layers counted, the kept ones by reason."""
        reasons: dict[str, int] = {}
        for reason in self.kept.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        kept = "; ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
        return (f"fp8 {self.recipe.value}: {len(self.fp8)} projections in FP8"
                + (f", kept in the run's precision: {kept}" if kept else ""))


def _projection_kind(module: nn.Module) -> str | None:
    from pretrain.model.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return "tensor-parallel"
    if type(module) is nn.Linear:
        return "linear"
    return None


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe, *, emulate: bool,
                   fsdp_all_gather: bool = False) -> Fp8Conversion:
    """Make every decoder block projection of `model` (a `LlamaModel`, a pipeline stage or a
    single block) compute in FP8 by `recipe`, in place, before any engine wraps it; returns what
    was converted and what was kept. Parameters keep their names, values and dtype."""
    import_torchao()
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from pretrain.model.llama import DecoderLayer
    from pretrain.model.moe import Expert

    done = Fp8Conversion(Fp8Recipe(recipe))
    if done.recipe is Fp8Recipe.NONE:
        return done
    config = float8_config(recipe, emulate=emulate, fsdp_all_gather=fsdp_all_gather)
    matmul = Float8Matmul(config)
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, DecoderLayer)]
    for block_name, block in blocks:
        for name, module in list(block.named_modules()):
            full = f"{block_name}.{name}"
            kind = _projection_kind(module)
            if kind is None:
                if hasattr(module, "project"):  # attention, MLP, expert: unfused under FP8
                    module.project = separate_projections
                if isinstance(module, Expert):  # its layers called, down_proj's too
                    module.fp8 = True
                continue
            if name.endswith("mlp.gate"):
                done.kept[full] = "router"
                continue
            if any(size % FP8_DIVISOR for size in module.weight.shape):
                done.kept[full] = f"dimensions {tuple(module.weight.shape)} not multiples of 16"
                continue
            if kind == "linear":
                parent, _, attr = name.rpartition(".")
                setattr(block.get_submodule(parent) if parent else block, attr,
                        Float8Linear.from_float(module, config=config))
            else:
                module.linear = matmul
                if config.enable_fsdp_float8_all_gather:
                    weight = module.weight
                    wrapped = nn.Parameter(
                        WeightWithDynamicFloat8CastTensor(weight, matmul.linear_mm_config,
                                                          config.cast_config_weight.target_dtype),
                        requires_grad=weight.requires_grad)
                    wrapped.__dict__.update(weight.__dict__)  # tensor_model_parallel, ...
                    module.weight = wrapped
            done.fp8.append(full)
    for name, module in model.named_modules():
        if not any(name == b or name.startswith(b + ".") for b, _ in blocks) \
                and _projection_kind(module) is not None:
            done.kept[name] = "outside the decoder blocks"
    if hasattr(model, "lm_head"):
        done.kept["lm_head"] = "the output layer"
    return done


def is_fp8(module: nn.Module) -> bool:
    """Whether `module` computes in FP8 (converted by `convert_to_fp8`)."""
    import_torchao()
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear) or isinstance(getattr(module, "linear", None),
                                                          Float8Matmul)


