"""Environment kinds, registered by name: what `env.name` selects.

An `EnvSpec` is everything the trainer needs to know about one kind of environment: where its
(train, held-out) tasks come from, how to build its environments (graded by the training
verifier for rollouts, by the strong verifier for held-out evaluation), the scripted teacher
of the warm start, its tools, which tool calls are an episode's answer, and which verifier
names and config fields it reads. `coding`, `guess` and `reasoning_gym` are registered here.
`env.name` names an environment in one of three ways, looked up in this order (`env_spec`):

    env.name=guess                    a name registered in this process (`register_env`)
    env.name=units                    a name a package declares under the `keelrl.envs` entry
                                      point group (pyproject.toml: [project.entry-points."keelrl.envs"]
                                      units = "mypkg.envs:UNITS")
    env.name=mypkg.envs:UNITS         an import path: MODULE:ATTRIBUTE

An entry point or import path names an `EnvSpec`, or a callable taking no arguments that
returns one. Since config.yaml keeps `env.name` as given, `keel train --resume`, `keel eval`,
`keel config`, `keel audit` and `keel view` find a user's environment exactly as `keel train`
did. A spec can also be passed without any name: `Trainer(cfg, env=EnvSpec(...))`, where
cfg.env.name must be the spec's name.

A duplicate registered name fails at registration. `resolve_env` (through
keelrl.components.check: the Trainer's first act, and `keel config`) validates the environment
section against the chosen kind: a field the kind does not read (`EnvSpec.fields`) set to other
than its default is an error naming it; the verifier; the spec's own checks; a teacher for the
warm start; and env.max_turns against the environment's own turn limit (`settle_env`). An
unknown name fails there, listing the valid names. Config loading does not look environments
up, so that `Trainer(cfg, env=spec)` can take an unregistered spec.

Every callable of a spec takes the whole run config, so an environment may read any field.
`train_env` and `eval_env` return a factory `() -> Env` (keelrl.envs.base's protocol); the
training factory must pickle, since Ray rollout workers call it in their own processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

from keelrl.envs.base import Env, Policy
from keelrl.errors import ConfigError
from keelrl.registry import Registry

if TYPE_CHECKING:
    from keelrl.config import EnvConfig, KeelConfig


class DemoTeacher(Protocol):
    """A scripted teacher: `policy(task)` gives a `Policy` callable for one episode of `task`."""

    def policy(self, task: Any) -> Policy: ...


EnvFactory = Callable[[], Env]


@dataclass(frozen=True)
class EnvSpec:
    """One kind of environment (see the module docstring). Stable public API: fields are only added."""

    name: str
    """The `env.name` that selects it."""
    tasks: Callable[[KeelConfig], tuple[Sequence[Any], Sequence[Any]]]
    """cfg -> (train tasks, held-out tasks), disjoint and both non-empty, deterministic in the
    config. A task is any object with a unique str `id` (and, optionally, a `kind` that the
    held-out report and the curriculum group by); `split_tasks` splits a list by id."""
    train_env: Callable[[KeelConfig], EnvFactory]
    """cfg -> a picklable factory of training environments, graded by the training verifier
    (`env.verifier`): the reward RL maximises."""
    eval_env: Callable[[KeelConfig], EnvFactory]
    """cfg -> a factory of held-out evaluation environments, graded by the strong verifier
    whatever the training verifier is."""
    teacher: Callable[[KeelConfig], DemoTeacher] | None = None
    """cfg -> the scripted teacher whose successful episodes are the warm start's demonstrations;
    None: the environment has none, and warm_start.demos must be 0."""
    answer_tools: tuple[str, ...] = ()
    """The tools whose calls make up an episode's answer (the train/distinct_patches metric and
    its alarm count distinct answers per group); empty: every action counts."""
    verifiers: tuple[str, ...] = ("strong",)
    """The accepted `env.verifier` names (held-out evaluation always uses strong)."""
    validate: Callable[[EnvConfig], None] | None = None
    """Further checks of the env section; raises ConfigError naming the field (e.g. "dataset")."""
    fields: tuple[str, ...] = ()
    """The env-section fields this kind reads, besides name, verifier and max_turns, which every
    kind has (e.g. guess: guess_n, guess_tasks, split_seed). Any other env field set to other
    than its default is an error naming it, not silently ignored."""
    off: Mapping[str, Any] = field(default_factory=dict)
    """Values of its `fields` that turn a feature off (coding: env.shaping=0): another kind, which
    has no such feature, accepts them, so a recipe can switch one off for every kind."""
    title: str = ""
    """How error messages name it ("the guessing game"); default: "env.name=NAME"."""
    family: Callable[[Any], str] | None = None
    """task -> the name of its family (coding: templated, agent or real); the held-out report
    gives each family its own figures and RL's lift on it. None: one family."""
    max_turns: int | None = None
    """The environment's own turn limit, used when env.max_turns is not set; None: read from an
    environment the training factory makes (its `max_turns`). env.max_turns set to another value
    than an environment's own is an error naming both (`settle_env`)."""
    tools: Mapping[str, Any] = field(default_factory=dict)
    """Its tools by name (keelrl.envs.tools.ToolSpec), declared once: `keel audit` drives probes
    through them and the tool-call formats render them. Empty: the audit's tool probes skip it."""
    test_tool: str = ""
    """The tool that runs the visible tests, if it has one (its info carries tests_failed or
    tests_error): the agent metrics' tested share and recovery rate read it."""
    hidden_paths: Callable[[KeelConfig], list[str]] | None = None
    """cfg -> paths the environment's sandbox hides from the code it runs (coding: keelrl's
    source, the run directory, the task file); None: it runs no code."""
    reference: Callable[[Any], str | None] | None = None
    """task -> its reference answer as the answer tool takes it ("3500"), None for a task without
    one; None: `keel audit` reads a task's str or number `answer` attribute, if it has one. The
    audit's constant probes try the most frequent ones, its rewrites reformat them ("3500.0"), and
    a probe that scores with the reference answer is a right answer, not a hole."""
    probes: Callable[[KeelConfig], Sequence[Any]] | None = None
    """cfg -> the environment's own audit probes (keelrl.audit.generic.EnvProbe: a name, a kind,
    and the actions for a task), run by `keel audit` after its generic ones; None: none."""
    weights: Callable[[Sequence[Any]], Sequence[float]] | None = None
    """train tasks -> their sampling weights, finite and > 0, one per task: each step draws its
    tasks in proportion to them, without replacement within the step (keelrl.train.requests;
    a mix of environments: each environment's weight shared among its tasks). None: uniform."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"an EnvSpec needs a non-empty str name, got {self.name!r}")
        if not self.verifiers or "strong" not in self.verifiers:
            raise ValueError(f"EnvSpec {self.name!r}: verifiers must include 'strong' (held-out evaluation "
                             f"uses it), got {self.verifiers!r}")

    @property
    def label(self) -> str:
        return self.title or f"env.name={self.name}"


ENVIRONMENTS: Registry[EnvSpec] = Registry("environment")
"""Registered environment kinds by name (`register_env`), in registration order."""


def register_env(spec: EnvSpec) -> EnvSpec:
    """Register `spec` under `spec.name` (a duplicate name raises ValueError); returns it.

    Register before the Trainer is built: the config's environment fields are validated against
    the registered spec when it resolves the environment.
    """
    return ENVIRONMENTS.add(spec.name, spec, summary=spec.label)


ENTRY_POINT_GROUP = "keelrl.envs"
"""The entry point group under which a package declares its environments by name."""


def env_spec(name: str) -> EnvSpec:
    """The spec `name` names: registered, declared by an entry point of `ENTRY_POINT_GROUP`, or an
    import path MODULE:ATTRIBUTE (module docstring); ConfigError on env.name listing the valid names
    otherwise."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    points = _entry_points()
    if name in points:
        return _as_spec(name, lambda: points[name].load(), f"entry point {points[name].value!r}")
    if ":" in name:
        return _as_spec(name, lambda: _import_attribute(name), "import path")
    raise ConfigError("env.name", f"unknown environment {name!r}; valid names: "
                                  f"{', '.join([*ENVIRONMENTS, *points])}, or an import path MODULE:ATTRIBUTE "
                                  f"naming an EnvSpec (or pass Trainer(cfg, env=EnvSpec(...)))")


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {point.name: point for point in entry_points(group=ENTRY_POINT_GROUP)}


