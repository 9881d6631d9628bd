"""A capability's contract: what it does (`description`), what it takes (`input_schema`), what
it answers (`output_schema`), and a few `examples`. Pure rules, no I/O.

Schemas are JSON Schema, draft 2020-12, checked as schemas with the `jsonschema` library.
They are never allowed to fetch anything: a `$ref` resolves within the schema itself or not
at all (an empty registry), so a deploy cannot make Sigil reach out to a URL.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError, best_match
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from sigil.errors import InvalidRequest

DESCRIPTION_MAX_CHARS = 4096
EXAMPLES_MAX = 10
# What one example, and each schema, may weigh as JSON: enough for any real contract, small
# enough that listing hundreds of tools stays cheap.
SCHEMA_MAX_BYTES = 64 * 1024
EXAMPLE_MAX_BYTES = 16 * 1024
FIELDS = ("description", "input_schema", "output_schema", "examples")
# Keywords whose values are instances, not schemas: a "$ref" key inside them is data.
INSTANCE_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
SCHEMA_URI = "urn:sigil:schema"
# A NUL as json.dumps writes it: \u0000 after an even number of backslashes.
ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
ENDLESS = "the schema refers to itself without end (a $ref cycle)"
# An MCP tool's input schema when a capability declares none: any JSON object.
OPEN_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Contract:
    description: str = ""
    input_schema: dict | None = None
    output_schema: dict | None = None
    examples: list = field(default_factory=list)

    @classmethod
    def of(cls, version) -> Contract:
        """The contract a CapabilityVersion (or None) carries."""
        if version is None:
            return cls()
        return cls(version.description, version.input_schema, version.output_schema, list(version.examples or []))

    def as_fields(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "input_schema": self.input_schema,
            "output_schema": self.output_schema,
            "examples": list(self.examples),
        }


def contract_merge(current: Contract, sent: Mapping[str, Any]) -> Contract:
    """The contract a deploy asks for: the fields it sent, the current ones for those it
    omitted (null clears a field). Raises InvalidRequest naming the first broken rule."""
    fields = current.as_fields()
    for name in FIELDS:
        if name in sent:
            value = sent[name]
            fields[name] = (
                ("" if name == "description" else [] if name == "examples" else None) if value is None else value
            )
    contract = Contract(**fields)
    contract_validate(contract)
    return contract


def contract_validate(contract: Contract) -> None:
    """Check a contract. Raises InvalidRequest naming the field and the problem."""
    if not isinstance(contract.description, str):
        raise InvalidRequest("description must be a string")
    if len(contract.description) > DESCRIPTION_MAX_CHARS:
        raise InvalidRequest(
            f"description is {len(contract.description)} characters; the limit is {DESCRIPTION_MAX_CHARS}"
        )
    for name in ("input_schema", "output_schema"):
        schema = getattr(contract, name)
        if schema is not None:
            _check_schema(name, schema)
    if contract.input_schema is not None and contract.input_schema.get("type") != "object":
        raise InvalidRequest(
            'input_schema must say "type": "object" at its root: a capability takes a JSON object, '
            "as an MCP tool takes its arguments"
        )
    _check_examples(contract)


def json_size(name: str, value: Any) -> int:
    """How many bytes `value` takes as JSON. What not every database and client can store is
    refused: a number out of JSON's range (1e400 read as infinity), a NUL character."""
    try:
        text = json.dumps(value, allow_nan=False)
    except ValueError:
        raise InvalidRequest(f"{name} holds a number out of JSON's range") from None
    if ESCAPED_NUL.search(text):
        raise InvalidRequest(f"{name} holds a NUL character (\\u0000)")
    return len(text)


