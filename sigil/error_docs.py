"""The error catalogue written out from its classes (sigil.errors): the OpenAPI error
responses, one per status with an example per code, and the table of docs/errors.md.

Regenerate the page with `python -m sigil.error_docs`; a test fails while it differs.
"""

from __future__ import annotations

import sys
from itertools import groupby
from pathlib import Path

from sigil.errors import SigilError, envelope, error_kinds

PAGE = Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def error_description(kinds: list[type[SigilError]], about: dict[type[SigilError], str] | None = None) -> str:
    """One status's description: each code and when Sigil answers it (in an operation's own
    words where `about` has them), and the headers sent."""
    about = about or {}
    description = "; ".join(f"{kind.code}: {about.get(kind, kind.meaning)}" for kind in kinds)
    headers = sorted({name for kind in kinds for name in kind.headers})
    return f"{description} (with {', '.join(headers)})" if headers else description


def error_example(kind: type[SigilError]) -> dict:
    """The envelope of `kind`'s example."""
    return envelope(kind.code, kind.example)


def by_status(kinds: tuple[type[SigilError], ...]) -> dict[int, list[type[SigilError]]]:
    """`kinds` grouped by their status, in the catalogue's order, each kind once."""
    rows = [kind for kind in error_kinds() if kind in kinds]
    missing = set(kinds) - set(rows)
    if missing:
        raise ValueError(f"not rows of the error catalogue: {', '.join(sorted(kind.__name__ for kind in missing))}")
    return {status: list(group) for status, group in groupby(rows, key=lambda kind: kind.status)}


def openapi_error_responses(
    *kinds: type[SigilError],
    about: dict[type[SigilError], str] | None = None,
    schema_ref: str = "#/components/schemas/Error",
) -> dict:
    """The OpenAPI responses object of an operation that can answer `kinds`: per status, the
    codes it stands for and one example each, in the `Error` schema. `about` says what a code
    means for this operation, where the catalogue's general words would say less."""
    return {
        str(status): {
            "description": error_description(group, about),
            "content": {
                "application/json": {
                    "schema": {"$ref": schema_ref},
                    "examples": {kind.code: {"value": error_example(kind)} for kind in group},
                }
            },
        }
        for status, group in by_status(kinds).items()
    }


def markdown_table() -> str:
    """docs/errors.md: every error Sigil answers, a row each."""
    lines = [
        "# Errors",
        "",
        "<!-- Written by `python -m sigil.error_docs` from the classes in sigil/errors.py; edit those. -->",
        "",
        "Every error code Sigil answers, with its status, headers and an example, generated from the",
        "error classes in `sigil/errors.py`. Every error Sigil writes itself, on the control API, the",
        'call route and MCP alike, is `{"error": {"code": …, "message": …}}`: a code for programs and',
        "a message for people, naming the field or limit at fault. A capability's own responses pass",
        "through unchanged.",
        "",
        "| status | code | when | headers | example message |",
        "|---|---|---|---|---|",
    ]
    for kind in error_kinds():
        headers = "<br>".join(f"`{name}`: {about}" for name, about in kind.headers.items())
        example = kind.example.replace("|", "\\|")
        lines.append(f"| `{kind.status}` | `{kind.code}` | {kind.meaning} | {headers} | `{example}` |")
    return "\n".join(lines) + "\n"


def write_page(path: Path = PAGE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown_table())


if __name__ == "__main__":
    write_page(Path(sys.argv[1]) if len(sys.argv) > 1 else PAGE)
