"""Issue 7: install it the way its users work — block installer, pip, plugin, Windows, consoles."""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (ENGINE_FILES, ROOT, SCRIPT, complete, engine, make_plan,
                      replace_everywhere, run_cli, state_files)

BEGIN, END = "<!-- fablize:begin -->", "<!-- fablize:end -->"
CLI = f"python3 {SCRIPT}"


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FABLIZE_") and k != "GITHUB_STEP_SUMMARY"}
    env.update(extra)
    return env


# install-block ##############################################################


def expected_block():
    """fablize-block.md, with the command a clone of the project can run: the script installing
    it lives outside the project, so that is the `fablize` command, never an absolute path."""
    return engine.room("setup").render_block("fablize")


def test_install_block_creates_claude_md_at_the_repository_root(fab, monkeypatch):
    sub = fab.root / "src" / "deep"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    r = fab("install-block")
    assert r.code == 0, r
    target = fab.root / "CLAUDE.md"
    text = target.read_text(encoding="utf-8")
    assert text == expected_block()
    assert text.startswith(BEGIN + "\n") and text.endswith(END + "\n")
    assert "`fablize next`" in text and str(SCRIPT) not in text
    assert not (fab.root / "CLAUDE.md.fablize-backup").exists()  # nothing to back up
    assert not (sub / "CLAUDE.md").exists()


ORIGINALS = {
    "trailing_newline": b"# Project\n\nUse tabs.\n",
    "no_trailing_newline": b"# Project\n\nUse tabs.",
    "crlf": b"# Project\r\n\r\nUse tabs.\r\n",
    "unicode": "# 프로젝트\n\n규칙 ✓ — ünïcode\n".encode("utf-8"),
    "empty": b"",
}


@pytest.mark.parametrize("name", ["CLAUDE.md", "AGENTS.md"])
@pytest.mark.parametrize("original", list(ORIGINALS), ids=list(ORIGINALS))
def test_install_block_three_times_then_remove_restores_the_original_bytes(fab, name, original):
    original = ORIGINALS[original]
    target = fab.root / name
    target.write_bytes(original)
    args = ["install-block"] if name == "CLAUDE.md" else ["install-block", name]
    installed = None
    for i in range(3):
        r = fab(*args)
        assert r.code == 0, r
        data = target.read_bytes()
        text = data.decode("utf-8")
        assert text.count(BEGIN) == 1 and text.count(END) == 1
        assert data.startswith(original)  # other bytes unchanged
        assert text[text.index(BEGIN):] == expected_block()
        if installed is None:
            installed = data
            backup = fab.root / (name + ".fablize-backup")
            assert backup.read_bytes() == original
        assert data == installed  # running again changes nothing
    r = fab(*args, "--remove")
    assert r.code == 0, r
    assert target.read_bytes() == original
    assert (fab.root / (name + ".fablize-backup")).read_bytes() == installed


def test_install_block_replaces_an_existing_block_in_place(fab):
    before = "# Rules\n\nintro\n"
    after = "## More rules\n\noutro\n"
    stale = f"{BEGIN}\nrun python3 /old/place/goals.py next\n{END}\n"
    target = fab.root / "CLAUDE.md"
    target.write_text(before + stale + after, encoding="utf-8")
    for _ in range(3):
        assert fab("install-block").code == 0
        assert target.read_text(encoding="utf-8") == before + expected_block() + after
    assert (fab.root / "CLAUDE.md.fablize-backup").read_text(encoding="utf-8") == \
        before + stale + after
    assert fab("install-block", "--remove").code == 0
    assert target.read_text(encoding="utf-8") == before + after


def test_install_block_keeps_text_added_after_the_block(fab):
    target = fab.root / "CLAUDE.md"
    target.write_bytes(b"intro\n")
    assert fab("install-block").code == 0
    with open(target, "ab") as f:
        f.write(b"added later\n")
    grown = target.read_bytes()
    for _ in range(2):
        assert fab("install-block").code == 0
        assert target.read_bytes() == grown
    assert fab("install-block", "--remove").code == 0
    text = target.read_text(encoding="utf-8")
    assert BEGIN not in text and END not in text
    assert text.startswith("intro\n") and text.endswith("added later\n")


