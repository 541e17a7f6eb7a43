"""FP8 training (`train.fp8`, pretrain/model/fp8.py): torchao's float8 recipes, emulated on CPU.

One projection: an FP8 matmul differs from the exact product by at most e4m3's rounding of both
operands (below), for a plain `nn.Linear` and this stack's tensor-parallel layers alike. Whole
runs: an FP8 run at tp 2 (sequence parallel) and under fsdp2 ends within the tolerance derived
in `_assert_fp8_tracks` of the fp32 run, and differs from it.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from pretrain import hardware
from pretrain.config import MODEL_PRESETS, Fp8Recipe, ModelConfig, load_config
from pretrain.errors import ConfigError
from pretrain.model import build_model
from pretrain.model.llama import DecoderLayer
from pretrain.model.fp8 import Float8Matmul, convert_to_fp8, float8_config, is_fp8
from pretrain.model.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from pretrain.resolve.run import resolve_run
from pretrain.testing.runs import REPO, train

E4M3_U = 2.0 ** -4  # e4m3: 3 stored mantissa bits, round to nearest: relative error <= 2^-4
E4M3_MAX = 448.0  # the largest e4m3 value: a dynamic scale maps a tensor's amax (or a row's) to it
E4M3_MIN_SUBNORMAL = 2.0 ** -9
RECIPES = (Fp8Recipe.TENSORWISE, Fp8Recipe.ROWWISE)


def _fp8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|fp8(x) fp8(w)^T - x w^T| elementwise, at most: each operand element moves by at most
    u = 2^-4 of itself (normal range) plus half the scaled grid's smallest step (subnormals:
    2^-10 / scale, the scale mapping the tensor's amax to 448), so the product of two moves by
    at most (2u + u^2) |x||w| plus the subnormal terms times the other operand."""
    ax, aw = x.abs(), w.abs()
    step_x = E4M3_MIN_SUBNORMAL / 2 * ax.max() / E4M3_MAX
    step_w = E4M3_MIN_SUBNORMAL / 2 * aw.max() / E4M3_MAX
    return ((2 * E4M3_U + E4M3_U ** 2) * (ax @ aw.T) + step_x * aw.sum(1) + step_w * ax.sum(1,
            keepdim=True) + x.shape[1] * step_x * step_w)


def _exact(x, w):
    return (x.double() @ w.double().T).float()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("layer", ["linear", "column", "row"])
def test_an_fp8_projection_is_within_e4m3_rounding_of_the_exact_product(recipe, layer):
    """Forward of each kind of projection `convert_to_fp8` reaches: within the bound, and not
    the exact product (the FP8 path ran). Its input gradient too, e5m2 (2^-3) or e4m3."""
    torch.manual_seed(0)
    make = {"linear": lambda: nn.Linear(64, 48, bias=False),
            "column": lambda: ColumnParallelLinear(64, 48, tp_group=None),
            "row": lambda: RowParallelLinear(64, 48, tp_group=None)}[layer]
    block = nn.Module()
    block.proj = make()
    w = block.proj.weight.detach().clone()
    converted = _converted_block(block, recipe)
    assert is_fp8(converted.proj)
    x = torch.randn(32, 64) * torch.logspace(-2, 1, 64)  # channels over three decades
    x.requires_grad_(True)
    y = converted.proj(x)
    exact = _exact(x.detach(), w)
    assert bool(((y - exact).abs() <= _fp8_bound(x.detach(), w)).all())
    assert (y - exact).abs().max() > 1e-3 * exact.abs().max()  # rounded: not fp32's product
    g = torch.randn_like(y)
    y.backward(g)
    u_grad = 2.0 ** -3 if recipe is Fp8Recipe.TENSORWISE else E4M3_U  # e5m2 / e4m3 gradients
    grad_bound = (2 * u_grad + u_grad ** 2) * (g.abs() @ w.abs()) + 1e-6
    assert bool(((x.grad - g @ w).abs() <= grad_bound).all())


def _converted_block(block: nn.Module, recipe: Fp8Recipe, **options) -> nn.Module:
    """`block`'s projections through `convert_to_fp8` (which converts decoder layers only)."""
    holder = nn.Module()
    layer = DecoderLayer.__new__(DecoderLayer)
    nn.Module.__init__(layer)
    layer.add_module("block", block)
    holder.add_module("layer", layer)
    done = convert_to_fp8(holder, recipe, emulate=True, **options)
    assert done.fp8 == ["layer.block.proj"], done
    return holder.layer.block


def test_rowwise_scales_each_row_and_tensorwise_the_whole_tensor():
    """The recipes differ where one row's magnitude dwarfs the others: tensorwise scales it
    all by that row's amax (the other rows, 10^6 times smaller, fall below e4m3's smallest
    subnormal and vanish), rowwise each row by its own (e4m3's few percent)."""
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    x[0] *= 1e6
    w = torch.randn(32, 64)
    errors = {}
    for recipe in RECIPES:
        out = Float8Matmul(float8_config(recipe, emulate=True))(x, w)
        exact = _exact(x, w)[1:]
        errors[recipe] = ((out[1:] - exact).abs().mean() / exact.abs().mean()).item()
    assert errors[Fp8Recipe.ROWWISE] < 0.1 < 0.9 < errors[Fp8Recipe.TENSORWISE], errors


