"""Kubernetes manifests for a run (`pretrain launch k8s`): a Kubeflow PyTorchJob or a plain
Indexed Job with a headless Service, the volume of the run directory, gang scheduling.

Every pod runs the same container command: the pre-flight (`pretrain launch preflight`, as the
Slurm scripts run it), then torchrun through `pretrain launch torchrun`, which keeps the ranks'
exit status (torchrun itself exits 1 whatever a rank returned). Exit statuses in the pod:

  0   the run finished                                   the pod completes
  2   bad input (config, data, checkpoint)               never restarted: the job fails
  131 a rank faulted (pretrain's 3) or the rendezvous    restarted
  203 a checkpoint was saved for a requeue (pretrain's 75, e.g. on SIGTERM from preemption)
                                                         restarted, not counted as a failure
                                                         by the Indexed Job

3 and 75 are raised by 128 because Kubeflow's training operator (v1.9) restarts a replica with
`restartPolicy: ExitCode` only for exit codes >= 128; the Indexed Job's podFailurePolicy uses the
same codes, so both kinds read one table.

A pod's termination grace (`terminationGracePeriodSeconds`, SIGTERM to SIGKILL) is what a rank
has to finish its step and save after a preemption; the pods get it in their environment
(`GRACE_ENV`) too, so the hang watchdog never waits past it (`pretrain.training.hang`). Its
default comes from the planner's step time and an estimate of the save (`grace_from_plan`).

For NCCL over RDMA (InfiniBand, RoCE) instead of TCP on the pod network, a pod needs the RDMA
devices (`pod_resources`, e.g. `rdma/hca_shared_devices_a: 1` of the RDMA shared device plugin),
the right to lock memory for them (`ipc_lock`: the IPC_LOCK capability), and a network that
reaches them: the host's (`host_network`) or a Multus secondary network (`networks`).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pretrain import storage
from pretrain.errors import EXIT_FAULT, EXIT_REQUEUE, EXIT_USER_ERROR, ConfigError

RETRY_OFFSET = 128  # the training operator restarts ExitCode replicas on codes >= 128 only
POD_EXIT = {EXIT_USER_ERROR: EXIT_USER_ERROR, EXIT_FAULT: RETRY_OFFSET + EXIT_FAULT,
            EXIT_REQUEUE: RETRY_OFFSET + EXIT_REQUEUE}
RDZV_PORT = 29400
CONTAINER = "pytorch"  # the training operator finds the training container by this name
GRACE_ENV = "PRETRAIN_TERMINATION_GRACE_S"  # the pod's grace, for the run's hang watchdog
# --termination-grace without a plan: a 70B step (tens of seconds on 64 GPUs) and its save
# (~20 GB of model and optimizer state per GPU) twice over, and the watchdog's verdict
DEFAULT_TERMINATION_GRACE_S = 600
SAVE_GBPS_PER_GPU = 0.5  # a save's assumed write rate per GPU (a node's 8 to a shared file system)
PLAN_MARGIN = 2.0  # the planner's step time is a prediction: twice it
GRACE_RESERVE_S = 60  # the hang watchdog's dump and verdict, the pod's own shutdown
MIN_TERMINATION_GRACE_S = 120
MULTUS_NETWORKS = "k8s.v1.cni.cncf.io/networks"
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")


@dataclass
class JobSpec:
    """What `pretrain launch k8s` was asked for."""
    name: str
    image: str
    nodes: int
    gpus_per_node: int
    min_nodes: int
    kind: str = "pytorchjob"  # or indexed-job
    train_args: list[str] = field(default_factory=list)  # --config/--set/--deepspeed-config
    run_dir: str = "runs/run"  # the config's run_dir, placed under mount_path
    mount_path: str = "/mnt/pretrain"
    pvc: str | None = None  # an existing claim; None with volume None: a new claim
    volume: dict | None = None  # a Kubernetes volume source, e.g. {"nfs": {...}}
    storage: str = "100Gi"
    storage_class: str | None = None
    scheduler: str | None = None  # volcano | kueue
    queue: str | None = None
    namespace: str | None = None
    max_restarts: int = 10  # torchrun's worker-group restarts inside a pod
    backoff_limit: int = 10  # pod restarts of the job
    cpu: str | None = None
    memory: str | None = None
    termination_grace_s: int = DEFAULT_TERMINATION_GRACE_S  # SIGTERM to SIGKILL of a pod
    pod_resources: dict[str, str] = field(default_factory=dict)  # extra limits, e.g. RDMA devices
    ipc_lock: bool = False  # the IPC_LOCK capability: RDMA pins (locks) its buffers
    host_network: bool = False  # the node's network (and its RDMA interfaces) for the pod
    networks: str | None = None  # Multus secondary networks (the pod annotation's value)
    store_secret: str = "pretrain-s3"  # run_dir at s3://: the Secret of the pods' AWS_* variables

    def check(self) -> None:
        if not _DNS_LABEL.match(self.name):
            raise ConfigError(f"--name {self.name!r}: a Kubernetes name needs lower-case letters, "
                              "digits and '-', starting with a letter, at most 40 characters")
        if self.nodes < 1 or not 1 <= self.min_nodes <= self.nodes:
            raise ConfigError(f"--min-nodes {self.min_nodes} --nodes {self.nodes}: need "
                              "1 <= MIN <= NODES")
        if self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node {self.gpus_per_node}: need >= 0 (0: one CPU rank a pod)")
        if self.scheduler == "kueue" and not self.queue:
            raise ConfigError("--scheduler kueue needs --queue LOCAL_QUEUE (the kueue.x-k8s.io/"
                              "queue-name label)")
        if self.queue and not self.scheduler:
            raise ConfigError(f"--queue {self.queue}: say which scheduler owns it: "
                              "--scheduler volcano or --scheduler kueue")
        if self.pvc and self.volume:
            raise ConfigError("--pvc and --volume both given: the run directory lives on one")
        if self.in_store and (self.pvc or self.volume):
            raise ConfigError(f"run_dir {self.run_dir}: the run directory is in the object "
                              "store; drop --pvc/--volume")
        if self.termination_grace_s < 1:
            raise ConfigError(f"--termination-grace {self.termination_grace_s}: need >= 1 s")
        for name in self.pod_resources:
            if name in ("cpu", "memory", "nvidia.com/gpu"):
                raise ConfigError(f"--pod-resource {name}: set it with --cpu, --memory or "
                                  "--gpus-per-node")

    @property
    def procs_per_node(self) -> int:
        return self.gpus_per_node or 1

    @property
    def in_store(self) -> bool:
        """Whether the run directory is in the object store (no volume: `storage`)."""
        return storage.is_remote(self.run_dir)

    @property
    def pod_run_dir(self) -> str:
        if self.in_store or self.run_dir.startswith("/"):
            return self.run_dir
        return f"{self.mount_path}/{self.run_dir}"

    @property
    def pod_log_dir(self) -> str:
        """The pod's job record: beside the run on its volume, or in the pod's own scratch when
        the run directory is in the store."""
        base = "/tmp/pretrain-k8s" if self.in_store else f"{self.pod_run_dir}/k8s"
        return f"{base}/${{POD_NAME}}"

    @property
    def rdzv_host(self) -> str:
        """The first pod's address: the operator's Service per replica, or the Indexed Job's
        pod 0 under the headless Service."""
        return f"{self.name}-worker-0" if self.kind == "pytorchjob" else f"{self.name}-0.{self.name}"


def parse_volume(text: str) -> dict:
    """`--volume`: a Kubernetes volume source as YAML or JSON, e.g. '{nfs: {server: s, path: /x}}'."""
    try:
        volume = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--volume {text!r} is not YAML/JSON: {exc}") from None
    if not isinstance(volume, dict) or len(volume) != 1:
        raise ConfigError(f"--volume {text!r}: give one volume source, e.g. "
                          "'{nfs: {server: nfs1, path: /runs}}' or '{hostPath: {path: /data}}'")
    return volume


def parse_pod_resource(text: str) -> tuple[str, str]:
    """`--pod-resource NAME=COUNT`, e.g. rdma/hca_shared_devices_a=1."""
    name, sep, count = text.partition("=")
    if not sep or not name.strip() or not count.strip():
        raise ConfigError(f"--pod-resource {text!r}: write NAME=COUNT, e.g. "
                          "rdma/hca_shared_devices_a=1")
    return name.strip(), count.strip()


def grace_from_plan(plan) -> int:
    """A pod's termination grace from a plan (`pretrain.plan.search.Plan`): finishing a step and
    saving this GPU's model and optimizer state, PLAN_MARGIN times over, plus GRACE_RESERVE_S;
    at least MIN_TERMINATION_GRACE_S."""
    memory = plan.memory
    save_s = (memory.params + memory.optimizer + memory.host) / (SAVE_GBPS_PER_GPU * 1e9)
    need = PLAN_MARGIN * (plan.time.step + save_s) + GRACE_RESERVE_S
    return max(MIN_TERMINATION_GRACE_S, int(need + 0.999))


def preflight_argv(spec: JobSpec) -> list[str]:
    """`pretrain launch preflight` arguments: the same at generation and in the pod."""
    world = spec.nodes * spec.procs_per_node
    argv = ["--world-size", str(world), "--ranks-per-node", str(spec.procs_per_node)]
    argv += ["--accelerator", "cuda"] if spec.gpus_per_node else ["--accelerator", "cpu",
                                                                   "--cluster", "cpu"]
    return argv + spec.train_args + ["--set", f"run_dir={spec.pod_run_dir}"]


def torchrun_argv(spec: JobSpec) -> list[str]:
    """torchrun's arguments in every pod: c10d rendezvous on the first pod, elastic MIN:MAX."""
    return ["--nnodes", f"{spec.min_nodes}:{spec.nodes}",
            "--nproc-per-node", str(spec.procs_per_node),
            "--max-restarts", str(spec.max_restarts), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{spec.rdzv_host}:{RDZV_PORT}", "--rdzv-id", spec.name,
            "-m", "pretrain", "train", *spec.train_args, "--set", f"run_dir={spec.pod_run_dir}"]


