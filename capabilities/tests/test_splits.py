"""Staged versions and traffic splits, over HTTP, on the local runtime and on the worker-pool
runtime under the Cloudflare emulator (with a real Celery worker): a staged version serves
nobody until a split sends callers to it, each caller always reaches one version, the shares
follow the weight, promote and abort end the split, and the guard aborts a failing version."""

from collections import Counter, defaultdict

import pytest

from agents import services as agent_services
from agents.models import Agent, AuditEvent
from capabilities.books import pager
from capabilities.models import Capability
from capabilities.runtimes.worker_pool import pool_script_name
from capabilities.tests.test_lifecycle import subscribe, verify
from capabilities.tests.test_pager_books import book_problems, settled
from testsupport.capability_code import answering as code
from testsupport.cast import deploy_answering as deploy
from testsupport.cast import flush_stats_when_recorded, wait_for

THROWS = "export default { async fetch() { throw new Error('v2 is broken') } }"
VARIANT = "alice--ping--v2"


@pytest.fixture(params=["local", "worker-pool"])
def runtime(request, alice):
    """Each test runs on the local runtime, and on the worker pool (3 slots) under the emulator.
    A Celery worker runs on both: it records breaker changes, the guard's abort, stats."""
    request.getfixturevalue("celery_worker")
    if request.param == "worker-pool":
        request.getfixturevalue("worker_pool")
        request.getfixturevalue("cf_client")  # it empties Redis when first made: before any call
    return request.param


@pytest.fixture
def scripts_on_cloudflare(request):
    """The emulated account's script names (worker-pool tests only)."""
    return lambda: sorted(script.id for script in request.getfixturevalue("cf_client").script_list())


def split(agent, full="alice--ping", **body):
    return agent.session.put(
        f"{agent.base_url}/_api/capabilities/{full}/split", json=body, headers=agent.headers(agent.deploy_token)
    )


def end(agent, how, full="alice--ping"):
    return agent.session.post(
        f"{agent.base_url}/_api/capabilities/{full}/split/{how}", headers=agent.headers(agent.deploy_token)
    )


def inspect(agent, full="alice--ping"):
    return agent.call(f"/_api/capabilities/{full}").json()


def stage(agent, text, name="ping", **body):
    return deploy(agent, name, text, stage=True, **body)


def answers_by_caller(agent, callers, rounds=3):
    """Call `rounds` times as each caller (an X-User value); return caller → answers seen."""
    seen = defaultdict(set)
    for _ in range(rounds):
        for caller in callers:
            response = agent.call("/alice/ping", headers={"X-User": caller})
            assert response.status_code == 200, response.text
            assert response.headers["X-Sigil-Capability"] == "alice--ping"
            # The version that answered says so, and is the one whose code answered.
            seen[caller].add((response.headers["X-Sigil-Version"], response.text))
    return seen


def actions(subject="alice--ping"):
    return list(AuditEvent.objects.filter(subject=subject).order_by("id").values_list("action", flat=True))


def test_a_staged_version_is_kept_aside_until_a_split_sends_callers_to_it(runtime, alice):
    deploy(alice, "ping", "one")
    staged = stage(alice, "two")
    assert staged == {**staged, "version": 2, "staged": True, "cold_start": False}
    assert stage(alice, "two") == staged  # the same code again changes nothing

    response = alice.call("/alice/ping")
    assert (response.text, response.headers["X-Sigil-Version"]) == ("one", "1")
    detail = inspect(alice)
    assert detail == {**detail, "version": 1, "staged_version": 2, "split": None}
    assert not Capability.objects.filter(full_name=VARIANT).exists()  # nothing placed for it yet
    assert actions()[-1] == "capability.staged"


