"""The test runners' own reports: asked for, read test by test, compared with the base's.

A check passes only when its exit code and its test runner's own report agree. The report is the
runner's machine format, asked for on its command line and written to a folder outside the tree
the check runs in — pytest's JUnit XML, `go test -json`, node's JUnit reporter, jest's and
vitest's JSON — or, for the runners that write none, their per-test lines (unittest under `-v`,
`cargo test`). A closing summary is never believed: any test can print one. CI compares two such
reports, the base's and the branch's, test by test (FAIL_TO_PASS, PASS_TO_PASS: SWE-bench's rule).

Interface:
  shell_segments(cmd)   each simple command of a shell line: [(word, start, end)] (ValueError when
                        the quoting does not close)
  test_runners(cmd)     the runners a command line starts, in order, each once
  ask(cmd, folder)      (the command line with each runner asked for its report, [asked])
  read(asked, documents, log_path, root)   what the runners reported: Report
  recorded(report)      its counts, as a run records them (REPORT_SPEC)
  compare(base, branch) how the branch's tests fared against the base's (Comparison)
Pure but for reading the run's log; imports nothing of the engine but base.
"""

import json
import os
import re

from .base import count_noun, one_line, regex

PASSED, FAILED, ERROR, SKIPPED, XFAILED = "passed", "failed", "error", "skipped", "xfailed"
NOT_RUN = (SKIPPED, XFAILED)
BROKEN = (FAILED, ERROR)
MAX_DOCUMENT = 64 << 20     # a report larger than this is no report (a test can write one)


# The shell's words, where they are ##############################################################


_SEPARATORS = ("&&", "||", ";;", ";", "&", "|", "(", ")", "\n")


def shell_segments(cmd):
    """Each simple command of a POSIX shell line, as [(word, start, end)]: the word with its
    quotes taken off, and where its raw text starts and ends in `cmd` (a report option is put
    right after a word). Redirections and their targets are no words; `$(…)` and backquotes stay
    inside the word that holds them. Raises ValueError when a quote does not close."""
    return [words for words, _ in shell_parts(cmd) if words]


def shell_parts(cmd):
    """The line as shell_segments reads it, each part with the operator that ends it — `&&`,
    `|`, `;`, a new line, … ("" for the last) — [(words, operator)]; a part may have no word
    (`( pytest )` starts with one)."""
    parts, words = [], []
    i, n = 0, len(cmd)
    while i < n:
        c = cmd[i]
        if c in " \t":
            i += 1
            continue
        if c == "#":  # a comment, to the end of the line
            while i < n and cmd[i] != "\n":
                i += 1
            continue
        op = next((s for s in _SEPARATORS if cmd.startswith(s, i)), None)
        if op is not None and not (op == "&" and cmd.startswith(">", i + 1)):
            parts.append((words, op))
            words = []
            i += len(op)
            continue
        if c in "<>" or (c == "&" and cmd.startswith(">", i + 1)):
            i = _skip_redirection(cmd, i)
            continue
        start, text, i = i, *_word(cmd, i)
        if i < n and cmd[i] in "<>" and text.isdigit():  # `2>`: a descriptor, not a word
            i = _skip_redirection(cmd, i)
            continue
        words.append((text, start, i))
    parts.append((words, ""))
    return parts


def _skip_redirection(cmd, i):
    """Past a redirection operator and its target word."""
    n = len(cmd)
    while i < n and cmd[i] in "<>&|":
        i += 1
    while i < n and cmd[i] in " \t":
        i += 1
    if i < n and cmd[i] not in ";&|()\n":
        _, i = _word(cmd, i)
    return i


