"""The README's first screen reads for a newcomer: what the project is, how to install it, the
Quickstart; the contributors' commands after; the project's own words defined in the glossary
it links."""

from __future__ import annotations

import re

from tests.helpers import ROOT

README = (ROOT / "README.md").read_text("utf-8")
GLOSSARY = (ROOT / "docs" / "glossary.md").read_text("utf-8")
#: The project's own words, as the README uses them.
WORDS = ("scope", "key", "rate", "window", "margin", "cost", "slot", "lease", "line", "released", "held",
         "pause", "parked", "deferred", "journal")


def test_the_first_screen_is_install_then_quickstart_and_the_make_commands_come_after() -> None:
    sections = re.findall(r"^## (.+)$", README, flags=re.MULTILINE)
    assert sections[:2] == ["Install", "Quickstart"], sections
    first_screen = README[:README.index("## Quickstart")]
    assert "pip install" in first_screen and "make demo" not in first_screen and "make test" not in first_screen
    assert README.index("make demo") > README.index("## Quickstart")


def test_every_word_of_the_project_the_readme_uses_is_defined_in_the_glossary_it_links() -> None:
    assert "(docs/glossary.md)" in README[:README.index("## Install")]
    for word in WORDS:
        assert re.search(rf"(?<![a-z]){word}", README), f"{word!r} is no longer used: drop it from WORDS"
        assert f"**{word}**" in GLOSSARY, f"docs/glossary.md does not define {word!r}"


def test_the_readme_stays_short_and_its_benchmark_is_a_table_of_commands() -> None:
    # A newcomer's page: at most 180 lines; the figures, at most 8 rows, each with the
    # command that measures it (the details: docs/benchmarks.md and bench/results.md)
    assert len(README.splitlines()) <= 180, len(README.splitlines())
    bench = README[README.index("## Benchmark"):]
    rows = [line for line in bench.splitlines() if line.startswith("| ") and not line.startswith("| figure")]
    assert 1 <= len(rows) <= 8, rows
    assert all(re.search(r"`python -m bench[ .]", row) for row in rows), rows
