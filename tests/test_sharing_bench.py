"""What a shared plan costs, measured (not a test: run it).

    .venv/bin/python tests/test_sharing_bench.py [--rounds N] [--clones 2,4,8] [--stories N]
        [--scripts DIR]   (another copy of scripts/ to measure, e.g. an older one)

1. cost: `next --agent a` and `checkpoint` of the story it handed out, in a local plan and in a
   plan shared through a local bare remote, interleaved (next local, next shared, checkpoint
   local, checkpoint shared: each plan moves on one story a round). Each command's CPU time is
   its own and its reaped children's (os.wait4: git, and the remote's receive-pack, which a
   local remote runs as our grandchild); the medians and the shared ÷ local ratios are printed.
2. throughput: C clones of one bare remote sharing one --parallel plan, two agents in each
   clone working it through (`next`, then `checkpoint` of the story handed out, until nothing
   is ready): completions a second of wall time, and each figure ÷ the 2-clone one.
The engine is started as the installed command starts it (scripts/fablize.py, bytecode cached).
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = [sys.executable, "-I", "-S", os.path.join(ROOT, "scripts", "fablize.py")]
HANDOFF = re.compile(r"handoff — (G\d+)")
GIT_ENV = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@localhost",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@localhost",
           "GIT_CONFIG_NOSYSTEM": "1"}


class Run:
    """One process: exit code, stdout, stderr, CPU seconds (its own and its reaped children's),
    wall seconds."""

    def __init__(self, argv, cwd, env):
        out = tempfile.TemporaryFile()
        err = tempfile.TemporaryFile()
        start = time.perf_counter()
        pid = self._spawn(argv, cwd, env, out, err)
        _, status, usage = os.wait4(pid, 0)
        self.wall = time.perf_counter() - start
        self.cpu = usage.ru_utime + usage.ru_stime
        self.code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        self.out = out.read().decode("utf-8", "replace")
        self.err = err.read().decode("utf-8", "replace")
        out.close()
        err.close()

    @staticmethod
    def _spawn(argv, cwd, env, out, err):
        pid = os.fork()
        if pid == 0:  # the child: never returns
            try:
                os.chdir(cwd)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        return pid


class Lab:
    def __init__(self, root):
        self.root = root
        self.env = dict({k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")},
                        HOME=root, **GIT_ENV)

    def git(self, *args):
        subprocess.run(["git", *args], cwd=self.root, env=self.env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def fab(self, cwd, *args, check=True):
        r = Run([*LAUNCH, *map(str, args)], cwd, self.env)
        if check and r.code != 0:
            raise SystemExit(f"bench: {' '.join(map(str, args))} in {cwd}: exit {r.code}: "
                             f"{r.err[-400:]}")
        return r

    def plan(self, clone, stories, shared):
        goals = [f"--goal=story {i}::objective {i}" for i in range(1, stories + 1)]
        self.fab(clone, "create", "--brief", "bench", "--parallel",
                 *(["--remote", "origin"] if shared else []), *goals)


def cost(lab, rounds, stories=100):
    remote = os.path.join(lab.root, "cost.git")
    lab.git("init", "-q", "--bare", remote)
    clones = {}
    for kind in ("local", "shared"):
        clones[kind] = os.path.join(lab.root, f"cost-{kind}")
        lab.git("clone", "-q", remote, clones[kind])
        lab.plan(clones[kind], stories, kind == "shared")
    samples = {(cmd, kind): [] for cmd in ("next", "checkpoint") for kind in clones}
    for rnd in range(-1, min(rounds, stories - 2)):  # round -1 warms up
        ids = {}
        for kind, clone in clones.items():
            r = lab.fab(clone, "next", "--agent", "a")
            ids[kind] = HANDOFF.search(r.out).group(1)
            if rnd >= 0:
                samples["next", kind].append(r)
        for kind, clone in clones.items():
            r = lab.fab(clone, "checkpoint", "--id", ids[kind], "--status", "complete",
                        "--evidence", "bench", "--agent", "a")
            if rnd >= 0:
                samples["checkpoint", kind].append(r)
    print(f"cost: {rounds} rounds, a {stories}-story --parallel plan, medians")
    for cmd in ("next", "checkpoint"):
        row = {}
        for kind in clones:
            row[kind] = (statistics.median(r.cpu for r in samples[cmd, kind]) * 1e3,
                         statistics.median(r.wall for r in samples[cmd, kind]) * 1e3)
        print(f"  {cmd:<10} local {row['local'][0]:5.1f} ms CPU {row['local'][1]:5.1f} ms wall"
              f" | shared {row['shared'][0]:5.1f} ms CPU {row['shared'][1]:5.1f} ms wall"
              f" | shared ÷ local: CPU ×{row['shared'][0] / row['local'][0]:.2f}, "
              f"wall ×{row['shared'][1] / row['local'][1]:.2f}")


def agent(lab, clone, name, tally):
    failures = 0
    while failures < 20:
        r = lab.fab(clone, "next", "--agent", name, check=False)
        tally["cpu"] += r.cpu
        tally["next cpu"] += r.cpu
        tally["claims lost"] += r.err.count("instead.")
        tally["codes"][f"next {r.code}"] = tally["codes"].get(f"next {r.code}", 0) + 1
        if r.code == 1 and "nothing is ready" in r.err:
            return
        m = HANDOFF.search(r.out) if r.code == 0 else None
        if m is None:
            if r.code == 0:  # the plan is done
                return
            failures += 1
            tally["errors"].append(f"next exit {r.code}: {r.err.strip()[-300:]}")
            continue
        args = ["checkpoint", "--id", m.group(1), "--status", "complete", "--evidence", "x",
                "--agent", name]
        if "Final story" in r.out:
            args += ["--verify-cmd", "true", "--verify-evidence", "ok"]
        c = lab.fab(clone, *args, check=False)
        tally["cpu"] += c.cpu
        tally["checkpoint cpu"] += c.cpu
        tally["codes"][f"checkpoint {c.code}"] = tally["codes"].get(f"checkpoint {c.code}", 0) + 1
        if c.code == 0:
            tally["completions"] += 1
            failures = 0
        else:
            failures += 1
            tally["errors"].append(f"checkpoint exit {c.code}: {c.err.strip()[-300:]}")
        if "waited" in r.err or "waited" in c.err:
            tally["waited"] += 1


def throughput(lab, clones, stories):
    print(f"throughput: a {stories}-story --parallel plan, 2 agents a clone")
    base = None
    for c in clones:
        where = os.path.join(lab.root, f"throughput-{c}")
        os.makedirs(where)
        remote = os.path.join(where, "remote.git")
        lab.git("init", "-q", "--bare", remote)
        creator = os.path.join(where, "creator")
        lab.git("clone", "-q", remote, creator)
        lab.plan(creator, stories, True)
        paths = []
        for i in range(c):
            paths.append(os.path.join(where, f"clone{i}"))
            lab.git("clone", "-q", remote, paths[-1])
            lab.fab(paths[-1], "sync")
        tallies = [{"cpu": 0.0, "completions": 0, "codes": {}, "errors": [], "waited": 0,
                    "claims lost": 0, "next cpu": 0.0, "checkpoint cpu": 0.0} for _ in range(2 * c)]
        threads = [threading.Thread(target=agent, args=(lab, paths[k // 2], f"c{k // 2}a{k % 2}",
                                                        tallies[k])) for k in range(2 * c)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - start
        done = sum(t["completions"] for t in tallies)
        cpu = sum(t["cpu"] for t in tallies)
        codes = {}
        for t in tallies:
            for k, v in t["codes"].items():
                codes[k] = codes.get(k, 0) + v
        lab.fab(creator, "sync")
        status = json.loads(lab.fab(creator, "status", "--json").out)
        per_s = done / wall
        base = per_s if c == clones[0] else base
        errors = [e for t in tallies for e in t["errors"]]
        print(f"  {c:2d} clones × 2 agents: {done} completions in {wall:5.1f} s = "
              f"{per_s:.2f}/s (×{per_s / base:.2f} the {clones[0]}-clone figure), "
              f"{cpu / max(done, 1) * 1e3:.0f} ms CPU a completion; plan {status['done']}/"
              f"{status['total']} done; exits {json.dumps(codes, sort_keys=True)}; "
              f"{sum(t['waited'] for t in tallies)} said they waited, "
              f"{sum(t['claims lost'] for t in tallies)} claims lost and made again")
        per = {cmd: sum(t[f"{cmd} cpu"] for t in tallies) * 1e3 / max(1, sum(
            n for k, n in codes.items() if k.startswith(cmd))) for cmd in ("next", "checkpoint")}
        print(f"      CPU a command: next {per['next']:.0f} ms, "
              f"checkpoint {per['checkpoint']:.0f} ms")
        for e in sorted(set(e for e in errors if " exit 3: " in e))[:5]:
            print(f"      {e}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="cost rounds (default 20)")
    p.add_argument("--clones", default="2,4,8", help="throughput clone counts (default 2,4,8)")
    p.add_argument("--stories", type=int, default=100, help="throughput plan size (default 100)")
    p.add_argument("--no-cost", action="store_true", help="skip the cost part")
    p.add_argument("--no-throughput", action="store_true", help="skip the throughput part")
    p.add_argument("--scripts", help="the engine's folder to measure (default: this tree's)")
    a = p.parse_args()
    if a.scripts:
        LAUNCH[-1] = os.path.join(os.path.abspath(a.scripts), "fablize.py")
    root = tempfile.mkdtemp(prefix="fablize-share-bench-")
    try:
        lab = Lab(root)
        if not a.no_cost:
            cost(lab, a.rounds)
        if not a.no_throughput:
            throughput(lab, [int(x) for x in a.clones.split(",")], a.stories)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
