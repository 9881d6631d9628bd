"""The Cloudflare API's rate budget by class of work, against the real (test) Redis: which class
gets room in a window filled so far, how long until each class has room, housekeeping's own
share, and the pause after Cloudflare's 429. Table-driven: each row is a window, as the ages of
the requests in it, and what each class finds there."""

from __future__ import annotations

import time

import pytest

from capabilities.runtimes.api_work import ApiClass, api_work
from capabilities.runtimes.cloudflare.budget import RateBudget
from capabilities.runtimes.cloudflare.errors import CloudflareRateLimited
from sigil import redis_keys

PAGE_IN, DEPLOY, PAGE_OUT, HOUSEKEEPING = ApiClass.PAGE_IN, ApiClass.DEPLOY, ApiClass.PAGE_OUT, ApiClass.HOUSEKEEPING
# 20 requests per 100 s: a page-in may fill all 20, a deploy 19, a page-out 17, housekeeping 12,
# and housekeeping's own requests are at most 4 of the window (a share of 0.2).
LIMIT, WINDOW = 20, 100.0


def budget_on(redis_client, *, max_wait: float = 0.0) -> RateBudget:
    return RateBudget(
        redis=redis_client,
        keys=redis_keys.budget("test-budget"),
        limit=LIMIT,
        window_seconds=WINDOW,
        max_wait_seconds=max_wait,
    )


def redis_now_ms(redis_client) -> int:
    seconds, microseconds = redis_client.time()
    return seconds * 1000 + microseconds // 1000


def window_of(redis_client, budget: RateBudget, ages: list[float], *, housekeeping: int = 0) -> None:
    """Requests in the window made `ages` seconds ago; the `housekeeping` youngest of them
    housekeeping's own."""
    now = redis_now_ms(redis_client)
    for i, age in enumerate(sorted(ages, reverse=True)):
        member, score = f"made-{i}", now - int(age * 1000)
        redis_client.zadd(budget.key, {member: score})
        if i >= len(ages) - housekeeping:
            redis_client.zadd(budget.housekeeping_key, {member: score})


def room_in(budget: RateBudget, api_class: ApiClass) -> float:
    """Seconds until `api_class` has room: 0 when it took some now, else what the refusal says."""
    try:
        budget.acquire(api_class)
    except CloudflareRateLimited as refused:
        return refused.retry_after
    return 0.0


def ages(count: int, *, oldest: float) -> list[float]:
    """`count` requests a second apart, the oldest `oldest` s ago."""
    return [oldest - i for i in range(count)]


# (what the window holds, how many of them housekeeping's, the seconds until each class has room)
WINDOWS = [
    pytest.param([], 0, {PAGE_IN: 0, DEPLOY: 0, PAGE_OUT: 0, HOUSEKEEPING: 0}, id="empty"),
    # Full: each class waits until enough have left for its own ceiling, not for the oldest alone.
    pytest.param(ages(20, oldest=90), 0, {PAGE_IN: 10, DEPLOY: 11, PAGE_OUT: 13, HOUSEKEEPING: 18}, id="full"),
    # 19 made: only a page-in has room; the others wait as above, one request fewer to leave.
    pytest.param(ages(19, oldest=90), 0, {PAGE_IN: 0, DEPLOY: 10, PAGE_OUT: 12, HOUSEKEEPING: 17}, id="19-of-20"),
    # 12 made: housekeeping has reached its ceiling; the work above it has room.
    pytest.param(ages(12, oldest=50), 0, {PAGE_IN: 0, DEPLOY: 0, PAGE_OUT: 0, HOUSEKEEPING: 50}, id="12-of-20"),
    # 6 made, 4 of them housekeeping's (made 45 to 42 s ago): its own share is spent until the
    # oldest of those leaves, though the window has room.
    pytest.param(ages(6, oldest=47), 4, {PAGE_IN: 0, DEPLOY: 0, PAGE_OUT: 0, HOUSEKEEPING: 55}, id="share-spent"),
]


