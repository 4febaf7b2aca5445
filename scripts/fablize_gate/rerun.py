"""CI's re-run, the trust room's witness the agent cannot write: every frozen check run again in
trees of its own outside the checkout, on the base's code and on the branch's, and the two runs
compared test by test from the runners' own reports (reports.py).

- The base's tree: the base commit's files, bytes and modes as committed (never `git archive`,
  whose export rules would drop or rewrite files).
- The branch's tree: the base's, with the branch's files inside the scope taken over — never a
  test, the harness (conftest.py, runner and build configuration, what git reads from the tree,
  what a check runs), an artefact, or a file named like a module it would shadow.
- The agent's own tests (test files the branch adds) run in trees of their own, never beside the
  base's tests: on the base's code each must fail, on the branch's each must pass.
- Held-out checks the policy names run like required checks; what they are is never said.

A check passes when, on the branch's tree, its exit code and its runner's report agree and every
test the base's run ran still runs and passes — those that passed still pass (PASS_TO_PASS),
those that failed now pass (FAIL_TO_PASS); a test skipped on the base may stay skipped.

Interface (for the trust room and `audit`):
  Isolation.choose(user)   how the checks run beside the auditor, said in one line
  rerun(store, plan, trust, opts, timeout)    the re-run (a dict), recording nothing
  failures(result, opts)   every gate of the re-run that says no: [{code, message, fix}]
"""

import os
import re
import shutil
import tempfile

from .base import count_noun, one_line, refused, usage
from .model import is_final, run_passed, run_result, touch
from .reports import BROKEN, compare, PASSED, XFAILED
from .runs import read_objects, run_command, tree_entries
from .storage import within

MAX_IDS = 20                # test ids kept per finding: a failing suite of 5,000 names a few
# never taken from the branch into the re-run's tree, whatever the scope: bytecode, compiled
# objects, and installed-package metadata (a *.dist-info entry point loads a pytest plugin)
ARTEFACT = (r"(^|/)(__pycache__|[^/]+\.(egg-info|dist-info))(/|$)"
            r"|\.(pyc|pyo|pyd|so|dylib|dll|o|a|class|jar|whl|egg|pth)$")
# the files that configure or extend a test run, never taken from the branch whatever the scope
# says (issue 34): a conftest.py at any depth, the runners' and build tools' configuration (pytest
# reads pytest.toml first), the interpreter's start-up hooks, a module that shadows a runner under
# `python -m`, and what git itself reads from the tree (.gitattributes: a `-diff` would make git
# print no lines). The base's own runner names the rest (rerun.classify).
HARNESS = (r"(^|/)(conftest\.py|pytest\.ini|\.?pytest\.toml|pyproject\.toml|setup\.cfg|setup\.py"
           r"|tox\.ini|noxfile\.py|sitecustomize\.py|usercustomize\.py|pytest\.py|unittest\.py"
           r"|[Mm]akefile|GNUmakefile|[^/]*\.mk|package\.json|\.npmrc|\.yarnrc(\.yml)?"
           r"|(jest|vitest|vite|babel|mocha|karma|ava)\.config\.[^/]*|\.babelrc[^/]*"
           r"|\.mocharc[^/]*|\.coveragerc|\.pytest\.ini|\.cargo/config(\.toml)?"
           r"|\.gitattributes|\.gitmodules"
           # what builds a check before it runs: cargo's manifest and build script, go's and
           # TypeScript's configuration, the toolchains they pin, the lockfiles they read
           r"|Cargo\.toml|Cargo\.lock|build\.rs|rust-toolchain(\.toml)?|go\.mod|go\.sum|go\.work"
           r"|tsconfig[^/]*\.json|jsconfig\.json|package-lock\.json|yarn\.lock|pnpm-lock\.yaml)\Z"
           r"|(^|/)\.cargo/")

# the names of test modules whatever runs them (the runners' own reports name the rest): pytest's
# defaults (its doctest files too: test*.txt, collected beside the tests), Django's tests.py,
# Go's and JavaScript's conventions
TEST_MODULE = re.compile(r"(^|/)(test_[^/]*\.py|[^/]*_tests?\.py|tests?\.py|[^/]*_test\.go"
                         r"|[^/]*\.(test|spec)\.[cm]?[jt]sx?|test[^/]*\.txt)\Z")
# unittest's discovery imports every module named test*.py (its default pattern): where a check
# runs unittest, those are test modules too (only there: a package's testing.py is code to pytest)
UNITTEST_MODULE = re.compile(r"(^|/)test[^/]*\.py\Z")
# the folders that hold tests and what they read — their helpers, data, snapshots, Rust's tests/:
# every file under one is the base's test material, whatever it is named
TEST_DIR = re.compile(r"(^|/)(tests?|__tests__|spec|testdata|__snapshots__|fixtures)/")


def test_module(path, runners=()):
    """Whether `path` is named as a test module of one of the checks' `runners` (or of any)."""
    return bool(TEST_MODULE.search(path) or ("unittest" in runners
                                             and UNITTEST_MODULE.search(path)))


def test_material(path, runners=()):
    """Whether `path` is a test or what tests read (by name: the base's runner names the rest),
    for checks that run `runners`."""
    return bool(test_module(path, runners) or TEST_DIR.search(path))


# Beside the auditor, with fewer rights ###########################################################


