#!/usr/bin/env python3
"""fablize benchmark: what each command costs, side by side in one run.

Each figure is the median wall time of N runs of a real process, measured interleaved with
  bare    `python3 -c pass`: the interpreter's own start, the floor of any command;
  floor   a script doing only the work a writing command must do: take the lock, read and
          parse goals.json, append one ledger line + fsync, write the snapshot to a temp file
          + fsync + rename + fsync the directory;
  script  `python3 scripts/goals.py …`: compiled at every start (Python caches no bytecode
          for a script);
  cached  the engine imported as a module with its bytecode cached (the installed command
          and the plugin's hooks take this path);
  plugin  the plugin's bin/fablize, which imports it the same way under `python3 -I -S`
          (so it is compared with `python3 -I -S -c pass`, which skips site-packages too).
Peak memory (max RSS) is the child's own. Large states are built in-process with the engine's
own transitions (`goals.make_event`), never with thousands of process launches.

  python3 scripts/bench.py             # the full table (a few minutes)
  python3 scripts/bench.py --quick     # fewer repeats, smaller ledgers
  python3 scripts/bench.py --markdown  # the tables README quotes
Stdlib only.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "goals.py")
sys.path.insert(0, HERE)

import goals  # noqa: E402  (the engine's own functions build the states)

PY = sys.executable
TS = "2026-01-01T00:00:00.000000+00:00"
# the plugin's launcher (bin/fablize) finds python3 on PATH: this interpreter's comes first, so
# the figure is the launcher's and the engine's, not a version manager's shim
PLUGIN = os.path.join(os.path.dirname(HERE), "bin", "fablize")
PLUGIN_ENV = dict(os.environ, PATH=os.path.dirname(PY) + os.pathsep + os.environ.get("PATH", ""))
PLUGIN_ENV.pop("FABLIZE_DIR", None)

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


# Building states with the engine's own transitions #########################


class Builder:
    """A plan grown event by event through goals.make_event (the function every writing command
    uses), written out at the end as the engine would write it, without an fsync a line."""

    def __init__(self):
        self.plan, self.lines = None, []

    def add(self, kind, **fields):
        self.plan, _, line = goals.make_event(self.plan, kind, fields, ts=TS)
        self.lines.append(line)

    def create(self, stories, checks=0):
        specs = [{"id": goals.story_id(i), "title": f"story {i}", "objective": f"objective {i}",
                  "after": [], "checks": ["true"] * checks, "accept": [], "judge": False}
                 for i in range(1, stories + 1)]
        specs[-1]["after"] = [s["id"] for s in specs[:-1]]
        self.add("plan_created", brief="bench", count=stories, plan_id="bench", stories=specs,
                 options={"rounds": 3, "require_run": False}, unverifiable=[], replaces=None)
        return self

    def run(self, sid, seq_note=None):
        """A passing run of the story's first frozen check."""
        seq = self.plan["ledger"]["seq"] + 1
        self.add("verify_run", id=sid, check=0, cmd="true", cwd="/", exit_code=0, signal=None,
                 timed_out=False, error=None, duration_s=0.001, bytes=0,
                 sha256="e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
                 tail="", log=f"runs/{seq}-{sid}.log", after_seq=seq - 1, started=TS,
                 git_head=None, git_dirty=None)

    def write(self, state_dir):
        os.makedirs(state_dir, exist_ok=True)
        with open(os.path.join(state_dir, goals.LEDGER), "wb") as f:
            f.write(b"".join(line + b"\n" for line in self.lines))
        with open(os.path.join(state_dir, goals.SNAPSHOT), "wb") as f:
            f.write(goals.snapshot_bytes(self.plan))
        return state_dir


def plan_state(root, name, stories, active=False, runs=0):
    """A plan of `stories` stories (G001 active when `active`, with `runs` runs of its check),
    built in a child process: a process's peak memory counts what it inherited before exec, so
    the bench itself stays small and every figure of max RSS is the measured command's own."""
    state = os.path.join(root, name, ".fablize")
    subprocess.run([PY, os.path.abspath(__file__), "--build", state, str(stories),
                    "1" if active else "0", str(runs)], check=True)
    return state


def build_state(state, stories, active, runs):
    b = Builder().create(stories, checks=1 if runs else 0)
    if active or runs:
        b.add("story_started", id="G001", title="story 1", round=1, agent=None)
    for _ in range(runs):
        b.run("G001")
    return b.write(state)


# Measuring ##################################################################


def run_once(argv, cwd, ok=(0,), env=None):
    """(seconds, max RSS in MiB) of one process."""
    start = time.perf_counter()
    p = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    elapsed = time.perf_counter() - start
    err = p.stderr.read()
    p.stderr.close()
    code = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else \
        status >> 8
    if code not in ok:
        raise SystemExit(f"bench: {' '.join(argv)} exited {code}: "
                         f"{err.decode(errors='replace').strip()[-300:]}")
    return elapsed, usage.ru_maxrss / 1024


