"""fablize's sharing room: one plan worked from many clones, through a git remote.

Layout. A shared plan's ledger is also a chain of commits under refs/fablize/plans/<plan id> on
a git remote, one commit per event: its tree holds `event.jsonl` (the ledger line, exact bytes)
and, for a run, `log` (the run's output). Every clone makes an event's commit the same way (its
time is the event's), so publishing the same events again makes the same commits. A plan that
`create --force` replaced ends with one more commit, whose tree holds `replaced.json` (the plan
that replaced it) instead of an event: every clone sees it at its next command, archives the
old plan and follows the new one.

Ordering. A push names the commit it expects the remote's ref to hold (--force-with-lease): the
remote's ref update is the compare-and-swap that orders writers. A push that loses fetches the
winner's events, replays them through apply_event, re-validates and re-chains the local events
not yet published (an event no longer legal is set aside, said and kept, never dropped) and
tries again, backing off with jitter for up to FABLIZE_SHARE_WAIT seconds. A push the remote
refuses for another reason (a hook, a policy) is said at once, in git's words. Commands push
first and fetch only when the push loses, unless other agents are at work (a story in progress
that is not theirs), when the remote has almost surely moved and is asked first.

Local state. share.json marks a shared plan and records how much of the ledger the remote is
known to hold — trusted only while the ledger holds, at that position, the line whose hash it
names (else the remote's events are taken in again from the last one both agree on: realign);
rejected.jsonl keeps every local event set aside, and rejected.pending.json those
not acknowledged yet (said on every command until `sync --acknowledge`, or, for a lost claim,
the agent's next claim). A step that changes several files (a rebase, following or undoing a
replacement) is written first as sync.journal, its logs staged beside it; applying a journal is
idempotent and any command finishes an interrupted one before it starts (attach), so a kill
anywhere leaves the old state or the new one. A local plan has no share.json and never loads
this room.

Interface (for the engine's commands):
  attach(store)            finish an interrupted sync, say unacknowledged events, and register
                           `publish` as the store's after-commit step
  pull(session)            `next`: the remote's events first, when `next` may not write
  reconcile(session)       `rebuild`: the remote's events first, whatever the ledger lost
  claim(session, story, agent)  `next`'s story_started, on the remote before it is handed out
  start(store, remote)     share the plan (`share`, `create --remote`)
  status(store, plan), status_lines(info, prog)   what `status` says of a shared plan
  audit_source(store, remote, plan_id, named_by)  (ledger bytes, run logs, which plan)
  COMMANDS                 share, sync, release
Imported by the commands that run it (cli.room_of, commands), when they run; what it
uses of the engine's layers is the names it imports from them, listed at its top. Of a writing
session it uses the interface storage gives a room (Transaction): it lets the lock go only
through session.unlocked(), and keeps what it knows of a session in a Share of its own.
"""

import json
import os
import re
import time
import weakref

from .base import (
    ARCHIVE, count_noun, damaged, dumps, EXIT_REFUSED, FablizeError, id_arg, is_plan_id, LEDGER,
    load_json, now_iso, one_line, PIN, quote_arg, refused, RUNS, sha256_hex, SHARE, SNAPSHOT,
    STATE_DIRNAME, STATE_GITIGNORE, Step, ZERO_HASH)
from .masking import masked_text
from .model import (
    active_stories, apply_event, find_story, misfit, parse_event, pick_ready, ready_stories,
    TEXT, touch)
from .storage import (
    commit_start, crash_point, ensure_subdir, free_name, fsync_dir, Ledger, link_or_copy, O_BINARY,
    open_state_file, read_state_file, shown_path, write_all,
    write_atomic)
from .runs import git, repo_root
from .render import invocation, plan_json, sequential, story_json, TAKE_TURNS
from .history import audit_ledger
from .sharing_git import (
    cat, default_remote, git_call, git_out, own_git_dirs, plan_id_arg, remote_arg,
    remote_failure, REMOTE_NAME, share_wait, SHARED_REFS, uniform, written_elsewhere)


REJECTED = "rejected.jsonl"          # every local event set aside, with why (append-only)
PENDING = "rejected.pending.json"    # those not acknowledged yet: said on every command
JOURNAL = "sync.journal"             # a sync step under way (Journal)
STAGE = "sync.stage-"                # its staged files: sync.stage-<journal id>/
# what a shared plan publishes, said once when it is first shared
PUBLISHES = ("  it publishes, to everyone who can read {remote}: the plan, its evidence and every "
             "run (command, exit code, output tail and log), with secrets masked, paths "
             "relative to the repository and environment variables as names with digests — no "
             "absolute path of this machine, no variable's value.")
REPLACED = "replaced.json"           # the last commit of a replaced plan holds this, no event
FIRST = "replacement.jsonl"          # ... and the first ledger line of the plan replacing it
SHARE_SPEC = {"remote": str, "plan_id": str, "seq": int, "head": str, "commit": TEXT}
SAFE_LOG = r"runs/[\w.-]+\.log"
COMMITTER = "fablize <fablize@localhost>"

LONG_WAIT = 5.0          # a wait longer than this is said
BACKOFF_BASE = 0.01      # seconds: the least a lost push's backoff scales with
BACKOFF_ROUNDS = 4       # the first wait is up to this many rounds (a round: one fetch and push)
BACKOFF_CAP = 2.0        # seconds: the most a lost push waits
CLAIM_ATTEMPTS = 20      # claims lost in a row before `next` gives up (each within the wait)
CHAIN_BATCH = 16         # commits read back by name (rev~N) before git rev-list lists them
MAX_SAID = 5             # unacknowledged events said one by one, the rest counted
# a fetch of one ref is not the moment for the repository's upkeep (~1.8 ms a fetch: the
# user's own git commands still run it), nor for telling forced updates (a +refspec of ours)
QUIET = ("-c", "maintenance.auto=false", "-c", "gc.auto=0",
         "-c", "fetch.showForcedUpdates=false")
# what git says when another writer won: the ref is not where this push expected it
LOST_RACE = ("fetch first", "non-fast-forward", "stale info", "already exists")
# ... and when the remote was updating the ref at that moment (its ref lock)
SERVER_RACE = ("failed to update ref", "cannot lock ref", "failed to lock", "unable to lock",
               "incorrect old value")


# What this room keeps of a writing session ####################################################


class Share:
    """The sharing room's state of one writing session (one command under the lock), kept here
    beside the session, never on it: storage's session is storage's."""

    def __init__(self):
        self.unsaved = False      # take_events moved share.json's position on in memory only
        self.busy = False         # the remote brought other clones' events (claim: spread)
        self.paused = False       # the command waited without the lock once (pause)
        self.contention = None    # the command's one Contention: its pushes share one wait


SHARES = weakref.WeakKeyDictionary()  # session → its Share, gone with the session


def share_of(session):
    """The session's Share, made at its first use."""
    found = SHARES.get(session)
    if found is None:
        found = SHARES[session] = Share()
    return found


# share.json and the events set aside ##########################################################


def new_config(remote, plan_id):
    return {"remote": remote, "plan_id": plan_id, "seq": 0, "head": ZERO_HASH, "commit": None}


def share_config(store):
    """The shared plan's record, or None for a local plan (one lstat, no git)."""
    path = store.path(SHARE)
    if not os.path.lexists(path):
        return None
    try:
        cfg = load_json(read_state_file(path) or b"")
    except ValueError:
        cfg = None
    if (misfit(cfg, SHARE_SPEC) is not None or not re.fullmatch(REMOTE_NAME, cfg["remote"])
            or not is_plan_id(cfg["plan_id"])):
        remote = guessed_remote(store)
        raise damaged(f"{SHARE} is not a fablize share record — `share --remote "
                      f"{remote}` reconnects this clone to the shared plan (the damaged "
                      f"record is kept as {SHARE}.broken):", "bad_share",
                      steps=Step.engine(f"share --remote {remote}"))
    return cfg


def guessed_remote(store):
    """The remote a damaged share record most likely named: `sync`'s default, else NAME."""
    try:
        return default_remote(store)
    except FablizeError:
        return "NAME"


def set_aside_share(store):
    """`share` over a damaged share record: kept as share.json.broken (never committed), said,
    then written anew."""
    path = store.path(SHARE)
    try:
        share_config(store)
    except FablizeError as e:
        if e.code != "bad_share":
            raise
        os.replace(path, path + ".broken")
        store.warn(f"{SHARE} was not a fablize share record; it is kept as {SHARE}.broken and "
                   "written anew.")


def save_share_config(store, cfg):
    write_atomic(store.path(SHARE), dumps(cfg).encode("utf-8") + b"\n", sweep=True)


def tracking_ref(remote, plan_id):
    return f"refs/fablize/remotes/{remote}/{plan_id}"


def set_aside_record(line, reason, code, journal_id):
    return {"event": parse_event(line), "reason": reason, "code": code,
            "rejected": now_iso(), "key": sha256_hex(line)[:16],
            "sync": journal_id}


def read_pending(store):
    """The events set aside and not acknowledged yet (one lstat when there are none)."""
    path = store.path(PENDING)
    if not os.path.lexists(path):
        return []
    try:
        records = load_json(read_state_file(path) or b"")
    except ValueError:
        records = None
    if not isinstance(records, list) or not all(isinstance(r, dict) and isinstance(
            r.get("event"), dict) for r in records):
        raise damaged(f"{PENDING} is not a list of events set aside — its events are all in "
                      f"{REJECTED}; remove it:", "bad_share",
                      steps=f"rm {quote_arg(shown_path(store, PENDING))}")
    return records


def write_pending(store, records):
    path = store.path(PENDING)
    if records:
        write_atomic(path, dumps(records).encode("utf-8") + b"\n", sweep=True)
    elif os.path.lexists(path):
        os.unlink(path)


def keep_set_aside(store, records, recovering=False):
    """The events a sync set aside: appended to rejected.jsonl (their history, each once, even
    when an interrupted journal is applied again) and to the unacknowledged list."""
    path = store.path(REJECTED)
    data = read_state_file(path) if recovering else None
    known = set()
    if data:
        for line in data.split(b"\n"):
            rec = parse_event_record(line)
            if rec is not None:
                known.add(rec.get("key"))
    new = [r for r in records if r["key"] not in known]
    if new:
        fd = open_state_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            if data and not data.endswith(b"\n"):  # a kill tore the last append: it is redone
                os.ftruncate(fd, data.rfind(b"\n") + 1)
            write_all(fd, b"".join(dumps(r).encode("utf-8") + b"\n" for r in new))
            os.fsync(fd)
        finally:
            os.close(fd)
    pending = read_pending(store)
    waiting = {r.get("key") for r in pending}
    added = [r for r in records if r["key"] not in waiting]
    if added:
        write_pending(store, pending + added)


def parse_event_record(line):
    try:
        rec = load_json(line) if line.strip() else None
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def ack_command():
    return f"`{invocation()} sync --acknowledge`"


def said_event(ev):
    who = f" by agent {one_line(ev['agent'])}" if ev.get("agent") else ""
    return f"{ev['event']} {one_line(ev.get('id') or '')}{who} (event {ev['seq']}, made here"


def say_set_aside(store, records):
    """At the time: one line for each event set aside, and how it is acknowledged."""
    for r in records:
        store.warn(set_aside_line(r))


def set_aside_line(record):
    ev = record["event"]
    # a lost claim is acknowledged by its agent's next claim (often this very command's)
    seen = (f"agent {one_line(ev['agent'])}'s next claim acknowledges it, or "
            f"{ack_command()}" if ev["event"] == "story_started" and ev.get("agent") else
            f"{ack_command()} once seen")
    return (f"{said_event(ev)} before the remote's newer events) is no longer legal: "
            f"{one_line(record['reason'])} — set aside in {REJECTED}, not published; {seen}.")


def said_instead(store, record):
    """This command's own event, set aside, is said by the command itself (its refusal, or the
    claim it makes instead): the line sync said of it goes, and it counts as seen — it is
    never said again by a later command."""
    line = set_aside_line(record)
    while line in store.warnings:
        store.warnings.remove(line)
    pending = read_pending(store)
    kept = [r for r in pending if r.get("key") != record.get("key")]
    if len(kept) != len(pending):
        write_pending(store, kept)


def pending_line(record):
    ev = record["event"]
    also = (f" (or agent {one_line(ev['agent'])}'s next claim)"
            if ev["event"] == "story_started" and ev.get("agent") else "")
    return (f"not acknowledged: {said_event(ev)}) was set aside, never published — "
            f"{one_line(record['reason']).rstrip('.')}; it is kept in {REJECTED}. "
            f"{ack_command()} once seen{also}.")


