"""Loads a local task's JSON lines files named relative to this directory (lm-eval's
`custom_dataset` hook; `datasets` would resolve them against the working directory)."""
from __future__ import annotations

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load(data_files: dict[str, str], **_) -> datasets.DatasetDict:
    files = {split: str(HERE / name) for split, name in data_files.items()}
    return datasets.load_dataset("json", data_files=files)
