"""Bug-fix tasks from real code: standard-library functions, each with one mutation.

The templated family (`keelrl.envs.coding_tasks`) writes its code from templates. This family
takes it from the pure-Python modules that ship with the running interpreter (CPython's `Lib/`,
under the Python Software Foundation License, version 2; `SOURCES` records module, function and
licence for each). A task's file holds the function's original text (comments and docstring
included), the few module-level names it needs copied in verbatim (`Source.helpers`), a line of
provenance and the imports it needs. The bug is one change to the function, made on its syntax
tree and written back into the original text by replacing only the changed token or line (a
task's kind is the mutation's name with `KIND_PREFIX`, "real_off_by_one"):

    off_by_one          `<` for `<=` (and back), an integer bound, index or step moved by 1
    flipped_comparison  `<` for `>`, `<=` for `>=`, `min` for `max`
    inverted_condition  `==`/`!=`, `in`/`not in`, `is`/`is not`, `<` for `>=`, `if x` for `if not x`
    wrong_operator      `+` for `-`, `*` for `+`, `//` for `/` or `%`, `<<` for `>>`, `&` for `|`, `and` for `or`
    missing_guard       an `if` that returns, raises or continues early is deleted

Checks call the function on the examples of its docstring (every `>>> function(literal args)`)
and on inputs chosen here (`Source.inputs`); the expected values always come from running the
original code, never from this file. A check is kept only when its arguments and its result
are JSON values (a tuple result drops the check) or the original raises a built-in exception
(not AssertionError). A mutant becomes a task when it fails at least one check, both as the
verifier compares (the grader's encoding, the verifier's comparison) and as the rendered
visible test file compares (`==`), runs every check within `STEP_BUDGET` traced Python events
(no endless loop), and does not fail every failing check with a TypeError alone (a `-` on two
strings is a crash, not a bug worth fixing). The key check is one such failing check; the
visible tests are the key plus 2-4 other checks, with one other failing check held back when
there is one. The wrong fix is a near miss where there is one: another change at the bug's
place (`<` where `<=` was, `c + 2` where `c + 1` was...), else on its line, that passes the key
check but fails another; failing that, another change at the bug's place that fails a check;
tasks with neither ship no wrong fix. The brittle phrase is the original line the bug changed.

What this module guarantees (tests/test_real_tasks.py checks it): every task passes
`validate_task`; the reference fix (the original text) passes every check; the buggy code
fails the key check and at least one visible test; the wrong fix, when there is one, fails a
check; ids and buggy sources are distinct; `real_tasks(seed)` is a pure function of the seed
AND of the interpreter's standard library (another Python version gives other source texts,
hence other tasks; a source whose function or helper is gone from its module is left out). `real_split`
holds out about a quarter of the SOURCE FUNCTIONS, not of the tasks: a function's mutants are
all in the same split, so training on one mutant of `cram` cannot teach the held-out answer of
another.
What it does NOT guarantee: that the checks pin the behaviour down completely (a mutant can be
equivalent on inputs nobody checks); that the agent cannot reach the original: each task puts it off limits (`Task.off_limits`), and the
grader fences it so that a call from the candidate's files raises (delegating, as in
`return os.path.basename(p)`, fails every check), but a candidate that digs the original out
again (the fence's closure, the library's source) is not stopped; that
the code runs the same on other platforms than Linux. Evaluating mutants here traces their
Python lines with `sys.settrace` (per thread, restored afterwards) to stop endless loops; that
only works for code without a bare `except:`, which `_prepared` refuses.
"""

from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import doctest
import functools
import random
import re
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from keelrl.envs import _grader
from keelrl.envs.tasks import Check, Task, render_test_file, split_of
from keelrl.envs.verifiers import _matches

KINDS = ("off_by_one", "flipped_comparison", "inverted_condition", "wrong_operator", "missing_guard")
KIND_PREFIX = "real_"
"""A task's kind is its mutation's name with this prefix ("real_off_by_one"), so held-out reports
and the curriculum keep this family's kinds apart from the templated kinds of the same name."""
TASKS_PER_SOURCE = 4
"""At most this many mutants of one function become tasks (chosen by the seed, kinds taken in turn)."""
STEP_BUDGET = 20_000
"""Traced Python events (calls and lines) a check may take before the mutant counts as hanging
(the originals take at most a few hundred, a few thousand when a regular expression is compiled)."""
PSF = "PSF-2.0"
"""The licence of CPython's standard library: Python Software Foundation License, version 2."""


@dataclass(frozen=True)
class Source:
    """One function of the standard library and the inputs its checks call it with."""

    module: str
    """Module that defines it, e.g. "posixpath" (its file is read from the interpreter's Lib/)."""
    function: str
    inputs: tuple[list[Any], ...]
    """Argument lists chosen here, beside the docstring's examples (expected values are computed)."""
    helpers: tuple[str, ...] = ()
    """Module-level names the function needs, copied in verbatim (defs, classes, assignments)."""
    imports: tuple[str, ...] = ()
    """Import lines at the top of the task file."""
    name: str = ""
    """Task name (ids, file names); default: the function's name without underscores, lower case."""
    summary: str = ""
    """What the function does, for the prompt, when its docstring's first sentence does not say it."""
    pairs_as_lists: bool = False
    """The function only unpacks pairs, so a docstring example's tuples may be passed as lists."""
    licence: str = PSF

    @property
    def slug(self) -> str:
        return self.name or self.function.strip("_").lower()


_OS = ("import os",)
_STATS = ("StatisticsError",)
_COOKIE_HOST = ("is_HDN", "IPV4_RE")

