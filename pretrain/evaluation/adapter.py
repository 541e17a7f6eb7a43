"""lm-eval-harness's `LM` interface over this stack's model (`ModelRunner`), for rank 0.

Tokenization is lm-eval's `TemplateLM` (the same context / continuation split as its `HFLM`) with
the run's tokenizer; an empty context is conditioned on the beginning-of-sequence token, or the
end-of-document one when the tokenizer has none (as `HFLM` does). Windows longer than
model.seq_length keep their last seq_length + 1 tokens, as `HFLM` truncates them.
"""
from __future__ import annotations

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from pretrain.data import Tokenizer
from pretrain.evaluation.runner import GreedyBatch, ModelRunner, ScoreRow

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default, when a task names none


class PretrainLM(TemplateLM):
    """The run's model for `lm_eval.simple_evaluate`: log-likelihoods and greedy decoding,
    batched by `runner` (rank 0 only; the other ranks serve the runner's commands)."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer) -> None:
        super().__init__()
        self.runner, self.tok = runner, tokenizer
        self.max_length = runner.seq_length
        if runner.decode is None:  # a one-process runner: it stops generations with ours
            runner.decode = tokenizer.decode

    # ---- tokenization ---------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id >= 0 else self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens)

    @property
    def tokenizer_name(self) -> str:
        return repr(self.tok)

    # ---- scoring --------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=True)  # no bar between run lines

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        rows = [self._window(context, continuation) for _, context, continuation in requests]
        results = self._in_batches(rows, key=lambda row: -len(row.tokens),
                                   run=self.runner.score)
        for (pair, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def _window(self, context: list[int], continuation: list[int]) -> ScoreRow:
        """The last max_length + 1 tokens of context + continuation (the first is never a
        target), the continuation's targets at its end."""
        if not continuation:
            raise ValueError("lm-eval asked for the log-likelihood of an empty continuation")
        tokens = (context + continuation)[-(self.max_length + 1):]
        return ScoreRow(tokens=tuple(tokens), continuation=min(len(continuation),
                                                               len(tokens) - 1))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood, in disjoint windows of max_length tokens (lm-eval's
        own windowing; the first conditioned on the prefix token)."""
        rows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            for context, continuation in windows:
                rows.append(self._window(context, continuation))
                owners.append(index)
        scores = self._in_batches(rows, key=lambda row: -len(row.tokens), run=self.runner.score)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _in_batches(self, items: list, *, key, run) -> list:
        """run(batches) over `items` sorted by `key`, in batches of the runner's size (one
        command: the data-parallel replicas share them); results in the items' order."""
        order = sorted(range(len(items)), key=lambda i: key(items[i]))
        size = self.runner.batch_size
        chosen = [order[start:start + size] for start in range(0, len(order), size)]
        results: list = [None] * len(items)
        for indices, outs in zip(chosen, run([[items[i] for i in idx] for idx in chosen])):
            for i, result in zip(indices, outs):
                results[i] = result
        return results

    # ---- generation -----------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, stopped and cut at the first of the request's `until` strings
        (and the end-of-document token). Prompts keep their last max_length - max_gen_toks
        tokens."""
        jobs = [self._generation_job(context, dict(kwargs)) for context, kwargs in
                (req.args for req in requests)]
        # one batch: prompts of one length and one max_gen_toks
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, (prompt, max_new, _) in enumerate(jobs):
            by_shape.setdefault((len(prompt), max_new), []).append(i)
        eos = self.tok.eos_id if self.tok.eos_id >= 0 else None
        size = self.runner.batch_size
        chosen = [members[start:start + size] for (_, _), members in sorted(by_shape.items())
                  for start in range(0, len(members), size)]
        batches = [GreedyBatch(prompts=tuple(tuple(jobs[i][0]) for i in indices),
                               max_new_tokens=jobs[indices[0]][1],
                               until=tuple(tuple(jobs[i][2]) for i in indices), eos_id=eos)
                   for indices in chosen]
        texts: list[str] = [""] * len(jobs)
        for indices, outs in zip(chosen, self.runner.greedy(batches)):
            for i, tokens in zip(indices, outs):
                texts[i] = self._cut(tokens, until=jobs[i][2], eos=eos)
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _generation_job(self, context: str, kwargs: dict) -> tuple[list[int], int, list[str]]:
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        if kwargs.pop("do_sample", False) or kwargs.get("temperature", 0.0):
            raise ValueError("this model's lm-eval adapter decodes greedily only: the task asks "
                             f"for sampling ({kwargs})")
        max_new = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        budget = max(1, self.max_length - max_new)
        prompt = (self.tok_encode(context) or [self.prefix_token_id])[-budget:]
        return prompt, max_new, until

    def _cut(self, tokens: list[int], *, until: list[str], eos: int | None) -> str:
        if eos is not None and eos in tokens:
            tokens = tokens[:tokens.index(eos)]
        text = self.tok_decode(tokens)
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return text
