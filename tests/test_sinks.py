"""Metric sinks: what W&B (offline) and MLflow (a file store) hold after a run, read back from
their own files; resume; config-time and build-time errors."""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import psutil
import pytest
from conftest import FAST_RUN

from keelrl.components import check
from keelrl.config import TINY_RUN, LogConfig, load_config
from keelrl.errors import ConfigError
from keelrl.metrics import MetricsLogger
from keelrl.runs import read_metrics
from keelrl.sinks import SINKS, check_sinks, flat_params, mlflow_metric_name, wandb_init_mode

CONFIG = {"algo": {"preset": "grpo", "eps_high": 0.28}, "optim": {"lr": 1e-5}, "perf": {"learner_cores": [0, 1]},
          "env": {"tasks": "x" * 7000}}
ROWS = [  # step -> metrics as the trainer hands them over: NaN, a flag, a string and a list mixed in
    {"train/reward": 0.25, "policy/entropy": float("nan"), "alarm/ok": True, "note": "warm", "count": 3,
     "eval/success@k": 0.5, "sizes": [1, 2]},
    {"train/reward": 0.5, "policy/entropy": 1.25, "count": 4, "eval/success@k": 0.75},
    {"train/reward": 0.75, "policy/entropy": float("inf"), "count": 5},
]


# ------------------------------------------------------------------ config and build-time errors
def test_unknown_sink_or_no_jsonl_fails_at_config_time_naming_the_field():
    with pytest.raises(ConfigError) as info:
        check(load_config(overrides=["log.sinks=[jsonl,neptune]"]))
    assert info.value.field == "log.sinks" and "neptune" in str(info.value)
    assert f"valid names: {', '.join(SINKS)}" in str(info.value) and list(SINKS)[:2] == ["jsonl", "tensorboard"]
    with pytest.raises(ConfigError, match="jsonl is required") as info:
        load_config(overrides=["log.sinks=[tensorboard,wandb]"])
    assert info.value.field == "log.sinks"
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["log.wandb_mode=cloud"])
    assert info.value.field == "log.wandb_mode"
    assert load_config().log.sinks == ["jsonl", "tensorboard"]


@pytest.mark.parametrize("sink", ["wandb", "mlflow"])
def test_a_sink_whose_package_is_missing_fails_before_the_model_loads(sink, tmp_path, monkeypatch):
    from keelrl.train.trainer import Trainer

    monkeypatch.setitem(sys.modules, sink, None)  # `import wandb` now raises ImportError, as if not installed
    run_dir = tmp_path / "run"
    cfg = load_config(overrides=[f"run_dir={run_dir}", f"log.sinks=[jsonl,{sink}]"])  # config alone is fine
    with pytest.raises(ConfigError, match=rf"pip install 'keelrl\[{sink}\]'") as info:
        Trainer(cfg)
    assert info.value.field == "log.sinks" and not run_dir.exists()
    check_sinks(LogConfig(), run_dir)  # the default sinks need nothing extra


def test_mlflow_refusing_its_file_store_fails_at_build_time_with_the_fix(tmp_path, monkeypatch):
    mlflow_env = pytest.importorskip("mlflow.environment_variables")
    if not hasattr(mlflow_env, "MLFLOW_ALLOW_FILE_STORE"):
        pytest.skip("this MLflow opens a file store unasked")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match="MLFLOW_ALLOW_FILE_STORE=true") as info:
        check_sinks(LogConfig(sinks=["jsonl", "mlflow"]), tmp_path)
    assert info.value.field == "log.mlflow_tracking_uri" and (tmp_path / "mlruns").as_uri() in str(info.value)


def test_wandb_auto_mode_is_wandbs_own_choice_with_credentials_and_offline_without(tmp_path, monkeypatch):
    bare = {"NETRC": str(tmp_path / "no-netrc")}
    with pytest.warns(UserWarning, match="logging offline"):
        assert wandb_init_mode("auto", bare) == "offline"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert wandb_init_mode("auto", {**bare, "WANDB_MODE": "offline"}) is None  # W&B reads it itself
        assert wandb_init_mode("auto", {**bare, "WANDB_API_KEY": "k" * 40}) is None
        netrc = tmp_path / "netrc"
        netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
        assert wandb_init_mode("auto", {"NETRC": str(netrc)}) is None  # what `wandb login` writes
        assert wandb_init_mode("online", bare) == "online" and wandb_init_mode("offline", bare) == "offline"
    with pytest.warns(UserWarning):  # a key for another server is no login to this one
        assert wandb_init_mode("auto", {"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.com"}) == "offline"


