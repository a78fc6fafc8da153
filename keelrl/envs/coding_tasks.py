"""The bundled coding tasks: the lecture's `retry_count` fixture and a seeded family of bug fixes.

Every generated task is one short module of plain Python (no imports) with a single bug of a
named kind (two in `two_defects`), a visible test file rendered by `render_test_file`, and hidden
checks made of the visible cases plus extra ones, exactly one of them marked `key`: the headline
case the bug breaks, as retries=0 is for the lecture's fixture. Each task ships the reference fix
(one or two lines replaced), a plausible `wrong_fix` (a partial fix that still fails a hidden check
and, where the bug allows, passes the key check, like the lecture's `config.get("retries", 3)`), and a
`brittle_phrase` from the reference fix that an equally good rewrite need not contain.

Three more kinds, `AGENT_KINDS`, are opt-in (`generate_tasks(seed, kinds=KINDS + AGENT_KINDS)`):
tasks where one look at the file rarely suffices and the output of the `test` tool says what to
change. In `hidden_edge_value` an edge case's expected value (a placeholder, a clamp bound, a
fallback, a wording) is stated only by the failing visible test of the key check, never by the
prompt or the code; the buggy code returns a wrong value there rather than crashing, so the test's
message shows the value. In `two_defects` a crash on some inputs hides a wrong value behind it: every
visible test the buggy code fails, fails with the crash; the wrong fix repairs only the crash, so the
key check passes and a different visible test fails with a wrong value; the reference fix repairs
both. In `tests_only_behaviour` the prompt names only the function and the files, and the code has
no docstring: the visible tests pin the behaviour (the buggy code and the wrong fix each fail one)
and the hidden checks are more cases of it. A wrong fix of these kinds may fail the key check too
(a guessed fallback does).

What this module guarantees (tests/test_coding_tasks.py checks it for every task of `KINDS`,
tests/test_agent_kinds.py for `AGENT_KINDS`): the reference fix passes every check; the buggy code
fails the key check and at least one visible test; the wrong fix fails at least one hidden check;
ids and buggy sources are distinct; the same seed gives identical tasks, `generate_tasks(seed, n)`
is a prefix of `generate_tasks(seed)`, and appending kinds to `kinds` leaves the tasks of the kinds
before them unchanged (the default `kinds=KINDS` tasks, which recorded runs depend on, stay as they are).
What it does NOT guarantee: that the hidden checks pin the intended behaviour down completely
(a fix that passes them all can still differ on inputs nobody checks), that tasks are hard, or
that they are safe to run untrusted: they are trusted data, the candidate code is what the
sandbox is for.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from keelrl.envs.tasks import Check, Task, render_test_file, shift_ints, split_of

KINDS = (
    "falsy_or_default",     # `config.get(k) or d` also replaces valid falsy values (the lecture's bug)
    "missing_none_guard",   # `config.get(k, d)` returns None for an explicit None
    "wrong_default",        # the fallback value is not the documented default
    "off_by_one",           # `<` for `<=` in a limit check, a range end, a slice bound
    "flipped_comparison",   # `<` for `>`: a threshold test or a max/min loop points the wrong way
    "inverted_condition",   # `if not flag` for `if flag`
    "wrong_operator",       # `+` for `-`, `%` for `//`, `*` for `**`...
    "swapped_arguments",    # a helper or method called with its arguments in the wrong order
    "missing_validation",   # an invalid input is returned instead of raising ValueError
    "missing_empty_guard",  # an empty or zero input crashes instead of giving the documented value
)
AGENT_KINDS = (
    "hidden_edge_value",     # an edge case's expected value is stated only by a failing visible test
    "two_defects",           # a crash masks a wrong value: fixing it makes a different visible test fail
    "tests_only_behaviour",  # no behaviour in the prompt: the visible tests pin it, hidden checks try more cases
)
"""Opt-in kinds (pass `kinds=KINDS + AGENT_KINDS`) where one look at the file rarely suffices: the
agent has to run `test` and read what fails. Not in the default `KINDS`, whose tasks stay as they were."""
TASKS_PER_KIND = 85
"""Generated tasks of each kind; with the fixture, 851 tasks by default (209 held out at split seed 0)."""

_CONFIG_ARGS = ("config", "options", "settings", "cfg", "params", "conf")


# ------------------------------------------------------------------------------ the fixture

_RETRY_CHECKS: tuple[tuple[str, dict[str, Any], int, bool], ...] = (
    ("missing", {}, 3, False),
    ("none", {"retries": None}, 3, False),
    ("zero", {"retries": 0}, 0, True),
    ("two", {"retries": 2}, 2, False),
)


def retry_count_task() -> Task:
    """The lecture's task: `retries=0` must disable retries; missing and None still mean 3."""
    checks = [Check(name, [args], expected, key=key) for name, args, expected, key in _RETRY_CHECKS]
    # Hidden only: the key case with an unrelated setting beside it, so memorising the four
    # visible answers does not pass (the audit's hard-coding probe).
    hidden = [*checks, Check("zero_variant", [{"retries": 0, "verbose": True}], 0)]
    buggy = 'def retry_count(config):\n    return config.get("retries") or 3\n'
    fixed = ('def retry_count(config):\n    value = config.get("retries")\n    if value is None:\n'
             '        return 3\n    return value\n')
    wrong = 'def retry_count(config):\n    return config.get("retries", 3)\n'
    return Task(
        id="retry_count", kind="falsy_or_default",
        prompt=_prompt("retry_count", "retry.py", "test_retry.py",
                       "retries=0 must disable retries; missing, None and positive values keep their behaviour."),
        files={"retry.py": buggy, "test_retry.py": render_test_file("retry", "retry_count", checks)},
        entry_file="retry.py", entry_function="retry_count", test_file="test_retry.py",
        visible_tests=list(checks), hidden_checks=hidden, reference_fix={"retry.py": fixed},
        wrong_fix={"retry.py": wrong}, brittle_phrase="is None")


# ------------------------------------------------------------------------------ public API

def generate_tasks(seed: int = 0, count: int | None = None, kinds: Sequence[str] = KINDS) -> list[Task]:
    """The fixture first, then generated tasks interleaving the kinds (ids `f"{kind}-{index:04d}"`).

    A pure function of `seed` and `kinds`: each kind draws from its own `random.Random(f"{seed}:{kind}")`,
    so `generate_tasks(seed, n)` is the first n tasks of `generate_tasks(seed)` and a larger `count`
    only appends, and kinds appended to `kinds` (e.g. `KINDS + AGENT_KINDS`) leave the tasks of the
    kinds before them unchanged. The fixture comes first when `kinds` holds its kind
    ("falsy_or_default"). Raises ValueError for an unknown or repeated kind, or when `count` asks
    for more tasks than the kinds can make.
    """
    if count is not None and count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    kinds = _checked_kinds(kinds)
    with_fixture = retry_count_task().kind in kinds
    per_kind = (TASKS_PER_KIND if count is None
                else max(TASKS_PER_KIND, math.ceil((count - with_fixture) / len(kinds))))
    tasks = list(_generated(seed, per_kind, kinds))
    return tasks if count is None else tasks[:count]


@functools.lru_cache(maxsize=8)
def _generated(seed: int, per_kind: int, kinds: tuple[str, ...]) -> tuple[Task, ...]:
    """`generate_tasks`' tasks, made once a process for each (seed, per_kind, kinds): a run builds
    several hundred (about half a second), and every run of a process (the labs' arms, a
    notebook's runs) draws the same ones. Tasks are frozen dataclasses whose file dicts nothing in
    keelrl writes to, so the runs share them."""
    fixture = retry_count_task()
    fixtures = [fixture] if fixture.kind in kinds else []
    # Sources are deduplicated across kinds in `kinds` order, so a kind's tasks never depend on
    # the kinds after it.
    seen = {fixture.files[fixture.entry_file]}
    by_kind = [_generate_kind(kind, seed, per_kind, seen) for kind in kinds]
    return tuple(fixtures + [kind_tasks[index] for index in range(per_kind) for kind_tasks in by_kind])


def bundled_tasks(split: str | None = None, seed: int = 0, kinds: Sequence[str] = KINDS) -> list[Task]:
    """All generated tasks of `kinds` for `seed`, or those with `split_of(task.id, seed) == split`."""
    if split not in (None, "train", "heldout"):
        raise ValueError(f"split must be None, 'train' or 'heldout', got {split!r}")
    tasks = generate_tasks(seed, kinds=kinds)
    return tasks if split is None else [task for task in tasks if split_of(task.id, seed) == split]


def _checked_kinds(kinds: Sequence[str]) -> tuple[str, ...]:
    """`kinds` as a tuple; an empty, repeated or unknown kind is an error naming the valid ones."""
    if isinstance(kinds, str):  # "two_defects" would otherwise iterate as letters
        raise ValueError(f"kinds must be a sequence of kind names, got the string {kinds!r}")
    kinds = tuple(kinds)
    if not kinds:
        raise ValueError(f"kinds must name at least one kind; valid kinds: {', '.join(_BUILDERS)}")
    unknown = [kind for kind in kinds if kind not in _BUILDERS]
    if unknown:
        raise ValueError(f"unknown task kinds {unknown}; valid kinds: {', '.join(_BUILDERS)}")
    repeated = sorted({kind for kind in kinds if kinds.count(kind) > 1})
    if repeated:
        raise ValueError(f"kinds lists {repeated} more than once")
    return kinds


# ------------------------------------------------------------------------------ assembly

@dataclass(frozen=True)
class _Draft:
    """One task before ids and visible tests are assigned."""

    module: str
    function: str
    source: str
    fix: str
    wrong: str
    checks: tuple[Check, ...]  # the hidden checks, exactly one with key=True
    behaviour: str             # the intended behaviour, for the prompt (never the fix)
    brittle: str
    shown: tuple[str, ...] = ()  # non-key checks that must be visible (the evidence a kind relies on)
    prompt: str = ""             # the whole prompt, for kinds that word it themselves (default: `_prompt`)


def _generate_kind(kind: str, seed: int, count: int, seen: set[str]) -> list[Task]:
    rng = random.Random(f"{seed}:{kind}")
    build = _BUILDERS[kind]
    tasks: list[Task] = []
    attempts = 0
    while len(tasks) < count:
        attempts += 1
        if attempts > 200 * count:
            raise ValueError(f"{kind}: only {len(tasks)} distinct tasks after {attempts - 1} draws; "
                             f"ask for fewer than {count} per kind")
        draft = build(rng)
        if draft.source in seen:
            continue
        seen.add(draft.source)
        tasks.append(_task(f"{kind}-{len(tasks):04d}", kind, draft, rng))
    return tasks


def _task(task_id: str, kind: str, draft: _Draft, rng: random.Random) -> Task:
    """Pick 2-4 visible tests (the key check among them) and render the repository.

    Some check the bug breaks always stays hidden, so memorising the visible tests' answers
    (the audit's hard-coding probe) does not pass the hidden checks: a failing non-key check is
    held back from the visible set, or, when the bug breaks only the key check, a hidden variant
    of the key check is added (see `_key_variant`) where the bug's reach allows one. The checks
    named in `draft.shown` are always visible and never held back.
    """
    keys = [check for check in draft.checks if check.key]
    if len(keys) != 1 or len(draft.checks) < 4:
        raise ValueError(f"{task_id}: needs >= 4 checks and exactly one key check, got {draft.checks}")
    others = [check for check in draft.checks if not check.key]
    shown = set(draft.shown)
    if not shown <= {check.name for check in others} or len(shown) > 2:
        raise ValueError(f"{task_id}: shown must name at most two non-key checks, got {draft.shown}")
    function = _load(draft.source, draft.function)
    failing_others = [check for check in others if check.name not in shown
                      and not _passes(function, check) and repr(check.args) != repr(keys[0].args)]
    reserved = rng.choice(failing_others) if failing_others else None
    candidates = [check for check in others if check is not reserved and check.name not in shown]
    extra = rng.randint(0 if shown else 1, min(3 - len(shown), len(candidates) - (0 if reserved else 1)))
    names = {keys[0].name, *shown} | {check.name for check in rng.sample(candidates, extra)}
    visible = [check for check in draft.checks if check.name in names]
    hidden = list(draft.checks)
    if reserved is None:
        variant = _key_variant(draft, keys[0])
        if variant is not None:
            hidden.append(variant)
    entry_file, test_file = f"{draft.module}.py", f"test_{draft.module}.py"
    return Task(
        id=task_id, kind=kind, prompt=draft.prompt or _prompt(draft.function, entry_file, test_file, draft.behaviour),
        files={entry_file: draft.source, test_file: render_test_file(draft.module, draft.function, visible)},
        entry_file=entry_file, entry_function=draft.function, test_file=test_file,
        visible_tests=visible, hidden_checks=hidden, reference_fix={entry_file: draft.fix},
        wrong_fix={entry_file: draft.wrong}, brittle_phrase=draft.brittle)


def _load(source: str, function: str) -> Callable[..., Any]:
    """The function `function` of a bundled (trusted) source, executed in a fresh namespace."""
    namespace: dict[str, Any] = {"__name__": "bundled_task_module"}
    exec(compile(source, "<task>", "exec"), namespace)  # trusted generator output, never agent code
    return namespace[function]


