"""Hooks: what an agent's harness runs — the Stop guard (`guard`), the PostToolUse recorder
(`observe`) and the session start (`status --resume`): reading its payloads and answering in its
protocol, always with exit 0.
"""

import os
import re
import sys
import time

from .base import (
    clean, count_noun, DEFAULT_GUARD_MAX, defused_line, DUPLICATE_WINDOW, FablizeError, INFLIGHT,
    json_text, last_chars, load_json, one_line, regex, RUNS, SHARE, sha256_hex, TAIL_CHARS)
from .masking import mask_places, masked_tail
from .model import (
    active_stories, find_story, guard_capped, guard_paused, observed_words,
    plan_done, unaddressed_failure)
from .storage import find_state_dir, Store
from .render import (
    hand_to_judge, human_command, inflight_json, next_action, text_session_start)


def read_hook_stdin():
    """The hook's JSON payload from stdin, or None for anything else (never an error: a hook
    that fails on odd input would trap or blind the agent)."""
    raw = b""
    if not sys.stdin.isatty():
        try:
            raw = sys.stdin.buffer.read(1 << 20)
        except (OSError, ValueError, AttributeError):
            raw = b""
    try:
        payload = load_json(raw) if raw.strip() else None
    except ValueError:
        payload = None
    return raw, payload if isinstance(payload, dict) else None


def asks_human(payload):
    """Whether the agent ended its turn by asking the human something: then stopping is right.
    Claude Code and Codex send `last_assistant_message`, Gemini CLI `prompt_response`."""
    text = payload.get("last_assistant_message")
    if not isinstance(text, str):
        text = payload.get("prompt_response")
    if not isinstance(text, str):
        return False
    lines = [x.strip() for x in text.strip().splitlines() if x.strip() and x.strip() != "```"]
    return bool(lines) and lines[-1].rstrip("*_`)\"' ").endswith(("?", "？"))


def hook_fingerprint(raw, payload):
    """What makes two guard runs the same stop: the same payload over the same transcript. Two
    registrations of the guard are fed the same stop at once; two real stops have a turn of the
    agent (transcript lines) between them. Without a transcript there is nothing to tell them
    apart by, so every run counts."""
    path = payload.get("transcript_path")
    if not isinstance(path, str) or not path:
        return None
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return sha256_hex(raw + f"\0{st.st_size}\0{st.st_mtime_ns}".encode())[:32]


def duplicate_stop(plan, fingerprint):
    guard = plan["guard"]
    if (fingerprint is None or guard.get("hook") != fingerprint
            or not isinstance(guard.get("hook_ts"), str)):
        return False
    try:
        import datetime
        then = datetime.datetime.fromisoformat(guard["hook_ts"]).timestamp()
    except ValueError:
        return False
    return abs(time.time() - then) < DUPLICATE_WINDOW


def guard_limit():
    raw = os.environ.get("FABLIZE_GUARD_MAX", str(DEFAULT_GUARD_MAX))
    return int(raw) if raw.isascii() and raw.isdigit() else DEFAULT_GUARD_MAX


def background_work(payload):
    """How many of the agent's own background tasks still run, as the Stop payload says
    (Claude Code sends `background_tasks`: subagents, shells, monitors, workflows); 0 when the
    payload says none or nothing. A task whose status says it is over is not counted."""
    tasks = payload.get("background_tasks")
    if not isinstance(tasks, list):
        return 0
    over = ("completed", "complete", "done", "failed", "killed", "cancelled", "canceled",
            "stopped", "error")
    return sum(1 for t in tasks
               if not (isinstance(t, dict) and isinstance(t.get("status"), str)
                       and t["status"].lower() in over))


