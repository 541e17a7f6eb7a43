"""The command line as a user meets it: --help everywhere, and bad input as one clear line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pretrain.testing.runs import REPO, run_pretrain

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)


@pytest.mark.parametrize("command", [None, "train", "tokenizer", "preprocess", "generate",
                                     "config"])
def test_help_of_every_command(command):
    args = [sys.executable, "-m", "pretrain"] + ([command] if command else []) + ["--help"]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: pretrain" in out.stdout
    if command is None:
        for sub in ("train", "tokenizer", "preprocess", "generate"):
            assert sub in out.stdout


def test_version_and_help_that_shows_defaults_and_only_real_subcommands():
    def pretrain(*args):
        out = subprocess.run([sys.executable, "-m", "pretrain", *args], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    from pretrain import __version__

    assert pretrain("--version").strip() == f"pretrain {__version__}"
    assert "sweep table" not in pretrain("--help")  # launch has no such subcommand
    assert "(default: 3600)" in pretrain("sweep", "--help")  # --timeout
    preflight = pretrain("launch", "preflight", "--help")
    assert "--search" not in preflight and "--json" not in preflight  # plan's, not preflight's
    assert "--search" in pretrain("plan", "--help")


def _assert_one_error_line(run, *expected: str) -> str:
    assert run.returncode == 2, (run.returncode, run.stdout[-2000:], run.stderr[-4000:])
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def _train(tmp_path, tiny_data, *extra: str):
    args = ["train", "--config", "configs/tiny.yaml", "--set", f"run_dir={tmp_path / 'run'}",
            "--set", f"data.tokenizer={tiny_data['tokenizer']}",
            "--set", f"data.dataset={tiny_data['dataset']}", *extra]
    return run_pretrain(args, run_dir=tmp_path / "run")


def test_unknown_config_key(tmp_path, tiny_data):
    _assert_one_error_line(_train(tmp_path, tiny_data, "--set", "train.learning_rate=1e-3"),
                           "unknown config key train.learning_rate", "valid keys are")


def test_wrong_type(tmp_path, tiny_data):
    _assert_one_error_line(_train(tmp_path, tiny_data, "--set", "train.micro_batch_size=two"),
                           "train.micro_batch_size='two'", "expected int")


def test_hidden_size_not_divisible_by_heads(tmp_path, tiny_data):
    _assert_one_error_line(_train(tmp_path, tiny_data, "--set", "model.hidden_size=70"),
                           "model.hidden_size=70", "divisible by model.num_heads=4")


def test_train_batch_size_contradiction(tmp_path, tiny_data):
    ds = json.loads((REPO / "ds_configs/zero1.json").read_text())
    ds["train_batch_size"] = 6  # run config: micro 2 x accum 2 x dp 1 = 4
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    _assert_one_error_line(_train(tmp_path, tiny_data, "--deepspeed-config", str(tmp_path / "ds.json")),
                           "train_batch_size=6", "gives 4")


def test_ds_json_that_does_not_parse(tmp_path, tiny_data):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 1,}}')
    _assert_one_error_line(_train(tmp_path, tiny_data, "--deepspeed-config", str(tmp_path / "ds.json")),
                           "is not valid JSON", "line 1")


def test_nvme_path_not_writable(tmp_path, tiny_data):
    ds = json.loads((REPO / "ds_configs/zero3_offload_nvme.json").read_text())
    (tmp_path / "plainfile").write_text("x")
    for key in ("offload_optimizer", "offload_param"):
        ds["zero_optimization"][key]["nvme_path"] = str(tmp_path / "plainfile" / "swap")
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    _assert_one_error_line(_train(tmp_path, tiny_data, "--deepspeed-config", str(tmp_path / "ds.json")),
                           "NVMe offload path", "is not writable")


def test_missing_dataset(tmp_path, tiny_data):
    _assert_one_error_line(_train(tmp_path, tiny_data, "--set", f"data.dataset={tmp_path}/nothing"),
                           "pretrain preprocess")


def test_missing_corpus(tmp_path):
    run = run_pretrain(["tokenizer", "--corpus", str(tmp_path / "no_such_dir"), "--output",
                        str(tmp_path / "tok.model")], run_dir=tmp_path)
    _assert_one_error_line(run, "no_such_dir")
    assert not list(tmp_path.glob("tok*"))


def test_empty_corpus(tmp_path, tiny_data):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    run = run_pretrain(["preprocess", "--corpus", str(tmp_path / "empty"), "--tokenizer",
                        tiny_data["tokenizer"], "--output-prefix", str(tmp_path / "out")],
                       run_dir=tmp_path)
    _assert_one_error_line(run, "empty")
    assert not list(tmp_path.glob("out*")), "a failed preprocess left files behind"


def test_run_from_another_directory_saves_absolute_paths(tmp_path, tiny_data):
    """Paths given with --set are the working directory's; `vocab_size: auto` is the
    tokenizer's; the config saved in the run directory holds both resolved, so resuming does
    not depend on where the command runs."""
    import os

    import yaml

    work = tmp_path / "work"
    work.mkdir()
    args = ["train", "--config", str(REPO / "configs/tiny.yaml"), "--set", "run_dir=run",
            "--set", f"data.tokenizer={os.path.relpath(tiny_data['tokenizer'], work)}",
            "--set", f"data.dataset={os.path.relpath(tiny_data['dataset'], work)}",
            "--set", "model.vocab_size=auto", "--set", "train.steps=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    run = subprocess.run([sys.executable, "-m", "pretrain", *args], cwd=work, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    saved = yaml.safe_load((work / "run" / "config.yaml").read_text())
    assert saved["run_dir"] == str(work / "run")
    assert saved["data"]["tokenizer"] == tiny_data["tokenizer"]
    assert saved["data"]["dataset"] == tiny_data["dataset"]
    assert saved["deepspeed"] == str(REPO / "ds_configs/zero1.json")
    assert saved["model"]["vocab_size"] == 512
