"""Run untrusted Python code: a fresh process tree, in a fresh directory, under limits.

Every `Sandbox.run` writes the given files into a new temporary directory, starts a new
process (never a reused one) in its own session, and applies, in this order of strength,
whatever the machine allows:

- ``namespaces`` (root, or unprivileged user namespaces): ``unshare`` puts the run in new
  network, PID, IPC, UTS and mount namespaces. The network namespace has only a downed
  loopback, so neither 127.0.0.1 on the host nor any outside address is reachable. The PID
  namespace dies with the run: a daemon the code spawns, even one that calls setsid, is
  killed when the run ends; the run has its own /proc, so it sees no host process. The IPC
  namespace takes any SysV shared memory or message queue the code leaves with it. In the
  mount namespace /tmp, /var/tmp, /dev/shm and /run are fresh size-capped tmpfs mounts, so
  the code cannot leave files where the host or another run would see them (nor reach the
  host's unix sockets under /run); /sys is the run's own (only ``lo`` in /sys/class/net);
  /dev holds only null, zero, full, random, urandom, tty and a private pts (no host disk or
  console); every other mount, the working directory included (bind-mounted at /tmp/work),
  is read-only. The hidden paths (`hidden_paths`: by default keelrl's own source tree, which
  holds the task generator and its reference fixes, and the directory the host was started
  in; the trainer adds its run directory and task file) are covered by empty mounts.
- ``uid`` (when the launcher is real root): the code runs as an unprivileged uid picked at
  random for this run (from 2**30 up, with no account; gid the same, no supplementary
  groups), so it cannot read root's files, cannot signal the host's processes or another
  run's, and RLIMIT_NPROC is enforced per run (the kernel ignores it for root, and counts it
  per uid, so a shared uid would let one run's fork bomb starve another). Without
  namespaces, every process left with that uid is killed when the run ends, and the working
  directory is still read-only to it (root owns it).
- ``rlimits`` (always): CPU seconds, address space, file size (which also caps what stdout
  and stderr can write), process count, open files, no core dumps. The code also runs with
  an empty capability bounding set and no_new_privs, so it cannot raise these limits, undo
  the mounts, or gain privileges through a setuid binary, even when it runs as root.
- ``env`` (always): the environment is built from an allowlist, not inherited, so no
  API key, token, secret, proxy or credential path of the host reaches the code; nor do
  the keys in the host's session keyring (the code gets a fresh, empty one).
  The interpreter runs with -I -S: PYTHON* variables, the script's directory (a ``json.py``
  next to it), sitecustomize and usercustomize are all ignored.
- ``wall`` (always): a wall-clock timeout kills the whole process group (and namespace).

`Sandbox.run` returns only once every process the run started is gone: under namespaces it
waits (by a pidfd) for the PID namespace's init, which the kernel lets exit only after every
process in the namespace has been killed and reaped; without namespaces but with the uid drop
it kills the run's uid until no live process of it remains. Survivors past
`CONTAINMENT_WAIT_S` raise `SandboxError`, never a silent return.

`SandboxResult.isolation` names the mechanisms that were in force for that run, and
`isolation_report()` says what the machine supports and what is missing. A failure of the
sandbox itself (it could not start the program) raises `SandboxError`; it is never reported
as the program's failure.

NOT guaranteed:
- Without namespaces (no root, no user namespaces) there is no network isolation, the code
  sees the host's processes, devices and /tmp (and can write there), and without the uid
  drop a daemon that calls setsid can outlive the run: the report says so.
- Without the uid drop the code runs as the launching user: it can read that user's files
  (root's, when root), and without namespaces also write them and signal that user's
  processes. RLIMIT_NPROC does not stop a fork bomb run as root (the wall clock and the PID
  namespace still end it); for another user without namespaces it counts all of that
  user's processes, not just the run's.
- Memory is limited per process (RLIMIT_AS); the run as a whole may use up to
  ``max_processes * memory_mb`` plus its tmpfs mounts. There is no cgroup.
- Pathname unix sockets outside /tmp, /var/tmp, /dev/shm and /run stay reachable (for
  reading and connecting) where their permissions allow.
- This is not a security boundary against kernel exploits; it closes the shortcuts an RL
  policy finds (network, secrets, shared files, stray processes, runaway resources).
- The code sees the read-only host filesystem (system Python and libraries) apart from the
  hidden paths. Answers kept on disk elsewhere stay readable: name them in `hidden_paths`.
  That includes other copies of the source (pip or uv caches, a wheel, a git worktree whose
  objects live in another checkout, another mount of the same filesystem). Without namespaces
  nothing is hidden (the report says so). A path that is or holds a system directory
  (`SYSTEM_DIRS`), the interpreter or its standard library is not hidden (it would break the
  run), nor one inside the run's private mounts (already the run's own); `Sandbox.hidden`
  lists what is. Git history beyond the base commit is the task builder's job.
- The script's directory is not on ``sys.path`` (that is what keeps a planted ``json.py``
  out); a grader that imports a sibling module must add the directory itself.
"""

