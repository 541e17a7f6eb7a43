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


# launch/k8s/: the shipped examples and the arguments they were generated with
EXAMPLES = {
    "pytorchjob.yaml": ["--config", "configs/llama_125m.yaml", "--nodes", "2", "--gpus-per-node",
                        "8", "--min-nodes", "1", "--image", "ghcr.io/example/pretrain:latest"],
    "indexed-job-kueue.yaml": ["--config", "configs/llama_125m.yaml", "--nodes", "2",
                               "--gpus-per-node", "8", "--min-nodes", "1", "--image",
                               "ghcr.io/example/pretrain:latest", "--kind", "indexed-job",
                               "--scheduler", "kueue", "--queue", "team-a"],
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