class Isolation:
    """How the re-run's checks run beside the auditor. As root with --check-user, as that user:
    they can neither trace nor signal the auditor, nor write what it writes. Always, where the
    kernel offers it: the auditor is not dumpable (no process of its user may trace it or read its
    memory) and neither it nor anything it starts gains privileges (no new privileges: sudo and
    setuid programs do nothing) — a check cannot attach to its judge and force a verdict."""

    def __init__(self, user=None):
        self.user = user
        self.guarded = []       # what prepare() achieved, in words
        self.home = self.own = None
        self.reaper = False
        self.homes = []

    def end_strays(self):
        """Every process a check left that escaped its group (a daemon, `setsid`): reparented
        to the auditor, a subreaper, and ended — nothing of one check lives into the next, or
        past the audit."""
        if not self.reaper:
            return
        import signal
        me = str(os.getpid())
        for _ in range(100):  # a stray's own children come back to us as it ends
            strays = []
            for entry in os.listdir("/proc"):
                if entry.isdigit() and entry != me:
                    fields = _read_small(f"/proc/{entry}/stat").rsplit(")", 1)[-1].split()
                    if len(fields) > 1 and fields[1] == me:
                        strays.append(int(entry))
            if not strays:
                return
            for pid in strays:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (OSError, ChildProcessError):
                    pass

    @classmethod
    def choose(cls, name):
        if not name:
            return cls()
        import pwd
        if "\x00" in name:
            raise usage("--check-user: a name cannot hold a NUL byte.", "check_user")
        try:
            user = pwd.getpwnam(name)
        except KeyError:
            raise usage(f"--check-user {one_line(name)}: no such user here — create one without "
                        "sudo rights (useradd --system NAME) or leave --check-user out.",
                        "check_user")
        if user.pw_uid == 0:
            raise usage(f"--check-user {one_line(name)} is root: checks must run with fewer "
                        "rights than the auditor.", "check_user")
        if os.geteuid() != 0:
            raise usage("--check-user starts each check as that user, which only root can: run "
                        "the audit as root (sudo) or leave --check-user out.", "check_user")
        return cls(user)

    def prepare(self):
        """The auditor out of reach, before the first check runs."""
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            prctl = libc.prctl
        except (OSError, AttributeError, ImportError):
            return
        if prctl(4, 0, 0, 0, 0) == 0:          # PR_SET_DUMPABLE: 0
            self.guarded.append("the auditor cannot be traced or read")
        if prctl(38, 1, 0, 0, 0) == 0:         # PR_SET_NO_NEW_PRIVS
            self.guarded.append("no check gains privileges (sudo does nothing)")
        if prctl(36, 1, 0, 0, 0) == 0:         # PR_SET_CHILD_SUBREAPER: a daemon a check left
            self.reaper = True                 # comes back to the auditor, which ends it
            self.guarded.append("what a check leaves running is ended after it")

    def scratch(self, wanted):
        """Where the re-run's trees go: `wanted`, unless a check user could not reach it (a
        folder on the way it may not enter) — then a folder of the re-run's own in /tmp, which
        `close` removes."""
        if self.user is None:
            return wanted
        folder = os.path.realpath(wanted)
        while folder != os.path.dirname(folder):
            try:
                if not os.stat(folder).st_mode & 0o001:
                    break
            except OSError:
                break
            folder = os.path.dirname(folder)
        else:
            return wanted
        self.own = tempfile.mkdtemp(prefix="fablize-rerun-", dir="/tmp")
        os.chmod(self.own, 0o711)
        return self.own

    def fresh_home(self, scratch):
        """A home of a check's own, made new for each run (HOME, TMPDIR in it): nothing a check
        writes under its home — a user-site .pth, a tool's config — is read by the next, or by
        the next audit on the same runner. The toolchains found under the real home stay
        found (RUSTUP_HOME, CARGO_HOME)."""
        home = tempfile.mkdtemp(prefix="fablize-home-", dir=scratch)
        os.mkdir(os.path.join(home, "tmp"))
        self.homes.append(home)
        if self.user is not None:
            self.give(home)
        env = {"HOME": home, "TMPDIR": os.path.join(home, "tmp")}
        for name, folder in (("RUSTUP_HOME", "~/.rustup"), ("CARGO_HOME", "~/.cargo")):
            real = os.path.expanduser(folder)
            if name not in os.environ and os.path.isdir(real):
                env[name] = real
        return env

    def popen(self, scratch):
        """What subprocess.Popen is given to start a check (with --check-user: as that user,
        in a home of its own)."""
        if self.user is None:
            return {}
        if self.home is None:
            self.home = tempfile.mkdtemp(prefix="fablize-check-home-", dir=scratch)
            os.chmod(self.home, 0o700)
            self.give(self.home)
        env = dict(os.environ, HOME=self.home, USER=self.user.pw_name,
                   LOGNAME=self.user.pw_name)
        return {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": [],
                "env": env}

    def give(self, path, keep=()):
        """`path` (a tree, a report folder) made the check user's, so it can write there — but
        for `keep` (paths below it: the base's tests and harness) and the folders that hold
        them, which stay the auditor's, and which the check may read, not change."""
        if self.user is None:
            return
        kept = {os.path.join(path, *p.split("/")) for p in keep}
        held = {os.path.dirname(p) for p in kept}
        for p in list(held):
            while p.startswith(path) and p != os.path.dirname(path):
                held.add(p)
                p = os.path.dirname(p)
        for folder, dirs, files in os.walk(path):
            for name in [folder] + [os.path.join(folder, x) for x in dirs + files]:
                if name in kept or name in held:
                    continue
                try:
                    os.lchown(name, self.user.pw_uid, self.user.pw_gid)
                except OSError:
                    pass

    def words(self):
        """The isolation the re-run had, in one sentence (the log and the job summary say it)."""
        yama = _read_small("/proc/sys/kernel/yama/ptrace_scope").strip()
        if self.user is not None:
            who = f"the checks ran as {self.user.pw_name}, not as the auditor"
            rest = self.guarded
        elif hasattr(os, "geteuid") and os.geteuid() == 0:
            return ("the checks shared the auditor's user, root, and its rights: nothing kept "
                    "them from tracing or signalling it (--check-user runs them as another user)")
        else:
            who = "the checks shared the auditor's user and its rights"
            rest = self.guarded + ([f"ptrace limited to descendants (Yama {yama})"]
                                   if yama in ("1", "2", "3") else [])
        if not self.guarded and self.user is None:
            return who + ": nothing kept them from tracing or signalling it (no isolation here)"
        return who + ("; " + "; ".join(rest) if rest else "")

    def shared(self):
        return self.user is None and (not self.guarded or (hasattr(os, "geteuid")
                                                           and os.geteuid() == 0))


