#!/usr/bin/env python3
"""fablize goal engine: "done" is refused until it is shown.

A task is split into stories (`create`). `next` activates one and prints the handoff a fresh
session needs; `checkpoint` completes it only with evidence; the final story is a verification
gate that needs the command that was run and its result, and the engine can run that command
itself (`--run`, frozen checks), so a claimed pass cannot be faked. Stories that fail come back
as a new round with what was missing; stories that cannot be done halt the plan until a human
decides.

Invariants, enforced in code and re-checked by `audit` on every event:
  1. a story is checkpointed only after `next` activated it;
  2. `complete` needs non-blank evidence;
  3. the final story completes only with verification: --verify-cmd and --verify-evidence, a
     witnessed run (--run), or all its frozen checks passing in a run made after its latest
     activation;
  4. the state persists under .fablize/, so `status` resumes a dead session.

Files (the state directory, normally .fablize/ at the repository root):
  goals.json    snapshot of the plan; rewritten atomically; derivable from the ledger
  ledger.jsonl  the source of truth: append-only, one event a line, hash-chained
  lock          the lock file, never renamed
  runs/         full output of verification runs the engine executed itself
  archive/      plans replaced by `create --force`, kept whole

This file is the core, read top to bottom: constants, helpers, the state model (pure
transitions, each with how `log` shows it), storage, the tools it runs (git), running checks,
rendering, audit, hooks, commands, the command line and `main`. A lone copy of it runs every
command the original had and every gate. What the original never had lives in rooms beside it
(`room()`): fablize_setup.py (setup, doctor, install-block), fablize_sharing.py (share, sync,
release, create --remote, audit --remote), fablize_merge.py (merge-driver, install-merge) and
fablize_trust.py (audit's --base/--since/--rerun and --require-* trust gates, decide --sign).
fablize.py starts this file with its bytecode cached.

Exit codes: 0 done, 1 refused, 2 usage, 3 damaged; 128 + N when signal N stopped a run.
Stdlib only, Python 3.9+.
"""

# Ctrl-C while the engine starts (its definitions, its imports) is kept, then raised where
# `main` answers it in one line — a traceback otherwise; the launcher keeps one from its own
# start the same way, in the list it hands over (STARTUP_INTERRUPT, set before this runs).
STARTUP_INTERRUPT = globals().get("STARTUP_INTERRUPT", [])
if __name__ in ("__main__", "fablize_engine"):  # a whole process, never an importer's
    import _signal
    _signal.signal(_signal.SIGINT, lambda signum, frame: STARTUP_INTERRUPT.append(signum))
    import sys
    if sys.version_info < (3, 9):  # one line, before anything an older Python cannot run
        sys.exit("fablize: needs Python 3.9 or newer, this is " + sys.version.split()[0])

import collections
import errno
import json
import os
import re
import stat
import sys
import time
from itertools import accumulate, compress, repeat
from operator import add, eq, itemgetter, methodcaller, sub

__version__ = "3.0.0"


# Constants ####################################################################################

SCHEMA_VERSION = 2          # of the --json envelope (2: `done` is a count everywhere)
ZERO_HASH = "0" * 64
STATE_DIRNAME = ".fablize"
SNAPSHOT = "goals.json"
LEDGER = "ledger.jsonl"
LOCK = "lock"
RUNS = "runs"
ARCHIVE = "archive"
SHARE = "share.json"        # marks a shared plan (the sharing room's record)
PIN = "pin.json"            # a shared plan's pin, committed for CI's --base (sync --pin)
LAUNCHER = "fablize.py"     # beside this file: starts it with its bytecode cached
EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_DAMAGED = 0, 1, 2, 3
EXIT_SIGNAL_BASE = 128      # interrupted by signal N: exit 128 + N, as a shell reports it

# Every status: its mark in `status`, its label in the plan map, its colour in `report`.
STATUS_TABLE = {
    "pending": ("·", "pending", "#eeeeee"),
    "in_progress": ("▶", "active", "#fff59d"),
    "complete": ("✓", "done", "#c8e6c9"),
    "failed": ("✗", "failed", "#ffcdd2"),
    "blocked": ("■", "blocked", "#ef9a9a"),
    "accepted": ("✓", "accepted", "#dcedc8"),
    "review": ("◇", "review", "#bbdefb"),
}
STATUSES = tuple(STATUS_TABLE)
MARKS = {status: row[0] for status, row in STATUS_TABLE.items()}
MAP_LABELS = {status: row[1] for status, row in STATUS_TABLE.items()}
DONE = ("complete", "accepted")
DECISIONS = ("accept", "retry", "amend")
VERDICTS = ("achieved", "not-achieved", "unachievable")
CHECKPOINT_STATUSES = ("complete", "failed", "blocked")
ORIGINAL_STATUSES = ("pending", "in_progress", "complete", "failed", "blocked")
TAIL_CHARS = 500            # carried evidence and run tails (seed 004)
MAP_WINDOW = 30             # plan-map lines around the current story (seed 004)
MAP_LOOKBACK = 10           # of which at most this many come before it
RESUME_MAP = (2, 7)         # a session start's map: lookback, window (it stays short)
RESUME_CARRIED = 2          # a session start's direct dependencies shown, the latest
RESUME_LISTED = 5           # a session start's failed, blocked or in-review stories listed
RESUME_TITLE = 80           # characters of a title a session start shows
RESUME_TAIL = 200           # characters of a dependency's evidence and output it shows
MAX_TEXT = 1 << 20          # one user-supplied text field, in UTF-8 bytes
DEFAULT_ROUNDS = 3
DEFAULT_RUN_TIMEOUT = 600.0
DEFAULT_LOCK_TIMEOUT = 10.0
DEFAULT_GUARD_MAX = 3       # Stop-hook blocks in a row before the guard lets go
READ_CHUNK = 1 << 16
HOOK_AGENTS = ("claude", "codex", "gemini", "cursor")  # the hook protocols the engine speaks
OBSERVED_KEEP = 20          # observed runs kept per story (the snapshot stays O(stories))
DUPLICATE_WINDOW = 60.0     # seconds: two guards fed the very same stop: one registration too many
REPORT_RUNS = 100           # the latest runs a report lists; the ledger holds the rest
PYTHON = "python" if os.name == "nt" else "python3"  # `python3` on Windows is the Store alias
STATE_GITIGNORE = """\
# written by fablize: the lock, temporary and torn-line files are never committed
lock
lock.owner
*.tmp-*
*.new
*.broken
*.bak
*.fablize-backup
runs/.*
"""
PLAN_EXISTS = "a plan already exists. Check it with `status`, or replace it with --force."


# Errors #######################################################################################


class FablizeError(Exception):
    """The one exception the engine raises on purpose: a message, a stable code, an exit code."""

    def __init__(self, message, code="refused", exit_code=EXIT_REFUSED):
        super().__init__(message)
        self.message = message
        self.code = code
        self.exit_code = exit_code


def refused(message, code="refused"):
    return FablizeError(message, code, EXIT_REFUSED)


def usage(message, code="usage"):
    return FablizeError(message, code, EXIT_USAGE)


def damaged(message, code="damaged"):
    return FablizeError(message, code, EXIT_DAMAGED)


def no_plan():
    """The original's refusal when there is no plan to work on: one wording, every command."""
    return refused("no plan — run `create` first.", "no_plan")


def forged(what):
    """A field no command of this engine would have written: the ledger was written by hand."""
    return damaged(what + " — not what fablize writes: the line was written or edited by hand.",
                   "bad_event")


# Small helpers ################################################################################


def sha256_hex(data):
    """SHA-256 as hex: the builtin module, or OpenSSL's on long inputs (several times faster;
    hashlib costs ~4 ms to import, which only a long input repays)."""
    if len(data) > 1 << 20:
        return fast_sha256()(data)
    return _sha256(data).hexdigest()


def _load_sha256():
    # hashlib pulls in OpenSSL (~4 ms per start); the builtin module is enough for SHA-256.
    for name in ("_sha2", "_sha256"):
        try:
            return __import__(name).sha256
        except ImportError:
            pass
    from hashlib import sha256
    return sha256
_sha256 = _load_sha256()


def openssl_sha256():
    """OpenSSL's SHA-256 constructor (several times faster on long inputs; hashlib costs ~4 ms
    to import, so only what reads a whole ledger or a large file uses it)."""
    from hashlib import sha256
    return sha256


def fast_sha256():
    """SHA-256 as hex, by OpenSSL (openssl_sha256)."""
    sha256 = openssl_sha256()
    return lambda data: sha256(data).hexdigest()


def now_iso():
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + ".%06d+00:00" % int(t % 1 * 1e6)


# one encoder, made once: json.dumps with options builds a new one at every call, and the
# snapshot encodes one story per line
dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def has_surrogate_escape(raw):
    # a one-character search runs on memchr: most state holds no backslash at all; where
    # backslashes are common (a run's tail holds \n), a search for `\u` by str.find costs ~0.85
    # ns a byte and the pattern ~0.3 (a ledger batch of 64 KiB: 55 → 19 µs), worth its compile
    # on a long text only
    if isinstance(raw, bytes):
        if b"\\" not in raw:
            return False
        if len(raw) > 4096:
            return regex(rb"\\u[dD]").search(raw) is not None
        return b"\\u" in raw and (b"\\ud" in raw or b"\\uD" in raw)
    if "\\" not in raw:
        return False
    if len(raw) > 4096:
        return regex(r"\\u[dD]").search(raw) is not None
    return "\\u" in raw and ("\\ud" in raw or "\\uD" in raw)


def load_json(raw, surrogates=None):
    """json.loads for state we did not just write: nesting too deep for the parser and lone
    surrogates (which no UTF-8 file or terminal can hold) are ValueErrors like any bad JSON.
    `surrogates=False` says the caller already knows `raw` has no \\ud… escape."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply")
    if surrogates if surrogates is not None else has_surrogate_escape(raw):
        try:
            dumps(value).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a lone surrogate (\\ud800–\\udfff) in a string")
        except RecursionError:
            raise ValueError("nested too deeply")
    return value


class Lazy(dict):
    """The one lazy idiom of this file: a table whose value for a key is made on first use and
    kept (bottle's lazy_attribute, as a dict). What most starts never need — a compiled pattern
    or spec, unicodedata's view of a character — then costs them nothing."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        value = self[key] = self.make(key)
        return value


# Characters that show nothing: blank-looking symbols (braille blank, Hangul fillers, variation
# selectors, …) and the format characters (Unicode Cf). Evidence made only of them is blank,
# and a marker with them between its words is still a marker.
_BLANKISH = frozenset([0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x2800, 0x3164, 0xFFA0, 0x1D159,
                       *range(0x180B, 0x1810), *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)])


def _invisible_as_space(c):
    import unicodedata  # only once non-ASCII text needs it
    return " " if c in _BLANKISH or unicodedata.category(chr(c)) == "Cf" else c


# str.translate table turning each invisible character into a space
_INVISIBLE = Lazy(_invisible_as_space)

# compiled regular expressions, by (pattern, flags): compiling one costs ~0.2 ms, and most starts
# need none of them
_REGEX = Lazy(lambda key: re.compile(*key))


def regex(pattern, flags=0):
    return _REGEX[pattern, flags]


def blank(text):
    if not (text and text.strip()):
        return True
    if text.isascii():  # the common case: no per-character work
        return False
    return not text.translate(_INVISIBLE).strip()


def last_chars(text, n=TAIL_CHARS):
    text = text or ""
    return text if len(text) <= n else "…" + text[-n:]


def short(text, n):
    """The first `n` characters of `text`, and … when there were more."""
    text = text or ""
    return text if len(text) <= n else text[:n] + "…"


def _escape_table(keep):
    table = {c: "\\x%02x" % c for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]
             if chr(c) not in keep}
    # bidi overrides and line separators can reorder or break what a terminal shows
    for c in (0x200E, 0x200F, 0x2028, 0x2029, 0x202A, 0x202B, 0x202C, 0x202D, 0x202E,
              0x2066, 0x2067, 0x2068, 0x2069, 0xFEFF):
        table[c] = "\\u%04x" % c
    return table


_ESCAPE_TEXT = _escape_table("\n\t")
_ESCAPE_LINE = _escape_table("")
# json.dumps escapes C0 itself; DEL, C1 and bidi controls become \uXXXX (still valid JSON)
_ESCAPE_JSON = {c: "\\u%04x" % c for c in _ESCAPE_LINE if c >= 0x7F}


def json_text(obj):
    """One JSON document for a terminal: no raw control character in it."""
    return json.dumps(obj, ensure_ascii=False).translate(_ESCAPE_JSON)


def clean(text):
    """Text safe for a terminal: control characters shown escaped, newlines and tabs kept."""
    text = str(text)
    # every character the tables escape is unprintable to str.isprintable (a pass in C, where
    # translate looks each character up): most text holds none, and what a status of 100,000
    # stories prints is cleaned in 5 ms, not 200
    if text.isprintable() or text.replace("\n", "").replace("\t", "").isprintable():
        return text
    return text.translate(_ESCAPE_TEXT)


def one_line(text):
    """Text safe inside one line of output: newlines escaped too, so it cannot forge a row."""
    text = str(text)
    return text if text.isprintable() else text.translate(_ESCAPE_LINE)


def indent(text, prefix="    "):
    return "\n".join(prefix + line for line in text.split("\n"))


def quote_arg(text):
    """A word for a printed command line, quoted for a POSIX shell when it needs to be."""
    text = one_line(text)
    if re.fullmatch(r"[\w./:@%+=,-]+", text, re.A):
        return text
    return "'" + text.replace("'", "'\\''") + "'"


# The engine's own markers, as (pattern, flags, replacement): text carried into a handoff must
# not pass for one. Compiled on first use, since most text names no marker word (each holds
# one of "fablize", "stories", "checkpoint": has_marker_word).
_MARKERS = (
    (r"=+\s*fablize\s+handoff\b(\s*[—-]+\s*[Gg][0-9]+\b)?", re.I, "[quoted fablize-handoff]"),
    (r"all\s+stories\s+(complete|done)", re.I, r"all-stories-\1"),
    (r"\bcheckpoint\s+--id\b(\s+\S+)?", re.I, "checkpoint-(quoted)"),
    (r"^(\s*)fablize:", re.I | re.M, r"\1fablize-quoted:"),
)
# the same markers when an escaped control (\u202e …) stands between the words (wide)
_GAP = r"(?:\s|\\u[0-9a-fA-F]{4})"
_COMPILED_MARKERS = Lazy(lambda wide: [
    (regex(p.replace(r"\s*", _GAP + "*").replace(r"\s+", _GAP + "+") if wide else p, flags), r)
    for p, flags, r in _MARKERS])


def defused_line(text):
    """A title, objective or brief on one line of output: escaped, and unable to pass for an
    engine marker."""
    return defuse(one_line(text))


def has_marker_word(text):
    lowered = text.lower()
    return "fablize" in lowered or "stories" in lowered or "checkpoint" in lowered


def defuse(text):
    """Carried text cannot pass for engine output: markers are rewritten into hyphenated
    forms that a scanner (even one reading a whitespace-stripped view) does not accept."""
    text = clean(text)
    wide = not text.isascii() or "\\u" in text
    if not text.isascii():
        # invisible characters between a marker's words must not hide it: read the text with
        # them as spaces, a view used only when it shows a marker (emoji joiners stay intact)
        bare = text.translate(_INVISIBLE)
        if (bare != text and has_marker_word(bare) and
                any(p.search(bare) for p, _ in _COMPILED_MARKERS[True])):
            text = bare
    if has_marker_word(text):  # the cheap test first: most text names no marker word
        for pattern, replacement in _COMPILED_MARKERS[wide]:
            text = pattern.sub(replacement, text)
    return text


def limit_text(name, text):
    if text is not None and len(text) > MAX_TEXT // 4 and len(text.encode("utf-8")) > MAX_TEXT:
        raise usage(f"{name} is {len(text.encode('utf-8')):,} bytes; the limit is {MAX_TEXT:,} — "
                    "cite a file or a digest instead of pasting it.", "too_large")
    return text


def fix_argv_text(text):
    # undecodable bytes in argv arrive as lone surrogates, which UTF-8 cannot store
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate no byte decoded to (a Windows argv)
            raw = text.encode("utf-8", "surrogatepass")
        return raw.decode("utf-8", "replace")


def split_assignment(option, value):
    """`G002=pytest -q` -> ("G002", "pytest -q")."""
    sid, sep, rest = value.partition("=")
    if not sep or not sid.strip():
        raise usage(f"{option} format is 'ID=VALUE' — invalid: {one_line(value)}")
    return normalize_id(sid), rest


# A story's id, G001, G002, … in order; a plan's id names its archive folder and its shared ref.
STORY_ID = r"G[0-9]{3,}"
PLAN_ID = r"[A-Za-z0-9][\w.-]*"


def story_id(number):
    return f"G{number:03d}"


def normalize_id(text):
    """`g1`, `G01`, ` g001 ` -> G001, the one spelling the plan uses; other text comes back
    stripped and upper-cased, for the caller to refuse."""
    text = text.strip()
    found = re.fullmatch(r"[Gg]0*([0-9]+)", text, re.A)
    return story_id(int(found.group(1))) if found else text.upper()


def id_arg(text):
    """argparse `type=` of every option that names one story."""
    sid = normalize_id(fix_argv_text(text))
    if not re.fullmatch(STORY_ID, sid, re.A):
        raise usage(f"{one_line(text)} is not a story id — ids look like G001, G002, … "
                    "(`status` lists them).", "bad_id")
    return sid


def parse_ids(text, option):
    ids = [normalize_id(part) for part in text.split(",") if part.strip()]
    for sid in ids:
        if not re.fullmatch(STORY_ID, sid, re.A):
            raise usage(f"{option}: {one_line(sid)} is not a story id (G001, G002, …).", "bad_id")
    return ids


def scope_pattern(text):
    """A path the plan's work may change (`create --scope`), as the plan records it: relative to
    the repository, `/`-separated, a literal path, a directory (its files) or a glob (`*`, `?`,
    `**` across folders); usage error for anything else."""
    if type(text) is not str:
        raise usage("--scope takes a path of the repository.", "bad_scope")
    path = text.strip().replace("\\", "/")
    while path.startswith("./"):
        path = path[2:]
    if (not path or "\x00" in path or path.startswith("/") or re.match(r"[A-Za-z]:", path) or
            ".." in path.split("/")):
        raise usage(f"--scope {one_line(text)!r}: a path of the repository, relative to its top "
                    "(a file, a folder or a glob like src/** or *.py).", "bad_scope")
    return path.rstrip("/") + ("/" if path.endswith("/") else "")


def is_plan_id(text):
    return type(text) is str and bool(re.fullmatch(PLAN_ID, text, re.A)) and ".." not in text


def new_plan_id():
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + os.urandom(3).hex()


def count_noun(n, noun):
    """`1 event`, `2 events`, `1 story`, `3 stories`: a count and its noun, never `event(s)`."""
    if n == 1:
        return f"1 {noun}"
    return (f"{n} {noun[:-1]}ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else
        f"{n} {noun}s")


def count_stories(n):
    return count_noun(n, "story")


def time_label(ts):
    """A ledger time for people: `2026-12-01 08:12:50 UTC` (the ledger writes UTC)."""
    ts = str(ts or "")
    zone = ts[26:] if len(ts) > 26 else ""
    zone = "UTC" if zone in ("+00:00", "Z", "") and ts else zone
    return f"{ts[:19].replace('T', ' ')} {zone}".strip()


# State model: pure transitions, no I/O ########################################################
# The shapes of state read back from disk: a hand-crafted goals.json (even with a recomputed
# digest) or a chained but forged ledger line must be exit 3, never a traceback three commands
# later. A spec is a type, a tuple of alternatives, [item spec] or {key: spec}; in a dict spec
# a key ending in "?" may be absent, and a key the spec does not name is never allowed.
_N = type(None)
TEXT = (str, _N)
_COMPILED = {}


def _compile(spec):
    """The spec in the form misfit walks: type sets tested inline, only nested specs recurse.
    Compiled on first use and kept (a command compiles only the specs it checks)."""
    found = _COMPILED.get(id(spec))
    if found is not None:
        return found[0]
    if type(spec) is type:
        c = ("t", frozenset((spec,)))
    elif type(spec) is tuple and all(type(x) is type for x in spec):
        c = ("t", frozenset(spec))
    elif type(spec) is tuple:
        c = ("a", tuple(_compile(x) for x in spec))
    elif type(spec) is list:
        c = ("l", _compile(spec[0]))
    elif list(spec) == ["*"]:
        c = ("m", _compile(spec["*"]))
    else:
        required, allowed, plain, nested = set(), set(), [], []
        for key, sub in spec.items():
            optional = key.endswith("?")
            key = key.rstrip("?")
            allowed.add(key)
            if not optional:
                required.add(key)
            sub_c = _compile(sub)
            none_ok = optional or (sub_c[0] == "a" and ("t", frozenset((_N,))) in sub_c[1])
            if sub_c[0] == "t":
                plain.append((key, sub_c[1] | {_N} if optional else sub_c[1]))
            else:
                if sub_c[0] == "a":  # (dict-or-list spec, None): None is tested inline
                    rest = tuple(x for x in sub_c[1] if x != ("t", frozenset((_N,))))
                    sub_c = rest[0] if len(rest) == 1 else ("a", rest)
                nested.append((key, sub_c, none_ok))
        c = ("d", frozenset(required), frozenset(allowed), tuple(plain), tuple(nested))
    _COMPILED[id(spec)] = (c, spec)  # the spec is kept alive so its id is never reused
    return c


def misfit(value, spec):
    """Where `value` does not fit `spec` (a path like .goals[2].runs[0].cmd, "." for the value
    itself), or None."""
    found = _misfit(value, _compile(spec))
    return None if found is None else found or "."


def _misfit(value, c):
    """None when `value` fits, else the path below it that does not ("" for itself). Paths are
    built on the way back from a misfit, so a value that fits costs no string."""
    kind = c[0]
    if kind == "t":
        return None if type(value) in c[1] else ""
    if kind == "d":
        if type(value) is not dict:
            return ""
        # the keys in their order and the types of their values: a long list of dicts of one
        # shape (a plan's stories) checks the keys and the plain fields once per shape
        get = value.get
        keys = value.keys()
        if not (keys >= c[1] and keys <= c[2]):
            odd = sorted(c[1] - keys) or sorted(k for k in keys if k not in c[2])
            return "." + one_line(str(odd[0]))[:60]
        for key, types in c[3]:
            if type(get(key)) not in types:
                return "." + key
        for key, sub, none_ok in c[4]:
            item = get(key)
            if (item is None and none_ok) or (item == [] and sub[0] == "l"):
                continue
            found = _misfit(item, sub)
            if found is not None:
                return f".{key}{found}"
        return None
    if kind == "l":
        if type(value) is not list:
            return ""
        sub = c[1]
        if sub[0] == "t":
            types = sub[1]
            if set(map(type, value)) <= types:  # one pass in C for a long list of strings
                return None
            for i, item in enumerate(value):
                if type(item) not in types:
                    return f"[{i}]"
        for i, item in enumerate(value):
            found = _misfit(item, sub)
            if found is not None:
                return f"[{i}]{found}"
        return None
    if kind == "m":
        if type(value) is not dict:
            return ""
        for key, item in value.items():
            if type(key) is not str:
                return "." + one_line(str(key))[:60]
            found = _misfit(item, c[1])
            if found is not None:
                return f".{one_line(key)[:60]}{found}"
        return None
    for alt in c[1]:
        if _misfit(value, alt) is None:
            return None
    return ""


# A run as the snapshot keeps it: the latest run of each frozen check (or --run command) in the
# story's current round, which is all the gates read; every other run lives only in the ledger.
RUN_SPEC = {"seq": int, "check": (int, _N), "cmd": str, "exit_code": (int, _N), "signal": TEXT,
            "timed_out": bool, "error": TEXT, "duration_s": (int, float, _N), "bytes": (int, _N),
            "sha256": TEXT, "tail": TEXT, "log": TEXT, "ok": bool, "interrupted?": TEXT}


# a run's own fields, as its verify_run event carries them (`interrupted` only when it was)
RUN_FIELDS = tuple(k for k in RUN_SPEC if k not in ("ok", "interrupted?"))
NOTE_SPEC = {"note": str, "seq": int, "ts": str}
FEEDBACK_SPEC = {"source": str, "round": int, "text": TEXT,
                 "runs": [{"cmd": str, "exit": str, "tail": TEXT}]}


# A story's fields, (spec, default) each: new stories, the snapshot's shape, touch() and the
# --json story all come from this one table. The original's fields (BASE_FIELDS) are always
# held; every other one only while it differs from its default, so a story nobody touched is
# its text and its dependencies, in the snapshot and in memory.
STORY_FIELDS = {
    "id": (str, None), "title": (str, None), "objective": (str, None),
    "status": (str, "pending"), "evidence": (TEXT, None),
    "after": ([str], []), "checks": ([str], []), "accept": ([str], []), "judge": (bool, False),
    "round": (int, 0), "round_base": (int, 0), "grade": (TEXT, None),
    "agent": (TEXT, None), "executor": (TEXT, None),
    "started_seq": ((int, _N), None), "started_ts": (TEXT, None),
    "verify_cmd": (TEXT, None), "verify_evidence": (TEXT, None),
    "runs": ([RUN_SPEC], []), "last_run": ((RUN_SPEC, _N), None),
    "feedback": ((FEEDBACK_SPEC, _N), None), "amendments": ([NOTE_SPEC], []),
    "decision": (({"decision": str, "note": str, "seq": int, "ts": str, "signer?": str}, _N),
                 None),
    "blocked_reason": (TEXT, None),
    "judged_by": (({"agent": str, "verdict": str, "seq": int}, _N), None),
    # what the harness reported of the agent's own verification commands (observe), latest last
    "observed": ([{"seq": int, "ts": str, "round": int, "cmd": str, "exit_code": (int, _N),
                   "ok": (bool, _N), "tool": TEXT, "detail": TEXT}], []),
    # the working tree the judge was shown (judge-packet): a verdict after it changed is void
    "packet": (({"tree": str, "files": (int, _N), "round": int, "seq": int}, _N), None),
}
BASE_FIELDS = ("id", "title", "objective", "status", "evidence")  # the original's
DEFAULTS = {key: default for key, (_, default) in STORY_FIELDS.items()}
STORY_SPEC = {key if key in BASE_FIELDS else key + "?": spec
              for key, (spec, _) in STORY_FIELDS.items()}
# what every plan-wide scan reads of every story, checked for all of them at every load
_PRISTINE = frozenset(BASE_FIELDS + ("after",))  # the fields of a story nobody touched
# a story as create, add and an import write it into their event
STORY_EVENT_SPEC = {"id": str, "title": str, "objective": str, "after": [str], "checks?": [str],
                    "accept?": [str], "judge?": bool, "status?": str, "evidence?": TEXT}
UNVERIFIABLE_SPEC = [{"id": str, "check": int, "cmd": str, "reason": str}]


# the Stop guard's count, which registration of it counted the last stop, and a human's pause
GUARD_SPEC = {"blocks": int, "hook?": TEXT, "hook_ts?": TEXT,
              "paused?": ({"seq": int, "ts": str, "note": TEXT}, _N)}
REPLACES_SPEC = {"plan_id": str, "head": TEXT, "seq": (int, _N), "path": str}
PLAN_HEAD_SPEC = {"schema_version": int, "digest?": str, "plan_id": str, "brief": str,
                  "created": str, "scope?": [str], "options": {"rounds": int, "require_run": bool},
                  "unverifiable": UNVERIFIABLE_SPEC, "replaces": (REPLACES_SPEC, _N),
                  "guard": GUARD_SPEC, "ledger": {"seq": int, "head": str}}
PLAN_SPEC = dict(PLAN_HEAD_SPEC, goals=[STORY_SPEC])
ORIGINAL_SPEC = {"brief": str, "created?": TEXT, "goals": [{"id": str, "title": str,
                                                              "objective": str, "status": str,
                                                              "evidence?": TEXT}]}


# where and with what a witnessed run ran (run_provenance): a hint for the reviewer
PROVENANCE_SPEC = {"dir": TEXT, "program": TEXT, "program_sha256": TEXT, "env": {"*": TEXT}}


def new_story(spec):
    """A story with every field, as `create` and `add` make it (lists of its own)."""
    story = {key: list(value) if type(value) is list else value for key, value in DEFAULTS.items()}
    for key, value in spec.items():
        story[key] = list(value) if type(value) is list else value
    return story


def touch(story):
    """`story` with every field, checked: a story read from the snapshot holds only the fields
    that differ from their defaults (STORY_FIELDS), so a command checks and fills in only the
    stories it touches. A story of a snapshot written before stories kept a grade gets the one
    its fields show. Raises exit 3 for a story that is not one (a hand-made snapshot)."""
    if len(story) < len(DEFAULTS):
        where = misfit(story, STORY_SPEC)
        if where is not None:
            raise damaged(f"{SNAPSHOT}: not a fablize snapshot (story {one_line(story['id'])}"
                          f"{where} is missing, unexpected or of the wrong type) — run `audit`.",
                          "bad_snapshot")
        for key, value in DEFAULTS.items():
            if key not in story and key != "grade":
                story[key] = list(value) if type(value) is list else value
        if "grade" not in story:
            story["grade"] = derived_grade(story)
    return story


def compact(story):
    """`story` as the snapshot holds it, in STORY_FIELDS' order whatever order its fields were
    set in: the original's fields, and every other field only while it differs from its
    default (every default is falsy, so a truthy value always differs)."""
    if len(story) <= len(BASE_FIELDS) + 1:
        return story  # the common shape, in order: its text and its dependencies
    return {k: story[k] for k, d in DEFAULTS.items()
            if k in story and (story[k] or story[k] != d or k in BASE_FIELDS)}


def lookup(plan, sid):
    """The story `sid` as the plan holds it (untouched), or None."""
    goals = plan["goals"]
    try:  # G007 is the 7th story; one added later sits one place back, before the final one,
        # which is last: three tries, not a pass over the plan for each event of those stories
        n = int(sid[1:])
        for story in (goals[n - 1] if n <= len(goals) else None, goals[n - 2], goals[-1]):
            if story is not None and story["id"] == sid:
                return story
    except (ValueError, TypeError, IndexError):
        pass
    return next((story for story in goals if story["id"] == sid), None)


def find_story(plan, sid):
    """The story `sid`, touched; refused when the plan has none."""
    story = lookup(plan, sid)
    if story is None:
        raise refused(f"{one_line(sid)} not found. {plan_ids(plan)}", "not_found")
    return touch(story)


def plan_ids(plan):
    """The plan's story ids, as a refusal lists them: all of them, or their range."""
    ids = [s["id"] for s in plan["goals"]]
    if len(ids) <= 8:
        return "The plan's stories: " + ", ".join(ids) + "."
    return f"The plan's stories: {ids[0]}–{ids[-1]} ({len(ids)})."


def is_final(plan, story):
    return plan["goals"][-1]["id"] == story["id"]


def waits_for(plan, story):
    """The direct dependencies of `story` that are not done yet."""
    after = story.get("after", ())
    if not after:
        return []
    if len(after) > 8:  # the final story: one pass over the plan, not a lookup a dependency
        done = done_ids(plan)
        return [d for d in after if d not in done]
    return [d for d in after if lookup(plan, d)["status"] not in DONE]


def done_ids(plan):
    return {s["id"] for s in plan["goals"] if s["status"] in DONE}


def ready_stories(plan):
    """The stories `next` may activate: pending or failed, every dependency done."""
    done = done_ids(plan)
    return [s for s in plan["goals"]
            if s["status"] in ("pending", "failed") and done.issuperset(s.get("after", ()))]


def pick_ready(plan):
    """The story `next` would activate, touched: reopened stories first (failed, or pending
    with a round behind them), then plan order."""
    goals, done = plan["goals"], done_ids(plan)
    # most plans have no reopened story: two passes in C tell, and the first ready story is then
    # near the front (a plan of 100,000 stories picks in 15 ms, not 65)
    reopened = ("failed" in map(itemgetter("status"), goals) or
        any(map(methodcaller("get", "round", 0), goals)))
    first = None
    for story in goals:
        status = story["status"]
        if status in ("pending", "failed") and done.issuperset(story.get("after", ())):
            if not reopened or status == "failed" or story.get("round", 0) > 0:
                return touch(story)
            if first is None:
                first = story
    return first and touch(first)


def stories_in(plan, status):
    """The stories of one status, touched (a few: in progress, blocked, in review)."""
    return [touch(s) for s in plan["goals"] if s["status"] == status]


# Which stories are in progress, known without a pass over the plan: a replay starts stories
# thousands of times, and each start asks it (one story at a time; one an agent). A pass each
# time made the replay quadratic in the stories (rebuild of a 10,000-story plan worked as agents
# work it, 100,000 events, bench.py section 4: 7.8 → 1.4 s CPU). Held for the one plan last
# asked about (its list of stories, by identity): the ids that may be in progress. Every story in
# progress is among them — a story starts only in _ev_story_started, which adds its id, and a
# plan read or made anew is a new list, scanned once — and an id whose story has since moved on
# is dropped when read.
_IN_PROGRESS = [None, set()]


def active_stories(plan):
    """The stories in progress, touched, in plan order: the order of their numbers (an added
    story sits after the others but before the final story, which starts only when every other
    is done)."""
    goals = plan["goals"]
    if _IN_PROGRESS[0] is not goals:
        _IN_PROGRESS[:] = [goals, {s["id"] for s in goals if s["status"] == "in_progress"}]
    ids = _IN_PROGRESS[1]
    active = [s for s in map(lookup, repeat(plan), ids)
              if s is not None and s["status"] == "in_progress"]
    if len(active) < len(ids):
        ids.intersection_update(s["id"] for s in active)
    if len(active) > 1:
        active.sort(key=lambda s: int(s["id"][1:]))
    return [touch(s) for s in active]


