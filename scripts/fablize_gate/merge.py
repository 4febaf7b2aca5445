"""fablize's merge room: branches whose committed plans diverge merge by replay.

Two branches that each replace or advance the committed plan change the same two files. Git asks
the driver (installed by `install-merge`: one .gitattributes line, one git config entry) for the
merged content of each. The same plan advanced further on one side: that side. Two different
plans: the one created later stays current and the other's whole ledger is carried in one
appended `plan_merged` event, replayed by audit, so both audit with their pins. The snapshot of
the current plan is then one event behind: the next command rolls it forward.

Interface: COMMANDS (merge-driver, install-merge), merge_ledgers, merge_snapshots.
Imported by the commands that run it (cli.room_of, commands), when they run; what it
uses of the engine's layers is the names it imports from them, listed at its top.
"""

import os
import re

from .base import (
    damaged, LEDGER, load_json, one_line, quote_arg, refused, RUNS, SNAPSHOT, Step)
from .model import is_original_snapshot, make_event, misfit, PLAN_SPEC
from .render import human_command
from .storage import (
    git_dirs, read_plain, read_state_file, repo_root, symlink_refusal, within, write_atomic)


# runs (git) and history are imported by the functions that use them: a command's start that
# asks only merge_driver_missing loads neither
MERGE_ATTRIBUTE = "merge=fablize"  # what .gitattributes says of a plan's files
MERGE_DRIVER = b'[merge "fablize"]'  # the git config section install-merge writes


def merge_driver_missing(root):
    """Whether the repository's committed .gitattributes names fablize's merge driver while
    this clone's git config (its own, the user's, the global one) lacks it: a fresh clone,
    whose merges would leave conflict markers in the plan. Read from the files, no git
    process and nothing but storage loaded: every command can afford it, a session start too."""
    top = repo_root(root)
    if top is None or MERGE_ATTRIBUTE.encode() not in read_plain(
            os.path.join(top, ".gitattributes")):
        return False
    dirs = git_dirs(top)
    git_dir = dirs[1] if dirs else os.path.join(top, ".git")
    home = os.path.expanduser("~")
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    return not any(MERGE_DRIVER in read_plain(path) for path in (
        os.path.join(git_dir, "config"), os.path.join(home, ".gitconfig"),
        os.path.join(xdg, "git", "config")))
# what a refusal of the driver leaves: git's conflict, which a human resolves (cmd_merge_driver
# names the command, with the state directory's path)
KEEP_ONE = "a human's choice, the other side's events are left out — then `git add` it:"


def keep_one(path, whole=False):
    """The side to keep of `path` (git's own path of the file being merged), a human's choice:
    the file, or (`whole`) the plan's folder — its ledger, snapshot and logs go together."""
    if not path:
        return ()
    where = path
    if whole:  # a run log's plan folder is above runs/; a ledger's or snapshot's, theirs
        where = (path.split(f"/{RUNS}/")[0] if f"/{RUNS}/" in "/" + path
                 else path.rpartition("/")[0]) or "."
    return f"git checkout --<ours|theirs> -- {quote_arg(':/' + where)}"


def merge_ledgers(ours, theirs, path=None):
    """The merged ledger.jsonl, or a refusal (git then leaves the conflict to a human). `path`:
    the file git merges (the ledger, or the snapshot or log that follows it)."""
    try:
        ours.decode("utf-8"), theirs.decode("utf-8")
    except UnicodeDecodeError:
        raise refused(f"{LEDGER}: a side is not UTF-8 text — merge it by hand.", "conflict")
    lo, lt = ours.splitlines(), theirs.splitlines()
    if not lo or not lt:
        return ours or theirs
    if lo[0] == lt[0]:
        if lt[:len(lo)] == lo:
            return theirs
        if lo[:len(lt)] == lt:
            return ours
        at = next(i for i, (x, y) in enumerate(zip(lo, lt), 1) if x != y)
        raise refused(f"both branches advanced the same plan differently (from event {at}); "
                      f"keep one side: `git checkout --ours` or `--theirs` on it — {KEEP_ONE}",
                      "diverged", keep_one(path, whole=True))
    from .history import audit_ledger  # two plans to merge: each replayed whole
    mine, other = audit_ledger(ours, None)["plan"], audit_ledger(theirs, None)["plan"]
    if (other["created"], other["plan_id"]) > (mine["created"], mine["plan_id"]):
        (mine, lo, ours), (other, lt, theirs) = (other, lt, theirs), (mine, lo, ours)
    _, _, line = make_event(mine, "plan_merged", {
        "plan_id": other["plan_id"], "events": len(lt), "head": other["ledger"]["head"],
        "lines": [x.decode("utf-8") for x in lt]})
    return ours + line + b"\n"