from __future__ import annotations

import functools
import marshal
import os
import re
import secrets
import select
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
RUN_UID_BASE = 1 << 30
"""Runs get a uid (and gid) in [RUN_UID_BASE, RUN_UID_BASE + RUN_UID_SPAN), picked at random."""
RUN_UID_SPAN = 1 << 29
SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|SESSION|PROXY)",
                         re.IGNORECASE)
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "PYTHONHASHSEED": "0",
            "USER": "sandbox", "LOGNAME": "sandbox"}
WORK_MOUNT = "/tmp/work"
_NO_NAMESPACES = ("no network, PID, IPC or /tmp isolation: the code can reach the network and "
                  "the host's loopback, sees the host's processes and /tmp, and can read keelrl's "
                  "source tree (the task generator) and the run directory")
SYSTEM_DIRS = ("/", "/usr", "/usr/local", "/lib", "/lib64", "/bin", "/sbin", "/etc", "/var", "/home", "/root")
"""Never hidden themselves (nor any directory holding one): too much lives there."""
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/proc", "/sys", "/dev")
"""Replaced by the run's own mounts under namespaces: nothing inside them needs hiding."""


def default_hidden_paths() -> list[Path]:
    """keelrl's source tree (its checkout when installed editable) and the current directory."""
    package = Path(__file__).resolve().parent
    root = package.parent if (package.parent / "pyproject.toml").is_file() else package
    return [root, Path.cwd().resolve()]


def _interpreter_paths(interpreter: str) -> list[Path]:
    """Every path the sandbox's interpreter is reached through (each symlink hop, the real file)
    and its standard library: a mount over any of them, or over a directory holding one, would
    keep the program from starting."""
    paths, hop = [], Path(os.path.abspath(interpreter))
    for _ in range(40):
        paths.append(hop)
        if not hop.is_symlink():
            break
        hop = Path(os.path.abspath(hop.parent / os.readlink(hop)))
    real = Path(os.path.realpath(interpreter))
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    stdlib = [real.parent.parent / "lib" / version, Path(sys.base_prefix) / "lib" / version]
    return [*paths, real, *stdlib]


def hideable(paths: Sequence[str | Path], interpreter: str) -> list[str]:
    """The paths that can be covered without breaking the run, deduplicated: not a system
    directory (`SYSTEM_DIRS`) or anything holding one, nothing holding the interpreter or its
    standard library, and nothing inside the run's private mounts (`PRIVATE_DIRS`, already
    the run's own)."""
    needed = {Path(os.path.realpath(d)) for d in SYSTEM_DIRS} | {Path(d) for d in SYSTEM_DIRS}
    needed |= {Path(WORK_MOUNT), *_interpreter_paths(interpreter)}
    private = {Path(d) for d in PRIVATE_DIRS}
    chosen: list[str] = []
    for raw in paths:
        path = Path(os.path.realpath(raw))
        if (not path.exists() or any(path == k or path in k.parents for k in needed)
                or any(path == p or p in path.parents for p in private)):
            continue
        if str(path) not in chosen:
            chosen.append(str(path))
    return chosen
