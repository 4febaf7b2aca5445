"""CI in one command (issue 42): `setup github` writes the audit's workflow, CI's policy and the
CODEOWNERS lines; the workflow runs the engine the base commits. Tested end to end against real
git — a bare origin, a main set up with `setup github` and committed, a pull-request branch
that completes README's quick start — with CI emulated by running the written workflow's own
`run:` steps in order (parsed from the YAML), GitHub's variables set as GitHub sets them."""

import json
import re
import subprocess

import pytest

from conftest import ROOT, git
from test_ci_recipe import Project, env_for, quick_start_files, readme_setup_github
from test_docs import README


@pytest.fixture
def project(tmp_path):
    return Project(tmp_path)


def test_setup_github_writes_the_workflow_the_policy_and_codeowners_and_names_the_ruleset(
        project):
    r = project.set_up()
    human = project.human
    workflow = (human / ".github" / "workflows" / "fablize.yml").read_text()
    assert workflow.startswith("# Written by `fablize setup github`")
    assert 'git archive --format=tar "origin/$BASE_REF" -- scripts/fablize_gate scripts/goals.py' \
        in workflow
    assert "python3 -I" in workflow and "persist-credentials: false" in workflow
    policy = json.loads((human / ".fablize" / "policy.json").read_text())
    assert policy == {"scope": ["cli.py"], "required_checks": ["python3 -m pytest -q tests"],
                      "fail_to_pass": True, "forbid_out_of_scope": True, "forbid_tripwires": True,
                      "agent_tests": "prove"}
    owners = (human / ".github" / "CODEOWNERS").read_text()
    assert "/.github/ @alice\n/.fablize/policy.json @alice\n" in owners, owners
    assert "/scripts/goals.py @alice" in owners
    lines = r.stdout.rstrip("\n").split("\n")
    assert "Require workflows to pass before merging" in "\n".join(lines[-4:]), r.stdout
    assert lines[-1].startswith("  gh api --method POST repos/{owner}/{repo}/rulesets"), r.stdout
    again = project.engine(human, *readme_setup_github()[0])
    assert again.returncode == 0 and "nothing changed" in again.stdout, again


def test_the_quick_start_as_a_first_pull_request_passes_the_written_workflow(project):
    project.set_up()
    project.pull_request()
    p, summary = project.github()
    assert p.returncode == 0, p
    assert summary.startswith("## ✅ re-witnessed"), summary
    assert "engine: the engine the base commits (scripts/), file for file" in summary, summary
    assert "the pull request's copy, identical to the base's" in summary


def test_an_edited_test_fails_the_written_workflow(project):
    project.set_up()
    test = quick_start_files()["tests/test_cli.py"].replace("cli 1.0.0", "cli 0.9.0")
    project.pull_request(version="0.9.0", test=test)
    p, summary = project.github()
    assert p.returncode == 1, p
    assert summary.startswith("## ❌ audit failed") and "base_test_changed" in summary, summary


def test_a_branch_that_edits_the_workflow_is_named_in_the_verdict(project):
    project.set_up()
    project.pull_request(after=lambda t: (t / ".github" / "workflows" / "fablize.yml").write_text(
        (t / ".github" / "workflows" / "fablize.yml").read_text().replace(
            "--require-complete", "--allow-imported")))
    p, summary = project.github()
    assert p.returncode == 1, p
    verdict = summary.split("\n", 1)[0]
    assert "policy_changed" in verdict, summary
    assert "which differs from the base's (policy_changed)" in summary


def test_doctor_github_passes_once_committed_and_names_the_step_for_a_missing_policy(project):
    project.set_up()
    r = project.engine(project.human, "doctor", "github")
    assert r.returncode == 0, r
    assert "cannot be checked from a clone" in r.stdout and "pytest: read test by test" in r.stdout
    git(project.human, "rm", "-q", ".fablize/policy.json")
    r = project.engine(project.human, "doctor", "github")
    assert r.returncode == 1 and ".fablize/policy.json does not exist" in r.stdout, r
    # no plan to read the policy from: the step gives what setup cannot go without
    assert r.stderr.rstrip().endswith(
        'setup github --scope <path> --required-check "<test command>"'), r


def test_setup_github_remove_leaves_what_the_user_had(project):
    human = project.human
    (human / ".github").mkdir()
    mine = "# our reviewers\n*.md @docs-team"  # no final newline: given back byte for byte
    (human / ".github" / "CODEOWNERS").write_text(mine)
    args = readme_setup_github()[0]
    r = project.engine(human, *args)
    assert r.returncode == 0, r
    assert "@docs-team" in (human / ".github" / "CODEOWNERS").read_text()
    r = project.engine(human, "setup", "github", "--remove")
    assert r.returncode == 0, r
    assert (human / ".github" / "CODEOWNERS").read_text() == mine
    assert not (human / ".github" / "workflows").exists()
    assert (human / ".fablize" / "policy.json").exists() and "kept" in r.stdout


