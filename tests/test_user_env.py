"""A user's environment package through every `keel` command, as its author would run them.

examples/units_env is a separate package (`keel-units`, installed beside keelrl by .ci/run and
the README's test setup) that declares its environments under the `keelrl.envs` entry point
group: `units` (a strict verifier) and `units_lenient` (a factory returning a spec whose verifier
accepts anything within 1.0). Nothing here registers them: keelrl finds them by name, or by
import path, in every command: the first training run in a fresh process (the real `keel`
console script), the other commands through the script's own function in this process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import keel_cli

from keelrl.components import check
from keelrl.config import load_config
from keelrl.envs.registry import ENVIRONMENTS, env_spec, settle_env
from keelrl.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]

try:
    import keel_units
except ImportError as error:  # a failure, not a skip: CI must run these
    raise ImportError("the user-style environment package is not installed: "
                      "pip install -e examples/units_env") from error

QUICK = ["model.path=tiny", "algo.preset=grpo", "warm_start.demos=24", "warm_start.epochs=2", "warm_start.batch_size=8",
         "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=24", "rollout.engine=sync",
         "train.minibatch_size=4", "eval.tasks=6", "perf.learner_precision=float32", "eval.dtype=float32"]


def keel_process(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("keel", path=str(Path(sys.executable).parent))
    assert exe, "the keel console script is not installed next to this interpreter"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_the_entry_points_and_the_import_path_name_the_same_environment():
    assert "units" not in ENVIRONMENTS  # found through the entry point, not registered
    assert env_spec("units") is keel_units.UNITS
    assert env_spec("keel_units:UNITS") is keel_units.UNITS
    lenient = env_spec("units_lenient")  # the entry point names a factory: called for the spec
    assert lenient.name == "units_lenient" and lenient.answer_tools == ("answer",)


def test_bad_names_are_one_line_errors_naming_env_name():
    for name, expected in (("unitz", "unknown environment 'unitz'"),
                           ("keel_units:UNITZ", "has no attribute 'UNITZ'"),
                           ("no_such_pkg:X", "cannot import 'no_such_pkg'"),
                           ("keel_units:make_tasks", "gives list, not an EnvSpec")):
        with pytest.raises(ConfigError) as info:
            check(load_config(overrides=[f"env.name={name}"]))
        assert info.value.field == "env.name" and expected in str(info.value), name
    result = keel_cli("train", "env.name=unitz", "run_dir=/nonexistent")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "units" in result.stderr  # the valid names include the entry point's


def test_the_environments_own_max_turns_is_honoured_and_a_conflict_names_both():
    spec = check(load_config(overrides=["env.name=units"]))
    assert settle_env(load_config(overrides=["env.name=units"]), spec).env.max_turns == 3
    assert settle_env(load_config(overrides=["env.name=units", "env.max_turns=3"]), spec).env.max_turns == 3
    with pytest.raises(ConfigError) as info:
        check(load_config(overrides=["env.name=units", "env.max_turns=6"]))
    assert info.value.field == "env.max_turns" and "6" in str(info.value) and "max_turns=3" in str(info.value)
    # The built-in kinds take env.max_turns: unset gives their default, set gives what was set.
    coding = check(load_config())
    assert settle_env(load_config(), coding).env.max_turns == 5
    assert settle_env(load_config(overrides=["env.max_turns=2"]), coding).env.max_turns == 2


@pytest.mark.parametrize("setting", ["env.partial_credit=true", "env.show_file=false", "env.show_tools=true",
                                     "env.guess_n=8", "env.tasks=real", "env.shaping=0.5", "env.verifier=weak"])
def test_a_setting_the_environment_does_not_read_is_refused(setting):
    with pytest.raises(ConfigError) as info:
        check(load_config(overrides=["env.name=units", setting]))
    assert info.value.field == setting.split("=")[0], setting
    assert "units" in str(info.value)


def test_every_keel_command_takes_the_users_environment(tmp_path):
    run = tmp_path / "run"
    config = keel_cli("config", "env.name=units", *QUICK)
    assert config.returncode == 0, config.stderr
    assert "name: units" in config.stdout and "max_turns: 3" in config.stdout

    train = keel_process("train", "env.name=units", *QUICK, "train.steps=1", f"run_dir={run}")
    assert train.returncode == 0, train.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["heldout"]["final"]["tasks"] == 6
    episodes = [json.loads(line) for line in (run / "episodes" / "step_0001.jsonl").read_text().splitlines()]
    assert episodes and all("Convert " in json.dumps(e) for e in episodes)  # rollouts ran in the user's env
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["warm_start/demos"] == 24  # the user's teacher demonstrated every task

    resumed = keel_cli("train", "--resume", str(run), "train.steps=2")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 2

    evaluated = keel_cli("eval", str(run), "eval.tasks=4")
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["eval/tasks"] == 4

    again = keel_cli("config", str(run / "config.yaml"))
    assert again.returncode == 0 and "name: units" in again.stdout, again.stderr

    view = keel_cli("view", str(run))
    assert view.returncode == 0, view.stderr
    assert "Convert " in (run / "view.html").read_text()

    audit = keel_cli("audit", "--env", "units", "--limit", "20", "--format", "json")
    assert audit.returncode == 0, audit.stderr  # the strict verifier has no hole the probes find
    assert json.loads(audit.stdout)["tasks"] == 20
    hole = keel_cli("audit", "--env", "units_lenient", "--limit", "20")
    assert hole.returncode == 1 and "constant" in hole.stdout, hole.stdout + hole.stderr


def test_the_import_path_trains_through_the_python_api(tmp_path, capsys):
    import keelrl

    trainer = keelrl.Trainer(keelrl.configure(None, "env.name=keel_units:UNITS", *QUICK, "train.steps=1",
                                              "warm_start.demos=8"), run_dir=tmp_path / "api")
    assert trainer.cfg.env.max_turns == 3 and trainer.env_spec is keel_units.UNITS
    summary = trainer.train()
    assert summary["steps"] == 1
    assert "warm start" in capsys.readouterr().err  # train() shows its progress as `keel train` does


def test_the_api_warm_start_takes_the_users_environment(tmp_path):
    import keelrl
    from keelrl.policy.model import load_policy

    # The spec given is the run's environment: its own turn limit holds against the config's.
    with pytest.raises(ConfigError, match="env.max_turns=6, but the environments of the units environment"):
        keelrl.warm_start(keelrl.configure(None, *QUICK, "env.max_turns=6"), tmp_path / "no", env=keel_units.UNITS)
    cfg = keelrl.configure(None, *QUICK, "warm_start.demos=8", "warm_start.own_mistakes=0")
    out = keelrl.warm_start(cfg, tmp_path / "warm", env=keel_units.UNITS, run_dir=tmp_path / "run")
    model, tokenizer = load_policy(str(out), "cpu")  # a complete model directory
    assert tokenizer.chat_template and sum(p.numel() for p in model.parameters()) > 0
    assert not (tmp_path / "no").exists()
