"""The one place processes start: git and the other tools the engine runs, the checks it runs
itself (run_command), their provenance, and which checks cannot be verified here.
"""

import os
import re
import stat
import time

from .base import (
    blank, clean, damaged, FablizeError, fix_argv_text, INFLIGHT, NOT_THERE, now_iso, one_line,
    quote_arg, READ_CHUNK, refused, regex, RUNS, _sha256, sha256_hex, TAIL_CHARS)
from .masking import mask, mask_places, Masker
from .model import run_outcome, run_result
from .reports import ask as ask_reports, read as read_reports, recorded, shell_segments
from .storage import (
    crash_point, ensure_subdir, from_here, fsync_dir, open_state_file, PROC, proc_stat,
    process_alive, repo_root, within, write_all, write_atomic)


# One policy for every program the engine and its rooms start (git, ssh-keygen, a shell for
# doctor): one timeout, never a prompt for credentials, a missing program or a timeout as one
# line. Like git-filter-repo's GitUtils: nothing else calls subprocess for a tool.
TOOL_TIMEOUT = 120.0


def run_tool(argv, cwd=None, data=None, what=None, timeout=TOOL_TIMEOUT, shell=False, env=None):
    """(exit code, stdout bytes, stderr text) of a program; `data` is its stdin (else none),
    `env` variables it gets besides this process's."""
    import subprocess
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", GIT_ASKPASS="", SSH_ASKPASS="", **(env or {}))
    name = argv.split()[0] if shell else argv[0]
    try:
        p = subprocess.run(argv, cwd=cwd, input=data, capture_output=True, timeout=timeout,
                           env=env, shell=shell,
                           stdin=subprocess.DEVNULL if data is None else None)
    except FileNotFoundError:
        raise refused(f"{name} is not installed (or not on PATH): {what or name} needs it.",
                      "tool_missing")
    except subprocess.TimeoutExpired:
        raise damaged(f"{name} took more than {timeout:g} s ({what or name}).", "tool_timeout")
    except (OSError, ValueError) as e:  # ValueError: a NUL in an argument
        raise damaged(f"{name} failed to run: {one_line(e)}", "io_error")
    return p.returncode, p.stdout, p.stderr.decode("utf-8", "replace").strip()


def git(root, *args, data=None, what=None, env=None, timeout=None):
    """(exit code, stdout bytes, stderr text) of git in the repository at `root`: every git
    process of the engine starts here (`timeout`: another than run_tool's)."""
    return run_tool(["git", "-C", root, *args], data=data, what=what or "this command", env=env,
                    **({} if timeout is None else {"timeout": timeout}))


def git_out(root, *args, data=None, what=None, env=None, repair=False):
    """git's stdout; a failure is damage, with git's own reason (git_failed)."""
    code, out, err = git(root, *args, data=data, what=what, env=env)
    if code != 0:
        raise git_failed(args, err, root if repair else None)
    return out


def git_failed(args, err, repair=None):
    """The damage of the git command `args` that failed, in git's own words. `repair`: the
    repository whose failure is its own damage (a shared plan's clone), named with its repair."""
    name = next(a for a in args if not a.startswith("-") and "=" not in a)
    said = f"git {name} failed: {one_line(err)[:300]}"
    if repair is None:
        return damaged(said, "git_failed")
    return damaged(f"{said} — the repository at {one_line(repair)} is broken or its disk is full: "
                   "a human repairs it (`git fsck` says what is broken), then runs the command "
                   "again.", "git_failed")


# Git read as data (issue 40): NUL-separated listings, objects fetched by their id, never a diff's
# text — so neither the user's configuration (diff.noprefix, diff.mnemonicPrefix, external diffs,
# textconv), nor a `.gitattributes` in the tree (`*.py -diff`), nor a file name (a newline, a
# tab, a quote, non-ASCII) changes what is read.
LITERAL = {"GIT_LITERAL_PATHSPECS": "1"}  # a file named `:!tests` is a file, not a pathspec


def tree_entries(top, rev, paths=()):
    """{path: (mode, object id)} of the files and links `rev` holds (under the literal `paths`,
    every one when none; a submodule's commit is no file)."""
    out = git_out(top, "ls-tree", "-r", "-z", "--full-tree", rev, "--", *paths, env=LITERAL)
    entries = {}
    for row in out.split(b"\0"):
        if row:
            meta, _, name = row.partition(b"\t")
            mode, kind, oid = meta.split()
            if kind == b"blob":
                entries[name.decode("utf-8", "surrogateescape")] = (mode.decode(), oid.decode())
    return entries


def cat_objects(root, names, what=None, repair=False):
    """[(object id, bytes), or None where there is no such object] of each name (an object id,
    `rev`, `rev:path`), through one `git cat-file --batch`: the engine's one reader of git
    objects (a failure as git_out's)."""
    if not names:
        return []
    out = git_out(root, "cat-file", "--batch", data="".join(n + "\n" for n in names).encode(),
                  what=what, repair=repair)
    found, pos = [], 0
    for _ in names:
        end = out.index(b"\n", pos)
        header, pos = out[pos:end].split(), end + 1
        if header[-1] in (b"missing", b"ambiguous"):  # nothing follows
            found.append(None)
            continue
        size = int(header[2])
        found.append((header[0].decode(), out[pos:pos + size]))
        pos += size + 1
    return found


def read_objects(top, oids):
    """{object id: its bytes} of each blob there is (asked by id: hex, one a line, whatever the
    files are named)."""
    wanted = list(dict.fromkeys(oids))
    return {oid: got[1] for oid, got in zip(wanted, cat_objects(top, wanted)) if got}


