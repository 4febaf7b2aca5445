"""The model: stories, events and the transitions that apply them, each with how `log` shows
it, the gates, and Replay, the one path from ledger lines to a plan. Pure: no I/O.
"""

import collections
import re
from itertools import repeat
from operator import itemgetter

from .base import (
    _ESCAPE_LINE, blank, CHECKPOINT_STATUSES, count_noun, count_stories, create_args, damaged,
    DECISIONS, DEFAULT_ROUNDS, defused_line, DONE, dumps, EXIT_DAMAGED, FablizeError, forged,
    is_plan_id, last_chars, Lazy, LEDGER, load_json, new_plan_id, now_iso, OBSERVED_KEEP, one_line,
    ORIGINAL_STATUSES, quote_arg, refused, regex, RUNS, scope_pattern, sha256_hex, SNAPSHOT,
    SNAPSHOT_VERSION, STATUSES, story_id, TAIL_CHARS, Step, usage, VERDICTS, ZERO_HASH)
from .masking import mask, mask_places


# The shapes of state read back from disk: a hand-crafted goals.json (even with a recomputed
# digest) or a chained but forged ledger line must be exit 3, never a traceback three commands
# later. A spec is a type, a tuple of alternatives, [item spec] or {key: spec}; in a dict spec
# a key ending in "?" may be absent, and a key the spec does not name is never allowed.
_N = type(None)
TEXT = (str, _N)


class _Spec:
    """A spec as a key of _COMPILED: by identity (specs are dicts and lists no code changes; the
    key keeps its spec alive, so an id is never reused)."""
    __slots__ = ("spec",)

    def __init__(self, spec):
        self.spec = spec

    def __hash__(self):
        return id(self.spec)

    def __eq__(self, other):
        return self.spec is other.spec


def _compile(spec):
    """The spec in the form misfit walks, compiled on first use and kept (_COMPILED: a command
    compiles only the specs it checks)."""
    return _COMPILED[_Spec(spec)]


def _compiled(key):
    """_compile's work: type sets tested inline, only nested specs recurse."""
    spec = key.spec
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
    return c


_COMPILED = Lazy(_compiled)


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
# What a test runner's own report said (reports.recorded), or null: a runner the engine does
# not read. Optional: a run recorded before the engine read runners has none. `missing`: the
# runners that wrote no report; `problem`: why a report disagrees with itself.
REPORT_SPEC = {"runner": str, "passed": int, "failed": int, "errors": int, "skipped": int,
               "missing?": [str], "problem?": str}
# what the test runner of an observed run printed, as its output showed it (hooks.observed_report):
# its counts, a few of the failing tests it named
OBSERVED_REPORT_SPEC = dict(REPORT_SPEC, **{"failing?": [str]})
RUN_SPEC = {"seq": int, "check": (int, _N), "cmd": str, "exit_code": (int, _N), "signal": TEXT,
            "timed_out": bool, "error": TEXT, "duration_s": (int, float, _N), "bytes": (int, _N),
            "sha256": TEXT, "tail": TEXT, "log": TEXT, "ok": bool, "interrupted?": TEXT,
            "report?": (REPORT_SPEC, _N)}


# a run's own fields, as its verify_run event carries them (`interrupted` only when it was,
# `report` only from an engine that reads runners' summaries)
RUN_FIELDS = tuple(k for k in RUN_SPEC if k not in ("ok", "interrupted?", "report?"))
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
                   "ok": (bool, _N), "tool": TEXT, "detail": TEXT,
                   "report?": OBSERVED_REPORT_SPEC, "exit_hidden?": bool}], []),
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
              "paused?": ({"seq": int, "ts": str, "note": TEXT}, _N),
              "capped?": ({"seq": int, "ts": str, "blocks": int, "id": TEXT}, _N)}
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
            raise not_a_snapshot(f"story {one_line(story['id'])}{where} is missing, unexpected "
                                 "or of the wrong type")
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
        raise refused(f"{one_line(sid)} not found. {plan_ids(plan)}", "not_found",
                      steps=Step.engine("status"))  # it lists them
    return touch(story)


