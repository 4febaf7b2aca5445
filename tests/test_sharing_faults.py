"""Shared plans under faults: kills at every step of a sync, events set aside, plans replaced,
deleted or rewritten on the remote, contention, corrupt remotes, locks left by killed git
processes. Real git throughout: bare remotes as a path, as file:// and behind a real
`git daemon`, real clones, real processes for every kill."""

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import engine, group_members, run_cli, state_files
from test_sharing import audit_ok, cli_env, create, git, ledger_lines, reject_pushes

pytest_plugins = ["test_sharing"]  # its `net` fixture: a bare remote and its clones

CRASH = -9  # a process FABLIZE_CRASH_AT killed


def offline(fab, net):
    git(fab.root, "remote", "set-url", "origin", str(net.tmp / "gone.git"))


def online(fab, url):
    git(fab.root, "remote", "set-url", "origin", str(url))


def kill_at(net, fab, point, *args):
    """The command run as a real process that kills itself at the crash point `point`."""
    return run_cli(*args, cwd=fab.root, env=dict(cli_env(net), FABLIZE_CRASH_AT=point))


def events_of(lines):
    return [(e["event"], e.get("id"), e.get("agent")) for e in map(json.loads, lines)]


def litter(state_dir):
    """What a finished sync never leaves behind: a journal, a stage folder, temp files."""
    return sorted(p.name for p in Path(state_dir).iterdir()
                  if p.name.startswith(("sync.", "share.json.tmp", "rejected.pending.json.tmp")))


# 1. A sync killed at every step loses and hides nothing ######################################

# every crash point a `sync` that rebases passes, in order: the push of the rebase (worked out
# in memory), then its journal's write (the engine's write_atomic points), the journal written,
# the ledger swap (the engine's), and each of the journal's steps
SYNC_CRASH_POINTS = ["after-push", "after-snapshot-temp", "before-snapshot-replace",
                     "after-snapshot-replace", "sync-journal-written", "before-ledger-write",
                     "after-ledger-write", "after-ledger-fsync", "sync-ledger-swapped",
                     "sync-logs-placed", "sync-set-aside", "sync-share-saved"]


def offline_work_against_a_colliding_remote(net):
    """a: a run and a checkpoint made offline, then a claim a kill kept from being published;
    b meanwhile: a run of the same story at the same seq (so its log has the name of a's), a
    claim of the story a claimed, and its completion. a's next sync must rebase: keep its run
    (its log renamed), keep its checkpoint, set its claim aside."""
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 4, "--parallel")
    assert a("next", "--agent", "x").code == 0  # event 2
    assert b("sync").code == 0
    offline(a, net)
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "offline",
          "--agent", "x", "--run", "--verify-cmd", "echo a-log")  # events 3 (run), 4
    assert r.code == 0 and "not published" in r.err, r
    online(a, net.remote)
    r = kill_at(net, a, "after-snapshot-replace", "next", "--agent", "x")  # event 5: G002
    assert r.code == CRASH, r
    assert b("verify", "--id", "G001", "--verify-cmd", "echo b-verify").code == 0  # 3: runs/3-G001
    assert b("next", "--agent", "y").code == 0  # 4: G002
    assert b("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "b did it",
             "--agent", "y").code == 0  # 5
    return a, b, plan_id


def assert_nothing_lost(net, a, b, plan_id, said):
    """Every clone and a fresh one agree with the remote and audit clean (--require-logs too);
    a's run and checkpoint are published with the run's log, its claim is set aside once and
    was said."""
    assert "G002" in said and ("no longer legal" in said or "not acknowledged" in said), said
    assert b("sync").code == 0
    remote = net.remote_lines(plan_id)
    assert [x + b"\n" for x in ledger_lines(a)] == remote == [x + b"\n" for x in ledger_lines(b)]
    assert events_of(remote) == [
        ("plan_created", None, None), ("story_started", "G001", "x"),
        ("verify_run", "G001", None), ("story_started", "G002", "y"), ("checkpoint", "G002", "y"),
        ("verify_run", "G001", None), ("checkpoint", "G001", "x")]
    fresh = net.clone("fresh")
    assert fresh("sync").code == 0
    for clone in (a, b, fresh):
        assert audit_ok(clone, "--require-logs")["missing_logs"] == 0
    assert audit_ok(fresh, "--remote", "origin", "--require-logs")["missing_logs"] == 0
    assert (a.dir / "runs" / "3-G001.log").read_text() == "b-verify\n"
    assert (a.dir / "runs" / "6-G001.log").read_text() == "a-log\n"
    assert (fresh.dir / "runs" / "6-G001.log").read_text() == "a-log\n"
    rejected = [json.loads(x) for x in (a.dir / "rejected.jsonl").read_text().splitlines()]
    assert [(r["event"]["event"], r["event"]["id"], r["event"]["agent"]) for r in rejected] == \
        [("story_started", "G002", "x")]
    assert litter(a.dir) == [] and not list((a.dir / "runs").glob(".rebase-*"))


