"""Shared test harness: run the engine in-process (fast) or as a real subprocess, and the
helpers every test file uses instead of its own copy — one refusal check (assert_refused), one
forger's ledger surgery (rechain, forge) and one git."""

import atexit
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "goals.py"
# the interpreter that runs the engine in subprocess tests: `make test` also runs them on the
# oldest supported Python (3.9) where one is installed
ENGINE_PYTHON = os.environ.get("FABLIZE_TEST_PYTHON") or sys.executable
sys.path.insert(0, str(SCRIPT.parent))
# `python3` in a check or a printed command is this interpreter's, as in an activated venv: found
# first on PATH, it starts at once, where a version manager's shim (pyenv's) costs ~0.15 s a start
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

# Every process a test starts carries this mark in its environment (git_env passes it on too):
# when the session ends, one still running is a process a test left behind (see
# pytest_sessionfinish). Set before xdist starts its workers, so one mark a whole run.
SESSION_MARK = "FZTEST_SESSION"
os.environ.setdefault(SESSION_MARK, f"{os.getpid()}-{os.urandom(6).hex()}")

import fablize_gate  # noqa: E402  (the engine package beside goals.py)
from fablize_gate import (audit, base, cli, commands, history, hooks, masking,  # noqa: E402
                          merge, model, render, reports, rerun, runs, setup, sharing, sharing_git,
                          storage, trust)

MODULES = [fablize_gate, base, masking, model, reports, storage, history, runs, render, hooks,
           commands, cli, setup, sharing, sharing_git, merge, rerun, trust, audit]


def group_members(pgid):
    """Live (not zombie) pids of the run-like process group `pgid`, which leads its own session,
    as the engine sees them (runs.group_members); [] where /proc cannot tell."""
    return engine.group_members(pgid) or []


def group_alive(pgid):
    """Whether a process of the group still runs; where /proc cannot tell, whether the group
    can still be signalled."""
    if engine.group_members(pgid) is not None:
        return bool(group_members(pgid))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def process_running(pid):
    """Whether `pid` runs (a zombie does not), as the engine tells (storage.process_alive)."""
    return engine.process_alive(pid)


class EngineView:
    """The engine's modules as one namespace to read, for tests: `engine.misfit` is
    model.misfit, `engine.main` cli.main. Read-only: a test replaces a name with
    `replace_everywhere`, which says that it touches every module holding it."""
    __slots__ = ()

    def __getattr__(self, name):
        for module in MODULES:
            if name in vars(module):
                return vars(module)[name]
        raise AttributeError(f"no engine module defines {name}")

    def __setattr__(self, name, value):
        raise AttributeError(f"engine.{name} is read-only: replace_everywhere(monkeypatch, "
                             f"{name!r}, …) replaces it in each module that imported it")

    @staticmethod
    def room(name, needed_by=None):
        """A room's module: setup, sharing, merge or trust."""
        return vars(fablize_gate)[name]


engine = EngineView()


def replace_everywhere(monkeypatch, name, value):
    """Replace the engine's `name` with `value` in every module holding the same object (each
    module imports what it uses by name), through `monkeypatch`, which puts each back."""
    old = getattr(engine, name)
    for module in MODULES:
        if vars(module).get(name, value) is old:
            monkeypatch.setattr(module, name, value)

# The engine in a subprocess, started as users start it: `python3 scripts/goals.py`, the package's
# bytecode cached (written once here, even where PYTHONDONTWRITEBYTECODE is set: a changed module
# is recompiled by the import anyway, the cache records the source's mtime and size).
ENGINE = [ENGINE_PYTHON, str(SCRIPT)]
subprocess.run([ENGINE_PYTHON, "-m", "compileall", "-q", str(SCRIPT.parent / "fablize_gate")],
               check=True)


ENGINE_DIR = SCRIPT.parent / "fablize_gate"
# the engine's files: the entry, the launcher of hooks written by 3.0, and the package
ENGINE_FILES = [SCRIPT, SCRIPT.parent / "fablize.py", *sorted(ENGINE_DIR.glob("*.py"))]
# CI's recipe, what action.yml runs: beside it, outside the folder a user copies
CI_SCRIPT = ROOT / "fablize-ci.sh"


def copy_engine(folder, bytecode=True):
    """The engine (goals.py and its folder fablize_gate/, and fablize.py for hooks written by
    3.0) copied into `folder`, as a user copies it into a repository or CI keeps its own copy;
    returns the copy of goals.py. With `bytecode`, the package's compiled modules come along
    (each source keeps its mtime, so Python takes them): a copy's first start then does not
    compile 12,000 lines (~0.3 s of CPU; the suite makes ~150 copies)."""
    folder = Path(folder)
    (folder / "fablize_gate").mkdir(parents=True, exist_ok=True)
    for path in ENGINE_FILES:
        shutil.copy2(path, folder / path.relative_to(SCRIPT.parent))
    if bytecode:
        shutil.copytree(ENGINE_DIR / "__pycache__", folder / "fablize_gate" / "__pycache__",
                        dirs_exist_ok=True)
    return folder / "goals.py"


