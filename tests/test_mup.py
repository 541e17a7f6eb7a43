"""muP (`model.parametrization: mup`, `pretrain.model.mup`): the rule, its width behaviour, and
the same rule in every place that applies it.

- coordinate check: the change of each layer's output after a few AdamW steps at one lr stays
  the same across widths 64..512 under muP, and grows with width under the standard
  parametrization,
- at m = 1 a muP model is the standard one, bitwise (initial weights, losses),
- the init, the optimizer groups (flat and pipeline names), the logits and attention scale
  folded into a Hugging Face export, resume and init_from refusing another parametrization,
- DeepSpeed honours the per-group learning rates through the schedule (ZeRO 1/2/3, CPU Adam),
- slow: `pretrain train` of a muP model gives the same fp32 losses at tp 2 and pp 2 as on one
  rank, and resumes from its checkpoint on another layout.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from pretrain.config import load_config
from pretrain.training.engine import warmup_cosine
from pretrain.errors import ConfigError
from pretrain.model import build_model, build_flat_pipeline, canonical_parameters
from pretrain.model import mup
from pretrain.model.llama import full_parameter_init
from pretrain.testing.ranks import run_on_ranks
from pretrain.testing.runs import LEVER_LAYOUTS, rel_diff, run_pretrain, train, train_args

REPO = Path(__file__).resolve().parents[1]
WIDTHS = (64, 128, 256, 512)


def model_cfg(width: int = 64, parametrization: str = "mup", base: int = 64, **fields):
    """The tiny preset (2 layers, vocab 512, seq 64) at `width`, 4 heads, ffn 3 x width."""
    overrides = ["model.preset=tiny", f"model.hidden_size={width}",
                 f"model.ffn_hidden_size={3 * width}", f"model.parametrization={parametrization}",
                 f"model.mup_base_width={base}"] + [f"model.{k}={v}" for k, v in fields.items()]
    return load_config(None, overrides).model


def fixed_batch(cfg, *, seed: int = 1, size: int = 4):
    tokens = torch.randint(0, cfg.vocab_size, (size, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def train_in_process(cfg, *, lr: float, steps: int, weight_decay: float = 0.0):
    """(model, losses) of `steps` torch AdamW steps on a fixed batch, groups from the rule."""
    model = build_model(cfg, seed=0)
    inputs, labels = fixed_batch(cfg)
    opt = torch.optim.AdamW(mup.optimizer_groups(model, lr=lr, weight_decay=weight_decay,
                                                 cfg=cfg), betas=(0.9, 0.95))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(inputs, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


# ---- coordinate check ----------------------------------------------------------------------------

COORD_LR, COORD_STEPS = 3e-3, 4


def activation_change(width: int, parametrization: str) -> dict[str, float]:
    """mean |x_t - x_0| of each decoder layer's output and of the logits, on the training batch,
    after COORD_STEPS AdamW steps at COORD_LR (base width 64)."""
    cfg = model_cfg(width, parametrization)
    model = build_model(cfg, seed=0)
    inputs, labels = fixed_batch(cfg)
    outputs: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(
            lambda mod, args, out, key=f"layer{i}": outputs.__setitem__(key, out.detach()))

    def activations() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            logits = model(inputs)
        return {**outputs, "logits": logits}

    before = activations()
    opt = torch.optim.AdamW(mup.optimizer_groups(model, lr=COORD_LR, weight_decay=0.0, cfg=cfg),
                            betas=(0.9, 0.95))
    for _ in range(COORD_STEPS):
        opt.zero_grad()
        model(inputs, labels).backward()
        opt.step()
    after = activations()
    return {k: float((after[k] - before[k]).abs().mean()) for k in before}


def test_coordinate_check():
    """muP: every layer's update size within a factor 2 across widths 64..512 (measured within
    1.2); standard: the same lr moves the wide model's activations ever more (measured 7x for
    the logits, 90x for the last layer from 64 to 512)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: one thread is as fast, and immune to a busy machine
    try:
        change = {p: {w: activation_change(w, p) for w in WIDTHS} for p in ("mup", "standard")}
    finally:
        torch.set_num_threads(threads)
    report = {p: {w: {k: round(v, 4) for k, v in d.items()} for w, d in c.items()}
              for p, c in change.items()}
    for key in change["mup"][WIDTHS[0]]:
        mup_values = [change["mup"][w][key] for w in WIDTHS]
        assert max(mup_values) / min(mup_values) < 2, (key, report)
        standard = [change["standard"][w][key] for w in WIDTHS]
        assert all(a < b for a, b in zip(standard, standard[1:])), (key, report)
        assert standard[-1] / standard[0] > 4, (key, report)


