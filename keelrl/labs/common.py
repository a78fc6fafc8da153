"""What the labs share: their settings, `LabResult`, the shared warm start and the helpers that
train variants from it, read their metrics and draw and tabulate the results."""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from keelrl.config import KeelConfig

LAB_FAST = ["rollout.tasks_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=64", "env.max_turns=4",
            "eval.tasks=40", "output.sample_trajectories=2", "output.checkpoint_every=1000",
            "warm_start.demos=128", "warm_start.epochs=3", "rollout.engine=sync"]
"""Budget shared by the labs' training runs (one warm start, short RL, a 40-task held-out eval)."""

GUESS = ["env.name=guess", "env.partial_credit=false", "env.show_file=true", "env.max_turns=5", "rollout.max_new_tokens=24", "rollout.tasks_per_step=8",
         "warm_start.demos=256", "warm_start.mistake_rate=0.6", "eval.tasks=100"]
"""The guessing-game labs (dynamic-sampling-guess): find 1..16 in 5 guesses, after a warm start
on a teacher that errs. The tiny recipe's coding settings (partial credit, the file not shown) go
back to their defaults: the guessing game reads neither."""


HACK = [*GUESS, "warm_start.mistake_rate=0.3", "rollout.tasks_per_step=16", "eval.tasks=200"]
"""The reward-hacking lab: a steadier teacher than the other guessing-game labs' (so the policy starts
out mostly well-formed), 64 episodes a step and a 200-task held-out eval."""

ENTROPY = [*GUESS, "warm_start.mistake_rate=0.3", "rollout.tasks_per_step=16", "optim.lr=5e-4"]
"""The entropy lab: the reward-hacking lab's warm start and batch, and a faster learning rate."""

QUICK = ["rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "env.max_turns=2",
         "eval.tasks=4", "warm_start.demos=8", "warm_start.epochs=1", "train.minibatch_size=4"]

CODING_QUICK = ["model.path=tiny", "env.show_file=false", "env.max_turns=3", "rollout.max_new_tokens=16",
                "rollout.tasks_per_step=2", "rollout.group_size=2", "train.steps=2", "eval.tasks=4",
                "train.minibatch_size=2", "rollout.temperature=1.0", "eval.dtype=float32", "warm_start.demos=16",
                "warm_start.lr=2e-3", "rollout.max_context_tokens=2048", "perf.learner_precision=float32"]
"""--quick on a SmolLM2 coding lab: the tiny model, 3 turns, 2 tasks x 2 attempts for 2 steps, a
4-task evaluation, a short warm start: a smoke run of the lab's machinery (each lab adds its own)."""

CODING_LAB = ["model.path=smollm2", "rollout.tasks_per_step=4", "train.minibatch_size=8", "algo.dynamic_sampling=false",
              "algo.kl_coef=0", "train.steps=3", "eval.tasks=32", "eval.every=1000", "eval.probe_tasks=0",
              "output.checkpoint_every=1000", "output.sample_trajectories=2", "rollout.lockstep=true"]
"""The SmolLM2 coding labs' shared budget over the default run (five turns, its cached warm start):
3 RL steps of 4 tasks x 4 attempts per arm, two updates a step, no dynamic sampling (every arm
samples the same 16 episodes a step), no reference KL, a 32-task held-out evaluation at the start
and at each arm's end and no probe between (each lab adds or changes its own). Rollouts run in
lockstep (evaluations do by default), so a seed repeats its rollouts token for token on one machine."""

QUICK_GUESS = ["rollout.tasks_per_step=2", "rollout.group_size=2", "eval.tasks=4", "warm_start.demos=16",
               "warm_start.epochs=1", "train.minibatch_size=4"]
"""--quick on a guessing-game lab (5 turns kept: the teacher's demonstrations must still succeed)."""


@dataclass
class LabResult:
    """What a lab reports: headline numbers, the markdown summary and the files it wrote."""

    name: str
    numbers: dict[str, Any]
    summary: str
    files: list[Path] = field(default_factory=list)
    effects: Mapping[str, tuple[float, float | None]] = field(default_factory=dict)
    """The lab's headline comparisons, each a remedy arm against its baseline on the same
    held-out tasks: name -> (the difference in strict success, its paired standard error over
    tasks, None when undefined): `paired_effect`, an `Effect` that also keeps each task's
    difference. `keelrl.labs.seeds` gives each a verdict."""


