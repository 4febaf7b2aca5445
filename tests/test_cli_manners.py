"""A command line people enjoy, and every command the engine prints runs as printed: pasted into
`sh` in the state it was printed in, it exits 0 or 1 as its meaning says — never 127 (not a
command), never 2 (a usage error) — for the person who must run it."""

import glob
import os
import pty
import re
import shutil
import subprocess
import sys

import pytest

from conftest import copy_engine, git, run_cli

HUMAN = re.compile(r"\x1b\[")


# Every printed command runs ######################################################################


def repo(tmp_path):
    root = tmp_path / "proj"
    root.mkdir()
    git(tmp_path, "init", "-q", str(root))
    copy_engine(root / "scripts")
    return root


def engine(root, *args, env=None):
    full = {k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")}
    full.update(env or {})
    return subprocess.run([sys.executable, str(root / "scripts" / "goals.py"), *args],
                          cwd=str(root), capture_output=True, text=True, env=full, timeout=120)


def printed_commands(text, prog):
    """Every command line in `text` that starts with the engine: whole in backticks, or the rest
    of its line (up to a parenthetical aside)."""
    found = []
    for line in text.splitlines():
        for m in re.finditer(re.escape(prog), line):
            start = m.start()
            if start and line[start - 1] == "`":
                end = line.index("`", m.end())
            else:
                end = len(line.split("   (")[0]) if "   (" in line[start:] else len(line)
            found.append(line[start:end].strip())
    return found


def test_every_command_the_engine_prints_runs_as_printed_in_sh(tmp_path):
    root = repo(tmp_path)
    prog = 'python3 "$(git rev-parse --show-toplevel)/scripts/goals.py"'
    printed = []  # (the step, the project as it was then, a command it printed)

    def step(*args):
        r = engine(root, *args)
        kept = tmp_path / f"after{len(printed)}-{args[0]}"
        shutil.copytree(root, kept, symlinks=True)
        printed.extend((args, kept, c) for c in printed_commands(r.stdout + r.stderr, prog))

    step("create", "--brief", "b", "--goal", "A::a", "--goal", "B::b", "--goal", "C::c",
         "--judge", "G002", "--verify", "true")
    step("status")
    step("next")
    step("checkpoint", "--id", "G001", "--status", "failed", "--evidence", "not yet")
    step("next")
    step("checkpoint", "--id", "G001", "--status", "blocked", "--evidence", "cannot")
    step("next")  # refused: a human must decide
    step("status")
    step("decide", "--id", "G001", "accept", "--note", "fine as it is")
    step("next")
    step("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "done")  # review
    step("status")
    step("pause", "--note", "lunch")
    step("status")
    kinds = {c.split(prog)[1].split()[0] for _, _, c in printed}
    assert {"next", "checkpoint", "decide", "judge-packet", "unpause"} <= kinds, kinds
    for n, (args, kept, command) in enumerate(printed):
        copy = tmp_path / f"paste{n}"
        shutil.copytree(kept, copy, symlinks=True)
        r = subprocess.run(["sh", "-c", command], cwd=str(copy), capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode in (0, 1), (args, command, r)


# Did you mean, the ids, examples ##############################################################


@pytest.mark.parametrize("args, said", [
    (["chekpoint", "--id", "G001"], "unknown command `chekpoint` — did you mean `checkpoint`?"),
    (["stauts"], "unknown command `stauts` — did you mean `status`?"),
    (["checkpoint", "--id", "G001", "--status", "complet", "--evidence", "e"],
     "invalid choice: 'complet' (choose from 'complete', 'failed', 'blocked') — did you mean "
     "`complete`?"),
    (["checkpoint", "--id", "G001", "--status", "complete", "--evidnce", "e"],
     "unrecognized arguments: --evidnce e — did you mean `--evidence`?"),
])
def test_a_mistyped_command_or_option_gets_its_nearest_name(fab, args, said):
    r = fab(*args)
    assert r.code == 2 and said in r.err and r.err.count("\n") == 1, r
    assert "'create'" not in r.err  # never every command listed


def test_a_word_near_nothing_gets_no_guess(fab):
    r = fab("frobnicate")
    assert r.code == 2 and "unknown command `frobnicate` (see" in r.err and "did you" not in r.err


def test_an_unknown_id_lists_the_ids_of_the_plan(fab):
    from conftest import make_plan
    make_plan(fab, 3)
    r = fab("checkpoint", "--id", "G009", "--status", "complete", "--evidence", "e")
    assert r.code == 1 and "G009 not found. The plan's stories: G001, G002, G003." in r.err
    make_plan(fab, 12, "--force")
    r = fab("decide", "--id", "G099", "retry", "--note", "x")
    assert "G099 not found. The plan's stories: G001–G012 (12)." in r.err


@pytest.mark.parametrize("args", [["--help"], ["create", "--help"], ["checkpoint", "--help"],
                                  ["decide", "--help"], ["audit", "--help"]])
def test_help_ends_with_examples_that_are_whole_commands(tmp_path, args):
    r = run_cli(*args, cwd=tmp_path)
    assert r.code == 0 and "\nExamples:\n" in r.out, r
    block = r.out.split("\nExamples:\n")[1].split("\n\n")[0]
    lines = block.splitlines()
    assert lines and all(line.startswith("  ") and " -" in line or line.strip().count(" ") <= 2
                         for line in lines), lines


# Colour #########################################################################################


def on_a_terminal(root, *args, env=None):
    """The engine with its stdout and stderr on a real pseudo-terminal; returns what it showed."""
    master, slave = pty.openpty()
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("FABLIZE_") and k not in ("NO_COLOR", "FORCE_COLOR")}
    full.update(TERM="xterm", **(env or {}))
    p = subprocess.Popen([sys.executable, str(root / "scripts" / "goals.py"), *args],
                         cwd=str(root), stdout=slave, stderr=slave, env=full)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed: the engine is done
            break
        if not chunk:
            break
        chunks.append(chunk)
    p.wait(timeout=120)
    os.close(master)
    return b"".join(chunks).decode("utf-8", "replace")


def test_a_terminal_gets_colour_and_no_color_or_a_pipe_gets_none(tmp_path):
    root = repo(tmp_path)
    created = engine(root, "create", "--brief", "b", "--goal", "A::a", "--goal", "B::b")
    assert created.returncode == 0
    assert engine(root, "next").returncode == 0
    shown = on_a_terminal(root, "status")
    assert HUMAN.search(shown) and "\x1b[33m▶\x1b[0m G001" in shown, shown
    assert not HUMAN.search(on_a_terminal(root, "status", env={"NO_COLOR": "1"}))
    assert not HUMAN.search(on_a_terminal(root, "--json", "status"))
    assert not HUMAN.search(on_a_terminal(root, "status", "--resume"))  # what an agent reads
    piped = engine(root, "status")
    assert piped.returncode == 0 and not HUMAN.search(piped.stdout + piped.stderr)
    forced = engine(root, "status", env={"FORCE_COLOR": "1"})
    assert HUMAN.search(forced.stdout)
    assert not HUMAN.search(engine(root, "status", env={"FORCE_COLOR": "0"}).stdout)
    error = on_a_terminal(root, "checkpoint", "--id", "G009", "--status", "complete",
                          "--evidence", "e")
    assert "\x1b[31mfablize: G009 not found." in error


# Old Pythons ####################################################################################


# a real Python 2 where one is installed (pyenv's, or `python2` on PATH), and the 3.x before 3.9
OLD_PYTHONS = list(dict.fromkeys(
    sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/2.7*/bin/python2.7")))
    + [p for p in (shutil.which("python2.7"), shutil.which("python2")) if p and subprocess.run(
        [p, "-c", "import sys; sys.exit(sys.version_info[0] != 2)"],
        capture_output=True).returncode == 0]
    + [p for p in (os.path.expanduser(f"~/.pyenv/versions/{v}/bin/python")
                   for v in ("3.6.15", "3.7.16", "3.8.18")) if os.path.exists(p)]))


@pytest.mark.skipif(not OLD_PYTHONS, reason="no Python older than 3.9 is installed here")
@pytest.mark.parametrize("python", OLD_PYTHONS or ["none"])
@pytest.mark.parametrize("start", ["goals.py", "fablize.py"])
def test_an_older_python_gets_one_line_naming_the_version_it_needs(tmp_path, python, start):
    """Python 2 too: it reads goals.py as far as the check (no raw SyntaxError for a non-ASCII
    docstring, no ImportError of _signal). The line names no variable only the plugin reads."""
    scripts = tmp_path / "scripts"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "scripts"), scripts,
                    ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([python, str(scripts / start), "status"], cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr.startswith("fablize: needs Python 3.9 or later, this is "), r
    assert r.stderr.count("\n") == 1 and "FABLIZE_PYTHON" not in r.stderr, r
    assert not list(scripts.glob("*.pyc")), "an old Python left bytecode beside goals.py"


# Shell completion ###############################################################################


def completion(tmp_path, shell):
    r = run_cli("completion", shell, cwd=tmp_path)
    assert r.code == 0, r
    path = tmp_path / f"fablize.{shell}"
    path.write_text(r.out)
    return path


def test_bash_completion_loads_and_completes_commands_options_and_choices(tmp_path):
    script = completion(tmp_path, "bash")

    def complete(*words):
        line = " ".join(words)
        p = subprocess.run(["bash", "--norc", "--noprofile", "-c",
                            f'source "{script}"; COMP_WORDS=({line}); '
                            f"COMP_CWORD={len(words) - 1}; _fablize; "
                            'printf "%s\\n" "${COMPREPLY[@]}"'],
                           capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
        assert p.returncode == 0 and p.stderr == "", p
        return p.stdout.split()
    assert complete("fablize", "chec") == ["checkpoint"]
    assert set(complete("fablize", "checkpoint", "--st")) == {"--status"}
    assert complete("fablize", "checkpoint", "--status", "c") == ["complete"]
    assert complete("fablize", "decide", "--id", "G001", "re") == ["retry"]
    assert "--resume" in complete("fablize", "status", "--")
    assert complete("fablize", "completion", "f") == ["fish"]


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed here")
def test_zsh_completion_loads_and_registers_the_command(tmp_path):
    script = completion(tmp_path, "zsh")
    p = subprocess.run(["zsh", "-f", "-c", "autoload -U compinit && compinit -u -D; "
                        f'eval "$(cat {script})"; print -r -- ${{_comps[fablize]}}; '
                        "(( $+functions[_fablize] )) && print defined"],
                       capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert p.returncode == 0 and p.stdout.split() == ["_fablize", "defined"], p


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed here")
def test_fish_completion_loads_and_completes(tmp_path):
    script = completion(tmp_path, "fish")

    def complete(line):
        p = subprocess.run(["fish", "--no-config", "-c", f"source {script}; complete -C '{line}'"],
                           capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
        assert p.returncode == 0, p
        return [x.split("\t")[0] for x in p.stdout.splitlines()]
    assert "checkpoint" in complete("fablize chec")
    assert complete("fablize checkpoint --status c") == ["complete"]
    assert "--verify-cmd" in complete("fablize checkpoint --ver")


def test_a_merged_log_shows_each_gates_fix_above_the_error_that_says_so(project):
    """A CI log merges stdout and stderr: the error's "(the fix of each is said above)" must
    come after the fixes it points at, not before them."""
    import subprocess
    from conftest import ENGINE
    assert run_cli("create", "--brief", "b", "--goal", "S1::o", "--goal", "S2::p",
                   cwd=project).code == 0
    assert run_cli("next", cwd=project).code == 0
    assert run_cli("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e",
                   "--run", "--verify-cmd", "true", cwd=project).code == 0
    for log in (project / ".fablize" / "runs").glob("*.log"):
        log.unlink()
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONUNBUFFERED" and not k.startswith("FABLIZE_")}  # as CI starts it
    p = subprocess.run([*ENGINE, "audit", "--require-logs", "--require-complete"],
                       cwd=str(project), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=120, env=env)
    text = p.stdout.decode()
    assert p.returncode == 1, text
    said = text.index("(the fix of each is said above)")
    assert 0 < text.index("— fix: ") < said and text.rindex("— fix: ") < said, text
