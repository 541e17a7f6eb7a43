"""`pretrain launch k8s`: the manifests validated against the Kubernetes OpenAPI schemas
(kubernetes-validate, offline) and the training operator's published PyTorchJob CRD
(tests/k8s/, v1.9.0); the pod's exit statuses; and the pod's command line run as two local pods
against a run of 2 ranks with the deepspeed launcher's environment. No Kubernetes cluster runs here."""
from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pretrain import k8s
from pretrain.commands.launch import RANK_ENV, pod_env
from pretrain.cli import build_parser
from pretrain.commands.launch_k8s import ranks_exit_status, spec_of
from pretrain.testing.runs import train

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "tests" / "k8s" / "kubeflow.org_pytorchjobs.v1.9.0.yaml"
K8S_VERSIONS = ("1.31", "1.37")  # podFailurePolicy is GA from 1.31; the newest schemas shipped
ENV = pod_env()
TRAIN = ["--config", "configs/tiny.yaml", "--set", "train.steps=3"]


def _spec(**kw) -> k8s.JobSpec:
    base = dict(name="pretrain-tiny", image="reg.example/pretrain:1", nodes=4, gpus_per_node=8,
                min_nodes=2, train_args=["--config", "configs/tiny.yaml"], run_dir="runs/tiny")
    return k8s.JobSpec(**{**base, **kw})