class Effect(tuple[float, "float | None"]):  # (difference, se): a 2-tuple to every reader
    """(difference in strict success, its paired standard error or None), as `LabResult.effects`
    holds it, with `tasks`: each held-out task's difference (remedy's outcome minus baseline's:
    -1, 0 or 1), so an effect over seeds can be judged task by task (`keelrl.labs.seeds`)."""

    tasks: dict[str, float]

    def __new__(cls, difference: float, se: float | None, tasks: dict[str, float] | None = None) -> Effect:
        effect = super().__new__(cls, (difference, se))
        effect.tasks = dict(tasks or {})
        return effect

    def __getnewargs__(self) -> tuple[float, float | None, dict[str, float]]:  # copy and pickle keep the tasks
        return self[0], self[1], self.tasks


def task_differences(baseline: dict[str, bool], remedy: dict[str, bool]) -> dict[str, float]:
    """Each task both evaluated -> remedy's strict outcome minus baseline's."""
    return {task: float(remedy[task]) - float(baseline[task]) for task in sorted(set(baseline) & set(remedy))}


def outcome_effect(baseline: dict[str, bool], remedy: dict[str, bool]) -> Effect:
    """`remedy`'s per-task strict outcomes against `baseline`'s: the mean of `task_differences`,
    its standard error (None when undefined) and the differences themselves."""
    from keelrl.train.evaluation import finite_or_none, mean_and_se

    tasks = task_differences(baseline, remedy)
    difference, se = mean_and_se(list(tasks.values()))
    return Effect(difference, finite_or_none(se), tasks)


def final_outcomes(run_dir: Path) -> dict[str, bool]:
    """The per-task strict outcomes of a run's last held-out evaluation (summary.json)."""
    return json.loads((run_dir / "summary.json").read_text())["heldout"]["final"]["task_success"]


def paired_effect(out: Path, baseline: str, remedy: str) -> Effect:
    """Variant `remedy`'s final held-out strict success minus `baseline`'s, over the tasks both
    evaluated, with its paired standard error (None when undefined) and each task's difference."""
    return outcome_effect(final_outcomes(out / baseline), final_outcomes(out / remedy))


def kl_anchor(cfg: Any) -> str:
    """How a lab's summary names the reference KL its runs trained with (`cfg.algo`)."""
    coef = cfg.algo.kl_coef
    return "no KL anchor" if coef == 0 else f"a reference KL of {coef:g} ({cfg.algo.kl_estimator})"


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def config(out: Path, overrides: Sequence[str]) -> Any:
    from keelrl.config import load_config

    return load_config(overrides=[f"run_dir={out}", *overrides])


def student_cache_dir() -> Path:
    """Where warm-started students are kept: `$KEELRL_STUDENT_CACHE` if set, else the students/
    folder of keelrl's cache (`keelrl.policy.download.model_cache_dir`)."""
    from keelrl.policy.download import model_cache_dir

    configured = os.environ.get("KEELRL_STUDENT_CACHE")
    return Path(configured).expanduser() if configured else model_cache_dir() / "students"


NOT_WARM_START_SOURCE = ("labs", "audit", "viewer", "cli.py")
"""keelrl's own source that never runs in a warm start (the labs' orchestration, the audit, the
viewer, the CLI): `source_hash` leaves it out, so editing a lab keeps its student."""

NOT_WARM_START_SECTIONS = ("train", "optim", "algo", "eval", "monitor", "output", "prm", "log", "curriculum")
"""Config sections the warm start does not read (`keelrl.train.warm_start` reads seed, env,
model, rollout, perf and warm_start): `student_config` puts their defaults in, so labs whose RL
settings differ share one student. So do the RL batch's shape and dynamic sampling's extra
draws (`NOT_WARM_START_ROLLOUT`)."""

