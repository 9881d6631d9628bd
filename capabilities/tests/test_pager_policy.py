"""The pager's policy as plain Python, and the Lua that runs it in Redis checked against it,
table-driven and on randomized states, on a real Redis."""

import random

import pytest

from capabilities.books import pager
from capabilities.books.pager import Candidate, eviction_order, excess, victims_needed
from sigil import redis_keys

NOW = 1_800_000_000.0


def c(full, kind, last_access, expires=None):
    return Candidate(
        full=full, type=kind, last_access=NOW + last_access, expires=None if expires is None else NOW + expires
    )


# --- the policy alone ---------------------------------------------------------------------


def test_the_seed_order_expired_ephemerals_then_ephemerals_normals_persistents():
    candidates = [
        c("p-old", "persistent", -900),
        c("n-new", "normal", -10),
        c("n-old", "normal", -500),
        c("e-live", "ephemeral", -1, expires=+60),
        c("e-expired-late", "ephemeral", -1, expires=-5),
        c("e-expired-early", "ephemeral", -2, expires=-50),
    ]
    order = [x.full for x in eviction_order(candidates, now=NOW)]
    assert order == ["e-expired-early", "e-expired-late", "e-live", "n-old", "n-new", "p-old"]


def test_an_ephemeral_expiring_exactly_now_counts_as_expired():
    order = eviction_order([c("e-old", "ephemeral", -100, expires=+1), c("e-now", "ephemeral", 0, expires=0)], now=NOW)
    assert [x.full for x in order] == ["e-now", "e-old"]


def test_equal_access_times_go_by_name_as_redis_orders_them():
    order = eviction_order([c("b", "normal", -1), c("a", "normal", -1)], now=NOW)
    assert [x.full for x in order] == ["a", "b"]


@pytest.mark.parametrize(
    ("used", "leaving", "slots", "margin", "needed"),
    [
        (2, 0, 3, 2, 0),  # room: no victim
        (3, 0, 3, 2, 1),  # full: one victim, the newcomer in the margin meanwhile
        (3, 1, 3, 2, 1),  # one page-out under way: still room in the margin
        (3, 2, 3, 2, None),  # the margin is taken: wait for a delete
        (2, 3, 3, 2, None),  # removed scripts not yet deleted hold the margin too
        (4, 0, 3, 2, 2),  # the slots were lowered: shed the excess with the newcomer's victim
        (6, 0, 3, 2, None),  # far over: nothing is admitted until the excess is shed
    ],
)
def test_victims_needed_keeps_scripts_within_slots_and_margin(used, leaving, slots, margin, needed):
    assert victims_needed(used=used, leaving=leaving, slots=slots, margin=margin) == needed


def test_excess_is_what_is_placed_beyond_the_slots():
    assert excess(used=12, slots=10) == 2
    assert excess(used=9, slots=10) == 0


SEED = [c("c", "normal", -300), c("d", "normal", -200), c("e", "normal", -100)]
MIXED = [
    c("p-old", "persistent", -900),
    c("n-new", "normal", -10),
    c("n-old", "normal", -500),
    c("e-live", "ephemeral", -1, expires=+60),
    c("e-expired", "ephemeral", -2, expires=-50),
]


