"""The docs stay true to the tree: docs/ARCHITECTURE.md's module map names every module under
quire/ and nothing else, its scripts paragraph every script, and the README and docs/ link only
to files that exist, the README to every page of docs/.

The map's rule, as the doc states it: in the fenced block under "## Module map", a line whose
first word ends in `/`, `.py`, `.c` or `.h` names that package or file by its path under quire/.
Every .py file but __init__.py, every .c and .h file and every package must be named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "quire"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
README = ROOT / "README.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
# [text](target) and ![alt](target), the target up to an optional #fragment
LINK = re.compile(r"!?\[[^\]]*\]\(([^)#\s]*)(?:#[^)]*)?\)")


def map_paths() -> list[str]:
    """The paths the module map names, in its order."""
    text = ARCHITECTURE.read_text()
    assert "\n## Module map\n" in text, "docs/ARCHITECTURE.md has no '## Module map' section"
    block = text.split("\n## Module map\n", 1)[1].split("```\n", 2)[1]
    first_words = [line.split()[0] for line in block.splitlines() if line.strip()]
    return [word for word in first_words if word.endswith(("/", ".py", ".c", ".h"))]


def tree_paths() -> set[str]:
    """Every module, C source and package under quire/, as the map spells it."""
    files = [path for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"]
    files += [*PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h")]
    packages = [path.parent for path in PACKAGE.rglob("__init__.py") if path.parent != PACKAGE]
    return {path.relative_to(PACKAGE).as_posix() for path in files} | {
        path.relative_to(PACKAGE).as_posix() + "/" for path in packages
    }


def test_the_module_map_names_every_module_in_the_tree():
    missing = sorted(tree_paths() - set(map_paths()))
    assert not missing, (
        "docs/ARCHITECTURE.md's module map lacks these paths under quire/; add a line "
        "`PATH  what it owns` to its ``` block for each:\n  " + "\n  ".join(missing)
    )


def test_the_module_map_names_only_paths_that_exist():
    stale = sorted(set(map_paths()) - tree_paths())
    assert not stale, (
        "docs/ARCHITECTURE.md's module map names paths that are not under quire/; remove or "
        "rename these lines:\n  " + "\n  ".join(stale)
    )


def test_the_architecture_doc_names_every_script_and_no_other():
    text = ARCHITECTURE.read_text()
    paragraph = text.split("`scripts/`:", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`([\w.-]+\.(?:py|sh))`", paragraph))
    scripts = {path.name for path in (ROOT / "scripts").iterdir() if path.is_file()}
    assert named == scripts, (
        "docs/ARCHITECTURE.md's `scripts/` paragraph must name every file in scripts/: add "
        f"{sorted(scripts - named)}, remove {sorted(named - scripts)}"
    )


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / target).resolve() for target in LINK.findall(README.read_text())}
    unlinked = [page.relative_to(ROOT).as_posix() for page in DOC_PAGES if page not in linked]
    assert not unlinked, f"README.md links no [page](docs/...) for {unlinked}: add one for each"


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = [
        f"{page.relative_to(ROOT).as_posix()}: ({target})"
        for page in [README, *DOC_PAGES]
        for target in LINK.findall(page.read_text())
        if target and not re.match(r"[a-z]+:", target) and not (page.parent / target).exists()
    ]
    assert not broken, "these links point at no file; fix the path:\n  " + "\n  ".join(broken)