SOURCES: tuple[Source, ...] = (
    Source("genericpath", "commonprefix", (
        [["/usr/lib", "/usr/local/lib"]], [["abc", "abd", "ab"]], [[]], [["same", "same"]],
        [["/home/user", "/home/user/docs"]], [["x", "y"]], [[["a", "b", "c"], ["a", "b", "d"]]]), imports=_OS),
    Source("posixpath", "basename", (
        ["/usr/lib/python3"], ["file.txt"], ["/usr/lib/"], ["/"], [""], ["a/b/c.tar.gz"], ["//srv//data"]),
        helpers=("_get_sep",), imports=_OS),
    Source("posixpath", "dirname", (
        ["/usr/lib/python3"], ["file.txt"], ["/usr/lib/"], ["/"], ["/usr"], ["///a"], ["a//b"], ["//"]),
        helpers=("_get_sep",), imports=_OS),
    Source("posixpath", "join", (
        ["/usr", "lib"], ["/usr/", "lib"], ["usr", "/etc", "passwd"], ["", "a"], ["a", ""], ["a", "b", "c"],
        ["a"], ["/", "x"]), helpers=("_get_sep",), imports=(*_OS, "import genericpath"), name="posix_join"),
    Source("posixpath", "commonpath", (
        [["/usr/lib", "/usr/local/lib"]], [["/usr/lib", "/usr/lib/python"]], [["a/b", "a/c"]], [["/a", "b"]],
        [[]], [["./a/./b", "a/b/c"]], [["/x"]], [["a/b/", "a/b"]], [["/a/b", "/a/bc"]]),
        imports=(*_OS, "import genericpath")),
    Source("posixpath", "relpath", (
        ["/a/b/c", "/a"], ["/a", "/a/b/c"], ["/a/b", "/a/b"], ["/a/x", "/a/y"], ["/", "/a"], ["/a/b/", "/a/b/c/"],
        [""], ["/x/y", "/"], ["/a/bc", "/a/b"]),
        imports=(*_OS, "import genericpath", "from posixpath import abspath, commonprefix, join")),
    Source("ntpath", "isabs", (
        ["C:\\Windows"], ["C:Windows"], ["\\\\server\\share"], ["/x"], ["relative\\path"], ["c:/x"], [""], ["d:"]),
        imports=_OS, name="nt_isabs"),
    Source("ntpath", "join", (
        ["C:\\", "foo"], ["C:", "foo"], ["C:\\a", "D:\\b"], ["a", "b", "c"], ["\\\\server\\share", "dir"],
        ["C:\\a", "c:b"], ["a\\", "b"], ["C:\\a", "\\b"], ["a", ""], ["C:\\a", "C:"]),
        helpers=("splitdrive",), imports=(*_OS, "import genericpath"), name="nt_join",
        summary="Join Windows path components with backslashes: an absolute component discards what came "
                "before it, and a component on another drive starts over on that drive."),
    Source("shlex", "quote", (
        [""], ["simple"], ["with space"], ["it's"], ["$HOME"], ["a-b_c.d/e:f"], ["semi;colon"]),
        helpers=("_find_unsafe",), imports=("import re",), name="shell_quote"),
    Source("textwrap", "dedent", (
        ["    a\n    b\n"], ["  a\n    b\n"], ["\ta\n  b\n"], ["no indent\n  x\n"], ["    a\n\n    b"],
        ["  \n  x\n"], ["   x\n   y\n     z\n"], ["  a\n \tb\n"], ["\t\ta\n\tb\n"]),
        helpers=("_whitespace_only_re", "_leading_whitespace_re"), imports=("import re",)),
    Source("textwrap", "indent", (
        ["a\nb\n", "> "], ["a\n\nb", "  "], ["", "#"], ["  \nx", "-"], ["one", ""], ["x\n  \ny\n", "| "])),
    Source("string", "capwords", (
        ["hello world"], ["  hello   world  "], ["hello-world", "-"], ["aBC dEF"], [""], ["a,b,,c", ","]),
        summary="Split the string into words, capitalize each word and join them again; without sep, runs "
                "of whitespace become one space and leading and trailing whitespace is removed."),
    Source("html", "escape", (
        ["<a href=\"x\">'&'</a>"], ["<a href=\"x\">", False], ["plain"], ["&amp;"], ["'"], ["\"q\"", False]),
        name="html_escape"),
    Source("calendar", "isleap", ([2000], [1900], [2024], [2023], [2100], [2400], [4], [1])),
    Source("calendar", "leapdays", (
        [2000, 2001], [1900, 2000], [2000, 2100], [1, 2024], [2024, 2024], [1999, 2005], [2001, 2004],
        [2001, 2005])),
    Source("calendar", "_monthlen", (
        [2024, 2], [2023, 2], [2023, 1], [1900, 2], [2000, 2], [2023, 12], [2023, 4]),
        helpers=("February", "mdays", "isleap"), summary="The number of days in the month of the year."),
    Source("datetime", "_cmp", ([1, 2], [2, 1], [3, 3], ["a", "b"], [[1, 2], [1, 3]], [2.5, 2.5], [-1, -2]),
           summary="Compare x and y: 0 when they are equal, 1 when x > y, -1 otherwise."),
    Source("datetime", "_divide_and_round", (
        [7, 2], [5, 2], [-7, 2], [7, -2], [10, 3], [11, 3], [1, 4], [3, 4], [-3, 4], [6, 4], [9, 2])),
    Source("datetime", "_days_before_year", ([1], [2], [5], [101], [401], [2000], [2001])),
    Source("datetime", "_days_in_month", (
        [2024, 2], [2023, 2], [1900, 2], [2000, 2], [2023, 1], [2023, 4], [2023, 12]),
        helpers=("_DAYS_IN_MONTH", "_is_leap")),
    Source("datetime", "_format_time", (
        [1, 2, 3, 0], [1, 2, 3, 4500], [1, 2, 3, 4500, "milliseconds"], [1, 2, 3, 4500, "hours"],
        [1, 2, 3, 4500, "minutes"], [1, 2, 3, 4500, "seconds"], [23, 59, 59, 999999, "microseconds"],
        [1, 2, 3, 4, "fortnights"], [12, 0, 0, 999, "milliseconds"]),
        summary="Format hours, minutes, seconds and microseconds as HH:MM:SS.ffffff, to the precision "
                "`timespec` names ('auto' leaves out zero microseconds)."),
    Source("datetime", "_parse_hh_mm_ss_ff", (
        ["12"], ["12:34"], ["1234"], ["12:34:56"], ["123456"], ["12:34:56.789"], ["12:34:56.123456"],
        ["12:34:56,5"], ["12:34:56.1234567"], ["1"], ["12:3456"], ["12:34:5"], ["12:34:56.123456789"]),
        helpers=("_FRACTION_CORRECTION", "_is_ascii_digit"),
        summary="Parse an ISO time HH[:MM[:SS[.fff[fff]]]] (colons optional) into "
                "[hours, minutes, seconds, microseconds]; a malformed time raises ValueError."),
    Source("datetime", "_find_isoformat_datetime_separator", (
        ["2023-01-15T10:00"], ["20230115T10"], ["2023-W05T1"], ["2023-W05-3T10"], ["2023W053T10"],
        ["2023W05T10"], ["2023-01"], ["2023-W05"], ["2023-W05-312"], ["2023W0512"], ["2023-W05-"]),
        helpers=("_is_ascii_digit",), name="find_datetime_separator",
        summary="The index in an ISO 8601 date-time string at which the date ends and the separator "
                "before the time begins."),
    Source("statistics", "median", (
        [[5, 1, 3]], [[2, 8]], [[4]], [[1, 2, 3, 4, 5, 6]], [[]], [[1.5, 2.5, 10.0]], [[7, 1]]), helpers=_STATS),
    Source("statistics", "median_low", (
        [[5, 1, 3]], [[2, 8]], [[4]], [[1, 2, 3, 4, 5, 6]], [[]], [[9, 7, 1, 3]]), helpers=_STATS),
    Source("statistics", "median_high", (
        [[5, 1, 3]], [[2, 8]], [[4]], [[1, 2, 3, 4, 5, 6]], [[]], [[9, 7, 1, 3]]), helpers=_STATS),
    Source("statistics", "median_grouped", (
        [[52, 52, 53, 54]], [[1, 3, 3, 5, 7]], [[1, 3, 3, 5, 7], 2], [[1, 2, 2, 3, 4, 4, 4, 4, 4, 5]], [[5]],
        [[2, 2, 2, 4], 2], [[10, 20, 20, 30]]),
        helpers=_STATS, imports=("from bisect import bisect_left, bisect_right",)),
    Source("statistics", "multimode", (
        [[1, 1, 2, 2, 3]], [[3]], [["a", "b", "b"]], [[]], [[4, 4, 4, 1, 1, 1, 2]]),
        imports=("from collections import Counter",)),
    Source("statistics", "quantiles", (
        [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], [[1, 2]], [[10, 20, 30]], [[1, 5, 2, 8, 7, 3]], [[0, 0, 0, 0, 100]],
        [[1.5, 2.5, 3.5, 4.5]], [[1]]), helpers=_STATS),
    Source("bisect", "bisect_right", (
        [[1, 2, 2, 3], 2], [[1, 2, 2, 3], 0], [[1, 2, 2, 3], 5], [[], 1], [[1, 3, 5, 7], 4], [[1, 2, 2, 3], 2, 2],
        [[1, 2, 2, 3], 2, 0, 1], [[1, 2, 3], 2, -1], [[1, 1, 1, 1, 1], 1])),
    Source("bisect", "bisect_left", (
        [[1, 2, 2, 3], 2], [[1, 2, 2, 3], 0], [[1, 2, 2, 3], 5], [[], 1], [[1, 3, 5, 7], 4], [[1, 2, 2, 3], 2, 2],
        [[1, 2, 2, 3], 3, 0, 2], [[1, 2, 3], 2, -1], [[1, 1, 1, 1, 1], 1])),
    Source("heapq", "nsmallest", (
        [3, [5, 1, 4, 2, 3, 9, 0]], [1, [4, 2, 6]], [0, [1, 2]], [5, [3, 1]], [2, [7, 7, 1, 1, 5]],
        [3, [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]], [1, []], [4, [2, 8, 1, 9, 3, 7, 4]]),
        helpers=("_heapify_max", "_heapreplace_max", "_siftdown_max", "_siftup_max")),
    Source("heapq", "nlargest", (
        [3, [5, 1, 4, 2, 3, 9, 0]], [1, [4, 2, 6]], [0, [1, 2]], [5, [3, 1]], [2, [7, 7, 1, 1, 5]],
        [3, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], [1, []], [4, [2, 8, 1, 9, 3, 7, 4]]),
        helpers=("heapreplace", "heapify", "_siftdown", "_siftup")),
    Source("difflib", "_format_range_unified", ([0, 0], [0, 1], [3, 4], [3, 7], [5, 5], [10, 12], [0, 2]),
           summary="Format the line range [start, stop) as a unified diff hunk header does: 'first,count', "
                   "or 'first' alone for one line."),
    Source("difflib", "_format_range_context", ([0, 0], [0, 1], [3, 4], [3, 7], [5, 5], [10, 12], [0, 2]),
           summary="Format the line range [start, stop) as a context diff hunk header does: 'first,last', "
                   "or 'first' alone for one line."),
    Source("difflib", "IS_LINE_JUNK", (["x = 1 # comment\n"], ["#\n"], ["##\n"], [""], ["   "], ["\t#\n"]),
           imports=("import re",)),
    Source("difflib", "IS_CHARACTER_JUNK", ([" "], ["\t"], ["x"], ["\r"])),
    Source("http.cookiejar", "reach", (
        ["www.acme.local"], ["127.0.0.1"], ["localhost"], ["a.b.c.d.com"], [".acme.com"], ["www.acme.com."],
        ["x.local"]), helpers=_COOKIE_HOST, imports=("import re",)),
    Source("http.cookiejar", "domain_match", (
        ["x.y.com", ".Y.com"], ["x.y.com", "Y.com"], ["a.b.c.com", ".c.com"], [".c.com", "a.b.c.com"],
        ["acme.com", "ACME.com"], ["192.168.1.1", ".168.1.1"], ["y.com", ".y.com"], ["x.y.com", ".y.com."],
        ["x.y.com", "."]), helpers=_COOKIE_HOST, imports=("import re",)),
    Source("http.cookiejar", "is_HDN", (
        ["www.example.com"], ["127.0.0.1"], [""], [".example.com"], ["example.com."], ["localhost"]),
        helpers=("IPV4_RE",), imports=("import re",)),
    Source("http.cookiejar", "join_header_words", (
        [[[["a", "b c"]]]], [[[["k", "v\"q"]]]], [[]], [[[], [["x", None]]]], [[[["a", "1"], ["b", "two"]]]]),
        helpers=("HEADER_JOIN_ESCAPE_RE",), imports=("import re",), pairs_as_lists=True),
    Source("http.cookiejar", "_timegm", (
        [[1970, 1, 1, 0, 0, 0]], [[2000, 2, 29, 12, 30, 15]], [[1969, 12, 31, 23, 59, 59]], [[2023, 13, 1, 0, 0, 0]],
        [[2023, 1, 32, 0, 0, 0]], [[2023, 1, 31, 24, 0, 0]], [[2023, 1, 31, 0, 60, 0]], [[2023, 1, 31, 0, 0, 61]],
        [[2023, 0, 1, 0, 0, 0]], [[2023, 1, 0, 0, 0, 0]], [[2023, 12, 31, 23, 59, 59]]),
        helpers=("EPOCH_YEAR",), imports=("from calendar import timegm",),
        summary="Seconds since the epoch for a UTC time [year, month, day, hour, minute, second], or None "
                "when the year is before 1970 or a field is out of range."),
    Source("http.cookiejar", "offset_from_tz_string", (
        ["GMT"], ["+0100"], ["-0530"], ["+01:30"], ["EST"], ["+5"], ["-02"], ["UTC"], ["0000"]),
        helpers=("UTC_ZONES", "TIMEZONE_RE"), imports=("import re",),
        summary="The offset in seconds east of UTC of a time zone string such as 'GMT' or '-0530', "
                "or None when it is not one."),
    Source("http.cookies", "_unquote", (
        ['"abc"'], ["abc"], ['"a\\"b"'], ['"a\\012b"'], ['"'], [None], ['""'], ['"x\\\\y"'], ['"\\101\\102"'],
        ['"a']), helpers=("_nulljoin", "_OctalPatt", "_QuotePatt"), imports=("import re",), name="cookie_unquote",
        summary="Undo the quoting of a cookie value: strip the double quotes and decode \\\" and \\ooo "
                "octal escapes; a value without quotes comes back unchanged."),
    Source("email.utils", "unquote", (
        ['"abc"'], ["<abc>"], ['"a\\"b\\\\c"'], ['"'], ["abc"], ['""'], ["<a"], ["<>"]), name="email_unquote"),
    Source("email.quoprimime", "decode", (
        ["hello=20world"], ["abc=\ndef"], ["=41=42=43"], ["a=\n"], [""], ["line1\nline2\n"], ["x=4"], ["=3D"],
        ["tail="], ["a\r\nb"], ["no eol=41"], ["a=2x"], ["\n\nz"]),
        helpers=("NL", "unquote"), imports=("from string import hexdigits",), name="qp_decode"),
    Source("urllib.parse", "unwrap", (
        ["<URL:http://x/y>"], ["<http://x>"], ["URL:ftp://a"], ["  <URL:  http://a  >  "], ["http://plain"],
        ["<>"], ["URL:"], ["<URL:>"])),
    Source("urllib.request", "parse_http_list", (
        ["a, b, c"], ['a="b, c", d'], ['"x\\"y", z'], [""], ["a,,b"], ["one"], ['k="v,w" , x'], ['a\\,b'])),
    Source("urllib.request", "parse_keqv_list", (
        [["a=1", 'b="2"']], [["k=v=w"]], [[]], [['q=""']], [['x="y']], [["e="]], [['z="', "w=1"]])),
    Source("pydoc", "cram", (
        ["hello world", 20], ["hello world", 8], ["hello world", 5], ["abcdefghij", 10], ["abcdefghij", 9],
        ["abcdefghijklmnop", 3], ["abcdefghijklmnop", 4], ["abc", 0], ["abcdefghijklmnop", 7])),
    Source("pydoc", "replace", (
        ["a-b-c", "-", "+"], ["abc", "a", "x", "b", "y"], ["abc"], ["aaa", "a", "aa"], ["x y", " ", "_", "_", "-"],
        ["abcabc", "bc", "", "a", "z"]), name="pydoc_replace"),
    Source("inspect", "cleandoc", (
        ["  first\n    second\n      third\n"], ["line"], ["\n\n  a\n  b\n\n"], ["a\n\tb\n\tc"], [""],
        ["  x\n\n   y"], ["title\n\n    body\n  less"]), imports=("import sys",)),
    Source("inspect", "indentsize", (["    x"], ["\tx"], ["x"], [""], ["  \t x"], ["   "])),
    Source("_pydecimal", "_decimal_lshift_exact", (
        [0, 5], [12, 3], [1200, -2], [1230, -2], [-1500, -2], [5, 0], [100, -3], [7, -1], [-20, -1])),
    Source("_pydecimal", "_div_nearest", ([7, 2], [5, 2], [9, 2], [10, 3], [11, 3], [1, 4], [3, 4], [6, 4], [0, 5])),
    Source("_pydecimal", "_rshift_nearest", ([7, 1], [5, 1], [6, 2], [10, 2], [1, 0], [11, 2], [13, 2], [-5, 1])),
    Source("_pydecimal", "_log10_lb", ([1], [9], [10], [99], [100], [12345], [0], [-1], [2])),
    Source("_pydecimal", "_sqrt_nearest", ([16, 1], [17, 4], [2, 1], [100, 7], [99, 10], [1, 1], [0, 1], [5, 0],
                                            [24, 5], [30, 5])),
    Source("ipaddress", "_count_righthand_zero_bits", (
        [0, 32], [8, 32], [12, 32], [1, 8], [256, 4], [6, 1], [1024, 16], [7, 3])),
    Source("colorsys", "_v", (
        [0.2, 0.8, 0.1], [0.2, 0.8, 0.3], [0.2, 0.8, 0.6], [0.2, 0.8, 0.9], [0.0, 1.0, 1.25], [0.0, 1.0, -0.1],
        [0.25, 0.75, 0.5], [0.0, 1.0, 0.0]), helpers=("ONE_SIXTH", "TWO_THIRD"), name="hls_value",
        summary="One RGB channel of an HLS colour: a value between m1 and m2 that depends on where the "
                "hue lies on the colour wheel (hue is taken modulo 1)."),
    Source("doctest", "_ellipsis_match", (
        ["abc", "abc"], ["a...c", "abc"], ["a...c", "abd"], ["...", "anything"], ["a...b...c", "axxbyyc"],
        ["a...b...c", "acb"], ["aa...aa", "aaaa"], ["x...", "y"], ["...z", "xyz"], ["a...a", "a"]),
        helpers=("ELLIPSIS_MARKER",),
        summary="Whether `got` matches the doctest output `want`, in which '...' matches any text."),
    Source("enum", "bin", ([-11], [0], [-1], [5, 8], [-3, 8], [255], [1, 2], [-8]),
           imports=("import builtins as bltns",), name="signed_bin"),
    Source("wsgiref.util", "application_uri", (
        [{"wsgi.url_scheme": "http", "HTTP_HOST": "example.com"}],
        [{"wsgi.url_scheme": "http", "SERVER_NAME": "h", "SERVER_PORT": "80"}],
        [{"wsgi.url_scheme": "http", "SERVER_NAME": "h", "SERVER_PORT": "8080"}],
        [{"wsgi.url_scheme": "https", "SERVER_NAME": "h", "SERVER_PORT": "443"}],
        [{"wsgi.url_scheme": "https", "SERVER_NAME": "h", "SERVER_PORT": "80"}],
        [{"wsgi.url_scheme": "http", "HTTP_HOST": "x", "SCRIPT_NAME": "/app path"}],
        [{"wsgi.url_scheme": "http", "HTTP_HOST": "", "SERVER_NAME": "s", "SERVER_PORT": "80"}])),
    Source("wsgiref.util", "guess_scheme", (
        [{}], [{"HTTPS": "on"}], [{"HTTPS": "yes"}], [{"HTTPS": "1"}], [{"HTTPS": "off"}], [{"HTTPS": "0"}])),
    Source("http.server", "_url_collapse_path", (
        ["/a/b/../c"], ["/a/./b/"], ["//a//b"], ["/a/b/.."], ["/a/b/."], ["/a?x=1/../"], ["/.."], ["/a/%2e%2e/b"],
        [""], ["/"], ["a/b"], ["/a/b/c?q"]), imports=("import urllib.parse",)),
    Source("ftplib", "parse257", (
        ['257 "/home/user" created'], ['257 "/dir with ""quotes"""'], ["257 created"], ['257 "unterminated'],
        ['257 ""'], ['500 "x"'], ['257 "a""']), helpers=("Error", "error_reply")),
    Source("unittest.util", "_shorten", (
        ["abcdefghijklmnopqrstuvwxyz0123", 5, 5], ["short", 1, 1], ["abcdefghijklmnopqrstuvwxyz", 2, 2],
        ["abcdefghijklmnopqr", 3, 3], ["abcdefghijklmnopqrs", 3, 3], ["abcdefghijklmnopqrstuvwxyz", 0, 0]),
        helpers=("_PLACEHOLDER_LEN",),
        summary="Shorten s to its first prefixlen and last suffixlen characters around a '[N chars]' marker, "
                "when more than _PLACEHOLDER_LEN characters would be left out."),
    Source("unittest.util", "safe_repr", (
        ["abc"], [[1, 2, 3]], ["x" * 100, True], ["x" * 100], [None, True], ["y" * 78, True], ["y" * 77, True]),
        helpers=("_MAX_LENGTH",),
        summary="repr(obj), or object.__repr__ when repr fails; with short=True, cut to _MAX_LENGTH "
                "characters followed by ' [truncated]...'."),
    Source("unittest.util", "three_way_cmp", ([1, 2], [2, 1], [2, 2], ["a", "b"], [1.5, 1.5], [[1], [0]])),
    Source("platform", "_norm_version", (
        ["1.2.3.4"], ["1.2"], ["1.2", "5"], ["01.02.03"], ["1.a.3"], ["10"], ["1.2.3", "beta"], ["7.0.1.2", "9"])),
    Source("fnmatch", "translate", (
        ["*.py"], ["?x"], ["[abc]"], ["[!abc]"], ["[a-z]*"], ["**"], ["a*b*c"], ["[]"], ["[!]"], ["[z-a]"],
        ["x[a-c-e]"], ["[^x]"], ["[&&]"], ["[a-]"], ["*a*"], ["[!a-c]d"], ["[a-c-]"]),
        imports=("import re",), name="fnmatch_translate"),
)

