"""The runner must agree (issue 34): a check passes only when it exits 0 and its test runner's
own summary says tests ran and none failed or errored. Real pytest, unittest and node runs where
they are installed here; the other runners' documented summary lines read by the same parser.
"""

import json
import shlex
import shutil
import sys

import pytest

from conftest import engine, ledger, make_plan, rechain, raw_lines, start, story, write_lines

PY = shlex.quote(sys.executable)
PYTEST = f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {PY} -m pytest -q -p no:cacheprovider"
TESTS = "def test_ok():\n    assert True\n\n\ndef test_bug():\n    assert 1 + 1 == 3\n"
PASSING = "def test_ok():\n    assert True\n\n\ndef test_too():\n    assert 2 == 2\n"
SESSION_EXIT_0 = ("def pytest_sessionfinish(session, exitstatus):\n"
                  "    session.exitstatus = 0\n")


def refused_keeping_runs(fab, sid, message):
    """exit 1 naming `message`; the story stays as it was; only the failed runs were appended."""
    before, status = ledger(fab.dir), story(fab.dir, sid)["status"]
    r = fab("checkpoint", "--id", sid, "--status", "complete", "--evidence", "tests pass")
    assert r.code == 1 and message in r.err, r
    new = ledger(fab.dir)[len(before):]
    assert new and all(e["event"] == "verify_run" for e in new), new
    assert story(fab.dir, sid)["status"] == status
    return new


def one_check(fab, check, files):
    for name, text in files.items():
        (fab.root / name).write_text(text)
    make_plan(fab, 1, "--verify", check)
    start(fab, "G001")


# What makes a run that exited 0 fail ###########################################################


def test_attack_conftest_that_sets_the_exit_status_to_0_fails_by_pytests_own_report(fab):
    one_check(fab, PYTEST + " test_calc.py", {"test_calc.py": TESTS, "conftest.py": SESSION_EXIT_0})
    new = refused_keeping_runs(fab, "G001", "(exit 0 but pytest reported 1 failed)")
    assert new[0]["exit_code"] == 0
    assert new[0]["report"] == {"runner": "pytest", "passed": 1, "failed": 1, "errors": 0,
                                "skipped": 0}


def test_attack_code_that_exits_0_at_interpreter_exit_fails_by_pytests_own_report(fab):
    """The code under test registers an exit hook (in-scope code, the test untouched)."""
    code = "import atexit\nimport os\n\natexit.register(os._exit, 0)\n\n\ndef add(a, b):\n" \
           "    return a - b\n"
    test = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    one_check(fab, PYTEST + " test_calc.py", {"calc.py": code, "test_calc.py": test})
    refused_keeping_runs(fab, "G001", "exit 0 but pytest reported 1 failed")


def test_a_run_stopped_before_its_report_fails(fab):
    test = "import os\n\n\ndef test_stop():\n    os._exit(0)\n\n\ndef test_bug():\n" \
           "    assert False\n"
    one_check(fab, PYTEST + " test_calc.py", {"test_calc.py": test})
    refused_keeping_runs(fab, "G001", "exit 0 but no pytest report")


def test_a_summary_a_test_prints_is_never_read(fab):
    """A test that prints pytest's closing line and ends the process before pytest reports:
    the summary is in the output, the runner's report is not."""
    test = ("import os\n\n\ndef test_bug():\n    print('=== 3 passed in 0.01s ===', flush=True)\n"
            "    os._exit(0)\n")
    one_check(fab, PYTEST + " -s test_calc.py", {"test_calc.py": test})
    refused_keeping_runs(fab, "G001", "exit 0 but no pytest report")


def test_pytest_told_to_print_no_summary_is_read_by_its_report(fab):
    """-qq prints no summary; the engine reads pytest's own report, not its summary."""
    one_check(fab, PYTEST + " -qq test_calc.py", {"test_calc.py": PASSING})
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "tests pass")
    assert r.code == 0 and "(pytest: 2 passed)" in r.out + r.err, r


def test_pytest_told_to_write_no_report_fails_naming_the_flag(fab):
    one_check(fab, PYTEST + " -p no:junitxml test_calc.py || true", {"test_calc.py": PASSING})
    refused_keeping_runs(fab, "G001", "exit 0 but no pytest report (pytest writes none under "
                                      "-p no:junitxml)")


