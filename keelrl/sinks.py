"""Metric sinks: where each step's metrics row goes, behind one interface, registered by name.

`MetricsLogger` (keelrl/metrics.py) builds the sinks `log.sinks` names and hands each the same
calls:

    sink = SINKS[name](context)    # run_dir, the LogConfig, the resolved config, resume info
    sink.log(step, row)            # row: {"step": step, key: value}, non-finite floats as None
    sink.log_summary(summary)      # once, after summary.json is written (a finished run only)
    sink.close(error)              # error: what ended the run (None: it ended normally)

- `jsonl`: run_dir/metrics.jsonl, one JSON line per step holding every value. It is the run's
  record (resume, summary.json, plots and `keel report` read it), so every config lists it.
- `tensorboard`: run_dir/tb, each numeric value as a scalar.
- `wandb`: a Weights & Biases run whose config is the resolved config (files in run_dir/wandb).
- `mlflow`: an MLflow run whose params are the resolved config, flattened to dotted keys.

Only numbers are metrics: every sink but jsonl skips None (a NaN or inf, made null for JSON),
booleans, strings and lists, and passes the step explicitly. MLflow names are sanitised to the
characters it accepts (letters, digits, _ - . space /; anything else becomes _); two keys that
sanitise to the same name raise. Param values longer than MLflow's limit (6000
characters in MLflow 3) are cut, ending in "...".

Resume (`resume_after=k`: a run restarted from its step-k checkpoint). metrics.jsonl drops the
lines after step k and TensorBoard purges events after step k, so the repeated steps replace the
first attempt's. W&B and MLflow cannot delete logged points: each reopens the run it recorded in
run_dir (wandb_run.json, mlflow_run.json: W&B `resume="allow"` on the same id, MLflow the same
run id set back to RUNNING) and skips the steps that run already holds, those up to the last
step metrics.jsonl held before the resume truncated it. Their values there stay the first
attempt's: a resumed run repeats the uninterrupted one, so they are equal but for timings. A
sink with no recorded run (added at the resume, the record lost, another MLflow tracking URI, a
W&B server that never received the run) starts a new run and first gets steps 0..k from
metrics.jsonl. MLflow records each resume as a tag `keelrl.resumed_at_step_k` naming the params
whose values changed (MLflow params cannot change). Not guaranteed: a kill between two sinks'
writes of one step can leave a remote run one point short or with one duplicate point.

Offline. `log.wandb_mode=offline` (or auto without credentials) writes
run_dir/wandb/offline-run-*-ID; each process of a resumed run writes its own folder with the
same run id, and `wandb sync run_dir/wandb/offline-run-*` uploads them, in start order, into one
run. MLflow's default store is the directory run_dir/mlruns (a file: URI) and needs no server;
MLflow 3 opens it only with MLFLOW_ALLOW_FILE_STORE=true in the environment, which keelrl does
not set for the user (the environment is process-wide).

Side effects not avoided: `wandb.init` sets the global `wandb.run` (each MetricsLogger gets a run
of its own: `reinit="create_new"`) and starts W&B's service process, which lives until the
Python process exits or `wandb.teardown()`. Console capture is off unless WANDB_CONSOLE asks for
it (it rewires the process's stdout). MLflow is driven through an `MlflowClient` of the sink's
own: no global tracking URI and no active run are set.
"""

from __future__ import annotations

import importlib
import json
import math
import netrc
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping
from urllib.parse import urlsplit

from keelrl.errors import ConfigError
from keelrl.registry import Registry

if TYPE_CHECKING:
    from keelrl.config import LogConfig


@dataclass(frozen=True)
class SinkContext:
    """What every sink is built from."""

    run_dir: Path
    settings: LogConfig
    config: Mapping[str, Any] = field(default_factory=dict)
    """The run's resolved config as nested dicts (empty when the logger was given none)."""
    resume_after: int | None = None
    """The checkpoint step a resumed run restarts from; None for a fresh run."""
    logged_through: int | None = None
    """Resumed: the last step metrics.jsonl held before it was truncated to resume_after."""


