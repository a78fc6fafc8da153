"""Several environments in one run: `env.mix`, an `EnvSpec` composed of other specs.

    env.mix=[guess:3, units]              the guessing game, weight 3, and the `units` entry
                                          point, weight 1 (env.name becomes mix)
    env.mix=[coding, keel_units:UNITS:0.5]  an import path: the weight follows the LAST colon,
                                          and only when what follows it is a number

Each entry names an environment as env.name would (`keelrl.envs.registry.env_spec`). The mix is
itself an `EnvSpec` (`resolve_env` builds it from `mix_parts` and `mix_spec_fields`), so the
trainer, the rollout engines, the warm start and the evaluation run it without a special case.
What the mix guarantees:

- Tasks: every part's own (train, held-out) split, each task wrapped as a `MixTask` whose id is
  "PART/ID" (unique across parts) and whose kind is the inner task's (else the part's name). The
  train tasks are interleaved in proportion to the weights (the warm start's first demos cover the
  parts so), the held-out tasks in turn (the first eval.tasks of them cover every part alike).
- Weights: `EnvSpec.weights` gives each part's weight shared among its train tasks; each step
  draws its tasks in proportion (keelrl.train.requests), so over many steps a part's share of
  the groups is its share of the weights. Within one step tasks are drawn without replacement,
  which tilts a step towards the parts with many tasks by about tasks_per_step / (a part's
  train tasks): negligible unless a part has only a handful of tasks.
- Groups never mix environments: a group is one task's attempts (keelrl.train.requests), and a
  task belongs to one part.
- Verifier: env.verifier must be one every part accepts (`EnvSpec.verifiers`: the intersection;
  strong always is). Held-out evaluation uses each part's strong verifier, as alone.
- The env section: a field is accepted when some part reads it (`EnvSpec.fields`, their union),
  and it applies to every part that reads it (env.split_seed splits every part that has one);
  a field no part reads is an error naming it, as for one environment. Each part's own checks run.
- Turn limits: env.max_turns is the run's (the scheduler's) limit; unset, it is the largest of
  the parts' own. A part whose limit follows env.max_turns (one declaring `EnvSpec.max_turns`:
  the built-in kinds) is built with it; a part with a fixed limit of its own keeps it, and must
  not exceed env.max_turns. The mix's environment ends a part's episode at that part's limit
  (info["termination"] = "max_turns"), whether or not the part's environment does.
- Figures: `family(task)` is the part's name, or "PART/FAMILY" for a part with families (coding),
  so the held-out report, eval/success_<family> and summary.json's rl_lift give each environment
  its own figures.
- Teacher: the parts' teachers, by the task's part; none unless every part has one (then
  warm_start.demos must be 0). The own-mistakes round continues the tasks of parts whose teacher
  has `recovery`.
- Tools: the union of the parts' (`answer_tools`: where a part declares none, all its tools
  count; where one declares neither, every action counts, for every part). `test_tool` is the
  parts' one test tool when they name at most one, else none (the agent metrics then count no
  test runs). `hidden_paths`: the union of the parts'.

Not guaranteed: a part's own audit probes (`EnvSpec.probes`) do not run on a mix (`keel audit`
on each part does); two parts with one name (the same environment twice) are an error, so one
environment with two settings (two reasoning-gym datasets) cannot be mixed with itself.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from keelrl.envs.base import Grade
from keelrl.errors import ConfigError

if TYPE_CHECKING:  # the registry builds the mix's EnvSpec (resolve_env): it imports this module, not the reverse
    from keelrl.config import EnvConfig, KeelConfig
    from keelrl.envs.registry import DemoTeacher, EnvFactory, EnvSpec

MIX_NAME = "mix"
"""The mix's `EnvSpec.name`: env.name of a run with env.mix set."""