PREWARM_TABLE = [
    # (description, top, cold, candidates, used, slots, place, evict)
    (
        "the seeds' example: the top 3 placed, only what is outside it paged out",
        ["a", "b", "c"],
        {"a", "b"},
        SEED,
        3,
        3,
        ["a", "b"],
        ["d", "e"],
    ),
    ("free slots first: nothing paged out", ["a", "b"], {"a", "b"}, SEED, 3, 5, ["a", "b"], []),
    ("one slot free: one paged out for the second", ["a", "b"], {"a", "b"}, SEED, 3, 4, ["a", "b"], ["c"]),
    (
        "never one of the top for another: the hottest it can place, no more",
        ["a", "b", "c", "d"],
        {"a", "b"},
        SEED,
        3,
        3,
        ["a"],
        ["e"],
    ),
    ("every slot held by the top: nothing", ["c", "d", "e", "a"], {"a"}, SEED, 3, 3, [], []),
    ("the top placed already: nothing", ["c", "d"], set(), SEED, 3, 3, [], []),
    (
        "least valuable first, in the pager's own order",
        ["a", "b", "c", "d", "e"],
        {"a", "b", "c", "d", "e"},
        MIXED,
        5,
        5,
        ["a", "b", "c", "d", "e"],
        ["e-expired", "e-live", "n-old", "n-new", "p-old"],
    ),
    (
        "a top capability's class or age does not make it a victim",
        ["n-old", "a"],
        {"a"},
        MIXED,
        5,
        5,
        ["a"],
        ["e-expired"],
    ),
    (
        "capabilities being placed hold their slots and are no victims",
        ["a", "b"],
        {"a", "b"},
        [c("x", "normal", -1)],
        3,
        3,
        ["a"],
        ["x"],
    ),
    ("the slots were lowered: shedding comes first", ["a"], {"a"}, SEED, 4, 3, [], []),
]


@pytest.mark.parametrize(
    ("description", "top", "cold", "candidates", "used", "slots", "place", "evict"),
    PREWARM_TABLE,
    ids=[row[0] for row in PREWARM_TABLE],
)
def test_prewarm_places_the_top_n_into_free_slots_then_in_place_of_what_is_outside_it(
    description, top, cold, candidates, used, slots, place, evict
):
    plan = pager.prewarm_plan(top=top, cold=cold, candidates=candidates, used=used, slots=slots, now=NOW)
    assert (list(plan.place), list(plan.evict)) == (place, evict)


def test_pager_candidates_reads_back_what_the_sets_hold(redis_client):
    state = [c("e", "ephemeral", -1, expires=+60), c("n", "normal", -10), c("p", "persistent", -900)]
    load(redis_client, state)
    assert sorted(pager.pager_candidates(), key=lambda x: x.full) == state


# --- the Lua against the policy -------------------------------------------------------------


def load(redis, candidates, *, placing=(), evicting=()):
    """The pager's Redis state holding `candidates` served, and the names given placing/evicting."""
    pipe = redis.pipeline()
    for x in candidates:
        pipe.zadd(redis_keys.lru(x.type), {x.full: x.last_access})
        if x.expires is not None:
            pipe.zadd(redis_keys.LRU_EXPIRY, {x.full: x.expires})
    for name in placing:
        pipe.zadd(redis_keys.LRU_PLACING, {name: NOW})
    for name in evicting:
        pipe.zadd(redis_keys.LRU_EVICTING, {name: NOW})
    pipe.set(redis_keys.LRU_BUILT, 1)  # built: no registry to read
    pipe.execute()


def expected_claim(candidates, *, placing, evicting, newcomer, slots, margin, now):
    """What the policy says a claim for `newcomer` (not yet counted) does."""
    leaving = len(evicting) - (newcomer in evicting)
    needed = victims_needed(used=len(candidates) + len(placing), leaving=leaving, slots=slots, margin=margin)
    if needed is None or needed > len(candidates):
        return "full", []
    return ("rescued" if newcomer in evicting else "claimed"), [
        x.full for x in eviction_order(candidates, now=now)[:needed]
    ]


