"""A new user's first hour (issue 41, item 7), tried as README tells it: each defect found that
way, with the behaviour a first-time user expects. Real git repositories, real clones of a bare
remote, real processes; the installed command's cases (a wheel off PATH) are in
test_install.py, beside the venv they need, and the old Pythons' in test_cli_manners.py."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, copy_engine, git, make_plan, state_files
from test_sharing import create

pytest_plugins = ["test_sharing"]  # its `net` fixture: a bare remote and its clones

sys.path.insert(0, str(ROOT / "tools"))
import dist  # noqa: E402  (tools/dist.py: what `make dist` builds)


def env_without_fablize(home, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FABLIZE_", "CLAUDE_")) and k != "GITHUB_STEP_SUMMARY"}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not (Path(p) / "fablize").exists())
    env.update(HOME=str(home), **extra)
    return env


# One git rule for setup and doctor ##############################################################


def ways_in(tmp_path):
    """The engine as README's first two ways give it, each run from a folder that is not a git
    repository: a copy in the project's scripts/, and the plugin's bin/fablize (the checkout's;
    the plugin is this repository) — both run as a real process."""
    copy = tmp_path / "copied"
    copy_engine(copy / "scripts")
    plugin = tmp_path / "plugin-project"
    plugin.mkdir()
    return [(copy, [sys.executable, str(copy / "scripts" / "goals.py")]),
            (plugin, [str(ROOT / "bin" / "fablize")])]


@pytest.mark.parametrize("way", [0, 1], ids=["copied", "plugin"])
def test_setup_and_doctor_have_one_git_rule_whatever_runs_them(tmp_path, way):
    home = tmp_path / "home"
    home.mkdir()
    root, argv = ways_in(tmp_path)[way]
    env = env_without_fablize(home, CLAUDE_PLUGIN_ROOT=str(ROOT)) if way else \
        env_without_fablize(home)
    before = sorted(p.name for p in root.iterdir())
    for command in (["setup", "claude"], ["doctor", "claude"], ["doctor"]):
        p = subprocess.run([*argv, *command], cwd=str(root), env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 1 and p.stdout == "", p
        assert f"{command[0]}: {root} is not a git repository" in p.stderr, p
        assert p.stderr.endswith(":\n  git init\n"), p  # the step: git init, never `setup`
        assert "setup claude" not in p.stderr
    assert sorted(p.name for p in root.iterdir()) == before  # nothing written
    git(tmp_path, "init", "-q", str(root))  # the step named, then setup again: it works
    p = subprocess.run([*argv, "setup", "claude"], cwd=str(root), env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p


def test_readme_states_the_git_rule_as_setup_and_doctor_apply_it():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Add it to your project"):text.index("## Quick start")]
    assert re.search(r"Both work only inside a git repository \(`git init` first\), however",
                     section), section[:600]


def test_setup_remove_leaves_the_text_a_user_wrote_above_the_block_byte_for_byte(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    root = tmp_path / "proj"
    copy_engine(root / "scripts")
    git(tmp_path, "init", "-q", str(root))

    def run(*args):
        p = subprocess.run([sys.executable, "scripts/goals.py", *args], cwd=str(root),
                           env=env_without_fablize(home), capture_output=True, text=True)
        assert p.returncode == 0, p
    run("setup", "claude")  # CLAUDE.md made by setup: the block alone
    mine = b"# Our rules\n\nTabs, never spaces.\n"
    (root / "CLAUDE.md").write_bytes(mine + (root / "CLAUDE.md").read_bytes())
    run("setup", "claude", "--remove")
    assert (root / "CLAUDE.md").read_bytes() == mine
    (root / "AGENTS.md").write_bytes(b"# Project\n")  # a file that was there: install, remove
    run("setup", "codex")
    run("setup", "codex", "--remove")
    assert (root / "AGENTS.md").read_bytes() == b"# Project\n"


# The step a refusal names ########################################################################


@pytest.mark.parametrize("extra, sid, said", [
    ((), "G002", "G002 is not active (pending) — it waits for G001; `next` activates G001 first."),
    ((), "G004", "G004 is not active (pending) — it waits for G001, G002, G003; `next` activates "
                 "G001 first."),
    (("--parallel",), "G003", "G003 is not active (pending) — `next` hands out the ready stories "
                              "in plan order; `next` activates G001 first."),
    ((), "G001", "G001 is not active (pending) — activate it with `next` first."),
])
def test_a_checkpoint_on_a_story_not_active_names_the_story_next_would_activate(fab, extra, sid,
                                                                                 said):
    make_plan(fab, 4, *extra)
    before = state_files(fab.dir)
    r = fab("checkpoint", "--id", sid, "--status", "complete", "--evidence", "done")
    assert r.code == 1 and r.err.splitlines() == [f"fablize: {said}", "  goals.py next"], r
    assert state_files(fab.dir) == before
    assert fab("next").out.startswith("=== fablize handoff — G001 S1\n")  # the step does that


@pytest.mark.parametrize("bad", [("--goal", "noseparator"), ("--brief", " ")],
                         ids=["goal", "brief"])
def test_create_over_a_plan_with_a_malformed_story_names_the_malformation_not_force(fab, bad):
    """A plan exists and the new one is malformed: the step `--force` would only meet the
    malformation, so the malformation is said first; nothing changes."""
    make_plan(fab, 2)
    before = state_files(fab.dir)
    args = {"--brief": "b", "--goal": "A::a"}
    args[bad[0]] = bad[1]
    r = fab("create", *[x for kv in args.items() for x in kv])
    assert r.code == 2, r
    assert "already exists" not in r.err and "--force" not in r.err, r
    assert ("title::objective" if bad[0] == "--goal" else "--brief must not be empty") in r.err
    assert state_files(fab.dir) == before


def test_a_story_waiting_on_another_agents_work_names_status_not_next(fab):
    make_plan(fab, 3)
    assert fab("next", "--agent", "alice").code == 0
    r = fab("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "e",
            "--agent", "bob")
    assert r.code == 1 and r.err.splitlines() == [
        "fablize: G002 is not active (pending) — it waits for G001, and nothing is ready to "
        "activate now: `status` says who holds what.", "  goals.py status"], r


# status: one line a story ######################################################################


def test_status_of_a_sequential_plan_is_one_line_a_story(fab):
    make_plan(fab, 10)
    lines = fab("status").out.splitlines()
    assert len(lines) == 12 and not any("waits for" in x for x in lines), lines
    assert fab("next").code == 0 and fab("checkpoint", "--id", "G001", "--status", "failed",
                                         "--evidence", "not yet").code == 0
    assert not any("waits for" in x for x in fab("status").out.splitlines())


def test_status_says_what_a_story_waits_for_where_the_plan_order_does_not(fab):
    make_plan(fab, 5, "--after", "G004=G001,G003", "--after", "G003=")
    lines = fab("status").out.splitlines()
    waits = [(lines[i - 1].split()[1], x.strip()) for i, x in enumerate(lines) if "waits" in x]
    # G002 waits for G001 (its predecessor: said by the order); G004 also for G001; the final
    # story, in a plan that is not sequential, for every one
    assert waits == [("G004", "waits for G001, G003"),
                     ("G005", "waits for G001, G002, G003, G004")], lines


# Sharing, as README shows it ###################################################################


def readme_sharing_lines():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text[text.index("## Sharing a plan across machines"):text.index("## CI")]
    commands = re.findall(r"^python3 scripts/goals.py (.+?)\s+#", block, re.M)
    assert [c.split()[0] for c in commands] == ["share", "sync", "next"], commands
    return block, [c.split() for c in commands]


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_readmes_sharing_lines_work_as_printed(net, parallel):
    block, (share, sync, alice) = readme_sharing_lines()
    assert "`create --parallel`" in block and "take turns" in block
    a, b = net.clone("a"), net.clone("b")
    made = a("create", "--brief", "shared", "--goal", "A::a", "--goal", "B::b", "--goal", "C::c",
             "--goal", "V::v", *(["--parallel"] if parallel else []))
    assert made.code == 0, made
    r = a(*share)
    assert r.code == 0 and ("its agents take turns" in r.out) is not parallel, r
    assert b(*sync).code == 0
    assert a(*alice).code == 0
    r = b("next", "--agent", "bob")  # each agent gets a story of its own — or is told why not
    if parallel:
        assert r.code == 0 and r.out.startswith("=== fablize handoff — G00"), r
        assert not r.out.startswith("=== fablize handoff — G001"), r  # alice's
    else:
        assert r.code == 1 and "nothing else is ready for agent bob" in r.err, r
        assert "this plan's stories go one after another: its agents take turns" in r.err, r
        r = b("next", "--agent", "bob")  # asked again, its copy up to date now
        assert r.code == 1 and "nothing is ready for agent bob" in r.err, r
        assert "this plan's stories go one after another: its agents take turns" in r.err, r


def test_a_claim_lost_to_another_agent_is_said_once(net):
    """Clone b synced before alice's claim: its `next --agent bob` loses G001. Said once — not
    as an event set aside, then the refusal, then again by every later command."""
    a, b = net.clone("a"), net.clone("b")
    create(a, 3)
    assert b("sync").code == 0
    assert a("next", "--agent", "alice").code == 0
    r = b("next", "--agent", "bob")
    assert r.code == 1 and r.err.count("G001 was taken on origin meanwhile") == 1, r
    assert "no longer legal" not in r.err and "not acknowledged" not in r.err, r
    for later in (["status"], ["next", "--agent", "bob"], ["sync"]):
        assert "not acknowledged" not in b(*later).err


def test_status_behind_the_remote_says_so_first_and_names_sync(net):
    a, b = net.clone("a"), net.clone("b")
    create(a, 4)
    assert b("sync").code == 0
    for sid in ("G001", "G002"):
        assert a("next", "--agent", "alice").code == 0
        assert a("checkpoint", "--id", sid, "--status", "complete", "--evidence", "e",
                 "--agent", "alice").code == 0
    r = b("status")
    lines = r.out.splitlines()
    assert lines[0].startswith("fablize: this clone's copy is 4 events behind origin"), lines
    step = [x for x in lines if x.startswith("fablize: next — ")]
    assert step == [f"fablize: next — `python3 {ROOT / 'scripts' / 'goals.py'} sync` (it brings "
                    "in those events; then `status` says what is next)"], lines
    assert "activates" not in r.out and sum("behind" in x for x in lines) == 1, lines
    assert b("status", "--json").json["next"]["kind"] == "sync"
    assert b("sync").code == 0
    assert "(activates G003)" in b("status").out


# make dist ####################################################################################


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("build", ["build_plugin_folder", "build_skill"])
def test_the_folders_make_dist_builds_ship_what_their_documents_link(tmp_path, build):
    folder = Path(getattr(dist, build)(str(tmp_path)))
    dead = []
    for doc in folder.rglob("*.md"):
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            path = target.split("#", 1)[0]
            if path and not re.match(r"[a-z][a-z0-9+.-]*:", path) and \
                    not (doc.parent / path).resolve().is_file():
                dead.append(f"{doc.relative_to(folder)} → {target}")
    assert not dead, dead
    assert (folder / "SKILL.md").is_file() and (folder / "scripts" / "goals.py").is_file()


def test_the_first_make_test_says_what_it_downloads():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    more = text[text.index("## More"):]
    assert "The first `make test` downloads" in more and "`.venv/`" in more and "npm" in more