def _same(got: Any, expected: Any) -> bool:
    if type(got) is not type(expected):
        return False
    if isinstance(expected, list):
        return len(got) == len(expected) and all(_same(g, e) for g, e in zip(got, expected))
    if isinstance(expected, dict):
        return got.keys() == expected.keys() and all(_same(got[k], expected[k]) for k in expected)
    return bool(got == expected)


def _passes(function: Callable[..., Any], check: Check) -> bool:
    try:
        got = function(*copy.deepcopy(check.args))
    except Exception as error:  # a check that raises fails unless it names the error
        return check.raises is not None and type(error).__name__ == check.raises
    return check.raises is None and _same(got, check.expected)


def _variant_args(args: list[Any]) -> list[list[Any]]:
    """Inputs near the key check's: an unrelated extra setting, shifted numbers, a longer string."""
    out = []
    if args and isinstance(args[0], dict):
        extra = "verbose" if "verbose" not in args[0] else "label"
        out.append([{**args[0], extra: True}, *args[1:]])
    out += [shift_ints(args, by) for by in (3, 7, 12)]
    strings = [i for i, a in enumerate(args) if isinstance(a, str) and a]
    if strings:
        first, every = list(args), list(args)
        first[strings[0]] = "re" + first[strings[0]]
        for i in strings:
            every[i] = "re" + every[i]
        out += [first, every]
    return [candidate for candidate in out if candidate != args]


def _key_variant(draft: _Draft, key: Check) -> Check | None:
    """A hidden check like the key one on another input, which the bug fails and the fix passes."""
    fixed, buggy = _load(draft.fix, draft.function), _load(draft.source, draft.function)
    used = {repr(check.args) for check in draft.checks}
    for args in _variant_args(key.args):
        if repr(args) in used:
            continue
        try:
            expected = fixed(*copy.deepcopy(args))
        except Exception as error:  # noqa: BLE001 - a variant that raises must raise what the key check raises
            if key.raises is None or type(error).__name__ != key.raises:
                continue
            check = Check(f"{key.name}_variant", copy.deepcopy(args), None, raises=key.raises)
        else:
            if key.raises is not None or type(expected) is not type(key.expected):
                continue
            check = Check(f"{key.name}_variant", copy.deepcopy(args), expected)
        if _passes(fixed, check) and not _passes(buggy, check):
            return check
    return None


def _draft(module: str, function: str, header: str | None, blocks: list[list[list[str]]], checks: list[Check],
           behaviour: str, brittle: str) -> _Draft:
    """`blocks` holds the top-level blocks of the buggy, fixed and wrong sources, in that order."""
    source, fix, wrong = (_assemble(header, *block) for block in blocks)
    return _Draft(module, function, source, fix, wrong, tuple(checks), behaviour, brittle)


def _prompt(function: str, entry_file: str, test_file: str, behaviour: str) -> str:
    return f"Fix the bug in `{function}` ({entry_file}). {behaviour} The visible tests are in {test_file}."


def _ok(name: str, args: list[Any], expected: Any, key: bool = False) -> Check:
    return Check(name, copy.deepcopy(args), copy.deepcopy(expected), key=key)


def _raises(name: str, args: list[Any], error: str, key: bool = False) -> Check:
    return Check(name, copy.deepcopy(args), None, raises=error, key=key)


