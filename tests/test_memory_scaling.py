"""Host memory each rank adds scales with its own shard, not with the model.

A wide model (hidden 1024, vocab 32000: 88M parameters, 352 MB in fp32, the embedding 131 MB)
is built, initialised and loaded from a final/ directory (`model.init_from`) on 1, 2 and 4
tensor-parallel ranks, and exported offline. Each phase's peak resident memory is measured from
the process (Linux's VmHWM, reset through /proc/self/clear_refs before the phase) and must stay
within 1.5 x the rank's shard + one whole tensor (the largest): reading the whole checkpoint on
every rank, or drawing and keeping whole tensors, would exceed it.

The ranks run with glibc's mmap threshold fixed at 64 KiB (`MALLOC_MMAP_THRESHOLD_`), so a freed
tensor goes back to the operating system and the resident size is what the process holds. With
glibc's adaptive threshold, memory freed to the heap stays resident: building a model inside
`deepspeed.zero.Init` (each layer allocated whole, then partitioned) then shows ~2x its peak.
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from pretrain.config import RunConfig, load_config
from pretrain.dist import init_deepspeed_comm
from pretrain.testing.memory import peak_added
from pretrain.testing.ranks import run_on_ranks
from pretrain.testing.runs import REPO

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)

WIDE = ["model.preset=tiny", "model.hidden_size=1024", "model.num_heads=16",
        "model.num_kv_heads=4", "model.ffn_hidden_size=2816", "model.vocab_size=32000",
        "model.num_layers=2", "model.tie_embeddings=false"]
MB = 2**20


def _largest_tensor_bytes(cfg) -> int:
    from pretrain.model.hf import expected_hf_keys
    from pretrain.model.llama import full_parameter_shape

    return max(math.prod(full_parameter_shape(n, cfg)) for n in expected_hf_keys(cfg)) * 4


def _build_and_load(rank: int, world_size: int, final_dir: str) -> dict:
    import torch.distributed as dist

    from pretrain.checkpoint.weights import load_initial_weights
    from pretrain.model import build_model

    cfg = load_config(None, WIDE + [f"model.init_from={final_dir}"]).model
    group = dist.group.WORLD if world_size > 1 else None
    model = []
    build = peak_added(lambda: model.append(build_model(cfg, seed=1, tp_group=group)))
    load = peak_added(lambda: load_initial_weights(model[0], cfg=cfg, tp_group=group))
    shard = sum(p.numel() * p.element_size() for p in model[0].parameters())
    return {"build": build, "load": load, "shard": shard}


@pytest.fixture(autouse=True)
def _freed_memory_returns_to_the_os(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # read by every process started now


@pytest.fixture(scope="module")
def wide_final(tmp_path_factory):
    """final/ of the wide model, written one tensor at a time."""
    from pretrain.checkpoint.weights import writing_final
    from pretrain.model.hf import expected_hf_keys
    from pretrain.model.llama import full_parameter_init, full_parameter_shape

    cfg = load_config(None, WIDE).model
    out = tmp_path_factory.mktemp("wide") / "final"
    names = sorted(expected_hf_keys(cfg))
    with writing_final(out, shapes={n: full_parameter_shape(n, cfg) for n in names},
                       run_config=RunConfig(model=cfg), tokenizer=None, step=0,
                       source="test") as writer:
        for name in names:
            writer.write(name, full_parameter_init(name, cfg, seed=1))
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_construction_and_init_from_add_about_a_shard_per_rank(tp, wide_final, tmp_path):
    cfg = load_config(None, WIDE).model
    largest = _largest_tensor_bytes(cfg)
    for rank, used in enumerate(run_on_ranks(_build_and_load, world_size=tp, tmp_path=tmp_path,
                                             args=(str(wide_final),), start_method="spawn")):
        limit = 1.5 * used["shard"] + largest
        assert used["build"] <= limit, (rank, {k: v / MB for k, v in used.items()}, limit / MB)
        # the weights are allocated already: loading adds at most a tensor and its shard
        assert used["load"] <= 0.5 * used["shard"] + largest, (rank, used, largest)


def _export_peak(src, out, *, dtype: str, tokenizer: str | None = None) -> int:
    """Bytes `export-hf` of `src` adds to a fresh process's peak, the weights opened first."""
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
            "from pretrain.testing.memory import peak_added\n"
            "from pretrain.checkpoint.weights import load_weights\n"
            "import pathlib\n"
            "import pretrain.checkpoint.hf as hf\n"
            f"weights = load_weights({str(src)!r})\n"
            + (f"weights.tokenizer = pathlib.Path({tokenizer!r})\n" if tokenizer else "")
            + f"added = peak_added(lambda: hf.export_hf(weights, pathlib.Path({str(out)!r}), "
            f"dtype={dtype!r}, max_shard_size='100MB'))\n"
            "print(added)")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO / "tests", capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return int(run.stdout.split()[-1])


def test_offline_export_holds_one_tensor(wide_final, tiny_data, tmp_path):
    """`export-hf` of a final/ directory (bf16, sharded): the peak is one tensor and its copy,
    not the 352 MB model."""
    added = _export_peak(wide_final, tmp_path / "hf", dtype="bf16",
                         tokenizer=tiny_data["tokenizer"])
    cfg = load_config(None, WIDE).model
    assert added <= 2 * _largest_tensor_bytes(cfg), added / MB
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) >= 3


