"""Hostile programs against `keelrl.sandbox`: one test per way out, each asserting containment.

Every hostile test checks four things: the attack did not succeed, the run ended in bounded
time, the host (this process, its files, a sentinel process, a concurrent run) is unharmed,
and `result.status` / `result.verdict()` say why the run ended. After every test a fixture
checks that no process with a sandbox uid escaped a finished run and that a plain run still works.

The suite expects the full isolation (root, `unshare` permitted): the `sandbox` fixture
requires it, so on a weaker machine the suite fails loudly instead of passing vacuously.
This workplace forbids traffic to non-loopback addresses: the one test that tries an outside
address first checks, inside the sandbox, that there is no interface but `lo` and no route.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

import keelrl.sandbox as sandbox_module
from keelrl.sandbox import (RUN_UID_BASE, RUN_UID_SPAN, SAFE_ENV, Sandbox, SandboxLimits,
                            SandboxResult, isolation_report)

LIMITS = SandboxLimits(wall_time_s=3, cpu_time_s=2, memory_mb=256, max_processes=16, max_file_mb=2,
                       max_open_files=32, tmpfs_mb=8)
FULL = ("namespaces", "uid", "rlimits", "env", "wall")
SECRETS = {"OPENAI_API_KEY": "sk-keel-secret-openai", "GITHUB_TOKEN": "ghp_keel-secret-github",
           "AWS_SECRET_ACCESS_KEY": "keel-secret-aws", "HTTPS_PROXY": "http://keel-secret-proxy:3128",
           "HF_TOKEN": "hf_keel-secret-hf", "ANTHROPIC_API_KEY": "keel-secret-anthropic"}


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS, require=("namespaces", "uid"))


def _run(box: Sandbox, program: str, *args: str, files: dict | None = None,
         **kwargs: object) -> SandboxResult:
    return box.run({"main.py": program, **(files or {})}, ["main.py", *args], **kwargs)  # type: ignore[arg-type]


def _stray_sandbox_processes() -> list[str]:
    """Live host processes with a sandbox uid that no running launcher owns any more.

    Other sessions on the machine may be running sandboxes right now: their processes have a
    live launcher among their ancestors. A process that escaped a finished run has none.
    """
    table = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            launcher = b"_sandbox_launcher.py" in (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        table[int(status.parent.name)] = (int(fields["PPid"]), int(fields["Uid"].split()[0]),
                                          fields["State"].strip(), launcher, fields["Name"].strip())
    stray = []
    for pid, (ppid, uid, state, _, name) in table.items():
        if not RUN_UID_BASE <= uid < RUN_UID_BASE + RUN_UID_SPAN or state.startswith("Z"):
            continue
        ancestor, owned = ppid, False
        while ancestor in table and not owned:
            owned = table[ancestor][3]
            ancestor = table[ancestor][0] if ancestor != table[ancestor][0] else -1
        if not owned:
            stray.append(f"{pid} uid {uid} {name}")
    return stray


def _host_processes_with(marker: str, *, sandbox_uid_only: bool = False) -> list[int]:
    """Host pids whose command line carries `marker` (optionally: only the program's processes,
    not the launcher, whose plan on its command line names the script too)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                uid = (cmdline.parent / "status").read_text().split("Uid:")[1].split()[0]
                if not sandbox_uid_only or int(uid) >= RUN_UID_BASE:
                    pids.append(int(cmdline.parent.name))
        except (OSError, IndexError):
            continue
    return pids


@pytest.fixture(autouse=True)
def host_unharmed(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch):
    survivors: list[str] = []
    execute = sandbox_module._execute

    def checked(*args: object, **kwargs: object) -> SandboxResult:
        # The moment `run` returns, not a single process of that run may be alive: checked
        # for every run of every test (attacks, concurrent runs, probes), then asserted below.
        result = execute(*args, **kwargs)  # type: ignore[arg-type]
        if result.run_uid is not None:
            left = sandbox_module._live_processes_of_uid(result.run_uid)
            if left:
                survivors.append(f"uid {result.run_uid}: pids {left} ({result.status})")
        return result

    monkeypatch.setattr(sandbox_module, "_execute", checked)
    yield
    assert survivors == []
    assert _stray_sandbox_processes() == []
    canary = _run(sandbox, "print('alive')")
    assert canary.status == "ok" and canary.stdout == "alive\n", canary.verdict()


def _in_thread(function: Callable[[], SandboxResult]) -> tuple[threading.Thread, dict]:
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", function()))
    thread.start()
    return thread, box


def _assert_contained(result: SandboxResult, status: str, bound_s: float, *reasons: str) -> None:
    assert result.status == status, (result.status, result.verdict(), result.stdout[-500:])
    assert not result.ok
    assert result.duration_s < bound_s, result.duration_s
    verdict = result.verdict()
    for reason in reasons:
        assert reason in verdict, verdict


# --- network ------------------------------------------------------------------------------