def changed_paths(top, base, head="HEAD"):
    """[(path, status letter)] of what `head` changed since `base` (A, M, D, T; renames as a
    deletion and an addition), whatever the user's diff settings."""
    out = git_out(top, "diff", "--name-status", "-z", "--no-renames", "--no-ext-diff",
                  "--no-textconv", "--no-relative", base, head, "--", env=LITERAL)
    fields = out.split(b"\0")
    return [(path.decode("utf-8", "surrogateescape"), status.decode()[:1])
            for status, path in zip(fields[0::2], fields[1::2]) if path]


def committed_copy(store, names, whole=False):
    """[`git checkout HEAD -- …`] of the state files `names` (or, `whole`, of the state
    directory) when git holds them as last committed and what is here differs — the way back
    to them, as runnable from where the user stands — else [] (no repository, never committed,
    the same as committed, or no git)."""
    top = repo_root(store.root)
    if top is None or not os.path.lexists(os.path.join(top, ".git", "HEAD")) and os.path.isdir(
            os.path.join(top, ".git")):  # no repository there (an empty .git): no git started
        return []
    paths = [store.path(name) for name in names]
    try:  # outside a repository `git diff` compares files (--no-index): HEAD's first
        if git(store.root, "rev-parse", "--verify", "--quiet", "HEAD")[0] != 0:
            return []
        if git(store.root, "diff", "--quiet", "--no-ext-diff", "--no-textconv", "HEAD", "--",
               *paths)[0] != 1:
            return []
    except FablizeError:
        return []
    end = "/" if whole else ""
    targets = [store.dir] if whole else paths
    if within(os.path.realpath("."), os.path.realpath(store.root)):  # inside: as typed there
        return ["git checkout HEAD -- " + " ".join(quote_arg(from_here(p) + end)
                                                  for p in targets)]
    return [f"git -C {quote_arg(store.root)} checkout HEAD -- " + " ".join(
        quote_arg(os.path.relpath(p, store.root) + end) for p in targets)]


def repo_relative(path):
    """`path` relative to its repository ("." at the top), or None outside one."""
    top = repo_root(path)
    return (None if top is None else
        os.path.relpath(os.path.realpath(path), top).replace(os.sep, "/"))


def git_state(root, state_dir):
    """(HEAD, dirty, tree) of the repository at `root` as a run starts: the commit, whether the
    working tree differs from it, and the id of the tree the working tree holds (what `git add
    -A` would commit, through an index of its own, the state directory taken out). The tree lets
    audit tell a run made before its exact tree was committed — an honest run — from one made
    on a tree that never was. (None, None, None) outside a repository."""
    import shutil
    import tempfile
    try:
        code, out, _ = git(root, "rev-parse", "HEAD", "--git-path", "index")
        if code != 0:
            return None, None, None
        head, index = out.decode("utf-8", "surrogateescape").split("\n")[:2]
        rel = os.path.relpath(state_dir, root).replace(os.sep, "/")
        paths = [".", ":(exclude,literal)" + rel] if not rel.startswith("..") else ["."]
        with tempfile.TemporaryDirectory(prefix="fablize-index-") as tmp:
            own = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
            try:  # the index's stat cache: a big tree is not hashed anew
                shutil.copyfile(os.path.join(root, index), own["GIT_INDEX_FILE"])
            except OSError:
                pass
            if git(root, "add", "-A", "--", *paths, env=own)[0] != 0:
                return head, None, None
            # the state directory out of the tree too (the index holds it as committed): the
            # tree is then the work alone, which CI can compute from a commit by itself
            if not rel.startswith("..") and git(root, "rm", "-r", "--cached", "-q",
                                                "--ignore-unmatch", "--", rel,
                                                env=dict(own, **LITERAL))[0] != 0:
                return head, None, None
            code, out, _ = git(root, "write-tree", env=own)
        tree = out.decode().strip() if code == 0 else None
        dirty = git(root, "diff", "--quiet", "--no-ext-diff", "--no-textconv", head, tree,
                            "--", *paths)[0] != 0 if tree else None
    except FablizeError:
        return None, None, None
    return head, dirty, tree


def tree_state(root, state_dir):
    """(sha256, file count) of the working tree at `root`: every tracked and untracked file
    (git's ignore rules apply), by name, mode and content; the state directory is left out.
    Outside git, every file under `root` but .git/ and the state directory."""
    top = repo_root(root)
    names, ignored = None, []
    if top is not None:
        code, out, _ = git(root, "ls-files", "-z", "--cached", "--others",
                           "--exclude-per-directory=.gitignore", "--full-name", what="judge-packet")
        if code == 0:
            names = sorted(set(os.path.join(top, n.decode("utf-8", "surrogateescape"))
                               for n in out.split(b"\0") if n))
            # what .gitignore files hide counts by name (a new ignored file, or a .gitignore
            # that hides itself, changes the tree too); folders once, not file by file
            code, out, _ = git(root, "ls-files", "-z", "--others", "--ignored",
                               "--exclude-per-directory=.gitignore", "--directory", "--full-name",
                               what="judge-packet")
            ignored = sorted(n.decode("utf-8", "surrogateescape") for n in out.split(b"\0")
                             if n) if code == 0 else []
    if names is None:
        names = []
        for d, subdirs, files in os.walk(root):
            subdirs[:] = [x for x in subdirs if x != ".git"
                          and os.path.join(d, x) != state_dir]
            names += [os.path.join(d, f) for f in files]
        names.sort()
    digest, count = _sha256(), 0
    state = os.path.join(os.path.abspath(state_dir), "")
    for name in ignored if top is not None and names is not None else []:
        if not os.path.join(top, name).startswith(state) and name != ".git/":
            digest.update(f"ignored:{name}\n".encode("utf-8", "surrogateescape"))
    for path in names:
        if path.startswith(state):  # by its own path: a symlink into it is a file of the tree
            continue
        try:
            st = os.lstat(path)
        except OSError:
            entry = "missing"
        else:
            if stat.S_ISLNK(st.st_mode):
                entry = "link:" + os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                entry = f"{st.st_mode & 0o111:o}:{file_sha256(path)}"
            else:
                entry = "other"
        rel = os.path.relpath(path, root)
        digest.update(f"{rel}\0{entry}\n".encode("utf-8", "surrogateescape"))
        count += 1
    return digest.hexdigest(), count