class Sink:
    """One destination of the metrics rows (see the module docstring for the calls it gets)."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    """One line for listings of the sinks."""
    package: ClassVar[str | None] = None
    """The module the sink needs, installed by keelrl's extra of the sink's name; None: none."""

    def __init__(self, context: SinkContext) -> None:
        self.context = context

    @classmethod
    def check(cls, settings: LogConfig, run_dir: Path) -> None:
        """Raise ConfigError if this sink could not start (its package missing), before any work."""
        if cls.package is not None:
            _import(cls.package, cls.name)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """summary.json's content, once a run finishes; the local sinks have it in summary.json."""

    def close(self, error: BaseException | None = None) -> None:
        """Flush and release; `error` is what ended the run, if anything did."""


SINKS: Registry[type[Sink]] = Registry("sink")
"""Sink name -> class, in registration order (`log.sinks` choices)."""


def register_sink(cls: type[Sink]) -> type[Sink]:
    """Class decorator: register `cls` under `cls.name` (a duplicate name raises ValueError)."""
    return SINKS.add(cls.name, cls, summary=cls.summary)


def check_sinks(settings: LogConfig, run_dir: str | Path) -> None:
    """Import every asked-for sink's package and open what can be opened without network (the
    MLflow store): ConfigError now, naming the fix, rather than once the run has started."""
    for name in settings.sinks:
        SINKS[name].check(settings, Path(run_dir))


def _import(module: str, sink: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError("log.sinks", f"the {sink} sink needs the {module.split('.')[0]} package, which does not "
                                       f"import ({error}): pip install 'keelrl[{sink}]'") from error


def numeric_metrics(row: Mapping[str, Any]) -> dict[str, int | float]:
    """The row's metrics that are numbers: no step, None, NaN, inf, booleans, strings or lists."""
    return {key: value for key, value in row.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


def numeric_leaves(data: Mapping[str, Any], prefix: str = "") -> dict[str, int | float]:
    """Numeric leaves of nested mappings, keyed by their '/'-joined paths (lists are skipped)."""
    out: dict[str, int | float] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(numeric_leaves(value, f"{prefix}{key}/"))
        else:
            out.update(numeric_metrics({f"{prefix}{key}": value}))
    return out


def summary_metrics(summary: Mapping[str, Any]) -> dict[str, int | float]:
    """summary.json's numbers as summary/... keys, without the full per-task held-out reports
    ("heldout": their totals are heldout_* already)."""
    return numeric_leaves({key: value for key, value in summary.items() if key != "heldout"}, prefix="summary/")


@register_sink
class JsonlSink(Sink):
    """run_dir/metrics.jsonl: one JSON line per step with every value. A resume first drops the
    lines after resume_after (and a torn last line a kill left), atomically."""

    name = "jsonl"
    summary = "run_dir/metrics.jsonl, one JSON line per step (the run's record)"

    def __init__(self, context: SinkContext) -> None:
        from keelrl.runs import truncate_jsonl

        super().__init__(context)
        self.path = context.run_dir / "metrics.jsonl"
        if context.resume_after is not None:
            truncate_jsonl(self.path, context.resume_after)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(dict(row)) + "\n")


@register_sink
class TensorBoardSink(Sink):
    """run_dir/tb: each numeric value as a scalar. A resume purges the events after resume_after,
    so repeated steps are not plotted twice."""

    name = "tensorboard"
    summary = "run_dir/tb, each numeric value as a scalar"

    def __init__(self, context: SinkContext) -> None:
        from torch.utils.tensorboard import SummaryWriter

        super().__init__(context)
        purge = None if context.resume_after is None else context.resume_after + 1
        self.writer = SummaryWriter(log_dir=str(context.run_dir / "tb"), purge_step=purge)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        for key, value in numeric_metrics(row).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, error: BaseException | None = None) -> None:
        self.writer.close()