def guard_reason(cli, plan, payload, fingerprint=None):
    """What the Stop guard does with this stop: (kind, text, whether another registration of
    the guard counted this stop). kind None: the agent may stop, nothing said (no plan, done,
    paused, halted on a human, a question for one); "block": sent back to work, `text` its next
    action; "wait": its own background work still runs — the turn ends, the guard spends none
    of its blocks and checks again at the next stop; "capped": let go after too many blocks in a
    row, with work left (recorded)."""
    if plan is None or guard_paused(plan) or asks_human(payload):
        return None, None, False  # paused by a human, or the turn ended on a question for one
    action = next_action(cli, plan, anyone=True)
    if action["kind"] not in ("finish", "next", "judge"):
        return None, None, False  # done, or halted on a human's decision
    running = background_work(payload)
    if running:
        return "wait", (f"fablize guard: the plan is not finished (next: {action['text']}), but "
                        f"{count_noun(running, 'background task')} of the agent still "
                        f"{'runs' if running == 1 else 'run'}: the turn may end; the guard checks "
                        "again when the agent next stops."), False
    limit = guard_limit()
    dup = duplicate_stop(plan, fingerprint)
    blocks = plan["guard"]["blocks"] if payload.get("stop_hook_active") is True else 0
    if dup:
        blocks = max(blocks - 1, 0)  # the other registration of the guard counted this stop
    if blocks >= limit:
        return "capped", (f"fablize guard: let the agent stop after {blocks} blocks in a row; the "
                          f"plan is not finished — `{human_command(cli)} status` says where it "
                          "stands."), dup
    story = find_story(plan, action["id"])
    if action["kind"] == "finish":
        reason = (f"fablize: {story['id']} \"{defused_line(story['title'])}\" is still in "
                  f"progress. Finish it, then run: {action['cmd']} (or --status failed / "
                  "blocked with the reason).") + observed_failure_note(story)
    elif action["kind"] == "judge":
        reason = hand_to_judge(cli, story)
    else:
        reason = (f"fablize: the plan is not finished — {story['id']} "
                  f"\"{defused_line(story['title'])}\" is ready. Run: {action['cmd']}")
    return "block", reason + f" [guard block {blocks + 1} of at most {limit} in a row]", dup


def guard_answer(agent, reason):
    """A block, in the words of the agent's Stop-hook protocol."""
    if agent == "gemini":
        return {"decision": "deny", "reason": reason}
    if agent == "cursor":
        return {"followup_message": reason}
    return {"decision": "block", "reason": reason}


def observed_failure_note(story):
    bad = unaddressed_failure(story)
    if bad is None:
        return ""
    return (f" The harness saw `{one_line(last_chars(bad['cmd'], 200))}` fail "
            f"({observed_words(bad, ', ')}event {bad.get('seq')}) and it has not been seen to pass "
            "since: address it first.")


def harness_outcome(payload):
    """(exit code or None, passed: True/False/None, detail, the command's output) from a
    PostToolUse-style payload — the harness's report of the run, never the agent's own words."""
    def exit_in(text, last=False):
        # the harness's own line, never one the command printed: Claude Code's failure text
        # opens with it, Gemini CLI's llmContent gives it after the command's output
        if not last:
            first = (text or "").lstrip().split("\n", 1)[0]
            m = regex(r"(?i)\s*exit(?:ed)?(?: with)?(?: code|\s+status)?\s*[:=]?\s*(-?\d+)"
                      ).match(first)
            return int(m.group(1)) if m else None
        found = regex(r"^\s*exit(?:ed)?(?: with)?(?: code|\s+status)?\s*[:=]?\s*(-?\d+)\s*$",
                      re.I | re.M).findall(text or "")
        return int(found[-1]) if found else None
    if payload.get("hook_event_name") == "PostToolUseFailure":
        error = payload.get("error")
        text = error if isinstance(error, str) else json_text(error)
        code = exit_in(text)
        return code, False, text, text
    resp = payload.get("tool_response")
    if isinstance(resp, str):
        code = exit_in(resp, last=True)
        return code, None if code is None else code == 0, resp, resp
    if not isinstance(resp, dict):
        return None, None, "", ""
    detail = json_text(resp)
    output = "\n".join(v for v in resp.values() if isinstance(v, str))
    for key in ("exit_code", "exitCode", "returncode", "returnCode", "exit_status"):
        if type(resp.get(key)) is int:
            return resp[key], resp[key] == 0, detail, output
    if resp.get("error"):  # Gemini CLI: a tool error
        return (exit_in(str(resp.get("llmContent") or resp["error"]), last=True), False, detail,
                output)
    if resp.get("interrupted") is True:
        return None, False, detail, output
    code = exit_in(resp.get("llmContent") if isinstance(resp.get("llmContent"), str) else "",
                   last=True)
    if code is not None:
        return code, code == 0, detail, output
    return None, True, detail, output  # Claude Code reports a failing command as PostToolUseFailure


