"""The house rules a maintainer relies on, read from the engine's source: an error is complete
where it is raised (its code, message and way out), and nothing above the raise edits it."""

import ast

from conftest import ENGINE_DIR, ENGINE_FILES

# what an error is, fixed at its construction (base.FablizeError.__init__ sets them once)
ERROR_FIELDS = {"message", "code", "exit_code", "steps", "commands", "run_next", "step"}


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
