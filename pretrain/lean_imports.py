"""Keep imports a rank never uses out of every process's start-up.

Two of DeepSpeed's imports cost a rank seconds for features this stack never uses:

DeepSpeed's autotuner module (imported by `import deepspeed`, never run by this stack) imports
MLflow when it is installed, to log its own experiments. MLflow, with FastAPI and pandas behind
it, is 2.5 s of the 7 s `import deepspeed` takes on a 2-core AMD EPYC: paid by every rank of every
run, and by every run of the test suite. The finder below answers "not installed" to that one
import only; the autotuner then runs without MLflow (`has_mlflow = False`), and every other
`import mlflow` (this stack's MLflow sink, `logging.report_to: [mlflow]`) works as usual.
"""
from __future__ import annotations

import importlib.abc
import sys

_IMPORTER = "deepspeed.autotuning.autotuner"


class _NoMlflowForDeepSpeedsAutotuner(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "mlflow":
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") == _IMPORTER:
                raise ModuleNotFoundError(f"MLflow is not imported for {_IMPORTER}", name=name)
            frame = frame.f_back
        return None


def install() -> None:
    """Once per process, before DeepSpeed is imported (a no-op after)."""
    if _IMPORTER in sys.modules or any(isinstance(f, _NoMlflowForDeepSpeedsAutotuner)
                                       for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _NoMlflowForDeepSpeedsAutotuner())


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
