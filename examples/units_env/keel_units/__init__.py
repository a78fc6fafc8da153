"""A unit-conversion agent, written as a keelrl user would write their own environment.

The agent is asked to convert a quantity ("Convert 3.5 km to m."). It has two tools, in
keelrl's tool-call format:

    <call>convert VALUE FROM TO</call>   the converted value, as the observation
    <call>answer VALUE</call>            the final answer; ends the episode

An episode has at most three turns (the environment's own `max_turns`). The verifier has two
checks: an answer was given, and it is within 1e-6 (relative) of the true value. The package
declares its environments under the `keelrl.envs` entry point group (pyproject.toml), so
`keel train env.name=units` finds it once it is installed, and so does every other `keel`
command; `env.name=keel_units:UNITS` (an import path) works without the entry point.

`lenient_spec()` is the same environment with a verifier that accepts any answer within 1.0 of
the true value, absolute: a hole `keel audit --env units_lenient` finds (small quantities make
a constant answer of 0 pass).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from keelrl.envs import ActionError, CheckResult, EnvSpec, Grade, ToolSpec, parse_action
from keelrl.envs.registry import split_tasks
from keelrl.envs.tools import describe_tools

FACTORS = {"m": 1.0, "km": 1000.0, "cm": 0.01, "mm": 0.001, "mi": 1609.344, "ft": 0.3048, "in": 0.0254}
"""Metres per unit."""

TOOLS = {
    "convert": ToolSpec("convert", "<call>convert VALUE FROM TO</call>",
                        f"convert VALUE from unit FROM to unit TO (units: {', '.join(FACTORS)})", 3, 3),
    "answer": ToolSpec("answer", "<call>answer VALUE</call>", "give the final answer; ends the episode", 1, 1),
}


@dataclass(frozen=True)
class UnitTask:
    id: str
    value: float
    source: str
    target: str

    @property
    def answer(self) -> str:
        """The reference answer, as the convert tool writes it."""
        return format_number(convert(self.value, self.source, self.target))


def convert(value: float, source: str, target: str) -> float:
    return value * FACTORS[source] / FACTORS[target]


def format_number(value: float) -> str:
    return f"{value:.10g}"


def make_tasks(count: int = 200, seed: int = 0) -> list[UnitTask]:
    rng = random.Random(seed)
    units = list(FACTORS)
    tasks = []
    for index in range(count):
        source, target = rng.sample(units, 2)
        value = round(rng.uniform(0.1, 20.0), 1)
        tasks.append(UnitTask(f"units-{index:04d}", value, source, target))
    return tasks


class UnitsEnv:
    """Convert a quantity with the convert tool, then answer (module docstring)."""

    max_turns = 3

    def __init__(self, tolerance: Callable[[float, float], bool]) -> None:
        self.close_enough = tolerance
        self.task: UnitTask | None = None
        self.answer: str | None = None
        self.turn = 0

    def reset(self, task: UnitTask) -> str:
        self.task, self.answer, self.turn = task, None, 0
        return f"Convert {task.value:g} {task.source} to {task.target}. Answer with the number only.\n" \
               f"{describe_tools(TOOLS)}"

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        self.turn += 1
        try:
            call = parse_action(action_text, TOOLS)
            if call.name == "convert":
                value, source, target = call.args
                if source not in FACTORS or target not in FACTORS:
                    raise ActionError(f"error: unknown unit; units: {', '.join(FACTORS)}")
                try:
                    number = float(value)
                except ValueError:
                    raise ActionError(f"error: VALUE must be a number, got {value!r}") from None
                observation, done, info = format_number(convert(number, source, target)), False, {"tool": "convert"}
            else:
                self.answer = call.args[0]
                observation, done, info = "answered.", True, {"tool": "answer", "termination": "submitted"}
        except ActionError as error:
            observation, done, info = str(error), False, {"error": str(error).splitlines()[0]}
        if not done and self.turn >= self.max_turns:
            observation += "\nturn limit reached."
            done, info["termination"] = True, "max_turns"
        return observation, done, info

    def grade(self) -> Grade:
        assert self.task is not None
        truth = convert(self.task.value, self.task.source, self.task.target)
        answered = self.answer is not None
        try:
            given = float(self.answer) if answered else math.nan
        except ValueError:
            given = math.nan
        correct = math.isfinite(given) and self.close_enough(given, truth)
        checks = (CheckResult("answered", answered, "" if answered else "no answer"),
                  CheckResult("value", correct, "" if correct else f"expected {format_number(truth)}, got {self.answer!r}"))
        return Grade(float(correct), checks, "units")


def strict(given: float, truth: float) -> bool:
    return math.isclose(given, truth, rel_tol=1e-6, abs_tol=1e-9)


def lenient(given: float, truth: float) -> bool:
    return abs(given - truth) <= 1.0


class UnitsFactory:
    """Picklable: Ray rollout workers call it in their own processes."""

    def __init__(self, tolerance: Callable[[float, float], bool] = strict) -> None:
        self.tolerance = tolerance

    def __call__(self) -> UnitsEnv:
        return UnitsEnv(self.tolerance)


class UnitsTeacher:
    """Convert, then answer with what the tool said: the warm start's demonstrations."""

    def policy(self, task: UnitTask) -> Callable[[str, Sequence[Any]], str]:
        def act(prompt: str, turns: Sequence[Any]) -> str:
            if not turns:
                return f"<call>convert {task.value:g} {task.source} {task.target}</call>"
            return f"<call>answer {turns[-1].observation.strip()}</call>"
        return act


def _tasks(cfg: Any) -> tuple[list[UnitTask], list[UnitTask]]:
    return split_tasks(make_tasks(), cfg.env.split_seed, "keel_units.make_tasks()")


def _spec(name: str, tolerance: Callable[[float, float], bool]) -> EnvSpec:
    return EnvSpec(name=name, tasks=_tasks, train_env=lambda cfg: UnitsFactory(tolerance),
                   eval_env=lambda cfg: UnitsFactory(tolerance), teacher=lambda cfg: UnitsTeacher(),
                   answer_tools=("answer",), tools=TOOLS, fields=("split_seed",), title="the units environment")


UNITS = _spec("units", strict)
"""The unit-conversion environment (entry point `units`)."""


def lenient_spec() -> EnvSpec:
    """The same environment with a verifier that has a hole (entry point `units_lenient`)."""
    return _spec("units_lenient", lenient)
