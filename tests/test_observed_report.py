"""Observed runs read the runner's report (issue 41, item 6). A verification the agent ran is
judged as frozen checks are: its test runner's own summary (or, where a filter cut it off, each
test's own line) wins over the exit code the harness saw; a command whose exit status is not its
verification's (`pytest | tail -3`) is never a pass; a failure left standing is cleared only by
a run seen to pass. The runs are real — pytest and unittest in a real shell, their output handed
to `observe` as Claude Code's PostToolUse hands it (stdout, no exit code: a failing command comes
as PostToolUseFailure, so a pipe that exits 0 reads as a success)."""

import shlex
import subprocess
import sys

import pytest

from conftest import engine, ledger, make_plan
from test_wiring import bash_failure, guard, observe, stop_payload

PY = shlex.quote(sys.executable)
PYTEST = f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {PY} -m pytest -p no:cacheprovider"
FOUR = ("def test_a():\n    assert True\n\n\ndef test_b():\n    assert True\n\n\n"
        "def test_c():\n    assert True\n\n\ndef test_bug():\n    assert 1 + 2 == 4\n")
FIXED = FOUR.replace("1 + 2 == 4", "1 + 3 == 4")


def project(fab, tests=FOUR):
    (fab.root / "tests").mkdir(exist_ok=True)
    (fab.root / "tests" / "test_calc.py").write_text(tests)
    make_plan(fab, 2)
    assert fab("next").code == 0


def ran(fab, cmd):
    """`cmd` run by a real shell in the project, as the agent's Bash tool runs it: (exit code,
    what it printed)."""
    p = subprocess.run(["bash", "-c", cmd], cwd=str(fab.root), capture_output=True, text=True,
                       timeout=120)
    return p.returncode, p.stdout + p.stderr


def seen_by_claude(fab, cmd):
    """Run `cmd`, and hand it to `observe` as Claude Code would: PostToolUse with the output when
    the shell exited 0, PostToolUseFailure with `Exit code N` and the output otherwise."""
    code, out = ran(fab, cmd)
    if code == 0:
        payload = {"session_id": "s", "cwd": str(fab.root), "hook_event_name": "PostToolUse",
                   "tool_name": "Bash", "tool_input": {"command": cmd},
                   "tool_response": {"stdout": out, "stderr": "", "interrupted": False,
                                     "isImage": False}}
    else:
        payload = bash_failure(fab.root, cmd, f"Exit code {code}\n{out}")
    observe(fab, payload)
    return [e for e in ledger(fab.dir) if e["event"] == "observed_run"][-1]


def standing(fab):
    return (guard(fab, stop_payload(fab.root)) or {}).get("reason", "")


def test_a_piped_pytest_whose_output_says_1_failed_is_recorded_as_failed_not_passed(fab):
    project(fab)
    ev = seen_by_claude(fab, f"{PYTEST} -q tests | tail -3")
    assert ev["ok"] is False and ev["exit_hidden"] is True, ev
    assert ev["report"]["failed"] == 1 and ev["report"]["passed"] == 3, ev
    assert ev["report"]["failing"] == ["tests/test_calc.py::test_bug"], ev
    assert "fail (pytest reported 1 failed: tests/test_calc.py::test_bug, event " in standing(fab)
    assert "→ failed (pytest reported 1 failed: tests/test_calc.py::test_bug)" in fab("log").out


def test_a_piped_pytest_that_passed_is_unknown_never_passed(fab):
    project(fab, FIXED)
    ev = seen_by_claude(fab, f"{PYTEST} -q tests 2>&1 | tail -3")
    assert ev["ok"] is None and ev["exit_hidden"] is True and ev["report"]["passed"] == 4, ev
    assert "outcome unknown (the exit status is not the test runner's" in fab("log").out


def test_only_a_run_seen_to_pass_clears_a_standing_failure(fab):
    project(fab)
    first = seen_by_claude(fab, f"{PYTEST} -q tests")  # exit 1: PostToolUseFailure
    assert first["ok"] is False and "exit 1" in standing(fab)
    # the same run reported as a success by a harness that gives no exit code: the runner's
    # summary says 1 failed, so it is a failure still, never the pass that clears it
    code, out = ran(fab, f"{PYTEST} -q tests")
    observe(fab, {"session_id": "s", "cwd": str(fab.root), "hook_event_name": "PostToolUse",
                  "tool_name": "Bash", "tool_input": {"command": f"{PYTEST} -q tests"},
                  "tool_response": {"stdout": out, "stderr": "", "interrupted": False}})
    assert ledger(fab.dir)[-1]["ok"] is False and "has not been seen to pass" in standing(fab)
    (fab.root / "tests" / "test_calc.py").write_text(FIXED)
    hidden = seen_by_claude(fab, f"{PYTEST} -q tests | tail -3")  # passes, through a pipe
    assert hidden["ok"] is None and "has not been seen to pass" in standing(fab)
    passed = seen_by_claude(fab, f"{PYTEST} -q tests")  # the command itself, seen to pass
    assert passed["ok"] is True and passed["report"]["passed"] == 4, passed
    assert "has not been seen to pass" not in standing(fab)
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "tests pass")
    assert r.code == 0 and "last saw" not in r.err, r
    assert "→ passed (pytest reported 4 passed)" in r.out, r
    assert fab("audit").code == 0


def test_a_failure_seen_through_a_filter_is_cleared_by_the_command_itself_passing(fab):
    project(fab)
    assert seen_by_claude(fab, f"{PYTEST} -q tests 2>&1 | tail -5")["ok"] is False
    (fab.root / "tests" / "test_calc.py").write_text(FIXED)
    assert seen_by_claude(fab, f"{PYTEST} -q tests")["ok"] is True
    assert "has not been seen to pass" not in standing(fab)