def plan_ids(plan):
    """The plan's story ids, as a refusal lists them: all of them, or their range."""
    ids = [s["id"] for s in plan["goals"]]
    if len(ids) <= 8:
        return "The plan's stories: " + ", ".join(ids) + "."
    return f"The plan's stories: {ids[0]}–{ids[-1]} ({len(ids)})."


def is_final(plan, story):
    return plan["goals"][-1]["id"] == story["id"]


def claimed_final(plan):
    """One line when the final story is complete on a verification only claimed (typed, not run
    by the engine), else None: `status` and a plain `audit` say it, as a warning (the strict
    recipe's --require-witnessed fails it)."""
    final = plan["goals"][-1]
    if final["status"] != "complete" or touch(final)["grade"] != "claimed":
        return None
    cmd = final.get("verify_cmd")
    return (f"⚠ final verification only claimed: {final['id']}'s "
            + (f"`{one_line(last_chars(cmd, 120))}` " if cmd else "")
            + "was typed in, not run by the engine (`audit --require-witnessed` fails it; "
            "`checkpoint --run` or a frozen check witnesses it).")


def waits_for(plan, story):
    """The direct dependencies of `story` that are not done yet."""
    after = story.get("after", ())
    if not after:
        return []
    if len(after) > 8:  # the final story: one pass over the plan, not a lookup a dependency
        done = done_ids(plan)
        return [d for d in after if d not in done]
    return [d for d in after if lookup(plan, d)["status"] not in DONE]


# how many story ids a line names: the final story waits for every other one; `status --json`
# and `next`'s map list them all
IDS_SHOWN = 10


def ids_text(ids):
    """`G001, G002` — or the first IDS_SHOWN and how many more."""
    if len(ids) <= IDS_SHOWN + 2:
        return ", ".join(ids)
    return f"{', '.join(ids[:IDS_SHOWN])} and {len(ids) - IDS_SHOWN:,} more"


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
    ready = ready_stories(plan)
    reopened = [s for s in ready if s["status"] == "failed" or s.get("round", 0) > 0]
    return touch((reopened or ready)[0]) if ready else None


def stories_in(plan, status):
    """The stories of one status, touched (a few: in progress, blocked, in review)."""
    return [touch(s) for s in plan["goals"] if s["status"] == status]


# Which stories are in progress, known without a pass over the plan: a replay starts every
# story, and each start asks it. A pass each time makes the replay quadratic in the stories: on a
# plan of 2,000 stories worked as agents work it (19,995 events), rebuild takes 613 ms of CPU
# with a pass, 411 with this; log 634 → 394, report 584 → 363, audit 792 → 571; at 200 stories
# the two are level (`python3 tools/bench.py --sizes --against DIR`, DIR a copy without it).
# Held for the one plan last asked about (its list of stories, by identity): the ids that may be
# in progress. Every story in progress is among them — a story starts only in
# _ev_story_started, which adds its id, and a plan read or made anew is a new list, scanned
# once — and an id whose story has since moved on is dropped when read.
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


def status_counts(plan):
    """How many stories have each status: one pass, counted in C."""
    return collections.Counter(map(itemgetter("status"), plan["goals"]))


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


# why a story came back, by who sent it back (its feedback's source): (the handoff's reason,
# who the feedback is from). A release is no failed attempt: the agent holding it was gone.
CAME_BACK = {"checkpoint": ("the earlier attempt did not achieve the objective",
                            "the failed checkpoint"),
             "judge": ("the judge found the objective not achieved", "the judge"),
             "retry": ("a human asked for another attempt", "a human's retry"),
             "amend": ("a human amended the objective (above)", "a human's amendment"),
             "release": ("a human released the claim of the agent that held it, not a failed "
                         "attempt", "a human's release")}


def came_back(story):
    """(why `story` came back, who said so), from its feedback."""
    source = (story["feedback"] or {}).get("source")
    return CAME_BACK.get(source) or (CAME_BACK["checkpoint"][0], source)


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
        and not run.get("interrupted") and report_refusal(run) is None)


def run_outcome(run):
    """passed, failed, or interrupted: a stop signal cut it short, which says nothing of the
    work (nothing to fix: run it again), so it is never shown as a failure."""
    return "passed" if run_passed(run) else "interrupted" if run.get("interrupted") else "failed"


