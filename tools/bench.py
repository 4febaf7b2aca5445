#!/usr/bin/env python3
"""fablize benchmark: what users actually run, side by side with the original, in one run.

Every figure is a real process, started and reaped here: its CPU time (user + sys, from
os.wait4's rusage, which counts the processes it waited for too, so a hook script's own python3
children are in its figure) and its wall time. The variants of one row group run interleaved,
round-robin (one run of each variant a round, N rounds), after one untimed warm-up run of each.
A figure is a median; a ratio is the median of the per-round ratios, CPU first and wall in
parentheses: `×0.72 (wall ×0.80)`. CPU is the steadier of the two on a loaded machine; every bar
is judged on it. The timed processes get this environment without PYTHONDONTWRITEBYTECODE (nor
any other PYTHON* or FABLIZE_* variable), after the engine's bytecode is cached, so "cached"
means cached. Large states are built with the engine's own transitions (model.make_event), in a
child process, streaming to disk: the bench process stays small, and since a child's max RSS
counts what it inherited at exec, every max RSS figure is the measured command's own.

  1. starts       a 100-story plan: status, next, checkpoint, started every way there is
                  (bare interpreters, a floor script, the script, setup's hooks, the plugin,
                  the engine imported with site as installed), against the original's goals.py
  2. hooks        every hook setup writes and the plugin runs, against the original's hooks
  2b. the floor   every hook `setup claude` writes, run as written, against a floor script
                  doing the same file work with the same interpreter flags (--hooks: alone)
  3. large plans  10,000 and 100,000 stories, against the original (time and max RSS)
  4. a long real-run ledger   audit, rebuild, log, report against a bare parse+hash loop;
                  its events replay the fields real `verify` runs recorded
  5. a long last line         8 MB against 32 MB
  6. a shared plan            next/checkpoint against a local plan, then throughput across
                  clones of one bare remote (--no-sharing skips it)
  7. huge states  (only with --huge) status without goals.json on 10,000,000 events against
                  rebuild, and audit of 1,000,000 stories
  8. sizes users have (--sizes: alone) a plan worked as agents work it at 20, 200 and 2,000
                  stories: status, next, log, report, audit, rebuild — against another copy of
                  the engine with --against DIR (its scripts/ folder): how an optimisation is
                  judged, its twin without it measured beside it

  python3 tools/bench.py --original DIR            # all but --huge (some 15 minutes)
  python3 tools/bench.py --quick --original DIR    # fewer rounds, smaller ledgers
  python3 tools/bench.py --markdown --save docs/bench.json --original DIR
  python3 tools/bench.py --from docs/bench.json --markdown   # the same output, measuring nothing
  python3 tools/bench.py --hooks                     # 2b alone: the hooks against their floor
  python3 tools/bench.py --sizes --against DIR2      # 8 alone: this engine against DIR2's
DIR is a checkout of https://github.com/fivetaku/fablize; without it the rows that need it say
so. `--from` renders only what the saved file holds, so it reproduces the printed output.
Stdlib only, Python 3.9+.
"""

import argparse
import collections
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this file is in tools/
ENGINE = os.path.join(REPO, "scripts")  # goals.py and its package, as a user copies them
SCRIPT = os.path.join(ENGINE, "goals.py")
PLUGIN = os.path.join(REPO, "bin", "fablize")
sys.path.insert(0, ENGINE)

import fablize_gate  # noqa: E402  (the engine's own transitions build the states)
from fablize_gate import base, model, storage  # noqa: E402

PY = sys.executable
TS = "2026-01-01T00:00:00.000000+00:00"
FORMAT = 1                  # of the --save file
RUN_TIMEOUT = 600.0         # seconds, any one timed process
HUGE_TIMEOUT = 1200.0       # seconds, one run of section 7
AGENT_TIMEOUT = 120.0       # seconds, one command of a throughput agent
SHARING_DEADLINE = 900.0    # seconds, one throughput run
RUN_LOGS = 10_000           # run logs written beside the long ledger (the latest runs')
NEEDS_ORIGINAL = "(needs --original DIR)"
ORIGINAL_FILES = ("scripts/goals.py", "hooks/gate_stop.py", "hooks/gate_post_tool.py",
                  "hooks/gate_prompt.py", "hooks/router.sh", "hooks/finish-the-work.sh")
# the installed command's start (`from fablize_gate import run; run()`), without installing it
CACHED = f"import sys; sys.path.insert(0, {ENGINE!r}); from fablize_gate import cli; cli.run()"
GIT_ENV = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@localhost",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@localhost",
           "GIT_CONFIG_NOSYSTEM": "1"}

FLOOR = r'''
import fcntl, json, os, sys
d = sys.argv[1]
lock = os.open(os.path.join(d, "lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(lock, fcntl.LOCK_EX)
with open(os.path.join(d, "goals.json"), "rb") as f:
    plan = json.loads(f.read())
fd = os.open(os.path.join(d, "ledger.jsonl"), os.O_WRONLY | os.O_APPEND)
os.write(fd, b'{"seq":0,"event":"floor"}\n')
os.fsync(fd)
os.close(fd)
tmp = os.path.join(d, "goals.json.tmp")
fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.write(fd, json.dumps(plan).encode())
os.fsync(fd)
os.close(fd)
os.replace(tmp, os.path.join(d, "goals.json"))
dfd = os.open(d, os.O_RDONLY)
os.fsync(dfd)
os.close(dfd)
'''

BARE_LOOP = r'''
import hashlib, json, sys
n = 0
with open(sys.argv[1], "rb") as f:
    for line in f:
        json.loads(line)
        hashlib.sha256(line[:-1]).hexdigest()
        n += 1
print(n)
'''


def say(text):
    """Progress, on stderr: stdout holds only the report."""
    print(f"bench: {text}", file=sys.stderr, flush=True)


# Building states with the engine's own transitions ############################################


class Builder:
    """A plan grown event by event through model.make_event (the function every writing command
    uses), each line written out as it is made (no fsync a line), the snapshot at the end as the
    engine writes it. Memory stays what the plan holds, whatever the ledger's length."""

    def __init__(self, state_dir):
        os.makedirs(state_dir, exist_ok=True)
        self.dir = state_dir
        self.plan = None
        self.out = open(os.path.join(state_dir, base.LEDGER), "wb", buffering=1 << 20)

    @property
    def seq(self):
        return self.plan["ledger"]["seq"] if self.plan else 0

    def add(self, kind, fields, ts=TS):
        self.plan, _, line = model.make_event(self.plan, kind, dict(fields), ts=ts)
        self.out.write(line)
        self.out.write(b"\n")

    def create(self, stories, checks=0):
        specs = [{"id": base.story_id(i), "title": f"story {i}", "objective": f"objective {i}",
                  "after": [], "checks": ["true"] * checks, "accept": [], "judge": False}
                 for i in range(1, stories + 1)]
        specs[-1]["after"] = [s["id"] for s in specs[:-1]]
        self.add("plan_created", {"brief": "bench", "count": stories, "plan_id": "bench",
                                  "stories": specs, "options": {"rounds": 3, "require_run": False},
                                  "unverifiable": [], "replaces": None})
        return self

    def run(self, sid):
        """A passing run of the story's first frozen check."""
        seq = self.seq + 1
        self.add("verify_run", {
            "id": sid, "check": 0, "cmd": "true", "cwd": "/", "exit_code": 0, "signal": None,
            "timed_out": False, "error": None, "duration_s": 0.001, "bytes": 0,
            "sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "tail": "", "log": f"runs/{seq}-{sid}.log", "after_seq": seq - 1, "started": TS,
            "git_head": None, "git_dirty": None})

    def finish(self, snapshot=True):
        self.out.close()
        if snapshot:
            with open(os.path.join(self.dir, base.SNAPSHOT), "wb") as f:
                f.write(storage.snapshot_bytes(self.plan))
        return self.dir


def build_state(state, stories, active, runs):
    """`--build`: a plan of `stories` stories, G001 active when `active`, with `runs` runs."""
    b = Builder(state).create(stories, checks=1 if runs else 0)
    if active or runs:
        b.add("story_started", {"id": "G001", "title": "story 1", "round": 1, "agent": None})
    for _ in range(runs):
        b.run("G001")
    return b.finish()


