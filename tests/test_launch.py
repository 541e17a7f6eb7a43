"""launch/: single-node runs through the real deepspeed and torchrun launchers (launch/single_node.sh),
hostfile and .deepspeed_env generation, and the pre-flight record (`pretrain launch ...`)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.commands import launch
from pretrain.errors import ConfigError

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)

REPO = Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.yaml", "--set", "train.steps=3", "--set", "data.num_workers=0"]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "VIRTUAL_ENV"):
        env.pop(var, None)
    env.update(extra)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    return env


def _pretrain(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain", *args], cwd=REPO, env=_env(**env),
                          capture_output=True, text=True, timeout=300)


# ---- single node through the real launchers ------------------------------------------------
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_single_node_script_runs_two_cpu_ranks(launcher, tiny_data, tmp_path):
    run_dir = tmp_path / launcher
    proc = subprocess.run(
        ["bash", "launch/single_node.sh", *TINY, "--set", f"run_dir={run_dir}",
         "--set", f"data.tokenizer={tiny_data['tokenizer']}",
         "--set", f"data.dataset={tiny_data['dataset']}"],
        cwd=REPO, env=_env(LAUNCHER=launcher, NPROC="2"), capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[launch] {launcher}: 2 ranks" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert (records[0]["world_size"], records[0]["launcher"]) == (2, launcher)
    assert (records[0]["data_parallel"], records[0]["zero_stage"]) == (2, 1)
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["consumed_samples"] for r in steps] == [4, 8, 12]  # one global batch per step
    # both ranks answered every step's memory all-gather and saved their shard of the end
    assert all(len(r["peak_mem_gb_ranks"]) == 2 and min(r["peak_mem_gb_ranks"]) > 0
               for r in steps), steps
    last = run_dir / "checkpoints" / "step3"
    assert sorted(p.name for p in last.glob("zero_pp_rank_*_optim_states.pt")) == \
        [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)]


def test_single_node_script_refuses_unknown_launcher():
    proc = subprocess.run(["bash", "launch/single_node.sh", *TINY], cwd=REPO,
                          env=_env(LAUNCHER="mpirun"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "LAUNCHER=mpirun: use deepspeed or torchrun" in proc.stderr


# ---- hostfiles -------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, names", [
    ("node1", ["node1"]),
    ("gpu[01-03,7],login", ["gpu01", "gpu02", "gpu03", "gpu7", "login"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("n[009-011]", ["n009", "n010", "n011"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    (" x1 , y[2] ", ["x1", "y2"]),
])
def test_expand_nodelist_follows_slurm_grammar(spec, names):
    assert launch.expand_nodelist(spec) == names


@pytest.mark.parametrize("spec, message", [
    ("node[1-2", "unbalanced '['"),
    ("node1-2]", "unbalanced ']'"),
    ("node[3-1]", "runs backwards"),
    ("node[a-b]", "is not a number"),
])
def test_expand_nodelist_rejects_malformed_lists(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        launch.expand_nodelist(spec)


def test_node_names_without_slurm_expand_the_job_nodelist(monkeypatch):
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-[1-2]")
    assert launch.node_names() == ["gpu-1", "gpu-2"]
    assert launch.node_names("other[3-4]") == ["other3", "other4"]  # an explicit list wins
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST is not set"):
        launch.node_names()


def test_hostfile_text_and_its_errors():
    assert launch.hostfile_text(["a", "b"], slots=8) == "a slots=8\nb slots=8\n"
    with pytest.raises(ConfigError, match="slots per node = 0"):
        launch.hostfile_text(["a"], slots=0)
    with pytest.raises(ConfigError, match="names a node twice"):
        launch.hostfile_text(["a", "a"], slots=1)


# A stand-in for `scontrol show hostnames`, which accepts malformed lists: 'c[1-' prints 'c]'.
FAKE_SCONTROL = """#!/bin/bash
echo "$*" >> "${0%/*}/calls"
case "$3" in
  'c[1-3]') printf 'c1\\nc2\\nc3\\n' ;;
  'c[1-') echo 'c]' ;;
  *) echo "scontrol: error: unexpected test input $3" >&2; exit 1 ;;
