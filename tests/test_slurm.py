"""The real `slurm/*.sh` scripts on a real local Slurm cluster (tests/slurm_cluster.py).

Four slurmd "nodes" on this host (a job gets two unless it asks for the `wide` partition), one CPU
rank each: the 70B script with tiny overrides trains and checkpoints; USR1 leads to a checkpoint,
a requeue and a resume at the next step (also on three of the four nodes the first attempt had:
the data-parallel checkpoint is resharded onto the ranks the batch can use, one sits idle, and
the losses are an uninterrupted run's); a hung rank is named; the ZeRO sweep array leaves a result
table; the tasks of the tune array share one study; a bad config fails in the pre-flight with its
message in the log; a fault is requeued once and not again at the same step.
Each test submits exactly what a user would, with `sbatch` options and environment overrides.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import require_root
from slurm_cluster import WIDE_PARTITION, SlurmCluster

from pretrain.testing.faults import hang_environment
from pretrain.testing.runs import rel_diff, train

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)

REPO = Path(__file__).resolve().parents[1]
# One cluster for the module: its tests must run on one pytest-xdist worker, or each worker would
# start its own cluster on the same node names and ports. launch/test.sh passes --dist loadfile
# (a file is one unit of work). Not --dist loadgroup: pytest-xdist 3.8 marks groups by setting
# `item._nodeid`, which pytest 9 no longer reads, so xdist_group marks are silently ignored.

# 2 nodes x 1 CPU rank, one thread each; everything else from the script's #SBATCH header. A time
# limit of 60 min puts the header's USR1 (10 min before the end) out of the tests' way.
TWO_CPU_NODES = ["--nodes", "2", "--ntasks-per-node", "1", "--gpus-per-node", "0",
                 "--cpus-per-task", "1", "--time", "60"]
# The 70B config shrunk to the tiny model, keeping its shape: pipeline across the 2 nodes, ZeRO-1
# (no tensor parallelism across 1 rank a node, so no sequence parallelism either).
TINY_70B = ["model.preset=tiny", "model.seq_length=64", "parallel.tensor=1", "parallel.pipeline=2",
            "parallel.sequence_parallel=false",
            "train.micro_batch_size=2", "train.global_batch_size=4", "train.precision=fp32",
            "train.warmup_steps=2", "train.eval_interval=0", "data.num_workers=0",
            "logging.report_to=[]",
            "logging.progress_bar=false", "checkpoint.save_final=false"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_root("the Slurm tests run slurmctld and slurmd as root on this machine")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


def _sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _submit(cluster: SlurmCluster, script: str, tmp: Path, *, sbatch_args: list[str],
            env: dict[str, str], script_args: list[str]) -> str:
    return cluster.sbatch(f"slurm/{script}", options=[*sbatch_args, "--output", f"{tmp}/%x-%j.out"],
                          script_args=script_args, env=env, cwd=REPO)


def _log(tmp: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp.glob("*.out")))


def _train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "train"]


def _submit_tiny_70b(cluster: SlurmCluster, data: dict[str, str], tmp: Path,
                     *overrides: str, env: dict[str, str] | None = None) -> tuple[str, Path, Path]:
    """slurm/pretrain_70b.sh on 2 nodes x 1 CPU rank with TINY_70B + overrides (and `env` for
    the job); (job, run, log dir)."""
    run_dir, log_dir = tmp / "run", tmp / "job"
    job = _submit(cluster, "pretrain_70b.sh", tmp, sbatch_args=TWO_CPU_NODES,
                  env={"RUN_DIR": str(run_dir), "LOG_DIR": str(log_dir), **(env or {})},
                  script_args=_sets(*TINY_70B, *overrides, f"data.tokenizer={data['tokenizer']}",
                                    f"data.dataset={data['dataset']}"))
    return job, run_dir, log_dir


def _done(cluster: SlurmCluster, job_id: str, tmp: Path, *, timeout: float = 420):
    jobs = cluster.wait(job_id, timeout=timeout)
    return jobs, _log(tmp)


def test_70b_script_trains_on_two_nodes_checkpoints_on_usr1_requeues_and_resumes(
        cluster, tiny_data, tmp_path):
    """slurm/pretrain_70b.sh, shrunk to the tiny model on 2 nodes: the job records what it ran,
    USR1 (sent once step 2 is logged, with enough steps left that it lands mid-run) checkpoints
    and requeues it, and the second attempt finishes the run with no step repeated or lost."""
    job, run_dir, log_dir = _submit_tiny_70b(cluster, tiny_data, tmp_path, "train.steps=60",
                                             "train.micro_batch_size=1", "train.global_batch_size=2",
                                             "checkpoint.save_interval=40",
                                             "checkpoint.save_final=true")
    deadline = time.monotonic() + 300
    while len(_train_steps(run_dir)) < 2:
        assert time.monotonic() < deadline, _log(tmp_path)
        assert cluster.job(job)[0].state in ("PENDING", "RUNNING"), _log(tmp_path)
        time.sleep(0.2)  # polling a condition, not synchronising on time
    cluster.run(["scancel", "--signal=USR1", "--batch", job])
    (info,), log = _done(cluster, job, tmp_path, timeout=600)
    assert (info.state, info.exit_code) == ("COMPLETED", "0:0"), log
    assert info.fields["NodeList"] == "pretrain-node[1-2]"
    assert info.fields["Restarts"] == "1", log
    attempts = (log_dir / "attempts.txt").read_text().splitlines()
    assert attempts == ["attempt=0 exit=75", "attempt=1 exit=0"], log
    assert "requeueing job" in log
    # The pre-flight's layout and the job record in the log directory.
    assert "layout  tp 1 x pp 2 x dp 1 = 2 ranks" in log
    assert (log_dir / "plan.txt").read_text() in log
    assert "pretrain-node1:" in log  # master address from scontrol show hostnames
    assert len((log_dir / "git_commit.txt").read_text().split()[0]) == 40
    assert json.loads((log_dir / "ds_config.json").read_text())["zero_optimization"]["stage"] == 1
    assert "preset: tiny" in (log_dir / "config.yaml").read_text()
    # Two ranks, one per node, through srun (discover_world's Slurm mapping), in both attempts.
    starts = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in starts if r["kind"] == "run"]
    assert [(r["world_size"], r["launcher"]) for r in starts] == [(2, "slurm")] * 2, starts
    # Attempt 1 continues at the step after the checkpoint of attempt 0: no step repeated or lost.
    steps = _train_steps(run_dir)
    assert steps == list(range(1, 61)), steps
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step60"
    assert (run_dir / "checkpoints" / "step40").is_dir() and (run_dir / "final").is_dir()


def test_a_four_rank_job_requeued_on_three_nodes_resumes_with_the_same_losses(
        cluster, tiny_data, tmp_path):
    """A data-parallel job on 4 nodes x 1 rank (global batch 8, micro-batch 1: dp 4) loses node
    4: it is drained, USR1 checkpoints and requeues the job, the requeued job is given the three
    nodes left (`scontrol update NumNodes=3`: this Slurm starts a node-count range at its
    minimum even when more nodes are idle, so a range cannot show the shrink). dp 3 does not divide 8: ranks 0-1 reshard
    the dp 4 checkpoint to dp 2, rank 2 sits idle until they finish (srun would end the job's
    other ranks if it left early), and the job exits 0 with the same global batch, no step
    repeated or lost, and the losses of an uninterrupted run (one process, the same config)."""
    run_dir, log_dir = tmp_path / "run", tmp_path / "job"
    four_nodes = [*TWO_CPU_NODES, "--partition", WIDE_PARTITION]
    four_nodes[four_nodes.index("--nodes") + 1] = "4"
    settings = [*TINY_70B, "parallel.pipeline=1", "train.steps=30", "train.micro_batch_size=1",
                "train.global_batch_size=8"]
    job = _submit(cluster, "pretrain_70b.sh", tmp_path, sbatch_args=four_nodes,
                  env={"RUN_DIR": str(run_dir), "LOG_DIR": str(log_dir)},
                  script_args=_sets(*settings, f"data.tokenizer={tiny_data['tokenizer']}",
                                    f"data.dataset={tiny_data['dataset']}"))
    deadline = time.monotonic() + 300
    while len(_train_steps(run_dir)) < 2:
        assert time.monotonic() < deadline, _log(tmp_path)
        assert cluster.job(job)[0].state in ("PENDING", "RUNNING"), _log(tmp_path)
        time.sleep(0.2)  # polling a condition, not synchronising on time
    assert cluster.job(job)[0].fields["NodeList"] == "pretrain-node[1-4]"
    cluster.run(["scontrol", "update", "nodename=pretrain-node4", "state=drain",
                 "reason=the shrink test"])
    try:
        cluster.run(["scancel", "--signal=USR1", "--batch", job])
        # requeued, it waits for a fourth node that is drained: give it the three left
        while not (cluster.job(job)[0].state == "PENDING"
                   and cluster.job(job)[0].fields.get("Restarts") == "1"):
            assert time.monotonic() < deadline + 300, _log(tmp_path)
            time.sleep(0.2)  # polling a condition, not synchronising on time
        # (and its CPUs: the job still asks for the 4 of its first attempt)
        cluster.run(["scontrol", "update", f"jobid={job}", "NumNodes=3", "NumTasks=3",
                     "NumCPUs=3"])
        (info,), log = _done(cluster, job, tmp_path, timeout=600)
    finally:
        cluster.run(["scontrol", "update", "nodename=pretrain-node4", "state=resume"])
    assert (info.state, info.exit_code) == ("COMPLETED", "0:0"), log
    assert info.fields["Restarts"] == "1" and info.fields["NodeList"] == "pretrain-node[1-3]", log
    assert "attempt=0 exit=75" in (log_dir / "attempts.txt").read_text()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    starts = [(r["world_size"], r["data_parallel"], r["global_batch"]) for r in records
              if r["kind"] == "run"]
    assert starts == [(4, 4, 8), (2, 2, 8)], starts
    assert ("training on ranks 0-1 of 3; rank 2 sits idle until the job ends: data parallel 3 "
            "does not divide train.global_batch_size=8") in log
    assert "resharded tp1 pp1 dp4 ZeRO-1 -> tp1 pp1 dp2 ZeRO-1" in log
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, 31))
    # the uninterrupted run: one process, 2 micro-batches of 4 a step (the same 8 samples)
    whole = train(tmp_path, tiny_data, config="configs/llama_70b.yaml", name="whole",
                  overrides=[*settings, "train.micro_batch_size=4"])
    reference = [r for r in whole.records if r["kind"] == "train"]
    assert [r["consumed_samples"] for r in steps] == [r["consumed_samples"] for r in reference]
    assert rel_diff([r["loss"] for r in steps], [r["loss"] for r in reference]) < 1e-5


def test_a_hung_rank_is_named_and_the_requeued_job_finishes(cluster, tiny_data, tmp_path):
    """Rank 1 (node 2) blocks inside step 2 in the job's first attempt: the watchdog names it in
    hang/verdict.txt and the job log, every rank exits 75, Slurm requeues the job, and the second
    attempt resumes from step 1's checkpoint and finishes, every step once."""
    job, run_dir, log_dir = _submit_tiny_70b(
        # data parallel over the 2 nodes: the hang is injected where a flat model's step starts
        # a micro-batch (a pipeline's micro-batches are DeepSpeed's)
        cluster, tiny_data, tmp_path, "parallel.pipeline=1", "train.steps=4",
        "train.micro_batch_size=1",
        "train.global_batch_size=2", "checkpoint.save_interval=1",
        "train.hang_timeout_minutes=0.1", "train.collective_timeout_minutes=1",
        env=hang_environment(2, 1, "block", directory=tmp_path, first_attempt_only=True))
    (info,), log = _done(cluster, job, tmp_path, timeout=600)
    assert (info.state, info.exit_code) == ("COMPLETED", "0:0"), log
    attempts = (log_dir / "attempts.txt").read_text().splitlines()
    assert attempts == ["attempt=0 exit=75", "attempt=1 exit=0"], log
    verdict = (run_dir / "hang" / "verdict.txt").read_text().strip()
    assert verdict.startswith("[hang] rank 1 (") and "rank 0 waits in" in verdict, verdict
    assert verdict in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["ranks"] for r in records if r["kind"] == "hang"] == [[1]]
    assert _train_steps(run_dir) == [1, 2, 3, 4]