def _import_attribute(path: str) -> Any:
    import importlib

    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigError("env.name", f"{path!r} is not an import path MODULE:ATTRIBUTE")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ConfigError("env.name", f"cannot import {module_name!r} for env.name={path!r}: {error} "
                                      f"(is its package installed, or on PYTHONPATH?)") from None
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            names = ", ".join(n for n in dir(value) if not n.startswith("_"))
            raise ConfigError("env.name", f"{module_name!r} has no attribute {attribute!r} (env.name={path!r}); "
                                          f"it has: {names}")
        value = getattr(value, part)
    return value


def _as_spec(name: str, load: Callable[[], Any], where: str) -> EnvSpec:
    """The EnvSpec `load()` gives, or that calling what it gives returns; ConfigError otherwise."""
    value = load()
    if not isinstance(value, EnvSpec) and callable(value):
        value = value()
    if not isinstance(value, EnvSpec):
        raise ConfigError("env.name", f"env.name={name!r} ({where}) gives {type(value).__name__}, not an EnvSpec "
                                      f"or a callable returning one")
    return value


EVERY_KIND_READS = ("name", "verifier", "max_turns")
"""The env-section fields every kind has: the rest are read only by the kinds whose
`EnvSpec.fields` name them."""


def check_env_section(env: EnvConfig, spec: EnvSpec) -> None:
    """The env section against `spec`: no field that `spec` does not read (`EnvSpec.fields`) set
    to other than its default (an `EnvSpec.off` value of any registered kind is not a setting:
    it turns off a feature `spec` lacks anyway), the verifier name, then the spec's own checks
    (fields relative to env)."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(env)]
    unknown = [name for name in spec.fields if name not in names]
    if unknown:
        raise ConfigError("name", f"{spec.label} declares fields {unknown} that the env section does not have; "
                                  f"it has: {', '.join(names)}")
    defaults = type(env)()
    offs = [spec.off, *(entry.obj.off for entry in ENVIRONMENTS.entries())]
    for name in names:
        value = getattr(env, name)
        if (name in EVERY_KIND_READS or name in spec.fields or value == getattr(defaults, name)
                or any(name in off and value == off[name] for off in offs)):
            continue
        readers = [entry.name for entry in ENVIRONMENTS.entries() if name in entry.obj.fields]
        hint = f" (it is a setting of env.name={' or '.join(readers)})" if readers else ""
        reads = ", ".join(spec.fields) or "none besides " + ", ".join(EVERY_KIND_READS)
        raise ConfigError(name, f"{name}={value!r} is not read by {spec.label}{hint}; remove it. "
                                f"{spec.label} reads: {reads}")
    from keelrl.envs.formats import FORMATS

    FORMATS.check(env.tool_format, "tool_format")
    if env.verifier not in spec.verifiers:
        raise ConfigError("verifier", f"{spec.label} has no verifier {env.verifier!r}; "
                                      f"valid names: {', '.join(spec.verifiers)}")
    if spec.validate is not None:
        spec.validate(env)


def check_run_config(cfg: KeelConfig, spec: EnvSpec) -> None:
    """What the rest of the run config needs of `spec` (dotted fields): a teacher for the warm start;
    for its own-mistakes round set to other than its default, one that can continue from a
    student's action (`recovery`) within env.max_turns (the default is skipped where that is
    missing: `runs_own_mistakes`)."""
    if cfg.warm_start.demos > 0 and spec.teacher is None:
        raise ConfigError("warm_start.demos", f"{spec.label} has no scripted teacher to demonstrate the warm "
                                              f"start; set warm_start.demos=0")
    own = cfg.warm_start.own_mistakes
    if cfg.warm_start.demos == 0 or own == 0 or own == type(cfg.warm_start)().own_mistakes or spec.teacher is None:
        return
    teacher = spec.teacher(cfg)
    if runs_own_mistakes(cfg, teacher):
        return
    if not hasattr(teacher, "recovery"):
        raise ConfigError("warm_start.own_mistakes", f"{spec.label}'s teacher cannot continue from a student's "
                                                     f"action (it has no `recovery`); set warm_start.own_mistakes=0")
    turns = getattr(teacher, "recovery_turns", 1)
    raise ConfigError("warm_start.own_mistakes", f"the teacher's continuations take at least {turns} turns, "
                                                 f"and env.max_turns is {turns_of(cfg)}; set "
                                                 f"warm_start.own_mistakes=0 or env.max_turns>={turns}")


def runs_own_mistakes(cfg: KeelConfig, teacher: Any) -> bool:
    """Whether the warm start's own-mistakes round runs: a warm start (warm_start.demos > 0),
    warm_start.own_mistakes > 0, a teacher with `recovery` (and its `recovery_turns`) and
    env.max_turns room for its shortest continuation. Only the field's default gets here without
    them (`check_run_config` refuses another value), and it then means no round."""
    return (cfg.warm_start.demos > 0 and cfg.warm_start.own_mistakes > 0 and hasattr(teacher, "recovery")
            and turns_of(cfg) >= getattr(teacher, "recovery_turns", 1))


def resolve_env(cfg: KeelConfig, env: EnvSpec | None = None) -> EnvSpec:
    """The run's environment: `env` when given (its name must be cfg.env.name), else the mix of
    env.mix where set (keelrl.envs.mix), else the one registered as cfg.env.name; validated
    against the whole config. Raises ConfigError."""
    if env is None and cfg.env.mix:
        from keelrl.envs.mix import mix_parts, mix_spec_fields

        spec = EnvSpec(**mix_spec_fields(mix_parts(cfg.env.mix, env_spec)))
    elif env is None:
        spec = env_spec(cfg.env.name)
    else:
        if not isinstance(env, EnvSpec):
            raise TypeError(f"env must be an EnvSpec, got {type(env).__name__}")
        if env.name != cfg.env.name:
            raise ConfigError("env.name", f"the environment given is {env.name!r} but env.name is "
                                          f"{cfg.env.name!r}; set env.name={env.name}")
        spec = env
    try:
        check_env_section(cfg.env, spec)
    except ConfigError as error:
        raise error.with_prefix("env") from None
    check_run_config(settle_env(cfg, spec), spec)
    return spec


def settle_env(cfg: KeelConfig, spec: EnvSpec) -> KeelConfig:
    """`cfg` with env.max_turns settled: unset (None), it becomes `spec.max_turns`, or, for a kind
    that declares none, the `max_turns` of an environment its training factory makes; set, it must
    equal that environment's own limit (ConfigError naming both values). A kind that declares
    `max_turns` builds its environments from env.max_turns, so any positive value is its own."""
    import dataclasses

    given = cfg.env.max_turns
    own: int
    if spec.max_turns is not None:
        own = spec.max_turns if given is None else given
    else:
        probed = getattr(spec.train_env(cfg)(), "max_turns", None)
        if isinstance(probed, bool) or not isinstance(probed, int) or probed < 1:
            raise ConfigError("env.max_turns", f"{spec.label}'s environments have max_turns={probed!r}, not a "
                                               f"positive int: give them one, or declare EnvSpec(max_turns=...)")
        own = probed
        if given is not None and given != own:
            raise ConfigError("env.max_turns", f"env.max_turns={given}, but the environments of {spec.label} have "
                                               f"max_turns={own}; leave env.max_turns unset to use the "
                                               f"environment's own, or make its environments take {given}")
    if given == own:
        return cfg
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, max_turns=own))


DEFAULT_MAX_TURNS = 5
"""The built-in kinds' turn limit where env.max_turns is unset (`EnvSpec.max_turns`)."""


