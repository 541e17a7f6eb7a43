"""Training telemetry: hardware vs model FLOPs, the profiler trace, the step record's fields."""
from __future__ import annotations

import json
import logging

import pytest

from png_check import coloured_pixels_per_band
from pretrain.testing.runs import run_pretrain, train, train_args
from pretrain.arithmetic import (hardware_flops_per_token, layer_forward_flops_per_token,
                                 model_flops_per_token)
from pretrain.config import MODEL_PRESETS, LoggingConfig, ModelConfig, Recompute
from pretrain.training.curves import PANELS
from pretrain.errors import ConfigError
from pretrain.training.metrics import format_step_line
from pretrain.testing.faults import nan_loss_environment


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


def _attention_forwards(trace_path) -> int:
    """Attention forwards in a profiler trace: recomputation in backward runs them again."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    return sum(e.get("name") == "aten::scaled_dot_product_attention" for e in events)


@pytest.mark.slow
def test_training_records_hardware_flops_and_writes_a_profile_trace(tmp_path, tiny_data):
    """HFU above MFU comes from the config's recomputation; the traces of the same steps show
    the hardware really ran every layer's forward twice (full recomputation) against once."""
    run = train(tmp_path, tiny_data, name="recompute",
                overrides=["train.steps=4", "model.activation_checkpointing=full",
                           "logging.profile_steps='2:3'"])
    records = [r for r in run.records if r["kind"] == "train"]
    assert len(records) == 4
    for r in records:
        assert r["hw_tflops_per_device"] > r["tflops_per_device"] > 0
        assert r["hfu"] > r["mfu"] > 0
        assert r["peak_mem_gb"] > 0 and r["data_wait_s"] >= 0 and r["grad_norm"] > 0
        assert r["skipped_steps"] == 0

    plain_dir = tmp_path / "plain"
    args = [*train_args(plain_dir, tiny_data, overrides=["train.steps=4"]),
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
    # 2 layers x 2 micro-batches x 2 steps of forwards; recomputation adds as many in backward
    once = _attention_forwards(trace_path)
    assert once == 8, once
    assert _attention_forwards(run.run_dir / "profile" / "rank0_steps2-3.json") == 2 * once


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

    from pretrain.training.metrics import GpuStats

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


# ---- sinks, log levels, progress bars --------------------------------------------------------

@pytest.mark.parametrize("sinks, hint", [(["tensorboard", "mlfow"], " (did you mean mlflow?)"),
                                         (["comet"], "")])
def test_an_unknown_sink_names_the_valid_ones(sinks, hint):
    with pytest.raises(ConfigError) as error:
        LoggingConfig(report_to=sinks)
    message = str(error.value)
    assert message.startswith(f"logging.report_to={sinks!r}: unknown sink {sinks[-1]!r}{hint}:")
    assert "choose from tensorboard, wandb, mlflow" in message
    assert LoggingConfig().report_to == ["tensorboard", "wandb"]


@pytest.mark.parametrize("saved, report_to", [(True, ["tensorboard", "wandb"]),
                                              (False, ["wandb"])])
def test_configs_saved_with_the_retired_tensorboard_flag_still_load(saved, report_to):
    from pretrain.config import config_from_dict

    cfg = config_from_dict({"logging": {"tensorboard": saved, "wandb_mode": "offline"}})
    assert cfg.logging.report_to == report_to and cfg.logging.wandb_mode == "offline"
    assert "tensorboard" not in cfg.to_dict()["logging"]


class _Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("enabled, out_tty, err_tty, shown", [
    (True, True, True, True), (True, False, True, False), (True, True, False, False),
    (True, False, False, False), (False, True, True, False)])
def test_the_progress_bar_is_drawn_only_on_a_terminal(enabled, out_tty, err_tty, shown):
    from pretrain.log import show_progress_bar

    assert show_progress_bar(enabled, stdout=_Stream(out_tty), stderr=_Stream(err_tty)) is shown


def test_a_closed_or_plain_stream_is_not_a_terminal(tmp_path):
    import io

    from pretrain.log import show_progress_bar

    closed = open(tmp_path / "log", "w")
    closed.close()
    assert not show_progress_bar(True, stdout=closed, stderr=_Stream(True))
    assert not show_progress_bar(True, stdout=io.StringIO(), stderr=_Stream(True))


@pytest.fixture
def restore_log_level():
    yield
    from pretrain.log import set_log_level

    set_log_level("info")


@pytest.mark.parametrize("level, deepspeed_level, notes", [
    ("debug", logging.DEBUG, True), ("info", logging.WARNING, True),
    ("warning", logging.WARNING, False)])
def test_the_log_level_sets_deepspeeds_logger_and_our_notes(level, deepspeed_level, notes,
                                                            capsys, restore_log_level):
    from deepspeed.utils import logger as deepspeed_logger

    from pretrain.log import log, set_log_level

    set_log_level(level)
    assert deepspeed_logger.level == deepspeed_level
    assert {handler.level for handler in deepspeed_logger.handlers} == {deepspeed_level}
    assert deepspeed_logger.isEnabledFor(logging.INFO) is (level == "debug")
    log("[checkpoint] a note")
    log("warning: a warning", level="warning")
    log("[eval] a result", level="result")
    shown = capsys.readouterr().out.splitlines()
    assert shown == (["[checkpoint] a note"] if notes else []) + ["warning: a warning",
                                                                  "[eval] a result"]


def test_a_log_object_holds_its_own_threshold(capsys):
    """The level lives in a `Log` object: one at warning drops notes while the process's `LOG`,
    at its default, still prints them."""
    from pretrain.log import LOG, Log

    quiet = Log("warning")
    quiet.write("[checkpoint] dropped")
    quiet.write("warning: kept", level="warning")
    quiet.write("[run] not on this rank", main=False, level="result")
    LOG.write("[checkpoint] shown")
    assert LOG.level == "info"
    assert capsys.readouterr().out.splitlines() == ["warning: kept", "[checkpoint] shown"]


def test_train_takes_a_log_level_option():
    from pretrain.cli import build_parser

    assert build_parser().parse_args(["train", "--log-level", "warning"]).log_level == "warning"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--log-level", "loud"])


def _mlflow_runs(uri: str, experiment: str = "pretrain"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(experiment)
    return client, client.search_runs([experiment.experiment_id])


def test_the_mlflow_sink_logs_params_and_metrics_and_closes_the_run(tmp_path):
    from pretrain.config import RunConfig
    from pretrain.training.sinks import MetricsSink, mlflow_local_uri

    run_dir = tmp_path / "mlrun"
    run_dir.mkdir()
    cfg = RunConfig(run_dir=str(run_dir))
    cfg.logging.report_to = ["mlflow"]
    cfg.logging.mlflow_experiment = "ablations"  # not the default: the runs must be there
    sink = MetricsSink(run_dir, enabled=True, settings=cfg.logging, run_config=cfg.to_dict())
    sink.write({"kind": "run", "world_size": 1})
    sink.write({"kind": "train", "step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": None,
                "mfu": float("nan"), "skipped_steps": 0})
    sink.write({"kind": "train", "step": 2, "loss": 2.25, "lr": 5e-4, "grad_norm": 0.75,
                "mfu": 0.125, "skipped_steps": 0})
    sink.write({"kind": "eval", "step": 2, "loss": 2.0, "ppl": 7.5})
    sink.close(status="KILLED")  # stopped to be requeued
    sink.close(status="FINISHED")  # a second close changes nothing
    # the requeued job starts again in the same run directory: a run of its own, same name
    again = MetricsSink(run_dir, enabled=True, settings=cfg.logging, run_config=cfg.to_dict())
    again.write({"kind": "train", "step": 3, "loss": 2.0})
    again.close(status="FAILED")
    client, runs = _mlflow_runs(mlflow_local_uri(run_dir), "ablations")
    assert client.get_experiment_by_name("pretrain") is None
    assert sorted((r.info.run_name, r.info.status) for r in runs) == [("mlrun", "FAILED"),
                                                                      ("mlrun", "KILLED")]
    first, second = ({r.info.status: r for r in runs}[status] for status in ("KILLED", "FAILED"))

    def history(run, key):
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]

    assert history(first, "train/loss") == [(1, 2.5), (2, 2.25)]
    assert history(first, "train/grad_norm") == [(2, 0.75)]  # null and NaN are not metrics
    assert history(first, "train/mfu") == [(2, 0.125)]
    assert history(first, "eval/ppl") == [(2, 7.5)]
    assert history(second, "train/loss") == [(3, 2.0)]
    params = first.data.params
    assert params["train.lr"] == str(cfg.train.lr) and params["logging.report_to"] == '["mlflow"]'
    assert params["run_dir"] == str(run_dir) and params["model.preset"] == "null"


def test_the_mlflow_sink_reports_to_the_tracking_uri_it_is_given(tmp_path):
    """logging.mlflow_tracking_uri (a team's tracking server; here a SQLite store outside the run
    directory): the run is recorded there, and no store is made inside the run directory."""
    from pretrain.config import RunConfig
    from pretrain.training.sinks import MetricsSink

    run_dir, server = tmp_path / "run", tmp_path / "server"
    run_dir.mkdir()
    server.mkdir()
    uri = f"sqlite:///{server / 'tracking.db'}"
    cfg = RunConfig(run_dir=str(run_dir))
    cfg.logging.report_to = ["mlflow"]
    cfg.logging.mlflow_tracking_uri = uri
    sink = MetricsSink(run_dir, enabled=True, settings=cfg.logging, run_config=cfg.to_dict())
    sink.write({"kind": "train", "step": 1, "loss": 3.5})
    sink.close(status="FINISHED")
    client, runs = _mlflow_runs(uri)
    assert [(r.info.run_name, r.info.status) for r in runs] == [("run", "FINISHED")]
    assert [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id,
                                                                 "train/loss")] == [(1, 3.5)]
    assert not (run_dir / "mlruns").exists()