def test_loopback_connection_never_reaches_a_host_listener(sandbox: Sandbox) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    port, udp_port = listener.getsockname()[1], udp.getsockname()[1]
    program = f"""
import socket
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"escaped", ("127.0.0.1", {udp_port}))
except OSError as error:
    print("udp", error)
socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"escaped")
"""
    try:
        result = _run(sandbox, program)
        _assert_contained(result, "error", 2.0, "Network is unreachable")
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
        udp.settimeout(0.05)
        with pytest.raises(socket.timeout):
            udp.recv(100)
    finally:
        listener.close()
        udp.close()


def test_outside_address_is_unreachable_because_only_a_downed_lo_exists(sandbox: Sandbox) -> None:
    # Never send traffic off this machine: connect only after proving there is nothing to send on.
    program = """
import os, socket, sys
interfaces = sorted(os.listdir("/sys/class/net"))
routes = open("/proc/net/route").read().splitlines()[1:]
if interfaces != ["lo"] or routes:
    sys.exit(f"refusing to connect: interfaces {interfaces}, routes {routes}")
print("only lo, no routes")
socket.create_connection(("192.0.2.1", 9), timeout=1)
"""
    result = _run(sandbox, program)
    assert "refusing" not in result.stderr
    assert result.stdout == "only lo, no routes\n"
    _assert_contained(result, "error", 2.0, "Network is unreachable")


def test_abstract_unix_socket_of_the_host_is_unreachable(sandbox: Sandbox) -> None:
    name = f"keel-test-{uuid.uuid4().hex}"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind("\0" + name)
    listener.listen(1)
    program = f"""
import socket
socket.socket(socket.AF_UNIX).connect("\\0{name}")
"""
    try:
        result = _run(sandbox, program)
        _assert_contained(result, "error", 2.0, "ConnectionRefusedError")
        listener.settimeout(0.1)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


# --- secrets and host files -----------------------------------------------------------------