NOT_WARM_START_ROLLOUT = ("tasks_per_step", "group_size", "dynamic_max_extra_groups")


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over the keelrl source a warm start can run (all of it but `NOT_WARM_START_SOURCE`):
    a student made by other code is not reused."""
    import keelrl

    digest = hashlib.sha256()
    root = Path(keelrl.__file__).parent
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in NOT_WARM_START_SOURCE:
            continue
        digest.update(str(relative).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def student_config(cfg: Any) -> str:
    """What makes `cfg`'s warm start, as YAML: the resolved config with run_dir and the sections in
    `NOT_WARM_START_SECTIONS` and the rollout fields in `NOT_WARM_START_ROLLOUT` at their defaults."""
    from keelrl.config import KeelConfig, dump_config

    defaults = KeelConfig()
    kept = {name: getattr(defaults, name) for name in NOT_WARM_START_SECTIONS}
    rollout = dataclasses.replace(cfg.rollout, **{name: getattr(defaults.rollout, name) for name in NOT_WARM_START_ROLLOUT})
    return dump_config(dataclasses.replace(cfg, run_dir="", rollout=rollout, **kept))


def student_key(text: str) -> str:
    """The cache key of the student `student_config` text `text` makes: its sha256 with keelrl's
    version and `source_hash`."""
    import keelrl

    return hashlib.sha256(f"{text}\0{keelrl.__version__}\0{source_hash()}".encode()).hexdigest()


def cached_student(overrides: Sequence[str], progress: Callable[[str], None] = lambda message: None,
                   label: str = "student") -> Path:
    """The model `overrides`' warm start makes (`Trainer.warm_start`), made once per machine and
    kept in `student_cache_dir()` under `student_key`; later calls whose `student_config` is the
    same, from any lab, reuse it. Returns its model directory (a Hugging Face model and tokenizer); student.json
    beside it holds the key, the config that made it and the warm start's seconds and figures."""
    from keelrl.runs import atomic_write_text
    from keelrl.train.trainer import Trainer

    cache = student_cache_dir()
    text = student_config(config(cache / "building", overrides))
    key = student_key(text)
    target = cache / key[:24]
    if (target / "student.json").exists() and (target / "model" / "config.json").exists():
        progress(f"the {label}: reusing the warm-started model in {target}")
        return target / "model"
    progress(f"making the {label}: warm-starting once; kept in {target} for every lab after")
    cache.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{key[:24]}-", dir=cache))
    try:
        started = time.monotonic()
        trainer = Trainer(config(building / "run", overrides))
        figures = trainer.warm_start()
        trainer.model.save_pretrained(building / "model")
        trainer.tokenizer.save_pretrained(building / "model")
        atomic_write_text(building / "student.json", json.dumps(
            {"key": key, "label": label, "seconds": round(time.monotonic() - started, 1), "warm_start": figures,
             "config": text}, indent=2, default=str))
        shutil.rmtree(building / "run", ignore_errors=True)
        try:
            building.rename(target)
        except OSError:  # another process made it first: theirs is the same student
            if not (target / "student.json").exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target / "model"


def warm_model(out: Path, overrides: Sequence[str], progress: Callable[[str], None] = lambda message: None) -> Path:
    """The labs' shared warm start (`cached_student` of `overrides`); out/warm/student.json
    names it. Returns its model directory."""
    model = cached_student(overrides, progress)
    (out / "warm").mkdir(parents=True, exist_ok=True)
    (out / "warm" / "student.json").write_text(json.dumps({"model": str(model)}, indent=2) + "\n")
    return model


def warm_tokenizer(out: Path) -> Any:
    """The tokenizer of the warm start out/warm/student.json names."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(json.loads((out / "warm" / "student.json").read_text())["model"])


USER_OVERRIDES: ContextVar[tuple[str, ...]] = ContextVar("keel_lab_user_overrides", default=())
"""The overrides the user gave `run_lab`: they win over every setting a lab makes, its variants' too."""

RL_OVERRIDES: ContextVar[tuple[str, ...]] = ContextVar("keel_lab_rl_overrides", default=())
"""The settings the user gave `run_lab` for the arms' RL runs alone (`keel lab --rl`): they come
after the user's other overrides, and the warm start (so the cached student) never sees them."""

RL_SEED: ContextVar[tuple[str, ...]] = ContextVar("keel_lab_rl_seed", default=())
"""`seed=N` while `run_lab` runs one seed of several: every variant's RL run takes it (after the
user's overrides); the warm start, shared by the seeds, does not."""