def test_mlflow_names_and_params():
    assert mlflow_metric_name("policy/clip_frac") == "policy/clip_frac"
    assert mlflow_metric_name("eval/success@k") == "eval/success_k"
    assert mlflow_metric_name("a:b//c/") == "a_b/_/c/_" and mlflow_metric_name("../x") == "__/x"
    params = flat_params(CONFIG, limit=20)
    assert params["algo.preset"] == "grpo" and params["algo.eps_high"] == "0.28"
    assert params["perf.learner_cores"] == "[0, 1]" and params["env.tasks"] == "x" * 17 + "..."


# ------------------------------------------------------------------ W&B offline
def _wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file: W&B's 7-byte header, then LevelDB log records
    (32 KiB blocks; 7-byte record headers of CRC, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, position, pieces, records = 32768, 7, [], []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        pieces.append(data[position + 7:position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            records.append(record)
            pieces = []
    return records


def _wandb_run(folder: Path) -> dict:
    """One offline run folder as {id, config, history: {step: {key: value}}, summary, exit_code}."""
    (path,) = folder.glob("run-*.wandb")
    out: dict = {"history": {}, "summary": {}, "config": {}, "exit_code": None}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"] = record.run.run_id
            out["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            items = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            out["history"][items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind == "summary":
            out["summary"].update({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                                   for item in record.summary.update})
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def test_wandb_offline_holds_the_numeric_metrics_at_their_steps_and_resume_continues_the_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import wandb

    for name in ("WANDB_CONSOLE", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    run_dir = tmp_path / "run"
    settings = LogConfig(sinks=["jsonl", "wandb"], project="keel-test", run_name="sinks")
    try:
        with MetricsLogger(run_dir, settings, config=CONFIG) as logger:
            for step, row in enumerate(ROWS):
                logger.log(step, row)
            logger.log_summary({"rl_lift": {"success": 0.125}, "preset": "grpo", "heldout": {"final": {"x": 1}}})
        (first,) = (run_dir / "wandb").glob("offline-run-*")
        run_id = json.loads((run_dir / "wandb_run.json").read_text())["run_id"]
        # A folder is named by its start second and the run id: a resume within the same second
        # (only a test is that quick) would share the first attempt's folder.
        time.sleep(1)
        # Resumed from the step-1 checkpoint: step 2 is already in W&B (equal in a real resume), so
        # only 3 and 4 are sent, to the same run id; the error that ends the run marks it failed.
        with pytest.raises(RuntimeError, match="disk full"):
            with MetricsLogger(run_dir, settings, config=CONFIG, resume_after=1) as logger:
                for step in (2, 3, 4):
                    logger.log(step, {"train/reward": step / 10})
                raise RuntimeError("disk full")
        assert json.loads((run_dir / "wandb_run.json").read_text())["run_id"] == run_id
    finally:
        wandb.teardown()  # stops W&B's service process; only then is every record on disk (under load, not at finish)
    leftover = [p for p in psutil.Process().children(recursive=True) if "wandb" in " ".join(p.cmdline())]
    assert not leftover, leftover

    run = _wandb_run(first)
    assert run["id"] == run_id
    assert run["config"]["algo"] == CONFIG["algo"] and run["config"]["perf"] == CONFIG["perf"]
    # None (NaN, inf), booleans, strings and lists never reach W&B; ints stay ints
    assert run["history"] == {0: {"train/reward": 0.25, "count": 3, "eval/success@k": 0.5},
                              1: {"train/reward": 0.5, "policy/entropy": 1.25, "count": 4, "eval/success@k": 0.75},
                              2: {"train/reward": 0.75, "count": 5}}
    assert run["summary"]["summary/rl_lift/success"] == 0.125 and "summary/heldout/final/x" not in run["summary"]
    assert run["exit_code"] == 0
    (second,) = set((run_dir / "wandb").glob("offline-run-*")) - {first}
    resumed = _wandb_run(second)
    assert resumed["id"] == run_id
    assert resumed["history"] == {3: {"train/reward": 0.3}, 4: {"train/reward": 0.4}}
    assert resumed["exit_code"] == 1
    assert [row["step"] for row in read_metrics(run_dir)] == [0, 1, 2, 3, 4]  # jsonl: the resumed values
    assert read_metrics(run_dir)[2]["train/reward"] == 0.2


# ------------------------------------------------------------------ MLflow file store
@pytest.fixture
def mlflow_file_store(monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def _mlflow(run_dir: Path):
    from mlflow.tracking import MlflowClient

    record = json.loads((run_dir / "mlflow_run.json").read_text())
    client = MlflowClient(tracking_uri=record["tracking_uri"])
    return client, record["run_id"]


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, key))


def test_mlflow_file_store_holds_params_and_metrics_and_resume_reopens_the_run(tmp_path, mlflow_file_store):
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    run_dir = tmp_path / "run"
    settings = LogConfig(sinks=["jsonl", "mlflow"], project="keel-test")
    with MetricsLogger(run_dir, settings, config=CONFIG) as logger:
        for step, row in enumerate(ROWS):
            logger.log(step, row)
        logger.log_summary({"rl_lift": {"success": 0.125}, "preset": "grpo"})
    client, run_id = _mlflow(run_dir)
    assert json.loads((run_dir / "mlflow_run.json").read_text())["tracking_uri"] == (run_dir / "mlruns").as_uri()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"  # the run directory's name
    assert client.get_experiment(run.info.experiment_id).name == "keel-test"
    assert run.data.params["algo.preset"] == "grpo" and run.data.params["perf.learner_cores"] == "[0, 1]"
    assert len(run.data.params["env.tasks"]) == MAX_PARAM_VAL_LENGTH and run.data.params["env.tasks"].endswith("...")
    assert _history(client, run_id, "train/reward") == [(0, 0.25), (1, 0.5), (2, 0.75)]
    assert _history(client, run_id, "policy/entropy") == [(1, 1.25)]  # NaN and inf skipped
    assert _history(client, run_id, "count") == [(0, 3.0), (1, 4.0), (2, 5.0)]
    assert _history(client, run_id, "eval/success_k") == [(0, 0.5), (1, 0.75)]
    assert set(run.data.metrics) == {"train/reward", "policy/entropy", "count", "eval/success_k",
                                     "summary/rl_lift/success"}  # no flag, string or list
    assert _history(client, run_id, "summary/rl_lift/success") == [(2, 0.125)]

    # Resume from the step-1 checkpoint with a changed learning rate: the same run, step 2 kept
    # from the first attempt, the change recorded; Ctrl-C ends it KILLED.
    with pytest.raises(KeyboardInterrupt):
        with MetricsLogger(run_dir, settings, config={**CONFIG, "optim": {**CONFIG["optim"], "lr": 2e-5}},
                           resume_after=1) as logger:
            for step in (2, 3):
                logger.log(step, {"train/reward": step / 10})
            raise KeyboardInterrupt
    assert _mlflow(run_dir)[1] == run_id
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and len(client.search_runs([run.info.experiment_id])) == 1
    assert _history(client, run_id, "train/reward") == [(0, 0.25), (1, 0.5), (2, 0.75), (3, 0.3)]
    assert run.data.tags["keelrl.resumed_at_step_1"] == "optim.lr: 1e-05 -> 2e-05"
    assert run.data.params["optim.lr"] == "1e-05"  # params are the run's start; MLflow cannot change them


def test_mlflow_added_at_a_resume_gets_the_earlier_steps_from_metrics_jsonl_and_names_stay_distinct(tmp_path, mlflow_file_store):
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, LogConfig(sinks=["jsonl"])) as logger:
        for step, row in enumerate(ROWS):
            logger.log(step, row)
    with MetricsLogger(run_dir, LogConfig(sinks=["jsonl", "mlflow"]), resume_after=1) as logger:
        logger.log(2, {"train/reward": 0.2})
        with pytest.raises(ValueError, match="both become MLflow metric 'eval/success_k'"):
            logger.log(3, {"eval/success_k": 1.0})  # a second key that sanitises to a name in use
    client, run_id = _mlflow(run_dir)
    assert _history(client, run_id, "train/reward") == [(0, 0.25), (1, 0.5), (2, 0.2)]
    assert client.get_run(run_id).info.status == "FINISHED"


# ------------------------------------------------------------------ the trainer
def test_a_tiny_training_run_logs_to_mlflow_what_metrics_jsonl_holds(tiny_model_dir, tmp_path, mlflow_file_store,
                                                                     monkeypatch, capsys):
    from keelrl.train.trainer import Trainer

    run_dir = tmp_path / "run"
    cfg = load_config(overrides=[
        *TINY_RUN, *FAST_RUN, f"run_dir={run_dir}", f"model.path={tiny_model_dir}", "train.steps=2",
        "eval.every=2", "eval.tasks=3", "train.minibatch_size=2", "output.sample_trajectories=1",
        "log.sinks=[jsonl,tensorboard,mlflow]"])
    summary = Trainer(cfg).run()
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [0, 1, 2]
    client, run_id = _mlflow(run_dir)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["log.sinks"] == '["jsonl", "tensorboard", "mlflow"]'
    assert run.data.params["train.steps"] == "2" and run.data.params["algo.preset"] == cfg.algo.preset
    for key in ("train/reward", "policy/entropy", "eval/success", "time/step_s"):
        expected = [(row["step"], float(row[key])) for row in rows if isinstance(row.get(key), (int, float))]
        assert expected and _history(client, run_id, key) == expected, key
    assert _history(client, run_id, "summary/eval_success_after_rl") == [(2, summary["eval_success_after_rl"])]


    # `keel eval` of the run logs nowhere, so it needs no MLflow even though the run's config names it
    from keelrl.cli import main

    monkeypatch.setitem(sys.modules, "mlflow", None)
    assert main(["eval", str(run_dir)]) == 0
    assert "eval/success" in json.loads(capsys.readouterr().out)
