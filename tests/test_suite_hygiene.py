"""The suite's own manners: a process a test starts and leaves running fails the run, named,
and is ended (conftest.pytest_sessionfinish) — with or without xdist's workers."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, SESSION_MARK


@pytest.mark.slow  # the xdist session is among the longest: started first (conftest)
@pytest.mark.parametrize("workers", [[], ["-p", "xdist.plugin", "-n", "2"]],
                         ids=["one-process", "xdist"])
def test_a_process_a_test_leaves_running_fails_the_run_and_is_ended(tmp_path, workers):
    """A whole pytest session of its own, with and without xdist (the slower: workers start):
    a test that leaves a process running fails the run, the process is named and ended. It
    proves the guard every other test relies on — no test's child outlives the suite."""
    pid_file = tmp_path / "pid"
    env = {k: v for k, v in os.environ.items() if k != SESSION_MARK}  # a session of its own
    env["FZTEST_PROBE_PID"] = str(pid_file)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only what the probe needs (xdist, named)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *workers, str(ROOT / "tests" / "leak_probe.py")],
                       cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p
    assert "1 process(es) left running by the tests (ended now):" in p.stdout, p
    pid = int(pid_file.read_text())
    assert f"pid {pid} " in p.stdout and "sleep 600" in p.stdout
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
