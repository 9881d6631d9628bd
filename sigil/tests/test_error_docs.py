"""The error catalogue has one home, the classes of sigil/errors.py: docs/errors.md and the
OpenAPI document's error responses are written from them."""

from sigil import error_docs
from sigil.errors import InvalidRequest, NotFound, RateLimited, SigilError, error_kinds


def test_docs_errors_md_is_what_the_error_classes_write():
    # After changing an error class: python -m sigil.error_docs
    assert error_docs.PAGE.read_text() == error_docs.markdown_table()


def test_every_row_of_the_catalogue_has_its_meaning_and_an_example():
    kinds = error_kinds()
    assert SigilError not in kinds
    for kind in kinds:
        assert kind.meaning and kind.example, kind.__name__
    codes = {kind.code for kind in kinds}
    assert {"invalid_request", "unauthenticated", "not_found", "rate_limited", "internal_error"} <= codes


def test_an_operations_error_responses_hold_an_example_of_each_code_by_status():
    responses = error_docs.openapi_error_responses(NotFound, InvalidRequest, RateLimited)
    assert list(responses) == ["400", "404", "429"]
    examples = responses["429"]["content"]["application/json"]["examples"]
    assert examples == {"rate_limited": {"value": {"error": {"code": "rate_limited", "message": RateLimited.example}}}}
    assert "(with Retry-After)" in responses["429"]["description"]