# variables that change what a witnessed command does, recorded with each run (a hint)
WITNESS_ENV = ("PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH",
               "PYTHONNOUSERSITE", "PYTHONUSERBASE", "LD_PRELOAD", "LD_LIBRARY_PATH",
               "DYLD_INSERT_LIBRARIES", "DYLD_LIBRARY_PATH", "MAKEFLAGS", "MAKEFILES",
               "BASH_ENV", "ENV", "NODE_OPTIONS", "NODE_PATH", "PERL5OPT", "RUBYOPT")


def command_program(cmd, root):
    """The program a shell command line starts first, or None (a builtin, a variable, a line
    that does not parse, a program that is nowhere)."""
    try:
        programs = command_programs(cmd, root)
    except ValueError:
        return None
    return programs[0][1] or None if programs else None


def file_sha256(path):
    digest = _sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def witness_env():
    """The listed variables that are set, each by its name and a digest of its value: what the
    audit compares between runs, and nothing that tells anyone what the value was."""
    return {name: "sha256:" + sha256_hex(fix_argv_text(os.environ[name]).encode("utf-8"))[:16]
            for name in WITNESS_ENV if name in os.environ}


def run_provenance(root, cmd):
    """Where and with what a witnessed run ran, as a plan may publish it: the folder relative to
    the repository, the program by its name and the digest of its file, the environment by
    names and digests — a hint for the reviewer (an agent with a shell can still lie about its
    environment; only a re-witnessed run is proof)."""
    program = command_program(cmd, root)
    return {"dir": repo_relative(root), "program": program and os.path.basename(program),
            "program_sha256": file_sha256(program) if program else None, "env": witness_env()}


_SHELL_BUILTINS = frozenset(
    "! : . [ [[ alias bg break builtin case cd command continue declare do done echo elif else "
    "esac eval exec exit export false fi for function getopts hash if in let local printf pwd "
    "read readonly return set shift source test then time times trap true type ulimit umask "
    "unalias unset until wait while { }".split())
_PREFIX_WORDS = frozenset("! { if then elif else while until do exec time command builtin "
                          "nohup env".split())


def command_programs(cmd, root):
    """[(word, its path)] for each program a shell command line starts (the first word, and the
    first after each `;`, `&&`, `|`, …, past `VAR=value`, `exec`, `time`, `if`, …), found as the
    shell would find it (PATH, or a path relative to `root`): None when it is nowhere, "" for a
    builtin or a program named by a variable (nothing to look up). The one program finder: a
    check that cannot run, a run's provenance and doctor's interpreter all read it. Raises
    ValueError for a line the shell could not parse either."""
    import shutil
    found = []
    for segment in shell_segments(cmd):  # the one shell lexer (reports)
        token = next((word for word, _, _ in segment if word not in _PREFIX_WORDS
                      and not regex(r"[A-Za-z_]\w*=.*", re.S | re.A).fullmatch(word)), None)
        if token is None:
            continue
        if token in _SHELL_BUILTINS or "$" in token or "`" in token:
            found.append((token, ""))
        elif "/" in token:
            path = os.path.abspath(token if os.path.isabs(token) else os.path.join(root, token))
            found.append((token, path if os.path.exists(path) else None))
        else:
            where = shutil.which(token)
            found.append((token, os.path.abspath(where) if where else None))
    return found


def unverifiable_reason(cmd, root):
    """Why `cmd` cannot run here (a program not found), or None if it looks runnable."""
    try:
        programs = command_programs(cmd, root)
    except ValueError as e:
        return f"cannot parse the command ({e})"
    for word, path in programs:
        if path is None:
            return f"{word}{NOT_THERE}" if "/" in word else f"{word} is not on PATH"
    return None


def unverifiable_checks(stories, root):
    found = []
    for story in stories:
        for i, cmd in enumerate(story.get("checks", [])):
            reason = unverifiable_reason(cmd, root)
            if reason:
                found.append({"id": story["id"], "check": i, "cmd": cmd, "reason": reason})
    return found


def kill_group(proc):
    import signal
    try:
        if os.name == "nt":  # no process groups: taskkill ends the whole tree under the shell
            import subprocess
            try:
                subprocess.run(["taskkill", "/F", "/T", "/PID", str(proc.pid)],
                               capture_output=True, stdin=subprocess.DEVNULL, timeout=30)
            except subprocess.SubprocessError:
                pass
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


class RunInterrupted(BaseException):
    """A stop signal during a run (not an Exception: no handler may swallow it)."""


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP while a user's command runs: the first one stops the run (its
    whole process group is killed) and is kept to be reported; nothing else is started.

    The handler never raises: it kills the group of the run being waited for, whose end ends
    the wait, and the wait then says RunInterrupted. An exception raised from a handler lands
    wherever the main thread is — inside Popen.wait, between taking its lock and the `try`
    that releases it, it left that lock held, and the engine's next wait on the run blocked
    for ever (seen once, under load, with the check's shell a zombie)."""

    NAMES = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self):
        self.got = None
        self.proc = None  # the run being waited for
        self.saved = {}

    def __enter__(self):
        import signal
        import threading
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may set handlers; the caller's stay in force
        for name in self.NAMES:
            num = getattr(signal, name, None)
            if num is not None:
                try:
                    self.saved[num] = signal.signal(num, self._handle)
                except (ValueError, OSError):
                    pass
        return self

    def _handle(self, signum, frame):
        if self.got is None:
            import signal
            self.got = signal.Signals(signum).name
            if self.proc is not None:
                kill_group(self.proc)

    def wait(self, proc, timeout):
        """proc.wait(timeout), cut short (RunInterrupted) by a stop signal, even an earlier one."""
        self.proc = proc  # from here a signal kills its group
        try:
            code = proc.wait(timeout=timeout) if self.got is None else None
        finally:
            self.proc = None
        if self.got is not None:
            raise RunInterrupted()
        return code

    def __exit__(self, *exc):
        import signal
        for num, old in self.saved.items():
            signal.signal(num, old if old is not None else signal.SIG_DFL)
        return False