# ---- the rule ------------------------------------------------------------------------------------

def test_m1_is_the_standard_model():
    """hidden_size == mup_base_width (head_dim == the base head dim): the same initial tensors
    and the same losses, bitwise."""
    standard, mu = model_cfg(64, "standard"), model_cfg(64, "mup", base=64)
    assert mup.width_multiplier(mu) == 1.0 and mup.softmax_scale(mu) is None
    a, b = build_model(standard, seed=0).state_dict(), build_model(mu, seed=0).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _, loss_standard = train_in_process(standard, lr=1e-3, steps=3, weight_decay=0.1)
    _, loss_mup = train_in_process(mu, lr=1e-3, steps=3, weight_decay=0.1)
    assert loss_standard == loss_mup


def test_init_scales_hidden_matrices_only():
    """m = 4: hidden matrices' std x 1/2 (exact: a power of two), on top of the residual
    projections' 1/sqrt(2 L); embedding and lm_head as standard; norms 1."""
    standard, mu = model_cfg(256, "standard"), model_cfg(256, "mup", base=64)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.layers.1.self_attn.o_proj.weight"):
        assert torch.equal(full_parameter_init(name, mu, seed=3),
                           full_parameter_init(name, standard, seed=3) * 0.5), name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(full_parameter_init(name, mu, seed=3),
                           full_parameter_init(name, standard, seed=3)), name
    std = full_parameter_init("model.layers.0.mlp.down_proj.weight", mu, seed=3).std().item()
    assert abs(std / (0.02 / 2 / math.sqrt(4)) - 1) < 0.02


