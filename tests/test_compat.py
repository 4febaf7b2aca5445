"""Drop-in compatibility with the original 139-line goals.py (DESIGN §2).

A script written against the original CLI must run unchanged: same subcommands and
flags, same ids, same messages on stderr (prefixed `fablize: `), same stdout shapes,
same snapshot keys and first ledger event. Exit codes follow DESIGN §6 (usage 2,
refusals 1, damage 3). A `.fablize/` written by the original tool is imported.
"""

import hashlib
import json

import pytest

from conftest import SCRIPT, assert_refused, complete, ledger, make_plan, rows, run_cli, state_files


NO_PLAN = "no plan — run `create` first."
PLAN_EXISTS = "a plan already exists. Check it with `status`, or replace it with --force."
NO_EVIDENCE = "a complete checkpoint requires non-empty --evidence."
GATE = ("the final story cannot complete without --verify-cmd and --verify-evidence "
        "(verification gate).")
RULE = "Rule: work this story only. Produce evidence as you go."


def steps(r):
    """The stderr lines after a refusal's own: each the whole command of its next step (this
    engine's addition; the original named a step by a word: `create`, `next`)."""
    lines = r.err.splitlines()[1:]
    assert all(line.startswith("  ") and "goals.py " in line for line in lines), r
    return lines


def refused_opening(r, code, message):
    """The original's refusal as its opening words (scripts match them), then what this engine
    adds on the same line, and the step's whole command on the lines after it."""
    assert r.code == code and r.out == "", r
    assert r.err.startswith(f"fablize: {message}"), r
    steps(r)


def refused_with(r, code, message):
    """The original's refusal: its stderr line `fablize: <message>` to the byte, first, nothing
    on stdout; then (ours) the whole command of each step it names."""
    assert r.code == code, r
    assert r.err.splitlines()[0] == f"fablize: {message}", r
    steps(r)
    assert r.out == "", r


# The original script, through the real entry point ###########################