@dataclass(frozen=True)
class MixPart:
    """One environment of a mix and its sampling weight."""

    spec: EnvSpec
    weight: float = 1.0

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class MixTask:
    """A task of part `env` of a mix: `task`, one of that environment's own."""

    env: str
    task: Any

    @property
    def id(self) -> str:
        """"PART/ID": unique across the parts."""
        return f"{self.env}/{self.task.id}"

    @property
    def kind(self) -> str:
        """The inner task's kind (the curriculum's levels and the held-out report's by_kind read
        it), else the part's name."""
        kind = getattr(self.task, "kind", None)
        return kind if isinstance(kind, str) and kind else self.env


# ------------------------------------------------------------------------------ config

def parse_entry(entry: str) -> tuple[str, float]:
    """(name, weight) of an env.mix entry NAME:WEIGHT or NAME (weight 1). The weight follows the
    last colon, and only when it parses as a number: "keel_units:UNITS" is an import path of
    weight 1, "keel_units:UNITS:0.5" that path with weight 0.5. ConfigError on env.mix otherwise."""
    text = entry.strip() if isinstance(entry, str) else ""
    if not text:
        raise ConfigError("env.mix", f"an entry is {entry!r}; write NAME or NAME:WEIGHT, e.g. guess:3")
    name, colon, tail = text.rpartition(":")
    if not colon:
        return text, 1.0
    try:
        weight = float(tail)
    except ValueError:  # MODULE:ATTRIBUTE, an import path without a weight
        return text, 1.0
    if not name:
        raise ConfigError("env.mix", f"entry {entry!r} has a weight but no environment; write NAME:WEIGHT")
    if not (math.isfinite(weight) and weight > 0):
        raise ConfigError("env.mix", f"entry {entry!r}: the weight must be a finite number > 0, got {tail!r}")
    return name, weight


def mix_parts(entries: Sequence[str], lookup: Callable[[str], EnvSpec]) -> list[MixPart]:
    """The parts env.mix describes: each entry parsed (`parse_entry`) and its name looked up by
    `lookup` (`env_spec`, as env.name is); ConfigError on env.mix for a bad entry, an unknown
    name or an environment twice."""
    if not entries:
        raise ConfigError("env.mix", "is empty; list the environments to mix, e.g. [guess:3, units]")
    parts: list[MixPart] = []
    for entry in entries:
        name, weight = parse_entry(entry)
        try:
            spec = lookup(name)
        except ConfigError as error:
            raise ConfigError("env.mix", f"entry {entry!r}: {error.message}") from None
        if spec.name == MIX_NAME:
            raise ConfigError("env.mix", f"entry {entry!r} is a mix itself; list its environments instead")
        twice = [part.name for part in parts if part.name == spec.name]
        if twice:
            raise ConfigError("env.mix", f"entry {entry!r} names {spec.name!r} again; each environment "
                                         f"appears once (give it one weight)")
        parts.append(MixPart(spec, weight))
    return parts


# ------------------------------------------------------------------------------ environments

def part_config(cfg: KeelConfig, spec: EnvSpec) -> KeelConfig:
    """The config a part is built from: `cfg`, with env.max_turns at the part's declared limit
    where it is unset (as `settle_env` would settle it for that part alone)."""
    if cfg.env.max_turns is not None or spec.max_turns is None:
        return cfg
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, max_turns=spec.max_turns))


