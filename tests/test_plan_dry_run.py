"""`pretrain plan` as the Slurm scripts call it: a dry run of a full config for N ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pretrain.testing.cli import run_cli
from pretrain.testing.runs import REPO
from test_cli import _assert_one_error_line as _one_error_line


def _plan(*args: str) -> subprocess.CompletedProcess:
    return run_cli(["plan", *args], cwd=REPO)


def test_dry_run_accepts_the_70b_config_on_128_ranks():
    out = _plan("--config", "configs/llama_70b.yaml", "--world-size", "128")
    assert out.returncode == 0, out.stderr
    assert "tp 4 x pp 8 x dp 4 = 128 ranks" in out.stdout
    assert "global batch 1024 = micro 1 x accum 256 x dp 4" in out.stdout
    assert "ZeRO-1" in out.stdout and "recompute none" in out.stdout
    assert "-> fits" in out.stdout
    # the data lives on the cluster, not here: a warning, not an error
    assert "warning: data.tokenizer" in out.stderr


def test_dry_run_json_is_one_object():
    out = _plan("--config", "configs/llama_70b.yaml", "--world-size", "128", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["ok"] and plan["world_size"] == 128
    assert plan["layout"]["data"] == 4 and plan["layout"]["grad_accum"] == 256
    assert plan["deepspeed"]["train_batch_size"] == 1024
    assert plan["deepspeed"]["zero_optimization"]["stage"] == 1
    mem = plan["memory_gb"]
    parts = sum(mem[k] for k in ("params", "grads", "optimizer", "activations", "buffers"))
    assert mem["total"] == pytest.approx(parts)
    assert 0 < plan["mfu"] == plan["hfu"] < 1  # no recomputation: hardware FLOPs = model FLOPs


@pytest.mark.parametrize("extra, expected", [
    # fewer ranks than one replica (a world the layout or the batch cannot use whole plans its
    # usable part, as `train` runs it: tests/test_world_fit.py)
    (["--world-size", "16"], ["world size 16", "parallel.tensor x parallel.pipeline"]),
    (["--world-size", "128", "--set", "parallel.tensor=3"], ["world size 128", "3 x 8 = 24"]),
    # model-build failures caught without building: heads not divisible by tp, layers < pp
    (["--world-size", "96", "--set", "parallel.tensor=3", "--set", "parallel.pipeline=1"],
     ["parallel.tensor=3", "model.num_heads=64"]),
    (["--world-size", "768", "--set", "parallel.pipeline=96"],
     ["parallel.pipeline=96", "model.num_layers=80"]),
    (["--world-size", "128", "--set", "train.micro_batch_size=2",
      "--set", "train.global_batch_size=1023"], ["train.global_batch_size=1023", "multiple of 8"]),
    (["--world-size", "128", "--deepspeed-config", "ds_configs/zero3.json"],
     ["ZeRO stage 3 with parallel.pipeline=8", "zero1.json"]),
    (["--world-size", "128", "--set", "parallel.sequence_parallel=true",
      "--set", "model.seq_length=4098"], ["model.seq_length=4098", "parallel.tensor=4"]),
])
def test_dry_run_rejects_bad_configs_with_one_line(extra, expected):
    _one_error_line(_plan("--config", "configs/llama_70b.yaml", *extra), *expected)


def test_dry_run_checks_the_tokenizer_when_present(tiny_data):
    """A vocabulary smaller than the tokenizer's would index past the embedding: an error; a
    larger one only pads."""
    data = ("--config", "configs/tiny.yaml", "--world-size", "2", "--accelerator", "cpu",
            "--set", f"data.tokenizer={tiny_data['tokenizer']}",
            "--set", f"data.dataset={tiny_data['dataset']}")
    _one_error_line(_plan(*data, "--set", "model.vocab_size=256"), "model.vocab_size=256",
                    "smaller than the 512 tokens", "set model.vocab_size=512 or auto")
    for vocab in ("512", "1024"):
        ok = _plan(*data, "--set", f"model.vocab_size={vocab}")
        assert ok.returncode == 0, ok.stderr
        assert "warning" not in ok.stderr


def test_plan_on_a_cpu_machine_uses_the_precision_it_would_run_and_its_peak(tmp_path):
    """--cluster cpu: the quickstart's 2 ranks on this machine; `auto` resolves as `train`
    would (fp32 on a CPU without bf16 instructions), the compute time follows the given peak."""
    (tmp_path / "cpuinfo").write_text("model name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma\n")
    env = {**os.environ, "PRETRAIN_CPUINFO": str(tmp_path / "cpuinfo")}
    runs = {}
    for peak in (0.1, 0.2):
        out = run_cli(["plan", "--config", "configs/quickstart.yaml", "--world-size", "2",
                            "--cluster", "cpu", "--peak-tflops", str(peak), "--json"],
                           cwd=REPO, env=env)
        assert out.returncode == 0, out.stderr
        runs[peak] = json.loads(out.stdout)
    plan = runs[0.1]
    assert plan["accelerator"] == "cpu" and plan["layout"]["precision"] == "fp32"
    assert plan["cluster"]["gpus_per_node"] == 2 and plan["cluster"]["peak_tflops"] == 0.1
    assert plan["deepspeed"]["bf16"]["enabled"] is False
    # 16 x 256 tokens of model FLOPs per step over 2 ranks at 60% of the peak (the stage count
    # differs from the model's by the padded vocabulary rows: 0.04% here)
    compute = plan["flops_per_token"] * 16 * 256 / 2 / (0.1e12 * 0.6)
    assert plan["time_s"]["compute"] == pytest.approx(compute, rel=2e-3)
    assert runs[0.2]["time_s"]["compute"] == pytest.approx(plan["time_s"]["compute"] / 2,
                                                           rel=1e-9)


@pytest.mark.parametrize("tokenizer", ["present", "unset"])
def test_train_refuses_missing_data_before_any_process_group_or_compiled_op(
        tmp_path, tiny_data, tokenizer):
    """`pretrain train` opens the tokenizer and every dataset before DeepSpeed's process group
    (which on a fresh CPU machine started by compiling an op): here starting a group fails the
    run, and the extension directory must stay empty. Every missing input is in the one line."""
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    prelude = ("import pretrain.dist\n"
               "def no_group(*args, **kwargs):\n"
               "    raise SystemExit('a process group was started')\n"
               "pretrain.dist.init_distributed = no_group\n")
    args = ["train", "--config", "configs/tiny.yaml", "--set", f"run_dir={tmp_path / 'run'}",
            "--set", "data.dataset=scratch/no_such_data", "--set", "model.vocab_size=512"]
    if tokenizer == "present":
        args += ["--set", f"data.tokenizer={tiny_data['tokenizer']}"]
    code = f"{prelude}from pretrain.cli import main\nmain({args!r})"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "DS_ACCELERATOR": "cpu",
                                           "TORCH_EXTENSIONS_DIR": str(extensions)})
    line = _one_error_line(run, "data.dataset:", "scratch/no_such_data")
    assert ("data.tokenizer is empty" in line) is (tokenizer == "unset"), line
    assert "process group" not in run.stderr
    assert not list(extensions.iterdir())


def test_a_plan_that_does_not_fit_is_an_error_after_the_plan(tmp_path):
    """70B on 8 GPUs at tp 8 needs ~168 GB per H100: the plan is printed, then one error line
    and exit 2 (what the Slurm pre-flight relies on); with GPUs given as large enough, it fits."""
    args = ("--config", "configs/llama_70b.yaml", "--world-size", "8", "--set",
            "parallel.tensor=8", "--set", "parallel.pipeline=1")
    out = _plan(*args)
    line = _one_error_line(out, "per GPU but 72.0 GB are usable of 80 GB", "--search")
    assert "--cluster h100-80gb's" in line and "DOES NOT FIT" in out.stdout
    as_json = _plan(*args, "--json")
    assert as_json.returncode == 2 and json.loads(as_json.stdout)["ok"] is False
    big = _plan(*args, "--gpu-memory-gb", "400")
    assert big.returncode == 0 and "-> fits" in big.stdout, big.stderr


def test_a_misspelled_deepspeed_section_is_an_error_not_zero_0(tmp_path):
    """DeepSpeed ignores an unknown top-level key: a JSON with `zero_optimisation` would run
    without ZeRO; `plan` names the key and the one it meant."""
    ds = json.loads((REPO / "ds_configs" / "zero1.json").read_text())
    ds["zero_optimisation"] = ds.pop("zero_optimization")
    (tmp_path / "typo.json").write_text(json.dumps(ds))
    out = _plan("--config", "configs/llama_70b.yaml", "--world-size", "128",
                "--deepspeed-config", str(tmp_path / "typo.json"))
    _one_error_line(out, "unknown DeepSpeed key 'zero_optimisation'",
                    "did you mean 'zero_optimization'?")


def test_plan_from_another_directory_finds_the_configs_files(tmp_path, tiny_data):
    """Paths in a config file are relative to it (`ds_configs/` falls back to the shipped
    directory), so the working directory does not matter."""
    experiment = tmp_path / "experiment"
    experiment.mkdir()
    (experiment / "run.yaml").write_text(
        "deepspeed: ds_configs/zero1.json\nmodel: {preset: tiny, vocab_size: auto}\n"
        f"data:\n  tokenizer: {os.path.relpath(tiny_data['tokenizer'], experiment)}\n"
        f"  dataset: {os.path.relpath(tiny_data['dataset'], experiment)}\n"
        "train: {micro_batch_size: 2, global_batch_size: 4, precision: fp32}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_cli(["plan", "--config", str(experiment / "run.yaml"), "--world-size", "2",
                        "--accelerator", "cpu", "--json"], cwd=elsewhere)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["warnings"] == []  # the tokenizer and the dataset were found
    assert plan["deepspeed"]["zero_optimization"]["stage"] == 1
    shipped = run_cli(["plan", "--config", str(REPO / "configs/llama_7b.yaml"),
                            "--world-size", "8"], cwd=elsewhere)
    assert shipped.returncode == 0, shipped.stderr
    assert "tp 2 x pp 1 x dp 4 = 8 ranks" in shipped.stdout
    assert str(REPO / "data/tokenizer.model") in shipped.stderr  # a warning: no data here


def test_vocab_size_auto_is_the_tokenizers(tiny_data):
    """`auto` reads the tokenizer before anything is sized: the plan of tiny with auto is the
    plan of tiny with the tokenizer's 512 tokens."""
    data = ("--config", "configs/tiny.yaml", "--world-size", "2", "--accelerator", "cpu",
            "--json", "--set", f"data.tokenizer={tiny_data['tokenizer']}",
            "--set", f"data.dataset={tiny_data['dataset']}")
    plans = {vocab: _plan(*data, "--set", f"model.vocab_size={vocab}") for vocab in ("auto", "512")}
    assert all(p.returncode == 0 for p in plans.values()), [p.stderr for p in plans.values()]
    auto, explicit = (json.loads(plans[v].stdout) for v in ("auto", "512"))
    assert auto["parameters"] == explicit["parameters"] and auto["warnings"] == []


