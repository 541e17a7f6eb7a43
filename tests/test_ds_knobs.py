"""DeepSpeed settings of the shipped JSONs, observed in what DeepSpeed builds and does with them.

Each rank function builds the tiny model's engine on one gloo rank as a run does (the run config
through `pretrain.resolve.run.resolve_ds_config`, then `pretrain.training.engine.build_engine`), from a shipped
JSON as it is and with settings moved off DeepSpeed's defaults, and reports what the engine did:
gradient buckets reduced, parameters gathered or kept whole, optimizer kernels run, lines logged.
Many shipped values are DeepSpeed's defaults; the moved values show that each key reaches
DeepSpeed instead of being dropped on the way. One process, fp32, a step or a few per engine.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import re
from pathlib import Path

import pytest
import torch

from pretrain.testing.ranks import run_on_ranks

pytestmark = pytest.mark.slow  # DeepSpeed engines (a few seconds each)

REPO = Path(__file__).resolve().parents[1]
HIDDEN = 64  # the tiny model's hidden size: the resolver sizes ZeRO-3's buckets from it
# zero2.json with every bucket knob moved: a reduce bucket smaller than the model, no
# contiguous gradient buffer, no overlap (DeepSpeed defaults: 5e8, true, false at ZeRO-2)
ZERO2_MOVED = {"reduce_bucket_size": 8192, "allgather_bucket_size": 12346,
               "contiguous_gradients": False, "overlap_comm": False}
LOG_STEPS = 10  # DeepSpeed's default steps_per_print: the shipped 1e9 must stay silent here


def _build(ds_name: str, *, zero: dict | None = None, top: dict | None = None,
           accelerator: str = "cpu", drop: tuple[str, ...] = ()):
    """(run config, engine) of the tiny model at world size 1 from ds_configs/<ds_name>.json,
    its zero_optimization / top-level keys updated with `zero` / `top` before resolving, and
    the zero_optimization keys `drop` removed after (as if the resolver had dropped them)."""
    from pretrain.config import load_config
    from pretrain.dist import init_deepspeed_comm
    from pretrain.training.engine import build_engine
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.resolve.topology import Topology

    path = REPO / "ds_configs" / f"{ds_name}.json"
    source = json.loads(path.read_text())
    source["zero_optimization"].update(zero or {})
    source.update(top or {})
    cfg = load_config(REPO / "configs/tiny.yaml", [
        f"deepspeed={path}", "train.micro_batch_size=2", "train.global_batch_size=2",
        f"run_dir={REPO}/runs/unused"])
    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    ds_config = resolve_ds_config(cfg, world_size=1, accelerator=accelerator, source=source)
    for key in drop:
        del ds_config["zero_optimization"][key]
    groups = Topology(tensor=1, pipeline=1, world_size=1).create_groups()
    return cfg, build_engine(cfg, ds_config, groups, main=False)


def _step(engine, cfg, seed: int) -> None:
    ids = torch.randint(0, cfg.model.vocab_size, (2, 33),
                        generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(ids[:, :-1], labels=ids[:, 1:]))
    engine.step()


@contextlib.contextmanager
def _counting(owner, name: str, record):
    """Call `record(*args)` before each call of `owner.name` while inside."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        record(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield
    finally:
        setattr(owner, name, original)