def observed_outcome(payload, cmd, story):
    """The fields of an observed_run beside its command: what the harness reported (exit_code,
    ok, detail), read against what the command's test runner printed where its output shows
    it, as frozen checks are — a runner that reports a failure is a failure whatever the exit
    code; a command whose exit status is not its runner's (a pipe, `;`, `||`) is never a pass;
    a runner that ran no test is no pass either. `report` (the runner's counts, the failing
    tests it named) and `exit_hidden` are recorded when there is something to say."""
    code, ok, detail, output = harness_outcome(payload)
    fields = {"exit_code": code, "ok": ok, "detail": detail}
    report = observed_report(cmd, output)
    hidden = exit_hidden(cmd, lambda words: is_verification(words, story))
    if report:
        fields["report"] = report
    if hidden:
        fields["exit_hidden"] = True
    if report and (report["failed"] or report["errors"]):
        fields["ok"] = False
    elif hidden:
        fields["ok"] = False if ok is False else None  # the pipeline failed, or unknown
    elif report and ok and not report.get("missing") and not report["passed"]:
        fields["ok"] = None  # no test ran: nothing was seen to pass
    return fields


FAILING_SAID = 5  # failing tests an observed run names (its output tail holds the rest)
# one line of a test's own outcome, as each runner prints it where its output allows (pytest -v
# or -r, unittest -v and its failure headers, go test -v, cargo test, node --test's TAP)
PER_TEST = {
    "pytest": (r"(?P<id>\S+::\S+) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b"
               r"|(?P<outcome2>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?P<id2>\S+)"),
    "unittest": (r"(?P<id>\w+ \([\w.]+\)) \.\.\. (?P<outcome>ok|FAIL|ERROR|skipped|"
                 r"expected failure|unexpected success)\b"
                 r"|(?P<outcome2>FAIL|ERROR): (?P<id2>\w+ \([\w.]+\))"),
    "go": r"--- (?P<outcome>PASS|FAIL|SKIP): (?P<id>\S+)",
    "cargo": r"test (?P<id>\S+) \.\.\. (?P<outcome>ok|FAILED|ignored)\b",
    "node": r"(?P<outcome>not ok|ok) \d+ - (?P<id>.+?)(?: # (?:SKIP|TODO)\b.*)?",
}
OUTCOME_OF = {"PASSED": "passed", "ok": "passed", "PASS": "passed", "XPASS": "passed",
              "FAILED": "failed", "FAIL": "failed", "not ok": "failed",
              "unexpected success": "failed", "ERROR": "errors", "SKIPPED": "skipped",
              "SKIP": "skipped", "skipped": "skipped", "ignored": "skipped", "XFAIL": "skipped",
              "expected failure": "skipped"}


# reports.py's outcomes, in this reading's words
FROM_REPORTS = {"passed": "passed", "failed": "failed", "error": "errors", "skipped": "skipped",
                "xfailed": "skipped"}


def frozen_check_reading(runner, text):
    """{test: outcome} as a frozen check's log is read, test by test, for the runners read from
    their lines there (reports.py: unittest -v, cargo test, go test -json) — where the output
    holds them whole (a reading that disagrees with the runner's own count, as a cut output
    does, is no reading); else None."""
    from . import reports
    reader = reports.LINE_READERS.get(runner)
    if reader is None:
        return None
    found = reports.Report([runner])
    if not reader(found, text) or found.problems or not found.tests:
        return None
    return {test: FROM_REPORTS.get(outcomes[-1], "errors")
            for test, outcomes in found.tests.items()}


def per_test(runner, lines):
    """{test: passed/failed/errors/skipped} of the tests whose own line `runner` printed in
    `lines`, the latest line of each winning (pytest's short summary after its verbose line):
    what a cut output still shows, where frozen_check_reading finds no whole reading."""
    pattern = PER_TEST.get(runner)
    if pattern is None:
        return {}
    rx, seen = regex(pattern), {}
    for line in lines:
        m = rx.fullmatch(line.strip()) or (rx.match(line.strip()) if runner == "pytest" else None)
        if m:
            found = m.groupdict()
            test, outcome = found.get("id") or found.get("id2"), (found.get("outcome")
                                                                   or found.get("outcome2"))
            if runner == "unittest":  # named as reports.py names it: `mod.Class.test_x`
                name, dotted = regex(r"(\w+) \(([\w.]+)\)").fullmatch(test).groups()
                test = dotted if dotted.endswith("." + name) else f"{dotted}.{name}"
            seen[test] = OUTCOME_OF[outcome]
    return seen


