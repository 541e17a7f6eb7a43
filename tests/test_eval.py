"""Downstream evaluation (pretrain/evaluation): the lm-eval adapter over this stack's model
against lm-eval's own HFLM on the same checkpoint exported to Hugging Face (fp32), in one
process, in a tensor-parallel run and in pipeline runs (DeepSpeed's, fsdp2's); an evaluation
inside training leaves the training bitwise unchanged; an unknown task is refused before
launch."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pretrain.resolve.eval_tasks import offline, task_manager
from pretrain.evaluation.tasks import scores_of
from pretrain.testing.runs import run_pretrain, train, train_args

TASKS = ["python_next_line", "python_passages", "python_line_completion"]
LIMIT = 4
STEPS = 4
EVAL = [f"eval.tasks=[{','.join(TASKS)}]", "eval.interval=2", f"eval.limit={LIMIT}",
        f"train.steps={STEPS}", "checkpoint.save_final=true"]
# fsdp2's ZBV: 4 stages in a V over 2 ranks (rank 0 holds stages 0 and 3, rank 1 stages 1 and
# 2), so a forward outside the schedule both sends between ranks and hands on within one
FSDP2_PP2 = ["train.engine=fsdp2", "deepspeed=ds_configs/zero2.json", "parallel.pipeline=2",
             "parallel.pipeline_schedule=zbv", "parallel.virtual_stages=2", "model.num_layers=4"]
LAYOUTS = {"tp2": ["parallel.tensor=2"], "pp2": ["parallel.pipeline=2"], "fsdp2_pp2": FSDP2_PP2}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict:
    """The tiny model trained 4 steps at tp 2, at pp 2 and on fsdp2's ZBV pipeline, each
    evaluating TASKS every 2 steps, and the two pipelines again without them; each run's final
    weights exported to Hugging Face."""
    from pretrain.checkpoint.hf import export_hf
    from pretrain.checkpoint.weights import load_weights

    tmp = tmp_path_factory.mktemp("eval_runs")
    out = {name: train(tmp, tiny_data, overrides=overrides + EVAL, nprocs=2, name=name)
           for name, overrides in LAYOUTS.items()}
    for name in ("pp2", "fsdp2_pp2"):
        out[f"{name}_without"] = train(tmp, tiny_data, overrides=LAYOUTS[name] + EVAL[3:],
                                       nprocs=2, name=f"{name}_without")
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


def _head_calls(model) -> list[int]:
    """[calls of the model's head so far]: one per scoring forward and per decoding step."""
    calls = [0]
    model.lm_head.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _generation_requests(until: list[str] | None = None):
    """python_line_completion's requests; with `until`, request i stops at until[i] instead of
    at the end of its line (which the tiny model does not reach in max_gen_toks tokens)."""
    requests = _requests("python_line_completion")
    for request, stop in zip(requests, until or []):
        request.arguments = (request.args[0], {**request.args[1], "until": [stop]})
    return requests


def _phases(lm, until: list[str]) -> list:
    """What each test asks of an adapter, in this order: the phases of `_counted_phases`."""
    return [lambda: lm.loglikelihood(_requests("python_next_line")),
            lambda: lm.loglikelihood_rolling(_requests("python_passages")),
            lambda: lm.generate_until(_generation_requests(until))]


def _counted_phases(rank: int, world_size: int, final: str,
                    until: list[str]) -> tuple[list, list[int]]:
    """The adapter's answers to `_phases` on the checkpoint `final`, batches of 3, rank 0
    driving, and the head calls (forwards, decoding steps) this rank made in each phase. On
    2 ranks: data parallelism, each rank a replica."""
    from pretrain.checkpoint.generate import load_for_inference
    from pretrain.evaluation.runner import ModelRunner, Replicas
    from pretrain.resolve.topology import Topology

    model, tokenizer, weights, _ = load_for_inference(final, device="cpu", dtype="fp32")
    replicas = Replicas()
    if world_size > 1:
        groups = Topology(tensor=1, pipeline=1, world_size=world_size, rank=rank).create_groups()
        replicas = Replicas.of_mpu(groups.mpu)
    # batch 3: batches of mixed lengths, padded differently from HFLM's batches of 4
    runner = ModelRunner(model, vocab_size=weights.model.vocab_size,
                         seq_length=weights.model.seq_length, batch_size=3,
                         distributed=world_size > 1, replicas=replicas, decode=tokenizer.decode)
    calls = _head_calls(model)
    answers, counts = [], []
    lm = None
    if rank == 0:  # lm-eval is imported by the driver only
        from pretrain.evaluation.adapter import PretrainLM

        lm = PretrainLM(runner, tokenizer)
    for phase in _phases(lm, until):
        before = calls[0]
        if rank == 0:
            answers.append(phase())
            runner.stop()
        else:
            runner.serve()
        counts.append(calls[0] - before)
    return answers, counts


@pytest.fixture(scope="module")
def one_process(runs) -> dict:
    """The adapter on the pp 2 run's final checkpoint in one process (its answers, the head
    calls of each phase, the generation batches with their decoding steps), and HFLM's answers
    on its export (generation: transformers' greedy ids, max_gen_toks of them, per prompt)."""
    from pretrain.checkpoint.generate import load_for_inference
    from pretrain.evaluation.adapter import PretrainLM
    from pretrain.evaluation.runner import ModelRunner

    final = str(runs["pp2"].run_dir / "final")
    model, tokenizer, weights, _ = load_for_inference(final, device="cpu", dtype="fp32")
    runner = ModelRunner(model, vocab_size=weights.model.vocab_size,
                         seq_length=weights.model.seq_length, batch_size=3)
    ours = PretrainLM(runner, tokenizer)
    theirs = _hflm(runs["tmp"] / "pp2_hf")
    full, until = {}, []  # prompt -> transformers' greedy ids (max_gen_toks, or up to EOS)
    for i, request in enumerate(_generation_requests()):
        prompt, max_new, _ = ours._generation_job(request.args[0], dict(request.args[1]))
        out = theirs.model.generate(torch.tensor([prompt]), max_new_tokens=max_new,
                                    do_sample=False, eos_token_id=tokenizer.eos_id,
                                    pad_token_id=tokenizer.eos_id)
        full[tuple(prompt)] = out[0, len(prompt):].tolist()
        # a stop string the model writes by token 3, 7, 11, ...: rows stop at different steps
        until.append(tokenizer.decode(full[tuple(prompt)][:3 + 4 * i])[-3:].strip("\ufffd"))
    calls, steps = _head_calls(model), []  # (batch, decoding steps) of each generation batch
    run_batch = runner._greedy

    def counted(batch):
        before = calls[0]
        out = run_batch(batch)
        steps.append((batch, calls[0] - before))
        return out

    runner._greedy = counted
    ours.generate_until(_generation_requests(until))
    answers, counts = _counted_phases(0, 1, final, until)
    return {"ours": answers, "counts": counts, "steps": steps, "full": full, "until": until,
            "ours_lm": ours, "theirs": [phase() for phase in _phases(theirs, until)[:2]],
            "eos": tokenizer.eos_id}


def _assert_hflms(answers: list, one_process: dict) -> None:
    """`answers` to `_phases` are HFLM's: log-likelihoods and greedy flags, rolling
    log-likelihoods, and the generations (transformers' greedy ids cut as the adapter cuts them:
    HFLM's strings differ only where a cut falls inside a UTF-8 byte sequence)."""
    a, b = answers[0], one_process["theirs"][0]
    assert len(a) == LIMIT * 4
    assert [greedy for _, greedy in a] == [greedy for _, greedy in b]
    for (x, _), (y, _) in zip(a, b):
        assert math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-4), (x, y)
    for x, y in zip(answers[1], one_process["theirs"][1]):
        assert math.isclose(x, y, rel_tol=1e-5), (x, y)
    ours, expected = one_process["ours_lm"], []
    for request in _generation_requests(one_process["until"]):
        prompt, _, until = ours._generation_job(request.args[0], dict(request.args[1]))
        tokens = one_process["full"][tuple(prompt)]
        expected.append(ours._cut(tokens, until=until, eos=one_process["eos"]))
    assert answers[2] == expected
    assert any(answers[2]), "every generation was empty: nothing compared"


