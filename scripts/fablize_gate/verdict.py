"""CI's last process: the step of a job that judges a pull request ends in it (`exec`), so no
shell of the job is left for a check to trace or to make exit 0. It makes itself untraceable,
hands the audit a nonce on a pipe no check inherits, waits for the audit, and passes only when
the audit exited 0 AND the verdict file it wrote last holds that nonce and says yes:

    exec python3 -I ENGINE/fablize_gate/verdict.py [--remove DIR] -- ENGINE/goals.py audit ARGS…

`--remove DIR`: a folder to take away once the audit is over (the engine's copy the step made).
Standard library only and nothing of the engine imported: it is the trust room's one process
that runs before the engine and after it.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile


def untraceable():
    """No process of this user may attach to this one or read its memory, and nothing it starts
    gains privileges (Linux; elsewhere nothing changes)."""
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError, ImportError):
        return
    prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE: 0
    prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS


def main(argv):
    remove = None
    if argv[:1] == ["--remove"] and len(argv) > 1:
        remove, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("fablize: verdict.py runs the audit: verdict.py [--remove DIR] -- goals.py audit …",
              file=sys.stderr)
        return 2
    untraceable()
    folder = tempfile.mkdtemp(prefix="fablize-verdict-")
    path = os.path.join(folder, "verdict.json")
    nonce = os.urandom(16).hex()
    read_end, write_end = os.pipe()
    os.write(write_end, nonce.encode())
    os.close(write_end)
    try:
        code = subprocess.call([sys.executable, "-I", *argv, "--verdict", path],
                               pass_fds=(read_end,),
                               env=dict(os.environ, FABLIZE_VERDICT_NONCE_FD=str(read_end)))
    except OSError as e:
        print(f"fablize: the audit could not start: {e}", file=sys.stderr)
        code = 1
    finally:
        os.close(read_end)
    try:
        with open(path, encoding="utf-8") as f:
            verdict = json.load(f)
    except (OSError, ValueError):
        verdict = None
    shutil.rmtree(folder, ignore_errors=True)
    if remove:
        shutil.rmtree(remove, ignore_errors=True)
    if code != 0:
        return code
    if not isinstance(verdict, dict):
        print("fablize: the audit exited 0 but wrote no verdict: it was stopped or forced to "
              "exit (a check that reached the auditor?) — failing.", file=sys.stderr)
        return 1
    if verdict.get("nonce") != nonce:
        print("fablize: the verdict file does not hold this run's nonce: something else wrote "
              "it — failing.", file=sys.stderr)
        return 1
    if verdict.get("ok") is not True:
        print("fablize: the audit exited 0 but its verdict says no — failing.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