def test_a_check_that_starts_pytest_twice_is_read_whole(fab):
    """Two sessions, two reports: the first one's failure is not lost to the second's pass."""
    one_check(fab, f"{PYTEST} test_bug.py; {PYTEST} test_calc.py",
              {"test_bug.py": TESTS, "test_calc.py": PASSING})
    new = refused_keeping_runs(fab, "G001", "exit 0 but pytest reported 1 failed")
    assert new[0]["report"] == {"runner": "pytest", "passed": 3, "failed": 1, "errors": 0,
                                "skipped": 0}


def test_exit_0_when_pytest_ran_no_test_fails(fab):
    one_check(fab, PYTEST + " -k no_such_test test_calc.py || true", {"test_calc.py": TESTS})
    refused_keeping_runs(fab, "G001", "exit 0 but pytest ran no test")


def test_exit_0_beside_a_unittest_report_of_failures_fails(fab):
    test = ("import unittest\n\n\nclass T(unittest.TestCase):\n    def test_bug(self):\n"
            "        self.assertEqual(1, 2)\n\n    def test_ok(self):\n        pass\n")
    one_check(fab, f"{PY} -m unittest test_u || true", {"test_u.py": test})
    new = refused_keeping_runs(fab, "G001", "exit 0 but unittest reported 1 failed")
    assert new[0]["report"]["passed"] == 1


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed here")
def test_exit_0_beside_a_node_test_report_of_failures_fails(fab):
    test = ("const test = require('node:test');\nconst assert = require('assert');\n"
            "test('ok', () => {});\ntest('bug', () => { assert.equal(1, 2); });\n")
    one_check(fab, "node --test calc.test.js || true", {"calc.test.js": test})
    refused_keeping_runs(fab, "G001", "exit 0 but node reported 1 failed")


# What a passing run shows ######################################################################


def test_a_passing_run_shows_its_runners_counts_in_log_status_report_and_the_judge_packet(fab):
    one_check(fab, PYTEST + " test_calc.py", {"test_calc.py": PASSING})
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "tests pass")
    assert r.code == 0, r
    assert "(pytest: 2 passed)" in r.err + r.out
    assert "(pytest: 2 passed)" in fab("log").out
    assert "witnessed (the engine ran the checks) — pytest: 2 passed" in fab("status").out
    assert "(pytest: 2 passed)" in fab("report").out
    packet = fab("judge-packet", "--id", "G001")
    assert "witnessed: `" in packet.out and "(pytest: 2 passed)" in packet.out, packet
    run = fab("--json", "log").json
    assert any(e.get("report", {}) and e["report"]["passed"] == 2 for e in run["events"]), run


def test_a_command_whose_runner_is_not_read_says_exit_code_only(fab):
    one_check(fab, "echo 5 passed", {})
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ok")
    assert r.code == 0, r
    assert "(exit code only)" in fab("log").out
    assert "checks) — exit code only" in fab("status").out
    assert ledger(fab.dir)[-2]["report"] is None


def test_runs_recorded_before_the_engine_read_summaries_replay_and_audit_unchanged(fab):
    one_check(fab, PYTEST + " test_calc.py", {"test_calc.py": PASSING})
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ok").code == 0
    entries = [json.loads(x) for x in raw_lines(fab.dir)]
    for e in entries:
        e.pop("report", None)  # an older engine's runs
    write_lines(fab.dir, rechain(entries))
    (fab.dir / "goals.json").unlink()
    assert fab("rebuild").code == 0
    assert fab("audit").code == 0
    log = fab("log").out
    assert "→ exit 0, " in log and "exit code only" not in log


# The runners recognised, and their summaries read ##############################################


@pytest.mark.parametrize("cmd, runners", [
    ("pytest -q tests", ["pytest"]),
    ("python3 -m pytest tests/test_a.py::test_x", ["pytest"]),
    ("PYTHONPATH=src .venv/bin/python -X dev -m pytest", ["pytest"]),
    ("uv run pytest && go test ./...", ["pytest", "go"]),
    ("python -m unittest discover -s tests", ["unittest"]),
    ("cargo +nightly test --all", ["cargo"]),
    ("node --test test/", ["node"]),
    ("npx jest --ci", ["jest"]),
    ("timeout 60 npx vitest run", ["vitest"]),
    ("node node_modules/.bin/jest", ["jest"]),
    ("echo pytest", []),
    ("make test", []),
    ("npm test", []),
    ("python3 check.py", []),
    ("go vet ./...", []),
])
def test_the_runner_is_recognised_from_the_command(cmd, runners):
    assert engine.test_runners(cmd) == runners