def _word(cmd, i):
    """(the word at i, quotes taken off; where it ends)."""
    out, n = [], len(cmd)
    while i < n:
        c = cmd[i]
        if c in " \t\n;&|()<>":
            break
        if c == "\\":
            if i + 1 < n and cmd[i + 1] != "\n":
                out.append(cmd[i + 1])
            i += 2
        elif c == "'":
            end = cmd.find("'", i + 1)
            if end < 0:
                raise ValueError("no closing quotation")
            out.append(cmd[i + 1:end])
            i = end + 1
        elif c == '"':
            i += 1
            while i < n and cmd[i] != '"':
                if cmd[i] == "\\" and i + 1 < n and cmd[i + 1] in '"\\$`\n':
                    i += 1
                out.append(cmd[i])
                i += 1
            if i >= n:
                raise ValueError("no closing quotation")
            i += 1
        elif cmd.startswith("$(", i):
            depth, j = 0, i
            while j < n:
                depth += {"(": 1, ")": -1}.get(cmd[j], 0)
                j += 1
                if depth == 0:
                    break
            if depth:
                raise ValueError("no closing parenthesis")
            out.append(cmd[i:j])
            i = j
        elif c == "`":
            end = cmd.find("`", i + 1)
            if end < 0:
                raise ValueError("no closing backquote")
            out.append(cmd[i:end + 1])
            i = end + 1
        else:
            out.append(c)
            i += 1
    return "".join(out), i


# Which runner a command starts, and where to ask it ##############################################


# words that start the next word as a program: a wrapper's own options are skipped too
WRAPPERS = frozenset("env nohup time nice timeout xvfb-run npx yarn pnpm bunx bun uv poetry pdm "
                     "hatch run exec command builtin if then elif else while until do ! { "
                     "sudo".split())
# this module's patterns are text, compiled on first use (base.regex): compiled as it loaded,
# they (and masking's one) were 1.2 ms of every start, a hook's too, that reads no runner
_ASSIGNMENT = r"(?sa)[A-Za-z_]\w*=.*"
_PYTHON = r"(python[\d.]*|pypy[\d.]*|py|coverage)\Z"
_DIRECT = {"pytest": "pytest", "py.test": "pytest", "jest": "jest", "vitest": "vitest"}
RUNNER_NAMES = ("pytest", "unittest", "go", "cargo", "node", "jest", "vitest")


def _runner_in(words):
    """(runner, index of the word its report options follow) of one simple command, or None."""
    i = 0
    while i < len(words) and (words[i][0] in WRAPPERS or words[i][0].startswith("-")
                              or words[i][0].isdigit()
                              or regex(_ASSIGNMENT).fullmatch(words[i][0])):
        i += 1
    if i >= len(words):
        return None
    name, args = os.path.basename(words[i][0]), [w[0] for w in words[i + 1:]]
    if name in _DIRECT:
        return _DIRECT[name], (len(words) - 1 if name in ("pytest", "py.test") else
                               _after_subcommand(words, i, name))
    if regex(_PYTHON).match(name) and "-m" in args[:-1]:
        module = args[args.index("-m") + 1]
        if module == "pytest":  # last: its own --junitxml would otherwise win over the engine's
            return "pytest", len(words) - 1
        if module == "unittest":
            return "unittest", len(words) - 1  # -v last: it wins over a -q before it
        return None
    if name == "go":
        plain = [k for k, a in enumerate(args) if not a.startswith("-")]
        if plain and args[plain[0]] == "test":
            return "go", i + 1 + plain[0]
    if name == "cargo":
        plain = [k for k, a in enumerate(args) if a[:1] not in "-+"]
        if plain and args[plain[0]] == "test":
            return "cargo", None
    if name == "node":
        if "--test" in args:
            return "node", i
        for k, a in enumerate(args):
            runner = _DIRECT.get(os.path.basename(a))
            if runner in ("jest", "vitest"):
                return runner, _after_subcommand(words, i + 1 + k, runner)
    return None


def _after_subcommand(words, i, runner):
    """vitest's report options follow its `run`; every other runner's, its own name."""
    if runner == "vitest" and i + 1 < len(words) and words[i + 1][0] in ("run", "watch", "dev"):
        return i + 1
    return i