def _strict(schema: dict) -> dict:
    """The CRD schema with unknown fields refused: the API server would prune them silently."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(schema)
    return schema


@pytest.fixture(scope="module")
def pytorchjob_schema() -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # 600 kB: seconds in pure Python
    crd = next(doc for doc in yaml.load_all(CRD.read_text(), Loader=loader) if doc)
    assert crd["metadata"]["name"] == "pytorchjobs.kubeflow.org"
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return _strict(version["schema"]["openAPIV3Schema"])


def _validate(doc: dict, pytorchjob_schema: dict) -> None:
    if doc["kind"] == "PyTorchJob":
        jsonschema.Draft7Validator(pytorchjob_schema).validate(doc)
    elif doc["kind"] == "PodGroup":  # Volcano's CRD is not shipped here: its fields by hand
        assert doc["apiVersion"] == "scheduling.volcano.sh/v1beta1"
        assert set(doc["spec"]) == {"minMember", "queue"}
    else:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


CASES = {
    "pytorchjob": {},
    "pytorchjob-volcano": dict(scheduler="volcano", queue="research"),
    "pytorchjob-kueue-pvc": dict(scheduler="kueue", queue="team-a", pvc="shared-runs"),
    "indexed": dict(kind="indexed-job"),
    "indexed-volcano-volume": dict(kind="indexed-job", scheduler="volcano",
                                   volume={"nfs": {"server": "nfs1", "path": "/runs"}}),
    "indexed-kueue-cpu": dict(kind="indexed-job", scheduler="kueue", queue="q", gpus_per_node=0,
                              cpu="8", memory="32Gi", storage_class="fast", namespace="ml"),
    "pytorchjob-rdma": dict(pod_resources={"rdma/hca_shared_devices_a": "1"}, ipc_lock=True,
                            host_network=True, networks="default/ib", termination_grace_s=900),
    "indexed-volcano-rdma": dict(kind="indexed-job", scheduler="volcano", ipc_lock=True,
                                 pod_resources={"nvidia.com/hostdev": "8"}, networks="ib-a,ib-b"),
}


@pytest.mark.parametrize("case", CASES)
def test_every_manifest_validates_against_the_published_schemas(case, pytorchjob_schema):
    spec = _spec(**CASES[case])
    docs = k8s.manifests(spec, rank_env=ENV)
    for doc in yaml.safe_load_all(k8s.to_yaml(docs)):  # what kubectl apply would read
        _validate(doc, pytorchjob_schema)
    kinds = [doc["kind"] for doc in docs]
    claim = [] if spec.pvc or spec.volume else ["PersistentVolumeClaim"]
    if spec.kind == "pytorchjob":
        assert kinds == claim + ["PyTorchJob"]
    else:
        gang = ["PodGroup"] if spec.scheduler == "volcano" else []
        assert kinds == claim + gang + ["Service", "Job"]


def test_a_wrong_field_fails_the_validators(pytorchjob_schema):
    """The validators catch what they are here for (a typo, a wrong type)."""
    job, = k8s.manifests(_spec(pvc="x"), rank_env=ENV)
    job["spec"]["elasticPolicy"]["minReplica"] = 1  # typo
    with pytest.raises(jsonschema.ValidationError, match="minReplica"):
        _validate(job, pytorchjob_schema)
    indexed = k8s.manifests(_spec(kind="indexed-job", pvc="x"), rank_env=ENV)[-1]
    indexed["spec"]["completions"] = "4"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(indexed, pytorchjob_schema)


def test_pytorchjob_is_elastic_and_restarts_on_the_retryable_codes():
    job, = k8s.manifests(_spec(pvc="runs", scheduler="volcano"), rank_env=ENV)
    assert job["spec"]["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 4,
                                            "rdzvBackend": "c10d", "rdzvPort": 29400,
                                            "maxRestarts": 10}
    assert job["spec"]["nprocPerNode"] == "8"
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert (worker["replicas"], worker["restartPolicy"]) == (4, "ExitCode")
    assert job["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 2, "queue": "default"}
    pod = worker["template"]["spec"]
    assert pod["schedulerName"] == "volcano"
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 8}
    # the operator (v1.9) restarts ExitCode replicas on codes >= 128 only
    assert k8s.POD_EXIT == {2: 2, 3: 131, 75: 203}
    script = k8s.script_of(job)
    assert "--rdzv-endpoint pretrain-tiny-worker-0:29400" in script
    assert "--nnodes 2:4 --nproc-per-node 8" in script


def test_indexed_job_fails_on_bad_input_and_restarts_faults():
    *_, service, job = k8s.manifests(_spec(kind="indexed-job", scheduler="kueue", queue="q"),
                                     rank_env=ENV)
    assert service["spec"]["clusterIP"] == "None"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q"
    assert job["spec"]["suspend"] is True
    rules = {rule["action"]: rule for rule in job["spec"]["podFailurePolicy"]["rules"]
             if "onExitCodes" in rule}
    assert rules["FailJob"]["onExitCodes"]["values"] == [2]
    assert rules["Ignore"]["onExitCodes"]["values"] == [203]  # saved for a requeue: not a failure
    assert rules["Count"]["onExitCodes"]["values"] == [131]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    assert "--rdzv-endpoint pretrain-tiny-0.pretrain-tiny:29400" in k8s.script_of(job)


def test_pods_get_the_environment_the_slurm_scripts_set():
    common = (REPO / "slurm" / "common.sh").read_text()
    for name, value in RANK_ENV.items():
        assert re.search(rf'^export {name}=("\$\{{{name}:-{value}\}}"|{value})\s', common, re.M), \
            f"slurm/common.sh no longer exports {name}={value}: update RANK_ENV with it"
    job, = k8s.manifests(_spec(pvc="x"), rank_env=ENV)
    assert k8s.env_of(job).items() >= RANK_ENV.items()


def _pod(doc: dict) -> dict:
    """The pod template of a generated job."""
    if doc["kind"] == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    return doc["spec"]["template"]


# each option for NCCL over RDMA: (JobSpec field and value, where it lands in the pod template)
RDMA_OPTIONS = {
    "pod_resources": ({"rdma/hca_shared_devices_a": "1", "nvidia.com/hostdev": "2"},
                      lambda pod: {k: v for k, v in pod["spec"]["containers"][0]["resources"]
                                   ["limits"].items() if k != "nvidia.com/gpu"}),
    "ipc_lock": (True, lambda pod: pod["spec"]["containers"][0].get("securityContext")),
    "host_network": (True, lambda pod: (pod["spec"].get("hostNetwork"),
                                        pod["spec"].get("dnsPolicy"))),
    "networks": ("default/ib-sriov",
                 lambda pod: pod["metadata"].get("annotations", {}).get(k8s.MULTUS_NETWORKS)),
}
RDMA_EXPECTED = {
    "pod_resources": {"rdma/hca_shared_devices_a": "1", "nvidia.com/hostdev": "2"},
    "ipc_lock": {"capabilities": {"add": ["IPC_LOCK"]}},
    "host_network": (True, "ClusterFirstWithHostNet"),  # the Service's DNS name still resolves
    "networks": "default/ib-sriov",
}
RDMA_ABSENT = {"pod_resources": {}, "ipc_lock": None, "host_network": (None, None),
               "networks": None}


@pytest.mark.parametrize("kind", ["pytorchjob", "indexed-job"])
@pytest.mark.parametrize("option", RDMA_OPTIONS)
def test_each_rdma_option_reaches_the_pods(option, kind):
    value, where = RDMA_OPTIONS[option]
    job = k8s.manifests(_spec(kind=kind, pvc="x", **{option: value}), rank_env=ENV)[-1]
    assert where(_pod(job)) == RDMA_EXPECTED[option]
    plain = k8s.manifests(_spec(kind=kind, pvc="x"), rank_env=ENV)[-1]
    assert where(_pod(plain)) == RDMA_ABSENT[option]  # nothing of it unless asked
    assert _pod(job)["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_multus_networks_and_volcanos_group_share_the_annotations():
    job = k8s.manifests(_spec(kind="indexed-job", scheduler="volcano", networks="ib"),
                        rank_env=ENV)[-1]
    assert _pod(job)["metadata"]["annotations"] == {k8s.MULTUS_NETWORKS: "ib",
                                                   "scheduling.k8s.io/group-name": "pretrain-tiny"}


def _k8s_args(*extra: str):
    return build_parser().parse_args(["launch", "k8s", "--config", "configs/tiny.yaml", "--nodes",
                                      "2", "--gpus-per-node", "8", "--image", "img", *extra])


def test_rdma_and_grace_options_of_the_command_line():
    spec = spec_of(_k8s_args("--pod-resource", "rdma/hca_shared_devices_a=1", "--pod-resource",
                             "nvidia.com/hostdev=8", "--ipc-lock", "--host-network",
                             "--network", "default/ib", "--termination-grace", "900"))
    assert spec.pod_resources == {"rdma/hca_shared_devices_a": "1", "nvidia.com/hostdev": "8"}
    assert (spec.ipc_lock, spec.host_network, spec.networks) == (True, True, "default/ib")
    assert spec.termination_grace_s == 900
    plain = spec_of(_k8s_args())
    assert (plain.pod_resources, plain.ipc_lock, plain.host_network, plain.networks) == \
        ({}, False, False, None)
    assert plain.termination_grace_s == k8s.DEFAULT_TERMINATION_GRACE_S == 600
    with pytest.raises(k8s.ConfigError, match="NAME=COUNT"):
        spec_of(_k8s_args("--pod-resource", "rdma/hca_shared_devices_a"))
    with pytest.raises(k8s.ConfigError, match="--gpus-per-node"):
        k8s.manifests(_spec(pod_resources={"nvidia.com/gpu": "4"}), rank_env=ENV)


@pytest.mark.parametrize("kind", ["pytorchjob", "indexed-job"])
def test_pods_get_the_termination_grace_and_the_run_knows_it(kind):
    """terminationGracePeriodSeconds is the SIGTERM-to-SIGKILL time the ranks have to finish a
    step and save; the run's hang watchdog reads it from PRETRAIN_TERMINATION_GRACE_S."""
    from pretrain.training.hang import PLATFORM_GRACE_ENV, platform_grace

    job = k8s.manifests(_spec(kind=kind, termination_grace_s=900), rank_env=ENV)[-1]
    assert _pod(job)["spec"]["terminationGracePeriodSeconds"] == 900
    assert k8s.env_of(job)[PLATFORM_GRACE_ENV] == "900"
    assert platform_grace(k8s.env_of(job)) == 900.0
    default = k8s.manifests(_spec(kind=kind), rank_env=ENV)[-1]
    assert _pod(default)["spec"]["terminationGracePeriodSeconds"] == 600  # not Kubernetes' 30


