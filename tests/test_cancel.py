"""Cancelling a run: SIGINT, SIGTERM and SIGHUP stop the command the engine runs — its whole
process group — remove the temp log, record the run as interrupted when the state can still be
written, and exit 128 + N. Real processes and real signals throughout."""

import _thread
import contextlib
import fcntl
import io
import json
import os
import shutil
import shlex
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, SCRIPT, engine, group_alive, ledger

pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX signals and process groups")

# The run writes its shell's pid (its process group: the engine starts it in a new session),
# then sleeps; if the group survived, `after.txt` would appear once the sleep ends.
SLOW = "echo $$ > run.pid; sleep 30; echo done > after.txt"
# Every wait here is for an event (the run started, the engine exited, the group is gone); this
# bounds only a wait that would otherwise never end, far beyond what a loaded machine needs.
HANG_GUARD = 120


def env():
    e = {k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")}
    e["FABLIZE_LOCK_TIMEOUT"] = "0.5"
    return e


def spawn(root, *args, **kw):
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=str(root), env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def run_goals(root, *args):
    """The engine in-process (setting up and reading back need no real signals)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = engine.main(["--dir", str(root / ".fablize"), *args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def active(tmp_path):
    """A repository with a 2-story plan whose G001 is in progress."""
    (tmp_path / ".git").mkdir()
    assert run_goals(tmp_path, "create", "--brief", "b", "--goal", "A::a", "--goal", "B::b")[0] == 0
    assert run_goals(tmp_path, "next")[0] == 0
    return tmp_path


def wait_for_run(root, proc):
    """The run's pid, once its shell has written it; the engine must not have exited first."""
    deadline = time.monotonic() + HANG_GUARD
    pid_file = root / "run.pid"
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.02)
    return int(pid_file.read_text())


def assert_group_gone(pgid):
    """Once the engine has exited, no process of the run's group is left running (the kernel
    may take a moment to deliver the kill: waited for, not timed)."""
    deadline = time.monotonic() + HANG_GUARD
    while group_alive(pgid):
        assert time.monotonic() < deadline, f"process group {pgid} survived the signal"
        time.sleep(0.02)


def temp_logs(root):
    runs = root / ".fablize" / "runs"  # in runs/.inflight/ beside the notes (once in runs/)
    return sorted(p.name for p in [*runs.glob(".run-*"), *runs.glob(".inflight/.run-*")])


CHECKPOINT = ["checkpoint", "--id", "G001", "--status", "complete", "--evidence", "x", "--run",
              "--verify-cmd", SLOW]


@pytest.mark.parametrize("sig, how", [(signal.SIGTERM, "pid"), (signal.SIGINT, "group"),
                                      (signal.SIGHUP, "pid")])
def test_a_stop_signal_kills_the_runs_group_records_it_and_exits_128_plus_n(active, sig, how):
    before = len(ledger(active / ".fablize"))
    # Ctrl-C reaches the terminal's whole foreground group; a tool timeout signals the pid
    proc = spawn(active, *CHECKPOINT, start_new_session=(how == "group"))
    pgid = wait_for_run(active, proc)
    if how == "group":
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=HANG_GUARD)
    err = err.decode()
    assert proc.returncode == 128 + sig, (proc.returncode, out, err)
    assert_group_gone(pgid)
    name = signal.Signals(sig).name
    assert f"fablize: interrupted by {name}: `{SLOW}` was stopped (its whole process group " \
           "killed) and recorded as interrupted" in err, err
    # said live as what it is: interrupted, never a failure to fix
    live = out.decode() + err
    assert f"fablize: verification interrupted by {name}" in live, live
    assert "FAILED" not in live, live
    # one line, then the step: the checkpoint again (the run recorded, the story unchanged)
    assert err.count("\n") == 2 and "Traceback" not in err, err
    assert err.splitlines()[1].endswith("goals.py " + " ".join(map(shlex.quote, CHECKPOINT))), err
    events = ledger(active / ".fablize")
    assert len(events) == before + 1  # the run, and no checkpoint
    run = events[-1]
    assert run["event"] == "verify_run" and run["interrupted"] == name, run
    assert temp_logs(active) == []
    assert (active / ".fablize" / run["log"]).exists()
    assert not (active / "after.txt").exists()
    if sig != signal.SIGTERM:
        return  # what the record shows afterwards is the same for every signal
    code, status, _ = run_goals(active, "--json", "status")
    story = json.loads(status)["stories"][0]
    assert story["status"] == "in_progress" and story["last_run"]["interrupted"] == name
    assert not story["last_run"]["ok"]
    assert run_goals(active, "audit")[0] == 0
    _, log, _ = run_goals(active, "log", "--id", "G001")
    assert f"interrupted by {name}" in log, log
    _, report, _ = run_goals(active, "report")  # the runs' table: interrupted, not FAIL
    row = next(line for line in report.splitlines() if line.startswith(f"| {run['seq']} |"))
    assert f"| interrupted by {name}" in row and "FAIL" not in row, row
    assert "exit code only" not in row, row  # the run never ended: its runner said nothing
    # said as interrupted, with "run it again" as its step: never a failure to fix
    _, text, _ = run_goals(active, "status")
    assert "already failed" not in text and "fix what" not in text, text
    assert f"`{SLOW}` was interrupted (interrupted by {name}" in text, text
    assert "nothing to fix: run it again: " in text and "verify --id G001 --verify-cmd" in text