def say_pending(store):
    """On every later command: the events set aside that nobody acknowledged yet."""
    records = read_pending(store)
    for r in records[:MAX_SAID]:
        store.warn(pending_line(r))
    if len(records) > MAX_SAID:
        store.warn(f"… and {len(records) - MAX_SAID} more events set aside and not acknowledged "
                   f"(all in {REJECTED}); {ack_command()} once seen.")


def acknowledge(store, agent=None, claims_only=False):
    """Mark events set aside as seen (those of `agent`'s claims, with claims_only); returns
    them."""
    records = read_pending(store)
    gone = [r for r in records if not claims_only or (
        r["event"]["event"] == "story_started" and r["event"].get("agent") == agent)]
    if gone:
        write_pending(store, [r for r in records if r not in gone])
    return gone


# Commits: each event's, made the same way on every clone ######################################


def days_from_civil(y, m, d):
    """Days from 1970-01-01 to a proleptic Gregorian date (H. Hinnant's algorithm): an event's
    time as a commit's, without the 2.6 ms import of datetime."""
    y -= m <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    return era * 146097 + (yoe * 365 + yoe // 4 - yoe // 100 + doy) - 719468


def commit_time(ts):
    """The UTC seconds of a ledger time (2026-12-01T08:12:50…); 0 when it is not one."""
    found = re.match(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)", ts if type(ts) is str else "")
    if not found:
        return 0
    y, mo, d, h, mi, s = map(int, found.groups())
    return max(0, days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60 + s)


def event_files(store, ev, line, where=None, sources=None):
    """The tree of an event's commit: its line and, for a run, its log as `where` (the state
    directory, or an archived plan's folder) holds it — or, for a run a rebase renamed and has
    not written yet, where `sources` says it is now."""
    files = {"event.jsonl": line + b"\n"}
    log = ev.get("log") if ev["event"] == "verify_run" else None
    if type(log) is str and re.fullmatch(SAFE_LOG, log):
        path = (sources or {}).get(log) or os.path.join(where or store.dir, log)
        body = read_state_file(path)
        if body is None and where is None:
            body = stranded_log(store, ev)
        if body is not None:
            files["log"] = body
    return files


def stranded_log(store, ev):
    """A run's log that fablize 3.0.0 left as runs/.rebase-<seq>-* when a sync was killed
    mid-rebase: put back under its name when its digest matches, so it is published with its
    event."""
    runs = store.path(RUNS)
    prefix = f".rebase-{ev['seq']}-"
    try:
        names = [n for n in os.listdir(runs) if n.startswith(prefix)]
    except FileNotFoundError:
        return None
    for name in names:
        body = read_state_file(os.path.join(runs, name))
        if body is not None and sha256_hex(body) == ev.get("sha256"):
            os.replace(os.path.join(runs, name), store.path(ev["log"]))
            store.warn(f"put back {ev['log']}, a run log an interrupted sync had left as "
                       f"{RUNS}/{name}.")
            return body
    return None


def event_commit(store, plan_id, line, where=None, sources=None):
    """(message, files, time) of the commit that carries one ledger line."""
    ev = parse_event(line)
    message = f"fablize {plan_id} #{ev['seq']} {ev['event']} {ev.get('id') or ''}".strip()
    return (message.encode("utf-8"), event_files(store, ev, line, where, sources),
            commit_time(ev.get("ts")))


def event_commits(store, cfg, lines, where=None, sources=None):
    """Commits for `lines` on top of cfg's commit; returns the new tip."""
    return write_commits(store, cfg["commit"], [
        event_commit(store, cfg["plan_id"], line, where, sources) for line in lines],
        cfg["plan_id"])


def end_commit(old_id, new_plan, when, first=None):
    """(message, files, time) of the commit that ends a replaced plan's chain. It carries the
    new plan's first ledger line (`first`): a clone that finds the old chain ended while the
    new plan's ref is not on the remote yet (its clone was killed between its two pushes)
    publishes that line itself — every clone makes its commit the same way — and follows."""
    body = dumps({"plan_id": new_plan["plan_id"], "brief": new_plan["brief"]}).encode("utf-8")
    files = {REPLACED: body + b"\n"}
    if first is not None:
        files[FIRST] = first + b"\n"
    return (f"fablize {old_id} replaced by {new_plan['plan_id']}".encode("utf-8"), files, when)


def write_commits(store, parent, commits, plan_id):
    """A chain of commits on `parent`, each (message, {name: bytes}, time); returns its tip.
    Written straight into the object store where that is a plain one (Objects), else by one
    git fast-import; both make the same commits."""
    if not commits:
        return parent
    objects = Objects.of(store, parent)
    if objects is not None:
        for message, files, when in commits:
            parent = objects.commit(parent, message, files, when)
        return parent
    ref = f"refs/fablize/local/{plan_id}"
    chunks = [f"reset {ref}\n".encode()]
    if parent:
        chunks.append(f"from {parent}\n".encode())
    for i, (message, files, when) in enumerate(commits, 1):
        who = f"{COMMITTER} {when} +0000"
        chunks.append(f"commit {ref}\nmark :{i}\nauthor {who}\ncommitter {who}\n"
                      f"data {len(message)}\n".encode() + message + b"\ndeleteall\n")
        for name in sorted(files):
            body = files[name]
            chunks.append(f"M 100644 inline {name}\ndata {len(body)}\n".encode() + body + b"\n")
    chunks.append(f"get-mark :{len(commits)}\n".encode())
    out = git_out(store, "fast-import", "--quiet", "--force", "--done",
                  data=b"".join(chunks) + b"done\n")
    return out.decode().split()[-1]


class Objects:
    """Git's loose objects, written by this process: zlib-compressed `type size\\0body` files
    named by their hash under .git/objects/ (not synced: git's default for loose objects). A
    publish then starts no git process to make its commits. A shared plan worked through (next and
    checkpoint, each publishing) spent 0.5-1.1 ms of CPU and 0.7-1.4 ms of wall time a publish
    here, git fast-import (and the unpack-objects it starts) 5.6-6.2 ms and 15-17 ms, at 20, 200
    and 2,000 stories: 18% of each command's CPU at 20 and 200 stories, 10% at 2,000 (the
    interpreter's start not counted). Used only where the object store is the plain one found
    from the state directory (no GIT_DIR-style variable, no shared-repository permissions) and
    the hash is known from a commit already made (40 hex digits: SHA-1, 64: SHA-256); otherwise
    fast-import writes the commits."""

    def __init__(self, directory, hasher):
        self.dir = directory
        self.hasher = hasher

    @classmethod
    def of(cls, store, commit):
        if commit is None or len(commit) not in (40, 64):
            return None
        dirs = own_git_dirs(store)
        if dirs is None:
            return None
        common = dirs[1]
        config = (read_state_file(os.path.join(common, "config")) or b"").lower()
        if b"sharedrepository" in config or b"compatobjectformat" in config:
            return None
        if (len(commit) == 64) != bool(re.search(rb"objectformat\s*=\s*sha256", config)):
            return None
        objects = os.path.join(common, "objects")
        if not os.path.isdir(os.path.join(objects, "pack")):
            return None
        if len(commit) == 40:
            try:
                from _sha1 import sha1 as hasher
            except ImportError:
                from hashlib import sha1 as hasher
        else:
            from hashlib import sha256 as hasher
        return cls(objects, hasher)

    def put(self, kind, body):
        """The object's id; its file is written unless it is there already."""
        import zlib
        raw = b"%s %d\0" % (kind, len(body)) + body
        oid = self.hasher(raw).hexdigest()
        folder = os.path.join(self.dir, oid[:2])
        path = os.path.join(folder, oid[2:])
        if os.path.lexists(path):
            return oid
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"tmp_obj_{os.getpid()}_{os.urandom(4).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_BINARY, 0o444)
        try:
            write_all(fd, zlib.compress(raw, 1))
        finally:
            os.close(fd)
        try:
            os.replace(tmp, path)  # the same name always holds the same bytes
        except OSError:
            os.unlink(tmp)
            if not os.path.lexists(path):  # not another writer of the same object
                raise
        return oid

    def commit(self, parent, message, files, when):
        tree = b"".join(b"100644 %s\0%s" % (name.encode(), bytes.fromhex(self.put(b"blob", body)))
                        for name, body in sorted(files.items()))
        who = f"{COMMITTER} {when} +0000"
        head = f"tree {self.put(b'tree', tree)}\n" + (f"parent {parent}\n" if parent else "")
        return self.put(b"commit", f"{head}author {who}\ncommitter {who}\n\n".encode() + message)


# Reading the remote ###########################################################################


def fetch_plan(store, remote, plan_id):
    """Fetch the plan's ref into its tracking ref and return that ref's name, or None when the
    remote holds no such ref."""
    tracking = tracking_ref(remote, plan_id)
    code, _, err = git_call(store, *QUIET, "fetch", "--quiet", "--no-tags", remote,
                            f"+{SHARED_REFS}{plan_id}:{tracking}")
    if code != 0:
        if "couldn't find remote ref" in err:
            return None
        raise remote_failure(remote, err, f"git fetch exit {code}")
    return tracking


def remote_tip(store, remote, plan_id):
    """The commit the remote's plan ref holds (None: no such ref), its objects here — read
    without writing any ref of this clone (ls-remote, then a fetch of objects only): a reading
    command (`status`, `audit --remote`) must never write a ref a writer of this clone holds,
    or moves under it, while that writer fetches the same plan under the lock."""
    ref = SHARED_REFS + plan_id
    code, out, err = git_call(store, "ls-remote", remote, ref)
    if code != 0:
        raise remote_failure(remote, err, f"git ls-remote exit {code}")
    rows = [row.split("\t") for row in out.decode("utf-8", "replace").splitlines()]
    sha = next((row[0] for row in rows if len(row) == 2 and row[1] == ref), None)
    if sha is not None and cat(store, [sha])[0] is None:
        fetch_objects(store, remote, [ref])
        if cat(store, [sha])[0] is None:  # the ref moved back or away meanwhile
            raise refused(f"{remote}'s {ref} moved while it was read — run the command "
                          "again.", "push_contended")
    return sha


FETCH_HEAD_FLAG = ["--no-write-fetch-head"]  # git 2.29+; emptied where git does not know it


def fetch_objects(store, remote, refs):
    """The objects of the remote's `refs`, fetched with no ref of this clone written (nor
    FETCH_HEAD, where git can leave it alone)."""
    while True:
        code, _, err = git_call(store, *QUIET, "fetch", "--quiet", "--no-tags",
                                *FETCH_HEAD_FLAG, remote, *refs)
        if code != 0 and FETCH_HEAD_FLAG and "no-write-fetch-head" in err:
            FETCH_HEAD_FLAG.clear()
            continue
        if code != 0:
            raise remote_failure(remote, err, f"git fetch exit {code}")
        return


def parse_commit(body):
    """(parent ids, message) of a commit object."""
    head, _, message = body.partition(b"\n\n")
    parents = [row[7:].decode() for row in head.split(b"\n") if row.startswith(b"parent ")]
    return parents, message


class Chain:
    """The commits of a shared plan's ref after `base` (the commit this clone last knew; None:
    all of them): `events` [(commit, line, log or None)] oldest first, and `replaced` (what the
    commit ending a replaced plan names) or None. `tip` is the ref's commit, `last` that of its
    last event (`base` when there is none)."""

    def __init__(self, store, ref, base, remote):
        self.remote = remote
        commits = self.read(store, ref, base)
        self.tip = commits[0][0] if commits else base
        self.replaced = None
        if commits and commits[0][2] is not None:
            self.replaced = self.replacement(commits[0])
            first = cat(store, [f"{commits[0][0]}:{FIRST}"])[0]
            self.replaced["first_line"] = first and first[1]
            commits = commits[1:]
        self.events = []
        for sha, line, replaced, log in reversed(commits):
            if line is None or replaced is not None:
                raise self.foreign(sha)
            self.events.append((sha, line, log))
        self.last = self.events[-1][0] if self.events else base

    def read(self, store, ref, base):
        """[(commit, line or None, replaced.json or None, log or None)] from the tip down to
        just above `base`. The first CHAIN_BATCH commits are asked for as ref~0, ref~1, … with
        their files in one git cat-file (a sync usually brings a few events: one process);
        beyond them git rev-list names the rest, read the same way. A chain that ends before
        reaching `base` is history rewritten."""
        found = []
        revs = [f"{ref}~{i}" for i in range(CHAIN_BATCH)]
        while True:
            anchor = self.walk(store, revs, base, found)
            if anchor is None:
                return found
            revs = git_out(store, "rev-list", "--first-parent", anchor,
                           *([f"^{base}"] if base else [])).decode().split()

    def walk(self, store, revs, base, found):
        """Read the commits `revs` (each the parent of the one before) into `found`; returns
        the parent to go on from, or None once `base` or the first commit is reached."""
        got = cat(store, [name for rev in revs for name in (
            rev, f"{rev}:event.jsonl", f"{rev}:{REPLACED}", f"{rev}:log")])
        parent = None
        for i in range(len(revs)):
            commit, line, replaced, log = got[4 * i:4 * i + 4]
            if commit is None or commit[0] == base:
                if commit is None and base is not None:
                    raise self.rewritten()  # the ref went back, or elsewhere
                return None
            sha, body = commit
            if not found and line is None and replaced is None:
                raise self.no_plan(sha)  # a commit that is no plan's: no need to read further
            parents, _ = parse_commit(body)
            if len(parents) > 1:
                raise self.foreign(sha)
            found.append((sha, self.line_of(sha, line), replaced and replaced[1],
                          log and log[1]))
            if not parents:
                if base is not None:
                    raise self.rewritten()
                return None
            parent = parents[0]
            if parent == base:
                return None
        return parent

    def line_of(self, sha, blob):
        if blob is None:
            return None
        raw = blob[1]
        if not raw.endswith(b"\n") or b"\n" in raw[:-1]:
            raise self.foreign(sha)
        return raw[:-1]

    def replacement(self, commit):
        sha, line, replaced, _ = commit
        try:
            named = load_json(replaced)
        except ValueError:
            named = None
        if line is not None or not isinstance(named, dict) or not is_plan_id(
                named.get("plan_id")):
            raise self.foreign(sha)
        return named

    def foreign(self, sha, detail=None):
        return damaged(f"the shared plan on {self.remote} has a commit {sha[:12]} that holds "
                       "no ledger line — the ref was written by something else.",
                       "bad_remote_event", detail=detail)

    def no_plan(self, sha):
        """The ref's own commit holds no plan at all (a branch pushed over the ref)."""
        return self.foreign(sha, {"no_plan_at": sha})

    def rewritten(self):
        return damaged(f"the shared plan on {self.remote} no longer holds the commit this clone "
                       "last published or pulled — its history was rewritten (a fork: "
                       "docs/reference.md, A fork of a shared plan, says how to keep one).",
                       "remote_history_rewritten")


def apply_shared_line(plan, line, seq, head, remote):
    """A line from the remote, checked like a line read back from the ledger."""
    ev = parse_event(line)
    if ev is None or ev["seq"] != seq or ev.get("prev") != head:
        got = ev["seq"] if ev else "?"
        raise damaged(f"the shared plan on {remote} does not continue this ledger at event {seq} "
                      f"(found event {got}, or a broken hash chain) — its history was rewritten "
                      "(a fork: docs/reference.md, A fork of a shared plan, says how to keep "
                      "one).", "remote_history_rewritten")
    try:
        plan = apply_event(plan, ev)
    except FablizeError as e:
        raise damaged(f"the shared plan on {remote}: event {seq} is not legal when replayed "
                      f"({e.message}).", "bad_remote_event")
    plan["ledger"] = {"seq": seq, "head": sha256_hex(line)}
    return plan, ev


def checked_log(ev, log, remote):
    """The path a remote run's log is written to (None when there is none), checked."""
    name = ev.get("log")
    if type(name) is not str or log is None:
        return None
    if not re.fullmatch(SAFE_LOG, name):
        raise damaged(f"the shared plan on {remote}: run log path {one_line(name)} is not under "
                      f"{RUNS}/.", "bad_remote_event")
    if ev.get("sha256") is not None and sha256_hex(log) != ev["sha256"]:
        raise damaged(f"the shared plan on {remote}: {name} does not match the sha256 its run "
                      "recorded.", "run_log_mismatch")
    return name


def write_run_log(store, ev, log, remote):
    """A remote run's log into runs/: the same bytes again are left alone (a sync killed after
    it wrote them); another file of that name is a stale local log, moved aside."""
    name = checked_log(ev, log, remote)
    if name is None:
        return
    path = store.path(name)
    ensure_subdir(store.path(RUNS))
    if os.path.lexists(path):
        if read_state_file(path) == log:
            return
        os.replace(path, free_name(path + ".local"))
    write_atomic(path, log)


def unpublished_lines(session, after_seq):
    """The local ledger's lines after event `after_seq`, oldest first."""
    if session.ledger.open() is None:
        return []
    end = session.cut_torn_tail(session.plan and {"ledger": session.plan["ledger"]})
    found = []
    for _, line in session.ledger.backward(end):
        ev = parse_event(line)
        if ev is None or ev["seq"] <= after_seq:
            break
        found.append(line)
    return found[::-1]


def diverged(plan, cfg, ledger=None, end=None):
    """Whether the local ledger no longer holds, at share.json's position, the event published
    there (`rebuild` set a damaged published line aside, a ledger was restored from a backup):
    share.json alone would then call unpublished what the remote already holds at those seqs,
    or published what it never saw. O(1) where the plan is at or behind that position; else
    the line is read back from `ledger` (its first `end` bytes)."""
    if cfg["seq"] == 0 or (plan is not None and plan["plan_id"] != cfg["plan_id"]):
        return False
    if plan is None:  # the ledger holds nothing of what was published
        return True
    seq = plan["ledger"]["seq"]
    if seq <= cfg["seq"]:
        return seq < cfg["seq"] or plan["ledger"]["head"] != cfg["head"]
    if ledger is None or ledger.open() is None:
        return False
    for _, line in ledger.backward(end):
        ev = parse_event(line)
        if ev is None or ev["seq"] <= cfg["seq"]:
            return ev is None or ev["seq"] != cfg["seq"] or sha256_hex(line) != cfg["head"]
    return True


def realign(session, cfg):
    """When the local ledger and share.json disagree (diverged): share.json's position goes back
    to the last event this clone's ledger and its copy of the published commits agree on, so
    that the remote's events after it come in again and the local ones after it are re-chained
    on them — never pushed on a chain the remote does not hold. Returns whether it did (the
    remote must then be asked first)."""
    plan, store = session.plan, session.store
    if (plan is not None and plan["plan_id"] != cfg["plan_id"]) or cfg["commit"] is None:
        return False
    end = session.cut_torn_tail(plan and {"ledger": plan["ledger"]})
    if not diverged(plan, cfg, session.ledger, end):
        return False
    n, tip = cfg["seq"], cfg["commit"]
    published = {}  # seq → (commit, line) as this clone published or pulled it

    def published_line(seq):
        if seq not in published:  # read CHAIN_BATCH commits down from there, in one git process
            steps = range(n - seq, min(n, n - seq + CHAIN_BATCH))
            got = cat(store, [name for i in steps for name in (
                f"{tip}~{i}", f"{tip}~{i}:event.jsonl")])
            for j, i in enumerate(steps):
                commit, blob = got[2 * j:2 * j + 2]
                published[n - i] = (commit and commit[0], blob and blob[1])
        return published[seq]

    base = (0, ZERO_HASH, None)
    for _, line in session.ledger.backward(end) if end else ():
        ev = parse_event(line)
        if ev is None or ev["seq"] > n:
            continue
        commit, blob = published_line(ev["seq"])
        if commit is not None and blob == line + b"\n":
            base = (ev["seq"], sha256_hex(line), commit)
            break
    seq, head, commit = base
    cfg.update(seq=seq, head=head, commit=commit)
    save_share_config(store, cfg)  # behind the remote is always safe: its events come in again
    store.warn(f"this clone's {LEDGER} no longer holds event {n} as it was published to "
               f"{cfg['remote']}: the remote's events after event {seq} are taken in again, and "
               "this clone's own after them are re-chained on them before they are published.")
    return True


def replay(data):
    """The plan a ledger's bytes hold, replayed and checked (None for no lines)."""
    return audit_ledger(data, None)["plan"] if data else None


# The journal: sync steps that change several files ############################################


class Journal:
    """One sync step that changes several files at once, made crash-safe. Its header says what
    the state is after it: the ledger (its first `base` lines kept, the journal's lines after
    them), the plan archived first (a step that replaces the plan), the logs staged for their
    final names, the names no event uses any more, the events set aside, share.json, and an
    archive folder whose plan became current again (removed at the end).

    Order: the staged files are written and synced, then the journal (write_atomic); until it
    exists a kill leaves the old state whole (a stage folder without a journal is litter, and
    goes). From then on every step is idempotent, and the next command (attach) applies the
    journal again up to the end, where it is removed: the ledger swap (Transaction.swap_ledger)
    is the moment the new state becomes current; before it the old one still is, and the
    ledger's position tells which."""

    def __init__(self, store, base_seq=0, base_head=ZERO_HASH):
        self.store = store
        self.id = os.urandom(4).hex()
        self.base = {"seq": base_seq, "head": base_head}
        self.ledger = None
        self.lines = []
        self.archive = None
        self.logs = []       # [staged name, final path]
        self.drop = []
        self.rejected = []
        self.share = None
        self.restored = None
        self.stage = None

    def stage_dir(self):
        if self.stage is None:
            for name in os.listdir(self.store.dir):  # litter of a kill before a journal
                if name.startswith(STAGE) and not os.path.lexists(self.store.path(JOURNAL)):
                    remove_tree(self.store.path(name))
            self.stage = STAGE + self.id
            os.mkdir(self.store.path(self.stage))
        return self.store.path(self.stage)

    def stage_bytes(self, final, data):
        staged = str(len(self.logs))
        fd = open_state_file(os.path.join(self.stage_dir(), staged),
                                    os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.logs.append([staged, final])

    def stage_link(self, src, final):
        staged = str(len(self.logs))
        link_or_copy(src, os.path.join(self.stage_dir(), staged))
        self.logs.append([staged, final])

    def header(self):
        return {"journal": 1, "id": self.id, "base": self.base, "ledger": self.ledger,
                "archive": self.archive, "logs": self.logs, "drop": self.drop,
                "rejected": self.rejected, "share": self.share, "restored": self.restored,
                "stage": self.stage}

    def write(self):
        if self.stage is not None:
            fsync_dir(self.store.path(self.stage))
        write_atomic(self.store.path(JOURNAL), dumps(self.header()).encode("utf-8")
                            + b"\n" + b"".join(x + b"\n" for x in self.lines), sweep=True)
        crash_point("sync-journal-written")

    @classmethod
    def read(cls, store):
        raw = read_state_file(store.path(JOURNAL))
        if raw is None:
            return None
        first, _, rest = raw.partition(b"\n")
        try:
            head = load_json(first)
        except ValueError:
            head = None
        if not isinstance(head, dict) or head.get("journal") != 1:
            os.replace(store.path(JOURNAL), free_name(store.path(JOURNAL + ".broken")))
            store.warn(f"{JOURNAL} was not a journal fablize wrote; it was moved to "
                       f"{JOURNAL}.broken and nothing was applied from it.")
            return None
        journal = cls(store)
        for key in ("id", "base", "ledger", "archive", "logs", "drop", "rejected", "share",
                    "restored", "stage"):
            setattr(journal, key, head[key])
        journal.lines = rest.split(b"\n")[:-1]
        return journal

    def apply(self, session, plan=None, recovering=False):
        """Bring the state to the journal's, step by step, each step done again harmlessly;
        `plan` is the new ledger's plan when the caller has it (it is replayed otherwise)."""
        store = self.store
        current = session.plan
        if current is None or current["ledger"] != self.ledger:  # not swapped in yet
            data = read_state_file(store.path(LEDGER)) or b""
            kept = data.split(b"\n")[:self.base["seq"]]
            head = sha256_hex(kept[-1]) if kept else ZERO_HASH
            if len(kept) != self.base["seq"] or head != self.base["head"]:
                self.discard("the ledger no longer starts with the lines it kept")
                return
            if self.archive:
                archive_files(store, self.archive)
                crash_point("sync-archived")
            data = b"".join(x + b"\n" for x in kept + self.lines)
            session.swap_ledger(data, plan if plan is not None else replay(data))
        crash_point("sync-ledger-swapped")
        finals = set()
        for staged, final in self.logs:
            finals.add(final)
            src = store.path(os.path.join(self.stage or "", staged))
            if os.path.lexists(src):
                if final.startswith(RUNS + "/"):
                    ensure_subdir(store.path(RUNS))
                os.replace(src, store.path(final))
        crash_point("sync-logs-placed")
        for name in self.drop:
            if name not in finals and os.path.lexists(store.path(name)):
                os.unlink(store.path(name))
        if self.rejected:
            keep_set_aside(store, self.rejected, recovering)
            if not recovering:
                say_set_aside(store, self.rejected)
        crash_point("sync-set-aside")
        save_share_config(store, self.share)
        share_of(session).unsaved = False
        crash_point("sync-share-saved")
        if self.restored and os.path.lexists(store.path(self.restored)):
            remove_tree(store.path(self.restored))
        self.finish()

    def discard(self, why):
        os.replace(self.store.path(JOURNAL), free_name(self.store.path(JOURNAL + ".broken")))
        self.store.warn(f"an interrupted sync could not be finished ({why}); its journal is kept "
                        f"as {JOURNAL}.broken and its staged files in {self.stage} — the plan is "
                        "as it was before that sync, and the next sync starts it again.")

    def finish(self):
        if self.stage and os.path.lexists(self.store.path(self.stage)):
            remove_tree(self.store.path(self.stage))
        if os.path.lexists(self.store.path(JOURNAL)):
            os.unlink(self.store.path(JOURNAL))
        fsync_dir(self.store.dir)


def remove_tree(path):
    import shutil
    shutil.rmtree(path)


def plan_logs(store, folder=""):
    """The run logs in `folder`/runs/ (the state directory's by default), not the hidden temp
    logs of runs under way."""
    try:
        names = os.listdir(store.path(os.path.join(folder, RUNS)))
    except FileNotFoundError:
        return []
    return sorted(f"{RUNS}/{n}" for n in names if not n.startswith(".") and n.endswith(".log"))


def archive_files(store, dest):
    """The current plan's files linked into `dest` (archive/<plan id>): its snapshot, ledger,
    torn lines and run logs. Links, not moves: the current plan stays whole until the journal
    swaps the new ledger in (its old logs go after). Done again, it adds what is missing."""
    ensure_subdir(store.path(ARCHIVE))
    ensure_subdir(store.path(dest))
    for name in (SNAPSHOT, LEDGER, LEDGER + ".broken", *plan_logs(store)):
        src, dst = store.path(name), store.path(os.path.join(dest, name))
        if os.path.lexists(src) and not os.path.lexists(dst):
            if name.startswith(RUNS + "/"):
                ensure_subdir(store.path(os.path.join(dest, RUNS)))
            link_or_copy(src, dst)
    fsync_dir(store.path(dest))


def finish_interrupted(store):
    """A sync a kill interrupted: applied again to its end, under the lock."""
    with store.session() as s:
        s.load()
        journal = Journal.read(store)
        if journal is not None:
            journal.apply(s, recovering=True)
            store.warn("finished a sync that an interrupted command had started (the ledger, "
                       "its run logs and share.json now agree).")


# Integrating the remote's events ##############################################################


def integrate(session, cfg, chain):
    """Take in the chain's events after cfg's position. With no local event waiting they are
    appended at once; otherwise the rebase is worked out in memory and returned, to be written
    once its push is decided (Rebase). A chain that ends with a replacement sets every local
    event aside, then the plan that replaced this one is followed. Returns (a Rebase or None,
    the events set aside, whether the replacing plan was on the remote: False means try
    again)."""
    replaced = chain.replaced
    if chain.events:
        share_of(session).busy = True  # other clones are at work right now (claim: spread)
    rebase = take_events(session, cfg, chain, replaced and replaced["plan_id"])
    if replaced is None:
        return rebase, [], True
    set_aside = rebase.apply(session, cfg) if rebase is not None else []
    followed = follow_replacement(session, cfg, replaced)
    if followed is None:
        return None, set_aside, False
    return None, set_aside + followed, True


def take_events(session, cfg, chain, replaced_by=None):
    """The chain's events appended to the local ledger when no local event waits for the
    remote (returns None); else the Rebase that puts them under the local ones."""
    store = session.store
    incoming = chain.events
    local = unpublished_lines(session, cfg["seq"])
    same = 0  # a push that landed before its process died: those events are already here
    while same < min(len(local), len(incoming)) and local[same] == incoming[same][1]:
        same += 1
    base_seq = cfg["seq"] + same
    local, incoming = local[same:], incoming[same:]
    if local:
        return Rebase(session, cfg, chain.last, base_seq, incoming, local, replaced_by)
    plan = session.plan
    seq, head = (plan["ledger"]["seq"], plan["ledger"]["head"]) if plan else (0, ZERO_HASH)
    lines = []
    for _, line, log in incoming:
        seq += 1
        plan, ev = apply_shared_line(plan, line, seq, head, cfg["remote"])
        if seq == 1 and plan["plan_id"] != cfg["plan_id"]:
            raise damaged(f"the shared plan {cfg['plan_id']} on {cfg['remote']} holds plan "
                          f"{one_line(plan['plan_id'])}.", "bad_remote_event")
        head = plan["ledger"]["head"]
        write_run_log(store, ev, log, cfg["remote"])
        lines.append(line)
    if lines:
        session.append_lines(lines, plan)
    if chain.last != cfg["commit"]:
        # written with the push that usually follows (keep_position): a share.json behind the
        # ledger is always safe, it only makes the next sync read those events again
        cfg.update(seq=seq, head=head, commit=chain.last)
        share_of(session).unsaved = True
    return None


def keep_position(session, cfg):
    """share.json written, if take_events moved it on in memory only."""
    share = share_of(session)
    if share.unsaved:
        save_share_config(session.store, cfg)
        share.unsaved = False


class Rebase:
    """The local ledger as it is once the remote's events come in under the local ones: its
    first `base_seq` lines (what the remote holds too), the remote's `incoming` events
    [(commit, line, log)], then the `local` unpublished events re-chained after them. Worked out
    in memory, so that a push that loses again costs no write here: `lines` is what to push, on
    `tip` (the remote's last event), and apply() writes the rebase (a Journal) once the push is
    decided — won, refused, or given up.

    A local event no longer legal after the remote's (another clone claimed the story first) is
    set aside with why; with `replaced_by` every local event is (the plan was replaced on the
    remote). A local event the remote holds already, re-chained (a command pushed this rebase
    and died before writing it here), is taken as the remote's. A run's log follows its event's
    new seq: the remote's logs come from their commits, the local ones are linked under their
    new names, and the journal places them, so a kill leaves each log where one ledger or the
    other names it."""

    def __init__(self, session, cfg, tip, base_seq, incoming, local, replaced_by=None):
        store, remote = session.store, cfg["remote"]
        self.store, self.tip = store, tip
        data = read_state_file(store.path(LEDGER)) or b""
        kept = data.split(b"\n")[:base_seq]
        plan = replay(b"".join(x + b"\n" for x in kept))
        seq, head = (base_seq, plan["ledger"]["head"]) if plan else (0, ZERO_HASH)
        self.base = (seq, head)
        self.incoming, theirs = [], []
        for _, line, log in incoming:
            seq += 1
            plan, ev = apply_shared_line(plan, line, seq, head, remote)
            head = plan["ledger"]["head"]
            self.incoming.append((line, checked_log(ev, log, remote), log))
            theirs.append(ev)
        self.share = dict(cfg, seq=seq, head=head, commit=tip)  # what the remote holds
        finals = {name for _, name, _ in self.incoming if name}
        self.lines, self.links, self.set_aside, moved = [], [], [], []
        renumber = {}
        for line in local:
            ev = parse_event(line)
            old, old_log = ev["seq"], ev.get("log") if ev["event"] == "verify_run" else None
            src = None
            if type(old_log) is str and re.fullmatch(SAFE_LOG, old_log):
                src = store.path(old_log)
                if not os.path.lexists(src) and stranded_log(store, ev) is None:
                    src = None
            if any(same_event(ev, t) for t in theirs):  # published already, re-chained
                moved.append(old_log)
                continue
            why = None
            if replaced_by is not None:
                why = (f"plan {cfg['plan_id']} was replaced on {remote} by {replaced_by}",
                       "plan_replaced")
            else:
                ev.update(seq=seq + 1, prev=head)
                if type(ev.get("after_seq")) is int:
                    ev["after_seq"] = renumber.get(ev["after_seq"], min(ev["after_seq"], base_seq))
                if isinstance(ev.get("runs"), list):
                    ev["runs"] = [renumber.get(r, r) for r in ev["runs"]]
                if old_log is not None:
                    ev["log"] = f"{RUNS}/{seq + 1}-{ev['id']}.log"
                trial = json.loads(json.dumps(plan)) if plan is not None else None
                why = moved_on(trial, ev, remote)
                if why is None:
                    try:
                        trial = apply_event(trial, ev)
                    except FablizeError as e:
                        why = (e.message, e.code)
            if why is not None:
                self.set_aside.append((line, why))
                if src is not None:
                    final = f"{RUNS}/rejected-{old}.log"
                    while final in finals or os.path.lexists(store.path(final)):
                        final = f"{RUNS}/rejected-{old}-{os.urandom(2).hex()}.log"
                    self.links.append((src, final))
                    finals.add(final)
                    moved.append(old_log)
                continue
            if src is not None:
                self.links.append((src, ev["log"]))
                finals.add(ev["log"])
                moved.append(old_log)
            new_line = dumps(ev).encode("utf-8")
            seq, head = seq + 1, sha256_hex(new_line)
            trial["ledger"] = {"seq": seq, "head": head}
            plan = trial
            renumber[old] = seq
            self.lines.append(new_line)
        self.drop = [name for name in moved if name is not None and name not in finals]
        self.plan, self.ledger = plan, {"seq": seq, "head": head}

    def apply(self, session, cfg, pushed=None):
        """Write the rebase (a Journal: crash-safe); with `pushed`, the commit its re-chained
        events were pushed as, share.json records them as published. Returns the events set
        aside (said now)."""
        journal = Journal(self.store, *self.base)
        for line, name, log in self.incoming:
            journal.lines.append(line)
            if name is not None:
                journal.stage_bytes(name, log)
        for src, final in self.links:
            journal.stage_link(src, final)
        journal.lines += self.lines
        journal.drop = self.drop
        journal.rejected = [set_aside_record(line, reason, code, journal.id)
                            for line, (reason, code) in self.set_aside]
        journal.ledger = self.ledger
        journal.share = self.share if pushed is None else dict(
            self.share, seq=self.ledger["seq"], head=self.ledger["head"], commit=pushed)
        journal.write()
        journal.apply(session, self.plan)
        cfg.clear()
        cfg.update(journal.share)
        return journal.rejected


def moved_on(plan, ev, remote):
    """Why a local claim lost a race in words that say so — the story went another round on the
    remote meanwhile, so the claim's round is not the plan's — or None. (apply_event would call
    that round a field no command writes: a hand edit; here it is another clone's work.)"""
    if ev["event"] != "story_started" or plan is None:
        return None
    story = next((s for s in plan["goals"] if s["id"] == ev.get("id")), None)
    if story is None or ev.get("round") == touch(story)["round"] + 1:
        return None
    story = touch(story)
    if story["status"] == "in_progress" and story["round"] == ev.get("round"):
        who = f" by agent {one_line(story['agent'])}" if story.get("agent") else ""
        return (f"on {remote}, {story['id']} was taken{who} meanwhile (it is in progress, "
                f"round {story['round']}: the round this claim was for)", "claim_lost")
    return (f"on {remote}, {story['id']} went another round meanwhile (it is "
            f"{story['status']}, round {story['round']}; this claim was for round "
            f"{one_line(str(ev.get('round')))})", "claim_lost")


def follow_replacement(session, cfg, replaced):
    """The plan was replaced on the remote (its chain ends with a replaced.json commit) and the
    local copy holds exactly the remote's events (integrate set the others aside): it is
    archived whole, and the plan that replaced it comes in from the remote and is current here.
    Returns [] (nothing more set aside), or None when the remote does not hold the new plan yet
    (its clone is between its two pushes: try again)."""
    store, remote, old_id = session.store, cfg["remote"], cfg["plan_id"]
    new_id = replaced["plan_id"]
    ref = fetch_plan(store, remote, new_id)
    if ref is None and publish_first(store, remote, old_id, replaced):
        ref = fetch_plan(store, remote, new_id)
    if ref is None:
        return None
    chain = Chain(store, ref, None, remote)
    plan, seq, head = None, 0, ZERO_HASH
    journal = Journal(store)
    for _, line, log in chain.events:
        seq += 1
        plan, ev = apply_shared_line(plan, line, seq, head, remote)
        head = plan["ledger"]["head"]
        name = checked_log(ev, log, remote)
        if name is not None:
            journal.stage_bytes(name, log)
        journal.lines.append(line)
    if plan is None or plan["plan_id"] != new_id:
        raise damaged(f"the shared plan {new_id} on {remote} does not hold plan {new_id}.",
                      "bad_remote_event")
    journal.archive = os.path.relpath(free_name(store.path(os.path.join(ARCHIVE, old_id))),
                                      store.dir)
    finals = {final for _, final in journal.logs}
    journal.drop = [name for name in plan_logs(store) + [LEDGER + ".broken"]
                    if name not in finals]
    journal.ledger = {"seq": seq, "head": head}
    journal.share = dict(new_config(remote, new_id), seq=seq, head=head, commit=chain.last)
    journal.write()
    journal.apply(session, plan)
    store.warn(f"plan {old_id} was replaced on {remote} by {new_id} (`create --force` on another "
               f"clone): the old plan is kept whole in {journal.archive}/, and this clone follows "
               f"{new_id} now.")
    cfg.clear()
    cfg.update(journal.share)
    if chain.replaced is not None:  # replaced again since
        return follow_replacement(session, cfg, chain.replaced)
    return []


def publish_first(store, remote, old_id, replaced):
    """The plan that replaced `old_id` is not on the remote: its clone was stopped between its
    two pushes (the old chain ended, the new plan not published). The replacement's commit
    carries the new plan's first line (end_commit): published here, checked first, so that no
    clone waits for one that may never run again. Its commit is the one every clone makes of
    that line, so a race with the replacing clone itself is a push that lands either way.
    Returns whether it is there now (False: an older engine's replacement, which carries none)."""
    raw, new_id = replaced.get("first_line"), replaced["plan_id"]
    if raw is None:
        return False
    if not raw.endswith(b"\n") or b"\n" in raw[:-1]:
        raise damaged(f"the shared plan {old_id} on {remote}: the first line of the plan that "
                      "replaced it is not one ledger line.", "bad_remote_event")
    line = raw[:-1]
    plan, _ = apply_shared_line(None, line, 1, ZERO_HASH, remote)
    if plan["plan_id"] != new_id:
        raise damaged(f"the shared plan {old_id} on {remote} names {new_id} as the plan that "
                      f"replaced it, but carries the first line of {one_line(plan['plan_id'])}.",
                      "bad_remote_event")
    tip = write_commits(store, None, [event_commit(store, new_id, line)], new_id)
    if push(store, remote, [(tip, SHARED_REFS + new_id, None)]):
        store.warn(f"plan {old_id} was replaced on {remote} by {new_id}, whose clone stopped "
                   f"before it published {new_id}: its first event, which the replacement "
                   "carries, is published from here.")
    return True


# Publishing ###################################################################################


class Contention:
    """Waiting out other writers, once per command: full-jitter exponential backoff (a lost
    push waits a random time up to BACKOFF_ROUNDS rounds, then twice that, … at most
    BACKOFF_CAP; a round is how long this command's last fetch-and-push took, so the wait
    scales with how busy the machine and the remote are), until FABLIZE_SHARE_WAIT seconds have
    passed. Writers that lost together spread out instead of colliding again: with 8 clones of
    2 agents, a first wait of up to 4 rounds made 4.1-4.8 completions/s where 1 round made
    2.5-2.8 (tests/test_sharing_bench.py)."""

    def __init__(self, remote):
        self.remote = remote
        self.limit = share_wait()
        self.started = self.round_started = time.monotonic()
        self.lost = 0
        self.why = None

    def elapsed(self):
        return time.monotonic() - self.started

    def lose(self, why=None):
        """After a lost push: how long to wait before the next try; or give up (exit 1, try
        again)."""
        self.lost += 1
        self.why = why or self.why
        now = time.monotonic()
        span = max(BACKOFF_BASE, now - self.round_started)
        delay = uniform() * min(BACKOFF_CAP, span * BACKOFF_ROUNDS * 2 ** (self.lost - 1))
        if self.elapsed() + delay > self.limit:
            raise refused(f"gave up publishing to {self.remote} after {self.elapsed():.1f} s: "
                          f"{self.lost} pushes lost to other writers"
                          + (f" (last: {one_line(self.why)[:200]})" if self.why else "")
                          + "; the events are kept here — try again (`sync` publishes them; "
                          "FABLIZE_SHARE_WAIT sets how long to wait):", "push_contended",
                          Step.engine("sync"))
        return delay

    def again(self):
        """A new round starts (after the wait)."""
        self.round_started = time.monotonic()

    def say_wait(self, store):
        if self.elapsed() > LONG_WAIT:
            store.warn(f"waited {self.elapsed():.1f} s for other writers on {self.remote} "
                       f"({self.lost} pushes lost to them) before this was published.")


def contention(session, remote):
    """The command's one Contention: every push of the command shares its wait."""
    share = share_of(session)
    if share.contention is None or share.contention.remote != remote:
        share.contention = Contention(remote)
    return share.contention


def push(store, remote, updates):
    """Push [(commit, ref, expected commit or None: the ref must not exist)]: True when the
    remote took them, False when another writer got there first (a ref is not where this clone
    expected it). A refusal for another reason (a hook, a policy) is raised at once with git's
    words; a remote that cannot be reached or is damaged, as such."""
    args = ["push", "--porcelain", "--no-verify"]
    args += [f"--force-with-lease={ref}:{expect or ''}" for _, ref, expect in updates]
    args += [remote] + [f"{commit}:{ref}" for commit, ref, _ in updates]
    code, out, err = git_call(store, *args)
    rows = [row.split("\t") for row in out.decode("utf-8", "replace").splitlines()]
    results = [row for row in rows if len(row) == 3]
    if code == 0 and results:
        return True
    lost, refusals = False, []
    for flag, _, summary in results:
        if flag != "!":
            continue
        reason = summary.lower()
        if (summary.startswith("[rejected]") and any(x in reason for x in LOST_RACE)) or any(
                x in reason for x in SERVER_RACE):
            lost = True
        elif "atomic push failed" not in reason:
            refusals.append(summary)
    if refusals:
        told = [line.strip()[7:].strip() for line in err.splitlines()
                if line.strip().startswith("remote:") and line.strip()[7:].strip()]
        said = (f"{one_line(remote)} refused the push: {one_line(refusals[0])[:200]}"
                + (f" — {one_line('; '.join(told))[:300]}" if told else "")
                + "; the events are kept here.")
        raise FablizeError(said + " The remote's own rule (a hook, a policy) refused it: "
                           "a human who runs that remote changes it, then `sync` "
                           "publishes them:", "push_refused", EXIT_REFUSED,
                           Step.engine("sync"), said)
    if lost:
        return False
    raise remote_failure(remote, err, f"git push exit {code}")


def sync_shared(session, cfg, fetch_first=True):
    """Publish what is unpublished: push it on the commit the remote is known to hold; a push
    that loses fetches the winner's events, works out the rebase of the local ones on them in
    memory, and pushes that, within the command's wait (Contention). The rebase is written here
    once its push is decided. A replacement of the plan (create --force) is published first.
    Returns the local events set aside."""
    store = session.store
    rejected = []
    if session.plan is not None and session.plan["plan_id"] != cfg["plan_id"]:
        publish_replacement(session, cfg)
    fetch = realign(session, cfg) or fetch_first
    wait = contention(session, cfg["remote"])
    while True:
        rebase = None
        if fetch:
            rebase, taken, ready = refresh(session, cfg)
            rejected += taken
            if not ready:
                pause(session, cfg, wait.lose(f"plan {cfg['plan_id']} was replaced on "
                                              f"{cfg['remote']} by a plan it does not hold yet"))
                wait.again()
                continue
        sources = None
        if rebase is not None:
            lines, parent, sources = rebase.lines, rebase.tip, dict(
                (final, src) for src, final in rebase.links)
        elif session.plan is not None and session.plan["ledger"]["seq"] > cfg["seq"]:
            lines, parent = unpublished_lines(session, cfg["seq"]), cfg["commit"]
        else:
            lines = []
        if not lines:  # nothing to publish: every local event is on the remote, or set aside
            if rebase is not None:
                rejected += rebase.apply(session, cfg)
            keep_position(session, cfg)
            wait.say_wait(store)
            return rejected
        tip = event_commits(store, dict(cfg, commit=parent), lines, None, sources)
        try:
            won = push(store, cfg["remote"], [(tip, SHARED_REFS + cfg["plan_id"], parent)])
            if not won:
                delay = wait.lose()
        except FablizeError:  # refused, unreachable, or waited out: the remote's events stay
            if rebase is not None:
                rejected += rebase.apply(session, cfg)
            keep_position(session, cfg)
            raise
        if won:
            crash_point("after-push")  # tests: published, not yet written here
            if rebase is not None:
                rejected += rebase.apply(session, cfg, pushed=tip)
            else:
                cfg.update(seq=session.plan["ledger"]["seq"], head=session.plan["ledger"]["head"],
                           commit=tip)
                save_share_config(store, cfg)
            share_of(session).unsaved = False
            wait.say_wait(store)
            return rejected
        fetch = True
        pause(session, cfg, delay)
        wait.again()


def pause(session, cfg, seconds):
    """Wait out other writers without holding the state lock (its holder would otherwise keep
    the other agents of this clone waiting up to FABLIZE_SHARE_WAIT, past their lock timeout):
    one of them may meanwhile commit and publish this command's events along with its own. The
    lock is taken again and the plan and share.json read again; `publish` then finds this
    command's event where it went."""
    if seconds <= 0:
        return
    keep_position(session, cfg)
    with session.unlocked():
        time.sleep(seconds)
    share_of(session).paused = True
    cfg.clear()
    cfg.update(share_config(session.store))


def refresh(session, cfg, restores=3):
    """Fetch the plan's ref and integrate what it holds: integrate's (rebase, events set aside,
    whether the plan that replaced this one, if any, was there)."""
    store = session.store
    ref = fetch_plan(store, cfg["remote"], cfg["plan_id"])
    if ref is None:
        if cfg["commit"] is None:
            return None, [], True
        raise ref_deleted(cfg, session.plan)
    try:
        chain = Chain(store, ref, cfg["commit"], cfg["remote"])
    except FablizeError as e:
        if restores and e.detail.get("no_plan_at") and restore_overwritten(
                store, cfg, e.detail["no_plan_at"]):
            return refresh(session, cfg, restores - 1)  # the plan is on the remote again
        if e.code != "remote_history_rewritten":
            raise written_elsewhere(e, cfg, ref)
        if not restores or not restore_rewound(store, cfg, ref):
            raise fork_error(store, cfg, ref) from None
        return refresh(session, cfg, restores - 1)  # the remote holds what this clone knew
    try:
        return integrate(session, cfg, chain)
    except FablizeError as e:
        raise written_elsewhere(e, cfg, ref)


def restore_overwritten(store, cfg, tip):
    """The remote's plan ref points at `tip`, a commit that holds no plan and does not continue
    this clone's published history (a branch pushed over the ref by mistake): nothing of the
    plan is there to decide between, so this clone — any clone that holds the plan — puts its
    published history back, checked by the lease on `tip`, and says so. False when this clone
    never published any of it, or `tip` continues its history (a commit someone added to the
    plan's chain: a human's to judge)."""
    mine = cfg["commit"]
    if mine is None or git_call(store, "merge-base", "--is-ancestor", mine, tip)[0] == 0:
        return False
    if push(store, cfg["remote"], [(mine, SHARED_REFS + cfg["plan_id"], tip)]):
        store.warn(f"{cfg['remote']}'s {SHARED_REFS}{cfg['plan_id']} pointed at commit "
                   f"{tip[:12]}, which holds no plan (a branch pushed over the plan's ref?): "
                   f"this clone's history of the plan ({count_noun(cfg['seq'], 'event')}) is "
                   f"published there again; that commit stays readable here (`git log "
                   f"{tip[:12]}`).")
    return True  # restored, or moved meanwhile: fetched again either way


def restore_rewound(store, cfg, ref):
    """The remote's ref moved back (a force-push, a server restored from a backup) to a commit
    this clone's published history holds: what the remote lost is pushed again, from this
    clone's own commits — a fast-forward, checked by the lease on where the remote is now —
    and said in one line. False when the remote's history is not a prefix of this clone's (a
    fork: a human keeps one)."""
    tip = git_out(store, "rev-parse", ref).decode().strip()
    mine = cfg["commit"]
    if tip == mine or git_call(store, "merge-base", "--is-ancestor", tip, mine)[0] != 0:
        return False
    lost = int(git_out(store, "rev-list", "--count", f"{tip}..{mine}").decode().strip() or 0)
    if not push(store, cfg["remote"], [(mine, SHARED_REFS + cfg["plan_id"], tip)]):
        return True  # another clone moved it meanwhile (restoring it too, or on top): fetch again
    store.warn(f"{cfg['remote']} had lost the last {count_noun(lost, 'event')} of plan "
               f"{cfg['plan_id']} (its ref had moved back); restored from this clone.")
    return True


def fork_error(store, cfg, ref):
    """The remote's history and this clone's differ (neither holds the other): a fork, which
    no command resolves alone. Names the command that shows both and the way to keep one."""
    remote, plan_id = cfg["remote"], cfg["plan_id"]
    return damaged(
       f"the shared plan on {remote} and this clone's copy differ (a fork: the remote's ref "
       "was rewritten and both went on). `git log --oneline --graph "
       f"{(cfg['commit'] or '')[:12]} {ref}` shows both; which to keep is a human's decision. "
       "To keep this clone's: "
       f"`git push --force {remote} {(cfg['commit'] or '')[:12]}:{SHARED_REFS}{plan_id}`, then "
       f"sync; to keep the remote's: move {STATE_DIRNAME}/ aside and sync (docs/reference.md: "
       "A fork of a shared plan):", "remote_history_rewritten",
                   steps=f"git log --oneline --graph {cfg['commit']} {ref}")


def ref_deleted(cfg, plan):
    held = plan["ledger"]["seq"] if plan else cfg["seq"]
    return damaged(
        f"{cfg['remote']} no longer holds {SHARED_REFS}{cfg['plan_id']}: the shared plan's ref "
        f"was deleted there. This clone keeps all {count_noun(held, 'event')} — `share --remote "
        f"{cfg['remote']}` publishes them again:", "remote_history_rewritten",
                   steps=Step.engine(f"share --remote {cfg['remote']}"))


def publish_replacement(session, cfg):
    """`create --force` on a shared plan, published: the old plan's chain gets the local events
    it lacks and ends with a commit naming the new plan, pushed where this clone last saw the
    old plan (the compare-and-swap: of two racing replacements one wins). share.json then names
    the new plan, which the caller publishes as any plan (a killed command's push of it is
    found there and taken as done). When the old plan moved on the remote or was replaced there
    first, the replacement is undone here — the new plan archived, the old one current again
    with the remote's events (or the plan that won followed) — and refused."""
    store, plan, remote, old_id = session.store, session.plan, cfg["remote"], cfg["plan_id"]
    if cfg["commit"] is not None:  # else the old plan never reached the remote: nothing to end
        replaced = plan.get("replaces") or {}
        folder = replaced.get("path") if replaced.get("plan_id") == old_id else None
        where = None
        if folder and re.fullmatch(ARCHIVE + r"/[\w.-]+", folder):
            where = store.path(folder)
        old_lines = []
        if where is not None:
            data = read_state_file(os.path.join(where, LEDGER)) or b""
            old_lines = [x for x in data.split(b"\n") if (parse_event(x) or {}).get("seq", 0)
                         > cfg["seq"]]
        old_tip = write_commits(
            store, cfg["commit"],
            [event_commit(store, old_id, line, where) for line in old_lines]
            + [end_commit(old_id, plan, commit_time(plan["created"]), first_line(session))],
            old_id)
        wait = contention(session, remote)
        while not push(store, remote, [(old_tip, SHARED_REFS + old_id, cfg["commit"])]):
            # lost: unless the remote's ref is still where this clone saw it (the winner of a
            # race at the remote's ref lock is not done yet, or failed too: try again)
            ref = fetch_plan(store, remote, old_id)
            tip = cat(store, [ref])[0] if ref else None
            if tip is not None and tip[0] == old_tip:
                break  # this very replacement, pushed before a kill: published
            if tip is None or tip[0] != cfg["commit"]:
                undo_replacement(session, cfg, folder)
            pause(session, cfg, wait.lose(f"the replacement of plan {old_id}"))
            wait.again()
            if cfg["plan_id"] != old_id:  # another command of this clone published it meanwhile
                return
        crash_point("after-replaced-push")
    cfg.clear()
    cfg.update(new_config(remote, plan["plan_id"]))
    save_share_config(store, cfg)


def first_line(session):
    """The local ledger's first line (the plan's plan_created), read up to its newline."""
    ledger, parts, pos = session.ledger, [], 0
    if ledger.open() is None:
        return None
    while True:
        chunk = ledger.read(pos, 1 << 16)
        if not chunk:
            return None
        end = chunk.find(b"\n")
        if end >= 0:
            return b"".join(parts) + chunk[:end]
        parts.append(chunk)
        pos += len(chunk)


def undo_replacement(session, cfg, folder):
    """The replacement lost: the new plan is archived, the old plan (from the archive the
    replacement made) is current again, then the remote's events come in. Raises the refusal."""
    store, remote, old_id = session.store, cfg["remote"], cfg["plan_id"]
    mine = session.plan["plan_id"]
    if not folder or not os.path.lexists(store.path(os.path.join(folder, LEDGER))):
        raise refused(f"plan {old_id} moved on {remote} (or was replaced there) before this "
                      f"clone's replacement {mine} was published, and its archive is gone, so "
                      f"{old_id} cannot be made current again here; the replacement stays "
                      "local, and which plan this clone follows is a human's decision: to "
                      f"publish {mine} as a plan of its own ({old_id} goes on without it), "
                      f"remove {shown_path(store, SHARE)} and `share --remote {remote}`; to "
                      f"follow the remote, move {shown_path(store, '')} aside and `sync`.",
                      "plan_replaced")
    journal = Journal(store)
    data = read_state_file(store.path(os.path.join(folder, LEDGER)))
    journal.lines = data.split(b"\n")[:-1]
    journal.archive = os.path.relpath(free_name(store.path(os.path.join(ARCHIVE, mine))),
                                      store.dir)
    kept = []
    for name in plan_logs(store, folder) + [LEDGER + ".broken"]:
        src = store.path(os.path.join(folder, name))
        if os.path.lexists(src):
            journal.stage_link(src, name)
            kept.append(name)
    journal.drop = [name for name in plan_logs(store) + [LEDGER + ".broken"] if name not in kept]
    old = replay(data)
    journal.ledger = old["ledger"]
    journal.share = dict(cfg)
    journal.restored = folder
    journal.write()
    journal.apply(session, old)
    before = session.plan["ledger"]["seq"]
    rebase, taken, _ = refresh(session, cfg)
    if rebase is not None:
        taken += rebase.apply(session, cfg)
    keep_position(session, cfg)
    if cfg["plan_id"] != old_id:
        raise refused(
            f"plan {old_id} was replaced on {remote} by {cfg['plan_id']} first (another clone's "
            f"`create --force`): this clone's replacement {mine} was not published — it is kept "
            f"in {journal.archive}/ — and this clone follows {cfg['plan_id']} now; whether to "
            "replace that one too is a human's decision, made looking at it:", "plan_replaced",
            steps=Step.engine("status"))
    moved = count_noun(session.plan["ledger"]["seq"] - before + len(taken), "new event")
    raise refused(
        f"plan {old_id} moved on {remote} since this clone last synced ({moved}): the "
        f"replacement {mine} was not published — it is kept in {journal.archive}/ and {old_id} "
        "is current here again, with those events; look at them (`status`), then run `create "
        "--force` again:", "plan_replaced", steps=Step.engine("status"))


def others_active(plan, own):
    """Whether another agent is at work (a story in progress that this command's event is not
    about): then the remote has almost surely moved since this clone's last command, and asking
    it first saves a push that would lose."""
    sid = own.get("id") if own else None
    return any(story["id"] != sid for story in active_stories(plan))


# The interface ################################################################################

TOLERATED = ("remote_unreachable", "push_contended", "push_refused")


def attach(store):
    """A shared plan: finish a sync a kill interrupted, say the events set aside that nobody
    acknowledged, and publish what every writing session commits (storage calls its
    after-commit steps, knowing nothing of sharing)."""
    store.after_commit.append(publish)
    if os.path.lexists(store.path(JOURNAL)):
        finish_interrupted(store)
    say_pending(store)


def publish(session, claim=False, fetch_first=None):
    """After a session's commits: put the unpublished events on the remote. With `claim`, the
    command may go on only if its last event is on the remote: an event set aside or an
    unreachable remote is refused; otherwise the events stay local with a warning and the next
    command or `sync` publishes them. Returns the plan."""
    store = session.store
    cfg = share_config(store)
    if cfg is None or session.plan is None:
        return session.plan
    own = session.last
    replacing = session.plan["plan_id"] != cfg["plan_id"]
    if fetch_first is None:
        fetch_first = not replacing and others_active(session.plan, own)
    if (not fetch_first and not replacing and session.plan["ledger"]["seq"] <= cfg["seq"]
            and not diverged(session.plan, cfg)):
        return session.plan
    try:
        rejected = sync_shared(session, cfg, fetch_first)
    except FablizeError as e:
        if claim or e.code not in TOLERATED:
            raise
        said = e.said.rstrip(".:").replace(  # said once:
            "; the events are kept here", "")
        store.warn(f"not published: {said}. The events are kept here; the next command "
                   "or `sync` publishes them.")
        return session.plan
    mine = own_set_aside(session, own, rejected)
    if mine is not None:
        ev = mine["event"]
        if mine["code"] == "plan_replaced":
            raise refused(
                f"this {ev['event']} was not published: {one_line(mine['reason'])} meanwhile "
                f"(set aside in {REJECTED}); this clone follows that plan now, and what of this "
                "work carries over to it is a human's decision:", "plan_replaced",
                steps=Step.engine("status"))
        held = find_story(session.plan, ev["id"]) if ev.get("id") else None
        who = f" — agent {one_line(held['agent'])} holds it" if held and held["agent"] else ""
        said_instead(store, mine)
        moved = ("was taken" if ev["event"] == "story_started" and held
                 and held["status"] == "in_progress" else "changed")
        lost = (f"{one_line(ev.get('id') or ev['event'])} {moved} on {cfg['remote']} "
                f"meanwhile{who}; this {ev['event']} was not published "
                f"({one_line(mine['reason']).rstrip('.')})")
        # said: what a claim made instead says of it
        raise FablizeError(f"{lost} — see who holds what now:", "claim_lost", EXIT_REFUSED,
                           Step.engine("status"), lost)
    return session.plan


def reconcile(session):
    """`rebuild` of a shared plan: the remote's events first, even when the local ledger holds
    none of them any more (lost, or a directory moved aside) — taken in again from the remote,
    the local ones after them re-chained. A remote that cannot be reached now is said; the next
    writing command does it then. Returns the plan."""
    cfg = share_config(session.store)
    if cfg is None or (session.plan is not None and session.plan["plan_id"] != cfg["plan_id"]):
        return publish(session, fetch_first=True) if cfg is not None else session.plan
    try:
        sync_shared(session, cfg, fetch_first=True)
    except FablizeError as e:
        if e.code not in TOLERATED:
            raise
        said = e.said.rstrip(".:").replace("; the events are kept here", "")
        session.store.warn(f"not reconciled with the remote: {said}. The next writing command "
                           "or `sync` does it.")
    return session.plan


def same_event(a, b):
    """Whether two events are one, whatever seq a rebase gave it."""
    return all(a.get(k) == b.get(k) for k in ("event", "id", "agent", "ts"))


def own_set_aside(session, own, rejected):
    """The record of this command's last event if it was set aside: by this sync, or, while
    this command waited without the lock (pause), by another command's sync."""
    if own is None:
        return None
    for r in rejected:
        if same_event(r["event"], own):
            return r
    if not share_of(session).paused:
        return None
    data = read_state_file(session.store.path(LEDGER)) or b""
    needle = b'"ts":"' + str(own.get("ts")).encode() + b'"'
    if any(same_event(parse_event(line) or {}, own) for line in data.split(b"\n")
           if needle in line):
        return None  # still here (published, or waiting for the next command)
    return next((r for r in read_pending(session.store) if same_event(r["event"], own)),
                {"event": own, "code": "claim_lost",
                 "reason": "another command of this clone set it aside"})


def pull(session):
    """`next`: the remote's newest events before it decides. When no story is in progress and
    one is ready, `next` will claim one, and the claim's push checks freshness itself (a push on
    a stale copy loses, and the claim is replayed on the winner's events): nothing is fetched
    first. Otherwise `next` may hand a story back or find nothing ready, which only the remote's
    newest events can tell: they are fetched first."""
    plan, cfg = session.plan, share_config(session.store)
    if (plan is not None and cfg is not None and plan["plan_id"] == cfg["plan_id"]
            and not active_stories(plan) and pick_ready(plan) is not None):
        return plan
    return publish(session, claim=True, fetch_first=True)


def claim(session, story, agent):
    """`next`'s story_started; in a shared plan it counts only once it is on the remote, and a
    claim lost to another machine (said, set aside) moves on to another ready story, a bounded
    number of times. A successful claim acknowledges the agent's claims set aside before.
    Returns the story now held."""
    if share_of(session).busy:
        story = spread(session.plan, story)
    for attempt in range(CLAIM_ATTEMPTS):
        commit_start(session, touch(story), agent)
        try:
            publish(session, claim=True, fetch_first=False)
            acknowledge(session.store, agent, claims_only=True)
            return find_story(session.plan, story["id"])
        except FablizeError as e:
            if e.code not in ("claim_lost", "plan_replaced"):
                withdraw_claim(session)
                raise
            if attempt == CLAIM_ATTEMPTS - 1:
                raise
            lost = e
        ready = ready_stories(session.plan)
        if not ready:
            if sequential(session.plan) and lost.code == "claim_lost":
                raise refused(f"{lost.said}; nothing else is ready for agent "
                              f"{one_line(agent or 'unnamed')} ({TAKE_TURNS}) — see who holds "
                              "what now:", "claim_lost", lost.steps) from lost
            raise lost
        # the other writers just won the first ready story: a random one avoids a convoy
        story = ready[int(uniform() * len(ready))]
        session.store.warn(f"{lost.said}. Claiming {story['id']} "
                           "instead.")
    raise lost


def spread(plan, story):
    """The story a claim goes for while other clones claim at the same moment (this command's
    fetch brought their new events): `next` picks the first ready story, and so do they, all
    at once, and all but one claim is lost and made again. A random ready story instead (plan
    order cannot be kept among clones racing anyway); a reopened story (a round behind it)
    keeps its turn. With 8 clones of 2 agents and 100 stories: 55 claims lost before, 35 with
    one of the first 2 x (in progress + 1), fewer with any."""
    if story["status"] == "failed" or story.get("round"):
        return story
    fresh = [s for s in ready_stories(plan)
             if s["status"] == "pending" and not s.get("round")]
    return fresh[int(uniform() * len(fresh))] if fresh else story


def withdraw_claim(session):
    """A claim whose push could not be made (the remote unreachable, a refusal, the wait spent)
    was never acknowledged — `next` fails — so it leaves the local ledger again, as a torn write
    would: a refused `next` changes nothing. (The claim was pushed first, without a fetch;
    before, the fetch would have failed first.) It is the ledger's last line, found by what it
    is (a rebase may have moved it), and only while the remote is not known to hold it."""
    last, cfg = session.last, share_config(session.store)
    if last is None or last["event"] != "story_started" or cfg is None or not session.held:
        return  # a pause let the lock go and could not take it again: nothing is written
    data = read_state_file(session.store.path(LEDGER)) or b""
    cut = data.rstrip(b"\n").rfind(b"\n") + 1
    ev = parse_event(data[cut:].rstrip(b"\n"))
    if ev is None or not same_event(ev, last):
        return
    if cfg["plan_id"] == session.plan["plan_id"] and cfg["seq"] >= ev["seq"]:
        return  # published (by another command of this clone, while this one waited)
    session.withdraw(data[:cut], replay(data[:cut]), ev["seq"])


def status(store, plan):
    """How far the local copy is ahead of and behind the remote, or None for a local plan; a
    remote that cannot be reached is `error`, a plan ref deleted, rewritten or replaced there
    (or a replacement not published yet) is `problem` — never "in sync"."""
    cfg = share_config(store)
    if cfg is None or plan is None:
        return None
    info = {"remote": cfg["remote"], "ref": SHARED_REFS + cfg["plan_id"],
            "published": cfg["seq"], "ahead": plan["ledger"]["seq"] - cfg["seq"], "behind": None}
    if plan["plan_id"] != cfg["plan_id"]:
        info.update(ref=SHARED_REFS + plan["plan_id"], published=0, ahead=plan["ledger"]["seq"],
                    problem=f"this plan replaces {cfg['plan_id']} here, and that is not "
                            "published yet — the next writing command (or `sync`) publishes it.")
        return info
    ledger = Ledger(store.path(LEDGER))
    try:
        lost = ledger.open() is not None and diverged(plan, cfg, ledger, ledger.end()[0])
    finally:
        ledger.close()
    if lost:
        info["problem"] = (f"this clone's {LEDGER} no longer holds event {cfg['seq']} as it was "
                           f"published to {cfg['remote']} — the next writing command (or `sync`) "
                           "takes the remote's events in again before it publishes anything.")
        return info
    try:
        ref = remote_tip(store, cfg["remote"], cfg["plan_id"])
        tip = cat(store, [ref, f"{ref}:{REPLACED}"]) if ref else None
    except FablizeError as e:
        info["error"] = e.said
        return info
    if tip is None:
        if cfg["commit"] is not None:
            info["problem"] = ref_deleted(cfg, plan).message
        else:
            info["behind"] = 0
        return info
    (sha, body), replaced = tip
    found = re.search(r" #(\d+) ", parse_commit(body)[1].decode("utf-8", "replace") + " ")
    seq = int(found.group(1)) if found else None
    if replaced is not None:
        info["problem"] = (f"this plan was replaced on {cfg['remote']} (`create --force` on "
                           "another clone) — the next command (or `sync`) archives it here and "
                           "follows the new plan.")
    elif sha == cfg["commit"]:
        info["behind"] = 0
    elif seq is not None and seq <= cfg["seq"]:
        back = cfg["commit"] and git_call(store, "merge-base", "--is-ancestor", sha,
                                          cfg["commit"])[0] == 0
        info["problem"] = (
            f"{cfg['remote']}'s ref moved back (it is at event {seq}, this clone published "
            f"{cfg['seq']}) — `sync` restores the events it lost from this clone." if back else
            f"{cfg['remote']}'s ref no longer continues this ledger (it is at event {seq}, this "
            f"clone published {cfg['seq']}) — its history was rewritten; `sync` shows how (a "
            "fork: docs/reference.md, A fork of a shared plan).")
    else:
        info["behind"] = seq - cfg["seq"] if seq is not None else None
    return info


def behind_step(info, prog):
    """(the line said first, the next step) of a clone whose copy is behind the remote (`status`,
    a session start): `sync` before anything this copy would name — a story it thinks ready may
    be done there. None when the copy is not known to be behind."""
    if not info or info.get("error") or info.get("problem") or not info.get("behind"):
        return None
    n = info["behind"]
    ahead = (f"; this clone has {count_noun(info['ahead'], 'event')} not published yet"
             if info["ahead"] else "")
    line = (f"fablize: this clone's copy is {count_noun(n, 'event')} behind {info['remote']} "
            f"({info['ref']}){ahead} — what follows is this copy, without "
            f"{'it' if n == 1 else 'them'}:")
    these = "that event" if n == 1 else "those events"
    return line, {"kind": "sync", "id": None, "cmd": f"{prog} sync",
                  "text": f"`{prog} sync` (it brings in {these}; then `status` says what is next)"}


def status_lines(info, prog):
    """The shared plan's state, said under the next step: where it is shared and how far this
    copy is ahead or behind (behind_step says that first, once)."""
    where = f"shared through {info['remote']} ({info['ref']})"
    if behind_step(info, prog):
        return []
    if info.get("error"):
        return [f"fablize: {where}: {count_noun(info['ahead'], 'event')} not published yet; "
                "the remote cannot "
                f"be reached now — {one_line(info['error'])}"]
    if info.get("problem"):
        return [f"fablize: {where}: {one_line(info['problem'])}"]
    if info["ahead"] or info["behind"]:
        return [f"fablize: {where}: {count_noun(info['ahead'], 'event')} ahead (not "
                "published), "
                f"{info['behind'] if info['behind'] is not None else 'some'} behind — run "
                f"`{prog} sync`."]
    return [f"fablize: {where}: in sync."]


def shared_plan_refs(store, remote):
    """{plan id: commit} of the plans shared on `remote`."""
    code, out, err = git_call(store, "ls-remote", remote, SHARED_REFS + "*")
    if code != 0:
        raise remote_failure(remote, err, f"git ls-remote exit {code}")
    found = {}
    for row in out.decode("utf-8", "replace").splitlines():
        sha, _, ref = row.partition("\t")
        plan_id = ref[len(SHARED_REFS):]
        if is_plan_id(plan_id):
            found[plan_id] = sha  # a ref no plan id names is someone else's, never a plan
    return found


def live_plans(store, remote, plans):
    """The plans of `plans` that no other plan replaced (their chains do not end with a
    replaced.json commit): what a fresh clone may pick without being told."""
    if len(plans) < 2:
        return plans
    fetch_objects(store, remote, [SHARED_REFS + p for p in sorted(plans)])  # no ref written
    ends = cat(store, [f"{plans[p]}:{REPLACED}" for p in sorted(plans)])
    return {p: plans[p] for p, end in zip(sorted(plans), ends) if end is None}


SHARED_GITIGNORE = (b"# a shared plan: its history is in refs/fablize/, not the branch; only "
                    b"its pin is committed\n*\n!" + PIN.encode() + b"\n")
OLD_SHARED_GITIGNORE = b"# a shared plan: its history is in refs/fablize/, not the branch\n*\n"


def ignore_shared_dir(store):
    """A shared plan lives in refs, not in the branch: nothing in its state directory is
    committed but its pin (sync --pin), so a branch merge never touches its history. Said in
    this clone's .git/info/exclude, which nothing commits: the state directory's .gitignore —
    which a branch may commit — is left as it is, so no `git commit -a` picks up an edit and no
    other clone's `git pull` meets one. Returns whether the exclusion was added (to be said)."""
    rel = exclude_path(store)
    if rel is None:  # no repository git would read it from: the state directory's own file
        path = store.path(".gitignore")
        if not os.path.lexists(path) or read_state_file(path) in (
                STATE_GITIGNORE.encode(), OLD_SHARED_GITIGNORE):
            write_atomic(path, SHARED_GITIGNORE)
        return False
    exclude, rel = rel
    wanted = [f"/{rel}/*", f"!/{rel}/{PIN}"]
    try:
        text = (read_state_file(exclude) or b"").decode("utf-8", "replace")
    except OSError:
        text = ""
    have = text.splitlines()
    if all(line in have for line in wanted):
        return False
    block = ("" if not text or text.endswith("\n") else "\n") + EXCLUDE_NOTE + "\n" + "".join(
        line + "\n" for line in wanted)
    os.makedirs(os.path.dirname(exclude), exist_ok=True)
    write_atomic(exclude, (text + block).encode("utf-8"))
    return True


EXCLUDE_NOTE = "# fablize: a shared plan's state stays in this clone (its history: refs/fablize/)"


def exclude_path(store):
    """(this clone's info/exclude, the state directory relative to the repository) — or None
    where git would not read them (a GIT_DIR-style variable, no repository, a name a pattern
    would misread)."""
    dirs = own_git_dirs(store)
    top = repo_root(store.root)
    if dirs is None or top is None:
        return None
    rel = os.path.relpath(os.path.realpath(store.dir), os.path.realpath(top)).replace(os.sep, "/")
    if rel.startswith("..") or not re.fullmatch(r"[\w.][\w./-]*", rel):
        return None
    return os.path.join(dirs[1], "info", "exclude"), rel


def pin_here(store, plan):
    """sync --pin (under the lock, after the sync): the plan's head as the remote holds it, in
    pin.json, for the branch to commit. Merged into the base branch, it is what `audit --remote
    --base` pins the shared plan to: the history up to it was reviewed with that merge, and may
    only grow. Refused while the remote lacks local events (a pin names what it holds)."""
    cfg = share_config(store)
    if cfg["plan_id"] != plan["plan_id"] or cfg["seq"] != plan["ledger"]["seq"]:
        raise refused(f"{cfg['remote']} does not hold all of this plan yet: a pin names what the "
                      "remote holds — run `sync --pin` again once it is reachable.",
                      "not_published")
    record = {"plan_id": plan["plan_id"], "pin": f"{cfg['seq']}:{cfg['head']}",
              "scope": plan.get("scope") or []}
    ignore_shared_dir(store)
    write_atomic(store.path(PIN), (dumps(record) + "\n").encode())
    return record


def start(store, remote):
    """share / create --remote: record the remote, then publish the whole ledger (again, when
    the remote lost the plan's ref). Returns the share record for --json and the line that says
    it."""
    with store.session() as s:
        plan = s.require_plan()
        set_aside_share(store)
        cfg = share_config(store)
        if cfg is not None and cfg["plan_id"] == plan["plan_id"] and cfg["remote"] != remote:
            raise refused(f"this plan is already shared through {cfg['remote']}. To move it "
                          f"to {remote}'s repository — every clone with it, a human's "
                          f"decision — point {cfg['remote']} there, then `share --remote "
                          f"{cfg['remote']}`:", "already_shared",
                          steps=f"git remote set-url {quote_arg(cfg['remote'])} <url>")
        replacing = (cfg is not None and cfg["remote"] == remote
                     and (plan.get("replaces") or {}).get("plan_id") == cfg["plan_id"])
        if cfg is None or (cfg["plan_id"] != plan["plan_id"] and not replacing) or (
                cfg["commit"] is not None and cfg["plan_id"] == plan["plan_id"]
                and fetch_plan(store, remote, cfg["plan_id"]) is None):
            cfg = new_config(remote, plan["plan_id"])
            save_share_config(store, cfg)
            first = True
        else:
            first = False
        excluded = ignore_shared_dir(store)
        sync_shared(s, cfg)
        plan = s.plan
    return {"remote": remote, "ref": SHARED_REFS + plan["plan_id"], "published": cfg["seq"],
            "first": first, "excluded": bool(excluded),
            "turns": len(plan["goals"]) > 2 and sequential(plan)}


def text_share(data):
    """What `share` (and `create --remote`) says of its `share` result: where the plan went; the
    first time, what that publishes and, for a plan whose agents take turns, that they do."""
    share = data["share"]
    lines = [f"fablize: plan {share['ref'][len(SHARED_REFS):]} shared through {share['remote']} "
             f"({share['ref']}, {count_noun(share['published'], 'event')})."]
    if share["excluded"]:  # said once, when this clone first keeps it out of git
        lines.append("fablize: the plan's state directory (but its pin) is kept out of git by "
                     "this clone's .git/info/exclude — no committed file changes.")
    if share["first"]:  # said once, when the plan first goes out
        lines.append(PUBLISHES.format(remote=share["remote"]))
        if share["turns"]:  # what its agents will get
            lines.append(f"fablize: {TAKE_TURNS}.")
    return lines


NO_PLAN_PROBE = 5.0  # seconds the no-plan refusal asks the remote whether it shares a plan


def remote_sharing(root):
    """"origin shares a plan" when the remote `sync` would use shares one, else None (no
    repository, no such remote, or it cannot be reached: the original's advice stands)."""
    if repo_root(root) is None:
        return None
    try:
        code, out, _ = git(root, "remote")
        names = out.decode("utf-8", "replace").split() if code == 0 else []
        remote = "origin" if "origin" in names else names[0] if len(names) == 1 else None
        if remote is None:
            return None
        # a refusal must not hang on a remote that does not answer: a few seconds, then the
        # original's advice stands
        code, out, _ = git(root, "ls-remote", remote, "refs/fablize/plans/*",
                           what="a shared plan", timeout=NO_PLAN_PROBE,
                           env=None if "GIT_SSH_COMMAND" in os.environ else {
                               "GIT_SSH_COMMAND": "ssh -o BatchMode=yes -o ConnectTimeout=3"})
    except (FablizeError, OSError):  # no git, or a remote that does not answer in time
        return None
    return f"{remote} shares a plan" if code == 0 and out.strip() else None


def cmd_share(ctx, a):
    ctx.store.require()
    ctx.show(text_share, {"share": start(ctx.store, remote_arg(ctx.store, a.remote,
                                                               "share --remote {}"))})


NEW_PLAN = 'create --brief "<task>" --goal "<title>::<objective>" --remote {}'


def choose_plan(store, remote, asked, step):
    """The plan a fresh clone syncs: the one asked for, else the one plan the remote shares
    that no other replaced. `step`: `sync` as it was run, with `{}` where --plan goes."""
    plans = shared_plan_refs(store, remote)
    if asked:
        if plan_id_arg(asked, step) not in plans:
            raise refused(f"{remote} shares no plan {one_line(asked)}" + (
                f" (it shares {', '.join(sorted(plans))}):" if plans else ":"), "not_found",
                steps=Step.engine(step.replace("{}", "<plan-id>", 1) if plans
                                  else NEW_PLAN.replace("{}", remote)))
        return asked
    live = live_plans(store, remote, plans)
    if len(live) == 1:
        return next(iter(live))
    raise refused(
        f"{remote} shares {len(live) or 'no'} plans" + (
            f" ({', '.join(sorted(live))}): say which with --plan ID:" if live else
            " — a human writes the plan; `create … --remote` shares it there:"), "which_plan",
        steps=Step.engine(step.replace("{}", "<plan-id>", 1) if live
                          else NEW_PLAN.replace("{}", remote)))



def cmd_sync(ctx, a):
    store = ctx.store
    cfg = share_config(store) if store.exists() else None
    if cfg is None:
        if store.exists() and store.has_plan_files():
            remote = a.remote or guessed_remote(store)
            raise refused("this plan is local — share it first: `share --remote "
                          "NAME`:", "not_shared",
                          steps=Step.engine("share --remote "
                                            + ("<remote>" if remote == "NAME" else remote)))
        # the steps of what this can refuse: `sync` as it was run, one value to choose
        asked = f" --plan {quote_arg(a.plan)}" if a.plan else ""
        remote = remote_arg(store, a.remote or default_remote(store, "sync --remote {}" + asked),
                            "sync --remote {}" + asked)
        plan_id = choose_plan(store, remote, a.plan, "sync" + (
            f" --remote {remote}" if a.remote else "") + " --plan {}")
        store.create_dir()
        with store.session() as s:
            s.load()
            if store.has_plan_files():  # made here while sync looked (sync has no --force)
                raise refused("a plan already exists — made here while `sync` ran: "
                              "check it with `status`:", "plan_exists",
                              steps=Step.engine("status"))
            cfg = new_config(remote, plan_id)
            save_share_config(store, cfg)
            ignore_shared_dir(store)
    elif a.remote and a.remote != cfg["remote"]:
        raise refused(f"this plan is shared through {cfg['remote']}, not "
                      f"{one_line(a.remote)}; `sync` uses {cfg['remote']}:",
                      "other_remote", steps=Step.engine("sync"))
    with store.session() as s:
        s.load()
        cfg = share_config(store)  # again under the lock: another command may have published
        before_id = s.plan["plan_id"] if s.plan else cfg["plan_id"]
        before = s.plan["ledger"]["seq"] if s.plan else 0
        replacing = before_id != cfg["plan_id"]  # create --force here, not published yet
        ahead = before if replacing else before - cfg["seq"]
        rejected = sync_shared(s, cfg)
        plan = s.plan
        seen = acknowledge(store) if a.acknowledge else []
        pinned = a.pin and plan is not None and pin_here(store, plan)
    if plan is None:
        raise refused(f"{cfg['remote']} holds nothing for plan {cfg['plan_id']} yet, and this "
                      f"clone holds none of it: forget the plan it named ({SHARE} is all there "
                      "is of it here), then `sync` finds what the remote shares:", "no_plan",
                      steps=f"rm {quote_arg(shown_path(store, SHARE))}")
    if plan["plan_id"] != before_id:  # the plan was replaced on the remote: this clone follows
        pulled, sent = plan["ledger"]["seq"], 0
    else:
        pulled = 0 if replacing else plan["ledger"]["seq"] - before + len(rejected)
        sent = ahead - len(rejected)
    for r in seen:
        if pending_line(r) in store.warnings:  # said by attach before: acknowledged now
            store.warnings.remove(pending_line(r))
    ctx.show(text_sync, {"share": {
        "remote": cfg["remote"], "ref": SHARED_REFS + cfg["plan_id"],
        "events": plan["ledger"]["seq"], "pulled": pulled, "published": sent,
        "rejected": [r["event"] for r in rejected], "acknowledged": [r["event"] for r in seen]},
        "plan": plan_json(plan), **({"pin": pinned} if pinned else {})},
        acknowledged=seen, pin_path=shown_path(store, PIN))


def text_sync(data, acknowledged, pin_path):
    """What `sync` says: the events pulled and published, the pin written, each acknowledged
    refusal (`acknowledged`: the records, with the reason each event was refused)."""
    share = data["share"]
    rejected = share["rejected"]
    lines = [f"fablize: in sync with {share['remote']} — {count_noun(share['events'], 'event')} "
             f"({share['ref']}): {share['pulled']} pulled, {share['published']} published"
             + (f", {len(rejected)} set aside in {REJECTED}" if rejected else "") + "."]
    if "pin" in data:
        lines.append(f"fablize: pinned {data['pin']['pin'][:24]}… in {pin_path} — commit it with "
                     "this branch: once merged, CI's `audit --remote --base` holds the plan to it.")
    lines += [f"  acknowledged: {said_event(r['event'])}) — {one_line(r['reason'])}"
              for r in acknowledged]
    return lines


def remote_ledger(store, remote, plan_id):
    """The ledger bytes and run logs of a plan as the remote holds it (for audit): a run whose
    commit carries no log is absent, as a log missing from runs/ is to a local audit."""
    ref = remote_tip(store, remote, plan_id)  # a reader: no ref of this clone written
    if ref is None:
        raise refused(f"{remote} shares no plan {one_line(plan_id)}.", "not_found")
    chain = Chain(store, ref, None, remote)
    logs = {}
    for _, line, log in chain.events:
        ev = parse_event(line) if log is not None else None
        if ev is not None and type(ev.get("log")) is str:  # a line that is no event: audit says
            logs[ev["log"]] = log
    if chain.replaced is not None:
        new = chain.replaced["plan_id"]
        store.warn(f"plan {plan_id} on {remote} was replaced by {new}: audited as it stood "
                   f"then ({count_noun(len(chain.events), 'event')}); `audit --remote "
                   f"{remote} --plan {new}` "
                   "audits the plan that replaced it.")
    return b"".join(line + b"\n" for _, line, _ in chain.events), logs


def audit_source(store, remote, plan_id, named_by=None):
    """audit --remote: (ledger bytes, run logs, which plan: {plan_id, remote, named_by}) of the
    plan as the remote holds it. `named_by` says who named `plan_id` (--plan, the base's pin);
    without one, the tree's own share.json or the remote's only plan names it — the tree is the
    pull request's, so that plan is unpinned, and said so."""
    remote = remote_arg(store, remote)
    plan_id = plan_id and plan_id_arg(plan_id)
    if plan_id is None:
        cfg = share_config(store) if store.exists() else None
        if cfg is not None and cfg["remote"] == remote:
            plan_id, named_by = cfg["plan_id"], "this tree's share.json"
        else:
            plans = live_plans(store, remote, shared_plan_refs(store, remote))
            if len(plans) != 1:
                raise refused(f"{remote} shares {len(plans) or 'no'} plans — say which with "
                              "--plan ID.", "which_plan")
            plan_id, named_by = next(iter(plans)), f"the only plan {remote} shares"
    data, logs = remote_ledger(store, remote, plan_id)
    return data, logs, {"plan_id": plan_id, "remote": remote, "named_by": named_by}


def refresh_first(session):
    """`release`: the remote's events first, always (who holds the story is the remote's)."""
    return publish(session, claim=True, fetch_first=True)


def cmd_release(ctx, a):
    with ctx.store.plan_session() as s:
        s.require_plan()
        plan = refresh_first(s)
        holder = find_story(plan, a.id)["agent"]
        s.commit("story_released", id=a.id, note=masked_text("--note", a.note, s.store.root),
                 agent=holder)
        publish(s, claim=True, fetch_first=False)
        plan = s.plan
    ctx.show(text_release, {"story": story_json(plan, find_story(plan, a.id)),
                            "released_from": holder})


def text_release(data):
    return [f"fablize: {data['story']['id']} released from agent "
            f"{one_line(data['released_from'] or 'unnamed')} → pending (its round is given back; "
            "the release is recorded in the ledger)."]


def add_share(command):
    c = command("share", cmd_share, "share the plan through a git remote",
                "its ledger goes to refs/fablize/plans/<plan id>, and every write publishes there")
    c.add_argument("--remote", required=True, metavar="NAME", help="the git remote, e.g. origin")


def add_sync(command):
    c = command("sync", cmd_sync, "pull and publish a shared plan",
                "pull the shared plan's new events and publish local ones; on a fresh clone, "
                "bring the shared plan in")
    c.add_argument("--remote", metavar="NAME",
                   help="the git remote (default: the plan's, else origin or the only remote)")
    c.add_argument("--plan", metavar="ID",
                   help="on a fresh clone: which shared plan, when the remote has several")
    c.add_argument("--acknowledge", action="store_true",
                   help="mark the events set aside (rejected.jsonl) as seen: they stop being "
                        "said on every command")
    c.add_argument("--pin", action="store_true",
                   help=f"write the plan's head as the remote holds it to {PIN}, to be "
                        "committed: merged, it is the pin CI's `audit --remote --base` holds")


def add_release(command):
    c = command("release", cmd_release, "end a silent agent's claim on a story",
                "recorded in the ledger; the story becomes ready again, its round given back")
    c.add_argument("--id", required=True, type=id_arg, help="the story, e.g. G001")
    c.add_argument("--note", required=True, help="why the claim ends (who decided, what was seen)")


COMMANDS = {"share": add_share, "sync": add_sync, "release": add_release}
