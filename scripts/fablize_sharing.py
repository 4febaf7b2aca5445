"""fablize's sharing room: one plan worked from many clones, through a git remote.

A shared plan's ledger is also a chain of commits under refs/fablize/plans/<plan id> on a git
remote, one commit per event: its tree holds `event.jsonl` (the ledger line, exact bytes) and,
for a run, `log` (the run's output). Writers order themselves by pushing without force: the
remote's fast-forward-only ref update is the compare-and-swap. A push that loses fetches the
winner's events, replays them through apply_event, re-validates and re-chains the local events
not yet published (an event no longer legal is set aside in rejected.jsonl and said, never
dropped silently) and tries again. share.json in the state directory marks a shared plan and
records how much of the local ledger the remote is known to hold; a local plan has no share.json
and never loads this room.

Interface (for the engine's commands):
  attach(store)            register `publish` as the store's after-commit step
  pull(session)            the remote's events first (`next`, `release`), claims refused if lost
  claim(session, story, agent)  `next`'s story_started, on the remote before it is handed out
  start(store, remote)     share the plan (`share`, `create --remote`)
  status(store, plan), status_lines(info)   what `status` says of a shared plan
  audit_source(store, remote, plan_id)      (ledger bytes, run logs) as the remote holds them
  COMMANDS                 share, sync, release
Loaded by the engine (goals.room), never imported on its own.
"""

import json
import os
import random
import re
import time

# the engine that loaded this room (goals.room registers itself under this name first): one
# engine module, never a second copy of goals.py, never one found on sys.path
import fablize_engine as engine
from fablize_engine import (EXIT_DAMAGED, LEDGER, RUNS, SHARE, ZERO_HASH, FablizeError, damaged,
                            dumps, one_line, parse_event, refused, usage)

REJECTED = "rejected.jsonl"
SHARED_REFS = "refs/fablize/plans/"
PUSH_ATTEMPTS = 12
CLAIM_ATTEMPTS = 5
SHARE_SPEC = {"remote": str, "plan_id": str, "seq": int, "head": str, "commit": engine.TEXT}
SAFE_LOG = r"runs/[\w.-]+\.log"
REMOTE_NAME = r"[A-Za-z0-9][\w.-]*"


def unreachable(remote, detail):
    return FablizeError(f"the remote {one_line(remote)} cannot be reached ({one_line(detail)[:300]}).",
                        "remote_unreachable", EXIT_DAMAGED)


def remote_git(store, remote, *args):
    """git talking to `remote`: a timeout means the remote cannot be reached."""
    try:
        return engine.git(store.root, *args, what="a shared plan")
    except FablizeError as e:
        if e.code == "tool_timeout":
            raise unreachable(remote, e.message)
        raise


def git_out(store, *args, data=None):
    return engine.git_out(store.root, *args, data=data, what="a shared plan")


def remote_arg(store, remote):
    if not re.fullmatch(REMOTE_NAME, remote or ""):
        raise usage(f"--remote takes the name of a git remote (as `git remote` lists them), not "
                    f"{one_line(remote)!r}.", "bad_remote")
    if engine.git(store.root, "remote", "get-url", remote, what="a shared plan")[0] != 0:
        raise refused(f"{one_line(remote)} is not a git remote of {store.root} — add it with "
                      f"`git remote add {one_line(remote)} URL`.", "no_remote")
    return remote


def plan_id_arg(plan_id):
    if not engine.is_plan_id(plan_id):
        raise usage(f"--plan takes a plan id (as `sync` lists them), not {one_line(plan_id)!r}.",
                    "bad_plan_id")
    return plan_id


def new_config(remote, plan_id):
    return {"remote": remote, "plan_id": plan_id, "seq": 0, "head": ZERO_HASH, "commit": None}


def share_config(store):
    """The shared plan's record, or None for a local plan (one lstat, no git)."""
    path = store.path(SHARE)
    if not os.path.lexists(path):
        return None
    try:
        cfg = engine.load_json(engine.read_state_file(path) or b"")
    except ValueError:
        cfg = None
    if engine.misfit(cfg, SHARE_SPEC) is not None or not re.fullmatch(REMOTE_NAME, cfg["remote"]) \
            or not engine.is_plan_id(cfg["plan_id"]):
        raise damaged(f"{SHARE} is not a fablize share record — run `goals.py sync` after "
                      "removing it.", "bad_share")
    return cfg


