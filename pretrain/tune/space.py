"""The search space of `pretrain tune`: a YAML mapping of run-config fields (the `--set` paths) to
a range or a list, each a `Param` that samples itself from an Optuna trial::

    train.lr: {low: 1.0e-4, high: 1.0e-1, log: true}   # float, log-uniform
    train.warmup_steps: {choices: [10, 50, 100]}      # categorical
    train.micro_batch_size: {low: 1, high: 8, step: 1}  # int: low, high (and step) are integers

and the `--set` text of a sampled value (`override`); trials enqueued by hand
(`parse_enqueued`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pretrain.config import read_user_file
from pretrain.errors import ConfigError


SPEC_KEYS = {"low", "high", "log", "step", "choices"}


@dataclass(frozen=True)
class Param:
    """One dimension of the search space: a run-config field and its distribution."""

    key: str
    kind: str  # float | int | categorical
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: Any) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high, step=self.step or 1,
                                     log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)

    def edge_values(self) -> list[Any]:
        """The values a config check tries: every choice, or both ends of the range."""
        return list(self.choices) if self.kind == "categorical" else [self.low, self.high]


def yaml_value(value: Any) -> str:
    """`value` as `--set` parses it back (YAML): 1e-05 as `1.0e-05`, which YAML reads as a float."""
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text[:-4].strip() if text.endswith("\n...") else text


def override(key: str, value: Any) -> str:
    return f"{key}={yaml_value(value)}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_space(raw: Any, *, source: str = "search space") -> list[Param]:
    """The parameters of a search-space mapping; a ConfigError naming the key for a bad entry."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{source}: expected a mapping of config fields to ranges, e.g. "
                          "train.lr: {low: 1.0e-4, high: 1.0e-2, log: true}")
    params = []
    for key, spec in raw.items():
        where = f"{source}: {key}"
        if not isinstance(key, str) or "." not in key and key not in ("run_dir", "deepspeed"):
            raise ConfigError(f"{where}: keys are config fields like train.lr")
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: expected {{low: .., high: ..}} or {{choices: [..]}}, "
                              f"got {spec!r}")
        unknown = sorted(set(spec) - SPEC_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown entry {unknown[0]!r}: use low/high (with log or "
                              "step) or choices")
        if "choices" in spec:
            choices = spec["choices"]
            if set(spec) != {"choices"}:
                raise ConfigError(f"{where}: choices cannot be combined with low/high/log/step")
            if not isinstance(choices, list) or not choices or not all(
                    c is None or isinstance(c, (str, int, float, bool)) for c in choices):
                raise ConfigError(f"{where}: choices must be a non-empty list of plain values, got "
                                  f"{choices!r}")
            params.append(Param(key, "categorical", choices=tuple(choices)))
            continue
        if "low" not in spec or "high" not in spec:
            raise ConfigError(f"{where}: needs low and high (or choices)")
        low, high, log, step = spec["low"], spec["high"], spec.get("log", False), spec.get("step")
        if not (_number(low) and _number(high)) or not low < high:
            raise ConfigError(f"{where}: needs numbers low < high, got low={low!r} high={high!r}")
        if not isinstance(log, bool):
            raise ConfigError(f"{where}: log must be true or false, got {log!r}")
        if log and low <= 0:
            raise ConfigError(f"{where}: a log range needs low > 0, got low={low!r}")
        if step is not None and (not _number(step) or step <= 0):
            raise ConfigError(f"{where}: step must be a positive number, got {step!r}")
        integer = all(isinstance(v, int) for v in (low, high) + ((step,) if step else ()))
        if log and step is not None and not (integer and step == 1):
            raise ConfigError(f"{where}: log and step cannot be combined (except step 1 of an "
                              "int range)")
        if step is not None and not math.isclose((high - low) / step, round((high - low) / step)):
            raise ConfigError(f"{where}: high - low = {high - low!r} is not a multiple of "
                              f"step {step!r}")
        params.append(Param(key, "int" if integer else "float", low=low, high=high, log=log,
                            step=step))
    return params


# the settings only train.optimizer=muon reads (Muon's rate, decay and Newton-Schulz dtype)
MUON_SETTINGS = ("train.muon_lr", "train.muon_weight_decay", "train.muon_ns_dtype")


def unread_settings(params: list[Param], *, optimizer: str) -> str | None:
    """Why a searched Muon setting would tune nothing: every trial trains with `optimizer`
    (train.optimizer of the config, unless the space searches it too) and none with muon;
    None when every searched setting is read."""
    searched = next((p for p in params if p.key == "train.optimizer"), None)
    optimizers = [str(c) for c in searched.choices] if searched else [optimizer]
    muon = [p.key for p in params if p.key in MUON_SETTINGS]
    if not muon or "muon" in optimizers:
        return None
    return (f"search space {muon[0]}: the trials train with train.optimizer="
            f"{'|'.join(optimizers)}, which does not read it (Muon's settings); set "
            "train.optimizer=muon (config or --set) or search train.optimizer: {choices: [..., "
            "muon]}")


def load_space(path: str | Path) -> list[Param]:
    raw = read_user_file(path, "--space", language="YAML",
                         hint="pass a YAML file like configs/tune/space.yaml")
    return parse_space(raw, source=f"search space {path}")


def parse_enqueued(raw: Any, params: list[Param], *, source: str) -> list[dict[str, Any]]:
    """A list of {field: value} mappings to try first, each field a key of the space."""
    keys = [p.key for p in params]
    if not isinstance(raw, list) or not all(isinstance(e, dict) and e for e in raw):
        raise ConfigError(f"{source}: expected a list of mappings like - {{{keys[0]}: ...}}")
    for entry in raw:
        unknown = sorted(set(entry) - set(keys))
        if unknown:
            raise ConfigError(f"{source}: {unknown[0]} is not a key of the search space "
                              f"({', '.join(keys)})")
    return raw
