"""Config tree, DeepSpeed JSON resolution and the learning-rate schedule (single process)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.arithmetic import num_parameters
from pretrain.config import MODEL_PRESETS, Precision, Recompute, load_config
from pretrain.errors import ConfigError
from pretrain.training.engine import warmup_cosine
from pretrain.resolve.run import layout_on, resolve_ds_config
from pretrain.testing.runs import REPO


def test_presets_have_published_shapes_and_sizes():
    c70 = load_config(None, ["model.preset=70b"]).model
    assert (c70.num_layers, c70.hidden_size, c70.num_heads, c70.num_kv_heads,
            c70.ffn_hidden_size, c70.vocab_size, c70.seq_length) == (80, 8192, 64, 8, 28672, 32000, 4096)
    # Llama-2 parameter counts (Touvron et al. 2023 / the Hugging Face checkpoints)
    assert num_parameters(load_config(None, ["model.preset=7b"]).model) == 6_738_415_616
    assert num_parameters(load_config(None, ["model.preset=13b"]).model) == 13_015_864_320
    assert num_parameters(load_config(None, ["model.preset=70b"]).model) == 68_976_648_192
    assert 10e6 < num_parameters(load_config(None, ["model.preset=small"]).model) < 30e6
    assert set(MODEL_PRESETS) >= {"tiny", "125m", "1b", "7b", "13b", "70b"}


def test_yaml_file_overrides_and_types(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: tiny\n  num_layers: 3\ntrain:\n  lr: 3e-4\n  precision: fp16\n")
    cfg = load_config(path, ["train.steps=7", "model.activation_checkpointing=every_k",
                             "data.blend=[0.5 a, 0.5 b]"])
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 64  # preset + explicit field
    assert cfg.train.lr == 3e-4 and cfg.train.precision is Precision.FP16
    assert cfg.train.steps == 7 and cfg.model.activation_checkpointing is Recompute.EVERY_K
    assert cfg.data.blend == [f"0.5 {Path.cwd() / 'a'}", f"0.5 {Path.cwd() / 'b'}"]  # --set: cwd


@pytest.mark.parametrize("overrides, message", [
    (["train.stepz=3"], "unknown config key train.stepz (did you mean train.steps?)"),
    (["data.corpus=x.txt"], "unknown config key data.corpus"),  # `pretrain preprocess --corpus`
    (["train.learning_rate=1e-3"], "unknown config key train.learning_rate (did you mean train.lr?)"),
    (["model.num_attention_heads=8"], "(did you mean model.num_heads?)"),
    (["bogus.x=1"], "unknown config key bogus"),
    (["train.steps=ten"], "train.steps='ten': expected int"),
    (["train.steps=0"], "train.steps=0: must be a positive integer"),
    (["model.preset=tiny", "model.hidden_size=66"], "model.hidden_size=66: must be divisible by model.num_heads=4"),
    (["model.preset=tiny", "model.num_kv_heads=3"], "model.num_kv_heads=3: must divide model.num_heads=4"),
    (["model.preset=huge"], "model.preset='huge': choose one of"),
    (["train.precision=fp8"], "train.precision='fp8': choose one of auto, fp32, bf16, fp16"),
    (["train.min_lr=1.0"], "train.min_lr=1.0"),
    (["train.lr"], "expected section.key=value"),
])
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(None, overrides)
    assert message in str(info.value)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_loads(name):
    """A shipped config with a field the loader does not know fails every command that reads it."""
    cfg = load_config(REPO / "configs" / name, [])
    assert cfg.model.num_layers > 0 and cfg.train.steps > 0


def test_yaml_syntax_errors_keep_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: 3\n  lr: [1,\nmodel: {a: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, [])
    assert "is not valid YAML" in str(info.value) and "at line 5 column 1" in str(info.value)


def test_duplicate_yaml_key_rejected(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match="duplicate key 'lr' at line 3"):
        load_config(path)


def test_derived_batch_values():
    cfg = load_config(None, ["train.micro_batch_size=4", "train.global_batch_size=64",
                             "parallel.tensor=2", "model.preset=tiny"])
    layout = layout_on(cfg, world_size=8)
    assert layout.data == 4
    assert layout.grad_accum == 4 and layout.global_batch == 64
    with pytest.raises(ConfigError, match="not a multiple of train.micro_batch_size x data-parallel"):
        layout_on(cfg, world_size=12)  # dp 6: 64 % 24 != 0
    with pytest.raises(ConfigError, match="world size 7 is not divisible"):
        layout_on(cfg, world_size=7)


def _resolve(tmp_path, ds: dict, overrides=(), world=2, accelerator="cpu"):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    cfg = load_config(None, ["model.preset=tiny", f"deepspeed={path}", f"run_dir={tmp_path}/run",
                             "train.micro_batch_size=2", "train.global_batch_size=8", *overrides])
    return resolve_ds_config(cfg, world_size=world, accelerator=accelerator)


def test_shipped_ds_configs_resolve_completely(tmp_path):
    import glob

    for name in sorted(glob.glob("ds_configs/*.json")):
        ds = _resolve(tmp_path, json.load(open(name)), ["train.precision=bf16"])
        assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 2
        assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["bf16"]["enabled"] is True
        assert ds["fp16"]["enabled"] is False
        assert ds["optimizer"]["params"]["betas"] == [0.9, 0.95]
        assert "auto" not in json.dumps(ds), name
        offloaded = "offload" in name
        assert ds["optimizer"]["params"]["torch_adam"] is (not offloaded), name


def test_gpu_optimizer_needs_no_compiler_on_the_compute_nodes(tmp_path):
    """On CUDA: torch's fused AdamW (DeepSpeed passes the remaining params to its constructor),
    not DeepSpeed's FusedAdam, which JIT-compiles with nvcc on every rank at the first step."""
    import inspect

    import torch

    ds = _resolve(tmp_path, json.load(open("ds_configs/zero1.json")), accelerator="cuda")
    params = ds["optimizer"]["params"]
    assert params["torch_adam"] is True and params["fused"] is True
    assert "fused" in inspect.signature(torch.optim.AdamW).parameters
    on_cpu = _resolve(tmp_path, json.load(open("ds_configs/zero1.json")))["optimizer"]["params"]
    assert on_cpu["torch_adam"] is True and "fused" not in on_cpu
    offloaded = _resolve(tmp_path, json.load(open("ds_configs/zero2_offload_cpu.json")),
                         accelerator="cuda")["optimizer"]["params"]
    assert offloaded["torch_adam"] is False and "fused" not in offloaded  # DeepSpeed's CPU Adam