@pytest.mark.parametrize("point", SYNC_CRASH_POINTS)
def test_a_sync_killed_at_any_step_loses_no_event_and_no_log_and_the_next_command_finishes_it(
        net, point):
    a, b, plan_id = offline_work_against_a_colliding_remote(net)
    r = kill_at(net, a, point, "sync")
    assert r.code == CRASH, (point, r)
    said = r.err
    r = a("status")  # any command: an interrupted journal is finished before it starts
    assert r.code == 0, r
    said += r.err
    r = a("sync")
    assert r.code == 0, r
    assert_nothing_lost(net, a, b, plan_id, said + r.err)


@pytest.mark.parametrize("point", ["sync-journal-written", "sync-ledger-swapped"])
def test_a_sync_killed_inside_the_ledger_swap_without_a_snapshot_is_finished(net, point):
    """The engine's swap removes the snapshot before its rename: a kill there leaves the old
    ledger (or, after the rename, the new one) and no goals.json."""
    a, b, plan_id = offline_work_against_a_colliding_remote(net)
    assert kill_at(net, a, point, "sync").code == CRASH
    (a.dir / "goals.json").unlink()
    r = a("sync")
    assert r.code == 0, r
    assert_nothing_lost(net, a, b, plan_id, r.err)


@pytest.mark.parametrize("point", ["after-snapshot-temp", "before-snapshot-replace",
                                   "before-ledger-write", "after-ledger-write",
                                   "after-ledger-fsync"])
def test_a_sync_that_only_pulls_killed_at_any_step_is_finished_by_the_next_command(net, point):
    """No local event waits: the remote's events and their logs are appended (the run log is
    written first, by write_atomic, then the ledger line, then the snapshot)."""
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 2)
    assert b("sync").code == 0
    assert a("next").code == 0
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
             "--run", "--verify-cmd", "echo pulled").code == 0
    r = kill_at(net, b, point, "sync")
    assert r.code == CRASH, (point, r)
    r = b("sync")
    assert r.code == 0, r
    assert [x + b"\n" for x in ledger_lines(b)] == net.remote_lines(plan_id)
    assert (b.dir / "runs" / "3-G001.log").read_text() == "pulled\n"
    assert not list((b.dir / "runs").glob("*.local*"))  # a log written again is no stranger
    assert audit_ok(b, "--require-logs")["missing_logs"] == 0


def test_a_run_log_an_older_sync_stranded_in_runs_rebase_is_put_back_and_published(net):
    """fablize before this fix moved unpublished logs to runs/.rebase-<seq>-* and a kill left
    them there; the next sync puts such a log back (its digest matches) and publishes it."""
    a = net.clone("a")
    plan_id = create(a, 2)
    assert a("next").code == 0
    offline(a, net)
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
             "--run", "--verify-cmd", "echo stranded").code == 0
    log = a.dir / "runs" / "3-G001.log"
    log.rename(a.dir / "runs" / ".rebase-3-0badf00d")
    online(a, net.remote)
    r = a("sync")
    assert r.code == 0 and "put back runs/3-G001.log" in r.err, r
    assert log.read_text() == "stranded\n"
    fresh = net.clone("fresh")
    assert fresh("sync").code == 0
    assert audit_ok(fresh, "--remote", "origin", "--require-logs")["missing_logs"] == 0
    assert len(net.remote_lines(plan_id)) == 4


# 2. An event set aside is said at the time and on every command until acknowledged ###########


def test_an_event_set_aside_by_a_sync_whose_push_fails_is_said_then_and_until_acknowledged(net):
    a, b = net.clone("a"), net.clone("b")
    create(a, 4, "--parallel")
    assert a("next", "--agent", "x").code == 0
    assert b("sync").code == 0
    offline(a, net)
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
             "--agent", "x").code == 0
    online(a, net.remote)
    assert kill_at(net, a, "after-snapshot-replace", "next", "--agent", "x").code == CRASH
    assert b("next", "--agent", "y").code == 0  # G002, which a's unpublished claim holds
    hook = reject_pushes(net.remote, -1)
    r = a("sync")  # sets the claim aside, then the push of the checkpoint is refused
    assert r.code == 1 and "refused the push" in r.err, r
    assert "no longer legal" in r.err and "sync --acknowledge" in r.err, r
    hook.unlink()
    for args in (["status"], ["log"], ["sync"]):  # said again by every later command
        r = a(*args)
        assert r.code == 0 and "not acknowledged: story_started G002 by agent x" in r.err, r
        assert "sync --acknowledge" in r.err, r
    r = a("status", "--json")
    assert any("not acknowledged" in w for w in r.json["warnings"]), r
    r = a("sync", "--acknowledge", "--json")
    assert r.code == 0 and [e["id"] for e in r.json["share"]["acknowledged"]] == ["G002"], r
    r = a("status")
    assert r.code == 0 and "not acknowledged" not in r.err, r
    history = (a.dir / "rejected.jsonl").read_text().splitlines()
    assert [json.loads(x)["event"]["agent"] for x in history] == ["x"]  # kept, once


