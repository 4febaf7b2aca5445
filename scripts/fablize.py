#!/usr/bin/env python3
# -*- coding: utf-8 -*-
"""Hooks written by fablize 3.0 run this file (`python3 -I -S …/scripts/fablize.py guard`): it
starts goals.py beside it, the one way in, so those hooks keep working. New wiring runs goals.py."""

import sys

if sys.version_info < (3, 9):  # goals.py says, in one line, which Python it needs (Python 2 too)
    import os
    sys.dont_write_bytecode = True  # Python 2 would leave a goals.pyc beside goals.py
    sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
    import goals  # noqa: F401  (it exits)

import _signal  # noqa: E402

INTERRUPTS = []  # Ctrl-C while the engine loads: kept, handed to it, answered there
_signal.signal(_signal.SIGINT, lambda signum, frame: INTERRUPTS.append(signum))

import os  # noqa: E402


def main():
    sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
    import goals  # goals.main takes this folder off sys.path again before the engine loads
    goals.main(interrupts=INTERRUPTS)


if __name__ == "__main__":
    main()
