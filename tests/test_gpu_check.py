"""`bench/gpu_check.sh --dry-run`: the one-GPU check's rows on the CPU with tiny shapes, the
GPU-only ones skipped with their reason, the table and the JSON; a row that fails fails the
check without stopping the others."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
GPU_ONLY = {"sdpa_flash", "varlen_documents", "selective_memory", "peak_memory_1b", "mfu_4096"}
ON_CPU = {"fused_adamw", "compile_layer", "moe", "process_group", "fsdp2", "fp8_tensorwise",
          "fp8_rowwise"}


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dry_run_runs_every_row_on_the_cpu_and_writes_the_table_and_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    run = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", str(out)], cwd=ROOT,
                         env={**env, "PYTHON": sys.executable}, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    rows = {r["row"]: r for r in report["rows"]}
    assert report["ok"] and report["dry_run"] and set(rows) == GPU_ONLY | ON_CPU
    for name in ON_CPU:
        assert rows[name]["status"] == "ok" and rows[name]["ran"] and rows[name]["matched"], name
    for name in GPU_ONLY:
        assert rows[name]["status"].startswith("skipped: needs a GPU"), rows[name]
        assert not rows[name]["ran"]
    # the planner's predictions are computed even where the measurement is skipped
    assert 5 < rows["peak_memory_1b"]["values"]["predicted_gib"] < 80
    assert 0 < rows["mfu_4096"]["values"]["predicted_mfu"] < 1
    assert "window_size" in rows["varlen_documents"]["values"]["binding"]
    table = run.stdout.splitlines()
    assert table[0].split()[:4] == ["row", "status", "ran", "matched"]
    assert {line.split()[0] for line in table[1:len(rows) + 1]} == set(rows)
    assert "gpu_check: every row holds" in run.stdout


def test_a_failing_row_fails_the_check_and_the_others_still_run(monkeypatch):
    gpu_check = _gpu_check()

    def broken(c, r):
        r.ran, r.matched = True, False

    def raises(c, r):
        raise RuntimeError("CUDA error: no kernel image")

    monkeypatch.setitem(gpu_check.ROW_FUNCTIONS, "moe", broken)
    monkeypatch.setitem(gpu_check.ROW_FUNCTIONS, "fsdp2", raises)
    c = gpu_check.Check(dry_run=True)
    try:
        results = gpu_check.run_rows(c, ("moe", "fsdp2", "process_group", "mfu_4096"))
    finally:
        if c.group_backend is not None:  # the one-rank group this check made
            import torch.distributed as dist
            dist.destroy_process_group()
    status = {r.row: r.status for r in results}
    assert status["moe"] == "FAIL" and status["fsdp2"] == "FAIL"
    assert "no kernel image" in results[1].detail
    assert status["process_group"] == "ok" and status["mfu_4096"].startswith("skipped")
    assert not all(r.holds for r in results)


def test_rows_left_when_the_budget_is_spent_are_skipped():
    gpu_check = _gpu_check()
    results = gpu_check.run_rows(gpu_check.Check(dry_run=True), ("moe",), budget_s=-1)
    assert results[0].status.startswith("skipped: the check's") and results[0].holds
