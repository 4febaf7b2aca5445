"""Issue 14: from zero to an enforced plan in one command — commands that run as printed, setup
and doctor, the guard people keep on (questions, pause, review, duplicates), SessionStart,
observed runs, and what git sees."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading

import pytest

from conftest import (ENGINE_PYTHON, ROOT, SCRIPT, assert_refused, complete, copy_engine, git,
                      ledger, make_plan, run_cli, state_files)

from conftest import engine

# what setup writes for a repository holding the engine: its launcher, with the bytecode cached
PORTABLE = 'python3 "$(git rev-parse --show-toplevel)/scripts/goals.py"'
HOOK = 'python3 -I -S "$(git rev-parse --show-toplevel)/scripts/goals.py"'  # hooks start it lean
# Claude Code's hooks find the project in the folder it names for them, else through git
CLAUDE_HOOK = ('python3 -I -S "${CLAUDE_PROJECT_DIR:-$(git rev-parse --show-toplevel)}'
               '/scripts/goals.py"')


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A HOME of its own: no agent settings of the machine leak into setup or doctor."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.delenv("CLAUDE_PLUGIN_ROOT", raising=False)
    return h


@pytest.fixture
def repo(tmp_path, home):
    """A real git repository with the engine copied in as scripts/goals.py, and a subdirectory."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    copy_engine(root / "scripts")
    (root / "src" / "deep").mkdir(parents=True)
    (root / "src" / "deep" / "x.txt").write_text("x\n")
    git(root, "init", "-q")
    git(root, "config", "user.email", "t@example.com")
    git(root, "config", "user.name", "t")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "init")
    return root


