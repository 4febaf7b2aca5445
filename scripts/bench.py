#!/usr/bin/env python3
"""fablize benchmark: each command's cost over a bare interpreter, side by side in one run.

Every figure is the median wall time of N runs of a real process (`python3 scripts/goals.py
…`), next to the median of `python3 -c pass` measured in the same run, so the table shows
what the engine adds to the interpreter's start. States with large plans and long ledgers
are built in-process (never with thousands of process launches).

  python3 scripts/bench.py            # the full table (a few minutes)
  python3 scripts/bench.py --quick    # fewer sizes and repeats
Stdlib only.
"""

import argparse
import json
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

import goals  # noqa: E402  (to build large states in-process)


def timed(argv, cwd, env=None):
    start = time.perf_counter()
    p = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       stdin=subprocess.DEVNULL)
    elapsed = time.perf_counter() - start
    if p.returncode != 0:
        raise SystemExit(f"bench: {' '.join(argv[1:])} exited {p.returncode}: "
                         f"{p.stderr.decode(errors='replace').strip()}")
    return elapsed


def median_ms(samples):
    return statistics.median(samples) * 1000


def write_state(state_dir, stories, events, rounds=3):
    """A plan of `stories` stories whose ledger holds `events` events, written directly
    (same bytes the engine would write, without an fsync per line)."""
    os.makedirs(state_dir, exist_ok=True)
    specs = [{"id": goals.story_id(i), "title": f"story {i}", "objective": f"objective {i}",
              "after": [], "checks": [], "accept": [], "judge": False}
             for i in range(1, stories + 1)]
    specs[-1]["after"] = [s["id"] for s in specs[:-1]]
    plan, head = None, goals.ZERO_HASH
    ts = goals.now_iso()
    lines = []

    def add(kind, **fields):
        nonlocal plan, head
        record = {"seq": len(lines) + 1, "ts": ts, "event": kind}
        record.update(fields)
        record["prev"] = head
        plan = goals.apply_event(plan, record)
        line = goals.dumps(record).encode("utf-8")
        head = goals.sha256_hex(line)
        lines.append(line)

    add("plan_created", brief=f"bench {stories} stories", count=stories, plan_id="bench",
        stories=specs, options={"rounds": rounds, "require_run": False}, unverifiable=[],
        replaces=None)
    filler = {"id": specs[0]["id"], "check": None, "cmd": "true", "cwd": "/tmp", "exit_code": 0,
              "signal": None, "timed_out": False, "error": None, "duration_s": 0.001, "bytes": 0,
              "sha256": goals.sha256_hex(b""), "tail": "", "log": None, "after_seq": 0,
              "started": ts, "git_head": None, "git_dirty": None}
    while len(lines) < events:
        add("verify_run", **filler)  # legal at any time; exercises hashing and replay
    with open(os.path.join(state_dir, goals.LEDGER), "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    plan["ledger"] = {"seq": len(lines), "head": head}
    with open(os.path.join(state_dir, goals.SNAPSHOT), "wb") as f:
        f.write(goals.snapshot_bytes(plan))
    return plan


class Bench:
    def __init__(self, repeat, python):
        self.repeat = repeat
        self.python = python
        self.rows = []
        self.env = dict(os.environ)
        self.env.pop("FABLIZE_DIR", None)

    def bare(self, cwd):
        return [timed([self.python, "-c", "pass"], cwd) for _ in range(self.repeat)]

    def cli(self, state_dir, *args):
        return [self.python, SCRIPT, "--dir", state_dir, *args]

    def installed(self, work, state, *args):
        code = (f"import sys; sys.path.insert(0, {HERE!r}); import goals; "
                f"sys.exit(goals.main({['--dir', state, *args]!r}))")
        return [self.python, "-c", code]

    def cache_env(self, work):
        env = dict(self.env, PYTHONPYCACHEPREFIX=os.path.join(work, "pycache"))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        return env

    def row(self, command, stories, events, samples, bare):
        cost, base = median_ms(samples), median_ms(bare)
        self.rows.append((command, stories, events, cost, base, cost - base, cost / base))
        print(f"  {command:<26} {stories:>6} stories {events:>9} events  "
              f"{cost:8.1f} ms  (+{cost - base:6.1f} ms, ×{cost / base:.2f})", flush=True)

    def measure_state(self, work, stories, events):
        state = os.path.join(work, f"s{stories}-e{events}")
        write_state(state, stories, events)
        bare = self.bare(work)
        for command in (["status"], ["status", "--json"]):
            samples = [timed(self.cli(state, *command), work) for _ in range(self.repeat)]
            self.row(" ".join(command), stories, events, samples, bare)
        # what an installed `fablize` pays: the module's bytecode is cached, a script's never is
        cached = [timed(self.installed(work, state, "status"), work, self.cache_env(work))
                  for _ in range(self.repeat + 1)][1:]
        self.row("status (installed)", stories, events, cached, bare)
        # next activates a story (timed), then checkpoint completes it (timed), repeat
        nexts, checkpoints, reshows = [], [], []
        for i in range(self.repeat):
            nexts.append(timed(self.cli(state, "next"), work))
            reshows.append(timed(self.cli(state, "next"), work))
            checkpoints.append(timed(self.cli(state, "checkpoint", "--id", goals.story_id(i + 1),
                                              "--status", "complete", "--evidence", "bench"), work))
        self.row("next (activate)", stories, events, nexts, bare)
        self.row("next (re-show)", stories, events, reshows, bare)
        self.row("checkpoint complete", stories, events, checkpoints, bare)
        shutil.rmtree(state)

    def audit_throughput(self, work, events):
        state = os.path.join(work, f"audit-{events}")
        write_state(state, 100, events)
        samples = [timed(self.cli(state, "audit"), work) for _ in range(max(1, self.repeat // 3))]
        bare = median_ms(self.bare(work)) / 1000
        seconds = statistics.median(samples)
        rate = events / max(seconds - bare, 1e-9)
        print(f"  audit of {events:,} events: {seconds:.2f} s → {rate:,.0f} events/s "
              "(interpreter start subtracted)", flush=True)
        shutil.rmtree(state)
        return events, seconds, rate

    def concurrent(self, work, workers, per_worker):
        """`workers` agents at once, each claiming and completing `per_worker` stories."""
        state = os.path.join(work, "concurrent")
        stories = workers * per_worker + 1
        subprocess.run(self.cli(state, "create", "--brief", "concurrency", "--parallel",
                                *[f"--goal=s{i}::o{i}" for i in range(stories)]),
                       cwd=work, check=True, stdout=subprocess.DEVNULL)
        script = ("import subprocess, sys\n"
                  "py, script, state, agent, n = sys.argv[1:6]\n"
                  "for _ in range(int(n)):\n"
                  "    out = subprocess.run([py, script, '--dir', state, '--json', 'next', '--agent',"
                  " agent], capture_output=True, check=True).stdout\n"
                  "    import json; sid = json.loads(out)['story']['id']\n"
                  "    subprocess.run([py, script, '--dir', state, 'checkpoint', '--id', sid,"
                  " '--status', 'complete', '--evidence', 'ok', '--agent', agent],"
                  " check=True, stdout=subprocess.DEVNULL)\n")
        env = dict(self.env, FABLIZE_LOCK_TIMEOUT="120")
        start = time.perf_counter()
        procs = [subprocess.Popen([self.python, "-c", script, self.python, SCRIPT, state,
                                   f"agent{w}", str(per_worker)], cwd=work, env=env)
                 for w in range(workers)]
        codes = [p.wait() for p in procs]
        elapsed = time.perf_counter() - start
        if any(codes):
            raise SystemExit(f"bench: concurrent workers failed: {codes}")
        ops = workers * per_worker * 2
        audit = subprocess.run(self.cli(state, "audit"), cwd=work, capture_output=True)
        print(f"  {workers} agents × {per_worker} (next + checkpoint): {ops} writes in {elapsed:.1f} s"
              f" → {ops / elapsed:.1f} writes/s; audit exit {audit.returncode}", flush=True)
        shutil.rmtree(state)
        return ops, elapsed, audit.returncode


def shared_plan_cost(python, work, repeat):
    """What sharing adds: `next` + `checkpoint` in a plan shared through a local bare remote,
    next to the same commands in a local plan. Self-contained (its own repositories); the
    figures are medians in ms, printed and returned."""
    env = dict(os.environ, GIT_AUTHOR_NAME="bench", GIT_AUTHOR_EMAIL="bench@localhost",
               GIT_COMMITTER_NAME="bench", GIT_COMMITTER_EMAIL="bench@localhost",
               GIT_CONFIG_NOSYSTEM="1", HOME=work)
    env.pop("FABLIZE_DIR", None)
    remote, results = os.path.join(work, "shared.git"), {}
    subprocess.run(["git", "init", "-q", "--bare", remote], check=True, env=env)
    for kind in ("local", "shared"):
        clone = os.path.join(work, f"clone-{kind}")
        subprocess.run(["git", "clone", "-q", remote, clone], check=True, env=env,
                       stderr=subprocess.DEVNULL)
        share = ["--remote", "origin"] if kind == "shared" else []
        subprocess.run([python, SCRIPT, "create", "--brief", "bench", "--parallel", *share,
                        *[f"--goal=s{i}::o{i}" for i in range(repeat + 1)]],
                       cwd=clone, env=env, check=True, stdout=subprocess.DEVNULL)
        nexts, checkpoints = [], []
        for i in range(repeat):
            nexts.append(timed([python, SCRIPT, "next", "--agent", "a"], clone, env))
            checkpoints.append(timed([python, SCRIPT, "checkpoint", "--id", goals.story_id(i + 1),
                                      "--status", "complete", "--evidence", "bench",
                                      "--agent", "a"], clone, env))
        results[kind] = (median_ms(nexts), median_ms(checkpoints))
    (ln, lc), (sn, sc) = results["local"], results["shared"]
    print(f"  shared plan (local bare remote): next {sn:.1f} ms (local {ln:.1f}, +{sn - ln:.1f}), "
          f"checkpoint {sc:.1f} ms (local {lc:.1f}, +{sc - lc:.1f})", flush=True)
    return results


def markdown(bench, audits, concurrency):
    out = ["| command | stories | ledger events | median | over `python3 -c pass` | ratio |",
           "|---|---:|---:|---:|---:|---:|"]
    for command, stories, events, cost, base, over, ratio in bench.rows:
        out.append(f"| `{command}` | {stories:,} | {events:,} | {cost:.1f} ms | +{over:.1f} ms | "
                   f"×{ratio:.2f} |")
    out.append("")
    for events, seconds, rate in audits:
        out.append(f"- `audit` of {events:,} events: {seconds:.2f} s, {rate:,.0f} events/s")
    if concurrency:
        ops, elapsed, code = concurrency
        out.append(f"- 16 agents at once: {ops} writes in {elapsed:.1f} s ({ops / elapsed:.1f} "
                   f"writes/s), audit exit {code}")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--repeat", type=int, help="runs per figure (default 7, --quick 3)")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    a = p.parse_args(argv)
    repeat = a.repeat or (3 if a.quick else 7)
    bench = Bench(repeat, sys.executable)
    work = tempfile.mkdtemp(prefix="fablize-bench-")
    try:
        print(f"fablize bench — Python {sys.version.split()[0]}, {os.cpu_count()} cores, "
              f"{repeat} runs per figure (medians)", flush=True)
        plans = [(10, 100), (100, 100), (1000, 1000), (10000, 10000)]
        ledgers = [(100, 100_000)] if a.quick else [(100, 100_000), (100, 1_000_000)]
        if a.quick:
            plans = [(10, 100), (100, 100), (1000, 1000)]
        for stories, events in plans + ledgers:
            bench.measure_state(work, stories, events)
        audits = [bench.audit_throughput(work, 100_000 if a.quick else 1_000_000)]
        concurrency = bench.concurrent(work, 16, 2 if a.quick else 3)
        shared_plan_cost(sys.executable, work, repeat)
        if a.markdown:
            print()
            print(markdown(bench, audits, concurrency))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