def test_script_written_for_the_original_cli_runs_unchanged(project):
    def run(*args):
        return run_cli(*args, cwd=project)

    # before a plan exists
    for args in (("status",), ("next",),
                 ("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "x")):
        refused_with(run(*args), 1, NO_PLAN)

    r = run("create", "--brief", "Build login",
            "--goal", "Screen::draw the login form",
            "--goal", "Server::wire the login API",
            "--goal", "Verify::run the whole test suite")
    assert r.code == 0, r
    lines = r.out.splitlines()
    assert lines[:4] == ["fablize: plan created — 3 stories",
                         "  G001 Screen: draw the login form",
                         "  G002 Server: wire the login API",
                         "  G003 Verify: run the whole test suite"]
    # the shape the original printed, then (ours) what to do next, last
    assert len(lines) == 5 and lines[4].startswith("fablize: next — ") and "next`" in lines[4]

    # every refusal of create, with its message and exit code
    refused_with(run("create", "--brief", "again", "--goal", "a::b"), 1, PLAN_EXISTS)
    refused_opening(run("create", "--brief", "b", "--goal", "X", "--force"), 2,
                    "--goal format is 'title::objective' — invalid: X")
    refused_opening(run("create", "--brief", "b", "--force"), 2, "at least one --goal is required.")

    # checkpoint refusals before any story is active
    # the original's words first
    refused_with(run("checkpoint", "--id", "G009", "--status", "complete", "--evidence", "e"), 1,
                 "G009 not found. The plan's stories: G001, G002, G003.")
    # the original's opening; then the story `next` would activate, which is not G002 (#41)
    refused_with(run("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "e"), 1,
                 "G002 is not active (pending) — it waits for G001; `next` activates G001 first.")

    # story 1
    r = run("next")
    assert r.code == 0, r
    lines = r.out.splitlines()
    assert lines[0] == "=== fablize handoff — G001 Screen"
    assert lines[1] == "Objective: draw the login form"
    assert RULE in lines
    assert not any(line.startswith("★ Final story") for line in lines)
    assert f'On completion: python3 {SCRIPT} checkpoint --id G001 --status complete --evidence ' \
        '"<evidence>"' in lines  # the script, by a path that runs from anywhere
    refused_with(run("checkpoint", "--id", "G001", "--status", "complete"), 1, NO_EVIDENCE)
    r = run("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "form renders")
    assert r.code == 0, r
    assert r.out.splitlines()[0] == "fablize: G001 → complete"
    assert "all stories complete" not in r.out

    # a new session resumes with status
    r = run("next")
    assert r.code == 0 and r.out.startswith("=== fablize handoff — G002 Server\n"), r
    r = run("status")
    assert r.code == 0, r
    assert r.out.splitlines()[0] == "fablize: 1/3 complete — Build login"
    assert rows(r.out) == [("✓", "G001", "complete", "Screen"),
                           ("▶", "G002", "in_progress", "Server"),
                           ("·", "G003", "pending", "Verify")]
    r = run("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "API answers 200")
    assert r.code == 0 and r.out.splitlines()[0] == "fablize: G002 → complete", r

    # the final story: the verification gate
    r = run("next")
    assert r.code == 0, r
    lines = r.out.splitlines()
    assert lines[0] == "=== fablize handoff — G003 Verify"
    assert any(line.startswith("★ Final story — ") for line in lines), r
    assert any(line.startswith(f'On completion: python3 {SCRIPT} checkpoint --id G003 '
                               '--status complete --evidence "<evidence>"') for line in lines), r
    refused_opening(run("checkpoint", "--id", "G003", "--status", "complete", "--evidence",
                        "ran"), 1, GATE)
    refused_opening(run("checkpoint", "--id", "G003", "--status", "complete", "--evidence", "ran",
                        "--verify-cmd", "pytest -q"), 1, GATE)
    refused_opening(run("checkpoint", "--id", "G003", "--status", "complete", "--evidence", "ran",
                        "--verify-evidence", "12 passed"), 1, GATE)
    r = run("checkpoint", "--id", "G003", "--status", "complete", "--evidence", "suite ran",
            "--verify-cmd", "pytest -q", "--verify-evidence", "12 passed")
    assert r.code == 0, r
    assert r.out.splitlines() == ["fablize: G003 → complete", "fablize: all stories complete ✓"]
    assert r.err == ""

    r = run("status")
    assert r.code == 0, r
    assert r.out.splitlines()[0] == "fablize: 3/3 complete — Build login"
    assert rows(r.out) == [("✓", "G001", "complete", "Screen"), ("✓", "G002", "complete", "Server"),
                           ("✓", "G003", "complete", "Verify")]
    assert r.out.splitlines()[-1] == "fablize: all stories complete ✓"
    r = run("next")
    assert r.code == 0 and r.out == "fablize: all stories complete ✓\n", r


def test_status_shows_every_mark_of_the_original(fab):
    make_plan(fab, 3)
    seen = {}

    def look():
        r = fab("status")
        assert r.code == 0, r
        for mark, sid, status, title in rows(r.out):
            seen.setdefault(status, set()).add(mark)
            assert title == f"S{int(sid[1:])}"

    look()                                          # · pending
    complete(fab, "G001")
    assert fab("next").code == 0
    look()                                          # ✓ complete, ▶ in_progress
    assert fab("checkpoint", "--id", "G002", "--status", "failed", "--evidence", "no").code == 0
    look()                                          # ✗ failed
    assert fab("next").code == 0                    # reopened as round 2
    assert fab("checkpoint", "--id", "G002", "--status", "blocked",
               "--evidence", "no key").code == 0
    look()                                          # ■ blocked
    assert seen == {"pending": {"·"}, "complete": {"✓"}, "in_progress": {"▶"},
                    "failed": {"✗"}, "blocked": {"■"}}


def test_blocked_and_failed_checkpoints_need_a_reason_a_deliberate_deviation(fab):
    """DESIGN §2: the original took failed/blocked without evidence; the next round and the
    deciding human need the reason, so it is refused (exit 1) and nothing is written."""
    make_plan(fab, 3)
    fab("next")
    for status in ("failed", "blocked"):
        assert_refused(fab, ["checkpoint", "--id", "G001", "--status", status], 1,
                       f"a {status} checkpoint requires --evidence")
        assert_refused(fab, ["checkpoint", "--id", "G001", "--status", status, "--evidence", " "],
                       1, f"a {status} checkpoint requires --evidence")
    r = fab("checkpoint", "--id", "G001", "--status", "failed", "--evidence", "no tests yet")
    assert r.code == 0 and r.out.startswith("fablize: G001 → failed"), r
    fab("next")
    r = fab("checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "needs a key")
    assert r.code == 0 and r.out.startswith("fablize: G001 → blocked"), r


# Files #######################################################################


def test_snapshot_keeps_the_original_keys_and_ids(fab):
    make_plan(fab, 12)
    complete(fab, "G001")
    snap = json.loads((fab.dir / "goals.json").read_text(encoding="utf-8"))
    assert isinstance(snap["brief"], str) and snap["brief"] == "test plan"
    assert isinstance(snap["created"], str) and snap["created"]
    assert [g["id"] for g in snap["goals"]] == [f"G{i:03d}" for i in range(1, 13)]
    for i, g in enumerate(snap["goals"], 1):
        assert {"id", "title", "objective", "status", "evidence"} <= set(g)
        assert (g["title"], g["objective"]) == (f"S{i}", f"objective {i}")
    assert (snap["goals"][0]["status"], snap["goals"][0]["evidence"]) == ("complete", "G001 done")
    assert (snap["goals"][1]["status"], snap["goals"][1]["evidence"]) == ("pending", None)


def test_ledger_keeps_the_original_events_and_fields(fab):
    make_plan(fab, 2)
    complete(fab, "G001")
    complete(fab, "G002", final=True)
    events = ledger(fab.dir)
    first = json.loads((fab.dir / "ledger.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert first["event"] == "plan_created"
    assert (first["brief"], first["count"]) == ("test plan", 2)
    assert [e["event"] for e in events] == ["plan_created", "story_started", "checkpoint",
                                            "story_started", "checkpoint"]
    for e in events:
        assert isinstance(e["ts"], str) and e["ts"]
    started = [e for e in events if e["event"] == "story_started"]
    assert [(e["id"], e["title"]) for e in started] == [("G001", "S1"), ("G002", "S2")]
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    for e in checkpoints:
        assert {"id", "status", "evidence", "verify_cmd", "verify_evidence"} <= set(e)
    assert (checkpoints[0]["id"], checkpoints[0]["status"], checkpoints[0]["evidence"]) == \
        ("G001", "complete", "G001 done")
    assert (checkpoints[1]["verify_cmd"], checkpoints[1]["verify_evidence"]) == \
        ("pytest -q", "3 passed")


# Exit codes (DESIGN §6) ######################################################


@pytest.mark.parametrize("args, code", [
    (("create", "--brief", "b", "--goal", "no separator", "--force"), 2),
    (("create", "--brief", "b", "--force"), 2),
    (("create", "--goal", "a::b"), 2),                       # --brief is required
    (("checkpoint", "--status", "complete", "--evidence", "e"), 2),   # --id is required
    (("checkpoint", "--id", "G001", "--status", "done"), 2),          # not a status
    (("frobnicate",), 2),
    (("status", "--no-such-flag"), 2),
    ((), 2),
    (("create", "--brief", "b", "--goal", "a::b"), 1),       # a plan exists
    (("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "e"), 1),
    (("checkpoint", "--id", "G404", "--status", "complete", "--evidence", "e"), 1),
    (("status",), 0),
    (("--version",), 0),
    (("--help",), 0),
])
def test_exit_codes_separate_usage_from_refusal(fab, args, code):
    make_plan(fab, 2)
    before = state_files(fab.dir)
    r = fab(*args)
    assert r.code == code, r
    if code:  # one line, then (ours) the whole command of each step it names
        assert r.err.startswith("fablize: "), r
        steps(r)
        assert state_files(fab.dir) == before


def test_real_process_exit_codes_are_0_1_2_3(project):
    assert run_cli("create", "--brief", "b", "--goal", "a::b", cwd=project).code == 0
    assert run_cli("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
                   cwd=project).code == 1
    assert run_cli("checkpoint", "--id", "G001", cwd=project).code == 2
    (project / ".fablize" / "goals.json").write_bytes(b"")
    r = run_cli("status", cwd=project)
    assert r.code == 3 and r.err.startswith("fablize: ") and "Traceback" not in r.err, r


# Importing a .fablize/ written by the original tool ##########################


def original_files(state_dir, statuses, brief="옛 계획 — old plan"):
    """Write goals.json and ledger.jsonl exactly as the original goals.py did (indent=2 JSON,
    ledger lines of ts + event + fields, no seq/prev); returns their bytes."""
    state_dir.mkdir(exist_ok=True)
    titles = ["로그인 화면", "Server", "Verify", "Docs", "Ship"]
    goals_ = []
    for i, status in enumerate(statuses):
        done = status == "complete"
        goals_.append({"id": f"G{i + 1:03d}", "title": titles[i], "objective": f"objective {i + 1}",
                       "status": status, "evidence": f"evidence {i + 1}" if done else None})
    snap = {"brief": brief, "created": "2024-05-01T09:00:00+00:00", "goals": goals_}
    snap_bytes = json.dumps(snap, ensure_ascii=False, indent=2).encode("utf-8")
    lines = [{"ts": "2024-05-01T09:00:00+00:00", "event": "plan_created", "brief": brief,
              "count": len(statuses)}]
    for g in goals_:
        if g["status"] != "pending":
            lines.append({"ts": "2024-05-01T09:10:00+00:00", "event": "story_started",
                          "id": g["id"], "title": g["title"]})
        if g["status"] == "complete":
            lines.append({"ts": "2024-05-01T09:20:00+00:00", "event": "checkpoint", "id": g["id"],
                          "status": "complete", "evidence": g["evidence"], "verify_cmd": None,
                          "verify_evidence": None})
    ledger_bytes = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode("utf-8")
    (state_dir / "goals.json").write_bytes(snap_bytes)
    (state_dir / "ledger.jsonl").write_bytes(ledger_bytes)
    return snap_bytes, ledger_bytes


def archived_dirs(state_dir):
    root = state_dir / "archive"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []


def test_status_imports_a_plan_written_by_the_original_and_keeps_its_files(fab):
    snap_bytes, ledger_bytes = original_files(fab.dir, ["complete", "in_progress", "pending"])
    r = fab("status")
    assert r.code == 0, r
    assert r.out.splitlines()[0] == "fablize: 1/3 complete — 옛 계획 — old plan"
    assert rows(r.out) == [("✓", "G001", "complete", "로그인 화면"),
                           ("▶", "G002", "in_progress", "Server"),
                           ("·", "G003", "pending", "Verify")]
    # the original files are kept whole under archive/
    [kept] = archived_dirs(fab.dir)
    assert (kept / "goals.json").read_bytes() == snap_bytes
    assert (kept / "ledger.jsonl").read_bytes() == ledger_bytes
    assert "archive/" in r.err and "original" in r.err
    # the new ledger is hash-chained and carries the stories as they were
    [created] = ledger(fab.dir)
    assert created["event"] == "plan_created" and created["seq"] == 1
    assert created["prev"] == "0" * 64
    assert created["brief"] == "옛 계획 — old plan" and created["count"] == 3
    assert created["imported_from"]["tool"] == "goals.py (original)"
    assert created["replaces"]["path"] == str(kept.relative_to(fab.dir))
    snap = json.loads((fab.dir / "goals.json").read_text(encoding="utf-8"))
    assert [(g["status"], g["evidence"]) for g in snap["goals"]] == \
        [("complete", "evidence 1"), ("in_progress", None), ("pending", None)]
    assert fab("audit").code == 0


def test_an_imported_plan_is_imported_once(fab):
    original_files(fab.dir, ["complete", "pending"])
    assert fab("status").code == 0
    after_first = state_files(fab.dir)
    r = fab("status")
    assert r.code == 0 and "original" not in r.err, r
    assert state_files(fab.dir) == after_first
    assert len(archived_dirs(fab.dir)) == 1


def test_an_imported_plan_continues_with_next_and_checkpoint(fab):
    original_files(fab.dir, ["complete", "in_progress", "pending"])
    # the first command may be any writing command: next re-prints the active story
    r = fab("next")
    assert r.code == 0, r
    assert r.out.startswith("=== fablize handoff — G002 Server\n")
    assert "evidence 1" in r.out                # the imported evidence is carried over
    r = fab("checkpoint", "--id", "G003", "--status", "complete", "--evidence", "e")
    assert r.code == 1 and r.out == "", r  # the original's opening, then the step that fits
    assert r.err.startswith("fablize: G003 is not active (pending) — G002 is in progress: "
                            "finish G002 first"), r
    r = fab("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "API works")
    assert r.code == 0 and r.out.startswith("fablize: G002 → complete\n"), r
    r = fab("next")
    assert r.code == 0 and r.out.startswith("=== fablize handoff — G003 Verify\n"), r
    assert "★ Final story — " in r.out
    refused_opening(fab("checkpoint", "--id", "G003", "--status", "complete", "--evidence", "e"),
                    1, GATE)
    r = fab("checkpoint", "--id", "G003", "--status", "complete", "--evidence", "ran",
            "--verify-cmd", "make test", "--verify-evidence", "ok")
    assert r.code == 0 and r.out.splitlines()[-1] == "fablize: all stories complete ✓", r
    assert fab("audit", "--require-complete").code == 0


def test_an_imported_fresh_plan_starts_at_g001(fab):
    original_files(fab.dir, ["pending", "pending"])
    r = fab("next")
    assert r.code == 0 and r.out.startswith("=== fablize handoff — G001 로그인 화면\n"), r
    assert "Resumed" not in r.out
    events = ledger(fab.dir)
    assert [e["event"] for e in events] == ["plan_created", "story_started"]
    assert [e["seq"] for e in events] == [1, 2]
    assert events[1]["prev"] == hashlib.sha256(
        (fab.dir / "ledger.jsonl").read_bytes().split(b"\n")[0]).hexdigest()


def test_an_imported_plan_is_replaced_with_force_and_nothing_is_lost(fab):
    snap_bytes, ledger_bytes = original_files(fab.dir, ["complete", "pending"])
    refused_with(fab("create", "--brief", "new", "--goal", "a::b"), 1, PLAN_EXISTS)
    r = fab("create", "--brief", "new", "--goal", "a::b", "--force")
    assert r.code == 0, r
    [kept] = archived_dirs(fab.dir)
    assert (kept / "goals.json").read_bytes() == snap_bytes
    assert (kept / "ledger.jsonl").read_bytes() == ledger_bytes
    assert ledger(fab.dir)[0]["replaces"]["head"] == \
        hashlib.sha256(ledger_bytes.rstrip(b"\n").split(b"\n")[-1]).hexdigest()


@pytest.mark.parametrize("args, statuses", [
    (("report",), ["complete", "pending"]),
    (("judge-packet", "--id", "G001"), ["complete", "pending"]),
    (("audit",), ["complete", "pending"]),
    pytest.param(("log",), ["complete", "pending"]),
    pytest.param(("rebuild",), ["complete", "pending"]),
    # one original ledger line: rebuild moves it to .broken, truncates, and says "no plan"
    pytest.param(("rebuild",), ["pending", "pending"]),
])
def test_a_reading_command_on_an_original_plan_says_to_import_it_and_changes_nothing(
        fab, args, statuses):
    original_files(fab.dir, statuses)
    before = state_files(fab.dir)
    r = fab(*args)
    assert state_files(fab.dir) == before
    assert r.code == 3, r
    assert "original goals.py" in r.err and "status" in r.err, r
    assert "damaged" not in r.err


def test_help_names_the_original_commands_and_flags(fab):
    r = fab("--help")
    assert r.code == 0
    for name in ("create", "next", "checkpoint", "status"):
        assert name in r.out
    create_help = fab("create", "--help").out
    for flag in ("--brief", "--goal", "--force"):
        assert flag in create_help
    checkpoint_help = fab("checkpoint", "--help").out
    for flag in ("--id", "--status", "--evidence", "--verify-cmd", "--verify-evidence"):
        assert flag in checkpoint_help
