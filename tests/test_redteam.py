"""Attacks found by a red-team pass on the CI audit, each kept as a test of what must happen
instead (each failed before its fix): a plan carried in by a merge, lines spliced into one event,
a tag standing in for the base branch, a judge re-recording or hiding what it changed, an
unsigned decision before a signed one, and inputs that once gave a traceback.

The CI audit is the documented one: a copy of the engine outside the tree, `python3 -I`, a clean
environment, from the root of a real git repository whose `main` holds the plan's beginning:

    audit --base main --require-complete --require-witnessed --rerun all
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ENGINE as CACHED
from conftest import copy_engine

ENGINE = Path(__file__).resolve().parent.parent / "scripts" / "goals.py"
CI = ["audit", "--base", "main", "--require-complete", "--require-witnessed", "--rerun", "all"]
ALL_GATES = ["--require-logs", "--require-independent-judge", "--forbid-accepted",
             "--require-clean-runs"]


def sha(b):
    return hashlib.sha256(b).hexdigest()


def dumps(ev):
    return json.dumps(ev, ensure_ascii=False, separators=(",", ":")).encode()


def git_env(home):
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"}


def run(cwd, *args, engine=ENGINE, env=None, isolated=False):
    # the repository's engine starts as an import with its bytecode cached (conftest.ENGINE);
    # a copy, as the CI action runs it, as a script
    start = CACHED[1:] if engine == ENGINE else [str(engine)]
    cmd = [sys.executable] + (["-I"] if isolated else []) + start + [*args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)


def git(repo, home, *args):
    p = subprocess.run(["git", *args], cwd=repo, capture_output=True, env=git_env(home))
    assert p.returncode == 0, p
    return p.stdout


@pytest.fixture
def ci(tmp_path):
    """(repo, ci(*extra)): main holds a started plan whose frozen checks fail (no DONE file);
    the PR branch `pr` is checked out. ci() runs the CI audit with an outside copy of the engine."""
    home = tmp_path / "home"
    home.mkdir()
    engine = copy_engine(tmp_path / "engine-copy")
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, home, "init", "-q", "-b", "main")
    (repo / "README").write_text("hi\n")
    assert run(repo, "create", "--brief", "make DONE", "--goal", "one::make DONE", "--goal",
               "two::make DONE2", "--check", "G001=test -f DONE",
               "--check", "G002=test -f DONE2").returncode == 0
    assert run(repo, "next").returncode == 0
    git(repo, home, "add", "-A")
    git(repo, home, "commit", "-qm", "base")
    git(repo, home, "checkout", "-qb", "pr")

    def audit(*extra):
        git(repo, home, "add", "-A")
        git(repo, home, "commit", "-qm", "pr", "--allow-empty")
        return run(repo, *CI, *extra, engine=engine, env={"PATH": "/usr/bin:/bin",
                                                           "HOME": str(home)}, isolated=True)
    audit.home = home
    return repo, audit


def trivial_plan(tmp_path):
    """An honest, engine-written, completed one-story plan whose only check is `true`."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=scratch, check=True)
    assert run(scratch, "create", "--brief", "swap", "--goal", "x::trivial",
               "--check", "G001=true").returncode == 0
    assert run(scratch, "next").returncode == 0
    assert run(scratch, "checkpoint", "--id", "G001", "--status", "complete",
               "--evidence", "ok").returncode == 0
    return scratch / ".fablize"


