"""Hugging Face interop end to end: import-hf, training from it, export-hf, generate.

Each run starts from a random transformers `LlamaForCausalLM` imported with `import-hf`
(`model.init_from`), trains 4 fp32 steps and keeps its engine checkpoint and final/: at tp=1
x dp=2 under ZeRO-3 with untied embeddings, and at tp=2 x pp=2 (ZeRO-0) with tied ones, whose
consolidated weights are checked against one process trained from the same import. The
vocabulary has 515 tokens (not a multiple of 128: padded to 640 rows at tp=1, 768 at tp=2) and
attention is grouped-query (4 query heads, 2 kv heads). transformers' LlamaForCausalLM (eager
attention) is the independent reference. Commands run in-process through `pretrain.cli.main`;
training runs through the real launcher.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from pretrain.testing.runs import run_pretrain, train
from safetensors.torch import load_file

from pretrain.cli import main as pretrain_main
from pretrain.config import load_config
from pretrain.checkpoint.weights import load_weights
from pretrain.data import Tokenizer, train_tokenizer, preprocess
from pretrain.errors import CheckpointError
from pretrain.model import LlamaModel
from pretrain.model.hf import from_hf_state_dict, to_hf_config

transformers.logging.set_verbosity_error()
VOCAB = 515
STEPS = 4
RUN_OVERRIDES = {
    "tp1_dp2_zero3_untied": (2, ["deepspeed=ds_configs/zero3.json"]),
    # ZeRO-0: the pipeline's weights are read from its layer_XX-model_YY files (ZeRO-1
    # pipelines, through the optimizer shards, are covered in test_convert_checkpoint.py).
    # Clipping on (train.grad_clip 1.0): a ZeRO-0 pipeline must clip by the whole model's norm
    # (pretrain.training.engine.clip_by_the_whole_models_norm), or its weights drift from one process's.
    "tp2_pp2_tied": (4, ["parallel.tensor=2", "parallel.pipeline=2", "model.tie_embeddings=true",
                         "deepspeed=ds_configs/zero0.json"]),
}
# tp2_pp2_tied in one process: the reference its consolidated weights are compared with
SINGLE_TIED = "tp1_pp1_tied"
REFERENCE_OVERRIDES = {SINGLE_TIED: (1, ["model.tie_embeddings=true",
                                         "deepspeed=ds_configs/zero0.json"])}


def make_data(out: Path, *, vocab_size: int = VOCAB) -> dict[str, str]:
    """A `vocab_size`-token tokenizer and dataset of a few stdlib packages (a second or two)."""
    from conftest import TINY_CORPUS_FILES

    model = train_tokenizer(TINY_CORPUS_FILES, model_prefix=out / f"sp{vocab_size}",
                            vocab_size=vocab_size).path
    preprocess(TINY_CORPUS_FILES, tokenizer_path=model, output_prefix=out / "corpus", workers=1,
               show_progress=False)
    return {"tokenizer": str(model), "dataset": str(out / "corpus")}


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory, worker_id) -> Path:
    """One directory for every pytest-xdist worker of this session, so that the runs below are
    trained once, not once per worker (xdist's documented recipe)."""
    if worker_id == "master":
        return tmp_path_factory.mktemp("hf_interop")
    path = tmp_path_factory.getbasetemp().parent / "hf_interop"
    path.mkdir(exist_ok=True)
    return path


def built_once(path: Path, build) -> Path:
    """`build(path)` unless another worker already did (a file lock serialises the builders)."""
    from filelock import FileLock

    with FileLock(f"{path}.lock"):
        if not (path / ".done").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            build(path)
            (path / ".done").touch()
    return path


@pytest.fixture(scope="session")
def data515(shared_dir) -> dict[str, str]:
    built_once(shared_dir / "data515", make_data)
    return {"tokenizer": str(shared_dir / "data515" / f"sp{VOCAB}.model"),
            "dataset": str(shared_dir / "data515" / "corpus")}


def _train_from_import(root: Path, *, layout: str, data: dict[str, str]) -> None:
    """Import a random HF Llama (root/hf_src) and train STEPS fp32 steps from it (root/run)."""
    nprocs, overrides = {**RUN_OVERRIDES, **REFERENCE_OVERRIDES}[layout]
    random_hf_llama(root / "hf_src", tied="tied" in layout.split("_"))
    cli("import-hf", root / "hf_src", "--output", root / "init")
    run = train(root, data, name="run", nprocs=nprocs, overrides=[
        f"model.vocab_size={VOCAB}", f"train.steps={STEPS}", "checkpoint.save_final=true",
        f"model.init_from={root / 'init'}", *overrides])
    assert "[init] weights from" in run.stdout + run.stderr


@pytest.fixture(scope="session")
def runs(shared_dir, data515):
    """run_dir(layout): the run directory of a layout, trained on first use."""
    def run_dir(layout: str) -> Path:
        root = built_once(shared_dir / layout,
                          lambda root: _train_from_import(root, layout=layout, data=data515))
        return root / "run"
    return run_dir


def cli(*args, capsys=None) -> str:
    """`pretrain ARGS` in this process (the real parser and command); its stdout."""
    if capsys is not None:
        capsys.readouterr()
    pretrain_main([str(a) for a in args])
    return capsys.readouterr().out if capsys is not None else ""


def cli_error(*args, capsys) -> str:
    """The `error:` output of a `pretrain ARGS` that must exit with the user-error status 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        pretrain_main([str(a) for a in args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def our_model(weights) -> LlamaModel:
    model = LlamaModel(weights.model)
    model.load_state_dict(from_hf_state_dict({k: v.float() for k, v in weights.state.items()},
                                             weights.model))
    return model.eval()


def tokens(*, size: int = 2, length: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, length), generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.slow
@pytest.mark.parametrize("layout", RUN_OVERRIDES)
def test_export_logits_tokenizer_and_consolidation(layout, runs, data515, tmp_path):
    run_dir = runs(layout)
    cfg = load_config(run_dir / "config.yaml").model
    tp = 2 if layout.startswith("tp2") else 1
    assert load_weights(run_dir).step == STEPS  # the run dir's newest engine checkpoint
    assert cfg.vocab_size == VOCAB and cfg.padded_vocab_size(tp) == (768 if tp == 2 else 640)
    assert cfg.num_kv_heads < cfg.num_heads and cfg.tie_embeddings == ("tied" in layout.split("_"))

    # convert-checkpoint --to fp32 reads the engine shards offline: equal to the live weights
    # that the run gathered into final/ (fp32 training: module weights = master weights)
    cli("convert-checkpoint", run_dir / "checkpoints" / f"step{STEPS}", "--to", "fp32", "--output",
        tmp_path / "fp32")
    consolidated, live = (load_file(str(p / "model.safetensors"))
                          for p in (tmp_path / "fp32", run_dir / "final"))
    assert consolidated.keys() == live.keys()
    assert ("lm_head.weight" in live) != cfg.tie_embeddings
    for name, tensor in live.items():
        assert torch.equal(consolidated[name], tensor), name
    assert consolidated["model.embed_tokens.weight"].shape == (VOCAB, cfg.hidden_size)

    cli("export-hf", run_dir, "--output", tmp_path / "hf", "--dtype", "fp32")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert hf.config.vocab_size == VOCAB and hf.config.tie_word_embeddings == cfg.tie_embeddings
    assert hf.config.num_key_value_heads == cfg.num_kv_heads
    ours = our_model(load_weights(run_dir))
    ids = tokens()
    with torch.no_grad():
        assert rel_err(ours(ids), hf.eval()(ids).logits) < 1e-5

    # AutoTokenizer loads the converted sentencepiece model offline and encodes as ours does
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    ours_tok = Tokenizer.load(data515["tokenizer"])
    from conftest import STDLIB
    for path in sorted(STDLIB.glob("*.py"))[:40]:
        text = path.read_text()
        ids = theirs(text, add_special_tokens=False)["input_ids"]
        assert ids == ours_tok.encode(text), path
        assert theirs.decode(ids) == text
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours_tok.bos_id, ours_tok.eos_id)


@pytest.mark.slow
def test_consolidated_tp2_pp2_weights_are_those_of_one_process(runs, tmp_path):
    """convert-checkpoint of the tp 2 x pp 2 run (tensor shards merged, pipeline layer files
    renamed) against one process trained from the same import on the same global batches, its
    weights read straight from its one DeepSpeed file (nothing merged, nothing renamed)."""
    run_dir, single_dir = runs("tp2_pp2_tied"), runs(SINGLE_TIED)
    cli("convert-checkpoint", run_dir / "checkpoints" / f"step{STEPS}", "--to", "fp32",
        "--output", tmp_path / "fp32")
    consolidated = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    module = torch.load(single_dir / "checkpoints" / f"step{STEPS}" / "mp_rank_00_model_states.pt",
                        map_location="cpu", weights_only=False)["module"]
    initial = load_file(str(single_dir.parent / "init" / "model.safetensors"))  # the import
    assert consolidated.keys() == initial.keys() and "lm_head.weight" not in consolidated  # tied
    steps = {name: [r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                    if r["kind"] == "train"] for name, d in (("single", single_dir),
                                                             ("pipeline", run_dir))}
    lrs = [r["lr"] for r in steps["single"]]
    assert len(lrs) == STEPS
    # the norm the pipeline clipped by (and reports) is the whole model's, above the clip of 1.0
    norms = [[r["grad_norm"] for r in steps[name]] for name in ("single", "pipeline")]
    assert min(norms[0]) > 1.0, norms
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-4, atol=0.0)
    # Adam moves every weight by about lr a step (|m_hat / sqrt(v_hat)| ~ 1: it ignores the
    # gradient's scale), so sum(lrs) in all. The two runs sum fp32 partial products and
    # gradients in other orders (the TP all-reduces, the tied embedding's gradient over two
    # stages): ~1e-7 relative changes of a gradient, which move Adam's update by about that
    # fraction of lr, more only for the rare element whose gradient cancels to within its
    # rounding. 1% of sum(lrs) bounds that with a wide margin; a consolidation error (shards
    # swapped or merged along the wrong dimension, a pipeline layer under another layer's
    # name) is off by the weights' own spread, and a training difference by ~sum(lrs).
    tol = 1e-2 * sum(lrs)
    for name, tensor in consolidated.items():
        reference = module[name][:VOCAB] if name == "model.embed_tokens.weight" else module[name]
        assert tensor.shape == reference.shape, name
        assert (reference - initial[name]).abs().max() > 0.5 * sum(lrs), name  # it trained
        assert tol < 1e-2 * reference.std(), name  # could fail: far below the weights' spread
        torch.testing.assert_close(tensor, reference, rtol=0.0, atol=tol,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_export_bf16_sharded(runs, tmp_path):
    run_dir = runs("tp1_dp2_zero3_untied")
    cli("export-hf", run_dir / "final", "--output", tmp_path / "hf", "--dtype", "bf16",
        "--max-shard-size", "100KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((tmp_path / "hf" / f).stat().st_size <= 150_000 for f in files)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.dtype == torch.bfloat16
    live = load_file(str(run_dir / "final" / "model.safetensors"))
    for name, param in hf.state_dict().items():
        assert torch.equal(param, live[name].bfloat16()), name


@pytest.mark.slow
def test_generate_native_and_exported_match_transformers(runs, tmp_path, capsys):
    run_dir = runs("tp1_dp2_zero3_untied")
    cli("export-hf", run_dir, "--output", tmp_path / "hf", "--dtype", "fp32")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = "def parse(self, value):\n    "
    prompt_ids = theirs(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    # min_new_tokens: our generate would also stop at eos; keep both going for the comparison
    expected = hf.generate(prompt_ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           eos_token_id=None)[0, prompt_ids.shape[1]:].tolist()

    def ids_of(checkpoint: Path, *extra: str) -> list[int]:
        out = cli("generate", "--checkpoint", checkpoint, "--prompt", prompt,
                  "--max-new-tokens", "12", "--print-ids", *extra, capsys=capsys)
        return [int(i) for i in out.rsplit("ids: ", 1)[1].split()]

    if theirs.eos_token_id in expected:  # ours stops after the end of a document
        expected = expected[:expected.index(theirs.eos_token_id) + 1]
    step_dir = run_dir / "checkpoints" / f"step{STEPS}"
    assert ids_of(step_dir) == expected  # native engine checkpoint (ZeRO-3 shards), greedy
    assert ids_of(tmp_path / "hf") == expected  # the exported directory, greedy
    sampled = ("--temperature", "0.9", "--top-k", "20", "--seed", "3")
    assert ids_of(step_dir, *sampled) == ids_of(tmp_path / "hf", *sampled)


def random_hf_llama(path: Path, *, tied: bool) -> transformers.LlamaForCausalLM:
    """A randomly initialised Hugging Face Llama saved to `path` (GQA, vocab 515)."""
    cfg = load_config(None, ["model.preset=tiny", f"model.vocab_size={VOCAB}",
                             f"model.tie_embeddings={str(tied).lower()}"]).model
    torch.manual_seed(11)
    hf = transformers.LlamaForCausalLM(to_hf_config(cfg, bos_token_id=1, eos_token_id=2,
                                                    attn_implementation="eager"))
    with torch.no_grad():  # non-trivial norms, so a dropped or swapped norm would show
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(path)
    return hf.eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_import_then_export_gives_the_same_tensors(tied, tmp_path):
    random_hf_llama(tmp_path / "src", tied=tied)
    cli("import-hf", tmp_path / "src", "--output", tmp_path / "init")
    cli("export-hf", tmp_path / "init", "--output", tmp_path / "back", "--dtype", "fp32",
        "--tokenizer", _tokenizer(tmp_path))
    original, back = (load_file(str(p / "model.safetensors")) for p in
                      (tmp_path / "src", tmp_path / "back"))
    assert back.keys() == original.keys() - ({"lm_head.weight"} if tied else set())
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name


def _tokenizer(tmp_path: Path) -> Path:
    """A 515-token sentencepiece model (export needs one; a random HF model has none)."""
    return Path(make_data(tmp_path)["tokenizer"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", RUN_OVERRIDES)
def test_first_training_step_after_import_matches_transformers(layout, runs):
    """Step 1's loss is computed with the imported weights: transformers gets the same on the
    same global batch (the sampler's first samples, whatever the layout)."""
    from pretrain.data import DistributedPackedSampler
    from pretrain.data.build import build_split

    run_dir = runs(layout)
    hf = transformers.LlamaForCausalLM.from_pretrained(
        run_dir.parent / "hf_src", attn_implementation="eager").eval()
    losses = [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text()
                                     .splitlines()) if r["kind"] == "train"]
    cfg = load_config(run_dir / "config.yaml")
    samples = build_split(cfg.data, split="train", seq_length=cfg.model.seq_length)
    sampler = DistributedPackedSampler(len(samples), micro_batch_size=4, dp_rank=0, dp_size=1,
                                       consumed_samples=0)
    batch = [samples[i] for i in next(iter(sampler))]
    input_ids = torch.stack([s["input_ids"] for s in batch])
    labels = torch.stack([s["labels"] for s in batch])
    with torch.no_grad():
        logits = hf(input_ids).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    assert abs(losses[0] - expected.item()) / expected.item() < 1e-5


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    # of no family here: another architecture's config.json, or no config.json at all
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    assert "of no model family" in cli_error(
        "import-hf", tmp_path / "gpt2", "--output", tmp_path / "x", capsys=capsys)
    assert "no config.json" in cli_error("import-hf", tmp_path, "--output", tmp_path / "x",
                                         capsys=capsys)
    assert "does not exist" in cli_error("export-hf", tmp_path / "missing", "--output",
                                         tmp_path / "x", capsys=capsys)

    # a config.json that claims other shapes than its tensors
    random_hf_llama(tmp_path / "src", tied=False)
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight has shape .* but its config gives"):
        load_weights(tmp_path / "src")


@pytest.mark.slow  # starts `pretrain train` (DeepSpeed's communication op)
def test_weights_that_do_not_fit_the_run_are_a_clear_error_before_any_step(data515, tmp_path):
    random_hf_llama(tmp_path / "src", tied=False)
    result = run_pretrain(
        ["train", "--config", "configs/tiny.yaml", "--set", f"run_dir={tmp_path / 'run'}",
         "--set", f"data.tokenizer={data515['tokenizer']}",
         "--set", f"data.dataset={data515['dataset']}", "--set", f"model.vocab_size={VOCAB}",
         "--set", "model.num_kv_heads=4", "--set", f"model.init_from={tmp_path / 'src'}"],
        run_dir=tmp_path / "run")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "do not fit the run's model config" in result.stderr
    assert "model.num_kv_heads: run 4, weights 2" in result.stderr
