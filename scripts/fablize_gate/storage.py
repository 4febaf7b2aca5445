"""Storage: where the plan lives (discovery), its files, the lock, the ledger, the snapshot,
transactions (Store, Reading, Transaction) and the streaming replay of a whole ledger.
"""

import errno
import json
import os
import stat
import time
from itertools import accumulate, chain, repeat
from operator import add, itemgetter, sub

from .base import (
    ARCHIVE, damaged, DEFAULT_LOCK_TIMEOUT, dumps, FablizeError, fast_sha256, has_surrogate_escape,
    is_plan_id, LEDGER, load_json, LOCK, no_plan, one_line, quote_arg, READ_CHUNK, refused, RUNS,
    sha256_hex, SNAPSHOT, SNAPSHOT_VERSION, STATE_DIRNAME, STATE_GITIGNORE, Step, usage, ZERO_HASH)
from .model import (
    _EVENT_KIND, check_graph, compact, is_original_snapshot, line_error, line_value, make_event,
    not_an_event, original_plan_fields, parse_event, Replay, validate_snapshot)


O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_BINARY = getattr(os, "O_BINARY", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


# Where FABLIZE_CRASH_AT (tests only) may kill the process, in write-protocol order.
CRASH_POINTS = ("before-ledger-write", "after-ledger-write", "after-ledger-fsync",
                "after-snapshot-temp", "before-snapshot-replace", "after-snapshot-replace",
                "after-archive-snapshot")


def crash_point(name):
    if os.environ.get("FABLIZE_CRASH_AT") == name:
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def repo_root(start):
    """The repository holding `start`: the nearest directory at or above it that holds `.git`
    (a folder, or the file of a worktree or submodule), or None. The one root finder: no git
    process, so every start can afford it."""
    d = os.path.realpath(start)
    while True:
        if os.path.lexists(os.path.join(d, ".git")):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def git_dirs(start):
    """(git dir, common dir) of the repository holding `start`, found from its files as git
    finds them — .git, a folder or a worktree's or submodule's `gitdir: PATH` file, and that
    folder's commondir — or None (no repository, an unreadable .git). No git process. A
    GIT_DIR-style variable, where one is set, decides for git instead: its caller asks."""
    top = repo_root(start)
    if top is None:
        return None
    gitdir = os.path.join(top, ".git")
    if not os.path.isdir(gitdir):
        raw = read_plain(gitdir)
        if not raw.startswith(b"gitdir:"):
            return None
        gitdir = os.path.join(top, raw[7:].strip().decode("utf-8", "replace"))
    common = read_plain(os.path.join(gitdir, "commondir")).strip().decode("utf-8", "replace")
    return os.path.realpath(gitdir), os.path.realpath(os.path.join(gitdir, common))


def read_plain(path):
    """A small file's bytes, or b"" when it cannot be read (a config, an attributes file)."""
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20)
    except OSError:
        return b""


def find_state_dir(explicit, cwd):
    """--dir, then $FABLIZE_DIR, then the nearest .fablize/ up to the repository root, then
    .fablize/ at that root, then ./.fablize/. Returns (path, discovered)."""
    if explicit:
        return os.path.abspath(explicit), False
    env = os.environ.get("FABLIZE_DIR")
    if env:
        return os.path.abspath(env), False
    here = d = os.path.abspath(cwd)
    while True:
        candidate = os.path.join(d, STATE_DIRNAME)
        if os.path.lexists(candidate) or os.path.lexists(os.path.join(d, ".git")):
            return candidate, True
        parent = os.path.dirname(d)
        if parent == d:
            return os.path.join(here, STATE_DIRNAME), True
        d = parent


def project_state_dir(path, out):
    """--dir or $FABLIZE_DIR naming a project (it holds .git or .fablize/, but no state files)
    means that project's .fablize/: state files written into the project would put the
    checks' working directory one level too high."""
    if os.path.basename(path) == STATE_DIRNAME or any(
            os.path.lexists(os.path.join(path, name)) for name in (SNAPSHOT, LEDGER)):
        return path
    if not any(os.path.lexists(os.path.join(path, name)) for name in (".git", STATE_DIRNAME)):
        return path
    state = os.path.join(path, STATE_DIRNAME)
    out.warn(f"{path} is a project root, not a state directory — using {state}.")
    return state


def symlink_refusal(path):
    return damaged(f"{path} is a symlink — refusing to follow it (state files must be regular "
                   "files inside the state directory).", "symlink", set_aside(path))


def set_aside(path):
    """The step of a state file, a folder or the state directory at `path` that is a link or of
    the wrong kind: what stands there moved aside, whole, to a free name beside it — nothing is
    lost, and what the engine writes there again is its own."""
    return f"mv {quote_arg(from_here(path))} {quote_arg(from_here(free_name(path + '.aside')))}"


def from_here(path):
    """`path` as a command typed where the user stands names it: relative to the current
    directory (absolute where it cannot be: another drive, a directory that is gone)."""
    try:
        return os.path.relpath(path)
    except (ValueError, OSError):
        return os.path.abspath(path)


def open_state_file(path, flags, mode=0o644):
    """os.open that never follows a symlink, never blocks (a FIFO or a device opens at once, and
    is then refused) and accepts nothing but a regular file."""
    try:
        fd = os.open(path, flags | O_NOFOLLOW | O_CLOEXEC | O_BINARY | O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno != errno.ENOENT and os.path.islink(path)):
            raise symlink_refusal(path)
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO without a reader, or a folder,
            # opened for writing: a writer says what a reader says of it, with the same step
            raise damaged(f"{path} is not a regular file.", "not_a_file", set_aside(path))
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise damaged(f"{path} is not a regular file.", "not_a_file", set_aside(path))
    return fd


def read_all(fd, start=0, size=None):
    os.lseek(fd, start, os.SEEK_SET)
    chunks = []
    left = size
    step = max(READ_CHUNK, os.fstat(fd).st_size - start) if size is None else 0
    while left is None or left > 0:
        chunk = os.read(fd, min(step, 1 << 30) if left is None else min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        if left is not None:
            left -= len(chunk)
    return b"".join(chunks)


def read_state_file(path):
    try:
        fd = open_state_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return read_all(fd)
    finally:
        os.close(fd)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path):
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY | O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_subdir(path):
    """mkdir that refuses a symlink or a file standing where the directory should be."""
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise symlink_refusal(path)
        if not stat.S_ISDIR(st.st_mode):
            raise damaged(f"{path} is not a directory.", "not_a_directory", set_aside(path))
    return path