def _read_small(path):
    try:
        with open(path) as f:
            return f.read(100)
    except OSError:
        return ""


# The trees ########################################################################################


class Trees:
    """The re-run's trees: each a fresh folder outside the checkout, removed after its run."""

    def __init__(self, tree, isolation, scratch):
        self.tree, self.isolation, self.scratch = tree, isolation, scratch
        top = tree["top"]
        self.base = tree_entries(top, tree["base"])
        kept = [path for path, deleted in tree["take"] if not deleted]
        kept += list(tree.get("marks_lifted") or ())
        self.head = tree_entries(top, "HEAD", kept) if kept else {}
        agent = tree.get("agent_tests") or []
        self.agent = tree_entries(top, "HEAD", agent) if agent else {}
        self.blobs = read_objects(top, [oid for _, oid in list(self.base.values())
                                        + list(self.head.values()) + list(self.agent.values())])

    def entries(self, code, tests, lifted=False):
        """{path: (mode, oid)} of a tree: `code` "base" or "branch" (the base's, with the files
        the scope takes); `tests` "base" (as the base holds them) or "agent" (the base's test
        files taken out, the agent's new ones put in); `lifted`: the branch's copies of the base
        tests whose xfail marks it takes out (marks_lifted), else the base's."""
        entries = dict(self.base)
        if code == "branch":
            for path, deleted in self.tree["take"]:
                entries.pop(path, None)
                for other in [p for p in entries if p.startswith(path + "/")]:
                    del entries[other]  # a folder the branch turned into a file
                if not deleted and path in self.head:
                    entries[path] = self.head[path]
            for path in (self.tree.get("marks_lifted") or ()) if lifted else ():
                entries[path] = self.head[path]  # the stricter copy
        if tests == "agent":
            for path in self.tree.get("base_test_modules") or ():
                entries.pop(path, None)
            entries.update(self.agent)
        return entries

    def protected(self, code, tests, lifted=False):
        """{path: object id} of the files of a tree the checks must not change: the base's tests
        and harness, as the base holds them (and the lifted copies, in a lifted run)."""
        entries = self.entries(code, tests, lifted)
        keep = set(self.tree.get("base_tests") or ()) | set(self.tree.get("harness") or ())
        lifted = set(self.tree.get("marks_lifted") or ())
        return {p: v[1] for p, v in entries.items()
                if (self.base.get(p) == v and (p in keep or re.search(HARNESS, p)))
                or (p in lifted and self.head.get(p) == v)}

    def tampered(self, folder, protected):
        """The protected files a run changed, removed or replaced in its tree."""
        changed = []
        for path, oid in sorted(protected.items()):
            target = os.path.join(folder, *path.split("/"))
            try:
                if os.path.islink(target):
                    raise OSError
                with open(target, "rb") as f:
                    same = f.read(len(self.blobs.get(oid, b"")) + 1) == self.blobs.get(oid)
            except OSError:
                same = False
            if not same:
                changed.append(path)
        return changed

    def build(self, code="branch", tests="base", lifted=False):
        folder = tempfile.mkdtemp(prefix="fablize-rerun-", dir=self.scratch)
        try:
            write_tree(folder, self.entries(code, tests, lifted), self.blobs)
            self.isolation.give(folder, self.protected(code, tests, lifted)
                                if code == "branch" else ())
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder


def write_tree(folder, entries, blobs):
    """Each (path → mode, oid) written into `folder`: a file with its bytes and its executable
    bit; a symlink only where it stays inside the tree — each alone, then all together (a chain
    of links that each stay inside can climb out: `a/up → ..`, `x → a/up/..`); a path no folder
    can hold (a file where a folder should be) skipped."""
    for path in sorted(entries):
        mode, oid = entries[path]
        data = blobs.get(oid)
        parts = path.split("/")
        if data is None or any(p in ("", ".", "..") for p in parts):
            continue
        target = os.path.join(folder, *parts)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        except OSError:  # a parent is a file of this tree (it cannot hold both)
            continue
        if mode == "120000":
            link = data.decode("utf-8", "surrogateescape")
            if not os.path.isabs(link) and not os.path.normpath(
                    os.path.join(os.path.dirname(path), link)).startswith(".."):
                os.symlink(link, target)
            continue
        with open(target, "wb") as f:
            f.write(data)
        os.chmod(target, 0o755 if mode == "100755" else 0o644)
    real = os.path.realpath(folder)
    for path in sorted(entries):
        target = os.path.join(folder, *path.split("/"))
        if os.path.islink(target) and not within(os.path.realpath(target), real):
            os.unlink(target)


# The runs #########################################################################################


class Check:
    """One command the re-run runs: a frozen check of a story, or a held-out check."""

    def __init__(self, sid, number, cmd, final=False, required=False, held_out=False):
        self.sid, self.number, self.cmd = sid, number, cmd
        self.final, self.required, self.held_out = final, required, held_out

    def label(self):
        return (f"held-out check {self.number}" if self.held_out
                else f"{self.sid} check {self.number}")