def test_vocab_size_auto_without_a_tokenizer(tmp_path):
    """`plan` on a login node that cannot read the tokenizer: with a preset it plans with the
    preset's vocabulary and says so; without one it cannot plan: an error naming the fix."""
    missing = ("--set", f"data.tokenizer={tmp_path / 'nope.model'}",
               "--set", "model.vocab_size=auto")
    with_preset = _plan("--config", "configs/tiny.yaml", "--world-size", "2", "--accelerator",
                        "cpu", *missing)
    assert with_preset.returncode == 0, with_preset.stderr
    assert "planned with preset tiny's 512 tokens" in with_preset.stderr
    no_preset = _plan("--world-size", "8", "--set", "model.preset=null", *missing)
    _one_error_line(no_preset, "model.vocab_size=auto", "nope.model",
                    "set model.vocab_size to its vocabulary size")


def test_train_settles_the_vocabulary_before_any_process_group(tmp_path, tiny_data):
    """`train` (required data): `auto` becomes the tokenizer's size; `auto` with no tokenizer,
    or a vocabulary the tokenizer's ids overflow, is an error before the process group."""
    from pretrain.config import load_config
    from pretrain.data.build import check_run_data
    from pretrain.errors import ConfigError

    data = [f"data.tokenizer={tiny_data['tokenizer']}", f"data.dataset={tiny_data['dataset']}"]
    cfg = load_config(REPO / "configs/tiny.yaml", [*data, "model.vocab_size=auto"])
    assert check_run_data(cfg, required=True) == [] and cfg.model.vocab_size == 512
    bigger = load_config(REPO / "configs/tiny.yaml", [*data, "model.vocab_size=640"])
    assert check_run_data(bigger, required=True) == [] and bigger.model.vocab_size == 640
    smaller = load_config(REPO / "configs/tiny.yaml", [*data, "model.vocab_size=500"])
    with pytest.raises(ConfigError, match="model.vocab_size=500 is smaller than the 512 tokens"):
        check_run_data(smaller, required=True)
    unreadable = load_config(REPO / "configs/tiny.yaml", [
        f"data.tokenizer={tmp_path / 'nope.model'}", f"data.dataset={tiny_data['dataset']}",
        "model.vocab_size=auto"])
    with pytest.raises(ConfigError, match="model.vocab_size=auto reads the vocabulary of "
                                          "data.tokenizer, but data.tokenizer: .*nope.model"):
        check_run_data(unreadable, required=True)


