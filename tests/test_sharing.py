"""Shared plans: one plan carried by a git remote (refs/fablize/plans/<id>), many clones,
concurrent writers ordered by the remote's fast-forward-only ref update. Real git throughout:
a bare repository is the remote, clones are real clones."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ENGINE, ROOT, SCRIPT, assert_refused, git, engine, run_cli, state_files

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_CONFIG_NOSYSTEM": "1"}


class Net:
    """A bare remote and its clones; clone(name)(*args) runs the engine in-process there."""

    def __init__(self, tmp_path, capsys):
        self.tmp = tmp_path
        self.capsys = capsys
        self.remote = tmp_path / "remote.git"
        git(tmp_path, "init", "-q", "--bare", str(self.remote))

    def clone(self, name):
        path = self.tmp / name
        git(self.tmp, "clone", "-q", str(self.remote), str(path))
        return self.at(path)

    def at(self, path):
        capsys = self.capsys

        def run(*args):
            old = os.getcwd()
            os.chdir(path)
            try:
                code = engine.main([str(a) for a in args])
            finally:
                os.chdir(old)
            out = capsys.readouterr()
            from conftest import Result
            return Result(code, out.out, out.err)
        run.root = path
        run.dir = path / ".fablize"
        return run

    def remote_lines(self, plan_id):
        """The ledger lines of the plan's commits on the remote (a replaced plan's last commit
        holds no event: its replaced.json names the plan that replaced it)."""
        ref = "refs/fablize/plans/" + plan_id
        revs = git(self.remote, "rev-list", "--reverse", ref).split()
        return [git(self.remote, "cat-file", "blob", f"{r}:event.jsonl").encode() for r in revs
                if "event.jsonl" in git(self.remote, "ls-tree", "--name-only", r).split()]


@pytest.fixture
def net(tmp_path, monkeypatch, capsys):
    for var in ("FABLIZE_DIR", "FABLIZE_CRASH_AT", "FABLIZE_LOCK_TIMEOUT", "GITHUB_STEP_SUMMARY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for k, v in GIT_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    return Net(tmp_path, capsys)


def cli_env(net):
    return dict(GIT_ENV, HOME=str(net.tmp))


def create(fab, n=3, *extra):
    args = ["create", "--brief", "shared plan", "--remote", "origin", *extra]
    for i in range(1, n + 1):
        args += ["--goal", f"S{i}::objective {i}"]
    r = fab(*args)
    assert r.code == 0, r
    return fab("status", "--json").json["plan_id"]


def ledger_lines(fab):
    return (fab.dir / "ledger.jsonl").read_bytes().splitlines()


def audit_ok(fab, *extra):
    r = fab("audit", "--json", *extra)
    assert r.code == 0, r
    return r.json


# Publishing ##################################################################


def test_create_remote_publishes_one_commit_per_event_holding_its_exact_line(net):
    a = net.clone("a")
    plan_id = create(a, 2)
    assert a("next").code == 0
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ran it",
          "--run", "--verify-cmd", "echo hello-log")
    assert r.code == 0, r
    assert net.remote_lines(plan_id) == [x + b"\n" for x in ledger_lines(a)]
    # a run's output travels with its event, as the log blob of that commit
    ref = "refs/fablize/plans/" + plan_id
    run_commit = git(net.remote, "rev-list", "-1", "--grep", "verify_run", ref).strip()
    assert git(net.remote, "cat-file", "blob", f"{run_commit}:log") == "hello-log\n"
    # a shared plan lives in refs, not in the branch: branch merges never touch it
    assert ".fablize" not in git(a.root, "status", "--porcelain", "--untracked-files=all")


def test_create_force_in_a_shared_plan_publishes_the_new_plan_under_its_own_ref(net):
    a, b = net.clone("a"), net.clone("b")
    old = create(a, 2)
    r = a("create", "--force", "--brief", "second", "--goal", "x::y")
    assert r.code == 0, r
    new = a("status", "--json").json["plan_id"]
    assert new != old and len(net.remote_lines(new)) == 1 and len(net.remote_lines(old)) == 1
    assert b("sync", "--plan", new).code == 0
    assert b("status", "--json").json["brief"] == "second"


def test_share_publishes_an_existing_plan_and_refuses_an_unknown_remote(net):
    a = net.clone("a")
    r = a("create", "--brief", "b", "--goal", "x::y", "--goal", "z::w")
    assert r.code == 0
    assert a("next").code == 0
    assert_refused(a, ["share", "--remote", "nowhere"], 1, "not a git remote")
    assert_refused(a, ["share", "--remote=a b"], 2, "--remote takes")
    r = a("share", "--remote", "origin", "--json")
    assert r.code == 0, r
    plan_id = r.json["share"]["ref"].rsplit("/", 1)[1]
    assert net.remote_lines(plan_id) == [x + b"\n" for x in ledger_lines(a)]


def test_a_checkpoint_names_the_next_step_of_its_own_agent_on_the_plan_as_the_remote_holds_it(
        net):
    a, b = net.clone("a"), net.clone("b")
    create(a, 3, "--parallel")  # G001 and G002 independent; G003, the final one, needs both
    assert a("next", "--agent", "alice").code == 0
    assert b("sync").code == 0 and b("next", "--agent", "bob").code == 0  # bob holds G002
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
          "--agent", "alice")
    assert r.code == 0, r
    last = r.out.strip().splitlines()[-1]  # never bob's story handed to alice
    assert "nothing is ready for agent alice: in progress G002 (bob)" in last, r.out
    assert "activates G002" not in r.out and "--agent bob" not in r.out
    r = b("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "e",
          "--agent", "bob")  # published after pulling alice's completion of G001
    assert r.code == 0, r
    last = r.out.strip().splitlines()[-1]
    assert "next --agent bob` (activates G003)" in last and "G001" not in last, r.out


def test_sharing_says_once_what_a_shared_plan_publishes(net):
    a = net.clone("a")
    r = a("create", "--brief", "b", "--goal", "x::y", "--remote", "origin")
    said = "it publishes, to everyone who can read origin: the plan, its evidence and every run"
    assert r.code == 0 and r.out.count(said) == 1, r
    assert "no absolute path of this machine, no variable's value" in r.out
    again = a("share", "--remote", "origin")  # already shared: said no more
    assert again.code == 0 and said not in again.out, again
    b = net.clone("b")
    r = b("create", "--brief", "b", "--goal", "x::y")
    assert r.code == 0 and said not in r.out  # a local plan publishes nothing
    r = b("share", "--remote", "origin")
    assert r.code == 0 and said in r.out, r


def test_a_local_plan_never_starts_git(fab, monkeypatch, tmp_path):
    empty = tmp_path / "nobin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no git to be found: any attempt would fail
    assert fab("create", "--brief", "b", "--goal", "a::b", "--goal", "c::d").code == 0
    for args in (["next"], ["checkpoint", "--id", "G001", "--status", "complete",
                            "--evidence", "e"],
                 ["status"], ["next"], ["release", "--id", "G002", "--note", "silent"], ["audit"]):
        r = fab(*args)
        assert r.code == 0, (args, r)
    assert not (fab.dir / "share.json").exists()


# Fresh clones ################################################################


def test_a_plan_continues_on_a_fresh_clone_with_git_clone_and_sync(net):
    a = net.clone("a")
    create(a, 3)
    assert a("next").code == 0
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "built the parser",
          "--run", "--verify-cmd", "echo parser-ok")
    assert r.code == 0, r
    b = net.clone("b")
    assert_refused(b, ["next"], 1, "no plan")
    r = b("sync")
    assert r.code == 0 and "in sync with origin" in r.out, r
    assert ledger_lines(b) == ledger_lines(a)
    r = b("next")
    assert r.code == 0 and "handoff — G002" in r.out, r
    assert "built the parser" in r.out  # the first clone's evidence is carried
    assert audit_ok(b, "--require-logs")["missing_logs"] == 0
    # and the first clone sees the second's claim
    assert a("sync").code == 0
    assert a("status", "--json").json["stories"][1]["status"] == "in_progress"


def test_a_checkpoint_on_a_stale_copy_of_a_shared_plan_is_told_to_sync(net):
    a, b = net.clone("a"), net.clone("b")
    create(a, 3)
    assert b("sync").code == 0
    assert a("next").code == 0  # published: b's copy still says G001 is pending
    r = assert_refused(b, ["checkpoint", "--id", "G001", "--status", "complete", "--evidence",
                           "done"], 1, "G001 is not active (pending)", "sync it first",
                       error="not_active")
    assert r.err.splitlines()[-1].strip().endswith(" sync"), r
    assert b("sync").code == 0  # the step named works: b now sees G001 in progress
    assert b("status", "--json").json["stories"][0]["status"] == "in_progress"


def test_sync_on_a_clone_refuses_a_local_plan_and_a_remote_without_plans(net):
    a = net.clone("a")
    assert_refused(a, ["sync"], 1, "shares no plans")
    assert a("create", "--brief", "b", "--goal", "x::y").code == 0
    assert_refused(a, ["sync"], 1, "this plan is local")


def test_sync_asks_which_plan_when_the_remote_shares_several(net):
    a = net.clone("a")
    first = create(a, 2)
    second_dir = net.clone("a2")
    second = create(second_dir, 2)
    b = net.clone("b")
    r = assert_refused(b, ["sync"], 1, "--plan ID")
    assert first in r.err and second in r.err
    assert_refused(b, ["sync", "--plan", "x:refs/heads/main"], 2, "--plan takes a plan id")
    assert b("sync", "--plan", second).code == 0
    assert b("status", "--json").json["plan_id"] == second


# Claims across machines ######################################################


def test_an_agent_in_another_clone_gets_a_different_story(net):
    a, b = net.clone("a"), net.clone("b")
    create(a, 4, "--parallel")
    assert b("sync").code == 0
    ra = a("next", "--agent", "x", "--json").json
    rb = b("next", "--agent", "y", "--json").json  # b has not synced since: next pulls first
    assert ra["story"]["id"] != rb["story"]["id"]


@pytest.mark.parametrize("stories", [2, 3])
def test_a_claim_lost_between_fetch_and_push_is_never_double_held_and_names_the_holder(
        net, monkeypatch, stories):
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, stories, "--parallel")
    assert b("sync").code == 0
    sharing = engine.room("sharing")
    real = sharing.event_commits
    raced = []

    def b_claims_first(store, cfg, lines, *rest):
        if not raced:  # another machine claims G001 right after a fetched
            raced.append(1)
            r = run_cli("next", "--agent", "y", cwd=b.root, env=cli_env(net))
            assert r.code == 0 and "G001" in r.out, r
        return real(store, cfg, lines, *rest)
    monkeypatch.setattr(sharing, "event_commits", b_claims_first)
    r = a("next", "--agent", "x")
    if stories == 2:  # nothing else is ready: refused, naming who holds it
        assert r.code == 1 and "G001" in r.err and "agent y holds it" in r.err, r
    else:  # said, set aside, and the next ready story is claimed instead
        assert r.code == 0 and "handoff — G002" in r.out, r
        assert "agent y holds it" in r.err and "Claiming G002 instead" in r.err, r
        # said once: not a second time as an event set aside, nor by the next command
        assert r.err.count("was taken on") == 1 and "no longer legal" not in r.err, r
        assert "not acknowledged" not in a("status").err  # this very claim acknowledged it
    rejected = [json.loads(x) for x in (a.dir / "rejected.jsonl").read_text().splitlines()]
    assert [(x["event"]["id"], x["event"]["agent"]) for x in rejected] == [("G001", "x")]
    starts = [json.loads(x) for x in net.remote_lines(plan_id) if b'"story_started"' in x]
    assert [(e["id"], e["agent"]) for e in starts] == \
        [("G001", "y")] + ([("G002", "x")] if stories == 3 else [])
    audit_ok(a)


def test_release_ends_a_silent_agents_claim_by_a_recorded_act(net):
    a, b = net.clone("a"), net.clone("b")
    create(a, 2)
    assert a("next", "--agent", "silent").code == 0
    assert b("sync").code == 0
    assert_refused(b, ["release", "--id", "G002", "--note", "n"], 1, "not in progress")
    assert_refused(b, ["release", "--id", "G001", "--note", " "], 1, "non-empty --note")
    r = b("release", "--id", "G001", "--note", "no heartbeat for 2 h", "--json")
    assert r.code == 0 and r.json["released_from"] == "silent", r
    r = b("next", "--agent", "fresh")
    assert r.code == 0 and "handoff — G001" in r.out and "no heartbeat" in r.out, r
    # a release is worded as one, never as a failed attempt
    assert "released the claim of the agent that held it, not a failed attempt" in r.out, r
    assert "## Why it came back (round 1, from a human's release)" in r.out, r
    assert "did not achieve" not in r.out and "What was missing" not in r.out, r
    # the silent agent's late checkpoint is refused, naming who holds the story now
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "late",
          "--agent", "silent")
    assert r.code == 1 and "fresh" in r.err, r
    assert b("sync").code == 0
    assert [e for e in map(json.loads, ledger_lines(b)) if e["event"] == "story_released"]
    audit_ok(b)


# Status ######################################################################


def test_status_says_how_far_ahead_and_behind_the_remote_the_copy_is(net):
    a, b = net.clone("a"), net.clone("b")
    create(a, 3, "--parallel")
    assert b("sync").code == 0
    assert a("next", "--agent", "x").code == 0
    assert a("next", "--agent", "z").code == 0
    share = b("status", "--json").json["share"]
    assert (share["ahead"], share["behind"]) == (0, 2)
    lines = b("status").out.splitlines()
    said = [x for x in lines if "behind" in x]  # first, once; the step is `sync`
    assert said == [lines[0]] and " is 2 events behind origin " in said[0], lines
    assert any(x.startswith(f"fablize: next — `python3 {SCRIPT} sync` (it brings in those events")
               for x in lines), lines
    git(b.root, "remote", "set-url", "origin", str(net.tmp / "gone.git"))
    r = b("release", "--id", "G001", "--note", "offline call")  # needs the remote: refused
    assert r.code == 3 and "cannot be reached" in r.err, r
    r = b("status")
    assert r.code == 0 and "cannot be reached" in r.out, r


# Durability ##################################################################


def reject_pushes(remote, times):
    """A pre-receive hook on the remote that refuses the next `times` pushes (-1: all)."""
    hook = Path(remote) / "hooks" / "pre-receive"
    counter = Path(remote) / "rejects-left"
    counter.write_text(str(times))
    hook.write_text("#!/bin/sh\nn=$(cat '%s')\n[ \"$n\" = 0 ] && exit 0\n"
                    "[ \"$n\" -gt 0 ] && echo $((n - 1)) > '%s'\necho busy >&2\nexit 1\n"
                    % (counter, counter))
    hook.chmod(0o755)
    return hook


class Races(list):
    stopped = False

    def stop(self):
        self.stopped = True


def others_push_first(net, monkeypatch, other, times=None):
    """Before each of this process's next `times` pushes (None: all, until `raced.stop()`), the
    clone `other` (a real process) claims a story and publishes it: real races, lost."""
    sharing = engine.room("sharing")
    real = sharing.event_commits
    raced = Races()

    def another_writer_first(store, cfg, lines, *rest):
        if not raced.stopped and (times is None or len(raced) < times):
            raced.append(run_cli("next", "--agent", f"y{len(raced)}", cwd=other.root,
                                 env=cli_env(net)))
            assert raced[-1].code == 0, raced[-1]
        return real(store, cfg, lines, *rest)
    monkeypatch.setattr(sharing, "event_commits", another_writer_first)
    return raced


def test_pushes_lost_to_other_writers_several_times_in_a_row_still_publish_every_event(
        net, monkeypatch):
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 6, "--parallel")
    assert a("next", "--agent", "x").code == 0
    assert b("sync").code == 0
    raced = others_push_first(net, monkeypatch, b, times=3)
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e", "--agent", "x")
    assert r.code == 0 and "not published" not in r.err, r
    assert len(raced) == 3
    assert net.remote_lines(plan_id) == [x + b"\n" for x in ledger_lines(a)]
    starts = [json.loads(x)["agent"] for x in ledger_lines(a) if b'"story_started"' in x]
    assert starts == ["x", "y0", "y1", "y2"] and not (a.dir / "rejected.jsonl").exists()


def test_a_push_the_remote_refuses_says_gits_reason_at_once_and_keeps_the_work(net):
    a = net.clone("a")
    plan_id = create(a, 3, "--parallel")
    assert a("next", "--agent", "x").code == 0
    hook = reject_pushes(net.remote, -1)
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "done offline",
          "--agent", "x")
    assert r.code == 0 and "not published" in r.err and "pre-receive hook declined" in r.err, r
    assert "busy" in r.err and "cannot be reached" not in r.err, r
    assert r.err.lower().count("the events are kept here") == 1, r  # said once
    assert (net.remote / "rejects-left").read_text().strip() == "-1"  # one push, not retried
    assert a("status", "--json").json["share"]["ahead"] == 1
    before = state_files(a.dir)
    r = a("next", "--agent", "x", "--json")
    assert r.code == 1 and r.json["error"]["code"] == "push_refused", r
    assert "busy" in r.json["error"]["message"]
    assert state_files(a.dir) == before  # the claim the remote refused is not kept
    hook.unlink()
    assert a("sync").code == 0
    assert net.remote_lines(plan_id) == [x + b"\n" for x in ledger_lines(a)]


def test_contention_that_outlasts_the_wait_is_exit_1_try_again_never_exit_3(net, monkeypatch):
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 8, "--parallel")
    assert b("sync").code == 0
    monkeypatch.setenv("FABLIZE_SHARE_WAIT", "0")  # give up at the first lost push
    raced = others_push_first(net, monkeypatch, b)
    before = state_files(a.dir)
    r = a("next", "--agent", "x", "--json")
    assert r.code == 1 and r.json["error"]["code"] == "push_contended", r
    assert "try again" in r.json["error"]["message"]
    assert state_files(a.dir) == before  # the claim that never got through is not kept
    monkeypatch.delenv("FABLIZE_SHARE_WAIT")
    raced.stop()
    r = a("next", "--agent", "x")
    assert r.code == 0, r
    assert net.remote_lines(plan_id) == [x + b"\n" for x in ledger_lines(a)]


def test_remote_dying_mid_push_keeps_the_event_and_sync_publishes_it(net):
    a = net.clone("a")
    plan_id = create(a, 2)
    assert a("next").code == 0
    hook = Path(net.remote) / "hooks" / "pre-receive"
    hook.write_text("#!/bin/sh\nkill -9 $PPID\n")  # receive-pack dies after the fetch worked
    hook.chmod(0o755)
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e")
    assert r.code == 0 and "not published" in r.err, r
    before = state_files(a.dir)
    r = a("next")
    assert r.code == 3 and "cannot be reached" in r.err, r
    assert state_files(a.dir) == before
    hook.unlink()
    assert a("sync").code == 0
    assert net.remote_lines(plan_id) == [x + b"\n" for x in ledger_lines(a)]


def test_kill_between_local_append_and_push_is_published_by_the_next_sync(net):
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 3, "--parallel")
    assert b("sync").code == 0
    r = run_cli("next", "--agent", "x", cwd=a.root,
                env=dict(cli_env(net), FABLIZE_CRASH_AT="after-snapshot-replace"))
    assert r.code == -9, r
    assert len(net.remote_lines(plan_id)) == 1
    assert b("next", "--agent", "y").code == 0  # b takes G001 meanwhile
    r = a("sync")  # a's unpublished claim on G001 is no longer legal: set aside, said
    assert r.code == 0 and "no longer legal" in r.err and "rejected.jsonl" in r.err, r
    assert [x + b"\n" for x in ledger_lines(a)] == net.remote_lines(plan_id)
    assert json.loads((a.dir / "rejected.jsonl").read_text())["event"]["agent"] == "x"
    r = a("next", "--agent", "x")
    assert r.code == 0 and "handoff — G002" in r.out, r
    assert b("sync").code == 0 and ledger_lines(a) == ledger_lines(b)


def test_kill_after_the_push_before_the_record_does_not_publish_twice(net):
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 2)
    r = run_cli("next", cwd=a.root, env=dict(cli_env(net), FABLIZE_CRASH_AT="after-push"))
    assert r.code == -9, r
    assert len(net.remote_lines(plan_id)) == 2  # it landed; share.json does not know yet
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e")
    assert r.code == 0, r
    assert net.remote_lines(plan_id) == [x + b"\n" for x in ledger_lines(a)]
    assert b("sync").code == 0 and ledger_lines(b) == ledger_lines(a)


def test_a_clone_offline_for_many_events_rebases_its_work_on_return(net):
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 12, "--parallel")
    assert a("next", "--agent", "x").code == 0
    assert b("sync").code == 0
    git(a.root, "remote", "set-url", "origin", str(net.tmp / "gone.git"))
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "offline work",
          "--agent", "x", "--run", "--verify-cmd", "echo offline-run")
    assert r.code == 0 and "not published" in r.err, r
    for sid in ("G%03d" % i for i in range(2, 12)):
        assert b("next", "--agent", "y").code == 0
        assert b("checkpoint", "--id", sid, "--status", "complete", "--evidence", "e",
                 "--agent", "y", "--run", "--verify-cmd", f"echo {sid}").code == 0
    git(a.root, "remote", "set-url", "origin", str(net.remote))
    r = a("sync", "--json")
    assert r.code == 0 and "set aside" not in r.err, r
    # pulled: 10 × start, run, checkpoint; published: its run and checkpoint
    assert (r.json["share"]["pulled"], r.json["share"]["published"]) == (30, 2)
    assert b("sync").code == 0
    assert ledger_lines(a) == ledger_lines(b) and net.remote_lines(plan_id) == \
        [x + b"\n" for x in ledger_lines(a)]
    for clone in (a, b):
        report = audit_ok(clone, "--require-logs")
        assert report["missing_logs"] == 0 and report["done"] == 11
    story = b("status", "--json").json["stories"][0]
    assert story["status"] == "complete" and story["evidence"] == "offline work"


def test_a_rewritten_remote_history_is_damage_not_something_to_merge(net):
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 2)
    assert b("sync").code == 0
    assert a("next").code == 0
    ref = "refs/fablize/plans/" + plan_id
    first = git(net.remote, "rev-list", "--max-parents=0", ref).strip()
    assert b("sync").code == 0
    forged = ledger_lines(b)[1].replace(b'"event":"story_started"', b'"event":"story_started" ')
    blob = subprocess.run(["git", "-C", str(net.remote), "hash-object", "-w", "--stdin"],
                          input=forged + b"\n", capture_output=True).stdout.decode().strip()
    tree = subprocess.run(["git", "-C", str(net.remote), "mktree"],
                          input=f"100644 blob {blob}\tevent.jsonl\n".encode(),
                          capture_output=True).stdout.decode().strip()
    commit = git(net.remote, "commit-tree", tree, "-p", first, "-m", "forged").strip()
    git(net.remote, "update-ref", ref, commit)  # history rewritten on the remote by force
    r = b("sync")
    assert r.code == 3 and "rewritten" in r.err, r


def test_a_remote_rewound_is_restored_by_the_clones_that_hold_more(net):
    """The issue's reproducer: three clones hold five events; the remote's ref moves back to
    event 2 (a force-push, a server restored from a backup); a fresh clone follows the shorter
    history. The first clone that syncs republishes what the remote lost and says so in one
    line; every clone, and the fresh one, then sees the whole history; nothing is exit 3."""
    a, b, c = net.clone("a"), net.clone("b"), net.clone("c")
    plan_id = create(a, 3, "--parallel")
    assert a("next", "--agent", "x").code == 0
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "done",
             "--agent", "x").code == 0
    assert a("next", "--agent", "x").code == 0
    assert b("sync").code == 0 and c("sync").code == 0
    full = ledger_lines(a)
    assert len(full) == 4 and ledger_lines(b) == full == ledger_lines(c)
    ref = "refs/fablize/plans/" + plan_id
    back = git(net.remote, "rev-list", "--first-parent", ref).split()[2]  # event 2's commit
    git(net.remote, "update-ref", ref, back)  # the remote moved back by force
    fresh = net.clone("fresh")
    assert fresh("sync").code == 0 and len(ledger_lines(fresh)) == 2  # follows the shorter
    r = b("sync")
    assert r.code == 0, r
    said = [x for x in r.err.splitlines() if "restored" in x]
    assert said == [f"fablize: warning: origin had lost the last 2 events of plan {plan_id} "
                    "(its ref had moved back); restored from this clone."], r
    assert [x.rstrip(b"\n") for x in net.remote_lines(plan_id)] == full
    for clone in (a, c, fresh):  # nothing worse than events restored: a plain pull
        r = clone("sync")
        assert r.code == 0 and "rewritten" not in r.err and "restored" not in r.err, r
        assert ledger_lines(clone) == full
        audit_ok(clone)
    status = fresh("status", "--json").json
    assert [x["status"] for x in status["stories"]] == ["complete", "in_progress", "pending"]


def test_a_fork_of_a_shared_plan_stays_exit_3_with_the_command_that_shows_both(net):
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 3, "--parallel")
    assert b("sync").code == 0
    assert a("next", "--agent", "x").code == 0  # published: event 2
    ref = "refs/fablize/plans/" + plan_id
    first = git(net.remote, "rev-list", "--max-parents=0", ref).strip()
    git(net.remote, "update-ref", ref, first)  # moved back to event 1...
    fresh = net.clone("fresh")
    assert fresh("sync").code == 0
    assert fresh("next", "--agent", "y").code == 0  # ...and another history went on from it
    before = state_files(a.dir)
    r = a("--json", "sync")
    assert r.code == 3 and r.json["error"]["code"] == "remote_history_rewritten", r
    assert "a fork" in r.json["error"]["message"], r
    assert "git push --force origin" in r.json["error"]["message"], r
    show = r.json["error"]["commands"][0]
    assert show.startswith("git log --oneline --graph ")
    assert subprocess.run(show, shell=True, cwd=str(a.root), capture_output=True,
                          timeout=120).returncode == 0  # the named command works from there
    assert state_files(a.dir) == before


# Audit on a shared plan ######################################################


def test_audit_remote_checks_the_plan_as_the_remote_holds_it_with_a_pin(net):
    a = net.clone("a")
    plan_id = create(a, 2)
    assert a("next").code == 0
    pin = audit_ok(a)["head"]
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
             "--run", "--verify-cmd", "echo x").code == 0
    ci = net.clone("ci")  # a fresh checkout: no .fablize at all
    report = audit_ok(ci, "--remote", "origin", "--since", pin, "--require-logs")
    assert report["event_count"] == len(ledger_lines(a)) and report["missing_logs"] == 0
    r = ci("audit", "--remote", "origin", "--since", "1:" + "0" * 64)
    assert r.code == 3 and "history_rewritten" in ci("audit", "--remote", "origin", "--since",
                                                      "1:" + "0" * 64, "--json").out
    assert not (ci.root / ".fablize").exists()
    assert plan_id


def pinned_on_main(net, *extra):
    """A shared plan with a scope, its pin committed on main by `sync --pin` and pushed; then
    more work on the remote. Returns (the clone that works, the plan id, the pin)."""
    a = net.clone("a")
    (a.root / "README").write_text("x\n")
    git(a.root, "add", "README")
    git(a.root, "commit", "-q", "-m", "start")
    git(a.root, "push", "-q", "origin", "HEAD:main")
    plan_id = create(a, 2, "--scope", "src/", *extra)
    assert a("next").code == 0
    r = a("sync", "--pin")
    assert r.code == 0 and "pinned" in r.out and "commit it with this branch" in r.out, r
    pin = json.loads((a.dir / "pin.json").read_text())
    assert pin["plan_id"] == plan_id and pin["scope"] == ["src/"]
    assert a("sync", "--pin", "--json").json["pin"] == pin  # nothing new: the same pin
    assert git(a.root, "status", "--porcelain", "--untracked-files=all").split() == [
        "??", ".fablize/pin.json"]  # the pin is the one file of a shared plan git sees
    git(a.root, "add", ".fablize/pin.json")
    git(a.root, "commit", "-q", "-m", "pin the plan")
    git(a.root, "push", "-q", "origin", "HEAD:main")
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
             "--run", "--verify-cmd", "echo x").code == 0
    return a, plan_id, pin["pin"]


def test_a_shared_plan_is_pinned_by_the_pin_json_committed_on_the_base(net):
    a, plan_id, pin = pinned_on_main(net)
    ci = net.clone("ci")  # CI names the plan; the pin and the scope come from main's pin.json
    r = ci("audit", "--remote", "origin", "--plan", plan_id, "--base", "origin/main", "--json")
    assert r.code == 0, r
    trust = r.json["trust"]
    assert trust["pin"]["pin"] == pin and not trust["new_plan"]
    assert trust["scope"] == {"patterns": ["src/"], "from": "the plan on origin/main"}
    assert r.json["snapshot"] == "none on a remote (its ledger is the whole of it)"
    assert "pin: " + pin[:40] in ci("audit", "--remote", "origin", "--base", "origin/main").out
    # a pull request's own pin.json moves nothing: only the base's copy is read
    (ci.dir).mkdir(exist_ok=True)
    (ci.dir / "pin.json").write_text(json.dumps({"plan_id": plan_id, "pin": "1:" + "0" * 64}))
    assert ci("audit", "--remote", "origin", "--base", "origin/main").code == 0


def test_sync_pin_writes_no_pin_while_the_remote_lacks_local_events(net):
    a = net.clone("a")
    create(a, 2)
    assert a("next").code == 0
    git(a.root, "remote", "set-url", "origin", str(net.tmp / "gone.git"))
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e").code == 0
    r = a("sync", "--pin")  # git's reason, not its advice
    assert r.code == 3 and "does not appear to be a git repository" in r.err, r
    assert not (a.dir / "pin.json").exists()
    git(a.root, "remote", "set-url", "origin", str(net.remote))
    assert a("sync", "--pin").code == 0 and (a.dir / "pin.json").exists()


def test_a_shared_plan_whose_base_holds_no_pin_is_new_and_said_so(net):
    a = net.clone("a")
    (a.root / "README").write_text("x\n")
    git(a.root, "add", "README")
    git(a.root, "commit", "-q", "-m", "start")
    git(a.root, "push", "-q", "origin", "HEAD:main")
    plan_id = create(a, 2)
    ci = net.clone("ci")
    r = ci("audit", "--remote", "origin", "--plan", plan_id, "--base", "origin/main")
    assert r.code == 1, r
    assert "✗ new_plan: origin/main holds no plan to pin it to: all of this plan is new" in r.out
    assert "created after the pin" not in r.err + r.out


def test_a_remote_history_rewritten_under_the_base_pin_fails_the_audit(net):
    a, plan_id, pin = pinned_on_main(net)
    ref = "refs/fablize/plans/" + plan_id
    first = git(net.remote, "rev-list", "--max-parents=0", ref).strip()
    git(net.remote, "update-ref", ref, first)  # the remote's history cut back before the pin
    ci = net.clone("ci")
    before = sorted(p.name for p in ci.root.iterdir())
    r = ci("audit", "--remote", "origin", "--plan", plan_id, "--base", "origin/main", "--json")
    assert r.code == 3 and r.json["error"]["code"] == "history_rewritten", r
    assert sorted(p.name for p in ci.root.iterdir()) == before


def test_a_fresh_clone_of_a_repository_pinning_a_shared_plan_is_told_to_sync(net):
    pinned_on_main(net)
    fresh = net.clone("fresh")  # main holds .fablize/pin.json, and nothing else of the plan
    git(fresh.root, "checkout", "-q", "main")
    assert (fresh.dir / "pin.json").exists() and not (fresh.dir / "ledger.jsonl").exists()
    r = fresh("status")
    assert r.code == 1 and r.err.startswith("fablize: no plan — run `create` first"), r
    assert "this repository pins a shared plan" in r.err.splitlines()[0], r
    assert r.err.splitlines()[1].strip().endswith(" sync"), r
    assert fresh("sync").code == 0 and fresh("status").code == 0


def test_a_fresh_clone_of_a_shared_plan_is_told_the_remote_shares_one_and_to_sync(net):
    create(net.clone("alice"), 2)
    fresh = net.clone("fresh")  # main holds nothing of the plan: it lives in refs/fablize/
    assert not fresh.dir.exists()
    r = fresh("next")
    assert r.code == 1 and r.err.startswith("fablize: no plan — run `create` first"), r
    assert "origin shares a plan this clone has not brought in yet" in r.err, r
    assert r.err.splitlines()[1].strip().endswith(" sync") and len(r.err.splitlines()) == 2, r
    assert fresh("--json", "status").json["error"]["commands"][0].endswith(" sync")
    assert fresh("sync").code == 0 and fresh("status").code == 0


def test_a_base_pin_of_another_plan_pins_nothing_and_a_broken_one_is_damage(net):
    a, plan_id, pin = pinned_on_main(net)
    (a.dir / "pin.json").write_text(json.dumps({"plan_id": "P" + "0" * 12, "pin": pin}) + "\n")
    git(a.root, "commit", "-q", "-am", "a pin of another plan")
    git(a.root, "push", "-q", "origin", "HEAD:main")
    ci = net.clone("ci")
    args = ("audit", "--remote", "origin", "--plan", plan_id, "--base", "origin/main")
    r = ci(*args, "--json")
    assert r.code == 1 and "new_plan" in [f["code"] for f in r.json["failures"]], r
    assert "it pins plan P000000000000" in ci(*args).out
    assert "the pin on origin/main is of plan P000000000000: all of this plan is new" in ci(
        *args).err
    assert ci(*args, "--allow-new-plan").code == 0
    (a.dir / "pin.json").write_text("{not json\n")
    git(a.root, "commit", "-q", "-am", "a broken pin")
    git(a.root, "push", "-q", "origin", "HEAD:main")
    git(ci.root, "fetch", "-q", "origin")
    r = ci(*args)
    assert r.code == 3 and "is not a fablize pin (`sync --pin` writes one)" in r.err, r


# The bar: 4 clones x 4 agents, one 40-story parallel plan ####################

AGENT = r"""
import json, subprocess, sys, time
engine, name = json.loads(sys.argv[1]), sys.argv[2]
def run(*args):
    p = subprocess.run([*engine, "--json", *args], capture_output=True, text=True)
    return json.loads(p.stdout)
