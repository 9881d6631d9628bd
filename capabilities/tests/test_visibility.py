"""One visibility rule (capabilities/visibility.py): the same answer for a row in hand, a
query and a route."""

import pytest

from agents.models import Agent
from agents.tokens import Principal
from capabilities import selectors, visibility
from capabilities.books import routes
from capabilities.models import Capability


@pytest.mark.django_db
def test_an_agent_sees_its_own_and_public_capabilities_the_same_way_everywhere():
    alice, bob = Agent.objects.create(name="alice"), Agent.objects.create(name="bob")
    rows = [
        Capability.objects.create(
            agent=owner, name=name, full_name=f"{owner.name}--{name}", type="persistent", is_public=public
        )
        for owner in (alice, bob)
        for name, public in (("open", True), ("shut", False))
    ]
    caller = Principal(agent_id=alice.pk, agent_name="alice", scope="invoke", token_hash="")
    listed = set(selectors.capability_list_visible(principal=caller).values_list("full_name", flat=True))
    assert listed == {"alice--open", "alice--shut", "bob--open"}
    for capability in rows:
        seen = capability.full_name in listed
        assert visibility.capability_visible(capability, caller) is seen, capability.full_name
        route = routes.decode(routes.encode(capability))
        assert routes.route_visible(route, "alice") is seen, capability.full_name
    assert not routes.route_visible(None, "alice")
