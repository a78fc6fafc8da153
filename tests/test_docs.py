"""docs/ stays true to the code: links, config overrides and keys, command lines, lab names,
paths and metric names, and the examples the guides show.

What counts as code: fenced blocks (```...```) and inline `spans`. An override is any
`section.key=value` in code; the overrides of one code line or one inline span are loaded
together (`load_config(None, [...])`), so dependent settings (`distill.mode=on_policy
distill.teacher=PATH`) go in one span. A value that is an upper-case placeholder (NAME, PATH, N)
is checked only for its key. A command is a code line or span starting with `keel `; it must
parse as `keel` itself parses it (keelrl.cli.main).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shlex
import sys
import types
from pathlib import Path

import pytest

from keelrl.cli import _looks_like_override, build_parser
from keelrl.components import explain
from keelrl.config import KeelConfig, load_config
from keelrl.errors import ConfigError
from keelrl.labs import LABS

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [*DOCS, REPO / "README.md"]

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
OVERRIDE = re.compile(r"(?<![\w./=-])((?:[a-z_][a-z0-9_]*\.)+[a-z_][a-z0-9_]*)=([^\s\"'`]*)")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")
SYNTAX = {"dotted.key=value"}
"""The override syntax itself, as the docs spell it out."""
SHELL_OPERATORS = {">", ">>", "<", "|", "&&", "||", ";", "2>&1", "&"}
KEYS = {path for path, _, _ in explain()}
SECTIONS = {f.name for f in dataclasses.fields(KeelConfig)}


def text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def fenced_blocks(page_text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block."""
    return [(info.strip(), body) for info, body in FENCE.findall(page_text)]


def prose(page_text: str) -> str:
    """The page without its fenced blocks."""
    return FENCE.sub("", page_text)


def inline_spans(page_text: str) -> list[str]:
    return [span.strip() for _, span in INLINE.findall(prose(page_text))]


