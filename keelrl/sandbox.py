"""Run untrusted Python code: a fresh process tree, in a fresh directory, under limits.

Every `Sandbox.run` writes the given files into a new temporary directory, starts a new
process (never a reused one) in its own session, and applies, in this order of strength,
whatever the machine allows:

- ``namespaces`` (root, or unprivileged user namespaces): ``unshare`` puts the run in new
  network, PID and mount namespaces. The network namespace has only a downed loopback, so
  neither 127.0.0.1 on the host nor any outside address is reachable. The PID namespace
  dies with the run: a daemon the code spawns, even one that calls setsid, is killed when
  the run ends. In the mount namespace /tmp, /var/tmp, /dev/shm and /run/lock are fresh
  size-capped tmpfs mounts, so the code cannot leave files where the host or another task
  would see them; its working directory is bind-mounted at /tmp/work.
- ``uid`` (when the launcher is real root): the code runs as an unprivileged user
  (nobody, 65534) with no supplementary groups, so it cannot write the host's files, cannot
  signal the host's processes, and RLIMIT_NPROC is enforced (the kernel ignores it for root).
  The working directory is read-only to it.
- ``rlimits`` (always): CPU seconds, address space, file size (which also caps what stdout
  and stderr can write), process count, open files, no core dumps.
- ``env`` (always): the environment is built from an allowlist, not inherited, so no
  API key, token, secret, proxy or credential path of the host reaches the code.
- ``wall`` (always): a wall-clock timeout kills the whole process group (and namespace).

`SandboxResult.isolation` names the mechanisms that were in force for that run, and
`isolation_report()` says what the machine supports and what is missing.

NOT guaranteed:
- Without namespaces (no root, no user namespaces) there is no network isolation, a daemon
  that calls setsid can outlive the run, and /tmp is shared: the report says so.
- Without the uid drop, RLIMIT_NPROC does not stop a fork bomb run as root; the wall clock
  and the PID namespace still end it.
- This is not a security boundary against kernel exploits; it closes the shortcuts an RL
  policy finds (network, secrets, shared files, stray processes, runaway resources).
- The code sees the read-only host filesystem (system Python and libraries). Tasks must not
  keep answers on disk; git history beyond the base commit is the task builder's job.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from keelrl.errors import ConfigError

_LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
NOBODY = 65534
SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|SESSION|PROXY)",
                         re.IGNORECASE)
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "PYTHONHASHSEED": "0"}
WORK_MOUNT = "/tmp/work"


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run."""

    wall_time_s: float = 10.0
    """Wall-clock limit; the whole process tree is killed when it passes."""
    cpu_time_s: int = 10
    """CPU seconds (RLIMIT_CPU) of each process."""
    memory_mb: int = 512
    """Address space of each process (RLIMIT_AS)."""
    max_processes: int = 32
    """Processes the sandbox user may have (RLIMIT_NPROC; enforced with the uid drop)."""
    max_file_mb: int = 8
    """Largest file any process may write, stdout and stderr included (RLIMIT_FSIZE)."""
    max_open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    tmpfs_mb: int = 16
    """Size of each private tmpfs (/tmp, /var/tmp, /dev/shm) under namespaces."""
    output_tail_chars: int = 4000
    """How much of the end of stdout and stderr the result keeps."""

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes", "max_file_mb",
                     "max_open_files", "tmpfs_mb", "output_tail_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(name, f"must be a positive number, got {value!r}")


@dataclass
class SandboxResult:
    """What happened in one run. `status` says why it ended, in one word."""

    status: str
    """ok | error (non-zero exit) | timeout | cpu_limit | memory | output_limit | killed."""
    exit_code: int | None
    """Exit status, or minus the signal number that killed it."""
    stdout: str
    """Tail of standard output."""
    stderr: str
    """Tail of standard error."""
    timed_out: bool
    memory_exceeded: bool
    duration_s: float
    isolation: tuple[str, ...]
    """Mechanisms in force: namespaces, uid, rlimits, env, wall."""
    result_data: str = ""
    """What the program wrote to its result channel (file descriptor `KEEL_RESULT_FD`)."""
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def verdict(self) -> str:
        """One line saying how the run ended and why, for logs and error observations."""
        reason = {
            "ok": "exited normally",
            "error": f"exited with status {self.exit_code}",
            "timeout": "killed: wall-clock limit reached",
            "cpu_limit": "killed: CPU-time limit reached",
            "memory": "failed: memory limit reached",
            "output_limit": "killed: file/output size limit reached",
            "killed": f"killed by signal {-(self.exit_code or 0)}",
        }.get(self.status, self.status)
        last = self.stderr.strip().splitlines()[-1:] if self.stderr.strip() else []
        return f"{reason}" + (f" ({last[0][:200]})" if last and self.status != "ok" else "")