def env_for(home, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FABLIZE_", "CLAUDE_")) and k != "GITHUB_STEP_SUMMARY"}
    env.update(HOME=str(home), **extra)
    return env


def sh(command, cwd, home, stdin=None, **extra):
    """A command line exactly as printed, run by a shell."""
    p = subprocess.run(["bash", "-c", command], cwd=str(cwd), env=env_for(home, **extra),
                       input=stdin, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def script(repo, home, *args, cwd=None, stdin=None, launcher=False, entry="goals.py"):
    """The repository's copy of the engine, run as setup wires it (goals.py) or, with
    `launcher`, as hooks written by 3.0 run it (`-I -S scripts/fablize.py`)."""
    start = ["-I", "-S", str(repo / "scripts" / "fablize.py")] if launcher else \
        [str(repo / "scripts" / entry)]
    p = subprocess.run([ENGINE_PYTHON, *start, *args], cwd=str(cwd or repo), env=env_for(home),
                       input=stdin, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def printed(out, prefix):
    line = next(x for x in out.splitlines() if x.startswith(prefix))
    return line[len(prefix):]


# Commands that run as printed ###########################################


def test_a_copied_script_prints_commands_that_run_from_any_subdirectory(repo, home):
    deep = repo / "src" / "deep"
    code, out, err = script(repo, home, "create", "--brief", "b", "--goal", "A::a", "--goal",
                            "V::v", cwd=deep)
    assert code == 0, err
    code, out, err = script(repo, home, "status", cwd=deep)  # as the original's users run it
    step = printed(out, "fablize: next — ").split("`")[1]  # the command between the backticks
    assert step == 'python3 "$(git rev-parse --show-toplevel)/scripts/goals.py" next'
    code, out, err = script(repo, home, "status", cwd=deep, launcher=True)  # as setup wires it
    step = printed(out, "fablize: next — ").split("`")[1]
    assert step == f"{PORTABLE} next"
    code, out, err = sh(step, deep, home)  # as printed, from the subdirectory
    assert code == 0 and "=== fablize handoff — G001 A" in out, err
    completion = printed(out, "On completion: ").replace("<evidence>", "did it")
    assert completion.startswith(f"{PORTABLE} checkpoint --id G001")
    assert str(repo) not in out  # nothing machine-specific in what an agent copies
    code, out, err = sh(completion, repo / "src", home)
    assert code == 0 and "G001 → complete" in out, err
    code, out, err = sh(f"{PORTABLE} next", deep, home)
    payload = json.dumps({"cwd": str(deep), "stop_hook_active": False})
    code, out, err = script(repo, home, "guard", cwd=deep, stdin=payload, launcher=True)
    reason = json.loads(out)["reason"]
    assert f"{PORTABLE} checkpoint --id G002" in reason
    # the guard's command, with its placeholders filled in, runs too
    cmd = reason[reason.index(PORTABLE):reason.index(" (or --status")]
    cmd = cmd.replace('"<what you did and saw>"', "ran").replace("complete", "failed")
    code, out, err = sh(cmd, deep, home)
    assert code == 0 and "G002 → failed" in out, err


def test_the_plugin_command_runs_from_a_subdirectory_and_names_itself(repo, home):
    bin_dir = ROOT / "bin"
    deep = repo / "src" / "deep"
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    code, out, err = sh("fablize create --brief b --goal A::a --goal V::v && fablize next", deep,
                        home, PATH=path)
    assert code == 0, err
    completion = printed(out, "On completion: ").replace("<evidence>", "done")
    assert completion.startswith("fablize checkpoint --id G001")
    code, out, err = sh(completion, deep, home, PATH=path)
    assert code == 0 and "G001 → complete" in out, err
    assert (ROOT / "scripts" / "__pycache__").is_dir()  # imported, so its bytecode is cached


def test_the_plugin_command_finds_python_without_python3_on_path(tmp_path, home):
    """Only `python` (as on Windows and some macOS setups): bin/fablize still starts."""
    only = tmp_path / "only-python"
    only.mkdir()
    (only / "python").symlink_to(sys.executable)
    sh_path = shutil.which("sh")
    code, out, err = sh(f"{ROOT / 'bin' / 'fablize'} --version", tmp_path, home,
                        PATH=f"{only}{os.pathsep}{os.path.dirname(sh_path)}")
    assert (code, out) == (0, f"fablize {engine.__version__}\n"), err


def test_the_plugin_command_says_so_when_no_python_is_found(tmp_path, home):
    empty = tmp_path / "empty-path"
    empty.mkdir()
    p = subprocess.run(["/bin/sh", str(ROOT / "bin" / "fablize"), "status"], cwd=str(tmp_path),
                       env=dict(env_for(home), PATH=str(empty)), capture_output=True, text=True)
    assert p.returncode == 3 and p.stderr.startswith("fablize: no Python found"), p


def test_a_script_outside_the_repository_prints_its_absolute_path(fab, monkeypatch):
    monkeypatch.undo()  # the real invocation(), not the harness's `goals.py`
    monkeypatch.chdir(fab.root)
    assert engine.invocation(str(fab.root)) == f"python3 {SCRIPT}"
    monkeypatch.setattr(sys, "argv", ["/somewhere/bin/fablize"])
    assert engine.invocation(str(fab.root)) == "fablize"


# setup and doctor ##########################################################


def test_setup_then_doctor_pass_and_setup_again_changes_no_file(repo, home):
    code, out, err = script(repo, home, "setup", "claude", cwd=repo / "src")
    assert code == 0, err
    assert "CLAUDE.md: the fablize block added" in out and ".claude/settings.json" in out
    block = (repo / "CLAUDE.md").read_text()
    assert f"`{PORTABLE} next`" in block and str(repo) not in block and str(home) not in block
    settings = json.loads((repo / ".claude" / "settings.json").read_text())
    assert [h["command"] for g in settings["hooks"]["Stop"] for h in g["hooks"]] == \
        [f"{CLAUDE_HOOK} guard"]
    assert str(repo) not in (repo / ".claude" / "settings.json").read_text()
    assert (repo / ".fablize" / ".gitignore").read_text() == engine.STATE_GITIGNORE
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in repo.rglob("*")
             if p.is_file() and ".git" not in p.parts}
    code, out, err = script(repo, home, "setup", "claude")
    assert code == 0 and "nothing changed" in out, err
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in repo.rglob("*")
            if p.is_file() and ".git" not in p.parts} == files
    code, out, err = script(repo, home, "doctor", cwd=repo / "src" / "deep")
    assert code == 0, out + err
    assert "✓ Stop hook: registered once (.claude/settings.json)" in out
    assert "✓ command:" in out and "doctor — claude is wired" in out


def written_hooks(repo):
    """{event: command line} of each hook `setup claude` wrote into .claude/settings.json."""
    settings = json.loads((repo / ".claude" / "settings.json").read_text())
    return {event: group["hooks"][0]["command"]
            for event, groups in settings["hooks"].items() for group in groups}


def run_hook(line, cwd, home, payload, path=None, **harness):
    """A hook's line as Claude Code runs it: /bin/sh -c LINE in the session's folder, the
    payload on stdin, the variables the harness sets (`harness`)."""
    env = env_for(home, **harness)
    if path is not None:
        env["PATH"] = path
    p = subprocess.run(["/bin/sh", "-c", line], cwd=str(cwd), env=env, input=json.dumps(payload),
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def test_each_hook_setup_writes_finds_the_project_from_a_subdirectory_without_git(repo, home,
                                                                                 tmp_path):
    """The lines `setup claude` writes, run as Claude Code runs them from a folder deep in the
    project: with $CLAUDE_PROJECT_DIR set they find the engine and the plan without git (none is
    on PATH: no git process a call); with it unset, through git, as before."""
    assert script(repo, home, "setup", "claude")[0] == 0
    lines = written_hooks(repo)
    assert set(lines) == {"SessionStart", "Stop", "PostToolUse", "PostToolUseFailure"}
    assert all(line.startswith(CLAUDE_HOOK) for line in lines.values()), lines
    assert script(repo, home, "create", "--brief", "b", "--goal", "A::a", "--goal", "V::v")[0] == 0
    assert script(repo, home, "next")[0] == 0
    deep = repo / "src" / "deep"
    no_git = tmp_path / "no-git"  # a PATH that holds python3 and nothing else
    no_git.mkdir()
    (no_git / "python3").symlink_to(shutil.which("python3"))
    common = {"session_id": "s", "cwd": str(deep), "transcript_path": str(tmp_path / "t.jsonl")}
    ran = {"tool_name": "Bash", "tool_input": {"command": "pytest -q"}}
    for path, harness in ((str(no_git), {"CLAUDE_PROJECT_DIR": str(repo)}), (None, {})):
        events = len(ledger(repo / ".fablize"))
        code, out, err = run_hook(lines["SessionStart"], deep, home,
                                  dict(common, hook_event_name="SessionStart", source="startup"),
                                  path, **harness)
        assert code == 0 and "=== fablize handoff — G001 A" in out, (harness, out, err)
        code, out, err = run_hook(lines["Stop"], deep, home,
                                  dict(common, hook_event_name="Stop", stop_hook_active=False),
                                  path, **harness)
        assert code == 0 and json.loads(out)["decision"] == "block", (harness, out, err)
        code, out, err = run_hook(
            lines["PostToolUse"], deep, home,
            dict(common, **ran, hook_event_name="PostToolUse",
                 tool_response={"stdout": "4 passed in 0.05s", "stderr": "", "exit_code": 0}),
            path, **harness)
        assert code == 0 and out == "", (harness, out, err)
        code, out, err = run_hook(
            lines["PostToolUseFailure"], deep, home,
            dict(common, **ran, hook_event_name="PostToolUseFailure",
                 error="Exit code 1\n1 failed, 3 passed in 0.06s"), path, **harness)
        assert code == 0 and out == "", (harness, out, err)
        recorded = [e["event"] for e in ledger(repo / ".fablize")[events:]]
        assert recorded == ["guard_block", "observed_run", "observed_run"], (harness, recorded)
    # without the harness's folder, and no git to find the project, the line fails as any
    # command that is not found does (exit 127), never answering for another project
    code, out, err = run_hook(lines["Stop"], deep, home,
                              dict(common, hook_event_name="Stop", stop_hook_active=False),
                              str(no_git))
    assert code != 0 and out == "", (out, err)


@pytest.mark.parametrize("line, payload, absent", [
    ("guard", {"hook_event_name": "Stop", "stop_hook_active": False},
     ("argparse", "fablize_gate.commands", "fablize_gate.audit", "fablize_gate.runs",
      "fablize_gate.reports")),
    ("status --resume", {"hook_event_name": "SessionStart", "source": "startup"},
     ("argparse", "fablize_gate.commands", "fablize_gate.audit")),
    ("observe", {"hook_event_name": "PostToolUse", "tool_name": "Bash",
                 "tool_input": {"command": "pytest -q"},
                 "tool_response": {"stdout": "4 passed in 0.05s", "exit_code": 0}},
     ("argparse", "fablize_gate.commands", "fablize_gate.audit", "fablize_gate.runs")),
    ("observe", {"hook_event_name": "PostToolUse", "tool_name": "Bash",
                 "tool_input": {"command": "git status"}, "tool_response": {"exit_code": 0}},
     ("argparse", "fablize_gate.commands", "fablize_gate.audit", "fablize_gate.runs")),
])
def test_a_hook_loads_only_what_it_needs(repo, home, line, payload, absent):
    """A hook runs at every tool call: its start reads its line without the parser (argparse)
    and loads neither the other commands nor what it does not use — told by the modules the
    interpreter says it imported (-X importtime), not by a clock."""
    assert script(repo, home, "create", "--brief", "b", "--goal", "A::a", "--goal", "V::v")[0] == 0
    assert script(repo, home, "next")[0] == 0
    p = subprocess.run([ENGINE_PYTHON, "-X", "importtime", "-I", "-S",
                        str(repo / "scripts" / "goals.py"), *line.split()], cwd=str(repo),
                       env=env_for(home), input=json.dumps(dict(payload, cwd=str(repo))),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p
    imported = {row.split("|")[-1].strip() for row in p.stderr.splitlines()
                if row.startswith("import time:")}
    assert "fablize_gate.hooks" in imported and "fablize_gate.cli" in imported, p.stderr[-2000:]
    assert not set(absent) & imported, sorted(set(absent) & imported)


def test_setup_remove_undoes_exactly_what_setup_did(repo, home):
    (repo / "CLAUDE.md").write_text("# Rules\n\nUse tabs.\n")
    (repo / ".claude").mkdir()
    (repo / ".claude" / "settings.json").write_text('{"permissions": {"allow": ["Bash(ls)"]}}\n')
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts}
    assert script(repo, home, "setup", "claude")[0] == 0
    code, out, err = script(repo, home, "setup", "claude", "--remove")
    assert code == 0, err
    after = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts}
    assert after.keys() == before.keys()
    assert after[repo / "CLAUDE.md"] == before[repo / "CLAUDE.md"]
    assert json.loads(after[repo / ".claude" / "settings.json"]) == \
        {"permissions": {"allow": ["Bash(ls)"]}}
    assert not (repo / ".fablize").exists()
    assert "fablize: .gitattributes: removed (it held only fablize's line)" in out
    assert "fablize: fablize's merge driver taken out of this clone's git config" in out


def test_setup_remove_puts_back_a_committed_settings_file_byte_for_byte(repo, home):
    """setup writes JSON in its own layout; --remove puts back the file as it was committed."""
    settings = repo / ".claude" / "settings.json"
    settings.parent.mkdir()
    settings.write_text('{"permissions": {"allow": ["Bash(ls)"]}}\n')
    git(repo, "add", ".claude")
    git(repo, "commit", "-qm", "settings")
    assert script(repo, home, "setup", "claude")[0] == 0
    assert "SessionStart" in settings.read_text()
    assert script(repo, home, "setup", "claude", "--remove")[0] == 0
    assert settings.read_bytes() == b'{"permissions": {"allow": ["Bash(ls)"]}}\n'


@pytest.mark.parametrize("agent, block_file, hooks_file, stop_event", [
    ("codex", "AGENTS.md", ".codex/hooks.json", "Stop"),
    ("gemini", "GEMINI.md", ".gemini/settings.json", "AfterAgent"),
    ("cursor", "AGENTS.md", ".cursor/hooks.json", "stop"),
    ("agents-md", "AGENTS.md", None, None),
])
def test_setup_wires_each_agent_and_removes_it_again(repo, home, agent, block_file, hooks_file,
                                                     stop_event):
    code, out, err = script(repo, home, "setup", agent)
    assert code == 0, err
    assert engine.room("setup").BLOCK_BEGIN in (repo / block_file).read_text()
    if hooks_file:
        config = json.loads((repo / hooks_file).read_text())
        stops = engine.room("setup").our_hooks(config, stop_event)
        assert len(stops) == 1 and stops[0][3]["command"].startswith(HOOK)
        if agent != "claude":
            assert f"--for {agent}" in stops[0][3]["command"]
    assert script(repo, home, "setup", agent)[1].endswith("nothing changed.\n")
    code, out, err = script(repo, home, "doctor", agent)
    assert code == 0, out + err
    assert script(repo, home, "setup", agent, "--remove")[0] == 0
    assert not (repo / block_file).exists()
    assert hooks_file is None or not (repo / hooks_file).exists()


def test_doctor_names_the_fix_for_a_stop_hook_registered_twice(repo, home):
    assert script(repo, home, "setup")[0] == 0
    shutil.copy(repo / ".claude" / "settings.json", repo / ".claude" / "settings.local.json")
    code, out, err = script(repo, home, "doctor")
    assert code == 1
    assert "✗ Stop hook: the Stop hook is registered 2 times (.claude/settings.json, " \
        ".claude/settings.local.json)" in out
    assert ("fix: keep one: take fablize's Stop entry out of .claude/settings.local.json "
            "(setup edits the project's files only)") in out
    assert err.startswith("fablize: doctor: ") and "problem" in err


def test_doctor_names_the_fix_for_a_missing_block(repo, home):
    assert script(repo, home, "setup")[0] == 0
    (repo / "CLAUDE.md").write_text("# no block\n")
    code, out, err = script(repo, home, "doctor")
    assert code == 1 and "✗ block: CLAUDE.md has no fablize block — fix: `" in out
    assert "setup claude` adds it" in out


def test_doctor_names_the_fix_when_the_blocks_command_does_not_run(repo, home):
    assert script(repo, home, "setup")[0] == 0
    engine = copy_engine(repo / "elsewhere")
    (repo / "scripts" / "goals.py").unlink()  # the block's path no longer exists
    p = subprocess.run([ENGINE_PYTHON, str(engine), "doctor"], cwd=str(repo), env=env_for(home),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert f"✗ command: the block's command `{PORTABLE}` does not run here" in p.stdout
    assert "fix: install fablize" in p.stdout


def test_doctor_counts_the_project_hooks_once_when_the_plugin_steps_aside(repo, home):
    assert script(repo, home, "setup")[0] == 0
    (home / ".claude").mkdir()
    (home / ".claude" / "settings.json").write_text(json.dumps(
        {"enabledPlugins": {"fablize-gate@fablize-gate": True}}))
    code, out, err = script(repo, home, "doctor")
    assert code == 0 and "✓ Stop hook: registered once (.claude/settings.json)" in out, out


def test_setup_with_the_plugin_registers_the_project_hooks_all_the_same(repo, home):
    (home / ".claude").mkdir()
    (home / ".claude" / "settings.json").write_text(json.dumps(
        {"enabledPlugins": {"fablize-gate@fablize-gate": True}}))
    code, out, err = script(repo, home, "setup", "claude")
    assert code == 0 and "hooks registered" in out and "step aside" in out, err
    assert "guard" in (repo / ".claude" / "settings.json").read_text()
    assert (repo / "CLAUDE.md").is_file()


def test_setup_migrates_the_original_fablize_block_to_exactly_one_block(repo, home):
    original = ("<!-- FABLIZE:BEGIN -->\n## fablize\nRun `python3 ~/.fablize/goals.py next`.\n"
                "<!-- FABLIZE:END -->\n")
    (repo / "CLAUDE.md").write_text("# Rules\n\n" + original + "\n## After\n")
    assert script(repo, home, "setup")[0] == 0
    text = (repo / "CLAUDE.md").read_text()
    assert "FABLIZE:BEGIN" not in text and text.count(engine.room("setup").BLOCK_BEGIN) == 1
    assert text.startswith("# Rules\n\n" + engine.room("setup").BLOCK_BEGIN)
    assert text.endswith("\n## After\n")


def test_install_block_migrates_the_original_block_too(fab):
    target = fab.root / "AGENTS.md"
    target.write_text("<!-- FABLIZE:BEGIN v2 -->\nold\n<!-- FABLIZE:END -->\n")
    assert fab("install-block", "AGENTS.md").code == 0
    text = target.read_text()
    assert "FABLIZE" not in text and text.count(engine.room("setup").BLOCK_BEGIN) == 1


def test_setup_refuses_a_settings_file_that_is_not_json(repo, home):
    (repo / ".claude").mkdir()
    (repo / ".claude" / "settings.json").write_text("{oops")
    code, out, err = script(repo, home, "setup")
    assert code == 1 and "settings.json is not valid JSON" in err
    assert not (repo / "CLAUDE.md").exists()


# Hostile files and payloads: one line or one JSON object, never a traceback or a hang ######
#
# Each failed before its fix. A hang is bounded by run_cli's 120-second guard, not by a short
# timeout a loaded machine could exceed: the fixed engine answers at once.


@pytest.mark.parametrize("cmd", [["guard"], ["observe"], ["guard", "--json"]])
def test_a_hook_payload_cwd_with_a_nul_is_no_traceback(tmp_path, cmd):
    git(tmp_path, "init", "-q")
    payload = json.dumps({"cwd": str(tmp_path) + "\x00x", "tool_name": "Bash",
                          "tool_input": {"command": "pytest -q"}}).encode()
    r = run_cli(*cmd, cwd=tmp_path, input=payload)
    assert "Traceback" not in r.err, r


@pytest.mark.parametrize("cmd,rel", [(["setup", "claude"], ".claude/settings.json"),
                                     (["setup", "claude"], ".claude/settings.local.json"),
                                     (["doctor", "claude"], ".claude/settings.json"),
                                     (["doctor", "claude"], "CLAUDE.md")])
def test_setup_and_doctor_do_not_hang_on_a_fifo(tmp_path, cmd, rel):
    git(tmp_path, "init", "-q")
    (tmp_path / ".claude").mkdir()
    os.mkfifo(tmp_path / rel)
    r = run_cli(*cmd, "--json", cwd=tmp_path, input=b"")  # a reader of the FIFO would wait
    json.loads(r.out)


@pytest.mark.parametrize("cmd,rel", [(["setup", "claude"], ".claude/settings.local.json"),
                                     (["doctor", "claude"], "CLAUDE.md")])
def test_setup_and_doctor_do_not_read_an_endless_file(tmp_path, cmd, rel):
    """A symlink to /dev/zero is read whole (open().read()): MemoryError, or all memory."""
    git(tmp_path, "init", "-q")
    (tmp_path / ".claude").mkdir()
    os.symlink("/dev/zero", tmp_path / rel)
    r = subprocess.run(["bash", "-c", 'ulimit -v 1500000; exec "$@"', "x", sys.executable,
                        str(SCRIPT), *cmd, "--json"], cwd=tmp_path, capture_output=True,
                       timeout=120)
    assert b"Traceback" not in r.stderr, r
    json.loads(r.stdout)


@pytest.mark.parametrize("agent,folder", [("claude", ".claude"), ("gemini", ".gemini")])
def test_setup_does_not_write_through_a_symlinked_settings_folder(tmp_path, agent, folder):
    """project_file refuses a symlinked settings.json, not a symlinked .claude/: a hostile
    repository's `.claude -> ~/.claude` makes `setup` register hooks in the user's global
    settings (every other project then runs them)."""
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    repo.mkdir()
    outside.mkdir()
    git(repo, "init", "-q")
    os.symlink(outside, repo / folder)
    r = run_cli("setup", agent, "--json", cwd=repo)
    assert not (outside / "settings.json").exists(), r.out  # failed before its fix
    assert r.code == 1 and r.json["error"]["code"] == "symlink"


# git sees only what is meant to be committed ###############################


def test_after_a_plan_a_run_and_a_decide_git_shows_only_files_to_commit(repo, home):
    def run(*args):
        code, out, err = script(repo, home, *args)
        assert code == 0, err
    run("create", "--brief", "b", "--goal", "A::a", "--goal", "V::v")
    run("next")
    run("checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "needs a call")
    run("decide", "--id", "G001", "retry", "--note", "try again")
    run("next")
    run("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ok", "--run",
        "--verify-cmd", "true")
    state = repo / ".fablize"
    for litter in ("lock.owner", "ledger.jsonl.broken", "goals.json.tmp-123-abcd"):
        (state / litter).write_text("x")  # what a crash or the lock fallback leaves
    assert (state / "lock").exists()
    shown = sorted(line[3:] for line in git(repo, "status", "--porcelain",
                                            "--untracked-files=all").splitlines())
    assert [x for x in shown if not x.startswith(".fablize/runs/")] == \
        [".fablize/.gitignore", ".fablize/goals.json", ".fablize/ledger.jsonl"]
    assert [x for x in shown if x.startswith(".fablize/runs/")]  # run logs are evidence: kept


# The guard people keep on #################################################


def stop_payload(root, **extra):
    return json.dumps(dict({"session_id": "s", "cwd": str(root), "hook_event_name": "Stop",
                            "stop_hook_active": False}, **extra))


def guard(fab, payload, *args):
    p = subprocess.run([ENGINE_PYTHON, str(SCRIPT), "guard", *args], cwd=str(fab.root),
                       input=payload, capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")})
    assert p.returncode == 0, p
    return json.loads(p.stdout) if p.stdout.strip() else None


def test_guard_lets_the_agent_ask_the_human_a_question_and_still_blocks_a_plain_stop(fab):
    make_plan(fab, 2)
    fab("next")
    before = state_files(fab.dir)
    for question in ("Should the login form keep the email field?",
                     "Two options:\n\n1. A\n2. B\n\nWhich do you prefer?**"):
        assert guard(fab, stop_payload(fab.root, last_assistant_message=question)) is None
    assert guard(fab, stop_payload(fab.root, prompt_response="Shall I go on?")) is None
    assert state_files(fab.dir) == before  # a question writes nothing
    answer = guard(fab, stop_payload(fab.root, last_assistant_message="I'm done for now."))
    assert answer["decision"] == "block" and "G001" in answer["reason"]


def test_a_paused_plan_is_not_blocked_and_the_pause_is_in_the_ledger(fab):
    make_plan(fab, 2)
    fab("next")
    r = fab("pause", "--note", "pairing with the human")
    assert r.code == 0 and "guard paused" in r.out
    assert guard(fab, stop_payload(fab.root)) is None
    status = fab("status").out
    assert "⏸ guard paused since event 3: pairing with the human — `goals.py unpause`" in status
    assert_refused(fab, ["pause"], 1, "already paused (since event 3)")
    assert fab("unpause").code == 0
    assert_refused(fab, ["unpause"], 1, "the guard is not paused.")
    assert guard(fab, stop_payload(fab.root))["decision"] == "block"
    kinds = [e["event"] for e in ledger(fab.dir)]
    assert kinds[-3:] == ["paused", "unpaused", "guard_block"]
    assert fab("audit").code == 0
    assert "guard paused: pairing with the human" in fab("log").out
    assert "guard on again" in fab("log").out


def test_pause_needs_a_plan(fab):
    assert_refused(fab, ["pause"], 1, "no plan")


def test_a_story_in_review_is_answered_with_hand_it_to_the_judge(fab):
    make_plan(fab, 3, "--judge", "G001")
    fab("next")
    fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "done")
    reason = guard(fab, stop_payload(fab.root))["reason"]
    assert reason.startswith("fablize: G001 \"S1\" is in review — hand G001 to the judge")
    assert "goals.py judge-packet --id G001" in reason or "judge-packet --id G001" in reason


def test_a_guard_registered_twice_counts_one_stop_once(fab, tmp_path):
    make_plan(fab, 2)
    fab("next")
    transcript = tmp_path / "t.jsonl"
    transcript.write_text('{"turn": 1}\n')
    payload = stop_payload(fab.root, transcript_path=str(transcript))
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(guard(fab, payload)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [a["decision"] for a in answers] == ["block", "block"]
    assert answers[0]["reason"] == answers[1]["reason"]
    assert [e["event"] for e in ledger(fab.dir)].count("guard_block") == 1
    with open(transcript, "a") as f:
        f.write('{"turn": 2}\n')  # the agent took another turn: a new stop
    again = json.loads(stop_payload(fab.root, transcript_path=str(transcript),
                                    stop_hook_active=True))
    assert "[guard block 2 of at most 3" in guard(fab, json.dumps(again))["reason"]
    assert [e["event"] for e in ledger(fab.dir)].count("guard_block") == 2


@pytest.mark.parametrize("agent, key, value", [("codex", "decision", "block"),
                                               ("gemini", "decision", "deny"),
                                               ("cursor", "followup_message", None)])
def test_guard_answers_in_each_agents_protocol(fab, agent, key, value):
    make_plan(fab, 2)
    fab("next")
    payload = stop_payload(fab.root) if agent != "cursor" else \
        json.dumps({"status": "completed", "loop_count": 0, "cwd": str(fab.root)})
    answer = guard(fab, payload, "--for", agent)
    assert value is None or answer[key] == value
    assert "G001" in (answer.get("reason") or answer.get("followup_message"))
    if agent == "cursor":
        stopped = json.dumps({"status": "aborted", "loop_count": 0, "cwd": str(fab.root)})
        assert guard(fab, stopped, "--for", "cursor") is None
    fab("pause")
    assert guard(fab, payload, "--for", agent) == ({} if agent == "gemini" else None)


# SessionStart #############################################################


def session_start(fab, *args):
    p = subprocess.run([ENGINE_PYTHON, str(SCRIPT), "status", "--resume", *args],
                       cwd=str(fab.root), capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")})
    return p.returncode, p.stdout, p.stderr


def test_session_start_says_one_line_for_a_finished_plan(fab):
    make_plan(fab, 2)
    complete(fab, "G001")
    complete(fab, "G002", final=True)
    code, out, err = session_start(fab)
    assert code == 0
    assert out == "fablize: plan finished (2/2 done) — test plan; nothing to resume.\n"


def test_session_start_warns_in_one_line_with_exit_0_on_a_damaged_plan(fab):
    make_plan(fab, 2)
    (fab.dir / "goals.json").write_text("{")
    code, out, err = session_start(fab)
    assert code == 0 and out.count("\n") == 1
    assert out.startswith("fablize: warning: the plan in ") and "cannot be read" in out


@pytest.mark.parametrize("agent", ["codex", "gemini"])
def test_session_start_speaks_json_where_the_protocol_needs_it(fab, agent):
    make_plan(fab, 2)
    fab("next")
    code, out, err = session_start(fab, "--for", agent)
    obj = json.loads(out)  # the whole of stdout is one JSON object
    context = obj["hookSpecificOutput"]["additionalContext"]
    assert obj["hookSpecificOutput"]["hookEventName"] == "SessionStart"
    assert context.startswith("fablize: 0/2 complete") and "=== fablize handoff — G001" in context
    (fab.dir / "goals.json").write_text("{")
    obj = json.loads(session_start(fab, "--for", agent)[1])
    assert "warning" in obj["hookSpecificOutput"]["additionalContext"]
    shutil.rmtree(fab.dir)
    assert json.loads(session_start(fab, "--for", agent)[1]) == {}  # no plan: still JSON


# Observed runs ############################################################


def observe(fab, payload, *args):
    p = subprocess.run([ENGINE_PYTHON, str(SCRIPT), "observe", *args], cwd=str(fab.root),
                       input=json.dumps(payload) if not isinstance(payload, str) else payload,
                       capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")})
    quiet = "{}\n" if "gemini" in args else ""  # Gemini CLI reads a hook's stdout as JSON
    assert (p.returncode, p.stdout) == (0, quiet), p
    return p


def bash_failure(root, command, error="Exit code 1\nFAILED tests/test_x.py::test_y"):
    return {"session_id": "s", "cwd": str(root), "hook_event_name": "PostToolUseFailure",
            "tool_name": "Bash", "tool_input": {"command": command}, "error": error}


def bash_success(root, command):
    return {"session_id": "s", "cwd": str(root), "hook_event_name": "PostToolUse",
            "tool_name": "Bash", "tool_input": {"command": command},
            "tool_response": {"stdout": "3 passed", "stderr": "", "interrupted": False}}


def test_observed_failure_is_recorded_shown_and_named_by_the_guard_until_it_passes(fab):
    make_plan(fab, 2)
    fab("next")
    observe(fab, bash_failure(fab.root, "python -m pytest -q tests"))
    observe(fab, bash_success(fab.root, "ls -la"))  # not a verification: not recorded
    events = [e for e in ledger(fab.dir) if e["event"] == "observed_run"]
    assert len(events) == 1
    assert (events[0]["id"], events[0]["cmd"], events[0]["ok"], events[0]["exit_code"]) == \
        ("G001", "python -m pytest -q tests", False, 1)
    handoff = fab("next").out
    assert "## Observed runs — what your harness reported" in handoff
    # the harness's exit code, and the test the runner's own line named
    said = "exit 1, pytest reported 1 failed: tests/test_x.py::test_y"
    assert f"`python -m pytest -q tests` → failed ({said})" in handoff
    reason = guard(fab, stop_payload(fab.root))["reason"]
    assert f"The harness saw `python -m pytest -q tests` fail ({said}, event 3)" in reason
    assert f"G001 observed `python -m pytest -q tests` → failed ({said}) (reported by Bash)" in \
        fab("log").out
    observe(fab, bash_success(fab.root, "python -m pytest -q tests"))
    reason = guard(fab, json.dumps(json.loads(stop_payload(fab.root))))["reason"]
    assert "The harness saw" not in reason
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "tests pass")
    assert r.code == 0 and "`python -m pytest -q tests` → passed" in r.out
    assert fab("audit").code == 0


def test_checkpoint_over_an_observed_failure_warns(fab):
    make_plan(fab, 2)
    fab("next")
    observe(fab, bash_failure(fab.root, "make test"))
    r = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "all good")
    assert r.code == 0 and "last saw `make test` fail" in r.err
    # and what it says is so: status, report and audit show the failure left standing
    assert "the harness last saw `make test` fail (event 3) before it was checkpointed" in \
        fab("status").out
    assert "## Failures the harness saw, left standing" in fab("report").out
    assert "G001: the harness last saw `make test` fail" in fab("audit").out


def test_observe_reads_gemini_and_codex_payloads(fab):
    make_plan(fab, 2)
    fab("next")
    observe(fab, {"cwd": str(fab.root), "hook_event_name": "AfterTool",
                  "tool_name": "run_shell_command", "tool_input": {"command": "npm test"},
                  "tool_response": {"llmContent": "Exit Code: 2", "error": "failed"}},
            "--for", "gemini")
    observe(fab, {"cwd": str(fab.root), "hook_event_name": "PostToolUse", "tool_name": "Bash",
                  "tool_input": {"command": ["cargo", "test"]},
                  "tool_response": {"exit_code": 0}}, "--for", "codex")
    seen = [(e["cmd"], e["ok"], e["exit_code"]) for e in ledger(fab.dir)
            if e["event"] == "observed_run"]
    assert seen == [("npm test", False, 2), ("cargo test", True, 0)]


@pytest.mark.parametrize("raw", ["", "garbage{", "[1]", json.dumps({"tool_input": 3})])
def test_observe_never_fails_and_records_nothing_on_odd_input(fab, raw):
    make_plan(fab, 2)
    fab("next")
    before = state_files(fab.dir)
    observe(fab, raw)
    assert state_files(fab.dir) == before


def test_observe_without_an_active_story_records_nothing(fab):
    make_plan(fab, 2)
    before = state_files(fab.dir)
    observe(fab, bash_failure(fab.root, "pytest"))
    assert state_files(fab.dir) == before


def test_a_frozen_check_counts_as_a_verification_whatever_its_name(fab):
    make_plan(fab, 2, "--check", "G001=./scripts/lint-all")
    fab("next")
    observe(fab, bash_failure(fab.root, "./scripts/lint-all --quick"))
    assert [e["cmd"] for e in ledger(fab.dir) if e["event"] == "observed_run"] == \
        ["./scripts/lint-all --quick"]


# The engine's state directory keeps its own .gitignore ######################


def test_the_engine_writes_the_state_gitignore_when_it_creates_the_directory(fab):
    make_plan(fab, 2)
    assert (fab.dir / ".gitignore").read_text() == engine.STATE_GITIGNORE


def test_a_gitignore_of_the_users_own_is_left_alone(fab):
    fab.dir.mkdir()
    (fab.dir / ".gitignore").write_text("mine\n")
    make_plan(fab, 2)
    assert (fab.dir / ".gitignore").read_text() == "mine\n"


# README's opening runs as shown ###########################################


def readme_blocks(heading):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    body = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return [b.split("\n```", 1)[0] for b in body.split("```sh\n")[1:]]


def test_readme_copy_the_engine_lines_run_as_shown(repo, home):
    """The copy step with /path/to/fablize as this checkout, then setup and doctor with the
    copied files alone."""
    shutil.rmtree(repo / "scripts", ignore_errors=True)
    block = readme_blocks("## Add it to your project")[0]
    lines = [x.split("#")[0].strip().replace("/path/to/fablize", str(ROOT))
             for x in block.splitlines()]
    for line in filter(None, lines):
        code, out, err = sh(line, repo, home)
        assert code == 0, (line, out, err)
    assert sorted(p.name for p in (repo / "scripts").iterdir()) == ["fablize_gate", "goals.py"]
    assert sorted(p.name for p in (repo / "scripts" / "fablize_gate").glob("*.py")) == sorted(
        p.name for p in (ROOT / "scripts" / "fablize_gate").glob("*.py"))


def test_the_plugins_merge_driver_runs_from_a_terminal_without_it_on_path(tmp_path, home):
    """The plugin's bin/ is on the PATH of Claude Code's tools only, and git runs the merge
    driver from any terminal: setup through the plugin (no engine copied into the project)
    writes the driver with the launcher's full path, and a plain `git merge` of two branches'
    plans replays them there."""
    repo = tmp_path / "plain"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    (repo / "README").write_text("a project\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "init")
    fablize = shlex.quote(str(ROOT / "bin" / "fablize"))
    code, out, err = sh(f"{fablize} setup claude", repo, home)
    assert code == 0, (out, err)
    assert git(repo, "config", "merge.fablize.driver").strip() == \
        f"{fablize} merge-driver %O %A %B %P"
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "fablize set up")
    base = git(repo, "rev-parse", "HEAD").strip()
    for branch in ("x", "y"):
        git(repo, "checkout", "-q", "-b", branch, base)
        code, out, err = sh(f"{fablize} create --brief {branch} --goal A::a --goal B::b", repo,
                            home)
        assert code == 0, (out, err)
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", f"plan {branch}")
    code, out, err = sh("git merge -q --no-edit x", repo, home)  # no plugin bin/ on PATH
    assert code == 0, (out, err)
    assert "<<<<<<<" not in (repo / ".fablize" / "ledger.jsonl").read_text()


def test_readme_three_commands_run_as_shown_through_the_plugin_command(repo, home):
    path = f"{ROOT / 'bin'}{os.pathsep}{os.environ['PATH']}"
    block, = readme_blocks("## The three commands an agent runs")
    for line in block.splitlines():
        code, out, err = sh(line, repo / "src" / "deep", home, PATH=path)
        assert code == 0, (line, out, err)
    assert "G001 → complete" in out


def test_the_engines_own_commands_are_not_observed(fab):
    """`checkpoint --run --verify-cmd pytest` is in the ledger already, witnessed."""
    make_plan(fab, 2)
    fab("next")
    before = state_files(fab.dir)
    for cmd in ('python3 scripts/goals.py checkpoint --id G001 --status complete --evidence x '
                '--run --verify-cmd "pytest -q"',
                'fablize checkpoint --id G001 --run --verify-cmd "make test"'):
        observe(fab, bash_failure(fab.root, cmd))
    assert state_files(fab.dir) == before
    observe(fab, bash_failure(fab.root, "fablize verify --id G001"))
    assert [e["cmd"] for e in ledger(fab.dir) if e["event"] == "observed_run"] == \
        ["fablize verify --id G001"]


def test_the_committed_hooks_are_the_same_with_the_plugin_and_its_copy_steps_aside(repo, home):
    assert script(repo, home, "setup")[0] == 0
    settings = repo / ".claude" / "settings.json"
    without = settings.read_bytes()
    (home / ".claude").mkdir()
    (home / ".claude" / "settings.json").write_text(
        json.dumps({"enabledPlugins": {"fablize-gate@fablize-gate": True}}))
    code, out, err = script(repo, home, "setup")
    assert code == 0 and "its hooks step aside for these (.claude/settings.json)" in out, (out, err)
    assert settings.read_bytes() == without  # byte-identical: teammates keep their guard
    assert script(repo, home, "create", "--brief", "b", "--goal", "A::a", "--goal", "B::b")[0] == 0
    stop = json.dumps({"cwd": str(repo), "hook_event_name": "Stop", "stop_hook_active": False})
    # the plugin's registration answers nothing where the project's runs; the project's blocks
    assert script(repo, home, "guard", "--plugin", stdin=stop)[:2] == (0, "")
    code, out, _ = script(repo, home, "guard", stdin=stop)
    assert code == 0 and json.loads(out)["decision"] == "block"
    blocks = [e for e in ledger(repo / ".fablize") if e["event"] == "guard_block"]
    assert len(blocks) == 1  # counted once
    assert script(repo, home, "status", "--resume", "--plugin")[:2] == (0, "")
    # where the project's hook cannot run (its engine gone), the plugin's copy does the work
    (repo / "scripts" / "goals.py").rename(repo / "scripts" / "moved.py")
    code, out, _ = script(repo, home, "guard", "--plugin", stdin=stop, entry="moved.py")
    assert code == 0 and json.loads(out)["decision"] == "block"
