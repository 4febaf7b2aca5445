"""The house rules a maintainer relies on, read from the engine's source: an error is complete
where it is raised (its code, message and way out), and nothing above the raise edits it."""

import ast

from conftest import ENGINE_DIR, ENGINE_FILES

# what an error is, fixed at its construction (base.FablizeError.__init__ sets them once)
ERROR_FIELDS = {"message", "code", "exit_code", "steps", "commands", "run_next", "step", "said",
                "lineno", "no_plan_at", "summarised"}


def assignments(tree):
    """(line, attribute) of every `x.attr = …` and `x.attr += …` in `tree`."""
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            if isinstance(target, ast.Attribute):
                yield node.lineno, target.attr


def test_no_error_is_edited_after_it_is_made():
    """One way to attach a step: at construction. No `error.commands = …`, no `with_step`
    after the raise, no `message +=` or `code =` on the way up (each was a bug's hiding place:
    a step named twice, a message worded by a room that did not decide it)."""
    edits = []
    for path in ENGINE_FILES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        inits = {node.lineno for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                 and node.name == "FablizeError" for node in node.body
                 if isinstance(node, ast.FunctionDef)}
        init_lines = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.lineno in inits:
                init_lines |= set(range(node.lineno, node.end_lineno + 1))
        edits += [f"{path.name}:{line}: .{attr}" for line, attr in assignments(tree)
                  if attr in ERROR_FIELDS and line not in init_lines]
        edits += [f"{path.name}:{node.lineno}: with_step" for node in ast.walk(tree)
                  if isinstance(node, ast.Name) and node.id == "with_step"]
    assert edits == []


def test_the_command_line_renders_an_error_without_changing_it(fab):
    """The step the command line adds (`--help`, the command again) is said, not written into
    the error: the same refusal rendered twice reads the same."""
    from fablize_gate import cli
    from fablize_gate.base import usage
    error = usage("--goal format is 'title::objective' — invalid: x", "bad_goal")
    first = cli.way_out(None, error, ["create", "--goal", "x"])
    assert first == cli.way_out(None, error, ["create", "--goal", "x"])
    assert error.message == "--goal format is 'title::objective' — invalid: x"
    assert error.steps == ()
    assert first[0].endswith("--help`)") and first[1][0].endswith("create --help")


def test_every_engine_module_is_where_the_package_says():
    """The package docstring names every module of the engine folder."""
    doc = (ENGINE_DIR / "__init__.py").read_text(encoding="utf-8")
    missing = [p.stem for p in ENGINE_DIR.glob("*.py")
               if p.stem != "__init__" and f"{p.stem}" not in doc]
    assert missing == []


# what names a storage object in the sharing room: a session (`session`, `s`, `tx`), the store,
# its ledger or its lock — whatever attribute path leads to it
STORAGE_OBJECTS = {"session", "s", "tx", "store", "ledger", "lock"}


def path_names(node):
    """The names along `a.b.c` (a, b, c), or of the call or subscript it starts from."""
    while True:
        if isinstance(node, ast.Attribute):
            yield node.attr
            node = node.value
        elif isinstance(node, (ast.Call, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        elif isinstance(node, ast.Name):
            yield node.id
            return
        else:
            return


def test_sharing_sets_no_attribute_on_storages_objects():
    """Storage takes and lets go of the lock and owns its session; the sharing room keeps its
    own state (sharing.Share) and uses the session's interface (Transaction's docstring): no
    `session.x = …`, no setattr on a session, the store, its ledger or its lock, and no
    getattr with a default (the reading side of an attribute hung on one)."""
    found = []
    files = sorted(ENGINE_DIR.glob("sharing*.py"))
    assert [p.name for p in files] == ["sharing.py", "sharing_git.py"]
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                if isinstance(target, ast.Attribute) and STORAGE_OBJECTS & set(
                        path_names(target.value)):
                    found.append(f"{path.name}:{node.lineno}: .{target.attr} =")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args
                    and (node.func.id in ("setattr", "delattr") or node.func.id == "getattr"
                         and len(node.args) == 3)
                    and STORAGE_OBJECTS & set(path_names(node.args[0]))):
                found.append(f"{path.name}:{node.lineno}: {node.func.id}")
    assert found == []


def test_every_command_returns_one_result_its_text_drawn_from_it():
    """A command states its result once — `ctx.show(text_renderer, fields, **view)` — and the
    command line draws the text from those fields (or prints them as --json): no engine module
    says a line of its own beside the data (`say`, `out.lines`), and every renderer a command
    names takes the result's fields first."""
    said, shows, renderers = [], [], {}
    for path in ENGINE_FILES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "say":
                said.append(f"{path.name}:{node.lineno}: .say")
            if isinstance(node, ast.FunctionDef) and node.name.startswith("text_"):
                renderers[node.name] = [a.arg for a in node.args.args]
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "show" and node.args
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "ctx"):
                shows.append((path.name, node.lineno, ast.unparse(node.args[0])))
    assert said == []
    assert len(shows) >= 25, shows  # every command that says something on stdout
    for name, line, renderer in shows:
        renderer = renderer.split(".")[-1].split(" and ")[-1]
        assert renderer in renderers, f"{name}:{line}: {renderer} is no text_ renderer"
        assert renderers[renderer][0] == "data", f"{renderer} must take the result first"


def test_text_and_json_are_one_result(fab):
    """The same command on the same state, as text and as --json: the text is drawn from the
    JSON's fields (a field the text names is the JSON's), never computed beside them."""
    import json
    import shutil
    assert fab("create", "--brief", "b", "--goal", "a::do a", "--goal", "v::verify",
               "--check", "G001=true").code == 0
    assert fab("next").code == 0
    twin = fab.dir.parent / "twin"
    shutil.copytree(fab.dir.parent, twin, symlinks=True)
    text = fab("checkpoint", "--id", "G001", "--status", "complete", "--evidence", "done")
    data = json.loads(fab("--dir", str(twin / fab.dir.name), "--json", "checkpoint", "--id",
                          "G001", "--status", "complete", "--evidence", "done").out)
    assert text.code == 0 and data["ok"]
    assert f"{data['story']['id']} → {data['story']['status']}" in text.out
    assert data["next"]["text"] in text.out and data["next"]["cmd"] in text.out