def report_refusal(run):
    """Why the run's test runner disagrees with a pass, by its own report, or None: it wrote
    none (stopped before it, or told not to), the report disagrees with itself, a test failed or
    errored, or none ran."""
    report = run.get("report")
    if not report:
        return None
    if report.get("problem"):
        return report["problem"]
    if report.get("missing"):
        return (f"no {' or '.join(report['missing'])} report"
                + (" (pytest writes none under -p no:junitxml)"
                   if "pytest" in report["missing"] else ""))
    bad = [f"{report['failed']} failed"] if report["failed"] else []
    bad += [count_noun(report["errors"], "error")] if report["errors"] else []
    if bad:
        return f"{report['runner']} reported " + ", ".join(bad)
    if not report["passed"]:
        return f"{report['runner']} ran no test"
    return None


def run_evidence(run):
    """What the run's runner counted, as its evidence: `pytest: 12 passed, 1 skipped`; `exit code
    only` for a command whose runner the engine does not read; "" for a run recorded before the
    engine read summaries, and for one that did not end (interrupted, timed out, killed, never
    started): its runner said nothing, and how it ended is said beside it."""
    if "report" not in run:
        return ""
    report = run["report"]
    if not report:
        unended = any(run.get(k) for k in ("interrupted", "timed_out", "signal", "error"))
        return "" if unended else "exit code only"
    counts = [f"{report[k]} {k if k != 'errors' or report[k] != 1 else 'error'}"
              for k in ("failed", "errors", "passed", "skipped") if report[k]]
    if report.get("missing"):
        counts.append("no report from " + " or ".join(report["missing"]))
    return f"{report['runner']}: " + (", ".join(counts) or "no test")


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
    refusal = report_refusal(run) if run.get("exit_code") == 0 else None
    return f"exit 0 but {refusal}" if refusal else f"exit {run.get('exit_code')}"


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
    evidence = [] if grade == "accepted" else list(dict.fromkeys(
        e for e in map(run_evidence, story["runs"]) if e))
    return GRADE_WORDS.get(grade, one_line(grade)) + (
        f" — {one_line('; '.join(evidence))}" if evidence else "") + (
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


def observed_key(cmd):
    """The command an observed run ran, as the runs that may clear its failure name it: without
    what only filters its output after a pipe (`| tail -3`, `2>&1 | tee log`) — a run of the
    command itself, seen to pass, clears a failure seen through a filter."""
    head = regex(r"(?<!\|)\|(?!\|)").split(cmd, 1)[0]
    return " ".join(regex(r"\s*\d*>&\d+").sub(" ", head).split())


def unaddressed_failure(story):
    """The latest observed failure of a command that has not been seen to pass since, or None:
    only a run seen to pass clears one (an outcome not reported, or hidden, clears nothing)."""
    latest = {}
    for o in observed_of(story):
        if o.get("ok") is not None:
            latest[observed_key(o["cmd"])] = o
    failed = [o for o in latest.values() if o.get("ok") is False]
    return max(failed, key=lambda o: o.get("seq", 0)) if failed else None


def observed_words(o, end=""):
    """What an observed run's outcome rests on, for a note: `exit 1, pytest reported 1 failed:
    tests/t.py::test_x` (or `… 4 passed`); "" when nothing is known (`end` follows what is
    said)."""
    words = [f"exit {o['exit_code']}"] if isinstance(o.get("exit_code"), int) else []
    report = o.get("report") if isinstance(o.get("report"), dict) else None
    runner = one_line(report.get("runner", "")) if report else ""
    if report and (report.get("failed") or report.get("errors")):
        bad = [f"{report['failed']} failed"] if report.get("failed") else []
        bad += [count_noun(report["errors"], "error")] if report.get("errors") else []
        named = report.get("failing") or []
        words.append(f"{runner} reported {', '.join(bad)}"
                     + (f": {one_line(', '.join(named))}" if named else ""))
    elif report and o.get("ok") and report.get("passed") and not report.get("missing"):
        words.append(f"{runner} reported {report['passed']} passed")
    return ", ".join(words) + end if words else ""


def observed_result(o):
    """An observed run's outcome in words: passed, failed (and why), or unknown (and why)."""
    report = o.get("report") if isinstance(o.get("report"), dict) else None
    if o.get("ok") is None:
        if o.get("exit_hidden"):
            counts = "" if not report or report.get("missing") else (
                f"; {one_line(report.get('runner', ''))} reported {report['passed']} passed")
            return ("outcome unknown (the exit status is not the test runner's: a pipe, `;` or "
                    f"`||` after it{counts})")
        if report and not report.get("missing") and not report.get("passed"):
            return f"no test ran ({one_line(report.get('runner', ''))} reported none)"
        return "outcome not reported"
    words = observed_words(o)
    return ("passed" if o["ok"] else "failed") + (f" ({words})" if words else "")


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
        raise refused(f"{story['id']} cannot start: it waits for {ids_text(pending)}.", "waiting")
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
    """Why a `complete` checkpoint of `story` is not verified, or None if it is: a refusal
    naming the checkpoint the gate accepts."""
    step = Step.engine(completion_args(plan, story))
    checks = story["checks"]
    if checks:
        for i, cmd in enumerate(checks):
            run = latest_run(story, check=i)
            if run is None:
                return refused(f"{story['id']}: frozen check {i + 1} (`{one_line(cmd)}`) has no "
                               "run "
                               "since the story was activated.", "verification_missing", step)
            if not run["ok"]:
                return refused(f"{story['id']}: frozen check {i + 1} (`{one_line(cmd)}`) failed "
                               f"({describe_exit(run)}).", "verification_failed", step)
        return None
    if ev.get("run"):
        run = latest_run(story, cmd=ev.get("verify_cmd"))
        if run is None:
            return refused(f"{story['id']}: no run of `{one_line(ev.get('verify_cmd'))}` since the "
                           "story was activated.", "verification_missing", step)
        if not run["ok"]:
            return refused(f"{story['id']}: `{one_line(run['cmd'])}` failed "
                           f"({describe_exit(run)}).", "verification_failed", step)
        return None
    if not is_final(plan, story):
        return None
    if plan["options"]["require_run"]:
        return refused("this plan requires a witnessed run: the final story completes only "
                       "with --run (the engine runs --verify-cmd) or frozen checks.",
                       "run_required", step)
    if blank(ev.get("verify_cmd")) or blank(ev.get("verify_evidence")):
        return refused("the final story cannot complete without --verify-cmd and --verify-evidence "
                       "(verification gate). Witnessed is stronger than typed: --run --verify-cmd "
                       "CMD has the engine run it (or the story's frozen checks run by "
                       "themselves); a --verify-evidence you type is only claimed.",
                       "verification_gate", step)
    return None


# what a human may decide of a story that needs one, each with what its note says
DECISION_NOTES = (("accept", "<why it is acceptable as it is>"),
                  ("retry", "<what the next attempt should do>"),
                  ("amend", "<what changes in the objective>"))
# what a checkpoint's evidence says, by its status, where a step leaves it to the agent
EVIDENCE_NOTES = {"complete": "<what shows it>", "failed": "<what is missing>",
                  "blocked": "<why it cannot be done as specified>"}


def checkpoint_args(story, status, evidence):
    """A whole checkpoint of `story` (its agent named, as the gate asks), after the engine."""
    return (f"checkpoint --id {story['id']} --status {status} --evidence \"{evidence}\""
            + (f" --agent {quote_arg(story['agent'])}" if story["agent"] else ""))


def completion_args(plan, story):
    """The checkpoint that completes `story`, as its gate will accept it."""
    args = checkpoint_args(story, "complete", "<evidence>")
    if story["checks"] or not is_final(plan, story):
        return args
    return args + " --run --verify-cmd \"<command>\""  # witnessed first (SKILL.md: prefer --run)


def verdict_args(sid, verdict, evidence=None, agent=None):
    """A judge's verdict on `sid`, after the engine; what the judge has to write is a
    placeholder."""
    return (f"verdict --id {sid} {verdict} --evidence "
            + (quote_arg(evidence) if evidence else '"<what you checked and saw>"')
            + " --agent " + (quote_arg(agent) if agent else '"<you>"'))


def reopen_final(plan):
    """Where `add` found verification started: the step that lets a story come before the
    final one again — the final story's checkpoint as failed (what is missing: the story to
    add), a human's retry of it in review, or, once the plan is done, a new plan."""
    final = plan["goals"][-1]
    if final["status"] == "in_progress":
        return Step.engine(checkpoint_args(final, "failed", "<the story that must come first>"))
    if final["status"] == "review":
        return Step.human(f"decide --id {final['id']} retry --note "
                          "\"<the story that must come first>\"")
    return Step.engine(create_args(force=True))


def decide_steps(sid):
    """What a human may run of a story that waits for one: in their own terminal."""
    return [Step.human(f"decide --id {sid} {decision} --note \"{note}\"")
            for decision, note in DECISION_NOTES]


def not_active(plan, story, agent=None, shared=False):
    """The refusal of a checkpoint on a story that is not in progress: the original's opening
    (`G00X is not active (STATUS)`, which scripts match), then what is true of this story and
    the one step that fits it, whole: `status`; a human's decisions for a blocked one; the
    judge's packet for one in review; the checkpoint of the story this agent holds; `next` (for
    this agent) to activate it — `sync` first in a clone of a `shared` plan, whose copy may be
    behind what another clone recorded."""
    sid, status = story["id"], story["status"]
    head = f"{sid} is not active ({status})"
    if status in DONE:
        return refused(f"{head} — it is already done; nothing to do for it (`status` shows "
                       "what is next).", "not_active", Step.engine("status"))
    if status == "blocked":
        return refused(f"{head} — a human decides it, with one of:", "not_active",
                       decide_steps(sid))
    if status == "review":
        return refused(f"{head} — its judge decides it: hand {sid} to an independent judge, who "
                       "runs:", "not_active", Step.engine(f"judge-packet --id {sid}"))
    mine = [s for s in active_stories(plan) if s["agent"] == agent]  # never another's
    if mine:
        other = mine[0]
        return refused(f"{head} — {other['id']} is in progress: finish {other['id']} first "
                       f"(`next` would hand out {other['id']} again).", "not_active",
                       Step.engine(completion_args(plan, other)))
    ready = pick_ready(plan)  # what `next` would activate: the step names no other story
    waiting = waits_for(plan, story)
    if ready is None:
        return refused(f"{head} — it waits for {ids_text(waiting) or 'stories in progress'}, "
                       "and nothing is ready to activate now: `status` says who holds what.",
                       "not_active", Step.engine("status"))
    if ready["id"] == sid:
        said = f"{head} — activate it with `next` first."
    else:
        why = (f"it waits for {ids_text(waiting)}" if waiting else
               "`next` hands out the ready stories in plan order")
        said = f"{head} — {why}; `next` activates {ready['id']} first."
    if shared:
        return refused(said + " This clone's copy of the shared plan may be behind what another "
                       "clone recorded: sync it first.", "not_active", Step.engine("sync"))
    # an unnamed caller, while agents hold stories, takes one by name (cmd_next)
    name = (quote_arg(agent) if agent else
            '"<your name>"' if any(s["agent"] for s in active_stories(plan)) else None)
    return refused(said, "not_active", Step.engine("next" + (f" --agent {name}" if name else "")))


def checkpoint_gate(plan, story, ev, shared=False):
    """The checks a checkpoint must pass before anything runs (the original's order)."""
    agent = ev.get("agent")
    if story["status"] != "in_progress":
        raise not_active(plan, story, agent, shared)
    _refuse_blank_agent(agent)
    if story["agent"] is not None and agent != story["agent"]:
        caller = "an unnamed caller (give --agent)" if agent is None else one_line(agent)
        # never the holder's name offered: each agent its own (a caller that gave none, its own)
        raise refused(f"{story['id']} is held by agent {one_line(story['agent'])}, "
                      f"not {caller}.", "held_by_other", Step.engine(
                          "status --agent "
                          + (quote_arg(agent) if agent is not None else '"<your name>"')))
    # failed/blocked without evidence stays legal in a replay (the original allowed it);
    # `checkpoint` asks for a reason now (reason_required)
    if ev["status"] == "complete" and blank(ev.get("evidence")):
        raise refused("a complete checkpoint requires non-empty --evidence.", "no_evidence",
                      Step.engine(completion_args(plan, story)))


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
    if "report" in ev:
        report = ev["report"]
        if report is not None and min(report[k] for k in (
                "passed", "failed", "errors", "skipped")) < 0:
            raise forged("a run's test counts are out of range")
        record["report"] = report
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
    return f"{sid} run {run_text(ev)} · log {ev['log']} · in {ev['cwd']}"


def _ev_decision(plan, ev):
    story = find_story(plan, ev["id"])
    decision, note = ev["decision"], ev["note"]
    if decision not in DECISIONS:
        raise usage(f"unknown decision {one_line(decision)}")
    if blank(note):  # the note is the human's to write
        raise refused("a decision requires a non-empty --note (the reason, or the feedback).",
                      "no_note", Step.human(f"decide --id {story['id']} {decision} --note "
                                            f"\"{dict(DECISION_NOTES)[decision]}\""))
    if story["status"] not in ("blocked", "failed", "review"):
        raise refused(f"{story['id']} is {story['status']} — `decide` applies to a "
                      "blocked, failed or in-review story.", "not_decidable",
                      steps=Step.engine("status"))
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
                      "only before verification starts.", "final_started", reopen_final(plan))
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
        raise refused(f"{story['id']} is {story['status']}, not in review — there is "
                      "nothing to judge.", "not_in_review", steps=Step.engine("status"))
    # the verdict again, what the judge has to write a placeholder; for the story's own
    # executor, the packet an independent judge starts from
    if blank(ev["evidence"]) or blank(agent):
        again = Step.engine(verdict_args(story["id"], verdict, None if blank(ev["evidence"])
                                         else ev["evidence"], None if blank(agent) else agent))
        if blank(ev["evidence"]):
            raise refused("a verdict requires non-empty --evidence (what you checked and saw).",
                          "no_evidence", again)
        raise refused("a verdict requires --agent (who judged).", "no_agent", again)
    if story["executor"] is not None and agent == story["executor"]:
        raise refused(f"{one_line(agent)} did the work of {story['id']} and cannot judge it.",
                      "judge_not_independent", Step.engine(f"judge-packet --id {story['id']}"))
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


