"""Time per 1,000 log-likelihood requests of the lm-eval adapter (`pretrain.evaluation`) at the
quickstart's shape: configs/quickstart.yaml's model (the `small` preset: 6 layers, hidden 384,
seq 256, vocabulary 8192, tied) in fp32 on the CPU, batches of 8, on the multiple-choice
requests of the local task python_next_line (the quickstart's tokenizer, made once under
.build/bench). The weights are the initial ones: the time does not depend on them.

Two measurements, each against a baseline measured in the same run:

- `overhead` (one process, the task's first 50 examples x 4 choices): the adapter against the
  same windows (the same token ids, batched in the same order) through the bare model,
  log-softmax and gather, without lm-eval, the adapter or the runner. The ratio is the
  adapter's overhead (tokenization, batching, bookkeeping).
- `dp` (the same 50 examples): the adapter on 1 gloo rank against 2 ranks, each a
  data-parallel replica running half the batches (one thread per rank, so that dp 2 uses the
  two cores dp 1 leaves idle). The ratio dp 1 / dp 2 is the speed-up of sharing the batches.

- `pp_generate` (2 gloo ranks, one thread each): greedy decoding through a 2-stage pipeline
  of the same model, GEN_ROWS prompts of GEN_PROMPT random tokens continued by GEN_TOKENS
  tokens: with the key/value cache (`ModelRunner.greedy`: the prompt once, then one position
  per token) against the decoding it replaced (one whole forward of the pipeline's training
  shape through DeepSpeed's `eval_batch` per new token). The ratio uncached / cached is the
  cache's speed-up per generated token.

    .venv/bin/python bench/eval_loglik.py                      # all three: ~8 minutes
    .venv/bin/python bench/eval_loglik.py --part dp            # ~2 minutes
    .venv/bin/python bench/eval_loglik.py --part pp_generate   # ~2 minutes on 2 shared cores
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F

from common import REPO, machine, median, stdlib_dataset

ROUNDS = 3
BATCH = 8
EXAMPLES = 50  # of the task's 200: 200 requests, timed per 1,000
DP_EXAMPLES = 50  # 200 requests per data-parallel round: 25 batches
DP_ROUNDS = 3
GEN_ROWS, GEN_PROMPT, GEN_TOKENS, GEN_ROUNDS = 4, 64, 16, 3


def requests(examples: int = EXAMPLES):
    from pretrain.resolve.eval_tasks import task_manager

    task = task_manager(["python_next_line"]).load(["python_next_line"])["tasks"]
    task = task["python_next_line"]
    task.build_all_requests(limit=examples, rank=0, world_size=1)
    return task.instances


def quickstart_model():
    """(model config, model with its initial weights, tokenizer) of the quickstart."""
    from pretrain.config import load_config
    from pretrain.data import Tokenizer
    from pretrain.model import build_model

    data = stdlib_dataset()
    cfg = load_config(REPO / "configs/quickstart.yaml",
                      [f"data.tokenizer={data['tokenizer']}", f"data.dataset={data['dataset']}",
                       "model.vocab_size=8192"])
    return cfg.model, build_model(cfg.model, seed=0).eval(), Tokenizer.load(data["tokenizer"])


def bare_forwards(model, rows) -> float:
    """Seconds to score `rows` (ScoreRow) with the model alone, batched as the adapter does."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].tokens))
    start = time.perf_counter()
    with torch.no_grad():
        for first in range(0, len(order), BATCH):
            batch = [rows[i] for i in order[first:first + BATCH]]
            ids = torch.zeros(len(batch), max(len(r.tokens) - 1 for r in batch), dtype=torch.long)
            for i, row in enumerate(batch):
                ids[i, :len(row.tokens) - 1] = torch.tensor(row.tokens[:-1])
            logprobs = F.log_softmax(model(ids).float(), dim=-1)
            for i, row in enumerate(batch):
                n, c = len(row.tokens) - 1, row.continuation
                targets = torch.tensor(row.tokens[-c:])
                logprobs[i, n - c:n].gather(-1, targets[:, None]).sum().item()
    return time.perf_counter() - start


def overhead() -> None:
    from pretrain.evaluation.adapter import PretrainLM
    from pretrain.evaluation.runner import ModelRunner

    cfg, model, tokenizer = quickstart_model()
    lm = PretrainLM(ModelRunner(model, vocab_size=cfg.vocab_size, seq_length=cfg.seq_length,
                                batch_size=BATCH), tokenizer)
    reqs = requests()
    rows = [lm._window(*lm._encode_pair(*req.args)) for req in reqs]
    adapter, bare = [], []
    for _ in range(ROUNDS):  # alternate, so that a change of load hits both
        start = time.perf_counter()
        lm.loglikelihood(reqs)
        adapter.append(time.perf_counter() - start)
        bare.append(bare_forwards(model, rows))
    per_k = 1000 / len(reqs)
    tokens = sum(len(r.tokens) - 1 for r in rows) / len(rows)
    print(f"{len(reqs)} requests (mean {tokens:.0f} input tokens), batch {BATCH}, fp32, "
          f"median of {ROUNDS}")
    print(f"adapter (lm-eval loglikelihood): {median(adapter) * per_k:.1f} s per 1,000 requests")
    print(f"bare model forwards:             {median(bare) * per_k:.1f} s per 1,000 requests")
    print(f"ratio adapter / bare: {median(adapter) / median(bare):.3f}")