@pytest.mark.parametrize("precision, zero, grads", [
    ("bf16", 1, "fp32"), ("bf16", 2, "fp32"), ("bf16", 3, "fp32"), ("bf16", 0, "bf16"),
    ("fp16", 1, "fp16"), ("fp32", 1, "fp32")])
def test_bf16_gradients_are_summed_and_reduced_in_fp32_under_zero(tmp_path, precision, zero,
                                                                   grads):
    ds = _resolve(tmp_path, json.load(open(f"ds_configs/zero{zero}.json")),
                  [f"train.precision={precision}"])
    assert ds["data_types"]["grad_accum_dtype"] == grads
    assert ds["communication_data_type"] == grads


@pytest.mark.parametrize("precision, grads", [("bf16", "fp32"), ("fp32", "fp32"), ("fp16", "fp16")])
def test_pipelines_at_zero0_sum_bf16_gradients_in_fp32(tmp_path, precision, grads):
    """A bf16 pipeline at ZeRO-0 steps in DeepSpeed's BF16_Optimizer, which sums gradients in
    grad_accum_dtype: fp32, like ZeRO >= 1 (an explicit bf16 stays the user's choice)."""
    zero0 = json.load(open("ds_configs/zero0.json"))
    ds = _resolve(tmp_path, zero0, [f"train.precision={precision}", "parallel.pipeline=2"], world=4)
    assert (ds["data_types"]["grad_accum_dtype"], ds["communication_data_type"]) == (grads, grads)
    if precision == "bf16":
        explicit = {**zero0, "data_types": {"grad_accum_dtype": "bf16"}}
        ds = _resolve(tmp_path, explicit, ["train.precision=bf16", "parallel.pipeline=2"], world=4)
        assert ds["data_types"]["grad_accum_dtype"] == "bf16"


