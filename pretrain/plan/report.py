"""The text `pretrain plan` prints: one planned layout, or the ranking of a search."""
from __future__ import annotations

from pretrain.arithmetic import (expert_data_size, expert_layout_label,
                                 expert_parameters_per_rank, expert_tensor_size,
                                 model_flops_per_token, num_active_parameters, num_parameters)
from pretrain.config import Engine, ModelConfig, RunConfig
from pretrain.families import family_of
from pretrain.resolve.ds_config import shipped_ds_configs
from pretrain.hardware import format_flops
from pretrain.plan.clusters import MEMORY_USABLE_FRACTION, Cluster
from pretrain.plan.memory import GB
from pretrain.resolve.layout import Layout
from pretrain.resolve.topology import Topology
from pretrain.plan.search import MEMORY_MARGIN_REASON, Plan, engine_key, keeps_margin, search


def format_run(plan: Plan, cfg: RunConfig, *, config_path: str | None, accelerator: str) -> str:
    """The dry run's summary of a run config (layout, engine, model) followed by its plan."""
    layout, world, m = plan.layout, plan.layout.world_size, cfg.model
    lines = [
        f"[plan] {config_path or '(defaults)'} on {world} ranks ({accelerator}): the config "
        "resolves; nothing was launched",
        f"layout  tp {layout.tensor} x pp {layout.pipeline}"
        f"{f' x cp {layout.context}' if layout.context > 1 else ''}"
        f"{expert_layout_label(layout)} "
        f"x dp {layout.data} = "
        f"{world} ranks | "
        f"global batch {layout.global_batch} = micro {layout.micro_batch} x accum "
        f"{layout.grad_accum} x dp {layout.data} ({layout.global_batch * m.seq_length:,} tokens)",
        f"engine  {_engine(plan)} | offload optimizer={layout.offload_optimizer} "
        f"param={layout.offload_param} | {layout.precision.value} | recompute "
        f"{layout.recompute.value} | sequence parallel "
        f"{'on' if layout.sequence_parallel else 'off'} | partition {layout.partition}"
        f"{f' | fp8 {layout.fp8}' if layout.fp8 != 'none' else ''}"
        f"{f' | optimizer {layout.optimizer}' if layout.optimizer != 'adamw' else ''}",
        f"model   {_count(num_parameters(m))} parameters{_active(m)}, "
        f"{model_flops_per_token(m):.3g} FLOPs/token, seq {m.seq_length}",
        *([_experts_line(m, layout)] if m.num_experts else []),
        format_plan(plan),
    ]
    return "\n".join(lines)


def _engine(plan: Plan) -> str:
    """'ZeRO-3' (DeepSpeed's), or what fsdp2 makes of the JSON's ZeRO stage."""
    stage = plan.layout.zero_stage
    if plan.engine is not Engine.FSDP2:
        return f"ZeRO-{stage}"
    kept = "resharded after forward" if stage == 3 else "kept gathered from forward to backward"
    replicas = plan.layout.fsdp2_replicas
    hsdp = f", HSDP {replicas} replica groups" if replicas > 1 else ""
    lay = plan.layout
    pipe = (f", pipeline {lay.schedule} with {lay.virtual_stages} stage"
            f"{'s' if lay.virtual_stages > 1 else ''} a rank" if lay.pipeline > 1 else "")
    return (f"fsdp2 (fully_shard per decoder layer, the JSON's ZeRO-{stage}: {kept}{hsdp}"
            f"{pipe})")


def _active(m) -> str:
    """" (12.9B active: 8 experts, top 2)" for a mixture of experts; "" for a dense model."""
    if not m.num_experts:
        return ""
    return (f" ({_count(num_active_parameters(m))} active: {m.num_experts} experts, "
            f"top {m.experts_per_token})")


