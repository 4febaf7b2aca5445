"""Issue 5: the ledger is checked from outside the agent — audit, rebuild, log, guard, report."""

import fcntl
import hashlib
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (SCRIPT, complete, encode, engine, ledger, make_plan, raw_lines, rechain,
                      run_cli, state_files, write_lines)

ZERO = "0" * 64
CLI = f"python3 {SCRIPT}"


# Ledger surgery: the tests forge lines with a VALID hash chain (conftest's rechain, encoded and
# hashed there with json and hashlib, not by the engine).


def ledger_path(state_dir):
    return Path(state_dir) / "ledger.jsonl"


def append_forged(state_dir, *forged):
    """Append events to the ledger with a valid chain; the existing lines stay byte-identical."""
    events = ledger(state_dir)
    lines = rechain(events + [dict(ev, ts="2026-01-01T00:00:00.000000+00:00") for ev in forged])
    assert lines[:len(events)] == raw_lines(state_dir)  # the re-chaining itself is faithful
    write_lines(state_dir, lines)
    return len(events) + 1  # the line number of the first forged event


def head_of(state_dir):
    lines = raw_lines(state_dir)
    return f"{len(lines)}:{hashlib.sha256(lines[-1]).hexdigest()}"


def checkpoint_ev(sid, evidence="done"):
    return {"event": "checkpoint", "id": sid, "status": "complete", "evidence": evidence,
            "verify_cmd": "", "verify_evidence": ""}


def run_ev(sid, exit_code, after_seq):
    """A run of frozen check 1 (`true`) as the engine records it."""
    return {"event": "verify_run", "id": sid, "check": 0, "cmd": "true", "exit_code": exit_code,
            "signal": None, "timed_out": False, "error": None, "duration_s": 0.01, "bytes": 0,
            "sha256": hashlib.sha256(b"").hexdigest(), "tail": "", "log": "AUTO",
            "after_seq": after_seq, "cwd": "/tmp", "started": "2026-01-01T00:00:00.000000+00:00",
            "git_head": None, "git_dirty": None}


def assert_damaged(r, *needles):
    assert r.code == 3, r
    for needle in needles:
        assert needle in r.err, (needle, r)


@pytest.fixture
def history(fab):
    """A 3-story plan with some history: 8 events, G002 in progress."""
    make_plan(fab, 3)
    fab("next")
    fab("checkpoint", "--id", "G001", "--status", "failed", "--evidence", "missing tests")
    fab("next")
    fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "wrote the parser")
    fab("next")
    r = fab("verify", "--id", "G002", "--verify-cmd", "echo hello")
    assert r.code == 0, r
    fab("checkpoint", "--id", "G002", "--status", "failed", "--evidence", "not yet")
    assert len(ledger(fab.dir)) == 8
    return fab


# audit: the whole ledger, replayed ##########################################


def test_audit_trusts_an_untouched_ledger_and_prints_its_head(history):
    fab = history
    r = fab("audit")
    assert r.code == 0, r
    assert "audit ok — 8 events" in r.out and "snapshot in sync" in r.out
    assert f"head: {head_of(fab.dir)}" in r.out
    j = fab("audit", "--json").json
    assert j["ok"] is True and j["command"] == "audit"
    assert j["schema_version"] == engine.SCHEMA_VERSION
    assert j["event_count"] == 8 and j["head"] == head_of(fab.dir)
    assert j["torn_tail_bytes"] == 0 and j["complete"] is False and j["done"] == 1
    assert j["total"] == 3


def test_audit_forged_events_that_are_legal_pass(fab):
    """The control for the forgeries below: a correctly chained, legal forgery is accepted, so
    each refusal below is the replay rule speaking, not the chain."""
    make_plan(fab, 2, "--check", "G001=true")
    fab("next")
    append_forged(fab.dir, run_ev("G001", 0, after_seq=2), checkpoint_ev("G001"))
    r = fab("audit", "--json")
    assert r.code == 0, r
    assert r.json["event_count"] == 4 and r.json["snapshot"].startswith("2 events behind")
    assert r.json["done"] == 1


@pytest.mark.parametrize("case", ["inactive", "no_evidence", "final_unverified",
                                  "frozen_no_run", "frozen_run_before_activation",
                                  "frozen_failed_run", "unknown_event"])
