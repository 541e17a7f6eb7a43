"""Where a run's records go: `metrics.jsonl` and the sinks of `logging.report_to` (TensorBoard,
wandb, MLflow), written by rank 0; what each record holds is `metrics.py`'s.

`metrics.jsonl` (rank 0, one JSON object per line, flushed as written) is the run's
machine-readable record. Fields:

``{"kind": "train", ...}`` once per optimizer step
    step, loss (mean over the global batch), lr, grad_norm (global, before clipping; null if
    DeepSpeed did not compute one), tokens_per_s (whole job), tflops_per_device (model FLOPs),
    mfu (model FLOPs utilisation against `peak_tflops`), hw_tflops_per_device and hfu (hardware
    FLOPs, counting the forward of recomputed layers), peak_mem_gb (this rank's allocator peak on
    GPUs; process peak RSS on CPU), peak_mem_gb_ranks (the same for every rank, in rank order),
    data_wait_s (time waiting for the data loader this step),
    step_time_s, consumed_samples, skipped_steps (cumulative, fp16 overflow), loss_scale (fp16),
    and on GPUs gpu_util_pct, gpu_temp_c, gpu_mem_used_gb (NVML, rank 0's device); update_skipped,
    nonfinite_steps, loss_spike, and the spike counts spikes_skipped, spikes_rolled_back,
    spikes_transient, samples_quarantined (`pretrain.training.spikes`); with straggler checks
    stragglers_named, and at a check straggler_max_slowdown and stragglers (the ranks named:
    rank, host, slowdown, compute_s, data_wait_s, collective_wait_s; `pretrain.training.stragglers`);
    with a mixture of experts moe_aux_loss and moe_z_loss (unweighted, mean per layer forward),
    moe_dropped_fraction, moe_load_max_mean_worst and per MoE layer the lists moe_expert_tokens,
    moe_load_max_mean, moe_dropped, moe_layer_aux_loss, moe_layer_z_loss, and under the sigmoid
    router moe_expert_bias (each expert's balancing bias after the step) (`pretrain.model.moe`).
``{"kind": "spike", ...}`` once per loss-spike rollback
    step, verdict (transient | data), to_step, samples (quarantined), hosts, replay_loss, counts.
``{"kind": "spike_summary", ...}`` last, when the run handled a spike: the spike counts.
``{"kind": "straggler_summary", ...}`` last, with straggler checks: slowest (rank, host,
    vs_median: own time over the run against the median rank's), stragglers_named.
``{"kind": "eval", ...}`` once per validation pass
    step, loss, ppl, tokens.
``{"kind": "tasks", ...}`` once per downstream evaluation (eval.tasks, `pretrain.evaluation`)
    step, one "<task>/<metric>" field per score (e.g. python_next_line/acc), seconds.
``{"kind": "run", ...}`` first line: world size, layout, parameters, peak_tflops, versions.

Each library is imported when its sink opens: a run that reports to none loads none of them.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from pretrain.config import LoggingConfig
from pretrain.errors import ConfigError
from pretrain.log import LOG, log
from pretrain.resolve.run_checks import SINK_PACKAGES


def resolve_wandb_mode(mode: str, *, project: str, env) -> str:
    """"auto": online when the user named a project and wandb has a key (WANDB_API_KEY, or the
    netrc entry `wandb login` writes), else offline."""
    if mode != "auto":
        return mode
    return "online" if project and (env.get("WANDB_API_KEY") or _wandb_login(env)) else "offline"


def _wandb_login(env) -> bool:
    """Whether `wandb login` stored a key for the wandb host in the netrc file ($NETRC, else
    $HOME/.netrc; nothing when neither is in `env`)."""
    import netrc
    from urllib.parse import urlparse

    path = env.get("NETRC") or (str(Path(env["HOME"]) / ".netrc") if env.get("HOME") else None)
    if not path or not Path(path).is_file():
        return False
    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (netrc.NetrcParseError, OSError):
        return False
    return bool(entry and entry[2])


class _TensorBoard:
    """Event files under <run_dir>/tensorboard."""

    def __init__(self, run_dir: Path, **_: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, numbers: dict[str, float], step: int) -> None:
        for key, value in numbers.items():
            self._writer.add_scalar(key, value, step)

    def close(self, status: str) -> None:
        self._writer.close()


class _Wandb:
    """A wandb run in `logging.wandb_mode` (see `resolve_wandb_mode`)."""

    def __init__(self, run_dir: Path, *, settings: LoggingConfig, run_config: dict[str, Any],
                 mode: str) -> None:
        import wandb

        self._run = wandb.init(project=settings.wandb_project or "pretrain", dir=str(run_dir),
                               mode=mode, config=run_config, name=run_dir.name,
                               settings=wandb.Settings(silent=True, console="off"))
        url = getattr(self._run, "url", None)
        log(f"[wandb] {mode}: {url or run_dir / 'wandb'}")

    def log(self, numbers: dict[str, float], step: int) -> None:
        self._run.log(numbers, step=step)

    def close(self, status: str) -> None:
        self._run.finish(exit_code=1 if status == "FAILED" else None)


def mlflow_local_uri(run_dir: Path) -> str:
    """The default MLflow store of a run: SQLite, <run_dir>/mlruns/mlflow.db. MLflow 3's own
    default is SQLite too; its file store (./mlruns) is in maintenance mode and refuses to open
    unless MLFLOW_ALLOW_FILE_STORE is set."""
    return "sqlite:///" + str((Path(run_dir) / "mlruns" / "mlflow.db").resolve())


def flatten_config(tree: dict[str, Any], *, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}: MLflow's params are flat."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, prefix=f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class _Mlflow:
    """An MLflow run named after the run directory, in experiment `logging.mlflow_experiment`:
    the flattened config as params, every numeric field of each record as a metric at its step.

    Each start of `pretrain train` is a run of its own (a resumed run may change the config, and
    MLflow refuses to change a logged param). MLflow's usage reports are off unless the user set
    MLFLOW_DISABLE_TELEMETRY: compute nodes are often offline.
    """

    def __init__(self, run_dir: Path, *, settings: LoggingConfig, run_config: dict[str, Any],
                 **_: Any) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        LOG.quiet_library("mlflow")  # importing mlflow set its logger to INFO
        local = not settings.mlflow_tracking_uri
        if local:
            (run_dir / "mlruns").mkdir(parents=True, exist_ok=True)
        self.uri = settings.mlflow_tracking_uri or mlflow_local_uri(run_dir)
        self._client = MlflowClient(tracking_uri=self.uri)
        experiment = self._experiment_id(
            settings.mlflow_experiment,
            artifacts=(run_dir / "mlruns" / "artifacts").resolve().as_uri() if local else None)
        self.run_id = self._client.create_run(experiment, run_name=run_dir.name).info.run_id
        self._log_params(flatten_config(run_config))
        log(f"[mlflow] {self.uri} run {self.run_id}")

    def _experiment_id(self, name: str, *, artifacts: str | None) -> str:
        """The experiment's id, created when missing (by another run at the same time too)."""
        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self._client.create_experiment(name, artifact_location=artifacts)
        except Exception:  # noqa: BLE001 - MlflowException: another run created it just now
            found = self._client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        entries = [Param(key, (value if isinstance(value, str) else json.dumps(value))
                         [:MAX_PARAM_VAL_LENGTH]) for key, value in params.items()]
        for start in range(0, len(entries), MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id,
                                   params=entries[start:start + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, numbers: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[
            Metric(key, float(value), now, step) for key, value in numbers.items()])

    def close(self, status: str) -> None:
        self._client.set_terminated(self.run_id, status=status)


# logging.report_to: each sink's class and the packages it needs (checked where the run's config
# is settled: `resolve.run_checks.check_sinks`)
SINKS = {name: (sink, SINK_PACKAGES[name]) for name, sink in
         (("tensorboard", _TensorBoard), ("wandb", _Wandb), ("mlflow", _Mlflow))}


def _open_sinks(run_dir: Path, *, settings: LoggingConfig,
                run_config: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, sink) of each sink of `settings.report_to` that is on (wandb_mode may disable
    wandb)."""
    wandb_mode = resolve_wandb_mode(settings.wandb_mode, project=settings.wandb_project,
                                    env=os.environ)
    sinks = []
    for name in settings.report_to:
        if name == "wandb" and wandb_mode == "disabled":
            continue
        sinks.append((name, SINKS[name][0](run_dir, settings=settings, run_config=run_config,
                                           mode=wandb_mode)))
    return sinks


class MetricsSink:
    """Writes records to metrics.jsonl and the sinks of `logging.report_to` (rank 0 only;
    no-op elsewhere).

    A sink that fails while the run goes on (a tracking server that went away) is turned off
    after one warning line: telemetry never stops a run. `close` ends every sink with the run's
    status (MLflow's FINISHED, KILLED for a stop to be requeued, FAILED).
    """

    def __init__(self, run_dir: Path, *, enabled: bool, settings: LoggingConfig,
                 run_config: dict[str, Any]):
        self.enabled, self._closed = enabled, False
        self._sinks: list[tuple[str, Any]] = []
        if not enabled:
            return
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._sinks = _open_sinks(run_dir, settings=settings, run_config=run_config)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        step = record.get("step")
        numbers = {f"{record['kind']}/{k}": v for k, v in clean.items()
                   if isinstance(v, (int, float)) and v is not None and k != "step"}
        if step is None or not numbers:
            return
        for name, sink in list(self._sinks):
            self._guarded(name, sink.log, numbers, step)

    def _guarded(self, name: str, action, *args: Any) -> None:
        """`action(*args)` of sink `name`; on an error the sink is dropped after one line."""
        try:
            action(*args)
        except Exception as exc:  # noqa: BLE001 - each library raises its own errors
            self._sinks = [(n, s) for n, s in self._sinks if n != name]
            log(f"warning: [{name}] off for the rest of the run: {type(exc).__name__}: "
                f"{str(exc)[:300]}", level="warning")

    def close(self, *, status: str = "FINISHED") -> None:
        """Flush and close every sink once; later calls do nothing."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        self._file.close()
        for name, sink in list(self._sinks):
            self._guarded(name, sink.close, status)