def story_in_progress(plan, story):
    """Note that `story` of `plan` has just started (see active_stories)."""
    if _IN_PROGRESS[0] is plan["goals"]:
        _IN_PROGRESS[1].add(story["id"])


def plan_done(plan):
    return all(s["status"] in DONE for s in plan["goals"])


def done_count(plan):
    return sum(1 for s in plan["goals"] if s["status"] in DONE)


def accepted_ids(plan):
    """The stories a human accepted instead of their completion (a decision, not evidence)."""
    return [s["id"] for s in plan["goals"] if s["status"] == "accepted"]


def blocked_because(story):
    """Why a blocked story is: the judge's or the rounds' reason, else its checkpoint's evidence
    (held once, as the story's evidence)."""
    return story["blocked_reason"] or story["evidence"] or "no reason given"


def rounds_left(plan, story):
    return plan["options"]["rounds"] - (story["round"] - story["round_base"])


def round_label(plan, story):
    """`round 2 of 3`; after a human's decision, counted from it: `round 4 (1 of 3 since a
    human's decision)`."""
    rounds = plan["options"]["rounds"]
    if not story["round_base"]:
        return f"round {story['round']} of {rounds}"
    return (f"round {story['round']} ({story['round'] - story['round_base']} of {rounds} "
            "since a human's decision)")


# why a story came back, by who sent it back (its feedback's source)
REOPENED_BECAUSE = {"checkpoint": "the earlier attempt did not achieve the objective",
                    "judge": "the judge found the objective not achieved",
                    "retry": "a human asked for another attempt",
                    "amend": "a human amended the objective (above)"}


def validate_graph(stories):
    """Unknown ids and cycles in `after` are refused; returns nothing. A walk with a stack of its
    own, not a recursion: a chain of thousands of stories is a plan, not a crash."""
    deps = {s["id"]: s.get("after", ()) for s in stories}
    for sid, after in deps.items():
        for dep in after:
            if dep not in deps:
                raise usage(f"{sid} depends on {one_line(dep)}, which is not in the plan.",
                            "unknown_dependency")
    done = set()
    for first in deps:
        if first in done:
            continue
        path, walks, on_path = [first], [iter(deps[first])], {first}
        while walks:
            dep = next(walks[-1], None)
            if dep is None:  # every dependency of the story at the path's end is done
                done.add(path[-1])
                on_path.discard(path.pop())
                walks.pop()
            elif dep in on_path:
                cycle = path[path.index(dep):] + [dep]
                raise usage("dependency cycle: " + " → ".join(cycle), "dependency_cycle")
            elif dep not in done:
                path.append(dep)
                on_path.add(dep)
                walks.append(iter(deps[dep]))


def run_key(run):
    return run["cmd"] if run["check"] is None else run["check"]


def latest_run(story, check=None, cmd=None):
    """This round's latest run of a frozen check (by index) or of a --run command."""
    key = cmd if check is None else check
    for run in story["runs"]:
        if run_key(run) == key:
            return run
    return None


def run_passed(run):
    return (run.get("exit_code") == 0 and not run.get("timed_out") and not run.get("error")
        and not run.get("interrupted"))


def describe_exit(run):
    return one_line(exit_words(run))


def exit_words(run):
    """How a run ended, its fields as they are: describe_exit escapes them, and so does
    format_event, a whole line at once."""
    if run.get("interrupted"):
        return f"interrupted by {run['interrupted']}"
    if run.get("error"):
        return ("did not start: " if run.get("exit_code") is None else "") + str(run["error"])
    if run.get("timed_out"):
        return f"timed out after {run.get('duration_s')} s"
    if run.get("signal"):
        return f"killed by {run['signal']}"
    return f"exit {run.get('exit_code')}"


def derived_grade(story):
    """The grade of a story in a snapshot written before stories kept one: what its completion
    rested on, read from what it holds."""
    if story["status"] == "accepted":
        return "accepted"
    if story["status"] not in ("complete", "review"):
        return None
    witnessed = story["checks"] or any(r["ok"] and r["check"] is None and
                                       r["cmd"] == story["verify_cmd"] for r in story["runs"])
    return "witnessed" if witnessed else "claimed"


GRADE_WORDS = {"witnessed": "witnessed (the engine ran the checks)",
               "claimed": "claimed (on the agent's word)", "accepted": "accepted by a human"}


def grade_detail(story):
    grade = story["grade"]
    if grade is None:
        return None
    if grade == "accepted" and story["decision"]:
        decision = story["decision"]
        return ("accepted by a human" + (f" (signed by {one_line(decision['signer'])})"
                                         if decision.get("signer") else " (unsigned)")
                + ": " + one_line(last_chars(decision["note"], 200)))
    judged = story["judged_by"]
    return GRADE_WORDS.get(grade, one_line(grade)) + (
        f"; judged {one_line(judged['verdict'])} by {one_line(judged['agent'])}"
        if judged and story["status"] == "complete" else "")


def round_failures(story):
    """This round's failed runs, newest last, one per check or command (the latest run of each)."""
    latest = {}
    for run in story["runs"] if story["status"] == "in_progress" else []:
        latest[(run["check"], run["cmd"] if run["check"] is None else None)] = run
    return [r for r in latest.values() if not r["ok"]]


def guard_paused(plan):
    return plan["guard"].get("paused") if isinstance(plan["guard"].get("paused"), dict) else None


def current_packet(story):
    """The judge packet recorded for the story's present review round, or None."""
    packet = story.get("packet")
    return packet if isinstance(packet, dict) and packet.get("round") == story["round"] else None


def observed_of(story):
    """This round's observed runs of a story (entries of other shapes are not ours: skipped)."""
    return [o for o in story.get("observed") or []
            if isinstance(o, dict) and o.get("round") == story["round"]
            and isinstance(o.get("cmd"), str)]


def unaddressed_failure(story):
    """The latest observed failure of a command that has not been seen to pass since, or None."""
    latest = {}
    for o in observed_of(story):
        latest[o["cmd"]] = o
    failed = [o for o in latest.values() if o.get("ok") is False]
    return max(failed, key=lambda o: o.get("seq", 0)) if failed else None


def observed_result(o):
    if o.get("ok") is None:
        return "outcome not reported"
    code = f"exit {o['exit_code']}" if isinstance(o.get("exit_code"), int) else None
    return ("passed" if o["ok"] else "failed") + (f" ({code})" if code else "")


def _require_story_text(spec):
    if blank(spec.get("title")) or blank(spec.get("objective")):
        raise usage(f"{one_line(spec.get('id'))}: title and objective must not be empty — "
                    "--goal format is 'title::objective'.", "blank_goal")
    if any("\x00" in cmd for cmd in spec.get("checks") or ()):  # argv cannot carry one
        raise forged(f"{one_line(spec.get('id'))} has a frozen check holding a NUL byte")


def _refuse_unknown_unverifiable(stories, found):
    by_id = {s["id"]: s for s in stories}
    for u in found:
        story = by_id.get(u["id"])
        if (story is None or not 0 <= u["check"] < len(story["checks"]) or
                story["checks"][u["check"]] != u["cmd"]):
            raise forged(f"unverifiable check {one_line(u['id'])}/{u['check']} is not a frozen "
                         "check of the plan")


def _refuse_blank_agent(agent):
    if agent is not None and blank(agent):
        raise forged("an agent name is blank")


def _ev_plan_created(plan, ev):
    """A plan begins: the previous one (if any) is gone from the replay, and this event holds
    every story whole — ids G001… in order, texts non-blank, dependencies a graph without
    cycles whose final story waits for all the others — with the unverifiable checks it named
    (each a frozen check of the plan), the plan it replaced and the scope of its work."""
    specs = ev["stories"]
    if not specs:
        raise usage("at least one --goal is required.", "no_goals")
    if ev["count"] != len(specs):
        raise forged(f"count is {ev['count']} but the event lists {len(specs)} stories")
    if not is_plan_id(ev["plan_id"]):
        raise forged(f"plan_id {one_line(ev['plan_id'])!r} is not a plan id")
    imported = ev.get("imported_from") is not None
    for i, spec in enumerate(specs, 1):
        if spec["id"] != story_id(i):
            raise damaged(f"story {i} has id {one_line(spec['id'])}, expected {story_id(i)}")
        _require_story_text(spec)
        if "status" in spec or "evidence" in spec:
            if not imported:
                raise damaged(f"{spec['id']} is created with status {one_line(spec.get('status'))}")
            if spec.get("status") not in ORIGINAL_STATUSES:
                raise forged(f"{spec['id']} is imported with status {one_line(spec.get('status'))}")
    final = specs[-1]
    others = [s["id"] for s in specs[:-1]]
    if sorted(final["after"]) != sorted(others):
        raise damaged("the final story must depend on every other story")
    stories = [new_story(s) for s in specs]
    validate_graph(stories)
    rounds = ev["options"]["rounds"]
    if rounds < 1:
        raise usage("--rounds must be a whole number ≥ 1.", "bad_rounds")
    unverifiable = ev.get("unverifiable") or []
    _refuse_unknown_unverifiable(stories, unverifiable)
    scope = ev.get("scope") or []
    if scope != [scope_pattern(p) for p in scope]:
        raise forged(f"scope {one_line(scope)[:80]} is not a list of repository paths")
    for s in stories:
        if s["status"] == "in_progress":
            s.update(round=1, started_seq=ev["seq"], started_ts=ev["ts"])
    plan = {
        "schema_version": SNAPSHOT_VERSION,
        "plan_id": ev["plan_id"],
        "brief": ev["brief"],
        "created": ev["ts"],
        "goals": stories,
        "options": {"rounds": rounds, "require_run": ev["options"]["require_run"]},
        "unverifiable": list(unverifiable),
        "replaces": ev["replaces"],
        "guard": {"blocks": 0},
    }
    if scope:  # the paths the work may change; the re-run takes only those from the branch
        plan["scope"] = list(scope)
    return plan


def _log_plan_created(ev, sid):
    text = f"plan created — {count_stories(ev['count'])}: {defused_line(ev['brief'])}"
    if ev.get("replaces"):
        text += f" (replaces {one_line(ev['replaces']['plan_id'])}, archived)"
    if ev.get("imported_from"):
        text += " (imported from the original goals.py)"
    return text


def _ev_story_started(plan, ev):
    story = find_story(plan, ev["id"])
    agent = ev["agent"]
    _refuse_blank_agent(agent)
    if story["status"] not in ("pending", "failed"):
        raise refused(f"{story['id']} cannot start: it is {story['status']}.", "not_startable")
    pending = waits_for(plan, story)
    if pending:
        raise refused(f"{story['id']} cannot start: it waits for {', '.join(pending)}.", "waiting")
    active = active_stories(plan)
    if agent is None and active:
        raise refused(f"{active[0]['id']} is already in progress — one story at a time.", "busy")
    if agent is not None and any(s["agent"] == agent for s in active):
        raise refused(f"agent {one_line(agent)} already holds a story.", "busy")
    if rounds_left(plan, story) <= 0:
        raise refused(f"{story['id']} has used all its rounds.", "rounds_exhausted")
    if ev["title"] != story["title"] or ev["round"] != story["round"] + 1:
        raise forged(f"{story['id']} started with title {one_line(ev['title'])[:60]!r}, round "
                     f"{ev['round']}; the plan says {one_line(story['title'])[:60]!r}, round "
                     f"{story['round'] + 1}")
    story.update(status="in_progress", round=story["round"] + 1, agent=agent,
                 started_seq=ev["seq"], started_ts=ev["ts"], runs=[])
    story_in_progress(plan, story)
    return plan


def _log_story_started(ev, sid):
    return f"{sid} started, round {ev['round']}" + (f", agent {one_line(ev['agent'])}"
                                                    if ev["agent"] else "")


def verification_gap(plan, story, ev):
    """Why a `complete` checkpoint of `story` is not verified, or None if it is."""
    checks = story["checks"]
    if checks:
        for i, cmd in enumerate(checks):
            run = latest_run(story, check=i)
            if run is None:
                return refused(f"{story['id']}: frozen check {i + 1} (`{one_line(cmd)}`) has no "
                               "run "
                               "since the story was activated.", "verification_missing")
            if not run["ok"]:
                return refused(f"{story['id']}: frozen check {i + 1} (`{one_line(cmd)}`) failed "
                               f"({describe_exit(run)}).", "verification_failed")
        return None
    if ev.get("run"):
        run = latest_run(story, cmd=ev.get("verify_cmd"))
        if run is None:
            return refused(f"{story['id']}: no run of `{one_line(ev.get('verify_cmd'))}` since the "
                           "story was activated.", "verification_missing")
        if not run["ok"]:
            return refused(f"{story['id']}: `{one_line(run['cmd'])}` failed "
                           f"({describe_exit(run)}).", "verification_failed")
        return None
    if not is_final(plan, story):
        return None
    if plan["options"]["require_run"]:
        return refused("this plan requires a witnessed run: the final story completes only "
                       "with --run (the engine runs --verify-cmd) or frozen checks.",
                       "run_required")
    if blank(ev.get("verify_cmd")) or blank(ev.get("verify_evidence")):
        return refused("the final story cannot complete without --verify-cmd and --verify-evidence "
                       "(verification gate).", "verification_gate")
    return None


def checkpoint_gate(plan, story, ev):
    """The checks a checkpoint must pass before anything runs (the original's order)."""
    if story["status"] != "in_progress":
        raise refused(f"{story['id']} is not active ({story['status']}) — activate it with `next` "
                      "first.", "not_active")
    agent = ev.get("agent")
    _refuse_blank_agent(agent)
    if story["agent"] is not None and agent != story["agent"]:
        caller = "an unnamed caller (give --agent)" if agent is None else one_line(agent)
        raise refused(f"{story['id']} is held by agent {one_line(story['agent'])}, "
                      f"not {caller}.", "held_by_other")
    # failed/blocked without evidence stays legal in a replay (the original allowed it);
    # `checkpoint` asks for a reason now (reason_required)
    if ev["status"] == "complete" and blank(ev.get("evidence")):
        raise refused("a complete checkpoint requires non-empty --evidence.", "no_evidence")


def _fail_round(plan, story, feedback):
    """Not achieved: another round, or blocked when the rounds are used up."""
    story["feedback"] = feedback
    story["agent"] = None
    if rounds_left(plan, story) > 0:
        story["status"] = "failed"
    else:
        story["status"] = "blocked"
        story["blocked_reason"] = (f"rounds exhausted ({plan['options']['rounds']} of "
                                   f"{plan['options']['rounds']}) — a human must decide")


def _failed_run_tails(story):
    return [{"cmd": r["cmd"], "exit": describe_exit(r), "tail": r["tail"]}
            for r in story["runs"] if not r["ok"]]


def _ev_checkpoint(plan, ev):
    """A story's result. The gate (checkpoint_gate: it was activated, by this agent) holds for
    every status; `complete` also needs its evidence and, for the final story, its
    verification: the frozen checks' runs it cites, all passing and made this round, or a
    --run of --verify-cmd, or (without --require-run) a claimed command and its result. A
    failed story goes another round while it has rounds left; then, as a blocked one, waits
    for a human. A judged story goes to review instead of complete."""
    story = find_story(plan, ev["id"])
    if ev["status"] not in CHECKPOINT_STATUSES:
        raise usage(f"unknown checkpoint status {one_line(ev['status'])}")
    if ev.get("run") is False:
        raise forged("run is false")
    checkpoint_gate(plan, story, ev)
    cited = ev.get("runs") or []
    if (len(set(cited)) != len(cited) or len(cited) > max(1, len(story["checks"])) or
            any(not 0 < seq < ev["seq"] for seq in cited)):
        raise forged(f"the checkpoint cites runs {cited[:5]}, which no checkpoint of "
                     f"{story['id']} ran")
    if ev["status"] == "complete":
        gap = verification_gap(plan, story, ev)
        if gap is not None:
            raise gap
    story["evidence"] = ev["evidence"]
    story["executor"] = ev.get("agent")  # whoever checkpointed, never the holder by default
    if ev["status"] == "complete":
        story.update(verify_cmd=ev["verify_cmd"], verify_evidence=ev["verify_evidence"],
                     agent=None, feedback=None, blocked_reason=None,
                     grade="witnessed" if story["checks"] or ev.get("run") else "claimed")
        story["status"] = "review" if story["judge"] else "complete"
    elif ev["status"] == "failed":
        story["grade"] = None
        _fail_round(plan, story, {"source": "checkpoint", "round": story["round"],
                                  "text": ev["evidence"], "runs": _failed_run_tails(story)})
    else:
        # the reason is the evidence, kept once (blocked_because reads it)
        story.update(status="blocked", agent=None, blocked_reason=None, grade=None)
    return plan


def _log_checkpoint(ev, sid):
    text = (f"{sid} checkpoint {one_line(ev['status'])} — evidence: "
            f"{one_line(last_chars(ev['evidence'], 200))}")
    if ev["verify_cmd"]:
        text += f" · verify-cmd: {one_line(ev['verify_cmd'])}"
    if ev["verify_evidence"]:
        text += f" · verify-evidence: {one_line(last_chars(ev['verify_evidence'], 120))}"
    if ev["status"] == "complete":
        text += " · grade: " + ("witnessed" if ev.get("run") or ev.get("runs") else "claimed")
    return text


_INF = float("inf")
_HEX64 = Lazy(lambda _: re.compile(r"[0-9a-f]{64}\Z").match)  # [0]: a digest's test, made once


def _ev_verify_run(plan, ev):
    story = find_story(plan, ev["id"])
    check, seq = ev["check"], ev["seq"]
    if check is not None and not (0 <= check < len(story["checks"])
                                  and story["checks"][check] == ev["cmd"]):
        raise forged(f"run of check {check} of {story['id']} with a command that is not that "
                     "frozen check")
    if ev["log"] != f"{RUNS}/{seq}-{story['id']}.log":
        raise forged(f"run log `{one_line(ev['log'])[:80]}` is not runs/<seq>-<story>.log")
    if (not _HEX64[0](ev["sha256"]) or ev["bytes"] < 0 or not (
            0 <= ev["duration_s"] < _INF and 0 <= ev["after_seq"] < seq) or
            len(ev["tail"]) > TAIL_CHARS):
        raise forged("a run's digest, size, duration, tail or position is out of range")
    record = {key: ev[key] for key in RUN_FIELDS}
    if ev.get("interrupted"):  # only then: replayed old runs stay as their snapshots hold them
        record["interrupted"] = ev["interrupted"]
    record["ok"] = run_passed(record)
    story["last_run"] = record
    # fresh evidence only: a run counts for the round in which it started; per check (or --run
    # command) only the latest run is kept, last, so the snapshot never holds history
    if story["status"] == "in_progress" and ev["after_seq"] >= story["started_seq"]:
        runs, key = story["runs"], (ev["cmd"] if check is None else check)  # run_key
        if len(runs) == 1 and run_key(runs[0]) == key:  # a check run again: the common case
            story["runs"] = [record]
        else:
            story["runs"] = [run for run in runs if run_key(run) != key] + [record]
    return plan


def _log_verify_run(ev, sid):
    if not (ev["error"] or ev["timed_out"] or ev["signal"] or ev.get("interrupted")):
        # a run that exited, the common case: run_text's words in one string (log of 100,000
        # real runs: 3.7 → 3.1 µs a line; test_a_history_line_is_its_fields_escaped holds the
        # two together)
        return (f"{sid} run `{ev['cmd']}` → exit {ev['exit_code']}, {ev['duration_s']} s, "
                f"{ev['bytes']} bytes, sha256 {str(ev['sha256'])[:16]}… · log {ev['log']} · "
                f"in {ev['cwd']}")
    return f"{sid} run {run_text(ev)} · log {ev['log']} · in {ev['cwd']}"


def _ev_decision(plan, ev):
    story = find_story(plan, ev["id"])
    decision, note = ev["decision"], ev["note"]
    if decision not in DECISIONS:
        raise usage(f"unknown decision {one_line(decision)}")
    if blank(note):
        raise refused("a decision requires a non-empty --note (the reason, or the feedback).",
                      "no_note")
    if story["status"] not in ("blocked", "failed", "review"):
        raise refused(f"{story['id']} is {story['status']} — `decide` applies to a blocked, failed "
                      "or in-review story.", "not_decidable")
    story["decision"] = {"decision": decision, "note": note, "seq": ev["seq"], "ts": ev["ts"]}
    if ev.get("signature"):  # who signed it, shown wherever the decision is (not proof: audit)
        story["decision"]["signer"] = ev["signature"]["signer"]
    story.update(agent=None, blocked_reason=None, grade=None)
    if decision == "accept":
        story.update(status="accepted", grade="accepted")  # a human's word: no evidence gate
        return plan
    if decision == "amend":
        story["amendments"].append({"note": note, "seq": ev["seq"], "ts": ev["ts"]})
    story.update(status="pending", round_base=story["round"],
                 feedback={"source": decision, "round": story["round"], "text": note, "runs": []})
    return plan


def _log_decision(ev, sid):
    signed = ev.get("signature")
    return (f"{sid} decision: {one_line(ev['decision'])} — {one_line(ev['note'])}"
            + (f" (signed by {one_line(signed['signer'])})" if signed else ""))


def _ev_story_added(plan, ev):
    spec = ev["story"]
    final = touch(plan["goals"][-1])
    if final["status"] not in ("pending", "failed", "blocked"):
        raise refused(f"the final story {final['id']} is {final['status']} — stories can be added "
                      "only before verification starts.", "final_started")
    expected = story_id(len(plan["goals"]) + 1)
    if spec["id"] != expected:
        raise damaged(f"added story has id {one_line(spec['id'])}, expected {expected}")
    if "status" in spec or "evidence" in spec:
        raise forged(f"{spec['id']} is added with a status")
    _require_story_text(spec)
    story = new_story(spec)
    validate_graph(plan["goals"] + [story])
    _refuse_unknown_unverifiable([story], ev["unverifiable"])
    plan["goals"].insert(len(plan["goals"]) - 1, story)
    final["after"].append(story["id"])
    plan["unverifiable"].extend(ev["unverifiable"])
    return plan


def _log_story_added(ev, sid):
    return f"{one_line(ev['story']['id'])} added: {defused_line(ev['story']['title'])}"


def _ev_verdict(plan, ev):
    """A judge's verdict on a story in review, from an agent other than its executor:
    achieved completes it; not-achieved sends it back for another round with what was missing;
    unachievable blocks it for a human. A verdict on a tree the judge changed after its packet
    arrives as not-achieved (cmd_verdict decides that, outside the transition)."""
    story = find_story(plan, ev["id"])
    verdict, agent = ev["verdict"], ev["agent"]
    if verdict not in VERDICTS:
        raise usage(f"unknown verdict {one_line(verdict)}")
    if story["status"] != "review":
        raise refused(f"{story['id']} is {story['status']}, not in review — there is nothing to "
                      "judge.", "not_in_review")
    if blank(ev["evidence"]):
        raise refused("a verdict requires non-empty --evidence (what you checked and saw).",
                      "no_evidence")
    if blank(agent):
        raise refused("a verdict requires --agent (who judged).", "no_agent")
    if story["executor"] is not None and agent == story["executor"]:
        raise refused(f"{one_line(agent)} did the work of {story['id']} and cannot judge it.",
                      "judge_not_independent")
    story["judged_by"] = {"agent": agent, "verdict": verdict, "seq": ev["seq"]}
    if verdict == "achieved":
        story["status"] = "complete"  # the grade stays that of the checkpoint the judge checked
    elif verdict == "not-achieved":
        story["grade"] = None
        _fail_round(plan, story, {"source": "judge", "round": story["round"],
                                  "text": ev["evidence"], "runs": []})
    else:
        story.update(status="blocked", blocked_reason=ev["evidence"], grade=None)
    return plan


def _log_verdict(ev, sid):
    return (f"{sid} verdict {one_line(ev['verdict'])} by {one_line(ev['agent'])} — "
            f"{one_line(last_chars(ev['evidence'], 200))}")


def _ev_judge_packet(plan, ev):
    story = find_story(plan, ev["id"])
    if story["status"] != "review":
        raise refused(f"{story['id']} is {story['status']}, not in review — there is nothing to "
                      "judge.", "not_in_review")
    if current_packet(story) is None:  # the round's first packet: a later one cannot launder
        story["packet"] = {"tree": ev["tree"], "files": ev["files"], "round": story["round"],
                           "seq": ev["seq"]}
    return plan


def _log_judge_packet(ev, sid):
    return (f"{sid} judge packet: working tree recorded ({one_line(ev['files'])} files, "
            f"sha256 {one_line(ev['tree'][:16])}…)")


def _ev_guard_block(plan, ev):
    # a fresh stop (not one caused by the previous block) starts the count again
    plan["guard"]["blocks"] = 1 if ev["fresh"] else plan["guard"]["blocks"] + 1
    if ev.get("hook") or "hook" in plan["guard"]:  # which stop it was: a second guard skips it
        plan["guard"].update(hook=ev.get("hook"), hook_ts=ev["ts"])
    return plan


def _log_guard_block(ev, sid):
    return f"stop blocked by the guard: {one_line(ev['reason'])}"


def _ev_paused(plan, ev):
    paused = plan["guard"].get("paused")
    if paused:
        raise refused(f"the guard is already paused (since event {paused['seq']}) — `unpause` "
                      "turns it back on.", "already_paused")
    plan["guard"]["paused"] = {"seq": ev["seq"], "ts": ev["ts"], "note": ev["note"]}
    return plan


def _log_paused(ev, sid):
    return "guard paused" + (f": {one_line(ev['note'])}" if ev["note"] else "")


def _ev_unpaused(plan, ev):
    if not plan["guard"].get("paused"):
        raise refused("the guard is not paused.", "not_paused")
    plan["guard"]["paused"] = None
    return plan


def _log_unpaused(ev, sid):
    return "guard on again"


def _ev_observed_run(plan, ev):
    story = find_story(plan, ev["id"])
    if story["status"] != "in_progress":
        raise refused(f"{story['id']} is not active ({story['status']}) — an observed run belongs "
                      "to the story being worked.", "not_active")
    seen = [o for o in story.get("observed") or [] if isinstance(o, dict)]
    seen.append({"seq": ev["seq"], "ts": ev["ts"], "round": story["round"], "cmd": ev["cmd"],
                 "exit_code": ev["exit_code"], "ok": ev["ok"], "tool": ev["tool"],
                 "detail": ev["detail"]})
    story["observed"] = seen[-OBSERVED_KEEP:]
    return plan


def _log_observed_run(ev, sid):
    return (f"{sid} observed `{one_line(last_chars(ev['cmd'], 200))}` → {observed_result(ev)} "
            f"(reported by {one_line(ev['tool'])})")


def _ev_story_released(plan, ev):
    story = find_story(plan, ev["id"])
    if story["status"] != "in_progress":
        raise refused(f"{story['id']} is {story['status']}, not in progress — there is no claim to "
                      "release.", "not_active")
    _refuse_blank_agent(ev["agent"])
    if blank(ev["note"]):
        raise refused("a release requires a non-empty --note (why the agent's claim ends).",
                      "no_note")
    # the silent agent's round is given back: it was not a failed attempt
    story.update(status="pending", agent=None, round_base=story["round_base"] + 1,
                 feedback={"source": "release", "round": story["round"], "text": ev["note"],
                           "runs": []})
    return plan


def _log_story_released(ev, sid):
    return (f"{sid} released from agent {one_line(ev['agent'] or 'unnamed')} — "
            f"{one_line(last_chars(ev['note'], 200))}")


def _ev_plan_merged(plan, ev):
    """`git merge` of a branch whose plan is another one: that plan's whole ledger rides along
    in this event, replayed here through the same rules, so it audits as it did on its branch."""
    inner = Replay()
    for text in ev["lines"]:
        raw = text.encode("utf-8")
        try:
            inner.feed(raw, parse_event(raw))
        except FablizeError as e:
            raise FablizeError(f"merged plan {one_line(ev['plan_id'])}: {e.message}", e.code,
                               EXIT_DAMAGED)
    other, head = inner.plan, inner.head
    if (other is None or other["plan_id"] != ev["plan_id"] or head != ev["head"]
            or len(ev["lines"]) != ev["events"] or other["plan_id"] == plan["plan_id"]):
        raise damaged(f"merged plan {one_line(ev['plan_id'])}: its lines do not give the plan, "
                      "head and event count the event names.", "bad_event")
    return plan


def _log_plan_merged(ev, sid):
    return (f"plan {one_line(ev['plan_id'])} merged in ({count_noun(ev['events'], 'event')}, "
            f"head {ev['head'][:16]}…)")


# Every event: its transition and exactly the fields fablize writes for it (seq, ts, event and
# prev on every line). Replay checks each line against this table, so a re-chained line carrying
# anything the engine would not have written is damage, named by its line.
TIMESTAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00\Z"  # what now_iso writes
_EVENT_BASE = {"seq": int, "ts": str, "event": str, "prev": str}
EVENTS = {
    "plan_created": (_ev_plan_created, {
        "brief": str, "count": int, "plan_id": str, "stories": [STORY_EVENT_SPEC],
        "options": {"rounds": int, "require_run": bool}, "unverifiable?": UNVERIFIABLE_SPEC,
        "replaces": (REPLACES_SPEC, _N), "imported_from?": {"tool": str}, "scope?": [str]},
        _log_plan_created),
    "story_started": (_ev_story_started, {"id": str, "title": str, "round": int, "agent": TEXT},
                      _log_story_started),
    "checkpoint": (_ev_checkpoint, {
        "id": str, "status": str, "evidence": TEXT, "verify_cmd": TEXT,
        "verify_evidence": TEXT, "agent?": TEXT, "run?": bool, "runs?": [int]}, _log_checkpoint),
    "verify_run": (_ev_verify_run, {
        "id": str, "check": (int, _N), "cmd": str, "cwd": str, "exit_code": (int, _N),
        "signal": TEXT, "timed_out": bool, "error": TEXT, "duration_s": (int, float),
        "bytes": int, "sha256": str, "tail": str, "log": str, "after_seq": int, "started": str,
        "git_head": TEXT, "git_dirty": (bool, _N), "interrupted?": str,
        "provenance?": (PROVENANCE_SPEC, _N), "tree?": str}, _log_verify_run),
    "decision": (_ev_decision, {"id": str, "decision": str, "note": str,
                                "signature?": ({"signer": str, "sig": str}, _N)}, _log_decision),
    "story_added": (_ev_story_added, {"story": STORY_EVENT_SPEC,
                                      "unverifiable": UNVERIFIABLE_SPEC}, _log_story_added),
    "verdict": (_ev_verdict, {"id": str, "verdict": str, "evidence": str, "agent": str,
                              "tree?": TEXT, "packet_seq?": (int, _N)}, _log_verdict),
    "guard_block": (_ev_guard_block, {"reason": str, "fresh": bool, "hook?": TEXT},
                    _log_guard_block),
    "judge_packet": (_ev_judge_packet, {"id": str, "tree": str, "files": (int, _N)},
                     _log_judge_packet),
    "paused": (_ev_paused, {"note": TEXT}, _log_paused),
    "unpaused": (_ev_unpaused, {}, _log_unpaused),
    "observed_run": (_ev_observed_run, {"id": str, "cmd": str, "exit_code": (int, _N),
                                        "ok": (bool, _N), "tool": TEXT, "detail": TEXT},
                     _log_observed_run),
    "story_released": (_ev_story_released, {"id": str, "note": str, "agent": TEXT},
                       _log_story_released),
    "plan_merged": (_ev_plan_merged, {"plan_id": str, "events": int, "head": str,
                                      "lines": [str]}, _log_plan_merged),
}
EVENT_SPECS = {kind: dict(_EVENT_BASE, **fields) for kind, (_, fields, _) in EVENTS.items()}
def apply_event(plan, ev):
    """Check that `ev` is an event fablize writes and is legal in `plan`, and apply it (in
    place). Commands and every replay go through here. Raises FablizeError."""
    kind = ev.get("event")
    entry = EVENTS.get(kind) if type(kind) is str else None
    if entry is None:
        raise damaged(f"unknown event {one_line(repr(kind))[:60]}", "unknown_event")
    where = misfit(ev, EVENT_SPECS[kind])
    if where:
        raise damaged(f"malformed {kind} event ({where.lstrip('.')} is missing, unexpected "
                      "or of the wrong type)", "bad_event")
    if not regex(TIMESTAMP, re.A).match(ev["ts"]):
        raise forged(f"ts {one_line(ev['ts'])[:40]!r} is not a UTC timestamp")
    if (plan is None) != (kind == "plan_created"):
        raise damaged("plan_created must be the first event and only the first", "bad_sequence")
    return transition(plan, ev)


def transition(plan, ev):
    """Apply `ev`, an event apply_event has checked the shape and time of, to `plan`."""
    kind = ev["event"]
    plan = EVENTS[kind][0](plan, ev)
    if kind != "guard_block":
        plan["guard"]["blocks"] = 0
    return plan


def format_event(ev):
    """One event of the ledger as a line of history (`log`): its number, its time and what its
    kind's renderer says of it (EVENTS, beside each transition). Only events a replay accepted
    are shown, so each has the fields its kind names, and a time TIMESTAMP matched (its label
    is time_label's, cut from it). The line is escaped whole, once: one_line works a character
    at a time, so that is each field escaped, and a renderer may give its fields as they are
    (log of 100,000 real runs: 4.8 → 3.7 µs a line rendered)."""
    ts = ev["ts"]
    line = (f"#{ev['seq']}  {ts[:10]} {ts[11:19]} UTC  "
            f"{EVENTS[ev['event']][2](ev, ev.get('id', ''))}")
    return line if line.isprintable() else line.translate(_ESCAPE_LINE)


