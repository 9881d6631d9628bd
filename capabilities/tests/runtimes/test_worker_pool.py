import pytest

from capabilities.runtimes.worker_pool import WorkerPoolRuntime
from capabilities.tests.runtimes.contract import RuntimeContract


@pytest.fixture
def runtime(cf_client, cf_emulator_fresh, settings):
    return WorkerPoolRuntime(
        client=cf_client,
        secret=settings.SIGIL_INTERNAL_SECRET,
        total_quota=500,
        system_reserved=5,
        user_reserved=50,
        safety_margin=5,
        invoke_base=cf_emulator_fresh.url,
    )


class TestWorkerPoolRuntime(RuntimeContract):
    pass


def test_a_pooled_script_refuses_calls_without_sigils_secret(runtime, cf_emulator_fresh):
    from capabilities.runtimes.base import CodeBundle
    from capabilities.tests.runtimes.contract import HELLO

    slot = runtime.slot_for("alice--guarded")
    runtime.place(slot=slot, bundle=CodeBundle.from_code(HELLO))
    direct = cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host(slot))
    assert direct.status_code == 403


def test_only_sigils_scripts_are_listed(runtime, cf_client):
    from capabilities.runtimes.base import CodeBundle
    from capabilities.tests.runtimes.contract import HELLO

    cf_client.script_upload(
        "owners-own-site", modules={"main.js": HELLO}, main_module="main.js", compatibility_date="2025-01-01"
    )
    runtime.place(slot=runtime.slot_for("alice--x"), bundle=CodeBundle.from_code(HELLO))
    assert runtime.list_slots() == [runtime.slot_for("alice--x")]


def test_slots_are_the_quota_less_reserved_and_margin(runtime):
    assert runtime.total_slots == 440 and runtime.safety_margin == 5


def test_every_answer_names_the_version_whose_code_answered_through_a_redeploy(runtime, cf_emulator_fresh):
    import threading

    from capabilities.runtimes.base import SERVED_VERSION_HEADER, CodeBundle
    from capabilities.tests.runtimes.contract import call
    from testsupport.capability_code import answering

    slot = runtime.slot_for("alice--versioned")
    first = CodeBundle.from_code(answering("one"), version=1)
    runtime.place(slot=slot, bundle=first)
    route = runtime.route(slot=slot, sha=first.sha)  # the route a gateway still holds
    answers, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            response = call(route)
            answers.append((response.data.decode(), response.headers.get(SERVED_VERSION_HEADER)))

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        cf_emulator_fresh.configure(latency=0.2)  # the redeploy takes a while: answers come meanwhile
        runtime.place(slot=slot, bundle=CodeBundle.from_code(answering("two"), version=2))
        cf_emulator_fresh.configure(latency=0)
        seen_two = len(answers)
        while len(answers) < seen_two + 5:
            threading.Event().wait(0.01)
    finally:
        stop.set()
        thread.join()
    assert set(answers) <= {("one", "1"), ("two", "2")}, set(answers)
    assert answers[0] == ("one", "1") and answers[-1] == ("two", "2")
    # Thrown errors are answered by the guard: they name the version too.
    runtime.place(slot=slot, bundle=CodeBundle.from_code("export default { fetch() { throw 1 } }", version=3))
    assert call(route).headers.get(SERVED_VERSION_HEADER) == "3"