def interleaved(variants, n, cwd, reset=None, ok=(0,), env=None):
    """{name: (median ms, median max RSS MiB)} for each (name, argv) in `variants`, run in turn
    n times, `reset()` before each run of a command that changes its state."""
    times = {name: [] for name, _ in variants}
    rss = {name: [] for name, _ in variants}
    for _ in range(n):
        for name, argv in variants:
            if reset is not None:
                reset()
            t, m = run_once(argv, cwd, ok, env)
            times[name].append(t)
            rss[name].append(m)
    return {name: (statistics.median(times[name]) * 1000, statistics.median(rss[name]))
            for name in times}


def cached_launcher(root):
    """A file that imports the engine as a module: its bytecode is cached after the first run."""
    path = os.path.join(root, "fablize_cached.py")
    with open(path, "w") as f:
        f.write(f"import sys\nsys.path.insert(0, {HERE!r})\nimport goals\n"
                "goals.run()\n")
    import importlib.util
    import py_compile
    # the bytecode cache, written even where PYTHONDONTWRITEBYTECODE is set (a stale .pyc would
    # make every "cached" run compile the engine again)
    py_compile.compile(SCRIPT, cfile=importlib.util.cache_from_source(SCRIPT), doraise=True)
    return path


def bench_commands(root, sizes, n):
    """Per command and plan size: bare, floor, script and cached, side by side."""
    launcher = cached_launcher(root)
    floor = os.path.join(root, "floor.py")
    with open(floor, "w") as f:
        f.write(FLOOR)
    rows = []
    commands = {
        "status": (["status"], False),
        "next": (["next"], False),
        "checkpoint": (["checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e"],
                       True),
    }
    for stories in sizes:
        for name, (args, active) in commands.items():
            pristine = plan_state(root, f"p{stories}-{name}", stories, active=active)
            work = os.path.join(root, f"w{stories}-{name}", ".fablize")

            def reset(pristine=pristine, work=work):
                shutil.rmtree(work, ignore_errors=True)
                shutil.copytree(pristine, work)

            cwd = os.path.dirname(work)
            res = interleaved([
                ("bare", [PY, "-c", "pass"]),
                ("bare -I -S", [PY, "-I", "-S", "-c", "pass"]),
                ("floor", [PY, floor, work]),
                ("script", [PY, SCRIPT, "--dir", work] + args),
                ("cached", [PY, launcher, "--dir", work] + args),
                ("plugin", [PLUGIN, "--dir", work] + args),
            ], n, cwd, reset, env=PLUGIN_ENV)
            rows.append((stories, name, res))
    return rows


def bench_audit(root, events, n):
    """audit of a long ledger against a bare loop that parses and hashes the same lines, and
    status on that plan against status on the same plan with three events."""
    big = plan_state(root, "audit-big", 100, runs=events - 2)
    small = plan_state(root, "audit-small", 100, runs=1)
    ledger = os.path.join(big, goals.LEDGER)
    loop = os.path.join(root, "bare_loop.py")
    with open(loop, "w") as f:
        f.write(BARE_LOOP)
    res = interleaved([
        ("bare loop", [PY, loop, ledger]),
        ("audit", [PY, SCRIPT, "--dir", big, "audit"]),
    ], n, root)
    status = interleaved([
        ("status, 3 events", [PY, SCRIPT, "--dir", small, "status"]),
        (f"status, {events:,} events", [PY, SCRIPT, "--dir", big, "status"]),
    ], n, root)
    size = os.path.getsize(ledger)
    return events, size, res, status


def bench_long_line(root, n):
    """Reading the ledger's last line backwards: a 32 MB line against an 8 MB one."""
    out = {}
    for mb in (8, 32):
        d = os.path.join(root, f"line{mb}", ".fablize")
        os.makedirs(d)
        with open(os.path.join(d, goals.LEDGER), "wb") as f:  # one oversized, unparsable line
            f.write(b'{"seq":1,"event":"x","pad":"' + b"x" * (mb << 20) + b'"\n')
        # the line is read whole, then found to be no event: exit 1 (no plan) with a warning
        out[mb] = interleaved([(f"{mb} MB", [PY, SCRIPT, "--dir", d, "status"])], n, root,
                              ok=(1,))
    return out


def shared_plan_cost(root, n):
    """What sharing adds: `next` + `checkpoint` in a plan shared through a local bare remote,
    next to the same commands in a local plan (medians, ms)."""
    env = dict(os.environ, GIT_AUTHOR_NAME="bench", GIT_AUTHOR_EMAIL="bench@localhost",
               GIT_COMMITTER_NAME="bench", GIT_COMMITTER_EMAIL="bench@localhost",
               GIT_CONFIG_NOSYSTEM="1", HOME=root)
    env.pop("FABLIZE_DIR", None)
    remote, results = os.path.join(root, "shared.git"), {}
    subprocess.run(["git", "init", "-q", "--bare", remote], check=True, env=env)
    for kind in ("local", "shared"):
        clone = os.path.join(root, f"clone-{kind}")
        subprocess.run(["git", "clone", "-q", remote, clone], check=True, env=env,
                       stderr=subprocess.DEVNULL)
        share = ["--remote", "origin"] if kind == "shared" else []
        subprocess.run([PY, SCRIPT, "create", "--brief", "bench", "--parallel", *share,
                        *[f"--goal=s{i}::o{i}" for i in range(n + 1)]],
                       cwd=clone, env=env, check=True, stdout=subprocess.DEVNULL)
        nexts, checkpoints = [], []
        for i in range(n):
            nexts.append(run_once([PY, SCRIPT, "next", "--agent", "a"], clone, env=env)[0])
            checkpoints.append(run_once([PY, SCRIPT, "checkpoint", "--id", goals.story_id(i + 1),
                                         "--status", "complete", "--evidence", "bench",
                                         "--agent", "a"], clone, env=env)[0])
        results[kind] = (statistics.median(nexts) * 1000, statistics.median(checkpoints) * 1000)
    return results