def is_original_snapshot(snap):
    """A goals.json written by the original goals.py: none of the keys this engine writes."""
    return not any(key in snap for key in ("digest", "ledger", "plan_id", "schema_version"))


def validate_snapshot(plan, whole=True):
    """A snapshot of the right shape, or exit 3 saying what is wrong. A command reads what it
    touches: once the snapshot's digest verifies, it checks the plan's own fields and leaves
    each story to touch() (`whole=False`: a status of 100,000 stories does not pay 0.7 µs a
    story for it); audit and rebuild check everything, and so does a command that failed on
    what a story holds (snapshot_damage), so a hand-made snapshot is exit 3, never a
    traceback."""
    def bad(what):
        return damaged(f"{SNAPSHOT}: not a fablize snapshot ({what}) — run `audit`.",
                       "bad_snapshot")
    if type(plan) is not dict:
        raise bad("top level is not an object")
    original = is_original_snapshot(plan)
    found = (misfit(plan, ORIGINAL_SPEC) if original else
        misfit({k: v for k, v in plan.items() if k != "goals"}, PLAN_HEAD_SPEC) or
        (None if type(plan.get("goals")) is list else ".goals"))
    if found:
        raise bad(f"{found.lstrip('.')} is missing, unexpected or of the wrong type")
    goals = plan["goals"]
    if not goals:
        raise bad("the plan has no stories")
    if not (whole or original):
        return plan
    for i, story in enumerate(goals):
        found = None if original else misfit(story, STORY_SPEC)
        if found:
            raise bad(f"goals[{i}]{found} is missing, unexpected or of the wrong type")
        if story["status"] not in STATUSES:
            raise bad(f"goals[{i}].status is {one_line(story['status'])!r}")
    return plan if original else check_graph(plan)


def check_graph(plan):
    """The graph `next` walks: one story per id, and every dependency one of them (checked by
    every writer, and by a whole check)."""
    goals = plan["goals"]
    ids = set(map(itemgetter("id"), goals))
    if len(ids) != len(goals):
        raise damaged(f"{SNAPSHOT}: not a fablize snapshot (two stories have the same id) — run "
                      "`audit`.", "bad_snapshot")
    for i, story in enumerate(goals):
        if not ids.issuperset(story.get("after", ())):
            raise damaged(f"{SNAPSHOT}: not a fablize snapshot (goals[{i}].after names a story "
                          "that is not in the plan) — run `audit`.", "bad_snapshot")
    return plan


def original_plan_fields(snap, root=None):
    """The plan_created fields that carry an original goals.py plan's stories as they are, but
    for what a plan may not publish (the original masked nothing): secrets masked, the places
    of the machine shown relative to them (its files stay whole in the archive)."""
    def kept(text):
        return text if type(text) is not str else mask_places(mask(text, True), root)
    stories = []
    for i, g in enumerate(snap["goals"], 1):
        stories.append({"id": story_id(i), "title": kept(g["title"]),
                        "objective": kept(g["objective"]), "status": g["status"],
                        "evidence": kept(g.get("evidence")),
                        "after": [story_id(i - 1)] if i > 1 else []})
    stories[-1]["after"] = [s["id"] for s in stories[:-1]]
    return {"brief": kept(snap["brief"]), "count": len(stories), "plan_id": new_plan_id(),
            "stories": stories, "options": {"rounds": DEFAULT_ROUNDS, "require_run": False},
            "imported_from": {"tool": "goals.py (original)"}}


def make_event(plan, kind, fields, ts=None):
    """The next event of `plan`: (the plan after it, its record, its ledger line). Pure: the
    plan is changed in place, nothing is written."""
    record = {"seq": plan["ledger"]["seq"] + 1 if plan else 1, "ts": ts or now_iso(), "event": kind}
    record.update(fields)
    record["prev"] = plan["ledger"]["head"] if plan else ZERO_HASH
    plan = apply_event(plan, record)
    line = dumps(record).encode("utf-8")
    plan["ledger"] = {"seq": record["seq"], "head": sha256_hex(line)}
    return plan, record, line


