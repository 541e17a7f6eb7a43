"""docs/first-run.md as a new user runs it, and what that user meets on the way.

Every command of docs/first-run.md that can run on a CPU runs here, on the tiny model: each
`pretrain ...` line of its code blocks (joined at a trailing backslash) is either run by a test of
this file (`RUN`, with the tiny sizes as extra `--set` overrides) or named in `NOT_RUN` with the
reason (GPU-only, hub access, a real Slurm cluster). A command added to the page fails
`test_every_command_of_the_page_is_run_or_says_why_not` until it is one or the other.

Then the messages on that path, each checked against the code that decides it: a tokenizer given
as a hub id, a missing text field, a DeepSpeed JSON that does not exist, the help of `eval` and
`export-hf`.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import re
import shlex
import subprocess
import typing
from pathlib import Path

import pytest

from pretrain.config import RunConfig
from pretrain.data.tokenizer import Tokenizer
from pretrain.errors import DataError, EXIT_USER_ERROR
from pretrain.testing.cli import run_cli
from pretrain.testing.runs import REPO

PAGE = REPO / "docs" / "first-run.md"


def _one_error_line(proc: subprocess.CompletedProcess, *expected: str) -> str:
    assert proc.returncode == EXIT_USER_ERROR, (proc.returncode, proc.stdout[-2000:],
                                                proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


# ---- the page's commands ---------------------------------------------------------------------

def page_commands() -> list[str]:
    """Every command line of the page's bash blocks, continuation lines joined, comments cut."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(line.split("  #")[0].split())
            if line:
                commands.append(line)
    return commands


# Commands of the page no CPU test can run, by how they start, and why.
NOT_RUN = {
    "huggingface-cli download": "needs the Hugging Face hub (this machine has no access)",
    "sbatch ": "a Slurm cluster with GPUs; the script's body is slurm/pretrain_70b.sh's "
               "(tests/test_docs.py), which tests/test_slurm.py runs on a local Slurm cluster",
    "CONFIG=configs/llama_7b.yaml DS_CONFIGS=": "a Slurm array; slurm/zero_sweep.sh runs in "
                                                "tests/test_slurm.py",
    "tail -f ": "the log of a running job",
    "tensorboard ": "a server; its event files are written by the runs of tests/test_telemetry.py",
}
# What each run command of the page is, by how it starts (the first that matches).
RUN = ["pretrain preprocess ", "pretrain train ", "pretrain config ",
       "pretrain plan --config configs/llama_7b.yaml --set data.tokenizer=tokenizers/llama3 "
       "--set model.vocab_size=auto --nodes 4 --search",
       "pretrain plan --config configs/llama_7b.yaml --set data.tokenizer=tokenizers/llama3 "
       "--set model.vocab_size=auto --nodes 4", "pretrain plot ", "pretrain sweep ",
       "pretrain export-hf ", "pretrain eval "]


def page_command(start: str) -> str:
    found = [command for command in page_commands() if command.startswith(start)]
    assert found, f"docs/first-run.md has no command starting {start!r}"
    return found[0]


def test_every_command_of_the_page_is_run_or_says_why_not():
    for command in page_commands():
        assert any(command.startswith(start) for start in [*NOT_RUN, *RUN]), \
            f"docs/first-run.md: {command!r} is neither run by a test nor in NOT_RUN"
    for start in RUN:
        page_command(start)


def test_the_recipe_reads_the_dataset_the_page_preprocesses():
    """`configs/llama_7b.yaml`'s data.dataset is, from the repository root, the prefix the
    page's `preprocess` writes."""
    from pretrain.config import load_config

    prefix = shlex.split(page_command("pretrain preprocess "))
    written = prefix[prefix.index("--output-prefix") + 1]
    assert load_config(REPO / "configs" / "llama_7b.yaml").data.dataset == str(REPO / written)


