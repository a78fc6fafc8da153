"""Multi-turn text environments: the protocol, the registry of environment kinds, the coding
bug-fix tasks, the guessing game, reasoning-gym's datasets."""

from keelrl.envs.base import CheckResult, Env, Episode, Grade, Turn, VerifierError, check_env, run_episode
from keelrl.envs.registry import ENVIRONMENTS, EnvSpec, env_spec, register_env
from keelrl.envs.tasks import Check, Task, TaskError, load_tasks, save_tasks, split_of
from keelrl.envs.tools import STOP, ActionError, ToolCall, ToolSpec, parse_action


__all__ = [
    "ENVIRONMENTS", "STOP", "ActionError", "Check", "CheckResult", "Env", "EnvSpec", "Episode", "Grade", "Task",
    "TaskError", "ToolCall", "ToolSpec", "Turn", "VerifierError", "check_env", "env_spec", "load_tasks",
    "parse_action", "register_env", "run_episode", "save_tasks", "split_of",
]
