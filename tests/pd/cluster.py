"""Real P/D clusters for tests: `pdserve prefill|decode|router` processes on 127.0.0.1, as pods run
them (pdserve/testing/processes.py), plus small HTTP helpers. A test module starts its cluster once."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.api.auth import ROUTER_AUTH_HEADER, RouterSigner
from pdserve.api.keys import ENGINE_FILES, KEYS_ENV, ROUTER_FILES, load_router_signing, new_bundle, write_bundle
from pdserve.launcher import free_port
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.metrics import scrape as metrics  # noqa: F401 - tests/fuzz still import it from here
from pdserve.testing.processes import Process, cpu_engine_flags, engine_argv, router_argv, server_env

ENGINE_FLAGS = cpu_engine_flags("8MiB", max_model_len=1024)  # room for a tools section (test_pd_parity)


@dataclass
class Cluster:
    prefills: list[Process] = field(default_factory=list)
    decodes: list[Process] = field(default_factory=list)
    router: Process | None = None
    # Where the keys are: all/ (the whole bundle, for tests), router/ and engine/ (each role's files, as given).
    keys: Path | None = None

    def router_header(self, url: str, path: str, data: bytes, signed: bool = False) -> dict[str, str]:
        """The router's credential on ``data`` POSTed to ``path`` of the engine at ``url`` (its id and leg key
        from /health): a test plays the router's part on one leg. A leg MAC, as the router sends, or with
        ``signed`` an Ed25519 signature (what it sends an engine whose leg key it does not know)."""
        assert self.keys is not None
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            health = json.loads(response.read())
        signer = RouterSigner(load_router_signing(self.keys / "all"))
        if signed:
            return {ROUTER_AUTH_HEADER: signer.header("POST", path, data, health["engine_id"])}
        return {ROUTER_AUTH_HEADER: signer.leg_header("POST", path, data, health["engine_id"], health["leg_key"])}

    def write_keys(self, bundle: dict[str, str]) -> None:
        """Replace the keys every process reads (each role's files in its folder), as a Secret's update does."""
        assert self.keys is not None
        write_bundle(self.keys / "all", bundle)
        write_bundle(self.keys / "router", bundle, ROUTER_FILES)
        write_bundle(self.keys / "engine", bundle, ENGINE_FILES)

    @classmethod
    def start(
        cls,
        tmp_path,
        transport: str = "nixl",
        num_prefill: int = 1,
        num_decode: int = 1,
        prefill_flags: tuple[str, ...] = (),
        decode_flags: tuple[str, ...] = (),
        decode_faults: str = "",
        with_router: bool = True,
        keys: bool = False,
        router_flags: tuple[str, ...] = (),
        model: str | None = None,
        engine_env: dict[str, str] | None = None,
    ) -> Cluster:
        """``keys``: fresh keys, the router's files for the router and the engines' for the engines (in their
        environment); False: none (loopback only). ``model``: a model folder (the demo model's tokenizer); None:
        the demo model. ``engine_env``: more environment for the engines."""
        demo = str(ensure_demo_model())
        tokenizer = ("--tokenizer", demo) if model is not None else ()
        model = model or demo
        env, router_env = dict(server_env(), **(engine_env or {})), server_env()
        cluster = cls()
        if keys:
            folder = cluster.keys = Path(tmp_path) / "keys"
            cluster.write_keys(new_bundle())
            env = dict(env, **{KEYS_ENV: str(folder / "engine")})
            router_env = dict(router_env, **{KEYS_ENV: str(folder / "router")})
        for role, count, flags in (("prefill", num_prefill, prefill_flags), ("decode", num_decode, decode_flags)):
            role_env = dict(env, PDSERVE_KV_FAULTS=decode_faults) if role == "decode" and decode_faults else env
            for index in range(count):
                port = free_port()
                argv = engine_argv(role, port, model, *ENGINE_FLAGS, *tokenizer, *flags, transport=transport)
                process = Process(f"{role}-{index}", argv, role_env, port, str(tmp_path / f"{role}-{index}.log"))
                (cluster.prefills if role == "prefill" else cluster.decodes).append(process)
        try:
            for process in cluster.prefills + cluster.decodes:
                process.start()
            for process in cluster.prefills + cluster.decodes:
                process.wait_healthy()
            if with_router:
                port = free_port()
                argv = router_argv(
                    port, [p.url for p in cluster.prefills], [d.url for d in cluster.decodes], *router_flags
                )
                cluster.router = Process("router", argv, router_env, port, str(tmp_path / "router.log"))
                cluster.router.start()
                cluster.router.wait_healthy()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def stop(self) -> None:
        for process in [self.router, *self.prefills, *self.decodes]:
            if process is not None:
                process.stop()


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def wait_for(condition, timeout: float, message: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, message
        time.sleep(interval)


def assert_a_cached_prefix_is_not_pulled_again(decode_url: str, complete) -> None:
    """Two prompts sharing 10 full blocks, each completed through ``complete(prompt)``: the second pulls
    only its 2 blocks past them (the rest is in the decode engine's prefix cache)."""
    import random

    from pdserve.testing.metrics import scrape

    rng = random.Random(11)
    prefix = [rng.randrange(10, 1000) for _ in range(160)]  # 10 full blocks

    def pulled() -> float:
        return scrape(decode_url)["pdserve_kv_transfer_bytes_total"]

    before = pulled()
    complete(prefix + [rng.randrange(10, 1000) for _ in range(20)])  # 180 tokens: 12 blocks
    first = pulled() - before
    complete(prefix + [rng.randrange(10, 1000) for _ in range(20)])  # same 10 blocks, new tail
    second = pulled() - first - before
    assert first > 0 and second == first / 12 * 2, (first, second)


def assert_disaggregated_like_colocated(
    cluster: Cluster, prompts: list[list[int]], expected: list[str], max_tokens: int
):
    """Greedy completions of ``prompts`` through the router equal ``expected`` (colocated serving's
    texts), every one went prefill → decode with its KV pulled and none failed, and every hold on
    the prefill engine ends without its lease expiring."""
    from pdserve.testing.metrics import scrape

    got = []
    for prompt in prompts:
        body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        status, answer = post(cluster.router.url + "/v1/completions", body)
        assert status == 200, answer
        got.append(answer["choices"][0]["text"])
    assert got == expected
    assert scrape(cluster.router.url)['pdserve_router_requests_total{path="disagg"}'] == len(prompts)
    decode = scrape(cluster.decodes[0].url)
    assert decode["pdserve_kv_transfer_bytes_total"] > 0 and decode["pdserve_kv_transfer_failures_total"] == 0
    prefill_url = cluster.prefills[0].url
    wait_for(lambda: scrape(prefill_url)["pdserve_kv_blocks_held_for_remote"] == 0, 10, "prefill holds to end")
    assert scrape(prefill_url)["pdserve_kv_lease_expirations_total"] == 0
