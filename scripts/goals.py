#!/usr/bin/env python3
"""fablize goal engine: "done" is refused until it is shown.

A task is split into stories (`create`). `next` activates one and prints the
handoff a fresh session needs; `checkpoint` completes it only with evidence; the
final story is a verification gate that needs the command that was run and its
result, and the engine can run that command itself (`--run`, frozen checks), so a
claimed pass cannot be faked. Stories that fail come back as a new round with what
was missing; stories that cannot be done halt the plan until a human decides.

Invariants, enforced in code and re-checked by `audit` on every event:
  1. a story is checkpointed only after `next` activated it;
  2. `complete` needs non-blank evidence;
  3. the final story completes only with verification: --verify-cmd and
     --verify-evidence, a witnessed run (--run), or all its frozen checks passing
     in a run made after its latest activation;
  4. the state persists under .fablize/, so `status` resumes a dead session.

Files (the state directory, normally .fablize/ at the repository root):
  goals.json    snapshot of the plan; rewritten atomically; derivable from the ledger
  ledger.jsonl  the source of truth: append-only, one event a line, hash-chained
  lock          the lock file, never renamed
  runs/         full output of verification runs the engine executed itself
  archive/      plans replaced by `create --force`, kept whole

Exit codes: 0 done, 1 refused, 2 usage, 3 damaged. Stdlib only, Python 3.9+.
"""

import json
import os
import re
import sys
import time

__version__ = "1.0.0"

# Constants ##################################################################

SCHEMA_VERSION = 1
ZERO_HASH = "0" * 64
STATE_DIRNAME = ".fablize"
SNAPSHOT = "goals.json"
LEDGER = "ledger.jsonl"
LOCK = "lock"
RUNS = "runs"
ARCHIVE = "archive"

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_DAMAGED = 0, 1, 2, 3

STATUSES = ("pending", "in_progress", "complete", "failed", "blocked", "accepted", "review")
DONE = ("complete", "accepted")
MARKS = {"complete": "✓", "in_progress": "▶", "pending": "·", "failed": "✗",
         "blocked": "■", "accepted": "✓", "review": "◇"}
MAP_LABELS = {"complete": "done", "pending": "pending", "failed": "failed", "blocked": "blocked",
              "accepted": "accepted", "review": "review", "in_progress": "active"}
DECISIONS = ("accept", "retry", "amend")
VERDICTS = ("achieved", "not-achieved", "unachievable")

TAIL_CHARS = 500            # carried evidence and run tails (seed 004)
MAP_WINDOW = 30             # plan-map lines around the current story (seed 004)
MAP_LOOKBACK = 10           # of which at most this many come before it
MAX_TEXT = 1 << 20          # one user-supplied text field, in UTF-8 bytes
DEFAULT_ROUNDS = 3
DEFAULT_RUN_TIMEOUT = 600.0
DEFAULT_LOCK_TIMEOUT = 10.0
DEFAULT_GUARD_MAX = 3       # Stop-hook blocks in a row before the guard lets go
READ_CHUNK = 1 << 16

BLOCK_BEGIN = "<!-- fablize:begin -->"
BLOCK_END = "<!-- fablize:end -->"
BLOCK_TEMPLATE = """\
<!-- fablize:begin -->
## fablize — evidence gate for multi-story work

[2+ sequential stories] When a task needs two or more sequential steps, run it
through fablize instead of declaring "done" yourself:

1. `{cli} create --brief "<task>" --goal "title::objective" ... --verify "<test command>"`
   The last story is the verification gate. Freeze the checks that prove a story with
   `--check G00N="<cmd>"`; if it says a check cannot run here, fix that now.
2. `{cli} next` — activates ONE story and prints its handoff. Work that story only.
3. `{cli} checkpoint --id G00N --status complete --evidence "<what you did, what you saw>"`
   Frozen checks run by themselves; otherwise prefer `--run --verify-cmd "<cmd>"`: the
   engine runs the command and records the result.
   Not achieved yet: `--status failed --evidence "<what is missing>"` (another round).
   Impossible as specified: `--status blocked --evidence "<why>"`, then stop and ask the human.
4. A judged story (`create --judge`) goes to review: never judge your own work. A separate
   judge runs `{cli} judge-packet --id G00N`, checks the artifact itself and answers with
   `{cli} verdict --id G00N achieved|not-achieved|unachievable --evidence "<what it saw>" --agent <judge>`.
5. Repeat from 2 until it prints `all stories complete ✓` (or `all stories done ✓` after a
   human accepted a story). A refusal is not an error to work around: produce the evidence
   it asks for.
6. Resuming after a crash or compaction: `{cli} status`, then `{cli} next`.

Never edit `.fablize/` by hand; `{cli} audit` detects it.
<!-- fablize:end -->
"""

# Errors #####################################################################


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


# Small helpers ##############################################################


def sha256_hex(data):
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


def now_iso():
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + ".%06d+00:00" % int(t % 1 * 1e6)


def dumps(obj):
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def has_surrogate_escape(raw):
    return (b"\\ud" in raw or b"\\uD" in raw) if isinstance(raw, bytes) else \
        ("\\ud" in raw or "\\uD" in raw)


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


def blank(text):
    return not (text and text.strip())


def last_chars(text, n=TAIL_CHARS):
    text = text or ""
    return text if len(text) <= n else "…" + text[-n:]


def _escape_table(keep):
    table = {c: "\\x%02x" % c for c in list(range(0x20)) + [0x7F] + list(range(0x80, 0xA0))
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
    """Text safe for a terminal: control characters shown escaped, newlines kept."""
    return str(text).translate(_ESCAPE_TEXT)


def one_line(text):
    """Text safe inside one line of output: newlines escaped too, so it cannot forge a row."""
    return str(text).translate(_ESCAPE_LINE)


_MARKERS = (
    (re.compile(r"=+\s*fablize\s+handoff\b[^\n]*", re.I), "[quoted fablize-handoff]"),
    (re.compile(r"all\s+stories\s+(complete|done)", re.I), r"all-stories-\1"),
    (re.compile(r"\bcheckpoint\s+--id\b(\s+\S+)?", re.I), "checkpoint-(quoted)"),
    (re.compile(r"^(\s*)fablize:", re.I | re.M), r"\1fablize-quoted:"),
)


def defused_line(text):
    """A title, objective or brief on one line of output: escaped, and unable to pass for an
    engine marker."""
    return defuse(one_line(text))


def defuse(text):
    """Carried text cannot pass for engine output: markers are rewritten into hyphenated
    forms that a scanner (even one reading a whitespace-stripped view) does not accept."""
    text = clean(text)
    for pattern, replacement in _MARKERS:
        text = pattern.sub(replacement, text)
    return text


def check_text(name, text):
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
    return sid.strip().upper(), rest


def story_id(number):
    return f"G{number:03d}"


# State model: pure transitions, no I/O #####################################
#
# The plan is a dict (the snapshot); every change is an event; apply_event(plan,
# event) checks that the event is legal and applies it. Commands build events and
# call it; `audit` and roll-forward replay the ledger through the same function, so
# a rule enforced at the call is the same rule checked after the fact.


# The shapes of the plan, for state read back from disk: a hand-crafted goals.json (even with
# a recomputed digest) or a chained but forged ledger line must be exit 3, never a traceback
# three commands later. A spec is a type, a tuple of alternatives, {key: spec} or [item spec].
_N = type(None)
_TEXT = (str, _N)
RUN_SPEC = {"seq": int, "check": (int, _N), "cmd": str, "exit_code": (int, _N), "signal": _TEXT,
            "timed_out": bool, "error": _TEXT, "duration_s": (int, float, _N), "bytes": (int, _N),
            "sha256": _TEXT, "tail": _TEXT, "log": _TEXT, "ok": bool}
NOTE_SPEC = {"note": str, "seq": int, "ts": str}
STORY_SPEC = {
    "id": str, "title": str, "objective": str, "status": str, "evidence": _TEXT,
    "after": [str], "checks": [str], "accept": [str], "judge": bool, "round": int,
    "round_base": int, "agent": _TEXT, "executor": _TEXT, "started_seq": (int, _N),
    "started_ts": _TEXT, "verify_cmd": _TEXT, "verify_evidence": _TEXT, "runs": [RUN_SPEC],
    "last_run": (RUN_SPEC, _N), "amendments": [NOTE_SPEC], "blocked_reason": _TEXT,
    "feedback": ({"source": str, "round": int, "text": _TEXT,
                  "runs": [{"cmd": str, "exit": str, "tail": _TEXT}]}, _N),
    "decision": ({"decision": str, "note": str, "seq": int, "ts": str}, _N),
    "judged_by": ({"agent": str, "verdict": str, "seq": int}, _N)}
UNVERIFIABLE_SPEC = [{"id": str, "check": int, "cmd": str, "reason": str}]
PLAN_SPEC = {"schema_version": int, "plan_id": str, "brief": str, "created": str,
             "goals": [STORY_SPEC], "options": {"rounds": int, "require_run": bool},
             "unverifiable": UNVERIFIABLE_SPEC, "replaces": (dict, _N), "guard": {"blocks": int},
             "ledger": {"seq": int, "head": str}}
ORIGINAL_SPEC = {"brief": str, "goals": [{"id": str, "title": str, "objective": str,
                                          "status": str, "evidence": _TEXT}]}


def misfit(value, spec, path="", required=True):
    """Where `value` does not fit `spec` (a path like .goals[2].runs[0].cmd), or None. With
    `required`, every key of a dict spec must be present (snapshots); events may omit the
    optional ones."""
    if type(spec) is dict:
        if type(value) is not dict:
            return path
        for key, sub in spec.items():
            if required and key not in value:
                return f"{path}.{key}"
            found = misfit(value.get(key), sub, f"{path}.{key}", required)
            if found:
                return found
        return None
    if type(spec) is list:
        if type(value) is not list:
            return path
        for i, item in enumerate(value):
            found = misfit(item, spec[0], f"{path}[{i}]", required)
            if found:
                return found
        return None
    if type(spec) is tuple:
        return None if any(misfit(value, alt, path, required) is None for alt in spec) else path
    return None if type(value) is spec else path  # exact: a bool is not a round number


def compile_spec(spec, required=True):
    """A spec in the form `fits` checks quickly: plain fields are a set of types, tested
    inline; only nested ones recurse (every command checks the whole snapshot)."""
    if type(spec) is dict:
        plain, nested = [], []
        keys = tuple(spec) if required else ()
        for key, sub in spec.items():
            if type(sub) is type or (type(sub) is tuple and all(type(x) is type for x in sub)):
                plain.append((key, frozenset(sub if type(sub) is tuple else (sub,))))
            elif type(sub) is tuple and _N in sub:  # optional: None needs no recursion
                rest = tuple(x for x in sub if x is not _N)
                nested.append((key, True, compile_spec(rest[0] if len(rest) == 1 else rest,
                                                       required)))
            else:
                nested.append((key, False, compile_spec(sub, required)))
        return ("dict", tuple(plain), tuple(nested), keys)
    if type(spec) is list:
        return ("list", compile_spec(spec[0], required))
    if type(spec) is tuple:
        return ("any", tuple(compile_spec(x, required) for x in spec))
    return ("type", frozenset((spec,)))


def fits(value, compiled):
    kind = compiled[0]
    if kind == "dict":
        if type(value) is not dict:
            return False
        for key in compiled[3]:
            if key not in value:
                return False
        get = value.get
        for key, types in compiled[1]:
            if type(get(key)) not in types:
                return False
        for key, optional, sub in compiled[2]:
            item = get(key)
            if not ((optional and item is None) or fits(item, sub)):
                return False
        return True
    if kind == "list":
        if type(value) is not list:
            return False
        sub = compiled[1]
        for item in value:
            if not fits(item, sub):
                return False
        return True
    if kind == "any":
        return any(fits(value, alt) for alt in compiled[1])
    return type(value) in compiled[1]


_PLAN_CHECK = compile_spec(PLAN_SPEC)
_ORIGINAL_CHECK = compile_spec(ORIGINAL_SPEC)


def new_story(spec):
    return {
        "id": spec["id"], "title": spec["title"], "objective": spec["objective"],
        "status": spec.get("status", "pending"), "evidence": spec.get("evidence"),
        "after": list(spec.get("after", [])), "checks": list(spec.get("checks", [])),
        "accept": list(spec.get("accept", [])), "judge": bool(spec.get("judge", False)),
        "round": 0, "round_base": 0, "agent": None, "executor": None,
        "started_seq": None, "started_ts": None,
        "verify_cmd": None, "verify_evidence": None,
        "runs": [], "last_run": None, "feedback": None, "amendments": [],
        "decision": None, "blocked_reason": None, "judged_by": None,
    }


def find_story(plan, sid):
    goals = plan["goals"]
    try:  # G007 is usually the 7th story (stories added later sit before the final one)
        story = goals[int(sid[1:]) - 1]
        if story["id"] == sid:
            return story
    except (ValueError, TypeError, IndexError):
        pass
    for story in goals:
        if story["id"] == sid:
            return story
    raise refused(f"{sid} not found.", "not_found")


def is_final(plan, story):
    return plan["goals"][-1]["id"] == story["id"]


def waits_for(plan, story):
    """The direct dependencies of `story` that are not done yet."""
    return [d for d in story["after"] if find_story(plan, d)["status"] not in DONE]


def is_ready(plan, story):
    return story["status"] in ("pending", "failed") and not waits_for(plan, story)


def pick_ready(plan):
    """The story `next` would activate: reopened stories first, then plan order."""
    ready = [s for s in plan["goals"] if is_ready(plan, s)]
    reopened = [s for s in ready if s["status"] == "failed" or s["round"] > 0]
    return (reopened or ready or [None])[0]


def active_stories(plan):
    return [s for s in plan["goals"] if s["status"] == "in_progress"]


def plan_done(plan):
    return all(s["status"] in DONE for s in plan["goals"])


def rounds_left(plan, story):
    return plan["options"]["rounds"] - (story["round"] - story["round_base"])


def validate_graph(stories):
    """Unknown ids and cycles in `after` are refused; returns nothing."""
    ids = {s["id"] for s in stories}
    for s in stories:
        for dep in s["after"]:
            if dep not in ids:
                raise usage(f"{s['id']} depends on {one_line(dep)}, which is not in the plan.",
                            "unknown_dependency")
    state = {}
    deps = {s["id"]: s["after"] for s in stories}

    def visit(sid, path):
        state[sid] = "visiting"
        for dep in deps[sid]:
            if state.get(dep) == "visiting":
                cycle = path[path.index(dep):] + [dep] if dep in path else [sid, dep]
                raise usage("dependency cycle: " + " → ".join(cycle), "dependency_cycle")
            if dep not in state:
                visit(dep, path + [dep])
        state[sid] = "done"

    for s in stories:
        if s["id"] not in state:
            visit(s["id"], [s["id"]])


def _check_story_text(spec):
    if blank(spec.get("title")) or blank(spec.get("objective")):
        raise usage(f"{spec.get('id')}: title and objective must not be empty — "
                    "--goal format is 'title::objective'.", "blank_goal")


def _ev_plan_created(plan, ev):
    specs = ev["stories"]
    if not specs:
        raise usage("at least one --goal is required.", "no_goals")
    imported = bool(ev.get("imported_from"))
    for i, spec in enumerate(specs, 1):
        if spec["id"] != story_id(i):
            raise damaged(f"story {i} has id {one_line(spec['id'])}, expected {story_id(i)}")
        _check_story_text(spec)
        if spec.get("status", "pending") != "pending" and not imported:
            raise damaged(f"{spec['id']} is created with status {spec['status']}")
    final = specs[-1]
    others = [s["id"] for s in specs[:-1]]
    if sorted(final.get("after", [])) != sorted(others):
        raise damaged("the final story must depend on every other story")
    stories = [new_story(s) for s in specs]
    validate_graph(stories)
    options = ev.get("options") or {}
    rounds = options.get("rounds", DEFAULT_ROUNDS)
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise usage("--rounds must be a whole number ≥ 1.", "bad_rounds")
    for s in stories:
        if s["status"] == "in_progress":
            s.update(round=1, started_seq=ev["seq"], started_ts=ev["ts"])
    return {
        "schema_version": SCHEMA_VERSION,
        "plan_id": ev["plan_id"],
        "brief": ev["brief"],
        "created": ev["ts"],
        "goals": stories,
        "options": {"rounds": rounds, "require_run": bool(options.get("require_run", False))},
        "unverifiable": list(ev.get("unverifiable") or []),
        "replaces": ev.get("replaces"),
        "guard": {"blocks": 0},
    }


def _ev_story_started(plan, ev):
    story = find_story(plan, ev["id"])
    agent = ev.get("agent")
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
    story.update(status="in_progress", round=story["round"] + 1, agent=agent,
                 started_seq=ev["seq"], started_ts=ev["ts"], runs=[])
    return plan


def _fresh_ok_run(story, check=None, cmd=None):
    """The latest run of this round for a frozen check (by index) or a --run command."""
    latest = None
    for run in story["runs"]:
        if (check is not None and run["check"] == check) or \
                (check is None and run["check"] is None and run["cmd"] == cmd):
            latest = run
    return latest


def verification_gap(plan, story, ev):
    """Why a `complete` checkpoint of `story` is not verified, or None if it is."""
    checks = story["checks"]
    if checks:
        for i, cmd in enumerate(checks):
            run = _fresh_ok_run(story, check=i)
            if run is None:
                return refused(f"{story['id']}: frozen check {i + 1} (`{one_line(cmd)}`) has no run "
                               "since the story was activated.", "verification_missing")
            if not run["ok"]:
                return refused(f"{story['id']}: frozen check {i + 1} (`{one_line(cmd)}`) failed "
                               f"({describe_exit(run)}).", "verification_failed")
        return None
    if ev.get("run"):
        run = _fresh_ok_run(story, cmd=ev.get("verify_cmd"))
        if run is None:
            return refused(f"{story['id']}: no run of `{one_line(ev.get('verify_cmd'))}` since the "
                           "story was activated.", "verification_missing")
        if not run["ok"]:
            return refused(f"{story['id']}: `{one_line(run['cmd'])}` failed ({describe_exit(run)}).",
                           "verification_failed")
        return None
    if not is_final(plan, story):
        return None
    if plan["options"]["require_run"]:
        return refused("this plan requires a witnessed run: the final story completes only "
                       "with --run (the engine runs --verify-cmd) or frozen checks.", "run_required")
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
    if agent is not None and story["agent"] is not None and agent != story["agent"]:
        raise refused(f"{story['id']} is held by agent {one_line(story['agent'])}, "
                      f"not {one_line(agent)}.", "held_by_other")
    # failed/blocked without evidence stays legal, as in the original; the handoff says so
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
    story = find_story(plan, ev["id"])
    if ev["status"] not in ("complete", "failed", "blocked"):
        raise usage(f"unknown checkpoint status {one_line(ev['status'])}")
    checkpoint_gate(plan, story, ev)
    if ev["status"] == "complete":
        gap = verification_gap(plan, story, ev)
        if gap is not None:
            raise gap
    story["evidence"] = ev.get("evidence")
    story["executor"] = ev.get("agent") or story["agent"]
    if ev["status"] == "complete":
        story.update(verify_cmd=ev.get("verify_cmd"), verify_evidence=ev.get("verify_evidence"),
                     agent=None, feedback=None, blocked_reason=None)
        story["status"] = "review" if story["judge"] else "complete"
    elif ev["status"] == "failed":
        _fail_round(plan, story, {"source": "checkpoint", "round": story["round"],
                                  "text": ev.get("evidence"), "runs": _failed_run_tails(story)})
    else:
        story.update(status="blocked", agent=None, blocked_reason=ev.get("evidence"))
    return plan


RUN_FIELDS = ("seq", "check", "cmd", "exit_code", "signal", "timed_out", "error", "duration_s",
              "bytes", "sha256", "tail", "log")


def _ev_verify_run(plan, ev):
    story = find_story(plan, ev["id"])
    record = dict(zip(RUN_FIELDS, map(ev.get, RUN_FIELDS)))
    record["ok"] = run_passed(record)
    story["last_run"] = record
    # fresh evidence only: a run counts for the round in which it started
    if story["status"] == "in_progress" and ev.get("after_seq", -1) >= story["started_seq"]:
        story["runs"].append(record)
    return plan


def _ev_decision(plan, ev):
    story = find_story(plan, ev["id"])
    decision, note = ev["decision"], ev.get("note")
    if decision not in DECISIONS:
        raise usage(f"unknown decision {one_line(decision)}")
    if blank(note):
        raise refused("a decision requires a non-empty --note (the reason, or the feedback).",
                      "no_note")
    if story["status"] not in ("blocked", "failed", "review"):
        raise refused(f"{story['id']} is {story['status']} — `decide` applies to a blocked, failed "
                      "or in-review story.", "not_decidable")
    story["decision"] = {"decision": decision, "note": note, "seq": ev["seq"], "ts": ev["ts"]}
    story.update(agent=None, blocked_reason=None)
    if decision == "accept":
        story["status"] = "accepted"
        return plan
    if decision == "amend":
        story["amendments"].append({"note": note, "seq": ev["seq"], "ts": ev["ts"]})
    story.update(status="pending", round_base=story["round"],
                 feedback={"source": decision, "round": story["round"], "text": note, "runs": []})
    return plan


def _ev_story_added(plan, ev):
    spec = ev["story"]
    final = plan["goals"][-1]
    if final["status"] not in ("pending", "failed", "blocked"):
        raise refused(f"the final story {final['id']} is {final['status']} — stories can be added "
                      "only before verification starts.", "final_started")
    expected = story_id(len(plan["goals"]) + 1)
    if spec["id"] != expected:
        raise damaged(f"added story has id {one_line(spec['id'])}, expected {expected}")
    _check_story_text(spec)
    story = new_story(spec)
    validate_graph(plan["goals"] + [story])
    plan["goals"].insert(len(plan["goals"]) - 1, story)
    final["after"].append(story["id"])
    plan["unverifiable"].extend(ev.get("unverifiable") or [])
    return plan


def _ev_verdict(plan, ev):
    story = find_story(plan, ev["id"])
    verdict, agent = ev["verdict"], ev.get("agent")
    if verdict not in VERDICTS:
        raise usage(f"unknown verdict {one_line(verdict)}")
    if story["status"] != "review":
        raise refused(f"{story['id']} is {story['status']}, not in review — there is nothing to "
                      "judge.", "not_in_review")
    if blank(ev.get("evidence")):
        raise refused("a verdict requires non-empty --evidence (what you checked and saw).",
                      "no_evidence")
    if blank(agent):
        raise refused("a verdict requires --agent (who judged).", "no_agent")
    if story["executor"] is not None and agent == story["executor"]:
        raise refused(f"{one_line(agent)} did the work of {story['id']} and cannot judge it.",
                      "judge_not_independent")
    story["judged_by"] = {"agent": agent, "verdict": verdict, "seq": ev["seq"]}
    if verdict == "achieved":
        story["status"] = "complete"
    elif verdict == "not-achieved":
        _fail_round(plan, story, {"source": "judge", "round": story["round"],
                                  "text": ev.get("evidence"), "runs": []})
    else:
        story.update(status="blocked", blocked_reason=ev.get("evidence"))
    return plan


def _ev_guard_block(plan, ev):
    # a fresh stop (not one caused by the previous block) starts the count again
    plan["guard"]["blocks"] = 1 if ev.get("fresh") else plan["guard"]["blocks"] + 1
    return plan


def _ev_story_released(plan, ev):
    story = find_story(plan, ev["id"])
    if story["status"] != "in_progress":
        raise refused(f"{story['id']} is {story['status']}, not in progress — there is no claim to "
                      "release.", "not_active")
    if blank(ev.get("note")):
        raise refused("a release requires a non-empty --note (why the agent's claim ends).",
                      "no_note")
    # the silent agent's round is given back: it was not a failed attempt
    story.update(status="pending", agent=None, round_base=story["round_base"] + 1,
                 feedback={"source": "release", "round": story["round"], "text": ev["note"],
                           "runs": []})
    return plan


def _ev_plan_merged(plan, ev):
    """`git merge` of a branch whose plan is another one: that plan's whole ledger rides along
    in this event, replayed here through the same rules, so it audits as it did on its branch."""
    other, head = None, ZERO_HASH
    for i, text in enumerate(ev["lines"], 1):
        raw = text.encode("utf-8")
        inner = parse_event(raw)
        if inner is None or inner["seq"] != i or inner.get("prev") != head:
            raise damaged(f"merged plan {one_line(ev['plan_id'])}: its line {i} is not the next "
                          "event of its hash chain.", "broken_chain")
        check_event(inner, i)
        other = apply_event(other, inner)
        head = sha256_hex(raw)
    if other is None or other["plan_id"] != ev["plan_id"] or head != ev["head"] \
            or len(ev["lines"]) != ev["events"] or other["plan_id"] == plan["plan_id"]:
        raise damaged(f"merged plan {one_line(ev['plan_id'])}: its lines do not give the plan, "
                      "head and event count the event names.", "bad_event")
    return plan


_SPEC_STORY = {"id": str, "title": str, "objective": str, "after": ([str], _N),
               "checks": ([str], _N), "accept": ([str], _N), "judge": (bool, _N),
               "status": _TEXT, "evidence": _TEXT}
EVENT_SPECS = {
    "plan_created": {"brief": str, "plan_id": str, "stories": [_SPEC_STORY],
                     "options": ({"rounds": (int, _N), "require_run": (bool, _N)}, _N),
                     "unverifiable": (UNVERIFIABLE_SPEC, _N), "replaces": (dict, _N)},
    "story_started": {"id": str, "agent": _TEXT},
    "checkpoint": {"id": str, "status": str, "evidence": _TEXT, "verify_cmd": _TEXT,
                   "verify_evidence": _TEXT, "agent": _TEXT, "run": (bool, _N)},
    "verify_run": dict({k: v for k, v in RUN_SPEC.items() if k not in ("seq", "ok")},
                       id=str, after_seq=int),
    "decision": {"id": str, "decision": str, "note": _TEXT},
    "story_added": {"story": _SPEC_STORY, "unverifiable": (UNVERIFIABLE_SPEC, _N)},
    "verdict": {"id": str, "verdict": str, "evidence": _TEXT, "agent": _TEXT},
    "guard_block": {"reason": _TEXT, "fresh": (bool, _N)},
    "story_released": {"id": str, "note": _TEXT, "agent": _TEXT},
    "plan_merged": {"plan_id": str, "events": int, "head": str, "lines": [str]},
}
_EVENT_CHECKS = {kind: compile_spec(dict(spec, ts=str), required=False)
                 for kind, spec in EVENT_SPECS.items()}

TRANSITIONS = {
    "plan_created": _ev_plan_created,
    "story_started": _ev_story_started,
    "checkpoint": _ev_checkpoint,
    "verify_run": _ev_verify_run,
    "decision": _ev_decision,
    "story_added": _ev_story_added,
    "verdict": _ev_verdict,
    "guard_block": _ev_guard_block,
    "story_released": _ev_story_released,
    "plan_merged": _ev_plan_merged,
}


def check_event(ev, lineno):
    """A ledger line's event has the fields its kind needs, of the right types. The engine's own
    events always do; this is for lines read back (roll-forward, and audit when the replayed
    plan turns out malformed: checking every line up front would halve audit's speed)."""
    kind = ev.get("event")
    if kind in _EVENT_CHECKS and not fits(ev, _EVENT_CHECKS[kind]):
        where = misfit(ev, dict(EVENT_SPECS[kind], ts=str), required=False).lstrip(".")
        raise damaged(f"{LEDGER} line {lineno}: malformed {kind} event ({where} is missing or of "
                      "the wrong type) — run `goals.py audit`.", "bad_event")


def apply_event(plan, ev):
    """Check that `ev` is legal in `plan` and apply it (in place). Raises FablizeError."""
    kind = ev.get("event")
    if kind not in TRANSITIONS:
        raise damaged(f"unknown event {one_line(kind)!r}", "unknown_event")
    if (plan is None) != (kind == "plan_created"):
        raise damaged("plan_created must be the first event and only the first", "bad_sequence")
    plan = TRANSITIONS[kind](plan, ev)
    if kind != "guard_block":
        plan["guard"]["blocks"] = 0
    return plan


def run_passed(run):
    return run.get("exit_code") == 0 and not run.get("timed_out") and not run.get("error")


def describe_exit(run):
    if run.get("error"):
        return "did not start: " + one_line(run["error"])
    if run.get("timed_out"):
        return f"timed out after {run.get('duration_s')} s"
    if run.get("signal"):
        return f"killed by {run['signal']}"
    return f"exit {run.get('exit_code')}"


def is_original_snapshot(snap):
    """A goals.json written by the original goals.py: none of the keys this engine writes."""
    return not any(key in snap for key in ("digest", "ledger", "plan_id", "schema_version"))




def validate_snapshot(plan):
    """A snapshot of the right shape, or exit 3 saying what is wrong."""
    def bad(what):
        return damaged(f"{SNAPSHOT}: not a fablize snapshot ({what}) — run `goals.py audit`.",
                       "bad_snapshot")
    if type(plan) is not dict:
        raise bad("top level is not an object")
    original = is_original_snapshot(plan)
    found = None if fits(plan, _ORIGINAL_CHECK if original else _PLAN_CHECK) else \
        misfit(plan, ORIGINAL_SPEC if original else PLAN_SPEC)
    if found:
        raise bad(f"{found.lstrip('.')} is missing or of the wrong type")
    if not plan["goals"]:
        raise bad("the plan has no stories")
    for i, story in enumerate(plan["goals"]):
        if story["status"] not in STATUSES:
            raise bad(f"goals[{i}].status is {one_line(story['status'])!r}")
    return plan


# Storage: discovery, lock, ledger, snapshot ################################

try:
    import fcntl
except ImportError:  # Windows: an exclusive-create lock file instead (Lock below)
    fcntl = None

import errno
import stat

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


def symlink_refusal(path):
    return damaged(f"{path} is a symlink — refusing to follow it (state files must be regular "
                   "files inside the state directory).", "symlink")


def open_state_file(path, flags, mode=0o644):
    """os.open that never follows a symlink and refuses anything but a regular file."""
    try:
        fd = os.open(path, flags | O_NOFOLLOW | O_CLOEXEC | O_BINARY, mode)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno != errno.ENOENT and os.path.islink(path)):
            raise symlink_refusal(path)
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
        fd = open_state_file(path, os.O_RDONLY | O_NONBLOCK)
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