def checks_in(plan, opts, held_out):
    """The checks to run, in order: the held-out ones and those CI requires first, then the final
    story's others, then (with --rerun all) every other story's."""
    which = opts["rerun"] or "final"  # fail-to-pass alone: the final story's
    stories = plan["goals"][-1:] + (plan["goals"][:-1] if which == "all" else [])
    stories = [touch(story) for story in stories if story.get("checks")]
    final = stories[0] if stories and is_final(plan, stories[0]) else None
    first = [Check(None, n, cmd, final=True, required=True, held_out=True)
             for n, cmd in enumerate(held_out, 1)]
    rest = []
    for story in stories:
        for i, cmd in enumerate(story["checks"]):
            required = story is final and cmd in opts["require_check"]
            (first if required else rest).append(
                Check(story["id"], i + 1, cmd, final=story is final, required=required))
    return first + rest


# What a runner looks for in the folders above the one it starts in — its configuration and
# what that configuration loads (pytest's inifile and the conftest.py beside it, cargo's
# .cargo/config.toml in every folder above, go's module and workspace files, node's packages):
# a file of these names that appears above the re-run's trees while it runs was written by a
# check, for the next one to read
LOOKED_UP = re.compile(r"(pytest|\.pytest)\.(ini|toml)|pyproject\.toml|tox\.ini|setup\.(cfg|py)"
                       r"|conftest\.py|\.cargo|Cargo\.toml|go\.(mod|work)|package\.json"
                       r"|node_modules|(jest|vite|vitest|babel)\.config\.\w+|\.babelrc\Z",
                       re.A)


class Above:
    """The folders above the re-run's trees, as they were when it began: its own folder (which
    holds only what the engine makes there, each `fablize-…`) and every folder above that, up to
    /, with the files of the names a runner looks up (LOOKED_UP). `planted()`, after each run:
    what a check wrote there, taken away before the next run reads it."""

    def __init__(self, own):
        self.own = own
        self.folders = []
        folder = os.path.dirname(own)
        while True:
            self.folders.append((folder, self.looked_up(folder)))
            if folder == os.path.dirname(folder):
                break
            folder = os.path.dirname(folder)

    @staticmethod
    def looked_up(folder):
        found = {}
        try:
            with os.scandir(folder) as entries:
                for e in entries:
                    if LOOKED_UP.fullmatch(e.name):
                        st = e.stat(follow_symlinks=False)
                        found[e.name] = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            pass
        return found

    def planted(self):
        """[path] written above the trees since the re-run began, each removed."""
        found = []
        try:
            found += [os.path.join(self.own, n) for n in os.listdir(self.own)
                      if not n.startswith("fablize-")]
        except OSError:
            pass
        for folder, before in self.folders:
            now = self.looked_up(folder)
            found += [os.path.join(folder, n) for n in now if before.get(n) != now[n]]
        for path in found:
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except OSError:
                pass  # not the auditor's to remove: said all the same
        return found


class Runner:
    """Runs commands in fresh trees (or the checkout), each once a kind of tree: a command two
    stories freeze runs once, and says so for both."""

    def __init__(self, store, trees, isolation, timeout, scratch, hidden):
        self.store, self.trees, self.isolation = store, trees, isolation
        self.timeout, self.hidden = timeout, hidden
        self.logs = tempfile.mkdtemp(prefix="fablize-rerun-logs-", dir=scratch)
        self.scratch = scratch
        self.above = Above(scratch)
        self.planted = []  # [(what ran, path)]: written above the trees by a check
        self.memo = {}

    def run(self, cmd, code="branch", tests="base", trace=False, lifted=False):
        """{record, report (reports.Report or None), root} of `cmd` on a tree of that kind."""
        key = (cmd, code, tests, trace, lifted)
        if key in self.memo:
            return self.memo[key]
        folder = None if self.trees is None else self.trees.build(code, tests, lifted)
        try:
            top = self.store.root if folder is None else folder
            root = top if folder is None else os.path.join(folder, self.trees.tree["root"])
            log = os.path.join(self.logs, f"{len(self.memo)}.log")
            popen = self.isolation.popen(self.scratch)
            env = dict(popen.get("env") or os.environ)
            for name in self.hidden:  # a check never sees what the held-out checks are
                env.pop(name, None)
            popen["env"] = dict(env, **self.isolation.fresh_home(self.scratch))
            record, report = run_command(cmd, root, self.timeout, None, log, popen=popen,
                                         trace=trace, detail=True, owner=self.isolation.user,
                                         reports=self.scratch, top=top)
            known = self.trees.entries(code, tests, lifted) if self.trees is not None else {}
            # the branch's code ran: the base's tests and harness must be as they were
            tampered = (self.trees.tampered(folder, self.trees.protected(code, tests, lifted))
                        if folder is not None and code == "branch" else [])
            self.memo[key] = {"record": record, "report": report, "top": top,
                              "files": test_files(report, top, known), "tampered": tampered,
                              "harness": traced_harness(log, top) if trace else set()}
        finally:
            self.isolation.end_strays()
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            self.planted += [((cmd, code, tests), path) for path in self.above.planted()]
        return self.memo[key]

    def close(self):
        shutil.rmtree(self.logs, ignore_errors=True)
        for folder in [self.isolation.home, self.isolation.own] + self.isolation.homes:
            if folder:
                shutil.rmtree(folder, ignore_errors=True)


_PLUGIN = re.compile(r"^PLUGIN registered: <module '[\w.]+' from '(.+)'>$", re.M)


def traced_harness(log, top):
    """The files inside the tree that pytest loaded as plugins (conftest.py files, `-p` modules)
    by its own word (--trace-config): harness, whatever they are named."""
    try:
        with open(log, "rb") as f:
            text = f.read(8 << 20).decode("utf-8", "replace")
    except OSError:
        return set()
    found = set()
    real = os.path.realpath(top)
    for path in _PLUGIN.findall(text):
        for base in (top, real):
            if within(path, base):
                found.add(os.path.relpath(path, base).replace(os.sep, "/"))
    return found