# Observed runs (the agent's own commands, seen by a hook) have only their output: a runner's
# closing summary is what they can be read by. A witnessed run reads the runner's own report
# (reports.py) instead: any test can print a summary.
_ANSI = r"\x1b\[[0-9;?]*[A-Za-z]"
_PYTEST_LINE = (r"=* ?((?:\d+ \w+(?:, )?)+|no tests ran) in \d+(?:\.\d+)?s"
                r"(?: \(\d+:\d\d:\d\d\))? ?=*\Z")
_UNITTEST_RAN = r"Ran (\d+) tests? in "
_UNITTEST_END = r"(OK|FAILED|NO TESTS RAN)(?: \((.*)\))?\Z"
_GO_LINE = r"(ok|FAIL)\s+\S+\s+(.*)\Z"
_CARGO_LINE = r"test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored;"
_NODE_LINE = r"[#\u2139] (tests|pass|fail|cancelled|skipped|todo) (\d+)\Z"
_JEST_LINE = r"(Tests|Test Suites):\s+(.*\d+ total)\Z"
_VITEST_LINE = r"(Tests|Test Files)\s+(.*)\(\d+\)\Z"
_COUNT = r"(\d+) ([a-z]+(?: [a-z]+)?)"


def runner_counts(runner, lines):
    """{passed, failed, errors, skipped} summed over every summary `runner` printed in `lines`
    (the run's output, escape sequences already taken out), or None when it printed none. For
    `go test` the counts are packages (its summary without -v names no single test)."""
    counts, seen = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}, False
    ran = None

    def add(**more):
        for key, n in more.items():
            counts[key] += n

    for line in lines:
        line = line.strip()
        if runner == "pytest":
            m = regex(_PYTEST_LINE).match(line)
            if m:
                seen = True
                items = {w: int(n) for n, w in regex(_COUNT).findall(m.group(1))}
                add(passed=items.get("passed", 0) + items.get("xpassed", 0),
                    failed=items.get("failed", 0),
                    errors=items.get("error", 0) + items.get("errors", 0),
                    skipped=items.get("skipped", 0) + items.get("xfailed", 0))
        elif runner == "unittest":
            m = regex(_UNITTEST_RAN).match(line)
            if m:
                ran = int(m.group(1))
                continue
            m = regex(_UNITTEST_END).match(line) if ran is not None else None
            if m:
                seen = True
                items = {w.strip(): int(n)
                         for w, n in regex(r"([a-z ]+)=(\d+)").findall(m.group(2) or "")}
                failed = items.get("failures", 0) + items.get("unexpected successes", 0)
                errors, skipped = items.get("errors", 0), (items.get("skipped", 0)
                                                           + items.get("expected failures", 0))
                add(passed=max(ran - failed - errors - skipped, 0), failed=failed,
                    errors=errors, skipped=skipped)
                ran = None
        elif runner == "go":
            m = regex(_GO_LINE).match(line)
            if m and (m.group(1) == "FAIL" or "no tests to run" not in m.group(2)):
                seen = True
                if m.group(1) == "ok":
                    add(passed=1)
                elif "build failed" in m.group(2) or "setup failed" in m.group(2):
                    add(errors=1)
                else:
                    add(failed=1)
        elif runner == "cargo":
            m = regex(_CARGO_LINE).match(line)
            if m:
                seen = True
                add(passed=int(m.group(1)), failed=int(m.group(2)), skipped=int(m.group(3)))
        elif runner == "node":
            m = regex(_NODE_LINE).match(line)
            if m:
                seen = seen or m.group(1) == "tests"
                n = int(m.group(2))
                add(**{"pass": {"passed": n}, "fail": {"failed": n}, "cancelled": {"errors": n},
                       "skipped": {"skipped": n}, "todo": {"skipped": n}}.get(m.group(1), {}))
        elif runner in ("jest", "vitest"):
            m = regex(_JEST_LINE if runner == "jest" else _VITEST_LINE).match(line)
            if m:
                items = {w: int(n) for n, w in regex(_COUNT).findall(m.group(2))}
                if m.group(1) == "Tests":
                    seen = True
                    add(passed=items.get("passed", 0), failed=items.get("failed", 0),
                        skipped=items.get("skipped", 0) + items.get("todo", 0))
                else:  # a suite or file that failed without a failing test did not load
                    counts["suite_failed"] = counts.get("suite_failed", 0) + items.get("failed", 0)
    suites = counts.pop("suite_failed", 0)
    if suites and not counts["failed"]:
        counts["errors"] += suites
        seen = True
    return counts if seen else None