def test_audit_refuses_an_illegal_event_even_with_a_valid_chain(fab, case):
    if case == "inactive":
        make_plan(fab, 3)
        forged, why = [checkpoint_ev("G001")], "G001 is not active (pending)"
    elif case == "no_evidence":
        make_plan(fab, 3)
        fab("next")
        forged, why = [checkpoint_ev("G001", evidence="  ")], "requires non-empty --evidence"
    elif case == "final_unverified":
        make_plan(fab, 2)
        complete(fab, "G001")
        fab("next")
        forged, why = [checkpoint_ev("G002", evidence="all good")], "verification gate"
    elif case == "frozen_no_run":
        make_plan(fab, 2, "--check", "G001=true")
        fab("next")
        forged, why = [checkpoint_ev("G001")], "frozen check 1 (`true`) has no run since"
    elif case == "frozen_run_before_activation":
        make_plan(fab, 2, "--check", "G001=true")
        fab("next")  # activated at seq 2; a run that started at seq 1 is not fresh
        forged = [run_ev("G001", 0, after_seq=1), checkpoint_ev("G001")]
        why = "frozen check 1 (`true`) has no run since"
    elif case == "frozen_failed_run":
        make_plan(fab, 2, "--check", "G001=true")
        fab("next")
        forged = [run_ev("G001", 1, after_seq=2), checkpoint_ev("G001")]
        why = "frozen check 1 (`true`) failed (exit 1)"
    else:
        make_plan(fab, 2)
        forged, why = [{"event": "story_finished", "id": "G001"}], "unknown event"
    before = state_files(fab.dir)
    first = append_forged(fab.dir, *forged)
    bad_line = first + len(forged) - 1
    edited = state_files(fab.dir)
    r = fab("audit")
    assert_damaged(r, f"ledger.jsonl line {bad_line}:", why)
    assert state_files(fab.dir) == edited != before  # audit only reads
    j = fab("audit", "--json").json
    assert j["ok"] is False and j["error"]["exit"] == 3 and j["error"]["code"] == "bad_event"
    assert f"line {bad_line}" in j["error"]["message"]


def test_audit_refuses_a_line_that_is_not_json(history):
    fab = history
    lines = raw_lines(fab.dir)
    lines[3] = lines[3][:-5]  # cut inside the object: not JSON any more
    write_lines(fab.dir, lines)
    assert_damaged(fab("audit"), "ledger.jsonl line 4: not a ledger event")


def test_audit_refuses_a_gap_in_seq_even_with_a_valid_chain(history):
    fab = history
    events = ledger(fab.dir)
    lines, prev = [], ZERO
    for i, ev in enumerate(events):
        ev = dict(ev, seq=i + 1 if i < 5 else i + 2, prev=prev)  # 1..5, 7..9
        lines.append(encode(ev))
        prev = hashlib.sha256(lines[-1]).hexdigest()
    write_lines(fab.dir, lines)
    assert_damaged(fab("audit"), "ledger.jsonl line 6: seq is 7, expected 6")


def edit_one_character(line):
    """Change one digit of the event's timestamp: still valid JSON, same seq, same meaning."""
    i = line.index(b'"ts":"') + len(b'"ts":"2026-01-01T00:00:0')
    digit = line[i:i + 1]
    return line[:i] + (b"1" if digit != b"1" else b"2") + line[i + 1:]


@pytest.mark.parametrize("lineno", [1, 2, 4, 7])
def test_audit_catches_one_changed_character_in_an_earlier_line(history, lineno):
    fab = history
    lines = raw_lines(fab.dir)
    lines[lineno - 1] = edit_one_character(lines[lineno - 1])
    json.loads(lines[lineno - 1])  # still a well-formed event
    write_lines(fab.dir, lines)
    before = state_files(fab.dir)
    r = fab("audit")
    assert_damaged(r, f"ledger.jsonl line {lineno + 1}: the hash chain is broken",
                   f"match line {lineno}")
    assert state_files(fab.dir) == before


def test_audit_catches_a_changed_character_in_the_evidence_text(history):
    fab = history
    lines = raw_lines(fab.dir)
    assert b"wrote the parser" in lines[4]
    lines[4] = lines[4].replace(b"wrote the parser", b"wrote the parsex")
    write_lines(fab.dir, lines)
    assert_damaged(fab("audit"), "ledger.jsonl line 6: the hash chain is broken")


@pytest.mark.parametrize("edit", ["evidence", "timestamp"])
def test_audit_catches_a_changed_last_line_through_the_snapshot(history, edit):
    """Nothing follows the last line, so its chain cannot tell; the snapshot (its content, and
    the hash of the line it reflects) can."""
    fab = history
    lines = raw_lines(fab.dir)
    if edit == "evidence":
        lines[-1] = lines[-1].replace(b"not yet", b"not yes")
        why = "goals[G002].evidence is 'not yet', the ledger says 'not yes'"
    else:
        lines[-1] = edit_one_character(lines[-1])
        why = "ledger.head is"
    write_lines(fab.dir, lines)
    assert_damaged(fab("audit"), "goals.json disagrees with the replay of ledger.jsonl up "
                                      "to line 8", why)


def test_audit_catches_a_last_line_made_unparsable_that_the_snapshot_reflects(history):
    fab = history
    lines = raw_lines(fab.dir)
    lines[-1] = lines[-1][:-3]
    write_lines(fab.dir, lines)
    assert_damaged(fab("audit"), "ledger.jsonl line 8: not a ledger event")


@pytest.mark.parametrize("lineno", [2, 5])
def test_audit_catches_a_deleted_line(history, lineno):
    fab = history
    lines = raw_lines(fab.dir)
    del lines[lineno - 1]
    write_lines(fab.dir, lines)
    assert_damaged(fab("audit"), f"ledger.jsonl line {lineno}: seq is {lineno + 1}, "
                                      f"expected {lineno}")


def test_audit_catches_a_deleted_last_line(history):
    fab = history
    write_lines(fab.dir, raw_lines(fab.dir)[:-1])
    assert_damaged(fab("audit"), "goals.json reflects event 8 but ledger.jsonl ends at event 7")


