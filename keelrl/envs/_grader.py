"""Runs inside the sandbox: import the candidate's code, call it, report what came back.

Copied into each sandbox run as `_keel_grader.py` and started with a JSON request on stdin:

    {"nonce": str, "mode": "checks" | "tests", "module": str, "function": str,
     "calls": [[arg, ...], ...], "test_module": str, "per_call_timeout": float,
     "off_limits": ["module.function", ...]}

It writes one JSON object to the result file descriptor (KEEL_RESULT_FD), tagged with the
nonce. In "checks" mode it reports, per call, the returned value (JSON-encoded with its type
name) or the exception; the expected values never enter the sandbox, so the candidate cannot
read them, and the host does the comparison. In "tests" mode it runs every test_* function
of the (visible) test module and reports pass/fail with the assertion message.

"off_limits" names library functions the candidate's own files may not call (a task taken from
real code: the original it was mutated from, which the sandbox's standard library still holds).
Before the candidate is imported, each such function is replaced, in every loaded module that
holds it, by a fence: called from a file under the working directory it raises OffLimitsError
naming the function; called from anywhere else (the library calling itself, as `abspath` calls
`join`) it runs the original. It closes delegation (`return os.path.basename(p)`), not a
candidate that digs the original out again (the fence's closure, the library's source).

Everything the grader needs is imported before the candidate's directory is put on sys.path,
so a candidate file named like a stdlib module cannot replace it. Standard library only.
"""

import copy
import importlib
import json
import os
import signal
import sys
import traceback


class _CallTimeout(BaseException):
    """Raised by the alarm inside a call that runs too long (BaseException: not caught by
    the candidate's `except Exception`)."""


_SELF = os.path.abspath(__file__)


class OffLimitsError(Exception):
    """Raised when the candidate calls a function the task puts off limits."""


def _fence(name, original, root):
    def fenced(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename  # no os.path here: the fenced function may be one of its
        if caller.startswith(root) and caller != _SELF:
            raise OffLimitsError(f"{name} is off limits in this task: fix the function in the file, "
                                 f"do not call the library's own {name}")
        return original(*args, **kwargs)

    fenced.__name__ = getattr(original, "__name__", "fenced")
    return fenced


def _fence_off(names, root):
    """Replace each "module.function" of `names` by its fence, wherever a loaded module holds it."""
    for name in names:
        module_name, _, attribute = name.rpartition(".")
        try:
            original = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError):  # not in this library (a C module replaced it): nothing to call
            continue
        fenced = _fence(name, original, root)  # root: absolute, as the candidate's modules' file names are
        for module in list(sys.modules.values()):
            try:
                holders = [key for key, value in vars(module).items() if value is original]
            except TypeError:  # a module without a __dict__
                continue
            for key in holders:
                setattr(module, key, fenced)


def _on_alarm(signum, frame):
    raise _CallTimeout()


def _encode(value):
    try:
        text = json.dumps(value, allow_nan=False)
        return {"ok": True, "value": text, "type": type(value).__name__}
    except (TypeError, ValueError):
        return {"ok": True, "value": None, "type": type(value).__name__, "repr": repr(value)[:300]}


def _error(exc):
    return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:300]}


def _timed(fn, timeout):
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _run_checks(request):
    try:
        module = _timed(lambda: importlib.import_module(request["module"]), request["per_call_timeout"])
        function = getattr(module, request["function"])
    except _CallTimeout:
        return {"import_error": "import timed out"}
    except BaseException as exc:  # noqa: BLE001 - any failure to import is the candidate's
        return {"import_error": f"{type(exc).__name__}: {exc}"[:500]}
    results = []
    for args in request["calls"]:
        try:
            value = _timed(lambda: function(*copy.deepcopy(args)), request["per_call_timeout"])
            results.append(_encode(value))
        except _CallTimeout:
            results.append({"ok": False, "error": "Timeout", "message": "call timed out"})
        except BaseException as exc:  # noqa: BLE001
            results.append(_error(exc))
    return {"results": results}


def _run_tests(request):
    try:
        module = _timed(lambda: importlib.import_module(request["test_module"]), request["per_call_timeout"])
    except _CallTimeout:
        return {"import_error": "importing the tests timed out"}
    except BaseException as exc:  # noqa: BLE001
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return {"import_error": last[:500]}
    tests = []
    for name in sorted(vars(module)):
        test = getattr(module, name)
        if not (name.startswith("test_") and callable(test)):
            continue
        try:
            _timed(test, request["per_call_timeout"])
            tests.append({"name": name, "passed": True, "message": ""})
        except _CallTimeout:
            tests.append({"name": name, "passed": False, "message": "timed out"})
        except AssertionError as exc:
            tests.append({"name": name, "passed": False, "message": str(exc)[:300] or "assertion failed"})
        except BaseException as exc:  # noqa: BLE001
            tests.append({"name": name, "passed": False, "message": f"{type(exc).__name__}: {exc}"[:300]})
    return {"tests": tests}


def main():
    request = json.loads(sys.stdin.read())
    result_fd = int(os.environ["KEEL_RESULT_FD"])
    nonce = request.pop("nonce")
    root = os.path.join(os.path.abspath(os.getcwd()), "")
    _fence_off(request.get("off_limits", []), root)
    sys.path.insert(0, os.getcwd())
    outcome = _run_checks(request) if request["mode"] == "checks" else _run_tests(request)
    outcome["nonce"] = nonce
    os.write(result_fd, json.dumps(outcome).encode())


if __name__ == "__main__":
    main()