def test_zero_sweep_array_leaves_result_table(cluster, tiny_data, tmp_path):
    sweep = tmp_path / "sweep"
    configs = [f"ds_configs/zero{s}.json" for s in range(4)]
    env = {"CONFIG": "configs/tiny.yaml", "SWEEP_DIR": str(sweep), "SWEEP_STEPS": "3",
           "DS_CONFIGS": " ".join(configs)}
    job = _submit(cluster, "zero_sweep.sh", tmp_path,
                  sbatch_args=["--array", "0-3", "--ntasks-per-node", "2", "--gpus-per-node", "0",
                               "--cpus-per-task", "1", "--time", "60"], env=env,
                  script_args=_sets("data.num_workers=0", f"data.tokenizer={tiny_data['tokenizer']}",
                                    f"data.dataset={tiny_data['dataset']}"))
    tasks, log = _done(cluster, job, tmp_path, timeout=600)
    assert len(tasks) == 4 and all(t.state == "COMPLETED" for t in tasks), log
    # One row per config from `pretrain sweep --aggregate`, run by the last task to finish.
    table = (sweep / "sweep.md").read_text().splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in table[2:]]
    assert sorted(r["name"] for r in rows) == ["zero0", "zero1", "zero2", "zero3"], table
    for row in rows:
        assert (row["status"], row["steps"], row["world_size"]) == ("ok", "3", "2"), table
        assert row["zero_stage"] == row["name"][-1], table
        assert float(row["tokens_per_s"]) > 0 and float(row["final_loss"]) > 0, table
    for s in range(4):
        ds = json.loads((sweep / f"zero{s}" / "job" / "ds_config.json").read_text())
        assert ds["zero_optimization"]["stage"] == s


