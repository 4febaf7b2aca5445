"""One engine: one replay path that checks every field, a snapshot that holds the present, readers
that take no lock, one answer to "what next", and nothing that waits on a FIFO."""

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from conftest import (encode, git, engine, ledger, make_plan, raw_lines, rechain, run_cli,
                      sha256_hex, state_files, write_lines)



def rewrite_event(state_dir, mutate, line):
    """Change event `line` (1-based) with `mutate(ev)` and re-chain the ledger, as a forger who
    read DESIGN.md would: the chain is valid, only the content lies."""
    events = ledger(state_dir)
    mutate(events[line - 1])
    write_lines(state_dir, rechain(events))
    (Path(state_dir) / "goals.json").unlink()  # only the ledger is the forger's story


@pytest.fixture
def history(fab):
    """plan_created, story_started, verify_run, checkpoint, story_started (G002), in a plan with a
    frozen check on G001 and an unverifiable one on G002."""
    make_plan(fab, 3, "--check", "G001=true", "--check", "G002=no-such-program-xyz")
    assert fab("next").code == 0
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ok").code == 0
    assert fab("next", "--agent", "ann").code == 0
    return fab


FORGERIES = {
    # name: (line, mutation, what the message names)
    "count": (1, lambda e: e.update(count=99), "count is 99 but the event lists 3 stories"),
    "plan_id": (1, lambda e: e.update(plan_id="../../x"), "plan_id"),
    "extra_field": (1, lambda e: e.update(approved_by="ci"), "approved_by"),
    "story_extra": (1, lambda e: e["stories"][0].update(done=True), "stories[0].done"),
    "unverifiable": (1, lambda e: e["unverifiable"][0].update(cmd="true"),
                     "unverifiable check G002/0"),
    "ts": (2, lambda e: e.update(ts="yesterday"), "is not a UTC timestamp"),
    "round": (2, lambda e: e.update(round=42), "round 42"),
    "title": (2, lambda e: e.update(title="something else"), "'something else'"),
    "agent_blank": (5, lambda e: e.update(agent=" "), "an agent name is blank"),
    "run_cmd": (3, lambda e: e.update(cmd="echo ok"), "not that frozen check"),
    "run_check_index": (3, lambda e: e.update(check=5), "not that frozen check"),
    "run_log": (3, lambda e: e.update(log="../../etc/passwd"), "is not runs/<seq>-<story>.log"),
    "run_log_null": (3, lambda e: e.update(log=None), "log"),
    "run_digest": (3, lambda e: e.update(sha256="nothex"), "out of range"),
    "run_bytes": (3, lambda e: e.update(bytes=-1), "out of range"),
    "run_after_seq": (3, lambda e: e.update(after_seq=99), "out of range"),
    "run_type": (3, lambda e: e.update(exit_code="0"), "exit_code"),
    "checkpoint_runs": (4, lambda e: e.update(runs=[3, 3]), "cites runs"),
    "checkpoint_run_false": (4, lambda e: e.update(run=False), "run is false"),
    "event_kind": (4, lambda e: e.update(event="approve"), "unknown event"),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_rechained_ledger_with_a_value_fablize_would_not_write_fails_audit_naming_the_line(
        history, name):
    line, mutate, needle = FORGERIES[name]
    rewrite_event(history.dir, mutate, line)
    before = state_files(history.dir)
    for args in (["audit"], ["rebuild"], ["log"], ["report"]):
        r = history(*args)
        assert r.code == 3, (args, r)
        assert f"ledger.jsonl line {line}: " in r.err and needle in r.err, (args, r)
        # one line, then its way out, a human's: a new plan (git holds no copy here)
        assert r.err.splitlines()[1:] == ['  goals.py create --force --brief "<brief>" '
                                          '--goal "<title>::<objective>"'], (args, r)
        assert state_files(history.dir) == before, args
    r = history("audit", "--json")
    assert r.code == 3 and r.json["error"]["code"] in ("bad_event", "unknown_event"), r


def test_the_untouched_history_passes_every_reader(history):
    rewrite_event(history.dir, lambda e: None, 1)  # re-chaining alone changes nothing
    for args in (["audit"], ["log"], ["report"], ["rebuild"], ["status"]):
        assert history(*args).code == 0, args


def test_a_non_finite_run_duration_is_damage_not_invalid_json(tmp_path):
    """duration_s 1e999 passes `ev["duration_s"] < 0`: replay accepted it, and status/log --json
    then printed `Infinity`, which is not JSON (RFC 8259; jq, JSON.parse and Go refuse it).
    Failed before its fix."""
    git(tmp_path, "init", "-q")
    assert run_cli("create", "--brief", "b", "--goal", "x::y", "--check", "G001=false",
                   cwd=tmp_path).code == 0
    assert run_cli("next", cwd=tmp_path).code == 0
    run_cli("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ok", cwd=tmp_path)
    state = tmp_path / ".fablize"
    write_lines(state, rechain([re.sub(rb'"duration_s":[0-9.e-]+', b'"duration_s":1e999', line)
                                for line in raw_lines(state)]))
    (state / "goals.json").unlink()
    r = run_cli("rebuild", cwd=tmp_path)
    assert r.code == 3, r

    def strict(text):
        return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    for cmd in (["status", "--json"], ["log", "--json"]):
        strict(run_cli(*cmd, cwd=tmp_path).out)


@pytest.mark.parametrize("args", [["status"], ["next"], ["log"], ["report"], ["audit"],
                                  ["judge-packet", "--id", "G001"], ["rebuild"],
                                  ["checkpoint", "--id", "G001", "--status", "complete",
                                   "--evidence", "x"]])
def test_a_fifo_in_place_of_the_ledger_is_damage_and_never_a_hang(fab, args):
    make_plan(fab, 2)
    (fab.dir / "ledger.jsonl").unlink()
    os.mkfifo(fab.dir / "ledger.jsonl")
    r = run_cli(*args, cwd=fab.root)  # a read of the FIFO would wait for a writer: run_cli's guard
    assert r.code == 3, r
    assert "ledger.jsonl is not a regular file" in r.err, r  # then the step: moved aside
    assert r.err.splitlines()[1:] == ["  mv .fablize/ledger.jsonl .fablize/ledger.jsonl.aside"], r


def test_a_fifo_in_place_of_the_snapshot_is_damage_and_never_a_hang(fab):
    make_plan(fab, 2)
    (fab.dir / "goals.json").unlink()
    os.mkfifo(fab.dir / "goals.json")
    for args in (["status"], ["next"], ["audit"]):
        r = run_cli(*args, cwd=fab.root)
        assert r.code == 3 and "goals.json is not a regular file" in r.err, (args, r)


def test_the_snapshot_keeps_only_the_latest_run_of_each_check(fab):
    make_plan(fab, 2, "--check", "G001=true", "--check", "G001=test -d .")
    assert fab("next").code == 0
    for _ in range(4):
        assert fab("verify", "--id", "G001").code == 0
    snap = json.loads((fab.dir / "goals.json").read_text())
    runs = snap["goals"][0]["runs"]
    assert [r["check"] for r in runs] == [0, 1]
    assert [r["seq"] for r in runs] == [9, 10]  # the fourth verify's two runs
    assert sum(1 for e in ledger(fab.dir) if e["event"] == "verify_run") == 8  # history stays
    assert fab("audit").code == 0
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ok")
    assert r.code == 0, r


def test_the_snapshot_digest_covers_its_own_bytes(fab):
    make_plan(fab, 2)
    raw = (fab.dir / "goals.json").read_bytes()
    assert raw.startswith(b'{"digest":"')
    assert raw[11:75].decode() == hashlib.sha256(raw[77:]).hexdigest()
    edited = raw.replace(b'"S1"', b'"S9"')
    (fab.dir / "goals.json").write_bytes(edited)
    r = fab("status")
    assert r.code == 3 and "goals.json was changed outside fablize" in r.err, r


def test_a_version_1_snapshot_with_every_run_still_loads_and_is_rewritten(fab):
    make_plan(fab, 2, "--check", "G001=true")
    assert fab("next").code == 0
    for _ in range(3):
        assert fab("verify", "--id", "G001").code == 0
    snap = json.loads((fab.dir / "goals.json").read_bytes())
    # the format fablize 1 wrote: every run of the round, a digest over sorted keys
    runs = [e for e in ledger(fab.dir) if e["event"] == "verify_run"]
    snap["goals"][0]["runs"] = [dict({k: e.get(k) for k in engine.RUN_FIELDS}, ok=True)
                                for e in runs]
    snap["schema_version"] = 1
    snap.pop("digest")
    snap["digest"] = engine.canonical_digest(snap)
    (fab.dir / "goals.json").write_text(json.dumps(snap))
    before = state_files(fab.dir)
    r = fab("status")
    assert r.code == 0 and "format of fablize 1" in r.err and r.err.count("\n") == 1, r
    assert state_files(fab.dir) == before  # a reader writes nothing
    r = fab("audit")
    assert r.code == 0 and "format of fablize 1" in r.out, r
    assert fab("next").code == 0  # a writer rewrites it from the ledger
    new = json.loads((fab.dir / "goals.json").read_bytes())
    assert new["schema_version"] == engine.SNAPSHOT_VERSION and len(new["goals"][0]["runs"]) == 1
    assert fab("audit").json if False else fab("audit").code == 0


def test_readers_answer_while_a_writer_holds_the_lock(fab):
    import fcntl
    make_plan(fab, 2)
    assert fab("next").code == 0
    fd = os.open(fab.dir / "lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        for args in (["status"], ["log"], ["report"], ["audit"], ["judge-packet", "--id", "G001"]):
            # no wait for the lock: one that tried it would give up at once, exit 3
            r = run_cli(*args, cwd=fab.root, env={"FABLIZE_LOCK_TIMEOUT": "0"})
            assert r.code == 0, (args, r)
    finally:
        os.close(fd)


def test_the_backward_tail_read_reads_each_byte_once():
    class Counting(engine.MemoryLedger):
        read_bytes = 0

        def read(self, start, size):
            Counting.read_bytes += size
            return super().read(start, size)

    for mb in (1, 4):
        line = b'{"seq":1,"event":"x","pad":"' + b"x" * (mb << 20) + b'"}'
        data = b'{"seq":0}\n' + line + b"\n"
        Counting.read_bytes = 0
        ledger = Counting(data)
        end, torn = ledger.end()
        assert (end, torn) == (len(data), b"")
        got = list(ledger.backward(end))
        assert got[0] == (10, line) and got[1] == (0, b'{"seq":0}')
        assert Counting.read_bytes <= len(data) + 1  # linear: no chunk is read twice


def test_streaming_batches_hold_every_line_once():
    lines = [b'{"seq":%d}' % i + b"x" * (i * 37 % 5000) for i in range(3000)]
    data = b"".join(x + b"\n" for x in lines)
    ledger = engine.MemoryLedger(data)
    got = [x for batch in ledger.batches(len(data), size=4096) for x in batch]
    assert got == lines


def replayed_line_by_line(data):
    """What replay_all would say of `data`, told by feeding each line alone (Replay.feed: every
    check of every line, no batch): the plan's snapshot bytes, or the damage's message."""
    replay = engine.Replay()
    try:
        for line in data.split(b"\n")[:-1]:
            replay.feed(line, engine.parse_events([line])[0])
    except engine.FablizeError as e:
        return e.message
    replay.plan["ledger"] = replay.position()
    return engine.snapshot_bytes(replay.plan)


def replayed_in_batches(data):
    try:
        replay = engine.replay_all(engine.MemoryLedger(data), len(data))
    except engine.FablizeError as e:
        return e.message
    replay.plan["ledger"] = replay.position()
    return engine.snapshot_bytes(replay.plan)


_ONE_RUN = []  # a plan with one real run, made once for every test that copies it


def runs_of_one_plan(fab, n):
    """(entries, head) for rechain: a plan's events before its first run (head of them), then
    `n` copies of that run, a real one, each an object of its own."""
    if not _ONE_RUN:
        make_plan(fab, 2, "--check", "G001=true")
        assert fab("next").code == 0
        assert fab("verify", "--id", "G001").code == 0
        _ONE_RUN.extend(ledger(fab.dir))
    run = next(e for e in _ONE_RUN if e["event"] == "verify_run")
    entries = json.loads(json.dumps([e for e in _ONE_RUN if e["event"] != "verify_run"]))
    head = len(entries)
    return entries + [json.loads(json.dumps(dict(run, log="AUTO"))) for _ in range(n)], head


BATCH_FORGERIES = {
    # name: what is done to run 137 of 200, in the ledger's second batch of 64 KiB, which the
    # replay parses as one array (every one a run the engine would never write)
    "none": lambda e: None,
    "exit code a bool": lambda e: e.update(exit_code=True),
    "timed_out an int": lambda e: e.update(timed_out=0),
    "duration as text": lambda e: e.update(duration_s="0.1"),
    "a key missing": lambda e: e.pop("tail"),
    "a key added": lambda e: e.update(extra=1),
    "a key renamed": lambda e: e.update(tail2=e.pop("tail")),
    # the same fields in another order: a shape of its own, which fits
    "keys in another order": lambda e: e.update(reversed([*e.items(), e.clear()][:-1])),
    "provenance env a number": lambda e: e["provenance"]["env"].update(PATH=1),
    "provenance dir changed": lambda e: e["provenance"].update(dir="elsewhere"),
    "log of another line": lambda e: e.update(log="runs/3-G001.log"),
    "check out of range": lambda e: e.update(check=5),
    "command not the check": lambda e: e.update(cmd="false"),
    "digest not hex": lambda e: e.update(sha256="z" * 64),
    "time not UTC": lambda e: e.update(ts="2026-12-01T10:00:00"),
    "run before the story started": lambda e: e.update(after_seq=-1),
    "unknown story": lambda e: e.update(id="G009"),
    "unknown kind": lambda e: e.update(event="verify_ran"),
    "seq a bool": None,  # the first line's seq: True equals 1
    "no plan first": None,  # the ledger starts with its story's start, runs behind it
    "a second plan": None,  # run 137 is another plan_created
    # each line must hold one value of its own: run 137 opens a list that the next line, a
    # whole event, closes; the line after it holds two runs, so the lines and the array's
    # values are as many
    "a line hidden in a list": None,
    "a line hidden in a list in a list in a dict": None,
    "two runs on one line": None,  # runs 137 and 138 on one line: one value fewer
    # run 137's seq as text, and a space after run 138, so that its batch is parsed a line at
    # a time: the seq is named as it is when the batch is scanned at once
    "seq as text beside a line parsed alone": None,
}


def hide_a_line(lines, at, hidden=(b"[0", b"]")):
    """`lines` re-chained with line `at` (0-based) swallowing the line after it into what
    `hidden` opens and closes (as the value of a key added last), when it is given, and the two
    runs after those on one line."""
    evs = [json.loads(line) for line in lines]
    head = evs[at]["prev"]
    if hidden:
        opened = encode(dict(evs[at], prev=head))[:-1] + b',"z":' + hidden[0]
        inner = encode(evs[at + 5]) + hidden[1] + b"}"
        first = dict(evs[at + 1], prev=sha256_hex(opened))
        second = dict(evs[at + 2], prev=sha256_hex(inner))
        made = [opened, inner, encode(first) + b"," + encode(second)]
        rest = at + 3
    else:
        first = dict(evs[at], prev=head)
        second = dict(evs[at + 1], prev=sha256_hex(encode(first)))
        made, rest = [encode(first) + b"," + encode(second)], at + 2
    out = lines[:at] + made
    for ev in evs[rest:]:
        out.append(encode(dict(ev, prev=sha256_hex(out[-1]))))
    return out


@pytest.mark.parametrize("name", sorted(BATCH_FORGERIES))
def test_a_batch_replays_as_its_lines_do_one_by_one(fab, name, monkeypatch):
    """replay_all streams the ledger in batches, each scanned at once: whatever a line holds, it
    must end as feeding every line alone would — the same plan, or the same damage named at the
    same line with the same words."""
    entries, head = runs_of_one_plan(fab, 200)
    mutate, target = BATCH_FORGERIES[name], head + 136
    if mutate is not None:
        mutate(entries[target])
    elif name == "a second plan":
        entries[target] = dict(entries[0])
    elif name == "no plan first":
        del entries[0]
    lines = rechain(entries)
    if name == "seq a bool":
        lines[0] = lines[0].replace(b'"seq":1,', b'"seq":true,', 1)
    if name == "a line hidden in a list":
        lines = hide_a_line(lines, target)
    elif name == "a line hidden in a list in a list in a dict":
        lines = hide_a_line(lines, target, (b'{"y":[1,[2', b"]]}"))
    elif name == "two runs on one line":
        lines = hide_a_line(lines, target, None)
    elif name == "seq as text beside a line parsed alone":
        seq = b'"seq":%d,' % (target + 1)
        lines[target] = lines[target].replace(seq, seq.replace(b":", b':"')[:-1] + b'",', 1)
        lines[target + 1] += b" "
    data = b"".join(line + b"\n" for line in lines)
    assert sum(map(len, lines[:target])) > 1 << 16  # past the first batch, parsed line by line
    outcome = replayed_line_by_line(data)
    assert replayed_in_batches(data) == outcome
    assert (type(outcome) is bytes) == (name in ("none", "provenance dir changed",
                                                 "keys in another order")), outcome
    if name.startswith("a line hidden"):
        assert f"line {target + 1}: not a ledger event" in outcome, outcome
    if name == "seq as text beside a line parsed alone":
        assert f"line {target + 1}: seq is '{target + 1}'" in outcome, outcome


class PassCounter(list):
    """A plan's list of stories that counts the passes made over it."""
    passes = 0

    def __iter__(self):
        PassCounter.passes += 1
        return super().__iter__()


def test_replaying_a_worked_plan_passes_over_its_stories_a_bounded_number_of_times(fab):
    """Each start asks which stories are in progress; a pass over the plan for each made the
    replay of a plan worked story by story quadratic in its stories (a 10,000-story plan of
    100,000 events: 7.8 s of CPU where 1.4 s is linear). Counted in passes, not seconds: 600
    stories started twice each (a failed round, then a completed one) and a story added on the
    way pass over the plan a handful of times, however many stories there are."""
    make_plan(fab, 601)
    assert fab("next").code == 0
    assert fab("checkpoint", "--id", "G001", "--status", "failed", "--evidence", "no").code == 0
    assert fab("next").code == 0
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ok").code == 0
    assert fab("add", "--goal", "Later::found on the way").code == 0
    events = ledger(fab.dir)
    created, added = events[0], events[-1]
    block = events[1:5]  # started, failed, started again, complete
    entries = [created]
    for i in range(1, 601):
        entries += [dict(e, id=engine.story_id(i), **({"title": f"S{i}"} if "title" in e else {}))
                    for e in block]
        if i == 300:
            entries.append(added)
    lines = rechain(entries)
    replay = engine.Replay()
    replay.feed(lines[0], json.loads(lines[0]))
    replay.plan["goals"] = PassCounter(replay.plan["goals"])
    PassCounter.passes = 0
    for line in lines[1:]:
        replay.feed(line, json.loads(line))
    assert [s["status"] for s in replay.plan["goals"]][-3:] == ["complete", "pending", "pending"]
    assert [s["id"] for s in replay.plan["goals"]][-2:] == ["G602", "G601"]
    assert 1 <= PassCounter.passes - 1 <= 8, PassCounter.passes  # (-1: the line above)


def test_active_stories_are_in_plan_order_however_they_started(fab):
    """Stories in progress are told in plan order — an added story after the others, before the
    final one — whatever the order they started in."""
    make_plan(fab, 5, "--parallel")
    assert fab("add", "--goal", "Later::found on the way", "--after", "G001").code == 0
    for agent in "abcd":
        assert fab("next", "--agent", agent).code == 0
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ok",
               "--agent", "a").code == 0
    assert fab("next", "--agent", "a").code == 0  # the added G006, after G002–G004 started
    plan = json.loads((Path(fab.dir) / "goals.json").read_bytes())
    assert [s["id"] for s in engine.active_stories(plan)] == ["G002", "G003", "G004", "G006"]
    assert fab("checkpoint", "--id", "G003", "--status", "complete", "--evidence", "ok",
               "--agent", "c").code == 0
    plan = json.loads((Path(fab.dir) / "goals.json").read_bytes())
    assert [s["id"] for s in engine.active_stories(plan)] == ["G002", "G004", "G006"]
    assert [line.split()[1] for line in fab("status").out.splitlines() if "▶" in line] == [
        "G002", "G004", "G006"]


def test_audit_of_many_batches_finds_what_a_scan_of_each_line_finds(fab, tmp_path):
    """audit checks a batch of events at once (secrets asked once per distinct text, logs found
    by set lookups, the trust scan passing over runs like the last clean one): over 300 runs in
    several batches, with a secret, a run made elsewhere, a dirty tree, a run whose log could
    not be made and logs present or edited among them, it must report what a scan of each
    line alone reports, at the same lines."""
    entries, head = runs_of_one_plan(fab, 300)
    token = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    for i in (40, 41, 170):
        entries[head + i]["tail"] = f"token {token}\n"
    entries[head + 200]["provenance"]["dir"] = "elsewhere"
    entries[head + 250].update(git_dirty=True, tree="0" * 40)
    entries[head + 260].update(bytes=0, sha256=engine.EMPTY_SHA256, error="no such program",
                               exit_code=None)
    lines = rechain(entries)
    data = b"".join(line + b"\n" for line in lines)
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    for i in (10, 100, 261, 299):  # logs kept for these runs; the one of run 100 edited
        ev = json.loads(lines[head + i])
        (runs_dir / ev["log"][5:]).write_bytes(b"" if i != 100 else b"edited\n")  # `true`
    for stray in ("notes.txt", "\u00b2-G001.log", "-G001.log"):  # named like no run's log
        (runs_dir / stray).write_bytes(b"x")
    trust = engine.room("trust", "test")
    batched, each = trust.Scan(str(fab.root), None), trust.Scan(str(fab.root), None)
    report = engine.audit_ledger(data, None, runs_dir=str(runs_dir), scan=batched)
    alone = engine.audit_ledger(data, None, runs_dir=str(runs_dir),
                               scan=lambda n, h, ev: each(n, h, ev))  # no batch: line by line
    parsed = [json.loads(line) for line in lines]
    assert report["secret_lines"] == alone["secret_lines"] == [
        ev["seq"] for ev in parsed if ev["event"] == "verify_run" and token in ev["tail"]]
    assert [e.message for e in report["bad_logs"]] == [e.message for e in alone["bad_logs"]]
    assert len(report["bad_logs"]) == 1 and f"line {head + 101}:" in report["bad_logs"][0].message
    assert report["missing_logs"] == alone["missing_logs"] == 300 - 4 - 1  # 4 logs, 1 logless
    assert [r["seq"] for r in report["recent_runs"]] == [r["seq"] for r in alone["recent_runs"]]
    assert len(report["recent_runs"]) == engine.REPORT_RUNS
    for name in ("first", "decisions", "unclean", "flagged", "unrecorded", "dirty"):
        assert getattr(batched, name) == getattr(each, name), name
    assert [f["line"] for f in batched.flagged] == [head + 201]
    assert [d["line"] for d in batched.dirty] == [head + 251]


def test_a_runs_record_holds_run_fields_in_their_order(fab):
    """The verify_run transition writes a run's record out key by key (a dict display, cheaper
    than a comprehension over RUN_FIELDS): its keys must be RUN_FIELDS, in their order, then
    its runner's report (issue 34: optional, absent from older runs), then its verdict; an
    interrupted run's record says so before the report."""
    make_plan(fab, 2, "--check", "G001=true")
    assert fab("next").code == 0
    assert fab("verify", "--id", "G001").code == 0
    run = next(e for e in ledger(fab.dir) if e["event"] == "verify_run")
    plan = None
    for ev in ledger(fab.dir):
        plan = engine.apply_event(plan, ev)
    record = engine.lookup(plan, "G001")["last_run"]
    assert tuple(record) == (*engine.RUN_FIELDS, "report", "ok")
    assert {k: record[k] for k in engine.RUN_FIELDS} == {k: run[k] for k in engine.RUN_FIELDS}
    assert engine.lookup(plan, "G001")["runs"] == [record] and record["ok"] is True
    run = dict(run, interrupted="SIGINT", seq=run["seq"] + 1, log=f"runs/{run['seq'] + 1}-G001.log")
    record = engine.lookup(engine.apply_event(plan, run), "G001")["last_run"]
    assert tuple(record) == (*engine.RUN_FIELDS, "interrupted", "report", "ok")
    assert record["ok"] is False


def test_json_done_is_a_count_and_complete_a_flag_in_every_command(fab):
    make_plan(fab, 2)
    results = [fab("next", "--json"), fab("checkpoint", "--id", "G001", "--status", "complete",
                                          "--evidence", "e", "--json"),
               fab("status", "--json"), fab("audit", "--json")]
    for r in results:
        assert r.json["schema_version"] == engine.SCHEMA_VERSION == 2, r
        assert type(r.json["done"]) is int and type(r.json["complete"]) is bool, r
        assert r.json["total"] == 2, r
    assert [r.json["done"] for r in results] == [0, 1, 1, 1]


# One answer to "what next" ##################################################


def next_of_status(fab):
    line = [x for x in fab("status").out.splitlines() if x.startswith("fablize: next — ")]
    return line[0] if line else None


def guard_reason(fab):
    payload = json.dumps({"cwd": str(fab.root), "stop_hook_active": False})
    r = run_cli("guard", cwd=fab.root, input=payload.encode())
    return json.loads(r.out)["reason"] if r.out.strip() else None


def test_the_guard_names_the_completion_the_final_gate_accepts(fab):
    """The bug this replaces: on an in-progress final story without frozen checks the guard told
    the agent to run a `checkpoint … --evidence` that the verification gate then refused."""
    make_plan(fab, 1)
    assert fab("next").code == 0
    reason = guard_reason(fab)
    assert reason is not None and "--run --verify-cmd" in reason  # witnessed first
    status_next = next_of_status(fab)
    assert "--run --verify-cmd" in status_next
    command = reason.split("then run: ", 1)[1].split(" (or --status", 1)[0]
    argv = command.split(" checkpoint ", 1)[1]
    import shlex
    args = ["checkpoint"] + shlex.split(argv.replace("<evidence>", "done")
                                        .replace("<command>", "true")
                                        .replace("<result>", "3 passed"))
    r = fab(*args)
    assert r.code == 0 and "all stories complete ✓" in r.out, r


def test_status_checkpoint_next_and_the_guard_give_the_same_next_action(fab):
    make_plan(fab, 3, "--parallel")
    assert fab("next").code == 0
    assert "finish G001" in next_of_status(fab)
    assert "G001" in guard_reason(fab) and "still in progress" in guard_reason(fab)
    cp = fab("checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "no API key")
    status_next = next_of_status(fab)
    assert "`goals.py next` (activates G002)" in status_next
    assert cp.out.splitlines()[-1].endswith("next: `goals.py next` (activates G002)"), cp
    assert fab("next").code == 0 and fab("checkpoint", "--id", "G002", "--status", "complete",
                                         "--evidence", "e").code == 0
    # only the blocked story is left before the gate: every command says a human decides
    status_next = next_of_status(fab)
    assert "G001 is blocked (no API key)" in status_next
    nxt = fab("next")
    assert nxt.code == 1 and "G001 is blocked (no API key)" in nxt.err, nxt
    assert "A human must decide, with one of:\n  goals.py decide --id G001 accept" in nxt.err
    assert guard_reason(fab) is None  # a human's turn: the guard lets the agent stop


# Found in review of the speed work: each held before it and must hold after ##################


def resign(fab, plan):
    """goals.json rewritten as the engine writes it (its digest recomputed): a hand-made
    snapshot that passes the digest, as an agent could make one."""
    (fab.dir / "goals.json").write_bytes(engine.snapshot_bytes(plan))


def test_a_last_line_that_is_no_event_is_damage_even_when_the_snapshot_names_its_hash(fab):
    make_plan(fab, 2)
    assert fab("next").code == 0
    lines = (fab.dir / "ledger.jsonl").read_bytes().splitlines()
    forged = b'{"seq":%d,this is not json at all' % len(lines)
    (fab.dir / "ledger.jsonl").write_bytes(b"\n".join(lines[:-1] + [forged]) + b"\n")
    plan = json.loads((fab.dir / "goals.json").read_bytes())
    plan["ledger"]["head"] = hashlib.sha256(forged).hexdigest()
    resign(fab, plan)
    before = state_files(fab.dir)
    r = fab("status")
    assert r.code == 3 and "damaged" in r.err, r
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e")
    assert r.code == 3, r
    assert state_files(fab.dir) == before  # nothing was built on the bad line


@pytest.mark.parametrize("edit, what", [
    (lambda goals_: goals_[1].update(after=["G009"]), "goals[1].after names a story"),
    (lambda goals_: goals_[1].update(id="G001"), "two stories have the same id"),
])
def test_a_snapshot_whose_stories_do_not_form_a_plan_is_damage(fab, edit, what):
    make_plan(fab, 3)
    plan = json.loads((fab.dir / "goals.json").read_bytes())
    edit(plan["goals"])
    resign(fab, plan)
    before = state_files(fab.dir)
    for args in (["status"], ["next"]):
        r = fab(*args, "--json")
        assert r.code == 3 and r.json["error"]["code"] == "bad_snapshot", r
        assert what in r.json["error"]["message"], r
    assert state_files(fab.dir) == before


def test_the_shape_memo_never_lets_a_misfit_through_after_a_fit():
    story = engine.new_story({"id": "G001", "title": "t", "objective": "o"})
    spec = engine.STORY_SPEC
    assert engine.misfit(dict(story), spec) is None  # fits, every nested field empty: memoised
    assert engine.misfit(dict(story), spec) is None
    run = {"seq": 1}  # a run missing most of its fields
    assert engine.misfit(dict(story, runs=[run]), spec).startswith(".runs[0].")
    assert engine.misfit(dict(story, last_run={}), spec).startswith(".last_run.")  # a falsy dict
    assert engine.misfit(dict(story, round=0.0), spec) == ".round"  # same falsiness, other type
    assert engine.misfit(dict(story, after=[1]), spec) == ".after[0]"
    reordered = dict(reversed(list(story.items())))  # another key order is another shape
    assert engine.misfit(reordered, spec) is None
    assert engine.misfit(dict(reordered, judge=1), spec) == ".judge"


def started_plan(checks=()):
    """A two-story plan built by the engine's own transitions, G001 started."""
    specs = [{"id": engine.story_id(i), "title": "t", "objective": "o", "after": [], "checks": [],
              "accept": [], "judge": False} for i in (1, 2)]
    specs[0]["checks"], specs[1]["after"] = list(checks), ["G001"]
    plan, _, _ = engine.make_event(None, "plan_created", {
        "brief": "b", "count": 2, "plan_id": "p", "stories": specs, "unverifiable": [],
        "options": {"rounds": 3, "require_run": False}, "replaces": None})
    plan, _, _ = engine.make_event(plan, "story_started", {"id": "G001", "title": "t", "round": 1,
                                                          "agent": None})
    return plan


def replay_run(plan, check=None, cmd="true", **change):
    seq = plan["ledger"]["seq"] + 1
    run = dict({"id": "G001", "check": check, "cmd": cmd, "cwd": "/", "exit_code": 0,
                "signal": None, "timed_out": False, "error": None, "duration_s": 0.5, "bytes": 0,
                "sha256": "0" * 64, "tail": "", "log": f"runs/{seq}-G001.log",
                "after_seq": seq - 1, "started": "2026-01-01T00:00:00.000000+00:00",
                "git_head": None, "git_dirty": None}, **change)
    return engine.make_event(plan, "verify_run", run)[0]


@pytest.mark.parametrize("change", [{}, {"exit_code": 1}, {"exit_code": None}, {"timed_out": True},
                                    {"error": "spawn failed"}, {"interrupted": "SIGINT"}])
def test_a_replayed_run_is_recorded_with_the_run_fields_and_the_verdict_of_run_passed(change):
    """The verify_run transition writes its record from RUN_FIELDS: its keys are RUN_SPEC's,
    in order, and its `ok` is run_passed's."""
    plan = replay_run(started_plan(), **change)
    record = plan["goals"][0]["last_run"]
    assert tuple(record)[:len(engine.RUN_FIELDS)] == engine.RUN_FIELDS
    assert set(record) - set(engine.RUN_FIELDS) == {"ok"} | set(change) & {"interrupted"}
    assert record["ok"] is engine.run_passed(record) and record["ok"] is (not change)
    assert plan["goals"][0]["runs"] == [record]
    assert engine.misfit(plan["goals"][0], engine.STORY_SPEC) is None


def test_a_run_again_moves_its_check_to_the_end_of_the_rounds_runs():
    """The latest run of a check replaces the one before and goes last, as snapshots written
    before the in-place shortcut hold them: runs of checks 0, 1, 0 leave [1, 0]."""
    plan = started_plan(["true", "test -d ."])
    for check, cmd in ((0, "true"), (1, "test -d ."), (0, "true"), (None, "make"), (None, "make")):
        plan = replay_run(plan, check, cmd)
    runs = plan["goals"][0]["runs"]
    assert [(r["check"], r["cmd"], r["seq"]) for r in runs] == [
        (1, "test -d .", 4), (0, "true", 5), (None, "make", 7)]


def test_the_snapshot_has_one_story_per_line_whatever_the_order_of_a_storys_keys(fab):
    make_plan(fab, 3)
    plan = json.loads((fab.dir / "goals.json").read_bytes())
    for keep in (plan, dict(plan, goals=[dict(reversed(list(s.items()))) for s in plan["goals"]])):
        raw = engine.snapshot_bytes(keep)
        lines = raw.split(b"\n")
        assert [json.loads(line.rstrip(b",")) for line in lines[1:4]] == keep["goals"], raw
        assert engine.parse_snapshot(raw) == dict(keep, digest=raw[11:75].decode())