_NO_UID = ("the code runs as this user: it can read this user's files (and without namespaces "
           "write them and signal its processes); RLIMIT_NPROC is not enforced for root, and "
           "without namespaces it counts all of this user's processes")


class SandboxError(RuntimeError):
    """The sandbox itself failed (it could not start the program); not a verdict on the code."""


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
    """Processes the run may have (RLIMIT_NPROC; enforced with the uid drop or a user namespace)."""
    max_file_mb: int = 8
    """Largest file any process may write, stdout and stderr included (RLIMIT_FSIZE)."""
    max_open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    tmpfs_mb: int = 16
    """Size of each private tmpfs (/tmp, /var/tmp, /dev/shm, /run) under namespaces."""
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
    run_uid: int | None = None
    """The uid the program ran as (with the uid drop); no live process has it once `run` returns."""

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
            "output_limit": "failed: file/output size limit reached",
            "killed": f"killed by signal {_signal_name(-(self.exit_code or 0))}",
        }.get(self.status, self.status)
        last = self.stderr.strip().splitlines()[-1:] if self.stderr.strip() else []
        return f"{reason}" + (f" ({last[0][:200]})" if last and self.status != "ok" else "")


def _signal_name(number: int) -> str:
    try:
        return f"{number} ({signal.Signals(number).name})"
    except ValueError:
        return str(number)


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
    namespaces, why = (False, "'unshare' not found") if shutil.which("unshare") is None else \
        _probe(interpreter, namespaces=True, drop=False)
    if not namespaces:
        missing.append(f"namespaces: not permitted here ({why}); {_NO_NAMESPACES}, and a setsid "
                       "daemon can outlive a run unless the uid drop is in force")
    drop, why = (False, "not running as root") if os.geteuid() != 0 else \
        _probe(interpreter, namespaces=namespaces, drop=True)
    if not drop:
        missing.append(f"uid: {why}; {_NO_UID}")
    return IsolationReport(namespaces=namespaces, uid_drop=drop, interpreter=interpreter,
                           missing=tuple(missing))


def _probe(interpreter: str, namespaces: bool, drop: bool) -> tuple[bool, str]:
    try:
        result = _execute({"probe.py": "print('ok')\n"}, ["probe.py"], SandboxLimits(wall_time_s=10),
                          interpreter=interpreter, namespaces=namespaces, drop=drop, stdin=None)
    except (OSError, SandboxError) as error:
        return False, str(error).strip().splitlines()[-1][:300] if str(error).strip() else repr(error)
    if result.status == "ok" and result.stdout.strip() == "ok":
        return True, ""
    return False, f"probe {result.verdict()}"


@functools.lru_cache(maxsize=64)
def _check_hiding(interpreter: str, hidden: tuple[str, ...]) -> None:
    """Run a tiny program once with these paths hidden; fail here, naming them, if it cannot start."""
    try:
        result = _execute({"probe.py": "print('ok')\n"}, ["probe.py"], SandboxLimits(wall_time_s=10),
                          interpreter=interpreter, namespaces=True, drop=False, stdin=None, hide=hidden)
    except SandboxError as error:
        raise SandboxError(f"hiding {', '.join(hidden)} keeps the sandbox from running "
                           f"{interpreter}: {error}; pass hidden_paths without them") from error
    if not (result.ok and result.stdout.strip() == "ok"):
        raise SandboxError(f"hiding {', '.join(hidden)} keeps the sandbox from running {interpreter}: "
                           f"{result.verdict()}; pass hidden_paths without them")


