"""The `keel` command line: the real console script, run as a user runs it, for the entry point
itself (`keel --version`, `keel algos`); the other commands through its function in this process
(conftest.keel_cli), as the script calls it."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import keel_cli

from keelrl.algos import ALL, PRESETS, AlgoConfig
from keelrl.cli import main

REPO = Path(__file__).resolve().parents[1]


def keel(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("keel", path=str(Path(sys.executable).parent))
    assert exe, "the keel console script is not installed next to this interpreter"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_keel_algos_prints_the_table_for_every_preset():
    result = keel("algos")
    assert result.returncode == 0, result.stderr
    for name in PRESETS:
        assert re.search(rf"^\S*\s*{re.escape(name)}\s", result.stdout, re.MULTILINE), name
    for column in ("credit assignment", "token weighting", "update limit"):
        assert column in result.stdout


def test_keel_algos_json_matches_the_registries(capsys):
    assert main(["algos", "--format", "json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert [row["preset"] for row in payload["presets"]] == list(PRESETS)
    assert {kind: list(names) for kind, names in payload["components"].items()} == \
        {kind: registry.names() for kind, registry in ALL.items()}
    dapo = next(row for row in payload["presets"] if row["preset"] == "dapo")
    assert dapo["components"]["clip"] == AlgoConfig(preset="dapo").clip
    assert dapo["dynamic_sampling"] is True


def test_keel_algos_single_preset_and_unknown_preset(capsys):
    assert main(["algos", "--preset", "cispo", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["presets"]
    assert [row["preset"] for row in rows] == ["cispo"]
    assert main(["algos", "--preset", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'nope'" in err and "grpo" in err


def test_keel_config_resolves_and_rejects():
    ok = keel_cli("config", "configs/dapo.yaml", "algo.entropy_coef=0.01")
    assert ok.returncode == 0, ok.stderr
    assert "eps_high: 0.28" in ok.stdout and "entropy_coef: 0.01" in ok.stdout
    bad = keel_cli("config", "algo.clip=ppo2")
    assert bad.returncode == 2
    assert "algo.clip" in bad.stderr and "dual_clip" in bad.stderr


def test_keel_config_explain_lists_fields(capsys):
    assert main(["config", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "algo.eps_high" in out and "clip-higher" in out


def test_keel_version():
    result = keel("--version")
    assert result.returncode == 0 and "keelrl" in result.stdout


@pytest.mark.parametrize("argv", [[], ["frobnicate"]])
def test_bad_usage_exits_nonzero(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code != 0


def test_config_file_path_containing_equals_is_a_file_not_an_override(tmp_path, capsys):
    run_dir = tmp_path / "lr=3e-4"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("algo:\n  preset: cispo\n")
    assert main(["config", str(run_dir / "config.yaml")]) == 0
    assert "clip: cispo" in capsys.readouterr().out


def test_keel_tasks_export_and_validate(tmp_path):
    out = tmp_path / "heldout.jsonl"
    exported = keel_cli("tasks", "export", "--split", "heldout", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    lines = out.read_text().splitlines()
    assert len(lines) >= 100 and f"wrote {len(lines)} tasks" in exported.stderr
    sample = tmp_path / "sample.jsonl"
    sample.write_text("\n".join(lines[:3]) + "\n")
    ok = keel_cli("tasks", "validate", str(sample))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "3 tasks, 0 problems" in ok.stderr
    broken = json.loads(lines[0])
    broken["reference_fix"] = {broken["entry_file"]: broken["files"][broken["entry_file"]]}  # "fix" = the bug
    (tmp_path / "broken.jsonl").write_text(json.dumps(broken) + "\n")
    bad = keel_cli("tasks", "validate", str(tmp_path / "broken.jsonl"))
    assert bad.returncode == 1 and "the reference fix fails" in bad.stdout
    (tmp_path / "malformed.jsonl").write_text('{"id": "x"}\n')
    malformed = keel_cli("tasks", "validate", str(tmp_path / "malformed.jsonl"))
    assert malformed.returncode == 2 and "missing fields" in malformed.stderr


def test_overrides_may_follow_options(monkeypatch):
    """`keel lab NAME --out DIR key=value`: overrides after an option still reach the command."""
    import keelrl.cli as cli

    seen = {}

    def fake_lab(args):
        seen.update(out=args.out, overrides=args.overrides, quick=args.quick)
        return 0

    monkeypatch.setattr(cli, "_cmd_lab", fake_lab)
    assert main(["lab", "credit", "a.b=1", "--out", "/tmp/x", "optim.lr=1e-3", "--quick", "c=2"]) == 0
    assert seen == {"out": "/tmp/x", "overrides": ["a.b=1", "optim.lr=1e-3", "c=2"], "quick": True}
    with pytest.raises(SystemExit):  # a stray word is still an error, not silently dropped
        main(["lab", "credit", "--out", "/tmp/x", "notanoverride"])


def test_docs_algorithm_table_is_what_the_registries_generate():
    """docs/algorithms.md is `keel algos --format markdown`: a preset or component added, renamed or
    redescribed without regenerating it fails here."""
    from pathlib import Path

    from keelrl.algos import ALL, PRESETS
    from keelrl.algos.catalogue import comparison_markdown

    committed = (Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
    assert committed == comparison_markdown(), "regenerate: keel algos --format markdown > docs/algorithms.md"
    for name in PRESETS:
        assert f"| `{name}` |" in committed
    for registry in ALL.values():
        for entry in registry.entries():
            assert f"| `{entry.name}` |" in committed


def test_keel_algos_markdown_prints_the_same_text(capsys):
    from keelrl.algos.catalogue import comparison_markdown
    from keelrl.cli import main

    assert main(["algos", "--format", "markdown"]) == 0
    assert capsys.readouterr().out == comparison_markdown()


def test_train_with_a_bad_task_file_says_so_in_one_line_before_loading_a_model(tmp_path, capsys):
    from keelrl.cli import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    model = tmp_path / "not-a-model"  # passes the path check; loading it would fail differently
    model.mkdir()
    (model / "config.json").write_text("{}")
    for source, message in ((tmp_path / "missing.jsonl", "No such file"), (empty, "0 train and 0 held-out tasks"),
                            (broken, "broken.jsonl:1")):
        assert main(["train", f"env.tasks={source}", f"model.path={model}", f"run_dir={tmp_path / 'r'}"]) == 2
        err = capsys.readouterr().err
        assert "keel: config error: env.tasks" in err and message in err and "Traceback" not in err


def test_a_misspelled_model_path_is_one_line_with_a_did_you_mean(tmp_path):
    result = keel_cli("train", "model.path=smollm3", f"run_dir={tmp_path / 'run'}")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("keel: config error: model.path:") and "did you mean 'smollm2'" in result.stderr
    assert not (tmp_path / "run").exists()
