"""A verdict measured test by test (issue 40): every attack an agent with a shell on a pull-request
branch made green on undone work, and every honest pull request that failed, as a test against
real git — a bare origin, a main where a human committed the code, its tests, the plan and CI's
policy (every gate on), a pull-request branch, and CI emulated twice: the action's script
(scripts/fablize-ci.sh, with the engine kept outside the tree) and the engine's strictest audit
(`python3 -I`, its own copy). Each attack must fail both; each honest pull request must pass
both. Named by what they try.
"""

import atexit
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ENGINE, ROOT, copy_engine, git, git_env

PY = shlex.quote(sys.executable)
PYTEST = f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {PY} -m pytest -q -p no:cacheprovider"
BUGGY = "def mul(a, b):\n    return a + b\n"
FIXED = "def mul(a, b):\n    return a * b\n"
TEST = "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n\n\n" \
       "def test_zero():\n    assert mul(0, 0) == 0\n"
STRICTEST = ["audit", "--base", "origin/main", "--require-complete", "--require-witnessed",
             "--rerun", "all", "--require-scope", "--require-unchanged-checks",
             "--forbid-out-of-scope", "--require-fail-to-pass", "--forbid-tripwires"]
EVERY_GATE = {"fail_to_pass": True, "forbid_out_of_scope": True, "forbid_tripwires": True,
              "require_witnessed": True}


# rustup's cargo finds its toolchain under the user's home, which the tests' git_env replaces
RUST_ENV = {name: os.environ.get(name) or os.path.expanduser(f"~/.{name.split('_')[0].lower()}")
            for name in ("RUSTUP_HOME", "CARGO_HOME")}


def engine(cwd, home, *args, env=None):
    return subprocess.run([*ENGINE, *args], cwd=str(cwd), capture_output=True, text=True,
                          env=dict(git_env(home), **RUST_ENV, **(env or {})))


ORIGINS = {}


def origin(files, check, scope, policy):
    """A bare origin whose main holds `files`, a human's plan of two stories whose final check
    is `check`, with the `scope`, and the policy (`policy`, on top of every gate): built once a
    process for each layout and copied by every Repo that asks for it."""
    key = json.dumps([files, check, scope, policy], sort_keys=True)
    if key not in ORIGINS:
        top = Path(tempfile.mkdtemp(prefix="fablize-verdict-origin-"))
        atexit.register(shutil.rmtree, top, True)
        home, bare, human = top / "home", top / "origin.git", top / "human"
        home.mkdir()
        git(top, "init", "-q", "--bare", "-b", "main", str(bare))
        git(top, "clone", "-q", str(bare), str(human))
        for rel, text in dict({".gitignore": "__pycache__/\n"}, **files).items():
            (human / rel).parent.mkdir(parents=True, exist_ok=True)
            (human / rel).write_text(text)
        first = check[0] if isinstance(check, tuple) else check
        args = ["create", "--brief", "mul multiplies", "--goal", "fix::mul returns the product",
                "--goal", "verify::the tests pass", "--check", f"G001={first}"]
        for final in (check if isinstance(check, tuple) else (check,)):
            args += ["--verify", final]
        for path in scope:
            args += ["--scope", path]
        r = engine(human, home, *args)
        assert r.returncode == 0, r
        rules = dict(EVERY_GATE, scope=list(scope),
                     required_checks=[check[0] if isinstance(check, tuple) else check])
        rules.update(policy or {})
        (human / ".fablize" / "policy.json").write_text(json.dumps(rules) + "\n")
        git(human, "add", "-A")
        git(human, "commit", "-qm", "the plan, the tests and CI's policy")
        git(human, "push", "-q", "origin", "main")
        ORIGINS[key] = bare
    return ORIGINS[key]