def replica_rank(rank: int, world_size: int) -> tuple[float, int] | None:
    """On each of `world_size` ranks (each a data-parallel replica): the adapter's
    loglikelihood over DP_EXAMPLES examples, driven by rank 0; rank 0's (seconds, requests)."""
    from pretrain.evaluation.adapter import PretrainLM
    from pretrain.evaluation.runner import ModelRunner, Replicas
    from pretrain.resolve.topology import Topology

    cfg, model, tokenizer = quickstart_model()
    replicas = Replicas()
    if world_size > 1:
        groups = Topology(tensor=1, pipeline=1, world_size=world_size, rank=rank).create_groups()
        replicas = Replicas.of_mpu(groups.mpu)
    runner = ModelRunner(model, vocab_size=cfg.vocab_size, seq_length=cfg.seq_length,
                         batch_size=BATCH, distributed=world_size > 1, replicas=replicas)
    if rank > 0:
        runner.serve()
        return None
    reqs = requests(DP_EXAMPLES)
    lm = PretrainLM(runner, tokenizer)
    start = time.perf_counter()
    lm.loglikelihood(reqs)
    seconds = time.perf_counter() - start
    runner.stop()
    return seconds, len(reqs)


def data_parallel() -> None:
    from pretrain.testing.ranks import run_on_ranks

    stdlib_dataset()  # made once, before the ranks read it
    times: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(DP_ROUNDS):  # alternate, so that a change of load hits both
            for dp in times:
                seconds, n = run_on_ranks(replica_rank, world_size=dp, tmp_path=tmp,
                                          timeout_s=1800)[0]
                times[dp].append(seconds * 1000 / n)
    print(f"{n} requests, batch {BATCH}, fp32, one thread per rank, median of {DP_ROUNDS}")
    for dp, per_k in times.items():
        print(f"dp {dp} ({dp} gloo rank{'s' * (dp > 1)}): {median(per_k):.1f} s per 1,000 "
              f"requests")
    print(f"ratio dp 1 / dp 2: {median(times[1]) / median(times[2]):.3f}")


def uncached_greedy(runner, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The pipeline's greedy decoding before the cache: per new token one forward of the
    training shape (the last seq_length tokens) through DeepSpeed's `eval_batch`."""
    sequences = [list(p) for p in prompts]
    for _ in range(max_new_tokens):
        windows = [seq[-runner.seq_length:] for seq in sequences]
        logits = runner._logits(runner._padded(windows))
        picked = None
        if logits is not None:
            picked = logits[torch.arange(len(windows)), [len(w) - 1 for w in windows]].argmax(-1)
        picked = runner._from_last_stage(picked, shape=(len(windows),), dtype=torch.long,
                                         fill=-1).tolist()
        for seq, token in zip(sequences, picked):
            seq.append(token)
    return [seq[len(prompts[0]):] for seq in sequences]


def pipeline_rank(rank: int, world_size: int) -> dict | None:
    """A 2-stage pipeline engine of the quickstart's model; rank 0's seconds per generated
    token, cached and uncached, rounds alternating (both stages take part in each)."""
    import logging

    import deepspeed

    from pretrain.dist import init_deepspeed_comm
    from pretrain.evaluation.runner import GreedyBatch, ModelRunner
    from pretrain.model import build_pipeline_model

    deepspeed.utils.logger.setLevel(logging.WARNING)
    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    cfg = quickstart_model()[0]
    module = build_pipeline_model(cfg, seed=0, num_stages=2)
    engine, *_ = deepspeed.initialize(model=module, config={
        "train_batch_size": GEN_ROWS, "train_micro_batch_size_per_gpu": GEN_ROWS,
        "steps_per_print": 10**9})
    runner = ModelRunner(engine, vocab_size=cfg.vocab_size, seq_length=cfg.seq_length,
                         batch_size=GEN_ROWS, distributed=True,
                         pipeline_shape=(GEN_ROWS, cfg.seq_length))
    prompts = torch.randint(0, cfg.vocab_size, (GEN_ROWS, GEN_PROMPT),
                            generator=torch.Generator().manual_seed(0)).tolist()
    batch = GreedyBatch(prompts=tuple(map(tuple, prompts)), max_new_tokens=GEN_TOKENS,
                        until=((),) * GEN_ROWS)
    times: dict[str, list[float]] = {"cached": [], "uncached": []}
    tokens = {}
    for _ in range(GEN_ROUNDS):
        for kind in times:
            start = time.perf_counter()
            with torch.no_grad():
                if kind == "cached":
                    tokens[kind] = runner._greedy(batch)
                else:
                    tokens[kind] = uncached_greedy(runner, prompts, GEN_TOKENS)
            times[kind].append((time.perf_counter() - start) / GEN_TOKENS)
    if tokens["cached"] != tokens["uncached"]:
        raise AssertionError("the cached and the uncached decoding chose different tokens")
    return times if rank == 0 else None


def pipeline_generation() -> None:
    from pretrain.testing.ranks import run_on_ranks

    stdlib_dataset()  # made once, before the ranks read it
    with tempfile.TemporaryDirectory() as tmp:
        times = run_on_ranks(pipeline_rank, world_size=2, tmp_path=tmp, timeout_s=1800)[0]
    print(f"pp 2 (2 gloo ranks, one thread each), {GEN_ROWS} rows, prompt {GEN_PROMPT}, "
          f"{GEN_TOKENS} new tokens, fp32, median of {GEN_ROUNDS} (same tokens both ways)")
    for kind, seconds in times.items():
        print(f"{kind + ':':<10} {median(seconds) * 1000:.1f} ms per generated token")
    print(f"ratio uncached / cached: {median(times['uncached']) / median(times['cached']):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["overhead", "dp", "pp_generate", "all"],
                        default="all")
    part = parser.parse_args().part
    print(f"machine: {machine()}")
    if part in ("overhead", "all"):
        overhead()
    if part in ("dp", "all"):
        data_parallel()
    if part in ("pp_generate", "all"):
        pipeline_generation()


if __name__ == "__main__":
    main()
