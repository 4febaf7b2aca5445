"""The command line: the parser of every command, Output (text or --json), Context, and `main`,
the one exit point.
"""

import _signal
import os
import re
import sys
import types

from .base import (
    clean, create_args, DECISIONS, DEFAULT_ROUNDS, DEFAULT_RUN_TIMEOUT, EXIT_DAMAGED, EXIT_OK,
    EXIT_SIGNAL_BASE, EXIT_USAGE, FablizeError, fix_argv_text, HOOK_AGENTS, id_arg, INFLIGHT,
    json_text, one_line, PIN, quote_arg, regex, RUNS, SCHEMA_VERSION, SHARE, STATE_DIRNAME, Step,
    TIMEOUT_OPTION, TRIPWIRE, usage, VERDICTS)
from .masking import plan_text, use_environment
from .storage import find_state_dir, lock_timeout, project_state_dir, snapshot_damage, Store
from .render import ENTRY_FOLDER, invocation, step_text
from .hooks import cmd_guard, cmd_observe, session_start, sharing_of, sharing_room
from . import __version__
# The core's other commands (commands.py) are named in their builders and loaded when one of
# them is built (Command): a hook's start — guard, observe, status --resume, read without the
# parser (hook_args) — loads neither them nor runs.py, which what starts a process loads.


ROOM_COMMANDS = {"install-block": "setup", "setup": "setup", "doctor": "setup",
                 "completion": "setup",
                 "share": "sharing", "sync": "sharing", "release": "sharing",
                 "merge-driver": "merge", "install-merge": "merge", "audit": "audit"}


def colour_on(stream):
    """Colour for a terminal only: never in a pipe or a file (nor --json, nor a hook's answer),
    never with NO_COLOR set (no-color.org); FORCE_COLOR set (force-color.org) turns it on
    anywhere, except as 0 or false."""
    if os.environ.get("NO_COLOR"):
        return False
    force = os.environ.get("FORCE_COLOR")
    if force:
        return force.lower() not in ("0", "false")
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError, OSError):
        return False


# what is painted, on a terminal: (pattern, SGR code) — marks, verdicts, headings, warnings
PAINT = ((r"(?m)^(\s*)(✓|✅[^\n]*)", "32"), (r"(?m)^(\s*)(✗|■|❌[^\n]*)", "31"),
         (r"(?m)^(\s*)(▶|⚠)", "33"), (r"(?m)^(\s*)(◇)", "34"),
         (r"(?m)^()(=== fablize handoff[^\n]*|## [^\n]*)", "1"),
         (r"(?m)^()(fablize: (?:warning:|⚠)[^\n]*)", "33"), (r"()(← you are here)", "1"))


def paint(text, stream, error=False, allowed=True):
    """`text` as `stream` shows it: coloured on a terminal (an error's line red), else as is
    (and always as is where an agent reads it: `allowed` false)."""
    if not allowed or not colour_on(stream):
        return text
    for pattern, code in PAINT:
        text = regex(pattern).sub(lambda m: f"{m.group(1)}\x1b[{code}m{m.group(2)}\x1b[0m", text)
    if error:
        text = regex(r"(?m)^(fablize: (?!warning:)[^\n]*)").sub("\x1b[31m\\1\x1b[0m", text)
    return text


class Output:
    """A command's one result: its fields (`data`, what --json carries), its warnings (storage's
    too), and how its text is drawn from those fields (`shown`: a renderer and the state the
    fields describe — set by `Context.show`). Nothing below `main` prints, except the progress
    of a run while it runs; `main` renders the result once, as text or as the one JSON object."""

    def __init__(self, json_mode):
        self.json = json_mode
        self.data = {}
        self.shown = self.drawn = None
        self.warnings = []
        self.raw = None
        self.colour = True  # false for what an agent's harness reads (a session start)

    def lines(self):
        """The result as text, a line an item: the renderer `Context.show` named, given the
        fields and the state they describe (none: the command says nothing on stdout). Drawn
        once, by `main` where a command's own failures are met (damage in the snapshot a
        renderer reads is said as damage); never under --json."""
        if self.drawn is None and self.shown is not None and not self.json:
            text, view = self.shown
            self.drawn = text(self.data, **view)
        return self.drawn or []

    def warn(self, text):
        self.warnings.append(text)

    def stream(self):
        """Where what must be seen now goes (a run starting, its output, its end): stdout in
        text mode, stderr under --json (stdout carries only the JSON object)."""
        return sys.stderr if self.json else sys.stdout

    def progress(self, text):
        stream = self.stream()
        stream.write(clean(text) + "\n")
        stream.flush()

    def render(self, command, error, code, said=None):
        """The command's result on stdout and stderr; an `error` as the command line says it
        (`said`: its message and its steps, whole — way_out)."""
        if self.raw is not None:  # a hook's answer: exactly that object, or nothing
            if self.raw:
                sys.stdout.write(json_text(self.raw[0]) + "\n")
            return
        if self.json:
            obj = {"schema_version": SCHEMA_VERSION, "ok": error is None, "command": command}
            obj.update(self.data)
            if self.warnings:
                obj["warnings"] = self.warnings
            if error is not None:
                obj["error"] = {"code": error.code, "message": said[0], "exit": code}
                if said[1]:
                    obj["error"]["commands"] = said[1]
            sys.stdout.write(json_text(obj) + "\n")
            return
        lines = self.lines()
        if lines:
            text = clean("\n".join(map(str, lines)))
            sys.stdout.write(paint(text, sys.stdout, allowed=self.colour) + "\n")
        # stdout whole before stderr: a CI log that merges the two shows what the error points
        # at ("said above") above it, not after it
        sys.stdout.flush()
        err = [f"fablize: warning: {clean(text)}" for text in self.warnings]
        if error is not None:
            message, commands = said
            err.append("fablize: " + one_line(message))
            # each step whole on its own line, but a usage error's --help, which its line
            # names as argparse's do: `(see `goals.py COMMAND --help`)`
            err += ["  " + one_line(cmd) for cmd in commands
                    if error.exit_code != EXIT_USAGE or f"`{cmd}`" not in message]
        if err:
            sys.stderr.write(paint("\n".join(err), sys.stderr, error is not None,
                                   self.colour) + "\n")


