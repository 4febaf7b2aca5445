"""The documents cannot drift from the code.

README.md, docs/*.md, SKILL.md, fablize-block.md and the agent definitions are read against
the engine itself: its parser (every command and option), its error codes (read from the
source), its exit codes, environment variables, events, statuses and version. A command
line in any document that names an option the engine does not have fails here. Each page
holds what it is for: README is short (the quick start, setup, the CI recipe), and what it
links to — docs/reference.md (every command, option, error code, variable, JSON field, the
hooks by hand), docs/ci.md (the recipe in full, the action's inputs), docs/threat-model.md
(the attack tables, each row naming a test that exists) — is held here to the same checks
that held README when it carried all of it.
"""

import argparse
import ast
import inspect
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ENGINE_FILES, ROOT, SCRIPT, engine

README = ROOT / "README.md"
REFERENCE = ROOT / "docs" / "reference.md"
SKILL = ROOT / "SKILL.md"
BLOCK = ROOT / "fablize-block.md"
CI_PAGE = ROOT / "docs" / "ci.md"
THREATS = ROOT / "docs" / "threat-model.md"
KOREAN = ROOT / "README.ko.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))

GLOBAL_OPTIONS = {"--dir": 1, "--json": 0, "--version": 0, "-h": 0, "--help": 0}
SHELL_STOPS = {"|", "||", "&&", ";", ">", ">>", "2>&1"}
FILE_COMMANDS = {"cp", "mv", "rm", "ls", "cat", "wc"}


def read(path):
    return path.read_text(encoding="utf-8")


def subparsers():
    """{command name: its parser}, from the full parser."""
    return dict(engine.build_parser()._subparsers._group_actions[0].choices)


def options_of(parser):
    return {s for action in parser._actions for s in action.option_strings}


def docs():
    """README and the reference it points to: the documentation the command line is held to."""
    return read(README) + "\n" + read(REFERENCE)


def section(text, heading):
    """The body of the section whose heading line is `heading`, up to the next heading of
    the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.split("\n")
    assert heading in lines, f"no section {heading!r}"
    start = lines.index(heading) + 1
    fenced = False
    for end in range(start, len(lines)):
        if re.match(r"\s*```", lines[end]):
            fenced = not fenced  # engine output in a code block may start with "## "
        elif not fenced and re.match(r"#{1,%d} " % level, lines[end]):
            break
    else:
        end = len(lines)
    return "\n".join(lines[start:end])


FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)


def fenced_blocks(text, info=None):
    pattern = re.compile(r"^[ \t]*```%s\n(.*?)^[ \t]*```"
                         % (re.escape(info) if info else r"[^\n]*"), re.M | re.S)
    return [m.group(1) for m in pattern.finditer(text)]


def code_fragments(text):
    """Every line of a fenced block (shell continuations joined) and every inline code span
    outside them."""
    frags = []
    for block in fenced_blocks(text):
        frags += re.sub(r"\\\n\s*", " ", block).splitlines()
    frags += re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    return frags


def tokens_of(fragment):
    try:
        return shlex.split(fragment)
    except ValueError:  # an apostrophe in prose or output: whitespace is good enough
        return fragment.split()


def invocations(text):
    """[(fragment, args after the program)] for each `goals.py …` or `fablize …` call."""
    found = []
    for frag in code_fragments(text):
        toks = tokens_of(frag)
        for i, tok in enumerate(toks):
            # `fablize` is the installed command only where a command line starts with it
            prog = re.search(r"(^|/)goals\.py$", tok) or \
                (tok == "fablize" and (i == 0 or toks[i - 1] == "$")
                 and re.match(r"-|[a-z]", toks[i + 1] if i + 1 < len(toks) else ""))
            if not prog:
                continue
            start = max([j + 1 for j in range(i) if toks[j] in SHELL_STOPS] or [0])
            if toks[start] in FILE_COMMANDS:
                continue  # `cp …/scripts/goals.py …` names the file, it does not run it
            args = []
            for t in toks[i + 1:]:
                if t in SHELL_STOPS or t.startswith("#"):
                    break
                args.append(t.rstrip(";"))
                if t.endswith(";"):
                    break
            found.append((frag, args))
    return found


def command_and_options(args):
    """(command or None, [option names]) of one invocation's arguments."""
    i = 0
    while i < len(args) and args[i].split("=")[0] in GLOBAL_OPTIONS:
        i += 1 + (GLOBAL_OPTIONS[args[i].split("=")[0]] if "=" not in args[i] else 0)
    if i >= len(args):
        return None, []
    opts = [a.split("=", 1)[0] for a in args[i + 1:] if re.match(r"--?[A-Za-z]", a)]
    return args[i], opts