def test_grace_from_the_plan_covers_a_step_and_a_save():
    from types import SimpleNamespace

    def plan(step_s: float, state_gb: float):
        return SimpleNamespace(time=SimpleNamespace(step=step_s), memory=SimpleNamespace(
            params=state_gb * 1e9 / 4, optimizer=state_gb * 1e9 * 3 / 4, host=0.0))

    # 20 s steps, 20 GB of state a GPU (40 s at 0.5 GB/s): twice (20 + 40), plus 60 s
    assert k8s.grace_from_plan(plan(20.0, 20.0)) == 2 * (20 + 40) + 60
    assert k8s.grace_from_plan(plan(0.1, 0.1)) == k8s.MIN_TERMINATION_GRACE_S  # a tiny model
    offloaded = plan(20.0, 4.0)
    offloaded.memory.host = 16e9  # the optimizer state in host memory is saved too
    assert k8s.grace_from_plan(offloaded) == k8s.grace_from_plan(plan(20.0, 20.0))


# ---- what each exit status makes the job do, read from the manifests ------------------------
def _indexed_job_action(job: dict, exit_code: int, *, disrupted: bool = False) -> str:
    """The Indexed Job's podFailurePolicy as Kubernetes applies it to a failed pod: the first
    rule that matches, else Count (against backoffLimit)."""
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes and codes["containerName"] == k8s.CONTAINER and codes["operator"] == "In" \
                and exit_code in codes["values"]:
            return rule["action"]
        conditions = rule.get("onPodConditions", [])
        if disrupted and {"type": "DisruptionTarget", "status": "True"} in conditions:
            return rule["action"]
    return "Count"