def test_audit_catches_two_reordered_lines(history):
    fab = history
    lines = raw_lines(fab.dir)
    lines[3], lines[4] = lines[4], lines[3]
    write_lines(fab.dir, lines)
    assert_damaged(fab("audit"), "ledger.jsonl line 4: seq is 5, expected 4")


def test_audit_catches_reordered_lines_with_seq_renumbered(history):
    fab = history
    events = ledger(fab.dir)
    events[3], events[4] = events[4], events[3]
    lines = [encode(dict(ev, seq=i)) for i, ev in enumerate(events, 1)]  # prev left as it was
    write_lines(fab.dir, lines)
    assert_damaged(fab("audit"), "ledger.jsonl line 4: the hash chain is broken")


def test_audit_catches_reordered_lines_even_when_fully_rechained(history):
    fab = history
    events = ledger(fab.dir)
    events[3], events[4] = events[4], events[3]  # G001 completed before it was reopened
    write_lines(fab.dir, rechain(events))
    assert_damaged(fab("audit"), "ledger.jsonl line 4:", "not active")


def test_audit_names_the_first_bad_line(history):
    fab = history
    lines = raw_lines(fab.dir)
    lines[1] = edit_one_character(lines[1])
    lines[5] = edit_one_character(lines[5])
    write_lines(fab.dir, lines)
    r = fab("audit")
    assert_damaged(r, "ledger.jsonl line 3:")
    assert "line 7" not in r.err


def test_audit_catches_goals_json_edited_to_mark_a_story_complete(history):
    fab = history
    path = fab.dir / "goals.json"
    plan = json.loads(path.read_text())
    plan["goals"][1]["status"] = "complete"
    path.write_text(json.dumps(plan))
    before = state_files(fab.dir)
    r = fab("audit")
    assert_damaged(r, "goals.json was changed outside fablize", "digest does not match")
    assert state_files(fab.dir) == before


def test_audit_catches_goals_json_edited_with_its_digest_recomputed(history):
    fab = history
    path = fab.dir / "goals.json"
    plan = json.loads(path.read_text())
    plan["goals"][1]["status"] = "complete"
    plan["goals"][1]["evidence"] = "it works"
    plan["digest"] = engine.canonical_digest(plan)
    path.write_text(json.dumps(plan))
    r = fab("audit")
    assert_damaged(r, "goals.json disagrees with the replay of ledger.jsonl up to line 8",
                   "goals[G002].status is 'complete', the ledger says 'failed'")


def test_audit_reports_a_torn_tail_as_never_acknowledged_and_trusts_the_rest(history):
    """The engine's choice: an unterminated last line is a write that never completed (it was
    never acknowledged), so audit exits 0 and says so; the next writing command moves it aside."""
    fab = history
    with open(ledger_path(fab.dir), "ab") as f:
        f.write(b'{"seq":9,"ts":"2026')
    before = state_files(fab.dir)
    r = fab("audit")
    assert r.code == 0, r
    assert "torn tail: 19 bytes after the last event" in r.out
    assert fab("audit", "--json").json["torn_tail_bytes"] == 19
    assert state_files(fab.dir) == before  # audit does not move it; it only reports


@pytest.mark.parametrize("line", [b'{"seq":9,"ts', b">>>>>>> feature"],
                         ids=["half an event", "a merge conflict marker"])
def test_a_whole_last_line_that_is_no_event_is_damage_not_a_torn_write(history, line):
    """A newline-terminated line was written whole: one that is no event is an edit or a merge
    gone wrong, never moved aside as a torn write (only an unterminated tail is one)."""
    fab = history
    with open(ledger_path(fab.dir), "ab") as f:
        f.write(line + b"\n")
    assert_damaged(fab("audit"), "ledger.jsonl line 9: not a ledger event")
    before = state_files(fab.dir)
    r = fab("next")
    assert r.code == 3 and "not a ledger event" in r.err, r
    assert state_files(fab.dir) == before  # nothing moved aside, nothing written


def test_audit_treats_an_unterminated_last_line_as_torn(history):
    fab = history
    with open(ledger_path(fab.dir), "ab") as f:
        f.write(b'{"seq":9,"ts')
    j = fab("audit", "--json").json
    assert j["ok"] is True and j["torn_tail_bytes"] == len(b'{"seq":9,"ts')


def test_audit_require_complete_fails_a_trusted_incomplete_plan(history):
    fab = history
    r = fab("audit", "--require-complete")
    assert r.code == 1, r
    assert "trusted but incomplete" in r.err and "G002 [failed]" in r.err
    assert "G003 [pending]" in r.err
    j = fab("audit", "--require-complete", "--json").json
    assert j["ok"] is False and j["error"] == {
        "code": "incomplete", "exit": 1, "message": j["error"]["message"],
        "commands": ["goals.py next"]}  # the plan's next step, whole: G002 reopens
    assert j["event_count"] == 8  # the report still comes with the refusal


