"""Downstream evaluation (pretrain/evaluation): the lm-eval adapter over this stack's model
against lm-eval's own HFLM on the same checkpoint exported to Hugging Face (fp32), in one
process, in a tensor-parallel run and in a pipeline run; an evaluation inside training leaves
the training bitwise unchanged; an unknown task is refused before launch."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pretrain.evaluation.tasks import offline, scores_of, task_manager
from pretrain.testing.runs import run_pretrain, train, train_args

TASKS = ["python_next_line", "python_passages", "python_line_completion"]
LIMIT = 4
STEPS = 4
EVAL = [f"eval.tasks=[{','.join(TASKS)}]", "eval.interval=2", f"eval.limit={LIMIT}",
        f"train.steps={STEPS}", "checkpoint.save_final=true"]
LAYOUTS = {"tp2": ["parallel.tensor=2"], "pp2": ["parallel.pipeline=2"]}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict:
    """The tiny model trained 4 steps at tp 2 and at pp 2, both evaluating TASKS every 2 steps,
    and the pp 2 run again without them; each run's final weights exported to Hugging Face."""
    from pretrain.checkpoint.hf import export_hf
    from pretrain.checkpoint.weights import load_weights

    tmp = tmp_path_factory.mktemp("eval_runs")
    out = {name: train(tmp, tiny_data, overrides=overrides + EVAL, nprocs=2, name=name)
           for name, overrides in LAYOUTS.items()}
    out["pp2_without"] = train(tmp, tiny_data, overrides=LAYOUTS["pp2"] + EVAL[3:], nprocs=2,
                               name="pp2_without")
    for name in LAYOUTS:
        export_hf(load_weights(out[name].run_dir / "final"), tmp / f"{name}_hf", dtype="fp32")
    out["tmp"] = tmp
    return out


def _hflm(path: Path, *, batch_size: int = 4):
    offline()
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(path), dtype="float32", device="cpu", batch_size=batch_size)


def _requests(task_name: str):
    task = task_manager([task_name]).load([task_name])["tasks"][task_name]
    task.build_all_requests(limit=LIMIT, rank=0, world_size=1)
    return task.instances


@pytest.mark.slow
def test_adapter_gives_hflms_log_likelihoods_and_generations(runs):
    """One process: each request's log-likelihood, greedy flag, rolling log-likelihood and
    greedy generation as lm-eval's HFLM gives them on the exported checkpoint."""
    from pretrain.checkpoint.generate import load_for_inference
    from pretrain.evaluation.adapter import PretrainLM
    from pretrain.evaluation.runner import ModelRunner

    run_dir = runs["pp2"].run_dir
    model, tokenizer, weights, _ = load_for_inference(str(run_dir / "final"), device="cpu",
                                                      dtype="fp32")
    # batch 3: batches of mixed lengths, padded differently from HFLM's batches of 4
    ours = PretrainLM(ModelRunner(model, vocab_size=weights.model.vocab_size,
                                  seq_length=weights.model.seq_length, batch_size=3), tokenizer)
    theirs = _hflm(runs["tmp"] / "pp2_hf")
    choices = _requests("python_next_line")
    a, b = ours.loglikelihood(choices), theirs.loglikelihood(choices)
    assert len(a) == LIMIT * 4
    assert [greedy for _, greedy in a] == [greedy for _, greedy in b]
    for (x, _), (y, _) in zip(a, b):
        assert math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-4), (x, y)
    passages = _requests("python_passages")
    for x, y in zip(ours.loglikelihood_rolling(passages), theirs.loglikelihood_rolling(passages)):
        assert math.isclose(x, y, rel_tol=1e-5), (x, y)
    # generation: transformers' greedy ids of the same prompts, cut as the adapter cuts them
    # (HFLM's strings differ only where a cut falls inside a UTF-8 byte sequence)
    lines = _requests("python_line_completion")
    expected = []
    for request in lines:
        prompt, max_new, until = ours._generation_job(request.args[0], dict(request.args[1]))
        out = theirs.model.generate(torch.tensor([prompt]), max_new_tokens=max_new,
                                    do_sample=False, eos_token_id=tokenizer.eos_id,
                                    pad_token_id=tokenizer.eos_id)
        expected.append(ours._cut(out[0, len(prompt):].tolist(), until=until,
                                  eos=tokenizer.eos_id))
    generated = ours.generate_until(lines)
    assert generated == expected
    assert any(generated), "every generation was empty: nothing compared"


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_in_run_scores_equal_hflms_on_the_exported_checkpoint(runs, layout):
    """The scores a tp 2 / pp 2 run wrote after its last step are HFLM's (same tasks, same
    limit) on its final weights; the step lines and the sinks' record carry them."""
    from lm_eval import simple_evaluate

    run = runs[layout]
    records = [r for r in run.records if r["kind"] == "tasks"]
    assert [r["step"] for r in records] == [2, 4]
    in_run = {k: v for k, v in records[-1].items() if "/" in k}
    results = simple_evaluate(model=_hflm(runs["tmp"] / f"{layout}_hf"), tasks=TASKS,
                              limit=LIMIT, task_manager=task_manager(TASKS), log_samples=False,
                              bootstrap_iters=0)
    reference = scores_of(results)
    assert set(in_run) == set(reference) and len(reference) == 6
    for name, value in reference.items():
        assert math.isclose(in_run[name], value, rel_tol=1e-5), (name, in_run[name], value)
    assert f"[tasks] step {STEPS} | python_next_line/acc" in run.stdout + run.stderr


