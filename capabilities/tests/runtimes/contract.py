"""What every Runtime guarantees. Subclasses provide a `runtime` fixture; each test places
real code and sends a real request to it."""

from __future__ import annotations

import pytest
import urllib3

from capabilities.runtimes.base import CodeBundle, Route
from capabilities.runtimes.errors import RuntimeRejected

HELLO = "export default { async fetch(request) { return new Response('hello ' + new URL(request.url).pathname) } }"
SECOND = "export default { async fetch() { return new Response('second version') } }"
# Code that does not start: Cloudflare refuses it at upload, the loader host at its start check.
UNFINISHED = "export default { async fetch() { return new Response('hi') "
THROWS_AT_START = "throw new Error('no config at start'); export default { async fetch() { return new Response('x') } }"
# Code that starts but is no capability: nothing could ever answer a call to it.
NO_FETCH = "export default { async scheduled() {} }"
NOT_A_MODULE_WITH_DEFAULT = "0"
ECHO_HEADERS = """export default { async fetch(request) {
  return Response.json(Object.fromEntries(request.headers));
} }"""

_http = urllib3.PoolManager(retries=False, timeout=10)


def call(route: Route, path: str = "/", method: str = "GET", headers: dict | None = None):
    all_headers = dict(route.headers)
    if route.host_header:
        all_headers["Host"] = route.host_header
    all_headers.update(headers or {})
    return _http.request(method, route.base_url + path, headers=all_headers)


class RuntimeContract:
    def test_forward_reaches_placed_code(self, runtime):
        bundle = CodeBundle.from_code(HELLO)
        slot = runtime.slot_for("alice--hello")
        runtime.place(slot=slot, bundle=bundle)
        response = call(runtime.route(slot=slot, sha=bundle.sha), "/some/path")
        assert response.status == 200
        assert response.data == b"hello /some/path"

    def test_new_code_gets_a_fresh_isolate_and_old_id_keeps_nothing(self, runtime):
        slot = runtime.slot_for("alice--versioned")
        first, second = CodeBundle.from_code(HELLO), CodeBundle.from_code(SECOND)
        runtime.place(slot=slot, bundle=first)
        assert call(runtime.route(slot=slot, sha=first.sha)).data == b"hello /"
        runtime.place(slot=slot, bundle=second)
        assert call(runtime.route(slot=slot, sha=second.sha)).data == b"second version"

    def test_placing_the_same_code_twice_is_a_no_op(self, runtime):
        slot = runtime.slot_for("alice--twice")
        bundle = CodeBundle.from_code(HELLO)
        runtime.place(slot=slot, bundle=bundle)
        runtime.place(slot=slot, bundle=bundle)
        assert runtime.list_slots().count(slot) == 1
        assert call(runtime.route(slot=slot, sha=bundle.sha)).status == 200

    def test_every_answer_is_of_the_version_its_route_or_its_header_names_through_a_redeploy(self, runtime):
        """The gateway takes the version from SERVED_VERSION_HEADER when the answer carries it,
        else from the route: either way the version whose code answered, while a redeploy
        replaces the code of one slot under a route that may still be the previous one."""
        import threading

        from capabilities.runtimes.base import SERVED_VERSION_HEADER
        from testsupport.capability_code import answering

        slot = runtime.slot_for("alice--redeployed")
        first = CodeBundle.from_code(answering("one"), version=1)
        runtime.place(slot=slot, bundle=first)
        routes = {1: runtime.route(slot=slot, sha=first.sha)}
        answers, stop = [], threading.Event()

        def poll():
            while not stop.is_set():
                route_version = max(routes)  # the route a gateway holds: updated after the placement
                response = call(routes[route_version])
                if runtime.is_missing(response):
                    continue  # not the code's answer: the gateway finds the route again
                version = response.headers.get(SERVED_VERSION_HEADER) or str(route_version)
                answers.append((response.data.decode(), version))

        thread = threading.Thread(target=poll)
        thread.start()
        try:
            second = CodeBundle.from_code(answering("two"), version=2)
            runtime.place(slot=slot, bundle=second)
            threading.Event().wait(0.2)  # the gateway's route is updated a moment later
            routes[2] = runtime.route(slot=slot, sha=second.sha)
            updated = len(answers)
            while len(answers) < updated + 10:
                threading.Event().wait(0.01)
        finally:
            stop.set()
            thread.join()
        assert set(answers) <= {("one", "1"), ("two", "2")}, sorted(set(answers))
        assert answers[-1] == ("two", "2")

    def test_removed_slot_is_not_listed(self, runtime):
        slot = runtime.slot_for("alice--gone")
        runtime.place(slot=slot, bundle=CodeBundle.from_code(HELLO))
        assert slot in runtime.list_slots()
        runtime.remove(slot=slot)
        assert slot not in runtime.list_slots()

    def test_removing_a_missing_slot_is_not_an_error(self, runtime):
        runtime.remove(slot=runtime.slot_for("alice--never-placed"))

    def test_internal_headers_do_not_reach_the_capability(self, runtime):
        slot = runtime.slot_for("alice--headers")
        bundle = CodeBundle.from_code(ECHO_HEADERS)
        runtime.place(slot=slot, bundle=bundle)
        seen = call(runtime.route(slot=slot, sha=bundle.sha), headers={"X-Custom": "kept"}).json()
        assert seen["x-custom"] == "kept"
        assert not [name for name in seen if name.startswith("x-sigil")]

    @pytest.mark.parametrize(
        ("code", "words"),
        [
            (UNFINISHED, "SyntaxError"),
            (THROWS_AT_START, "no config at start"),
            (NO_FETCH, "has no fetch handler"),
            (NOT_A_MODULE_WITH_DEFAULT, "default export"),
        ],
    )
    def test_code_that_does_not_start_is_refused_and_placed_nowhere(self, runtime, code, words):
        slot = runtime.slot_for("alice--broken")
        with pytest.raises(RuntimeRejected, match=words):
            runtime.place(slot=slot, bundle=CodeBundle.from_code(code))
        assert slot not in runtime.list_slots()

    def test_check_passes_when_the_runtime_serves(self, runtime):
        runtime.check()