def test_audit_require_complete_passes_a_complete_plan(fab):
    make_plan(fab, 2)
    complete(fab, "G001")
    complete(fab, "G002", final=True)
    r = fab("audit", "--require-complete")
    assert r.code == 0, r
    assert "plan: 2/2 done" in r.out
    assert fab("audit", "--require-complete", "--json").json["complete"] is True


# audit --since: history only grew ##########################################


@pytest.fixture
def green_head(history):
    """The head CI kept from its last green run, then more work on top."""
    fab = history
    head = re.search(r"head: (\d+:[0-9a-f]{64})", fab("audit").out).group(1)
    assert head == head_of(fab.dir)
    fab("next")
    fab("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "done now")
    return fab, head


def test_audit_since_accepts_a_ledger_that_only_grew(green_head):
    fab, head = green_head
    assert fab("audit", "--since", head).code == 0
    assert fab("audit", "--since", head.split(":")[1]).code == 0
    assert fab("audit", "--since", head_of(fab.dir)).code == 0


def rewrite_history_from_scratch(fab, drop_after=None):
    """What a careful forger does: rebuild a legal history with fresh timestamps (so fresh
    hashes), and regenerate goals.json from it with `rebuild`."""
    events = ledger(fab.dir)
    if drop_after is not None:
        events = events[:drop_after]
    events = [dict(ev, ts=ev["ts"].replace("+00:00", "1+00:00")[:26] + "+00:00")
              for ev in events]
    for ev in events:
        if ev["event"] == "checkpoint" and ev["status"] == "failed":
            ev["evidence"] = "all fine"  # the embarrassing part of history, rewritten
    write_lines(fab.dir, rechain(events))
    (fab.dir / "goals.json").unlink()
    assert fab("rebuild").code == 0
    assert fab("audit").code == 0  # legal-looking on its own


@pytest.mark.parametrize("form", ["seq:hash", "hash"])
def test_audit_since_catches_a_ledger_rechained_from_scratch(green_head, form):
    fab, head = green_head
    rewrite_history_from_scratch(fab)
    since = head if form == "seq:hash" else head.split(":")[1]
    r = fab("audit", "--since", since)
    if form == "seq:hash":
        assert_damaged(r, "ledger.jsonl line 8 no longer hashes to", head[2:18],
                       "history before it was rewritten")
    else:
        assert_damaged(r, f"--since {head[2:18]}", "no line hashes to it", "re-written")
    assert fab("audit", "--since", since, "--json").json["error"]["code"] == "history_rewritten"


@pytest.mark.parametrize("form", ["seq:hash", "hash"])
def test_audit_since_catches_a_truncated_and_rechained_ledger(green_head, form):
    fab, head = green_head
    rewrite_history_from_scratch(fab, drop_after=5)
    since = head if form == "seq:hash" else head.split(":")[1]
    r = fab("audit", "--since", since)
    assert_damaged(r, "line 8 does not exist" if form == "seq:hash" else "no line hashes to it",
                   "truncated or re-written")


def test_audit_since_refuses_a_malformed_position(history):
    r = history("audit", "--since", "eight:abc")
    assert r.code == 2 and "SEQ:HASH" in r.err, r


# run logs: the ledger holds each log's digest ##############################


def test_audit_catches_an_edited_run_log(history):
    fab = history
    log = fab.dir / "runs" / "7-G002.log"
    assert log.read_bytes() == b"hello\n"
    assert fab("audit").code == 0
    log.write_bytes(b"hellO\n")
    assert_damaged(fab("audit"), "ledger.jsonl line 7: runs/7-G002.log does not match the "
                                      "sha256")


def test_audit_accepts_a_run_log_that_is_absent_and_counts_it(history):
    """The engine's choice: logs may not be committed; their digests stay in the ledger."""
    fab = history
    (fab.dir / "runs" / "7-G002.log").unlink()
    r = fab("audit", "--json")
    assert r.code == 0 and r.json["missing_logs"] == 1, r


def test_audit_checks_each_runs_own_log_and_ignores_other_files(history):
    """audit reads the log each run names (runs/<seq>-<story>.log): files named after another
    event, a huge number or no number are not logs, and an edited log is still caught beside
    them; a log that is absent is counted, not read."""
    fab = history
    runs = fab.dir / "runs"
    for name in ("3-G001.log", "9" * 200 + "-G002.log", "\u0667-G002.log", "notes.txt",
                 "07-G002.log", "-G002.log"):
        (runs / name).write_bytes(b"x")
    r = fab("audit", "--json")
    assert r.code == 0 and r.json["run_count"] == 1 and r.json["missing_logs"] == 0, r
    (runs / "7-G002.log").rename(runs / "7-G002.log.bak")
    r = fab("audit", "--json")
    assert r.code == 0 and r.json["missing_logs"] == 1, r
    (runs / "7-G002.log.bak").rename(runs / "7-G002.log")
    (runs / "7-G002.log").write_bytes(b"hellO\n")
    assert_damaged(fab("audit"), "ledger.jsonl line 7: runs/7-G002.log does not match")


# rebuild ####################################################################


def bak_files(state_dir):
    return sorted(p.name for p in Path(state_dir).iterdir()
                  if re.fullmatch(r"goals\.json\.\d{8}T\d{6}Z\.bak", p.name))


def test_rebuild_regenerates_a_deleted_snapshot_byte_for_byte(history):
    fab = history
    original = (fab.dir / "goals.json").read_bytes()
    (fab.dir / "goals.json").unlink()
    r = fab("rebuild")
    assert r.code == 0, r
    assert "rebuilt goals.json from 8 ledger events." in r.out
    assert (fab.dir / "goals.json").read_bytes() == original
    assert bak_files(fab.dir) == []
    assert fab("audit").code == 0


@pytest.mark.parametrize("damage", ["garbage", "edited"])
def test_rebuild_replaces_a_damaged_snapshot_and_keeps_the_old_one(history, damage):
    fab = history
    path = fab.dir / "goals.json"
    original = path.read_bytes()
    bad = b"{not json" if damage == "garbage" else original.replace(b'"failed"', b'"complete"', 1)
    path.write_bytes(bad)
    assert fab("status").code == 3
    r = fab("rebuild")
    assert r.code == 0, r
    assert path.read_bytes() == original
    baks = bak_files(fab.dir)
    assert len(baks) == 1 and (fab.dir / baks[0]).read_bytes() == bad
    assert f"the old one is kept as {baks[0]}" in r.out
    assert fab("audit").code == 0 and fab("status").code == 0


def test_rebuild_never_overwrites_an_earlier_backup(history, monkeypatch):
    fab = history
    frozen = time.gmtime()
    monkeypatch.setattr(engine.time, "gmtime", lambda *a: frozen)  # all of it within one second
    path = fab.dir / "goals.json"
    first = path.read_bytes()
    assert fab("rebuild").code == 0
    assert fab("next").code == 0  # G002 again: a different snapshot
    second = path.read_bytes()
    assert fab("rebuild").code == 0
    kept = sorted(p.read_bytes() for p in fab.dir.iterdir() if ".bak" in p.name)
    assert kept == sorted([first, second])


def test_rebuild_refuses_a_damaged_ledger_and_changes_nothing(history):
    fab = history
    lines = raw_lines(fab.dir)
    lines[2] = edit_one_character(lines[2])
    write_lines(fab.dir, lines)
    (fab.dir / "goals.json").unlink()  # nothing else in the way: the ledger is the reason
    before = state_files(fab.dir)
    r = fab("rebuild")
    assert_damaged(r, "ledger.jsonl line 4: the hash chain is broken")
    assert state_files(fab.dir) == before
    assert bak_files(fab.dir) == []


def test_rebuild_moves_a_torn_tail_aside_and_rebuilds_from_the_rest(history):
    fab = history
    original = (fab.dir / "goals.json").read_bytes()
    with open(ledger_path(fab.dir), "ab") as f:
        f.write(b'{"seq":9,"ts":"2026')
    (fab.dir / "goals.json").unlink()
    r = fab("rebuild")
    assert r.code == 0, r
    assert "moved to ledger.jsonl.broken" in r.err
    assert (fab.dir / "ledger.jsonl.broken").read_bytes() == b'{"seq":9,"ts":"2026\n'
    assert (fab.dir / "goals.json").read_bytes() == original
    assert fab("audit", "--json").json["torn_tail_bytes"] == 0


def test_rebuild_refuses_to_cut_a_last_line_the_snapshot_reflects(history):
    fab = history
    lines = raw_lines(fab.dir)
    lines[-1] = lines[-1][:-4]  # the acknowledged checkpoint of G002, damaged
    write_lines(fab.dir, lines)
    assert fab("audit").code == 3
    before = state_files(fab.dir)
    r = fab("rebuild")
    assert r.code == 3, r
    assert "line 8" in r.err or "reflects event 8" in r.err
    assert state_files(fab.dir) == before


# log ########################################################################


@pytest.fixture
def full_history(fab):
    """Every kind of event: rounds, a failed run, a block and a decision, a verdict, --run."""
    r = fab("create", "--brief", "a plan", "--goal", "Parser::parse", "--goal", "Client::call",
            "--goal", "Docs::write", "--goal", "Gate::verify", "--judge", "G003")
    assert r.code == 0, r
    fab("next")
    fab("checkpoint", "--id", "G001", "--status", "failed", "--evidence", "missing tests")
    fab("next")
    fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "wrote parser")
    fab("next")
    assert fab("verify", "--id", "G002", "--verify-cmd", "exit 3").code == 1
    fab("checkpoint", "--id", "G002", "--status", "blocked", "--evidence", "needs an API key")
    fab("decide", "--id", "G002", "accept", "--note", "a human says fine")
    fab("next")
    fab("checkpoint", "--id", "G003", "--status", "complete", "--evidence", "wrote docs")
    assert fab("verdict", "--id", "G003", "achieved", "--evidence", "read them",
               "--agent", "judge-1").code == 0
    fab("next")
    r = fab("checkpoint", "--id", "G004", "--status", "complete", "--run", "--verify-cmd",
            "echo ok", "--evidence", "gate passed")
    assert r.code == 0, r
    assert len(ledger(fab.dir)) == 15
    return fab


