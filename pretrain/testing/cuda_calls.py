"""Every CUDA-only call the stack makes, in one table, checked against the installed functions.

The stack is tested on CPU ranks, where its CUDA-only calls never run: a torch or pynvml
release that renamed a keyword would fail only on the first GPU. `CUDA_CALLS` lists each such
call (what it is, the installed function it reaches, the arguments and keywords the stack
passes, where in `pretrain/` it is made), and `check(call)` resolves the function, binds the
stack's arguments against its signature (`inspect.Signature.bind`: every keyword accepted)
and, where it can, runs it on meta tensors (or on the CPU for the fused AdamW kernel, which
torch also has there).

`call_sites()` walks `pretrain/`'s syntax trees for the names these calls go by (the
variable-length attention, grouped matmul, fused optimizers, NVML, the accelerator's memory
readings, anything under `torch.cuda` but `is_available`), so a test fails when a new
CUDA-only call is not in the table (`tests/test_cuda_calls.py`). `bench/gpu_check.py` runs the
same calls for real on one GPU.
"""
from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

PACKAGE = Path(__file__).resolve().parents[1]  # pretrain/

# names that reach CUDA-only code wherever they appear in pretrain/ (calls, imports, attributes)
CUDA_ONLY_NAMES = frozenset({
    "varlen_attn", "_grouped_mm", "grouped_mm", "pynvml",
    "max_memory_allocated", "memory_allocated", "max_memory_reserved", "memory_reserved",
    "reset_peak_memory_stats", "mem_get_info", "utilization",
})


@dataclass(frozen=True)
class CudaCall:
    """One CUDA-only call: `target` ("module:attribute.path") is the installed function,
    `arguments()` the (args, kwargs) the stack passes it (placeholders where only the binding
    matters), `sites` the (file under pretrain/, name) pairs `call_sites` finds for it, `run`
    (optional) runs it without a GPU and says on what."""

    name: str
    target: str
    arguments: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]
    sites: tuple[tuple[str, str], ...]
    run: Callable[[Callable[..., Any]], str] | None = None
    optional: bool = False  # a package the stack guards (telemetry): missing is not a failure
    note: str = ""


@dataclass
class Row:
    """What `check` found for one call."""

    name: str
    target: str
    found: bool = False
    bound: bool = False
    ran: str = "no"  # what it ran on, or why not
    problem: str = ""
    optional: bool = False
    sites: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.bound and not self.problem) or (self.optional and not self.found)


def resolve(target: str) -> Callable[..., Any]:
    """The installed object a "module:attribute.path" names (ImportError/AttributeError)."""
    module, _, path = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def signature_of(function: Callable[..., Any]) -> inspect.Signature:
    """The signature calls bind against (a class's constructor without self)."""
    return inspect.signature(function)


# ---- the calls --------------------------------------------------------------------------------

def _varlen_arguments() -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call `documents.varlen_attention` makes with the installed binding."""
    from pretrain.model.documents import VARLEN

    return tuple(range(7)), VARLEN.keywords(scale=0.125, gqa=True)


def _run_varlen(function) -> str:
    """The document attention's call on meta tensors (bf16, GQA 4:2, two documents)."""
    import torch

    from pretrain.model.documents import VARLEN, varlen_attention

    if VARLEN.problem is not None:
        return f"not run: {VARLEN.problem}"
    q = torch.empty(1, 4, 16, 8, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 2, 16, 8, device="meta", dtype=torch.bfloat16)
    cumulative = torch.empty(3, device="meta", dtype=torch.int32)
    y = varlen_attention(q, k, k, (cumulative, 11), scale=0.125)
    if y.shape != q.shape:
        raise AssertionError(f"varlen_attn gave {tuple(y.shape)}, expected {tuple(q.shape)}")
    return "meta"


def adamw_arguments() -> tuple[tuple[Any, ...], dict[str, Any]]:
    """DeepSpeed's torch AdamW with the keywords `resolve.ds_config.fill_ds_config` sets on a
    GPU (optimizer.params: lr, betas, eps, weight_decay, fused)."""
    return ([],), {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                   "fused": True}