class Context:
    def __init__(self, args, out, prog=None, argv=()):
        self.args = args
        self.argv = list(argv)  # as given: a step that is this command again prints it whole
        self.build_parser = build_parser  # for a room that reads the command table (completion)
        self.out = out
        self.data = out.data
        self.json = out.json
        self.timeout = getattr(args, "timeout", None)
        if self.timeout is None:
            self.timeout = DEFAULT_RUN_TIMEOUT
        elif not self.timeout > 0:
            raise usage("--timeout must be a number of seconds > 0.")
        # every printed command runs as printed, from any directory of the project
        self.prog = self.cli = prog or invocation()
        self._store = None
        agent = getattr(args, "agent", None)
        if isinstance(agent, str):
            plan_text("--agent", agent)  # a name the plan records: never a secret

    @property
    def store(self):
        if self._store is None:
            path, discovered = find_state_dir(self.args.dir, os.getcwd())
            if not discovered:
                path = project_state_dir(path, self.out)
            self.store = Store(path, discovered, self.out.warnings)
        return self._store

    @store.setter
    def store(self, value):
        """The state directory commands work in (store_opened says what opening it does)."""
        self._store = value
        store_opened(self, value)

    def show(self, text, fields=(), **view):
        """The command's result: `fields` join its --json data, and its text is `text(data,
        **view)` — `view` the state the data describes (the plan it left, a review), which the
        JSON carries only as the data's projection of it. Rendered once, by `main`."""
        self.data.update(fields)
        self.out.shown = (text, view)

    def emit_raw(self, obj):
        """Hook output: exactly this object (or nothing), whatever --json says."""
        self.out.raw = [obj] if obj is not None else []


# No merge-driver warning from the commands that wire the driver, nor from audit (CI's copy of
# the engine is no clone), doctor (a finding says it), or the hooks whose answer is their
# harness's JSON (a warning reaches no one there)
MERGE_QUIET = ("install-merge", "setup", "merge-driver", "audit", "doctor", "guard", "observe")


def store_opened(ctx, store):
    """What every command does as it opens the state directory `store`: what is left of a run
    whose engine died is ended when the lock is next taken (end_orphans); a shared plan's store
    publishes after each write (the sharing room attaches to it); a clone whose git config
    lacks the merge driver that .gitattributes names is warned — not where no branch merge can
    touch the plan (a shared plan lives in refs), nor by MERGE_QUIET's commands. Read from
    files, no git process."""
    store.on_lock.append(end_orphans)  # a run whose engine died: ended under the lock
    sharing = sharing_of(store)
    if sharing is not None:
        sharing.attach(store)
    elif getattr(ctx.args, "command", None) not in MERGE_QUIET:
        from .merge import merge_driver_missing
        if merge_driver_missing(store.root):
            ctx.out.warn(f".gitattributes merges {STATE_DIRNAME}/ with fablize's merge driver, "
                         "which this clone's git config does not have: a merge of two "
                         f"branches' plans would leave conflict markers — `{ctx.prog} "
                         "install-merge` (once in each clone; `setup` does it too).")


def end_orphans(store):
    """runs.end_orphaned_runs, under the lock, where a run was noted in flight since it last
    tidied: it reads only the notes' folder, runs/.inflight/ (and removes it once empty), so
    it has nothing to do where there is none — as for most writes a hook makes, which then do
    not load runs.py (0.45 ms of a start)."""
    if os.path.lexists(os.path.join(store.path(RUNS), INFLIGHT)):
        from .runs import end_orphaned_runs
        end_orphaned_runs(store)