def free_name(path):
    """`path`, or `path.2`, `path.3`, … whichever does not exist yet."""
    candidate, n = path, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


def link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:  # no hard links here (some filesystems): copy, refusing a symlink
        fd = open_state_file(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            write_all(fd, read_state_file(src) or b"")
            os.fsync(fd)
        finally:
            os.close(fd)


def shown_path(store, rel):
    """A state file's path (`runs/3-G001.log`) as a person standing where they are can open
    it: relative to the current directory."""
    return one_line(os.path.relpath(store.path(rel)))


def within(path, folder):
    """Whether `path` is `folder` or lies under it (both as given: resolve them first)."""
    return os.path.commonpath([path, folder]) == folder


def user_file(root, path, outside=False, steps=((), ())):
    """Where a file written on the user's behalf (`install-block`, `report --out`) goes:
    `path`, inside the project at `root` unless the user passed --outside, and never through
    a symlink — not the file itself, not a folder on the way that leads out of the project.
    Returns (path, its lstat or None when it does not exist yet). `steps`: the caller's way out
    of a path outside the project, and of a file it cannot write."""
    target = os.path.abspath(path)
    top = os.path.realpath(root)
    if not outside and not within(os.path.realpath(os.path.dirname(target)), top):
        where = ("a folder on the way is a symlink out of it"
            if within(os.path.abspath(os.path.dirname(target)), os.path.abspath(root)) else
            "it is not inside it")
        raise refused(f"{one_line(path)} is outside the project ({one_line(root)}): {where} — "
                      "fablize writes a file there only when asked with --outside.",
                      "outside_project", steps[0])
    return target, file_to_write(target, steps[1])


def file_to_write(path, steps=()):
    """The lstat of a file about to be written on the user's behalf, or None when there is none
    yet; refuses a symlink (never written through) or anything but a regular file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise refused(f"{path} is a symlink — refusing to write through it.", "symlink", steps)
    if not stat.S_ISREG(st.st_mode):
        raise refused(f"{path} is not a regular file.", "not_a_file", steps)
    return st


def unwrite(fd, n):
    """Take back the last `n` bytes appended to `fd` (an fsync failed: they were never
    durable). Best effort: if that fails too, the line stays, and the error said stands."""
    try:
        os.ftruncate(fd, os.fstat(fd).st_size - n)
        os.fsync(fd)
    except OSError:
        pass


def write_atomic(path, data, mode=0o644, sweep=False):
    """Replace `path` with `data` whole: a temp file in the same directory, fsync, rename, fsync
    the directory. With `sweep`, temp files a killed writer left are removed first (the caller
    holds the lock)."""
    directory = os.path.dirname(path) or "."
    if sweep:
        prefix = os.path.basename(path) + ".tmp-"
        for name in os.listdir(directory):
            if name.startswith(prefix):
                os.unlink(os.path.join(directory, name))
    tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    fd = open_state_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            write_all(fd, data)
            crash_point("after-snapshot-temp")
            os.fsync(fd)
        finally:
            os.close(fd)
        crash_point("before-snapshot-replace")
        os.replace(tmp, path)  # rename last: a crash before it leaves the old file whole
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    crash_point("after-snapshot-replace")
    fsync_dir(directory)


def write_state_gitignore(state_dir):
    """`.fablize/.gitignore`, unless one is there already (it may be the user's own)."""
    path = os.path.join(state_dir, ".gitignore")
    if os.path.lexists(path):
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_BINARY, 0o644)
    except FileExistsError:
        return False
    try:
        write_all(fd, STATE_GITIGNORE.encode())
    finally:
        os.close(fd)
    return True


PROC = "/proc"


def process_alive(pid):
    """Whether process `pid` runs: one of another user counts, a zombie (ended, not yet reaped)
    does not. The engine's one test of a process's life (the lock's owner, a run's engine)."""
    if os.name == "nt":  # os.kill(pid, 0) there would end the process (TerminateProcess)
        import ctypes
        handle = ctypes.windll.kernel32.OpenProcess(0x1000, False, pid)  # QUERY_LIMITED_INFORMATION
        if not handle:
            return False
        code = ctypes.c_ulong()
        ctypes.windll.kernel32.GetExitCodeProcess(handle, ctypes.byref(code))
        ctypes.windll.kernel32.CloseHandle(handle)
        return code.value == 259  # STILL_ACTIVE
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, ValueError, OverflowError):
        return False
    except OSError:  # another user's process: alive
        return True
    fields = proc_stat(pid)
    return fields is None or fields[0] not in (b"Z", b"X")