def test_a_90_10_split_keeps_each_caller_on_one_version_and_follows_the_weight(runtime, alice):
    deploy(alice, "ping", "one", type="normal")
    stage(alice, "two", type="normal")
    response = split(alice, weight=10, caller_header="X-User")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body == {**body, "caller_header": "X-User", "guard": None}
    assert (body["current"]["version"], body["current"]["weight"]) == (1, 90)
    assert (body["staged"]["version"], body["staged"]["weight"]) == (2, 10)

    callers = [f"user-{i}" for i in range(100)]
    seen = answers_by_caller(alice, callers)  # 300 calls
    assert all(len(answers) == 1 for answers in seen.values()), "a caller reached both versions"
    shares = Counter(next(iter(answers)) for answers in seen.values())
    assert set(shares) == {("1", "one"), ("2", "two")}
    assert 4 <= shares[("2", "two")] <= 18, shares  # 10 of 100 callers, give or take the hash

    # Placed like any capability, in its own slot.
    variant = Capability.objects.get(full_name=VARIANT)
    assert variant.state == "live" and variant.variant_of.full_name == "alice--ping"
    if runtime == "worker-pool":
        assert variant.slot == pool_script_name(VARIANT)
        assert VARIANT in pager.pager_locations()
        assert alice.call("/_api/status").json()["used_slots"] == 2
    # Never listed to agents.
    listed = [c["capability"] for c in alice.call("/_api/capabilities").json()["results"]]
    assert listed == ["alice--ping"]

    # Changed at any time: a caller on the staged version stays there as its share grows.
    on_staged = {caller for caller, answers in seen.items() if ("2", "two") in answers}
    assert split(alice, weight=50, caller_header="X-User").status_code == 200
    wider = answers_by_caller(alice, callers, rounds=1)
    assert all(("2", "two") in wider[caller] for caller in on_staged)
    assert 30 <= sum(("2", "two") in answers for answers in wider.values()) <= 70
    assert actions()[-2:] == ["capability.split_started", "capability.split_changed"]


def test_without_a_header_each_invoke_token_is_one_caller(runtime, alice):
    deploy(alice, "ping", "one")
    stage(alice, "two")
    assert split(alice, weight=50).status_code == 200
    agent = Agent.objects.get(name="alice")
    tokens = [agent_services.token_issue(agent=agent, scope="invoke", actor="owner:test")[1] for _ in range(12)]
    versions = defaultdict(set)
    for _ in range(3):
        for token in tokens:
            # The header names no caller key here: the token decides.
            versions[token].add(alice.call("/alice/ping", token=token, headers={"X-User": "x"}).text)
    assert all(len(seen) == 1 for seen in versions.values())
    assert {next(iter(seen)) for seen in versions.values()} == {"one", "two"}


def test_promote_makes_the_staged_version_current_and_ends_the_split(runtime, alice, scripts_on_cloudflare):
    deploy(alice, "ping", "one")
    stage(alice, "two")
    assert split(alice, weight=10, caller_header="X-User").status_code == 200

    response = end(alice, "promote")
    assert response.status_code == 200, response.text
    assert response.json() == {**response.json(), "version": 2, "staged_version": None, "split": None}
    seen = answers_by_caller(alice, [f"user-{i}" for i in range(30)], rounds=1)
    assert {answer for answers in seen.values() for answer in answers} == {("2", "two")}
    wait_for(lambda: Capability.objects.get(full_name=VARIANT).state == "removed", message="the variant retired")
    if runtime == "worker-pool":
        wait_for(settled, message="the pager to settle")
        wait_for(lambda: pool_script_name(VARIANT) not in scripts_on_cloudflare(), message="its script gone")
        assert book_problems(scripts_on_cloudflare) == []
    assert end(alice, "promote").status_code == 409  # nothing staged any more
    assert actions()[-3:] == ["capability.staged", "capability.split_started", "capability.promoted"]
    event = AuditEvent.objects.get(subject="alice--ping", action="capability.promoted")
    assert (event.actor, event.detail) == ("agent:alice", {"version": 2, "previous_version": 1})


