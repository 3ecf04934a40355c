"""Fair shares counted in tokens (#39 item 3; `tenancy.fairness` through `backends.admission`): on a
simulated engine in steps (every running request makes one token a step), no clock: the paper's bound
on the difference in service between two backlogged keys, a returning key lifted, classes still first."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.backends.admission import Admission, Permit
from gateway.errors import ModelOverloaded
from gateway.settings import AdmissionSettings, FairnessSettings, Priority
from gateway.tenancy.fairness import MOST_KEYS, Served, VirtualTokenCounter
from gateway.tenancy.keys import ANONYMOUS
from tests.fakes import FakeEngine, app_with, chat_body
from tests.waits import until

W_IN, W_OUT = FairnessSettings().input_weight, FairnessSettings().output_weight


@dataclass(eq=False)
class Job:
    key: str
    prompt: int
    output: int  # tokens it will generate
    klass: Priority = "normal"
    generated: int = 0
    started_at: int | None = None
    permit: Permit | None = None


@dataclass
class Engine:
    """Admission in front of a simulated engine: each step the running requests make a token each; one
    that has made all of its output finishes and gives its permit back."""

    admission: Admission
    step: int = 0
    running: list[Job] = field(default_factory=list)
    waiting: list[Job] = field(default_factory=list)
    served: dict[str, float] = field(default_factory=dict)  # weighted service per key, counted apart from the VTC
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def settle(self) -> None:
        """Let every woken waiter run (a few turns of the loop; no time passes)."""
        for _ in range(5):
            await asyncio.sleep(0)

    async def _run(self, job: Job) -> None:
        served = Served(job.prompt, lambda: job.generated)
        job.permit = await self.admission.acquire(1, job.klass, job.key, served)
        self.waiting.remove(job)
        job.started_at = self.step
        self.served[job.key] = self.served.get(job.key, 0) + W_IN * job.prompt
        self.running.append(job)

    async def arrive(self, job: Job) -> None:
        self.waiting.append(job)
        self.tasks.append(asyncio.create_task(self._run(job)))
        await self.settle()

    async def tick(self) -> None:
        self.step += 1
        for job in list(self.running):
            job.generated += 1
            self.served[job.key] = self.served.get(job.key, 0) + W_OUT
            if job.generated >= job.output:
                self.running.remove(job)
                assert job.permit is not None
                job.permit.release()
        await self.settle()

    def backlogged(self, key: str) -> bool:
        return any(job.key == key for job in self.waiting)


def engine(max_running: int, order: str = "vtc") -> Engine:
    settings = AdmissionSettings(max_running=max_running, max_waiting=100_000, wait_timeout_s=1e9,
                                 fairness=FairnessSettings(order=order))  # type: ignore[arg-type]
    return Engine(Admission("m", settings))


async def service_gap(order: str, arrivals: list[list[tuple[str, int, int]]], max_running: int, steps: int) -> float:
    """The largest |W_a - W_b| over intervals in which keys a and b both had requests waiting throughout."""
    sim = engine(max_running, order)
    worst, low, high, together = 0.0, 0.0, 0.0, False
    for step in range(steps):
        for key, prompt, output in arrivals[step] if step < len(arrivals) else []:
            await sim.arrive(Job(key, prompt, output))
        both = sim.backlogged("a") and sim.backlogged("b")
        difference = sim.served.get("a", 0) - sim.served.get("b", 0)
        if both and not together:
            low = high = difference
        elif both:
            low, high = min(low, difference), max(high, difference)
            worst = max(worst, high - low)
        together = both
        await sim.tick()
    for task in sim.tasks:
        task.cancel()
    await asyncio.gather(*sim.tasks, return_exceptions=True)
    return worst


MAX_PROMPT, MAX_OUTPUT = 40, 12
JOB = st.tuples(st.sampled_from(["a", "b"]), st.integers(1, MAX_PROMPT), st.integers(1, MAX_OUTPUT))


def bound(max_running: int) -> float:
    """The paper's: 2 x max(w_in x the longest prompt, w_out x M), M the tokens the running requests hold."""
    held = max_running * (MAX_PROMPT + MAX_OUTPUT)
    return 2 * max(W_IN * MAX_PROMPT, W_OUT * held)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(st.lists(JOB, max_size=6), min_size=1, max_size=60), max_running=st.integers(1, 4))
