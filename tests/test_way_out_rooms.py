"""Every refusal and damage message of the rooms (setup, sharing, sharing_git, merge, trust)
names one runnable next step, and following it leads out. Each state below is made in a real
scratch project — real git: a bare repository as the remote, real clones, branches and merges;
real ssh-keygen keys — then the command that meets it runs: its exit code, its opening words
(scripts match them) and, for a refusal, the state files it left as they were are checked; then
the walk runs the command each message names (--json's error.commands, whole, as the engine was
started: `goals.py …` here, git and shell commands whole) until the command the user wanted
succeeds, or what is left is a human's: a command with a <placeholder>, or a decision the
message says is a human's — which the test then makes, as a human would, and the step the
message names after it must work. No step may lead back to a message already seen (a circle).

WALKED names how each room error code is made here; UNREACHABLE the few no command line can
make, and why: a code a room raises that is in neither fails the first test below.
"""

import ast
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import (ROOT, Result, copy_engine, engine, git, replace_everywhere, run_cli,
                      state_files)
from test_sharing import create as shared  # a plan of n stories shared through origin: its id

ROOMS = ["setup", "sharing", "sharing_git", "merge", "trust", "rerun"]

WALKED = {
    # sharing_git
    "remote_unreachable": "a clone's remote URL names no repository; next → set-url (a "
                          "human's <url>) → next",
    "remote_damaged": "the remote's loose objects emptied; sync → point origin at a sound bare "
                      "repository (<url>) → share --remote origin",
    "git_failed": "share with .git/refs/fablize/local a file (fast-import cannot write its ref: a "
                  "human repairs it) → share; trust's: audit --base on an orphan branch (a human "
                  "commits) → audit",
    "bad_remote": "share/sync --remote 'a b' → the command with <remote>",
    "no_remote": "share --remote nowhere → git remote add nowhere <url>; sync in a clone with "
                 "no remote → git remote add origin <url>",
    "bad_plan_id": "sync --plan x:y on a fresh clone → sync --plan <plan-id>",
    "io_error": "sync with this clone's disk full (a file size limit) → the command again, "
                "once there is room",
    # sharing
    "bad_share": "share.json, then rejected.pending.json, not fablize's → share --remote origin; "
                 "rm the pending list",
    "bad_remote_event": "a commit on the remote's ref with no ledger line → git log shows it; a "
                        "human pushes this clone's history back → sync",
    "run_log_mismatch": "a run's commit on the remote carries another log → as bad_remote_event",
    "remote_history_rewritten": "a fork (the remote's ref rewound and advanced by another clone)"
                                " → git log, a human keeps one; the ref deleted → share; an event"
                                " that does not chain → git log, a human",
    "push_contended": "FABLIZE_SHARE_WAIT=0 and another clone's claim first → sync → next",
    "push_refused": "a pre-receive hook that refuses → a human takes it away → sync → next",
    "plan_replaced": "create --force lost to another clone's (→ status, a human's), to events "
                     "meanwhile (→ status → create --force), its archive removed (a human's); a "
                     "checkpoint of a plan replaced meanwhile (→ status, a human's)",
    "claim_lost": "two clones claim the only ready story → status → next: nothing ready (others'"
                  " work)",
    "no_plan": "a fresh clone's first sync met a damaged remote, whose plan ref its owner then "
               "deleted → rm share.json → sync → create <task> --remote origin",
    "not_found": "sync --plan <an id the remote does not share> → sync --plan <plan-id>",
    "which_plan": "two plans shared → sync --plan <plan-id>; none → create … --remote origin",
    "not_shared": "sync with a local plan → share --remote origin → sync (no remote: share "
                  "--remote <remote>)",
    "other_remote": "sync --remote other on a plan shared through origin → sync",
    "already_shared": "share --remote other on a plan shared through origin → set-url origin "
                      "<url> (a human's) → share --remote origin",
    "usage": "sync in a clone with two remotes, neither origin → sync --remote <remote>; trust's "
             "argument errors (--base with --since, a gate without --base, --sign without "
             "--signer, a --sign that is no file): exit 2, the value is a human's",
    # setup
    "command_missing": "setup where `fablize` is not installed → the copy command → setup",
    "not_a_repository": "setup with scripts/goals.py outside a repository → git init → setup; "
                        "audit --base outside one → cd <checkout>",
    "doctor_problems": "doctor with nothing wired → setup <agent>; hooks taken out and goals.json "
                       "damaged → setup claude → rebuild → doctor",
    "bad_config": "settings.json whose hooks is a list / not JSON / not an object → by hand → "
                  "setup",
    "bad_block": "CLAUDE.md with two begin markers (setup, install-block) → by hand → setup",
    "symlink": ".claude a symlink (a human's) → setup; a symlinked CLAUDE.md.fablize-backup → "
               "rm → install-block",
    "not_text": "CLAUDE.md not UTF-8 / with NUL bytes / over 1 MiB → a human → setup",
    "bad_name": "completion bash --name 'a b' → completion bash --name <name>",
    # merge
    "diverged": "two branches advance one plan differently; git merge → git checkout "
                "--<ours|theirs> (a human's) → commit → audit",
    "conflict": "both branches change .fablize/.gitignore → checkout --<ours|theirs>; a run log "
                "outside a merge → the same; a ledger not UTF-8 → by hand",
    "bad_snapshot": "one branch commits a broken goals.json; git merge → rebuild → commit → audit",
    "no_git_repo": "install-merge where no repository is → git init → install-merge",
    # trust
    "archive_unverified": "audit --base after create --force, its archive named outside "
                          "archive/ / removed / edited / cut short → a human's",
    "history_rewritten": "audit --base on a branch whose plan was written anew, --since a line "
                         "beyond the ledger → a human's",
    "bad_policy": "policy.json on main not a policy, or a symlink → a human fixes it on main",
    "base_not_pr_base": "audit --base other under GitHub's pull request for main → the audit "
                        "with --base main",
    "held_out_missing": "the policy names held-out checks, the job set none → a human's",
    "check_user": "audit --check-user nosuchuser → exit 2, a human's",
    "bad_ref": "audit --base main / origin/main where only the remote has it → git fetch → "
               "audit; a branch nowhere, no remote, --base=-x, a tag → a human's",
    "bad_since": "audit --since xyz → exit 2, the value is a human's",
    "broad_scope": "audit --scope . / create --scope '*.txt' → exit 2, a human's",
    "no_signers": "--allowed-signers missing / outside the repository → exit 2; not committed on"
                  " the base → a human commits it",
    "sign_failed": "decide --sign a file that is no key → a human's key → decide",
    "damaged": "a shared plan's pin.json on main not a pin → a human's",
}

UNREACHABLE = {
    "outside_repository": "merge.install: the state directory's root is its parent folder, so "
                          "its path relative to it never leaves it (`..`): a guard",
    "not_published": "sync --pin pins only after its own sync published every local event (or "
                     "raised); only a ledger restored by hand behind share.json reaches it",
    "plan_exists": "sync on a fresh clone: a plan appearing between its check and its lock — a "
                   "race with another process",
    "not_a_file": "setup's read_project_file: storage.file_to_write refuses a non-file first "
                  "(the core's not_a_file); only a file replaced between the two reaches it",
    "scratch_inside": "audit --rerun: the checkout's parent folder is always outside it; only a "
                      "repository at / has none",
    "plan_changed": "decide --sign: another writer must commit while ssh-keygen signs (outside "
                    "the lock); tools run with SSH_ASKPASS cleared, so nothing real can sit in "
                    "that window without a mock",
}

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}
PLACEHOLDER = re.compile(r"<[\w|-]+>")


def room_codes():
    """Every error code the rooms raise: the code argument of refused/usage/damaged/FablizeError
    (its default when none is given)."""
    defaults = {"refused": "refused", "usage": "usage", "damaged": "damaged"}
    found = set()
    for name in ROOMS:
        path = ROOT / "scripts" / "fablize_gate" / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            called = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if called not in (*defaults, "FablizeError"):
                continue
            code = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "code"), None)
            if code is None:
                found.add(defaults.get(called, "refused"))
            elif isinstance(code, ast.Constant):
                found.add(code.value)
            elif isinstance(code, ast.Attribute) and code.attr == "code":
                pass  # a refusal raised elsewhere, worded again by the room that knows its way out
            else:
                raise AssertionError(f"{name}.py:{node.lineno}: a code that is not a literal")
    return found