@pytest.mark.parametrize("ds, overrides, message", [
    ({"train_batch_size": 16}, [], "train_batch_size=16 contradicts the run config, which gives 8"),
    ({"gradient_accumulation_steps": 1}, [], "gradient_accumulation_steps=1 contradicts"),
    ({"bf16": {"enabled": True}}, ["train.precision=fp32"], "bf16.enabled=True contradicts"),
    ({"zero_optimization": {"stage": 2}}, ["parallel.pipeline=2"], "DeepSpeed pipelines support ZeRO 0 or 1 only"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
     [], "NVMe offload needs ZeRO stage 3"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, [], "offload_param needs ZeRO stage 3"),
    ({"scheduler": {"type": "WarmupLR"}}, [], 'remove the "scheduler" block'),
    ({"zero_optimization": {"stage": 5}}, [], "stage=5 must be 0, 1, 2 or 3"),
    ({"flops_profiler": {"profile_step": "auto"}}, [],
     'no run-config value for "auto" field flops_profiler.profile_step'),
    # DeepSpeed ignores unknown top-level keys and its models reject unknown section keys
    ({"zero_optimisation": {"stage": 1}}, [],
     "unknown DeepSpeed key 'zero_optimisation' (did you mean 'zero_optimization'?)"),
    ({"zero_optimization": {"stage": 2, "offload_optimiser": {"device": "cpu"}}}, [],
     "unknown DeepSpeed key zero_optimization.offload_optimiser (did you mean "
     "'offload_optimizer'?)"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memry": 1}}},
     [], "zero_optimization.offload_optimizer.pin_memry (did you mean 'pin_memory'?)"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "lots"}}, [],
     "DeepSpeed config zero_optimization.stage3_prefetch_bucket_size='lots': must be a whole"),
    ({"zero_optimization": {"stage": 1, "overlap_comm": "sometimes"}}, [],
     "DeepSpeed rejects zero_optimization.overlap_comm='sometimes'"),
    ({"tensorboard": {"enabled": True, "output": "tb"}}, [],
     "unknown DeepSpeed key tensorboard.output (did you mean 'output_path'?)"),
])
def test_ds_contradictions_are_errors(tmp_path, ds, overrides, message):
    with pytest.raises(ConfigError) as info:
        _resolve(tmp_path, ds, overrides, world=4 if "parallel.pipeline=2" in overrides else 2)
    assert message in str(info.value)


def test_nvme_path_must_be_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ds = json.load(open("ds_configs/zero3_offload_nvme.json"))
    ds["zero_optimization"]["offload_param"]["nvme_path"] = str(blocker / "swap")
    with pytest.raises(ConfigError, match="NVMe offload path .* is not writable"):
        _resolve(tmp_path, ds)


