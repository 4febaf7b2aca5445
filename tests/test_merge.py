"""Branches that merge: committed plans and `git merge`, through the driver `install-merge`
sets up (one .gitattributes line, one git config entry). Real git repositories."""

import json
import os

import pytest

from conftest import git, git_env, engine, run_cli


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "r"
    git(tmp_path, "init", "-q", "-b", "main", str(root))
    return root


def fab(root, *args):
    return run_cli(*args, cwd=root, env=git_env(root.parent))


def complete_plan(root, brief, runs=True):
    r = fab(root, "create", "--force", "--brief", brief, "--goal", "x::y", "--goal", "z::w")
    assert r.code == 0, r
    assert fab(root, "next").code == 0
    assert fab(root, "checkpoint", "--id", "G001", "--status", "complete",
               "--evidence", f"{brief} G001").code == 0
    assert fab(root, "next").code == 0
    extra = ["--run", "--verify-cmd", f"echo {brief}"] if runs else \
        ["--verify-cmd", "t", "--verify-evidence", "ok"]
    assert fab(root, "checkpoint", "--id", "G002", "--status", "complete",
               "--evidence", "e", *extra).code == 0
    return json.loads(fab(root, "audit", "--json").out)["head"]


def based(repo):
    assert fab(repo, "install-merge").code == 0
    assert fab(repo, "create", "--brief", "base", "--goal", "a::b").code == 0
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base plan")


def test_two_branches_completing_different_plans_merge_and_both_audit_with_their_pins(repo):
    based(repo)
    git(repo, "checkout", "-qb", "a")
    pin_a = complete_plan(repo, "plan-a")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "a")
    git(repo, "checkout", "-q", "main")
    git(repo, "checkout", "-qb", "b")
    pin_b = complete_plan(repo, "plan-b")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "b")
    assert "CONFLICT" not in git(repo, "merge", "a", "-m", "merge a")
    assert git(repo, "status", "--porcelain") == ""
    first = (repo / ".fablize" / "ledger.jsonl").read_text().splitlines()[0]
    assert json.loads(first)["event"] == "plan_created"  # the merged ledger still starts a plan
    for pin in (pin_a, pin_b, None):
        r = fab(repo, "audit", "--require-complete", "--require-logs",
                *(["--since", pin] if pin else []))
        # a pin of the plan the merge carried in holds, but the current plan is new to it: the
        # reviewer must accept it knowingly (its frozen checks are printed)
        carried_pin = pin is not None and not any(
            engine.sha256_hex(x.encode()) == pin.split(":")[1]
            for x in (repo / ".fablize" / "ledger.jsonl").read_text().splitlines()[:6])
        if carried_pin:
            assert r.code == 1 and "--allow-new-plan" in r.err, (pin, r)
            r = fab(repo, "audit", "--require-complete", "--require-logs", "--since", pin,
                    "--allow-new-plan")
        assert r.code == 0, (pin, r)
    events = [json.loads(x) for x in (repo / ".fablize" / "ledger.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "plan_merged"
    assert {events[0]["brief"], json.loads(events[-1]["lines"][0])["brief"]} == {"plan-a", "plan-b"}
    # both plans ran G002's check at event 5: the one log name keeps the current plan's output
    assert (repo / ".fablize" / "runs" / "5-G002.log").read_text() == events[0]["brief"] + "\n"
    # the carried plan is replayed: an edit inside it is caught
    path = repo / ".fablize" / "ledger.jsonl"
    carried = json.loads(events[-1]["lines"][0])["brief"]
    text = path.read_text()
    assert text.count(f"{carried} G001") == 1  # only inside the plan_merged event
    path.write_text(text.replace(f"{carried} G001", f"{carried} G00I"))
    r = fab(repo, "audit")
    assert r.code == 3 and "merged plan" in r.err, r


def test_the_same_plan_advanced_on_one_side_merges_to_the_further_one(repo):
    based(repo)
    assert fab(repo, "next").code == 0
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "started")
    git(repo, "checkout", "-qb", "a")
    assert fab(repo, "checkpoint", "--id", "G001", "--status", "complete", "--verify-cmd", "t",
               "--verify-evidence", "ok", "--evidence", "done on a").code == 0
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "a")
    git(repo, "checkout", "-q", "main")
    (repo / "other.txt").write_text("x")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "unrelated")
    git(repo, "merge", "a", "-m", "m")
    r = fab(repo, "audit", "--require-complete")
    assert r.code == 0, r