def test_two_backlogged_keys_are_served_within_the_papers_bound(
    arrivals: list[list[tuple[str, int, int]]], max_running: int
) -> None:
    gap = asyncio.run(service_gap("vtc", arrivals, max_running, steps=len(arrivals) + 40))
    assert gap <= bound(max_running)


def flood(steps: int) -> list[list[tuple[str, int, int]]]:
    """Key a sends four long requests a step, key b one short one every other step: both stay backlogged."""
    return [[("a", MAX_PROMPT, MAX_OUTPUT)] * 4 + ([("b", 1, 1)] if step % 2 == 0 else []) for step in range(steps)]


async def test_arrival_order_breaks_the_bound_where_the_counter_keeps_it() -> None:
    """The property can fail: first come, first served lets the flooding key take nearly everything."""
    fcfs = await service_gap("fcfs", flood(200), 2, steps=200)
    vtc = await service_gap("vtc", flood(200), 2, steps=200)
    assert fcfs > bound(2)
    assert vtc <= bound(2)


async def test_the_light_key_waits_for_one_slot_not_for_the_flood() -> None:
    sim = engine(2)
    for _ in range(20):
        await sim.arrive(Job("heavy", 100, 10))
    light = Job("light", 5, 2)
    await sim.arrive(light)
    while light.started_at is None:
        await sim.tick()
    assert light.started_at <= 10  # the first slot that freed: one heavy request's output
    for task in sim.tasks:
        task.cancel()
    await asyncio.gather(*sim.tasks, return_exceptions=True)


async def test_a_returning_key_is_lifted_to_the_least_served_of_the_others() -> None:
    sim = engine(1)
    vtc = sim.admission.fairness
    assert isinstance(vtc, VirtualTokenCounter)
    for _ in range(3):
        await sim.arrive(Job("busy", 50, 5))
    while len(sim.waiting) > 1:
        await sim.tick()
    busy = vtc.counter("busy")
    assert busy > 0
    assert vtc.counter("idle") == 0
    await sim.arrive(Job("idle", 1, 1))  # joins behind busy's waiting request: no credit for its time away
    assert vtc.counter("idle") == pytest.approx(busy)
    for task in sim.tasks:
        task.cancel()
    await asyncio.gather(*sim.tasks, return_exceptions=True)


async def test_a_key_that_returns_to_an_idle_model_gets_no_credit_either() -> None:
    vtc = VirtualTokenCounter(FairnessSettings())
    served = Served(100, lambda: 10)
    vtc.admitted("busy", served, waiting={})
    vtc.finished("busy", served)
    assert vtc.counter("busy") == 100 * W_IN + 10 * W_OUT
    vtc.joined("idle", waiting={}, running={})  # nobody around: lifted to the last one served
    assert vtc.counter("idle") == vtc.counter("busy")
    vtc.joined("busy", waiting={"idle": 1}, running={})  # never lowered
    assert vtc.counter("busy") == 100 * W_IN + 10 * W_OUT


def test_idle_keys_counters_are_dropped_past_the_bound_and_a_dropped_key_returns_to_the_floor() -> None:
    """A flood of fresh keys, each served once: the counters kept stay bounded; those of keys waiting or
    running are never dropped; a key dropped returns to the floor, as it would have at or under it."""
    vtc = VirtualTokenCounter(FairnessSettings())
    early = Served(0)
    vtc.admitted("waits", early, waiting={})
    vtc.finished("waits", early)  # the least counter of all, then waiting again
    waiting = {"waits": 1}
    holding = Served(1)
    vtc.admitted("holds", holding, waiting)
    for n in range(3 * MOST_KEYS):
        served = Served(1 + n % 7)
        vtc.admitted(f"k{n}", served, waiting)
        vtc.finished(f"k{n}", served)
        assert len(vtc._settled) <= MOST_KEYS + 1
    assert vtc.counter("holds") == W_IN  # running: kept
    assert "waits" in vtc._settled  # waiting: never dropped, though the least
    assert "k0" not in vtc._settled
    vtc.joined("k0", waiting={"holds": 1}, running={"holds": 1})
    assert vtc.counter("k0") == vtc.counter("holds")  # lifted to the floor, as any returning key