def test_a_staged_version_older_than_the_current_one_is_not_promoted(alice, celery_worker):
    deploy(alice, "ping", "one")
    stage(alice, "two")
    assert split(alice, weight=50, caller_header="X-User").status_code == 200
    deploy(alice, "ping", "three")  # v3, deployed while v2 is staged

    refused = end(alice, "promote")
    assert refused.status_code == 409, refused.text
    assert "v3 was deployed after v2 was staged" in refused.json()["error"]["message"]
    assert inspect(alice)["version"] == 3 and inspect(alice)["staged_version"] == 2  # nothing changed
    assert end(alice, "abort").status_code == 200
    restaged = stage(alice, "two")
    assert restaged["version"] == 4 and restaged["staged"] is True
    assert end(alice, "promote").status_code == 200
    assert alice.call("/alice/ping").headers["X-Sigil-Version"] == "4"


def test_abort_sends_every_caller_back_and_keeps_the_version_in_history(runtime, alice, scripts_on_cloudflare):
    deploy(alice, "ping", "one")
    stage(alice, "two")
    assert split(alice, weight=50, caller_header="X-User").status_code == 200

    response = end(alice, "abort")
    assert response.status_code == 200, response.text
    assert response.json() == {**response.json(), "version": 1, "staged_version": None, "split": None}
    seen = answers_by_caller(alice, [f"user-{i}" for i in range(30)], rounds=1)
    assert {answer for answers in seen.values() for answer in answers} == {("1", "one")}
    assert list(Capability.objects.get(full_name="alice--ping").versions.values_list("number", flat=True)) == [2, 1]
    wait_for(lambda: Capability.objects.get(full_name=VARIANT).state == "removed", message="the variant retired")
    if runtime == "worker-pool":
        wait_for(settled, message="the pager to settle")
        assert book_problems(scripts_on_cloudflare) == []
    event = AuditEvent.objects.get(subject="alice--ping", action="capability.split_aborted")
    assert (event.actor, event.detail) == ("agent:alice", {"staged_version": 2})


def test_each_version_has_its_own_stats_and_breaker(runtime, alice, settings):
    settings.SIGIL_BREAKER_THRESHOLD = 3
    deploy(alice, "ping", "one")
    alice.deploy(name="ping", code=THROWS, stage=True)
    assert split(alice, weight=50, caller_header="X-User").status_code == 200
    outcomes = Counter()
    for i in range(40):
        response = alice.call("/alice/ping", headers={"X-User": f"user-{i}"})
        outcomes[response.status_code] += 1
    # v2 throws: its breaker opens after three failures and stops only its callers.
    assert outcomes[200] >= 10 and outcomes[502] == 3 and outcomes[503] >= 1, outcomes
    assert Capability.objects.get(full_name=VARIANT).breaker_state == "open"
    assert Capability.objects.get(full_name="alice--ping").breaker_state == "closed"

    flush_stats_when_recorded(alice__ping=outcomes[200], alice__ping__v2=3)
    report = inspect(alice)["split"]
    assert report["current"]["stats"] == {
        **report["current"]["stats"],
        "calls": outcomes[200],
        "errors": 0,
        "breaker": "closed",
    }
    assert report["staged"]["stats"] == {**report["staged"]["stats"], "calls": 3, "errors": 3, "breaker": "open"}


def test_the_guard_aborts_a_failing_staged_version_and_tells_the_agent(
    runtime, alice, settings, webhook_receiver, request
):
    if runtime == "local":
        request.getfixturevalue("celery_worker")  # the webhook is delivered by Celery
    settings.SIGIL_BREAKER_THRESHOLD = 100  # the guard, not the breaker
    secret = subscribe("alice", webhook_receiver.url)
    deploy(alice, "ping", "one")
    alice.deploy(name="ping", code=THROWS, stage=True)
    guard = {"margin": 0.2, "min_calls": 5}
    assert split(alice, weight=50, caller_header="X-User", guard=guard).status_code == 200
    failed = sum(alice.call("/alice/ping", headers={"X-User": f"user-{i}"}).status_code == 502 for i in range(30))
    assert failed >= 5

    flush_stats_when_recorded(alice__ping=30 - failed, alice__ping__v2=failed)
    detail = inspect(alice)
    assert detail == {**detail, "version": 1, "staged_version": None, "split": None}
    assert {alice.call("/alice/ping", headers={"X-User": f"user-{i}"}).text for i in range(30)} == {"one"}
    event = AuditEvent.objects.get(subject="alice--ping", action="capability.split_aborted")
    assert event.actor == "system"
    assert event.detail == {
        "staged_version": 2,
        "reason": "guard",
        "staged_error_rate": 1.0,
        "current_error_rate": 0.0,
        "staged_calls": failed,
        "margin": 0.2,
    }

    def guard_delivery():
        # The staged version's own error-rate alert may come too.
        return next((d for d in webhook_receiver.received if d[0]["x-sigil-event"] == "capability.split_aborted"), None)

    headers, body = wait_for(guard_delivery, message="the guard's webhook")
    delivery = verify(secret, headers, body)
    assert delivery == {**delivery, "capability": "alice--ping", "staged_version": 2, "staged_error_rate": 1.0}