def test_optimizer_groups_follow_the_rule():
    """Hidden matrices at lr/m, embeddings and lm_head at lr, norm gains at lr without weight
    decay; the pipeline's stage names give the same groups as the flat model's."""
    cfg = model_cfg(256, "mup", base=64)
    model = build_model(cfg, seed=0)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = mup.optimizer_groups(model, lr=1e-2, weight_decay=0.1, cfg=cfg)
    by_name = {names[id(p)]: (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
    assert len(by_name) == len(names)
    for name, (lr, wd) in by_name.items():
        kind = mup.parameter_kind(name, cfg)
        assert lr == pytest.approx(1e-2 / 4 if kind == mup.HIDDEN else 1e-2), name
        assert wd == (0.0 if kind == mup.NORM else 0.1), name
    pipeline = build_flat_pipeline(cfg, seed=0)
    canonical = {id(p): n for n, p in canonical_parameters(pipeline, cfg)}
    pipe_groups = mup.optimizer_groups(pipeline, lr=1e-2, weight_decay=0.1, cfg=cfg)
    assert {canonical[id(p)]: (g["lr"], g["weight_decay"])
            for g in pipe_groups for p in g["params"]} == by_name
    standard = mup.optimizer_groups(model, lr=1e-2, weight_decay=0.1,
                                    cfg=model_cfg(256, "standard"))
    assert [len(g["params"]) for g in standard] == [7 * 2 + 2, 2 * 2 + 1]
    assert [(g["lr"], g["weight_decay"]) for g in standard] == [(1e-2, 0.1), (1e-2, 0.0)]


def test_attention_and_output_multipliers():
    """Softmax scale sqrt(base head dim)/head_dim, logits x 1/m, on the flat model and the
    pipeline form alike (the same logits)."""
    cfg = model_cfg(256, "mup", base=64)  # head_dim 64, base head dim 16
    assert mup.softmax_scale(cfg) == pytest.approx(4 / 64)
    assert mup.output_multiplier(cfg) == 0.25
    model, pipeline = build_model(cfg, seed=0), build_flat_pipeline(cfg, seed=0)
    inputs, labels = fixed_batch(cfg)
    with torch.no_grad():
        assert torch.allclose(model(inputs, labels), pipeline(inputs, labels), rtol=1e-6)
        logits = model(inputs)
        model.lm_head.output_multiplier = 1.0
        assert torch.allclose(model(inputs) * 0.25, logits, rtol=1e-5, atol=1e-7)
    tied = model_cfg(256, "mup", base=64, tie_embeddings="true")
    with torch.no_grad():
        assert torch.allclose(build_model(tied, seed=0)(inputs, labels),
                              build_flat_pipeline(tied, seed=0)(inputs, labels), rtol=1e-6)


def test_config_validation():
    with pytest.raises(ConfigError, match="mup_base_width"):
        model_cfg(64, "mup", base=0)
    with pytest.raises(ConfigError, match="mup_base_head_dim"):
        model_cfg(64, "mup", mup_base_head_dim=-1)
    with pytest.raises(ConfigError, match="parametrization"):
        model_cfg(64, "muP2")
    assert mup.base_head_dim(model_cfg(256, "mup", base=64, mup_base_head_dim=32)) == 32


# ---- export, resume, init_from -------------------------------------------------------------------

def test_export_folds_the_multipliers_into_transformers_llama(tmp_path):
    """An untied muP model (m = 4) exported with q_proj and lm_head folded: transformers'
    LlamaForCausalLM gives its logits. A tied one is refused, with the reason."""
    import transformers

    from pretrain.checkpoint.hf import export_hf
    from pretrain.checkpoint.weights import Weights
    from pretrain.errors import CheckpointError
    from pretrain.model.hf import to_hf_config, to_hf_state_dict
    from pretrain.model.llama import gather_full_state_dict

    cfg = model_cfg(256, "mup", base=64, num_kv_heads=2)
    model, _ = train_in_process(cfg, lr=1e-3, steps=2)  # non-trivial weights
    state = to_hf_state_dict(gather_full_state_dict(model), cfg)
    folded = {name: mup.fold_for_export(name, t, cfg) for name, t in state.items()}
    hf = transformers.LlamaForCausalLM(to_hf_config(cfg, attn_implementation="eager")).eval()
    hf.load_state_dict(folded)
    inputs, _ = fixed_batch(cfg)
    with torch.no_grad():
        ours, theirs = model(inputs), hf(inputs).logits
    assert (ours - theirs).abs().max() / ours.abs().max() < 1e-5
    tied = model_cfg(256, "mup", base=64, tie_embeddings="true")
    weights = Weights(model=tied, state={}, tokenizer=tmp_path / "tok.model", source="run")
    with pytest.raises(CheckpointError, match="tied embeddings .* cannot be exported"):
        export_hf(weights, tmp_path / "out")


def test_resume_and_init_from_refuse_another_parametrization():
    from pretrain.checkpoint.engine import resume_mismatch
    from pretrain.model.mup import parametrization_mismatch

    def run(*overrides):
        return load_config(REPO / "configs/tiny.yaml", list(overrides))

    standard = run()
    muP = run("model.parametrization=mup", "model.mup_base_width=32")
    meta = {"config": standard.to_dict()}
    assert resume_mismatch(meta, standard) is None
    assert "model.parametrization='standard' there, 'mup' here" in resume_mismatch(meta, muP)
    assert "parametrization" in resume_mismatch({"config": muP.to_dict()}, standard)
    other_base = run("model.parametrization=mup", "model.mup_base_width=16")
    assert "mup_base_width" in resume_mismatch({"config": muP.to_dict()}, other_base)
    # a checkpoint from before the parametrization fields is standard; muP's base fields do
    # not matter to a standard run
    old = standard.to_dict()
    for key in ("parametrization", "mup_base_width", "mup_base_head_dim"):
        old["model"].pop(key)
    assert resume_mismatch({"config": old}, standard) is None
    assert resume_mismatch({"config": old}, run("model.mup_base_width=8")) is None
    assert "parametrization" in resume_mismatch({"config": old}, muP)
    assert parametrization_mismatch(standard.model, standard.model) is None
    assert "mup (base width 32" in parametrization_mismatch(standard.model, muP.model)


# ---- DeepSpeed honours the groups' learning rates ------------------------------------------------

def _first_update_by_kind(rank: int, world_size: int, ds_json: str, precision: str) -> dict:
    """mean |update| of each kind of parameter after one engine step (Adam's first update is
    lr x sign(grad) elementwise, so it measures each group's lr), and the groups' lrs."""
    import deepspeed

    from pretrain.resolve.run import resolve_ds_config
    from pretrain.training.engine import _lr_schedule, param_groups

    cfg = load_config(REPO / "configs/tiny.yaml", [
        f"deepspeed={ds_json}", f"train.precision={precision}", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.weight_decay=0", "train.warmup_steps=2",
        "train.lr=1e-2", "model.parametrization=mup", "model.mup_base_width=16",
        f"run_dir={REPO}/runs/unused"])
    ds_config = resolve_ds_config(cfg, world_size=world_size, accelerator="cpu")
    model = build_model(cfg.model, seed=1)
    engine, *_ = deepspeed.initialize(
        model=model, config=ds_config, lr_scheduler=_lr_schedule(cfg.train),
        model_parameters=param_groups(model, cfg.train.weight_decay, cfg=cfg.model,
                                      lr=cfg.train.lr))
    before = {n: p.detach().float().clone() for n, p in _whole(engine)}
    inputs, labels = fixed_batch(cfg.model, size=2)
    engine.backward(engine(inputs, labels))
    engine.step()
    change: dict[str, list[float]] = {}
    for name, p in _whole(engine):
        delta = (p.detach().float() - before[name]).abs()
        if name == "model.embed_tokens.weight":  # rows of tokens in the batch only
            delta = delta[torch.unique(inputs)]
        change.setdefault(mup.parameter_kind(name, cfg.model), []).append(float(delta.mean()))
    lrs = sorted(g["lr"] for g in engine.optimizer.param_groups)
    decay = []  # the groups' lrs at updates 3..train.steps: the cosine decay after the warmup
    for _ in range(3, cfg.train.steps + 1):
        engine.lr_scheduler.step()
        decay.append(sorted(g["lr"] for g in engine.optimizer.param_groups))
    return {"change": {k: sum(v) / len(v) for k, v in change.items()}, "lrs": lrs, "decay": decay,
            "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__}


def _whole(engine):
    import deepspeed

    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]) if hasattr(p, "ds_id") else _null():
            yield name, p


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("ds_json,precision", [
    ("ds_configs/zero1.json", "fp32"), ("ds_configs/zero2.json", "bf16"),
    ("ds_configs/zero3.json", "fp32"),
    # DeepSpeed's CPU Adam: a compiled op (minutes the first time)
    pytest.param("ds_configs/zero2_offload_cpu.json", "fp32", marks=pytest.mark.slow)],
    ids=["zero1", "zero2-bf16", "zero3", "zero2-cpu-adam"])
def test_deepspeed_applies_each_groups_lr(ds_json, precision, tmp_path):
    """m = 4: the first (warmup: lr/2) step moved the hidden matrices lr/m/2 per element, the
    embeddings, lm_head and norms lr/2; after the scheduler's step the groups keep the 1/m."""
    result, = run_on_ranks(_first_update_by_kind, world_size=1, tmp_path=tmp_path,
                           args=(ds_json, precision), timeout_s=300)
    # after the step the schedule is at update 2 of a 2-step warmup: the peak lr, ratio kept
    assert result["lrs"] == pytest.approx([1e-2 / 4, 1e-2, 1e-2]), result
    # and through the decay to min_lr (tiny.yaml: 10 steps, min_lr 1e-4): every group follows
    # the schedule, the hidden matrices' lr stays 1/m of the others'
    expected = [warmup_cosine(u, lr=1e-2, min_lr=1e-4, warmup=2, total=10) for u in range(3, 11)]
    assert expected[-1] == pytest.approx(1e-4) and expected == sorted(expected, reverse=True)
    assert result["decay"] == [pytest.approx([e / 4, e, e]) for e in expected], result["decay"]
    lr = 1e-2 / 2  # the update just taken: warmup step 1 of 2
    change = result["change"]
    tolerance = 0.1 if precision == "fp32" else 0.3  # bf16 weights round the update
    assert change[mup.HIDDEN] == pytest.approx(lr / 4, rel=tolerance), result
    for kind in (mup.EMBEDDING, mup.OUTPUT, mup.NORM):
        assert change[kind] == pytest.approx(lr, rel=tolerance), (kind, result)


# ---- the same muP training in every layout (slow) ------------------------------------------------

MUP = ["model.parametrization=mup", "model.mup_base_width=32", "train.steps=4",
       "checkpoint.save_interval=2", "checkpoint.keep_last=2"]


@pytest.mark.slow
def test_mup_training_is_layout_independent(tiny_data, tmp_path):
    """`pretrain train` of a muP model (m = 2, hidden 64 over a base of 32) in fp32: the same
    losses within 1e-5 relative at tp 2 and pp 2 as on one rank. Its step-2 checkpoint (three
    optimizer groups) resumes on pp 2 with the same lrs and losses, is refused by a standard
    run, and exports to transformers with the same logits."""
    runs = {layout: train(tmp_path, tiny_data, nprocs=LEVER_LAYOUTS[layout][0], name=layout,
                          overrides=MUP + LEVER_LAYOUTS[layout][1])
            for layout in ("flat", "tp2", "pp2")}
    flat = runs["flat"].losses
    assert len(flat) == 4 and "[mup] parametrization mup (base width 32, m=2" in (
        runs["flat"].stdout + runs["flat"].stderr)
    for layout in ("tp2", "pp2"):
        assert rel_diff(runs[layout].losses, flat) < 1e-5, (layout, runs[layout].losses, flat)

    saved = runs["flat"].run_dir / "checkpoints" / "step2"
    _export_gives_the_same_logits(saved, tmp_path / "hf")
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / "step2")
    resumed = train(tmp_path, tiny_data, nprocs=2, name="resumed",
                    overrides=MUP + LEVER_LAYOUTS["pp2"][1])
    assert "resharded" in resumed.stdout + resumed.stderr
    after = [r for r in resumed.records if r["kind"] == "train"]
    before = [r for r in runs["flat"].records if r["kind"] == "train"][2:]
    assert [r["lr"] for r in after] == [r["lr"] for r in before]
    assert rel_diff([r["loss"] for r in after], [r["loss"] for r in before]) < 1e-5
    refused = run_pretrain(train_args(tmp_path / "as_standard", tiny_data,
                                      overrides=["train.steps=4"])
                           + ["--resume-from", str(saved)], run_dir=tmp_path / "as_standard")
    assert refused.returncode == 2
    assert "model.parametrization='mup' there, 'standard' here" in refused.stderr