def test_a_run_whose_engine_was_killed_is_said_by_status_and_ended_by_the_next_writer(active):
    """kill -9 of the engine mid-run: its check's group is left with parent 1. status says a
    run was in flight and never finished; the next command that takes the lock ends the group
    and says so; nothing was recorded, and the run is run again."""
    before = len(ledger(active / ".fablize"))
    proc = spawn(active, *CHECKPOINT)
    pgid = wait_for_run(active, proc)
    # the engine notes the run once it has started it (it needs the group's id): a kill -9
    # between the two leaves a run no note names, a window this test waits out
    note = active / ".fablize" / "runs" / ".inflight" / f"{pgid}.json"
    deadline = time.monotonic() + HANG_GUARD
    while not note.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run was never noted"
        time.sleep(0.02)
    proc.kill()  # SIGKILL: no handler runs, the group is left behind
    proc.communicate(timeout=HANG_GUARD)
    assert group_alive(pgid)  # what the issue saw: the check keeps running
    try:
        _, text, _ = run_goals(active, "status")
        assert "was in flight and never finished" in text, text
        assert f"its engine, pid {proc.pid}, died" in text and "run it again: " in text, text
        # the session that resumes the work is told too (a session start reads, ends nothing)
        _, text, _ = run_goals(active, "status", "--resume")
        assert "was in flight and never finished" in text and "run it again: " in text, text
        assert group_alive(pgid)
        code, out, err = run_goals(active, "next")  # a writer: it takes the lock
        assert code == 0, err
        assert f"a run of `{SLOW}` for G001 was in flight when its engine (pid {proc.pid}) " \
            "died; what was left of it" in err and "was ended" in err, err
        assert_group_gone(pgid)
    finally:
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
    assert len(ledger(active / ".fablize")) == before  # it recorded nothing
    assert temp_logs(active) == []  # its temp log went with it: the run counts for nothing
    assert list((active / ".fablize" / "runs" / ".inflight").glob("*.json")) == []
    _, text, _ = run_goals(active, "status")
    assert "in flight" not in text, text
    _, text, _ = run_goals(active, "status", "--resume")
    assert "in flight" not in text, text
    assert not (active / "after.txt").exists()


def gnu_timeout():
    """coreutils' timeout, whose expiry is its own SIGALRM (timeout.c: cleanup(SIGALRM) sends the
    -s signal to the command), or None."""
    path = shutil.which("timeout")
    if path is None:
        return None
    p = subprocess.run([path, "--version"], capture_output=True, text=True)
    return path if "coreutils" in p.stdout else None


