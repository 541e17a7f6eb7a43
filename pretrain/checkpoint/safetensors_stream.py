"""safetensors files written and read one tensor at a time.

`safetensors.torch.save_file` takes the whole state dict at once: for a 70B model that is every
tensor in memory on the writing rank. The format needs no such thing (8 bytes of header length,
a JSON header of names, dtypes, shapes and byte offsets, then the tensors' bytes in that order),
and the shapes of a checkpoint are known before its first tensor arrives, so `SafetensorsWriter`
writes the header first and then each tensor as it comes: the writer holds one tensor at a time.
The file is what `safetensors` itself writes and reads (`safe_open`, `load_file`, transformers).
`LazyTensors` is the reading side: a mapping over safetensors files that reads a tensor when it
is asked for, so copying a checkpoint into a model, or into another file, holds one tensor.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from safetensors import safe_open

_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class SafetensorsWriter:
    """Write `shapes` (name -> shape, in this order) of `dtype` to `path`, one `write` each."""

    def __init__(self, path: Path, shapes: dict[str, Sequence[int]], *,
                 dtype: torch.dtype = torch.float32, metadata: dict[str, str] | None = None):
        self.path, self.dtype = Path(path), dtype
        self._order = list(shapes)
        self._shapes = {name: tuple(shape) for name, shape in shapes.items()}
        itemsize = dtype.itemsize
        header: dict[str, object] = {"__metadata__": dict(metadata or {})}
        offset = 0
        for name in self._order:
            size = itemsize * math.prod(self._shapes[name])
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(self._shapes[name]),
                            "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self._file = open(self.path, "wb")
        self._file.write(len(text).to_bytes(8, "little") + text)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append `name`, the next tensor of the header's order, cast to the file's dtype."""
        if self._next >= len(self._order) or self._order[self._next] != name:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing"
            raise ValueError(f"{self.path}: got {name!r}, the header's order expects {expected!r}")
        if tuple(tensor.shape) != self._shapes[name]:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the header says "
                             f"{self._shapes[name]}")
        data = tensor.detach().to("cpu", self.dtype).contiguous()
        self._file.write(data.view(torch.uint8).numpy().data if data.numel() else b"")
        self._next += 1

    def close(self) -> None:
        """Close the file; every tensor of the header must have been written."""
        self._file.close()
        if self._next != len(self._order):
            raise ValueError(f"{self.path}: {len(self._order) - self._next} tensors of the header "
                             f"were not written (next: {self._order[self._next]!r})")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


class LazyTensors(Mapping):
    """{name: tensor} of safetensors files, each tensor read from disk when it is looked up.

    Opening reads only the headers (a damaged or truncated file fails here, as safetensors
    checks that the offsets cover the file); `shape(name)` needs no data.
    """

    def __init__(self, files: Sequence[Path], *, skip: Callable[[str], bool] = lambda name: False):
        self._file: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            with safe_open(str(file), "pt") as handle:
                for name in handle.keys():
                    if not skip(name):
                        self._file[name] = Path(file)
                        self._shapes[name] = tuple(handle.get_slice(name).get_shape())

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._file[name]), "pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def slice(self, name: str, *, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices start..stop of `name` along `dim`, read without the rest of the tensor."""
        index = tuple(slice(start, stop) if d == dim else slice(None)
                      for d in range(len(self._shapes[name])))
        with safe_open(str(self._file[name]), "pt") as handle:
            return handle.get_slice(name)[index]
