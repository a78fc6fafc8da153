"""The Python API (keelrl.api): configure, explain, with_paths, warm_start, Trainer(...).train(),
and the quickstart's three lines run as written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST_RUN

import keelrl
from keelrl.api import with_paths
from keelrl.config import KeelConfig, load_config
from keelrl.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
FAST = [*FAST_RUN, "eval.tasks=3", "train.minibatch_size=4", "eval.base=false", "rollout.engine=sync",
        "algo.dynamic_sampling=false"]  # the untrained tiny model's groups are all-fail: nothing would be kept


def test_import_keelrl_is_light_and_names_resolve():
    code = ("import sys, keelrl; light = 'torch' not in sys.modules; "
            "names = [keelrl.configure, keelrl.Trainer, keelrl.ADVANTAGES, keelrl.check_env, keelrl.warm_start]; "
            "print(light, all(callable(n) or hasattr(n, 'register') for n in names))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["True", "True"], result.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        keelrl.nope  # noqa: B018


def test_configure_from_nothing_a_file_a_mapping_or_a_config(tmp_path):
    assert keelrl.configure() == load_config()
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 3\nalgo:\n  preset: dapo\n")
    from_file = keelrl.configure(path, "optim.lr=1e-4")
    assert (from_file.train.steps, from_file.algo.preset, from_file.optim.lr) == (3, "dapo", 1e-4)
    from_mapping = keelrl.configure({"train": {"steps": 3}, "algo": {"preset": "dapo"}}, "optim.lr=1e-4")
    assert from_mapping == from_file
    again = keelrl.configure(from_file, "train.steps=5")
    assert again.train.steps == 5 and again.algo.preset == "dapo" and from_file.train.steps == 3
    assert isinstance(again, KeelConfig)


def test_configure_names_the_bad_field_before_any_work():
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        keelrl.configure(None, "optim.lr=-1")
    with pytest.raises(ConfigError, match="algo.clpi"):
        keelrl.configure({"algo": {"clpi": "ppo"}})
    with pytest.raises(ConfigError, match="a YAML path, a mapping or a KeelConfig"):
        keelrl.configure(42)  # type: ignore[arg-type]


def test_explain_is_the_field_docstrings():
    text = keelrl.explain("output.save_episodes")
    assert text.startswith("output.save_episodes = 64") and "keel view" in text
    section = keelrl.explain("rollout")
    names = [line.split(" = ")[0] for line in section.splitlines() if not line.startswith(" ")]
    assert "rollout.group_size" in names and all(name.startswith("rollout.") for name in names)
    with pytest.raises(ConfigError, match="no such config field"):
        keelrl.explain("train.nope")


def test_with_paths_keeps_paths_as_strings():
    cfg = with_paths(load_config(), model="1e3", tasks="true", run_dir="runs/x")
    assert (cfg.model.path, cfg.env.tasks, cfg.run_dir) == ("1e3", "true", "runs/x")
    assert with_paths(cfg) is cfg


def test_quickstart_three_lines_run_as_written(tiny_model_dir, tmp_path, monkeypatch):
    """docs/quickstart.md's Python block, executed; only its size is cut (configure gets the fast
    overrides appended and `model="tiny"` becomes the small tiny model)."""
    page = (REPO / "docs" / "quickstart.md").read_text()
    block = re.search(r"## In Python\n\n```python\n(.*?)```", page, re.DOTALL)
    assert block is not None
    code = block.group(1)
    assert code.count("\n") == 3 and "keelrl.Trainer(" in code and ".train()" in code
    original = keelrl.configure
    monkeypatch.setattr(keelrl, "configure", lambda *args: original(*args, *FAST, f"run_dir={tmp_path / 'run'}",
                                                                    f"model.path={tiny_model_dir}"))
    monkeypatch.chdir(REPO)
    namespace: dict = {}
    exec(code.replace('model="tiny"', f'model="{tiny_model_dir}"'), namespace)  # noqa: S102
    summary = namespace["summary"]
    assert summary["steps"] == 2
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary


def test_warm_start_then_train_from_it(tiny_model_dir, tmp_path):
    cfg = keelrl.configure(None, *FAST, f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'w'}")
    warm = keelrl.warm_start(cfg, tmp_path / "warm")
    assert (warm / "config.json").exists() and (warm / "tokenizer_config.json").exists()
    trainer = keelrl.Trainer(keelrl.configure(cfg, "train.steps=1", "warm_start.demos=0"), model=warm,
                             run_dir=tmp_path / "rl")
    assert trainer.cfg.model.path == str(warm) and trainer.run_dir == tmp_path / "rl"
    summary = trainer.train()
    assert summary["steps"] == 1 and "warm_start/demos" not in summary  # no second warm start


def test_a_user_advantage_estimator_plugs_in_by_name(tiny_model_dir, tmp_path):
    """Registered through the public registry, then named in the config like a built-in one."""
    import torch

    from keelrl.algos.advantages import AdvantageOutput

    seen: list[torch.Tensor] = []

    def sign_of_reward(*, token_rewards, mask, group_ids, values, turn_ids, cfg):
        """token_rewards [B, T] -> [B, T]: +1 at every action token of a rewarded episode, else -1."""
        scores = token_rewards.sum(dim=1)  # [B]
        advantages = torch.where(scores > 0, 1.0, -1.0)[:, None].expand_as(token_rewards) * mask
        seen.append(advantages)
        return AdvantageOutput(advantages=advantages, returns=advantages)

    keelrl.ADVANTAGES.register("test_sign_of_reward", summary="+1 / -1 by the episode's reward")(sign_of_reward)
    try:
        cfg = keelrl.configure(None, *FAST, "algo.advantage=test_sign_of_reward", "train.steps=1",
                               f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}")
        assert cfg.algo.advantage == "test_sign_of_reward"
        keelrl.Trainer(cfg).train()
    finally:  # the registry is process-wide: leave it as keelrl fills it (docs/algorithms.md is generated from it)
        keelrl.ADVANTAGES.unregister("test_sign_of_reward")
    assert "test_sign_of_reward" not in keelrl.ADVANTAGES
    assert seen, "the trainer never called the registered estimator"
    episodes = [json.loads(line) for line in (tmp_path / "run" / "episodes" / "step_0001.jsonl").read_text().splitlines()]
    for episode in episodes:
        expected = 1.0 if episode["reward"] > 0 else -1.0
        assert {token[1] for turn in episode["turns"] for token in turn["tokens"] or []} == {expected}