def _ev_guard_capped(plan, ev):
    """The guard let the agent stop after its cap of blocks in a row, with work left: kept until
    the next event that is more than the guard's own, so `status` says it in the morning."""
    if ev["id"] is not None:
        find_story(plan, ev["id"])
    plan["guard"]["capped"] = {"seq": ev["seq"], "ts": ev["ts"], "blocks": ev["blocks"],
                               "id": ev["id"]}
    return plan


def _log_guard_capped(ev, sid):
    return (f"the agent stopped with work left: the guard let it stop after {ev['blocks']} blocks "
            "in a row" + (f" — next: {one_line(ev['id'])}" if ev["id"] else ""))


def guard_capped(plan):
    """The stop the guard let through at its cap, while nothing has happened since, or None."""
    capped = plan["guard"].get("capped")
    return capped if isinstance(capped, dict) else None


def _ev_paused(plan, ev):
    paused = plan["guard"].get("paused")
    if paused:
        raise refused(f"the guard is already paused (since event {paused['seq']}) — "
                      "`unpause` turns it back on.", "already_paused", steps=Step.engine("status"))
    plan["guard"]["paused"] = {"seq": ev["seq"], "ts": ev["ts"], "note": ev["note"]}
    return plan


def _log_paused(ev, sid):
    return "guard paused" + (f": {one_line(ev['note'])}" if ev["note"] else "")