def test_a_claim_set_aside_is_acknowledged_by_that_agents_next_successful_claim(net):
    a, b = net.clone("a"), net.clone("b")
    create(a, 4, "--parallel")
    assert b("sync").code == 0
    assert kill_at(net, a, "after-snapshot-replace", "next", "--agent", "x").code == CRASH
    assert b("next", "--agent", "y").code == 0  # takes G001, which a's claim held
    r = a("sync")
    assert r.code == 0 and "no longer legal" in r.err, r
    r = a("status")
    assert "not acknowledged" in r.err and "agent x's next claim" in r.err, r
    r = a("next", "--agent", "z")  # another agent's claim acknowledges nothing of x's
    assert r.code == 0
    assert "not acknowledged" in a("status").err
    r = a("next", "--agent", "x")
    assert r.code == 0 and "handoff" in r.out, r
    assert "not acknowledged" not in a("status").err


# 3. Plans that change are seen everywhere ####################################################


def plan_refs(net):
    return sorted(git(net.remote, "for-each-ref", "--format=%(refname)",
                      "refs/fablize/plans/").split())


def test_create_force_on_one_clone_is_followed_by_every_other_clone_at_its_next_command(net):
    a, b = net.clone("a"), net.clone("b")
    old = create(a, 3, "--parallel")
    assert b("sync").code == 0
    assert b("next", "--agent", "y").code == 0  # G001
    offline(b, net)
    assert b("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "offline",
             "--agent", "y").code == 0  # never published: the plan is replaced meanwhile
    online(b, net.remote)
    assert a("sync").code == 0
    r = a("create", "--force", "--brief", "second", "--goal", "n1::o1", "--goal", "n2::o2")
    assert r.code == 0, r
    new = a("status", "--json").json["plan_id"]
    r = b("status")
    assert r.code == 0 and "was replaced on origin" in r.out and "in sync" not in r.out, r
    r = b("next", "--agent", "y")
    assert r.code == 0 and "handoff — G001 n1" in r.out, r
    assert f"plan {old} was replaced on origin by {new}" in r.err, r
    assert f"kept whole in archive/{old}/" in r.err, r
    assert "not published" in r.err or "no longer legal" in r.err, r  # its checkpoint, said
    assert b("status", "--json").json["plan_id"] == new
    archived = (b.dir / "archive" / old / "ledger.jsonl").read_bytes().splitlines()
    assert [x + b"\n" for x in archived] == net.remote_lines(old)  # the old plan, whole
    rejected = [json.loads(x) for x in (b.dir / "rejected.jsonl").read_text().splitlines()]
    # its offline checkpoint, and the claim `next` pushed first on the old plan
    assert [(x["event"]["event"], x["code"]) for x in rejected] == [
        ("checkpoint", "plan_replaced"), ("story_started", "plan_replaced")]
    assert a("sync").code == 0 and ledger_lines(a) == ledger_lines(b)
    for clone in (a, b):
        audit_ok(clone, "--require-logs")
    fresh = net.clone("fresh")
    r = fresh("sync")  # two plans on the remote, one of them replaced: the live one is taken
    assert r.code == 0 and new in r.out, r
    audit_ok(fresh, "--remote", "origin")
    r = fresh("audit", "--remote", "origin", "--plan", old, "--json")
    assert r.code == 0 and any(f"replaced by {new}" in w for w in r.json["warnings"]), r