def container_script(spec: JobSpec) -> str:
    """The pod's `bash -c` script: pre-flight (its 3/75 raised by 128 as POD_EXIT says), then
    torchrun as PID 1 (exec), so that SIGTERM reaches it and the ranks save and exit 75."""
    log_dir = spec.pod_log_dir  # the job record of this pod
    preflight = _lines(["python", "-m", "pretrain", "launch", "preflight", *preflight_argv(spec)])
    torchrun = _lines(["python", "-m", "pretrain", "launch", "torchrun", "--retry-offset",
                       str(RETRY_OFFSET), "--", *torchrun_argv(spec)])
    return (f"{preflight} \\\n  --log-dir \"{log_dir}\" || {{ rc=$?; case $rc in "
            f"{EXIT_FAULT}|{EXIT_REQUEUE}) exit $(( {RETRY_OFFSET} + rc )) ;; esac; exit $rc; }}\n"
            f"exec {torchrun}\n")


def _lines(argv: list[str]) -> str:
    """A shell command, one line per group of arguments, for a readable manifest."""
    breaks = {"--", "--world-size", "--config", "--set", "--deepspeed-config", "--rdzv-backend",
              "-m"}
    out = ""
    for index, arg in enumerate(argv):
        out += (" \\\n  " if index > 1 and arg in breaks else " " if index else "") + shlex.quote(arg)
    return out