esac
"""


@pytest.mark.parametrize("slurm", ["scontrol", "no scontrol"])
def test_hostfile_command_reads_the_slurm_nodelist(slurm, tmp_path):
    """With Slurm installed (a stand-in `scontrol` first on PATH) and without (no `scontrol` on
    PATH): the same hostfile, and a malformed list is refused either way."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if slurm == "scontrol":
        (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
        (bin_dir / "scontrol").chmod(0o755)
    out = tmp_path / "hostfile"
    proc = _pretrain("launch", "hostfile", "--slots", "4", "--output", str(out),
                     SLURM_JOB_NODELIST="c[1-3]", PATH=str(bin_dir))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "c1 slots=4\nc2 slots=4\nc3 slots=4\n"
    bad = tmp_path / "bad_hostfile"
    proc = _pretrain("launch", "hostfile", "--slots", "4", "--output", str(bad),
                     "--nodes", "c[1-", PATH=str(bin_dir))
    assert proc.returncode == 2 and proc.stderr.startswith("error: node list 'c[1-'"), proc.stderr
    assert not bad.exists()
    # Slurm's expansion is used where it is installed, for lists that are well formed only.
    calls = (bin_dir / "calls").read_text() if slurm == "scontrol" else ""
    assert calls == ("show hostnames c[1-3]\n" if slurm == "scontrol" else "")


def test_deepspeed_env_carries_the_run_environment_only():
    env = {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "4", "PYTHONPATH": "/x", "HOME": "/root",
           "DS_ACCELERATOR": "cuda", "MY_SETTING": "1", "SLURM_JOB_ID": "7",
           "VIRTUAL_ENV_PROMPT": "(.venv)", "PATHEXT": "x"}
    text = launch.deepspeed_env_text(env, names=("MY_SETTING",))
    assert text == "DS_ACCELERATOR=cuda\nMY_SETTING=1\nNCCL_DEBUG=WARN\nOMP_NUM_THREADS=4\nPYTHONPATH=/x\n"
    with pytest.raises(ConfigError, match="NCCL_X holds a newline"):
        launch.deepspeed_env_text({"NCCL_X": "a\nb"})


# ---- pre-flight --------------------------------------------------------------------------------
def test_preflight_records_the_resolved_run(tmp_path):
    proc = _pretrain("launch", "preflight", "--world-size", "4", "--accelerator", "cpu",
                     "--log-dir", str(tmp_path), *TINY, "--set", "parallel.pipeline=2",
                     "--deepspeed-config", "ds_configs/zero0.json")
    assert proc.returncode == 0, proc.stderr
    assert "layout  tp 1 x pp 2 x dp 2 = 4 ranks | global batch 4" in proc.stdout
    assert "engine  ZeRO-0" in proc.stdout
    assert (tmp_path / "plan.txt").read_text() == proc.stdout
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert (ds["train_batch_size"], ds["zero_optimization"]["stage"]) == (4, 0)
    assert "pipeline: 2" in (tmp_path / "config.yaml").read_text()
    commit = (tmp_path / "git_commit.txt").read_text()
    assert commit.startswith(subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, text=True,
                                            capture_output=True).stdout.strip())


def test_preflight_refuses_a_config_that_does_not_fit_the_world(tmp_path):
    # a batch no data-parallel size fits (3 ranks of a batch of 4 now train on 2 of them:
    # tests/test_world_fit.py)
    proc = _pretrain("launch", "preflight", "--world-size", "3", "--log-dir", str(tmp_path), *TINY,
                     "--set", "train.global_batch_size=5")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: train.global_batch_size=5 is not a multiple of train.micro_batch_size x "
        "data-parallel size = 2 x 3 = 6: set it to a multiple of 6"]
    assert not (tmp_path / "config.yaml").exists()
    proc = _pretrain("launch", "preflight", "--world-size", "2", "--search", *TINY)
    assert proc.returncode == 2 and "unrecognized arguments: --search" in proc.stderr