def proc_stat(pid):
    """The fields of /proc/<pid>/stat after the command's name (the state first), or None when
    there is no such process or no /proc."""
    try:
        with open(f"{PROC}/{int(pid)}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError, ValueError):
        return None


def env_seconds(name, default):
    """A number of seconds ≥ 0 from the environment variable `name`, else `default`; anything
    else is a usage error (FABLIZE_LOCK_TIMEOUT, the sharing room's FABLIZE_SHARE_WAIT)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1
    if not value >= 0:
        raise usage(f"{name} must be a number of seconds ≥ 0, not {one_line(raw)!r}.")
    return value


def lock_timeout():
    return env_seconds("FABLIZE_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT)


def flock_module():
    """fcntl, imported when a lock is taken (reading commands take none); None on Windows, where
    an exclusive-create lock file stands in (Lock)."""
    try:
        import fcntl
    except ImportError:
        return None
    return fcntl


class Lock:
    """The state directory's lock: flock on `lock` where fcntl exists; elsewhere an
    exclusive-create `lock.owner` file holding the owner's pid (a dead owner's is stale)."""

    def __init__(self, state_dir, warnings):
        self.path = os.path.join(state_dir, LOCK)
        self.warnings = warnings
        self.fd = None
        self.owner_path = None

    def __enter__(self):
        timeout = lock_timeout()
        deadline = time.monotonic() + timeout
        delay = 0.001
        while not self._try_acquire():
            if time.monotonic() >= deadline:
                holder = self._holder()
                raise damaged(f"another fablize command holds {self.path}{holder} — gave up after "
                              f"{timeout:g} s (set FABLIZE_LOCK_TIMEOUT to wait longer).",
                              "lock_timeout")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self

    def _try_acquire(self):
        fcntl = flock_module()
        if fcntl is None:
            return self._try_owner_file()
        if self.fd is None:
            self.fd = open_state_file(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return False
            raise

    def _try_owner_file(self):
        path = self.path + ".owner"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_BINARY, 0o644)
        except FileExistsError:
            pid = self._owner_pid()
            if pid is None and self._owner_age() > 5:
                # created but never written: its creator died between the two steps
                self.warnings.append("removed a stale lock file that no process finished writing.")
            elif pid is not None and not process_alive(pid):
                self.warnings.append(f"removed a stale lock left by process {pid}, which is no "
                                     "longer running.")
            else:
                return False
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return False
        try:
            write_all(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)
        self.owner_path = path
        return True

    def _owner_pid(self):
        try:
            raw = read_state_file(self.path + ".owner")
            return int(raw.decode().strip()) if raw else None
        except (ValueError, UnicodeDecodeError):
            return None
        except FileNotFoundError:
            return None

    def _owner_age(self):
        try:
            return time.time() - os.lstat(self.path + ".owner").st_mtime
        except FileNotFoundError:
            return 0

    def _holder(self):
        if flock_module() is None:
            pid = self._owner_pid()
            return f" (process {pid})" if pid else ""
        return ""

    def __exit__(self, *exc):
        if self.owner_path:
            try:
                os.unlink(self.owner_path)
            except FileNotFoundError:
                pass
            self.owner_path = None
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None  # taken again, the lock opens its file again
        return False
_SCAN = json.JSONDecoder().scan_once  # json's C scanner: one value at a position, and its end
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def parse_events(lines):
    """line_value for a batch of lines, in one pass of json's scanner over the joined batch
    (JSON strings never hold a raw newline). Each value must end exactly where its own line
    does: a value spread over several lines — a forged line hidden inside another event, so
    that its hash sits in the chain without its prev ever being checked — is no event, and
    the lines are then parsed one by one, where it fails. Audit of a plan worked as agents
    work it, 200 stories: 132 → 127 ms CPU against parsing each line alone (x1.05; x1.07 at
    10,000 stories)."""
    text = batch_text(lines)
    if text is None:
        return list(map(line_value, lines))
    # where each line starts and ends in the text, and the scanner called at each start, all in
    # C (map, accumulate): a loop in Python would cost ~0.4 µs a line more
    lengths = map(len, lines if text.isascii() else map(bytes.decode, lines))
    starts = [0, *accumulate(map(add, lengths, repeat(1)))]  # the join's "," after each line
    try:
        scanned = list(map(_SCAN, repeat(text), starts[:-1]))
    except (StopIteration, ValueError, RecursionError):
        return list(map(line_value, lines))
    if list(map(_SECOND, scanned)) != list(map(sub, starts[1:], repeat(1))):
        return list(map(line_value, lines))
    return list(map(_FIRST, scanned))  # Replay.feed checks each is an event


def batch_text(lines):
    """The lines joined by "," as text, or None when they hold what only a line parsed alone
    can tell (bytes no UTF-8 text holds, a lone surrogate's escape)."""
    try:
        text = b",".join(lines).decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if has_surrogate_escape(text) else text


class Ledger:
    """ledger.jsonl: its tail read backwards (cost linear in what is read), its lines streamed
    forwards in batches (memory flat in its length), one event appended with one write."""

    def __init__(self, path, writable=False):
        self.path = path
        self.writable = writable
        self.fd = None
        # the last line is the snapshot's and whole but for its newline: a reader reads it as
        # if the newline were there (a writer restores it, restore_newline)
        self.newline_lost = False

    def open(self, create=False):
        """The descriptor, or None when there is no ledger."""
        if self.fd is None:
            flags = (os.O_RDONLY if not self.writable else
                os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0))
            try:
                self.fd = open_state_file(self.path, flags)
            except FileNotFoundError:
                return None
        return self.fd

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def end(self):
        """(end, torn): `end` is the size of the ledger's newline-terminated part; `torn` the
        bytes after it (an unterminated last line: a write that never completed)."""
        read, size = self.read, self.size()
        if size == 0 or read(size - 1, 1) == b"\n":
            return size, b""
        pos = size
        while pos > 0:
            start = max(0, pos - READ_CHUNK)
            i = read(start, pos - start).rfind(b"\n")
            if i >= 0:
                end = start + i + 1
                return end, read(end, size - end)
            pos = start
        return 0, read(0, size)

    def size(self):
        return os.fstat(self.fd).st_size + self.newline_lost

    def read(self, start, size):
        data = read_all(self.fd, start, size)
        if self.newline_lost and len(data) < size and start + len(data) == self.size() - 1:
            data += b"\n"
        return data

    def restore_newline(self):
        """The newline of an acknowledged last line that lost it, written back (a writer)."""
        n = os.write(self.fd, b"\n")
        if n != 1:
            raise damaged(f"short write to {LEDGER} (its last line's newline).", "io_error")
        os.fsync(self.fd)

    def backward(self, end):
        """Yield (offset, line) for each complete line before `end`, newest first; every byte
        is read once, so a long line costs what its length costs."""
        if end <= 0:
            return
        pos, parts = end - 1, []
        while pos > 0:
            start = max(0, pos - READ_CHUNK)
            chunk = self.read(start, pos - start)
            i = len(chunk)
            while True:
                j = chunk.rfind(b"\n", 0, i)
                if j < 0:
                    parts.append(chunk[:i])
                    break
                parts.append(chunk[j + 1:i])
                yield start + j + 1, b"".join(reversed(parts))
                parts = []
                i = j
            pos = start
        yield 0, b"".join(reversed(parts))

    def last(self, end):
        return next(self.backward(end), (None, None))[1]

    def batches(self, end, size=1 << 16):
        """The complete lines before `end` (a line boundary), a list per 64 KiB or so: a batch's
        events then fit in the CPU's cache, and a long replay runs ~10% faster than with
        batches of a megabyte."""
        pos, parts = 0, []
        while pos < end:
            chunk = self.read(pos, min(size, end - pos))
            if not chunk:
                break
            pos += len(chunk)
            k = chunk.rfind(b"\n")
            if k < 0:
                parts.append(chunk)
                continue
            head = chunk[:k]
            if parts:
                head = b"".join(parts + [head])
            parts = [chunk[k + 1:]] if k + 1 < len(chunk) else []
            yield head.split(b"\n")

    def append(self, line, fd=None):
        fd = self.fd if fd is None else fd
        crash_point("before-ledger-write")
        n = os.write(fd, line + b"\n")  # one write on an O_APPEND descriptor
        if n != len(line) + 1:
            raise damaged(f"short write to {LEDGER} ({n} of {len(line) + 1} bytes); the next "
                          "command moves the torn line aside.", "io_error")
        crash_point("after-ledger-write")
        try:
            os.fsync(fd)
        except OSError:
            # not durable, so not recorded: the line goes again, so that no later command
            # takes as acknowledged what this one reports as failed
            unwrite(fd, n)
            raise
        crash_point("after-ledger-fsync")

    def cut(self, end, torn):
        """Move the torn bytes after `end` to ledger.jsonl.broken, then truncate (a writer only)."""
        bfd = open_state_file(self.path + ".broken", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            write_all(bfd, torn if torn.endswith(b"\n") else torn + b"\n")
            os.fsync(bfd)
        finally:
            os.close(bfd)
        os.ftruncate(self.fd, end)
        os.fsync(self.fd)


class MemoryLedger(Ledger):
    """A ledger's bytes already in memory (an archived plan, a ledger read from a git ref)."""

    def __init__(self, data):
        super().__init__(None)
        self.data = data
        self.fd = -1

    def size(self):
        return len(self.data)

    def read(self, start, size):
        return self.data[start:start + size]

    def close(self):
        pass


def replay_all(ledger, end, on_event=None, kinds=None, on_batch=None):
    """Replay the ledger's first `end` bytes from nothing, streaming; returns the Replay, its
    `counts` the events of each kind. `on_event(replay, line, ev)` sees each event after it
    replayed: every one, or with `kinds` only those of these kinds; `on_batch(replay, events)`
    each batch of events, once all of them replayed."""
    replay = Replay(digest=fast_sha256())
    feed, counts = replay.feed, replay.counts
    for lines in ledger.batches(end):
        events = parse_events(lines)
        for line, ev in zip(lines, events):
            feed(line, ev)
            if on_event is not None and (kinds is None or ev["event"] in kinds):
                on_event(replay, line, ev)
        if on_batch is not None:
            on_batch(replay, events)
        counts.update(map(_EVENT_KIND, events))  # in C: every line is an event by now
        del events  # freed before the next batch is parsed, whose objects reuse its memory
    return replay
_DIGEST_PREFIX = b'{"digest":"'


def snapshot_bytes(plan):
    """The snapshot: its digest, the plan's fields, then one compact story per line (readable,
    and written by json's C encoder, which an `indent` would switch off)."""
    head = {k: v for k, v in plan.items() if k not in ("goals", "digest")}
    head["schema_version"] = SNAPSHOT_VERSION
    goals = [compact(story) for story in plan["goals"]]
    # the stories in one call of the encoder, then a line break before each story: a string's
    # quotes are escaped, so `},{"id":` only ever joins two dicts whose first key is "id" — two
    # stories, when the count says so (a story's "id" comes first; nothing inside one starts so)
    stories = dumps(goals)[1:-1]
    if stories.count('},{"id":') == len(goals) - 1:
        stories = stories.replace('},{"id":', '},\n{"id":')
    else:
        stories = ",\n".join(dumps(s) for s in goals)
    body = (dumps(head)[1:-1] + ',"goals":[\n' + stories + "\n]}\n").encode("utf-8")
    return _DIGEST_PREFIX + sha256_hex(body).encode() + b'",' + body


def canonical_digest(plan):
    """Version 1's digest: over the plan re-serialised with sorted keys."""
    body = {k: v for k, v in plan.items() if k != "digest"}
    return sha256_hex(json.dumps(body, ensure_ascii=False, sort_keys=True,
                                 separators=(",", ":")).encode("utf-8"))


def parse_snapshot(raw, whole=False):
    """goals.json's bytes as a plan, its digest verified; exit 3 when it cannot be trusted.
    `whole`: every story checked too (audit, rebuild), not only those a command touches."""
    try:
        snap = load_json(raw)
    except ValueError as e:
        what = "empty" if not raw.strip() else f"not valid JSON ({e})"
        raise damaged(f"{SNAPSHOT} is {what} — {REBUILD_STEP}", "bad_snapshot",
                      steps=Step.engine("rebuild"))
    validate_snapshot(snap, whole)
    if is_original_snapshot(snap):
        return snap
    n = len(_DIGEST_PREFIX)
    if raw.startswith(_DIGEST_PREFIX) and raw[n + 64:n + 66] == b'",':
        # a view, not a slice: no copy of the body
        good = raw[n:n + 64].decode("ascii", "replace") == sha256_hex(memoryview(raw)[n + 66:])
    else:
        good = snap.get("digest") == canonical_digest(snap)  # version 1's digest
    if not good:
        raise damaged(f"{SNAPSHOT} was changed outside fablize (its digest does not "
                      f"match) — {REBUILD_STEP}", "snapshot_edited", steps=Step.engine("rebuild"))
    return snap


# the step out of a snapshot that is not the ledger's: the ledger is the source of truth
REBUILD_STEP = "`rebuild` regenerates it from the ledger (the old one is kept as a .bak):"


def acknowledged_line(line, snap):
    """Whether `line` is the ledger line the snapshot `snap` reflects: its seq, and its hash the
    one the snapshot names."""
    pos = snap.get("ledger") if isinstance(snap, dict) else None
    return (isinstance(pos, dict) and type(pos.get("seq")) is int and pos["seq"] > 0
            and line.startswith(b'{"seq":%d,' % pos["seq"])
            and sha256_hex(line) == pos.get("head"))


def position_error(snap_seq, ledger_seq, missing=False):
    """The snapshot reflects an event the ledger does not hold (one message, for every reader):
    the ledger lost lines. Restoring it is the human's call; `rebuild` is the way out that
    keeps what the ledger still holds (a shared plan's: what its remote holds)."""
    where = ("is empty (the file is missing)" if missing else "is empty" if not ledger_seq else
             f"ends at event {ledger_seq}")
    return damaged(
        f"{SNAPSHOT} reflects event {snap_seq} but {LEDGER} {where}: the ledger lost events. "
        f"If it was committed, `git checkout HEAD -- {STATE_DIRNAME}/` restores both files as "
        f"last committed; else `rebuild` makes {SNAPSHOT} match the ledger (the old one is kept "
        "as a .bak):", "disagree", steps=Step.engine("rebuild"))


def snapshot_damage(store):
    """Why the snapshot in `store` is not one, checked whole, or None when it is sound: a
    command that reads only the stories it touches (validate_snapshot) and failed on something
    a story holds is damage, exit 3; on a sound snapshot the failure is the engine's own bug,
    and keeps its traceback."""
    try:
        raw = read_state_file(store.path(SNAPSHOT))
        if raw is not None:
            parse_snapshot(raw, whole=True)
    except FablizeError as e:
        return e
    except OSError:
        pass
    return None


def loose_snapshot(store):
    """goals.json as a dict with a goals list, or None when it is missing or unreadable."""
    try:
        snap = load_json(read_state_file(store.path(SNAPSHOT)) or b"null")
    except ValueError:
        return None
    return snap if isinstance(snap, dict) and isinstance(snap.get("goals"), list) else None


def stripped_snapshot_error():
    return damaged(f"{SNAPSHOT} lost its ledger position and digest but {LEDGER} is "
                   f"hash-chained: it was edited by hand — {REBUILD_STEP}",
                   "snapshot_edited", steps=Step.engine("rebuild"))


def legacy_refusal():
    return damaged(f"{SNAPSHOT} was written by the original goals.py; run `status` (or "
                   "any writing command) to import it into a hash-chained ledger first.",
                   "legacy", steps=Step.engine("status"))


class Store:
    """A state directory. Storage never prints: what it has to say goes to `warnings`. Its
    `after_commit` steps run after every writing session that committed an event, still under
    the lock (a shared plan publishes there); storage knows nothing of what they do."""

    def __init__(self, path, discovered, warnings=None):
        self.dir = path
        self.root = os.path.dirname(path)
        self.discovered = discovered
        self.warnings = [] if warnings is None else warnings
        self.after_commit = []
        self.on_lock = []  # steps run once the lock is taken (runs whose engine died are ended)
        self.recorded = []  # (seq, event) of each event made durable by this command
        self.unrecorded = None  # the kind of event whose append failed (nothing of it stands)

    def path(self, name):
        return os.path.join(self.dir, name)

    def warn(self, text):
        self.warnings.append(text)

    def exists(self):
        """Whether the state directory exists (refusing a planted symlink in its place)."""
        try:
            st = os.lstat(self.dir)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode) and (self.discovered or
                                         os.path.basename(self.dir) == STATE_DIRNAME):
            raise symlink_refusal(self.dir)  # a cloned repository's `.fablize -> elsewhere`
        if not stat.S_ISDIR(os.stat(self.dir).st_mode):
            raise damaged(f"{self.dir} is not a directory.", "not_a_directory",
                          set_aside(self.dir))
        return True

    def create_dir(self):
        if not self.exists():
            os.makedirs(self.dir, exist_ok=True)
            write_state_gitignore(self.dir)

    def has_plan_files(self):
        if os.path.lexists(self.path(SNAPSHOT)):
            return True
        try:
            return os.lstat(self.path(LEDGER)).st_size > 0
        except FileNotFoundError:
            return False

    def session(self, exclusive=True, imports=False):
        return Transaction(self) if exclusive else Reading(self, imports)

    def require(self):
        """Refuses with the original's `no plan` when the state directory does not exist."""
        if not self.exists():
            raise no_plan()

    def plan_session(self, exclusive=True):
        """A session on an existing plan (under the lock when `exclusive`); refuses with the
        original's message when there is none."""
        self.require()
        return self.session(exclusive)