@pytest.fixture(scope="module")
def llama3_standin(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """What the page's user has: a Hugging Face tokenizer directory (the tiny sentencepiece
    model converted, saved as `huggingface-cli download` leaves one), a `.jsonl` corpus in two
    files, and where the page's outputs go instead of the repository."""
    from pretrain.checkpoint.hf import sentencepiece_to_hf

    from conftest import TINY_CORPUS_FILES

    root = tmp_path_factory.mktemp("first_run")
    sentencepiece_to_hf(Path(tiny_data["tokenizer"])).save_pretrained(root / "llama3")
    (root / "corpus").mkdir()
    for index, half in enumerate((TINY_CORPUS_FILES[::2], TINY_CORPUS_FILES[1::2])):
        (root / "corpus" / f"part{index}.jsonl").write_text("".join(
            json.dumps({"text": path.read_text(), "path": path.name}) + "\n" for path in half))
    return {"root": root, "tokenizer": root / "llama3", "corpus": root / "corpus",
            "dataset": root / "corpus_text_document"}


def _as_tested(command: str, where: dict[str, Path], *extra: str) -> list[str]:
    """The page's command with this test's paths for the user's files and outputs, the tiny
    sizes in `extra`; its arguments after `pretrain`."""
    root = where["root"]
    for page, here in (("tokenizers/llama3", where["tokenizer"]),
                       ("'my_corpus/*.jsonl'", f"'{where['corpus']}/*.jsonl'"),
                       ("data/corpus_text_document", where["dataset"]),
                       ("runs/llama_7b-hf", root / "hf"), ("runs/llama_7b", root / "rehearsal"),
                       ("runs/rehearsal", root / "rehearsal"), ("runs/sweep", root / "sweep"),
                       ("--output curves.png", f"--output {root / 'curves.png'}")):
        command = command.replace(page, str(here))
    return shlex.split(command)[1:] + list(extra)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    proc = run_cli(args, cwd=REPO, timeout=600)
    assert proc.returncode == 0, (args, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


@pytest.fixture(scope="module")
def preprocessed(llama3_standin) -> subprocess.CompletedProcess:
    return _run(_as_tested(page_command("pretrain preprocess "), llama3_standin))


def test_preprocess_writes_the_recipes_dataset_and_names_the_eos_it_appended(
        preprocessed, llama3_standin):
    from pretrain.data.indexed import IndexedDataset

    tokenizer = Tokenizer.load(llama3_standin["tokenizer"])
    assert (f"[preprocess] tokenizer {llama3_standin['tokenizer']}: {tokenizer.vocab_size:,} "
            f"tokens (model.vocab_size: auto takes them); each document ends with eos "
            f"{tokenizer.eos_id} {tokenizer.token(tokenizer.eos_id)}; no bos is added"
            ) in preprocessed.stdout
    dataset = IndexedDataset(str(llama3_standin["dataset"]))
    first = dataset[0]
    assert first[-1] == tokenizer.eos_id and first[0] != tokenizer.bos_id


# The tiny sizes (and the test's dataset) added to the page's recipe commands.
TINY = ["--set", "model.preset=tiny"]


def _dataset(where: dict[str, Path]) -> list[str]:
    return ["--set", f"data.dataset={where['dataset']}"]


def test_config_prints_the_run_the_cluster_job_will_run(preprocessed, llama3_standin):
    out = _run(_as_tested(page_command("pretrain config "), llama3_standin,
                          *_dataset(llama3_standin))).stdout
    assert f"tokenizer: {llama3_standin['tokenizer']}" in out and "vocab_size: auto" in out


def test_plan_and_its_search_for_four_nodes(preprocessed, llama3_standin):
    """The page's two plans on 4 x 8 H100 (the tiny model: the planner needs no GPU): the
    search ranks the recipe's own layout first, and the plan reads the vocabulary from the
    tokenizer directory."""
    search = page_command(RUN[3])
    plan, = [c for c in page_commands() if c.startswith(RUN[4]) and "--search" not in c]
    out = _run(_as_tested(search, llama3_standin, *TINY, *_dataset(llama3_standin))).stdout
    assert "this config: tp2 pp1 dp16 mbs4 ZeRO-3" in out, out
    out = _run(_as_tested(plan, llama3_standin, *TINY, *_dataset(llama3_standin))).stdout
    assert "tp 2 x pp 1 x dp 16 = 32 ranks" in out, out


# ---- the laptop rehearsal and what follows it (training runs: slow) ---------------------------

QUIET = ["--set", "data.num_workers=0", "--set", "logging.report_to=[]",
         "--set", "logging.curves=false", "--set", "logging.progress_bar=false"]


@pytest.fixture(scope="module")
def rehearsal(preprocessed, llama3_standin) -> Path:
    _run(_as_tested(page_command("pretrain train "), llama3_standin, *_dataset(llama3_standin),
                    *QUIET))
    return llama3_standin["root"] / "rehearsal"


@pytest.mark.slow
def test_the_rehearsal_trains_checkpoints_and_is_plotted_exported_and_evaluated(
        rehearsal, llama3_standin):
    records = [json.loads(line) for line in (rehearsal / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 21))
    assert train[-1]["loss"] < train[0]["loss"]
    assert (rehearsal / "checkpoints" / "step20").is_dir()
    root = llama3_standin["root"]
    _run(_as_tested(page_command("pretrain plot "), llama3_standin))
    assert (root / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _run(_as_tested(page_command("pretrain export-hf "), llama3_standin))
    from transformers import AutoTokenizer

    exported = AutoTokenizer.from_pretrained(root / "hf", local_files_only=True)
    assert exported.eos_token_id == Tokenizer.load(llama3_standin["tokenizer"]).eos_id
    # the page's lm-eval tasks need their datasets cached; the local one stands in for them
    command = page_command("pretrain eval ").replace("hellaswag,arc_easy", "python_word_order")
    out = _run(_as_tested(command.replace("--limit 500", "--limit 20"), llama3_standin)).stdout
    assert "python_word_order/acc" in out


@pytest.mark.slow
def test_the_zero_sweep_runs_each_deepspeed_config(preprocessed, llama3_standin):
    command = page_command("pretrain sweep ").replace("--nprocs 8", "--nprocs 1")
    _run(_as_tested(command.replace("--steps 20", "--steps 2"), llama3_standin, *TINY,
                    "--set", "parallel.tensor=1", "--set", "parallel.sequence_parallel=false",
                    "--set", "train.micro_batch_size=2", "--set", "train.global_batch_size=4",
                    "--set", "train.precision=fp32", *_dataset(llama3_standin), *QUIET))
    table = (llama3_standin["root"] / "sweep" / "sweep.csv").read_text()
    assert "zero1" in table and "zero3" in table, table


# ---- the messages on the way -----------------------------------------------------------------

def test_a_hub_id_as_tokenizer_says_how_to_download_it_on_another_machine():
    """This machine reads tokenizers from local files only: a hub id is answered with the
    download command for a machine that has hub access and the directory to pass."""
    with pytest.raises(DataError) as caught:
        Tokenizer.load("meta-llama/Meta-Llama-3-8B")
    message = str(caught.value)
    assert ('huggingface-cli download meta-llama/Meta-Llama-3-8B --include "tokenizer*" '
            "--local-dir") in message, message
    assert "pretrain tokenizer" not in message, message  # not the advice to train another
    # a missing .model file is still a missing file, with both ways out
    with pytest.raises(DataError, match="not found") as caught:
        Tokenizer.load("data/missing.model")
    assert "Hugging Face tokenizer directory" in str(caught.value)


def _config_sections() -> dict[str, set[str]]:
    hints = typing.get_type_hints(RunConfig)
    return {f.name: {g.name for g in dataclasses.fields(hints[f.name])}
            for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(hints[f.name])}


FILE_SUFFIXES = {"safetensors", "bin", "idx", "json", "jsonl", "yaml", "model"}


def _error_messages(path: Path):
    """(line, text) of every string in a call of an `...Error` class: the messages users read."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "").endswith("Error"):
            for part in ast.walk(node):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    yield part.lineno, part.value


def test_every_config_key_an_error_message_names_exists():
    """An error that tells the user to set `data.text_field` (no such key) sends them to a
    second error; every `section.key` in a message of the package is a field of the config
    (a name ending in `_` is a prefix the message completes)."""
    sections = _config_sections()
    key = re.compile(rf"(?<![\w./-])({'|'.join(sections)})\.([a-z_][a-z0-9_]*)\b")
    wrong = []
    for path in sorted((REPO / "pretrain").rglob("*.py")):
        for line, text in _error_messages(path):
            for match in key.finditer(text):
                section, name = match.groups()
                known = sections[section]
                if name in FILE_SUFFIXES or name in known or (
                        name.endswith("_") and any(k.startswith(name) for k in known)):
                    continue
                wrong.append(f"{path.relative_to(REPO)}:{line}: {match.group(0)}")
    assert not wrong, "\n".join(wrong)


def test_a_missing_text_field_names_the_option_that_chooses_it(tmp_path, tiny_data):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"content": "def f():\n    return 1\n"}) + "\n")
    proc = run_cli(["preprocess", "--corpus", str(corpus), "--tokenizer", tiny_data["tokenizer"],
                    "--workers", "1", "--output-prefix", str(tmp_path / "out")], cwd=REPO)
    error = _one_error_line(proc, "\"text\" field (found ['content'])", "--text-field content")
    assert "data.text_field" not in error


def test_config_refuses_a_deepspeed_json_that_does_not_exist(tmp_path):
    """The README promises one error line for a DeepSpeed JSON that is missing or does not
    parse: `pretrain config` checks it as `train` does."""
    _one_error_line(run_cli(["config", "--config", "configs/tiny.yaml", "--deepspeed-config",
                             str(tmp_path / "missing.json")], cwd=REPO),
                    "missing.json", "does not exist")
    (tmp_path / "bad.json").write_text("{ not json")
    _one_error_line(run_cli(["config", "--deepspeed-config", str(tmp_path / "bad.json")],
                            cwd=REPO), "bad.json", "not valid JSON")
    assert run_cli(["config", "--config", "configs/tiny.yaml"], cwd=REPO).returncode == 0


def _help(*command: str) -> str:
    proc = run_cli([*command, "--help"], cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.split())


def test_eval_help_lists_every_local_task():
    from pretrain.resolve.eval_tasks import LOCAL_TASKS

    text = _help("eval")
    assert len(LOCAL_TASKS) >= 4
    assert all(name in text for name in LOCAL_TASKS), (LOCAL_TASKS, text)


def test_every_tokenizer_option_says_both_kinds_a_tokenizer_loads_from():
    """`Tokenizer.load` reads a sentencepiece .model or a Hugging Face tokenizer directory;
    every command's `--tokenizer` says so (export-hf's too)."""
    for command in (["preprocess"], ["export-hf"]):
        text = _help(*command)
        assert "sentencepiece .model or a Hugging Face tokenizer directory" in text, text


# ---- a Slurm job's faults: requeued a bounded number of times (slurm/faults.sh) ---------------

def _requeue_fault(faults: Path, step: int, limit: str | None = None) -> tuple[int, str]:
    """`requeue_fault FAULTS STEP [LIMIT]` of slurm/faults.sh: (0 requeue / 1 not, its line)."""
    script = f'source slurm/faults.sh; requeue_fault {faults} {step} {limit or ""}'
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, proc.stdout.strip()


def test_a_fault_is_requeued_until_the_limit_and_never_twice_at_the_same_step(tmp_path):
    """A dead rank or a failed collective (exit 3) is requeued, as torchrun's max-restarts and
    Kubernetes' backoffLimit restart: at most SLURM_FAULT_REQUEUES times (default 2), and not
    when the job faults at the step of its previous fault (it would fail there forever)."""
    faults = tmp_path / "faults.txt"
    assert _requeue_fault(faults, 120)[0] == 0
    assert _requeue_fault(faults, 340)[0] == 0
    code, line = _requeue_fault(faults, 560)
    assert code == 1 and "SLURM_FAULT_REQUEUES=2" in line, line
    assert faults.read_text() == "step=120\nstep=340\nstep=560\n"
    again = tmp_path / "again.txt"
    assert _requeue_fault(again, 7, "5")[0] == 0
    code, line = _requeue_fault(again, 7, "5")
    assert code == 1 and "step 7 again" in line, line
    assert _requeue_fault(tmp_path / "none.txt", 3, "0")[0] == 1  # 0: never requeued


def test_the_fault_step_is_the_last_train_record_of_the_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"kind": "run", "world_size": 2}, {"kind": "train", "step": 9, "loss": 3.0},
        {"kind": "valid", "step": 10, "loss": 3.1}, {"kind": "train", "step": 10, "loss": 2.9},
        {"kind": "eval", "step": 10})))

    def step(run_dir: Path) -> str:
        return subprocess.run(["bash", "-c", f"source slurm/faults.sh; last_train_step {run_dir}"],
                              cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    assert step(tmp_path) == "10"
    assert step(tmp_path / "missing") == "0"  # faulted before its first step


# ---- from a laptop ------------------------------------------------------------------------------

def test_cores_are_counted_without_gnu_nproc(tmp_path):
    """launch/env.sh counts cores with GNU `nproc`, else macOS's `sysctl -n hw.ncpu`: a PATH with
    only a stand-in `sysctl` (a Mac's) gives its count, and the CPU ranks' threads follow."""
    (tmp_path / "sysctl").write_text("#!/bin/sh\n[ \"$1 $2\" = '-n hw.ncpu' ] && echo 12\n")
    (tmp_path / "sysctl").chmod(0o755)
    script = "source launch/env.sh; cpu_cores; rank_env 0 4; echo $OMP_NUM_THREADS"
    env = {"PATH": str(tmp_path), "ROOT": str(REPO)}
    out = subprocess.run(["/bin/bash", "-c", script], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["12", "3"]
