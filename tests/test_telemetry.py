"""Training telemetry: hardware vs model FLOPs, the profiler trace, the step record's fields."""
from __future__ import annotations

import json

import pytest

from pretrain.testing.runs import run_pretrain, train
from pretrain.arithmetic import (hardware_flops_per_token, layer_forward_flops_per_token,
                                 model_flops_per_token)
from pretrain.config import MODEL_PRESETS, LoggingConfig, ModelConfig, Recompute
from pretrain.errors import ConfigError
from pretrain.telemetry import format_step_line


def test_hardware_flops_count_recomputed_forwards():
    m = ModelConfig(**MODEL_PRESETS["7b"])
    assert hardware_flops_per_token(m) == model_flops_per_token(m)
    full = ModelConfig(**MODEL_PRESETS["7b"], activation_checkpointing=Recompute.FULL)
    every4 = ModelConfig(**MODEL_PRESETS["7b"], activation_checkpointing=Recompute.EVERY_K,
                         activation_checkpointing_interval=4)
    layer = layer_forward_flops_per_token(m)
    assert hardware_flops_per_token(full) == pytest.approx(model_flops_per_token(m) + 32 * layer)
    assert hardware_flops_per_token(every4) == pytest.approx(model_flops_per_token(m) + 8 * layer)
    # a forward is a third of forward + backward for the layers: ~4/3 overall
    assert 1.25 < hardware_flops_per_token(full) / model_flops_per_token(m) < 4 / 3


@pytest.mark.parametrize("bad", ["3", "5:3", "0:2", "a:b", "3:"])
def test_profile_steps_validation(bad):
    with pytest.raises(ConfigError, match="logging.profile_steps"):
        LoggingConfig(profile_steps=bad)
    assert LoggingConfig(profile_steps="2:4").profile_range() == (2, 4)


def test_step_line_shows_hfu_only_when_it_differs():
    rec = {"step": 3, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0,
           "mfu": 0.10, "hfu": 0.13, "peak_mem_gb": 1.0, "data_wait_s": 0.001}
    assert "MFU 10.0% (HFU 13.0%)" in format_step_line(rec, 10)
    assert "HFU" not in format_step_line({**rec, "hfu": 0.10}, 10)


@pytest.mark.slow
def test_training_records_hardware_flops_and_writes_a_profile_trace(tmp_path, tiny_data):
    run = train(tmp_path, tiny_data, overrides=["train.steps=4", "model.activation_checkpointing=full"],
                name="recompute")
    records = [r for r in run.records if r["kind"] == "train"]
    assert len(records) == 4
    for r in records:
        assert r["hw_tflops_per_device"] > r["tflops_per_device"] > 0
        assert r["hfu"] > r["mfu"] > 0
        assert r["peak_mem_gb"] > 0 and r["data_wait_s"] >= 0 and r["grad_norm"] > 0
        assert r["skipped_steps"] == 0

    plain_dir = tmp_path / "plain"
    args = ["train", "--config", "configs/tiny.yaml", "--set", f"run_dir={plain_dir}",
            "--set", f"data.tokenizer={tiny_data['tokenizer']}",
            "--set", f"data.dataset={tiny_data['dataset']}", "--set", "train.steps=4",
            "--profile-steps", "2:3"]
    plain = run_pretrain(args, run_dir=plain_dir).check()
    for r in (r for r in plain.records if r["kind"] == "train"):
        assert r["hfu"] == pytest.approx(r["mfu"])  # nothing recomputed
    trace_path = plain_dir / "profile" / "rank0_steps2-3.json"
    assert trace_path.is_file(), sorted(p.name for p in plain_dir.rglob("*"))
    assert f"Chrome trace of steps 2:3 in {trace_path}" in plain.stdout
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert len(events) > 100
    assert any("aten::mm" in n or "aten::addmm" in n or "aten::linear" in n for n in names)
    assert list(plain_dir.joinpath("profile").iterdir()) == [trace_path]  # one rank, one file


class _FakeNVMLError(Exception):
    """pynvml raises its own exception classes, none of them a RuntimeError."""


def _fake_pynvml(*, fail: str | None):
    import types

    calls = {"nvmlInit": 0, "reads": 0}

    def init():
        calls["nvmlInit"] += 1
        if fail == "init":
            raise _FakeNVMLError("NVML_ERROR_NO_PERMISSION")

    def utilization(handle):
        calls["reads"] += 1
        if fail == "read" and calls["reads"] > 1:
            raise _FakeNVMLError("NVML_ERROR_NOT_SUPPORTED")  # e.g. a MIG slice
        return types.SimpleNamespace(gpu=87)

    module = types.SimpleNamespace(
        nvmlInit=init, nvmlDeviceGetHandleByIndex=lambda index: ("gpu", index),
        nvmlDeviceGetUtilizationRates=utilization, NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetTemperature=lambda handle, sensor: 61,
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(used=3 * 2**30))
    return module, calls


@pytest.mark.parametrize("fail", [None, "init", "read"])
def test_nvml_is_opened_once_and_its_errors_turn_the_stats_off(fail, monkeypatch, capsys):
    import sys

    import torch

    from pretrain.telemetry import GpuStats

    module, calls = _fake_pynvml(fail=fail)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    stats = GpuStats(enabled=True)
    readings = [stats.read() for _ in range(4)]
    assert calls["nvmlInit"] == 1
    if fail is None:
        assert readings == [{"gpu_util_pct": 87.0, "gpu_temp_c": 61.0, "gpu_mem_used_gb": 3.0}] * 4
        assert stats._handle == ("gpu", 5)  # NVML's index of the visible device
    else:
        good = 1 if fail == "read" else 0
        assert readings[good:] == [{}] * (4 - good)
        assert capsys.readouterr().out.count("GPU utilisation/temperature off") == 1
