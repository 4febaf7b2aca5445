"""Run only by test_suite_hygiene.py (its name is not test_*.py): a test that starts a process
and leaves it running, writing its pid where FZTEST_PROBE_PID says."""

import os
import subprocess


def test_leaves_a_process_running():
    p = subprocess.Popen(["sleep", "600"])
    with open(os.environ["FZTEST_PROBE_PID"], "w") as f:
        f.write(str(p.pid))
