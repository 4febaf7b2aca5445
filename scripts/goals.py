#!/usr/bin/env python3
# -*- coding: utf-8 -*-
"""fablize: split a large task into stories and refuse every "done" that arrives without evidence.

    python3 scripts/goals.py create --brief "<task>" --goal "title::objective" ... --verify "<cmd>"
    python3 scripts/goals.py next
    python3 scripts/goals.py checkpoint --id G001 --status complete --evidence "<what you saw>"
    python3 scripts/goals.py status          (and --help for every command)

This file is the one way in, and small on purpose: Python compiles the script it is given at
every start, and caches the bytecode of what that script imports. The engine is the package
beside it, fablize_gate/ (its docstring says the invariants and where each layer lives), loaded
from this file's own folder — never from the current directory, never from sys.path — so
nothing in a user's scripts/ or site-packages can stand in for it. Copy both together.

Ctrl-C is kept from this file's first statements on and answered by the engine in one line.
Stdlib only, Python 3.9+. Every Python reads this file as far as its version check, Python 2
too (no syntax of Python 3 in it, its encoding declared), and is told in one line what it needs.
"""

import sys

if sys.version_info < (3, 9):  # exit 1, as every version before this one said it
    sys.exit("fablize: needs Python 3.9 or later, this is %s" % sys.version.split()[0])

import _signal  # noqa: E402  (after the check: Python 2 has no _signal)

INTERRUPTS = []  # Ctrl-C while the engine loads: kept, handed to it, answered there in one line
_signal.signal(_signal.SIGINT, lambda signum, frame: INTERRUPTS.append(signum))

import os  # noqa: E402  (after the handler: a Ctrl-C from here on is answered in one line)

ENGINE = "fablize_gate"  # the engine's folder, beside this file


def fail(message):
    """One line on stderr and exit 2: no engine to say it in its own words."""
    sys.stderr.write("fablize: " + message + "\n")
    sys.exit(2)


def load(here):
    """The engine package in `here`, imported from that folder alone."""
    folder = os.path.join(here, ENGINE)
    if not os.path.isfile(os.path.join(folder, "__init__.py")):
        fail("the engine's folder %s/ is not beside %s (in %s) — copy both from fablize's "
             "scripts/ folder: cp -r FABLIZE/scripts/goals.py FABLIZE/scripts/%s scripts/"
             % (ENGINE, os.path.basename(__file__), here, ENGINE))
    # this folder is on sys.path only while the package itself is found: a user's json.py
    # beside goals.py never stands in for the standard library's
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    sys.path.insert(0, here)
    try:
        import fablize_gate
    finally:
        del sys.path[0]
    if os.path.dirname(os.path.realpath(fablize_gate.__file__)) != os.path.realpath(folder):
        fail("another %s (%s) was loaded instead of the one beside %s"
             % (ENGINE, fablize_gate.__file__, __file__))
    from fablize_gate import cli
    ignore_bytecode(folder)
    return cli


def ignore_bytecode(folder):
    """The bytecode Python caches for the engine (`folder`/__pycache__/) stays out of git: it
    holds a .gitignore of `*`. Never an error: a read-only checkout, or
    PYTHONDONTWRITEBYTECODE, caches nothing."""
    cache = os.path.join(folder, "__pycache__")
    marker = os.path.join(cache, ".gitignore")
    if sys.dont_write_bytecode or os.path.lexists(marker) or not os.path.isdir(cache):
        return
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                     0o644)
        os.write(fd, b"# bytecode Python cached for fablize: never committed\n*\n")
        os.close(fd)
    except OSError:
        pass


def main(name=None, interrupts=None):
    """Run the engine as a whole process (it exits). `name`: how it says it was started, for
    the commands it prints (the plugin's bin/fablize says `fablize`); `interrupts`: Ctrl-Cs a
    caller kept before this file was loaded."""
    if interrupts:
        INTERRUPTS.extend(interrupts)
    if name is not None:
        sys.argv[0] = name
    cli = load(os.path.dirname(os.path.realpath(__file__)))
    cli.run(INTERRUPTS)


if __name__ == "__main__":
    main()