def check_invocations(text, where):
    """Every documented call names a real command and only that command's options."""
    parsers = subparsers()
    used = set()
    for frag, args in invocations(text):
        command, opts = command_and_options(args)
        if command is None:
            continue
        if command not in parsers:
            # a synopsis (`goals.py [--dir PATH] COMMAND …`) is not a call
            assert re.match(r"[\[<A-Z…]|\.\.\.", command), \
                f"{where}: `{frag}` calls unknown command {command!r}"
            continue
        used.add(command)
        unknown = [o for o in opts if o not in options_of(parsers[command])]
        assert not unknown, f"{where}: `{frag}` uses {unknown}, which `{command}` does not have"
    return used


def engine_error_codes():
    """{code: {exit codes}} for every error the engine can raise, read from its source:
    refused()/usage()/damaged() calls (their default code when they give none),
    FablizeError(...) calls, and `….code = "…"` reassignments (exit unknown: empty set)."""
    helpers = {"refused": engine.EXIT_REFUSED, "usage": engine.EXIT_USAGE,
               "damaged": engine.EXIT_DAMAGED, "line_error": engine.EXIT_DAMAGED}
    defaults = {name: inspect.signature(getattr(engine, name)).parameters["code"].default
                for name in helpers}
    codes = {defaults[name]: {exit_code} for name, exit_code in helpers.items()}
    trees = [ast.parse(read(path)) for path in ENGINE_FILES]  # the core and its rooms
    for node in (node for tree in trees for node in ast.walk(tree)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if name in helpers:
                at = 2 if name == "line_error" else 1  # line_error(lineno, message, code)
                given = node.args[at] if len(node.args) > at else \
                    next((k.value for k in node.keywords if k.arg == "code"), None)
                if given is None:
                    code = defaults[name]
                else:
                    assert isinstance(given, ast.Constant) and isinstance(given.value, str), \
                        f"goals.py line {node.lineno}: an error code must be a string literal"
                    code = given.value
                codes.setdefault(code, set()).add(helpers[name])
            elif name == "failure" and node.args and isinstance(node.args[0], ast.Constant):
                codes.setdefault(node.args[0].value, set()).add(engine.EXIT_REFUSED)  # trust gate
            elif name == "FablizeError" and len(node.args) > 2 and \
                    isinstance(node.args[1], ast.Constant):
                arg = node.args[2]
                exit_code = getattr(engine, arg.id) if isinstance(arg, ast.Name) \
                    else getattr(engine, arg.attr) if isinstance(arg, ast.Attribute) \
                    else arg.value if isinstance(arg, ast.Constant) else None
                found = codes.setdefault(node.args[1].value, set())
                if exit_code is not None:  # else a signal's own (EXIT_SIGNAL_BASE + signal)
                    found.add(exit_code)
        elif isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "code"
                                                for k in node.keys) and \
                any(isinstance(k, ast.Constant) and k.value == "fix" for k in node.keys):
            value = node.values[[getattr(k, "value", None) for k in node.keys].index("code")]
            if isinstance(value, ast.Constant):
                codes.setdefault(value.value, set()).add(engine.EXIT_REFUSED)  # an audit gate
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Attribute) and node.targets[0].attr == "code" \
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            codes.setdefault(node.value.value, set())
    return codes


def readme_error_codes():
    """{code: {exit codes}} from docs/reference.md's error-code table."""
    table = section(docs(), "### Error codes")
    rows = re.findall(r"^\| `([a-z_]+)` \| ([\d, ]+) \|", table, re.M)
    assert rows, "docs/reference.md's error-code table has no rows"
    return {code: {int(x) for x in exits.split(",")} for code, exits in rows}