def add_create(command):
    c = command("create", "cmd_create", "create a plan of sequential stories",
            "the last one is the verification gate; freeze the commands that prove a story with "
            "--check and --verify")
    c.add_argument("--brief", required=True, help="the task, in one line")
    c.add_argument("--goal", action="append", default=[], metavar="TITLE::OBJECTIVE",
                   help="a story, in order (repeat; the last is the final verification story)")
    c.add_argument("--force", action="store_true",
                   help="replace an existing plan (it is archived whole in archive/<plan id>/)")
    c.add_argument("--check", action="append", default=[], metavar="ID=CMD",
                   help="freeze an acceptance command for a story (repeatable); its completion "
                        "runs it and needs exit 0")
    c.add_argument("--verify", action="append", default=[], metavar="CMD",
                   help="freeze a check on the final story (repeatable; same as --check on it)")
    c.add_argument("--after", action="append", default=[], metavar="ID=IDS",
                   help="explicit dependencies, e.g. G004=G001,G002; G003= means none "
                        "(default: each story after the one before it)")
    c.add_argument("--parallel", action="store_true",
                   help="no default dependencies: every story but the final one is independent")
    c.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, metavar="N",
                   help=f"rounds a story may fail before it is blocked (default {DEFAULT_ROUNDS})")
    c.add_argument("--require-run", action="store_true",
                   help="the final story completes only on a run the engine witnessed")
    c.add_argument("--judge", action="append", nargs="?", const="ALL", metavar="ID",
                   help="require an independent judge's verdict: for every story, or for ID")
    c.add_argument("--accept", action="append", default=[], metavar="ID=TEXT",
                   help="an acceptance item for a judge to check on a story (repeatable)")
    c.add_argument("--scope", action="append", default=[], metavar="PATH",
                   help="a path the work may change (repeatable: a file, a folder, or a glob like "
                        "src/** or src/*.py; never the whole tree, nor the tests); CI's re-run "
                        "takes only these from the branch, and the tests, tools and build files "
                        "from the base")
    c.add_argument("--remote", metavar="NAME",
                   help="share the new plan through this git remote (see `share`)")


def add_next(command):
    c = command("next", "cmd_next", "activate the next ready story, print its handoff",
            'a story already in progress for this agent is printed again, never restarted; '
            'without --agent, none an agent holds is handed out')
    c.add_argument("--agent", metavar="NAME",
                   help="claim a ready story for this agent (one active story per agent)")


def add_timeout(c):
    c.add_argument(*TIMEOUT_OPTION[0], **TIMEOUT_OPTION[1])


def add_checkpoint(command):
    c = command("checkpoint", "cmd_checkpoint", "record a story's result, with evidence",
            "complete needs evidence, and the final story needs verification; frozen checks run "
            "by themselves")
    c.add_argument("--id", required=True, type=id_arg, help="the story, e.g. G001 (g1 works too)")
    c.add_argument("--status", required=True, choices=["complete", "failed", "blocked"],
                   help="complete (achieved), failed (not achieved: another round), blocked "
                        "(cannot be achieved: a human decides)")
    c.add_argument("--evidence", default="",
                   help="what was done and what shows it; for failed what is missing, for blocked "
                        "why (required for every status)")
    c.add_argument("--verify-cmd", dest="verify_cmd", default="",
                   help="the verification command that was run (final story)")
    c.add_argument("--verify-evidence", dest="verify_evidence", default="",
                   help="its result (final story; optional with --run)")
    c.add_argument("--run", action="store_true",
                   help="the engine runs --verify-cmd itself and records the run; only exit 0 "
                        "passes")
    add_timeout(c)
    c.add_argument("--agent", metavar="NAME", help="the agent recording it (must hold the story)")


def add_status(command):
    c = command("status", "cmd_status", "show the plan and what to do next",
            "every story, what it waits for, and the next command (the first command when "
            "resuming)")
    c.add_argument("--resume", action="store_true",
                   help="also print the handoff of each story in progress; print nothing when "
                        "there is no plan (for SessionStart hooks)")
    c.add_argument("--agent", metavar="NAME",
                   help="the next step for this agent: its own story, never another agent's")
    add_hook_for(c, "with --resume: answer")


def add_verify(command):
    c = command("verify", "cmd_verify", "run a story's frozen checks now",
            "the runs are recorded; the story's status does not change")
    c.add_argument("--id", required=True, type=id_arg, help="the story, e.g. G001")
    c.add_argument("--verify-cmd", dest="verify_cmd", default="",
                   help="a command to run when the story has no frozen checks")
    add_timeout(c)