# A run in flight: runs/.inflight/<pid of its group>.json while it runs, so that a run whose
# engine died (kill -9) is found — its group ended by the next command that takes the lock, and
# said by `status` meanwhile. `runs/.*` is never committed; a folder of its own keeps the look
# one listdir of a few names, however many logs runs/ holds.
#
# A number names a process only while it lives: pids (and so process groups) are reused, 32,768
# of them on a default Linux. So a note records what tells its processes from any later holder
# of their numbers — each one's start time (/proc/<pid>/stat, field 22: clock ticks since boot),
# the session, and this boot's id — and a group is ended only when it is provably the run's: its
# leader is the process the note names, started when the note says, leading its own session.
# Where /proc cannot tell (macOS, the BSDs) nothing is ever signalled: the message says how to
# end it by hand.


def process_identity(pid):
    """{start, pgid, sid, zombie} of process `pid` — its start time in clock ticks since boot,
    its process group and session — or None (no such process, or no /proc here)."""
    fields = proc_stat(pid)
    if fields is None or len(fields) < 20:
        return None
    try:
        return {"start": int(fields[19]), "pgid": int(fields[2]), "sid": int(fields[3]),
                "zombie": fields[0] in (b"Z", b"X")}
    except ValueError:
        return None


def proc_tells():
    """Whether /proc tells processes apart here (Linux); elsewhere nothing is ever signalled."""
    return os.path.isdir(f"{PROC}/self")


def boot_id():
    """This boot's id (Linux), or None: start times count from a boot, so a note of another
    boot names no process running now."""
    try:
        with open(f"{PROC}/sys/kernel/random/boot_id", "rb") as f:
            return f.read(64).decode("ascii", "replace").strip() or None
    except OSError:
        return None


def own_start():
    """This process's start time (clock ticks since boot), or None where /proc cannot tell."""
    me = process_identity(os.getpid())
    return me and me["start"]


def engine_alive(pid, start=None, boot=None):
    """Whether the engine `pid` (started at `start`, in boot `boot`, where a note says) still
    runs: a later process given its number is not it."""
    if boot is not None and boot != boot_id():
        return False
    if not process_alive(pid):
        return False
    if start is None or not proc_tells():
        return True  # nothing more can be told: alive it is
    me = process_identity(pid)
    return me is not None and me["start"] == start


def temp_log_name():
    """A temp log's name for a run of this engine: its pid and start time in the name, so that
    the next command can tell a log whose engine died (sweep_litter)."""
    start = own_start()
    return f".run-{os.getpid()}-{'x' if start is None else start}-{os.urandom(4).hex()}.log"


def new_temp_log(runs_dir):
    """Where a run's temp log goes: runs/.inflight/, beside the notes, so that what a killed
    engine leaves is found in that folder's few names, never by listing every log runs/ holds
    (2.6 ms a writing command at 5,000 logs). A file or a link where the folder goes is refused
    (its step: move it aside); Run makes the folder again if another run's end removed it,
    empty, before the log was opened."""
    return os.path.join(ensure_subdir(os.path.join(runs_dir, INFLIGHT)), temp_log_name())


def drop_temp_logs(records):
    """The temp logs of runs that will not be recorded, removed, and their folder once empty."""
    for record in records:
        path = record.get("tmp_log")
        if path and os.path.lexists(path):
            os.unlink(path)
        if path:
            forget_folder(os.path.dirname(path))


def forget_folder(folder):
    """The notes' folder, once nothing is in it (runs/ holds what a plan keeps)."""
    try:
        os.rmdir(folder)
    except OSError:  # a note or a temp log of another run is there: it stays for it
        pass


# .run-<pid>-<start or x>-<hex>.log, and .run-<pid>-<hex>.log of engines before start times
TEMP_LOG = r"\.run-(\d+)-(?:(\d+|x)-)?[0-9a-f]{8}\.log"


def note_inflight(folder, proc, cmd, story, check, log_path):
    """The run's note in `folder`, durable (written, fsynced, renamed, its folder synced) before
    the check is let go: (its path, None), or (None, why it could not be written) — the run
    then never starts."""
    path = os.path.join(folder, f"{proc.pid}.json")
    leader = process_identity(proc.pid)
    note = json_bytes({"engine": os.getpid(), "engine_start": own_start(), "boot": boot_id(),
                       "pgid": proc.pid, "leader_start": leader and leader["start"],
                       "sid": leader and leader["sid"], "id": story, "check": check,
                       "cmd": mask(cmd, command=True), "started": now_iso(),
                       "log": os.path.basename(log_path)})
    for attempt in range(20):
        try:
            made = not os.path.isdir(folder)
            ensure_subdir(folder)
            write_atomic(path, note)  # at once: an empty folder is another run's to remove
            if made:
                fsync_dir(os.path.dirname(folder))
            return path, None
        except FileNotFoundError as e:  # another run's end took the folder, empty, meanwhile
            why = log_reason(e)
        except OSError as e:  # a full disk, a read-only folder
            return None, log_reason(e)
        except FablizeError as e:  # a planted link or file where its folder goes
            return None, one_line(e.message)
    return None, why


def forget_inflight(path):
    """The note gone, and its folder with the last one."""
    try:
        os.unlink(path)
    except OSError:
        pass
    forget_folder(os.path.dirname(path))


