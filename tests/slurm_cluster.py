"""A real, throw-away Slurm cluster on this one host, for the tests of `slurm/*.sh`.

Debian's `slurm-wlm` and `munge` packages (installed with apt-get when missing; needs root), one
`munged` on a private socket, one `slurmctld`, and four `slurmd` daemons (`slurmd -N nodeN`: Debian
builds Slurm with multiple-slurmd support) on distinct ports, all `NodeAddr=127.0.0.1`; two
partitions: the default one of nodes 1-2, and `wide` of all four (for a job that loses one of
four nodes). Everything (config, state, spool, logs) lives under one directory and the daemons are
stopped by `stop()`; nothing system-wide is started. The node names are added to /etc/hosts
because the job scripts (like on a real cluster) use `scontrol show hostnames` as the master address.

No systemd and no cgroups in a container: `proctrack/linuxproc`, `task/none`, every daemon as
root. `cred_expire=10` (default 120 s) is also how long a requeued job waits before it may
start again. Without a database `sacct` is unavailable; finished jobs stay visible to `scontrol show job`
for `MinJobAge` seconds and `jobcomp/filetxt` keeps a line per finished job.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("pretrain-node1", "pretrain-node2", "pretrain-node3", "pretrain-node4")
PARTITION = "debug"  # the default: nodes 1-2
WIDE_PARTITION = "wide"  # all four nodes
# Terminal job states (`scontrol show job` JobState=...).
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def install_slurm() -> None:
    """apt-get install slurm-wlm and munge unless present (root only: say so otherwise)."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise RuntimeError("the Slurm tests need Debian's slurm-wlm and munge: run `apt-get install "
                           "-y slurm-wlm munge` as root (the test setup does it when run as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm",
                    "munge"], check=True, env=env, capture_output=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_hosts(names: tuple[str, ...]) -> None:
    missing = []
    for name in names:
        try:
            socket.gethostbyname(name)
        except OSError:
            missing.append(name)
    if missing:
        with open("/etc/hosts", "a") as f:
            f.write(f"127.0.0.1 {' '.join(missing)}  # pretrain Slurm tests\n")


@dataclass
class Job:
    job_id: str
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "")

    @property
    def exit_code(self) -> str:
        return self.fields.get("ExitCode", "")


class SlurmCluster:
    """Start with `SlurmCluster(base).start()`; `env` is the environment for sbatch/squeue."""

    def __init__(self, base: Path, *, cpus_per_node: int = 2):
        self.base = Path(base)
        self.cpus = cpus_per_node
        self.conf = self.base / "slurm.conf"
        self.munge_socket = self.base / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._pids: list[int] = []

    def _write_config(self) -> None:
        b = self.base
        for d in ("munge", "state", "log", *(f"spool/{n}" for n in NODES)):
            (b / d).mkdir(parents=True, exist_ok=True)
        os.chmod(b / "munge", 0o700)
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={_free_port()}"
            f" CPUs={self.cpus} RealMemory=2000 State=UNKNOWN" for n in NODES)
        self.conf.write_text(f"""\
ClusterName=pretraintest
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd.%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
MinJobAge=3600
JobCompType=jobcomp/filetxt
JobCompLoc={b}/log/jobcomp.txt
KillWait=10
SlurmdTimeout=60
InactiveLimit=0
{nodes}
PartitionName={PARTITION} Nodes={','.join(NODES[:2])} Default=YES MaxTime=INFINITE State=UP
PartitionName={WIDE_PARTITION} Nodes={','.join(NODES)} MaxTime=INFINITE State=UP
""")

    def _spawn(self, argv: list[str], log: str) -> None:
        out = open(self.base / "log" / log, "ab")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)
        self._pids.append(proc.pid)

    def start(self, *, timeout: float = 60) -> "SlurmCluster":
        install_slurm()
        _ensure_hosts(NODES)
        self._write_config()
        m = self.base / "munge"
        self._spawn(["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                     f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
                     f"--seed-file={m}/munged.seed"], "munged.out")
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged did not create its socket")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        for n in NODES:
            self._spawn(["slurmd", "-D", "-N", n, "-f", str(self.conf)], f"slurmd.{n}.out")
        self._wait(self._nodes_idle, timeout, "the slurmd nodes did not become idle")
        return self

    def _nodes_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split("\n")
        states = dict(line.split() for line in out if line.strip())
        return len(states) == len(NODES) and all(s == "idle" for s in states.values())

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout:.0f}s; logs in {self.base / 'log'}:\n"
                                   + self.logs())
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted((self.base / "log").glob("*")) if p.is_file())

    def stop(self) -> None:
        """Cancel what still runs (a failed test may leave a job), then stop the daemons."""
        if self._pids:
            self.run(["scancel", "--user", "root"], check=False)
            try:
                self._wait(lambda: not self.run(["squeue", "-h"], check=False).stdout.strip(), 60,
                           "jobs still running after scancel")
            except RuntimeError:
                pass  # the daemons go anyway
        for pid in reversed(self._pids):
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid in self._pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self._pids.clear()

    # ---- jobs ------------------------------------------------------------------------------
    def run(self, argv: list[str], *, check: bool = True, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, capture_output=True, text=True, env={**self.env, **(env or {})},
                              cwd=cwd, timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr}")
        return proc

    def sbatch(self, script: str | None, *, options: list[str] = (), script_args: list[str] = (),
               env: dict | None = None, cwd: Path) -> str:
        """`sbatch OPTIONS [SCRIPT ARGS]` (no script with `--wrap`); returns the job id."""
        argv = ["sbatch", "--parsable", *options] + ([script, *script_args] if script else [])
        out = self.run(argv, env=env, cwd=cwd).stdout
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> list[Job]:
        """`scontrol show job` of a job (every task of an array job)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
        jobs = []
        for line in out.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if "JobId" in fields:
                jobs.append(Job(fields["JobId"], fields))
        return jobs

    def wait(self, job_id: str, *, timeout: float, until=None) -> list[Job]:
        """Poll until every task of the job is finished (or `until(jobs)` holds); the jobs."""
        until = until or (lambda jobs: jobs and all(j.state in FINISHED for j in jobs))
        deadline = time.monotonic() + timeout
        while True:
            jobs = self.job(job_id)
            if until(jobs):
                return jobs
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not done within {timeout:.0f}s: "
                                   f"{[(j.job_id, j.state) for j in jobs]}\n{self.logs()}")
            time.sleep(0.5)
