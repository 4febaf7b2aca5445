# Developer tasks. Needs only python3 (with its venv module) and make; the test
# tools are installed into .venv from requirements-dev.txt.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# Files that must run on Python 3.9. vermin's `union-types` feature is not used: it
# mistakes every bitwise `|` of os.O_* flags for a 3.10 union type. The engine has no
# annotations, so there is no `X | Y` type for it to find.
VERMIN_FILES := scripts/goals.py scripts/bench.py
VERMIN_FLAGS := --no-tips --violations -t=3.9- --eval-annotations

PYTEST_ARGS ?= -q -n 2 tests

.PHONY: venv test demo bench clean

venv: $(VENV)/.stamp

# Rebuilt from scratch whenever the pins change, so no stale package survives.
$(VENV)/.stamp: requirements-dev.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -r requirements-dev.txt
	touch $@

test: venv
	$(BIN)/vermin $(VERMIN_FLAGS) $(VERMIN_FILES)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo:
	PYTHON="$(PYTHON)" bash scripts/demo.sh

bench:
	$(PYTHON) scripts/bench.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build dist *.egg-info scripts/*.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
