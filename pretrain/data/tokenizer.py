"""A sentencepiece tokenizer that round-trips source code exactly.

Training choices, and why:

- BPE with ``byte_fallback``: any character the vocabulary lacks (a rare symbol, an emoji, a
  tab) is encoded as its UTF-8 bytes instead of ``<unk>``, so ``decode(encode(text)) == text``
  for every string.
- ``normalization_rule_name="identity"``, ``remove_extra_whitespaces=False``,
  ``add_dummy_prefix=False``: no NFKC, no collapsed or invented spaces; indentation is data.
- ``allow_whitespace_only_pieces`` and ``split_digits``: runs of indentation become single
  tokens; numbers are spelled digit by digit (as in Llama), which helps arithmetic.
- ``"\\n"`` is a user-defined symbol: sentencepiece reads its training input one line per
  sentence, so a newline never appears inside a training sentence and would otherwise only be
  reachable through byte fallback.
- Special ids: ``<unk>`` = 0, ``<s>`` (bos) = 1, ``</s>`` (eos, the end of a document) = 2,
  no padding id (packed samples need none).
- It trains on a deterministic sample of the corpus (whole files in a fixed shuffled order, up
  to `sample_bytes`), so a large corpus trains in seconds and the same corpus gives the same
  model file (and sha256) every time.
"""
from __future__ import annotations

import hashlib
import io
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from pretrain.data.corpus import iter_documents
from pretrain.data.indexed import atomic_file
from pretrain.errors import DataError

DEFAULT_SAMPLE_BYTES = 8_000_000  # ~8 MB of text: ~2 s of BPE training for 8k tokens on 2 cores
_SAMPLE_SEED = 0  # fixed: the sample, hence the model file, must not vary between runs
_MAX_SENTENCE_BYTES = 1 << 16  # longer lines (minified data, base64 blobs) are left out of training
_MODEL_TYPES = ("bpe", "unigram")


def train_tokenizer(paths: Sequence[Path], *, model_prefix: str | Path, vocab_size: int,
                    model_type: str = "bpe",
                    sample_bytes: int = DEFAULT_SAMPLE_BYTES) -> Tokenizer:
    """Train a tokenizer on a sample of the corpus files `paths`; write ``model_prefix.model``.

    Sentences are streamed to the trainer and the model comes back in memory, so the model file
    records no temporary paths and the same corpus gives a byte-identical file. It is written
    under a temporary name and renamed, so a crash never leaves a half-written model.
    """
    if model_type not in _MODEL_TYPES:
        raise DataError(f"tokenizer model_type {model_type!r} is not supported: use one of "
                        f"{', '.join(_MODEL_TYPES)}")
    sentences = _training_sample(paths, sample_bytes=sample_bytes)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, byte_fallback=True, split_digits=True,
            allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
            add_dummy_prefix=False, normalization_rule_name="identity",
            user_defined_symbols=["\n"], max_sentence_length=_MAX_SENTENCE_BYTES,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            input_sentence_size=0, shuffle_input_sentence=False,  # the sample is the input
            num_threads=os.cpu_count() or 1, minloglevel=2)
    except RuntimeError as error:
        # Keep sentencepiece's sentence, drop its "INTERNAL: file.cc(638) [condition]" prefix.
        reason = str(error).strip().splitlines()[-1].rpartition("] ")[2]
        raise DataError(f"sentencepiece could not train a {vocab_size}-token {model_type} "
                        f"tokenizer: {reason}") from error
    path = Path(f"{model_prefix}.model")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as out:
        out.write(model.getvalue())
    return Tokenizer.load(path)


def _training_sample(paths: Sequence[Path], *, sample_bytes: int) -> list[str]:
    """The lines of whole documents, in a seeded file order, up to about `sample_bytes`.

    Whole files in a shuffled order (rather than the first files alphabetically) give a sample
    that spans the corpus; ``random.Random(int).shuffle`` is stable across Python versions.
    """
    order = list(paths)
    random.Random(_SAMPLE_SEED).shuffle(order)
    sentences: list[str] = []
    size = 0
    for document in iter_documents(order):
        for line in document.split("\n"):
            if line:
                sentences.append(line)
                size += len(line.encode("utf-8")) + 1
        if size >= sample_bytes:
            break
    if not sentences:
        raise DataError(f"cannot train a tokenizer: the {len(order)} corpus files hold no text")
    return sentences


class Tokenizer:
    """A loaded sentencepiece model with the ids the data pipeline needs.

    Picklable (it carries the serialized model, not a path that may change), so it can be
    sent to DataLoader workers.
    """

    def __init__(self, model_bytes: bytes, *, path: Path) -> None:
        self.path = Path(path)
        self.sha256 = hashlib.sha256(model_bytes).hexdigest()  # recorded in checkpoints
        self._model_bytes = model_bytes
        self._processor = spm.SentencePieceProcessor()
        try:
            self._processor.LoadFromSerializedProto(model_bytes)
        except (RuntimeError, OSError) as error:
            raise DataError(f"tokenizer {str(path)!r} is not a sentencepiece model ({error}): "
                            "train a new one with `pretrain tokenizer` or fix data.tokenizer"
                            ) from error

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load a ``.model`` file; `DataError` when it is missing or not a sentencepiece model."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer model {str(path)!r} not found: train one with "
                            "`pretrain tokenizer --corpus ... --output PATH` or fix the path")
        return cls(path.read_bytes(), path=path)

    def __getstate__(self) -> dict:
        return {"model_bytes": self._model_bytes, "path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_bytes"], path=state["path"])

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def eos_id(self) -> int:
        """End of document; appended to every document by preprocessing. -1 when undefined."""
        return self._processor.eos_id()

    @property
    def bos_id(self) -> int:
        return self._processor.bos_id()

    @property
    def unk_id(self) -> int:
        return self._processor.unk_id()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without bos/eos."""
        return self._processor.encode(text, out_type=int)

    def encode_batch(self, texts: Iterable[str], *, num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text. One thread by default: preprocessing parallelises with
        processes, and threads on top of them would oversubscribe the cores."""
        return self._processor.encode(list(texts), out_type=int, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` (a list or a NumPy array); special tokens decode to nothing."""
        return self._processor.decode(np.asarray(ids, dtype=np.int64).tolist())

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"
