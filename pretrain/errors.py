"""Errors a user can act on.

Every error that comes from user input (a config, a corpus, a checkpoint) is a `PretrainError`.
The command line prints its message as one line and exits with status 2, without a traceback.
Messages say what was wrong, the value seen, and what to do.
"""


class PretrainError(Exception):
    """Base class: a problem with the user's input, reported without a traceback."""


class ConfigError(PretrainError, ValueError):
    """A run config or DeepSpeed config that is invalid or contradicts itself."""


class DataError(PretrainError, ValueError):
    """A corpus, tokenizer or indexed dataset that cannot be used."""


class CheckpointError(PretrainError):
    """A checkpoint that is missing, damaged or does not match the run."""
