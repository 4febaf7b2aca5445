"""Shared test harness: run the engine in-process (fast) or as a real subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "goals.py"
# the interpreter that runs the engine in subprocess tests: `make test` also runs them on the
# oldest supported Python (3.9) where one is installed
ENGINE_PYTHON = os.environ.get("FABLIZE_TEST_PYTHON") or sys.executable
sys.path.insert(0, str(SCRIPT.parent))

import goals  # noqa: E402

# The engine in a subprocess, started as the installed command and the plugin start it: imported,
# its bytecode cached. Python compiles a script at every start (~55 ms, and the suite starts the
# engine some 650 times); `python3 scripts/goals.py` itself is tested where it is the subject
# (test_smoke, test_compat, test_wiring, test_cancel).
ENGINE = [ENGINE_PYTHON, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); import goals; "
          "goals.run()", str(SCRIPT.parent)]
# the cache written once here, even where PYTHONDONTWRITEBYTECODE is set (a changed goals.py is
# recompiled by the import anyway: the cache records the source's mtime and size)
subprocess.run([ENGINE_PYTHON, "-c", "import importlib.util, py_compile, sys; p = sys.argv[1]; "
                "py_compile.compile(p, cfile=importlib.util.cache_from_source(p), doraise=True)",
                str(SCRIPT)], check=True)


ENGINE_FILES = [SCRIPT, SCRIPT.parent / "fablize.py", *sorted(SCRIPT.parent.glob("fablize_*.py"))]


def copy_engine(folder):
    """The engine's files (the core, its launcher and its rooms) copied into `folder`, as a user
    copies them into a repository or CI keeps its own copy; returns the copy of goals.py."""
    import shutil
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for path in ENGINE_FILES:
        shutil.copy(path, folder / path.name)
    return folder / "goals.py"


class Result:
    def __init__(self, code, out, err):
        self.code, self.out, self.err = code, out, err

    @property
    def json(self):
        return json.loads(self.out)

    def __repr__(self):
        return f"Result(code={self.code}, out={self.out[-2000:]!r}, err={self.err[-2000:]!r})"


def state_files(state_dir):
    """Every file under the state directory with its bytes (the lock file excluded): compare
    before/after a refused command to prove nothing changed."""
    state_dir = Path(state_dir)
    if not state_dir.exists():
        return {}
    return {str(p.relative_to(state_dir)): p.read_bytes()
            for p in sorted(state_dir.rglob("*")) if p.is_file() and p.name != "lock"}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A fresh repository root (it has a .git directory) as the current directory."""
    for var in ("FABLIZE_DIR", "FABLIZE_CRASH_AT", "FABLIZE_LOCK_TIMEOUT", "GITHUB_STEP_SUMMARY",
                "FABLIZE_GUARD_MAX"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / ".git").mkdir()
    monkeypatch.chdir(tmp_path)
    # in-process, the engine names itself `goals.py` in what it prints; how it names itself when
    # really started (installed, plugin, script) is tested through subprocesses
    monkeypatch.setattr(goals, "invocation", lambda cwd=None: "goals.py")
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # whatever a test puts on it goes again
    goals._SECRETS.clear()  # made once a process: each test's environment has its own secrets
    return tmp_path


@pytest.fixture
def fab(project, capsys):
    """fab("status", "--json") runs goals.main in-process; returns Result(code, out, err)."""
    def run(*args):
        code = goals.main([str(a) for a in args])
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)
    run.dir = project / ".fablize"
    run.root = project
    return run


def run_cli(*args, cwd, env=None, input=None, timeout=120):
    """The real entry point in a subprocess."""
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith("FABLIZE_") and k != "GITHUB_STEP_SUMMARY"}
    full_env.update(env or {})
    p = subprocess.run([*ENGINE, *[str(a) for a in args]], cwd=str(cwd),
                       env=full_env, input=input, capture_output=True, timeout=timeout)
    return Result(p.returncode, p.stdout.decode("utf-8", "replace"),
                  p.stderr.decode("utf-8", "replace"))


def make_plan(fab, n=3, *extra):
    """create a plan of n stories S1..Sn; extra options are passed to create."""
    goals_args = []
    for i in range(1, n + 1):
        goals_args += ["--goal", f"S{i}::objective {i}"]
    r = fab("create", "--brief", "test plan", *goals_args, *extra)
    assert r.code == 0, r
    return r


def complete(fab, sid, final=False):
    """next + complete the story `sid` (which must be the one next hands out)."""
    r = fab("next")
    assert r.code == 0 and f"handoff — {sid}" in r.out, r
    args = ["checkpoint", "--id", sid, "--status", "complete", "--evidence", f"{sid} done"]
    if final:
        args += ["--verify-cmd", "pytest -q", "--verify-evidence", "3 passed"]
    r = fab(*args)
    assert r.code == 0, r
    return r


def snapshot(state_dir):
    """goals.json, its stories with every field (the snapshot holds only those that differ from
    their defaults): what a test reads of a story."""
    snap = json.loads((Path(state_dir) / "goals.json").read_text(encoding="utf-8"))
    snap["goals"] = [goals.touch(story) for story in snap["goals"]]
    return snap


def ledger(state_dir):
    return [json.loads(line) for line in (Path(state_dir) / "ledger.jsonl").read_text().splitlines()]


def assert_refused(fab, args, code, *fragments):
    """`fab(*args)` exits `code`, says each fragment on stderr, and changes no state file."""
    before = state_files(fab.dir)
    r = fab(*args)
    assert r.code == code, r
    for fragment in fragments:
        assert fragment in r.err, r
    assert state_files(fab.dir) == before
    return r
