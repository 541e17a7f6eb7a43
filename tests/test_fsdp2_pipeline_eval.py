"""Scoring and cached greedy decoding through fsdp2's pipelines (`PipelineDriver.inference_hops`,
`pretrain.evaluation.pipeline_decoding`), against one process's flat model of the same seed.

fsdp2 builds each rank's shards bitwise the seeded one-process model's, so the pipelined
runner must give the flat runner's answers: the same greedy tokens (a decode that lost its
key/value cache, or ran a stage on the wrong input, continues differently within a few
tokens) and the same log-likelihoods. ZBV's V puts stages 0 and 3 on rank 0 and 1 and 2 on
rank 1: one forward sends between the ranks and hands on inside one. Under tensor parallelism
with sequence parallelism the decode recomputes its window each step (no cache), padded to a
multiple of the tensor ranks.
"""
from __future__ import annotations

import math

import pytest

from pretrain.config import load_config
from pretrain.testing.runs import REPO

MODEL = ["model.vocab_size=500", "model.tie_embeddings=false", "model.num_layers=4",
         "train.micro_batch_size=1", "train.global_batch_size=4"]
FSDP2_PIPELINE = ["train.engine=fsdp2", "deepspeed=ds_configs/zero2.json",
                  "parallel.pipeline=2", "parallel.virtual_stages=2"]
# prompts of one length (a GreedyBatch's); rows to score: (tokens, continuation)
PROMPTS = ((5, 17, 42, 99, 7), (250, 3, 3, 480, 61))
ROWS = (((11, 12, 13, 14, 15, 16), 2), ((400, 401), 1), ((9, 8, 7, 6, 5, 4, 3, 2, 1), 4))
NEW_TOKENS = 8


def _answers(runner, *, driver: bool):
    from pretrain.evaluation.runner import GreedyBatch, ScoreRow

    if not driver:
        runner.serve()
        return None
    rows = [ScoreRow(tokens=tokens, continuation=c) for tokens, c in ROWS]
    scores = runner.score([rows[:2], rows[2:]])
    batch = GreedyBatch(prompts=PROMPTS, max_new_tokens=NEW_TOKENS, until=((), ()))
    tokens = runner.greedy([batch])
    runner.stop()
    return {"scores": scores, "tokens": tokens}


def _pipelined(rank: int, world_size: int, overrides: list[str]):
    """The runner over fsdp2's pipeline engine built as a run builds it; rank 0 drives."""
    from pretrain.dist import init_deepspeed_comm
    from pretrain.evaluation.runner import ModelRunner
    from pretrain.model import tensor_parallel_group
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.resolve.topology import Topology
    from pretrain.training.engine import build_engine

    cfg = load_config(REPO / "configs/tiny.yaml", [*MODEL, *overrides,
                                                   f"run_dir={REPO}/runs/unused"])
    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    groups = Topology.from_parallel_config(cfg.parallel, world_size=world_size,
                                           rank=rank).create_groups()
    engine = build_engine(cfg, resolve_ds_config(cfg, world_size=world_size), groups,
                          main=False)
    engine.eval()
    shards = groups.topology.tensor if cfg.parallel.sequence_parallel else 1
    runner = ModelRunner(engine, vocab_size=cfg.model.vocab_size,
                         seq_length=cfg.model.seq_length, batch_size=2, distributed=True,
                         tp_multiple=shards, tp_group=tensor_parallel_group(groups))
    assert runner.staged and runner.batch_size == 2
    return _answers(runner, driver=rank == 0)


@pytest.fixture(scope="module")
def one_process() -> dict:
    from pretrain.evaluation.runner import ModelRunner
    from pretrain.model import build_model

    cfg = load_config(REPO / "configs/tiny.yaml", MODEL)
    model = build_model(cfg.model, seed=cfg.train.seed).eval()
    runner = ModelRunner(model, vocab_size=cfg.model.vocab_size,
                         seq_length=cfg.model.seq_length, batch_size=2)
    return _answers(runner, driver=True)


@pytest.mark.slow
@pytest.mark.parametrize("overrides, world_size", [
    (["parallel.pipeline_schedule=zbv"], 2),
    (["parallel.pipeline_schedule=interleaved_1f1b", "parallel.tensor=2",
      "parallel.sequence_parallel=true"], 4),
], ids=["zbv", "interleaved_tp2_sp"])
def test_fsdp2_pipelines_score_and_decode_as_one_process(overrides, world_size, one_process,
                                                         tmp_path):
    from pretrain.testing.ranks import run_on_ranks

    answers = run_on_ranks(_pipelined, world_size=world_size, tmp_path=tmp_path,
                           args=([*FSDP2_PIPELINE, *overrides],), timeout_s=300)[0]
    assert answers["tokens"] == one_process["tokens"]
    assert len(answers["tokens"][0][0]) == NEW_TOKENS
    for mine, theirs in zip(sum(answers["scores"], []), sum(one_process["scores"], [])):
        assert mine[1] == theirs[1]
        assert math.isclose(mine[0], theirs[0], rel_tol=1e-5, abs_tol=1e-5), (mine, theirs)