def merge_snapshots(ours, theirs, path=None):
    """goals.json of the plan merge_ledgers keeps current (same rule, read from the snapshot).
    Two snapshots of one plan at different events follow the ledgers: where the two ledgers
    diverged (merge_ledgers refuses them), the snapshot is left in conflict too, never merged
    on its own."""
    sides = []
    for raw in (ours, theirs):
        try:
            snap = load_json(raw)
        except ValueError:
            snap = None
        if (type(snap) is not dict or is_original_snapshot(snap) or
                misfit(snap, PLAN_SPEC) is not None):
            raise damaged(f"{SNAPSHOT}: one side is not a fablize snapshot — once "
                          f"{LEDGER} is merged, `rebuild` writes it anew from it (then "
                          "`git add` it):", "bad_snapshot", steps=Step.engine("rebuild"))
        sides.append((snap["plan_id"], snap["ledger"]["seq"], snap["created"]))
    ko, kt = sides
    if ko[0] == kt[0]:
        if ko[1] == kt[1]:
            raise refused("both branches changed the same plan's snapshot at the same event; "
                          f"keep one side of the plan (its {LEDGER} with it) — {KEEP_ONE}",
                          "diverged", keep_one(path, whole=True))
        ledgers = ledger_sides(path.rsplit("/", 1)[0] + "/" + LEDGER) if path else None
        if ledgers is not None:  # refuses a diverged plan: the snapshot stays in conflict
            merge_ledgers(*ledgers, path)
        return ours if ko[1] > kt[1] else theirs
    return ours if (ko[2], ko[0]) > (kt[2], kt[0]) else theirs


def ledger_sides(ledger):
    """(ours, theirs) of the ledger at `ledger` during a `git merge` of one branch (named only
    by the GITHEAD_<commit> variable git sets), or None when that cannot be told."""
    from .runs import git
    heads = [k[len("GITHEAD_"):] for k in os.environ if re.fullmatch(r"GITHEAD_[0-9a-f]{40,64}", k)]
    if len(heads) != 1:
        return None
    sides = []
    for rev in ("HEAD", heads[0]):
        code, out, _ = git(".", "show", f"{rev}:{ledger}", what="merge-driver")
        sides.append(out if code == 0 else b"")
    return tuple(sides) if all(sides) else None


def merge_run_log(path, ours, theirs):
    """Two different logs at one runs/ path: the current plan's (the side merge_ledgers keeps)."""
    sides = ledger_sides(path.rsplit("/" + RUNS + "/", 1)[0] + "/" + LEDGER)
    if sides is None:
        raise refused(f"{one_line(path)}: both branches wrote a different run log here, and this "
                      f"is not a `git merge` of one branch whose sides both hold {LEDGER}; keep "
                      f"the log of the plan that stays — {KEEP_ONE}", "conflict", keep_one(path))
    merged = merge_ledgers(*sides, path)
    if merged == sides[1] or (merged != sides[0] and not merged.startswith(sides[0])):
        return theirs
    return ours


def cmd_merge_driver(ctx, a):
    ours, theirs = (read_state_file(p) or b"" for p in (a.ours, a.theirs))
    name = os.path.basename(a.path or "")
    if ours == theirs:
        return
    if name == LEDGER:
        merged = merge_ledgers(ours, theirs, a.path)
    elif name == SNAPSHOT:
        merged = merge_snapshots(ours, theirs, a.path)
    elif f"/{RUNS}/" in "/" + (a.path or "") and name.endswith(".log"):
        merged = merge_run_log(a.path, ours, theirs)
    else:
        raise refused(f"{one_line(a.path)}: both branches changed it and only {LEDGER} and "
                      f"{SNAPSHOT} merge by replay; keep one side — {KEEP_ONE}", "conflict",
                      keep_one(a.path))
    write_atomic(a.ours, merged)
    ctx.out.warn(f"merged {one_line(a.path)} by replay.")


