"""Git for a shared plan: the sharing room's calls of the engine's one git runner (runs.git,
runs.cat_objects), with the room's own rule for a ref lock a killed git left under
refs/fablize/, and what their failures mean (a remote that cannot be reached, a corrupt
repository). Part of the sharing room; imported by it alone.
"""

import os
import re
import time

from .base import (
    damaged, EXIT_DAMAGED, FablizeError, is_plan_id, one_line, quote_arg, refused, usage, Step)
from .storage import env_seconds
from .runs import cat_objects, git, git_failed
from .storage import git_dirs

REMOTE_NAME = r"[A-Za-z0-9][\w.-]*"
SHARED_REFS = "refs/fablize/plans/"

# what git says of a repository whose objects or refs are broken (never a network problem)
CORRUPT = ("corrupt", "not our ref", "bad object", "object file", "unable to read",
           "did not send all necessary objects", "inflate", "missing blob", "missing tree")
# what git says when it cannot write this clone's own repository (its disk full, a file size
# limit, a read-only folder, a ref another git process holds): never the remote's fault. A
# line the remote sent (`remote: …`) is the remote's own.
LOCAL_FAULT = ("no space left on device", "file too large", "disk quota exceeded",
               "read-only file system", "unable to write loose object",
               "unable to create temporary", "unable to write new index file",
               "cannot lock ref", "died of signal 25")  # 25: SIGXFSZ, a file size limit
STALE_LOCK = r"Unable to create '([^']+\.lock)': File exists"
GIT_LOCATION = ("GIT_DIR", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY", "GIT_WORK_TREE",
                "GIT_CEILING_DIRECTORIES", "GIT_QUARANTINE_PATH")
REF_LOCK_STALE = 2.0     # seconds: git holds a ref lock for milliseconds; older ones are litter
DEFAULT_WAIT = 30.0      # seconds a command waits out other writers (FABLIZE_SHARE_WAIT)


# Git: its calls, and what their failures mean #####################################################


def unreachable(remote, detail):
    """The remote does not answer: if it moved, pointing it at its new URL is a human's step
    (which URL); if it is down, the same command once it answers. `said`: the message without
    the step, for a warning that keeps the events (publish) and for `status`."""
    said = f"the remote {one_line(remote)} cannot be reached ({one_line(detail)[:300]})."
    return FablizeError(f"{said[:-1]} — if it moved, point {one_line(remote)} at its new URL; if "
                        "it is down, run the command again once it answers:",
                        "remote_unreachable", EXIT_DAMAGED,
                        f"git remote set-url {quote_arg(remote)} <url>", said)


def remote_failure(remote, err, what):
    """A failed fetch or push: a damaged remote, named as such with its fix, or one that cannot
    be reached."""
    said = [line.strip() for line in err.splitlines() if line.strip()]
    local = [line for line in said if not line.lower().startswith("remote:")
             and any(p in line.lower() for p in LOCAL_FAULT)]
    if local:  # this machine's disk or repository: nothing the remote or its URL can change
        return damaged(f"git could not write this clone's repository while it talked to "
                       f"{one_line(remote)} — git says: {one_line(local[0])[:300]}. That is this "
                       "machine (its disk full or not writable, or another git process at work "
                       "in this clone), not the remote: make room if it is full, then run the "
                       "command again.", "io_error")
    broken = [line for line in said if any(p in line.lower() for p in CORRUPT)]
    if broken:
        name = one_line(remote)
        return damaged(f"the remote {name} is damaged — git says: {one_line(broken[0])[:300]}. "
                       "This is not a network problem: repair that repository (`git fsck` in it "
                       f"says what is broken), or point {name} at a sound one, where `share "
                       f"--remote {name}` publishes the plan again from a clone that holds it; "
                       "this clone keeps its events:", "remote_damaged",
                       f"git remote set-url {quote_arg(remote)} <url>")
    # git's own reason is its first fatal or error line; the advice after it is the same always
    reason = [line for line in said if line.startswith(("fatal:", "error:"))] or said[-1:]
    return unreachable(remote, reason[0] if reason else what)


def own_git_dirs(store):
    """storage.git_dirs of the plan's repository, or None when a GIT_DIR-style variable decides
    where git looks instead."""
    if any(name in os.environ for name in GIT_LOCATION):
        return None
    return git_dirs(store.root)


def own_ref_lock(store, err):
    """The path of a ref lock under refs/fablize/ of this clone's own repository that git
    reported it could not take, or None (a lock of the remote's is never this clone's)."""
    found = re.search(STALE_LOCK, err)
    dirs = own_git_dirs(store) if found else None
    if dirs is None:
        return None
    path = os.path.realpath(found.group(1))
    if not any(path.startswith(os.path.join(d, "refs", "fablize") + os.sep) for d in dirs):
        return None
    return path


