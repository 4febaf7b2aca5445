"""fablize's setup room: wiring an agent to the engine, and checking the wiring.

`setup AGENT` writes the fablize block into the agent's instructions file and registers the
engine's hooks in its settings (SessionStart: `status --resume`; Stop: `guard`; after a shell
command: `observe`); `doctor` checks all of it; `install-block` puts the block into any file.
What setup writes is meant to be committed: it names the engine by a command that runs from any
directory of any clone and holds no absolute path.

Interface: COMMANDS (setup, doctor, install-block), render_block(cli), BLOCK_BEGIN/BLOCK_END.
Imported by the commands that run it (cli.room_of, commands), when they run; what it
uses of the engine's layers is the names it imports from them, listed at its top.
"""

import json
import os
import re
import shutil
import stat
import sys

from .base import (
    count_noun, DEFAULT_GUARD_MAX, DONE, FablizeError, last_chars, load_json, one_line, PYTHON,
    quote_arg, refused, STATE_DIRNAME, STATE_GITIGNORE, Step, usage)
from .storage import (
    file_to_write, fsync_dir, O_BINARY, O_CLOEXEC, O_NONBLOCK, read_state_file, user_file,
    write_atomic, write_state_gitignore)
from .runs import command_programs, git, repo_root, run_tool
from .render import human_command, invocation, repository_command, step_text
from . import merge
from . import __version__


BLOCK_BEGIN = "<!-- fablize:begin -->"
BLOCK_END = "<!-- fablize:end -->"


BLOCK_TEMPLATE = """\
<!-- fablize:begin -->
## fablize — evidence gate for multi-story work

[2+ sequential stories] When a task needs two or more sequential steps, run it
through fablize instead of declaring "done" yourself:

1. `{cli} create --brief "<task>" --goal "title::objective" ... --verify "<test command>"`
   The last story is the verification gate. Freeze the checks that prove a story with
   `--check G00N="<cmd>"` (test-first: a check may run a test a story will write);
   if it says a check cannot run here, fix that now.
2. `{cli} next` — activates ONE story and prints its handoff. Work that story only.
3. `{cli} checkpoint --id G00N --status complete --evidence "<what you did, what you saw>"`
   Frozen checks run by themselves; otherwise prefer `--run --verify-cmd "<cmd>"`: the
   engine runs the command and records the result.
   Not achieved yet (another round):
   `{cli} checkpoint --id G00N --status failed --evidence "<what is missing>"`
   Impossible as specified — then ask the human: end your turn with the question (the Stop
   guard lets a question through):
   `{cli} checkpoint --id G00N --status blocked --evidence "<why>"`
4. A judged story (`create --judge`) goes to review: never judge your own work. A separate
   judge runs `{cli} judge-packet --id G00N`, checks the artifact itself and answers with
   `{cli} verdict --id G00N achieved|not-achieved|unachievable --evidence "<what it saw>" --agent <judge>`.
5. Repeat from 2 until it prints `all stories complete ✓` (or `all stories done ✓` after a
   human accepted a story). A refusal is not an error to work around: produce the evidence
   it asks for.
6. Resuming after a crash or compaction: `{cli} status` (it shows what was missing and what
   already failed), then `{cli} next`. Every failed or blocked checkpoint needs its reason.

Never edit `.fablize/` by hand; `{cli} audit` detects it.
<!-- fablize:end -->
"""  # noqa: E501 (a command the agent copies stays one line)
PLUGIN_NAME = "fablize-gate"  # not `fablize`: the original's plugin and marketplace are named so
AGENTS = ("claude", "codex", "gemini", "cursor", "agents-md")
# Patterns kept as text, compiled (and cached by `re`) on first use: not at every start.
# the original fablize's block: migrated to ours, so that a file ends with exactly one block
ORIGINAL_BLOCK = r"(?s)<!--\s*FABLIZE:BEGIN\b.*?FABLIZE:END\b[^>]*-->\n?"
# a hook command of ours (or of the original), whatever path or interpreter runs it
OUR_HOOK = (r"(?:goals\.py|fablize(?:\.py)?)[\"']?((?:\s+--\S+)*)\s+"
            r"(guard|status\s+--resume|observe)\b")


def portable_command(root):
    """The command written into files that get committed, so that it runs on every clone: the
    repository's own copy of the engine when it has one (scripts/goals.py) — then teammates
    without the plugin or the installed command run the same thing — else this engine's
    repository form when it lives there, else `fablize` (installed, or the plugin's)."""
    if os.path.isfile(os.path.join(root, "scripts", "goals.py")):
        return repository_command("scripts/goals.py")
    cmd = invocation(root)
    return cmd if cmd == "fablize" or "$(git rev-parse" in cmd else "fablize"


def command_missing(cli):
    """Why the command written into the project does not run here, or None: `fablize` names a
    command that must be installed (or come with the plugin) and on PATH."""
    if cli == "fablize" and shutil.which("fablize") is None:
        off_path = path_step()
        if off_path is not None:  # this very engine is the installed command, off PATH
            return (f"the wiring runs `fablize`, which is installed but not on PATH here "
                    f"({off_path[0]}): `{off_path[1]}`, then a new terminal")
        return ("the wiring runs `fablize`, which is not on PATH here: install it (README: Add it "
                "to your project — pipx, uv tool or the plugin), or copy scripts/goals.py and "
                "scripts/fablize_gate/ (together) into this repository and run setup again with "
                "that copy")
    return None


def path_step():
    """(where the installed `fablize` is, the command that puts that folder on PATH) when this
    engine is the installed command (a wheel: no goals.py beside its package) and its folder is
    not on PATH; else None. pipx and uv say it themselves (`pipx ensurepath`, `uv tool
    update-shell`: their venvs carry pipx_metadata.json, uv-receipt.toml); for pip (--user, or
    a venv) it is the folder, added to PATH in the shell's profile."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(here, "goals.py")):
        return None  # a checkout or a copy: its goals.py is what to copy
    started = sys.argv[0] if os.path.basename(sys.argv[0] or "").startswith("fablize") else ""
    folder = os.path.dirname(os.path.abspath(started)) if started else None
    if folder is None or not os.path.isfile(os.path.join(folder, os.path.basename(started))):
        import sysconfig
        folder = sysconfig.get_path("scripts")
    if os.path.isfile(os.path.join(sys.prefix, "pipx_metadata.json")):
        return f"pipx put it in {folder}", "pipx ensurepath"
    if os.path.isfile(os.path.join(sys.prefix, "uv-receipt.toml")):
        return f"uv put it in {folder}", "uv tool update-shell"
    return (f"it is in {folder}; add that line to your shell's profile",
            f"export PATH={quote_arg(folder)}:\"$PATH\"")


def refuse_missing_command(ctx, cli):
    """setup writes no wiring whose command is not there: hooks and a merge driver that run
    `fablize` where it is not installed would fail at every event, and a merge of two branches'
    plans would leave conflict markers. Refused before anything is written, naming the copy
    that makes the wiring run the project's own engine."""
    missing = command_missing(cli)
    if missing is None:
        return
    if human_command(cli) != cli:  # the plugin's engine: Claude Code puts its bin/ on PATH
        ctx.out.warn(missing + ".")
        return
    off_path = path_step()
    if off_path is not None:  # installed (pipx, uv tool, pip): its wheel holds no goals.py
        raise refused(f"setup: the wiring would run `{cli}`, which is installed but not on "
                      f"PATH here ({off_path[0]}) — nothing was written. Put it on PATH, open "
                      f"a new terminal, then run `{cli} setup {ctx.args.agent}` again (or copy "
                      "the engine from a checkout into the project: README, Add it to your "
                      "project):", "command_missing", steps=off_path[1])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this engine's scripts/
    copy = (f"mkdir -p scripts && cp -r {quote_arg(os.path.join(here, 'goals.py'))} "
            f"{quote_arg(os.path.join(here, 'fablize_gate'))} scripts/")
    raise refused(f"setup: the wiring would run `{cli}`, which is not on PATH here, and this "
                  "engine is not in the project — nothing was written. Copy the engine into "
                  "the project (then run setup again with that copy: `python3 scripts/goals.py "
                  f"setup {ctx.args.agent}`), or install fablize (README: Add it to your "
                  "project):", "command_missing", steps=copy)


