"""Keep imports and builds a rank never uses out of every process's start-up.

Three of DeepSpeed's start-up costs pay for features this stack never uses.

DeepSpeed's autotuner module (imported by `import deepspeed`, never run by this stack) imports
MLflow when it is installed, to log its own experiments. MLflow, with FastAPI and pandas behind
it, is 2.5 s of the 7 s `import deepspeed` takes on a 2-core AMD EPYC: paid by every rank of every
run, and by every run of the test suite. The finder below answers "not installed" to that one
import only; the autotuner then runs without MLflow (`has_mlflow = False`), and every other
`import mlflow` (this stack's MLflow sink, `logging.report_to: [mlflow]`) works as usual.

DeepSpeed's comm backend builds a shared-memory all-reduce op (a C++ extension, compiled on first
use: about 80 s on a fresh machine, under a file lock every rank waits on) whenever the
accelerator is the CPU, for `inference_all_reduce`, which only its inference kernels call.
`build_shm_op` is answered "no op" as that module loads; collectives stay torch.distributed's.

DeepSpeed's ZeRO imports its Muon optimizer for an isinstance check; `import_muon_uncompiled`
keeps the `torch.compile` decorators on it from importing inductor.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_IMPORTER = "deepspeed.autotuning.autotuner"
COMM_BACKEND = "deepspeed.comm.torch"


class _LeanDeepSpeedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == COMM_BACKEND:
            return _without_shm_op(name, path)
        if name != "mlflow":
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") == _IMPORTER:
                raise ModuleNotFoundError(f"MLflow is not imported for {_IMPORTER}", name=name)
            frame = frame.f_back
        return None


def _no_shm_op():
    return None


class _ThenNoShmOp(importlib.abc.Loader):
    """DeepSpeed's comm backend module as it is, with `build_shm_op` answering "no op"."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        module.build_shm_op = _no_shm_op


def _without_shm_op(name: str, path):
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None and spec.loader is not None:
        spec.loader = _ThenNoShmOp(spec.loader)
    return spec


def install() -> None:
    """Once per process, before DeepSpeed is imported (a no-op after)."""
    if _IMPORTER in sys.modules or any(isinstance(f, _LeanDeepSpeedFinder)
                                       for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _LeanDeepSpeedFinder())


MUON = "deepspeed.runtime.zero.muon.original_muon"


def import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer without `torch.compile` on its functions (once, before
    `deepspeed.initialize`; a no-op when it is already imported)."""
    if MUON in sys.modules:
        return
    from deepspeed.runtime import compiler

    wrap = compiler.compile
    compiler.compile = lambda: compiler.dummy_decorator
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    finally:
        compiler.compile = wrap
