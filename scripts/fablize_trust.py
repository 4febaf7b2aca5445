"""fablize's trust room: what CI can believe of a plan the agent wrote itself.

The ledger is the agent's own diary: the hash chain proves only that history after a pin grew.
Trust comes from what the agent cannot write — the base branch's committed ledger (the pin,
`audit --base`), CI's own re-run of the frozen checks (`audit --rerun`), a human's key
(`decide --sign`, checked against allowed signers read from the base branch) and the checks CI
requires (`--require-check`). Three grades name what a completion rests on: claimed (text the
agent typed), witnessed (the engine ran it, in the agent's environment), re-witnessed (CI re-ran
it).

Interface (for the engine's `audit` and `decide`):
  Scan(root, pin)                  what audit's one replay gathers (a callback per line)
  pin_of(store, base, since)       (pin, what --base read)
  review(store, plan, scan, pin, base)   the trust report (a dict; its `warnings` to show)
  lines(trust)                     what audit says of it
  gates(store, plan, trust, opts)  the trust gates, cheapest first: raises the first that says no
  rerun(plan, which, root, timeout)      the frozen checks run again, recording nothing
  check_signer(key, signer), sign(plan, sid, decision, note, key, signer),
  signed_fields(plan, signature, prev)
Loaded by the engine (goals.room), never imported on its own.
"""

import json
import os
import re
import shutil
import tempfile

# the engine that loaded this room (goals.room registers itself under this name first): one
# engine module, never a second copy of goals.py, never one found on sys.path
import fablize_engine as engine
from fablize_engine import (ARCHIVE, LEDGER, FablizeError, damaged, defused_line, last_chars,
                            one_line, parse_event, refused, sha256_hex, usage)

SIGN_NAMESPACE = "fablize"
MAX_LISTED = 10             # unclean runs named one a line in audit's text


def parse_pin(text):
    """--since [SEQ:]HASH as (seq or None, hash); a malformed pin is a usage error."""
    seq_text, _, pin_hash = text.rpartition(":")
    pin_hash = pin_hash.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{64}", pin_hash, re.A) or (
            seq_text and not (seq_text.isascii() and seq_text.isdigit())):
        raise usage("--since takes HASH or SEQ:HASH (as `audit` prints its head: 64 hex digits, "
                    f"optionally after the event number) — not {one_line(text)[:80]!r}.",
                    "bad_since")
    return (int(seq_text) if seq_text else None), pin_hash


class PinScan:
    """Where a pin is in one ledger, seen line by line during audit's replay: `where` is
    'found', 'rewritten' (line SEQ exists with another hash) or 'absent'."""

    def __init__(self, pin):
        self.seq, self.hash = parse_pin(pin)
        self.where = "absent"
        self.first = None
        self.merged = False  # found only inside a plan `git merge` carried in

    def __call__(self, lineno, head, ev):
        if lineno == 1:
            self.first = ev
        if self.seq is None:
            if head == self.hash:
                self.where = "found"
        elif lineno == self.seq and self.where != "found":
            self.where = "found" if head == self.hash else "rewritten"
        if ev["event"] == "plan_merged" and self.where != "found" and self.in_merged(ev["lines"]):
            # a line of a plan `git merge` carried in: its history holds, but the plan that is
            # current now was made after the pin — the reviewer must see it as new
            self.where, self.merged = "found", True

    def in_merged(self, lines):
        for i, text in enumerate(lines, 1):
            raw = text.encode("utf-8")
            if (self.seq is None or self.seq == i) and sha256_hex(raw) == self.hash:
                return True
            if b'"plan_merged"' in raw:
                inner = parse_event(raw)
                if inner and inner.get("event") == "plan_merged" and self.in_merged(inner["lines"]):
                    return True
        return False


