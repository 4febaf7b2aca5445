"""The command line is read twice over: quick_args reads a plain one without importing argparse,
and argparse, built from the same declarations, reads everything else. They must never differ:
on any command line quick_args answers, argparse gives the same namespace or the same error."""

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from conftest import SCRIPT, goals

# the command lines the hooks, the handoffs and the printed next steps run: the quick path must
# take them (else every start pays for argparse again)
HOT = [
    ["status"], ["status", "--resume"], ["status", "--resume", "--for", "codex"],
    ["--dir", "/tmp/x", "status", "--json"], ["--dir=/tmp/x", "--json", "next"],
    ["next"], ["next", "--agent", "a1"], ["guard"], ["guard", "--for", "cursor"],
    ["observe"], ["observe", "--for", "gemini"], ["log"], ["verify", "--id", "g1"],
    ["checkpoint", "--id", "G001", "--status", "complete", "--evidence", "tests pass"],
    ["checkpoint", "--id", "G003", "--status", "complete", "--evidence", "e",
     "--verify-cmd", "make test", "--run", "--timeout", "60"],
    ["create", "--brief", "b", "--goal", "a::b", "--goal=c::d", "--check", "G001=true"],
]


def read(argv, quick):
    """(what parsing gave, as a comparable value) by one of the two readers."""
    try:
        if quick:
            ns = goals.quick_args(argv, goals.command_in(argv))
            if ns is None:
                return None
        else:
            ns = goals.build_parser(goals.command_in(argv)).parse_args(argv)
        return ("ok", dict(vars(ns)))
    except goals.FablizeError as e:
        return ("error", e.code, str(e))


@pytest.mark.parametrize("argv", HOT, ids=" ".join)
def test_the_command_lines_fablize_prints_are_read_without_argparse(argv):
    quick = read(argv, quick=True)
    assert quick is not None, argv
    assert quick == read(argv, quick=False)


def option_tokens(name):
    """Every option of `name` as written, abbreviated and with `=`, its choices, and values that
    argparse reads in its own ways."""
    spec = goals.command_spec(name)
    tokens = ["--dir", "--json", "--di", "-h", "--help", "--", name, "other"]
    for names, options in spec.arguments:
        for option in names:
            tokens += [option, option[:-1], option[:5], option[:-4], option + "=", option + "=x"]
        tokens += [str(c) for c in options.get("choices") or ()]
    return tokens


VALUES = ["x", "", "-x", "-1", "1.5", "G001", "g1", "G1000000", "a b", "--json", "status",
          "complete", "claude", "a=b", "G002=true", "t::o", "é"]


@st.composite
def command_lines(draw):
    """Mostly well-formed command lines (each option of the command or not, with a value from
    its choices or from VALUES), some with a stray token from option_tokens put in."""
    name = draw(st.sampled_from(sorted(goals.command_names())))
    before = draw(st.lists(st.sampled_from(["--dir", "--json", "--dir=d", "d"]), max_size=2))
    parts = []
    for names, options in goals.command_spec(name).arguments:
        if not draw(st.booleans()):
            continue
        values = [str(c) for c in options.get("choices") or ()] or VALUES
        value = draw(st.sampled_from(values) | st.sampled_from(VALUES))
        option = draw(st.sampled_from(names))
        if not option.startswith("-"):
            parts.append([value])
        elif options.get("action") == "store_true":
            parts.append([option])
        else:
            parts.append(draw(st.sampled_from([[option, value], [f"{option}={value}"]])))
    parts = draw(st.permutations(parts))
    if draw(st.integers(0, 3)) == 0:
        at = draw(st.integers(0, len(parts)))
        parts.insert(at, [draw(st.sampled_from(option_tokens(name)))])
    return before + [name] + [token for part in parts for token in part]


@settings(max_examples=600, deadline=None)
@given(command_lines())
def test_quick_args_and_argparse_never_disagree(argv):
    quick = read(argv, quick=True)
    if quick is not None:
        assert quick == read(argv, quick=False), argv


def test_a_mistake_is_left_to_argparse_and_named_as_it_names_it():
    argv = ["checkpoint", "--id", "G001", "--status", "done", "--evidence", "e"]
    assert read(argv, quick=True) is None
    err = read(argv, quick=False)
    assert err[0] == "error" and "invalid choice: 'done'" in err[2], err
    assert read(["checkpoint", "--id", "G001"], quick=True) is None  # required ones missing


def test_a_bad_value_next_to_an_ambiguous_option_is_named_as_argparse_names_it():
    # argparse reports the ambiguous --verify before it converts --id's value: so must we
    for argv in (["checkpoint", "--id", "BAD", "--verify"],
                 ["checkpoint", "--id", "BAD", "--verify=x"]):
        assert read(argv, quick=True) is None
        err = read(argv, quick=False)
        assert err[0] == "error" and "ambiguous option: --verify" in err[2], err


@pytest.mark.parametrize("closed", [">&-", "2>&-"])
def test_a_closed_output_stream_changes_no_exit_code(tmp_path, closed):
    for args, code in (("--version", 0), ("status", 1)):
        p = subprocess.run(["sh", "-c", f'"$0" "$1" {args} {closed}', sys.executable,
                            str(SCRIPT)], cwd=str(tmp_path), capture_output=True,
                           env={"PATH": os.environ["PATH"]})
        assert p.returncode == code, (args, closed, p)
        assert b"Traceback" not in p.stderr, p