_NAMES = [source.slug for source in SOURCES]
if len(set(_NAMES)) != len(_NAMES):
    raise RuntimeError(f"real_tasks: task names must be unique, got {sorted(_NAMES)}")
if any(name in sys.stdlib_module_names or name.startswith(("test", "conftest")) for name in _NAMES):
    raise RuntimeError("real_tasks: a task file must not be named like a standard module or a test")


# ------------------------------------------------------------------------------ public API

def real_tasks(seed: int = 0, split: str | None = None) -> list[Task]:
    """The family for `seed`, sources in `SOURCES` order, ids `real-<name>-<n>`; or one split.

    A pure function of `seed` and the interpreter's standard library: which mutants of each
    function become tasks (at most `TASKS_PER_SOURCE`, kinds taken in turn), the key check, the
    visible tests and the wrong fix are drawn from `random.Random(f"{seed}:{name}")`.
    """
    if split not in (None, "train", "heldout"):
        raise ValueError(f"split must be None, 'train' or 'heldout', got {split!r}")
    tasks = []
    for source in SOURCES:
        prepared = _prepared(source.slug)
        if prepared is not None:
            tasks += _tasks_of(prepared, random.Random(f"{seed}:{source.slug}"))
    return tasks if split is None else [task for task in tasks if real_split(task, seed) == split]