# Storage: discovery, files, lock, ledger, snapshot ############################################
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_BINARY = getattr(os, "O_BINARY", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


# Where FABLIZE_CRASH_AT (tests only) may kill the process, in write-protocol order.
CRASH_POINTS = ("before-ledger-write", "after-ledger-write", "after-ledger-fsync",
                "after-snapshot-temp", "before-snapshot-replace", "after-snapshot-replace",
                "after-archive-snapshot")


def crash_point(name):
    if os.environ.get("FABLIZE_CRASH_AT") == name:
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def find_state_dir(explicit, cwd):
    """--dir, then $FABLIZE_DIR, then the nearest .fablize/ up to the repository root, then
    .fablize/ at that root, then ./.fablize/. Returns (path, discovered)."""
    if explicit:
        return os.path.abspath(explicit), False
    env = os.environ.get("FABLIZE_DIR")
    if env:
        return os.path.abspath(env), False
    here = d = os.path.abspath(cwd)
    while True:
        candidate = os.path.join(d, STATE_DIRNAME)
        if os.path.lexists(candidate) or os.path.lexists(os.path.join(d, ".git")):
            return candidate, True
        parent = os.path.dirname(d)
        if parent == d:
            return os.path.join(here, STATE_DIRNAME), True
        d = parent


def project_state_dir(path, out):
    """--dir or $FABLIZE_DIR naming a project (it holds .git or .fablize/, but no state files)
    means that project's .fablize/: state files written into the project would put the
    checks' working directory one level too high."""
    if os.path.basename(path) == STATE_DIRNAME or any(
            os.path.lexists(os.path.join(path, name)) for name in (SNAPSHOT, LEDGER)):
        return path
    if not any(os.path.lexists(os.path.join(path, name)) for name in (".git", STATE_DIRNAME)):
        return path
    state = os.path.join(path, STATE_DIRNAME)
    out.warn(f"{path} is a project root, not a state directory — using {state}.")
    return state


def symlink_refusal(path):
    return damaged(f"{path} is a symlink — refusing to follow it (state files must be regular "
                   "files inside the state directory).", "symlink")


def open_state_file(path, flags, mode=0o644):
    """os.open that never follows a symlink, never blocks (a FIFO or a device opens at once, and
    is then refused) and accepts nothing but a regular file."""
    try:
        fd = os.open(path, flags | O_NOFOLLOW | O_CLOEXEC | O_BINARY | O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno != errno.ENOENT and os.path.islink(path)):
            raise symlink_refusal(path)
        if e.errno == errno.ENXIO:  # a FIFO without a reader, opened for writing
            raise damaged(f"{path} is not a regular file.", "not_a_file")
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise damaged(f"{path} is not a regular file.", "not_a_file")
    return fd


def read_all(fd, start=0, size=None):
    os.lseek(fd, start, os.SEEK_SET)
    chunks = []
    left = size
    step = max(READ_CHUNK, os.fstat(fd).st_size - start) if size is None else 0
    while left is None or left > 0:
        chunk = os.read(fd, min(step, 1 << 30) if left is None else min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        if left is not None:
            left -= len(chunk)
    return b"".join(chunks)


def read_state_file(path):
    try:
        fd = open_state_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return read_all(fd)
    finally:
        os.close(fd)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path):
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY | O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_subdir(path):
    """mkdir that refuses a symlink or a file standing where the directory should be."""
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise symlink_refusal(path)
        if not stat.S_ISDIR(st.st_mode):
            raise damaged(f"{path} is not a directory.", "not_a_directory")
    return path


def free_name(path):
    """`path`, or `path.2`, `path.3`, … whichever does not exist yet."""
    candidate, n = path, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


def link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:  # no hard links here (some filesystems): copy, refusing a symlink
        fd = open_state_file(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            write_all(fd, read_state_file(src) or b"")
            os.fsync(fd)
        finally:
            os.close(fd)


def shown_path(store, rel):
    """A state file's path (`runs/3-G001.log`) as a person standing where they are can open
    it: relative to the current directory."""
    return one_line(os.path.relpath(store.path(rel)))


def within(path, folder):
    """Whether `path` is `folder` or lies under it (both as given: resolve them first)."""
    return os.path.commonpath([path, folder]) == folder


def user_file(root, path, outside=False):
    """Where a file written on the user's behalf (`install-block`, `report --out`) goes:
    `path`, inside the project at `root` unless the user passed --outside, and never through
    a symlink — not the file itself, not a folder on the way that leads out of the project.
    Returns (path, its lstat or None when it does not exist yet)."""
    target = os.path.abspath(path)
    top = os.path.realpath(root)
    if not outside and not within(os.path.realpath(os.path.dirname(target)), top):
        where = ("a folder on the way is a symlink out of it"
            if within(os.path.abspath(os.path.dirname(target)), os.path.abspath(root)) else
            "it is not inside it")
        raise refused(f"{one_line(path)} is outside the project ({one_line(root)}): {where} — "
                      "fablize writes a file there only when asked with --outside.",
                      "outside_project")
    return target, file_to_write(target)


def file_to_write(path):
    """The lstat of a file about to be written on the user's behalf, or None when there is none
    yet; refuses a symlink (never written through) or anything but a regular file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise refused(f"{path} is a symlink — refusing to write through it.", "symlink")
    if not stat.S_ISREG(st.st_mode):
        raise refused(f"{path} is not a regular file.", "not_a_file")
    return st


def write_atomic(path, data, mode=0o644, sweep=False):
    """Replace `path` with `data` whole: a temp file in the same directory, fsync, rename, fsync
    the directory. With `sweep`, temp files a killed writer left are removed first (the caller
    holds the lock)."""
    directory = os.path.dirname(path) or "."
    if sweep:
        prefix = os.path.basename(path) + ".tmp-"
        for name in os.listdir(directory):
            if name.startswith(prefix):
                os.unlink(os.path.join(directory, name))
    tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    fd = open_state_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            write_all(fd, data)
            crash_point("after-snapshot-temp")
            os.fsync(fd)
        finally:
            os.close(fd)
        crash_point("before-snapshot-replace")
        os.replace(tmp, path)  # rename last: a crash before it leaves the old file whole
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    crash_point("after-snapshot-replace")
    fsync_dir(directory)


def write_state_gitignore(state_dir):
    """`.fablize/.gitignore`, unless one is there already (it may be the user's own)."""
    path = os.path.join(state_dir, ".gitignore")
    if os.path.lexists(path):
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_BINARY, 0o644)
    except FileExistsError:
        return False
    try:
        write_all(fd, STATE_GITIGNORE.encode())
    finally:
        os.close(fd)
    return True


def pid_alive(pid):
    if os.name == "nt":
        import ctypes
        handle = ctypes.windll.kernel32.OpenProcess(0x1000, False, pid)  # QUERY_LIMITED_INFORMATION
        if not handle:
            return False
        code = ctypes.c_ulong()
        ctypes.windll.kernel32.GetExitCodeProcess(handle, ctypes.byref(code))
        ctypes.windll.kernel32.CloseHandle(handle)
        return code.value == 259  # STILL_ACTIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def env_seconds(name, default):
    """A number of seconds ≥ 0 from the environment variable `name`, else `default`; anything
    else is a usage error (FABLIZE_LOCK_TIMEOUT, the sharing room's FABLIZE_SHARE_WAIT)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1
    if not value >= 0:
        raise usage(f"{name} must be a number of seconds ≥ 0, not {one_line(raw)!r}.")
    return value


def lock_timeout():
    return env_seconds("FABLIZE_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT)


def flock_module():
    """fcntl, imported when a lock is taken (reading commands take none); None on Windows, where
    an exclusive-create lock file stands in (Lock)."""
    try:
        import fcntl
    except ImportError:
        return None
    return fcntl


class Lock:
    """The state directory's lock: flock on `lock` where fcntl exists; elsewhere an
    exclusive-create `lock.owner` file holding the owner's pid (a dead owner's is stale)."""

    def __init__(self, state_dir, warnings):
        self.path = os.path.join(state_dir, LOCK)
        self.warnings = warnings
        self.fd = None
        self.owner_path = None

    def __enter__(self):
        timeout = lock_timeout()
        deadline = time.monotonic() + timeout
        delay = 0.001
        while not self._try_acquire():
            if time.monotonic() >= deadline:
                holder = self._holder()
                raise damaged(f"another fablize command holds {self.path}{holder} — gave up after "
                              f"{timeout:g} s (set FABLIZE_LOCK_TIMEOUT to wait longer).",
                              "lock_timeout")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self

    def _try_acquire(self):
        fcntl = flock_module()
        if fcntl is None:
            return self._try_owner_file()
        if self.fd is None:
            self.fd = open_state_file(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return False
            raise

    def _try_owner_file(self):
        path = self.path + ".owner"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_BINARY, 0o644)
        except FileExistsError:
            pid = self._owner_pid()
            if pid is None and self._owner_age() > 5:
                # created but never written: its creator died between the two steps
                self.warnings.append("removed a stale lock file that no process finished writing.")
            elif pid is not None and not pid_alive(pid):
                self.warnings.append(f"removed a stale lock left by process {pid}, which is no "
                                     "longer running.")
            else:
                return False
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return False
        try:
            write_all(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)
        self.owner_path = path
        return True

    def _owner_pid(self):
        try:
            raw = read_state_file(self.path + ".owner")
            return int(raw.decode().strip()) if raw else None
        except (ValueError, UnicodeDecodeError):
            return None
        except FileNotFoundError:
            return None

    def _owner_age(self):
        try:
            return time.time() - os.lstat(self.path + ".owner").st_mtime
        except FileNotFoundError:
            return 0

    def _holder(self):
        if flock_module() is None:
            pid = self._owner_pid()
            return f" (process {pid})" if pid else ""
        return ""

    def __exit__(self, *exc):
        if self.owner_path:
            try:
                os.unlink(self.owner_path)
            except FileNotFoundError:
                pass
            self.owner_path = None
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None  # taken again, the lock opens its file again
        return False


def parse_event(line):
    """The event on a ledger line, or None when the line is not one."""
    ev = line_value(line)
    if type(ev) is dict and type(ev.get("seq")) is int and type(ev.get("event")) is str:
        return ev
    return None


def line_value(line):
    """The JSON value a ledger line holds, or None when it holds none (Replay.feed says what is
    wrong with a value that is no event, as parse_events' scan of a batch hands it over)."""
    try:
        return load_json(line)
    except ValueError:
        return None
_SCAN = json.JSONDecoder().scan_once  # json's C scanner: one value at a position, and its end
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def parse_events(lines):
    """line_value for a batch of lines, in one pass of json's scanner over the joined batch
    (JSON strings never hold a raw newline). Each value must end exactly where its own line
    does: a value spread over several lines — a forged line hidden inside another event, so
    that its hash sits in the chain without its prev ever being checked — is no event, and
    the lines are then parsed one by one, where it fails. Audit of a plan worked as agents
    work it, 200 stories: 132 → 127 ms CPU against parsing each line alone (x1.05; x1.07 at
    10,000 stories)."""
    text = batch_text(lines)
    if text is None:
        return list(map(line_value, lines))
    # where each line starts and ends in the text, and the scanner called at each start, all in
    # C (map, accumulate): a loop in Python would cost ~0.4 µs a line more
    lengths = map(len, lines if text.isascii() else map(bytes.decode, lines))
    starts = [0, *accumulate(map(add, lengths, repeat(1)))]  # the join's "," after each line
    try:
        scanned = list(map(_SCAN, repeat(text), starts[:-1]))
    except (StopIteration, ValueError, RecursionError):
        return list(map(line_value, lines))
    if list(map(_SECOND, scanned)) != list(map(sub, starts[1:], repeat(1))):
        return list(map(line_value, lines))
    return list(map(_FIRST, scanned))  # Replay.feed checks each is an event


def batch_text(lines):
    """The lines joined by "," as text, or None when they hold what only a line parsed alone
    can tell (bytes no UTF-8 text holds, a lone surrogate's escape)."""
    try:
        text = b",".join(lines).decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if has_surrogate_escape(text) else text


class Ledger:
    """ledger.jsonl: its tail read backwards (cost linear in what is read), its lines streamed
    forwards in batches (memory flat in its length), one event appended with one write."""

    def __init__(self, path, writable=False):
        self.path = path
        self.writable = writable
        self.fd = None

    def open(self, create=False):
        """The descriptor, or None when there is no ledger."""
        if self.fd is None:
            flags = (os.O_RDONLY if not self.writable else
                os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0))
            try:
                self.fd = open_state_file(self.path, flags)
            except FileNotFoundError:
                return None
        return self.fd

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def end(self):
        """(end, torn): `end` is the size of the ledger's newline-terminated part; `torn` the
        bytes after it (an unterminated last line: a write that never completed)."""
        read, size = self.read, self.size()
        if size == 0 or read(size - 1, 1) == b"\n":
            return size, b""
        pos = size
        while pos > 0:
            start = max(0, pos - READ_CHUNK)
            i = read(start, pos - start).rfind(b"\n")
            if i >= 0:
                end = start + i + 1
                return end, read(end, size - end)
            pos = start
        return 0, read(0, size)

    def size(self):
        return os.fstat(self.fd).st_size

    def read(self, start, size):
        return read_all(self.fd, start, size)

    def backward(self, end):
        """Yield (offset, line) for each complete line before `end`, newest first; every byte
        is read once, so a long line costs what its length costs."""
        if end <= 0:
            return
        pos, parts = end - 1, []
        while pos > 0:
            start = max(0, pos - READ_CHUNK)
            chunk = self.read(start, pos - start)
            i = len(chunk)
            while True:
                j = chunk.rfind(b"\n", 0, i)
                if j < 0:
                    parts.append(chunk[:i])
                    break
                parts.append(chunk[j + 1:i])
                yield start + j + 1, b"".join(reversed(parts))
                parts = []
                i = j
            pos = start
        yield 0, b"".join(reversed(parts))

    def last(self, end):
        return next(self.backward(end), (None, None))[1]

    def batches(self, end, size=1 << 16):
        """The complete lines before `end` (a line boundary), a list per 64 KiB or so: a batch's
        events then fit in the CPU's cache, and a long replay runs ~10% faster than with
        batches of a megabyte."""
        pos, parts = 0, []
        while pos < end:
            chunk = self.read(pos, min(size, end - pos))
            if not chunk:
                break
            pos += len(chunk)
            k = chunk.rfind(b"\n")
            if k < 0:
                parts.append(chunk)
                continue
            head = chunk[:k]
            if parts:
                head = b"".join(parts + [head])
            parts = [chunk[k + 1:]] if k + 1 < len(chunk) else []
            yield head.split(b"\n")

    def append(self, line, fd=None):
        fd = self.fd if fd is None else fd
        crash_point("before-ledger-write")
        n = os.write(fd, line + b"\n")  # one write on an O_APPEND descriptor
        if n != len(line) + 1:
            raise damaged(f"short write to {LEDGER} ({n} of {len(line) + 1} bytes); the next "
                          "command moves the torn line aside.", "io_error")
        crash_point("after-ledger-write")
        os.fsync(fd)
        crash_point("after-ledger-fsync")

    def cut(self, end, torn):
        """Move the torn bytes after `end` to ledger.jsonl.broken, then truncate (a writer only)."""
        bfd = open_state_file(self.path + ".broken", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            write_all(bfd, torn if torn.endswith(b"\n") else torn + b"\n")
            os.fsync(bfd)
        finally:
            os.close(bfd)
        os.ftruncate(self.fd, end)
        os.fsync(self.fd)


class MemoryLedger(Ledger):
    """A ledger's bytes already in memory (an archived plan, a ledger read from a git ref)."""

    def __init__(self, data):
        super().__init__(None)
        self.data = data
        self.fd = -1

    def size(self):
        return len(self.data)

    def read(self, start, size):
        return self.data[start:start + size]

    def close(self):
        pass


def line_error(lineno, what, code="bad_event"):
    """Damage at one ledger line: every message about a line starts the same way."""
    return FablizeError(f"{LEDGER} line {lineno}: {what}", code, EXIT_DAMAGED)


def not_an_event(lineno):
    return line_error(lineno, "not a ledger event (unparsable, or no seq/event) — damaged or "
                      "edited.", "bad_line")


_EVENT_KIND, _SEQ, _PREV, _TS = map(itemgetter, ("event", "seq", "prev", "ts"))
# what a transition raises on an event it refuses: its refusal, or a field it cannot use
_REFUSED_EVENT = (FablizeError, KeyError, TypeError, ValueError, AttributeError, IndexError,
                  RecursionError)


def refused_event(n, ev, e):
    """The damage at line `n` whose event the replay refused with `e`."""
    if isinstance(e, FablizeError):
        return line_error(n, e.message)
    return line_error(n, f"malformed {one_line(ev.get('event'))} event ({type(e).__name__})")


class Replay:
    """The one path from ledger lines to a plan. Each line must carry the next seq and the hash
    of the line before it, and hold an event fablize would have written that is legal in the
    plan so far (apply_event). Load, roll-forward, audit, rebuild, log and report all feed
    their lines through here, so every check and every message exists once."""

    def __init__(self, plan=None, seq=0, head=ZERO_HASH, digest=None):
        self.plan, self.seq, self.head = plan, seq, head
        self.digest = digest or sha256_hex
        self.counts = collections.Counter()  # events of each kind (replay_all tallies them)

    def feed(self, line, ev):
        n = self.seq + 1
        if type(ev) is not dict or type(ev.get("event")) is not str:
            raise not_an_event(n)
        seq = ev.get("seq")
        if seq != n or type(seq) is not int:
            raise line_error(n, f"seq is {one_line(repr(ev.get('seq')))[:40]}, expected {n} — a "
                             "line was deleted, duplicated or moved.", "bad_seq")
        if ev.get("prev") != self.head:
            raise line_error(n, f"the hash chain is broken — its prev does not match line "
                             f"{n - 1}, so an earlier line was changed, removed or reordered.",
                             "broken_chain")
        try:
            self.plan = apply_event(self.plan, ev)
        except _REFUSED_EVENT as e:
            raise refused_event(n, ev, e)
        self.seq, self.head = n, self.digest(line)
        return ev

    def position(self):
        return {"seq": self.seq, "head": self.head}


def replay_all(ledger, end, on_event=None, kinds=None, on_batch=None):
    """Replay the ledger's first `end` bytes from nothing, streaming; returns the Replay, its
    `counts` the events of each kind. `on_event(replay, line, ev)` sees each event after it
    replayed: every one, or with `kinds` only those of these kinds; `on_batch(replay, events)`
    each batch of events, once all of them replayed."""
    replay = Replay(digest=fast_sha256())
    feed, counts = replay.feed, replay.counts
    for lines in ledger.batches(end):
        events = parse_events(lines)
        for line, ev in zip(lines, events):
            feed(line, ev)
            if on_event is not None and (kinds is None or ev["event"] in kinds):
                on_event(replay, line, ev)
        if on_batch is not None:
            on_batch(replay, events)
        counts.update(map(_EVENT_KIND, events))  # in C: every line is an event by now
        del events  # freed before the next batch is parsed, whose objects reuse its memory
    return replay


# The snapshot ###
#
# goals.json starts with its digest: the SHA-256 of the file's own bytes after that first key, so
# checking it costs one hash and no re-serialising. One story a line, each compact (only the
# fields that differ from their defaults). Older snapshots still load: version 2 held every field
# of every story, version 1 also every run (it is rebuilt from the ledger) and a digest over
# sorted keys.

SNAPSHOT_VERSION = 3
_DIGEST_PREFIX = b'{"digest":"'


def snapshot_bytes(plan):
    """The snapshot: its digest, the plan's fields, then one compact story per line (readable,
    and written by json's C encoder, which an `indent` would switch off)."""
    head = {k: v for k, v in plan.items() if k not in ("goals", "digest")}
    head["schema_version"] = SNAPSHOT_VERSION
    goals = [compact(story) for story in plan["goals"]]
    # the stories in one call of the encoder, then a line break before each story: a string's
    # quotes are escaped, so `},{"id":` only ever joins two dicts whose first key is "id" — two
    # stories, when the count says so (a story's "id" comes first; nothing inside one starts so)
    stories = dumps(goals)[1:-1]
    if stories.count('},{"id":') == len(goals) - 1:
        stories = stories.replace('},{"id":', '},\n{"id":')
    else:
        stories = ",\n".join(dumps(s) for s in goals)
    body = (dumps(head)[1:-1] + ',"goals":[\n' + stories + "\n]}\n").encode("utf-8")
    return _DIGEST_PREFIX + sha256_hex(body).encode() + b'",' + body


def canonical_digest(plan):
    """Version 1's digest: over the plan re-serialised with sorted keys."""
    body = {k: v for k, v in plan.items() if k != "digest"}
    return sha256_hex(json.dumps(body, ensure_ascii=False, sort_keys=True,
                                 separators=(",", ":")).encode("utf-8"))


def parse_snapshot(raw, whole=False):
    """goals.json's bytes as a plan, its digest verified; exit 3 when it cannot be trusted.
    `whole`: every story checked too (audit, rebuild), not only those a command touches."""
    try:
        snap = load_json(raw)
    except ValueError as e:
        what = "empty" if not raw.strip() else f"not valid JSON ({e})"
        raise damaged(f"{SNAPSHOT} is {what} — run `audit`; `rebuild` regenerates it from the "
                      "ledger.", "bad_snapshot")
    validate_snapshot(snap, whole)
    if is_original_snapshot(snap):
        return snap
    n = len(_DIGEST_PREFIX)
    if raw.startswith(_DIGEST_PREFIX) and raw[n + 64:n + 66] == b'",':
        good = raw[n:n + 64].decode("ascii", "replace") == sha256_hex(raw[n + 66:])
    else:
        good = snap.get("digest") == canonical_digest(snap)  # version 1's digest
    if not good:
        raise damaged(f"{SNAPSHOT} was changed outside fablize (its digest does not match) — run "
                      "`audit`; `rebuild` regenerates it from the ledger.", "snapshot_edited")
    return snap


def position_error(snap_seq, ledger_seq):
    """The snapshot reflects an event the ledger does not hold (one message, for every reader)."""
    where = "is empty" if not ledger_seq else f"ends at event {ledger_seq}"
    return damaged(f"{SNAPSHOT} reflects event {snap_seq} but {LEDGER} {where} — run `audit`.",
                   "disagree")


def snapshot_damage(store):
    """Why the snapshot in `store` is not one, checked whole, or None when it is sound: a
    command that reads only the stories it touches (validate_snapshot) and failed on something
    a story holds is damage, exit 3; on a sound snapshot the failure is the engine's own bug,
    and keeps its traceback."""
    try:
        raw = read_state_file(store.path(SNAPSHOT))
        if raw is not None:
            parse_snapshot(raw, whole=True)
    except FablizeError as e:
        return e
    except OSError:
        pass
    return None


def loose_snapshot(store):
    """goals.json as a dict with a goals list, or None when it is missing or unreadable."""
    try:
        snap = load_json(read_state_file(store.path(SNAPSHOT)) or b"null")
    except ValueError:
        return None
    return snap if isinstance(snap, dict) and isinstance(snap.get("goals"), list) else None


def stripped_snapshot_error():
    return damaged(f"{SNAPSHOT} lost its ledger position and digest but {LEDGER} is hash-chained: "
                   "it was edited by hand — run `audit`; `rebuild` regenerates it from the "
                   "ledger.", "snapshot_edited")


def legacy_refusal():
    return damaged(f"{SNAPSHOT} was written by the original goals.py; run `status` (or any writing "
                   "command) to import it into a hash-chained ledger first.", "legacy")


class Store:
    """A state directory. Storage never prints: what it has to say goes to `warnings`. Its
    `after_commit` steps run after every writing session that committed an event, still under
    the lock (a shared plan publishes there); storage knows nothing of what they do."""

    def __init__(self, path, discovered, warnings=None):
        self.dir = path
        self.root = os.path.dirname(path)
        self.discovered = discovered
        self.warnings = [] if warnings is None else warnings
        self.after_commit = []

    def path(self, name):
        return os.path.join(self.dir, name)

    def warn(self, text):
        self.warnings.append(text)

    def exists(self):
        """Whether the state directory exists (refusing a planted symlink in its place)."""
        try:
            st = os.lstat(self.dir)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode) and (self.discovered or
                                         os.path.basename(self.dir) == STATE_DIRNAME):
            raise symlink_refusal(self.dir)  # a cloned repository's `.fablize -> elsewhere`
        if not stat.S_ISDIR(os.stat(self.dir).st_mode):
            raise damaged(f"{self.dir} is not a directory.", "not_a_directory")
        return True

    def create_dir(self):
        if not self.exists():
            os.makedirs(self.dir, exist_ok=True)
            write_state_gitignore(self.dir)

    def has_plan_files(self):
        if os.path.lexists(self.path(SNAPSHOT)):
            return True
        try:
            return os.lstat(self.path(LEDGER)).st_size > 0
        except FileNotFoundError:
            return False

    def session(self, exclusive=True, imports=False):
        return Transaction(self) if exclusive else Reading(self, imports)


class Reading:
    """The plan as a reader sees it: no lock taken, nothing written. The snapshot is read before
    the ledger (a writer appends before it replaces the snapshot, so the ledger is never behind
    what the snapshot says); a ledger ahead is replayed in memory, an unterminated last line is
    left for a writer. A reader that raced a plan replacement reads again."""

    writer = False

    def __init__(self, store, imports=False):
        self.store = store
        self.imports = imports
        self.ledger = Ledger(store.path(LEDGER), self.writer)
        self.plan = None

    def __enter__(self):
        # a reader never opens the lock, but a symlink planted there is damage all the same
        if os.path.islink(self.store.path(LOCK)):
            raise symlink_refusal(self.store.path(LOCK))
        return self

    def __exit__(self, *exc):
        self.ledger.close()
        return False

    def require_plan(self):
        plan = self.load()
        if plan is None:
            raise no_plan()
        return plan

    def load(self):
        """The current plan, or None when there is none. Raises FablizeError(exit 3) on damage."""
        for attempt in range(3):
            try:
                return self._load()
            except FablizeError as e:
                # `create --force` and `rebuild` swap files under a reader: read again
                if self.writer or e.code != "disagree" or attempt == 2:
                    raise
                self.ledger.close()
                time.sleep(0.02)

    def _load(self):
        """The plan as this start must see it, reading as little as it can. A snapshot of the
        original tool is imported; one of an older schema is upgraded; no snapshot means the
        whole ledger, replayed streaming. Otherwise the ledger is read backwards from its end
        only as far as the event the snapshot reflects: that line's digest must be the one the
        snapshot names (else the two disagree: damage), and the events after it — a writer
        killed between its two writes — are rolled forward. `last_event` is torn_tail's find,
        (offset, event, digest verified), handed over so the last line is parsed once."""
        self.last_event = None  # a retry reads the ledger afresh
        raw = read_state_file(self.store.path(SNAPSHOT))
        snap = parse_snapshot(raw) if raw is not None else None
        if snap is not None and self.writer and not is_original_snapshot(snap):
            check_graph(snap)
        ledger = self.ledger
        if snap is not None and is_original_snapshot(snap):
            return self.plan_from_original(snap)
        end = self.good_end(snap) if ledger.open() is not None else 0
        if snap is not None and snap["schema_version"] < 2:
            return self.upgrade(snap, end)
        if snap is None and end:  # no snapshot: the plan is the whole ledger's, replayed streaming
            return self.replayed(end)
        snap_seq = snap["ledger"]["seq"] if snap else 0
        newer, found = [], None
        last = getattr(self, "last_event", None)
        for offset, line in ledger.backward(end):
            known = last if last and last[0] == offset else None
            ev = known[1] if known else parse_event(line)
            last = None
            if ev is None:
                raise not_an_event(newer[-1][0]["seq"] - 1 if newer else "at the end")
            if ev["seq"] <= snap_seq:
                found = (ev["seq"], line, bool(known and known[2]))
                break
            newer.append((ev, line))
        if snap is not None and snap_seq > 0:
            if found is None or found[0] < snap_seq:
                raise position_error(snap_seq, found[0] if found else 0)
            if not found[2] and sha256_hex(found[1]) != snap["ledger"]["head"]:
                raise damaged(f"{SNAPSHOT} and {LEDGER} disagree at event {snap_seq} (line "
                              f"{snap_seq} is not the one the snapshot reflects) — run `audit`.",
                              "disagree")
        self.plan = snap
        if newer:
            self.plan = self.roll_forward(snap, newer[::-1])
        return self.plan

    def good_end(self, snap):
        """Where the ledger's acknowledged lines end; a torn last line is left in place."""
        end, torn = self.torn_tail(snap)
        if torn:
            self.store.warn(f"{LEDGER} ends with a torn last line ({len(torn)} bytes, never "
                            "acknowledged); the next writing command moves it aside.")
        return end

    def torn_tail(self, snap):
        """(end, torn): an unterminated last line is a write that never completed — unless the
        snapshot reflects it, or the line before it is damaged too."""
        ledger = self.ledger
        end, torn = ledger.end()
        if not torn and end:
            offset, line = next(ledger.backward(end))
            # The load that follows reuses it, and knows whether it is the line the snapshot
            # reflects: one hash of it a start, and no parse of the acknowledged event (a
            # plan_created of 100,000 stories is a 12 MB line, 0.15 s of json).
            pos = snap.get("ledger") if snap else None
            if (type(pos) is dict and line.startswith(b'{"seq":%d,' % pos["seq"]) and
                    line[-75:-66] == b',"prev":"' and line.endswith(b'"}') and
                    sha256_hex(line) == pos["head"]):  # an event's first and last fields
                self.last_event = (offset, {"seq": pos["seq"]}, True)
            else:
                self.last_event = (offset, parse_event(line), False)
                # a whole line is an acknowledged write: one that is no event (a merge's conflict
                # marker, a hand edit) is damage, for the replay to name; only an unterminated
                # tail is a write that never completed
        if not torn:
            return end, torn
        snap_seq = snap["ledger"]["seq"] if snap and "ledger" in snap else 0
        prev = ledger.last(end) if end else None
        prev_ev = parse_event(prev) if prev is not None else None
        if prev_ev is None and end:
            raise damaged(f"{LEDGER}: the last two lines are damaged — run `audit`.", "bad_line")
        if (prev_ev["seq"] if prev_ev else 0) < snap_seq:
            raise line_error(snap_seq, f"the last line is damaged but {SNAPSHOT} reflects event "
                             f"{snap_seq} — run `audit`.", "bad_line")
        return end, torn

    def roll_forward(self, plan, events):
        """Apply ledger events the snapshot does not reflect yet (a crash between the two
        writes, or a reader that came between them)."""
        pos = plan["ledger"] if plan else {"seq": 0, "head": ZERO_HASH}
        replay = Replay(plan, pos["seq"], pos["head"])
        for ev, line in events:
            replay.feed(line, ev)
        replay.plan["ledger"] = replay.position()
        return replay.plan

    def replayed(self, end):
        """The plan of the ledger's first `end` bytes, replayed from nothing in batches (memory
        flat in the ledger's length, rebuild's cost): what a command gets when goals.json is
        missing; a writer saves it."""
        replay = replay_all(self.ledger, end)
        if replay.plan is not None:
            replay.plan["ledger"] = replay.position()
        self.plan = replay.plan
        return self.plan

    def upgrade(self, snap, end):
        """A version-1 snapshot (it kept every run): its position is checked, then the plan is
        replayed from the ledger."""
        plan = self.replayed(end)
        if (plan["ledger"]["seq"] if plan else 0) < snap["ledger"]["seq"]:
            raise position_error(snap["ledger"]["seq"], plan["ledger"]["seq"] if plan else 0)
        if plan is not None:
            self.store.warn(f"{SNAPSHOT} is in the format of fablize 1 (it kept every run); "
                            + ("it was rewritten from the ledger." if self.writer else
                               "the next writing command rewrites it from the ledger."))
        return plan

    def plan_from_original(self, snap):
        """A plan written by the original goals.py: `status`, the command its users resume with,
        imports it once (a write, under the lock); other readers say how."""
        self.refuse_stripped_snapshot()
        if not self.imports:
            raise legacy_refusal()
        with Transaction(self.store) as t:
            self.plan = t.load()
        return self.plan

    def refuse_stripped_snapshot(self):
        """An original-format goals.json beside a hash-chained ledger is a hand edit, not an
        old plan: importing it would launder whatever it claims."""
        if self.ledger.open() is None:
            return
        end = self.ledger.end()[0]
        last = self.ledger.last(end) if end else None
        if last is not None and parse_event(last) is not None:
            raise stripped_snapshot_error()

    def refuse_original(self):
        """Commands that read the ledger itself (audit, log, rebuild) do not import an original
        plan; they say how to. Any other damage to goals.json is theirs to report or repair."""
        snap = loose_snapshot(self.store)
        if snap is None or not is_original_snapshot(snap):
            return
        last = None
        if self.ledger.open() is not None:
            end = self.ledger.end()[0]
            last = self.ledger.last(end) if end else None
        if last is None or parse_event(last) is None:
            raise legacy_refusal()


class Transaction(Reading):
    """A write: the lock held throughout; load() moves a torn last line aside and saves a rolled
    forward plan; commit() appends one event (one write, fsync) and then replaces the snapshot."""

    writer = True

    def __init__(self, store):
        super().__init__(store)
        self.lock = Lock(store.dir, store.warnings)
        self.last = None

    def __enter__(self):
        self.lock.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            if exc[0] is None and self.last is not None:
                for step in self.store.after_commit:
                    step(self)
        finally:
            self.ledger.close()
            self.lock.__exit__(*exc)
        return False

    def good_end(self, snap):
        end, torn = self.torn_tail(snap)
        if torn:
            self.ledger.cut(end, torn)
            self.store.warn(f"{LEDGER}: a torn last line ({len(torn)} bytes, a write that never "
                            f"completed) was moved to {LEDGER}.broken.")
        return end

    def cut_torn_tail(self, snap):
        """rebuild's repair: the ledger's good end, after moving a torn last line aside."""
        return self.good_end(snap) if self.ledger.open() is not None else 0

    def roll_forward(self, plan, events):
        plan = super().roll_forward(plan, events)
        self.save_snapshot(plan)
        return plan

    def replayed(self, end):
        plan = super().replayed(end)
        if plan is not None:
            self.save_snapshot(plan)
        return plan

    def plan_from_original(self, snap):
        """Import for real: the original's files go to archive/, a chained ledger starts."""
        self.refuse_stripped_snapshot()
        old = self.replace_plan(original_plan_fields(snap, self.store.root))
        self.store.warn(f"imported the plan written by the original goals.py; its files are "
                        f"kept in {old['path']}.")
        return self.plan

    def commit(self, kind, **fields):
        """Append one event (checked by apply_event first) and save the snapshot."""
        plan, line = self.prepare(kind, fields)
        self.ledger.append(line, self.ledger.open(create=True))
        self.settle(plan)
        return self.last

    def prepare(self, kind, fields):
        plan, self.last, line = make_event(self.plan, kind, fields)
        return plan, line

    def settle(self, plan):
        self.save_snapshot(plan)
        self.plan = plan

    def save_snapshot(self, plan):
        write_atomic(self.store.path(SNAPSHOT), snapshot_bytes(plan), sweep=True)

    def replace_plan(self, fields):
        """Start a new plan over the current one, which moves whole to archive/<plan id>/.
        The old plan stays current until the new ledger is durable, so a crash anywhere leaves
        the old plan or the new one, never none: its files are linked into the archive, then
        the new first event replaces the ledger (swap_ledger)."""
        old = self.archive_current()
        plan, line = self.prepare("plan_created", dict(fields, replaces=old))
        self.swap_ledger(line + b"\n", plan)
        self.drop_replaced_logs()
        return old

    def drop_replaced_logs(self):
        """After the swap: the replaced plan's run logs (linked into its archive) leave runs/.
        A kill before this leaves them there, harmless: audit reads only the logs the current
        plan's runs name, and a new run's log replaces a file of the same name."""
        store = self.store
        for name in (RUNS, LEDGER + ".broken"):
            path = store.path(name)
            if os.path.isdir(path) and not os.path.islink(path):
                for entry in os.listdir(path):
                    if not entry.startswith("."):  # a run under way writes runs/.run-*
                        os.unlink(os.path.join(path, entry))
            elif os.path.lexists(path):
                os.unlink(path)

    def swap_ledger(self, data, plan):
        """Replace the whole ledger with `data` and the snapshot with `plan`'s, crash-safe: the
        new ledger is written and fsynced beside the old one, the snapshot removed (from then a
        crash replays the new ledger from nothing), and one rename swaps it in. The rename is
        the moment the new ledger becomes current; before it, the old one still is."""
        store = self.store
        staged = store.path(LEDGER + ".new")
        if os.path.lexists(staged):
            os.unlink(staged)  # left by a crash before its swap: never current
        fd = open_state_file(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            crash_point("before-ledger-write")
            write_all(fd, data)
            crash_point("after-ledger-write")
            os.fsync(fd)
            crash_point("after-ledger-fsync")
        finally:
            os.close(fd)
        self.ledger.close()
        if os.path.lexists(store.path(SNAPSHOT)):
            os.unlink(store.path(SNAPSHOT))
        os.replace(staged, store.path(LEDGER))
        fsync_dir(store.dir)
        self.settle(plan)

    def archive_current(self):
        """Copy the current plan into archive/<plan id>/, its run logs too (hard links: a
        constant time a file); returns what a new plan_created names as the plan it replaces."""
        store = self.store
        snap = loose_snapshot(store)
        plan_id = snap.get("plan_id") if snap else None
        head, seq = None, 0
        if self.ledger.open() is not None:
            end = self.ledger.end()[0]
            last = self.ledger.last(end) if end else None
            if last is not None:
                head = sha256_hex(last)
                ev = parse_event(last)
                seq = ev["seq"] if ev else None
        plan_id = (plan_id if is_plan_id(plan_id)
            else "unknown-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
        ensure_subdir(store.path(ARCHIVE))
        dest = free_name(store.path(os.path.join(ARCHIVE, plan_id)))
        os.mkdir(dest)
        for name in (SNAPSHOT, LEDGER):
            if os.path.lexists(store.path(name)):
                link_or_copy(store.path(name), os.path.join(dest, name))
        # the old plan's logs are linked in too: they leave runs/ only once the new plan is
        # current (drop_replaced_logs), so a kill before the swap leaves the old plan whole
        if os.path.lexists(store.path(LEDGER + ".broken")):
            link_or_copy(store.path(LEDGER + ".broken"), os.path.join(dest, LEDGER + ".broken"))
        runs = store.path(RUNS)
        if os.path.isdir(runs) and not os.path.islink(runs):
            os.mkdir(os.path.join(dest, RUNS))
            for entry in os.listdir(runs):
                if not entry.startswith(".") and os.path.isfile(os.path.join(runs, entry)):
                    link_or_copy(os.path.join(runs, entry), os.path.join(dest, RUNS, entry))
            fsync_dir(os.path.join(dest, RUNS))
        fsync_dir(dest)
        fsync_dir(store.dir)
        crash_point("after-archive-snapshot")
        self.plan = None
        return {"plan_id": plan_id, "head": head, "seq": seq,
                "path": os.path.relpath(dest, store.dir)}


# Tools: git and the other programs the engine starts ##########################################
# One policy for every program the engine and its rooms start (git, ssh-keygen, a shell for
# doctor): one timeout, never a prompt for credentials, a missing program or a timeout as one
# line. Like git-filter-repo's GitUtils: nothing else calls subprocess for a tool.
TOOL_TIMEOUT = 120.0


def run_tool(argv, cwd=None, data=None, what=None, timeout=TOOL_TIMEOUT, shell=False, env=None):
    """(exit code, stdout bytes, stderr text) of a program; `data` is its stdin (else none),
    `env` variables it gets besides this process's."""
    import subprocess
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", GIT_ASKPASS="", SSH_ASKPASS="", **(env or {}))
    name = argv.split()[0] if shell else argv[0]
    try:
        p = subprocess.run(argv, cwd=cwd, input=data, capture_output=True, timeout=timeout,
                           env=env, shell=shell,
                           stdin=subprocess.DEVNULL if data is None else None)
    except FileNotFoundError:
        raise refused(f"{name} is not installed (or not on PATH): {what or name} needs it.",
                      "tool_missing")
    except subprocess.TimeoutExpired:
        raise damaged(f"{name} took more than {timeout:g} s ({what or name}).", "tool_timeout")
    except (OSError, ValueError) as e:  # ValueError: a NUL in an argument
        raise damaged(f"{name} failed to run: {one_line(e)}", "io_error")
    return p.returncode, p.stdout, p.stderr.decode("utf-8", "replace").strip()


def git(root, *args, data=None, what=None, env=None):
    """(exit code, stdout bytes, stderr text) of git in the repository at `root`."""
    return run_tool(["git", "-C", root, *args], data=data, what=what or "this command", env=env)


def git_out(root, *args, data=None, what=None, env=None):
    """git's stdout; a failure is damage, with git's own reason."""
    code, out, err = git(root, *args, data=data, what=what, env=env)
    if code != 0:
        raise damaged(f"git {args[0]} failed: {one_line(err)[:300]}", "git_failed")
    return out


def repo_root(start):
    """The repository holding `start`: the nearest directory at or above it that holds `.git`
    (a folder, or the file of a worktree or submodule), or None. The one root finder: no git
    process, so every start can afford it."""
    d = os.path.realpath(start)
    while True:
        if os.path.lexists(os.path.join(d, ".git")):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def repo_relative(path):
    """`path` relative to its repository ("." at the top), or None outside one."""
    top = repo_root(path)
    return (None if top is None else
        os.path.relpath(os.path.realpath(path), top).replace(os.sep, "/"))


MERGE_DRIVER = b'[merge "fablize"]'  # the git config section install-merge writes


def merge_driver_missing(root):
    """Whether the repository's committed .gitattributes names fablize's merge driver while
    this clone's git config (its own, the user's, the global one) lacks it: a fresh clone,
    whose merges would leave conflict markers in the plan. Read from the files, no git
    process: every command can afford it."""
    top = repo_root(root)
    if top is None or MERGE_ATTRIBUTE not in (read_plain(os.path.join(top, ".gitattributes"))):
        return False
    git_dir = os.path.join(top, ".git")
    if os.path.isfile(git_dir):  # a worktree or submodule: `gitdir: PATH`, maybe a commondir
        link = read_plain(git_dir).decode("utf-8", "replace").partition("gitdir:")[2].strip()
        git_dir = os.path.join(top, link)
        common = read_plain(os.path.join(git_dir, "commondir")).decode("utf-8", "replace").strip()
        git_dir = os.path.join(git_dir, common) if common else git_dir
    home = os.path.expanduser("~")
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    return not any(MERGE_DRIVER in read_plain(path) for path in (
        os.path.join(git_dir, "config"), os.path.join(home, ".gitconfig"),
        os.path.join(xdg, "git", "config")))


MERGE_ATTRIBUTE = b"merge=fablize"
MERGE_QUIET = ("install-merge", "setup", "merge-driver", "audit", "doctor")  # doctor: a finding


def read_plain(path):
    """A small file's bytes, or b"" when it cannot be read (a config, an attributes file)."""
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20)
    except OSError:
        return b""


def git_state(root, state_dir):
    """(HEAD, dirty, tree) of the repository at `root` as a run starts: the commit, whether the
    working tree differs from it, and the id of the tree the working tree holds (what `git add
    -A` would commit, the state directory left out, through an index of its own). The tree lets
    audit tell a run made before its exact tree was committed — an honest run — from one made
    on a tree that never was. (None, None, None) outside a repository."""
    import shutil
    import tempfile
    try:
        code, out, _ = git(root, "rev-parse", "HEAD", "--git-path", "index")
        if code != 0:
            return None, None, None
        head, index = out.decode("utf-8", "surrogateescape").split("\n")[:2]
        rel = os.path.relpath(state_dir, root).replace(os.sep, "/")
        paths = [".", ":(exclude,literal)" + rel] if not rel.startswith("..") else ["."]
        with tempfile.TemporaryDirectory(prefix="fablize-index-") as tmp:
            own = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
            try:  # the index's stat cache: a big tree is not hashed anew
                shutil.copyfile(os.path.join(root, index), own["GIT_INDEX_FILE"])
            except OSError:
                pass
            if git(root, "add", "-A", "--", *paths, env=own)[0] != 0:
                return head, None, None
            code, out, _ = git(root, "write-tree", env=own)
        tree = out.decode().strip() if code == 0 else None
        dirty = git(root, "diff", "--quiet", head, tree, "--", *paths)[0] != 0 if tree else None
    except FablizeError:
        return None, None, None
    return head, dirty, tree


def tree_state(root, state_dir):
    """(sha256, file count) of the working tree at `root`: every tracked and untracked file
    (git's ignore rules apply), by name, mode and content; the state directory is left out.
    Outside git, every file under `root` but .git/ and the state directory."""
    top = repo_root(root)
    names, ignored = None, []
    if top is not None:
        code, out, _ = git(root, "ls-files", "-z", "--cached", "--others",
                           "--exclude-per-directory=.gitignore", "--full-name", what="judge-packet")
        if code == 0:
            names = sorted(set(os.path.join(top, n.decode("utf-8", "surrogateescape"))
                               for n in out.split(b"\0") if n))
            # what .gitignore files hide counts by name (a new ignored file, or a .gitignore
            # that hides itself, changes the tree too); folders once, not file by file
            code, out, _ = git(root, "ls-files", "-z", "--others", "--ignored",
                               "--exclude-per-directory=.gitignore", "--directory", "--full-name",
                               what="judge-packet")
            ignored = sorted(n.decode("utf-8", "surrogateescape") for n in out.split(b"\0")
                             if n) if code == 0 else []
    if names is None:
        names = []
        for d, subdirs, files in os.walk(root):
            subdirs[:] = [x for x in subdirs if x != ".git"
                          and os.path.join(d, x) != state_dir]
            names += [os.path.join(d, f) for f in files]
        names.sort()
    digest, count = _sha256(), 0
    state = os.path.join(os.path.abspath(state_dir), "")
    for name in ignored if top is not None and names is not None else []:
        if not os.path.join(top, name).startswith(state) and name != ".git/":
            digest.update(f"ignored:{name}\n".encode("utf-8", "surrogateescape"))
    for path in names:
        if path.startswith(state):  # by its own path: a symlink into it is a file of the tree
            continue
        try:
            st = os.lstat(path)
        except OSError:
            entry = "missing"
        else:
            if stat.S_ISLNK(st.st_mode):
                entry = "link:" + os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                entry = f"{st.st_mode & 0o111:o}:{file_sha256(path)}"
            else:
                entry = "other"
        rel = os.path.relpath(path, root)
        digest.update(f"{rel}\0{entry}\n".encode("utf-8", "surrogateescape"))
        count += 1
    return digest.hexdigest(), count


# variables that change what a witnessed command does, recorded with each run (a hint)
WITNESS_ENV = ("PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH",
               "PYTHONNOUSERSITE", "PYTHONUSERBASE", "LD_PRELOAD", "LD_LIBRARY_PATH",
               "DYLD_INSERT_LIBRARIES", "DYLD_LIBRARY_PATH", "MAKEFLAGS", "MAKEFILES",
               "BASH_ENV", "ENV", "NODE_OPTIONS", "NODE_PATH", "PERL5OPT", "RUBYOPT")


def command_program(cmd, root):
    """The program a shell command line starts first, or None (a builtin, a variable, a line
    that does not parse, a program that is nowhere)."""
    try:
        programs = command_programs(cmd, root)
    except ValueError:
        return None
    return programs[0][1] or None if programs else None


def file_sha256(path):
    digest = _sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def witness_env():
    """The listed variables that are set, each by its name and a digest of its value: what the
    audit compares between runs, and nothing that tells anyone what the value was."""
    return {name: "sha256:" + sha256_hex(fix_argv_text(os.environ[name]).encode("utf-8"))[:16]
            for name in WITNESS_ENV if name in os.environ}


def run_provenance(root, cmd):
    """Where and with what a witnessed run ran, as a plan may publish it: the folder relative to
    the repository, the program by its name and the digest of its file, the environment by
    names and digests — a hint for the reviewer (an agent with a shell can still lie about its
    environment; only a re-witnessed run is proof)."""
    program = command_program(cmd, root)
    return {"dir": repo_relative(root), "program": program and os.path.basename(program),
            "program_sha256": file_sha256(program) if program else None, "env": witness_env()}


# Secrets: whatever looks like one is masked before anything is written — a run's log and tail,
# an observed command and what the harness said of it, a --run command, evidence — the way CI
# systems mask theirs: the values of this environment's variables whose names say they are
# secret, and well-known shapes of tokens; in a command line, also the value of an assignment
# to such a name (`GITHUB_TOKEN=… pytest`). A committed plan, and a shared plan's refs, are read
# by everyone who can read the repository.
SECRET_WORDS = (r"token|secret|passw(?:or)?d|passphrase|credential|api_?key|access_?key|"
                r"private_?key|auth_?key|signing_?key")
# well-known token shapes, each by its literal prefix (what a quick scan looks for first) and
# the rest of its pattern; a prefix that ends words too (task-queue, AKIA in no word) must start
# one here
SECRET_SHAPES = (
    *((f"gh{k}_", r"[A-Za-z0-9]{30,}") for k in "pousr"), ("github_pat_", r"\w{20,}"),
    ("AKIA", r"[0-9A-Z]{16}"), *((f"xox{k}-", r"[\w-]{10,}") for k in "abprs"),
    ("sk-", r"(?:ant-)?[\w-]{20,}"), ("AIza", r"[\w-]{35}"), ("npm_", r"[A-Za-z0-9]{36}"),
    ("glpat-", r"[\w-]{20}"), ("eyJ", r"[\w-]{10,}\.eyJ[\w-]{10,}\.[\w-]{10,}"))
_WORD_START = ("sk-", "AKIA", "AIza", "npm_", "glpat-", "eyJ")
# a shape's body is first tried stopping where another token begins (two tokens side by side
# are two), then whole (a token that holds another's prefix is still one)
_NOT_A_PREFIX = "(?!" + "|".join(re.escape(prefix) for prefix, _ in SECRET_SHAPES) + ")"
# an assignment to a name that says it is secret — it ends with the word (GITHUB_TOKEN,
# db_password, AWS_SECRET_ACCESS_KEY) or holds SECRET (SECRET_KEY_BASE) — not max_tokens,
# TOKENIZERS_PARALLELISM or password_min_length; nor a value the shell fills in ($GITHUB_TOKEN,
# ${{ secrets.X }}), a comparison (token==x), a null (password=None) or what closes a call
# after it. Linear: a word starts it, and one with no `=` in it fails at once.
SECRET_ASSIGNMENT = (r"(?<![\w-])(?=\w*=)((?:\w*?(?i:" + SECRET_WORDS + r")|(?i:\w*secret\w*))=)"
                     r"(?![=$]|(?:None|null|nil|true|false|True|False)\b)"
                     r"(?:'[^']*'|\"[^\"]*\"|[^\s'\"(),;]+)")
MASK = "***"
SHORT_TEXT = 48             # characters: below this, looks_secret skips its literal pre-scan
PRIVATE_KEY = b"PRIVATE KEY-----"


def secret_values():
    """This environment's values of variables whose names say they are secret, longest first
    (so that none is masked half)."""
    names = regex("(?i)" + SECRET_WORDS)
    values = {fix_argv_text(v) for k, v in os.environ.items() if len(v) >= 6 and names.search(k)}
    # each also as JSON writes it (what the harness reports arrives as JSON text)
    values |= {json.dumps(v)[1:-1] for v in values}
    return sorted(values, key=len, reverse=True)


def _secrets(key):
    """(pattern, literals) of what is masked in text of `kind` (str or bytes): a text holding
    none of the literals holds no secret (output, not a command: a name's case varies), which
    a scan for each finds at memory speed, where the pattern would cost ~20 ns a byte."""
    kind, command = key
    text = "|".join(([SECRET_ASSIGNMENT] if command else []) +
                    [("(?<![\\w-])" if prefix in _WORD_START else "") + re.escape(prefix) +
                     f"(?:{tempered(rest)}|{rest})" for prefix, rest in SECRET_SHAPES] +
                    [re.escape(v) for v in secret_values()])
    if kind is bytes:
        text = text.encode("utf-8", "surrogateescape")
    return re.compile(text), None if command else secret_literals(kind)


def secret_literals(kind):
    """What a text of `kind` that holds a secret holds literally (not a command, whose names'
    case varies): the shapes' prefixes and the secret values."""
    literals = [prefix for prefix, _ in SECRET_SHAPES] + secret_values()
    return literals if kind is str else [x.encode("utf-8", "surrogateescape") for x in literals]


def tempered(body):
    """A token shape's body whose characters each stop where another token begins."""
    return re.sub(r"\[[^\]]*\]|\\w", lambda m: f"(?:{_NOT_A_PREFIX}{m.group(0)})", body)


_SECRETS = Lazy(_secrets)  # (str or bytes, a command line?) -> (pattern, literals), once a run


def mask(text, command=False):
    """`text` (str or bytes) with every secret it holds replaced by ***; a `command` line's
    assignments to a secret-looking name keep the name (`GITHUB_TOKEN=***`)."""
    if not looks_secret(text, command):
        return text
    star = MASK.encode() if type(text) is bytes else MASK
    return _SECRETS[type(text), command][0].sub(
        lambda m: (m.lastindex and m.group(1) or star[:0]) + star, text)


def looks_secret(text, command=False):
    if not text:
        return False
    pattern, literals = _SECRETS[type(text), command]
    # the pattern costs ~50 ns a character, a scan for each literal ~1 ns a character plus
    # ~40 ns: on a short text (a command, a one-line tail) the pattern alone is cheaper
    # (audit of 100,000 real runs, bench.py section 4: 2.13 → 2.03 s CPU with this threshold)
    if literals is not None and len(text) > SHORT_TEXT and not any(x in text for x in literals):
        return False
    return pattern.search(text) is not None


def masked_text(name, text, root=None):
    """An agent's text as the plan keeps it: within the limit, its secrets masked, and the
    places of the machine under `root` shown relative to them (mask_places)."""
    return mask_places(mask(limit_text(name, text), command=True), root)


# Places: where this machine keeps the work and its user's files. Output names them (a
# traceback's file, pytest's rootdir, a tool under the home folder) and so do an agent's commands
# (`cd /home/alice/proj && pytest`); a plan that kept them would tell everyone who reads the
# repository the machine's layout and its user's name. What the engine records of output, of
# the harness and of an agent's words shows them as a shell would let one type them: the
# repository's root as `.`, the home folder as `~`. A command the engine runs again (a frozen
# check, a --run) is kept as given: it must run as written.
def _places(key):
    """(pattern, {place: shown}) for text of `kind` (str or bytes) under `root`, or None."""
    kind, root = key
    shown = {}
    for path, name in ((root, "."), (logical_root(root), "."), (os.environ.get("HOME"), "~")):
        for p in (path, path and os.path.realpath(path)):
            p = (p or "").rstrip("/")
            # a place of one folder names no one (/root, CI's and containers' user; /app): it
            # stays, as it does on other machines in the output (`scp x web:/root/`, GET /app/x)
            if p.startswith("/") and p.count("/") >= 2 and p not in shown:
                shown[p] = name
    if not shown:
        return None
    # a whole place only, the longest first (a root inside the home folder is `.`): not the end
    # of a longer path (/root in /srv/root) but where a place starts — after a space, a quote, an
    # `=`, a JSON escape (`\n/root`), a URL's `://`, a flag (`-I/root/include`), a terminal's
    # colour (`\x1b[1m/root`) — and not the start of a longer name (/root in /rootfs, /root.bak,
    # /root~), a sentence's stop aside
    text = (r"(?:(?<![\w.~/-])|(?<=\\[nrt])|(?<=://)|(?<=(?<![^\s\"'=(])-[A-Za-z])|"
            r"(?<=\\[nrt]-[A-Za-z])|(?<=[\d\[;][mK]))(?:"
            + "|".join(map(re.escape, sorted(shown, key=len, reverse=True)))
            + r")(?![\w~-]|\.[\w-])")
    if kind is bytes:
        return (re.compile(text.encode("utf-8", "surrogateescape")),
                {k.encode("utf-8", "surrogateescape"): v.encode() for k, v in shown.items()})
    return re.compile(text), shown


def logical_root(root):
    """`root` as the shell that started the engine names it ($PWD), where a symlink on the way
    makes that differ from the real path the engine works with (a check's `pwd` says it so)."""
    pwd = os.environ.get("PWD")
    if not root or not pwd or not pwd.startswith("/"):
        return None
    rel = os.path.relpath(os.path.realpath(pwd), os.path.realpath(root))
    if rel == ".":
        return pwd
    tail = "/" + rel
    if rel.startswith("..") or not pwd.rstrip("/").endswith(tail):
        return None
    return pwd.rstrip("/")[:-len(tail)]


_PLACES = Lazy(_places)


def mask_places(text, root):
    """`text` (str or bytes) with the repository's root (`root`, when given) shown as `.` and
    the home folder as `~`, wherever a whole one of them is named."""
    places = _PLACES[type(text), root] if text else None
    if places is None:
        return text
    pattern, shown = places
    dot, slash = (".", "/") if type(text) is str else (b".", b"/")

    def place(m):  # the root at a sentence's stop is `./.`: `..` would say its parent
        name = shown[m.group(0)]
        return name + slash if name == dot and m.string[m.end():m.end() + 1] == dot else name
    return pattern.sub(place, text)


def masked_tail(text, n, root):
    """The last `n` characters of what the harness reported (a command, its output), its
    secrets and places masked before it is cut, so that none is cut in half and kept: a long
    text is first cut to its last 64·n characters at a space, without the word cut in half."""
    text = text or ""
    if len(text) > 64 * n:
        text = text[-64 * n:]
        text = text[min(i for i in (text.find(" "), text.find("\n"), len(text)) if i >= 0):]
    return last_chars(mask_places(mask(text, True), root), n)


def check_command(option, cmd):
    """A command the engine will run and record: never one that carries a secret, which the
    plan would publish and a re-run could not repeat masked."""
    if looks_secret(cmd, command=True):
        raise usage(f"{option} `{one_line(mask(cmd, command=True))}` holds what looks like a "
                    "secret, and a plan is read by everyone who can read the repository: keep "
                    "it in the environment (the command sees it there) and leave it out of the "
                    "command.", "secret_in_command")
    return limit_text(option, cmd)


def plan_text(name, text):
    """The plan's own words (its brief, a story's title, objective, acceptance items) as typed:
    never one that carries a secret, which masking would silently change."""
    if looks_secret(text):  # a token's shape or a secret's value; `max_tokens=…` is words
        raise usage(f"{name} `{one_line(mask(text))}` holds what looks like a secret, and a "
                    "plan is read by everyone who can read the repository: leave it out.",
                    "secret_in_plan")
    return limit_text(name, text)


_LAST_BREAK = re.compile(rb"[^\w./~:%+=@\\-][\w./~:%+=@\\-]*\Z")  # the last byte no token holds
HOLD = 4096  # bytes of a line too long to hold that wait for what follows them


class Masker:
    """Masks a stream of output, a line at a time (a secret never spans lines; a line held
    back waits for its end, up to READ_CHUNK bytes); a private key's lines are dropped whole,
    from its BEGIN line to its END line. A line longer than that is cut where no token or place
    (under `root`) goes on, its last HOLD bytes kept back for what follows them."""

    def __init__(self, root=None):
        self.carry = b""
        self.in_key = False
        self.root = root

    def cut(self, data):
        """Where to cut a line too long to hold: at a byte no token or path holds (a space, a
        quote) near its end, else there; moved back before a secret or a place that goes on
        past it (a secret's value or a path may hold a space). What matches over more than
        HOLD bytes is no token: cut through, so that the line held back stays short."""
        end = len(data) - HOLD
        found = _LAST_BREAK.search(data, end - READ_CHUNK // 4, end)
        cut = found.start() + 1 if found else end
        for pattern in (_SECRETS[bytes, False][0], (_PLACES[bytes, self.root] or [None])[0]):
            for m in pattern.finditer(data) if pattern is not None else ():
                if m.start() < cut < m.end() and m.end() - m.start() <= HOLD:
                    cut = m.start()
        return cut

    def feed(self, chunk, final=False):
        data = self.carry + chunk
        cut = len(data) if final else data.rfind(b"\n") + 1
        if not cut and len(data) >= READ_CHUNK:
            cut = self.cut(data)
        self.carry = data[cut:]
        block = data[:cut]
        if self.in_key or PRIVATE_KEY in block:
            block = self.keys(block)
        return mask(block)

    def keys(self, block):
        out = []
        for line in block.splitlines(True):
            key = PRIVATE_KEY in line
            if self.in_key:
                if key and b"-----END" in line:
                    self.in_key = False
                    out.append(MASK.encode() + line[len(line.rstrip(b"\r\n")):])
                continue
            if key and b"-----BEGIN" in line:
                self.in_key = b"-----END" not in line
                line = (line[:line.index(b"-----BEGIN")] + MASK.encode() +
                    line[len(line.rstrip(b"\r\n")):])
            out.append(line)
        return b"".join(out)


# Running checks ###############################################################################
_SHELL_BUILTINS = frozenset(
    "! : . [ [[ alias bg break builtin case cd command continue declare do done echo elif else "
    "esac eval exec exit export false fi for function getopts hash if in let local printf pwd "
    "read readonly return set shift source test then time times trap true type ulimit umask "
    "unalias unset until wait while { }".split())
_PREFIX_WORDS = frozenset("! { if then elif else while until do exec time command builtin "
                          "nohup env".split())


def command_programs(cmd, root):
    """[(word, its path)] for each program a shell command line starts (the first word, and the
    first after each `;`, `&&`, `|`, …, past `VAR=value`, `exec`, `time`, `if`, …), found as the
    shell would find it (PATH, or a path relative to `root`): None when it is nowhere, "" for a
    builtin or a program named by a variable (nothing to look up). The one program finder: a
    check that cannot run, a run's provenance and doctor's interpreter all read it. Raises
    ValueError for a line the shell could not parse either."""
    import shlex
    import shutil
    lexer = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    found, expect = [], True
    for token in lexer:
        if token and all(c in "();<>|&" for c in token):
            expect = token in (";", "&&", "||", "|", "&", "(", "((")
            continue
        if not expect or token in _PREFIX_WORDS or re.fullmatch(r"[A-Za-z_]\w*=.*", token,
                                                                  re.S | re.A):
            continue
        expect = False
        if token in _SHELL_BUILTINS or "$" in token or "`" in token:
            found.append((token, ""))
        elif "/" in token:
            path = os.path.abspath(token if os.path.isabs(token) else os.path.join(root, token))
            found.append((token, path if os.path.exists(path) else None))
        else:
            where = shutil.which(token)
            found.append((token, os.path.abspath(where) if where else None))
    return found


def unverifiable_reason(cmd, root):
    """Why `cmd` cannot run here (a program not found), or None if it looks runnable."""
    try:
        programs = command_programs(cmd, root)
    except ValueError as e:
        return f"cannot parse the command ({e})"
    for word, path in programs:
        if path is None:
            return f"{word}{NOT_THERE}" if "/" in word else f"{word} is not on PATH"
    return None


NOT_THERE = " does not exist"  # a check's file: a story may yet write it (test-first)


def file_not_there_yet(u):
    """Whether an unverifiable check only waits for its file (a story may write it)."""
    return u["reason"].endswith(NOT_THERE)


def unverifiable_label(u):
    where = f"{one_line(u['id'])} check {u['check'] + 1}"
    return (f"· {where} waits for its file" if file_not_there_yet(u)
            else f"⚠ {where} cannot run here")


def unverifiable_checks(stories, root):
    found = []
    for story in stories:
        for i, cmd in enumerate(story.get("checks", [])):
            reason = unverifiable_reason(cmd, root)
            if reason:
                found.append({"id": story["id"], "check": i, "cmd": cmd, "reason": reason})
    return found


def kill_group(proc):
    import signal
    try:
        if os.name == "nt":  # no process groups: taskkill ends the whole tree under the shell
            import subprocess
            try:
                subprocess.run(["taskkill", "/F", "/T", "/PID", str(proc.pid)],
                               capture_output=True, stdin=subprocess.DEVNULL, timeout=30)
            except subprocess.SubprocessError:
                pass
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


class RunInterrupted(BaseException):
    """A stop signal during a run (not an Exception: no handler may swallow it)."""


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP while a user's command runs: the first one stops the run (its
    whole process group is killed) and is kept to be reported; nothing else is started."""

    NAMES = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self):
        self.got = None
        self.waiting = False
        self.saved = {}

    def __enter__(self):
        import signal
        import threading
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may set handlers; the caller's stay in force
        for name in self.NAMES:
            num = getattr(signal, name, None)
            if num is not None:
                try:
                    self.saved[num] = signal.signal(num, self._handle)
                except (ValueError, OSError):
                    pass
        return self

    def _handle(self, signum, frame):
        if self.got is None:
            import signal
            self.got = signal.Signals(signum).name
            if self.waiting:
                raise RunInterrupted()

    def wait(self, proc, timeout):
        """proc.wait(timeout), cut short (RunInterrupted) by a stop signal, even an earlier one."""
        self.waiting = True
        try:
            if self.got is not None:
                raise RunInterrupted()
            return proc.wait(timeout=timeout)
        finally:
            self.waiting = False

    def __exit__(self, *exc):
        import signal
        for num, old in self.saved.items():
            signal.signal(num, old if old is not None else signal.SIG_DFL)
        return False


def run_command(cmd, cwd, timeout, stream, log_path):
    """Run `cmd` through the shell in `cwd`, stdin closed, its output masked (secrets) and then
    streamed (escaped) to `stream` and written whole to `log_path`. Returns the run's record,
    whose size, digest and tail are read back from the log on disk: a log that could not be
    written whole (a full disk, a read-only folder) makes the run an error, and the record
    never claims more than the disk holds."""
    import codecs
    import subprocess
    import threading
    masker = Masker(cwd)
    try:
        log_fd = open_state_file(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        log_error = [None]
    except OSError as e:
        log_fd, log_error = None, [e]
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    # a child that escaped the process group may keep writing after the run is over: what it
    # writes then belongs to no run, so the reader drops it once `finished` is set
    guard = threading.Lock()
    finished = [False]
    at_start = [True]
    # once the group is gone, what it wrote is in the pipe: the reader empties it and stops, so
    # a child that escaped the group and keeps the pipe open costs no wait (where pipes can be
    # polled; on Windows the reader waits for the end of the pipe, at most 5 s)
    draining = [False]

    def take(masked):
        """One masked piece of output (whole lines, but for the last): to the log (until a
        write fails) with the machine's places shown as a plan may publish them, then as it is
        to the stream (the terminal is no publication: `pwd` shows where it ran)."""
        if log_error[0] is None and masked:
            try:
                write_all(log_fd, mask_places(masked, cwd))
            except OSError as e:  # the run goes on; its record will say the log is short
                log_error[0] = e
        if stream is not None and masked:
            try:
                piece, at_start[0] = quote_output(clean(decoder.decode(masked)), at_start[0])
                stream.write(piece)
                stream.flush()
            except (OSError, ValueError):
                pass

    def pump(pipe):
        import select
        poller = select.poll() if hasattr(select, "poll") else None  # poll: no descriptor limit
        if poller is not None:
            poller.register(pipe, select.POLLIN)
        try:
            while True:
                if poller is not None and not poller.poll(0 if draining[0] else 50):
                    if draining[0]:
                        return
                    continue
                chunk = os.read(pipe, READ_CHUNK)
                if not chunk:
                    return
                with guard:
                    if finished[0]:
                        return
                    take(masker.feed(chunk))
        except OSError:
            return
        finally:
            os.close(pipe)  # the reader's own descriptor: never reused under another run

    started = time.monotonic()
    record = {"cmd": cmd, "cwd": repo_relative(cwd) or ".", "exit_code": None, "signal": None,
              "timed_out": False, "error": None}
    # Ctrl-C, an agent's tool timeout (SIGTERM) or a closed terminal must not leave the command
    # running on its own in its new session: a stop signal kills its group like a timeout does
    with StopSignals() as stop:
        proc = None
        if log_fd is None:
            record["error"] = f"its log could not be written ({log_reason(log_error[0])})"
        else:
            try:
                kwargs = ({"start_new_session": True} if os.name != "nt" else
                    {"creationflags": getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0)})
                proc = subprocess.Popen(cmd, shell=True, cwd=cwd, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        **kwargs)
            except (OSError, ValueError) as e:  # ValueError: a NUL in the command
                record["error"] = one_line(str(e))
        if proc is not None:
            reader = threading.Thread(target=pump, args=(os.dup(proc.stdout.fileno()),),
                                      daemon=True)
            proc.stdout.close()
            reader.start()
            try:
                code = stop.wait(proc, timeout)
            except subprocess.TimeoutExpired:
                record["timed_out"] = True
                kill_group(proc)
                code = proc.wait()
            except RunInterrupted:
                kill_group(proc)
                code = proc.wait()
            # what it left behind is part of the check: stop it, then drain what was written
            kill_group(proc)
            draining[0] = True
            reader.join(5)
            if code < 0:
                import signal
                try:
                    record["signal"] = signal.Signals(-code).name
                except ValueError:
                    record["signal"] = f"signal {-code}"
            record["exit_code"] = code
    if stop.got:
        record["interrupted"] = stop.got
    with guard:
        finished[0] = True
        take(masker.feed(b"", final=True))
    if log_fd is not None:
        try:
            os.fsync(log_fd)
        except OSError as e:
            log_error[0] = log_error[0] or e
        os.close(log_fd)
    size, sha, tail = (log_on_disk(log_path) if log_fd is not None
                       else (0, _sha256().hexdigest(), b""))
    if log_error[0] is not None and record["error"] is None:
        record["error"] = (f"its log could not be written whole ({log_reason(log_error[0])}; "
                           f"{size:,} bytes kept): the run counts for nothing")
    record.update(duration_s=round(time.monotonic() - started, 3), bytes=size, sha256=sha,
                  tail=tail.decode("utf-8", "replace")[-TAIL_CHARS:])
    if stream is not None and not at_start[0]:
        stream.write("\n")
    return record


def log_reason(error):
    return one_line(error.strerror or str(error)) if isinstance(error, OSError) else one_line(error)


def log_on_disk(path):
    """(size, sha256, last bytes) of the log as the disk holds it, read back."""
    digest = _sha256()
    size, tail = 0, b""
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(READ_CHUNK), b""):
                digest.update(chunk)
                size += len(chunk)
                tail = (tail + chunk)[-4 * TAIL_CHARS:]
    except OSError:
        pass
    return size, digest.hexdigest(), tail


OUTPUT_BAR = "  │ "


def quote_output(text, at_start):
    """A command's streamed output, every line behind a bar, so that no line it prints can
    pass for the engine's own; returns the text and whether the next chunk starts a line."""
    if not text:
        return "", at_start
    quoted = (OUTPUT_BAR if at_start else "") + text.replace("\n", "\n" + OUTPUT_BAR)
    if text.endswith("\n"):
        return quoted[:-len(OUTPUT_BAR)], True
    return quoted, False


def verification_runs(story, verify_cmd, run):
    """What verifying `story` runs — [(frozen check index, or None for --verify-cmd, command)] —
    and what to say of a --verify-cmd that does not run: a story's frozen checks run whenever it
    has any, and only they count; without them, --verify-cmd runs when `run` asks for it."""
    if story["checks"]:
        note = (None if blank(verify_cmd) or verify_cmd in story["checks"] else
            f"{story['id']} has frozen checks: they run instead of --verify-cmd "
            f"`{one_line(verify_cmd)}`.")
        return list(enumerate(story["checks"])), note
    return ([(None, verify_cmd)] if run and not blank(verify_cmd) else []), None


def execute_runs(store, sid, commands, after_seq, timeout, out):
    """Run each (check index, command) of story `sid` outside the lock, saying on `out` (an
    Output) when each starts and ends; returns records ready to commit."""
    runs_dir = ensure_subdir(store.path(RUNS))
    head, dirty, tree = git_state(store.root, store.dir)
    records = []
    for check, cmd in commands:
        label = f"frozen check {check + 1}" if check is not None else "verification"
        out.progress(f"fablize: running {label} for {sid} in {store.root}: {one_line(cmd)}")
        tmp_log = os.path.join(runs_dir, f".run-{os.getpid()}-{os.urandom(4).hex()}.log")
        started = now_iso()
        record = run_command(cmd, store.root, timeout, out.stream(), tmp_log)
        record.update(cmd=mask(cmd, command=True), id=sid, check=check, after_seq=after_seq,
                      started=started, git_head=head, git_dirty=dirty, tmp_log=tmp_log,
                      provenance=run_provenance(store.root, cmd))
        if tree:
            record["tree"] = tree
        out.progress(f"fablize: {label} {'passed' if run_passed(record) else 'FAILED'} — "
                     f"{run_result(record)}")
        records.append(record)
        if record.get("interrupted"):
            break  # a stop signal stops the whole command, not just this run
    return records


def commit_runs(session, records):
    """Append verify_run events, naming each log runs/<seq>-<id>.log."""
    committed = []
    for record in records:
        tmp_log = record.pop("tmp_log")
        seq = session.plan["ledger"]["seq"] + 1
        log_rel = f"{RUNS}/{seq}-{record['id']}.log"
        if os.path.lexists(tmp_log):  # none when it could not be made: the run is an error
            os.replace(tmp_log, session.store.path(log_rel))
            fsync_dir(session.store.path(RUNS))  # the log is there before the record names it
        record["log"] = log_rel
        committed.append(session.commit("verify_run", **record))
    return committed



# Rendering: handoff, status, report ###########################################################


def invocation(cwd=None):
    """The command that runs this engine, as every handoff, hook reason and block prints it:
    `fablize` when started as the installed command or through the plugin's bin/fablize; else
    the file that was started (this script, or the launcher beside it) by its place in the
    repository, found from wherever the shell stands (`git rev-parse`); else, for a copy outside
    the repository, by its absolute path."""
    name, ext = os.path.splitext(os.path.basename(sys.argv[0] or ""))
    if name == "fablize" and ext.lower() != ".py":
        return "fablize"
    started = sys.argv[0] if name + ext == LAUNCHER else __file__
    script = os.path.realpath(started)
    root = repo_root(cwd or os.getcwd())
    if root is not None:
        try:
            rel = os.path.relpath(script, root).replace(os.sep, "/")
        except ValueError:  # another drive on Windows
            rel = ".."
        if not rel.startswith("..") and re.fullmatch(r"[\w./@+-]+", rel):
            return repository_command(rel)
    return f"{PYTHON}{' -I -S' if name + ext == LAUNCHER else ''} {quote_arg(script)}"


def repository_command(rel):
    """The command that runs the repository's file `rel` (its launcher or goals.py) from any
    directory of any clone, with no absolute path: what setup commits."""
    flags = " -I -S" if os.path.basename(rel) == LAUNCHER else ""  # a lean start: stdlib only
    return f'{PYTHON}{flags} "$(git rev-parse --show-toplevel)/{rel}"'


def run_summary(run):
    return one_line(run_text(run))


def run_text(run):
    """A run's command and result, its fields as they are (run_summary escapes them)."""
    return f"`{run.get('cmd')}` → {run_words(run)}, sha256 {str(run.get('sha256'))[:16]}…"


def run_result(run):
    return one_line(run_words(run))


def run_words(run):
    took = "" if run.get("timed_out") else f", {run.get('duration_s')} s"
    return f"{exit_words(run)}{took}, {run.get('bytes')} bytes"


def checkpoint_command(prog, story, status, evidence):
    """A whole checkpoint command line for `story` (its agent named, as the gate asks)."""
    return (f"{prog} checkpoint --id {story['id']} --status {status} --evidence \"{evidence}\""
            + (f" --agent {quote_arg(story['agent'])}" if story["agent"] else ""))


def completion_command(prog, plan, story):
    """The checkpoint that completes `story`, as its gate will accept it."""
    cmd = checkpoint_command(prog, story, "complete", "<evidence>")
    if story["checks"]:
        return cmd
    if is_final(plan, story):  # witnessed first: the engine runs it (SKILL.md: prefer --run)
        return cmd + " --run --verify-cmd \"<command>\""
    return cmd


def handoff_command(prog, story):
    """The command that prints `story`'s whole handoff again without changing anything."""
    if story["agent"]:
        return f"{prog} next --agent {quote_arg(story['agent'])}"
    return f"{prog} next"


def render_map(plan, story, lookback=MAP_LOOKBACK, window=MAP_WINDOW, title=None):
    goals = plan["goals"]
    n = len(goals)
    idx = goals.index(story)
    start = max(0, idx - lookback)
    end = min(n, start + window)
    start = max(0, end - window)
    width = len(str(n))
    lines = ["## Plan map — context only: work the NOW story; do not start later ones."]
    for i in range(start, end):
        s = goals[i]
        label = "NOW" if s is story else MAP_LABELS[s["status"]]
        name = s["title"] if title is None else short(s["title"], title)
        line = f" {i + 1:>{width}}. [{label:<8}] {s['id']} {defused_line(name)}"
        if s is story:
            line += "   ← you are here"
        elif s["status"] == "in_progress" and s.get("agent"):
            line += f"   (agent {one_line(s['agent'])})"
        lines.append(line)
    if start or end < n:
        lines.append(f"  … {start} earlier stories not shown above, "
                     f"{n - end} later not shown below")
    return lines


def render_carried(plan, story, latest=None, chars=TAIL_CHARS, title=None):
    """One block per direct dependency (the `latest` few, when given): its latest evidence and
    run, their last `chars` characters, defused."""
    lines = []
    after = story["after"]
    if latest is not None and len(after) > latest:
        lines.append(f"## From {count_noun(len(after) - latest, 'earlier dependency')} — not "
                     f"shown here; `next` prints the whole handoff")
        after = after[-latest:]
    for dep_id in after:
        dep = find_story(plan, dep_id)
        name = dep["title"] if title is None else short(dep["title"], title)
        lines.append(f"## From {dep['id']} — {defused_line(name)} (direct dependency, "
                     f"{MAP_LABELS[dep['status']]})")
        if dep["decision"] and dep["status"] == "accepted":
            lines.append("accepted by a human decision: "
                         + defuse(last_chars(dep["decision"]["note"])))
        if not blank(dep["evidence"]):
            lines.append(f"evidence (last {chars} characters):")
            lines.append(indent(defuse(last_chars(dep["evidence"], chars))))
        run = dep["last_run"]
        if run:
            lines.append("verification run: " + defuse(run_summary(run)) + " — output tail:")
            lines.append(indent(defuse(last_chars(run["tail"], chars)) or "(no output)"))
    return lines


def render_feedback(story):
    fb = story["feedback"]
    if not fb:
        return []
    source = {"checkpoint": "the failed checkpoint", "judge": "the judge",
              "retry": "a human's retry", "amend": "a human's amendment"}
    source = source.get(fb["source"], fb["source"])
    lines = [f"## What was missing (round {fb['round']}, from {source})"]
    lines.append(indent(defuse(last_chars(fb["text"]))) if not blank(fb["text"])
                 else "    (no reason was given)")
    for run in fb.get("runs", []):
        lines.append(f"failed run `{defuse(one_line(run['cmd']))}` ({run['exit']}) — output tail:")
        lines.append(indent(defuse(last_chars(run["tail"])) or "(no output)"))
    return lines


def render_round_failures(story, prefix):
    failed = round_failures(story)
    if not failed:
        return []
    lines = [f"⚠ {prefix}{count_noun(len(failed), 'run')} already failed in this round — fix what "
             "they "
             "show before the complete checkpoint:"]
    for run in failed:
        label = f"frozen check {run['check'] + 1}" if run["check"] is not None else "run"
        lines.append(f"  {label} `{defuse(one_line(run['cmd']))}` ({describe_exit(run)}, event "
                     f"{run['seq']}) — output tail:")
        lines.append(indent(defuse(last_chars(run["tail"]).rstrip("\n")) or "(no output)",
                            "      "))
    return lines


def render_observed(story):
    seen = observed_of(story)
    if not seen:
        return []
    lines = ["## Observed runs — what your harness reported about commands you ran (observed: "
             "more than claimed, less than witnessed):"]
    lines += [f"  event {o.get('seq')}: `{one_line(o['cmd'])}` → {observed_result(o)}"
              for o in seen[-5:]]
    return lines


def render_handoff(prog, plan, story, reshown, brief=False):
    """A story's handoff: what a fresh session needs to do it (`reshown`: it was already in
    progress). `brief` (what a session start injects): a smaller map window and the latest
    few direct dependencies, so that it stays short however large the plan."""
    lines = [f"=== fablize handoff — {story['id']} {defused_line(story['title'])}",
             f"Objective: {defused_line(story['objective'])}"]
    for a in story["amendments"]:
        lines.append(f"Amended ({a['ts'][:10]}): {one_line(a['note'])}")
    if reshown:
        lines.append(f"⚠ Resumed: this story was already in progress (round {story['round']}, "
                     "started "
                     f"{time_label(story['started_ts'])}). Continue it; do not restart it.")
    elif story["round"] > 1:
        fb = story["feedback"] or {}
        lines.append(f"⚠ Reopened: {round_label(plan, story)} — "
                     f"{REOPENED_BECAUSE.get(fb.get('source'), REOPENED_BECAUSE['checkpoint'])}; "
                     "what was missing is below. Continue the work; do not restart it.")
    if reshown:
        lines += render_round_failures(story, "Resumed: ")
    if reshown or story["round"] > 1:
        lines.append("  Files from the earlier attempt exist only if that work was kept (committed "
                     "or "
                     "still in this working tree): check before relying on them.")
    lines.append("Rule: work this story only. Produce evidence as you go.")
    if is_final(plan, story):
        if story["checks"]:
            lines.append("★ Final story — its frozen checks must pass: the engine runs them at the "
                         "complete checkpoint (verification gate).")
        elif plan["options"]["require_run"]:
            lines.append("★ Final story — this plan requires a witnessed run: the complete "
                         "checkpoint needs --run --verify-cmd (the engine runs it; verification "
                         "gate).")
        else:
            lines.append("★ Final story — the complete checkpoint requires verification: prefer "
                         "--run --verify-cmd (witnessed: the engine runs it); --verify-cmd with "
                         "--verify-evidence is recorded as claimed (verification gate).")
    lines += (render_map(plan, story, *RESUME_MAP, title=RESUME_TITLE) if brief
              else render_map(plan, story))
    lines += (render_carried(plan, story, RESUME_CARRIED, RESUME_TAIL, RESUME_TITLE) if brief
              else render_carried(plan, story))
    lines += render_feedback(story)
    if story["checks"]:
        lines.append("## Frozen checks — the engine runs all of them at `complete`; no substitute "
                     "command counts:")
        flagged = {u["check"]: u["reason"] for u in plan["unverifiable"] if u["id"] == story["id"]}
        for i, cmd in enumerate(story["checks"]):
            note = ("" if i not in flagged else
                    f"   (not there yet: {one_line(flagged[i])}; write it first)"
                    if flagged[i].endswith(NOT_THERE) else
                    f"   ⚠ cannot run here: {one_line(flagged[i])}")
            lines.append(f"  {i + 1}. {one_line(cmd)}{note}")
    if story["accept"]:
        lines.append("## Acceptance items — a judge checks each one:")
        lines += [f"  - {one_line(item)}" for item in story["accept"]]
    if story["judge"]:
        lines.append("Judged story: `complete` moves it to review; an independent judge decides.")
    lines += render_observed(story)
    lines.append("Not achieved yet: " + checkpoint_command(prog, story, "failed",
                                                            "<what is missing>"))
    lines.append("Impossible as specified: " + checkpoint_command(prog, story, "blocked", "<why>")
                 + "   (then stop and ask a human)")
    lines.append("On completion: " + completion_command(prog, plan, story))
    if is_final(plan, story) and not story["checks"] and not plan["options"]["require_run"]:
        lines.append("  (only if the engine cannot run it, a claimed completion: --verify-cmd "
                     "\"<command>\" --verify-evidence \"<result>\" without --run)")
    return lines


def render_resume(prog, plan, story):
    """What `status` shows of a story in progress: enough to pick it up after a crash."""
    lines = [f"## Resume {story['id']} — {defused_line(story['title'])} (round {story['round']}, "
             f"started {time_label(story['started_ts'])})",
             f"Objective: {defused_line(story['objective'])}"]
    lines += [f"Amended: {defused_line(a['note'])}" for a in story["amendments"]]
    fb = story["feedback"]
    if fb:
        lines.append(f"What was missing last round (round {fb['round']}):")
        lines.append(indent(defuse(last_chars(fb["text"], 300))) if not blank(fb["text"])
                     else "    (no reason was recorded)")
    lines += render_round_failures(story, "")
    lines.append("Full handoff (plan map, dependencies' evidence, checks): "
                 + handoff_command(prog, story))
    lines.append(f"  or, for every story in progress: {prog} status --resume")
    lines.append("Then: " + completion_command(prog, plan, story))
    return lines


def status_details(plan, story):
    """The lines under a story in `status`: its round, holder, what it waits for, why it is
    blocked, what its completion rests on, its amendments."""
    if _PRISTINE.issuperset(story):  # untouched since `create`: at most what it waits for
        waiting = waits_for(plan, story)
        return ["waits for " + ", ".join(waiting)] if waiting else []
    touch(story)
    details = []
    if story["status"] in DONE:
        if story["round"] > 1:
            details.append(f"done in round {story['round']}")
    elif story["round"] > 1 or story["status"] in ("failed", "in_progress"):
        details.append(f"{round_label(plan, story)}, "
                       f"{count_noun(max(rounds_left(plan, story), 0), 'round')} left")
    if story["status"] == "in_progress" and story["agent"]:
        details.append(f"held by agent {one_line(story['agent'])}")
    if story["status"] in ("pending", "failed"):
        waiting = waits_for(plan, story)
        if waiting:
            details.append("waits for " + ", ".join(waiting))
    if story["status"] == "blocked":
        details.append("blocked: " + one_line(last_chars(blocked_because(story), 200)))
    if story["status"] == "review":
        details.append("awaiting an independent judge")
    if story["status"] in ("accepted", "complete", "review") and grade_detail(story):
        details.append(grade_detail(story))
    for a in story["amendments"]:
        details.append("amended: " + one_line(last_chars(a["note"], 200)))
    bad = unaddressed_failure(story) if story["status"] in DONE + ("review",) else None
    if bad is not None:
        details.append(f"the harness last saw `{one_line(last_chars(bad['cmd'], 120))}` fail "
                       f"(event {bad.get('seq')}) before it was checkpointed")
    return details


def next_action(prog, plan, agent=None):
    """What to do now — the one answer `next`, `status`, `checkpoint`, `decide`, `verdict`, the
    guard and every refusal give, so no two commands disagree and no suggested command is one a
    gate then refuses. A dict: kind (done, finish, next, decide, judge, wait), id (the story),
    cmd (the command line, runnable as printed) and text (one line)."""
    if plan_done(plan):
        return {"kind": "done", "id": None, "cmd": None, "text": done_line(plan)}
    active = active_stories(plan)
    mine = [s for s in active if agent is None or s["agent"] == agent]
    if mine:
        s = mine[0]
        command = completion_command(prog, plan, s)
        return {"kind": "finish", "id": s["id"], "cmd": command,
                "text": f"finish {s['id']}, then `{command}`"}
    ready = pick_ready(plan)
    if ready is not None:
        command = f"{prog} next" + (f" --agent {quote_arg(agent)}" if agent is not None else "")
        return {"kind": "next", "id": ready["id"], "cmd": command,
                "text": f"`{command}` (activates {ready['id']})"}
    blocked = stories_in(plan, "blocked")
    if blocked:
        s = blocked[0]
        commands = decide_commands(prog, s["id"])
        reason = one_line(last_chars(blocked_because(s), 200))
        return {"kind": "decide", "id": s["id"], "cmd": commands[0], "commands": commands,
                "text": f"{s['id']} is blocked ({reason}) — the plan halts here: nothing that "
                        "depends on it can start. A human must decide, with one of:"}
    review = stories_in(plan, "review")
    if review:
        s = review[0]
        command = f"{prog} judge-packet --id {s['id']}"
        return {"kind": "judge", "id": s["id"], "cmd": command,
                "text": f"{s['id']} awaits an independent judge: hand {s['id']} to the judge, who "
                        f"runs `{command}`"}
    held = ", ".join(f"{s['id']} ({one_line(s['agent'] or 'no agent')})" for s in active)
    return {"kind": "wait", "id": None, "cmd": None,
            "text": f"nothing is ready{' for agent ' + one_line(agent) if agent else ''}: in "
                    f"progress {held}; the rest waits for them"}


def hand_to_judge(prog, story):
    sid = story["id"]
    return (f"fablize: {sid} \"{defused_line(story['title'])}\" is in review — hand {sid} to the "
            f"judge: start the fablize-judge agent (or another independent reviewer) on {sid}; it "
            f"runs {prog} judge-packet --id {sid} and answers with a verdict. Do not judge "
            "your own work.")


def plan_summary(plan):
    """The counts every command's --json carries: `done` is always a count."""
    return {"done": done_count(plan), "total": len(plan["goals"]), "complete": plan_done(plan)}


def left_line(plan, action):
    """After a transition: what is left and what to do next (`action`): a line, and a line for
    each of its alternative commands."""
    if action["kind"] == "done":
        return action["text"]
    left = count_stories(len(plan["goals"]) - done_count(plan))
    return with_commands(f"fablize: {left} left — next: {action['text']}", action)


def next_line(action):
    if action["kind"] == "done":
        return action["text"]
    return with_commands(f"fablize: next — {action['text']}", action)


def with_commands(line, action):
    """`line`, then each alternative command of `action` whole on its own line."""
    return "\n".join([line] + [f"  {cmd}" for cmd in action.get("commands", ())])


# what a human may decide of a story that needs one, each with what its note says
DECISION_NOTES = (("accept", "<why it is acceptable as it is>"),
                  ("retry", "<what the next attempt should do>"),
                  ("amend", "<what changes in the objective>"))


def decide_commands(prog, sid):
    """What a human may run: in their own terminal, so the plugin's engine by its full path."""
    return [f"{human_command(prog)} decide --id {sid} {decision} --note \"{note}\""
            for decision, note in DECISION_NOTES]


def human_command(prog):
    """The engine as a person runs it in their own terminal: `prog`, except when it was started
    through the plugin's bin/fablize, which is on the PATH of Claude Code's Bash tool only —
    then that file, by its full path."""
    if prog != "fablize":
        return prog
    top = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    launcher = os.path.join(top, "bin", "fablize")
    if os.path.isfile(os.path.join(top, ".claude-plugin", "plugin.json")) and os.path.isfile(
            launcher):
        return quote_arg(launcher)
    return prog


def done_line(plan):
    accepted = [s["id"] for s in plan["goals"] if s["status"] == "accepted"]
    if accepted:
        return f"fablize: all stories done ✓ ({', '.join(accepted)} accepted by a human decision)"
    return "fablize: all stories complete ✓"


def story_json(plan, story):
    """A story in --json: every field of STORY_FIELDS (defaults filled in), and what follows
    from the plan: whether it is the final story, its rounds left, what it waits for."""
    data = {key: story.get(key, default) for key, default in DEFAULTS.items()}
    data.update(final=is_final(plan, story), rounds_left=rounds_left(plan, data),
                waits_for=waits_for(plan, story))
    return data


def plan_json(plan):
    return {"plan_id": plan["plan_id"], "brief": plan["brief"], "created": plan["created"],
            "scope": plan.get("scope", []),
            **plan_summary(plan), "accepted": accepted_ids(plan), "options": plan["options"],
            "unverifiable": plan["unverifiable"], "ledger": plan["ledger"],
            "stories": [story_json(plan, s) for s in plan["goals"]]}


GRADES_EACH = 8  # up to this many stories, each story's grade is told; beyond, each grade's count


def grade_groups(grades):
    """[(grade, its stories' ids)] of {id: grade}, the most common grade first: how a plan of
    thousands of stories tells its grades without a line of thousands of ids."""
    groups = {}
    for sid, grade in grades.items():
        groups.setdefault(grade, []).append(sid)
    return sorted(groups.items(), key=lambda g: -len(g[1]))


def grades_line(grades):
    """`grades: G001 witnessed, G002 claimed`, or by grade for a long plan: `grades: 9,998
    witnessed, 2 claimed (G0042, G0077)` (the ids of a grade held by a few stories)."""
    if len(grades) <= GRADES_EACH:
        return "grades: " + ", ".join(f"{sid} {grade}" for sid, grade in grades.items())
    return "grades: " + ", ".join(f"{len(ids):,} {grade}{few_ids(ids)}"
                                  for grade, ids in grade_groups(grades))


def few_ids(ids):
    """` (G0042, G0077)` for a few stories, nothing for many."""
    return f" ({', '.join(ids)})" if len(ids) <= GRADES_EACH else ""


def md_cell(text, limit=120):
    text = one_line(last_chars(text or "", limit) if len(text or "") > limit else text or "")
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("`", "'")


def render_report(plan, runs, total=None):
    """`report`: a Markdown summary (progress, a row a story, the latest runs, the dependency
    graph) for a pull request or a CI job summary."""
    goals = [touch(s) for s in plan["goals"]]
    done = done_count(plan)
    filled = round(20 * done / len(goals))
    lines = [f"# fablize report — {md_cell(plan['brief'], 200)}", "",
             f"`{'█' * filled}{'░' * (20 - filled)}` **{done}/{len(goals)} done** "
             f"({100 * done // len(goals)}%)" +
             (" — " + done_line(plan)[len("fablize: "):] if plan_done(plan) else ""),
             "", "| Story | Title | Status | Rounds | Evidence | Grade |",
             "|---|---|---|---|---|---|"]
    for s in goals:
        evidence = md_cell(s["evidence"])
        if s["status"] == "accepted" and s["decision"]:
            evidence = "accepted by a human: " + md_cell(s["decision"]["note"], 100)
        lines.append(f"| {s['id']} | {md_cell(s['title'], 80)} | {MARKS[s['status']]} "
                     f"{s['status']} | {md_cell(str(s['round']))} | {evidence} | "
                     f"{s['grade'] or ''} |")
    if runs:
        lines += ["", "## Verification runs", "",
                  "| Event | Story | Command | Result | Duration | Output sha256 |",
                  "|---|---|---|---|---|---|"]
        if total and total > len(runs):
            lines[-3] += f" — the latest {len(runs)} of {total} (`log` lists them all)"
        for r in runs:
            lines.append(f"| {md_cell(str(r['seq']))} | {md_cell(r['id'])} | "
                         f"`{md_cell(r['cmd'], 80)}` | "
                         f"{'pass' if run_passed(r) else 'FAIL'}: {md_cell(describe_exit(r))} | "
                         f"{md_cell(str(r.get('duration_s')))} s | "
                         f"`{md_cell(str(r.get('sha256'))[:16])}` |")
    standing = [(s, unaddressed_failure(s)) for s in goals if s["status"] in DONE + ("review",)]
    standing = [(s, o) for s, o in standing if o is not None]
    if standing:
        lines += ["", "## Failures the harness saw, left standing", ""]
        lines += [f"- {s['id']}: the harness last saw `{md_cell(o['cmd'], 120)}` fail (event "
                  f"{md_cell(str(o.get('seq')))}) before it was checkpointed" for s, o in standing]
    lines += ["", "## Stories and dependencies", "", "```mermaid", "graph TD"]
    for s in goals:
        label = md_cell(s["title"], 40).replace('"', "#quot;")
        lines.append(f"  {s['id']}[\"{s['id']} {label}\"]:::{s['status']}")
    for s in goals:
        for dep in s["after"]:
            lines.append(f"  {dep} --> {s['id']}")
    lines += [f"  classDef {k} fill:{row[2]}" for k, row in STATUS_TABLE.items()]
    lines += ["```", "", "Ledger head: "
                         f"`{plan['ledger']['seq']}:{md_cell(plan['ledger']['head'])}` "
              f"(plan `{md_cell(plan['plan_id'])}`)", ""]
    return "\n".join(lines)


# Audit: replaying the whole ledger ############################################################


# the fields of an event where a secret could have been recorded (an older engine masked none)
SECRET_FIELDS = {"verify_run": ("cmd", "tail"), "observed_run": ("cmd", "detail", "tool"),
                 "checkpoint": ("evidence", "verify_cmd", "verify_evidence", "agent?"),
                 "verdict": ("evidence", "agent"), "paused": ("note",), "decision": ("note",),
                 "story_released": ("note", "agent"), "guard_block": ("reason",),
                 "story_started": ("agent",), "plan_created": ("brief",)}
_STORY_TEXTS = ("title", "objective", "evidence")  # (and its checks and acceptance items)


def story_texts(ev):
    """The words of the stories an event holds (plan_created's, story_added's), and the plan's
    scope: what a forger could hide a secret in besides the fields of SECRET_FIELDS."""
    stories = ev["stories"] if ev["event"] == "plan_created" else [ev["story"]]
    for story in stories:
        yield from (story.get(key) for key in _STORY_TEXTS)
        yield from story.get("checks") or ()
        yield from story.get("accept") or ()
    yield from ev.get("scope") or ()


MAX_SECRET_LINES = 20
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
_SHA256, _LOG = itemgetter("sha256"), itemgetter("log")


def secret_seqs(groups, secret):
    """The lines (seqs, in order) of the events in `groups` ({kind: its events, as replay
    accepted them}) whose recorded text looks secret: each text of a batch is asked of
    `secret` once, however many events recorded it."""
    seqs = []
    for kind, fields in SECRET_FIELDS.items():
        group = groups.get(kind)
        if not group:
            continue
        texts = set()
        for name in fields:  # text or None, each (replay checked); `name?` may be missing
            texts.update(map(methodcaller("get", name[:-1]) if name.endswith("?") else
                             itemgetter(name), group))
        flagged = {text for text in texts if text and secret(text)}
        if flagged:
            seqs += [ev["seq"] for ev in group
                     if any(ev.get(name.rstrip("?")) in flagged for name in fields)]
    for kind in ("plan_created", "story_added"):  # a few events, each read whole
        seqs += [ev["seq"] for ev in groups.get(kind, ())
                 if any(type(text) is str and secret(text) for text in story_texts(ev))]
    return sorted(set(seqs))


def audit_ledger(source, snapshot_raw, require_independent=False, runs_dir=None, scan=None,
                 logs=None):
    """Replay every line of `source` (a Ledger, or a ledger's bytes), streaming; returns a report
    dict. Raises FablizeError(exit 3) at the first line that cannot be trusted, naming it and
    why. With `runs_dir` (or `logs`, {log path: bytes} as a shared plan's commits carry them),
    each run's log found there is checked against its recorded digest;
    `scan(lineno, head, ev)` sees every line after it replayed (the trust checks' pass)."""
    ledger = MemoryLedger(source) if isinstance(source, bytes) else source
    end, torn = ledger.end() if ledger.fd is not None else (0, b"")
    snap = parse_snapshot(snapshot_raw, whole=True) if snapshot_raw is not None else None
    if snap is not None and is_original_snapshot(snap):
        raise stripped_snapshot_error()  # beside a chained ledger (else refuse_original said so)
    snap_seq = snap["ledger"]["seq"] if snap is not None else None
    version = snap["schema_version"] if snap is not None else None
    if version == SNAPSHOT_VERSION:
        # this engine's snapshot is compared as the bytes it would write at that event: the
        # parsed copy is let go before the replay builds its own, and parsed again only on a
        # mismatch (audit of a 100,000-story plan: max RSS 496 → 309 MiB, CPU 2.85 → 1.96 s)
        snap = True
    snap_view = None
    present = set(os.listdir(runs_dir)) if runs_dir and os.path.isdir(runs_dir) else set()
    independence, bad_logs, secrets = [], [], []
    checked = 0
    digest = fast_sha256()
    recent = collections.deque(maxlen=REPORT_RUNS)  # the latest runs, for the summary
    seen = {}  # short text -> looks secret: a run's command and tail mostly repeat run after run

    def secret(text):
        known = seen.get(text)
        if known is None:
            known = looks_secret(text)
            if len(text) <= SHORT_TEXT:
                if len(seen) >= 4096:
                    seen.clear()
                seen[text] = known
        return known

    # a run's log is runs/<seq>-<story>.log (replay checked): where it is looked for
    log_key = itemgetter(slice(len(RUNS) + 1, None)) if logs is None else None
    found = logs.keys() if logs is not None else present
    has_log = found.__contains__
    # the seqs whose log may be here, from the names (<seq>-<story>.log): a batch none of whose
    # seqs is among them has no log to look up
    logged = {int(seq) for seq in (name.rpartition("/")[2].partition("-")[0] for name in found)
              if seq.isascii() and seq.isdigit()}

    def on_batch(replay, events):
        """What audit checks of each batch the replay accepted, in C loops where it can (with
        the trust scan's batch: audit of 100,000 real runs, bench.py section 4's ledger, 1.42 →
        1.32 s CPU, against checking each event in Python as it replayed)."""
        nonlocal checked
        kinds = list(map(_EVENT_KIND, events))
        distinct = set(kinds)
        groups = ({kinds[0]: events} if len(distinct) == 1 else  # most batches: runs only
            {kind: list(compress(events, map(eq, kinds, repeat(kind)))) for kind in distinct})
        if len(secrets) < MAX_SECRET_LINES:
            secrets.extend(secret_seqs(groups, secret)[:MAX_SECRET_LINES - len(secrets)])
        runs = groups.get("verify_run", ())
        recent.extend(runs)
        logless = set()  # runs whose log could not be made: no log to show, none claimed
        if EMPTY_SHA256 in map(_SHA256, runs):
            logless = {ev["seq"] for ev in runs if not ev["bytes"] and ev["error"] and
                       ev["sha256"] == EMPTY_SHA256}
            checked += len(logless)
        names = ()
        if runs and not logged.isdisjoint(range(runs[0]["seq"], runs[-1]["seq"] + 1)):
            names = map(_LOG, runs) if log_key is None else map(log_key, map(_LOG, runs))
        for ev in compress(runs, map(has_log, names)):  # most batches: none of their logs here
            if ev["seq"] in logless:
                continue
            checked += 1
            log = ev["log"]
            content = (logs.get(log) if logs is not None else
                read_state_file(os.path.join(runs_dir, log_key(log))))
            if content is None or digest(content) != ev["sha256"]:
                bad_logs.append(line_error(ev["seq"], f"{one_line(log)} does not match the sha256 "
                                           "recorded for that run — the log was edited or "
                                           "replaced.", "run_log_mismatch"))
        if scan is not None:
            heads = [*map(_PREV, events[1:]), replay.head]  # each line's hash, as the next names
            if hasattr(scan, "batch"):
                scan.batch(events, groups, heads)
            else:
                for ev, head in zip(events, heads):
                    scan(ev["seq"], head, ev)

    def view(replay):  # the snapshot this engine would have written at this event
        nonlocal snap_view
        replay.plan["ledger"] = replay.position()
        snap_view = (snapshot_bytes(replay.plan) if snap is True else
                     snapshot_view(replay.plan, version))

    def on_event(replay, line, ev):
        if require_independent and ev["event"] == "verdict":  # it leaves executor as it was
            story = find_story(replay.plan, ev["id"])
            if story["executor"] is None or story["executor"] == ev["agent"]:
                independence.append(f"line {replay.seq}: {story['id']} judged by "
                                    f"{one_line(ev['agent'])}, executor "
                                    f"{one_line(story['executor'] or 'unnamed')}")
        if replay.seq == snap_seq and not at_end:
            view(replay)

    # the snapshot is compared as of its own event: after the replay when that is the last
    # line (a snapshot in sync), else as the replay passes it
    last = parse_event(ledger.last(end) or b"") if snap_seq is not None else None
    at_end = snap_seq is None or (last is not None and last["seq"] == snap_seq)
    kinds = {"verdict"} if require_independent else set()
    replay = replay_all(ledger, end, on_event if kinds or not at_end else None,
                        kinds if at_end else None, on_batch)
    if snap_seq is not None and at_end and replay.seq == snap_seq:
        view(replay)
    runs = replay.counts["verify_run"]
    plan = replay.plan
    if plan is None:
        if snap is not None:
            raise position_error(snap_seq, 0)
        raise no_plan()
    plan["ledger"] = replay.position()
    report = {"event_count": replay.seq, "head": f"{replay.seq}:{replay.head}",
              "torn_tail_bytes": len(torn), "snapshot": "missing", "plan": plan,
              "independence": independence, "run_count": runs, "missing_logs": runs - checked,
              "recent_runs": list(recent), "bad_logs": bad_logs,
              "secret_lines": secrets}
    if snap is not None:
        if replay.seq < snap_seq:
            raise position_error(snap_seq, replay.seq)
        if snap is True:  # this engine's snapshot: the very bytes it would write, or else
            if snap_view == snapshot_raw:  # what differs, from both parsed
                snap_view = None
            else:
                snap, view = parse_snapshot(snapshot_raw, whole=True), load_json(snap_view)
                # in the plan's own key order, as a view of any other version is compared
                snap_view = {k: view[k] for k in [*plan, *view] if k in view and k != "digest"}
        if snap_view is None:
            mismatch = None
        elif version < 2:
            if snap_view["ledger"]["head"] != snap["ledger"]["head"]:
                raise damaged(f"{SNAPSHOT} and {LEDGER} disagree at event {snap_seq}.",
                              "snapshot_mismatch")
            report["snapshot"] = ("in the format of fablize 1 (the next writing command "
                                 "rewrites it)")
            return report
        else:
            mismatch = first_difference(forgive_new_keys(snap_view, snap),
                                        {k: v for k, v in snap.items() if k != "digest"})
        if mismatch:
            raise damaged(f"{SNAPSHOT} disagrees with the replay of {LEDGER} up to line "
                          f"{snap_seq}: "
                          f"{mismatch}.", "snapshot_mismatch")
        behind = replay.seq - snap_seq
        report["snapshot"] = ("in sync" if not behind else
            f"{behind} event{'s' if behind > 1 else ''} behind (rolled forward by the next "
            "writing command)")
    return report


def first_difference(expected, actual, path=""):
    if type(expected) is not type(actual):
        return (f"{path or 'top level'} is {one_line(repr(actual))[:80]}, the ledger says "
               f"{one_line(repr(expected))[:80]}")
    if isinstance(expected, dict):
        for key in list(expected) + [k for k in actual if k not in expected]:
            if key not in actual or key not in expected:
                return f"{path}{key} is {'missing' if key not in actual else 'extra'}"
            found = first_difference(expected[key], actual[key], f"{path}{key}.")
            if found:
                return found
        return None
    if isinstance(expected, list):
        if len(expected) != len(actual):
            return f"{path.rstrip('.')} has {len(actual)} entries, the ledger says {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            label = e.get("id", i) if isinstance(e, dict) else i
            found = first_difference(e, a, f"{path.rstrip('.')}[{label}].")
            if found:
                return found
        return None
    if expected != actual:
        return (f"{path.rstrip('.')} is {one_line(repr(actual))[:80]}, the ledger says "
               f"{one_line(repr(expected))[:80]}")
    return None


def snapshot_view(plan, version):
    """The plan as a snapshot of `version` holds it, what audit compares goals.json with:
    compact stories from version 3, every field of every story before."""
    view = json.loads(dumps(plan))
    view["schema_version"] = version
    if version >= 3:
        view["goals"] = [compact(story) for story in view["goals"]]
    return view


def forgive_new_keys(view, snap):
    """The replayed plan as a snapshot written before this engine held it: without the keys it
    lacks (grade, a decision's signer), and with a blocked checkpoint's reason kept twice, as
    it was."""
    for mine, theirs in zip(view.get("goals", []), snap.get("goals", [])):
        if not isinstance(theirs, dict):
            continue
        if "grade" not in theirs:
            mine.pop("grade", None)
        if (mine.get("blocked_reason") is None and theirs.get("blocked_reason") is not None and
                theirs.get("blocked_reason") == theirs.get("evidence")):
            mine["blocked_reason"] = theirs["blocked_reason"]
        decision, kept = mine.get("decision"), theirs.get("decision")
        if isinstance(decision, dict) and isinstance(kept, dict) and "signer" not in kept:
            decision.pop("signer", None)  # a signed decision's signer, not yet kept then
    return view


# Hooks: what an agent's harness runs ##########################################################


def read_hook_stdin():
    """The hook's JSON payload from stdin, or None for anything else (never an error: a hook
    that fails on odd input would trap or blind the agent)."""
    raw = b""
    if not sys.stdin.isatty():
        try:
            raw = sys.stdin.buffer.read(1 << 20)
        except (OSError, ValueError, AttributeError):
            raw = b""
    try:
        payload = load_json(raw) if raw.strip() else None
    except ValueError:
        payload = None
    return raw, payload if isinstance(payload, dict) else None


def asks_human(payload):
    """Whether the agent ended its turn by asking the human something: then stopping is right.
    Claude Code and Codex send `last_assistant_message`, Gemini CLI `prompt_response`."""
    text = payload.get("last_assistant_message")
    if not isinstance(text, str):
        text = payload.get("prompt_response")
    if not isinstance(text, str):
        return False
    lines = [x.strip() for x in text.strip().splitlines() if x.strip() and x.strip() != "```"]
    return bool(lines) and lines[-1].rstrip("*_`)\"' ").endswith(("?", "？"))


def hook_fingerprint(raw, payload):
    """What makes two guard runs the same stop: the same payload over the same transcript. Two
    registrations of the guard are fed the same stop at once; two real stops have a turn of the
    agent (transcript lines) between them. Without a transcript there is nothing to tell them
    apart by, so every run counts."""
    path = payload.get("transcript_path")
    if not isinstance(path, str) or not path:
        return None
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return sha256_hex(raw + f"\0{st.st_size}\0{st.st_mtime_ns}".encode())[:32]


def duplicate_stop(plan, fingerprint):
    guard = plan["guard"]
    if (fingerprint is None or guard.get("hook") != fingerprint
            or not isinstance(guard.get("hook_ts"), str)):
        return False
    try:
        import datetime
        then = datetime.datetime.fromisoformat(guard["hook_ts"]).timestamp()
    except ValueError:
        return False
    return abs(time.time() - then) < DUPLICATE_WINDOW


def guard_limit():
    raw = os.environ.get("FABLIZE_GUARD_MAX", str(DEFAULT_GUARD_MAX))
    return int(raw) if raw.isascii() and raw.isdigit() else DEFAULT_GUARD_MAX


def guard_reason(cli, plan, payload, fingerprint=None):
    """(why the agent may not stop now — its next action — or a note that the guard lets go
    after too many blocks in a row, or None; whether another registration counted this stop)."""
    if plan is None or guard_paused(plan) or asks_human(payload):
        return None, False  # paused by a human, or the turn ended on a question for one
    action = next_action(cli, plan)
    if action["kind"] not in ("finish", "next", "judge"):
        return None, False  # done, or halted on a human's decision
    limit = guard_limit()
    dup = duplicate_stop(plan, fingerprint)
    blocks = plan["guard"]["blocks"] if payload.get("stop_hook_active") is True else 0
    if dup:
        blocks = max(blocks - 1, 0)  # the other registration of the guard counted this stop
    if blocks >= limit:
        return (f"fablize guard: let the agent stop after {blocks} blocks in a row; the plan is "
                f"not finished — `{human_command(cli)} status` says where it stands."), dup
    story = find_story(plan, action["id"])
    if action["kind"] == "finish":
        reason = (f"fablize: {story['id']} \"{defused_line(story['title'])}\" is still in "
                  f"progress. Finish it, then run: {action['cmd']} (or --status failed / "
                  "blocked with the reason).") + observed_failure_note(story)
    elif action["kind"] == "judge":
        reason = hand_to_judge(cli, story)
    else:
        reason = (f"fablize: the plan is not finished — {story['id']} "
                  f"\"{defused_line(story['title'])}\" is ready. Run: {action['cmd']}")
    return reason + f" [guard block {blocks + 1} of at most {limit} in a row]", dup


def guard_answer(agent, reason):
    """A block, in the words of the agent's Stop-hook protocol."""
    if agent == "gemini":
        return {"decision": "deny", "reason": reason}
    if agent == "cursor":
        return {"followup_message": reason}
    return {"decision": "block", "reason": reason}


def observed_failure_note(story):
    bad = unaddressed_failure(story)
    if bad is None:
        return ""
    code = f"exit {bad['exit_code']}, " if isinstance(bad.get("exit_code"), int) else ""
    return (f" The harness saw `{one_line(last_chars(bad['cmd'], 200))}` fail ({code}event "
            f"{bad.get('seq')}) and it has not been seen to pass since: address it first.")


def observed_outcome(payload):
    """(exit code or None, passed: True/False/None, detail) from a PostToolUse-style payload —
    the harness's report of the run, never the agent's own words."""
    def exit_in(text, last=False):
        # the harness's own line, never one the command printed: Claude Code's failure text
        # opens with it, Gemini CLI's llmContent gives it after the command's output
        found = regex(r"^\s*exit(?:ed)?(?: with)?(?: code|\s+status)?\s*[:=]?\s*(-?\d+)\s*$",
                      re.I | re.M).findall(text or "")
        lines = (text or "").lstrip().split("\n", 1)
        if not last:
            m = regex(r"(?i)\s*exit(?:ed)?(?: with)?(?: code|\s+status)?\s*[:=]?\s*(-?\d+)"
                      ).match(lines[0])
            return int(m.group(1)) if m else None
        return int(found[-1]) if found else None
    if payload.get("hook_event_name") == "PostToolUseFailure":
        error = payload.get("error")
        text = error if isinstance(error, str) else json_text(error)
        code = exit_in(text)
        return code, False, text
    resp = payload.get("tool_response")
    if isinstance(resp, str):
        code = exit_in(resp, last=True)
        return code, None if code is None else code == 0, resp
    if not isinstance(resp, dict):
        return None, None, ""
    detail = json_text(resp)
    for key in ("exit_code", "exitCode", "returncode", "returnCode", "exit_status"):
        if type(resp.get(key)) is int:
            return resp[key], resp[key] == 0, detail
    if resp.get("error"):  # Gemini CLI: a tool error
        return exit_in(str(resp.get("llmContent") or resp["error"]), last=True), False, detail
    if resp.get("interrupted") is True:
        return None, False, detail
    code = exit_in(resp.get("llmContent") if isinstance(resp.get("llmContent"), str) else "",
                   last=True)
    if code is not None:
        return code, code == 0, detail
    return None, True, detail  # Claude Code reports a failing command as PostToolUseFailure


def shell_command_of(payload):
    tool_input = payload.get("tool_input")
    cmd = tool_input.get("command") if isinstance(tool_input, dict) else None
    if isinstance(cmd, list) and all(isinstance(x, str) for x in cmd):
        cmd = " ".join(cmd)
    return cmd if isinstance(cmd, str) and cmd.strip() else None
VERIFY_LIKE = r"""(?x)(?:^|[\s;&|(/])(?:
    py\.?test|tox|nox|unittest|ctest|jest|vitest|mocha|rspec|phpunit|ruff|flake8|pylint|mypy|
    pyright|eslint|tsc|shellcheck|vermin|[\w.-]*tests?[\w.-]*\.sh|
    make(?:\s+-\S+)*\s+(?:test|check|lint|verify|ci|demo)[\w-]*|
    (?:npm|pnpm|yarn|bun)\s+(?:run\s+)?(?:test|lint|check|build|typecheck|verify)[\w:-]*|
    cargo\s+(?:test|check|clippy|build|nextest)|go\s+(?:test|vet|build)|
    (?:\./)?(?:gradlew?|mvnw?)\s+(?:\S+\s+)*?(?:test|check|verify|build)|dotnet\s+test|
    bazel\s+test|swift\s+test|mix\s+test|deno\s+test|
    (?:goals\.py|fablize)\s+(?:audit|verify))\b"""


def is_verification(cmd, story):
    # the engine's own commands are in the ledger already (`checkpoint --run` names pytest too)
    if re.search(r"""(?:goals\.py|(?:^|[\s/;&|(])fablize)["']?(?:\s+--\S+)*\s+"""
                 r"(?!verify|audit)[a-z]", cmd):
        return False
    return (any(c.strip() and c.strip() in cmd for c in story["checks"]) or
        bool(re.search(VERIFY_LIKE, cmd)))



# Rooms: integrations beside the core ##########################################################
# What the original never had lives in a room beside this file, one module a room. A room is
# loaded by path from this file's own folder, never through sys.path (nothing in a tree under
# audit can stand in for one), only by the commands that use it, and it sees this module as
# `fablize_engine`: one engine, even when this file runs as __main__ (a room's FablizeError is
# the engine's). A lone goals.py answers a command whose room is missing in one line.
ROOMS = {"setup": "fablize_setup.py", "sharing": "fablize_sharing.py",
         "merge": "fablize_merge.py", "trust": "fablize_trust.py"}
ROOM_COMMANDS = {"install-block": "setup", "setup": "setup", "doctor": "setup",
                 "completion": "setup",
                 "share": "sharing", "sync": "sharing", "release": "sharing",
                 "merge-driver": "merge", "install-merge": "merge"}


def ignore_bytecode(folder):
    """The bytecode Python caches for the files in `folder` (the engine and its rooms, imported)
    stays out of git: __pycache__/ holds a .gitignore of `*`. Never an error: a read-only
    checkout, or PYTHONDONTWRITEBYTECODE, caches nothing."""
    cache = os.path.join(folder, "__pycache__")
    marker = os.path.join(cache, ".gitignore")
    if sys.dont_write_bytecode or os.path.lexists(marker) or not os.path.isdir(cache):
        return
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW, 0o644)
        os.write(fd, b"# bytecode Python cached for fablize: never committed\n*\n")
        os.close(fd)
    except OSError:
        pass


def room_present(name):
    return os.path.isfile(os.path.join(os.path.dirname(os.path.realpath(__file__)), ROOMS[name]))


def room(name, needed_by=None):
    """The room `name` (a key of ROOMS), loaded once; its bytecode is cached as an import's."""
    module = sys.modules.get("fablize_" + name)
    if module is not None and getattr(module, "engine", None) is sys.modules[__name__]:
        return module
    path = os.path.join(os.path.dirname(os.path.realpath(__file__)), ROOMS[name])
    if not os.path.isfile(path):
        raise usage(f"{needed_by or name} needs {ROOMS[name]}, which is not beside "
                    f"{os.path.basename(__file__)} here — copy goals.py, fablize.py and "
                    "fablize_*.py from fablize's scripts/ folder together (README: Add it to "
                    "your project).", "room_missing")
    from importlib.machinery import SourceFileLoader
    from importlib.util import module_from_spec, spec_from_loader
    loader = SourceFileLoader("fablize_" + name, path)
    module = module_from_spec(spec_from_loader(loader.name, loader))
    sys.modules["fablize_engine"] = sys.modules[__name__]
    sys.modules[loader.name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[loader.name]
        raise
    ignore_bytecode(os.path.dirname(path))
    return module


# Commands #####################################################################################
#
# Each command is a thin layer: it opens the plan (under the lock when it writes), lets the
# transitions judge the events it builds, and states the result once — ctx.say for the text,
# ctx.data for the --json object, both rendered by Output. Nothing below this section takes the
# command line's objects.


def require_state_dir(store):
    if not store.exists():
        raise no_plan()


def open_plan(ctx, exclusive=True):
    """A session on an existing plan; refuses with the original message when there is none."""
    require_state_dir(ctx.store)
    return ctx.store.session(exclusive)


def sharing_of(store):
    """The sharing room when the plan in `store` is shared (its share.json: one lstat), else
    None: a local plan never loads it."""
    return room("sharing", "a shared plan") if os.path.lexists(store.path(SHARE)) else None


def commit_start(session, story, agent):
    """`next`'s event: `story` in progress, for `agent` (None: whoever calls)."""
    session.commit("story_started", id=story["id"], title=story["title"], round=story["round"] + 1,
                   agent=agent)


def stop_if_interrupted(ctx, records):
    """After a run a signal cut short: record the runs (the interrupted one says so) when the
    state can still be written, else remove their temp logs; then stop with exit 128 + N."""
    hit = next((r for r in records if r.get("interrupted")), None)
    if hit is None:
        return
    import signal
    name, sid = hit["interrupted"], hit["id"]
    try:
        with open_plan(ctx) as s:
            s.require_plan()
            runs = commit_runs(s, records)
        ctx.data["runs"] = runs
        fate = (f"recorded as interrupted (event {runs[-1]['seq']}, log "
                f"{shown_path(ctx.store, runs[-1]['log'])})")
    except (FablizeError, OSError) as e:
        for record in records:
            if record.get("tmp_log") and os.path.lexists(record["tmp_log"]):
                os.unlink(record["tmp_log"])
        fate = (f"not recorded ({e.message if isinstance(e, FablizeError) else e}; its temp log "
               "was removed)")
    error = FablizeError(f"interrupted by {name}: `{one_line(hit['cmd'])}` was stopped (its "
                         f"whole process group killed) and {fate}; {sid} is unchanged.",
                         exit_code=EXIT_SIGNAL_BASE + getattr(signal, name, 0))
    error.code = "interrupted"
    raise error


def record_judge_packet(ctx, sid):
    """Record the working tree as the judge sees it first; a verdict compares against it."""
    digest, count = tree_state(ctx.store.root, ctx.store.dir)
    with open_plan(ctx) as s:
        plan = s.require_plan()
        if find_story(plan, sid)["status"] != "review":
            return plan, None
        s.commit("judge_packet", id=sid, tree=digest, files=count)
        return s.plan, {"tree": digest, "files": count, "seq": s.last["seq"]}


def tree_changed_verdict(ctx, a):
    """The verdict event's fields when the tree changed since the judge packet: the judge's
    finding goes back as not-achieved (a judge that fixed the work judged nothing); else None."""
    with open_plan(ctx, exclusive=False) as s:
        plan = s.require_plan()
    packet = current_packet(find_story(plan, a.id))
    if packet is None:
        return None
    digest, _ = tree_state(ctx.store.root, ctx.store.dir)
    if digest == packet["tree"]:
        return None
    return {"verdict": "not-achieved", "tree": digest, "packet_seq": packet["seq"],
            "evidence": f"the working tree changed after the judge packet (event {packet['seq']}) "
                        f"— a judge must not change what it judges; its verdict ({a.verdict}) "
                        "is void. The judge's finding: "
                        + masked_text("--evidence", a.evidence, ctx.store.root)}


def parse_goal(value, number):
    if "::" not in value:
        raise usage(f"--goal format is 'title::objective' — invalid: {one_line(value)}", "bad_goal")
    title, objective = value.split("::", 1)
    return {"id": story_id(number), "title": plan_text("a title", title.strip()),
            "objective": plan_text("an objective", objective.strip()),
            "after": [], "checks": [], "accept": [], "judge": False}


def build_stories(a):
    """The story list of `create` from its options; usage errors name the option."""
    specs = [parse_goal(g, i) for i, g in enumerate(a.goal, 1)]
    if not specs:
        raise usage("at least one --goal is required.", "no_goals")
    by_id = {s["id"]: s for s in specs}

    def target(option, sid):
        if sid not in by_id:
            raise usage(f"{option} names {one_line(sid)}, which is not in the plan "
                        f"({specs[0]['id']}–{specs[-1]['id']}).", "unknown_id")
        return by_id[sid]

    for i, spec in enumerate(specs[1:], 1):
        spec["after"] = [] if a.parallel else [specs[i - 1]["id"]]
    for value in a.after:
        sid, deps = split_assignment("--after", value)
        target("--after", sid)["after"] = parse_ids(deps, "--after")
        for dep in by_id[sid]["after"]:
            target("--after", dep)
    for value in a.check:
        sid, cmd = split_assignment("--check", value)
        if blank(cmd):
            raise usage(f"--check {sid}= needs a command.", "blank_check")
        target("--check", sid)["checks"].append(check_command("--check", cmd))
    for cmd in a.verify:
        if blank(cmd):
            raise usage("--verify needs a command.", "blank_check")
        specs[-1]["checks"].append(check_command("--verify", cmd))
    for value in a.accept:
        sid, text = split_assignment("--accept", value)
        if blank(text):
            raise usage(f"--accept {sid}= needs the item's text.", "blank_item")
        target("--accept", sid)["accept"].append(plan_text("an acceptance item", text))
    for value in a.judge or []:
        for sid in ([s["id"] for s in specs] if value == "ALL" else parse_ids(value, "--judge")):
            target("--judge", sid)["judge"] = True
    specs[-1]["after"] = [s["id"] for s in specs[:-1]]  # the gate waits for everything
    return specs


def say_unverifiable(ctx, found):
    """What create and add say of frozen checks that cannot run yet: a program that is missing
    here must be fixed now; a file not there yet is a test-first check, fine."""
    later = [u for u in found if file_not_there_yet(u)]
    now = [u for u in found if u not in later]
    if now:
        ctx.say(f"fablize: ⚠ {count_noun(len(now), 'frozen check')} cannot run here — fix the "
                "command or install what it needs now: found at the gate, it costs the whole run:")
    for u in now:
        ctx.say(f"  {one_line(u['id'])} check {u['check'] + 1}: `{one_line(u['cmd'])}` — "
                f"{one_line(u['reason'])}")
    if later:
        ctx.say(f"fablize: {count_noun(len(later), 'frozen check')} "
                f"{'starts' if len(later) == 1 else 'start'} a file that does not exist yet — "
                "fine for a test-first plan: a story writes it, and each check runs when its "
                "own story completes:")
    for u in later:
        ctx.say(f"  {one_line(u['id'])} check {u['check'] + 1}: `{one_line(u['cmd'])}` — "
                f"{one_line(u['reason'])} yet")


def cmd_create(ctx, a):
    """create: a plan from the command line, its checks flagged when they cannot run here (a
    program missing now; a file a story will write, test-first), the previous plan archived
    whole under --force, published with --remote; ends with the next step."""
    store = ctx.store
    if not a.force and store.exists() and store.has_plan_files():
        raise refused(PLAN_EXISTS, "plan_exists")
    plan_text("--brief", a.brief)
    if blank(a.brief):
        raise usage("--brief must not be empty: it is the task every handoff starts from.",
                    "blank_brief")
    sharing = room("sharing", "create --remote") if a.remote else None
    remote = sharing.remote_arg(store, a.remote) if a.remote else None
    specs = build_stories(a)
    unverifiable = unverifiable_checks(specs, store.root)
    fields = {"brief": a.brief, "count": len(specs), "plan_id": new_plan_id(), "stories": specs,
              "options": {"rounds": a.rounds, "require_run": a.require_run},
              "unverifiable": unverifiable}
    scope = list(dict.fromkeys(scope_pattern(plan_text("--scope", p)) for p in a.scope))
    if scope:
        fields["scope"] = scope
    # judge the new plan before anything moves: a bad one must not archive the old one
    apply_event(None, dict(fields, seq=1, ts=now_iso(), event="plan_created", prev=ZERO_HASH,
                           replaces=None))
    store.create_dir()
    with store.session() as s:
        replaces = None
        if store.has_plan_files():
            if not a.force:
                raise refused(PLAN_EXISTS, "plan_exists")
            replaces = s.replace_plan(fields)
        else:
            s.commit("plan_created", **fields, replaces=None)
        plan = s.plan
    ctx.say(f"fablize: plan created — {count_stories(len(specs))}")
    for story in plan["goals"]:
        ctx.say(f"  {story['id']} {defused_line(story['title'])}: "
                f"{defused_line(story['objective'])}")
    if scope:
        ctx.say("  scope: " + ", ".join(map(one_line, scope)) + " — the paths the work may change "
                "(CI re-runs the checks with only these taken from the branch)")
    if replaces:
        ctx.say(f"fablize: the previous plan {replaces['plan_id']} is kept whole in "
                f"{replaces['path']}/ (head {replaces['head']}).")
    say_unverifiable(ctx, unverifiable)
    ctx.data.update(plan=plan_json(plan), replaces=replaces)
    if remote:  # the new plan's ledger published
        share, line = sharing.start(store, remote)
        ctx.say(line)
        ctx.data.update(share=share)
    action = next_action(ctx.prog, plan)
    ctx.say(next_line(action))  # the last line: what to do now
    ctx.data["next"] = action


def stuck_error(ctx, plan, agent):
    """Why `next` has nothing to hand out (the plan is not done): the plan's next action."""
    action = next_action(ctx.prog, plan, agent)
    if action["kind"] == "decide":
        error = refused(action["text"], "halted")
        error.commands = action["commands"]  # each whole on its own line, after the message
        return error
    if action["kind"] == "judge":
        return refused(action["text"] + ".", "awaiting_review")
    return refused(action["text"] + ".", "nothing_ready")


def cmd_next(ctx, a):
    """next: the story to work now, and its handoff. A story already in progress for this agent
    is shown again, changing nothing; else the first ready one is activated (for a shared
    plan, after pulling what other clones claimed); with nothing ready, why not and what
    would unblock it."""
    agent = a.agent
    if agent is not None and blank(agent):
        raise usage("--agent needs a name.")
    with open_plan(ctx) as s:
        plan = s.require_plan()
        sharing = sharing_of(s.store)
        if sharing is not None:
            plan = sharing.pull(s)  # the claims other clones made
        active = active_stories(plan)
        held = [x for x in active if x["agent"] == agent] if agent is not None else active
        reshown = bool(held)
        if held:
            story = held[0]  # the same caller gets its own story back; nothing is written
        else:
            story = pick_ready(plan)
            if story is None:
                if plan_done(plan):
                    ctx.say(done_line(plan))
                    ctx.data.update(plan_summary(plan), story=None, plan=plan_json(plan))
                    return
                raise stuck_error(ctx, plan, agent)
            if sharing is not None:  # on the remote before it is handed out
                story = sharing.claim(s, story, agent)
            else:
                commit_start(s, story, agent)
                story = find_story(s.plan, story["id"])
            plan = s.plan
    lines = render_handoff(ctx.prog, plan, story, reshown)
    for line in lines:
        ctx.say(line)
    ctx.data.update(plan_summary(plan), activated=not reshown, story=story_json(plan, story),
                    handoff="\n".join(clean(x) for x in lines))


def say_after_checkpoint(ctx, plan, story, agent=None):
    """What a checkpoint or a verdict left; returns the next action it named (for `agent`,
    when one checkpointed: never a story another agent holds)."""
    sid, status = story["id"], story["status"]
    if status == "failed":
        left = count_noun(rounds_left(plan, story), "round")
        ctx.say(f"fablize: {sid} → failed ({round_label(plan, story)}; {left} left) — "
                f"`{ctx.prog} next` reopens it as round {story['round'] + 1} "
                "with what was missing.")
    elif status == "blocked":
        ctx.say(f"fablize: {sid} → blocked — a human must decide.")
    elif status == "review":
        ctx.say(f"fablize: {sid} → review — an independent judge decides.")
    else:
        ctx.say(f"fablize: {sid} → {status}")
    action = next_action(ctx.prog, plan, agent)
    ctx.say(left_line(plan, action))
    return action


def reason_required(status):
    """failed and blocked carry a reason: the next round reads it, or the human who decides."""
    if status == "failed":
        return refused("a failed checkpoint requires --evidence: what is missing (the next round "
                       "is handed it).", "no_evidence")
    return refused("a blocked checkpoint requires --evidence: why it cannot be done as specified "
                   "(the human who decides is handed it).", "no_evidence")


def cmd_checkpoint(ctx, a):
    """checkpoint: record a story's result. In three steps, so that no lock is held while a
    user's command runs: check the gate and decide what verifying the story runs (its frozen
    checks, else --run's --verify-cmd); run those outside the lock, streaming their output;
    then, under the lock again, record each run and the checkpoint that cites them — a failed
    run stays recorded as evidence when the gate refuses the completion."""
    if a.run and not blank(a.verify_cmd):
        check_command("--verify-cmd", a.verify_cmd)
    root = ctx.store.root  # (a --verify-cmd is a command: kept as given, but for secrets)
    ev = {"id": a.id, "status": a.status,
          "evidence": masked_text("--evidence", a.evidence, root),
          "verify_cmd": mask(limit_text("--verify-cmd", a.verify_cmd), command=True),
          "verify_evidence": masked_text("--verify-evidence", a.verify_evidence, root)}
    if a.agent is not None:
        ev["agent"] = a.agent
    if a.run:
        if blank(a.verify_cmd):
            raise usage("--run needs --verify-cmd: the command the engine runs.")
        ev["run"] = True
    commands = []
    with open_plan(ctx) as s:
        plan = s.require_plan()
        story = find_story(plan, a.id)
        checkpoint_gate(plan, story, ev)
        # here, not in the transition: ledgers written before this rule must still replay
        if a.status != "complete" and blank(a.evidence):
            raise reason_required(a.status)
        if a.status == "complete":
            commands, note = verification_runs(story, a.verify_cmd, a.run)
            if note:
                ctx.out.warn(note)
            if story["checks"]:
                ev.pop("run", None)  # the frozen checks are the run
        if not commands:
            s.commit("checkpoint", **ev)
    runs = []
    if commands:
        records = execute_runs(ctx.store, a.id, commands, plan["ledger"]["seq"], ctx.timeout,
                               ctx.out)
        stop_if_interrupted(ctx, records)
        with open_plan(ctx) as s:
            s.require_plan()
            runs = commit_runs(s, records)
            ev["runs"] = [r["seq"] for r in runs]
            ctx.data["runs"] = runs
            try:
                s.commit("checkpoint", **ev)
            except FablizeError as e:
                failed = [r for r in runs if not run_passed(r)]
                if failed:
                    r = failed[0]
                    e.message += (f" The run is recorded (event {r['seq']}, log "
                                  f"{shown_path(ctx.store, r['log'])}); "
                                  f"{a.id} stays in progress: fix it and checkpoint again.")
                    e.code = "verification_failed"
                raise
    plan = s.plan  # as the session left it: a shared plan's publish may have pulled events
    story = find_story(plan, a.id)
    say_observed(ctx, story)
    # the next step is the last thing said, for the agent that checkpointed
    action = say_after_checkpoint(ctx, plan, story, a.agent)
    ctx.data.update(plan_summary(plan), story=story_json(plan, story), runs=runs, next=action)


def render_status(prog, plan, share=()):
    """What `status` says, whole, for a human: the plan's count and brief, a line per story
    with its details, checks that cannot run here, a pause, the next step, the shared plan's
    state, and how to pick up each story in progress."""
    lines = [count_line(plan)]
    goals = plan["goals"]
    # titles that need no escaping and carry no marker word are shown as they are: checked in
    # one pass over them all (a status of 100,000 stories renders in 50 ms, not 120)
    titles = " ".join(map(str, map(itemgetter("title"), goals)))
    plain = titles.isascii() and titles.isprintable() and not has_marker_word(titles)
    say, marks, base = lines.append, MARKS, len(BASE_FIELDS)
    for story in goals:
        status = story["status"]
        title = story["title"] if plain else defused_line(story["title"])
        say(f"  {marks[status]} {story['id']} [{status}] {title}")
        if len(story) > base:  # a story with only the original's fields has no details
            lines += [f"      {detail}" for detail in status_details(plan, story)]
    for u in plan["unverifiable"]:
        lines.append(f"  {unverifiable_label(u)}: `{one_line(u['cmd'])}` — "
                     f"{one_line(u['reason'])}{' yet' if file_not_there_yet(u) else ''}")
    lines += paused_line(prog, plan)
    action = next_action(prog, plan)
    lines.append(next_line(action))
    lines += share
    for story in active_stories(plan):
        lines.append("")
        lines += render_resume(prog, plan, story)
    return lines, action, guard_paused(plan)


def render_session_start(prog, plan, share=()):
    """What a session start hands a new session, bounded however large the plan: the count,
    the stories by status, those a human or a judge must look at (a few), the next step, the
    first story in progress with its whole handoff (a short map window, its latest
    dependencies), a line for each other one; `status` for the rest."""
    lines = [count_line(plan)]
    counts = collections.Counter(s["status"] for s in plan["goals"])
    lines.append("  " + " · ".join(f"{counts[status]} {word}" for status, word in
                                   STATUS_WORDS.items() if counts[status]))
    stuck = [s for s in plan["goals"] if s["status"] in ("failed", "blocked", "review")]
    for story in stuck[:RESUME_LISTED]:
        story = touch(story)
        why = (f": {one_line(last_chars(blocked_because(story), 120))}"
               if story["status"] == "blocked" else "")
        lines.append(f"  {MARKS[story['status']]} {story['id']} [{story['status']}] "
                     f"{one_line(short(story['title'], RESUME_TITLE))}{why}")
    if len(stuck) > RESUME_LISTED:
        lines.append(f"  … and {len(stuck) - RESUME_LISTED} more: `{prog} status` lists them")
    if plan["unverifiable"]:
        lines.append(f"  ⚠ {count_noun(len(plan['unverifiable']), 'frozen check')} cannot run "
                     f"here yet: `{prog} status` lists them")
    lines += paused_line(prog, plan)
    action = next_action(prog, plan)
    lines.append(next_line(action))
    lines += share
    active = active_stories(plan)
    if active:
        lines.append("")
        lines += render_handoff(prog, plan, active[0], True, brief=True)
    for story in active[1:RESUME_LISTED + 1]:
        lines.append(f"Also in progress: {story['id']} "
                     f"{one_line(short(story['title'], RESUME_TITLE))}"
                     + (f" (agent {one_line(story['agent'])})" if story["agent"] else "")
                     + f" — its handoff: {handoff_command(prog, story)}")
    if len(active) > RESUME_LISTED + 1:
        lines.append(f"… and {len(active) - RESUME_LISTED - 1} more in progress: "
                     f"`{prog} status` lists them")
    return lines


# each status as a session start counts it, in the order it counts them
STATUS_WORDS = {"complete": "complete", "accepted": "accepted", "in_progress": "in progress",
                "review": "in review", "failed": "failed", "blocked": "blocked",
                "pending": "pending"}


def count_line(plan):
    """The plan's first line: how much is done, and its brief."""
    accepted = accepted_ids(plan)
    # a human's accept is not a completion: with one, the count says `done`, never `complete`
    counted = (f"done ({', '.join(accepted)} accepted by a human decision)" if accepted
               else "complete")
    return (f"fablize: {done_count(plan)}/{len(plan['goals'])} {counted} — "
            f"{defused_line(plan['brief'])}")


def paused_line(prog, plan):
    paused = guard_paused(plan)
    if not paused:
        return []
    return [f"  ⏸ guard paused since event {paused['seq']}"
            f"{': ' + one_line(paused['note']) if paused['note'] else ''}"
            f" — `{human_command(prog)} unpause` turns it back on"]


def read_plan_and_share(store, imports=False):
    """(plan or None, what a shared plan's remote says or None), read without the lock."""
    with store.session(exclusive=False, imports=imports) as s:
        plan = s.load()
    sharing = sharing_of(store) if plan is not None else None
    return plan, sharing and sharing.status(store, plan), sharing


def cmd_status(ctx, a):
    if a.resume:
        return session_start(ctx, a)
    require_state_dir(ctx.store)
    plan, share, sharing = read_plan_and_share(ctx.store, imports=True)
    if plan is None:
        raise no_plan()
    shared = sharing.status_lines(share, ctx.prog) if share else ()
    lines, action, paused = render_status(ctx.prog, plan, share=shared)
    ctx.out.lines += lines
    if share:
        ctx.data["share"] = share
    if ctx.json:
        ctx.data.update(plan_json(plan), next=action, paused=paused)


def cmd_verify(ctx, a):
    with open_plan(ctx) as s:
        plan = s.require_plan()
        commands, note = verification_runs(find_story(plan, a.id), a.verify_cmd, True)
        if note:
            ctx.out.warn(note)
        if not commands:
            raise refused(f"{a.id} has no frozen checks — give --verify-cmd to run a command.",
                          "no_checks")
        after_seq = plan["ledger"]["seq"]
    records = execute_runs(ctx.store, a.id, commands, after_seq, ctx.timeout, ctx.out)
    stop_if_interrupted(ctx, records)
    with open_plan(ctx) as s:
        s.require_plan()
        runs = commit_runs(s, records)
    ctx.data["runs"] = runs
    failed = [r for r in runs if not run_passed(r)]
    if failed:
        raise refused(f"{a.id}: {len(failed)} of {count_noun(len(runs), 'check')} failed — first: "
                      f"{run_summary(failed[0])} (log {shown_path(ctx.store, failed[0]['log'])}).",
                      "verification_failed")
    ctx.say(f"fablize: {a.id}: {'all ' if len(runs) > 1 else ''}{count_noun(len(runs), 'check')} "
            "passed (status unchanged: "
            f"{find_story(s.plan, a.id)['status']}).")


def cmd_decide(ctx, a):
    signature = prev = None
    note = masked_text("--note", a.note, ctx.store.root)  # as the plan keeps it, and signed so
    if a.sign or a.signer:  # signed outside the lock, over the head the decision follows
        trust = room("trust", "decide --sign")
        trust.check_signer(a.sign, a.signer)
        with open_plan(ctx, exclusive=False) as s:
            plan = s.require_plan()
        signature, prev = trust.sign(plan, a.id, a.decision, note, a.sign, a.signer)
    with open_plan(ctx) as s:
        s.require_plan()
        signed = trust.signed_fields(s.plan, signature, prev) if signature else {}
        s.commit("decision", id=a.id, decision=a.decision, note=note, **signed)
        plan = s.plan
    story = find_story(plan, a.id)
    what = {"accept": "counts as done", "retry": "back to work, rounds reset",
            "amend": "objective amended, back to work"}[a.decision]
    ctx.say(f"fablize: {a.id} → {story['status']} ({what}; decision recorded in the ledger).")
    ctx.say(next_line(next_action(ctx.prog, plan)))
    ctx.data.update(story=story_json(plan, story))


def cmd_add(ctx, a):
    with open_plan(ctx) as s:
        plan = s.require_plan()
        spec = parse_goal(a.goal, len(plan["goals"]) + 1)
        if a.after is None:
            spec["after"] = [plan["goals"][-2]["id"]] if len(plan["goals"]) > 1 else []
        else:
            spec["after"] = parse_ids(a.after, "--after")
            for dep in spec["after"]:
                find_story(plan, dep)
                if dep == plan["goals"][-1]["id"]:
                    raise usage(f"--after {dep}: a story cannot wait for the final story.",
                                "dependency_cycle")
        for cmd in a.check:
            if blank(cmd):
                raise usage("--check needs a command.", "blank_check")
            spec["checks"].append(check_command("--check", cmd))
        spec["accept"] = [plan_text("an acceptance item", t) for t in a.accept if not blank(t)]
        spec["judge"] = a.judge
        unverifiable = unverifiable_checks([spec], ctx.store.root)
        s.commit("story_added", story=spec, unverifiable=unverifiable)
        plan = s.plan
    story = find_story(plan, spec["id"])
    ctx.say(f"fablize: added {story['id']} {defused_line(story['title'])} — before the final story "
            f"{plan['goals'][-1]['id']}" + (f", after {', '.join(story['after'])}"
                                            if story["after"] else ""))
    say_unverifiable(ctx, unverifiable)
    ctx.data.update(story=story_json(plan, story))


# audit's options that the trust room answers; --allow-* only relax its gates
TRUST_OPTIONS = ("base", "since", "rerun", "require_check", "require_witnessed",
                 "require_clean_runs", "allowed_signers", "forbid_accepted",
                 "require_unchanged_checks", "scope", "require_scope", "forbid_out_of_scope",
                 "fail_to_pass", "require_fail_to_pass", "allow_new_plan", "allow_imported")


def cmd_audit(ctx, a):
    """audit: replay the whole ledger (chain, every field, every transition, the snapshot, the
    run logs), then, with the trust room, what CI can believe of it (the pin, the scope, a
    re-run on the base's tree). Every gate that says no is named at once, the verdict first;
    `--summary` writes the same for a CI job summary, also when the ledger is damaged."""
    try:
        audit_and_judge(ctx, a)
    except FablizeError as e:
        if a.summary and not getattr(e, "summarised", False):
            write_summary(a.summary, f"❌ audit failed: {e.message}", "")
        raise


def audit_and_judge(ctx, a):
    """The audit itself: replay the whole ledger (locally, or a shared plan as its remote holds
    it) with the trust room's scan alongside; then the gates — independence, logs,
    completeness, secrets, and the trust room's (pin, scope, required checks, witnesses,
    signatures) — and the re-run on the base's tree; then one verdict, every failed gate with
    its reason and fix, the grades, and the job summary. Exit 1 names the first gate."""
    store = ctx.store
    opts = {name: getattr(a, name) for name in TRUST_OPTIONS}
    asked = [f"--{name.replace('_', '-')}" for name, value in opts.items()
             if value and not name.startswith("allow_")]
    # a plain audit reports trust too when the room is there; a lone goals.py checks the rest
    trust = (room("trust", asked[0] if asked else "audit") if asked or room_present("trust")
        else None)
    shared = {"plan": a.plan} if a.remote else None
    pin, base = trust.pin_of(store, a.base, a.since, shared) if trust else (None, None)
    scan = trust.Scan(store.root, pin) if trust else None
    if a.remote:  # a shared plan as the remote holds it: no local state needed
        # the plan CI names, else the one the base's pin names, else the remote's only plan
        plan_id = a.plan or (base or {}).get("plan_id")
        data, logs = room("sharing", "audit --remote").audit_source(store, a.remote, plan_id)
        report = audit_ledger(data, None, a.require_independent_judge, logs=logs, scan=scan)
        report["snapshot"] = "none on a remote (its ledger is the whole of it)"
    else:
        with open_plan(ctx, exclusive=False) as s:
            s.refuse_original()
            for name in (RUNS, ARCHIVE):  # a planted link would have audit read another tree
                if os.path.islink(s.store.path(name)):
                    raise symlink_refusal(s.store.path(name))
            snapshot = read_state_file(s.store.path(SNAPSHOT))  # before the ledger, as readers do
            s.ledger.open()
            report = audit_ledger(s.ledger, snapshot, a.require_independent_judge,
                                  runs_dir=s.store.path(RUNS), scan=scan)
    plan, recent = report.pop("plan"), report.pop("recent_runs")
    bad_logs = report.pop("bad_logs")
    if bad_logs:
        raise bad_logs[0]
    review = trust.review(store, plan, scan, pin, base, opts) if trust else None
    missing_logs = report["missing_logs"]
    accepted = accepted_ids(plan)
    report.update(plan_summary(plan), brief=plan["brief"], accepted=accepted)
    failures = []
    if report["independence"]:
        failures.append({"code": "judge_not_independent", "message": "a verdict was not given by "
                         "an independent judge — " + "; ".join(report["independence"]),
                         "fix": "an agent other than the executor judges the story again"})
    if a.require_logs and missing_logs:
        failures.append({"code": "missing_logs", "message":
                         f"{count_noun(missing_logs, 'verification run log')} "
                         f"{'is' if missing_logs == 1 else 'are'} missing, so "
                         f"{'that run' if missing_logs == 1 else 'those runs'} cannot be shown to "
                         "have happened", "fix": "commit .fablize/runs/"})
    if report["secret_lines"]:
        lines = report["secret_lines"]
        failures.append({"code": "secret_in_ledger", "message":
                         f"{count_noun(len(lines), 'event')} "
                         "recorded what looks like a secret (line " + ", ".join(map(str, lines)) +
                         ") — everyone who can read the plan can read it",
                         "fix": "rotate that secret now: what was committed or shared stays in the "
                         "repository's history"})
    if a.require_complete and not report["complete"]:
        left = [f"{x['id']} [{x['status']}]" for x in plan["goals"] if x["status"] not in DONE]
        failures.append({"code": "incomplete", "message": "trusted but incomplete — "
                         + ", ".join(left), "fix": "finish the plan: `next`, then `checkpoint`"})
    if trust:
        for warning in review["warnings"]:
            ctx.out.warn(warning)
        failures += trust.gates(store, plan, review, opts)
    results = trust.rerun(store, plan, review, opts, ctx.timeout) if a.rerun or (
        opts["fail_to_pass"] or opts["require_fail_to_pass"]) else []
    if results:
        failures += trust.rerun_failures(results, opts)
    grades = trust.grades(plan, results) if trust else None
    if review is not None:
        report["trust"] = {k: v for k, v in review.items()
                           if k not in ("decisions", "warnings", "tree")}
        report["trust"]["tree"] = review["tree"] and {
            k: review["tree"][k] for k in ("scope", "from", "left")}
    if results:
        report["rerun"] = results
    report.update(grades=grades, failures=failures)
    ctx.data.update(report)
    ledger_line = (f"{count_noun(report['event_count'], 'event')}, hash chain intact, every event "
                   f"one fablize writes and legal when replayed; snapshot {report['snapshot']}.")
    rerun_passed = results and not any(f["code"] == "rerun_failed" for f in failures)
    if failures:
        verdict = (f"❌ audit failed: {count_noun(len(failures), 'gate')} said no — " +
            ", ".join(f["code"] for f in failures))
        ctx.say(f"fablize: {verdict}")
        for f in failures:
            ctx.say(f"  ✗ {f['code']}: {f['message']} — fix: {f['fix']}")
        ctx.say(f"  ledger: {ledger_line}")
    else:
        verdict = ("✅ re-witnessed: every frozen check passed again; " if rerun_passed else
                   "✅ ") + f"audit ok — {report['done']}/{report['total']} done"
        if rerun_passed:
            ctx.say(f"fablize: ✅ re-witnessed — {count_noun(len(results), 'frozen check')} "
                    "passed again, run by this audit")
        ctx.say(f"fablize: audit ok — {ledger_line}")
    ctx.say(f"  head: {report['head']}   (keep it; `audit --since` proves later history only grew)")
    ctx.say(f"  plan: {report['done']}/{report['total']} done — {defused_line(plan['brief'])}"
            + (f" ({', '.join(accepted)} accepted by a human decision)" if accepted else ""))
    if report["torn_tail_bytes"]:
        ctx.say(f"  torn tail: {report['torn_tail_bytes']} bytes after the last event — a write "
                "that "
                "never completed; the next writing command moves it aside.")
    if missing_logs:
        ctx.say(f"  {count_noun(missing_logs, 'run log')} not present here (not committed?); their "
                "digests are in the ledger.")
    for line in trust.lines(review) if trust else ():
        ctx.say(line)
    for line in trust.rerun_lines(results, review["tree"]) if results else ():
        ctx.say(line)
    if grades:
        ctx.say("  " + grades_line(grades))
    standing = [(s["id"], unaddressed_failure(s)) for s in stories_in(plan, "complete")]
    for sid, o in standing:
        if o is not None:
            ctx.say(f"  {sid}: the harness last saw `{one_line(last_chars(o['cmd'], 120))}` fail "
                    f"(event {o.get('seq')}) before it was checkpointed")
    if a.summary:
        report_md = render_report(plan, recent)
        md = (trust.summary(verdict, failures, report_md, review, results, grades) if trust
              else f"## {verdict}\n\n" + report_md)
        write_summary(a.summary, None, md)
    if failures:  # each gate's fix is said above (and under --json, in `failures`)
        error = FablizeError("audit: " + (f"{failures[0]['message']} — {failures[0]['fix']}"
                                          if len(failures) == 1 else
                                          "; ".join(f["message"] for f in failures) +
                                          " (the fix of each is said above)"),
                             failures[0]["code"], EXIT_REFUSED)
        error.summarised = True
        raise error


def write_summary(path, verdict, markdown):
    """Append a job summary (Markdown) to `path`: `verdict` alone when the audit could not go
    further (a damaged ledger), else what the audit wrote."""
    text = markdown if verdict is None else f"## {verdict}\n"
    with open(path, "ab") as f:
        if f.tell() > 0:
            f.write(b"\n")
        f.write(text.encode("utf-8") + b"\n")


def cmd_rebuild(ctx, a):
    with open_plan(ctx) as s:
        s.refuse_original()
        if s.ledger.open() is None:
            raise no_plan()
        old = loose_snapshot(s.store)
        position = old.get("ledger") if old else None
        # a last line the old snapshot reflects was acknowledged: damage, not a torn write
        reflected = (position if isinstance(position, dict) and type(position.get("seq")) is int
            else {"seq": 0})
        end = s.cut_torn_tail({"ledger": reflected})
        replay = replay_all(s.ledger, end)
        plan = replay.plan
        if plan is None:
            raise no_plan()
        plan["ledger"] = replay.position()
        target = s.store.path(SNAPSHOT)
        kept = None
        if os.path.lexists(target):
            kept = os.path.basename(free_name(
                f"{target}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.bak"))
            os.replace(target, s.store.path(kept))
        s.save_snapshot(plan)
    ctx.say(f"fablize: rebuilt {SNAPSHOT} from {count_noun(replay.seq, 'ledger event')}"
            + (f"; the old one is kept as {kept}." if kept else "."))
    ctx.data.update(event_count=replay.seq, kept=kept, plan=plan_json(plan))


def cmd_log(ctx, a):
    """log: every event, checked as audit checks it, a line each. The whole history is printed
    as it is replayed, in batches (memory flat in the ledger's length; damage stops it at the
    line it names); under --json, or for one story, it is gathered first."""
    events = []
    streaming = not ctx.json and a.id is None

    def pick(replay, line, ev):
        if (a.id is None or ev.get("id") == a.id or ev["event"] == "plan_created" or
                (ev["event"] == "story_added" and ev["story"]["id"] == a.id)):
            if ctx.json:
                events.append(ev)
            else:
                ctx.say(format_event(ev))

    def stream(replay, batch):  # the whole history as text: each batch said once it replayed,
        # written every 512 lines or so, which the CPU's cache still holds as they are joined
        # and encoded (log of 100,000 real runs, medians of 15: 1.29 → 1.25 s CPU against
        # every 4,096)
        said.extend(map(format_event, batch))
        if len(said) >= 512:
            ctx.out.flush(escaped=True)

    with open_plan(ctx, exclusive=False) as s:
        s.refuse_original()
        if s.ledger.open() is None:
            raise no_plan()
        try:
            said = ctx.out.lines
            replay = (replay_all(s.ledger, s.good_end(None), on_batch=stream) if streaming else
                      replay_all(s.ledger, s.good_end(None), pick))
        except FablizeError:
            ctx.out.lines.clear()  # what was not yet written stays unsaid: the damage is the news
            raise
    if replay.plan is None:
        raise no_plan()
    if a.id is not None:
        find_story(replay.plan, a.id)
    ctx.data["events"] = events


def guard_verdict(ctx, payload, fingerprint):
    """(reason to block or None, message for the user or None) for a Stop hook."""
    if not hook_store(ctx, payload).exists():
        return None, None
    with ctx.store.session(exclusive=False) as s:
        if guard_reason(ctx.cli, s.load(), payload, fingerprint)[0] is None:
            return None, None  # most stops: decided without the lock, nothing written
    with ctx.store.session() as s:
        plan = s.load()
        reason, dup = guard_reason(ctx.cli, plan, payload, fingerprint)
        if reason is None or reason.startswith("fablize guard:"):
            return None, reason
        if not dup:  # a second registration of the guard answers the same, writes nothing
            s.commit("guard_block", reason=mask_places(reason, s.store.root),
                     fresh=payload.get("stop_hook_active") is not True,
                     **({"hook": fingerprint} if fingerprint else {}))
        return reason, None


def steps_aside(a, root, role):
    """Whether this is the plugin's copy of a hook (`--plugin`) in a project whose committed
    settings register their own: then the project's runs, and this one answers nothing."""
    return bool(getattr(a, "plugin", False)) and room("setup", "--plugin").registers(root, role)


def cmd_guard(ctx, a):
    raw, payload = read_hook_stdin()
    if payload is None:
        return  # empty or malformed input never blocks
    if steps_aside(a, hook_store(ctx, payload).root, "guard"):
        return ctx.emit_raw(None)
    if a.hook_for == "cursor":  # Cursor counts its own follow-ups and says how the turn ended
        if payload.get("status", "completed") != "completed":
            return ctx.emit_raw(None)
        count = payload.get("loop_count")
        payload["stop_hook_active"] = isinstance(count, int) and count > 0
    try:
        reason, message = guard_verdict(ctx, payload, hook_fingerprint(raw, payload))
    except FablizeError as e:  # damaged state or a busy lock: say so, never trap the agent
        reason, message = None, f"fablize guard: {e.message}"
    if reason:
        ctx.emit_raw(guard_answer(a.hook_for, reason))
    elif message and a.hook_for != "cursor":
        ctx.emit_raw({"systemMessage": message})
    else:
        ctx.emit_raw({} if a.hook_for == "gemini" else None)  # Gemini CLI reads stdout as JSON


def cmd_report(ctx, a):
    with open_plan(ctx, exclusive=False) as s:
        plan = s.require_plan()
        runs = collections.deque(maxlen=REPORT_RUNS)
        # the whole history, checked as audit does; the latest runs kept
        replay = replay_all(s.ledger, s.good_end(None), lambda replay, line, ev: runs.append(ev),
                            kinds={"verify_run"})
    text = render_report(plan, list(runs), replay.counts["verify_run"])
    target = a.out or os.environ.get("GITHUB_STEP_SUMMARY")
    if target and within(os.path.abspath(target), ctx.store.dir):
        raise usage(f"report --out {one_line(target)}: that is inside the state directory, whose "
                    "files only fablize writes.", "usage")
    if a.out:  # the user's file: in the project unless --outside, never through a symlink
        target, st = user_file(ctx.store.root, a.out, a.outside)
        write_atomic(target, text.encode("utf-8"), st.st_mode & 0o7777 if st else 0o644)
    elif target:  # CI's job summary, where CI keeps it: appended to
        with open(target, "ab+") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")  # a heading must start its own line
            f.write(text.encode("utf-8"))
    if target:
        ctx.say(f"fablize: report written to {target}")
    else:
        ctx.say(text)
    ctx.data.update(markdown=text, path=target)


def cmd_judge_packet(ctx, a):
    """judge-packet: what an independent judge needs — the objective, a checklist of every
    frozen check (with this round's witnessed run) and acceptance item, the executor's
    evidence and runs, and the three verdict commands. For a story in review it also records
    the working tree (record_judge_packet), so a verdict given after the judge changed it is
    void; for any other story it is for reading only and offers no verdict."""
    with open_plan(ctx, exclusive=False) as s:
        plan = s.require_plan()
    packet = None
    if find_story(plan, a.id)["status"] == "review":
        plan, packet = record_judge_packet(ctx, a.id)
    story = find_story(plan, a.id)
    items = [{"kind": "check", "text": cmd, "run": latest_run(story, check=i) or next(
        (r for r in reversed(story["runs"]) if r["check"] == i), None)}
        for i, cmd in enumerate(story["checks"])]
    items += [{"kind": "item", "text": text} for text in story["accept"]]
    lines = [f"=== fablize judge packet — {story['id']} {defused_line(story['title'])} "
             f"[{story['status']}, round {story['round']}]",
             "You are the judge. You did not do this work: judge the artifact itself, not anyone's "
             "account of it.",
             f"Objective: {defused_line(story['objective'])}"]
    lines += [f"Amended: {one_line(x['note'])}" for x in story["amendments"]]
    lines.append("Checklist — every item must be seen to pass:")
    for n, item in enumerate(items, 1):
        if item["kind"] == "check":
            run = item["run"]
            seen = f" — witnessed: {run_summary(run)}" if run else " — no run this round"
            lines.append(f"  [ ] {n}. run `{one_line(item['text'])}`{seen}")
        else:
            lines.append(f"  [ ] {n}. {one_line(item['text'])}")
    if not items:
        lines.append("  [ ] 1. the objective above, as stated")
    lines.append("Executor's evidence (this round):")
    lines.append(indent(defuse(story["evidence"])) if not blank(story["evidence"])
                 else "    (none)")
    if story["runs"]:
        lines.append("Witnessed runs (this round):")
        for r in story["runs"]:
            lines.append(f"  event {r['seq']}: {defuse(run_summary(r))} — output tail:")
            lines.append(indent(defuse(last_chars(r["tail"])), "      "))
    sid = story["id"]
    instructions = [
        "Go to the artifact (files, the running program, its output) and check every item.",
        "An item without evidence you saw yourself is not passed. Ambiguous means not achieved.",
        "Do not fix the work. Answer with exactly one verdict:"]
    verdicts = [
        f"{ctx.prog} verdict --id {sid} achieved --evidence \"<what you checked and saw>\" --agent "
        "<you>",
        f"{ctx.prog} verdict --id {sid} not-achieved --evidence \"<what is missing, not how to fix "
        "it>\" --agent <you>",
        f"{ctx.prog} verdict --id {sid} unachievable --evidence \"<why more rounds cannot help>\" "
        "--agent <you>",
    ]
    if story["status"] != "review":  # a verdict on it would be refused: offer none
        verdicts = []
        instructions = [f"{sid} is {story['status']}, not in review: there is nothing to judge "
                        "now, and a verdict would be refused. This packet is for reading only."]
    lines += ["How to judge:"] + [f"  - {x}" for x in instructions] + [f"    {x}" for x in verdicts]
    if packet:
        lines.append(f"Working tree recorded (event {packet['seq']}: {packet['files']} files, "
                     "sha256 "
                     f"{packet['tree'][:16]}…): a verdict given after any change to it is void and "
                     "goes back as not-achieved.")
    for line in lines:
        ctx.say(line)
    ctx.data["packet"] = packet
    ctx.data.update(id=sid, status=story["status"], round=story["round"],
                    objective=story["objective"], amendments=story["amendments"],
                    checklist=items, evidence=story["evidence"], runs=story["runs"],
                    instructions=instructions, verdicts=verdicts)


def cmd_verdict(ctx, a):
    void = tree_changed_verdict(ctx, a)
    with open_plan(ctx) as s:
        s.require_plan()
        fields = {"verdict": a.verdict,
                  "evidence": masked_text("--evidence", a.evidence, s.store.root)}
        s.commit("verdict", id=a.id, agent=a.agent, **dict(fields, **(void or {})))
        plan = s.plan
    story = find_story(plan, a.id)
    ctx.data.update(story=story_json(plan, story))
    if void:
        raise refused(f"the working tree changed since the judge packet (event "
                      f"{void['packet_seq']}): the verdict is refused and recorded as not-achieved "
                      f"— {a.id} is {story['status']}; a judge must not change what it judges.",
                      "tree_changed")
    say_after_checkpoint(ctx, plan, story)


def session_start(ctx, a):
    """`status --resume` for a SessionStart hook: the plan and its active handoffs; one line for
    a finished plan; nothing without a plan; one warning line, still exit 0, for a damaged one
    (an exit 3 there is a message the agent never sees). Codex and Gemini CLI take it as JSON
    context. Never coloured: an agent reads it."""
    ctx.out.colour = False
    if steps_aside(a, ctx.store.root, "status"):
        return ctx.emit_raw({} if a.hook_for in ("codex", "gemini") else None)
    lines = []
    try:
        plan, share, sharing = (read_plan_and_share(ctx.store, imports=True)
            if ctx.store.exists() else (None, None, None))
        if plan is not None and plan_done(plan):
            lines.append(f"fablize: plan finished ({done_count(plan)}/{len(plan['goals'])} done) — "
                         f"{defused_line(last_chars(plan['brief'], 200))}; nothing to resume.")
        elif plan is not None:
            lines = render_session_start(ctx.prog, plan,
                                         sharing.status_lines(share, ctx.prog) if share else ())
            if share:
                ctx.data["share"] = share
    except FablizeError as e:
        lines.append(f"fablize: warning: the plan in {ctx.store.dir} cannot be read — "
                     f"{one_line(e.message)} (`{ctx.prog} audit` says more).")
    if a.hook_for in ("codex", "gemini"):
        ctx.emit_raw({"hookSpecificOutput": {"hookEventName": "SessionStart",
                                             "additionalContext": "\n".join(map(clean, lines))}}
                     if lines else {})
    else:
        for line in lines:
            ctx.say(line)


def cmd_pause(ctx, a):
    with open_plan(ctx) as s:
        s.require_plan()
        s.commit("paused", note=masked_text("--note", a.note, s.store.root))
        plan = s.plan
    ctx.say(f"fablize: guard paused (event {plan['ledger']['seq']}) — the Stop hook lets the agent "
            f"stop until `{ctx.prog} unpause`.")
    ctx.data.update(paused=guard_paused(plan))


def cmd_unpause(ctx, a):
    with open_plan(ctx) as s:
        s.require_plan()
        s.commit("unpaused")
        plan = s.plan
    ctx.say(f"fablize: guard on again (event {plan['ledger']['seq']}) — the Stop hook keeps the "
            "agent at work while the plan has some.")
    ctx.data.update(paused=None)


def hook_store(ctx, payload):
    """A hook runs wherever the agent's harness started it: the plan is the one of the
    directory the payload names."""
    cwd = payload.get("cwd")
    if not isinstance(cwd, str) or "\x00" in cwd or not os.path.isdir(cwd):
        cwd = os.getcwd()  # the payload's own, when it names a directory at all
    if ctx.args.dir is None and not os.environ.get("FABLIZE_DIR"):
        ctx.store = Store(*find_state_dir(None, cwd), ctx.out.warnings)
    return ctx.store


def cmd_observe(ctx, a):
    raw, payload = read_hook_stdin()
    ctx.emit_raw({} if a.hook_for == "gemini" else None)  # it only records; Gemini wants JSON
    cmd = shell_command_of(payload) if payload else None
    if cmd is None:
        return
    try:
        store = hook_store(ctx, payload)
        if steps_aside(a, store.root, "observe"):
            return
        if not store.exists():
            return
        with store.session() as s:
            plan = s.load()
            active = active_stories(plan) if plan else []
            if len(active) != 1 or not is_verification(cmd, active[0]):
                return  # nothing to attribute it to, or not a verification
            code, ok, detail = observed_outcome(payload)
            tool = payload.get("tool_name")
            s.commit("observed_run", id=active[0]["id"], cmd=masked_tail(cmd, 2000, store.root),
                     exit_code=code, ok=ok,
                     tool=masked_tail(tool, 200, None) if isinstance(tool, str) else a.hook_for,
                     detail=masked_tail(detail, TAIL_CHARS, store.root))
    except FablizeError as e:  # never fail the agent's tool call over our bookkeeping
        sys.stderr.write("fablize observe: " + one_line(e.message) + "\n")


def say_observed(ctx, story):
    """After a checkpoint: the observed runs of the round, and a failure left standing."""
    seen = observed_of(story)
    ctx.data["observed"] = seen
    for line in render_observed(story):
        ctx.say(line)
    bad = unaddressed_failure(story)
    if bad is not None and story["status"] in DONE + ("review",):
        ctx.out.warn(f"{story['id']} was checkpointed while the harness last saw "
                     f"`{one_line(bad['cmd'])}` "
                     f"fail (event {bad.get('seq')}): `status`, `report` and `audit` show it "
                     "to the reviewer.")


# Command line #################################################################################


def colour_on(stream):
    """Colour for a terminal only: never in a pipe or a file (nor --json, nor a hook's answer),
    never with NO_COLOR set (no-color.org); FORCE_COLOR set (force-color.org) turns it on
    anywhere, except as 0 or false."""
    if os.environ.get("NO_COLOR"):
        return False
    force = os.environ.get("FORCE_COLOR")
    if force:
        return force.lower() not in ("0", "false")
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError, OSError):
        return False


# what is painted, on a terminal: (pattern, SGR code) — marks, verdicts, headings, warnings
PAINT = ((r"(?m)^(\s*)(✓|✅[^\n]*)", "32"), (r"(?m)^(\s*)(✗|■|❌[^\n]*)", "31"),
         (r"(?m)^(\s*)(▶|⚠)", "33"), (r"(?m)^(\s*)(◇)", "34"),
         (r"(?m)^()(=== fablize handoff[^\n]*|## [^\n]*)", "1"),
         (r"(?m)^()(fablize: (?:warning:|⚠)[^\n]*)", "33"), (r"()(← you are here)", "1"))


def paint(text, stream, error=False, allowed=True):
    """`text` as `stream` shows it: coloured on a terminal (an error's line red), else as is
    (and always as is where an agent reads it: `allowed` false)."""
    if not allowed or not colour_on(stream):
        return text
    for pattern, code in PAINT:
        text = regex(pattern).sub(lambda m: f"{m.group(1)}\x1b[{code}m{m.group(2)}\x1b[0m", text)
    if error:
        text = regex(r"(?m)^(fablize: (?!warning:)[^\n]*)").sub("\x1b[31m\\1\x1b[0m", text)
    return text


class Output:
    """A command's result: the lines it says, its --json data, its warnings (storage's too).
    Nothing below `main` prints, except the progress of a run while it runs; `main` renders the
    rest once, as text or as the one JSON object."""

    def __init__(self, json_mode):
        self.json = json_mode
        self.lines = []
        self.data = {}
        self.warnings = []
        self.raw = None
        self.colour = True  # false for what an agent's harness reads (a session start)

    def say(self, text=""):
        self.lines.append(text)

    def warn(self, text):
        self.warnings.append(text)

    def stream(self):
        """Where what must be seen now goes (a run starting, its output, its end): stdout in
        text mode, stderr under --json (stdout carries only the JSON object)."""
        return sys.stderr if self.json else sys.stdout

    def progress(self, text):
        stream = self.stream()
        stream.write(clean(text) + "\n")
        stream.flush()

    def flush(self, escaped=False):
        """Write the lines said so far now (text mode): a long answer streams, memory flat.
        `escaped`: each line is one_line's already (format_event's), which clean() leaves as it
        is, so they are not looked through again (log of 100,000 real runs: 0.66 → 0.22 µs a
        line)."""
        if self.lines and not self.json:
            text = "\n".join(self.lines) if escaped else clean("\n".join(map(str, self.lines)))
            sys.stdout.write(paint(text, sys.stdout) + "\n")
            self.lines.clear()

    def render(self, command, error, code):
        """The command's result on stdout and stderr."""
        if self.raw is not None:  # a hook's answer: exactly that object, or nothing
            if self.raw:
                sys.stdout.write(json_text(self.raw[0]) + "\n")
            return
        if self.json:
            obj = {"schema_version": SCHEMA_VERSION, "ok": error is None, "command": command}
            obj.update(self.data)
            if self.warnings:
                obj["warnings"] = self.warnings
            if error is not None:
                obj["error"] = {"code": error.code, "message": error.message, "exit": code}
                if getattr(error, "commands", None):
                    obj["error"]["commands"] = error.commands
            sys.stdout.write(json_text(obj) + "\n")
            return
        if self.lines:
            sys.stdout.write(paint(clean("\n".join(map(str, self.lines))), sys.stdout,
                                   allowed=self.colour) + "\n")
        err = [f"fablize: warning: {clean(text)}" for text in self.warnings]
        if error is not None:
            err.append("fablize: " + one_line(error.message))
            err += ["  " + one_line(cmd) for cmd in getattr(error, "commands", None) or ()]
        if err:
            sys.stderr.write(paint("\n".join(err), sys.stderr, error is not None,
                                   self.colour) + "\n")


class Context:
    def __init__(self, args, out, prog=None):
        self.args = args
        self.out = out
        self.say = out.say
        self.data = out.data
        self.json = out.json
        self.timeout = getattr(args, "timeout", None)
        if self.timeout is None:
            self.timeout = DEFAULT_RUN_TIMEOUT
        elif not self.timeout > 0:
            raise usage("--timeout must be a number of seconds > 0.")
        # every printed command runs as printed, from any directory of the project
        self.prog = self.cli = prog or invocation()
        self._store = None
        agent = getattr(args, "agent", None)
        if isinstance(agent, str):
            plan_text("--agent", agent)  # a name the plan records: never a secret

    @property
    def store(self):
        if self._store is None:
            path, discovered = find_state_dir(self.args.dir, os.getcwd())
            if not discovered:
                path = project_state_dir(path, self.out)
            self.store = Store(path, discovered, self.out.warnings)
        return self._store

    @store.setter
    def store(self, value):
        """The state directory commands work in; a shared plan's publishes after each write."""
        self._store = value
        sharing = sharing_of(value)
        if sharing is not None:
            sharing.attach(value)
        # not said where no branch merge can touch the plan (a shared plan lives in refs), by
        # the commands that wire the driver, nor by audit (CI's copy of the engine is no clone)
        if (sharing is None and getattr(self.args, "command", None) not in MERGE_QUIET
                and merge_driver_missing(value.root)):
            self.out.warn(f".gitattributes merges {STATE_DIRNAME}/ with fablize's merge driver, "
                          "which this clone's git config does not have: a merge of two branches' "
                          f"plans would leave conflict markers — `{self.prog} install-merge` "
                          "(once in each clone; `setup` does it too).")

    def emit_raw(self, obj):
        """Hook output: exactly this object (or nothing), whatever --json says."""
        self.out.raw = [obj] if obj is not None else []


def add_create(command):
    c = command("create", cmd_create, "create a plan of sequential stories",
            "the last one is the verification gate; freeze the commands that prove a story with "
            "--check and --verify")
    c.add_argument("--brief", required=True, help="the task, in one line")
    c.add_argument("--goal", action="append", default=[], metavar="TITLE::OBJECTIVE",
                   help="a story, in order (repeat; the last is the final verification story)")
    c.add_argument("--force", action="store_true",
                   help="replace an existing plan (it is archived whole in archive/<plan id>/)")
    c.add_argument("--check", action="append", default=[], metavar="ID=CMD",
                   help="freeze an acceptance command for a story (repeatable); its completion "
                        "runs it and needs exit 0")
    c.add_argument("--verify", action="append", default=[], metavar="CMD",
                   help="freeze a check on the final story (repeatable; same as --check on it)")
    c.add_argument("--after", action="append", default=[], metavar="ID=IDS",
                   help="explicit dependencies, e.g. G004=G001,G002; G003= means none "
                        "(default: each story after the one before it)")
    c.add_argument("--parallel", action="store_true",
                   help="no default dependencies: every story but the final one is independent")
    c.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, metavar="N",
                   help=f"rounds a story may fail before it is blocked (default {DEFAULT_ROUNDS})")
    c.add_argument("--require-run", action="store_true",
                   help="the final story completes only on a run the engine witnessed")
    c.add_argument("--judge", action="append", nargs="?", const="ALL", metavar="ID",
                   help="require an independent judge's verdict: for every story, or for ID")
    c.add_argument("--accept", action="append", default=[], metavar="ID=TEXT",
                   help="an acceptance item for a judge to check on a story (repeatable)")
    c.add_argument("--scope", action="append", default=[], metavar="PATH",
                   help="a path the work may change (repeatable: a file, a folder, or a glob like "
                        "src/** or *.py); CI's re-run takes only these from the branch, and the "
                        "tests, tools and build files from the base")
    c.add_argument("--remote", metavar="NAME",
                   help="share the new plan through this git remote (see `share`)")