def migration_note(text, name):
    """What replacing the original fablize's block leaves out, and where it is kept: its rules
    that are not fablize's (the original's router for other kinds of task)."""
    m = re.search(ORIGINAL_BLOCK, text)
    rules = [r for r in re.findall(r"\*\*\[([^\]]+)\]\*\*", m.group(0) if m else "")
             if "stories" not in r]
    if not rules:
        return ""
    return (f" — its other rules ({', '.join(one_line(r) for r in rules)}) are not fablize's "
            f"and are not carried over; the file as it was is kept as {name}{BACKUP}: copy "
            "back what you want, outside the fablize block")


BACKUP = ".fablize-backup"  # beside a file setup or install-block changed: the file as it was


def cut_original_block(text):
    """`text` without the original fablize's block, and where it stood (None: it had none)."""
    m = re.search(ORIGINAL_BLOCK, text)
    if m is None:
        return text, None
    return text[:m.start()] + text[m.end():], m.start()


# the repository's top as a hook of Claude Code finds it: the folder Claude Code names in
# $CLAUDE_PROJECT_DIR for its hooks (no process started), else git's answer — where it is unset
# (a hook run by hand, a harness that does not set it) the line still finds the engine
CLAUDE_TOP = '${CLAUDE_PROJECT_DIR:-$(git rev-parse --show-toplevel)}'


def lean(cli, agent=None):
    """The command a hook runs: the repository's goals.py started lean (-I -S: no site, so no
    .pth file and no site-packages runs before it; hooks run at every tool call), found through
    $CLAUDE_PROJECT_DIR for Claude Code (CLAUDE_TOP); else `cli`."""
    if cli.startswith(PYTHON + ' "$(git rev-parse'):
        cli = PYTHON + " -I -S" + cli[len(PYTHON):]
        if agent == "claude":
            cli = cli.replace("$(git rev-parse --show-toplevel)", CLAUDE_TOP, 1)
    return cli


def hook_entries(agent, cli):
    """[(event, matcher, role, hook object)] that wire `agent` to the engine run as `cli`."""
    cli = lean(cli, agent)
    def command(args, timeout=30):
        return {"type": "command", "command": f"{cli} {args}", "timeout": timeout}
    if agent == "claude":
        return [("SessionStart", "startup|resume|clear|compact", "status",
                 command("status --resume")),
                ("Stop", None, "guard", command("guard")),
                ("PostToolUse", "Bash", "observe", command("observe")),
                # Claude Code reports a command that failed as PostToolUseFailure
                ("PostToolUseFailure", "Bash", "observe", command("observe"))]
    if agent == "codex":
        return [("SessionStart", "startup|resume|clear", "status",
                 command("status --resume --for codex")),
                ("Stop", None, "guard", command("guard --for codex")),
                ("PostToolUse", "Bash", "observe", command("observe --for codex"))]
    if agent == "gemini":  # timeouts in milliseconds; hooks are named in its /hooks panel
        return [("SessionStart", None, "status",
                 dict(command("status --resume --for gemini", 30000), name="fablize-status")),
                ("AfterAgent", None, "guard",
                 dict(command("guard --for gemini", 30000), name="fablize-guard")),
                ("AfterTool", "run_shell_command", "observe",
                 dict(command("observe --for gemini", 30000), name="fablize-observe"))]
    if agent == "cursor":
        return [("stop", None, "guard", {"command": f"{cli} guard --for cursor",
                                          "loop_limit": DEFAULT_GUARD_MAX})]
    return []


AGENT_FILES = {  # agent: (instructions file, hook configuration file), relative to the root
    "claude": ("CLAUDE.md", ".claude/settings.json"),
    "codex": ("AGENTS.md", ".codex/hooks.json"),
    "gemini": ("GEMINI.md", ".gemini/settings.json"),
    "cursor": ("AGENTS.md", ".cursor/hooks.json"),
    "agents-md": ("AGENTS.md", None),
}


def hook_role(hook):
    cmd = hook.get("command") if isinstance(hook, dict) else None
    m = re.search(OUR_HOOK, cmd) if isinstance(cmd, str) else None
    return m.group(2).split()[0] if m else None


def our_hooks(config, event):
    """[(group list, group, hook list, hook)] for the hooks of ours registered for `event`,
    in Claude Code's nesting ({event: [{matcher, hooks: [...]}]}) or Cursor's ({event: [...]})."""
    found = []
    hooks = config.get("hooks") if isinstance(config, dict) else None
    groups = hooks.get(event) if isinstance(hooks, dict) else None
    for group in groups if isinstance(groups, list) else []:
        inner = group.get("hooks") if isinstance(group, dict) else None
        if isinstance(inner, list):
            found += [(groups, group, inner, h) for h in inner if hook_role(h)]
        elif hook_role(group):
            found.append((groups, None, groups, group))
    return found


def registers(root, role):
    """Whether the project's own Claude Code settings register a hook of ours for `role`
    (guard, status, observe) that can run here: the plugin's copy then steps aside, and the
    project's runs (a project hook that cannot run here leaves the plugin's to do the work)."""
    for rel in (".claude/settings.json", ".claude/settings.local.json"):
        config = read_json_config(os.path.join(root, *rel.split("/")), quiet=True)
        hooks = config.get("hooks") if isinstance(config, dict) else None
        for event in hooks if isinstance(hooks, dict) else ():
            if any(hook_role(f[3]) == role and runs_here(f[3]["command"], root)
                   for f in our_hooks(config, event)):
                return True
    return False


