"""reasoning-gym's procedural datasets as keelrl environments (`env.name=reasoning_gym env.dataset=NAME`).

Each task is one entry of a reasoning-gym dataset (`reasoning_gym.create_dataset(NAME,
size=env.rg_size, seed=env.rg_seed)`), split into train and held-out by `split_of(task.id,
env.split_seed)`. The first observation is the entry's question and one line saying how to
answer; the agent answers with one tool call, and the answer ends the episode:

    <call>answer 42</call>
    <call>answer
    1 2 3
    4 5 6</call>

That is the call format; in another `tool_format` (keelrl.envs.formats) the answer is the `answer`
tool's `answer` argument, e.g. <tool_call>{"name": "answer", "arguments": {"answer": "42"}}</tool_call>
in hermes, and the first observation shows the call in that format.

The answer is the call's text after the word `answer`, first line and body together, exactly as
written (runs of spaces inside it are kept) but for surrounding white space, which is stripped:
reasoning-gym's default scorer gives " 42 " half marks, a formatting accident no model should be
trained against. Anything else (no call, another tool, an empty answer, a call over
`max_action_chars`) is an error observation that costs a turn; after `max_turns` turns without an
answer the episode ends, unanswered.

The verifier is the dataset's own scoring, `dataset.score_answer(answer, entry)`, a number in
[0, 1] (an unanswered episode scores 0 without asking it). reward = the score, whatever
env.partial_credit says. The Grade's checks carry the score as weights, so that keelrl's partial
credit is the score and strict success is a perfect score:

    score 1        answer_credit (passed, weight 1)                              success, partial 1
    score s < 1    answer_credit (passed, weight s) + answer_shortfall (failed,  no success, partial s
                   weight 1 - s); s = 0: answer_shortfall alone (failed, weight 1)

Training and held-out evaluation grade alike (the only verifier is `strong`). A score_answer that
raises, or returns anything but a number in [0, 1], raises VerifierError: never a made-up reward.
A score within `SCORE_TOLERANCE` of 0 or 1 is taken as 0 or 1: float rounding (spell_backward adds
1/n n times and returns 1.0000000000000002 or 0.9999999999999999 for a perfect prefix).

The scripted teacher writes the entry's reference answer (entry["answer"]); datasets whose entries
have none (their answers are checked by simulation) cannot warm-start. reasoning-gym is imported
only when a dataset is used, so keelrl works without it; asking for one without it installed is a
ConfigError saying how to install it.

What it does NOT guarantee: that a dataset's scorer is sound (some give partial credit to an answer
that merely contains the reference; `keel audit --env reasoning_gym` probes for full marks), nor
that the tasks are distinct (a small dataset may generate one question twice, on both sides of
the split).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from keelrl.envs.base import CheckResult, Grade, VerifierError
from keelrl.envs.formats import CallFormat, format_of
from keelrl.envs.tools import OPEN, STOP, ActionError, ToolCall, ToolSpec
from keelrl.errors import ConfigError

ANSWER_TOOL = "answer"
RG_TOOLS = {ANSWER_TOOL: ToolSpec(ANSWER_TOOL, "<call>answer ANSWER</call>",
                                  "give your final answer (a multi-line one continues on the next lines)",
                                  0, 1 << 30, body="optional", body_param="answer",
                                  param_descriptions={"answer": "your final answer"})}
"""The answer tool. In the call format the answer is the words after its name (and the body); the
JSON formats pass it as the argument `answer` (the tool names no positional parameters)."""
RG_VERIFIERS = ("strong",)
"""The one verifier: the dataset's own score_answer (training and held-out alike)."""
INSTALL_HINT = "pip install 'keelrl[reasoning-gym]'"
SCORE_TOLERANCE = 1e-9
"""A score this close to 0 or 1 is float rounding and counts as 0 or 1; farther outside [0, 1] is a
VerifierError."""


def import_reasoning_gym() -> Any:
    """The reasoning_gym module; ConfigError (on env.name) with the install command when it is missing."""
    try:
        import reasoning_gym
    except ImportError as error:
        raise ConfigError("name", f"env.name=reasoning_gym needs the reasoning-gym package ({error}): "
                                  f"{INSTALL_HINT}") from None
    return reasoning_gym


