"""Storage never follows a planted symlink: a state file (goals.json, ledger.jsonl, the lock,
ledger.jsonl.broken), the state directory, runs/ or archive/ pointing elsewhere is refused —
exit 3, `symlink` — before anything is read through it or written to it, a dangling target is
never created, and no command writes outside the state directory.
"""

import os

import pytest

from conftest import assert_refused, complete, engine, make_plan, start, state_files

# Planted symlinks, one command at a time ###################################


@pytest.fixture
def outside(tmp_path):
    """A directory outside the project, which no command may write to."""
    d = tmp_path.parent / (tmp_path.name + "-outside")
    d.mkdir()
    return d


@pytest.mark.parametrize("name", ["goals.json", "ledger.jsonl", "lock"])
@pytest.mark.parametrize("args", [["status"], ["next"], ["audit"],
                                  ["checkpoint", "--id", "G001", "--status", "complete",
                                   "--evidence", "x"]])
def test_symlinked_state_file_is_refused(fab, outside, name, args):
    make_plan(fab, 2)
    assert fab("next").code == 0
    target = outside / name
    real = fab.dir / name
    target.write_bytes(real.read_bytes() if real.exists() else b"precious\n")
    real.unlink(missing_ok=True)
    real.symlink_to(target)
    before = target.read_bytes()
    assert_refused(fab, args, 3, f"{name} is a symlink — refusing to follow it", error="symlink")
    assert target.read_bytes() == before and real.is_symlink()
    assert sorted(p.name for p in outside.iterdir()) == [name]


def test_dangling_symlinked_lock_is_refused_and_never_created(fab, outside):
    make_plan(fab, 2)
    lock = fab.dir / "lock"
    lock.unlink(missing_ok=True)
    lock.symlink_to(outside / "lock")
    assert_refused(fab, ["next"], 3, "lock is a symlink", error="symlink")
    assert not (outside / "lock").exists()


def test_symlinked_state_directory_is_refused(fab, outside):
    make_plan(fab, 2)
    real = outside / "state"
    os.rename(fab.dir, real)
    fab.dir.symlink_to(real)
    before = state_files(real)
    for args in (["status"], ["next"], ["audit"], ["create", "--force", "--brief", "b",
                                                   "--goal", "a::b"]):
        r = fab(*args)
        assert r.code == 3 and ".fablize is a symlink — refusing to follow it" in r.err, r
    assert state_files(real) == before


def test_symlinked_runs_directory_is_refused_before_anything_runs(fab, outside):
    make_plan(fab, 2, "--check", "G001=touch ran.flag")
    assert fab("next").code == 0
    (fab.dir / "runs").symlink_to(outside)
    for args in (["checkpoint", "--id", "G001", "--status", "complete", "--evidence", "x"],
                 ["verify", "--id", "G001"]):
        assert_refused(fab, args, 3, "runs is a symlink", error="symlink")
    assert list(outside.iterdir()) == []
    assert not (fab.root / "ran.flag").exists()


def test_symlinked_archive_directory_is_refused_by_create_force(fab, outside):
    make_plan(fab, 2)
    (fab.dir / "archive").symlink_to(outside)
    assert_refused(fab, ["create", "--force", "--brief", "new", "--goal", "a::b"], 3,
                   "archive is a symlink", error="symlink")
    assert list(outside.iterdir()) == []


def test_symlinked_broken_file_is_not_written_through(fab, outside):
    make_plan(fab, 2)
    with open(fab.dir / "ledger.jsonl", "ab") as f:
        f.write(b'{"seq":3,"event":"checkpo')  # a torn last line, to be moved aside
    target = outside / "precious"
    target.write_bytes(b"precious\n")
    (fab.dir / "ledger.jsonl.broken").symlink_to(target)
    assert_refused(fab, ["next"], 3, "ledger.jsonl.broken is a symlink", error="symlink")
    assert target.read_bytes() == b"precious\n"


# Planted symlinks, every command in turn ###################################


def plant_symlink(fab, name, outside, dangling):
    target = fab.root / outside
    if not dangling:
        target.write_bytes(b"precious bytes outside .fablize\n")
    link = fab.dir / name
    if link.exists() or link.is_symlink():
        if not dangling:  # keep the real content in the outside file, like a planted link would
            target.write_bytes(link.read_bytes())
        link.unlink()
    link.symlink_to(target)
    return target


def outside_files(fab):
    return {str(p.relative_to(fab.root)): p.read_bytes() for p in fab.root.rglob("*")
            if p.is_file() and ".fablize" not in p.parts and ".git" not in p.parts}


