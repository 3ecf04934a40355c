"""A drill (`make chaos`; it depends on the machine's speed, so it is not in `make test`): a flood is
answered within its deadline (#26 item 5, #39 item 1): 200 and 1,000 chat requests at once, whole
and streamed, against a gateway on the real engine with the default settings, each sending its
deadline as the openai SDK sends its timeout (`X-Stainless-Read-Timeout`). Each gets an answer
before its client gives up (the deadline plus a margin for the network and the loop): a 200, or a
429/503 with Retry-After; no client times out, and /health answers throughout. The figures (`-s`
prints them) are `benchmarks/flood.py`'s, whose run beside fixed bounds is in benchmarks/RESULTS.md.
What it guards without timing: tests/unit/test_capacity.py (the limit, on a simulated engine) and
tests/unit/test_deadlines.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.flood import flood
from tests.integration.conftest import gateway_process

pytestmark = pytest.mark.drill
DEADLINE_S = 30
MARGIN_S = 5  # the client's wait beyond the deadline: the gateway's answer on its way on a busy machine
HEALTH_P50_S = 1  # /health's median while the flood runs (at worst it waits for the loop: under DEADLINE_S)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {"GATEWAY_LOG_FORMAT": "json", "GATEWAY_ENGINE__ENFORCE_EAGER": "true"}
    with gateway_process(tmp_path_factory.mktemp("flood"), env) as (base, _):
        yield base


@pytest.mark.parametrize("count", [200, 1000])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streams"])
async def test_a_flood_is_answered_within_its_deadline(server: str, count: int, stream: bool) -> None:
    result = await flood(server, count, stream, DEADLINE_S, MARGIN_S)
    summary = result.summary()
    print(f"flood of {count} {'streams' if stream else 'whole'}: {summary}")
    assert summary["timeouts"] == 0, summary
    assert summary["others"] == 0, summary  # 200, 429 or 503 only
    assert summary["answered"] > 0, summary
    assert summary["refused_without_retry_after"] == 0, summary
    assert result.health_s, "/health was never answered while the flood ran"
    assert summary["health_p50_ms"] < HEALTH_P50_S * 1000, summary
    assert summary["health_max_ms"] < DEADLINE_S * 1000, summary