def save_share_config(store, cfg):
    engine.write_atomic(store.path(SHARE), dumps(cfg).encode("utf-8") + b"\n")


def tracking_ref(cfg):
    return f"refs/fablize/remotes/{cfg['remote']}/{cfg['plan_id']}"


def fetch_shared(store, cfg):
    """The commit at the remote's ref (fetched into a tracking ref), or None if it has none."""
    ref = SHARED_REFS + cfg["plan_id"]
    code, _, err = remote_git(store, cfg["remote"], "fetch", "--quiet", "--no-tags", cfg["remote"],
                              f"+{ref}:{tracking_ref(cfg)}")
    if code != 0:
        if "couldn't find remote ref" in err:
            return None
        raise unreachable(cfg["remote"], err.splitlines()[-1] if err else f"git fetch exit {code}")
    return git_out(store, "rev-parse", "--verify", tracking_ref(cfg)).decode().strip()


def cat_objects(store, names):
    """The bytes of each `rev:path` (None where it is missing), through one git cat-file."""
    if not names:
        return []
    out = git_out(store, "cat-file", "--batch", data="".join(n + "\n" for n in names).encode())
    found, pos = [], 0
    for _ in names:
        end = out.index(b"\n", pos)
        header = out[pos:end].split()
        pos = end + 1
        if header[-1] == b"missing":
            found.append(None)
            continue
        size = int(header[2])
        found.append(out[pos:pos + size])
        pos += size + 1
    return found


def remote_events(store, cfg, base, tip):
    """[(line, log bytes or None)] of the commits after `base` up to `tip`, oldest first."""
    spec = [tip, "^" + base] if base else [tip]
    revs = git_out(store, "rev-list", "--reverse", "--topo-order", *spec).decode().split()
    lines = cat_objects(store, [f"{r}:event.jsonl" for r in revs])
    events = []
    for rev, raw in zip(revs, lines):
        if raw is None or not raw.endswith(b"\n") or b"\n" in raw[:-1]:
            raise damaged(f"the shared plan on {cfg['remote']} has a commit {rev[:12]} that holds "
                          "no ledger line — the ref was written by something else.", "bad_remote_event")
        events.append([rev, raw[:-1], None])
    runs = [e for e in events if b'"event":"verify_run"' in e[1]]
    for e, log in zip(runs, cat_objects(store, [f"{e[0]}:log" for e in runs])):
        e[2] = log
    return [(line, log) for _, line, log in events]


def apply_shared_line(plan, line, seq, head, remote):
    """A line from the remote, checked like a line read back from the ledger."""
    ev = parse_event(line)
    if ev is None or ev["seq"] != seq or ev.get("prev") != head:
        got = ev["seq"] if ev else "?"
        raise damaged(f"the shared plan on {remote} does not continue this ledger at event {seq} "
                      f"(found event {got}, or a broken hash chain) — its history was rewritten; "
                      "run `goals.py audit --remote` to see it.", "remote_history_rewritten")
    try:
        plan = engine.apply_event(plan, ev)
    except FablizeError as e:
        raise damaged(f"the shared plan on {remote}: event {seq} is not legal when replayed "
                      f"({e.message}).", "bad_remote_event")
    plan["ledger"] = {"seq": seq, "head": engine.sha256_hex(line)}
    return plan, ev


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


def write_run_log(store, ev, log, remote):
    name = ev.get("log")
    if type(name) is not str or log is None:
        return
    if not re.fullmatch(SAFE_LOG, name):
        raise damaged(f"the shared plan on {remote}: run log path {one_line(name)} is not under "
                      f"{RUNS}/.", "bad_remote_event")
    if ev.get("sha256") is not None and engine.sha256_hex(log) != ev["sha256"]:
        raise damaged(f"the shared plan on {remote}: {name} does not match the sha256 its run "
                      "recorded.", "run_log_mismatch")
    path = store.path(name)
    engine.ensure_subdir(store.path(RUNS))
    if os.path.lexists(path):
        os.replace(path, engine.free_name(path + ".local"))  # a stale local log of the same name
    engine.write_atomic(path, log)