def test_log_shows_the_history_in_readable_lines(full_history):
    fab = full_history
    r = fab("log")
    assert r.code == 0, r
    lines = r.out.splitlines()
    assert len(lines) == 15
    for i, line in enumerate(lines, 1):
        assert re.match(rf"#{i}  \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC  ", line), line
    expected = {
        1: "plan created — 4 stories: a plan",
        2: "G001 started, round 1",
        3: "G001 checkpoint failed — evidence: missing tests",
        4: "G001 started, round 2",
        5: "G001 checkpoint complete — evidence: wrote parser",
        7: "G002 run `exit 3` → exit 3",
        8: "G002 checkpoint blocked — evidence: needs an API key",
        9: "G002 decision: accept — a human says fine",
        11: "G003 checkpoint complete — evidence: wrote docs",
        12: "G003 verdict achieved by judge-1 — read them",
        14: "G004 run `echo ok` → exit 0",
        15: "G004 checkpoint complete — evidence: gate passed · verify-cmd: echo ok",
    }
    for n, text in expected.items():
        assert text in lines[n - 1], (n, lines[n - 1])
    assert "log runs/7-G002.log" in lines[6] and "log runs/14-G004.log" in lines[13]


def test_log_id_shows_only_that_story(full_history):
    fab = full_history
    r = fab("log", "--id", "G001")
    assert r.code == 0, r
    lines = r.out.splitlines()
    assert [line.split()[0] for line in lines] == ["#1", "#2", "#3", "#4", "#5"]
    assert "G002" not in r.out and "G003" not in r.out
    j = fab("log", "--id", "G002", "--json").json
    assert [ev["seq"] for ev in j["events"]] == [1, 6, 7, 8, 9]