def real_split(task: Task | str, seed: int = 0) -> str:
    """'train' or 'heldout' for a task (or task id) of this family: `split_of` over its source function."""
    return split_of(f"real:{source_of(task).slug}", seed)


def source_of(task: Task | str) -> Source:
    """The `Source` a task (or task id) of this family was made from."""
    task_id = task if isinstance(task, str) else task.id
    prefix, _, rest = task_id.partition("-")
    name, _, number = rest.rpartition("-")
    if prefix != "real" or not number.isdigit() or name not in _BY_NAME:
        raise ValueError(f"{task_id!r} is not a task id of the real-code family (real-<name>-<n>)")
    return _BY_NAME[name]


_BY_NAME = {source.slug: source for source in SOURCES}


# ------------------------------------------------------------------------------ reading the sources

def stdlib_path(module: str) -> Path:
    """The file of a standard-library module under the interpreter's Lib/ (never imported)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    raise FileNotFoundError(f"no source file for the standard module {module!r} under {root}")


@functools.lru_cache(maxsize=None)
def _module_lines(module: str) -> list[str]:
    """The module's lines, split at "\\n" only (as the parser counts them)."""
    text = stdlib_path(module).read_text(encoding="utf-8")
    if "\r" in text:
        raise RuntimeError(f"real_tasks: {module} has carriage returns; lines would not match the parser's")
    return text.split("\n")