@pytest.mark.slow
def test_mup_at_three_pipeline_stages(tiny_data, tmp_path):
    """3 layers at pp 3: the middle stage holds neither embedding nor head (two kinds of
    parameter, not three). From scratch the losses are one rank's within 1e-5 relative (the run
    used to hang before its first step), and one rank's step-2 checkpoint resumes at pp 3 with
    the same lrs and losses (the middle stage used to fail on the saved schedule's groups)."""
    three = MUP + ["model.num_layers=3"]
    pp3 = ["parallel.pipeline=3"]
    flat = train(tmp_path, tiny_data, nprocs=1, name="flat", overrides=three)
    staged = train(tmp_path, tiny_data, nprocs=3, name="pp3", overrides=three + pp3, timeout=300)
    assert len(flat.losses) == 4
    assert rel_diff(staged.losses, flat.losses) < 1e-5, (staged.losses, flat.losses)

    saved = flat.run_dir / "checkpoints" / "step2"
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / "step2")
    resumed = train(tmp_path, tiny_data, nprocs=3, name="resumed", overrides=three + pp3,
                    timeout=300)
    assert "resharded tp1 pp1 dp1 ZeRO-1 -> tp1 pp3 dp1 ZeRO-1" in resumed.stdout
    after = [r for r in resumed.records if r["kind"] == "train"]
    before = [r for r in flat.records if r["kind"] == "train"][2:]
    assert [r["lr"] for r in after] == [r["lr"] for r in before]
    assert rel_diff([r["loss"] for r in after], [r["loss"] for r in before]) < 1e-5


