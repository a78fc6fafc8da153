"""Environment kinds, registered by name: what `env.name` selects.

An `EnvSpec` is everything the trainer needs to know about one kind of environment: where its
(train, held-out) tasks come from, how to build its environments (graded by the training
verifier for rollouts, by the strong verifier for held-out evaluation), the scripted teacher
of the warm start, which tool calls are an episode's answer, and which verifier names and
config values it accepts. `coding`, `guess` and `reasoning_gym` are registered here; a user's
environment plugs in either way:

    register_env(EnvSpec(name="mine", tasks=..., train_env=..., eval_env=...))   # before the Trainer
    Trainer(load_config(overrides=["env.name=mine"])).run()

    Trainer(cfg, env=EnvSpec(name="mine", ...)).run()   # no name registered; cfg.env.name must be "mine"

A duplicate name fails at registration. `resolve_env` (through keelrl.components.check: the
Trainer's first act, and `keel config`) validates the environment section against the chosen
kind (no other kind's fields set, the verifier, the spec's own checks, a teacher for the warm
start); an unknown name fails there, listing the valid names from the registry. Config loading
does not look environments up, so that `Trainer(cfg, env=spec)` can take an unregistered spec.

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
    """The env-section fields that only this kind reads (e.g. guess_n): set to other than its
    default under another env.name, such a field is an error, not silently ignored."""
    off: Mapping[str, Any] = field(default_factory=dict)
    """Values of its `fields` that turn a feature off (coding: env.shaping=0): another kind, which
    has no such feature, accepts them, so a recipe can switch one off for every kind."""
    title: str = ""
    """How error messages name it ("the guessing game"); default: "env.name=NAME"."""
    family: Callable[[Any], str] | None = None
    """task -> the name of its family (coding: templated, agent or real); the held-out report
    gives each family its own figures and RL's lift on it. None: one family."""

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


def env_spec(name: str) -> EnvSpec:
    """The registered spec `name`; ConfigError on env.name listing the valid names otherwise."""
    if name not in ENVIRONMENTS:
        raise ConfigError("env.name", f"unknown environment {name!r}; valid names: {', '.join(ENVIRONMENTS)} "
                                      f"(or pass Trainer(cfg, env=EnvSpec(...)))")
    return ENVIRONMENTS[name]


def check_env_section(env: EnvConfig, spec: EnvSpec) -> None:
    """The env section against `spec`: no field of another registered kind set (`EnvSpec.fields`;
    its default or an `EnvSpec.off` value is not a setting),
    the verifier name, then the spec's own checks (fields relative to env)."""
    defaults = type(env)()
    for other in ENVIRONMENTS.entries():
        for name in other.obj.fields:
            value = getattr(env, name)
            if (name not in spec.fields and value != getattr(defaults, name)
                    and not (name in other.obj.off and value == other.obj.off[name])):
                raise ConfigError(name, f"{name}={value!r} is a setting of {other.obj.label}, "
                                        f"which {spec.label} does not read; remove it (or choose "
                                        f"env.name={other.name})")
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
                                                 f"and env.max_turns is {cfg.env.max_turns}; set "
                                                 f"warm_start.own_mistakes=0 or env.max_turns>={turns}")


def runs_own_mistakes(cfg: KeelConfig, teacher: Any) -> bool:
    """Whether the warm start's own-mistakes round runs: a warm start (warm_start.demos > 0),
    warm_start.own_mistakes > 0, a teacher with `recovery` (and its `recovery_turns`) and
    env.max_turns room for its shortest continuation. Only the field's default gets here without
    them (`check_run_config` refuses another value), and it then means no round."""
    return (cfg.warm_start.demos > 0 and cfg.warm_start.own_mistakes > 0 and hasattr(teacher, "recovery")
            and cfg.env.max_turns >= getattr(teacher, "recovery_turns", 1))