def lock_timeout():
    raw = os.environ.get("FABLIZE_LOCK_TIMEOUT")
    if raw is None:
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1
    if not value >= 0:
        raise usage(f"FABLIZE_LOCK_TIMEOUT must be a number of seconds ≥ 0, not {one_line(raw)!r}.")
    return value


class Lock:
    """The state directory's lock: flock on `lock` where fcntl exists; elsewhere an
    exclusive-create `lock.owner` file holding the owner's pid (a dead owner's is stale)."""

    def __init__(self, state_dir, exclusive, out):
        self.path = os.path.join(state_dir, LOCK)
        self.exclusive = exclusive
        self.out = out
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
        if fcntl is None:
            return self._try_owner_file()
        if self.fd is None:
            self.fd = open_state_file(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
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
                self.out.warn("removed a stale lock file that no process finished writing.")
            elif pid is not None and not pid_alive(pid):
                self.out.warn(f"removed a stale lock left by process {pid}, which is no longer running.")
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
        if fcntl is None:
            pid = self._owner_pid()
            return f" (process {pid})" if pid else ""
        return ""

    def __exit__(self, *exc):
        if self.owner_path:
            try:
                os.unlink(self.owner_path)
            except FileNotFoundError:
                pass
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
        return False


def ledger_end(fd):
    """(end, torn): `end` is the size of the ledger's newline-terminated part; `torn` the bytes
    after it (an unterminated last line: a write that never completed)."""
    size = os.fstat(fd).st_size
    if size == 0 or read_all(fd, size - 1, 1) == b"\n":
        return size, b""
    pos = size
    while pos > 0:
        start = max(0, pos - READ_CHUNK)
        i = read_all(fd, start, pos - start).rfind(b"\n")
        if i >= 0:
            end = start + i + 1
            return end, read_all(fd, end, size - end)
        pos = start
    return 0, read_all(fd, 0, size)


def lines_backward(fd, end):
    """Yield (offset, line) for each complete line before `end`, newest first."""
    buf = b""
    pos = end
    while pos > 0:
        start = max(0, pos - READ_CHUNK)
        buf = read_all(fd, start, pos - start) + buf
        pos = start
        while True:
            i = buf.rfind(b"\n", 0, len(buf) - 1)
            if i < 0:
                break
            yield pos + i + 1, buf[i + 1:-1]
            buf = buf[:i + 1]
    if buf:
        yield 0, buf[:-1]


def parse_event(line):
    """The event on a ledger line, or None when the line is not one."""
    try:
        ev = load_json(line)
    except ValueError:
        return None
    if isinstance(ev, dict) and isinstance(ev.get("seq"), int) and isinstance(ev.get("event"), str):
        return ev
    return None


def canonical_digest(plan):
    body = {k: v for k, v in plan.items() if k != "digest"}
    return sha256_hex(json.dumps(body, ensure_ascii=False, sort_keys=True,
                                 separators=(",", ":")).encode("utf-8"))


def snapshot_bytes(plan):
    """The snapshot: the plan's fields, then one story per line (readable, and written by
    json's C encoder, which an `indent` would switch off)."""
    head = {k: v for k, v in plan.items() if k not in ("goals", "digest")}
    head["digest"] = canonical_digest(plan)
    stories = ",\n".join(dumps(s) for s in plan["goals"])
    return (dumps(head)[:-1] + ',"goals":[\n' + stories + "\n]}\n").encode("utf-8")


def replay_error(lineno, err):
    return damaged(f"{LEDGER} line {lineno}: {err.message if isinstance(err, FablizeError) else err}"
                   " — run `goals.py audit`.", "bad_event")


def replay_line(plan, ev, lineno):
    """apply_event for a line read back from the ledger: any failure names the line."""
    try:
        return apply_event(plan, ev)
    except FablizeError as e:
        raise replay_error(lineno, e)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise replay_error(lineno, f"malformed {ev.get('event')} event ({type(e).__name__}: {e})")


class Store:
    """A state directory and the plan in it, read and written under its lock."""

    def __init__(self, path, discovered, out):
        self.dir = path
        self.root = os.path.dirname(path)
        self.discovered = discovered
        self.out = out

    def path(self, name):
        return os.path.join(self.dir, name)

    def exists(self):
        """Whether the state directory exists (refusing a planted symlink in its place)."""
        try:
            st = os.lstat(self.dir)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode) and self.discovered:
            raise symlink_refusal(self.dir)
        if not stat.S_ISDIR(os.stat(self.dir).st_mode):
            raise damaged(f"{self.dir} is not a directory.", "not_a_directory")
        return True

    def create_dir(self):
        if not self.exists():
            os.makedirs(self.dir, exist_ok=True)

    def session(self, exclusive=True):
        return Session(self, exclusive)

    def ledger_bytes(self):
        return read_state_file(self.path(LEDGER)) or b""