def test_tune_array_tasks_are_workers_of_one_study(cluster, tiny_data, tmp_path):
    """slurm/tune.sh as a 2-task array: both tasks work on one study (its journal in STUDY_DIR),
    each trial a 2-rank torchrun run; together they run exactly TRIALS trials."""
    import csv

    import yaml

    study = tmp_path / "study"
    env = {"CONFIG": "configs/tiny.yaml", "SPACE": "configs/tune/space.yaml", "TRIALS": "4",
           "STUDY_DIR": str(study)}
    job = _submit(cluster, "tune.sh", tmp_path,
                  sbatch_args=["--array", "0-1", "--ntasks-per-node", "2", "--gpus-per-node", "0",
                               "--cpus-per-task", "1", "--time", "60"], env=env,
                  script_args=_sets("data.num_workers=0", "train.steps=3",
                                    f"data.tokenizer={tiny_data['tokenizer']}",
                                    f"data.dataset={tiny_data['dataset']}"))
    tasks, log = _done(cluster, job, tmp_path, timeout=600)
    assert len(tasks) == 2 and all(t.state == "COMPLETED" for t in tasks), log
    rows = list(csv.DictReader(open(study / "trials.csv")))
    assert sorted(int(r["number"]) for r in rows) == [0, 1, 2, 3], log
    assert all(r["state"] in ("COMPLETE", "PRUNED") for r in rows), log
    assert len({r["user_attrs_worker"] for r in rows}) == 2, log  # both tasks ran trials
    for r in rows:
        run = json.loads((Path(r["user_attrs_run_dir"]) / "metrics.jsonl").read_text()
                         .splitlines()[0])
        assert (run["world_size"], run["launcher"]) == (2, "torchrun"), r
    best = yaml.safe_load((study / "best.yaml").read_text())
    assert best["objective"] == "train loss" and best["command"] in log
    assert "4 trials, 2 ranks per trial" in log and "[tune] best trial " in log


