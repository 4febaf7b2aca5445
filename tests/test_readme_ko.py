"""README.ko.md is the same short README in Korean.

The Korean README gives the same five-minute start: the same sections, the same commands and
the same links; the prose is translated freely, the commands never. Its fenced code blocks
(every command to type, the quick start's transcript, the CI job) are README.md's, byte for
byte and in order; every command README.md shows inline is in it; it links every page README.md
links; its headings have the same levels in the same order; its "Performance" section quotes
the same bench lines, verbatim; the two READMEs link to each other under their titles; and its
links lead to files that exist and to headings that exist (GitHub's anchors). The tables and
the wording are not held here: docs/ holds the detail, in English.
"""

import re
import unicodedata
from collections import Counter
from itertools import zip_longest

from conftest import ROOT
from test_bench import FIGURE
from test_docs import check_invocations, invocations

README = ROOT / "README.md"
KOREAN = ROOT / "README.ko.md"

TO_KOREAN = "English · [한국어](README.ko.md)"
TO_ENGLISH = "[English](README.md) · 한국어"

# a whole fenced block, its fence lines (and their info string) included
FENCED = re.compile(r"^[ \t]*```[^\n]*\n.*?^[ \t]*```[^\n]*$", re.M | re.S)
HEADING = re.compile(r"(#{1,6}) (.+)")
SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a figure with its number: `7.40 s`, `61%`, `×1.95`, `39 MiB` (FIGURE, test_bench's, finds lines)
FIGURE_VALUE = re.compile(r"\d[\d,.]*\s?(?:ms\b|%|×|MiB\b|MB\b|/s\b|s\b)|×\s?\d[\d,.]*")


def read(path):
    return path.read_text(encoding="utf-8")


def prose(text):
    """The text outside fenced blocks."""
    return FENCED.sub("", text)


def code_spans(text):
    """Every inline code span outside fenced blocks, its inner whitespace collapsed (a span may
    be wrapped across lines, and a translation wraps it elsewhere)."""
    return [re.sub(r"\s+", " ", span) for span in SPAN.findall(prose(text))]


def outline(text):
    """[(level, heading text, line index)] of the headings outside fenced blocks (engine output
    in a block may start with "## ")."""
    found, fenced = [], False
    for i, line in enumerate(text.split("\n")):
        if re.match(r"\s*```", line):
            fenced = not fenced
        elif not fenced and HEADING.fullmatch(line):
            hashes, title = HEADING.fullmatch(line).groups()
            found.append((len(hashes), title.strip(), i))
    return found


def section_lines(text, number):
    """The lines of the `number`-th heading's section, up to the next heading of the same or a
    higher level."""
    heads = outline(text)
    level, _, start = heads[number]
    end = next((i for lvl, _, i in heads[number + 1:] if lvl <= level), None)
    return text.split("\n")[start + 1:end]


def performance(text, english):
    """The "## Performance" section of `text`: the `##` section at the place the English one
    has among README.md's `##` sections (a translated heading is found by where it stands)."""
    sections = [[n for n, (lvl, _, _) in enumerate(outline(doc)) if lvl == 2]
                for doc in (english, text)]
    place = [outline(english)[n][1] for n in sections[0]].index("Performance")
    assert place < len(sections[1]), \
        f"README.ko.md has {len(sections[1])} `##` sections; Performance is number {place + 1}"
    return section_lines(text, sections[1][place])


def bench_lines(lines):
    """The lines bench.py prints: table rows, and lines holding a figure that are neither the
    prose bullets explaining them (`- **…**`) nor the continuation of one (indented)."""
    return [line for line in lines if line.startswith("|") or
            (FIGURE.search(line) and not line[:1].isspace() and not line.startswith("- **"))]


def slug(heading):
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (letters of any
    script, Hangul included, digits, `_` and `-` kept), each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(text):
    """Every heading anchor of a document; a repeated one gets -1, -2, … as on GitHub."""
    seen, found = Counter(), set()
    for _, title, _ in outline(text):
        base = slug(title)
        found.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def unclosed_bold(text):
    """Where a `**` meant to close bold text cannot close it, or one meant to open cannot open
    it (CommonMark's flanking rules). Korean trips them where English does not: bold ending in a
    code span, then a particle (`**…`audit`**이`), stays literal asterisks, a closing `**` after
    punctuation needing a space or punctuation after it. Code spans are blanked first (a `**`
    in one is text), keeping their backticks, which are punctuation."""
    def punctuation(c):
        return c != "" and unicodedata.category(c)[0] in "PS"

    def space(c):
        return c == "" or c.isspace()

    original = prose(text)
    blanked = SPAN.sub(lambda m: "`" + "x" * len(m.group(1)) + "`", original)
    wrong = []
    for paragraph in re.finditer(r"(?s).+?(?=\n\s*\n|\Z)", blanked):
        markers = re.finditer(r"(?<!\*)\*\*(?!\*)", paragraph.group())
        for n, m in enumerate(markers):
            at, to = paragraph.start() + m.start(), paragraph.start() + m.end()
            before, after = blanked[at - 1:at], blanked[to:to + 1]
            if n % 2 == 0:  # opens: left-flanking
                fine = not space(after) and (not punctuation(after) or space(before)
                                             or punctuation(before))
            else:  # closes: right-flanking
                fine = not space(before) and (not punctuation(before) or space(after)
                                              or punctuation(after))
            if not fine:
                wrong.append(original[max(0, at - 30):to + 12].replace("\n", " "))
    return wrong


def first_line_under_the_title(text):
    lines = text.split("\n")
    assert lines[0].startswith("# "), "the README must open with its title"
    return next((line for line in lines[1:] if line.strip()), "")


def shown(heading):
    return "#" * heading[0] + " " + heading[1] if heading else "—"


def clip(text, limit=600):
    return text if len(text) <= limit else text[:limit] + " …"


# The two READMEs ############################################################


def test_each_readme_links_to_the_other_under_its_title():
    assert first_line_under_the_title(read(README)) == TO_KOREAN, \
        f"README.md: the line under the title must be {TO_KOREAN!r}"
    assert first_line_under_the_title(read(KOREAN)) == TO_ENGLISH, \
        f"README.ko.md: the line under the title must be {TO_ENGLISH!r}"


def test_fenced_blocks_are_the_english_ones_byte_for_byte():
    english, korean = FENCED.findall(read(README)), FENCED.findall(read(KOREAN))
    assert english, "README.md has no fenced block: the pattern reads nothing"
    for i, (en, ko) in enumerate(zip(english, korean), 1):
        assert ko == en, (f"fenced block {i} of README.ko.md differs from README.md's "
                          f"(copy it, never translate it):\n--- README.md\n{clip(en)}\n"
                          f"--- README.ko.md\n{clip(ko)}")
    assert len(korean) == len(english), \
        f"README.md has {len(english)} fenced blocks, README.ko.md {len(korean)}"


def test_every_command_the_english_shows_inline_is_kept():
    """The commands README.md names in running text (`fablize setup claude`, `decide …`), as
    code spans, exactly as in English."""
    def commands(text):
        return {span for span in code_spans(text) if invocations(f"`{span}`")}
    english, korean = commands(read(README)), commands(read(KOREAN))
    assert len(english) >= 5, "reading README.md's inline commands found too few"
    missing = sorted(english - korean)
    assert not missing, ("commands README.md shows inline that README.ko.md does not, to be "
                         "kept exactly as in English: " + ", ".join(f"`{s}`" for s in missing))


def test_every_page_the_english_links_is_linked():
    def pages(text):
        return {target.split("#")[0] for target in LINK.findall(SPAN.sub("`…`", prose(text)))
                if target.split("#")[0] and target.split("#")[0] != "README.ko.md"}
    english, korean = pages(read(README)), pages(read(KOREAN)) - {"README.md"}
    assert "docs/reference.md" in english, "reading README.md's links found too few"
    assert english == korean, (f"pages README.md links and README.ko.md does not: "
                               f"{sorted(english - korean)}; the other way: "
                               f"{sorted(korean - english)}")


def test_headings_have_the_same_levels_in_the_same_order():
    english, korean = outline(read(README)), outline(read(KOREAN))
    assert len(english) >= 8, "reading README.md's headings found too few"
    levels = [[lvl for lvl, _, _ in heads] for heads in (english, korean)]
    counts = [dict(Counter("#" * lvl for lvl in lvls)) for lvls in levels]
    side_by_side = "\n".join(f"  {shown(en):<50} | {shown(ko)}"
                             for en, ko in zip_longest(english, korean))
    assert levels[0] == levels[1], (
        f"the headings differ (by level: README.md {counts[0]}, README.ko.md {counts[1]}); "
        f"README.md | README.ko.md:\n{side_by_side}")


def test_performance_section_quotes_the_same_bench_lines_and_figures():
    english_text = read(README)
    english, korean = performance(english_text, english_text), \
        performance(read(KOREAN), english_text)
    quoted = bench_lines(english)
    assert quoted, "README.md's performance section quotes no bench line"
    assert bench_lines(korean) == quoted, (
        "the bench lines of README.ko.md's performance section differ from README.md's (table "
        "rows and figure lines are copied verbatim; refresh them with the English section):\n"
        + "\n".join([f"- {line}" for line in quoted if line not in korean]
                    + [f"+ {line}" for line in bench_lines(korean) if line not in english]))
    prose_figures = {value for line in english for value in FIGURE_VALUE.findall(line)}
    missing = sorted(v for v in prose_figures if v not in "\n".join(korean))
    assert not missing, ("figures README.md's performance section quotes that README.ko.md's "
                         f"does not: {missing}")


def test_links_lead_to_files_and_headings_that_exist():
    text = read(KOREAN)
    targets = LINK.findall(SPAN.sub("`…`", prose(text)))
    assert "README.md" in targets, "README.ko.md has no link to README.md"
    broken = []
    for target in targets:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        if path and not (ROOT / path).exists():
            broken.append(f"{target} (no file {path})")
        elif anchor:
            document = text if not path else read(ROOT / path) if path.endswith(".md") else None
            if document is not None and anchor not in anchors(document):
                broken.append(f"{target} (no heading #{anchor} in {path or 'README.ko.md'})")
    assert not broken, "README.ko.md links lead nowhere: " + "; ".join(broken)


def test_command_lines_use_only_real_commands_and_options():
    check_invocations(read(KOREAN), "README.ko.md")


def test_bold_text_renders_where_hangul_follows_it():
    wrong = unclosed_bold(read(KOREAN))
    assert not wrong, ("README.ko.md has `**` GitHub shows as asterisks (a closing `**` after "
                       "punctuation, such as a code span's backtick, needs a space or "
                       "punctuation after it, not a Hangul particle): " + "; ".join(wrong))