def test_install_block_keeps_the_file_mode(fab):
    target = fab.root / "CLAUDE.md"
    target.write_text("x\n")
    target.chmod(0o600)
    assert fab("install-block").code == 0
    assert target.stat().st_mode & 0o777 == 0o600


def test_install_block_remove_without_a_file_creates_nothing(fab):
    r = fab("install-block", "--remove")
    assert r.code == 0 and "nothing changed" in r.out, r
    assert not (fab.root / "CLAUDE.md").exists()


def refusal_files(root):
    """Every entry of the project (a symlink as its target, a directory as None) with its bytes."""
    return {p.name: (os.readlink(p) if p.is_symlink() else None if p.is_dir() else p.read_bytes())
            for p in sorted(Path(root).iterdir()) if p.name != ".git"}


@pytest.mark.parametrize("case", ["symlink", "latin1", "nul", "begin_without_end",
                                  "two_blocks", "directory"])
@pytest.mark.parametrize("remove", [False, True])
def test_install_block_refuses_and_leaves_the_file_unchanged(fab, case, remove):
    target = fab.root / "CLAUDE.md"
    if case == "symlink":
        (fab.root / "real.md").write_text("real\n")
        target.symlink_to("real.md")
        why = "is a symlink — refusing to write through it"
    elif case == "latin1":
        target.write_bytes("caf\xe9 rules\n".encode("latin-1"))
        why = "is not UTF-8 text"
    elif case == "nul":
        target.write_bytes(b"rules\x00more\n")
        why = "holds NUL bytes"
    elif case == "begin_without_end":
        target.write_text(f"intro\n{BEGIN}\nhalf a block\n")
        why = "broken or repeated fablize block"
    elif case == "two_blocks":
        target.write_text(f"{BEGIN}\na\n{END}\n{BEGIN}\nb\n{END}\n")
        why = "broken or repeated fablize block"
    else:
        target.mkdir()
        why = "is not a regular file"
    before = refusal_files(fab.root)
    r = fab("install-block", *(["--remove"] if remove else []))
    assert r.code == 1, r
    assert r.err.startswith("fablize: ") and why in r.err, r
    assert refusal_files(fab.root) == before
    j = fab("install-block", "--json").json
    assert j["ok"] is False and j["error"]["exit"] == 1


# pip install: one fresh venv ##############################################

COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", ".fablize",
                                     ".pytest_cache", ".hypothesis", ".benchmarks", "__pycache__")
ENVIRONMENT_TROUBLE = ("Could not find a version", "No matching distribution", "Network",
                       "Connection", "Temporary failure", "ensurepip", "timed out")