# ---- ZeRO-2: the gradient reduction buckets ----------------------------------------------------
def _zero2_reductions(rank: int, world_size: int) -> dict:
    """Per engine (shipped zero2.json, and ZERO2_MOVED): each gradient bucket reduced in one
    step (its elements, parameters and the contiguous buffers it was copied into), and the
    all-gather bucket the ZeRO optimizer was built with."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    reductions = []

    def record(optimizer, comm_dtype=None):
        for dtype, bucket in optimizer.ipg_buckets.items():
            if comm_dtype in (None, dtype) and bucket.elements:
                reductions.append({"elements": bucket.elements, "params": len(bucket.params),
                                   "buffers": [b.numel() for b in bucket.buffer]})

    report = {}
    with _counting(DeepSpeedZeroOptimizer, "reduce_ipg_grads", record):
        for name, zero in (("shipped", {}), ("moved", ZERO2_MOVED)):
            reductions.clear()
            cfg, engine = _build("zero2", zero=zero)
            _step(engine, cfg, seed=0)
            report[name] = {"reductions": list(reductions),
                            "allgather_bucket": engine.optimizer.allgather_bucket_size,
                            "numel": sum(p.numel() for p in engine.module.parameters())}
    return report


@pytest.fixture(scope="module")
def zero2(tmp_path_factory) -> dict:
    [report] = run_on_ranks(_zero2_reductions, world_size=1,
                            tmp_path=tmp_path_factory.mktemp("zero2"), timeout_s=300)
    return report


def _shipped_zero2() -> dict:
    return json.loads((REPO / "ds_configs/zero2.json").read_text())["zero_optimization"]


def test_zero2_reduces_in_buckets_of_the_configured_size(zero2):
    """The shipped 5e7-element bucket holds the whole tiny model: one reduction per step. An
    8192-element bucket reduces many times, each bucket within the size (a parameter larger
    than the bucket goes alone)."""
    shipped, moved = zero2["shipped"], zero2["moved"]
    assert [r["elements"] for r in shipped["reductions"]] == [shipped["numel"]]
    size = ZERO2_MOVED["reduce_bucket_size"]
    assert len(moved["reductions"]) > 1, moved["reductions"]
    assert sum(r["elements"] for r in moved["reductions"]) == moved["numel"]
    assert all(r["elements"] <= size or r["params"] == 1 for r in moved["reductions"]), moved


def test_zero2_contiguous_gradients_and_overlap_comm_build_the_bucket_buffers(zero2):
    """contiguous_gradients copies each gradient into a buffer of the bucket's size, and
    overlap_comm doubles it (one fills while the other is reduced); both off, none is built."""
    zero = _shipped_zero2()
    assert zero["contiguous_gradients"] and zero["overlap_comm"]
    (bucket,) = zero2["shipped"]["reductions"]
    assert bucket["buffers"] == [zero["reduce_bucket_size"]] * 2, bucket
    assert all(r["buffers"] == [] for r in zero2["moved"]["reductions"]), zero2["moved"]


def test_zero2_optimizer_is_built_with_the_configured_allgather_bucket(zero2):
    """Read back from the ZeRO optimizer: DeepSpeed 0.19.8 gathers the updated partitions with
    one all_gather_into_tensor per parameter group where torch has it (always, here), so the
    bucket only shapes its fallback; what the JSON sets is what the optimizer holds."""
    assert zero2["shipped"]["allgather_bucket"] == _shipped_zero2()["allgather_bucket_size"]
    assert zero2["moved"]["allgather_bucket"] == ZERO2_MOVED["allgather_bucket_size"]


# ---- ZeRO-3: buckets the resolver sizes from the model, persistence, the 16-bit save ----------
def _zero3_gathers(rank: int, world_size: int, save_dir: str) -> dict:
    """Per engine (shipped zero3.json, whose buckets the resolver fills from the hidden size;
    and the same with the prefetch bucket left to DeepSpeed's default and the 16-bit save
    on): the parameters
    gathered per gather call in step 2 (step 1 records the trace prefetching follows), the
    gradient buckets reduced in it, which parameters stay gathered after it, and whether
    DeepSpeed's `save_16bit_model` wrote the gathered weights."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import \
        PartitionedParameterCoordinator
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    gathers, reductions = [], []

    def record_gather(coordinator, params, *args, **kwargs):
        gathers.append(sum(p.ds_numel for p in params
                           if p.ds_status == ZeroParamStatus.NOT_AVAILABLE))

    def record_reduction(optimizer, dtype):
        bucket = optimizer.ipg_buckets[dtype]
        if bucket.params:
            reductions.append({"elements": sum(p.ds_numel for p in bucket.params),
                               "params": len(bucket.params),
                               "buffer": 0 if bucket.buffer is None else bucket.buffer.numel()})

    report = {}
    with _counting(PartitionedParameterCoordinator,
                   "_PartitionedParameterCoordinator__all_gather_params", record_gather), \
            _counting(DeepSpeedZeroOptimizer_Stage3,
                      "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads",
                      record_reduction):
        for name, zero, drop in (
                ("shipped", {}, ()),
                ("moved", {"stage3_gather_16bit_weights_on_model_save": True},
                 ("stage3_prefetch_bucket_size",))):
            cfg, engine = _build("zero3", zero=zero, drop=drop)
            _step(engine, cfg, seed=0)
            gathers.clear()
            reductions.clear()
            _step(engine, cfg, seed=1)
            saved = engine.save_16bit_model(save_dir, f"{name}.bin")
            report[name] = {
                "gathers": [n for n in gathers if n], "reductions": list(reductions),
                "gathered_after_step": [(p.ds_numel, p.ds_status == ZeroParamStatus.AVAILABLE)
                                        for p in engine.module.parameters()],
                "numel": sum(p.ds_numel for p in engine.module.parameters()),
                "largest": max(p.ds_numel for p in engine.module.parameters()),
                "saved": saved, "file": (Path(save_dir) / f"{name}.bin").exists()}
    return report