class Sandbox:
    """Runs Python programs under the strongest isolation this machine allows.

    Thread-safe: each run has its own directory, process tree and uid. Use one per process
    or share it; the machine probe is cached.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, require: Sequence[str] = (),
                 use_namespaces: bool = True, use_uid_drop: bool = True,
                 hidden_paths: Sequence[str | Path] | None = None) -> None:
        self.limits = limits or SandboxLimits()
        probed = isolation_report()
        missing = list(probed.missing)
        if probed.namespaces and not use_namespaces:
            missing.append(f"namespaces: turned off (use_namespaces=False); {_NO_NAMESPACES}")
        if probed.uid_drop and not use_uid_drop:
            missing.append(f"uid: turned off (use_uid_drop=False); {_NO_UID}")
        report = IsolationReport(namespaces=probed.namespaces and use_namespaces,
                                 uid_drop=probed.uid_drop and use_uid_drop,
                                 interpreter=probed.interpreter, missing=tuple(missing))
        absent = [name for name in require if name not in report.mechanisms()]
        if absent:
            raise RuntimeError(f"sandbox isolation {absent} required but not available here:\n"
                               f"{report.describe()}")
        self.report = report
        wanted = default_hidden_paths() if hidden_paths is None else list(hidden_paths)
        self.hidden: tuple[str, ...] = tuple(hideable(wanted, report.interpreter)) if report.namespaces else ()
        """Host paths the code sees as empty (only with namespaces)."""
        if self.hidden:
            _check_hiding(report.interpreter, self.hidden)

    def run(self, files: Mapping[str, str | bytes], argv: Sequence[str], *,
            stdin: bytes | None = None, limits: SandboxLimits | None = None) -> SandboxResult:
        """Write `files` into a fresh directory and run `python <argv...>` there.

        `argv[0]` is the script, relative to the directory, which the program sees read-only.
        The program may write a result string to the file descriptor named by the environment
        variable KEEL_RESULT_FD; it comes back as `result_data`, separate from stdout.
        Raises `SandboxError` if the sandbox itself could not start the program.
        """
        return _execute(files, argv, limits or self.limits, interpreter=self.report.interpreter,
                        namespaces=self.report.namespaces, drop=self.report.uid_drop, stdin=stdin,
                        hide=self.hidden)


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


def _private_file(path: Path, content: bytes = b"") -> int:
    """A new file only root (the host side) may open; the run gets the descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    if content:
        os.write(fd, content)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _tail(path: Path, chars: int) -> tuple[str, bool]:
    size = path.stat().st_size
    with path.open("rb") as handle:
        handle.seek(max(0, size - 4 * chars))
        data = handle.read().decode("utf-8", errors="replace")
    return data[-chars:], size > len(data[-chars:].encode("utf-8", errors="replace"))