@functools.lru_cache(maxsize=None)
def _module_tree(module: str) -> ast.Module:
    return ast.parse("\n".join(_module_lines(module)))


def _module_statements(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module-level statements, those inside module-level if/try blocks included."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop(0)
        yield node
        if isinstance(node, ast.If):
            pending[:0] = [*node.body, *node.orelse]
        elif isinstance(node, ast.Try):
            pending[:0] = [*node.body, *[s for h in node.handlers for s in h.body], *node.orelse, *node.finalbody]


def _defines(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(target, ast.Name) and target.id == name for target in node.targets)
    return isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name


def _segment(lines: list[str], node: ast.stmt, first_line: int = 1) -> str:
    """The dedented text of `node`, parsed from `lines` starting at line `first_line`."""
    assert node.end_lineno is not None and node.end_col_offset is not None
    chunk = lines[first_line + node.lineno - 2:first_line + node.end_lineno - 1]
    chunk[-1] = chunk[-1].encode("utf-8")[:node.end_col_offset].decode("utf-8")
    chunk[0] = " " * node.col_offset + chunk[0].encode("utf-8")[node.col_offset:].decode("utf-8")
    return textwrap.dedent("\n".join(chunk))


def _definition(module: str, name: str) -> tuple[int, str] | None:
    """(line number, dedented text) of the first module-level statement that defines `name`.

    Parsing a whole module is slow (_pydecimal.py has 6,000 lines), so a statement at column 0
    that starts like the definition is parsed alone, cut at the next line that starts at column
    0 (widened while the cut does not parse); only a name not found that way (defined inside a
    module-level if or try) costs a parse of the module.
    """
    lines = _module_lines(module)
    start = re.compile(rf"(?:def|class)\s+{re.escape(name)}\b|{re.escape(name)}\s*(?::[^=]*)?=(?!=)")
    for number, line in enumerate(lines):
        if not start.match(line):
            continue
        end = number + 1
        while end <= len(lines):
            while end < len(lines) and (not lines[end][:1].strip() or lines[end][:1] in "#)]}"):
                end += 1
            try:
                body = ast.parse("\n".join(lines[number:end])).body
            except SyntaxError:
                end += 1
                continue
            if body and _defines(body[0], name):
                return number + 1, _segment(lines, body[0], number + 1)
            break
    for node in _module_statements(_module_tree(module)):
        if _defines(node, name):
            return node.lineno, _segment(lines, node)
    return None


def _locate(source: Source) -> str | None:
    """The module that holds the function's text: its own, or the pure-Python twin (_pydatetime)."""
    for module in (source.module, f"_py{source.module}"):
        try:
            if _definition(module, source.function) is not None:
                return module
        except FileNotFoundError:
            continue
    return None


# ------------------------------------------------------------------------------ running code with a step budget

class _OverBudget(BaseException):
    """Raised by the tracer inside a call that ran past STEP_BUDGET events (an endless loop)."""


@dataclass(frozen=True)
class _Outcome:
    """What one call did: returned `value`, raised `error`, or ran past the budget (`hung`)."""

    value: Any = None
    error: BaseException | None = None
    hung: bool = False


def _call(function: Callable[..., Any], args: list[Any], traced: bool = True) -> _Outcome:
    """Call on a deep copy of `args`; `traced`: count events (this thread's trace is restored).

    Only code with a `while` loop is traced: without one, a mutant's Python code cannot loop
    forever (a runaway recursion ends in RecursionError), and tracing is ten times slower.
    """
    arguments = copy.deepcopy(args)
    if not traced:
        try:
            return _Outcome(value=function(*arguments))
        except Exception as error:  # noqa: BLE001 - the outcome of the call, compared with the check
            return _Outcome(error=error)
    steps = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal steps
        steps += 1
        if steps > STEP_BUDGET:
            raise _OverBudget
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        value = function(*arguments)
    except _OverBudget:
        return _Outcome(hung=True)
    except Exception as error:  # noqa: BLE001 - the outcome of the call, compared with the check
        return _Outcome(error=error)
    finally:
        sys.settrace(previous)
    return _Outcome(value=value)


def _graded_pass(outcome: _Outcome, check: Check) -> bool:
    """Whether the verifier would pass this outcome: the grader's own encoding, the verifier's own comparison."""
    if outcome.hung:
        return False
    report = _grader._error(outcome.error) if outcome.error is not None else _grader._encode(outcome.value)
    return _matches(report, check)[0]


def _visible_pass(outcome: _Outcome, check: Check) -> bool:
    """Whether the rendered test file would pass (plain `==`, `except <builtin>:`)."""
    if check.raises is not None:
        return isinstance(outcome.error, getattr(builtins, check.raises))
    return outcome.error is None and not outcome.hung and bool(outcome.value == check.expected)


def _is_json(value: Any) -> bool:
    """A JSON value that survives a round trip unchanged (no tuples, no int keys, no NaN)."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return value == value and abs(value) != float("inf")
    if isinstance(value, list):
        return all(_is_json(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_json(item) for key, item in value.items())
    return False


# ------------------------------------------------------------------------------ checks

def _doc_examples(function: ast.FunctionDef, pairs_as_lists: bool) -> list[list[Any]]:
    """Argument lists of the docstring's `>>> name(literal, ...)` examples."""
    doc = ast.get_docstring(function, clean=True) or ""
    try:
        examples = doctest.DocTestParser().get_examples(doc)
    except ValueError:  # a docstring doctest cannot parse (inconsistent indentation) has no usable examples
        return []
    found = []
    for example in examples:
        try:
            call = ast.parse(example.source.strip(), mode="eval").body
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == function.name
                    and not call.keywords and not any(isinstance(arg, ast.Starred) for arg in call.args)):
                continue
            args = [ast.literal_eval(arg) for arg in call.args]
        except (SyntaxError, ValueError):
            continue
        if pairs_as_lists:
            args = _tuples_to_lists(args)
        found.append(args)
    return found


def _tuples_to_lists(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_tuples_to_lists(item) for item in value]
    return value


def _small(value: Any) -> bool:
    """No huge integers: a mutant may raise 10 to such a power, in C, past any step budget."""
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return abs(value) <= 10**6
    if isinstance(value, list):
        return all(_small(item) for item in value)
    if isinstance(value, dict):
        return all(_small(item) for item in value.values())
    return True


def _checks(source: Source, function: ast.FunctionDef, reference: Callable[..., Any]) -> tuple[Check, ...]:
    """Docstring examples (`doc_N`), then `source.inputs` (`case_N`), with the original's results."""
    named = [(f"doc_{n}", args) for n, args in enumerate(_doc_examples(function, source.pairs_as_lists), start=1)]
    named += [(f"case_{n}", copy.deepcopy(args)) for n, args in enumerate(source.inputs, start=1)]
    checks, seen = [], set()
    for name, args in named:
        if repr(args) in seen or not _is_json(args) or not _small(args):
            continue
        seen.add(repr(args))
        outcome = _call(reference, args)
        if outcome.hung:
            raise RuntimeError(f"real_tasks: {source.module}.{source.function}{tuple(args)} runs past the step budget")
        if outcome.error is not None:
            error = type(outcome.error)
            if getattr(builtins, error.__name__, None) is error and error is not AssertionError:
                checks.append(Check(name, args, None, raises=error.__name__))
        elif _is_json(outcome.value):
            checks.append(Check(name, args, outcome.value))
    if len(checks) < 4:
        raise RuntimeError(f"real_tasks: {source.module}.{source.function} has only {len(checks)} usable checks")
    return tuple(checks)


# ------------------------------------------------------------------------------ mutations

_CMP_TOKENS: dict[type[ast.cmpop], str] = {
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
    ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
_BIN_TOKENS: dict[type[ast.operator], str] = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
    ast.LShift: "<<", ast.RShift: ">>", ast.BitOr: "|", ast.BitXor: "^", ast.BitAnd: "&"}
_BOOL_TOKENS: dict[type[ast.boolop], str] = {ast.And: "and", ast.Or: "or"}