def _experts_line(m: ModelConfig, layout: Layout) -> str:
    """How the experts lie on a GPU and what they weigh there (before ZeRO sharding), and
    under expert parallelism the expert grid's first groups (`Topology.expert_groups`,
    `expert_data_groups`: rank 0's)."""
    etp = expert_tensor_size(layout)
    if layout.expert == 1:
        held = f"1/{layout.tensor} of each of {m.num_experts} experts"
    else:
        held = (f"{m.num_experts // layout.expert} of {m.num_experts} experts "
                + ("whole" if etp == 1 else f"each split over {etp} ranks"))
    # the heaviest stage's mixture layers
    layers = -(-len(family_of(m).moe_layers(m)) // layout.pipeline)
    n = expert_parameters_per_rank(m, layout, layers=layers)
    line = f"experts {held} per GPU: {_count(n)} expert parameters ({layers} layers)"
    if layout.expert > 1:
        topo = Topology(tensor=layout.tensor, pipeline=layout.pipeline,
                        world_size=layout.world_size, context=layout.context,
                        expert=layout.expert, expert_tensor=layout.expert_tensor)
        line += (f"; expert={layout.expert} x expert_tensor={etp}: all-to-all over expert "
                 f"groups like {_ranks(topo.expert_groups()[0])}, experts reduced and "
                 f"partitioned over expert-data groups of {expert_data_size(layout)} like "
                 f"{_ranks(topo.expert_data_groups()[0])}")
    return line


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 3] as such; a long list by its first ranks and its length."""
    if len(ranks) <= 8:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:4]))}, ... ({len(ranks)} ranks)]"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_plan(plan: Plan) -> str:
    lay, mem, t, c = plan.layout, plan.memory, plan.time, plan.cluster
    pct = (lambda x: f"{100 * x / t.step:4.1f}%") if t.step else (lambda x: "-")
    lines = [
        f"memory per GPU (stage {mem.stage} of {lay.pipeline}, the heaviest; "
        f"{mem.parameters_count / 1e6:,.1f}M parameters before ZeRO sharding):",
        *(f"  {k:<12}{mem.to_gb()[k]:9.2f} GB" for k in
          ("params", "grads", "optimizer", "activations", "buffers")),
        f"  {'total':<12}{mem.total / GB:9.2f} GB of {plan.memory_limit_gb:.1f} GB usable "
        f"({c.gpu_memory_gb:g} GB x {MEMORY_USABLE_FRACTION:g}) -> "
        f"{'fits' if plan.fits else 'DOES NOT FIT'}"
        + (f"; {mem.host / GB:.2f} GB per GPU on the host" if mem.host else ""),
        f"time per step {t.step:.3f} s on {c.name} ({format_flops(c.peak_tflops)} peak):",
        *(f"  {k:<14}{getattr(t, k):9.3f} s {pct(getattr(t, k))}" for k in
          ("compute", "tensor_comm", "bubble", "pipeline_comm", "data_comm", "offload",
           "memory_bound")),
        *([f"  {'pp_overhead':<14}{t.pipeline_overhead:9.3f} s "
           f"{pct(t.pipeline_overhead)} (schedule actions, message latency, split backward)"]
          if lay.pipeline > 1 else []),
        *([f"  {'context_comm':<14}{t.context_comm:9.3f} s {pct(t.context_comm)}"]
          if lay.context > 1 else []),
        *([f"  {'optimizer':<14}{t.optimizer:9.3f} s {pct(t.optimizer)} (Muon: gathers and "
           "Newton-Schulz)"] if t.optimizer else []),
        *([f"  (tensor_comm: expert all-to-alls {t.expert_comm:.3f} s, "
           f"{pct(t.expert_comm).strip()} of the step)"] if lay.expert > 1 else []),
        f"throughput {plan.tokens_per_s:,.0f} tokens/s | model "
        f"{format_flops(plan.model_tflops_per_gpu)}/GPU (MFU {100 * plan.mfu:.1f}%) | hardware "
        f"{format_flops(plan.hardware_tflops_per_gpu)}/GPU (HFU {100 * plan.hfu:.1f}%)",
    ]
    return "\n".join(lines)


def selecting_arguments(layout: Layout, ds_config: str, *,
                        engine: Engine = Engine.DEEPSPEED) -> str:
    """The `pretrain train` / `plan` arguments that select `layout` under `engine` (with
    `ds_config`, the JSON of its ZeRO stage and offload)."""
    sets = [*([f"train.engine={engine.value}"] if engine is not Engine.DEEPSPEED else []),
            *([f"train.fsdp2_replicas={layout.fsdp2_replicas}"]
              if layout.fsdp2_replicas > 1 else []),
            f"parallel.tensor={layout.tensor}", f"parallel.pipeline={layout.pipeline}",
            *([f"parallel.context={layout.context}"] if layout.context > 1 else []),
            *(["parallel.context_kind=allgather"]
              if layout.context > 1 and layout.context_kind == "allgather" else []),
            *([f"parallel.expert={layout.expert}"] if layout.expert > 1 else []),
            *([f"parallel.expert_tensor={layout.expert_tensor}"]
              if layout.expert > 1 and layout.expert_tensor > 1 else []),
            *([f"parallel.pipeline_schedule={layout.schedule}",
               f"parallel.virtual_stages={layout.virtual_stages}"]
              if layout.pipeline > 1 and engine is Engine.FSDP2 else []),
            f"parallel.sequence_parallel={str(layout.sequence_parallel).lower()}",
            f"train.micro_batch_size={layout.micro_batch}",
            f"model.activation_checkpointing={layout.recompute.value}",
            f"train.global_batch_size={layout.global_batch}"]
    return f"--deepspeed-config {ds_config} " + " ".join(f"--set {s}" for s in sets)


def format_search(plans: list[Plan], cluster: Cluster, *, top: int,
                  ds_configs: dict[tuple[int, str, str], str], margin: float,
                  current: tuple[Plan | None, str] | None = None) -> str:
    """The fastest `top` of the layouts that keep `margin`, one line each and the arguments that
    select it under it; then where `current` (the config's own plan, or None and why) ranks,
    how far it is from the fastest and which parts of the step cost the difference."""
    under = " under train.engine=fsdp2" if plans and plans[0].engine is Engine.FSDP2 else ""
    lines = [f"[plan] {len(plans)} layouts of {cluster.world_size} GPUs ({cluster.nodes} x "
             f"{cluster.gpus_per_node} {cluster.name}) fit{under} with the memory margin; "
             f"the fastest {min(top, len(plans))}:",
             f"  {'#':>3}  {'layout':<58}{'memory':>9}{'tokens/s':>12}{'MFU':>7}"]
    for i, p in enumerate(plans[:top], 1):
        lines += [f"  {i:>3}  {p.layout.describe():<58}{p.memory.total / GB:8.1f}G"
                  f"{p.tokens_per_s:12,.0f}{100 * p.mfu:6.1f}%",
                  f"       {_arguments(p, ds_configs)}"]
    if plans:
        lines.append(margin_line(margin, plans[0].memory_limit_gb))
    if current is not None:
        lines.append(f"this config: {_current_rank(plans, *current, margin=margin)}")
    return "\n".join(lines)


def margin_line(margin: float, limit_gb: float) -> str:
    return (f"memory margin {margin:.0%} (--memory-margin {margin:g}): a layout is ranked when "
            f"its predicted memory x {1 + margin:.2f} fits the {limit_gb:.1f} GB usable (at most "
            f"{limit_gb / (1 + margin):.1f} GB predicted); {MEMORY_MARGIN_REASON}")


def _current_rank(plans: list[Plan], plan: Plan | None, why: str, *, margin: float) -> str:
    where = current_rank(plans, plan, why, margin=margin)
    if not where["ok"]:
        return why
    described = f"{where['layout']}, {where['tokens_per_s']:,.0f} tokens/s"
    if not where["fits"]:
        return f"{described}: does not fit ({plan.memory.total / GB:.1f} GB per GPU)"
    kept = "" if where["keeps_margin"] else \
        f" (unranked: {plan.memory.total / GB:.1f} GB does not keep the margin)"
    if not plans:
        return f"{described}{kept}"
    return (f"{described}: #{where['rank']} of {len(plans)}{kept}; "
            f"{slowdown_text(plan, plans[0])}")


def current_rank(plans: list[Plan], plan: Plan | None, why: str, *, margin: float) -> dict:
    """`format_search`'s last line as JSON."""
    if plan is None:
        return {"ok": False, "reason": why}
    where = {"ok": True, "layout": plan.layout.describe(), "tokens_per_s": plan.tokens_per_s,
             "fits": plan.fits, "keeps_margin": keeps_margin(plan, margin),
             "rank": 1 + sum(p.tokens_per_s > plan.tokens_per_s for p in plans) if plan.fits
             else None}
    if plans:
        where.update(times_slower=times_slower(plan, plans[0]),
                     step_difference_s=step_difference(plan, plans[0]))
    return where


# The parts of a step, compute split into the model's FLOPs and recomputation's.
STEP_TERMS = {"compute": "compute", "recompute": "recomputation",
              "tensor_comm": "tensor-parallel communication",
              "context_comm": "context-parallel all-to-alls or all-gathers", "bubble": "pipeline bubble",
              "pipeline_comm": "pipeline point-to-point", "data_comm": "data-parallel communication",
              "offload": "offload", "memory_bound": "memory-bound copies",
              "optimizer": "Muon's step", "pipeline_overhead": "pipeline schedule overhead"}
SLOWER_THAN_BEST = 0.10  # the pre-flight warns past this: the best predicted 1.10x faster


def step_terms(plan: Plan) -> dict[str, float]:
    """Seconds per step of each of `STEP_TERMS`."""
    t = plan.time
    model_share = plan.mfu / plan.hfu if plan.hfu else 1.0
    return {"compute": t.compute * model_share, "recompute": t.compute * (1 - model_share),
            "tensor_comm": t.tensor_comm, "context_comm": t.context_comm, "bubble": t.bubble,
            "pipeline_comm": t.pipeline_comm, "data_comm": t.data_comm, "offload": t.offload,
            "memory_bound": t.memory_bound, "optimizer": t.optimizer,
            "pipeline_overhead": t.pipeline_overhead}


def times_slower(plan: Plan, best: Plan) -> float:
    """How many times longer `plan` takes than `best` for the same tokens."""
    return best.tokens_per_s / plan.tokens_per_s


def step_difference(plan: Plan, best: Plan) -> dict[str, float]:
    """Seconds each term of `plan`'s step takes more than `best`'s (negative: less), `plan`'s
    scaled to `best`'s global batch, largest first."""
    scale = best.layout.global_batch / plan.layout.global_batch
    ours, theirs = step_terms(plan), step_terms(best)
    diff = {k: ours[k] * scale - theirs[k] for k in STEP_TERMS}
    return dict(sorted(diff.items(), key=lambda kv: -kv[1]))


def slowdown_text(plan: Plan, best: Plan, *, best_is: str = "#1") -> str:
    """'1.52x slower than #1 (tp4 ...): of the 15.0 s more per step, recomputation +8.2 s,
    ...': the terms that moved by at least 1% of `best`'s step."""
    ratio = times_slower(plan, best)
    if ratio <= 1.0:
        return f"as fast as {best_is}"
    diff = step_difference(plan, best)
    shown = [f"{STEP_TERMS[k]} {v:+.2f} s" for k, v in diff.items()
             if abs(v) >= 0.01 * best.time.step]
    return (f"{ratio:.2f}x slower than {best_is} ({best.layout.describe()}): of the "
            f"{sum(diff.values()):.2f} s more per step, " + ", ".join(shown))


def slower_layout_warnings(model: ModelConfig, plan: Plan, *, margin: float) -> list[str]:
    """`warnings_against_best` of `plan` and a search of its cluster with `margin` (the same
    global batch, precision and train.engine, the ZeRO stages and offloads a shipped DeepSpeed
    JSON selects)."""
    engines = shipped_ds_configs()
    plans = search(model, plan.cluster, global_batch=plan.layout.global_batch,
                   precision=plan.layout.precision, engines=set(engines), memory_margin=margin,
                   engine=plan.engine, fp8=plan.layout.fp8, optimizer=plan.layout.optimizer)
    return warnings_against_best(plan, plans, margin=margin, ds_configs=engines)


def warnings_against_best(plan: Plan, plans: list[Plan], *, margin: float,
                          ds_configs: dict[tuple[int, str, str], str]) -> list[str]:
    """A warning when `plan` is predicted more than `SLOWER_THAN_BEST` slower than the fastest
    of `plans` (a search with `margin`), naming the arguments of that one; else []."""
    if not plans or times_slower(plan, plans[0]) <= 1 + SLOWER_THAN_BEST:
        return []
    best = plans[0]
    fastest = f"the fastest layout with a {margin:.0%} memory margin"
    return [f"this layout ({plan.layout.describe()}, {plan.tokens_per_s:,.0f} tokens/s) is "
            f"predicted {slowdown_text(plan, best, best_is=fastest)}; that one "
            f"({best.tokens_per_s:,.0f} tokens/s, MFU {100 * best.mfu:.1f}%, "
            f"{best.memory.total / GB:.1f} GB per GPU): "
            f"{_arguments(best, ds_configs)}"]


def _arguments(plan: Plan, ds_configs: dict[tuple[int, str, str], str]) -> str:
    return selecting_arguments(plan.layout, ds_configs[engine_key(plan.layout)],
                               engine=plan.engine)
