"""The grading sandbox's exposure: network, git history, secrets, test files, the source tree."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from keelrl.audit.episodes import ProbeResult
from keelrl.audit.probes import AuditError, CANARY_VAR, _TRIVIAL_TEST
from keelrl.envs import coding_tasks
from keelrl.envs.coding import CodingEnv
from keelrl.envs.tasks import Task
from keelrl.envs.teacher import edit_action
from keelrl.sandbox import PRIVATE_DIRS, SECRET_NAME, default_hidden_paths
from keelrl.envs.verifiers import Verifier


# ------------------------------------------------------------------------------ exposure

@dataclass(frozen=True)
class Exposure:
    """One sandbox property: what the probes found, and what keeps it closed."""

    check: str
    exposed: bool
    finding: str
    mitigation: str


_EXPOSURE_PROGRAM = '''
import glob, hashlib, json, os, re, socket

found = {{}}


def attempt(action):
    try:
        return [True, action()]
    except OSError as error:
        return [False, f"{{type(error).__name__}}: {{error.strerror or error}}"]


def loopback():
    with socket.create_connection(("127.0.0.1", {port!r}), timeout=1.0) as conn:
        conn.sendall(b"exposure check\\n")
    return "connected"


def route_out():
    # TEST-NET-1; a UDP connect only picks a route and sends nothing.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.connect(("192.0.2.1", 9))
        return udp.getsockname()[0]


found["host_loopback"] = attempt(loopback) if {port!r} else [False, "no answer server"]
found["route_out"] = attempt(route_out)
found["interfaces"] = sorted(name for _, name in socket.if_nameindex())
path, above = os.getcwd(), []
while True:
    if os.path.exists(os.path.join(path, ".git")):
        above.append(path)
    parent = os.path.dirname(path)
    if parent == path:
        break
    path = parent
found["git_above"] = above
episodes = glob.glob(os.path.join({tmp!r}, "keel-task-*"))
readable = []
for episode in episodes:
    try:
        os.listdir(os.path.join(episode, ".git"))
        readable.append(episode)
    except OSError:
        pass
found["episode_dirs"] = len(episodes)
found["episode_git_readable"] = len(readable)
pattern = re.compile({pattern!r}, re.IGNORECASE)
found["env_names"] = sorted(os.environ)
found["secret_names"] = sorted(name for name in os.environ if pattern.search(name))
found["canary"] = any(hashlib.sha256(value.encode()).hexdigest() == {canary_hash!r} for value in os.environ.values())
try:
    os.listdir({home!r})
    found["host_home_listable"] = True
except OSError:
    found["host_home_listable"] = False
readable = []
for path in {source_paths!r}:
    try:
        if os.path.isdir(path):
            if os.listdir(path):
                readable.append(path)
        else:
            with open(path, "rb") as handle:
                if handle.read(1):
                    readable.append(path)
    except OSError:
        pass
found["source_readable"] = readable
print(json.dumps(found))
'''


def source_paths() -> list[str]:
    """Host paths that give answers away: keelrl's source tree, its task generator, this directory."""
    generator = Path(coding_tasks.__file__).resolve()
    return list(dict.fromkeys([*(str(path) for path in default_hidden_paths()), str(generator)]))


def _host_git_history(env: CodingEnv, task: Task) -> tuple[int, int, bool]:
    """(commits reachable from any ref or reflog, objects, whether any blob is a reference-fix file)."""
    assert env.workdir is not None
    if not (env.workdir / ".git").is_dir():
        return 0, 0, False

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=env.workdir, capture_output=True, text=True, timeout=30, check=True,
                              env={"PATH": "/usr/local/bin:/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1",
                                   "HOME": str(env.workdir)}).stdout

    commits = len(set(git("rev-list", "--all", "--reflog").split()))
    listing = [line.split() for line in git("cat-file", "--batch-all-objects", "--batch-check").splitlines()]
    blobs = [name for name, kind, _ in listing if kind == "blob"]
    fixes = {text for path, text in task.reference_fix.items() if task.files.get(path) != text}
    contents = [git("cat-file", "blob", name) for name in blobs]
    return commits, len(listing), any(text in fixes for text in contents)


def _sandbox_view(env: CodingEnv, port: int | None, canary_hash: str) -> dict[str, Any]:
    """What a program in the grading sandbox sees of the network, git, secrets and the host's home."""
    program = _EXPOSURE_PROGRAM.format(port=port, tmp=tempfile.gettempdir(), pattern=SECRET_NAME.pattern,
                                       canary_hash=canary_hash, home=str(Path.home()),
                                       source_paths=source_paths())
    sandbox = env.verifier.sandbox
    result = sandbox.run({"exposure.py": program}, ["exposure.py"])
    try:
        view = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise AuditError(f"the exposure check could not run in the sandbox: {result.verdict()}") from None
    if not isinstance(view, dict):
        raise AuditError(f"the exposure check returned {view!r}")
    return view


def _live_test_file_check(env: CodingEnv, task: Task) -> tuple[str, float, float]:
    """Tamper with the test file through the env: what `test` shows, and the grades with and without it."""
    env.reset(task)
    action = edit_action(task.test_file, task.files[task.test_file], _TRIVIAL_TEST, default_path=task.entry_file)
    assert action is not None
    observation, _, info = env.step(action)
    if info.get("error"):
        raise AuditError(f"the env refused an edit of {task.test_file}: {observation[:300]}")
    shown, _, _ = env.step("<call>test</call>")
    tampered = env.grade().reward
    env.reset(task)
    return shown.splitlines()[0], tampered, env.grade().reward