def test_files(report, top, known):
    """{test id: repository path} of the tests a report names in a test module: the file as
    the runner named it (reports name none for a doctest or a unit test inside the code), found
    in the tree that ran (`known`: its paths) by its path from the tree's top, or as the end of
    one path there."""
    if report is None:
        return {}
    found, cache = {}, {}
    for test_id, file in report.files.items():
        if not file:
            continue
        if os.path.isabs(file):
            file = os.path.relpath(file, top) if within(file, top) else None
        if not file:
            continue
        file = file.replace(os.sep, "/")
        while file.startswith("./"):
            file = file[2:]
        if file not in cache:
            hits = [p for p in known if p == file or p.endswith("/" + file)]
            cache[file] = hits[0] if len(hits) == 1 else (file if file in known or not known
                                                          else None)
        if cache[file]:
            found[test_id] = cache[file]
    return found


def rerun(store, plan, trust, opts, timeout):
    """The frozen checks (and the policy's held-out checks) run again by CI, recording nothing:
    the re-witnessed grade. With a scope and a base, each check runs on the base's tree and on the
    branch's, each in a fresh tree of its own, and the two reports are compared test by test;
    the agent's own test files, under `agent_tests: prove`, run red → green apart. Without a
    scope, in the checkout, judged by their own report alone."""
    tree = trust["tree"]
    held_out, hidden = held_out_checks(opts)  # a job that set none fails before anything runs
    isolation = opts.get("isolation") or Isolation.choose(opts.get("check_user"))
    isolation.prepare()
    checks = checks_in(plan, opts, held_out)
    # a folder of the re-run's own, above its trees: what a check writes beside them is seen
    # (Above), and none of it outlives the re-run
    scratch = tempfile.mkdtemp(prefix="fablize-rerun-", dir=isolation.scratch(
        tree["scratch"] if tree is not None else tempfile.gettempdir()))
    os.chmod(scratch, 0o711 if isolation.user is not None else 0o700)
    trees = Trees(tree, isolation, scratch) if tree is not None else None
    runner = Runner(store, trees, isolation, timeout, scratch, hidden)
    taken = [path for path, deleted in tree["take"] if not deleted] if tree else []
    result = {"where": "checkout" if tree is None else "tree", "checks": [],
              "isolation": isolation.words(), "shared": isolation.shared(),
              "held_out": len(held_out), "agent_tests": None, "tests_changed": [],
              "marks_lifted": sorted(tree["marks_lifted"]) if tree else []}
    try:
        if tree is not None:
            base_runs = {c.cmd: runner.run(c.cmd, code="base", trace=True) for c in checks}
            classify(tree, trees, base_runs.values())
            result["tests_changed"] = tree["tests_changed"]
        lifts = tree["marks_lifted"] if tree is not None else {}
        for c in checks:
            branch = runner.run(c.cmd)
            base = base_runs[c.cmd] if tree is not None else None
            lifted = runner.run(c.cmd, lifted=True) if lifts else None
            result["checks"].append(judged(c, branch, base, taken, lifted, lifts))
        if tree is not None and opts.get("agent_tests") == "prove" and tree["agent_tests"]:
            result["agent_tests"] = agent_tests(runner, [c for c in checks if c.final
                                                         and not c.held_out],
                                                tree["agent_tests"], base_runs)
    finally:
        runner.close()
        shutil.rmtree(scratch, ignore_errors=True)
    result["planted"] = [{"after": f"`{one_line(cmd)}` on the {code}'s code" + (
        " with the agent's tests" if tests == "agent" else ""), "path": path}
        for (cmd, code, tests), path in runner.planted]
    return result


def held_out_checks(opts):
    """(the held-out checks' commands, the variables that hold them): the policy names the
    variable CI fills from outside the repository (a secret, another repository, an artifact);
    one command a line."""
    name = opts.get("held_out_checks")
    if not name:
        return [], []
    value = os.environ.get(name, "")
    commands = [line.strip() for line in value.splitlines() if line.strip()]
    if not commands:
        raise refused(f"the policy names held-out checks in ${name}, and CI set none: a human "
                      f"makes the job fill {name} (from a secret, another repository or an "
                      "artifact) before the audit runs.", "held_out_missing")
    return commands, [name]


def only_marks_lifted(base, head):
    """The tests whose marks `head` lifts — [[class or None, test or None]] — when it is `base`
    (a Python file's bytes) with lines taken out and nothing else, those lines whole xfail
    marks of tests (xfail_marks): a base test the work fixes, its expected failure lifted.
    Else [] (falsy). Lines as Python counts them (a form feed or U+2028 ends none); a file
    Python would not read as UTF-8, or that does not parse here, lifts nothing."""
    try:
        old, new = python_lines(base), python_lines(head)
    except (TypeError, ValueError, SyntaxError):  # no blob, not UTF-8, another encoding
        return []
    if len(new) >= len(old):
        return []
    i, gone = 0, set()
    for number, line in enumerate(old, 1):  # `new` is `old` less some lines
        if i < len(new) and new[i] == line:
            i += 1
        else:
            gone.add(number)
    if i != len(new):
        return []
    marks = [(span, test) for span, test in xfail_marks(base) if span & gone]
    spans = [span for span, _ in marks] + unused_import(base, head)  # `import pytest`, unused
    if not marks or not all(span <= gone for span in spans if span & gone) or \
            not gone <= set().union(*spans):
        return []
    return [list(t) for t in dict.fromkeys(test for _, test in marks)]


def unused_import(base, head):
    """[the lines of `base`'s top-level `import pytest`] when `head` names pytest nowhere: a
    linter asks for its removal once the last mark goes, and importing it does nothing under
    pytest, which has."""
    import ast
    try:
        old, new = ast.parse(base), ast.parse(head)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    if any(isinstance(n, ast.Name) and n.id == "pytest" for n in ast.walk(new)):
        return []
    return [set(range(n.lineno, n.end_lineno + 1)) for n in old.body
            if isinstance(n, ast.Import) and [(a.name, a.asname) for a in n.names]
            == [("pytest", None)]]


