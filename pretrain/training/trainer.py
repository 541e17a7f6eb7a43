"""The training loop: step, evaluate, log, checkpoint.

One optimizer step consumes one global batch of `micro_batch_size * grad_accum * dp` packed
samples in a fixed global order (`pretrain.data.DistributedPackedSampler`), so a run's data stream
does not depend on how many ranks it used. The engine comes from `pretrain.training.engine`; this module
owns the loop, the data, the telemetry and when to save.
"""
from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator
from tqdm import tqdm

from pretrain import checkpoint
from pretrain.checkpoint.store import recorded_config
from pretrain.config import Precision
from pretrain.data import Tokenizer
from pretrain.data.build import Samples, build_datasets
from pretrain.data.loader import micro_batches
from pretrain.data.samples import stream_numbers
from pretrain.dist import World, same_on_every_rank, wait_for_io
from pretrain.errors import EXIT_REQUEUE, ConfigError
from pretrain.files import git_commit
from pretrain.hardware import PrecisionChoice
from pretrain.log import log, show_progress_bar
from pretrain.model import ModelForm, compile_report, moe, mtp
from pretrain.resolve.batch_ramp import RampSchedule
from pretrain.resolve.run import ResolvedRun
from pretrain.resolve.topology import ProcessGroups
from pretrain.training import curves, faults, hang, spikes, stragglers
from pretrain.training.engine import (TimedBatches, build_engine, engine_loss,
                                      set_step_micro_batches)
from pretrain.training.evaluators import TaskEvaluator, ValidationLoss
from pretrain.training.loop_state import LoopState, Position
from pretrain.training.metrics import StepRecords, announce_run, format_step_line, global_grad_norm
from pretrain.training.memory_snapshot import MemorySnapshots
from pretrain.training.profiler import StepProfiler
from pretrain.training.sinks import MetricsSink

@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # one per optimizer step of this process
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    final_step: int = 0
    final_dir: Path | None = None
    stop_reason: str | None = None  # set when a signal or time limit stopped the run early


