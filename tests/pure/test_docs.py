"""The docs cite only what the code has: every test they name (``test_x.py::test_y``, and a
``::test_z`` after it in the same file), every file, every relative link and every
``throttle_*`` setting. A rename or a removal that leaves a doc behind fails here, not in
a reader's hands.

The living docs are checked: the README, CONTRIBUTING and ``docs/``. The CHANGELOG and
``bench/results.md`` are records of what was true when they were written, and keep their
old names."""

from __future__ import annotations

import dataclasses
import re
from functools import cache
from pathlib import Path

import pytest

from celery_throttle.core.config import Settings
from tests.conftest import TIERS
from tests.helpers import ROOT

DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
#: Where a file named without its folder may live.
SOURCE_DIRS = ("celery_throttle", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "celery_throttle").glob("*/"))
                                  if p.name != "__pycache__"),
               "celery_throttle/store/lua", "celery_throttle/store/lua/include", "celery_throttle/store/lua/op", "tests",
               *(f"tests/{tier}" for tier in TIERS), "tests/fixtures",
               "bench", "examples", ".ci", ".")
#: ``throttle_*`` names that are not settings: the remote-control command of ``throttle why``.
NOT_SETTINGS = frozenset({"throttle_why"})

# A test cited as `test_file.py::test_name`, or as `::test_name` after such a citation,
# which names the same file (a table cell of several tests of one file).
_TEST = re.compile(r"(?P<file>test_\w+\.py)(?:::(?P<name>\w+))?|(?<![\w.:])::(?P<more>test_\w+)")
# A file in backquotes: a path with a folder, or a bare name with a source suffix.
_FILE = re.compile(r"`(?P<path>(?:[\w.-]+/)*[\w-]+\.(?:py|lua|md|json|toml|cfg|ini|yml|yaml|txt))(?::\d+)?`")
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
_SETTING = re.compile(r"(?<![\w.])(?P<name>throttle_[a-z_]+)")


def _text(doc: Path) -> str:
    # (Fenced code is examples of a user's project: its paths are theirs, not ours.)
    return re.sub(r"^```.*?^```", "", doc.read_text("utf-8"), flags=re.MULTILINE | re.DOTALL)


@cache
def _defined_tests(file: str) -> frozenset[str] | None:
    """The tests a test file defines, found in its tier's folder (tests/pure/, ...): a doc
    cites it by its name alone. None: no such file, or more than one of that name."""
    paths = [ROOT / "tests" / tier / file for tier in TIERS if (ROOT / "tests" / tier / file).exists()]
    if len(paths) != 1:
        return None
    return frozenset(re.findall(r"^(?:async )?def (test_\w+)", paths[0].read_text("utf-8"), flags=re.MULTILINE))


def cited_tests(text: str) -> list[tuple[str, str | None]]:
    """Every (file, test) a text cites, in order; test None: the file alone."""
    cited: list[tuple[str, str | None]] = []
    current = None
    for m in _TEST.finditer(text):
        if m["file"]:
            current = m["file"]
            cited.append((current, m["name"]))
        elif current is not None:
            cited.append((current, m["more"]))
    return cited


def _exists(path: str, doc: Path) -> bool:
    if "/" in path:
        return any((base / path).exists() for base in (ROOT, doc.parent))
    return any((ROOT / folder / path).exists() for folder in SOURCE_DIRS)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_test_a_doc_cites_exists(doc: Path) -> None:
    missing = []
    for file, name in cited_tests(_text(doc)):
        defined = _defined_tests(file)
        if defined is None:
            missing.append(f"{file} (in no tier's folder, or in several)")
        elif name is not None and name not in defined:
            missing.append(f"{file}::{name}")
    assert not missing, f"{doc.name} cites tests that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_file_and_link_a_doc_cites_exists(doc: Path) -> None:
    text = _text(doc)
    missing = [m["path"] for m in _FILE.finditer(text) if not _exists(m["path"], doc)]
    for m in _LINK.finditer(text):
        target = m["target"].split("#", 1)[0]
        if target and not re.match(r"[a-z]+:", target) and not (doc.parent / target).exists():
            missing.append(m["target"])
    assert not missing, f"{doc.name} cites files that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_setting_a_doc_names_is_one(doc: Path) -> None:
    settings = {f"throttle_{f.name}" for f in dataclasses.fields(Settings)} | {"throttle_redis_secret_url"}
    named = {m["name"].rstrip("_") for m in _SETTING.finditer(_text(doc))}
    unknown = named - settings - NOT_SETTINGS
    assert not unknown, f"{doc.name} names settings that do not exist: {sorted(unknown)}"


def test_the_check_finds_a_test_cited_after_its_file_and_a_missing_one() -> None:
    # The check itself: a citation of a test that is not there is caught, a continued one
    # is read as of the file before it.
    text = "| row | `test_docs.py::test_every_test_a_doc_cites_exists`, `::test_no_such_test` |"
    assert cited_tests(text) == [("test_docs.py", "test_every_test_a_doc_cites_exists"),
                                 ("test_docs.py", "test_no_such_test")]
    defined = _defined_tests("test_docs.py")
    assert defined is not None and "test_no_such_test" not in defined
    assert _defined_tests("test_no_such_file.py") is None


def test_every_module_has_a_test_home() -> None:
    """docs/tests.md has a row for every module and Lua script of the package, under its
    folder's heading (``## core: ...``; the package's own files under ``## the package's top``)."""
    rows: dict[str, set[str]] = {}
    folder = ""
    for line in _text(ROOT / "docs" / "tests.md").splitlines():
        if line.startswith("## "):
            folder = "" if "top" in line else line[3:].split(":")[0].strip()
        elif line.startswith("| `"):
            rows.setdefault(folder, set()).update(re.findall(r"`([\w/]+\.(?:py|lua))`", line.split("|")[1]))
    package = ROOT / "celery_throttle"
    missing = []
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.lua")]):
        parts = path.relative_to(package).parts
        if len(parts) > 1 and parts[-1] == "__init__.py":
            continue
        folder, name = ("", parts[0]) if len(parts) == 1 else (parts[0], parts[-1])
        if name not in rows.get(folder, set()):
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"docs/tests.md gives no test home to: {missing}"


def test_contributings_layout_names_every_module_of_the_package_under_its_folder_and_no_other() -> None:
    # Each folder's table in CONTRIBUTING's Layout ("**`ops/`** ..." then "| `cli.py` | ..."
    # rows; lua/ as one row of store's) against the package's files
    text = _text(ROOT / "CONTRIBUTING.md")
    layout = text[text.index("## Layout"):text.index("### Reading order")]
    named: dict[str, set[str]] = {}
    folder = None
    for line in layout.splitlines():
        if m := re.match(r"^\*\*`(\w+)/`\*\*", line):
            folder = m.group(1)
            named[folder] = set()
        elif folder and (m := re.match(r"^\| `([\w.]+)`", line)):
            named[folder].add(m.group(1))
    package = ROOT / "celery_throttle"
    folders = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert set(named) == folders, f"Layout's folders {sorted(named)}, the package's {sorted(folders)}"
    for name, listed in named.items():
        modules = {p.name for p in (package / name).glob("*.py") if p.name != "__init__.py"}
        assert modules <= listed, f"{name}/: Layout misses {sorted(modules - listed)}"
        assert listed - {"lua/"} <= modules | {"lua"}, f"{name}/: Layout names what is not there: {sorted(listed - modules)}"