def front_matter(text):
    """A tiny YAML front-matter reader: `---`, then `key: value` lines, then `---`."""
    lines = text.split("\n")
    assert lines[0] == "---", "SKILL.md must open with a `---` front-matter line"
    end = lines.index("---", 1)
    fields = {}
    for line in lines[1:end]:
        key, sep, value = line.partition(": ")
        assert sep and re.fullmatch(r"[a-z][a-z-]*", key), f"not a `key: value` line: {line!r}"
        assert key not in fields, f"front matter repeats {key!r}"
        fields[key] = value.strip()
    return fields


# The parser: every command and option has help and is in the docs ##########


def test_every_command_and_option_has_help_text():
    parser = engine.build_parser()
    sub = parser._subparsers._group_actions[0]
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            assert action.help and action.help.strip(), f"goals.py {action.option_strings}: no help"
    summaries = {a.dest: a.help for a in sub._choices_actions}
    assert set(summaries) == set(sub.choices)
    for name, command in sub.choices.items():
        assert summaries[name] and summaries[name].strip(), f"`{name}` has no summary in --help"
        for action in command._actions:
            what = action.option_strings or [action.dest]
            assert action.help not in (None, argparse.SUPPRESS) and action.help.strip(), \
                f"`{name}` {what}: no help"


def test_every_command_has_a_readme_section_and_an_example():
    text = docs()
    used = check_invocations(text, "README.md and docs/reference.md")
    for name in subparsers():
        assert f"### `{name}`" in text.split("\n"), f"docs/reference.md has no section for `{name}`"
        assert name in used, f"the docs have no example calling `goals.py {name}`"


def test_every_option_of_every_command_is_in_the_readme():
    text = docs()
    parsers = {"goals.py": engine.build_parser(), **subparsers()}
    missing = []
    for name, parser in parsers.items():
        for action in parser._actions:
            for opt in action.option_strings:
                if not re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(opt), text):
                    missing.append(f"{name} {opt}")
            for choice in (action.choices or []) if not action.option_strings else []:
                if not isinstance(action, argparse._SubParsersAction):
                    assert re.search(r"`[^`\n]*\b%s\b" % re.escape(choice), text), \
                        f"the docs do not show `{name}` {action.dest} {choice!r}"
    assert not missing, \
        "options missing from README.md and docs/reference.md: " + ", ".join(missing)


def test_command_lines_in_every_document_use_only_real_commands_and_options():
    for path in [README, SKILL, BLOCK, *DOC_PAGES, *sorted((ROOT / "agents").glob("*.md"))]:
        check_invocations(read(path), path.name)


# The short README and the short skill (the bar) #####################


def test_readme_is_short_and_the_korean_one_is_as_short():
    english = len(read(README).split("\n")) - 1  # `wc -l`: the newlines
    korean = len(read(KOREAN).split("\n")) - 1
    assert english <= 250, f"README.md has {english} lines; the bar is 250 (move detail to docs/)"
    assert abs(korean - english) <= english // 10, \
        f"README.ko.md has {korean} lines, README.md {english}: not within 10%"


def test_skill_is_at_most_1000_words():
    words = len(read(SKILL).split())  # `wc -w`
    assert words <= 1000, f"SKILL.md has {words} words; the bar is 1,000 (details by link)"


def test_readme_has_the_newcomers_sections_in_order_and_links_the_pages():
    heads = [line for line in read(README).split("\n") if re.match(r"## ", line)]
    fenced = [h for h in heads if h.startswith("## Plan map")]  # engine output in a block
    heads = [h for h in heads if h not in fenced]
    assert heads == ["## Add it to your project", "## Quick start",
                     "## The three commands an agent runs", "## What `setup` writes",
                     "## Sharing a plan across machines", "## CI", "## Limits",
                     "## Performance", "## More"], heads
    for page in ("docs/reference.md", "docs/ci.md", "docs/threat-model.md",
                 "docs/performance.md", "SKILL.md", "CHANGELOG.md"):
        assert f"]({page}" in read(README), f"README does not link {page}"


def test_changelog_says_what_changed_without_benchmark_figures():
    """Figures live in docs/performance.md, printed by the bench; the changelog only says what
    changed for a user."""
    from test_bench import FIGURE
    text = read(ROOT / "CHANGELOG.md")
    assert text.split("\n")[text.split("\n").index("## Unreleased") - 1] == "" and \
        "`scripts/fablize_gate/`" in section(text, "## Unreleased")
    tables = [line for line in text.split("\n") if line.startswith("|")]
    figures = [line for line in text.split("\n") if FIGURE.search(line)]
    assert not tables and not figures, f"CHANGELOG quotes bench figures: {tables + figures}"


