"""README's CI recipe, run as written on README's own quick start as a first pull request: a
bare origin whose main holds the tests (test-first), an agent's branch that creates the plan,
writes cli.py and completes it, and a CI clone running the action's script with the inputs the
README's job gives. The honest pull request passes; one that edits the test to match a wrong
answer fails, the recipe unchanged."""

import os
import re
import shlex
import shutil
import subprocess
import sys


from conftest import ROOT, copy_engine
from test_docs import README, fenced_blocks, read, section

TEST = ("import subprocess\nimport sys\n\n\n"
        "def test_version():\n"
        "    out = subprocess.run([sys.executable, 'cli.py', '--version'], capture_output=True,\n"
        "                         text=True).stdout\n"
        "    assert out.strip() == 'cli 1.0.0'\n")
CLI = "import sys\nif '--version' in sys.argv:\n    print('cli %s' % '{}')\n"


def readme_inputs():
    """The `with:` inputs of README's CI job, as the action's environment gets them."""
    job = fenced_blocks(section(read(README), "## CI"), "yaml")[0]
    block = job.split("with:\n", 1)[1]
    inputs, key = {}, None
    for line in block.splitlines():
        m = re.match(r"^ {10}([a-z-]+): *(\|)?(.*?)(?:\s+#.*)?$", line)
        if m:
            key = m.group(1)
            inputs[key] = "" if m.group(2) else m.group(3).strip()
        elif key and line.startswith(" " * 12):
            inputs[key] += line.strip() + "\n"
    return {f"FABLIZE_{k.upper().replace('-', '_')}": v.strip() for k, v in inputs.items()}


def readme_quick_start():
    """The quick start's engine commands, as README prints them (continuations joined)."""
    block = fenced_blocks(section(read(README), "## Quick start"), "console")[0]
    commands = [line[2:] for line in re.sub(r"\\\n\s*", " ", block).splitlines()
                if line.startswith("$ ")]
    return [shlex.split(c.split("  #")[0])[2:] for c in commands]


def env_for(home):
    venv_bin = os.path.dirname(sys.executable)  # python3 there has pytest, as CI installs it
    return {"HOME": str(home), "PATH": venv_bin + os.pathsep + os.environ["PATH"],
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"}


def sh(cwd, env, *args):
    p = subprocess.run(list(args), cwd=str(cwd), capture_output=True, text=True, env=env,
                       timeout=300)
    return p


def first_pull_request(tmp_path, version, test=TEST):
    home = tmp_path / "home"
    home.mkdir()
    env = env_for(home)
    origin, human, agent = tmp_path / "origin.git", tmp_path / "human", tmp_path / "agent"
    init = sh(tmp_path, env, "git", "init", "-q", "--bare", "-b", "main", str(origin))
    assert init.returncode == 0, init
    sh(tmp_path, env, "git", "clone", "-q", str(origin), str(human))
    copy_engine(human / "scripts")
    (human / "tests").mkdir()
    (human / "tests" / "test_cli.py").write_text(TEST)
    (human / ".gitignore").write_text("__pycache__/\n")
    for args in (["add", "-A"], ["commit", "-qm", "the test, first"], ["push", "-q", "origin",
                                                                         "main"]):
        assert sh(human, env, "git", *args).returncode == 0
    sh(tmp_path, env, "git", "clone", "-q", str(origin), str(agent))
    sh(agent, env, "git", "checkout", "-q", "-b", "pr")
    (agent / "cli.py").write_text(CLI.format(version))
    (agent / "tests" / "test_cli.py").write_text(test)
    for args in readme_quick_start():
        if args[:1] == ["checkpoint"] and "--evidence" not in args:
            continue  # the quick start's refusal, shown on purpose
        r = sh(agent, env, sys.executable, str(agent / "scripts" / "goals.py"), *args)
        assert r.returncode == 0, (args, r)
    for args in (["add", "-A"], ["commit", "-qm", "the work"], ["push", "-q", "origin", "pr"]):
        assert sh(agent, env, "git", *args).returncode == 0
    ci = tmp_path / "ci"
    sh(tmp_path, env, "git", "clone", "-q", str(origin), str(ci))
    sh(ci, env, "git", "checkout", "-q", "pr")
    action = tmp_path / "action"
    shutil.copytree(ROOT / "scripts", action / "scripts",
                    ignore=shutil.ignore_patterns("__pycache__"))
    summary = tmp_path / "summary.md"
    ci_env = dict(env, **readme_inputs(), FABLIZE_BASE="origin/main",
                  GITHUB_STEP_SUMMARY=str(summary))
    p = sh(ci, ci_env, "bash", str(action / "scripts" / "fablize-ci.sh"))
    return p, summary.read_text() if summary.exists() else ""


def test_readme_recipe_passes_the_quick_start_as_its_first_pull_request(tmp_path):
    assert readme_inputs()["FABLIZE_SCOPE"] == "cli.py"
    p, summary = first_pull_request(tmp_path, "1.0.0")
    assert p.returncode == 0, p
    assert summary.startswith("## ✅ re-witnessed"), summary
    assert "re-witnessed" in p.stdout


def test_readme_recipe_fails_a_pull_request_that_edits_the_test_to_match(tmp_path):
    p, summary = first_pull_request(tmp_path, "0.9.0", TEST.replace("cli 1.0.0", "cli 0.9.0"))
    assert p.returncode == 1, p
    assert summary.startswith("## ❌ audit failed") and "rerun_failed" in summary, summary