def test_every_room_code_is_walked_or_said_unreachable():
    assert not set(WALKED) & set(UNREACHABLE)
    codes = room_codes()
    assert len(codes) > 40, "reading the rooms' error codes found too few"
    assert codes == set(WALKED) | set(UNREACHABLE), codes ^ (set(WALKED) | set(UNREACHABLE))


# The harness ###################################################################################


class Place:
    """A folder where the engine runs in-process (or, given `engine`, that copy of goals.py in a
    real process): place(*args) → Result."""

    def __init__(self, root, capsys, engine=None):
        self.root, self.dir, self.capsys = Path(root), Path(root) / ".fablize", capsys
        self.engine = engine

    def __call__(self, *args):
        if self.engine is not None:
            return run_cli(*args, cwd=self.root, engine=self.engine)
        old = os.getcwd()
        os.chdir(self.root)
        try:
            code = engine.main([str(a) for a in args])
        finally:
            os.chdir(old)
        out = self.capsys.readouterr()
        return Result(code, out.out, out.err)

    def sh(self, command):
        """A printed command that is not the engine's, run by a shell here."""
        p = subprocess.run(command, shell=True, cwd=str(self.root), capture_output=True,
                           text=True, timeout=120, stdin=subprocess.DEVNULL)
        return Result(p.returncode, p.stdout, p.stderr)

    def step(self, command):
        words = shlex.split(command)
        return self(*words[1:]) if words[0] == "goals.py" else self.sh(command)


def walk(at, first, exit_code, code, opening, human=None, until=(), changes=False, limit=6):
    """Run `first` at `at`: it exits `exit_code` with `code`, its message opens with `opening`
    and (unless `changes`) it leaves every state file as it was. Then follow the one command
    each message names until `first` succeeds ("good"), a command holds a <placeholder>, the
    message says the rest is a human's (`human`, a phrase of it: its show-only commands must
    run), or an error in `until` (another's work) is met. Returns (errors seen, end, result)."""
    seen, args = [], list(first)
    before = state_files(at.dir)
    for i in range(limit):
        r = at("--json", *args)
        if r.code == 0:
            return seen, "good", r
        error = r.json["error"]
        if i == 0:
            assert (r.code, error["code"]) == (exit_code, code), r
            assert error["message"].startswith(opening), error
            if not changes:
                assert state_files(at.dir) == before, "a refusal changed the state"
        assert error["message"] not in [e["message"] for e in seen], f"a circle: {error}"
        seen.append(error)
        if error["code"] in until:
            return seen, "until", r
        commands = error.get("commands") or []
        if any(PLACEHOLDER.search(c) for c in commands):
            return seen, "placeholder", r
        if human is not None and human in error["message"]:
            for command in commands:  # what it names to look at runs as printed
                assert at.step(command).code == 0, command
            return seen, "human", r
        assert len(commands) == 1, f"no one runnable step: {error}"
        step = at.step(commands[0])
        assert step.code == 0, (commands[0], step)
        words = shlex.split(commands[0])
        if words[0] == "goals.py" and words[1] == args[0]:  # the command itself, as it works
            return seen, "good", step
        args = list(first)
    pytest.fail(f"no way out after {limit} steps: {seen}")