def read_archived_ledger(store, replaced):
    """The bytes of the archived ledger a plan's `replaces` names, refusing anything outside
    archive/ or reached through a symlink."""
    rel = replaced.get("path")
    if not (isinstance(rel, str) and re.fullmatch(ARCHIVE + r"/[\w.-]+", rel)):
        raise damaged(f"the plan's replaces names no archive ({one_line(repr(rel))}) — it cannot be "
                      "verified.", "archive_unverified")
    for part in (ARCHIVE, rel):
        if os.path.islink(store.path(part)):
            raise engine.symlink_refusal(store.path(part))
    data = engine.read_state_file(store.path(os.path.join(rel, LEDGER)))
    if data is None:
        raise damaged(f"{rel}/{LEDGER}, the plan the current one replaces, is missing — the "
                      "replaced history cannot be verified.", "archive_unverified")
    return rel, data


def verify_pin(store, scan, pin):
    """Where the pinned line is: this ledger (`scan` saw it during the replay), or an archived
    one (plans replaced by `create --force`) whose bytes and chain verify, whose final head the
    next plan's `replaces` names, and that holds the pinned line. Raises exit 3 otherwise."""
    if scan.pin.where == "found":
        if scan.pin.merged:
            return {"pin": pin, "in": f"a plan merged into {LEDGER} (plan_merged)",
                    "new_plan": True}
        return {"pin": pin, "in": LEDGER, "new_plan": False}
    replaced, chain = scan.first.get("replaces") if scan.first else None, []
    while isinstance(replaced, dict) and replaced.get("head") and len(chain) < 1000:
        rel, archived = read_archived_ledger(store, replaced)
        found = PinScan(pin)
        try:
            report = engine.audit_ledger(archived, None, scan=found)
        except FablizeError as e:  # its own line numbers: say which ledger they are in
            raise damaged(f"{rel}/{LEDGER}, the plan the current one replaces, does not verify: "
                          f"{e.message}", "archive_unverified")
        if report["head"] != f"{replaced.get('seq')}:{replaced.get('head')}":
            raise damaged(f"{rel}/{LEDGER} ends at {report['head'][:24]}…, not at the head the "
                          f"plan after it names as the one it replaces — the archive was edited.",
                          "archive_unverified")
        chain.append(rel)
        if found.where == "found":
            return {"pin": pin, "in": f"{rel}/{LEDGER}", "new_plan": True, "archives": chain}
        replaced = report["plan"]["replaces"]
    seq, pin_hash = scan.pin.seq, scan.pin.hash
    if scan.pin.where == "rewritten":
        raise damaged(f"{LEDGER} line {seq} no longer hashes to {pin_hash[:16]}… (the pin): history "
                      "before it was rewritten.", "history_rewritten")
    what = f"line {seq} does not exist" if seq else "no line hashes to it"
    raise damaged(f"--since {pin_hash[:16]}…: {what} — the ledger was truncated or re-written "
                  "from scratch" + (", and no verified archive holds it." if chain else "."),
                  "history_rewritten")


def git_show(root, ref, path, what):
    """The bytes of `path` (relative to the repository top) at `ref`, or None when the ref has
    no such file. An unknown ref is a usage error."""
    top, full = branch_ref(root, ref, what)
    code, out, _ = engine.git(top, "cat-file", "blob", f"{full}:{path}", what=what)
    return out if code == 0 else None


def branch_ref(root, ref, what):
    """(repository top, the full name of the one branch `ref` names); anything else — an
    unknown ref, a tag, a bare commit, an ambiguous name — is a usage error."""
    if not ref or ref.startswith("-") or "\x00" in ref:  # never an option to git
        raise usage(f"{what}: {one_line(ref)!r} is not a git ref.", "bad_ref")
    top = engine.repo_root(root)
    if top is None:
        raise refused(f"{what}: {root} is not inside a git repository.", "not_a_repository")
    code, _, _ = engine.git(top, "rev-parse", "--verify", "--quiet", ref + "^{commit}", what=what)
    if code != 0:
        raise usage(f"{what}: {one_line(ref)} is not a commit here (fetch it first?).", "bad_ref")
    # the ref as git resolves it: a tag the pull request pushed must not stand in for the base
    # branch (git prefers refs/tags/X to refs/heads/X and refs/remotes/X)
    code, out, err = engine.git(top, "rev-parse", "--symbolic-full-name", ref, what=what)
    full = out.decode("utf-8", "replace").strip()
    if code != 0 or "ambiguous" in err or not (full.startswith("refs/heads/")
                                               or full.startswith("refs/remotes/")):
        raise usage(f"{what}: {one_line(ref)} must name one branch (refs/heads/… or "
                    f"refs/remotes/…), not {one_line(full) or 'a tag or a commit'}"
                    + (" — it is ambiguous" if "ambiguous" in err else "") + ".", "bad_ref")
    return top, full


