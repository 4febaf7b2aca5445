"""Issue 3: evidence that cannot be faked — engine-run verification (`--run`, `verify`), frozen
checks, unverifiable checks flagged at creation, fresh evidence only, the three verdicts with
bounded rounds and `decide`, `add`, and the Bar (no CLI sequence completes a story whose frozen
check fails short of `decide … accept`; hostile verification commands end, fail closed and leave
a record; the lock is never held while a check runs)."""

import copy
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import (SCRIPT, assert_refused, git, engine, ledger, make_plan, process_running,
                      run_cli, snapshot, start, state_files, story)

# What a test waits for is an event (a run's record, a process gone); these bound only a wait
# that would otherwise never end: far beyond what a loaded machine needs, yet far below the time
# a hostile command would take if it were not stopped (sleep 300).
HANG_GUARD = 120.0
WAIT_LIMIT = 60.0


# Helpers ######################################################################


def snap(fab):
    return snapshot(fab.dir)


def kinds(fab):
    return [e["event"] for e in ledger(fab.dir)]


def runs_of(fab, sid=None):
    return [e for e in ledger(fab.dir)
            if e["event"] == "verify_run" and (sid is None or e["id"] == sid)]


def sha256_file(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def ok(r):
    assert r.code == 0, r
    return r


def assert_refused_keeping_runs(fab, args, message):
    """A fail-closed completion: exit 1 with `message`; the only events appended are the
    verify_run records of the failed runs (the story stays as it was), each with its log."""
    before = ledger(fab.dir)
    sid = args[args.index("--id") + 1]
    status_before = story(fab.dir, sid)["status"]
    r = fab(*args)
    assert r.code == 1, r
    assert message in r.err, r
    after = ledger(fab.dir)
    assert after[:len(before)] == before
    new = after[len(before):]
    assert new and all(e["event"] == "verify_run" for e in new), new
    for e in new:
        assert (fab.dir / e["log"]).is_file()
    assert story(fab.dir, sid)["status"] == status_before
    return r, new


def checkpoint(*extra, sid="G001", status="complete", evidence="did it"):
    return ["checkpoint", "--id", sid, "--status", status, "--evidence", evidence, *extra]


def wait_until(predicate, limit=WAIT_LIMIT):
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kill_pid_file(path):
    """Kill the process whose pid a test's own command wrote to `path` (never by name)."""
    try:
        pid = int(Path(path).read_text().strip())
    except (FileNotFoundError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self") or os.name == "nt",
                                reason="process checks use /proc and POSIX process groups")


# 1. The engine runs the verification itself ####################################


def test_run_executes_verify_cmd_through_the_shell_in_the_project_root_and_records_it(
        fab, monkeypatch):
    make_plan(fab, 1)
    sub = fab.root / "deep" / "sub"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)  # the state directory is found upward; the run happens at its parent
    started = ok(fab("next"))
    assert "handoff — G001" in started.out
    cmd = "pwd > where.txt && echo one two | tr a-z A-Z"
    r = ok(fab(*checkpoint("--run", "--verify-cmd", cmd, "--verify-evidence", "")))
    assert "fablize: G001 → complete" in r.out
    assert "ONE TWO" in r.out  # the shell ran the pipe, its output was streamed
    assert os.path.realpath((fab.root / "where.txt").read_text().strip()) == \
        os.path.realpath(fab.root)
    assert not (sub / "where.txt").exists()
    events = ledger(fab.dir)
    assert [e["event"] for e in events] == ["plan_created", "story_started", "verify_run",
                                            "checkpoint"]
    run = events[2]
    assert run["cmd"] == cmd
    assert run["cwd"] == "."  # the project root, relative to the repository: no machine's path
    assert run["exit_code"] == 0 and run["timed_out"] is False and run["error"] is None
    assert isinstance(run["duration_s"], (int, float)) and run["duration_s"] >= 0
    assert run["log"] == f"runs/{run['seq']}-G001.log"
    log = fab.dir / run["log"]
    assert log.read_bytes() == b"ONE TWO\n"
    assert run["bytes"] == len(log.read_bytes())
    assert run["sha256"] == sha256_file(log)
    assert run["tail"] == "ONE TWO\n"
    assert run["after_seq"] >= events[1]["seq"] and run["after_seq"] < run["seq"]
    assert events[3]["runs"] == [run["seq"]]
    assert ok(fab("audit")).code == 0


def test_run_tail_is_the_last_500_characters_and_the_log_holds_everything(fab):
    make_plan(fab, 1)
    start(fab, "G001")
    text = "".join(f"line {i:04d} " + "abcdefghij" * 3 + "\n" for i in range(200)) + "THE-END"
    (fab.root / "out.txt").write_text(text)
    ok(fab(*checkpoint("--run", "--verify-cmd", "cat out.txt")))
    run = runs_of(fab)[0]
    assert len(run["tail"]) == 500 and run["tail"] == text[-500:]
    assert (fab.dir / run["log"]).read_text() == text
    assert run["bytes"] == len(text.encode())


def test_a_runs_echo_is_cut_with_a_count_and_the_log_keeps_all(fab):
    """The issue's 300 KB single line: the terminal is shown its start and its end, with how
    much was left out; the log keeps every byte."""
    make_plan(fab, 1, "--verify", "python3 big.py")
    (fab.root / "big.py").write_text("print('S' + 'x' * 300000 + 'E')\n")
    start(fab, "G001")
    r = fab("verify", "--id", "G001")
    assert r.code == 0, r.err
    shown = engine.ECHO_HEAD + engine.ECHO_TAIL
    assert len(r.out) < shown + 2000, len(r.out)
    left = 300003 - shown  # S, the x's, E and the line break, less what was shown
    cut = f"… {left:,} characters not shown here (the run's log keeps all) …"
    assert cut in r.out, r.out[-300:]
    assert "  │ Sxxx" in r.out and "xxxE\n" in r.out
    run = runs_of(fab)[0]
    assert (fab.dir / run["log"]).read_bytes() == b"S" + b"x" * 300000 + b"E\n"


def test_run_output_is_streamed_to_stdout_escaped_and_logged_raw(fab):
    make_plan(fab, 1)
    start(fab, "G001")
    r = ok(fab(*checkpoint("--run", "--verify-cmd", r"printf 'A\033]0;pwned\007B\n'")))
    assert "A\\x1b]0;pwned\\x07B" in r.out
    assert "\x1b" not in r.out and "\x07" not in r.out
    run = runs_of(fab)[0]
    assert (fab.dir / run["log"]).read_bytes() == b"A\x1b]0;pwned\x07B\n"