@pytest.mark.slow
def test_adapter_gives_hflms_log_likelihoods_and_generations(one_process):
    """One process: each request's log-likelihood, greedy flag, rolling log-likelihood and
    greedy generation as lm-eval's HFLM gives them on the exported checkpoint."""
    _assert_hflms(one_process["ours"], one_process)


@pytest.mark.slow
def test_generation_stops_at_its_until_strings(one_process):
    """A generation batch decodes until every row has written one of its `until` strings (or
    the end-of-document token), not max_gen_toks tokens: its decoding steps are the latest of
    its rows' stops in transformers' greedy ids."""
    decode = one_process["ours_lm"].tok_decode
    eos, full = one_process["eos"], one_process["full"]
    for batch, steps in one_process["steps"]:
        stops = []
        for prompt, until in zip(batch.prompts, batch.until):
            tokens = full[prompt]
            stop = next((n for n in range(1, len(tokens) + 1) if tokens[n - 1] == eos
                         or any(s in decode(tokens[:n]) for s in until if s)), len(tokens))
            stops.append(stop)
        assert steps == max(stops), (steps, stops, batch.max_new_tokens)
    assert any(steps < batch.max_new_tokens for batch, steps in one_process["steps"]), (
        "no batch stopped early: nothing checked")


@pytest.mark.slow
def test_data_parallel_replicas_share_the_batches(runs, one_process, tmp_path):
    """dp 2 (two replicas of one rank each): the answers are HFLM's, as in one process, and
    each replica ran about half the forwards: together, one process's count."""
    from pretrain.testing.ranks import run_on_ranks

    final = str(runs["pp2"].run_dir / "final")
    (answers, counts0), (_, counts1) = run_on_ranks(
        _counted_phases, world_size=2, tmp_path=tmp_path, args=(final, one_process["until"]))
    _assert_hflms(answers, one_process)
    alone = one_process["counts"]
    for phase, (mine, theirs, total) in enumerate(zip(counts0, counts1, alone)):
        assert mine + theirs == total and 0 < mine < total, (phase, counts0, counts1, alone)
    for phase in (0, 1):  # scoring: one forward per batch, batches dealt alternately
        assert counts0[phase] == (alone[phase] + 1) // 2, (counts0, alone)


