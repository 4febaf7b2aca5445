"""Setup that cannot half-work: in a folder that is not a repository it refuses with the fix;
doctor runs every hook it finds as the agent would and fails on one that does not answer; the
user is told what loads the hooks; committed files never depend on one person's machine."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import conftest
from conftest import copy_engine


def env_for(home, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FABLIZE_", "CLAUDE_")) and k != "GITHUB_STEP_SUMMARY"}
    env.update(HOME=str(home), **extra)
    return env


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "home"
    h.mkdir()
    return h


def project(tmp_path, git=True):
    root = tmp_path / "proj"
    copy_engine(root / "scripts")
    if git:
        conftest.git(tmp_path, "init", "-q", str(root))
    return root


def run(root, home, *args, stdin=None):
    return subprocess.run([sys.executable, str(root / "scripts" / "goals.py"), *args],
                          cwd=str(root), env=env_for(home), input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_setup_outside_a_repository_refuses_with_git_init_and_writes_nothing(tmp_path, home):
    root = project(tmp_path, git=False)
    before = sorted(p.name for p in root.iterdir())
    r = run(root, home, "setup", "claude")
    assert r.returncode == 1 and "is not a git repository" in r.stderr, r
    assert "run `git init` first" in r.stderr and r.stderr.count("\n") == 2
    assert r.stderr.endswith(":\n  git init\n"), r  # the step, whole, on its own line
    assert sorted(p.name for p in root.iterdir()) == before  # no block, no hooks, no state


@pytest.mark.parametrize("agent, line", [
    ("claude", "restart Claude Code"), ("codex", "you trust them"),
    ("gemini", "only in a trusted folder"), ("cursor", "restart Cursor")])
def test_setup_says_what_loads_the_hooks_then_the_next_step(tmp_path, home, agent, line):
    root = project(tmp_path)
    r = run(root, home, "setup", agent)
    assert r.returncode == 0 and "fablize: for the hooks to load: " in r.stdout, r
    assert line in r.stdout
    assert r.stdout.rstrip("\n").splitlines()[-1].startswith("fablize: next — ")


def test_codex_gets_its_story_back_after_clear(tmp_path, home):
    root = project(tmp_path)
    assert run(root, home, "setup", "codex").returncode == 0
    hooks = json.loads((root / ".codex" / "hooks.json").read_text())["hooks"]
    assert hooks["SessionStart"][0]["matcher"] == "startup|resume|clear"


def test_doctor_runs_each_hook_and_fails_on_one_that_does_not_answer(tmp_path, home):
    root = project(tmp_path)
    assert run(root, home, "setup", "claude").returncode == 0
    created = run(root, home, "create", "--brief", "b", "--goal", "A::a", "--goal", "B::b")
    assert created.returncode == 0
    ledger = (root / ".fablize" / "ledger.jsonl").read_bytes()
    r = run(root, home, "doctor")
    assert r.returncode == 0
    assert "✓ Stop hook command: runs and answers as claude reads it" in r.stdout
    assert (root / ".fablize" / "ledger.jsonl").read_bytes() == ledger  # the plan untouched
    # a hook that runs our engine but answers nonsense: the guard's output replaced
    settings = root / ".claude" / "settings.json"
    config = json.loads(settings.read_text())
    stop = config["hooks"]["Stop"][0]["hooks"][0]
    stop["command"] = stop["command"] + " --for cursor; echo not-json"
    settings.write_text(json.dumps(config))
    r = run(root, home, "doctor")
    assert r.returncode == 1 and "✗ Stop hook command:" in r.stdout, r
    assert "cannot read as a JSON object: 'not-json'" in r.stdout
    assert "fix: `" in r.stdout and "setup claude`" in r.stdout


def test_doctor_passes_the_hooks_readme_shows_written_by_hand(tmp_path, home):
    """The by-hand settings (docs/reference.md, Wiring an agent) use $CLAUDE_PROJECT_DIR, which
    Claude Code sets for its hooks: doctor runs them as Claude Code does, with it set to the
    project."""
    text = (conftest.ROOT / "docs" / "reference.md").read_text()
    snippet = text[text.index("by hand, in\n  `.claude/settings.json`"):]
    snippet = snippet[snippet.index("```json") + 7:snippet.index("```\n", 7)]
    assert "$CLAUDE_PROJECT_DIR/scripts/goals.py" in snippet
    root = project(tmp_path)
    (root / ".claude").mkdir()
    (root / ".claude" / "settings.json").write_text(snippet)
    r = run(root, home, "doctor", "claude")
    for hook in ("Stop", "SessionStart", "PostToolUse"):
        assert f"✓ {hook} hook command: runs and answers as claude reads it" in r.stdout, r
    assert "exits 2" not in r.stdout


def test_doctor_names_a_repository_that_went_away_as_the_cause(tmp_path, home):
    root = project(tmp_path)
    assert run(root, home, "setup", "claude").returncode == 0
    (root / ".git").rename(root / "git-away")
    r = run(root, home, "doctor", "claude")
    # setup's rule (#41): no wiring is healthy outside a repository — the cause, said once,
    # and `git init` its step, before any hook is run
    assert r.returncode == 1 and r.stdout == "", r
    assert f"doctor: {root} is not a git repository" in r.stderr, r
    assert r.stderr.count("`git init`") == 1 and r.stderr.endswith(":\n  git init\n"), r


def test_doctor_without_an_agent_checks_the_agents_wired_here(tmp_path, home):
    root = project(tmp_path)
    assert run(root, home, "setup", "codex").returncode == 0
    r = run(root, home, "doctor")
    assert r.returncode == 0 and "codex is wired" in r.stdout, r  # not five problems of claude
    assert "CLAUDE.md" not in r.stdout
    assert run(root, home, "setup", "gemini").returncode == 0
    r = run(root, home, "doctor")
    assert r.returncode == 0 and "codex, gemini are wired" in r.stdout, r
    bare = project(tmp_path / "other")
    r = run(bare, home, "doctor")
    assert r.returncode == 1 and "no agent is wired" in r.stderr and "setup claude" in r.stderr


def test_a_duplicated_hook_in_the_project_file_is_fixed_by_running_setup_again(tmp_path, home):
    root = project(tmp_path)
    assert run(root, home, "setup", "claude").returncode == 0
    settings = root / ".claude" / "settings.json"
    config = json.loads(settings.read_text())
    config["hooks"]["Stop"].append(config["hooks"]["Stop"][0])
    settings.write_text(json.dumps(config))
    r = run(root, home, "doctor")
    assert r.returncode == 1 and "registered 2 times" in r.stdout
    assert "setup claude` keeps one" in r.stdout
    assert run(root, home, "setup", "claude").returncode == 0
    assert run(root, home, "doctor").returncode == 0


ORIGINAL = ("<!-- FABLIZE:BEGIN — run Opus like Fable -->\n## Operating mode\n"
            "- **[always]** Lead with the outcome.\n"
            "- **[2+ sequential stories]** Run `python3 x/goals.py`.\n"
            "- **[debugging / test failure]** Follow the investigation protocol.\n"
            "<!-- FABLIZE:END -->\n")


def test_migrating_the_original_block_says_what_it_left_out_and_keeps_the_file(tmp_path, home):
    root = project(tmp_path)
    (root / "CLAUDE.md").write_text("# Rules\n\n" + ORIGINAL)
    r = run(root, home, "setup", "claude")
    assert r.returncode == 0, r
    assert "its other rules (always, debugging / test failure) are not fablize's" in r.stdout
    assert "kept as CLAUDE.md.fablize-backup" in r.stdout
    assert (root / "CLAUDE.md.fablize-backup").read_text() == "# Rules\n\n" + ORIGINAL
    assert "FABLIZE:BEGIN" not in (root / "CLAUDE.md").read_text()


def test_install_block_remove_leaves_no_backup_of_a_file_it_created(tmp_path, home):
    root = project(tmp_path)
    assert run(root, home, "install-block", "NOTES.md").returncode == 0
    assert run(root, home, "install-block", "NOTES.md").returncode == 0  # again: unchanged
    r = run(root, home, "install-block", "NOTES.md", "--remove")
    assert r.returncode == 0 and "the fablize block was all it held" in r.stdout, r
    assert not (root / "NOTES.md").exists() and not (root / "NOTES.md.fablize-backup").exists()
    (root / "MINE.md").write_text("# mine\n")
    assert run(root, home, "install-block", "MINE.md").returncode == 0
    assert run(root, home, "install-block", "MINE.md", "--remove").returncode == 0
    assert (root / "MINE.md").read_text() == "# mine\n"
    assert (root / "MINE.md.fablize-backup").is_file()  # a file of the user's: its copy kept


def test_the_plugins_engine_names_itself_by_its_full_path_for_a_human(tmp_path, home):
    plugin = tmp_path / "plugin"
    copy_engine(plugin / "scripts")
    (plugin / ".claude-plugin").mkdir()
    (plugin / ".claude-plugin" / "plugin.json").write_text('{"name": "fablize-gate"}')
    (plugin / "bin").mkdir()
    root_bin = os.path.join(os.path.dirname(__file__), "..", "bin", "fablize")
    (plugin / "bin" / "fablize").write_bytes(open(root_bin, "rb").read())
    (plugin / "bin" / "fablize").chmod(0o755)
    root = tmp_path / "proj"
    root.mkdir()
    conftest.git(tmp_path, "init", "-q", str(root))
    fablize = str(plugin / "bin" / "fablize")

    def sh(*args):
        return subprocess.run([fablize, *args], cwd=str(root), env=env_for(home),
                              capture_output=True, text=True, timeout=120)
    assert sh("create", "--brief", "b", "--goal", "A::a", "--goal", "B::b").returncode == 0
    sh("next")
    r = sh("checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "no key")
    assert f"\n  {fablize} decide --id G001 accept --note" in r.stdout, r
    assert "checkpoint --id" not in r.stdout.split("decide")[0].split("\n")[-1]
    r = sh("setup", "claude")
    assert f"`alias fablize={fablize}`" in r.stdout, r


def test_setup_with_an_engine_neither_copied_nor_installed_writes_nothing_and_names_the_copy(
        tmp_path, home):
    """`python3 /path/to/fablize/scripts/goals.py setup agents-md` in another project, with no
    `fablize` on PATH: hooks and a merge driver running `fablize` would fail at every event
    and leave conflict markers at the next merge. Refused, nothing written, the copy named;
    the named step works."""
    elsewhere = copy_engine(tmp_path / "fablize" / "scripts")
    root = tmp_path / "proj"
    conftest.git(tmp_path, "init", "-q", str(root))
    before = sorted(p.name for p in root.iterdir())
    env = env_for(home, PATH=os.path.dirname(shutil.which("git")))
    if shutil.which("fablize", path=env["PATH"]):
        pytest.skip("an installed fablize sits beside git here")
    r = subprocess.run([sys.executable, str(elsewhere), "setup", "agents-md"], cwd=str(root),
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r
    lines = r.stderr.splitlines()
    assert lines[0].startswith("fablize: setup: the wiring would run `fablize`, which is not on "
                               "PATH here") and "nothing was written" in lines[0], r
    assert sorted(p.name for p in root.iterdir()) == before  # no block, no hooks, no state
    copy = lines[1].strip()
    assert copy.startswith("mkdir -p scripts && cp -r ") and len(lines) == 2, r
    assert subprocess.run(copy, shell=True, cwd=str(root), timeout=120).returncode == 0
    r = run(root, home, "setup", "agents-md")
    assert r.returncode == 0 and "not on PATH" not in r.stderr, r