def _execute(files: Mapping[str, str | bytes], argv: Sequence[str], limits: SandboxLimits, *,
             interpreter: str, namespaces: bool, drop: bool, stdin: bytes | None,
             hide: Sequence[str] = ()) -> SandboxResult:
    started = time.monotonic()
    run_uid = RUN_UID_BASE + secrets.randbelow(RUN_UID_SPAN) if drop else None
    with tempfile.TemporaryDirectory(prefix="keel-sbx-") as tmp:
        base = Path(tmp)
        base.chmod(0o700)
        work = base / "work"
        work.mkdir()
        work.chmod(0o755)
        _write_files(work, files)
        if run_uid is not None and not namespaces:
            # The program reaches its directory through the host's /tmp: only its own gid may
            # pass through, so another run (another uid) cannot read this one's files.
            os.chown(base, 0, run_uid)
            base.chmod(0o710)
        out_path, err_path = base / "stdout", base / "stderr"
        result_path, status_path = base / "result", base / "status"
        fds = [_private_file(path) for path in (out_path, err_path, result_path, status_path)]
        out, err, res, stat = fds
        if stdin is not None:  # a file, not a pipe: a program that never reads cannot block us
            fds.append(_private_file(base / "stdin", stdin))
        try:
            plan = {
                "workdir": str(work), "namespaces": namespaces, "drop_uid": run_uid,
                "interpreter": interpreter, "argv": list(argv), "mount_point": WORK_MOUNT,
                "env": dict(SAFE_ENV, HOME=WORK_MOUNT if namespaces else str(work)),
                "tmpfs_mb": limits.tmpfs_mb, "hide": list(hide), "status_fd": stat, "wall_time_s": limits.wall_time_s,
                "rlimits": {"CPU": limits.cpu_time_s, "AS": limits.memory_mb * 2**20,
                            "FSIZE": limits.max_file_mb * 2**20, "NPROC": limits.max_processes,
                            "NOFILE": limits.max_open_files, "CORE": 0},
            }
            command = [sys.executable, "-I", "-S", str(_LAUNCHER), marshal.dumps(plan).hex()]
            if namespaces:
                userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
                command = ["unshare", *userns, "--net", "--pid", "--ipc", "--uts", "--fork",
                           "--kill-child", "--mount", "--propagation", "private", *command]
            proc = subprocess.Popen(
                command, stdin=fds[4] if stdin is not None else subprocess.DEVNULL,
                stdout=out, stderr=err, pass_fds=(res, stat), start_new_session=True,
                env={"KEEL_RESULT_FD": str(res), "PATH": SAFE_ENV["PATH"]}, close_fds=True)
            timed_out = not _wait_for_exit(proc, limits.wall_time_s)
            # Still running: hold the namespace's init (the launcher) by a pidfd before the kill,
            # so that we can wait for it; it exits only once every process of the namespace is
            # gone. (If unshare exited by itself, its init and namespace were already gone.)
            inits = _namespace_inits(proc) if namespaces and timed_out else []
            _kill_tree(proc)
            _wait_until_gone(inits, run_uid if not namespaces else None, interpreter)
        finally:
            for fd in fds:
                os.close(fd)
        duration = time.monotonic() - started
        stdout, out_cut = _tail(out_path, limits.output_tail_chars)
        stderr, err_cut = _tail(err_path, limits.output_tail_chars)
        result_data = result_path.read_bytes()[: 4 * 2**20].decode("utf-8", errors="replace")
        output_full = max(out_path.stat().st_size, err_path.stat().st_size) >= limits.max_file_mb * 2**20
        code = _child_exit_code(status_path.read_bytes(), proc.returncode, timed_out, stderr)
    isolation = IsolationReport(namespaces, drop, interpreter).mechanisms()
    status = _status(code, timed_out, stderr, output_full)
    return SandboxResult(status=status, exit_code=None if timed_out else code, stdout=stdout, stderr=stderr,
                         timed_out=timed_out, memory_exceeded=status == "memory", duration_s=duration,
                         isolation=isolation, result_data=result_data, output_truncated=out_cut or err_cut,
                         run_uid=run_uid)


