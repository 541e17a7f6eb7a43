"""The resolved run is built once and handed down: nothing outside the resolver (`pretrain/resolve/run.py`)
derives a layout or a `Topology` from the config, and nothing assigns to the resolved config."""
from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path
from types import SimpleNamespace

import pytest

from pretrain.config import Precision, load_config
from pretrain.errors import CheckpointError, ConfigError
from pretrain.resolve.run import resolve_run
from pretrain.testing.runs import REPO

PACKAGE = REPO / "pretrain"
RESOLVER = PACKAGE / "resolve" / "run.py"
CONFIG = PACKAGE / "config.py"
SECTIONS = {f.name for f in dataclasses.fields(load_config(None))} - {"run_dir", "deepspeed"}


@functools.cache  # parsed once for every test below (they only read the trees)
def _trees() -> dict[Path, ast.AST]:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def _calls_of(name: str, tree: ast.AST) -> list[int]:
    """Lines calling `name` (a bare name or an attribute)."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and (
        getattr(node.func, "id", None) == name or getattr(node.func, "attr", None) == name)]


@pytest.mark.parametrize("rule", ["resolve_layout", "from_parallel_config", "check_run_data",
                                  "fill_ds_config", "settle_precision", "choose_precision"])
def test_only_the_resolver_applies_the_rules_of_a_run(rule):
    outside = [f"{path.relative_to(REPO)}:{line}" for path, tree in _trees().items()
               if path != RESOLVER for line in _calls_of(rule, tree)]
    assert not outside, f"{rule} is called outside pretrain/resolve/run.py: {outside}"


def _section_assignments(tree: ast.AST) -> list[str]:
    """`x.<section>.<field> = ...` (also +=, and tuple targets) for the run config's sections."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for item in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Attribute) \
                        and item.value.attr in SECTIONS:
                    found.append(f"{node.lineno}: .{item.value.attr}.{item.attr} =")
    return found


def test_no_module_assigns_to_a_field_of_the_run_config():
    outside = [f"{path.relative_to(REPO)}:{hit}" for path, tree in _trees().items()
               if path not in (RESOLVER, CONFIG) for hit in _section_assignments(tree)]
    assert not outside, f"run config fields assigned outside the resolver: {outside}"


def test_the_scan_finds_an_assignment():
    """The AST scan above is not vacuous: it sees the forms a mutation takes."""
    code = "cfg.train.precision = p\nrun.cfg.model.vocab_size += 1\na, cfg.data.seed = 1, 2\n"
    assert len(_section_assignments(ast.parse(code))) == 3
    assert _calls_of("resolve_layout", ast.parse("x = run.resolve_layout(cfg, t)")) == [1]


def _tiny(tmp_path, *overrides):
    return load_config(REPO / "configs" / "tiny.yaml",
                       [f"run_dir={tmp_path / 'run'}", "data.tokenizer=''", *overrides])


def test_the_resolved_config_is_settled_and_frozen(tmp_path):
    cfg = _tiny(tmp_path, "model.vocab_size=512", "train.precision=auto",
                "train.global_batch_size=null")
    run = resolve_run(cfg, world_size=2, rank=1, data_required=False)
    assert run.cfg.train.precision in (Precision.FP32, Precision.BF16)  # auto settled here
    assert run.topology.rank == 1 and run.topology.world_size == 2
    assert run.layout.data == 2 and run.layout.global_batch == 2 * cfg.train.micro_batch_size
    assert run.ds_config["train_batch_size"] == run.layout.deepspeed_batch
    assert run.checkpoint_layout == {
        "tensor": 1, "pipeline": 1, "data": 2, "context": 1, "expert": 1, "world_size": 2,
        "zero_stage": run.layout.zero_stage, "offload": "none",
        "precision": run.cfg.train.precision.value}
    for section, name, value in (("train", "precision", Precision.BF16),
                                 ("model", "vocab_size", 1024), ("parallel", "tensor", 2)):
        with pytest.raises(dataclasses.FrozenInstanceError, match="resolved and frozen"):
            setattr(getattr(run.cfg, section), name, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.cfg.run_dir = "elsewhere"


def test_auto_precision_keeps_the_checkpoint_s_and_the_global_batch_follows_it(tmp_path):
    class Resumed:  # the fields of a checkpoint.ResumePoint that resolving reads
        universal = False
        meta = {"global_batch": 8, "config": {"train": {"precision": "bf16"}}}

    cfg = _tiny(tmp_path, "model.vocab_size=512", "train.precision=auto",
                "train.global_batch_size=null")
    run = resolve_run(cfg, world_size=2, data_required=False, find_resume=lambda c: Resumed())
    assert run.cfg.train.precision == Precision.BF16
    assert "checkpoint being resumed" in run.precision.reason
    assert run.layout.global_batch == 8
    assert run.layout.grad_accum == 8 // (cfg.train.micro_batch_size * 2)
    assert run.resume is not None and "checkpoint" not in run.ds_config


def test_a_layout_error_names_the_deepspeed_json_only_for_its_own_fields(tmp_path):
    zero3 = REPO / "ds_configs" / "zero3.json"
    cfg = _tiny(tmp_path, "model.vocab_size=512", "parallel.pipeline=2", f"deepspeed={zero3}")
    with pytest.raises(ConfigError, match=rf"^{zero3}: ZeRO stage 3 with parallel.pipeline=2"):
        resolve_run(cfg, world_size=2, data_required=False)
    cfg = _tiny(tmp_path, "model.vocab_size=512", "parallel.pipeline=2", f"deepspeed={zero3}")
    with pytest.raises(ConfigError, match=r"^world size 3 is not divisible"):
        resolve_run(cfg, world_size=3, data_required=False)


def test_the_resolver_refuses_another_layout_only_when_asked(tmp_path):
    """`train --require-same-layout`: a checkpoint saved on another layout is refused while the
    run resolves (before any process group); its own layout, a universal checkpoint, or the
    flag left out resolve."""
    own = resolve_run(_tiny(tmp_path, "model.vocab_size=512"), world_size=2,
                      data_required=False).checkpoint_layout

    def resolved(saved: dict, *, universal: bool = False, same_layout_only: bool = True):
        resumed = SimpleNamespace(  # the fields of a checkpoint.ResumePoint resolving reads
            path=tmp_path / "step1", universal=universal,
            meta={"global_batch": 8, "layout": saved,
                  "config": {"train": {"precision": own["precision"]}}})
        return resolve_run(_tiny(tmp_path, "model.vocab_size=512"), world_size=2,
                           data_required=False, find_resume=lambda c: resumed,
                           same_layout_only=same_layout_only)

    other = {**own, "data": 1, "tensor": 2}
    with pytest.raises(CheckpointError, match=r"was saved on another layout \(tp2 pp1 dp1 "
                                              r"ZeRO-\d -> tp1 pp1 dp2 ZeRO-\d\) and "
                                              r"--require-same-layout is set"):
        resolved(other)
    assert resolved(own).resume is not None
    assert resolved(other, universal=True).resume is not None
    assert resolved(other, same_layout_only=False).resume is not None