def markdown_links(text):
    """[(target)] of every Markdown link outside code (fenced blocks and code spans)."""
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose)


def heading_anchors(text):
    """GitHub's anchor of every heading outside fenced blocks (a repeat gets -1, -2, …)."""
    found, seen = set(), {}
    for line in FENCE.sub("", text).split("\n"):
        m = re.fullmatch(r"#{1,6} (.+)", line)
        if m:
            base = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def test_links_of_readme_and_docs_lead_to_files_and_headings_that_exist():
    broken = []
    for path in [README, KOREAN, SKILL, ROOT / "CHANGELOG.md", *DOC_PAGES]:
        for target in markdown_links(read(path)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            where = (path.parent / file).resolve() if file else path
            if not where.exists():
                broken.append(f"{path.name}: {target} (no file)")
            elif anchor and where.suffix == ".md" and anchor not in heading_anchors(read(where)):
                broken.append(f"{path.name}: {target} (no heading #{anchor})")
    assert not broken, "links that lead nowhere: " + "; ".join(broken)


def test_readme_quick_start_prints_what_the_engine_prints(fab):
    """The quick start's transcript, up to the first abbreviated step, is real output."""
    block = fenced_blocks(section(read(README), "## Quick start"), "console")[0]
    steps = []
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif line.strip():
            steps[-1][1].append(line)
    ran = 0
    for command, expected in steps:
        if "#" in command:
            break
        if not command.startswith("python3 scripts/goals.py"):
            # the agent's work (cli.py written): run by the shell it shows, printing nothing
            p = subprocess.run(command, shell=True, cwd=str(fab.root), capture_output=True,
                               text=True)
            assert p.returncode == 0 and not expected and not p.stdout, (command, p)
            continue
        args = shlex.split(command)
        assert args[:2] == ["python3", "scripts/goals.py"], command
        code = 0
        if expected and re.search(r"\s\(exit \d\)$", expected[-1]):
            code = int(expected[-1][-2])
            expected[-1] = re.sub(r"\s+\(exit \d\)$", "", expected[-1])
        r = fab(*args[2:])
        assert r.code == code, (command, r)
        actual = [x for x in (r.out + r.err).splitlines() if x.strip()]
        assert actual == expected, f"README quick start drifted at `{command}`"
        ran += 1
    assert ran >= 4, "the quick start should show create, next, a refusal and a completion"


# The other documents ########################################################


def test_block_file_is_exactly_the_block_the_engine_installs():
    # the command `setup` writes for a project holding the script: it runs on every clone,
    # from any directory
    cli = 'python3 "$(git rev-parse --show-toplevel)/scripts/goals.py"'
    expected = engine.room("setup").render_block(cli)
    assert read(BLOCK) == expected, \
        f"fablize-block.md drifted: regenerate it with engine.room('setup').render_block({cli!r})"
    setup = engine.room("setup")
    assert expected.startswith(setup.BLOCK_BEGIN)
    assert expected.rstrip("\n").endswith(setup.BLOCK_END)


def test_skill_front_matter_names_fablize_and_says_when_to_use_it():
    fields = front_matter(read(SKILL))
    assert fields.get("name") == "fablize"
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", fields["name"]) and len(fields["name"]) <= 64
    description = fields.get("description", "")
    assert 0 < len(description) <= 1024
    assert re.search(r"\b2\+ sequential stories\b", description), \
        "the description must say when to use it: tasks with 2+ sequential stories"
    assert len(fields.get("compatibility", "")) <= 500
    assert set(fields) <= {"name", "description", "license", "compatibility", "allowed-tools"}
    for key, value in fields.items():
        # plain YAML scalars: what the tiny reader returns is what a YAML parser returns
        assert value and value[0] not in "-?:,[]{}#&*!|>'\"%@`", \
            f"{key}: starts with a YAML indicator"
        assert ": " not in value and " #" not in value, f"{key}: not a plain YAML scalar"


def test_skill_gives_both_invocations_and_teaches_the_whole_loop():
    text = read(SKILL)
    assert "python3 scripts/goals.py" in text
    assert 'python3 "$(git rev-parse --show-toplevel)/scripts/goals.py"' in text
    assert "`fablize`" in text and '"${CLAUDE_PLUGIN_ROOT}/bin/fablize"' in text
    used = check_invocations(text, "SKILL.md")
    assert {"create", "next", "checkpoint", "status", "decide", "add", "judge-packet",
            "verdict"} <= used
    for status in ("complete", "failed", "blocked"):
        assert f"**{status}**" in text, f"SKILL.md does not explain the verdict {status!r}"
    assert "## Writing good checklists" in text and "3–5" in text


# Codes, variables, files ####################################################


def test_every_error_code_the_engine_raises_is_in_the_readme_with_its_exit_code():
    engine, readme = engine_error_codes(), readme_error_codes()
    assert len(engine) > 40, "reading the engine's error codes found too few"
    missing = sorted(set(engine) - set(readme))
    assert not missing, f"error codes missing from docs/reference.md's table: {missing}"
    stale = sorted(set(readme) - set(engine))
    assert not stale, f"docs/reference.md lists error codes the engine never raises: {stale}"
    wrong = {c: (sorted(readme[c]), sorted(e)) for c, e in engine.items() if e and readme[c] != e}
    assert not wrong, \
        f"docs/reference.md's exit codes differ from the engine's (docs, engine): {wrong}"


def test_readme_exit_code_table_has_every_exit_code():
    table = section(docs(), "## Exit codes")
    for code, word in ((engine.EXIT_OK, "done"), (engine.EXIT_REFUSED, "refused"),
                       (engine.EXIT_USAGE, "usage"), (engine.EXIT_DAMAGED, "damaged")):
        assert re.search(r"^\| %d \| %s\b" % (code, word), table, re.M), \
            f"exit code {code} ({word}) missing from docs/reference.md's table"


def test_every_environment_variable_the_engine_reads_is_documented():
    source = "".join(read(path) for path in ENGINE_FILES)  # the core and its rooms
    names = set(re.findall(r"""(?:os\.(?:environ(?:\.get)?|getenv)|env_seconds)\s*[(\[]\s*"""
                           r"""["']([A-Z_][A-Z0-9_]*)""", source))
    assert {"FABLIZE_DIR", "FABLIZE_LOCK_TIMEOUT", "FABLIZE_SHARE_WAIT",
            "GITHUB_STEP_SUMMARY"} <= names
    table = section(docs(), "## Environment variables")
    missing = sorted(n for n in names if f"`{n}`" not in table)
    assert not missing, f"environment variables missing from docs/reference.md: {missing}"


def test_readme_names_every_ledger_event_status_and_state_file():
    text = docs()
    files = section(text, "## Files")
    for event in engine.EVENTS:
        assert f"`{event}`" in files, f"ledger event {event!r} missing from docs/reference.md"
    for field in ("seq", "ts", "event", "prev", "ledger", "digest"):
        assert f"`{field}`" in files, (
            f"{field!r} missing from docs/reference.md's ledger/snapshot format")
    for name in (engine.SNAPSHOT, engine.LEDGER, engine.LOCK, engine.RUNS, engine.ARCHIVE):
        assert f"`{name}" in files, f"state file {name!r} missing from docs/reference.md's Files"
    for status in engine.STATUSES:
        assert f"`{engine.MARKS[status]} {status}`" in text or f"`{status}`" in text, status
        if status != "accepted":
            assert f"`{engine.MARKS[status]} {status}`" in text, f"mark of {status!r} not shown"


def test_readme_documents_the_make_targets_and_the_version():
    text = docs()
    makefile = read(ROOT / "Makefile")
    for target in ("demo", "test"):
        assert f"`make {target}`" in text
        assert re.search(r"^%s:" % target, makefile, re.M), f"Makefile has no `{target}` target"
    assert "tools/demo.sh" in text and "tools/demo.sh" in makefile
    assert "vermin" in text and "vermin" in makefile
    assert f"`fablize {engine.__version__}`" in text


def test_plugin_manifest_version_is_the_engine_version():
    manifest = json.loads(read(ROOT / ".claude-plugin" / "plugin.json"))
    assert manifest["version"] == engine.__version__


# Recipes that must work as printed ##########################################


def readme_settings():
    """The hooks written by hand, as docs/reference.md's "Wiring an agent" shows them."""
    for block in fenced_blocks(section(read(REFERENCE), "## Wiring an agent"), "json"):
        try:
            data = json.loads(block)
        except ValueError:
            continue
        if isinstance(data, dict) and "hooks" in data:
            return data["hooks"]
    pytest.fail("docs/reference.md has no settings.json snippet with hooks")


def hook_commands(hooks, event):
    return [h["command"] for group in hooks[event] for h in group["hooks"]]


def test_readme_hooks_snippet_matches_the_plugin_hooks():
    readme = readme_settings()
    plugin = json.loads(read(ROOT / "hooks" / "hooks.json"))["hooks"]
    assert set(readme) == set(plugin) == {"Stop", "SessionStart", "PostToolUse",
                                          "PostToolUseFailure"}
    for event in plugin:
        assert [g.get("matcher") for g in readme[event]] == \
            [g.get("matcher") for g in plugin[event]]
        # the program differs (the script in the project, the plugin's bin/fablize); the
        # arguments must not
        # (and the plugin's marks its registration: it steps aside for the project's own)
        program = r'(?:goals|fablize)\.py"|bin/fablize"'
        args = [[re.split(program, c, 1)[1].replace(" --plugin", "").strip()
                 for c in hook_commands(h, event)] for h in (readme, plugin)]
        assert args[0] == args[1], \
            f"{event}: docs/reference.md runs {args[0]}, the plugin {args[1]}"


def run_hook(command, cwd, payload=""):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FABLIZE_") and k != "GITHUB_STEP_SUMMARY"}
    env["CLAUDE_PROJECT_DIR"] = str(ROOT)
    return subprocess.run(["bash", "-c", command], cwd=str(cwd), env=env, input=payload,
                          capture_output=True, text=True, timeout=60)


def test_readme_hooks_snippet_blocks_a_stop_with_ready_work_and_allows_one_without_a_plan(tmp_path):
    hooks = readme_settings()
    stop, = hook_commands(hooks, "Stop")
    start, = hook_commands(hooks, "SessionStart")
    empty = tmp_path / "empty"
    project = tmp_path / "project"
    for d in (empty, project):
        (d / ".git").mkdir(parents=True)
    r = subprocess.run([sys.executable, str(SCRIPT), "create", "--brief", "b", "--goal", "A::a",
                        "--goal", "V::v"], cwd=str(project), capture_output=True, text=True)
    assert r.returncode == 0, r

    def payload(cwd):
        return json.dumps({"session_id": "s", "hook_event_name": "Stop",
                           "stop_hook_active": False, "cwd": str(cwd)})

    r = run_hook(stop, project, payload(project))
    assert r.returncode == 0 and json.loads(r.stdout)["decision"] == "block", r
    assert "G001" in json.loads(r.stdout)["reason"]
    r = run_hook(start, project)
    assert r.returncode == 0 and r.stdout.startswith("fablize: 0/2 complete — b"), r
    for command, stdin in ((stop, payload(empty)), (start, "")):
        r = run_hook(command, empty, stdin)
        assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), r