def json_bytes(obj):
    import json
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


_NOTE_INTS = ("engine", "pgid")
_NOTE_OPTIONAL = ("engine_start", "leader_start", "sid")


def read_note(path):
    """A note's record, its numbers checked, or None when it is no note fablize wrote."""
    import json
    try:
        with open(path, "rb") as f:
            rec = json.loads(f.read(1 << 16))
        if not isinstance(rec, dict):
            return None
        for key in _NOTE_INTS:
            if type(rec.get(key)) is not int:
                return None
        for key in _NOTE_OPTIONAL:
            if rec.get(key) is not None and type(rec[key]) is not int:
                rec[key] = None  # unreadable: as if unknown, which never signals
        if not isinstance(rec.get("boot"), str):
            rec["boot"] = None
    except (OSError, ValueError):
        return None
    rec["path"] = path
    return rec


def inflight_runs(store):
    """[(record, its engine alive)] of each run noted in flight, oldest first."""
    folder = os.path.join(store.path(RUNS), INFLIGHT)
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except OSError:
        return []
    found = []
    for name in names:
        rec = read_note(os.path.join(folder, name))
        if rec is None:
            continue  # no note of a run: the next writer removes it
        found.append((rec, engine_alive(rec["engine"], rec.get("engine_start"),
                                        rec.get("boot"))))
    return found


def group_members(pgid):
    """Pids of the live processes in process group `pgid` that are in its session too (the run's
    group leads its own session), or None where /proc cannot tell."""
    if not proc_tells():
        return None
    members = []
    for entry in os.listdir(PROC):
        if not entry.isdigit():
            continue
        me = process_identity(entry)
        if me is not None and me["pgid"] == pgid and me["sid"] == pgid and not me["zombie"]:
            members.append(int(entry))
    return members


def never_signalled():
    """The process groups no note can get signalled, whatever it says: this command's own, the
    one of the command that started it, and its session's."""
    groups = {os.getpgrp(), os.getsid(0), os.getpid()}
    try:
        groups.add(os.getpgid(os.getppid()))
    except OSError:
        pass
    return groups


def processes(n):
    return f"{n} process" + ("" if n == 1 else "es")


def end_run_group(rec):
    """What became of the process group of a run whose engine died, in words: ended (SIGKILL)
    only when it is provably the run's — its leader alive with the start time and session the
    note recorded. Groups 0 and 1, this command's own and its caller's are never signalled."""
    import signal
    pgid = rec["pgid"]
    by_hand = f"`kill -9 -{pgid}` ends it if it is"
    if pgid <= 1 or pgid in never_signalled():
        return (f"its note names process group {pgid}, which is no run's ("
                + ("the system's" if pgid <= 1 else "this command's own or its caller's")
                + "): nothing was signalled")
    if not proc_tells():
        return (f"whether its process group {pgid} is still the run's cannot be told here (no "
                f"/proc): nothing was signalled — {by_hand}")
    if rec.get("boot") is not None and rec["boot"] != boot_id():
        return "the machine has restarted since: nothing of it is running"
    members = group_members(pgid) or []
    if not members:
        return "nothing of it was still running"
    leader = process_identity(pgid)
    if leader is None:
        return (f"its shell has ended, and the {processes(len(members))} left in "
                f"group {pgid} cannot be proven to be the run's: nothing was signalled — "
                f"`kill -9 -{pgid}` ends them if they are")
    if rec.get("leader_start") is None:
        return (f"its note (written by an older fablize) does not say when the run started, so "
                f"process group {pgid} cannot be proven to be the run's: nothing was signalled "
                f"— {by_hand}")
    if (leader["start"] != rec["leader_start"] or leader["pgid"] != pgid
            or leader["sid"] != pgid or rec.get("sid") not in (None, pgid)):
        return (f"process group {pgid} is no longer the run's (its number now belongs to "
                "another process): it was left alone")
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError as e:
        return f"its process group {pgid} could not be ended ({e.strerror}): {by_hand}"
    return f"what was left of it ({processes(len(members))}, group {pgid}) was ended"


def end_orphaned_runs(store):
    """Under the lock: each run noted in flight whose engine died — what is left of its process
    group ended where it is provably the run's (end_run_group), its note and temp log removed
    (the run counts for nothing), and said; then what killed engines left behind with no note
    (sweep_litter)."""
    for rec, alive in inflight_runs(store):
        if alive:
            continue
        what = f"`{one_line(str(rec.get('cmd')))}`"
        fate = end_run_group(rec)
        log = str(rec.get("log", ""))
        if re.fullmatch(TEMP_LOG, log):
            try:
                os.unlink(os.path.join(os.path.dirname(rec["path"]), log))
            except OSError:
                pass
        forget_inflight(rec["path"])
        store.warn(f"a run of {what} for {one_line(str(rec.get('id')))} was in flight when its "
                   f"engine (pid {rec['engine']}) died; {fate}. It recorded nothing: run it "
                   "again.")
    sweep_litter(store)


def sweep_litter(store):
    """What killed engines left in the notes' folder with no note of a live run: temp logs of
    runs killed before their note was written or after their run ended (a temp log's engine is
    told by its name: temp_log_name), notes torn by a kill, files no fablize wrote. One listdir
    of a few names, however many logs runs/ holds."""
    folder = os.path.join(store.path(RUNS), INFLIGHT)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        log = re.fullmatch(TEMP_LOG, name)
        temp = re.fullmatch(r"\d+\.json\.tmp-(\d+)-[0-9a-f]{8}", name)  # write_atomic's
        if log:
            gone = not engine_alive(int(log.group(1)), None if log.group(2) in (None, "x")
                                    else int(log.group(2)))
        elif temp:
            gone = not engine_alive(int(temp.group(1)))
        else:  # a note fablize wrote (read whole: written by a rename), or not one
            gone = (not name.endswith(".json") or read_note(path) is None) and os.path.lexists(
                path)  # (a note gone meanwhile: its run ended)
            if gone:
                store.warn(f"removed {RUNS}/{INFLIGHT}/{one_line(name)}, which was no note of a "
                           "run in flight.")
        if gone:
            try:
                os.unlink(path)
            except OSError:
                pass
    forget_folder(folder)


