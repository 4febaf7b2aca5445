"""The gates at the call: a checkpoint only for the story `next` activated, and only by the agent
that holds it; no completion without evidence; the final story only with verification; frozen
checks that run instead of the agent's own command, and no pass carried from an earlier round;
an independent judge; a decision only with a note. Each refusal is checked by its exit code, its
message, the stable `--json` error code and unchanged state files (conftest.assert_refused).
The README's "Refused at the call, detected by `audit`" table names these tests.
"""

import shlex
import sys

import pytest

from conftest import (SCRIPT, assert_refused, complete, ledger, make_plan, start, story,
                      two_stories_second_active)

GATE = ("the final story cannot complete without --verify-cmd and --verify-evidence "
        "(verification gate).")


def run_of(events, **match):
    return [e for e in events if all(e.get(k) == v for k, v in match.items())]


# Refused at the call ########################################################


@pytest.mark.parametrize("setup, sid, status", [
    ("fresh", "G001", "pending"),         # never activated
    ("fresh", "G002", "pending"),         # a later story, before any work
    ("fresh", "G003", "pending"),         # the final story, before any work
    ("first-active", "G002", "pending"),  # a later story while an earlier one works
    ("first-active", "G003", "pending"),  # the final story while an earlier one works
    ("first-done", "G001", "complete"),   # completing a story twice
    ("first-failed", "G001", "failed"),   # a failed story not reopened by `next`
])
def test_checkpoint_refuses_a_story_that_next_did_not_activate(fab, setup, sid, status):
    make_plan(fab, 3)
    if setup == "first-active":
        start(fab, "G001")
    elif setup == "first-done":
        complete(fab, "G001")
    elif setup == "first-failed":
        start(fab, "G001")
        assert fab("checkpoint", "--id", "G001", "--status", "failed", "--evidence", "no").code == 0
    # the original's opening, then what is true of the story and the one step that fits it
    # a fresh plan: the step names the story `next` would activate (#41), G001
    step = {"fresh": {"G001": "activate it with `next` first.",
                      "G002": "it waits for G001; `next` activates G001 first.",
                      "G003": "it waits for G001, G002; `next` activates G001 first."}.get(sid),
            "first-active": "G001 is in progress: finish G001 first",
            "first-done": "it is already done; nothing to do for it",
            "first-failed": "activate it with `next` first."}[setup]
    command = {"fresh": "next", "first-active": "checkpoint --id G001 --status complete",
               "first-done": "status", "first-failed": "next"}[setup]
    for outcome in ("complete", "failed", "blocked"):  # no checkpoint of any kind
        r = assert_refused(fab, ["checkpoint", "--id", sid, "--status", outcome, "--evidence",
                                 "done, honest"], 1,
                           f"{sid} is not active ({status}) — {step}", error="not_active")
        lines = r.err.splitlines()  # the original's line, then the step's whole command
        assert len(lines) == 2 and lines[1].startswith("  goals.py " + command), r
        j = fab("--json", "checkpoint", "--id", sid, "--status", outcome, "--evidence", "e")
        assert [command in c for c in j.json["error"]["commands"]] == [True], j


@pytest.mark.parametrize("evidence", ["", " ", "   \t ", "\n", "\n\n\r\n", "\u3000\u2003\u00a0",
                                      "\x0b\x0c"])
def test_complete_refuses_blank_evidence(fab, evidence):
    make_plan(fab, 2)
    assert fab("next").code == 0
    assert_refused(fab,
                   ["checkpoint", "--id", "G001", "--status", "complete", "--evidence", evidence],
                   1, "a complete checkpoint requires non-empty --evidence.", error="no_evidence")


def test_complete_refuses_a_missing_evidence_option(fab):
    make_plan(fab, 2)
    assert fab("next").code == 0
    assert_refused(fab, ["checkpoint", "--id", "G001", "--status", "complete"], 1,
                   "a complete checkpoint requires non-empty --evidence.", error="no_evidence")


@pytest.mark.parametrize("verification", [
    [],
    ["--verify-cmd", "pytest -q"],
    ["--verify-evidence", "12 passed"],
    ["--verify-cmd", "   ", "--verify-evidence", "12 passed"],
    ["--verify-cmd", "pytest -q", "--verify-evidence", "\n\t"],
    ["--verify-cmd", "pytest -q", "--verify-evidence", "\n\t "],
    ["--verify-cmd", "", "--verify-evidence", ""],
])
def test_final_story_refuses_completion_without_verification(fab, verification):
    two_stories_second_active(fab)
    assert_refused(fab, ["checkpoint", "--id", "G002", "--status", "complete", "--evidence",
                         "all done", *verification], 1, GATE, error="verification_gate")
    # the gate lets the same story through with both
    r = fab("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "done",
            "--verify-cmd", "pytest -q", "--verify-evidence", "12 passed")
    assert r.code == 0 and "all stories complete ✓" in r.out, r


