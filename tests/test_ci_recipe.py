"""README's CI recipe, run as written on README's own quick start as a first pull request: a
bare origin whose main holds the stub and its test (test-first) and CI's audit as `setup github`
writes it; an agent's branch that creates the plan, writes cli.py and completes it; CI as the
written workflow, GitLab's recipe and the plain commands of docs/ci.md each run it. The honest
pull request passes; one that edits the test to match a wrong answer fails, the recipe unchanged.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, copy_engine, git, git_env
from test_docs import README, fenced_blocks, read, section

CI_PAGE = ROOT / "docs" / "ci.md"


def readme_quick_start():
    """The quick start's engine commands, as README prints them (continuations joined); the
    work it shows (cli.py written) is the pull request's own here."""
    block = fenced_blocks(section(read(README), "## Quick start"), "console")[0]
    commands = [line[2:] for line in re.sub(r"\\\n\s*", " ", block).splitlines()
                if line.startswith("$ python3 scripts/goals.py ")]
    return [shlex.split(c.split("  #")[0])[2:] for c in commands]


VENV_BIN = os.path.dirname(sys.executable)  # python3 there has pytest, as the workflow installs


def quick_start_files():
    """The two files README's quick start puts on main: the stub and its test."""
    stub, test = fenced_blocks(section(read(README), "## Quick start"), "python")[:2]
    return {"cli.py": stub, "tests/test_cli.py": test}


def readme_setup_github():
    """README's CI lines, as printed: setup github's arguments and the commit."""
    block = fenced_blocks(section(read(README), "## CI"), "sh")[0]
    lines = block.strip().splitlines()
    import shlex
    return shlex.split(lines[0])[2:], lines[1]


def env_for(home, **more):
    return dict(git_env(home), PATH=VENV_BIN + os.pathsep + os.environ["PATH"], **more)


class Project:
    """origin (bare), a human's main set up with `setup github`, the agent's branch, CI."""

    def __init__(self, top):
        self.top, self.home = top, top / "home"
        self.home.mkdir()
        self.origin = top / "origin.git"
        git(top, "init", "-q", "--bare", "-b", "main", str(self.origin))
        self.human = top / "human"
        git(top, "clone", "-q", str(self.origin), str(self.human))
        # GitHub's URL for reading (the owner setup names), the bare one for pushing
        git(self.human, "remote", "set-url", "origin", "https://github.com/alice/cli.git")
        git(self.human, "remote", "set-url", "--push", "origin", str(self.origin))
        copy_engine(self.human / "scripts")
        for rel, text in dict(quick_start_files(), **{".gitignore": "__pycache__/\n"}).items():
            (self.human / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.human / rel).write_text(text)

    def engine(self, at, *args):
        return subprocess.run([sys.executable, str(at / "scripts" / "goals.py"), *args],
                              cwd=str(at), capture_output=True, text=True,
                              env=env_for(self.home))

    def set_up(self):
        args, commit = readme_setup_github()
        r = self.engine(self.human, *args)
        assert r.returncode == 0, r
        git(self.human, "add", "-A")
        git(self.human, "commit", "-qm", "the stub, its test, the engine and CI's audit")
        git(self.human, "push", "-q", "origin", "main")
        return r

    def pull_request(self, version="1.0.0", test=None, after=None):
        """The agent's branch: README's quick start, as printed, its cli.py the work."""
        agent = self.top / "agent"
        git(self.top, "clone", "-q", str(self.origin), str(agent))
        git(agent, "checkout", "-q", "-b", "pr")
        (agent / "cli.py").write_text("import sys\n\nif '--version' in sys.argv:\n"
                                      f"    print('cli {version}')\n")
        if test:
            (agent / "tests" / "test_cli.py").write_text(test)
        for args in readme_quick_start():
            if args[:1] == ["checkpoint"] and "--evidence" not in args:
                continue  # the quick start's refusal, shown on purpose
            r = self.engine(agent, *args)
            assert r.returncode == 0, (args, r)
        if after:
            after(agent)
        git(agent, "add", "-A")
        git(agent, "commit", "-qm", "the work")
        git(agent, "push", "-q", "origin", "pr")

    def github(self):
        """CI: the pull request's merge commit checked out, as actions/checkout does, then the
        written workflow's steps in order. (exit code of the job, its summary)."""
        ci = self.top / "ci"
        git(self.top, "clone", "-q", str(self.origin), str(ci))
        git(ci, "checkout", "-q", "--detach", "origin/main")
        git(ci, "merge", "-q", "--no-ff", "--no-edit", "origin/pr")
        workflow = yaml.safe_load((ci / ".github" / "workflows" / "fablize.yml").read_text())
        assert workflow["permissions"] == {"contents": "read"}
        runner_temp = self.top / "runner-temp"
        runner_temp.mkdir()
        summary = self.top / "summary.md"
        github = env_for(self.home, GITHUB_ACTIONS="true", CI="true", GITHUB_BASE_REF="main",
                         GITHUB_EVENT_NAME="pull_request", RUNNER_TEMP=str(runner_temp),
                         GITHUB_STEP_SUMMARY=str(summary),
                         GITHUB_WORKFLOW_REF="alice/cli/.github/workflows/fablize.yml@"
                                             "refs/pull/1/merge")
        values = {"github.base_ref": "main", "runner.temp": str(runner_temp)}

        def filled(text):
            def one(m):
                assert m.group(1) in values, f"the workflow reads {m.group(1)}"
                return values[m.group(1)]
            return re.sub(r"\$\{\{\s*([\w.]+)\s*\}\}", one, str(text))

        p = None
        for step in workflow["jobs"]["audit"]["steps"]:
            if "uses" in step:
                assert step["uses"].split("@")[0] in ("actions/checkout", "actions/setup-python")
                continue  # checked out above; python3 is the one on PATH
            env = dict(github, **{k: filled(v) for k, v in (step.get("env") or {}).items()})
            cwd = filled(step.get("working-directory", str(ci)))
            p = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
                                filled(step["run"])], cwd=cwd, capture_output=True, text=True,
                               env=env, timeout=300)
            if p.returncode != 0:
                break
        return p, summary.read_text() if summary.exists() else ""




