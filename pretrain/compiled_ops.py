"""DeepSpeed's compiled (C++) ops a run needs, built before its ranks start.

Offloading configs use DeepSpeed ops that are compiled on first use (`torch.utils.cpp_extension`
into `$TORCH_EXTENSIONS_DIR/<op>`): CPU Adam for an offloaded optimizer, async I/O for NVMe.
Left to the ranks, every rank of every node compiles at its first step, into one shared folder,
on compute nodes that may have no compiler, and a build cancelled with its job leaves torch's
`lock` file behind: every later job waits on it forever. So:

- `launch/setup_env.sh --ops` builds the ops of every shipped DeepSpeed config into the
  repository's `.build/torch_extensions` (`shipped_ops`, `build`);
- a Slurm job whose config needs ops runs one task per node first (`pretrain launch build-ops`),
  which copies the set-up's builds into a node-local folder of the job (`node_local_ops_dir`) or
  compiles them there, and the ranks load them from that folder;
- the pre-flight refuses a config whose op cannot load here (`load_problem`): no compiler, no
  libaio, an op the accelerator does not have;
- a build lock with no build process on this node, older than any build on a shared file
  system (a minute on a node-local disk), is removed and reported (`clear_stale_locks`).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from pretrain.resolve.ds_config import offload_devices
from pretrain.mounts import network_filesystem, node_local_scratch

BUILDERS = {"cpu_adam": "CPUAdamBuilder", "async_io": "AsyncIOBuilder"}
CPU_STAMP = "built_for_cpu.txt"  # cpu_signature() of the node that built the op
STALE_LOCK_S = 1800.0  # longer than any op build (CPU Adam: ~45 s on 2 cores)
# On a node-local disk only this node's processes can build: a lock this old with none of them
# in the folder is stale (the grace covers torch taking the lock before it starts ninja).
LOCAL_STALE_LOCK_S = 60.0


def needed_ops(ds: dict[str, Any]) -> list[str]:
    """The compiled ops a DeepSpeed config makes the engine load: CPU Adam for an offloaded
    optimizer (unless it asks for torch's Adam), async I/O for NVMe offload."""
    optimizer, params = offload_devices(ds)
    torch_adam = ds.get("optimizer", {}).get("params", {}).get("torch_adam") is True
    ops = ["cpu_adam"] if optimizer != "none" and not torch_adam else []
    return ops + (["async_io"] if "nvme" in (optimizer, params) else [])


def shipped_ops(ds_configs: Path) -> list[str]:
    """The ops any of the DeepSpeed configs in `ds_configs` needs, in BUILDERS' order."""
    import json

    wanted = {op for path in ds_configs.glob("*.json")
              for op in needed_ops(json.loads(path.read_text()))}
    return [op for op in BUILDERS if op in wanted]


def extensions_dir() -> Path:
    """Where torch builds and finds JIT ops: $TORCH_EXTENSIONS_DIR, else torch's default."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def node_local_ops_dir(env: dict[str, str] | None = None) -> Path:
    """The job's folder for compiled ops on each node: in the node's scratch directory, named
    after the job (the same path string on every node, each node's own disk), so that no lock
    is shared between nodes or left for a later job."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID") or str(os.getpid())
    return node_local_scratch(env) / f"pretrain_torch_extensions-{job}"


def _builder(name: str) -> Any:
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(BUILDERS[name])
    if builder is None:
        raise RuntimeError(f"DeepSpeed's {get_accelerator()._name} accelerator has no {name} op")
    return builder


def is_built(name: str, ext_dir: Path | None = None) -> bool:
    """Installed with DeepSpeed (DS_BUILD_*=1) or already compiled in `ext_dir`."""
    from deepspeed.git_version_info import installed_ops

    ext_dir = extensions_dir() if ext_dir is None else ext_dir
    return bool(installed_ops.get(name)) or (ext_dir / name / f"{name}.so").is_file()


def load_problem(name: str) -> str | None:
    """Why op `name` cannot load on this node, or None. A built op loads; one to be built needs
    DeepSpeed's compatibility check (libaio for async I/O) to pass and a compiler and ninja."""
    try:
        builder = _builder(name)
    except RuntimeError as error:
        return str(error)
    if is_built(name):
        return None
    if not builder.is_compatible(verbose=False):
        detail = getattr(builder, "error_log", None) or (
            "libaio's headers and library are missing (Debian: apt-get install libaio-dev)"
            if name == "async_io" else "DeepSpeed's compatibility check failed")
        return f"{name} cannot be built here: {detail}"
    compiler = os.environ.get("CXX", "c++")
    missing = [tool for tool in (compiler, "ninja") if shutil.which(tool) is None]
    if missing:
        return (f"{name} is not built and this node has no {' or '.join(missing)} to build it: "
                "run `bash launch/setup_env.sh --ops` where there is one")
    return None


def clear_stale_locks(ops: list[str], ext_dir: Path, *, older_than_s: float | None = None,
                      now: float | None = None) -> list[str]:
    """Remove the build locks of `ops` in `ext_dir` that a dead build left: no process on this
    node building in that folder (torch runs ninja and the compiler there), and older than
    `older_than_s` (default: STALE_LOCK_S on a network file system, where another node may be
    building, else LOCAL_STALE_LOCK_S). One line per lock found, saying what was done."""
    now = time.time() if now is None else now
    if older_than_s is None:
        older_than_s = STALE_LOCK_S if network_filesystem(ext_dir) else LOCAL_STALE_LOCK_S
    lines = []
    for name in ops:
        lock = ext_dir / name / "lock"
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:
            continue
        builders = processes_in(lock.parent)
        if builders or age < older_than_s:
            who = f"pid {', '.join(map(str, builders))}" if builders else "no process on this node"
            lines.append(f"[ops] {lock}: a build holds it ({age:.0f} s old, {who}): left alone")
            continue
        lock.unlink(missing_ok=True)
        lines.append(f"[ops] {lock}: removed a stale build lock ({age:.0f} s old, no build "
                     "running on this node); a cancelled build left it")
    return lines


def processes_in(folder: Path) -> list[int]:
    """Pids of this node's processes whose working directory is `folder` (a running build)."""
    target, pids = os.path.realpath(folder), []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(proc / "cwd") == target:
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def build(ops: list[str], *, ext_dir: Path, seed: Path | None = None) -> list[str]:
    """Make `ops` loadable from `ext_dir` (exported as TORCH_EXTENSIONS_DIR): copied from
    `seed`'s builds where they were made on this CPU model, compiled otherwise, stale locks
    removed first. Returns why the ops that cannot load here were skipped."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ext_dir)
    ext_dir.mkdir(parents=True, exist_ok=True)
    for name in ops:
        if seed is not None and not (ext_dir / name).exists() and _same_cpu_build(seed / name):
            shutil.copytree(seed / name, ext_dir / name, ignore=shutil.ignore_patterns("lock"))
    for line in clear_stale_locks(ops, ext_dir):
        print(line, file=sys.stderr)
    problems = {name: load_problem(name) for name in ops}
    for name in (name for name in ops if not problems[name]):
        start = time.perf_counter()
        _builder(name).load(verbose=False)
        (ext_dir / name / CPU_STAMP).write_text(cpu_signature() + "\n")
        print(f"[ops] {name}: loadable from {ext_dir} ({time.perf_counter() - start:.0f} s)")
    return [problem for problem in problems.values() if problem]


def cpu_signature() -> str:
    """This node's CPU model and instruction set flags: DeepSpeed compiles its CPU ops with
    -march=native, so a build is only reused on the CPU it was made for."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return "unknown"
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


def _same_cpu_build(folder: Path) -> bool:
    name = folder.name
    stamp = folder / CPU_STAMP
    return ((folder / f"{name}.so").is_file() and stamp.is_file()
            and stamp.read_text().strip() == cpu_signature())