def part_limit(spec: EnvSpec, cfg: KeelConfig, factory: EnvFactory) -> int:
    """A part's own turn limit in a mix built from `cfg` (module docstring): env.max_turns for a
    part declaring `EnvSpec.max_turns`, else its environments' own, which must not exceed a set
    env.max_turns. ConfigError on env.max_turns otherwise."""
    built = part_config(cfg, spec)
    if spec.max_turns is not None:
        assert built.env.max_turns is not None  # part_config settles it
        return built.env.max_turns
    env = factory()
    try:
        own = getattr(env, "max_turns", None)
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()
    if isinstance(own, bool) or not isinstance(own, int) or own < 1:
        raise ConfigError("env.max_turns", f"{spec.label}'s environments have max_turns={own!r}, not a positive "
                                           f"int: give them one, or declare EnvSpec(max_turns=...)")
    given = cfg.env.max_turns
    if given is not None and own > given:
        raise ConfigError("env.max_turns", f"env.max_turns={given}, but the environments of {spec.label} have "
                                           f"max_turns={own}; in a mix each environment's own limit must be at "
                                           f"most env.max_turns: leave it unset (the largest of the parts' own) "
                                           f"or raise it")
    return own


class MixEnv:
    """One episode's environment in a mix: `reset(task)` picks the part's environment by the
    `MixTask`'s part (made on first use, then reused), and steps and grading go to it. The part's
    own turn limit ends its episodes. Other attributes (tools, show_tools, tool_format,
    read_only_tools) are the current part env's."""

    def __init__(self, factories: Mapping[str, EnvFactory], limits: Mapping[str, int]) -> None:
        self.factories, self.limits = factories, limits
        self.envs: dict[str, Any] = {}
        self.part: str | None = None
        self.current: Any = None
        """The part's environment of the current episode (None before the first reset)."""
        self.turns = 0
        self.max_turns = max(limits.values())
        """The current episode's part's limit (set by `reset`); before the first reset, the largest
        of the parts' (the run's limit, which `settle_env` reads)."""

    def reset(self, task: Any) -> str:
        if not isinstance(task, MixTask):
            raise TypeError(f"a mix's environment takes the mix's tasks (MixTask), got {type(task).__name__}")
        if task.env not in self.factories:
            raise KeyError(f"task {task.id!r} is of environment {task.env!r}, not one of the mix's: "
                           f"{', '.join(self.factories)}")
        if task.env not in self.envs:
            self.envs[task.env] = self.factories[task.env]()
        self.part, self.current, self.turns = task.env, self.envs[task.env], 0
        self.max_turns = self.limits[task.env]
        return self.current.reset(task.task)

    def step(self, action_text: str) -> tuple[str, bool, dict]:
        if self.current is None or self.part is None:
            raise RuntimeError("step before reset")
        observation, done, info = self.current.step(action_text)
        self.turns += 1
        if not done and self.turns >= self.max_turns:  # the part's own limit, at most the run's
            return observation, True, {**info, "termination": "max_turns"}
        return observation, done, info

    def grade(self) -> Grade:
        if self.current is None:
            raise RuntimeError("grade before reset")
        grade: Grade = self.current.grade()
        return grade

    def close(self) -> None:
        for env in self.envs.values():
            close = getattr(env, "close", None)
            if callable(close):
                close()

    def __getattr__(self, name: str) -> Any:
        current = self.__dict__.get("current")  # not self.current: no recursion before __init__ ran
        if current is None:
            raise AttributeError(name)
        return getattr(current, name)


class MixEnvFactory:
    """A picklable factory of `MixEnv`s over the parts' own factories (picklable themselves)."""

    def __init__(self, factories: Mapping[str, EnvFactory], limits: Mapping[str, int]) -> None:
        self.factories, self.limits = dict(factories), dict(limits)
        self.max_turns = max(self.limits.values())

    def __call__(self) -> MixEnv:
        return MixEnv(self.factories, self.limits)


def _mix_env(parts: Sequence[MixPart], cfg: KeelConfig, training: bool) -> MixEnvFactory:
    factories: dict[str, EnvFactory] = {}
    limits: dict[str, int] = {}
    for part in parts:
        build = part.spec.train_env if training else part.spec.eval_env
        factories[part.name] = build(part_config(cfg, part.spec))
        limits[part.name] = part_limit(part.spec, cfg, factories[part.name])
    return MixEnvFactory(factories, limits)


# ------------------------------------------------------------------------------ teachers

