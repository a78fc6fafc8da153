"""The run's named components, checked against their registries where they are resolved.

A config names its components by string: the environment (`env.name`), the critic
(`model.critic`), the rollout engine (`rollout.engine`), the alarms that stop a run
(`monitor.stop_on`), the metric sinks (`log.sinks`) and the algorithm's parts (`algo.*`, checked
by `keelrl.algos` as an `AlgoConfig` is built). `keelrl.config` only parses and checks values;
`check(cfg)` looks every name up in its registry and checks the environment section against the
chosen kind, raising `ConfigError` naming the dotted field; model.path must name something
loadable (a registered name, a model directory, a .gguf file), with a did-you-mean when not. The trainer calls it before any
model loads, and so do `keel config` and `keelrl.configure`. `explain()` is the config's field
table with each component field's registered choices.
"""

from __future__ import annotations

from typing import Any


from keelrl.algos import AlgoConfig
from keelrl.algos.catalogue import choices_for
from keelrl.alarms import ALARMS
from keelrl.config import KeelConfig, LogConfig, ModelConfig, MonitorConfig, RolloutSettings, field_rows
from keelrl.envs.registry import EnvSpec, resolve_env
from keelrl.errors import ConfigError
from keelrl.inference import DECODERS
from keelrl.policy.critic import CRITICS
from keelrl.policy.download import ModelPathError, check_model_path
from keelrl.registry import Registry
from keelrl.rollout.build import ENGINES
from keelrl.serve import engine as _endpoint_engine  # noqa: F401  (registers rollout.engine=endpoint)
from keelrl.sinks import SINKS


def check(cfg: KeelConfig, env: EnvSpec | None = None) -> EnvSpec:
    """Every component `cfg` names, looked up (module docstring); -> the run's environment
    (`env` when given, else the one registered as env.name). Raises ConfigError."""
    CRITICS.check(cfg.model.critic, "model.critic")
    ENGINES.check(cfg.rollout.engine, "rollout.engine")
    DECODERS.check(cfg.rollout.decoder, "rollout.decoder")
    unknown = [name for name in cfg.monitor.stop_on if name not in (*ALARMS, "any")]
    if unknown:
        raise ConfigError("monitor.stop_on", f"unknown alarm(s) {unknown}; valid names: {', '.join(ALARMS)}, any")
    unknown = [name for name in cfg.log.sinks if name not in SINKS]
    if unknown:
        raise ConfigError("log.sinks", f"unknown sink(s) {unknown}; valid names: {', '.join(SINKS)}")
    spec = resolve_env(cfg, env)
    if cfg.rollout.engine == "endpoint":
        _endpoint_engine.check_settings(cfg)
    try:
        check_model_path(cfg.model.path)
    except ModelPathError as error:
        raise ConfigError("model.path", str(error)) from None
    return spec


def choices(cls: type, name: str) -> list[str]:
    """Valid values of field `name` of config section `cls` when it names a registered component, else []."""
    registries: dict[tuple[type, str], Registry[Any]] = {
        (ModelConfig, "critic"): CRITICS, (RolloutSettings, "engine"): ENGINES,
        (RolloutSettings, "decoder"): DECODERS, (LogConfig, "sinks"): SINKS,
        (MonitorConfig, "stop_on"): ALARMS}
    if cls is AlgoConfig:
        return choices_for(name)
    registry = registries.get((cls, name))
    return registry.names() if registry is not None else []


def explain(cls: type = KeelConfig) -> list[tuple[str, str, str]]:
    """(dotted field, default, help) for every leaf field of the config, with each component
    field's choices read from its registry."""
    rows = []
    for path, section, f, default, help_text in field_rows(cls):
        options = choices(section, f.name)
        rows.append((path, default, help_text + (f" Choices: {', '.join(options)}." if options else "")))
    return rows


__all__ = ["check", "choices", "explain"]