def test_run_command_sees_closed_stdin(project):
    assert run_cli("create", "--brief", "b", "--goal", "S1::o1", cwd=project).code == 0
    assert run_cli("next", cwd=project).code == 0
    cmd = 'if read line; then echo "got:$line"; else echo "stdin-eof"; fi'
    r = run_cli("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e", "--run",
                "--verify-cmd", cmd, cwd=project, input=b"LEAKED-INPUT\n")
    assert r.code == 0, r
    run = [e for e in ledger(project / ".fablize") if e["event"] == "verify_run"][0]
    assert run["tail"] == "stdin-eof\n"
    assert "LEAKED-INPUT" not in r.out


def test_run_records_git_head_and_whether_the_tree_was_dirty(fab):
    shutil.rmtree(fab.root / ".git")
    git(fab.root, "init", "-q")
    (fab.root / "README").write_text("hello\n")
    git(fab.root, "add", "README")
    git(fab.root, "commit", "-q", "-m", "init")
    head = git(fab.root, "rev-parse", "HEAD").strip()
    make_plan(fab, 2)
    start(fab, "G001")
    ok(fab(*checkpoint("--run", "--verify-cmd", "true")))
    clean_run = runs_of(fab)[-1]
    # the state directory itself (untracked) does not count as a dirty tree
    assert clean_run["git_head"] == head and clean_run["git_dirty"] is False
    (fab.root / "README").write_text("changed\n")
    start(fab, "G002")
    ok(fab(*checkpoint("--run", "--verify-cmd", "true", sid="G002")))
    dirty_run = runs_of(fab)[-1]
    assert dirty_run["git_head"] == head and dirty_run["git_dirty"] is True


def test_run_outside_a_git_repository_records_no_git_head(fab):
    make_plan(fab, 1)  # the fixture's .git is an empty directory, not a repository
    start(fab, "G001")
    ok(fab(*checkpoint("--run", "--verify-cmd", "true")))
    run = runs_of(fab)[0]
    assert run["git_head"] is None and run["git_dirty"] is None


@pytest.mark.parametrize("cmd, exit_code, signal_name, described", [
    ("echo about to fail; exit 3", 3, None, "exit 3"),
    ("echo dying; kill -9 $$", -9, "SIGKILL", "killed by SIGKILL"),
    ("no-such-program-fablize-xyz --version", 127, None, "exit 127"),
], ids=["nonzero", "signal", "not-found"])
def test_run_that_does_not_exit_0_fails_closed_and_stays_in_the_ledger(fab, cmd, exit_code,
                                                                         signal_name, described):
    make_plan(fab, 1)
    start(fab, "G001")
    r, new = assert_refused_keeping_runs(
        fab, checkpoint("--run", "--verify-cmd", cmd, "--verify-evidence", "it passed, trust me"),
        f"G001: `{cmd}` failed ({described}).")
    assert "G001 stays in progress" in r.err
    run = new[0]
    assert run["exit_code"] == exit_code and run["signal"] == signal_name
    assert run["sha256"] == sha256_file(fab.dir / run["log"])
    assert story(fab.dir, "G001")["status"] == "in_progress"
    assert "checkpoint" not in kinds(fab)
    # the failed run is evidence: `log` shows it, `audit` accepts the ledger
    assert f"G001 run `{cmd}` → {described}" in ok(fab("log", "--id", "G001")).out
    ok(fab("audit"))


def test_run_makes_verify_evidence_optional_on_the_final_story(fab):
    make_plan(fab, 1)
    start(fab, "G001")
    r = ok(fab(*checkpoint("--run", "--verify-cmd", "echo 3 passed")))
    assert "fablize: all stories complete ✓" in r.out
    assert ledger(fab.dir)[-1]["verify_evidence"] == ""


def test_run_without_verify_cmd_is_a_usage_error(fab):
    make_plan(fab, 1)
    start(fab, "G001")
    assert_refused(fab, checkpoint("--run"), 2, "--run needs --verify-cmd")


def test_json_checkpoint_with_run_prints_one_json_object_and_streams_to_stderr(fab):
    make_plan(fab, 1)
    start(fab, "G001")
    r = fab("--json", *checkpoint("--run", "--verify-cmd", "echo streamed-to-stderr"))
    assert r.code == 0, r
    obj = json.loads(r.out)  # exactly one object: the run's output did not go to stdout
    assert obj["ok"] is True and obj["command"] == "checkpoint"
    assert obj["runs"][0]["tail"] == "streamed-to-stderr\n"
    assert "streamed-to-stderr" in r.err


def test_verify_runs_a_storys_checks_without_changing_its_status(fab):
    make_plan(fab, 2, "--check", "G002=echo checking-G002")
    before = story(fab.dir, "G002")["status"]
    r = ok(fab("verify", "--id", "G002"))
    assert "1 check passed" in r.out
    assert story(fab.dir, "G002")["status"] == before == "pending"
    assert kinds(fab) == ["plan_created", "verify_run"]
    assert runs_of(fab)[0]["tail"] == "checking-G002\n"


def test_verify_refuses_with_exit_1_when_a_check_fails_and_records_the_run(fab):
    make_plan(fab, 2, "--check", "G001=exit 4")
    r = fab("verify", "--id", "G001")
    assert r.code == 1 and "1 of 1 check failed" in r.err, r
    assert kinds(fab) == ["plan_created", "verify_run"]
    assert story(fab.dir, "G001")["status"] == "pending"


def test_verify_without_checks_or_command_is_refused(fab):
    make_plan(fab, 2)
    assert_refused(fab, ["verify", "--id", "G001"], 1, "G001 has no frozen checks")


# 2. Checks frozen up front #####################################################


def test_create_freezes_checks_and_verify_commands_in_the_plan(fab):
    make_plan(fab, 3, "--check", "G002=pytest -q tests/a.py", "--check", "G002=true",
              "--check", "G003=echo final-1", "--verify", "echo final-2", "--verify", "true")
    created = ledger(fab.dir)[0]
    assert created["event"] == "plan_created"
    checks = {s["id"]: s["checks"] for s in created["stories"]}
    assert checks == {"G001": [], "G002": ["pytest -q tests/a.py", "true"],
                      "G003": ["echo final-1", "echo final-2", "true"]}
    stories = ok(fab("status", "--json")).json["stories"]
    assert [s["checks"] for s in stories] == list(checks.values())


def test_complete_runs_every_frozen_check_and_needs_all_to_pass(fab):
    make_plan(fab, 2, "--check", "G001=exit 5",
              "--check", "G001=touch second-ran; test -f fixed.flag")
    start(fab, "G001")
    # no --run: the frozen checks run anyway, all of them, even after the first one failed
    r, new = assert_refused_keeping_runs(fab, checkpoint(),
                                         "G001: frozen check 1 (`exit 5`) failed (exit 5).")
    assert [(e["check"], e["exit_code"]) for e in new] == [(0, 5), (1, 1)]
    assert (fab.root / "second-ran").exists()
    # one passing check is not enough
    (fab.root / "fixed.flag").write_text("")
    r, new = assert_refused_keeping_runs(fab, checkpoint(), "frozen check 1 (`exit 5`) failed")
    assert [(e["check"], e["exit_code"]) for e in new] == [(0, 5), (1, 0)]