ECHO_HEAD = 16000   # characters of a run's output the terminal is shown as they come
ECHO_TAIL = 4000    # and of its end, once it is over


class Run:
    """One command the engine runs, in named steps: `start` it in a session of its own,
    `wait` for it (a timeout or a stop signal kills its whole group), then `finish`: its output,
    pumped from the pipe by a reader thread as it comes, masked (secrets) and then streamed
    (escaped) to `stream` and written whole to `log_path`; the record's size, digest and tail
    are read back from the log on disk."""

    def __init__(self, cmd, cwd, stream, log_path, story=None, check=None, popen=None,
                 trace=False, owner=None, reports=None, top=None):
        import codecs
        import threading
        self.cwd, self.stream, self.log_path = cwd, stream, log_path
        self.story, self.check = story, check  # what the in-flight note names
        self.masker = Masker(cwd)
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.log_fd, self.log_error = None, None
        for attempt in range(20):
            try:
                self.log_fd = open_state_file(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                break
            except FileNotFoundError as e:  # runs/.inflight/ removed, empty, by another run's
                self.log_error = e  # end meanwhile: made again
                folder = os.path.dirname(log_path)
                if os.path.basename(folder) != INFLIGHT:
                    break
                try:
                    ensure_subdir(folder)
                except (OSError, FablizeError):
                    break
            except OSError as e:
                self.log_error = e
                break
        if self.log_fd is not None:
            self.log_error = None
        # a child that escaped the process group may keep writing after the run is over: what
        # it writes then belongs to no run, so the reader drops it once `finished` is set
        self.guard = threading.Lock()
        self.finished = False
        self.at_start = True  # whether the next piece streamed starts a line
        # once the group is gone, what it wrote is in the pipe: the reader empties it and stops,
        # so a child that escaped the group and keeps the pipe open costs no wait (where pipes
        # can be polled; on Windows the reader waits for the end of the pipe, at most 5 s)
        self.draining = False
        # the terminal is shown the output's first ECHO_HEAD characters as they come and, once
        # the run is over, its last ECHO_TAIL, with a count of what was left out between: the log
        # keeps all of it (a 300 KB line would otherwise flood an agent's context)
        self.echoed, self.held, self.left_out = 0, "", 0
        self.started = time.monotonic()
        self.reports = None  # the report files its runners are asked for (ReportCollector)
        # CI's re-run: how the check is started beside the auditor (rerun.Isolation), whether
        # pytest says which plugins it loaded (--trace-config), whose the report folder is
        self.popen, self.trace, self.owner, self.report_dir = popen or {}, trace, owner, reports
        self.top = top  # the tree the run is in, when it runs below its top (CI's re-run)
        self.gated = False  # its note could not be written: the check was never let go
        self.record = {"cmd": cmd, "cwd": repo_relative(cwd) or ".", "exit_code": None,
                       "signal": None, "timed_out": False, "error": None}

    def take(self, masked):
        """One masked piece of output (whole lines, but for the last): to the log (until a
        write fails) with the machine's places shown as a plan may publish them, then as it is
        to the stream (the terminal is no publication: `pwd` shows where it ran)."""
        if self.log_error is None and masked:
            try:
                write_all(self.log_fd, mask_places(masked, self.cwd))
            except OSError as e:  # the run goes on; its record will say the log is short
                self.log_error = e
        if self.stream is not None and masked:
            text = clean(self.decoder.decode(masked))
            room = ECHO_HEAD - self.echoed
            if room > 0:
                self.echo(text[:room])
                self.echoed += min(room, len(text))
                text = text[room:]
            if text:
                self.held += text
                if len(self.held) > ECHO_TAIL:
                    self.left_out += len(self.held) - ECHO_TAIL
                    self.held = self.held[-ECHO_TAIL:]

    def echo(self, text):
        try:
            piece, self.at_start = quote_output(text, self.at_start)
            self.stream.write(piece)
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def echo_end(self):
        """What the terminal was not shown as it came: a count of what is left out, then the
        output's end."""
        if self.stream is None:
            return
        if self.left_out:
            self.echo(("" if self.at_start else "\n") + f"… {self.left_out:,} characters not "
                      "shown here (the run's log keeps all) …\n")
        if self.held:
            self.echo(self.held)

    def pump(self, pipe):
        """The reader thread: the pipe's output, a chunk at a time, until it ends, the run is
        over, or (draining) nothing more is there."""
        import select
        poller = select.poll() if hasattr(select, "poll") else None  # poll: no descriptor limit
        if poller is not None:
            poller.register(pipe, select.POLLIN)
        try:
            while True:
                if poller is not None and not poller.poll(0 if self.draining else 50):
                    if self.draining:
                        return
                    continue
                chunk = os.read(pipe, READ_CHUNK)
                if not chunk:
                    return
                with self.guard:
                    if self.finished:
                        return
                    self.take(self.masker.feed(chunk))
        except OSError:
            return
        finally:
            os.close(pipe)  # the reader's own descriptor: never reused under another run

    def start(self):
        """The process, in a new session (its own process group), stdout and stderr one pipe,
        each test runner it starts asked for its own report (reports.ask); None when it cannot
        start (the record says why). Where notes are kept (not Windows) it starts gated: its
        shell waits for a line on stdin before it runs anything (release), so that no check runs
        before its in-flight note is durable."""
        import subprocess
        if self.log_fd is None:
            self.record["error"] = f"its log could not be written ({log_reason(self.log_error)})"
            return None
        try:
            self.reports = ReportCollector(self.owner, self.report_dir)
            cmd = self.reports.ask(self.record["cmd"], self.trace)
            if os.name == "nt":
                return subprocess.Popen(
                    cmd, shell=True, cwd=self.cwd, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    creationflags=getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0))
            return subprocess.Popen(["/bin/sh", "-c", GATE, "sh", cmd],
                                    cwd=self.cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    **self.popen)
        except (OSError, ValueError) as e:  # ValueError: a NUL in the command
            self.record["error"] = one_line(str(e))
            return None

    def release(self, proc, why_not=None):
        """Let the gated check run; with `why_not` (its note could not be written), end the gate
        instead: its shell exits without running anything, and the record says why."""
        if proc.stdin is None:
            return
        try:
            if why_not is None:
                proc.stdin.write(b"go\n")
                proc.stdin.flush()
        except OSError:  # the shell is gone already (a stop signal): nothing runs
            pass
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass
        if why_not is not None:
            self.record["error"] = (f"it could not be noted in flight ({why_not}), so it was "
                                    "not started")
            self.gated = True

    def wait(self, proc, stop, timeout):
        """Pump its output while it runs; a timeout or a stop signal kills its group, and so
        does its end (what it left behind is part of the check); then drain the pipe."""
        import subprocess
        import threading
        reader = threading.Thread(target=self.pump, args=(os.dup(proc.stdout.fileno()),),
                                  daemon=True)
        proc.stdout.close()
        reader.start()
        try:
            code = stop.wait(proc, timeout)
        except subprocess.TimeoutExpired:
            self.record["timed_out"] = True
            kill_group(proc)
            code = proc.wait()
        except RunInterrupted:
            kill_group(proc)
            code = proc.wait()
        kill_group(proc)
        self.draining = True
        reader.join(5)
        if self.gated:
            code = None  # the gate's own exit: the check never ran
        elif code < 0:
            import signal
            try:
                self.record["signal"] = signal.Signals(-code).name
            except ValueError:
                self.record["signal"] = f"signal {-code}"
        self.record["exit_code"] = code

    def finish(self):
        """The record, once what was left of the output is written and the log read back: a
        log that could not be written whole (a full disk, a read-only folder) makes the run an
        error, and the record never claims more than the disk holds."""
        with self.guard:
            self.finished = True
            self.take(self.masker.feed(b"", final=True))
            self.echo_end()
        if self.log_fd is not None:
            try:
                os.fsync(self.log_fd)
            except OSError as e:
                self.log_error = self.log_error or e
            os.close(self.log_fd)
        size, sha, tail = (log_on_disk(self.log_path) if self.log_fd is not None
                           else (0, _sha256().hexdigest(), b""))
        record = self.record
        if self.log_error is not None and record["error"] is None:
            record["error"] = (f"its log could not be written whole "
                               f"({log_reason(self.log_error)}; {size:,} bytes kept): the run "
                               "counts for nothing")
        self.detail = (self.reports.read(self.log_path, self.cwd, self.top)
                       if self.reports is not None else None)
        record.update(duration_s=round(time.monotonic() - self.started, 3), bytes=size,
                      sha256=sha, tail=tail.decode("utf-8", "replace")[-TAIL_CHARS:],
                      report=recorded(self.detail))
        if self.stream is not None and not self.at_start:
            self.stream.write("\n")
        return record