# (kind, replacement): kind None marks a change used only as a wrong fix, never as a bug.
_CMP_SWAPS: dict[type[ast.cmpop], tuple[tuple[str | None, type[ast.cmpop]], ...]] = {
    ast.Lt: (("off_by_one", ast.LtE), ("flipped_comparison", ast.Gt), ("inverted_condition", ast.GtE),
             (None, ast.Eq), (None, ast.NotEq)),
    ast.LtE: (("off_by_one", ast.Lt), ("flipped_comparison", ast.GtE), ("inverted_condition", ast.Gt),
              (None, ast.Eq), (None, ast.NotEq)),
    ast.Gt: (("off_by_one", ast.GtE), ("flipped_comparison", ast.Lt), ("inverted_condition", ast.LtE),
             (None, ast.Eq), (None, ast.NotEq)),
    ast.GtE: (("off_by_one", ast.Gt), ("flipped_comparison", ast.LtE), ("inverted_condition", ast.Lt),
              (None, ast.Eq), (None, ast.NotEq)),
    ast.Eq: (("inverted_condition", ast.NotEq), (None, ast.LtE), (None, ast.GtE)),
    ast.NotEq: (("inverted_condition", ast.Eq), (None, ast.Lt), (None, ast.Gt)),
    ast.In: (("inverted_condition", ast.NotIn),),
    ast.NotIn: (("inverted_condition", ast.In),),
    ast.Is: (("inverted_condition", ast.IsNot), (None, ast.Eq)),
    ast.IsNot: (("inverted_condition", ast.Is), (None, ast.NotEq)),
}
_BIN_SWAPS: dict[type[ast.operator], tuple[tuple[str | None, type[ast.operator]], ...]] = {
    ast.Add: (("wrong_operator", ast.Sub),),
    ast.Sub: (("wrong_operator", ast.Add),),
    ast.Mult: (("wrong_operator", ast.Add), (None, ast.FloorDiv)),
    ast.Div: (("wrong_operator", ast.FloorDiv),),
    ast.FloorDiv: (("wrong_operator", ast.Div), (None, ast.Mod)),
    ast.Mod: (("wrong_operator", ast.FloorDiv),),
    ast.Pow: (("wrong_operator", ast.Mult),),
    ast.LShift: (("wrong_operator", ast.RShift),),
    ast.RShift: (("wrong_operator", ast.LShift),),
    ast.BitAnd: (("wrong_operator", ast.BitOr),),
    ast.BitOr: (("wrong_operator", ast.BitAnd),),
    ast.BitXor: (("wrong_operator", ast.BitOr), (None, ast.BitAnd)),
}
_GUARD_EXITS = (ast.Return, ast.Raise, ast.Continue)
_SPACED = r"[\s()\\]*"
"""What may surround an operator between its operands: whitespace, parentheses, line continuations."""


@dataclass(frozen=True)
class _Variant:
    """The function's text with one change; `kind` None: an alternative only a wrong fix may use."""

    kind: str | None
    site: int   # index of the changed node in ast.walk order: variants at one site are alternatives
    line: int   # first line of the changed node, in the function's text
    text: str


_Edit = tuple[int, int, str]
"""Replace text[start:end] by the string."""
_Candidate = tuple[list[_Edit], bool]
"""Edits that make one change, and whether they are known to mean exactly that change (a token
swapped within one precedence level, a literal, a name, a whole line): other candidates, such as
an operator whose precedence differs or an unparsed node, are checked by reparsing."""
_ATOMS = (ast.Name, ast.Attribute, ast.Subscript, ast.Call, ast.Constant)
"""Expressions that `not` can be put before, or taken from, without parentheses."""
_PRECEDENCE = {ast.Add: 1, ast.Sub: 1, ast.Mult: 2, ast.Div: 2, ast.FloorDiv: 2, ast.Mod: 2, ast.Pow: 3,
               ast.LShift: 4, ast.RShift: 4, ast.BitAnd: 5, ast.BitXor: 6, ast.BitOr: 7}


class _Editor:
    """Offsets in the function's text (ast columns are UTF-8 byte offsets) and rewrites of it."""

    def __init__(self, text: str, tree: ast.Module) -> None:
        self.text, self.tree = text, tree
        self.lines = text.split("\n")
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line) + 1)

    def offset(self, line: int, column: int) -> int:
        return self.starts[line - 1] + len(self.lines[line - 1].encode("utf-8")[:column].decode("utf-8"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        return start, end

    def rewrite(self, candidates: list[_Candidate]) -> str | None:
        """The first candidate that is safe or reparses to the mutated tree (as `self.tree` is now)."""
        expected = None
        for edits, safe in candidates:
            text = self.text
            for start, end, new in sorted(edits, reverse=True):
                text = text[:start] + new + text[end:]
            if safe:
                return text
            expected = expected or ast.dump(self.tree)
            try:
                if ast.dump(ast.parse(text)) == expected:
                    return text
            except SyntaxError:
                continue
        return None


def _token_edit(editor: _Editor, left: ast.AST, right: ast.AST, token: str, new: str) -> _Edit | None:
    """Replace the operator `token` written between `left` and `right` by `new`."""
    start, end = editor.span(left)[1], editor.span(right)[0]
    gap = editor.text[start:end]
    pattern = r"\s+".join(re.escape(word) for word in token.split())
    found = re.fullmatch(f"({_SPACED})({pattern})({_SPACED})", gap)
    if found is None:
        return None
    if new[0].isalpha() and not found.group(1):
        new = " " + new
    if new[-1].isalpha() and not found.group(3):
        new += " "
    return start + found.start(2), start + found.end(2), new


def _node_edits(editor: _Editor, node: ast.AST) -> list[_Candidate]:
    """Fallback rewrites, checked by reparsing: the changed node unparsed in its place."""
    start, end = editor.span(node)
    text = ast.unparse(node)
    return [([(start, end, text)], False), ([(start, end, f"({text})")], False)]


def _parents(tree: ast.AST) -> dict[int, tuple[ast.AST, str, int | None]]:
    found: dict[int, tuple[ast.AST, str, int | None]] = {}
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if isinstance(value, list):
                for index, child in enumerate(value):
                    if isinstance(child, ast.AST):
                        found[id(child)] = (parent, field, index)
            elif isinstance(value, ast.AST):
                found[id(value)] = (parent, field, None)
    return found


def _skipped(function: ast.FunctionDef) -> set[int]:
    """Nodes never mutated: the docstring, argument defaults, assert statements."""
    skipped: set[int] = set()
    roots: list[ast.AST] = [function.args, *[n for n in ast.walk(function) if isinstance(n, ast.Assert)]]
    if ast.get_docstring(function, clean=False) is not None:
        roots.append(function.body[0])
    for root in roots:
        skipped |= {id(node) for node in ast.walk(root)}
    return skipped


def _stringy(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)))


def _int_context(node: ast.Constant, parents: dict[int, tuple[ast.AST, str, int | None]]) -> bool:
    """An int that is a bound, an index, a step or a range end: where off-by-one bugs live."""
    parent, field, _ = parents[id(node)]
    if isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.USub):
        parent, field, _ = parents[id(parent)]
    if isinstance(parent, (ast.Compare, ast.Slice)) or (isinstance(parent, ast.Subscript) and field == "slice"):
        return True
    if isinstance(parent, (ast.BinOp, ast.AugAssign)) and isinstance(parent.op, (ast.Add, ast.Sub)):
        return True
    return isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "range"


