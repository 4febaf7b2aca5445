"""The guard's cap is recorded (issue 41, item 8). After FABLIZE_GUARD_MAX blocks in a row the
Stop guard lets the agent stop with work left; that stop is a ledger event (`guard_capped`), so
`status`, a session start, `report`, `audit` and `log` say the agent stopped with work left —
never anything that reads as done — until the work goes on. While the agent's own background
work runs (Claude Code's Stop payload lists it in `background_tasks`), the guard lets the turn
end without spending a block and says it will check again. Real hook processes throughout."""

import json

from conftest import ledger, make_plan, run_cli
from test_wiring import guard, stop_payload

STOPPED = "⚠ the agent stopped with work left: the guard let it stop after 3 blocks in a row"


def stop(fab, active, **extra):
    return guard(fab, stop_payload(fab.root, stop_hook_active=active, **extra))


def capped(fab):
    """Three blocks in a row, then the stop the guard lets through."""
    make_plan(fab, 3)
    assert fab("next").code == 0
    for n, active in ((1, False), (2, True), (3, True)):
        assert f"[guard block {n} of at most 3 in a row]" in stop(fab, active)["reason"]
    answer = stop(fab, True)
    assert answer["systemMessage"].startswith("fablize guard: let the agent stop after 3 blocks")
    return answer


def test_a_stop_at_the_cap_is_recorded_once_and_every_reader_says_work_was_left(fab):
    capped(fab)
    events = ledger(fab.dir)
    assert events[-1]["event"] == "guard_capped", events[-1]
    assert (events[-1]["blocks"], events[-1]["id"]) == (3, "G001")
    stop(fab, True)  # the agent stops again, nothing happened since: said once
    assert len(ledger(fab.dir)) == len(events)
    seq = events[-1]["seq"]
    status = fab("status").out
    assert f"  {STOPPED} (event {seq}, " in status and "the plan is not finished" in status
    assert "complete ✓" not in status and status.startswith("fablize: 0/3 complete")
    assert fab("status", "--json").json["capped"]["seq"] == seq
    resume = run_cli("status", "--resume", cwd=fab.root, input=json.dumps(
        {"cwd": str(fab.root), "source": "startup"}).encode())
    assert resume.code == 0 and STOPPED in resume.out, resume
    assert STOPPED in fab("report").out
    audit = fab("audit")
    assert audit.code == 0 and STOPPED in audit.out, audit
    assert "the agent stopped with work left: the guard let it stop after 3 blocks in a row — " \
        "next: G001" in fab("log").out
    # it replays: the snapshot rebuilt from the ledger is the same
    snapshot = (fab.dir / "goals.json").read_bytes()
    assert fab("rebuild").code == 0
    assert (fab.dir / "goals.json").read_bytes() == snapshot
    assert fab("audit").code == 0


def test_a_pause_keeps_the_note_and_the_work_going_on_ends_it(fab):
    capped(fab)
    assert fab("pause", "--note", "looking at it in the morning").code == 0
    assert STOPPED in fab("status").out  # a human's pause works on nothing
    assert fab("unpause").code == 0
    assert STOPPED in fab("status").out
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "done now")
    assert r.code == 0, r
    assert STOPPED[2:] not in fab("status").out and fab("status", "--json").json["capped"] is None
    assert "[guard block 1 of at most 3 in a row]" in stop(fab, False)["reason"]


def test_the_guard_spends_no_block_while_the_agents_background_work_runs(fab):
    make_plan(fab, 3)
    assert fab("next").code == 0
    assert "[guard block 1 of" in stop(fab, False)["reason"]
    assert "[guard block 2 of" in stop(fab, True)["reason"]
    before = ledger(fab.dir)
    tasks = [{"id": "b1", "type": "shell", "status": "running", "command": "npm run build"}]
    answer = stop(fab, True, background_tasks=tasks)
    assert list(answer) == ["systemMessage"], answer
    assert "1 background task of the agent still runs" in answer["systemMessage"]
    assert "checks again when the agent next stops" in answer["systemMessage"]
    assert ledger(fab.dir) == before  # nothing recorded, no block spent
    assert "[guard block 3 of" in stop(fab, True)["reason"]
    # at the cap too: the turn ends, the stop is not the one the guard gives up on
    assert "background task" in stop(fab, True, background_tasks=tasks * 2)["systemMessage"]
    assert [e["event"] for e in ledger(fab.dir)].count("guard_capped") == 0
    stop(fab, True)
    assert ledger(fab.dir)[-1]["event"] == "guard_capped"


def test_background_tasks_that_are_over_do_not_hold_the_guard_back(fab):
    make_plan(fab, 3)
    assert fab("next").code == 0
    over = [{"id": "b1", "status": "completed"}, {"id": "b2", "status": "failed"}]
    assert "[guard block 1 of" in stop(fab, False, background_tasks=over)["reason"]
    assert "[guard block 2 of" in stop(fab, True, background_tasks=[])["reason"]
    assert "[guard block 3 of" in stop(fab, True, background_tasks="not a list")["reason"]


def test_a_finished_plan_lets_the_agent_stop_whatever_runs_in_the_background(fab):
    make_plan(fab, 1)
    assert fab("next").code == 0
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e", "--run",
               "--verify-cmd", "true").code == 0
    assert stop(fab, False, background_tasks=[{"status": "running"}]) is None
