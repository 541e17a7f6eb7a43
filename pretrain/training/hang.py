"""Name the rank that hangs: a watchdog thread per rank, dumps, one verdict, exit to be requeued.

`Watchdog` is a daemon thread started when training starts. The training loop calls `beat`
after every micro-batch it runs itself (a flat model's accumulation and evaluation, a pipeline's
evaluation chunks), after every forward of a pipeline stage (a hook: DeepSpeed's 1F1B schedule
runs a step's micro-batches) and after every step, a rollback's replayed ones included:
micro-batches, not steps, because a step of a long accumulation may legitimately run for minutes
while a micro-batch is bounded like a collective. Saves and a rollback's loads run `paused`
(their waits have `train.io_timeout_minutes`). No beat for `train.hang_timeout_minutes` - or a
SIGTERM the loop has not acted on within its grace (its handler only sets a flag that a hung loop
never polls) - is a hang. The grace (`Watchdog.sigterm_grace`) is what finishing a step and saving
has taken this run, GRACE_MARGIN times over, at least SIGTERM_GRACE_S, and never more than the
platform leaves between its SIGTERM and its SIGKILL (`$PRETRAIN_TERMINATION_GRACE_S`: a Kubernetes
pod's grace; the Slurm scripts leave it unset), less the time the verdict takes. Then every rank that can still
run Python:

1. raises the alarm in the rendezvous store (the launcher's TCPStore, which works while
   NCCL / gloo are wedged), which the other ranks' watchdogs see at their next poll;
2. writes `<run_dir>/hang/rank<N>.txt`: every thread's Python stack (faulthandler) and its last
   collectives (`pretrain.training.collective_log`); on NCCL also torch's flight recorder
   (`hang/flight_recorder_rank<N>.pkl`);
3. answers in the store with its status: host, last finished step, collectives entered per
   group, the one it is in.

The lowest rank that answered within `answer_window` judges (`verdict`): one line, in the log and
in `hang/verdict.txt`, naming the rank(s) and hosts that did not reach the collective the others
wait in, and a rank that never answered (SIGSTOPped, frozen) as one that cannot answer. A
"hang" record goes to metrics.jsonl (through rank 0's sinks when rank 0 answered). Then every
answering rank exits EXIT_REQUEUE (75): the Slurm scripts requeue the job, which resumes from the
last complete checkpoint. Between hangs each watchdog publishes a heartbeat (the same status)
every `interval` seconds, so the status of a rank that stops answering is at most that old.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from pretrain.training import collective_log
from pretrain.errors import EXIT_REQUEUE
from pretrain.training.hang_verdict import verdict

SIGTERM_GRACE_S = 30.0  # the least grace after a SIGTERM (Slurm's default KillWait)
GRACE_MARGIN = 1.5  # the longest step and save measured so far, this many times over
# the platform's seconds from SIGTERM to SIGKILL, as its launcher tells the ranks
PLATFORM_GRACE_ENV = "PRETRAIN_TERMINATION_GRACE_S"
_KEY = "pretrain/hang"


def intervals(timeout_s: float) -> tuple[float, float]:
    """(poll interval, answer window) for a hang timeout: a rank's status is at most one interval
    old; the judge waits up to the window for every rank's answer."""
    interval = min(max(timeout_s / 6, 0.2), 10.0)
    return interval, max(10.0, 3 * interval)


def platform_grace(env: dict[str, str] | os._Environ) -> float | None:
    """Seconds between the platform's SIGTERM and its SIGKILL (`PLATFORM_GRACE_ENV`), or None
    where the launcher did not say."""
    text = env.get(PLATFORM_GRACE_ENV, "").strip()
    try:
        return float(text) if text else None
    except ValueError:
        print(f"warning: {PLATFORM_GRACE_ENV}={text!r} is not a number of seconds: ignored",
              file=sys.stderr)
        return None


def flight_recorder_environment(device_type: str) -> None:
    """On NCCL, keep torch's flight recorder (its last collectives, per communicator) unless the
    user set it: set before the process group exists. Not exercised on CPU machines."""
    if device_type == "cuda":
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")