def changed_check_files(root, ref, plan):
    """The files and folders the plan's frozen checks name (words of their commands that are
    paths in the tree) which differ between the base branch and the working tree: a frozen
    `python3 check.py` proves nothing if the branch rewrote check.py."""
    import shlex
    top, full = branch_ref(root, ref, "--base")
    named = set()
    for story in plan["goals"]:
        for cmd in engine.touch(story)["checks"]:
            try:
                words = shlex.split(cmd)
            except ValueError:
                continue
            for word in words:
                if not word.startswith("-") and "\x00" not in word and \
                        os.path.lexists(os.path.join(root, word)):
                    # the path as written (a symlink put in its place is a change git sees)
                    rel = os.path.relpath(os.path.normpath(os.path.join(os.path.abspath(root),
                                                                        word)), top)
                    if not rel.startswith(".."):
                        named.add(rel.replace(os.sep, "/"))
    if not named:
        return []
    code, out, _ = engine.git(top, "diff", "--name-only", "-z", full, "--", *sorted(named),
                              what="--base")
    changed = {x.decode("utf-8", "replace") for x in out.split(b"\0") if x} if code == 0 else set()
    code, out, _ = engine.git(top, "ls-files", "-z", "--others", "--exclude-standard", "--",
                              *sorted(named), what="--base")
    if code == 0:
        changed |= {x.decode("utf-8", "replace") for x in out.split(b"\0") if x}
    return sorted(changed)


def base_pin(store, ref):
    """(pin "SEQ:HASH" or None, what was read) from the ledger committed at `ref`."""
    top = engine.repo_root(store.root)
    rel = os.path.relpath(os.path.realpath(store.dir), top or "/").replace(os.sep, "/")
    data = git_show(store.root, ref, f"{rel}/{LEDGER}", "--base")
    if not data:
        return None, {"ref": ref, "path": f"{rel}/{LEDGER}", "plan": False}
    committed = engine.MemoryLedger(data)
    end = committed.end()[0]
    last = committed.last(end) if end else None
    if not last:
        return None, {"ref": ref, "path": f"{rel}/{LEDGER}", "plan": False}
    # the pin is the committed head: its seq is its line number, counted without a parse
    seq = data.count(b"\n", 0, end)
    return f"{seq}:{sha256_hex(last)}", {"ref": ref, "path": f"{rel}/{LEDGER}", "plan": True}


def pin_of(store, base, since):
    """(pin or None, what --base read or None): the pin comes from --since, or from the ledger
    committed at --base (so a pull request cannot move its own pin)."""
    if base is None:
        if since is not None:
            parse_pin(since)  # a malformed pin is a usage error before anything is read
        return since, None
    if since is not None:
        raise usage("give --base or --since, not both.")
    return base_pin(store, base)


