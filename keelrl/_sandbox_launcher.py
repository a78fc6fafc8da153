"""The sandbox's first process: set up the run, start the program, report how it ended.

Started by `keelrl.sandbox` (inside new namespaces when available) with one JSON argument,
the plan. It stays alive as the parent (PID 1 of the namespace) while the program runs as
its child, so signals and limits hit the program as an ordinary process, and when the
program exits this process exits, taking the namespace and any daemon left in it along.
It writes the child's wait status to the file descriptor `plan["status_fd"]`, which the
child never sees.
Standard library only: it runs with -I -S before anything else.
"""

import ctypes
import json
import os
import resource
import sys

def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    if libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {fstype} on {target}: {os.strerror(errno)}")


MS_BIND = 4096


def _private_filesystem(plan: dict) -> str:
    """Fresh tmpfs over every world-writable directory; the work dir re-appears at mount_point."""
    keep = os.open(plan["workdir"], os.O_RDONLY | os.O_DIRECTORY)
    size = f"size={int(plan['tmpfs_mb'])}m,mode=1777"
    for target in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        if os.path.isdir(target):
            _mount("tmpfs", target, "tmpfs", 0, size)
    mount_point = plan["mount_point"]
    os.makedirs(mount_point, exist_ok=True)
    _mount(f"/proc/self/fd/{keep}", mount_point, "", MS_BIND, "")
    os.close(keep)
    return mount_point


def _child(plan: dict, workdir: str) -> None:
    os.chdir(workdir)
    for name, value in plan["rlimits"].items():
        limit = int(value)
        hard = limit + 1 if name == "CPU" else limit  # SIGXCPU first, SIGKILL one second later
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (limit, hard))
    uid = plan["drop_uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    env = dict(plan["env"])
    env["KEEL_RESULT_FD"] = os.environ.get("KEEL_RESULT_FD", "")
    interpreter = plan["interpreter"]
    os.execve(interpreter, [interpreter, "-I", "-S", "-B", *plan["argv"]], env)


def main() -> None:
    plan = json.loads(sys.argv[1])
    status_fd = int(plan["status_fd"])
    os.set_inheritable(status_fd, False)
    workdir = _private_filesystem(plan) if plan["namespaces"] else plan["workdir"]
    pid = os.fork()
    if pid == 0:
        try:
            _child(plan, workdir)
        except BaseException as error:  # noqa: BLE001 - report any setup failure, then die
            os.write(2, f"keelrl sandbox setup failed: {error!r}\n".encode())
        os._exit(126)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    os.write(status_fd, json.dumps({"status": status}).encode())
    os._exit(0)


if __name__ == "__main__":
    main()