class Trainer:
    def __init__(self, run: ResolvedRun, world: World, groups: ProcessGroups, *,
                 resume: checkpoint.ResumePoint | None, control: faults.RunControl):
        """`run` is the resolved run (`pretrain.resolve.run.resolve_run`: its frozen config, layout and
        DeepSpeed config); `groups` this rank's process groups (`run.topology.create_groups()`);
        `resume` the checkpoint to start from, its content confirmed
        (`pretrain.checkpoint.confirm_content`), whose `checkpoint.load_universal` the DeepSpeed
        config already carries when it is universal; `control` the signal / time-limit / save
        cadence watcher the process made first thing."""
        cfg, ds_config = run.cfg, run.ds_config
        self.cfg, self.world, self.ds_config, self.groups = cfg, world, ds_config, groups
        self.main = world.is_main
        self.run_dir = Path(cfg.run_dir)
        # the config as recorded: a run in the object store names its URL, not this node's copy
        self.recorded_cfg = recorded_config(cfg)
        self.device = get_accelerator().current_device_name()
        self.layout = run.layout
        self._agree_on_precision(run.precision)
        self.dp_size, self.grad_accum = self.layout.data, self.layout.grad_accum
        self.global_batch = self.layout.global_batch  # the full size (a ramp's last)
        # train.batch_ramp: each step's global batch, from the samples consumed before it
        self.batch_sizes = RampSchedule.of(cfg, self.global_batch)
        self.step_batch = self.global_batch  # the global batch of the step being run
        # Ranks of one tensor-parallel group read the same samples: the data follows the dp index;
        # the ranks of one context group read the same samples too, each its chunk of them.
        self.dp_rank = groups.topology.my_coords.data
        self.context_rank, self.context_size = groups.topology.my_coords.context, \
            groups.topology.context
        # a loss is averaged over every replica (data x context: each context rank's loss is
        # its chunk's share of the mean, times parallel.context)
        self.replicas = groups.topology.replicas
        self.tokenizer, self.train_data, self.valid_data = self._load_data()
        if self.main:
            self._write_run_configs()
        self.engine = build_engine(cfg, ds_config, groups, main=self.main)
        self.pipelined = ModelForm.of(self.engine) is ModelForm.PIPELINE
        # the step, samples consumed, newest checkpoint's step, the running step's sample numbers
        # and this replica's loss of it: what a rollback (`pretrain.training.spikes`) moves too
        self.position = Position()
        self._steps_run = 0  # steps completed by this process (a stop waits for the first)
        self.saver = checkpoint.Saver(self.engine, ckpt_dir=self.run_dir / "checkpoints",
                                      keep_last=cfg.checkpoint.keep_last,
                                      keep_every=cfg.checkpoint.keep_every, rank=world.rank,
                                      background=cfg.checkpoint.async_save)
        self._save_started = 0.0  # perf_counter of the save in flight
        # The pipeline engine steps inside train_batch: at ZeRO-0 it reports no norm (null).
        self._norm_before_step = self.layout.zero_stage == 0 and not self.pipelined
        self._grad_norm: float | None = None
        self.checkpoint_layout = run.checkpoint_layout
        # what a loss spike does, and the sample numbers the data stream leaves out
        self.spikes = spikes.LossSpikes(cfg.train.on_loss_spike, excluded=cfg.data.exclude_samples)
        self._spike_skipped = False  # the last step's update was dropped for a spike
        if resume is not None:
            self._resume(resume)
        self.control = control
        control.schedule(save_interval_steps=cfg.checkpoint.save_interval,
                         save_interval_minutes=cfg.checkpoint.save_interval_minutes,
                         exit_after_minutes=cfg.train.exit_after_minutes)
        self.watchdog, self.guard, self.stragglers = self._watchers()
        if self.pipelined:  # DeepSpeed's schedule runs the micro-batches: every stage beats
            # as each forward of its own ends (middle stages read no data to beat on)
            self.engine.module.register_forward_hook(lambda *_: self.watchdog.beat())
        self._git_commit = git_commit()  # recorded in every checkpoint's meta.json
        self.records = StepRecords(cfg, world_size=world.world_size, device=self.device,
                                   main=self.main)
        self.metrics = MetricsSink(self.run_dir, enabled=self.main, settings=cfg.logging,
                                   run_config=self.recorded_cfg.to_dict())
        self._curves_step: int | None = None  # the step curves.png shows; -1: drawing failed
        self.state = self._loop_state()  # what the rollback and the evaluations take
        self.validation = ValidationLoss(self.state)  # every train.eval_interval steps and the last
        self.tasks = TaskEvaluator(self.state)  # eval.tasks (lm-eval), after the steps it is due
        announce_run(self.metrics, cfg, world, self.engine, self.records, layout=self.layout,
                     train_data=self.train_data, run_dir=self.run_dir
                     if self.recorded_cfg.run_dir == cfg.run_dir else
                     f"{self.recorded_cfg.run_dir} (this node's copy: {self.run_dir})")
        if self.batch_sizes.ramp is not None:
            ramp = self.batch_sizes.ramp
            log(f"[batch ramp] global batch {ramp.start} growing by {ramp.increment} over the "
                f"first {ramp.samples} samples to {self.global_batch} (sizes "
                f"{', '.join(map(str, self.batch_sizes.sizes()))}; this step's: "
                f"{self.batch_sizes.size_at(self.consumed_samples)})", main=self.main)

    # ---- setup ------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The last finished optimizer step."""
        return self.position.step

    @step.setter
    def step(self, value: int) -> None:
        self.position.step = value

    @property
    def consumed_samples(self) -> int:
        """Global samples the finished steps read."""
        return self.position.consumed_samples

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        self.position.consumed_samples = value

    def _loop_state(self) -> LoopState:
        """The run as a spike's rollback and the evaluations see it: its pieces and the loop's
        position, shared (a rollback moves this trainer's step)."""
        return LoopState(
            cfg=self.cfg, position=self.position, engine=self.engine, device=self.device,
            main=self.main, rank=self.world.rank, world_size=self.world.world_size,
            groups=self.groups, run_dir=self.run_dir, checkpoint_layout=self.checkpoint_layout,
            global_batch=self.global_batch, grad_accum=self.grad_accum, pipelined=self.pipelined,
            train_data=self.train_data, valid_data=self.valid_data, tokenizer=self.tokenizer,
            watchdog=self.watchdog, guard=self.guard, control=self.control, metrics=self.metrics,
            spikes=self.spikes, loader=self._loader, train_step=self._replay_step,
            finish_save=self._finish_save, mean_over_dp=self._mean_over_dp,
            draw_curves=self._draw_curves)

    def _watchers(self) -> tuple[hang.Watchdog, faults.NonFiniteGuard, stragglers.StragglerWatch]:
        """What watches every step of this rank: the hang watchdog (started with the loop: a rank
        without progress for train.hang_timeout_minutes is named), the non-finite and spike
        guard, the straggler check."""
        cfg, world = self.cfg, self.world
        warn = functools.partial(log, main=self.main, level="warning")
        watchdog = hang.Watchdog(
            timeout_minutes=cfg.train.hang_timeout, rank=world.rank, world_size=world.world_size,
            run_dir=self.run_dir, store=hang.default_store() if world.world_size > 1 else None,
            control=self.control, log=lambda line: log(line, level="warning"),
            on_verdict=self._record_hang, saver=self.saver)
        guard = faults.NonFiniteGuard(
            self.engine, max_in_a_row=cfg.train.max_nonfinite_steps,
            spike_factor=cfg.train.loss_spike_factor, device=self.device, rank=world.rank,
            log=warn, spikes_kept_out=self.spikes.action is not spikes.SpikeAction.LOG)
        watch = stragglers.StragglerWatch(
            interval=cfg.train.straggler_interval, margin=cfg.train.straggler_margin,
            patience=cfg.train.straggler_patience, rank=world.rank, log=warn)
        return watchdog, guard, watch

    def _agree_on_precision(self, choice: PrecisionChoice) -> None:
        """Every rank must have chosen the same precision (ranks on different CPUs might not);
        then the run says which and why."""
        if not same_on_every_rank(list(Precision).index(choice.precision)):
            raise ConfigError(f"train.precision=auto chose {choice.precision.value} on rank "
                              f"{self.world.rank} ({choice.reason}) but not on every rank: the "
                              "ranks run on different hardware; set train.precision explicitly")
        log(f"[precision] {choice.precision.value}: {choice.reason}", main=self.main)
        if choice.warning:
            log(f"warning: {choice.warning}", main=self.main, level="warning")

    def _load_data(self) -> tuple[Tokenizer, Samples, Samples | None]:
        d, m = self.cfg.data, self.cfg.model
        tokenizer = Tokenizer.load(d.tokenizer)
        # Rank 0 builds (and caches) the sample indices; the others then load the cached files.
        if not self.main:
            wait_for_io()
        train, valid = build_datasets(
            d, seq_length=m.seq_length,
            train_samples=self.batch_sizes.samples_for(self.cfg.train.steps),
            with_valid=self.cfg.train.eval_interval > 0,
            log=lambda message: log(message, main=self.main))
        if self.main:
            wait_for_io()
        return tokenizer, train, valid

    def _loader(self, dataset: Samples, *, consumed: int,
                workers: int) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches of `dataset` from `consumed` on; the training data leaves out the
        quarantined sample numbers (`pretrain.training.spikes`), the validation data nothing."""
        skip = self.spikes.quarantine if dataset is self.train_data else ()
        return micro_batches(dataset, micro_batch_size=self.cfg.train.micro_batch_size,
                             dp_rank=self.dp_rank, dp_size=self.dp_size,
                             consumed_samples=consumed, workers=workers,
                             pin_memory=self.device.startswith("cuda"),
                             context_rank=self.context_rank, context_size=self.context_size,
                             skip=skip, document_eod=self._document_eod(),
                             head_tail=self.cfg.parallel.context_kind == "allgather")

    def _document_eod(self) -> int | None:
        """The end-of-document id the loader marks documents by (data.document_mask)."""
        if not self.cfg.data.document_mask:
            return None
        if self.tokenizer.eos_id < 0:
            raise ConfigError(f"data.document_mask needs the tokenizer's end-of-document token, "
                              f"and {self.cfg.data.tokenizer!r} has none: use the tokenizer the "
                              "dataset was preprocessed with, or set data.document_mask=false")
        return self.tokenizer.eos_id

    def _resume(self, point: checkpoint.ResumePoint) -> None:
        start = time.perf_counter()
        change = checkpoint.load(self.engine, point, cfg=self.cfg, groups=self.groups,
                                 layout=self.checkpoint_layout, rank=self.world.rank)
        self.step, self.consumed_samples = point.step, point.meta["consumed_samples"]
        self.position.saved_step = point.step
        self.spikes.resume(point.meta)
        if point.meta["global_batch"] != self.global_batch:
            raise ConfigError(f"{point.path} was trained with a global batch of "
                              f"{point.meta['global_batch']}, this run has {self.global_batch}: set "
                              f"train.global_batch_size={point.meta['global_batch']}")
        how = (", universal" if point.universal else "") + (f", resharded {change}" if change
                                                             else "")
        log(f"[resume] from {point.path} at step {self.step} ({self.consumed_samples} "
                      f"samples consumed{how}) in {time.perf_counter() - start:.1f}s",
                      main=self.main)

    def _write_run_configs(self) -> None:
        """The run's config and resolved DeepSpeed config, next to its checkpoints."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.recorded_cfg.save(self.run_dir / "config.yaml")
        (self.run_dir / "ds_config.json").write_text(json.dumps(self.ds_config, indent=2))

    # ---- the loop -----------------------------------------------------------------------------
    def _mean_over_dp(self, value: torch.Tensor) -> float:
        value = value.detach().float().to(self.device)
        if self.replicas > 1:
            torch_dist.all_reduce(value, group=self.groups.data)
            value /= self.replicas
        return value.item()

    def _step_loss(self, local: torch.Tensor) -> float:
        """The step's loss, the mean over replicas of each replica's `local` loss (through
        the spike seam); this replica's share is kept for a rollback's replay."""
        local = self.spikes.observed_loss(local.detach().float(), step=self.step + 1,
                                          samples=self.position.step_samples,
                                          dp_rank=self.dp_rank)
        if self.spikes.rolls_back:  # a host sync only where a replay may compare it
            self.position.local_loss = local.item()
        return self._mean_over_dp(local)

    def train_step(self, batches: Iterator[dict[str, torch.Tensor]]) -> tuple[float | None, float]:
        """One optimizer step over `grad_accum` micro-batches; returns (mean loss, data wait).
        The loss is None when a stop request came between two micro-batches: the partial step
        is abandoned (`pretrain.training.faults`: the engine state is still the last completed step's).
        With train.on_loss_spike=skip a spike's update is dropped (`pretrain.training.spikes`)."""
        timed = TimedBatches(batches)
        self.step_batch = self.batch_sizes.size_at(self.consumed_samples)
        accum = self.step_batch // (self.cfg.train.micro_batch_size * self.dp_size)
        ramped = self.batch_sizes.ramp is not None
        if ramped:
            set_step_micro_batches(self.engine, accum)
        self.position.step_samples = stream_numbers(self.consumed_samples, self.step_batch,
                                                    skip=self.spikes.quarantine)
        self._spike_skipped = False
        if self.pipelined:  # DeepSpeed's 1F1B schedule pulls the micro-batches itself
            loss = self.engine.train_batch(data_iter=self._pipeline_micro_batches(timed))
            return self._step_loss(loss), timed.wait
        engine, total = self.engine, torch.zeros((), device=self.device)
        self._grad_norm = None
        mean = None
        for micro in range(accum):
            # one small all-reduce per micro-batch; a stop waits for this process's first step,
            # so that a signal or time limit during start-up still saves a step
            if micro and self._steps_run and self.control.stop_agreed():
                return None, timed.wait
            inputs, labels = next(timed)
            self.control.micro_batch_started("step", step=self.step + 1, micro=micro,
                                      rank=self.world.rank)
            if ramped:  # DeepSpeed's own count of micro-batches is off once a size changed
                engine.set_gradient_accumulation_boundary(micro == accum - 1)
            loss = engine_loss(engine, inputs, labels, self.device, non_blocking=True)
            loss = self.guard.corrupt_loss(loss, step=self.step + 1, micro=micro)
            total += loss.detach().float()
            if self.spikes.skips and micro == accum - 1:
                # the loss is known before the update: a spike takes the non-finite path
                mean = self._step_loss(total / accum)
                if self.guard.is_spike(mean):
                    self._spike_skipped = True
                    loss = loss * float("nan")
            engine.backward(loss)
            if self._norm_before_step and micro == accum - 1:
                # DeepSpeed clips without keeping the norm at ZeRO-0: measure the reduced grads.
                self._grad_norm = global_grad_norm(engine.module.parameters(), self.groups,
                                                   device=self.device)
            engine.step()
            self.control.micro_batch_done()
            self.watchdog.beat()
        if mean is None:
            mean = self._step_loss(total / accum)
        return mean, timed.wait

    def _pipeline_micro_batches(self, pairs: TimedBatches) -> Iterator:
        """The (inputs, labels) pairs of a pipeline step, each announced to the run control's
        seam as DeepSpeed's schedule takes it (on the first and last stages, which read data),
        as a flat step announces its micro-batches."""
        for micro, pair in enumerate(pairs):
            self.control.micro_batch_started("step", step=self.step + 1, micro=micro,
                                             rank=self.world.rank)
            yield pair

    def train(self) -> TrainResult:
        """Train to train.steps or a stop request. The metric sinks are closed on every way out:
        a run that raised is FAILED in MLflow (KILLED when interrupted)."""
        self.watchdog.start()
        try:
            return self._train()
        except BaseException as exc:
            self.metrics.close(status="FAILED" if isinstance(exc, Exception) else "KILLED")
            raise
        finally:
            self.watchdog.stop()
            self.stragglers.close()

    def _record_hang(self, record: dict[str, Any]) -> None:
        """The hang verdict's record (rank 0's watchdog, just before the process exits)."""
        if record:
            self.metrics.write(record)
        self.metrics.close(status="FAILED")

    def _train(self) -> TrainResult:
        result = TrainResult()
        if self.main:
            checkpoint.clear_stopped(self.run_dir)
        batches = self._loader(self.train_data, consumed=self.consumed_samples,
                               workers=self.cfg.data.num_workers)
        bar = self._progress_bar()
        profiler = StepProfiler(self.cfg.logging.profile_range(), run_dir=self.run_dir,
                                          rank=self.world.rank)
        snapshots = MemorySnapshots(self.cfg.logging.memory_snapshot, run_dir=self.run_dir,
                                    rank=self.world.rank, device_type=torch.device(self.device).type,
                                    main=self.main)
        while self.step < self.cfg.train.steps:
            with snapshots.recording():
                record = self._run_step(batches, profiler, result)
            snapshots.after_step(self.step)
            if record is None:  # a stop request inside the step: the partial step is abandoned
                self._stop(result, self.control.poll(device=self.device).stop)
                break
            self._show_step(record, bar)
            if record["loss_spike"] and self.spikes.rolls_back:
                batches = spikes.roll_back(self.state, batches, record=record, losses=result.losses)
                if self.step < record["step"]:  # back at the checkpoint (or stopped in replay)
                    continue
            self.validation.after_step(self.step, result.eval_losses)
            self.tasks.after_step(self.step)
            if self._stop_or_save(result):
                break
        bar.close()
        batches.close()  # the loader's worker processes end here, not at interpreter exit
        self.control.restore_handlers()
        return self._finish(result)

    def _progress_bar(self) -> tqdm:
        show = self.main and show_progress_bar(self.cfg.logging.progress_bar)
        return tqdm(total=self.cfg.train.steps, initial=self.step, desc="train", unit="step",
                    dynamic_ncols=True, disable=not show)

    def _run_step(self, batches: Iterator[dict[str, torch.Tensor]],
                  profiler: StepProfiler, result: TrainResult) -> dict[str, Any] | None:
        """One optimizer step, profiled and timed; its loss into `result`; its step record,
        written to the metric sinks (the non-finite guard's fields in it). None when a stop
        request abandoned the step."""
        profiler.begin(self.step + 1)
        start = time.perf_counter()
        lr = self.engine.get_lr()[0]  # the rate this update uses (the scheduler steps inside)
        skipped_before = self.engine.skipped_steps
        self.stragglers.begin_step(self.step + 1)
        self._begin_router_step()
        loss, wait = self.train_step(batches)
        if loss is None:  # stopped inside the step (`RunControl.stop_agreed`)
            return None
        self.step += 1
        self._steps_run += 1
        self.watchdog.beat(self.step)
        self.consumed_samples += self.step_batch
        elapsed = time.perf_counter() - start
        if profiler.end(self.step):
            log(f"[profile] Chrome trace of steps {self.cfg.logging.profile_steps} in "
                          f"{profiler.path}", main=self.main)
        result.losses.append(loss)
        if self.cfg.model.compile and len(result.losses) == 1:
            self._log_compile(elapsed)
        record = self.records.record(
            self.engine, step=self.step, loss=loss, lr=lr, wait=wait, elapsed=elapsed,
            tokens=self.step_batch * self.cfg.model.seq_length, global_batch=self.step_batch,
            consumed_samples=self.consumed_samples, grad_norm=self._grad_norm)
        record.update(self.guard.after_step(step=self.step, loss=loss,
                                            skipped_before=skipped_before,
                                            spike_skipped=self._spike_skipped))
        self.spikes.counts.skipped += self._spike_skipped
        record.update(self.spikes.counts.fields())
        record.update(self.stragglers.end_step(step=self.step, elapsed=elapsed, data_wait=wait))
        record.update(self._end_router_step(skipped=record["update_skipped"]))
        self.metrics.write(record)
        return record

    def _begin_router_step(self) -> None:
        """Before a step of an MoE model: the auxiliary losses' gradient scale, and no router
        statistics of an abandoned step's forwards."""
        if self.cfg.model.num_experts:
            moe.set_aux_loss_grad_scale(moe.aux_loss_grad_scale(self.engine))
            moe.reset_stats(self.engine.module)
        if self.cfg.model.mtp_depth:  # nor the prediction modules' losses
            mtp.reset_losses(self.engine.module)

    def _end_router_step(self, *, skipped: bool) -> dict[str, Any]:
        """After a step of an MoE model (every rank: the sums are all-reduced): the router's
        statistics for the step record, and the sigmoid router's expert bias moved by its
        balancing step (`moe.collect_stats`) - unless the step's update was `skipped` (a
        non-finite or overflowed step, a spike skipped): the bias belongs to the weights, and
        stays with them."""
        model = self.cfg.model
        record = {}
        if model.mtp_depth:  # the prediction modules' cross entropies, averaged as the loss is
            record.update(mtp.collect_losses(
                self.engine.module, depth=model.mtp_depth, device=self.device,
                group=self.groups.data if self.replicas > 1 else None))
        if not model.num_experts:
            return record
        rate = None  # softmax routers: no bias
        if model.moe_router == "sigmoid":
            rate = 0.0 if skipped else model.moe_bias_update_rate
        # the prediction modules' layers are numbered after the decoder's
        record.update(moe.collect_stats(
            self.engine.module, device=self.device,
            num_layers=model.num_layers + model.mtp_depth, num_experts=model.num_experts,
            bias_update_rate=rate))
        return record

    def _replay_step(self, batches: Iterator[dict[str, torch.Tensor]]) -> tuple[float | None, float]:
        """`train_step` as a spike's rollback replays a step (`spikes.roll_back`, through the
        loop state): with a step's router bookkeeping, so that the expert bias takes each
        replayed step's balancing step as the first run did (none on a skipped update)."""
        skipped_before = self.engine.skipped_steps
        self._begin_router_step()
        loss, wait = self.train_step(batches)
        if loss is not None:  # a stop abandoned the step otherwise
            self._end_router_step(skipped=self.engine.skipped_steps > skipped_before)
        return loss, wait

    def _log_compile(self, elapsed: float) -> None:
        report = compile_report()
        log(f"[compile] {report.seconds:.1f} s of the first step ({elapsed:.1f} s) "
                      f"compiling {report.graphs} graphs ({report.graph_breaks} graph breaks); "
                      f"inductor cache: {report.cache_hits} reused, {report.cache_misses} built",
                      main=self.main)

    def _show_step(self, record: dict[str, Any], bar: tqdm) -> None:
        """The progress bar, and the step line every logging.log_interval steps and at the end."""
        steps = self.cfg.train.steps
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
        if self.main and (self.step % self.cfg.logging.log_interval == 0 or self.step == steps
                          or record.get("stragglers")):
            bar.write(format_step_line(record, steps))

    def _stop_or_save(self, result: TrainResult) -> bool:
        """What the ranks agreed on after this step (`faults.RunControl`, the one owner of when
        to save and stop): complete a background save, save, or save and stop (True)."""
        stop, save_due, writing = self.control.poll(  # the same on every rank
            device=self.device, step=self.step, writing=self.saver.writing())
        if self.saver.in_flight and not writing:  # every rank's files are on disk
            self._finish_save()
        last = self.step >= self.cfg.train.steps  # saved by `_finish`, stop or not
        if stop and not last:
            self._stop(result, stop)
            return True
        if save_due and not last:
            self.save()
        return False

    def _finish(self, result: TrainResult) -> TrainResult:
        """After the loop: the last step saved (and the final weights), curves, sinks closed."""
        result.final_step = self.step
        warn = functools.partial(log, main=self.main, level="warning")
        self.spikes.write_summary(self.metrics, step=self.step, log=warn)
        self.stragglers.write_summary(self.metrics, step=self.step)
        if result.stop_reason:
            self._draw_curves()
            self.metrics.close(status="KILLED")
            return result
        if self.position.saved_step != self.step:  # the last step is always resumable
            self.save()
        self._finish_save()
        if self.cfg.checkpoint.save_final:
            with self.watchdog.paused():  # its waits have train.io_timeout_minutes
                result.final_dir = checkpoint.save_final(
                    self.engine, cfg=self.recorded_cfg, groups=self.groups,
                    tokenizer=self.tokenizer,
                    run_dir=self.run_dir, step=self.step, main=self.main)
            warn(f"[checkpoint] final weights in {result.final_dir}", main=self.main)
        self._draw_curves()
        self.metrics.close()
        return result

    def _stop(self, result: TrainResult, stop: str) -> None:
        """A stop request: save the last completed step (unless saved), mark the run stopped."""
        result.stop_reason = stop
        log(f"[stop] {stop}: saving step {self.step}, then exiting to be requeued",
                      main=self.main, level="warning")
        if self.position.saved_step != self.step:
            self.save()
        self._finish_save()
        if self.main:
            checkpoint.mark_stopped(self.run_dir, step=self.step, reason=stop,
                                    exit_code=EXIT_REQUEUE)

    def _draw_curves(self) -> None:
        """<run_dir>/curves.png from metrics.jsonl (rank 0), once per step. A failure turns the
        picture off for the run after one warning: it never stops training."""
        if not self.main or not self.cfg.logging.curves or self._curves_step in (self.step, -1):
            return
        try:
            curves.write_png([curves.read_curves(self.run_dir)], self.run_dir / "curves.png")
            self._curves_step = self.step
        except Exception as exc:  # noqa: BLE001 - matplotlib missing or failing
            self._curves_step = -1
            log(f"warning: curves.png off for this run: {type(exc).__name__}: {exc}",
                          level="warning")

    def save(self) -> None:
        """A checkpoint of this step (collective): DeepSpeed's state plus ours (`meta.json`).
        With `checkpoint.async_save` it returns once the state is copied to host memory; the
        save completes in `_finish_save`."""
        cfg = self.cfg
        state, meta = checkpoint.checkpoint_meta(
            self.recorded_cfg, step=self.step, consumed_samples=self.consumed_samples,
            global_batch=self.global_batch, tokenizer=self.tokenizer, git_commit=self._git_commit,
            layout=self.checkpoint_layout)
        meta.update(self.spikes.meta_fields())  # the quarantine every later resume honours
        self._finish_save()  # the previous save, if it is still being written
        self._save_started = time.perf_counter()
        with self.watchdog.paused():  # its waits have train.io_timeout_minutes
            path = self.saver.save(meta=meta, client_state=state)
        self.control.mark_saved()
        self.position.saved_step = self.step
        took = f"{time.perf_counter() - self._save_started:.1f}s"
        log(f"[checkpoint] {path}: state copied in {took}, written in the background"
                      if self.saver.in_flight else f"[checkpoint] {path} in {took}", main=self.main)

    def _finish_save(self) -> None:
        """Complete the save in flight, if any (collective): every rank's files on disk, then
        the manifest and `latest`."""
        with self.watchdog.paused():  # its waits have train.io_timeout_minutes
            path = self.saver.finish()
        if path is not None:
            log(f"[checkpoint] {path} complete, "
                          f"{time.perf_counter() - self._save_started:.1f}s after the save began",
                          main=self.main)
