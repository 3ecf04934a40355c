"""The measured limit (backends.capacity), driven by a simulated engine on a fake clock: no timing
in these tests, only the rule's arithmetic against an engine whose pace is known."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import httpx
import pytest

from engine.types import Task
from gateway.app import create_app
from gateway.backends.admission import Admission
from gateway.backends.capacity import INITIAL, MOST_RETRY_S, Capacity
from gateway.settings import AdmissionSettings
from tests.fakes import FakeEngine, app_with, fake_settings
from tests.unit.test_disconnect import drive

TOKENS = 32  # every simulated answer's length
RECENT = 2 / (20 + 1)  # engine.load's average of the engine's time per request (not imported: it imports vllm)


@dataclass
class Engine:
    """Continuous batching: each step gives every running request one token and takes `fixed` +
    `per_request` x the batch seconds (a GPU: a large fixed cost of reading the weights; a CPU: the
    compute per request dominates)."""

    fixed: float
    per_request: float


@dataclass
class Run:
    throughput: float  # tokens per second over the second half
    limit: int
    pace: float  # seconds per token over the second half
    unloaded: float | None


def flood(engine: Engine, bound: int = 256, adaptive: bool = True, steps: int = 6000,
          slower: Engine | None = None) -> Run:
    """Endless demand: the engine runs as many requests as the limit lets it, for `steps` steps
    (from half way on at the pace of `slower`, when given)."""
    now = 0.0
    capacity = Capacity(bound, adaptive, clock=lambda: now)
    running: list[list[float]] = []  # [taken at, tokens left]
    made, half_at, half_made, half_steps = 0, 0.0, 0, 0.0
    for step in range(steps):
        if step == steps // 2:
            half_at, half_made = now, made
            engine = slower or engine
        while len(running) < capacity.limit:
            running.append([now, TOKENS])
        took = engine.fixed + engine.per_request * len(running)
        now += took
        if step >= steps // 2:
            half_steps += took
        made += len(running)
        for request in running:
            request[1] -= 1
        for request in [request for request in running if request[1] == 0]:
            capacity.finished(now - request[0], TOKENS, len(running))
        running = [request for request in running if request[1] > 0]
    return Run((made - half_made) / (now - half_at), capacity.limit, half_steps / (steps - steps // 2), capacity.unloaded)


CPU, MIXED, GPU = Engine(0.015, 0.005), Engine(0.02, 0.002), Engine(0.05, 0.001)


@pytest.mark.parametrize("engine", [CPU, MIXED, GPU], ids=["cpu", "mixed", "gpu"])
def test_the_limit_keeps_the_throughput_of_the_bound_at_a_fraction_of_its_pace(engine: Engine) -> None:
    adaptive, fixed = flood(engine), flood(engine, adaptive=False)
    assert fixed.limit == 256
    assert adaptive.throughput >= 0.9 * fixed.throughput  # the engine's best: everything in at once
    assert adaptive.limit < 256
    assert adaptive.pace < fixed.pace  # each answer comes faster: the waiting is in the gateway's queue
    assert adaptive.unloaded is not None


@dataclass
class Burst:
    served: int  # answered by the deadline
    at_once: int  # refused for their expected wait, before the deadline
    late: int  # refused at the deadline: still waiting, or running and aborted there


def burst(engine: Engine, timed: bool = True, intake_s: float = 0.0, bound: int = 256, adaptive: bool = True,
          n: int = 1000, deadline: float = 30.0, tokens: int = 16) -> Burst:
    """`n` whole answers arriving at once on a cold gateway, each due by `deadline`. `intake_s`: the gateway's
    event loop is busy taking them in that long, so no answer is delivered (no permit given back) before then.
    `timed`: the engine reports its own time per request (`EngineLoad.request_s`, averaged as the recorder does)."""
    now, reported = 0.0, [0.0]  # [average], 0: none yet
    capacity = Capacity(bound, adaptive, clock=lambda: now, engine_s=(lambda: reported[0] or None) if timed else None)
    waiting, running = n, list[list[float]]()  # [admitted at, tokens left]
    served = at_once = 0
    while (waiting or running) and now < deadline:
        while waiting and len(running) < capacity.limit:
            waiting -= 1
            running.append([now, tokens])
        now += engine.fixed + engine.per_request * len(running)
        for request in running:
            request[1] -= 1
        done = [request for request in running if request[1] == 0]
        running = [request for request in running if request[1] > 0]
        for held, request in enumerate(done):
            took = now - request[0]
            reported[0] = took if not reported[0] else reported[0] + RECENT * (took - reported[0])
            if now > deadline:
                continue  # aborted at the deadline
            served += 1
            if capacity.finished(max(now, intake_s) - request[0], tokens, len(running) + len(done) - held):
                kept = 0  # as admission's _refuse_late: the waiters whose expected wait passes the deadline leave
                while kept < waiting and now + (capacity.expected_wait(kept + 1) or 0) <= deadline:
                    kept += 1
                at_once, waiting = at_once + waiting - kept, kept
    return Burst(served, at_once, n - served - at_once)


def best_fixed(engine: Engine) -> int:
    """The most a fixed limit serves of the burst, the best limit known in advance."""
    return max(burst(engine, timed=False, bound=bound, adaptive=False).served for bound in (4, 8, 16, 32, 64, 128, 256))


LOADED_CPU = Engine(0.05, 0.02)  # the shared 2-core machine: a batch of 8 makes 16 tokens in over 3 s


@pytest.mark.parametrize("engine", [LOADED_CPU, CPU, GPU], ids=["loaded-cpu", "cpu", "gpu"])
def test_a_cold_burst_is_served_near_the_best_fixed_limit_and_the_rest_refused_before_its_deadline(engine: Engine) -> None:
    """A thousand at once on a gateway that has measured nothing: the limit starts low and doubles while the
    pace allows (slow start), and while it does the waiters are not refused for a limit it will outgrow."""
    cold, best = burst(engine), best_fixed(engine)
    assert cold.served >= 0.6 * best
    assert cold.late <= 0.1 * 1000  # the rest refused at once, with time to spare, not at the deadline
    assert cold.served + cold.at_once + cold.late == 1000


@pytest.mark.parametrize("engine", [LOADED_CPU, CPU, GPU], ids=["loaded-cpu", "cpu", "gpu"])
@pytest.mark.parametrize("intake_s", [10.0, 20.0])
def test_a_busy_intake_does_not_stretch_the_measure(engine: Engine, intake_s: float) -> None:
    """The first answers' permits are held while the event loop takes in the burst: measured from the engine's
    own time per request, the limit and the expected waits are as without that intake; measured from the
    permits alone (before: no engine report), the service time looks many times longer and most of the burst
    is refused for it."""
    assert burst(engine, intake_s=intake_s) == burst(engine)
    if engine is GPU:  # an engine fast enough to serve the whole burst by the deadline
        assert burst(engine).served == 1000
        assert burst(engine, timed=False, intake_s=intake_s).served < 0.8 * 1000


def test_on_an_engine_whose_pace_does_not_change_with_its_batch_the_limit_reaches_the_bound() -> None:
    assert flood(Engine(0.03, 0.0001)).limit == 256


def test_the_bound_holds_from_the_start() -> None:
    assert Capacity(3).limit == 3
    assert Capacity(1000).limit == INITIAL
    assert Capacity(20, batch=1024).limit == 20
    assert flood(Engine(0.03, 0.0001), bound=20).limit == 20


def test_when_the_engine_slows_the_limit_falls() -> None:
    before = flood(CPU, steps=3000).limit
    after = flood(CPU, steps=6000, slower=Engine(CPU.fixed, CPU.per_request * 3))
    assert after.limit < before


def test_with_the_rule_off_the_limit_is_the_bound() -> None:
    assert flood(CPU, adaptive=False).limit == 256
    assert Capacity(256, adaptive=False).limit == 256


def test_an_answer_that_failed_teaches_nothing() -> None:
    capacity = Capacity(16)
    for _ in range(100):
        capacity.finished(5.0, None, 16)
    assert capacity.service_s is None
    assert capacity.expected_wait(10) is None
    assert capacity.limit == INITIAL


def test_a_light_load_does_not_grow_the_limit() -> None:
    capacity = Capacity(256)
    for _ in range(1000):
        capacity.finished(1.0, 10, 1)  # one at a time: the limit never held anyone back
    assert capacity.limit == INITIAL


def test_expected_wait_and_retry_after_follow_the_measured_rate() -> None:
    capacity = Capacity(4, adaptive=False)
    assert capacity.retry_after(100, least=2) == 2  # nothing measured: the setting
    capacity.finished(8.0, 10, 4)  # 4 at once, each held 8 s: one admitted every 2 s
    assert capacity.expected_wait(0) == 0
    assert capacity.expected_wait(10) == pytest.approx(20.0)
    assert capacity.retry_after(10, least=1) == 20
    assert capacity.retry_after(0, least=1) == 1
    assert capacity.retry_after(10**9, least=1) == MOST_RETRY_S


async def test_a_stream_its_client_cut_short_teaches_the_limit_nothing() -> None:
    """A stream the client leaves after its first tokens held its permit for the queue and the prefill and
    made a token or two: its pace is not the engine's. Learnt from, a flood of them (or a client's tiny
    timeout) would shrink the limit, and lengthen the expected wait, of every key."""
    engine = FakeEngine(max_model_len=10_000, delay=0.01)
    # no reconnect grace: the stream ends with its client (waiting out the grace teaches nothing more)
    app = create_app(fake_settings(streams={"grace_s": 0}), engine_starter=lambda es: engine)
    body = {"model": engine.info.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "stream": True}
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):  # type: ignore[no-untyped-def]
            scope["state"] = dict(state)
            await app(scope, receive, send)

        await drive(with_state, body, disconnect_after_chunks=3)
        admission = state["gateway"].models.backends[engine.info.name].admission
        assert engine.aborted
        assert admission.running == 0
        assert admission.capacity.service_s is None


@pytest.mark.parametrize(("task", "path", "body"), [
    ("generate", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ("embed", "/v1/embeddings", {"input": ["one", "two"]}),
])
async def test_whole_answers_and_embeddings_still_teach_it(task: Task, path: str, body: dict[str, object]) -> None:
    app = app_with(FakeEngine(task=task))
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):  # type: ignore[no-untyped-def]
            scope["state"] = dict(state)
            await app(scope, receive, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://t") as client:
            assert (await client.post(path, json={"model": "fake-model", **body})).status_code == 200
        assert state["gateway"].models.backends["fake-model"].admission.capacity.service_s is not None


async def test_admission_reads_the_engine_s_own_time_per_request_before_a_permit_s() -> None:
    """The engine's report (`EngineLoad.request_s`) is what the expected wait reads once there is one: a
    permit's time holds the gateway's intake too."""
    engine = FakeEngine()
    app = app_with(engine)
    async with app.router.lifespan_context(app) as state:
        capacity = state["gateway"].models.backends["fake-model"].admission.capacity
        capacity.finished(30.0, 10, 1)  # a permit held while the loop took a burst in
        assert capacity.service == 30.0
        engine.scheduler = replace(engine.scheduler, request_s=2.0)
        assert capacity.service == 2.0
        assert capacity.expected_wait(256) == pytest.approx(2.0)  # starting: at the bound's rate, 256


@pytest.mark.parametrize(("batch", "start"), [(0, INITIAL), (16, INITIAL), (128, 32), (256, 64), (1024, 256)])
def test_the_limit_starts_at_a_share_of_the_engine_s_batch(batch: int, start: int) -> None:
    """The engine's max_num_seqs as it reports it (`EngineLoad.batch`; vLLM's default for our engine: 128): a
    quarter of it runs while the gateway takes the rest of a cold flood in, never fewer than INITIAL."""
    engine = FakeEngine()
    engine.scheduler = replace(engine.scheduler, batch=batch)
    assert Admission("m", AdmissionSettings(max_running=256), engine).capacity.limit == start
    assert Admission("m", AdmissionSettings(max_running=256, adaptive=False), engine).capacity.limit == 256


def test_answers_in_no_time_by_the_clock_leave_the_limit_as_it_was() -> None:
    """A clock's grain (or a fake one) can read a permit's hold as 0 s: no pace, not a division by it."""
    capacity = Capacity(64, clock=lambda: 0.0)
    for _ in range(4 * INITIAL):
        capacity.finished(0.0, 5, capacity.limit)
    assert capacity.limit == INITIAL
    assert capacity.unloaded is None
    capacity.finished(math.nan, 5, 1)  # a hold no clock gives: nothing learnt, nothing poisoned
    assert capacity.service == 0.0


@pytest.mark.parametrize("engine_s", [math.inf, math.nan, 1e300])
def test_retry_after_stays_between_a_second_and_the_most_whatever_the_engine_reports(engine_s: float) -> None:
    capacity = Capacity(4, engine_s=lambda: engine_s)
    capacity.finished(1.0, 3, 3)
    assert capacity.retry_after(5, least=1) == MOST_RETRY_S


def test_retry_after_is_never_0_even_when_the_setting_is() -> None:
    capacity = Capacity(4, adaptive=False)
    assert capacity.retry_after(3, least=0) == 1  # nothing measured
    capacity.finished(0.001, 3, 1)
    assert capacity.retry_after(0, least=0) == 1  # nobody ahead


def test_a_model_with_max_running_1_starts_and_stays_at_1() -> None:
    engine = FakeEngine()
    engine.scheduler = replace(engine.scheduler, batch=128)
    capacity = Admission("m", AdmissionSettings(max_running=1), engine).capacity
    assert capacity.limit == 1
    for held in (1.0, 100.0, 1.0, 0.5, 1000.0):
        capacity.finished(held, 10, 1)
        assert capacity.limit == 1


@dataclass
class Phase:
    served: int  # answered in time: a whole answer by its deadline; a stream's first token by it, no gap past its bound
    tokens_per_s: float  # the served answers' tokens over the phase
    gaps_over: int  # streams served whose gap between tokens passed their client's read timeout


class Batched:
    """A simulated engine with vLLM's batch (`max_num_seqs`): it runs the first `batch` requests admitted, the rest
    wait in its queue (their time there counts in its time per request, as vLLM's queued_time). One gateway's measured
    capacity over several floods: the engine's report (time per request, to a first token) as `engine.load` averages."""

    def __init__(self, engine: Engine, batch: int = 128, bound: int = 256, adaptive: bool = True,
                 first_tokens: bool = True) -> None:
        """`first_tokens`: the limit learns from a stream's first token (`Capacity.started`); False: from its end only."""
        self.engine, self.batch, self.now, self.first_tokens = engine, batch, 0.0, first_tokens
        self.reported: list[float | None] = [None, None]  # request_s, first_token_s
        self.capacity = Capacity(bound, adaptive, clock=lambda: self.now, engine_s=lambda: self.reported[0],
                                 batch=batch, first_token_s=lambda: self.reported[1])

    def _report(self, which: int, seconds: float) -> None:
        old = self.reported[which]
        self.reported[which] = seconds if old is None else old + RECENT * (seconds - old)

    def flood(self, n: int, stream: bool, due_s: float = 30.0, tokens: int = 16) -> Phase:
        """`n` requests at once, each with a read timeout of `due_s` (its first byte by then: a whole answer's is its end)."""
        start, capacity = self.now, self.capacity
        deadline, gap_s = start + due_s, (due_s if stream else None)
        waiting, admitted = n, list[list[float]]()  # [admitted at, tokens left, first token at (0: none), longest gap]

        def refuse_late() -> int:  # as admission: the waiters whose expected wait passes their deadline leave
            kept = 0
            while kept < waiting and self.now + (capacity.expected_wait(kept + 1, stream) or 0) <= deadline:
                kept += 1
            return kept

        waiting = refuse_late()
        served = made = gaps_over = 0
        while waiting or admitted:
            while waiting and len(admitted) < capacity.limit and self.now < deadline:
                waiting -= 1
                admitted.append([self.now, tokens, 0.0, 0.0])
            running = admitted[: self.batch]
            took = self.engine.fixed + self.engine.per_request * len(running)
            self.now += took
            firsts = [request for request in running if not request[2]]
            for request in running:
                request[1] -= 1
                request[3] = max(request[3], took) if request[2] else 0.0
                request[2] = request[2] or self.now
            for request in firsts if stream and self.first_tokens else ():  # as the pipeline: at a stream's first token
                if capacity.started(self.now - request[0], len(admitted), due_s):
                    waiting = refuse_late()
            if self.now >= deadline:  # the deadline: waiters leave, and the requests not answered yet are aborted
                waiting = 0
                admitted = [request for request in admitted if request[2] and (stream or request[1] == 0)]
            done = [request for request in admitted if request[1] == 0]
            admitted = [request for request in admitted if request[1] > 0]
            for held, request in enumerate(done):
                self._report(0, self.now - request[0])
                self._report(1, request[2] - request[0])
                served += 1
                made += tokens
                gaps_over += request[3] > due_s
                if capacity.finished(self.now - request[0], tokens, len(admitted) + len(done) - held, gap_s):
                    waiting = refuse_late()
        return Phase(served, made / (self.now - start), gaps_over)


GPU_BATCH = Engine(0.03, 0.0002)  # weights read once per step: a batch of 256 costs under three times one alone


@pytest.mark.parametrize("engine", [LOADED_CPU, CPU, MIXED, GPU_BATCH], ids=["loaded-cpu", "cpu", "mixed", "gpu"])
@pytest.mark.parametrize("n", [200, 1000])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after-whole-answers"])
def test_streams_are_served_as_admitting_everything_serves_them(engine: Engine, n: int, warm: bool) -> None:
    """A flood of streams (each with a 30 s read timeout) is answered at its first token: the limit for them
    runs up to the engine's batch while their pace stays well within the read timeout, on a cold gateway and
    on one whose limit whole answers set just before; fixed bounds (everything admitted) beside it. When the
    engine serves the whole flood in time either way, what counts is that all are served (the slow start's
    first window then costs a fast engine the flood's last fraction of a second, not an answer)."""
    adaptive, fixed = Batched(engine), Batched(engine, adaptive=False)
    if warm:
        adaptive.flood(n, stream=False)
        fixed.flood(n, stream=False)
    ours, theirs = adaptive.flood(n, stream=True), fixed.flood(n, stream=True)
    assert ours.served >= 0.9 * theirs.served
    if theirs.served < n:  # more than the engine serves by the deadline: its throughput is what is admitted
        assert ours.tokens_per_s >= 0.9 * theirs.tokens_per_s
    assert ours.gaps_over == 0


@pytest.mark.parametrize("engine", [LOADED_CPU, CPU, GPU_BATCH], ids=["loaded-cpu", "cpu", "gpu"])
def test_a_flood_of_streams_takes_the_limit_to_the_engine_s_batch_not_past_it(engine: Engine) -> None:
    gateway = Batched(engine)
    for _ in range(3):
        gateway.flood(1000, stream=True)
        assert gateway.capacity.limit == 128  # past the batch the engine only queues them


def test_a_client_s_short_read_timeout_does_not_shrink_the_limit_below_the_whole_answers_rule() -> None:
    """A hostile key streaming with a tiny read timeout: the streams' bound only raises the limit past the whole
    answers' rule (up to the batch), never lowers it beneath, so one key's header cannot shrink every key's limit."""
    paced = [1.0] * 64 + [3.0] * 64 + [6.0] * 64 + [20.0] * 64
    whole, tiny = Capacity(256, batch=128), Capacity(256, batch=128)
    for held in paced:
        whole.finished(held, 10, whole.limit)
        tiny.finished(held, 10, tiny.limit, gap_s=0.001)
    assert tiny.limit >= whole.limit


def test_a_stream_s_expected_wait_runs_to_its_first_token() -> None:
    capacity = Capacity(4, adaptive=False, engine_s=lambda: 8.0, first_token_s=lambda: 3.0)
    capacity.finished(8.0, 10, 4)
    assert capacity.expected_wait(10) == pytest.approx(20.0)  # a whole answer: until it is admitted
    assert capacity.expected_wait(10, stream=True) == pytest.approx(23.0)  # a stream: then its first token
    assert Capacity(4, adaptive=False, engine_s=lambda: 8.0).expected_wait(10, stream=True) == pytest.approx(20.0)


def test_whole_answers_keep_their_rule() -> None:
    """The same answers, whole or streamed with a read timeout no pace nears: whole answers' windows hold the
    engine's pace (TOLERANCE), streams' go to the batch; one whole answer in a window holds it to the engine's pace."""
    paced = [1.0] * 64 + [10.0] * 64 + [40.0] * 64  # 10 tokens each: from 0.1 s a token to 4 s
    whole, streams, mixed = Capacity(256, batch=128), Capacity(256, batch=128), Capacity(256, batch=128)
    for held in paced:
        whole.finished(held, 10, whole.limit)
        streams.finished(held, 10, streams.limit, gap_s=600.0)
        mixed.finished(held, 10, mixed.limit, gap_s=None if mixed._window[0] == 0 else 600.0)
    assert streams.limit == 128
    assert whole.limit < 128 * 0.75  # shrinking, a half at most each window
    assert mixed.limit == whole.limit


@pytest.mark.parametrize("engine", [LOADED_CPU, CPU], ids=["loaded-cpu", "cpu"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after-whole-answers"])
def test_streams_longer_than_their_deadline_raise_the_limit_at_their_first_tokens(engine: Engine, warm: bool) -> None:
    """Streams whose generation outlasts their deadline (64 tokens): a window of answers closes only when the first
    wave ends, past the deadline, so a limit starting low (or left low by whole answers) never grew and the rest of
    the flood waited out its deadline. Their first tokens, in long before, take it to the engine's batch."""
    fixed = Batched(engine, adaptive=False)
    if warm:
        fixed.flood(200, stream=False)
    theirs = fixed.flood(200, stream=True, tokens=64)
    for first_tokens in (False, True):
        adaptive = Batched(engine, first_tokens=first_tokens)
        if warm:
            adaptive.flood(200, stream=False)
        ours = adaptive.flood(200, stream=True, tokens=64)
        assert ours.gaps_over == 0
        if first_tokens:
            assert ours.served >= 0.9 * theirs.served
        elif engine is LOADED_CPU:  # (its first wave's 64 tokens take longer than the deadline)
            assert ours.served < 0.9 * theirs.served  # the end alone: the first wave only, as the limit stood


def test_a_stream_s_first_token_only_raises_the_limit() -> None:
    """A first token slower than a quarter of its client's read timeout (a key's tiny timeout, a slow engine) leaves
    the limit as it was: the answers' windows lower it, by the whole answers' rule at most."""
    for gap_s in (0.001, 1.0, 600.0):
        capacity = Capacity(256, batch=128)
        before = capacity.limit
        for _ in range(capacity.limit):
            capacity.started(10.0, capacity.limit, gap_s)
        assert capacity.limit == (128 if gap_s == 600.0 else before)
    idle = Capacity(256, batch=128)
    for _ in range(100):
        idle.started(0.1, 1, 600.0)  # the limit never held anyone back: nothing to grow for
    assert idle.limit == 32
    off = Capacity(256, adaptive=False)
    assert not off.started(0.1, 256, 600.0)
    assert off.limit == 256


async def test_a_stream_s_first_token_reaches_the_limit_and_a_whole_answer_s_does_not() -> None:
    app = app_with(FakeEngine())
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):  # type: ignore[no-untyped-def]
            scope["state"] = dict(state)
            await app(scope, receive, send)

        capacity = state["gateway"].models.backends["fake-model"].admission.capacity
        seen: list[float] = []
        capacity.started = lambda first_s, running, gap_s: seen.append(gap_s) or False
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://t") as client:
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            assert seen == []
            headers = {"X-Stainless-Read-Timeout": "12"}
            assert (await client.post("/v1/chat/completions", json={**body, "stream": True}, headers=headers)).status_code == 200
        assert seen == [12.0]


def test_past_the_engine_s_batch_a_stream_s_expected_wait_leaves_the_engine_s_queue_out() -> None:
    """Whole answers left the limit past the batch: the engine queues the rest, and its time per request and to a
    first token both hold that queue (the recent answers, the ones that queued, most). The batch frees at the time
    between them (its decode): a stream waits for `ahead` of those, then its first token. A whole answer's is as it was."""
    capacity = Capacity(256, adaptive=False, engine_s=lambda: 8.0, first_token_s=lambda: 4.0, batch=128)
    assert capacity.expected_wait(256, stream=True) == pytest.approx(256 * 4.0 / 128 + 4.0)
    assert capacity.expected_wait(256) == pytest.approx(256 * 8.0 / 256)
    within = Capacity(64, adaptive=False, engine_s=lambda: 8.0, first_token_s=lambda: 4.0, batch=128)
    assert within.expected_wait(64, stream=True) == pytest.approx(64 * 8.0 / 64 + 4.0)  # no queue past the batch
