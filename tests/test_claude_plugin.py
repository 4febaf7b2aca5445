"""The plugin as Claude Code itself sees it: its own validator (`claude plugin validate --strict`,
installed from the npm registry into a throwaway directory) and a real install from a local
marketplace made of the plugin archive `make dist` builds. Skipped, with the reason, when npm or
the network is not there. The download (~250 MB) happens once and is cached under the system's
temporary directory, so a warm run costs seconds."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import dist  # noqa: E402  (tools/dist.py: what `make dist` builds)

CACHE = Path(os.environ.get("FABLIZE_CLAUDE_CACHE",
                            os.path.join(tempfile.gettempdir(), "fablize-claude-code-cache")))


def install_claude():
    """The `claude` command, installed into CACHE once (a lock keeps two test workers from
    installing it at the same time); the reason it cannot be had, as a skip."""
    claude = CACHE / "node_modules" / ".bin" / "claude"
    if claude.exists():
        return claude
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: cannot install @anthropic-ai/claude-code")
    CACHE.mkdir(parents=True, exist_ok=True)
    import fcntl
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not claude.exists():
            try:
                p = subprocess.run([npm, "install", "--prefix", str(CACHE), "--no-audit",
                                    "--no-fund", "--loglevel=error", "@anthropic-ai/claude-code"],
                                   capture_output=True, text=True, timeout=600)
            except subprocess.TimeoutExpired:
                pytest.skip("npm install @anthropic-ai/claude-code took over 10 minutes")
            if p.returncode != 0 or not claude.exists():
                pytest.skip("cannot install @anthropic-ai/claude-code from the npm registry: "
                            + (p.stderr.strip() or p.stdout.strip())[-300:])
    return claude


@pytest.fixture(scope="session")
def claude():
    return install_claude()


def run_claude(claude, *args, home, cwd=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLAUDE_", "ANTHROPIC_"))}
    env.update(HOME=str(home), DISABLE_AUTOUPDATER="1",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    p = subprocess.run([str(claude), *args], cwd=str(cwd or home), env=env, capture_output=True,
                       text=True, timeout=180)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("target", [".", ".claude-plugin/plugin.json"])
def test_claude_validates_the_repository_strictly(claude, tmp_path, target):
    code, out = run_claude(claude, "plugin", "validate", "--strict", str(ROOT / target),
                           home=tmp_path)
    assert code == 0 and "Validation passed" in out, out


def unzip_keeping_modes(archive, into):
    with zipfile.ZipFile(archive) as z:
        for info in z.infolist():
            path = Path(z.extract(info, into))
            mode = info.external_attr >> 16 & 0o777
            if mode:
                path.chmod(mode)


def test_the_plugin_archive_validates_installs_and_its_hooks_run(claude, tmp_path):
    archive = dist.build_plugin(str(tmp_path))
    unzip_keeping_modes(archive, tmp_path / "unpacked")
    market = tmp_path / "unpacked" / "fablize-gate"
    assert sorted(str(p.relative_to(market)) for p in market.rglob("*") if p.is_file()) == \
        sorted(dist.PLUGIN_FILES)
    assert (market / "scripts" / "goals.py").read_bytes() == \
        (ROOT / "scripts" / "goals.py").read_bytes()
    home = tmp_path / "home"
    home.mkdir()
    code, out = run_claude(claude, "plugin", "validate", "--strict", str(market), home=home)
    assert code == 0, out
    code, out = run_claude(claude, "plugin", "marketplace", "add", str(market), home=home)
    assert code == 0, out
    code, out = run_claude(claude, "plugin", "install", "fablize-gate@fablize-gate", home=home)
    assert code == 0 and "Successfully installed" in out, out
    settings = json.loads((home / ".claude" / "settings.json").read_text())
    assert settings["enabledPlugins"] == {"fablize-gate@fablize-gate": True}
    installed, = (home / ".claude" / "plugins" / "cache" / "fablize-gate" /
                  "fablize-gate").iterdir()
    # the installed hooks, as Claude Code runs them, in a project of their own
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    hooks = json.loads((installed / "hooks" / "hooks.json").read_text())["hooks"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABLIZE_")}
    env.update(CLAUDE_PLUGIN_ROOT=str(installed), HOME=str(home))

    def hook(event, payload):
        command = hooks[event][0]["hooks"][0]["command"].replace("${CLAUDE_PLUGIN_ROOT}",
                                                                 str(installed))
        return subprocess.run(["bash", "-c", command], cwd=str(project), env=env, text=True,
                              input=json.dumps(payload), capture_output=True, timeout=60)
    fablize = str(installed / "bin" / "fablize")
    assert subprocess.run([fablize, "create", "--brief", "b", "--goal", "A::a", "--goal", "V::v"],
                          cwd=str(project), env=env, capture_output=True).returncode == 0
    p = hook("Stop", {"cwd": str(project), "stop_hook_active": False})
    assert p.returncode == 0 and "fablize next" in json.loads(p.stdout)["reason"], p
    p = hook("SessionStart", {"cwd": str(project), "source": "startup"})
    assert p.returncode == 0 and p.stdout.startswith("fablize: 0/2 complete — b"), p
    # setup commits the same hooks as without the plugin; the plugin's own copy steps aside
    # at run time only where the project's can run (here `fablize` is not on PATH: it runs)
    p = subprocess.run([fablize, "setup", "claude"], cwd=str(project), env=env,
                       capture_output=True, text=True)
    assert p.returncode == 0 and "its hooks step aside for these" in p.stdout, p
    with_plugin = (project / ".claude" / "settings.json").read_bytes()
    bare = tmp_path / "bare"
    (bare / ".git").mkdir(parents=True)
    no_plugin = dict(env, HOME=str(tmp_path / "nobody"))
    no_plugin.pop("CLAUDE_PLUGIN_ROOT")
    assert subprocess.run([fablize, "setup", "claude"], cwd=str(bare), env=no_plugin,
                          capture_output=True).returncode == 0
    assert (bare / ".claude" / "settings.json").read_bytes() == with_plugin
    p = subprocess.run([fablize, "doctor"], cwd=str(project), env=env, capture_output=True,
                       text=True)
    assert "✓ Stop hook: registered once (the fablize-gate plugin)" in p.stdout, p
    p = hook("Stop", {"cwd": str(project), "stop_hook_active": False})
    assert p.returncode == 0 and "fablize next" in json.loads(p.stdout)["reason"], p


def test_the_skill_folder_holds_only_what_the_skill_needs_and_its_script_runs(tmp_path):
    """What `npx skills add ./dist/skill/fablize` copies: SKILL.md on top, the engine's files."""
    folder = Path(dist.build_skill(str(tmp_path)))
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == \
        sorted(dist.SKILL_FILES)
    assert (folder / "SKILL.md").read_bytes() == (ROOT / "SKILL.md").read_bytes()
    p = subprocess.run([sys.executable, str(folder / "scripts" / "goals.py"), "--version"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("fablize ")


def test_the_plugin_archive_keeps_bin_fablize_executable(tmp_path):
    with zipfile.ZipFile(dist.build_plugin(str(tmp_path))) as z:
        modes = {i.filename: i.external_attr >> 16 & 0o777 for i in z.infolist()}
    assert modes["fablize-gate/bin/fablize"] == 0o755
    assert modes["fablize-gate/hooks/hooks.json"] == 0o644


def test_the_plugin_folder_from_a_checkout_holds_the_plugin_only(tmp_path):
    """What README has `claude plugin marketplace add`: the plugin's files, the launcher
    executable, and nothing of the checkout (venv, caches, tests)."""
    folder = Path(dist.build_plugin_folder(str(tmp_path)))
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert files == sorted(dist.PLUGIN_FILES)
    assert os.access(folder / "bin" / "fablize", os.X_OK)
    assert sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) < 2_000_000