def test_plan_merged_swallows_the_pinned_plan(ci, tmp_path):
    """create --force + merge-driver carrying main's ledger: the pin is 'found in this ledger',
    the plan is not new, the failing checks of main's plan are never re-run."""
    repo, audit = ci
    base = subprocess.run(["git", "show", "main:.fablize/ledger.jsonl"], cwd=repo,
                          capture_output=True, check=True).stdout
    (tmp_path / "base.jsonl").write_bytes(base)
    assert run(repo, "create", "--force", "--brief", "swap", "--goal", "x::trivial",
               "--check", "G001=true").returncode == 0
    assert run(repo, "next").returncode == 0
    assert run(repo, "checkpoint", "--id", "G001", "--status", "complete",
               "--evidence", "ok").returncode == 0
    led = repo / ".fablize" / "ledger.jsonl"
    assert run(repo, "merge-driver", os.devnull, str(led), str(tmp_path / "base.jsonl"),
               ".fablize/ledger.jsonl").returncode == 0
    assert run(repo, "rebuild").returncode == 0
    for p in (repo / ".fablize").glob("goals.json.*.bak"):
        p.unlink()
    shutil.rmtree(repo / ".fablize" / "archive", ignore_errors=True)
    r = audit(*ALL_GATES)
    assert r.returncode != 0, r.stdout  # failed before its fix


def splice(pin_line, pin_seq, honest_lines):
    """Re-chain `honest_lines` so that ledger line `pin_seq` is, byte for byte, the pinned line
    of main, while the events the batch parser (parse_events: lines joined with ',') sees are
    the honest ones: event pin_seq-1 swallows the pinned line as the value of a duplicate key."""
    evs = [json.loads(x) for x in honest_lines]
    k = pin_seq - 1
    lines, prev, i = [], "0" * 64, 0
    while i < len(evs):
        e = evs[i]
        e["prev"] = prev
        if i + 1 == k:
            t = dumps(e)
            key = b'"event":"%s",' % e["event"].encode()
            cut = t.index(key) + len(key)
            dup = b'"brief":' if e["event"] == "plan_created" else b'"id":'
            first = t[:cut] + dup + b"[0"
            evs[i + 1]["prev"] = sha(first)
            evs[i + 2]["prev"] = sha(pin_line)
            third = b"0]," + t[cut:] + b"," + dumps(evs[i + 1]) + b"," + dumps(evs[i + 2])
            lines += [first, pin_line, third]
            prev, i = sha(third), i + 3
            continue
        t = dumps(e)
        lines.append(t)
        prev, i = sha(t), i + 1
    return b"\n".join(lines) + b"\n"


def test_spliced_lines_put_the_pinned_line_into_a_new_plan(ci, tmp_path):
    """A wholly new plan whose line 2 is main's line 2, byte for byte, but absorbed into event 1
    by parse_events' join: --base, --since SEQ:HASH and --since HASH all say the pin holds."""
    repo, audit = ci
    base = subprocess.run(["git", "show", "main:.fablize/ledger.jsonl"], cwd=repo,
                          capture_output=True, check=True).stdout.splitlines()
    state = trivial_plan(tmp_path)
    honest = (state / "ledger.jsonl").read_bytes().splitlines()
    led = repo / ".fablize" / "ledger.jsonl"
    led.write_bytes(splice(base[-1], len(base), honest))
    (repo / ".fablize" / "runs").mkdir(exist_ok=True)
    for log in (state / "runs").iterdir():
        shutil.copy(log, repo / ".fablize" / "runs" / log.name)
    # each line must hold one value of its own: the splice is no event at line 1
    r = run(repo, "rebuild")
    assert r.returncode == 3 and "line 1: not a ledger event" in r.stderr, r
    for p in (repo / ".fablize").glob("goals.json*"):
        p.unlink()
    r = audit(*ALL_GATES)
    assert r.returncode == 3, r.stdout


