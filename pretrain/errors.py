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


# Exit statuses of `pretrain` (documented in docs/checkpoints-and-faults.md; the Slurm scripts
# act on them).
EXIT_OK = 0
EXIT_USER_ERROR = 2  # a PretrainError: bad config, data or checkpoint; fix the input, do not retry
EXIT_FAULT = 3  # the run stopped itself: a rank died / collective timed out, too many NaN steps
# A checkpoint was saved because of SIGTERM / SIGUSR1 / --exit-after-minutes: requeue the job and
# it resumes from that checkpoint. Also a hang the watchdog named (pretrain/training/hang.py): the requeued
# job resumes from the last complete checkpoint. 75 is EX_TEMPFAIL of sysexits.h ("try again later").
EXIT_REQUEUE = 75


class TrainingFault(Exception):
    """The run stopped itself (too many non-finite steps, a dead rank, a checkpoint a rank could
    not write): exit EXIT_FAULT. Not a `PretrainError`: the input was fine, the run was not."""

    exit_code = EXIT_FAULT