# a runner's closing counts as an output cut or trimmed may show them, where runner_counts
# (a frozen check's whole log) finds none: pytest's without its `in 0.12s` (`1 failed, 3
# passed`), unittest's `FAILED (failures=1)` without the `Ran N tests` above it
LOOSE = {"pytest": r"=*\s*((?:\d+ (?:failed|passed|errors?|skipped|xfailed|xpassed|deselected|"
                   r"warnings?)(?:, |\s)?)+)(?:\s*in \d+(?:\.\d+)?s\b.*)?\s*=*",
         "unittest": r"(FAILED|OK) \(((?:[a-z ]+=\d+(?:, )?)+)\)"}


def loose_counts(runner, lines):
    """{passed, failed, errors, skipped} of the last closing-counts line of `runner` in
    `lines` that LOOSE reads, or None."""
    pattern = LOOSE.get(runner)
    rx, found = regex(pattern) if pattern else None, None
    for line in lines if rx else ():
        m = rx.fullmatch(line.strip())
        if m:
            found = m
    if found is None:
        return None
    if runner == "unittest":
        items = {w.strip(): int(n) for w, n in regex(r"([a-z ]+)=(\d+)").findall(found.group(2))}
        return {"passed": 0, "failed": items.get("failures", 0), "errors": items.get("errors", 0),
                "skipped": items.get("skipped", 0)}
    items = {w: int(n) for n, w in regex(r"(\d+) ([a-z]+)").findall(found.group(1))}
    if not {"passed", "failed", "error", "errors"} & set(items):
        return None
    return {"passed": items.get("passed", 0) + items.get("xpassed", 0),
            "failed": items.get("failed", 0),
            "errors": items.get("error", 0) + items.get("errors", 0),
            "skipped": items.get("skipped", 0) + items.get("xfailed", 0)}