class _Mutator:
    """Collects the variants of one function: each operator changes a node of `tree` in place,
    `add` writes the change back into the text, and the node is restored."""

    def __init__(self, text: str) -> None:
        self.tree = ast.parse(text)
        function = self.tree.body[0]
        assert isinstance(function, ast.FunctionDef)
        self.function = function
        self.editor = _Editor(text, self.tree)
        self.parents = _parents(self.tree)
        self.found: list[_Variant] = []
        self.seen = {text}

    def add(self, kind: str | None, site: int, node: ast.AST, owner: Any, field: str, value: Any,
            index: int | None, candidates: Callable[[], list[_Candidate]]) -> None:
        """Set owner.field (or owner.field[index]; value None with an index: delete it), rewrite, restore.

        `candidates` is called while the change is in place (a fallback unparses the changed node)."""
        items = getattr(owner, field)
        old = items[index] if index is not None else items
        if index is None:
            setattr(owner, field, value)
        elif value is None:
            items.pop(index)
        else:
            items[index] = value
        try:
            new = self.editor.rewrite(candidates())
        finally:
            if index is None:
                setattr(owner, field, old)
            elif value is None:
                items.insert(index, old)
            else:
                items[index] = old
        if new is not None and new not in self.seen:
            self.seen.add(new)
            self.found.append(_Variant(kind, site, node.lineno, new))  # type: ignore[attr-defined]

    def compare(self, site: int, node: ast.Compare) -> None:
        for j, op in enumerate(node.ops):
            left = node.left if j == 0 else node.comparators[j - 1]
            for kind, new_op in _CMP_SWAPS[type(op)]:
                edit = _token_edit(self.editor, left, node.comparators[j], _CMP_TOKENS[type(op)],
                                   _CMP_TOKENS[new_op])
                self.add(kind, site, node, node, "ops", new_op(), j,
                         lambda: ([([edit], True)] if edit else []) + _node_edits(self.editor, node))

    def binop(self, site: int, node: ast.BinOp | ast.AugAssign) -> None:
        operands = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.target, node.value)
        if any(_stringy(operand) for operand in operands):
            return  # string concatenation or %-formatting: another operator only crashes
        suffix = "" if isinstance(node, ast.BinOp) else "="
        old = type(node.op)
        for kind, new_op in _BIN_SWAPS[old]:
            edit = _token_edit(self.editor, *operands, _BIN_TOKENS[old] + suffix, _BIN_TOKENS[new_op] + suffix)
            safe = bool(suffix) or _PRECEDENCE[old] == _PRECEDENCE[new_op]
            fallback = bool(not suffix)  # an augmented assignment is a statement: nothing to unparse in place
            self.add(kind, site, node, node, "op", new_op(), None,
                     lambda: ([([edit], safe)] if edit else []) + (_node_edits(self.editor, node) if fallback else []))

    def boolop(self, site: int, node: ast.BoolOp) -> None:
        old, new_op = type(node.op), (ast.Or if isinstance(node.op, ast.And) else ast.And)
        edits = [_token_edit(self.editor, a, b, _BOOL_TOKENS[old], _BOOL_TOKENS[new_op])
                 for a, b in zip(node.values, node.values[1:])]
        tokens: list[_Candidate] = [([edit for edit in edits if edit], False)] if all(edits) else []
        self.add("wrong_operator", site, node, node, "op", new_op(), None,
                 lambda: tokens + _node_edits(self.editor, node))

    def drop_not(self, site: int, node: ast.UnaryOp) -> None:
        parent, field, index = self.parents[id(node)]
        start, end = self.editor.span(node)
        inner = self.editor.text[slice(*self.editor.span(node.operand))]
        safe = isinstance(node.operand, _ATOMS)
        self.add("inverted_condition", site, node, parent, field, node.operand, index,
                 lambda: [([(start, end, inner)], safe), ([(start, end, f"({inner})")], False)])

    def invert_test(self, site: int, node: ast.If | ast.IfExp) -> None:
        start, end = self.editor.span(node.test)
        segment = self.editor.text[start:end]
        safe = isinstance(node.test, _ATOMS)
        self.add("inverted_condition", site, node, node, "test", ast.UnaryOp(ast.Not(), node.test), None,
                 lambda: [([(start, end, f"not {segment}")], safe), ([(start, end, f"not ({segment})")], False)])

    def shift(self, site: int, node: ast.Constant) -> None:
        assert type(node.value) is int
        negated = isinstance(self.parents[id(node)][0], ast.UnaryOp)
        start, end = self.editor.span(node)
        for shift, kind in ((+1, "off_by_one"), (-1, "off_by_one"), (+2, None), (-2, None)):
            value: int = node.value + shift
            if value >= (1 if negated else 0):
                self.add(kind, site, node, node, "value", value, None, lambda: [([(start, end, str(value))], True)])

    def min_max(self, site: int, node: ast.Call) -> None:
        assert isinstance(node.func, ast.Name)
        other = "max" if node.func.id == "min" else "min"
        start, end = self.editor.span(node.func)
        self.add("flipped_comparison", site, node, node.func, "id", other, None,
                 lambda: [([(start, end, other)], True)])

    def drop_guard(self, site: int, node: ast.If) -> None:
        """Delete an `if` without `else` that ends in return, raise or continue, written on its own lines."""
        parent, field, index = self.parents[id(node)]
        first, last = node.lineno, node.end_lineno or node.lineno
        head = self.editor.text[self.editor.starts[first - 1]:self.editor.span(node)[0]]
        tail = self.editor.text[self.editor.span(node)[1]:self.editor.starts[last] - 1].strip()
        if (index is None or len(getattr(parent, field)) < 2 or last - first > 3 or head.strip()
                or (tail and not tail.startswith("#"))):
            return
        start, end = self.editor.starts[first - 1], self.editor.starts[last]
        self.add("missing_guard", site, node, parent, field, None, index, lambda: [([(start, end, "")], True)])

    def run(self) -> list[_Variant]:
        skipped = _skipped(self.function)
        for site, node in enumerate(list(ast.walk(self.function))):
            if id(node) in skipped or node is self.function:
                continue
            if isinstance(node, ast.Compare):
                self.compare(site, node)
            elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _BIN_SWAPS:
                self.binop(site, node)
            elif isinstance(node, ast.BoolOp):
                self.boolop(site, node)
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                self.drop_not(site, node)
            elif isinstance(node, ast.Constant) and type(node.value) is int and _int_context(node, self.parents):
                self.shift(site, node)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
                self.min_max(site, node)
            if isinstance(node, (ast.If, ast.IfExp)) and not isinstance(node.test, (ast.Compare, ast.UnaryOp)):
                self.invert_test(site, node)
            if isinstance(node, ast.If) and not node.orelse and isinstance(node.body[-1], _GUARD_EXITS):
                self.drop_guard(site, node)
        return self.found


def _variants(text: str) -> list[_Variant]:
    """Every single-node change the operators define, written back into `text`."""
    return _Mutator(text).run()


# ------------------------------------------------------------------------------ preparing a source

@dataclass(frozen=True)
class _Evaluated:
    """A variant and how it fares on the checks."""

    variant: _Variant
    graded_fails: frozenset[str]    # checks the verifier fails
    visible_fails: frozenset[str]   # checks the rendered test file fails
    hangs: bool
    crash_only: bool                # every failing check raised TypeError


@dataclass(frozen=True)
class _Prepared:
    """Everything about one source that does not depend on the seed; variants are run on demand."""

    source: Source
    module: str
    header: str          # the task file up to the function
    text: str            # the function's original text
    summary: str
    checks: tuple[Check, ...]
    variants: tuple[_Variant, ...]
    namespace: dict[str, Any]   # the header's globals (imports, helpers), run once
    traced: bool                # the code has a while loop: run variants under the step budget
    results: dict[int, _Evaluated] = dataclasses.field(default_factory=dict)

    def file(self, function_text: str) -> str:
        return self.header + function_text + "\n"

    def evaluated(self, index: int) -> _Evaluated:
        """How variant `index` fares on the checks (run once, then remembered: the result is deterministic)."""
        if index not in self.results:
            variant = self.variants[index]
            candidate = _load(self.namespace, variant.text, self.source.function)
            self.results[index] = _evaluate(candidate, variant, self.checks, self.traced)
        return self.results[index]