def test_a_failing_sink_is_turned_off_after_one_warning(tmp_path, monkeypatch, capsys):
    from pretrain.training import sinks

    class Broken:
        calls = 0

        def __init__(self, run_dir, **_):
            pass

        def log(self, numbers, step):
            Broken.calls += 1
            raise ConnectionError("tracking server gone")

        def close(self, status):
            raise AssertionError("a sink turned off is not closed")

    monkeypatch.setitem(sinks.SINKS, "mlflow", (Broken, ()))
    settings = LoggingConfig(report_to=["mlflow"])
    sink = sinks.MetricsSink(tmp_path, enabled=True, settings=settings, run_config={})
    for step in (1, 2, 3):
        sink.write({"kind": "train", "step": step, "loss": 1.0})
    sink.close()
    assert Broken.calls == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert capsys.readouterr().out.splitlines() == [
        "warning: [mlflow] off for the rest of the run: ConnectionError: tracking server gone"]


@pytest.mark.parametrize("mode, project, opened", [
    ("disabled", "llama", []), ("offline", "llama", ["offline"]), ("auto", "", ["offline"]),
    ("auto", "llama", ["online"]), ("online", "", ["online"])])
def test_the_wandb_sink_opens_in_the_configured_mode(tmp_path, monkeypatch, mode, project,
                                                     opened):
    """What the run opens, with the sink's class replaced by a recorder: logging.wandb_mode and
    logging.wandb_project decide whether wandb opens and in which mode."""
    from pretrain.training import sinks

    modes = []
    monkeypatch.setitem(sinks.SINKS, "wandb", (lambda *_, mode, **__: modes.append(mode),
                                               ("wandb",)))
    monkeypatch.setenv("WANDB_API_KEY", "k")
    settings = LoggingConfig(report_to=["wandb"], wandb_mode=mode, wandb_project=project)
    sinks._open_sinks(tmp_path, settings=settings, run_config={})
    assert modes == opened


