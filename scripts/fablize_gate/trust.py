"""fablize's trust room: what CI can believe of a plan the agent wrote itself.

The ledger is the agent's own diary: the hash chain proves only that history after a pin grew.
Trust comes from what the agent cannot write — the base branch's committed ledger (the pin,
`audit --base`), CI's own re-run of the frozen checks (`audit --rerun`), a human's key
(`decide --sign`, checked against allowed signers read from the base branch) and the checks CI
requires (`--require-check`). Three grades name what a completion rests on: claimed (text the
agent typed), witnessed (the engine ran it, in the agent's environment), re-witnessed (CI re-ran
it).

The pull request's tree is the agent's too: its tests, conftest.py, tool configuration and
build files decide what a check says. So a plan declares its scope (`create --scope`), the paths
its work may change, and the re-run builds a tree of its own, outside the checkout: the base
commit's files, with only the branch's tracked files inside the scope taken over (never bytecode
or other build artefacts). A check that already passes on the base alone proves nothing about
the work (fail-to-pass, the way SWE-bench judges a patch against tests it cannot touch).

Interface (for the engine's `audit` and `decide`):
  Scan(root, pin)                  what audit's one replay gathers (a callback per line)
  pin_of(store, base, since, shared)   (pin, what --base read: its plan's scope too)
  review(store, plan, scan, pin, base, opts)   the trust report (a dict; `warnings` to show)
  lines(trust)                     what audit says of it
  gates(store, plan, trust, opts)  every trust gate that says no: [{code, message, fix}]
  rerun(store, plan, trust, opts, timeout)     the frozen checks run again, recording nothing
  summary(...)                     the Markdown a CI job summary shows
  check_signer(key, signer), sign(plan, sid, decision, note, key, signer),
  signed_fields(plan, signature, prev)
Imported by the commands that run it (cli.room_of, commands), when they run; what it
uses of the engine's layers is the names it imports from them, listed at its top.
"""

import json
import os
import re
import shutil
import tempfile
import weakref

from .base import (
    ARCHIVE, blank, count_noun, damaged, defused_line, DONE, FablizeError, last_chars, LEDGER,
    one_line, PIN, quote_arg, refused, scope_pattern, sha256_hex, TRIPWIRE, usage)
from .model import latest_run, parse_event, stories_in, touch
from .storage import MemoryLedger, read_state_file, symlink_refusal, within
from .runs import (
    changed_paths, git, git_out, LITERAL, OUTPUT_BAR, read_objects, repo_relative, repo_root,
    run_tool, tree_entries)
from .render import few_ids, grade_groups, GRADES_EACH, md_cell
from .history import audit_ledger
from .rerun import ARTEFACT, failure, HARNESS


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


def first_event(ev):
    """What the trust checks keep of the ledger's first line: all but its stories, which the
    replay holds already."""
    return {k: v for k, v in ev.items() if k != "stories"}


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
            self.first = first_event(ev)
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
        raise damaged(f"the plan's replaces names no archive ({one_line(repr(rel))}) — it cannot "
                      f"be verified. {UNVERIFIED}", "archive_unverified")
    for part in (ARCHIVE, rel):
        if os.path.islink(store.path(part)):
            raise symlink_refusal(store.path(part))
    data = read_state_file(store.path(os.path.join(rel, LEDGER)))
    if data is None:
        raise damaged(f"{rel}/{LEDGER}, the plan the current one replaces, is missing — the "
                      f"replaced history cannot be verified. {UNVERIFIED}", "archive_unverified")
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
            report = audit_ledger(archived, None, scan=found)
        except FablizeError as e:  # its own line numbers: say which ledger they are in
            raise damaged(f"{rel}/{LEDGER}, the plan the current one replaces, does not verify: "
                          f"{e.message} {UNVERIFIED}", "archive_unverified")
        if report["head"] != f"{replaced.get('seq')}:{replaced.get('head')}":
            raise damaged(f"{rel}/{LEDGER} ends at {report['head'][:24]}…, not at the head the "
                          "plan after it names as the one it replaces — the archive was edited. "
                          + UNVERIFIED, "archive_unverified")
        chain.append(rel)
        if found.where == "found":
            return {"pin": pin, "in": f"{rel}/{LEDGER}", "new_plan": True, "archives": chain}
        replaced = report["plan"]["replaces"]
    seq, pin_hash = scan.pin.seq, scan.pin.hash
    if scan.pin.where == "rewritten":
        raise damaged(f"{LEDGER} line {seq} no longer hashes to {pin_hash[:16]}… (the pin): "
                      f"history before it was rewritten. {UNVERIFIED}", "history_rewritten")
    what = f"line {seq} does not exist" if seq else "no line hashes to it"
    raise damaged(f"--since {pin_hash[:16]}…: {what} — the ledger was truncated or re-written "
                  "from scratch" + (", and no verified archive holds it. " if chain else ". ")
                  + UNVERIFIED, "history_rewritten")


# what a history that does not verify leaves: no command makes it verify again
UNVERIFIED = ("Whether to trust this plan is a human's decision: a reviewer compares the branch's "
              f"{LEDGER} (and archive/) with the base's (`git diff BASE -- .fablize/` shows "
              "them), and only a plan that replays from its pin passes.")


def branch_ref(root, ref, what):
    """(repository top, the full name of the one branch `ref` names); anything else — an
    unknown ref, a tag, a bare commit, an ambiguous name — is a usage error."""
    if not ref or ref.startswith("-") or "\x00" in ref:  # never an option to git
        raise usage(f"{what}: {one_line(ref)!r} is not a git ref.", "bad_ref")
    top = repo_root(root)
    if top is None:
        raise refused(f"{what}: {root} is not inside a git repository — run it in the "
                      "checkout of the branch under review (where it is, is a human's to "
                      "say):", "not_a_repository", steps="cd <checkout>")
    code, _, _ = git(top, "rev-parse", "--verify", "--quiet", ref + "^{commit}", what=what)
    if code != 0:
        fetch = fetch_step(top, ref)
        raise usage(f"{what}: {one_line(ref)} is not a commit here (fetch it first?)"
                    + (": " if len(fetch) > 1 else " — ") + fetch[0], "bad_ref", fetch[1:])
    # the ref as git resolves it: a tag the pull request pushed must not stand in for the base
    # branch (git prefers refs/tags/X to refs/heads/X and refs/remotes/X)
    code, out, err = git(top, "rev-parse", "--symbolic-full-name", ref, what=what)
    full = out.decode("utf-8", "replace").strip()
    if code != 0 or "ambiguous" in err or not (full.startswith("refs/heads/")
                                               or full.startswith("refs/remotes/")):
        raise usage(f"{what}: {one_line(ref)} must name one branch (refs/heads/… or "
                    f"refs/remotes/…), not {one_line(full) or 'a tag or a commit'}"
                    + (" — it is ambiguous" if "ambiguous" in err else "") + ".", "bad_ref")
    return top, full


BASES = weakref.WeakKeyDictionary()  # a command's store → {ref: Base}, gone with the command


class Base:
    """The base branch `--base` names, resolved once a command (base_of): every gate of an audit
    reads the same branch, and git is asked once — an audit asked it 8 times (16 rev-parses)
    and where the branch left it 5 times; a command's store is the key, so an in-process
    command after a fetch resolves it again."""

    def __init__(self, top, full):
        self.top, self.full, self._fork = top, full, None

    @property
    def fork(self):
        """Where the branch left the base (fork_point), asked once."""
        if self._fork is None:
            self._fork = fork_point(self.top, self.full)
        return self._fork

    def show(self, path, what="--base", rev=None):
        """The bytes of `path` (relative to the repository top) on the base — or at `rev`, the
        branch's HEAD — or None where it has no such file."""
        code, out, _ = git(self.top, "cat-file", "blob", f"{rev or self.full}:{path}", what=what)
        return out if code == 0 else None


def base_of(store, ref, what="--base"):
    """The Base `ref` names for the command whose store is `store` (branch_ref's refusals when
    it names no one branch: `what` is the option said in them)."""
    bases = BASES.setdefault(store, {})
    if ref not in bases:
        bases[ref] = Base(*branch_ref(store.root, ref, what))
    return bases[ref]


def fetch_step(top, ref):
    """(what to say, the command) that fetches the branch `ref` from the repository's remote
    (origin, or the only one) — into a branch of that name, or for `origin/main` its
    remote-tracking branch — when the remote has it (asked: this is an error's path only);
    else (why not, and no command): which branch is meant is then a human's to say."""
    code, out, _ = git(top, "remote", what="--base")
    names = out.decode("utf-8", "replace").split() if code == 0 else []
    remote = "origin" if "origin" in names else names[0] if len(names) == 1 else None
    if remote is None:
        return ("this repository has no remote to fetch it from; which branch is meant is a "
                "human's to say.",)
    branch = ref[len(remote) + 1:] if ref.startswith(remote + "/") else ref
    code, out, _ = git(top, "ls-remote", "--heads", remote, "refs/heads/" + branch, what="--base")
    if code != 0 or not out.strip():
        return (f"{remote} has no branch {one_line(branch)} either; which branch is meant is a "
                "human's to say.",)
    if branch != ref:  # origin/main: its remote-tracking branch
        cmd = f"git fetch {quote_arg(remote)} {quote_arg(branch)}"
    else:
        cmd = f"git fetch {quote_arg(remote)} {quote_arg(ref + ':' + ref)}"
    return f"`{cmd}` brings it in:", cmd


# a program that runs the file its first plain argument names (its options before it)
INTERPRETERS = re.compile(r"(python[\d.]*|pypy[\d.]*|bash|sh|dash|zsh|ksh|node|deno|bun|ruby"
                          r"|perl|php|Rscript|tclsh|lua|tsx|ts-node)\Z")
# options of those that take the next word as their value, or end the list of files (-c, -e, -m)
VALUE_OPTIONS = frozenset("-W -X -o -O --require -r --import --loader -I".split())
INLINE_OPTIONS = frozenset("-c -e -E --eval -p --print".split())