def allowed_signers_file(store, signers, base):
    """Path of the allowed-signers file to verify with: read from `base`'s ref when given, so a
    pull request cannot add its own key. Returns (path, temporary directory or None)."""
    if "\x00" in signers:
        raise usage("--allowed-signers: a path cannot hold a NUL byte.", "no_signers")
    if base is None:
        if not os.path.isfile(signers):
            raise usage(f"--allowed-signers: {one_line(signers)} does not exist.", "no_signers")
        return signers, None
    top = engine.repo_root(store.root) or store.root
    rel = os.path.relpath(os.path.abspath(signers), top).replace(os.sep, "/")
    if rel.startswith(".."):
        raise usage("--allowed-signers with --base names a file inside the repository.",
                    "no_signers")
    data = git_show(store.root, base, rel, "--allowed-signers")
    if data is None:
        raise refused(f"--allowed-signers: {one_line(rel)} is not committed at {one_line(base)} "
                      "— only signers the base branch lists count.", "no_signers")
    tmp = tempfile.mkdtemp(prefix="fablize-signers-")
    path = os.path.join(tmp, "allowed_signers")
    with open(path, "wb") as f:
        f.write(data)
    return path, tmp


def decision_payload(plan_id, sid, decision, note, prev):
    """The canonical content a decision's signature covers (docs/reference.md, `decide`)."""
    return json.dumps({"plan": plan_id, "story": sid, "decision": decision, "note": note,
                       "prev": prev}, ensure_ascii=False, sort_keys=True,
                      separators=(",", ":")).encode("utf-8")


def check_signer(key, signer):
    """decide's --sign KEYFILE and --signer PRINCIPAL, before anything is read."""
    if bool(key) != bool(signer) or (signer is not None and engine.blank(signer)):
        raise usage("--sign KEYFILE and --signer PRINCIPAL go together.", "usage")
    if "\x00" in key or not os.path.isfile(key):
        raise usage(f"--sign: {one_line(key)} is not a key file.", "usage")


def sign(plan, sid, decision, note, key, signer):
    """(signature, the ledger head it was made over) of a decision, signed with ssh-keygen
    outside the lock."""
    prev = plan["ledger"]["head"]
    payload = decision_payload(plan["plan_id"], sid, decision, note, prev)
    code, out, err = engine.run_tool(["ssh-keygen", "-q", "-Y", "sign", "-f", key, "-n",
                                      SIGN_NAMESPACE], data=payload, what="decide --sign")
    if code != 0 or b"BEGIN SSH SIGNATURE" not in out:
        raise refused(f"ssh-keygen could not sign the decision: {one_line(err)[:300]}",
                      "sign_failed")
    return {"signer": signer, "sig": out.decode("ascii", "replace")}, prev


def signed_fields(plan, signature, prev):
    """The decision's signature field, if the plan did not move while it was being signed."""
    if signature is None:
        return {}
    if plan["ledger"]["head"] != prev:
        raise refused("the plan changed while the decision was being signed — run `decide` "
                      "again.", "plan_changed")
    return {"signature": signature}


def verify_signature(signers_path, plan_id, ev):
    """None when the decision's signature verifies for its signer, else why not."""
    sig = ev.get("signature")
    if not isinstance(sig, dict) or not isinstance(sig.get("sig"), str) or \
            not isinstance(sig.get("signer"), str) or engine.blank(sig.get("signer")):
        return "unsigned"
    payload = decision_payload(plan_id, ev.get("id"), ev.get("decision"), ev.get("note"),
                               ev.get("prev"))
    with tempfile.TemporaryDirectory(prefix="fablize-verify-") as tmp:
        path = os.path.join(tmp, "decision.sig")
        with open(path, "w", encoding="utf-8") as f:
            f.write(sig["sig"])
        code, _, _ = engine.run_tool(["ssh-keygen", "-Y", "verify", "-f", signers_path, "-I",
                                      sig["signer"], "-n", SIGN_NAMESPACE, "-s", path],
                                     data=payload, what="audit --allowed-signers")
    return None if code == 0 else f"signature by {one_line(sig['signer'])} does not verify"


