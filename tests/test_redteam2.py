"""A second red-team pass: holes found in the CI gates, the judge's tree state, the hooks and
setup/doctor, each kept as a test of what must happen instead (each failed before its fix)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ENGINE as CACHED
from conftest import copy_engine
from test_redteam import (ALL_GATES, ENGINE, check_py_branch, ci, git,  # noqa: F401
                          judged_story, run, status_after_verdict)  # (ci: a fixture)


def _signal_free(cmd, cwd, stdin=b"", timeout=15):
    try:
        return subprocess.run([*CACHED, *cmd], cwd=cwd, input=stdin,
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_a_story_added_after_the_pin_cannot_make_the_final_check_pass_in_the_rerun(ci):
    """The re-run runs every story's checks in order, in the one working tree CI checked out.
    `add` puts a story (with the agent's own frozen check) before the final one, so its check
    runs first in the re-run and can write what the final check tests: DONE2 is never
    committed, `test -f DONE2` fails on the tree, and CI passes — even the required check."""
    repo, audit = ci
    assert run(repo, "add", "--goal", "helper::prepare", "--check", "touch DONE2").returncode == 0
    (repo / "DONE").write_text("done\n")  # G001 is really done
    for sid in ("G001", "G003", "G002"):
        if sid != "G001":
            assert run(repo, "next").returncode == 0
        git(repo, audit.home, "add", "-A")  # each run on a clean tree: --require-clean-runs
        git(repo, audit.home, "commit", "-qm", sid)
        assert run(repo, "checkpoint", "--id", sid, "--status", "complete",
                   "--evidence", "done").returncode == 0, sid
    (repo / "DONE2").unlink()  # the final story's check fails on what is committed
    r = audit("--require-check", "test -f DONE2", *ALL_GATES)
    assert not (repo / "DONE2").exists() or r.returncode != 0, r.stdout  # failed before its fix


def test_a_frozen_check_file_swapped_for_a_symlink_out_of_the_tree_is_named(tmp_path):
    """`check.py -> /dev/null` resolves outside the tree: compared by its real path it was never
    named, and `python3 /dev/null` exits 0 — the check that fails on the tree passed the CI
    re-run even under --require-unchanged-checks. The path as written is what counts."""
    repo, home = check_py_branch(tmp_path, "python3")
    (repo / "check.py").unlink()
    os.symlink("/dev/null", repo / "check.py")  # impl.txt still says todo
    assert run(repo, "checkpoint", "--id", "G001", "--status", "complete",
               "--evidence", "done").returncode == 0
    git(repo, home, "add", "-A")
    git(repo, home, "commit", "-qm", "pr")
    engine = copy_engine(tmp_path / "x")
    r = run(repo, "audit", "--base", "main", "--require-complete", "--require-witnessed",
            "--rerun", "all", "--require-unchanged-checks", "--json", engine=engine,
            env={"PATH": "/usr/bin:/bin"}, isolated=True)
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "check_files_changed", \
        r.stdout  # failed before its fix


def test_a_self_ignoring_gitignore_the_judge_adds_changes_the_tree(tmp_path):
    """tree_state honours every .gitignore, including a new one that ignores itself."""
    judged_story(tmp_path)
    (tmp_path / ".gitignore").write_text("conftest.py\n.gitignore\n")
    (tmp_path / "conftest.py").write_text("# makes the judge's own test run pass\n")
    assert status_after_verdict(tmp_path) != "complete"  # failed before its fix


def test_a_symlink_into_the_state_directory_the_judge_adds_changes_the_tree(tmp_path):
    """tree_state skips any path whose realpath is in .fablize/: conftest.py -> .fablize/x.py
    is left out of the digest."""
    judged_story(tmp_path)
    (tmp_path / ".fablize" / "x.py").write_text("# makes the judge's own test run pass\n")
    os.symlink(".fablize/x.py", tmp_path / "conftest.py")
    assert status_after_verdict(tmp_path) != "complete"  # failed before its fix


@pytest.mark.parametrize("cmd", [["guard"], ["observe"], ["guard", "--json"]])
def test_a_hook_payload_cwd_with_a_nul_is_no_traceback(tmp_path, cmd):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    payload = json.dumps({"cwd": str(tmp_path) + "\x00x", "tool_name": "Bash",
                          "tool_input": {"command": "pytest -q"}}).encode()
    r = _signal_free(cmd, tmp_path, payload)
    assert r is not None and b"Traceback" not in r.stderr, r  # failed before its fix


@pytest.mark.parametrize("cmd,rel", [(["setup", "claude"], ".claude/settings.json"),
                                     (["setup", "claude"], ".claude/settings.local.json"),
                                     (["doctor", "claude"], ".claude/settings.json"),
                                     (["doctor", "claude"], "CLAUDE.md")])
def test_setup_and_doctor_do_not_hang_on_a_fifo(tmp_path, cmd, rel):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".claude").mkdir()
    os.mkfifo(tmp_path / rel)
    r = _signal_free(cmd + ["--json"], tmp_path)
    assert r is not None, "hangs"  # failed before its fix
    json.loads(r.stdout)


@pytest.mark.parametrize("cmd,rel", [(["setup", "claude"], ".claude/settings.local.json"),
                                     (["doctor", "claude"], "CLAUDE.md")])
def test_setup_and_doctor_do_not_read_an_endless_file(tmp_path, cmd, rel):
    """A symlink to /dev/zero is read whole (open().read()): MemoryError, or all memory."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".claude").mkdir()
    os.symlink("/dev/zero", tmp_path / rel)
    try:
        r = subprocess.run(["bash", "-c", 'ulimit -v 1500000; exec "$@"', "x", sys.executable,
                            str(ENGINE), *cmd, "--json"], cwd=tmp_path, capture_output=True,
                           timeout=30)
    except subprocess.TimeoutExpired:
        r = None
    assert r is not None and b"Traceback" not in r.stderr, r  # failed before its fix
    json.loads(r.stdout)


@pytest.mark.parametrize("ours,theirs", [
    ({"plan_id": "a", "ledger": {"seq": "5"}, "created": "x"},
     {"plan_id": "a", "ledger": {"seq": 3}, "created": "x"}),
    ({"plan_id": "a", "ledger": {"seq": 1}, "created": 1},
     {"plan_id": "b", "ledger": {"seq": 3}, "created": "x"})])
def test_merge_driver_with_wrongly_typed_snapshot_keys_is_one_line(tmp_path, ours, theirs):
    """merge_snapshots compares seq / created of either side without checking their types."""
    (tmp_path / "o.json").write_text(json.dumps(ours))
    (tmp_path / "t.json").write_text(json.dumps(theirs))
    r = run(tmp_path, "merge-driver", os.devnull, "o.json", "t.json", ".fablize/goals.json",
            "--json")
    assert "Traceback" not in r.stderr, r.stderr  # failed before its fix
    json.loads(r.stdout)


def test_a_non_utf8_plan_ref_on_the_remote_is_one_line(tmp_path):
    """Anyone who can push makes refs/fablize/plans/p\\xff: ls-remote's output is decoded
    strictly, and every `sync` and `audit --remote` of every agent gives a traceback."""
    from test_redteam import git_env
    env = git_env(tmp_path)
    bare, work, clone = tmp_path / "r.git", tmp_path / "w", tmp_path / "c"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True, env=env)
    subprocess.run(["git", "init", "-q", str(work)], check=True, env=env)
    for args in (["commit", "-q", "--allow-empty", "-m", "x"],
                 ["push", "-q", str(bare), "HEAD:refs/heads/main"],
                 ["push", "-q", str(bare), b"HEAD:refs/fablize/plans/p\xff"]):
        subprocess.run([b"git", *[a if isinstance(a, bytes) else a.encode() for a in args]],
                       cwd=work, check=True, env=env)
    subprocess.run(["git", "clone", "-q", str(bare), str(clone)], check=True, env=env,
                   capture_output=True)
    for cmd in (["audit", "--remote", "origin", "--json"], ["sync", "--json"]):
        r = run(clone, *cmd, env=env)
        assert "Traceback" not in r.stderr, (cmd, r.stderr)  # failed before its fix
        json.loads(r.stdout)