def test_offline_export_of_a_zero_checkpoint_holds_one_tensor(tiny_data, tmp_path):
    """`export-hf` of a ZeRO-2 engine checkpoint of the wide model (2 data-parallel ranks): the
    fp32 masters are read parameter by parameter from the optimizer partitions. DeepSpeed's
    zero_to_fp32 concatenates every partition first (the 352 MB model, then the state dict
    cut from it)."""
    from pretrain.testing.runs import train

    run = train(tmp_path, tiny_data, nprocs=2, overrides=[
        *WIDE, "train.steps=1", "train.precision=fp32", "deepspeed=ds_configs/zero2.json",
        "checkpoint.save_final=false", "train.eval_interval=0"])
    step_dir = run.run_dir / "checkpoints" / "step1"
    added = _export_peak(step_dir, tmp_path / "hf", dtype="fp32")
    cfg = load_config(None, WIDE).model
    # the largest tensor, and the pages of the optimizer file it is copied from while they are
    # mapped (clean file pages, but the process's resident size counts them); 32 MB of slack
    assert added <= 2 * _largest_tensor_bytes(cfg) + 32 * MB, added / MB
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) >= 3


# Many layers, a small vocabulary: the largest tensor is a small part of the model (425 MB).
DEEP = ["model.preset=tiny", "model.hidden_size=1024", "model.num_heads=16", "model.num_kv_heads=4",
        "model.ffn_hidden_size=2816", "model.vocab_size=8000", "model.num_layers=8",
        "model.tie_embeddings=false"]


def _build_under_zero3(rank: int, world_size: int) -> dict:
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.model.build import build_for_layout
    from pretrain.resolve.topology import Topology

    init_deepspeed_comm(dist_backend="gloo", verbose=False)  # no shm inference op
    cfg = load_config(None, DEEP + ["deepspeed=ds_configs/zero3.json", "train.precision=fp32",
                                    "train.micro_batch_size=1",
                                    f"train.global_batch_size={world_size}"])
    ds = resolve_ds_config(cfg, world_size=world_size)
    groups = Topology.from_parallel_config(cfg.parallel, world_size=world_size,
                                           rank=rank).create_groups()
    model = []
    build = peak_added(lambda: model.append(build_for_layout(cfg, groups, zero3_config=ds)))
    partition = sum(p.ds_tensor.numel() * p.ds_tensor.element_size()
                    for p in model[0].parameters())
    return {"build": build, "partition": partition}


def test_zero3_construction_adds_a_partition_per_rank(tmp_path):
    """Under ZeRO-3 the model is built inside deepspeed.zero.Init and initialised one gathered
    parameter at a time: each of 4 data-parallel ranks adds about its quarter of the 425 MB
    model, plus DeepSpeed's gather of one whole parameter (on gloo two copies of it: the
    gathered pieces and their concatenation). Building the whole model first would add 425 MB."""
    from pretrain.arithmetic import num_parameters

    cfg = load_config(None, DEEP).model
    largest, whole = _largest_tensor_bytes(cfg), 4 * num_parameters(cfg)
    for rank, used in enumerate(run_on_ranks(_build_under_zero3, world_size=4, tmp_path=tmp_path,
                                             start_method="spawn")):
        assert abs(used["partition"] - whole / 4) < 0.01 * whole, (rank, used, whole)
        assert used["build"] <= 1.5 * used["partition"] + 2 * largest < 0.6 * whole, (
            rank, {k: v / MB for k, v in used.items()}, largest / MB)


def _save_final(rank: int, world_size: int, out_dir: str, tokenizer: str) -> dict:
    import types
    from pathlib import Path

    from pretrain.checkpoint.engine import save_final
    from pretrain.dist import create_io_group
    from pretrain.model.build import build_for_layout
    from pretrain.resolve.topology import Topology

    init_deepspeed_comm(dist_backend="gloo", verbose=False)  # no shm inference op
    create_io_group(timeout_minutes=5)
    cfg = load_config(None, WIDE + [f"parallel.tensor={world_size}", "train.precision=fp32"])
    groups = Topology.from_parallel_config(cfg.parallel, world_size=world_size,
                                           rank=rank).create_groups()
    model = build_for_layout(cfg, groups)
    engine = types.SimpleNamespace(module=model)  # save_final reads only the module
    saved = peak_added(lambda: save_final(
        engine, cfg=cfg, groups=groups, tokenizer=types.SimpleNamespace(path=tokenizer),
        run_dir=Path(out_dir), step=1, main=rank == 0))
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"save": saved, "shard": shard}


@pytest.mark.parametrize("tp", [1, 2])
def test_final_save_adds_about_one_tensor_per_rank(tp, tiny_data, tmp_path):
    """final/ of the wide model, written from tensor-parallel ranks: each parameter is gathered,
    sent and written alone. Gathering (or copying) the whole model on a rank would add 352 MB
    (and gather_object's pickles twice that); at tp 1 the bound is below the model's size."""
    from safetensors import safe_open

    cfg = load_config(None, WIDE).model
    largest = _largest_tensor_bytes(cfg)
    used = run_on_ranks(_save_final, world_size=tp, tmp_path=tmp_path,
                        args=(str(tmp_path / "run"), tiny_data["tokenizer"]),
                        start_method="spawn")
    for rank, u in enumerate(used):
        if tp == 1:  # nothing gathered: the tensor being written (measured 125 of 336 MB)
            assert u["save"] <= 1.5 * largest < 0.6 * u["shard"], (rank, u, largest)
        else:  # gathering one tensor over tp ranks holds its pieces and their concatenation
            assert u["save"] <= 0.5 * u["shard"] + 2 * largest, (rank, u, largest)
    with safe_open(str(tmp_path / "run" / "final" / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [32000, 1024]
        assert f.metadata() == {"step": "1", "source": str(tmp_path / "run")}