done = []
log = open(name + ".log", "w")
for _ in range(400):
    r = run("next", "--agent", name)
    if r["ok"] and r.get("complete"):
        break
    if not r["ok"]:
        code = r["error"]["code"]
        log.write(json.dumps(r) + "\n"); log.flush()
        if code in ("nothing_ready", "claim_lost", "awaiting_review", "push_contended", "busy"):
            time.sleep(0.05 if code == "claim_lost" else 0.5)
            continue
        print(json.dumps(r)); sys.exit(1)
    log.write(json.dumps(r) + "\n")
    sid = r["story"]["id"]
    args = ["checkpoint", "--id", sid, "--status", "complete", "--evidence", f"{name} did {sid}",
            "--agent", name]
    if r["story"].get("final") or sid == "G040":
        args += ["--verify-cmd", "true", "--verify-evidence", "ok"]
    c = run(*args)
    if not c["ok"]:
        print(json.dumps(c)); sys.exit(1)
    done.append(sid)
print(json.dumps(done))
"""


@pytest.mark.slow
def test_bar_four_clones_four_agents_each_complete_a_40_story_parallel_plan(net):
    """The sharing bar, and the suite's slowest test (~20 s): 16 agent processes in 4 clones,
    each looping next → checkpoint on one 40-story parallel plan through a real bare remote at
    once. It proves what no two-clone test can: under real contention every story is claimed
    once and completed once, no event is lost, every clone and a fresh one audit the same
    complete history, and lost claims stay bounded (by events, not seconds)."""
    a = net.clone("c0")
    plan_id = create(a, 40, "--parallel")
    clones = [a] + [net.clone(f"c{i}") for i in range(1, 4)]
    for c in clones[1:]:
        assert c("sync").code == 0
    agent = net.tmp / "agent.py"
    agent.write_text(AGENT)
    env = dict(os.environ, **cli_env(net), FABLIZE_LOCK_TIMEOUT="60")
    procs = [(c, subprocess.Popen([sys.executable, str(agent), json.dumps(ENGINE), f"c{i}-a{j}"],
                                  cwd=str(c.root), env=env, stdout=subprocess.PIPE))
             for i, c in enumerate(clones) for j in range(4)]
    results = []
    for _, p in procs:
        out, _ = p.communicate(timeout=900)  # a hang's guard: an agent tries 400 times at most
        assert p.returncode == 0, out
        results.append(json.loads(out))
    done = [sid for r in results for sid in r]
    assert sorted(done) == [f"G{i:03d}" for i in range(1, 41)]  # each story completed once
    events = [json.loads(x) for x in net.remote_lines(plan_id)]
    starts = [e["id"] for e in events if e["event"] == "story_started"]
    assert sorted(starts) == sorted(set(starts)) == sorted(done)  # no story claimed twice
    completions = [e["id"] for e in events if e["event"] == "checkpoint"]
    assert sorted(completions) == sorted(done)  # no event lost
    for c in clones:
        assert c("sync").code == 0
        report = audit_ok(c, "--require-complete")
        assert report["event_count"] == len(events)
    fresh = net.clone("fresh")
    assert fresh("sync").code == 0
    audit_ok(fresh, "--require-complete")
    answers = [json.loads(x) for c in clones for log in c.root.glob("c*-a*.log")
               for x in log.read_text().splitlines()]
    # bounded by events, not seconds: an agent that finds nothing ready waits its turn, and
    # one that lost a claim or the push lost it to a story another agent took (4–7 here)
    lost = [r["error"]["code"] for r in answers if not r["ok"] and
            r["error"]["code"] != "nothing_ready"]
    assert len(lost) <= 2 * 40, lost


def test_bench_measures_a_shared_plan_command_against_a_local_bare_remote(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import bench
    results = bench.shared_plan_cost(str(tmp_path), 1)
    assert set(results) == {"local", "shared"} and all(x > 0 for r in results.values() for x in r)


def test_a_damaged_share_record_is_exit_3_not_a_guess(net):
    a = net.clone("a")
    create(a, 2)
    share = a.dir / "share.json"
    record = json.loads(share.read_text())
    for bad in ("{", json.dumps(dict(record, plan_id="x:refs/heads/main"))):
        share.write_text(bad)
        r = assert_refused(a, ["next"], 3, "share.json is not a fablize share record")
        assert "Traceback" not in r.err


def test_a_bare_audit_remote_names_the_plan_it_read_and_says_it_is_unpinned(net):
    """Issue 34: without --plan or --base, the tree under audit (the pull request's) chose the
    plan: audit says which, and how, and that nothing pins it."""
    a, plan_id, _ = pinned_on_main(net)
    r = a("audit", "--remote", "origin")
    assert r.code == 0, r
    assert (f"shared plan: {plan_id} as origin holds it, named by this tree's share.json — "
            "unpinned") in r.out, r
    ci = net.clone("ci")
    r = ci("audit", "--remote", "origin", "--json")
    assert r.json["remote_plan"] == {"plan_id": plan_id, "remote": "origin", "pinned": False,
                                     "named_by": "the only plan origin shares"}, r
    r = ci("audit", "--remote", "origin", "--base", "origin/main")
    assert r.code == 0 and "named by the pin on origin/main" in r.out, r
    assert "unpinned" not in r.out
    r = ci("audit", "--remote", "origin", "--plan", plan_id, "--json")
    assert r.json["remote_plan"]["named_by"] == "--plan" and not r.json["remote_plan"]["pinned"]


def test_sharing_a_plan_changes_no_committed_file_and_another_clones_pull_stays_clean(net):
    """The issue's reproducer: main commits .fablize/.gitignore; alice shares a plan, commits
    with `git commit -a` and pushes; bob, who shares the same plan, pulls. Nothing the branch
    commits was edited, so the pull neither aborts nor brings a change to it."""
    a = net.clone("alice")
    a.dir.mkdir()
    (a.dir / ".gitignore").write_text(engine.STATE_GITIGNORE)
    (a.root / "README").write_text("x\n")
    git(a.root, "add", "README", ".fablize/.gitignore")
    git(a.root, "commit", "-q", "-m", "start")
    git(a.root, "push", "-q", "origin", "HEAD:main")
    b = net.clone("bob")
    git(b.root, "checkout", "-q", "main")
    r = a("create", "--brief", "shared plan", "--goal", "S1::o", "--goal", "S2::p",
          "--remote", "origin")
    assert r.code == 0 and "no committed file changes" in r.out, r
    assert r.out.count("info/exclude") == 1, r  # said once
    assert (a.dir / ".gitignore").read_text() == engine.STATE_GITIGNORE  # left as committed
    assert git(a.root, "status", "--porcelain", "--untracked-files=all").split() == []
    (a.root / "README").write_text("y\n")
    git(a.root, "commit", "-q", "-a", "-m", "work")
    assert git(a.root, "show", "--name-only", "--format=", "HEAD").split() == ["README"]
    git(a.root, "push", "-q", "origin", "HEAD:main")
    assert b("sync").code == 0 and b("next").code == 0
    git(b.root, "pull", "-q", "origin", "main")  # raises if git aborts
    assert (b.root / "README").read_text() == "y\n"
    assert git(b.root, "status", "--porcelain", "--untracked-files=all").split() == []
    assert a("share", "--remote", "origin").out.count("info/exclude") == 0  # once is enough


def test_a_plan_shared_from_a_worktree_finds_the_repository_through_its_git_file(
        net, monkeypatch):
    """A worktree's .git is a file naming its git dir, whose commondir names the repository's
    (storage.git_dirs): the exclusion goes to the repository's info/exclude, where git reads it
    for every worktree, and the commits are written into the repository's objects."""
    a = net.clone("a")
    (a.root / "README").write_text("x\n")
    git(a.root, "add", "README")
    git(a.root, "commit", "-q", "-m", "start")
    git(a.root, "worktree", "add", "-q", str(net.tmp / "wt"))
    w = net.at(net.tmp / "wt")
    assert w("create", "--brief", "b", "--goal", "x::y", "--goal", "z::w",
             "--remote", "origin").code == 0
    assert "/.fablize/*" in (a.root / ".git" / "info" / "exclude").read_text()
    assert git(w.root, "status", "--porcelain", "--untracked-files=all").split() == []
    written = []
    room = engine.room("sharing")
    put = room.Objects.put
    monkeypatch.setattr(room.Objects, "put", lambda self, *a: written.append(self.dir) or put(
        self, *a))
    assert w("next").code == 0
    assert set(written) == {os.path.realpath(a.root / ".git" / "objects")}
    plan_id = w("status", "--json").json["plan_id"]
    assert net.remote_lines(plan_id) == [x + b"\n" for x in ledger_lines(w)]


def test_a_damaged_share_record_names_share_which_reconnects_the_clone(net):
    """The issue's reproducer: a damaged share.json used to say `sync` after removing it, which
    answered "this plan is local". The step named now is `share --remote origin`, and it
    works from where the user stands: the plan whole, shared again, nothing published twice."""
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 2)
    assert a("next").code == 0
    (a.dir / "share.json").write_text("garbage\n")
    r = a("--json", "status")
    assert r.code == 3 and r.json["error"]["code"] == "bad_share", r
    assert [c.endswith("goals.py share --remote origin") for c in r.json["error"]["commands"]
            ] == [True], r
    r = a("share", "--remote", "origin")
    assert r.code == 0 and "kept as share.json.broken" in r.err, r
    assert (a.dir / "share.json.broken").read_text() == "garbage\n"
    assert a("status").code == 0 and "in sync" in a("status").out
    assert [x.rstrip(b"\n") for x in net.remote_lines(plan_id)] == ledger_lines(a)
    assert b("sync").code == 0 and ledger_lines(b) == ledger_lines(a)
