"""keelrl: reinforcement learning for LLM agents, for when the simple recipe breaks.

The Python API in three lines (`keelrl.api`):

    import keelrl
    trainer = keelrl.Trainer(keelrl.configure("configs/tiny.yaml", "train.steps=2"), model="tiny")
    summary = trainer.train()

Names here load on first use, so `import keelrl` (and the `keel` command) stays quick.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "configure": ("keelrl.api", "configure"),
    "explain": ("keelrl.api", "explain"),
    "warm_start": ("keelrl.api", "warm_start"),
    "KeelConfig": ("keelrl.config", "KeelConfig"),
    "TINY_RUN": ("keelrl.config", "TINY_RUN"),
    "ConfigError": ("keelrl.errors", "ConfigError"),
    "Trainer": ("keelrl.train.trainer", "Trainer"),
    "ADVANTAGES": ("keelrl.algos.registries", "ADVANTAGES"),
    "POLICY_LOSSES": ("keelrl.algos.registries", "POLICY_LOSSES"),
    "RATIOS": ("keelrl.algos.registries", "RATIOS"),
    "check_env": ("keelrl.envs.base", "check_env"),
    "EnvSpec": ("keelrl.envs.registry", "EnvSpec"),
    "register_env": ("keelrl.envs.registry", "register_env"),
    "Grade": ("keelrl.envs.base", "Grade"),
    "CheckResult": ("keelrl.envs.base", "CheckResult"),
}

__all__ = ["__version__"]
__all__ += list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'keelrl' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