DOCUMENTED = {
    "pytest": ["===== 1 failed, 3 passed, 1 skipped, 2 xfailed, 1 warning in 0.52s =====",
               "1 passed, 2 errors in 65.12s (0:01:05)"],
    "go": ["--- FAIL: TestAdd (0.00s)", "FAIL", "FAIL\texample.com/calc\t0.004s",
           "ok  \texample.com/util\t0.002s", "ok  \texample.com/cached\t(cached)",
           "?   \texample.com/cmd\t[no test files]"],
    "cargo": ["test result: FAILED. 3 passed; 1 failed; 2 ignored; 0 measured; 0 filtered out; "
              "finished in 0.00s",
              "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out"],
    "node": ["\u2139 tests 4", "\u2139 suites 0", "\u2139 pass 2", "\u2139 fail 1",
             "\u2139 cancelled 0", "\u2139 skipped 1", "\u2139 todo 0"],
    "jest": ["Test Suites: 1 failed, 2 passed, 3 total",
             "Tests:       1 failed, 1 skipped, 5 passed, 7 total"],
    "vitest": [" Test Files  1 failed | 1 passed (2)",
               "      Tests  1 failed | 3 passed | 1 skipped (5)"],
    "unittest": ["Ran 6 tests in 0.003s", "", "FAILED (failures=1, errors=1, skipped=2)"],
}
COUNTS = {
    "pytest": {"passed": 4, "failed": 1, "errors": 2, "skipped": 3},
    "go": {"passed": 2, "failed": 1, "errors": 0, "skipped": 0},
    "cargo": {"passed": 4, "failed": 1, "errors": 0, "skipped": 2},
    "node": {"passed": 2, "failed": 1, "errors": 0, "skipped": 1},
    "jest": {"passed": 5, "failed": 1, "errors": 0, "skipped": 1},
    "vitest": {"passed": 3, "failed": 1, "errors": 0, "skipped": 1},
    "unittest": {"passed": 2, "failed": 1, "errors": 1, "skipped": 2},
}


@pytest.mark.parametrize("runner", sorted(DOCUMENTED))
def test_each_runners_documented_summary_is_read(runner):
    assert engine.runner_counts(runner, DOCUMENTED[runner]) == COUNTS[runner]
    assert engine.runner_counts(runner, ["all good", "exit 0"]) is None


def test_a_suite_that_failed_to_load_is_an_error_for_jest_and_vitest():
    assert engine.runner_counts("jest", ["Test Suites: 1 failed, 1 total",
                                         "Tests:       0 total"])["errors"] == 1
    assert engine.runner_counts("vitest", [" Test Files  1 failed (1)",
                                           "      Tests  no tests"])["errors"] == 1


def test_coloured_pytest_output_is_read(fab):
    one_check(fab, PYTEST + " --color=yes test_calc.py || true", {"test_calc.py": TESTS})
    refused_keeping_runs(fab, "G001", "exit 0 but pytest reported 1 failed")


def test_a_test_reported_twice_is_fixed_only_when_no_run_of_it_failed():
    """A test id the branch's report names twice (a twin of the failing test under its id)
    is fixed, or still passing, only when no run of it failed: a pass beside a failure proves
    nothing."""
    from fablize_gate.reports import compare, ERROR, FAILED, PASSED, Report

    def report(**tests):
        r = Report(["pytest"])
        for test_id, outcomes in tests.items():
            for outcome in outcomes:
                r.add(test_id, outcome, "tests/test_calc.py")
        return r

    cmp = compare(report(t=[FAILED]), report(t=[FAILED, PASSED]))
    assert (cmp.fixed, cmp.still_failing) == ([], ["t"])
    cmp = compare(report(t=[PASSED]), report(t=[PASSED, ERROR]))
    assert (cmp.fixed, cmp.broken) == ([], ["t"])
    cmp = compare(report(t=[FAILED]), report(t=[PASSED]))
    assert cmp.fixed == ["t"] and cmp.ok()
    cmp = compare(report(t=[PASSED, PASSED]), report(t=[PASSED, PASSED]))
    assert cmp.ok() and cmp.broken == []