def setup_step(cmd):
    try:
        p = subprocess.run(cmd, capture_output=True, timeout=600, env=clean_env())
    except subprocess.TimeoutExpired:
        pytest.skip(f"cannot install here: `{' '.join(cmd[-2:])}` timed out")
    return p.returncode, (p.stdout + p.stderr).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv with the checkout pip-installed into it (from a copy of the checkout, so
    the build leaves nothing in the working tree). The venv is made without its own pip when
    this pip can install into another interpreter (--python): ensurepip is the slow part."""
    base = tmp_path_factory.mktemp("pip")
    checkout = base / "checkout"
    shutil.copytree(ROOT, checkout, ignore=COPY_IGNORE, symlinks=True)
    env_dir = base / "venv"
    python = str(env_dir / "bin" / "python")
    install = ["install", "-q", "--disable-pip-version-check", str(checkout)]
    code, out = setup_step([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    if code == 0:
        code, out = setup_step([sys.executable, "-m", "pip", "--python", python, *install])
        if code != 0 and "no such option" in out:  # an older pip: the venv gets its own
            code, out = setup_step([python, "-m", "ensurepip", "-q"])
            if code == 0:
                code, out = setup_step([python, "-m", "pip", *install])
    if code != 0:
        if any(t in out for t in ENVIRONMENT_TROUBLE):
            pytest.skip(f"cannot install here (environment): {out.strip()[-300:]}")
        pytest.fail(f"creating the venv or `pip install {checkout}` failed:\n{out[-3000:]}")
    return env_dir / "bin"


def installed(bin_dir, *args, cwd):
    p = subprocess.run([str(bin_dir / "fablize"), *map(str, args)], cwd=str(cwd),
                       env=clean_env(), capture_output=True, timeout=120)
    return p.returncode, p.stdout.decode("utf-8"), p.stderr.decode("utf-8")


@pytest.mark.slow
def test_pip_install_gives_a_fablize_command_that_drives_a_plan_from_another_directory(
        venv, tmp_path):
    """One test for the whole venv, so that even split across workers it is built once."""
    code, out, err = installed(venv, "--version", cwd=tmp_path)
    assert code == 0 and out == f"fablize {engine.__version__}\n", (out, err)

    project = tmp_path / "elsewhere"
    (project / ".git").mkdir(parents=True)
    code, out, err = installed(venv, "create", "--brief", "installed", "--goal", "A::a",
                               "--goal", "B::b", cwd=project)
    assert code == 0 and "fablize: plan created — 2 stories" in out, err
    code, out, err = installed(venv, "next", cwd=project)
    assert code == 0 and "=== fablize handoff — G001 A" in out, err
    assert "On completion: fablize checkpoint --id G001" in out  # names itself as installed
    code, out, err = installed(venv, "status", "--json", cwd=project)
    assert code == 0, err
    status = json.loads(out)
    assert status["ok"] is True and [s["status"] for s in status["stories"]] == \
        ["in_progress", "pending"]
    assert (project / ".fablize" / "ledger.jsonl").is_file()
    assert installed(venv, "checkpoint", "--id", "G001", "--status", "complete", "--evidence",
                     "did a", cwd=project)[0] == 0
    assert installed(venv, "next", cwd=project)[0] == 0
    code, out, err = installed(venv, "checkpoint", "--id", "G002", "--status", "complete",
                               "--evidence", "gate", "--run", "--verify-cmd", "true",
                               cwd=project)
    assert code == 0 and "all stories complete ✓" in out, (out, err)
    assert installed(venv, "audit", "--require-complete", cwd=project)[0] == 0
    # the same state, read by the uninstalled script: one engine, two entry points
    assert run_cli("audit", "--require-complete", cwd=project).code == 0

    # what was installed is scripts/goals.py itself and its rooms, and nothing they depend on
    probe = ("import fablize_gate, json; from importlib.metadata import files, requires; "
             "print(json.dumps([fablize_gate.__file__, requires('fablize-gate'), "
             "[str(f) for f in files('fablize-gate')]]))")
    p = subprocess.run([str(venv / "python"), "-c", probe], cwd=str(tmp_path), env=clean_env(),
                       capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    module, requires, files = json.loads(p.stdout)
    package = Path(module).parent
    assert package.name == "fablize_gate" and not requires
    payload = sorted(f for f in files if ".dist-info/" not in f and "__pycache__" not in f)
    engine_files = sorted(p.name for p in (SCRIPT.parent / "fablize_gate").glob("*.py"))
    assert payload == ["../../../bin/fablize"] + [f"fablize_gate/{n}" for n in engine_files]
    for name in engine_files:  # byte for byte
        assert (package / name).read_bytes() == (SCRIPT.parent / "fablize_gate" / name).read_bytes()


def off_path(bin_dir, home, **extra):
    """The environment of a shell whose PATH lacks the installed command's folder (pipx's
    ~/.local/bin before `pipx ensurepath`, pip --user's before the profile names it)."""
    env = clean_env(HOME=str(home), **extra)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if Path(p).resolve() != bin_dir.resolve()
                                  and not (Path(p) / "fablize").exists())
    return env


