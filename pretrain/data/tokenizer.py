"""Tokenizers: sentencepiece models (trained here or loaded) and Hugging Face tokenizers.

`Tokenizer.load(path)` is the one entry point: a file is a sentencepiece ``.model``, a
directory is a Hugging Face tokenizer (``save_pretrained`` output, loaded with
``AutoTokenizer``). Both give the same interface: ``vocab_size``, ``eos_id``, ``bos_id``,
``encode``/``encode_batch``/``decode``, ``path`` and ``sha256`` (of the file, or of every file
of the directory), which checkpoints record so that a run is tied to its tokenizer.

Sentencepiece training choices, and why:

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
import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from pretrain.data.corpus import DEFAULT_TEXT_FIELD, iter_documents
from pretrain.errors import DataError
from pretrain.files import atomic_file

DEFAULT_SAMPLE_BYTES = 8_000_000  # ~8 MB of text: ~2 s of BPE training for 8k tokens on 2 cores
_SAMPLE_SEED = 0  # fixed: the sample, hence the model file, must not vary between runs
_MAX_SENTENCE_BYTES = 1 << 16  # longer lines (minified data, base64 blobs) are left out of training
_MODEL_TYPES = ("bpe", "unigram")
# A tokenizer copied into a directory (a checkpoint's final/): the sentencepiece model, or the
# files of a Hugging Face tokenizer, matched by `HF_TOKENIZER_FILES` (a model directory also holds
# weights: not these).
COPIED_MODEL = "tokenizer.model"
COPIED_DIR = "tokenizer"
HF_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                      "merges.txt", "chat_template*")


def train_tokenizer(paths: Sequence[Path], *, model_prefix: str | Path, vocab_size: int,
                    model_type: str = "bpe", text_field: str = DEFAULT_TEXT_FIELD,
                    sample_bytes: int = DEFAULT_SAMPLE_BYTES) -> SentencePieceTokenizer:
    """Train a tokenizer on a sample of the corpus files `paths`; write ``model_prefix.model``.

    Sentences are streamed to the trainer and the model comes back in memory, so the model file
    records no temporary paths and the same corpus gives a byte-identical file. It is written
    under a temporary name and renamed, so a crash never leaves a half-written model.
    """
    if model_type not in _MODEL_TYPES:
        raise DataError(f"tokenizer model_type {model_type!r} is not supported: use one of "
                        f"{', '.join(_MODEL_TYPES)}")
    sentences = _training_sample(paths, text_field=text_field, sample_bytes=sample_bytes)
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
    return SentencePieceTokenizer.load(path)


def _training_sample(paths: Sequence[Path], *, text_field: str,
                     sample_bytes: int) -> list[str]:
    """The lines of whole documents, in a seeded file order, up to about `sample_bytes`.

    Whole files in a shuffled order (rather than the first files alphabetically) give a sample
    that spans the corpus; ``random.Random(int).shuffle`` is stable across Python versions.
    """
    order = list(paths)
    random.Random(_SAMPLE_SEED).shuffle(order)
    sentences: list[str] = []
    size = 0
    for document in iter_documents(order, text_field=text_field):
        for line in document.split("\n"):
            if line:
                sentences.append(line)
                size += len(line.encode("utf-8")) + 1
        if size >= sample_bytes:
            break
    if not sentences:
        raise DataError(f"cannot train a tokenizer: the {len(order)} corpus files hold no text")
    return sentences


class Tokenizer(ABC):
    """What the data pipeline needs of a tokenizer; `Tokenizer.load` picks the implementation.

    Picklable, so it can be sent to DataLoader and preprocessing workers.
    """

    path: Path
    sha256: str  # recorded in checkpoints: the run is tied to these exact tokenizer files

    @staticmethod
    def load(path: str | Path) -> Tokenizer:
        """A sentencepiece ``.model`` file or a Hugging Face tokenizer directory.

        `DataError` when the path is missing or holds no tokenizer.
        """
        path = Path(path)
        if path.is_dir():
            return HuggingFaceTokenizer.load(path)
        if not path.exists() and _looks_like_hub_id(str(path)):
            raise DataError(
                f"tokenizer {str(path)!r} is not a local file or directory; it looks like a "
                "Hugging Face hub id, and tokenizers are read from local files only (ranks "
                "have no hub access). On a machine that has it: `huggingface-cli download "
                f'{path} --include "tokenizer*" --local-dir tokenizers/{path.name}` (a gated '
                "model such as Llama 3 needs `huggingface-cli login` and its licence accepted "
                f"first), copy that directory here and pass it: --tokenizer "
                f"tokenizers/{path.name} / data.tokenizer=tokenizers/{path.name}")
        return SentencePieceTokenizer.load(path)

    def copy_to(self, directory: str | Path) -> Path:
        """`copy_tokenizer` of this tokenizer's files into `directory`."""
        return copy_tokenizer(self.path, directory)

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size): the model's embedding rows."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """End of document; appended to every document by preprocessing. -1 when undefined."""

    @property
    @abstractmethod
    def bos_id(self) -> int:
        """Beginning of sequence (prompts of `pretrain generate`); -1 when undefined."""

    @abstractmethod
    def token(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` as the tokenizer writes it (`</s>`,
        `<|end_of_text|>`): what `preprocess` names as the end-of-document token."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without bos/eos."""
        return self.encode_batch([text])[0]

    @abstractmethod
    def encode_batch(self, texts: Iterable[str], *, num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text, without bos/eos."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; special tokens decode to nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size})"


class SentencePieceTokenizer(Tokenizer):
    """A loaded sentencepiece model.

    Pickles the serialized model, not a path that may change.
    """

    def __init__(self, model_bytes: bytes, *, path: Path) -> None:
        self.path = Path(path)
        self.sha256 = hashlib.sha256(model_bytes).hexdigest()
        self._model_bytes = model_bytes
        self._processor = spm.SentencePieceProcessor()
        try:
            self._processor.LoadFromSerializedProto(model_bytes)
        except (RuntimeError, OSError) as error:
            raise DataError(f"tokenizer {str(path)!r} is not a sentencepiece model ({error}): "
                            "train a new one with `pretrain tokenizer` or fix data.tokenizer"
                            ) from error

    @classmethod
    def load(cls, path: str | Path) -> SentencePieceTokenizer:
        """Load a ``.model`` file; `DataError` when it is missing or not a sentencepiece model."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer model {str(path)!r} not found: train one with "
                            "`pretrain tokenizer --corpus ... --output PATH`, or give an existing "
                            "sentencepiece .model or Hugging Face tokenizer directory")
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
        return self._processor.eos_id()

    @property
    def bos_id(self) -> int:
        return self._processor.bos_id()

    def token(self, token_id: int) -> str:
        return self._processor.id_to_piece(token_id)

    @property
    def unk_id(self) -> int:
        return self._processor.unk_id()

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text, out_type=int)

    def encode_batch(self, texts: Iterable[str], *, num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text. One thread by default: preprocessing parallelises with
        processes, and threads on top of them would oversubscribe the cores."""
        return self._processor.encode(list(texts), out_type=int, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` (a list or a NumPy array); special tokens decode to nothing."""
        return self._processor.decode(np.asarray(ids, dtype=np.int64).tolist())


class HuggingFaceTokenizer(Tokenizer):
    """Any tokenizer ``AutoTokenizer`` loads from a local directory (offline: no hub access).

    ``vocab_size`` counts added tokens (``len(tokenizer)``), the size the embedding needs.
    Pickles its path and hash; the receiving process reloads and checks the hash.
    """

    def __init__(self, path: str | Path, *, expected_sha256: str | None = None) -> None:
        self.path = Path(path)
        self.sha256 = directory_sha256(self.path)
        if expected_sha256 is not None and self.sha256 != expected_sha256:
            raise DataError(f"tokenizer {str(self.path)!r} changed (sha256 {self.sha256[:12]}, "
                            f"expected {expected_sha256[:12]}): do not modify a tokenizer "
                            "during a run")
        from transformers import AutoTokenizer  # ~2-9 s: only for Hugging Face tokenizers

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError) as error:
            raise DataError(f"{str(self.path)!r} is not a Hugging Face tokenizer directory "
                            f"({str(error).splitlines()[0]}): give a sentencepiece .model or a "
                            "directory written by `save_pretrained`") from error

    @classmethod
    def load(cls, path: str | Path) -> HuggingFaceTokenizer:
        return cls(path)

    def __getstate__(self) -> dict:
        return {"path": self.path, "sha256": self.sha256}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], expected_sha256=state["sha256"])

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def eos_id(self) -> int:
        eos = self._tokenizer.eos_token_id
        return -1 if eos is None else int(eos)

    @property
    def bos_id(self) -> int:
        bos = self._tokenizer.bos_token_id
        return -1 if bos is None else int(bos)

    def token(self, token_id: int) -> str:
        return self._tokenizer.convert_ids_to_tokens(token_id)

    def encode_batch(self, texts: Iterable[str], *, num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text, without special tokens (the library's batch encoding)."""
        return self._tokenizer(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(np.asarray(ids, dtype=np.int64).tolist(),
                                      skip_special_tokens=True)


def _looks_like_hub_id(text: str) -> bool:
    """`owner/name` as the hub spells repositories, with no file suffix:
    `meta-llama/Meta-Llama-3-8B` is one, `data/tokenizer.model` and `./tok` are not."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) is not None and \
        Path(text).suffix not in (".model", ".json")


def copy_tokenizer(source: str | Path, directory: str | Path) -> Path:
    """Copy the tokenizer at `source` into `directory` (a checkpoint, so that it is
    self-contained): a sentencepiece model as ``directory/tokenizer.model``, a Hugging Face
    directory's tokenizer files under ``directory/tokenizer/``. Returns the path
    `Tokenizer.load` takes. Reads no tokenizer: nothing is loaded to copy it."""
    source, directory = Path(source), Path(directory)
    if source.is_dir():
        copy_tokenizer_files(source, directory / COPIED_DIR)
        return directory / COPIED_DIR
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, directory / COPIED_MODEL)
    return directory / COPIED_MODEL


def copy_tokenizer_files(src_dir: Path, dst_dir: Path) -> None:
    """Copy the files of the Hugging Face tokenizer in `src_dir` (`HF_TOKENIZER_FILES`, not the
    model's weights beside them) into `dst_dir`."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for pattern in HF_TOKENIZER_FILES:
        for file in src_dir.glob(pattern):
            if file.is_file():
                shutil.copyfile(file, dst_dir / file.name)


def directory_sha256(directory: Path) -> str:
    """A sha256 over the names and contents of the files of `directory`, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()
