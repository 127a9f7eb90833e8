"""The user documentation stays true: docs/configuration.md is what the command lines print, the
README stays a README, and every relative link in the docs leads somewhere."""

import importlib.util
import re
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_configuration", ROOT / "tools" / "gen_configuration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_the_current_help():
    gen = _generator()
    expected = gen.render()
    on_disk = gen.PAGE.read_text() if gen.PAGE.exists() else ""
    if on_disk != expected:
        old, new = on_disk.splitlines(), expected.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        raise AssertionError(
            f"docs/configuration.md is stale: run `{gen.COMMAND}` (python tools/gen_configuration.py) and commit it.\n"
            f"first difference at line {first + 1}:\n  on disk:   {old[first] if first < len(old) else '<end>'}\n"
            f"  generated: {new[first] if first < len(new) else '<end>'}")


def test_configuration_page_names_every_option_of_every_command():
    """The page on disk (the test above keeps it the commands' current --help) names every option."""
    from starsd_draftd.cli import main as draftd
    from starsd_target.cli import main as target

    gen = _generator()
    text = gen.PAGE.read_text()
    groups = {"starsd-draftd": draftd, "starsd-target": target}
    for prog, sub in gen.COMMANDS:
        with click.Context(groups[prog]) as ctx:
            command = groups[prog].get_command(ctx, sub)
        assert command is not None, f"{prog} {sub} is not a command"
        assert f"## {prog} {sub}\n" in text
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                for opt in param.opts + param.secondary_opts:
                    assert opt in text, f"{prog} {sub} {opt} is missing from the generated page"


def test_readme_is_short_and_states_the_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "README.md is for users: at most 300 lines, depth goes to docs/"
    assert "make test" in readme  # .ci/run runs the README's test command
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_each_docs_page_opens_with_what_it_covers():
    for page in sorted((ROOT / "docs").glob("*.md")):
        lines = page.read_text().splitlines()
        assert lines and lines[0].startswith("# "), f"{page.name}: no title"
        body = next((line for line in lines[1:] if line.strip()), "")
        assert body and not body.startswith(("#", "|", "```")), f"{page.name}: no opening line saying what it covers"


def test_relative_links_in_the_docs_lead_to_files_and_headings_that_exist():
    link = re.compile(r"\]\(([^)\s]+)\)")
    for page in DOCS:
        for target in link.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{page.relative_to(ROOT)} links to {target}: no such heading"


def test_the_architecture_page_maps_every_product_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    tooling = ("starsd_draftd/bench/", "starsd_draftd/demo/")  # mapped by package
    missing = [str(path.relative_to(ROOT)) for pkg in ("common", "starsd_draftd", "starsd_target")
               for path in sorted((ROOT / pkg).rglob("*.py"))
               if path.name not in ("__init__.py", "__main__.py")
               and not str(path.relative_to(ROOT)).startswith(tooling)
               and f"`{path.relative_to(ROOT)}`" not in page]
    assert missing == [], f"docs/architecture.md's module map has no line for {missing}: add one from the module's docstring"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out