def wanted(store):
    """Whether `store` lies in a real git repository whose .gitattributes does not yet merge it
    with the driver, or whose clone lacks the driver's config: setup then installs it."""
    from .runs import git
    top = repo_root(store.root)
    if top is None or not within(os.path.realpath(store.dir), os.path.realpath(top)):
        return False
    if git(store.root, "rev-parse", "--git-dir", what="setup")[0] != 0:
        return False  # a `.git` that is no repository: nothing git could merge
    return (attribute_line(store).encode() not in read_plain(
        os.path.join(top, ".gitattributes")).splitlines() or merge_driver_missing(top))


def committed(store):
    """Whether the plan's ledger is tracked by git (committed, or staged to be)."""
    from .runs import git
    rel = os.path.relpath(store.path(LEDGER), store.root)
    return git(store.root, "ls-files", "--error-unmatch", "--", rel,
                      what="doctor")[0] == 0


def attribute_line(store):
    rel = os.path.relpath(store.dir, store.root).replace(os.sep, "/")
    return f"/{rel}/** {MERGE_ATTRIBUTE}"


def uninstall(store):
    """Undo what install did (the .gitattributes line, this clone's driver config); returns
    ([(the file it changed, what it did)], whether the config held the driver)."""
    from .runs import git
    top = repo_root(store.root)
    if top is None:
        return [], False
    path = os.path.join(top, ".gitattributes")
    old = read_plain(path)
    line = attribute_line(store)
    kept = [x for x in old.splitlines(True) if x.rstrip(b"\r\n") != line.encode()]
    changed = []
    if b"".join(kept) != old and not os.path.islink(path):
        if any(x.strip() for x in kept):
            write_atomic(path, b"".join(kept))
            changed.append((".gitattributes", f"`{line}` taken out"))
        else:
            os.unlink(path)
            changed.append((".gitattributes", "removed (it held only fablize's line)"))
    code = git(store.root, "config", "--remove-section", "merge.fablize",
                      what="setup --remove")[0]
    return changed, code == 0


def install(store, cli):
    """Wire `git merge` for the plans under `store`: the .gitattributes line (to commit) and the
    driver in this clone's git config. Returns (the line, the driver command)."""
    from .runs import git, git_out
    root = store.root
    if git(root, "rev-parse", "--git-dir", what="install-merge")[0] != 0:
        raise refused(f"{root} is not a git repository — `git init` makes it one:",
                      "no_git_repo", steps="git init")
    rel = os.path.relpath(store.dir, root).replace(os.sep, "/")
    if rel.startswith(".."):
        raise refused("the state directory is outside the repository: nothing to merge.",
                      "outside_repository")
    line = attribute_line(store)
    path = os.path.join(root, ".gitattributes")
    if os.path.islink(path):
        raise symlink_refusal(path)
    old = read_state_file(path) or b""
    if line.encode() not in old.splitlines():
        write_atomic(path, old + (b"" if not old or old.endswith(b"\n") else b"\n")
                            + line.encode() + b"\n")
    driver = f"{cli} merge-driver %O %A %B %P"
    git_out(root, "config", "merge.fablize.name", "fablize: plans merge by replay")
    git_out(root, "config", "merge.fablize.driver", driver)
    return line, driver


def cmd_install_merge(ctx, a):
    line, driver = install(ctx.store, human_command(ctx.cli))  # git runs it from any terminal
    ctx.show(text_install_merge, {"attribute": line, "driver": driver})


def text_install_merge(data):
    return [f"fablize: .gitattributes has `{data['attribute']}` (commit it); this clone's git "
            f"config runs `{data['driver']}` for those files."]


def add_merge_driver(command):
    c = command("merge-driver", cmd_merge_driver, "git's merge driver for plan files",
                "git runs it; see `install-merge`")
    c.add_argument("base", help="the common ancestor's version (%%O)")
    c.add_argument("ours", help="our version, replaced by the merged one (%%A)")
    c.add_argument("theirs", help="their version (%%B)")
    c.add_argument("path", nargs="?", help="the file's path in the repository (%%P)")


def add_install_merge(command):
    command("install-merge", cmd_install_merge, "let `git merge` merge committed plans",
            "one .gitattributes line (commit it) and the driver in this clone's git config")


COMMANDS = {"merge-driver": add_merge_driver, "install-merge": add_install_merge}