def test_bad_config_fails_fast_with_message_in_log(cluster, tiny_data, tmp_path):
    # tp 3 cannot split the tiny model's 4 heads: refused by the pre-flight, before srun starts
    # any rank (not requeued, as more nodes would not cure it).
    job, run_dir, _ = _submit_tiny_70b(cluster, tiny_data, tmp_path, "parallel.tensor=3")
    (info,), log = _done(cluster, job, tmp_path, timeout=120)
    assert (info.state, info.exit_code) == ("FAILED", "2:0"), log
    assert "error: parallel.tensor=3: must divide model.num_heads=4" in log
    assert "not requeued" in log and info.fields["Restarts"] == "0"
    assert not run_dir.exists()  # no rank ever started


def test_a_fault_is_requeued_and_not_again_at_the_same_step(cluster, tmp_path):
    """`finish_job` of slurm/common.sh after ranks that faulted (exit 3) at step 5, without
    training (seconds): the job is requeued once; its second attempt faults at step 5 again and
    ends with 3, not requeued (slurm/faults.sh's rules are unit-tested in tests/test_first_run.py)."""
    run_dir, log_dir = tmp_path / "run", tmp_path / "job"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 5}) + "\n")
    script = ("bash -c 'source slurm/common.sh; JOB_RC=3; "
              "echo attempt=$ATTEMPT exit=3 >> $LOG_DIR/attempts.txt; finish_job'")
    job = cluster.sbatch(None, cwd=REPO, options=[
        *TWO_CPU_NODES, "--requeue", "--open-mode=append", "--output", f"{tmp_path}/%x-%j.out",
        "--wrap", script],
        env={"CONFIG": "configs/tiny.yaml", "RUN_DIR": str(run_dir), "LOG_DIR": str(log_dir)})
    (info,), log = _done(cluster, job, tmp_path, timeout=180)
    assert (info.state, info.exit_code) == ("FAILED", "3:0"), log
    assert info.fields["Restarts"] == "1", log
    assert (log_dir / "attempts.txt").read_text() == "attempt=0 exit=3\nattempt=1 exit=3\n"
    assert (log_dir / "faults.txt").read_text() == "step=5\nstep=5\n"
    assert "fault 1 of at most 2 requeued (SLURM_FAULT_REQUEUES), at step 5" in log
    assert "faulted at step 5 again: not requeued" in log