CLAIM_TABLE = [
    # (description, candidates, placing, evicting, slots, margin)
    ("room left", [c("a", "normal", -5)], [], [], 3, 2),
    (
        "full: the least recently used normal",
        [c("a", "normal", -5), c("b", "normal", -9), c("p", "persistent", -99)],
        [],
        [],
        3,
        2,
    ),
    (
        "an expired ephemeral before an older normal",
        [c("n", "normal", -99), c("e", "ephemeral", -1, expires=-1), c("p", "persistent", -5)],
        [],
        [],
        3,
        2,
    ),
    (
        "a live ephemeral before a normal",
        [c("n", "normal", -99), c("e", "ephemeral", -1, expires=+99), c("p", "persistent", -5)],
        [],
        [],
        3,
        2,
    ),
    (
        "persistents only when nothing else",
        [c("p1", "persistent", -1), c("p2", "persistent", -2), c("p3", "persistent", -3)],
        [],
        [],
        3,
        2,
    ),
    (
        "a capability being placed is never the victim",
        [c("b", "normal", -1), c("p", "persistent", -1)],
        ["a"],
        [],
        3,
        2,
    ),
    ("everything else being placed: full", [], ["a", "b", "c"], [], 3, 2),
    (
        "the margin taken by page-outs: full",
        [c("a", "normal", -1), c("b", "normal", -2), c("c", "normal", -3)],
        [],
        ["x", "y"],
        3,
        2,
    ),
    (
        "a rescued victim takes its own margin back",
        [c("a", "normal", -1), c("b", "normal", -2), c("c", "normal", -3)],
        [],
        ["new", "y"],
        3,
        2,
    ),
    (
        "slots lowered by one: two victims",
        [c("a", "normal", -1), c("b", "normal", -2), c("c", "normal", -3), c("d", "ephemeral", -1)],
        [],
        [],
        3,
        2,
    ),
    ("slots lowered by three: full until shed", [c(f"n{i}", "normal", -i) for i in range(6)], [], [], 3, 2),
]


@pytest.mark.parametrize(
    ("description", "candidates", "placing", "evicting", "slots", "margin"),
    CLAIM_TABLE,
    ids=[row[0] for row in CLAIM_TABLE],
)
def test_the_claim_script_follows_the_policy(redis_client, description, candidates, placing, evicting, slots, margin):
    check_claim(
        redis_client, candidates, placing=placing, evicting=evicting, newcomer="new", slots=slots, margin=margin
    )


def check_claim(redis, candidates, *, placing, evicting, newcomer, slots, margin, now=NOW):
    redis.flushdb()
    load(redis, candidates, placing=placing, evicting=evicting)
    outcome, victims = expected_claim(
        candidates, placing=placing, evicting=evicting, newcomer=newcomer, slots=slots, margin=margin, now=now
    )
    before = pager_state(redis)
    claim = pager.pager_claim_slot(full=newcomer, now=now, slots=slots, safety_margin=margin)
    assert (claim.outcome, [v.full for v in claim.victims]) == (outcome, victims)
    after = pager.pager_locations()
    if outcome == "full":
        assert pager_state(redis) == before  # nothing changed
        return
    assert after[newcomer] == {redis_keys.LRU_PLACING}
    for name in victims:
        assert after[name] == {redis_keys.LRU_EVICTING}
        assert redis.zscore(redis_keys.LRU_EXPIRY, name) is None
    # A placement that fails gives everything back exactly as it was.
    pager.pager_release(full=newcomer, claim=claim, capability_type="normal", expires_epoch=None)
    for victim in claim.victims:
        assert pager.pager_restore(victim)
    assert pager_state(redis) == before


@pytest.mark.parametrize(
    ("candidates", "placing", "evicting", "outcome"),
    [
        ([c("a", "normal", -1)], [], [], "claimed"),  # a free slot: taken
        ([c("a", "normal", -1), c("b", "normal", -2), c("c", "normal", -3)], [], [], "no-room"),
        ([c("a", "normal", -1), c("b", "normal", -2)], ["x"], [], "no-room"),  # full with one being placed
        # The margin taken by page-outs: wait for a delete, as any claim does.
        ([c("a", "normal", -1), c("b", "normal", -2), c("c", "normal", -3)], [], ["x", "y"], "full"),
    ],
)
def test_a_claim_that_may_evict_nothing_takes_a_free_slot_or_changes_nothing(
    redis_client, candidates, placing, evicting, outcome
):
    load(redis_client, candidates, placing=placing, evicting=evicting)
    before = pager_state(redis_client)
    claim = pager.pager_claim_slot(full="new", now=NOW, slots=3, safety_margin=2, max_victims=0)
    assert (claim.outcome, claim.victims) == (outcome, ())
    if outcome == "claimed":
        assert pager.pager_locations()["new"] == {redis_keys.LRU_PLACING}
    else:
        assert pager_state(redis_client) == before