def test_setup_github_refuses_a_workflow_that_is_not_its_own_and_writes_nothing(project):
    human = project.human
    (human / ".github" / "workflows").mkdir(parents=True)
    (human / ".github" / "workflows" / "fablize.yml").write_text("name: mine\n")
    r = project.engine(human, *readme_setup_github()[0])
    assert r.returncode == 1 and "is not fablize's" in r.stderr, r
    assert not (human / ".fablize" / "policy.json").exists()
    assert (human / ".github" / "workflows" / "fablize.yml").read_text() == "name: mine\n"


def test_no_placeholder_owner_in_readme_the_docs_or_what_setup_writes(project):
    project.set_up()
    for path in [README, ROOT / "README.ko.md", *sorted((ROOT / "docs").glob("*.md")),
                 *sorted((project.human / ".github").rglob("*"))]:
        if path.is_file():
            assert "<owner>" not in path.read_text(errors="replace"), path


def test_setup_github_takes_the_policy_from_the_plan_its_refusal_names(project):
    """Without --scope and --required-check, the policy is the plan's scope and its final
    story's frozen checks: the plan the refusal says to make first is read, not skipped."""
    human = project.human
    r = project.engine(human, "setup", "github")
    assert r.returncode == 2 and "make the plan with them first" in r.stderr, r
    assert not (human / ".fablize" / "policy.json").exists()
    r = project.engine(human, "create", "--brief", "the version flag", "--scope", "cli.py",
                       "--goal", "version::cli --version prints it", "--verify",
                       "python3 -m pytest -q tests")
    assert r.returncode == 0, r
    r = project.engine(human, "setup", "github")
    assert r.returncode == 0, r
    policy = json.loads((human / ".fablize" / "policy.json").read_text())
    assert policy["scope"] == ["cli.py"], policy
    assert policy["required_checks"] == ["python3 -m pytest -q tests"], policy


def tree(top):
    """Every file of the checkout but git's own and bytecode, with its bytes, and what git
    holds of them: what a refused or read-only command must leave as it was."""
    files = {str(p.relative_to(top)): p.read_bytes() for p in sorted(top.rglob("*"))
             if p.is_file() and ".git" not in p.relative_to(top).parts[:1]
             and "__pycache__" not in p.parts}
    return files, git(top, "status", "--porcelain", "--untracked-files=all")


def shell(project, command):
    """A printed step, run as a person pastes it: a shell in the human's checkout."""
    return subprocess.run(["bash", "--noprofile", "--norc", "-c", command],
                          cwd=str(project.human), capture_output=True, text=True,
                          env=env_for(project.home), timeout=120)


FILLED = {"<@owner>": "@alice", "<path>": "cli.py",
          '"<test command>"': '"python3 -m pytest -q tests"'}


def filled(step):
    """A printed step with each placeholder given the value a person would type."""
    for placeholder, value in FILLED.items():
        step = step.replace(placeholder, value)
    assert "<" not in step, step
    return step


def not_on_github(project):
    """origin read from a forge that is not GitHub: no owner to read from it."""
    git(project.human, "remote", "set-url", "origin", "https://git.example.com/alice/cli.git")


@pytest.mark.parametrize("left, item, said", [
    (".github/workflows/fablize.yml", "workflow", ".github/workflows/fablize.yml is not committed"),
    (".github/CODEOWNERS", "codeowners", ".github/CODEOWNERS is not committed"),
    ("scripts", "engine", "scripts/goals.py and scripts/fablize_gate are not committed")])
def test_doctor_github_flags_what_ci_reads_from_the_base_when_it_is_not_committed(
        project, left, item, said):
    """CI and GitHub read the workflow, the engine, the policy and CODEOWNERS from the branch
    that becomes the base: one that only this checkout holds is a gap, as an uncommitted
    policy is, and the step doctor names commits it."""
    human = project.human
    r = project.engine(human, *readme_setup_github()[0])
    assert r.returncode == 0, r
    git(human, "add", "-A")
    git(human, "rm", "-r", "-q", "--cached", "--", left)
    git(human, "commit", "-qm", "everything but " + left)
    before = tree(human)
    r = project.engine(human, "doctor", "github")
    assert r.returncode == 1, r
    assert f"  ✗ {item}: {said} here" in r.stdout, r
    assert "github is wired and the state is healthy" not in r.stdout + r.stderr, r
    assert r.stderr.startswith("fablize: doctor: 1 problem — ") and said in r.stderr, r
    assert tree(human) == before, "doctor changed the checkout"
    fix = re.search(rf"  ✗ {item}: .* — fix: `([^`]+)` on the default branch", r.stdout)
    assert fix and fix.group(1).startswith("git add ") and left in fix.group(1), r.stdout
    assert r.stderr.splitlines()[1:] == ["  " + fix.group(1)], r  # the step, on its own line
    committed = shell(project, fix.group(1))
    assert committed.returncode == 0, committed
    r = project.engine(human, "doctor", "github")
    assert r.returncode == 0 and "github is wired and the state is healthy" in r.stdout, r