class ReportCollector:
    """The reports a run's test runners are asked for (reports.ask), in a folder of their own
    outside the tree the check runs in. Where the platform has FIFOs each report path is one,
    read by a thread while the run lasts, so a runner started twice in one check (`pytest a &&
    pytest b`, a loop) leaves two documents where a file would keep only the last."""

    def __init__(self, owner=None, where=None):
        import tempfile
        self.folder = tempfile.mkdtemp(prefix="fablize-report-", dir=where)
        self.owner = owner  # a pwd entry: the user the check runs as, who must write here
        self.asked, self.documents, self.readers, self.done = [], {}, [], False
        if owner is not None:
            os.chown(self.folder, owner.pw_uid, owner.pw_gid)

    def ask(self, cmd, trace=False):
        """The command line to run: `cmd` with each runner asked for its report."""
        import threading
        run, self.asked = ask_reports(cmd, self.folder, trace)
        for item in self.asked:
            path = item["path"]
            if path is None:
                continue
            self.documents[path] = []
            if hasattr(os, "mkfifo"):
                os.mkfifo(path, 0o600)
                if self.owner is not None:
                    os.chown(path, self.owner.pw_uid, self.owner.pw_gid)
                reader = threading.Thread(target=self.pump, args=(path,), daemon=True)
                reader.start()
                self.readers.append((path, reader))
        return run

    def pump(self, path):
        """Each document written to the FIFO at `path`: a writer's open to its close."""
        while True:
            try:
                fd = os.open(path, os.O_RDONLY)  # blocks until a writer opens it
            except OSError:
                return
            chunks, size = [], 0
            try:
                for chunk in iter(lambda: os.read(fd, READ_CHUNK), b""):
                    if size <= REPORT_LIMIT:  # past it, read and dropped: the parse refuses it
                        chunks.append(chunk)
                    size += len(chunk)
            except OSError:
                pass
            finally:
                os.close(fd)
            if chunks:
                self.documents[path].append(b"".join(chunks))
            if self.done:
                return

    def read(self, log_path, root, top=None):
        """The Report (reports.read) once the run is over; the folder is removed."""
        import shutil
        self.done = True
        for path, reader in self.readers:
            for _ in range(100):  # a reader waiting in open() for a writer: one that writes nothing
                if not reader.is_alive():
                    break
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
                reader.join(0.05)
        for path in self.documents:
            if not self.readers and os.path.isfile(path):  # no FIFOs here: the file it wrote
                try:
                    with open(path, "rb") as f:
                        self.documents[path].append(f.read(REPORT_LIMIT + 1))
                except OSError:
                    pass
        try:
            return read_reports(self.asked, self.documents, log_path, root, top)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