def test_the_blocks_projections_convert_and_the_head_embedding_and_router_stay():
    """Dense: the 7 projections of each block; the head kept. MoE: every expert's projections,
    the router kept. Names and values of the parameters unchanged (checkpoints are the same)."""
    dense = build_model(ModelConfig(**MODEL_PRESETS["tiny"]), seed=1)
    before = {n: p.detach().clone() for n, p in dense.named_parameters()}
    done = convert_to_fp8(dense, Fp8Recipe.TENSORWISE, emulate=True)
    assert len(done.fp8) == 7 * 2 and done.kept == {"lm_head": "the output layer"}
    assert all(torch.equal(before[n], p) for n, p in dense.named_parameters())
    assert set(before) == {n for n, _ in dense.named_parameters()}
    assert not is_fp8(dense.lm_head) and type(dense.model.embed_tokens) is nn.Embedding
    assert "14 projections in FP8" in done.line()

    moe = build_model(ModelConfig(**{**MODEL_PRESETS["tiny"], "num_experts": 4}), seed=1)
    done = convert_to_fp8(moe, Fp8Recipe.ROWWISE, emulate=True)
    assert len(done.fp8) == (4 + 3 * 4) * 2
    assert {n for n, why in done.kept.items() if why == "router"} == {
        f"model.layers.{i}.mlp.gate" for i in range(2)}
    assert type(moe.model.layers[0].mlp.gate) is nn.Linear


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_experts_cast_for_the_rows_they_get_and_the_grouped_matmul_casts_none(recipe,
                                                                                  monkeypatch):
    """A mixture layer under FP8, its 16 tokens all routed to experts 0 and 1 of 8. On the loop
    those two run gate, up and down each through an FP8 matmul: each of the 6 casts its input,
    weight and output gradient twice (forward and backward: 36 casts); the 6 experts without
    rows cast nothing (a dynamic scale of an empty tensor has no maximum: torchao raises) and
    their weights get zero gradients. The grouped matmul casts nothing: it multiplies in the
    run's precision (`grouped_outputs`)."""
    import torchao.float8.float8_linear as float8_linear

    from pretrain.model.moe import moe_layers

    casts = []
    cast = float8_linear.hp_tensor_to_float8_dynamic

    def counted(tensor, *args, **kwargs):
        casts.append((tensor.data_ptr(), kwargs["gemm_input_role"].name))
        return cast(tensor, *args, **kwargs)

    monkeypatch.setattr(float8_linear, "hp_tensor_to_float8_dynamic", counted)
    cfg = ModelConfig(**{**MODEL_PRESETS["tiny"], "family": "qwen3", "num_layers": 1,
                         "num_experts": 8, "experts_per_token": 2, "moe_ffn_hidden_size": 32})
    for grouped in (False, True):
        model = build_model(cfg, seed=1)
        convert_to_fp8(model, recipe, emulate=True)
        moe = moe_layers(model)[0]
        moe.grouped = grouped
        with torch.no_grad():  # every token's two largest logits: experts 0 and 1
            moe.gate.weight.zero_()
            moe.gate.weight[0], moe.gate.weight[1] = 1.0, 0.5
        casts.clear()
        moe(torch.ones(1, 16, 64)).sum().backward()
        if grouped:
            assert casts == []
            continue
        projections = [getattr(moe.experts[e], name)
                       for e in range(8) for name in ("gate_proj", "up_proj", "down_proj")]
        assert len(casts) == 36
        assert {role for _, role in casts} == {"INPUT", "WEIGHT", "GRAD_OUTPUT"}
        weights = {ptr for ptr, role in casts if role == "WEIGHT"}
        assert weights == {p.weight.data_ptr() for p in projections[:6]}
        assert all(p.weight.grad.abs().sum() > 0 for p in projections[:6])
        assert all(not p.weight.grad.any() for p in projections[6:])


