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