def test_two_racing_replacements_leave_one_winner_and_one_clear_refusal(net):
    a, c = net.clone("a"), net.clone("c")
    old = create(a, 2)
    assert c("sync").code == 0
    procs = [subprocess.Popen(
        [*goals_cli(), "create", "--force", "--brief", f"by {fab.root.name}", "--goal", "p::q"],
        cwd=str(fab.root), env=clean_env(net), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for fab in (a, c)]
    results = [(p.wait(timeout=120), p.stderr.read().decode()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    loser = [err for code, err in results if code == 1][0]
    assert "first" in loser and "was not published" in loser and "archive/" in loser, loser
    refs = plan_refs(net)
    assert len(refs) == 2 and f"refs/fablize/plans/{old}" in refs, refs
    winner = a("status", "--json").json["plan_id"]
    assert c("status", "--json").json["plan_id"] == winner  # the loser follows the winner
    assert ledger_lines(a) == ledger_lines(c)
    fresh = net.clone("fresh")
    assert fresh("sync").code == 0 and fresh("status", "--json").json["plan_id"] == winner
    audit_ok(fresh, "--remote", "origin")


def test_a_replacement_made_on_a_stale_copy_is_refused_and_the_old_plan_is_current_again(net):
    a, b = net.clone("a"), net.clone("b")
    old = create(a, 3, "--parallel")
    assert b("sync").code == 0
    assert b("next", "--agent", "y").code == 0  # a has not seen it
    r = a("create", "--force", "--brief", "second", "--goal", "n::o")
    assert r.code == 1 and "moved on origin" in r.err and "create --force` again" in r.err, r
    status = a("status", "--json").json
    assert status["plan_id"] == old and status["stories"][0]["agent"] == "y"  # b's claim is here
    assert plan_refs(net) == [f"refs/fablize/plans/{old}"]
    assert [p.name for p in (a.dir / "archive").iterdir()] != []  # the refused plan is kept
    r = a("create", "--force", "--brief", "second", "--goal", "n::o")
    assert r.code == 0, r
    assert b("sync").code == 0 and b("status", "--json").json["brief"] == "second"
    audit_ok(b)


def test_a_plan_ref_deleted_on_the_remote_is_reported_never_in_sync(net):
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 2)
    assert b("sync").code == 0
    git(net.remote, "update-ref", "-d", f"refs/fablize/plans/{plan_id}")
    r = b("status")
    assert r.code == 0 and "deleted" in r.out and "in sync" not in r.out, r
    r = b("sync", "--json")
    assert r.code == 3 and r.json["error"]["code"] == "remote_history_rewritten", r
    assert "deleted" in r.json["error"]["message"] and "share --remote origin" in \
        r.json["error"]["message"]
    r = b("share", "--remote", "origin")  # the fix it names: publish it again
    assert r.code == 0, r
    assert net.remote_lines(plan_id) == [x + b"\n" for x in ledger_lines(b)]
    assert a("sync").code == 0 and "in sync" in a("status").out
    fresh = net.clone("fresh")
    assert fresh("sync").code == 0
    audit_ok(fresh, "--remote", "origin")


def test_a_plan_ref_wound_back_on_the_remote_is_never_in_sync_and_sync_restores_it(net):
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 2)
    assert a("next").code == 0
    assert b("sync").code == 0
    ref = f"refs/fablize/plans/{plan_id}"
    git(net.remote, "update-ref", ref, git(net.remote, "rev-parse", f"{ref}~1").strip())
    r = b("status")
    assert r.code == 0 and "moved back" in r.out and "in sync" not in r.out, r
    assert "`sync` restores the events it lost" in r.out, r
    r = b("sync")
    assert r.code == 0 and "restored from this clone" in r.err, r
    fresh = net.clone("fresh")
    assert fresh("sync").code == 0
    assert ledger_lines(fresh) == ledger_lines(b)  # the whole history again
    audit_ok(fresh, "--remote", "origin")


@pytest.mark.parametrize("who", ["another clone", "a fresh clone", "the replacing clone"])
def test_a_replacement_killed_between_its_two_pushes_is_finished_by_the_next_command_anywhere(
        net, who):
    """`create --force` killed after the old plan's chain ended, naming the new plan, and before
    the new plan was published: the next command in any clone finishes it — the replacement
    carries the new plan's first line, published from there — so no clone is left saying "try
    again" for ever, waiting for a clone that may never run again (issue 41)."""
    a, b = net.clone("a"), net.clone("b")
    old = create(a, 2)
    assert b("sync").code == 0
    r = kill_at(net, a, "after-replaced-push", "create", "--force", "--brief", "second",
                "--goal", "n::o", "--goal", "p::q")
    assert r.code == CRASH, r
    new = a("status", "--json").json["plan_id"]
    assert new != old and plan_refs(net) == [f"refs/fablize/plans/{old}"]
    if who == "another clone":
        r = b("sync")
        assert r.code == 0 and "is published from here" in r.err, r
        assert "was replaced on origin" in r.err, r
        assert b("status", "--json").json["plan_id"] == new
    elif who == "a fresh clone":
        fresh = net.clone("fresh")
        r = fresh("sync")  # the only live plan is the new one: the old one's chain ended
        assert r.code == 0, r
        assert fresh("status", "--json").json["plan_id"] == new
    assert a("next").code == 0  # the clone that was killed goes on with its plan
    assert a("sync").code == 0 and b("sync").code == 0
    assert ledger_lines(a) == ledger_lines(b)
    assert b("status", "--json").json["stories"][0]["status"] == "in_progress"
    assert len(plan_refs(net)) == 2
    audit_ok(b, "--remote", "origin")


@pytest.mark.parametrize("point", ["after-snapshot-replace", "sync-journal-written",
                                   "sync-archived", "sync-ledger-swapped", "sync-logs-placed"])
def test_following_a_replaced_plan_killed_at_any_step_is_finished_by_the_next_command(
        net, point):
    a, b = net.clone("a"), net.clone("b")
    old = create(a, 2)
    assert a("next").code == 0
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
             "--run", "--verify-cmd", "echo old-plan").code == 0
    assert b("sync").code == 0
    assert a("create", "--force", "--brief", "second", "--goal", "n::o", "--goal",
             "p::q").code == 0
    new = a("status", "--json").json["plan_id"]
    assert a("next").code == 0
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
             "--run", "--verify-cmd", "echo new-plan").code == 0
    r = kill_at(net, b, point, "sync")
    assert r.code == CRASH, (point, r)
    r = b("status", "--json")
    assert r.code == 0 and r.json["plan_id"] == new, r
    assert b("sync").code == 0 and ledger_lines(b) == ledger_lines(a)
    archived = b.dir / "archive" / old
    assert [x + b"\n" for x in (archived / "ledger.jsonl").read_bytes().splitlines()] == \
        net.remote_lines(old)
    assert (archived / "runs" / "3-G001.log").read_text() == "old-plan\n"
    assert (b.dir / "runs" / "3-G001.log").read_text() == "new-plan\n"
    assert audit_ok(b, "--require-logs")["missing_logs"] == 0
    assert litter(b.dir) == []