def _lit(value: Any) -> str:
    """A JSON value as Python source, strings in double quotes like the rest of the task code."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_lit(item) for item in value) + "]"
    return repr(value)


def _header(rng: random.Random, topic: str) -> str | None:
    """An optional module docstring about `topic`, shared by the buggy, fixed and wrong sources."""
    words = topic.replace("_", " ")
    return rng.choice([None, f"{words.capitalize()} helpers.", f"Small utilities for the {words} code."])


def _assemble(header: str | None, *blocks: list[str]) -> str:
    """Top-level blocks two blank lines apart, under the optional module docstring."""
    lines = [f'"""{header}"""', ""] if header else []
    for number, block in enumerate(blocks):
        lines += (["", ""] if number else []) + block
    return "\n".join(lines) + "\n"


def _doc(rng: random.Random, *options: str) -> list[str]:
    """A function docstring picked from `options`, or none at all."""
    text = rng.choice([None, *options])
    return [f'    """{text}"""'] if text else []


def _pick(rng: random.Random, rows: tuple[Any, ...]) -> Any:
    return rows[rng.randrange(len(rows))]


# ------------------------------------------------------------------------------ settings read from a dict

@dataclass(frozen=True)
class _Setting:
    """A config key whose falsy value is valid, for the config-reading kinds."""

    key: str
    default: Any
    falsy: Any                 # a valid falsy value (0, "", False, []) that must come back unchanged
    others: tuple[Any, ...]    # other valid values
    wrongs: tuple[Any, ...]    # plausible wrong defaults (wrong_default)
    meaning: str               # what the falsy value means, for the prompt
    functions: tuple[str, ...]
    modules: tuple[str, ...]

    @property
    def falsy_name(self) -> str:
        return {int: "zero", str: "empty", bool: "false", list: "empty_list"}[type(self.falsy)]


_SETTINGS = (
    _Setting("retries", 3, 0, (1, 2, 5), (1, 5, 10), "0 disables retries",
             ("retry_count", "max_retries", "retries_for", "retry_limit"), ("retry", "retrying", "resilience")),
    _Setting("timeout", 30, 0, (5, 10, 120), (60, 300, 3), "0 means do not wait at all",
             ("timeout_seconds", "request_timeout", "wait_limit"), ("timeouts", "http_client", "waiting")),
    _Setting("workers", 4, 0, (1, 2, 16), (1, 8, 2), "0 runs every job in the calling process",
             ("worker_count", "num_workers", "pool_size"), ("workers", "job_pool", "jobs")),
    _Setting("port", 8080, 0, (80, 443, 5000), (8000, 80, 8081), "0 lets the operating system pick a free port",
             ("listen_port", "server_port", "bind_port"), ("server", "listener", "net_config")),
    _Setting("max_depth", 10, 0, (1, 3, 25), (5, 100, 1), "0 only looks at the top level",
             ("depth_limit", "crawl_depth", "max_depth"), ("crawler", "tree_walk", "scanner")),
    _Setting("verbosity", 1, 0, (2, 3), (2, 3), "0 silences all output",
             ("verbosity_level", "log_verbosity"), ("console", "log_setup")),
    _Setting("cache_size", 128, 0, (16, 64, 1024), (256, 100, 64), "0 disables the cache",
             ("cache_capacity", "lru_size", "cache_size"), ("cache", "memo", "lru")),
    _Setting("backoff_ms", 100, 0, (50, 250, 1000), (1000, 10), "0 retries immediately",
             ("backoff_delay", "retry_delay_ms"), ("backoff", "scheduler")),
    _Setting("indent", 4, 0, (2, 8), (2, 8), "0 writes every line flush left",
             ("indent_width", "indent_size"), ("layout", "pretty")),
    _Setting("precision", 2, 0, (1, 3, 6), (3, 1), "0 rounds to whole numbers",
             ("decimal_places", "price_precision"), ("rounding", "money")),
    _Setting("min_length", 8, 0, (4, 12, 16), (6, 10), "0 accepts passwords of any length",
             ("min_password_length", "minimum_length"), ("passwords", "validation")),
    _Setting("priority", 5, 0, (1, 3, 9), (1, 10), "0 is the most urgent priority",
             ("job_priority", "priority_of"), ("scheduling", "job_queue")),
    _Setting("history", 100, 0, (10, 500), (50, 1000), "0 keeps no history",
             ("history_length", "history_size"), ("shell_history", "undo")),
    _Setting("discount", 10, 0, (5, 25, 50), (15, 20), "0 means full price",
             ("discount_percent", "discount_rate"), ("pricing", "checkout")),
    _Setting("seed", 42, 0, (1, 7, 1234), (123, 7), "0 is a valid seed like any other",
             ("random_seed", "rng_seed"), ("seeding", "experiment")),
    _Setting("alert_threshold", 90, 0, (50, 75, 99), (80, 95), "0 alerts on every reading",
             ("alert_threshold", "alarm_level"), ("alerts", "monitoring")),
    _Setting("prefix", "> ", "", ("# ", "-- "), ("# ", ">> "), "an empty prefix leaves lines unchanged",
             ("line_prefix", "quote_prefix"), ("quoting", "text_format")),
    _Setting("separator", ",", "", (";", " | ", "\t"), (";", ", "),
             "an empty separator joins fields with nothing between them",
             ("field_separator", "join_separator"), ("csv_tools", "fields")),
    _Setting("suffix", "...", "", (" [more]", "~"), (" ...", "--"), "an empty suffix appends nothing",
             ("ellipsis", "truncation_suffix"), ("truncate", "summary")),
    _Setting("greeting", "Hello", "", ("Hi", "Welcome"), ("Hi", "Dear"), "an empty greeting sends no greeting",
             ("greeting_text", "salutation"), ("messages", "mailer")),
    _Setting("label", "untitled", "", ("draft", "report"), ("unnamed", "new"), "an empty label is allowed",
             ("document_label", "label_for"), ("documents", "labels")),
    _Setting("verify_ssl", True, False, (True,), (False,), "False turns certificate checks off",
             ("verify_certificates", "ssl_verify"), ("http_session", "tls")),
    _Setting("color", True, False, (True,), (False,), "False prints plain text",
             ("use_color", "color_enabled"), ("terminal", "styling")),
    _Setting("autosave", True, False, (True,), (False,), "False turns autosave off",
             ("autosave_enabled", "should_autosave"), ("editor", "drafts")),
    _Setting("compress", True, False, (True,), (False,), "False stores files uncompressed",
             ("use_compression", "compression_on"), ("archive", "storage")),
    _Setting("tags", ["general"], [], (["urgent"], ["a", "b"]), (["misc"], ["untagged"]),
             "an empty list means no tags", ("default_tags", "tag_list"), ("tagging", "post_meta")),
    _Setting("extensions", [".py"], [], ([".txt"], [".md", ".rst"]), (["*"], [".txt"]),
             "an empty list matches no files", ("file_extensions", "watched_extensions"), ("file_watch", "globbing")),
    _Setting("admins", ["root"], [], (["ops"], ["ann", "bo"]), (["admin"],),
             "an empty list means nobody has admin rights", ("admin_users", "admin_list"), ("permissions", "access")),
)
_INT_SETTINGS = tuple(s for s in _SETTINGS if type(s.default) is int)


def _setting_checks(rng: random.Random, s: _Setting, key: str, most: int = 6) -> list[Check]:
    """missing, none, the falsy value, one or two given values, maybe unrelated keys; `key` is the headline."""
    checks = [_ok("missing", [{}], s.default, key=key == "missing"),
              _ok("none", [{s.key: None}], s.default, key=key == "none"),
              _ok(s.falsy_name, [{s.key: s.falsy}], s.falsy, key=key == "falsy")]
    given = rng.sample(s.others, min(len(s.others), rng.randint(1, 2)))
    checks += [_ok(name, [{s.key: value}], value) for name, value in zip(("given", "given_other"), given)]
    if len(checks) < most and rng.random() < 0.5:
        checks.append(_ok("unrelated_keys", [{"debug": True}], s.default))
    return checks


def _setting_parts(rng: random.Random, s: _Setting) -> tuple[str, str, str, str | None]:
    """function, module, dict argument name, and an optional DEFAULT_* constant name."""
    constant = f"DEFAULT_{s.key.upper()}" if rng.random() < 0.35 else None
    return _pick(rng, s.functions), _pick(rng, s.modules), _pick(rng, _CONFIG_ARGS), constant


def _with_constant(constant: str | None, value: Any) -> list[list[str]]:
    return [[f"{constant} = {_lit(value)}"]] if constant else []



def _falsy_or_default(rng: random.Random) -> _Draft:
    s = _pick(rng, _SETTINGS)
    function, module, arg, constant = _setting_parts(rng, s)
    header, default, get = _header(rng, module), constant or _lit(s.default), f'{arg}.get("{s.key}")'
    head = [f"def {function}({arg}):",
            *_doc(rng, f"The {s.key} setting from {arg}.", f"Read the {s.key} option.",
                  f"Return {arg}[{s.key!r}], or the default when it is not set.")]
    bug = _pick(rng, ([f"    return {get} or {default}"],
                      [f"    value = {get} or {default}", "    return value"],
                      [f"    value = {get}", f"    return value or {default}"]))
    fix = _pick(rng, ([f"    value = {get}", "    if value is None:", f"        return {default}",
                       "    return value"],
                      [f"    value = {get}", f"    return {default} if value is None else value"]))
    wrong = [f'    return {arg}.get("{s.key}", {default})']
    consts = _with_constant(constant, s.default)
    return _draft(
        module, function, header, [[*consts, head + body] for body in (bug, fix, wrong)],
        _setting_checks(rng, s, key="falsy"),
        f"`{function}({arg})` returns the {s.key} setting. {s.key}={_lit(s.falsy)} is a valid value "
        f"({s.meaning}) and must come back unchanged; a missing or None {s.key} means the default "
        f"{_lit(s.default)}; any other value is returned as is.",
        "is None")


def _missing_none_guard(rng: random.Random) -> _Draft:
    s = _pick(rng, _SETTINGS)
    function, module, arg, constant = _setting_parts(rng, s)
    header, default = _header(rng, module), constant or _lit(s.default)
    posts: list[tuple[str, Callable[[Any], Any], str]] = [("{}", lambda v: v, "")]
    cap = 0
    if type(s.default) is int:
        cap = 2 * max(s.default, *s.others)
        posts += [("max({}, 0)", lambda v: max(v, 0), "; negative values count as 0"),
                  (f"min({{}}, {cap})", lambda v: min(v, cap), f"; values above {cap} are capped at {cap}")]
    post, apply, note = _pick(rng, tuple(posts))
    head = [f"def {function}({arg}):",
            *_doc(rng, f"The {s.key} setting from {arg}{note}.",
                  f"Read the {s.key} option (default {_lit(s.default)}).")]
    bug = _pick(rng, ([f'    return {post.format(f"{arg}.get({_lit(s.key)}, {default})")}'],
                      [f'    value = {arg}.get("{s.key}", {default})', f"    return {post.format('value')}"]))
    fix = _pick(rng, ([f'    value = {arg}.get("{s.key}")', "    if value is None:", f"        value = {default}"],
                      [f'    value = {arg}.get("{s.key}")', f"    value = {default} if value is None else value"]))
    fix = fix + [f"    return {post.format('value')}"]
    wrong = [f'    value = {arg}.get("{s.key}") or {default}', f"    return {post.format('value')}"]
    checks = [_ok("missing", [{}], apply(s.default)), _ok("none", [{s.key: None}], apply(s.default), key=True),
              _ok(s.falsy_name, [{s.key: s.falsy}], s.falsy)]
    given = rng.sample(s.others, min(len(s.others), 2))
    checks.append(_ok("given", [{s.key: given[0]}], apply(given[0])))
    if post.startswith("max"):
        checks.append(_ok("negative", [{s.key: -given[0]}], 0))
    elif post.startswith("min"):
        checks.append(_ok("above_cap", [{s.key: cap + s.default}], cap))
    elif len(given) > 1:
        checks.append(_ok("given_other", [{s.key: given[1]}], given[1]))
    if rng.random() < 0.5:
        checks.append(_ok("unrelated_keys", [{"debug": True}], apply(s.default)))
    consts = _with_constant(constant, s.default)
    return _draft(
        module, function, header, [[*consts, head + body] for body in (bug, fix, wrong)], checks,
        f"`{function}({arg})` returns the {s.key} setting{note}. A missing {s.key} and an explicit "
        f"None both mean the default {_lit(s.default)}; {s.key}={_lit(s.falsy)} is a valid value "
        f"({s.meaning}) and is kept.",
        "is None")


def _wrong_default(rng: random.Random) -> _Draft:
    s = _pick(rng, _SETTINGS)
    function, module, arg, _ = _setting_parts(rng, s)
    header, right, wrong_value = _header(rng, module), _lit(s.default), _lit(_pick(rng, s.wrongs))
    head = [f"def {function}({arg}):",
            *_doc(rng, f"The {s.key} setting from {arg}.", f"Read the {s.key} option, falling back to the default.")]
    layout = rng.randrange(3)
    if layout == 0:  # two early returns, both with the wrong default
        def body(first: str, second: str) -> list[str]:
            return [f'    if "{s.key}" not in {arg}:', f"        return {first}", f'    value = {arg}["{s.key}"]',
                    "    if value is None:", f"        return {second}", "    return value"]
        brittle = f"return {right}"
        blocks = [[head + body(wrong_value, wrong_value)], [head + body(right, right)],
                  [head + body(right, wrong_value)]]
    elif layout == 1:  # .get default and a None branch
        def body(first: str, second: str) -> list[str]:
            return [f'    value = {arg}.get("{s.key}", {first})', "    if value is None:",
                    f"        value = {second}", "    return value"]
        brittle = f'.get("{s.key}", {right})'
        blocks = [[head + body(wrong_value, wrong_value)], [head + body(right, right)],
                  [head + body(right, wrong_value)]]
    else:  # a DEFAULT_* constant; the wrong fix patches the .get call and leaves the constant
        constant = f"DEFAULT_{s.key.upper()}"
        ret = f"    return {constant} if value is None else value"
        blocks = [[[f"{constant} = {wrong_value}"], head + [f'    value = {arg}.get("{s.key}")', ret]],
                  [[f"{constant} = {right}"], head + [f'    value = {arg}.get("{s.key}")', ret]],
                  [[f"{constant} = {wrong_value}"], head + [f'    value = {arg}.get("{s.key}", {right})', ret]]]
        brittle = f"{constant} = {right}"
    return _draft(
        module, function, header, blocks, _setting_checks(rng, s, key="missing"),
        f"`{function}({arg})` returns the {s.key} setting. The default is {right}: a missing or None "
        f"{s.key} must give {right}. Any other value, {_lit(s.falsy)} included, is returned unchanged.",
        brittle)


# ------------------------------------------------------------------------------ comparisons and bounds

_LIMIT_MODULES = ("limits", "quota", "guards", "throttle", "policy", "thresholds")
_INCLUSIVE_MAX = (("can_retry", "attempt", "max_attempts"), ("within_quota", "used", "quota"),
                  ("fits", "size", "capacity"), ("is_allowed_length", "length", "max_length"),
                  ("may_continue", "step", "max_steps"), ("under_rate_limit", "requests", "limit"),
                  ("can_enqueue", "queued", "max_queue"), ("is_valid_page", "page", "last_page"))
_INCLUSIVE_MIN = (("is_old_enough", "age", "min_age"), ("meets_minimum", "score", "passing_score"),
                  ("has_enough_stock", "stock", "min_stock"), ("is_long_enough", "length", "min_length"),
                  ("can_withdraw", "balance", "minimum_balance"), ("has_quorum", "votes", "quorum"))
_INCLUSIVE_RANGE = (("page_numbers", "first", "last"), ("ports_between", "low", "high"),
                    ("days_in_span", "start_day", "end_day"), ("versions_between", "oldest", "newest"),
                    ("ids_in_range", "first_id", "last_id"), ("floors_between", "bottom", "top"))
_HEAD = (("head", "items"), ("top_results", "results"), ("first_lines", "lines"), ("preview_words", "words"),
         ("latest_events", "events"), ("leading_rows", "rows"))
_WORDS = ("alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa")


def _off_by_one(rng: random.Random) -> _Draft:
    template = rng.randrange(4)
    module = _pick(rng, _LIMIT_MODULES + ("ranges", "paging", "listing"))
    header = _header(rng, module)
    if template in (0, 1):  # `<` for `<=` (or `>` for `>=`) at an inclusive bound
        function, x, bound = _pick(rng, _INCLUSIVE_MAX if template == 0 else _INCLUSIVE_MIN)
        strict, loose = ("<", "<=") if template == 0 else (">", ">=")
        shift = "+ 1" if template == 0 else "- 1"
        limit = rng.randint(3, 20)
        side = 1 if template == 0 else -1  # the direction in which x leaves the allowed range
        from_config = rng.random() < 0.35
        arg = _pick(rng, _CONFIG_ARGS)
        config_default = rng.randint(3, 20)
        params = f"{x}, {arg}" if from_config else f"{x}, {bound}"
        lookup = [f'    {bound} = {arg}.get("{bound}", {config_default})'] if from_config else []
        word = "at most" if template == 0 else "at least"
        head = [f"def {function}({params}):",
                *_doc(rng, f"True when {x} is {word} {bound}.", f"{x} may reach {bound} exactly.",
                      f"Is {x} within {bound} ({bound} itself included)?"), *lookup]

        def wrap(value: int) -> list[Any]:
            return [value, {bound: limit} if from_config else limit]
        checks = [_ok("inside", wrap(limit - side * rng.randint(1, 2)), True),
                  _ok("at_bound", wrap(limit), True, key=True),
                  _ok("one_past", wrap(limit + side), False)]
        extras = [_ok("far_past", wrap(limit + side * rng.randint(4, 9)), False),
                  _ok("zero", wrap(0), template == 0)]
        if from_config:
            extras.append(_ok("default_bound", [config_default, {}], True))
        checks += rng.sample(extras, rng.randint(1, min(3, len(extras))))
        bodies = [f"    return {x} {strict} {bound}", f"    return {x} {loose} {bound}",
                  f"    return {x} {loose} {bound} {shift}"]
        blocks = [[head + [body]] for body in bodies]
        direction = "above" if template == 0 else "below"
        behaviour = (f"`{function}` tells whether {x} is {word} {bound}: {bound} itself is allowed, anything "
                     f"{direction} it is not." + (f" {bound} comes from {arg} (default {config_default})."
                                                  if from_config else ""))
        brittle = f"{x} {loose} {bound}"
    elif template == 2:  # range end exclusive where the span is inclusive
        function, first, last = _pick(rng, _INCLUSIVE_RANGE)
        head = [f"def {function}({first}, {last}):",
                *_doc(rng, f"Every integer from {first} to {last}, both included.",
                      f"[{first}, ..., {last}] inclusive; empty when {first} > {last}.")]
        bodies = [f"    return list(range({first}, {last}))", f"    return list(range({first}, {last} + 1))",
                  f"    return list(range({first}, {last})) + [{last}]"]
        blocks = [[head + [body]] for body in bodies]
        a, k = rng.randint(1, 9), rng.randint(2, 4)
        b = rng.randint(1, 9)
        checks = [_ok("span", [a, a + k], list(range(a, a + k + 1)), key=True),
                  _ok("single", [b, b], [b]),
                  _ok("reversed", [a + k, a], [])]
        extras = [_ok("from_zero", [0, k], list(range(0, k + 1))), _ok("negative", [-k, 0], list(range(-k, 1)))]
        checks += rng.sample(extras, rng.randint(1, 2))
        behaviour = (f"`{function}({first}, {last})` lists every integer from {first} to {last}, both ends "
                     f"included, and returns [] when {first} > {last}.")
        brittle = f"{last} + 1"
    else:  # slice bound one short
        function, items = _pick(rng, _HEAD)
        n = _pick(rng, ("n", "count", "limit"))
        head = [f"def {function}({items}, {n}):",
                *_doc(rng, f"The first {n} {items} (all of them when there are fewer).",
                      f"Up to {n} {items}, in order.")]
        bodies = [f"    return {items}[: {n} - 1]", f"    return {items}[:{n}]",
                  f"    return {items}[: {n} - 1] + {items}[{n} - 1 : {n}]"]
        blocks = [[head + [body]] for body in bodies]
        values = rng.sample(_WORDS, rng.randint(4, 6))
        k = rng.randint(2, len(values) - 1)
        checks = [_ok("some", [values, k], values[:k], key=True), _ok("none_wanted", [values, 0], []),
                  _ok("all", [values, len(values)], values)]
        extras = [_ok("more_than_there_are", [values, len(values) + 3], values), _ok("empty_input", [[], 2], []),
                  _ok("one", [values, 1], values[:1])]
        checks += rng.sample(extras, rng.randint(1, 3))
        behaviour = (f"`{function}({items}, {n})` returns the first {n} {items} in order: [] for {n}=0 and the "
                     f"whole list when {n} is at least its length.")
        brittle = f"{items}[:{n}]"
    return _draft(module, function, header, blocks, checks, behaviour, brittle)


_STRICTLY_ABOVE = (("is_expired", "age", "ttl"), ("over_budget", "spent", "budget"),
                   ("is_too_long", "length", "max_length"), ("is_slow", "latency_ms", "threshold_ms"),
                   ("exceeds_quota", "used", "quota"), ("is_overheated", "temperature", "max_temperature"))
_AT_LEAST = (("needs_flush", "size", "threshold"), ("should_rotate", "log_bytes", "max_bytes"),
             ("is_full", "count", "capacity"), ("reached_goal", "steps", "goal"),
             ("can_afford", "balance", "price"), ("should_alert", "errors", "alert_level"))
_EXTREMES = (("peak_load", "loads", "load", "max"), ("highest_score", "scores", "score", "max"),
             ("latest_version", "versions", "version", "max"), ("max_latency", "latencies", "latency", "max"),
             ("lowest_price", "prices", "price", "min"), ("earliest_start", "starts", "start", "min"),
             ("fastest_time", "times", "elapsed", "min"), ("coldest_reading", "readings", "reading", "min"))


def _flipped_comparison(rng: random.Random) -> _Draft:
    template = rng.randrange(3)
    module = _pick(rng, ("checks", "thresholds", "monitoring", "stats", "rules", "metrics"))
    header = _header(rng, module)
    if template in (0, 1):
        function, x, limit = _pick(rng, _STRICTLY_ABOVE if template == 0 else _AT_LEAST)
        bug_op, right_op, wrong_op = ("<", ">", ">=") if template == 0 else ("<=", ">=", ">")
        word = "strictly greater than" if template == 0 else "greater than or equal to"
        head = [f"def {function}({x}, {limit}):",
                *_doc(rng, f"True when {x} is {word} {limit}.", f"Compare {x} with {limit}.")]
        blocks = [[head + [f"    return {x} {op} {limit}"]] for op in (bug_op, right_op, wrong_op)]
        bound = rng.randint(5, 50)
        checks = [_ok("above", [bound + rng.randint(1, 5), bound], True, key=True),
                  _ok("equal", [bound, bound], template == 1),
                  _ok("below", [bound - rng.randint(1, 4), bound], False)]
        extras = [_ok("far_above", [bound * 3, bound], True), _ok("zero", [0, bound], False)]
        checks += rng.sample(extras, rng.randint(1, 2))
        behaviour = f"`{function}({x}, {limit})` is True exactly when {x} is {word} {limit}."
        brittle = f"{x} {right_op} {limit}"
    else:  # a max/min loop compares the wrong way round; the wrong fix starts from 0 instead of the first item
        function, items, item, which = _pick(rng, _EXTREMES)
        bug_op, right_op = ("<", ">") if which == "max" else (">", "<")
        best = _pick(rng, ("best", "result", "current"))
        word = "largest" if which == "max" else "smallest"
        head = [f"def {function}({items}):", *_doc(rng, f"The {word} of {items} (a non-empty list).",
                                                  f"Return the {word} value in {items}.")]

        def body(start: str, op: str) -> list[str]:
            return [f"    {best} = {start}", f"    for {item} in {items}:", f"        if {item} {op} {best}:",
                    f"            {best} = {item}", f"    return {best}"]
        blocks = [[head + body(f"{items}[0]", bug_op)], [head + body(f"{items}[0]", right_op)],
                  [head + body("0", right_op)]]
        pick = max if which == "max" else min
        sign = 1 if which == "max" else -1
        mixed = [sign * value for value in rng.sample(range(-9, 30), 4)]
        while pick(mixed) == mixed[0] or min(mixed) >= 0 or max(mixed) <= 0:
            mixed = [sign * value for value in rng.sample(range(-9, 30), 4)]
        same_sign = [-sign * value for value in rng.sample(range(1, 40), 3)]  # all below 0 for max, above for min
        checks = [_ok("mixed", [mixed], pick(mixed), key=True), _ok("same_sign", [same_sign], pick(same_sign))]
        single = rng.randint(1, 99)
        extras = [_ok("single", [[single]], single),
                  _ok("first_is_best", [[sign * 50, sign * 3, sign * 7]], sign * 50),
                  _ok("ties", [[sign * 4, sign * 9, sign * 9]], sign * 9)]
        checks += rng.sample(extras, rng.randint(2, 3))
        behaviour = f"`{function}({items})` returns the {word} value in a non-empty list of numbers (any sign)."
        brittle = f"{item} {right_op} {best}"
    return _draft(module, function, header, blocks, checks, behaviour, brittle)


# ------------------------------------------------------------------------------ conditions

_KEEP_IF_TRUE = (("enabled_plugins", "plugins", "plugin", "enabled"), ("active_users", "users", "user", "active"),
                 ("visible_items", "items", "item", "visible"), ("online_hosts", "hosts", "host", "online"),
                 ("published_posts", "posts", "post", "published"), ("healthy_nodes", "nodes", "node", "healthy"))
_DROP_IF_TRUE = (("live_jobs", "jobs", "job", "cancelled"), ("current_files", "files", "entry", "deleted"),
                 ("open_tickets", "tickets", "ticket", "closed"), ("inbox_messages", "messages", "message", "spam"),
                 ("current_projects", "projects", "project", "archived"), ("pending_tasks", "tasks", "task", "done"))
_FLAG_TRANSFORMS = (
    ("clean_line", "line", "strip", "{}.strip()", "stripped of surrounding whitespace",
     ("  hello  ", "\tvalue\n", " padded")),
    ("normalize_tag", "tag", "lowercase", "{}.lower()", "lower-cased", ("Python", "ML", "Data-Science")),
    ("format_alert", "message", "uppercase", "{}.upper()", "upper-cased", ("disk full", "Low battery")),
    ("tidy_title", "title", "title_case", "{}.title()", "title-cased", ("the old man", "war and peace")),
    ("compact_text", "text", "collapse_spaces", '" ".join({}.split())',
     "with runs of whitespace collapsed to one space",
     ("a  b", "one   two  three", " lead and trail ")),
)
_NAMES = ("ada", "bo", "cy", "dee", "eve", "fay", "gus", "hal")
_PY_TRANSFORMS: dict[str, Callable[[str], str]] = {
    "strip": str.strip, "lowercase": str.lower, "uppercase": str.upper, "title_case": str.title,
    "collapse_spaces": lambda text: " ".join(text.split())}


def _inverted_condition(rng: random.Random) -> _Draft:
    template = rng.randrange(3)
    if template in (0, 1):
        function, items, item, field = _pick(rng, _KEEP_IF_TRUE if template == 0 else _DROP_IF_TRUE)
        module = _pick(rng, ("registry", "inventory", "listing", "catalog", "filters"))
        keep = template == 0  # keep the entries whose flag is true (missing counts as true), else drop them
        if keep:
            conditions = (f'not {item}.get("{field}", True)', f'{item}.get("{field}", True)',
                          f'{item}.get("{field}")')
            rule = f'whose "{field}" field is true; an entry without the field counts as {field}'
        else:
            conditions = (f'{item}.get("{field}", False)', f'not {item}.get("{field}", False)',
                          f'{item}.get("{field}") is False')
            rule = f'that are not {field}; an entry without a "{field}" field is not {field}'
        loop = rng.random() < 0.5
        head = [f"def {function}({items}):", *_doc(rng, f"Names of the {items} {rule.split(';')[0]}.",
                                                  f"Filter {items} on their {field} flag.")]

        def body(condition: str) -> list[str]:
            if loop:
                return ["    names = []", f"    for {item} in {items}:", f"        if {condition}:",
                        f'            names.append({item}["name"])', "    return names"]
            return [f'    return [{item}["name"] for {item} in {items} if {condition}]']
        blocks = [[head + body(condition)] for condition in conditions]
        names = rng.sample(_NAMES, 5)
        flags = [True, False] + [rng.random() < 0.5 for _ in range(rng.randint(0, 2))]
        rng.shuffle(flags)
        mixed = [{"name": name, field: flag} for name, flag in zip(names, flags)]
        kept = [entry["name"] for entry in mixed if entry[field] is keep]
        no_field = [{"name": name} for name in names[:rng.randint(1, 3)]]
        all_flagged = [{"name": name, field: not keep} for name in names[:2]]
        checks = [_ok("mixed", [mixed], kept, key=True), _ok("no_field", [no_field], [e["name"] for e in no_field]),
                  _ok("all_excluded", [all_flagged], [])]
        partly = [{"name": names[0], field: keep}, {"name": names[1]}, {"name": names[2], field: not keep}]
        extras = [_ok("empty", [[]], []), _ok("partly_missing", [partly], names[:2])]
        checks += rng.sample(extras, rng.randint(1, 2))
        behaviour = f"`{function}({items})` returns, in order, the names of the {items} {rule}."
        brittle = f"if {conditions[1]}"
    else:  # an on-by-default flag tested the wrong way round; the wrong fix forgets the default
        function, text, flag, transform, description, samples = _pick(rng, _FLAG_TRANSFORMS)
        module = _pick(rng, ("text_utils", "formatting", "cleanup"))
        arg = _pick(rng, _CONFIG_ARGS)
        head = [f"def {function}({text}, {arg}):",
                *_doc(rng, f"Apply the {flag} option (on unless {arg} turns it off).", f"Format {text} per {arg}.")]

        def body(condition: str) -> list[str]:
            return [f"    if {condition}:", f"        return {transform.format(text)}", f"    return {text}"]
        conditions = (f'not {arg}.get("{flag}", True)', f'{arg}.get("{flag}", True)', f'{arg}.get("{flag}")')
        blocks = [[head + body(condition)] for condition in conditions]
        first, second = rng.sample(samples, 2)
        apply = _PY_TRANSFORMS[flag]
        checks = [_ok("flag_on", [first, {flag: True}], apply(first), key=True),
                  _ok("flag_off", [first, {flag: False}], first),
                  _ok("flag_missing", [second, {}], apply(second))]
        extras = [_ok("flag_on_other", [second, {flag: True}], apply(second)),
                  _ok("flag_off_other", [second, {flag: False}], second)]
        checks += rng.sample(extras, rng.randint(1, 2))
        behaviour = (f"`{function}({text}, {arg})` returns {text} {description} when {arg}[{flag!r}] is true or "
                     f"missing (the option is on by default), and {text} unchanged when it is false.")
        brittle = f"if {conditions[1]}"
    header = _header(rng, module)
    return _draft(module, function, header, blocks, checks, behaviour, brittle)


# ------------------------------------------------------------------------------ arithmetic and arguments

_FLOORED_DIFFERENCE = (("discounted_price", "price", "discount"), ("remaining_budget", "budget", "spent"),
                       ("stock_left", "stock", "sold"), ("seats_left", "capacity", "booked"),
                       ("time_left", "timeout", "elapsed"), ("credits_left", "credits", "used"))
_HEADER_PLUS_PRODUCT = (("payload_bytes", "count", "size", "HEADER_BYTES", 16),
                        ("frame_length", "frames", "frame_size", "PREAMBLE", 8),
                        ("order_total", "quantity", "unit_price", "SHIPPING", 5),
                        ("storage_needed", "files", "file_size", "OVERHEAD", 64),
                        ("message_cost", "recipients", "cost_each", "BASE_FEE", 3))
_AVERAGES = (("mean_latency", "samples"), ("average_score", "scores"), ("mean_size", "sizes"),
             ("average_load", "loads"), ("mean_duration", "durations"))
_MIDPOINTS = (("midpoint", "low", "high"), ("middle_index", "start", "end"), ("split_point", "lo", "hi"),
              ("pivot", "left", "right"), ("halfway", "begin", "finish"))
_BACKOFFS = (("backoff_delay", "attempt", "base_ms"), ("retry_wait", "retry", "base_seconds"),
             ("poll_interval", "step", "base"), ("reconnect_delay", "failures", "initial_delay"))


def _wrong_operator(rng: random.Random) -> _Draft:
    template = rng.randrange(5)
    module = _pick(rng, ("arithmetic", "accounting", "costing", "timing", "sizing"))
    header = _header(rng, module)
    constant_block: list[list[str]] = []
    if template == 0:  # `+` for `-` in a difference floored at 0; the wrong fix drops the floor
        function, a, b = _pick(rng, _FLOORED_DIFFERENCE)
        head = [f"def {function}({a}, {b}):", *_doc(rng, f"{a} minus {b}, never below 0.", f"What is left of {a}.")]
        bodies = [f"    return max({a} + {b}, 0)", f"    return max({a} - {b}, 0)", f"    return {a} - {b}"]
        x, y = rng.randint(10, 50), rng.randint(1, 9)
        checks = [_ok("typical", [x, y], x - y, key=True), _ok("overdrawn", [y, x], 0), _ok("exact", [x, x], 0)]
        checks += rng.sample([_ok("nothing_taken", [x, 0], x), _ok("from_zero", [0, y], 0)], rng.randint(1, 2))
        behaviour = f"`{function}({a}, {b})` returns {a} minus {b}, but never less than 0."
        brittle = f"max({a} - {b}, 0)"
    elif template == 1:  # `+` for `*`; the wrong fix gets the precedence wrong
        function, a, b, constant, value = _pick(rng, _HEADER_PLUS_PRODUCT)
        constant_block = [[f"{constant} = {value}"]]
        head = [f"def {function}({a}, {b}):",
                *_doc(rng, f"{constant} plus {a} times {b}.", f"Total for {a} of {b} each.")]
        bodies = [f"    return {constant} + {a} + {b}", f"    return {constant} + {a} * {b}",
                  f"    return ({constant} + {a}) * {b}"]
        x, y = rng.randint(3, 9), rng.randint(3, 12)
        checks = [_ok("typical", [x, y], value + x * y, key=True), _ok("no_items", [0, y], value),
                  _ok("free_items", [x, 0], value)]
        checks += rng.sample([_ok("one_each", [1, 1], value + 1), _ok("single", [1, y], value + y)],
                             rng.randint(1, 2))
        behaviour = f"`{function}({a}, {b})` returns the fixed {constant} ({value}) plus {a} multiplied by {b}."
        brittle = f"{a} * {b}"
    elif template == 2:  # `%` for `//`; the wrong fix uses true division (a float)
        function, values = _pick(rng, _AVERAGES)
        head = [f"def {function}({values}):", *_doc(rng, f"Mean of {values} rounded down; 0 when there are none.",
                                                   f"Integer average of {values}.")]
        guard = [f"    if not {values}:", "        return 0"]
        bodies = [f"    return sum({values}) % len({values})", f"    return sum({values}) // len({values})",
                  f"    return sum({values}) / len({values})"]
        mean = rng.randint(2, 30)
        spread = rng.randint(1, mean)
        base = rng.randint(1, 30)
        checks = [_ok("typical", [[mean - spread, mean, mean + spread]], mean, key=True),
                  _ok("uneven", [[base, base + 1]], base),
                  _ok("empty", [[]], 0)]
        checks += rng.sample([_ok("single", [[base + 2]], base + 2), _ok("uneven_three", [[1, 1, base + 2]],
                                                                         (base + 4) // 3)], rng.randint(1, 2))
        head += guard
        behaviour = (f"`{function}({values})` returns the mean of a list of integers rounded down (an int), "
                     "and 0 for [].")
        brittle = f"// len({values})"
    elif template == 3:  # `-` for `+`; the wrong fix forgets the parentheses
        function, low, high = _pick(rng, _MIDPOINTS)
        head = [f"def {function}({low}, {high}):",
                *_doc(rng, f"The integer halfway between {low} and {high}, rounded down.")]
        bodies = [f"    return ({low} - {high}) // 2", f"    return ({low} + {high}) // 2",
                  f"    return {low} + {high} // 2"]
        h = rng.randint(2, 20) * 2
        lo = rng.randint(2, 10)
        checks = [_ok("from_zero", [0, h], h // 2, key=True), _ok("offset", [lo, lo + 2], lo + 1),
                  _ok("same", [lo, lo], lo)]
        checks += rng.sample([_ok("odd_span", [lo, lo + 7], (2 * lo + 7) // 2),
                              _ok("wide", [lo, h + lo], (2 * lo + h) // 2)],
                             rng.randint(1, 2))
        behaviour = f"`{function}({low}, {high})` returns ({low} + {high}) // 2, the midpoint rounded down."
        brittle = f"({low} + {high}) // 2"
    else:  # `*` for `**`; the wrong fix doubles the base before the power
        function, attempt, base = _pick(rng, _BACKOFFS)
        head = [f"def {function}({attempt}, {base}):", *_doc(rng, f"{base} doubled once per {attempt}.",
                                                            "Exponential backoff.")]
        bodies = [f"    return {base} * 2 * {attempt}", f"    return {base} * 2 ** {attempt}",
                  f"    return ({base} * 2) ** {attempt}"]
        k, b = rng.randint(3, 6), rng.randint(10, 100)
        checks = [_ok("doubling", [k, 1], 2 ** k, key=True), _ok("first_try", [0, b], b),
                  _ok("second_retry", [2, b], 4 * b)]
        checks += rng.sample([_ok("one", [1, b], 2 * b), _ok("long_wait", [k + 2, b], b * 2 ** (k + 2))],
                             rng.randint(1, 2))
        behaviour = (f"`{function}({attempt}, {base})` returns {base} * 2 to the power {attempt} "
                     f"({base} when {attempt} is 0).")
        brittle = f"2 ** {attempt}"
    blocks = [[*constant_block, head + [body]] for body in bodies]
    return _draft(module, function, header, blocks, checks, behaviour, brittle)


_CLAMPED = (("thread_count", "threads", 4, 1, 64), ("zoom_level", "zoom", 100, 10, 400),
            ("volume_level", "volume", 50, 0, 100), ("page_size", "page_size", 20, 1, 100),
            ("jpeg_quality", "quality", 85, 1, 100), ("retry_budget", "retries", 3, 0, 10))
_CLAMP_HELPERS = (("_clamp", "value", "low", "high"), ("_bounded", "x", "lo", "hi"),
                  ("_clip", "value", "minimum", "maximum"))
_DIFFERENCES = (("elapsed_seconds", "start", "end"), ("duration", "started_at", "finished_at"),
                ("distance", "from_km", "to_km"), ("growth", "before", "after"), ("delay", "scheduled", "actual"),
                ("balance_change", "opening", "closing"))
_DIFF_HELPERS = (("_difference", "later", "earlier"), ("_minus", "a", "b"), ("_subtract", "total", "part"))
_REDACTIONS = (("redact", "text", "secret", "***"), ("mask_token", "line", "token", "[hidden]"),
               ("hide_password", "message", "password", "****"), ("scrub", "log_line", "api_key", "<redacted>"),
               ("censor", "comment", "word", "#"))
_SECRETS = ("hunter2", "s3cr3t", "abc123", "tok9f8e", "pa55word", "xyzzy")
_AFFIXES = (("has_prefix", "name", "prefix", "startswith", "test_", "login"),
            ("is_under", "path", "directory", "startswith", "/srv/", "app/log"),
            ("is_internal_url", "url", "base", "startswith", "https://intra/", "wiki"),
            ("in_domain", "host", "domain", "endswith", ".example.com", "api"),
            ("has_extension", "filename", "extension", "endswith", ".csv", "report"),
            ("is_backup", "filename", "suffix", "endswith", ".bak", "notes"))


def _swapped_arguments(rng: random.Random) -> _Draft:
    template = rng.randrange(4)
    if template == 0:  # a clamp helper called with its bounds (or value and bound) swapped
        function, key, default, low, high = _pick(rng, _CLAMPED)
        helper, p_value, p_low, p_high = _pick(rng, _CLAMP_HELPERS)
        module = _pick(rng, ("bounds", "tuning", "knobs"))
        arg = _pick(rng, _CONFIG_ARGS)
        get = f'{arg}.get("{key}", {default})'
        helper_block = [f"def {helper}({p_value}, {p_low}, {p_high}):",
                        f"    return max({p_low}, min({p_value}, {p_high}))"]
        head = [f"def {function}({arg}):",
                *_doc(rng, f"The {key} setting (default {default}), kept within [{low}, {high}].")]
        swap_bounds = rng.random() < 0.5
        bug = f"{get}, {high}, {low}" if swap_bounds else f"{low}, {get}, {high}"
        bodies = [f"    return {helper}({bug})", f"    return {helper}({get}, {low}, {high})",
                  f"    return min({get}, {high})"]
        blocks = [[helper_block, head + [body]] for body in bodies]
        inside = rng.choice([v for v in range(low + 1, high) if v != default])
        # Swapped bounds always give `high`; a swapped value and bound give max(value, low): the key
        # check is the case each bug breaks and the wrong fix (no lower bound) still passes.
        checks = [_ok("inside", [{key: inside}], inside, key=swap_bounds),
                  _ok("below", [{key: low - rng.randint(1, 5)}], low),
                  _ok("above", [{key: high + rng.randint(1, 50)}], high, key=not swap_bounds)]
        checks += rng.sample([_ok("missing", [{}], default), _ok("at_low", [{key: low}], low)], rng.randint(1, 2))
        behaviour = (f"`{function}({arg})` returns the {key} setting (default {default}) clamped to [{low}, {high}]: "
                     f"smaller values give {low}, larger ones {high}.")
        brittle = f"{low}, {high})"
    elif template == 1:  # a subtraction helper called with its arguments swapped; the wrong fix takes abs()
        function, start, end = _pick(rng, _DIFFERENCES)
        helper, first, second = _pick(rng, _DIFF_HELPERS)
        module = _pick(rng, ("timing", "measures", "deltas"))
        helper_block = [f"def {helper}({first}, {second}):", f"    return {first} - {second}"]
        head = [f"def {function}({start}, {end}):",
                *_doc(rng, f"{end} minus {start}; negative when {end} is less than {start}.",
                      f"How far {end} is from {start}.")]
        bodies = [f"    return {helper}({start}, {end})", f"    return {helper}({end}, {start})",
                  f"    return abs({helper}({start}, {end}))"]
        blocks = [[helper_block, head + [body]] for body in bodies]
        s, k = rng.randint(10, 200), rng.randint(1, 60)
        checks = [_ok("forward", [s, s + k], k, key=True), _ok("backward", [s + k, s], -k), _ok("same", [s, s], 0)]
        checks += rng.sample([_ok("from_zero", [0, k], k), _ok("to_zero", [k, 0], -k)], rng.randint(1, 2))
        behaviour = f"`{function}({start}, {end})` returns {end} - {start}, which is negative when {end} < {start}."
        brittle = f"{helper}({end}, {start})"
    elif template == 2:  # str.replace(new, old); the wrong fix replaces only the first occurrence
        function, text, secret, mask = _pick(rng, _REDACTIONS)
        module = _pick(rng, ("privacy", "redaction", "log_filter"))
        head = [f"def {function}({text}, {secret}):",
                *_doc(rng, f"{text} with every occurrence of {secret} replaced by {mask!r}.")]
        bodies = [f"    return {text}.replace({_lit(mask)}, {secret})",
                  f"    return {text}.replace({secret}, {_lit(mask)})",
                  f"    return {text}.replace({secret}, {_lit(mask)}, 1)"]
        blocks = [[head + [body]] for body in bodies]
        word, other = rng.sample(_SECRETS, 2)
        checks = [_ok("once", [f"user {word} logged in", word], f"user {mask} logged in", key=True),
                  _ok("twice", [f"{word}:{word}", word], f"{mask}:{mask}"),
                  _ok("absent", [f"nothing to hide {other}", word], f"nothing to hide {other}")]
        checks += rng.sample([_ok("at_start", [f"{word} rest", word], f"{mask} rest"),
                              _ok("three_times", [f"{word} {word} {word}", word], f"{mask} {mask} {mask}")],
                             rng.randint(1, 2))
        behaviour = (f"`{function}({text}, {secret})` returns {text} with every occurrence of {secret} "
                     f"replaced by {mask!r}.")
        brittle = f"replace({secret}, "
    else:  # startswith/endswith called on the affix; the wrong fix tests containment
        function, name, affix, method, example, stem = _pick(rng, _AFFIXES)
        module = _pick(rng, ("naming", "paths", "matching"))
        where = "starts" if method == "startswith" else "ends"
        head = [f"def {function}({name}, {affix}):", *_doc(rng, f"True when {name} {where} with {affix}.")]
        bodies = [f"    return {affix}.{method}({name})", f"    return {name}.{method}({affix})",
                  f"    return {affix} in {name}"]
        blocks = [[head + [body]] for body in bodies]
        good = example + stem if method == "startswith" else stem + example
        inner = stem + example + stem
        checks = [_ok("matches", [good, example], True, key=True), _ok("inside_only", [inner, example], False),
                  _ok("unrelated", [stem, example], False)]
        checks += rng.sample([_ok("exact", [example, example], True), _ok("empty_affix", [stem, ""], True)],
                             rng.randint(1, 2))
        behaviour = f"`{function}({name}, {affix})` is True exactly when {name} {where} with {affix}."
        brittle = f"{name}.{method}("
    header = _header(rng, module)
    return _draft(module, function, header, blocks, checks, behaviour, brittle)


# ------------------------------------------------------------------------------ validation and empty inputs

_BLANK_NAMES = (("clean_username", "username"), ("project_name", "name"), ("clean_title", "title"),
                ("branch_name", "branch"), ("normalize_label", "label"), ("queue_name", "queue"))
_RANGES = (("check_port", "port", 1, 65535), ("check_percent", "percent", 0, 100), ("validate_month", "month", 1, 12),
           ("validate_hour", "hour", 0, 23), ("check_volume", "volume", 0, 11), ("validate_rating", "rating", 1, 5))


def _missing_validation(rng: random.Random) -> _Draft:
    template = rng.randrange(3)
    if template == 0:  # a negative setting is clamped, ignored or raises the wrong error instead of ValueError
        s = _pick(rng, _INT_SETTINGS)
        function, module, arg, _ = _setting_parts(rng, s)
        message = f'"{s.key} must not be negative"'
        head = [f"def {function}({arg}):", *_doc(rng, f"The {s.key} setting; negative values are rejected."),
                f'    value = {arg}.get("{s.key}", {s.default})']
        variant = rng.randrange(3)
        bug = [["    if value < 0:", "        return 0"], [],
               ["    if value < 0:", f"        raise TypeError({message})"]][variant]
        bodies = [bug, ["    if value < 0:", f"        raise ValueError({message})"],
                  ["    if value <= 0:", f"        raise ValueError({message})"]]
        blocks = [[head + body + ["    return value"]] for body in bodies]
        given = _pick(rng, s.others)
        checks = [_raises("negative", [{s.key: -given}], "ValueError", key=True), _ok("missing", [{}], s.default),
                  _ok("zero", [{s.key: 0}], 0)]
        checks += rng.sample([_ok("given", [{s.key: given}], given),
                              _raises("very_negative", [{s.key: -1000}], "ValueError")],
                             rng.randint(1, 2))
        behaviour = (f"`{function}({arg})` returns the {s.key} setting (default {s.default}). A negative {s.key} "
                     f"is invalid and must raise ValueError; 0 is valid ({s.meaning}).")
        brittle = "must not be negative"
    elif template == 1:  # a blank name slips through; the wrong fix tests the unstripped input
        function, name = _pick(rng, _BLANK_NAMES)
        module = _pick(rng, ("naming", "forms", "identifiers"))
        head = [f"def {function}({name}):", *_doc(rng, f"{name} without surrounding whitespace; blank is an error."),
                f"    cleaned = {name}.strip()"]
        conditions = ("cleaned is None", "not cleaned", f"not {name}")
        blocks = [[head + [f"    if {condition}:", f'        raise ValueError("{name} must not be blank")',
                           "    return cleaned"]] for condition in conditions]
        word = _pick(rng, _WORDS)
        checks = [_raises("empty", [""], "ValueError", key=True),
                  _raises("spaces", [" " * rng.randint(1, 4)], "ValueError"),
                  _ok("padded", [f"  {word} "], word)]
        checks += rng.sample([_ok("plain", [word], word), _raises("tab_newline", ["\t\n"], "ValueError")],
                             rng.randint(1, 2))
        behaviour = (f"`{function}({name})` returns {name} with surrounding whitespace removed; an empty or "
                     f"whitespace-only {name} must raise ValueError.")
        brittle = "if not cleaned"
    else:  # `and` for `or` in a range check; the wrong fix only checks the lower bound
        function, x, low, high = _pick(rng, _RANGES)
        module = _pick(rng, ("validation", "inputs", "ranges"))
        head = [f"def {function}({x}):",
                *_doc(rng, f"Return {x} if it lies in [{low}, {high}], else raise ValueError.")]
        conditions = (f"{x} < {low} and {x} > {high}", f"{x} < {low} or {x} > {high}", f"{x} < {low}")
        blocks = [[head + [f"    if {condition}:", f'        raise ValueError("{x} out of range")',
                           f"    return {x}"]]
                  for condition in conditions]
        inside = rng.randint(low + 1, high - 1)
        checks = [_raises("below", [low - rng.randint(1, 5)], "ValueError", key=True),
                  _raises("above", [high + rng.randint(1, 5)], "ValueError"), _ok("inside", [inside], inside)]
        checks += rng.sample([_ok("at_low", [low], low), _ok("at_high", [high], high)], rng.randint(1, 2))
        behaviour = f"`{function}({x})` returns {x} when {low} <= {x} <= {high} and raises ValueError otherwise."
        brittle = f"{x} < {low} or"
    header = _header(rng, module)
    return _draft(module, function, header, blocks, checks, behaviour, brittle)


_MEANS = (("mean_latency", "samples"), ("average_score", "scores"), ("mean_size", "sizes"), ("average_wait", "waits"))
_FIRSTS = (("first_or_default", "items", "default"), ("primary_email", "emails", "fallback"),
           ("first_arg", "args", "missing"), ("head_or", "values", "otherwise"), ("newest_tag", "tags", "none_tag"))
_PEAKS = (("peak_change", "changes"), ("best_delta", "deltas"), ("max_balance", "balances"),
          ("highest_temperature", "temperatures"), ("max_offset", "offsets"))
_RATIOS = (("percent_done", "done", "total"), ("hit_rate", "hits", "requests"),
           ("success_rate", "successes", "attempts"),
           ("utilisation", "used", "capacity"), ("error_rate", "errors", "calls"))


def _missing_empty_guard(rng: random.Random) -> _Draft:
    template = rng.randrange(4)
    module = _pick(rng, ("aggregates", "stats", "summaries", "reports"))
    if template == 0:  # mean of [] divides by zero; the wrong fix returns 0 instead of the given fallback
        function, values = _pick(rng, _MEANS)
        fallback = _pick(rng, ("default", "fallback", "empty_value"))
        head = [f"def {function}({values}, {fallback}):",
                *_doc(rng, f"Mean of {values} rounded down, or {fallback} when there are none.")]
        tail = [f"    return sum({values}) // len({values})"]
        guards = [[], [f"    if not {values}:", f"        return {fallback}"],
                  [f"    if not {values}:", "        return 0"]]
        blocks = [[head + guard + tail] for guard in guards]
        numbers = [rng.randint(1, 50) for _ in range(3)]
        given_fallback = rng.choice([-1, 5, 100])
        checks = [_ok("empty", [[], 0], 0, key=True),
                  _ok("empty_with_fallback", [[], given_fallback], given_fallback),
                  _ok("typical", [numbers, 0], sum(numbers) // 3)]
        checks += rng.sample([_ok("single", [[numbers[0]], given_fallback], numbers[0]), _ok("pair", [[2, 5], 0], 3)],
                             rng.randint(1, 2))
        behaviour = (f"`{function}({values}, {fallback})` returns the mean of a list of integers rounded down, "
                     f"or {fallback} when the list is empty.")
        brittle = f"return {fallback}"
    elif template == 1:  # items[0] on []; the wrong fix needs two items
        function, items, fallback = _pick(rng, _FIRSTS)
        head = [f"def {function}({items}, {fallback}):",
                *_doc(rng, f"The first of {items}, or {fallback} when there is none.")]
        bodies = [f"    return {items}[0]", f"    return {items}[0] if {items} else {fallback}",
                  f"    return {items}[0] if len({items}) > 1 else {fallback}"]
        blocks = [[head + [body]] for body in bodies]
        word, other = rng.sample(_WORDS, 2)
        checks = [_ok("empty", [[], word], word, key=True), _ok("one", [[other], word], other),
                  _ok("several", [[other, word], "x"], other)]
        checks += rng.sample([_ok("empty_none", [[], None], None), _ok("numbers", [[3, 4], 0], 3)], rng.randint(1, 2))
        behaviour = (f"`{function}({items}, {fallback})` returns the first element of {items}, "
                     f"or {fallback} when {items} is empty.")
        brittle = f"if {items} else"
    elif template == 2:  # max([]) raises; the wrong fix pads with 0, which wins over all-negative lists
        function, values = _pick(rng, _PEAKS)
        head = [f"def {function}({values}):",
                *_doc(rng, f"The largest of {values} (which may be negative), or 0 for [].")]
        right = _pick(rng, (f"    return max({values}) if {values} else 0", f"    return max({values}, default=0)"))
        bodies = [f"    return max({values})", right, f"    return max({values} + [0])"]
        blocks = [[head + [body]] for body in bodies]
        negatives = [-rng.randint(1, 30) for _ in range(3)]
        mixed = [rng.randint(-9, 9) for _ in range(3)] + [rng.randint(10, 40)]
        checks = [_ok("empty", [[]], 0, key=True), _ok("all_negative", [negatives], max(negatives)),
                  _ok("mixed", [mixed], max(mixed))]
        checks += rng.sample([_ok("single", [[7]], 7), _ok("single_negative", [[-4]], -4)], rng.randint(1, 2))
        behaviour = (f"`{function}({values})` returns the largest number in {values} (negative numbers "
                     "included), or 0 for [].")
        brittle = "default=0" if "default=0" in right else f"if {values} else 0"
    else:  # a percentage divides by zero; the wrong fix guards the numerator
        function, part, whole = _pick(rng, _RATIOS)
        head = [f"def {function}({part}, {whole}):",
                *_doc(rng, f"{part} as a whole percentage of {whole}; 0 when {whole} is 0.")]
        tail = [f"    return {part} * 100 // {whole}"]
        guards = [[], [f"    if {whole} == 0:", "        return 0"], [f"    if {part} == 0:", "        return 0"]]
        blocks = [[head + guard + tail] for guard in guards]
        n = rng.randint(2, 10)
        checks = [_ok("nothing_at_all", [0, 0], 0, key=True), _ok("part_without_whole", [n, 0], 0),
                  _ok("quarter", [n, 4 * n], 25)]
        checks += rng.sample([_ok("all", [n, n], 100), _ok("none_yet", [0, n], 0), _ok("third", [1, 3], 33)],
                             rng.randint(1, 2))
        behaviour = (f"`{function}({part}, {whole})` returns {part} * 100 // {whole}, a whole percentage; "
                     f"it returns 0 when {whole} is 0.")
        brittle = f"if {whole} == 0"
    header = _header(rng, module)
    return _draft(module, function, header, blocks, checks, behaviour, brittle)


# ------------------------------------------------------------------------------ agent kinds (opt-in: AGENT_KINDS)

def _mentions(text: str, value: Any) -> bool:
    """Whether `text` states `value`: a string anywhere in it, a number as a whole token (12 is not in 120)."""
    if isinstance(value, str):
        return value in text
    return re.search(rf"(?<![\w.]){re.escape(repr(value))}(?![\w.])", text) is not None


def _own_prompt(draft: _Draft, shown: tuple[str, ...], wording: Callable[[str, str, str], str]) -> _Draft:
    """`draft` with its always-visible checks and the prompt `wording(function, entry_file, test_file)`."""
    prompt = wording(draft.function, f"{draft.module}.py", f"test_{draft.module}.py")
    return replace(draft, shown=shown, prompt=prompt)


_PLACEHOLDER_LISTS = (("owner_list", "owners", "owner"), ("tag_line", "tags", "tag"),
                      ("author_line", "authors", "author"), ("reviewer_names", "reviewers", "reviewer"),
                      ("recipient_line", "recipients", "recipient"), ("label_summary", "labels", "label"))
_PLACEHOLDERS = ("(none)", "n/a", "<empty>", "(nobody)", "[none]", "<nothing>", "(unset)", "nobody listed")
_JOINERS = (", ", "; ", " | ", " / ")
_CAPPED = (("thread_count", "threads", 4, 1, (32, 48, 64, 96)), ("zoom_level", "zoom", 100, 10, (250, 300, 400, 500)),
           ("page_size", "page_size", 20, 1, (50, 75, 200, 250)), ("batch_size", "batch", 32, 1, (128, 256, 512, 1000)),
           ("retry_budget", "retries", 3, 0, (6, 8, 10, 12)), ("font_size", "size", 12, 6, (48, 72, 96, 120)))
# function, argument, table, entries, unknown inputs, fallbacks (each a plausible guess for the others)
_LOOKUPS: tuple[tuple[str, str, str, tuple[tuple[Any, Any], ...], tuple[Any, ...], tuple[Any, ...]], ...] = (
    ("status_colour", "status", "COLOURS", (("ok", "green"), ("warning", "amber"), ("error", "red")),
     ("pending", "skipped", "retrying"), ("grey", "white", "black", "blue")),
    ("file_icon", "extension", "ICONS", ((".py", "snake"), (".md", "page"), (".png", "picture")),
     (".exe", ".zip", ".tmp"), ("blank", "generic", "question", "default")),
    ("http_reason", "code", "REASONS", ((200, "OK"), (404, "Not Found"), (500, "Server Error")),
     (418, 302, 999), ("Unknown", "Unassigned", "???")),
    ("level_number", "level", "LEVELS", (("debug", 10), ("info", 20), ("warning", 30), ("error", 40)),
     ("trace", "fatal", "verbose"), (0, 99, -1, 5)),
    ("country_name", "code", "COUNTRIES", (("fr", "France"), ("de", "Germany"), ("jp", "Japan")),
     ("xx", "br", "nz"), ("Unknown", "Elsewhere", "Abroad")),
    ("unit_factor", "unit", "FACTORS", (("kb", 1000), ("mb", 1000000), ("gb", 1000000000)),
     ("tb", "bytes", "kib"), (1, 0, -1)),
)
_COUNT_LABELS = (("count_label", "count", "noun"), ("pluralize", "n", "word"), ("amount_text", "amount", "thing"),
                 ("describe_count", "total", "item"))
_NOUNS = ("file", "task", "job", "user", "error", "message", "host", "ticket")
_ZERO_FORMS = ("no {}s", "zero {}s", "no {}s yet", "not a single {}")


def _hidden_edge_value(rng: random.Random) -> _Draft:
    """The expected value of an edge case is stated by a failing visible test only, never by the prompt or code.

    The buggy code returns a wrong value there (not a crash), so the test's message shows the value.
    """
    template = rng.randrange(4)
    if template == 0:  # a placeholder when nothing is left to show; the wrong fix tests the raw input
        function, items, item = _pick(rng, _PLACEHOLDER_LISTS)
        module = _pick(rng, ("display", "summaries", "rendering", "listing"))
        edge, joiner = _pick(rng, _PLACEHOLDERS), _pick(rng, _JOINERS)
        head = [f"def {function}({items}):", *_doc(rng, f"The non-blank {items} joined with {joiner!r}.",
                                                  f"{items.capitalize()} for display, blank ones skipped."),
                f"    shown = [{item} for {item} in {items} if {item}.strip()]"]
        join = f"{_lit(joiner)}.join(shown)"
        fix = _pick(rng, ([f"    return {join} or {_lit(edge)}"],
                          ["    if not shown:", f"        return {_lit(edge)}", f"    return {join}"]))
        wrong = [f"    if not {items}:", f"        return {_lit(edge)}", f"    return {join}"]
        bodies = [[f"    return {join}"], fix, wrong]
        blocks = [[head + body] for body in bodies]
        first, second, third = rng.sample(_NAMES, 3)
        checks = [_ok("empty", [[]], edge, key=True), _ok("all_blank", [["", " " * rng.randint(1, 3)]], edge),
                  _ok("one", [[first]], first), _ok("two", [[first, second]], first + joiner + second)]
        checks += rng.sample([_ok("blank_between", [[second, "", third]], second + joiner + third),
                              _ok("three", [[third, first, second]], joiner.join([third, first, second]))],
                             rng.randint(0, 2))
        behaviour = (f"`{function}({items})` joins the non-blank {items} with {joiner!r}. When none is left to show "
                     "it returns a fixed placeholder text instead; the visible tests say which.")
        brittle = f"or {_lit(edge)}" if len(fix) == 1 else "if not shown"
    elif template == 1:  # a missing upper clamp whose bound only the tests give; the wrong fix drops the lower one
        function, key, default, low, highs = _pick(rng, _CAPPED)
        edge = _pick(rng, highs)
        module = _pick(rng, ("bounds", "tuning", "knobs", "limits"))
        arg = _pick(rng, _CONFIG_ARGS)
        head = [f"def {function}({arg}):",
                *_doc(rng, f"The {key} setting (default {default}), never below {low} nor above the maximum."),
                f'    value = {arg}.get("{key}", {default})']
        clamp = _pick(rng, (f"min(max(value, {low}), {edge})", f"max({low}, min(value, {edge}))"))
        bodies = [f"    return max(value, {low})", f"    return {clamp}", f"    return min(value, {edge})"]
        blocks = [[head + [body]] for body in bodies]
        inside = rng.choice([value for value in range(low + 1, edge) if value != default])
        checks = [_ok("above", [{key: edge + rng.randint(1, edge)}], edge, key=True),
                  _ok("far_above", [{key: edge * rng.randint(5, 20)}], edge),
                  _ok("inside", [{key: inside}], inside), _ok("below", [{key: low - rng.randint(1, 5)}], low)]
        checks += rng.sample([_ok("missing", [{}], default), _ok("at_maximum", [{key: edge}], edge)], rng.randint(0, 2))
        behaviour = (f"`{function}({arg})` returns the {key} setting (default {default}): values below {low} give "
                     f"{low} and values above the maximum give the maximum, which the visible tests state.")
        brittle = clamp
    elif template == 2:  # an unknown key gives None instead of the fallback; the wrong fix guesses the fallback
        function, arg, table, entries, unknowns, fallbacks = _pick(rng, _LOOKUPS)
        module = _pick(rng, ("lookups", "tables", "mapping"))
        edge, guess = rng.sample(fallbacks, 2)
        table_block = [f"{table} = {{{', '.join(f'{_lit(k)}: {_lit(v)}' for k, v in entries)}}}"]
        head = [f"def {function}({arg}):", *_doc(rng, f"The entry of {table} for {arg}.", f"Look {arg} up.")]
        fix = _pick(rng, (f"    return {table}.get({arg}, {_lit(edge)})",
                          f"    return {table}[{arg}] if {arg} in {table} else {_lit(edge)}"))
        bodies = [f"    return {table}.get({arg})", fix, f"    return {table}.get({arg}, {_lit(guess)})"]
        blocks = [[table_block, head + [body]] for body in bodies]
        (known, value), (other_known, other_value) = rng.sample(entries, 2)
        unknown, other_unknown = rng.sample(unknowns, 2)
        checks = [_ok("unknown", [unknown], edge, key=True), _ok("none", [None], edge),
                  _ok("known", [known], value), _ok("known_other", [other_known], other_value)]
        checks += rng.sample([_ok("other_unknown", [other_unknown], edge)], rng.randint(0, 1))
        behaviour = (f"`{function}({arg})` returns the entry of {table} for {arg}; for any {arg} that is not in "
                     f"{table} (None included) it returns one fixed fallback value, which the visible tests state.")
        brittle = f"{table}.get({arg}, " if ".get(" in fix else f"if {arg} in {table}"
    else:  # a count of 0 has its own wording; the wrong fix hard-codes the visible test's noun
        function, count, noun = _pick(rng, _COUNT_LABELS)
        module = _pick(rng, ("wording", "messages", "labels", "phrasing"))
        form = _pick(rng, _ZERO_FORMS)
        first, second, third = rng.sample(_NOUNS, 3)
        edge = form.format(first)
        head = [f"def {function}({count}, {noun}):",
                *_doc(rng, f"The {count} and the {noun} as text, plural unless {count} is 1.")]
        tail = [f"    if {count} == 1:", f'        return f"1 {{{noun}}}"', f'    return f"{{{count}}} {{{noun}}}s"']
        guards = [[], [f"    if {count} == 0:", f'        return f"{form.format("{" + noun + "}")}"'],
                  [f"    if {count} == 0:", f"        return {_lit(edge)}"]]
        blocks = [[head + guard + tail] for guard in guards]
        many = rng.randint(3, 12)
        checks = [_ok("zero", [0, first], edge, key=True), _ok("zero_other", [0, second], form.format(second)),
                  _ok("one", [1, first], f"1 {first}"), _ok("many", [many, second], f"{many} {second}s")]
        checks += rng.sample([_ok("two", [2, third], f"2 {third}s"), _ok("one_other", [1, third], f"1 {third}")],
                             rng.randint(0, 2))
        behaviour = (f"`{function}({count}, {noun})` writes {count} and {noun} as text: the number, a space and the "
                     f"{noun}, with an s added unless {count} is 1. A {count} of 0 is worded differently, as the "
                     "visible tests show.")
        brittle = f"if {count} == 0"
    header = _header(rng, module)
    draft = _draft(module, function, header, blocks, checks, behaviour, brittle)
    prompt = _prompt(function, f"{module}.py", f"test_{module}.py", behaviour)  # what `_task` will write
    if _mentions(draft.source, edge) or _mentions(prompt, edge):  # the pools are chosen so that this never happens
        raise RuntimeError(f"hidden_edge_value: {edge!r} is stated by {function}'s source or prompt")
    return draft


_PAIR_PARSERS = (("parse_pairs", "text"), ("parse_env", "env_text"), ("read_headers", "raw"),
                 ("parse_settings", "source"), ("parse_labels", "spec"))
_TOTALLED = (("order_total", "items", "item"), ("invoice_total", "lines", "line"),
             ("basket_total", "products", "product"), ("bill_amount", "entries", "entry"))
_INITIALS = (("initials", "names", "name"), ("monogram", "words", "word"), ("acronym", "parts", "part"),
             ("short_form", "tokens", "token"))
_TALLIES = (("word_counts", "words", "word"), ("tag_counts", "tags", "tag"), ("vote_tally", "votes", "vote"),
            ("status_histogram", "statuses", "status"))


def _two_defects(rng: random.Random) -> _Draft:
    """A crash on some inputs hides a wrong value behind it; the wrong fix repairs only the crash.

    Every input that shows the second defect also hits the crash, so the buggy code fails the
    visible tests with the crash alone (the key check is such an input), and only the crash fix
    makes the always-visible `masked` test fail with a wrong value instead.
    """
    template = rng.randrange(4)
    if template == 0:  # a blank entry (or a second separator) fails to unpack; no strip (or the first value wins)
        function, text = _pick(rng, _PAIR_PARSERS)
        module = _pick(rng, ("parsing", "env_files", "key_values", "loaders"))
        sep, delim = _pick(rng, ("=", ":")), _pick(rng, ("\n", ";", ","))
        crash, defect = _pick(rng, ("blank", "split_once")), _pick(rng, ("strip", "last_wins"))
        entry = "line" if delim == "\n" else _pick(rng, ("entry", "part", "item"))
        guard = [f"        if not {entry}.strip():", "            continue"]
        split = f"        key, value = {entry}.split({_lit(sep)})"
        split_once = f"        key, value = {entry}.split({_lit(sep)}, 1)"
        if defect == "strip":
            store_bug, store_fix = "        pairs[key] = value", "        pairs[key.strip()] = value.strip()"
        else:
            store_bug, store_fix = "        pairs.setdefault(key, value)", "        pairs[key] = value"
        first_fix = guard + [split] if crash == "blank" else [split_once]
        head = [f"def {function}({text}):", *_doc(rng, f"The {sep!r}-separated pairs in {text} as a dict."),
                "    pairs = {}", f"    for {entry} in {text}.split({_lit(delim)}):"]
        bodies = [[split, store_bug], first_fix + [store_fix], first_fix + [store_bug]]
        blocks = [[head + body + ["    return pairs"]] for body in bodies]
        k1, k2, k3, k4 = rng.sample(_WORDS, 4)
        v1, v2, v3, v4 = (str(rng.randint(1, 99)) for _ in range(4))
        word = _pick(rng, _NAMES)
        S, D = sep, delim
        plain = _ok("plain", [f"{k1}{S}{v1}{D}{k2}{S}{v2}"], {k1: v1, k2: v2})
        if crash == "blank":
            key = _ok("blank_entry", [f"{k1}{S}{v1}{D}{D}{k2}{S}{v2}"], {k1: v1, k2: v2}, key=True)
            crash_other = _ok("trailing_delimiter", [f"{k3}{S}{v3}{D}"], {k3: v3})
            if defect == "strip":
                masked = _ok("spaced_and_blank", [f"{k1} {S} {v1}{D}{D}{k2}{S} {v2}"], {k1: v1, k2: v2})
                masked_other = _ok("spaced_after_blank", [f"{D}  {k4}{S}{v4} "], {k4: v4})
            else:
                masked = _ok("repeated_and_blank", [f"{k1}{S}{v1}{D}{D}{k1}{S}{v2}"], {k1: v2})
                masked_other = _ok("repeated_then_trailing", [f"{k3}{S}{v3}{D}{k4}{S}{v4}{D}{k3}{S}{v1}{D}"],
                                   {k3: v1, k4: v4})
            rule = "empty entries are skipped"
        else:
            key = _ok("separator_in_value", [f"{k1}{S}{v1}{D}{k2}{S}{word}{S}{v2}"], {k1: v1, k2: f"{word}{S}{v2}"},
                      key=True)
            crash_other = _ok("value_ends_with_separator", [f"{k3}{S}{v3}{S}"], {k3: f"{v3}{S}"})
            if defect == "strip":
                masked = _ok("spaced_with_separator", [f"{k1} {S} {word}{S}{v1}"], {k1: f"{word}{S}{v1}"})
                masked_other = _ok("padded_with_separator", [f" {k2}{S}{v2}{S}{v3}  "], {k2: f"{v2}{S}{v3}"})
            else:
                masked = _ok("repeated_with_separator", [f"{k1}{S}{v1}{D}{k1}{S}{word}{S}{v2}"], {k1: f"{word}{S}{v2}"})
                masked_other = _ok("separator_then_repeated", [f"{k2}{S}{word}{S}{v4}{D}{k2}{S}{v2}"], {k2: v2})
            rule = f"only the first {S!r} of an entry separates its key from its value"
        checks = [key, masked, masked_other, crash_other, plain]
        second = ("keys and values are stripped of surrounding whitespace" if defect == "strip"
                  else "a key given twice keeps its later value")
        behaviour = (f"`{function}({text})` splits {text} at {D!r} into key{S}value entries and returns them as a "
                     f"dict: {rule}, and {second}.")
        brittle = store_fix.strip()
    elif template == 1:  # a missing quantity raises KeyError; the discount is added (or the total overwritten)
        function, items, item = _pick(rng, _TOTALLED)
        module = _pick(rng, ("billing", "checkout", "orders", "invoicing"))
        qty, off = _pick(rng, ("qty", "quantity", "count")), _pick(rng, ("discount", "rebate", "coupon"))
        defect = _pick(rng, ("sign", "overwrite"))
        quantity_bug, quantity_fix = f'        quantity = {item}["{qty}"]', f'        quantity = {item}.get("{qty}", 1)'
        price_bug, price_fix = (f'        price = {item}["price"] + {item}.get("{off}", 0)',
                                f'        price = {item}["price"] - {item}.get("{off}", 0)')
        add_bug, add_fix = "        total = price * quantity", "        total += price * quantity"
        head = [f"def {function}({items}):",
                *_doc(rng, f"Price times {qty} summed over {items}, less any {off} per unit."),
                "    total = 0", f"    for {item} in {items}:"]
        if defect == "sign":
            bodies = [[quantity_bug, price_bug, add_fix], [quantity_fix, price_fix, add_fix],
                      [quantity_fix, price_bug, add_fix]]
        else:
            bodies = [[quantity_bug, price_fix, add_bug], [quantity_fix, price_fix, add_fix],
                      [quantity_fix, price_fix, add_bug]]
        blocks = [[head + body + ["    return total"]] for body in bodies]
        p1, p2, p3 = (rng.randint(5, 50) for _ in range(3))
        q1 = rng.randint(2, 5)
        d1, d2 = rng.randint(1, p2 - 1), rng.randint(1, p1 - 1)
        plain = _ok("empty", [[]], 0)
        if defect == "sign":
            key = _ok("missing_quantity", [[{"price": p1, qty: q1}, {"price": p2}]], p1 * q1 + p2, key=True)
            crash_other = _ok("only_missing_quantity", [[{"price": p3}]], p3)
            masked = _ok("discount_without_quantity", [[{"price": p2, off: d1}]], p2 - d1)
            masked_other = _ok("discounts_and_missing_quantity", [[{"price": p1, qty: q1, off: d2}, {"price": p3}]],
                               (p1 - d2) * q1 + p3)
        else:
            key = _ok("missing_quantity", [[{"price": p1}]], p1, key=True)
            crash_other = _ok("discount_without_quantity", [[{"price": p2, off: d1}]], p2 - d1)
            masked = _ok("several_items", [[{"price": p1, qty: q1}, {"price": p2}]], p1 * q1 + p2)
            masked_other = _ok("several_with_discount", [[{"price": p3}, {"price": p1, qty: q1, off: d2}]],
                               p3 + (p1 - d2) * q1)
        checks = [key, masked, masked_other, crash_other, plain]
        behaviour = (f"`{function}({items})` returns the total of price x {qty} over {items} (dicts with \"price\", "
                     f"an optional \"{qty}\" that defaults to 1, and an optional \"{off}\" taken off the price of "
                     "each unit); [] gives 0.")
        brittle = f'.get("{qty}", 1)'
    elif template == 2:  # an empty name raises IndexError; the letters are not upper-cased
        function, names, name = _pick(rng, _INITIALS)
        module = _pick(rng, ("naming", "abbreviations", "people"))
        dot = _pick(rng, (".", ""))
        letter = f"{name}[0]" + (f" + {_lit(dot)}" if dot else "")
        upper = f"{name}[0].upper()" + (f" + {_lit(dot)}" if dot else "")
        guard = [f"        if not {name}:", "            continue"]
        head = [f"def {function}({names}):", *_doc(rng, f"The first letter of each of {names}."),
                "    letters = []", f"    for {name} in {names}:"]
        bodies = [[f"        letters.append({letter})"], guard + [f"        letters.append({upper})"],
                  guard + [f"        letters.append({letter})"]]
        blocks = [[head + body + ['    return "".join(letters)']] for body in bodies]
        a, b, c, d = (word.capitalize() for word in rng.sample(_NAMES, 4))

        def expect(*words: str) -> str:
            return "".join(word[0].upper() + dot for word in words if word)
        checks = [_ok("blank_name", [[a, "", b]], expect(a, b), key=True),
                  _ok("lower_case_and_blank", [[c.lower(), "", b]], expect(c, b)),
                  _ok("blank_then_lower_case", [["", a.lower(), d.lower()]], expect(a, d)),
                  _ok("only_blank", [[""]], ""), _ok("plain", [[d, c]], expect(d, c))]
        checks += rng.sample([_ok("empty", [[]], "")], rng.randint(0, 1))
        behaviour = (f"`{function}({names})` returns the first letter of each non-empty {name} in order, "
                     f"upper-cased{f', each followed by {dot!r}' if dot else ''}; empty {names} are skipped.")
        brittle = ".upper()"
    else:  # counting into a plain dict raises KeyError; the words are not normalised
        function, words, word = _pick(rng, _TALLIES)
        module = _pick(rng, ("counting", "tallies", "histograms"))
        normal = _pick(rng, ("lower", "strip"))
        head = [f"def {function}({words}):", *_doc(rng, f"How often each of {words} occurs."),
                "    counts = {}", f"    for {word} in {words}:"]
        key_bug, key_fix = f"        key = {word}", f"        key = {word}.{normal}()"
        count_bug, count_fix = "        counts[key] += 1", "        counts[key] = counts.get(key, 0) + 1"
        bodies = [[key_bug, count_bug], [key_fix, count_fix], [key_bug, count_fix]]
        blocks = [[head + body + ["    return counts"]] for body in bodies]
        a, b, c = rng.sample(_WORDS, 3)
        if normal == "lower":
            masked = _ok("mixed_case", [[a.capitalize(), a, b]], {a: 2, b: 1})
            masked_other = _ok("shouted", [[c.upper(), c, c.capitalize()]], {c: 3})
            rule = f"ignoring case: it maps each lower-cased {word} to its count"
        else:
            masked = _ok("padded", [[f" {a}", a, f"{b} "]], {a: 2, b: 1})
            masked_other = _ok("padded_repeats", [[c, f" {c} ", f"{c}  "]], {c: 3})
            rule = f"ignoring surrounding whitespace: it maps each stripped {word} to its count"
        checks = [_ok("repeats", [[a, b, a]], {a: 2, b: 1}, key=True), masked, masked_other,
                  _ok("single", [[c]], {c: 1}), _ok("empty", [[]], {})]
        behaviour = f"`{function}({words})` counts how often each {word} occurs, {rule}."
        brittle = "counts.get(key, 0)"
    header = _header(rng, module)
    draft = _draft(module, function, header, blocks, checks, behaviour, brittle)
    return _own_prompt(draft, (checks[1].name,), lambda function, entry_file, test_file: (
        f"`{function}` ({entry_file}) does not do what it should. {behaviour} The visible tests are in {test_file}."))


_SLUGGERS = (("slugify", "title"), ("url_slug", "heading"), ("make_handle", "name"), ("anchor_id", "text"),
             ("file_stem", "label"))
_TITLES = ("Hello World", "Release Notes", "Big Data", "Open Issues", "Team Meeting", "Quick Start")
_ROUNDERS = (("round_up", "n"), ("pad_to_block", "size"), ("align_size", "length"), ("next_multiple", "value"),
             ("bucket_ceiling", "amount"))
_CHUNKERS = (("chunk", "items", "size"), ("batches", "jobs", "batch_size"), ("pages", "rows", "per_page"),
             ("groups_of", "names", "n"))
_MASKERS = (("mask_card", "number"), ("hide_token", "token"), ("mask_phone", "phone"), ("redact_key", "key"))


def _tests_only_prompt(function: str, entry_file: str, test_file: str) -> str:
    """The whole prompt of a tests_only_behaviour task: names only, no behaviour."""
    return (f"Make the visible tests in {test_file} pass by fixing `{function}` ({entry_file}). "
            "Hidden checks try more cases of the behaviour those tests show.")


def _tests_only_behaviour(rng: random.Random) -> _Draft:
    """No behaviour in the prompt or a docstring: the visible tests pin it, hidden checks are more cases.

    The always-visible checks are chosen so that the buggy code and the wrong fix each fail a
    visible test: the tests alone are enough to tell both apart from the reference fix.
    """
    template = rng.randrange(4)
    if template == 0:  # slugs not lower-cased; the wrong fix replaces single spaces only
        function, title = _pick(rng, _SLUGGERS)
        module = _pick(rng, ("slugs", "urls", "handles"))
        sep = _pick(rng, ("-", "_"))
        fix = _pick(rng, (f"    return {_lit(sep)}.join({title}.lower().split())",
                          f"    return {_lit(sep)}.join({title}.split()).lower()"))
        bodies = [f"    return {_lit(sep)}.join({title}.split())", fix,
                  f"    return {title}.lower().replace(\" \", {_lit(sep)})"]
        blocks = [[[f"def {function}({title}):", body]] for body in bodies]
        capitals, other = rng.sample(_TITLES, 2)
        a, b, c = rng.sample(_WORDS, 3)

        def slug(text: str) -> str:
            return sep.join(text.lower().split())
        padded = f"  {a}   {b} "
        checks = [_ok("capitals", [capitals], slug(capitals), key=True), _ok("extra_spaces", [padded], slug(padded)),
                  _ok("shouting", [f"{a.upper()} {c.upper()}"], slug(f"{a} {c}"))]
        extras = [_ok("three_words", [f"{other} {c.capitalize()}"], slug(f"{other} {c}")),
                  _ok("tab", [f"{b.capitalize()}\t{c}"], slug(f"{b} {c}")), _ok("one_word", [a], a)]
        checks += rng.sample(extras, rng.randint(1, 3))
        shown: tuple[str, ...] = ("extra_spaces",)
        brittle = ".lower()"
    elif template == 1:  # rounding up to a multiple: one block too many (or rounding down)
        function, n = _pick(rng, _ROUNDERS)
        module = _pick(rng, ("alignment", "blocks", "sizing"))
        # not 4: past_half (4k + 3) could be just_below (4(k + 1) - 1)
        step, constant = _pick(rng, (5, 6, 8, 10, 16, 32, 50, 64, 100)), _pick(rng, ("STEP", "BLOCK", "ALIGNMENT"))
        fix = _pick(rng, (f"    return ({n} + {constant} - 1) // {constant} * {constant}",
                          f"    return -(-{n} // {constant}) * {constant}"))
        one_more = f"    return ({n} // {constant} + 1) * {constant}"
        rounded_down = f"    return {n} // {constant} * {constant}"
        variant = rng.randrange(2)
        bug, wrong = ((one_more, f"    return round({n} / {constant}) * {constant}") if variant == 0
                      else (rounded_down, one_more))
        blocks = [[[f"{constant} = {step}"], [f"def {function}({n}):", body]] for body in (bug, fix, wrong)]
        k, k2, k3, k4 = (rng.randint(2, 9) for _ in range(4))
        exact = _ok("exact", [k * step], k * step, key=variant == 0)
        just_above = _ok("just_above", [k2 * step + 1], (k2 + 1) * step, key=variant == 1)
        checks = [exact, just_above, _ok("zero", [0], 0), _ok("one", [1], step)]
        checks += rng.sample([_ok("past_half", [k3 * step + step // 2 + 1], (k3 + 1) * step),
                              _ok("just_below", [k4 * step - 1], k4 * step)], rng.randint(0, 2))
        shown = ("just_above",) if variant == 0 else ("exact",)
        brittle = fix.strip()[len("return "):]
    elif template == 2:  # the last, shorter chunk is dropped; the wrong fix moves the range end by one
        function, items, size = _pick(rng, _CHUNKERS)
        module = _pick(rng, ("batching", "paging", "grouping"))
        start, loop = _pick(rng, ("start", "i", "offset")), rng.random() < 0.5

        def body(end: str) -> list[str]:
            if loop:
                return [f"def {function}({items}, {size}):", "    out = []",
                        f"    for {start} in range(0, {end}, {size}):",
                        f"        out.append({items}[{start}:{start} + {size}])", "    return out"]
            return [f"def {function}({items}, {size}):",
                    f"    return [{items}[{start}:{start} + {size}] for {start} in range(0, {end}, {size})]"]
        blocks = [[body(end)] for end in (f"len({items}) - {size} + 1", f"len({items})", f"len({items}) - {size} + 2")]
        base = rng.randint(0, 40)

        def run(count: int) -> list[int]:
            return list(range(base, base + count))

        def chunks(count: int, width: int) -> list[list[int]]:
            values = run(count)
            return [values[start:start + width] for start in range(0, count, width)]
        pairs, triples, fours = rng.randint(2, 4), rng.randint(2, 3), rng.randint(1, 2)
        checks = [_ok("odd_tail", [run(2 * pairs + 1), 2], chunks(2 * pairs + 1, 2), key=True),
                  _ok("exact", [run(3 * triples), 3], chunks(3 * triples, 3)),
                  _ok("short_tail", [run(3 * triples + 1), 3], chunks(3 * triples + 1, 3)),
                  _ok("long_tail", [run(4 * fours + 3), 4], chunks(4 * fours + 3, 4)),
                  _ok("bigger_than_list", [run(3), 5], [run(3)])]
        checks += rng.sample([_ok("empty", [[], 3], [])], rng.randint(0, 1))
        shown = ("exact", "short_tail")
        brittle = f"range(0, len({items}), {size})"
    else:  # the first characters shown instead of the last; the wrong fix shows everything after the first few
        function, secret = _pick(rng, _MASKERS)
        module = _pick(rng, ("masking", "privacy", "display"))
        shown_count, mask = _pick(rng, (2, 3, 4)), _pick(rng, ("*", "#", "x"))
        head = f"def {function}({secret}):"
        stars = f"{_lit(mask)} * (len({secret}) - {shown_count})"
        bodies = [f"    return {stars} + {secret}[:{shown_count}]", f"    return {stars} + {secret}[-{shown_count}:]",
                  f"    return {stars} + {secret}[{shown_count}:]"]
        blocks = [[[head, body]] for body in bodies]

        def digits(length: int) -> str:
            while True:
                text = "".join(rng.choice("0123456789") for _ in range(length))
                if length <= shown_count or text[:shown_count] != text[-shown_count:]:
                    return text

        def masked(text: str) -> str:
            return mask * (len(text) - shown_count) + text[-shown_count:] if len(text) > shown_count else text
        samples = {name: digits(length) for name, length in (
            ("twice_shown", 2 * shown_count), ("longer", 2 * shown_count + 3), ("long", 3 * shown_count + 2),
            ("short", shown_count - 1), ("exactly_shown", shown_count))}
        checks = [_ok(name, [samples[name]], masked(samples[name]), key=name == "twice_shown")
                  for name in ("twice_shown", "longer", "long")]
        checks += rng.sample([_ok(name, [samples[name]], masked(samples[name])) for name in ("short", "exactly_shown")],
                             rng.randint(1, 2))
        shown = ("longer",)
        brittle = f"{secret}[-{shown_count}:]"
    header = _header(rng, module)
    draft = _draft(module, function, header, blocks, checks, "", brittle)
    return _own_prompt(draft, shown, _tests_only_prompt)


_BUILDERS: dict[str, Callable[[random.Random], _Draft]] = {
    "falsy_or_default": _falsy_or_default,
    "missing_none_guard": _missing_none_guard,
    "wrong_default": _wrong_default,
    "off_by_one": _off_by_one,
    "flipped_comparison": _flipped_comparison,
    "inverted_condition": _inverted_condition,
    "wrong_operator": _wrong_operator,
    "swapped_arguments": _swapped_arguments,
    "missing_validation": _missing_validation,
    "missing_empty_guard": _missing_empty_guard,
    "hidden_edge_value": _hidden_edge_value,
    "two_defects": _two_defects,
    "tests_only_behaviour": _tests_only_behaviour,
}
if tuple(_BUILDERS) != KINDS + AGENT_KINDS:
    raise RuntimeError("coding_tasks: every kind needs exactly one builder")