@dataclass(frozen=True)
class IsolationReport:
    """What this machine lets the sandbox do, probed once per process."""

    namespaces: bool
    uid_drop: bool
    interpreter: str
    missing: tuple[str, ...] = field(default_factory=tuple)

    def mechanisms(self) -> tuple[str, ...]:
        found = ["namespaces"] if self.namespaces else []
        found += ["uid"] if self.uid_drop else []
        return (*found, "rlimits", "env", "wall")

    def describe(self) -> str:
        lines = [f"in force: {', '.join(self.mechanisms())}; interpreter {self.interpreter}"]
        lines += [f"missing: {item}" for item in self.missing]
        return "\n".join(lines)


def _interpreter_for_sandbox() -> str:
    """A Python that an unprivileged user can execute (a venv under a 0700 home may not be)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        if candidate and os.path.exists(candidate) and _world_executable(candidate):
            return candidate
    return sys.executable


def _world_executable(path: str) -> bool:
    real = Path(os.path.realpath(path))
    for part in [real, *real.parents]:
        mode = part.stat().st_mode
        if not mode & 0o001:
            return False
    return True


@functools.lru_cache(maxsize=None)
def isolation_report() -> IsolationReport:
    """Probe, once, which mechanisms work here by running a tiny program through each."""
    interpreter = _interpreter_for_sandbox()
    missing = []
    namespaces = shutil.which("unshare") is not None and _probe(interpreter, namespaces=True, drop=False)
    if not namespaces:
        missing.append("namespaces: 'unshare' unavailable or not permitted (no network, PID or "
                       "/tmp isolation; setsid daemons can outlive a run)")
    drop = os.geteuid() == 0 and _probe(interpreter, namespaces=namespaces, drop=True)
    if not drop:
        missing.append("uid: not running as root, so code runs as this user "
                       "(RLIMIT_NPROC is only enforced per user, the working directory is writable)")
    return IsolationReport(namespaces=namespaces, uid_drop=drop, interpreter=interpreter,
                           missing=tuple(missing))


def _probe(interpreter: str, namespaces: bool, drop: bool) -> bool:
    try:
        result = _execute({"probe.py": "print('ok')\n"}, ["probe.py"], SandboxLimits(wall_time_s=10),
                          interpreter=interpreter, namespaces=namespaces, drop=drop, stdin=None)
    except OSError:
        return False
    return result.status == "ok" and result.stdout.strip() == "ok"


class Sandbox:
    """Runs Python programs under the strongest isolation this machine allows.

    Thread-safe: each run has its own directory and process tree. Use one per process or
    share it; the machine probe is cached.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, require: Sequence[str] = (),
                 use_namespaces: bool = True, use_uid_drop: bool = True) -> None:
        self.limits = limits or SandboxLimits()
        probed = isolation_report()
        report = IsolationReport(namespaces=probed.namespaces and use_namespaces,
                                 uid_drop=probed.uid_drop and use_uid_drop,
                                 interpreter=probed.interpreter, missing=probed.missing)
        absent = [name for name in require if name not in report.mechanisms()]
        if absent:
            raise RuntimeError(f"sandbox isolation {absent} required but not available here:\n"
                               f"{report.describe()}")
        self.report = report

    def run(self, files: Mapping[str, str | bytes], argv: Sequence[str], *,
            stdin: bytes | None = None, limits: SandboxLimits | None = None) -> SandboxResult:
        """Write `files` into a fresh directory and run `python <argv...>` there.

        `argv[0]` is the script, relative to the directory. The program may write a result
        string to the file descriptor named by the environment variable KEEL_RESULT_FD;
        it comes back as `result_data`, separate from stdout.
        """
        return _execute(files, argv, limits or self.limits, interpreter=self.report.interpreter,
                        namespaces=self.report.namespaces, drop=self.report.uid_drop, stdin=stdin)