def test_complete_with_frozen_checks_completes_when_all_pass(fab):
    make_plan(fab, 2, "--check", "G001=true", "--check", "G001=test -f fixed.flag")
    start(fab, "G001")
    assert_refused_keeping_runs(fab, checkpoint(), "frozen check 2 (`test -f fixed.flag`) failed")
    (fab.root / "fixed.flag").write_text("")
    r = ok(fab(*checkpoint()))
    assert "fablize: G001 → complete" in r.out
    assert ledger(fab.dir)[-1]["event"] == "checkpoint"
    assert [e["exit_code"] for e in runs_of(fab)][-2:] == [0, 0]


@pytest.mark.parametrize("claim", [
    ["--verify-cmd", "true", "--verify-evidence", "ok"],
    ["--run", "--verify-cmd", "true"],
    ["--run", "--verify-cmd", "true", "--verify-evidence", "all green"],
], ids=["claimed", "run-own-command", "run-with-evidence"])
def test_an_agents_own_command_cannot_substitute_for_a_failing_frozen_check(fab, claim):
    make_plan(fab, 1, "--verify", "exit 9")
    start(fab, "G001")
    r, new = assert_refused_keeping_runs(fab, checkpoint(*claim),
                                         "G001: frozen check 1 (`exit 9`) failed (exit 9).")
    assert [e["cmd"] for e in new] == ["exit 9"]  # the agent's `true` was not what ran


def test_frozen_check_on_a_middle_story_gates_its_completion(fab):
    make_plan(fab, 3, "--check", "G002=exit 2")
    start(fab, "G001")
    ok(fab(*checkpoint()))
    start(fab, "G002")
    assert_refused_keeping_runs(fab, checkpoint(sid="G002"),
                                "G002: frozen check 1 (`exit 2`) failed")
    assert story(fab.dir, "G002")["status"] == "in_progress"


def test_require_run_refuses_a_claimed_final_result(fab):
    make_plan(fab, 1, "--require-run")
    assert ok(fab("status", "--json")).json["options"]["require_run"] is True
    start(fab, "G001")
    assert_refused(fab, checkpoint("--verify-cmd", "true", "--verify-evidence", "3 passed"), 1,
                   "this plan requires a witnessed run")
    r = ok(fab(*checkpoint("--run", "--verify-cmd", "true")))
    assert "fablize: all stories complete ✓" in r.out


def test_require_run_accepts_passing_frozen_checks_on_the_final_story(fab):
    make_plan(fab, 1, "--require-run", "--verify", "echo ok")
    start(fab, "G001")
    r = ok(fab(*checkpoint()))
    assert "fablize: all stories complete ✓" in r.out


def test_require_run_does_not_gate_a_middle_story(fab):
    make_plan(fab, 2, "--require-run")
    start(fab, "G001")
    ok(fab(*checkpoint()))


# 3. Unverifiable checks flagged at creation #####################################


def test_create_flags_checks_that_cannot_run_here_and_still_creates_the_plan(fab):
    r = fab("create", "--brief", "b", "--goal", "S1::o1", "--goal", "S2::o2",
            "--check", "G001=no-such-tool-fablize-abc --all",
            "--verify", "./scripts/missing-gate.sh", "--verify", "true")
    assert r.code == 0, r
    assert "fablize: plan created — 2 stories" in r.out
    # a program missing here must be fixed now; a file not there yet is a test-first check
    assert "⚠ 1 frozen check cannot run here — fix the command or install what it needs now" \
        in r.out
    assert "G001 check 1: `no-such-tool-fablize-abc --all` — no-such-tool-fablize-abc is not " \
        "on PATH" in r.out
    assert "1 frozen check starts a file that does not exist yet — fine for a test-first plan" \
        in r.out
    assert "G002 check 1: `./scripts/missing-gate.sh` — ./scripts/missing-gate.sh does not " \
        "exist yet" in r.out
    assert "fix" not in r.out.split("starts a file")[1]  # never "fix now" for a test to be written
    assert r.out.splitlines()[-1] == "fablize: next — `goals.py next` (activates G001)"
    expected = [
        {"id": "G001", "check": 0, "cmd": "no-such-tool-fablize-abc --all",
         "reason": "no-such-tool-fablize-abc is not on PATH"},
        {"id": "G002", "check": 0, "cmd": "./scripts/missing-gate.sh",
         "reason": "./scripts/missing-gate.sh does not exist"},
    ]
    assert ledger(fab.dir)[0]["unverifiable"] == expected
    assert ok(fab("status", "--json")).json["unverifiable"] == expected
    text = ok(fab("status")).out
    assert "⚠ G001 check 1 cannot run here: `no-such-tool-fablize-abc --all` — " \
           "no-such-tool-fablize-abc is not on PATH" in text
    assert "· G002 check 1 waits for its file: `./scripts/missing-gate.sh`" in text


def test_create_with_runnable_checks_flags_nothing(fab):
    r = ok(fab("create", "--brief", "b", "--goal", "S1::o1", "--verify", "true"))
    assert "cannot run here" not in r.out
    assert ok(fab("status", "--json")).json["unverifiable"] == []
    assert "cannot run here" not in ok(fab("status")).out


@pytest.mark.parametrize("cmd, flagged", [
    ("true", None),
    ("cd . && true", None),
    ("export A=1; echo $A", None),
    ("FOO=1 BAR=two true --x", None),
    ("echo hi | wc -l", None),
    ("./tools/run.sh --fast", None),
    ("true && no-such-prog-fab1", "no-such-prog-fab1 is not on PATH"),
    ("true || no-such-prog-fab2", "no-such-prog-fab2 is not on PATH"),
    ("echo x | no-such-prog-fab3", "no-such-prog-fab3 is not on PATH"),
    ("true; no-such-prog-fab4", "no-such-prog-fab4 is not on PATH"),
    ("FOO=1 no-such-prog-fab5 --flag", "no-such-prog-fab5 is not on PATH"),
    ("./tools/missing.sh", "./tools/missing.sh does not exist"),
    ("/nonexistent-fablize/bin/prog", "/nonexistent-fablize/bin/prog does not exist"),
    ("(no-such-prog-fab6 --x)", "no-such-prog-fab6 is not on PATH"),
] + [pytest.param(cmd, flagged)
    for cmd, flagged in [
        ("exec no-such-prog-fab7 --x", "no-such-prog-fab7 is not on PATH"),
        ("! no-such-prog-fab8", "no-such-prog-fab8 is not on PATH"),
        ("if no-such-prog-fab9; then echo yes; fi", "no-such-prog-fab9 is not on PATH"),
        ("if true; then no-such-prog-fab10; fi", "no-such-prog-fab10 is not on PATH"),
        ("{ no-such-prog-fab11; }", "no-such-prog-fab11 is not on PATH"),
        ("time no-such-prog-fab12", "no-such-prog-fab12 is not on PATH"),
    ]], ids=lambda v: str(v))