def files_run(cmd):
    """The files a shell command line runs, relative to where it starts (a `cd` before them
    followed): a program named by its path (./run.sh), the script an interpreter runs (python3
    check.py, bash ci/test.sh), the module `python -m` runs when it is a file of the tree
    (pytest.py, tests/run.py). Arguments it only reads (ruff calc.py, compileall calc.py) and
    folders it enters are not files it runs."""
    from .reports import shell_segments, WRAPPERS
    try:
        segments = shell_segments(cmd)
    except ValueError:
        return []
    found, here = [], ""
    for words in segments:
        words = [w[0] for w in words]
        i = 0
        while i < len(words) and (words[i] in WRAPPERS or re.fullmatch(r"[A-Za-z_]\w*=.*", words[i],
                                                                       re.S | re.A)):
            i += 1
        if i >= len(words):
            continue
        program, args = words[i], words[i + 1:]
        if program == "cd":
            here = os.path.normpath(os.path.join(here, args[0])) if args else ""
            here = "" if here == "." else here
            continue
        if "/" in program:
            found.append(os.path.join(here, program))
        if not INTERPRETERS.match(os.path.basename(program)):
            continue
        k = 0
        while k < len(args):
            arg = args[k]
            if arg == "-m" and k + 1 < len(args):
                module = args[k + 1].replace(".", "/")
                found += [os.path.join(here, module + ".py"),
                          os.path.join(here, module, "__main__.py")]
                break
            if arg in INLINE_OPTIONS or arg == "--":
                break
            if arg.startswith("-"):
                k += 2 if arg in VALUE_OPTIONS else 1
                continue
            found.append(os.path.join(here, arg))
            break
    return found


def check_paths(plan, root, top):
    """The files the plan's frozen checks run (files_run), relative to the repository top,
    those that exist in the tree (as written: a symlink put in its place is a change git sees)."""
    named = set()
    for story in plan["goals"]:
        for cmd in story.get("checks", ()):
            for path in files_run(cmd):
                if "\x00" in path or not os.path.lexists(os.path.join(root, path)):
                    continue
                rel = os.path.relpath(os.path.normpath(os.path.join(os.path.abspath(root), path)),
                                      top)
                if not rel.startswith(".."):
                    named.add(rel.replace(os.sep, "/"))
    return sorted(named)


def changed_check_files(store, ref, plan):
    """The files the plan's frozen checks run which differ between the base branch and the
    working tree: a frozen `python3 check.py` proves nothing if the branch rewrote check.py."""
    base = base_of(store, ref)
    top = base.top
    named = check_paths(plan, store.root, top)
    if not named:
        return []
    code, out, _ = git(top, "diff", "--name-only", "-z", "--no-renames", "--no-relative",
                       base.fork, "--", *named, what="--base", env=LITERAL)
    changed = {x.decode("utf-8", "replace") for x in out.split(b"\0") if x} if code == 0 else set()
    code, out, _ = git(top, "ls-files", "-z", "--others", "--exclude-standard", "--",
                       *named, what="--base", env=LITERAL)
    if code == 0:
        changed |= {x.decode("utf-8", "replace") for x in out.split(b"\0") if x}
    return sorted(changed)


def base_pin(store, ref, shared=None):
    """(pin "SEQ:HASH" or None, what was read) from the ledger committed at `ref`: where it is,
    whether there is a plan, and that plan's scope (its plan_created's). A shared plan's ledger
    is not in the branch: its pin is the pin.json committed there (shared_pin)."""
    top = repo_root(store.root)
    rel = os.path.relpath(os.path.realpath(store.dir), top or "/").replace(os.sep, "/")
    if shared is not None:
        return shared_pin(store, ref, rel, shared["plan"])
    info = {"ref": ref, "path": f"{rel}/{LEDGER}", "plan": False, "scope": []}
    data = base_of(store, ref).show(f"{rel}/{LEDGER}")
    committed = MemoryLedger(data or b"")
    end = committed.end()[0]
    last = committed.last(end) if end else None
    if not last:
        return None, info
    first = parse_event(data[:data.find(b"\n")])
    scope = first.get("scope") if first and first.get("event") == "plan_created" else None
    info.update(plan=True, scope=scope if isinstance(scope, list) else [])
    # the pin is the committed head: its seq is its line number, counted without a parse
    seq = data.count(b"\n", 0, end)
    return f"{seq}:{sha256_hex(last)}", info


def shared_pin(store, ref, rel, plan_id):
    """A shared plan's pin as the base branch holds it: the pin.json `sync --pin` wrote there
    (the plan, its head, its scope), committed and merged like any other file. Only the base's
    copy counts: a pull request's own pin.json is the next pin, once merged. A pin of another
    plan than the one CI names pins nothing (the plan is new)."""
    info = {"ref": ref, "path": f"{rel}/{PIN}", "plan": False, "scope": []}
    data = base_of(store, ref).show(info["path"])
    if data is None:
        return None, info
    try:
        record = json.loads(data.decode("utf-8"))
        pin, pinned = record["pin"], record["plan_id"]
        parse_pin(pin)
        scope = [p for p in record.get("scope") or () if isinstance(p, str)]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, FablizeError):
        raise damaged(f"{ref}:{info['path']} is not a fablize pin (`sync --pin` writes one) — "
                      f"a human replaces it on {ref}: `sync --pin` on a branch writes one, "
                      "committed and merged there.")
    info["plan_id"] = pinned
    if plan_id is not None and plan_id != pinned:
        info["path"] += f" (it pins plan {one_line(pinned)})"
        return None, info
    info.update(plan=True, scope=scope)
    return pin, info


def pin_of(store, base, since, shared=None):
    """(pin or None, what --base read or None): the pin comes from --since, or from what is
    committed at --base (so a pull request cannot move its own pin): the ledger, or for a shared
    plan (`shared`: {"plan": the id CI names, or None}) the pin.json `sync --pin` wrote."""
    if base is None:
        if since is not None:
            parse_pin(since)  # a malformed pin is a usage error before anything is read
        return since, None
    if since is not None:
        raise usage("give --base or --since, not both.")
    return base_pin(store, base, shared)


# CI's policy, committed on the base branch (issue 34): what the workflow's inputs say, read from
# where the pull request cannot write it — one literal path at the repository's top, never where
# --dir or a variable points, never through a symlink (issue 40). A pull request that edits its
# workflow cannot loosen it; one that changes it (content, mode, type), or the workflow that runs
# the audit, fails the audit.
POLICY = "policy.json"
POLICY_PATH = ".fablize/policy.json"
POLICY_KEYS = {"scope": list, "required_checks": list, "fail_to_pass": bool,
               "forbid_out_of_scope": bool, "forbid_tripwires": bool, "allowed_signers": str,
               "require_witnessed": bool, "forbid_accepted": bool, "agent_tests": str,
               "held_out_checks": str}
AGENT_TESTS = ("prove", "forbid")
# each gate the policy can turn on: (its key, audit's option it turns on)
POLICY_FLAGS = (("fail_to_pass", "require_fail_to_pass"), ("forbid_out_of_scope",
                                                             "forbid_out_of_scope"),
                ("forbid_tripwires", "forbid_tripwires"), ("require_witnessed",
                                                             "require_witnessed"),
                ("forbid_accepted", "forbid_accepted"))


def policy_path(store):
    return POLICY_PATH


def base_policy(store, ref):
    """The policy committed on `ref` ({…, path, ref}), or None when it holds none; a policy that
    is not one, or a symlink, is damage (exit 3): CI must not run on a policy it cannot read."""
    base = base_of(store, ref)
    top, full = base.top, base.full
    entry = tree_entries(top, full, [POLICY_PATH]).get(POLICY_PATH)
    if entry is None:
        return None
    mode, oid = entry
    fix = f" — a human fixes it on {one_line(ref)} (the policy is the base branch's, never the " \
          "pull request's)."
    if mode == "120000":
        raise damaged(f"{POLICY_PATH} on {one_line(ref)} is a symlink: the policy is read at one "
                      "literal path and never followed" + fix, "bad_policy")
    raw = read_objects(top, [oid]).get(oid, b"")
    try:
        policy = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        policy = None
    bad = not isinstance(policy, dict) or any(
        key not in POLICY_KEYS or type(value) is not POLICY_KEYS[key] or (
            type(value) is list and not all(isinstance(x, str) for x in value))
        for key, value in policy.items())
    if not bad and policy.get("agent_tests", "prove") not in AGENT_TESTS:
        bad = True
    if not bad and not re.fullmatch(r"[A-Za-z_]\w*", policy.get("held_out_checks", "X"), re.A):
        bad = True
    if bad:
        raise damaged(f"{POLICY_PATH} on {one_line(ref)} is not a policy: a JSON object of "
                      + ", ".join(POLICY_KEYS) + " (agent_tests \"prove\" or \"forbid\"; "
                      "held_out_checks the name of a variable)" + fix, "bad_policy")
    return dict(policy, path=POLICY_PATH, ref=ref)


def apply_policy(opts, policy):
    """audit's options tightened by the base's policy: its scope wins over the one CI gives, its
    required checks are added, its gates are on whatever the workflow says, and where each gate
    came from is kept (`sources`, what the effective policy shows)."""
    src = f"the policy on {policy['ref']}"
    opts = dict(opts, policy=policy, sources=dict(opts.get("sources") or {}))
    sources = opts["sources"]
    if policy.get("scope"):
        opts.update(scope=policy["scope"], require_scope=True, scope_from=src)
        sources.update(scope=src, require_scope=src)
    if policy.get("required_checks"):
        opts["require_check"] = list(dict.fromkeys(opts["require_check"]
                                                   + policy["required_checks"]))
        sources["require_check"] = src
    for key, flag in POLICY_FLAGS:
        if policy.get(key):  # on, whatever the workflow says: the policy is what binds it
            opts[flag] = True
            sources[flag] = src
    if policy.get("agent_tests"):
        opts["agent_tests"] = policy["agent_tests"]
        sources["agent_tests"] = src
    if policy.get("held_out_checks"):
        opts["held_out_checks"] = policy["held_out_checks"]
        sources["held_out_checks"] = src
    if policy.get("allowed_signers") and opts["allowed_signers"] is None:
        opts["allowed_signers"] = policy["allowed_signers"]
        sources["allowed_signers"] = src
    return opts