def test_the_guard_aborts_an_always_failing_staged_version_once_its_breaker_refusals_reach_the_least_calls(
    runtime, alice, settings
):
    settings.SIGIL_BREAKER_THRESHOLD = 3  # the staged version's breaker opens long before the guard's least calls
    deploy(alice, "ping", "one")
    alice.deploy(name="ping", code=THROWS, stage=True)
    assert split(alice, weight=100, guard={"margin": 0.5, "min_calls": 10}).status_code == 200

    answers = []

    def split_ended():
        answers.append(alice.call("/alice/ping").status_code)
        return inspect(alice)["split"] is None

    wait_for(split_ended, timeout=30, interval=0.1, message="the guard's abort")
    staged = answers[: answers.index(200)] if 200 in answers else answers
    assert set(staged) == {502, 503}  # its errors, then its breaker's refusals
    assert staged.count(503) >= 10 - 3
    event = AuditEvent.objects.get(subject="alice--ping", action="capability.split_aborted")
    assert event.detail == {
        **event.detail,
        "reason": "guard",
        "staged_error_rate": 1.0,
        "current_error_rate": 0.0,
        "margin": 0.5,
    }
    assert 10 <= event.detail["staged_calls"] <= len(staged) and event.detail["staged_refused"] > 0
    assert {alice.call("/alice/ping").text for _ in range(5)} == {"one"}


@pytest.mark.parametrize(
    ("staged", "current", "tripped"),
    [
        ((9, 9), (100, 0), False),  # below the least answers, however bad
        ((10, 10), (100, 0), True),  # every answer failed (errors and refusals alike)
        ((10, 5), (100, 0), False),  # half: within the margin of 0.5
        ((10, 6), (100, 0), True),
        ((10, 10), (100, 60), False),  # the current version fails nearly as much
        ((10, 10), (0, 0), True),  # no calls to the current version: its rate counts as 0
    ],
)
def test_the_guard_rule(staged, current, tripped):
    from capabilities.services.splits import GuardFigures, guard_trips

    figures = GuardFigures(
        staged_answers=staged[0], staged_failed=staged[1], current_calls=current[0], current_errors=current[1]
    )
    assert guard_trips(figures, margin=0.5, min_calls=10) is tripped


def test_the_guard_leaves_a_split_alone_below_its_least_calls(alice, settings):
    settings.SIGIL_BREAKER_THRESHOLD = 100
    deploy(alice, "ping", "one")
    alice.deploy(name="ping", code=THROWS, stage=True)
    assert split(alice, weight=50, caller_header="X-User", guard={"margin": 0.2, "min_calls": 1000}).status_code == 200
    failed = sum(alice.call("/alice/ping", headers={"X-User": f"user-{i}"}).status_code == 502 for i in range(20))
    flush_stats_when_recorded(alice__ping=20 - failed, alice__ping__v2=failed)
    assert inspect(alice)["split"]["guard"] == {"margin": 0.2, "min_calls": 1000}