def test_each_tests_own_line_decides_where_the_summary_is_cut_off(fab):
    project(fab)
    ev = seen_by_claude(fab, f"{PYTEST} -v tests | head -9")  # the summary line is cut off
    assert ev["ok"] is False and ev["report"]["failed"] == 1, ev
    assert ev["report"]["failing"] == ["tests/test_calc.py::test_bug"], ev
    (fab.root / "test_more.py").write_text(
        "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n"
        "        pass\n\n    def test_bad(self):\n        self.assertEqual(1, 2)\n")
    ev = seen_by_claude(fab, f"{PY} -m unittest -v test_more 2>&1 | head -3")
    assert ev["ok"] is False and ev["report"]["runner"] == "unittest", ev
    assert ev["report"]["failing"] == ["test_more.T.test_bad"], ev


def test_a_whole_output_is_read_test_by_test_as_a_frozen_checks_log_is(fab):
    """unittest -v, whole: each test's outcome, read by reports.py as a frozen check's log is
    (its count checked against the runner's `Ran N tests`)."""
    project(fab)
    (fab.root / "test_more.py").write_text(
        "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n"
        "        pass\n\n    def test_bad(self):\n        self.assertEqual(1, 2)\n")
    ev = seen_by_claude(fab, f"{PY} -m unittest -v test_more")
    assert ev["ok"] is False and ev["exit_code"] == 1, ev
    assert (ev["report"]["passed"], ev["report"]["failed"]) == (1, 1), ev
    assert ev["report"]["failing"] == ["test_more.T.test_bad"], ev


@pytest.mark.parametrize("cmd, output, runner", [
    ("python3 -m pytest -q tests", "1 failed", "pytest"),  # the words, and no more
    ("python3 -m pytest -q tests | tail -1", "=== 1 failed, 3 passed ===", "pytest"),
    ("python3 -m unittest discover 2>&1 | tail -1", "FAILED (failures=1)", "unittest"),
])
def test_closing_counts_cut_short_still_say_the_failure(fab, cmd, output, runner):
    """What a cut output keeps of a summary (pytest's counts without their time, unittest's
    FAILED line without `Ran N tests`) is read too: the failure is recorded, nothing clears."""
    project(fab)
    observe(fab, {"session_id": "s", "cwd": str(fab.root), "hook_event_name": "PostToolUse",
                  "tool_name": "Bash", "tool_input": {"command": cmd},
                  "tool_response": {"stdout": output, "stderr": "", "interrupted": False}})
    ev = ledger(fab.dir)[-1]
    assert ev["ok"] is False and ev["report"]["runner"] == runner, ev
    assert ev["report"]["failed"] == 1 and "has not been seen to pass" in standing(fab)


def test_a_pipe_after_set_o_pipefail_shows_the_runners_exit_status(fab):
    project(fab, FIXED)
    ev = seen_by_claude(fab, f"set -o pipefail; {PYTEST} -q tests | tail -3")
    assert ev["ok"] is True and "exit_hidden" not in ev, ev


@pytest.mark.parametrize("agent, payload", [
    ("codex", {"tool_response": {"exit_code": 0, "output": "..F.\n1 failed, 3 passed in 0.1s"}}),
    ("gemini", {"tool_response": {"llmContent": "1 failed, 3 passed in 0.1s\nExit Code: 0"}}),
])
def test_every_harness_exit_0_with_a_runners_failure_is_a_failure(fab, agent, payload):
    project(fab)
    observe(fab, dict(payload, cwd=str(fab.root), tool_name="Bash",
                      tool_input={"command": "pytest -q"}), "--for", agent)
    ev = ledger(fab.dir)[-1]
    assert (ev["exit_code"], ev["ok"], ev["report"]["failed"]) == (0, False, 1), ev


@pytest.mark.parametrize("cmd, hidden", [
    ("pytest -q", False), ("cd tests && pytest -q", False), ("pytest -q > log.txt", False),
    ("pytest -q 2>&1", False), ("(cd x; pytest -q)", False), ("pytest -q && echo ok", False),
    ("set -euo pipefail; pytest -q | tail -3", False),
    ("pytest -q | tail -3", True), ("pytest -q 2>&1 | tee log", True),
    ("pytest -q; echo done", True), ("pytest -q || true", True), ("pytest -q &", True),
    ("pytest -q\necho done", True),
    ("make test | tail", True), ("npm test 2>&1 | head -50", True), ("ruff check . ; true", True),
])
def test_a_command_whose_exit_status_is_not_its_verifications(cmd, hidden):
    story = {"checks": []}
    assert engine.exit_hidden(cmd, lambda words: engine.is_verification(words, story)) is hidden


def test_an_observed_run_from_before_this_reading_still_replays_and_audits(fab):
    """observed_run events without `report` or `exit_hidden` (every earlier engine's) replay
    as they were: only their exit code decides."""
    make_plan(fab, 2)
    assert fab("next").code == 0
    observe(fab, bash_failure(fab.root, "make test", "Exit code 2"))
    ev = ledger(fab.dir)[-1]
    assert "report" not in ev and "exit_hidden" not in ev and ev["ok"] is False
    assert fab("audit").code == 0 and fab("rebuild").code == 0
    observed = fab("status", "--json").json["stories"][0]["observed"]
    assert [(o["cmd"], o["ok"]) for o in observed] == [("make test", False)], observed