def test_host_secrets_in_the_environment_never_reach_the_program(sandbox: Sandbox,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONPATH", "/keel-secret-pythonpath")
    monkeypatch.setenv("LD_PRELOAD", "/keel-secret-preload.so")
    program = """
import json, os
environs = {}
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            environs[pid] = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
        except OSError as error:
            environs[pid] = error.strerror
os.write(int(os.environ["KEEL_RESULT_FD"]), json.dumps({"env": dict(os.environ), "proc": environs}).encode())
os.environ["OPENAI_API_KEY"]
"""
    result = _run(sandbox, program)
    _assert_contained(result, "error", 2.0, "KeyError: 'OPENAI_API_KEY'")
    seen = json.loads(result.result_data)
    assert set(seen["env"]) <= {*SAFE_ENV, "HOME", "KEEL_RESULT_FD"}
    assert seen["proc"]["1"] == "Permission denied"  # the launcher, root's
    for value in [*SECRETS.values(), "keel-secret-pythonpath", "keel-secret-preload"]:
        assert "keel-secret" in value and value not in result.result_data + result.stdout + result.stderr


KEYRING_READER = """
import ctypes, os
KEYCTL = {"x86_64": 250, "aarch64": 219}[os.uname().machine]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
key = libc.syscall(KEYCTL, 10, ctypes.c_int(-3), b"user", b"keel-test", 0)  # KEYCTL_SEARCH, session
if key < 0:
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
buffer = ctypes.create_string_buffer(100)
length = libc.syscall(KEYCTL, 11, ctypes.c_long(key), buffer, ctypes.c_size_t(100))  # KEYCTL_READ
print(buffer.raw[:length].decode())
"""

KEYRING_HOLDER = """
import ctypes, json, os, subprocess, sys
from keelrl.sandbox import Sandbox
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
assert libc.syscall(KEYCTL, 1, b"keel-test-session") > 0  # KEYCTL_JOIN_SESSION_KEYRING
secret = b"keel-secret-in-a-keyring"
assert libc.syscall(ADD_KEY, b"user", b"keel-test", secret, ctypes.c_size_t(len(secret)), ctypes.c_int(-3)) > 0
reader = sys.argv[1]
own = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True).stdout.strip()
result = Sandbox(require=("namespaces", "uid")).run({"main.py": reader}, ["main.py"])
print(json.dumps({"own": own, "status": result.status, "verdict": result.verdict(), "out": result.stdout,
                  "duration_s": result.duration_s}))
"""


def test_a_secret_in_the_host_session_keyring_is_unreachable() -> None:
    # Whoever holds a session keyring may read its keys, whatever its uid. A helper process
    # joins a keyring of its own holding a secret, shows a child of its own reads it, then
    # runs the same reader in the sandbox.
    done = subprocess.run([sys.executable, "-c", KEYRING_HOLDER, KEYRING_READER], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["own"] == "keel-secret-in-a-keyring"  # an ordinary child of the holder reads it
    assert seen["status"] == "error" and "Required key not available" in seen["verdict"], seen
    assert "keel-secret" not in seen["out"] and seen["duration_s"] < 2.0


def test_root_only_host_files_are_unreadable(sandbox: Sandbox) -> None:
    secret_dir = Path(os.path.expanduser("~")) / f".keel-test-secret-{uuid.uuid4().hex}"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "answer.txt"
    secret.write_text("keel-secret-answer-42")
    secret.chmod(0o600)
    program = f"""
import os
for path in ["/etc/shadow", "{secret_dir}"]:
    try:
        print(path, os.listdir(path) if os.path.isdir(path) else open(path).read())
    except OSError as error:
        print(path, error.strerror)
print(open("{secret}").read())
"""
    try:
        result = _run(sandbox, program)
        _assert_contained(result, "error", 2.0, "Permission denied")
        assert "keel-secret-answer" not in result.stdout + result.stderr + result.result_data
        assert "/etc/shadow Permission denied" in result.stdout
        assert secret.read_text() == "keel-secret-answer-42"
    finally:
        secret.unlink()
        secret_dir.rmdir()


def _host_cwd_outcomes() -> set[str]:
    """How a write to the host's cwd ends inside: refused (read-only), or, when the cwd lies in
    a directory the sandbox replaces with a private tmpfs (CI may run from a clone under /tmp),
    missing or written into that private tmpfs. Either way the host never sees the file, which
    the callers check on the host."""
    private = ("/tmp", "/var/tmp", "/dev/shm", "/run")
    hidden = any(Path.cwd() == Path(p) or Path(p) in Path.cwd().parents for p in private)
    return {"No such file or directory", "written"} if hidden else {"Read-only file system"}


def test_writes_outside_the_work_dir_never_reach_the_host(sandbox: Sandbox) -> None:
    name = f"keel-escape-{uuid.uuid4().hex}"
    host_dirs = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/run", os.getcwd(),
                 os.path.expanduser("~"), "/", "/etc", "/usr/local/lib"]
    program = f"""
import json, os
outcome = {{}}
for folder in {host_dirs[:-1]!r}:
    try:
        with open(os.path.join(folder, "{name}"), "w") as handle:
            handle.write("escaped")
        outcome[folder] = "written"
    except OSError as error:
        outcome[folder] = error.strerror
print(json.dumps(outcome))
open(os.path.join("{host_dirs[-1]}", "{name}"), "w").write("escaped")
"""
    result = _run(sandbox, program)
    _assert_contained(result, "error", 2.0, "Read-only file system")
    outcome = json.loads(result.stdout)
    assert outcome["/tmp"] == outcome["/dev/shm"] == "written"  # the run's own tmpfs: it worked in there
    assert outcome["/etc"] == "Read-only file system"
    assert outcome[os.getcwd()] in _host_cwd_outcomes()
    for folder in host_dirs:
        assert not (Path(folder) / name).exists(), folder


def test_the_work_dir_is_read_only(sandbox: Sandbox) -> None:
    program = """
import json, os
outcome = {}
attempts = {
    "create": lambda: open("new.txt", "w"),
    "append to itself": lambda: open("main.py", "a"),
    "chmod": lambda: os.chmod("main.py", 0o777),
    "remove": lambda: os.remove("tests.py"),
    "rename": lambda: os.rename("tests.py", "gone.py"),
    "mkdir": lambda: os.mkdir("cache"),
    "utime": lambda: os.utime("tests.py", (0, 0)),
}
for name, attempt in attempts.items():
    try:
        attempt()
        outcome[name] = "done"
    except OSError as error:
        outcome[name] = error.strerror
print(json.dumps(outcome))
assert open("tests.py").read() == "assert solve() == 42\\n"
open("tests.py", "w").write("pass\\n")
"""
    result = _run(sandbox, program, files={"tests.py": "assert solve() == 42\n"})
    _assert_contained(result, "error", 2.0, "Read-only file system")
    assert "done" not in json.loads(result.stdout).values()


def test_planted_stdlib_shadows_and_customize_files_are_ignored(sandbox: Sandbox,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    hijack = "import sys\nsys.stdout.write('HIJACKED\\n')\nraise SystemExit(0)\n"
    files = {name: hijack for name in ("json.py", "os.py", "random.py", "sitecustomize.py",
                                       "usercustomize.py", "collections/__init__.py")}
    files["keel.pth"] = "import sys; sys.stdout.write('HIJACKED pth\\n')\n"
    for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONINSPECT", "PYTHONUSERBASE"):
        monkeypatch.setenv(name, "/tmp/work")
    program = """
import collections, json, os, random, sys
print(json.dumps({"json": json.__file__, "os": os.__file__, "random": random.__file__,
                  "collections": collections.__file__, "path": sys.path,
                  "isolated": sys.flags.isolated, "no_site": sys.flags.no_site,
                  "customize": [m for m in ("sitecustomize", "usercustomize") if m in sys.modules]}))
"""
    result = _run(sandbox, program, files=files)
    assert result.status == "ok" and result.duration_s < 2.0, result.verdict()
    assert "HIJACKED" not in result.stdout
    seen = json.loads(result.stdout)
    stdlib = subprocess.run([sandbox.report.interpreter, "-I", "-S", "-c",
                             "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    for module in ("json", "os", "random", "collections"):
        assert seen[module].startswith(stdlib + "/"), seen[module]
    assert "/tmp/work" not in seen["path"] and "" not in seen["path"]
    assert seen["isolated"] == 1 and seen["no_site"] == 1 and seen["customize"] == []


# --- processes ------------------------------------------------------------------------------

def test_fork_bomb_is_capped_and_a_concurrent_run_still_forks(sandbox: Sandbox) -> None:
    marker = f"bomb_{uuid.uuid4().hex}"
    program = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], len(_host_processes_with(marker, sandbox_uid_only=True)))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    thread, box = _in_thread(lambda: sandbox.run({f"{marker}.py": program}, [f"{marker}.py"],
                                                 limits=SandboxLimits(wall_time_s=2, cpu_time_s=2,
                                                                      memory_mb=128, max_processes=16)))
    time.sleep(0.5)
    other = _run(sandbox, "import os\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
                          "        os._exit(0)\n    os.waitpid(pid, 0)\nprint('forked 4')")
    thread.join()
    done.set()
    watcher.join()
    assert other.status == "ok" and other.stdout == "forked 4\n", other.verdict()
    _assert_contained(box["result"], "timeout", 3.5, "wall-clock")
    assert 2 <= peak[0] <= 16
    assert _host_processes_with(marker) == []


def _daemon_program(heartbeat: str) -> str:
    """A program that double-forks a setsid daemon (its argv carries the run's marker) which
    appends to `heartbeat` every 20 ms, then waits 0.3 s so the daemon has written."""
    return f"""
import os, sys, time
beat = "import time\\nwhile True:\\n    open('{heartbeat}', 'a').write('beat\\\\n')\\n    time.sleep(0.02)\\n"
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", beat, sys.argv[1]])
    os._exit(0)
os.wait()
time.sleep(0.3)
"""


def test_daemon_does_not_outlive_the_run(sandbox: Sandbox) -> None:
    marker = f"daemon-{uuid.uuid4().hex}"
    program = _daemon_program("/tmp/heartbeat") + 'print(open("/tmp/heartbeat").read().count("beat"))\n'
    result = _run(sandbox, program, marker)
    assert result.status == "ok", result.verdict()
    assert int(result.stdout) > 0  # the daemon really ran
    assert result.duration_s < 2.0
    assert _host_processes_with(marker) == []


def test_a_daemon_of_a_run_killed_at_the_wall_clock_is_gone_when_run_returns(sandbox: Sandbox) -> None:
    marker = f"daemon-{uuid.uuid4().hex}"
    program = _daemon_program("/tmp/heartbeat") + "time.sleep(60)\n"
    result = _run(sandbox, program, marker, limits=SandboxLimits(wall_time_s=1, cpu_time_s=2))
    _assert_contained(result, "timeout", 3.0, "wall-clock")
    assert _host_processes_with(marker) == []
    assert sandbox_module._live_processes_of_uid(result.run_uid) == []


def test_children_that_ignore_sigterm_are_gone_when_run_returns(sandbox: Sandbox) -> None:
    marker = f"stubborn-{uuid.uuid4().hex}"
    program = """
import os, signal, sys, time
for _ in range(4):
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        os.setsid()
        while True:
            time.sleep(0.01)
print("started", flush=True)
time.sleep(60)
"""
    result = _run(sandbox, program, marker, limits=SandboxLimits(wall_time_s=1, cpu_time_s=2))
    _assert_contained(result, "timeout", 3.0, "wall-clock")
    assert result.stdout == "started\n"
    assert _host_processes_with(marker) == []
    assert sandbox_module._live_processes_of_uid(result.run_uid) == []


ATTACKS = {
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "setsid daemons": _daemon_program("/tmp/heartbeat") + "time.sleep(60)\n",
    "sigterm-proof children": "import os, signal, time\nfor _ in range(6):\n    if os.fork() == 0:\n"
                              "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                              "        while True:\n            pass\ntime.sleep(60)\n",
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_no_process_outlives_an_attack_under_cpu_load_while_other_runs_proceed(sandbox: Sandbox,
                                                                                 attack: str) -> None:
    """Under two CPU hogs (the load that once let fork-bomb children outlive `run`), each
    attack three times beside a stream of ordinary runs: nothing of the attack is alive when
    its `run` returns, and every ordinary run succeeds."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    stop = threading.Event()
    ordinary: list[SandboxResult] = []

    def stream() -> None:
        while not stop.is_set():
            ordinary.append(_run(sandbox, "import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\nprint('ok')"))

    streamer = threading.Thread(target=stream)
    streamer.start()
    try:
        for _ in range(3):
            marker = f"attack-{uuid.uuid4().hex}"
            result = _run(sandbox, ATTACKS[attack], marker,
                          limits=SandboxLimits(wall_time_s=1, cpu_time_s=2, memory_mb=128, max_processes=16))
            assert result.status == "timeout", result.verdict()
            assert sandbox_module._live_processes_of_uid(result.run_uid) == []
            assert _host_processes_with(marker) == []
    finally:
        stop.set()
        streamer.join()
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert ordinary and all(r.status == "ok" and r.stdout == "ok\n" for r in ordinary), \
        [r.verdict() for r in ordinary if not r.ok]


def test_killing_the_parent_init_and_host_pids_harms_no_one(sandbox: Sandbox) -> None:
    sentinel = subprocess.Popen(["sleep", "30"])
    thread, box = _in_thread(lambda: _run(sandbox, "import time\ntime.sleep(1)\nprint('survived')"))
    time.sleep(0.3)
    program = """
import json, os, signal, sys
outcome = {}
for pid in [os.getppid(), 1, -1, *map(int, sys.argv[1:])]:
    try:
        os.kill(pid, signal.SIGKILL)
        outcome[pid] = "sent"
    except OSError as error:
        outcome[pid] = error.strerror
print(json.dumps(outcome))
os.kill(os.getppid(), signal.SIGKILL)
"""
    try:
        result = _run(sandbox, program, str(os.getpid()), str(sentinel.pid), str(os.getppid()))
        thread.join()
        _assert_contained(result, "error", 2.0, "Operation not permitted")
        assert sentinel.poll() is None
        assert box["result"].status == "ok" and box["result"].stdout == "survived\n"
    finally:
        sentinel.kill()
        sentinel.wait()


# --- resources ------------------------------------------------------------------------------

def test_memory_bomb_hits_the_memory_limit(sandbox: Sandbox) -> None:
    program = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))\n"
    _assert_contained(_run(sandbox, program), "memory", 2.0, "memory limit", "MemoryError")


def test_cpu_spin_hits_the_cpu_limit(sandbox: Sandbox) -> None:
    limits = SandboxLimits(wall_time_s=5, cpu_time_s=1)
    _assert_contained(_run(sandbox, "while True:\n    pass\n", limits=limits), "cpu_limit", 3.0,
                      "CPU-time limit")


def test_sleep_forever_hits_the_wall_clock(sandbox: Sandbox) -> None:
    program = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(10**6)\n"
    result = _run(sandbox, program, limits=SandboxLimits(wall_time_s=1))
    _assert_contained(result, "timeout", 2.0, "wall-clock")
    assert result.timed_out and result.exit_code is None and result.duration_s >= 1.0


def test_unread_stdin_cannot_stall_the_wall_clock(sandbox: Sandbox) -> None:
    result = _run(sandbox, "import time\ntime.sleep(10**6)\n", stdin=b"x" * (8 * 2**20),
                  limits=SandboxLimits(wall_time_s=1))
    _assert_contained(result, "timeout", 2.0, "wall-clock")


def test_stdout_flood_is_capped_on_the_host(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: dict[str, int] = {}
    real_tail = sandbox_module._tail

    def measuring_tail(path: Path, chars: int) -> tuple[str, bool]:
        sizes[path.name] = path.stat().st_size
        return real_tail(path, chars)

    monkeypatch.setattr(sandbox_module, "_tail", measuring_tail)
    limits = SandboxLimits(wall_time_s=5, max_file_mb=1, output_tail_chars=1000)
    result = _run(sandbox, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", limits=limits)
    _assert_contained(result, "output_limit", 2.0, "output size limit")
    assert sizes["stdout"] <= 2**20 and sizes["stderr"] < 2**20
    assert result.output_truncated and len(result.stdout) == 1000


def test_huge_file_in_the_work_dir_is_refused(sandbox: Sandbox) -> None:
    program = "with open('big.bin', 'wb') as handle:\n    handle.write(bytes(100 * 2**20))\n"
    _assert_contained(_run(sandbox, program), "error", 2.0, "Read-only file system")


def test_huge_file_in_tmp_is_capped_by_file_size_and_tmpfs(sandbox: Sandbox) -> None:
    program = """
import os
written = 0
try:
    for index in range(1000):
        with open(f"/dev/shm/part{index}", "wb") as handle:
            handle.write(bytes(2**20))
        written += 1
except OSError as error:
    print(written, error.strerror, flush=True)
with open("/tmp/big.bin", "wb") as handle:
    handle.write(bytes(100 * 2**20))
"""
    result = _run(sandbox, program)
    _assert_contained(result, "output_limit", 2.0, "file/output size limit", "File too large")
    written, reason = result.stdout.split(" ", 1)
    assert int(written) <= LIMITS.tmpfs_mb and reason.strip() == "No space left on device"
    assert not Path("/tmp/big.bin").exists() and not Path("/dev/shm/part0").exists()


def test_recursion_bomb_dies_alone(sandbox: Sandbox) -> None:
    c_stack = """
import sys
sys.setrecursionlimit(10**7)
class Deep:
    def __getattr__(self, name):
        return getattr(self, name + "x")
Deep().attribute
"""
    _assert_contained(_run(sandbox, c_stack), "killed", 2.0, "SIGSEGV")
    python_frames = "import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return f(n + 1) + 1\nf(0)\n"
    result = _run(sandbox, python_frames, limits=SandboxLimits(wall_time_s=3, memory_mb=96))
    assert result.status in ("error", "memory") and result.exit_code == 1, result.verdict()
    assert result.duration_s < 3.0 and "Error" in result.verdict()


def test_open_file_exhaustion_stops_at_the_limit(sandbox: Sandbox) -> None:
    program = """
import resource
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (10**6, 10**6))
except (ValueError, OSError) as error:
    print("raise refused:", error)
handles = []
try:
    while True:
        handles.append(open("/dev/null"))
finally:
    print(len(handles), flush=True)
"""
    result = _run(sandbox, program)
    _assert_contained(result, "error", 2.0, "Too many open files")
    refused, count = result.stdout.splitlines()
    assert refused.startswith("raise refused") and int(count) < LIMITS.max_open_files
    with open(os.devnull) as handle:  # and the host still opens files
        assert handle.read() == ""


def test_no_privileges_to_regain(sandbox: Sandbox) -> None:
    program = """
import ctypes, json, os, resource, subprocess
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
outcome = {key: status[key].strip() for key in ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs")}
libc = ctypes.CDLL(None, use_errno=True)
outcome["umount /tmp"] = libc.umount2(b"/tmp", 2) == 0
try:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    outcome["raise AS"] = True
except (ValueError, OSError):
    outcome["raise AS"] = False
mount = subprocess.run(["mount", "-t", "tmpfs", "none", "/mnt"], capture_output=True)
outcome["setuid mount"] = mount.returncode == 0
print(json.dumps(outcome))
os.setuid(0)
"""
    result = _run(sandbox, program)
    _assert_contained(result, "error", 2.0, "Operation not permitted")
    seen = json.loads(result.stdout)
    assert seen["CapEff"] == seen["CapPrm"] == seen["CapBnd"] == "0000000000000000"
    assert seen["NoNewPrivs"] == "1"
    assert not seen["umount /tmp"] and not seen["raise AS"] and not seen["setuid mount"]


def test_sysv_shared_memory_does_not_outlive_the_run(sandbox: Sandbox) -> None:
    key = 0x6B000000 + int(uuid.uuid4().hex[:6], 16)
    program = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget({key}, 2**20, 0o1000 | 0o666)
address = libc.shmat(shmid, None, 0)
ctypes.memset(address, 1, 2**20)
libc.shmdt(ctypes.c_void_p(address))
print(shmid)
"""
    result = _run(sandbox, program)
    assert result.status == "ok" and int(result.stdout) >= 0, result.verdict()  # it made one, in its IPC namespace
    assert result.duration_s < 2.0
    keys = [int(line.split()[0]) for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
    assert key not in keys


# --- runs side by side and one after another -------------------------------------------------

def test_concurrent_runs_do_not_see_each_other(sandbox: Sandbox) -> None:
    program = """
import json, os, sys, time
mine = sys.argv[1]
for folder in ("/tmp", "/dev/shm"):
    open(os.path.join(folder, mine), "w").write(mine)
time.sleep(0.4)
print(json.dumps({"uid": os.getuid(), "tmp": sorted(os.listdir("/tmp")), "shm": os.listdir("/dev/shm"),
                  "work": sorted(os.listdir(".")), "pids": sorted(p for p in os.listdir("/proc") if p.isdigit())}))
"""
    runs = [_in_thread(functools.partial(sandbox.run, {"main.py": program, f"{name}.txt": name},
                                         ["main.py", name]))
            for name in ("left", "right")]
    seen = {}
    for (thread, box), name in zip(runs, ("left", "right")):
        thread.join()
        assert box["result"].status == "ok" and box["result"].duration_s < 2.5, box["result"].verdict()
        seen[name] = json.loads(box["result"].stdout)
    assert seen["left"]["uid"] != seen["right"]["uid"]
    for name in ("left", "right"):
        assert seen[name]["tmp"] == sorted([name, "work"]) and seen[name]["shm"] == [name]
        assert seen[name]["work"] == sorted(["main.py", f"{name}.txt"])
        assert seen[name]["pids"] == ["1", "2"]


def test_a_run_after_a_hostile_run_starts_clean(sandbox: Sandbox) -> None:
    marker = f"sleeper-{uuid.uuid4().hex}"
    hostile = """
import os, subprocess, sys
for folder in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
    open(os.path.join(folder, "stale"), "w").write("left behind")
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", sys.argv[1]], start_new_session=True)
"""
    assert _run(sandbox, hostile, marker).status == "ok"
    assert _host_processes_with(marker) == []
    clean = """
import json, os
print(json.dumps({folder: sorted(os.listdir(folder)) for folder in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")}
                 | {"pids": sorted(p for p in os.listdir("/proc") if p.isdigit())}))
"""
    result = _run(sandbox, clean)
    assert result.status == "ok" and result.duration_s < 2.0, result.verdict()
    assert json.loads(result.stdout) == {"/tmp": ["work"], "/var/tmp": [], "/dev/shm": [], "/run/lock": [],
                                         "pids": ["1", "2"]}


def test_results_and_report_name_the_isolation_in_force(sandbox: Sandbox) -> None:
    result = _run(sandbox, "print('hi')")
    assert result.status == "ok" and result.verdict() == "exited normally"
    assert result.isolation == FULL
    report = isolation_report()
    assert report.mechanisms() == FULL and report.missing == () and sandbox.report.missing == ()


# --- degraded modes: weaker isolation, reported as such, still holding what they claim --------

def _assert_baseline_containment(box: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """What every mode claims: wall clock, rlimits that cannot be raised, a scrubbed environment."""
    slept = _run(box, "import time\ntime.sleep(10**6)\n", limits=SandboxLimits(wall_time_s=1))
    _assert_contained(slept, "timeout", 2.0, "wall-clock")
    spun = _run(box, "while True:\n    pass\n", limits=SandboxLimits(wall_time_s=5, cpu_time_s=1))
    _assert_contained(spun, "cpu_limit", 3.0, "CPU-time limit")
    bomb = """
import resource
try:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
except (ValueError, OSError):
    pass
chunks = []
while True:
    chunks.append(bytearray(16 * 2**20))
"""
    _assert_contained(_run(box, bomb), "memory", 2.0, "MemoryError")
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    scrubbed = _run(box, "import json, os\nprint(json.dumps(dict(os.environ)))\nos.environ['GITHUB_TOKEN']")
    _assert_contained(scrubbed, "error", 2.0, "KeyError: 'GITHUB_TOKEN'")
    assert set(json.loads(scrubbed.stdout.splitlines()[0])) <= {*SAFE_ENV, "HOME", "KEEL_RESULT_FD"}


def test_without_namespaces_uid_rlimits_env_and_wall_still_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    box = Sandbox(LIMITS, use_namespaces=False)
    assert box.report.mechanisms() == ("uid", "rlimits", "env", "wall")
    assert [item.split(":")[0] for item in box.report.missing] == ["namespaces"]
    assert "use_namespaces=False" in box.report.missing[0] and isolation_report().missing == ()
    result = _run(box, "import os\nprint(os.getuid())")
    assert result.status == "ok" and result.isolation == ("uid", "rlimits", "env", "wall")
    assert RUN_UID_BASE <= int(result.stdout) < RUN_UID_BASE + RUN_UID_SPAN
    _assert_baseline_containment(box, monkeypatch)
    forks = """
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        children += 1
finally:
    print(children, flush=True)
"""
    forked = _run(box, forks)
    _assert_contained(forked, "error", 2.0, "Resource temporarily unavailable")
    assert int(forked.stdout) < LIMITS.max_processes
    root_only = _run(box, "print(open('/etc/shadow').read())")
    _assert_contained(root_only, "error", 2.0, "Permission denied")


def test_without_namespaces_a_setsid_daemon_is_still_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    box = Sandbox(LIMITS, use_namespaces=False)
    marker = f"daemon-{uuid.uuid4().hex}"
    heartbeat = Path("/tmp") / f"keel-test-{marker}"  # the host's /tmp: this mode shares it
    program = _daemon_program(str(heartbeat))
    try:
        result = _run(box, program, marker)
        assert result.status == "ok", result.verdict()
        beats = heartbeat.read_text().count("beat")
        assert beats > 0 and _host_processes_with(marker) == []
        time.sleep(0.1)
        assert heartbeat.read_text().count("beat") == beats
    finally:
        heartbeat.unlink(missing_ok=True)


def test_without_uid_drop_namespaces_still_hold_and_root_has_no_capabilities(
        monkeypatch: pytest.MonkeyPatch) -> None:
    box = Sandbox(LIMITS, use_uid_drop=False)
    assert box.report.mechanisms() == ("namespaces", "rlimits", "env", "wall")
    assert [item.split(":")[0] for item in box.report.missing] == ["uid"]
    assert "use_uid_drop=False" in box.report.missing[0]
    _assert_baseline_containment(box, monkeypatch)
    name = f"keel-escape-{uuid.uuid4().hex}"
    program = f"""
import ctypes, json, os, socket
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
libc = ctypes.CDLL(None, use_errno=True)
outcome = {{"uid": os.getuid(), "CapEff": status["CapEff"].strip(), "umount": libc.umount2(b"/tmp", 2),
           "tmp": os.listdir("/tmp"), "dev": sorted(os.listdir("/dev"))}}
for path in ("/root/{name}", "{os.getcwd()}/{name}", "/proc/sys/kernel/core_pattern"):
    try:
        open(path, "a").write("x")
        outcome[path] = "written"
    except OSError as error:
        outcome[path] = error.strerror
print(json.dumps(outcome))
socket.create_connection(("127.0.0.1", 9), timeout=1)
"""
    result = _run(box, program)
    assert result.isolation == ("namespaces", "rlimits", "env", "wall")
    _assert_contained(result, "error", 2.0, "Network is unreachable")
    seen = json.loads(result.stdout)
    assert seen["uid"] == 0 and seen["CapEff"] == "0000000000000000" and seen["umount"] == -1
    assert seen["tmp"] == ["work"]
    assert seen["dev"] == ["fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout",
                           "tty", "urandom", "zero"]  # root, but no host disk, console or kmsg to open
    assert seen[f"/root/{name}"] == seen["/proc/sys/kernel/core_pattern"] == "Read-only file system"
    assert seen[f"{os.getcwd()}/{name}"] in _host_cwd_outcomes()
    assert not (Path("/root") / name).exists() and not (Path.cwd() / name).exists()


def test_with_neither_wall_rlimits_and_env_still_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    box = Sandbox(LIMITS, use_namespaces=False, use_uid_drop=False)
    assert box.report.mechanisms() == ("rlimits", "env", "wall")
    assert sorted(item.split(":")[0] for item in box.report.missing) == ["namespaces", "uid"]
    assert _run(box, "print('plain')").isolation == ("rlimits", "env", "wall")
    _assert_baseline_containment(box, monkeypatch)


def test_the_library_installs_no_signal_handlers() -> None:
    # No signal handlers are installed by the library (STYLE habit 9): the host's stay as they were.
    before = {number: signal.getsignal(number) for number in (signal.SIGCHLD, signal.SIGALRM, signal.SIGTERM)}
    Sandbox(LIMITS).run({"main.py": "print(1)"}, ["main.py"])
    assert {number: signal.getsignal(number) for number in before} == before


HIDDEN_READER = r"""
import json, os, sys
seen = {}
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            seen[path] = sorted(os.listdir(path))
        else:
            with open(path) as handle:
                seen[path] = handle.read(200)
    except OSError as error:
        seen[path] = f"error: {error.strerror}"
print(json.dumps(seen))
"""


def test_keelrl_source_run_dir_and_task_file_are_hidden_from_the_code() -> None:
    # The task generator holds every reference fix; a run directory holds solved transcripts.
    import keelrl

    source = Path(keelrl.__file__).resolve().parent
    generator = source / "envs" / "coding_tasks.py"
    run_dir = source.parent / f".keel-test-run-{uuid.uuid4().hex}"  # beside the package, as runs/ is
    run_dir.mkdir()
    try:
        (run_dir / "answers.jsonl").write_text("the answer is 42\n")
        task_file = run_dir.with_suffix(".jsonl")  # a task file beside the run directory
        task_file.write_text('{"id": "t1"}\n')
        paths = [str(source), str(generator), str(run_dir), str(run_dir / "answers.jsonl"), str(task_file)]
        box = Sandbox(LIMITS, require=("namespaces", "uid"), hidden_paths=[source, run_dir, task_file])
        seen = json.loads(_run(box, HIDDEN_READER, *paths).stdout)
        open_box = Sandbox(LIMITS, require=("namespaces", "uid"), hidden_paths=[])
        opened = json.loads(_run(open_box, HIDDEN_READER, *paths).stdout)
        if not any(Path(d) in source.parents for d in sandbox_module.PRIVATE_DIRS):
            assert set(box.hidden) == {str(source), str(run_dir), str(task_file)}
            assert seen[str(source)] == [] and seen[str(run_dir)] == []  # empty mounts
            assert seen[str(generator)].startswith("error:") and seen[str(run_dir / "answers.jsonl")].startswith("error:")
            assert seen[str(task_file)] == ""
            # Without hiding, the same program reads the generator and the answers.
            assert "envs" in opened[str(source)] and "retry_count" in opened[str(generator)]
            assert opened[str(run_dir / "answers.jsonl")] == "the answer is 42\n"
            assert opened[str(task_file)] == '{"id": "t1"}\n'
        else:  # a checkout under /tmp: the run's private /tmp already shows none of it, nothing is mounted
            assert box.hidden == ()
            assert all(str(value).startswith("error: No such file") for value in [*seen.values(), *opened.values()])
    finally:
        shutil.rmtree(run_dir)
        run_dir.with_suffix(".jsonl").unlink(missing_ok=True)


def test_default_hidden_paths_cover_the_source_tree_but_never_what_the_interpreter_needs() -> None:
    import keelrl

    box = Sandbox(LIMITS, require=("namespaces", "uid"))
    package = Path(keelrl.__file__).resolve().parent
    under_tmp = Path(tempfile.gettempdir()).resolve() in package.parents  # a checkout in /tmp: private there
    assert under_tmp or any(package == Path(h) or Path(h) in package.parents for h in box.hidden), box.hidden
    generator = package / "envs" / "coding_tasks.py"
    seen = json.loads(_run(box, HIDDEN_READER, str(package), str(generator)).stdout)
    assert seen[str(package)] in ([], "error: No such file or directory"), seen
    assert str(seen[str(generator)]).startswith("error:"), seen
    interpreter = box.report.interpreter
    assert sandbox_module.hideable(["/", "/usr", "/usr/lib", "/tmp", "/tmp/x", "/proc/self", os.path.dirname(interpreter),
                                    "/no/such/dir"], interpreter) == []
    # A venv whose python links to the system interpreter: the venv itself (the path the run
    # starts) may not be hidden, nor anything holding it; a sibling may.
    project = Path(os.path.expanduser("~")).resolve() / f".keel-test-venv-{uuid.uuid4().hex}"
    (project / ".venv" / "bin").mkdir(parents=True)
    (project / "runs").mkdir()
    try:
        venv_python = project / ".venv" / "bin" / "python"
        venv_python.symlink_to(os.path.realpath(interpreter))
        assert sandbox_module.hideable([project, project / ".venv", project / "runs"], str(venv_python)) == [
            str(project / "runs")]
        # Hiding what the interpreter needs fails when the sandbox is made, naming the paths.
        with pytest.raises(sandbox_module.SandboxError, match="keeps the sandbox from running"):
            sandbox_module._check_hiding(str(venv_python), (str(project),))
    finally:
        shutil.rmtree(project)
    outside = Path(os.path.expanduser("~")).resolve() / f".keel-test-hide-{uuid.uuid4().hex}"
    (outside / "runs").mkdir(parents=True)
    try:  # deduplicated, nested paths kept (each its own mount)
        assert sandbox_module.hideable([outside, outside, outside / "runs"], interpreter) == [
            str(outside), str(outside / "runs")]
    finally:
        shutil.rmtree(outside)
    assert _run(box, "import json, sys; print(sys.version_info[0])").stdout.strip() == "3"
