"""Hooks: what an agent's harness runs (guard, observe): reading its payloads and answering
in its protocol.
"""

import os
import re
import sys
import time

from .base import (
    DEFAULT_GUARD_MAX, defused_line, DUPLICATE_WINDOW, json_text, last_chars, load_json,
    one_line, regex, sha256_hex)
from .model import find_story, guard_paused, unaddressed_failure
from .render import hand_to_judge, human_command, next_action


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


def guard_reason(cli, plan, payload, fingerprint=None):
    """(why the agent may not stop now — its next action — or a note that the guard lets go
    after too many blocks in a row, or None; whether another registration counted this stop)."""
    if plan is None or guard_paused(plan) or asks_human(payload):
        return None, False  # paused by a human, or the turn ended on a question for one
    action = next_action(cli, plan, anyone=True)
    if action["kind"] not in ("finish", "next", "judge"):
        return None, False  # done, or halted on a human's decision
    limit = guard_limit()
    dup = duplicate_stop(plan, fingerprint)
    blocks = plan["guard"]["blocks"] if payload.get("stop_hook_active") is True else 0
    if dup:
        blocks = max(blocks - 1, 0)  # the other registration of the guard counted this stop
    if blocks >= limit:
        return (f"fablize guard: let the agent stop after {blocks} blocks in a row; the plan is "
                f"not finished — `{human_command(cli)} status` says where it stands."), dup
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
    return reason + f" [guard block {blocks + 1} of at most {limit} in a row]", dup


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
    code = f"exit {bad['exit_code']}, " if isinstance(bad.get("exit_code"), int) else ""
    return (f" The harness saw `{one_line(last_chars(bad['cmd'], 200))}` fail ({code}event "
            f"{bad.get('seq')}) and it has not been seen to pass since: address it first.")


def observed_outcome(payload):
    """(exit code or None, passed: True/False/None, detail) from a PostToolUse-style payload —
    the harness's report of the run, never the agent's own words."""
    def exit_in(text, last=False):
        # the harness's own line, never one the command printed: Claude Code's failure text
        # opens with it, Gemini CLI's llmContent gives it after the command's output
        found = regex(r"^\s*exit(?:ed)?(?: with)?(?: code|\s+status)?\s*[:=]?\s*(-?\d+)\s*$",
                      re.I | re.M).findall(text or "")
        lines = (text or "").lstrip().split("\n", 1)
        if not last:
            m = regex(r"(?i)\s*exit(?:ed)?(?: with)?(?: code|\s+status)?\s*[:=]?\s*(-?\d+)"
                      ).match(lines[0])
            return int(m.group(1)) if m else None
        return int(found[-1]) if found else None
    if payload.get("hook_event_name") == "PostToolUseFailure":
        error = payload.get("error")
        text = error if isinstance(error, str) else json_text(error)
        code = exit_in(text)
        return code, False, text
    resp = payload.get("tool_response")
    if isinstance(resp, str):
        code = exit_in(resp, last=True)
        return code, None if code is None else code == 0, resp
    if not isinstance(resp, dict):
        return None, None, ""
    detail = json_text(resp)
    for key in ("exit_code", "exitCode", "returncode", "returnCode", "exit_status"):
        if type(resp.get(key)) is int:
            return resp[key], resp[key] == 0, detail
    if resp.get("error"):  # Gemini CLI: a tool error
        return exit_in(str(resp.get("llmContent") or resp["error"]), last=True), False, detail
    if resp.get("interrupted") is True:
        return None, False, detail
    code = exit_in(resp.get("llmContent") if isinstance(resp.get("llmContent"), str) else "",
                   last=True)
    if code is not None:
        return code, code == 0, detail
    return None, True, detail  # Claude Code reports a failing command as PostToolUseFailure


def shell_command_of(payload):
    tool_input = payload.get("tool_input")
    cmd = tool_input.get("command") if isinstance(tool_input, dict) else None
    if isinstance(cmd, list) and all(isinstance(x, str) for x in cmd):
        cmd = " ".join(cmd)
    return cmd if isinstance(cmd, str) and cmd.strip() else None
VERIFY_LIKE = r"""(?x)(?:^|[\s;&|(/])(?:
    py\.?test|tox|nox|unittest|ctest|jest|vitest|mocha|rspec|phpunit|ruff|flake8|pylint|mypy|
    pyright|eslint|tsc|shellcheck|vermin|[\w.-]*tests?[\w.-]*\.sh|
    make(?:\s+-\S+)*\s+(?:test|check|lint|verify|ci|demo)[\w-]*|
    (?:npm|pnpm|yarn|bun)\s+(?:run\s+)?(?:test|lint|check|build|typecheck|verify)[\w:-]*|
    cargo\s+(?:test|check|clippy|build|nextest)|go\s+(?:test|vet|build)|
    (?:\./)?(?:gradlew?|mvnw?)\s+(?:\S+\s+)*?(?:test|check|verify|build)|dotnet\s+test|
    bazel\s+test|swift\s+test|mix\s+test|deno\s+test|
    (?:goals\.py|fablize)\s+(?:audit|verify))\b"""


def is_verification(cmd, story):
    # the engine's own commands are in the ledger already (`checkpoint --run` names pytest too);
    # most commands name neither, and then the pattern is not compiled (0.2 ms of a hook)
    if ("goals.py" in cmd or "fablize" in cmd) and re.search(
            r"""(?:goals\.py|(?:^|[\s/;&|(])fablize)["']?(?:\s+--\S+)*\s+(?!verify|audit)[a-z]""",
            cmd):
        return False
    return (any(c.strip() and c.strip() in cmd for c in story["checks"]) or
        bool(re.search(VERIFY_LIKE, cmd)))