class MixTeacher:
    """The parts' scripted teachers, each playing its own part's tasks."""

    def __init__(self, teachers: Mapping[str, DemoTeacher]) -> None:
        self.teachers = dict(teachers)

    def policy(self, task: MixTask) -> Any:
        return self.teachers[task.env].policy(task.task)


class MixRecoveryTeacher(MixTeacher):
    """A `MixTeacher` some of whose parts' teachers can continue from a student's action
    (`recovery`): theirs continue their parts' tasks, the others' none."""

    def __init__(self, teachers: Mapping[str, DemoTeacher]) -> None:
        super().__init__(teachers)
        self.recovery_turns = min(getattr(teacher, "recovery_turns", 1) for teacher in self.teachers.values()
                                  if hasattr(teacher, "recovery"))
        """The fewest turns any part's continuation takes (the own-mistakes round needs room for it)."""

    def recovery(self, task: MixTask, first_action: str, env: MixEnv) -> Any:
        teacher = self.teachers[task.env]
        if not hasattr(teacher, "recovery"):
            return None
        return teacher.recovery(task.task, first_action, env.current)


def _mix_teacher(parts: Sequence[MixPart], cfg: KeelConfig) -> DemoTeacher:
    teachers: dict[str, DemoTeacher] = {}
    for part in parts:
        assert part.spec.teacher is not None  # the mix has a teacher only when every part has one
        teachers[part.name] = part.spec.teacher(part_config(cfg, part.spec))
    if any(hasattr(teacher, "recovery") for teacher in teachers.values()):
        return MixRecoveryTeacher(teachers)
    return MixTeacher(teachers)


# ------------------------------------------------------------------------------ tasks

def interleave(groups: Sequence[Sequence[Any]], weights: Sequence[float]) -> list[Any]:
    """The items of `groups`, each group's in its order, interleaved in proportion to `weights`
    by smooth weighted round robin (each turn the group furthest behind its share goes next; ties
    to the first), a group left out once it runs out."""
    positions = [0] * len(groups)
    credit = [0.0] * len(groups)
    out: list[Any] = []
    while True:
        live = [i for i, group in enumerate(groups) if positions[i] < len(group)]
        if not live:
            return out
        total = sum(weights[i] for i in live)
        for i in live:
            credit[i] += weights[i]
        chosen = max(live, key=lambda i: (credit[i], -i))
        credit[chosen] -= total
        out.append(groups[chosen][positions[chosen]])
        positions[chosen] += 1


def _mix_tasks(parts: Sequence[MixPart], cfg: KeelConfig) -> tuple[list[MixTask], list[MixTask]]:
    train: list[list[MixTask]] = []
    heldout: list[list[MixTask]] = []
    for part in parts:
        inner_train, inner_heldout = part.spec.tasks(part_config(cfg, part.spec))
        train.append([MixTask(part.name, task) for task in inner_train])
        heldout.append([MixTask(part.name, task) for task in inner_heldout])
    weights = [part.weight for part in parts]
    return interleave(train, weights), interleave(heldout, [1.0] * len(parts))


def _mix_weights(parts: Sequence[MixPart], tasks: Sequence[Any]) -> list[float]:
    """Each task's share of its part's weight: a part's tasks together weigh its weight."""
    weight = {part.name: part.weight for part in parts}
    counts: dict[str, int] = {}
    for task in tasks:
        counts[task.env] = counts.get(task.env, 0) + 1
    return [weight[task.env] / counts[task.env] for task in tasks]


def _mix_family(parts: Sequence[MixPart], task: MixTask) -> str:
    family = {part.name: part.spec.family for part in parts}[task.env]
    return task.env if family is None else f"{task.env}/{family(task.task)}"