def fmt(ms):
    return f"{ms:.1f}"


def report(rows, audit, lines, shared, markdown):
    out = []
    if markdown:
        out += ["| stories | command | bare | floor | script | cached | plugin | script − bare | "
                "cached − bare | plugin − bare -I -S | script / floor | cached / floor | max RSS |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    else:
        out.append(f"{'stories':>8} {'command':<11} {'bare':>7} {'floor':>7} {'script':>7} "
                   f"{'cached':>7} {'plugin':>7} {'scr−bare':>9} {'cch−bare':>9} {'plg−bIS':>9} "
                   f"{'scr/fl':>7} {'cch/fl':>7} {'RSS MiB':>8}")
    for stories, name, res in rows:
        bare, bare_is, floor, script, cached, plugin = (
            res[k][0] for k in ("bare", "bare -I -S", "floor", "script", "cached", "plugin"))
        cells = [f"{stories:,}", name, fmt(bare), fmt(floor), fmt(script), fmt(cached),
                 fmt(plugin), f"{script - bare:+.1f}", f"{cached - bare:+.1f}",
                 f"{plugin - bare_is:+.1f}", f"×{script / floor:.2f}", f"×{cached / floor:.2f}",
                 f"{res['script'][1]:.0f}"]
        out.append("| " + " | ".join(cells) + " |" if markdown else
                   f"{cells[0]:>8} {cells[1]:<11} {cells[2]:>7} {cells[3]:>7} {cells[4]:>7} "
                   f"{cells[5]:>7} {cells[6]:>7} {cells[7]:>9} {cells[8]:>9} {cells[9]:>9} "
                   f"{cells[10]:>7} {cells[11]:>7} {cells[12]:>8}")
    events, size, res, status = audit
    loop_ms, audit_ms = res["bare loop"][0], res["audit"][0]
    out += ["", f"audit of {events:,} events ({size / 1e6:.0f} MB): {audit_ms / 1000:.2f} s "
            f"({events / audit_ms * 1000:,.0f} events/s), bare parse+hash loop "
            f"{loop_ms / 1000:.2f} s: audit runs at {loop_ms / audit_ms:.0%} of its rate; "
            f"audit max RSS {res['audit'][1]:.0f} MiB"]
    (small_name, (small_ms, small_rss)), (big_name, (big_ms, big_rss)) = status.items()
    out.append(f"{big_name}: {big_ms:.1f} ms, {big_rss:.0f} MiB; {small_name}: {small_ms:.1f} "
               f"ms, {small_rss:.0f} MiB: ×{big_ms / small_ms:.2f}")
    t8, t32 = lines[8]["8 MB"][0], lines[32]["32 MB"][0]
    out.append(f"a ledger whose last line is 8 MB: {t8:.0f} ms; 32 MB: {t32:.0f} ms "
               f"(×{t32 / t8:.2f})")
    (ln, lc), (sn, sc) = shared["local"], shared["shared"]
    out.append(f"shared plan (a local bare remote): next {sn:.1f} ms (local plan {ln:.1f}, "
               f"{sn - ln:+.1f}), checkpoint {sc:.1f} ms (local plan {lc:.1f}, {sc - lc:+.1f})")
    if markdown:  # the figures under the table as a list, as README quotes them
        out[-4:] = ["- " + line for line in out[-4:]]
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats and smaller ledgers")
    p.add_argument("--markdown", action="store_true", help="the tables as Markdown")
    p.add_argument("--runs", type=int, help="repeats of each figure (default 15, quick 5)")
    p.add_argument("--events", type=int,
                   help="events in the long ledger (default 1,000,000, quick 100,000)")
    p.add_argument("--build", nargs=4, metavar=("STATE", "STORIES", "ACTIVE", "RUNS"),
                   help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.build:
        state, stories, active, runs = a.build
        build_state(state, int(stories), active == "1", int(runs))
        return 0
    n = a.runs or (5 if a.quick else 15)
    events = a.events or (100_000 if a.quick else 1_000_000)
    root = tempfile.mkdtemp(prefix="fablize-bench-")
    try:
        rows = bench_commands(root, (100, 10_000), n)
        audit = bench_audit(root, events, max(3, n // 5))
        lines = bench_long_line(root, max(3, n // 3))
        shared = shared_plan_cost(root, max(3, n // 3))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores; medians of {n} runs "
          "(interleaved); times in ms")
    print(report(rows, audit, lines, shared, a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