def integrate(session, cfg, tip):
    """Bring the remote's events after cfg's position into the local ledger; the local events
    not published yet are replayed after them. Returns the local events set aside."""
    store = session.store
    if tip is None or tip == cfg["commit"]:
        return []
    incoming = remote_events(store, cfg, cfg["commit"], tip)
    local = unpublished_lines(session, cfg["seq"])
    same = 0  # a push that landed before its process died: those events are already there
    while same < min(len(local), len(incoming)) and local[same] == incoming[same][0]:
        same += 1
    base_seq = cfg["seq"] + same
    local, incoming = local[same:], incoming[same:]
    if not local:
        plan = session.plan
        seq, head = (plan["ledger"]["seq"], plan["ledger"]["head"]) if plan else (0, ZERO_HASH)
        lines = []
        for line, log in incoming:
            seq += 1
            plan, ev = apply_shared_line(plan, line, seq, head, cfg["remote"])
            if seq == 1 and plan["plan_id"] != cfg["plan_id"]:
                raise damaged(f"the shared plan {cfg['plan_id']} on {cfg['remote']} holds plan "
                              f"{one_line(plan['plan_id'])}.", "bad_remote_event")
            head = plan["ledger"]["head"]
            write_run_log(store, ev, log, cfg["remote"])
            lines.append(line)
        if lines:
            session.ledger.append(b"\n".join(lines), session.ledger.open(create=True))
            session.save_snapshot(plan)
            session.plan = plan
        cfg.update(seq=seq, head=head, commit=tip)
        save_share_config(store, cfg)
        return []
    return rebase(session, cfg, tip, base_seq, incoming, local)


