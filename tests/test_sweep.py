"""`pretrain sweep`: real short runs over two DeepSpeed configs -> CSV, Markdown, PNG; aggregation;
the same ZeRO-3 run under fsdp2 beside DeepSpeed's (`--engines`: an engine column, a bar per
engine); configs checked before any run, runs stopped at --timeout, a closed stdout, no
matplotlib."""
from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain import cli
from pretrain.testing.runs import REPO

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)


def _sweep(*args: str, **kwargs) -> subprocess.CompletedProcess:
    if "stdout" not in kwargs:
        kwargs["capture_output"] = True
    return subprocess.run([sys.executable, "-m", "pretrain", "sweep", *args], cwd=REPO, text=True,
                          timeout=900, **kwargs)


def _data(tiny_data: dict[str, str]) -> list[str]:
    return ["--config", "configs/tiny.yaml", "--set", f"data.tokenizer={tiny_data['tokenizer']}",
            "--set", f"data.dataset={tiny_data['dataset']}"]


def test_sweep_two_zero_configs_on_two_ranks(tmp_path, tiny_data):
    out = tmp_path / "sweep"
    data = ["--config", "configs/tiny.yaml", "--set", f"data.tokenizer={tiny_data['tokenizer']}",
            "--set", f"data.dataset={tiny_data['dataset']}"]
    listing = _sweep(*data, "--deepspeed-configs", "ds_configs/zero1.json",
                     "ds_configs/zero3.json", "--micro-batches", "1", "2", "--out", str(out),
                     "--list")
    assert listing.returncode == 0, listing.stderr
    names = [line.split("\t")[0] for line in listing.stdout.splitlines()]
    assert names == ["zero1_mbs1", "zero1_mbs2", "zero3_mbs1", "zero3_mbs2"]
    assert "--deepspeed-config ds_configs/zero3.json" in listing.stdout.splitlines()[2]

    run = _sweep(*data, "--deepspeed-configs", "ds_configs/zero1.json", "ds_configs/zero3.json",
                 "--steps", "3", "--nprocs", "2", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert [r["name"] for r in rows] == ["zero1", "zero3"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["world_size"] == "2" and r["steps"] == "3" and r["micro_batch"] == "2"
        assert float(r["tokens_per_s"]) > 0 and float(r["step_time_s"]) > 0
        ranks = [float(v) for v in r["peak_mem_gb_ranks"].split(";")]
        assert len(ranks) == 2 and all(0.1 < v < 8 for v in ranks)  # a process, not a GPU
        assert float(r["peak_mem_gb_max"]) == max(ranks)
        assert 3.0 < float(r["final_loss"]) < 7.0  # near ln(512) = 6.2 after 3 steps
    assert [r["zero_stage"] for r in rows] == ["1", "3"]
    assert rows[0]["deepspeed"] == str(REPO / "ds_configs/zero1.json")  # resolved, absolute
    # same seed and data: ZeRO stages give the same fp32 losses
    assert abs(float(rows[0]["final_loss"]) - float(rows[1]["final_loss"])) < 1e-3
    md = (out / "sweep.md").read_text().splitlines()
    assert md[0].startswith("| name | deepspeed | zero_stage") and len(md) == 4
    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    # the Slurm array's way: aggregate a directory of finished runs, plus one that failed early
    agg = tmp_path / "array"
    for r in rows:
        shutil.copytree(out / r["name"], agg / r["name"])
    (agg / "broken").mkdir()
    (agg / "broken" / "metrics.jsonl").write_text("")
    again = _sweep("--aggregate", str(agg))
    assert again.returncode == 0, again.stderr
    agg_rows = list(csv.DictReader(open(agg / "sweep.csv")))
    assert [r["name"] for r in agg_rows] == ["broken", "zero1", "zero3"]
    assert agg_rows[0]["status"] == "no steps"
    assert [r["tokens_per_s"] for r in agg_rows[1:]] == [r["tokens_per_s"] for r in rows]
    assert (agg / "sweep.png").is_file()
    assert [r["engine"] for r in rows] == ["deepspeed", "deepspeed"]  # as the runs built it

    # the same ZeRO-3 run under fsdp2: one more run, compared with DeepSpeed's in one table
    engines = tmp_path / "engines"
    fsdp2 = _sweep(*data, "--deepspeed-configs", "ds_configs/zero3.json", "--engines", "fsdp2",
                   "--steps", "3", "--nprocs", "2", "--out", str(engines))
    assert fsdp2.returncode == 0, fsdp2.stdout[-3000:] + fsdp2.stderr[-3000:]
    shutil.copytree(out / "zero3", engines / "zero3")
    compared = _sweep("--aggregate", str(engines))
    assert compared.returncode == 0, compared.stderr
    both = list(csv.DictReader(open(engines / "sweep.csv")))
    assert [(r["name"], r["engine"], r["zero_stage"], r["status"]) for r in both] == [
        ("fsdp2_zero3", "fsdp2", "3", "ok"), ("zero3", "deepspeed", "3", "ok")]
    assert abs(float(both[0]["final_loss"]) - float(both[1]["final_loss"])) < 1e-3  # fp32
    assert (engines / "sweep.md").read_text().startswith(
        "| name | deepspeed | zero_stage | engine |")
    from png_check import bar_heights

    png = engines / "sweep.png"  # a bar per engine: DeepSpeed's blue, fsdp2's green
    assert len(bar_heights(png, "tab:blue")) == len(bar_heights(png, "tab:green")) == 2


def test_sweep_lists_a_run_per_engine_and_checks_each_engines_config(tiny_data):
    listing = _sweep(*_data(tiny_data), "--deepspeed-configs", "ds_configs/zero1.json",
                     "ds_configs/zero3.json", "--engines", "deepspeed", "fsdp2", "--list")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert [line.split("\t")[0] for line in lines] == [
        "deepspeed_zero1", "fsdp2_zero1", "deepspeed_zero3", "fsdp2_zero3"]
    assert lines[3].endswith("--set train.engine=fsdp2")
    assert lines[2].endswith("--set train.engine=deepspeed")
    # fsdp2 refuses ZeRO-0 (plain data parallelism): refused before anything is listed
    refused = _sweep(*_data(tiny_data), "--deepspeed-configs", "ds_configs/zero0.json",
                     "--engines", "deepspeed", "fsdp2", "--list")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout
    assert refused.stderr.startswith("error: sweep run fsdp2_zero0 (2 ranks): train.engine=fsdp2 "
                                     "cannot run this config: "), refused.stderr
    twice = _sweep(*_data(tiny_data), "--engines", "fsdp2", "fsdp2", "--list")
    assert twice.returncode == 2 and "--engines fsdp2 fsdp2: each engine once" in twice.stderr


def test_sweep_picture_draws_a_bar_per_engine_to_scale(tmp_path):
    """Runs of two engines: a group of bars per configuration in both panels, one bar per
    engine in its colour (deepspeed blue, fsdp2 green), heights in the runs' proportions."""
    from png_check import bar_heights

    from pretrain.sweep.results import COLUMNS, write_results

    def row(engine, config, tokens, memory):
        return {**dict.fromkeys(COLUMNS, ""), "name": f"{engine}_{config}", "engine": engine,
                "tokens_per_s": tokens, "peak_mem_gb_max": memory, "status": "ok"}

    rows = [row("deepspeed", "zero1", 1200.0, 2.0), row("fsdp2", "zero1", 600.0, 3.0),
            row("deepspeed", "zero3", 400.0, 6.0), row("fsdp2", "zero3", 800.0, 4.0)]
    png = write_results(rows, tmp_path)["png"]
    deepspeed, fsdp2 = bar_heights(png, "tab:blue"), bar_heights(png, "tab:green")
    # left to right: the speed panel's zero1 and zero3 bars, then the memory panel's
    assert len(deepspeed) == 4 and len(fsdp2) == 4, (deepspeed, fsdp2)
    speed = [deepspeed[0], fsdp2[0], deepspeed[1], fsdp2[1]]
    memory = [deepspeed[2], fsdp2[2], deepspeed[3], fsdp2[3]]
    for heights, values in ((speed, [1200, 600, 400, 800]), (memory, [2.0, 3.0, 6.0, 4.0])):
        for height, value in zip(heights, values):
            assert height / heights[0] == pytest.approx(value / values[0], rel=0.03)
    assert bar_heights(png, "tab:orange") == []  # colours name engines here, not panels


def test_sweep_picture_draws_each_finished_runs_speed_and_memory_to_scale(tmp_path):
    """sweep.png: one blue bar per finished run for tokens/s and one orange bar for peak memory,
    heights in the runs' proportions; a failed run has no bar."""
    from png_check import bar_heights

    from pretrain.sweep.results import COLUMNS, write_results

    def row(name, tokens, memory, status="ok"):
        return {**dict.fromkeys(COLUMNS, ""), "name": name, "tokens_per_s": tokens,
                "peak_mem_gb_max": memory, "status": status}

    rows = [row("zero1", 1200.0, 2.0), row("zero3", 400.0, 6.0), row("offload", "", "", "failed")]
    png = write_results(rows, tmp_path)["png"]
    speed, memory = bar_heights(png, "tab:blue"), bar_heights(png, "tab:orange")
    assert len(speed) == 2 and len(memory) == 2, (speed, memory)
    assert speed[0] / speed[1] == pytest.approx(3.0, rel=0.03)
    assert memory[1] / memory[0] == pytest.approx(3.0, rel=0.03)


def test_sweep_refuses_missing_configs_and_empty_directories(tmp_path):
    bad = _sweep("--deepspeed-configs", "ds_configs/zero9.json", "--list")
    assert bad.returncode == 2 and "error: --deepspeed-configs: 'ds_configs/zero9.json'" in bad.stderr
    empty = _sweep("--aggregate", str(tmp_path))
    assert empty.returncode == 2 and "no run directories with metrics.jsonl" in empty.stderr


def test_sweep_checks_every_run_config_before_listing_or_starting(tmp_path, tiny_data):
    # A misspelled field (the real one is train.lr) is refused before --list prints anything.
    bad_field = _sweep(*_data(tiny_data), "--set", "train.learning_rate=1", "--deepspeed-configs",
                       "ds_configs/zero1.json", "--list")
    assert bad_field.returncode == 2 and bad_field.stdout == ""
    lines = bad_field.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: sweep run zero1 (2 ranks): unknown config key train.learning_rate (did you mean "
        "train.lr?): valid keys are "), bad_field.stderr
    # A layout that does not fit --nprocs: only the second run's micro-batch is wrong, and the
    # first one does not start either.
    out = tmp_path / "sweep"
    bad_layout = _sweep(*_data(tiny_data), "--deepspeed-configs", "ds_configs/zero1.json",
                        "--micro-batches", "1", "3", "--nprocs", "2", "--out", str(out))
    assert bad_layout.returncode == 2, bad_layout.stdout + bad_layout.stderr
    assert bad_layout.stderr.strip().splitlines() == [
        "error: sweep run zero1_mbs3 (2 ranks): train.global_batch_size=4 is not a multiple of "
        "train.micro_batch_size x data-parallel size = 3 x 2 = 6: set it to a multiple of 6"]
    assert "[sweep]" not in bad_layout.stdout and not out.exists()


def test_sweep_list_into_a_closed_pipe_ends_quietly(tiny_data):
    """`pretrain sweep --list | head -1`: the reader is gone before the listing is written (here
    always, with `head` only sometimes): no BrokenPipeError traceback, SIGPIPE's status 141."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = _sweep(*_data(tiny_data), "--deepspeed-configs", "ds_configs/zero1.json",
                      "ds_configs/zero3.json", "--list", stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    command = shlex.join([sys.executable, "-m", "pretrain", "sweep", *_data(tiny_data), "--list"])
    head = subprocess.run(["bash", "-c", f"set -o pipefail; {command} | head -1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert head.returncode in (0, 141) and head.stdout.startswith("zero0\t"), head.stderr
    assert "Traceback" not in head.stderr and "BrokenPipeError" not in head.stderr, head.stderr


def test_a_broken_pipe_that_is_not_stdout_keeps_its_traceback(monkeypatch):
    def fails(args):
        raise BrokenPipeError("a pipe of the command's own")

    help_text, add_arguments, _ = cli.COMMANDS["sweep"]
    monkeypatch.setitem(cli.COMMANDS, "sweep", (help_text, add_arguments, fails))
    with pytest.raises(BrokenPipeError, match="a pipe of the command's own"):
        cli.main(["sweep", "--list"])


def _alive_naming(text: str) -> list[str]:
    """Processes (not zombies) whose command line contains `text`."""
    alive = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if proc.name.isdigit() and text in cmdline:
            alive.append(f"{proc.name}: {cmdline}")
    return alive


def test_sweep_timeout_stops_every_process_of_the_run_and_still_writes_the_table(tmp_path,
                                                                                 tiny_data):
    out = tmp_path / "sweep"
    run = _sweep(*_data(tiny_data), "--deepspeed-configs", "ds_configs/zero1.json",
                 "--micro-batches", "1", "2", "--steps", "100000", "--nprocs", "2",
                 "--timeout", "15", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    groups = [int(g) for g in re.findall(r"^\[sweep\] \d/2 \w+ \(process group (\d+)\)$",
                                         run.stdout, re.M)]
    assert len(groups) == 2, run.stdout  # the second run started after the first timed out
    for group in groups:  # torchrun's group...
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
    # ...and its ranks, which torchrun starts in sessions of their own: nothing names the runs.
    assert _alive_naming(str(out)) == []
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert [(r["name"], r["status"]) for r in rows] == [("zero1_mbs1", "timeout after 15s"),
                                                        ("zero1_mbs2", "timeout after 15s")]
    assert len((out / "sweep.md").read_text().splitlines()) == 4
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_writes_the_table_without_matplotlib(tmp_path):
    """matplotlib is a runtime dependency; where it is missing anyway, the table is not lost."""
    requires = re.search(r"install_requires=\[(.*?)\]", (REPO / "setup.py").read_text(), re.S)
    assert '"matplotlib>=' in requires.group(1)
    for name, loss in (("zero1", 6.0), ("zero3", 5.5)):
        (tmp_path / "runs" / name).mkdir(parents=True)
        records = [{"kind": "run", "world_size": 2, "global_batch": 4,
                    "deepspeed_config": f"ds_configs/{name}.json"}]
        records += [{"kind": "train", "step": s, "tokens_per_s": 100.0 * s, "step_time_s": 1.0 / s,
                     "peak_mem_gb": 1.5, "loss": loss} for s in (1, 2, 3)]
        (tmp_path / "runs" / name / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records))
    shadow = tmp_path / "no_matplotlib" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    proc = _sweep("--aggregate", str(tmp_path / "runs"), env=env)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "matplotlib" in line] == [
        "warning: sweep.png skipped: matplotlib cannot be imported (No module named 'matplotlib'); "
        "pip install matplotlib"]
    rows = list(csv.DictReader(open(tmp_path / "runs" / "sweep.csv")))
    assert [(r["name"], r["status"], r["tokens_per_s"]) for r in rows] == [
        ("zero1", "ok", "250.0"), ("zero3", "ok", "250.0")]
    assert (tmp_path / "runs" / "sweep.md").is_file()
    assert not (tmp_path / "runs" / "sweep.png").exists()
    assert "sweep.png" not in proc.stdout
