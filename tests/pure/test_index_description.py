"""What the package index shows for the project (setup.py): README.md with no link that
points into the tree, since an index shows none of its files."""

from __future__ import annotations

import re
import runpy
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _index_description() -> str:
    # (Run as a module, setup.py only defines its function: setup() runs under __main__.)
    described = runpy.run_path(str(ROOT / "setup.py"), run_name="index_description")
    return str(described["index_description"]((ROOT / "README.md").read_text("utf-8")))


def test_the_index_description_has_no_link_or_image_into_the_tree() -> None:
    text = _index_description()
    links = re.findall(r"!?\[[^\]]*\]\(([^)]+)\)", text)
    assert all(target.startswith(("http://", "https://", "#")) for target in links), links
    # and each document the README links to is still named, as a path of the source distribution
    for path in ("docs/guarantees.md", "docs/operations.md", "docs/design.md", "bench/results.md",
                 "CONTRIBUTING.md"):
        assert f"`{path}`" in text, path
    assert "bench/chart.png" not in text


def test_every_path_the_index_description_names_is_in_the_source_distribution() -> None:
    rules = [line.split() for line in (ROOT / "MANIFEST.in").read_text("utf-8").splitlines()
             if line.strip() and not line.startswith("#")]

    def shipped(path: str) -> bool:
        return any((rule[0] == "include" and path in rule[1:])
                   or (rule[0] == "recursive-include" and path.startswith(f"{rule[1]}/")
                       and any(fnmatch(Path(path).name, glob) for glob in rule[2:])) for rule in rules)

    named = set(re.findall(r"`([\w./-]+\.md)`", _index_description()))
    assert {"docs/design.md", "bench/results.md"} <= named
    for path in named:
        assert (ROOT / path).exists() and shipped(path), f"{path} is not in the source distribution"
