"""The house's rules that the linters do not check (import-linter keeps ``redis`` in store/):
only the store reaches its client, only core/keys.py spells a key of the store, and the
parts of an app's throttle are wired in one place (``Throttle``'s constructor)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from tests.helpers import ROOT

PACKAGE = ROOT / "celery_throttle"


def _modules(*, outside: tuple[str, ...]) -> Iterator[tuple[str, ast.AST]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if not name.startswith(outside):
            yield name, ast.parse(path.read_text("utf-8"), filename=str(path))


def reaches_the_client(tree: ast.AST) -> list[int]:
    """Lines that read a store's client (``_redis``, or ``client`` as it was named)."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in ("_redis", "client")]


def spells_a_key(tree: ast.AST) -> list[int]:
    """Lines of f-strings that write a hash tag after a ``:`` (``f"{prefix}:{{lines}}"``):
    the shape of the store's key names."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
            and any(isinstance(part, ast.Constant) and ":{" in str(part.value) for part in node.values)]


def test_only_the_store_reaches_its_redis_client() -> None:
    found = {name: lines for name, tree in _modules(outside=("store/",)) if (lines := reaches_the_client(tree))}
    assert not found, f"a store's client read outside store/ (name the operation a method of the store): {found}"


def test_only_core_keys_spells_a_key_of_the_store() -> None:
    found = {name: lines for name, tree in _modules(outside=("core/keys.py",)) if (lines := spells_a_key(tree))}
    assert not found, f"a key of the store spelt outside core/keys.py: {found}"


#: The parts of one app's throttle: made by check/limiter.py's Throttle, and nowhere else.
PARTS = ("Setup", "Checker", "Lines", "Slots", "Hints", "Recorder")


def wires_a_part(tree: ast.AST) -> list[int]:
    """Lines that make one of :data:`PARTS`."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id in PARTS]


def test_the_parts_are_wired_in_one_place() -> None:
    found = {name: lines for name, tree in _modules(outside=("check/limiter.py",)) if (lines := wires_a_part(tree))}
    assert not found, f"a part made outside Throttle's constructor (hand it the parts it calls there): {found}"
    assert any(wires_a_part(tree) for name, tree in _modules(outside=()) if name == "check/limiter.py")


def test_the_rules_see_what_they_forbid() -> None:
    # (A rule that sees nothing would pass vacuously.)
    assert reaches_the_client(ast.parse("x = ctl.store._redis.zcard(k)")) == [1]
    assert spells_a_key(ast.parse('k = f"{prefix}:{{lines}}:due"')) == [1]
    assert wires_a_part(ast.parse("lines = Lines(setup, checker)")) == [1]
    assert not spells_a_key(ast.parse('m = f"use a format string such as {{tenant}}: {x}"'))
    assert any(spells_a_key(tree) for name, tree in _modules(outside=()) if name == "core/keys.py")

