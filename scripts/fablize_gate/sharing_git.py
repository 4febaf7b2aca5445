"""Git for a shared plan: the one runner of the sharing room's git commands, and what their
failures mean (a remote that cannot be reached, a corrupt repository, a ref lock git left).
Part of the sharing room; imported by it alone.
"""

import os
import re
import time

from .base import damaged, EXIT_DAMAGED, FablizeError, is_plan_id, one_line, refused, usage
from .storage import env_seconds, read_state_file
from .runs import git, repo_root

REMOTE_NAME = r"[A-Za-z0-9][\w.-]*"

# what git says of a repository whose objects or refs are broken (never a network problem)
CORRUPT = ("corrupt", "not our ref", "bad object", "object file", "unable to read",
           "did not send all necessary objects", "inflate", "missing blob", "missing tree")
STALE_LOCK = r"Unable to create '([^']+\.lock)': File exists"
GIT_LOCATION = ("GIT_DIR", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY", "GIT_WORK_TREE",
                "GIT_CEILING_DIRECTORIES", "GIT_QUARANTINE_PATH")
REF_LOCK_STALE = 2.0     # seconds: git holds a ref lock for milliseconds; older ones are litter
DEFAULT_WAIT = 30.0      # seconds a command waits out other writers (FABLIZE_SHARE_WAIT)


# Git: one runner, and what its failures mean ##################################################


def unreachable(remote, detail):
    return FablizeError(f"the remote {one_line(remote)} cannot be reached "
                        f"({one_line(detail)[:300]}).", "remote_unreachable", EXIT_DAMAGED)


def remote_failure(remote, err, what):
    """A failed fetch or push: a damaged remote, named as such with its fix, or one that cannot
    be reached."""
    said = [line.strip() for line in err.splitlines() if line.strip()]
    broken = [line for line in said if any(p in line.lower() for p in CORRUPT)]
    if broken:
        return damaged(f"the remote {one_line(remote)} is damaged — git says: "
                       f"{one_line(broken[0])[:300]}. This is not a network problem: repair that "
                       "repository (`git fsck` in it says what is broken) or move the plan to a "
                       "sound remote (`share --remote NAME`); this clone keeps its events.",
                       "remote_damaged")
    # git's own reason is its first fatal or error line; the advice after it is the same always
    reason = [line for line in said if line.startswith(("fatal:", "error:"))] or said[-1:]
    return unreachable(remote, reason[0] if reason else what)


def git_dirs(store):
    """(git dir, common dir) of the repository holding the state directory, found as git finds
    them from there (.git, a folder or a worktree's file, and its commondir), or None when a
    GIT_DIR-style variable decides instead."""
    if any(name in os.environ for name in GIT_LOCATION):
        return None
    top = repo_root(store.root)
    if top is None:
        return None
    gitdir = os.path.join(top, ".git")
    if not os.path.isdir(gitdir):
        raw = read_state_file(gitdir) or b""
        if not raw.startswith(b"gitdir: "):
            return None
        gitdir = os.path.join(top, raw[8:].strip().decode("utf-8", "replace"))
    common = gitdir
    if os.path.isfile(os.path.join(gitdir, "commondir")):
        raw = read_state_file(os.path.join(gitdir, "commondir")) or b""
        common = os.path.join(gitdir, raw.strip().decode("utf-8", "replace"))
    return os.path.realpath(gitdir), os.path.realpath(common)


def own_ref_lock(store, err):
    """The path of a ref lock under refs/fablize/ of this clone's own repository that git
    reported it could not take, or None (a lock of the remote's is never this clone's)."""
    found = re.search(STALE_LOCK, err)
    dirs = git_dirs(store) if found else None
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
    """git's stdout; a failure is damage, with git's own reason."""
    code, out, err = git_call(store, *args, data=data)
    if code != 0:
        name = next(a for a in args if not a.startswith("-") and "=" not in a)
        raise damaged(f"git {name} failed: {one_line(err)[:300]}", "git_failed")
    return out


def cat_objects(store, names):
    """[(object id, bytes) or None where missing] of each name (`rev`, `rev:path`), through one
    git cat-file."""
    if not names:
        return []
    out = git_out(store, "cat-file", "--batch", data="".join(n + "\n" for n in names).encode())
    found, pos = [], 0
    for _ in names:
        end = out.index(b"\n", pos)
        header = out[pos:end].split()
        pos = end + 1
        if header[-1] in (b"missing", b"ambiguous"):
            found.append(None)
            continue
        size = int(header[2])
        found.append((header[0].decode(), out[pos:pos + size]))
        pos += size + 1
    return found


def remote_arg(store, remote):
    if not re.fullmatch(REMOTE_NAME, remote or ""):
        raise usage(f"--remote takes the name of a git remote (as `git remote` lists them), not "
                    f"{one_line(remote)!r}.", "bad_remote")
    if git(store.root, "remote", "get-url", remote, what="a shared plan")[0] != 0:
        raise refused(f"{one_line(remote)} is not a git remote of {store.root} — add it with "
                      f"`git remote add {one_line(remote)} URL`.", "no_remote")
    return remote


def plan_id_arg(plan_id):
    if not is_plan_id(plan_id):
        raise usage(f"--plan takes a plan id (as `sync` lists them), not {one_line(plan_id)!r}.",
                    "bad_plan_id")
    return plan_id


def share_wait():
    """FABLIZE_SHARE_WAIT: how long a command waits out other writers, in seconds."""
    return env_seconds("FABLIZE_SHARE_WAIT", DEFAULT_WAIT)


def uniform():
    """A number in [0, 1) for jitter (os.urandom: the random module costs 1 ms to import)."""
    return int.from_bytes(os.urandom(4), "big") / 2 ** 32