def test_runners(cmd):
    """The test runners a shell command line starts whose report the engine reads, in order,
    each once: pytest (also `python -m pytest`), unittest (`python -m unittest`), go (`go test`),
    cargo (`cargo test`), node (`node --test`), jest, vitest. [] for any other command."""
    try:
        segments = shell_segments(cmd)
    except ValueError:
        return []
    found = []
    for words in segments:
        hit = _runner_in(words)
        if hit and hit[0] not in found:
            found.append(hit[0])
    return found


def _report_options(runner, path):
    """What a runner is told so that it writes its report to `path` (None: it prints its
    per-test lines to the log, and is told to)."""
    import shlex
    q = shlex.quote(path) if path else None
    return {
        # every module that fails to load is an entry: the tests of the others still run
        "pytest": f" --junitxml={q} -o junit_family=xunit1 --continue-on-collection-errors",
        "unittest": " -v",
        "go": " -json",
        "node": (" --test-reporter=spec --test-reporter-destination=stdout"
                 f" --test-reporter=junit --test-reporter-destination={q}"),
        "jest": f" --json --outputFile={q}",
        "vitest": f" --reporter=default --reporter=json --outputFile.json={q}",
    }.get(runner, "")


FILE_RUNNERS = ("pytest", "node", "jest", "vitest")   # write a report file; the others, lines


def ask(cmd, folder, trace=False):
    """(the command line with each runner it starts asked for its report, [{runner, path}]):
    a report file in `folder` for each runner that writes one, per-test lines in the log for
    the others. The command the user froze is what is recorded; this is what runs. `trace`:
    pytest also says which plugins it loads (--trace-config: conftest.py files, `-p` modules),
    as the re-run asks it on the base's tree."""
    try:
        segments = shell_segments(cmd)
    except ValueError:
        return cmd, []
    inserts, asked = [], []
    for words in segments:
        hit = _runner_in(words)
        if not hit:
            continue
        runner, at = hit
        path = (os.path.join(folder, f"{runner}-{len(asked) + 1}.report")
                if runner in FILE_RUNNERS else None)
        asked.append({"runner": runner, "path": path})
        if at is not None:
            inserts.append((words[at][2], _report_options(runner, path)
                            + (" --trace-config" if trace and runner == "pytest" else "")))
    for end, text in sorted(inserts, reverse=True):
        cmd = cmd[:end] + text + cmd[end:]
    return cmd, asked


# Reading what they reported #######################################################################


class Report:
    """What the runners of one run reported: each test's outcomes (a list: a test run twice has
    two), the file each came from as the runner named it, how many reports arrived, and what
    makes the report disagree with itself or be missing."""

    def __init__(self, runners, roots=()):
        self.runners = runners
        self.roots = [r for r in roots if r]  # the tree's places: never part of a test's id
        self.tests = {}
        self.files = {}
        self.hosts = {}        # a test written inside a module of the code (a doctest, a Rust
        #                        unit test in src/): that file, which the work may change
        self.missing = []      # runners that reported nothing
        self.problems = []     # what makes a report unbelievable, a sentence each
        self.per_test = True   # False when a runner gave counts only (cargo -q)
        self.extra = {}        # counts of a runner read without names: outcome → n

    def add(self, test_id, outcome, file=None, host=None):
        for root in self.roots:  # a parametrized id that holds the tree's path
            test_id = test_id.replace(root + os.sep, "").replace(root, "")
        self.tests.setdefault(test_id, []).append(outcome)
        if file and test_id not in self.files:
            self.files[test_id] = file
        if host:
            self.hosts[test_id] = host

    def counts(self):
        counts = dict.fromkeys((PASSED, FAILED, ERROR, SKIPPED, XFAILED), 0)
        for outcomes in self.tests.values():
            for o in outcomes:
                counts[o] += 1
        for o, n in self.extra.items():
            counts[o] += n
        return counts