class Scan:
    """What audit's trust options need from each line, gathered during its one replay: where the
    pin is, the first event, each story's latest decision, and why runs are not clean. Memory
    grows with what it reports (at most MAX_FLAGGED runs are kept), never with the ledger."""

    MAX_FLAGGED = 1000

    def __init__(self, root, pin):
        self.pin = PinScan(pin) if pin is not None else None
        self.here = engine.repo_relative(root)
        self.first = None
        self.decisions = []  # every one: an unsigned decision before a signed one counts too
        self.added = []
        self.first_env = None
        self.unclean, self.flagged, self.unrecorded = 0, [], 0

    def __call__(self, lineno, head, ev):
        after_pin = self.pin is not None and self.pin.where == "found"
        if self.pin is not None:
            self.pin(lineno, head, ev)
        if lineno == 1:
            self.first = ev
        kind = ev["event"]
        if kind == "decision":
            self.decisions.append(ev)
        elif kind == "story_added" and after_pin:
            self.added.append(ev["story"])  # after the pin: its checks are the agent's own
        elif kind == "verify_run":
            self.run(lineno, ev)

    def run(self, lineno, ev):
        """Why a witnessed run is not clean: outside the repository root, on a dirty tree, or
        under an environment different from the plan's first run."""
        prov = ev.get("provenance")
        why = []
        if not isinstance(prov, dict):
            self.unrecorded += 1  # counted apart: every run of an older engine would be listed
        else:
            if prov.get("dir") is None or (self.here is not None and prov.get("dir") != self.here):
                why.append(f"made outside the repository root ({one_line(prov.get('dir'))})")
            env = prov.get("env")
            if self.first_env is None:
                self.first_env = env
            elif env != self.first_env:
                names = sorted(str(k) for k in set(env) | set(self.first_env)
                               if env.get(k) != self.first_env.get(k))
                why.append("environment differs from the plan's first run (" +
                           ", ".join(one_line(n) for n in names) + ")")
        if ev.get("git_dirty"):
            why.append("the working tree was dirty")
        if why:
            self.unclean += 1
            if len(self.flagged) < self.MAX_FLAGGED:
                self.flagged.append({"line": lineno, "id": ev["id"], "cmd": ev["cmd"],
                                     "why": why})


def witnessed_gaps(plan):
    """The completed stories that do not rest on their own frozen checks run by the engine."""
    gaps = []
    for s in engine.stories_in(plan, "complete"):
        if not s["checks"]:
            how = "its pass was run ad hoc (--run)" if s["last_run"] and \
                s["last_run"]["check"] is None else "it has no frozen checks: its pass is claimed"
            gaps.append(f"{s['id']} ({how})")
            continue
        for i in range(len(s["checks"])):
            run = engine.latest_run(s, check=i)
            if run is None or not run["ok"]:
                gaps.append(f"{s['id']} (frozen check {i + 1} has no passing run of the engine's)")
                break
    return gaps