@pytest.mark.parametrize(("window", "housekeeping", "expected"), WINDOWS)
@pytest.mark.parametrize("api_class", list(ApiClass), ids=lambda c: c.value)
def test_each_class_has_room_when_the_window_under_its_ceiling_says_so(
    redis_client, window, housekeeping, expected, api_class
):
    budget = budget_on(redis_client)
    window_of(redis_client, budget, window, housekeeping=housekeeping)
    assert room_in(budget, api_class) == pytest.approx(expected[api_class], abs=0.25)


def test_a_window_full_to_housekeepings_ceiling_refuses_it_while_a_page_in_gets_room(redis_client):
    budget = budget_on(redis_client)
    for _ in range(12):
        budget.acquire(DEPLOY)
    assert room_in(budget, HOUSEKEEPING) > 0
    for _ in range(5):
        budget.acquire(PAGE_OUT)
    assert room_in(budget, PAGE_OUT) > 0
    budget.acquire(DEPLOY)
    budget.acquire(DEPLOY)
    assert room_in(budget, DEPLOY) > 0
    budget.acquire(PAGE_IN)  # the last of the window is a page-in's
    assert redis_client.zcard(budget.key) == LIMIT
    assert room_in(budget, PAGE_IN) > 0


def test_housekeeping_never_takes_more_than_its_share_of_an_idle_window(redis_client):
    budget = budget_on(redis_client)
    taken = 0
    while room_in(budget, HOUSEKEEPING) == 0:
        taken += 1
    assert taken == budget.own_cap(HOUSEKEEPING) == 4  # 0.2 of 20
    # The rest of the window is still there for the work above it.
    for _ in range(LIMIT - taken):
        budget.acquire(PAGE_IN)
    assert redis_client.zcard(budget.key) == LIMIT and redis_client.zcard(budget.housekeeping_key) == 4


def test_a_settled_request_counts_from_when_it_ended_in_housekeepings_share_too(redis_client):
    budget = budget_on(redis_client)
    ticket = budget.acquire(HOUSEKEEPING)
    stamped = redis_client.zscore(budget.housekeeping_key, ticket)
    time.sleep(0.05)
    budget.settle(ticket)
    assert redis_client.zscore(budget.housekeeping_key, ticket) > stamped
    assert redis_client.zscore(budget.key, ticket) == redis_client.zscore(budget.housekeeping_key, ticket)


@pytest.mark.parametrize("api_class", list(ApiClass), ids=lambda c: c.value)
def test_the_pause_after_a_429_answers_every_class_at_once_with_its_time(redis_client, api_class):
    budget = budget_on(redis_client, max_wait=10)
    budget.pause(30)
    started = time.monotonic()
    with pytest.raises(CloudflareRateLimited) as refused:
        budget.acquire(api_class)
    assert time.monotonic() - started < 0.2  # no sleep towards a room that is 30 s away
    assert 29 < refused.value.retry_after <= 30


def test_a_pause_within_the_allowed_wait_is_waited_out(redis_client):
    budget = budget_on(redis_client, max_wait=5)
    budget.pause(0.3)
    started = time.monotonic()
    budget.acquire(PAGE_IN)
    assert 0.29 <= time.monotonic() - started < 2


def test_room_further_than_the_work_may_wait_is_refused_at_once_in_one_sentence(redis_client):
    budget = budget_on(redis_client, max_wait=30)
    window_of(redis_client, budget, [10 - i / 2 for i in range(20)])  # room for a page-in in 90 s
    started = time.monotonic()
    with api_work(PAGE_IN, wait_seconds=12), pytest.raises(CloudflareRateLimited) as refused:
        budget.acquire()
    assert time.monotonic() - started < 0.2
    assert refused.value.why == ("Cloudflare's API budget has no room for 90 s, longer than this call may wait (12 s)")
    with pytest.raises(CloudflareRateLimited) as skipped:
        budget.acquire(HOUSEKEEPING)
    assert skipped.value.why.startswith("Cloudflare's API budget has no room for housekeeping for ")


def test_the_class_of_the_work_is_the_one_its_context_names(redis_client):
    budget = budget_on(redis_client)
    window_of(redis_client, budget, ages(12, oldest=50))
    with api_work(HOUSEKEEPING), pytest.raises(CloudflareRateLimited):
        budget.acquire()
    budget.acquire()  # nobody said: someone's request, a deploy's class
