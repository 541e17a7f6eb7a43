"""The optimizer state a reshard creates is the state each optimizer's kernel takes.

A resume onto another layout creates Adam's state by hand for optimizers that build it lazily
(`reshard._create_adam_state`). On GPUs the configs select torch's fused AdamW, whose kernel
refuses a step count that is not an fp32 tensor on the parameter's device. This machine has no
GPU, so each optimizer path the shipped configs select is built here (torch's AdamW with
`fused=True`, as on GPUs; DeepSpeed's CPU Adam under offload) and checked twice:

- with the engine as built (masters on the CPU): every state tensor has the device and dtype the
  optimizer's kernel needs, and one real optimizer step accepts the state;
- with the masters moved to another device than the host (`meta`, standing in for the GPU):
  the state follows the masters' device wherever the kernel needs it there (the fused kernel's
  step, the moments) and stays on the host only where the optimizer keeps it there by design
  (DeepSpeed's CPU Adam: an int count).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain.testing.ranks import run_on_ranks

REPO = Path(__file__).resolve().parents[1]

PATHS = {  # name: (DeepSpeed config, precision); each is one optimizer path of the configs
    "zero0-fp32-torch-adamw": ("zero0", "fp32"),
    "zero0-bf16-unfused-wrapper": ("zero0", "bf16"),
    "zero1-bf16-BF16_Optimizer": ("zero1", "bf16"),
    "zero1-fp32": ("zero1", "fp32"),
    "zero2-fp32": ("zero2", "fp32"),
    "zero3-fp32": ("zero3", "fp32"),
    "zero2-offload-cpu-adam": ("zero2_offload_cpu", "fp32"),
    "zero3-offload-cpu-adam": ("zero3_offload_cpu", "fp32"),
}


def _engine(ds_name: str, precision: str):
    """A one-rank engine of the tiny model, its torch AdamW fused as the configs make it on GPUs."""
    from pretrain.config import load_config
    from pretrain.dist import init_deepspeed_comm
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.training.engine import build_engine
    from pretrain.resolve.topology import Topology

    cfg = load_config(REPO / "configs/tiny.yaml", [
        f"deepspeed=ds_configs/{ds_name}.json", f"train.precision={precision}",
        "train.global_batch_size=2", "model.num_layers=1", f"run_dir={REPO}/runs/unused"])
    init_deepspeed_comm(dist_backend="gloo")
    ds_config = resolve_ds_config(cfg, world_size=1, accelerator="cpu")
    params = ds_config["optimizer"]["params"]
    if params["torch_adam"]:
        params["fused"] = True  # what resolve_ds_config sets on a GPU
    groups = Topology.from_parallel_config(cfg.parallel, world_size=1, rank=0).create_groups()
    return cfg, build_engine(cfg, ds_config, groups, main=False)


def _adam_tensors(engine):
    from pretrain.checkpoint.reshard import _updated_tensors

    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return base, [(group, p) for group, tensors in _updated_tensors(engine.optimizer, base)
                  for p in tensors]


def _state_problems(engine) -> list[str]:
    """What in the optimizer state differs from what its kernel requires."""
    base, tensors = _adam_tensors(engine)
    torch_adam = isinstance(base, torch.optim.Adam)
    problems = []
    for group, p in tensors:
        state = base.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            got = state[key]
            if (got.device, got.dtype, got.shape) != (p.device, p.dtype, p.shape):
                problems.append(f"{key} {got.device} {got.dtype} for a {p.device} {p.dtype} "
                                "parameter")
        step = state["step"]
        if not torch_adam:  # DeepSpeed's CPU Adam: a host int by design
            if type(step) is not int or step != 3:
                problems.append(f"CPU Adam step {step!r}")
            continue
        fused = group.get("fused") or group.get("capturable")
        want = (p.device if fused else torch.device("cpu"), torch.float32)
        if not isinstance(step, torch.Tensor) or (step.device, step.dtype) != want:
            problems.append(f"step {step!r} on a {p.device} parameter of a "
                            f"{'fused' if fused else 'for-each'} group: wants {want}")
        elif step.dim() != 0 or (step.device.type != "meta" and step.item() != 3):
            problems.append(f"step {step!r}")
    return problems


def _move_masters_to_meta(wrapper, base) -> None:
    """Replace every tensor Adam updates by a twin of its shape and dtype on the meta device
    (in the optimizer's groups and ZeRO-3's list of flat partitions), with no state yet."""
    def twin(p: torch.Tensor) -> torch.Tensor:
        base.state.pop(p, None)
        return torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)

    for group in base.param_groups:
        group["params"] = [twin(p) for p in group["params"]]
    flat = getattr(wrapper, "fp32_partitioned_groups_flat", None)
    if flat is not None:
        flat[:] = [twin(p) for p in flat]


def _check_path(rank: int, world_size: int, ds_name: str, precision: str) -> dict:
    from pretrain.checkpoint.reshard import _create_adam_state

    cfg, engine = _engine(ds_name, precision)
    base, tensors = _adam_tensors(engine)
    fused = [bool(group.get("fused")) for group, _ in tensors]
    _create_adam_state(engine, step=3)
    on_host = _state_problems(engine)
    # the optimizer's own step takes that state (the fused CPU kernel checks device and dtype)
    inputs = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length))
    engine.backward(engine(inputs, inputs))
    engine.step()
    steps = {base.state[p]["step"].item() if isinstance(base.state[p]["step"], torch.Tensor)
             else base.state[p]["step"] for _, p in tensors}

    # the masters on another device than the host: the state must follow them there
    _move_masters_to_meta(engine.optimizer, base)
    _create_adam_state(engine, step=3)
    return {"on_host": on_host, "on_device": _state_problems(engine), "steps_after": steps,
            "optimizer": type(base).__name__, "fused": fused}


# DeepSpeed's CPU Adam is a compiled op (minutes the first time): the full tier builds it before
# the tests, the quick tier leaves those paths out
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if "cpu-adam" in p else p
                                  for p in PATHS])
def test_created_adam_state_is_what_the_kernel_takes(path, tmp_path):
    ds_name, precision = PATHS[path]
    result, = run_on_ranks(_check_path, world_size=1, tmp_path=tmp_path,
                           args=(ds_name, precision), timeout_s=600)
    if "offload" in ds_name:
        assert result["optimizer"] == "DeepSpeedCPUAdam", result
    else:
        assert result["optimizer"] == "AdamW" and all(result["fused"]), result
    assert result["on_host"] == [], result
    assert result["steps_after"] == {4}, result  # the created count, stepped once
    assert result["on_device"] == [], result
