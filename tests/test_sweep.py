"""`pretrain sweep`: real short runs over two DeepSpeed configs -> CSV, Markdown, PNG; aggregation."""
from __future__ import annotations

import csv
import shutil
import subprocess
import sys

import pytest

from pretrain.testing.runs import REPO

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)


def _sweep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain", "sweep", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=900)


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
    assert rows[0]["deepspeed"] == "ds_configs/zero1.json"
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


def test_sweep_refuses_missing_configs_and_empty_directories(tmp_path):
    bad = _sweep("--deepspeed-configs", "ds_configs/zero9.json", "--list")
    assert bad.returncode == 2 and "error: --deepspeed-configs: 'ds_configs/zero9.json'" in bad.stderr
    empty = _sweep("--aggregate", str(tmp_path))
    assert empty.returncode == 2 and "no run directories with metrics.jsonl" in empty.stderr