def quoted(message, start):
    """The command in backticks that starts with `start`, as a message names it."""
    return re.search(r"`(" + re.escape(start) + r"[^`]*)`", message).group(1)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A scratch folder as HOME and the current directory; git's identity, no user config; the
    engine names itself `goals.py` in what it prints."""
    for var in ("FABLIZE_DIR", "FABLIZE_CRASH_AT", "FABLIZE_LOCK_TIMEOUT", "GITHUB_STEP_SUMMARY",
                "FABLIZE_SHARE_WAIT", "CLAUDE_PLUGIN_ROOT", "GITHUB_WORKFLOW_REF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    for k, v in GIT_ENV.items():
        monkeypatch.setenv(k, v)
    replace_everywhere(monkeypatch, "invocation", lambda cwd=None: "goals.py")
    monkeypatch.chdir(tmp_path)
    return tmp_path


class World:
    """A bare repository as the remote, and its clones (each a Place)."""

    def __init__(self, tmp, capsys):
        self.tmp, self.capsys = tmp, capsys
        self.remote = self.bare("remote.git")

    def bare(self, name):
        git(self.tmp, "init", "-q", "--bare", str(self.tmp / name))
        return self.tmp / name

    def clone(self, name, url=None):
        git(self.tmp, "clone", "-q", str(url or self.remote), str(self.tmp / name))
        return self.at(name)

    def at(self, name):
        return Place(self.tmp / name, self.capsys)


@pytest.fixture
def world(env, capsys):
    return World(env, capsys)


def ok(at, *args):
    r = at(*args)
    assert r.code == 0, (args, r)
    return r


def empty_loose_objects(repo):
    """Every loose object of a bare repository replaced by an empty file (a clone's hard links
    keep theirs)."""
    for p in (repo / "objects").glob("??/*"):
        p.unlink()
        p.write_bytes(b"")


def remote_commit(world, plan_id, files, parent=None):
    """A commit of `files` ({name: bytes}) on the remote's plan ref, on its tip (or `parent`),
    as something other than fablize writes it."""
    ref = f"refs/fablize/plans/{plan_id}"
    parent = parent or git(world.remote, "rev-parse", ref).strip()
    rows = []
    for name, body in files.items():
        blob = subprocess.run(["git", "-C", str(world.remote), "hash-object", "-w", "--stdin"],
                              input=body, capture_output=True, check=True).stdout.decode().strip()
        rows.append(f"100644 blob {blob}\t{name}\n")
    tree = subprocess.run(["git", "-C", str(world.remote), "mktree"], input="".join(rows).encode(),
                          capture_output=True, check=True).stdout.decode().strip()
    commit = git(world.remote, "commit-tree", tree, "-p", parent, "-m", "not fablize").strip()
    git(world.remote, "update-ref", ref, commit)
    return commit


# sharing_git and sharing #######################################################################


def test_remote_unreachable_names_the_url_to_fix_and_the_same_command_then_publishes(world):
    a = world.clone("a")
    plan_id = shared(a, 2)
    git(a.root, "remote", "set-url", "origin", str(world.tmp / "gone.git"))
    seen, end, r = walk(a, ["next"], 3, "remote_unreachable",
                        "the remote origin cannot be reached (fatal: ")
    assert end == "placeholder" and r.json["error"]["commands"] == [
        "git remote set-url origin <url>"], r
    # the claim that could not be published is taken back: nothing stands, `next` runs again
    assert "was recorded in the ledger before this and stands" not in seen[0]["message"], seen
    r = ok(a, "add", "--goal", "late::x")  # another write: kept here, said once, no step
    assert "not published: the remote origin cannot be reached (" in r.err, r
    assert "set-url" not in r.err and "):." not in r.err, r
    assert "the remote cannot be reached now — the remote origin cannot be reached (" in ok(
        a, "status").out
    git(a.root, "remote", "set-url", "origin", str(world.remote))  # the human: where it is
    ok(a, "next")
    assert len(git(world.remote, "rev-list", f"refs/fablize/plans/{plan_id}").split()) == 3


def test_a_damaged_remote_is_replaced_by_a_sound_one_and_share_publishes_the_plan_there(world):
    a, b = world.clone("a"), world.clone("b")
    plan_id = shared(a, 3, "--parallel")
    ok(b, "sync")
    ok(b, "next", "--agent", "y")  # a must fetch these objects, which the remote lost
    empty_loose_objects(world.remote)
    seen, end, r = walk(a, ["sync"], 3, "remote_damaged", "the remote origin is damaged — git says")
    assert end == "placeholder", r
    assert r.json["error"]["commands"] == ["git remote set-url origin <url>"], r
    sound = world.bare("sound.git")
    for at in (a, b):  # the human: every clone points origin at the sound repository
        git(at.root, "remote", "set-url", "origin", str(sound))
    step = quoted(seen[0]["message"], "share --remote ")
    ok(b, *shlex.split(step))  # from a clone that holds the plan: b's events are the newest
    ok(a, "sync")
    assert git(sound, "rev-list", "--count", f"refs/fablize/plans/{plan_id}").strip() == "2"
    ok(a, "audit", "--remote", "origin")


def test_git_failing_in_the_clone_is_a_humans_repair_then_the_same_command(world):
    a = world.clone("a")
    ok(a, "create", "--brief", "b", "--goal", "x::y")
    (a.root / ".git" / "refs" / "fablize").mkdir(parents=True)
    (a.root / ".git" / "refs" / "fablize" / "local").write_text("not a folder\n")
    seen, end, r = walk(a, ["share", "--remote", "origin"], 3, "git_failed",
                        "git fast-import failed: ", human="a human repairs it", changes=True)
    assert end == "human" and "then runs the command again" in seen[0]["message"], r
    (a.root / ".git" / "refs" / "fablize" / "local").unlink()  # the human's repair
    ok(a, "share", "--remote", "origin")
    ok(a, "audit", "--remote", "origin")


def fresh_clone_of_a_shared_plan(world):
    a = world.clone("a")
    plan_id = shared(a, 2)
    return world.clone("b"), plan_id


@pytest.mark.parametrize("args, exit_code, code, opening, step, then", [
    (["share", "--remote", "a b"], 2, "bad_remote", "--remote takes the name of a git remote",
     "goals.py share --remote <remote>", "origin"),
    (["sync", "--remote", "a b"], 2, "bad_remote", "--remote takes the name of a git remote",
     "goals.py sync --remote <remote>", "origin"),
    (["sync", "--plan", "x:y"], 2, "bad_plan_id", "--plan takes a plan id",
     "goals.py sync --plan <plan-id>", "PLAN"),
    (["sync", "--plan", "20260101T000000Z-abcdef"], 1, "not_found",
     "origin shares no plan 20260101T000000Z-abcdef (it shares ", "goals.py sync --plan <plan-id>",
     "PLAN"),
    (["share", "--remote", "nowhere"], 1, "no_remote", "nowhere is not a git remote of ",
     "git remote add nowhere <url>", "BARE"),
])
def test_a_value_that_is_not_one_names_the_command_with_a_placeholder(
        world, args, exit_code, code, opening, step, then):
    b, plan_id = fresh_clone_of_a_shared_plan(world)
    if args[0] == "share":
        b = world.clone("c")
        ok(b, "create", "--brief", "local", "--goal", "x::y")
    seen, end, r = walk(b, args, exit_code, code, opening)
    assert end == "placeholder" and r.json["error"]["commands"] == [step], r
    # the human's value: the remote there is, the plan the remote shares, a repository to add
    value = {"origin": "origin", "PLAN": plan_id, "BARE": str(world.bare("new.git"))}[then]
    assert b.step(PLACEHOLDER.sub(value, step)).code == 0
    if not step.startswith("goals.py"):
        ok(b, *args)  # the command the user wanted, now that the remote is there
    assert (b.dir / "ledger.jsonl").exists()


def test_which_remote_and_which_plan_are_the_humans_and_then_sync_brings_the_plan_in(world):
    a = world.clone("a")
    first = shared(a, 2)
    c = world.clone("c")
    second = shared(c, 2)  # a second plan on the same remote
    d = world.clone("d")
    git(d.root, "remote", "rename", "origin", "up")
    git(d.root, "remote", "add", "down", str(world.bare("down.git")))
    seen, end, r = walk(d, ["sync"], 2, "usage", "several git remotes (down, up): say which")
    assert end == "placeholder" and r.json["error"]["commands"] == [
        "goals.py sync --remote <remote>"], r
    seen, end, r = walk(d, ["sync", "--remote", "up"], 1, "which_plan",
                        f"up shares 2 plans ({', '.join(sorted([first, second]))})")
    assert end == "placeholder" and r.json["error"]["commands"] == [
        "goals.py sync --remote up --plan <plan-id>"], r
    ok(d, "sync", "--remote", "up", "--plan", second)
    assert d("status", "--json").json["plan_id"] == second


def test_a_remote_with_no_plan_ends_at_the_humans_plan_and_a_clone_without_remote_at_add(world):
    e = world.clone("e")
    seen, end, r = walk(e, ["sync"], 1, "which_plan", "origin shares no plans — a human writes")
    assert end == "placeholder" and r.json["error"]["commands"] == [
        'goals.py create --brief "<task>" --goal "<title>::<objective>" --remote origin'], r
    ok(e, "create", "--brief", "the human's task", "--goal", "x::y", "--remote", "origin")
    lone = Place(world.tmp / "lone", world.capsys)
    git(world.tmp, "init", "-q", str(lone.root))
    seen, end, r = walk(lone, ["sync"], 1, "no_remote", f"{lone.root} has no git remote — add one")
    assert end == "placeholder" and r.json["error"]["commands"] == [
        "git remote add origin <url>"], r
    git(lone.root, "remote", "add", "origin", str(world.remote))  # the human's URL
    ok(lone, "sync")
    alone = Place(world.tmp / "alone", world.capsys)
    git(world.tmp, "init", "-q", str(alone.root))
    ok(alone, "create", "--brief", "local", "--goal", "x::y")
    seen, end, r = walk(alone, ["sync"], 1, "not_shared", "this plan is local — share it first")
    assert end == "placeholder" and r.json["error"]["commands"] == [
        "goals.py share --remote <remote>"], r


def test_sync_of_a_local_plan_shares_it_and_another_remote_named_syncs_with_its_own(world):
    a = world.clone("a")
    ok(a, "create", "--brief", "local", "--goal", "x::y")
    seen, end, r = walk(a, ["sync"], 1, "not_shared", "this plan is local — share it first")
    assert end == "good" and seen[0]["commands"] == ["goals.py share --remote origin"], seen
    git(a.root, "remote", "add", "other", str(world.bare("other.git")))
    seen, end, r = walk(a, ["sync", "--remote", "other"], 1, "other_remote",
                        "this plan is shared through origin, not other")
    assert end == "good" and seen[0]["commands"] == ["goals.py sync"], seen
    seen, end, r = walk(a, ["share", "--remote", "other"], 1, "already_shared",
                        "this plan is already shared through origin.")
    assert end == "placeholder" and r.json["error"]["commands"] == [
        "git remote set-url origin <url>"], r
    git(a.root, "remote", "set-url", "origin", str(world.tmp / "other.git"))  # the human's move
    ok(a, *shlex.split(quoted(seen[0]["message"], "share --remote origin")))
    assert git(world.tmp / "other.git", "for-each-ref", "refs/fablize/plans/").strip()


def test_damaged_share_records_are_reconnected_or_removed(world):
    a = world.clone("a")
    shared(a, 2)
    (a.dir / "share.json").write_text("garbage\n")
    seen, end, r = walk(a, ["sync"], 3, "bad_share", "share.json is not a fablize share record")
    assert end == "good" and seen[0]["commands"] == ["goals.py share --remote origin"], seen
    (a.dir / "rejected.pending.json").write_text("{}\n")
    seen, end, r = walk(a, ["status"], 3, "bad_share",
                        "rejected.pending.json is not a list of events set aside")
    assert end == "good" and seen[0]["commands"] == ["rm .fablize/rejected.pending.json"], seen


@pytest.mark.parametrize("what", ["no ledger line", "another log", "a line that does not chain"])
def test_a_remote_ref_written_by_something_else_is_shown_and_a_human_puts_the_history_back(
        world, what):
    a, b = world.clone("a"), world.clone("b")
    plan_id = shared(a, 2)
    ok(b, "sync")
    ok(b, "next")
    if what == "no ledger line":
        remote_commit(world, plan_id, {"README": b"hello\n"})
        code, opening = "bad_remote_event", "the shared plan on origin has a commit "
    elif what == "another log":
        ok(a, "sync")
        ok(a, "verify", "--id", "G001", "--verify-cmd", "echo original")
        tip = git(world.remote, "rev-parse", f"refs/fablize/plans/{plan_id}").strip()
        event = subprocess.run(["git", "-C", str(world.remote), "cat-file", "blob",
                                f"{tip}:event.jsonl"], capture_output=True).stdout
        remote_commit(world, plan_id, {"event.jsonl": event, "log": b"edited\n"}, f"{tip}~1")
        code, opening = "run_log_mismatch", "the shared plan on origin: runs/3-G001.log does not"
    else:
        line = (b.dir / "ledger.jsonl").read_bytes().splitlines()[-1]
        remote_commit(world, plan_id, {"event.jsonl": line.replace(b'"seq":2', b'"seq":3')
                                       + b"\n"})
        code, opening = "remote_history_rewritten", "the shared plan on origin does not continue"
    mine = b.dir / "share.json"
    seen, end, r = walk(b, ["sync"], 3, code, opening, human="is a human's decision")
    assert end == "human" and r.json["error"]["commands"][0].startswith(
        "git log --oneline --graph "), r
    assert mine.exists()
    if what == "no ledger line":  # a clone that never held the plan has none to put back
        fresh = world.clone("fresh")
        seen_fresh, end, r = walk(fresh, ["sync"], 3, code, opening,
                                  human="a human who holds the plan", changes=True)
        assert end == "human" and r.json["error"]["commands"] == [
            f"git log --oneline refs/fablize/remotes/origin/{plan_id}"], r
    b.sh(quoted(seen[0]["message"], "git push --force origin "))  # the human keeps this clone's
    ok(b, "sync")
    ok(b, "audit", "--remote", "origin")
    if what == "no ledger line":
        ok(fresh, "sync")


def test_a_fork_is_shown_and_kept_by_a_human_and_a_deleted_ref_is_published_again(world):
    a, b = world.clone("a"), world.clone("b")
    plan_id = shared(a, 3, "--parallel")
    ok(b, "sync")
    ref = f"refs/fablize/plans/{plan_id}"
    base = git(world.remote, "rev-parse", ref).strip()
    ok(b, "next", "--agent", "y")
    git(world.remote, "update-ref", ref, base)  # the remote's ref rewound …
    ok(a, "next", "--agent", "x")               # … and advanced by another clone: a fork
    seen, end, r = walk(b, ["sync"], 3, "remote_history_rewritten",
                        "the shared plan on origin and this clone's copy differ (a fork",
                        human="which to keep is a human's decision")
    assert end == "human" and r.json["error"]["commands"][0].startswith("git log --oneline"), r
    b.sh(quoted(seen[0]["message"], "git push --force origin "))  # the human keeps b's
    ok(b, "sync")
    git(world.remote, "update-ref", "-d", ref)
    seen, end, r = walk(b, ["sync"], 3, "remote_history_rewritten",
                        f"origin no longer holds {ref}: the shared plan's ref was deleted")
    assert end == "good" and seen[0]["commands"] == ["goals.py share --remote origin"], seen
    fresh = world.clone("fresh")
    ok(fresh, "sync")
    assert fresh("status", "--json").json["stories"][0]["agent"] == "y"


def test_contention_and_a_refusing_remote_end_with_sync_then_the_claim(world, monkeypatch):
    a, b = world.clone("a"), world.clone("b")
    shared(a, 4, "--parallel")
    ok(b, "sync")
    ok(b, "next", "--agent", "y")
    monkeypatch.setenv("FABLIZE_SHARE_WAIT", "0")  # give up at the first lost push
    seen, end, r = walk(a, ["next", "--agent", "x"], 1, "push_contended",
                        "gave up publishing to origin after ")
    assert end == "good" and seen[0]["commands"] == ["goals.py sync"], seen
    hook = world.remote / "hooks" / "pre-receive"
    hook.write_text("#!/bin/sh\necho 'no pushes today' >&2\nexit 1\n")
    hook.chmod(0o755)
    seen, end, r = walk(a, ["next", "--agent", "z"], 1, "push_refused",
                        "origin refused the push: ", human="a human who runs that remote")
    assert end == "human" and seen[0]["commands"] == ["goals.py sync"], seen
    r = ok(a, "checkpoint", "--id", "G002", "--status", "complete", "--evidence", "e",
           "--agent", "x")  # another write: kept here, said once, no step in a warning
    assert "not published: origin refused the push: " in r.err and "a human" not in r.err, r
    hook.unlink()  # the human's change on the remote
    ok(a, "sync")
    ok(a, "next", "--agent", "z")


def test_a_lost_claim_shows_who_holds_what_and_ends_at_the_others_work(world):
    a, b = world.clone("a"), world.clone("b")
    shared(a, 2)
    ok(b, "sync")
    ok(b, "next", "--agent", "y")
    seen, end, r = walk(a, ["next", "--agent", "x"], 1, "claim_lost",
                        "G001 was taken on origin meanwhile — agent y holds it", changes=True,
                        until=("nothing_ready",))
    assert seen[0]["commands"] == ["goals.py status"] and end == "until", seen


def test_replacements_that_lose_end_at_status_and_a_humans_decision(world):
    a, b = world.clone("a"), world.clone("b")
    shared(a, 2)
    ok(b, "sync")
    ok(b, "next")  # the plan moved on the remote
    force = ["create", "--force", "--brief", "second", "--goal", "x::y", "--goal", "z::w"]
    seen, end, r = walk(a, force, 1, "plan_replaced", "plan ", changes=True)
    assert "moved on origin since this clone last synced (1 new event)" in seen[0]["message"]
    assert end == "good" and seen[0]["commands"] == ["goals.py status"], seen
    ok(b, "sync")  # b follows a's replacement
    ok(b, "create", "--force", "--brief", "third", "--goal", "x::y", "--goal", "z::w")
    seen, end, r = walk(a, force, 1, "plan_replaced", "plan ", changes=True,
                        human="is a human's decision")
    assert "first (another clone's `create --force`)" in seen[0]["message"], seen
    assert end == "human" and seen[0]["commands"] == ["goals.py status"], seen
    ok(a, "next")
    ok(b, "sync")
    ok(b, "create", "--force", "--brief", "fourth", "--goal", "x::y")
    seen, end, r = walk(a, ["checkpoint", "--id", "G001", "--status", "complete",
                            "--evidence", "e"], 1, "plan_replaced",
                        "this checkpoint was not published: plan ", changes=True,
                        human="is a human's decision")
    assert end == "human" and seen[0]["commands"] == ["goals.py status"], seen
    assert a("status", "--json").json["brief"] == "fourth"


def test_a_replacement_whose_archive_is_gone_is_a_humans_and_no_circle_through_sync(world):
    a, b = world.clone("a"), world.clone("b")
    shared(a, 2)
    ok(b, "sync")
    ok(b, "next")
    git(a.root, "remote", "set-url", "origin", str(world.tmp / "gone.git"))
    ok(a, "create", "--force", "--brief", "second", "--goal", "x::y")  # kept here
    shutil.rmtree(a.dir / "archive")
    git(a.root, "remote", "set-url", "origin", str(world.remote))
    seen, end, r = walk(a, ["sync"], 1, "plan_replaced", "plan ", human="a human's decision")
    assert "its archive is gone" in seen[0]["message"] and end == "human", seen
    assert "run `sync` to see the remote" not in seen[0]["message"]  # it led back here
    assert "remove .fablize/share.json and `share --remote origin`" in seen[0]["message"], seen
    (a.dir / "share.json").unlink()  # the human keeps the replacement as a plan of its own
    ok(a, *shlex.split(quoted(seen[0]["message"], "share --remote ")))
    ok(a, "sync")
    assert a("status", "--json").json["brief"] == "second"


def test_a_share_record_whose_plan_is_gone_is_forgotten_and_sync_finds_what_is_shared(world):
    a = world.clone("a")
    plan_id = shared(a, 2)
    b = Place(world.tmp / "b", world.capsys)
    git(world.tmp, "clone", "-q", f"file://{world.remote}", str(b.root))  # no shared objects
    empty_loose_objects(world.remote)
    r = b("sync", "--json")  # the first sync chose the plan, then met the damage
    assert r.code == 3 and r.json["error"]["code"] == "remote_damaged", r
    git(world.remote, "update-ref", "-d", f"refs/fablize/plans/{plan_id}")  # its owner's repair
    seen, end, r = walk(b, ["sync"], 1, "no_plan", f"origin holds nothing for plan {plan_id} yet")
    assert seen[0]["commands"] == ["rm .fablize/share.json"], seen
    assert end == "placeholder" and r.json["error"]["code"] == "which_plan", r


# setup #########################################################################################


@pytest.fixture
def project(env, capsys):
    """A git repository holding its own copy of the engine (scripts/goals.py)."""
    root = env / "p"
    git(env, "init", "-q", "-b", "main", str(root))
    copy_engine(root / "scripts")
    return Place(root, capsys)


def test_setup_without_the_command_or_a_repository_names_the_copy_then_git_init(env, capsys,
                                                                                monkeypatch):
    # a copy of the engine outside any plugin's folder (this repository is the plugin's), run
    # where no `fablize` is on PATH
    monkeypatch.setenv("PATH", os.pathsep.join(
        p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "fablize").exists()))
    bare = Place(env / "bare", capsys, engine=copy_engine(env / "elsewhere"))
    git(env, "init", "-q", str(bare.root))
    seen, end, r = walk(bare, ["setup", "claude"], 1, "command_missing",
                        "setup: the wiring would run `fablize`, which is not on PATH here")
    assert end == "good" and seen[0]["commands"][0].startswith("mkdir -p scripts && cp -r "), seen
    assert (bare.root / ".claude" / "settings.json").exists()
    outside = Place(env / "outside", capsys)
    copy_engine(outside.root / "scripts")
    seen, end, r = walk(outside, ["setup", "claude"], 1, "not_a_repository",
                        f"setup: {outside.root} is not a git repository")
    assert end == "good" and seen[0]["commands"] == ["git init"], seen


def test_doctor_names_setup_with_the_agent_a_human_picks_then_the_fix_it_finds(project):
    seen, end, r = walk(project, ["doctor"], 1, "doctor_problems", "doctor: no agent is wired")
    assert end == "placeholder" and r.json["error"]["commands"] == ["goals.py setup <agent>"], r
    ok(project, "setup", "claude")  # the human's agent
    ok(project, "doctor")
    (project.root / ".claude" / "settings.json").write_text("{}\n")  # the hooks taken out
    ok(project, "create", "--brief", "b", "--goal", "x::y")
    (project.dir / "goals.json").write_text("{not json")  # and the plan's snapshot damaged
    seen, end, r = walk(project, ["doctor"], 1, "doctor_problems", "doctor: 5 problems")
    assert end == "good" and [e["commands"] for e in seen] == [
        ["goals.py setup claude"], ["goals.py rebuild"]], seen


@pytest.mark.parametrize("rel, content, code, opening", [
    (".claude/settings.json", b'{"hooks": []}\n', "bad_config", 'its "hooks" is not an object '
                                                               "(.claude/settings.json)"),
    (".claude/settings.json", b"{\n", "bad_config", "{root}/.claude/settings.json is not valid "
                                                     "JSON"),
    (".claude/settings.json", b"[]\n", "bad_config", "{root}/.claude/settings.json does not hold "
                                                      "a JSON object"),
    ("CLAUDE.md", b"<!-- fablize:begin -->\n<!-- fablize:begin -->\n<!-- fablize:end -->\n",
     "bad_block", "the file has a broken or repeated fablize block"),
    ("CLAUDE.md", b"\xff\xfe notes\n", "not_text", "{root}/CLAUDE.md is not UTF-8 text"),
    ("CLAUDE.md", b"notes\x00\n", "not_text", "{root}/CLAUDE.md is not text (it holds NUL"),
    ("CLAUDE.md", b"x" * ((1 << 20) + 1), "not_text", "{root}/CLAUDE.md is larger than"),
    (".claude", None, "symlink", "{root}/.claude is a symlink — refusing to write through it"),
])
def test_a_project_file_setup_cannot_edit_is_a_humans_to_fix_then_setup_runs(
        project, rel, content, code, opening):
    path = project.root / rel
    if content is None:
        (project.root / "elsewhere").mkdir()
        path.symlink_to(project.root / "elsewhere")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    human = "by hand" if code in ("bad_config", "bad_block") else "a human"
    seen, end, r = walk(project, ["setup", "claude"], 1, code,
                        opening.format(root=project.root), human=human)
    assert end == "human" and "again" in seen[0]["message"] and "commands" not in seen[0], seen
    if code == "bad_block":
        assert "fix CLAUDE.md by hand" in seen[0]["message"], seen
        r = project("install-block")
        assert r.code == 1 and f"fix {path} by hand, then run the command again" in r.err, r
    path.unlink()  # the human's fix
    ok(project, "setup", "claude")


def test_a_symlinked_backup_of_install_block_is_removed_and_install_block_runs(project):
    (project.root / "CLAUDE.md").write_text("# notes\n")
    target = project.root / "mine.txt"
    target.write_text("keep me\n")
    (project.root / "CLAUDE.md.fablize-backup").symlink_to(target)
    seen, end, r = walk(project, ["install-block"], 1, "symlink",
                        f"{project.root}/CLAUDE.md.fablize-backup is a symlink")
    assert end == "good" and seen[0]["commands"] == ["rm CLAUDE.md.fablize-backup"], seen
    assert target.read_text() == "keep me\n"


def test_completion_with_a_name_that_is_not_one_names_the_command_with_a_placeholder(env, capsys):
    seen, end, r = walk(Place(env, capsys), ["completion", "bash", "--name", "a b"], 2,
                        "bad_name", "--name 'a b' is not a command's name")
    assert end == "placeholder" and r.json["error"]["commands"] == [
        "goals.py completion bash --name <name>"], r


# merge #########################################################################################


def real(root, *args):
    """The engine copied into the repository, run as git runs its merge driver."""
    return run_cli(*args, cwd=root, engine=root / "scripts" / "goals.py")


def branches(project, a_side, b_side):
    """main: a plan of two stories (merge driver installed); branch `a` and branch `b` each
    change it with `a_side(place)` / `b_side(place)`, committed; `b` checked out."""
    root = project.root
    assert real(root, "install-merge").code == 0
    ok(project, "create", "--brief", "base", "--goal", "x::y", "--goal", "z::w")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    for name, side in (("a", a_side), ("b", b_side)):
        git(root, "checkout", "-q", "-b", name, "main")
        side(project)
        git(root, "add", "-A")
        git(root, "commit", "-qm", name)


def driver_on_stages(project, path):
    """The merge driver run as git runs it, on the conflicted file's three stages (--json)."""
    stages = []
    for n in (1, 2, 3):
        f = project.root.parent / f"stage{n}"
        f.write_bytes(subprocess.run(["git", "-C", str(project.root), "show", f":{n}:{path}"],
                                     capture_output=True, check=True).stdout)
        stages.append(f)
    before = stages[1].read_bytes()
    r = project("--json", "merge-driver", *stages, path)
    assert stages[1].read_bytes() == before, "a refused merge changed its side"
    return r