def manifests(spec: JobSpec, *, rank_env: dict[str, str]) -> list[dict]:
    """The objects to apply, in order: volume claim, gang objects, Service, job."""
    spec.check()
    docs: list[dict] = []
    if not spec.pvc and not spec.volume and not spec.in_store:
        docs.append(_claim(spec))
    if spec.kind == "indexed-job":
        if spec.scheduler == "volcano":
            docs.append(_pod_group(spec))
        docs += [_headless_service(spec), _indexed_job(spec, rank_env)]
    elif spec.kind == "pytorchjob":
        docs.append(_pytorch_job(spec, rank_env))
    else:
        raise ConfigError(f"--kind {spec.kind}: use pytorchjob or indexed-job")
    return docs


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the container script) as `|` blocks, readable in the manifest."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def to_yaml(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                         width=100)


def _meta(spec: JobSpec, name: str, *, queue_label: bool = False) -> dict:
    labels = {"app.kubernetes.io/name": "pretrain", "app.kubernetes.io/instance": spec.name}
    if queue_label and spec.scheduler == "kueue":
        labels["kueue.x-k8s.io/queue-name"] = spec.queue
    meta = {"name": name, "labels": labels}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    return meta


def _claim_name(spec: JobSpec) -> str:
    return spec.pvc or f"{spec.name}-runs"


def _claim(spec: JobSpec) -> dict:
    claim = {"accessModes": ["ReadWriteMany"],  # every node writes its checkpoint shards
             "resources": {"requests": {"storage": spec.storage}}}
    if spec.storage_class:
        claim["storageClassName"] = spec.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(spec, _claim_name(spec)), "spec": claim}


def _pod_group(spec: JobSpec) -> dict:
    """Volcano's gang for the Indexed Job (the training operator makes its own for a PyTorchJob)."""
    return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
            "metadata": _meta(spec, spec.name),
            "spec": {"minMember": spec.min_nodes, "queue": spec.queue or "default"}}