def test_a_sink_whose_package_is_missing_is_an_error_before_the_run(monkeypatch):
    import importlib.util

    from pretrain.resolve.run_checks import check_sinks

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "alembic" else real(name, *a))
    check_sinks(["tensorboard", "wandb"])
    with pytest.raises(ConfigError, match=r"mlflow needs alembic, not installed here"):
        check_sinks(["tensorboard", "mlflow"])


@pytest.mark.slow
def test_training_reports_to_mlflow_and_draws_curves(tmp_path, tiny_data):
    from pretrain.training.sinks import mlflow_local_uri

    run = train(tmp_path, tiny_data, name="tracked",
                overrides=["train.steps=4", "train.eval_interval=2", "logging.report_to=[mlflow]",
                           "logging.curves=true"])
    client, runs = _mlflow_runs(mlflow_local_uri(run.run_dir))
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    assert f"[mlflow] sqlite:///{run.run_dir / 'mlruns' / 'mlflow.db'} run {run_id}" in run.stdout
    train_records = [r for r in run.records if r["kind"] == "train"]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == \
        [(r["step"], r["loss"]) for r in train_records] and len(train_records) == 4
    assert [m.step for m in client.get_metric_history(run_id, "eval/loss")] == [2, 4]
    assert runs[0].data.params["train.steps"] == "4"
    assert not (run.run_dir / "tensorboard").exists()  # report_to has no tensorboard
    # the run's curves drawn: data in each stacked panel (loss, learning rate, tokens/s)
    bands = coloured_pixels_per_band(run.run_dir / "curves.png", len(PANELS))
    assert all(n > 100 for n in bands), bands


@pytest.mark.slow
def test_log_level_warning_keeps_step_and_eval_lines_only(tmp_path, tiny_data):
    run_dir = tmp_path / "quiet"
    args = train_args(run_dir, tiny_data, overrides=[
        "train.steps=3", "train.eval_interval=3", "logging.progress_bar=true"]) + [
        "--log-level", "warning"]
    run = run_pretrain(args, run_dir=run_dir).check()
    lines = run.stdout.splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3",
                                                       "[eval] step 3"], run.stdout
    assert "[INFO]" not in run.stdout + run.stderr
    assert "train:" not in run.stderr  # stdout is a pipe: no progress bar


@pytest.mark.slow
def test_a_diverged_run_ends_its_mlflow_run_failed(tmp_path, tiny_data):
    from pretrain.errors import EXIT_FAULT
    from pretrain.training.sinks import mlflow_local_uri

    run_dir = tmp_path / "diverged"
    args = train_args(run_dir, tiny_data, overrides=[
        "train.steps=6", "train.max_nonfinite_steps=2", "logging.report_to=[mlflow]"])
    run = run_pretrain(args, run_dir=run_dir, env=nan_loss_environment({2, 3}, directory=tmp_path))
    assert run.returncode == EXIT_FAULT, run.stderr[-3000:]
    client, runs = _mlflow_runs(mlflow_local_uri(run_dir))
    assert [r.info.status for r in runs] == ["FAILED"]
    history = client.get_metric_history(runs[0].info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, run.records[1]["loss"])]  # NaNs: none
