"""Compatibility with Megatron-LM's own indexed-dataset code (megatron-core), both directions.

megatron-core is not a dependency of this project (it would pull Transformer Engine and more);
its pure-Python `indexed_dataset` module is enough, installed without dependencies into the
ignored build folder::

    .venv/bin/pip install --no-deps --target .build/megatron_core megatron-core==0.16.1

The fixture below does this when the folder is missing; where the package index cannot be
reached (an offline machine) these tests are skipped, saying so, instead of failing.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from filelock import FileLock

from pretrain.data import IndexedDataset, IndexedDatasetWriter

MEGATRON = Path(__file__).resolve().parents[1] / ".build" / "megatron_core"
MEGATRON_CORE_VERSION = "0.16.1"


@pytest.fixture(scope="module")
def megatron_indexed():
    with FileLock(str(MEGATRON) + ".lock"):  # pytest-xdist workers install it once
        if not (MEGATRON / "megatron" / "core").is_dir():
            pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                                  "--retries", "1", "--timeout", "30", "--target", str(MEGATRON),
                                  f"megatron-core=={MEGATRON_CORE_VERSION}"],
                                 capture_output=True, text=True)
            if pip.returncode != 0:
                pytest.skip(f"megatron-core=={MEGATRON_CORE_VERSION} could not be installed into "
                            f"{MEGATRON} (offline?): {pip.stderr.strip().splitlines()[-1:]}")
    if str(MEGATRON) not in sys.path:
        sys.path.append(str(MEGATRON))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        return importlib.import_module("megatron.core.datasets.indexed_dataset")


def documents(count: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 60000, size=int(rng.integers(1, 50))).tolist() + [2]
            for _ in range(count)]


def megatron_write(module, prefix: Path, docs: list[list[int]], *, dtype) -> None:
    builder = module.IndexedDatasetBuilder(module.get_bin_path(str(prefix)), dtype=dtype)
    for document in docs:
        builder.add_item(torch.tensor(document))
        builder.end_document()
    builder.finalize(module.get_idx_path(str(prefix)))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_reads_ours_and_files_are_byte_identical(tmp_path, megatron_indexed, dtype):
    docs = documents(60)
    with IndexedDatasetWriter(tmp_path / "ours", dtype=dtype) as writer:
        for document in docs:
            writer.add_document(document)
    theirs = megatron_indexed.IndexedDataset(str(tmp_path / "ours"), mmap=True)
    assert [theirs[i].tolist() for i in range(len(theirs))] == docs
    assert theirs.index.dtype == dtype
    assert theirs.document_indices.tolist() == list(range(len(docs) + 1))
    megatron_write(megatron_indexed, tmp_path / "meg", docs, dtype=dtype)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"meg{suffix}").read_bytes()


def test_we_read_megatron_documents_of_several_sentences(tmp_path, megatron_indexed):
    docs = documents(10)
    builder = megatron_indexed.IndexedDatasetBuilder(
        megatron_indexed.get_bin_path(str(tmp_path / "meg")), dtype=np.uint16)
    for document in docs[:4]:
        builder.add_item(torch.tensor(document))
        builder.end_document()
    # One document of three sentences (sequences), as Megatron's sentence splitting writes.
    builder.add_document(torch.tensor(sum(docs[4:7], [])), [len(d) for d in docs[4:7]])
    builder.finalize(megatron_indexed.get_idx_path(str(tmp_path / "meg")))
    ours = IndexedDataset(tmp_path / "meg")
    assert [ours[i].tolist() for i in range(len(ours))] == docs[:7]
    assert ours.num_documents == 5 and ours.document_indices.tolist() == [0, 1, 2, 3, 4, 7]