def checkpoint(evidence):
    def side(at):
        ok(at, "next")
        ok(at, "checkpoint", "--id", "G001", "--status", "complete", "--evidence", evidence)
    return side


def test_a_plan_advanced_differently_on_two_branches_is_kept_from_one_side_by_a_human(project):
    branches(project, checkpoint("from a"), checkpoint("from b"))
    merge = git(project.root, "merge", "a", "-m", "merge a", check=False)
    assert merge.returncode == 1 and "both branches advanced the same plan differently" in (
        merge.stdout + merge.stderr), merge
    for path, opening in ((".fablize/ledger.jsonl", "both branches advanced the same plan "
                                                    "differently (from event 2)"),
                          (".fablize/goals.json", "both branches changed the same plan's "
                                                  "snapshot at the same event")):
        r = driver_on_stages(project, path)
        error = r.json["error"]
        assert (r.code, error["code"]) == (1, "diverged") and error["message"].startswith(
            opening), r
        assert "a human's choice" in error["message"], r
        assert error["commands"] == ["git checkout --<ours|theirs> -- :/.fablize"], r
    project.sh("git checkout --ours -- :/.fablize && git add :/.fablize && "
               "git commit -q --no-edit")  # the human keeps this branch's
    ok(project, "audit")


def test_other_plan_files_changed_on_both_branches_are_a_humans_to_keep_one(project):
    def gitignore(text):
        return lambda at: (at.dir / ".gitignore").write_text(text)
    branches(project, gitignore("lock\na\n"), gitignore("lock\nb\n"))
    merge = git(project.root, "merge", "a", "-m", "merge a", check=False)
    assert merge.returncode == 1, merge
    r = driver_on_stages(project, ".fablize/.gitignore")
    error = r.json["error"]
    assert (r.code, error["code"]) == (1, "conflict") and error["message"].startswith(
        ".fablize/.gitignore: both branches changed it and only ledger.jsonl"), r
    assert error["commands"] == ["git checkout --<ours|theirs> -- :/.fablize/.gitignore"], r
    project.sh("git checkout --theirs -- :/.fablize/.gitignore && git add -A && "
               "git commit -q --no-edit")
    ok(project, "audit")
    # a run log in conflict outside a `git merge` of one branch, and a ledger that is no text
    (project.root.parent / "o").write_bytes(b"one\n")
    (project.root.parent / "t").write_bytes(b"two\n")
    before = (project.root.parent / "o").read_bytes()
    r = project("--json", "merge-driver", project.root.parent / "b", project.root.parent / "o",
                project.root.parent / "t", ".fablize/runs/3-G001.log")
    assert r.code == 1 and r.json["error"]["message"].startswith(
        ".fablize/runs/3-G001.log: both branches wrote a different run log here"), r
    assert r.json["error"]["commands"] == [
        "git checkout --<ours|theirs> -- :/.fablize/runs/3-G001.log"], r
    (project.root.parent / "t").write_bytes(b"\xff\n")
    r = project("--json", "merge-driver", project.root.parent / "b", project.root.parent / "o",
                project.root.parent / "t", ".fablize/ledger.jsonl")
    assert r.code == 1 and r.json["error"]["message"] == (
        "ledger.jsonl: a side is not UTF-8 text — merge it by hand."), r
    assert (project.root.parent / "o").read_bytes() == before


