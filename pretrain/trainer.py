"""The training loop: build the DeepSpeed engine, step, evaluate, log, checkpoint.

One optimizer step consumes one global batch of `micro_batch_size * grad_accum * dp` packed
samples in a fixed global order (`pretrain.data.DistributedPackedSampler`), so a run's data stream
does not depend on how many ranks it used. DeepSpeed owns sharding (ZeRO), mixed precision,
gradient accumulation and clipping; this module owns the schedule, the data, the telemetry and
when to save.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as torch_dist

# DeepSpeed 0.19.8's ZeRO-2 calls a torch.distributed function that torch 2.13 deprecates, once
# per rank per step: the warning is DeepSpeed's to fix and would bury the step lines.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated")

from pretrain import checkpoint, faults, telemetry
from pretrain.config import Precision, Recompute, RunConfig
from pretrain.data import Tokenizer
from pretrain.data.build import Samples, build_datasets
from pretrain.data.loader import micro_batches
from pretrain.dist import World
from pretrain.ds_config import offload_devices, zero_stage
from pretrain.errors import EXIT_REQUEUE, ConfigError, DataError
from pretrain.model import build_model
from pretrain.plan import hardware_flops_per_token
from pretrain.topology import ProcessGroups

DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16,
          Precision.FP16: torch.float16}


def warmup_cosine(update: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Learning rate of optimizer update number `update` (1-based).

    Linear warmup from lr/warmup to lr over the first `warmup` updates, then cosine decay from lr
    to min_lr at update `total` (and min_lr after it). Update 1 already learns: DeepSpeed's
    WarmupCosineLR would give it lr = 0.
    """
    if update <= warmup:
        return lr * update / warmup
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (linears, embeddings), none on vectors (RMSNorm gains)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def global_grad_norm(parameters, groups: ProcessGroups, *, device: str) -> float:
    """L2 norm of the whole model's gradient, each element counted once across the grid.

    Tensor-parallel shards (`tensor_model_parallel`) count on every TP rank; replicated weights
    (norms) on TP rank 0 only; a pipeline-tied weight (`ds_pipe_replicated`) on its first stage
    only; then the squares are summed over the model-parallel (TP x PP) group. DeepSpeed's own
    `clip_grad_norm_` counts replicated weights on model-parallel rank 0 only, which drops the
    norms of every later pipeline stage.
    """
    tp_rank0 = groups.topology.my_coords.tensor == 0
    total = torch.zeros((), device=device)
    for p in parameters:
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        if getattr(p, "tensor_model_parallel", False) or tp_rank0:
            total += p.grad.detach().float().pow(2).sum().to(device)
    if groups.topology.tensor * groups.topology.pipeline > 1:
        torch_dist.all_reduce(total, group=groups.model)
    return total.sqrt().item()


class _TimedBatches:
    """(input_ids, labels) pairs from a loader's batches (the tuple DeepSpeed's pipeline engine
    takes), adding up the time spent waiting for them in `wait`."""

    def __init__(self, batches: Iterator[dict[str, torch.Tensor]]):
        self.batches, self.wait = batches, 0.0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        batch = next(self.batches)
        self.wait += time.perf_counter() - start
        return batch["input_ids"], batch["labels"]


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # one per optimizer step of this process
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    final_step: int = 0
    final_dir: Path | None = None
    stop_reason: str | None = None  # set when a signal or time limit stopped the run early