@pytest.mark.parametrize("start", [
    readme_setup_github()[0],
    ["setup", "github"],
    ["setup", "github", "--owner", "@alice"],
    ["setup", "github", "--scope", "cli.py"]])
def test_setup_github_steps_walked_as_printed_converge_without_github_or_a_plan(project, start):
    """Each refusal's step is the command as given with what is missing added, every gap at
    once: followed as printed (placeholders filled in), the steps end in a setup that runs,
    never meeting the same refusal twice — none drops what the user already said."""
    not_on_github(project)
    said, command = [], None
    for _ in range(4):
        before = tree(project.human)
        r = project.engine(project.human, *start) if command is None else shell(project, command)
        if r.returncode == 0:
            break
        assert r.returncode == 2, r
        message, *steps = r.stderr.rstrip("\n").split("\n")
        assert message.startswith("fablize: setup github: ") and message not in said, (said, r)
        assert tree(project.human) == before, "a refused setup changed the checkout"
        said.append(message)
        command = filled(steps[-1].strip())
    assert r.returncode == 0, (said, r)
    assert len(said) <= 1, said  # everything missing is named by the first refusal
    owners = (project.human / ".github" / "CODEOWNERS").read_text()
    assert "/.github/ @alice" in owners, owners
    policy = json.loads((project.human / ".fablize" / "policy.json").read_text())
    assert policy["scope"] == ["cli.py"], policy
    assert policy["required_checks"] == ["python3 -m pytest -q tests"], policy


def test_setup_github_names_every_option_it_lacks_in_one_refusal(project):
    not_on_github(project)
    before = tree(project.human)
    r = project.engine(project.human, "setup", "github")
    assert r.returncode == 2, r
    assert ("CI's policy needs what the work may change and the check that proves it; "
            "CODEOWNERS needs who reviews changes to the audit") in r.stderr, r
    assert r.stderr.rstrip().endswith(
        'setup github --scope <path> --required-check "<test command>" --owner <@owner>'), r
    assert tree(project.human) == before
    j = project.engine(project.human, "--json", "setup", "github")
    assert j.returncode == 2 and json.loads(j.stdout)["error"]["code"] == "policy_unknown", j
    r = project.engine(project.human, "setup", "github", "--scope", "cli.py",
                       "--required-check", "python3 -m pytest -q tests")
    j = project.engine(project.human, "--json", "setup", "github", "--scope", "cli.py",
                       "--required-check", "python3 -m pytest -q tests")
    assert r.returncode == 2 and json.loads(j.stdout)["error"]["code"] == "bad_owner", j
    assert tree(project.human) == before


def test_doctor_github_names_a_setup_step_that_runs_as_printed_without_github(project):
    """Where origin is not on GitHub, bare `setup github` is refused (no owner to read): the
    step doctor names — how to make the workflow required, and the fix of a missing policy —
    carries what setup cannot go without here."""
    not_on_github(project)
    human = project.human
    r = project.engine(human, *readme_setup_github()[0], "--owner", "@alice")
    assert r.returncode == 0, r
    git(human, "add", "-A")
    git(human, "commit", "-qm", "CI's audit")
    r = project.engine(human, "doctor", "github")
    assert r.returncode == 0, r
    step = re.search(r"✓ ruleset: .*\(`([^`]+)` prints how\)", r.stdout)
    assert step and step.group(1).endswith("setup github --owner <@owner>"), r.stdout
    p = shell(project, filled(step.group(1)))
    assert p.returncode == 0 and "Require workflows to pass before merging" in p.stdout, p
    git(human, "rm", "-q", ".fablize/policy.json")
    git(human, "commit", "-qm", "no policy")
    r = project.engine(human, "doctor", "github")
    assert r.returncode == 1 and ".fablize/policy.json does not exist" in r.stdout, r
    p = shell(project, filled(r.stderr.rstrip().split("\n")[-1].strip()))
    assert p.returncode == 0 and "CI's policy — scope cli.py" in p.stdout, p


def test_doctor_github_names_the_policy_options_when_the_plan_cannot_be_read(project):
    """With no policy, setup reads the plan's scope and checks; a plan it cannot read does not
    stop doctor, whose step gives them, so setup never reads the plan."""
    project.set_up()
    human = project.human
    git(human, "rm", "-q", ".fablize/policy.json")
    git(human, "commit", "-qm", "no policy")
    (human / ".fablize").mkdir()
    (human / ".fablize" / "goals.json").write_text("{not json")
    (human / ".fablize" / "ledger.jsonl").write_text("not a ledger\n")
    before = tree(human)
    r = project.engine(human, "doctor", "github")
    assert r.returncode == 1 and ".fablize/policy.json does not exist" in r.stdout, r
    assert tree(human) == before
    step = r.stderr.rstrip().split("\n")[-1].strip()
    assert step.endswith('setup github --scope <path> --required-check "<test command>"'), r
    p = shell(project, filled(step))
    assert p.returncode == 0 and "CI's policy — scope cli.py" in p.stdout, p