def runs_here(cmd, root):
    """Whether a hook command of ours finds its program and its engine here."""
    if interpreter_problem(cmd, root):
        return False
    m = re.search(r"(\$\(git rev-parse --show-toplevel\)|" + re.escape(CLAUDE_TOP)
                  + r")/([^\"'\s]+)", cmd)
    if m is None:
        return True
    # the folder the line's shell would name: Claude Code's for its hooks, else git's
    top = (m.group(1) == CLAUDE_TOP and os.environ.get("CLAUDE_PROJECT_DIR")) or repo_root(root)
    return top is not None and os.path.isfile(os.path.join(top, m.group(2)))


def merge_hooks(config, agent, cli, remove=False, where="its settings file"):
    """`config` (a parsed settings file, `where`) with exactly one hook of ours per event, or
    none."""
    config = json.loads(json.dumps(config))  # a copy: the caller compares old and new
    if agent == "cursor":
        config.setdefault("version", 1)
    for event, matcher, role, hook in hook_entries(agent, cli):
        found = [f for f in our_hooks(config, event) if hook_role(f[3]) == role]
        if not remove and len(found) == 1 and found[0][3] == hook:
            continue
        for groups, group, inner, h in found:
            inner.remove(h)
            if group is not None and not inner:
                groups.remove(group)
        if not remove:
            hooks = config.setdefault("hooks", {})
            if not isinstance(hooks, dict):
                raise refused(f"its \"hooks\" is not an object ({where}) — fix it by hand, "
                              "then run setup again.", "bad_config")
            groups = hooks.setdefault(event, [])
            if agent == "cursor":
                groups.append(hook)
            else:
                groups.append(dict({"matcher": matcher} if matcher else {}, hooks=[hook]))
        hooks = config.get("hooks")
        if isinstance(hooks, dict) and hooks.get(event) == []:
            del hooks[event]
    if config.get("hooks") == {}:
        del config["hooks"]
    if agent == "cursor" and set(config) == {"version"}:
        config = {}
    return config


def plugin_enabled(root):
    """Where the fablize-gate plugin is switched on for Claude Code ([] when nowhere): it brings
    its own hooks, so settings must not register them again."""
    found = []
    home = os.path.expanduser("~")
    for path in (os.path.join(home, ".claude", "settings.json"),
                 os.path.join(root, ".claude", "settings.json"),
                 os.path.join(root, ".claude", "settings.local.json")):
        data = read_json_config(path, quiet=True)
        enabled = data.get("enabledPlugins") if isinstance(data, dict) else None
        if isinstance(enabled, dict) and any(
                k.split("@")[0] == PLUGIN_NAME and v is True for k, v in enabled.items()):
            found.append(path)
    env = os.environ.get("CLAUDE_PLUGIN_ROOT")
    if env and read_json_config(os.path.join(env, ".claude-plugin", "plugin.json"),
                                quiet=True).get("name") == PLUGIN_NAME:
        found.append("$CLAUDE_PLUGIN_ROOT")
    return found


def read_json_config(path, quiet=False):
    """A JSON settings file as a dict ({} when absent); refuses one that is not an object."""
    try:
        raw = read_project_file(path)
    except FileNotFoundError:
        return {}
    except (OSError, FablizeError):
        if quiet:
            return {}
        raise
    try:
        data = load_json(raw) if raw.strip() else {}
    except ValueError as e:
        if quiet:
            return {}
        raise refused(f"{path} is not valid JSON ({e}) — fix it by hand, then run setup again.",
                      "bad_config")
    if not isinstance(data, dict):
        if quiet:
            return {}
        raise refused(f"{path} does not hold a JSON object — fix it by hand, then run setup "
                      "again.", "bad_config")
    return data


def json_config_bytes(config):
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def committed_as(root, rel, config):
    """The bytes of `rel` as the last commit holds them, when they hold `config`: what
    `setup --remove` puts back (setup writes JSON in its own layout; the file as it was
    committed keeps the project's), else None."""
    code, raw, _ = git(root, "show", f"HEAD:{rel}", what="setup --remove")
    try:
        return raw if code == 0 and json.loads(raw) == config else None
    except ValueError:
        return None


MAX_PROJECT_FILE = 1 << 20  # a settings or instructions file larger than this is not one


def read_project_file(path):
    """The bytes of a project's settings or instructions file: never blocks on a FIFO, never
    reads an endless device, refuses what is not a regular file (it may follow a symlink the
    user made; setup refuses to write through one)."""
    fd = os.open(path, os.O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_BINARY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise refused(f"{path} is not a regular file.", "not_a_file")
        data = os.read(fd, MAX_PROJECT_FILE + 1)
        if len(data) > MAX_PROJECT_FILE:
            raise refused(f"{path} is larger than {MAX_PROJECT_FILE:,} bytes — not a settings "
                          "or instructions file fablize edits: a human trims it (or moves it "
                          "aside), then runs the command again.", "not_text")
        return data
    finally:
        os.close(fd)


def project_file(root, rel):
    """A file of the project to write: refuses a symlink or a non-file in its place, and a
    symlinked folder on the way to it (a cloned repository's `.claude -> ~/.claude` must not
    put hooks into the user's own settings)."""
    path = os.path.join(root, *rel.split("/"))
    folder = root
    for part in rel.split("/")[:-1]:
        folder = os.path.join(folder, part)
        if os.path.islink(folder):
            raise refused(f"{folder} is a symlink — refusing to write through it: where the "
                          "project's settings live is a human's decision — make it a real "
                          "folder, then run the command again.", "symlink")
    return path, file_to_write(path)


def project_text(path, st):
    """(bytes, text) of an instructions file to edit (b"", "" when it does not exist yet):
    UTF-8 text without NUL bytes, or a refusal."""
    raw = read_project_file(path) if st is not None else b""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise refused(f"{path} is not UTF-8 text — refusing to edit it: a human converts it (or "
                      "moves it aside), then runs the command again.", "not_text")
    if "\x00" in text:
        raise refused(f"{path} is not text (it holds NUL bytes) — refusing to edit it: a human "
                      "repairs it (or moves it aside), then runs the command again.", "not_text")
    return raw, text


def put_project_file(path, st, data):
    """Write (or, with data None, delete) a project file; parent folders made as needed, and
    a folder this left empty taken away again."""
    if data is None:
        os.unlink(path)
        parent = os.path.dirname(path)
        try:
            os.rmdir(parent)  # only when empty: `.claude/` that setup made
        except OSError:
            pass
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, data, st.st_mode & 0o7777 if st else 0o644)
    fsync_dir(os.path.dirname(path))