@pytest.mark.parametrize("status, pod_status, indexed_action, operator_restarts", [
    (2, 2, "FailJob", False),  # bad input: never restarted, the job fails
    (3, 131, "Count", True),  # a fault: restarted, counted against --backoff-limit
    (75, 203, "Ignore", True),  # saved for a requeue (preemption, hang): restarted, not counted
    (137 - 128, 137, "Count", True),  # a pod SIGKILLed (OOM): a failure like a fault
])
def test_each_exit_status_restarts_or_fails_the_job(status, pod_status, indexed_action,
                                                    operator_restarts):
    assert k8s.POD_EXIT.get(status, pod_status) == pod_status
    job, = k8s.manifests(_spec(pvc="x"), rank_env=ENV)
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "ExitCode"  # the operator restarts codes >= 128 only
    assert (pod_status >= 128) == operator_restarts
    indexed = k8s.manifests(_spec(kind="indexed-job", pvc="x"), rank_env=ENV)[-1]
    assert _indexed_job_action(indexed, pod_status) == indexed_action
    assert indexed["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_an_evicted_pod_is_not_counted_whatever_its_status():
    indexed = k8s.manifests(_spec(kind="indexed-job", pvc="x"), rank_env=ENV)[-1]
    assert _indexed_job_action(indexed, 143, disrupted=True) == "Ignore"
    assert _indexed_job_action(indexed, 2, disrupted=True) == "FailJob"  # bad input still fails


@pytest.mark.parametrize("preflight, pod_status", [(0, 0), (2, 2), (3, 131), (75, 203), (1, 1)])
def test_the_pod_script_raises_the_preflights_restartable_statuses(preflight, pod_status,
                                                                  tmp_path):
    """The container script run by bash with `python` replaced by a stub that exits with
    `preflight` (and 0 for torchrun): 3 and 75 leave the pod as 131 and 203."""
    stub = tmp_path / "python"
    stub.write_text('#!/bin/bash\n[[ "$*" == *"launch preflight"* ]] && exit "$PREFLIGHT"\n'
                    "exit 0\n")
    stub.chmod(0o755)
    job, = k8s.manifests(_spec(pvc="x"), rank_env=ENV)
    proc = subprocess.run(["bash", "-c", k8s.script_of(job)], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}",
                               "PREFLIGHT": str(preflight), "POD_NAME": "p0"}, timeout=60)
    assert proc.returncode == pod_status, proc.stderr


# launch/k8s/: the shipped examples and the arguments they were generated with
EXAMPLES = {
    "pytorchjob.yaml": ["--config", "configs/llama_125m.yaml", "--nodes", "2", "--gpus-per-node",
                        "8", "--min-nodes", "1", "--image", "ghcr.io/example/pretrain:latest",
                        "--termination-grace", "600"],
    "indexed-job-kueue.yaml": ["--config", "configs/llama_125m.yaml", "--nodes", "2",
                               "--gpus-per-node", "8", "--min-nodes", "1", "--image",
                               "ghcr.io/example/pretrain:latest", "--kind", "indexed-job",
                               "--scheduler", "kueue", "--queue", "team-a",
                               "--termination-grace", "600"],
}