def dataset_names() -> list[str]:
    """The names in reasoning-gym's dataset registry, sorted."""
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_dataset(name: str) -> None:
    """ConfigError (field "dataset", or "name" without the package) unless reasoning-gym registers `name`."""
    import_reasoning_gym()
    names = dataset_names()
    if not name:
        raise ConfigError("dataset", f"env.name=reasoning_gym needs env.dataset=NAME, one of {len(names)} "
                                     f"reasoning-gym datasets, e.g. {', '.join(names[:12])}, ...")
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        guess = f"did you mean {' or '.join(close)}? " if close else ""
        raise ConfigError("dataset", f"unknown reasoning-gym dataset {name!r}; {guess}valid names ({len(names)}): "
                                     f"{', '.join(names)}")


def create_dataset(name: str, size: int, seed: int) -> Any:
    """reasoning_gym.create_dataset(name, size=size, seed=seed), the name checked first."""
    check_dataset(name)
    return import_reasoning_gym().create_dataset(name, size=size, seed=seed)


@dataclass(frozen=True, eq=False)
class ReasoningGymTask:
    """Entry `index` of dataset `dataset` (generated with `seed`)."""

    id: str
    dataset: str
    index: int
    question: str
    answer: str | None
    """The entry's reference answer (None: the dataset has none and scores by checking)."""
    entry: dict[str, Any] = field(repr=False)
    """The whole entry (question, answer, metadata): what score_answer reads."""

    @property
    def kind(self) -> str:
        """The held-out report's group: the dataset."""
        return self.dataset


def rg_tasks(dataset: str, size: int, seed: int) -> list[ReasoningGymTask]:
    """The `size` entries of `dataset` generated with `seed`, as tasks with ids rg-NAME-SEED-INDEX."""
    data = create_dataset(dataset, size, seed)
    tasks = []
    for index in range(size):
        entry = data[index]
        answer = entry.get("answer")
        tasks.append(ReasoningGymTask(id=f"rg-{dataset}-{seed}-{index:05d}", dataset=dataset, index=index,
                                      question=str(entry["question"]), answer=None if answer is None else str(answer),
                                      entry=entry))
    return tasks


def answer_text(action_text: str, max_chars: int = 16_000, tool_format: str = "call") -> str:
    """The answer an action gives (see the module docstring), or ActionError with the observation."""
    fmt = format_of(tool_format)
    call = fmt.parse(action_text, RG_TOOLS, max_chars=max_chars)  # exactly one well-formed answer call
    if isinstance(fmt, CallFormat):  # the text as written: its words are not split into arguments
        start = action_text.find(OPEN) + len(OPEN)
        inner = action_text[start:action_text.find(STOP, start)].lstrip()
        answer = inner[len(ANSWER_TOOL):].strip()
    else:
        answer = call.body.strip()
    if not answer:
        raise ActionError(f"error: the answer is empty; usage: {fmt.usage(RG_TOOLS[ANSWER_TOOL])}")
    return answer


def answer_action(answer: str, tool_format: str = "call") -> str:
    """The tool call that gives `answer`, in `tool_format` (the call format: `<call>answer ANSWER</call>`,
    the answer right after the tool's name, as written)."""
    fmt = format_of(tool_format)
    if isinstance(fmt, CallFormat):
        return f"{OPEN}{ANSWER_TOOL} {answer}{STOP}"
    return fmt.render(ToolCall(ANSWER_TOOL, (), answer), RG_TOOLS)


def score_grade(score: float, verifier: str, detail: str = "") -> Grade:
    """The Grade of a score in [0, 1] (the module docstring's table)."""
    if score >= 1.0:
        return Grade(reward=1.0, checks=(CheckResult("answer_credit", True, detail, 1.0),), verifier=verifier)
    shortfall = CheckResult("answer_shortfall", False, detail or f"score {score:g} of 1", 1.0 - score)
    if score <= 0.0:
        return Grade(reward=0.0, checks=(shortfall,), verifier=verifier)
    return Grade(reward=score, checks=(CheckResult("answer_credit", True, f"score {score:g}", score), shortfall),
                 verifier=verifier)