def _check_schema(name: str, schema: Any) -> None:
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{name} must be a JSON Schema object (draft 2020-12)")
    if json_size(name, schema) > SCHEMA_MAX_BYTES:
        raise InvalidRequest(f"{name} is over {SCHEMA_MAX_BYTES} bytes of JSON")
    declared = schema.get("$schema")
    if declared is not None and declared.rstrip("#") != Draft202012Validator.META_SCHEMA["$id"].rstrip("#"):
        raise InvalidRequest(f"{name} must be JSON Schema draft 2020-12; its $schema says {declared!r}")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequest(f"{name} is not a valid JSON Schema (draft 2020-12): {_where(exc)}{exc.message}") from None
    _check_refs(name, schema)
    if schema_problem(schema, {}) == ENDLESS:
        raise InvalidRequest(f"{name}: {ENDLESS}")


def _check_refs(name: str, schema: dict) -> None:
    """Every `$ref` points within the schema (`#...`) and resolves there: a ref that cannot
    resolve must fail at deploy, not on the first call."""
    resolver = Registry().with_resource(SCHEMA_URI, DRAFT202012.create_resource(schema)).resolver(SCHEMA_URI)
    pending: list[Any] = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                if not ref.startswith("#"):
                    raise InvalidRequest(f"{name}: $ref {ref!r} points outside the schema; only #... refs are allowed")
                try:
                    resolver.lookup(ref)
                except Unresolvable:
                    raise InvalidRequest(f"{name}: $ref {ref!r} does not resolve within the schema") from None
            pending.extend(value for key, value in node.items() if key not in INSTANCE_KEYWORDS)


def _check_examples(contract: Contract) -> None:
    examples = contract.examples
    if not isinstance(examples, list):
        raise InvalidRequest("examples must be a list of {input, output} objects")
    if len(examples) > EXAMPLES_MAX:
        raise InvalidRequest(f"examples holds {len(examples)} entries; the limit is {EXAMPLES_MAX}")
    for index, example in enumerate(examples):
        label = f"examples[{index}]"
        if not isinstance(example, dict) or not set(example) <= {"input", "output", "description"} or not example:
            raise InvalidRequest(f"{label} must be an object with input, output and optionally description")
        if json_size(label, example) > EXAMPLE_MAX_BYTES:
            raise InvalidRequest(f"{label} is over {EXAMPLE_MAX_BYTES} bytes of JSON")
        if not isinstance(example.get("description", ""), str):
            raise InvalidRequest(f"{label}.description must be a string")
        for part, schema in (("input", contract.input_schema), ("output", contract.output_schema)):
            if part in example and schema is not None:
                problem = schema_problem(schema, example[part])
                if problem is not None:
                    raise InvalidRequest(f"{label}.{part} does not match {part}_schema: {problem}")


_validators: dict[str, Draft202012Validator] = {}
# The same schema object again (a contract copy's, a constant) finds its validator without
# serialising the schema: its identity, checked against the object itself.
_by_identity: dict[int, tuple[dict, Draft202012Validator]] = {}


def validator_for(schema: dict) -> Draft202012Validator:
    """A compiled validator for `schema`, kept per process (compiling costs far more than
    validating); refs resolve only within the schema (an empty registry)."""
    known = _by_identity.get(id(schema))
    if known is not None and known[0] is schema:
        return known[1]
    key = json.dumps(schema, sort_keys=True)
    validator = _validators.get(key)
    if validator is None:
        if len(_validators) > 2000:
            _validators.clear()
            _by_identity.clear()
        validator = _validators[key] = Draft202012Validator(schema, registry=Registry())
    if len(_by_identity) > 2000:
        _by_identity.clear()
    _by_identity[id(schema)] = (schema, validator)
    return validator


def schema_problem(schema: dict, instance: Any) -> str | None:
    """Why `instance` breaks `schema`, in one line; None when it matches."""
    try:
        validator = validator_for(schema)
        if validator.is_valid(instance):
            return None
        error = best_match(validator.iter_errors(instance))
    except Unresolvable as exc:
        return f"the schema has a $ref that does not resolve: {exc}"
    except RecursionError:
        return ENDLESS
    if error is None:
        return None
    return f"{_where(error)}{error.message}"


def _where(error: ValidationError | SchemaError) -> str:
    path = "".join(f"[{part!r}]" if isinstance(part, int) else f".{part}" for part in error.absolute_path)
    return f"at {path.lstrip('.')}: " if path else ""