@pytest.mark.slow
def test_an_evaluation_inside_training_changes_no_training_loss(runs):
    """The pp 2 run with evaluations after steps 2 and 4 has bitwise the losses of the same run
    without them (the pipeline's buffers, the modules' modes and the generators restored)."""
    with_eval, without = runs["pp2"].losses, runs["pp2_without"].losses
    assert len(with_eval) == STEPS and with_eval == without
    assert not [r for r in runs["pp2_without"].records if r["kind"] == "tasks"]


@pytest.mark.slow
def test_an_unknown_task_is_refused_before_launch(tiny_data, tmp_path):
    """A misspelt task name stops `pretrain train` with exit 2 and one line naming the task, the
    near name and where tasks come from, before any engine or process group."""
    run_dir = tmp_path / "refused"
    args = train_args(run_dir, tiny_data, overrides=["eval.tasks=[python_next_lines]"])
    run = run_pretrain(args, run_dir=run_dir, nprocs=1)
    assert run.returncode == 2, run.stderr[-2000:]
    assert ("error: eval.tasks: unknown task 'python_next_lines' (did you mean python_next_line?)"
            in run.stderr)
    assert not (run_dir / "metrics.jsonl").exists()


def test_curves_draw_the_task_scores_in_a_fourth_panel(tmp_path):
    """Scores in [0, 1] get a panel of their own; perplexities (which would flatten it) do not."""
    import json

    from pretrain import curves

    records = [{"kind": "train", "step": s, "loss": 5.0 - s, "lr": 1e-3, "tokens_per_s": 10.0}
               for s in (1, 2, 3, 4)]
    records += [{"kind": "tasks", "step": s, "python_next_line/acc": 0.25 * s / 2,
                 "python_passages/byte_perplexity": 30.0 / s, "seconds": 1.0} for s in (2, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = curves.read_curves(tmp_path)
    assert run.tasks == {"python_next_line/acc": [(2, 0.25), (4, 0.5)]}
    from matplotlib.figure import Figure

    drawn = []
    original = Figure.subplots
    Figure.subplots = lambda self, rows, cols, **kw: drawn.append(rows) or original(
        self, rows, cols, **kw)
    try:
        curves.write_png([run], tmp_path / "with.png")
        curves.write_png([curves.RunCurves("plain", [(1, 1.0)], [], [], [])],
                         tmp_path / "without.png")
    finally:
        Figure.subplots = original
    assert drawn == [4, 3]


def test_eval_settings_are_checked_when_the_config_loads():
    from pretrain.config import load_config
    from pretrain.errors import ConfigError

    cfg = load_config(None, ["eval.tasks=[python_next_line]", "eval.interval=5", "eval.limit=3"])
    assert (cfg.eval.tasks, cfg.eval.interval, cfg.eval.limit) == (["python_next_line"], 5, 3)
    for bad, words in (("eval.interval=-1", "eval.interval"), ("eval.limit=0", "eval.limit"),
                       ("eval.tasks=[a,a]", "name each task once")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, [bad])


def test_context_parallel_runs_are_refused_before_launch():
    from pretrain.config import load_config
    from pretrain.errors import ConfigError
    from pretrain.evaluation.tasks import check_eval_config

    cfg = load_config(None, ["eval.tasks=[python_next_line]", "parallel.context=2"])
    with pytest.raises(ConfigError, match="parallel.context > 1"):
        check_eval_config(cfg)
    check_eval_config(load_config(None, ["eval.tasks=[python_next_line]"]))  # a local task: fine


@pytest.mark.slow
def test_pretrain_eval_prints_and_writes_the_runs_final_scores(runs):
    """`pretrain eval` on the pp 2 run's directory (its last checkpoint, one process) gives the
    scores the run wrote after its last step, printed and in eval_step4.json beside it."""
    import json

    from pretrain.testing.cli import run_cli
    from pretrain.testing.runs import REPO

    run = runs["pp2"]
    proc = run_cli(["eval", str(run.run_dir), "--tasks", "python_next_line,python_passages",
                    "--limit", str(LIMIT), "--batch-size", "3"], cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads((run.run_dir / f"eval_step{STEPS}.json").read_text())
    in_run = [r for r in run.records if r["kind"] == "tasks"][-1]
    assert written["step"] == STEPS and written["limit"] == LIMIT
    assert set(written["scores"]) == {"python_next_line/acc", "python_next_line/acc_norm",
                                      "python_passages/word_perplexity",
                                      "python_passages/byte_perplexity",
                                      "python_passages/bits_per_byte"}
    for name, value in written["scores"].items():
        assert math.isclose(value, in_run[name], rel_tol=1e-5), (name, value, in_run[name])
        assert f"{name}" in proc.stdout
