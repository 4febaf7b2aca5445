"""The hooks always answer (issue 41, item 5): `guard`, `observe` and the session start
(`status --resume`) exit 0 with what their harness reads — one JSON object, or the text a
session start injects — on every I/O error of the state directory, saying in one line what they
could not do; they exited 3 with nothing on stdout. Real faults, in real processes: a directory
where `lock` (or the ledger, or the snapshot) should be, a read-only `.fablize/` (a read-only
bind mount in a user namespace when this runs as root, whom file modes do not stop; the modes
otherwise), a full disk (a 1 MiB tmpfs, filled)."""

import json
import os
import shutil
import subprocess

import pytest

from conftest import ENGINE, make_plan, state_files

NAMESPACE = shutil.which("unshare") is not None and subprocess.run(
    ["unshare", "-rm", "true"], capture_output=True).returncode == 0
# the wrappers that give the state directory ($1) the fault inside a mount namespace of its own
MOUNTS = {
    "read_only": 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1"',
    "full_disk": 'cp -a "$1" "$1.copy" && mount -t tmpfs -o size=1m tmpfs "$1" && '
                 'cp -a "$1.copy/." "$1/" && (dd if=/dev/zero of="$1/fill" bs=64k 2>/dev/null; '
                 'true)',
}


def with_fault(fault, state_dir):
    """The argv prefix that runs a command with `fault` on `state_dir`; None when this machine
    cannot make it (then the test is skipped, saying so)."""
    if fault in MOUNTS:
        if not NAMESPACE:
            return None
        return ["unshare", "-rm", "sh", "-c", MOUNTS[fault] + ' && shift && exec "$@"', "sh",
                str(state_dir)]
    return []


def make_fault(fault, state_dir):
    """Faults made on disk, before the hook runs."""
    if fault in ("lock_dir", "ledger_dir", "snapshot_dir"):
        name = {"lock_dir": "lock", "ledger_dir": "ledger.jsonl",
                "snapshot_dir": "goals.json"}[fault]
        path = state_dir / name
        if path.exists():
            path.unlink()
        path.mkdir()
    elif fault == "read_only" and os.geteuid() != 0:
        for p in [state_dir, *state_dir.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)


def undo_fault(state_dir):
    for p in [state_dir, *state_dir.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


PAYLOADS = {
    "guard": lambda root: {"session_id": "s", "cwd": str(root), "hook_event_name": "Stop",
                           "stop_hook_active": False},
    "observe": lambda root: {"session_id": "s", "cwd": str(root),
                             "hook_event_name": "PostToolUse", "tool_name": "Bash",
                             "tool_input": {"command": "python3 -m pytest -q tests"},
                             "tool_response": {"stdout": "1 failed in 0.10s", "stderr": "",
                                               "interrupted": False}},
    "status": lambda root: {"session_id": "s", "cwd": str(root),
                            "hook_event_name": "SessionStart", "source": "startup"},
}


def run_hook(fab, fault, hook, agent):
    args = {"guard": ["guard"], "observe": ["observe"], "status": ["status", "--resume"]}[hook]
    payload = PAYLOADS[hook](fab.root)
    if agent == "cursor":
        payload = {"status": "completed", "loop_count": 0, "cwd": str(fab.root)}
    prefix = with_fault(fault, fab.dir)
    if prefix is None:
        pytest.skip(f"no user namespace here to make a {fault.replace('_', ' ')} state directory")
    make_fault(fault, fab.dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")}
    try:
        p = subprocess.run([*prefix, *ENGINE, *args, "--for", agent], cwd=str(fab.root),
                           input=json.dumps(payload).encode(), capture_output=True, env=env,
                           timeout=120)
    finally:
        if fault == "read_only" and os.geteuid() != 0:
            undo_fault(fab.dir)
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def in_progress(fab):
    make_plan(fab, 3)
    assert fab("next").code == 0  # work left: the guard would block, observe would record


WRITE_FAULTS = ["lock_dir", "read_only", "full_disk"]
READ_FAULTS = ["ledger_dir", "snapshot_dir"]


@pytest.mark.parametrize("fault", WRITE_FAULTS + READ_FAULTS)
@pytest.mark.parametrize("agent", ["claude", "codex", "gemini", "cursor"])
def test_the_guard_answers_its_harness_on_every_io_error_and_lets_the_agent_stop(fab, fault,
                                                                                   agent):
    in_progress(fab)
    before = state_files(fab.dir)
    code, out, err = run_hook(fab, fault, "guard", agent)
    assert code == 0 and "Traceback" not in err, (code, out, err)
    if fault == "full_disk" and agent != "cursor" and "decision" in json.loads(out):
        return  # the block's line fit in the ledger's last page: recorded, a block is right
    if agent == "cursor":  # Cursor reads no message from a stop hook: nothing is an answer
        assert out == "" or "followup_message" in json.loads(out), out
    else:
        answer = json.loads(out)
        assert list(answer) == ["systemMessage"], answer  # never a block it cannot record
        line = answer["systemMessage"]
        assert line.startswith("fablize guard: ") and "\n" not in line, line
        assert ("could not be checked" in line and "I/O error" in line) or (
            "not a regular file" in line), line
    if fault not in ("lock_dir", "ledger_dir", "snapshot_dir"):
        assert state_files(fab.dir) == before


@pytest.mark.parametrize("fault", WRITE_FAULTS + READ_FAULTS)
@pytest.mark.parametrize("agent", ["claude", "codex", "gemini"])
def test_observe_answers_its_harness_on_every_io_error_saying_what_was_not_recorded(fab, fault,
                                                                                     agent):
    in_progress(fab)
    before = state_files(fab.dir)
    code, out, err = run_hook(fab, fault, "observe", agent)
    assert code == 0 and "Traceback" not in err, (code, out, err)
    if fault == "full_disk" and out in ("", "{}\n"):
        return  # the line fit in the ledger's last page: recorded, nothing to say
    answer = json.loads(out)
    line = answer["systemMessage"]
    assert line.startswith("fablize observe: `python3 -m pytest -q tests` was not recorded — ")
    assert "\n" not in line and err == "", (line, err)
    if fault not in ("lock_dir", "ledger_dir", "snapshot_dir"):
        assert state_files(fab.dir) == before


@pytest.mark.parametrize("fault", READ_FAULTS)
@pytest.mark.parametrize("agent", ["claude", "codex", "gemini"])
def test_the_session_start_answers_with_one_warning_line_when_the_plan_cannot_be_read(
        fab, fault, agent):
    in_progress(fab)
    code, out, err = run_hook(fab, fault, "status", agent)
    assert code == 0 and "Traceback" not in err, (code, out, err)
    text = out if agent == "claude" else json.loads(out)["hookSpecificOutput"][
        "additionalContext"]
    assert text.startswith("fablize: warning: the plan in ") and " cannot be read — " in text
    assert text.strip().count("\n") == 0, text


@pytest.mark.parametrize("fault", WRITE_FAULTS)
def test_the_session_start_still_hands_over_the_plan_when_only_writing_fails(fab, fault):
    """A session start only reads: a state directory it cannot write still shows the plan."""
    in_progress(fab)
    code, out, err = run_hook(fab, fault, "status", "claude")
    assert code == 0 and out.startswith("fablize: 0/3 complete — test plan"), (code, out, err)
    assert "=== fablize handoff — G001 S1" in out
