#!/usr/bin/env python3
"""`make dist`: everything a release ships, built from the checkout into dist/.

  fablize_gate-V-py3-none-any.whl   pip / pipx / uv tool install it (`fablize` command)
  fablize_gate-V.tar.gz             the sdist (the same files the wheel is built from)
  fablize-gate-V-plugin.zip         the Claude Code plugin and its marketplace: unzip it and
                                    `claude plugin marketplace add` the folder
  plugin/fablize-gate/              the same, unzipped: `claude plugin marketplace add` it
  skill/fablize/                    what a skill installer should copy: SKILL.md on top, the
                                    engine's files and the documents SKILL.md links, nothing else

Every artifact holds the engine's files (ENGINE_FILES: scripts/goals.py, the one way in, its
package scripts/fablize_gate/, and scripts/fablize.py, which hooks written by 3.0 run) byte for
byte; the wheel installs the package alone (`fablize` runs fablize_gate.cli:run). The plugin and
the skill folder ship every document their Markdown links to, and what those link to (with_links):
the project has no web pages a link could point to instead, and a link into a folder that does
not hold its target is a dead end for the agent or person who follows it.
"""

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import fablize_gate  # noqa: E402

VERSION = fablize_gate.__version__
# the engine: the entry, the launcher of hooks written by 3.0, and the package
ENGINE_FILES = ["scripts/goals.py", "scripts/fablize.py"] + sorted(
    "scripts/fablize_gate/" + name for name in os.listdir(os.path.join(ROOT, "scripts",
                                                                        "fablize_gate"))
    if name.endswith(".py"))


def with_links(files):
    """`files`, then every file of the checkout their Markdown links to by a relative path
    (`[docs/ci.md](docs/ci.md)`, `(../README.md#ci)`), and what those link to, each once: a
    folder that ships a document ships what it points at."""
    files, todo = list(files), [f for f in files if f.endswith(".md")]
    while todo:
        rel = todo.pop(0)
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z][a-z0-9+.-]*:", path):  # an anchor, a URL
                continue
            path = os.path.normpath(os.path.join(os.path.dirname(rel), path)).replace(os.sep, "/")
            if path not in files and os.path.isfile(os.path.join(ROOT, path)):
                files.append(path)
                if path.endswith(".md"):
                    todo.append(path)
    return files


# the plugin as Claude Code installs it: manifests, hooks, the judge agent, the skill, the engine
PLUGIN_FILES = with_links([".claude-plugin/plugin.json", ".claude-plugin/marketplace.json",
                           "hooks/hooks.json", "agents/fablize-judge.md", "bin/fablize",
                           "bin/fablize.cmd", *ENGINE_FILES, "SKILL.md", "fablize-block.md",
                           "README.md", "docs/reference.md", "LICENSE", "CHANGELOG.md"])
SKILL_FILES = with_links(["SKILL.md", *ENGINE_FILES, "LICENSE"])
SDIST_FILES = ["pyproject.toml", "setup.py", "MANIFEST.in", *ENGINE_FILES, "README.md",
               "docs/reference.md", "LICENSE", "CHANGELOG.md"]


def build_wheel(out):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                    "--disable-pip-version-check", "-w", out, ROOT], check=True)
    for d in ("build", "fablize_gate.egg-info", os.path.join("scripts", "fablize_gate.egg-info")):
        shutil.rmtree(os.path.join(ROOT, d), ignore_errors=True)
    return os.path.join(out, f"fablize_gate-{VERSION}-py3-none-any.whl")


def build_sdist(out, wheel):
    """The sdist: the source files and PKG-INFO, the core metadata the wheel build wrote."""
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(f"fablize_gate-{VERSION}.dist-info/METADATA")
    base = f"fablize_gate-{VERSION}"
    path = os.path.join(out, base + ".tar.gz")
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        def add(name, data, mode=0o644):
            info = tarfile.TarInfo(f"{base}/{name}")
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
        add("PKG-INFO", metadata)
        for rel in SDIST_FILES:
            with open(os.path.join(ROOT, rel), "rb") as f:
                add(rel, f.read())
    return path


def build_plugin_folder(out):
    """The plugin's marketplace as a folder, for `claude plugin marketplace add` from a
    checkout: the plugin's files only (~0.5 MB), never the checkout's venv, caches or tests."""
    target = os.path.join(out, "plugin", "fablize-gate")
    shutil.rmtree(target, ignore_errors=True)
    for rel in PLUGIN_FILES:
        os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(target, rel))
    return target


def build_plugin(out):
    path = os.path.join(out, f"fablize-gate-{VERSION}-plugin.zip")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for rel in PLUGIN_FILES:
            src = os.path.join(ROOT, rel)
            info = zipfile.ZipInfo(f"fablize-gate/{rel}", date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (0o100755 if os.access(src, os.X_OK) else 0o100644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            with open(src, "rb") as f:
                z.writestr(info, f.read())
    return path


def build_skill(out):
    target = os.path.join(out, "skill", "fablize")
    shutil.rmtree(target, ignore_errors=True)
    for rel in SKILL_FILES:
        os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(target, rel))
    return target


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out = os.path.abspath(argv[0] if argv else os.path.join(ROOT, "dist"))
    os.makedirs(out, exist_ok=True)
    wheel = build_wheel(out)
    for built in (wheel, build_sdist(out, wheel), build_plugin(out), build_plugin_folder(out),
                  build_skill(out)):
        print(f"dist: {os.path.relpath(built, os.getcwd())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