class Session:
    """The plan under the lock. load() checks the snapshot against the ledger's tail in O(1),
    moves a torn last line aside and rolls a ledger that is ahead forward; commit() appends one
    event (one write, fsync) and then replaces the snapshot atomically."""

    def __init__(self, store, exclusive):
        self.store = store
        self.out = store.out
        self.exclusive = exclusive
        self.lock = Lock(store.dir, exclusive, store.out)
        self._fd = None
        self.plan = None

    def __enter__(self):
        self.lock.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            if exc[0] is None and self.exclusive and getattr(self, "last", None) is not None:
                publish(self)  # Sharing: this command's events go to the remote (local plan: no-op)
        finally:
            self._close_ledger()
            self.lock.__exit__(*exc)
        return False

    def _close_ledger(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def ledger_fd(self, create=False):
        if self._fd is None:
            flags = (os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0)) if self.exclusive \
                else os.O_RDONLY
            try:
                self._fd = open_state_file(self.store.path(LEDGER), flags)
            except FileNotFoundError:
                return None
        return self._fd

    # reading

    def load(self):
        """The current plan, or None when there is none. Raises FablizeError(exit 3) on damage."""
        snap = self._read_snapshot()
        fd = self.ledger_fd()
        if snap is not None and is_original_snapshot(snap):
            self._refuse_stripped_snapshot(fd)
            return self._import_original(snap)
        end = self.cut_torn_tail(fd, snap) if fd is not None else 0
        lines = lines_backward(fd, end) if end else iter(())
        snap_seq = snap["ledger"]["seq"] if snap else 0
        newer = []
        for offset, line in lines:
            ev = parse_event(line)
            if ev is None:
                raise damaged(f"{LEDGER}: line at byte {offset} is not a ledger event — run "
                              "`goals.py audit`.", "bad_line")
            if ev["seq"] <= snap_seq:
                if ev["seq"] < snap_seq:
                    raise damaged(f"{SNAPSHOT} reflects event {snap_seq} but {LEDGER} ends at "
                                  f"event {ev['seq']} — run `goals.py audit`.", "disagree")
                if sha256_hex(line) != snap["ledger"]["head"]:
                    raise damaged(f"{SNAPSHOT} and {LEDGER} disagree at event {snap_seq} (line "
                                  f"{snap_seq} is not the one the snapshot reflects) — run "
                                  "`goals.py audit`.", "disagree")
                break
            newer.append((ev, line))
        else:
            if snap is not None and snap_seq > 0:
                raise damaged(f"{SNAPSHOT} reflects event {snap_seq} but {LEDGER} "
                              f"{'is empty' if not newer else 'does not contain it'} — run "
                              "`goals.py audit`.", "disagree")
        self.plan = snap
        if newer:
            self.plan = self._roll_forward(snap, newer[::-1])
        return self.plan

    def require_plan(self):
        plan = self.load()
        if plan is None:
            raise refused("no plan — run `create` first.", "no_plan")
        return plan

    def _refuse_stripped_snapshot(self, fd):
        """An original-format goals.json beside a hash-chained ledger is a hand edit, not an
        old plan: importing it would launder whatever it claims."""
        end = ledger_end(fd)[0] if fd is not None else 0
        last = next(lines_backward(fd, end), None) if end else None
        if last is not None and parse_event(last[1]) is not None:
            raise damaged(f"{SNAPSHOT} lost its ledger position and digest but {LEDGER} is "
                          "hash-chained: it was edited by hand — run `goals.py audit`; "
                          "`goals.py rebuild` regenerates it from the ledger.", "snapshot_edited")

    def refuse_original(self):
        """Commands that read the ledger itself (audit, log, rebuild) do not import an original
        plan; they say how to. Any other damage to goals.json is theirs to report or repair."""
        snap = loose_snapshot(self.store)
        if snap is None or not is_original_snapshot(snap):
            return
        fd = self.ledger_fd()
        end = ledger_end(fd)[0] if fd is not None else 0
        last = next(lines_backward(fd, end), None) if end else None
        if last is None or parse_event(last[1]) is None:
            raise damaged(f"{SNAPSHOT} was written by the original goals.py; run `goals.py status` "
                          "to import it into a hash-chained ledger first.", "legacy")

    def _read_snapshot(self):
        raw = read_state_file(self.store.path(SNAPSHOT))
        if raw is None:
            return None
        try:
            snap = load_json(raw)
        except ValueError as e:
            what = "empty" if not raw.strip() else f"not valid JSON ({e})"
            raise damaged(f"{SNAPSHOT} is {what} — run `goals.py audit`; `goals.py rebuild` "
                          "regenerates it from the ledger.", "bad_snapshot")
        validate_snapshot(snap)
        if not is_original_snapshot(snap):
            pos = snap.get("ledger")
            if not (isinstance(pos, dict) and isinstance(pos.get("seq"), int)
                    and isinstance(pos.get("head"), str)):
                raise damaged(f"{SNAPSHOT}: ledger position missing or malformed — run "
                              "`goals.py audit`.", "bad_snapshot")
            if snap.get("digest") != canonical_digest(snap):
                raise damaged(f"{SNAPSHOT} was changed outside fablize (its digest does not match) "
                              "— run `goals.py audit`; `goals.py rebuild` regenerates it from the "
                              "ledger.", "snapshot_edited")
        return snap

    def cut_torn_tail(self, fd, snap):
        """Move an unterminated or unparsable last line aside; return the ledger's good end."""
        end, torn = ledger_end(fd)
        if not torn and end:
            offset, line = next(lines_backward(fd, end))
            if parse_event(line) is None:
                end, torn = offset, line + b"\n"
        if not torn:
            return end
        snap_seq = snap["ledger"]["seq"] if snap else 0
        prev = next(lines_backward(fd, end), None) if end else None
        prev_ev = parse_event(prev[1]) if prev else None
        if prev_ev is None and end:
            raise damaged(f"{LEDGER}: the last two lines are damaged — run `goals.py audit`.",
                          "bad_line")
        if (prev_ev["seq"] if prev_ev else 0) < snap_seq:
            raise damaged(f"{LEDGER} line {snap_seq}: the last line is damaged but {SNAPSHOT} "
                          f"reflects event {snap_seq} — run `goals.py audit`.", "bad_line")
        if not self.exclusive:
            self.out.warn(f"{LEDGER} ends with a torn line ({len(torn)} bytes, never "
                          "acknowledged); the next writing command moves it aside.")
            return end
        broken = self.store.path(LEDGER + ".broken")
        bfd = open_state_file(broken, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            write_all(bfd, torn if torn.endswith(b"\n") else torn + b"\n")
            os.fsync(bfd)
        finally:
            os.close(bfd)
        os.ftruncate(fd, end)
        os.fsync(fd)
        self.out.warn(f"{LEDGER}: a torn last line ({len(torn)} bytes, a write that never "
                      f"completed) was moved to {LEDGER}.broken.")
        return end

    def _roll_forward(self, plan, events):
        """Apply ledger events the snapshot does not reflect yet (a crash between the two writes)."""
        seq = plan["ledger"]["seq"] if plan else 0
        head = plan["ledger"]["head"] if plan else ZERO_HASH
        for ev, line in events:
            if ev["seq"] != seq + 1 or ev.get("prev") != head:
                raise damaged(f"{LEDGER} line {ev['seq']}: the hash chain is broken — run "
                              "`goals.py audit`.", "broken_chain")
            check_event(ev, ev["seq"])
            plan = replay_line(plan, ev, ev["seq"])
            seq, head = ev["seq"], sha256_hex(line)
            plan["ledger"] = {"seq": seq, "head": head}
        if self.exclusive:
            self.save_snapshot(plan)
        return plan

    # writing

    def commit(self, kind, **fields):
        """Append one event (checked by apply_event first) and save the snapshot."""
        plan, line = self._prepare(kind, fields)
        self._append(self.ledger_fd(create=True), line)
        self._settle(plan, line)
        return self.last

    def _prepare(self, kind, fields):
        plan = self.plan
        record = {"seq": plan["ledger"]["seq"] + 1 if plan else 1, "ts": now_iso(), "event": kind}
        record.update(fields)
        record["prev"] = plan["ledger"]["head"] if plan else ZERO_HASH
        plan = apply_event(plan, record)
        self.last = record
        return plan, dumps(record).encode("utf-8")

    def _append(self, fd, line):
        crash_point("before-ledger-write")
        n = os.write(fd, line + b"\n")  # one write on an O_APPEND descriptor
        if n != len(line) + 1:
            raise damaged(f"short write to {LEDGER} ({n} of {len(line) + 1} bytes); the next "
                          "command moves the torn line aside.", "io_error")
        crash_point("after-ledger-write")
        os.fsync(fd)
        crash_point("after-ledger-fsync")

    def _settle(self, plan, line):
        plan["ledger"] = {"seq": self.last["seq"], "head": sha256_hex(line)}
        self.save_snapshot(plan)
        self.plan = plan

    def replace_plan(self, fields):
        """Start a new plan over the current one, which moves whole to archive/<plan id>/.
        The old plan stays current until the new ledger is durable, so a crash anywhere leaves
        the old plan or the new one, never none: its files are linked into the archive, the new
        first event goes to ledger.jsonl.new, and one rename swaps it in."""
        store = self.store
        old = self._archive_current()
        plan, line = self._prepare("plan_created", dict(fields, replaces=old))
        staged = store.path(LEDGER + ".new")
        if os.path.lexists(staged):
            os.unlink(staged)  # left by a crash before its swap: never current
        fd = open_state_file(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            self._append(fd, line)
        finally:
            os.close(fd)
        self._close_ledger()
        if os.path.lexists(store.path(SNAPSHOT)):
            os.unlink(store.path(SNAPSHOT))  # from here a crash rolls the old ledger forward
        os.replace(staged, store.path(LEDGER))
        fsync_dir(store.dir)
        self._settle(plan, line)
        return old

    def _archive_current(self):
        """Copy the current plan into archive/<plan id>/ (hard links: constant time) and move its
        run logs there; returns what a new plan_created names as the plan it replaces."""
        store = self.store
        raw = read_state_file(store.path(SNAPSHOT))
        try:
            plan_id = load_json(raw)["plan_id"] if raw else None
        except (ValueError, KeyError, TypeError):
            plan_id = None
        fd = self.ledger_fd()
        head, seq = None, 0
        if fd is not None:
            end, _ = ledger_end(fd)
            last = next(lines_backward(fd, end), None) if end else None
            if last is not None:
                head = sha256_hex(last[1])
                ev = parse_event(last[1])
                seq = ev["seq"] if ev else None
        plan_id = plan_id if isinstance(plan_id, str) and re.fullmatch(r"[\w.-]+", plan_id) \
            else "unknown-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        ensure_subdir(store.path(ARCHIVE))
        dest = free_name(store.path(os.path.join(ARCHIVE, plan_id)))
        os.mkdir(dest)
        for name in (SNAPSHOT, LEDGER):
            if os.path.lexists(store.path(name)):
                link_or_copy(store.path(name), os.path.join(dest, name))
        # the old plan's logs leave before the new plan can write runs/<seq>-<id>.log over them
        for name in (RUNS, LEDGER + ".broken"):
            if os.path.lexists(store.path(name)):
                os.replace(store.path(name), os.path.join(dest, name))
        fsync_dir(dest)
        fsync_dir(store.dir)
        crash_point("after-archive-snapshot")
        self.plan = None
        return {"plan_id": plan_id, "head": head, "seq": seq,
                "path": os.path.relpath(dest, store.dir)}

    def save_snapshot(self, plan):
        body = snapshot_bytes(plan)
        target = self.store.path(SNAPSHOT)
        for name in os.listdir(self.store.dir):
            if name.startswith(SNAPSHOT + ".tmp-"):  # left by a killed writer; we hold the lock
                os.unlink(self.store.path(name))
        tmp = f"{target}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
        fd = open_state_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            try:
                write_all(fd, body)
                crash_point("after-snapshot-temp")
                os.fsync(fd)
            finally:
                os.close(fd)
            crash_point("before-snapshot-replace")
            os.replace(tmp, target)  # rename last: a crash before it leaves the old snapshot whole
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        crash_point("after-snapshot-replace")
        fsync_dir(self.store.dir)

    def _import_original(self, snap):
        """A plan written by the original goals.py (no ledger position): keep its files in
        archive/ and start a hash-chained ledger that carries its stories as they are."""
        if not self.exclusive:
            self.refuse_original()
        stories = []
        for i, g in enumerate(snap["goals"], 1):
            stories.append({"id": story_id(i), "title": g["title"], "objective": g["objective"],
                            "status": g["status"], "evidence": g.get("evidence"),
                            "after": [story_id(i - 1)] if i > 1 else []})
        stories[-1]["after"] = [s["id"] for s in stories[:-1]]
        old = self.replace_plan({
            "brief": snap["brief"], "count": len(stories), "plan_id": new_plan_id(),
            "stories": stories, "options": {"rounds": DEFAULT_ROUNDS, "require_run": False},
            "imported_from": {"tool": "goals.py (original)"}})
        self.out.warn(f"imported the plan written by the original goals.py; its files are kept "
                      f"in {old['path']}.")
        return self.plan


def loose_snapshot(store):
    """goals.json as a dict with a goals list, or None when it is missing or unreadable."""
    try:
        snap = load_json(read_state_file(store.path(SNAPSHOT)) or b"null")
    except ValueError:
        return None
    return snap if isinstance(snap, dict) and isinstance(snap.get("goals"), list) else None


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


def new_plan_id():
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + os.urandom(3).hex()


# Running verification commands ##############################################
#
# The lock is never held while a user's command runs: a check runs outside it and its
# record is appended afterwards. Exit 0 is the only pass; non-zero, timeout, a signal
# or a failure to start all fail closed.

_SHELL_BUILTINS = frozenset(
    "! : . [ [[ alias bg break builtin case cd command continue declare do done echo elif else "
    "esac eval exec exit export false fi for function getopts hash if in let local printf pwd "
    "read readonly return set shift source test then time times trap true type ulimit umask "
    "unalias unset until wait while { }".split())


_PREFIX_WORDS = frozenset("! { if then elif else while until do exec time command builtin "
                          "nohup env".split())


def unverifiable_reason(cmd, root):
    """Why `cmd` cannot run here (a program not found), or None if it looks runnable."""
    import shlex
    import shutil
    try:
        lexer = shlex.shlex(cmd, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError as e:
        return f"cannot parse the command ({e})"
    expect_program = True
    for token in tokens:
        if token and all(c in "();<>|&" for c in token):
            expect_program = token in (";", "&&", "||", "|", "&", "(", "((")
            continue
        if not expect_program:
            continue
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", token, re.S):
            continue  # VAR=value before the program
        if token in _PREFIX_WORDS:
            continue  # `exec X`, `! X`, `if X`, `{ X; }`, `time X`: X is the program
        expect_program = False
        if token in _SHELL_BUILTINS or "$" in token or "`" in token:
            continue  # a builtin, or a program named by a variable: nothing to look up
        if "/" in token:
            path = token if os.path.isabs(token) else os.path.join(root, token)
            if not os.path.exists(path):
                return f"{token} does not exist"
        elif shutil.which(token) is None:
            return f"{token} is not on PATH"
    return None


def unverifiable_checks(stories, root):
    found = []
    for story in stories:
        for i, cmd in enumerate(story.get("checks", [])):
            reason = unverifiable_reason(cmd, root)
            if reason:
                found.append({"id": story["id"], "check": i, "cmd": cmd, "reason": reason})
    return found


def git_state(root):
    """(HEAD, dirty) of the repository at `root`, or (None, None) outside one."""
    import subprocess
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                              timeout=10, stdin=subprocess.DEVNULL)
        if head.returncode != 0:
            return None, None
        status = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", ".",
                                 ":(exclude)" + STATE_DIRNAME], capture_output=True, timeout=30,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head.stdout.decode().strip(), bool(status.stdout.strip())


def kill_group(proc):
    import signal
    try:
        if os.name == "nt":
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def run_check(cmd, cwd, timeout, stream, log_path):
    """Run `cmd` through the shell in `cwd`, stdin closed, output streamed (escaped) to
    `stream` and captured whole to `log_path`. Returns the run's record."""
    import codecs
    import subprocess
    import threading
    digest = _sha256()
    tail = bytearray()
    count = [0]
    log_fd = open_state_file(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    # a child that escaped the process group may keep writing after the run is over: what it
    # writes then belongs to no run, so the reader drops it once `finished` is set
    guard = threading.Lock()
    finished = [False]
    at_start = [True]

    def pump(pipe):
        try:
            while True:
                chunk = os.read(pipe, READ_CHUNK)
                if not chunk:
                    return
                with guard:
                    if finished[0]:
                        return
                    count[0] += len(chunk)
                    digest.update(chunk)
                    tail.extend(chunk)
                    del tail[:-4 * TAIL_CHARS]
                    write_all(log_fd, chunk)
                    if stream is not None:
                        try:
                            piece, at_start[0] = quote_output(clean(decoder.decode(chunk)),
                                                              at_start[0])
                            stream.write(piece)
                            stream.flush()
                        except (OSError, ValueError):
                            pass
        except OSError:
            return
        finally:
            os.close(pipe)  # the reader's own descriptor: never reused under another run

    started = time.monotonic()
    record = {"cmd": cmd, "cwd": cwd, "exit_code": None, "signal": None, "timed_out": False,
              "error": None}
    try:
        kwargs = {"start_new_session": True} if os.name != "nt" else \
            {"creationflags": getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0)}
        proc = subprocess.Popen(cmd, shell=True, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
    except OSError as e:
        record["error"] = str(e)
        proc = None
    if proc is not None:
        reader = threading.Thread(target=pump, args=(os.dup(proc.stdout.fileno()),), daemon=True)
        proc.stdout.close()
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            record["timed_out"] = True
            kill_group(proc)
            code = proc.wait()
        # what it left behind is part of the check: stop it, then drain what was written
        kill_group(proc)
        reader.join(5)
        if code < 0:
            import signal
            try:
                record["signal"] = signal.Signals(-code).name
            except ValueError:
                record["signal"] = f"signal {-code}"
        record["exit_code"] = code
    with guard:
        finished[0] = True
    os.fsync(log_fd)
    os.close(log_fd)
    text = bytes(tail).decode("utf-8", "replace")
    record.update(duration_s=round(time.monotonic() - started, 3), bytes=count[0],
                  sha256=digest.hexdigest(), tail=text[-TAIL_CHARS:])
    if stream is not None and not at_start[0]:
        stream.write("\n")
    return record


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


def execute_runs(ctx, store, story_id_, commands, after_seq):
    """Run each (check index, command) outside the lock; returns records ready to commit."""
    runs_dir = ensure_subdir(store.path(RUNS))
    head, dirty = git_state(store.root)
    stream = sys.stderr if ctx.json else sys.stdout
    records = []
    for check, cmd in commands:
        label = f"frozen check {check + 1}" if check is not None else "verification"
        ctx.say(f"fablize: running {label} for {story_id_}: {one_line(cmd)}")
        if stream is sys.stdout:
            sys.stdout.flush()
        tmp_log = os.path.join(runs_dir, f".run-{os.getpid()}-{os.urandom(4).hex()}.log")
        started = now_iso()
        record = run_check(cmd, store.root, ctx.timeout, stream, tmp_log)
        record.update(id=story_id_, check=check, after_seq=after_seq, started=started,
                      git_head=head, git_dirty=dirty, tmp_log=tmp_log)
        ctx.say(f"fablize: {label} {'passed' if run_passed(record) else 'FAILED'} — "
                f"{run_result(record)}")
        records.append(record)
    return records


def commit_runs(session, records):
    """Append verify_run events, naming each log runs/<seq>-<id>.log."""
    committed = []
    for record in records:
        tmp_log = record.pop("tmp_log")
        seq = session.plan["ledger"]["seq"] + 1
        log_rel = f"{RUNS}/{seq}-{record['id']}.log"
        os.replace(tmp_log, session.store.path(log_rel))
        record["log"] = log_rel
        committed.append(session.commit("verify_run", **record))
    return committed


# Rendering: handoff, status, history ########################################


def indent(text, prefix="    "):
    return "\n".join(prefix + line for line in text.split("\n"))


def run_summary(run):
    return (f"`{one_line(run.get('cmd'))}` → {run_result(run)}, "
            f"sha256 {str(run.get('sha256'))[:16]}…")


def run_result(run):
    took = "" if run.get("timed_out") else f", {run.get('duration_s')} s"
    return f"{describe_exit(run)}{took}, {run.get('bytes')} bytes"


def completion_command(ctx, plan, story):
    cmd = f"{ctx.prog} checkpoint --id {story['id']} --status complete --evidence \"<evidence>\""
    if story["agent"]:
        cmd += f" --agent {one_line(story['agent'])}"
    if story["checks"]:
        return cmd
    if is_final(plan, story):
        if plan["options"]["require_run"]:
            return cmd + " --run --verify-cmd \"<command>\""
        return cmd + " --verify-cmd \"<command>\" --verify-evidence \"<result>\""
    return cmd


def render_map(plan, story):
    goals = plan["goals"]
    n = len(goals)
    idx = goals.index(story)
    start = max(0, idx - MAP_LOOKBACK)
    end = min(n, start + MAP_WINDOW)
    start = max(0, end - MAP_WINDOW)
    width = len(str(n))
    lines = ["## Plan map — context only: work the NOW story; do not start later ones."]
    for i in range(start, end):
        s = goals[i]
        label = "NOW" if s is story else MAP_LABELS[s["status"]]
        line = f" {i + 1:>{width}}. [{label:<8}] {s['id']} {defused_line(s['title'])}"
        if s is story:
            line += "   ← you are here"
        elif s["status"] == "in_progress" and s["agent"]:
            line += f"   (agent {one_line(s['agent'])})"
        lines.append(line)
    if start or end < n:
        lines.append(f"  … {start} earlier stories not shown above, {n - end} later not shown below")
    return lines


def render_carried(plan, story):
    """One block per direct dependency: its latest evidence and run, tails only, defused."""
    lines = []
    for dep_id in story["after"]:
        dep = find_story(plan, dep_id)
        lines.append(f"## From {dep['id']} — {defused_line(dep['title'])} (direct dependency, "
                     f"{MAP_LABELS[dep['status']]})")
        if dep["decision"] and dep["status"] == "accepted":
            lines.append("accepted by a human decision: " + defuse(last_chars(dep["decision"]["note"])))
        if not blank(dep["evidence"]):
            lines.append("evidence (last 500 characters):")
            lines.append(indent(defuse(last_chars(dep["evidence"]))))
        run = dep["last_run"]
        if run:
            lines.append("verification run: " + defuse(run_summary(run)) + " — output tail:")
            lines.append(indent(defuse(last_chars(run["tail"])) or "(no output)"))
    return lines


def render_feedback(story):
    fb = story["feedback"]
    if not fb:
        return []
    source = {"checkpoint": "the failed checkpoint", "judge": "the judge", "retry": "a human (retry)",
              "amend": "a human (amend)"}.get(fb["source"], fb["source"])
    lines = [f"## What was missing (round {fb['round']}, from {source})"]
    lines.append(indent(defuse(last_chars(fb["text"]))) if not blank(fb["text"])
                 else "    (no reason was given)")
    for run in fb.get("runs", []):
        lines.append(f"failed run `{defuse(one_line(run['cmd']))}` ({run['exit']}) — output tail:")
        lines.append(indent(defuse(last_chars(run["tail"])) or "(no output)"))
    return lines


def render_handoff(ctx, plan, story, reshown):
    lines = [f"=== fablize handoff — {story['id']} {defused_line(story['title'])}",
             f"Objective: {defused_line(story['objective'])}"]
    for a in story["amendments"]:
        lines.append(f"Amended ({a['ts'][:10]}): {one_line(a['note'])}")
    rounds = plan["options"]["rounds"]
    if reshown:
        lines.append(f"⚠ Resumed: this story was already in progress (round {story['round']}, started "
                     f"{story['started_ts']}). Continue it; do not restart it.")
    elif story["round"] > 1:
        lines.append(f"⚠ Reopened: round {story['round']} (round {story['round'] - story['round_base']} "
                     f"of {rounds} since the last decision) — the earlier attempt did not achieve the "
                     "objective; what was missing is below. Continue the work; do not restart it.")
    if reshown or story["round"] > 1:
        lines.append("  Files from the earlier attempt exist only if that work was kept (committed or "
                     "still in this working tree): check before relying on them.")
    lines.append("Rule: work this story only. Produce evidence as you go.")
    if is_final(plan, story):
        if story["checks"]:
            lines.append("★ Final story — its frozen checks must pass: the engine runs them at the "
                         "complete checkpoint (verification gate).")
        else:
            lines.append("★ Final story — the complete checkpoint requires --verify-cmd and "
                         "--verify-evidence (verification gate).")
    lines += render_map(plan, story)
    lines += render_carried(plan, story)
    lines += render_feedback(story)
    if story["checks"]:
        lines.append("## Frozen checks — the engine runs all of them at `complete`; no substitute "
                     "command counts:")
        flagged = {u["check"]: u["reason"] for u in plan["unverifiable"] if u["id"] == story["id"]}
        for i, cmd in enumerate(story["checks"]):
            note = f"   ⚠ cannot run here: {one_line(flagged[i])}" if i in flagged else ""
            lines.append(f"  {i + 1}. {one_line(cmd)}{note}")
    if story["accept"]:
        lines.append("## Acceptance items — a judge checks each one:")
        lines += [f"  - {one_line(item)}" for item in story["accept"]]
    if story["judge"]:
        lines.append("Judged story: `complete` moves it to review; an independent judge decides.")
    lines.append(f"Not achieved yet: {ctx.prog} checkpoint --id {story['id']} --status failed "
                 "--evidence \"<what is missing>\"; impossible as specified: --status blocked "
                 "--evidence \"<why>\", then stop and ask a human.")
    lines.append("On completion: " + completion_command(ctx, plan, story))
    return lines


def status_details(plan, story):
    details = []
    if story["round"] > 1 or story["status"] in ("failed", "in_progress"):
        details.append(f"round {story['round']}, {max(rounds_left(plan, story), 0)} left")
    if story["status"] == "in_progress" and story["agent"]:
        details.append(f"held by agent {one_line(story['agent'])}")
    if story["status"] in ("pending", "failed"):
        waiting = waits_for(plan, story)
        if waiting:
            details.append("waits for " + ", ".join(waiting))
    if story["status"] == "blocked":
        details.append("blocked: " + one_line(last_chars(story["blocked_reason"] or "no reason given", 200)))
    if story["status"] == "review":
        details.append("awaiting an independent judge")
    if story["status"] == "accepted" and story["decision"]:
        details.append("accepted by a human: " + one_line(last_chars(story["decision"]["note"], 200)))
    for a in story["amendments"]:
        details.append("amended: " + one_line(last_chars(a["note"], 200)))
    return details


def next_step(ctx, plan):
    """What to do now, as one line, or None when the plan is done."""
    if plan_done(plan):
        return None
    active = active_stories(plan)
    if active:
        s = active[0]
        return f"finish {s['id']}, then `{ctx.prog} checkpoint --id {s['id']} --status complete ...`"
    if pick_ready(plan):
        return f"`{ctx.prog} next`"
    blocked = [s["id"] for s in plan["goals"] if s["status"] == "blocked"]
    if blocked:
        return (f"{blocked[0]} is blocked — a human decides: `{ctx.prog} decide --id {blocked[0]} "
                "accept|retry|amend --note \"…\"`")
    review = [s["id"] for s in plan["goals"] if s["status"] == "review"]
    if review:
        return f"{review[0]} awaits a judge: `{ctx.prog} judge-packet --id {review[0]}`"
    return None


def done_line(plan):
    accepted = [s["id"] for s in plan["goals"] if s["status"] == "accepted"]
    if accepted:
        return f"fablize: all stories done ✓ ({', '.join(accepted)} accepted by a human decision)"
    return "fablize: all stories complete ✓"


def story_json(plan, story):
    data = {k: story[k] for k in ("id", "title", "objective", "status", "evidence", "after",
                                  "checks", "accept", "judge", "round", "agent", "feedback",
                                  "amendments", "decision", "blocked_reason", "judged_by")}
    data.update(final=is_final(plan, story), rounds_left=rounds_left(plan, story),
                waits_for=waits_for(plan, story), last_run=story["last_run"])
    return data


def plan_json(plan):
    done = sum(1 for s in plan["goals"] if s["status"] in DONE)
    return {"plan_id": plan["plan_id"], "brief": plan["brief"], "created": plan["created"],
            "done": done, "total": len(plan["goals"]), "complete": plan_done(plan),
            "options": plan["options"], "unverifiable": plan["unverifiable"],
            "ledger": plan["ledger"], "stories": [story_json(plan, s) for s in plan["goals"]]}


def format_event(ev):
    """One event of the ledger as a line of history."""
    kind, sid = ev.get("event"), ev.get("id", "")
    when = str(ev.get("ts", ""))[:19].replace("T", " ")
    if kind == "plan_created":
        text = f"plan created — {ev.get('count')} stories: {defused_line(ev.get('brief'))}"
        if ev.get("replaces"):
            text += f" (replaces {ev['replaces'].get('plan_id')}, archived)"
        if ev.get("imported_from"):
            text += " (imported from the original goals.py)"
    elif kind == "story_started":
        text = f"{sid} started, round {ev.get('round')}" + (f", agent {one_line(ev['agent'])}"
                                                           if ev.get("agent") else "")
    elif kind == "checkpoint":
        text = f"{sid} checkpoint {ev.get('status')} — evidence: {one_line(last_chars(ev.get('evidence'), 200))}"
        if ev.get("verify_cmd"):
            text += f" · verify-cmd: {one_line(ev['verify_cmd'])}"
        if ev.get("verify_evidence"):
            text += f" · verify-evidence: {one_line(last_chars(ev['verify_evidence'], 120))}"
    elif kind == "verify_run":
        text = f"{sid} run {run_summary(ev)} · log {ev.get('log')}"
    elif kind == "decision":
        text = f"{sid} decision: {ev.get('decision')} — {one_line(ev.get('note'))}"
    elif kind == "story_added":
        story = ev.get("story", {})
        text = f"{story.get('id')} added: {defused_line(story.get('title'))}"
    elif kind == "verdict":
        text = (f"{sid} verdict {ev.get('verdict')} by {one_line(ev.get('agent'))} — "
                f"{one_line(last_chars(ev.get('evidence'), 200))}")
    elif kind == "guard_block":
        text = f"stop blocked by the guard: {one_line(ev.get('reason', ''))}"
    else:
        text = one_line(kind)
    return f"#{ev.get('seq')}  {when}  {text}"


# Audit: replaying the whole ledger ##########################################


def audit_ledger(data, snapshot_raw, since=None, require_independent=False):
    """Replay every line; returns a report dict. Raises FablizeError(exit 3) at the first line
    that cannot be trusted, naming it and why."""
    from hashlib import sha256  # OpenSSL's is several times faster on long ledgers
    lines = data.split(b"\n")
    torn = lines.pop()  # b"" when the ledger ends with a newline
    if not torn and lines and parse_event(lines[-1]) is None:
        torn = lines.pop()  # an unparsable last line is a torn write too
    plan, head = None, ZERO_HASH
    since_seq, since_hash, since_found = None, None, since is None
    if since is not None:
        seq_text, _, since_hash = since.rpartition(":")
        since_hash = since_hash.strip().lower()
        if seq_text:
            if not (seq_text.isascii() and seq_text.isdigit()):
                raise usage("--since takes HASH or SEQ:HASH (as `audit` prints its head).")
            since_seq = int(seq_text)
    snap = None
    if snapshot_raw is not None:
        try:
            snap = load_json(snapshot_raw)
            validate_snapshot(snap)
        except ValueError:
            raise damaged(f"{SNAPSHOT} is not valid JSON.", "bad_snapshot")
        if snap.get("digest") != canonical_digest(snap):
            raise damaged(f"{SNAPSHOT} was changed outside fablize: its digest does not match its "
                          "content.", "snapshot_edited")
    snap_seq = snap.get("ledger", {}).get("seq") if isinstance(snap, dict) else None
    if since is not None and b'"event":"plan_merged"' in data:  # a pin of a plan merged in
        since_found = merged_pin(lines, since_seq, since_hash)
    snap_view = None
    independence, run_logs = [], []
    for lineno, (line, ev) in enumerate(zip(lines, parse_in_chunks(lines, data)), 1):
        if type(ev) is not dict:
            raise damaged(f"{LEDGER} line {lineno}: not a ledger event (unparsable or missing "
                          "seq/event) — damaged or edited.", "bad_line")
        if ev.get("seq") != lineno:  # a seq of another type is not equal either
            raise damaged(f"{LEDGER} line {lineno}: seq is {one_line(repr(ev.get('seq')))}, "
                          f"expected {lineno} — a line was deleted, duplicated or moved.", "bad_seq")
        if ev.get("prev") != head:
            raise damaged(f"{LEDGER} line {lineno}: the hash chain is broken — its prev does not "
                          f"match line {lineno - 1}, so an earlier line was changed, removed or "
                          "reordered.", "broken_chain")
        plan = replay_line(plan, ev, lineno)
        if ev["event"] == "verify_run" and type(ev.get("log")) is str:
            run_logs.append((lineno, ev["log"], ev.get("sha256")))
        if require_independent and ev["event"] == "verdict":  # a verdict leaves executor as it was
            story = find_story(plan, ev["id"])
            if story["executor"] is None or story["executor"] == ev.get("agent"):
                independence.append(f"line {lineno}: {story['id']} judged by "
                                    f"{one_line(ev.get('agent'))}, executor "
                                    f"{one_line(story['executor'] or 'unnamed')}")
        head = sha256(line).hexdigest()
        if since_found is False and (since_seq == lineno or (since_seq is None
                                                              and head == since_hash)):
            if head != since_hash:
                raise damaged(f"{LEDGER} line {lineno} no longer hashes to {since_hash[:16]}… "
                              "(--since): history before it was rewritten.", "history_rewritten")
            since_found = True
        if lineno == snap_seq:
            plan["ledger"] = {"seq": lineno, "head": head}
            snap_view = json.loads(dumps(plan))
    if plan is None:
        if snap is not None:
            raise damaged(f"{SNAPSHOT} reflects event {snap_seq} but {LEDGER} is empty or "
                          "missing.", "disagree")
        raise refused("no plan — run `create` first.", "no_plan")
    first = parse_event(lines[0]) if lines else None
    replaced = first.get("replaces") if first else None
    if not since_found and isinstance(replaced, dict) and replaced.get("head") == since_hash \
            and since_seq in (None, replaced.get("seq")):
        since_found = True  # the head was the last event of the plan `create --force` archived
    if not since_found:
        where = f"line {since_seq} does not exist" if since_seq else "no line hashes to it"
        raise damaged(f"--since {since_hash[:16]}…: {where} — the ledger was truncated or "
                      "re-written from scratch.", "history_rewritten")
    plan["ledger"] = {"seq": len(lines), "head": head}
    if not fits(plan, _PLAN_CHECK):
        for lineno, ev in enumerate(parse_in_chunks(lines, data), 1):
            check_event(ev, lineno)
        where = misfit(plan, PLAN_SPEC).lstrip(".")
        raise damaged(f"the replay of {LEDGER} gives a malformed plan ({where}).", "bad_event")
    report = {"events": len(lines), "head": f"{len(lines)}:{head}", "torn_tail_bytes": len(torn),
              "snapshot": "missing", "plan": plan, "independence": independence,
              "run_logs": run_logs}
    if snap is not None:
        if snap_view is None:
            raise damaged(f"{SNAPSHOT} reflects event {snap_seq}, which the ledger does not "
                          "contain.", "disagree")
        mismatch = first_difference(snap_view, {k: v for k, v in snap.items() if k != "digest"})
        if mismatch:
            raise damaged(f"{SNAPSHOT} disagrees with the replay of {LEDGER} up to line {snap_seq}: "
                          f"{mismatch}.", "snapshot_mismatch")
        behind = len(lines) - snap_seq
        report["snapshot"] = "in sync" if not behind else f"{behind} events behind (rolled " \
                                                          "forward by the next command)"
    return report


def parse_in_chunks(lines, data, size=4096):
    """parse_events over a long ledger a slice at a time: memory stays flat and each slice's
    events are freed as the replay moves on."""
    surrogates = has_surrogate_escape(data)  # one scan of the whole ledger, not one a slice
    for start in range(0, len(lines), size):
        yield from parse_events(lines[start:start + size], surrogates)


def parse_events(lines, surrogates=None):
    """parse_event for every line; the whole ledger in one json call when it is all well
    formed (JSON strings never hold a raw newline, so the lines join into one array)."""
    try:
        events = load_json("[" + b",".join(lines).decode("utf-8") + "]", surrogates)
    except ValueError:
        events = None
    if events is not None and len(events) == len(lines):
        return events  # the replay checks each is an event (cheaper there than a second pass)
    return [parse_event(line) for line in lines]


def first_difference(expected, actual, path=""):
    if type(expected) is not type(actual):
        return f"{path or 'top level'} is {one_line(repr(actual))[:80]}, the ledger says " \
               f"{one_line(repr(expected))[:80]}"
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
        return f"{path.rstrip('.')} is {one_line(repr(actual))[:80]}, the ledger says " \
               f"{one_line(repr(expected))[:80]}"
    return None


# Sharing: plans through a git remote #########################################
#
# A shared plan's ledger is also a chain of commits under refs/fablize/plans/<plan id> on a git
# remote, one commit per event: its tree holds `event.jsonl` (the ledger line, exact bytes) and,
# for a run, `log` (the run's output). Writers order themselves by pushing without force: the
# remote's fast-forward-only ref update is the compare-and-swap. A push that loses fetches the
# winner's events, replays them through apply_event, re-validates and re-chains the local events
# not yet published (an event no longer legal is set aside in rejected.jsonl and said, never
# dropped silently) and tries again. share.json in the state directory marks a shared plan and
# records how much of the local ledger the remote is known to hold; a local plan has no
# share.json and never starts git.
#
# Interface for the storage layer: publish(session) after a session's commits (Session.__exit__
# calls it), publish(session, claim=True) where the command must not go on unless its events
# are on the remote, and share_status(store, plan) for `status`.

SHARE = "share.json"
REJECTED = "rejected.jsonl"
SHARED_REFS = "refs/fablize/plans/"
PUSH_ATTEMPTS = 12
CLAIM_ATTEMPTS = 5
GIT_TIMEOUT = 60.0
SHARE_SPEC = compile_spec({"remote": str, "plan_id": str, "seq": int, "head": str,
                           "commit": _TEXT})
SAFE_LOG = re.compile(r"runs/[\w.-]+\.log")


def unreachable(remote, detail):
    return FablizeError(f"the remote {one_line(remote)} cannot be reached ({one_line(detail)[:300]}).",
                        "remote_unreachable", EXIT_DAMAGED)


def git(root, *args, data=None, remote=None):
    """git in the repository at `root`; never prompts. Returns the CompletedProcess."""
    import subprocess
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", GIT_ASKPASS="", SSH_ASKPASS="")
    try:
        return subprocess.run(["git", "-C", root, *args], input=data, capture_output=True,
                              timeout=GIT_TIMEOUT, env=env,
                              stdin=subprocess.DEVNULL if data is None else None)
    except FileNotFoundError:
        raise damaged("git is not installed (or not on PATH): a shared plan needs it.", "no_git")
    except subprocess.TimeoutExpired:
        raise unreachable(remote or "?", f"git {args[0]} took more than {GIT_TIMEOUT:g} s")


def git_out(root, *args, data=None):
    p = git(root, *args, data=data)
    if p.returncode != 0:
        raise damaged(f"git {args[0]} failed: {one_line(p.stderr.decode('utf-8', 'replace'))[:300]}",
                      "git_failed")
    return p.stdout


def check_remote(store, remote):
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*", remote or ""):
        raise usage(f"--remote takes the name of a git remote (as `git remote` lists them), not "
                    f"{one_line(remote)!r}.", "bad_remote")
    p = git(store.root, "remote", "get-url", remote)
    if p.returncode != 0:
        raise refused(f"{one_line(remote)} is not a git remote of {store.root} — add it with "
                      f"`git remote add {one_line(remote)} URL`.", "no_remote")
    return remote


def check_plan_id(plan_id):
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*", plan_id or "") or ".." in plan_id:
        raise usage(f"--plan takes a plan id (as `sync` lists them), not {one_line(plan_id)!r}.",
                    "bad_plan_id")
    return plan_id


def share_config(store):
    """The shared plan's record, or None for a local plan (one lstat, no git)."""
    path = store.path(SHARE)
    if not os.path.lexists(path):
        return None
    try:
        cfg = load_json(read_state_file(path) or b"")
    except ValueError:
        cfg = None
    names = re.compile(r"[A-Za-z0-9][\w.-]*")
    if not fits(cfg, SHARE_SPEC) or not names.fullmatch(cfg["remote"]) or \
            not names.fullmatch(cfg["plan_id"]) or ".." in cfg["plan_id"]:
        raise damaged(f"{SHARE} is not a fablize share record — run `goals.py sync` after "
                      "removing it.", "bad_share")
    return cfg


def save_share_config(store, cfg):
    write_file_atomic(store.path(SHARE), dumps(cfg).encode("utf-8") + b"\n")


def tracking_ref(cfg):
    return f"refs/fablize/remotes/{cfg['remote']}/{cfg['plan_id']}"


def fetch_shared(store, cfg):
    """The commit at the remote's ref (fetched into a tracking ref), or None if it has none."""
    ref = SHARED_REFS + cfg["plan_id"]
    p = git(store.root, "fetch", "--quiet", "--no-tags", cfg["remote"],
            f"+{ref}:{tracking_ref(cfg)}", remote=cfg["remote"])
    if p.returncode != 0:
        err = p.stderr.decode("utf-8", "replace")
        if "couldn't find remote ref" in err:
            return None
        raise unreachable(cfg["remote"], err.strip().splitlines()[-1] if err.strip() else
                          f"git fetch exit {p.returncode}")
    return git_out(store.root, "rev-parse", "--verify", tracking_ref(cfg)).decode().strip()


def cat_objects(root, names):
    """The bytes of each `rev:path` (None where it is missing), through one git cat-file."""
    if not names:
        return []
    out = git_out(root, "cat-file", "--batch", data="".join(n + "\n" for n in names).encode())
    found, pos = [], 0
    for _ in names:
        end = out.index(b"\n", pos)
        header = out[pos:end].split()
        pos = end + 1
        if header[-1] == b"missing":
            found.append(None)
            continue
        size = int(header[2])
        found.append(out[pos:pos + size])
        pos += size + 1
    return found


def remote_events(store, cfg, base, tip):
    """[(line, log bytes or None)] of the commits after `base` up to `tip`, oldest first."""
    spec = [tip, "^" + base] if base else [tip]
    revs = git_out(store.root, "rev-list", "--reverse", "--topo-order", *spec).decode().split()
    lines = cat_objects(store.root, [f"{r}:event.jsonl" for r in revs])
    events = []
    for rev, raw in zip(revs, lines):
        if raw is None or not raw.endswith(b"\n") or b"\n" in raw[:-1]:
            raise damaged(f"the shared plan on {cfg['remote']} has a commit {rev[:12]} that holds "
                          "no ledger line — the ref was written by something else.", "bad_remote_event")
        events.append([rev, raw[:-1], None])
    runs = [e for e in events if b'"event":"verify_run"' in e[1]]
    for e, log in zip(runs, cat_objects(store.root, [f"{e[0]}:log" for e in runs])):
        e[2] = log
    return [(line, log) for _, line, log in events]


def apply_shared_line(plan, line, seq, head, remote):
    """A line from the remote, checked like a line read back from the ledger."""
    ev = parse_event(line)
    if ev is None or ev["seq"] != seq or ev.get("prev") != head:
        got = ev["seq"] if ev else "?"
        raise damaged(f"the shared plan on {remote} does not continue this ledger at event {seq} "
                      f"(found event {got}, or a broken hash chain) — its history was rewritten; "
                      "run `goals.py audit --remote` to see it.", "remote_history_rewritten")
    check_event(ev, seq)
    try:
        plan = apply_event(plan, ev)
    except FablizeError as e:
        raise damaged(f"the shared plan on {remote}: event {seq} is not legal when replayed "
                      f"({e.message}).", "bad_remote_event")
    plan["ledger"] = {"seq": seq, "head": sha256_hex(line)}
    return plan, ev


def unpublished_lines(session, after_seq):
    """The local ledger's lines after event `after_seq`, oldest first."""
    fd = session.ledger_fd()
    if fd is None:
        return []
    end = session.cut_torn_tail(fd, session.plan and {"ledger": session.plan["ledger"]})
    found = []
    for _, line in lines_backward(fd, end) if end else ():
        ev = parse_event(line)
        if ev is None or ev["seq"] <= after_seq:
            break
        found.append(line)
    return found[::-1]


def write_run_log(store, ev, log, remote):
    name = ev.get("log")
    if type(name) is not str or log is None:
        return
    if not SAFE_LOG.fullmatch(name):
        raise damaged(f"the shared plan on {remote}: run log path {one_line(name)} is not under "
                      f"{RUNS}/.", "bad_remote_event")
    if ev.get("sha256") is not None and sha256_hex(log) != ev["sha256"]:
        raise damaged(f"the shared plan on {remote}: {name} does not match the sha256 its run "
                      "recorded.", "run_log_mismatch")
    path = store.path(name)
    ensure_subdir(store.path(RUNS))
    if os.path.lexists(path):
        os.replace(path, free_name(path + ".local"))  # a stale local log of the same name
    write_file_atomic(path, log)


def integrate(session, cfg, tip):
    """Bring the remote's events after cfg's position into the local ledger; the local events
    not published yet are replayed after them. Returns the local events set aside."""
    store = session.store
    if tip is None or tip == cfg["commit"]:
        return []
    incoming = remote_events(store, cfg, cfg["commit"], tip)
    local = unpublished_lines(session, cfg["seq"])
    same = 0  # a push that landed before its process died: those events are already there
    while same < min(len(local), len(incoming)) and local[same] == incoming[same][0]:
        same += 1
    base_seq = cfg["seq"] + same
    local, incoming = local[same:], incoming[same:]
    if not local:
        plan = session.plan
        seq, head = (plan["ledger"]["seq"], plan["ledger"]["head"]) if plan else (0, ZERO_HASH)
        lines = []
        for line, log in incoming:
            seq += 1
            plan, ev = apply_shared_line(plan, line, seq, head, cfg["remote"])
            if seq == 1 and plan["plan_id"] != cfg["plan_id"]:
                raise damaged(f"the shared plan {cfg['plan_id']} on {cfg['remote']} holds plan "
                              f"{one_line(plan['plan_id'])}.", "bad_remote_event")
            head = plan["ledger"]["head"]
            write_run_log(store, ev, log, cfg["remote"])
            lines.append(line)
        if lines:
            fd = session.ledger_fd(create=True)
            session._append(fd, b"\n".join(lines))
            session.save_snapshot(plan)
            session.plan = plan
        cfg.update(seq=seq, head=head, commit=tip)
        save_share_config(store, cfg)
        return []
    return rebase(session, cfg, tip, base_seq, incoming, local)


def rebase(session, cfg, tip, base_seq, incoming, local):
    store = session.store
    data = store.ledger_bytes()
    kept = data.split(b"\n")[:base_seq]
    plan = audit_ledger(b"".join(x + b"\n" for x in kept), None)["plan"] if kept else None
    seq, head = (base_seq, plan["ledger"]["head"]) if plan else (0, ZERO_HASH)
    ensure_subdir(store.path(RUNS))
    moved = {}
    for line in local:  # our unpublished logs step aside: the remote's may carry their names
        ev = parse_event(line)
        if ev["event"] == "verify_run" and type(ev.get("log")) is str and \
                os.path.lexists(store.path(ev["log"])):
            tmp = store.path(f"{RUNS}/.rebase-{ev['seq']}-{os.urandom(4).hex()}")
            os.replace(store.path(ev["log"]), tmp)
            moved[ev["seq"]] = tmp
    for line, log in incoming:
        seq += 1
        plan, ev = apply_shared_line(plan, line, seq, head, cfg["remote"])
        head = plan["ledger"]["head"]
        write_run_log(store, ev, log, cfg["remote"])
        kept.append(line)
    cfg.update(seq=seq, head=head, commit=tip)
    renumber, rejected = {}, []
    for line in local:
        ev = parse_event(line)
        old = ev["seq"]
        ev.update(seq=seq + 1, prev=head)
        if type(ev.get("after_seq")) is int:
            ev["after_seq"] = renumber.get(ev["after_seq"], min(ev["after_seq"], base_seq))
        if isinstance(ev.get("runs"), list):
            ev["runs"] = [renumber.get(r, r) for r in ev["runs"]]
        if ev["event"] == "verify_run" and type(ev.get("log")) is str:
            ev["log"] = f"{RUNS}/{seq + 1}-{ev['id']}.log"
        trial = json.loads(json.dumps(plan)) if plan is not None else None
        try:
            trial = apply_event(trial, ev)
        except FablizeError as e:
            rejected.append({"event": parse_event(line), "reason": e.message, "code": e.code})
            if old in moved:
                os.replace(moved.pop(old), free_name(store.path(f"{RUNS}/rejected-{old}.log")))
            continue
        if old in moved:
            os.replace(moved.pop(old), store.path(ev["log"]))
        new_line = dumps(ev).encode("utf-8")
        seq, head = seq + 1, sha256_hex(new_line)
        trial["ledger"] = {"seq": seq, "head": head}
        plan = trial
        renumber[old] = seq
        kept.append(new_line)
    staged = store.path(LEDGER + ".new")
    if os.path.lexists(staged):
        os.unlink(staged)
    fd = open_state_file(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        write_all(fd, b"".join(x + b"\n" for x in kept))
        os.fsync(fd)
    finally:
        os.close(fd)
    session._close_ledger()
    if os.path.lexists(store.path(SNAPSHOT)):
        os.unlink(store.path(SNAPSHOT))  # from here a crash replays the new ledger from scratch
    os.replace(staged, store.path(LEDGER))
    fsync_dir(store.dir)
    session.save_snapshot(plan)
    session.plan = plan
    save_share_config(store, cfg)
    if rejected:
        rfd = open_state_file(store.path(REJECTED), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            write_all(rfd, b"".join(dumps(dict(r, rejected=now_iso())).encode("utf-8") + b"\n"
                                    for r in rejected))
            os.fsync(rfd)
        finally:
            os.close(rfd)
    return rejected


def event_commits(store, cfg, lines):
    """Commits for `lines` on top of cfg's commit (one git fast-import); returns the new tip."""
    ref = f"refs/fablize/local/{cfg['plan_id']}"
    chunks = [f"reset {ref}\n".encode()]
    if cfg["commit"]:
        chunks.append(f"from {cfg['commit']}\n".encode())
    when = int(time.time())
    for i, line in enumerate(lines, 1):
        ev = parse_event(line)
        message = f"fablize {cfg['plan_id']} #{ev['seq']} {ev['event']} {ev.get('id') or ''}".strip()
        message = message.encode("utf-8")
        chunks.append(f"commit {ref}\nmark :{i}\ncommitter fablize <fablize@localhost> {when} +0000\n"
                      f"data {len(message)}\n".encode() + message + b"\ndeleteall\n")
        chunks.append(f"M 100644 inline event.jsonl\ndata {len(line) + 1}\n".encode() + line + b"\n\n")
        log = ev.get("log") if ev["event"] == "verify_run" else None
        body = read_state_file(store.path(log)) if type(log) is str and SAFE_LOG.fullmatch(log) \
            else None
        if body is not None:
            chunks.append(f"M 100644 inline log\ndata {len(body)}\n".encode() + body + b"\n")
    chunks.append(f"get-mark :{len(lines)}\n".encode())
    out = git_out(store.root, "fast-import", "--quiet", "--force", "--done", data=b"".join(chunks)
                  + b"done\n")
    return out.decode().split()[-1]


def push_shared(store, cfg, new_tip):
    """True when the remote took the new tip; False when another writer got there first."""
    p = git(store.root, "push", "--porcelain", "--no-verify", cfg["remote"],
            f"{new_tip}:{SHARED_REFS}{cfg['plan_id']}", remote=cfg["remote"])
    if p.returncode == 0:
        return True
    out = (p.stdout + p.stderr).decode("utf-8", "replace")
    if "[rejected]" in out or "[remote rejected]" in out:
        return False
    raise unreachable(cfg["remote"], out.strip().splitlines()[-1] if out.strip() else
                      f"git push exit {p.returncode}")


def say_rejected(store, rejected):
    for r in rejected:
        ev = r["event"]
        store.out.warn(f"{ev['event']} {one_line(ev.get('id') or '')} (event {ev['seq']}, made here "
                       f"before the remote's newer events) is no longer legal: {one_line(r['reason'])}"
                       f" — set aside in {REJECTED}, not published.")


def sync_shared(session, cfg, fetch_first=True):
    """Fetch, integrate, push what is unpublished; retry a lost push a bounded number of times.
    Returns the local events set aside."""
    import random
    store = session.store
    rejected = []
    fetch = fetch_first
    for attempt in range(PUSH_ATTEMPTS):
        if fetch:
            rejected += integrate(session, cfg, fetch_shared(store, cfg))
        plan = session.plan
        if plan is None or plan["ledger"]["seq"] <= cfg["seq"]:
            return rejected
        lines = unpublished_lines(session, cfg["seq"])
        tip = event_commits(store, cfg, lines)
        if push_shared(store, cfg, tip):
            crash_point("after-push")  # tests: published, but share.json does not know yet
            cfg.update(seq=plan["ledger"]["seq"], head=plan["ledger"]["head"], commit=tip)
            save_share_config(store, cfg)
            return rejected
        fetch = True
        time.sleep(random.uniform(0.005, 0.02) * min(attempt + 1, 8))
    raise FablizeError(f"gave up publishing to {cfg['remote']} after {PUSH_ATTEMPTS} pushes lost to "
                       "other writers; the events are kept here — run `sync` again.",
                       "push_contended", EXIT_DAMAGED)


def publish(session, claim=False, fetch_first=False):
    """After a session's commits: put the unpublished events on the remote. A local plan
    returns at once. With `claim`, the command may go on only if its last event is on the
    remote: an event set aside or an unreachable remote is refused; otherwise the events stay
    local with a warning and the next command or `sync` publishes them. Returns the plan."""
    store = session.store
    cfg = share_config(store)
    if cfg is None or session.plan is None:
        return session.plan
    own = getattr(session, "last", None)
    if session.plan["plan_id"] != cfg["plan_id"]:  # create --force: the new plan, its own ref
        cfg = {"remote": cfg["remote"], "plan_id": session.plan["plan_id"], "seq": 0,
               "head": ZERO_HASH, "commit": None}
        save_share_config(store, cfg)
    if not fetch_first and session.plan["ledger"]["seq"] <= cfg["seq"]:
        return session.plan
    try:
        rejected = sync_shared(session, cfg, fetch_first)
    except FablizeError as e:
        if claim or e.code not in ("remote_unreachable", "push_contended"):
            raise
        store.out.warn(f"not published: {e.message} The events are kept here; the next command "
                       "or `sync` publishes them.")
        return session.plan
    say_rejected(store, rejected)
    for r in rejected:
        ev = r["event"]
        if own is not None and ev["seq"] >= own["seq"] and ev.get("id") == own.get("id"):
            held = find_story(session.plan, ev["id"]) if ev.get("id") else None
            who = f" — agent {one_line(held['agent'])} holds it" if held and held["agent"] else ""
            raise refused(f"{one_line(ev.get('id') or ev['event'])} was taken on {cfg['remote']} "
                          f"meanwhile{who}; this {ev['event']} was not published "
                          f"({one_line(r['reason'])}).", "claim_lost")
    return session.plan


def claim_story(session, story, agent):
    """`next`'s story_started; in a shared plan it counts only once it is on the remote, and a
    claim lost to another machine (said, set aside) moves on to the next ready story, a bounded
    number of times. Returns the story now held."""
    import random
    for attempt in range(CLAIM_ATTEMPTS):
        session.commit("story_started", id=story["id"], title=story["title"],
                       round=story["round"] + 1, agent=agent)
        try:
            publish(session, claim=True)
            return find_story(session.plan, story["id"])
        except FablizeError as e:
            if e.code != "claim_lost" or attempt == CLAIM_ATTEMPTS - 1:
                raise
            lost = e
        ready = [x for x in session.plan["goals"] if is_ready(session.plan, x)]
        if not ready:
            raise lost
        # the other writers just won the first ready story: a random one avoids a convoy
        story = random.choice(ready)
        session.out.warn(f"{lost.message} Claiming {story['id']} instead.")
    raise lost


def share_status(store, plan):
    """How far the local copy is ahead of and behind the remote, or None for a local plan."""
    cfg = share_config(store)
    if cfg is None or plan is None:
        return None
    info = {"remote": cfg["remote"], "ref": SHARED_REFS + cfg["plan_id"],
            "published": cfg["seq"], "ahead": plan["ledger"]["seq"] - cfg["seq"], "behind": None}
    try:
        tip = fetch_shared(store, cfg)
    except FablizeError as e:
        info["error"] = e.message
        return info
    behind = 0
    if tip is not None and tip != cfg["commit"]:
        subject = git_out(store.root, "log", "-1", "--format=%s", tip).decode()
        found = re.search(r" #(\d+) ", subject + " ")
        behind = int(found.group(1)) - cfg["seq"] if found else None
    info["behind"] = behind
    return info


def shared_plan_refs(store, remote):
    """{plan id: commit} of the plans shared on `remote`."""
    p = git(store.root, "ls-remote", remote, SHARED_REFS + "*", remote=remote)
    if p.returncode != 0:
        raise unreachable(remote, p.stderr.decode("utf-8", "replace").strip()[-300:])
    found = {}
    for row in p.stdout.decode().splitlines():
        sha, _, ref = row.partition("\t")
        found[ref[len(SHARED_REFS):]] = sha
    return found


def default_remote(store):
    names = git_out(store.root, "remote").decode().split()
    if "origin" in names:
        return "origin"
    if len(names) == 1:
        return names[0]
    if not names:
        raise refused(f"{store.root} has no git remote — add one with `git remote add NAME URL`.",
                      "no_remote")
    raise usage(f"several git remotes ({', '.join(names)}): say which with --remote NAME.")


def ignore_shared_dir(store):
    """A shared plan lives in refs, not in the branch: nothing in its state directory is
    committed, so a branch merge never touches it."""
    path = store.path(".gitignore")
    if not os.path.lexists(path):
        write_file_atomic(path, b"# a shared plan: its history is in refs/fablize/, not the branch\n*\n")


def start_sharing(ctx, remote):
    """share / create --remote: record the remote, then publish the whole ledger."""
    store = ctx.store
    with open_plan(ctx) as s:
        plan = s.require_plan()
        cfg = share_config(store)
        if cfg is not None and cfg["plan_id"] == plan["plan_id"] and cfg["remote"] != remote:
            raise refused(f"this plan is already shared through {cfg['remote']}.", "already_shared")
        if cfg is None or cfg["plan_id"] != plan["plan_id"]:
            cfg = {"remote": remote, "plan_id": plan["plan_id"], "seq": 0, "head": ZERO_HASH,
                   "commit": None}
            save_share_config(store, cfg)
        ignore_shared_dir(store)
        rejected = sync_shared(s, cfg)
        say_rejected(store, rejected)
        plan = s.plan
    ctx.say(f"fablize: plan {plan['plan_id']} shared through {remote} "
            f"({SHARED_REFS}{plan['plan_id']}, {cfg['seq']} events).")
    ctx.data.update(share={"remote": remote, "ref": SHARED_REFS + plan["plan_id"],
                           "published": cfg["seq"]})


def cmd_share(ctx, a):
    if not ctx.store.exists():
        raise refused("no plan — run `create` first.", "no_plan")
    start_sharing(ctx, check_remote(ctx.store, a.remote))


def cmd_sync(ctx, a):
    store = ctx.store
    cfg = share_config(store) if store.exists() else None
    if cfg is None:
        if store.exists() and has_plan_files(store):
            raise refused("this plan is local — share it first: `share --remote NAME`.", "not_shared")
        remote = check_remote(store, a.remote or default_remote(store))
        plans = shared_plan_refs(store, remote)
        if a.plan:
            if check_plan_id(a.plan) not in plans:
                raise refused(f"{remote} shares no plan {one_line(a.plan)}.", "not_found")
            plan_id = a.plan
        elif len(plans) == 1:
            plan_id = next(iter(plans))
        else:
            raise refused(f"{remote} shares {len(plans) or 'no'} plans" +
                          (f" ({', '.join(sorted(plans))}): say which with --plan ID." if plans
                           else " — share one with `share --remote NAME`."), "which_plan")
        store.create_dir()
        with store.session() as s:
            s.load()
            if has_plan_files(store):
                raise refused(PLAN_EXISTS, "plan_exists")
            cfg = {"remote": remote, "plan_id": plan_id, "seq": 0, "head": ZERO_HASH,
                   "commit": None}
            save_share_config(store, cfg)
            ignore_shared_dir(store)
    elif a.remote and a.remote != cfg["remote"]:
        raise refused(f"this plan is shared through {cfg['remote']}, not {one_line(a.remote)}.",
                      "other_remote")
    with store.session() as s:
        s.load()
        cfg = share_config(store)  # again under the lock: another command may have published
        before = s.plan["ledger"]["seq"] if s.plan else 0
        ahead = before - cfg["seq"]
        rejected = sync_shared(s, cfg)
        say_rejected(store, rejected)
        plan = s.plan
    if plan is None:
        raise refused(f"{cfg['remote']} holds nothing for plan {cfg['plan_id']} yet.", "no_plan")
    pulled = plan["ledger"]["seq"] - before + len(rejected)
    sent = ahead - len(rejected)
    ctx.say(f"fablize: in sync with {cfg['remote']} — {plan['ledger']['seq']} events "
            f"({SHARED_REFS}{cfg['plan_id']}): {pulled} pulled, {sent} published"
            + (f", {len(rejected)} set aside in {REJECTED}" if rejected else "") + ".")
    ctx.data.update(share={"remote": cfg["remote"], "ref": SHARED_REFS + cfg["plan_id"],
                           "events": plan["ledger"]["seq"], "pulled": pulled, "published": sent,
                           "rejected": [r["event"] for r in rejected]}, plan=plan_json(plan))


def remote_ledger(store, remote, plan_id):
    """The ledger bytes and run logs of a plan as the remote holds it (for audit)."""
    cfg = {"remote": remote, "plan_id": plan_id, "seq": 0, "head": ZERO_HASH, "commit": None}
    tip = fetch_shared(store, cfg)
    if tip is None:
        raise refused(f"{remote} shares no plan {one_line(plan_id)}.", "not_found")
    events = remote_events(store, cfg, None, tip)
    return b"".join(line + b"\n" for line, _ in events), \
        {parse_event(line).get("log"): log for line, log in events if log is not None}



def say_share_status(ctx, info):
    if info is None:
        return
    where = f"shared through {info['remote']} ({info['ref']})"
    if info.get("error"):
        ctx.say(f"fablize: {where}: {info['ahead']} event(s) not published yet; the remote cannot be "
                f"reached now — {one_line(info['error'])}")
    elif info["ahead"] or info["behind"]:
        ctx.say(f"fablize: {where}: {info['ahead']} event(s) ahead (not published), "
                f"{info['behind'] if info['behind'] is not None else 'some'} behind — run `sync`.")
    else:
        ctx.say(f"fablize: {where}: in sync.")
    ctx.data["share"] = info


def audit_remote_source(ctx, a):
    """audit --remote: (ledger bytes, no snapshot, run logs) of the plan on the remote."""
    store = ctx.store
    remote = check_remote(store, a.remote)
    plan_id = a.plan and check_plan_id(a.plan)
    if plan_id is None:
        cfg = share_config(store) if store.exists() else None
        if cfg is not None and cfg["remote"] == remote:
            plan_id = cfg["plan_id"]
        else:
            plans = shared_plan_refs(store, remote)
            if len(plans) != 1:
                raise refused(f"{remote} shares {len(plans) or 'no'} plans — say which with "
                              "--plan ID.", "which_plan")
            plan_id = next(iter(plans))
    data, logs = remote_ledger(store, remote, plan_id)
    return data, None, logs


def check_remote_logs(run_logs, logs):
    """check_run_logs for logs carried in the remote's commits."""
    missing, bad = 0, []
    for lineno, log, digest in run_logs:
        content = logs.get(log)
        if content is None:
            missing += 1
        elif sha256_hex(content) != digest:
            bad.append(f"event {lineno}: the log its commit carries does not match the sha256 "
                       "recorded for that run.")
    return missing, bad


def cmd_release(ctx, a):
    with open_plan(ctx) as s:
        plan = s.require_plan()
        plan = publish(s, claim=True, fetch_first=True)  # release what the remote says is held
        story = find_story(plan, a.id)
        holder = story["agent"]
        s.commit("story_released", id=a.id, note=check_text("--note", a.note), agent=holder)
        publish(s, claim=True)
        plan = s.plan
    ctx.say(f"fablize: {a.id} released from agent {one_line(holder or 'unnamed')} → pending (its "
            "round is given back; the release is recorded in the ledger).")
    ctx.data.update(story=story_json(plan, find_story(plan, a.id)), released_from=holder)


# Branches that merge: a merge driver for committed plans ####################
#
# Two branches that each replace or advance the committed plan change the same two files. Git
# asks the driver (installed by `install-merge`: one .gitattributes line, one git config entry)
# for the merged content of each. The same plan advanced further on one side: that side. Two
# different plans: the one created later stays current and the other's whole ledger is carried
# in one appended `plan_merged` event, replayed by audit, so both audit with their pins. The
# snapshot of the current plan is then one event behind: the next command rolls it forward.

MERGE_ATTRIBUTE = "merge=fablize"


def merged_pin(lines, since_seq, since_hash):
    """Whether a `--since` pin names a line of a plan carried in by a plan_merged event."""
    for line in lines:
        if b'"plan_merged"' not in line:
            continue
        ev = parse_event(line)
        if ev is None or ev.get("event") != "plan_merged" or not isinstance(ev.get("lines"), list):
            continue
        inner = [x.encode("utf-8") for x in ev["lines"] if isinstance(x, str)]
        for i, raw in enumerate(inner, 1):
            if (since_seq is None or since_seq == i) and sha256_hex(raw) == since_hash:
                return True
        if merged_pin(inner, since_seq, since_hash):
            return True
    return False


def merge_ledgers(ours, theirs):
    """The merged ledger.jsonl, or a refusal (git then leaves the conflict to a human)."""
    lo, lt = ours.splitlines(), theirs.splitlines()
    if not lo or not lt:
        return ours or theirs
    if lo[0] == lt[0]:
        if lt[:len(lo)] == lo:
            return theirs
        if lo[:len(lt)] == lt:
            return ours
        at = next(i for i, (x, y) in enumerate(zip(lo, lt), 1) if x != y)
        raise refused(f"both branches advanced the same plan differently (from event {at}); "
                      "keep one side: `git checkout --ours .fablize/` or `--theirs`.", "diverged")
    mine, other = audit_ledger(ours, None)["plan"], audit_ledger(theirs, None)["plan"]
    if (other["created"], other["plan_id"]) > (mine["created"], mine["plan_id"]):
        (mine, lo, ours), (other, lt, theirs) = (other, lt, theirs), (mine, lo, ours)
    ev = {"seq": mine["ledger"]["seq"] + 1, "ts": now_iso(), "event": "plan_merged",
          "plan_id": other["plan_id"], "events": len(lt), "head": other["ledger"]["head"],
          "lines": [x.decode("utf-8") for x in lt], "prev": mine["ledger"]["head"]}
    apply_event(mine, ev)
    return ours + dumps(ev).encode("utf-8") + b"\n"


def merge_snapshots(ours, theirs):
    """goals.json of the plan merge_ledgers keeps current (same rule, read from the snapshot)."""
    try:
        so, st = load_json(ours), load_json(theirs)
        ko = (so["plan_id"], so["ledger"]["seq"], so["created"])
        kt = (st["plan_id"], st["ledger"]["seq"], st["created"])
    except (ValueError, KeyError, TypeError):
        raise damaged(f"{SNAPSHOT}: one side is not a fablize snapshot.", "bad_snapshot")
    if ko[0] == kt[0]:
        if ko[1] == kt[1]:
            raise refused("both branches changed the same plan's snapshot at the same event.",
                          "diverged")
        return ours if ko[1] > kt[1] else theirs
    return ours if (ko[2], ko[0]) > (kt[2], kt[0]) else theirs


def merge_run_log(path, ours, theirs):
    """Two different logs at one runs/ path: the current plan's (the side merge_ledgers keeps).
    Their branch is named only by the GITHEAD_<commit> variable `git merge` sets."""
    heads = [k[len("GITHEAD_"):] for k in os.environ if re.fullmatch(r"GITHEAD_[0-9a-f]{40,64}", k)]
    ledger = path.rsplit("/" + RUNS + "/", 1)[0] + "/" + LEDGER
    if len(heads) != 1:
        raise refused(f"{one_line(path)}: both branches wrote a different run log here, and this "
                      "is not a `git merge` of one branch.", "conflict")
    sides = []
    for rev in ("HEAD", heads[0]):
        p = git(".", "show", f"{rev}:{ledger}")
        sides.append(p.stdout if p.returncode == 0 else b"")
    if not all(sides):
        raise refused(f"{one_line(path)}: a side has no {LEDGER} to tell whose run it is.",
                      "conflict")
    merged = merge_ledgers(*sides)
    if merged == sides[1] or (merged != sides[0] and not merged.startswith(sides[0])):
        return theirs
    return ours


def cmd_merge_driver(ctx, a):
    ours, theirs = (read_state_file(p) or b"" for p in (a.ours, a.theirs))
    name = os.path.basename(a.path or "")
    if ours == theirs:
        return
    if name == LEDGER:
        merged = merge_ledgers(ours, theirs)
    elif name == SNAPSHOT:
        merged = merge_snapshots(ours, theirs)
    elif f"/{RUNS}/" in "/" + (a.path or "") and name.endswith(".log"):
        merged = merge_run_log(a.path, ours, theirs)
    else:
        raise refused(f"{one_line(a.path)}: both branches changed it and only {LEDGER} and "
                      f"{SNAPSHOT} merge by replay.", "conflict")
    write_file_atomic(a.ours, merged)
    ctx.out.warn(f"merged {one_line(a.path)} by replay.")


def cmd_install_merge(ctx, a):
    store = ctx.store
    root = store.root
    if git(root, "rev-parse", "--git-dir").returncode != 0:
        raise refused(f"{root} is not a git repository.", "no_git_repo")
    rel = os.path.relpath(store.dir, root).replace(os.sep, "/")
    if rel.startswith(".."):
        raise refused("the state directory is outside the repository: nothing to merge.",
                      "outside_repository")
    line = f"/{rel}/** {MERGE_ATTRIBUTE}"
    path = os.path.join(root, ".gitattributes")
    if os.path.islink(path):
        raise symlink_refusal(path)
    old = read_state_file(path) or b""
    if line.encode() not in old.splitlines():
        write_file_atomic(path, old + (b"" if not old or old.endswith(b"\n") else b"\n")
                          + line.encode() + b"\n")
    driver = f"{ctx.cli} merge-driver %O %A %B %P"
    git_out(root, "config", "merge.fablize.name", "fablize: plans merge by replay")
    git_out(root, "config", "merge.fablize.driver", driver)
    ctx.say(f"fablize: .gitattributes has `{line}` (commit it); this clone's git config runs "
            f"`{driver}` for those files.")
    ctx.data.update(attribute=line, driver=driver)


# Commands ###################################################################
#
# Each command is a thin wrapper: it reads the plan under the lock, builds events,
# lets apply_event judge them, and says what happened. ctx.say prints human text;
# ctx.data becomes the --json object.

PLAN_EXISTS = "a plan already exists. Check it with `status`, or replace it with --force."


def has_plan_files(store):
    if os.path.lexists(store.path(SNAPSHOT)):
        return True
    try:
        return os.lstat(store.path(LEDGER)).st_size > 0
    except FileNotFoundError:
        return False


def open_plan(ctx, exclusive=True):
    """A session on an existing plan; refuses with the original message when there is none."""
    if not ctx.store.exists():
        raise refused("no plan — run `create` first.", "no_plan")
    return ctx.store.session(exclusive)


def parse_goal(value, number):
    if "::" not in value:
        raise usage(f"--goal format is 'title::objective' — invalid: {one_line(value)}", "bad_goal")
    title, objective = value.split("::", 1)
    return {"id": story_id(number), "title": check_text("a title", title.strip()),
            "objective": check_text("an objective", objective.strip()),
            "after": [], "checks": [], "accept": [], "judge": False}


def parse_ids(text, option):
    ids = [part.strip().upper() for part in text.split(",") if part.strip()]
    for sid in ids:
        if not re.fullmatch(r"G[0-9]{3,}", sid):
            raise usage(f"{option}: {one_line(sid)} is not a story id (G001, G002, …).", "bad_id")
    return ids


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
        target("--check", sid)["checks"].append(check_text("a check", cmd))
    for cmd in a.verify:
        if blank(cmd):
            raise usage("--verify needs a command.", "blank_check")
        specs[-1]["checks"].append(check_text("a check", cmd))
    for value in a.accept:
        sid, text = split_assignment("--accept", value)
        if blank(text):
            raise usage(f"--accept {sid}= needs the item's text.", "blank_item")
        target("--accept", sid)["accept"].append(check_text("an acceptance item", text))
    for value in a.judge or []:
        for sid in ([s["id"] for s in specs] if value == "ALL" else parse_ids(value, "--judge")):
            target("--judge", sid)["judge"] = True
    specs[-1]["after"] = [s["id"] for s in specs[:-1]]  # the gate waits for everything
    return specs


def say_unverifiable(ctx, found):
    if not found:
        return
    ctx.say(f"fablize: ⚠ {len(found)} frozen check(s) cannot run here — fix now; found at the gate "
            "it costs the whole run:")
    for u in found:
        ctx.say(f"  {u['id']} check {u['check'] + 1}: `{one_line(u['cmd'])}` — {one_line(u['reason'])}")


def cmd_create(ctx, a):
    store = ctx.store
    if not a.force and store.exists() and has_plan_files(store):
        raise refused(PLAN_EXISTS, "plan_exists")
    check_text("--brief", a.brief)
    remote = check_remote(store, a.remote) if a.remote else None  # Sharing
    specs = build_stories(a)
    unverifiable = unverifiable_checks(specs, store.root)
    fields = {"brief": a.brief, "count": len(specs), "plan_id": new_plan_id(), "stories": specs,
              "options": {"rounds": a.rounds, "require_run": a.require_run},
              "unverifiable": unverifiable}
    # judge the new plan before anything moves: a bad one must not archive the old one
    apply_event(None, dict(fields, seq=1, ts=now_iso(), event="plan_created"))
    store.create_dir()
    with store.session() as s:
        replaces = None
        if has_plan_files(store):
            if not a.force:
                raise refused(PLAN_EXISTS, "plan_exists")
            replaces = s.replace_plan(fields)
        else:
            s.commit("plan_created", **fields, replaces=None)
        plan = s.plan
    ctx.say(f"fablize: plan created — {len(specs)} stories")
    for story in plan["goals"]:
        ctx.say(f"  {story['id']} {defused_line(story['title'])}: {defused_line(story['objective'])}")
    if replaces:
        ctx.say(f"fablize: the previous plan {replaces['plan_id']} is kept whole in "
                f"{replaces['path']}/ (head {replaces['head']}).")
    say_unverifiable(ctx, unverifiable)
    ctx.data.update(plan=plan_json(plan), replaces=replaces)
    if remote:
        start_sharing(ctx, remote)  # Sharing: publish the new plan's ledger


def stuck_error(ctx, plan, agent):
    """Why `next` has nothing to hand out (the plan is not done)."""
    active = active_stories(plan)
    blocked = [s for s in plan["goals"] if s["status"] == "blocked"]
    review = [s for s in plan["goals"] if s["status"] == "review"]
    if blocked:
        s = blocked[0]
        reason = one_line(last_chars(s["blocked_reason"] or "no reason given", 200))
        held = f" ({', '.join(x['id'] for x in active)} still in progress)" if active else ""
        return refused(f"{s['id']} is blocked ({reason}) — the plan halts here: nothing that depends "
                       f"on it can start{held}. A human must decide: {ctx.prog} decide --id "
                       f"{s['id']} accept|retry|amend --note \"…\"", "halted")
    if review:
        s = review[0]
        return refused(f"{s['id']} awaits an independent judge (review); nothing else is ready. "
                       f"Judge it: {ctx.prog} judge-packet --id {s['id']}", "awaiting_review")
    if active:
        held = ", ".join(f"{s['id']} ({one_line(s['agent'] or 'no agent')})" for s in active)
        return refused(f"nothing is ready for agent {one_line(agent)}: in progress {held}; the rest "
                       "waits for them.", "nothing_ready")
    return refused("nothing is ready.", "nothing_ready")


def cmd_next(ctx, a):
    agent = a.agent
    if agent is not None and blank(agent):
        raise usage("--agent needs a name.")
    with open_plan(ctx) as s:
        s.require_plan()
        plan = publish(s, claim=True, fetch_first=True)  # Sharing: see other machines' claims
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
                    ctx.data.update(done=True, story=None, plan=plan_json(plan))
                    return
                raise stuck_error(ctx, plan, agent)
            story = claim_story(s, story, agent)  # Sharing: on the remote before it is handed out
            plan = s.plan
    lines = render_handoff(ctx, plan, story, reshown)
    for line in lines:
        ctx.say(line)
    ctx.data.update(done=False, activated=not reshown, story=story_json(plan, story),
                    handoff="\n".join(clean(x) for x in lines))


def say_after_checkpoint(ctx, plan, story):
    sid = story["id"]
    status = story["status"]
    if status == "failed":
        ctx.say(f"fablize: {sid} → failed (round {story['round']}; {rounds_left(plan, story)} left) — "
                f"`{ctx.prog} next` reopens it as round {story['round'] + 1} with what was missing.")
    elif status == "blocked":
        ctx.say(f"fablize: {sid} → blocked — a human must decide: {ctx.prog} decide --id {sid} "
                "accept|retry|amend --note \"…\"")
    elif status == "review":
        ctx.say(f"fablize: {sid} → review — an independent judge decides: {ctx.prog} judge-packet "
                f"--id {sid}")
    else:
        ctx.say(f"fablize: {sid} → {status}")
    if plan_done(plan):
        ctx.say(done_line(plan))
        return
    left = [s for s in plan["goals"] if s["status"] not in DONE]
    blocked = [s["id"] for s in left if s["status"] == "blocked"]
    if blocked:
        ctx.say(f"fablize: {len(left)} stories left — {', '.join(blocked)} blocked: what depends on "
                f"it waits for a human decision: {ctx.prog} decide --id {blocked[0]} "
                "accept|retry|amend --note \"…\"")
    elif active_stories(plan) or pick_ready(plan):
        ctx.say(f"fablize: {len(left)} stories left — continue with `next`.")
    else:
        ctx.say(f"fablize: {len(left)} stories left — next: {next_step(ctx, plan)}")


def cmd_checkpoint(ctx, a):
    ev = {"id": a.id, "status": a.status, "evidence": check_text("--evidence", a.evidence),
          "verify_cmd": check_text("--verify-cmd", a.verify_cmd),
          "verify_evidence": check_text("--verify-evidence", a.verify_evidence)}
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
        if a.status == "complete":
            if story["checks"]:
                commands = list(enumerate(story["checks"]))
                if not blank(a.verify_cmd) and a.verify_cmd not in story["checks"]:
                    ctx.out.warn(f"{a.id} has frozen checks: they run instead of --verify-cmd, "
                                 "which is recorded as a claim only.")
                ev.pop("run", None)
            elif a.run:
                commands = [(None, a.verify_cmd)]
        if not commands:
            s.commit("checkpoint", **ev)
            plan = s.plan
    runs = []
    if commands:
        records = execute_runs(ctx, ctx.store, a.id, commands, plan["ledger"]["seq"])
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
                    e.message += (f" The run is recorded (event {r['seq']}, log {r['log']}); "
                                  f"{a.id} stays in progress: fix it and checkpoint again.")
                    e.code = "verification_failed"
                raise
            plan = s.plan
    story = find_story(plan, a.id)
    say_after_checkpoint(ctx, plan, story)
    ctx.data.update(story=story_json(plan, story), runs=runs, done=plan_done(plan))


def cmd_status(ctx, a):
    if not ctx.store.exists():
        if a.resume:
            return
        raise refused("no plan — run `create` first.", "no_plan")
    with ctx.store.session() as s:
        plan = s.load()
        share = share_status(s.store, plan)  # Sharing: None for a local plan
    if plan is None:
        if a.resume:
            return
        raise refused("no plan — run `create` first.", "no_plan")
    done = sum(1 for x in plan["goals"] if x["status"] in DONE)
    ctx.say(f"fablize: {done}/{len(plan['goals'])} complete — {defused_line(plan['brief'])}")
    for story in plan["goals"]:
        ctx.say(f"  {MARKS[story['status']]} {story['id']} [{story['status']}] {defused_line(story['title'])}")
        for detail in status_details(plan, story):
            ctx.say(f"      {detail}")
    for u in plan["unverifiable"]:
        ctx.say(f"  ⚠ {u['id']} check {u['check'] + 1} cannot run here: `{one_line(u['cmd'])}` — "
                f"{one_line(u['reason'])}")
    step = next_step(ctx, plan)
    ctx.say(done_line(plan) if step is None else f"fablize: next — {step}")
    say_share_status(ctx, share)
    if a.resume:
        for story in active_stories(plan):
            ctx.say("")
            for line in render_handoff(ctx, plan, story, True):
                ctx.say(line)
    if ctx.json:
        ctx.data.update(plan_json(plan))


def cmd_verify(ctx, a):
    with open_plan(ctx) as s:
        plan = s.require_plan()
        story = find_story(plan, a.id)
        if story["checks"]:
            commands = list(enumerate(story["checks"]))
        elif not blank(a.verify_cmd):
            commands = [(None, a.verify_cmd)]
        else:
            raise refused(f"{a.id} has no frozen checks — give --verify-cmd to run a command.",
                          "no_checks")
        after_seq = plan["ledger"]["seq"]
    records = execute_runs(ctx, ctx.store, a.id, commands, after_seq)
    with open_plan(ctx) as s:
        s.require_plan()
        runs = commit_runs(s, records)
    ctx.data["runs"] = runs
    failed = [r for r in runs if not run_passed(r)]
    if failed:
        raise refused(f"{a.id}: {len(failed)} of {len(runs)} check(s) failed — first: "
                      f"{run_summary(failed[0])} (log {failed[0]['log']}).", "verification_failed")
    ctx.say(f"fablize: {a.id}: all {len(runs)} check(s) passed (status unchanged: "
            f"{find_story(s.plan, a.id)['status']}).")


def cmd_decide(ctx, a):
    with open_plan(ctx) as s:
        s.require_plan()
        s.commit("decision", id=a.id, decision=a.decision, note=check_text("--note", a.note))
        plan = s.plan
    story = find_story(plan, a.id)
    what = {"accept": "accepted — counts as done", "retry": "back to work, rounds reset",
            "amend": "objective amended, back to work"}[a.decision]
    ctx.say(f"fablize: {a.id} → {story['status']} ({what}; decision recorded in the ledger).")
    step = next_step(ctx, plan)
    ctx.say(done_line(plan) if step is None else f"fablize: next — {step}")
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
            spec["checks"].append(check_text("a check", cmd))
        spec["accept"] = [check_text("an acceptance item", t) for t in a.accept if not blank(t)]
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


def cmd_audit(ctx, a):
    if a.remote:  # Sharing: the plan as the remote holds it, no local state needed
        data, snapshot, logs = audit_remote_source(ctx, a)
    else:
        with open_plan(ctx, exclusive=False) as s:
            s.refuse_original()
            data = s.store.ledger_bytes()
            snapshot = read_state_file(s.store.path(SNAPSHOT))
    report = audit_ledger(data, snapshot, a.since, a.require_independent_judge)
    plan = report.pop("plan")
    missing_logs, bad_logs = check_remote_logs(report.pop("run_logs"), logs) if a.remote else \
        check_run_logs(ctx.store, report.pop("run_logs"))
    if bad_logs:
        raise damaged(bad_logs[0], "run_log_mismatch")
    report.update(missing_logs=missing_logs, complete=plan_done(plan),
                  done=sum(1 for x in plan["goals"] if x["status"] in DONE),
                  total=len(plan["goals"]), brief=plan["brief"])
    ctx.data.update(report)
    ctx.say(f"fablize: audit ok — {report['events']} events, hash chain intact, every event legal "
            f"when replayed; snapshot {report['snapshot']}.")
    ctx.say(f"  head: {report['head']}   (keep it; `audit --since` proves later history only grew)")
    ctx.say(f"  plan: {report['done']}/{report['total']} done — {defused_line(plan['brief'])}")
    if report["torn_tail_bytes"]:
        ctx.say(f"  torn tail: {report['torn_tail_bytes']} bytes after the last event — a write that "
                "never completed; the next writing command moves it aside.")
    if missing_logs:
        ctx.say(f"  {missing_logs} run log(s) not present here (not committed?); their digests are "
                "in the ledger.")
    if report["independence"]:
        raise refused("audit: a verdict was not given by an independent judge — "
                      + "; ".join(report["independence"]), "judge_not_independent")
    if a.require_logs and missing_logs:
        raise refused(f"audit: {missing_logs} verification run log(s) are missing, so those runs "
                      "cannot be shown to have happened — commit .fablize/runs/.", "missing_logs")
    if a.require_complete and not report["complete"]:
        left = [f"{x['id']} [{x['status']}]" for x in plan["goals"] if x["status"] not in DONE]
        raise refused("audit: trusted but incomplete — " + ", ".join(left), "incomplete")


def check_run_logs(store, run_logs):
    """Compare each run's recorded digest with its log file where the file exists; `run_logs`
    is audit's list of (line, log path, sha256)."""
    missing, bad = 0, []
    for lineno, log, digest in run_logs:
        path = os.path.join(store.dir, log)
        if os.path.commonpath([os.path.abspath(path), store.dir]) != store.dir:
            bad.append(f"{LEDGER} line {lineno}: run log path {one_line(log)} leaves the state "
                       "directory.")
            continue
        try:
            content = read_state_file(path)
        except FablizeError as e:
            bad.append(f"{LEDGER} line {lineno}: {e.message}")
            continue
        if content is None:
            missing += 1
        elif sha256_hex(content) != digest:
            bad.append(f"{LEDGER} line {lineno}: {log} does not match the sha256 recorded for "
                       "that run — the log was edited or replaced.")
    return missing, bad


def cmd_rebuild(ctx, a):
    with open_plan(ctx) as s:
        s.refuse_original()
        fd = s.ledger_fd()
        if fd is None:
            raise refused("no plan — run `create` first.", "no_plan")
        old = loose_snapshot(s.store)
        position = old.get("ledger") if old else None
        # a last line the old snapshot reflects was acknowledged: damage, not a torn write
        reflected = position if isinstance(position, dict) and type(position.get("seq")) is int \
            else {"seq": 0}
        s.cut_torn_tail(fd, {"ledger": reflected})
        report = audit_ledger(s.store.ledger_bytes(), None)
        plan = report["plan"]
        target = s.store.path(SNAPSHOT)
        kept = None
        if os.path.lexists(target):
            kept = os.path.basename(free_name(
                f"{target}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.bak"))
            os.replace(target, s.store.path(kept))
        s.save_snapshot(plan)
    ctx.say(f"fablize: rebuilt {SNAPSHOT} from {report['events']} ledger events"
            + (f"; the old one is kept as {kept}." if kept else "."))
    ctx.data.update(events=report["events"], kept=kept, plan=plan_json(plan))


def cmd_log(ctx, a):
    with open_plan(ctx, exclusive=False) as s:
        s.refuse_original()
        data = s.store.ledger_bytes()
    events = []
    for lineno, line in enumerate(data.split(b"\n")[:-1], 1):
        ev = parse_event(line)
        if ev is None:
            raise damaged(f"{LEDGER} line {lineno} is not a ledger event — run `goals.py audit`.",
                          "bad_line")
        check_event(ev, lineno)
        if a.id is None or ev.get("id") == a.id or \
                (ev["event"] == "story_added" and ev.get("story", {}).get("id") == a.id) or \
                (ev["event"] == "plan_created" and a.id is not None):
            events.append(ev)
    if not events:
        raise refused("no plan — run `create` first.", "no_plan")
    if a.id is not None and len(events) == 1:
        raise refused(f"{a.id} not found.", "not_found")  # only plan_created names no story
    for ev in events:
        ctx.say(format_event(ev))
    ctx.data["events"] = events


def guard_verdict(ctx, payload):
    """(reason to block or None, message for the user or None) for a Stop hook."""
    cwd = payload.get("cwd") if isinstance(payload.get("cwd"), str) else os.getcwd()
    if ctx.args.dir is None and not os.environ.get("FABLIZE_DIR"):
        ctx.store = Store(*find_state_dir(None, cwd), ctx.out)
    if not ctx.store.exists():
        return None, None
    with ctx.store.session() as s:
        plan = s.load()
        if plan is None or plan_done(plan):
            return None, None
        active = active_stories(plan)
        ready = pick_ready(plan)
        if not active and ready is None:
            return None, None  # halted on a blocked story or a verdict: a human's or judge's turn
        limit = guard_limit()
        repeat = payload.get("stop_hook_active") is True
        blocks = plan["guard"]["blocks"] if repeat else 0
        if blocks >= limit:
            return None, (f"fablize guard: let the agent stop after {blocks} blocks in a row; the "
                          "plan is not finished — run `status`.")
        cli = ctx.cli
        if active:
            story = active[0]
            reason = (f"fablize: {story['id']} \"{defused_line(story['title'])}\" is still in progress. "
                      f"Finish it, then run: {cli} checkpoint --id {story['id']} --status complete "
                      "--evidence \"<what you did and saw>\" (or --status failed / blocked with "
                      "the reason).")
        else:
            reason = (f"fablize: the plan is not finished — {ready['id']} \"{defused_line(ready['title'])}\""
                      f" is ready. Run: {cli} next")
        reason += f" [guard block {blocks + 1} of at most {limit} in a row]"
        s.commit("guard_block", reason=reason, fresh=not repeat)
        return reason, None


def guard_limit():
    raw = os.environ.get("FABLIZE_GUARD_MAX", str(DEFAULT_GUARD_MAX))
    return int(raw) if raw.isascii() and raw.isdigit() else DEFAULT_GUARD_MAX


def cmd_guard(ctx, a):
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
    if not isinstance(payload, dict):
        return  # empty or malformed input never blocks
    try:
        reason, message = guard_verdict(ctx, payload)
    except FablizeError as e:  # damaged state or a busy lock: say so, never trap the agent
        reason, message = None, f"fablize guard: {e.message}"
    if reason:
        ctx.emit_raw({"decision": "block", "reason": reason})
    elif message:
        ctx.emit_raw({"systemMessage": message})
    else:
        ctx.emit_raw(None)


def md_cell(text, limit=120):
    text = one_line(last_chars(text or "", limit) if len(text or "") > limit else text or "")
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("`", "'")


def render_report(plan, runs):
    goals = plan["goals"]
    done = sum(1 for s in goals if s["status"] in DONE)
    filled = round(20 * done / len(goals))
    lines = [f"# fablize report — {md_cell(plan['brief'], 200)}", "",
             f"`{'█' * filled}{'░' * (20 - filled)}` **{done}/{len(goals)} done** "
             f"({100 * done // len(goals)}%)" + (" — all stories complete ✓" if plan_done(plan) else ""),
             "", "| Story | Title | Status | Rounds | Evidence |", "|---|---|---|---|---|"]
    for s in goals:
        lines.append(f"| {s['id']} | {md_cell(s['title'], 80)} | {MARKS[s['status']]} {s['status']} "
                     f"| {s['round']} | {md_cell(s['evidence'])} |")
    if runs:
        lines += ["", "## Verification runs", "",
                  "| Event | Story | Command | Result | Duration | Output sha256 |", "|---|---|---|---|---|---|"]
        for r in runs:
            lines.append(f"| {r['seq']} | {r['id']} | `{md_cell(r['cmd'], 80)}` | "
                         f"{'pass' if run_passed(r) else 'FAIL'}: {md_cell(describe_exit(r))} | "
                         f"{r.get('duration_s')} s | `{str(r.get('sha256'))[:16]}` |")
    lines += ["", "## Stories and dependencies", "", "```mermaid", "graph TD"]
    for s in goals:
        label = md_cell(s["title"], 40).replace('"', "#quot;")
        lines.append(f"  {s['id']}[\"{s['id']} {label}\"]:::{s['status']}")
    for s in goals:
        for dep in s["after"]:
            lines.append(f"  {dep} --> {s['id']}")
    colours = {"complete": "#c8e6c9", "accepted": "#dcedc8", "in_progress": "#fff59d",
               "pending": "#eeeeee", "failed": "#ffcdd2", "blocked": "#ef9a9a", "review": "#bbdefb"}
    lines += [f"  classDef {k} fill:{v}" for k, v in colours.items()]
    lines += ["```", "", f"Ledger head: `{plan['ledger']['seq']}:{plan['ledger']['head']}` "
              f"(plan `{plan['plan_id']}`)", ""]
    return "\n".join(lines)


def cmd_report(ctx, a):
    with open_plan(ctx, exclusive=False) as s:
        plan = s.require_plan()
        data = s.store.ledger_bytes()
    runs = []
    for lineno, line in enumerate(data.split(b"\n"), 1):
        ev = parse_event(line) if b'"verify_run"' in line else None
        if ev and ev["event"] == "verify_run":
            check_event(ev, lineno)
            runs.append(ev)
    text = render_report(plan, runs)
    target = a.out or os.environ.get("GITHUB_STEP_SUMMARY")
    if target:
        with open(target, "wb" if a.out else "ab+") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")  # a heading must start its own line
            f.write(text.encode("utf-8"))
        ctx.say(f"fablize: report written to {target}")
    else:
        ctx.say(text)
    ctx.data.update(markdown=text, path=target)


def cmd_judge_packet(ctx, a):
    with open_plan(ctx, exclusive=False) as s:
        plan = s.require_plan()
    story = find_story(plan, a.id)
    items = [{"kind": "check", "text": cmd, "run": _fresh_ok_run(story, check=i) or next(
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
    lines.append(indent(defuse(story["evidence"])) if not blank(story["evidence"]) else "    (none)")
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
        f"{ctx.prog} verdict --id {sid} achieved --evidence \"<what you checked and saw>\" --agent <you>",
        f"{ctx.prog} verdict --id {sid} not-achieved --evidence \"<what is missing, not how to fix "
        "it>\" --agent <you>",
        f"{ctx.prog} verdict --id {sid} unachievable --evidence \"<why more rounds cannot help>\" "
        "--agent <you>",
    ]
    lines += ["How to judge:"] + [f"  - {x}" for x in instructions] + [f"    {x}" for x in verdicts]
    for line in lines:
        ctx.say(line)
    ctx.data.update(id=sid, status=story["status"], round=story["round"],
                    objective=story["objective"], amendments=story["amendments"],
                    checklist=items, evidence=story["evidence"], runs=story["runs"],
                    instructions=instructions, verdicts=verdicts)


def cmd_verdict(ctx, a):
    with open_plan(ctx) as s:
        s.require_plan()
        s.commit("verdict", id=a.id, verdict=a.verdict, evidence=check_text("--evidence", a.evidence),
                 agent=a.agent)
        plan = s.plan
    story = find_story(plan, a.id)
    say_after_checkpoint(ctx, plan, story)
    ctx.data.update(story=story_json(plan, story))


def render_block(cli):
    return BLOCK_TEMPLATE.format(cli=cli)


def install_block(text, block, remove=False):
    """`text` with exactly one fablize block (replaced in place, or appended), or without it.
    Appending adds one newline before the block when the file does not end a line with a blank
    one; removal takes that newline back, so remove(install(x)) == x."""
    begin = text.find(BLOCK_BEGIN)
    if begin >= 0:
        end = text.find(BLOCK_END, begin)
        if end < 0 or text.find(BLOCK_BEGIN, begin + 1) >= 0:
            raise refused("the file has a broken or repeated fablize block (begin/end markers do "
                          "not pair) — fix it by hand.", "bad_block")
        end += len(BLOCK_END)
        if text[end:end + 1] == "\n":
            end += 1
        if not remove:
            return text[:begin] + block + text[end:]
        if end == len(text) and begin > 0 and text[begin - 1] == "\n":
            begin -= 1
        return text[:begin] + text[end:]
    if remove:
        return text
    return text + ("\n" if text else "") + block


def cmd_install_block(ctx, a):
    target = a.file
    if target is None:
        target = os.path.join(ctx.store.root, "CLAUDE.md")
    target = os.path.abspath(target)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise refused(f"{target} is a symlink — refusing to write through it.", "symlink")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise refused(f"{target} is not a regular file.", "not_a_file")
    raw = read_state_file(target) if st is not None else b""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise refused(f"{target} is not UTF-8 text — refusing to edit it.", "not_text")
    if "\x00" in text:
        raise refused(f"{target} is not text (it holds NUL bytes) — refusing to edit it.", "not_text")
    new = install_block(text, render_block(ctx.cli), a.remove)
    if new == text:
        ctx.say(f"fablize: {target} already {'has no' if a.remove else 'has this'} fablize block; "
                "nothing changed.")
        ctx.data.update(path=target, changed=False)
        return
    directory = os.path.dirname(target)
    backup = None
    if st is not None:
        backup = target + ".fablize-backup"
        if os.path.islink(backup):
            raise refused(f"{backup} is a symlink — refusing to write through it.", "symlink")
        write_file_atomic(backup, raw)
    write_file_atomic(target, new.encode("utf-8"), st.st_mode & 0o7777 if st else 0o644)
    fsync_dir(directory)
    verb = "removed the fablize block from" if a.remove else "installed the fablize block in"
    ctx.say(f"fablize: {verb} {target}" + (f" (previous file kept as {backup})" if backup else ""))
    ctx.data.update(path=target, changed=True, backup=backup)


def write_file_atomic(path, data, mode=0o644):
    tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_BINARY, mode)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        os.unlink(tmp)
        raise


# Command line ###############################################################


class Output:
    """Human text to stdout as it happens, or one JSON object at the end (--json)."""

    def __init__(self, json_mode):
        self.json = json_mode
        self.data = {}
        self.warnings = []
        self.raw = False

    def say(self, text=""):
        if not self.json:
            sys.stdout.write(clean(text) + "\n")

    def warn(self, text):
        self.warnings.append(text)
        sys.stderr.write("fablize: warning: " + clean(text) + "\n")


class Context:
    def __init__(self, args, out):
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
        console = os.path.basename(sys.argv[0] or "") == "fablize"
        self.prog = "fablize" if console else "goals.py"
        # the exact command a hook or CLAUDE.md can run from anywhere
        self.cli = "fablize" if console else \
            "python3 " + quote_path(os.path.abspath(__file__))
        self._store = None

    @property
    def store(self):
        if self._store is None:
            self._store = Store(*find_state_dir(self.args.dir, os.getcwd()), self.out)
        return self._store

    @store.setter
    def store(self, value):
        self._store = value

    def emit_raw(self, obj):
        """Hook output: exactly this object (or nothing), whatever --json says."""
        self.out.raw = True
        if obj is not None:
            sys.stdout.write(json_text(obj) + "\n")


def quote_path(path):
    return path if re.fullmatch(r"[\w./:@+-]+", path) else "'" + path.replace("'", "'\\''") + "'"


def add_create(command):
    c = command("create", cmd_create, "create a plan of sequential stories (the last one is the "
                "verification gate)")
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
    c.add_argument("--remote", metavar="NAME",
                   help="share the new plan through this git remote (see `share`)")


def add_next(command):
    c = command("next", cmd_next, "activate the next ready story and print its handoff (or "
                "re-print the one in progress)")
    c.add_argument("--agent", metavar="NAME",
                   help="claim a ready story for this agent (one active story per agent)")


def add_timeout(c):
    c.add_argument("--timeout", type=float, metavar="SECONDS",
                   help=f"limit for each run; the whole process group is killed at expiry "
                        f"(default {DEFAULT_RUN_TIMEOUT:g})")


def add_checkpoint(command):
    c = command("checkpoint", cmd_checkpoint, "record a story's result: complete needs evidence; "
                "the final story needs verification")
    c.add_argument("--id", required=True, help="the story, e.g. G001")
    c.add_argument("--status", required=True, choices=["complete", "failed", "blocked"],
                   help="complete (achieved), failed (not achieved: another round), blocked "
                        "(cannot be achieved: a human decides)")
    c.add_argument("--evidence", default="", help="what was done and what shows it")
    c.add_argument("--verify-cmd", dest="verify_cmd", default="",
                   help="the verification command that was run (final story)")
    c.add_argument("--verify-evidence", dest="verify_evidence", default="",
                   help="its result (final story; optional with --run)")
    c.add_argument("--run", action="store_true",
                   help="the engine runs --verify-cmd itself and records the run; only exit 0 passes")
    add_timeout(c)
    c.add_argument("--agent", metavar="NAME", help="the agent recording it (must hold the story)")


def add_status(command):
    c = command("status", cmd_status, "show the plan: every story, what it waits for, what to do "
                "next (the first command when resuming)")
    c.add_argument("--resume", action="store_true",
                   help="also print the handoff of each story in progress; print nothing when "
                        "there is no plan (for SessionStart hooks)")


def add_verify(command):
    c = command("verify", cmd_verify, "run a story's frozen checks now, without changing its status")
    c.add_argument("--id", required=True, help="the story")
    c.add_argument("--verify-cmd", dest="verify_cmd", default="",
                   help="a command to run when the story has no frozen checks")
    add_timeout(c)


def add_decide(command):
    c = command("decide", cmd_decide, "a human's call on a blocked, failed or in-review story")
    c.add_argument("--id", required=True, help="the story")
    c.add_argument("decision", choices=DECISIONS,
                   help="accept (counts as done), retry (back to work, rounds reset), amend "
                        "(extend the objective, back to work)")
    c.add_argument("--note", required=True, help="the reason, or the feedback or amendment")


def add_add(command):
    c = command("add", cmd_add, "add a story before the final verification story")
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
    c = command("audit", cmd_audit, "replay the whole ledger and say whether it can be trusted")
    c.add_argument("--require-complete", action="store_true",
                   help="exit 1 unless every story is complete or accepted")
    c.add_argument("--since", metavar="[SEQ:]HASH",
                   help="exit 3 unless the ledger still holds this earlier head (history only grew)")
    c.add_argument("--require-independent-judge", action="store_true",
                   help="exit 1 unless every verdict came from an agent other than the executor")
    c.add_argument("--require-logs", action="store_true",
                   help="exit 1 unless every verification run's log is present (and matches)")
    c.add_argument("--remote", metavar="NAME",
                   help="audit the shared plan as this git remote holds it (fetched; no local "
                        "state needed)")
    c.add_argument("--plan", metavar="ID",
                   help="with --remote: which shared plan (default: the only one)")


def add_rebuild(command):
    command("rebuild", cmd_rebuild, "regenerate goals.json from the ledger (the old one is kept)")


def add_log(command):
    c = command("log", cmd_log, "the plan's history in readable form")
    c.add_argument("--id", help="only this story's events")


def add_guard(command):
    command("guard", cmd_guard, "Claude Code Stop hook: block stopping while the plan has work "
            "(reads the hook JSON on stdin)")


def add_report(command):
    c = command("report", cmd_report, "a Markdown summary for a pull request or CI job summary")
    c.add_argument("--out", metavar="FILE",
                   help="write it here (default: append to $GITHUB_STEP_SUMMARY when set, else stdout)")


def add_judge_packet(command):
    c = command("judge-packet", cmd_judge_packet, "what an independent judge needs to judge a story")
    c.add_argument("--id", required=True, help="the story")


def add_verdict(command):
    c = command("verdict", cmd_verdict, "an independent judge's verdict on a story in review")
    c.add_argument("--id", required=True, help="the story")
    c.add_argument("verdict", choices=VERDICTS,
                   help="achieved (complete), not-achieved (another round with what is missing), "
                        "unachievable (blocked: a human decides)")
    c.add_argument("--evidence", required=True, help="what you checked and saw, or what is missing")
    c.add_argument("--agent", required=True, help="who judged (must not be the executor)")


def add_install_block(command):
    c = command("install-block", cmd_install_block, "put the fablize block into CLAUDE.md or "
                "AGENTS.md (again: replace it in place)")
    c.add_argument("file", nargs="?", help="the file (default: CLAUDE.md at the repository root)")
    c.add_argument("--remove", action="store_true", help="take the block out again")


def add_share(command):
    c = command("share", cmd_share, "share this plan through a git remote: its ledger goes to "
                "refs/fablize/plans/<plan id>, and every write publishes there")
    c.add_argument("--remote", required=True, metavar="NAME", help="the git remote, e.g. origin")


def add_sync(command):
    c = command("sync", cmd_sync, "pull the shared plan's new events and publish local ones; on a "
                "fresh clone, bring the shared plan in")
    c.add_argument("--remote", metavar="NAME",
                   help="the git remote (default: the plan's, else origin or the only remote)")
    c.add_argument("--plan", metavar="ID",
                   help="on a fresh clone: which shared plan, when the remote has several")


def add_release(command):
    c = command("release", cmd_release, "end a silent agent's claim on a story in progress "
                "(recorded in the ledger; the story becomes ready again)")
    c.add_argument("--id", required=True, help="the story")
    c.add_argument("--note", required=True, help="why the claim ends (who decided, what was seen)")


def add_merge_driver(command):
    c = command("merge-driver", cmd_merge_driver, "git's merge driver for committed plan files "
                "(git runs it; see `install-merge`)")
    c.add_argument("base", help="the common ancestor's version (%%O)")
    c.add_argument("ours", help="our version, replaced by the merged one (%%A)")
    c.add_argument("theirs", help="their version (%%B)")
    c.add_argument("path", nargs="?", help="the file's path in the repository (%%P)")


def add_install_merge(command):
    command("install-merge", cmd_install_merge, "let `git merge` merge committed plans: one "
            ".gitattributes line (commit it) and the driver in this clone's git config")


COMMANDS = {"create": add_create, "next": add_next, "checkpoint": add_checkpoint,
            "status": add_status, "verify": add_verify, "decide": add_decide, "add": add_add,
            "audit": add_audit, "rebuild": add_rebuild, "log": add_log, "guard": add_guard,
            "report": add_report, "judge-packet": add_judge_packet, "verdict": add_verdict,
            "install-block": add_install_block, "share": add_share, "sync": add_sync,
            "release": add_release, "merge-driver": add_merge_driver,
            "install-merge": add_install_merge}
# one line each in `goals.py --help`; each command's own --help says more
SUMMARIES = {
    "create": "create a plan of sequential stories",
    "next": "activate the next ready story, print its handoff",
    "checkpoint": "record a story's result, with evidence",
    "status": "show the plan and what to do next",
    "verify": "run a story's frozen checks now",
    "decide": "a human's call on a blocked story",
    "add": "add a story before the final one",
    "audit": "check that the whole ledger can be trusted",
    "rebuild": "regenerate goals.json from the ledger",
    "log": "the plan's history, readable",
    "guard": "Stop hook: no stopping while work is left",
    "report": "a Markdown summary for a PR or CI job",
    "judge-packet": "what a judge needs to judge a story",
    "verdict": "a judge's verdict on a story in review",
    "install-block": "put the fablize block into CLAUDE.md",
    "share": "share the plan through a git remote",
    "sync": "pull and publish a shared plan",
    "release": "end a silent agent's claim on a story",
    "merge-driver": "git's merge driver for plan files",
    "install-merge": "let `git merge` merge committed plans",
}
DIR_HELP = ("state directory (default: $FABLIZE_DIR, else .fablize/ found walking up to the "
            "repository root)")
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
        elif token in COMMANDS:
            return token
        elif not (token == "--json" or token.startswith("--dir=")):
            return None
    return None


def build_parser(only=None):
    """The command-line parser: every command, or just `only`."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise usage(f"{message} (see `{self.prog} --help`)")

    common = Parser(add_help=False)
    common.add_argument("--dir", default=argparse.SUPPRESS, metavar="PATH", help=DIR_HELP)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=JSON_HELP)
    class Formatter(argparse.HelpFormatter):
        def __init__(self, prog):
            super().__init__(prog, max_help_position=30)
            self._action_max_length = 20  # room for `install-block` and its line on one row

    p = Parser(prog="goals.py", formatter_class=Formatter,
               description="fablize goal engine: split a task into stories; "
               "\"done\" is refused until evidence shows it.",
               epilog="Exit codes: 0 done, 1 refused, 2 usage, 3 damaged state. "
                      "`goals.py COMMAND --help` shows a command's options.")
    p.add_argument("--version", action="version", version=f"fablize {__version__}",
                   help="print the version and exit")
    p.add_argument("--dir", default=None, metavar="PATH", help=DIR_HELP)
    p.add_argument("--json", action="store_true", default=False, help=JSON_HELP)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)

    def command(name, func, description):
        c = sub.add_parser(name, parents=[common], help=SUMMARIES[name], description=description)
        c.set_defaults(func=func)
        return c

    for name, add in COMMANDS.items():
        if only is None or name == only:
            add(command)
    return p


def utf8_streams():
    """Marks like ✓ ▶ ■ must not crash a cp949 or cp1252 console: write UTF-8 regardless."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if encoding != "utf8" and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(encoding="utf-8", errors="replace")
            except (ValueError, OSError):
                pass


def main(argv=None):
    argv = [fix_argv_text(x) for x in (sys.argv[1:] if argv is None else argv)]
    utf8_streams()
    out = Output("--json" in argv)
    command = None
    try:
        args = build_parser(command_in(argv)).parse_args(argv)
        command = args.command
        out.json = args.json and command != "guard"
        args.func(Context(args, out), args)
        code, error = EXIT_OK, None
    except FablizeError as e:
        code, error = e.exit_code, e
    except BrokenPipeError:  # `goals.py status | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:  # a failing disk, a full one, a permission: state stays old or new
        code, error = EXIT_DAMAGED, FablizeError(f"I/O error: {e}", "io_error", EXIT_DAMAGED)
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    if out.json and not out.raw:
        obj = {"schema_version": SCHEMA_VERSION, "ok": error is None, "command": command}
        obj.update(out.data)
        if out.warnings:
            obj["warnings"] = out.warnings
        if error is not None:
            obj["error"] = {"code": error.code, "message": error.message, "exit": code}
        sys.stdout.write(json_text(obj) + "\n")
    elif error is not None:
        sys.stderr.write("fablize: " + one_line(error.message) + "\n")
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return code


if __name__ == "__main__":
    sys.exit(main())