def _write_files(root: Path, files: Mapping[str, str | bytes]) -> None:
    for name, content in files.items():
        relative = Path(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise ValueError(f"sandbox file name {name!r} must be a relative path inside the directory")
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        for parent in [target.parent, *target.parent.relative_to(root).parents]:
            (root / parent).chmod(0o755)
        if isinstance(content, str):
            target.write_text(content)
        else:
            target.write_bytes(content)
        target.chmod(0o644)


def _tail(path: Path, chars: int) -> tuple[str, bool]:
    size = path.stat().st_size
    with path.open("rb") as handle:
        handle.seek(max(0, size - 4 * chars))
        data = handle.read().decode("utf-8", errors="replace")
    return data[-chars:], size > len(data[-chars:].encode("utf-8", errors="replace"))


def _execute(files: Mapping[str, str | bytes], argv: Sequence[str], limits: SandboxLimits, *,
             interpreter: str, namespaces: bool, drop: bool, stdin: bytes | None) -> SandboxResult:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="keel-sbx-") as tmp:
        base = Path(tmp)
        base.chmod(0o711)  # the sandbox user may pass through, not list
        work = base / "work"
        work.mkdir()
        work.chmod(0o755)
        _write_files(work, files)
        out_path, err_path = base / "stdout", base / "stderr"
        result_path, status_path = base / "result", base / "status"
        with out_path.open("wb") as out, err_path.open("wb") as err, \
                result_path.open("wb") as res, status_path.open("wb") as stat:
            result_path.chmod(0o622)
            plan = {
                "workdir": str(work), "namespaces": namespaces, "drop_uid": NOBODY if drop else None,
                "interpreter": interpreter, "argv": list(argv), "mount_point": WORK_MOUNT,
                "env": dict(SAFE_ENV, HOME=WORK_MOUNT if namespaces else str(work)),
                "tmpfs_mb": limits.tmpfs_mb, "status_fd": stat.fileno(),
                "rlimits": {"CPU": limits.cpu_time_s, "AS": limits.memory_mb * 2**20,
                            "FSIZE": limits.max_file_mb * 2**20, "NPROC": limits.max_processes,
                            "NOFILE": limits.max_open_files, "CORE": 0},
            }
            command = [sys.executable, "-I", "-S", str(_LAUNCHER), json.dumps(plan)]
            if namespaces:
                userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
                command = ["unshare", *userns, "--net", "--pid", "--fork", "--kill-child", "--mount",
                           "--propagation", "private", *command]
            proc = subprocess.Popen(
                command, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=out, stderr=err, pass_fds=(res.fileno(), stat.fileno()), start_new_session=True,
                env={"KEEL_RESULT_FD": str(res.fileno()), "PATH": SAFE_ENV["PATH"]}, close_fds=True)
            timed_out = False
            try:
                if stdin is not None:
                    try:
                        assert proc.stdin is not None
                        proc.stdin.write(stdin)
                        proc.stdin.close()
                    except OSError:
                        pass
                proc.wait(timeout=limits.wall_time_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_tree(proc)
        duration = time.monotonic() - started
        stdout, out_cut = _tail(out_path, limits.output_tail_chars)
        stderr, err_cut = _tail(err_path, limits.output_tail_chars)
        result_data = result_path.read_bytes()[: 4 * 2**20].decode("utf-8", errors="replace")
        output_full = max(out_path.stat().st_size, err_path.stat().st_size) >= limits.max_file_mb * 2**20
        code = _child_exit_code(status_path.read_bytes(), proc.returncode)
    isolation = IsolationReport(namespaces, drop, interpreter).mechanisms()
    status = _status(code, timed_out, stderr, output_full)
    return SandboxResult(status=status, exit_code=None if timed_out else code, stdout=stdout, stderr=stderr,
                         timed_out=timed_out, memory_exceeded=status == "memory", duration_s=duration,
                         isolation=isolation, result_data=result_data, output_truncated=out_cut or err_cut)


def _child_exit_code(status_record: bytes, launcher_code: int | None) -> int | None:
    """The program's exit code (or minus its signal) from the launcher's wait-status record."""
    try:
        status = int(json.loads(status_record)["status"])
    except (ValueError, KeyError, TypeError):
        return launcher_code if launcher_code is None or launcher_code < 0 else -signal.SIGKILL
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill the run's whole session (and, with namespaces, its PID namespace with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - the kernel did not reap it in time
        pass


def _status(code: int | None, timed_out: bool, stderr: str, output_full: bool) -> str:
    if timed_out:
        return "timeout"
    if code == 0:
        return "ok"
    if code is not None and code < 0:
        number = -code
        if number == signal.SIGXCPU:
            return "cpu_limit"
        if number == signal.SIGXFSZ or output_full:
            return "output_limit"
        if number == signal.SIGKILL and "MemoryError" in stderr:
            return "memory"
        return "killed"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    if output_full:
        return "output_limit"
    return "error"
