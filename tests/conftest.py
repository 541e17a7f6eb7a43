"""Shared fixtures: a tiny tokenized corpus, and running `pretrain` under real launchers."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# DeepSpeed's JIT ops (shared-memory comm, CPU Adam, async io) compile once per machine into the
# repository's ignored build folder, shared by every test process.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".build" / "torch_extensions"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# torch.compile's inductor kernels (model.compile) likewise: built once, reused by every run
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".build" / "torch_compile"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# A fixed slice of the bundled corpus (the interpreter's standard library): small enough that
# tokenizer training and preprocessing take seconds, real enough that a model can learn from it.
STDLIB = Path(sysconfig.get_paths()["stdlib"])
TINY_CORPUS_FILES = sorted(p for d in ("json", "email", "logging", "concurrent")
                           for p in (STDLIB / d).rglob("*.py") if "test" not in p.parts)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "slow: launches training runs, a Slurm cluster or compiled ops; the quick tier "
        "(`bash launch/test.sh --quick`, pytest -m 'not slow') leaves these out")


# {node id: slow} of every test this session collected, before `-m`, `-k` or --deselect left any
# out, and the test files it collected whole (under a folder or file argument, not a node id):
# tests/test_mutants.py checks the mutant entries' node ids against them instead of collecting
# the named files again.
_COLLECTED: dict[str, bool] = {}
_WHOLE_FILES: set[str] = set()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    here = config.invocation_params.dir
    whole = [(here / arg).resolve() for arg in config.args if "::" not in arg]
    for item in items:
        _COLLECTED[item.nodeid] = item.get_closest_marker("slow") is not None
        path = Path(item.path).resolve()
        if any(path == arg or arg in path.parents for arg in whole):
            _WHOLE_FILES.add(item.nodeid.split("::")[0])


def collected_here(test_files: list[str]) -> dict[str, bool] | None:
    """{node id: slow} of every test in `test_files` as this session collected them, or None
    when it did not collect each of them whole."""
    if not set(test_files) <= _WHOLE_FILES:
        return None
    files = set(test_files)
    return {node: slow for node, slow in _COLLECTED.items() if node.split("::")[0] in files}


def require_root(what: str) -> None:
    """Skip, with one line, a test that has to install Debian packages or edit /etc/hosts."""
    if os.geteuid() != 0:
        pytest.skip(f"{what}: needs root (apt-get, /etc/hosts); CI runs as root")


@pytest.fixture(scope="session")
def moe_reference(tiny_data, tmp_path_factory):
    """One process training `configs/tiny_moe.yaml` (tests/test_moe.py's `_moe_train`): the
    reference of every mixture-of-experts layout; its step-3 checkpoint is kept for resuming on
    other layouts."""
    from tests.test_moe import SAVE_AT, _moe_train

    return _moe_train(tmp_path_factory.mktemp("moe_ref"), tiny_data, name="single", overrides=[
        f"checkpoint.save_interval={SAVE_AT}", "checkpoint.keep_last=1",
        f"checkpoint.keep_every={SAVE_AT}"])


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> dict[str, str]:
    """A 512-token sentencepiece model and a .bin/.idx dataset of a few stdlib packages."""
    from pretrain.data import preprocess, train_tokenizer

    out = tmp_path_factory.mktemp("tiny_data")
    model = train_tokenizer(TINY_CORPUS_FILES, model_prefix=out / "sp512", vocab_size=512).path
    preprocess(TINY_CORPUS_FILES, tokenizer_path=model, output_prefix=out / "corpus", workers=1,
               show_progress=False)
    return {"tokenizer": str(model), "dataset": str(out / "corpus")}


@pytest.fixture(scope="session")
def libaio() -> None:
    """DeepSpeed's async-io op (NVMe offload) compiles against Debian's libaio-dev: install it."""
    if Path("/usr/include/libaio.h").exists():
        return
    require_root("NVMe offload compiles against Debian's libaio-dev, which is not installed")
    if shutil.which("apt-get") is None:
        pytest.fail("NVMe offload needs Debian's libaio-dev: install it with your package manager")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "libaio-dev"], check=True, env=env,
                   capture_output=True)
    assert Path("/usr/include/libaio.h").exists()