def python_lines(data):
    """`data`'s lines, each with its end, as Python's tokenizer splits them (\\n, \\r\\n,
    \\r), decoded as Python would: UTF-8 (with or without its BOM) or refused."""
    import io
    import tokenize
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    if encoding not in ("utf-8", "utf-8-sig"):
        raise ValueError(encoding)
    return re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$", data.decode("utf-8-sig"))


def xfail_marks(data):
    """[(set of line numbers, (class or None, test or None))] of each xfail mark of a test in
    `data` (a Python file): a decorator `pytest.mark.xfail` (or `mark.xfail`, `mark` imported
    from pytest) whose arguments are keywords with literal values (`strict`, `reason`; `raises`
    an exception's name — never `run=False`: a test its base never ran proves nothing), on a
    test function or class pytest collects by default — `test*` at the top or in a `Test*`
    class (or a unittest TestCase, whatever its name), such a class at the top — never a
    helper, nor a function inside a test. What else
    may read a test's marks (another test, a hook) is judged where they stand: every test but
    the lifted ones from a run with the base's copy (Runner.run's `lifted`). Nothing where it
    does not parse here."""
    import ast
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    bare = any(isinstance(node, ast.ImportFrom) and node.module == "pytest" and any(
        n.name == "mark" and n.asname in (None, "mark") for n in node.names)
        for node in tree.body)

    def is_xfail(d):
        call = d if isinstance(d, ast.Call) else None
        target = call.func if call else d
        named = (isinstance(target, ast.Attribute) and target.attr == "xfail"
                 and isinstance(target.value, ast.Attribute) and target.value.attr == "mark"
                 and isinstance(target.value.value, ast.Name)
                 and target.value.value.id == "pytest") or (
            bare and isinstance(target, ast.Attribute) and target.attr == "xfail"
            and isinstance(target.value, ast.Name) and target.value.id == "mark")
        if not named or call is None:
            return named
        return not call.args and all(
            (k.arg in ("strict", "reason") and isinstance(k.value, ast.Constant)) or (
                k.arg == "raises" and isinstance(k.value, (ast.Name, ast.Attribute)))
            for k in call.keywords)

    tests = []  # (node, (class, test))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.name.startswith("test"):
            tests.append((node, (None, node.name)))
        elif isinstance(node, ast.ClassDef) and (node.name.startswith("Test") or any(
                (b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")).endswith(
                    "TestCase") for b in node.bases)):
            tests.append((node, (node.name, None)))
            tests += [(m, (node.name, m.name)) for m in node.body
                      if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and m.name.startswith("test")]
    return [(set(range(d.lineno, d.end_lineno + 1)), test) for node, test in tests
            for d in node.decorator_list if is_xfail(d)]


def classify(tree, trees, base_runs):
    """What the base's runner said of its own files, added to the scope's lists: the test modules
    it ran and the plugins it loaded are the base's, even inside the scope — a branch change to
    one is taken out of the branch's tree (a test or harness file) and, for a test, listed as a
    change to a base test. The list names the rest."""
    named, harness = set(), set()
    for run in base_runs:
        named |= set(run["files"].values())
        harness |= run["harness"]
    runners = tree.get("runners", ())
    listed = {p for p in trees.base if test_material(p, runners)}
    base_tests = (named | listed) - harness
    tree["base_tests"] = sorted(base_tests)
    # what the agent's trees leave out: the base's test modules only — never the helpers, data
    # or packages (tests/__init__.py) the agent's own tests may need beside them
    tree["base_test_modules"] = sorted((named | {p for p in trees.base
                                                 if test_module(p, runners)}) - harness)
    changed = {path for path, _ in tree["take"]} | set(tree["left"])
    tree["tests_changed"] = sorted(p for p in changed if p in base_tests)
    moved = [(p, d) for p, d in tree["take"] if p in base_tests or p in harness]
    if moved:
        tree["take"] = [x for x in tree["take"] if x not in moved]
        tree["harness"] = sorted(set(tree["harness"]) | {p for p, _ in moved})
        tree["left"] = sorted(set(tree["left"]) | {p for p, _ in moved})


def hosted_in(report, test_id, taken):
    """The file of the work a test lives in, when it lives in one the branch changed (a doctest
    in the module it tests, a Rust unit test in src/): a test the work can rewrite proves
    nothing about it."""
    host = report.hosts.get(test_id)
    if not host:
        return None
    return next((p for p in taken if p == host or p.endswith("/" + host.lstrip("./"))), None)


def lifted_ids(run, lifts):
    """The ids of the tests a run reports whose xfail marks the branch takes out (`lifts`:
    {path: [[class or None, test or None]]}): the lifted test (any parameter of it), or every
    test of a lifted class. A test's id names its holder last before `::` (JUnit's classname:
    the module, or the class)."""
    found = set()
    for test_id, path in run["files"].items():
        holder, _, name = test_id.rpartition("::")
        name, owner = name.split("[", 1)[0], holder.rsplit(".", 1)[-1]
        module = path.rsplit("/", 1)[-1][:-3]
        if any((owner == cls if cls else owner == module) and test in (None, name)
               for cls, test in lifts.get(path, ())):
            found.add(test_id)
    return found


