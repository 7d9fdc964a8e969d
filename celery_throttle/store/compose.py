"""How the store's scripts are put together from the files of ``lua/``.

A script names the shared parts it uses on a line of its own (``-- include: clock,
cubic``); a window operation is its algorithm, window.lua, line.lua and its own file of
``lua/op/``. Two steps then make the script Redis runs cheaper without touching what it
does, and keep every line where it was, so an error still names its file's own line
(:func:`.scripts.true_lines`):

- :func:`with_constants` writes each constant's value where its name is: Lua 5.1 makes a
  closure of every function on every run, and a constant written in place is no upvalue
  for it to capture (a denied check's script time 73 -> 63 µs in a probe of one server).
- :func:`pruned` blanks each top-level function the script never reaches: an operation makes
  no closure of another's helpers (74 -> 62 µs in the same probe; docs/benchmarks.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources

__all__ = ["composed", "line_map", "lua", "pruned", "script_parts", "with_constants"]


def lua(name: str) -> str:
    """The source of one of the package's scripts (``celery_throttle/store/lua/``)."""
    return resources.files("celery_throttle.store").joinpath("lua", *name.split("/")).read_text("utf-8")


#: A script names the shared parts it uses on a line of its own: ``-- include: clock, cubic``
#: (``lua/include/<name>.lua``, each a set of local functions).
_INCLUDE = re.compile(r"^-- include: ([a-z_, ]+)$", re.MULTILINE)


def script_parts(*names: str) -> list[tuple[str, str]]:
    """(file, source) of the scripts ``names`` as the loader composes them into one: the
    includes any of them names, each once, in the order first named, then each script."""
    sources = [(name, lua(name)) for name in names]
    included = dict.fromkeys(part.strip() for _, source in sources for found in _INCLUDE.findall(source)
                             for part in found.split(",") if part.strip())
    return [(f"include/{name}.lua", lua(f"include/{name}.lua")) for name in included] + sources


def line_map(parts: Sequence[tuple[str, str]]) -> list[tuple[int, str]]:
    """(first line in the composed script, file) of each part."""
    out, first = [], 1
    for name, source in parts:
        out.append((first, name))
        first += source.count("\n")
    return out


def composed(parts: Sequence[tuple[str, str]]) -> tuple[str, list[tuple[int, str]]]:
    """The script made of ``parts`` (each ending with a newline), and its line map."""
    return "".join(source for _, source in parts), line_map(parts)


#: A Lua string literal or a comment to the end of the line: never rewritten, never read as
#: code. (The scripts write no long strings or long comments.)
_NOT_CODE = re.compile(r"""('(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*"|--.*$)""", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z_]\w*")


def _code(text: str) -> str:
    """``text`` with its strings emptied and comments gone: the names it uses."""
    return _NOT_CODE.sub(lambda m: "''" if m.group(0)[0] in "'\"" else "", text)


def with_constants(source: str, constants: Mapping[str, int]) -> str:
    """``source`` with each name of ``constants`` written as its value, in code only (not a
    field: ``M.RELEASED``; not a key of a table constructor: ``{RELEASED = 8}``)."""
    if not constants:
        return source
    name = re.compile(r"(?<![.\w])(" + "|".join(sorted(map(re.escape, constants), key=len, reverse=True))
                      + r")\b(?!\s*=(?!=))")
    pieces = _NOT_CODE.split(source)
    for i in range(0, len(pieces), 2):
        pieces[i] = name.sub(lambda m: f"({constants[m.group(1)]})", pieces[i])
    return "".join(pieces)


#: A function defined at the top level of a script: ``local function name(`` (or ``name =
#: function(``, forward-declared), to the first ``end`` at the start of a line.
_FUNCTION = re.compile(r"^(?:local function (\w+)\(|(\w+) = function\()")
_OPENS, _ENDS = re.compile(r"\b(?:function|if|do)\b"), re.compile(r"\bend\b")


def _closed(line: str) -> bool:
    """Whether ``line`` closes every block it opens (a function written on one line)."""
    code = _code(line)
    return len(_OPENS.findall(code)) == len(_ENDS.findall(code))


def _functions(lines: Sequence[str]) -> tuple[dict[str, list[tuple[int, int]]], list[int]]:
    """Each top-level function's spans of lines (first, last), and the other lines."""
    spans: dict[str, list[tuple[int, int]]] = {}
    rest, i = [], 0
    while i < len(lines):
        found = _FUNCTION.match(lines[i])
        if not found:
            rest.append(i)
            i += 1
            continue
        last = i
        # (A function on one line ends on it: `local function f() return 1 end`.)
        while not (lines[last].startswith("end") or (last == i and _closed(lines[i]))):
            last += 1
        spans.setdefault(found.group(1) or found.group(2), []).append((i, last))
        i = last + 1
    return spans, rest


_DECLARATION = re.compile(r"^local [\w, ]+$")


def _names(lines: Iterable[str]) -> set[str]:
    return set(_NAME.findall(_code("\n".join(lines))))


def pruned(source: str) -> str:
    """``source`` with each top-level function that nothing else in it reaches blanked out
    (its lines left empty). Reached: named by the code outside the functions, or by a
    function reached; a name in a string or a comment reaches nothing."""
    lines = source.split("\n")
    spans, rest = _functions(lines)
    # (A forward declaration, `local arrive`, names a function without reaching it.)
    used = [lines[i] for i in rest if not _DECLARATION.match(_code(lines[i]))]
    todo = [name for name in _names(used) if name in spans]
    reached: set[str] = set()
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        for first, last in spans[name]:
            todo += [n for n in _names(lines[first:last + 1]) if n in spans and n not in reached]
    for name, where in spans.items():
        if name not in reached:
            for first, last in where:
                lines[first:last + 1] = [""] * (last + 1 - first)
    return "\n".join(lines)
