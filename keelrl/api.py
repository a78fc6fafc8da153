"""The Python API: a config, a model, an environment or a task file, then `train()`.

    import keelrl
    trainer = keelrl.Trainer(keelrl.configure("configs/tiny.yaml", "train.steps=2"), model="tiny")
    summary = trainer.train()

`configure` builds the same validated `KeelConfig` as `keel train` does, from a YAML file, a
mapping or nothing (the defaults), plus `dotted.key=value` overrides; every field's help is its
docstring (`keelrl.explain("algo")` prints them, as `keel config --explain` does).
`Trainer(cfg, model=..., tasks=... or env=..., run_dir=...)` sets those on the config
(`with_paths`), and `train()` runs the whole job (warm start, evaluation, RL, final
evaluation) into the run directory and returns what `summary.json` holds. `warm_start` runs
only the warm start, to compare variants from one start.

Components plug in through the registries: an advantage estimator, clip rule or ratio
registered under a new name (`keelrl.ADVANTAGES.register(NAME, summary=...)(fn)`) is then a
valid `algo.advantage=NAME`; an environment comes in as an `EnvSpec` (`Trainer(cfg, env=spec)`),
or registered by name (`keelrl.register_env`) for `env.name=...`.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Mapping

from keelrl.components import explain as _explain_rows
from keelrl.config import KeelConfig, apply_overrides, from_dict, load_config, to_dict, with_paths
from keelrl.envs.registry import EnvSpec
from keelrl.errors import ConfigError


def configure(source: str | Path | Mapping[str, Any] | KeelConfig | None = None, *overrides: str) -> KeelConfig:
    """A validated run config: `source` (a YAML path, a nested mapping, a `KeelConfig`, or None for
    the defaults) with `overrides` applied (`"algo.preset=dapo"`, ...). A bad field or value raises
    `ConfigError` naming it, before any work starts."""
    if source is None or isinstance(source, (str, Path)):
        cfg = load_config(source, overrides)
    else:
        data = to_dict(source) if isinstance(source, KeelConfig) else _plain(source)
        if not isinstance(data, dict):
            raise ConfigError("", f"a config source is a YAML path, a mapping or a KeelConfig, got "
                                  f"{type(source).__name__}")
        cfg = from_dict(KeelConfig, apply_overrides(data, overrides))
    return cfg


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def explain(section: str = "") -> str:
    """Every config field under `section` ("" for all, "algo", "optim.lr"...) with its default and help."""
    rows = [row for row in _explain_rows() if row[0] == section or row[0].startswith(section + ".") or not section]
    if not rows:
        raise ConfigError(section, "no such config field or section")
    return "\n".join(f"{name} = {default}\n" + textwrap.indent(help_text or "(no help)", "    ")
                     for name, default, help_text in rows)


def warm_start(cfg: KeelConfig, out: str | Path, env: EnvSpec | None = None, *, model: str | Path | None = None,
               run_dir: str | Path | None = None) -> Path:
    """Only the warm start of `cfg` (SFT on the scripted teacher's successful episodes), saved as
    a model directory at `out`; -> `out`. `env`, `model` and `run_dir` are the Trainer's: a user's
    EnvSpec warm-starts on its own teacher. Train several variants from it with `model=out` and
    `warm_start.demos=0`, so they differ only in what comes after."""
    from keelrl.train.trainer import Trainer

    out = Path(out)
    trainer = Trainer(cfg, env=env, model=model, run_dir=run_dir)
    trainer.warm_start()
    trainer.model.save_pretrained(out)
    trainer.tokenizer.save_pretrained(out)
    return out


__all__ = ["configure", "explain", "warm_start", "with_paths"]