def recorded(report):
    """A report as a run records it: the runner, the counts (an expected failure counts as
    skipped), the runners that wrote none and what makes it disagree — None without a runner."""
    if report is None:
        return None
    c = report.counts()
    out = {"runner": "+".join(report.runners), "passed": c[PASSED], "failed": c[FAILED],
           "errors": c[ERROR], "skipped": c[SKIPPED] + c[XFAILED]}
    if report.missing:
        out["missing"] = list(report.missing)
    if report.problems:
        out["problem"] = "; ".join(report.problems)
    return out


def read(asked, documents, log_path, root=None, top=None):
    """The Report of a run whose runners were `asked` (ask): `documents` maps each report path to
    the documents written there (a runner started twice wrote two), the per-test lines come from
    the log; `root` is the tree the run ran in (absolute paths in a report are made relative to
    it, so two trees' reports compare). None when no runner was asked."""
    if not asked:
        return None
    runners = list(dict.fromkeys(a["runner"] for a in asked))
    places = {p for base in (root, top) if base for p in (base, os.path.realpath(base))}
    report = Report(runners, sorted(places, key=len, reverse=True))
    log = None
    for a in asked:
        runner = a["runner"]
        if runner in FILE_RUNNERS:
            docs = [d for d in documents.get(a["path"], ()) if d.strip()]
            if not docs:
                if runner not in report.missing:
                    report.missing.append(runner)
                continue
            for doc in docs:
                try:
                    _READERS[runner](report, doc, root)
                except ValueError as e:
                    report.problems.append(f"{runner}'s report cannot be read "
                                           f"({one_line(e)[:120]})")
        else:
            if log is None:
                log = _log_text(log_path)
            if not LINE_READERS[runner](report, log):
                if runner not in report.missing:
                    report.missing.append(runner)
    return report


def _log_text(path):
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_DOCUMENT)
    except OSError:
        return ""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", data.decode("utf-8", "replace"))


def _relative(path, root):
    """A path a report names, relative to the run's tree when it lies inside it."""
    if root and path and os.path.isabs(path):
        real = os.path.realpath(root)
        for base in (root, real):
            if path == base or path.startswith(os.path.join(base, "")):
                return os.path.relpath(path, base).replace(os.sep, "/")
    return path


def _xml(doc):
    """A report's XML, refusing what no runner writes (a DOCTYPE: entity tricks)."""
    import xml.etree.ElementTree as ET
    if len(doc) > MAX_DOCUMENT:
        raise ValueError("larger than 64 MiB")
    if b"<!DOCTYPE" in doc or b"<!ENTITY" in doc:
        raise ValueError("it declares a document type")
    try:
        return ET.fromstring(doc)
    except ET.ParseError as e:
        raise ValueError(str(e))


def _junit_outcome(case):
    tags = {child.tag: child for child in case}
    if "error" in tags:
        return ERROR
    if "failure" in tags:
        return FAILED
    skipped = tags.get("skipped")
    if skipped is not None:
        return XFAILED if skipped.get("type") == "pytest.xfail" else SKIPPED
    return PASSED


def _read_pytest(report, doc, root):
    tree = _xml(doc)
    if tree.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"its root is <{tree.tag}>, not JUnit's")
    for case in tree.iter("testcase"):
        classname, name = case.get("classname") or "", case.get("name") or ""
        doctest = bool(classname) and name.startswith(classname + ".")  # a module of the code
        report.add(f"{classname}::{name}" if classname else name, _junit_outcome(case),
                   None if doctest else case.get("file") or None,
                   host=case.get("file") if doctest else None)