def setup_plan(root, agent, remove):
    """[(relative path, absolute path, stat, new bytes or None to delete, what)] that `setup`
    would write, leaving out what is already as it should be; and notes to say."""
    cli = portable_command(root)
    changes = []
    block_rel, hooks_rel = AGENT_FILES[agent]
    path, st = project_file(root, block_rel)
    raw, text = project_text(path, st)
    new = install_block(text, render_block(cli), remove, block_rel)
    if new != text and not remove and re.search(ORIGINAL_BLOCK, text):
        kept, kept_st = project_file(root, block_rel + BACKUP)
        changes.append((block_rel + BACKUP, kept, kept_st, raw,
                        "the file as it was, before the original fablize's block was migrated"))
    if new != text:
        data = None if remove and not new.strip() else new.encode("utf-8")
        changes.append((block_rel, path, st, data, "the fablize block " +
                        ("removed" if remove else "updated" if BLOCK_BEGIN in text else
                         "migrated from the original fablize's block" +
                         migration_note(text, block_rel)
                         if re.search(ORIGINAL_BLOCK, text) else "added")))
    notes = []
    if hooks_rel:
        # the committed hooks are the same whoever runs setup: with the plugin enabled too, its
        # own hooks step aside at run time for the project's (guard --plugin and the others)
        path, st = project_file(root, hooks_rel)
        config = read_json_config(path)
        new = merge_hooks(config, agent, cli, remove, hooks_rel)
        if new != config:
            data = None if remove and not new and st is not None else json_config_bytes(new)
            if remove and data is not None:
                data = committed_as(root, hooks_rel, new) or data
            changes.append((hooks_rel, path, st, data,
                            "hooks " + ("removed" if remove else "registered") + ": " +
                            ", ".join(e for e, _, _, _ in hook_entries(agent, cli))))
        if agent == "claude" and plugin_enabled(root) and not remove:
            notes.append(f"hooks: the {PLUGIN_NAME} plugin is enabled too; its hooks step aside "
                         f"for these ({hooks_rel}), so each runs once")
    return changes, notes


def block_problem(root, agent, prog):
    """(problem or None, fix, the command the block uses or None) for the agent's instructions."""
    block_rel = AGENT_FILES[agent][0]
    path = os.path.join(root, block_rel)
    try:
        text = read_project_file(path).decode("utf-8")
    except FileNotFoundError:
        text = ""
    except (OSError, UnicodeDecodeError) as e:
        return f"{block_rel} cannot be read ({one_line(e)})", "fix it by hand", None
    except FablizeError as e:
        return f"{block_rel} cannot be read ({e.message})", "fix it by hand", None
    begin = text.find(BLOCK_BEGIN)
    if re.search(ORIGINAL_BLOCK, text):
        return (f"{block_rel} holds the original fablize's block", f"`{prog} setup {agent}` "
                                                                   "migrates it",
                None)
    if begin < 0:
        return f"{block_rel} has no fablize block", f"`{prog} setup {agent}` adds it", None
    end = text.find(BLOCK_END, begin)
    block = text[begin:end + len(BLOCK_END)] + "\n"
    m = re.search(r"`(.+?) create --brief", block)
    cli = m.group(1) if m else None
    if cli is None or block != render_block(cli):
        return (f"{block_rel} holds an outdated fablize block",
                f"`{prog} setup {agent}` updates it", cli)
    if cli != portable_command(root):
        return (f"{block_rel}'s block runs `{cli}`, not `{portable_command(root)}`",
                f"`{prog} setup {agent}` updates it", cli)
    return None, None, cli


def command_runs(cli, root):
    """(ok, what it said) for `CLI --version`, run by a shell in the repository."""
    try:
        code, out, err = run_tool(f"{cli} --version", cwd=root, shell=True, timeout=30,
                                         what="doctor")
    except FablizeError as e:
        return False, e.message
    out = out.decode("utf-8", "replace").strip()
    if code == 0 and out.startswith("fablize "):
        return True, out
    return False, f"exit {code}: " + one_line(last_chars(err or out, 200))


def interpreter_problem(cli, root):
    """Why the program at the front of `cli` does not resolve here, or None."""
    try:
        programs = command_programs(cli, root)
    except ValueError as e:
        return f"`{one_line(cli)}` does not parse ({e})"
    if not programs:
        return None
    first, found = programs[0]
    if found is None:
        return f"`{first}` is not on PATH" if "/" not in first else f"`{first}` does not exist"
    if "WindowsApps" in found:
        return f"`{first}` is the Windows Store alias ({found}), not a Python"
    return None


def hook_registrations(root, agent):
    """{event: [where]} for every registration of our hooks that `agent` will run."""
    events = [e for e, _, _, _ in hook_entries(agent, "fablize")]
    where = {event: [] for event in events}
    hooks_rel = AGENT_FILES[agent][1]
    if hooks_rel is None:
        return where
    paths = [hooks_rel, {"claude": "~/.claude/settings.json", "gemini": "~/.gemini/settings.json"}
             .get(agent, "~/" + hooks_rel)]
    if agent == "claude":
        paths.insert(1, ".claude/settings.local.json")
    for rel in paths:
        path = os.path.expanduser(rel) if rel.startswith("~") else os.path.join(root, rel)
        config = read_json_config(path, quiet=True)
        for event in events:
            where[event] += [rel] * len(our_hooks(config, event))
    if agent == "claude" and plugin_enabled(root):
        for event, role in ((e, r) for e, _, r, _ in hook_entries(agent, "fablize")):
            if not registers(root, role):  # else the plugin's copy steps aside for the project's
                where[event] = [w for w in where[event] if w != hooks_rel]
                where[event].append(f"the {PLUGIN_NAME} plugin")
    return where


def render_block(cli):
    return BLOCK_TEMPLATE.format(cli=cli)


def install_block(text, block, remove=False, where="the file"):
    """`text` with exactly one fablize block (replaced in place, or appended), or without it.
    Appending adds one newline before the block, ending the file's last line or leaving a blank
    line; removal takes back only a newline that leaves a blank line before the block, so the
    text above it keeps its last line's end — remove(install(x)) == x for a file ending in a
    newline, and text a user wrote above the block keeps its own (install-block, which keeps the
    file as it was, gives back a missing final newline from that copy)."""
    text, at = cut_original_block(text)
    if at is not None and BLOCK_BEGIN not in text and not remove:
        return text[:at] + block + text[at:]
    begin = text.find(BLOCK_BEGIN)
    if begin >= 0:
        end = text.find(BLOCK_END, begin)
        if end < 0 or text.find(BLOCK_BEGIN, begin + 1) >= 0:
            raise refused("the file has a broken or repeated fablize block (begin/end markers do "
                          f"not pair) — fix {where} by hand, then run the command again.",
                          "bad_block")
        end += len(BLOCK_END)
        if text[end:end + 1] == "\n":
            end += 1
        if not remove:
            return text[:begin] + block + text[end:]
        if end == len(text) and text[max(begin - 2, 0):begin] == "\n\n":
            begin -= 1
        return text[:begin] + text[end:]
    if remove:
        return text
    return text + ("\n" if text else "") + block