def test_readme_ci_recipe_is_setup_github_and_ci_md_holds_the_rest():
    """README's CI section is `setup github`, the commit, the ruleset and what it guarantees, on
    one screen; docs/ci.md holds the same lines, GitLab's recipe, the same audit as plain
    commands for any other CI, and every input of the published action."""
    ci = section(read(README), "## CI")
    blocks = fenced_blocks(ci, "sh")
    assert len(blocks) == 1 and blocks[0].startswith("python3 scripts/goals.py setup github "), ci
    words = " ".join(ci.split())
    assert "Require workflows to pass before merging" in words and "job summary" in words
    assert "](docs/ci.md)" in ci and len(ci.strip().split("\n")) <= 30, "more than a screen"
    text = read(CI_PAGE)
    assert fenced_blocks(section(text, "## The recipe: `setup github`"), "sh")[0] == blocks[0]
    assert "CI_MERGE_REQUEST_DIFF_BASE_SHA" in fenced_blocks(section(text, "## GitLab CI"),
                                                             "yaml")[0]
    plain = fenced_blocks(section(text, "## Any other CI"), "sh")[0]
    assert "git archive" in plain and "python3 -I" in plain and "verdict.py" in plain
    # every input the action has is in the table, and every row is an input
    action = read(ROOT / "action.yml")
    inputs = re.findall(r"^  ([a-z-]+):\n    description", action, re.M)
    rows = re.findall(r"^\| `([a-z-]+)`(?:, `([a-z-]+)`)? \|",
                      section(text, "## The action and its inputs"), re.M)
    assert sorted(x for row in rows for x in row if x) == sorted(inputs)
    assert "`.fablize/goals.json`" in text and "`.fablize/ledger.jsonl`" in text