def with_lifted(check, branch, lifted, lifts):
    """The branch's run of `check` where its base tests' xfail marks are lifted: every test as
    the run with the base's copies reported it (what the lifted marks might change of another
    test is never read), but the lifted tests as the run with the branch's copies reported them
    — and that run must pass whole, whatever its report names (a check no runner reports on, a
    lifted test the report does not name). (run, why not) — `why` a sentence when it fails."""
    why = None
    if not run_passed(lifted["record"]):
        why = "with the branch's copies of the tests whose xfail marks it takes out, " + \
            run_result(lifted["record"])
    ids = lifted_ids(lifted, lifts)
    report, record = branch["report"], dict(branch["record"])
    unsure = sorted({f for t, f in (lifted["report"].files if lifted["report"] else {}).items()
                     if f and t not in lifted["files"] and not os.path.isabs(f)
                     and any(p.endswith("/" + f.replace(os.sep, "/").lstrip("./"))
                             for p in lifts)})
    if why is None and unsure:  # the lifted tests cannot be told apart: none is taken as one
        why = (f"the runner names {one_line(unsure[0])}, which more than one file of the tree "
               "ends with: the tests whose xfail marks the branch takes out cannot be told apart")
    if report is None or lifted["report"] is None or not ids:
        return branch, why  # judged as the base's copies ran, the other run passing whole
    from .reports import Report, FAILED, ERROR
    # each lifted test must pass there: a test the code under test skips or xfails at run time
    # was expected to fail on the base, so the comparison alone would ask nothing of it
    short = sorted(t for t in ids if any(o != PASSED for o in lifted["report"].tests[t]))
    if why is None and short:
        why = (f"{count_noun(len(short), 'test')} whose xfail mark the branch takes out "
               f"{'does' if len(short) == 1 else 'do'} not pass with the branch's copy ("
               + ", ".join(one_line(t)[:60] for t in short[:3]) + ")")
    merged = Report(report.runners, report.roots)
    for name in ("files", "hosts", "missing", "problems", "per_test", "extra"):
        setattr(merged, name, getattr(report, name))
    merged.tests = {t: (lifted["report"].tests.get(t, outcomes) if t in ids else outcomes)
                    for t, outcomes in report.tests.items()}
    failing = {t for t, outcomes in report.tests.items()
               if any(o in (FAILED, ERROR) for o in outcomes)}
    if why is None and record.get("exit_code") == 1 and failing and failing <= ids and \
            not record.get("timed_out") and not record.get("error") and \
            not record.get("interrupted"):
        # the run with the base's copies failed on lifted tests alone (a strict xfail that
        # passes: pytest's exit 1): they are judged by the other run, which passed whole
        record.update(exit_code=0, report=lifted["record"].get("report"))
    return dict(branch, record=record, report=merged), why


def judged(check, branch, base, taken=(), lifted=None, lifts=None):
    """One check's result: its run on the branch's tree (or the checkout), and, with the base's
    run beside it, the comparison test by test. A test fixed in a file the work changed counts
    for nothing (hosted). `lifted`: the run with the branch's copies of the base tests whose
    xfail marks it takes out (with_lifted)."""
    why, lifted_set = None, set()
    if lifted is not None:
        branch, why = with_lifted(check, branch, lifted, lifts)
        lifted_set = lifted_ids(lifted, lifts)
    record, report = branch["record"], branch["report"]
    out = {"tampered": branch.get("tampered") or [], "id": check.sid, "check": check.number,
           "cmd": check.cmd if not check.held_out else None, "held_out": check.held_out,
           "on": "checkout" if base is None else "tree",
           "final": check.final, "required": check.required, "result": run_result(record),
           "tail": record["tail"] if not check.held_out else "",
           "report": record.get("report"), "passed": run_passed(record),
           "base": None, "compare": None}
    out["tampered"] += (lifted or {}).get("tampered") or []
    if why:
        out["passed"], out["result"] = False, why
    out["ok"] = out["passed"] and not out["tampered"]
    if base is not None:
        brecord, breport = base["record"], base["report"]
        out["base"] = {"result": run_result(brecord), "passed": run_passed(brecord),
                       "report": brecord.get("report")}
        if breport is not None and report is not None and breport.per_test and report.per_test:
            cmp = compare(breport, report)
            hosted = [t for t in cmp.fixed if hosted_in(breport, t, taken)]
            # a lifted test fixes something only where it ran and failed on the base (XFAIL): a
            # strict one that passed there (XPASS) passes on the base's code without its mark
            stale = [t for t in cmp.fixed if t in lifted_set
                     and any(o != XFAILED for o in breport.tests.get(t, ()))]
            cmp.fixed = [t for t in cmp.fixed if t not in hosted and t not in stale]
            out["compare"] = {k: getattr(cmp, k)[:MAX_IDS] for k in
                              ("fixed", "still_failing", "broken", "vanished")}
            out["compare"].update({f"{k}_count": len(getattr(cmp, k)) for k in
                                   ("fixed", "still_failing", "broken", "vanished", "new")})
            out["compare"]["words"] = cmp.words() + ([
                f"{count_noun(len(hosted), 'test')} fixed inside a file the work "
                f"changes count for nothing ({', '.join(one_line(t)[:60] for t in hosted[:3])}: a "
                "doctest, a unit test inside the code)"] if hosted else []) + ([
                f"{count_noun(len(stale), 'test')} whose xfail mark the branch takes out "
                f"passed on the base already ({', '.join(one_line(t)[:60] for t in stale[:3])}): "
                "no fix of the work"] if stale else [])
            out["compare"]["hosted"] = hosted[:MAX_IDS]
            out["ok"] = out["passed"] and cmp.ok() and not out["tampered"]
        elif not out["base"]["passed"] and out["passed"]:
            out["compare"] = {"fixed": [], "fixed_count": 1, "words": [], "whole": True}
    return out