def test_unverifiable_detection_understands_builtins_assignments_and_chains(fab, cmd, flagged):
    (fab.root / "tools").mkdir()
    (fab.root / "tools" / "run.sh").write_text("#!/bin/sh\n")
    r = ok(fab("create", "--brief", "b", "--goal", "S1::o1", "--verify", cmd))
    found = snap(fab)["unverifiable"]
    if flagged is None:
        assert found == [] and "cannot run here" not in r.out
    else:
        assert [u["reason"] for u in found] == [flagged]
        assert flagged in r.out


def test_add_flags_an_unverifiable_check(fab):
    make_plan(fab, 2)
    r = ok(fab("add", "--goal", "Docs::write them", "--check", "no-such-prog-fab6 build"))
    assert "G003 check 1: `no-such-prog-fab6 build` — no-such-prog-fab6 is not on PATH" in r.out
    assert ok(fab("status", "--json")).json["unverifiable"] == [
        {"id": "G003", "check": 0, "cmd": "no-such-prog-fab6 build",
         "reason": "no-such-prog-fab6 is not on PATH"}]


# 4. Fresh evidence only ########################################################


def forged_checkpoint(plan, sid, **extra):
    ev = {"seq": plan["ledger"]["seq"] + 1, "ts": engine.now_iso(), "event": "checkpoint",
          "id": sid,
          "status": "complete", "evidence": "forged: it passed earlier", "verify_cmd": "",
          "verify_evidence": "", "prev": plan["ledger"]["head"]}
    ev.update(extra)
    return ev


def test_green_run_from_an_earlier_round_does_not_complete_the_reopened_story(fab):
    make_plan(fab, 2, "--check", "G001=test -f ok.flag")
    (fab.root / "ok.flag").write_text("")
    start(fab, "G001")
    assert "1 check passed" in ok(fab("verify", "--id", "G001")).out  # green in round 1
    green = runs_of(fab, "G001")[-1]
    assert green["exit_code"] == 0
    # control: in round 1 that green run is fresh, so a completion backed by it would be legal
    engine.apply_event(copy.deepcopy(snap(fab)), forged_checkpoint(snap(fab), "G001"))
    ok(fab(*checkpoint(status="failed", evidence="not there yet")))
    (fab.root / "ok.flag").unlink()
    assert "round 2" in start(fab, "G001").out
    # the engine refuses a completion that only the round-1 run could back ...
    with pytest.raises(engine.FablizeError) as e:
        engine.apply_event(snap(fab), forged_checkpoint(snap(fab), "G001"))
    assert e.value.code == "verification_missing"
    assert "has no run since the story was activated" in e.value.message
    # ... and the CLI runs the check again, which now fails
    r, new = assert_refused_keeping_runs(fab, checkpoint(),
                                         "frozen check 1 (`test -f ok.flag`) failed")
    assert new[0]["seq"] > green["seq"] and new[0]["exit_code"] == 1


def test_green_run_of_an_earlier_round_does_not_back_a_run_checkpoint(fab):
    make_plan(fab, 1)
    start(fab, "G001")
    ok(fab("verify", "--id", "G001", "--verify-cmd", "true"))
    ok(fab(*checkpoint(status="failed", evidence="not yet")))
    start(fab, "G001")
    with pytest.raises(engine.FablizeError) as e:
        engine.apply_event(snap(fab), forged_checkpoint(snap(fab), "G001", run=True,
                                                       verify_cmd="true"))
    assert e.value.code == "verification_missing"


def test_run_that_started_before_the_latest_activation_does_not_count(fab):
    make_plan(fab, 2, "--check",
              "G001=touch started.flag; while [ ! -f release.flag ]; do sleep 0.02; done; "
              "echo checked")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "verify", "--id", "G001",
                             "--timeout", "120"],
                            cwd=str(fab.root), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            env={k: v for k, v in os.environ.items()
                                 if not k.startswith("FABLIZE_")})
    try:
        assert wait_until(lambda: (fab.root / "started.flag").exists())
        start(fab, "G001")  # activated while the check (started on the pending story) still runs
    finally:
        (fab.root / "release.flag").write_text("")
        assert proc.wait(timeout=WAIT_LIMIT) == 0
    events = ledger(fab.dir)
    started = [e for e in events if e["event"] == "story_started"][-1]
    run = events[-1]
    assert run["event"] == "verify_run" and run["exit_code"] == 0
    assert run["after_seq"] < started["seq"]
    s = story(fab.dir, "G001")
    assert s["status"] == "in_progress" and s["runs"] == [] and s["last_run"]["seq"] == run["seq"]
    with pytest.raises(engine.FablizeError) as e:
        engine.apply_event(snap(fab), forged_checkpoint(snap(fab), "G001"))
    assert e.value.code == "verification_missing"


# 5. Three verdicts #############################################################


def test_failed_story_is_reopened_as_round_2_before_a_ready_earlier_story(fab):
    # G001 waits for G002; G002 and G003 are independent; G004 is the gate
    make_plan(fab, 4, "--parallel", "--after", "G001=G002")
    start(fab, "G002", "--agent", "a")
    start(fab, "G003", "--agent", "b")
    ok(fab(*checkpoint("--agent", "a", sid="G002")))
    # G001 is ready now, and earlier in the plan
    assert story(fab.dir, "G001")["status"] == "pending"
    r = ok(fab(*checkpoint("--agent", "b", sid="G003", status="failed", evidence="half done")))
    assert "G003 → failed (round 1 of 3; 2 rounds left)" in r.out
    r = start(fab, "G003", "--agent", "b")
    assert "⚠ Reopened: round 2" in r.out
    assert story(fab.dir, "G003")["round"] == 2 and story(fab.dir, "G001")["status"] == "pending"


@pytest.mark.parametrize("how", ["frozen", "run"])
def test_reopened_handoff_shows_what_was_missing_with_the_failed_runs_tails(fab, how):
    cmd = "echo TAIL-MARK-7 parser missing; exit 4"
    if how == "frozen":
        make_plan(fab, 1, "--verify", cmd)
        attempt = checkpoint()
    else:
        make_plan(fab, 1)
        attempt = checkpoint("--run", "--verify-cmd", cmd)
    start(fab, "G001")
    assert_refused_keeping_runs(fab, attempt, "failed (exit 4)")
    ok(fab(*checkpoint(status="failed", evidence="the parser is still missing")))
    h = start(fab, "G001").out
    assert "⚠ Reopened: round 2" in h and "Continue the work; do not restart it." in h
    missing = h[h.index("## What was missing (round 1, from the failed checkpoint)"):]
    assert "the parser is still missing" in missing
    assert f"failed run `{cmd}` (exit 4) — output tail:" in missing
    assert "TAIL-MARK-7 parser missing" in missing
    feedback = story(fab.dir, "G001")["feedback"]
    assert feedback["text"] == "the parser is still missing"
    assert feedback["runs"][0]["tail"] == "TAIL-MARK-7 parser missing\n"


