"""Multi-turn text environments: the protocol, the coding bug-fix tasks, the guessing game."""

from keelrl.envs.base import CheckResult, Env, Episode, Grade, Turn, VerifierError, check_env, run_episode
from keelrl.envs.tasks import Check, Task, TaskError, load_tasks, save_tasks, split_of
from keelrl.envs.tools import STOP, ActionError, ToolCall, ToolSpec, parse_action

__all__ = [
    "STOP", "ActionError", "Check", "CheckResult", "Env", "Episode", "Grade", "Task", "TaskError",
    "ToolCall", "ToolSpec", "Turn", "VerifierError", "check_env", "load_tasks", "parse_action",
    "run_episode", "save_tasks", "split_of",
]