def test_a_staged_version_whose_code_does_not_start_never_enters_traffic(alice):
    deploy(alice, "ping", "one")
    assert alice.deploy(name="ping", code="throw new Error('no'); export default {}", stage=True).status_code == 200
    response = split(alice, weight=10)
    assert response.status_code == 400 and "the runtime refused the script" in response.json()["error"]["message"]
    assert inspect(alice)["split"] is None
    assert not Capability.objects.filter(full_name=VARIANT).exists()
    assert {alice.call("/alice/ping").text for _ in range(5)} == {"one"}


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"weight": 101}, 400, "weight"),
        ({"weight": "10"}, 400, "weight"),
        ({"weight": 10, "caller_header": "Authorization"}, 400, "caller_header"),
        ({"weight": 10, "caller_header": "X User"}, 400, "caller_header"),
        ({"weight": 10, "guard": {"margin": 0}}, 400, "margin"),
        ({"weight": 10, "shares": 3}, 400, "shares"),
    ],
)
def test_bad_split_input_is_refused_in_the_envelope(alice, body, status, words):
    deploy(alice, "ping", "one")
    stage(alice, "two")
    response = split(alice, **body)
    assert response.status_code == status
    assert response.json()["error"]["code"] == "invalid_request" and words in response.json()["error"]["message"]


def test_splits_are_their_owners_alone(alice, bob):
    deploy(alice, "ping", "one")
    assert split(alice, weight=10).status_code == 409  # nothing staged
    stage(alice, "two")
    assert split(bob, weight=10).status_code == 404  # private: bob may not know it exists
    deploy(alice, "open", "one", public=True)
    deploy(alice, "open", "two", public=True, stage=True)
    assert split(bob, "alice--open", weight=10).status_code == 403
    assert end(bob, "promote", "alice--open").status_code == 403
    url = f"{alice.base_url}/_api/capabilities/alice--ping/split"
    invoke_only = alice.session.put(url, json={"weight": 10}, headers=alice.headers(alice.invoke_token))
    assert invoke_only.status_code == 403
    assert alice.deploy(name=None, code=code("e"), stage=True).status_code == 400  # ephemerals: not staged
    assert alice.deploy(name="nothing-yet", code=code("x"), stage=True).status_code == 404


def test_removing_a_capability_retires_its_staged_version_in_traffic(runtime, alice):
    deploy(alice, "ping", "one")
    stage(alice, "two")
    assert split(alice, weight=50).status_code == 200
    assert (
        alice.session.delete(
            f"{alice.base_url}/_api/capabilities/alice--ping", headers=alice.headers(alice.deploy_token)
        ).status_code
        == 204
    )
    assert Capability.objects.get(full_name=VARIANT).state == "removed"
    assert alice.call("/alice/ping").status_code == 404


@pytest.fixture
def owner_client(sigil, client):
    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.create_superuser("owner", "owner@example.invalid", "pw"))
    return client


def test_the_owner_splits_promotes_and_aborts_from_the_admin_after_confirming(owner_client, alice):
    deploy(alice, "ping", "one")
    stage(alice, "two")
    capability = Capability.objects.get(full_name="alice--ping")
    page = f"/admin/capabilities/capability/{capability.pk}"
    assert "v2 is staged, not in traffic" in owner_client.get(f"{page}/change/").content.decode()

    confirm = owner_client.get(f"{page}/split/set/")
    assert confirm.status_code == 200 and 'id="split-confirm"' in confirm.content.decode()
    assert alice.call("/alice/ping", headers={"X-User": "u"}).text == "one"  # asking changed nothing
    done = owner_client.post(
        f"{page}/split/set/", {"weight": 100, "caller_header": "X-User", "guard_margin": "0.3"}, follow=True
    )
    assert "the split is set" in done.content.decode()
    body = owner_client.get(f"{page}/change/").content.decode()
    assert 'id="split"' in body and "callers keyed by X-User" in body and "abort past 30 points over 20 calls" in body
    assert alice.call("/alice/ping", headers={"X-User": "u"}).text == "two"
    assert Capability.objects.get(full_name="alice--ping").split_guard_min_calls == 20

    assert "Every call will go to v1 again" in owner_client.get(f"{page}/split/abort/").content.decode()
    owner_client.post(f"{page}/split/abort/")
    assert alice.call("/alice/ping", headers={"X-User": "u"}).text == "one"

    stage(alice, "three")
    owner_client.post(f"{page}/split/promote/")
    assert alice.call("/alice/ping").headers["X-Sigil-Version"] == "3"
    trail = AuditEvent.objects.filter(subject="alice--ping", actor="owner:owner").values_list("action", flat=True)
    assert list(trail.order_by("id")) == ["capability.split_started", "capability.split_aborted", "capability.promoted"]
    # The staged version's own placement is shown on its capability's page, not listed apart.
    assert VARIANT not in owner_client.get("/admin/capabilities/capability/").content.decode()