def cmd_install_block(ctx, a):
    target, st = user_file(ctx.store.root, a.file or os.path.join(ctx.store.root,
                                                                        "CLAUDE.md"), a.outside)
    raw, text = project_text(target, st)
    new = install_block(text, render_block(portable_command(ctx.store.root)), a.remove,
                        target)
    if new == text:
        return ctx.show(text_install_block, {"path": target, "changed": False}, remove=a.remove)
    directory = os.path.dirname(target)
    backup = target + BACKUP
    if os.path.islink(backup):  # fablize's own file: the link goes, never what it points at
        raise refused(f"{backup} is a symlink — refusing to write through it; removing the "
                      "link leaves what it points at:", "symlink",
                      steps=f"rm {quote_arg(os.path.relpath(backup))}")
    if a.remove and not new and block_created(backup):
        # install-block made this file: removing the block removes it (no 0-byte file) and the
        # copy it kept of it, which held nothing but a block
        for path in (target, backup):
            if os.path.lexists(path):
                os.unlink(path)
        fsync_dir(directory)
        return ctx.show(text_install_block, {"path": target, "changed": True, "backup": None,
                                             "deleted": True}, remove=a.remove)
    if a.remove and new.endswith("\n") and not new.endswith("\n\n"):
        kept = read_state_file(backup) if os.path.lexists(backup) else None
        if kept is not None and kept.decode("utf-8", "replace") == new[:-1]:
            new = new[:-1]  # the file had no final newline before install-block ended its line
    if st is not None:
        write_atomic(backup, raw)
    else:
        backup = None
    write_atomic(target, new.encode("utf-8"), st.st_mode & 0o7777 if st else 0o644)
    fsync_dir(directory)
    ctx.show(text_install_block, {"path": target, "changed": True, "backup": backup},
             remove=a.remove, note=migration_note(text, os.path.basename(target))
             if not a.remove else "")


def text_install_block(data, remove, note=""):
    target = data["path"]
    if not data["changed"]:
        return [f"fablize: {target} already {'has no' if remove else 'has this'} fablize block; "
                "nothing changed."]
    if data.get("deleted"):
        return [f"fablize: removed {target}: the fablize block was all it held"]
    verb = "removed the fablize block from" if remove else "installed the fablize block in"
    backup = data["backup"]
    return [f"fablize: {verb} {target}" + (f" (previous file kept as {backup})" if backup else "")
            + note]


def block_created(backup):
    """Whether install-block created the file whose backup is `backup`: it never backed up an
    earlier file, or the only one it kept held nothing but a fablize block."""
    try:
        prior = read_state_file(backup)
        if prior is None:
            return True
        text = prior.decode("utf-8")
    except (FablizeError, OSError, UnicodeDecodeError):
        return False
    return bool(text.strip()) and BLOCK_BEGIN in text and not install_block(text, "", True).strip()


# what the user must do once setup wrote an agent's hooks, for the agent to run them
LOAD_HOOKS = {
    "claude": "restart Claude Code (it reads hooks when a session starts; `/hooks` lists them "
              "for review)",
    "codex": "restart Codex: it runs a project's hooks once they are switched on "
             "(`[features] codex_hooks = true` in ~/.codex/config.toml) and you trust them "
             "(`/hooks`, or Settings → Hooks)",
    "gemini": "restart Gemini CLI: it reads a project's .gemini/settings.json only in a "
              "trusted folder (trust this one when it asks, or `/permissions`)",
    "cursor": "restart Cursor (it reads .cursor/hooks.json when it starts)",
}


def not_a_repository(root, what):
    """The one git rule of setup and doctor, whatever runs them (a copy, the installed command,
    the plugin): what setup writes is the project's, to be committed with it — the rules, the
    hooks (a copy's find the engine with `git rev-parse`), the merge driver (git's) — so both
    work inside a git repository only. The refusal of `what` outside one, naming `git init`."""
    return refused(f"{what}: {root} is not a git repository — what setup writes (the rules, the "
                   "hooks, the merge driver) belongs in one, committed with the project: run "
                   f"`git init` first, then {what} again:", "not_a_repository", steps="git init")


def cmd_setup(ctx, a):
    root = ctx.store.root
    if a.agent == "github":  # CI's wiring: the setup room's CI part
        from . import setup_ci
        return setup_ci.setup(ctx, a)
    if a.scope or a.required_check or a.owner:
        raise usage("--scope, --required-check and --owner go with `setup github` (CI's policy "
                    "and its reviewers).", "usage")
    cli = portable_command(root)
    if not a.remove and repo_root(root) is None:
        raise not_a_repository(root, "setup")
    changes, notes = setup_plan(root, a.agent, a.remove)
    if not a.remove:  # checked before anything is written
        refuse_missing_command(ctx, cli)
    done = []  # what changed, in order: {"file": its path, or None for git config; "what"}
    for rel, path, st, data, what in changes:
        put_project_file(path, st, data)
        done.append({"file": rel, "what": what})
    ignore = os.path.join(ctx.store.dir, ".gitignore")
    if not a.remove:
        if not ctx.store.exists():
            os.makedirs(ctx.store.dir, exist_ok=True)
        if write_state_gitignore(ctx.store.dir):
            done.append({"file": os.path.relpath(ignore, root), "what": "written — the lock, "
                         "temporary and torn-line files stay out of git"})
    elif (read_state_file(ignore) == STATE_GITIGNORE.encode()
          and not ctx.store.has_plan_files()):
        os.unlink(ignore)
        done.append({"file": os.path.relpath(ignore, root), "what": "removed"})
        try:
            os.rmdir(ctx.store.dir)
        except OSError:
            pass
    if a.remove:
        changed, driver = merge.uninstall(ctx.store)
        done += [{"file": rel, "what": what} for rel, what in changed]
        if driver:
            done.append({"file": None,
                         "what": "fablize's merge driver taken out of this clone's git config"})
    elif merge.wanted(ctx.store):
        # git runs the driver from a person's terminal too: the engine as it runs there
        line, _ = merge.install(ctx.store, human_command(portable_command(root)))
        done.append({"file": ".gitattributes", "what": f"`{line}` (commit it) — git merges, "
                     "rebases and cherry-picks of committed plans replay them, through this "
                     "clone's git config"})
    ctx.show(text_setup, {"agent": a.agent, "files": [c["file"] for c in done if c["file"]],
                          "changes": done, "notes": notes, "cli": portable_command(root)},
             prog=ctx.prog, remove=a.remove, human=human_command(portable_command(root)))