def turns_of(cfg: KeelConfig) -> int:
    """env.max_turns, or `DEFAULT_MAX_TURNS` where unset: what a built-in kind's factories build with."""
    return DEFAULT_MAX_TURNS if cfg.env.max_turns is None else cfg.env.max_turns


def split_tasks(tasks: Sequence[Any], seed: int, source: str) -> tuple[list[Any], list[Any]]:
    """(train, heldout) of `tasks` by `split_of(task.id, seed)`; ValueError naming `source` when
    either is empty."""
    from keelrl.envs.tasks import split_of

    train = [t for t in tasks if split_of(t.id, seed) == "train"]
    heldout = [t for t in tasks if split_of(t.id, seed) == "heldout"]
    if not train or not heldout:  # a ConfigError: `keel train` says it in one line, before any work
        raise ConfigError("", f"{source} gives {len(train)} train and {len(heldout)} held-out tasks; "
                              f"both must be non-empty")
    return train, heldout


# ------------------------------------------------------------------------------ coding

def coding_hidden_paths(cfg: KeelConfig) -> list[str]:
    """What the sandbox hides from the code it runs: keelrl's source, the directory the run
    started in, the run directory (checkpoints, solved transcripts) and the task file."""
    from pathlib import Path

    from keelrl.envs.task_sources import is_file_source
    from keelrl.sandbox import default_hidden_paths

    paths = [*default_hidden_paths(), Path(cfg.run_dir).resolve()]
    if is_file_source(cfg.env.tasks):
        paths.append(Path(cfg.env.tasks).resolve())
    return [str(path) for path in paths]