def add_decide(command):
    c = command("decide", "cmd_decide", "a human's call on a blocked, failed or in-review story",
            "accept it, retry it, or amend its objective")
    c.add_argument("--id", required=True, type=id_arg, help="the story, e.g. G001")
    c.add_argument("decision", choices=DECISIONS,
                   help="accept (counts as done), retry (back to work, rounds reset), amend "
                        "(extend the objective, back to work)")
    c.add_argument("--note", required=True, help="the reason, or the feedback or amendment")
    c.add_argument("--sign", metavar="KEYFILE",
                   help="sign the decision with this ssh key (ssh-keygen -Y sign -n fablize)")
    c.add_argument("--signer", metavar="PRINCIPAL",
                   help="the signer's principal, as listed in the allowed-signers file")


def add_add(command):
    c = command("add", "cmd_add", "add a story before the final one",
            'stories can be added until the final story starts')
    c.add_argument("--goal", required=True, metavar="TITLE::OBJECTIVE", help="the new story")
    c.add_argument("--check", action="append", default=[], metavar="CMD",
                   help="freeze an acceptance command for it (repeatable)")
    c.add_argument("--after", metavar="IDS",
                   help="its dependencies, e.g. G001,G002; empty for none (default: the story "
                        "before the final one)")
    c.add_argument("--accept", action="append", default=[], metavar="TEXT",
                   help="an acceptance item for a judge (repeatable)")
    c.add_argument("--judge", action="store_true", help="require an independent judge's verdict")


def add_rebuild(command):
    command("rebuild", "cmd_rebuild", "regenerate goals.json from the ledger",
            'the old snapshot is kept beside it')


def add_log(command):
    c = command("log", "cmd_log", "the plan's history, readable",
            "every event of the ledger, checked as audit checks it")
    c.add_argument("--id", type=id_arg, help="only this story's events, e.g. G001")


def add_guard(command):
    c = command("guard", cmd_guard, "Stop hook: no stopping while work is left",
                "reads the hook JSON on stdin; never blocks on bad input, a busy lock or damaged "
                "state")
    add_hook_for(c, "answer")


def add_report(command):
    c = command("report", "cmd_report", "a Markdown summary for a PR or CI job",
            'progress, stories, the latest runs and the dependency graph')
    c.add_argument("--out", metavar="FILE",
                   help="write it here (default: append to $GITHUB_STEP_SUMMARY when set, else "
                        "stdout)")
    c.add_argument("--outside", action="store_true",
                   help="--out may name a file outside the project (never through a symlink)")
    add_tripwire_base(c)


def add_judge_packet(command):
    c = command("judge-packet", "cmd_judge_packet", "what a judge needs to judge a story",
            "the objective, the checklist and this round's evidence and runs")
    c.add_argument("--id", required=True, type=id_arg, help="the story, e.g. G001")
    add_tripwire_base(c)


def add_tripwire_base(c):
    c.add_argument("--base", metavar="REF",
                   help="list the work's lines since this git ref (e.g. origin/main) whose code "
                        f"{TRIPWIRE} (tripwires)")


def add_verdict(command):
    c = command("verdict", "cmd_verdict", "a judge's verdict on a story in review",
            "the judge must not be the story's executor")
    c.add_argument("--id", required=True, type=id_arg, help="the story, e.g. G001")
    c.add_argument("verdict", choices=VERDICTS,
                   help="achieved (complete), not-achieved (another round with what is missing), "
                        "unachievable (blocked: a human decides)")
    c.add_argument("--evidence", required=True, help="what you checked and saw, or what is missing")
    c.add_argument("--agent", required=True, help="who judged (must not be the executor)")


def add_hook_for(c, what):
    c.add_argument("--for", dest="hook_for", choices=HOOK_AGENTS, default="claude",
                   help=f"{what} in this agent's hook protocol (default: claude)")
    c.add_argument("--plugin", action="store_true",
                   help="this registration is the fablize-gate plugin's: it does nothing where "
                        "the project registers its own (each hook runs once)")


def add_pause(command):
    c = command("pause", "cmd_pause", "let the Stop guard rest (recorded)",
                "the agent may stop although the plan has work; recorded in the ledger")
    c.add_argument("--note", help="why (shown in status and the history)")


def add_unpause(command):
    command("unpause", "cmd_unpause", "turn the Stop guard back on", "recorded in the ledger")


def add_observe(command):
    c = command("observe", cmd_observe, "PostToolUse hook: note verification runs",
                "records a verification command the agent ran and what its harness reported "
                "(reads the hook JSON on stdin)")
    add_hook_for(c, "read the payload")


# The core's commands, by their builders; the rooms' (ROOM_COMMANDS) come from their rooms.
COMMANDS = {"create": add_create, "next": add_next, "checkpoint": add_checkpoint,
            "status": add_status, "verify": add_verify, "decide": add_decide, "add": add_add,
            "rebuild": add_rebuild, "log": add_log, "guard": add_guard,
            "report": add_report, "judge-packet": add_judge_packet, "verdict": add_verdict,
            "pause": add_pause, "unpause": add_unpause, "observe": add_observe}