def test_replicas_share_batches_only_where_each_holds_whole_weights():
    """A DeepSpeed engine's replicas come from its mpu; under ZeRO-3 (weights partitioned over
    the data-parallel ranks: every forward gathers from every replica) and for a bare model or
    an engine without an mpu (FSDP2's), there is one: every rank runs every batch."""
    from types import SimpleNamespace

    from pretrain.evaluation.runner import Replicas

    mpu = SimpleNamespace(get_data_parallel_world_size=lambda: 2,
                          get_data_parallel_rank=lambda: 1, get_model_parallel_group=lambda: "g")

    def engine(zero3: bool):
        return SimpleNamespace(mpu=mpu, zero_optimization_partition_weights=lambda: zero3)

    assert Replicas.of_model(engine(False)) == Replicas(index=1, count=2, group="g")
    assert Replicas.of_model(engine(True)) == Replicas()
    assert Replicas.of_model(SimpleNamespace(module=None)) == Replicas()
    assert Replicas.of_model(torch.nn.Linear(1, 1)) == Replicas()


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_in_run_scores_equal_hflms_on_the_exported_checkpoint(runs, layout):
    """The scores a tp 2 / pp 2 / fsdp2 ZBV run wrote after its last step are HFLM's (same tasks, same
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
@pytest.mark.parametrize("layout", ["pp2", "fsdp2_pp2"])
def test_an_evaluation_inside_training_changes_no_training_loss(runs, layout):
    """A pipeline run with evaluations after steps 2 and 4 has bitwise the losses and gradient
    norms of the same run without them (DeepSpeed's buffers, torch's schedule and FSDP2's
    units, the modules' modes and the generators as they were)."""
    with_eval, without = runs[layout], runs[f"{layout}_without"]
    assert len(with_eval.losses) == STEPS and with_eval.losses == without.losses
    norms = [[r["grad_norm"] for r in run.records if r["kind"] == "train"]
             for run in (with_eval, without)]
    assert norms[0] == norms[1]
    assert not [r for r in without.records if r["kind"] == "tasks"]


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

    from pretrain.training import curves

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
    from pretrain.resolve.run_checks import check_eval_config

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