def fail_rounds(fab, sid, n):
    for _ in range(n):
        start(fab, sid)
        r = ok(fab(*checkpoint(sid=sid, status="failed", evidence="still broken")))
    return r


def test_rounds_default_to_3_then_the_story_is_blocked(fab):
    make_plan(fab, 2)
    assert snap(fab)["options"]["rounds"] == 3
    fail_rounds(fab, "G001", 2)
    assert story(fab.dir, "G001")["status"] == "failed"
    r = fail_rounds(fab, "G001", 1)
    assert "G001 → blocked — a human must decide" in r.out
    s = story(fab.dir, "G001")
    assert s["status"] == "blocked" and s["round"] == 3
    assert "rounds exhausted (3 of 3)" in s["blocked_reason"]


def test_create_rounds_bounds_how_often_a_story_may_fail(fab):
    make_plan(fab, 2, "--rounds", "1")
    fail_rounds(fab, "G001", 1)
    assert story(fab.dir, "G001")["status"] == "blocked"


def test_create_refuses_rounds_below_1(fab):
    r = fab("create", "--brief", "b", "--goal", "S1::o", "--rounds", "0")
    assert r.code == 2 and "--rounds must be a whole number ≥ 1" in r.err, r
    assert state_files(fab.dir) == {}


@pytest.mark.parametrize("how", ["checkpoint-blocked", "rounds-exhausted"])
def test_blocked_story_halts_the_plan_until_a_human_decides(fab, how):
    make_plan(fab, 3, "--rounds", "1")
    start(fab, "G001")
    if how == "checkpoint-blocked":
        ok(fab(*checkpoint(status="blocked", evidence="the API does not exist")))
    else:
        ok(fab(*checkpoint(status="failed", evidence="no luck")))
    assert story(fab.dir, "G001")["status"] == "blocked"
    r = assert_refused(fab, ["next"], 1, "G001 is blocked")
    assert "the plan halts here" in r.err
    assert "one of:\n  goals.py decide --id G001 accept" in r.err
    assert_refused(fab, ["next", "--agent", "other"], 1, "A human must decide")
    out = ok(fab("status")).out
    assert "G001 is blocked (" in out and "one of:\n  goals.py decide --id G001 accept" in out