@pytest.fixture
def project(tmp_path):
    return Project(tmp_path)


def ci_clone(project, merge=True):
    """CI's checkout of the pull request: its merge into main (GitHub's refs/pull/N/merge), or
    its own tip (a merge-request pipeline), the base's branch fetched beside it."""
    ci = project.top / "ci"
    git(project.top, "clone", "-q", str(project.origin), str(ci))
    git(ci, "checkout", "-q", "--detach", "origin/main" if merge else "origin/pr")
    if merge:
        git(ci, "merge", "-q", "--no-ff", "--no-edit", "origin/pr")
    return ci


def gitlab(project):
    """GitLab's merge-request pipeline: docs/ci.md's job, its script run as GitLab runs it
    (one shell, -e and pipefail), with the variables GitLab sets."""
    block = fenced_blocks(section(read(CI_PAGE), "## GitLab CI"), "yaml")[0]
    job = yaml.safe_load(block)["fablize"]
    assert job["rules"] == [{"if": '$CI_PIPELINE_SOURCE == "merge_request_event"'}]
    ci = ci_clone(project, merge=False)
    base = git(ci, "merge-base", "origin/main", "origin/pr").strip()
    env = env_for(project.home, CI="true", GITLAB_CI="true",
                  CI_PIPELINE_SOURCE="merge_request_event", CI_MERGE_REQUEST_DIFF_BASE_SHA=base,
                  CI_MERGE_REQUEST_TARGET_BRANCH_NAME="main", **job.get("variables", {}))
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
                           "\n".join(job["script"])], cwd=str(ci), capture_output=True,
                          text=True, env=env, timeout=300)


def plain(project):
    """docs/ci.md's plain commands, in a checkout of the pull request with main fetched."""
    block = fenced_blocks(section(read(CI_PAGE), "## Any other CI"), "sh")[0]
    ci = ci_clone(project)
    return subprocess.run(["bash", "--noprofile", "--norc", "-c", block], cwd=str(ci),
                          capture_output=True, text=True, env=env_for(project.home, CI="true"),
                          timeout=300)


@pytest.mark.parametrize("ci", [gitlab, plain], ids=["gitlab", "plain commands"])
def test_the_quick_start_as_a_first_pull_request_passes_the_other_recipes(project, ci):
    project.set_up()
    project.pull_request()
    p = ci(project)
    assert p.returncode == 0, p
    assert "✅ re-witnessed" in p.stdout, p


@pytest.mark.parametrize("ci", [gitlab, plain], ids=["gitlab", "plain commands"])
def test_an_edited_test_fails_the_other_recipes(project, ci):
    project.set_up()
    test = quick_start_files()["tests/test_cli.py"].replace("cli 1.0.0", "cli 0.9.0")
    project.pull_request(version="0.9.0", test=test)
    p = ci(project)
    assert p.returncode == 1 and "base_test_changed" in p.stdout, p