def test_a_broken_snapshot_on_one_branch_is_rebuilt_from_the_merged_ledger(project):
    def broken(at):
        (at.dir / "goals.json").write_text("{}\n")
    branches(project, checkpoint("from a"), broken)
    merge = git(project.root, "merge", "a", "-m", "merge a", check=False)
    assert merge.returncode == 1 and "one side is not a fablize snapshot" in merge.stderr, merge
    r = driver_on_stages(project, ".fablize/goals.json")
    assert (r.code, r.json["error"]["code"]) == (3, "bad_snapshot"), r
    assert r.json["error"]["message"].startswith("goals.json: one side is not a fablize snapshot")
    assert r.json["error"]["commands"] == ["goals.py rebuild"], r
    ok(project, "rebuild")
    project.sh("git add -A && git commit -q --no-edit")
    ok(project, "audit")
    assert project("status", "--json").json["stories"][0]["status"] == "complete"


def test_install_merge_outside_a_repository_names_git_init(env, capsys):
    at = Place(env / "plain", capsys)
    at.root.mkdir()
    seen, end, r = walk(at, ["install-merge"], 1, "no_git_repo",
                        f"{at.root} is not a git repository")
    assert end == "good" and seen[0]["commands"] == ["git init"], seen


# trust #########################################################################################


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "alice", "-f",
                    str(folder / "alice")], check=True, capture_output=True)
    return folder


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """main: a plan of two stories, committed; the branch `pr` checked out; a bare `origin`."""
    top = tmp_path_factory.mktemp("trust")
    repo = top / "repo"
    git(top, "init", "-q", "-b", "main", str(repo))
    (repo / "impl.txt").write_text("todo\n")
    r = run_cli("create", "--brief", "ship it", "--goal", "Build::b", "--goal", "Verify::v",
                cwd=repo)
    assert r.code == 0, r
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "plan")
    git(top, "clone", "-q", "--bare", str(repo), str(top / "origin.git"))
    git(repo, "remote", "add", "origin", str(top / "origin.git"))
    git(repo, "checkout", "-q", "-b", "pr")
    return top