def test_nul_in_a_frozen_check_is_one_line_not_a_traceback(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    assert run(tmp_path, "create", "--brief", "b", "--goal", "x::y",
               "--check", "G001=true").returncode == 0
    led = tmp_path / ".fablize" / "ledger.jsonl"
    ev = json.loads(led.read_bytes())
    ev["stories"][0]["checks"] = ["true\x00"]
    led.write_bytes(dumps(ev) + b"\n")
    r = run(tmp_path, "rebuild")  # no argv holds a NUL: the replay refuses it, on one line
    assert r.returncode == 3 and "NUL" in r.stderr and r.stderr.count("\n") == 1, r
    r = run(tmp_path, "audit", "--rerun", "all", "--json")
    assert "Traceback" not in r.stderr and r.returncode == 3
    assert json.loads(r.stdout)["error"]["code"] == "bad_event"


def test_merge_driver_with_a_torn_non_utf8_line_is_one_line(ci, tmp_path):
    repo, _ = ci
    base = subprocess.run(["git", "show", "main:.fablize/ledger.jsonl"], cwd=repo,
                          capture_output=True, check=True).stdout
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_bytes(base + b"\xff\xfe{")
    ours = tmp_path / "ours.jsonl"
    ours.write_bytes((trivial_plan(tmp_path) / "ledger.jsonl").read_bytes())
    r = run(repo, "merge-driver", os.devnull, str(ours), str(theirs), ".fablize/ledger.jsonl",
            "--json")
    assert "Traceback" not in r.stderr  # failed before its fix
    json.loads(r.stdout)


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs ssh-keygen")
def test_every_decision_is_verified_not_only_each_storys_last(ci, tmp_path):
    """An unsigned `decide retry` (the agent giving itself a round) hides behind a later signed
    `accept` of the same story: only scan.decisions[id] (the last) is verified."""
    repo, audit = ci
    keys = tmp_path / "keys"
    keys.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "h")],
                   check=True)
    gh = repo / ".github"
    gh.mkdir()
    (gh / "allowed_signers").write_text("h@x " + (keys / "h.pub").read_text())
    git(repo, audit.home, "checkout", "-q", "main")
    git(repo, audit.home, "add", "-A")
    git(repo, audit.home, "commit", "-qm", "signers")
    git(repo, audit.home, "checkout", "-q", "pr")
    git(repo, audit.home, "merge", "-q", "main")
    assert run(repo, "checkpoint", "--id", "G001", "--status", "blocked",
               "--evidence", "stuck").returncode == 0
    assert run(repo, "decide", "--id", "G001", "retry", "--note", "agent's own").returncode == 0
    assert run(repo, "next").returncode == 0
    assert run(repo, "checkpoint", "--id", "G001", "--status", "blocked",
               "--evidence", "stuck again").returncode == 0
    assert run(repo, "decide", "--id", "G001", "accept", "--note", "human", "--sign",
               str(keys / "h"), "--signer", "h@x").returncode == 0
    r = run(repo, "audit", "--allowed-signers", ".github/allowed_signers")
    assert r.returncode != 0, r.stdout  # failed before its fix


def test_base_ref_shadowed_by_a_tag_of_the_same_name(ci, tmp_path):
    """`--base main` (or origin/main) resolves through git's ref order, where refs/tags/<name>
    comes before refs/heads/<name> and refs/remotes/<name>: a tag the agent pushed (fetched by a
    CI that fetches tags) moves the pin, and the allowed signers, to the agent's own commit."""
    repo, audit = ci
    assert run(repo, "create", "--force", "--brief", "swap", "--goal", "x::trivial",
               "--check", "G001=true").returncode == 0
    assert run(repo, "next").returncode == 0
    assert run(repo, "checkpoint", "--id", "G001", "--status", "complete",
               "--evidence", "ok").returncode == 0
    git(repo, audit.home, "add", "-A")
    git(repo, audit.home, "commit", "-qm", "attack")
    git(repo, audit.home, "tag", "main")
    r = audit()
    assert r.returncode != 0, r.stdout  # failed before its fix