# Two configs `pretrain train` refuses before any process group: a sink whose packages are not
# installed here (MLflow's store without Alembic, hidden from this process), eval tasks on a
# context-parallel layout. (overrides, what the error line says)
_HIDE_ALEMBIC = ("import importlib.util\n"
                 "_find = importlib.util.find_spec\n"
                 "importlib.util.find_spec = lambda name, *a: None if name == 'alembic' "
                 "else _find(name, *a)\n")
REFUSED = {
    "sink-not-installed": (["logging.report_to=[mlflow]"], "mlflow needs alembic"),
    "eval-on-context": (["parallel.context=2", "eval.tasks=[python_next_line]"],
                        "eval.tasks with parallel.context > 1"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_plan_and_preflight_refuse_what_train_refuses(case, tmp_path, tiny_data):
    """The run's checks run where its config is settled: `train`, `plan` and the Slurm
    pre-flight (each in a process whose process group cannot start) print the same one
    `error:` line and exit 2."""
    overrides, expected = REFUSED[case]
    sets = [arg for override in overrides for arg in ("--set", override)]
    data = ["--set", f"data.tokenizer={tiny_data['tokenizer']}",
            "--set", f"data.dataset={tiny_data['dataset']}"]
    commands = {
        "train": ["train", "--config", "configs/tiny.yaml", "--set", f"run_dir={tmp_path / 'run'}",
                  *data, *sets],
        "plan": ["plan", "--config", "configs/tiny.yaml", "--world-size", "2", *data, *sets],
        "preflight": ["launch", "preflight", "--world-size", "2", "--accelerator", "cpu",
                      "--log-dir", str(tmp_path / "log"), "--config", "configs/tiny.yaml",
                      *data, *sets],
    }
    # one interpreter imports the CLI once; each command runs in a child forked from it, as
    # its own process would (its own exit status and stderr), without paying the imports again
    code = (f"{_HIDE_ALEMBIC}import json, os, sys\n"
            "import pretrain.dist\n"
            "def no_group(*args, **kwargs):\n"
            "    raise SystemExit('a process group was started')\n"
            "pretrain.dist.init_distributed = no_group\n"
            "from pretrain.cli import main\n"
            f"commands = {commands!r}\n"
            f"out = {str(tmp_path / 'stderr')!r}\n"
            "status = {}\n"
            "for name, args in commands.items():\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        fd = os.open(f'{out}.{name}', os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n"
            "        os.dup2(fd, 2)\n"
            "        sys.stderr = os.fdopen(2, 'w', buffering=1)\n"
            "        code = 0\n"
            "        try:\n"
            "            main(args)\n"
            "        except SystemExit as exc:\n"
            "            code = exc.code if isinstance(exc.code, int) else (exc.code is not None)\n"
            "            if not isinstance(exc.code, int) and exc.code is not None:\n"
            "                print(exc.code, file=sys.stderr)\n"
            "        sys.stderr.flush()\n"
            "        os._exit(code)\n"
            "    status[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
            "print(json.dumps(status))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=240, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert run.returncode == 0, run.stderr[-3000:]
    status = json.loads(run.stdout.splitlines()[-1])
    lines = {name: _one_error_line(subprocess.CompletedProcess(
        args, status[name], "", (tmp_path / f"stderr.{name}").read_text()), expected)
        for name, args in commands.items()}
    assert lines["plan"] == lines["train"] and lines["preflight"] == lines["train"], lines