def test_a_non_finite_run_duration_is_damage_not_invalid_json(tmp_path):
    """duration_s 1e999 passes `ev["duration_s"] < 0`: replay accepts it, and status/log --json
    then print `Infinity`, which is not JSON (RFC 8259; jq, JSON.parse and Go refuse it)."""
    import hashlib
    import re
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    assert run(tmp_path, "create", "--brief", "b", "--goal", "x::y",
               "--check", "G001=false").returncode == 0
    assert run(tmp_path, "next").returncode == 0
    run(tmp_path, "checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ok")
    led = tmp_path / ".fablize" / "ledger.jsonl"
    out, prev = [], b"0" * 64
    for line in led.read_bytes().splitlines():
        line = re.sub(rb'"prev":"[0-9a-f]{64}"', b'"prev":"' + prev + b'"', line)
        line = re.sub(rb'"duration_s":[0-9.e-]+', b'"duration_s":1e999', line)
        out.append(line)
        prev = hashlib.sha256(line).hexdigest().encode()
    led.write_bytes(b"\n".join(out) + b"\n")
    (tmp_path / ".fablize" / "goals.json").unlink()
    r = run(tmp_path, "rebuild")
    assert r.returncode == 3, r  # failed before its fix

    def strict(text):
        return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    for cmd in (["status", "--json"], ["log", "--json"]):
        strict(run(tmp_path, *cmd).stdout)


@pytest.mark.parametrize("agent,folder", [("claude", ".claude"), ("gemini", ".gemini")])
def test_setup_does_not_write_through_a_symlinked_settings_folder(tmp_path, agent, folder):
    """project_file refuses a symlinked settings.json, not a symlinked .claude/: a hostile
    repository's `.claude -> ~/.claude` makes `setup` register hooks in the user's global
    settings (every other project then runs them)."""
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    repo.mkdir()
    outside.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    os.symlink(outside, repo / folder)
    r = run(repo, "setup", agent, "--json")
    assert not (outside / "settings.json").exists(), r.stdout  # failed before its fix
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "symlink"