def rebase(session, cfg, tip, base_seq, incoming, local):
    """The local ledger rewritten as: its first `base_seq` lines (what the remote holds too),
    the remote's `incoming` events, then the `local` unpublished events re-chained after them.
    A local event that is no longer legal after the remote's (another clone claimed the story
    first) is set aside in rejected.jsonl with why; a run's log follows its event's new seq.
    Returns the events set aside."""
    store = session.store
    data = engine.read_state_file(store.path(LEDGER)) or b""
    kept = data.split(b"\n")[:base_seq]
    plan = engine.audit_ledger(b"".join(x + b"\n" for x in kept), None)["plan"] if kept else None
    seq, head = (base_seq, plan["ledger"]["head"]) if plan else (0, ZERO_HASH)
    engine.ensure_subdir(store.path(RUNS))
    moved = {}
    for line in local:  # our unpublished logs step aside: the remote's may carry their names
        ev = parse_event(line)
        if ev["event"] == "verify_run" and type(ev.get("log")) is str and \
                os.path.lexists(store.path(ev["log"])):
            tmp = store.path(f"{RUNS}/.rebase-{ev['seq']}-{os.urandom(4).hex()}")
            os.replace(store.path(ev["log"]), tmp)
            moved[ev["seq"]] = tmp
    for line, log in incoming:
        seq += 1
        plan, ev = apply_shared_line(plan, line, seq, head, cfg["remote"])
        head = plan["ledger"]["head"]
        write_run_log(store, ev, log, cfg["remote"])
        kept.append(line)
    cfg.update(seq=seq, head=head, commit=tip)
    renumber, rejected = {}, []
    for line in local:
        ev = parse_event(line)
        old = ev["seq"]
        ev.update(seq=seq + 1, prev=head)
        if type(ev.get("after_seq")) is int:
            ev["after_seq"] = renumber.get(ev["after_seq"], min(ev["after_seq"], base_seq))
        if isinstance(ev.get("runs"), list):
            ev["runs"] = [renumber.get(r, r) for r in ev["runs"]]
        if ev["event"] == "verify_run" and type(ev.get("log")) is str:
            ev["log"] = f"{RUNS}/{seq + 1}-{ev['id']}.log"
        trial = json.loads(json.dumps(plan)) if plan is not None else None
        try:
            trial = engine.apply_event(trial, ev)
        except FablizeError as e:
            rejected.append({"event": parse_event(line), "reason": e.message, "code": e.code})
            if old in moved:
                os.replace(moved.pop(old), engine.free_name(store.path(f"{RUNS}/rejected-{old}.log")))
            continue
        if old in moved:
            os.replace(moved.pop(old), store.path(ev["log"]))
        new_line = dumps(ev).encode("utf-8")
        seq, head = seq + 1, engine.sha256_hex(new_line)
        trial["ledger"] = {"seq": seq, "head": head}
        plan = trial
        renumber[old] = seq
        kept.append(new_line)
    session.swap_ledger(b"".join(x + b"\n" for x in kept), plan)
    save_share_config(store, cfg)
    if rejected:
        rfd = engine.open_state_file(store.path(REJECTED), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            engine.write_all(rfd, b"".join(dumps(dict(r, rejected=engine.now_iso())).encode("utf-8")
                                           + b"\n" for r in rejected))
            os.fsync(rfd)
        finally:
            os.close(rfd)
    return rejected


def event_commits(store, cfg, lines):
    """Commits for `lines` on top of cfg's commit (one git fast-import); returns the new tip."""
    ref = f"refs/fablize/local/{cfg['plan_id']}"
    chunks = [f"reset {ref}\n".encode()]
    if cfg["commit"]:
        chunks.append(f"from {cfg['commit']}\n".encode())
    when = int(time.time())
    for i, line in enumerate(lines, 1):
        ev = parse_event(line)
        message = f"fablize {cfg['plan_id']} #{ev['seq']} {ev['event']} {ev.get('id') or ''}".strip()
        message = message.encode("utf-8")
        chunks.append(f"commit {ref}\nmark :{i}\ncommitter fablize <fablize@localhost> {when} +0000\n"
                      f"data {len(message)}\n".encode() + message + b"\ndeleteall\n")
        chunks.append(f"M 100644 inline event.jsonl\ndata {len(line) + 1}\n".encode() + line + b"\n\n")
        log = ev.get("log") if ev["event"] == "verify_run" else None
        body = engine.read_state_file(store.path(log)) if type(log) is str and \
            re.fullmatch(SAFE_LOG, log) else None
        if body is not None:
            chunks.append(f"M 100644 inline log\ndata {len(body)}\n".encode() + body + b"\n")
    chunks.append(f"get-mark :{len(lines)}\n".encode())
    out = git_out(store, "fast-import", "--quiet", "--force", "--done",
                  data=b"".join(chunks) + b"done\n")
    return out.decode().split()[-1]


def push_shared(store, cfg, new_tip):
    """True when the remote took the new tip; False when another writer got there first."""
    code, out, err = remote_git(store, cfg["remote"], "push", "--porcelain", "--no-verify",
                                cfg["remote"], f"{new_tip}:{SHARED_REFS}{cfg['plan_id']}")
    if code == 0:
        return True
    said = out.decode("utf-8", "replace") + err
    if "[rejected]" in said or "[remote rejected]" in said:
        return False
    raise unreachable(cfg["remote"], said.strip().splitlines()[-1] if said.strip() else
                      f"git push exit {code}")


def say_rejected(store, rejected):
    for r in rejected:
        ev = r["event"]
        store.warn(f"{ev['event']} {one_line(ev.get('id') or '')} (event {ev['seq']}, made here "
                   f"before the remote's newer events) is no longer legal: {one_line(r['reason'])}"
                   f" — set aside in {REJECTED}, not published.")


def sync_shared(session, cfg, fetch_first=True):
    """Fetch, integrate, push what is unpublished; retry a lost push a bounded number of times.
    Returns the local events set aside."""
    store = session.store
    rejected = []
    fetch = fetch_first
    for attempt in range(PUSH_ATTEMPTS):
        if fetch:
            rejected += integrate(session, cfg, fetch_shared(store, cfg))
        plan = session.plan
        if plan is None or plan["ledger"]["seq"] <= cfg["seq"]:
            return rejected
        lines = unpublished_lines(session, cfg["seq"])
        tip = event_commits(store, cfg, lines)
        if push_shared(store, cfg, tip):
            engine.crash_point("after-push")  # tests: published, but share.json does not know yet
            cfg.update(seq=plan["ledger"]["seq"], head=plan["ledger"]["head"], commit=tip)
            save_share_config(store, cfg)
            return rejected
        fetch = True
        time.sleep(random.uniform(0.005, 0.02) * min(attempt + 1, 8))
    raise FablizeError(f"gave up publishing to {cfg['remote']} after {PUSH_ATTEMPTS} pushes lost to "
                       "other writers; the events are kept here — run `sync` again.",
                       "push_contended", EXIT_DAMAGED)


def attach(store):
    """A shared plan: every writing session publishes what it committed (storage calls its
    after-commit steps, knowing nothing of sharing)."""
    store.after_commit.append(publish)


def publish(session, claim=False, fetch_first=False):
    """After a session's commits: put the unpublished events on the remote. With `claim`, the
    command may go on only if its last event is on the remote: an event set aside or an
    unreachable remote is refused; otherwise the events stay local with a warning and the next
    command or `sync` publishes them. Returns the plan."""
    store = session.store
    cfg = share_config(store)
    if cfg is None or session.plan is None:
        return session.plan
    own = session.last
    if session.plan["plan_id"] != cfg["plan_id"]:  # create --force: the new plan, its own ref
        cfg = new_config(cfg["remote"], session.plan["plan_id"])
        save_share_config(store, cfg)
    if not fetch_first and session.plan["ledger"]["seq"] <= cfg["seq"]:
        return session.plan
    try:
        rejected = sync_shared(session, cfg, fetch_first)
    except FablizeError as e:
        if claim or e.code not in ("remote_unreachable", "push_contended"):
            raise
        store.warn(f"not published: {e.message} The events are kept here; the next command "
                   "or `sync` publishes them.")
        return session.plan
    say_rejected(store, rejected)
    for r in rejected:
        ev = r["event"]
        if own is not None and ev["seq"] >= own["seq"] and ev.get("id") == own.get("id"):
            held = engine.find_story(session.plan, ev["id"]) if ev.get("id") else None
            who = f" — agent {one_line(held['agent'])} holds it" if held and held["agent"] else ""
            raise refused(f"{one_line(ev.get('id') or ev['event'])} was taken on {cfg['remote']} "
                          f"meanwhile{who}; this {ev['event']} was not published "
                          f"({one_line(r['reason'])}).", "claim_lost")
    return session.plan


def pull(session):
    """The remote's newest events, before a command decides on them (`next`, `release`)."""
    return publish(session, claim=True, fetch_first=True)


def claim(session, story, agent):
    """`next`'s story_started; in a shared plan it counts only once it is on the remote, and a
    claim lost to another machine (said, set aside) moves on to the next ready story, a bounded
    number of times. Returns the story now held."""
    for attempt in range(CLAIM_ATTEMPTS):
        engine.commit_start(session, story, agent)
        try:
            publish(session, claim=True)
            return engine.find_story(session.plan, story["id"])
        except FablizeError as e:
            if e.code != "claim_lost" or attempt == CLAIM_ATTEMPTS - 1:
                raise
            lost = e
        ready = engine.ready_stories(session.plan)
        if not ready:
            raise lost
        # the other writers just won the first ready story: a random one avoids a convoy
        story = random.choice(ready)
        session.store.warn(f"{lost.message} Claiming {story['id']} instead.")
    raise lost


def status(store, plan):
    """How far the local copy is ahead of and behind the remote, or None for a local plan."""
    cfg = share_config(store)
    if cfg is None or plan is None:
        return None
    info = {"remote": cfg["remote"], "ref": SHARED_REFS + cfg["plan_id"],
            "published": cfg["seq"], "ahead": plan["ledger"]["seq"] - cfg["seq"], "behind": None}
    try:
        tip = fetch_shared(store, cfg)
    except FablizeError as e:
        info["error"] = e.message
        return info
    behind = 0
    if tip is not None and tip != cfg["commit"]:
        subject = git_out(store, "log", "-1", "--format=%s", tip).decode()
        found = re.search(r" #(\d+) ", subject + " ")
        behind = int(found.group(1)) - cfg["seq"] if found else None
    info["behind"] = behind
    return info


def status_lines(info):
    where = f"shared through {info['remote']} ({info['ref']})"
    if info.get("error"):
        return [f"fablize: {where}: {info['ahead']} event(s) not published yet; the remote cannot "
                f"be reached now — {one_line(info['error'])}"]
    if info["ahead"] or info["behind"]:
        return [f"fablize: {where}: {info['ahead']} event(s) ahead (not published), "
                f"{info['behind'] if info['behind'] is not None else 'some'} behind — run `sync`."]
    return [f"fablize: {where}: in sync."]


def shared_plan_refs(store, remote):
    """{plan id: commit} of the plans shared on `remote`."""
    code, out, err = remote_git(store, remote, "ls-remote", remote, SHARED_REFS + "*")
    if code != 0:
        raise unreachable(remote, err[-300:])
    found = {}
    for row in out.decode("utf-8", "replace").splitlines():
        sha, _, ref = row.partition("\t")
        plan_id = ref[len(SHARED_REFS):]
        if engine.is_plan_id(plan_id):
            found[plan_id] = sha  # a ref no plan id names is someone else's, never a plan
    return found


def default_remote(store):
    names = git_out(store, "remote").decode().split()
    if "origin" in names:
        return "origin"
    if len(names) == 1:
        return names[0]
    if not names:
        raise refused(f"{store.root} has no git remote — add one with `git remote add NAME URL`.",
                      "no_remote")
    raise usage(f"several git remotes ({', '.join(names)}): say which with --remote NAME.")


def ignore_shared_dir(store):
    """A shared plan lives in refs, not in the branch: nothing in its state directory is
    committed, so a branch merge never touches it."""
    path = store.path(".gitignore")
    # the engine's own .gitignore (written with the directory) gives way; a user's stays
    if not os.path.lexists(path) or engine.read_state_file(path) == engine.STATE_GITIGNORE.encode():
        engine.write_atomic(path, b"# a shared plan: its history is in refs/fablize/, not the "
                                  b"branch\n*\n")


def start(store, remote):
    """share / create --remote: record the remote, then publish the whole ledger. Returns the
    share record for --json and the line that says it."""
    with store.session() as s:
        plan = s.require_plan()
        cfg = share_config(store)
        if cfg is not None and cfg["plan_id"] == plan["plan_id"] and cfg["remote"] != remote:
            raise refused(f"this plan is already shared through {cfg['remote']}.", "already_shared")
        if cfg is None or cfg["plan_id"] != plan["plan_id"]:
            cfg = new_config(remote, plan["plan_id"])
            save_share_config(store, cfg)
        ignore_shared_dir(store)
        say_rejected(store, sync_shared(s, cfg))
        plan = s.plan
    line = (f"fablize: plan {plan['plan_id']} shared through {remote} "
            f"({SHARED_REFS}{plan['plan_id']}, {cfg['seq']} events).")
    return {"remote": remote, "ref": SHARED_REFS + plan["plan_id"], "published": cfg["seq"]}, line


def cmd_share(ctx, a):
    engine.require_state_dir(ctx.store)
    share, line = start(ctx.store, remote_arg(ctx.store, a.remote))
    ctx.say(line)
    ctx.data.update(share=share)


def cmd_sync(ctx, a):
    store = ctx.store
    cfg = share_config(store) if store.exists() else None
    if cfg is None:
        if store.exists() and store.has_plan_files():
            raise refused("this plan is local — share it first: `share --remote NAME`.", "not_shared")
        remote = remote_arg(store, a.remote or default_remote(store))
        plans = shared_plan_refs(store, remote)
        if a.plan:
            if plan_id_arg(a.plan) not in plans:
                raise refused(f"{remote} shares no plan {one_line(a.plan)}.", "not_found")
            plan_id = a.plan
        elif len(plans) == 1:
            plan_id = next(iter(plans))
        else:
            raise refused(f"{remote} shares {len(plans) or 'no'} plans" +
                          (f" ({', '.join(sorted(plans))}): say which with --plan ID." if plans
                           else " — share one with `share --remote NAME`."), "which_plan")
        store.create_dir()
        with store.session() as s:
            s.load()
            if store.has_plan_files():
                raise refused(engine.PLAN_EXISTS, "plan_exists")
            cfg = new_config(remote, plan_id)
            save_share_config(store, cfg)
            ignore_shared_dir(store)
    elif a.remote and a.remote != cfg["remote"]:
        raise refused(f"this plan is shared through {cfg['remote']}, not {one_line(a.remote)}.",
                      "other_remote")
    with store.session() as s:
        s.load()
        cfg = share_config(store)  # again under the lock: another command may have published
        before = s.plan["ledger"]["seq"] if s.plan else 0
        ahead = before - cfg["seq"]
        rejected = sync_shared(s, cfg)
        say_rejected(store, rejected)
        plan = s.plan
    if plan is None:
        raise refused(f"{cfg['remote']} holds nothing for plan {cfg['plan_id']} yet.", "no_plan")
    pulled = plan["ledger"]["seq"] - before + len(rejected)
    sent = ahead - len(rejected)
    ctx.say(f"fablize: in sync with {cfg['remote']} — {plan['ledger']['seq']} events "
            f"({SHARED_REFS}{cfg['plan_id']}): {pulled} pulled, {sent} published"
            + (f", {len(rejected)} set aside in {REJECTED}" if rejected else "") + ".")
    ctx.data.update(share={"remote": cfg["remote"], "ref": SHARED_REFS + cfg["plan_id"],
                           "events": plan["ledger"]["seq"], "pulled": pulled, "published": sent,
                           "rejected": [r["event"] for r in rejected]},
                    plan=engine.plan_json(plan))


def remote_ledger(store, remote, plan_id):
    """The ledger bytes and run logs of a plan as the remote holds it (for audit)."""
    cfg = new_config(remote, plan_id)
    tip = fetch_shared(store, cfg)
    if tip is None:
        raise refused(f"{remote} shares no plan {one_line(plan_id)}.", "not_found")
    events = remote_events(store, cfg, None, tip)
    logs = {}
    for line, log in events:
        ev = parse_event(line) if log is not None else None
        if ev is not None and type(ev.get("log")) is str:  # a line that is no event: audit says
            logs[ev["log"]] = log
    return b"".join(line + b"\n" for line, _ in events), logs


def audit_source(store, remote, plan_id):
    """audit --remote: (ledger bytes, run logs) of the plan as the remote holds it."""
    remote = remote_arg(store, remote)
    plan_id = plan_id and plan_id_arg(plan_id)
    if plan_id is None:
        cfg = share_config(store) if store.exists() else None
        if cfg is not None and cfg["remote"] == remote:
            plan_id = cfg["plan_id"]
        else:
            plans = shared_plan_refs(store, remote)
            if len(plans) != 1:
                raise refused(f"{remote} shares {len(plans) or 'no'} plans — say which with "
                              "--plan ID.", "which_plan")
            plan_id = next(iter(plans))
    return remote_ledger(store, remote, plan_id)


def cmd_release(ctx, a):
    with engine.open_plan(ctx) as s:
        s.require_plan()
        plan = pull(s)  # release what the remote says is held
        holder = engine.find_story(plan, a.id)["agent"]
        s.commit("story_released", id=a.id, note=engine.masked_text("--note", a.note), agent=holder)
        publish(s, claim=True)
        plan = s.plan
    ctx.say(f"fablize: {a.id} released from agent {one_line(holder or 'unnamed')} → pending (its "
            "round is given back; the release is recorded in the ledger).")
    ctx.data.update(story=engine.story_json(plan, engine.find_story(plan, a.id)),
                    released_from=holder)


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


def add_release(command):
    c = command("release", cmd_release, "end a silent agent's claim on a story",
                "recorded in the ledger; the story becomes ready again, its round given back")
    c.add_argument("--id", required=True, type=engine.id_arg, help="the story, e.g. G001")
    c.add_argument("--note", required=True, help="why the claim ends (who decided, what was seen)")


COMMANDS = {"share": add_share, "sync": add_sync, "release": add_release}