@pytest.fixture(scope="module")
def zero3(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("zero3")
    [report] = run_on_ranks(_zero3_gathers, world_size=1, tmp_path=tmp, args=(str(tmp),),
                            timeout_s=300)
    return report


def test_zero3_prefetches_in_buckets_the_resolver_sizes_from_the_model(zero3):
    """The resolver's prefetch bucket (0.9 x hidden^2, below one weight matrix) gathers the
    next matrix at a time: a gather call per parameter or module. DeepSpeed's default bucket
    (what a dropped key gives) prefetches everything left in one call."""
    small, large = zero3["shipped"]["gathers"], zero3["moved"]["gathers"]
    bucket = int(0.9 * HIDDEN * HIDDEN)
    assert all(n <= bucket + zero3["shipped"]["largest"] for n in small), small
    # and each call fills the bucket: the key and value projections (2048 elements each, GQA)
    # come in one call, not two (a bucket sized below them would gather each alone)
    assert min(small) >= bucket, small
    assert len(small) > 2 * len(large), (small, large)
    assert max(large) > bucket + zero3["moved"]["largest"], large


def test_zero3_reduces_in_buckets_the_resolver_sizes_from_the_model(zero3):
    """reduce_bucket_size "auto" is hidden^2 elements: the contiguous buffer has that size and
    gradients are reduced in many buckets (DeepSpeed's 5e8 default reduces them all at once)."""
    size = HIDDEN * HIDDEN
    shipped = zero3["shipped"]["reductions"]
    assert {r["buffer"] for r in shipped} == {size}, shipped
    assert all(r["elements"] <= size or r["params"] == 1 for r in shipped), shipped
    assert len(shipped) > 1, shipped


def test_zero3_keeps_parameters_under_the_persistence_threshold_gathered(zero3):
    """stage3_param_persistence_threshold "auto" is 10 x hidden elements: after a step the
    norms' gains (hidden elements) stay whole, every matrix is released to its partition
    (DeepSpeed's default of 1e5 would keep the whole tiny model gathered)."""
    kept = zero3["shipped"]["gathered_after_step"]
    assert all(gathered == (numel <= 10 * HIDDEN) for numel, gathered in kept), kept
    assert {gathered for _, gathered in kept} == {True, False}, kept


def test_zero3_16bit_save_follows_gather_16bit_weights_on_model_save(zero3):
    """Off in the shipped JSON (the run exports its weights itself): DeepSpeed's
    save_16bit_model gathers and writes nothing; on, it writes the gathered weights."""
    assert (zero3["shipped"]["saved"], zero3["shipped"]["file"]) == (False, False)
    assert (zero3["moved"]["saved"], zero3["moved"]["file"]) == (True, True)


# ---- DeepSpeed's own log lines and timers; torch's fused AdamW ---------------------------------
class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _logged_steps(rank: int, world_size: int) -> dict:
    """Per engine (shipped zero1.json resolved for CPU; and with steps_per_print 2 and
    wall_clock_breakdown on, resolved for CUDA): per step, DeepSpeed's progress lines (its
    logger) and timer lines (printed), and the calls of torch's fused AdamW kernel."""
    from deepspeed.utils import logger as deepspeed_logger

    lines = _Lines()
    deepspeed_logger.addHandler(lines)
    level = deepspeed_logger.level
    deepspeed_logger.setLevel(logging.INFO)
    fused = []
    report = {}
    try:
        with _counting(torch, "_fused_adamw_", lambda *a, **k: fused.append(1)):
            for name, top, accelerator in (
                    ("shipped", {}, "cpu"),
                    ("moved", {"steps_per_print": 2, "wall_clock_breakdown": True}, "cuda")):
                cfg, engine = _build("zero1", top=top, accelerator=accelerator)
                fused.clear()
                steps = []
                for step in range(1, LOG_STEPS + 1):
                    lines.lines.clear()
                    printed = io.StringIO()
                    with contextlib.redirect_stdout(printed):
                        _step(engine, cfg, seed=step)
                    steps.append({"progress": [int(m.group(1)) for m in map(
                                      re.compile(r"\bstep=(\d+), skipped=").search, lines.lines)
                                               if m],
                                  "timers": printed.getvalue().count("time (ms)")})
                report[name] = {"steps": steps, "fused_calls": len(fused)}
    finally:
        deepspeed_logger.removeHandler(lines)
        deepspeed_logger.setLevel(level)
    return report


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> dict:
    [report] = run_on_ranks(_logged_steps, world_size=1,
                            tmp_path=tmp_path_factory.mktemp("logged"), timeout_s=300)
    return report


def test_steps_per_print_sets_deepspeeds_progress_line_cadence(logged):
    """The shipped 1e9 silences DeepSpeed's own step line (its default, 10, would print at
    step 10); steps_per_print 2 prints it at every second step, numbered."""
    assert all(not s["progress"] for s in logged["shipped"]["steps"]), logged["shipped"]
    for step, seen in enumerate(logged["moved"]["steps"], start=1):
        assert seen["progress"] == ([step] if step % 2 == 0 else []), (step, seen)


def test_wall_clock_breakdown_prints_deepspeeds_timers(logged):
    """Off (shipped): no timer line; on: DeepSpeed prints its forward/backward/step timers at
    every step."""
    assert all(s["timers"] == 0 for s in logged["shipped"]["steps"]), logged["shipped"]
    assert all(s["timers"] >= 1 for s in logged["moved"]["steps"]), logged["moved"]


def test_the_optimizer_runs_torchs_fused_adamw_kernel_exactly_on_cuda(logged):
    """The resolver asks for torch's fused AdamW when the accelerator is CUDA: DeepSpeed passes
    it on and every step runs the fused kernel (torch has it on CPU too, so the CUDA config
    runs here); resolved for a CPU run, the kernel never runs."""
    assert logged["moved"]["fused_calls"] >= LOG_STEPS, logged["moved"]["fused_calls"]
    assert logged["shipped"]["fused_calls"] == 0


# ---- NVMe offload: the swappers' buffers and async-io handles ----------------------------------
# Every aio key, moved off DeepSpeed's default, and the handle property that reports it.
AIO_MOVED = {"block_size": 2 * 1024 * 1024, "queue_depth": 4, "intra_op_parallelism": 2,
             "single_submit": True, "overlap_events": False}
AIO_GETTERS = {"block_size": "get_block_size", "queue_depth": "get_queue_depth",
               "intra_op_parallelism": "get_intra_op_parallelism",
               "single_submit": "get_single_submit", "overlap_events": "get_overlap_events"}
# DeepSpeed's defaults: 5 buffers of 1e8 elements, 1e9 parameters in CPU memory, 4 optimizer
# buffers. max_in_cpu 0: no parameter group gets a flat CPU buffer (the tiny model fits in 1e9).
PARAM_MOVED = {"buffer_count": 8, "buffer_size": 50_000, "max_in_cpu": 0}
OPTIMIZER_MOVED = {"buffer_count": 6}


def _nvme_engine(rank: int, world_size: int, swap_dir: str) -> dict:
    """zero3_offload_nvme.json with every aio and swap-buffer key moved (AIO_MOVED,
    PARAM_MOVED, OPTIMIZER_MOVED): what the parameter and optimizer swappers and the ZeRO-3
    optimizer's flat CPU parameter buffers were built with."""
    shipped = json.loads((REPO / "ds_configs/zero3_offload_nvme.json").read_text())
    zero = shipped["zero_optimization"]
    sections = {"offload_param": {**zero["offload_param"], **PARAM_MOVED, "nvme_path": swap_dir},
                "offload_optimizer": {**zero["offload_optimizer"], **OPTIMIZER_MOVED,
                                      "nvme_path": swap_dir}}
    aio = {key: AIO_MOVED[key] for key in shipped["aio"] if key in AIO_MOVED}
    _, engine = _build("zero3_offload_nvme", zero=sections, top={"aio": aio})
    params = list(engine.module.parameters())
    param_swapper = params[0].nvme_swapper
    optimizer_swapper = engine.optimizer.optimizer_swapper

    def handle(h):
        return {key: getattr(h, getter)() for key, getter in AIO_GETTERS.items()}

    return {
        "handles": [handle(h) for h in (param_swapper.aio_read_handle,
                                        param_swapper.aio_write_handle,
                                        optimizer_swapper.aio_handle)],
        "param_buffers": (param_swapper.param_buffer_count, param_swapper.buffers.numel()),
        "param_buffer_size": param_swapper._io_aligned_numel(PARAM_MOVED["buffer_size"]),
        "optimizer_buffers": len(optimizer_swapper.swap_buffer_manager.all_buffers),
        "flat_cpu_buffers": [buffer.numel() for buffer
                             in engine.optimizer.param_groups_fp16_flat_cpu_memory],
        "group_sizes": [sum(p.partition_numel() for p in group["params"])
                        for group in engine.optimizer.trainable_param_groups]}


def test_nvme_swappers_are_built_with_the_aio_and_buffer_settings(libaio, tmp_path):
    """Every aio key of the shipped JSON, moved off its default, is what the three async-io
    handles DeepSpeed opens report; the parameter swapper holds buffer_count buffers of
    buffer_size elements, the optimizer swapper buffer_count buffers; max_in_cpu 0 gives no
    parameter group a flat CPU buffer (1e9 gives each its size: the placeholder is 1 element).
    Built, not stepped: the tiny model's tensors are all below the 1 MiB DeepSpeed swaps at
    least, so its parameters would not be swapped either way."""
    shipped = json.loads((REPO / "ds_configs/zero3_offload_nvme.json").read_text())
    assert set(shipped["aio"]) == set(AIO_GETTERS), (
        f"aio keys without a handle property DeepSpeed sets from them: "
        f"{sorted(set(shipped['aio']) - set(AIO_GETTERS))}")
    [built] = run_on_ranks(_nvme_engine, world_size=1, tmp_path=tmp_path,
                           args=(str(tmp_path / "swap"),), timeout_s=600)
    assert built["handles"] == [AIO_MOVED] * 3, built["handles"]
    count = PARAM_MOVED["buffer_count"]
    assert built["param_buffers"] == (count, count * built["param_buffer_size"]), built
    assert built["optimizer_buffers"] == OPTIMIZER_MOVED["buffer_count"]
    assert built["flat_cpu_buffers"] == [1] * len(built["group_sizes"]), built
    assert min(built["group_sizes"]) > 1, built


# ---- offload: page-locked host buffers -----------------------------------------------------------
def _pinned_buffers(rank: int, world_size: int) -> dict:
    """Per engine (shipped zero3_offload_cpu.json: both pin_memory on; and both off): where
    DeepSpeed asked its accelerator to pin a buffer while building the engine, as (ZeRO module,
    function). A CPU accelerator pins nothing, but DeepSpeed asks for what the
    settings tell it to pin: the requests are what a GPU node page-locks."""
    import inspect

    from deepspeed.accelerator import get_accelerator

    asked: list[str] = []

    def record(*args, **kwargs):
        caller = inspect.stack()[2]
        asked.append((caller.filename.rsplit("/", 1)[-1].removesuffix(".py"), caller.function))

    report = {}
    with _counting(type(get_accelerator()), "pin_memory", record):
        for name, pin in (("shipped", None), ("off", False)):
            moved = {} if pin is None else {
                "offload_optimizer": {"device": "cpu", "pin_memory": pin},
                "offload_param": {"device": "cpu", "pin_memory": pin}}
            asked.clear()
            _build("zero3_offload_cpu", zero=moved)  # both pin as the engine is built
            report[name] = sorted(set(asked))
    return report


def test_offload_pins_the_host_buffers_its_pin_memory_settings_name(tmp_path):
    shipped = json.loads((REPO / "ds_configs/zero3_offload_cpu.json").read_text())
    zero = shipped["zero_optimization"]
    assert zero["offload_optimizer"]["pin_memory"] and zero["offload_param"]["pin_memory"]
    [report] = run_on_ranks(_pinned_buffers, world_size=1, tmp_path=tmp_path, timeout_s=300)
    shipped, off = ({tuple(site) for site in report[name]} for name in ("shipped", "off"))
    assert off < shipped, report  # off (DeepSpeed's default) asks at fewer places, none new
    # each setting reaches DeepSpeed: offload_param pins the parameters' partitions
    # (partition_parameters), offload_optimizer the optimizer's gradient buffers (stage3)
    assert {module for module, _ in shipped - off} == {"partition_parameters", "stage3"}, report