def _headless_service(spec: JobSpec) -> dict:
    """DNS names `<job>-<index>.<job>` for the Indexed Job's pods; the rendezvous is on pod 0."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, spec.name),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {"job-name": spec.name},
                     "ports": [{"name": "rendezvous", "port": RDZV_PORT}]}}


def _container(spec: JobSpec, rank_env: dict[str, str]) -> dict:
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    env += [{"name": k, "value": v} for k, v in rank_env.items()]
    env.append({"name": "DS_ACCELERATOR", "value": "cuda" if spec.gpus_per_node else "cpu"})
    env.append({"name": GRACE_ENV, "value": str(spec.termination_grace_s)})
    if not spec.gpus_per_node:
        env.append({"name": "OMP_NUM_THREADS", "value": spec.cpu or "1"})
    limits = {"nvidia.com/gpu": spec.gpus_per_node} if spec.gpus_per_node else {}
    limits.update(spec.pod_resources)  # extended resources are limits (requests follow them)
    requests = {k: v for k, v in (("cpu", spec.cpu), ("memory", spec.memory)) if v}
    resources = {k: v for k, v in (("limits", {**requests, **limits}), ("requests", requests)) if v}
    security = {"securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}} if spec.ipc_lock else {}
    return {"name": CONTAINER, "image": spec.image, "command": ["bash", "-c", container_script(spec)],
            "env": env, "ports": [{"name": "pytorchjob-port", "containerPort": RDZV_PORT}],
            **({"resources": resources} if resources else {}), **security,
            **({"envFrom": [{"secretRef": {"name": spec.store_secret}}]} if spec.in_store else {}),
            "volumeMounts": [*([] if spec.in_store else [{"name": "runs",
                                                          "mountPath": spec.mount_path}]),
                             {"name": "dshm", "mountPath": "/dev/shm"}]}


def _pod_template(spec: JobSpec, rank_env: dict[str, str], **pod: object) -> dict:
    source = spec.volume or {"persistentVolumeClaim": {"claimName": _claim_name(spec)}}
    pod_spec = {**pod, "terminationGracePeriodSeconds": spec.termination_grace_s,
                "containers": [_container(spec, rank_env)],
                "volumes": [*([] if spec.in_store else [{"name": "runs", **source}]),
                            # NCCL's and the data loaders' shared memory: the default is 64 MiB
                            {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}
    if spec.host_network:  # and the cluster's DNS still, for the rendezvous Service's name
        pod_spec.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    meta: dict = {"labels": _meta(spec, spec.name)["labels"]}
    annotations = {MULTUS_NETWORKS: spec.networks} if spec.networks else {}
    if spec.scheduler == "volcano":
        pod_spec["schedulerName"] = "volcano"
        if spec.kind == "indexed-job":
            annotations["scheduling.k8s.io/group-name"] = spec.name
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": pod_spec}


def _pytorch_job(spec: JobSpec, rank_env: dict[str, str]) -> dict:
    run_policy: dict = {"backoffLimit": spec.backoff_limit, "cleanPodPolicy": "Running"}
    if spec.scheduler == "volcano":
        run_policy["schedulingPolicy"] = {"minAvailable": spec.min_nodes,
                                          "queue": spec.queue or "default"}
    if spec.scheduler == "kueue":
        run_policy["suspend"] = True  # Kueue admits (unsuspends) it when the quota is there
    worker = {"replicas": spec.nodes, "restartPolicy": "ExitCode",
              "template": _pod_template(spec, rank_env)}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": _meta(spec, spec.name, queue_label=True),
            "spec": {"elasticPolicy": {"minReplicas": spec.min_nodes, "maxReplicas": spec.nodes,
                                       "rdzvBackend": "c10d", "rdzvPort": RDZV_PORT,
                                       "maxRestarts": spec.max_restarts},
                     "nprocPerNode": str(spec.procs_per_node),
                     "runPolicy": run_policy, "pytorchReplicaSpecs": {"Worker": worker}}}


def _indexed_job(spec: JobSpec, rank_env: dict[str, str]) -> dict:
    rules = [
        {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                              "values": [POD_EXIT[EXIT_USER_ERROR]]}},
        {"action": "Ignore", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                             "values": [POD_EXIT[EXIT_REQUEUE]]}},
        {"action": "Ignore",  # evicted or preempted
         "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "Count", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                            "values": [POD_EXIT[EXIT_FAULT]]}},
    ]
    job = {"completionMode": "Indexed", "completions": spec.nodes, "parallelism": spec.nodes,
           "backoffLimit": spec.backoff_limit, "podFailurePolicy": {"rules": rules},
           "template": _pod_template(spec, rank_env, restartPolicy="Never",  # podFailurePolicy needs it
                                     subdomain=spec.name)}
    if spec.scheduler == "kueue":
        job["suspend"] = True
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _meta(spec, spec.name, queue_label=True), "spec": job}


def default_name(config: str | None) -> str:
    stem = Path(config).stem if config else "run"
    name = re.sub(r"[^a-z0-9-]+", "-", f"pretrain-{stem}".lower()).strip("-")[:40].rstrip("-")
    return name


def script_of(doc: dict) -> str:
    """The container script of a generated job (what the tests run)."""
    if doc["kind"] == "PyTorchJob":
        pod = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    else:
        pod = doc["spec"]["template"]["spec"]
    return pod["containers"][0]["command"][2]


def env_of(doc: dict) -> dict[str, str]:
    """The plain `value` variables of a generated job's container."""
    if doc["kind"] == "PyTorchJob":
        pod = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    else:
        pod = doc["spec"]["template"]["spec"]
    return {e["name"]: e["value"] for e in pod["containers"][0]["env"] if "value" in e}

