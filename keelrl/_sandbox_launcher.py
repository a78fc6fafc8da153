"""The sandbox's first process: set up the run, start the program, report how it ended.

Started by `keelrl.sandbox` (inside new namespaces when available) with one argument, the
plan (a dict, marshalled, in hex). It stays alive as the parent (PID 1 of the namespace)
while the program runs as its child, so signals and limits hit the program as an ordinary
process, and when the program exits this process exits, taking the namespace and any
daemon left in it along.
It writes one marshalled dict to the file descriptor `plan["status_fd"]`, which the program
never sees: ``{"status": <wait status>}``, or ``{"setup_error": "..."}`` when the program
could not be started (a sandbox failure, not the program's).

Inside the mount namespace it replaces /tmp, /var/tmp, /dev/shm and /run with small private
tmpfs mounts, mounts a /proc of the run's own PID namespace and a /sys of its own network
namespace (so neither host processes nor host network interfaces are visible), replaces /dev
by a few harmless devices, shows the working directory read-only at `plan["mount_point"]`,
covers each path of `plan["hide"]` (keelrl's source tree, the run directory, task files) with
an empty read-only tmpfs (a file: with /dev/null), and makes every other mount read-only.
The program then runs with an empty capability bounding set and no_new_privs, so even
without the uid drop it cannot undo any of this, raise its limits or gain privileges
through a setuid binary.

Standard library only: it runs with -I -S before anything else. It runs once per grading,
so its start-up is part of every grading's cost: it imports neither json nor signal (with
re and enum behind them, 8 ms of a 40 ms run) but marshal and the C module _signal.
"""

import _signal as signal  # the C module: `signal` would import enum
import ctypes
import marshal
import os
import resource
import select
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
# statvfs reports these with the same bits as the mount flags. A remount must keep them: in a
# user namespace the kernel refuses to clear a locked flag. (Atime flags it keeps by itself.)
KEPT_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
EINVAL, EPERM = 22, 1
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
KEYCTL_JOIN_SESSION_KEYRING = 1
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "i686": 288, "armv7l": 311}
WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.syscall.restype = ctypes.c_long