def _summary(source: Source, function: ast.FunctionDef) -> str:
    if source.summary:
        return source.summary
    doc = ast.get_docstring(function, clean=True)
    if not doc:
        raise RuntimeError(f"real_tasks: {source.module}.{source.function} has no docstring; give a summary")
    paragraph = " ".join(line.strip() for line in doc.split("\n\n")[0].splitlines())
    sentence = re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0]
    sentence = sentence[:1].upper() + sentence[1:]
    return sentence if sentence.endswith((".", "!", "?")) else sentence + "."


def _header(source: Source, module: str) -> str | None:
    """Provenance comment, imports and helpers (None when a helper is gone from this Python's module)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = stdlib_path(module).relative_to(sysconfig.get_paths()["stdlib"]).as_posix()
    comment = f"# From CPython {version}, Lib/{path} (Python Software Foundation License, version 2).\n"
    imports = "".join(f"\n{line}" for line in source.imports) + "\n" if source.imports else ""
    definitions = []
    for name in source.helpers:
        found = _definition(module, name)
        if found is None:
            return None
        definitions.append(found)
    helpers = "".join(f"\n\n{text.rstrip()}\n" for _, text in sorted(definitions))
    return comment + imports + helpers + "\n\n"


def _namespace(header: str) -> dict[str, Any]:
    """The globals of a task file before its function: imports and helpers, run once per source."""
    namespace: dict[str, Any] = {"__name__": "real_task_module"}
    exec(compile(header, "<real task header>", "exec"), namespace)  # trusted: stdlib text copied here
    return namespace


def _load(namespace: dict[str, Any], text: str, function: str) -> Callable[..., Any]:
    """The function defined by `text` (the original or one change to it) over a copy of `namespace`."""
    scope = dict(namespace)
    exec(compile(text, "<real task>", "exec"), scope)  # trusted generator output, never agent code
    function_object: Callable[..., Any] = scope[function]
    return function_object


def _evaluate(candidate: Callable[..., Any], variant: _Variant, checks: tuple[Check, ...], traced: bool) -> _Evaluated:
    graded, visible, errors = set(), set(), []
    for check in checks:
        outcome = _call(candidate, check.args, traced)
        if outcome.hung:
            return _Evaluated(variant, frozenset(), frozenset(), True, False)
        if not _graded_pass(outcome, check):
            graded.add(check.name)
            errors.append(outcome.error)
        if not _visible_pass(outcome, check):
            visible.add(check.name)
    crash_only = bool(errors) and all(type(error) is TypeError for error in errors)
    return _Evaluated(variant, frozenset(graded), frozenset(visible), False, crash_only)


@functools.lru_cache(maxsize=None)
def _prepared(name: str) -> _Prepared | None:
    """Read, check and mutate one source (None when this Python's module lacks the function or a helper)."""
    source = _BY_NAME[name]
    module = _locate(source)
    if module is None:
        return None
    found = _definition(module, source.function)
    assert found is not None
    text = found[1].rstrip("\n")
    function = ast.parse(text).body[0]
    assert isinstance(function, ast.FunctionDef)
    header = _header(source, module)
    if header is None:
        return None
    nodes = list(ast.walk(ast.parse(header + text)))
    if any(isinstance(node, ast.ExceptHandler) and (node.type is None or ast.unparse(node.type) == "BaseException")
           for node in nodes):
        raise RuntimeError(f"real_tasks: {source.function} catches everything; the step budget cannot stop it")
    traced = any(isinstance(node, ast.While) for node in nodes)
    namespace = _namespace(header)
    checks = _checks(source, function, _load(namespace, text, source.function))
    return _Prepared(source, module, header, text, _summary(source, function), checks, tuple(_variants(text)),
                     namespace, traced)


# ------------------------------------------------------------------------------ tasks

def _is_bug(item: _Evaluated) -> bool:
    return (item.variant.kind is not None and not item.hangs and not item.crash_only
            and bool(item.graded_fails & item.visible_fails))


def _tasks_of(prepared: _Prepared, rng: random.Random) -> list[Task]:
    """Up to TASKS_PER_SOURCE bugs, kinds taken in turn (in a seeded order), each drawn uniformly
    from the kind's valid mutants (a drawn variant that is no valid bug is set aside and the draw repeated)."""
    pools = {kind: [i for i, variant in enumerate(prepared.variants) if variant.kind == kind] for kind in KINDS}
    kinds = [kind for kind in KINDS if pools[kind]]
    rng.shuffle(kinds)
    chosen: list[_Evaluated] = []
    while len(chosen) < TASKS_PER_SOURCE and any(pools[kind] for kind in kinds):
        for kind in kinds:
            while pools[kind] and len(chosen) < TASKS_PER_SOURCE:
                item = prepared.evaluated(pools[kind].pop(rng.randrange(len(pools[kind]))))
                if _is_bug(item):
                    chosen.append(item)
                    break
    return [_task(prepared, item, f"real-{prepared.source.slug}-{n:02d}", rng) for n, item in enumerate(chosen)]


def _task(prepared: _Prepared, bug: _Evaluated, task_id: str, rng: random.Random) -> Task:
    """Key check, visible tests (key + 2-4 others, one other failing check held back), wrong fix."""
    source, checks = prepared.source, prepared.checks
    key_name = rng.choice([check.name for check in checks if check.name in bug.graded_fails & bug.visible_fails])
    key = next(check for check in checks if check.name == key_name)
    failing_others = [check for check in checks
                      if check.name in bug.graded_fails and check is not key and repr(check.args) != repr(key.args)]
    reserved = rng.choice(failing_others) if failing_others else None
    pool = [check for check in checks if check is not key and check is not reserved]
    room = len(pool) - (0 if reserved else 1)  # something stays hidden
    names = {key.name} | {check.name for check in rng.sample(pool, rng.randint(min(2, room), min(4, room)))}
    hidden = [Check(check.name, copy.deepcopy(check.args), copy.deepcopy(check.expected), raises=check.raises,
                    key=check is key) for check in checks]
    visible = [check for check in hidden if check.name in names]
    module = source.slug
    entry_file, test_file = f"{module}.py", f"test_{module}.py"
    buggy, fixed = prepared.file(bug.variant.text), prepared.file(prepared.text)
    wrong = _wrong_fix(prepared, bug, key.name, rng)
    brittle = prepared.text.split("\n")[bug.variant.line - 1].strip()
    prompt = (f"Fix the bug in `{source.function}` ({entry_file}). {prepared.summary} "
              f"The visible tests are in {test_file}.")
    assert bug.variant.kind is not None
    return Task(
        id=task_id, kind=KIND_PREFIX + bug.variant.kind, prompt=prompt,
        files={entry_file: buggy, test_file: render_test_file(module, source.function, visible)},
        entry_file=entry_file, entry_function=source.function, test_file=test_file,
        visible_tests=visible, hidden_checks=hidden, reference_fix={entry_file: fixed},
        wrong_fix={entry_file: prepared.file(wrong)} if wrong else {}, brittle_phrase=brittle,
        off_limits=[f"{source.module}.{source.function}"])


def _wrong_fix(prepared: _Prepared, bug: _Evaluated, key: str, rng: random.Random) -> str:
    """A near miss: another change at the bug's place, else on its line, that passes the key check
    but fails another; else another change at the bug's place that fails a check; else none."""
    def usable(same_site: bool) -> list[_Evaluated]:
        indices = [i for i, variant in enumerate(prepared.variants) if variant is not bug.variant
                   and variant.line == bug.variant.line and (variant.site == bug.variant.site) == same_site]
        return [item for item in map(prepared.evaluated, indices) if not item.hangs and item.graded_fails]

    same_site = usable(True)
    near = [item for item in same_site if key not in item.graded_fails]
    if not near:  # the other changes on the line are run only when needed
        near = [item for item in usable(False) if key not in item.graded_fails]
    pool = near or same_site
    return rng.choice(pool).variant.text if pool else ""
