"""The wheel installs scripts/goals.py, the single source, as the module `fablize_gate`: the
module name `goals` is claimed by unrelated packages, and one of them would shadow the engine."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildEngine(build_py):
    def find_modules(self):
        return [("", "fablize_gate", os.path.join("scripts", "goals.py"))]


setup(cmdclass={"build_py": BuildEngine})