def text_setup(data, prog, remove, human):
    """What `setup` says: each change, the notes, and — something set up — how to run the
    command from a terminal, how the agent loads its hooks, and doctor, last."""
    agent, cli = data["agent"], data["cli"]
    lines = [f"fablize: {c['file']}: {c['what']}" if c["file"] else f"fablize: {c['what']}"
             for c in data["changes"]]
    lines += [f"fablize: {note}" for note in data["notes"]]
    if not data["files"]:
        lines.append(f"fablize: {agent} is already {'unwired' if remove else 'set up'} here; "
                     "nothing changed.")
    elif not remove:
        if human != cli:
            lines.append(f"fablize: in your own terminal, the plugin's bin/ is not on PATH "
                         f"(Claude Code's Bash tool has it): `alias fablize={human}` in your "
                         "shell's profile runs it there")
        if agent in LOAD_HOOKS:
            lines.append(f"fablize: for the hooks to load: {LOAD_HOOKS[agent]}")
        lines.append(f"fablize: next — `{prog} doctor {agent}` checks the wiring; the agent's "
                     f"commands are `{cli} …`")
    return lines


# what each hook of ours is sent, as its agent's harness sends it, when doctor runs it
HOOK_PAYLOADS = {
    "status": {"hook_event_name": "SessionStart", "source": "startup"},
    "guard": {"hook_event_name": "Stop", "stop_hook_active": False},
    "observe": {"hook_event_name": "PostToolUse", "tool_name": "Bash",
                "tool_input": {"command": "echo fablize doctor"},
                "tool_response": {"stdout": "fablize doctor", "stderr": "", "exit_code": 0}},
}


# what each agent's harness sets for its hooks: the project's folder (Claude Code's
# $CLAUDE_PROJECT_DIR, which hooks written by hand use; Gemini CLI sets it too, beside its own)
HOOK_ENV = {"claude": ("CLAUDE_PROJECT_DIR",),
            "gemini": ("GEMINI_PROJECT_DIR", "CLAUDE_PROJECT_DIR")}


def hook_answer_problem(cmd, root, agent, role):
    """Why the hook command `cmd` does not answer as its agent needs, run exactly as the agent
    runs it (a shell in the project, the payload on stdin, the variables its harness sets)
    against an empty state directory — so nothing of the real plan changes — or None."""
    import tempfile
    payload = dict(HOOK_PAYLOADS[role], session_id="fablize-doctor", cwd=root,
                   transcript_path=os.path.join(root, "fablize-doctor.jsonl"))
    with tempfile.TemporaryDirectory() as empty:
        try:
            code, out, err = run_tool(
                cmd, cwd=root, shell=True, timeout=30, what="doctor",
                data=json.dumps(payload).encode(),
                env=dict({name: root for name in HOOK_ENV.get(agent, ())},
                         FABLIZE_DIR=os.path.join(empty, STATE_DIRNAME)))
        except FablizeError as e:
            return e.message
    said = one_line(last_chars(err or out.decode("utf-8", "replace"), 200))
    if code != 0:
        if "$(git rev-parse" in cmd and repo_root(root) is None:
            return (f"exits {code} here: this folder is not a git repository, and the command "
                    f"finds the engine with `git rev-parse` ({said})")
        if code == 127:
            return f"exits 127: its program is not found here ({said})"
        return f"exits {code} ({said})"
    text = out.decode("utf-8", "replace").strip()
    if not text and agent != "gemini":  # nothing to say is an answer; Gemini CLI wants JSON
        return None
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        return f"answers what {agent} cannot read as a JSON object: {one_line(text[:120])!r}"
    return None


def wired_agents(root):
    """The agents this project is wired for: those whose hook file registers a hook of ours,
    those whose own instructions file (CLAUDE.md, GEMINI.md) holds the block, and agents-md
    for a block in AGENTS.md that no agent's hooks go with."""
    def has_block(rel):
        try:
            return BLOCK_BEGIN in read_project_file(os.path.join(root, rel)).decode("utf-8",
                                                                                    "replace")
        except (OSError, FablizeError):
            return False
    found = []
    for agent, (block_rel, hooks_rel) in AGENT_FILES.items():
        config = read_json_config(os.path.join(root, hooks_rel), quiet=True) if hooks_rel else {}
        if any(our_hooks(config, e) for e, _, _, _ in hook_entries(agent, "fablize")):
            found.append(agent)
        elif block_rel != "AGENTS.md" and has_block(block_rel):
            found.append(agent)
    if has_block("AGENTS.md") and not {"codex", "cursor"} & set(found):
        found.append("agents-md")
    if os.path.isfile(os.path.join(root, ".github", "workflows", "fablize.yml")):
        found.append("github")
    return found


def cmd_doctor(ctx, a):
    if repo_root(ctx.store.root) is None:  # setup's rule: no wiring is healthy outside git
        raise not_a_repository(ctx.store.root, "doctor")
    agents = [a.agent] if a.agent else wired_agents(ctx.store.root)
    if not agents:
        raise refused(f"doctor: no agent is wired in {ctx.store.root} — `{ctx.prog} setup "
                      "claude` (or codex, gemini, cursor, agents-md) wires one; which agent is "
                      "a human's choice:", "doctor_problems", steps=f"{ctx.prog} setup <agent>")
    findings = []
    for agent in agents:
        if agent == "github":
            from . import setup_ci
            findings += [dict(f, agent=agent) for f in setup_ci.doctor_findings(ctx)]
            continue
        findings += [dict(f, agent=agent) for f in doctor_findings(ctx, agent)]
    # said also when doctor then refuses: the refusal points at the fixes said
    ctx.show(text_doctor, {"agent": agents[0] if len(agents) == 1 else agents,
                           "findings": findings}, agents=agents)
    problems = [c for c in findings if not c["ok"]]
    if problems:
        fixes = list(dict.fromkeys(c["fix"] for c in problems))
        # the first fix's command, when it is one (a fix that is a human's names none): git's
        # (`git init`, the commit of what CI reads from the base) or the engine's
        step = re.match(r"`((?:git init|git add [^`]+|" + re.escape(ctx.prog) + r" [^`]+))`",
                        fixes[0])
        raise refused(f"doctor: {count_noun(len(problems), 'problem')} — "
                      + (f"{problems[0]['problem']}; fix: {fixes[0]}" if len(problems) == 1 else
                         f"{count_noun(len(fixes), 'fix')}, each said once "
                         f"above; the first: {fixes[0]}"), "doctor_problems",
                      step.group(1) if step else ())


def text_doctor(data, agents):
    """What doctor says: each agent's findings, each fix said once (a problem that shares one
    points at it); all well, that it is."""
    lines, said, findings = [], {}, data["findings"]
    for agent in agents:
        if len(agents) > 1:
            lines.append(f"fablize: doctor — {agent}")
        for c in (f for f in findings if f["agent"] == agent):
            if c["ok"]:
                lines.append(f"  ✓ {c['item']}: {c['detail']}")
            elif c["fix"] in said:
                lines.append(f"  ✗ {c['item']}: {c['problem']} — fix: the same as "
                             f"{said[c['fix']]}'s")
            else:
                said[c["fix"]] = c["item"]
                lines.append(f"  ✗ {c['item']}: {c['problem']} — fix: {c['fix']}")
    if all(c["ok"] for c in findings):
        lines.append(f"fablize: doctor — {', '.join(agents)} "
                     f"{'is' if len(agents) == 1 else 'are'} wired and the state is healthy.")
    return lines