@pytest.mark.skipif(gnu_timeout() is None, reason="needs coreutils timeout")
def test_timeout_sends_term_and_the_run_does_not_finish_later(active):
    """The issue's own report: `timeout -s TERM 2 goals.py checkpoint … --run`. timeout expires
    once the run has started — its SIGALRM is sent then — rather than after a delay that a
    loaded machine could spend before the run even starts."""
    proc = subprocess.Popen([gnu_timeout(), "--preserve-status", "-s", "TERM", str(HANG_GUARD),
                             sys.executable, str(SCRIPT), *CHECKPOINT], cwd=str(active),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pgid = wait_for_run(active, proc)
    proc.send_signal(signal.SIGALRM)  # timeout's expiry, now
    out, err = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 143, (out, err)
    assert_group_gone(pgid)
    assert temp_logs(active) == []
    assert ledger(active / ".fablize")[-1]["interrupted"] == "SIGTERM"


def test_verify_is_interrupted_too_and_runs_nothing_after(active):
    assert run_goals(active, "create", "--force", "--brief", "b", "--goal", "A::a",
                     "--goal", "B::b", "--check", f"G001={SLOW}",
                     "--check", "G001=echo second > second.txt")[0] == 0
    proc = spawn(active, "--json", "verify", "--id", "G001")
    wait_for_run(active, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 143, (out, err)
    obj = json.loads(out)
    assert obj["ok"] is False and obj["error"]["code"] == "interrupted", obj
    assert obj["error"]["exit"] == 143
    assert not (active / "second.txt").exists()  # the second frozen check never started
    runs = [e for e in ledger(active / ".fablize") if e["event"] == "verify_run"]
    assert len(runs) == 1 and runs[0]["interrupted"] == "SIGTERM"


def test_when_the_state_cannot_be_written_the_temp_log_is_removed_all_the_same(active):
    before = (active / ".fablize" / "ledger.jsonl").read_bytes()
    proc = spawn(active, *CHECKPOINT)
    pgid = wait_for_run(active, proc)
    fd = os.open(active / ".fablize" / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another writer holds the lock past the 0.5 s limit
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=HANG_GUARD)
    finally:
        os.close(fd)
    err = err.decode()
    assert proc.returncode == 143, (out, err)
    assert_group_gone(pgid)
    assert "and not recorded (another fablize command holds" in err, err
    assert "its temp log was removed" in err, err
    assert temp_logs(active) == []
    assert (active / ".fablize" / "ledger.jsonl").read_bytes() == before


def test_help_and_readme_document_the_signal_exit_codes():
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert "128+N" in " ".join(p.stdout.split()) and "143 SIGTERM" in " ".join(p.stdout.split())
    readme = (SCRIPT.parent.parent / "docs" / "reference.md").read_text(encoding="utf-8")
    table = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    for code in ("130", "143", "129"):
        assert code in table, code



def test_ctrl_c_outside_a_run_exits_130_with_one_json_error(fab, monkeypatch):
    """Ctrl-C while the engine itself works (here: waiting for a lock another command holds):
    it arrives when the engine finds the lock held, and the lock is never given up on."""
    assert fab("create", "--brief", "b", "--goal", "A::a").code == 0
    monkeypatch.setenv("FABLIZE_LOCK_TIMEOUT", str(HANG_GUARD))
    # interrupt_main does nothing where SIGINT is ignored — a suite started in the background
    # (`make test &`) inherits SIG_IGN — or handled by something an earlier test left: the
    # handler Python answers Ctrl-C with, for this test
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try_acquire = engine.Lock._try_acquire

    def contended(lock):
        got = try_acquire(lock)
        if not got:
            _thread.interrupt_main()  # the user's Ctrl-C, while the engine waits
        return got
    monkeypatch.setattr(engine.Lock, "_try_acquire", contended)
    fd = os.open(fab.dir / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = fab("--json", "next")
    finally:
        os.close(fd)
        signal.signal(signal.SIGINT, previous)
    assert r.code == 130, r
    assert r.json["error"] == {"code": "interrupted", "exit": 130, "message": "interrupted by "
                               "SIGINT; the state is as the last completed write left it.",
                               "commands": ["goals.py --json next"]}  # the step: run it again
    assert len(ledger(fab.dir)) == 1


# Ctrl-C while `python3 scripts/goals.py` starts ##############################################


def test_ctrl_c_at_any_moment_of_the_start_never_prints_a_traceback_through_our_files(tmp_path):
    """40 Ctrl-Cs, one a start, spread over the first 0.5 s of `python3 scripts/goals.py status`
    (eight starts at a time; each moment is counted from its own spawn, so it falls wherever
    that start happens to be: Python's own start-up, goals.py, the engine's imports, the
    command, its exit): none is answered by a traceback through goals.py or the engine's folder.
    Python's own start-up, before goals.py's first statement, is out of its reach: a Ctrl-C
    there is raised as that statement is about to run, at `goals.py", line 0`."""
    (tmp_path / ".git").mkdir()
    assert subprocess.run([sys.executable, str(SCRIPT), "create", "--brief", "b", "--goal", "A::a"],
                          cwd=str(tmp_path), env=env(), capture_output=True).returncode == 0
    ours = (str(SCRIPT), str(SCRIPT.parent / "fablize_gate"))
    answered = 0
    for batch in range(5):  # eight starts at a time, each signalled at its own moment
        procs = []
        for i in range(8):
            procs.append((spawn(tmp_path, "status"), time.monotonic(), 0.5 * (batch + 5 * i) / 40))
        for p, spawned, delay in sorted(procs, key=lambda x: x[1] + x[2]):
            time.sleep(max(0.0, spawned + delay - time.monotonic()))
            p.send_signal(signal.SIGINT)
        for p, _, _ in procs:
            out, err = p.communicate(timeout=HANG_GUARD)
            err = err.decode("utf-8", "replace")
            # a signal that arrived while Python itself started (before goals.py's first
            # statement) is raised as the first instruction runs: `goals.py", line 0`, Python's
            frames = [line for line in err.splitlines() if line.strip().startswith("File ")]
            assert not any(f'File "{path}' in line and 'goals.py", line 0,' not in line
                           for line in frames for path in ours), err
            answered += p.returncode == 130
    assert answered, "no Ctrl-C landed while goals.py ran: the spread missed the start"


# A signal that lands inside Popen.wait, just after it took its lock and before the `try` that
# releases it: the lock below stands in for subprocess's own, and sends the signal at that very
# moment. A handler that raised there left the lock held; the engine's next wait on the run
# (after killing its group) then blocked for ever — seen once under load, the check's shell a
# zombie under an engine that never exited.
LEAKED_LOCK = """
import os, signal, subprocess, sys, threading
sys.path.insert(0, sys.argv[1])
from fablize_gate import runs

class SignalJustAfterTaking:
    def __init__(self):
        self.lock, self.sent = threading.Lock(), False
    def acquire(self, *args, **kwargs):
        taken = self.lock.acquire(*args, **kwargs)
        if taken and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10000):  # the handler runs here, the lock taken
                pass
        return taken
    def release(self):
        self.lock.release()
    __enter__ = acquire
    def __exit__(self, *exc):
        self.release()

proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
proc._waitpid_lock = SignalJustAfterTaking()
with runs.StopSignals() as stop:
    try:
        stop.wait(proc, 50)
        print("not interrupted")
    except runs.RunInterrupted:
        runs.kill_group(proc)
        print("interrupted", stop.got, proc.wait())
"""


def test_a_stop_signal_inside_popen_wait_never_leaves_the_engine_blocked(tmp_path):
    script = tmp_path / "leak.py"
    script.write_text(LEAKED_LOCK)
    p = subprocess.run([sys.executable, str(script), str(ROOT / "scripts")], capture_output=True,
                       text=True, timeout=HANG_GUARD)
    assert p.returncode == 0, p
    assert p.stdout.startswith("interrupted SIGTERM -9"), p


# A run's in-flight note: durable before the check may run, and never a reason to signal a
# process group that is not provably the run's (issue 41) ######################################

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"),
                                reason="start times and sessions are read from /proc")


def shells_running(marker):
    """Pids of the processes whose command line holds `marker`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


@needs_proc
def test_a_check_never_runs_before_its_note_is_durable(active):
    """The engine killed (kill -9) after it started the check's shell and before its note was
    written: the shell, gated, never runs the check — its pipe ends with the engine — so no
    check runs on unseen; the next writer removes the temp log the run left."""
    marker = os.urandom(6).hex()
    cmd = f"touch ran.flag; sleep 30  # {marker}"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "checkpoint", "--id", "G001",
                             "--status", "complete", "--evidence", "x", "--run", "--verify-cmd",
                             cmd], cwd=str(active), env=dict(env(),
                                                             FABLIZE_CRASH_AT="before-inflight-note"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    deadline = time.monotonic() + HANG_GUARD
    while shells_running(marker):  # the gated shell ends once its pipe does
        assert time.monotonic() < deadline, "the run's shell outlived its engine"
        time.sleep(0.02)
    assert not (active / "ran.flag").exists(), "the check ran before its note was written"
    assert len(temp_logs(active)) == 1  # what the kill left
    assert "in flight" not in run_goals(active, "status")[1]  # nothing ran: nothing to say
    assert run_goals(active, "next")[0] == 0  # a writer: it takes the lock and sweeps
    assert temp_logs(active) == []


def dead_pid():
    """A pid no process has now (a process that ran and was reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def start_ticks(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[19])


def write_note(root, pgid, **fields):
    folder = root / ".fablize" / "runs" / ".inflight"
    folder.mkdir(parents=True, exist_ok=True)
    note = {"engine": dead_pid(), "pgid": pgid, "id": "G001", "check": None, "cmd": "sleep 60",
            "started": "2026-01-01T03:00:00+00:00", "log": ".run-1-x-00000000.log", **fields}
    (folder / f"{pgid}.json").write_text(json.dumps(note))


@pytest.fixture
def stranger():
    """Another agent's check: a process leading its own session and group, running."""
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield p
    if p.poll() is None:
        p.kill()
    p.wait()


@needs_proc
@pytest.mark.parametrize("how", ["reused", "older note", "run's own"])
def test_a_group_is_ended_only_when_it_is_provably_the_runs(active, stranger, how):
    """A note whose engine died names a group that is running. Only a leader with the start
    time and session the note recorded is the run's, and its group ended; a group whose number
    now belongs to another process (pid reuse: another agent's check) or one a note of an
    older fablize names, which cannot be told apart, is left alone — said, with `kill` by hand."""
    start = start_ticks(stranger.pid)
    fields = {"reused": {"leader_start": start - 1, "sid": stranger.pid},
              "older note": {}, "run's own": {"leader_start": start, "sid": stranger.pid,
                                              "engine_start": 1}}[how]
    write_note(active, stranger.pid, **fields)
    code, _, err = run_goals(active, "next")
    assert code == 0, err
    assert "was in flight when its engine" in err and "It recorded nothing" in err, err
    if how == "run's own":
        assert f"(1 process, group {stranger.pid}) was ended" in err, err
        assert stranger.wait(timeout=HANG_GUARD) == -signal.SIGKILL
    else:
        assert stranger.poll() is None, "another's process was killed"
        said = ("is no longer the run's (its number now belongs to another process): it was "
                "left alone" if how == "reused" else
                f"cannot be proven to be the run's: nothing was signalled — `kill -9 "
                f"-{stranger.pid}` ends it if it is")
        assert said in err, err
    assert list((active / ".fablize" / "runs").glob(".inflight/*")) == []


# the engine, started by a parent that waits for a line first (the note is written by then),
# in a new session of its own or in the parent's group; prints the engine's exit code
PARENT = """
import subprocess, sys
sys.stdin.readline()
code = subprocess.run(sys.argv[2:], start_new_session=sys.argv[1] == "apart",
                      stdout=subprocess.DEVNULL).returncode
print(code, flush=True)
"""


@needs_proc
@pytest.mark.parametrize("group, session", [(0, "apart"), ("own", "together"),
                                            ("caller's", "apart")])
def test_group_0_and_the_engines_own_and_callers_groups_are_never_signalled(active, group,
                                                                           session):
    """A note naming group 0 (killpg(0) is the caller's own group), the engine's own group, or
    the group of the command that started it: nothing is signalled, whatever the note says.
    (Group 1 — killpg(1) signals every process the user may — is checked without a real
    signal: test_group_1_is_never_signalled.)"""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, session, sys.executable,
                               str(SCRIPT), "next"], cwd=str(active), env=env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, start_new_session=True)
    try:
        write_note(active, 0 if group == 0 else parent.pid, leader_start=1, sid=parent.pid)
        out, err = parent.communicate(b"go\n", timeout=HANG_GUARD)
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
    assert parent.returncode == 0 and out.strip() == b"0", (parent.returncode, out, err)
    assert b"which is no run's" in err and b"nothing was signalled" in err, err


def test_group_1_is_never_signalled(monkeypatch):
    """killpg(1) is kill(-1): every process the user may signal. No note gets it sent."""
    sent = []
    monkeypatch.setattr(os, "killpg", lambda *args: sent.append(args))
    for pgid in (1, 0, -5, os.getpgrp()):
        fate = engine.end_run_group({"pgid": pgid, "engine": dead_pid(), "leader_start": 1,
                                     "sid": pgid, "boot": None})
        assert "which is no run's" in fate and "nothing was signalled" in fate, fate
    assert sent == []


@needs_proc
def test_status_says_every_run_that_never_finished(active, stranger):
    """Each run noted in flight is said by `status`: running, or never finished — also when its
    engine's pid now belongs to another process (here: this test's own, started at another
    time), which is not its engine."""
    write_note(active, 4000001, cmd="first check")
    write_note(active, 4000002, cmd="second check")
    write_note(active, stranger.pid, cmd="third check", engine=os.getpid(),
               engine_start=start_ticks(os.getpid()) + 1)
    _, text, _ = run_goals(active, "status")
    for cmd in ("first check", "second check", "third check"):
        assert f"a run of `{cmd}` for G001 was in flight and never finished" in text, text
    assert "▷" not in text, text  # none is said to be running
    code, out, _ = run_goals(active, "--json", "status")
    runs = json.loads(out)["in_flight"]
    assert sorted(r["cmd"] for r in runs) == ["first check", "second check", "third check"]
    assert not any(r["running"] for r in runs), runs


def test_what_a_killed_engine_left_in_runs_is_removed_by_the_next_writer(active):
    """Temp logs of engines that died (by the pid and start time in their names), torn or
    foreign files in the notes' folder: removed by the next command that takes the lock; a temp
    log of a live engine stays."""
    runs = active / ".fablize" / "runs"
    (runs / ".inflight").mkdir(parents=True)
    gone = dead_pid()
    litter = [f".run-{gone}-12345-0badc0de.log", f".run-{gone}-x-0badc0de.log",
              f".run-{gone}-0badc0de.log"]
    for name in litter:
        (runs / ".inflight" / name).write_text("half a run\n")
    live = runs / ".inflight" / engine.temp_log_name()
    live.write_text("a run under way\n")
    (runs / ".inflight" / f"77.json.tmp-{gone}-0badc0de").write_text("{\"eng")
    (runs / ".inflight" / "78.json").write_text("not a note")
    code, _, err = run_goals(active, "next")
    assert code == 0, err
    assert temp_logs(active) == [live.name]
    assert sorted(p.name for p in (runs / ".inflight").iterdir()) == [live.name]
    live.unlink()
    assert run_goals(active, "next")[0] == 0  # a writer: G001 shown again
    assert not (runs / ".inflight").exists()  # empty: gone too
    assert "removed runs/.inflight/78.json, which was no note of a run in flight." in err, err


def test_a_run_whose_note_cannot_be_written_never_starts(fab, monkeypatch):
    """A full disk where the note goes: the check is not let go (a kill -9 of the engine would
    leave it unseen), and the run is recorded as one that did not start, saying why."""
    import errno
    from conftest import make_plan, start
    make_plan(fab, 2)
    start(fab, "G001")
    real = engine.runs.write_atomic

    def full(path, data, *args, **kwargs):
        if "/.inflight/" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data, *args, **kwargs)
    monkeypatch.setattr(engine.runs, "write_atomic", full)
    r = fab("--json", "checkpoint", "--id", "G001", "--status", "complete", "--evidence", "x",
            "--run", "--verify-cmd", "touch ran.flag")
    assert r.code == 1 and r.json["error"]["code"] == "verification_failed", r
    assert not (fab.root / "ran.flag").exists()
    run = ledger(fab.dir)[-1]
    assert run["event"] == "verify_run" and run["exit_code"] is None, run
    assert run["error"] == ("it could not be noted in flight (No space left on device), so it "
                            "was not started"), run
