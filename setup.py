"""The wheel installs the engine's package, scripts/fablize_gate/, as `fablize_gate`, and the
`fablize` command (fablize_gate.cli:run); pyproject.toml says the rest."""

from setuptools import setup

setup()
