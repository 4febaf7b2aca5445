"""The command line: argparse, built from each command's declarations, reads it; its mistakes are
named as argparse names them, and a closed output stream changes no exit code."""

import os
import subprocess
import sys

import pytest

from conftest import SCRIPT, engine


def read(argv):
    """What parsing gave, as a comparable value."""
    try:
        ns = engine.build_parser(engine.command_in(argv)).parse_args(argv)
        return ("ok", dict(vars(ns)))
    except engine.FablizeError as e:
        return ("error", e.code, str(e))


def test_a_mistake_is_named_as_argparse_names_it():
    err = read(["checkpoint", "--id", "G001", "--status", "done", "--evidence", "e"])
    assert err[0] == "error" and "invalid choice: 'done'" in err[2], err


def test_a_bad_value_next_to_an_ambiguous_option_is_named_as_argparse_names_it():
    # argparse reports the ambiguous --verify before it converts --id's value
    for argv in (["checkpoint", "--id", "BAD", "--verify"],
                 ["checkpoint", "--id", "BAD", "--verify=x"]):
        err = read(argv)
        assert err[0] == "error" and "ambiguous option: --verify" in err[2], err


@pytest.mark.parametrize("closed", [">&-", "2>&-"])
def test_a_closed_output_stream_changes_no_exit_code(tmp_path, closed):
    for args, code in (("--version", 0), ("status", 1)):
        p = subprocess.run(["sh", "-c", f'"$0" "$1" {args} {closed}', sys.executable,
                            str(SCRIPT)], cwd=str(tmp_path), capture_output=True,
                           env={"PATH": os.environ["PATH"]})
        assert p.returncode == code, (args, closed, p)
        assert b"Traceback" not in p.stderr, p


# A hook's line is read without argparse (cli.hook_args): the same values, or the parser's turn

HOOK_LINES = [
    ["guard"], ["guard", "--for", "codex"], ["guard", "--for=gemini", "--plugin"],
    ["--dir", "x", "guard"], ["--json", "observe", "--for", "cursor"], ["observe", "--dir=y"],
    ["--dir=a", "guard", "--dir", "b"], ["--dir", "guard", "guard"], ["observe", "--dir="],
    ["status", "--resume"], ["status", "--resume", "--for", "codex", "--plugin"],
    ["status", "--agent", "a", "--resume"], ["--dir=z", "status", "--json", "--resume"],
    ["status", "--resume", "--resume", "--agent=b", "--agent", "c"],
]


@pytest.mark.parametrize("argv", HOOK_LINES)
def test_a_hooks_line_is_read_without_the_parser_as_the_parser_reads_it(argv):
    fast = engine.hook_args(argv, engine.command_in(argv))
    kind, parsed = read(argv)
    assert fast is not None and kind == "ok"
    # `status --resume` is the session start that cmd_status hands it to, called directly
    assert parsed.pop("func") is {"status": engine.cmd_status}.get(parsed["command"],
                                                                    fast.func)
    assert fast.func is {"status": engine.session_start}.get(parsed["command"], fast.func)
    assert {k: v for k, v in vars(fast).items() if k != "func"} == parsed


@pytest.mark.parametrize("argv", [
    ["guard", "--help"], ["guard", "-h"], ["guard", "--for", "vim"], ["guard", "--for="],
    ["guard", "--plug"], ["guard", "--dir"], ["guard", "--dir", "--json"], ["guard", "x"],
    ["guard", "guard"], ["observe", "--", "x"], ["observe", "--resume"], ["status"],
    ["status", "--resume", "--agent"], ["status", "--resume", "--verbose"], ["next"],
    ["--version"], ["guard", "--json=1"],
])
def test_anything_else_is_left_to_the_parser_with_its_own_words(argv):
    assert engine.hook_args(argv, engine.command_in(argv)) is None


@pytest.mark.parametrize("argv, said", [
    (["guard", "--for", "vim"], "argument --for: invalid choice: 'vim'"),
    (["observe", "--dir"], "argument --dir: expected one argument"),
    (["status", "--resume", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_a_bad_hook_line_gets_the_parsers_error_exit_2(argv, said, capsys):
    assert engine.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fablize: ") and said in err and "Traceback" not in err, err