def _run_fused_adamw(adamw) -> str:
    """One fused step on state built as a reshard builds it (`checkpoint.reshard`: zero
    moments, an fp32 step tensor on the parameter's device), on the CPU (torch's fused AdamW
    has a CPU kernel), against the for-each step."""
    import torch

    from pretrain.checkpoint.reshard import adam_step_tensor

    results = []
    for fused in (True, False):
        p = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))
        _, kwargs = adamw_arguments()
        opt = adamw([p], **{**kwargs, "fused": fused})
        state = opt.state[p]
        state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        state["step"] = adam_step_tensor(5, param=p, group=opt.param_groups[0])
        p.grad = torch.full_like(p, 0.5)
        opt.step()
        results.append(p.detach().clone())
    if not torch.allclose(results[0], results[1], rtol=1e-6, atol=1e-7):
        raise AssertionError("the fused AdamW step differs from the for-each one")
    return "cpu"


def _run_grouped_mm(grouped_mm) -> str:
    import torch

    a = torch.empty(32, 16, device="meta", dtype=torch.bfloat16)
    b = torch.empty(2, 16, 8, device="meta", dtype=torch.bfloat16)
    offsets = torch.empty(2, device="meta", dtype=torch.int32)
    y = grouped_mm(a, b, offs=offsets)
    if tuple(y.shape) != (32, 8):
        raise AssertionError(f"_grouped_mm gave {tuple(y.shape)}, expected (32, 8)")
    return "meta"


def _no_args() -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (), {}


def _one_arg() -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (0,), {}


METRICS = "training/metrics.py"
SNAPSHOTS = "training/memory_snapshot.py"
CUDA_CALLS: tuple[CudaCall, ...] = (
    CudaCall("varlen attention", "torch.nn.attention.varlen:varlen_attn", _varlen_arguments,
             sites=(("model/documents.py", "varlen_attn"),), run=_run_varlen,
             note="document masking on CUDA in 16 bits (`model.documents`)"),
    CudaCall("fused AdamW", "torch.optim:AdamW", adamw_arguments,
             sites=(("resolve/ds_config.py", "fused"), ("checkpoint/reshard.py", "fused")),
             run=_run_fused_adamw,
             note="DeepSpeed's torch_adam on GPUs: AdamW(fused=True)"),
    CudaCall("grouped matmul", "torch:_grouped_mm", lambda: ((0, 0), {"offs": 0}),
             sites=(("model/moe.py", "torch._grouped_mm"),), run=_run_grouped_mm,
             note="a mixture of experts' experts as one matmul on GPUs of capability 9.0+ in "
                  "bf16 (`model.moe.grouped_outputs`)"),
    CudaCall("device capability", "torch.cuda:get_device_capability", _one_arg,
             sites=(("model/moe.py", "torch.cuda.get_device_capability"),),
             note="whether the grouped matmul runs (`model.moe.grouped_mm_runs`)"),
    CudaCall("peak memory (accelerator)", "torch.cuda:max_memory_allocated", _no_args,
             sites=((METRICS, "max_memory_allocated"),),
             note="DeepSpeed's accelerator forwards to torch.cuda"),
    CudaCall("current device", "torch.cuda:current_device", _no_args,
             sites=((METRICS, "torch.cuda.current_device"),)),
    CudaCall("NVML import", "pynvml:nvmlInit", _no_args,
             sites=((METRICS, "pynvml"), (METRICS, "pynvml.nvmlInit")), optional=True),
    CudaCall("NVML handle", "pynvml:nvmlDeviceGetHandleByIndex", _one_arg,
             sites=((METRICS, "pynvml.nvmlDeviceGetHandleByIndex"),), optional=True),
    CudaCall("NVML utilisation", "pynvml:nvmlDeviceGetUtilizationRates", _one_arg,
             sites=((METRICS, "nvml.nvmlDeviceGetUtilizationRates"),), optional=True),
    CudaCall("NVML temperature", "pynvml:nvmlDeviceGetTemperature", lambda: ((0, 0), {}),
             sites=((METRICS, "nvml.nvmlDeviceGetTemperature"),
                    (METRICS, "nvml.NVML_TEMPERATURE_GPU")), optional=True),
    CudaCall("NVML memory", "pynvml:nvmlDeviceGetMemoryInfo", _one_arg,
             sites=((METRICS, "nvml.nvmlDeviceGetMemoryInfo"),), optional=True),
    CudaCall("stream event", "torch.cuda:Event", _no_args,
             sites=(("checkpoint/writer.py", "torch.cuda.Event"),),
             note="the background checkpoint writer waits on the training stream's copies"),
    CudaCall("synchronize", "torch.cuda:synchronize", _no_args,
             sites=(("hardware.py", "torch.cuda.synchronize"),)),
    CudaCall("device name", "torch.cuda:get_device_name", _no_args,
             sites=(("hardware.py", "torch.cuda.get_device_name"),)),
    CudaCall("compute capability", "torch.cuda:get_device_capability", _no_args,
             sites=(("hardware.py", "torch.cuda.get_device_capability"),),
             note="train.fp8 is refused below 8.9"),
    CudaCall("memory history", "torch.cuda.memory:_record_memory_history",
             lambda: ((), {"max_entries": 100_000}),
             sites=((SNAPSHOTS, "torch.cuda.memory._record_memory_history"),
                    (SNAPSHOTS, "torch.cuda.memory")),
             note="logging.memory_snapshot"),
    CudaCall("memory snapshot", "torch.cuda.memory:_dump_snapshot", lambda: (("x.pickle",), {}),
             sites=((SNAPSHOTS, "torch.cuda.memory._dump_snapshot"),),
             note="logging.memory_snapshot: at the chosen step and on out-of-memory"),
    CudaCall("native bf16", "torch.cuda:is_bf16_supported",
             lambda: ((), {"including_emulation": False}),
             sites=(("hardware.py", "torch.cuda.is_bf16_supported"),)),
)