def pager_state(redis):
    """Every member and score of the pager's sets."""
    keys = [*pager.LRU_KEYS, redis_keys.LRU_EXPIRY, redis_keys.LRU_PLACING, redis_keys.LRU_EVICTING]
    return {key: redis.zrange(key, 0, -1, withscores=True) for key in keys}


def test_a_served_capability_placed_again_keeps_its_slot_and_is_out_of_reach(redis_client):
    load(redis_client, [c("a", "normal", -5), c("b", "normal", -9), c("c", "normal", -1)])
    claim = pager.pager_claim_slot(full="a", now=NOW, slots=3, safety_margin=2)
    assert (claim.outcome, claim.victims, claim.previous_score) == ("live", (), NOW - 5)
    other = pager.pager_claim_slot(full="d", now=NOW, slots=3, safety_margin=2)
    assert [v.full for v in other.victims] == ["b"]  # not "a", older but being placed
    pager.pager_release(full="a", claim=claim, capability_type="normal", expires_epoch=None)
    assert redis_client.zscore(redis_keys.lru("normal"), "a") == NOW - 5


@pytest.mark.parametrize("slots", [5, 3, 1, 0])
def test_the_shed_script_follows_the_policy(redis_client, slots):
    candidates = [
        c("p", "persistent", -99),
        c("n1", "normal", -1),
        c("n2", "normal", -50),
        c("e1", "ephemeral", -1, expires=+10),
        c("e2", "ephemeral", -3, expires=-10),
    ]
    load(redis_client, candidates, placing=["new"])
    shed = pager.pager_shed_excess(now=NOW, slots=slots)
    count = min(len(candidates), excess(used=len(candidates) + 1, slots=slots))
    assert [v.full for v in shed] == [x.full for x in eviction_order(candidates, now=NOW)[:count]]
    assert pager.pager_locations()["new"] == {redis_keys.LRU_PLACING}  # never shed while placed


def test_the_claim_script_agrees_with_the_policy_on_random_states(redis_client):
    rng = random.Random(8)
    for _ in range(150):
        candidates = []
        for i in range(rng.randint(0, 8)):
            kind = rng.choice(pager.CLASS_ORDER)
            # Whole seconds, so that ties (broken by name) happen.
            expires = rng.randint(-5, 5) if kind == "ephemeral" and rng.random() < 0.8 else None
            candidates.append(c(f"c{i}", kind, -rng.randint(0, 5), expires=expires))
        placing = [f"p{i}" for i in range(rng.randint(0, 2))]
        evicting = [f"v{i}" for i in range(rng.randint(0, 3))] + (["new"] if rng.random() < 0.2 else [])
        check_claim(
            redis_client,
            candidates,
            placing=placing,
            evicting=evicting,
            newcomer="new",
            slots=rng.randint(1, 7),
            margin=rng.randint(0, 3),
        )


def test_the_scripts_write_only_the_keys_they_are_given(redis_client):
    keys = [f"elsewhere:{i}" for i in range(len(pager.PAGER_KEYS))]
    lru = dict(zip(pager.LRU_KEYS, keys[:3], strict=True))
    redis_client.zadd(lru[redis_keys.lru("normal")], {"a": NOW - 9, "b": NOW - 5})
    redis_client.zadd(lru[redis_keys.lru("ephemeral")], {"e": NOW - 1})
    redis_client.zadd(keys[3], {"e": NOW - 1})  # expired

    def run(script, *args):
        return redis_client.eval(script, len(keys), *keys, *args)

    run(pager.CLAIM_SLOT, "new", NOW, 2, 2, -1)
    run(pager.SETTLE, "new", 2, NOW, "")
    run(pager.SHED_EXCESS, NOW, 1)
    run(pager.RESTORE, "a", 2, NOW - 9, "")
    assert {k.decode() for k in redis_client.keys("*")} <= set(keys)
    # Evictions: "e" and "a" for the newcomer (three placed over two slots), then "b" shed.
    assert redis_client.get(keys[6]) == b"3"
