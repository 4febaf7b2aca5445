"""The foundation rules (issue 2): invariants, resume, blank text, honest completion,
state discovery, `create --force`, `--json`, escaping, damaged snapshots, symlinks,
huge and binary evidence, --version/--help. Mostly in-process through `fab`."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (SCRIPT, assert_escaped, assert_refused, complete, git, ledger, make_plan,
                      rows, run_cli, start, state_files)

from conftest import engine

# Invariants ##################################################################


def test_checkpoint_refuses_a_story_that_is_already_complete(fab):
    make_plan(fab, 3)
    complete(fab, "G001")
    assert_refused(fab,
                   ["checkpoint", "--id", "G001", "--status", "complete", "--evidence", "again"], 1,
                   "G001 is not active (complete) — it is already done; nothing to do for it",
                   error="not_active")
    assert_refused(fab, ["checkpoint", "--id", "G001", "--status", "failed", "--evidence", "undo"],
                   1, "G001 is not active (complete)", error="not_active")


def test_checkpoint_refuses_an_unknown_story(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    assert_refused(fab, ["checkpoint", "--id", "G009", "--status", "complete", "--evidence", "e"],
                   1, "G009 not found.", error="not_found")
    assert_refused(fab, ["checkpoint", "--id", "X1", "--status", "complete", "--evidence", "e"], 2,
                   "X1 is not a story id — ids look like G001", error="bad_id")


@pytest.mark.parametrize("evidence", [None, "", " ", "\t\n  \r\n"])
def test_complete_refuses_missing_or_blank_evidence(fab, evidence):
    make_plan(fab, 3)
    start(fab, "G001")
    args = ["checkpoint", "--id", "G001", "--status", "complete"]
    if evidence is not None:
        args += ["--evidence", evidence]
    assert_refused(fab, args, 1, "a complete checkpoint requires non-empty --evidence.",
                   error="no_evidence")
    assert fab("status", "--json").json["stories"][0]["status"] == "in_progress"


def test_the_verification_gate_applies_only_to_the_final_story(fab):
    make_plan(fab, 3)
    start(fab, "G001")
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "done")
    assert r.code == 0, r


def test_final_story_evidence_is_still_required_with_verification(fab):
    make_plan(fab, 1)
    start(fab, "G001")
    assert_refused(fab,
                   ["checkpoint", "--id", "G001", "--status", "complete", "--evidence", "  ",
                    "--verify-cmd", "pytest", "--verify-evidence", "ok"], 1,
                   "a complete checkpoint requires non-empty --evidence.", error="no_evidence")


def file_stamps(state_dir):
    """(inode, size, mtime) of every state file: a rewrite with identical bytes still shows."""
    return {p.name: (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in Path(state_dir).iterdir() if p.is_file() and p.name != "lock"}


def test_next_while_a_story_is_in_progress_reprints_its_handoff_and_writes_nothing(fab):
    make_plan(fab, 3)
    first = start(fab, "G001")
    before = state_files(fab.dir)
    stamps = file_stamps(fab.dir)
    for _ in range(3):
        again = fab("next")
        assert again.code == 0, again
        assert again.out.splitlines()[0] == first.out.splitlines()[0] == \
            "=== fablize handoff — G001 S1"
        assert "Resumed" in again.out and "Resumed" not in first.out
        assert "On completion: goals.py checkpoint --id G001" in again.out
        assert state_files(fab.dir) == before
    j = fab("next", "--json").json
    assert j["ok"] and j["activated"] is False and j["story"]["id"] == "G001"
    assert state_files(fab.dir) == before
    assert file_stamps(fab.dir) == stamps, "the snapshot or ledger was rewritten"
    assert [e["event"] for e in ledger(fab.dir)] == ["plan_created", "story_started"]


def test_status_resumes_a_dead_session_from_the_files(project):
    assert run_cli("create", "--brief", "b", "--goal", "a::x", "--goal", "b::y",
                   cwd=project).code == 0
    assert run_cli("next", cwd=project).code == 0
    r = run_cli("status", cwd=project)        # a new process: only the files remember
    assert r.code == 0, r
    assert rows(r.out) == [("▶", "G001", "in_progress", "a"), ("·", "G002", "pending", "b")]
    assert "finish G001" in r.out


# Blank titles and objectives #################################################


@pytest.mark.parametrize("goal", ["   ::objective", "title::   ", "::", "\t\n::\n", " :: "])
def test_titles_and_objectives_empty_after_stripping_are_refused(fab, goal):
    r = fab("create", "--brief", "b", "--goal", "fine::ok", "--goal", goal)
    assert r.code == 2, r
    assert "must not be empty" in r.err and "G002" in r.err, r
    assert state_files(fab.dir) == {}
    assert fab("create", "--brief", "b", "--goal", goal, "--json").json["error"]["code"] == \
        "blank_goal"


def test_a_blank_goal_with_force_keeps_the_existing_plan(fab):
    make_plan(fab, 2)
    before = state_files(fab.dir)
    r = fab("create", "--brief", "new", "--goal", " ::x", "--force")
    assert r.code == 2 and "must not be empty" in r.err, r
    assert state_files(fab.dir) == before
    assert not (fab.dir / "archive").exists()


@pytest.mark.parametrize("goal", [" ::objective", "title:: \t"])
def test_add_refuses_a_blank_title_or_objective(fab, goal):
    make_plan(fab, 2)
    before = state_files(fab.dir)
    r = fab("add", "--goal", goal)
    assert r.code == 2 and "must not be empty" in r.err, r
    assert state_files(fab.dir) == before


# Honest completion: never "all stories complete" unless they are #############


def assert_never_all_complete(*results):
    for r in results:
        assert "all stories complete" not in r.out + r.err, r
        assert "all stories done" not in r.out + r.err, r


def test_a_blocked_final_story_is_not_reported_as_all_complete(fab):
    """The original printed "all stories complete ✓" once no story was pending/in progress."""
    make_plan(fab, 3)
    complete(fab, "G001")
    complete(fab, "G002")
    start(fab, "G003")
    cp = fab("checkpoint", "--id", "G003", "--status", "blocked", "--evidence", "no test env")
    assert cp.code == 0, cp
    assert "G003 → blocked" in cp.out and "decide --id G003" in cp.out, cp
    nxt = fab("next")
    assert nxt.code == 1, nxt
    assert "G003 is blocked (no test env)" in nxt.err
    assert "A human must decide, with one of:\n  goals.py decide --id G003 accept --note" in nxt.err
    assert "\n  goals.py decide --id G003 retry --note" in nxt.err  # each whole, on its line
    st = fab("status")
    assert st.code == 0 and "G003 is blocked" in st.out and "decide --id G003" in st.out, st
    assert_never_all_complete(cp, nxt, st)
    assert fab("next", "--json").json["error"]["code"] == "halted"


def test_a_blocked_story_halts_what_depends_on_it_and_next_names_it(fab):
    make_plan(fab, 3)
    start(fab, "G001")
    cp = fab("checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "API key missing")
    assert cp.code == 0, cp
    assert "G001 → blocked" in cp.out and "decide --id G001" in cp.out
    before = state_files(fab.dir)
    nxt = fab("next")
    assert nxt.code == 1 and "G001 is blocked (API key missing)" in nxt.err, nxt
    assert "decide --id G001" in nxt.err
    assert state_files(fab.dir) == before
    assert_never_all_complete(cp, nxt)


def test_a_failed_final_story_is_reopened_not_reported_done(fab):
    make_plan(fab, 2)
    complete(fab, "G001")
    start(fab, "G002")
    cp = fab("checkpoint", "--id", "G002", "--status", "failed", "--evidence", "3 tests fail")
    assert cp.code == 0 and "G002 → failed" in cp.out and "next" in cp.out, cp
    nxt = fab("next")
    assert nxt.code == 0 and nxt.out.startswith("=== fablize handoff — G002 "), nxt
    assert "3 tests fail" in nxt.out and "round 2" in nxt.out
    assert_never_all_complete(cp, nxt)


def test_a_story_out_of_rounds_is_blocked_and_next_names_the_decision(fab):
    make_plan(fab, 2, "--rounds", "1")
    start(fab, "G001")
    cp = fab("checkpoint", "--id", "G001", "--status", "failed", "--evidence", "nope")
    assert cp.code == 0 and "G001 → blocked" in cp.out and "decide --id G001" in cp.out, cp
    nxt = fab("next")
    assert nxt.code == 1 and "G001 is blocked" in nxt.err and "decide --id G001" in nxt.err, nxt
    assert_never_all_complete(cp, nxt)


def test_checkpoint_of_another_story_names_the_blocked_one(fab):
    make_plan(fab, 3, "--parallel")
    start(fab, "G001")
    assert fab("checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "why").code == 0
    start(fab, "G002")
    cp = fab("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "done")
    assert cp.code == 0, cp
    assert "G001 is blocked" in cp.out
    assert_never_all_complete(cp)


def test_checkpoint_of_another_story_gives_the_decide_command_for_the_blocked_one(fab):
    make_plan(fab, 3, "--parallel")
    start(fab, "G001")
    assert fab("checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "why").code == 0
    start(fab, "G002")
    cp = fab("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "done")
    assert cp.code == 0, cp
    assert "decide --id G001" in cp.out, cp


def test_all_stories_complete_is_said_only_when_every_story_is_complete(fab):
    make_plan(fab, 3)
    complete(fab, "G001")
    r = complete(fab, "G002")
    assert_never_all_complete(r, fab("status"))
    r = complete(fab, "G003", final=True)
    assert r.out.splitlines()[-1] == "fablize: all stories complete ✓"
    assert fab("status").out.splitlines()[-1] == "fablize: all stories complete ✓"
    assert fab("next").out == "fablize: all stories complete ✓\n"
    assert fab("status", "--json").json["complete"] is True


def test_a_human_acceptance_is_not_called_complete(fab):
    make_plan(fab, 2)
    complete(fab, "G001")
    start(fab, "G002")
    fab("checkpoint", "--id", "G002", "--status", "blocked", "--evidence", "no CI here")
    r = fab("decide", "--id", "G002", "accept", "--note", "verified by hand on staging")
    assert r.code == 0, r
    assert "all stories complete" not in r.out
    assert "all stories done ✓ (G002 accepted by a human decision)" in r.out


# State discovery #############################################################


def plan_brief(state_dir):
    return json.loads((Path(state_dir) / "goals.json").read_text(encoding="utf-8"))["brief"]


def create_in(fab, brief, *opts):
    r = fab(*opts, "create", "--brief", brief, "--goal", "a::b")
    assert r.code == 0, r
    return r


@pytest.mark.parametrize("where", ["before", "after", "equals"])
def test_dir_option_names_the_state_directory_before_or_after_the_command(fab, where):
    other = fab.root / "elsewhere" / "state"
    opts = {"before": ["--dir", str(other)], "equals": [f"--dir={other}"]}.get(where, [])
    args = [*opts, "create", "--brief", "in other", "--goal", "a::b"]
    if where == "after":
        args += ["--dir", str(other)]
    r = fab(*args)
    assert r.code == 0, r
    assert plan_brief(other) == "in other"
    assert not fab.dir.exists()
    r = fab("status", "--dir", str(other)) if where == "after" else fab(*opts, "status")
    assert r.code == 0 and "in other" in r.out, r
    assert fab("status").code == 1          # the discovered state is untouched


def test_fablize_dir_is_the_state_directory_itself(fab, monkeypatch):
    env_dir = fab.root / "env-state"
    monkeypatch.setenv("FABLIZE_DIR", str(env_dir))
    create_in(fab, "from env")
    assert (env_dir / "goals.json").is_file() and (env_dir / "ledger.jsonl").is_file()
    assert not (env_dir / ".fablize").exists() and not fab.dir.exists()
    sub = fab.root / "deep" / "er"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    assert "from env" in fab("status").out
    # --dir beats $FABLIZE_DIR
    explicit = fab.root / "explicit"
    create_in(fab, "explicit", "--dir", str(explicit))
    assert plan_brief(explicit) == "explicit" and plan_brief(env_dir) == "from env"


def test_a_subdirectory_finds_the_state_at_the_repository_root(fab, monkeypatch):
    sub = fab.root / "src" / "pkg" / "deep"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    create_in(fab, "from a subdirectory")       # no state yet: it goes to the repository root
    assert plan_brief(fab.dir) == "from a subdirectory"
    assert not (sub / ".fablize").exists()
    monkeypatch.chdir(fab.root / "src")
    assert fab("next").code == 0
    monkeypatch.chdir(sub)
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
               "--verify-cmd", "c", "--verify-evidence", "v").code == 0
    assert [e["event"] for e in ledger(fab.dir)] == ["plan_created", "story_started", "checkpoint"]


def test_the_nearest_state_directory_wins(fab, monkeypatch):
    create_in(fab, "root plan")
    inner = fab.root / "pkg"
    inner.mkdir()
    create_in(fab, "pkg plan", "--dir", str(inner / ".fablize"))
    (inner / "src").mkdir()
    monkeypatch.chdir(inner / "src")
    assert "pkg plan" in fab("status").out
    monkeypatch.chdir(fab.root)
    assert "root plan" in fab("status").out


def test_a_git_worktree_has_its_own_state(fab, monkeypatch):
    create_in(fab, "main checkout")
    before = state_files(fab.dir)
    wt = fab.root / "worktrees" / "feature"
    (wt / "src").mkdir(parents=True)
    (wt / ".git").write_text("gitdir: ../../.git/worktrees/feature\n")   # a .git FILE
    monkeypatch.chdir(wt / "src")
    r = fab("status")
    assert r.code == 1 and "no plan" in r.err, r
    create_in(fab, "worktree plan")
    assert plan_brief(wt / ".fablize") == "worktree plan"
    assert state_files(fab.dir) == before


def test_walking_up_stops_at_the_repository_root(fab, monkeypatch):
    outer = fab.root / "outer"
    create_in(fab, "outside the repo", "--dir", str(outer / ".fablize"))
    before = state_files(outer / ".fablize")
    repo = outer / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "sub").mkdir()
    monkeypatch.chdir(repo / "sub")
    r = fab("status")
    assert r.code == 1 and "no plan" in r.err, r
    create_in(fab, "inside")
    assert plan_brief(repo / ".fablize") == "inside"
    assert state_files(outer / ".fablize") == before


def test_without_a_repository_the_state_is_in_the_current_directory(fab, monkeypatch,
                                                                     tmp_path_factory):
    base = tmp_path_factory.mktemp("norepo")
    for d in [base, *base.parents]:
        if (d / ".git").exists() or (d / ".fablize").exists():
            pytest.skip(f"{d} holds .git or .fablize: no repository-free directory here")
    cwd = base / "a" / "b"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    create_in(fab, "no repo")
    assert plan_brief(cwd / ".fablize") == "no repo"
    assert not (base / ".fablize").exists() and not (base / "a" / ".fablize").exists()


# create --force loses nothing ###############################################


def test_create_force_archives_the_old_plan_whole(fab):
    make_plan(fab, 3)
    complete(fab, "G001")
    start(fab, "G002")
    old_snap = (fab.dir / "goals.json").read_bytes()
    old_ledger = (fab.dir / "ledger.jsonl").read_bytes()
    old_id = json.loads(old_snap)["plan_id"]
    r = fab("create", "--brief", "second", "--goal", "x::y", "--force")
    assert r.code == 0, r
    kept = fab.dir / "archive" / old_id
    assert (kept / "goals.json").read_bytes() == old_snap
    assert (kept / "ledger.jsonl").read_bytes() == old_ledger
    assert old_id in r.out
    events = ledger(fab.dir)
    assert len(events) == 1 and events[0]["event"] == "plan_created"
    assert events[0]["seq"] == 1 and events[0]["prev"] == "0" * 64
    replaces = events[0]["replaces"]
    assert replaces["plan_id"] == old_id
    assert replaces["head"] == hashlib.sha256(old_ledger.rstrip(b"\n").split(b"\n")[-1]).hexdigest()
    assert plan_brief(fab.dir) == "second"
    assert fab("audit").code == 0


def test_create_force_twice_keeps_both_old_plans(fab):
    make_plan(fab, 2)
    first = (fab.dir / "ledger.jsonl").read_bytes()
    assert fab("create", "--brief", "second", "--goal", "a::b", "--force").code == 0
    second = (fab.dir / "ledger.jsonl").read_bytes()
    assert fab("create", "--brief", "third", "--goal", "a::b", "--force").code == 0
    kept = sorted((fab.dir / "archive").iterdir())
    assert len(kept) == 2
    assert sorted((k / "ledger.jsonl").read_bytes() for k in kept) == sorted([first, second])
    third = ledger(fab.dir)[0]
    assert third["replaces"]["head"] == hashlib.sha256(second.rstrip(b"\n")).hexdigest()


# --json on every command #####################################################


def check_json(r, ok):
    """stdout is exactly one JSON object with schema_version 1; errors carry code and exit."""
    assert r.out.endswith("\n") and r.out.count("\n") == 1, r
    obj = json.loads(r.out)
    assert isinstance(obj, dict), r
    assert obj["schema_version"] == engine.SCHEMA_VERSION and obj["ok"] is ok, r
    if ok:
        assert r.code == 0 and "error" not in obj, r
    else:
        err = obj["error"]
        assert isinstance(err["code"], str) and re.fullmatch(r"[a-z_]+", err["code"]), r
        assert isinstance(err["message"], str) and err["message"], r
        assert err["exit"] == r.code != 0, r
    return obj


def judged_plan(fab):
    """G001 judged and in review (waiting for a verdict), G002 the final story."""
    r = fab("create", "--brief", "b", "--goal", "a::x", "--goal", "b::y", "--judge", "G001")
    assert r.code == 0, r
    start(fab, "G001")
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
            "--agent", "worker")
    assert r.code == 0 and "review" in r.out, r


def blocked_plan(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    assert fab("checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "why").code == 0


def plan2(fab):
    make_plan(fab, 2)


def active_plan(fab):
    make_plan(fab, 2)
    start(fab, "G001")


def nothing(fab):
    pass


def edited_ledger(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    path = fab.dir / "ledger.jsonl"
    path.write_bytes(path.read_bytes().replace(b'"brief":"test plan"', b'"brief":"test plaN"', 1))


def git_repo(fab):
    """The project as a real git repository with a bare remote `origin`."""
    import shutil
    shutil.rmtree(fab.root / ".git")
    git(fab.root, "init", "-q")
    git(fab.root, "init", "-q", "--bare", str(fab.root / "r.git"))
    git(fab.root, "remote", "add", "origin", str(fab.root / "r.git"))


def shared_plan(fab):
    git_repo(fab)
    make_plan(fab, 2)
    assert fab("share", "--remote", "origin").code == 0


def driver_files(same):
    def setup(fab):
        (fab.root / "a").write_text("x\n")
        (fab.root / "b").write_text("x\n" if same else "y\n")
    return setup


# command -> (setup, success args, setup for the failure, failure args, error code, exit)
JSON_CASES = {
    "create": (nothing, ["create", "--brief", "b", "--goal", "a::b"],
               plan2, ["create", "--brief", "b", "--goal", "a::b"], "plan_exists", 1),
    "next": (plan2, ["next"], nothing, ["next"], "no_plan", 1),
    "checkpoint": (active_plan, ["checkpoint", "--id", "G001", "--status", "complete",
                                 "--evidence", "e"],
                   active_plan, ["checkpoint", "--id", "G001", "--status", "complete"],
                   "no_evidence", 1),
    "status": (plan2, ["status"], nothing, ["status"], "no_plan", 1),
    "verify": (plan2, ["verify", "--id", "G001", "--verify-cmd", "exit 0"],
               plan2, ["verify", "--id", "G001"], "no_checks", 1),
    "decide": (blocked_plan, ["decide", "--id", "G001", "retry", "--note", "try again"],
               plan2, ["decide", "--id", "G001", "retry", "--note", "n"], "not_decidable", 1),
    "add": (plan2, ["add", "--goal", "extra::more"], plan2, ["add", "--goal", "::"],
            "blank_goal", 2),
    "audit": (plan2, ["audit"], edited_ledger, ["audit"], "broken_chain", 3),
    "rebuild": (plan2, ["rebuild"], nothing, ["rebuild"], "no_plan", 1),
    "log": (plan2, ["log"], nothing, ["log"], "no_plan", 1),
    "report": (plan2, ["report"], nothing, ["report"], "no_plan", 1),
    "judge-packet": (judged_plan, ["judge-packet", "--id", "G001"],
                     plan2, ["judge-packet", "--id", "G404"], "not_found", 1),
    "verdict": (judged_plan, ["verdict", "--id", "G001", "achieved", "--evidence", "seen",
                              "--agent", "judge"],
                plan2, ["verdict", "--id", "G001", "achieved", "--evidence", "e",
                        "--agent", "judge"], "not_in_review", 1),
    "install-block": (nothing, ["install-block", "AGENTS.md"],
                      lambda fab: (fab.root / "AGENTS.md").symlink_to(fab.root / "target.md"),
                      ["install-block", "AGENTS.md"], "symlink", 1),
    "setup": (nothing, ["setup"],
              lambda fab: (fab.root / "CLAUDE.md").symlink_to(fab.root / "target.md"),
              ["setup"], "symlink", 1),
    "doctor": (lambda fab: wired(fab), ["doctor"], nothing, ["doctor"], "doctor_problems", 1),
    "completion": (nothing, ["completion", "bash"], nothing,
                   ["completion", "bash", "--name", "a b"], "bad_name", 2),
    "pause": (plan2, ["pause", "--note", "n"], lambda fab: (plan2(fab), fab("pause")), ["pause"],
              "already_paused", 1),
    "unpause": (lambda fab: (plan2(fab), fab("pause")), ["unpause"], plan2, ["unpause"],
                "not_paused", 1),
    "share": (lambda fab: (git_repo(fab), make_plan(fab, 2)), ["share", "--remote", "origin"],
              plan2, ["share", "--remote", "origin"], "no_remote", 1),
    "sync": (shared_plan, ["sync"], plan2, ["sync"], "not_shared", 1),
    "release": (active_plan, ["release", "--id", "G001", "--note", "silent"],
                plan2, ["release", "--id", "G001", "--note", "n"], "not_active", 1),
    "install-merge": (git_repo, ["install-merge"], nothing, ["install-merge"], "no_git_repo", 1),
    "merge-driver": (driver_files(True), ["merge-driver", "o", "a", "b", ".fablize/ledger.jsonl"],
                     driver_files(False), ["merge-driver", "o", "a", "b", "x.txt"], "conflict", 1),
}


def wired(fab):
    """`setup` done, with a `fablize` on PATH (the in-process engine names itself so)."""
    bin_dir = fab.root / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "fablize"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} {SCRIPT} \"$@\"\n")
    shim.chmod(0o755)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"  # restored by `project`
    assert fab("setup").code == 0


def test_json_cases_cover_every_command_but_the_hook():
    assert set(JSON_CASES) == set(engine.command_names()) - {"guard", "observe"}


@pytest.mark.parametrize("position", ["after", "before"])
@pytest.mark.parametrize("command", sorted(JSON_CASES))
def test_json_success_prints_exactly_one_object(fab, command, position):
    setup, args, *_ = JSON_CASES[command]
    setup(fab)
    argv = [*args, "--json"] if position == "after" else ["--json", *args]
    obj = check_json(fab(*argv), ok=True)
    assert obj["command"] == command


@pytest.mark.parametrize("command", sorted(JSON_CASES))
def test_json_failure_carries_a_stable_code_and_the_exit_code(fab, command):
    _, _, setup, args, code, exit_code = JSON_CASES[command]
    setup(fab)
    before = state_files(fab.dir)
    r = fab(*args, "--json")
    obj = check_json(r, ok=False)
    assert (obj["error"]["code"], r.code) == (code, exit_code), r
    assert obj["command"] == command
    assert state_files(fab.dir) == before


@pytest.mark.parametrize("args", [
    ["checkpoint", "--json"],                       # --id and --status missing
    ["--json", "frobnicate"],
    ["--json"],
    ["create", "--brief", "b", "--goal", "no separator", "--json"],
])
def test_json_usage_errors_are_one_object_with_exit_2(fab, args):
    obj = check_json(fab(*args), ok=False)
    assert obj["error"]["exit"] == 2


def test_json_on_a_damaged_snapshot_is_one_object_with_exit_3(fab):
    make_plan(fab, 2)
    (fab.dir / "goals.json").write_bytes(b"{")
    obj = check_json(fab("status", "--json"), ok=False)
    assert obj["error"] == {"code": "bad_snapshot", "message": obj["error"]["message"], "exit": 3,
                            "commands": ["goals.py rebuild"]}  # the way out, whole


# A damaged goals.json is exit 3, one line, nothing changed ###################


def _edit_snapshot(fn):
    def edit(raw):
        snap = json.loads(raw)
        fn(snap)
        return json.dumps(snap).encode()
    return edit


def _set_status(value):
    def fn(snap):
        snap["goals"][0]["status"] = value
    return fn


BAD_SNAPSHOTS = {
    "empty": lambda raw: b"",
    "whitespace": lambda raw: b" \n\t\n",
    "truncated": lambda raw: raw[:len(raw) // 2],
    "non-utf8": lambda raw: raw.replace(b'"S1"', b'"S\xff\xfe1"'),
    "json list": lambda raw: b"[" + raw.rstrip() + b"]",
    "json string": lambda raw: b'"goals"',
    "goals not a list": _edit_snapshot(lambda s: s.update(goals={"G001": s["goals"][0]})),
    "goals empty": _edit_snapshot(lambda s: s.update(goals=[])),
    "story not an object": _edit_snapshot(lambda s: s["goals"].__setitem__(0, "G001")),
    "status 5": _edit_snapshot(_set_status(5)),
    "status unknown": _edit_snapshot(_set_status("done")),
    "title not a string": _edit_snapshot(lambda s: s["goals"][0].update(title=None)),
    "ledger position missing": _edit_snapshot(lambda s: s.pop("ledger")),
    "hand edit of a status": _edit_snapshot(_set_status("complete")),
    "hand edit of evidence": _edit_snapshot(lambda s: s["goals"][0].update(evidence="forged")),
}

COMMANDS_ON_PLAN = [
    ["status"], ["next"], ["checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e"],
    ["add", "--goal", "x::y"], ["report"], ["judge-packet", "--id", "G001"],
    ["decide", "--id", "G001", "retry", "--note", "n"], ["audit"],
]


def one_message(err):
    """One `fablize: ` line, then at most the one command of the step it names, indented."""
    lines = err.splitlines()
    return (err.startswith("fablize: ") and err.endswith("\n") and len(lines) <= 2
            and all(x.startswith("  ") for x in lines[1:]))


@pytest.mark.parametrize("damage", sorted(BAD_SNAPSHOTS))
def test_a_damaged_snapshot_is_refused_with_exit_3_and_changes_nothing(fab, damage):
    make_plan(fab, 2)
    path = fab.dir / "goals.json"
    path.write_bytes(BAD_SNAPSHOTS[damage](path.read_bytes()))
    before = state_files(fab.dir)
    for args in COMMANDS_ON_PLAN:
        r = fab(*args)
        assert r.code == 3, (args, r)
        assert one_message(r.err), (args, r)
        assert "Traceback" not in r.err and r.out == "", (args, r)
        assert state_files(fab.dir) == before, args


def test_a_hand_edited_status_names_the_digest_and_the_way_out(fab):
    make_plan(fab, 2)
    path = fab.dir / "goals.json"
    path.write_bytes(path.read_bytes().replace(b'"status":"pending"', b'"status":"complete"', 1))
    r = fab("status")
    assert r.code == 3 and "goals.json" in r.err and "digest" in r.err, r
    assert r.err.splitlines()[1] == "  goals.py rebuild", r  # the way out, whole
    assert fab("status", "--json").json["error"]["code"] == "snapshot_edited"


@pytest.mark.parametrize("damage", ["empty", "truncated", "non-utf8", "hand edit of a status"])
def test_a_damaged_snapshot_gives_no_traceback_in_the_real_process(project, damage):
    assert run_cli("create", "--brief", "b", "--goal", "S1::x", "--goal", "S2::y",
                   cwd=project).code == 0
    path = project / ".fablize" / "goals.json"
    path.write_bytes(BAD_SNAPSHOTS[damage](path.read_bytes()))
    before = state_files(project / ".fablize")
    r = run_cli("next", cwd=project)
    assert r.code == 3, r
    assert one_message(r.err) and "Traceback" not in r.err, r
    assert state_files(project / ".fablize") == before


def test_a_snapshot_stripped_of_its_digest_beside_a_chained_ledger_is_tampering(fab):
    make_plan(fab, 2)
    path = fab.dir / "goals.json"
    snap = json.loads(path.read_bytes())
    del snap["digest"], snap["ledger"]
    for g in snap["goals"]:
        g.update(status="complete", evidence="forged")
    path.write_text(json.dumps(snap))
    before = state_files(fab.dir)
    r = fab("status")
    assert "all stories complete" not in r.out
    assert r.code == 3, r
    assert state_files(fab.dir) == before
    assert fab("audit", "--require-complete").code != 0


# Huge and binary evidence #####################################################


@pytest.mark.parametrize("option", ["--evidence", "--verify-evidence", "--verify-cmd"])
def test_five_megabytes_of_evidence_is_refused_as_usage(fab, option):
    make_plan(fab, 1)
    start(fab, "G001")
    args = {"--evidence": "e", "--verify-cmd": "pytest", "--verify-evidence": "ok"}
    args[option] = "x" * (5 << 20)
    flat = [x for kv in args.items() for x in kv]
    before = state_files(fab.dir)
    r = fab("checkpoint", "--id", "G001", "--status", "complete", *flat)
    assert r.code == 2, r
    assert option in r.err and "5,242,880 bytes" in r.err and "limit" in r.err, r
    assert r.err.count("\n") == 1 and len(r.err) < 500
    assert state_files(fab.dir) == before
    assert fab("checkpoint", "--id", "G001", "--status", "complete", *flat, "--json") \
        .json["error"]["code"] == "too_large"
    assert state_files(fab.dir) == before


def test_a_five_megabyte_brief_or_title_is_refused(fab):
    big = "y" * (5 << 20)
    assert fab("create", "--brief", big, "--goal", "a::b").code == 2
    assert fab("create", "--brief", "b", "--goal", f"{big}::b").code == 2
    assert state_files(fab.dir) == {}


def test_binary_looking_evidence_is_stored_and_shown_escaped(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    evidence = "bin\x00ary \x1b[31mred\x1b[0m bell\x07 cr\r lone\udcff end"
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", evidence)
    assert r.code == 0, r
    stored = evidence.replace("\udcff", "\ufffd")   # undecodable argv bytes: U+FFFD
    assert ledger(fab.dir)[-1]["evidence"] == stored
    snap = json.loads((fab.dir / "goals.json").read_text(encoding="utf-8"))
    assert snap["goals"][0]["evidence"] == stored
    shown = [fab("next"), fab("log"), fab("judge-packet", "--id", "G001")]
    for o in shown:
        assert o.code == 0, o
        assert_escaped(o.out + o.err)
        assert "bin\\x00ary \\x1b[31mred" in o.out, o
    assert fab("audit").code == 0


def test_undecodable_argv_bytes_are_accepted_by_the_real_process(project):
    assert run_cli("create", "--brief", "b", "--goal", "a::x", "--goal", "b::y",
                   cwd=project).code == 0
    assert run_cli("next", cwd=project).code == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")}
    p = subprocess.run([sys.executable, str(SCRIPT), "checkpoint", "--id", "G001", "--status",
                        "complete", "--evidence", b"latin1 caf\xe9 \xff\xfe end"],
                       cwd=str(project), env=env, capture_output=True, timeout=120)
    assert p.returncode == 0, p
    assert b"Traceback" not in p.stderr
    assert ledger(project / ".fablize")[-1]["evidence"] == "latin1 caf\ufffd \ufffd\ufffd end"
    assert run_cli("audit", cwd=project).code == 0


# --version and --help ########################################################


def test_version_prints_the_version(fab):
    r = fab("--version")
    assert r.code == 0
    assert r.out.strip() == f"fablize {engine.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", engine.__version__)


def test_help_lists_every_command(fab):
    r = fab("--help")
    assert r.code == 0, r
    listed = set(re.findall(r"^\s{2,}([a-z][a-z-]+)\b", r.out, re.M))
    assert set(engine.command_names()) <= listed, set(engine.command_names()) - listed
    assert "Exit codes" in r.out


@pytest.mark.parametrize("command", sorted(engine.command_names()))
def test_each_command_has_its_own_help(fab, command):
    r = fab(command, "--help")
    assert r.code == 0, r
    assert r.out.startswith(f"usage: goals.py {command}"), r
    assert "--json" in r.out and "--dir" in r.out
