"""Audit: replaying the whole ledger and what it finds (audit_ledger), beside the snapshot.
"""

import collections
import json
import os
from itertools import compress, repeat
from operator import eq, itemgetter, methodcaller

from .base import (
    count_noun, damaged, dumps, fast_sha256, LEDGER, load_json, no_plan, one_line, REPORT_RUNS,
    RUNS, SNAPSHOT, SNAPSHOT_VERSION, Step)
from .masking import looks_secret
from .model import (
    _EVENT_KIND, _PREV, compact, find_story, is_original_snapshot, line_error, parse_event)
from .storage import (
    MemoryLedger, parse_snapshot, position_error, read_state_file, REBUILD_STEP, replay_all,
    snapshot_bytes, stripped_snapshot_error)


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
    `scan(lineno, head, ev)` sees every line after it replayed (the trust checks' pass; a scan
    with a `batch` method is given each batch at once instead)."""
    audit = Audit(source, snapshot_raw, require_independent, runs_dir, scan, logs)
    replay = audit.replay()
    report = audit.report(replay)
    audit.compare_snapshot(replay, report)
    return report


class Audit:
    """One audit of a ledger, in the steps audit_ledger takes: the snapshot read, the replay
    (each batch checked as it passes: secrets, run logs, the trust scan; each event the
    independence of its verdict), the report, the snapshot compared."""

    def __init__(self, source, snapshot_raw, require_independent, runs_dir, scan, logs):
        self.ledger = MemoryLedger(source) if isinstance(source, bytes) else source
        self.end, self.torn = self.ledger.end() if self.ledger.fd is not None else (0, b"")
        self.snapshot_raw = snapshot_raw
        snap = parse_snapshot(snapshot_raw, whole=True) if snapshot_raw is not None else None
        if snap is not None and is_original_snapshot(snap):
            raise stripped_snapshot_error()  # beside a chained ledger (else refuse_original)
        self.snap_seq = snap["ledger"]["seq"] if snap is not None else None
        self.version = snap["schema_version"] if snap is not None else None
        if self.version == SNAPSHOT_VERSION:
            # this engine's snapshot is compared as the bytes it would write at that event: the
            # parsed copy is let go before the replay builds its own, and parsed again only on
            # a mismatch, to say where
            snap = True
        self.snap, self.snap_view = snap, None
        self.require_independent, self.scan = require_independent, scan
        self.runs_dir, self.logs = runs_dir, logs
        self.independence, self.bad_logs, self.secrets = [], [], []
        self.checked = 0
        self.digest = fast_sha256()
        self.recent = collections.deque(maxlen=REPORT_RUNS)  # the latest runs, for the summary
        present = set(os.listdir(runs_dir)) if runs_dir and os.path.isdir(runs_dir) else set()
        # a run's log is runs/<seq>-<story>.log (replay checked): where it is looked for
        self.log_key = itemgetter(slice(len(RUNS) + 1, None)) if logs is None else None
        found = logs.keys() if logs is not None else present
        self.has_log = found.__contains__
        # the seqs whose log may be here, from the names (<seq>-<story>.log): a batch none of
        # whose seqs is among them has no log to look up
        self.logged = {int(seq) for seq in
                       (name.rpartition("/")[2].partition("-")[0] for name in found)
                       if seq.isascii() and seq.isdigit()}
        # the snapshot is compared as of its own event: after the replay when that is the last
        # line (a snapshot in sync), else as the replay passes it
        last = parse_event(self.ledger.last(self.end) or b"") if self.snap_seq is not None else None
        self.at_end = self.snap_seq is None or (last is not None and last["seq"] == self.snap_seq)

    def replay(self):
        kinds = {"verdict"} if self.require_independent else set()
        replay = replay_all(self.ledger, self.end,
                            self.on_event if kinds or not self.at_end else None,
                            kinds if self.at_end else None, self.on_batch)
        if self.snap_seq is not None and self.at_end and replay.seq == self.snap_seq:
            self.view(replay)
        return replay

    def on_batch(self, replay, events):
        """What audit checks of each batch the replay accepted: secrets, run logs, the trust
        scan."""
        kinds = list(map(_EVENT_KIND, events))
        distinct = set(kinds)
        groups = ({kinds[0]: events} if len(distinct) == 1 else  # most batches: runs only
            {kind: list(compress(events, map(eq, kinds, repeat(kind)))) for kind in distinct})
        if len(self.secrets) < MAX_SECRET_LINES:
            self.secrets.extend(
                secret_seqs(groups, looks_secret)[:MAX_SECRET_LINES - len(self.secrets)])
        runs = groups.get("verify_run", ())
        self.recent.extend(runs)
        self.check_logs(runs)
        if self.scan is not None:
            heads = [*map(_PREV, events[1:]), replay.head]  # each line's hash, as the next names
            for ev, head in zip(events, heads):
                self.scan(ev["seq"], head, ev)

    def check_logs(self, runs):
        """Each run's log found here against the digest its run recorded."""
        logless = set()  # runs whose log could not be made: no log to show, none claimed
        if EMPTY_SHA256 in map(_SHA256, runs):
            logless = {ev["seq"] for ev in runs if not ev["bytes"] and ev["error"] and
                       ev["sha256"] == EMPTY_SHA256}
            self.checked += len(logless)
        names = ()
        if runs and not self.logged.isdisjoint(range(runs[0]["seq"], runs[-1]["seq"] + 1)):
            names = (map(_LOG, runs) if self.log_key is None else
                map(self.log_key, map(_LOG, runs)))
        for ev in compress(runs, map(self.has_log, names)):  # most batches: none of their logs
            if ev["seq"] in logless:
                continue
            self.checked += 1
            log = ev["log"]
            content = (self.logs.get(log) if self.logs is not None else
                read_state_file(os.path.join(self.runs_dir, self.log_key(log))))
            if content is None or self.digest(content) != ev["sha256"]:
                self.bad_logs.append(line_error(
                    ev["seq"], f"{one_line(log)} does not match the sha256 recorded for that "
                    "run — the log was edited or replaced.", "run_log_mismatch",
                    # the file here: what a way back restores
                    path=os.path.join(self.runs_dir, self.log_key(log))
                    if self.logs is None else None))

    def view(self, replay):
        """The snapshot this engine would have written at this event."""
        replay.plan["ledger"] = replay.position()
        self.snap_view = (snapshot_bytes(replay.plan) if self.snap is True else
                          snapshot_view(replay.plan, self.version))

    def on_event(self, replay, line, ev):
        if self.require_independent and ev["event"] == "verdict":  # it leaves executor as it was
            story = find_story(replay.plan, ev["id"])
            if story["executor"] is None or story["executor"] == ev["agent"]:
                self.independence.append(f"line {replay.seq}: {story['id']} judged by "
                                         f"{one_line(ev['agent'])}, executor "
                                         f"{one_line(story['executor'] or 'unnamed')}")
        if replay.seq == self.snap_seq and not self.at_end:
            self.view(replay)

    def report(self, replay):
        runs = replay.counts["verify_run"]
        plan = replay.plan
        if plan is None:
            if self.snap is not None:
                raise position_error(self.snap_seq, 0)
            raise no_plan()
        plan["ledger"] = replay.position()
        return {"event_count": replay.seq, "head": f"{replay.seq}:{replay.head}",
                "torn_tail_bytes": len(self.torn), "snapshot": "missing", "plan": plan,
                "independence": self.independence, "run_count": runs,
                "missing_logs": runs - self.checked, "recent_runs": list(self.recent),
                "bad_logs": self.bad_logs, "secret_lines": self.secrets}

    def compare_snapshot(self, replay, report):
        """The snapshot against the replay at its own event: report["snapshot"] says how it
        stands; exit 3 when it differs."""
        snap, snap_seq, snap_view = self.snap, self.snap_seq, self.snap_view
        if snap is None:
            return
        if replay.seq < snap_seq:
            raise position_error(snap_seq, replay.seq)
        if snap is True:  # this engine's snapshot: the very bytes it would write, or else
            if snap_view == self.snapshot_raw:  # what differs, from both parsed
                snap_view = None
            else:
                snap = parse_snapshot(self.snapshot_raw, whole=True)
                view = load_json(snap_view)
                # in the plan's own key order, as a view of any other version is compared
                snap_view = {k: view[k] for k in [*report["plan"], *view]
                             if k in view and k != "digest"}
        if snap_view is None:
            mismatch = None
        elif self.version < 2:
            if snap_view["ledger"]["head"] != snap["ledger"]["head"]:
                raise damaged(f"{SNAPSHOT} and {LEDGER} disagree at event {snap_seq} "
                              f"— {REBUILD_STEP}", "snapshot_mismatch",
                              steps=Step.engine("rebuild"))
            report["snapshot"] = ("in the format of fablize 1 (the next writing command "
                                  "rewrites it)")
            return
        else:
            mismatch = first_difference(forgive_new_keys(snap_view, snap),
                                        {k: v for k, v in snap.items() if k != "digest"})
        if mismatch:
            raise damaged(f"{SNAPSHOT} disagrees with the replay of {LEDGER} up to line "
                          f"{snap_seq}: {mismatch} — {REBUILD_STEP}",
                          "snapshot_mismatch", steps=Step.engine("rebuild"))
        behind = replay.seq - snap_seq
        report["snapshot"] = ("in sync" if not behind else
            f"{count_noun(behind, 'event')} behind (rolled forward by the next "
            "writing command)")


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