def doctor_findings(ctx, agent):
    """What doctor finds of `agent`'s wiring: [{item, ok, problem, fix, detail}]."""
    root = ctx.store.root
    findings = []

    def finding(name, problem, fix, fine):
        findings.append({"item": name, "ok": problem is None, "problem": problem, "fix": fix,
                         "detail": fine if problem is None else None})

    finding("engine", None, None,
            f"fablize {__version__} on Python {sys.version.split()[0]}")
    problem, fix, cli = block_problem(root, agent, ctx.prog)
    finding("block", problem, fix, f"{AGENT_FILES[agent][0]} holds the current block")
    if cli:
        bad = interpreter_problem(cli, root)
        ok, said = (False, bad) if bad else command_runs(cli, root)
        if bad and cli == "fablize" and agent == "claude" and plugin_enabled(root):
            ok, said = True, (f"not on this PATH, but Claude Code puts the {PLUGIN_NAME} "
                              "plugin's bin/ on its own")
        outside = "$(git rev-parse" in cli and repo_root(root) is None
        finding("command",
                None if ok else f"the block's command `{cli}` does not run here ({said})"
                + (": this folder is not a git repository" if outside else ""),
                "`git init`" if outside else command_missing(cli) or "install fablize (README: "
                f"Add it to your project) or keep the script in the repository, then `{ctx.prog} "
                f"setup {agent}`", f"`{cli} --version` → {said}")
    hooks_rel = AGENT_FILES[agent][1]
    for event, where in hook_registrations(root, agent).items():
        if not where:
            finding(f"{event} hook", f"no fablize {event} hook is registered",
                    f"`{ctx.prog} setup {agent}`", None)
        elif len(where) > 1:
            fix = (f"`{ctx.prog} setup {agent}` keeps one" if set(where) == {hooks_rel} else
                   f"keep one: take fablize's {event} entry out of "
                   f"{next(w for w in where if w != hooks_rel)} (setup edits the project's files "
                   "only)")
            finding(f"{event} hook", f"the {event} hook is registered {len(where)} times "
                    f"({', '.join(where)}): every event would be counted twice", fix, None)
        else:
            finding(f"{event} hook", None, None, f"registered once ({where[0]})")
    if hooks_rel:
        config = read_json_config(os.path.join(root, hooks_rel), quiet=True)
        for event, _, role, _ in hook_entries(agent, "fablize"):
            for f in our_hooks(config, event):
                cmd = f[3]["command"]
                bad = (interpreter_problem(cmd, root)
                       or hook_answer_problem(cmd, root, agent, role))
                if bad and agent == "claude" and plugin_enabled(root) and not registers(root,
                                                                                         role):
                    finding(f"{event} hook command", None, None,
                            f"`{one_line(cmd)}` does not run here ({bad}): the {PLUGIN_NAME} "
                            "plugin's own hook runs instead (teammates without the plugin "
                            "need fablize installed)")
                    continue
                fix = ("`git init`, then " if bad and "not a git repository" in bad else "") + (
                    command_missing(cmd.split()[0]) or f"`{ctx.prog} setup {agent}`")
                finding(f"{event} hook command",
                        bad and f"`{one_line(cmd)}` {bad} (in {hooks_rel})", fix,
                        f"runs and answers as {agent} reads it")
    if merge.wanted(ctx.store) or merge.merge_driver_missing(root):
        committed = merge.committed(ctx.store)
        finding("merge driver", (
            "this clone's git config lacks fablize's merge driver, which .gitattributes names: "
            "a merge of two branches' plans would leave conflict markers"
            if merge.merge_driver_missing(root) else
            ".gitattributes does not name fablize's merge driver, and the plan is committed: a "
            "merge of two branches' plans would leave conflict markers" if committed else None),
            f"`{ctx.prog} install-merge` (or `{ctx.prog} setup {agent}`)",
            "not needed yet: no plan is committed")
    elif repo_root(root) is not None and os.path.isdir(os.path.join(
            repo_root(root), ".git")):
        finding("merge driver", None, None,
                "git merges committed plans by replay (.gitattributes and this clone's config)")
    if ctx.store.exists():
        try:
            with ctx.store.session(exclusive=False) as s:
                plan = s.load()
            done = sum(1 for x in plan["goals"] if x["status"] in DONE) if plan else 0
            finding("state", None, None, "no plan yet" if plan is None else
                    f"plan readable, {done}/{len(plan['goals'])} done")
        except FablizeError as e:  # the step the plan's own error names, when it names one
            steps = [step_text(step, ctx.prog) for step in e.steps]
            finding("state", f"the plan cannot be read: {one_line(e.message)}",
                    f"`{steps[0]}`" if steps else f"`{ctx.prog} audit` says what is "
                    f"wrong; `{ctx.prog} rebuild` regenerates goals.json from the ledger", None)
        present = read_state_file(os.path.join(ctx.store.dir, ".gitignore")) is not None
        finding(".gitignore", None if present else
                f"{STATE_DIRNAME}/.gitignore is missing: the lock and temporary files "
                "would be committed", f"`{ctx.prog} setup {agent}`",
                f"{STATE_DIRNAME}/.gitignore keeps local files out of git")
    return findings


# Shell completion, generated from the command table ###########################################


def command_table(parser):
    """[(command, summary, [(option, takes a value, choices, help)], positional choices)] of
    every command, read from `parser`, the one the engine itself uses: one source."""
    sub = next(a for a in parser._actions if getattr(a, "choices", None) and
               isinstance(a.choices, dict))
    summaries = {a.dest: a.help or "" for a in sub._choices_actions}
    table = []
    for name, p in sub.choices.items():
        options, positional = [], []
        for action in p._actions:
            if action.option_strings:
                if "-h" in action.option_strings:
                    continue
                for option in action.option_strings:
                    options.append((option, action.nargs != 0, list(action.choices or ()),
                                    action.help or ""))
            elif action.choices:
                positional += list(action.choices)
        table.append((name, summaries.get(name, ""), options, positional))
    return table


def plain(text, limit=70):
    """Help text a completion script can hold without quoting trouble."""
    return re.sub(r"[^\w .,;/()+’-]", "", one_line(text).replace("'", "’"))[:limit].strip()