def test_the_adversarial_and_benchmark_pages_are_kept():
    """The threat model moved whole to docs/threat-model.md; README keeps its limits, a few
    bench lines, and links to both."""
    lines = read(README).split("\n")
    assert "## Limits" in lines and "## Performance" in lines
    assert "](docs/threat-model.md)" in section(read(README), "## Limits")
    assert "](docs/performance.md)" in section(read(README), "## Performance")
    threats = read(THREATS).split("\n")
    for heading in ("## Attacks on the CI audit", "## Attacks from the tree",
                    "## Limits, said plainly", "## Refused at the call, detected by `audit`"):
        assert heading in threats, f"docs/threat-model.md has no section {heading!r}"


def test_every_test_the_threat_model_tables_name_exists():
    """The attack tables of docs/threat-model.md name a test (or `test_x_*`, a family) for
    every row and the files that hold them: a test renamed, merged or moved cannot leave a row
    pointing nowhere."""
    text = read(THREATS)
    trust = text.split("## Attacks on the CI audit", 1)[1].split("## Limits", 1)[0]
    assert re.findall(r"`(test_[a-z0-9_]+)`", trust)
    tests = ROOT / "tests"
    defined = {name for path in tests.glob("test_*.py")
               for name in re.findall(r"^\s*def (test_[a-z0-9_]+)", read(path), re.M)}
    for name in set(re.findall(r"`(test_[a-z0-9_]+\*?)`", text)):
        if name.endswith("*"):
            assert any(d.startswith(name[:-1]) for d in defined), name
        else:
            assert name in defined, name
    for path in set(re.findall(r"`(tests/test_[a-z0-9_]+\.py)`", text)):
        assert (ROOT / path).is_file(), path


