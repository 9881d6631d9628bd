"""The owner sees each capability's contract in the admin, searches the catalogue there, and
sees a new contract as a change between versions."""

from capabilities.models import Capability
from capabilities.tests.test_admin import owner_client  # noqa: F401 (a fixture)
from capabilities.tests.test_contracts import ADD_CONTRACT
from testsupport.capability_code import PONG


def test_the_capability_page_shows_the_contract_escaped(owner_client, alice):  # noqa: F811
    alice.deploy(name="add", code=PONG, **{**ADD_CONTRACT, "description": "Adds <b>two</b> numbers."})
    capability = Capability.objects.get(full_name="alice--add")
    body = owner_client.get(f"/admin/capabilities/capability/{capability.pk}/change/").content.decode()
    assert '<pre class="contract">' in body
    assert "Adds &lt;b&gt;two&lt;/b&gt; numbers." in body
    assert "input_schema:" in body and "&quot;required&quot;: [" in body and "examples:" in body


def test_the_catalogue_is_searchable_by_description(owner_client, alice, bob):  # noqa: F811
    alice.deploy(name="add", code=PONG, description="Adds two numbers.")
    bob.deploy(name="weather", code=PONG, description="Tells the weather.")
    body = owner_client.get("/admin/capabilities/capability/?q=numbers").content.decode()
    assert "alice--add" in body and "bob--weather" not in body


def test_the_version_view_diffs_the_contract(owner_client, alice):  # noqa: F811
    alice.deploy(name="add", code=PONG, description="Adds two numbers.")
    alice.deploy(name="add", code=PONG, description="Adds two numbers, or more.")
    capability = Capability.objects.get(full_name="alice--add")
    body = owner_client.get(f"/admin/capabilities/capability/{capability.pk}/versions/2/").content.decode()
    assert '<span class="del">-Adds two numbers.</span>' in body
    assert '<span class="add">+Adds two numbers, or more.</span>' in body
    assert "Same code as v1." in body