class ReasoningGymEnv:
    """Answer one reasoning-gym question, scored by the dataset (see the module docstring)."""

    tools = RG_TOOLS

    def __init__(self, dataset: Any, *, max_turns: int = 1, show_tools: bool = False,
                 max_action_chars: int = 16_000, tool_format: str = "call") -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        format_of(tool_format)  # an unknown name fails here, listing the valid ones
        self.dataset = dataset
        self.max_turns = max_turns
        self.show_tools = show_tools
        """The rollout shows the tool in the first prompt (`keelrl.envs.formats.prompt_tools`)."""
        self.tool_format = tool_format
        self.max_action_chars = max_action_chars
        self.task: ReasoningGymTask | None = None
        self.answer: str | None = None
        self.turns = 0
        self.done = False

    def reset(self, task: ReasoningGymTask) -> str:
        self.task, self.answer, self.turns, self.done = task, None, 0, False
        return f"{task.question}\nGive your final answer as {answer_action('ANSWER', self.tool_format)}."

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        if self.task is None:
            raise RuntimeError("call reset(task) before step()")
        if self.done:
            raise RuntimeError("the episode is over; call reset(task) to start another")
        self.turns += 1  # a malformed action costs a turn too
        try:
            self.answer = answer_text(action_text, self.max_action_chars, self.tool_format)
        except ActionError as error:
            observation, info = str(error), {"error": str(error).splitlines()[0]}
        else:
            observation, info = "answer recorded.", {"tool": ANSWER_TOOL}
        self.done = self.answer is not None or self.turns >= self.max_turns
        if self.done:
            info["termination"] = "submitted" if self.answer is not None else "max_turns"
        return observation, self.done, info

    def score(self) -> float:
        """The dataset's score of the answer given (0 when there is none); VerifierError if it fails."""
        if self.task is None:
            raise RuntimeError("call reset(task) before grade()")
        if self.answer is None:
            return 0.0
        try:
            score = self.dataset.score_answer(self.answer, self.task.entry)
        except Exception as error:  # noqa: BLE001 - the verifier failed: reported, never a zero reward
            raise VerifierError(f"{self.task.dataset}.score_answer raised {error!r} on {self.task.id}") from error
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) \
                or not -SCORE_TOLERANCE <= score <= 1.0 + SCORE_TOLERANCE:
            raise VerifierError(f"{self.task.dataset}.score_answer returned {score!r} on {self.task.id}; "
                                f"expected a number in [0, 1]")
        for whole in (0.0, 1.0):
            if abs(score - whole) <= SCORE_TOLERANCE:
                return whole
        return float(score)

    def grade(self) -> Grade:
        score = self.score()
        assert self.task is not None
        if self.answer is None:
            detail = "no answer given"
        elif score < 1.0:
            detail = f"score {score:g} of 1 for {self.answer[:100]!r}"
            if self.task.answer is not None:
                detail += f" (reference {self.task.answer[:100]!r})"
        else:
            detail = ""
        return score_grade(score, f"reasoning_gym:{self.task.dataset}", detail)


class ReasoningGymEnvFactory:
    """A picklable `make_env` for ReasoningGymEnv: each process builds the dataset once, on first use."""

    def __init__(self, dataset: str, size: int, seed: int, *, max_turns: int = 1, show_tools: bool = False,
                 tool_format: str = "call") -> None:
        format_of(tool_format)  # an unknown name fails here, listing the valid ones
        self.dataset, self.size, self.seed = dataset, size, seed
        self.max_turns, self.show_tools, self.tool_format = max_turns, show_tools, tool_format
        self._data: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_data": None}

    def __call__(self) -> ReasoningGymEnv:
        if self._data is None:
            self._data = create_dataset(self.dataset, self.size, self.seed)
        return ReasoningGymEnv(self._data, max_turns=self.max_turns, show_tools=self.show_tools,
                               tool_format=self.tool_format)


class ReferenceAnswerTeacher:
    """The warm start's teacher: answers with the entry's reference answer, first turn, in `tool_format`."""

    def __init__(self, tool_format: str = "call") -> None:
        format_of(tool_format)  # an unknown name fails here, listing the valid ones
        self.tool_format = tool_format

    def policy(self, task: ReasoningGymTask) -> Callable[[str, Sequence[Any]], str]:
        """A `Policy` callable for one episode of `task`; ValueError when the entry has no reference."""
        if task.answer is None:
            raise ValueError(f"reasoning-gym dataset {task.dataset!r} gives no reference answer ({task.id}): "
                             f"its answers are checked, not compared; set warm_start.demos=0")
        action = answer_action(task.answer, self.tool_format)
        return lambda prompt, turns: action
