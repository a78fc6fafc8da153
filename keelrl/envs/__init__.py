"""Multi-turn text environments: the protocol, the registry of environment kinds, the coding
bug-fix tasks, the guessing game, reasoning-gym's datasets."""

from typing import TYPE_CHECKING, Any

from keelrl.envs.base import CheckResult, Env, Episode, Grade, Turn, VerifierError, check_env, run_episode
from keelrl.envs.tasks import Check, Task, TaskError, load_tasks, save_tasks, split_of
from keelrl.envs.tools import STOP, ActionError, ToolCall, ToolSpec, parse_action

if TYPE_CHECKING:
    from keelrl.envs.registry import ENVIRONMENTS, EnvSpec, env_spec, register_env

_REGISTRY = ("ENVIRONMENTS", "EnvSpec", "env_spec", "register_env")


def __getattr__(name: str) -> Any:
    # The registry is imported on first use: it names the coding verifiers, and keelrl.verifiers
    # imports this package, so importing the registry here would be circular.
    if name in _REGISTRY:
        from keelrl.envs import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'keelrl.envs' has no attribute {name!r}")


__all__ = [
    "ENVIRONMENTS", "STOP", "ActionError", "Check", "CheckResult", "Env", "EnvSpec", "Episode", "Grade", "Task",
    "TaskError", "ToolCall", "ToolSpec", "Turn", "VerifierError", "check_env", "env_spec", "load_tasks",
    "parse_action", "register_env", "run_episode", "save_tasks", "split_of",
]