def git_call(store, *args, data=None):
    """(exit code, stdout, stderr) of git in the plan's repository. A ref lock under this
    clone's refs/fablize/ left by a git process that was killed (it outlived REF_LOCK_STALE: git
    holds one for milliseconds, and this command holds the state lock) is removed, said, and
    the call made again: a kill must never leave a clone that fails at every command."""
    for attempt in range(8):
        code, out, err = git(store.root, *args, data=data, what="a shared plan")
        path = own_ref_lock(store, err) if code else None
        if path is None:
            return code, out, err
        try:
            age = time.time() - os.lstat(path).st_mtime
        except FileNotFoundError:
            continue  # its owner finished meanwhile
        if age < REF_LOCK_STALE:
            time.sleep(min(0.05 * 2 ** attempt, REF_LOCK_STALE - age + 0.01))
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        store.warn(f"removed {one_line(os.path.relpath(path, store.root))}, a git ref lock left "
                   f"by a git process that was killed ({age:.0f} s old).")
    return code, out, err


def git_out(store, *args, data=None):
    """git's stdout, through git_call; a failure is this clone's damage (runs.git_failed)."""
    code, out, err = git_call(store, *args, data=data)
    if code != 0:
        raise git_failed(args, err, store.root)
    return out


def cat(store, names):
    """runs.cat_objects in the plan's repository: [(object id, bytes) or None] of each name."""
    return cat_objects(store.root, names, what="a shared plan", repair=True)


def remote_arg(store, remote, step=None):
    """`remote`, a git remote of the plan's repository. `step`: the command that was run, with
    `{}` where --remote's value goes (named with a placeholder when the name is not one)."""
    if not re.fullmatch(REMOTE_NAME, remote or ""):
        raise usage(f"--remote takes the name of a git remote (as `git remote` lists them), not "
                    f"{one_line(remote)!r}" + (":" if step else "."), "bad_remote",
                    steps=Step.engine(step.replace("{}", "<remote>", 1)) if step else ())
    if git(store.root, "remote", "get-url", remote, what="a shared plan")[0] != 0:
        raise refused(f"{one_line(remote)} is not a git remote of {store.root} — add it with "
                      f"`git remote add {one_line(remote)} URL`:", "no_remote",
                      steps=f"git remote add {quote_arg(remote)} <url>")
    return remote


def default_remote(store, step="sync --remote {}"):
    """The remote `sync` uses: origin, or the only one. `step`: the command that was run, with
    `{}` where --remote goes (as remote_arg's)."""
    names = git_out(store, "remote").decode().split()
    if "origin" in names:
        return "origin"
    if len(names) == 1:
        return names[0]
    if not names:
        raise refused(f"{store.root} has no git remote — add one with `git remote add NAME "
                      "URL`:", "no_remote", steps="git remote add origin <url>")
    raise usage(f"several git remotes ({', '.join(names)}): say which with --remote "
                "NAME:", steps=Step.engine(step.replace("{}", "<remote>", 1)))


def plan_id_arg(plan_id, step=None):
    """`plan_id`, a plan id; `step` as remote_arg's, with `{}` where --plan's value goes."""
    if not is_plan_id(plan_id):
        raise usage(f"--plan takes a plan id (as `sync` lists them), not {one_line(plan_id)!r}"
                    + (":" if step else "."), "bad_plan_id",
                    steps=Step.engine(step.replace("{}", "<plan-id>", 1)) if step else ())
    return plan_id


def written_elsewhere(error, cfg, ref):
    """What `error` means when it says the remote's ref holds what fablize did not write there
    (a commit with no ledger line, an event that does not chain or is not legal, a log that is
    not its run's): the sharing room's refusal, which the replay that found it could not word —
    with the command that shows it and the way to put this clone's history back (what the
    plan's history is, is a human's decision). Any other error is returned as it is."""
    if error.code not in ("bad_remote_event", "run_log_mismatch", "remote_history_rewritten"):
        return error
    mine, remote = cfg["commit"], cfg["remote"]
    if mine is None:  # a clone that never held the plan has no history of its own to offer
        return FablizeError(
            f"{error.message} A clone that holds the plan repairs {SHARED_REFS}{cfg['plan_id']} "
            f"on {remote} (a ref that holds no plan at all, at its next command; else a human "
            f"who holds the plan); `git log --oneline {ref}` shows what it holds now:",
            error.code, error.exit_code, f"git log --oneline {ref}")
    return FablizeError(
        f"{error.message} What the plan's history is, is a human's decision: `git log --oneline "
        f"--graph {mine[:12]} {ref}` shows this clone's and the remote's; to keep this clone's, "
        f"`git push --force {remote} {mine[:12]}:{SHARED_REFS}{cfg['plan_id']}`, then `sync`:",
        error.code, error.exit_code, f"git log --oneline --graph {mine} {ref}")


def share_wait():
    """FABLIZE_SHARE_WAIT: how long a command waits out other writers, in seconds."""
    return env_seconds("FABLIZE_SHARE_WAIT", DEFAULT_WAIT)


def uniform():
    """A number in [0, 1) for jitter (os.urandom: the random module costs 1 ms to import)."""
    return int.from_bytes(os.urandom(4), "big") / 2 ** 32