class Reading:
    """The plan as a reader sees it: no lock taken, nothing written. The snapshot is read before
    the ledger (a writer appends before it replaces the snapshot, so the ledger is never behind
    what the snapshot says); a ledger ahead is replayed in memory, an unterminated last line is
    left for a writer. A reader that raced a plan replacement reads again."""

    writer = False

    def __init__(self, store, imports=False):
        self.store = store
        self.imports = imports
        self.ledger = Ledger(store.path(LEDGER), self.writer)
        self.plan = None

    def __enter__(self):
        # a reader never opens the lock, but a symlink planted there is damage all the same
        if os.path.islink(self.store.path(LOCK)):
            raise symlink_refusal(self.store.path(LOCK))
        return self

    def __exit__(self, *exc):
        self.ledger.close()
        return False

    def require_plan(self):
        plan = self.load()
        if plan is None:
            raise no_plan()
        return plan

    def load(self):
        """The current plan, or None when there is none. Raises FablizeError(exit 3) on damage."""
        for attempt in range(3):
            try:
                return self._load()
            except FablizeError as e:
                # `create --force` and `rebuild` swap files under a reader: read again
                if self.writer or e.code != "disagree" or attempt == 2:
                    raise
                self.ledger.close()
                time.sleep(0.02)

    def _load(self):
        """The plan as this start must see it, reading as little as it can. A snapshot of the
        original tool is imported; one of an older schema is upgraded; no snapshot means the
        whole ledger, replayed streaming. Otherwise the ledger is read backwards from its end
        only as far as the event the snapshot reflects: that line's digest must be the one the
        snapshot names (else the two disagree: damage), and the events after it — a writer
        killed between its two writes — are rolled forward. `last_event` is torn_tail's find,
        (offset, event, digest verified, line), handed over so the last line is read and parsed
        once."""
        self.last_event = None  # a retry reads the ledger afresh
        raw = read_state_file(self.store.path(SNAPSHOT))
        snap = parse_snapshot(raw) if raw is not None else None
        if snap is not None and self.writer and not is_original_snapshot(snap):
            check_graph(snap)
        ledger = self.ledger
        if snap is not None and is_original_snapshot(snap):
            return self.plan_from_original(snap)
        end = self.good_end(snap) if ledger.open() is not None else 0
        if snap is not None and snap["schema_version"] < 2:
            return self.upgrade(snap, end)
        if snap is None and end:  # no snapshot: the plan is the whole ledger's, replayed streaming
            return self.replayed(end)
        snap_seq = snap["ledger"]["seq"] if snap else 0
        newer, found = [], None
        last = getattr(self, "last_event", None)
        lines = ledger.backward(end)
        if last:
            lines = chain([(last[0], last[3])], ledger.backward(last[0]))
        for offset, line in lines:
            known = last if last and last[0] == offset else None
            ev = known[1] if known else parse_event(line)
            last = None
            if ev is None:
                raise not_an_event(newer[-1][0]["seq"] - 1 if newer else "at the end")
            if ev["seq"] <= snap_seq:
                found = (ev["seq"], line, bool(known and known[2]))
                break
            newer.append((ev, line))
        if snap is not None and snap_seq > 0:
            if found is None or found[0] < snap_seq:
                raise position_error(snap_seq, found[0] if found else 0, ledger.fd is None)
            if not found[2] and sha256_hex(found[1]) != snap["ledger"]["head"]:
                raise damaged(
          f"{SNAPSHOT} and {LEDGER} disagree at event {snap_seq} (line {snap_seq} is not "
          f"the one the snapshot reflects) — {REBUILD_STEP}", "disagree",
                              steps=Step.engine("rebuild"))
        self.plan = snap
        if newer:
            self.plan = self.roll_forward(snap, newer[::-1])
        return self.plan

    def see_lost_newline(self, snap):
        """For a command that reads the whole ledger itself (audit, log): the last line the
        snapshot reflects is whole, whatever its newline (torn_tail's rule)."""
        if self.ledger.open() is None:
            return
        torn = self.ledger.end()[1]
        if torn and acknowledged_line(torn, snap):
            self.keep_lost_newline(snap["ledger"]["seq"])

    def keep_lost_newline(self, seq):
        """A reader writes nothing: the line is read as whole until a writer restores it."""
        self.ledger.newline_lost = True
        self.store.warn(f"{LEDGER}'s last line (event {seq}, which {SNAPSHOT} reflects) lost its "
                        "newline; the next writing command restores it.")

    def good_end(self, snap):
        """Where the ledger's acknowledged lines end; a torn last line is left in place."""
        end, torn = self.torn_tail(snap)
        if torn:
            self.store.warn(f"{LEDGER} ends with a torn last line ({len(torn)} bytes, never "
                            "acknowledged); the next writing command moves it aside.")
        return end

    def torn_tail(self, snap):
        """(end, torn): an unterminated last line is a write that never completed — unless the
        snapshot reflects it, or the line before it is damaged too. The line the snapshot names
        (its seq and hash) is whole whatever its newline: an editor or a copy dropped that, and
        it is acknowledged — restored by a writer, read as whole by a reader."""
        ledger = self.ledger
        end, torn = ledger.end()
        if torn and acknowledged_line(torn, snap):
            self.keep_lost_newline(snap["ledger"]["seq"])
            end, torn = ledger.end()
        if not torn and end:
            offset, line = next(ledger.backward(end))
            # The load that follows reuses it, and knows whether it is the line the snapshot
            # reflects: one hash of it a start, and no parse of the acknowledged event.
            pos = snap.get("ledger") if snap else None
            if (type(pos) is dict and line.startswith(b'{"seq":%d,' % pos["seq"]) and
                    line[-75:-66] == b',"prev":"' and line.endswith(b'"}') and
                    sha256_hex(line) == pos["head"]):  # an event's first and last fields
                self.last_event = (offset, {"seq": pos["seq"]}, True, line)
            else:
                self.last_event = (offset, parse_event(line), False, line)
                # a whole line is an acknowledged write: one that is no event (a merge's conflict
                # marker, a hand edit) is damage, for the replay to name; only an unterminated
                # tail is a write that never completed
        if not torn:
            return end, torn
        snap_seq = snap["ledger"]["seq"] if snap and "ledger" in snap else 0
        prev = ledger.last(end) if end else None
        prev_ev = parse_event(prev) if prev is not None else None
        if prev_ev is None and end:
            raise damaged(f"{LEDGER}: the last two lines are damaged — not a torn write, so not "
                          f"repaired: restore {LEDGER} (`git checkout HEAD -- {STATE_DIRNAME}/` "
                          "when it was committed); a human decides:", "bad_line")
        if (prev_ev["seq"] if prev_ev else 0) < snap_seq:
            raise line_error(
      snap_seq, f"the last line is damaged but {SNAPSHOT} reflects event {snap_seq}: "
      f"an acknowledged event was damaged. If it was committed, `git checkout HEAD "
      f"-- {STATE_DIRNAME}/` restores both files; else `rebuild` keeps the events "
      f"before it (the damaged line goes to {LEDGER}.broken, the old snapshot to a "
      ".bak):",
      "bad_line", steps=Step.engine("rebuild"))
        return end, torn

    def roll_forward(self, plan, events):
        """Apply ledger events the snapshot does not reflect yet (a crash between the two
        writes, or a reader that came between them)."""
        pos = plan["ledger"] if plan else {"seq": 0, "head": ZERO_HASH}
        replay = Replay(plan, pos["seq"], pos["head"])
        for ev, line in events:
            replay.feed(line, ev)
        replay.plan["ledger"] = replay.position()
        return replay.plan

    def replayed(self, end):
        """The plan of the ledger's first `end` bytes, replayed from nothing in batches (memory
        flat in the ledger's length, rebuild's cost): what a command gets when goals.json is
        missing; a writer saves it."""
        replay = replay_all(self.ledger, end)
        if replay.plan is not None:
            replay.plan["ledger"] = replay.position()
        self.plan = replay.plan
        return self.plan

    def upgrade(self, snap, end):
        """A version-1 snapshot (it kept every run): its position is checked, then the plan is
        replayed from the ledger."""
        plan = self.replayed(end)
        if (plan["ledger"]["seq"] if plan else 0) < snap["ledger"]["seq"]:
            raise position_error(snap["ledger"]["seq"], plan["ledger"]["seq"] if plan else 0)
        if plan is not None:
            self.store.warn(f"{SNAPSHOT} is in the format of fablize 1 (it kept every run); "
                            + ("it was rewritten from the ledger." if self.writer else
                               "the next writing command rewrites it from the ledger."))
        return plan

    def plan_from_original(self, snap):
        """A plan written by the original goals.py: `status`, the command its users resume with,
        imports it once (a write, under the lock); other readers say how."""
        self.refuse_stripped_snapshot()
        if not self.imports:
            raise legacy_refusal()
        with Transaction(self.store) as t:
            self.plan = t.load()
        return self.plan

    def refuse_stripped_snapshot(self):
        """An original-format goals.json beside a hash-chained ledger is a hand edit, not an
        old plan: importing it would launder whatever it claims."""
        if self.ledger.open() is None:
            return
        end = self.ledger.end()[0]
        last = self.ledger.last(end) if end else None
        if last is not None and parse_event(last) is not None:
            raise stripped_snapshot_error()

    def refuse_original(self):
        """Commands that read the ledger itself (audit, log, rebuild) do not import an original
        plan; they say how to. Any other damage to goals.json is theirs to report or repair."""
        snap = loose_snapshot(self.store)
        if snap is None or not is_original_snapshot(snap):
            return
        last = None
        if self.ledger.open() is not None:
            end = self.ledger.end()[0]
            last = self.ledger.last(end) if end else None
        if last is None or parse_event(last) is None:
            raise legacy_refusal()