@pytest.fixture
def pr(env, template, capsys):
    shutil.copytree(template, env / "t", symlinks=True)
    git(env / "t" / "repo", "remote", "set-url", "origin", str(env / "t" / "origin.git"))
    return Place(env / "t" / "repo", capsys)


def commit(at, message="work"):
    git(at.root, "add", "-A")
    git(at.root, "commit", "-qm", message, "--allow-empty")


def test_a_base_only_the_remote_holds_is_fetched_by_the_command_named(pr):
    clone = Place(pr.root.parent / "ci", pr.capsys)
    git(pr.root.parent, "clone", "-q", "--branch", "main", str(pr.root.parent / "origin.git"),
        str(clone.root))
    git(clone.root, "checkout", "-q", "-b", "pr")
    git(clone.root, "branch", "-q", "-D", "main")
    git(clone.root, "update-ref", "-d", "refs/remotes/origin/main")
    seen, end, r = walk(clone, ["audit", "--base", "origin/main"], 2, "bad_ref",
                        "--base: origin/main is not a commit here (fetch it first?)")
    assert end == "good" and seen[0]["commands"] == ["git fetch origin main"], seen
    seen, end, r = walk(clone, ["audit", "--base", "main"], 2, "bad_ref",
                        "--base: main is not a commit here (fetch it first?)")
    assert end == "good" and seen[0]["commands"] == ["git fetch origin main:main"], seen
    seen, end, r = walk(clone, ["audit", "--base", "mian"], 2, "bad_ref",
                        "--base: mian is not a commit here", human="a human's to say")
    assert end == "human" and "origin has no branch mian either" in seen[0]["message"], seen
    git(clone.root, "remote", "remove", "origin")
    seen, end, r = walk(clone, ["audit", "--base", "mian"], 2, "bad_ref",
                        "--base: mian is not a commit here", human="a human's to say")
    assert end == "human" and "no remote to fetch it from" in seen[0]["message"], seen


@pytest.mark.parametrize("args, code, opening", [
    (["audit", "--base=-x"], "bad_ref", "--base: '-x' is not a git ref."),
    (["audit", "--base", "v1"], "bad_ref", "--base: v1 must name one branch"),
    (["audit", "--since", "xyz"], "bad_since", "--since takes HASH or SEQ:HASH"),
    (["audit", "--base", "main", "--since", "1:" + "0" * 64], "usage",
     "give --base or --since, not both."),
    (["audit", "--require-unchanged-checks"], "usage", "--require-unchanged-checks compares "),
    (["audit", "--forbid-out-of-scope"], "usage", "--forbid-out-of-scope and "),
    (["audit", "--forbid-tripwires"], "usage", "--forbid-tripwires reads what the branch added"),
    (["audit", "--base", "main", "--scope", "."], "broad_scope", "--scope '.' takes the whole"),
    (["create", "--force", "--brief", "b", "--goal", "x::y", "--scope", "*.txt"], "broad_scope",
     "--scope '*.txt' takes every such file"),
    (["audit", "--allowed-signers", "missing"], "no_signers",
     "--allowed-signers: missing does not exist."),
    (["audit", "--base", "main", "--allowed-signers", "/etc/hostname"], "no_signers",
     "--allowed-signers with --base names a file inside the repository."),
    (["decide", "--id", "G001", "accept", "--note", "n", "--sign", "k"], "usage",
     "--sign KEYFILE and --signer PRINCIPAL go together."),
    (["audit", "--rerun", "--check-user", "nosuchuser"], "check_user",
     "--check-user nosuchuser: no such user here"),
    (["decide", "--id", "G001", "accept", "--note", "n", "--sign", "missing", "--signer", "a"],
     "usage", "--sign: missing is not a key file."),
])
def test_an_option_value_that_is_not_one_is_exit_2_and_the_value_is_a_humans(
        pr, args, code, opening):
    git(pr.root, "tag", "v1")
    seen, end, r = walk(pr, args, 2, code, opening, human="")  # any message: the value
    # is a human's; the message names the option and what it takes, and the core's cli, as
    # for every usage error, the command's --help (which the walk ran)
    help_step = f"goals.py {args[0]} --help"
    assert end == "human" and seen[0]["commands"] == [help_step], r
    assert seen[0]["message"].endswith(f" (see `{help_step}`)"), r