def test_the_same_plan_advanced_differently_on_both_sides_stays_a_conflict(repo):
    based(repo)
    assert fab(repo, "next").code == 0
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "started")
    git(repo, "checkout", "-qb", "a")
    assert fab(repo, "checkpoint", "--id", "G001", "--status", "failed",
               "--evidence", "on a").code == 0
    git(repo, "commit", "-qam", "a")
    git(repo, "checkout", "-q", "main")
    assert fab(repo, "checkpoint", "--id", "G001", "--status", "blocked",
               "--evidence", "on main").code == 0
    git(repo, "commit", "-qam", "main")
    r = git(repo, "merge", "a", "-m", "m", check=False)
    assert r.returncode != 0 and "CONFLICT" in r.stdout
    assert "advanced the same plan differently" in r.stderr + r.stdout


def test_install_merge_writes_its_one_line_once(repo):
    assert fab(repo, "install-merge").code == 0
    assert fab(repo, "install-merge").code == 0
    assert (repo / ".gitattributes").read_text() == "/.fablize/** merge=fablize\n"
    assert "merge-driver %O %A %B %P" in git(repo, "config", "merge.fablize.driver")


# The driver given what no engine wrote: one line or one JSON object, never a traceback #####


def test_merge_driver_with_a_torn_non_utf8_line_is_one_line(tmp_path):
    """Theirs: a base's ledger (a started plan) with a torn, non-UTF-8 last line; ours: another,
    completed plan. Failed before its fix."""
    base = tmp_path / "base"
    git(tmp_path, "init", "-q", str(base))
    assert fab(base, "create", "--brief", "make DONE", "--goal", "one::make DONE", "--goal",
               "two::make DONE2", "--check", "G001=test -f DONE",
               "--check", "G002=test -f DONE2").code == 0
    assert fab(base, "next").code == 0
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_bytes((base / ".fablize" / "ledger.jsonl").read_bytes() + b"\xff\xfe{")
    other = tmp_path / "other"
    git(tmp_path, "init", "-q", str(other))
    assert fab(other, "create", "--brief", "swap", "--goal", "x::trivial",
               "--check", "G001=true").code == 0
    assert fab(other, "next").code == 0
    assert fab(other, "checkpoint", "--id", "G001", "--status", "complete",
               "--evidence", "ok").code == 0
    ours = tmp_path / "ours.jsonl"
    ours.write_bytes((other / ".fablize" / "ledger.jsonl").read_bytes())
    r = fab(base, "merge-driver", os.devnull, str(ours), str(theirs), ".fablize/ledger.jsonl",
            "--json")
    assert "Traceback" not in r.err, r
    json.loads(r.out)


@pytest.mark.parametrize("ours,theirs", [
    ({"plan_id": "a", "ledger": {"seq": "5"}, "created": "x"},
     {"plan_id": "a", "ledger": {"seq": 3}, "created": "x"}),
    ({"plan_id": "a", "ledger": {"seq": 1}, "created": 1},
     {"plan_id": "b", "ledger": {"seq": 3}, "created": "x"})])
def test_merge_driver_with_wrongly_typed_snapshot_keys_is_one_line(tmp_path, ours, theirs):
    """merge_snapshots compares seq / created of either side without checking their types.
    Failed before its fix."""
    (tmp_path / "o.json").write_text(json.dumps(ours))
    (tmp_path / "t.json").write_text(json.dumps(theirs))
    r = run_cli("merge-driver", os.devnull, "o.json", "t.json", ".fablize/goals.json", "--json",
                cwd=tmp_path)
    assert "Traceback" not in r.err, r.err
    json.loads(r.out)


# A fresh clone: the committed .gitattributes without this clone's git config #####################


def diverged_origin(repo, tmp_path):
    """A bare origin whose main holds a committed plan (through install-merge) and two branches
    that each replaced it with a plan of their own."""
    based(repo)
    for branch in ("a", "b"):
        git(repo, "checkout", "-q", "main")
        git(repo, "checkout", "-qb", branch)
        complete_plan(repo, f"plan-{branch}")
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", branch)
    origin = tmp_path / "origin.git"
    git(tmp_path, "clone", "-q", "--bare", str(repo), str(origin))
    return origin


def test_a_fresh_clone_is_told_at_its_first_command_and_setup_makes_merges_clean(repo, tmp_path):
    origin = diverged_origin(repo, tmp_path)
    fresh = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", str(origin), str(fresh))
    (fresh / "scripts").mkdir()
    from conftest import copy_engine
    copy_engine(fresh / "scripts")
    r = fab(fresh, "status")
    assert r.code == 0 and "which this clone's git config does not have" in r.err, r
    assert "install-merge` (once in each clone" in r.err and r.err.count("\n") == 1
    # without the driver, git leaves markers in the plan: what the warning is about
    git(fresh, "checkout", "-q", "b")
    git(fresh, "checkout", "-q", "a")
    bad = git(fresh, "merge", "b", "-m", "m", check=False)
    assert bad.returncode != 0 and "<<<<<<<" in (fresh / ".fablize" / "ledger.jsonl").read_text()
    git(fresh, "merge", "--abort")
    # setup wires this clone's driver: the same merge is clean, both plans audit
    r = fab(fresh, "setup", "claude")
    assert r.code == 0, r
    assert "which this clone's git config does not have" not in fab(fresh, "status").err
    doctor = fab(fresh, "doctor", "claude")
    assert "✓ merge driver:" in doctor.out, doctor
    git(fresh, "add", "-A")
    git(fresh, "commit", "-qm", "setup")
    assert "CONFLICT" not in git(fresh, "merge", "b", "-m", "merge b")
    assert "<<<<<<<" not in (fresh / ".fablize" / "ledger.jsonl").read_text()
    assert fab(fresh, "audit").code == 0