@pytest.mark.parametrize("point", ["sync-journal-written", "sync-archived",
                                   "sync-ledger-swapped"])
def test_undoing_a_lost_replacement_killed_at_any_step_is_finished_by_the_next_command(
        net, point):
    a, b = net.clone("a"), net.clone("b")
    old = create(a, 3, "--parallel")
    assert a("next", "--agent", "x").code == 0
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
             "--agent", "x", "--run", "--verify-cmd", "echo kept").code == 0
    assert b("sync").code == 0
    assert b("next", "--agent", "y").code == 0  # a has not seen it: a's replacement loses
    r = kill_at(net, a, point, "create", "--force", "--brief", "second", "--goal", "n::o")
    assert r.code == CRASH, (point, r)
    assert a("status").code == 0
    assert a("sync").code == 0
    status = a("status", "--json").json
    assert status["plan_id"] == old and ledger_lines(a) == ledger_lines(b)
    assert (a.dir / "runs" / "3-G001.log").read_text() == "kept\n"
    assert not (a.dir / "archive" / old).exists()  # current again, not archived twice
    assert audit_ok(a, "--require-logs")["missing_logs"] == 0
    assert plan_refs(net) == [f"refs/fablize/plans/{old}"] and litter(a.dir) == []


def test_commits_written_as_loose_objects_and_by_fast_import_are_the_same_and_sound(
        net, monkeypatch):
    a = net.clone("a")
    plan_id = create(a, 2)
    assert a("next").code == 0
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
             "--run", "--verify-cmd", "echo both").code == 0
    sharing = engine.room("sharing")
    store = engine.Store(str(a.dir), True)
    cfg = sharing.share_config(store)
    lines = ledger_lines(a)
    first = git(net.remote, "rev-parse", f"refs/fablize/plans/{plan_id}~{len(lines) - 1}").strip()
    base = dict(cfg, commit=first)
    loose = sharing.event_commits(store, base, lines[1:])
    monkeypatch.setattr(sharing.Objects, "of", classmethod(lambda cls, store, commit: None))
    imported = sharing.event_commits(store, base, lines[1:])
    on_remote = git(net.remote, "rev-parse", f"refs/fablize/plans/{plan_id}").strip()
    assert loose == imported == on_remote
    assert subprocess.run(["git", "-C", str(a.root), "fsck", "--no-dangling"],
                          capture_output=True).returncode == 0


# 4. Contention is waiting; other refusals are said at once ###################################


def test_a_command_waiting_out_other_writers_frees_the_lock_for_the_other_agent_of_its_clone(
        net, monkeypatch):
    """x's push loses; while x waits, y (the other agent of the same clone) takes the lock at
    once (a lock timeout of 0 would fail otherwise) and publishes both checkpoints; x then
    finds its own event published, once."""
    import time as real_time
    from test_sharing import others_push_first
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 4, "--parallel")
    assert a("next", "--agent", "x").code == 0 and a("next", "--agent", "y").code == 0
    assert b("sync").code == 0
    others_push_first(net, monkeypatch, b, times=1)
    sibling = []

    class Clock:
        monotonic, time = staticmethod(real_time.monotonic), staticmethod(real_time.time)

        @staticmethod
        def sleep(seconds):
            if not sibling:
                sibling.append(run_cli("checkpoint", "--id", "G002", "--status", "complete",
                                       "--evidence", "y did it", "--agent", "y", cwd=a.root,
                                       env=dict(cli_env(net), FABLIZE_LOCK_TIMEOUT="0")))
    monkeypatch.setattr(engine.room("sharing"), "time", Clock)
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "x did it",
          "--agent", "x")
    assert r.code == 0 and "not published" not in r.err, r
    assert sibling and sibling[0].code == 0, sibling
    checkpoints = [json.loads(x)["id"] for x in net.remote_lines(plan_id)
                   if b'"checkpoint"' in x]
    assert sorted(checkpoints) == ["G001", "G002"]
    assert [x + b"\n" for x in ledger_lines(a)] == net.remote_lines(plan_id)


def test_a_corrupt_remote_is_named_as_damaged_with_its_fix_not_as_unreachable(net):
    a = net.clone("a")
    plan_id = create(a, 2)
    url = f"file://{net.remote}"
    b = net.at(net.tmp / "b")
    git(net.tmp, "clone", "-q", url, str(b.root))  # file://: no objects shared with the remote
    objects = [p for p in (net.remote / "objects").glob("??/*")]
    assert objects, plan_id
    for p in objects:  # every loose object of the plan's commits, emptied
        p.chmod(0o644)
        p.write_bytes(b"")
    r = b("sync", "--json")
    assert r.code == 3 and r.json["error"]["code"] == "remote_damaged", r
    message = r.json["error"]["message"]
    assert "damaged" in message and "git fsck" in message and "cannot be reached" not in message