def add_next(command):
    c = command("next", cmd_next, "activate the next ready story, print its handoff",
            'a story already in progress (for this agent) is printed again, never restarted')
    c.add_argument("--agent", metavar="NAME",
                   help="claim a ready story for this agent (one active story per agent)")


def add_timeout(c):
    c.add_argument("--timeout", type=float, metavar="SECONDS",
                   help=f"limit for each run; the whole process group is killed at expiry "
                        f"(default {DEFAULT_RUN_TIMEOUT:g})")


def add_checkpoint(command):
    c = command("checkpoint", cmd_checkpoint, "record a story's result, with evidence",
            "complete needs evidence, and the final story needs verification; frozen checks run "
            "by themselves")
    c.add_argument("--id", required=True, type=id_arg, help="the story, e.g. G001 (g1 works too)")
    c.add_argument("--status", required=True, choices=["complete", "failed", "blocked"],
                   help="complete (achieved), failed (not achieved: another round), blocked "
                        "(cannot be achieved: a human decides)")
    c.add_argument("--evidence", default="",
                   help="what was done and what shows it; for failed what is missing, for blocked "
                        "why (required for every status)")
    c.add_argument("--verify-cmd", dest="verify_cmd", default="",
                   help="the verification command that was run (final story)")
    c.add_argument("--verify-evidence", dest="verify_evidence", default="",
                   help="its result (final story; optional with --run)")
    c.add_argument("--run", action="store_true",
                   help="the engine runs --verify-cmd itself and records the run; only exit 0 "
                        "passes")
    add_timeout(c)
    c.add_argument("--agent", metavar="NAME", help="the agent recording it (must hold the story)")