def test_preflight_plans_for_the_gpus_of_the_node_and_refuses_what_does_not_fit(tmp_path):
    """The batch script's node lists 8 x 16 GiB GPUs (a stand-in nvidia-smi): the 70B recipe's
    ~55 GB per GPU does not fit, so the pre-flight prints the plan and exits 2 before srun; on
    80 GiB GPUs it fits and records the run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    for memory_mib, fits in ((16384, False), (81559, True)):
        smi.write_text("#!/bin/sh\n" + "".join(
            f"echo 'Tesla GPU-{memory_mib}, {memory_mib}'\n" for _ in range(8)))
        smi.chmod(0o755)
        log_dir = tmp_path / f"log{memory_mib}"
        proc = _pretrain("launch", "preflight", "--world-size", "128", "--accelerator", "cuda",
                         "--no-build", "--config", "configs/llama_70b.yaml",
                         "--log-dir", str(log_dir),
                         PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        gib = memory_mib / 1024
        assert f"8 GPU(s), the smallest Tesla GPU-{memory_mib} with {gib:.1f} GiB" in proc.stdout
        if fits:
            assert proc.returncode == 0, proc.stderr
            assert "-> fits" in (log_dir / "plan.txt").read_text()
        else:
            assert proc.returncode == 2 and "DOES NOT FIT" in proc.stdout, proc.stderr
            errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and "nvidia-smi on this node" in errors[0], proc.stderr
            assert not (log_dir / "config.yaml").exists()


# ---- Slurm job logs ------------------------------------------------------------------------------
SBATCH_SCRIPTS = ["pretrain_7b.sh", "pretrain_13b.sh", "pretrain_70b.sh", "pretrain_qwen3_moe.sh",
                  "tune.sh", "zero_sweep.sh",
                  "ray_cluster.sh"]


def test_sbatch_output_is_in_a_directory_of_a_fresh_clone():
    """sbatch opens the #SBATCH --output file before the script runs: in a directory that does not
    exist (runs/ is ignored by git), the job fails without any log."""
    scripts = sorted(p.name for p in (REPO / "slurm").glob("*.sh")
                     if re.search(r"^#SBATCH ", p.read_text(), re.M))
    assert scripts == sorted(SBATCH_SCRIPTS)
    for script in scripts:
        text = (REPO / "slurm" / script).read_text()
        outputs = re.findall(r"^#SBATCH --output=(\S+)$", text, re.M)
        assert len(outputs) == 1, script
        parent = Path(outputs[0]).parent
        assert not parent.is_absolute(), f"{script}: {outputs[0]}"
        tracked = subprocess.run(["git", "ls-files", "--", str(parent)], cwd=REPO, text=True,
                                 capture_output=True, check=True).stdout
        assert parent == Path(".") or tracked, (
            f"{script}: #SBATCH --output={outputs[0]}: {parent}/ is not in a fresh clone")


def _job_shell(script: str, cwd: Path, *, stdout=subprocess.PIPE,
               **env: str) -> subprocess.CompletedProcess:
    """`script` in a bash with slurm/job_log.sh sourced as the job scripts do, in `cwd`."""
    env = {"PATH": os.environ["PATH"], **env}
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source {REPO}/slurm/job_log.sh; "
                           f"{script}"], cwd=cwd, env=env, stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=60)


def test_job_log_creates_runs_slurm_and_copies_the_job_output(tmp_path):
    job = {"SLURM_JOB_NAME": "llama70b", "SLURM_JOB_ID": "42"}
    # Slurm's TERM on cancel reaches every process of the job: tee stays for the last lines.
    proc = _job_shell('echo one; echo two >&2; kill -TERM "$JOB_LOG_PID"; echo three; exit 3',
                      tmp_path, **job)
    log = tmp_path / "runs" / "slurm" / "llama70b-42.out"
    assert proc.returncode == 3, proc.stderr  # the script's own exit status
    assert log.read_text() == "one\ntwo\nthree\n"
    assert (proc.stdout, proc.stderr) == ("one\ntwo\nthree\n", "")  # and still sbatch's --output
    # A requeued job (same id) appends; sourcing twice (zero_sweep.sh, then common.sh) copies once.
    proc = _job_shell(f"source {REPO}/slurm/job_log.sh; echo attempt 1", tmp_path, **job)
    assert proc.returncode == 0 and log.read_text() == "one\ntwo\nthree\nattempt 1\n"
    # sbatch --output pointing at that file already: no second copy of each line.
    with open(log, "a") as f:
        proc = _job_shell("echo attempt 2", tmp_path, stdout=f, **job)
    assert proc.returncode == 0 and log.read_text().endswith("attempt 1\nattempt 2\n")
    # Array tasks: the #SBATCH name of zero_sweep.sh, %x-%A_%a.
    proc = _job_shell("echo task 2", tmp_path, SLURM_JOB_NAME="zero_sweep", SLURM_JOB_ID="51",
                      SLURM_ARRAY_JOB_ID="49", SLURM_ARRAY_TASK_ID="2")
    assert (tmp_path / "runs" / "slurm" / "zero_sweep-49_2.out").read_text() == "task 2\n"


def test_job_scripts_set_up_the_log_before_anything_else():
    common = (REPO / "slurm" / "common.sh").read_text()
    assert common.index('source "$ROOT/slurm/job_log.sh"') < common.index("echo \"[slurm] job")
    sweep = (REPO / "slurm" / "zero_sweep.sh").read_text()
    assert sweep.index("source slurm/job_log.sh") < sweep.index("echo \"error:")
    for script in [*SBATCH_SCRIPTS, "common.sh", "job_log.sh"]:
        proc = subprocess.run(["bash", "-n", str(REPO / "slurm" / script)], capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr


def _zero_sweep_task(tmp_path: Path, task: int, **env: str) -> subprocess.CompletedProcess:
    """slurm/zero_sweep.sh as array task `task` in a copy of the repository's ds_configs/ whose
    slurm/common.sh only records, per task, the run directory and the arguments it got (a
    stand-in for the training job, which test_slurm runs for real), and whose `python` records
    the aggregation."""
    root = tmp_path / "root"
    if not root.exists():
        (root / "slurm").mkdir(parents=True)
        (root / "ds_configs").symlink_to(REPO / "ds_configs")
        (root / "slurm" / "common.sh").write_text(
            'ARGS="$*"  # what the real one hands `pretrain train` (RUN_ARGS)\n'
            'run_training() { mkdir -p "$RUN_DIR"\n'
            '  echo "$RUN_DIR|$ARGS" >> "$PRETRAIN_ROOT/runs.txt"; }\n'
            "finish_job() { :; }\n")
        (root / "bin").mkdir()
        (root / "bin" / "python").write_text(
            '#!/bin/bash\necho "$*" >> "$PRETRAIN_ROOT/aggregated.txt"\n')
        (root / "bin" / "python").chmod(0o755)
    full = {**_env(PRETRAIN_ROOT=str(root), SWEEP_DIR="sweep", SLURM_ARRAY_TASK_ID=str(task),
                   **env)}
    full["PATH"] = f"{root / 'bin'}:{full['PATH']}"
    return subprocess.run(["bash", str(REPO / "slurm" / "zero_sweep.sh"), "--set", "x=1"],
                          env=full, capture_output=True, text=True, timeout=60)


def test_zero_sweep_runs_every_config_once_per_engine(tmp_path):
    """ENGINES: task i runs config i // engines under engine i % engines, named as `pretrain
    sweep --engines` names its runs; without it the runs are DeepSpeed's, named by config."""
    configs = {"DS_CONFIGS": "ds_configs/zero3.json ds_configs/zero2.json"}
    for task in range(4):
        proc = _zero_sweep_task(tmp_path, task, ENGINES="deepspeed fsdp2", **configs)
        assert proc.returncode == 0, proc.stderr
    runs = (tmp_path / "root" / "runs.txt").read_text().splitlines()
    expected = [("deepspeed_zero2", "zero2", "deepspeed"), ("fsdp2_zero2", "zero2", "fsdp2"),
                ("deepspeed_zero3", "zero3", "deepspeed"), ("fsdp2_zero3", "zero3", "fsdp2")]
    assert len(runs) == 4, runs
    for line, (name, ds, engine) in zip(runs, expected):
        run_dir, args = line.split("|")
        assert run_dir == f"sweep/{name}", line
        assert args == (f"--deepspeed-config ds_configs/{ds}.json --set train.steps=50 "
                        f"--set train.engine={engine} --set x=1"), line
    aggregated = (tmp_path / "root" / "aggregated.txt").read_text().splitlines()
    assert aggregated == ["-m pretrain sweep --aggregate sweep"] * 4
    too_far = _zero_sweep_task(tmp_path, 4, ENGINES="deepspeed fsdp2", **configs)
    assert too_far.returncode == 2 and "submit with --array=0-3" in too_far.stderr
    for engines, reason in (("fsdp3", "not a train.engine"), ("fsdp2 fsdp2", "twice")):
        refused = _zero_sweep_task(tmp_path, 0, ENGINES=engines, **configs)
        assert refused.returncode == 2 and reason in refused.stderr, refused.stderr
    plain = _zero_sweep_task(tmp_path / "plain", 1, **configs)
    assert plain.returncode == 0, plain.stderr
    assert (tmp_path / "plain" / "root" / "runs.txt").read_text() == \
        "sweep/zero3|--deepspeed-config ds_configs/zero3.json --set train.steps=50 --set x=1\n"