def rerun(plan, which, root, timeout):
    """Run the frozen checks again, here, recording nothing: the re-witnessed grade."""
    # the final story first: a check another story added could otherwise write, before it
    # runs, what the gate tests (the tree CI checked out is the one they all run in)
    stories = plan["goals"][-1:] + (plan["goals"][:-1] if which == "all" else [])
    stories = [engine.touch(story) for story in stories]
    results = []
    tmp = tempfile.mkdtemp(prefix="fablize-rerun-")
    try:
        for story in stories:
            for i, cmd in enumerate(story["checks"]):
                record = engine.run_command(cmd, root, timeout, None,
                                            os.path.join(tmp, f"{story['id']}-{i}.log"))
                results.append({"id": story["id"], "check": i + 1, "cmd": cmd,
                                "ok": engine.run_passed(record),
                                "result": engine.run_result(record), "tail": record["tail"]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def engine_inside(root):
    here = os.path.realpath(os.path.abspath(engine.__file__))
    top = os.path.realpath(engine.repo_root(root) or root)
    return os.path.commonpath([here, top]) == top


def review(store, plan, scan, pin, base):
    """The trust part of `audit`, from what `scan` saw during the replay: the pin, run
    provenance, decisions and their signatures. Raises exit 3 for a pin that does not hold;
    gates that say no come later (gates)."""
    first = scan.first
    trust = {"base": base, "pin": None, "new_plan": False,
             "imported": bool(first and first.get("imported_from"))}
    if pin is not None:
        trust["pin"] = verify_pin(store, scan, pin)
        trust["new_plan"] = trust["pin"]["new_plan"]
    elif base is not None:
        trust["new_plan"] = True  # nothing committed at the base: all of this plan is new
    trust["unclean_runs"], trust["runs_without_provenance"] = scan.flagged, scan.unrecorded
    trust["unclean_count"] = scan.unclean
    trust["decisions"] = scan.decisions
    last_decision = {ev["id"]: ev for ev in scan.decisions}
    trust["accepted"] = []
    for s in engine.stories_in(plan, "accepted"):
        sig = last_decision.get(s["id"], {}).get("signature")
        trust["accepted"].append({"id": s["id"], "note": s["decision"]["note"],
                                  "signer": sig.get("signer") if isinstance(sig, dict) else None})
    trust["frozen_checks"] = [{"id": s["id"], "checks": s["checks"]} for s in plan["goals"]
                              if s.get("checks")]
    trust["check_files_changed"] = changed_check_files(store.root, base["ref"], plan) \
        if base is not None else []
    trust["added_after_pin"] = [{"id": x["id"], "title": x["title"], "checks": x.get("checks", [])}
                                for x in scan.added] if trust["pin"] and not trust["new_plan"] else []
    trust["engine_inside_tree"] = engine_inside(store.root)
    trust["warnings"] = ["the engine running this audit lies inside the tree it audits: a pull "
                         "request can change it — run a copy kept outside the tree, with "
                         "python3 -I."] if trust["engine_inside_tree"] else []
    return trust


def lines(trust):
    """What audit says of the trust report, a line each."""
    out = []
    for story in trust["added_after_pin"]:
        checks = "; ".join(one_line(c) for c in story["checks"]) or "no frozen check"
        out.append(f"  added after the pin: {story['id']} {defused_line(story['title'])} — {checks} "
                   "(the re-run runs the final story's checks first)")
    if trust["check_files_changed"]:
        out.append("  frozen checks run files this branch changed since the base (review them): "
                   + ", ".join(one_line(x) for x in trust["check_files_changed"][:MAX_LISTED]))
    pin = trust["pin"]
    if pin is not None:
        where = "this ledger" if not pin["new_plan"] else f"{pin['in']} (a replaced plan)"
        out.append(f"  pin: {one_line(pin['pin'][:80])} found in {where}"
                   + (f" — from {one_line(trust['base']['ref'])}" if trust["base"] else ""))
    elif trust["base"] is not None:
        out.append(f"  pin: none — {one_line(trust['base']['ref'])} has no plan "
                   f"({one_line(trust['base']['path'])}); this plan is new")
    if trust["new_plan"]:
        out.append("  new plan since the pin — its frozen checks (review what changed):")
        for item in trust["frozen_checks"]:
            for i, cmd in enumerate(item["checks"], 1):
                out.append(f"    {item['id']} check {i}: {one_line(cmd)}")
        if not trust["frozen_checks"]:
            out.append("    (none: every completion in it is claimed)")
    if trust["imported"]:
        out.append("  imported from the original goals.py: its first event is not the engine's own")
    for item in trust["accepted"]:
        by = f"signed by {one_line(item['signer'])}" if item["signer"] else "unsigned"
        out.append(f"  accepted: {item['id']} ({by}) — {defused_line(last_chars(item['note'], 200))}")
    for run in trust["unclean_runs"][:MAX_LISTED]:
        out.append(f"  run at line {run['line']} ({one_line(run['id'])} `{one_line(run['cmd'])}`): "
                   + "; ".join(run["why"]))
    if trust["runs_without_provenance"]:
        out.append(f"  {trust['runs_without_provenance']} run(s) recorded no provenance (an older "
                   "engine's, or written by hand)")
    if trust["unclean_count"] > MAX_LISTED:
        out.append(f"  … and {trust['unclean_count'] - MAX_LISTED} more run(s) not clean "
                   "(all of them under --json)")
    return out


def gates(store, plan, trust, opts):
    """The trust options of `audit` that can say no, cheapest first; --rerun is the command's,
    last. `opts` holds the options' values by name."""
    if trust["imported"] and trust["new_plan"] and not opts["allow_imported"]:
        raise refused("audit: the plan was imported from the original goals.py format — nothing "
                      "shows it was made by the engine (--allow-imported to accept it).",
                      "imported_plan")
    if opts["require_unchanged_checks"] and opts["base"] is None:
        raise usage("--require-unchanged-checks compares with --base: give it too.")
    if opts["require_unchanged_checks"] and trust["check_files_changed"]:
        raise refused("audit: frozen checks run files this branch changed since the base — "
                      + ", ".join(one_line(x) for x in trust["check_files_changed"][:MAX_LISTED]),
                      "check_files_changed")
    if trust["new_plan"] and not opts["allow_new_plan"]:
        raise refused("audit: the plan was created after the pin (create --force or a new plan) — "
                      "review its frozen checks above; --allow-new-plan accepts it.", "new_plan")
    final = engine.touch(plan["goals"][-1])
    missing = [c for c in opts["require_check"] if c not in final["checks"]]
    if missing:
        raise refused(f"audit: the final story {final['id']} does not carry the required frozen "
                      f"check `{one_line(missing[0])}`.", "required_check_missing")
    if opts["require_witnessed"]:
        gaps = witnessed_gaps(plan)
        if gaps:
            raise refused("audit: not witnessed — " + "; ".join(gaps), "not_witnessed")
    if opts["require_clean_runs"] and trust["runs_without_provenance"]:
        raise refused(f"audit: {trust['runs_without_provenance']} run(s) recorded no provenance, so "
                      "they cannot be shown to be clean.", "unclean_runs")
    if opts["require_clean_runs"] and trust["unclean_runs"]:
        run = trust["unclean_runs"][0]
        raise refused(f"audit: {trust['unclean_count']} run(s) not clean — line {run['line']}: "
                      + "; ".join(run["why"]), "unclean_runs")
    if opts["forbid_accepted"] and trust["accepted"]:
        raise refused("audit: accepted by a decision, not completed — "
                      + ", ".join(x["id"] for x in trust["accepted"]), "accepted_forbidden")
    if opts["allowed_signers"] is not None:
        path, tmp = allowed_signers_file(store, opts["allowed_signers"], opts["base"])
        try:
            bad = [(ev["id"], verify_signature(path, plan["plan_id"], ev))
                   for ev in trust["decisions"]]
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        bad = [(sid, why) for sid, why in bad if why]
        if bad:
            raise refused("audit: decisions not signed by an allowed signer — "
                          + "; ".join(f"{sid}: {why}" for sid, why in bad), "bad_signature")


def rerun_lines(which, results):
    """What the re-run says: a line per check, the tail of what a failure printed."""
    out = [f"  re-run ({which}): {len(results)} frozen check(s), here, recorded nowhere:"]
    for r in results:
        out.append(f"    {'✓' if r['ok'] else '✗'} {r['id']} check {r['check']} "
                   f"`{one_line(r['cmd'])}` → {r['result']}")
        if r["tail"]:  # a failure shows more of what it printed
            tail = last_chars(r["tail"], 300).rstrip("\n").split("\n")
            out += ["    " + engine.OUTPUT_BAR + one_line(x) for x in tail[-8 if not r["ok"] else -2:]]
    return out


def rerun_failure(which, results):
    failed = [r for r in results if not r["ok"]]
    if failed:
        r = failed[0]
        return refused(f"audit: re-run failed — {r['id']} check {r['check']} "
                       f"`{one_line(r['cmd'])}`: {r['result']}", "rerun_failed")
    return None
