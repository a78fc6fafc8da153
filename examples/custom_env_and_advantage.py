"""Your own environment and your own advantage estimator, through the public API.

The environment: count the vowels of a word and answer `<call>answer N</call>`, graded 1 when N
is right (the protocol of keelrl.envs.base: reset, step, grade, max_turns; a malformed action
is an error observation, never a crash). `check_env` validates it before any training. It
comes into training as an `EnvSpec`: where its tasks come from, how to build it for training
and for held-out evaluation, and a scripted teacher for the warm start.

The advantage estimator: each episode's reward minus its group's median, a baseline that one
lucky attempt does not move. Registered under a name, it is then `algo.advantage=median_baseline`
like any built-in one, and the trainer calls it with the one signature every estimator has.

    python examples/custom_env_and_advantage.py         # the tiny model, a few minutes on CPU
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch

import keelrl
from keelrl.runs import read_metrics
from keelrl.algos.advantages import AdvantageOutput, trajectory_scores
from keelrl.envs.base import CheckResult, Grade
from keelrl.envs.registry import EnvSpec, split_tasks
from keelrl.envs.tools import ActionError, ToolSpec, describe_tools, parse_action

# ---------------------------------------------------------------------------------------- the environment

TOOLS = {"answer": ToolSpec("answer", "<call>answer N</call>", "your answer: the number of vowels", 1, 1)}
VOWELS = set("aeiou")


@dataclass(frozen=True)
class WordTask:
    id: str
    word: str

    @property
    def vowels(self) -> int:
        return sum(letter in VOWELS for letter in self.word)


def word_tasks(count: int = 600, seed: int = 0) -> list[WordTask]:
    rng = random.Random(seed)
    return [WordTask(f"word-{i:04d}", "".join(rng.choice("abcdefghijklmnoprstuvw") for _ in range(rng.randint(3, 8))))
            for i in range(count)]


class VowelEnv:
    """One question, one answer: the number of vowels in the task's word."""

    max_turns = 1

    def __init__(self) -> None:
        self.task: WordTask | None = None
        self.answer: int | None = None

    def reset(self, task: WordTask) -> str:
        self.task, self.answer = task, None
        return f"How many vowels (a, e, i, o, u) are in the word {task.word!r}?\n" + describe_tools(TOOLS)

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        try:
            call = parse_action(action_text, TOOLS, max_chars=200)
            if not call.args[0].isdigit():
                raise ActionError(f"error: N must be a whole number, got {call.args[0]!r}")
        except ActionError as error:
            return str(error), True, {"error": str(error).splitlines()[0], "termination": "max_turns"}
        self.answer = int(call.args[0])
        return f"you answered {self.answer}", True, {"tool": "answer", "termination": "submitted"}

    def grade(self) -> Grade:
        if self.task is None:
            raise RuntimeError("call reset(task) before grade()")
        right = self.answer == self.task.vowels
        detail = "" if right else f"expected {self.task.vowels}, got {self.answer}"
        return Grade(reward=float(right), checks=(CheckResult("count", right, detail),), verifier="vowels")


class VowelTeacher:
    """The warm start's scripted teacher: the right answer, and now and then a wrong one."""

    def __init__(self, seed: int = 0, mistake_rate: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.mistake_rate = mistake_rate

    def policy(self, task: WordTask) -> Any:
        count = task.vowels + (1 if self.rng.random() < self.mistake_rate else 0)
        return lambda observation, turns: f"<call>answer {count}</call>"


def make_env() -> VowelEnv:  # a module-level function: the training factory must pickle
    return VowelEnv()


VOWELS_ENV = EnvSpec(
    name="vowels",
    tasks=lambda cfg: split_tasks(word_tasks(seed=cfg.env.split_seed), cfg.env.split_seed, "vowels"),
    train_env=lambda cfg: make_env,
    eval_env=lambda cfg: make_env,
    teacher=lambda cfg: VowelTeacher(cfg.seed, cfg.warm_start.mistake_rate),
    answer_tools=("answer",),
    fields=("split_seed",),  # the env settings it reads; any other set is refused
    title="the vowel-counting environment")


# ---------------------------------------------------------------------------------------- the estimator

def median_baseline(*, token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                    values: torch.Tensor | None, turn_ids: torch.Tensor | None, cfg: Any) -> AdvantageOutput:
    """token_rewards [B, T] -> advantages [B, T]: the episode's score minus its group's median, at
    every action token."""
    scores = trajectory_scores(token_rewards, mask)  # [B]
    baseline = torch.empty_like(scores)
    for group in group_ids.unique():
        members = group_ids == group
        baseline[members] = scores[members].median()
    advantages = (scores - baseline)[:, None] * mask  # [B, T]
    return AdvantageOutput(advantages=advantages, returns=scores[:, None] * mask)


if "median_baseline" not in keelrl.ADVANTAGES:
    keelrl.ADVANTAGES.register("median_baseline", summary="r - group median", tags=("group",))(median_baseline)


# ---------------------------------------------------------------------------------------- the run

SMOKE = ["rollout.tasks_per_step=2", "rollout.group_size=2", "eval.tasks=4", "warm_start.demos=8",
         "warm_start.epochs=1", "train.minibatch_size=4"]
"""The test's size: a few tasks, one step (it checks that the example runs, not that it learns)."""


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/example-custom", help="run directory")
    parser.add_argument("--steps", type=int, default=10, help="RL steps")
    parser.add_argument("--model", default="tiny", help="a local HF model (default: the built-in tiny one)")
    parser.add_argument("--smoke", action="store_true", help="the test's tiny size")
    args = parser.parse_args(argv)

    # Validate the environment against the protocol before spending anything on it.
    task = word_tasks(1)[0]
    keelrl.check_env(VowelEnv(), task, good_actions=[f"<call>answer {task.vowels}</call>"])

    # TINY_RUN is the tiny model's coding recipe: its coding-only env settings go back to their defaults.
    cfg = keelrl.configure(None, *keelrl.TINY_RUN, "env.partial_credit=false", "env.show_file=true",
                           "env.name=vowels", "env.max_turns=1",
                           "rollout.max_new_tokens=16", "rollout.engine=sync", "warm_start.demos=256",
                           "warm_start.mistake_rate=0.2", "warm_start.epochs=3", "eval.tasks=100",
                           "algo.preset=grpo", "algo.advantage=median_baseline", f"train.steps={args.steps}",
                           f"eval.every={args.steps}", *(SMOKE if args.smoke else []))
    summary = keelrl.Trainer(cfg, env=VOWELS_ENV, model=args.model, run_dir=args.out).train()
    rows = read_metrics(args.out)
    trained = [row for row in rows if "train/reward" in row]
    print(f"held-out success: {summary['eval_success_before_rl']:.3f} after the warm start, "
          f"{summary['eval_success_after_rl']:.3f} after {len(trained)} steps with the median baseline; "
          f"training reward {trained[0]['train/reward']:.3f} -> {trained[-1]['train/reward']:.3f}")
    print(f"read the trajectories: keel view {args.out}")
    return summary


if __name__ == "__main__":
    main()