def resolve_env(cfg: KeelConfig, env: EnvSpec | None = None) -> EnvSpec:
    """The run's environment: `env` when given (its name must be cfg.env.name), else the one
    registered as cfg.env.name; validated against the whole config. Raises ConfigError."""
    if env is None:
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
    check_run_config(cfg, spec)
    return spec


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
        return CodingEnvFactory(env.verifier, partial_credit=env.partial_credit, max_turns=env.max_turns,
                                show_tools=env.show_tools, show_file=env.show_file, key_weight=env.key_check_weight,
                                hidden_paths=coding_hidden_paths(cfg), shaping=env.shaping,
                                malformed_cost=env.malformed_cost)
    return CodingEnvFactory("strong", partial_credit=False, max_turns=env.max_turns, show_tools=env.show_tools,
                            show_file=env.show_file, key_weight=1.0, hidden_paths=coding_hidden_paths(cfg))


def _coding_teacher(cfg: KeelConfig) -> DemoTeacher:
    from keelrl.envs.teacher import ScriptedTeacher

    return ScriptedTeacher(success_rate=1.0, mistake_rate=cfg.warm_start.mistake_rate, seed=cfg.seed,
                           read_first=not cfg.env.show_file)


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

    return GuessEnvFactory(cfg.env.max_turns, cfg.env.verifier if training else "strong")


def _guess_teacher(cfg: KeelConfig) -> DemoTeacher:
    from keelrl.envs.guess import BinarySearchTeacher

    return BinarySearchTeacher(mistake_rate=cfg.warm_start.mistake_rate, seed=cfg.seed)


# ------------------------------------------------------------------------------ reasoning gym

def _rg_tasks(cfg: KeelConfig) -> tuple[list[Any], list[Any]]:
    from keelrl.envs.reasoning_gym import rg_tasks

    tasks = rg_tasks(cfg.env.dataset, cfg.env.rg_size, cfg.env.rg_seed)
    return split_tasks(tasks, cfg.env.split_seed, f"env.dataset={cfg.env.dataset} with env.rg_size={cfg.env.rg_size}")


def _rg_env(cfg: KeelConfig, training: bool) -> EnvFactory:
    from keelrl.envs.reasoning_gym import ReasoningGymEnvFactory

    env = cfg.env
    return ReasoningGymEnvFactory(env.dataset, env.rg_size, env.rg_seed, max_turns=env.max_turns,
                                  show_tools=env.show_tools)


def _rg_teacher(cfg: KeelConfig) -> DemoTeacher:
    from keelrl.envs.reasoning_gym import ReferenceAnswerTeacher

    return ReferenceAnswerTeacher()


def _rg_validate(env: EnvConfig) -> None:
    from keelrl.envs.reasoning_gym import check_dataset

    check_dataset(env.dataset)


def _register_builtins() -> None:
    from keelrl.alarms import PATCH_TOOLS
    from keelrl.envs.guess import GUESS_VERIFIERS
    from keelrl.envs.reasoning_gym import ANSWER_TOOL, RG_VERIFIERS

    register_env(EnvSpec(name="coding", tasks=_coding_tasks, train_env=lambda cfg: _coding_env(cfg, True),
                         eval_env=lambda cfg: _coding_env(cfg, False), teacher=_coding_teacher,
                         answer_tools=PATCH_TOOLS, verifiers=_coding_verifiers(), family=_coding_family,
                         title="the coding environment",
                         fields=("tasks", "key_check_weight", "shaping", "malformed_cost"),
                         off={"shaping": 0.0, "malformed_cost": 0.0}))
    register_env(EnvSpec(name="guess", tasks=_guess_tasks, train_env=lambda cfg: _guess_env(cfg, True),
                         eval_env=lambda cfg: _guess_env(cfg, False), teacher=_guess_teacher,
                         answer_tools=("guess",), verifiers=GUESS_VERIFIERS, title="the guessing game",
                         fields=("guess_n", "guess_tasks")))
    register_env(EnvSpec(name="reasoning_gym", tasks=_rg_tasks, train_env=lambda cfg: _rg_env(cfg, True),
                         eval_env=lambda cfg: _rg_env(cfg, False), teacher=_rg_teacher,
                         answer_tools=(ANSWER_TOOL,), verifiers=RG_VERIFIERS, validate=_rg_validate,
                         title="env.name=reasoning_gym", fields=("dataset", "rg_size", "rg_seed")))


_register_builtins()
