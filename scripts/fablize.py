#!/usr/bin/env python3
"""fablize: the engine beside this file (goals.py), started with its bytecode cached.

`python3 goals.py` compiles the whole engine at every start: Python caches no bytecode for the
script it is given. This file is that script instead, and small: it imports goals.py, whose
bytecode the import caches in __pycache__/ beside it, so a start costs what an import of cached
bytecode costs. The hooks and commands `setup` writes run it (`python3 -I -S …/scripts/fablize.py
guard`), and so does the plugin's bin/fablize. That __pycache__/ holds a .gitignore of `*`, so
nothing of it is ever committed; where it cannot be written (PYTHONDONTWRITEBYTECODE, a
read-only checkout) the engine still runs, compiled as the script would be.
"""

import _signal

STARTUP_INTERRUPT = []  # Ctrl-C before the engine answers it: kept, handed to it, answered there
_signal.signal(_signal.SIGINT, lambda signum, frame: STARTUP_INTERRUPT.append(signum))

import os
import sys


def main(name=None):
    """Run the engine as `fablize` would (`name`: how it says it was started, for the commands
    it prints; by default this file, by its place in the repository)."""
    if sys.version_info < (3, 9):
        sys.exit(f"fablize: needs Python 3.9 or newer, this is {sys.version.split()[0]} "
                 "(set FABLIZE_PYTHON for the plugin's bin/fablize)")
    here = os.path.dirname(os.path.realpath(__file__))
    if sys.path and os.path.realpath(sys.path[0] or ".") == here:
        del sys.path[0]  # this folder is not a place to import from: goals.py is loaded by path
    if name is not None:
        sys.argv[0] = name
    from importlib.machinery import SourceFileLoader
    from importlib.util import module_from_spec, spec_from_loader
    loader = SourceFileLoader("fablize_engine", os.path.join(here, "goals.py"))
    engine = module_from_spec(spec_from_loader(loader.name, loader))
    engine.STARTUP_INTERRUPT = STARTUP_INTERRUPT
    sys.modules[loader.name] = engine
    loader.exec_module(engine)
    engine.ignore_bytecode(here)
    engine.run()


if __name__ == "__main__":
    main()
