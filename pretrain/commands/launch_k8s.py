"""`pretrain launch k8s` (the manifests of a run on Kubernetes) and `pretrain launch torchrun`
(torchrun keeping the ranks' exit status: the command every such pod runs). See pretrain/k8s.py."""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from pretrain.errors import EXIT_FAULT, EXIT_OK, EXIT_REQUEUE, EXIT_USER_ERROR, ConfigError

EXAMPLE = """\
example:
  pretrain launch k8s --config configs/llama_1b.yaml --nodes 4 --gpus-per-node 8 \\
      --image registry.example.com/pretrain:latest --min-nodes 2 > job.yaml
  kubectl apply -f job.yaml

  # NCCL over RDMA (the RDMA shared device plugin's devices, a Multus network):
  pretrain launch k8s ... --pod-resource rdma/hca_shared_devices_a=1 --ipc-lock \
      --network default/ib-sriov > job.yaml

Exit statuses of a pod: 0 done; 2 bad input (never restarted); 131 a rank faulted (pretrain's 3)
and 203 a checkpoint saved for a requeue (pretrain's 75): restarted. The training operator
restarts `restartPolicy: ExitCode` replicas only on codes >= 128, hence 3 and 75 + 128."""


def add_k8s_arguments(sub) -> None:
    from pretrain.config import add_config_arguments

    k = sub.add_parser("k8s", help="print the Kubernetes manifests of a run (PyTorchJob or "
                                   "Indexed Job), after the pre-flight for its world size",
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(k)
    k.add_argument("--nodes", type=int, required=True, help="pods (nodes) of the job; the most "
                   "the elastic job grows to")
    k.add_argument("--gpus-per-node", type=int, required=True, metavar="G",
                   help="GPUs (ranks) a pod; 0: one CPU rank a pod")
    k.add_argument("--image", required=True, help="container image with this repository "
                   "installed (its working directory the repository: configs/ and ds_configs/)")
    k.add_argument("--kind", choices=["pytorchjob", "indexed-job"], default="pytorchjob",
                   help="pytorchjob: Kubeflow's training operator; indexed-job: a plain batch/v1 "
                   "Indexed Job and a headless Service, for clusters without the operator")
    k.add_argument("--min-nodes", type=int, help="the job trains once this many pods met at "
                   "the rendezvous (torchrun --nnodes MIN:MAX; default --nodes)")
    k.add_argument("--name", help="job name (default pretrain-<config file name>)")
    k.add_argument("--namespace")
    k.add_argument("--scheduler", choices=["volcano", "kueue"],
                   help="gang scheduling: Volcano (schedulerName, PodGroup) or Kueue (queue label)")
    k.add_argument("--queue", help="Volcano queue (default: default) or Kueue LocalQueue")
    vol = k.add_mutually_exclusive_group()
    vol.add_argument("--pvc", metavar="NAME", help="existing PersistentVolumeClaim for the run "
                     "directory (default: a new ReadWriteMany claim <name>-runs)")
    vol.add_argument("--volume", metavar="YAML", help="a volume source instead, e.g. "
                     "'{nfs: {server: nfs1, path: /runs}}'")
    k.add_argument("--store-secret", default="pretrain-s3", metavar="NAME",
                   help="with run_dir at s3://: the Secret whose keys become the pods' "
                   "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL); "
                   "no volume is mounted")
    k.add_argument("--storage", default="100Gi", help="size of the new claim")
    k.add_argument("--storage-class", help="storage class of the new claim")
    k.add_argument("--mount-path", default="/mnt/pretrain", help="where the volume is mounted; "
                   "a relative run_dir is placed under it")
    k.add_argument("--cpu", help="CPU request of a pod (also OMP_NUM_THREADS of a CPU rank)")
    k.add_argument("--memory", help="memory request of a pod, e.g. 512Gi")
    k.add_argument("--max-restarts", type=int, default=10,
                   help="torchrun's worker-group restarts in a pod before it exits")
    k.add_argument("--backoff-limit", type=int, default=10, help="failed pods before the job fails")
    k.add_argument("--gpu-memory-gb", type=float, help="plan for GPUs of this size at "
                   "generation (the pods' pre-flight plans for the GPUs nvidia-smi lists)")
    k.add_argument("--termination-grace", type=int, metavar="SECONDS",
                   help="a pod's terminationGracePeriodSeconds: SIGTERM (preemption, eviction) "
                   "to SIGKILL, in which the ranks finish their step and save; also the most "
                   "the hang watchdog waits for that (default: twice the planner's step time "
                   "and a save of each GPU's state at 0.5 GB/s, plus 60 s, at least 120 s)")
    k.add_argument("--pod-resource", action="append", default=[], metavar="NAME=COUNT",
                   help="an extra resource limit of each pod (repeatable), e.g. the RDMA "
                   "devices NCCL needs for InfiniBand/RoCE: rdma/hca_shared_devices_a=1, or "
                   "nvidia.com/hostdev=8")
    k.add_argument("--ipc-lock", action="store_true", help="add the IPC_LOCK capability (RDMA "
                   "locks its memory: NCCL over InfiniBand/RoCE needs it)")
    k.add_argument("--host-network", action="store_true", help="hostNetwork: true (the node's "
                   "network interfaces, RDMA ones included; the rendezvous port 29400 must be "
                   "free on the nodes)")
    k.add_argument("--network", metavar="NETS", help="Multus secondary network(s) of each pod "
                   "(the k8s.v1.cni.cncf.io/networks annotation), e.g. default/ib-sriov")
    t = sub.add_parser("torchrun", help="torchrun, exiting with the ranks' status: 2 when a rank "
                                        "exited 2, 75 when one saved for a requeue, else 3")
    t.add_argument("--retry-offset", type=int, default=0, metavar="N",
                   help="add N to the restartable statuses 3 and 75 (128 in a Kubernetes pod)")
    t.add_argument("torchrun_args", nargs="*", help="after --: torchrun's arguments")


def spec_of(args: argparse.Namespace):
    from pretrain import k8s
    from pretrain.config import config_overrides, load_config

    cfg = load_config(args.config, config_overrides(args))
    train_args = [*(["--config", args.config] if args.config else []),
                  *[a for kv in args.set for a in ("--set", kv)],
                  *(["--deepspeed-config", args.deepspeed_config] if args.deepspeed_config else [])]
    return k8s.JobSpec(
        name=args.name or k8s.default_name(args.config), image=args.image, nodes=args.nodes,
        gpus_per_node=args.gpus_per_node, min_nodes=args.min_nodes or args.nodes, kind=args.kind,
        train_args=train_args, run_dir=_relative(cfg.run_dir), mount_path=args.mount_path, pvc=args.pvc,
        volume=k8s.parse_volume(args.volume) if args.volume else None, storage=args.storage,
        storage_class=args.storage_class, scheduler=args.scheduler, queue=args.queue,
        namespace=args.namespace, max_restarts=args.max_restarts,
        backoff_limit=args.backoff_limit, cpu=args.cpu, memory=args.memory,
        termination_grace_s=args.termination_grace or k8s.DEFAULT_TERMINATION_GRACE_S,
        pod_resources=dict(map(k8s.parse_pod_resource, args.pod_resource)),
        ipc_lock=args.ipc_lock, host_network=args.host_network, networks=args.network,
        store_secret=args.store_secret)


def _relative(run_dir) -> str:
    """The config's run_dir as written: the config loader resolves it against this directory,
    and a relative one goes under the pods' volume."""
    from pretrain import storage

    if storage.is_remote(run_dir):  # s3://...: no volume, as written
        return run_dir
    path = Path(run_dir)
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    return str(path)


def ranks_exit_status(codes: list[int]) -> int:
    """One status for the failed ranks: bad input wins (a restart cannot cure it), then a saved
    requeue; anything else (a crash, a signal, a timeout) is a fault."""
    if EXIT_USER_ERROR in codes:
        return EXIT_USER_ERROR
    return EXIT_REQUEUE if EXIT_REQUEUE in codes else EXIT_FAULT


def run_torchrun(args: argparse.Namespace) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        torchrun.run(torchrun.parse_args(args.torchrun_args))
        status = EXIT_OK
    except ChildFailedError as exc:
        codes = [failure.exitcode for failure in exc.failures.values()]
        status = ranks_exit_status(codes)
        print(f"[launch] torchrun: ranks exited {codes}: status {status}", file=sys.stderr)
    except SignalException as exc:  # SIGTERM (preemption): the ranks were asked to save
        print(f"[launch] torchrun: {exc}: the ranks saved for a requeue", file=sys.stderr)
        status = EXIT_REQUEUE
    except RendezvousError as exc:
        print(f"[launch] torchrun: rendezvous failed: {exc}", file=sys.stderr)
        status = EXIT_FAULT
    if status in (EXIT_FAULT, EXIT_REQUEUE):
        status += args.retry_offset
    sys.exit(status)