def observed_report(cmd, output):
    """What the test runners `cmd` starts reported in `output` (reports.test_runners names
    them): each test's outcome as a frozen check's log is read where the output holds it whole
    (frozen_check_reading); else the runner's closing counts (runner_counts, or what a cut
    output keeps of them, LOOSE), else the count of the tests' own lines (per_test); and the
    failing tests named (a few). None for a command that starts no runner the engine reads. A
    reading here can only fail an observed run or leave it unknown: a pass still needs the
    harness's own success."""
    # loaded for a verification's command only: the other hooks' starts (a stop, a session
    # start, a `git status`) do not load reports.py
    from .reports import test_runners
    runners = test_runners(cmd)
    if not runners:
        return None
    text = regex(_ANSI).sub("", output)
    lines = text.splitlines()
    report = {"runner": "+".join(runners), "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    missing, failing = [], []
    for runner in runners:
        tests = frozen_check_reading(runner, text)
        if tests is not None:  # each test's outcome, as a frozen check's: its counts are these
            failing += [t for t, outcome in tests.items() if outcome in ("failed", "errors")]
            for outcome in tests.values():
                report[outcome] += 1
            continue
        tests = per_test(runner, lines)
        failing += [t for t, outcome in tests.items() if outcome in ("failed", "errors")]
        counts = runner_counts(runner, lines) or loose_counts(runner, lines)
        if counts is None and tests:
            counts = {k: sum(1 for v in tests.values() if v == k)
                      for k in ("passed", "failed", "errors", "skipped")}
        if counts is None:
            missing.append(runner)
            continue
        for key, n in counts.items():
            report[key] += n
    if missing:
        report["missing"] = missing
    if failing:
        report["failing"] = failing[:FAILING_SAID]
    return report


def exit_hidden(cmd, verifies):
    """Whether the exit status a shell reports for `cmd` may not be its verification's — the
    last command `verifies` (its text) says is one, else the first: anything but `&&` (and
    redirections) after it — a pipe (`| tail -3` exits 0 whatever pytest said) unless
    `set -o pipefail` came before, `;`, `||`, `&`, a new line. The line is read by the lexer
    the check commands are read with (reports.shell_parts)."""
    from .reports import shell_parts  # loaded for a verification's command only, as below
    try:
        parts = shell_parts(cmd)
    except ValueError:
        return True  # it cannot be read: nothing says the exit status is the runner's
    first, last, pipefail = None, None, False
    for i, (words, _) in enumerate(parts):
        if not words:
            continue
        texts = [text for text, _, _ in words]
        if texts[0] == "set" and "pipefail" in texts:
            pipefail = True
        if first is None and texts[0] not in ("cd", "set", "export"):
            first = (i, pipefail)
        if verifies(cmd[words[0][1]:words[-1][2]]):
            last = (i, pipefail)
    if (last or first) is None:
        return False
    at, pipefail = last or first
    for _, op in parts[at:]:
        if op in ("||", ";", ";;", "&", "\n") or (op == "|" and not pipefail):
            return True
    return False


def shell_command_of(payload):
    tool_input = payload.get("tool_input")
    cmd = tool_input.get("command") if isinstance(tool_input, dict) else None
    if isinstance(cmd, list) and all(isinstance(x, str) for x in cmd):
        cmd = " ".join(cmd)
    return cmd if isinstance(cmd, str) and cmd.strip() else None


# What a verification looks like, form by form, each with the text it cannot match without: a
# command is a verification where one of these follows its start, a space, `;&|(` or `/` and ends
# a word. Only the forms whose text the command holds are compiled, into one pattern: the whole
# table is 0.6 ms of compiling, `pytest -q`'s one form 0.05 ms, and a command that holds none of
# the texts — most of what an agent runs: `ls`, `git diff` — compiles nothing.
VERIFY_FORMS = (
    *(((name,), re.escape(name)) for name in (
        "tox", "nox", "unittest", "ctest", "jest", "vitest", "mocha", "rspec", "phpunit", "ruff",
        "flake8", "pylint", "mypy", "pyright", "eslint", "tsc", "shellcheck", "vermin")),
    (("test",), r"py\.?test|[\w.-]*tests?[\w.-]*\.sh"),
    (("make",), r"make(?:\s+-\S+)*\s+(?:test|check|lint|verify|ci|demo)[\w-]*"),
    (("npm", "yarn", "bun"),
     r"(?:npm|pnpm|yarn|bun)\s+(?:run\s+)?(?:test|lint|check|build|typecheck|verify)[\w:-]*"),
    (("cargo",), r"cargo\s+(?:test|check|clippy|build|nextest)"),
    (("go",), r"go\s+(?:test|vet|build)"),
    (("gradle", "mvn"), r"(?:\./)?(?:gradlew?|mvnw?)\s+(?:\S+\s+)*?(?:test|check|verify|build)"),
    (("test",), r"(?:dotnet|bazel|swift|mix|deno)\s+test"),
    (("goals.py", "fablize"), r"(?:goals\.py|fablize)\s+(?:audit|verify)"),
)


def looks_like_verification(cmd):
    """Whether `cmd` runs a test runner, a linter or type checker, or a build tool's verifying
    target, by the form of one (VERIFY_FORMS)."""
    forms = [form for texts, form in VERIFY_FORMS if any(text in cmd for text in texts)]
    return bool(forms) and regex(r"(?:^|[\s;&|(/])(?:" + "|".join(forms) + r")\b").search(
        cmd) is not None


def is_verification(cmd, story):
    # the engine's own commands are in the ledger already (`checkpoint --run` names pytest too);
    # most commands name neither, and then the pattern is not compiled (0.2 ms of a hook)
    if ("goals.py" in cmd or "fablize" in cmd) and re.search(
            r"""(?:goals\.py|(?:^|[\s/;&|(])fablize)["']?(?:\s+--\S+)*\s+(?!verify|audit)[a-z]""",
            cmd):
        return False
    return (any(c.strip() and c.strip() in cmd for c in story["checks"]) or
            looks_like_verification(cmd))


# The hook commands, and what they share with the others ###########################################


def sharing_room():
    """The sharing room (share, sync, release, create --remote, audit --remote), loaded when a
    command needs it."""
    from . import sharing
    return sharing


def sharing_of(store):
    """The sharing room when the plan in `store` is shared (its share.json: one lstat), else
    None: a local plan never loads it."""
    return sharing_room() if os.path.lexists(store.path(SHARE)) else None


def read_plan_and_share(store, imports=False):
    """(plan or None, what a shared plan's remote says or None), read without the lock."""
    with store.session(exclusive=False, imports=imports) as s:
        plan = s.load()
    sharing = sharing_of(store) if plan is not None else None
    return plan, sharing and sharing.status(store, plan), sharing


def hook_store(ctx, payload):
    """A hook runs wherever the agent's harness started it: the plan is the one of the
    directory the payload names."""
    cwd = payload.get("cwd")
    if not isinstance(cwd, str) or "\x00" in cwd or not os.path.isdir(cwd):
        cwd = os.getcwd()  # the payload's own, when it names a directory at all
    if ctx.args.dir is None and not os.environ.get("FABLIZE_DIR"):
        ctx.store = Store(*find_state_dir(None, cwd), ctx.out.warnings)
    return ctx.store


def steps_aside(a, root, role):
    """Whether this is the plugin's copy of a hook (`--plugin`) in a project whose committed
    settings register their own: then the project's runs, and this one answers nothing."""
    if not getattr(a, "plugin", False):
        return False
    from .setup import registers  # the setup room, only for the plugin's copy of a hook
    return registers(root, role)


def hook_trouble(role, doing, e):
    """The one line a hook says when the state cannot be read or written (damage, a busy lock, a
    read-only folder, a directory where a file should be): what it could not do, and why."""
    why = e.message if isinstance(e, FablizeError) else f"I/O error: {one_line(str(e))}"
    return f"fablize {role}: {doing} — {why.rstrip('.')}"


def cmd_guard(ctx, a):
    """guard: the Stop hook. It always answers in its harness's words and exits 0: bad input,
    damage, a busy lock or an I/O error never trap the agent — it may stop, and is told in one
    line what the guard could not do."""
    raw, payload = read_hook_stdin()
    if payload is None:
        return  # empty or malformed input never blocks
    if a.hook_for == "cursor":  # Cursor counts its own follow-ups and says how the turn ended
        if payload.get("status", "completed") != "completed":
            return ctx.emit_raw(None)
        count = payload.get("loop_count")
        payload["stop_hook_active"] = isinstance(count, int) and count > 0
    try:
        if steps_aside(a, hook_store(ctx, payload).root, "guard"):
            return ctx.emit_raw(None)
        reason, message = guard_verdict(ctx, payload, hook_fingerprint(raw, payload))
    except (FablizeError, OSError) as e:  # say so, never trap the agent
        reason, message = None, (f"fablize guard: {e.message}" if isinstance(e, FablizeError)
                                 else hook_trouble("guard", "the plan could not be checked or "
                                                   "its block recorded, so the agent may stop", e))
    if reason:
        ctx.emit_raw(guard_answer(a.hook_for, reason))
    elif message and a.hook_for != "cursor":
        ctx.emit_raw({"systemMessage": message})
    else:
        ctx.emit_raw({} if a.hook_for == "gemini" else None)  # Gemini CLI reads stdout as JSON


def guard_verdict(ctx, payload, fingerprint):
    """(reason to block or None, message for the user or None) for a Stop hook. A stop at the
    guard's cap, with work left, is recorded once (guard_capped): `status`, `report` and `audit`
    say the agent stopped with work left."""
    if not hook_store(ctx, payload).exists():
        return None, None
    with ctx.store.session(exclusive=False) as s:
        kind, text, _ = guard_reason(ctx.cli, s.load(), payload, fingerprint)
        if kind in (None, "wait"):
            return None, text  # most stops: decided without the lock, nothing written
    with ctx.store.session() as s:
        plan = s.load()
        kind, text, dup = guard_reason(ctx.cli, plan, payload, fingerprint)
        if kind in (None, "wait"):
            return None, text
        if kind == "capped":
            if guard_capped(plan) is None:  # said once however often the agent stops after it
                action = next_action(ctx.cli, plan, anyone=True)
                s.commit("guard_capped", blocks=plan["guard"]["blocks"], id=action["id"])
            return None, text
        if not dup:  # a second registration of the guard answers the same, writes nothing
            s.commit("guard_block", reason=mask_places(text, s.store.root),
                     fresh=payload.get("stop_hook_active") is not True,
                     **({"hook": fingerprint} if fingerprint else {}))
        return text, None


def cmd_observe(ctx, a):
    """observe: the PostToolUse hook. It only records, and always answers in its harness's
    words with exit 0: what it could not record (damage, a busy lock, an I/O error) is said in
    one line, never a failure of the agent's tool call."""
    raw, payload = read_hook_stdin()
    ctx.emit_raw({} if a.hook_for == "gemini" else None)  # it only records; Gemini wants JSON
    cmd = shell_command_of(payload) if payload else None
    if cmd is None:
        return
    try:
        store = hook_store(ctx, payload)
        if steps_aside(a, store.root, "observe"):
            return
        if not store.exists():
            return
        with store.session() as s:
            plan = s.load()
            active = active_stories(plan) if plan else []
            if len(active) != 1 or not is_verification(cmd, active[0]):
                return  # nothing to attribute it to, or not a verification
            seen = observed_outcome(payload, cmd, active[0])
            tool = payload.get("tool_name")
            if seen.get("report", {}).get("failing"):
                seen["report"]["failing"] = [masked_tail(t, 300, store.root)
                                             for t in seen["report"]["failing"]]
            s.commit("observed_run", id=active[0]["id"], cmd=masked_tail(cmd, 2000, store.root),
                     tool=masked_tail(tool, 200, None) if isinstance(tool, str) else a.hook_for,
                     **dict(seen, detail=masked_tail(seen["detail"], TAIL_CHARS, store.root)))
    except (FablizeError, OSError) as e:  # never fail the agent's tool call over our bookkeeping
        ctx.emit_raw({"systemMessage": hook_trouble(
            "observe", f"`{one_line(last_chars(cmd, 120))}` was not recorded", e)})


def runs_in_flight(ctx):
    """The runs noted in flight (inflight_json) — one a session that died mid-run left, which
    the resumed session is to run again — read only where a note's folder is (runs.py is loaded
    then alone)."""
    if not os.path.lexists(os.path.join(ctx.store.path(RUNS), INFLIGHT)):
        return []
    from .runs import inflight_runs
    return inflight_json(inflight_runs(ctx.store))


def session_start(ctx, a):
    """`status --resume` for a SessionStart hook: the plan and its active handoffs; one line for
    a finished plan; nothing without a plan; one warning line, still exit 0, for a damaged one
    (an exit 3 there is a message the agent never sees). Codex and Gemini CLI take it as JSON
    context. Never coloured: an agent reads it."""
    ctx.out.colour = False
    view = {"prog": ctx.prog}
    try:
        if steps_aside(a, ctx.store.root, "status"):
            return ctx.emit_raw({} if a.hook_for in ("codex", "gemini") else None)
        plan, share, sharing = (read_plan_and_share(ctx.store, imports=True)
            if ctx.store.exists() else (None, None, None))
        view.update(plan=plan, sharing=sharing)
        if plan is not None and not plan_done(plan):
            if share:
                ctx.data["share"] = share
            view["in_flight"] = runs_in_flight(ctx)
    except (FablizeError, OSError) as e:
        view["unreadable"] = (ctx._store.dir if ctx._store is not None else "this project",
                              e.message if isinstance(e, FablizeError) else f"I/O error: {e}")
    if a.hook_for in ("codex", "gemini"):
        lines = text_session_start(ctx.data, **view)
        ctx.emit_raw({"hookSpecificOutput": {"hookEventName": "SessionStart",
                                             "additionalContext": "\n".join(map(clean, lines))}}
                     if lines else {})
    else:
        ctx.show(text_session_start, **view)