def command_names():
    """Every command, as `--help` lists them: the core's, then the rooms'."""
    return list(COMMANDS) + list(ROOM_COMMANDS)
DIR_HELP = ("state directory (default: $FABLIZE_DIR, else .fablize/ found walking up to the "
            "repository root); a project root means its .fablize/")
JSON_HELP = "print exactly one JSON object to stdout"


def command_in(argv):
    """The subcommand named in argv, so that only its parser is built (argparse costs ~1 ms a
    subcommand); None for --help, --version or anything unexpected."""
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token == "--dir":
            skip = True
        elif token in COMMANDS or token in ROOM_COMMANDS:
            return token
        elif not (token == "--json" or token.startswith("--dir=")):
            return None
    return None


def hook_args(argv, name):
    """The arguments of a hook's command line — `guard`, `observe`, `status --resume`, with the
    options they declare (add_hook_for; --dir, --json) — as the parser would give them, read
    without it: a hook runs at every tool call, and the parser (argparse, the patterns it
    compiles, the commands it names) is some 4 ms of its CPU (`status --resume` on a 100-story
    plan: 22.0 ms, 25.8 ms through the parser). None for anything else (help, an abbreviation,
    a value it would refuse): then the parser reads the line, with its own errors."""
    if name not in ("guard", "observe", "status"):
        return None
    values = {"dir": None, "json": False, "command": name, "hook_for": "claude", "plugin": False}
    flags = {"--json": "json", "--plugin": "plugin"}
    takes = {"--dir": "dir", "--for": "hook_for"}
    if name == "status":  # a session start: cmd_status hands --resume to it
        values.update(resume=False, agent=None, func=session_start)
        flags["--resume"], takes["--agent"] = "resume", "agent"
    else:
        values["func"] = cmd_guard if name == "guard" else cmd_observe
    tokens, named = list(argv), False
    while tokens:
        token = tokens.pop(0)
        option, equals, value = token.partition("=")
        if token == name and not named:
            named = True
        elif token in flags:
            values[flags[token]] = True
        elif option in takes and (equals or tokens):
            value = value if equals else tokens.pop(0)
            if not equals and value.startswith("-"):
                return None  # argparse's: it expected a value
            values[takes[option]] = value
        else:
            return None
    if values["hook_for"] not in HOOK_AGENTS or (name == "status" and not values["resume"]):
        return None
    return types.SimpleNamespace(**values)


class Command:
    """One command as its builder declares it: its --help lines and the add_argument calls
    argparse is given, kept, so that only the command named is built (build_parser) and its
    options can be listed (the docs' tests)."""

    def __init__(self, name, func, summary, details):
        self.name, self.summary, self.description = name, summary, f"{summary}: {details}"
        if isinstance(func, str):  # a core command's, by its name in commands.py
            from . import commands
            func = getattr(commands, func)
        self.defaults = {"func": func}
        self.arguments = []  # (option strings, add_argument's keywords)
        self.epilog, self.raw_epilog = None, False

    def add_argument(self, *names, **options):
        self.arguments.append((names, options))

    def set_defaults(self, **values):
        self.defaults.update(values)


def room_of(command):
    """The room that declares `command` (ROOM_COMMANDS), imported when one of its commands runs."""
    room = ROOM_COMMANDS[command]
    if room == "sharing":
        return sharing_room()
    if room == "setup":
        from . import setup
        return setup
    if room == "audit":
        from . import audit
        return audit
    from . import merge
    return merge


def command_spec(name):
    """The Command `name` declares: the core's builder, or its room's (loaded for it)."""
    builder = COMMANDS.get(name) or room_of(name).COMMANDS[name]
    made = []
    builder(lambda *fields: made.append(Command(*fields)) or made[-1])
    return made[0]


def better_usage_error(parser, message):
    """argparse's complaint, with what was probably meant: an unknown command or choice gets
    its nearest name (`chekpoint` → `checkpoint`) instead of the list of every one, and an
    unknown option the nearest option of its command."""
    import difflib
    m = re.match(r"argument (\S+): invalid choice: '?(.*?)'? \(choose from (.*)\)\Z", message, re.S)
    if m:
        name, word = m.group(1), m.group(2)
        choices = re.findall(r"[\w-]+", m.group(3))
        close = difflib.get_close_matches(word, choices, 1, 0.7)
        hint = f" — did you mean `{close[0]}`?" if close else ""
        if name == "COMMAND":
            return f"unknown command `{one_line(word)}`{hint}"
        return message + hint  # the original's words, which scripts may read
    m = re.match(r"unrecognized arguments: (.*)\Z", message, re.S)
    if m:
        options = set()  # the commands' own options: --dir or --help are seldom what was meant
        for action in parser._actions:
            for sub in (getattr(action, "choices", None) or {}).values():
                if isinstance(sub, argparse_parser()):
                    options.update(o for a in sub._actions for o in a.option_strings)
        for word in m.group(1).split():
            close = difflib.get_close_matches(word.split("=")[0],
                                              sorted(options - {"--dir", "--json", "-h", "--help"}),
                                              1, 0.7)
            if word.startswith("-") and close:
                return f"{message} — did you mean `{close[0]}`?"
    return message