def code_lines(page_text: str) -> list[str]:
    """Every line of every fenced block that is not Python, YAML or JSON (those have their own
    checks), with backslash continuations joined and a leading `$ ` prompt dropped."""
    lines = []
    for info, body in fenced_blocks(page_text):
        if info.split()[:1] and info.split()[0] in ("python", "yaml", "json"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            lines.append(line.strip().removeprefix("$ "))
    return lines


def code_units(page: Path) -> list[str]:
    """The places overrides and commands are read from: each code line and each inline span."""
    page_text = text(page)
    python_lines = [line for info, body in fenced_blocks(page_text) if info.startswith("python")
                    for line in body.splitlines()]
    return [*code_lines(page_text), *python_lines, *inline_spans(page_text)]


def where(page: Path, unit: str) -> str:
    return f"{page.relative_to(REPO)}: {unit[:120]!r}"


# ----------------------------------------------------------------- links


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(text(page)).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = github_slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_every_relative_link_resolves():
    bad = []
    for page in PAGES:
        page_prose = INLINE.sub("", prose(text(page)))
        for target in LINK.findall(page_prose):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                bad.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                bad.append(f"{page.relative_to(REPO)}: {target} (no heading #{anchor} in {resolved.name})")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_slug_rule_matches_githubs_on_the_generated_tables():
    # algorithms.md's component headings are `algo.NAME`; GitHub drops the backticks and the dot.
    assert {"algorithms", "algoadvantage", "algoclip", "algokl_estimator"} <= anchors(REPO / "docs" / "algorithms.md")


def test_the_index_lists_every_page():
    index = text(REPO / "docs" / "README.md")
    missing = [page.name for page in DOCS if page.name != "README.md" and f"]({page.name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


# ----------------------------------------------------------------- config overrides and keys


def overrides_in(unit: str) -> list[str]:
    return [f"{key}={value}" for key, value in OVERRIDE.findall(unit) if f"{key}={value}" not in SYNTAX]


def config_file_in(unit: str) -> Path | None:
    """A YAML config named on a `keel train/config` line, when it exists in the repository."""
    for word in unit.split():
        if word.endswith((".yaml", ".yml")) and (REPO / word).is_file():
            return REPO / word
    return None


def config_problem(overrides: list[str], path: Path | None) -> str | None:
    """None when the overrides load together; else the error. A placeholder value that the
    config refuses (algo.preset=NAME) is dropped and its key alone checked."""
    remaining = list(overrides)
    for override in overrides:
        key = override.partition("=")[0]
        if key not in KEYS:
            return f"unknown key {key!r}"
    while True:
        try:
            load_config(path, remaining)
            return None
        except ConfigError as error:
            placeholder = next((o for o in remaining if o.partition("=")[0] == error.field
                                and PLACEHOLDER.fullmatch(o.partition("=")[2])), None)
            if placeholder is None:
                return str(error)
            remaining.remove(placeholder)


def test_every_documented_override_is_valid(monkeypatch):
    # the docs' rollout.decoder=vllm lines are for a venv with vLLM (.ci/vllm builds one): valid there
    monkeypatch.setattr("keelrl.config.vllm_installed", lambda: True)
    bad, seen = [], 0
    for page in DOCS:
        for unit in code_units(page):
            overrides = overrides_in(unit)
            if not overrides:
                continue
            seen += len(overrides)
            problem = config_problem(overrides, config_file_in(unit))
            if problem:
                bad.append(f"{where(page, unit)}: {problem}")
    assert seen > 50, f"only {seen} overrides found: the extraction is broken"
    assert not bad, "invalid config overrides in docs:\n" + "\n".join(bad)


def test_the_override_check_rejects_what_it_should():
    assert config_problem(["algo.preset=dapo"], None) is None
    assert config_problem(["algo.preset=NAME"], None) is None  # a placeholder: the key exists
    assert config_problem(["distill.mode=on_policy", "distill.teacher=PATH"], None) is None
    assert "unknown key" in config_problem(["rolout.engine=async"], None)
    assert config_problem(["algo.preset=dapo2"], None)
    assert config_problem(["distill.mode=on_policy"], None)  # needs its teacher in the same span
    assert overrides_in("keel train rollout.worker_cores=[1] a.b=c") == ["rollout.worker_cores=[1]", "a.b=c"]
    assert overrides_in('keelrl.config("configs/tiny.yaml", "train.steps=2")') == ["train.steps=2"]
    assert overrides_in("runs/lr=3e-4/x") == []


def test_every_documented_config_key_exists():
    """An inline span that is a dotted config key (`rollout.max_staleness`) names a real field."""
    key_span = re.compile(rf"(?:{'|'.join(sorted(SECTIONS))})\.[a-z_][a-z0-9_]*")
    bad = [where(page, span) for page in DOCS for span in inline_spans(text(page))
           if key_span.fullmatch(span) and span not in KEYS]
    assert not bad, "unknown config keys in docs:\n" + "\n".join(bad)


def test_every_yaml_block_is_a_valid_config(tmp_path):
    bad, seen = [], 0
    for page in DOCS:
        for info, body in fenced_blocks(text(page)):
            if info != "yaml":
                continue
            seen += 1
            path = tmp_path / "block.yaml"
            path.write_text(body)
            try:
                load_config(path)
            except ConfigError as error:
                bad.append(f"{page.relative_to(REPO)}: {error}\n{body}")
    assert seen >= 5
    assert not bad, "invalid YAML configs in docs:\n" + "\n".join(bad)


# ----------------------------------------------------------------- commands and labs


def command_words(unit: str) -> list[str] | None:
    """The argv of a `keel ...` line (comments and shell redirections cut off), else None."""
    if not unit.startswith("keel "):
        return None
    words = shlex.split(unit, comments=True)
    for i, word in enumerate(words):
        if word in SHELL_OPERATORS:
            return words[1:i]
    return words[1:]


def parse_problem(argv: list[str]) -> str | None:
    """None when `keel ARGV` parses as keelrl.cli.main would parse it; else why not."""
    parser = build_parser()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args, extra = parser.parse_known_args(argv)
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]
    stray = [a for a in extra if not (hasattr(args, "overrides") and _looks_like_override(a))]
    return f"unrecognized arguments: {stray}" if stray else None


def documented_commands() -> list[tuple[Path, str, list[str]]]:
    """(page, line, argv) of every command in a fenced block, and of every inline span that
    gives arguments: a bare `keel report` in prose names the subcommand, it is not a command line."""
    found = []
    for page in DOCS:
        page_text = text(page)
        spans = [span for span in inline_spans(page_text) if len((command_words(span) or [])) > 1]
        for unit in [*code_lines(page_text), *spans]:
            argv = command_words(unit)
            if argv is not None:
                found.append((page, unit, argv))
    return found


def test_every_named_subcommand_exists():
    subcommands = set(next(a for a in build_parser()._actions if a.dest == "command").choices)
    named = {(page, span) for page in DOCS for span in inline_spans(text(page)) if command_words(span)}
    bad = [where(page, span) for page, span in sorted(named) if command_words(span)[0] not in subcommands]
    assert not bad, "keel subcommands named in docs that do not exist:\n" + "\n".join(bad)


def test_every_documented_command_parses():
    commands = documented_commands()
    assert len(commands) > 40, f"only {len(commands)} commands found: the extraction is broken"
    bad = [f"{where(page, unit)}: {problem}" for page, unit, argv in commands
           if argv[:1] and (problem := parse_problem(argv))]
    assert not bad, "command lines in docs that keel does not accept:\n" + "\n".join(bad)


def test_the_command_check_rejects_what_it_should():
    assert parse_problem(["lab", "credit", "--quick", "train.steps=2"]) is None
    assert parse_problem(["tasks", "check"])  # the choices are export and validate
    assert parse_problem(["train", "--resmue", "runs/default"])
    assert parse_problem(["eval"])  # run_dir is required
    assert command_words("keel algos --format markdown > docs/algorithms.md") == ["algos", "--format", "markdown"]
    assert command_words("keel train   # the default run") == ["train"]


def test_every_named_lab_exists_and_every_lab_is_documented():
    named: dict[str, str] = {}
    for page in PAGES:
        for unit in code_units(page):
            for name in re.findall(r"\bkeel lab ([a-z][a-z0-9-]*)", unit):
                named.setdefault(name, str(page.relative_to(REPO)))
    named.pop("list", None)
    unknown = {name: page for name, page in named.items() if name not in LABS}
    assert not unknown, f"labs named in docs but not in keelrl.labs.LABS: {unknown}"
    undocumented = sorted(set(LABS) - {name for page in DOCS if page.name != "README.md"
                                       for unit in code_units(page)
                                       for name in re.findall(r"\bkeel lab ([a-z][a-z0-9-]*)", unit)})
    assert not undocumented, f"labs no docs page shows: {undocumented}"


# ----------------------------------------------------------------- paths and metrics


def test_every_repository_path_in_code_exists():
    """An inline span that looks like a path in the repository (`keelrl/train/prm.py`,
    `configs/tiny.yaml`) names a file or folder that is there."""
    path_span = re.compile(r"(?:keelrl|configs|bench|tests|docs)/[\w./-]*")
    bad = [where(page, span) for page in DOCS for span in inline_spans(text(page))
           if path_span.fullmatch(span) and not (REPO / span).exists()]
    assert not bad, "paths in docs that do not exist:\n" + "\n".join(bad)


SOURCE = "\n".join(path.read_text(encoding="utf-8") for path in (REPO / "keelrl").rglob("*.py"))
METRIC = re.compile(r"(?:train|eval|policy|rollout|dynamic|value|prm|curriculum|distill|time|memory|engine"
                    r"|loss|warm_start|alarm)/[a-z0-9_<>]+")


def metric_logged(name: str) -> bool:
    """`name` appears as a metric key in keelrl's source: literally, as an f-string template
    (`rollout/staleness_frac_<lag>` ~ f"rollout/staleness_frac_{lag}"), or built from a prefix
    (`prm/accuracy` ~ "prm/" + f"{prefix}accuracy")."""
    pattern = re.escape(name).replace(re.escape("<"), "<").replace(re.escape(">"), ">")
    pattern = re.sub(r"<[^>]*>", r"\\{[^}]+\\}", pattern)
    if re.search('"' + pattern + '"', SOURCE):
        return True
    return any(f'"{name[:i]}"' in SOURCE and re.search(r"\{\w+\}" + re.escape(name[i:]) + '"', SOURCE)
               for i in range(name.index("/") + 1, len(name)))


def test_every_documented_metric_is_logged():
    names = {(page, span) for page in DOCS for span in inline_spans(text(page)) if METRIC.fullmatch(span)}
    assert len(names) > 40, "the metric extraction is broken"
    bad = [where(page, span) for page, span in sorted(names) if not metric_logged(span)]
    assert not bad, "metrics named in docs that keelrl never logs:\n" + "\n".join(bad)


def test_the_metric_check_rejects_what_it_should():
    assert metric_logged("policy/is_weight_max")
    assert metric_logged("rollout/staleness_frac_<lag>")
    assert metric_logged("prm/balanced_accuracy") and metric_logged("eval/prm_accuracy")
    assert not metric_logged("policy/is_weight_maximum")
    assert not metric_logged("prm/precision")


# ----------------------------------------------------------------- the guides' examples


def marked_block(page: str, marker: str) -> str:
    blocks = [body for info, body in fenced_blocks(text(REPO / "docs" / page))
              if info == "python" and body.startswith(f"# docs-test: {marker}\n")]
    assert len(blocks) == 1, f"docs/{page} needs exactly one python block starting '# docs-test: {marker}'"
    return blocks[0]


def test_the_example_environment_passes_check_env_and_runs():
    from keelrl.envs import Grade, check_env, run_episode
    from keelrl.envs.base import EnvCheckError

    module = types.ModuleType("docs_guide_environment")  # dataclasses look their module up
    sys.modules[module.__name__] = module
    try:
        exec(compile(marked_block("guide-environment.md", "run"), "docs/guide-environment.md", "exec"),
             module.__dict__)
    finally:
        del sys.modules[module.__name__]
    namespace = module.__dict__
    env, task = namespace["env"], namespace["task"]
    fresh = type(env)()
    check_env(fresh, task)  # the protocol with the default bad actions alone
    episode = run_episode(fresh, task, namespace["scripted"])
    assert isinstance(episode.grade, Grade) and episode.grade.success
    assert episode.turns[0].info.get("error"), "the example's first action is meant to be rejected"

    class RaisesOnBadAction(type(env)):  # check_env must catch what the example avoids
        def step(self, action_text):
            if "<call>" not in action_text:
                raise ValueError("no call")
            return super().step(action_text)

    with pytest.raises(EnvCheckError, match="raised"):
        check_env(RaisesOnBadAction(), task)


def test_the_chat_template_example_works_with_keelrl():
    from keelrl.policy.chat import ChatFormat
    from keelrl.policy.tiny import build_tiny_tokenizer

    namespace: dict = {}
    exec(compile(marked_block("guide-model.md", "template"), "docs/guide-model.md", "exec"), namespace)
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = namespace["TEMPLATE"]
    found = ChatFormat.of(tokenizer)
    assert tokenizer.eos_token_id in found.end_token_ids
    assert found.observation_role == "tool"


def test_the_example_task_is_the_bundled_one_and_validates():
    from keelrl.envs.coding_tasks import bundled_tasks
    from keelrl.envs.tasks import task_from_dict
    from keelrl.envs.verifiers import check_tasks

    (body,) = [body for info, body in fenced_blocks(text(REPO / "docs" / "guide-tasks.md")) if info == "json"]
    task = task_from_dict(json.loads(body))
    bundled = {t.id: t for t in bundled_tasks(None)}
    assert task == bundled[task.id], "docs/guide-tasks.md's example drifted from the bundled task"
    assert check_tasks([task]) == []