def add_status(command):
    c = command("status", cmd_status, "show the plan and what to do next",
            "every story, what it waits for, and the next command (the first command when "
            "resuming)")
    c.add_argument("--resume", action="store_true",
                   help="also print the handoff of each story in progress; print nothing when "
                        "there is no plan (for SessionStart hooks)")
    add_hook_for(c, "with --resume: answer")


def add_verify(command):
    c = command("verify", cmd_verify, "run a story's frozen checks now",
            "the runs are recorded; the story's status does not change")
    c.add_argument("--id", required=True, type=id_arg, help="the story, e.g. G001")
    c.add_argument("--verify-cmd", dest="verify_cmd", default="",
                   help="a command to run when the story has no frozen checks")
    add_timeout(c)


def add_decide(command):
    c = command("decide", cmd_decide, "a human's call on a blocked, failed or in-review story",
            "accept it, retry it, or amend its objective")
    c.add_argument("--id", required=True, type=id_arg, help="the story, e.g. G001")
    c.add_argument("decision", choices=DECISIONS,
                   help="accept (counts as done), retry (back to work, rounds reset), amend "
                        "(extend the objective, back to work)")
    c.add_argument("--note", required=True, help="the reason, or the feedback or amendment")
    c.add_argument("--sign", metavar="KEYFILE",
                   help="sign the decision with this ssh key (ssh-keygen -Y sign -n fablize)")
    c.add_argument("--signer", metavar="PRINCIPAL",
                   help="the signer's principal, as listed in the allowed-signers file")