def _wait_for_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the launcher to exit, WITHOUT reaping it.

    While it is an unreaped zombie its pid (the run's process-group id) cannot be reused,
    so `_kill_tree` can never signal an unrelated process group that got the same number.
    """
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # pragma: no cover - Linux < 5.3
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                if poller.poll(max(1, int(left * 1000))):
                    return True
            except InterruptedError:  # pragma: no cover - retried by Python on EINTR anyway
                continue
    finally:
        os.close(pidfd)


def _child_exit_code(status_record: bytes, launcher_code: int | None, timed_out: bool,
                     stderr: str) -> int | None:
    """The program's exit code (or minus its signal) from the launcher's record."""
    try:
        record = marshal.loads(status_record) if status_record else {}
    except (EOFError, ValueError, TypeError):
        record = {}
    if not isinstance(record, dict):
        record = {}
    if "setup_error" in record:
        raise SandboxError(f"the sandbox could not start the program: {record['setup_error']}")
    if "status" in record:
        status = int(record["status"])
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    if timed_out or (launcher_code is not None and launcher_code < 0):
        return -signal.SIGKILL  # killed with the whole tree (only the weakest mode lets code do it)
    raise SandboxError(f"the sandbox launcher exited with status {launcher_code} before the program "
                       f"ended: {stderr.strip()[-500:]}")


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


CONTAINMENT_WAIT_S = 10.0
"""How long `Sandbox.run` waits, after the kill, for the run's last process to be gone."""


def _namespace_inits(proc: subprocess.Popen) -> list[int]:
    """pidfds of unshare's children: the init of the run's PID namespace (the launcher).

    The child may exit and be reaped by unshare between reading the list and opening the
    pidfd, and its pid be reused: a pidfd is kept only if, once open, its process still has
    unshare as its parent (a pidfd pins its process, so the check cannot go stale).
    """
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:  # pragma: no cover - kernels without CONFIG_PROC_CHILDREN
        children = [line.split()[0] for line in _proc_status_lines("PPid") if line.split()[1] == str(proc.pid)]
    fds = []
    for child in children:
        try:
            fd = os.pidfd_open(int(child))
        except (AttributeError, OSError):
            continue  # already exited and reaped by unshare: its namespace is gone with it
        try:
            parent = Path(f"/proc/{child}/status").read_text().split("PPid:")[1].split()[0]
        except (OSError, IndexError):
            parent = ""
        if parent == str(proc.pid):
            fds.append(fd)
        else:  # exited, reaped and its pid taken by an unrelated process
            os.close(fd)
    return fds


def _proc_status_lines(key: str) -> list[str]:
    """'<pid> <value>' for every process's /proc/<pid>/status line `key`."""
    lines = []
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/status", "rb") as handle:
                    text = handle.read().decode(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith(f"{key}:"):
                    lines.append(f"{entry.name} {line.split(':', 1)[1].strip()}")
                    break
    return lines


def _live_processes_of_uid(uid: int) -> list[int]:
    """Host pids whose real uid is `uid` and that are not zombies (a zombie holds nothing)."""
    pids = []
    for line in _proc_status_lines("Uid"):
        pid, real_uid = line.split()[:2]
        if int(real_uid) != uid:
            continue
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            pids.append(int(pid))
    return pids


def _wait_until_gone(inits: list[int], uid: int | None, interpreter: str) -> None:
    """Return once the run's every process is gone, or raise `SandboxError` naming survivors.

    Under namespaces: the PID namespace's init exits only after the kernel has killed and
    reaped every process in the namespace (setsid daemons and fork bombs too), so its pidfd
    turning readable means the run is empty. Without namespaces but with the uid drop: every
    process of the run's uid is killed again and again until none is left alive.
    """
    deadline = time.monotonic() + CONTAINMENT_WAIT_S
    try:
        for fd in inits:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(max(1, int(left * 1000))):
                raise SandboxError(f"the run's PID namespace was still alive {CONTAINMENT_WAIT_S:.0f} s "
                                   "after it was killed")
    finally:
        for fd in inits:
            os.close(fd)
    if uid is None:
        return
    while True:
        _kill_uid(uid, interpreter)
        survivors = _live_processes_of_uid(uid)
        if not survivors:
            return
        if time.monotonic() > deadline:
            raise SandboxError(f"processes {survivors} of the run's uid {uid} were still alive "
                               f"{CONTAINMENT_WAIT_S:.0f} s after the run was killed")
        time.sleep(0.002)


def _kill_uid(uid: int, interpreter: str) -> None:
    """Kill every process of the run's uid: without a PID namespace, setsid daemons remain.

    kill(-1) as that uid reaches exactly the processes it may signal, which is its own (and
    no other process has this uid); the kernel does it under one lock, so a process forking
    at the same moment cannot slip a new child past it. It fails (ESRCH) when none is left.
    """
    kill = shutil.which("kill", path=SAFE_ENV["PATH"])
    command = [kill, "-KILL", "--", "-1"] if kill else \
        [interpreter, "-I", "-S", "-c", "import os\ntry:\n    os.kill(-1, 9)\nexcept ProcessLookupError:\n    pass"]
    subprocess.run(command, user=uid, group=uid, extra_groups=[], env={}, cwd="/", stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, check=False)


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
    # Python ignores SIGXFSZ, so a Python program meets RLIMIT_FSIZE as EFBIG, not as a signal.
    if output_full or "File too large" in stderr:
        return "output_limit"
    return "error"