async def test_output_counts_as_it_comes_not_only_at_the_end() -> None:
    vtc = VirtualTokenCounter(FairnessSettings())
    made = [0]
    vtc.admitted("k", Served(10, lambda: made[0]), waiting={})
    assert vtc.counter("k") == 10 * W_IN
    made[0] = 7
    assert vtc.counter("k") == 10 * W_IN + 7 * W_OUT


async def test_classes_still_go_high_then_normal_then_low_whatever_the_counters() -> None:
    """The least served key's low request waits behind a well served key's high and normal ones."""
    admission = Admission("m", AdmissionSettings(max_running=1, max_waiting=10))
    vtc = admission.fairness
    holder = admission.admit_now(1, "rich", Served(1000))
    assert holder is not None
    assert isinstance(vtc, VirtualTokenCounter)
    order: list[str] = []

    async def wait(klass: Priority, key: str) -> None:
        permit = await admission.acquire(1, klass, key, Served(1))
        order.append(f"{klass}-{key}")
        await asyncio.sleep(0)
        permit.release()

    tasks = [asyncio.create_task(wait(klass, key))  # type: ignore[arg-type]
             for klass, key in [("low", "poor"), ("normal", "rich"), ("high", "rich"), ("normal", "poor")]]
    await asyncio.sleep(0)
    assert admission.waiting == 4
    holder.release()
    await asyncio.gather(*tasks)
    assert order == ["high-rich", "normal-poor", "normal-rich", "low-poor"]


async def test_the_request_next_in_order_is_not_overtaken_when_it_does_not_fit() -> None:
    """A large request next in order (the other key lifted to the running one's counter: a tie, so the older)
    holds up a small one behind it that would fit: it never starves."""
    admission = Admission("m", AdmissionSettings(max_running=4, max_waiting=10))
    rich = admission.admit_now(3, "rich", Served(500))
    assert rich is not None
    big = asyncio.create_task(admission.acquire(4, "normal", "poor", Served(10)))
    await asyncio.sleep(0)
    small = asyncio.create_task(admission.acquire(1, "normal", "rich", Served(10)))
    await asyncio.sleep(0)
    assert not big.done()
    assert not small.done()
    rich.release()
    (await big).release()
    (await small).release()
    assert admission.running == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_the_pipeline_counts_a_requests_prompt_and_output_into_its_keys_counter(stream: bool) -> None:
    """Through the app: what the key's counter grew by is the answer's usage, weighted."""
    app = app_with(FakeEngine(), admission={"max_running": 4})
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):  # type: ignore[no-untyped-def]
            scope["state"] = dict(state)
            await app(scope, receive, send)

        vtc = state["gateway"].models.backends["fake-model"].admission.fairness
        assert isinstance(vtc, VirtualTokenCounter)
        body = chat_body(max_tokens=6, stream=stream, stream_options={"include_usage": True} if stream else None)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://test") as client:
            answer = await client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200
    if stream:
        usage = [json.loads(line[6:]) for line in answer.text.splitlines()
                 if line.startswith("data: {")][-1]["usage"]
    else:
        usage = answer.json()["usage"]
    assert usage["completion_tokens"] == 6
    assert vtc.counter(ANONYMOUS) == W_IN * usage["prompt_tokens"] + W_OUT * usage["completion_tokens"]