def _coding_tasks(cfg: KeelConfig) -> tuple[list[Any], list[Any]]:
    from keelrl.envs.task_sources import load_source, task_split
    from keelrl.envs.tasks import TaskError

    try:
        tasks = load_source(cfg.env.tasks, seed=cfg.env.split_seed)
    except (TaskError, OSError) as error:  # a missing or malformed file: one line from `keel train`, no traceback
        raise ConfigError("env.tasks", str(error)) from None
    split = [task_split(task, cfg.env.split_seed) for task in tasks]
    train = [task for task, where in zip(tasks, split) if where == "train"]
    heldout = [task for task, where in zip(tasks, split) if where == "heldout"]
    if not train or not heldout:
        raise ConfigError("env.tasks", f"env.tasks {cfg.env.tasks!r} gives {len(train)} train and {len(heldout)} "
                                       f"held-out tasks; both must be non-empty")
    return train, heldout


def _coding_env(cfg: KeelConfig, training: bool) -> EnvFactory:
    from keelrl.envs.coding import CodingEnvFactory

    env = cfg.env
    if training:
        return CodingEnvFactory(env.verifier, partial_credit=env.partial_credit, max_turns=turns_of(cfg),
                                show_tools=env.show_tools, show_file=env.show_file, key_weight=env.key_check_weight,
                                hidden_paths=coding_hidden_paths(cfg), shaping=env.shaping,
                                malformed_cost=env.malformed_cost, tool_format=env.tool_format)
    return CodingEnvFactory("strong", partial_credit=False, max_turns=turns_of(cfg), show_tools=env.show_tools,
                            show_file=env.show_file, key_weight=1.0, hidden_paths=coding_hidden_paths(cfg),
                            tool_format=env.tool_format)