def agent_tests(runner, checks, files, base_runs):
    """The agent's own test files, run by the final story's checks apart from the base's tests:
    on the base's code each test must fail (red), on the branch's it must pass (green).
    {files, proven, not_red (passed on the base: proves nothing), not_green, unrun (files no
    check ran)}."""
    files = set(files)
    red, green, red_files, seen = {}, {}, set(), set()
    for c in checks:
        base_report = base_runs[c.cmd]["report"]
        base_ids = set(base_report.tests) if base_report else set()
        for code, into in (("base", red), ("branch", green)):
            run = runner.run(c.cmd, code=code, tests="agent")
            if run["report"] is None:
                continue
            for test_id, outcomes in run["report"].tests.items():
                file = run["files"].get(test_id)
                if file in files or (file is None and test_id not in base_ids):
                    into.setdefault(test_id, []).extend(outcomes)
                    if file and code == "branch":
                        seen.add(file)
                    if file and code == "base" and all(o in BROKEN for o in outcomes):
                        red_files.add((file, test_id))
    # a file that did not load on the base's code (an import of what the work adds) failed whole
    broken_files = {file for file, test_id in red_files if test_id not in green}
    proven, not_red, not_green = [], [], []
    for test_id, outcomes in sorted(green.items()):
        file = next((f for f, t in red_files if t == test_id), None)
        before = red.get(test_id)
        if not all(o == PASSED for o in outcomes):
            not_green.append(test_id)
        elif (any(o in BROKEN for o in before) if before is not None else
              runner_file(runner, test_id, file) in broken_files):
            proven.append(test_id)
        else:
            not_red.append(test_id)
    # a test that ran on the base's code and not on the branch's (a file-level error entry, an
    # id without `::`, stands for its file's tests, which the green run names one by one)
    not_green += sorted(t for t in red if t not in green and "::" in t)
    return {"files": sorted(files), "proven": proven, "not_red": not_red,
            "not_green": not_green,
            "unrun": sorted(f for f in files - seen if TEST_MODULE.search(f))}


def runner_file(runner, test_id, known):
    """The repository file a test of the green run came from."""
    if known:
        return known
    for run in runner.memo.values():
        if test_id in run["files"]:
            return run["files"][test_id]
    return None


# Its gates ########################################################################################


def failure(code, message, fix):
    """A gate that says no: its stable code, why, and what to do."""
    return {"code": code, "message": message, "fix": fix}



def failures(result, opts):
    """The re-run's gates: a check that fails on the branch's tree, or whose tests fare worse
    than on the base's; a change to a base test; with fail-to-pass, a final story none of whose
    tests failed on the base and pass now (nor, under `agent_tests: prove`, one of the agent's
    own, proven red → green); the agent's own tests failing, or forbidden."""
    found = []
    for r in result["checks"]:
        what = ("held-out check " + str(r["check"]) if r["held_out"] else
                f"{r['id']} check {r['check']} `{one_line(r['cmd'])}`")
        if r.get("tampered"):
            found.append(failure(
                "tests_tampered", f"re-run — {what}: the check changed the base's tests or "
                "harness while it ran (" + ", ".join(map(one_line, r["tampered"][:5])) + ")",
                "the work's code must leave the tests alone: what a check reads is the base's"))
        elif not r["passed"]:
            found.append(failure(
                "rerun_failed", f"re-run failed — {what}: " + (r["result"] if not r["held_out"]
                                                               else "it failed"),
                "fix the work so that the frozen check passes; the re-run is CI's own"
                if not r["held_out"] else "the held-out check is CI's own: fix the work, not "
                "the check (a reviewer can read its output in CI's own logs)"))
        elif not r["ok"]:
            found.append(failure(
                "tests_not_passing", f"re-run — {what}: " + (
                    "; ".join(r["compare"]["words"]) if not r["held_out"] else
                    "tests that ran on the base do not pass now"),
                "every test the base's run ran must still run and pass with the work: a test "
                "skipped, expected to fail or gone where it passed or failed on the base proves "
                "nothing"))
    if result.get("planted"):
        first = result["planted"][0]
        found.append(failure(
            "tests_tampered", "re-run — a check wrote above its tree, where the next check's "
            "runner looks for its configuration: " + ", ".join(
                one_line(p["path"]) for p in result["planted"][:5]) + f" (after {first['after']})",
            "the work's code must not write outside its tree: what a check reads is the base's "
            "(the files were removed before the next check ran)"))
    if result["tests_changed"]:
        found.append(failure(
            "base_test_changed", "the branch changes tests the base holds — "
            + ", ".join(map(one_line, result["tests_changed"][:10])),
            "take those changes out of the branch: the base's tests judge the work; a new test "
            "goes in a new file (the agent's own tests, run red → green with agent_tests: "
            "prove)"))
    agent = result["agent_tests"]
    if agent and agent["not_green"]:
        found.append(failure(
            "agent_tests_failed", f"{count_noun(len(agent['not_green']), 'agent-written test')} "
            "do not pass on the branch's code — " + ", ".join(
                one_line(x)[:80] for x in agent["not_green"][:5]),
            "fix the work (or the new test) until it passes"))
    if opts.get("require_fail_to_pass") or opts.get("fail_to_pass"):
        final = [r for r in result["checks"] if r["final"]]
        fixed = sum((r["compare"] or {}).get("fixed_count", 0) for r in final if r["ok"])
        proven = len(agent["proven"]) if agent else 0
        if final and not fixed and not proven and opts.get("require_fail_to_pass"):
            carried = (" nor did an agent-written test prove red → green"
                       if opts.get("agent_tests") == "prove" else "")
            found.append(failure(
                "vacuous_check", "no test of the final story's checks failed on the base and "
                "passes with the work" + carried + ": they prove nothing about this work",
                "a human freezes a check with a test that fails before the work and passes after "
                "it" + ("" if opts.get("agent_tests") == "prove" else
                        ", or the policy lets the agent's own tests carry it (agent_tests: "
                        "\"prove\")")))
    return found