def test_decide_accept_counts_as_done_and_dependents_proceed(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    ok(fab(*checkpoint(status="blocked", evidence="cannot be done as specified")))
    assert_refused(fab, ["next"], 1, "A human must decide")
    r = ok(fab("decide", "--id", "G001", "accept", "--note", "good enough, shipping without it"))
    assert "G001 → accepted" in r.out
    s = story(fab.dir, "G001")
    assert s["status"] == "accepted" and s["decision"]["note"] == "good enough, shipping without it"
    last = ledger(fab.dir)[-1]
    assert (last["event"], last["id"], last["decision"], last["note"]) == \
        ("decision", "G001", "accept", "good enough, shipping without it")
    h = start(fab, "G002").out
    assert "accepted by a human decision: good enough, shipping without it" in h
    r = ok(fab(*checkpoint("--verify-cmd", "true", "--verify-evidence", "ok", sid="G002")))
    assert "fablize: all stories done ✓ (G001 accepted by a human decision)" in r.out
    assert "all stories complete" not in r.out
    assert "accepted by a human (unsigned): good enough" in ok(fab("status")).out


def test_decide_retry_resumes_with_the_note_as_feedback_and_resets_rounds(fab):
    make_plan(fab, 2, "--rounds", "2")
    fail_rounds(fab, "G001", 2)
    assert story(fab.dir, "G001")["status"] == "blocked"
    r = ok(fab("decide", "--id", "G001", "retry", "--note", "use the v2 endpoint instead"))
    assert "G001 → pending" in r.out
    assert ledger(fab.dir)[-1]["decision"] == "retry"
    h = start(fab, "G001").out
    assert "round 3 (1 of 2 since a human's decision) — a human asked for another attempt" in h
    assert "## What was missing (round 2, from a human's retry)" in h
    assert "use the v2 endpoint instead" in h
    # rounds reset: one more failure is a failed round, not a block
    ok(fab(*checkpoint(status="failed", evidence="v2 also broken")))
    assert story(fab.dir, "G001")["status"] == "failed"
    fail_rounds(fab, "G001", 1)
    assert story(fab.dir, "G001")["status"] == "blocked"


def test_decide_amend_extends_the_objective_keeping_the_original_visible(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    ok(fab(*checkpoint(status="blocked", evidence="objective is ambiguous")))
    ok(fab("decide", "--id", "G001", "amend", "--note", "also support UTF-16 input"))
    assert ledger(fab.dir)[-1]["decision"] == "amend"
    h = start(fab, "G001").out
    assert "Objective: objective 1" in h
    assert "Amended (" in h and "): also support UTF-16 input" in h
    s = story(fab.dir, "G001")
    assert s["status"] == "in_progress" and s["objective"] == "objective 1"
    assert [a["note"] for a in s["amendments"]] == ["also support UTF-16 input"]
    assert "amended: also support UTF-16 input" in ok(fab("status")).out
    ok(fab(*checkpoint()))


@pytest.mark.parametrize("state", ["pending", "in_progress", "complete"])
def test_decide_is_refused_on_a_story_that_is_not_blocked_failed_or_in_review(fab, state):
    make_plan(fab, 3)
    if state != "pending":
        start(fab, "G001")
    if state == "complete":
        ok(fab(*checkpoint()))
    assert story(fab.dir, "G001")["status"] == state
    assert_refused(fab, ["decide", "--id", "G001", "accept", "--note", "just do it"], 1,
                   f"G001 is {state} — `decide` applies to a blocked, failed or in-review story")


# 6. Amending the plan in the open ##############################################


def test_add_inserts_a_story_before_the_final_one_with_the_next_id(fab):
    make_plan(fab, 3)
    r = ok(fab("add", "--goal", "Docs::write the docs", "--check", "echo docs-ok"))
    assert "added G004 Docs — before the final story G003" in r.out
    plan = ok(fab("status", "--json")).json
    assert [s["id"] for s in plan["stories"]] == ["G001", "G002", "G004", "G003"]
    added = plan["stories"][2]
    assert added["checks"] == ["echo docs-ok"] and added["after"] == ["G002"]
    assert plan["stories"][-1]["final"] is True and "G004" in plan["stories"][-1]["after"]
    event = ledger(fab.dir)[-1]
    assert event["event"] == "story_added" and event["story"]["id"] == "G004"
    assert "G004 [pending] Docs" in ok(fab("status")).out
    # the gate waits for it
    start(fab, "G001")
    ok(fab(*checkpoint()))
    start(fab, "G002")
    ok(fab(*checkpoint(sid="G002")))
    start(fab, "G004")
    ok(fab(*checkpoint(sid="G004")))
    assert runs_of(fab, "G004")[-1]["tail"] == "docs-ok\n"
    start(fab, "G003")


def test_add_is_refused_once_the_final_story_has_started(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    ok(fab(*checkpoint()))
    start(fab, "G002")
    assert_refused(fab, ["add", "--goal", "Late::too late"], 1,
                   "the final story G002 is in_progress — stories can be added only before "
                   "verification starts")
    ok(fab(*checkpoint("--verify-cmd", "true", "--verify-evidence", "ok", sid="G002")))
    assert_refused(fab, ["add", "--goal", "Later::even later"], 1,
                   "the final story G002 is complete")


# 7. The Bar ####################################################################


def test_claimed_verify_cmd_true_completes_a_plan_without_frozen_checks_or_require_run(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    ok(fab(*checkpoint()))
    start(fab, "G002")
    r = ok(fab(*checkpoint("--verify-cmd", "true", "--verify-evidence", "ok", sid="G002")))
    assert "fablize: all stories complete ✓" in r.out
    assert runs_of(fab) == []  # a claim, not a run


def test_failing_frozen_check_yields_to_no_cli_sequence_but_a_human_accept(fab):
    make_plan(fab, 3, "--check", "G002=echo not yet; exit 7", "--verify", "exit 9", "--rounds", "2")
    start(fab, "G001")
    ok(fab(*checkpoint()))
    start(fab, "G002")
    G2 = "frozen check 1 (`echo not yet; exit 7`) failed"
    for attempt in (checkpoint(sid="G002"),
                    checkpoint("--verify-cmd", "true", "--verify-evidence", "ok", sid="G002"),
                    checkpoint("--run", "--verify-cmd", "true", sid="G002"),
                    checkpoint("--run", "--verify-cmd", "echo not yet; exit 7", sid="G002")):
        assert_refused_keeping_runs(fab, attempt, G2)
    r = fab("verify", "--id", "G002", "--verify-cmd", "true")  # runs the frozen check, not `true`
    assert r.code == 1 and runs_of(fab)[-1]["cmd"] == "echo not yet; exit 7"
    # failed -> next -> complete
    ok(fab(*checkpoint(sid="G002", status="failed", evidence="still red")))
    start(fab, "G002")
    assert_refused_keeping_runs(fab, checkpoint("--verify-cmd", "true", "--verify-evidence", "ok",
                                                sid="G002"), G2)
    # add a story, then try again
    ok(fab("add", "--goal", "Workaround::skip the check", "--check", "true", "--after", "G001"))
    assert_refused_keeping_runs(fab, checkpoint(sid="G002"), G2)
    # blocked -> retry / amend -> complete
    ok(fab(*checkpoint(sid="G002", status="blocked", evidence="cannot")))
    ok(fab("decide", "--id", "G002", "retry", "--note", "try harder"))
    start(fab, "G002")
    assert_refused_keeping_runs(fab, checkpoint(sid="G002"), G2)
    ok(fab(*checkpoint(sid="G002", status="blocked", evidence="cannot")))
    ok(fab("decide", "--id", "G002", "amend", "--note", "the check is what counts"))
    start(fab, "G002")
    assert_refused_keeping_runs(fab, checkpoint(sid="G002"), G2)
    assert story(fab.dir, "G002")["status"] == "in_progress"
    assert not [e for e in ledger(fab.dir) if e["event"] == "checkpoint" and e["id"] == "G002"
                and e["status"] == "complete"]
    # only a human accept gets past it, and the ledger shows that decision
    ok(fab(*checkpoint(sid="G002", status="blocked", evidence="the check cannot pass here")))
    ok(fab("decide", "--id", "G002", "accept", "--note", "known flaky check, accepted by the lead"))
    assert story(fab.dir, "G002")["status"] == "accepted"
    decision = ledger(fab.dir)[-1]
    assert (decision["event"], decision["id"], decision["decision"]) == \
        ("decision", "G002", "accept")
    start(fab, "G004")
    ok(fab(*checkpoint(sid="G004")))
    start(fab, "G003")
    assert_refused_keeping_runs(fab, checkpoint("--verify-cmd", "true", "--verify-evidence", "ok",
                                                sid="G003"),
                                "G003: frozen check 1 (`exit 9`) failed")
    assert not snap(fab)["goals"][-1]["status"] == "complete"
    ok(fab("audit"))


def random_walk(fab, rng, steps, guarded):
    """Random CLI calls (no `decide accept`, no `create --force`) on a plan whose `guarded`
    stories have frozen checks that always fail; returns how many completions were attempted on
    them while they were in progress. Weighted towards what an agent would try: complete the
    active story with every kind of claim, fail or block it, reopen, retry, amend, add."""
    attempts = 0
    claims = [[], ["--verify-cmd", "true", "--verify-evidence", "ok"],
              ["--run", "--verify-cmd", "true"], ["--run", "--verify-cmd", "exit 7"],
              ["--verify-cmd", "exit 9", "--verify-evidence", "passed"]]
    for _ in range(steps):
        plan = snap(fab)
        stories = plan["goals"]
        active = [s for s in stories if s["status"] == "in_progress"]
        stuck = [s for s in stories if s["status"] in ("failed", "blocked")]
        roll = rng.random()
        if active and roll < 0.75:
            s = rng.choice(active)
            action = rng.choice(["complete"] * 6 + ["failed", "blocked", "verify"])
        elif not active and roll < 0.6:
            action, s = rng.choice(["next", "next-agent"]), None
        elif stuck and roll < 0.9:
            action, s = rng.choice(["retry", "amend"]), rng.choice(stuck)
        else:
            action = rng.choice(["add", "status", "verify", "complete", "retry", "next-agent"])
            s = rng.choice(stories)
        sid = s["id"] if s else None
        who = ["--agent", s["agent"]] if s and s["agent"] else []
        if action == "next":
            fab("next")
        elif action == "next-agent":
            fab("next", "--agent", rng.choice(["a", "b"]))
        elif action == "complete":
            if sid in guarded and s["status"] == "in_progress":
                attempts += 1
            fab(*checkpoint(*rng.choice(claims), *who, sid=sid))
        elif action in ("failed", "blocked"):
            fab(*checkpoint(*who, sid=sid, status=action, evidence="walk"))
        elif action == "verify":
            fab("verify", "--id", sid, "--verify-cmd", "true")
        elif action in ("retry", "amend"):
            fab("decide", "--id", sid, action, "--note", "walk decision")
        elif action == "add":
            fab("add", "--goal", "extra::more", *rng.choice([[], ["--check", "true"]]))
        else:
            fab("status")
        for x in snap(fab)["goals"]:
            if x["id"] in guarded:
                assert x["status"] not in ("complete", "accepted", "review"), (action, x)
    return attempts


def test_random_cli_sequences_never_complete_a_story_whose_frozen_check_fails(fab):
    walks = int(os.environ.get("FABLIZE_TEST_DEPTH", "4"))
    reached_gate = False
    for walk in range(walks):
        # even walks: a middle story and the gate have failing checks; odd: only the gate
        middle = ["--check", "G002=exit 7"] if walk % 2 == 0 else []
        guarded = {"G002", "G003"} if middle else {"G003"}
        ok(fab("create", "--force", "--brief", f"walk {walk}", "--goal", "A::a", "--goal", "B::b",
               "--goal", "C::c", *middle, "--verify", "exit 9", "--rounds", "2",
               "--after", "G002="))
        tried = random_walk(fab, random.Random(walk), 40, guarded)
        assert tried > 0  # the walk did try to complete a guarded story while it was active
        events = ledger(fab.dir)
        assert not [e for e in events if e["event"] == "checkpoint"
                    and e.get("status") == "complete" and e["id"] in guarded]
        assert not [e for e in events if e["event"] == "decision" and e["decision"] == "accept"]
        ok(fab("audit"))
        reached_gate = reached_gate or any(e["event"] == "verify_run" and e["id"] == "G003"
                                           for e in events)
    assert reached_gate  # at least one walk got to the final gate and tried it


def big_output_script(root, exit_code):
    (root / "big.py").write_text(
        "import sys\n"
        "line = b'x' * 99 + b'\\n'\n"
        "for _ in range(500):\n"
        "    sys.stdout.buffer.write(line * 1000)\n"
        "sys.stdout.buffer.write(b'BIG-TAIL-MARK\\n')\n"
        f"sys.exit({exit_code})\n")
    return f"'{sys.executable}' big.py"


@pytest.mark.slow  # among the longest: started first (conftest)
def test_50_mb_of_output_ends_fails_closed_and_leaves_a_readable_log(fab):
    """A run that prints 50 MB (~12 s, the suite's largest output): memory stays flat while it
    streams, the whole output reaches the log on disk (its size and digest as recorded), the
    ledger keeps only a 500-character tail (no line of it over 10 KB), `--json` still prints
    one object on stdout, and the failed run leaves the story in progress."""
    make_plan(fab, 1)
    start(fab, "G001")
    cmd = big_output_script(fab.root, 3)
    r = run_cli("--json", "checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
                "--run", "--verify-cmd", cmd, "--timeout", "120", cwd=fab.root, timeout=300)
    assert r.code == 1, r
    obj = json.loads(r.out)  # one JSON object; the 50 MB went to stderr
    assert obj["ok"] is False and obj["error"]["code"] == "verification_failed"
    run = runs_of(fab)[-1]
    assert run["exit_code"] == 3 and run["timed_out"] is False
    assert run["bytes"] == 50_000_000 + len("BIG-TAIL-MARK\n")
    log = fab.dir / run["log"]
    assert log.stat().st_size == run["bytes"]
    assert run["sha256"] == sha256_file(log)
    assert run["tail"].endswith("BIG-TAIL-MARK\n") and len(run["tail"]) == 500
    assert max(len(line) for line in (fab.dir / "ledger.jsonl").read_bytes().splitlines()) < 10_000
    assert story(fab.dir, "G001")["status"] == "in_progress"


@needs_proc
def test_never_exiting_run_is_killed_with_its_process_group_at_the_timeout(fab):
    make_plan(fab, 1)
    start(fab, "G001")
    cmd = ("sh -c 'echo $$ > bg.pid; exec sleep 300' & "
           "while [ ! -s bg.pid ]; do sleep 0.01; done; echo waiting-forever; sleep 300")
    try:
        # stopped at its timeout, or the sleep's 300 s would outlast the guard
        r = run_cli("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
                    "--run", "--verify-cmd", cmd, "--timeout", "1", cwd=fab.root,
                    timeout=HANG_GUARD)
        assert r.code == 1, r
        assert "G001: `" in r.err and "failed (timed out after" in r.err, r
        assert "stays in progress" in r.err, r
        run = runs_of(fab)[-1]
        assert run["timed_out"] is True and run["signal"] == "SIGKILL"
        assert run["duration_s"] >= 1
        assert (fab.dir / run["log"]).read_text() == "waiting-forever\n"
        assert run["sha256"] == sha256_file(fab.dir / run["log"])
        assert story(fab.dir, "G001")["status"] == "in_progress"
        pid = int((fab.root / "bg.pid").read_text())
        assert wait_until(lambda: not process_running(pid)), "the background child survived"
    finally:
        kill_pid_file(fab.root / "bg.pid")


@needs_proc
def test_run_whose_background_child_outlives_it_passes_on_exit_0_and_its_group_is_stopped(fab):
    make_plan(fab, 1)
    start(fab, "G001")
    cmd = ("sh -c 'echo $$ > bg.pid; exec sleep 300' & "
           "while [ ! -s bg.pid ]; do sleep 0.01; done; echo started")
    try:
        r = ok(fab(*checkpoint("--run", "--verify-cmd", cmd, "--timeout", "120")))
        assert "fablize: all stories complete ✓" in r.out
        run = runs_of(fab)[-1]  # ended by its own exit, not by the 120 s timeout
        assert run["exit_code"] == 0 and run["timed_out"] is False
        assert (fab.dir / run["log"]).read_text() == "started\n"
        pid = int((fab.root / "bg.pid").read_text())
        assert wait_until(lambda: not process_running(pid)), "the leftover child was not stopped"
    finally:
        kill_pid_file(fab.root / "bg.pid")


@needs_proc
@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid")
def test_run_whose_child_escapes_into_its_own_session_does_not_hang(fab):
    make_plan(fab, 1)
    start(fab, "G001")
    cmd = ("setsid sh -c 'echo $$ > child.pid; exec sleep 300' & "
           "while [ ! -s child.pid ]; do sleep 0.01; done; echo started")
    try:
        r = run_cli("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
                    "--run", "--verify-cmd", cmd, "--timeout", "120", cwd=fab.root,
                    timeout=HANG_GUARD)
        # the command itself exited 0; the child holding the pipe does not hang it
        assert r.code == 0, r
        run = runs_of(fab)[-1]
        assert run["exit_code"] == 0 and run["timed_out"] is False
        assert (fab.dir / run["log"]).read_text() == "started\n"
        assert story(fab.dir, "G001")["status"] == "complete"
        assert ok(fab("audit")).code == 0
    finally:
        kill_pid_file(fab.root / "child.pid")


@needs_proc
@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid")
def test_a_child_escaped_into_its_own_session_costs_the_run_no_wait(fab):
    """Once the group is gone the reader empties the pipe and stops: it does not wait for an end
    of the pipe that the escaped child never gives (it used to, for 5 s). Seen as the event
    itself, not as a time: the run leaves no reader behind, blocked on the child's pipe."""
    make_plan(fab, 1)
    start(fab, "G001")
    cmd = ("setsid sh -c 'echo $$ > child.pid; exec sleep 300' & "
           "while [ ! -s child.pid ]; do sleep 0.01; done; echo started")
    before = set(threading.enumerate())
    try:
        ok(fab(*checkpoint("--run", "--verify-cmd", cmd, "--timeout", "120")))
        left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        assert left == [], left
        assert process_running(int((fab.root / "child.pid").read_text()))  # still holding it
    finally:
        kill_pid_file(fab.root / "child.pid")


@needs_proc
@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid")
def test_escaped_childs_output_does_not_leak_into_a_later_runs_log(fab):
    make_plan(fab, 1, "--verify",
              "setsid sh -c 'echo $$ > child.pid; while :; do echo LEAK; sleep 0.02; done' & "
              "while [ ! -s child.pid ]; do sleep 0.01; done; echo started",
              "--verify", "sleep 1; echo second")
    start(fab, "G001")
    try:
        r = run_cli("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
                    "--timeout", "60", cwd=fab.root, timeout=HANG_GUARD)
    finally:
        kill_pid_file(fab.root / "child.pid")
    assert r.code == 0, r
    second = runs_of(fab)[-1]
    assert second["check"] == 1
    assert (fab.dir / second["log"]).read_text() == "second\n"
    assert ok(fab("audit")).code == 0


def test_status_is_not_blocked_while_a_long_check_runs(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    out = open(fab.root / "checkpoint.out", "wb")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "checkpoint", "--id", "G001", "--status", "complete",
         "--evidence", "e", "--run", "--timeout", "120", "--verify-cmd",
         "touch started.flag; while [ ! -f release.flag ]; do sleep 0.02; done; echo released"],
        cwd=str(fab.root), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")})
    try:
        assert wait_until(lambda: (fab.root / "started.flag").exists())
        # another agent's commands while the check runs: they must get the lock at once
        r = run_cli("status", cwd=fab.root, env={"FABLIZE_LOCK_TIMEOUT": "5"})
        assert r.code == 0, r
        assert "▶ G001 [in_progress]" in r.out
        r = run_cli("--json", "log", cwd=fab.root, env={"FABLIZE_LOCK_TIMEOUT": "5"})
        assert r.code == 0, r
        assert proc.poll() is None  # the check was still running throughout
    finally:
        (fab.root / "release.flag").write_text("")
        code = proc.wait(timeout=WAIT_LIMIT)
        out.close()
    assert code == 0, (fab.root / "checkpoint.out").read_text()
    assert story(fab.dir, "G001")["status"] == "complete"
    assert runs_of(fab)[-1]["tail"] == "released\n"


# 8. The round trip from the Bar ###############################################


def test_round_trip_fail_reopen_fail_fail_blocked_retry_complete(fab):
    make_plan(fab, 2, "--check", "G001=echo checking; test -f fixed.flag", "--verify", "true")
    G1 = "G001: frozen check 1 (`echo checking; test -f fixed.flag`) failed (exit 1)"
    # round 1: the check fails, the story is failed
    start(fab, "G001")
    assert_refused_keeping_runs(fab, checkpoint(), G1)
    ok(fab(*checkpoint(status="failed", evidence="fixed.flag is not produced yet")))
    assert "round 1 of 3, 2 rounds left" in ok(fab("status")).out
    # round 2: reopened with what was missing
    h = start(fab, "G001").out
    assert "⚠ Reopened: round 2" in h
    assert "## What was missing (round 1, from the failed checkpoint)" in h
    assert "fixed.flag is not produced yet" in h and "checking" in h
    assert "round 2 of 3, 1 round left" in ok(fab("status")).out  # the round in progress counts
    assert_refused_keeping_runs(fab, checkpoint(), G1)
    ok(fab(*checkpoint(status="failed", evidence="still no fixed.flag")))
    # round 3: the last one
    start(fab, "G001")
    assert_refused_keeping_runs(fab, checkpoint(), G1)
    r = ok(fab(*checkpoint(status="failed", evidence="giving up")))
    assert "G001 → blocked" in r.out
    status = ok(fab("status")).out
    assert "■ G001 [blocked]" in status and "round 3 of 3, 0 rounds left" in status
    assert "rounds exhausted (3 of 3) — a human must decide" in status
    assert_refused(fab, ["next"], 1, "A human must decide")
    # the human retries with feedback; the story resumes and completes
    ok(fab("decide", "--id", "G001", "retry", "--note", "write fixed.flag from the build step"))
    h = start(fab, "G001").out
    assert "round 4 (1 of 3 since a human's decision)" in h
    assert "write fixed.flag from the build step" in h
    (fab.root / "fixed.flag").write_text("")
    ok(fab(*checkpoint()))
    data = ok(fab("status", "--json")).json
    assert data["stories"][0]["status"] == "complete" and data["stories"][0]["round"] == 4
    start(fab, "G002")
    assert "fablize: all stories complete ✓" in ok(fab(*checkpoint(sid="G002"))).out
    steps = [(e["event"],
              e.get("status") or e.get("decision") or e.get("round") or e.get("exit_code"))
             for e in ledger(fab.dir)]
    assert steps == [
        ("plan_created", None),
        ("story_started", 1), ("verify_run", 1), ("checkpoint", "failed"),
        ("story_started", 2), ("verify_run", 1), ("checkpoint", "failed"),
        ("story_started", 3), ("verify_run", 1), ("checkpoint", "failed"),
        ("decision", "retry"),
        ("story_started", 4), ("verify_run", 0), ("checkpoint", "complete"),
        ("story_started", 1), ("verify_run", 0), ("checkpoint", "complete"),
    ]
    ok(fab("audit"))


WRAPPER = r"""
import os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if hard != resource.RLIM_INFINITY and hard < 1200:
    sys.exit(77)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
for _ in range(1100):  # the engine starts with 1,100 descriptors open: its pipes come after
    os.set_inheritable(os.open(os.devnull, os.O_RDONLY), True)
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


@pytest.mark.skipif(os.name == "nt", reason="POSIX descriptors")
def test_a_run_whose_pipe_is_past_descriptor_1024_is_read_whole(fab, tmp_path):
    make_plan(fab, 1, "--verify", "printf hello-from-check")
    start(fab, "G001")
    wrapper = tmp_path / "many_fds.py"
    wrapper.write_text(WRAPPER)
    p = subprocess.run([sys.executable, str(wrapper), str(SCRIPT), "checkpoint", "--id", "G001",
                        "--status", "complete", "--evidence", "e"], cwd=str(fab.root),
                       capture_output=True, text=True, timeout=60)
    if p.returncode == 77:
        pytest.skip("cannot open 1,100 descriptors here")
    assert p.returncode == 0, p
    run = runs_of(fab)[-1]
    assert run["bytes"] == len("hello-from-check") and run["exit_code"] == 0, run
    assert (fab.dir / run["log"]).read_text() == "hello-from-check"
    assert "Traceback" not in p.stderr, p