def add_add(command):
    c = command("add", cmd_add, "add a story before the final one",
            'stories can be added until the final story starts')
    c.add_argument("--goal", required=True, metavar="TITLE::OBJECTIVE", help="the new story")
    c.add_argument("--check", action="append", default=[], metavar="CMD",
                   help="freeze an acceptance command for it (repeatable)")
    c.add_argument("--after", metavar="IDS",
                   help="its dependencies, e.g. G001,G002; empty for none (default: the story "
                        "before the final one)")
    c.add_argument("--accept", action="append", default=[], metavar="TEXT",
                   help="an acceptance item for a judge (repeatable)")
    c.add_argument("--judge", action="store_true", help="require an independent judge's verdict")


def add_audit(command):
    c = command("audit", cmd_audit, "check that the whole ledger can be trusted",
            "replay every line: hash chain, every field, every transition, the snapshot and the "
            "run logs")
    c.add_argument("--require-complete", action="store_true",
                   help="exit 1 unless every story is complete or accepted")
    c.add_argument("--since", metavar="[SEQ:]HASH",
                   help="exit 3 unless the ledger still holds this earlier head "
                        "(history only grew)")
    c.add_argument("--require-independent-judge", action="store_true",
                   help="exit 1 unless every verdict came from an agent other than the executor")
    c.add_argument("--require-logs", action="store_true",
                   help="exit 1 unless every verification run has its log present (and matching)")
    add_audit_trust(c)