# the gates the effective policy lists: (audit's option, what it is called there)
EFFECTIVE = (("scope", "scope"), ("require_scope", "a scope required"),
             ("require_check", "required checks"), ("require_fail_to_pass", "fail-to-pass"),
             ("forbid_out_of_scope", "nothing changed outside the scope"),
             ("forbid_tripwires", "no tripwires"), ("require_witnessed", "every story witnessed"),
             ("require_unchanged_checks", "the files checks run unchanged"),
             ("forbid_accepted", "no story accepted"), ("allowed_signers", "signed decisions"),
             ("agent_tests", "the agent's own tests"), ("held_out_checks", "held-out checks"))


def effective_policy(opts):
    """[(gate, its value in words, where it came from)] of every gate the audit applies."""
    sources = opts.get("sources") or {}
    out = []
    for key, name in EFFECTIVE:
        value = opts.get(key)
        if key == "agent_tests":
            words = {"prove": "run red → green and may carry fail-to-pass",
                     "forbid": "forbidden"}.get(value, "not run: listed as changes outside the "
                                                       "scope")
        elif key == "held_out_checks":
            words = f"from ${value}" if value else None
        elif key == "scope":
            words = ", ".join(map(one_line, value[:MAX_LISTED])) if value else None
        elif key == "require_check":
            words = "; ".join(f"`{one_line(c)}`" for c in value[:MAX_LISTED]) if value else None
        elif key == "allowed_signers":
            words = one_line(value) if value else None
        else:
            words = "on" if value else None
        if words is None and key not in ("agent_tests",):
            continue
        out.append((name, words, sources.get(key) or ("the audit's options" if value
                                                      else "the default")))
    return out


def policy_changes(store, ref):
    """The files of the audit's own policy the branch changed since `ref`: the policy (its bytes,
    its mode, its type — a symlink, a folder where .fablize was — or its absence), and the
    workflow that runs the audit (GitHub's GITHUB_WORKFLOW_REF names it; else every workflow
    under .github/workflows/ that names fablize, on either side)."""
    base = base_of(store, ref)
    top = base.top
    changed = []
    # the policy as each side's tree holds it: mode, type and object (a symlink put in its place,
    # or a .fablize folder that became a link, leaves no such entry: absent is a change too)
    # against where the branch left the base: a policy the base changed since is not the branch's
    sides = [git(top, "ls-tree", "-z", side, "--", POLICY_PATH, env=LITERAL)[1]
             for side in (base.fork, "HEAD")]
    if sides[0] != sides[1]:
        changed.append(POLICY_PATH)
    code, out, _ = git(top, "diff", "--name-only", "-z", "--no-renames", "--no-relative",
                       base.fork, "HEAD", "--", ".github/workflows", what="--base",
                       env=LITERAL)
    names = ([x.decode("utf-8", "surrogateescape") for x in out.split(b"\0") if x]
             if code == 0 else [])
    ours = os.environ.get("GITHUB_WORKFLOW_REF", "").split("@")[0]
    for name in names:
        if ours and ours.endswith("/" + name):
            changed.append(name)
        elif not ours and any(b"fablize" in (base.show(name, rev=side) or b"")
                              for side in (None, "HEAD")):
            changed.append(name)
    return changed


def github_changes(store, ref):
    """Every path under .github/ the branch changed: workflows, CODEOWNERS, actions — listed for
    the reviewer whatever they are."""
    base = base_of(store, ref)
    top = base.top
    code, out, _ = git(top, "diff", "--name-only", "-z", "--no-renames", "--no-relative",
                       base.fork, "HEAD", "--", ".github", env=LITERAL)
    return ([x.decode("utf-8", "surrogateescape") for x in out.split(b"\0") if x]
            if code == 0 else [])


def policy_history(store, ref, pin_path):
    """{commit, subject, after_pin} of the commit on `ref` that last changed the policy, or None:
    a policy loosened by an earlier pull request merged over a red check shows in every later
    audit. `after_pin`: it came after the commit that last changed the plan's ledger there."""
    base = base_of(store, ref)
    top, full = base.top, base.full
    code, out, _ = git(top, "log", "-1", "--format=%H%x00%s", full, "--", POLICY_PATH,
                       env=LITERAL)
    if code != 0 or not out.strip():
        return None
    commit, _, subject = out.decode("utf-8", "replace").strip().partition("\0")
    code, out, _ = git(top, "log", "-1", "--format=%H", full, "--", pin_path, env=LITERAL)
    pinned = out.decode().strip() if code == 0 else ""
    after = bool(pinned) and pinned != commit and git(
        top, "merge-base", "--is-ancestor", pinned, commit)[0] == 0
    return {"commit": commit, "subject": subject, "after_pin": after}


def pr_base(store, ref):
    """Under GitHub Actions on a pull request, the pull request's base branch as this clone
    holds it when --base names another (a workflow the branch edited could name a base whose
    pin and policy are the branch's choosing), else None."""
    wanted = os.environ.get("GITHUB_BASE_REF", "")
    if not wanted or os.environ.get("GITHUB_ACTIONS") != "true":
        return None
    base = base_of(store, ref)
    top, full = base.top, base.full
    if full == f"refs/heads/{wanted}" or (full.startswith("refs/remotes/")
                                          and full.split("/", 3)[-1] == wanted):
        return None
    for name in (f"origin/{wanted}", wanted):
        if git(top, "rev-parse", "--verify", "--quiet", name + "^{commit}")[0] == 0:
            return name
    return f"origin/{wanted}"


def anchor(store, ref):
    """Where the judge came from, for the verdict to open with: the engine running this audit
    (the base's committed copy — scripts/ or .github/fablize/ — file for file, or another) and,
    under GitHub Actions, the workflow (the base's, as a required workflow runs it, or the pull
    request's copy: identical to the base's, or not — then policy_changed names it too)."""
    base = base_of(store, ref)
    top, full = base.top, base.full
    here = os.path.dirname(os.path.abspath(__file__))
    own = {"goals.py": os.path.join(os.path.dirname(here), "goals.py")}
    own.update({f"fablize_gate/{n}": os.path.join(here, n) for n in os.listdir(here)
                if n.endswith(".py")})
    commit = git_out(top, "rev-parse", full).decode().strip()
    engine = None
    for folder in ("scripts", ".github/fablize"):
        entries = tree_entries(top, full, [folder + "/goals.py", folder + "/fablize_gate"])
        wanted = {k[len(folder) + 1:]: v for k, v in entries.items() if k.endswith(".py")}
        if not wanted:
            continue
        blobs = read_objects(top, [oid for _, oid in wanted.values()])
        same = set(wanted) == set(own) and all(
            read_small(own[name]) == blobs.get(oid) for name, (_, oid) in wanted.items())
        engine = (f"the engine the base commits ({folder}/), file for file, as of "
                  f"{commit[:12]}" if same else
                  f"not the engine {folder}/ holds on the base (an engine of CI's own)")
        if same:
            break
    items = [["engine: " + (engine or "CI's own (the base commits no engine)")]]
    workflow = os.environ.get("GITHUB_WORKFLOW_REF", "")
    if workflow and os.environ.get("GITHUB_ACTIONS") == "true":
        name, _, wref = workflow.partition("@")
        rel = name.split("/", 2)[-1] if name.count("/") >= 2 else name
        base_name = os.environ.get("GITHUB_BASE_REF", "")
        if base_name and wref == f"refs/heads/{base_name}":
            items.append([f"workflow: {rel} of {wref} — the base's own, as a required workflow "
                          "runs it"])
        else:
            code, out, _ = git(top, "diff", "--quiet", "--no-ext-diff", "--no-textconv", full,
                               "HEAD", "--", rel, env=LITERAL)
            items.append([f"workflow: {rel} of {wref or 'the pull request'} — the pull "
                          "request's copy, " + ("identical to the base's" if code == 0 else
                                                "which differs from the base's (policy_changed)")
                          + "; a ruleset that requires the base's makes it the base's own"])
    return items


def read_small(path):
    try:
        with open(path, "rb") as f:
            return f.read(8 << 20)
    except OSError:
        return None


def not_the_pr_base(ref, step):
    """The refusal of a --base that is not the pull request's (pr_base), naming `step`: the
    same audit on the pull request's base."""
    return refused(f"--base {one_line(ref)} is not the pull request's base branch "
                   f"{one_line(os.environ.get('GITHUB_BASE_REF', ''))} (GITHUB_BASE_REF): the "
                   "pin, the policy and the tree the checks re-run on come from that branch "
                   "only — was the workflow edited?", "base_not_pr_base", steps=step)


def allowed_signers_file(store, signers, base):
    """Path of the allowed-signers file to verify with: read from `base`'s ref when given, so a
    pull request cannot add its own key. Returns (path, temporary directory or None)."""
    if "\x00" in signers:
        raise usage("--allowed-signers: a path cannot hold a NUL byte.", "no_signers")
    if base is None:
        if not os.path.isfile(signers):
            raise usage(f"--allowed-signers: {one_line(signers)} does not exist.", "no_signers")
        return signers, None
    top = repo_root(store.root) or store.root
    rel = os.path.relpath(os.path.abspath(signers), top).replace(os.sep, "/")
    if rel.startswith(".."):
        raise usage("--allowed-signers with --base names a file inside the repository.",
                    "no_signers")
    data = base_of(store, base, "--allowed-signers").show(rel, "--allowed-signers")
    if data is None:
        raise refused(f"--allowed-signers: {one_line(rel)} is not committed at {one_line(base)} "
                      "— only signers the base branch lists count: a human commits it there "
                      "(the pull request's own list never counts).", "no_signers")
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
    if bool(key) != bool(signer) or (signer is not None and blank(signer)):
        raise usage("--sign KEYFILE and --signer PRINCIPAL go together.", "usage")
    if "\x00" in key or not os.path.isfile(key):
        raise usage(f"--sign: {one_line(key)} is not a key file.", "usage")