def test_the_owner_finds_a_degraded_staged_version_on_its_capabilitys_page_and_resets_it(
    owner_client, alice, settings, celery_worker
):
    settings.SIGIL_BREAKER_THRESHOLD = 1
    deploy(alice, "ping", "one")
    alice.deploy(name="ping", code=THROWS, stage=True)
    assert split(alice, weight=100).status_code == 200
    assert alice.call("/alice/ping").status_code == 502
    wait_for(lambda: Capability.objects.get(full_name=VARIANT).breaker_state == "open", message="v2's breaker open")
    assert alice.call("/alice/ping").status_code == 503

    # The index lists the staged version by its own name, linked to its capability's page.
    page = f"/admin/capabilities/capability/{Capability.objects.get(full_name='alice--ping').pk}/change/"
    index = owner_client.get("/admin/").content.decode()
    assert f'href="{page}">{VARIANT}</a>' in index
    body = owner_client.get(page).content.decode()
    reset = body.split('id="split-reset-breaker"')[0].rsplit('href="', 1)[1].split('"')[0]
    assert "Reset the breaker" in owner_client.get(reset).content.decode()  # asked first
    assert alice.call("/alice/ping").status_code == 503
    assert owner_client.post(reset)["Location"] == page
    assert Capability.objects.get(full_name=VARIANT).breaker_state == "closed"
    assert 'id="split-reset-breaker"' not in owner_client.get(page).content.decode()
    assert alice.call("/alice/ping").status_code == 502  # v2 runs again (and fails again)


def test_on_the_pool_a_staged_version_in_traffic_pages_out_and_in_like_any_capability(
    worker_pool, celery_worker, cf_client, alice
):
    deploy(alice, "ping", "one", type="normal")
    stage(alice, "two", type="normal")
    assert split(alice, weight=100).status_code == 200  # every caller on v2: v1 is left idle
    assert alice.call("/alice/ping").text == "two"
    for name in ("a", "b", "c"):  # three slots: ping, then the variant, are the least recently used
        deploy(alice, name, name, type="normal")
    wait_for(lambda: Capability.objects.get(full_name=VARIANT).state == "paged_out", message="the variant paged out")
    assert pool_script_name(VARIANT) not in [s.id for s in cf_client.script_list()]

    response = alice.call("/alice/ping")
    assert (response.text, response.headers["X-Sigil-Version"], response.headers["X-Sigil-Cold-Start"]) == (
        "two",
        "2",
        "1",
    )
    wait_for(settled, message="the pager to settle")
    assert book_problems(lambda: sorted(s.id for s in cf_client.script_list())) == []
    assert AuditEvent.objects.filter(subject=VARIANT, action="capability.evicted").exists()


def test_warm_calls_to_either_version_run_no_sql(alice):
    import contextlib

    from testsupport.engine_calls import answers, call_request, sql_counted

    deploy(alice, "ping", "one")
    stage(alice, "two")
    assert split(alice, weight=50, caller_header="X-User").status_code == 200
    callers = [f"user-{i}" for i in range(20)]
    batch = [call_request(alice, "/alice/ping", headers={"x-user": caller}) for caller in callers]
    queries: list[str] = []
    counting = contextlib.ExitStack()
    # The first batch fills the token and route caches; the second is counted.
    first, again = answers(batch, batch, between=lambda _: counting.enter_context(sql_counted(queries)))
    counting.close()
    versions = [(headers["X-Sigil-Version"], body) for _, headers, body in first]
    assert set(versions) == {("1", b"one"), ("2", b"two")}
    assert [(headers["X-Sigil-Version"], body) for _, headers, body in again] == versions
    assert queries == [], queries