TRUST_MODEL = """\
Trust model — three grades of evidence:
  claimed       text the agent typed (--evidence, --verify-cmd + --verify-evidence).
  witnessed     the engine ran the command (--run, frozen checks) and recorded its exit
                code, digest and log. It proves the command ran and what it printed, in
                the agent's environment; not that the environment was honest.
  re-witnessed  CI, with its own copy of the engine (python3 -I) and its own environment,
                re-ran the plan's frozen checks on the committed tree (--rerun).
The hash chain proves only that history after a pin grew, not who wrote it. Trust comes
from what the agent cannot write: the base branch's committed ledger and archives (--base),
CI's own re-run (--rerun), checks CI requires (--require-check) and a human's key
(decide --sign, verified with --allowed-signers read from the base branch)."""


def add_audit_trust(c):
    c.epilog, c.raw_epilog = TRUST_MODEL, True
    c.add_argument("--base", metavar="REF",
                   help="take the pin from the ledger committed at this git ref (e.g. "
                        "origin/main); "
                        "files named by --allowed-signers are read from it too")
    c.add_argument("--allow-new-plan", action="store_true",
                   help="accept a plan created after the pin (its frozen checks are printed)")
    c.add_argument("--allow-imported", action="store_true",
                   help="accept a plan imported from the original goals.py format after the pin")
    c.add_argument("--rerun", nargs="?", const="all", choices=["final", "all"],
                   help="re-run the frozen checks (of all stories, or of the final one), recording "
                        "nothing: with --base and a scope, on the base's tree with the branch's "
                        "in-scope files; exit 1 if any fails")
    c.add_argument("--scope", action="append", default=[], metavar="PATH",
                   help="the paths the work may change, as CI gives them (repeatable; wins over "
                        "the plan's): the re-run takes only these from the branch")
    c.add_argument("--require-scope", action="store_true",
                   help="exit 1 unless a scope is known (CI's, or the plan's as the base holds it)")
    c.add_argument("--forbid-out-of-scope", action="store_true",
                   help="with --base: exit 1 if the branch changed files outside the scope")
    c.add_argument("--fail-to-pass", action="store_true",
                   help="with --base: also run the final story's frozen checks on the base's tree "
                        "alone; one that passes there is reported as vacuous")
    c.add_argument("--require-fail-to-pass", action="store_true",
                   help="with --base: exit 1 if a final check passes on the base's tree alone")
    c.add_argument("--summary", metavar="FILE",
                   help="append the verdict, every failed gate and the report to FILE as Markdown "
                        "(a CI job summary), even when the ledger is damaged")
    c.add_argument("--require-check", action="append", default=[], metavar="CMD",
                   help="exit 1 unless the final story carries exactly this frozen check "
                        "(repeatable; with --rerun it must pass)")
    c.add_argument("--require-witnessed", action="store_true",
                   help="exit 1 unless every completed story rests on its frozen checks run by "
                        "the engine (not a claim, not an ad-hoc --run)")
    c.add_argument("--require-clean-runs", action="store_true",
                   help="exit 1 if a run was made outside the repository root, on a dirty tree, "
                        "or under an environment different from the plan's first run")
    c.add_argument("--allowed-signers", metavar="PATH",
                   help="exit 1 unless every decision is signed (decide --sign) by a key in this "
                        "ssh allowed-signers file")
    c.add_argument("--forbid-accepted", action="store_true",
                   help="exit 1 if any story was accepted by a decision instead of completed")
    c.add_argument("--require-unchanged-checks", action="store_true",
                   help="with --base: exit 1 if a file or folder a frozen check names differs "
                        "from the base branch (a frozen `python3 check.py` is only as good as "
                        "check.py)")
    add_timeout(c)
    c.add_argument("--remote", metavar="NAME",
                   help="audit the shared plan as this git remote holds it (fetched; no local "
                        "state needed)")
    c.add_argument("--plan", metavar="ID",
                   help="with --remote: which shared plan (default: the only one)")


def add_rebuild(command):
    command("rebuild", cmd_rebuild, "regenerate goals.json from the ledger",
            'the old snapshot is kept beside it')


def add_log(command):
    c = command("log", cmd_log, "the plan's history, readable",
            "every event of the ledger, checked as audit checks it")
    c.add_argument("--id", type=id_arg, help="only this story's events, e.g. G001")


def add_guard(command):
    c = command("guard", cmd_guard, "Stop hook: no stopping while work is left",
                "reads the hook JSON on stdin; never blocks on bad input, a busy lock or damaged "
                "state")
    add_hook_for(c, "answer")


def add_report(command):
    c = command("report", cmd_report, "a Markdown summary for a PR or CI job",
            'progress, stories, the latest runs and the dependency graph')
    c.add_argument("--out", metavar="FILE",
                   help="write it here (default: append to $GITHUB_STEP_SUMMARY when set, else "
                        "stdout)")
    c.add_argument("--outside", action="store_true",
                   help="--out may name a file outside the project (never through a symlink)")


def add_judge_packet(command):
    c = command("judge-packet", cmd_judge_packet, "what a judge needs to judge a story",
            "the objective, the checklist and this round's evidence and runs")
    c.add_argument("--id", required=True, type=id_arg, help="the story, e.g. G001")


def add_verdict(command):
    c = command("verdict", cmd_verdict, "a judge's verdict on a story in review",
            "the judge must not be the story's executor")
    c.add_argument("--id", required=True, type=id_arg, help="the story, e.g. G001")
    c.add_argument("verdict", choices=VERDICTS,
                   help="achieved (complete), not-achieved (another round with what is missing), "
                        "unachievable (blocked: a human decides)")
    c.add_argument("--evidence", required=True, help="what you checked and saw, or what is missing")
    c.add_argument("--agent", required=True, help="who judged (must not be the executor)")


def add_hook_for(c, what):
    c.add_argument("--for", dest="hook_for", choices=HOOK_AGENTS, default="claude",
                   help=f"{what} in this agent's hook protocol (default: claude)")
    c.add_argument("--plugin", action="store_true",
                   help="this registration is the fablize-gate plugin's: it does nothing where "
                        "the project registers its own (each hook runs once)")


def add_pause(command):
    c = command("pause", cmd_pause, "let the Stop guard rest (recorded)",
                "the agent may stop although the plan has work; recorded in the ledger")
    c.add_argument("--note", help="why (shown in status and the history)")


def add_unpause(command):
    command("unpause", cmd_unpause, "turn the Stop guard back on", "recorded in the ledger")


def add_observe(command):
    c = command("observe", cmd_observe, "PostToolUse hook: note verification runs",
                "records a verification command the agent ran and what its harness reported "
                "(reads the hook JSON on stdin)")
    add_hook_for(c, "read the payload")


# The core's commands, by their builders; the rooms' (ROOM_COMMANDS) come from their rooms.
COMMANDS = {"create": add_create, "next": add_next, "checkpoint": add_checkpoint,
            "status": add_status, "verify": add_verify, "decide": add_decide, "add": add_add,
            "audit": add_audit, "rebuild": add_rebuild, "log": add_log, "guard": add_guard,
            "report": add_report, "judge-packet": add_judge_packet, "verdict": add_verdict,
            "pause": add_pause, "unpause": add_unpause, "observe": add_observe}


def command_names():
    """Every command, as `--help` lists them: the core's, then the rooms'."""
    return list(COMMANDS) + list(ROOM_COMMANDS)
DIR_HELP = ("state directory (default: $FABLIZE_DIR, else .fablize/ found walking up to the "
            "repository root); a project root means its .fablize/")
JSON_HELP = "print exactly one JSON object to stdout"


def command_in(argv):
    """The subcommand named in argv, so that only its parser is built (argparse costs ~1 ms a
    subcommand); None for --help, --version or anything unexpected."""
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token == "--dir":
            skip = True
        elif token in COMMANDS or token in ROOM_COMMANDS:
            return token
        elif not (token == "--json" or token.startswith("--dir=")):
            return None
    return None


class Command:
    """One command as its builder declares it: its --help lines and the add_argument calls
    argparse is given, kept, so that only the command named is built (build_parser) and its
    options can be listed (the docs' tests)."""

    def __init__(self, name, func, summary, details):
        self.name, self.summary, self.description = name, summary, f"{summary}: {details}"
        self.defaults = {"func": func}
        self.arguments = []  # (option strings, add_argument's keywords)
        self.epilog, self.raw_epilog = None, False

    def add_argument(self, *names, **options):
        self.arguments.append((names, options))

    def set_defaults(self, **values):
        self.defaults.update(values)


def command_spec(name):
    """The Command `name` declares: the core's builder, or its room's (loaded for it)."""
    builder = COMMANDS.get(name) or room(ROOM_COMMANDS[name], name).COMMANDS[name]
    made = []
    builder(lambda *fields: made.append(Command(*fields)) or made[-1])
    return made[0]


def better_usage_error(parser, message):
    """argparse's complaint, with what was probably meant: an unknown command or choice gets
    its nearest name (`chekpoint` → `checkpoint`) instead of the list of every one, and an
    unknown option the nearest option of its command."""
    import difflib
    m = re.match(r"argument (\S+): invalid choice: '?(.*?)'? \(choose from (.*)\)\Z", message, re.S)
    if m:
        name, word = m.group(1), m.group(2)
        choices = re.findall(r"[\w-]+", m.group(3))
        close = difflib.get_close_matches(word, choices, 1, 0.7)
        hint = f" — did you mean `{close[0]}`?" if close else ""
        if name == "COMMAND":
            return f"unknown command `{one_line(word)}`{hint}"
        return message + hint  # the original's words, which scripts may read
    m = re.match(r"unrecognized arguments: (.*)\Z", message, re.S)
    if m:
        options = set()  # the commands' own options: --dir or --help are seldom what was meant
        for action in parser._actions:
            for sub in (getattr(action, "choices", None) or {}).values():
                if isinstance(sub, argparse_parser()):
                    options.update(o for a in sub._actions for o in a.option_strings)
        for word in m.group(1).split():
            close = difflib.get_close_matches(word.split("=")[0],
                                              sorted(options - {"--dir", "--json", "-h", "--help"}),
                                              1, 0.7)
            if word.startswith("-") and close:
                return f"{message} — did you mean `{close[0]}`?"
    return message


def argparse_parser():
    import argparse
    return argparse.ArgumentParser


# what --help shows a command (None: the engine's own --help) used for: whole command lines
EXAMPLES = {
    None: ['create --brief "Add --version" --goal "Flag::cli.py accepts --version" '
           '--goal "Verify::the tests pass" --verify "python3 -m pytest -q"',
           "next",
           'checkpoint --id G001 --status complete --evidence "cli.py --version prints 1.0"',
           "status", "audit"],
    "create": ['--brief "Add --version" --goal "Flag::cli.py accepts --version" '
               '--goal "Verify::the tests pass" --verify "python3 -m pytest -q"',
               '--brief "Two parts" --parallel --goal "API::the endpoint answers" '
               '--goal "UI::the page shows it" --goal "Verify::all tests pass" '
               '--check "G001=python3 -m pytest -q tests/test_api.py" --verify "make test"'],
    "checkpoint": ['--id G001 --status complete --evidence "tests/test_cli.py passes: 4 passed"',
                   '--id G002 --status complete --evidence "the suite passes" --run '
                   '--verify-cmd "python3 -m pytest -q"',
                   '--id G001 --status failed --evidence "the parser rejects -V"',
                   '--id G001 --status blocked --evidence "needs an API key nobody has"'],
    "decide": ['--id G003 accept --note "the manual check is enough here"',
               '--id G003 retry --note "use the fixture in tests/conftest.py"',
               '--id G003 amend --note "only the CLI, not the GUI"'],
    "audit": ["", "--require-complete --require-logs",
              "--base origin/main --rerun --require-witnessed"],
    "status": ["", "--resume"],
}


def examples(prog, name):
    command = f"{prog} {name}" if name else prog
    return "Examples:\n" + "\n".join(f"  {command} {line}".rstrip() for line in EXAMPLES[name])


def build_parser(only=None, prog="goals.py"):
    """The command-line parser: every command, or just `only`."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise usage(f"{better_usage_error(self, message)} (see `{self.prog} --help`)")

    common = Parser(add_help=False)
    common.add_argument("--dir", default=argparse.SUPPRESS, metavar="PATH", help=DIR_HELP)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=JSON_HELP)

    class Formatter(argparse.HelpFormatter):
        def __init__(self, prog):
            super().__init__(prog, max_help_position=30)
            self._action_max_length = 20  # room for `install-block` and its line on one row

        def _fill_text(self, text, width, indent):  # examples keep their lines
            return text if "\n" in text else super()._fill_text(text, width, indent)

    p = Parser(prog=prog, formatter_class=Formatter,
               description="fablize goal engine: split a task into stories; "
               "\"done\" is refused until evidence shows it.",
               epilog=examples(prog, None) +
               "\n\nExit codes: 0 done, 1 refused, 2 usage, 3 damaged state; 128+N interrupted"
               "\nby signal N during a run (130 SIGINT, 143 SIGTERM, 129 SIGHUP), the run"
               f"\nrecorded as interrupted. `{prog} COMMAND --help` shows a command's options.")
    p.add_argument("--version", action="version", version=f"fablize {__version__}",
                   help="print the version and exit")
    p.add_argument("--dir", default=None, metavar="PATH", help=DIR_HELP)
    p.add_argument("--json", action="store_true", default=False, help=JSON_HELP)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for name in command_names() if only is None else [only]:
        if only is None and name in ROOM_COMMANDS and not room_present(ROOM_COMMANDS[name]):
            sub.add_parser(name, help=f"(needs {ROOMS[ROOM_COMMANDS[name]]} beside this file)")
            continue
        # a command's summary is its line in `--help`, and its own --help starts with it
        spec = command_spec(name)
        epilog = spec.epilog
        if name in EXAMPLES:
            epilog = examples(prog, name) + (f"\n\n{epilog}" if epilog else "")
        c = sub.add_parser(name, parents=[common], help=spec.summary,
                           description=spec.description, epilog=epilog,
                           formatter_class=(argparse.RawDescriptionHelpFormatter
                                            if spec.raw_epilog else Formatter))
        for names, options in spec.arguments:
            c.add_argument(*names, **options)
        c.set_defaults(**spec.defaults)
    return p


def utf8_streams():
    """Marks like ✓ ▶ ■ must not crash a cp949 or cp1252 console: write UTF-8 regardless. A
    stream started closed (None) writes to the null device: what it would say is lost, not the
    exit code."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower()
        encoding = encoding.replace("-", "").replace("_", "")
        if encoding != "utf8" and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(encoding="utf-8", errors="replace")
            except (ValueError, OSError):
                pass


def answer_interrupts():
    """From here on, Ctrl-C raises KeyboardInterrupt, which `main` answers; one kept while the
    process started is raised now."""
    if "_signal" in globals():
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
        if STARTUP_INTERRUPT:
            raise KeyboardInterrupt


def no_plan_commands(ctx):
    """Under the original's refusal (kept to the byte: scripts read it), the one case it never
    had: a fresh clone of a repository that pins a shared plan brings it in with `sync`."""
    store = ctx._store
    if store is not None and os.path.lexists(store.path(PIN)) and not os.path.lexists(
            store.path(SHARE)):
        return [f"{ctx.prog} sync"]
    return None


def keep_interrupts():
    if "_signal" in globals():
        _signal.signal(_signal.SIGINT, lambda signum, frame: None)


def main(argv=None):
    argv = [fix_argv_text(x) for x in (sys.argv[1:] if argv is None else argv)]
    utf8_streams()
    out = Output("--json" in argv)
    command = ctx = None
    try:
        answer_interrupts()
        # usage errors and --help name the engine as it was started, runnable as printed
        prog = invocation()  # once a start: the usage line and every printed command use it
        name = command_in(argv)
        args = build_parser(name, prog).parse_args(argv)
        command = args.command
        out.json = args.json and command != "guard"
        ctx = Context(args, out, prog)
        args.func(ctx, args)
        code, error = EXIT_OK, None
    except FablizeError as e:
        code, error = e.exit_code, e
        if e.code == "no_plan" and ctx is not None and not getattr(e, "commands", None):
            e.commands = no_plan_commands(ctx)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        # a failure on what the snapshot holds is its damage; on a sound one, a genuine bug
        error = snapshot_damage(ctx._store) if ctx is not None and ctx._store else None
        if error is None:
            raise e
        code = error.exit_code
    except BrokenPipeError:  # the reader of a run's streamed output left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:  # a failing disk, a full one, a permission: state stays old or new
        code, error = EXIT_DAMAGED, FablizeError(f"I/O error: {e}", "io_error", EXIT_DAMAGED)
    except KeyboardInterrupt:  # Ctrl-C outside a run: every write is whole or absent
        error = FablizeError("interrupted by SIGINT; the state is as the last completed write "
                             "left it.", exit_code=EXIT_SIGNAL_BASE + 2)
        error.code = "interrupted"
        code = error.exit_code
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    keep_interrupts()  # the command is over: a Ctrl-C now changes nothing it did or says
    try:
        out.render(command, error, code)
        sys.stdout.flush()
    except BrokenPipeError:  # `goals.py status | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


def run():
    """`main` as a whole process. It ends with os._exit: by then every write is fsynced and the
    lock released, so the interpreter's teardown would only free memory, which costs a start
    about 4 ms (more with a large plan loaded)."""
    import gc
    gc.disable()  # a short-lived process: what it allocates is freed on exit (a 10,000-story plan
    # is some 10 ms of collections otherwise); reference counting still frees everything else
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: started with that descriptor closed
                stream.flush()
        except (OSError, ValueError):  # a reader that left, a stream already closed
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