class Repo:
    """origin (bare) with the human's main; the agent's branch `pr`; CI's clone and both audits."""

    def __init__(self, top, files=None, check=PYTEST + " tests", scope=("calc.py",), policy=None):
        self.top, self.home = top, top / "home"
        self.home.mkdir()
        files = files if files is not None else {"calc.py": BUGGY, "tests/test_calc.py": TEST}
        self.origin = top / "origin.git"
        shutil.copytree(origin(files, check, list(scope), policy), self.origin, symlinks=True)

    def branch(self, change=None, after=None, fix=True):
        """The agent's work: `change(tree)`, the plan completed (each checkpoint runs the frozen
        checks in the agent's own tree), `after(tree)` (what is committed need not be what the
        engine saw), committed and pushed as `pr`."""
        tree = self.top / "agent"
        git(self.top, "clone", "-q", str(self.origin), str(tree))
        git(tree, "checkout", "-q", "-b", "pr")
        if fix:
            (tree / "calc.py").write_text(FIXED)
        if change:
            change(tree)
        for sid in ("G001", "G002"):
            assert engine(tree, self.home, "next").returncode == 0
            r = engine(tree, self.home, "checkpoint", "--id", sid, "--status", "complete",
                       "--evidence", "the tests pass")
            assert r.returncode == 0, r  # whatever it did, it passes the agent's own runs
        if after:
            after(tree)
        git(tree, "add", "-A")
        git(tree, "commit", "-qm", "the work")
        git(tree, "push", "-q", "origin", "pr")
        return tree

    def ci(self):
        ci = self.top / "ci"
        if not ci.exists():
            git(self.top, "clone", "-q", str(self.origin), str(ci))
            git(ci, "checkout", "-q", "pr")
        return ci

    def recipe(self, env=None, **settings):
        """The action's script, as README's recipe runs it: (process, job summary)."""
        ci, action = self.ci(), self.top / "action"
        if not action.exists():
            shutil.copytree(ROOT / "scripts", action / "scripts")
        scratch = self.top / "runner-temp"
        scratch.mkdir(exist_ok=True)
        summary = self.top / "summary.md"
        if summary.exists():
            summary.unlink()
        run_env = dict(git_env(self.home), FABLIZE_BASE="origin/main", RUNNER_TEMP=str(scratch),
                       GITHUB_STEP_SUMMARY=str(summary), **RUST_ENV)
        run_env.update({f"FABLIZE_{k.upper()}": v for k, v in settings.items()})
        run_env.update(env or {})
        p = subprocess.run(["bash", str(action / "scripts" / "fablize-ci.sh")], cwd=str(ci),
                           capture_output=True, text=True, env=run_env)
        return p, summary.read_text() if summary.exists() else ""

    def strictest(self, *more, env=None):
        ci = self.ci()
        copy = self.top / "ci-engine" / "goals.py"
        if not copy.exists():
            copy_engine(copy.parent)
        return subprocess.run([sys.executable, "-I", str(copy), *STRICTEST, *more], cwd=str(ci),
                              capture_output=True, text=True,
                              env=dict(git_env(self.home), **RUST_ENV, **(env or {})))


def red_both(repo, *needles, recipe_env=None, strict=True):
    """The attack makes CI red both ways, each naming why."""
    p, summary = repo.recipe(env=recipe_env)
    assert p.returncode == 1, p
    assert summary.startswith("## ❌ audit failed"), summary
    for needle in needles:
        assert needle in p.stdout + p.stderr, (needle, p)
    if strict:
        s = repo.strictest()
        assert s.returncode == 1, s
        for needle in needles:
            assert needle in s.stdout + s.stderr, (needle, s)
    return p, summary


def green_both(repo, *more, recipe_env=None, strictest=True):
    p, summary = repo.recipe(env=recipe_env)
    assert p.returncode == 0, p
    assert summary.startswith("## ✅ re-witnessed"), summary
    if strictest:
        s = repo.strictest(*more)
        assert s.returncode == 0, s
    return p, summary


@pytest.fixture
def repo(tmp_path):
    return Repo(tmp_path)


# The honest pull request, and the outcome of each test compared #################################


def test_the_honest_pull_request_passes_the_recipe_and_the_strictest_audit(repo):
    repo.branch()
    p, summary = green_both(repo)
    assert "1 fixed (failed on the base, pass now)" in p.stdout, p
    assert summary.index("effective policy") < summary.index("| Story | Grade |"), summary
    assert "fail-to-pass: on — the policy on origin/main" in summary


def call_in_the_code(what):
    """In-scope code that, when the test calls it, turns the test into a skip or an expected
    failure: the runner's summary says `1 skipped`, no failure, exit 0."""
    return lambda tree: (tree / "calc.py").write_text(
        f"{what}\n\n\ndef mul(a, b):\n    if (a, b) == (2, 3):\n        skip_it('later')\n"
        "    return a * b if (a, b) != (2, 3) else a + b\n")


