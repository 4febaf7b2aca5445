"""Every damage message names one runnable next step, and following it leads out: each state
below is made in a real scratch project, then the walk runs the command each refusal names
(as --json's error.commands gives it) until the plan reads whole again or what is left is a
human's decision. No step may lead back to a message already seen (a circle)."""

import json
import shlex

import pytest

from conftest import make_plan, start


def walk(fab, first=("status",), limit=6):
    """Follow the named steps from `first`; returns the messages seen and the last result."""
    seen, args = [], list(first)
    for _ in range(limit):
        r = fab("--json", *args)
        if r.code == 0:
            return seen, r
        error = r.json["error"]
        assert error["message"] not in seen, f"a circle: {error['message']}"
        seen.append(error["message"])
        commands = error.get("commands") or []
        if error["code"] == "no_plan" and not commands:
            return seen, r  # the original's line names its step: `create`, a human's plan
        if commands and all("<" in c for c in commands):
            return seen, r  # what to write is a human's (or the agent's) to decide
        assert len(commands) == 1, f"no one runnable step: {error}"
        words = shlex.split(commands[0])
        assert words[0] == "goals.py", commands  # the engine, as it was started
        if any(w.startswith("<") for w in words):
            return seen, r  # a human's decision: what to write is theirs
        step = fab("--json", *words[1:])
        assert step.code == 0, step
        args = list(first)
    pytest.fail(f"no way out after {limit} steps: {seen}")


def edit_snapshot(fab):
    path = fab.dir / "goals.json"
    path.write_text(path.read_text().replace('"brief":"test plan"', '"brief":"edited"'))


def damage(fab, how):
    if how == "hand-edited goals.json":
        edit_snapshot(fab)
    elif how == "goals.json not JSON":
        (fab.dir / "goals.json").write_text("{not json")
    elif how == "a garbage last line":
        with open(fab.dir / "ledger.jsonl", "a") as f:
            f.write('{"x":1}\n')
    elif how == "ledger shorter than the snapshot":
        lines = (fab.dir / "ledger.jsonl").read_bytes().splitlines(keepends=True)
        (fab.dir / "ledger.jsonl").write_bytes(b"".join(lines[:-1]))


@pytest.mark.parametrize("how", ["hand-edited goals.json", "goals.json not JSON",
                                 "a garbage last line", "ledger shorter than the snapshot"])
@pytest.mark.parametrize("first", [("status",), ("next",), ("audit",)])
def test_each_damage_names_a_step_that_leads_to_a_whole_plan(fab, how, first):
    make_plan(fab, 3)
    start(fab, "G001")
    damage(fab, how)
    seen, r = walk(fab, first)
    assert len(seen) == 1, seen  # one step was enough
    assert "rebuild" in seen[0] and "run `audit`" not in seen[0], seen
    assert fab("audit").code == 0  # and the plan is whole: audit agrees


def test_a_garbage_last_line_is_kept_aside_not_lost(fab):
    make_plan(fab, 2)
    with open(fab.dir / "ledger.jsonl", "a") as f:
        f.write("<<<<<<< HEAD\n")
    r = fab("rebuild")
    assert r.code == 0 and "moved to ledger.jsonl.broken" in r.err, r
    assert (fab.dir / "ledger.jsonl.broken").read_text() == "<<<<<<< HEAD\n"


def test_an_empty_ledger_under_a_snapshot_ends_at_a_humans_decision(fab):
    make_plan(fab, 2)
    (fab.dir / "ledger.jsonl").write_bytes(b"")
    seen, r = walk(fab)
    assert "goals.json reflects event 1 but ledger.jsonl is empty" in seen[0], seen
    assert r.json["error"]["code"] == "no_plan"  # the history is gone: a human starts again
    kept = [p.name for p in fab.dir.iterdir() if p.name.startswith("goals.json.")]
    assert len(kept) == 1 and json.loads((fab.dir / kept[0]).read_text())["goals"], kept


def test_a_damaged_share_record_is_reconnected_by_share(fab):
    make_plan(fab, 2)
    (fab.dir / "share.json").write_text("garbage\n")
    r = fab("--json", "status")
    assert r.code == 3 and r.json["error"]["code"] == "bad_share", r
    assert "sync" not in r.json["error"]["message"], r  # sync would answer "this plan is local"
    # no git remote here: the step names the remote to give
    assert r.json["error"]["commands"] == ["goals.py share --remote NAME"], r


def test_a_deleted_working_directory_is_said_with_the_folder_to_go_to(fab, tmp_path,
                                                                      monkeypatch):
    gone = tmp_path / "sub" / "deeper"
    gone.mkdir(parents=True)
    monkeypatch.chdir(gone)
    monkeypatch.setenv("PWD", str(gone))
    (gone).rmdir()
    (tmp_path / "sub").rmdir()
    r = fab("--json", "status")
    assert r.code == 3 and r.json["error"]["code"] == "cwd_gone", r
    assert f"the working directory {gone} no longer exists" in r.json["error"]["message"], r
    assert r.json["error"]["commands"] == [f"cd {tmp_path}"], r


def test_a_damaged_last_event_the_snapshot_reflects_names_rebuild_which_keeps_its_bytes(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    data = (fab.dir / "ledger.jsonl").read_bytes()
    (fab.dir / "ledger.jsonl").write_bytes(data[:-20])  # event 2 cut short, acknowledged
    seen, r = walk(fab)
    assert "goals.json reflects event 2" in seen[0] and len(seen) == 1, seen
    assert (fab.dir / "ledger.jsonl.broken").read_bytes() == data[-len(data.splitlines()[-1]) - 1:
                                                                   -20] + b"\n"
    assert fab("audit").code == 0


def test_a_halted_plan_and_a_wrong_checkpoint_end_at_a_decision_with_whole_commands(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    assert fab("checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "no key").code \
        == 0
    seen, r = walk(fab, ("next",))
    assert r.json["error"]["code"] == "halted" and len(r.json["error"]["commands"]) == 3, r
    assert all(c.startswith("goals.py decide --id G001 ") for c in r.json["error"]["commands"])
    assert fab("decide", "--id", "G001", "retry", "--note", "key found").code == 0
    start(fab, "G001")
    seen, r = walk(fab, ("checkpoint", "--id", "G002", "--status", "complete", "--evidence",
                         "e"))
    assert r.json["error"]["code"] == "not_active", r
    assert r.json["error"]["commands"] == [
        'goals.py checkpoint --id G001 --status complete --evidence "<evidence>"'], r
