"""Time per 1,000 log-likelihood requests of the lm-eval adapter (`pretrain.evaluation`) at the
quickstart's shape: configs/quickstart.yaml's model (the `small` preset: 6 layers, hidden 384,
seq 256, vocabulary 8192, tied) in fp32 on the CPU, one process, batches of 8, on the
multiple-choice requests of the local task python_next_line (its first 50 examples x 4
choices; the quickstart's tokenizer, made once under .build/bench). The weights are the initial ones: the
time does not depend on them.

Baseline, measured in the same run: the same windows (the same token ids, batched in the same
order) through the bare model, log-softmax and gather, without lm-eval, the adapter or the
runner. The ratio is the adapter's overhead (tokenization, batching, bookkeeping).

    .venv/bin/python bench/eval_loglik.py        # ~5 minutes on 2 shared, loaded cores
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from common import REPO, machine, median, stdlib_dataset

ROUNDS = 3
BATCH = 8
EXAMPLES = 50  # of the task's 200: 200 requests, timed per 1,000


def requests(tokenizer):
    from pretrain.evaluation.tasks import task_manager

    task = task_manager(["python_next_line"]).load(["python_next_line"])["tasks"]
    task = task["python_next_line"]
    task.build_all_requests(limit=EXAMPLES, rank=0, world_size=1)
    return task.instances


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


def main() -> None:
    from pretrain.config import load_config
    from pretrain.data import Tokenizer
    from pretrain.evaluation.adapter import PretrainLM
    from pretrain.evaluation.runner import ModelRunner
    from pretrain.model import build_model

    data = stdlib_dataset()
    cfg = load_config(REPO / "configs/quickstart.yaml",
                      [f"data.tokenizer={data['tokenizer']}", f"data.dataset={data['dataset']}",
                       "model.vocab_size=8192"])
    model = build_model(cfg.model, seed=0).eval()
    tokenizer = Tokenizer.load(data["tokenizer"])
    lm = PretrainLM(ModelRunner(model, vocab_size=cfg.model.vocab_size,
                                seq_length=cfg.model.seq_length, batch_size=BATCH), tokenizer)
    reqs = requests(tokenizer)
    rows = [lm._window(*lm._encode_pair(*req.args)) for req in reqs]
    adapter, bare = [], []
    for _ in range(ROUNDS):  # alternate, so that a change of load hits both
        start = time.perf_counter()
        lm.loglikelihood(reqs)
        adapter.append(time.perf_counter() - start)
        bare.append(bare_forwards(model, rows))
    per_k = 1000 / len(reqs)
    tokens = sum(len(r.tokens) - 1 for r in rows) / len(rows)
    print(f"machine: {machine()}")
    print(f"{len(reqs)} requests (mean {tokens:.0f} input tokens), batch {BATCH}, fp32, "
          f"median of {ROUNDS}")
    print(f"adapter (lm-eval loglikelihood): {median(adapter) * per_k:.1f} s per 1,000 requests")
    print(f"bare model forwards:             {median(bare) * per_k:.1f} s per 1,000 requests")
    print(f"ratio adapter / bare: {median(adapter) / median(bare):.3f}")


if __name__ == "__main__":
    main()
