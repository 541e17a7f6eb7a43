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
    from pretrain.evaluation.tasks import LOCAL_TASKS

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