def _mount(source: str, target: str, fstype: str, flags: int, data: str = "") -> None:
    if _libc.mount(os.fsencode(source), os.fsencode(target), fstype.encode(), flags, data.encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {fstype or source} on {target} (flags {flags:#x}): {os.strerror(errno)}")


def _remount_read_only(target: str) -> None:
    """Make one mount read-only in this namespace only: MS_BIND makes it a per-mount flag.

    Without MS_BIND a remount would change the filesystem itself, for the host as well.
    """
    kept = os.statvfs(target).f_flag & KEPT_FLAGS
    _mount("none", target, "", MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept)


def _mount_points() -> list:
    points = []
    with open("/proc/self/mountinfo", "rb") as handle:
        for line in handle:
            field = line.split()[4]  # octal escapes (\040) for space, tab, newline, backslash
            parts = field.split(b"\\")
            decoded = parts[0] + b"".join(bytes([int(part[:3], 8)]) + part[3:] for part in parts[1:])
            points.append(os.fsdecode(decoded))
    return points


def _minimal_dev() -> None:
    """Replace /dev by a tmpfs holding only the harmless devices (as bubblewrap's --dev does).

    Without the uid drop the code is root, and root without capabilities may still open a
    root-owned device node by its permission bits: the host's disks, consoles, /dev/kmsg.
    """
    devices = {name: os.open(f"/dev/{name}", os.O_PATH | os.O_CLOEXEC)
               for name in DEVICES if os.path.exists(f"/dev/{name}")}
    _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name, fd in devices.items():
        os.close(os.open(f"/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
        _mount(f"/proc/self/fd/{fd}", f"/dev/{name}", "", MS_BIND)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm")
    os.mkdir("/dev/pts")
    try:  # a private devpts, for programs that open a pseudo-terminal
        _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
        os.symlink("pts/ptmx", "/dev/ptmx")
    except OSError:
        pass


def _private_filesystem(plan: dict) -> str:
    """Private writable tmpfs, a private /proc, /sys and /dev, read-only everything else."""
    keep = os.open(plan["workdir"], os.O_RDONLY | os.O_DIRECTORY)
    _minimal_dev()
    tmpfs_mb = int(plan["tmpfs_mb"])
    nr_inodes = max(1024, 256 * tmpfs_mb)
    for target in WRITABLE:
        if os.path.isdir(target) and not os.path.islink(target):
            # A fresh /run also hides the host's unix sockets (dbus, databases), which a
            # network namespace does not: they are reached through the filesystem.
            mode = "755" if target == "/run" else "1777"
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV,
                   f"size={tmpfs_mb}m,nr_inodes={nr_inodes},mode={mode}")
            if target == "/run":
                os.mkdir("/run/lock")
                os.chmod("/run/lock", 0o1777)
    mount_point = plan["mount_point"]
    os.makedirs(mount_point, exist_ok=True)
    _mount(f"/proc/self/fd/{keep}", mount_point, "", MS_BIND)
    os.close(keep)
    for target in plan.get("hide", ()):
        # What the host keeps about its tasks (generator source, answer files, checkpoints and
        # transcripts of solved episodes) must not be readable by the code being graded.
        if os.path.isdir(target) and not os.path.islink(target):
            _mount("tmpfs", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
        elif os.path.isfile(target) and not os.path.islink(target):
            _mount("/dev/null", target, "", MS_BIND)
    # The host's /proc shows every host process (and their command lines); the host's /sys
    # lists the host's network interfaces and its cgroup files. A user namespace may refuse a
    # new proc or sysfs (a container with masked /proc paths): then an empty tmpfs hides them.
    for target, fstype in (("/proc", "proc"), ("/sys", "sysfs")):
        try:
            _mount(fstype, target, fstype, MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError:
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    for target in _mount_points():
        if target in WRITABLE:
            continue
        try:
            _remount_read_only(target)
        except OSError:
            # A mount hidden under another one (the host's /tmp under ours) has the same
            # path; the remount reached the top one. Anything else must be read-only.
            if target in ("/", mount_point):
                raise
    for target in ("/", mount_point):
        if not os.statvfs(target).f_flag & os.ST_RDONLY:
            raise OSError(f"{target} is still writable after the read-only remount")
    return mount_point


def _drop_privileges(plan: dict) -> None:
    """No capabilities after execve, no way back to them, and (with a uid) not root at all."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            if errno == EINVAL:  # past the last capability this kernel knows
                break
            if errno == EPERM and os.geteuid() != 0:  # an ordinary user: nothing to drop,
                break  # and no_new_privs below stops file capabilities
            raise OSError(errno, f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(errno)}")
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL on old kernels
    _clear_inheritable_capabilities()
    uid = plan["drop_uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid or os.getgid() != uid:
            raise OSError(f"uid drop to {uid} did not take effect")
    # The session keyring is inherited, and whoever holds it may read its keys whatever its
    # uid: start a fresh, empty one. (No keyctl on this kernel or architecture: no keyring.)
    number = SYS_KEYCTL.get(os.uname().machine)
    if number is not None:
        _libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(errno)}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _clear_inheritable_capabilities() -> None:
    """After execve, root keeps its inheritable set even with an empty bounding set."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    if _libc.capget(ctypes.byref(header), data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"capget: {os.strerror(errno)}")
    for item in data:
        item.inheritable = 0
    if _libc.capset(ctypes.byref(header), data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"capset: {os.strerror(errno)}")


def _child(plan: dict, workdir: str) -> None:
    # This process is Python, which ignores SIGPIPE and SIGXFSZ; an ignored signal stays
    # ignored across execve. Restore the defaults, as subprocess does (restore_signals).
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    os.chdir(workdir)
    for name, value in plan["rlimits"].items():
        limit = int(value)
        hard = limit + 1 if name == "CPU" else limit  # SIGXCPU first, SIGKILL one second later
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (limit, hard))
    _drop_privileges(plan)
    env = dict(plan["env"])
    env["KEEL_RESULT_FD"] = os.environ.get("KEEL_RESULT_FD", "")
    interpreter = plan["interpreter"]
    os.execve(interpreter, [interpreter, "-I", "-S", "-B", *plan["argv"]], env)


def _wait(pid: int, deadline_s: float) -> int:
    """Wait for the program; past the deadline kill it (a backstop if the host side is gone)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if not poller.poll(int(deadline_s * 1000)):
            os.kill(pid, signal.SIGKILL)  # under namespaces, exiting then ends the rest
        os.close(pidfd)
    while True:
        try:
            return os.waitpid(pid, 0)[1]
        except InterruptedError:
            continue


def main() -> None:
    plan = marshal.loads(bytes.fromhex(sys.argv[1]))
    status_fd = int(plan["status_fd"])
    os.set_inheritable(status_fd, False)
    try:
        workdir = _private_filesystem(plan) if plan["namespaces"] else plan["workdir"]
        # This process stays alive beside the program: its working directory (the host's start
        # directory, maybe hidden) must not be one the program could reach via /proc/1/cwd.
        os.chdir("/")
    except OSError as error:
        os.write(status_fd, marshal.dumps({"setup_error": f"filesystem: {error}"}))
        os._exit(0)
    report_read, report_write = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(report_read)
        try:
            _child(plan, workdir)
        except BaseException as error:  # noqa: BLE001 - report any setup failure, then die
            os.write(report_write, f"{error!r}".encode()[:4000])
        os._exit(126)
    os.close(report_write)
    setup_error = b""
    while chunk := os.read(report_read, 4096):  # EOF once execve succeeded (close-on-exec)
        setup_error += chunk
    os.close(report_read)
    status = _wait(pid, float(plan["wall_time_s"]) + 2.0)
    record = {"setup_error": setup_error.decode(errors="replace")} if setup_error else {"status": status}
    os.write(status_fd, marshal.dumps(record))
    os._exit(0)


if __name__ == "__main__":
    main()