def _read_node(report, doc, root):
    tree = _xml(doc)
    if tree.tag != "testsuites":
        raise ValueError(f"its root is <{tree.tag}>, not JUnit's")

    def walk(element, path):
        for child in element:
            if child.tag == "testsuite":
                walk(child, path + [child.get("name") or ""])
            elif child.tag == "testcase":
                name = _relative(child.get("name") or "", root)
                report.add(" > ".join(path + [name]), _junit_outcome(child),
                           name if name != child.get("name") else None)
    walk(tree, [])


def _read_jest(report, doc, root):
    """jest's --json, and vitest's JSON reporter (the same shape)."""
    try:
        data = json.loads(doc.decode("utf-8"))
        results = data["testResults"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"not jest's JSON: {e}")
    if not isinstance(results, list):
        raise ValueError("testResults is not a list")
    for suite in results:
        if not isinstance(suite, dict):
            raise ValueError("a test file's result is not an object")
        file = _relative(str(suite.get("name") or suite.get("testFilePath") or ""), root)
        cases = suite.get("assertionResults") or []
        if not cases and (suite.get("status") == "failed" or suite.get("testExecError")
                          or suite.get("failureMessage")):
            report.add(file, ERROR, file)  # the file did not load: none of its tests ran
        for case in cases:
            if not isinstance(case, dict):
                continue
            titles = list(case.get("ancestorTitles") or []) + [case.get("title") or ""]
            status = case.get("status")
            outcome = {"passed": PASSED, "failed": FAILED}.get(status, SKIPPED)
            report.add(f"{file}::" + " > ".join(map(str, titles)), outcome, file)


_READERS = {"pytest": _read_pytest, "node": _read_node, "jest": _read_jest, "vitest": _read_jest}


# a test's line: its name, its dotted id, a sub-test's parameters, and — when its docstring is
# printed — the docstring's line, before ` ... ` and its outcome
# (a module that did not load is named dotted: `tests.test_calc (unittest.loader._FailedTest…)`)
_UNITTEST_TEST = (r"(?m)(?:^|(?<=\s))([\w.]+) \(([\w.]+)\)(?: \(([^\n]*?)\))?"
                  r"(?:\n[^\n]*?)? \.\.\. ")
_UNITTEST_BLOCK = r"(?m)^(FAIL|ERROR|UNEXPECTED SUCCESS): ([\w.]+) \(([\w.]+)\)"
_UNITTEST_RAN = r"(?m)^Ran (\d+) tests? in "
_UNITTEST_RESULT = (("ok", PASSED), ("FAIL", FAILED), ("ERROR", ERROR), ("skipped", SKIPPED),
                    ("expected failure", XFAILED), ("unexpected success", FAILED))


def _unittest_id(name, dotted):
    """A unittest's id whichever Python printed it: 3.11 names the method in the parentheses,
    3.9 and 3.10 only its class."""
    return dotted if dotted.endswith("." + name) else f"{dotted}.{name}"


def _read_unittest(report, log):
    """unittest's -v lines (`test_x (mod.Class.test_x) ... ok`), then its FAIL/ERROR blocks
    (which name a failed sub-test too). Each `Ran N tests` must be matched by N tests named."""
    runs = [int(m.group(1)) for m in regex(_UNITTEST_RAN).finditer(log)]
    if not runs:
        return False
    found = {}
    for m in regex(_UNITTEST_TEST).finditer(log):
        test_id = _unittest_id(m.group(1), m.group(2))
        rest = log[m.end():m.end() + 200]
        if m.group(3) is not None:  # a sub-test's own line: it failed
            found[test_id] = FAILED
            continue
        outcome = next((o for word, o in _UNITTEST_RESULT if rest.startswith(word)), None)
        if outcome is None:  # the test printed first: its word is on a line of its own, after
            # what it printed (log lines, however many), before the next test's line
            following = log[m.end():m.end() + 65536].split("\n")[1:]
            for line in following:
                if regex(_UNITTEST_TEST).match(line) or line.startswith(("=" * 20, "-" * 20)):
                    break
                outcome = next((o for word, o in _UNITTEST_RESULT
                                if line.strip() == word or line.startswith(word + " ")), None)
                if outcome is not None:
                    break
        if test_id not in found or found[test_id] is None:
            found[test_id] = outcome
    for m in regex(_UNITTEST_BLOCK).finditer(log):
        test_id = _unittest_id(m.group(2), m.group(3))
        found[test_id] = ERROR if m.group(1) == "ERROR" and found.get(test_id) != FAILED \
            else FAILED
    ran = sum(runs)
    if len(found) != ran:
        report.problems.append(f"unittest ran {count_noun(ran, 'test')} by its own "
                               f"count but named {len(found)} (its -v lines)")
    for test_id, outcome in found.items():
        if outcome is None:
            report.problems.append(f"unittest named {one_line(test_id)[:80]} without its outcome")
            outcome = ERROR
        if test_id.startswith("unittest.loader._FailedTest."):  # a module that did not load
            file = test_id[len("unittest.loader._FailedTest."):].replace(".", "/") + ".py"
        else:
            file = test_id.rsplit(".", 2)[0].replace(".", "/") + ".py"
        report.add(test_id, outcome, file)
    return True