def test_the_final_gate_names_the_witnessed_way_after_the_original_line(fab):
    two_stories_second_active(fab)
    r = assert_refused(fab, ["checkpoint", "--id", "G002", "--status", "complete", "--evidence",
                             "all done"], 1, error="verification_gate")
    line = r.err.splitlines()[0]
    assert line.startswith("fablize: " + GATE), r  # the original's words first: scripts match
    assert "--run --verify-cmd" in line and "frozen checks" in line, r


def test_a_final_verification_only_claimed_is_said_by_status_and_plain_audit(fab):
    two_stories_second_active(fab)
    r = fab("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "done",
            "--verify-cmd", "pytest -q", "--verify-evidence", "5 passed")
    assert r.code == 0, r
    warning = "⚠ final verification only claimed: G002's `pytest -q` was typed in"
    status = fab("status")
    assert status.code == 0 and status.out.count(warning) == 1, status
    audit = fab("audit")
    assert audit.code == 0 and "audit ok" in audit.out, audit  # a warning, not a failure
    assert audit.out.count(warning) == 1, audit
    assert fab("--json", "audit").json["claimed_final"] == "G002"


def test_a_witnessed_final_verification_is_not_called_claimed(fab):
    two_stories_second_active(fab)
    r = fab("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "done", "--run",
            "--verify-cmd", "true")
    assert r.code == 0, r
    assert "only claimed" not in fab("status").out + fab("audit").out


@pytest.mark.parametrize("substitute", [
    ["--verify-cmd", "true", "--verify-evidence", "ok"],
    ["--run", "--verify-cmd", "true"],
    ["--run", "--verify-cmd", "true", "--verify-evidence", "all green"],
])
def test_frozen_check_cannot_be_replaced_by_the_agents_own_command(fab, substitute):
    two_stories_second_active(fab, "--verify", "false")
    before = ledger(fab.dir)
    r = fab("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "works for me",
            *substitute)
    assert r.code == 1, r
    assert "G002: frozen check 1 (`false`) failed (exit 1)" in r.err, r
    assert "has frozen checks: they run instead of --verify-cmd" in r.err, r
    after = ledger(fab.dir)
    # the frozen check ran (and failed, on the record); the substitute never ran
    assert after[:len(before)] == before
    assert [e["event"] for e in after[len(before):]] == ["verify_run"]
    run = after[-1]
    assert run["cmd"] == "false" and run["check"] == 0 and run["exit_code"] == 1
    assert not run_of(after, event="verify_run", cmd="true")
    assert not run_of(after, event="checkpoint", id="G002")
    assert story(fab.dir, "G002")["status"] == "in_progress"
    j = fab("--json", "checkpoint", "--id", "G002", "--status", "complete", "--evidence", "again",
            *substitute)
    assert j.code == 1 and j.json["error"]["code"] == "verification_failed", j
    assert fab("audit").code == 0


def test_passing_run_from_an_earlier_round_does_not_complete_the_reopened_story(fab):
    make_plan(fab, 2, "--check", "G001=test -f built.flag")
    flag = fab.root / "built.flag"
    flag.write_text("yes")
    assert fab("next").code == 0
    assert fab("verify", "--id", "G001").code == 0  # round 1: the check passes
    r = fab("checkpoint", "--id", "G001", "--status", "failed", "--evidence", "docs missing")
    assert r.code == 0, r
    flag.unlink()  # round 2 breaks what the check proves
    r = fab("next")
    assert r.code == 0 and "round 2" in r.out, r
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "passed before")
    assert r.code == 1, r
    assert "frozen check 1 (`test -f built.flag`) failed (exit 1)" in r.err, r
    s = story(fab.dir, "G001")
    assert s["status"] == "in_progress" and s["round"] == 2
    assert [run["exit_code"] for run in s["runs"]] == [1]  # round 1's pass is not carried
    assert not run_of(ledger(fab.dir), event="checkpoint", status="complete")


def test_run_started_before_the_story_was_reopened_does_not_count(fab):
    """The check passes, but while it ran the story was failed and reopened (here by the
    check itself, the lock is not held during a run): its pass belongs to round 1 and cannot
    complete round 2."""
    py, script = shlex.quote(sys.executable), shlex.quote(str(SCRIPT))
    check = (f"{py} {script} checkpoint --id G001 --status failed --evidence reopened >/dev/null"
             f" && {py} {script} next >/dev/null")
    make_plan(fab, 2, "--check", f"G001={check}")
    assert fab("next").code == 0
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "green")
    assert r.code == 1, r
    assert "G001: frozen check 1" in r.err, r
    assert "has no run since the story was activated" in r.err, r
    events = ledger(fab.dir)
    assert [e["event"] for e in events] == ["plan_created", "story_started", "checkpoint",
                                            "story_started", "verify_run"]
    run = events[-1]
    assert run["exit_code"] == 0 and run["after_seq"] == 2  # passed, but for round 1
    s = story(fab.dir, "G001")
    assert s["status"] == "in_progress" and s["round"] == 2 and s["runs"] == []
    assert fab("audit").code == 0