def completion_bash(prog, table):
    lines = ["# fablize completion for bash: eval \"$(fablize completion bash)\"",
             "_fablize() {",
             '  local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} cmd="" i',
             "  for ((i = 1; i < COMP_CWORD; i++)); do",
             '    case ${COMP_WORDS[i]} in --dir) ((i++)) ;; -*) ;; *) cmd=${COMP_WORDS[i]}; '
             'break ;; esac',
             "  done",
             '  if [[ -z $cmd ]]; then',
             '    COMPREPLY=($(compgen -W "' + " ".join(t[0] for t in table) +
             ' --dir --json --help --version" -- "$cur")); return',
             "  fi",
             '  local words="" values=""',
             '  case "$cmd $prev" in']
    for name, _, options, _ in table:
        for option, value, choices, _ in options:
            if choices:
                lines.append(f'    "{name} {option}") COMPREPLY=($(compgen -W "{" ".join(choices)}"'
                             ' -- "$cur")); return ;;')
    lines += ["  esac", '  case $cmd in']
    for name, _, options, positional in table:
        words = " ".join([o for o, _, _, _ in options] + positional)
        values = " ".join(o for o, value, choices, _ in options if value and not choices)
        lines.append(f'    {name}) words="{words}" values=" {values} " ;;')
    lines += ["  esac",
              '  if [[ $values == *" $prev "* ]]; then  # an option\'s value: a file, or words',
              '    COMPREPLY=($(compgen -f -- "$cur")); return',
              "  fi",
              '  COMPREPLY=($(compgen -W "$words" -- "$cur"))', "}",
              f"complete -F _fablize {prog}"]
    return "\n".join(lines) + "\n"


def completion_zsh(prog, table):
    lines = ["#compdef " + prog,
             "# fablize completion for zsh (after compinit): eval \"$(fablize completion zsh)\"",
             "_fablize() {", "  local -a commands", "  commands=("]
    lines += [f"    '{name}:{plain(summary)}'" for name, summary, _, _ in table]
    lines += ["  )",
              "  local i=2",
              "  while (( i < CURRENT )) && [[ $words[i] == -* ]]; do",
              "    [[ $words[i] == --dir ]] && (( i++ ))",
              "    (( i++ ))",
              "  done",
              "  if (( CURRENT <= i )); then _describe command commands; return; fi",
              "  case $words[i] in"]
    for name, _, options, positional in table:
        specs = []
        for option, value, choices, help in options:
            spec = f"'{option}[{plain(help)}]"
            if value:
                spec += f":{option.lstrip('-')}:" + (f"({' '.join(choices)})" if choices
                                                     else "_files")
            specs.append(spec + "'")
        if positional:
            specs.append(f"'*:choice:({' '.join(positional)})'")
        lines.append(f"    {name}) _arguments -s {' '.join(specs)} ;;")
    lines += ["  esac", "}", f"compdef _fablize {prog}"]
    return "\n".join(lines) + "\n"


def completion_fish(prog, table):
    lines = [f"# fablize completion for fish: {prog} completion fish | source",
             f"complete -c {prog} -f"]
    for name, summary, options, positional in table:
        lines.append(f"complete -c {prog} -n __fish_use_subcommand -a {name} "
                     f"-d '{plain(summary)}'")
        seen = f"'__fish_seen_subcommand_from {name}'"
        for option, value, choices, help in options:
            if not option.startswith("--"):
                continue
            line = f"complete -c {prog} -n {seen} -l {option[2:]} -d '{plain(help)}'"
            if choices:
                line += f" -x -a '{' '.join(choices)}'"
            elif value:
                line += " -r -F"
            lines.append(line)
        if positional:
            lines.append(f"complete -c {prog} -n {seen} -a '{' '.join(positional)}'")
    return "\n".join(lines) + "\n"


COMPLETIONS = {"bash": completion_bash, "zsh": completion_zsh, "fish": completion_fish}


def cmd_completion(ctx, a):
    """The completion script of `a.shell` for the `fablize` command, on stdout."""
    if not re.fullmatch(r"[\w.-]+", a.name or ""):
        raise usage(f"--name {one_line(a.name)!r} is not a command's name: one word "
                    "of letters, digits, ., - and _:", "bad_name",
                    steps=Step.engine(f"completion {a.shell} --name <name>"))
    script = COMPLETIONS[a.shell](a.name, command_table(ctx.build_parser(None, a.name)))
    ctx.show(text_completion, {"shell": a.shell, "script": script})


def text_completion(data):
    return [data["script"].rstrip("\n")]


def add_completion(command):
    c = command("completion", cmd_completion, "print a shell completion script",
                "for bash (eval \"$(fablize completion bash)\" in ~/.bashrc), zsh (the same "
                "in ~/.zshrc, after compinit) or fish (fablize completion fish | source, in "
                "~/.config/fish/config.fish); every command, option and choice, from the same "
                "table as --help")
    c.add_argument("shell", choices=tuple(COMPLETIONS), help="bash, zsh or fish")
    c.add_argument("--name", default="fablize",
                   help="the command it completes (default: fablize)")


def add_install_block(command):
    c = command("install-block", cmd_install_block, "put the fablize block into CLAUDE.md",
            "or into the file named (AGENTS.md, …); run again, it replaces the block in place; "
            "--remove takes it out")
    c.add_argument("file", nargs="?", help="the file (default: CLAUDE.md at the repository root)")
    c.add_argument("--remove", action="store_true", help="take the block out again")
    c.add_argument("--outside", action="store_true",
                   help="the file may be outside the project (never through a symlink)")


def add_setup(command):
    c = command("setup", cmd_setup, "wire this project for an agent",
                "the block in its instructions file, its hooks, .fablize/.gitignore (running it "
                "again changes nothing)")
    c.add_argument("agent", nargs="?", choices=AGENTS + ("github",), default="claude",
                   help="claude (CLAUDE.md, .claude/settings.json), codex (AGENTS.md, "
                        ".codex/hooks.json), gemini (GEMINI.md, .gemini/settings.json), cursor "
                        "(AGENTS.md, .cursor/hooks.json), agents-md (AGENTS.md only), or github "
                        "(CI: .github/workflows/fablize.yml, .fablize/policy.json, CODEOWNERS)")
    c.add_argument("--remove", action="store_true", help="undo it: take out what setup added")
    c.add_argument("--scope", action="append", metavar="PATH",
                   help="setup github: the paths the work may change, for CI's policy "
                        "(repeatable; default: the plan's scope)")
    c.add_argument("--required-check", action="append", metavar="CMD",
                   help="setup github: a check the final story must carry, for CI's policy "
                        "(repeatable; default: the plan's final story's frozen checks)")
    c.add_argument("--owner", metavar="@NAME",
                   help="setup github: who CODEOWNERS names for the audit's files (default: "
                        "the owner of the GitHub repository origin points at)")


def add_doctor(command):
    c = command("doctor", cmd_doctor, "check the wiring and the state",
                "the interpreter resolves, each hook is registered once, the block is current and "
                "its command runs, the state is healthy")
    c.add_argument("agent", nargs="?", choices=AGENTS + ("github",), default=None,
                   help="the agent whose wiring to check, or github for CI's (default: every "
                        "one wired here)")


COMMANDS = {"install-block": add_install_block, "setup": add_setup, "doctor": add_doctor,
            "completion": add_completion}