_CARGO_RUNNING = r"^\s*(Running|Doc-tests)\s+(.*?)\s*(?:\((.*)\))?$"
_CARGO_COUNT = r"^running (\d+) tests?$"
_CARGO_TEST = r"^test (.+?) \.\.\. (ok|FAILED|ignored(?:, .*)?)$"
_CARGO_RESULT = r"^test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored;"


def _read_cargo(report, log):
    """cargo test's blocks, one a test binary: `running N tests`, a line a test, `test result:`.
    A binary that ended before its result line, or whose lines do not add up, disagrees."""
    source, block, seen = "?", None, False

    def close(block):
        if block is None:
            return
        named, want, result = block
        if result is None:
            report.problems.append(f"cargo: the test binary {one_line(source)[:80]} said it ran "
                                   f"{want} tests and ended before its result line")
        elif named and named != want:
            report.problems.append(f"cargo: {one_line(source)[:80]} ran {want} tests by its own "
                                   f"count but named {named}")
        elif not named and want:
            report.per_test = False  # -q: dots, no names; its counts are all there is
            passed, failed, ignored = result
            for outcome, n in ((PASSED, passed), (FAILED, failed), (SKIPPED, ignored)):
                report.extra[outcome] = report.extra.get(outcome, 0) + n

    for line in log.split("\n"):
        line = line.rstrip("\r")
        m = regex(_CARGO_RUNNING).match(line)
        if m and block is None:
            source = m.group(2) if m.group(1) == "Running" else "doc-tests " + m.group(2)
            source = source.replace("unittests ", "")
            continue
        m = regex(_CARGO_COUNT).match(line)
        if m:
            close(block)
            block, seen = [0, int(m.group(1)), None], True
            continue
        if block is None:
            continue
        m = regex(_CARGO_TEST).match(line)
        if m:
            block[0] += 1
            outcome = {"ok": PASSED, "FAILED": FAILED}.get(m.group(2), SKIPPED)
            # a unit test lives inside the code (src/): only tests/ holds test files
            report.add(f"{source}::{m.group(1)}", outcome,
                       source if source.startswith("tests/") else None,
                       host=None if source.startswith(("tests/", "doc-tests ")) else source)
            continue
        m = regex(_CARGO_RESULT).match(line)
        if m:
            block[2] = tuple(int(x) for x in m.groups())
            close(block)
            block = None
    close(block)
    return seen


