"""Every refusal and every damage message of the engine's core names one runnable next step,
and following it leads out. For each error code the core raises (WALKED; the few no command
line can reach are in UNREACHABLE, with why), a real scratch project is put in the state
that raises it; the command is run (exit code, the message's opening words kept, no file under
.fablize/ changed by a refusal, each step printed whole on its own line); then the walk runs
the step each message names, as --json's error.commands gives it — the engine as it was
started (`goals.py …`), or git, `mv`, `cd` as a shell runs them — until the command the user
wanted succeeds or the plan audits whole again, or what is left is a human's decision (a
command with a `<…>` placeholder, or a choice between several). A decision is then taken as a
human would (the placeholder filled) and must run. No step may lead back to a message already
seen (a circle)."""

import ast
import fcntl
import json
import os
import re
import shlex
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest

from conftest import (ENGINE_DIR, ENGINE_PYTHON, Result, copy_engine, engine, forge, git,
                      git_env, make_plan, raw_lines, replace_everywhere, start, state_files, story,
                      write_lines)

PLACEHOLDER = re.compile(r"<[^<>]*>")
TOKEN = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"  # the shape of a GitHub token
NEW_PLAN = 'goals.py create --force --brief "<brief>" --goal "<title>::<objective>"'


# What each code's walk starts from: every code the core raises is walked, or unreachable.

WALKED = {
    "already_paused": "`pause` twice; the step, `status`, shows the pause the user wanted",
    "awaiting_review": "`next` with the only ready story in review: the judge's packet",
    "bad_event": "an event fablize never writes in the ledger: git's copy, or a new plan",
    "bad_line": "a last line that is no event (`rebuild`); one in the middle (a human's)",
    "bad_seq": "a ledger line removed: a new plan, the damaged one archived",
    "broken_chain": "an earlier ledger line edited: a new plan, the damaged one archived",
    "bad_snapshot": "goals.json cut short: `rebuild`",
    "cwd_gone": "the working directory deleted under the command: `cd` to the nearest folder",
    "disagree": "the ledger lost its last line: `rebuild`; the ledger missing: `rebuild`, then a "
                "human's new plan",
    "final_started": "`add` while the final story runs, and once the plan is done",
    "git_failed": "`install-merge` with git's config locked: the command again once unlocked",
    "halted": "`next` at a blocked story: a human's decide commands",
    "held_by_other": "a checkpoint by an unnamed caller, and by another agent",
    "incomplete": "`audit --require-complete` on an unfinished plan: its next steps",
    "interrupted": "Ctrl-C while `next` works: the command again",
    "io_error": "a failing fsync while the ledger is written: the command again; a checkpoint "
                "torn after its run was recorded: the command again",
    "judge_not_independent": "a verdict by the executor; `audit --require-independent-judge`",
    "legacy": "an original goals.json under `audit`: `status` imports it",
    "lock_timeout": "another command holds the lock: the command again, waiting longer",
    "missing_logs": "`audit --require-logs` with a committed run log deleted: git's copy",
    "no_agent": "a verdict with a blank --agent",
    "no_checks": "`verify` on a story without frozen checks",
    "no_evidence": "a blank --evidence: complete, failed, and a verdict",
    "no_note": "`decide` with a blank --note",
    "no_plan": "`status` before any plan: `create`, a human's plan",
    "not_a_directory": "a file where .fablize/archive/ goes: moved aside",
    "not_a_file": "a folder where goals.json, ledger.jsonl or lock goes (readers and writers "
                  "alike: `mv`); `report --out` a folder",
    "not_active": "a checkpoint of a story pending, done, blocked or in review",
    "not_decidable": "`decide` on a pending story: `status`",
    "not_found": "a checkpoint of a story the plan does not have: `status` lists them",
    "not_in_review": "a verdict on a story not in review: `status`",
    "not_paused": "`unpause` with the guard on: `status`",
    "nothing_ready": "`next --agent c` while agents a and b hold what is ready",
    "outside_project": "`report --out` outside the project: the same with --outside",
    "plan_exists": "`create` over a plan: `status`, or the same with --force",
    "run_log_mismatch": "a committed run log edited: git's copy of it",
    "run_required": "a --require-run plan's final story claimed: --run",
    "secret_in_ledger": "a token written into the ledger by hand: rotate it, a new plan",
    "snapshot_edited": "goals.json's brief edited by hand: `rebuild`",
    "snapshot_mismatch": "goals.json edited with its digest made again: `rebuild`",
    "symlink": "goals.json a symlink (moved aside); `report --out` a symlink",
    "tool_missing": "`judge-packet` with git off PATH: the command again once it is back",
    "tool_timeout": "`judge-packet` with a git that hangs: the command again",
    "tree_changed": "a verdict after the judge changed the tree: `next` reopens the story",
    "verification_failed": "a frozen check failing at the checkpoint, and under `verify`",
    "verification_gate": "the final story completed on a claim alone: --run",
    "verification_missing": "the story reopened while its check ran (a race): checkpoint again",
    # usage errors (exit 2): the step is the command's --help (test_usage_errors_name_help)
    "bad_goal": "--goal without ::", "bad_id": "--id x1", "bad_rounds": "--rounds 0",
    "bad_scope": "--scope /abs", "blank_brief": "--brief ' '", "blank_check": "--check G001=",
    "blank_goal": "--goal ' ::x'", "blank_item": "--accept 'G001= '",
    "dependency_cycle": "--after both ways", "no_goals": "create without --goal",
    "secret_in_command": "a token in --check", "secret_in_plan": "a token in --brief",
    "too_large": "1 MiB of --evidence", "unknown_id": "--check G009=", "usage": "no --status",
    "room_missing": "a copy of the engine without merge.py: the file copied in",
}