def test_ds_json_that_does_not_parse(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": "auto",\n "zero_optimization": {"stage": 2,}}')
    cfg = load_config(None, [f"deepspeed={path}"])
    with pytest.raises(ConfigError, match="is not valid JSON: .* at line 2"):
        resolve_ds_config(cfg, world_size=1)


def test_warmup_cosine_schedule():
    kw = dict(lr=1.0, min_lr=0.1, warmup=10, total=110)
    assert warmup_cosine(1, **kw) == pytest.approx(0.1)  # the first update already learns
    assert warmup_cosine(10, **kw) == pytest.approx(1.0)
    assert warmup_cosine(60, **kw) == pytest.approx(0.1 + 0.9 * 0.5)  # half way down the cosine
    assert warmup_cosine(110, **kw) == pytest.approx(0.1)
    assert warmup_cosine(500, **kw) == pytest.approx(0.1)
    lrs = [warmup_cosine(i, **kw) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert math.isclose(warmup_cosine(5, lr=1.0, min_lr=0.0, warmup=0, total=10),
                        0.5 * (1 + math.cos(math.pi * 0.5)))


def test_the_engines_schedule_follows_the_run_config():
    """The scheduler the engine hands DeepSpeed, stepped on a real optimizer: train.lr,
    min_lr, warmup_steps and steps each move the lr it sets."""
    import torch

    from pretrain.training.engine import _lr_schedule
    t = load_config(None, ["train.lr=2.0", "train.min_lr=0.5", "train.warmup_steps=4",
                           "train.steps=20"]).train
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
    schedule = _lr_schedule(t)(opt)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(25):
        opt.step()
        schedule.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(2.0 / 4)  # update 1 of 4 warmup updates
    assert lrs[3] == pytest.approx(2.0)  # warmup done
    assert lrs[11] == pytest.approx(0.5 + 1.5 * 0.5)  # half way down the cosine
    assert lrs[19] == pytest.approx(0.5) and lrs[24] == pytest.approx(0.5)


def _engine_against_torch_adamw(rank: int, world_size: int, ds_json: str) -> float:
    """The largest difference between the parameters of a DeepSpeed engine built from the run
    config (train.beta1/beta2/eps through the resolver) and of torch's AdamW given those values
    directly, after 3 steps on the same batches."""
    import copy

    import deepspeed
    import torch

    from pretrain.training.engine import _lr_schedule, param_groups
    from pretrain.model import build_model

    cfg = load_config(REPO / "configs/tiny.yaml", [
        f"deepspeed={ds_json}", "train.precision=fp32", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.weight_decay=0", "train.grad_clip=0",
        "train.beta1=0.5", "train.beta2=0.75", "train.eps=0.01", f"run_dir={REPO}/runs/unused"])
    model = build_model(cfg.model, seed=1)
    reference = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(
        model=model, config=resolve_ds_config(cfg, world_size=world_size, accelerator="cpu"),
        lr_scheduler=_lr_schedule(cfg.train), model_parameters=param_groups(model, 0.0))
    adamw = torch.optim.AdamW(reference.parameters(), lr=cfg.train.lr, betas=(0.5, 0.75),
                              eps=0.01, weight_decay=0.0)
    schedule = _lr_schedule(cfg.train)(adamw)
    for seed in range(3):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length + 1),
                               generator=torch.Generator().manual_seed(seed))
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
        reference(tokens[:, :-1], tokens[:, 1:]).backward()
        adamw.step()
        adamw.zero_grad()
        schedule.step()
    return max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(engine.module.parameters(), reference.parameters()))


@pytest.mark.slow  # a DeepSpeed engine per case
@pytest.mark.parametrize("ds_json", ["ds_configs/zero0.json", "ds_configs/zero1.json"])
def test_adams_betas_and_eps_reach_the_optimizer(ds_json, tmp_path):
    """train.beta1/beta2/eps (far from the defaults) move the engine's parameters exactly as
    torch's AdamW given them: the resolver writes them into the DeepSpeed JSON's optimizer and
    DeepSpeed's optimizer (a plain torch one at ZeRO-0, ZeRO-1's wrapper) uses them."""
    from pretrain.testing.ranks import run_on_ranks

    difference, = run_on_ranks(_engine_against_torch_adamw, world_size=1, tmp_path=tmp_path,
                               args=(ds_json,), timeout_s=300)
    assert difference < 1e-6


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.tensor=3"], 6, "parallel.tensor=3: must divide model.num_heads=4"),
    (["parallel.tensor=4", "model.num_kv_heads=2"], 4, "parallel.tensor=4: must divide model.num_kv_heads=2"),
    (["parallel.pipeline=3"], 3, "parallel.pipeline=3: exceeds model.num_layers=2"),
    (["parallel.tensor=2", "parallel.pipeline=2"], 6, "world size 6 is not divisible by parallel.tensor x parallel.pipeline = 2 x 2 = 4"),
    (["parallel.sequence_parallel=true"], 2, "parallel.sequence_parallel=True: needs parallel.tensor > 1"),
    (["parallel.pipeline=2", "model.activation_checkpointing=every_k"], 2, "use none or full"),
    (["parallel.tensor=2", "parallel.sequence_parallel=true", "model.seq_length=63"], 2,
     "model.seq_length=63: must be divisible by parallel.tensor=2"),
])
def test_forbidden_layouts_are_refused_before_launch(overrides, world, message):
    """What `pretrain train` checks before any process group exists (pretrain.resolve.run.resolve_layout)."""
    cfg = load_config(None, ["model.preset=tiny", *overrides])
    with pytest.raises(ConfigError) as info:
        layout_on(cfg, world_size=world)
    assert message in str(info.value)