def test_readme_documents_every_json_field_the_commands_print(tmp_path, monkeypatch, capsys):
    """Walk a plan through every command with --json and collect the top-level fields: each is
    a row of docs/reference.md's JSON table (one meaning, one type — the table says which)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".git").mkdir()
    for var in ("FABLIZE_DIR", "GITHUB_STEP_SUMMARY"):
        monkeypatch.delenv(var, raising=False)
    seen = {}

    def run(*args):
        engine.main(["--json", *args])
        obj = json.loads(capsys.readouterr().out)
        for key, value in obj.items():
            seen.setdefault(key, set()).add(type(value).__name__)
        return obj

    run("create", "--brief", "b", "--goal", "a::b", "--goal", "v::w", "--check", "G001=true",
        "--judge", "G001")
    run("next")
    run("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "e")
    run("judge-packet", "--id", "G001")
    run("verdict", "--id", "G001", "achieved", "--evidence", "seen", "--agent", "j")
    run("verify", "--id", "G001")
    run("add", "--goal", "x::y")
    run("next")
    run("checkpoint", "--id", "G003", "--status", "blocked", "--evidence", "no")
    run("decide", "--id", "G003", "accept", "--note", "fine")
    for args in (["status"], ["audit"], ["log"], ["report"], ["rebuild"], ["pause"], ["unpause"],
                 ["install-block", "X.md"], ["setup", "agents-md"], ["doctor", "agents-md"],
                 ["checkpoint", "--id", "G404", "--status", "complete", "--evidence", "x"]):
        run(*args)
    table = section(docs(), "## JSON mode")
    documented = set(re.findall(r"^\| ((?:`[\w_]+`(?:, )?)+) \|", table, re.M))
    names = {n for row in documented for n in re.findall(r"`([\w_]+)`", row)}
    missing = sorted(set(seen) - names)
    assert not missing, f"JSON fields docs/reference.md's table does not document: {missing}"
    mixed = {k: v for k, v in seen.items() if len(v - {"NoneType"}) > 1}
    assert not mixed, f"fields with more than one type across commands: {mixed}"
