"""Constants, the one exception type (FablizeError) and the small helpers every layer uses:
hashing, JSON, text escaping and defusing, ids, scopes. Imports nothing of the engine.
"""

import json
import os
import re
import time
from types import MappingProxyType


SCHEMA_VERSION = 2          # of the --json envelope (2: `done` is a count everywhere)
ZERO_HASH = "0" * 64
STATE_DIRNAME = ".fablize"
SNAPSHOT = "goals.json"
LEDGER = "ledger.jsonl"
LOCK = "lock"
RUNS = "runs"
INFLIGHT = ".inflight"       # runs/.inflight/: a note for each run in flight, while it runs
ARCHIVE = "archive"
NOT_THERE = " does not exist"  # a check's file: a story may yet write it (test-first)
SHARE = "share.json"        # marks a shared plan (the sharing room's record)
PIN = "pin.json"            # a shared plan's pin, committed for CI's --base (sync --pin)
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
# every command that runs checks takes it: (flags, argparse's options)
TIMEOUT_OPTION = (("--timeout",), {
    "type": float, "metavar": "SECONDS",
    "help": f"limit for each run; the whole process group is killed at expiry (default "
            f"{DEFAULT_RUN_TIMEOUT:g})"})
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
# what a tripwire is, wherever one is said (report, judge-packet, audit's gate and its help)
TRIPWIRE = "reaches into the test run or looks for its judge"
PLAN_EXISTS = "a plan already exists. Check it with `status`, or replace it with --force."


class Step(tuple):
    """One runnable next step an error names, decided where the error is raised and printed
    whole by the command line (render.step_text): the engine's own subcommand (`Step.engine`),
    after the engine as it was started; the same as a person runs it in their own terminal
    (`Step.human`: the plugin's launcher by its full path); or the command again as it was
    started (`Step.again`: with `extra` arguments after it, a variable `env` set for it). A
    plain string is a step printed as it is: git's, a shell's."""

    __slots__ = ()
    kind = property(lambda self: self[0])
    args = property(lambda self: self[1])
    env = property(lambda self: self[2])

    @classmethod
    def engine(cls, args):
        return cls(("engine", args, None))

    @classmethod
    def human(cls, args):
        return cls(("human", args, None))

    @classmethod
    def again(cls, extra="", env=None):
        return cls(("again", extra, env))


def create_args(force=False):
    """A new plan, as a human writes it (what to write is theirs), after the engine: the step
    of `no plan`, and of a plan that cannot go on (its history damaged, or done and more work
    found)."""
    return (f"create{' --force' if force else ''} --brief \"<brief>\" "
            "--goal \"<title>::<objective>\"")


class FablizeError(Exception):
    """The one exception the engine raises on purpose: a message, a stable code, an exit code,
    and `steps`, the way out (a Step or a string, or a list of them), all decided where the
    refusal is. Nothing above the raise edits it: the command line renders it once, naming the
    step the error leaves to it — the command again, `--help` — where it names none. `said`:
    what happened without the way out (the message where it is not given), for a caller that
    goes on and says it as a warning. `detail`: what a caller that handles it may read, fixed
    here too (read-only): `lineno` (the ledger line damaged), `path` (the run log that does not
    match), `no_plan_at` (a shared ref's commit that holds no plan), `summarised` (audit's job
    summary already says it)."""

    def __init__(self, message, code="refused", exit_code=EXIT_REFUSED, steps=(), said=None,
                 detail=None):
        super().__init__(message)
        self.message = message
        self.said = message if said is None else said
        self.code = code
        self.exit_code = exit_code
        self.steps = (steps,) if isinstance(steps, (str, Step)) else tuple(steps)
        self.detail = MappingProxyType(dict(detail or {}))


def refused(message, code="refused", steps=(), detail=None):
    return FablizeError(message, code, EXIT_REFUSED, steps, detail=detail)


def usage(message, code="usage", steps=()):
    return FablizeError(message, code, EXIT_USAGE, steps)


def damaged(message, code="damaged", steps=(), detail=None):
    return FablizeError(message, code, EXIT_DAMAGED, steps, detail=detail)


def no_plan():
    """The original's refusal when there is no plan to work on: one wording, every command."""
    return refused("no plan — run `create` first.", "no_plan")


def forged(what):
    """A field no command of this engine would have written: the ledger was written by hand."""
    return damaged(what + " — not what fablize writes: the line was written or edited by hand.",
                   "bad_event")


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
    """OpenSSL's SHA-256 constructor (several times faster on long inputs; it costs ~2.3 ms to
    load, so only what reads a whole ledger or a large file uses it), taken from the module
    hashlib wraps: hashlib's own set-up (its other algorithms) is another ~0.5 ms."""
    try:
        from _hashlib import openssl_sha256 as sha256
    except ImportError:  # a Python built without OpenSSL, or one that names it otherwise
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
    # translate looks each character up): most text holds none
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
                    "(a file, a folder or a glob like src/** or src/*.py).", "bad_scope")
    return path.rstrip("/") + ("/" if path.endswith("/") else "")


def is_plan_id(text):
    return type(text) is str and bool(re.fullmatch(PLAN_ID, text, re.A)) and ".." not in text


def new_plan_id():
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + os.urandom(3).hex()


def count_noun(n, noun):
    """`1 event`, `2 events`, `1 story`, `3 stories`, `2 fixes`: a count and its noun, never
    `event(s)`; the one place a plural is made."""
    if n == 1:
        return f"1 {noun}"
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return f"{n} {noun[:-1]}ies"
    return f"{n} {noun}{'es' if noun.endswith(('s', 'x', 'sh', 'ch')) else 's'}"


def count_stories(n):
    return count_noun(n, "story")


def time_label(ts):
    """A ledger time for people: `2026-12-01 08:12:50 UTC` (the ledger writes UTC)."""
    ts = str(ts or "")
    zone = ts[26:] if len(ts) > 26 else ""
    zone = "UTC" if zone in ("+00:00", "Z", "") and ts else zone
    return f"{ts[:19].replace('T', ' ')} {zone}".strip()


# The snapshot ###
#
# goals.json starts with its digest: the SHA-256 of the file's own bytes after that first key, so
# checking it costs one hash and no re-serialising. One story a line, each compact (only the
# fields that differ from their defaults). Older snapshots still load: version 2 held every field
# of every story, version 1 also every run (it is rebuilt from the ledger) and a digest over
# sorted keys.

SNAPSHOT_VERSION = 3