SYMLINK_COMMANDS = [
    ["status"], ["next"], ["checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e"],
    ["create", "--brief", "new", "--goal", "a::b", "--force"], ["audit"], ["log"],
]


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
@pytest.mark.parametrize("name", ["goals.json", "ledger.jsonl", "lock"])
def test_a_symlinked_state_file_is_refused_and_its_target_untouched(fab, name, dangling):
    make_plan(fab, 2)
    start(fab, "G001")
    target = plant_symlink(fab, name, "outside.txt", dangling)
    before_out = outside_files(fab)
    before = state_files(fab.dir)
    for args in SYMLINK_COMMANDS:
        if args[0] == "log" and name == "goals.json":
            continue  # log reads the ledger only
        r = fab(*args)
        assert r.code == 3, (args, r)
        assert "is a symlink — refusing" in r.err, (args, r)
        # then the step: the link moved aside (its target untouched)
        assert r.err.splitlines()[1:] == [f"  mv .fablize/{name} .fablize/{name}.aside"], r
        assert outside_files(fab) == before_out, args
        assert state_files(fab.dir) == before, args
        assert target.exists() is not dangling
    assert fab("status", "--json").json["error"]["code"] == "symlink"


def test_a_symlinked_broken_file_is_refused_when_a_torn_tail_is_moved_aside(fab):
    make_plan(fab, 2)
    ledger_path = fab.dir / "ledger.jsonl"
    with open(ledger_path, "ab") as f:
        f.write(b'{"seq":2,"ts":"x"')            # a torn last line
    target = plant_symlink(fab, "ledger.jsonl.broken", "outside.txt", dangling=True)
    before = state_files(fab.dir)
    r = fab("next")
    assert r.code == 3 and "is a symlink — refusing" in r.err, r
    assert not target.exists()
    assert state_files(fab.dir) == before


@pytest.mark.parametrize("subdir, args", [
    ("archive", ["create", "--brief", "new", "--goal", "a::b", "--force"]),
    ("runs", ["verify", "--id", "G001", "--verify-cmd", "exit 0"]),
])
def test_a_symlinked_state_subdirectory_is_refused(fab, subdir, args):
    make_plan(fab, 2)
    outside = fab.root / "outside-dir"
    outside.mkdir()
    (fab.dir / subdir).symlink_to(outside)
    before = state_files(fab.dir)
    r = fab(*args)
    assert r.code == 3 and "is a symlink — refusing" in r.err, r
    assert list(outside.iterdir()) == []
    assert state_files(fab.dir) == before


@pytest.mark.parametrize("args", [["status"], ["next"], ["audit"],
                                  ["create", "--brief", "b", "--goal", "a::b", "--force"]])
def test_a_discovered_state_directory_that_is_a_symlink_is_refused(fab, args):
    real = fab.root / "real-state"
    assert fab("--dir", str(real), "create", "--brief", "planted", "--goal", "a::b").code == 0
    before = state_files(real)
    fab.dir.symlink_to(real)
    r = fab(*args)
    assert r.code == 3 and "is a symlink — refusing" in r.err, r
    assert state_files(real) == before


def test_nothing_is_written_outside_the_state_directory(fab):
    before = outside_files(fab)
    make_plan(fab, 2)
    complete(fab, "G001")
    fab("status")
    fab("audit")
    complete(fab, "G002", final=True)
    fab("create", "--brief", "again", "--goal", "a::b", "--force")
    assert outside_files(fab) == before


def test_a_swapped_ledger_is_recorded_as_its_last_event_not_as_plan_created(fab):
    # a sync that takes the remote's history swaps the ledger whole: a failure after it said
    # "event 2 (plan_created) was recorded" for a story_started
    make_plan(fab, 2)
    start(fab, "G001")
    store = engine.Store(str(fab.dir), True)
    data = (fab.dir / "ledger.jsonl").read_bytes()
    with store.session() as s:
        plan = s.load()
        s.swap_ledger(data, plan)
    assert store.recorded == [(2, "story_started")]
    assert (fab.dir / "ledger.jsonl").read_bytes() == data


def test_a_session_that_lets_the_lock_go_writes_nothing_and_then_sees_what_others_wrote(
        fab, monkeypatch):
    """Transaction.unlocked, the sharing room's wait on other machines: while its block runs
    another command takes the lock at once (a lock timeout of 0) and writes, and the session
    itself writes nothing; after it, the session holds the lock again and has read the other
    command's event."""
    monkeypatch.setenv("FABLIZE_LOCK_TIMEOUT", "0")
    make_plan(fab, 3, "--parallel")
    store = engine.Store(str(fab.dir), True)
    with store.session() as s:
        plan = s.load()
        assert s.held and fab("next").code == 3  # held: the other command times out at once
        with s.unlocked():
            assert not s.held
            assert fab("next").code == 0
            before = state_files(fab.dir)
            for write in (lambda: engine.commit_start(s, engine.touch(plan["goals"][1]), None),
                          lambda: s.save_snapshot(plan),
                          lambda: s.swap_ledger(b"", plan)):
                with pytest.raises(RuntimeError, match="without the state lock"):
                    write()
            assert state_files(fab.dir) == before
        assert s.held and s.plan["goals"][0]["status"] == "in_progress"
        r = fab("status")
        assert fab("next").code == 3 and r.code == 0  # held again; a reader reads meanwhile
    assert fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e").code == 0