def sign(plan, sid, decision, note, key, signer):
    """(signature, the ledger head it was made over) of a decision, signed with ssh-keygen
    outside the lock."""
    prev = plan["ledger"]["head"]
    payload = decision_payload(plan["plan_id"], sid, decision, note, prev)
    code, out, err = run_tool(["ssh-keygen", "-q", "-Y", "sign", "-f", key, "-n",
                                      SIGN_NAMESPACE], data=payload, what="decide --sign")
    if code != 0 or b"BEGIN SSH SIGNATURE" not in out:
        raise refused(f"ssh-keygen could not sign the decision: {one_line(err)[:300]} — the key "
                      f"is a human's: `ssh-keygen -y -f {quote_arg(key)}` checks it can be read, "
                      "then `decide` again with it.", "sign_failed")
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
    if (not isinstance(sig, dict) or not isinstance(sig.get("sig"), str) or
            not isinstance(sig.get("signer"), str) or blank(sig.get("signer"))):
        return "unsigned"
    payload = decision_payload(plan_id, ev.get("id"), ev.get("decision"), ev.get("note"),
                               ev.get("prev"))
    with tempfile.TemporaryDirectory(prefix="fablize-verify-") as tmp:
        path = os.path.join(tmp, "decision.sig")
        with open(path, "w", encoding="utf-8") as f:
            f.write(sig["sig"])
        code, _, _ = run_tool(["ssh-keygen", "-Y", "verify", "-f", signers_path, "-I",
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
        self.here = repo_relative(root)
        self.first = None
        self.decisions = []  # every one: an unsigned decision before a signed one counts too
        self.added = []
        self.first_env = None
        self.prov, self.why = object(), ()  # the last run's provenance, and what is wrong with it
        self.unclean, self.flagged, self.unrecorded, self.dirty = 0, [], 0, []

    def __call__(self, lineno, head, ev):
        after_pin = self.pin is not None and self.pin.where == "found"
        if self.pin is not None:
            self.pin(lineno, head, ev)
        if lineno == 1:
            self.first = first_event(ev)
        kind = ev["event"]
        if kind == "decision":
            self.decisions.append(ev)
        elif kind == "story_added" and after_pin:
            self.added.append(ev["story"])  # after the pin: its checks are the agent's own
        elif kind == "verify_run":
            self.run(lineno, ev)

    def run(self, lineno, ev):
        """Why a witnessed run is not clean: outside the repository root, or under an environment
        different from the plan's first run. A run made on a dirty tree is kept apart: review
        flags it only if that exact tree was never committed."""
        prov = ev.get("provenance")
        if not isinstance(prov, dict):
            self.unrecorded += 1  # counted apart: every run of an older engine would be listed
            why = ()
        elif prov == self.prov:  # most runs share one provenance: it is judged once
            why = self.why
        else:
            self.prov = prov
            why = self.why = self.judge(prov)
        if ev.get("git_dirty") and len(self.dirty) < self.MAX_FLAGGED:
            self.dirty.append({"line": lineno, "id": ev["id"], "cmd": ev["cmd"],
                               "tree": ev.get("tree"), "why": list(why)})
        elif why:
            self.flag(lineno, ev, list(why))

    def judge(self, prov):
        """Why runs of this provenance are not clean (a tuple, empty when they are)."""
        why = []
        if prov.get("dir") is None or (self.here is not None and prov.get("dir") != self.here):
            why.append(f"made outside the repository root ({one_line(prov.get('dir'))})")
        env = env_digests(prov.get("env"))
        if self.first_env is None:
            self.first_env = env
        elif env != self.first_env:
            names = sorted(str(k) for k in set(env) | set(self.first_env)
                           if env.get(k) != self.first_env.get(k))
            why.append("environment differs from the plan's first run (" +
                       ", ".join(one_line(n) for n in names) + ")")
        return tuple(why)

    def flag(self, lineno, ev, why):
        self.unclean += 1
        if len(self.flagged) < self.MAX_FLAGGED:
            self.flagged.append({"line": lineno, "id": ev["id"], "cmd": ev["cmd"], "why": why})


def env_digests(env):
    """A run's recorded environment as names and short digests, whichever engine wrote it (an
    older one kept the values): runs made before and after an upgrade compare alike."""
    if not isinstance(env, dict):
        return env
    return {k: v[:23] if isinstance(v, str) and v.startswith("sha256:") else
            "sha256:" + sha256_hex(str(v).encode("utf-8", "surrogateescape"))[:16]
            for k, v in env.items()}


def witnessed_gaps(plan):
    """The completed stories that do not rest on their own frozen checks run by the engine."""
    gaps = []
    for s in stories_in(plan, "complete"):
        if not s["checks"]:
            how = ("its pass was run ad hoc (--run)" if s["last_run"] and
                s["last_run"]["check"] is None else "it has no frozen checks: its pass is claimed")
            gaps.append(f"{s['id']} ({how})")
            continue
        for i in range(len(s["checks"])):
            run = latest_run(s, check=i)
            if run is None or not run["ok"]:
                gaps.append(f"{s['id']} (frozen check {i + 1} has no passing run of the engine's)")
                break
    return gaps


# The work's scope and the re-run's own tree ####################################################


def scope_matcher(patterns):
    """Whether a repository path (`/`-separated, from the top) is inside the scope: a pattern
    without a wildcard is that file or that folder's files; a glob matches the whole path,
    `*` and `?` within one folder, `**` across folders (`src/**`, `**/*.py`, `*.md` at the
    top only)."""
    literal, globs = [], []
    for pattern in patterns:
        if not any(c in pattern for c in "*?["):
            literal.append(pattern.rstrip("/"))
            continue
        rx, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                rx, i = rx + ".*", i + 2
            else:
                c = pattern[i]
                rx += {"*": "[^/]*", "?": "[^/]"}.get(c, re.escape(c) if c != "[" else "[")
                i += 1
        globs.append(re.compile(rx + r"\Z", re.S))
    return (lambda path: any(path == p or path.startswith(p + "/") for p in literal) or
        any(g.match(path) for g in globs))


NARROWER = "name the folder or the files the work changes"


def scope_refusal(pattern, files):
    """Why `pattern` is no scope of a work, or None: it takes the whole tree (`.`, `*`, `**`) or
    every file of a kind at the top (`*.py`), or matches no file of the tree (`files`, None when
    unknown; a literal path may name a file the work will create). A scope holding tests or
    harness is no longer refused: those always come from the base (tree_plan)."""
    bare = pattern.rstrip("/")
    if re.fullmatch(r"[.*/]*", bare):
        return "takes the whole tree"
    if re.fullmatch(r"(\*\*/)?\*[^/*?\[]*", bare):
        return "takes every such file from the top down"
    if files is None:
        return None
    if any(c in pattern for c in "*?[") and not any(map(scope_matcher([pattern]), files)):
        return "matches no file of the tree"
    return None


def narrower(pattern, files):
    """A narrower form the engine accepts, for the refusal to name: the folders (or top-level
    files) of the tree's files the pattern takes that are no tests, harness or hidden files, a
    few of them."""
    inside = scope_matcher([pattern]) if files is not None else (lambda path: False)
    picks = []
    from .rerun import test_material
    for path in files or ():
        if (not inside(path) or test_material(path) or re.search(HARNESS, path)
                or any(part.startswith(".") for part in path.split("/"))):
            continue  # tests, harness, .fablize/, .github/, dotfiles: never what a work changes
        pick = path.split("/", 1)[0] + "/" if "/" in path else path
        if pick not in picks and scope_refusal(pick, files) is None:
            picks.append(pick)
        if len(picks) == 3:
            break
    return ", ".join(picks) if picks else "src/, src/calc.py, src/**/*.py"


def check_scope(patterns, root, stories, option="--scope"):
    """Usage error, in one line naming where the scope came from and a narrower form, for a
    scope that says more than a work may change (scope_refusal), judged against the repository's
    files at `root`."""
    top = repo_root(root)
    files = None
    if top is not None:
        code, out, _ = git(top, "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                           what=option)
        if code == 0:
            files = [x.decode("utf-8", "surrogateescape") for x in out.split(b"\0") if x]
    for pattern in patterns:
        why = scope_refusal(pattern, files)
        if why:
            raise usage(f"{option} {one_line(pattern)!r} {why}: {NARROWER} — for instance "
                        f"{narrower(pattern, files)}.", "broad_scope")


def scope_of(plan, base, given, given_from="CI"):
    """(patterns, where they come from) of the work's scope, or ([], None): the scope of the
    policy on the base, else the one CI gives (--scope), wins; with --base, the scope of the plan
    as the base branch holds it (so a scope the branch declared after the pin does not count);
    else the plan's own."""
    if given:
        return [scope_pattern(p) for p in given], given_from
    if base is not None:
        scope = [p for p in base.get("scope") or () if isinstance(p, str)]
        return scope, (f"the plan on {base['ref']}" if scope else None)
    scope = plan.get("scope") or []
    return scope, ("the plan" if scope else None)


def widen_where(source):
    """Where the scope that came from `source` (scope_of's) is widened — the place it came
    from, so the step is one that changes it."""
    if source and source.startswith("the policy on "):
        return (f"in {POLICY_PATH} on {source[len('the policy on '):]} (a human's change on the "
                "base: the policy wins over the plan's and CI's)")
    if source == "CI":
        return "CI gives (`--scope`, FABLIZE_SCOPE, the action's `scope`)"
    return "on the base (`create --scope`)"


def tree_plan(store, plan, base, opts):
    """How the re-run builds its trees: None to run in the checkout (no scope, or no --base);
    else {top, base commit, the branch's files it takes, those it leaves (outside the scope, the
    harness, the base's tests, artefacts), the harness inside the scope, the test files the
    branch adds (the agent's own tests), the files it would not take as they shadow a module,
    the state directory's and the root's place}. The base's runner adds what it names as tests
    and harness once it has run (rerun.classify)."""
    from .rerun import test_material
    from .reports import test_runners
    scope, source = scope_of(plan, base, opts["scope"], opts.get("scope_from", "CI"))
    if base is None or not scope:
        return None
    # what the checks run decides which names are tests (a held-out check may run any runner)
    runners = {r for story in plan["goals"] for cmd in story.get("checks") or ()
               for r in test_runners(cmd)}
    runners |= {r for cmd in opts.get("require_check") or () for r in test_runners(cmd)}
    if opts.get("held_out_checks"):
        runners.add("unittest")
    b = base_of(store, base["ref"])
    top, full = b.top, b.full
    state_rel = os.path.relpath(os.path.realpath(store.dir), top).replace(os.sep, "/")
    inside = scope_matcher(scope)
    named = set(check_paths(plan, store.root, top))  # what a check runs is the base's
    shadows = Shadows(top, full, plan)
    take, left, harness, agent, shadow, lifted = [], [], [], [], [], {}
    for path, status in branch_changes(b):
        if path == state_rel or path.startswith(state_rel + "/") or path == POLICY_PATH:
            continue
        if re.search(HARNESS, path) or path in named:
            (harness if inside(path) else left).append(path)
        elif test_material(path, runners):
            if status == "A":
                agent.append(path)
            elif status == "M" and (tests := marks_lifted(b, path)):
                lifted[path] = tests  # the branch's copy runs them
            else:
                left.append(path)  # a base test changed: listed
        elif not inside(path) or re.search(ARTEFACT, path):
            left.append(path)
        elif status != "D" and shadows.module_of(path):
            shadow.append({"path": path, "module": shadows.module_of(path)})
        else:
            take.append((path, status == "D"))
    scratch, moved = scratch_folder(top)
    return {"top": top, "base": full, "fork": b.fork, "take": take,
            "left": left + harness, "harness": harness,
            "agent_tests": agent, "shadow": shadow, "scope": scope, "from": source,
            "marks_lifted": lifted,
            "scratch": scratch, "scratch_moved": moved, "runners": sorted(runners),
            "root": os.path.relpath(os.path.realpath(store.root), top)}


def marks_lifted(base, path):
    """The tests whose xfail marks the branch's `path` takes out — when it is the base's with
    lines taken out and nothing else, each a whole mark (rerun.only_marks_lifted): base tests
    the work fixes, now required to pass — else []. Compared with the base as it is now, so
    that nothing the base changed since the branch left it is undone."""
    from .rerun import only_marks_lifted
    before = tree_entries(base.top, base.full, [path])
    after = tree_entries(base.top, "HEAD", [path])
    if path not in before or path not in after or before[path][0] != after[path][0]:
        return []
    blobs = read_objects(base.top, [before[path][1], after[path][1]])
    return only_marks_lifted(blobs.get(before[path][1]), blobs.get(after[path][1]))


def fork_point(top, full):
    """Where the branch left the base: their merge base (a base that moved on since is not the
    branch's change), else the base itself."""
    code, out, _ = git(top, "merge-base", full, "HEAD")
    return out.decode().strip() if code == 0 and out.strip() else full


def branch_changes(base):
    """[(path, status)] the branch's HEAD changed since it left the Base `base`."""
    try:
        return changed_paths(base.top, base.fork)
    except FablizeError as e:
        raise damaged(f"--base: git cannot compare HEAD with {one_line(base.full)} "
                      f"({one_line(e.message)[:200]}) — the branch under review must have a "
                      "commit: a human commits its work (or checks out the branch), then the "
                      "audit runs again.", "git_failed")


class Shadows:
    """Which module a file of the work would stand in for: its import name, under each folder
    the checks put on sys.path (the tree's top, the folder a check `cd`s into, PYTHONPATH a check
    sets, pytest's `pythonpath` in the base's configuration), when that name is a standard
    library module, an installed distribution's top-level module or a plugin's entry module (a
    `pytest_cov/` of the work would replace the plugin CI installed)."""

    def __init__(self, top, full, plan):
        self.top, self.full, self.plan = top, full, plan
        self.roots, self.protected = None, None

    def module_of(self, path):
        if self.roots is None:
            self.roots, self.protected = self.import_roots(), protected_modules()
        for root in self.roots:
            rel = path if not root else (path[len(root) + 1:] if path.startswith(root + "/")
                                         else None)
            if not rel:
                continue
            first, _, rest = rel.partition("/")
            name = first[:-3] if first.endswith(".py") and not rest else first
            if not rest and not first.endswith(".py"):
                continue  # a data file at the root imports as nothing
            if name in self.protected:
                return name
        return None

    def import_roots(self):
        roots = {""}
        from .reports import shell_segments
        for story in self.plan["goals"]:
            for cmd in story.get("checks", ()):
                try:
                    segments = shell_segments(cmd)
                except ValueError:
                    continue
                here = ""
                for words in segments:
                    words = [w[0] for w in words]
                    if words[:1] == ["cd"] and len(words) > 1:
                        here = os.path.normpath(os.path.join(here, words[1])).lstrip("./")
                        roots.add("" if here == "." else here)
                    for w in words:
                        if w.startswith("PYTHONPATH="):
                            roots |= {os.path.normpath(os.path.join(here, p)).lstrip("./")
                                      for p in w[11:].split(":") if p and not os.path.isabs(p)}
        configs = tree_entries(self.top, self.full, [f"{r}/{name}" if r else name
                                                      for r in roots for name in PYTEST_CONFIGS])
        blobs = read_objects(self.top, [oid for _, oid in configs.values()])
        for path, (_, oid) in configs.items():
            folder = os.path.dirname(path)
            text = blobs.get(oid, b"").decode("utf-8", "replace")
            for m in re.finditer(r"^\s*pythonpath\s*=\s*(\[[^\]]*\]|.*)$", text, re.M):
                for p in re.findall(r"[\"']([^\"']+)[\"']", m.group(1)) if m.group(1).startswith(
                        "[") else m.group(1).split():
                    roots.add(os.path.normpath(os.path.join(folder, p)).lstrip("./"))
        return sorted(r if r != "." else "" for r in roots)


PYTEST_CONFIGS = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml",
                  "tox.ini", "setup.cfg")


def protected_modules():
    """The import names a file of the work must not take: the standard library's, and each
    installed distribution's top-level modules and entry modules (as this interpreter sees
    them, CI's own)."""
    import sys
    names = set(sys.builtin_module_names) | set(getattr(sys, "stdlib_module_names", ()))
    if not hasattr(sys, "stdlib_module_names"):  # Python 3.9: the standard library's folder
        import sysconfig
        for folder in (sysconfig.get_paths()["stdlib"],
                       os.path.join(sysconfig.get_paths()["stdlib"], "lib-dynload")):
            try:
                for entry in os.listdir(folder):
                    names.add(entry.split(".")[0])
            except OSError:
                pass
        names.discard("site-packages")
    try:
        from importlib import metadata
        for dist in metadata.distributions():
            top_level = dist.read_text("top_level.txt")
            if top_level:
                names |= {x.strip() for x in top_level.split() if x.strip()}
            else:
                for f in dist.files or ():
                    first = str(f).split("/")[0]
                    if not first.endswith((".dist-info", ".egg-info", ".pth")) and \
                            first not in ("..", "__pycache__", "bin"):
                        names.add(first[:-3] if first.endswith(".py") else first)
            for ep in dist.entry_points:
                names.add(ep.value.split(":")[0].split(".")[0].strip())
    except Exception:  # a broken installation's metadata: the standard library still counts
        pass
    names |= {"pytest", "_pytest", "pluggy", "unittest", "conftest"}
    return {n for n in names if n}


def scratch_folder(top):
    """(where the re-run's trees go, the temporary folder it refused or None): $RUNNER_TEMP or
    the temporary folder, never inside the checkout — there, a runner's upward search for its
    configuration (pytest.ini, conftest.py) would find the branch's; a self-hosted runner's
    TMPDIR inside the checkout is moved out, to the checkout's parent, and said so."""
    wanted = os.environ.get("RUNNER_TEMP") or tempfile.gettempdir()
    if not within(os.path.realpath(wanted), os.path.realpath(top)):
        return wanted, None
    for other in ("/tmp", os.path.dirname(os.path.realpath(top))):
        if os.path.isdir(other) and not within(os.path.realpath(other), os.path.realpath(top)):
            return other, wanted
    raise refused(f"the temporary folder {wanted} lies inside the checkout, and no folder outside "
                  "it is at hand for the re-run's trees: set TMPDIR (or RUNNER_TEMP) outside it.",
                  "scratch_inside")


# What in-scope code does to its judge, read from the lines the branch added: a tripwire for the
# reviewer, not a proof (code inside the test process can hide what it does)
# (what honest code writes too — tempfile.gettempdir(), an __eq__, sys.modules[__name__] — is left
# out: a tripwire that fires on honest work teaches reviewers to ignore it)
TRIPWIRES = (
    ("reaches into the test runner",
     r"\b_pytest\b|pluginmanager|sessionfinish|\bSkipTest\b|\bdef pytest_\w+|hookimpl"
     r"|\bpytest\.(exit|skip)\b|unittest\.(TestResult|TextTestRunner)"
     r"|sys\.modules\[[\"'](_?pytest|unittest)"),
    ("ends the process", r"\bos\._exit\b|\batexit\b|^(sys\.exit|exit|quit|raise SystemExit)\b"),
    ("looks for CI or its judge",
     r"[\"'](CI|GITHUB_\w+|RUNNER_\w+|PYTEST_\w+|FABLIZE\w*)[\"']|fablize|getppid"),
)


def wire_of(line):
    """The kind of tripwire a line of code is, or None."""
    for what, rx in TRIPWIRES:
        if re.search(rx, line):
            return what
    return None


def added_lines(old, new):
    """[(line number, text)] of the lines of `new` (bytes) that `old` does not hold: a line
    counts as added once for each time it appears more often than before. No diff is parsed, so
    no diff setting, attribute or file name hides a line (a `+++ ` line, `-diff`, a quoted
    name)."""
    import collections
    before = collections.Counter(old.decode("utf-8", "replace").split("\n"))
    found = []
    for number, line in enumerate(new.decode("utf-8", "replace").split("\n"), 1):
        if before[line] > 0:
            before[line] -= 1
        else:
            found.append((number, line))
    return found


def tripwires(tree, limit=50, head="HEAD"):
    """[{path, line, what, text}]: each line the branch added to a file the re-run takes that
    reaches into the test run, ends the process at import, or looks for CI or the audit;
    `head` None reads the working tree instead of HEAD (a judge's, an agent's report)."""
    kept = [path for path, deleted in tree["take"] if not deleted]
    if not kept:
        return []
    before = tree_entries(tree["top"], tree.get("fork") or tree["base"], kept)
    after = tree_entries(tree["top"], head, kept) if head else {}
    blobs = read_objects(tree["top"], [oid for _, oid in list(before.values())
                                       + list(after.values())])
    found = []
    for path in kept:
        old = blobs.get(before[path][1], b"") if path in before else b""
        if head:
            new = blobs.get(after[path][1], b"") if path in after else b""
        else:
            try:
                with open(os.path.join(tree["top"], *path.split("/")), "rb") as f:
                    new = f.read(1 << 22)
            except OSError:
                continue
        for number, line in added_lines(old, new):
            what = wire_of(line)
            if what:
                found.append({"path": path, "line": number, "what": what,
                              "text": line.strip()[:120]})
                if len(found) >= limit:
                    return found
    return found


def tripwires_since(store, plan, ref, limit=50):
    """The tripwires of the work in this working tree since `ref` (committed or not, new files
    too), inside the plan's scope (every file without one), the state directory, artefacts and
    the harness left out: what `judge-packet --base` and `report --base` show."""
    base = base_of(store, ref)
    top, full = base.top, base.full
    state_rel = os.path.relpath(os.path.realpath(store.dir), top).replace(os.sep, "/")
    scope = [p for p in plan.get("scope") or () if isinstance(p, str)]
    inside = scope_matcher(scope) if scope else (lambda path: True)

    def kept(path):
        return (inside(path) and path != state_rel and not path.startswith(state_rel + "/")
                and not re.search(ARTEFACT, path) and not re.search(HARNESS, path))

    fork = base.fork
    code, out, _ = git(top, "diff", "--name-only", "-z", "--no-renames", "--no-relative", fork,
                       "--", what="--base", env=LITERAL)
    paths = set(x.decode("utf-8", "surrogateescape") for x in out.split(b"\0") if x) \
        if code == 0 else set()
    code, out, _ = git(top, "ls-files", "-z", "--others", "--exclude-standard", what="--base")
    if code == 0:
        paths |= {x.decode("utf-8", "surrogateescape") for x in out.split(b"\0") if x}
    take = [(path, not os.path.lexists(os.path.join(top, path))) for path in sorted(paths)
            if kept(path)]
    return tripwires({"top": top, "base": full, "fork": fork, "take": take}, limit, head=None)


# Said once, rendered once: every finding of the trust room is a Block — a title and its items,
# each item a list of parts (plain words, or ("`", text) for a path, a command, a line of code) —
# which the audit's text, the job summary, `report` and the judge packet all render (issue 40).


class Block:
    """A finding: its title and items; `inline` says it in one line (its items joined)."""

    def __init__(self, title, items=(), empty=None, inline=False):
        self.title, self.items, self.empty, self.inline = title, list(items), empty, inline


def code(text):
    """A command or a line of code: in backquotes, in text and Markdown alike."""
    return ("`", str(text))


def path(text):
    """A file's path (or a command listed for review): backquoted in Markdown, bare in text."""
    return ("p", str(text))


def tail(text):
    """A line of a failed check's output: shown behind a bar in text, left to the log in
    Markdown (the job's own log holds it)."""
    return ("tail", str(text))


def render_parts(parts, md):
    out = []
    for p in parts:
        if not isinstance(p, tuple):
            out.append(p)
        elif p[0] == "tail":
            out.append(OUTPUT_BAR.strip() + " " + one_line(p[1]))
        elif md:
            out.append(f"`{md_cell(p[1], 200)}`")
        else:
            out.append(f"`{one_line(p[1])}`" if p[0] == "`" else one_line(p[1]))
    return "".join(out)


def block_lines(block, md=False, indent="  ", limit=MAX_LISTED):
    """A Block as lines: text indents its items under its title, Markdown makes them bullets
    (50 at most; text shows `limit`, --json has them all); an inline block is one line."""
    items = [i for i in block.items if not (md and i and isinstance(i[0], tuple)
                                            and i[0][0] == "tail")]
    cap = 50 if md else limit
    more = len(items) - cap
    if not items:
        if block.empty is None:
            return []
        line = f"{block.title} {block.empty}".rstrip()
        return [line, ""] if md else [indent + line]
    if block.inline:
        line = f"{block.title} " + ", ".join(render_parts(i, md) for i in items[:cap]) + (
            f" and {more} more" if more > 0 else "")
        return [line, ""] if md else [indent + line]
    if md:
        return ([block.title, ""] + [f"- {render_parts(i, True)}" for i in items[:cap]]
                + ([f"- … and {more} more"] if more > 0 else []) + [""])
    return ([f"{indent}{block.title}"] + [f"{indent}  {render_parts(i, False)}"
                                          for i in items[:cap]]
            + ([f"{indent}  … and {more} more"] if more > 0 else []))


def tripwire_block(wires, empty=None):
    return Block(f"The work's code {TRIPWIRE} (a tripwire for the reviewer, not a proof):",
                 [[path(f"{t['path']}:{t['line']}"), f" {t['what']} — ", code(t["text"])]
                  for t in wires], empty)


def tripwire_md(wires, base):
    """The report's section on the tripwires since `base`."""
    return "\n## Tripwires\n\n" + "\n".join(block_lines(tripwire_block(
        wires, f"None since `{md_cell(base)}`: no line of the work reaches into the test run or "
               "looks for its judge."), md=True))


def tripwire_lines(wires):
    """What judge-packet says of the tripwires, a line each."""
    return block_lines(tripwire_block(wires), indent="")


def gate_lines(failures, md=False):
    """Every failed gate with its fix."""
    if md:
        return [f"- **{f['code']}** — {md_cell(f['message'], 400)}. _Fix:_ {md_cell(f['fix'], 300)}"
                for f in failures]
    return [f"  ✗ {f['code']}: {f['message']} — fix: {f['fix']}" for f in failures]


# The report: what the audit saw, its gates, its verdict #######################################


def engine_inside(root):
    here = os.path.realpath(os.path.abspath(__file__))
    top = os.path.realpath(repo_root(root) or root)
    return within(here, top)


def committed_trees(top, trees, state_rel, limit=200):
    """The trees of `trees` (run trees, state directory left out) that some commit reachable from
    HEAD holds exactly, apart from the state directory: a run made before its work was committed
    as it was tested is honest. A run's tree object lives only in the clone that ran it, so each
    commit's tree is computed without the state directory (tree_id_without) and compared by id:
    CI's clone, which never received those objects, tells them apart all the same."""
    if not trees or top is None:
        return set()
    code, out, _ = git(top, "rev-list", f"--max-count={limit}", "HEAD")
    commits = out.decode().split() if code == 0 else []
    code, out, _ = git(top, "rev-parse", "--show-object-format")
    algorithm = out.decode().strip() if code == 0 and out.strip() else "sha1"
    found, wanted = set(), set(trees)
    for commit in commits:
        if not wanted - found:
            break
        try:
            tree = (tree_id_without(top, commit + "^{tree}", state_rel.split("/"), algorithm)
                    if not state_rel.startswith("..") else
                    git_out(top, "rev-parse", commit + "^{tree}").decode().strip())
        except (FablizeError, ValueError):
            continue
        if tree in wanted:
            found.add(tree)
    # an older engine's run trees hold the state directory as its index did: only the clone
    # that ran them has those objects, and there git compares them without it
    paths = (["--", ".", ":(exclude,literal)" + state_rel] if not state_rel.startswith("..")
             else [])
    for tree in wanted - found:
        if git(top, "cat-file", "-e", tree)[0] != 0:
            continue
        for commit in commits:
            if git(top, "diff", "--quiet", "--no-ext-diff", "--no-textconv", tree, commit,
                   *paths)[0] == 0:
                found.add(tree)
                break
    return found


def tree_id_without(top, treeish, parts, algorithm):
    """The id git would give `treeish` with the path `parts` taken out, computed from its
    listing (nothing written to the object store: a reading command writes nothing)."""
    import hashlib
    body = []
    for row in git_out(top, "ls-tree", "-z", treeish).split(b"\0"):
        if not row:
            continue
        meta, _, name = row.partition(b"\t")
        mode, kind, oid = meta.split()
        if name == parts[0].encode("utf-8", "surrogateescape"):
            if len(parts) == 1 or kind != b"tree":
                continue  # the state directory: left out
            oid = tree_id_without(top, oid.decode(), parts[1:], algorithm).encode()
        body.append(mode.lstrip(b"0") + b" " + name + b"\0" + bytes.fromhex(oid.decode()))
    data = b"".join(body)
    return hashlib.new(algorithm, b"tree %d\0" % len(data) + data).hexdigest()


def review(store, plan, scan, pin, base, opts):
    """The trust part of `audit`, from what `scan` saw during the replay: the pin, the scope and
    what the branch changed outside it, run provenance, decisions and their signatures. Raises
    exit 3 for a pin that does not hold; the gates that say no come after (gates)."""
    first = scan.first
    trust = {"base": base, "pin": None, "new_plan": False,
             "imported": bool(first and first.get("imported_from"))}
    if pin is not None:
        trust["pin"] = verify_pin(store, scan, pin)
        trust["new_plan"] = trust["pin"]["new_plan"]
    elif base is not None:
        trust["new_plan"] = True  # nothing committed at the base: all of this plan is new
    top = repo_root(store.root)
    state_rel = os.path.relpath(os.path.realpath(store.dir), top or "/").replace(os.sep, "/")
    honest = committed_trees(top, {run["tree"] for run in scan.dirty if run.get("tree")},
                             state_rel)
    for run in scan.dirty:
        why = run["why"] + ([] if run.get("tree") in honest else [
            "the working tree was dirty, and that tree was never committed"])
        if why:
            scan.flag(run["line"], run, why)
    trust["unclean_runs"], trust["runs_without_provenance"] = scan.flagged, scan.unrecorded
    trust["unclean_count"] = scan.unclean
    trust["decisions"] = scan.decisions
    last_decision = {ev["id"]: ev for ev in scan.decisions}
    trust["accepted"] = []
    for s in stories_in(plan, "accepted"):
        sig = last_decision.get(s["id"], {}).get("signature")
        trust["accepted"].append({"id": s["id"], "note": s["decision"]["note"],
                                  "signer": sig.get("signer") if isinstance(sig, dict) else None})
    trust["frozen_checks"] = [{"id": s["id"], "checks": s["checks"]} for s in plan["goals"]
                              if s.get("checks")]
    trust["check_files_changed"] = (changed_check_files(store, base["ref"], plan)
        if base is not None else [])
    trust["added_after_pin"] = ([{"id": x["id"], "title": x["title"], "checks": x.get("checks", [])}
                                 for x in scan.added]
                                if trust["pin"] and not trust["new_plan"] else [])
    scope, source = scope_of(plan, base, opts["scope"], opts.get("scope_from", "CI"))
    if opts["scope"]:  # CI's own (or the policy's): judged as create judges the plan's
        check_scope(scope, store.root, plan["goals"],
                    "--scope" if source == "CI" else f"the scope of {source}")
    trust["scope"] = {"patterns": scope, "from": source}
    tree = trust["tree"] = (tree_plan(store, plan, base, opts) if opts["rerun"] or (
        opts["fail_to_pass"] or opts["require_fail_to_pass"] or opts["forbid_out_of_scope"]
        or opts["forbid_tripwires"]) else None)
    agent = tree["agent_tests"] if tree else []
    trust["agent_test_files"] = agent
    # a base test whose xfail marks the branch takes out is no change outside the scope where
    # the re-run runs its stricter copy; else it is one, listed
    reruns = opts["rerun"] or opts["fail_to_pass"] or opts["require_fail_to_pass"]
    trust["out_of_scope"] = (tree["left"] + ([] if opts.get("agent_tests") == "prove" else agent)
                             + ([] if reruns else sorted(tree["marks_lifted"])) if tree else [])
    trust["harness"] = tree["harness"] if tree else []
    trust["shadow"] = tree["shadow"] if tree else []
    trust["tripwires"] = tripwires(tree) if tree else []
    trust["engine_inside_tree"] = engine_inside(store.root)
    policy = opts.get("policy")
    trust["policy"] = policy and {k: v for k, v in policy.items() if k != "ref"}
    trust["effective"] = effective_policy(opts)
    trust["anchor"] = anchor(store, base["ref"]) if base is not None and opts["rerun"] else None
    trust["policy_changed"] = policy_changes(store, base["ref"]) if base is not None else []
    trust["github_changes"] = github_changes(store, base["ref"]) if base is not None else []
    trust["policy_history"] = (policy_history(store, base["ref"], base["path"])
                               if base is not None and policy else None)
    ci = base is not None or os.environ.get("CI", "").lower() in ("1", "true", "yes")
    trust["warnings"] = ["the engine running this audit lies inside the tree it audits: a pull "
                         "request can change it — run a copy kept outside the tree, with "
                         "python3 -I."] if trust["engine_inside_tree"] and ci else []
    if trust["tree"] and trust["tree"]["scratch_moved"]:
        trust["warnings"].append(
            f"the temporary folder {trust['tree']['scratch_moved']} lies inside the checkout, "
            "where a test runner's upward search would find the branch's configuration: the "
            f"re-run's trees go to {trust['tree']['scratch']} instead.")
    return trust


def gates(store, plan, trust, opts):
    """Every trust gate of `audit` that says no, in the order they are checked, each with what to
    do: [{code, message, fix}] — the re-run's come after (rerun_failures). A usage mistake is
    raised at once."""
    if opts["require_unchanged_checks"] and opts["base"] is None:
        raise usage("--require-unchanged-checks compares with --base: give it too.")
    if (opts["forbid_out_of_scope"] or opts["require_fail_to_pass"]) and opts["base"] is None:
        raise usage("--forbid-out-of-scope and --require-fail-to-pass compare with --base: give it "
                    "too.")
    if opts["forbid_tripwires"] and opts["base"] is None:
        raise usage("--forbid-tripwires reads what the branch added since --base: give it too.")
    found = []
    if trust["policy_changed"]:
        found.append(failure(
            "policy_changed", "the branch changes the audit's own policy — "
            + ", ".join(map(one_line, trust["policy_changed"][:MAX_LISTED])),
            "take those changes out of the pull request: a human changes the policy and the "
            "workflow on the base branch (protect .github/ and the policy with CODEOWNERS)"))
    if trust["imported"] and trust["new_plan"] and not opts["allow_imported"]:
        found.append(failure("imported_plan", "the plan was imported from the original goals.py "
                             "format — nothing shows it was made by the engine",
                             "a human who trusts it passes --allow-imported"))
    if opts["require_scope"] and not trust["scope"]["patterns"]:
        found.append(failure(
            "no_scope", "no scope is known: the re-run would take the branch's own tests, "
            "conftest.py, tool configuration and build files",
            "declare the paths the work may change — `create --scope PATH` in the plan on the base "
            "branch, or CI's own: `--scope PATH`, FABLIZE_SCOPE, the action's `scope`"))
    if opts["require_unchanged_checks"] and trust["check_files_changed"]:
        found.append(failure(
            "check_files_changed", "frozen checks name files this branch changed since the base — "
            + ", ".join(one_line(x) for x in trust["check_files_changed"][:MAX_LISTED]),
            "take those changes out of the branch, or have a human change the checks on the base"))
    if opts["forbid_out_of_scope"] and trust["out_of_scope"]:
        agent = [p for p in trust["out_of_scope"] if p in trust["agent_test_files"]]
        found.append(failure(
            "out_of_scope", "the branch changed files outside the work's scope"
            + (" or the test harness" if trust["harness"] else "") + " — "
            + ", ".join(map(one_line, trust["out_of_scope"][:MAX_LISTED])),
            "take them out of the branch, or widen the scope "
            + widen_where(trust["scope"]["from"])
            + ("; the new test files are the agent's own: the policy on the base runs them red "
               "→ green with \"agent_tests\": \"prove\"" if agent else "")))
    if trust.get("shadow"):
        found.append(failure(
            "shadow", "files of the work are named like modules they would stand in for — "
            + ", ".join(f"{one_line(x['path'])} ({x['module']})" for x in trust["shadow"][:5]),
            "rename them: a file of the work must not take the name of a standard-library "
            "module or of a package CI installed (its tests would import the work's file)"))
    if opts.get("agent_tests") == "forbid" and trust["agent_test_files"]:
        found.append(failure(
            "agent_tests_forbidden", "the branch adds test files, and the policy forbids the "
            "agent's own tests — " + ", ".join(map(one_line, trust["agent_test_files"][:5])),
            "take them out of the branch (a human adds tests on the base), or a human sets "
            "\"agent_tests\": \"prove\" in the policy"))
    if trust["new_plan"] and not opts["allow_new_plan"]:
        base = trust["base"]
        if trust["pin"] is not None or base is None:
            why = "the plan was created after the pin (create --force or a new plan)"
        elif base.get("plan_id"):  # a shared plan's pin on the base, of another plan
            why = (f"the pin on {one_line(base['ref'])} is of plan {one_line(base['plan_id'])}: "
                   "all of this plan is new")
        else:
            why = f"{one_line(base['ref'])} holds no plan to pin it to: all of this plan is new"
        found.append(failure("new_plan", why, "review its frozen checks (listed with the pin); "
                             "--allow-new-plan (the action's allow-new-plan) accepts it"))
    final = touch(plan["goals"][-1])
    for check in opts["require_check"]:
        if check not in final["checks"]:
            found.append(failure("required_check_missing", f"the final story {final['id']} does "
                                 f"not carry the required frozen check `{one_line(check)}`",
                                 f"a plan whose final story has --verify \"{one_line(check)}\""))
    if opts["require_witnessed"]:
        gaps = witnessed_gaps(plan)
        if gaps:
            found.append(failure("not_witnessed", "not witnessed — " + "; ".join(gaps),
                                 "a story rests on a run only if the engine made it: give the "
                                 "next plan's stories frozen checks (`create --check`) or "
                                 "complete them with `checkpoint --run`; a workflow that accepts "
                                 "claimed stories drops --require-witnessed (the action's "
                                 "require-witnessed: false)"))
    if opts["require_clean_runs"] and trust["runs_without_provenance"]:
        unrecorded = count_noun(trust["runs_without_provenance"], "run")
        found.append(failure("unclean_runs", f"{unrecorded} "
                             "recorded no provenance, so they cannot be shown to be clean",
                             "run the checks again with this engine"))
    if opts["require_clean_runs"] and trust["unclean_runs"]:
        run = trust["unclean_runs"][0]
        found.append(failure("unclean_runs", f"{count_noun(trust['unclean_count'], 'run')} "
                             f"not clean — line {run['line']}: " + "; ".join(run["why"]),
                             "run the checks again from the repository root, on a committed "
                             "tree, in one environment"))
    final_id = plan["goals"][-1]["id"]
    signed = opts["allowed_signers"] is not None and any(  # its signature: bad_signature's
        x["id"] == final_id and x["signer"] for x in trust["accepted"])
    if opts["forbid_tripwires"] and trust["tripwires"] and not signed:
        first = trust["tripwires"][0]
        found.append(failure(
            "tripwire", f"the branch's code inside the scope {TRIPWIRE} "
            f"({count_noun(len(trust['tripwires']), 'line')}) — "
            f"{one_line(first['path'])}:{first['line']} {first['what']}",
            "take it out of the work; or a human reviews it and accepts the final story with a "
            f"signed decision (`decide --id {final_id} accept --note \"<why>\" --sign KEY "
            "--signer NAME`, with --allowed-signers)"))
    if opts["forbid_accepted"] and trust["accepted"]:
        found.append(failure("accepted_forbidden", "accepted by a decision, not completed — "
                             + ", ".join(x["id"] for x in trust["accepted"]),
                             "complete those stories with evidence"))
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
            found.append(failure("bad_signature", "decisions not signed by an allowed signer — "
                                 + "; ".join(f"{sid}: {why}" for sid, why in bad),
                                 "a human listed on the base signs them: `decide … --sign KEY "
                                 "--signer NAME`"))
    return found


def findings(trust, rerun=None):
    """Everything the trust room found, as Blocks in the order a reviewer reads them: the
    effective policy, where it last changed, the pin, the plan's new checks, the scope and what
    the branch changed around it, the re-run, the agent's own tests, tripwires, decisions and
    runs that are not clean. The audit's text and the job summary render these same blocks."""
    out = []
    if trust.get("anchor"):
        out.append(Block("the judge:", trust["anchor"]))
    if trust.get("effective"):
        out.append(Block("effective policy (each gate, and where it came from):",
                         [[f"{name}: {words} — {source}"] for name, words, source in
                          trust["effective"]]))
    history = trust.get("policy_history")
    if history:
        after = (" — after the plan's pin: review what it loosened" if history["after_pin"]
                 else "")
        out.append(Block("policy:", [[f"{POLICY_PATH} as the base holds it, last changed by ",
                                      code(history["commit"][:12]),
                                      f" ({one_line(history['subject'])[:80]})" + after]],
                         inline=True))
    if trust.get("github_changes"):
        out.append(Block("the branch changes .github/ (review it):",
                         [[path(p)] for p in trust["github_changes"]], inline=True))
    pin = trust["pin"]
    if pin is not None:
        where = "this ledger" if not pin["new_plan"] else f"{pin['in']} (a replaced plan)"
        out.append(Block("pin:", [[path(pin["pin"][:80]), f" found in {where}" + (
            f" — from {one_line(trust['base']['ref'])}" if trust["base"] else "")]], inline=True))
    elif trust["base"] is not None:
        out.append(Block("pin:", [[f"none — {one_line(trust['base']['ref'])} has no plan (",
                                   path(trust["base"]["path"]), "); this plan is new"]],
                         inline=True))
    for story in trust["added_after_pin"]:
        out.append(Block(f"added after the pin: {story['id']} {defused_line(story['title'])} —",
                         [[path(c)] for c in story["checks"]] or [["no frozen check"]],
                         inline=True))
        out[-1].items[-1].append(" (the re-run runs the final story's checks first)")
    if trust["new_plan"]:
        out.append(Block("new plan since the pin — its frozen checks (review what changed):",
                         [[f"{item['id']} check {i}: ", path(cmd)] for item in
                          trust["frozen_checks"] for i, cmd in enumerate(item["checks"], 1)],
                         "(none: every completion in it is claimed)"))
    if trust["check_files_changed"]:
        out.append(Block("files the frozen checks run that this branch changed since the base "
                         "(review them):", [[path(x)] for x in trust["check_files_changed"]],
                         inline=True))
    scope = trust["scope"]
    if scope["patterns"]:
        out.append(Block(f"scope ({one_line(scope['from'])}):",
                         [[path(p)] for p in scope["patterns"]], inline=True))
    if trust["out_of_scope"]:
        out.append(Block(f"the branch changed {count_noun(len(trust['out_of_scope']), 'file')} "
                         "outside the scope, which the re-run did not take (review them):",
                         [[path(p)] for p in trust["out_of_scope"]], inline=True))
    if trust["harness"]:
        out.append(Block("of them inside the scope but the test harness, which always comes "
                         "from the base (conftest.py, runner and build configuration, what a "
                         "check runs):", [[path(p)] for p in trust["harness"]], inline=True))
    if trust.get("shadow"):
        out.append(Block("files of the work named like a module they would stand in for (not "
                         "taken):", [[path(x["path"]), f" ({x['module']})"]
                                     for x in trust["shadow"]], inline=True))
    if rerun is not None:
        out += rerun_blocks(trust, rerun)
    if trust["tripwires"]:
        out.append(tripwire_block(trust["tripwires"]))
    if trust["imported"]:
        out.append(Block("imported from the original goals.py: its first event is not the "
                         "engine's own", [], ""))
    for item in trust["accepted"]:
        by = f"signed by {one_line(item['signer'])}" if item["signer"] else "unsigned"
        out.append(Block(f"accepted: {item['id']} ({by}) —",
                         [[defused_line(last_chars(item["note"], 200))]], inline=True))
    for run in trust["unclean_runs"][:MAX_LISTED]:
        out.append(Block(f"run at line {run['line']} ({one_line(run['id'])}",
                         [[code(run["cmd"]), "): " + "; ".join(run["why"])]], inline=True))
    if trust["runs_without_provenance"]:
        out.append(Block(f"{count_noun(trust['runs_without_provenance'], 'run')} recorded no "
                         "provenance (an older engine's, or written by hand)", [], ""))
    if trust["unclean_count"] > MAX_LISTED:
        out.append(Block(f"… and {count_noun(trust['unclean_count'] - MAX_LISTED, 'more run')} "
                         "not clean (all of them under --json)", [], ""))
    return out


def lines(trust, rerun=None):
    """What audit says of the trust report, a line each."""
    out = []
    for block in findings(trust, rerun):
        out += block_lines(block)
    return out


def check_parts(r):
    """One re-run check, as the reviewer reads it: what ran, what its runner said, and against
    the base's run how its tests fared. A held-out check is never named."""
    mark = "✓ " if r["ok"] else "✗ "
    if r["held_out"]:
        return [f"{mark}held-out check {r['check']} → " + ("passed" if r["ok"] else "failed")]
    parts = [f"{mark}{r['id']} check {r['check']} ", code(r["cmd"]), f" → {r['result']}"]
    base, cmp = r.get("base"), r.get("compare")
    if base is not None:
        parts.append(f"; on the base alone: {base['result']}")
    if cmp is not None:
        if cmp.get("whole"):
            parts.append(" — it failed on the base, and passes with the work")
        else:
            said = [f"{cmp['fixed_count']} fixed (failed on the base, pass now)"] if \
                cmp["fixed_count"] else []
            said += cmp["words"]
            if said:
                parts.append(" — " + "; ".join(said))
    return parts


def rerun_blocks(trust, rerun):
    """The re-run as Blocks: where it ran, a line a check (a failed one's output tail beneath
    it), its isolation, the held-out checks, the agent's own tests, the base tests changed."""
    tree = trust.get("tree")
    checks = rerun["checks"]
    if rerun["where"] == "checkout":
        where = "here, in the checkout"
    else:
        where = (f"on {one_line(tree['base'])}'s tree with the branch's files inside the scope "
                 f"({count_noun(len(tree['take']), 'file')} taken), each test compared with its "
                 "run on the base's tree alone")
    items = []
    for r in checks:
        items.append(check_parts(r))
        if not r["held_out"] and r["tail"]:  # a failure's last 8 lines, a pass's last 2
            lines = last_chars(r["tail"], 300).rstrip("\n").split("\n")
            items += [[tail(x)] for x in lines[-8 if not r["ok"] else -2:]]
    out = [Block(f"re-run: {count_noun(len(checks), 'frozen check')}, {where}, recorded "
                 "nowhere:", items)]
    if rerun["where"] == "checkout":
        out.append(Block("(no scope known: the checks ran on the branch's own tests and tools)",
                         [], ""))
    out.append(Block("isolation:", [[rerun["isolation"]]], inline=True))
    if rerun["held_out"]:
        passed = sum(1 for r in checks if r["held_out"] and r["ok"])
        out.append(Block(f"held-out checks: {rerun['held_out']} ran, {passed} passed (what they "
                         "are is CI's own)", [], ""))
    agent = rerun.get("agent_tests")
    if agent is not None:
        items = [["proven red → green: ", path(t)] for t in agent["proven"]]
        items += [["passes on the base too — proves nothing: ", path(t)] for t in agent["not_red"]]
        items += [["does not pass on the branch's code: ", path(t)] for t in agent["not_green"]]
        items += [["run by no frozen check: ", path(f)] for f in agent["unrun"]]
        out.append(Block(f"agent-written tests: {len(agent['proven'])} proven red → green — "
                         "review what they test:", items))
    if rerun.get("tests_changed"):
        out.append(Block("base tests the branch changes (the re-run ran the base's):",
                         [[path(p)] for p in rerun["tests_changed"]], inline=True))
    if rerun.get("marks_lifted"):
        out.append(Block("base tests whose xfail marks the branch takes out (the re-run ran the "
                         "branch's copy: each test must pass now):",
                         [[path(p)] for p in rerun["marks_lifted"]], inline=True))
    exit_only = sorted({r["cmd"] for r in checks if not r["held_out"] and r["report"] is None})
    out.append(Block("what this verdict cannot see (inherent — review the diff):", [
        ["code inside a test's own process can rewrite its runner's report"],
        ["code can tell its judge from a laptop (CI's variables, the scratch tree, no .git "
         "above it) and behave there"]] + [
        ["judged by its exit code only (no runner the engine reads): ", code(c)]
        for c in exit_only]))
    return out


def grades(plan, rerun):
    """Each story's grade for the reviewer: claimed, witnessed, accepted — re-witnessed when every
    frozen check of it passed again in this re-run."""
    passed = {}
    for r in (rerun or {}).get("checks", ()):
        if not r["held_out"]:
            passed[r["id"]] = passed.get(r["id"], True) and r["ok"]
    return {s["id"]: "re-witnessed" if passed.get(s["id"]) else
            (s.get("grade") or ("not done" if s["status"] not in DONE else "claimed"))
            for s in plan["goals"]}


def summary(verdict, failures, report_md, trust=None, rerun=None, story_grades=None):
    """The Markdown of a CI job summary, opening with the verdict: every failed gate with what to
    do, the effective policy, each story's grade, the re-run check by check and everything else
    the audit found (findings: the same blocks as its text), then the report."""
    md = [f"## {verdict}", ""]
    md += gate_lines(failures, md=True)
    if failures:
        md.append("")
    blocks = findings(trust, rerun) if trust is not None else []
    while blocks and blocks[0].title.startswith(("the judge", "effective policy")):
        md += block_lines(blocks.pop(0), md=True)  # where the judge and its rules came from
    if story_grades and len(story_grades) <= GRADES_EACH:
        md += ["| Story | Grade |", "|---|---|"]
        md += [f"| {sid} | {grade} |" for sid, grade in story_grades.items()]
        md.append("")
    elif story_grades:  # a long plan: a row a grade (the report below has a row a story)
        md += ["| Grade | Stories |", "|---|---:|"]
        md += [f"| {grade} | {len(ids):,}{few_ids(ids)} |"
               for grade, ids in grade_groups(story_grades)]
        md.append("")
    for block in blocks:
        md += block_lines(block, md=True)
    md.append(report_md)
    return "\n".join(md)
