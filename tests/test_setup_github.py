"""CI in one command (issue 42): `setup github` writes the audit's workflow, CI's policy and the
CODEOWNERS lines; the workflow runs the engine the base commits. Tested end to end against real
git — a bare origin, a main set up with `setup github` and committed, a pull-request branch
that completes README's quick start — with CI emulated by running the written workflow's own
`run:` steps in order (parsed from the YAML), GitHub's variables set as GitHub sets them."""

import json

import pytest

from conftest import ROOT, git
from test_ci_recipe import Project, quick_start_files, readme_setup_github
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
    assert r.stderr.rstrip().endswith("setup github"), r


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
