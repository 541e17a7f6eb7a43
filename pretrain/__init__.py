"""Pretrain Llama-style decoder models with tensor, pipeline and ZeRO data parallelism."""

from pretrain import lean_imports

lean_imports.install()

__version__ = "0.1.0"