@pytest.mark.parametrize("what", [
    "from pytest import skip as skip_it",
    "from pytest import xfail as skip_it",
    "import unittest\nskip_it = getattr(unittest, 'Skip' + 'Test')\n"
    "skip_it = (lambda reason, e=skip_it: (_ for _ in ()).throw(e(reason)))",
], ids=["pytest.skip", "pytest.xfail", "SkipTest-assembled"])
def test_attack_the_code_under_test_skips_its_own_failing_test(repo, what):
    repo.branch(fix=False, change=call_in_the_code(what))
    p, summary = red_both(repo, "tests_not_passing",
                          "failed on the base and still do not pass (tests.test_calc::test_mul)")
    assert "tests_not_passing" in summary


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed here")
def test_attack_node_code_that_exits_0_when_its_test_file_imports_it(tmp_path):
    """The test file's tests never run: node reports the file itself as one passing test."""
    test = ("const test = require('node:test');\nconst assert = require('assert');\n"
            "const { mul } = require('../calc.js');\n"
            "test('mul', () => { assert.strictEqual(mul(2, 3), 6); });\n"
            "test('zero', () => { assert.strictEqual(mul(0, 0), 0); });\n")
    repo = Repo(tmp_path, files={"calc.js": "exports.mul = (a, b) => a + b;\n",
                                 "test/calc.test.js": test},
                check="node --test test/", scope=("calc.js",))
    repo.branch(fix=False, change=lambda t: (t / "calc.js").write_text(
        "process.exit(0);\nexports.mul = (a, b) => a * b;\n"))
    red_both(repo, "tests_not_passing", "vanished")


CARGO_TOML = '[package]\nname = "calc"\nversion = "0.1.0"\nedition = "2021"\n'
CARGO_TEST = ("#[test]\nfn mul() { assert_eq!(calc::mul(2, 3), 6); }\n"
              "#[test]\nfn zero() { assert_eq!(calc::mul(0, 0), 0); }\n")


@pytest.mark.skipif(shutil.which("cargo") is None, reason="cargo is not installed here")
def test_attack_a_rust_test_binary_that_exits_0_before_its_result_line(tmp_path):
    repo = Repo(tmp_path, files={"Cargo.toml": CARGO_TOML,
                                 "src/lib.rs": "pub fn mul(a: i32, b: i32) -> i32 { a + b }\n",
                                 "tests/calc.rs": CARGO_TEST, ".gitignore": "target/\n"},
                check="cargo test --offline", scope=("src/",))
    # the agent's own runs refuse it as CI does: it is committed after them
    lib = "pub fn mul(a: i32, b: i32) -> i32 {\n    %s\n    a * b\n}\n"
    repo.branch(fix=False, change=lambda t: (t / "src" / "lib.rs").write_text(lib % ""),
                after=lambda t: (t / "src" / "lib.rs").write_text(
                    lib % "if a == 2 { std::process::exit(0) }"))
    red_both(repo, "ended before its result line")


# What git shows is read as data, whatever the settings and the names ###########################

LOOKS_FOR_CI = "import os\n\nIN_CI = os.environ.get(\"CI\")\n\n\ndef mul(a, b):\n" \
               "    return a * b\n"


@pytest.mark.parametrize("how", ["a line starting with ++", "diff.noprefix", "mnemonicPrefix",
                                 "-diff attribute"])
def test_attack_a_tripwire_hidden_from_a_diff_is_still_found(tmp_path, how):
    repo = Repo(tmp_path, scope=("calc.py", ".gitattributes") if "attribute" in how
                else ("calc.py",))
    code = ('NOTE = """\n++ a line git prints as a file header\n"""\n' + LOOKS_FOR_CI
            if how.startswith("a line") else LOOKS_FOR_CI)

    def change(tree):
        (tree / "calc.py").write_text(code)
        if "attribute" in how:
            (tree / ".gitattributes").write_text("*.py -diff\n")
    repo.branch(fix=False, change=change)
    ci = repo.ci()
    if how == "diff.noprefix":
        git(ci, "config", "diff.noprefix", "true")
    elif how == "mnemonicPrefix":
        git(ci, "config", "diff.mnemonicPrefix", "true")
    red_both(repo, "tripwire", "calc.py:")


def test_attack_a_tripwire_in_a_file_whose_name_git_would_quote(tmp_path):
    repo = Repo(tmp_path, scope=("calc.py", "lib/"))
    repo.branch(fix=False, change=lambda t: (
        (t / "lib").mkdir(),
        (t / "lib" / "café\tnew\nline.py").write_text("import os\nos._exit(0)\n"),
        (t / "calc.py").write_text(FIXED)))
    red_both(repo, "tripwire", "ends the process")


def test_names_with_newlines_tabs_quotes_and_accents_are_built_and_judged_whole(tmp_path):
    """The re-run's trees are written from objects asked for by id: a name holding a newline
    shifts nothing, and the honest work beside it passes."""
    names = ["lib/a\nb.txt", "lib/tab\there.txt", "lib/quo\"te's.txt", "lib/naïve café.txt"]
    repo = Repo(tmp_path, scope=("calc.py", "lib/"))

    def change(tree):
        (tree / "lib").mkdir()
        for i, name in enumerate(names):
            (tree / name).write_text(f"{i}\n")
    repo.branch(change=change)
    p, summary = green_both(repo)
    assert "4 files taken" not in p.stdout and "5 files taken" in p.stdout, p


