"""Pretrain Llama-style decoder models with tensor, pipeline and ZeRO data parallelism."""

from pretrain.training import deepspeed_imports

deepspeed_imports.install()

__version__ = "0.1.0"