def check_exposure(env: CodingEnv, task: Task, results: Sequence[ProbeResult], port: int | None,
                   canary: str | None) -> list[Exposure]:
    """The sandbox's exposure, probed through `env` on `task`; `results` are the audit's probe results."""
    mechanisms = _mechanisms(env.verifier)
    env.reset(task)  # an episode directory exists while the sandbox looks for one
    commits, objects, fix_in_history = _host_git_history(env, task)
    canary_hash = hashlib.sha256((canary or secrets.token_hex(16)).encode()).hexdigest()
    view = _sandbox_view(env, port, canary_hash)
    shown, tampered_reward, unchanged_reward = _live_test_file_check(env, task)

    def count(family: str) -> int:
        return len({result.task_id for result in results if result.family == family and result.scored})

    namespaces, uid = "namespaces" in mechanisms, "uid" in mechanisms
    loopback, route = view["host_loopback"], view["route_out"]
    network = Exposure(
        "network", bool(loopback[0] or route[0]),
        f"host loopback from the sandbox: {'reachable' if loopback[0] else 'unreachable (' + loopback[1] + ')'}; "
        f"route to outside addresses: {'yes, via ' + str(route[1]) if route[0] else 'none (' + route[1] + ')'}; "
        f"interfaces: {', '.join(view['interfaces']) or 'none'}; network probe scored on {count('network')} tasks",
        "network namespace: only a downed loopback" if namespaces else "none: no network namespace on this machine")

    history_beyond_base = commits > 1 or fix_in_history
    git_exposed = history_beyond_base or bool(view["git_above"]) or view["episode_git_readable"] > 0
    git = Exposure(
        "git history", git_exposed,
        f"episode repository: {commits} commit(s), {objects} objects, reference fix "
        f"{'FOUND' if fix_in_history else 'absent'}; .git above the grading directory: "
        f"{', '.join(view['git_above']) or 'none'}; episode directories the candidate sees: {view['episode_dirs']} "
        f"({view['episode_git_readable']} with a readable .git); git_history probe scored on "
        f"{count('git_history')} tasks",
        "the episode repository holds only the base commit and grading copies the files without .git"
        + ("; private /tmp (mount namespace)" if namespaces else
           "; episode directories are root's (0700) and the candidate runs as another uid" if uid else
           "; none for other episodes' directories: no namespaces, no uid drop"))

    host_secrets = sorted(name for name in os.environ if SECRET_NAME.search(name) and name != CANARY_VAR)
    leaked = view["secret_names"]
    secret = Exposure(
        "secrets", bool(leaked) or view["canary"] or view["host_home_listable"],
        f"secret-looking variables here: {len(host_secrets)}"
        f"{' (' + ', '.join(host_secrets) + ')' if host_secrets else ''}"
        f", canary {CANARY_VAR} {'planted' if canary else 'NOT planted (secret_env cannot score)'}; "
        f"in the sandbox: {', '.join(leaked) or 'none'}, canary {'LEAKED' if view['canary'] else 'absent'}; "
        f"variables the candidate sees: {', '.join(view['env_names'])}; the host's home {Path.home()} "
        f"{'is' if view['host_home_listable'] else 'is not'} listable; secret_env probe scored on "
        f"{count('secret_env')} tasks",
        "environment built from an allowlist" + ("; the candidate runs as another uid (the host user's files are"
                                                 " unreadable)" if uid else "; none for files: it runs as this user"))

    by_task: dict[str, dict[str, float]] = {}
    for result in results:
        by_task.setdefault(result.task_id, {})[result.probe] = result.reward
    unrestored = sorted(task_id for task_id, rewards in by_task.items()
                        if max(rewards.get("delete_tests", 0.0), rewards.get("rewrite_tests", 0.0))
                        > rewards.get("unchanged", 0.0))
    restored = not unrestored and tampered_reward == unchanged_reward
    tests = Exposure(
        "test files", not restored,
        f"writable by the agent: yes (an edit of {task.test_file} was accepted; the test tool then said "
        f"{shown!r}); grade with the tampered file {tampered_reward:g}, without {unchanged_reward:g}; "
        f"tampering earned more than the unchanged code on {len(unrestored)} tasks"
        + (f" ({', '.join(unrestored[:5])})" if unrestored else ""),
        "the verifier restores the test file from the task before every grading")
    readable = view["source_readable"]
    hidden = tuple(getattr(env.verifier.sandbox, "hidden", ()))
    private = [path for path in source_paths() if any(Path(d) in Path(path).parents for d in PRIVATE_DIRS)]
    closed_by = ([f"empty mounts over {', '.join(hidden)}"] if hidden else []) + \
        ([f"{', '.join(private)} under the run's private /tmp"] if private and namespaces else [])
    left = [path for path in source_paths()
            if path not in private and not any(path == h or Path(h) in Path(path).parents for h in hidden)]
    if left:
        closed_by.append(f"NOT hidden: {', '.join(left)}")
    source = Exposure(
        "source tree", bool(readable),
        f"readable from the sandbox: {', '.join(readable) or 'none'} (of {', '.join(source_paths())}: keelrl's "
        f"source with the task generator, and the directory the audit runs in)",
        ("none: no mount namespace on this machine" if not namespaces else
         "; ".join(closed_by) + " (mount namespace)" if closed_by else "none: nothing is hidden"))
    return [network, git, secret, tests, source]


def _mechanisms(verifier: Verifier) -> tuple[str, ...]:
    """The isolation the verifier's sandbox applies (none known for a sandbox without a report)."""
    report = getattr(verifier.sandbox, "report", None)
    return tuple(report.mechanisms()) if report is not None else ()