@pytest.fixture(scope="module")
def deepspeed_multi_node_run(cluster, tiny_data, tmp_path_factory):
    """launch/multi_node.sh on 2 nodes with DeepSpeed's Slurm backend (it runs srun): 3 steps of
    the tiny config; (job info, log, run dir, launch dir). Also the reference of the Ray job."""
    tmp = tmp_path_factory.mktemp("multi_node")
    run_dir, launch_dir = tmp / "run", tmp / "launch"
    train_args = " ".join(["--config configs/tiny.yaml", *(f"--set {o}" for o in (
        "train.steps=3", "data.num_workers=0", f"run_dir={run_dir}",
        f"data.tokenizer={tiny_data['tokenizer']}", f"data.dataset={tiny_data['dataset']}"))])
    script = f"LAUNCHER=slurm LAUNCH_DIR={launch_dir} bash launch/multi_node.sh {train_args}"
    job = cluster.sbatch(None, cwd=REPO, options=["--nodes", "2", "--ntasks-per-node", "1",
                                                  "--output", f"{tmp}/%x-%j.out",
                                                  "--wrap", script])
    (info,), log = _done(cluster, job, tmp)
    return info, log, run_dir, launch_dir


# LAUNCHER=no_ssh (srun starting one `deepspeed --no_ssh` per node, DeepSpeed's other multi-node
# mode in an allocation) passed the same test once; it is left out of the suite for its minute of
# CPU time.
def test_multi_node_deepspeed_launcher_in_an_allocation(deepspeed_multi_node_run):
    """launch/multi_node.sh on 2 nodes: hostfile and .deepspeed_env from the job, DeepSpeed's
    Slurm backend starts one rank per node."""
    info, log, run_dir, launch_dir = deepspeed_multi_node_run
    assert (info.state, info.exit_code) == ("COMPLETED", "0:0"), log
    assert (launch_dir / "hostfile").read_text() == "pretrain-node1 slots=1\npretrain-node2 slots=1\n"
    assert "DS_ACCELERATOR=cpu\n" in (launch_dir / "deepspeed_env").read_text()
    assert f"deepspeed_env file = {launch_dir}/deepspeed_env" in log
    run = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    # DeepSpeed's Slurm backend leaves rank discovery to SLURM_PROCID (discover_world).
    assert (run["world_size"], run["launcher"]) == (2, "slurm")
    assert _train_steps(run_dir) == [1, 2, 3]