def _read_go(report, log):
    """`go test -json`: a JSON event a line; each test's last action is its outcome, and a
    package that failed with no test failing did not build or set up."""
    seen, failed_tests, packages = False, set(), {}
    for line in log.split("\n"):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if not isinstance(ev, dict) or "Action" not in ev:
            continue
        seen = True
        action, package, test = ev.get("Action"), str(ev.get("Package") or ""), ev.get("Test")
        if action not in ("pass", "fail", "skip", "build-fail"):
            continue
        if test:
            outcome = {"pass": PASSED, "fail": FAILED, "skip": SKIPPED}[action]
            key = f"{package}::{test}"
            report.tests[key] = [outcome]
            if outcome == FAILED:
                failed_tests.add(package)
        else:
            packages[package or str(ev.get("ImportPath") or "?")] = action
    for package, action in packages.items():
        if action in ("fail", "build-fail") and package not in failed_tests:
            report.add(package, ERROR)
    return seen


LINE_READERS = {"unittest": _read_unittest, "cargo": _read_cargo, "go": _read_go}


# Comparing the branch's run with the base's ######################################################


class Comparison:
    """How the tests of the base's run fared in the branch's (each list names test ids):
    fixed — failed on the base, pass now (FAIL_TO_PASS); still_failing — failed on the base, not
    passing now; broken — passed on the base, not passing now (skipped, expected to fail, failed);
    vanished — ran on the base, not now; new — run now, not on the base."""

    def __init__(self):
        self.fixed, self.still_failing, self.broken, self.vanished, self.new = [], [], [], [], []

    def ok(self):
        return not (self.still_failing or self.broken or self.vanished)

    def words(self, limit=3):
        """What went wrong, in a phrase each (a few ids named)."""
        out = []
        for what, ids in (("vanished", self.vanished), ("passed on the base and do not now",
                                                         self.broken),
                          ("failed on the base and still do not pass", self.still_failing)):
            if ids:
                named = ", ".join(one_line(x)[:80] for x in ids[:limit])
                more = f" and {len(ids) - limit} more" if len(ids) > limit else ""
                out.append(f"{count_noun(len(ids), 'test')} {what} ({named}{more})")
        return out


def compare(base, branch):
    """The branch's Report held against the base's, test by test, counting repeats: a test the
    base ran must still run; one that passed must pass (not be skipped, expected to fail or
    fail); one that failed or errored — or was expected to fail — must now pass. A test skipped
    on the base may stay skipped. A file that did not load on the base (one error entry for
    all its tests, as a test-first suite whose module does not exist yet) is fixed when its
    tests run and pass now."""
    result = Comparison()
    by_file = {}
    for test_id, file in branch.files.items():
        if test_id not in base.tests:
            by_file.setdefault(file, []).append(test_id)
    # node names a file that did not load, never the file of a test that ran: the new tests
    # without a file stand for such a file's tests
    unfiled = [t for t in branch.tests if t not in base.tests and t not in branch.files]
    for test_id, before in base.tests.items():
        after = branch.tests.get(test_id, [])
        if len(after) < len(before):
            file = base.files.get(test_id)
            grown = (by_file.get(file) or (unfiled if file == test_id else None)
                     if file and not after and all(o in BROKEN for o in before) else None)
            if grown:  # the file's own error entry, its tests named one by one now
                outcomes = [o for t in grown for o in branch.tests[t]]
                if PASSED in outcomes and not any(o in BROKEN for o in outcomes):
                    result.fixed.append(test_id)
                else:
                    result.still_failing.append(test_id)
                continue
            result.vanished.append(test_id)
            continue
        passed_before = before.count(PASSED)
        broken_before = sum(before.count(o) for o in BROKEN + (XFAILED,))
        passed_after = after.count(PASSED)
        if any(o in BROKEN for o in after):  # a run of it failed: a twin's pass beside it
            (result.still_failing if broken_before else result.broken).append(test_id)
            continue                          # proves nothing
        if passed_after < passed_before + sum(before.count(o) for o in BROKEN):
            (result.still_failing if passed_after >= passed_before and broken_before
             else result.broken).append(test_id)
        elif broken_before and passed_after > passed_before:
            result.fixed.append(test_id)
    result.new = [t for t in branch.tests if t not in base.tests]
    return result
