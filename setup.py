"""The wheel installs scripts/goals.py, the core, as the module `fablize_gate` (the module name
`goals` is claimed by unrelated packages, and one of them would shadow the engine), and its rooms
beside it under their own names: the engine loads them by path from its own folder."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

ROOMS = ["fablize_setup", "fablize_sharing", "fablize_merge", "fablize_trust"]


class BuildEngine(build_py):
    def find_modules(self):
        return [("", "fablize_gate", os.path.join("scripts", "goals.py"))] + [
            ("", room, os.path.join("scripts", room + ".py")) for room in ROOMS]


setup(cmdclass={"build_py": BuildEngine})