def build_original(state, stories, active):
    """`--build-original`: the same plan in the original's own format, as its goals.py writes
    it (goals.json with brief/created/goals, indent=1; one ledger line an event)."""
    os.makedirs(state, exist_ok=True)
    plan = {"brief": "bench", "created": TS, "goals": [
        {"id": base.story_id(i), "title": f"story {i}", "objective": f"objective {i}",
         "status": "in_progress" if active and i == 1 else "pending", "evidence": None}
        for i in range(1, stories + 1)]}
    with open(os.path.join(state, "goals.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(plan, ensure_ascii=False, indent=1))
    events = [{"ts": TS, "event": "plan_created", "brief": "bench", "count": stories}]
    if active:
        events.append({"ts": TS, "event": "story_started", "id": "G001", "title": "story 1"})
    with open(os.path.join(state, "ledger.jsonl"), "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in events))


def event_fields(ev):
    """An event's own fields: what make_event is given (it adds seq, ts, event and prev)."""
    return {k: v for k, v in ev.items() if k not in ("seq", "ts", "event", "prev")}


def build_real(state, source, events, logs, snapshot=True):
    """`--build-real`: a ledger of `events` events whose every field is one a real run recorded.

    `source` is the state directory of real runs (a plan created, a story started, `verify`
    run a few times); its plan_created and story_started events are replayed, then its
    verify_run events in turn, each renumbered as the engine numbers a run (seq, after_seq one
    before it, log runs/<seq>-<story>.log) and otherwise unchanged: the same provenance, sizes,
    digests and timestamps. The last `logs` runs get their log file, holding the real output."""
    with open(os.path.join(source, base.LEDGER), "rb") as f:
        real = [json.loads(line) for line in f]
    created = next(e for e in real if e["event"] == "plan_created")
    started = next(e for e in real if e["event"] == "story_started")
    runs = [e for e in real if e["event"] == "verify_run"]
    output = {}
    for r in runs:
        with open(os.path.join(source, r["log"]), "rb") as f:
            output[r["seq"]] = f.read()
    b = Builder(state)
    b.add("plan_created", event_fields(created), ts=created["ts"])
    b.add("story_started", event_fields(started), ts=started["ts"])
    runs_dir = os.path.join(state, base.RUNS)
    os.makedirs(runs_dir, exist_ok=True)
    first_log = events - logs + 1
    for i in range(events - 2):
        r = runs[i % len(runs)]
        seq = b.seq + 1
        fields = event_fields(r)
        fields["after_seq"] = seq - 1
        fields["log"] = f"{base.RUNS}/{seq}-{r['id']}.log"
        b.add("verify_run", fields, ts=r["ts"])
        if seq >= first_log:
            with open(os.path.join(state, fields["log"]), "wb") as f:
                f.write(output[r["seq"]])
    return b.finish(snapshot)


def build_worked(state, source, events, logs):
    """`--build-worked`: a ledger of about `events` events, a plan worked as agents work it, story
    after story, each event one a real session recorded.

    `source` is the state directory of that session (worked_plan): a plan of a story and its
    final story, each worked through the hooks to completion. Its first story's events (from its
    start to its completion: starts, observed runs, a guard block, runs, checkpoints) are
    replayed for each of this plan's stories but the final one, whose own events come last; each
    event is renumbered as the engine numbers it (seq; a run's after_seq as far behind it, its log
    runs/<seq>-<story>.log; a checkpoint's runs the runs' new seqs) and names its story, and is
    otherwise unchanged. The last `logs` runs get their log file, holding the real output."""
    with open(os.path.join(source, base.LEDGER), "rb") as f:
        real = [json.loads(line) for line in f]
    created = real[0]
    work, final = created["stories"][0], created["stories"][-1]
    last = max(i for i, e in enumerate(real) if e.get("id") == work["id"])
    block, final_block = real[1:last + 1], real[last + 1:]
    output = {}
    for r in real:
        if r["event"] == "verify_run":
            with open(os.path.join(source, r["log"]), "rb") as f:
                output[r["seq"]] = f.read()
    stories = max(1, (events - 1 - len(final_block)) // len(block))
    runs_of = [sum(e["event"] == "verify_run" for e in b) for b in (block, final_block)]
    first_log = stories * runs_of[0] + runs_of[1] - logs  # the runs before it have no log
    specs = [dict(work, id=base.story_id(i)) for i in range(1, stories + 1)]
    specs.append(dict(final, id=base.story_id(stories + 1), after=[s["id"] for s in specs]))
    b = Builder(state)
    b.add("plan_created", dict(event_fields(created), stories=specs, count=len(specs)),
          ts=created["ts"])
    os.makedirs(os.path.join(state, base.RUNS), exist_ok=True)
    run = 0
    for sid, events_of_story in ([(s["id"], block) for s in specs[:-1]] +
                                 [(specs[-1]["id"], final_block)]):
        renumbered = {}
        for ev in events_of_story:
            seq = renumbered[ev["seq"]] = b.seq + 1
            fields = event_fields(ev)
            if "id" in fields:
                fields["id"] = sid
            if ev["event"] == "verify_run":
                fields["after_seq"] = seq - (ev["seq"] - ev["after_seq"])
                fields["log"] = f"{base.RUNS}/{seq}-{sid}.log"
                if run >= first_log:
                    with open(os.path.join(state, fields["log"]), "wb") as f:
                        f.write(output[ev["seq"]])
                run += 1
            if "runs" in fields:
                fields["runs"] = [renumbered[r] for r in fields["runs"]]
            b.add(ev["event"], fields, ts=ev["ts"])
    return b.finish()


def build_main(a):
    """The hidden --build* commands: each builds a state in this (child) process."""
    if a.build:
        state, stories, active, runs = a.build
        build_state(state, int(stories), active == "1", int(runs))
    elif a.build_original:
        state, stories, active = a.build_original
        build_original(state, int(stories), active == "1")
    elif a.build_worked:
        state, source, events, logs = a.build_worked
        build_worked(state, source, int(events), int(logs))
    else:
        state, source, events, logs, snapshot = a.build_real
        build_real(state, source, int(events), int(logs), snapshot == "1")
    return 0


def child_build(*args):
    subprocess.run([PY, os.path.abspath(__file__), *map(str, args)], check=True)


# Measuring ####################################################################################


def cache_engine(engine=None):
    """The engine's bytecode (`engine`: another copy's scripts/ folder), written into
    __pycache__ as an import would write it, even where PYTHONDONTWRITEBYTECODE is set: a
    missing or stale .pyc makes every "cached" start compile the engine again. The timed
    processes may refresh it themselves (their environment lets them), should the engine change
    while the bench runs."""
    import importlib.util
    import py_compile
    package = os.path.join(engine or ENGINE, "fablize_gate")
    for path in sorted(os.path.join(package, name) for name in os.listdir(package)
                       if name.endswith(".py")):
        py_compile.compile(path, cfile=importlib.util.cache_from_source(path), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)


def timed_env():
    """The environment of every timed process: this one without PYTHON* and FABLIZE_* variables
    (PYTHONDONTWRITEBYTECODE would make every cached start a compiling one, PYTHONUNBUFFERED
    would make a long output a write a line) nor a job summary for `report`; this interpreter's
    folder first on PATH, so that `python3` in the plugin's launcher and the original's shell
    hooks is this interpreter, not a version manager's shim."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "FABLIZE_", "GIT_")) and k != "GITHUB_STEP_SUMMARY"}
    env["PATH"] = os.path.dirname(PY) + os.pathsep + os.environ.get("PATH", "")
    return env


# The process that starts every timed one. A child's max RSS counts the memory of the process
# it was started from (Linux carries the parent's peak across exec), so the bench, holding the
# engine, would lend every figure its own 20-30 MiB: a small interpreter (-I -S, json only)
# forks and execs them instead, and reaps each with wait4. One request a line: [argv, cwd, env,
# stdin, stdout, stderr, memory cap or null]; it answers the pid, then [cpu, wall, maxrss, exit
# code]. Between fork and exec the child only sets its session, signals, limit and files.
SPAWNER = r'''
import json, os, resource, signal, sys, time
def child(argv, env, files, cap):
    try:
        os.setsid()
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        if cap is not None:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        for fd, path, flags in files:
            f = os.open(path, flags)
            os.dup2(f, fd)
            os.close(f)
        os.execve(argv[0], argv, env)
    finally:
        os._exit(127)
for line in sys.stdin.buffer:
    argv, cwd, env, stdin, stdout, stderr, cap = json.loads(line)
    files = [(0, stdin or os.devnull, os.O_RDONLY),
             (1, stdout or os.devnull, os.O_WRONLY | os.O_TRUNC),
             (2, stderr, os.O_WRONLY | os.O_TRUNC)]
    os.chdir(cwd)
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        child(argv, env, files, cap)
    sys.stdout.write("%d\n" % pid)
    sys.stdout.flush()
    _, status, ru = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    sys.stdout.write(json.dumps([ru.ru_utime + ru.ru_stime, wall, ru.ru_maxrss,
                                 os.waitstatus_to_exitcode(status)]) + "\n")
    sys.stdout.flush()
'''
_spawners = threading.local()


def spawner():
    """This thread's spawner (SPAWNER), started on first use."""
    proc = getattr(_spawners, "proc", None)
    if proc is None or proc.poll() is not None:
        proc = _spawners.proc = subprocess.Popen(
            [PY, "-I", "-S", "-c", SPAWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            cwd="/", env={"PATH": os.defpath}, text=True, bufsize=1)
    return proc


def close_spawner():
    proc = getattr(_spawners, "proc", None)
    if proc is not None:
        proc.stdin.close()
        proc.wait()
        _spawners.proc = None


class Result:
    __slots__ = ("cpu", "wall", "rss", "code", "out", "err", "timed_out")


def run_once(argv, cwd, env, stdin=None, timeout=RUN_TIMEOUT, capture=False, cap=None):
    """One process, started by this thread's spawner: a Result with its CPU seconds (user +
    sys, its own and its reaped children's), wall seconds, max RSS (MiB), exit code, stderr and
    (with `capture`) stdout. Output goes to files, never pipes, so a long one cannot stall it; a
    run past `timeout` is killed with its process group (timed_out); `cap` limits its address
    space (bytes)."""
    program = shutil.which(argv[0], path=env.get("PATH")) if os.sep not in argv[0] else argv[0]
    if program is None:
        raise SystemExit(f"bench: {argv[0]} is not on PATH")
    fd, err_path = tempfile.mkstemp(prefix="fablize-bench-err-")
    os.close(fd)
    out_path = None
    if capture:
        fd, out_path = tempfile.mkstemp(prefix="fablize-bench-out-")
        os.close(fd)
    try:
        return spawn(program, argv, cwd, env, stdin, out_path, err_path, timeout, cap)
    finally:
        for path in (out_path, err_path):
            if path is not None:
                os.remove(path)


def spawn(program, argv, cwd, env, stdin, out_path, err_path, timeout, cap):
    """run_once's request to the spawner, and the Result from its answer and the files."""
    proc = spawner()
    proc.stdin.write(json.dumps([[program, *map(str, argv[1:])], cwd, env, stdin, out_path,
                                 err_path, cap]) + "\n")
    pid = int(proc.stdout.readline())
    fired = []

    def kill():
        fired.append(True)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass

    timer = threading.Timer(timeout, kill)
    timer.daemon = True
    timer.start()
    try:
        cpu, wall, maxrss, code = json.loads(proc.stdout.readline())
    finally:
        timer.cancel()
    r = Result()
    r.cpu, r.wall, r.code, r.timed_out = cpu, wall, code, bool(fired)
    r.rss = maxrss / ((1 << 20) if sys.platform == "darwin" else 1024)
    r.out = b""
    if out_path is not None:
        with open(out_path, "rb") as f:
            r.out = f.read()
    with open(err_path, "rb") as f:
        r.err = f.read().decode("utf-8", "replace")
    return r


def memory_cap():
    """The address space a command that reads a whole long ledger may take: half the machine's
    memory, at most 16 GiB (None where it cannot be told). On a machine without swap, a command
    that holds the whole ledger would otherwise bring in the OOM killer for everyone."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return min(total // 2, 16 << 30)


def failed(argv, cwd, r, timeout=RUN_TIMEOUT):
    return SystemExit(f"bench: `{' '.join(map(str, argv))}` in {cwd} "
                      + (f"did not finish within {timeout:,.0f} s" if r.timed_out else
                         f"exited {r.code}: {r.err.strip()[-400:]}"))


class Variant:
    """One way of running one thing: a name, argv, cwd, a stdin file, a reset run before each of
    its runs (it puts back the state the run changes), the exit codes that are success."""

    def __init__(self, name, argv, cwd, stdin=None, reset=None, ok=(0,), env=None):
        self.name, self.argv, self.cwd, self.stdin = name, argv, cwd, stdin
        self.reset, self.ok, self.env = reset, ok, env


def new_samples():
    return {"cpu": [], "wall": [], "rss": []}


def add_sample(samples, r):
    samples["cpu"].append(r.cpu)
    samples["wall"].append(r.wall)
    samples["rss"].append(r.rss)


class Lab:
    """The bench's temporary world: its folder, the environments of the processes it times."""

    def __init__(self, root, original=None):
        self.root = root
        self.original = original
        self.env = timed_env()
        self.home = self.path("home")
        os.makedirs(self.home, exist_ok=True)
        # git's own world: no system or user configuration, a fixed identity
        self.git_env = dict(self.env, HOME=self.home, **GIT_ENV)
        self._pristine = {}

    def path(self, *parts):
        return os.path.join(self.root, *parts)

    def run(self, argv, cwd, env=None, check=True, **kw):
        r = run_once(argv, cwd, env or self.env, **kw)
        if check and (r.timed_out or r.code != 0):
            raise failed(argv, cwd, r, kw.get("timeout", RUN_TIMEOUT))
        return r

    def git(self, *args, cwd=None):
        subprocess.run(["git", *args], cwd=cwd or self.root, env=self.git_env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def measure(self, variants, rounds, warmup=True, timeout=RUN_TIMEOUT, cap=None):
        """{name: {"cpu": [...], "wall": [...], "rss": [...]}} of each variant: `rounds` rounds,
        each one run of every variant in the order given, after one untimed warm-up run of
        each; a variant's reset runs before each of its runs, untimed."""
        samples = {v.name: new_samples() for v in variants}
        for rnd in range(-1 if warmup else 0, rounds):
            for v in variants:
                if v.reset is not None:
                    v.reset()
                r = run_once(v.argv, v.cwd, v.env or self.env, stdin=v.stdin, timeout=timeout,
                             cap=cap)
                if r.timed_out or r.code not in v.ok:
                    raise failed(v.argv, v.cwd, r, timeout)
                if rnd >= 0:
                    add_sample(samples[v.name], r)
        return samples

    def pristine(self, stories, active, original=False):
        """A state directory built once (in a child process) and copied before each run."""
        key = (stories, active, original)
        if key not in self._pristine:
            path = self.path("pristine", f"{'original' if original else 'ours'}-{stories}-"
                             f"{int(active)}", ".fablize")
            if original:
                child_build("--build-original", path, stories, int(active))
            else:
                child_build("--build", path, stories, int(active), 0)
            self._pristine[key] = path
        return self._pristine[key]

    def project(self, name, stories, active, original=False):
        """A git repository `name` holding a plan, and the reset that puts the plan back."""
        project = self.path(name)
        os.makedirs(project)
        self.git("init", "-q", project)
        return project, copier(self.pristine(stories, active, original),
                               os.path.join(project, ".fablize"))


def copier(src, dst):
    """A reset: `dst` becomes a fresh copy of `src`."""
    def reset():
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    return reset


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(data)
    return path


def ours(*args):
    """The three ways the engine starts for a user, each with `args`."""
    return {"hook": [PY, "-I", "-S", SCRIPT, *args],         # what setup writes into hooks
            "plugin": [PLUGIN, *args],                        # the plugin's bin/fablize
            "cached": [PY, "-c", CACHED, *args]}              # the installed command's path


def original_file(lab, rel):
    return os.path.join(lab.original, rel)


# 1. Starts ####################################################################################

COMMANDS = {  # name: (arguments, whether G001 is active before it runs)
    "status": (["status"], False),
    "next": (["next"], False),
    "checkpoint": (["checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e"], True),
}


def bench_starts(lab, rounds, stories=100):
    """Per command on a `stories`-story plan: every way a command starts, interleaved, each in
    a git repository holding the plan (found from the current directory, as users run it)."""
    floor = write(lab.path("floor.py"), FLOOR)
    groups = {}
    for name, (args, active) in COMMANDS.items():
        project, reset = lab.project(f"starts-{name}", stories, active)
        state = os.path.join(project, ".fablize")
        launch = ours(*args)
        variants = [
            Variant("bare", [PY, "-c", "pass"], project),
            Variant("bare -I -S", [PY, "-I", "-S", "-c", "pass"], project),
            Variant("floor", [PY, floor, state], project, reset=reset),
            Variant("script", [PY, SCRIPT, *args], project, reset=reset),
            Variant("hook", launch["hook"], project, reset=reset),
            Variant("plugin", launch["plugin"], project, reset=reset),
            Variant("cached", launch["cached"], project, reset=reset),
        ]
        if lab.original:
            orig, orig_reset = lab.project(f"starts-{name}-original", stories, active, True)
            variants.append(Variant("original", [PY, original_file(lab, "scripts/goals.py"),
                                                 *args], orig, reset=orig_reset))
        say(f"starts: {name}, {stories} stories, {rounds} rounds")
        groups[name] = lab.measure(variants, rounds)
    return {"stories": stories, "rounds": rounds, "groups": groups}


# 2. Hooks #####################################################################################

SESSION = "bench-session"
PROMPT = "Refactor the parser thoroughly and fix the failing test in tests/test_parser.py"
TRANSCRIPT = [
    {"type": "user", "message": {"role": "user", "content": PROMPT}},
    {"type": "assistant", "message": {"role": "assistant", "content": [
        {"type": "text", "text": "Running the tests first."},
        {"type": "tool_use", "id": "toolu_01", "name": "Bash",
         "input": {"command": "pytest -q", "description": "Run the tests"}}]}},
    {"type": "user", "message": {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "4 passed in 0.05s"}]}},
    {"type": "assistant", "message": {"role": "assistant", "content": [
        {"type": "text", "text": "The parser is refactored and the four tests pass."}]}},
]


def hook_payloads(project, transcript):
    """The payloads Claude Code sends each hook, one shape for ours and the original's."""
    common = {"session_id": SESSION, "transcript_path": transcript, "cwd": project,
              "permission_mode": "default"}
    return {
        "SessionStart": dict(common, hook_event_name="SessionStart", source="startup"),
        "UserPromptSubmit": dict(common, hook_event_name="UserPromptSubmit", prompt=PROMPT),
        "Stop": dict(common, hook_event_name="Stop", stop_hook_active=False),
        "PostToolUse": dict(common, hook_event_name="PostToolUse", tool_name="Bash",
                            tool_input={"command": "pytest -q", "description": "Run the tests"},
                            tool_response={"stdout": "....\n4 passed in 0.05s\n", "stderr": "",
                                           "interrupted": False, "isImage": False,
                                           "exit_code": 0},
                            tool_use_id="toolu_02"),
        # seeds the original's per-session ledger: a file changed, nothing verified yet
        "Edit": dict(common, hook_event_name="PostToolUse", tool_name="Edit",
                     tool_input={"file_path": os.path.join(project, "parser.py"),
                                 "old_string": "a", "new_string": "b"},
                     tool_response={"filePath": os.path.join(project, "parser.py"),
                                    "success": True},
                     tool_use_id="toolu_03"),
    }


HOOKS = {  # event: (our command, the original's hooks for it)
    "SessionStart": (["status", "--resume"], ("router.sh", "gate_prompt.py")),
    "Stop": (["guard"], ("gate_stop.py", "finish-the-work.sh")),
    "PostToolUse": (["observe"], ("gate_post_tool.py",)),
}


def original_hook(lab, name):
    path = original_file(lab, "hooks/" + name)
    return ["bash", path] if name.endswith(".sh") else [PY, path]


def bench_hooks(lab, rounds):
    """Each hook as Claude Code runs it, in the project's directory with the same payload on
    stdin: ours started three ways, the original's for the same event. The plan has a story in
    progress (the guard blocks, observe records the run); the original's per-session ledger has
    a deep task with a changed file and nothing verified (gate_stop blocks, gate_post_tool
    records the run). Both states are put back before every run."""
    project, reset_ours = lab.project("hooks", 100, True)
    transcript = os.path.join(lab.home, "transcript.jsonl")
    write(transcript, "".join(json.dumps(line) + "\n" for line in TRANSCRIPT))
    payloads = {name: write(lab.path("payloads", name + ".json"), json.dumps(payload))
                for name, payload in hook_payloads(project, transcript).items()}
    env = dict(lab.env, TMPDIR=lab.root)  # finish-the-work.sh reads transcripts under TMPDIR
    resets = [reset_ours]
    if lab.original:
        data = lab.path("original-data")
        env.update(FABLIZE_DATA=data, CLAUDE_PLUGIN_ROOT=lab.original)
        for hook, payload in (("gate_prompt.py", "UserPromptSubmit"),
                              ("gate_post_tool.py", "Edit")):
            lab.run(original_hook(lab, hook), project, env=env, stdin=payloads[payload])
        shutil.copytree(data, data + ".pristine")
        resets.append(copier(data + ".pristine", data))

    def reset():
        for r in resets:
            r()

    groups = {}
    for event, (args, theirs) in HOOKS.items():
        variants = [Variant(name, argv, project, payloads[event], reset, env=env)
                    for name, argv in ours(*args).items()]
        if lab.original:
            stdin = payloads["UserPromptSubmit" if event == "SessionStart" else event]
            variants += [Variant(hook, original_hook(lab, hook), project, stdin, reset, env=env)
                         for hook in theirs]
        say(f"hooks: {event}, {rounds} rounds")
        groups[event] = lab.measure(variants, rounds)
    return {"rounds": rounds, "groups": groups}


# 2b. Hooks against the floor #################################################################

# What a hook must do at the least, with the same interpreter and flags as the line setup writes:
# read and parse its payload and the plan; for a writing hook, under the lock, one ledger append
# + fsync and one atomic snapshot (temp file, fsync, rename, fsync of the folder). A reader takes
# no lock, as the engine's readers take none.
HOOK_FLOOR = r"""
import fcntl, json, os, sys
d, write = sys.argv[1], sys.argv[2:] == ["write"]
payload = json.loads(sys.stdin.buffer.read())
if write:
    lock = os.open(os.path.join(d, "lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
with open(os.path.join(d, "goals.json"), "rb") as f:
    plan = json.loads(f.read())
if write:
    fd = os.open(os.path.join(d, "ledger.jsonl"), os.O_WRONLY | os.O_APPEND)
    os.write(fd, json.dumps({"seq": 0, "event": "floor", "payload": payload}).encode() + b"\n")
    os.fsync(fd)
    os.close(fd)
    tmp = os.path.join(d, "goals.json.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(fd, json.dumps(plan).encode())
    os.fsync(fd)
    os.close(fd)
    os.replace(tmp, os.path.join(d, "goals.json"))
    dfd = os.open(d, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
"""
# each hook `setup claude` writes: (its event, its payload, whether it writes in this state)
FLOOR_HOOKS = (("SessionStart", "SessionStart", False), ("Stop", "Stop", True),
               ("PostToolUse", "PostToolUse", True),
               ("PostToolUseFailure", "PostToolUseFailure", True))
HOOK_FLOOR_BAR = 1.3  # every hook setup writes, against the floor doing the same file work


def written_hooks(project):
    """{event: command line} of the hooks `setup claude` wrote into the project's settings."""
    with open(os.path.join(project, ".claude", "settings.json"), encoding="utf-8") as f:
        config = json.load(f)
    return {event: group["hooks"][0]["command"]
            for event, groups in config["hooks"].items() for group in groups}


def bench_hook_floor(lab, rounds):
    """Each hook `setup claude` writes, run as written — through `sh -c`, as Claude Code runs a
    hook command, in the project with CLAUDE_PROJECT_DIR set as Claude Code sets it, its payload
    on stdin — against the floor script run the same way with the interpreter and flags of the
    same line; and the same line without CLAUDE_PROJECT_DIR (its fallback). The project holds a
    copy of the engine (scripts/goals.py and fablize_gate/, bytecode cached) as a user's does,
    and a 100-story plan with a story in progress: the guard blocks and records it, observe
    records the run. The plan is put back before every run."""
    project, reset = lab.project("hook-floor", 100, True)
    shutil.copytree(os.path.join(ENGINE, "fablize_gate"),
                    os.path.join(project, "scripts", "fablize_gate"))
    shutil.copy2(SCRIPT, os.path.join(project, "scripts", "goals.py"))
    lab.run([PY, os.path.join(project, "scripts", "goals.py"), "setup", "claude"], project,
            env=lab.git_env)
    lines = written_hooks(project)
    floor = write(lab.path("hook-floor.py"), HOOK_FLOOR)
    transcript = os.path.join(lab.home, "transcript.jsonl")
    write(transcript, "".join(json.dumps(line) + "\n" for line in TRANSCRIPT))
    payloads = hook_payloads(project, transcript)
    payloads["PostToolUseFailure"] = dict(
        payloads["PostToolUse"], hook_event_name="PostToolUseFailure",
        error="Exit code 1\n....F\n1 failed, 4 passed in 0.06s")
    del payloads["PostToolUseFailure"]["tool_response"]
    harness = dict(lab.env, CLAUDE_PROJECT_DIR=project)
    unset = {k: v for k, v in lab.git_env.items() if k != "CLAUDE_PROJECT_DIR"}  # git finds it
    state = os.path.join(project, ".fablize")
    groups = {}
    for event, shape, writes in FLOOR_HOOKS:
        line = lines[event]
        flags = line[:line.index('"')]  # `python3 -I -S `: the interpreter as the line starts it
        stdin = write(lab.path("payloads", f"floor-{event}.json"), json.dumps(payloads[shape]))
        floor_line = f"{flags}{floor} {state}" + (" write" if writes else "")
        variants = [Variant("floor", ["sh", "-c", floor_line], project, stdin, reset, env=harness),
                    Variant("hook", ["sh", "-c", line], project, stdin, reset, env=harness),
                    Variant("hook, unset", ["sh", "-c", line], project, stdin, reset,
                            env=unset)]
        say(f"hooks against the floor: {event}, {rounds} rounds")
        groups[event] = {"line": line.replace(project, "<project>"), "writes": writes,
                         "variants": lab.measure(variants, rounds)}
    return {"rounds": rounds, "stories": 100, "groups": groups}


# 3. Large plans ###############################################################################


def bench_large(lab, sizes, rounds):
    """status, next and checkpoint at each size: ours as users type it (the script), as setup's
    hooks start it (-I -S), and the original's goals.py."""
    groups = []
    for stories, n in zip(sizes, rounds):
        for name, (args, active) in COMMANDS.items():
            project, reset = lab.project(f"large-{stories}-{name}", stories, active)
            variants = [
                Variant("script", [PY, SCRIPT, *args], project, reset=reset),
                Variant("hook", [PY, "-I", "-S", SCRIPT, *args], project, reset=reset),
            ]
            if lab.original:
                orig, orig_reset = lab.project(f"large-{stories}-{name}-original", stories,
                                               active, True)
                variants.append(Variant("original", [PY, original_file(lab, "scripts/goals.py"),
                                                     *args], orig, reset=orig_reset))
            say(f"large plans: {name}, {stories:,} stories, {n} rounds")
            groups.append({"stories": stories, "command": name, "rounds": n,
                           "variants": lab.measure(variants, n)})
    return {"groups": groups}


# 4. A long real-run ledger ####################################################################

REAL_CHECK = "python3 -c 'print(1)'"
REAL_VERIFIES = 3


def real_runs(lab):
    """A plan made and verified as a user makes it, in a fresh git repository with one commit:
    create with a frozen check, next, verify a few times. Returns its state directory."""
    project = lab.path("real")
    os.makedirs(project)
    lab.git("init", "-q", project)
    write(os.path.join(project, "README.md"), "a project\n")
    lab.git("add", "README.md", cwd=project)
    lab.git("commit", "-qm", "a first commit", cwd=project)
    steps = [["create", "--brief", "bench: real runs", "--goal", "build::build the thing",
              "--goal", "verify::it works", "--check", f"G001={REAL_CHECK}"], ["next"]]
    for args in steps + [["verify", "--id", "G001"]] * REAL_VERIFIES:
        lab.run([PY, SCRIPT, *args], project, env=lab.git_env)
    return os.path.join(project, ".fablize")


def ledger_commands(lab, state, rounds, what):
    """audit, rebuild, log and report of the ledger in `state`, each right after a run of a bare
    loop that parses and hashes the same lines: a machine whose speed drifts within a round (a
    2-core machine others use) moves a command and its own loop run alike, and its rate is
    taken against that run."""
    ledger = os.path.join(state, base.LEDGER)
    loop = write(lab.path("bare_loop.py"), BARE_LOOP)

    def no_backups():  # rebuild keeps the old snapshot as goals.json.<time>.bak
        for name in os.listdir(state):
            if name.endswith(".bak"):
                os.remove(os.path.join(state, name))

    variants = []
    for cmd in LEDGER_COMMANDS:
        variants += [Variant(LOOP_BEFORE[cmd], [PY, loop, ledger], lab.root),
                     Variant(cmd, [PY, SCRIPT, "--dir", state, cmd], lab.root, reset=no_backups)]
    say(f"{what}: audit, rebuild, log, report, {rounds} rounds")
    return lab.measure(variants, rounds, cap=memory_cap())


def audited(lab, state):
    """What audit --json says of a ledger: its runs, and their logs found."""
    return json.loads(lab.run([PY, SCRIPT, "--dir", state, "audit", "--json"], lab.root,
                              capture=True).out)


def bench_ledger(lab, events, rounds):
    """audit, rebuild, log and report of a long ledger of real-run events against a bare loop
    that parses and hashes the same lines; then status on it against status on the same plan
    with three events."""
    source = real_runs(lab)
    with open(os.path.join(source, base.LEDGER), "rb") as f:
        real = [line for line in f if b'"event":"verify_run"' in line]
    big = lab.path("ledger-big", ".fablize")
    small = lab.path("ledger-small", ".fablize")
    logs = min(RUN_LOGS, events - 2)
    say(f"ledger: building {events:,} events from {len(real)} real runs")
    child_build("--build-real", big, source, events, logs, 1)
    child_build("--build-real", small, source, 3, 1, 1)
    size = os.path.getsize(os.path.join(big, base.LEDGER))
    report = audited(lab, big)
    commands = ledger_commands(lab, big, rounds, f"ledger of {events:,} events")
    say(f"ledger: status, {rounds} rounds")
    status = lab.measure([Variant("3 events", [PY, SCRIPT, "--dir", small, "status"], lab.root),
                          Variant("long", [PY, SCRIPT, "--dir", big, "status"], lab.root)],
                         rounds)
    return {"events": events, "bytes": size, "real_runs": len(real),
            "real_line_bytes": [len(line) for line in real], "logs_written": logs,
            "logs_checked": report["run_count"] - report["missing_logs"],
            "rounds": rounds, "commands": commands, "status": status}


WORKED_FILES = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "test_calc.py": 'from calc import add\n'
                    'assert add(2, 3) == 5, f"add(2, 3) returned {add(2, 3)}, expected 5"\n'
                    'print("test_calc: 1 passed")\n'}
WORKED_CHECK = "python3 test_calc.py"
WORKED_FAILURE = ("Exit code 1\nTraceback (most recent call last):\n  File \"test_calc.py\", "
                  "line 2, in <module>\nAssertionError: add(2, 3) returned -1, expected 5")


def worked_plan(lab):
    """A plan worked as an agent works it under Claude Code's hooks, every step a real process,
    in a fresh git repository holding a bug and its test: create (a frozen check on the story,
    the test as the final gate), next; the agent runs the test twice (it fails: observed), tries
    to stop (the Stop hook blocks), claims the story done (the engine runs the check: it fails,
    the claim is refused), says it failed; round 2: fixes the bug, runs the test (observed),
    completes (the check runs and passes); then the final story the same way. The fix is not
    committed, as an agent leaves it. Returns the state directory."""
    project = lab.path("worked")
    os.makedirs(project)
    lab.git("init", "-q", project)
    for name, text in WORKED_FILES.items():
        write(os.path.join(project, name), text)
    lab.git("add", ".", cwd=project)
    lab.git("commit", "-qm", "add() and its test", cwd=project)
    transcript = write(os.path.join(lab.home, "worked.jsonl"),
                       "".join(json.dumps(line) + "\n" for line in TRANSCRIPT))
    hooks = hook_payloads(project, transcript)
    ran = {"tool_input": {"command": WORKED_CHECK, "description": "Run the test"}}
    payloads = {name: write(lab.path("payloads", f"worked-{name}.json"), json.dumps(payload))
                for name, payload in (
                    ("failed", dict(hooks["PostToolUse"], hook_event_name="PostToolUseFailure",
                                    error=WORKED_FAILURE, **ran)),
                    ("passed", dict(hooks["PostToolUse"], **ran, tool_response={
                        "stdout": "test_calc: 1 passed\n", "stderr": "", "interrupted": False,
                        "isImage": False})),
                    ("stop", hooks["Stop"]))}

    def step(*args, stdin=None, code=0):
        r = lab.run([PY, SCRIPT, *args], project, env=lab.git_env, stdin=stdin, check=False)
        if r.timed_out or r.code != code:
            raise failed([PY, SCRIPT, *args], project, r)

    step("create", "--brief", "Fix add() in calc.py", "--goal", "Fix add::add(2, 3) returns 5",
         "--goal", "Verify::the tests pass", "--check", f"G001={WORKED_CHECK}",
         "--verify", WORKED_CHECK)
    step("next")
    step("observe", stdin=payloads["failed"])
    step("observe", stdin=payloads["failed"])
    step("guard", stdin=payloads["stop"])
    step("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "fixed add()",
         code=1)
    step("checkpoint", "--id", "G001", "--status", "failed", "--evidence",
         "add() still subtracts: the test says add(2, 3) returned -1")
    step("next")
    write(os.path.join(project, "calc.py"), WORKED_FILES["calc.py"].replace("a - b", "a + b"))
    # the fix has the old file's size and may have its mtime: Python would keep the old bytecode
    shutil.rmtree(os.path.join(project, "__pycache__"), ignore_errors=True)
    step("observe", stdin=payloads["passed"])
    step("checkpoint", "--id", "G001", "--status", "complete", "--evidence",
         "add() adds; test_calc passes")
    step("next")
    step("observe", stdin=payloads["passed"])
    step("checkpoint", "--id", "G002", "--status", "complete", "--evidence", "the suite is green")
    return os.path.join(project, ".fablize")


def bench_worked(lab, events, rounds):
    """audit, rebuild, log and report of a plan worked as agents work it (worked_plan's session,
    story after story) against the bare loop over the same file; then rebuild of a plan a tenth
    its size, whose cost an event tells whether the replay stays linear in the stories."""
    source = worked_plan(lab)
    with open(os.path.join(source, base.LEDGER), "rb") as f:
        session = [json.loads(line) for line in f]
    kinds = collections.Counter(e["event"] for e in session)
    sizes = {}
    for name, n in (("small", events // 10), ("big", events)):
        state = sizes[name] = lab.path(f"worked-{name}", ".fablize")
        say(f"worked plan: building {n:,} events from a real session of {len(session)}")
        child_build("--build-worked", state, source, n, RUN_LOGS)
    state = sizes["big"]
    report = audited(lab, state)
    commands = ledger_commands(lab, state, rounds, "worked plan")
    say(f"worked plan: audit and rebuild of a tenth of it, {rounds} rounds")
    small = lab.measure([Variant(cmd, [PY, SCRIPT, "--dir", sizes["small"], cmd], lab.root,
                                 ok=(0, 1)) for cmd in ("audit", "rebuild")], rounds)
    return {**{f"{key}_{name}": value for name, path in sizes.items()
               for key, value in worked_size(path).items()},
            "session": dict(kinds.most_common()),
            "logs_written": min(RUN_LOGS, report["run_count"]), "run_count": report["run_count"],
            "logs_checked": report["run_count"] - report["missing_logs"],
            "rounds": rounds, "commands": commands, "rebuild_small": small["rebuild"],
            "audit_small": small["audit"]}


# 8. Sizes users have ##########################################################################


SIZES = (20, 200, 2000)
SIZE_COMMANDS = (("status",), ("next",), ("log",), ("report",), ("audit",), ("rebuild",))


def worked_events(source, stories):
    """The events of a worked plan of `stories` stories (build_worked's count for it)."""
    with open(os.path.join(source, base.LEDGER), "rb") as f:
        real = [json.loads(line) for line in f]
    work = real[0]["stories"][0]["id"]
    last = max(i for i, e in enumerate(real) if e.get("id") == work)
    block, final_block = last, len(real) - last - 1
    return 1 + (stories - 1) * block + final_block


def bench_sizes(lab, rounds, against=None):
    """Each command at the plan sizes users have — a plan worked as agents work it (worked_plan's
    session, story after story, to the end) at 20, 200 and 2,000 stories — for this engine and,
    with `against`, another copy of it, run interleaved: the figure that keeps an optimisation
    or takes it out."""
    source = worked_plan(lab)
    engines = [("this", SCRIPT)]
    if against:
        cache_engine(against)
        engines.append(("against", os.path.join(against, "goals.py")))
    rows = {}
    for stories in SIZES:
        state = lab.path(f"sizes-{stories}", ".fablize")
        say(f"sizes: building a worked plan of {stories:,} stories")
        child_build("--build-worked", state, source, worked_events(source, stories), RUN_LOGS)
        pristine = lab.path(f"sizes-{stories}-pristine")
        shutil.copytree(state, pristine)
        reset = copier(pristine, state)
        variants = [Variant(f"{cmd[0]}/{name}", [PY, script, "--dir", state, *cmd], lab.root,
                            reset=reset, ok=(0, 1))
                    for cmd in SIZE_COMMANDS for name, script in engines]
        say(f"sizes: {stories:,} stories, {rounds} rounds")
        rows[str(stories)] = {"size": worked_size(state), "samples": lab.measure(variants, rounds)}
    return {"rounds": rounds, "against": against, "sizes": rows}


def render_sizes(page, sec):
    page.heading("8. Sizes users have: a plan worked as agents work it")
    against = sec.get("against")
    page.text("CPU median (wall in parentheses) of each command on a worked plan of each size"
              + (f"; `against`: the engine in {against}, run interleaved with this one, and the "
                 "median per-round ratio against / this" if against else "") + ".")
    headers = ["stories (events)", *[c[0] for c in SIZE_COMMANDS]]
    rows = []
    for stories, row in sec["sizes"].items():
        samples = row["samples"]
        cells = [f"{int(stories):,} ({row['size']['events']:,})"]
        for cmd in SIZE_COMMANDS:
            this = samples[f"{cmd[0]}/this"]
            text = cell(this)
            if against:
                text += " vs " + cell(samples[f"{cmd[0]}/against"]) + " " + times(
                    samples[f"{cmd[0]}/against"], this)
            cells.append(text)
        rows.append(cells)
    page.table(headers, rows)


def worked_size(state):
    """The events, stories and bytes of a plan's ledger."""
    ledger = os.path.join(state, base.LEDGER)
    with open(ledger, "rb") as f:
        events = sum(1 for _ in f)
    with open(os.path.join(state, base.SNAPSHOT), "rb") as f:
        stories = len(storage.parse_snapshot(f.read(), whole=True)["goals"])
    return {"events": events, "stories": stories, "bytes": os.path.getsize(ledger)}


# 5. A long last line ##########################################################################


def bench_long_line(lab, rounds):
    """Reading the ledger's last line backwards: a 32 MB line against an 8 MB one. The line is
    read whole, then found to be no event: a complete line that does not parse is damage, exit 3
    with one line saying where."""
    variants = []
    for mb in (8, 32):
        d = lab.path(f"line{mb}", ".fablize")
        os.makedirs(d)
        with open(os.path.join(d, base.LEDGER), "wb") as f:  # one oversized, unparsable line
            f.write(b'{"seq":1,"event":"x","pad":"' + b"x" * (mb << 20) + b'"\n')
        variants.append(Variant(f"{mb} MB", [PY, SCRIPT, "--dir", d, "status"], lab.root, ok=(3,)))
    say(f"long last line, {rounds} rounds")
    return {"rounds": rounds, "variants": lab.measure(variants, rounds)}


# 6. A shared plan #############################################################################

HANDOFF = re.compile(rb"handoff \xe2\x80\x94 (G\d+)")  # "=== fablize handoff — G001 …"
NOTHING_READY = "nothing is ready"
LAUNCH = [PY, "-I", "-S", SCRIPT]  # as setup's hooks start it


def new_plan(lab, clone, stories, shared):
    goals_args = [f"--goal=story {i}::objective {i}" for i in range(1, stories + 1)]
    lab.run([*LAUNCH, "create", "--brief", "bench", "--parallel",
             *(["--remote", "origin"] if shared else []), *goals_args], clone, env=lab.git_env)


def bench_sharing_cost(lab, rounds, stories=100):
    """`next --agent a` and `checkpoint` of the story it handed out, in a plan shared through a
    local bare remote and in a local one, interleaved: a round is next local, next shared,
    checkpoint local, checkpoint shared (each plan moves on one story a round)."""
    remote = lab.path("cost.git")
    lab.git("init", "-q", "--bare", remote)
    clones = {}
    for kind in ("local", "shared"):
        clones[kind] = lab.path(f"cost-{kind}")
        lab.git("clone", "-q", remote, clones[kind])
        new_plan(lab, clones[kind], stories, kind == "shared")
    samples = {f"{cmd}, {kind}": new_samples() for cmd in ("next", "checkpoint")
               for kind in clones}
    for rnd in range(-1, min(rounds, stories - 2)):
        ids = {}
        for kind, clone in clones.items():
            r = lab.run([*LAUNCH, "next", "--agent", "a"], clone, env=lab.git_env, capture=True)
            ids[kind] = HANDOFF.search(r.out).group(1).decode()
            if rnd >= 0:
                add_sample(samples[f"next, {kind}"], r)
        for kind, clone in clones.items():
            r = lab.run([*LAUNCH, "checkpoint", "--id", ids[kind], "--status", "complete",
                         "--evidence", "bench", "--agent", "a"], clone, env=lab.git_env)
            if rnd >= 0:
                add_sample(samples[f"checkpoint, {kind}"], r)
    return samples


def shared_plan_cost(root, n):
    """{"local": (next ms, checkpoint ms), "shared": (…)}: median wall times of
    bench_sharing_cost in `root` (tests/test_sharing.py runs it)."""
    samples = bench_sharing_cost(Lab(root), n)
    return {kind: tuple(statistics.median(samples[f"{cmd}, {kind}"]["wall"]) * 1000
                        for cmd in ("next", "checkpoint")) for kind in ("local", "shared")}


def count_exit(tally, cmd, r):
    """Count the exit code of `cmd`; for a failure, what it said (numbers as #, to group)."""
    tally[cmd][str(r.code)] = tally[cmd].get(str(r.code), 0) + 1
    tally["cpu"] += r.cpu
    if r.code != 0:
        lines = r.err.strip().splitlines() or ["(nothing on stderr)"]
        said = tally["said"].setdefault(f"{cmd} exit {r.code}", {})
        text = re.sub(r"\d+", "#", lines[-1])[:240]
        said[text] = said.get(text, 0) + 1


def agent(lab, clone, name, deadline, tally):
    """One agent: `next --agent NAME`, then `checkpoint` of the story it handed out, until next
    says nothing is ready or the plan is done (or ten failures in a row: it gives up)."""
    try:
        agent_loop(lab, clone, name, deadline, tally)
    finally:
        close_spawner()


def agent_loop(lab, clone, name, deadline, tally):
    failures = 0
    while time.monotonic() < deadline and failures < 10:
        r = lab.run([*LAUNCH, "next", "--agent", name], clone, env=lab.git_env, check=False,
                    capture=True, timeout=AGENT_TIMEOUT)
        count_exit(tally, "next", r)
        if r.code == 1 and NOTHING_READY in r.err:
            tally["nothing_ready"] += 1
            return
        m = HANDOFF.search(r.out) if r.code == 0 else None
        if m is None:
            if r.code == 0:  # "all stories complete"
                return
            failures += 1
            continue
        args = ["checkpoint", "--id", m.group(1).decode(), "--status", "complete",
                "--evidence", "x", "--agent", name]
        if b"Final story" in r.out:  # the verification gate: a command and its result
            args += ["--verify-cmd", "true", "--verify-evidence", "ok"]
        c = lab.run([*LAUNCH, *args], clone, env=lab.git_env, check=False, timeout=AGENT_TIMEOUT)
        count_exit(tally, "checkpoint", c)
        if c.code == 0:
            tally["completions"] += 1
            failures = 0
        else:
            failures += 1
    tally["gave_up"] += 1


def merge_counts(into, counts):
    for key, value in counts.items():
        if isinstance(value, dict):
            merge_counts(into.setdefault(key, {}), value)
        else:
            into[key] = into.get(key, 0) + value


def bench_throughput(lab, clones, stories=100):
    """For C clones of a fresh bare remote sharing one `stories`-story --parallel plan, two
    agents in each clone working it through (agent()): completions a second of wall time."""
    results = []
    for c in clones:
        base = lab.path(f"throughput-{c}")
        remote = os.path.join(base, "remote.git")
        os.makedirs(base)
        lab.git("init", "-q", "--bare", remote)
        creator = os.path.join(base, "creator")
        lab.git("clone", "-q", remote, creator)
        new_plan(lab, creator, stories, True)
        paths = []
        for i in range(c):
            paths.append(os.path.join(base, f"clone{i}"))
            lab.git("clone", "-q", remote, paths[-1])
            lab.run([*LAUNCH, "sync"], paths[-1], env=lab.git_env)
        tallies = [{"cpu": 0.0, "next": {}, "checkpoint": {}, "completions": 0,
                    "nothing_ready": 0, "gave_up": 0, "said": {}} for _ in range(2 * c)]
        say(f"throughput: {c} clones × 2 agents")
        start = time.monotonic()
        deadline = start + SHARING_DEADLINE
        threads = [threading.Thread(target=agent, args=(lab, paths[k // 2], f"c{k // 2}a{k % 2}",
                                                        deadline, tallies[k]))
                   for k in range(2 * c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - start
        lab.run([*LAUNCH, "sync"], creator, env=lab.git_env)
        status = json.loads(lab.run([*LAUNCH, "status", "--json"], creator, env=lab.git_env,
                                    capture=True).out)
        total = {"clones": c, "agents": 2 * c, "wall": wall, "stories": stories,
                 "done": status.get("done"), "finished": wall < SHARING_DEADLINE,
                 "deadline": SHARING_DEADLINE}
        for key in ("cpu", "completions", "nothing_ready", "gave_up"):
            total[key] = sum(t[key] for t in tallies)
        for key in ("next", "checkpoint", "said"):
            total[key] = {}
            for t in tallies:
                merge_counts(total[key], t[key])
        results.append(total)
    return results


def bench_sharing(lab, rounds, clones):
    say(f"shared plan: next and checkpoint against a local plan, {rounds} rounds")
    return {"rounds": min(rounds, 98), "cost": bench_sharing_cost(lab, rounds),
            "throughput": bench_throughput(lab, clones)}


# 7. Huge states ###############################################################################


def once(lab, argv, reset=None):
    """One run (no warm-up: a warm-up would double a run of minutes), with the huge timeout and
    the memory cap: {"cpu": [s], "wall": [s], "rss": [MiB]}, else {"timeout": s} or
    {"failed": exit code, "said": its last line, "cap": bytes}."""
    if reset is not None:
        reset()
    cap = memory_cap()
    r = run_once(argv, lab.root, lab.env, timeout=HUGE_TIMEOUT, cap=cap)
    if r.timed_out:
        return {"timeout": HUGE_TIMEOUT}
    if r.code != 0:
        lines = r.err.strip().splitlines() or ["(nothing on stderr)"]
        return {"failed": r.code, "said": lines[-1][:300], "cap": cap}
    samples = new_samples()
    add_sample(samples, r)
    return samples


def bench_huge(lab, events, stories):
    """status with no goals.json on a long ledger (it replays the ledger) against rebuild of the
    same ledger, and audit of a plan with many stories (its max RSS)."""
    source = lab.path("real", ".fablize")
    if not os.path.isdir(source):
        source = real_runs(lab)
    state = lab.path("huge-ledger", ".fablize")
    say(f"huge: building {events:,} events")
    child_build("--build-real", state, source, events, 0, 0)
    size = os.path.getsize(os.path.join(state, base.LEDGER))

    def no_snapshot():
        for name in os.listdir(state):
            if name == base.SNAPSHOT or name.endswith(".bak"):
                os.remove(os.path.join(state, name))

    say("huge: status without goals.json")
    status = once(lab, [PY, SCRIPT, "--dir", state, "status"], no_snapshot)
    say("huge: rebuild")
    rebuild = once(lab, [PY, SCRIPT, "--dir", state, "rebuild"], no_snapshot)
    shutil.rmtree(os.path.dirname(state))
    plan = lab.path("huge-plan", ".fablize")
    say(f"huge: building {stories:,} stories")
    child_build("--build", plan, stories, 0, 0)
    plan_bytes = os.path.getsize(os.path.join(plan, base.SNAPSHOT))
    say("huge: audit")
    audit = once(lab, [PY, SCRIPT, "--dir", plan, "audit"])
    return {"events": events, "bytes": size, "status": status, "rebuild": rebuild,
            "stories": stories, "snapshot_bytes": plan_bytes, "audit": audit}


# Rendering: a pure function of the saved measurements #########################################


def median(xs):
    return statistics.median(xs)


def per_round(a, b, key):
    """The median of the per-round ratios a/b."""
    return median([x / y for x, y in zip(a[key], b[key])])


def summed(*samples):
    """Variants run one after the other for one event (two hooks): per-round sums."""
    return {"cpu": [sum(x) for x in zip(*(s["cpu"] for s in samples))],
            "wall": [sum(x) for x in zip(*(s["wall"] for s in samples))],
            "rss": [max(x) for x in zip(*(s["rss"] for s in samples))]}


def cell(s):
    """ms CPU (wall), for a table cell."""
    return f"{median(s['cpu']) * 1e3:.1f} ({median(s['wall']) * 1e3:.1f})"


def dur(seconds):
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def took(s):
    return f"{dur(median(s['cpu']))} (wall {dur(median(s['wall']))})"


def times(a, b):
    return f"×{per_round(a, b, 'cpu'):.2f} (wall ×{per_round(a, b, 'wall'):.2f})"


def rss(s):
    return f"{median(s['rss']):,.0f} MiB"


def met(ok):
    return "met" if ok else "NOT met"


def bar_by(names, values, ok):
    """Which of the named ratios meet a bar."""
    good = [n for n, v in zip(names, values) if ok(v)]
    if len(good) == len(names):
        return "met by all " + ("three" if len(names) == 3 else str(len(names)))
    bad = [n for n in names if n not in good]
    return (f"met by {', '.join(good)}; " if good else "") + f"NOT met by {', '.join(bad)}"


def table(headers, rows, markdown, left=1):
    """A table whose first `left` columns are labels (aligned left), the rest figures."""
    if markdown:
        return ["| " + " | ".join(headers) + " |",
                "|" + "|".join("---" if i < left else "---:" for i in range(len(headers))) + "|",
                *("| " + " | ".join(row) + " |" for row in rows)]
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    return ["  ".join(x.ljust(w) if i < left else x.rjust(w)
                      for i, (x, w) in enumerate(zip(row, widths))).rstrip()
            for row in [headers, *rows]]


class Page:
    """The output, as Markdown or plain text: headings, tables, figure lines."""

    def __init__(self, markdown):
        self.markdown = markdown
        self.lines = []

    def heading(self, text):
        self.lines += ["", f"### {text}" if self.markdown else text, ""]

    def text(self, text):
        self.lines.append(text)

    def figure(self, text):
        self.lines.append(f"- {text}" if self.markdown else text)

    def table(self, headers, rows, left=1):
        self.lines.append("")
        self.lines += table(headers, rows, self.markdown, left)
        self.lines.append("")


STARTS = [  # key, header
    ("bare", "bare"), ("bare -I -S", "bare -I -S"), ("floor", "floor"), ("script", "script"),
    ("hook", "hook"), ("plugin", "plugin"), ("cached", "cached (with site)"),
    ("original", "original")]
OURS = [("hook", "hook"), ("plugin", "plugin"), ("cached", "cached (with site)")]


def render_header(page, data):
    m = data["meta"]
    page.text(f"python {m['python']}, {m['cores']} cores, load average "
              f"{' '.join(f'{x:.2f}' for x in m['load'])} at the start, "
              f"{m['load_end'][0]:.2f} at the end; {m['rounds']} rounds "
              "(interleaved: one run of each variant a round, after one warm-up run of each); "
              "CPU is user+sys of the child (os.wait4), wall in parentheses; medians, and "
              "ratios are medians of per-round ratios")
    page.text(f"fablize {m['engine']} against "
              + (f"the original fablize {m['original']}" if m["original"] else
                 f"no original {NEEDS_ORIGINAL}")
              + "; the timed processes run without PYTHONDONTWRITEBYTECODE (nor other PYTHON* "
              "or FABLIZE_* variables), the engine's bytecode cached first; max RSS is the "
              f"process's own peak, at least the {m['rss_floor']:.1f} MiB it inherits from the "
              "small process that starts it; bars are judged on CPU"
              + ("; --quick" if m["quick"] else ""))


def render_starts(page, sec):
    n = sec["stories"]
    page.heading(f"1. Starts: a {n}-story plan ({sec['rounds']} rounds)")
    page.text("bare = `python3 -c pass`; bare -I -S = `python3 -I -S -c pass`; floor = a script "
              "that locks, reads and parses goals.json, appends a ledger line + fsync and "
              "rewrites the snapshot atomically; script = `python3 scripts/goals.py` (what users "
              "type: the engine's bytecode cached); hook = `python3 -I -S scripts/goals.py` "
              "(what setup writes into hooks); plugin = `bin/fablize`; cached (with site) = the "
              "installed command's path; original = `python3 ORIGINAL/scripts/goals.py` on the "
              "same plan in its own format")
    rows = [[name] + [cell(g[key]) if key in g else NEEDS_ORIGINAL for key, _ in STARTS]
            for name, g in sec["groups"].items()]
    page.table([f"{n} stories, ms CPU (wall)"] + [h for _, h in STARTS], rows)
    for name, g in sec["groups"].items():
        if "original" in g:
            r = per_round(g["script"], g["original"], "cpu")
            vs = (f"script ÷ original {times(g['script'], g['original'])}, "
                  f"bar ≤ 1: {met(r <= 1)}")
        else:
            vs = f"script ÷ original {NEEDS_ORIGINAL}"
        page.figure(f"{name}, {n} stories: {vs}; hook ÷ bare -I -S "
                    f"{times(g['hook'], g['bare -I -S'])}; plugin ÷ bare -I -S "
                    f"{times(g['plugin'], g['bare -I -S'])}; cached (with site) ÷ bare "
                    f"{times(g['cached'], g['bare'])}")


HOOK_LABELS = {"SessionStart": "SessionStart hook (`status --resume`)",
               "Stop": "Stop hook (`guard`)", "PostToolUse": "PostToolUse hook (`observe`)"}


def render_hooks(page, sec):
    page.heading(f"2. Hooks: ours against the original's, same payloads ({sec['rounds']} rounds)")
    page.text("ours started three ways: hook = `python3 -I -S <repo>/scripts/goals.py` "
              "(what setup writes), plugin = `bin/fablize` (the plugin's hooks.json), cached "
              "(with site) = the engine imported with site (the installed command's path); the "
              "original has no SessionStart hook, so that row holds its UserPromptSubmit hooks "
              "(router.sh + gate_prompt.py); its hooks.json's Stop hook is gate_stop.py, and "
              "its setup asks for finish-the-work.sh as a second one")
    rows = []
    for event, g in sec["groups"].items():
        theirs = HOOKS[event][1]
        row = [HOOK_LABELS[event]] + [cell(g[key]) for key, _ in OURS]
        if all(h in g for h in theirs):
            total = summed(*(g[h] for h in theirs))
            row += [cell(total), " + ".join(f"{h} {cell(g[h])}" for h in theirs)]
        else:
            row += [NEEDS_ORIGINAL, NEEDS_ORIGINAL]
        rows.append(row)
    page.table(["hook, ms CPU (wall)"] + [h for _, h in OURS] + ["original", "original's hooks"],
               rows)
    for event, g in sec["groups"].items():
        theirs = HOOKS[event][1]
        # Stop: against the hook its hooks.json registers, then with the one setup asks for
        comparisons = [theirs[:1], theirs] if event == "Stop" else [theirs]
        for against in comparisons:
            name = " + ".join(against)
            what = {"SessionStart": "the original's UserPromptSubmit hooks",
                    "Stop": "the original's Stop hook" + ("s" if len(against) > 1 else ""),
                    "PostToolUse": "the original's PostToolUse hook"}[event]
            head = f"{HOOK_LABELS[event]} ÷ {what} ({name})"
            if not all(h in g for h in against):
                page.figure(f"{head}: {NEEDS_ORIGINAL}")
                continue
            base = summed(*(g[h] for h in against))
            ratios = [per_round(g[key], base, "cpu") for key, _ in OURS]
            parts = "; ".join(f"{label} {times(g[key], base)}" for key, label in OURS)
            verdict = bar_by([label for _, label in OURS], ratios, lambda v: v <= HOOK_BAR)
            page.figure(f"{head}: {parts}; bar ≤ {HOOK_BAR}: {verdict}")


def render_hook_floor(page, sec):
    page.heading(f"2b. Hooks against the floor: what `setup claude` writes, run as written "
                 f"({sec['rounds']} rounds)")
    page.text("each hook line exactly as `setup claude` writes it into .claude/settings.json, run "
              "through `sh -c` in the project as Claude Code runs it, with CLAUDE_PROJECT_DIR "
              "set (hook) and unset (hook, unset: the line's fallback finds the project with "
              "`git rev-parse`); floor = a script run the same way with the same interpreter and "
              "flags that reads and parses the payload and goals.json and, for a hook that "
              f"writes, under the lock appends one ledger line + fsync and rewrites the snapshot "
              f"atomically; a {sec['stories']}-story plan with a story in progress (the guard "
              "blocks and records it, observe records the run), put back before every run")
    rows = []
    for event, g in sec["groups"].items():
        v = g["variants"]
        rows.append([f"{event} `{g['line']}`", cell(v["floor"]), cell(v["hook"]),
                     cell(v["hook, unset"])])
    page.table(["hook line, ms CPU (wall)", "floor", "hook", "hook, unset"], rows)
    for event, g in sec["groups"].items():
        v = g["variants"]
        ratio = per_round(v["hook"], v["floor"], "cpu")
        page.figure(f"{event} hook ÷ its floor ({'a write' if g['writes'] else 'a read'}): "
                    f"{times(v['hook'], v['floor'])}, bar ≤ {HOOK_FLOOR_BAR}: "
                    f"{met(ratio <= HOOK_FLOOR_BAR)}; with CLAUDE_PROJECT_DIR unset "
                    f"{times(v['hook, unset'], v['floor'])}")


HOOK_BAR = 0.6  # every hook setup writes, against the original plugin's for the same event
LARGE = [("script", "scripts/goals.py"), ("hook", "-I -S scripts/goals.py"),
         ("original", "original")]


def render_large(page, sec):
    pairs = []  # (stories, rounds), in the order measured
    for g in sec["groups"]:
        if (g["stories"], g["rounds"]) not in pairs:
            pairs.append((g["stories"], g["rounds"]))
    rounds = ", ".join(f"{r} rounds at {n:,} stories" for n, r in pairs)
    if len({r for _, r in pairs}) == 1:
        rounds = f"{pairs[0][1]} rounds"
    page.heading(f"3. Large plans ({rounds})")
    page.text("ours as users type it (`python3 scripts/goals.py`) and as setup's hooks start it "
              "(`python3 -I -S scripts/goals.py`), and the original's `python3 scripts/goals.py` "
              "on the same plan in its own format; each state put back before each run")
    rows = []
    for g in sec["groups"]:
        v = g["variants"]
        rows.append([f"{g['stories']:,}", g["command"]]
                    + [f"{cell(v[k])}, {rss(v[k])}" if k in v else NEEDS_ORIGINAL
                       for k, _ in LARGE])
    page.table(["stories", "command, ms CPU (wall), max RSS"] + [h for _, h in LARGE], rows,
               left=2)
    for g in sec["groups"]:
        v = g["variants"]
        head = f"{g['command']}, {g['stories']:,} stories: ours ÷ original"
        if "original" not in v:
            page.figure(f"{head} {NEEDS_ORIGINAL}")
            continue
        mine = LARGE[:2]
        ratios = [per_round(v[k], v["original"], "cpu") for k, _ in mine]
        parts = "; ".join(f"{label} {times(v[k], v['original'])}" for k, label in mine)
        verdict = bar_by([label for _, label in mine], ratios, lambda x: x <= 1)
        page.figure(f"{head}: {parts}; bar ≤ 1: {verdict}")


LEDGER_COMMANDS = ("audit", "rebuild", "log", "report")
# the run of the loop just before each command (a file saved before there was one a command
# holds only the first, "bare loop")
LOOP_BEFORE = {cmd: "bare loop" if i == 0 else f"bare loop before {cmd}"
               for i, cmd in enumerate(LEDGER_COMMANDS)}


def rate(commands, name, key):
    """The command's rate as a share of the bare loop's: per round, the time of the loop's run
    just before it / its time."""
    return per_round(commands.get(LOOP_BEFORE[name], commands["bare loop"]), commands[name], key)


def ledger_table(page, c, n):
    """The table of a long ledger's commands and its bare loop (the median of all the loop's
    runs)."""
    loops = [c[name] for name in LOOP_BEFORE.values() if name in c]
    loop = {key: [x for s in loops for x in s[key]] for key in ("cpu", "wall", "rss")}
    names = ["bare loop", *LEDGER_COMMANDS]
    page.table([f"{n:,} events", "CPU (wall)", "max RSS"],
               [[name, took(loop if name == "bare loop" else c[name]),
                 rss(loop if name == "bare loop" else c[name])] for name in names])
    if len(loops) > 1:
        page.figure("the bare loop runs before each command, and each command's rate is the "
                    "loop's time in the run just before it over its own, a round at a time "
                    "(the row above: the median of all of the loop's runs)")


def ledger_rate(c, name, what, bar=None):
    """`name` of `what` runs at R% of the bare loop's rate (with its bar, if any): its rounds
    and max RSS."""
    r_cpu, r_wall = rate(c, name, "cpu"), rate(c, name, "wall")
    rounds = sorted(x / y for x, y in zip(c.get(LOOP_BEFORE[name], c["bare loop"])["cpu"],
                                          c[name]["cpu"]))
    judged = f", bar ≥ {bar:.0%}: {met(r_cpu >= bar)}" if bar is not None else ""
    return (f"{name} of {what} runs at {r_cpu:.0%} of the bare loop's rate (wall {r_wall:.0%})"
            f"{judged} (its rounds {rounds[0]:.0%}–{rounds[-1]:.0%}); max RSS {rss(c[name])}")


def render_ledger(page, sec):
    n, size = sec["events"], sec["bytes"]
    page.heading(f"4. A long ledger of real-run events ({sec['rounds']} rounds)")
    lengths = sorted(set(sec["real_line_bytes"]))
    own = f"{lengths[0]:,}" + (f"–{lengths[-1]:,}" if len(lengths) > 1 else "")
    page.figure(f"real-run ledger: {n:,} events, {size / 1e6:,.0f} MB, mean line "
                f"{size / n:,.0f} bytes (the {sec['real_runs']} real `verify` runs' own lines: "
                f"{own} bytes, each with its provenance); run logs "
                f"written for the last {sec['logs_written']:,} runs, audit checked "
                f"{sec['logs_checked']:,}")
    c = sec["commands"]
    ledger_table(page, c, n)
    for name in LEDGER_COMMANDS:  # rates for the record (the 60% bar is withdrawn); memory's bar
        line = ledger_rate(c, name, f"{n:,} real-run events", None)
        if name == "audit":
            line += f", bar ≤ 100 MiB at 1,000,000 events: {met(median(c[name]['rss']) <= 100)}"
        page.figure(line)
    s = sec["status"]
    r = per_round(s["long"], s["3 events"], "cpu")
    page.figure(f"status on a {n:,}-event ledger ÷ status on the same plan with 3 events: "
                f"{times(s['long'], s['3 events'])}, bar ≤ 1.3: {met(r <= 1.3)}; "
                f"{took(s['long'])} against {took(s['3 events'])}")


def render_worked(page, sec):
    n, size, stories = sec["events_big"], sec["bytes_big"], sec["stories_big"]
    page.heading(f"4b. A plan worked as agents work it ({sec['rounds']} rounds)")
    session = ", ".join(f"{count} {kind}" for kind, count in sec["session"].items())
    page.figure(f"worked-plan ledger: {n:,} events, {stories:,} stories, {size / 1e6:,.0f} MB, "
                f"mean line {size / n:,.0f} bytes: one real session under Claude Code's hooks "
                f"({sum(sec['session'].values())} events: {session}), its first story's events "
                f"replayed story after story; run logs written for the last "
                f"{sec['logs_written']:,} of its {sec['run_count']:,} runs, audit checked "
                f"{sec['logs_checked']:,}")
    c = sec["commands"]
    ledger_table(page, c, n)
    for name in LEDGER_COMMANDS:
        page.figure(ledger_rate(c, name, f"a {stories:,}-story plan worked as agents work it", None)
                    + f" ({median(c[name]['rss']) * 1024 / stories:,.1f} KiB a story)")
    grew = n / sec["events_small"]
    for name in ("audit", "rebuild"):
        small, big = sec.get(f"{name}_small"), c[name]
        if small is None:  # a file saved before audit's was measured
            continue
        cost = median(big["cpu"]) / median(small["cpu"])
        page.figure(f"{name} of the {stories:,}-story plan costs ×{cost:.1f} what {name} of one "
                    f"of {sec['stories_small']:,} stories costs (×{grew:.1f} the events): "
                    f"{took(big)} against {took(small)}, bar ≤ ×{grew * 1.1:.1f} (linear in "
                    f"the events): {met(cost <= grew * 1.1)}")


def render_long_line(page, sec):
    v = sec["variants"]
    page.heading(f"5. A long last line ({sec['rounds']} rounds)")
    page.figure(f"status on a ledger whose last line is 32 MB ÷ one whose last line is 8 MB: "
                f"{times(v['32 MB'], v['8 MB'])} (linear: at most ×4); 32 MB {took(v['32 MB'])}, "
                f"8 MB {took(v['8 MB'])}")


def exits(counts):
    return f"exit 1 ×{counts.get('1', 0)}, exit 3 ×{counts.get('3', 0)}"


def render_sharing(page, sec):
    if "skipped" in sec:
        page.heading(f"6. A shared plan: skipped ({sec['skipped']})")
        return
    page.heading(f"6. A shared plan, through a local bare remote ({sec['rounds']} rounds)")
    c = sec["cost"]
    page.table(["100-story --parallel plan, --agent a", "local plan", "shared plan"],
               [[cmd, took(c[f"{cmd}, local"]), took(c[f"{cmd}, shared"])]
                for cmd in ("next", "checkpoint")])
    for cmd in ("next", "checkpoint"):
        a, b = c[f"{cmd}, shared"], c[f"{cmd}, local"]
        r = per_round(a, b, "cpu")
        page.figure(f"{cmd} --agent a in a shared plan ÷ in a local plan: {times(a, b)}, "
                    f"bar ≤ 1.5: {met(r <= 1.5)}")
    runs = sec["throughput"]
    base = next((t for t in runs if t["clones"] == 2 and t["completions"]), None)
    rows = []
    for t in runs:
        per_s = t["completions"] / t["wall"]
        rows.append([str(t["clones"]), str(t["agents"]), f"{t['completions']}",
                     f"{t['done']}/{t['stories']}", f"{t['wall']:.1f} s", f"{per_s:.2f}/s",
                     f"×{per_s / (base['completions'] / base['wall']):.2f}" if base else "—",
                     f"{t['cpu'] / max(t['completions'], 1) * 1e3:.0f} ms",
                     exits(t["next"]), exits(t["checkpoint"])])
    page.table(["clones", "agents", "completions", "plan done", "wall", "completions/s",
                "÷ 2 clones", "CPU per completion", "next", "checkpoint"], rows)
    for t in runs:
        per_s = t["completions"] / t["wall"]
        line = (f"shared-plan throughput, {t['clones']} clones × 2 agents: {per_s:.2f} "
                f"completions/s (wall), {t['completions']} completions in {t['wall']:.1f} s, "
                f"plan {t['done']}/{t['stories']} done")
        if base and t is not base:
            r = per_s / (base["completions"] / base["wall"])
            line += f"; ×{r:.2f} the 2-clone figure"
            if t["clones"] == 8:
                line += f", bar ≥ 0.8: {met(r >= 0.8)}"
        line += (f"; next {exits(t['next'])} (of the exits 1, {t['nothing_ready']} said nothing "
                 f"is ready: the agent's stop), checkpoint {exits(t['checkpoint'])}")
        for key, said in sorted(t["said"].items()):
            said = {text: k for text, k in said.items() if NOTHING_READY not in text}
            if said:
                text, k = max(sorted(said.items()), key=lambda item: item[1])
                line += f"; {key} ×{sum(said.values())}, most often ({k}): {text}"
        if t["gave_up"]:
            line += f"; {t['gave_up']} agent(s) gave up after ten failures in a row or the deadline"
        if not t["finished"]:
            line += f"; did not finish within {t['deadline']:,.0f} s"
        page.figure(line)


def huge_figure(s):
    if "timeout" in s:
        return f"did not finish within {s['timeout']:,.0f} s"
    if "failed" in s:
        cap = f" (memory capped at {s['cap'] / (1 << 30):,.1f} GiB)" if s["cap"] else ""
        return f"exited {s['failed']}{cap}: {s['said']}"
    return f"{took(s)}, max RSS {rss(s)}"


def render_huge(page, sec):
    if "skipped" in sec:
        page.heading(f"7. Huge states: skipped ({sec['skipped']})")
        return
    page.heading("7. Huge states (one run each, no warm-up)")
    n, st, rb = sec["events"], sec["status"], sec["rebuild"]
    line = (f"status without goals.json on a {n:,}-event ledger ({sec['bytes'] / 1e9:,.1f} GB): "
            f"{huge_figure(st)}; rebuild of it: {huge_figure(rb)}")
    if "cpu" in st and "cpu" in rb:
        t = per_round(st, rb, "cpu")
        m = per_round(st, rb, "rss")
        line += (f"; status at {times(st, rb)} rebuild's time and ×{m:.2f} its memory, bar ≤ 2: "
                 f"{met(t <= 2 and m <= 2)}")
    page.figure(line)
    a = sec["audit"]
    line = (f"audit of a {sec['stories']:,}-story plan ({sec['snapshot_bytes'] / 1e6:,.0f} MB "
            f"snapshot): {huge_figure(a)}")
    if "cpu" in a:
        per_story = median(a["rss"]) * 1024 / sec["stories"]
        line += f", {per_story:.2f} KiB per story, bar ≤ 4 KiB: {met(per_story <= 4)}"
    page.figure(line)


def render(data, markdown=False):
    """The whole output, from the saved measurements alone."""
    page = Page(markdown)
    render_header(page, data)
    s = data["sections"]
    # each section a run measured, in order (--hooks measures 2b alone; a file saved before a
    # section was measured has none of it)
    for name, render_section in (("starts", render_starts), ("hooks", render_hooks),
                                 ("hook_floor", render_hook_floor), ("large", render_large),
                                 ("ledger", render_ledger), ("worked", render_worked),
                                 ("long_line", render_long_line), ("sharing", render_sharing),
                                 ("huge", render_huge), ("sizes", render_sizes)):
        if name in s:
            render_section(page, s[name])
    lines, out = page.lines, []
    for line in lines:  # one blank line at most between blocks
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip("\n") + "\n"


# Command line #################################################################################


def original_version(path):
    try:
        with open(os.path.join(path, ".claude-plugin", "plugin.json"), encoding="utf-8") as f:
            return f"{json.load(f)['version']} ({path})"
    except (OSError, ValueError, KeyError):
        return f"({path})"


def measure_all(a, rounds, events):
    original = os.path.abspath(a.original) if a.original else None
    if original:
        missing = [f for f in ORIGINAL_FILES if not os.path.isfile(os.path.join(original, f))]
        if missing:
            raise SystemExit(f"bench: --original {a.original} is not a checkout of the original "
                             f"fablize: no {', '.join(missing)}")
    cache_engine()
    data = {"bench": FORMAT, "meta": {
        "python": sys.version.split()[0], "cores": os.cpu_count(),
        "load": list(os.getloadavg()), "rounds": rounds, "quick": a.quick,
        "engine": fablize_gate.__version__,
        "original": original_version(original) if original else None,
        "platform": sys.platform,
        # what any timed process inherits at exec from the spawner: the floor of max RSS
        "rss_floor": run_once(["true"], "/", timed_env()).rss}, "sections": {}}
    s = data["sections"]
    root = tempfile.mkdtemp(prefix="fablize-bench-")
    try:
        lab = Lab(root, original)
        if a.hooks:  # section 2b alone
            s["hook_floor"] = bench_hook_floor(lab, rounds)
            return data
        if a.sizes:  # section 8 alone
            s["sizes"] = bench_sizes(lab, rounds, a.against and os.path.abspath(a.against))
            return data
        s["starts"] = bench_starts(lab, rounds)
        s["hooks"] = bench_hooks(lab, rounds)
        s["hook_floor"] = bench_hook_floor(lab, rounds)
        s["large"] = bench_large(lab, (10_000, 100_000), (rounds, max(3, rounds // 2)))
        s["ledger"] = bench_ledger(lab, events, max(5, rounds // 3))
        s["worked"] = bench_worked(lab, events, max(5, rounds // 3))
        s["long_line"] = bench_long_line(lab, max(3, rounds // 3))
        s["sharing"] = {"skipped": "--no-sharing"}
        if not a.no_sharing:
            s["sharing"] = bench_sharing(lab, rounds, (2, 8) if a.quick else (2, 4, 8, 16))
        s["huge"] = {"skipped": "run with --huge"}
        if a.huge:
            s["huge"] = bench_huge(lab, a.huge_events, a.huge_stories)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        data["meta"]["load_end"] = list(os.getloadavg())
    return data


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--original", metavar="DIR", help="a checkout of the original fablize")
    p.add_argument("--quick", action="store_true",
                   help="fewer rounds, 100,000 events, 2 and 8 clones")
    p.add_argument("--markdown", action="store_true", help="Markdown tables and lists")
    p.add_argument("--runs", type=int, help="rounds of each row group (default 15, quick 5)")
    p.add_argument("--events", type=int,
                   help="events in the real-run ledger (default 1,000,000, quick 100,000)")
    p.add_argument("--no-sharing", action="store_true", help="skip section 6 (a shared plan)")
    p.add_argument("--hooks", action="store_true",
                   help="measure only section 2b: each hook `setup claude` writes, run as "
                        "written, against the floor script (about a minute)")
    p.add_argument("--sizes", action="store_true",
                   help="measure only section 8: each command on worked plans of 20, 200 and "
                        "2,000 stories")
    p.add_argument("--against", metavar="DIR",
                   help="with --sizes: also run another copy of the engine (its scripts/ folder) "
                        "beside this one")
    p.add_argument("--huge", action="store_true", help="run section 7 (huge states; slow)")
    p.add_argument("--huge-events", type=int, default=10_000_000, metavar="N",
                   help="events of section 7's ledger (default 10,000,000)")
    p.add_argument("--huge-stories", type=int, default=1_000_000, metavar="N",
                   help="stories of section 7's plan (default 1,000,000)")
    p.add_argument("--save", metavar="FILE", help="write the raw measurements as JSON")
    p.add_argument("--from", dest="source", metavar="FILE",
                   help="render a saved file's measurements; measure nothing")
    p.add_argument("--build", nargs=4, metavar=("STATE", "STORIES", "ACTIVE", "RUNS"),
                   help=argparse.SUPPRESS)
    p.add_argument("--build-original", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--build-real", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--build-worked", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.build or a.build_original or a.build_real or a.build_worked:
        return build_main(a)
    if a.source:
        with open(a.source, encoding="utf-8") as f:
            data = json.load(f)
    else:
        rounds = a.runs or (5 if a.quick else 15)
        data = measure_all(a, rounds, a.events or (100_000 if a.quick else 1_000_000))
        data = json.loads(json.dumps(data))  # render exactly what --save keeps
        if a.save:
            with open(a.save, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
                f.write("\n")
    sys.stdout.write(render(data, a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