def test_log_json_gives_the_events(full_history):
    fab = full_history
    j = fab("log", "--json").json
    assert j["ok"] is True and j["events"] == ledger(fab.dir)


@pytest.mark.parametrize("damage", [b"{not json", b"{}"])
def test_log_reads_the_ledger_even_when_goals_json_is_damaged(full_history, damage):
    fab = full_history
    (fab.dir / "goals.json").write_bytes(damage)
    r = fab("log")
    assert r.code == 0, r
    assert len(r.out.splitlines()) == 15


def test_log_id_refuses_an_unknown_story(full_history):
    r = full_history("log", "--id", "G999")
    assert r.code == 1 and "G999 not found." in r.err, r


def test_log_refuses_a_damaged_line(full_history):
    fab = full_history
    lines = raw_lines(fab.dir)
    lines[4] = b"not an event"
    write_lines(fab.dir, lines)
    assert_damaged(fab("log"), "ledger.jsonl line 5: not a ledger event")


# guard: the Stop hook #######################################################


def stop_payload(cwd, active):
    """The Stop hook input as Claude Code's hooks reference documents it."""
    return json.dumps({"session_id": "abc123", "transcript_path": "/tmp/abc123.jsonl",
                       "cwd": str(cwd), "permission_mode": "default",
                       "hook_event_name": "Stop", "stop_hook_active": active}).encode()


