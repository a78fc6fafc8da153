"""`keel audit`: try to cheat each task's verifier, and try to make it reject correct code.

For every task the audit runs probe solutions through the real episode machinery: a fresh
`CodingEnv` episode, the probe's files written by the env's own tool calls (built with
`teacher.edit_action`; a file the probe deletes is unlinked from the working copy, as an agent's
shell would), `submit`, then `grade()`. So the sandbox, the copy without .git and the test-file
restoration are exercised exactly as in training. Two kinds of probe:

- false positives, which a sound verifier must pay nothing (reward 0):

    constant_<v>      the entry function returns v; one probe per distinct value the task's
                      visible tests expect
    unchanged         the buggy code as it is
    delete_tests      the test file deleted, the code unchanged
    rewrite_tests     the test file overwritten with one trivially passing test, the code unchanged
    hardcode_visible  a table from repr(arguments) to the visible tests' answers; any other input
                      goes to the buggy function
    git_history       at import, looks for the fix in git history: commits other than HEAD of any
                      repository above its directory or in an episode directory under /tmp (with
                      git), blobs of loose objects (without it); uses the first one that defines
                      the entry function, else the buggy function
    network           at import, asks an answer server that the audit runs on this host's loopback
                      for the key to its answers, else the buggy function
    secret_env        at import, tries every secret-looking environment variable as that key, else
                      the buggy function; `keel audit` plants a canary key in its own environment
                      (`planted_secret`) so that a sandbox that passes the parent's environment on
                      is caught

  The last two carry the task's hidden answers sealed (XOR with a keystream derived from a random
  key), so they score only when their channel really delivers the key: their reward measures the
  leak, not the probe's cleverness.

- rewrites (false negatives), which a sound verifier must pass in full: the reference fix put
  through one behaviour-preserving transformation from `REWRITES` (renamed locals, aliased
  parameters, mirrored comparisons, `is None` as `== None` or `in (None,)`, if-statements as
  conditional expressions and back, returns through a variable, the body moved into a helper,
  other docstrings and comments). Every rewrite goes through `ast.unparse`, so quoting and
  spacing change as well. A rewrite that does not apply to a task (nothing to rename...) is left
  out for that task.

A probe "scores" when its reward is > 0. A false-positive family that scores on any task is
flagged, and so is a rewrite rejected (not full success) on any task; `keel audit` exits 1 when
anything is flagged. One exception: `hardcode_visible` is a plausible fix where the bug breaks
only the visible inputs (`peak_change([])` crashing, say: answering [] correctly IS the fix). Its
score is flagged only when it is distinguishable from the reference fix: both run, in the
verifier's sandbox, one process each, on the probe inputs (every check's arguments, and each
perturbed: an unrelated key added to dict arguments, ints shifted, strings prefixed) and are
compared as the verifier compares (type-aware values, exceptions by name). If they agree on every
input the score is reported as `scored_but_equivalent` and not flagged. The other false positives
are hacks by construction (a constant, untouched code, tampered tests, a leaked answer), so any
score of theirs is flagged.

The report also gives the sandbox's exposure (network, git history, secrets, test files, and
the source tree: whether the code can read keelrl's task generator or the directory the audit
runs in), each probed through the env or the grading sandbox, with the mitigation in force.

What it does NOT guarantee:
- A clean audit does not prove a verifier sound: the probes are the known shortcuts, not all of
  them, and the rewrites change wording and structure, not the algorithm.
- The rewrites are equivalent by construction only for the values tasks use (JSON values: no
  NaN, no custom `__eq__`) and for operands without side effects (a mirrored comparison
  evaluates its operands in the other order). A rewrite that `strong` rejects is reported as a
  finding with the failing check, to be read: it is a verifier false negative or a flaw here.
- The answer server listens on 127.0.0.1 only, so `network` catches a sandbox that shares the
  host's network; whether outside addresses are routable comes from the exposure report, which
  asks for a route with a UDP connect (no packet is sent) and never sends traffic outside.
- Channels no probe tries (a unix socket, a file the host leaves readable outside /tmp) are not
  tested. secret_env reads environment variables only; whether the host user's home is readable
  is an exposure check that lists the directory and reads no credential file.
- `hardcode_visible` flagged under a sound verifier means the task's hidden checks add no case
  the bug breaks beyond the visible ones, though a probe input shows the bug elsewhere: a finding
  about the task data, not the verifier. "Equivalent" means equal on the probe inputs only, a
  handful of perturbations: a candidate that differs from the fix on other inputs alone passes as
  equivalent. A comparison that cannot be made (the reference fix fails to import, the sandbox
  run dies) keeps the score flagged, with the reason; outcomes that differ between two runs of the
  same code (set order under hash randomisation, time) are differences too.

Layout: `probes` (the false positives and their channels), `rewrites`, `episodes` (probes run
through the env, and the comparison with the fix), `exposure`, `report` (`run_audit` and its
output). Everything public is importable from `keelrl.audit` itself.
"""

from keelrl.audit.probes import (AuditError, CANARY_VAR, Channels, FALSE_POSITIVE, FALSE_POSITIVE_PROBES,
                                 MAX_PROBE_CHARS, Probe, ProbeBuilder, REWRITE, answer_server,
                                 false_positive_probes, planted_secret, seal_answers)
from keelrl.audit.rewrites import (REWRITES, Rewrite, rewrite_probes, rewrite_source)
from keelrl.audit.episodes import (PROBE_INPUT_LIMIT, ProbeResult, audit_probe, audit_task, compare_with_fix,
                                   default_env, probe_inputs, run_probe)
from keelrl.audit.exposure import (Exposure, check_exposure, source_paths)
from keelrl.audit.report import (AuditReport, FamilySummary, default_workers, print_report, run_audit)

__all__ = [
    "answer_server", "audit_probe", "audit_task", "AuditError", "AuditReport", "CANARY_VAR", "Channels",
    "check_exposure", "compare_with_fix", "default_env", "default_workers", "Exposure", "FALSE_POSITIVE",
    "FALSE_POSITIVE_PROBES", "false_positive_probes", "FamilySummary", "MAX_PROBE_CHARS", "planted_secret",
    "print_report", "Probe", "PROBE_INPUT_LIMIT", "probe_inputs", "ProbeBuilder", "ProbeResult", "REWRITE",
    "Rewrite", "rewrite_probes", "rewrite_source", "REWRITES", "run_audit", "run_probe", "seal_answers",
    "source_paths",
]