def argparse_parser():
    import argparse
    return argparse.ArgumentParser


# what --help shows a command (None: the engine's own --help) used for: whole command lines
EXAMPLES = {
    None: ['create --brief "Add --version" --goal "Flag::cli.py accepts --version" '
           '--goal "Verify::the tests pass" --verify "python3 -m pytest -q"',
           "next",
           'checkpoint --id G001 --status complete --evidence "cli.py --version prints 1.0"',
           "status", "audit"],
    "create": ['--brief "Add --version" --goal "Flag::cli.py accepts --version" '
               '--goal "Verify::the tests pass" --verify "python3 -m pytest -q"',
               '--brief "Two parts" --parallel --goal "API::the endpoint answers" '
               '--goal "UI::the page shows it" --goal "Verify::all tests pass" '
               '--check "G001=python3 -m pytest -q tests/test_api.py" --verify "make test"'],
    "checkpoint": ['--id G001 --status complete --evidence "tests/test_cli.py passes: 4 passed"',
                   '--id G002 --status complete --evidence "the suite passes" --run '
                   '--verify-cmd "python3 -m pytest -q"',
                   '--id G001 --status failed --evidence "the parser rejects -V"',
                   '--id G001 --status blocked --evidence "needs an API key nobody has"'],
    "decide": ['--id G003 accept --note "the manual check is enough here"',
               '--id G003 retry --note "use the fixture in tests/conftest.py"',
               '--id G003 amend --note "only the CLI, not the GUI"'],
    "audit": ["", "--require-complete --require-logs",
              "--base origin/main --rerun --require-witnessed"],
    "status": ["", "--resume"],
}


def examples(prog, name):
    command = f"{prog} {name}" if name else prog
    return "Examples:\n" + "\n".join(f"  {command} {line}".rstrip() for line in EXAMPLES[name])


def terminal_width():
    """The width argparse would use (shutil.get_terminal_size's columns, less 2): $COLUMNS,
    else the terminal's, else 80."""
    try:
        columns = int(os.environ.get("COLUMNS", 0))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
    return (columns or 80) - 2


def build_parser(only=None, prog="goals.py"):
    """The command-line parser: every command, or just `only`."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise usage(f"{better_usage_error(self, message)} (see `{self.prog} --help`)",
                        steps=f"{self.prog} --help")

    # argparse makes a formatter for each option it is given, and one without a width imports
    # shutil (bz2, lzma) to ask for the terminal's: ~2.7 ms of every start (a hook's ~10%)
    width = terminal_width()

    class Formatter(argparse.HelpFormatter):
        def __init__(self, prog):
            super().__init__(prog, max_help_position=30, width=width)
            self._action_max_length = 20  # room for `install-block` and its line on one row

        def _fill_text(self, text, width, indent):  # examples keep their lines
            return text if "\n" in text else super()._fill_text(text, width, indent)

    class RawFormatter(argparse.RawDescriptionHelpFormatter):
        def __init__(self, prog):
            super().__init__(prog, width=width)

    common = Parser(add_help=False, formatter_class=Formatter)
    common.add_argument("--dir", default=argparse.SUPPRESS, metavar="PATH", help=DIR_HELP)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=JSON_HELP)

    p = Parser(prog=prog, formatter_class=Formatter,
               description="fablize goal engine: split a task into stories; "
               "\"done\" is refused until evidence shows it.",
               epilog=examples(prog, None) +
               "\n\nExit codes: 0 done, 1 refused, 2 usage, 3 damaged state; 128+N interrupted"
               "\nby signal N during a run (130 SIGINT, 143 SIGTERM, 129 SIGHUP), the run"
               f"\nrecorded as interrupted. `{prog} COMMAND --help` shows a command's options.")
    p.add_argument("--version", action="version", version=f"fablize {__version__}",
                   help="print the version and exit")
    p.add_argument("--dir", default=None, metavar="PATH", help=DIR_HELP)
    p.add_argument("--json", action="store_true", default=False, help=JSON_HELP)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for name in command_names() if only is None else [only]:
        # a command's summary is its line in `--help`, and its own --help starts with it
        spec = command_spec(name)
        epilog = spec.epilog
        if name in EXAMPLES:
            epilog = examples(prog, name) + (f"\n\n{epilog}" if epilog else "")
        c = sub.add_parser(name, parents=[common], help=spec.summary,
                           description=spec.description, epilog=epilog,
                           formatter_class=RawFormatter if spec.raw_epilog else Formatter)
        for names, options in spec.arguments:
            c.add_argument(*names, **options)
        c.set_defaults(**spec.defaults)
    return p


def utf8_streams():
    """Marks like ✓ ▶ ■ must not crash a cp949 or cp1252 console: write UTF-8 regardless. A
    stream started closed (None) writes to the null device: what it would say is lost, not the
    exit code."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower()
        encoding = encoding.replace("-", "").replace("_", "")
        if encoding != "utf8" and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(encoding="utf-8", errors="replace")
            except (ValueError, OSError):
                pass