REPORT_LIMIT = 64 << 20


# The gate a run's shell passes before the check (Run.start): a line on stdin, which the engine
# writes once the run's note is durable; if the engine dies first, the pipe ends and nothing runs.
# Then the check's own shell replaces it — the same pid, start time, group and session, the
# command line and exit code the check's own, stdin /dev/null as for every run.
GATE = 'read -r go || exit 125; exec /bin/sh -c "$1" </dev/null'


def run_command(cmd, cwd, timeout, stream, log_path, story=None, check=None, popen=None,
                trace=False, detail=False, owner=None, reports=None, top=None):
    """Run `cmd` through the shell in `cwd` (Run): its record (with `detail`, and its runners'
    Report). Ctrl-C, an agent's tool timeout (SIGTERM) or a closed terminal must not leave the
    command running on its own in its new session: a stop signal kills its group as a timeout
    does, and the record says so. A kill -9 of the engine cannot be answered, so the run is
    noted in flight, durably, before it may start (end_orphaned_runs ends what it left).
    `popen`, `trace`, `owner`, `reports`: CI's re-run (Run)."""
    run = Run(cmd, cwd, stream, log_path, story, check, popen, trace, owner, reports, top)
    with StopSignals() as stop:
        proc = run.start()
        if proc is not None:
            inflight = None
            if os.name != "nt":
                crash_point("before-inflight-note")  # tests: the check started, not yet noted
                folder = os.path.dirname(log_path)  # runs/.inflight/, or a re-run's own folder
                if os.path.basename(folder) != INFLIGHT:
                    folder = os.path.join(folder, INFLIGHT)
                inflight, why_not = note_inflight(folder, proc, cmd, story, check, log_path)
                run.release(proc, why_not)
            run.wait(proc, stop, timeout)
            if inflight is not None:
                forget_inflight(inflight)
    if stop.got:
        run.record["interrupted"] = stop.got
    record = run.finish()
    return (record, run.detail) if detail else record


def log_reason(error):
    return one_line(error.strerror or str(error)) if isinstance(error, OSError) else one_line(error)


def log_on_disk(path):
    """(size, sha256, last bytes) of the log as the disk holds it, read back."""
    digest = _sha256()
    size, tail = 0, b""
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(READ_CHUNK), b""):
                digest.update(chunk)
                size += len(chunk)
                tail = (tail + chunk)[-4 * TAIL_CHARS:]
    except OSError:
        pass
    return size, digest.hexdigest(), tail


OUTPUT_BAR = "  │ "


def quote_output(text, at_start):
    """A command's streamed output, every line behind a bar, so that no line it prints can
    pass for the engine's own; returns the text and whether the next chunk starts a line."""
    if not text:
        return "", at_start
    quoted = (OUTPUT_BAR if at_start else "") + text.replace("\n", "\n" + OUTPUT_BAR)
    if text.endswith("\n"):
        return quoted[:-len(OUTPUT_BAR)], True
    return quoted, False


def verification_runs(story, verify_cmd, run):
    """What verifying `story` runs — [(frozen check index, or None for --verify-cmd, command)] —
    and what to say of a --verify-cmd that does not run: a story's frozen checks run whenever it
    has any, and only they count; without them, --verify-cmd runs when `run` asks for it."""
    if story["checks"]:
        note = (None if blank(verify_cmd) or verify_cmd in story["checks"] else
            f"{story['id']} has frozen checks: they run instead of --verify-cmd "
            f"`{one_line(verify_cmd)}`.")
        return list(enumerate(story["checks"])), note
    return ([(None, verify_cmd)] if run and not blank(verify_cmd) else []), None


def execute_runs(store, sid, commands, after_seq, timeout, out):
    """Run each (check index, command) of story `sid` outside the lock, saying on `out` (an
    Output) when each starts and ends; returns records ready to commit."""
    runs_dir = ensure_subdir(store.path(RUNS))
    head, dirty, tree = git_state(store.root, store.dir)
    records = []
    for check, cmd in commands:
        label = f"frozen check {check + 1}" if check is not None else "verification"
        out.progress(f"fablize: running {label} for {sid} in {store.root}: {one_line(cmd)}")
        tmp_log = new_temp_log(runs_dir)
        started = now_iso()
        record = run_command(cmd, store.root, timeout, out.stream(), tmp_log, sid, check)
        record.update(cmd=mask(cmd, command=True), id=sid, check=check, after_seq=after_seq,
                      started=started, git_head=head, git_dirty=dirty, tmp_log=tmp_log,
                      provenance=run_provenance(store.root, cmd))
        if tree:
            record["tree"] = tree
        outcome = run_outcome(record)
        out.progress(f"fablize: {label} {run_result(record)}" if outcome == "interrupted" else
                     f"fablize: {label} {'passed' if outcome == 'passed' else 'FAILED'} — "
                     f"{run_result(record)}")
        records.append(record)
        if record.get("interrupted"):
            break  # a stop signal stops the whole command, not just this run
    return records


def commit_runs(session, records):
    """Append verify_run events, naming each log runs/<seq>-<id>.log."""
    committed = []
    for record in records:
        tmp_log = record.pop("tmp_log")
        seq = session.plan["ledger"]["seq"] + 1
        log_rel = f"{RUNS}/{seq}-{record['id']}.log"
        if os.path.lexists(tmp_log):  # none when it could not be made: the run is an error
            os.replace(tmp_log, session.store.path(log_rel))
            fsync_dir(session.store.path(RUNS))  # the log is there before the record names it
        forget_folder(os.path.dirname(tmp_log))
        record["log"] = log_rel
        committed.append(session.commit("verify_run", **record))
    return committed
