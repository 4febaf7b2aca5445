# Developer tasks. Needs only python3 (with its venv module) and make; the test
# tools are installed into .venv from requirements-dev.txt.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# Files that must run on Python 3.9. vermin's `union-types` feature is not used: it
# mistakes every bitwise `|` of os.O_* flags for a 3.10 union type. The engine has no
# annotations, so there is no `X | Y` type for it to find.
VERMIN_FILES := scripts/*.py scripts/fablize_gate/*.py tools/*.py
VERMIN_FLAGS := --no-tips --violations -t=3.9- --eval-annotations

# four workers on two cores: most tests wait on a subprocess (git, the engine); an idle worker
# takes tests queued for another (worksteal). On this project's idle 2-core machine `make test`
# takes about 2m50s (`time make test`: user+sys ~331 s of CPU, both cores busy throughout; the
# end-to-end audits of tests/test_scope.py and tests/test_verdict.py are 46% of the tests' CPU)
PYTEST_ARGS ?= -q -n 4 --dist worksteal tests
# The oldest supported Python, proven rather than assumed: where a 3.9 is installed, `make test`
# also runs the demo and the engine's subprocess tests on it (the test tools themselves need a
# newer Python, so they stay on the venv's).
PY39 ?= $(firstword $(wildcard /usr/bin/python3.9 /usr/local/bin/python3.9 $(HOME)/.pyenv/versions/3.9*/bin/python3.9))
PY39_TESTS := tests/test_smoke.py tests/test_compat.py tests/test_wiring.py

.PHONY: venv test test39 demo bench dist clean

venv: $(VENV)/.stamp

# Rebuilt from scratch whenever the pins change, so no stale package survives.
$(VENV)/.stamp: requirements-dev.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -r requirements-dev.txt
	touch $@

# test39 runs beside the main suite (its output is said after it, whole): one wall clock, not
# two in a row (~6 s of the idle machine's ~3 min)
TEST39_LOG := .test39.log

test: venv
	$(BIN)/vermin $(VERMIN_FLAGS) $(VERMIN_FILES)
	$(BIN)/ruff check --no-cache scripts tests tools
	@$(MAKE) --no-print-directory test39 > $(TEST39_LOG) 2>&1 & t39=$$!; \
	echo "$(BIN)/python -m pytest $(PYTEST_ARGS)"; \
	$(BIN)/python -m pytest $(PYTEST_ARGS); main=$$?; \
	wait $$t39; py39=$$?; cat $(TEST39_LOG); rm -f $(TEST39_LOG); \
	[ $$main -eq 0 ] && [ $$py39 -eq 0 ]

test39: venv
ifeq ($(PY39),)
	@echo "test39: no python3.9 here (looked in /usr/bin, /usr/local/bin, ~/.pyenv) — skipped"
else
	PYTHON="$(PY39)" bash tools/demo.sh > /dev/null
	FABLIZE_TEST_PYTHON="$(PY39)" $(BIN)/python -m pytest -q -n 2 $(PY39_TESTS)
endif

demo:
	PYTHON="$(PYTHON)" bash tools/demo.sh

bench:
	$(PYTHON) tools/bench.py

# the wheel, the sdist, the plugin archive and the skill folder, into dist/ (see tools/dist.py)
dist: venv
	$(BIN)/python tools/dist.py dist

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build dist *.egg-info scripts/*.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