class RemoteRunSink(Sink):
    """A sink whose backend keeps a run that cannot be rewritten (W&B, MLflow): the run is named
    in run_dir/`record` so that a resume reopens it (module docstring, Resume)."""

    record: ClassVar[str]

    def __init__(self, context: SinkContext) -> None:
        from keelrl.runs import read_metrics
        from keelrl.runs import atomic_write_text

        super().__init__(context)
        record_path = context.run_dir / self.record
        previous = None
        if context.resume_after is not None and record_path.exists():
            previous = json.loads(record_path.read_text())
        record, reopened = self._open(previous)
        atomic_write_text(record_path, json.dumps(record, indent=2) + "\n")
        self.skip_through = context.logged_through if reopened else None
        self.last_step = context.resume_after or 0
        """The last step this run holds (where log_summary puts what needs a step)."""
        if context.resume_after is not None and not reopened:
            for row in read_metrics(context.run_dir):  # the jsonl sink, built first, kept steps <= k
                self.log(int(row["step"]), row)

    def _open(self, previous: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
        """Start a run, or reopen the recorded `previous` one: (the record to keep, reopened)."""
        raise NotImplementedError

    def _send(self, step: int, metrics: Mapping[str, int | float]) -> None:
        raise NotImplementedError

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        if self.skip_through is not None and step <= self.skip_through:
            return  # the reopened run has this step from the attempt before the resume
        metrics = numeric_metrics(row)
        if metrics:
            self._send(step, metrics)
        self.last_step = step

    def _run_name(self) -> str:
        return self.context.settings.run_name or self.context.run_dir.resolve().name


def _project(settings: LogConfig, variable: str) -> str:
    return settings.project or os.environ.get(variable) or "keelrl"


def wandb_init_mode(mode: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """`log.wandb_mode` -> wandb.init's mode; None leaves the choice to W&B (WANDB_MODE,
    `wandb offline`'s settings file, else online). auto without WANDB_MODE or credentials is
    offline, with a warning."""
    if mode != "auto":
        return mode
    if environ.get("WANDB_MODE") or wandb_credentials_found(environ):
        return None
    warnings.warn("log.sinks has wandb but W&B has no credentials (no WANDB_API_KEY, no `wandb login`) and "
                  "WANDB_MODE is unset: logging offline to run_dir/wandb (`wandb sync` uploads it later); "
                  "set log.wandb_mode or WANDB_MODE to choose", stacklevel=2)
    return "offline"


def wandb_credentials_found(environ: Mapping[str, str] = os.environ) -> bool:
    """W&B credentials as W&B itself finds them: WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or a
    netrc entry (NETRC, else ~/.netrc) for the host of WANDB_BASE_URL (`wandb login` writes it)."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    path = Path(environ.get("NETRC") or "~/.netrc").expanduser()
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):  # no netrc file, or one W&B could not read either
        return False
    return bool(entry and entry[2])


@register_sink
class WandbSink(RemoteRunSink):
    """A Weights & Biases run: `wandb.init(project, name, dir=run_dir, config=<resolved config>,
    mode)`, then `run.log(metrics, step=step)`; the summary's numbers go to the run summary and
    an error that ends the run finishes it with exit code 1 (failed)."""

    name = "wandb"
    summary = "a Weights & Biases run"
    package = "wandb"
    record = "wandb_run.json"

    def _open(self, previous: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
        wandb = _import("wandb", self.name)
        settings = self.context.settings
        resume: dict[str, Any] = {}
        if previous is not None:
            resume = {"id": previous["run_id"], "resume": "allow", "allow_val_change": True}
        self.run = wandb.init(
            project=_project(settings, "WANDB_PROJECT"), name=self._run_name(), dir=str(self.context.run_dir),
            config=dict(self.context.config), mode=wandb_init_mode(settings.wandb_mode), reinit="create_new",
            settings=None if "WANDB_CONSOLE" in os.environ else wandb.Settings(console="off"), **resume)
        # Offline, nothing can tell whether an earlier segment exists; it does (its folder is kept).
        reopened = previous is not None and (self.run.resumed or self.run.offline)
        return {"run_id": self.run.id, "project": self.run.project}, reopened

    def _send(self, step: int, metrics: Mapping[str, int | float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self.run.summary.update(summary_metrics(summary))

    def close(self, error: BaseException | None = None) -> None:
        self.run.finish(exit_code=0 if error is None else 1)


_MLFLOW_BAD_CHARACTER = re.compile(r"[^\w./ -]")


def mlflow_metric_name(key: str) -> str:
    """`key` as a metric name MLflow accepts on every platform: letters, digits, _ - . space and /,
    without an empty, '.' or '..' path segment; anything else becomes _ ("a:b//c" -> "a_b/_/c")."""
    parts = _MLFLOW_BAD_CHARACTER.sub("_", key).split("/")
    return "/".join(part if part.strip(".") else "_" * max(1, len(part)) for part in parts)


def flat_params(config: Mapping[str, Any], limit: int, prefix: str = "") -> dict[str, str]:
    """Nested config -> {dotted key: value as text} (strings as they are, anything else as JSON),
    each value cut to `limit` characters, the cut ones ending in '...'."""
    out: dict[str, str] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_params(value, limit, prefix=f"{path}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        out[path] = text if len(text) <= limit else text[:limit - 3] + "..."
    return out


def mlflow_tracking_uri(settings: LogConfig, run_dir: Path) -> str:
    """log.mlflow_tracking_uri, else MLFLOW_TRACKING_URI, else the file store run_dir/mlruns."""
    return (settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or (Path(run_dir).resolve() / "mlruns").as_uri())


def _mlflow_client(uri: str) -> Any:
    tracking = _import("mlflow.tracking", "mlflow")
    from mlflow.exceptions import MlflowException

    try:
        return tracking.MlflowClient(tracking_uri=uri)  # opens the store (no network for a server URI)
    except MlflowException as error:
        hint = ""
        if uri.startswith("file:"):
            hint = (" MLflow 3 opens a file store only with MLFLOW_ALLOW_FILE_STORE=true in the environment: set it, "
                    "or point log.mlflow_tracking_uri (or MLFLOW_TRACKING_URI) at a tracking server.")
        raise ConfigError("log.mlflow_tracking_uri", f"MLflow cannot open the tracking store {uri}: "
                                                     f"{str(error)[:300]}{hint}") from error


@register_sink
class MlflowSink(RemoteRunSink):
    """An MLflow run in experiment `log.project` at `mlflow_tracking_uri`: the flattened config as
    params, each row as metrics at its step (`log_batch`), the summary's numbers as summary/...
    metrics at the last step; closed FINISHED, FAILED, or KILLED (Ctrl-C)."""

    name = "mlflow"
    summary = "an MLflow run"
    package = "mlflow"
    record = "mlflow_run.json"

    @classmethod
    def check(cls, settings: LogConfig, run_dir: Path) -> None:
        super().check(settings, run_dir)
        _mlflow_client(mlflow_tracking_uri(settings, run_dir))

    def _open(self, previous: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.exceptions import MlflowException
        from mlflow.utils import validation

        self._metric = Metric
        self._names: dict[str, str] = {}
        uri = mlflow_tracking_uri(self.context.settings, self.context.run_dir)
        self.client = _mlflow_client(uri)
        params = flat_params(self.context.config, getattr(validation, "MAX_PARAM_VAL_LENGTH", 500))
        if previous is not None and previous.get("tracking_uri") == uri:
            self.run_id = previous["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            logged = self.client.get_run(self.run_id).data.params
            changed = [f"{key}: {logged[key]} -> {value}" for key, value in params.items()
                       if key in logged and logged[key] != value]
            tag = RunTag(f"keelrl.resumed_at_step_{self.context.resume_after}",
                         "; ".join(changed)[:getattr(validation, "MAX_TAG_VAL_LENGTH", 5000)] or "no param changed")
            self.client.log_batch(self.run_id, params=[Param(key, value) for key, value in params.items()
                                                       if key not in logged], tags=[tag])
            return dict(previous), True
        experiment = _project(self.context.settings, "MLFLOW_EXPERIMENT_NAME")
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            try:
                experiment_id = self.client.create_experiment(experiment)
            except MlflowException:  # another run created it meanwhile
                experiment_id = self.client.get_experiment_by_name(experiment).experiment_id
        else:
            experiment_id = found.experiment_id
        run = self.client.create_run(experiment_id, run_name=self._run_name(),
                                     tags={"keelrl.run_dir": str(self.context.run_dir.resolve())})
        self.run_id = run.info.run_id
        self.client.log_batch(self.run_id, params=[Param(key, value) for key, value in params.items()])
        return {"run_id": self.run_id, "experiment_id": experiment_id, "tracking_uri": uri}, False

    def _name(self, key: str) -> str:
        if key not in self._names:
            name = mlflow_metric_name(key)
            clash = [other for other, taken in self._names.items() if taken == name]
            if clash:
                raise ValueError(f"metrics {clash[0]!r} and {key!r} both become MLflow metric {name!r}")
            self._names[key] = name
        return self._names[key]

    def _send(self, step: int, metrics: Mapping[str, int | float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(self._name(key), float(value), now, step)
                                                    for key, value in metrics.items()])

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        metrics = summary_metrics(summary)
        if metrics:
            self._send(self.last_step, metrics)

    def close(self, error: BaseException | None = None) -> None:
        status = "FINISHED" if error is None else "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        self.client.set_terminated(self.run_id, status=status)