def test_fablize_share_wait_that_is_not_a_number_is_a_usage_error(net, monkeypatch):
    a = net.clone("a")
    create(a, 2)
    monkeypatch.setenv("FABLIZE_SHARE_WAIT", "soon")
    r = a("sync")
    assert r.code == 2 and "FABLIZE_SHARE_WAIT" in r.err and "Traceback" not in r.err, r


# 6. No state a kill leaves makes a clone fail forever ########################################


def age(path, seconds=600):
    """A lock file as a git process killed `seconds` ago leaves it."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_fetch_ref_lock_left_by_a_killed_git_is_cleared_with_a_notice(net):
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 3, "--parallel")
    assert b("sync").code == 0
    assert a("next", "--agent", "x").code == 0
    lock = b.root / ".git" / "refs" / "fablize" / "remotes" / "origin" / f"{plan_id}.lock"
    lock.write_text("")
    age(lock)
    r = b("sync")
    assert r.code == 0 and "ref lock left by a git process that was killed" in r.err, r
    assert not lock.exists()
    for args in (["next", "--agent", "y"], ["status"], ["sync"]):
        r = b(*args)
        assert r.code == 0 and "Traceback" not in r.err, (args, r)
    assert a("sync").code == 0 and ledger_lines(a) == ledger_lines(b)


def test_a_fast_import_ref_lock_left_by_a_killed_git_is_cleared_with_a_notice(net):
    a = net.clone("a")
    assert a("create", "--brief", "b", "--goal", "x::y", "--goal", "z::w").code == 0
    plan_id = a("status", "--json").json["plan_id"]
    lock = a.root / ".git" / "refs" / "fablize" / "local" / f"{plan_id}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("")
    age(lock)
    r = a("share", "--remote", "origin")
    assert r.code == 0 and "ref lock left by a git process that was killed" in r.err, r
    assert not lock.exists()
    assert net.remote_lines(plan_id) == [x + b"\n" for x in ledger_lines(a)]


def test_audit_remote_counts_a_log_missing_on_the_remote_as_absent_and_an_edited_one_as_tampering(
        net):
    a = net.clone("a")
    plan_id = create(a, 2)
    assert a("next").code == 0
    offline(a, net)
    assert a("verify", "--id", "G001", "--verify-cmd", "echo never-published").code == 0
    (a.dir / "runs" / "3-G001.log").unlink()  # its log is gone before it is published
    online(a, net.remote)
    assert a("sync").code == 0
    ci = net.clone("ci")
    report = audit_ok(ci, "--remote", "origin")
    assert report["missing_logs"] == 1 and report["run_count"] == 1
    r = ci("audit", "--remote", "origin", "--require-logs", "--json")
    assert r.code == 1 and r.json["error"]["code"] == "missing_logs", r
    assert audit_ok(a)["missing_logs"] == 1  # the local audit says the same
    # an edited log on the remote: a commit whose log is not the one its run recorded
    assert a("verify", "--id", "G001", "--verify-cmd", "echo original").code == 0
    ref = f"refs/fablize/plans/{plan_id}"
    tip = git(net.remote, "rev-parse", ref).strip()
    blob = subprocess.run(["git", "-C", str(net.remote), "hash-object", "-w", "--stdin"],
                          input=b"edited\n", capture_output=True).stdout.decode().strip()
    event = git(net.remote, "rev-parse", f"{tip}:event.jsonl").strip()
    tree = subprocess.run(["git", "-C", str(net.remote), "mktree"],
                          input=f"100644 blob {event}\tevent.jsonl\n100644 blob {blob}\tlog\n"
                          .encode(), capture_output=True).stdout.decode().strip()
    forged = git(net.remote, "commit-tree", tree, "-p", f"{tip}~1", "-m", "forged").strip()
    git(net.remote, "update-ref", ref, forged)
    r = ci("audit", "--remote", "origin", "--json")
    assert r.code == 3 and r.json["error"]["code"] == "run_log_mismatch", r


# Other transports: file:// and a real git daemon ##############################################


def goals_cli():
    from conftest import ENGINE
    return list(ENGINE)


def clean_env(net):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FABLIZE_") and k != "GITHUB_STEP_SUMMARY"}
    env.update(cli_env(net))
    return env


def two_clones_share_a_plan(net, url):
    """create --remote, a second clone's claim, a lost race, a run with its log, a fresh clone,
    audit --remote: the whole round through `url`."""
    clones = []
    for name in ("a", "b", "fresh"):
        fab = net.at(net.tmp / name)
        git(net.tmp, "clone", "-q", url, str(fab.root))
        clones.append(fab)
    a, b, fresh = clones
    plan_id = create(a, 3, "--parallel")
    assert b("sync").code == 0
    assert a("next", "--agent", "x").code == 0
    r = b("next", "--agent", "y")  # b has not seen a's claim: pushes first, loses, rebases
    assert r.code == 0 and "handoff — G002" in r.out, r
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
             "--agent", "x", "--run", "--verify-cmd", "echo over-the-wire").code == 0
    assert b("sync").code == 0 and fresh("sync").code == 0
    assert ledger_lines(a) == ledger_lines(b) == ledger_lines(fresh)
    assert (fresh.dir / "runs" / "4-G001.log").read_text() == "over-the-wire\n"
    assert audit_ok(fresh, "--remote", "origin", "--require-logs")["missing_logs"] == 0
    return plan_id


def test_a_plan_shared_through_a_file_url_works_the_whole_round(net):
    two_clones_share_a_plan(net, f"file://{net.remote}")


@pytest.fixture
def git_daemon(net):
    """A real `git daemon --enable=receive-pack` on 127.0.0.1 serving the test's folder, or a
    skip saying why it cannot run here."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.1", 0))
    except OSError as e:
        pytest.skip(f"cannot listen on 127.0.0.1 here ({e})")
    port = probe.getsockname()[1]
    probe.close()
    (net.remote / "git-daemon-export-ok").write_text("")
    # `git daemon` is git starting git-daemon as its child, which forks one per connection:
    # in a session of their own, so that the whole group is ended, not just `git` (killing only
    # it left git-daemon running with parent 1)
    proc = subprocess.Popen(["git", "daemon", "--enable=receive-pack", "--reuseaddr",
                             "--listen=127.0.0.1", f"--port={port}", f"--base-path={net.tmp}",
                             str(net.tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        for _ in range(200):  # until it answers (bounded by tries, not by a clock)
            if proc.poll() is not None:
                pytest.skip(f"git daemon did not start: {proc.stderr.read().decode()[-300:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.02)
        else:
            pytest.skip("git daemon never answered on 127.0.0.1")
        yield f"git://127.0.0.1:{port}/remote.git"
    finally:
        end_group(proc)


def end_group(proc):
    """Kill `proc`'s whole process group and wait until none of it is left (bounded by tries:
    the kernel delivers a kill at once, reaping by init may lag a little)."""
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for _ in range(500):
        if not group_members(proc.pid):
            return
        time.sleep(0.01)
    pytest.fail(f"process group {proc.pid} outlived its kill: {group_members(proc.pid)}")


def test_a_plan_shared_through_a_git_daemon_works_the_whole_round(net, git_daemon):
    two_clones_share_a_plan(net, git_daemon)


def test_the_git_daemon_fixture_leaves_no_process_behind(net):
    """What the issue saw: `git daemon` processes left with parent 1 after the sharing tests."""
    gen = git_daemon.__wrapped__(net)
    url = next(gen)
    a = net.at(net.tmp / "a")
    git(net.tmp, "clone", "-q", url, str(a.root))  # a connection: git-daemon forked for it
    pgid = None
    for frame_proc in gen.gi_frame.f_locals.values():
        if isinstance(frame_proc, subprocess.Popen):
            pgid = frame_proc.pid
    assert pgid is not None and group_members(pgid), "the daemon's group is running"
    gen.close()  # the fixture's teardown
    assert group_members(pgid) == []


def test_a_push_refused_by_a_hook_behind_a_git_daemon_is_said_at_once(net, git_daemon):
    a = net.at(net.tmp / "a")
    git(net.tmp, "clone", "-q", git_daemon, str(a.root))
    create(a, 2)
    reject_pushes(net.remote, -1)
    before = state_files(a.dir)
    r = a("next", "--json")
    assert r.code == 1 and r.json["error"]["code"] == "push_refused", r
    assert "busy" in r.json["error"]["message"]
    assert state_files(a.dir) == before


def test_the_sharing_room_never_leaves_a_traceback_when_git_is_missing(net, monkeypatch):
    a = net.clone("a")
    create(a, 2)
    empty = net.tmp / "nobin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    for args in (["next"], ["sync"], ["status"]):
        r = a(*args)
        assert "Traceback" not in r.err and r.code in (0, 1, 3), (args, r)


def test_a_full_disk_after_a_shared_checkpoint_is_published_says_recorded_not_failed(
        net, monkeypatch):
    """The issue's shared checkpoint on a full disk: the line is durable and pushed, then this
    clone's share record cannot be written. The checkpoint is recorded (exit 0), says what
    could not be done, and the next sync finishes it without publishing twice."""
    a = net.clone("a")
    create(a, 2)
    assert a("next").code == 0
    room = engine.room("sharing")
    real = room.save_share_config

    def full(store, cfg):
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(room, "save_share_config", full)
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "did it")
    monkeypatch.setattr(room, "save_share_config", real)
    assert r.code == 0 and "G001 → complete" in r.out, r
    assert "the events are recorded here" in r.err and "No space left" in r.err, r
    assert a("sync").code == 0
    plan_id = a("status", "--json").json["plan_id"]
    assert [x.rstrip(b"\n") for x in net.remote_lines(plan_id)] == ledger_lines(a)  # each once
    audit_ok(a)


def test_damage_met_after_a_checkpoint_is_durable_says_the_event_stands(net, monkeypatch):
    """git failing (a full disk under .git) once the checkpoint's line is durable: exit 3, and
    the message says the event was recorded and stands, so no one checkpoints it again."""
    a = net.clone("a")
    create(a, 2)
    assert a("next").code == 0
    room = engine.room("sharing")

    def broken(*args, **kwargs):
        raise engine.damaged("git hash-object failed: fatal: No space left on device",
                             "git_failed")

    monkeypatch.setattr(room, "sync_shared", broken)
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "did it")
    monkeypatch.undo()
    assert r.code == 3 and "No space left" in r.err, r
    assert "(Event 3, checkpoint, was recorded in the ledger before this and stands" in r.err, r
    assert a("status", "--json").json["stories"][0]["status"] == "complete"
    assert a("sync").code == 0
    audit_ok(a)


# A clone whose ledger no longer holds what it published (issue 41) ###########################


def published_then_lost(net, how):
    """a: G001 claimed and completed, both published (events 2, 3); then its ledger loses event
    3 as published — the last line torn (rebuild, the step named, sets it aside) or the ledger
    and snapshot restored from a backup taken at event 2. b synced at event 3."""
    a, b = net.clone("a"), net.clone("b")
    plan_id = create(a, 3)
    assert a("next").code == 0
    backup = {n: (a.dir / n).read_bytes() for n in ("ledger.jsonl", "goals.json")}
    assert a("checkpoint", "--id", "G001", "--status", "complete", "--evidence",
             "the acknowledged evidence").code == 0
    assert b("sync").code == 0
    if how == "torn":
        data = (a.dir / "ledger.jsonl").read_bytes()
        (a.dir / "ledger.jsonl").write_bytes(data[:-20])
        r = a("--json", "status")
        assert r.code == 3 and r.json["error"]["commands"][0].endswith(" rebuild"), r
    else:
        for name, body in backup.items():
            (a.dir / name).write_bytes(body)
    return a, b, plan_id


@pytest.mark.parametrize("how", ["torn", "backup"])
def test_a_clone_that_lost_published_events_takes_them_back_before_it_publishes(net, how):
    """share.json says event 3 is published; the ledger no longer holds it. Nothing may then be
    called unpublished or in sync from share.json alone: `status` says so, `rebuild` (the step
    of a torn line) and any writing command take the remote's events in again first, and a
    later claim and checkpoint are published on the remote's chain — no silent fork, and the
    acknowledged evidence stays on the remote."""
    a, b, plan_id = published_then_lost(net, how)
    if how == "torn":
        r = a("rebuild")
        assert r.code == 0 and "1 event came in from the shared plan's remote" in r.out, r
        assert a("status", "--json").json["stories"][0]["status"] == "complete"
    else:
        r = a("status")
        assert r.code == 0 and "in sync" not in r.out, r
        assert "no longer holds event 3 as it was published" in r.out, r
    r = a("next")
    assert r.code == 0 and "handoff — G002" in r.out, r
    assert a("status", "--json").json["stories"][0]["status"] == "complete"
    assert a("checkpoint", "--id", "G002", "--status", "complete", "--evidence",
             "second").code == 0
    r = a("sync")
    assert r.code == 0 and "0 published" in r.out, r  # everything was published as it went
    assert b("sync").code == 0
    remote = net.remote_lines(plan_id)
    assert [x + b"\n" for x in ledger_lines(a)] == remote == [x + b"\n" for x in ledger_lines(b)]
    assert len(remote) == 5 and b"the acknowledged evidence" in remote[2]
    fresh = net.clone("fresh")
    assert fresh("sync").code == 0
    audit_ok(fresh, "--remote", "origin")
    audit_ok(a)


def test_a_rebuild_offline_is_reconciled_by_the_next_writing_command(net):
    a, b, plan_id = published_then_lost(net, "torn")
    git(a.root, "remote", "set-url", "origin", str(net.tmp / "gone.git"))
    r = a("rebuild")
    assert r.code == 0 and "not reconciled with the remote: the remote origin cannot be " \
        "reached" in r.err, r
    assert "no longer holds event 3 as it was published" in r.err, r
    assert a("status", "--json").json["stories"][0]["status"] == "in_progress"  # set aside here
    git(a.root, "remote", "set-url", "origin", str(net.remote))
    r = a("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "again")
    assert r.code == 1 and "is not active (complete)" in r.err, r  # the remote's event 3 is back
    assert "G001 changed on origin meanwhile" in r.err, r
    assert a("status", "--json").json["stories"][0]["status"] == "complete"
    assert a("next").code == 0 and b("sync").code == 0
    assert [x + b"\n" for x in ledger_lines(a)] == net.remote_lines(plan_id)
    assert b"the acknowledged evidence" in net.remote_lines(plan_id)[2]
    audit_ok(b, "--remote", "origin")