class Unlocked:
    """Transaction.unlocked's block."""

    def __init__(self, session):
        self.session = session

    def __enter__(self):
        session = self.session
        session.ledger.close()
        session.held = False
        session.lock.__exit__(None, None, None)
        return session

    def __exit__(self, kind, *exc):
        if kind is None:
            session = self.session
            session.lock.__enter__()
            session.held = True
            session.load()
        return False


class Transaction(Reading):
    """A write: the lock held throughout (but while `unlocked` lets it go); load() moves a torn
    last line aside and saves a rolled forward plan; commit() appends one event (one write,
    fsync) and then replaces the snapshot.

    What a room is given of a writing session (the sharing room uses no more): `store`, `plan`,
    `last` (the event this session committed last), `held`, `ledger` to read, and load(),
    commit(), cut_torn_tail(), save_snapshot(), append_lines(), swap_ledger(), withdraw() and
    unlocked(). Storage takes and lets go of the lock; a room never does, and keeps its own
    state of a session in objects of its own."""

    writer = True

    def __init__(self, store):
        super().__init__(store)
        self.lock = Lock(store.dir, store.warnings)
        self.last = None
        self.held = False  # whether this session holds the lock: it writes only then
        self.unsaved = False  # a recorded event's snapshot could not be written (said once)

    def __enter__(self):
        self.lock.__enter__()
        self.held = True
        try:
            for step in self.store.on_lock:
                step(self.store)
        except BaseException:
            self.held = False
            self.lock.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            if exc[0] is None and self.last is not None:
                for step in self.store.after_commit:
                    try:
                        step(self)
                    except OSError as e:  # the events are recorded: what is left is said
                        self.store.warn(
                            f"the events are recorded here, but what follows a write could not "
                            f"be finished ({e.strerror or e}); the next command (or `sync`) "
                            "finishes it.")
        finally:
            self.ledger.close()
            self.held = False
            self.lock.__exit__(*exc)
        return False

    def unlocked(self):
        """`with session.unlocked():` the lock let go while the block runs — a wait on other
        machines, which would otherwise keep this clone's other commands waiting past their lock
        timeout — then taken again, and the plan read again (another command may have written
        meanwhile). Meanwhile the session writes nothing: `held` is False and a write raises (a
        bug). A block that raises, or a lock that cannot be taken again, leaves the session
        without the lock: the error goes up, and nothing more is written."""
        return Unlocked(self)

    def require_lock(self):
        if not self.held:
            raise RuntimeError("a write without the state lock (inside Transaction.unlocked)")

    def keep_lost_newline(self, seq):
        """Under the lock: the newline written back, so the line is whole on disk too."""
        self.ledger.restore_newline()
        self.store.warn(f"{LEDGER}'s last line (event {seq}, which {SNAPSHOT} reflects) had lost "
                        "its newline; it is restored (the event is whole and stands).")

    def good_end(self, snap):
        end, torn = self.torn_tail(snap)
        if torn:
            self.ledger.cut(end, torn)
            self.store.warn(f"{LEDGER}: a torn last line ({len(torn)} bytes, a write that never "
                            f"completed) was moved to {LEDGER}.broken.")
        return end

    def cut_torn_tail(self, snap):
        """rebuild's repair: the ledger's good end, after moving a torn last line aside."""
        return self.good_end(snap) if self.ledger.open() is not None else 0

    def roll_forward(self, plan, events):
        plan = super().roll_forward(plan, events)
        self.save_snapshot(plan)
        return plan

    def replayed(self, end):
        plan = super().replayed(end)
        if plan is not None:
            self.save_snapshot(plan)
        return plan

    def plan_from_original(self, snap):
        """Import for real: the original's files go to archive/, a chained ledger starts."""
        self.refuse_stripped_snapshot()
        old = self.replace_plan(original_plan_fields(snap, self.store.root))
        self.store.warn(f"imported the plan written by the original goals.py; its files are "
                        f"kept in {old['path']}.")
        return self.plan

    def commit(self, kind, **fields):
        """Append one event (checked by apply_event first) and save the snapshot."""
        self.require_lock()
        plan, line = self.prepare(kind, fields)
        try:
            self.ledger.append(line, self.ledger.open(create=True))
        except (OSError, FablizeError):
            # not recorded (a torn line is moved aside next): after events this command did
            # record, the command again is the way on, not a warning against it
            self.store.unrecorded = kind
            raise
        self.recorded(plan, kind)
        return self.last

    def recorded(self, plan, kind):
        """The event is durable: from here it is recorded, whatever fails after. A snapshot that
        cannot be written (a full disk) is said, not failed: the ledger is ahead of it, and the
        next command rolls it forward."""
        self.store.recorded.append((plan["ledger"]["seq"], kind))
        try:
            self.settle(plan)
        except OSError as e:
            self.plan = plan
            if not self.unsaved:
                self.unsaved = True
                self.store.warn(f"event {plan['ledger']['seq']} ({kind}) is recorded in {LEDGER}, "
                                f"but {SNAPSHOT} could not be written ({e.strerror or e}); the "
                                "next command brings it up to date from the ledger.")

    def prepare(self, kind, fields):
        plan, self.last, line = make_event(self.plan, kind, fields)
        return plan, line

    def settle(self, plan):
        self.save_snapshot(plan)
        self.plan = plan

    def rebuilt(self, plan):
        """Replaying the whole ledger gave `plan` (None: it holds none): it is the session's
        plan from here, its snapshot written."""
        if plan is not None:
            self.save_snapshot(plan)
        self.plan = plan

    def save_snapshot(self, plan):
        self.require_lock()
        write_atomic(self.store.path(SNAPSHOT), snapshot_bytes(plan), sweep=True)

    def append_lines(self, lines, plan):
        """Append ledger lines already checked and chained — events another machine recorded,
        replayed by the room that brought them into `plan` — and save `plan`'s snapshot. They
        are not this command's events: `recorded` does not list them."""
        self.require_lock()
        self.ledger.append(b"\n".join(lines), self.ledger.open(create=True))
        self.save_snapshot(plan)
        self.plan = plan

    def replace_plan(self, fields):
        """Start a new plan over the current one, which moves whole to archive/<plan id>/.
        The old plan stays current until the new ledger is durable, so a crash anywhere leaves
        the old plan or the new one, never none: its files are linked into the archive, then
        the new first event replaces the ledger (swap_ledger)."""
        old = self.archive_current()
        plan, line = self.prepare("plan_created", dict(fields, replaces=old))
        self.swap_ledger(line + b"\n", plan, "plan_created")
        self.drop_replaced_logs()
        return old

    def drop_replaced_logs(self):
        """After the swap: the replaced plan's run logs (linked into its archive) leave runs/.
        A kill before this leaves them there, harmless: audit reads only the logs the current
        plan's runs name, and a new run's log replaces a file of the same name."""
        store = self.store
        for name in (RUNS, LEDGER + ".broken"):
            path = store.path(name)
            if os.path.isdir(path) and not os.path.islink(path):
                for entry in os.listdir(path):
                    if not entry.startswith("."):  # a run under way writes runs/.run-*
                        os.unlink(os.path.join(path, entry))
            elif os.path.lexists(path):
                os.unlink(path)

    def swap_ledger(self, data, plan, kind=None):
        """Replace the whole ledger with `data` and the snapshot with `plan`'s, crash-safe: the
        new ledger is written and fsynced beside the old one, the snapshot removed (from then a
        crash replays the new ledger from nothing), and one rename swaps it in. The rename is
        the moment the new ledger becomes current; before it, the old one still is. `kind`: the
        last event's, as a later failure names it (read from `data` when not given)."""
        self.require_lock()
        if kind is None:
            last = parse_event(data.rstrip(b"\n").rsplit(b"\n", 1)[-1])
            kind = last["event"] if last else "event"
        store = self.store
        staged = store.path(LEDGER + ".new")
        if os.path.lexists(staged):
            os.unlink(staged)  # left by a crash before its swap: never current
        fd = open_state_file(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            crash_point("before-ledger-write")
            write_all(fd, data)
            crash_point("after-ledger-write")
            os.fsync(fd)
            crash_point("after-ledger-fsync")
        finally:
            os.close(fd)
        self.ledger.close()
        if os.path.lexists(store.path(SNAPSHOT)):
            os.unlink(store.path(SNAPSHOT))
        os.replace(staged, store.path(LEDGER))
        try:
            fsync_dir(store.dir)
        except OSError as e:  # the rename is done and seen: the new plan is the current one
            store.warn(f"event {plan['ledger']['seq']} ({kind}) is recorded in {LEDGER}, but "
                       f"its folder could not be synced to disk ({e.strerror or e}).")
        self.recorded(plan, kind)

    def withdraw(self, data, plan, seq):
        """Take back this command's events from `seq` on, never acknowledged (a claim no other
        machine saw): the ledger becomes `data`, `plan` its plan (swap_ledger), and they no
        longer count as recorded by this command — as after a torn write, nothing of them
        stands."""
        recorded = self.store.recorded
        kept = [r for r in recorded if r[0] < seq]
        self.swap_ledger(data, plan)
        recorded[:] = kept

    def archive_current(self):
        """Copy the current plan into archive/<plan id>/, its run logs too (hard links: a
        constant time a file); returns what a new plan_created names as the plan it replaces."""
        store = self.store
        snap = loose_snapshot(store)
        plan_id = snap.get("plan_id") if snap else None
        head, seq = None, 0
        if self.ledger.open() is not None:
            end = self.ledger.end()[0]
            last = self.ledger.last(end) if end else None
            if last is not None:
                head = sha256_hex(last)
                ev = parse_event(last)
                seq = ev["seq"] if ev else None
        plan_id = (plan_id if is_plan_id(plan_id)
            else "unknown-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
        ensure_subdir(store.path(ARCHIVE))
        dest = free_name(store.path(os.path.join(ARCHIVE, plan_id)))
        os.mkdir(dest)
        for name in (SNAPSHOT, LEDGER):
            if os.path.lexists(store.path(name)):
                link_or_copy(store.path(name), os.path.join(dest, name))
        # the old plan's logs are linked in too: they leave runs/ only once the new plan is
        # current (drop_replaced_logs), so a kill before the swap leaves the old plan whole
        if os.path.lexists(store.path(LEDGER + ".broken")):
            link_or_copy(store.path(LEDGER + ".broken"), os.path.join(dest, LEDGER + ".broken"))
        runs = store.path(RUNS)
        if os.path.isdir(runs) and not os.path.islink(runs):
            os.mkdir(os.path.join(dest, RUNS))
            for entry in os.listdir(runs):
                if not entry.startswith(".") and os.path.isfile(os.path.join(runs, entry)):
                    link_or_copy(os.path.join(runs, entry), os.path.join(dest, RUNS, entry))
            fsync_dir(os.path.join(dest, RUNS))
        fsync_dir(dest)
        fsync_dir(store.dir)
        crash_point("after-archive-snapshot")
        self.plan = None
        return {"plan_id": plan_id, "head": head, "seq": seq,
                "path": os.path.relpath(dest, store.dir)}


#
def commit_start(session, story, agent):
    """`next`'s event: `story` in progress, for `agent` (None: whoever calls)."""
    session.commit("story_started", id=story["id"], title=story["title"], round=story["round"] + 1,
                   agent=agent)


def last_line_alone_damaged(ledger):
    """Whether the ledger's last whole line, and only it, is no event."""
    end = ledger.end()[0]
    if not end:
        return False
    offset, line = next(ledger.backward(end))
    prev = ledger.last(offset) if offset else None
    return parse_event(line) is None and (prev is None or parse_event(prev) is not None)