UNREACHABLE = {
    "busy": "`next` hands a caller its own story again rather than start another, under the "
            "lock; a ledger line that breaks the rule replays as bad_event",
    "not_startable": "`next` starts only a story pick_ready found startable, under the lock; "
                     "a ledger line that breaks the rule replays as bad_event",
    "waiting": "as not_startable: pick_ready skips a story whose dependencies are not done",
    "rounds_exhausted": "as not_startable: a story out of rounds is blocked, never ready",
    "unknown_dependency": "create and add check each id an option names first (unknown_id, "
                          "not_found); the graph check guards replays, where it is bad_event",
    "unknown_event": "only a replayed line carries an unknown kind: refused_event reports it "
                     "as bad_event",
    "bad_sequence": "commands write plan_created only first; a replayed one elsewhere is "
                    "bad_event (refused_event)",
    "damaged": "a default of transitions a command reaches only with events it builds "
               "itself; replayed, refused_event reports it as bad_event",
}


def core_codes():
    """Every error code the core's modules raise, read from their source: the code given to
    refused/usage/damaged/line_error/FablizeError (or the default where none is), an audit
    gate's `code`, and a `.code = "…"` rename."""
    defaults = {"refused": "refused", "usage": "usage", "damaged": "damaged",
                "line_error": "bad_event", "FablizeError": "refused"}
    codes = set()
    for name in ("base", "masking", "model", "storage", "runs", "render", "history", "audit",
                 "hooks", "commands", "cli"):
        tree = ast.parse((ENGINE_DIR / f"{name}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in defaults:
                at = 2 if node.func.id == "line_error" else 1
                given = node.args[at] if len(node.args) > at else next(
                    (k.value for k in node.keywords if k.arg == "code"), None)
                if given is None:
                    codes.add(defaults[node.func.id])
                elif isinstance(given, ast.Constant):
                    codes.add(given.value)
            elif isinstance(node, ast.Dict):
                keys = [getattr(k, "value", None) for k in node.keys]
                if "code" in keys and "fix" in keys:
                    value = node.values[keys.index("code")]
                    codes.add(value.value)
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute) \
                    and node.targets[0].attr == "code" and isinstance(node.value, ast.Constant):
                codes.add(node.value.value)
    return codes


def test_every_core_code_is_walked_or_said_unreachable():
    codes = core_codes()
    assert len(codes) > 60, sorted(codes)
    assert not set(WALKED) & set(UNREACHABLE)
    assert sorted(codes - set(WALKED) - set(UNREACHABLE)) == [], "codes nobody walks"
    assert sorted((set(WALKED) | set(UNREACHABLE)) - codes) == [], "codes the core never raises"
    walked = {case.code for case in CASES} | {code for code, *_ in USAGE} | {"room_missing"}
    assert walked == set(WALKED), sorted(walked ^ set(WALKED))


# The walk ########################################################################################


def run_step(fab, command, monkeypatch):
    """One step as printed, from where the user stands: the engine (in-process, as it was
    started: `goals.py`), with any `NAME=value` before it set; `cd`; anything else (git, mv,
    cp) as a shell runs it."""
    words = shlex.split(command)
    while re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        monkeypatch.setenv(name, value)
    if words[0] == "goals.py":
        return fab(*words[1:])
    if words[0] == "cd":
        monkeypatch.chdir(words[1])
        return Result(0, "", "")
    p = subprocess.run(command, shell=True, cwd=os.getcwd(), env=dict(os.environ, **git_env()),
                       capture_output=True, text=True, timeout=60)
    return Result(p.returncode, p.stdout, p.stderr)


def filled(command, values):
    """`command` as a human would run it: each <placeholder> given a value (`values` names
    some; anything else gets a word)."""
    return PLACEHOLDER.sub(lambda m: values.get(m.group(0), "filled in"), command)


def said(fab, args, opening):
    """The refusal in text: its line, with the opening words kept, then each step's whole
    command on a line of its own."""
    r = fab(*args)
    lines = r.err.splitlines()
    assert lines and lines[0].startswith("fablize: " + opening), r
    j = fab("--json", *args)
    commands = j.json["error"].get("commands") or []
    # (a step that is the command again is it as typed: under --json, with --json)
    assert [line[2:] for line in lines[1:] if line.startswith("  ")] == [
        c.replace("goals.py --json ", "goals.py ") for c in commands], r
    return r.code


def walk(fab, monkeypatch, first, code, exit, opening, end, values=None, fix=None, good=None,
         pick=None, then=None, records=False, limit=6):
    """Run `first`, which must be refused with `code` and `exit`, its message opening with
    `opening` (and, unless it `records`, no state file changed); follow each step named until
    `end`: "good" (`first` succeeds, or `good(fab)` holds), "step" (the named step ran: the user's
    wish already holds, their words must change, or what is left is another's), or "decision"
    (several commands, or one with a <placeholder>: the one `pick` names is run filled with
    `values`; it must succeed, and then `then`, when given, must too). `fix` is what the human
    does before the first step (free the lock, fix the code, put git back). `opening` may
    name the project's folder as {root}."""
    opening = opening.format(root=fab.root)
    before = state_files(fab.dir)
    if not records:
        assert said(fab, first, opening) == exit
        assert state_files(fab.dir) == before, "a refusal changed the state"
    r = fab("--json", *first)
    assert r.code == exit, r
    error = r.json["error"]
    assert error["code"] == code and error["message"].startswith(opening), error
    if not records:
        assert state_files(fab.dir) == before, "a refusal changed the state"
    seen = []
    for _ in range(limit):
        assert error["message"] not in seen, f"a circle: {error['message']}"
        seen.append(error["message"])
        commands = error.get("commands") or []
        assert commands, f"no step named: {error}"
        for command in commands:
            assert re.match(r"(?:[A-Z_]+=\S+ )?(?:goals\.py|git|mv|cd|cp) ", command), command
        if len(commands) > 1 or PLACEHOLDER.search(commands[0]):
            assert end == "decision", (end, error)
            chosen = next(c for c in commands if pick is None or pick in c)
            if fix:
                fix()
            r = run_step(fab, filled(chosen, values or {}), monkeypatch)
            assert r.code == 0, (chosen, r)
            if then is not None:
                r = fab(*then)
                assert r.code == 0, (then, r)
            return seen
        if fix:
            fix()
            fix = None
        r = run_step(fab, commands[0], monkeypatch)
        assert r.code == 0, (commands[0], r)
        if end == "step" or (good is not None and good(fab)):
            return seen
        r = fab("--json", *first)
        if r.code == 0:
            assert end == "good", (end, seen)
            return seen
        error = r.json["error"]
    pytest.fail(f"no way out after {limit} steps: {seen}")


# The states, a function each: it makes the state in `fab`'s project and returns what the walk
# takes (the command first, and what the walk's case needs besides).


def checkpoint(sid="G001", status="complete", evidence="done", *extra):
    return ["checkpoint", "--id", sid, "--status", status, "--evidence", evidence, *extra]


def judged_in_review(fab, agent=None):
    make_plan(fab, 2, "--judge", "G001")
    start(fab, "G001")
    assert fab(*checkpoint(), *(["--agent", agent] if agent else [])).code == 0


def blocked(fab):
    make_plan(fab, 2)
    start(fab, "G001")
    assert fab(*checkpoint(status="blocked", evidence="no key")).code == 0


def final_active(fab, *extra):
    make_plan(fab, 2, *extra)
    start(fab, "G001")
    assert fab(*checkpoint()).code == 0
    start(fab, "G002")


def a_repository(fab):
    """The scratch project a real git repository, its plan committed."""
    (fab.root / ".git").rmdir()
    git(fab.root, "init", "-q", "-b", "main")
    git(fab.root, "add", "-A")
    git(fab.root, "commit", "-q", "-m", "plan")


def edit_line(fab, n, change):
    lines = raw_lines(fab.dir)
    ev = json.loads(lines[n - 1])
    change(ev)
    lines[n - 1] = json.dumps(ev, ensure_ascii=False, separators=(",", ":")).encode()
    write_lines(fab.dir, lines)


def edit_snapshot_keeping_its_digest(fab):
    raw = (fab.dir / "goals.json").read_bytes()
    body = raw[77:].replace(b'"brief":"test plan"', b'"brief":"edited"')
    digest = engine.sha256_hex(body).encode()
    (fab.dir / "goals.json").write_bytes(raw[:11] + digest + raw[75:77] + body)


Case = namedtuple("Case", "code exit opening make end options", defaults=((),))


def state(code, exit, opening, end, **options):
    """A case's decorator: the function below makes its state and returns its first command."""
    def register(make):
        CASES.append(Case(code, exit, opening, make, end, options))
        return make
    return register


CASES = []


@state("no_plan", 1, "no plan — run `create` first.", "decision", then=["status"])
def _(fab, mp):
    return ["status"]


@state("plan_exists", 1, "a plan already exists. Check it with `status`", "decision",
       pick="--force", then=["audit"])
def _(fab, mp):
    make_plan(fab, 2)
    return ["create", "--brief", "again", "--goal", "a::b"]


@state("not_found", 1, "G009 not found. The plan's stories: G001, G002.", "step")
def _(fab, mp):
    make_plan(fab, 2)
    return checkpoint("G009")


@state("not_active", 1, "G002 is not active (pending) — it waits for G001; `next` activates G001 "
       "first.", "decision")
def _(fab, mp):  # `next` activates G001, whose checkpoint is what the agent then owes
    make_plan(fab, 2)
    return checkpoint("G002")


@state("not_active", 1, "G001 is not active (complete) — it is already done", "step")
def _(fab, mp):
    make_plan(fab, 2)
    start(fab, "G001")
    assert fab(*checkpoint()).code == 0
    return checkpoint()


@state("not_active", 1, "G001 is not active (blocked) — a human decides it", "decision",
       pick=" accept ", then=["next"])
def _(fab, mp):
    blocked(fab)
    return checkpoint()


@state("not_active", 1, "G001 is not active (review) — its judge decides it", "step")
def _(fab, mp):
    judged_in_review(fab)
    return checkpoint()


@state("no_evidence", 1, "a complete checkpoint requires non-empty --evidence.", "decision")
def _(fab, mp):
    make_plan(fab, 2)
    start(fab, "G001")
    return checkpoint(evidence=" ")


@state("no_evidence", 1, "a failed checkpoint requires --evidence", "decision", then=["next"])
def _(fab, mp):
    make_plan(fab, 2)
    start(fab, "G001")
    return checkpoint(status="failed", evidence="")


@state("no_evidence", 1, "a verdict requires non-empty --evidence", "decision")
def _(fab, mp):
    judged_in_review(fab)
    return ["verdict", "--id", "G001", "achieved", "--evidence", " ", "--agent", "judge"]


@state("no_agent", 1, "a verdict requires --agent (who judged).", "decision")
def _(fab, mp):
    judged_in_review(fab)
    return ["verdict", "--id", "G001", "achieved", "--evidence", "ran it", "--agent", " "]


@state("judge_not_independent", 1, "ann did the work of G001 and cannot judge it.", "step")
def _(fab, mp):
    judged_in_review(fab, agent="ann")
    return ["verdict", "--id", "G001", "achieved", "--evidence", "fine", "--agent", "ann"]


@state("judge_not_independent", 1, "audit: a verdict was not given by an independent judge",
       "decision", then=["audit", "--require-independent-judge"])
def _(fab, mp):
    judged_in_review(fab)  # checkpointed by no named agent: no verdict can be independent
    assert fab("verdict", "--id", "G001", "achieved", "--evidence", "ok", "--agent", "j").code == 0
    return ["audit", "--require-independent-judge"]


@state("not_in_review", 1, "G001 is pending, not in review — there is nothing to judge.", "step")
def _(fab, mp):
    make_plan(fab, 2)
    return ["verdict", "--id", "G001", "achieved", "--evidence", "ok", "--agent", "j"]


@state("awaiting_review", 1, "G001 awaits an independent judge", "step")
def _(fab, mp):
    judged_in_review(fab)
    return ["next"]


@state("tree_changed", 1, "the working tree changed since the judge packet", "good",
       records=True, good=lambda fab: story(fab.dir, "G001")["status"] == "in_progress")
def _(fab, mp):
    judged_in_review(fab)
    assert fab("judge-packet", "--id", "G001").code == 0
    (fab.root / "fixed-by-the-judge.txt").write_text("x")
    return ["verdict", "--id", "G001", "achieved", "--evidence", "ok", "--agent", "j"]


@state("verification_gate", 1, "the final story cannot complete without --verify-cmd and "
       "--verify-evidence", "decision", values={"<command>": "true"}, then=["audit"])
def _(fab, mp):
    final_active(fab)
    return checkpoint("G002", "complete", "ran", "--verify-cmd", "pytest -q")


@state("run_required", 1, "this plan requires a witnessed run", "decision",
       values={"<command>": "true"}, then=["audit"])
def _(fab, mp):
    final_active(fab, "--require-run")
    return checkpoint("G002", "complete", "ran", "--verify-cmd", "pytest", "--verify-evidence",
                      "1 passed")


@state("verification_failed", 1, "G001: frozen check 1 (`test -f ok.flag`) failed", "decision",
       records=True)
def _(fab, mp):
    make_plan(fab, 2, "--check", "G001=test -f ok.flag")
    start(fab, "G001")
    return checkpoint(), lambda: (fab.root / "ok.flag").write_text("")  # the agent's fix


@state("verification_failed", 1, "G001: 1 of 1 check failed", "good", records=True)
def _(fab, mp):
    make_plan(fab, 2, "--check", "G001=test -f ok.flag")
    start(fab, "G001")
    return ["verify", "--id", "G001"], lambda: (fab.root / "ok.flag").write_text("")


@state("verification_missing", 1, "G001: frozen check 1", "decision", records=True,
       then=["audit"])
def _(fab, mp):
    # the check itself fails the story and reopens it, once, while it runs outside the lock:
    # the run it records started before the story's new activation, so it cannot back it
    engine_cmd = f"{shlex.quote(str(ENGINE_DIR.parent / 'goals.py'))}"
    race = (f"test -f raced || {{ touch raced && python3 {engine_cmd} checkpoint --id G001 "
            f"--status failed --evidence again >/dev/null && python3 {engine_cmd} next "
            ">/dev/null; }")
    make_plan(fab, 2, "--check", f"G001={race}")
    start(fab, "G001")
    return checkpoint()


@state("held_by_other", 1, "G001 is held by agent ann, not an unnamed caller", "decision",
       values={"<your name>": "ann"}, then=["audit"])
def _(fab, mp):
    make_plan(fab, 2, "--parallel")
    assert fab("next", "--agent", "ann").code == 0
    return checkpoint()


@state("held_by_other", 1, "G001 is held by agent ann, not bob.", "step")
def _(fab, mp):
    make_plan(fab, 3, "--parallel")
    assert fab("next", "--agent", "ann").code == 0
    return checkpoint("G001", "complete", "done", "--agent", "bob")


@state("halted", 1, "G001 is blocked (no key) — the plan halts here", "decision",
       pick=" retry ", then=["next"])
def _(fab, mp):
    blocked(fab)
    return ["next"]


@state("nothing_ready", 1, "nothing is ready for agent c", "decision", then=["next", "--agent",
                                                                            "c"])
def _(fab, mp):
    make_plan(fab, 3, "--parallel")
    assert fab("next", "--agent", "a").code == 0
    assert fab("next", "--agent", "b").code == 0
    return ["next", "--agent", "c"]


@state("no_note", 1, "a decision requires a non-empty --note", "decision", then=["next"])
def _(fab, mp):
    blocked(fab)
    return ["decide", "--id", "G001", "retry", "--note", " "]


@state("not_decidable", 1, "G002 is pending — `decide` applies to a blocked", "step")
def _(fab, mp):
    make_plan(fab, 2)
    return ["decide", "--id", "G002", "accept", "--note", "fine"]


@state("final_started", 1, "the final story G002 is in_progress — stories can be added only "
       "before verification starts.", "decision", then=["add", "--goal", "More::more"])
def _(fab, mp):
    final_active(fab)
    return ["add", "--goal", "More::more"]


@state("final_started", 1, "the final story G002 is complete", "decision", then=["audit"])
def _(fab, mp):
    final_active(fab)
    assert fab(*checkpoint("G002", "complete", "ran", "--verify-cmd", "true", "--run")).code == 0
    return ["add", "--goal", "More::more"]


@state("final_started", 1, "the final story G002 is review", "decision",
       then=["add", "--goal", "More::more"])
def _(fab, mp):
    final_active(fab, "--judge", "G002")
    assert fab(*checkpoint("G002", "complete", "ran", "--verify-cmd", "true", "--run")).code == 0
    return ["add", "--goal", "More::more"]


@state("not_active", 1, "G002 is pending, not in progress — there is no claim to release.",
       "step")
def _(fab, mp):
    make_plan(fab, 2)
    return ["release", "--id", "G002", "--note", "gone"]


@state("no_checks", 1, "G001 has no frozen checks — give --verify-cmd", "decision",
       values={"<command>": "true"})
def _(fab, mp):
    make_plan(fab, 2)
    return ["verify", "--id", "G001"]


@state("already_paused", 1, "the guard is already paused", "step")
def _(fab, mp):
    make_plan(fab, 2)
    assert fab("pause").code == 0
    return ["pause"]


@state("not_paused", 1, "the guard is not paused.", "step")
def _(fab, mp):
    make_plan(fab, 2)
    return ["unpause"]


@state("outside_project", 1, "{root}-report.md is outside the project", "good",
       good=lambda fab: Path(f"{fab.root}-report.md").exists())
def _(fab, mp):
    make_plan(fab, 2)
    return ["report", "--out", f"{fab.root}-report.md"]


@state("symlink", 1, "{root}/link.md is a symlink — refusing to write through it.", "decision",
       values={"<another file>": "report.md"})
def _(fab, mp):
    make_plan(fab, 2)
    (fab.root / "link.md").symlink_to(fab.root / "elsewhere.md")
    return ["report", "--out", "link.md"]


@state("not_a_file", 1, "{root}/folder.md is not a regular file.", "decision",
       values={"<another file>": "report.md"})
def _(fab, mp):
    make_plan(fab, 2)
    (fab.root / "folder.md").mkdir()
    return ["report", "--out", "folder.md"]


@state("incomplete", 1, "audit: trusted but incomplete — G001 [pending]", "decision")
def _(fab, mp):
    make_plan(fab, 2)
    return ["audit", "--require-complete"]


@state("secret_in_ledger", 1, "audit: 1 event recorded what looks like a secret", "decision",
       then=["audit"])
def _(fab, mp):
    make_plan(fab, 2)
    start(fab, "G001")
    forge(fab.dir, event="checkpoint", id="G001", status="failed", evidence=f"see {TOKEN}")
    return ["audit"]


@state("missing_logs", 1, "audit: 1 verification run log is missing", "good")
def _(fab, mp):
    make_plan(fab, 2, "--check", "G001=true")
    start(fab, "G001")
    assert fab(*checkpoint()).code == 0
    a_repository(fab)
    next((fab.dir / "runs").glob("*-G001.log")).unlink()
    return ["audit", "--require-logs"]


@state("tool_missing", 1, "git is not installed (or not on PATH): judge-packet needs it.",
       "good")
def _(fab, mp):
    judged_in_review(fab)
    path = os.environ["PATH"]
    mp.setenv("PATH", str(fab.root / "no-tools-here"))
    return ["judge-packet", "--id", "G001"], lambda: mp.setenv("PATH", path)  # installed


@state("tool_timeout", 3, "git took more than 0.1 s (judge-packet).", "good")
def _(fab, mp):
    judged_in_review(fab)
    slow = Path(f"{fab.root}-slow-git")
    slow.mkdir()
    (slow / "git").write_text("#!/bin/sh\nexec sleep 30\n")
    (slow / "git").chmod(0o755)
    path = os.environ["PATH"]
    mp.setenv("PATH", f"{slow}{os.pathsep}{path}")
    mp.setattr(engine.run_tool, "__defaults__", (None, None, None, 0.1, False, None))
    return ["judge-packet", "--id", "G001"], lambda: mp.setenv("PATH", path)  # git mended


@state("io_error", 3, "I/O error: [Errno 5] Input/output error", "good")
def _(fab, mp):
    make_plan(fab, 2)
    real = os.fsync

    def failing(fd):
        raise OSError(5, os.strerror(5))
    mp.setattr(os, "fsync", failing)
    return ["next"], lambda: mp.setattr(os, "fsync", real)  # the disk mended


@state("lock_timeout", 3, "another fablize command holds {root}/.fablize/lock", "good")
def _(fab, mp):
    make_plan(fab, 2)
    mp.setenv("FABLIZE_LOCK_TIMEOUT", "0")
    held = os.open(fab.dir / "lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # another command at work
    return ["next"], lambda: os.close(held)  # and done


@state("interrupted", 130, "interrupted by SIGINT; the state is as the last completed write "
       "left it.", "good")
def _(fab, mp):
    make_plan(fab, 2)
    real = engine.commit_start

    def ctrl_c(*args):
        raise KeyboardInterrupt  # the user's Ctrl-C, as the event is about to be written
    replace_everywhere(mp, "commit_start", ctrl_c)
    return ["next"], lambda: replace_everywhere(mp, "commit_start", real)


@state("git_failed", 3, "git config failed", "good")
def _(fab, mp):
    make_plan(fab, 2)
    a_repository(fab)
    lock = fab.root / ".git" / "config.lock"
    lock.write_text("")  # another git at work on the config
    return ["install-merge"], lock.unlink


@state("bad_snapshot", 3, "goals.json is not valid JSON", "good")
def _(fab, mp):
    make_plan(fab, 2)
    (fab.dir / "goals.json").write_bytes(b"{")
    return ["status"]


@state("snapshot_edited", 3, "goals.json was changed outside fablize", "good")
def _(fab, mp):
    make_plan(fab, 2)
    path = fab.dir / "goals.json"
    path.write_text(path.read_text().replace('"brief":"test plan"', '"brief":"edited"'))
    return ["next"]


@state("snapshot_mismatch", 3, "goals.json disagrees with the replay of ledger.jsonl", "good")
def _(fab, mp):
    make_plan(fab, 2)
    edit_snapshot_keeping_its_digest(fab)
    return ["audit"]


@state("disagree", 3, "goals.json reflects event 2 but ledger.jsonl ends at event 1", "good")
def _(fab, mp):
    make_plan(fab, 2)
    start(fab, "G001")
    write_lines(fab.dir, raw_lines(fab.dir)[:-1])
    return ["status"]


@state("bad_line", 3, "ledger.jsonl line 2: not a ledger event", "good")
def _(fab, mp):
    make_plan(fab, 2)
    with open(fab.dir / "ledger.jsonl", "ab") as f:
        f.write(b"<<<<<<< HEAD\n")
    return ["audit"]


@state("bad_line", 3, "ledger.jsonl line 2: not a ledger event", "decision", then=["audit"])
def _(fab, mp):
    make_plan(fab, 2)
    start(fab, "G001")
    lines = raw_lines(fab.dir)
    write_lines(fab.dir, [lines[0], b"<<<<<<< HEAD", *lines[1:]])
    return ["audit"]


@state("bad_line", 3, "ledger.jsonl: the last two lines are damaged", "decision", then=["audit"])
def _(fab, mp):
    make_plan(fab, 2)
    start(fab, "G001")
    first = raw_lines(fab.dir)[0]
    (fab.dir / "ledger.jsonl").write_bytes(first + b'\n<<<<<<< HEAD\n{"seq":3')
    return ["status"]


@state("bad_seq", 3, "ledger.jsonl line 2: seq is 3, expected 2", "decision", then=["audit"])
def _(fab, mp):
    make_plan(fab, 2)
    start(fab, "G001")
    assert fab("pause").code == 0
    lines = raw_lines(fab.dir)
    write_lines(fab.dir, [lines[0], lines[2]])
    (fab.dir / "goals.json").unlink()
    return ["audit"]


@state("broken_chain", 3, "ledger.jsonl line 3: the hash chain is broken", "decision",
       then=["audit"])
def _(fab, mp):
    make_plan(fab, 2)
    start(fab, "G001")
    assert fab("pause").code == 0
    edit_line(fab, 2, lambda ev: ev.update(  # a legal event still, but not the one chained
        ts=ev["ts"][:20] + ("123456" if ev["ts"][20:26] != "123456" else "654321") + "+00:00"))
    (fab.dir / "goals.json").unlink()
    return ["audit"]


@state("bad_event", 3, "ledger.jsonl line 3: unknown event 'approve'", "decision",
       pick="git checkout", then=["audit"])
def _(fab, mp):
    make_plan(fab, 2)
    start(fab, "G001")
    a_repository(fab)
    forge(fab.dir, event="approve", id="G001")
    return ["status"]


@state("run_log_mismatch", 3, "ledger.jsonl line 3: runs/3-G001.log does not match", "decision",
       pick="git checkout", then=["audit"])
def _(fab, mp):
    make_plan(fab, 2, "--check", "G001=echo checked")
    start(fab, "G001")
    assert fab(*checkpoint()).code == 0
    a_repository(fab)
    (fab.dir / "runs" / "3-G001.log").write_text("edited\n")
    return ["audit"]


@state("legacy", 3, "goals.json was written by the original goals.py", "good")
def _(fab, mp):
    fab.dir.mkdir()
    (fab.dir / "goals.json").write_text(json.dumps(
        {"brief": "old plan", "created": "2024-05-01T09:00:00+00:00", "goals": [
            {"id": "G001", "title": "A", "objective": "a", "status": "pending",
             "evidence": None}]}))
    return ["audit"]


@state("not_a_directory", 3, "{root}/.fablize/archive is not a directory.", "good")
def _(fab, mp):
    make_plan(fab, 2)
    (fab.dir / "archive").write_text("a file where the archive goes\n")
    return ["create", "--force", "--brief", "anew", "--goal", "a::b"]


@state("not_a_file", 3, "{root}/.fablize/goals.json is not a regular file.", "good")
def _(fab, mp):
    make_plan(fab, 2)
    (fab.dir / "goals.json").unlink()
    (fab.dir / "goals.json").mkdir()
    return ["status"]


@state("symlink", 3, "{root}/.fablize/goals.json is a symlink — refusing to follow it", "good")
def _(fab, mp):
    make_plan(fab, 2)
    (fab.dir / "goals.json").rename(fab.root / "goals-elsewhere.json")
    (fab.dir / "goals.json").symlink_to(fab.root / "goals-elsewhere.json")
    return ["status"]


@state("cwd_gone", 3, "the working directory {root}/sub/deeper no longer exists", "good")
def _(fab, mp):
    make_plan(fab, 2)
    gone = fab.root / "sub" / "deeper"
    gone.mkdir(parents=True)
    mp.chdir(gone)
    mp.setenv("PWD", str(gone))
    gone.rmdir()
    return ["status"]


@state("not_a_file", 3, "{root}/.fablize/lock is not a regular file.", "good")
def _(fab, mp):  # a writer meets it (readers never open the lock)
    make_plan(fab, 2)
    (fab.dir / "lock").unlink()
    (fab.dir / "lock").mkdir()
    return ["next"]


@state("not_a_file", 3, "{root}/.fablize/ledger.jsonl is not a regular file.", "decision",
       then=["next"])
def _(fab, mp):  # a writer meets it; once it is moved aside, the history is gone: a new plan
    make_plan(fab, 2)
    (fab.dir / "ledger.jsonl").unlink()
    (fab.dir / "ledger.jsonl").mkdir()
    return ["next"]


@state("disagree", 3, "goals.json reflects event 2 but ledger.jsonl is empty (the file is missing)",
       "decision",
       then=["next"])
def _(fab, mp):  # no circle through rebuild, `no plan`, create and `a plan already exists`
    make_plan(fab, 2)
    start(fab, "G001")
    (fab.dir / "ledger.jsonl").unlink()
    return ["next"]


@state("io_error", 3, "short write to ledger.jsonl", "good", records=True,
       good=lambda fab: story(fab.dir, "G001")["status"] == "complete")
def _(fab, mp):  # the run is recorded; the checkpoint's line tears: the command again
    make_plan(fab, 2, "--check", "G001=echo checked")
    start(fab, "G001")
    real = os.write

    def tears_the_checkpoint(fd, data):
        if b'"event":"checkpoint"' in bytes(data)[:200]:
            return real(fd, bytes(data)[:len(data) // 2])
        return real(fd, data)
    mp.setattr(os, "write", tears_the_checkpoint)
    return checkpoint(), lambda: mp.setattr(os, "write", real)  # the disk mended


def case_id(case):
    return f"{case.code}-{case.make.__code__.co_firstlineno}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_each_refusal_and_damage_names_a_step_that_leads_out(fab, monkeypatch, case):
    made = case.make(fab, monkeypatch)
    first, fix = made if isinstance(made, tuple) else (made, None)
    walk(fab, monkeypatch, first, case.code, case.exit, case.opening, case.end, fix=fix,
         **dict(case.options))
    if case.exit == 3 and case.code != "cwd_gone":
        assert fab("audit").code == 0  # and the plan is whole: audit agrees


# Usage errors: the step is the command's --help, which the line itself names ###################

USAGE = [
    ("usage", ["checkpoint", "--id", "G001"], "checkpoint"),
    ("usage", ["next", "--agent", " "], "next"),
    ("bad_goal", ["create", "--force", "--brief", "b", "--goal", "X"], "create"),
    ("bad_id", ["checkpoint", "--id", "x1", "--status", "complete"], "checkpoint"),
    ("bad_rounds", ["create", "--force", "--brief", "b", "--goal", "a::b", "--rounds", "0"],
     "create"),
    ("bad_scope", ["create", "--force", "--brief", "b", "--goal", "a::b", "--scope", "/etc"],
     "create"),
    ("blank_brief", ["create", "--force", "--brief", " ", "--goal", "a::b"], "create"),
    ("blank_check", ["create", "--force", "--brief", "b", "--goal", "a::b", "--check", "G001="],
     "create"),
    ("blank_goal", ["create", "--force", "--brief", "b", "--goal", " ::x"], "create"),
    ("blank_item", ["create", "--force", "--brief", "b", "--goal", "a::b", "--accept",
                    "G001= "], "create"),
    ("dependency_cycle", ["create", "--force", "--brief", "b", "--goal", "a::b", "--goal",
                          "c::d", "--goal", "e::f", "--after", "G001=G002", "--after",
                          "G002=G001"], "create"),
    ("dependency_cycle", ["add", "--goal", "a::b", "--after", "G002"], "add"),
    ("no_goals", ["create", "--force", "--brief", "b"], "create"),
    ("secret_in_command", ["create", "--force", "--brief", "b", "--goal", "a::b", "--check",
                           f"G001=curl -H 'Authorization: token {TOKEN}' x"], "create"),
    ("secret_in_plan", ["create", "--force", "--brief", f"ship with {TOKEN}", "--goal", "a::b"],
     "create"),
    ("too_large", checkpoint(evidence="x" * (1 << 20) + "x"), "checkpoint"),
    ("unknown_id", ["create", "--force", "--brief", "b", "--goal", "a::b", "--check",
                    "G009=true"], "create"),
]


@pytest.mark.parametrize("code, args, command", USAGE, ids=[u[0] for u in USAGE])
def test_usage_errors_name_help(fab, code, args, command):
    """Every usage error says its step in the line itself, as argparse's do — `(see
    `goals.py COMMAND --help`)` — and --json names it whole; the help it names runs, and
    nothing changed. What to type instead is the user's: the walk ends there."""
    make_plan(fab, 2)
    start(fab, "G001")
    before = state_files(fab.dir)
    step = f"goals.py {command} --help"
    r = fab(*args)
    assert r.code == 2 and r.err.count("\n") == 1, r  # one line: the step is in it
    assert r.err.rstrip("\n").endswith(f"(see `{step}`)"), r
    j = fab("--json", *args)
    assert j.json["error"]["code"] == code and j.json["error"]["commands"] == [step], j
    assert state_files(fab.dir) == before
    r = fab(*shlex.split(step)[1:])
    assert r.code == 0 and r.out.startswith("usage: goals.py " + command), r


def test_a_copy_of_the_engine_without_a_room_names_the_file_to_copy_in(tmp_path):
    """room_missing (exit 2, before any command runs): the step is the missing file copied
    into the engine's folder from fablize's own, a human's (where fablize is is theirs to
    say); taken, the command runs."""
    project = tmp_path / "proj"
    (project / ".git").mkdir(parents=True)
    script = copy_engine(project / "scripts")
    (project / "scripts" / "fablize_gate" / "merge.py").unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")}

    def run(*args):
        return subprocess.run([ENGINE_PYTHON, str(script), *args], cwd=str(project), env=env,
                              capture_output=True, text=True, timeout=60)
    p = run("--json", "install-merge")
    error = json.loads(p.stdout)["error"]
    assert p.returncode == 2 and error["code"] == "room_missing", p
    assert error["message"].startswith("merge.py is missing from the engine's folder"), error
    [command] = error["commands"]
    assert PLACEHOLDER.search(command), command  # where fablize is: the human's to say
    p = subprocess.run(filled(command, {"<fablize>": str(ENGINE_DIR.parent.parent)}),
                       shell=True, capture_output=True, text=True)
    assert p.returncode == 0, p
    p = run("install-merge", "--help")  # the room is back: the command's parser loads it
    assert p.returncode == 0 and p.stdout.startswith("usage: "), p


def test_a_step_names_the_engine_as_it_was_started(fab, monkeypatch):
    """Run from elsewhere (the plugin's launcher, a copy by its path), each step is printed
    with the engine as it was started, never a bare `goals.py`."""
    replace_everywhere(monkeypatch, "invocation", lambda cwd=None: 'python3 "/x y/goals.py"')
    make_plan(fab, 2)
    j = fab("--json", *checkpoint("G002"))
    assert j.json["error"]["commands"] == ['python3 "/x y/goals.py" next'], j
    j = fab("--json", "verify", "--id", "G001")
    assert j.json["error"]["commands"][0].startswith('python3 "/x y/goals.py" verify --id G001')


def test_a_step_from_a_subfolder_names_paths_from_there(fab, monkeypatch):
    """A step that names a file names it from where the user stands: `mv` of a state file
    from a subfolder of the project."""
    make_plan(fab, 2)
    (fab.dir / "goals.json").unlink()
    (fab.dir / "goals.json").mkdir()
    (fab.root / "src").mkdir()
    monkeypatch.chdir(fab.root / "src")
    j = fab("--json", "status")
    assert j.json["error"]["commands"] == ["mv ../.fablize/goals.json ../.fablize/goals.json.aside"]
    assert run_step(fab, j.json["error"]["commands"][0], monkeypatch).code == 0
    assert fab("status").code == 0


def test_history_damage_outside_git_names_only_a_new_plan(fab):
    """Without a committed copy, a damaged history's only way out is a new plan, the
    damaged one archived whole: a human's to write."""
    make_plan(fab, 2)
    start(fab, "G001")
    forge(fab.dir, event="approve", id="G001")
    j = fab("--json", "audit")
    assert j.json["error"]["commands"] == [NEW_PLAN], j
    assert "a human decides whether to start a new plan (this one is kept whole in archive/):" \
        in j.json["error"]["message"], j  # one way out, not a choice "between" it


def test_a_story_another_agent_holds_is_never_offered_under_its_name(fab):
    """The step of a checkpoint on another agent's story is the caller's own (`status
    --agent`), never the checkpoint under the holder's name: that would be the way round
    the guard, printed."""
    make_plan(fab, 2, "--parallel")
    assert fab("next", "--agent", "ann").code == 0
    for caller in ([], ["--agent", "bob"]):
        j = fab("--json", *checkpoint(), *caller)
        assert j.json["error"]["code"] == "held_by_other", j
        assert not any("ann" in c for c in j.json["error"]["commands"]), j


def test_run_logs_git_does_not_hold_are_the_clone_that_ran_them_to_commit(fab):
    """--require-logs with a log git never held: no command here brings it back; the step is
    the clone that ran it committing its runs/ (where that clone is: a human's to say)."""
    make_plan(fab, 2, "--check", "G001=true")
    start(fab, "G001")
    assert fab(*checkpoint()).code == 0
    next((fab.dir / "runs").glob("*-G001.log")).unlink()
    j = fab("--json", "audit", "--require-logs")
    assert j.json["error"]["code"] == "missing_logs", j
    assert j.json["error"]["commands"] == ['git -C "<the clone that ran them>" add .fablize/runs/']


def test_the_command_named_again_keeps_a_secret_typed_into_it_masked(fab, monkeypatch):
    # the step after a lock timeout is the command as typed: a token in its evidence would reach
    # the CI log that keeps stderr
    make_plan(fab, 2)
    start(fab, "G001")
    monkeypatch.setenv("FABLIZE_LOCK_TIMEOUT", "0")
    held = os.open(fab.dir / "lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        before = state_files(fab.dir)
        r = fab("--json", "checkpoint", "--id", "G001", "--status", "complete", "--evidence",
                f"pushed with {TOKEN}")
    finally:
        os.close(held)
    assert r.code == 3 and r.json["error"]["code"] == "lock_timeout", r
    step = r.json["error"]["commands"][0]
    assert TOKEN not in r.out and "checkpoint --id G001 --status complete" in step, step
    assert "***" in step and state_files(fab.dir) == before


def test_a_checkpoint_torn_after_its_run_was_recorded_names_the_command_again(fab, monkeypatch):
    """The run is recorded (it stands, and is said to); the checkpoint's own line tore, so it
    was not recorded: the step is the checkpoint again — which completes the story — never
    "do not run the command again"."""
    make_plan(fab, 2, "--check", "G001=echo checked")
    start(fab, "G001")
    real = os.write

    def tears_the_checkpoint(fd, data):
        if b'"event":"checkpoint"' in bytes(data)[:200]:
            return real(fd, bytes(data)[:len(data) // 2])
        return real(fd, data)
    monkeypatch.setattr(os, "write", tears_the_checkpoint)
    r = fab("--json", *checkpoint())
    monkeypatch.setattr(os, "write", real)
    error = r.json["error"]
    assert r.code == 3 and error["code"] == "io_error", r
    assert "do not run the command again" not in error["message"], error
    assert "(Event 3, verify_run, was recorded in the ledger before this and stands; the " \
           "checkpoint was not recorded: running the command again records it.)" in \
           error["message"], error
    assert error["commands"] == ["goals.py --json " + " ".join(map(shlex.quote, checkpoint()))]
    r = fab(*checkpoint())
    assert r.code == 0 and "torn last line" in r.err, r
    assert story(fab.dir, "G001")["status"] == "complete"
    assert fab("audit").code == 0