class Trainer:
    def __init__(self, cfg: RunConfig, world: World, ds_config: dict[str, Any],
                 groups: ProcessGroups, *, resume: checkpoint.ResumePoint | None = None,
                 control: faults.RunControl | None = None):
        """`ds_config` is the resolved DeepSpeed config (`pretrain.ds_config.resolve_ds_config`);
        `groups` this rank's process groups (`pretrain.topology.Topology.create_groups`);
        `resume` the checkpoint to start from (`pretrain.checkpoint.find_resume`), whose
        `checkpoint.load_universal` the DeepSpeed config already carries when it is universal;
        `control` the signal / time-limit watcher (made here when None)."""
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        self.cfg, self.world, self.ds_config, self.groups = cfg, world, ds_config, groups
        self.main = world.is_main
        self.run_dir = Path(cfg.run_dir)
        self.device = get_accelerator().current_device_name()
        self.dp_size = cfg.data_parallel_size(world.world_size)
        # Ranks of one tensor-parallel group read the same samples: the data follows the dp index.
        self.dp_rank = groups.topology.my_coords.data
        self.grad_accum = cfg.grad_accum_steps(world.world_size)
        self.global_batch = cfg.global_batch_size(world.world_size)
        self.tokenizer, self.train_data, self.valid_data = self._load_data()

        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.run_dir / "config.yaml")
            (self.run_dir / "ds_config.json").write_text(
                json.dumps(self.ds_config, indent=2))

        t, p = cfg.train, cfg.parallel
        tp_group = groups.tensor if p.tensor > 1 else None
        self.pipelined = p.pipeline > 1
        if self.pipelined:
            from pretrain.model.pipeline import build_pipeline_model

            model = build_pipeline_model(
                cfg.model, seed=t.seed, num_stages=p.pipeline, topology=groups.topology,
                tp_group=tp_group, sequence_parallel=p.sequence_parallel,
                partition_method=p.pipeline_partition,
                activation_checkpoint_interval=int(
                    cfg.model.activation_checkpointing == Recompute.FULL))
            mpu = None  # a PipelineModule brings its own grid (DeepSpeed asserts mpu is None)
        else:
            model = build_model(cfg.model, seed=t.seed, tp_group=tp_group,
                                sequence_parallel=p.sequence_parallel)
            mpu = groups.mpu  # without it DeepSpeed treats every rank as data parallel
        if cfg.model.init_from:  # before DeepSpeed partitions (ZeRO-3) or copies the weights
            from pretrain.interop import load_initial_weights

            source = load_initial_weights(model, cfg=cfg.model, tp_group=tp_group)
            telemetry.log(f"[init] weights from {source}", main=self.main)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, t.weight_decay),
            config=self.ds_config, mpu=mpu,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                opt, lambda i: warmup_cosine(i + 1, lr=1.0, min_lr=t.min_lr / t.lr,
                                             warmup=t.warmup_steps, total=t.steps)))
        if self.dp_size == 1 and zero_stage(ds_config) == 0 and not self.pipelined:
            # One replica: DeepSpeed's bucketed gradient all-reduce would only copy gradients
            # in and out of flat buffers (measured ~2% of a step of the quickstart model).
            self.engine.enable_backward_allreduce = False
        self.step, self.consumed_samples = 0, 0
        # The pipeline engine steps inside train_batch: at ZeRO-0 it reports no norm (null).
        self._norm_before_step = zero_stage(ds_config) == 0 and not self.pipelined
        self._grad_norm: float | None = None
        if resume is not None:
            self._resume(resume)
        log = lambda text: telemetry.log(text, main=self.main)  # noqa: E731
        self.control = control or faults.RunControl(
            save_interval_minutes=cfg.checkpoint.save_interval_minutes,
            exit_after_minutes=t.exit_after_minutes)
        self.guard = faults.NonFiniteGuard(self.engine, max_in_a_row=t.max_nonfinite_steps,
                                           spike_factor=t.loss_spike_factor, device=self.device,
                                           rank=world.rank, log=log)
        self._git_commit = checkpoint.git_commit()  # recorded in every checkpoint's meta.json
        self.flops_per_token = cfg.model.flops_per_token()
        self.peak_tflops, self.peak_source = telemetry.device_peak_tflops(
            DTYPES[t.precision], cfg.logging.peak_tflops)
        self.metrics = telemetry.MetricsSink(
            self.run_dir, enabled=self.main, tensorboard=cfg.logging.tensorboard,
            wandb_mode=cfg.logging.wandb_mode, wandb_project=cfg.logging.wandb_project,
            run_config=cfg.to_dict())
        self._announce(model)

    # ---- setup ------------------------------------------------------------------------------
    def _load_data(self) -> tuple[Tokenizer, Samples, Samples | None]:
        d, m = self.cfg.data, self.cfg.model
        if not d.tokenizer:
            raise ConfigError("data.tokenizer is empty: set it to the .model file written by "
                              "`pretrain tokenizer` (or a Hugging Face tokenizer directory)")
        tokenizer = Tokenizer.load(d.tokenizer)
        if tokenizer.vocab_size != m.vocab_size:
            raise ConfigError(f"model.vocab_size={m.vocab_size} but the tokenizer {d.tokenizer!r} "
                              f"has {tokenizer.vocab_size} tokens: set "
                              f"model.vocab_size={tokenizer.vocab_size}")
        # Rank 0 builds (and caches) the sample indices; the others then load the cached files.
        if not self.main:
            torch_dist.barrier()
        train, valid = build_datasets(
            d, seq_length=m.seq_length, train_samples=self.cfg.train.steps * self.global_batch,
            with_valid=self.cfg.train.eval_interval > 0,
            log=lambda message: telemetry.log(message, main=self.main))
        if self.main:
            torch_dist.barrier()
        return tokenizer, train, valid

    def _loader(self, dataset: Samples, *, consumed: int,
                workers: int) -> Iterator[dict[str, torch.Tensor]]:
        return micro_batches(dataset, micro_batch_size=self.cfg.train.micro_batch_size,
                             dp_rank=self.dp_rank, dp_size=self.dp_size,
                             consumed_samples=consumed, workers=workers,
                             pin_memory=self.device.startswith("cuda"))

    def _resume(self, point: checkpoint.ResumePoint) -> None:
        start = time.perf_counter()
        checkpoint.load(self.engine, point, rank=self.world.rank, world_size=self.world.world_size)
        self.step, self.consumed_samples = point.step, point.meta["consumed_samples"]
        if point.meta["global_batch"] != self.global_batch:
            raise ConfigError(f"{point.path} was trained with a global batch of "
                              f"{point.meta['global_batch']}, this run has {self.global_batch}: set "
                              f"train.global_batch_size={point.meta['global_batch']}")
        telemetry.log(f"[resume] from {point.path} at step {self.step} ({self.consumed_samples} "
                      f"samples consumed{', universal' if point.universal else ''}) in "
                      f"{time.perf_counter() - start:.1f}s", main=self.main)

    def _announce(self, model: torch.nn.Module) -> None:
        cfg, w = self.cfg, self.world
        stage = zero_stage(self.ds_config)
        opt_dev, param_dev = offload_devices(self.ds_config)
        n_params = cfg.model.num_parameters()
        self.metrics.write({"kind": "run", "world_size": w.world_size, "launcher": w.launcher,
                            "tensor": cfg.parallel.tensor, "pipeline": cfg.parallel.pipeline,
                            "data_parallel": self.dp_size, "zero_stage": stage,
                            "parameters": n_params, "global_batch": self.global_batch,
                            "grad_accum": self.grad_accum, "precision": cfg.train.precision.value,
                            "peak_tflops": self.peak_tflops, "peak_source": self.peak_source,
                            "deepspeed_config": cfg.deepspeed,
                            "torch": torch.__version__,
                            "deepspeed": __import__("deepspeed").__version__})
        telemetry.log(
            f"[run] {n_params / 1e6:.1f}M parameters | world {w.world_size} ({w.launcher}) = "
            f"tp {cfg.parallel.tensor} x pp {cfg.parallel.pipeline} x dp {self.dp_size} | "
            f"ZeRO-{stage} offload opt={opt_dev} param={param_dev} | {cfg.train.precision.value} | "
            f"global batch {self.global_batch} = micro {cfg.train.micro_batch_size} x accum "
            f"{self.grad_accum} x dp {self.dp_size} | {len(self.train_data)} train samples of "
            f"{cfg.model.seq_length} tokens | peak {self.peak_tflops:.2f} TFLOP/s/device "
            f"({self.peak_source}) | run dir {self.run_dir}", main=self.main)

    # ---- the loop -----------------------------------------------------------------------------
    def _mean_over_dp(self, value: torch.Tensor) -> float:
        value = value.detach().float().to(self.device)
        if self.dp_size > 1:
            torch_dist.all_reduce(value, group=self.groups.data)
            value /= self.dp_size
        return value.item()

    def train_step(self, batches: Iterator[dict[str, torch.Tensor]]) -> tuple[float, float]:
        """One optimizer step over `grad_accum` micro-batches; returns (mean loss, data wait)."""
        timed = _TimedBatches(batches)
        if self.pipelined:  # DeepSpeed's 1F1B schedule pulls the micro-batches itself
            loss = self.engine.train_batch(data_iter=timed)
            return self._mean_over_dp(loss), timed.wait
        engine, total = self.engine, torch.zeros((), device=self.device)
        self._grad_norm = None
        for micro in range(self.grad_accum):
            input_ids, labels = next(timed)
            loss = engine(input_ids.to(self.device, non_blocking=True),
                          labels=labels.to(self.device, non_blocking=True))
            loss = self.guard.maybe_inject(loss, step=self.step + 1, micro=micro)
            engine.backward(loss)
            if self._norm_before_step and micro == self.grad_accum - 1:
                # DeepSpeed clips without keeping the norm at ZeRO-0: measure the reduced grads.
                self._grad_norm = global_grad_norm(engine.module.parameters(), self.groups,
                                                   device=self.device)
            engine.step()
            total += loss.detach().float()
        return self._mean_over_dp(total / self.grad_accum), timed.wait

    @torch.no_grad()
    def evaluate(self) -> float:
        assert self.valid_data is not None
        self.engine.eval()
        batches = self._loader(self.valid_data, consumed=0, workers=0)
        # `eval_batches` global batches, read in the training order: the same samples whatever
        # the layout, since the global batch is (each rank: accum micro-batches per batch).
        n = min(self.cfg.train.eval_batches,
                max(1, len(self.valid_data) // self.global_batch)) * self.grad_accum
        pairs = _TimedBatches(batches)
        if self.pipelined:  # the inference schedule; the loss comes back on every stage
            loss = self.engine.eval_batch(pairs, num_micro_batches=n)
            self.engine.train()
            return self._mean_over_dp(loss)
        total = torch.zeros((), device=self.device)
        for _ in range(n):
            input_ids, labels = next(pairs)
            total += self.engine(input_ids.to(self.device), labels=labels.to(self.device)).float()
        self.engine.train()
        return self._mean_over_dp(total / n)

    def train(self) -> TrainResult:
        from tqdm import tqdm

        cfg, t = self.cfg, self.cfg.train
        result = TrainResult()
        if self.main:
            checkpoint.clear_stopped(self.run_dir)
        batches = self._loader(self.train_data, consumed=self.consumed_samples,
                               workers=cfg.data.num_workers)
        tokens_per_step = self.global_batch * cfg.model.seq_length
        bar = tqdm(total=t.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (self.main and cfg.logging.progress_bar))
        profiler = telemetry.StepProfiler(cfg.logging.profile_range(), run_dir=self.run_dir,
                                          rank=self.world.rank)
        while self.step < t.steps:
            profiler.begin(self.step + 1)
            start = time.perf_counter()
            lr = self.engine.get_lr()[0]  # the rate this update uses (the scheduler steps inside)
            skipped_before = self.engine.skipped_steps
            loss, wait = self.train_step(batches)
            self.step += 1
            self.consumed_samples += self.global_batch
            elapsed = time.perf_counter() - start
            if profiler.end(self.step):
                telemetry.log(f"[profile] Chrome trace of steps {cfg.logging.profile_steps} in "
                              f"{profiler.path}", main=self.main)
            result.losses.append(loss)
            rec = self._step_record(loss=loss, lr=lr, wait=wait, elapsed=elapsed,
                                    tokens=tokens_per_step)
            rec.update(self.guard.after_step(step=self.step, loss=loss,
                                              skipped_before=skipped_before))
            self.metrics.write(rec)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            if self.main and (self.step % cfg.logging.log_interval == 0 or self.step == t.steps):
                bar.write(telemetry.format_step_line(rec, t.steps))
            if self.valid_data is not None and t.eval_interval and (
                    self.step % t.eval_interval == 0 or self.step == t.steps):
                self._log_eval(result)
            stop, save_due = self.control.poll(device=self.device)  # same on every rank
            if stop and self.step < t.steps:
                result.stop_reason = stop
                telemetry.log(f"[stop] {stop}: saving step {self.step}, then exiting to be "
                              "requeued", main=self.main)
                self.save()
                if self.main:
                    checkpoint.mark_stopped(self.run_dir, step=self.step, reason=stop,
                                            exit_code=EXIT_REQUEUE)
                break
            if (save_due or cfg.checkpoint.save_interval
                    and self.step % cfg.checkpoint.save_interval == 0) and self.step < t.steps:
                self.save()
        bar.close()
        self.control.restore_handlers()
        result.final_step = self.step
        if result.stop_reason:
            self.metrics.close()
            return result
        if cfg.checkpoint.save_final:
            self.save()
            result.final_dir = checkpoint.save_final(
                self.engine, cfg=cfg, groups=self.groups, tokenizer=self.tokenizer,
                run_dir=self.run_dir,
                step=self.step, main=self.main)
            telemetry.log(f"[checkpoint] final weights in {result.final_dir}", main=self.main)
        self.metrics.close()
        return result

    def _step_record(self, *, loss: float, lr: float, wait: float, elapsed: float,
                     tokens: int) -> dict[str, Any]:
        engine = self.engine
        grad_norm = engine.get_global_grad_norm()
        if grad_norm is None:
            grad_norm = self._grad_norm
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.item()
        tokens_per_s = tokens / elapsed
        per_device = tokens_per_s / self.world.world_size
        hardware_flops = hardware_flops_per_token(self.cfg.model)  # + recomputed forwards
        rec: dict[str, Any] = {
            "kind": "train", "step": self.step, "loss": loss,
            "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
            "tflops_per_device": self.flops_per_token * tokens_per_s / self.world.world_size / 1e12,
            "mfu": telemetry.mfu(flops_per_token=self.flops_per_token,
                                 tokens_per_s_per_device=tokens_per_s / self.world.world_size,
                                 peak_tflops=self.peak_tflops),
            "hw_tflops_per_device": hardware_flops * per_device / 1e12,
            "hfu": telemetry.mfu(flops_per_token=hardware_flops, tokens_per_s_per_device=per_device,
                                 peak_tflops=self.peak_tflops),
            "peak_mem_gb": telemetry.peak_memory_gb(),
            "peak_mem_gb_ranks": telemetry.peak_memory_all_ranks(self.device),
            "data_wait_s": wait, "step_time_s": elapsed,
            "consumed_samples": self.consumed_samples, "skipped_steps": engine.skipped_steps,
        }
        if self.cfg.train.precision == Precision.FP16:
            rec["loss_scale"] = float(getattr(engine.optimizer, "cur_scale", float("nan")))
        if self.main:
            rec.update(telemetry.gpu_stats())  # NVML utilisation / temperature / memory on GPUs
        return rec

    def _log_eval(self, result: TrainResult) -> None:
        loss = self.evaluate()
        result.eval_losses.append((self.step, loss))
        ppl = math.exp(min(loss, 50.0))
        self.metrics.write({"kind": "eval", "step": self.step, "loss": loss, "ppl": ppl})
        telemetry.log(f"[eval] step {self.step} | valid loss {loss:.4f} | ppl {ppl:.2f}",
                      main=self.main)

    def save(self) -> None:
        """A checkpoint of this step (collective): DeepSpeed's state plus ours (`meta.json`)."""
        cfg, topo = self.cfg, self.groups.topology
        state = {"step": self.step, "consumed_samples": self.consumed_samples,
                 "config": cfg.to_dict(),
                 "tokenizer": {"path": str(self.tokenizer.path), "sha256": self.tokenizer.sha256}}
        meta = {**state, "global_batch": self.global_batch, "git_commit": self._git_commit,
                "layout": {"tensor": topo.tensor, "pipeline": topo.pipeline, "data": self.dp_size,
                           "world_size": self.world.world_size,
                           "zero_stage": zero_stage(self.ds_config)},
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        start = time.perf_counter()
        path = checkpoint.save(self.engine, ckpt_dir=self.run_dir / "checkpoints", meta=meta,
                               client_state=state, keep_last=cfg.checkpoint.keep_last,
                               keep_every=cfg.checkpoint.keep_every, rank=self.world.rank)
        self.control.mark_saved()
        telemetry.log(f"[checkpoint] {path} in {time.perf_counter() - start:.1f}s", main=self.main)