def test_fsdp2_all_gathers_tensorwise_weights_in_fp8_and_rowwise_in_their_dtype():
    """torchao's FP8 all-gather is tensorwise's only: its weights (tensor-parallel ones too) are
    torchao's casting subclass; rowwise's stay plain parameters."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for recipe, fp8_gather in ((Fp8Recipe.TENSORWISE, True), (Fp8Recipe.ROWWISE, False)):
        block = nn.Module()
        block.proj = ColumnParallelLinear(64, 48, tp_group=None)
        weight = _converted_block(block, recipe, fsdp_all_gather=True).proj.weight
        assert isinstance(weight, WeightWithDynamicFloat8CastTensor) is fp8_gather
        assert getattr(weight, "tensor_model_parallel", False)  # DeepSpeed's norm still counts it


def _cfg(tmp_path, *overrides):
    return load_config(REPO / "configs" / "tiny.yaml",
                       [f"run_dir={tmp_path / 'run'}", "data.tokenizer=''",
                        "model.vocab_size=512", *overrides])


def test_fp8_is_refused_before_launch_below_compute_capability_8_9(tmp_path, monkeypatch):
    """A stand-in GPU answers the capability query: 8.0 (A100) refused with the reason, 9.0
    (H100) and 8.9 (L40S) resolved; a CPU emulates. fp16 with FP8 is refused everywhere."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **k: True)
    for capability, refused in (((8, 0), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(hardware, "gpu_capability", lambda c=capability: c)
        for recipe in RECIPES:
            cfg = _cfg(tmp_path, f"train.fp8={recipe.value}")
            if refused:
                with pytest.raises(ConfigError, match="compute capability is 8.0"):
                    resolve_run(cfg, world_size=1, device_type="cuda", data_required=False)
            else:
                resolve_run(cfg, world_size=1, device_type="cuda", data_required=False)
    monkeypatch.setattr(hardware, "gpu_capability", lambda: (8, 0))
    resolve_run(_cfg(tmp_path, "train.fp8=none"), world_size=1, device_type="cuda",
                data_required=False)
    resolve_run(_cfg(tmp_path, "train.fp8=rowwise"), world_size=1, device_type="cpu",
                data_required=False)
    with pytest.raises(ConfigError, match="fp16"):
        resolve_run(_cfg(tmp_path, "train.fp8=tensorwise", "train.precision=fp16"),
                    world_size=1, device_type="cpu", data_required=False)


STEPS = 4
LAYOUTS = {"tp2": ["parallel.tensor=2", "parallel.sequence_parallel=true"],
           "fsdp2": ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json"]}
FP8_COUNT = {"tp2": 8, "fsdp2": 14}  # tp 2: the MLP's 88-wide shards are not multiples of 16


def _assert_fp8_tracks(fp8: list[float], fp32: list[float], bf16: list[float]) -> None:
    """The tolerance. Rounding perturbs a run's losses, to first order, in proportion to the
    unit roundoff of what is rounded. A bf16 run rounds every matmul's operands and every
    activation to u = 2^-8; an FP8 run rounds a subset of those (the blocks' projection
    operands) to e4m3's 2^-4 and, tensorwise, the output gradients to e5m2's 2^-3: at most
    2^-3 / 2^-8 = 32 times bf16's perturbation. So each FP8 step's loss is within 32 x the
    largest |bf16 - fp32| of the run's steps (the largest: one step's bf16 difference can
    cross zero). And it must differ from fp32 at every step (the FP8 matmuls ran)."""
    tolerance = 32 * max(abs(a - b) for a, b in zip(bf16, fp32))
    assert 0 < tolerance < 0.01, (bf16, fp32)  # a bf16 run that trains as fp32 does
    assert all(abs(a - b) <= tolerance for a, b in zip(fp8, fp32)), (fp8, fp32, tolerance)
    assert all(a != b for a, b in zip(fp8, fp32)), (fp8, fp32)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_emulated_fp8_run_ends_within_the_tolerance_of_fp32(tiny_data, tmp_path, layout):
    """tp 2 with sequence parallelism (the column/row layers' FP8 matmuls, the MLP's 88-wide
    shards kept) and fsdp2 (tensorwise all-gathers in FP8), tensorwise and rowwise."""
    over = [f"train.steps={STEPS}", *LAYOUTS[layout]]
    fp32 = train(tmp_path, tiny_data, nprocs=2, name="fp32", overrides=over)
    bf16 = train(tmp_path, tiny_data, nprocs=2, name="bf16",
                 overrides=[*over, "train.precision=bf16"])
    losses = {}
    for recipe in RECIPES:
        run = train(tmp_path, tiny_data, nprocs=2, name=recipe.value,
                    overrides=[*over, f"train.fp8={recipe.value}"])
        assert f"[fp8] fp8 {recipe.value}: {FP8_COUNT[layout]} projections in FP8" in run.stdout
        _assert_fp8_tracks(run.losses, fp32.losses, bf16.losses)
        losses[recipe] = run.losses
    assert losses[Fp8Recipe.TENSORWISE] != losses[Fp8Recipe.ROWWISE]
    assert "[fp8]" not in fp32.stdout


@pytest.mark.slow
@pytest.mark.parametrize("cuda", [False, True])
def test_torchao_imports_without_its_gpu_kernel_warnings_on_a_cpu_only(cuda):
    """torchao logs a "Failed to load" warning for each of its GPU kernel libraries a CPU-only
    torch cannot load: dropped there (never used: FP8 is emulated), kept where CUDA is (a
    kernel missing on a GPU matters; CUDA's presence faked here)."""
    import subprocess
    import sys

    code = ("import torch; torch.cuda.is_available = lambda: %s\n"
            "from pretrain.config import Fp8Recipe\n"
            "from pretrain.model.fp8 import float8_config\n"
            "float8_config(Fp8Recipe.TENSORWISE, emulate=True)\n") % cuda
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    shipped = any(Path(torchao_dir()).glob("_C*.so"))
    assert ("Failed to load" in out.stderr) == (cuda and shipped and not torch.cuda.is_available())


def torchao_dir() -> str:
    import importlib.util

    return str(Path(importlib.util.find_spec("torchao").origin).parent)