def test_ray_cluster_script_trains_like_the_deepspeed_launcher(deepspeed_multi_node_run, cluster,
                                                               tiny_data, tmp_path):
    """slurm/ray_cluster.sh on 2 nodes: a Ray head on the first, a Ray node on the second (both
    with the token the script made for the job), `pretrain launch ray` with one rank per node;
    the run's losses equal the deepspeed launcher's on the same allocation shape, the job ends 0
    and leaves no Ray process behind. (Both Ray nodes run on this one host and tail the same log files, so each
    worker line appears twice in the job log; on a cluster it appears once.)"""
    run_dir, log_dir = tmp_path / "run", tmp_path / "job"
    job = _submit(cluster, "ray_cluster.sh", tmp_path,
                  sbatch_args=["--nodes", "2", "--ntasks-per-node", "1", "--gpus-per-node", "0",
                               "--cpus-per-task", "1", "--time", "60"],
                  env={"CONFIG": "configs/tiny.yaml", "RUN_DIR": str(run_dir),
                       "LOG_DIR": str(log_dir)},
                  script_args=_sets("train.steps=3", "data.num_workers=0",
                                    f"data.tokenizer={tiny_data['tokenizer']}",
                                    f"data.dataset={tiny_data['dataset']}"))
    (info,), log = _done(cluster, job, tmp_path)
    assert (info.state, info.exit_code) == ("COMPLETED", "0:0"), log
    assert "[slurm] Ray head on pretrain-node1" in log and "2 nodes x 1 ranks" in log
    assert "Authentication token is missing" not in log
    assert (log_dir / "attempts.txt").read_text() == "attempt=0 exit=0\n"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["launcher"], r["world_size"]) for r in records if r["kind"] == "run"] == [("ray", 2)]
    reference = deepspeed_multi_node_run[2] / "metrics.jsonl"
    expected = [r["loss"] for r in map(json.loads, reference.read_text().splitlines())
                if r["kind"] == "train"]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 3 and losses == expected
    # every process srun started, and what they started (Ray's daemons, its workers), has the id
    assert not _processes_with(f"SLURM_JOB_ID={job}"), "Ray processes outlived the job"


def _processes_with(variable: str) -> list[int]:
    """Pids of the processes whose environment holds `variable` (NAME=value)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and variable.encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:  # ended meanwhile
            pass
    return found