@pytest.mark.parametrize("name", EXAMPLES)
def test_shipped_examples_are_what_the_generator_prints(name, pytorchjob_schema):
    shipped = (REPO / "launch" / "k8s" / name).read_text()
    assert shlex.join(EXAMPLES[name]) in (REPO / "launch" / "k8s" / "README.md").read_text()
    spec = spec_of(build_parser().parse_args(["launch", "k8s", *EXAMPLES[name]]))
    assert k8s.to_yaml(k8s.manifests(spec, rank_env=ENV)) == shipped, \
        f"regenerate launch/k8s/{name} with the command in launch/k8s/README.md"
    for doc in yaml.safe_load_all(shipped):
        _validate(doc, pytorchjob_schema)


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheduler="kueue"), "--scheduler kueue needs --queue"),
    (dict(queue="q"), "say which scheduler"),
    (dict(min_nodes=5), "1 <= MIN <= NODES"),
    (dict(name="Bad_Name"), "Kubernetes name"),
])
def test_bad_requests_are_refused(kwargs, message):
    with pytest.raises(k8s.ConfigError, match=re.escape(message)):
        k8s.manifests(_spec(**kwargs), rank_env=ENV)


def test_ranks_exit_status_prefers_bad_input_then_requeue():
    assert ranks_exit_status([1, 2, -15]) == 2
    assert ranks_exit_status([75, -15]) == 75
    assert ranks_exit_status([1, -9]) == 3


def _pretrain(*args: str, env: dict | None = None, timeout: int = 300):
    return subprocess.run([sys.executable, "-m", "pretrain", *args], cwd=REPO, timeout=timeout,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True)


@pytest.mark.slow  # starts torchrun (seconds each): the quick tier has no launcher
@pytest.mark.parametrize("rank_status, pod_status", [(75, 203), (2, 2)])
def test_torchrun_wrapper_keeps_the_ranks_status(rank_status, pod_status):
    proc = _pretrain("launch", "torchrun", "--retry-offset", "128", "--", "--standalone",
                     "--nproc-per-node", "1", "--max-restarts", "0", "--no-python",
                     "bash", "-c", f"exit {rank_status}", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == pod_status, proc.stderr[-2000:]


@pytest.mark.slow  # two `pretrain launch k8s` processes, each planning and building the model
def test_generation_runs_the_preflight():
    ok = _pretrain("launch", "k8s", *TRAIN, "--nodes", "2", "--gpus-per-node", "0",
                   "--image", "img", "--kind", "indexed-job")
    assert ok.returncode == 0, ok.stderr[-2000:]
    docs = list(yaml.safe_load_all(ok.stdout))  # stdout is only the manifests
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "Service", "Job"]
    assert "[preflight]" in ok.stderr  # the plan goes to stderr
    bad = _pretrain("launch", "k8s", *TRAIN, "--set", "parallel.pipeline=4", "--nodes", "2",
                    "--gpus-per-node", "0", "--image", "img")
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert (bad.returncode, bad.stdout, len(errors)) == (2, "", 1), bad.stderr[-2000:]


# ---- the pod's command line, two pods as two local processes ---------------------------------
def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.mark.slow
def test_pod_command_trains_like_the_deepspeed_launcher(tiny_data, tmp_path):
    from pretrain.dist import free_port

    data = ["--set", f"data.tokenizer={tiny_data['tokenizer']}",
            "--set", f"data.dataset={tiny_data['dataset']}"]
    gen = _pretrain("launch", "k8s", *TRAIN, *data, "--nodes", "2", "--gpus-per-node", "0",
                    "--image", "img", "--pvc", "runs", "--mount-path", str(tmp_path / "vol"))
    assert gen.returncode == 0, gen.stderr[-2000:]
    job, = yaml.safe_load_all(gen.stdout)
    port = free_port()
    script = k8s.script_of(job).replace("pretrain-tiny-worker-0:29400", f"localhost:{port}")
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    pods = [subprocess.Popen(["bash", "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             env={**base, **k8s.env_of(job), "POD_NAME": f"pretrain-tiny-worker-{i}",
                                  "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
            for i in range(2)]
    outs = [pod.communicate(timeout=600)[0] for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    pod_run = tmp_path / "vol" / "runs" / "tiny"
    assert (pod_run / "k8s" / "pretrain-tiny-worker-1" / "plan.txt").exists()  # pre-flight ran

    # the reference: 2 ranks with the environment the deepspeed launcher gives them, forked from
    # the test's fork server (the launcher itself is tested in tests/test_launch.py)
    ds_run = train(tmp_path, tiny_data, nprocs=2, name="deepspeed", overrides=["train.steps=3"],
                   timeout=600).run_dir
    assert len(_losses(pod_run)) == 3
    assert _losses(pod_run) == _losses(ds_run)