def release_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the system (glibc's malloc_trim;
    nothing more where there is none): a lab that makes one trainer after another in a process
    would otherwise keep every earlier arm's freed activations in its resident set."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim among the process's own symbols, looked up once; None without glibc."""
    import ctypes

    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


KEEP_CHECKPOINTS: ContextVar[bool] = ContextVar("keel_lab_keep_checkpoints", default=False)
"""Whether a lab's arms keep their final checkpoints (`keel lab --keep-checkpoints`); by default
`drop_checkpoint` removes each one once its arm has finished and been evaluated."""


def drop_checkpoint(run_dir: Path, progress: Callable[[str], None]) -> int:
    """Remove a finished arm's checkpoints (its model, optimizer and sampler state; 1.6 GB an arm on
    SmolLM2) and the pointer to them, unless `KEEP_CHECKPOINTS` is set; -> bytes freed. The arm's
    metrics, summary, episodes and samples stay, and so does the lab's resume: a finished arm is
    known by its summary, not its checkpoint. The pointer goes first, so no pointer ever names a
    half-removed folder."""
    from keelrl.runs import POINTER

    folder = run_dir / "checkpoints"
    if KEEP_CHECKPOINTS.get() or not folder.is_dir():
        return 0
    freed = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    (run_dir / POINTER).unlink(missing_ok=True)
    shutil.rmtree(folder)
    progress(f"removed {run_dir.name}'s checkpoint ({freed / 1e9:.2f} GB; --keep-checkpoints keeps it)")
    return freed


def variant_settings() -> list[str]:
    """What every variant's run ends with: the user's overrides, their RL-only settings, then the
    seed of this repetition."""
    return [*USER_OVERRIDES.get(), *RL_OVERRIDES.get(), *RL_SEED.get()]


def train_variants(out: Path, variants: dict[str, list[str]], overrides: Sequence[str],
                   progress: Callable[[str], None], trainers: dict[str, Any] | None = None,
                   evaluate_start_once: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Run each variant from the shared warm start; returns each variant's metrics rows.

    Pass `trainers` to get each variant's trained `Trainer` back in it. The user's overrides
    (`run_lab`'s) are applied again after each variant's own settings, so they win there too.
    Each variant is one `train_variant`: one that finished before in its directory with the same
    config is kept, not trained again, unless `trainers` asks for its trainer.

    `evaluate_start_once`: every variant keeps its evaluation before RL in its own metrics (its probe
    curve and alarms start there), but only the first runs it; the others take the first's
    (`start_evaluation`), the same weights evaluated the same way (each variant's settings must
    leave the evaluation alone).
    """
    model = warm_model(out, overrides, progress)
    runs: dict[str, list[dict[str, Any]]] = {}
    start = None
    for label, extra in variants.items():
        cfg = config(out / label, [*overrides, *extra, *variant_settings(), f"model.path={model}", "warm_start.demos=0"])
        runs[label] = train_variant(label, cfg, progress, trainers, start=start)
        if evaluate_start_once and start is None:
            start = start_evaluation(Path(cfg.run_dir), runs[label])
    return runs


