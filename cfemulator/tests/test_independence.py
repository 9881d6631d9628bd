"""The emulator is the witness of Cloudflare's API: it shares none of Sigil's code but the
workerd host it runs scripts on, so a mistake Sigil makes about Cloudflare cannot hide in
code both sides run."""

from __future__ import annotations

import ast
from pathlib import Path

import cfemulator

EMULATOR = Path(cfemulator.__file__).resolve().parent
# Sigil's packages, and the parts of them the emulator may use: the workerd host and its
# supervision (capabilities/workerd/), and the ground, which imports no app (ports, files).
SIGIL_PACKAGES = ("agents", "capabilities", "sigil", "sigil_site", "testsupport")
SHARED = ("capabilities.workerd", "sigil")


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_emulator_imports_of_sigil_only_the_workerd_host():
    borrowed = {
        f"{path.relative_to(EMULATOR.parent)}: {module}"
        for path in EMULATOR.rglob("*.py")
        if "tests" not in path.relative_to(EMULATOR).parts
        for module in imported_modules(path)
        if any(is_within(module, package) for package in SIGIL_PACKAGES)
        and not any(is_within(module, shared) for shared in SHARED)
    }
    assert borrowed == set()


def test_the_check_sees_an_import_of_sigils_runtimes(tmp_path):
    module = tmp_path / "borrowing.py"
    module.write_text(
        "from capabilities.runtimes.base import CodeBundle\nimport capabilities.workerd\n"
        "def late():\n    from capabilities import cloudflare\n"
    )
    assert imported_modules(module) >= {"capabilities.runtimes.base", "capabilities.workerd", "capabilities"}
    assert not is_within("capabilities.runtimes.base", "capabilities.workerd")
    assert is_within("capabilities.workerd.supervision", "capabilities.workerd")
