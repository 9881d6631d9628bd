"""Every Redis key is named once, in sigil/redis_keys.py: no other Python file (shipped code,
tests, benchmarks, the emulator) spells one, and each key there says who writes it and when
it expires."""

from __future__ import annotations

import ast
import inspect
import io
import os
import re
import tokenize
from pathlib import Path

import pytest

from sigil import redis_keys

ROOT = Path(__file__).resolve().parents[2]
KEY_MODULE = Path(redis_keys.__file__).resolve()
# This file spells keys on purpose: the examples the rule is tested on.
RULE_TEST = Path(__file__).resolve()
# Not the project's files: the virtualenv, node's packages, what runs and tests leave behind.
SKIPPED_DIRS = {"node_modules", "var", "test-artifacts", "__pycache__"}

# A key is spelled `sigil:` then its family (`sigil:route:…`, f"sigil:{…}"), standing at the
# start of a word: `urn:sigil:schema` (a JSON Schema id) and `sigil: Sigil` (an argument's
# annotation) are no keys.
KEY_SPELLING = re.compile(r"(?<![\w:.\[/-])sigil:(?=[\w{])")
# Strings of that shape that are not Redis keys, each with what it is.
NOT_KEYS = {
    # Cloudflare's `tags` filter of the script list (`tag:yes`), as the emulator's test sends it.
    ("cfemulator/tests/test_fidelity.py", '"sigil:yes"'),
    ("cfemulator/tests/test_fidelity.py", '"sigil:no"'),
}


def python_files() -> list[Path]:
    found = []
    for directory, subdirectories, files in os.walk(ROOT):
        subdirectories[:] = [d for d in subdirectories if not d.startswith(".") and d not in SKIPPED_DIRS]
        found += [Path(directory) / name for name in files if name.endswith(".py")]
    return sorted(found)


def key_spellings(path: str, text: str) -> list[str]:
    """`path:line: text` of each line of `text` that spells a Redis key."""
    spelled = []
    for number, line in enumerate(text.splitlines(), 1):
        if KEY_SPELLING.search(line) and not any(path == where and what in line for where, what in NOT_KEYS):
            spelled.append(f"{path}:{number}: {line.strip()}")
    return spelled


@pytest.mark.parametrize(
    ("line", "spells"),
    [
        ('ROUTE = "sigil:route:alice--ping"', True),
        ('return f"sigil:token:{token_hash}"', True),
        ('key = f"sigil:{family}:{name}"', True),
        ("# the records (sigil:logs:…) are the tail's", True),
        ('"""`sigil:stats:{full}` holds the counters"""', True),
        ('SCHEMA_URI = "urn:sigil:schema"', False),
        ("def call_timed(sigil: Sigil, token: str) -> Timed:", False),
        ('const EXCEPTION_MARK = "[sigil:exception]"', False),
        ('id="sigil.E001"', False),
    ],
)
def test_the_rule_tells_a_key_from_other_strings(line, spells):
    assert bool(key_spellings("any.py", line)) is spells


def test_no_python_file_but_the_key_module_spells_a_redis_key():
    spelled = []
    for path in python_files():
        if path.resolve() in (KEY_MODULE, RULE_TEST):
            continue
        spelled += key_spellings(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))
    assert not spelled, "Redis keys spelled outside sigil/redis_keys.py (name them there):\n" + "\n".join(spelled)


def test_the_scan_reaches_every_package_of_the_checkout():
    scanned = {path.relative_to(ROOT).parts[0] for path in python_files()}
    assert {"agents", "bench", "capabilities", "cfemulator", "sigil", "sigil_site", "testsupport"} <= scanned


def documented_keys() -> dict[str, str]:
    """Each key the module names (a constant or a family) → what is written beside it: the
    `#:` comment above a constant or family, or the docstring of a function."""
    source = KEY_MODULE.read_text(encoding="utf-8")
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and token.string.startswith("#:") and token.start[1] == 0:
            comments[token.start[0]] = token.string[2:].strip()
    documented = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name != "key_family":
            documented[node.name] = ast.get_docstring(node) or ""
        elif isinstance(node, ast.Assign):
            (target,) = node.targets
            above, line = [], node.lineno - 1
            while line in comments:
                above.insert(0, comments[line])
                line -= 1
            documented[target.id] = " ".join(above)
    return documented


def test_every_key_says_who_writes_it_and_when_it_expires():
    documented = documented_keys()
    assert len(documented) > 50  # the module's keys were found
    missing = [
        name
        for name, text in documented.items()
        if not re.search(r"\bWritten\b|\bwrites\b", text) or not re.search(r"[Ee]xpir|\b[Aa] lease\b", text)
    ]
    assert not missing, f"say who writes these keys and when they expire: {missing}"


def spelling_of(name: str) -> str:
    """The key `name` stands for, with each thing it is named by shown as `{}`."""
    value = getattr(redis_keys, name)
    if isinstance(value, str):
        return value
    parameters = inspect.signature(value).parameters.values() if inspect.isfunction(value) else [None]
    arguments = [0 if p is not None and p.annotation in ("int", "float") else "{}" for p in parameters]
    spelled = value(*arguments)
    return "|".join(spelled) if isinstance(spelled, tuple) else spelled


def test_no_two_names_stand_for_the_same_key():
    spellings: dict[str, list[str]] = {}
    for name in documented_keys():
        spellings.setdefault(spelling_of(name), []).append(name)
    assert {spelling: names for spelling, names in spellings.items() if len(names) > 1} == {}