def judged_story(tmp_path):
    """A story in review: alice did it, its judge packet is recorded; the judge is bob."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "impl.txt").write_text("x\n")
    assert run(tmp_path, "create", "--brief", "b", "--goal", "x::y", "--check", "G001=true",
               "--judge").returncode == 0
    assert run(tmp_path, "next", "--agent", "alice").returncode == 0
    assert run(tmp_path, "checkpoint", "--id", "G001", "--status", "complete", "--evidence", "ok",
               "--agent", "alice").returncode == 0
    assert run(tmp_path, "judge-packet", "--id", "G001").returncode == 0


def status_after_verdict(tmp_path):
    run(tmp_path, "verdict", "--id", "G001", "achieved", "--evidence", "fine", "--agent", "bob")
    return json.loads(run(tmp_path, "status", "--json").stdout)["stories"][0]["status"]


def test_a_second_judge_packet_after_fixing_the_tree_does_not_launder_it(tmp_path):
    judged_story(tmp_path)
    (tmp_path / "impl.txt").write_text("fixed by the judge\n")
    run(tmp_path, "judge-packet", "--id", "G001")  # re-records the tree the judge changed
    assert status_after_verdict(tmp_path) != "complete"


def test_an_ignored_file_the_judge_adds_changes_the_tree(tmp_path):
    judged_story(tmp_path)
    with open(tmp_path / ".git" / "info" / "exclude", "a") as f:
        f.write("conftest.py\n")
    (tmp_path / "conftest.py").write_text("# makes the judge's own test run pass\n")
    assert status_after_verdict(tmp_path) != "complete"


def test_audit_remote_with_an_unparsable_run_line_is_one_line(tmp_path):
    """remote_ledger: {parse_event(line).get("log"): ...} for every commit carrying a `log`."""
    bare, work = tmp_path / "r.git", tmp_path / "w"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True)
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    env = git_env(tmp_path)
    (work / "event.jsonl").write_bytes(b'not json "event":"verify_run"\n')
    (work / "log").write_bytes(b"log\n")
    for args in (["add", "event.jsonl", "log"], ["commit", "-qm", "e"],
                 ["push", "-q", str(bare), "HEAD:refs/fablize/plans/P1"]):
        subprocess.run(["git", *args], cwd=work, check=True, env=env)
    clone = tmp_path / "c"
    subprocess.run(["git", "clone", "-q", str(bare), str(clone)], check=True, env=env,
                   capture_output=True)
    r = run(clone, "audit", "--remote", "origin", "--json")
    assert "Traceback" not in r.stderr  # failed before its fix
    json.loads(r.stdout)


def check_py_branch(tmp_path, python):
    """(repo, home): main holds a started plan whose frozen check `PYTHON check.py` fails
    (impl.txt says todo); the PR branch `pr` is checked out."""
    home = tmp_path / "home"
    home.mkdir()
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, home, "init", "-q", "-b", "main")
    (repo / "check.py").write_text("import sys\nsys.exit(open('impl.txt').read() != 'done\\n')\n")
    (repo / "impl.txt").write_text("todo\n")
    assert run(repo, "create", "--brief", "b", "--goal", "x::make impl.txt say done",
               "--check", f"G001={python} check.py").returncode == 0
    assert run(repo, "next").returncode == 0
    git(repo, home, "add", "-A")
    git(repo, home, "commit", "-qm", "base")
    git(repo, home, "checkout", "-qb", "pr")
    return repo, home


def test_a_frozen_check_whose_file_the_branch_rewrote_is_named_and_can_fail_ci(tmp_path):
    """The frozen command stays frozen, but the file it runs does not: the branch rewrites
    check.py to exit 0. audit --base names the file; --require-unchanged-checks fails it."""
    repo, home = check_py_branch(tmp_path, sys.executable)
    (repo / "check.py").write_text("raise SystemExit(0)\n")  # impl.txt still says todo
    assert run(repo, "checkpoint", "--id", "G001", "--status", "complete",
               "--evidence", "done").returncode == 0
    git(repo, home, "add", "-A")
    git(repo, home, "commit", "-qm", "pr")
    r = run(repo, "audit", "--base", "main", "--require-complete", "--rerun", "all")
    assert r.returncode == 0 and "frozen checks name files this branch changed since the base " \
        "(review them): check.py" in r.stdout, r  # the rerun passes: only a reviewer sees it
    r = run(repo, "audit", "--base", "main", "--require-complete", "--rerun", "all",
            "--require-unchanged-checks", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "check_files_changed", r
    assert json.loads(r.stdout)["trust"]["check_files_changed"] == ["check.py"]
    r = run(repo, "audit", "--require-unchanged-checks")
    assert r.returncode == 2 and "give it too" in r.stderr, r