def _coding_teacher(cfg: KeelConfig) -> DemoTeacher:
    from keelrl.envs.teacher import ScriptedTeacher

    return ScriptedTeacher(success_rate=1.0, mistake_rate=cfg.warm_start.mistake_rate, seed=cfg.seed,
                           read_first=not cfg.env.show_file, tool_format=cfg.env.tool_format)


def _coding_family(task: Any) -> str:
    from keelrl.envs.task_sources import family_of

    return family_of(task)


def _coding_verifiers() -> tuple[str, ...]:
    from keelrl.envs.verifiers import VERIFIERS

    return tuple(VERIFIERS)


# ------------------------------------------------------------------------------ guess

def _guess_tasks(cfg: KeelConfig) -> tuple[list[Any], list[Any]]:
    from keelrl.envs.guess import guess_tasks

    tasks = guess_tasks(cfg.env.guess_tasks, cfg.env.guess_n, seed=cfg.env.split_seed)
    return split_tasks(tasks, cfg.env.split_seed, f"env.guess_tasks={cfg.env.guess_tasks}")


def _guess_env(cfg: KeelConfig, training: bool) -> EnvFactory:
    from keelrl.envs.guess import GuessEnvFactory

    return GuessEnvFactory(turns_of(cfg), cfg.env.verifier if training else "strong", cfg.env.tool_format)