def dump_flight_recorder(path: Path) -> bool:
    """torch's flight recorder (NCCL's, or gloo's when TORCH_FR_BUFFER_SIZE is set) to `path`
    (a pickle that torch's `fr_trace` tool reads); False when this build or backend has none."""
    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_nccl_trace", None)
    if dump is None and os.environ.get("TORCH_FR_BUFFER_SIZE"):
        dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return False
    try:
        path.write_bytes(dump(includeCollectives=True, includeStackTraces=True, onlyActive=False))
    except Exception:  # noqa: BLE001 - best effort: the stacks and our log are already written
        return False
    return True


def default_store():
    """The process group's rendezvous store (None without a process group)."""
    import torch.distributed as torch_dist

    if not torch_dist.is_initialized():
        return None
    return torch_dist.distributed_c10d._get_default_store()


class Watchdog:
    def __init__(self, *, timeout_minutes: float, rank: int, world_size: int, run_dir: Path,
                 store: Any = None, control: Any = None, log: Callable[[str], None] = print,
                 on_verdict: Callable[[dict[str, Any]], None] | None = None,
                 exit: Callable[[int], None] = os._exit,
                 collectives: collective_log.CollectiveLog = collective_log.LOG,
                 saver: Any = None, clock: Callable[[], float] = time.monotonic,
                 platform_grace_s: float | None = None):
        """`store` the rendezvous store (a `torch.distributed.Store`; None in a world of one);
        `control` the `faults.RunControl` whose SIGTERM flag counts; `on_verdict` called on rank
        0 with the metrics record before the exit; `exit` ends the process; `saver` the run's
        `checkpoint.Saver`, whose background save in flight is completed before the exit when
        every rank has written its files; `clock` the monotonic time of beats and pauses;
        `platform_grace_s` the platform's SIGTERM-to-SIGKILL seconds (default from the
        environment, `platform_grace`)."""
        self.timeout_s, self.rank, self.world_size = timeout_minutes * 60.0, rank, world_size
        self.dir, self.store, self.control = Path(run_dir) / "hang", store, control
        self.log, self.on_verdict, self.exit, self.collectives = log, on_verdict, exit, collectives
        self.saver = saver
        self.interval, self.window = intervals(self.timeout_s)
        self.host, self.step = socket.gethostname(), 0
        self.clock = clock
        self.platform_grace_s = (platform_grace_s if platform_grace_s is not None
                                 else platform_grace(os.environ))
        self.last_progress = clock()
        self._paused, self._sigterm_at = 0, None
        # the SIGTERM grace's measurements: the longest step (without its pauses) and the
        # longest pause of one step (its saves, evaluations) since the first step
        self.longest_step = self.longest_pauses = 0.0
        self._step_beat: float | None = None  # when the last step ended
        self._paused_since_step = 0.0
        self._pause_began = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prefix = f"{_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._local: dict[str, str] = {}  # the store of a world of one

    # ---- the training loop's side ----------------------------------------------------------
    def start(self) -> None:
        """Publish this rank's first heartbeat (so a rank stopped at once is still known by its
        host), then watch from a daemon thread."""
        self.beat()
        self._set(f"beat/{self.rank}", json.dumps(self.status()))
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, 2 * self.interval))

    def beat(self, step: int | None = None) -> None:
        """Progress: a micro-batch ran, or step `step` completed."""
        self.last_progress = self.clock()
        if step is not None:
            self.step = step
            self._measure_step(self.last_progress)

    def _measure_step(self, now: float) -> None:
        """A step ended at `now`: the time since the previous one, split into the step and the
        pauses (saves, evaluations) between them. The first step (warm-up) is not measured."""
        if self._step_beat is not None:
            self.longest_pauses = max(self.longest_pauses, self._paused_since_step)
            self.longest_step = max(self.longest_step,
                                    now - self._step_beat - self._paused_since_step)
        self._step_beat, self._paused_since_step = now, 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No alarm from this rank inside the block (a save: its waits have their own timeout)."""
        if not self._paused:
            self._pause_began = self.clock()
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            if not self._paused:
                self._paused_since_step += self.clock() - self._pause_began
            self.beat()

    def sigterm_grace(self) -> float:
        """Seconds a rank may make no progress after a SIGTERM before it counts as hung: the
        longest step and the longest pauses of one step measured so far (finishing the step in
        flight and saving), GRACE_MARGIN times over, at least SIGTERM_GRACE_S; never more than
        the platform's grace less the answer window (the dump and the verdict must end before
        its SIGKILL), nor than the hang timeout."""
        grace = max(SIGTERM_GRACE_S, GRACE_MARGIN * (self.longest_step + self.longest_pauses))
        if self.platform_grace_s is not None:
            grace = min(grace, max(self.platform_grace_s - self.window, 1.0))
        return min(grace, self.timeout_s)

    # ---- the thread ------------------------------------------------------------------------
    def due(self, now: float) -> str | None:
        """Why this rank is hung at monotonic time `now`, or None."""
        if self._paused:
            return None
        idle = now - self.last_progress
        if idle >= self.timeout_s:
            return (f"no progress for {idle:.1f} s (train.hang_timeout_minutes="
                    f"{self.timeout_s / 60:g})")
        if self.control is not None and self.control.received == "SIGTERM":
            if self._sigterm_at is None:
                self._sigterm_at = now
            waited = now - max(self._sigterm_at, self.last_progress)
            grace = self.sigterm_grace()
            if waited >= grace:
                return (f"SIGTERM not acted on: no progress for {waited:.1f} s after it arrived "
                        f"(its grace: {grace:.0f} s)")
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                reason = self.due(self.clock())
                alarm = self._get("alarm")
                if not (reason or alarm):
                    self._set(f"beat/{self.rank}", json.dumps(self.status()))
                    continue
            except Exception as exc:  # noqa: BLE001 - the watchdog must never kill training
                print(f"warning: rank {self.rank}: hang watchdog off: {type(exc).__name__}: "
                      f"{exc}", file=sys.stderr, flush=True)
                return
            try:
                self._on_hang(reason, alarm)
            except Exception as exc:  # noqa: BLE001 - the store's host (rank 0) may be gone
                print(f"error: rank {self.rank}: hang: {reason or alarm}; naming the rank "
                      f"failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            self.exit(EXIT_REQUEUE)
            return

    def status(self, *, answered: bool = False) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": self.step,
                "at": time.time(), "answered": answered,
                "counts": dict(self.collectives.counts), "last": self.collectives.last()}

    def _on_hang(self, reason: str | None, alarm: str | None) -> None:
        if reason and not alarm:
            self._set("alarm", f"rank {self.rank}: {reason}")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._dump(reason or f"alarm raised by {alarm}")
        self._set(f"answer/{self.rank}", json.dumps(self.status(answered=True)))
        statuses = self._gather_answers()
        answered = [r for r, s in statuses.items() if s and s["answered"]]
        self._complete_save(first=self.rank == min(answered))
        if self._get("verdict") is None:
            if self.rank == min(answered) or self._wait_for("verdict", self.window) is None:
                self._judge(statuses)  # the lowest rank that answered, or the next if it died
        if self.rank == 0 and self.on_verdict is not None:
            with contextlib.suppress(Exception):
                self.on_verdict(json.loads(self._get("record") or "{}"))
        self._upload_records()
        self._set(f"left/{self.rank}", "1")
        if self.rank == 0:  # it holds the store under most launchers: leave last
            self._wait_for_all([f"left/{r}" for r in answered], self.window)
            from pretrain.resolve.world_fit import publish_exit  # ranks left idle exit with this code

            publish_exit(EXIT_REQUEUE, rank=0)

    def _complete_save(self, *, first: bool) -> None:
        """A background save in flight whose files every rank has written is completed here
        (the training threads cannot meet to do it), so the requeued job resumes from it: each
        answering rank publishes its written files, the lowest one writes the manifest. A run
        in the object store then gets it uploaded as a regular save does: each rank its own
        files, the lowest one, once all are in the store, the rest and the manifest last
        (within `upload_window`: a save not uploaded then stays node-local, with a warning)."""
        tag = self.saver.pending() if self.saver is not None else None
        if tag is None:
            return
        written = self.saver.written_without_collectives(timeout_s=self.window)
        if written is not None:
            self._set(f"save/{tag}/{self.rank}", json.dumps(written))
        completed = None
        if first:
            keys = [f"save/{tag}/{r}" for r in range(self.world_size)]
            if not self._wait_for_all(keys, self.window):
                self.log(f"[hang] checkpoint {tag} left incomplete: not every rank has written "
                         "its files; resuming starts from the previous checkpoint")
                return
            completed = [json.loads(self._get(key)) for key in keys]
            path = self.saver.complete_from(completed)
            self.log(f"[hang] checkpoint {path} completed before the exit (every rank had "
                     "written its files): the requeued job resumes from it")
        if written is None or getattr(self.saver, "store_url", None) is None:
            return
        window = self.upload_window()
        error = self.saver.upload_without_collectives(written, timeout_s=window)
        self._set(f"uploaded/{tag}/{self.rank}", error or "")
        if completed is None:
            return
        keys = [f"uploaded/{tag}/{r}" for r in range(self.world_size)]
        if not self._wait_for_all(keys, window):
            error = f"not every rank's files reached the store within {window:.0f} s"
        error = error or next((e for e in map(self._get, keys) if e), None) or \
            self.saver.complete_upload_without_collectives(completed)
        self.log(f"[hang] checkpoint {tag} was not uploaded to {self.saver.store_url} ({error}): "
                 "it stays on this node; the store keeps its last complete checkpoint" if error
                 else f"[hang] checkpoint {tag} uploaded to {self.saver.store_url}")

    def _upload_records(self) -> None:
        """A run in the object store: its records (metrics with the hang record, the dumps)
        uploaded before the exit, as at the end of a run."""
        upload = getattr(self.saver, "upload_records_without_collectives", None)
        if upload is None or getattr(self.saver, "store_url", None) is None:
            return
        own = [self.dir / f"rank{self.rank}.txt", self.dir / f"flight_recorder_rank{self.rank}.pkl"]
        error = upload(own, main=self.rank == 0, timeout_s=self.upload_window())
        if error:
            self.log(f"[hang] rank {self.rank}'s records were not uploaded to "
                     f"{self.saver.store_url} ({error}): they stay in {self.dir.parent}")

    def upload_window(self) -> float:
        """Seconds the hang's uploads may take: the hang timeout (as long as a step may go
        without progress), within what the platform's grace leaves after a SIGTERM."""
        window = self.timeout_s
        if self.platform_grace_s is not None and self._sigterm_at is not None:
            left = self.platform_grace_s - self.window - (self.clock() - self._sigterm_at)
            window = min(window, max(left, 1.0))
        return window

    def _dump(self, reason: str) -> None:
        now = time.time()
        with open(self.dir / f"rank{self.rank}.txt", "w") as f:
            f.write(f"rank {self.rank} on {self.host} (pid {os.getpid()}), last finished step "
                    f"{self.step}: {reason}\n\nPython stacks (faulthandler):\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
            f.write(f"\nlast collectives, oldest first ({self.collectives.total} entered):\n")
            for entry in self.collectives.recent():
                f.write(collective_log.describe(collective_log.as_dict(entry), now=now) + "\n")
        dump_flight_recorder(self.dir / f"flight_recorder_rank{self.rank}.pkl")

    def _gather_answers(self) -> dict[int, dict[str, Any] | None]:
        """Every rank's answer, or its last heartbeat if it has not answered within the window."""
        self._wait_for_all([f"answer/{r}" for r in range(self.world_size)], self.window)
        statuses = {}
        for r in range(self.world_size):
            text = self._get(f"answer/{r}") or self._get(f"beat/{r}")
            statuses[r] = json.loads(text) if text else None
        return statuses

    def _judge(self, statuses: dict[int, dict[str, Any] | None]) -> None:
        line, record = verdict(statuses, now=time.time())
        (self.dir / "verdict.txt").write_text(line + "\n")
        self.log(line)
        rank0_writes = (statuses.get(0) or {}).get("answered") and (
            self.rank != 0 or self.on_verdict is not None)  # through its metric sinks
        if not rank0_writes:
            with open(self.dir.parent / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        self._set("record", json.dumps(record))
        self._set("verdict", line)

    # ---- the store (a world of one has none: its own statuses only) ------------------------
    def _set(self, key: str, value: str) -> None:
        if self.store is not None:
            self.store.set(f"{self._prefix}/{key}", value)
        else:
            self._local[key] = value

    def _get(self, key: str) -> str | None:
        if self.store is None:
            return self._local.get(key)
        full = f"{self._prefix}/{key}"
        return self.store.get(full).decode() if self.store.check([full]) else None

    def _wait_for_all(self, keys: list[str], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not (done := self._has_all(keys)) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the store for the other ranks
        return done

    def _has_all(self, keys: list[str]) -> bool:
        if self.store is None:
            return all(k in self._local for k in keys)
        return self.store.check([f"{self._prefix}/{k}" for k in keys])

    def _wait_for(self, key: str, seconds: float) -> str | None:
        deadline = time.monotonic() + seconds
        while (value := self._get(key)) is None and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the store for the judge's line
        return value