def test_require_run_refuses_a_claimed_pass_on_the_final_story(fab):
    two_stories_second_active(fab, "--require-run")
    assert_refused(fab,
                   ["checkpoint", "--id", "G002", "--status", "complete", "--evidence", "ran it",
                    "--verify-cmd", "pytest -q", "--verify-evidence", "48 passed in 2.1s"], 1,
                   "this plan requires a witnessed run", error="run_required")
    # the witnessed way still works: the engine runs the command itself
    r = fab("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "ran it",
            "--run", "--verify-cmd", "true")
    assert r.code == 0 and "fablize: all stories complete ✓" in r.out, r


def test_judge_cannot_be_the_agent_who_did_the_work(fab):
    make_plan(fab, 2, "--judge", "G001")
    assert fab("next", "--agent", "alice").code == 0
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "did it",
            "--agent", "alice")
    assert r.code == 0 and "G001 → review" in r.out, r
    assert_refused(fab,
                   ["verdict", "--id", "G001", "achieved", "--evidence", "looks right", "--agent",
                    "alice"], 1, "alice did the work of G001 and cannot judge it.",
                   error="judge_not_independent")
    assert story(fab.dir, "G001")["status"] == "review"


def test_judging_your_own_unnamed_work_is_caught_by_audit_require_independent_judge(fab):
    """Without --agent the engine cannot know who worked; `audit` names the verdict."""
    make_plan(fab, 2, "--judge", "G001")
    assert fab("next").code == 0
    assert fab("checkpoint", "--id", "G001", "--status", "complete",
               "--evidence", "did it").code == 0
    r = fab("verdict", "--id", "G001", "achieved", "--evidence", "fine", "--agent", "me")
    assert r.code == 0, r
    assert fab("audit").code == 0
    r = fab("audit", "--require-independent-judge")
    assert r.code == 1, r
    assert "line 4: G001 judged by me, executor unnamed" in r.err, r
    j = fab("--json", "audit", "--require-independent-judge")
    assert j.json["error"]["code"] == "judge_not_independent", j


def test_decide_requires_a_note(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    assert fab("checkpoint", "--id", "G001", "--status", "blocked",
               "--evidence", "no access").code == 0
    assert_refused(fab, ["decide", "--id", "G001", "accept"], 2,
                   "the following arguments are required: --note", error="usage")
    for note in ("", "  ", "   ", "\n"):
        assert_refused(fab, ["decide", "--id", "G001", "accept", "--note", note], 1,
                       "a decision requires a non-empty --note", error="no_note")
    assert story(fab.dir, "G001")["status"] == "blocked"


def test_self_accepted_story_is_never_reported_as_plainly_complete(fab):
    """`decide` is the human's command and the engine cannot tell who typed it; an agent
    that accepts its own blocked story is visible everywhere the plan is reported."""
    make_plan(fab, 2)
    assert fab("next").code == 0
    assert fab("checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "hard").code == 0
    assert fab("decide", "--id", "G001", "accept", "--note", "fine by me").code == 0
    r = complete(fab, "G002", final=True)
    assert "fablize: all stories complete ✓" not in r.out, r
    assert "all stories done ✓ (G001 accepted by a human decision)" in r.out, r
    assert "accepted by a human (unsigned): fine by me" in fab("status").out
    assert "G001 decision: accept — fine by me" in fab("log").out
    assert "✓ accepted" in fab("report").out


def test_checkpoint_refuses_another_agents_story(fab):
    make_plan(fab, 2)
    assert fab("next", "--agent", "alice").code == 0
    assert_refused(fab,
                   ["checkpoint", "--id", "G001", "--status", "complete", "--evidence", "mine now",
                    "--agent", "mallory"], 1, "G001 is held by agent alice, not mallory.",
                   error="held_by_other")
    assert_refused(fab, ["next", "--agent", "mallory"], 1,
                   "nothing is ready for agent mallory: in progress G001 (alice)",
                   error="nothing_ready")


def test_an_agent_is_never_handed_another_agents_story(fab):
    """bob's status names alice's story as hers and hands bob his own step, never her
    checkpoint: the skill says never to take over another agent's story."""
    make_plan(fab, 3, "--after", "G002=")  # G002 ready beside G001
    assert fab("next", "--agent", "alice").code == 0
    alices = "--agent alice"
    plain = fab("status")
    nxt = next(line for line in plain.out.splitlines() if line.startswith("fablize: next — "))
    assert alices not in nxt and "G001 is agent alice's" in nxt, plain
    assert "next --agent <your name>" in nxt, plain
    bob = fab("--json", "status", "--agent", "bob").json["next"]
    assert bob["kind"] == "next" and bob["cmd"].endswith("next --agent bob"), bob
    alice = fab("--json", "status", "--agent", "alice").json["next"]
    assert alice["kind"] == "finish" and alice["cmd"].endswith(alices), alice