@pytest.mark.slow
def test_the_installed_command_off_path_names_what_puts_it_on_path_not_a_copy_it_lacks(
        venv, tmp_path):
    """`fablize setup claude` run by its full path while its folder is not on PATH: the wiring
    would run a `fablize` the shell cannot find. The wheel holds no goals.py, so the copy a
    checkout names (`cp -r …/site-packages/goals.py …`) would fail: it names the step that puts
    the folder on PATH — the `export` line for a pip install, `pipx ensurepath` in a pipx venv
    (which pipx marks with pipx_metadata.json; pipx itself is not installed here) — and writes
    nothing. Outside a repository it refuses as a copy does: one git rule."""
    home = tmp_path / "home"
    home.mkdir()
    project = tmp_path / "proj"
    project.mkdir()
    env = off_path(venv, home)

    def fablize(*args, cwd=project):
        p = subprocess.run([str(venv / "fablize"), *args], cwd=str(cwd), env=env,
                           capture_output=True, text=True, timeout=120)
        return p.returncode, p.stdout, p.stderr
    for args in (["setup", "claude"], ["doctor", "claude"]):
        code, out, err = fablize(*args)
        assert code == 1 and f"{project} is not a git repository" in err, (out, err)
        assert err.endswith(":\n  git init\n"), err
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    code, out, err = fablize("setup", "claude")
    assert code == 1 and out == "", (out, err)
    assert "installed but not on PATH here" in err and "nothing was written" in err, err
    assert "goals.py" not in err and "cp -r" not in err, err
    step = err.splitlines()[-1].strip()
    assert step == f'export PATH={venv}:"$PATH"', err
    assert sorted(p.name for p in project.iterdir()) == [".git"]
    marker = venv.parent / "pipx_metadata.json"
    marker.write_text("{}")
    try:
        code, out, err = fablize("setup", "claude")
        assert code == 1 and err.splitlines()[-1] == "  pipx ensurepath", err
        assert "pipx put it in " + str(venv) in err, err
    finally:
        marker.unlink()
    # the step, as named, and the command runs: setup wires the project
    p = subprocess.run(["bash", "-c", f"{step} && fablize setup claude"], cwd=str(project),
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "fablize: CLAUDE.md: the fablize block added" in p.stdout, p


def test_the_script_runs_without_installing_anything(tmp_path):
    """No site-packages at all (-S): the single file needs nothing but the standard library."""
    (tmp_path / ".git").mkdir()

    def script(*args):
        return subprocess.run([sys.executable, "-I", "-S", str(SCRIPT), *args], cwd=str(tmp_path),
                              env=clean_env(), capture_output=True, timeout=60)
    p = script("--version")
    assert p.returncode == 0 and p.stdout == f"fablize {engine.__version__}\n".encode()
    assert script("create", "--brief", "b", "--goal", "A::a").returncode == 0
    p = script("status", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["total"] == 1


def test_scripts_holds_only_what_a_user_copies():
    """scripts/ is what a user copies: goals.py, the engine's folder and the launcher hooks
    written by 3.0 run — no developer tool (they live in tools/, CI's script beside action.yml)."""
    held = sorted(p.relative_to(ROOT) for p in (ROOT / "scripts").rglob("*")
                  if p.is_file() and not {"__pycache__"} & set(p.parts)
                  and not any(part.endswith(".egg-info") for part in p.parts))
    assert held == sorted(p.relative_to(ROOT) for p in ENGINE_FILES), held
    assert (ROOT / "tools" / "bench.py").is_file() and (ROOT / "fablize-ci.sh").is_file()
    assert (ROOT / "action.yml").is_file()


def lone_copy(tmp_path, *left_out, engine=True):
    """A git project holding a copy of goals.py in its scripts/, with the engine's folder beside
    it (less the files `left_out`) when `engine`."""
    project = tmp_path / "proj"
    (project / "scripts").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    shutil.copy(SCRIPT, project / "scripts" / "goals.py")
    if engine:
        shutil.copytree(SCRIPT.parent / "fablize_gate", project / "scripts" / "fablize_gate",
                        ignore=shutil.ignore_patterns("__pycache__", *left_out))

    def script(*args):
        return subprocess.run([sys.executable, "-I", "scripts/goals.py", *args], cwd=str(project),
                              env=clean_env(), capture_output=True, text=True, timeout=60)
    return project, script


def test_a_goals_py_without_its_engine_says_what_to_copy_in_one_line_and_writes_nothing(
        tmp_path):
    project, script = lone_copy(tmp_path, engine=False)
    before = sorted(p.relative_to(project) for p in project.rglob("*") if ".git" not in p.parts)
    for args in (("status",), ("create", "--brief", "b", "--goal", "A::a"), ("setup", "claude")):
        r = script(*args)
        assert r.returncode == 2 and r.stdout == "", r
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith("fablize: the engine's folder fablize_gate/ is not beside "
                                   "goals.py"), r.stderr
        assert ("cp -r FABLIZE/scripts/goals.py FABLIZE/scripts/fablize_gate scripts/"
                in r.stderr), r.stderr
    after = sorted(p.relative_to(project) for p in project.rglob("*") if ".git" not in p.parts)
    assert after == before


def test_a_copied_goals_py_and_its_folder_run_the_originals_commands(tmp_path):
    project, script = lone_copy(tmp_path)
    assert script("create", "--brief", "b", "--goal", "A::a", "--goal", "B::b").returncode == 0
    assert script("next").returncode == 0
    assert script("checkpoint", "--id", "G001", "--status", "complete",
                  "--evidence", "e").returncode == 0
    assert script("status").returncode == 0 and script("audit").returncode == 0


def test_a_users_files_beside_goals_py_or_on_the_path_never_stand_in_for_the_engine(tmp_path):
    """goals.py loads its engine from its own folder alone: a user's json.py beside it (which
    the standard library's would otherwise lose to: the script's folder comes first on
    sys.path) and another fablize_gate on PYTHONPATH are never imported."""
    project, _ = lone_copy(tmp_path)
    trap = "raise SystemExit('fablize: the wrong {} was imported')\n"
    (project / "scripts" / "json.py").write_text(trap.format("json"))
    elsewhere = tmp_path / "elsewhere" / "fablize_gate"
    elsewhere.mkdir(parents=True)
    (elsewhere / "__init__.py").write_text(trap.format("fablize_gate"))
    env = clean_env(PYTHONPATH=str(elsewhere.parent))
    for args in (["create", "--brief", "b", "--goal", "A::a"], ["status"]):
        p = subprocess.run([sys.executable, "scripts/goals.py", *args], cwd=str(project),
                           env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "wrong" not in p.stderr, p


def test_setup_with_a_room_missing_writes_nothing(tmp_path):
    project, script = lone_copy(tmp_path, "merge.py")  # a copy of the folder without merge.py
    r = script("setup", "claude")
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr == ("fablize: merge.py is missing from the engine's folder fablize_gate/ — "
                        "copy goals.py and fablize_gate/ from fablize's scripts/ folder together "
                        "(README: Add it to your project).\n"  # then the step, the human's
                        f'  cp "<fablize>/scripts/fablize_gate/merge.py" '
                        f"{project / 'scripts' / 'fablize_gate'}/\n"), r.stderr
    assert not (project / "CLAUDE.md").exists() and not (project / ".claude").exists()
    assert not (project / ".fablize").exists() and not (project / ".gitattributes").exists()


# Windows: the lock without fcntl #########################################


@pytest.fixture
def no_fcntl(monkeypatch):
    replace_everywhere(monkeypatch, "flock_module", lambda: None)


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_lock_fallback_is_an_owner_file_with_the_pid_removed_afterwards(fab, no_fcntl,
                                                                        monkeypatch):
    make_plan(fab, 2)
    owner = fab.dir / "lock.owner"
    seen = []
    load = engine.Transaction.load

    def spy(self):
        seen.append(owner.read_text())
        return load(self)
    monkeypatch.setattr(engine.Transaction, "load", spy)
    assert fab("next").code == 0
    assert seen == [str(os.getpid())]
    assert not owner.exists()
    assert not (fab.dir / "lock").exists()  # the flock file is not used at all
    r = fab("checkpoint", "--id", "G009", "--status", "complete", "--evidence", "x")
    assert r.code == 1 and "G009 not found." in r.err
    assert not owner.exists()  # released on a refusal too


def test_lock_fallback_removes_a_stale_lock_of_a_dead_process_and_says_so(fab, no_fcntl):
    make_plan(fab, 2)
    pid = dead_pid()
    owner = fab.dir / "lock.owner"
    owner.write_text(str(pid))
    r = fab("next")
    assert r.code == 0, r
    assert f"removed a stale lock left by process {pid}" in r.err
    assert "=== fablize handoff — G001" in r.out
    assert not owner.exists()


def test_lock_fallback_waits_for_a_live_owner_then_times_out_naming_it(fab, no_fcntl,
                                                                       monkeypatch):
    make_plan(fab, 2)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE)
    try:
        owner = fab.dir / "lock.owner"
        owner.write_text(str(holder.pid))
        monkeypatch.setenv("FABLIZE_LOCK_TIMEOUT", "0.05")
        before = state_files(fab.dir)
        r = fab("next")
        assert r.code == 3, r
        assert f"(process {holder.pid})" in r.err and "FABLIZE_LOCK_TIMEOUT" in r.err
        assert "stale" not in r.err
        assert state_files(fab.dir) == before  # the live owner's file is left alone
        assert fab("next", "--json").json["error"]["code"] == "lock_timeout"
    finally:
        holder.stdin.close()
        holder.wait()


# consoles that are not UTF-8 #############################################


@pytest.fixture
def every_mark(fab):
    """A plan whose status shows ✓ ▶ · ✗ ■."""
    goals_args = []
    for i in range(1, 7):
        goals_args += ["--goal", f"S{i}::o{i}"]
    assert fab("create", "--brief", "marks", "--parallel", *goals_args).code == 0
    for agent in ("a", "b", "c", "d"):
        assert fab("next", "--agent", agent).code == 0
    fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "x", "--agent", "a")
    fab("checkpoint", "--id", "G002", "--status", "failed", "--evidence", "x", "--agent", "b")
    fab("checkpoint", "--id", "G003", "--status", "blocked", "--evidence", "x", "--agent", "c")
    return fab


def run_on_console(monkeypatch, encoding, argv):
    out = io.TextIOWrapper(io.BytesIO(), encoding=encoding)
    err = io.TextIOWrapper(io.BytesIO(), encoding=encoding)
    with monkeypatch.context() as m:  # undone here, before capsys restores its own streams
        m.setattr(sys, "stdout", out)
        m.setattr(sys, "stderr", err)
        code = engine.main(argv)
        out.flush()
        err.flush()
    return code, out.buffer.getvalue(), err.buffer.getvalue()


@pytest.mark.parametrize("encoding", ["cp949", "cp1252"])
def test_status_on_a_non_utf8_console_writes_utf8_marks(every_mark, monkeypatch, encoding):
    code, out, err = run_on_console(monkeypatch, encoding, ["status"])
    assert code == 0, err
    text = out.decode("utf-8")
    for line in ("  ✓ G001 [complete]", "  ✗ G002 [failed]", "  ■ G003 [blocked]",
                 "  ▶ G004 [in_progress]", "  · G005 [pending]"):
        assert line in text


@pytest.mark.parametrize("encoding", ["cp949", "cp1252"])
def test_other_output_on_a_non_utf8_console_is_utf8(every_mark, monkeypatch, encoding):
    code, out, _ = run_on_console(monkeypatch, encoding, ["report"])
    assert code == 0 and "█" in out.decode("utf-8") and "■ blocked" in out.decode("utf-8")
    code, out, _ = run_on_console(monkeypatch, encoding, ["status", "--json"])
    assert code == 0 and json.loads(out.decode("utf-8"))["done"] == 1
    code, out, err = run_on_console(monkeypatch, encoding, ["decide", "--id", "G001", "retry",
                                                           "--note", "é ✓"])
    assert code == 1 and "fablize: G001 is complete — `decide` applies" in err.decode("utf-8")


@pytest.mark.parametrize("encoding", ["cp1252", "cp949"])
def test_a_subprocess_with_a_non_utf8_io_encoding_prints_utf8(every_mark, encoding):
    r = run_cli("status", cwd=every_mark.root, env={"PYTHONIOENCODING": encoding})
    assert r.code == 0 and "Traceback" not in r.err, r
    assert "\ufffd" not in r.out
    for mark in "✓▶·✗■":
        assert f"  {mark} G00" in r.out


# --version, --help ##########################################################


def test_version_prints_the_engine_version(fab):
    r = fab("--version")
    assert r.code == 0 and r.out == f"fablize {engine.__version__}\n", r
    assert re.fullmatch(r"\d+\.\d+\.\d+", engine.__version__)


def test_help_lists_every_command_with_its_summary(fab):
    r = fab("--help")
    assert r.code == 0, r
    text = "".join(r.out.split())  # argparse may wrap (even after a hyphen); the words stay
    parser = engine.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    summaries = {c.dest: c.help for c in sub._choices_actions}
    assert set(summaries) == set(engine.command_names())
    for name, summary in summaries.items():
        assert summary and name + "".join(summary.split()) in text, name


def test_help_gives_each_command_exactly_one_line_at_80_columns(fab, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    lines = fab("--help").out.splitlines()
    for name in engine.command_names():
        i = next(i for i, line in enumerate(lines) if line.split()[:1] == [name])
        assert len(lines[i].split()) > 1, f"{name}: summary not on its line"
        assert not lines[i + 1].startswith(" " * 8), f"{name}: summary wraps: {lines[i + 1]!r}"


# the Claude Code plugin #####################################################

PLUGIN_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


def load_json(rel):
    return json.loads((ROOT / rel).read_text(encoding="utf-8"))


def test_plugin_manifest_has_the_documented_fields():
    manifest = load_json(".claude-plugin/plugin.json")
    assert PLUGIN_NAME.match(manifest["name"])
    assert manifest.get("version", engine.__version__) == engine.__version__
    for key in ("commands", "agents", "skills", "hooks", "mcpServers"):
        paths = manifest.get(key, [])
        for path in [paths] if isinstance(paths, str) else paths:
            if isinstance(path, str):  # custom paths are relative and start with ./
                assert path.startswith("./") and (ROOT / path).exists(), (key, path)
    assert (ROOT / "hooks" / "hooks.json").is_file()  # the default hooks location


def test_marketplace_entry_has_the_documented_fields():
    market = load_json(".claude-plugin/marketplace.json")
    manifest = load_json(".claude-plugin/plugin.json")
    assert PLUGIN_NAME.match(market["name"])
    assert isinstance(market["owner"]["name"], str) and market["owner"]["name"].strip()
    entries = [p for p in market["plugins"] if p["name"] == manifest["name"]]
    assert len(entries) == 1
    source = entries[0]["source"]
    assert isinstance(source, str) and source.startswith("./")
    assert (ROOT / source / ".claude-plugin" / "plugin.json").is_file()


def hook_commands(event):
    config = load_json("hooks/hooks.json")
    groups = config["hooks"][event]
    commands = []
    for group in groups:
        for hook in group["hooks"]:
            assert hook["type"] == "command"
            assert isinstance(hook.get("timeout", 1), (int, float))
            commands.append(hook["command"])
    return groups, commands


def test_hooks_file_registers_the_guard_and_the_session_start_status():
    groups, commands = hook_commands("Stop")
    assert commands == ['"${CLAUDE_PLUGIN_ROOT}/bin/fablize" guard --plugin']  # the plugin's own
    groups, commands = hook_commands("SessionStart")
    assert commands == ['"${CLAUDE_PLUGIN_ROOT}/bin/fablize" status --resume --plugin']
    for group in groups:  # SessionStart matchers are the documented sources
        assert set(group.get("matcher", "startup").split("|")) <= {
            "startup", "resume", "clear", "compact"}


def run_hook(event, project, payload):
    (command,) = hook_commands(event)[1]
    command = command.replace("${CLAUDE_PLUGIN_ROOT}", str(ROOT))
    p = subprocess.run(command, shell=True, cwd=str(project), input=json.dumps(payload).encode(),
                       capture_output=True, timeout=60,
                       env=clean_env(CLAUDE_PLUGIN_ROOT=str(ROOT), CLAUDE_PROJECT_DIR=str(project)))
    return p.returncode, p.stdout.decode("utf-8"), p.stderr.decode("utf-8")


def session_start(project, source="startup"):
    return run_hook("SessionStart", project, {
        "session_id": "abc123", "transcript_path": "/tmp/abc123.jsonl", "cwd": str(project),
        "hook_event_name": "SessionStart", "source": source})


def stop(project, active=False):
    return run_hook("Stop", project, {
        "session_id": "abc123", "transcript_path": "/tmp/abc123.jsonl", "cwd": str(project),
        "permission_mode": "default", "hook_event_name": "Stop", "stop_hook_active": active})


@pytest.mark.parametrize("source", ["startup", "compact"])
def test_session_start_hook_prints_status_and_the_active_handoff(fab, source):
    make_plan(fab, 3)
    complete(fab, "G001")
    fab("next")
    code, out, err = session_start(fab.root, source)
    assert code == 0, err
    assert out.startswith("fablize: 1/3 complete — test plan\n")
    assert "  1 complete · 1 in progress · 1 pending\n" in out  # counts, not every story
    assert "=== fablize handoff — G002 S2" in out and "⚠ Resumed" in out


def test_session_start_hook_without_an_active_story_prints_status_only(fab):
    make_plan(fab, 3)
    code, out, err = session_start(fab.root)
    assert code == 0 and "fablize: 0/3 complete" in out and "handoff" not in out, err


@pytest.mark.parametrize("state", ["no_state_dir", "empty_state_dir"])
def test_session_start_hook_prints_nothing_without_a_plan(project, state):
    if state == "empty_state_dir":
        (project / ".fablize").mkdir()
    code, out, err = session_start(project)
    assert (code, out, err) == (0, "", "")


def test_stop_hook_blocks_while_work_is_left_and_allows_otherwise(fab):
    code, out, _ = stop(fab.root)
    assert (code, out) == (0, "")  # no plan
    make_plan(fab, 2)
    fab("next")
    code, out, _ = stop(fab.root)
    block = json.loads(out)
    assert code == 0 and block["decision"] == "block"
    assert "fablize checkpoint --id G001 --status complete" in block["reason"]
    fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "x")
    code, out, _ = stop(fab.root, active=True)
    assert json.loads(out)["decision"] == "block" and "fablize next" in out
    complete(fab, "G002", final=True)
    code, out, _ = stop(fab.root)
    assert (code, out) == (0, "")  # complete


def test_lock_fallback_removes_an_owner_file_never_written_once_it_is_old(fab, no_fcntl):
    make_plan(fab, 2)
    owner = fab.dir / "lock.owner"
    owner.write_text("")
    old = time.time() - 60
    os.utime(owner, (old, old))
    r = fab("next")
    assert r.code == 0, r
    assert "removed a stale lock file that no process finished writing" in r.err
    assert not owner.exists()


def test_lock_fallback_waits_for_a_fresh_owner_file_not_yet_written(fab, no_fcntl, monkeypatch):
    make_plan(fab, 2)
    owner = fab.dir / "lock.owner"
    owner.write_text("")  # its creator may be about to write its pid
    future = time.time() + 3600  # it stays younger than the 5 s that make it stale, however
    os.utime(owner, (future, future))  # long this test takes on a loaded machine
    monkeypatch.setenv("FABLIZE_LOCK_TIMEOUT", "0.05")
    before = state_files(fab.dir)
    r = fab("next")
    assert r.code == 3 and "stale" not in r.err, r
    assert owner.exists() and state_files(fab.dir) == before