def answer_interrupts(interrupts):
    """From here on, Ctrl-C raises KeyboardInterrupt, which `main` answers; one kept while the
    process started (`interrupts`, the entry's list; None in-process) is raised now."""
    if interrupts is not None:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
        if interrupts:
            raise KeyboardInterrupt


def shared_elsewhere(store):
    """After the original's `no plan` refusal (its words first: scripts match them), the one
    case it never had: a fresh clone of a shared plan — the branch pins it, or the remote
    shares one (asked only here, on the way out, of the remote `sync` would use) — brings it
    in with `sync`; `create` would start a second plan. What says so, or None."""
    if store is None or os.path.lexists(store.path(SHARE)):
        return None
    if os.path.lexists(store.path(PIN)):
        return "this repository pins a shared plan"
    return sharing_room().remote_sharing(store.root)


def cwd_gone():
    """The error of a command started in a directory that was deleted (or moved away) since,
    naming the nearest folder that is still there; None when the directory is there."""
    try:
        os.getcwd()
        return None
    except FileNotFoundError:
        pass
    where = os.environ.get("PWD") or ""
    parent = os.path.dirname(where) if os.path.isabs(where) else ""
    while parent and not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    error = FablizeError(f"the working directory {where or ''} no longer exists (deleted or "
                         "moved away): change to the project's folder and run the command again"
                         + (f"; the nearest folder still there is {parent}:" if parent else "."),
                         "cwd_gone", EXIT_DAMAGED, f"cd {quote_arg(parent)}" if parent else ())
    return error


# the errors whose step is the command again, once what stopped it is fixed or over: a tool
# missing or too slow, git's own failure, a write that failed before anything was recorded, a
# signal that stopped it
RUN_AGAIN = ("io_error", "tool_missing", "tool_timeout", "git_failed", "interrupted")
# damage to the history itself (the ledger, or a run log it digests), which no command repairs
HISTORY_DAMAGE = ("bad_event", "bad_seq", "broken_chain", "bad_line", "run_log_mismatch")


def way_out(ctx, error, argv):
    """`error` as the command line says it, once: (its message, its steps as whole command
    lines, runnable as printed — the engine as it was started). What only the command line
    knows is said here, the error itself left as it was raised: an event this command recorded
    before it failed stands (recorded_note), and where the error names no step, the one it
    leaves to the command line — a usage error's `--help`; no plan's `create` (what to write is
    a human's), or `sync` for a clone of a shared plan; the command again, where a lock, a tool
    or a signal stopped it; `status` after an event that stands; a history no command repairs,
    a human's decision (commands.history_way_out)."""
    prog = ctx.prog if ctx is not None else invocation()
    store = ctx._store if ctx is not None else None
    message, steps = error.message, list(error.steps)
    recorded = store.recorded if store is not None else ()
    if recorded and error.exit_code == EXIT_DAMAGED:  # after a durable event: it stands
        message += " " + recorded_note(store)
    code, command = error.code, command_in(argv)
    if steps:
        pass
    elif error.exit_code == EXIT_USAGE:  # said as argparse says it, in the line itself
        step = f"{prog} {command} --help" if command else f"{prog} --help"
        message += f" (see `{step}`)"
        steps = [step]
    elif code == "no_plan":
        where = shared_elsewhere(store)
        if where is not None:
            message = (f"{message[:-1]}, or, as {where} this clone has not brought in "
                       "yet, `sync` it:")
        steps = [Step.engine("sync" if where is not None else create_args())]
    elif code == "interrupted":
        steps = [Step.again()]
    elif recorded and not store.unrecorded:  # an event this command recorded stands:
        steps = [Step.engine("status")]  # seen first, never run twice
    elif code == "lock_timeout":
        steps = [Step.again(env=f"FABLIZE_LOCK_TIMEOUT={max(60.0, 2 * lock_timeout()):g}")]
    elif code in RUN_AGAIN and "a human" not in message:  # else the message's repair
        # is a human's first (a room says which): the command again would meet it again
        steps = [Step.again()]
    elif (code in HISTORY_DAMAGE and store is not None
          and not getattr(ctx.args, "remote", None)):  # a remote's history: the sharing room's
        from .commands import history_way_out
        said, steps = history_way_out(store, error)
        message += said
    return message, [step_text(step, prog, argv) for step in steps]


