"""The package index's description of the project: README.md with its links into the
tree told as paths (an index shows no file of the repository, and the project has no
public home yet to link to), and without the chart, which it cannot show. Everything
else is in pyproject.toml."""

from __future__ import annotations

import re
from pathlib import Path

#: A Markdown link or image to a path of the tree (not a web address, not an anchor).
_RELATIVE = re.compile(r"(!?)\[([^\]]*)\]\((?!https?://|#)([^)\s]+)\)")


def index_description(readme: str) -> str:
    """``readme`` as the package index shows it: a link to a file of the tree becomes its
    text and the file's path in the source distribution; an image of the tree, and a line
    that held only that, are left out."""
    def told(match: re.Match[str]) -> str:
        image, text, target = match.groups()
        path = target.split("#")[0]
        if image:
            return ""
        if text in (path, f"`{path}`"):
            return f"`{path}` (in the source distribution)"
        return f"{text} (`{path}` in the source distribution)"

    kept = []
    for line in readme.splitlines():
        told_line = _RELATIVE.sub(told, line)
        if told_line.strip() or not line.strip():
            kept.append(told_line)
    return "\n".join(kept) + "\n"


if __name__ == "__main__":
    from setuptools import setup

    setup(long_description=index_description(Path(__file__).with_name("README.md").read_text("utf-8")),
          long_description_content_type="text/markdown")