# The lists that missed names ###################################################################

DJANGO_TEST = ("import unittest\n\nfrom app.calc import mul\n\n\nclass T(unittest.TestCase):\n"
               "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n")


@pytest.mark.parametrize("name", ["tests.py", "calc_tests.py"])
def test_attack_a_django_style_test_module_inside_the_scope_is_edited(tmp_path, name):
    repo = Repo(tmp_path, files={"app/__init__.py": "", "app/calc.py": BUGGY,
                                 f"app/{name}": DJANGO_TEST},
                check=f"{PY} -m unittest app.{name[:-3]}", scope=("app/",))
    repo.branch(fix=False, change=lambda t: (t / "app" / name).write_text(
        DJANGO_TEST.replace("6)", "5)")))
    red_both(repo, "base_test_changed", f"app/{name}", "re-run failed")


def test_attack_a_pytest_toml_in_the_scope_deselects_the_failing_test(tmp_path):
    test = TEST.replace("from calc import", "from calc import")
    repo = Repo(tmp_path, files={"packages/a/calc.py": BUGGY, "packages/a/tests/test_calc.py":
                                 test}, check=f"cd packages/a && {PYTEST}",
                scope=("packages/a/",))
    repo.branch(fix=False, change=lambda t: (t / "packages" / "a" / "pytest.toml").write_text(
        '[pytest]\naddopts = ["-k", "not test_mul"]\npythonpath = ["."]\n'))
    red_both(repo, "packages/a/pytest.toml", "re-run failed")


def test_attack_a_module_named_like_an_installed_plugin_in_the_bases_pythonpath(tmp_path):
    """pytest's `pythonpath = src` puts src/ first on sys.path: a src/pytest_timeout.py would
    be the plugin CI installed."""
    files = {"src/calc.py": BUGGY, "tests/test_calc.py": TEST,
             "pytest.ini": "[pytest]\npythonpath = src\n"}
    repo = Repo(tmp_path, files=files, scope=("src/",))
    repo.branch(change=lambda t: (
        (t / "src" / "calc.py").write_text(FIXED),
        (t / "src" / "pytest_timeout.py").write_text("# nothing to see\n")))
    red_both(repo, "shadow", "src/pytest_timeout.py (pytest_timeout)")


# The policy cannot be dropped, moved or hidden #################################################


def test_attack_the_policy_turned_into_a_symlink_to_nothing(repo):
    def drop(tree):
        (tree / ".fablize" / "policy.json").unlink()
        (tree / ".fablize" / "policy.json").symlink_to("nowhere.json")
    repo.branch(after=drop)
    p, summary = red_both(repo, "policy_changed", ".fablize/policy.json")
    assert "fail-to-pass: on — the policy on origin/main" in p.stdout  # it still binds


def test_attack_the_state_folder_moved_so_that_no_policy_is_found(repo):
    """The branch's copy of another CI's script points the state elsewhere and accepts a new
    plan there: the policy is read at its one path on the base all the same."""
    def elsewhere(tree):
        shutil.copytree(tree / ".fablize", tree / "alt")
        (tree / "alt" / "policy.json").unlink()
    repo.branch(fix=False, change=lambda t: (t / "tests" / "test_calc.py").write_text(
        TEST.replace("== 6", "== 5")), after=elsewhere)
    p, summary = repo.recipe(state="alt", allow_new_plan="true")
    assert p.returncode == 1, p
    assert "fail-to-pass: on — the policy on origin/main" in p.stdout, p
    assert "base_test_changed" in p.stdout, p


def test_attack_a_workflow_that_names_another_base(repo):
    tree = repo.branch()
    git(tree, "push", "-q", "origin", "origin/main:refs/heads/loose")
    p, _ = repo.recipe(env={"GITHUB_ACTIONS": "true", "GITHUB_BASE_REF": "main"},
                       base="origin/loose")
    assert p.returncode == 1, p
    assert "--base origin/loose is not the pull request's base branch main" in p.stderr, p
    step = p.stderr.split("\n")[1]
    assert " audit " in step and "--base origin/main" in step, p


def test_a_policy_loosened_after_the_pin_is_named_in_every_later_audit(tmp_path):
    repo = Repo(tmp_path)
    human = tmp_path / "human"
    git(tmp_path, "clone", "-q", str(repo.origin), str(human))
    (human / ".fablize" / "policy.json").write_text('{"scope": ["calc.py"]}\n')
    git(human, "commit", "-qam", "loosen the policy")
    git(human, "push", "-q", "origin", "main")
    repo.branch()
    p, summary = repo.recipe()
    assert p.returncode == 0, p
    assert "last changed by" in summary and "(loosen the policy) — after the plan's pin" \
        in summary, summary

