"""The house rules of the layout, checked: what a target and the draft daemon's serve path import,
who imports a CLI module, module sizes and docstrings, and `--model demo` never training."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from common.models import DEMO_BUILD_COMMAND, DEMO_BUILD_COMMANDS

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "starsd_draftd", "starsd_target")
TOOLING = ("starsd_draftd.bench", "starsd_draftd.demo")


def _modules_after(code: str) -> list[str]:
    """Module names loaded by a fresh interpreter after running ``code``."""
    out = subprocess.run([sys.executable, "-c", code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_target_generating_alone_imports_no_draft_bench_demo_or_training_code(tiny_target):
    code = ("from starsd_target.cli import main\n"
            f"main(['generate', '--model', {str(tiny_target)!r}, '--no-draft', '--prompt', 'ab', '--max-tokens', '3'],"
            " standalone_mode=False)")
    mods = _modules_after(code)
    assert "starsd_target.engine" in mods  # it did generate
    assert not [m for m in mods if m.split(".")[0] == "starsd_draftd"]
    assert not [m for m in mods if m.split(".")[0] in ("eagle", "matplotlib")]


def test_the_draft_daemons_serve_path_imports_no_tooling():
    mods = _modules_after("import starsd_draftd.cli, starsd_draftd.app, starsd_draftd.backends.model")
    assert "starsd_draftd.server" in mods
    assert not [m for m in mods if m.startswith(TOOLING)]


def test_tooling_commands_are_registered_lazily_and_still_listed():
    from starsd_draftd.cli import main

    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in ("serve", "bench", "bench-peers", "plan", "demo", "train-eagle", "keygen", "status"):
        assert f"  {name} " in result.output


def _py_files():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def test_no_module_outside_a_cli_imports_a_cli_module():
    offenders = []
    for path in _py_files():
        if path.stem in ("cli", "__main__"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.split(".")[-1] == "cli" and n.split(".")[0] in PACKAGES for n in names):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_each_product_module_says_what_it_is_and_stays_readable():
    for path in _py_files():
        text = path.read_text()
        if path.name == "__main__.py" and len(text.splitlines()) < 10:
            continue
        assert ast.get_docstring(ast.parse(text)), f"{path.relative_to(ROOT)} has no module docstring"
        assert len(text.splitlines()) <= 800, f"{path.relative_to(ROOT)} is over 800 lines"


def test_common_and_the_target_import_neither_daemon_nor_tooling():
    for path in _py_files():
        rel = path.relative_to(ROOT)
        if rel.parts[0] not in ("common", "starsd_target"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for m in mods:
                assert m.split(".")[0] != "starsd_draftd", f"{rel} imports {m}"
                if rel.parts[0] == "common":
                    assert m.split(".")[0] != "starsd_target", f"{rel} imports {m}"


def test_model_demo_on_a_target_never_trains_and_names_the_build_command(tmp_path, monkeypatch):
    from starsd_target.cli import main

    monkeypatch.setenv("STARSD_CACHE_DIR", str(tmp_path))
    result = CliRunner().invoke(main, ["generate", "--model", "demo", "--no-draft", "--prompt", "x"])
    assert result.exit_code == 1
    assert "not built yet" in result.output and DEMO_BUILD_COMMAND in result.output
    assert list(tmp_path.iterdir()) == []


def test_serve_demo_draft_on_the_draft_daemon_never_trains_either(tmp_path):
    env = dict(os.environ, STARSD_CACHE_DIR=str(tmp_path))
    for args in (["--model", "demo-draft"], ["--backend", "eagle", "--eagle-head", "demo-eagle", "--base-model", "demo"]):
        out = subprocess.run([sys.executable, "-m", "starsd_draftd", "serve", "--bind", "tcp://127.0.0.1:0", *args],
                             capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        assert out.returncode == 1, out.stderr[-2000:]
        name = "demo-eagle" if "eagle" in args else "demo-draft"
        assert "not built yet" in out.stderr and DEMO_BUILD_COMMANDS[name] in out.stderr
        assert list(tmp_path.iterdir()) == []