def test_every_pipeline_stage_has_the_whole_models_group_count():
    """DeepSpeed's ZeRO-1/2 collectives run once per group: each stage of a muP pipeline has as
    many groups as the whole model, each group's parameters at their rule's lr and decay."""
    cfg = model_cfg(64, "mup", base=32, num_layers=3)
    pipeline = build_flat_pipeline(cfg, seed=0)
    named = list(canonical_parameters(pipeline, cfg))
    whole = mup.optimizer_groups(build_model(cfg, seed=0), lr=1e-2, weight_decay=0.1, cfg=cfg)
    middle = [(n, p) for n, p in named if n.startswith("model.layers.1.")]
    groups = mup.optimizer_groups(middle, lr=1e-2, weight_decay=0.1, cfg=cfg)
    assert len(whole) == len(groups) == 3
    assert sum(len(g["params"]) for g in groups) == len(middle)
    names = {id(p): n for n, p in middle}
    for group in groups:
        assert group["params"]
        for p in group["params"]:
            r = mup.rule(names[id(p)], cfg)
            assert (group["lr"], group["weight_decay"]) == (1e-2 * r.lr, 0.1 * r.weight_decay)
    # at m = 1 the whole model has two groups (hidden matrices at lr): so does every stage
    same = model_cfg(32, "mup", base=32, num_layers=3)
    assert len(mup.optimizer_groups(middle, lr=1e-2, weight_decay=0.1, cfg=same)) == 2


def _export_gives_the_same_logits(step_dir: Path, out: Path) -> None:
    """`export-hf` of a muP engine checkpoint: transformers' logits are the muP model's."""
    import transformers

    from pretrain.checkpoint.hf import export_hf
    from pretrain.checkpoint.weights import load_weights
    from pretrain.model import LlamaModel
    from pretrain.model.hf import from_hf_state_dict

    weights = load_weights(step_dir)
    assert mup.is_mup(weights.model) and mup.width_multiplier(weights.model) == 2
    model = LlamaModel(weights.model)
    model.load_state_dict(from_hf_state_dict({k: v.float() for k, v in weights.state.items()},
                                             weights.model))
    export_hf(weights, out, dtype="fp32")
    hf = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    inputs, _ = fixed_batch(weights.model, size=2)
    with torch.no_grad():
        ours, theirs = model.eval()(inputs), hf(inputs).logits
    assert (ours - theirs).abs().max() / ours.abs().max() < 1e-5