def test_audit_outside_a_repository_is_sent_to_the_checkout(pr, capsys):
    out = Place(pr.root.parent / "out", capsys)
    out.root.mkdir()
    shutil.copytree(pr.dir, out.dir)
    seen, end, r = walk(out, ["audit", "--base", "main"], 1, "not_a_repository",
                        f"--base: {out.root} is not inside a git repository")
    assert end == "placeholder" and r.json["error"]["commands"] == ["cd <checkout>"], r
    ok(pr, "audit", "--base", "main")  # the human's checkout


def test_signers_the_base_does_not_list_and_a_key_that_is_none_are_a_humans(pr, keys):
    shutil.copy(keys / "alice", pr.root.parent / "alice")
    (pr.root / "allowed_signers").write_text(
        "alice namespaces=\"fablize\" " + " ".join((keys / "alice.pub").read_text().split()[:2])
        + "\n")
    seen, end, r = walk(pr, ["audit", "--base", "main", "--allowed-signers", "allowed_signers"],
                        1, "no_signers", "--allowed-signers: allowed_signers is not committed at "
                        "main", human="a human commits it there")
    assert end == "human", r
    ok(pr, "next")
    ok(pr, "checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "needs a human")
    (pr.root / "notakey").write_text("not a key\n")
    seen, end, r = walk(pr, ["decide", "--id", "G001", "accept", "--note", "fine", "--sign",
                             "notakey", "--signer", "alice"], 1, "sign_failed",
                        "ssh-keygen could not sign the decision: ", human="the key is a human's")
    assert end == "human" and "`ssh-keygen -y -f notakey`" in seen[0]["message"], r
    ok(pr, "decide", "--id", "G001", "accept", "--note", "fine", "--sign",
       str(pr.root.parent / "alice"), "--signer", "alice")  # the human's key


@pytest.mark.parametrize("how, code, opening", [
    ("archive named outside archive/", "archive_unverified", "the plan's replaces names no "
                                                            "archive ('../x')"),
    ("archive removed", "archive_unverified", "archive/{old}/ledger.jsonl, the plan the current "
                                              "one replaces, is missing"),
    ("archive edited", "archive_unverified", "archive/{old}/ledger.jsonl, the plan the current "
                                             "one replaces, does not verify"),
    ("archive cut short", "archive_unverified", "archive/{old}/ledger.jsonl ends at "),
    ("plan written anew", "history_rewritten", "ledger.jsonl line 1 no longer hashes to "),
    ("pin beyond the ledger", "history_rewritten", "--since 0000000000000000…: line 9 does not "
                                                   "exist — the ledger was truncated"),
    ("policy not one", "bad_policy", ".fablize/policy.json on main is not a policy"),
    ("policy a symlink", "bad_policy", ".fablize/policy.json on main is a symlink"),
])
def test_a_history_or_policy_that_does_not_verify_is_a_humans_to_judge(pr, how, code, opening):
    old = pr("status", "--json").json["plan_id"]
    if how.startswith("policy"):
        git(pr.root, "checkout", "-q", "main")
        if how == "policy a symlink":
            (pr.root / "elsewhere.json").write_text("{}\n")
            (pr.dir / "policy.json").symlink_to("../elsewhere.json")
        else:
            (pr.dir / "policy.json").write_text("[]\n")
        commit(pr, "policy")
        git(pr.root, "checkout", "-q", "pr")
    elif how == "plan written anew":
        shutil.rmtree(pr.dir)
        ok(pr, "create", "--brief", "anew", "--goal", "x::y")
    elif how != "pin beyond the ledger":
        ok(pr, "next")
        ok(pr, "create", "--force", "--brief", "second", "--goal", "x::y")
        archived = pr.dir / "archive" / old / "ledger.jsonl"
        if how == "archive named outside archive/":  # the line written by hand
            ledger = pr.dir / "ledger.jsonl"
            ledger.write_bytes(ledger.read_bytes().replace(f'"path":"archive/{old}"'.encode(),
                                                           b'"path":"../x"'))
            (pr.dir / "goals.json").unlink()
            ok(pr, "rebuild")
        elif how == "archive removed":
            shutil.rmtree(archived.parent)
        elif how == "archive edited":
            archived.write_bytes(archived.read_bytes().replace(b"ship it", b"ship that"))
        else:
            archived.write_bytes(archived.read_bytes().rstrip(b"\n").rpartition(b"\n")[0] + b"\n")
    commit(pr)
    args = ["--since", "9:" + "0" * 64] if how == "pin beyond the ledger" else ["--base", "main"]
    seen, end, r = walk(pr, ["audit", *args], 3, code, opening.format(old=old), human="a human")
    assert end == "human", r


def test_a_base_other_than_the_pull_requests_is_refused_naming_the_audit_on_its_base(
        pr, monkeypatch):
    git(pr.root, "branch", "other", "main")
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_BASE_REF", "main")
    before = state_files(pr.dir)
    r = pr("audit", "--base", "other", "--allow-new-plan")
    assert r.code == 1 and r.err.startswith("fablize: --base other is not the pull request's "
                                            "base branch main (GITHUB_BASE_REF)"), r
    assert r.err.endswith("\n  goals.py audit --base main --allow-new-plan\n"), r
    assert state_files(pr.dir) == before
    assert pr.step("goals.py audit --base main --allow-new-plan").code == 0


def test_held_out_checks_the_job_did_not_set_are_a_humans(pr, monkeypatch):
    git(pr.root, "checkout", "-q", "main")
    (pr.dir / "policy.json").write_text('{"held_out_checks": "HIDDEN_CHECKS"}\n')
    commit(pr, "policy")
    git(pr.root, "checkout", "-q", "pr")
    monkeypatch.delenv("HIDDEN_CHECKS", raising=False)
    seen, end, r = walk(pr, ["audit", "--base", "main", "--rerun"], 1, "held_out_missing",
                        "the policy names held-out checks in $HIDDEN_CHECKS, and CI set none",
                        human="a human makes the job fill HIDDEN_CHECKS")
    assert end == "human", r


def test_a_branch_with_no_commit_is_a_humans_to_commit_then_the_audit_runs(pr):
    git(pr.root, "checkout", "-q", "--orphan", "empty")
    args = ["audit", "--base", "main", "--forbid-out-of-scope", "--scope", "impl.txt"]
    seen, end, r = walk(pr, args, 3, "git_failed", "--base: git cannot compare HEAD with "
                        "refs/heads/main", human="a human commits its work")
    assert end == "human", r
    commit(pr, "the work")
    ok(pr, *args)


def test_a_shared_plans_pin_on_the_base_that_is_no_pin_is_a_humans(world):
    a = world.clone("a")
    shared(a, 2)
    (a.dir / "pin.json").write_text("not a pin\n")
    git(a.root, "add", "-f", ".fablize/pin.json")
    git(a.root, "commit", "-qm", "a broken pin")
    branch = git(a.root, "branch", "--show-current").strip() or "master"
    seen, end, r = walk(a, ["audit", "--remote", "origin", "--base", branch], 3, "damaged",
                        f"{branch}:.fablize/pin.json is not a fablize pin", human="a human")
    assert end == "human", r
    git(a.root, "rm", "-q", "--cached", ".fablize/pin.json")
    ok(a, "sync", "--pin")
    git(a.root, "add", "-f", ".fablize/pin.json")
    git(a.root, "commit", "-qm", "a pin")
    ok(a, "audit", "--remote", "origin", "--base", branch)


# Faults of a clone's own, and the remote's ref written by something else (issue 41) ##########


def test_a_full_local_disk_during_sync_is_this_machines_and_the_command_again_publishes(world):
    """The clone's disk is full while `sync` fetches (a file size limit: git's objects cannot be
    written): said as this machine's, never as a damaged or unreachable remote (no `set-url`);
    the step is the command again, which works once there is room."""
    import resource
    import signal
    from conftest import ENGINE
    a, b = world.clone("a"), world.clone("b")
    shared(a, 3, "--parallel")
    ok(b, "sync")
    ok(b, "next", "--agent", "y")  # objects a must fetch

    def full():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2, 2))
    before = state_files(a.dir)
    p = subprocess.run([*ENGINE, "--json", "sync"], cwd=str(a.root), capture_output=True,
                       env={k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")},
                       preexec_fn=full, timeout=120)
    error = __import__("json").loads(p.stdout)["error"]
    assert p.returncode == 3 and error["code"] == "io_error", (p, error)
    assert error["message"].startswith("git could not write this clone's repository while it "
                                       "talked to origin — git says: "), error
    assert "not the remote" in error["message"] and "set-url" not in error["message"], error
    assert [shlex.split(c)[-2:] for c in error["commands"]] == [["--json", "sync"]], error
    assert state_files(a.dir) == before
    ok(a, "sync")  # the step, once there is room
    assert a("status", "--json").json["stories"][0]["agent"] == "y"


def test_a_branch_pushed_over_a_plans_ref_is_repaired_by_the_clones_that_hold_the_plan(world):
    """`git push --force origin HEAD:refs/fablize/plans/ID`: the ref holds a commit that is no
    plan's. Not a fork and not a human's decision: the next command of a clone that holds the
    plan puts the plan back, says so, and goes on; a fresh clone meanwhile is told a clone
    that holds it repairs it."""
    a, b = world.clone("a"), world.clone("b")
    plan_id = shared(a, 3, "--parallel")
    ok(b, "sync")
    ok(b, "next", "--agent", "y")
    ok(a, "sync")
    (a.root / "README").write_text("a branch\n")
    git(a.root, "add", "README")
    git(a.root, "commit", "-qm", "work on a branch")
    git(a.root, "push", "-q", "--force", "origin", f"HEAD:refs/fablize/plans/{plan_id}")
    fresh = world.clone("fresh")
    seen, end, r = walk(fresh, ["sync"], 3, "bad_remote_event", "the shared plan on origin has a "
                        "commit ", human="A clone that holds the plan repairs", changes=True)
    assert end == "human", r
    r = ok(a, "next", "--agent", "x")  # a clone that holds the plan: repaired, then its claim
    assert "which holds no plan (a branch pushed over the plan's ref?)" in r.err, r
    assert "a human" not in r.err and "fork" not in r.err, r
    ok(b, "sync")
    ok(fresh, "sync")
    assert [s["agent"] for s in fresh("status", "--json").json["stories"][:2]] == ["y", "x"]
    ok(fresh, "audit", "--remote", "origin")


def test_an_ordinary_lost_claim_is_never_called_a_hand_edit(world):
    """b claims G001 on an old copy while a's round of it failed on the remote: the claim lost a
    race, said as such (and `next` claims again), never "written or edited by hand"."""
    a, b = world.clone("a"), world.clone("b")
    shared(a, 2)
    ok(b, "sync")
    ok(a, "next")
    ok(a, "checkpoint", "--id", "G001", "--status", "failed", "--evidence", "not yet")
    r = ok(b, "next")  # its copy says G001 is pending, round 0
    assert "by hand" not in r.err, r
    assert "on origin, G001 went another round meanwhile (it is failed, round 1; this claim " \
           "was for round 1)" in r.err, r
    assert "handoff — G001" in r.out and "round 2" in r.out, r
    ok(a, "sync")
    ok(a, "audit", "--remote", "origin")


def test_a_claim_lost_to_another_agent_in_the_same_round_says_it_was_taken(world):
    """b's agent claims G001 on an old copy while a's agent holds it, in the round b's claim
    was for: said as taken, by whom — never as another round."""
    a, b = world.clone("a"), world.clone("b")
    shared(a, 3, "--parallel")
    ok(b, "sync")
    ok(a, "next", "--agent", "alice")
    r = ok(b, "next", "--agent", "bob")  # its copy says G001 is pending, round 0
    assert "on origin, G001 was taken by agent alice meanwhile (it is in progress, round 1: " \
           "the round this claim was for)" in r.err, r
    assert "another round" not in r.err and "handoff — G002" in r.out, r


RACE_HOOK = """#!/bin/sh
# git runs this in every ref transaction of this clone. While a reading command's fetch holds
# the refs it writes (prepared), a writer of this clone runs, racing it, as an agent would.
[ "$1" = prepared ] || exit 0
[ -f "$RACE_ARMED" ] || exit 0
grep -q ' refs/fablize/' || exit 0
rm -f "$RACE_ARMED"
unset GIT_DIR GIT_INDEX_FILE GIT_WORK_TREE GIT_PREFIX
cd "$RACE_CLONE" && "$RACE_PYTHON" "$RACE_SCRIPT" --json next --agent w > "$RACE_OUT"
exit 0
"""


@pytest.mark.parametrize("reader", [["status"], ["audit", "--remote", "origin"]])
def test_a_reading_command_writes_no_ref_a_writer_of_the_clone_holds(world, reader):
    """`status` and `audit --remote` take no lock, so they must not write the refs a writer of
    the same clone fetches into under its lock: a writer racing them was told 'the remote
    cannot be reached' while it was reachable. A reference-transaction hook stands for the
    race: it runs a writer whenever a ref of refs/fablize/ is about to change — and a reader
    changes none."""
    import json
    import sys
    from conftest import SCRIPT
    a, b = world.clone("a"), world.clone("b")
    shared(a, 3, "--parallel")
    ok(b, "sync")
    ok(b, "next", "--agent", "y")  # the remote moved: a's reader has something to fetch
    hook = a.root / ".git" / "hooks" / "reference-transaction"
    hook.write_text(RACE_HOOK)
    hook.chmod(0o755)
    armed, out = world.tmp / "armed", world.tmp / "writer.json"
    armed.write_text("")
    refs = git(a.root, "for-each-ref", "refs/fablize/")
    env = {"RACE_ARMED": str(armed), "RACE_CLONE": str(a.root), "RACE_OUT": str(out),
           "RACE_PYTHON": sys.executable, "RACE_SCRIPT": str(SCRIPT)}
    r = run_cli(*reader, cwd=a.root, env=env)
    assert r.code == 0 and "cannot be reached" not in r.out + r.err, r
    if out.exists():  # the reader wrote a ref: the writer that raced it must still have worked
        answer = json.loads(out.read_text())
        assert answer["ok"], answer
    assert armed.exists(), "the reader changed a ref of refs/fablize/"
    assert git(a.root, "for-each-ref", "refs/fablize/") == refs
    hook.unlink()
    ok(a, "next", "--agent", "w")


def test_a_shared_plans_missing_ledger_comes_back_from_its_remote_by_rebuild(world):
    a = world.clone("a")
    shared(a, 2)
    ok(a, "next")
    (a.dir / "ledger.jsonl").unlink()
    seen, end, r = walk(a, ["status"], 3, "disagree", "goals.json reflects event 2 but "
                        "ledger.jsonl is empty (the file is missing)", changes=True)
    assert end == "good" and seen[0]["commands"][0].endswith(" rebuild"), seen
    assert a("status", "--json").json["stories"][0]["status"] == "in_progress"
    ok(a, "audit")
    ok(a, "audit", "--remote", "origin")