def copy_action(folder, bytecode=True):
    """The action's checkout as its steps see it ($GITHUB_ACTION_PATH): action.yml and the CI
    script beside it at the top, the engine in scripts/; returns the copy of the CI script."""
    folder = Path(folder)
    copy_engine(folder / "scripts", bytecode)
    for name in ("action.yml", CI_SCRIPT.name):
        shutil.copy2(ROOT / name, folder / name)
    return folder / CI_SCRIPT.name


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
    replace_everywhere(monkeypatch, "invocation", lambda cwd=None: "goals.py")
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # whatever a test puts on it goes again
    return tmp_path


@pytest.fixture
def fab(project, capsys):
    """fab("status", "--json") runs engine.main in-process; returns Result(code, out, err)."""
    def run(*args):
        code = engine.main([str(a) for a in args])
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)
    run.dir = project / ".fablize"
    run.root = project
    return run


def run_cli(*args, cwd, env=None, input=None, timeout=120, engine=None, isolated=False,
            inherit=True):
    """The real entry point in a subprocess: the repository's engine (started as an import, its
    bytecode cached) or `engine`, a copy of goals.py started as a script — with `isolated`, under
    `python -I`, as CI runs its own copy. Its environment is this one's without the FABLIZE_
    settings, updated with `env`; with inherit=False, `env` alone (CI's clean environment)."""
    if inherit:
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith("FABLIZE_") and k != "GITHUB_STEP_SUMMARY"}
        full_env.update(env or {})
    else:
        full_env = dict(env or {})
    start = ENGINE if engine is None else [ENGINE_PYTHON, *(["-I"] if isolated else []),
                                           str(engine)]
    p = subprocess.run([*start, *[str(a) for a in args]], cwd=str(cwd),
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


def start(fab, sid, *extra):
    """`next` (with `extra`), which must hand out the story `sid`."""
    r = fab("next", *extra)
    assert r.code == 0 and f"handoff — {sid} " in r.out, r
    return r


def two_stories_second_active(fab, *extra):
    """A plan of two stories (`extra` passed to create): G001 complete, G002, the final story,
    in progress."""
    make_plan(fab, 2, *extra)
    complete(fab, "G001")
    start(fab, "G002")


STORY_ROW = re.compile(r"^  (\S) (G\d{3}) \[(\w+)\] (.*)$")


def rows(out):
    """The `  MARK ID [status] title` lines of a status output, as tuples."""
    return [m.groups() for m in map(STORY_ROW.match, out.splitlines()) if m]


RAW_CONTROLS = ("\x1b", "\r", "\x07", "\x00", "\x7f", "\x9b", "\u202e")


def assert_escaped(text):
    """No raw terminal control (escape, CR, bell, NUL, DEL, CSI, a bidi override) in `text`."""
    for c in RAW_CONTROLS:
        assert c not in text, f"raw {c!r} in output: {text!r}"


def snapshot(state_dir):
    """goals.json, its stories with every field (the snapshot holds only those that differ from
    their defaults): what a test reads of a story."""
    snap = json.loads((Path(state_dir) / "goals.json").read_text(encoding="utf-8"))
    snap["goals"] = [engine.touch(story) for story in snap["goals"]]
    return snap


def story(state_dir, sid):
    """The story `sid` of the snapshot, with every field."""
    return next(s for s in snapshot(state_dir)["goals"] if s["id"] == sid)


def ledger(state_dir):
    text = (Path(state_dir) / "ledger.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def assert_refused(fab, args, exit_code, *fragments, error=None):
    """`fab(*args)` is refused: it exits `exit_code`, says `fablize: ` and each fragment on stderr,
    and changes not one state file. With `error`, the same command under `--json` is refused
    alike, as one JSON object naming that stable error code, and again changes nothing."""
    before = state_files(fab.dir)
    r = fab(*args)
    assert r.code == exit_code, r
    assert r.err.startswith("fablize: "), r
    for fragment in fragments:
        assert fragment in r.err, r
    assert state_files(fab.dir) == before, "a refused command changed the state"
    if error is not None:
        j = fab("--json", *args)
        assert j.code == exit_code, j
        assert j.json["ok"] is False and j.json["error"]["code"] == error, j
        assert j.json["error"]["exit"] == exit_code, j
        assert state_files(fab.dir) == before, "a refused command (--json) changed the state"
    return r


# Ledger surgery: what a forger who read DESIGN.md writes by hand. Lines are encoded and hashed
# here, with json and hashlib, not by the engine's own code: a forgery must not share its bugs.


def encode(ev):
    """An event as the engine writes it: compact JSON, UTF-8, no ASCII escapes."""
    return json.dumps(ev, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def sha256_hex(data):
    return hashlib.sha256(data).hexdigest()


def raw_lines(state_dir):
    """The ledger's lines as bytes, without their newlines."""
    return (Path(state_dir) / "ledger.jsonl").read_bytes().split(b"\n")[:-1]


def write_lines(state_dir, lines):
    (Path(state_dir) / "ledger.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))


def rechain(entries, encode=encode):
    """Ledger lines (bytes, no newline) for `entries`, each chained to the one before it (its
    prev), so that every chain check passes and only the content lies. An event (a dict) is
    numbered by its place (seq; a run's log "AUTO" becomes the path the engine gives it) and
    encoded by `encode`; a line (bytes) keeps every byte but its prev."""
    out, head = [], "0" * 64
    for entry in entries:
        if isinstance(entry, bytes):
            line, found = re.subn(rb'"prev":"[0-9a-f]{64}"', b'"prev":"%s"' % head.encode(),
                                  entry, count=1)
            assert found, entry
        else:
            ev = dict(entry, seq=len(out) + 1, prev=head)
            if ev.get("log") == "AUTO":
                ev["log"] = f"runs/{ev['seq']}-{ev['id']}.log"
            line = encode(ev)
        head = sha256_hex(line)
        out.append(line)
    return out


# every field fablize writes for an event of these kinds, where a forged one does not say: the
# rule under test is then what speaks, not a missing field
FORGED_DEFAULTS = {
    "verify_run": {"cwd": "/tmp", "git_head": None, "git_dirty": None, "log": "AUTO"},
    "checkpoint": {"verify_cmd": "", "verify_evidence": ""},
    "story_started": {"title": "S1", "agent": None},
}


def forge(state_dir, **fields):
    """Append one event after the ledger's last line, with the next seq, a timestamp, the right
    prev and every field fablize writes for its kind; returns its seq."""
    lines = raw_lines(state_dir)
    ev = {"seq": len(lines) + 1, "ts": engine.now_iso(), **fields,
          "prev": sha256_hex(lines[-1]) if lines else "0" * 64}
    defaults = dict(FORGED_DEFAULTS.get(ev.get("event"), {}))
    if ev.get("event") == "verify_run":
        defaults["started"] = ev["ts"]  # a run started when its event was written
    for key, value in defaults.items():
        ev.setdefault(key, value)
    if ev.get("log") == "AUTO":
        ev["log"] = f"runs/{ev['seq']}-{ev['id']}.log"
    with open(Path(state_dir) / "ledger.jsonl", "ab") as f:
        f.write(encode(ev) + b"\n")
    return ev["seq"]


# git, the same for every test #################################################################

# HOME for git: an empty folder of this run's own, so nothing of the machine's user is read
GIT_HOME = Path(tempfile.mkdtemp(prefix="fablize-tests-home-"))
atexit.register(shutil.rmtree, GIT_HOME, True)


def git_env(home=None):
    """The environment a test's git runs in (and an engine a test runs beside it, where it needs
    the same): HOME is `home` or an empty folder, no system or global git configuration, one
    author and committer, and never a prompt."""
    return {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(home or GIT_HOME),
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_TERMINAL_PROMPT": "0", SESSION_MARK: os.environ[SESSION_MARK],
            "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}


def git(cwd, *args, home=None, check=True):
    """`git ARGS` in `cwd`, under git_env(home); returns its stdout as text, after asserting that
    it exited 0. With check=False, the finished process (returncode, stdout, stderr as text),
    whatever its exit."""
    p = subprocess.run(["git", *args], cwd=str(cwd), env=git_env(home), capture_output=True,
                       stdin=subprocess.DEVNULL, timeout=120)
    p.stdout = p.stdout.decode("utf-8", "surrogateescape")
    p.stderr = p.stderr.decode("utf-8", "replace")
    if not check:
        return p
    assert p.returncode == 0, (args, p.stderr)
    return p.stdout


def pytest_collection_modifyitems(items):
    """The tests marked slow (a virtual environment built, a 16-process shared plan) run first:
    started at once, each on a worker, they do not end the run alone while the other idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def processes_left_behind(workers):
    """The processes still running that carry this session's mark, but for the session's own
    (this process and, with `workers`, its children: xdist's workers): each was started by a
    test that did not end it. A process that dropped its environment (started with an env of
    its own that leaves the mark out) is not seen."""
    mark = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode()
    me = os.getpid()
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if int(pid) != me and not (workers and parent == me):
            left.append((int(pid), parent, command))
    return left


def pytest_sessionfinish(session, exitstatus):
    """A process a test started and did not end (a `git daemon`, a check's process group) fails
    the run, named, and is ended here. Where /proc is not there to read, nothing is checked."""
    if hasattr(session.config, "workerinput") or not os.path.isdir("/proc"):
        return
    workers = session.config.pluginmanager.hasplugin("dsession")  # pytest-xdist's, with -n
    for _ in range(20):  # a process killed at a test's end may take a moment to be gone
        left = processes_left_behind(workers)
        if not left:
            return
        time.sleep(0.1)
    for pid, _, _ in left:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"{len(left)} process(es) left running by the tests (ended now):",
                            red=True)
        for pid, parent, command in left:
            reporter.write_line(f"  pid {pid} (parent {parent}): {command[:200]}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
