"""Chaos: a stranger floods every engine's side channel while the prefill engine is stopped (SIGSTOP) under load.
Real router, prefill and decode processes with keys (NIXL); the prefill holds blocks for 8 s, decode bounds each
handshake and transfer by 3 s; the flood is fresh, well-addressed, wrongly keyed frames of near the largest size the
side channel takes (each costs the receiving agent an HMAC), from four connections per engine, for the whole run.

Two waves of 16 requests around the stop: each ends within 60 s with 200 or a JSON error and at least 24 succeed;
every 200 carries the tokens the same request gets on a quiet cluster afterwards (greedy: zero wrong answers);
after SIGCONT and a lease, no engine owns, holds, quarantines or waits for anything, and the flood was refused
frame by frame (counted), never answered."""

from __future__ import annotations

import json
import urllib.request

import pytest

from pdserve.bench.flood import SideChannelFlood
from pdserve.testing.metrics import idle, metric, scrape
from tests.chaos.load import request, two_waves_around_a_stop
from tests.pd.cluster import Cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LEASE_S = 8
FRAME_BYTES = 60 * 1024  # under any engine's side-channel bound (64 KiB + 18 B a block)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster.start(
        tmp_path_factory.mktemp("chaos-flood"),
        prefill_flags=("--kv-lease-seconds", str(LEASE_S)),
        decode_flags=("--kv-transfer-timeout", "3"),
        keys=True,
    )
    yield cluster
    cluster.stop()


def _side_channel(process) -> tuple[str, str]:
    """(endpoint, agent id) of an engine's side channel."""
    port = process.argv[process.argv.index("--kv-side-channel-port") + 1]
    with urllib.request.urlopen(process.url + "/health", timeout=10) as response:
        engine_id = json.loads(response.read())["engine_id"]
    return f"tcp://127.0.0.1:{port}", engine_id


def test_a_flood_and_a_stopped_prefill_together_cost_no_wrong_answer_and_leave_nothing_held(cluster):
    router, prefill, decode = cluster.router.url, cluster.prefills[0], cluster.decodes[0]
    flood = SideChannelFlood([_side_channel(prefill), _side_channel(decode)], FRAME_BYTES).start()
    try:
        wait_for(lambda: flood.sent > 500, 20, "the flood did not start")
        results = two_waves_around_a_stop(router, prefill.process.pid)
        succeeded = {number: answer for number, (_, status, answer) in results.items() if status == 200}
        slowest = max(seconds for seconds, _, _ in results.values())
        print(f"flood + stopped prefill: {len(succeeded)}/32 succeeded, slowest {slowest:.1f} s, {flood.sent} frames")
        assert len(succeeded) >= 24
        # Settled under the flood: nothing owned, waiting, held or quarantined once a lease has passed.
        for engine in (decode.url, prefill.url):
            wait_for(lambda engine=engine: idle(scrape(engine)), LEASE_S + 25, f"{engine} did not settle")
            assert metric(scrape(engine), "pdserve_kv_blocks_quarantined") == 0
        refused = [
            metric(scrape(engine), "pdserve_kv_side_channel_rejected_total", reason="unauthenticated")
            for engine in (prefill.url, decode.url)
        ]
    finally:
        flood.close()
    assert flood.answers == 0  # a stranger learns nothing, not even "refused"
    assert all(count > 100 for count in refused), refused
    # Zero wrong answers: each one equals what the same request gets on the quiet cluster (greedy, to length).
    quiet: dict = {}
    for number in succeeded:
        request(router, number, quiet)
        assert quiet[number][1] == 200, quiet[number]
        assert succeeded[number]["choices"][0]["text"] == quiet[number][2]["choices"][0]["text"], number