async def test_a_flooding_keys_queue_does_not_get_the_others_refused_at_once() -> None:
    """The expected wait of a request is the queue the order puts before it: a key that keeps the queue at
    the brink of the wait allowed (its own requests refused beyond it) does not make every other key's
    request look as if it waited behind the whole flood, refused at once, when the counter admits it next."""
    model = Admission("flood", AdmissionSettings(max_running=1, max_waiting=100, wait_timeout_s=25))
    held = model.admit_now(1, "a", Served(1))
    assert held is not None
    model.capacity.service_s = 10.0  # measured: one answer every 10 s
    flood = [asyncio.create_task(model.acquire(1, "normal", "a", Served(1))) for _ in range(3)]
    await until(lambda: flood[2].done(), what="the flood's third refused: it would wait 30 s")
    assert isinstance(flood[2].exception(), ModelOverloaded)
    light = asyncio.create_task(model.acquire(1, "normal", "b", Served(1)))
    await until(lambda: model.waiting == 3 or light.done(), what="the light key's request queued")
    assert not light.done()  # queued: one of the flood's goes first (it came first, counters equal), then it
    held.release()
    first = await flood[0]
    first.release()
    (await light).release()
    assert not flood[1].done()
    flood[1].cancel()
    await asyncio.gather(flood[1], return_exceptions=True)
    assert model.running == 0


async def test_waiters_refused_once_measured_are_those_whose_turn_comes_too_late() -> None:
    """Measured while they wait (`_refuse_late`), a light key's request is judged by its turn (second: the
    keys go in turn), not by the flood queued before it (third)."""
    model = Admission("turns", AdmissionSettings(max_running=1, max_waiting=100, wait_timeout_s=100))
    held = model.admit_now(1, "a", Served(1))
    assert held is not None
    now = asyncio.get_running_loop().time()
    flood = [asyncio.create_task(model.acquire(1, "normal", "a", Served(1))) for _ in range(2)]
    light = asyncio.create_task(model.acquire(1, "normal", "b", Served(1), deadline=now + 60))
    await until(lambda: model.waiting == 3, what="all three queued, nothing measured")
    model.capacity.clock = lambda: held.taken + 25  # its answer took 25 s: the light one's turn is 50 s away
    held.release(4)
    first = await flood[0]
    assert not light.done()  # not refused: its turn (after one of the flood's) is within its deadline
    first.release()
    (await light).release()
    (await flood[1]).release()
    assert model.running == 0


async def test_a_full_queue_makes_room_for_another_key_by_refusing_the_floods_newest() -> None:
    """A key that fills the queue (short answers: the expected wait never refuses it) does not get every
    other key refused as queue_full: the newest request of the key holding the most of the queue gives up
    its place (queue_full), so the queue stays bounded and the others still get in."""
    model = Admission("full", AdmissionSettings(max_running=1, max_waiting=2, wait_timeout_s=100))
    held = model.admit_now(1, "a", Served(1))
    assert held is not None
    flood = [asyncio.create_task(model.acquire(1, "normal", "a", Served(1))) for _ in range(2)]
    await until(lambda: model.waiting == 2, what="the flood fills the queue")
    light = asyncio.create_task(model.acquire(1, "normal", "b", Served(1)))
    await until(lambda: flood[1].done(), what="the flood's newest refused")
    assert isinstance(flood[1].exception(), ModelOverloaded)
    assert not light.done()
    assert model.waiting == 2
    again = asyncio.create_task(model.acquire(1, "normal", "a", Served(1)))  # the flood holds no more than b now
    await until(lambda: again.done(), what="the flood refused")
    assert isinstance(again.exception(), ModelOverloaded)
    held.release()
    (await flood[0]).release()
    (await light).release()
    assert model.running == 0
    assert model.waiting == 0


async def test_room_is_not_made_of_a_waiter_already_refused() -> None:
    """A waiter refused once measured (`_refuse_late`) is still queued until its task runs: a request that
    comes in between does not take its place a second time (a refusal set twice is an error, a 500)."""
    model = Admission("twice", AdmissionSettings(max_running=1, max_waiting=2, wait_timeout_s=100))
    held = model.admit_now(1, "a", Served(1))
    assert held is not None
    flood = [asyncio.create_task(model.acquire(1, "normal", "a", Served(1))) for _ in range(2)]
    await until(lambda: model.waiting == 2, what="the flood fills the queue")
    model._queues["normal"][-1].future.set_exception(model.refuse("expected_wait", "measured"))
    assert not model._make_room("normal", "b", 1, 2)  # in the same turn: its one place is the leaving one's
    with pytest.raises(ModelOverloaded):
        await flood[1]
    held.release()
    (await flood[0]).release()
    assert model.running == 0
    assert model.waiting == 0