def test_the_commands_that_wire_the_driver_and_audit_do_not_warn_of_it(repo, tmp_path):
    origin = diverged_origin(repo, tmp_path)
    fresh = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", str(origin), str(fresh))
    warning = "which this clone's git config does not have"
    r = fab(fresh, "audit")  # CI's copy of the engine is no clone to wire
    assert r.code == 0 and warning not in r.err, r
    r = fab(fresh, "install-merge")  # the fix, said without the warning it fixes
    assert r.code == 0 and warning not in r.err + r.out, r
    assert warning not in fab(fresh, "status").err


def test_a_shared_plan_in_a_clone_without_the_driver_is_not_warned_of_it(repo, tmp_path):
    origin = diverged_origin(repo, tmp_path)
    fresh = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", str(origin), str(fresh))
    git(fresh, "checkout", "-q", "a")
    assert "which this clone's git config" in fab(fresh, "status").err
    assert fab(fresh, "share", "--remote", "origin").code == 0  # its history now lives in refs
    r = fab(fresh, "status")
    assert r.code == 0 and "which this clone's git config" not in r.err, r


def test_a_worktree_reads_its_repositorys_config_for_the_driver(repo, tmp_path):
    """A worktree's .git is a file; the driver is in the config of the repository its git dir
    names (commondir): wired there, the worktree is not warned; unwired, it is."""
    origin = diverged_origin(repo, tmp_path)
    fresh = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", str(origin), str(fresh))
    git(fresh, "worktree", "add", "-q", str(tmp_path / "wt"), "a")
    warning = "which this clone's git config does not have"
    assert warning in fab(tmp_path / "wt", "status").err
    assert fab(fresh, "install-merge").code == 0
    r = fab(tmp_path / "wt", "status")
    assert r.code == 0 and warning not in r.err, r


def test_doctor_fails_a_clone_without_the_driver_its_gitattributes_names(repo, tmp_path):
    origin = diverged_origin(repo, tmp_path)
    fresh = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", str(origin), str(fresh))
    r = fab(fresh, "doctor", "claude")
    assert r.code == 1 and "✗ merge driver: this clone's git config lacks" in r.out, r
    assert "install-merge` (or `" in r.out


def test_one_plan_advanced_differently_leaves_the_ledger_and_the_snapshot_in_conflict(repo):
    assert fab(repo, "install-merge").code == 0
    assert fab(repo, "create", "--brief", "one", "--goal", "a::b", "--goal", "c::d").code == 0
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "plan")
    for branch in ("a", "b"):
        git(repo, "checkout", "-q", "main")
        git(repo, "checkout", "-qb", branch)
        assert fab(repo, "next").code == 0
        assert fab(repo, "checkpoint", "--id", "G001", "--status", "complete",
                   "--evidence", f"done on {branch}").code == 0
        if branch == "b":
            assert fab(repo, "next").code == 0  # further on: the snapshots are at other events
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", branch)
    r = git(repo, "merge", "a", "-m", "merge a", check=False)
    assert r.returncode != 0
    unmerged = git(repo, "diff", "--name-only", "--diff-filter=U").split()
    # never one merged without the other: the snapshot follows the ledger it describes
    assert {".fablize/ledger.jsonl", ".fablize/goals.json"} <= set(unmerged), unmerged


def test_the_side_to_keep_of_a_diverged_plan_is_its_folder_whatever_file_found_it():
    """Two branches that advanced one plan differently: the ledger, the snapshot and a run log
    each name the plan's folder to keep whole (a run log named the repository's root before)."""
    from fablize_gate.merge import keep_one
    folder = "git checkout --<ours|theirs> -- :/.fablize"
    for path in (".fablize/ledger.jsonl", ".fablize/goals.json", ".fablize/runs/3-G001.log"):
        assert keep_one(path, whole=True) == folder, path
    assert keep_one(".fablize/runs/3-G001.log") == folder + "/runs/3-G001.log"
    assert keep_one("ledger.jsonl", whole=True) == "git checkout --<ours|theirs> -- :/."
    assert keep_one(None) == ()