def _mix_reference(parts: Sequence[MixPart], task: MixTask) -> str | None:
    """The part's reference answer (`EnvSpec.reference`), else its task's str or number `answer`
    (as `keel audit` reads one alone)."""
    reference = {part.name: part.spec.reference for part in parts}[task.env]
    if reference is not None:
        return reference(task.task)
    answer = getattr(task.task, "answer", None)
    if isinstance(answer, str):
        return answer
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return str(answer)
    return None


def _mix_validate(parts: Sequence[MixPart], env: EnvConfig) -> None:
    for part in parts:
        if part.spec.validate is not None:
            part.spec.validate(env)


def _mix_hidden_paths(parts: Sequence[MixPart], cfg: KeelConfig) -> list[str]:
    paths: list[str] = []
    for part in parts:
        if part.spec.hidden_paths is not None:
            paths.extend(part.spec.hidden_paths(part_config(cfg, part.spec)))
    return list(dict.fromkeys(paths))


def _union(values: Sequence[Sequence[str]]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(value for group in values for value in group))


def _answer_tools(parts: Sequence[MixPart]) -> tuple[str, ...]:
    declared = [part.spec.answer_tools or tuple(part.spec.tools) for part in parts]
    if any(not tools for tools in declared):  # a part whose every action is its answer
        return ()
    return _union(declared)


def mix_spec_fields(parts: Sequence[MixPart]) -> dict[str, Any]:
    """The fields of the `EnvSpec` of a mix of `parts` (module docstring), `EnvSpec(**fields)`:
    named mix, reading env.mix and the union of the parts' fields. ValueError for no parts, a
    name twice or a weight not finite and > 0."""
    parts = list(parts)
    names = [part.name for part in parts]
    if not parts or len(set(names)) != len(names):
        raise ValueError(f"a mix needs one or more parts with distinct names, got {names}")
    if any(not (math.isfinite(part.weight) and part.weight > 0) for part in parts):
        raise ValueError(f"a mix's weights must be finite and > 0, got {[part.weight for part in parts]}")
    verifiers = tuple(name for name in parts[0].spec.verifiers
                      if all(name in part.spec.verifiers for part in parts))
    tools: dict[str, Any] = {}
    for part in parts:
        for name, tool in part.spec.tools.items():
            tools.setdefault(name, tool)
    test_tools = _union([[part.spec.test_tool] for part in parts if part.spec.test_tool])
    off: dict[str, Any] = {}
    for part in parts:
        off.update(part.spec.off)
    teacher: Callable[[KeelConfig], DemoTeacher] | None = None
    if all(part.spec.teacher is not None for part in parts):
        teacher = lambda cfg: _mix_teacher(parts, cfg)  # noqa: E731
    hidden: Callable[[KeelConfig], list[str]] | None = None
    if any(part.spec.hidden_paths is not None for part in parts):
        hidden = lambda cfg: _mix_hidden_paths(parts, cfg)  # noqa: E731
    validate: Callable[[EnvConfig], None] | None = None
    if any(part.spec.validate is not None for part in parts):
        validate = lambda env: _mix_validate(parts, env)  # noqa: E731
    return dict(
        name=MIX_NAME,
        tasks=lambda cfg: _mix_tasks(parts, cfg),
        train_env=lambda cfg: _mix_env(parts, cfg, training=True),
        eval_env=lambda cfg: _mix_env(parts, cfg, training=False),
        teacher=teacher,
        answer_tools=_answer_tools(parts),
        verifiers=verifiers,
        validate=validate,
        fields=("mix", *_union([part.spec.fields for part in parts])),
        off=off,
        title=f"the mix of {', '.join(names)}",
        family=lambda task: _mix_family(parts, task),
        max_turns=None,  # the largest of the parts' limits, read from a mix environment (settle_env)
        tools=tools,
        test_tool=test_tools[0] if len(test_tools) == 1 else "",
        hidden_paths=hidden,
        reference=lambda task: _mix_reference(parts, task),
        weights=lambda tasks: _mix_weights(parts, tasks),
    )