@pytest.fixture
def guard(fab, tmp_path_factory):
    """Runs the real guard, from a directory other than the project, fed the payload on stdin."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")

    def run(active=False, raw=None, env=None):
        data = stop_payload(fab.root, active) if raw is None else raw
        return run_cli("guard", cwd=elsewhere, input=data, env=env)
    return run


def blocked_reason(r):
    assert r.code == 0, r
    assert r.out.endswith("\n") and r.out.count("\n") == 1, r  # exactly one JSON object
    obj = json.loads(r.out)
    assert set(obj) == {"decision", "reason"} and obj["decision"] == "block", obj
    return obj["reason"]


def assert_allows(r):
    assert r.code == 0, r
    if r.out.strip():
        obj = json.loads(r.out)
        assert "decision" not in obj, obj
    return json.loads(r.out) if r.out.strip() else None


@pytest.mark.parametrize("active", [False, True])
def test_guard_blocks_while_a_story_is_in_progress_naming_the_exact_command(fab, guard, active):
    make_plan(fab, 3)
    fab("next")
    reason = blocked_reason(guard(active=active))
    assert "G001 \"S1\" is still in progress" in reason
    assert f"{CLI} checkpoint --id G001 --status complete --evidence" in reason
    events = ledger(fab.dir)
    assert events[-1]["event"] == "guard_block" and events[-1]["reason"] == reason


def test_guard_holds_back_a_named_agent_whose_story_is_in_progress(fab, guard):
    """The guard cannot tell who stops: a story an agent holds keeps it from stopping, as
    before status learned to hand an unnamed caller only its own step."""
    make_plan(fab, 3)
    assert fab("next", "--agent", "alice").code == 0
    reason = blocked_reason(guard())
    assert "G001 \"S1\" is still in progress" in reason, reason
    assert "--agent alice" in reason, reason


def test_guard_blocks_while_work_is_ready_naming_next(fab, guard):
    make_plan(fab, 3)
    complete(fab, "G001")
    reason = blocked_reason(guard())
    assert "G002 \"S2\" is ready" in reason and f"Run: {CLI} next" in reason


@pytest.mark.parametrize("situation", ["complete", "blocked", "no_plan", "no_state_dir"])
def test_guard_lets_the_agent_stop(fab, guard, situation):
    if situation == "complete":
        make_plan(fab, 2)
        complete(fab, "G001")
        complete(fab, "G002", final=True)
    elif situation == "blocked":
        make_plan(fab, 3)
        fab("next")
        fab("checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "impossible")
    elif situation == "review":
        make_plan(fab, 3, "--judge", "G001")
        fab("next")
        fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "done")
    elif situation == "no_plan":
        fab.dir.mkdir()
    before = state_files(fab.dir)
    for active in (False, True):
        assert assert_allows(guard(active=active)) is None
    assert state_files(fab.dir) == before


@pytest.mark.parametrize("raw", [b"", b"   \n", b"garbage{", b"[1, 2]", b'"Stop"', b"null",
                                 b"\xff\xfe"])
def test_guard_never_blocks_on_empty_or_malformed_stdin(fab, guard, raw):
    make_plan(fab, 3)
    fab("next")
    before = state_files(fab.dir)
    r = run_cli("guard", cwd=fab.root, input=raw)  # in the project: only the input is wrong
    assert r.code == 0 and r.out == "" and "Traceback" not in r.err, r
    assert state_files(fab.dir) == before


def test_guard_finds_the_state_through_the_payload_cwd_not_its_own(fab, guard, tmp_path_factory):
    make_plan(fab, 3)
    fab("next")
    assert "G001" in blocked_reason(guard())  # run from `elsewhere`, which holds no plan
    other = tmp_path_factory.mktemp("other-project")
    (other / ".git").mkdir()
    r = run_cli("guard", cwd=fab.root, input=stop_payload(other, False))
    assert assert_allows(r) is None  # the payload's project has no plan, whatever cwd holds


def test_guard_blocks_at_most_the_bound_in_a_row_then_lets_go(fab, guard):
    make_plan(fab, 3)
    fab("next")
    assert "[guard block 1 of at most 3 in a row]" in blocked_reason(guard(active=False))
    assert "[guard block 2 of at most 3 in a row]" in blocked_reason(guard(active=True))
    assert "[guard block 3 of at most 3 in a row]" in blocked_reason(guard(active=True))
    for _ in range(2):
        msg = assert_allows(guard(active=True))
        assert "let the agent stop after 3 blocks in a row" in msg["systemMessage"]
    said = re.search(r"— `(.+ status)` says where it stands\.$", msg["systemMessage"])
    assert said, msg  # a whole command, for the human, run as printed from the project
    p = subprocess.run(["sh", "-c", said.group(1)], cwd=str(fab.root), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("fablize: 0/3 complete"), p
    # a fresh stop (not caused by a block) counts from 1 again
    assert "[guard block 1 of at most 3 in a row]" in blocked_reason(guard(active=False))
    assert "[guard block 2 of at most 3 in a row]" in blocked_reason(guard(active=True))
    # progress — any other event — resets the count
    assert fab("verify", "--id", "G001", "--verify-cmd", "true").code == 0
    assert "[guard block 1 of at most 3 in a row]" in blocked_reason(guard(active=True))
    kinds = [ev["event"] for ev in ledger(fab.dir)]
    assert kinds.count("guard_block") == 6
    assert fab("audit").code == 0


def test_guard_bound_is_set_by_fablize_guard_max(fab, guard):
    make_plan(fab, 3)
    fab("next")
    env = {"FABLIZE_GUARD_MAX": "1"}
    assert "[guard block 1 of at most 1 in a row]" in blocked_reason(guard(False, env=env))
    assert "after 1 blocks" in assert_allows(guard(True, env=env))["systemMessage"]
    assert "[guard block 1 of at most 1 in a row]" in blocked_reason(guard(False, env=env))


def test_guard_never_blocks_while_the_lock_is_held(fab, guard):
    make_plan(fab, 3)
    fab("next")
    before = state_files(fab.dir)
    with open(fab.dir / "lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        r = guard(env={"FABLIZE_LOCK_TIMEOUT": "0.05"})
    msg = assert_allows(r)
    assert "another fablize command holds" in msg["systemMessage"]
    assert state_files(fab.dir) == before


@pytest.mark.parametrize("damage", [b"{broken", b"{}"])
def test_guard_never_blocks_on_a_damaged_state(fab, guard, damage):
    make_plan(fab, 3)
    fab("next")
    (fab.dir / "goals.json").write_bytes(damage)
    before = state_files(fab.dir)
    msg = assert_allows(guard())
    assert msg["systemMessage"].startswith("fablize guard: goals.json")
    assert state_files(fab.dir) == before


# report #####################################################################


def table_rows(text, header):
    """The rows of the Markdown table under `header`, each split on its unescaped pipes."""
    lines = text.splitlines()
    i = lines.index(header)
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


STORY_HEADER = "| Story | Title | Status | Rounds | Evidence | Grade |"
RUN_HEADER = "| Event | Story | Command | Result | Duration | Output sha256 |"


@pytest.fixture
def reported(fab):
    r = fab("create", "--brief", "ship it", "--goal", "Parser::p", "--goal", "Client::c",
            "--goal", "Glue::g", "--goal", "Gate::v", "--parallel", "--after", "G003=G001,G002")
    assert r.code == 0, r
    fab("next")
    fab("checkpoint", "--id", "G001", "--status", "failed", "--evidence", "no tests")
    fab("next")
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--run", "--verify-cmd",
               "echo parsed", "--evidence", "parser works").code == 0
    assert fab("verify", "--id", "G002", "--verify-cmd", "exit 4").code == 1
    return fab


def test_report_has_progress_stories_runs_head_and_dependency_graph(reported):
    fab = reported
    r = fab("report")
    assert r.code == 0, r
    md = r.out
    assert md.startswith("# fablize report — ship it\n")
    assert f"`{'█' * 5}{'░' * 15}` **1/4 done** (25%)" in md
    rows = table_rows(md, STORY_HEADER)
    assert rows == [["G001", "Parser", "✓ complete", "2", "parser works", "witnessed"],
                    ["G002", "Client", "· pending", "0", "", ""],
                    ["G003", "Glue", "· pending", "0", "", ""],
                    ["G004", "Gate", "· pending", "0", "", ""]]
    runs = [ev for ev in ledger(fab.dir) if ev["event"] == "verify_run"]
    assert table_rows(md, RUN_HEADER) == [
        [str(ev["seq"]), ev["id"], f"`{ev['cmd']}`", result, f"{ev['duration_s']} s",
         f"`{ev['sha256'][:16]}`"]
        for ev, result in zip(runs, ["pass: exit 0 (exit code only)",
                                     "FAIL: exit 4 (exit code only)"])]
    assert f"Ledger head: `{head_of(fab.dir)}`" in md
    graph = md.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert graph.startswith("graph TD\n")
    edges = set(re.findall(r"^  (G\d{3}) --> (G\d{3})$", graph, re.M))
    assert edges == {("G001", "G003"), ("G002", "G003"), ("G001", "G004"), ("G002", "G004"),
                     ("G003", "G004")}
    for sid in ("G001", "G002", "G003", "G004"):
        assert re.search(rf'^  {sid}\["{sid} ', graph, re.M)


def test_report_out_writes_the_file(reported, tmp_path):
    fab = reported
    out = tmp_path / "summary.md"
    out.write_text("old content that --out replaces\n")
    r = fab("report", "--out", out)
    assert r.code == 0 and f"report written to {out}" in r.out, r
    text = out.read_text(encoding="utf-8")
    assert text == fab("report", "--json").json["markdown"]
    assert text.startswith("# fablize report")


def test_report_appends_to_the_github_step_summary(reported, tmp_path, monkeypatch):
    fab = reported
    summary = tmp_path / "step_summary.md"
    summary.write_text("## Tests\n\nall passed\n", encoding="utf-8")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    r = fab("report")
    assert r.code == 0, r
    text = summary.read_text(encoding="utf-8")
    assert text.startswith("## Tests\n\nall passed\n# fablize report — ship it\n")
    assert STORY_HEADER in text
    fab("report")
    assert summary.read_text(encoding="utf-8").count("# fablize report") == 2


def test_report_heading_starts_a_line_in_the_step_summary(reported, tmp_path, monkeypatch):
    fab = reported
    summary = tmp_path / "step_summary.md"
    summary.write_text("all passed", encoding="utf-8")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert fab("report").code == 0
    assert "\n# fablize report" in summary.read_text(encoding="utf-8")


def test_report_user_text_cannot_break_its_tables(fab):
    hostile = "a | b `c` <script>alert(1)</script>\n| G999 | forged | ✓ complete | 1 | x |"
    r = fab("create", "--brief", hostile, "--goal", f"{hostile}::objective", "--goal", "Gate::v")
    assert r.code == 0, r
    fab("next")
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--run", "--verify-cmd",
               "echo 'x|y' | cat", "--evidence", hostile).code == 0
    md = fab("report").out
    for line in md.splitlines():
        assert not line.startswith("| G999"), line
    stories = table_rows(md, STORY_HEADER)
    assert [row[0] for row in stories] == ["G001", "G002"]
    assert all(len(row) == 6 for row in stories)
    assert stories[0][2] == "✓ complete" and stories[0][3] == "1"
    runs = table_rows(md, RUN_HEADER)
    assert len(runs) == 1 and len(runs[0]) == 6 and runs[0][3] == "pass: exit 0 (exit code only)"
    assert "<script>" not in md
    graph = md.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert set(re.findall(r"^  (\S+) --> (\S+)$", graph, re.M)) == {("G001", "G002")}
    assert md.count("```") == 2  # the user's backticks open no code block


def test_audit_require_logs_refuses_a_run_whose_log_is_missing(fab):
    make_plan(fab, 1, "--verify", "true")
    assert fab("next").code == 0
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ok").code == 0
    assert fab("audit", "--require-logs").code == 0
    log = next((fab.dir / "runs").glob("*.log"))
    log.unlink()
    before = state_files(fab.dir)
    r = fab("audit", "--require-logs", "--json")
    assert r.code == 1 and r.json["error"]["code"] == "missing_logs", r
    assert "1 verification run log is missing" in r.json["error"]["message"]
    assert state_files(fab.dir) == before
    assert fab("audit").code == 0  # without the option a missing log is only reported