def recorded_note(store):
    """What a failure after a durable event says of it: it stands. When what failed was the
    append of a later event (a torn or unsynced line, never recorded), the command again
    records that one — a checkpoint whose line tore after its runs were recorded completes
    when run again; otherwise the command is not to be run again for what stands."""
    seq, kind = store.recorded[-1]
    if store.unrecorded:
        return (f"(Event {seq}, {kind}, was recorded in the ledger before this and stands; "
                f"the {store.unrecorded} was not recorded: running the command again records "
                "it.)")
    return (f"(Event {seq}, {kind}, was recorded in the ledger before this and stands: "
            "`status` shows it; do not run the command again for it.)")


def keep_interrupts(interrupts):
    if interrupts is not None:
        _signal.signal(_signal.SIGINT, lambda signum, frame: None)


def missing_module(e):
    """The module of the engine's folder whose absence raised the ImportError `e`, or None."""
    if (e.name or "").startswith("fablize_gate."):
        return e.name.split(".")[-1]
    m = re.match(r"cannot import name '(\w+)' from 'fablize_gate'", str(e))
    return m.group(1) if m and e.name == "fablize_gate" else None


def main(argv=None, interrupts=None):
    """Run one command (`argv`, by default the process's) and return its exit code; the one
    exit point. `interrupts`: the Ctrl-Cs the entry kept while the process started (a list),
    when this is a whole process — then Ctrl-C is answered here in one line."""
    argv = [fix_argv_text(x) for x in (sys.argv[1:] if argv is None else argv)]
    utf8_streams()
    out = Output("--json" in argv)
    command = ctx = None
    try:
        answer_interrupts(interrupts)
        use_environment(os.environ)  # the secrets and places masking keeps out of the plan
        # usage errors and --help name the engine as it was started, runnable as printed
        prog = invocation()  # once a start: the usage line and every printed command use it
        name = command_in(argv)
        args = hook_args(argv, name) or build_parser(name, prog).parse_args(argv)
        command = args.command
        out.json = args.json and command != "guard"
        ctx = Context(args, out, prog, argv)
        args.func(ctx, args)
        out.lines()  # drawn here: what the text meets in the snapshot is the snapshot's damage
        code, error = EXIT_OK, None
    except FablizeError as e:
        code, error = e.exit_code, e
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        # a failure on what the snapshot holds is its damage; on a sound one, a genuine bug
        error = snapshot_damage(ctx._store) if ctx is not None and ctx._store else None
        if error is None:
            raise e
        code = error.exit_code
    except ImportError as e:  # a copy of the engine's folder without one of its rooms
        missing = missing_module(e)
        if missing is None:
            raise
        code, error = EXIT_USAGE, FablizeError(
            f"{missing}.py is missing from the engine's folder fablize_gate/ — copy "
            "goals.py and fablize_gate/ from fablize's scripts/ folder together (README: Add it "
            "to your project).", "room_missing", EXIT_USAGE,
            f"cp \"<fablize>/scripts/fablize_gate/{missing}.py\" "
            f"{quote_arg(os.path.join(ENTRY_FOLDER, 'fablize_gate', ''))}")
    except BrokenPipeError:  # the reader of a run's streamed output left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:  # a failing disk, a full one, a permission: state stays old or new
        code, error = EXIT_DAMAGED, cwd_gone() or FablizeError(f"I/O error: {e}", "io_error",
                                                               EXIT_DAMAGED)
    except KeyboardInterrupt:  # Ctrl-C outside a run: every write is whole or absent
        error = FablizeError("interrupted by SIGINT; the state is as the last completed write "
                             "left it.", "interrupted", EXIT_SIGNAL_BASE + 2)
        code = error.exit_code
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    keep_interrupts(interrupts)  # the command is over: a Ctrl-C now changes nothing it did or says
    try:
        out.render(command, error, code, way_out(ctx, error, argv) if error else None)
        sys.stdout.flush()
    except BrokenPipeError:  # `goals.py status | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


def run(interrupts=None):
    """`main` as a whole process. It ends with os._exit: by then every write is fsynced and the
    lock released, so the interpreter's teardown would only free memory, which costs a start
    about 4 ms (more with a large plan loaded)."""
    import gc
    gc.disable()  # a short-lived process: what it allocates is freed on exit; reference
    # counting still frees everything else
    code = main(None, [] if interrupts is None else interrupts)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: started with that descriptor closed
                stream.flush()
        except (OSError, ValueError):  # a reader that left, a stream already closed
            pass
    os._exit(code)