def _ev_unpaused(plan, ev):
    if not plan["guard"].get("paused"):
        raise refused("the guard is not paused.", "not_paused", steps=Step.engine("status"))
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
                 "detail": ev["detail"],
                 **{k: ev[k] for k in ("report", "exit_hidden") if k in ev}})
    story["observed"] = seen[-OBSERVED_KEEP:]
    return plan


def _log_observed_run(ev, sid):
    return (f"{sid} observed `{one_line(last_chars(ev['cmd'], 200))}` → {observed_result(ev)} "
            f"(reported by {one_line(ev['tool'])})")


def _ev_story_released(plan, ev):
    story = find_story(plan, ev["id"])
    if story["status"] != "in_progress":
        raise refused(f"{story['id']} is {story['status']}, not in progress — there is "
                      "no claim to release.", "not_active", steps=Step.engine("status"))
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
        "provenance?": (PROVENANCE_SPEC, _N), "tree?": str, "report?": (REPORT_SPEC, _N)},
        _log_verify_run),
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
    "guard_capped": (_ev_guard_capped, {"blocks": int, "id": TEXT}, _log_guard_capped),
    "paused": (_ev_paused, {"note": TEXT}, _log_paused),
    "unpaused": (_ev_unpaused, {}, _log_unpaused),
    "observed_run": (_ev_observed_run, {"id": str, "cmd": str, "exit_code": (int, _N),
                                        "ok": (bool, _N), "tool": TEXT, "detail": TEXT,
                                        "report?": OBSERVED_REPORT_SPEC, "exit_hidden?": bool},
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
    if kind not in GUARD_OWN:
        plan["guard"]["blocks"] = 0
    if kind not in GUARD_KEEPS and "capped" in plan["guard"]:
        del plan["guard"]["capped"]  # the work went on: the stop at the cap is history (`log`)
    return plan


# the events that leave the guard's count of blocks in a row as it is, and those after which a
# stop at the cap still stands (a human pausing the guard, or turning it on, works on nothing)
GUARD_OWN = ("guard_block", "guard_capped")
GUARD_KEEPS = ("guard_capped", "paused", "unpaused")


def format_event(ev):
    """One event of the ledger as a line of history (`log`): its number, its time and what its
    kind's renderer says of it (EVENTS, beside each transition). Only events a replay accepted
    are shown, so each has the fields its kind names, and a time TIMESTAMP matched (its label
    is time_label's, cut from it). The line is escaped whole, once: one_line works a character
    at a time, so that is each field escaped, and a renderer may give its fields as they
    are."""
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
    each story to touch(), which fills in the fields a compact snapshot leaves out
    (`whole=False`); audit and rebuild check everything, and so does a command that failed on
    what a story holds (snapshot_damage), so a hand-made snapshot is exit 3, never a
    traceback."""
    bad = not_a_snapshot
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
        raise not_a_snapshot("two stories have the same id")
    for i, story in enumerate(goals):
        if not ids.issuperset(story.get("after", ())):
            raise not_a_snapshot(f"goals[{i}].after names a story that is not in the plan")
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


def not_a_snapshot(what):
    """goals.json is no snapshot this engine writes: the ledger is the source of truth, and
    `rebuild` regenerates the snapshot from it."""
    return damaged(f"{SNAPSHOT}: not a fablize snapshot ({what}) — `rebuild` "
                   "regenerates it from the ledger (the old one is kept as a .bak):",
                   "bad_snapshot", steps=Step.engine("rebuild"))


def line_error(lineno, what, code="bad_event", steps=(), path=None):
    """Damage at one ledger line: every message about a line starts the same way (`path`: the
    run log it names, when that is what does not match)."""
    return FablizeError(f"{LEDGER} line {lineno}: {what}", code, EXIT_DAMAGED, steps,
                        detail={"lineno": lineno, "path": path})


def not_an_event(lineno, last=False):
    if last or lineno == "at the end":  # acknowledged, so damage; rebuild sets it aside, said
        return line_error(
            lineno, "not a ledger event (unparsable, or no seq/event) — damaged or edited; "
            f"`rebuild` moves it to {LEDGER}.broken and regenerates the snapshot from the events "
            "before it:", "bad_line", steps=Step.engine("rebuild"))
    return line_error(lineno, "not a ledger event (unparsable, or no seq/event) — damaged or "
                      f"edited (if the ledger was committed, `git diff -- {LEDGER}` in its "
                      "folder shows the edit).", "bad_line")


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


def run_summary(run):
    return one_line(run_text(run))


def run_text(run):
    """A run's command and result, its fields as they are (run_summary escapes them)."""
    return f"`{run.get('cmd')}` → {run_words(run)}, sha256 {str(run.get('sha256'))[:16]}…"


def run_result(run):
    return one_line(run_words(run))


def run_words(run):
    took = "" if run.get("timed_out") else f", {run.get('duration_s')} s"
    evidence = run_evidence(run)
    evidence = f" ({evidence})" if evidence else ""
    return f"{exit_words(run)}{evidence}{took}, {run.get('bytes')} bytes"