def _guess_reference(task: Any) -> str:
    """The secret: the guess that wins (the audit tells a lucky constant from a hole by it)."""
    return str(task.secret)


def _guess_teacher(cfg: KeelConfig) -> DemoTeacher:
    from keelrl.envs.guess import BinarySearchTeacher

    return BinarySearchTeacher(mistake_rate=cfg.warm_start.mistake_rate, seed=cfg.seed,
                               tool_format=cfg.env.tool_format)


# ------------------------------------------------------------------------------ reasoning gym

def _rg_tasks(cfg: KeelConfig) -> tuple[list[Any], list[Any]]:
    from keelrl.envs.reasoning_gym import rg_tasks

    tasks = rg_tasks(cfg.env.dataset, cfg.env.rg_size, cfg.env.rg_seed)
    return split_tasks(tasks, cfg.env.split_seed, f"env.dataset={cfg.env.dataset} with env.rg_size={cfg.env.rg_size}")


def _rg_env(cfg: KeelConfig, training: bool) -> EnvFactory:
    from keelrl.envs.reasoning_gym import ReasoningGymEnvFactory

    env = cfg.env
    return ReasoningGymEnvFactory(env.dataset, env.rg_size, env.rg_seed, max_turns=turns_of(cfg),
                                  show_tools=env.show_tools, tool_format=env.tool_format)


def _rg_teacher(cfg: KeelConfig) -> DemoTeacher:
    from keelrl.envs.reasoning_gym import ReferenceAnswerTeacher

    return ReferenceAnswerTeacher(cfg.env.tool_format)


def _rg_validate(env: EnvConfig) -> None:
    from keelrl.envs.reasoning_gym import check_dataset

    check_dataset(env.dataset)


def _register_builtins() -> None:
    from keelrl.envs.coding import CODING_TOOLS, PATCH_TOOLS
    from keelrl.envs.guess import GUESS_TOOLS, GUESS_VERIFIERS
    from keelrl.envs.reasoning_gym import ANSWER_TOOL, RG_TOOLS, RG_VERIFIERS

    register_env(EnvSpec(name="coding", tasks=_coding_tasks, train_env=lambda cfg: _coding_env(cfg, True),
                         eval_env=lambda cfg: _coding_env(cfg, False), teacher=_coding_teacher,
                         answer_tools=PATCH_TOOLS, verifiers=_coding_verifiers(), family=_coding_family,
                         title="the coding environment", max_turns=DEFAULT_MAX_TURNS, tools=CODING_TOOLS,
                         test_tool="test", hidden_paths=coding_hidden_paths,
                         fields=("tasks", "split_seed", "partial_credit", "key_check_weight", "show_tools",
                                 "show_file", "shaping", "malformed_cost", "tool_format"),
                         off={"shaping": 0.0, "malformed_cost": 0.0}))
    register_env(EnvSpec(name="guess", tasks=_guess_tasks, train_env=lambda cfg: _guess_env(cfg, True),
                         eval_env=lambda cfg: _guess_env(cfg, False), teacher=_guess_teacher,
                         answer_tools=("guess",), verifiers=GUESS_VERIFIERS, title="the guessing game",
                         max_turns=DEFAULT_MAX_TURNS, tools=GUESS_TOOLS, reference=_guess_reference,
                         fields=("guess_n", "guess_tasks", "split_seed", "tool_format")))
    register_env(EnvSpec(name="reasoning_gym", tasks=_rg_tasks, train_env=lambda cfg: _rg_env(cfg, True),
                         eval_env=lambda cfg: _rg_env(cfg, False), teacher=_rg_teacher,
                         answer_tools=(ANSWER_TOOL,), verifiers=RG_VERIFIERS, validate=_rg_validate,
                         title="env.name=reasoning_gym", max_turns=DEFAULT_MAX_TURNS, tools=RG_TOOLS,
                         fields=("dataset", "rg_size", "rg_seed", "split_seed", "show_tools", "tool_format")))

_register_builtins()