def test_pipeline_with_sequence_parallel_gets_unpartitioned_p2p(tmp_path):
    ds = _resolve(tmp_path, json.load(open("ds_configs/zero1.json")),
                  ["parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true",
                   "train.global_batch_size=2", "train.micro_batch_size=2"], world=4)
    assert ds["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    explicit = json.load(open("ds_configs/zero1.json"))
    explicit["pipeline"] = {"pipe_partitioned": True}
    with pytest.raises(ConfigError, match="pipe_partitioned"):
        _resolve(tmp_path, explicit, ["parallel.tensor=2", "parallel.pipeline=2",
                                      "parallel.sequence_parallel=true",
                                      "train.global_batch_size=2", "train.micro_batch_size=2"],
                 world=4)


def test_wandb_goes_online_only_with_a_project_and_a_key():
    from pretrain.training.sinks import resolve_wandb_mode

    assert load_config(None).logging.wandb_mode == "auto"
    assert resolve_wandb_mode("auto", project="", env={"WANDB_API_KEY": "k"}) == "offline"
    assert resolve_wandb_mode("auto", project="llama", env={}) == "offline"
    assert resolve_wandb_mode("auto", project="llama", env={"WANDB_API_KEY": "k"}) == "online"
    assert resolve_wandb_mode("disabled", project="llama", env={"WANDB_API_KEY": "k"}) == "disabled"


def test_wandb_goes_online_for_a_user_who_ran_wandb_login(tmp_path):
    """`wandb login` writes the key to ~/.netrc, not to the environment."""
    from pretrain.training.sinks import resolve_wandb_mode

    home = tmp_path / "home"
    home.mkdir()
    assert resolve_wandb_mode("auto", project="llama", env={"HOME": str(home)}) == "offline"
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123abcd\n")
    (home / ".netrc").chmod(0o600)
    assert resolve_wandb_mode("auto", project="llama", env={"HOME": str(home)}) == "online"
    assert resolve_wandb_mode("auto", project="", env={"HOME": str(home)}) == "offline"
    elsewhere = {"HOME": str(home), "WANDB_BASE_URL": "https://wandb.example.org"}
    assert resolve_wandb_mode("auto", project="llama", env=elsewhere) == "offline"
    with pytest.raises(ConfigError, match="logging.wandb_mode='cloud'"):
        load_config(None, ["logging.wandb_mode=cloud"])


# ---- `pretrain config` and where a config's paths resolve -------------------------------------

def _printed_config(capsys, *args: str) -> str:
    from pretrain.cli import main

    main(["config", *args])
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_printed_config_loads_back_to_the_same_config_from_anywhere(tmp_path, monkeypatch,
                                                                    capsys, name):
    """`pretrain config` prints a run config: `train --config printed.yaml` runs the same one,
    whatever the working directory (its paths are absolute)."""
    cfg = load_config(REPO / "configs" / name, ["train.lr=2e-3"])
    printed = tmp_path / "printed" / "run.yaml"
    printed.parent.mkdir()
    printed.write_text(_printed_config(capsys, "--config", str(REPO / "configs" / name),
                                       "--set", "train.lr=2e-3"))
    as_json = json.loads(_printed_config(capsys, "--config", str(REPO / "configs" / name),
                                         "--set", "train.lr=2e-3", "--json"))
    assert as_json == cfg.to_dict()
    monkeypatch.chdir(tmp_path)
    assert load_config(printed) == cfg


def test_printed_config_explains_every_field_and_the_changed_defaults(capsys):
    import dataclasses

    from pretrain.config import RunConfig

    text = _printed_config(capsys, "--config", str(REPO / "configs" / "quickstart.yaml"),
                           "--set", "train.lr=0.002")
    lines = {line.strip().split(":")[0]: line.strip() for line in text.splitlines()
             if not line.startswith("#")}
    assert lines["lr"] == "lr: 0.002  # peak learning rate, reached after warmup (default 0.0003)"
    assert lines["steps"] == "steps: 150  # optimizer steps (default 1000)"
    assert lines["grad_clip"] == "grad_clip: 1.0  # global gradient-norm clipping; 0 disables"
    assert lines["vocab_size"].startswith("vocab_size: auto  # tokenizer's vocabulary")
    assert "(padded_vocab_size); auto:" in lines["vocab_size"]  # the continuation line
    assert "`pretrain import-hf` output" in lines["init_from"]  # the continuation line
    assert "How long the other ranks wait" in lines["io_timeout_minutes"]  # the block above it
    assert lines["deepspeed"] == (f"deepspeed: {REPO / 'ds_configs/zero2.json'}  # DeepSpeed "
                                  'JSON with "auto" fields')
    assert lines["model"].startswith("model:  # Decoder architecture of one model family")
    sections = [f.name for f in dataclasses.fields(RunConfig) if f.name in ("model", "train")]
    fields = [f.name for s in sections for f in dataclasses.fields(getattr(RunConfig(), s))]
    assert set(fields) <= set(lines)
    assert all("  # " in lines[name] for name in fields)  # every one explained


def test_field_comments_follow_the_source_layout():
    """The comment beside a field, its continuation lines, or the block right above a field
    without one; a '#' inside a string is no comment."""
    import dataclasses

    from pretrain.commands.config import field_comments

    @dataclasses.dataclass
    class Example:
        plain: int = 1
        hashed: str = "a # b"  # not the '#' in the string
        wrapped: int = 2  # first line,
        # second line

        # A block above a field without a comment of its own.
        blocked: int = 3
        last: int = 4  # own comment
        # trailing note on last

        def method(self) -> int:  # a method's comment is no field's
            return self.plain

    assert field_comments(Example) == {
        "hashed": "not the '#' in the string", "wrapped": "first line, second line",
        "blocked": "A block above a field without a comment of its own.",
        "last": "own comment trailing note on last"}


def test_config_command_does_not_import_torch():
    code = ("import sys\nfrom pretrain.cli import main\n"
            "main(['config', '--config', 'configs/llama_7b.yaml', '--json'])\n"
            "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # cli would look for a GPU
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=env, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out


def test_paths_in_a_file_resolve_against_its_directory_and_overrides_against_the_cwd(
        tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "mine.json").write_text("{}")
    (project / "run.yaml").write_text(
        "run_dir: out/run\ndeepspeed: mine.json\nmodel: {init_from: ../weights}\n"
        "data:\n  tokenizer: data/tok.model\n  blend: ['0.7 data/code', {weight: 0.3, prefix: "
        "/abs/prose}]\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(project / "run.yaml")
    assert cfg.deepspeed == str(project / "mine.json")
    assert cfg.model.init_from == str(tmp_path / "weights")
    assert cfg.data.tokenizer == str(project / "data/tok.model")
    assert cfg.data.blend == [f"0.7 {project / 'data/code'}",
                              {"weight": 0.3, "prefix": "/abs/prose"}]
    assert cfg.run_dir == str(elsewhere / "out/run")  # written, not read: the cwd's
    over = load_config(project / "run.yaml", ["data.blend=[]", "data.dataset=rel/corpus",
                                              "data.tokenizer=tok.model", "deepspeed=x.json"])
    assert over.data.dataset == str(elsewhere / "rel/corpus")
    assert over.data.tokenizer == str(elsewhere / "tok.model")
    assert over.deepspeed == str(elsewhere / "x.json")


def test_shipped_ds_configs_are_found_from_a_copied_config(tmp_path, monkeypatch):
    """`deepspeed: ds_configs/zero1.json` in a config outside the project is the shipped file,
    unless the config's directory has its own; so is the default."""
    (tmp_path / "run.yaml").write_text("deepspeed: ds_configs/zero1.json\n")
    monkeypatch.chdir(tmp_path)
    assert load_config(tmp_path / "run.yaml").deepspeed == str(REPO / "ds_configs/zero1.json")
    assert load_config(None).deepspeed == str(REPO / "ds_configs/zero2.json")
    (tmp_path / "ds_configs").mkdir()
    (tmp_path / "ds_configs/zero1.json").write_text("{}")
    assert load_config(tmp_path / "run.yaml").deepspeed == str(tmp_path / "ds_configs/zero1.json")


@pytest.mark.parametrize("value, message", [
    ("big", "model.vocab_size='big': must be a positive integer, or auto"),
    ("0", "model.vocab_size=0: must be a positive integer, or auto"),
    ("2.5", "model.vocab_size=2.5: expected int, got float"),
])
def test_vocab_size_is_a_positive_integer_or_auto(value, message):
    assert load_config(None, ["model.vocab_size=auto"]).model.vocab_size == "auto"
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.vocab_size={value}"])
    assert message in str(info.value)


def _user_file_readers():
    """Each reader of a file the user names: (what its errors call it, read(path))."""
    import argparse

    from pretrain.commands.tune import _enqueued
    from pretrain.resolve.ds_config import load_ds_json
    from pretrain.tune.space import Param, load_space

    params = [Param("train.lr", "float", low=1e-4, high=1e-2)]
    return {"run config": lambda path: load_config(path, []),
            "DeepSpeed config": load_ds_json,
            "--space": load_space,
            "--enqueue": lambda path: _enqueued(argparse.Namespace(enqueue=str(path), config=None),
                                                params, [])}


@pytest.mark.parametrize("what", ["run config", "DeepSpeed config", "--space", "--enqueue"])
def test_a_user_file_that_cannot_be_read_is_one_config_error(what, tmp_path):
    """Every file a user names is read one way: missing, not text, a directory or not valid
    JSON/YAML, each is one ConfigError that names the file (exit 2), never a traceback."""
    read = _user_file_readers()[what]
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x80\x81\xfe\xff")
    for path, problem in ((tmp_path / "none.yaml", "does not exist"),
                          (binary, "cannot be read: not UTF-8 text"),
                          (tmp_path, "cannot be read: Is a directory")):
        with pytest.raises(ConfigError) as info:
            read(path)
        assert str(info.value).startswith(f"{what} {str(path)!r} {problem}"), str(info.value)
    broken = tmp_path / "broken.txt"
    broken.write_text("{a: [1,\n")
    with pytest.raises(ConfigError, match=r"is not valid (JSON|YAML): .* at line \d+ column \d+"):
        read(broken)


def test_a_run_config_or_deepspeed_json_that_is_not_a_mapping_is_refused(tmp_path):
    from pretrain.resolve.ds_config import load_ds_json

    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")  # JSON is YAML too
    with pytest.raises(ConfigError, match="run config .*: expected a mapping of sections"):
        load_config(listed, [])
    with pytest.raises(ConfigError, match="DeepSpeed config .*: expected a JSON object"):
        load_ds_json(listed)