def start_evaluation(run_dir: Path, rows: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, Any]] | None:
    """A finished run's evaluation before RL as `Trainer.start_evaluation` takes it: its step-0
    eval/* metrics and the report summary.json keeps of it (None when it made none)."""
    from keelrl.runs import SUMMARY

    metrics = {key: value for row in rows if row.get("step") == 0
               for key, value in row.items() if key.startswith("eval/")}
    try:
        report = json.loads((run_dir / SUMMARY).read_text())["heldout"]["warm_start"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (metrics, report) if metrics and report else None


def train_variant(label: str, cfg: KeelConfig, progress: Callable[[str], None],
                  trainers: dict[str, Any] | None = None,
                  start: tuple[dict[str, float], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One lab arm: `cfg`'s run, trained and evaluated in `cfg.run_dir`; returns its
    metrics rows. A run that finished before in that directory with the same config (its
    `VARIANT_RECORD`) is kept, not trained again, unless `trainers` asks for its trainer: a stopped
    lab resumes at the first unfinished arm. A finished arm's record gets its wall clock, its
    checkpoint is dropped (`drop_checkpoint`), and its trainer is released before the next arm
    loads (kept only in `trainers[label]` when given). `start`: its evaluation before RL, made by
    another run from the same weights (`Trainer.start_evaluation`)."""
    from keelrl.config import dump_config
    from keelrl.runs import SUMMARY, atomic_write_text, read_metrics
    from keelrl.train.trainer import Trainer

    run_dir = Path(cfg.run_dir)
    requested = dump_config(cfg)
    if trainers is None and (run_dir / SUMMARY).exists() and variant_record(run_dir).get("config") == requested:
        progress(f"variant {label!r}: finished before with this config, kept ({run_dir})")
        return read_metrics(run_dir)
    progress(f"training variant {label!r}")
    (run_dir / VARIANT_RECORD).unlink(missing_ok=True)
    started = time.monotonic()
    trainer = Trainer(cfg)
    trainer.start_evaluation = start
    trainer.run()
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / VARIANT_RECORD, json.dumps(
        {"config": requested, "seconds": round(time.monotonic() - started, 1)}, indent=2))
    rows = read_metrics(run_dir)
    drop_checkpoint(run_dir, progress)
    if trainers is not None:
        trainers[label] = trainer
    del trainer  # else this arm's model and optimizer live on while the next one's load
    release_memory()
    return rows


VARIANT_RECORD = "lab_variant.json"
"""What `train_variant` writes into a variant's directory when it finishes: the config it ran
and its wall-clock seconds (building its `Trainer`, loading the model, training and evaluating)."""


def variant_record(run_dir: Path) -> dict[str, Any]:
    """A finished variant's `VARIANT_RECORD` ({} when it has none)."""
    path = run_dir / VARIANT_RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def share_start(runs: dict[str, list[dict[str, Any]]], source: str) -> dict[str, list[dict[str, Any]]]:
    """`runs` with variant `source`'s evaluation before RL (its step-0 `eval/success` rows) put
    first in every other variant's rows: the variants that start from one student and skip that
    evaluation (eval.before_rl=false) begin their curves from it."""
    start = [row for row in runs[source] if row.get("step") == 0 and "eval/success" in row]
    return {label: rows if label == source else [*start, *rows] for label, rows in runs.items()}


def steps_run(runs: dict[str, list[dict[str, Any]]]) -> int:
    """RL steps the variants ran (what a summary reports, whatever the overrides set)."""
    return max((int(row["step"]) for rows in runs.values() for row in rows), default=0)


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]


def pooled_share(rows: list[dict[str, Any]], count_key: str, share_key: str) -> tuple[int, float]:
    """(the count `count_key` summed over a run's steps, the share `share_key` pooled over them by
    that count): e.g. turns of some kind over the run, and how many of them had a positive
    advantage. NaN share when the count is 0."""
    counts = dict(series(rows, count_key))
    shares = dict(series(rows, share_key))
    total = sum(counts.values())
    positive = sum(counts[step] * shares[step] for step in shares if step in counts)
    return int(total), (positive / total if total else float("nan"))


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def last(rows: list[dict[str, Any]], key: str) -> float:
    points = series(rows, key)
    return points[-1][1] if points else math.nan


def first(rows: list[dict[str, Any]], key: str) -> float:
    points = series(rows, key)
    return points[0][1] if points else math.nan


def alarm_events(out: Path) -> list[dict[str, Any]]:
    """The alarms a run fired (alarms.jsonl), in order."""
    from keelrl.runs import read_alarms

    return read_alarms(out)


def replayed_alarms(run_dir: Path) -> list[dict[str, Any]]:
    """The alarms keelrl's monitor fires on a finished run's metrics.jsonl with the run's own
    monitor settings (config.yaml), as a resumed run replays them: the same as alarms.jsonl for
    a run of this keelrl, and what this keelrl's alarms make of an older run's metrics."""
    from keelrl.alarms import AlarmMonitor
    from keelrl.config import load_config
    from keelrl.runs import read_metrics

    monitor = AlarmMonitor(load_config(run_dir / "config.yaml").monitor)
    return [event.as_dict() for row in read_metrics(run_dir) for event in monitor.update(int(row["step"]), row)]


def alarms(out: Path) -> list[str]:
    return [event["alarm"] for event in alarm_events(out)]


def plot_variants(path: Path, runs: dict[str, list[dict[str, Any]]], panels: list[tuple[str, str]],
                  title: str, marks: dict[str, list[tuple[int, str]]] | None = None) -> Path:
    """One panel per metric, one line per variant; `marks` draws each variant's (step, label) events
    (alarms) as dashed vertical lines in the variant's colour."""
    plt = pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    axes = list(axes) if len(panels) > 1 else [axes]
    for ax, (key, label) in zip(axes, panels):
        for index, (variant, rows) in enumerate(runs.items()):
            points = series(rows, key)
            if points:  # a variant keeps its colour in every panel, also where another has no points
                steps, values = zip(*points)
                line = ax.plot(steps, values, marker="o", label=variant, color=f"C{index}")[0]
                for step, name in (marks or {}).get(variant, []):
                    ax.axvline(step, color=line.get_color(), linestyle="--", linewidth=1,
                               label=f"{variant}: {name} alarm")
        ax.set_title(label)
        ax.set_xlabel("RL step")
        if ax.get_legend_handles_labels()[0]:  # a metric no variant logged leaves an empty panel
            ax.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def effect_sentence(what: str, effect: tuple[float, float | None], tasks: int, remedy: str) -> str:
    """One seed's verdict on a held-out `effect` ((difference, paired SE or None), `paired_effect`'s)
    in words: "{what}: +0.094 (paired standard error 0.070 over the 32 tasks)", then "." or, when it
    is within twice its standard error (or has none), that this run does not show `remedy` helped."""
    difference, se = effect
    spread = f" (paired standard error {se:.3f} over the {tasks} tasks)" if se is not None else ""
    within = se is None or abs(difference) <= 2 * se
    return (f"{what}: {difference:+.3f}{spread}"
            + (f"; within twice its standard error: this run does not show that {remedy} helped." if within else "."))