def check(call: CudaCall) -> Row:
    """Resolve `call`'s function, bind the stack's arguments to its signature, run it where
    it can run without a GPU."""
    row = Row(call.name, call.target, optional=call.optional,
              sites=[f"pretrain/{path}: {name}" for path, name in call.sites])
    try:
        function = resolve(call.target)
    except (ImportError, AttributeError) as exc:
        row.problem = f"not installed: {exc}"
        return row
    row.found = True
    args, kwargs = call.arguments()
    try:
        signature_of(function).bind(*args, **kwargs)
    except TypeError as exc:
        row.problem = f"{call.target}{signature_of(function)} refuses {sorted(kwargs)}: {exc}"
        return row
    except ValueError:  # a builtin without a readable signature: binding cannot be checked
        row.ran = "signature not readable"
    row.bound = True
    if call.run is not None:
        try:
            row.ran = call.run(function)
        except Exception as exc:  # noqa: BLE001 - the row reports whatever the call raised
            row.problem = f"{type(exc).__name__}: {exc}"
    else:
        row.ran = "needs a GPU"
    return row


def check_all() -> list[Row]:
    return [check(call) for call in CUDA_CALLS]


# ---- where pretrain/ makes them ------------------------------------------------------------------

def _dotted(node: ast.AST) -> str:
    """a.b.c of an attribute chain ending in a name; "" otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _sites_in(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(alias.name.split(".")[-1] for alias in node.names
                         if alias.name.split(".")[-1] in CUDA_ONLY_NAMES)
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in CUDA_ONLY_NAMES)
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if node.attr in CUDA_ONLY_NAMES or node.attr.lower().startswith("nvml"):
                found.add(dotted if dotted.split(".")[0] in ("torch", "pynvml", "nvml")
                          else node.attr)
            elif dotted.startswith("torch.cuda.") and dotted != "torch.cuda.is_available":
                found.add(dotted)
        elif isinstance(node, ast.keyword) and node.arg == "fused":
            found.add("fused")
        elif isinstance(node, ast.Call) and node.args and _dotted(node.func).endswith(
                ("setdefault", "get", "pop")) and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value == "fused":
            found.add("fused")
        elif isinstance(node, ast.Dict) and any(
                isinstance(k, ast.Constant) and k.value == "fused" for k in node.keys):
            found.add("fused")
    return found


def call_sites(package: Path = PACKAGE) -> set[tuple[str, str]]:
    """(file under the package, name) of every CUDA-only name its code uses, minus the ones
    only this module lists (its own table)."""
    sites = set()
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative == "testing/cuda_calls.py":
            continue
        sites.update((relative, name) for name in _sites_in(ast.parse(path.read_text())))
    return sites


def listed_sites() -> set[tuple[str, str]]:
    return {site for call in CUDA_CALLS for site in call.sites}
