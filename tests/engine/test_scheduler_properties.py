"""Property tests: random interleavings of add / step / abort against the scheduler, the KV-cache
manager and the block pool, with invariants checked after every action and the output oracle
checked for every request that finishes normally; with and without async scheduling (the model one
step behind the core, whose placeholders must never change an output)."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import (
    EOS,
    VOCAB,
    FakeRemoteConnector,
    ScriptedRequest,
    assert_nothing_leaks,
    check_invariants,
    expected_output,
    make_engine,
)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(4, 40),
        budget=st.integers(1, 48),
        max_num_seqs=st.integers(1, 8),
        enable_prefix_caching=st.booleans(),
        prefixes=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=24), min_size=1, max_size=3),
        async_scheduling=st.booleans(),
        scheduling_policy=st.sampled_from(["fcfs", "priority"]),
    )
    def setup(
        self,
        block_size,
        num_blocks,
        budget,
        max_num_seqs,
        enable_prefix_caching,
        prefixes,
        async_scheduling,
        scheduling_policy,
    ):
        self.connector = FakeRemoteConnector()
        self.max_placeholders = 2 if async_scheduling else 0
        self.engine = make_engine(
            self.connector,
            async_scheduling,
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=num_blocks * block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_prefix_caching=enable_prefix_caching,
            scheduling_policy=scheduling_policy,
        )
        self.scheduler = self.engine.scheduler
        self.prefixes = prefixes
        self.requests: dict[str, Request] = {}
        self.finished: set[str] = set()
        self.checked: set[str] = set()
        self.next_id = 0

    @rule(
        data=st.data(),
        max_tokens=st.integers(1, 12),
        min_tokens=st.integers(0, 3),
        ignore_eos=st.booleans(),
        stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2),
        remote=st.sampled_from([None, "do_remote_prefill", "do_remote_decode"]),
        delay=st.integers(0, 3),
        fail=st.booleans(),
        priority=st.integers(-2, 2),
    )
    def add(self, data, max_tokens, min_tokens, ignore_eos, stop_token_ids, remote, delay, fail, priority):
        max_prompt = self.scheduler.config.max_model_len - 1
        prefix = data.draw(st.sampled_from(self.prefixes))[:max_prompt]
        suffix = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=max_prompt - len(prefix)))
        prompt = prefix + suffix
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            ignore_eos=ignore_eos,
            stop_token_ids=stop_token_ids,
        )
        request_id = f"r{self.next_id}"
        self.next_id += 1
        script = {remote: True, "delay": delay, "fail": fail} if remote else {}
        request = ScriptedRequest(request_id, prompt, params, EOS, script=script, priority=priority)
        self.engine.add_request(request)
        self.requests[request_id] = request

    @rule(num_steps=st.integers(1, 8))
    def step(self, num_steps):
        for _ in range(num_steps):
            self._step()

    @rule()
    def drain(self):
        for _ in range(1000):
            if not self.engine.has_work():
                return
            self._step()
            check_invariants(self.scheduler, self.max_placeholders)
        raise AssertionError("the engine did not finish its work in 1000 steps")

    def _step(self):
        for output in self.engine.step():
            request = self.requests[output.request_id]
            assert output.request_id not in self.finished
            if output.finish_reason is not None:
                self.finished.add(output.request_id)
                tokens, reason = expected_output(request)
                assert request.output_token_ids == tokens, request
                assert output.finish_reason == reason
                self.checked.add(output.request_id)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        self.engine.abort_requests([request_id])
        self.finished.add(request_id)

    @invariant()
    def core_invariants(self):
        if hasattr(self, "scheduler"):
            check_invariants(self.scheduler, self.max_placeholders)

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        # Everything ends one way or another; afterwards no block may be owned.
        self.engine.abort_requests(list(self.requests))
        for _ in range(20):
            if not self.engine.has_work():
                break
            self.engine.step()
            check_invariants(self.scheduler, self.max_placeholders)
        assert_nothing_leaks(self.scheduler)
        stats = self.scheduler.make_stats()
        event(f"preempted: {stats.num_preemptions > 0}")
        event(f"prefix hits: {stats.prefix_cache_hits > 0}")
        event(f"remote loads: {self.connector.num_loads > 0}")
        event(f"checked outputs: {min(len(self.checked), 5)}")
        event(f"async scheduling: {self.engine.async_scheduling}")
        event(f"policy: {self.scheduler.config.scheduling_policy}")


SchedulerMachine.TestCase.settings = settings(
    settings.default,
    stateful_step_count=max(60, settings.default.stateful_step_count),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerProperties = SchedulerMachine.TestCase


@st.composite
def workloads(draw):
    """A whole run at once: an engine configuration and requests with arrival and abort steps."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_blocks = draw(st.integers(4, 64))
    max_model_len = num_blocks * block_size
    prefixes = draw(
        st.lists(
            st.lists(st.integers(0, VOCAB - 1), min_size=block_size, max_size=3 * block_size), min_size=1, max_size=4
        )
    )
    requests = []
    for _ in range(draw(st.integers(1, 30))):
        prefix = draw(st.sampled_from(prefixes))[: max_model_len - 1]
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), max_size=min(40, max_model_len - 1 - len(prefix))))
        requests.append(
            {
                "prompt": prefix + suffix,
                "max_tokens": draw(st.integers(1, 16)),
                "ignore_eos": draw(st.booleans()),
                "arrival": draw(st.integers(0, 30)),
                "abort": draw(st.one_of(st.none(), st.integers(0, 40))),
                "remote": draw(st.sampled_from([None, None, "do_remote_prefill", "do_remote_decode"])),
                "delay": draw(st.integers(0, 4)),
                "fail": draw(st.booleans()),
            }
        )
    config = {
        "num_blocks": num_blocks,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "max_num_seqs": draw(st.integers(1, 16)),
        "max_num_batched_tokens": draw(st.integers(1, 64)),
        "enable_prefix_caching": draw(st.booleans()),
    }
    return config, requests, draw(st.booleans())


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workload_keeps_invariants_and_outputs(workload):
    config, specs, async_scheduling = workload
    engine = make_engine(FakeRemoteConnector(), async_scheduling, **config)
    requests = {}
    finished: dict[str, str] = {}
    aborted: set[str] = set()
    last_event = max(max(s["arrival"], s["abort"] or 0) for s in specs)
    for step in range(last_event + 2000):
        for index, spec in enumerate(specs):
            request_id = f"r{index}"
            if spec["arrival"] == step:
                params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"])
                script = {spec["remote"]: True, "delay": spec["delay"], "fail": spec["fail"]} if spec["remote"] else {}
                requests[request_id] = ScriptedRequest(request_id, spec["prompt"], params, EOS, script=script)
                engine.add_request(requests[request_id])
            if spec["abort"] == step and request_id in requests:
                engine.abort_requests([request_id])
                aborted.add(request_id)
        for output in engine.step():
            if output.finish_reason is not None:
                finished[output.request_id] = output.finish_reason
        check_invariants(engine.scheduler, 2 if async_scheduling else 0)
        if step > last_event and not engine.has_work():
            break
    else:
        raise AssertionError("the workload did not finish")
    for request_id, reason in finished.items():
        tokens, expected_reason = expected_output(requests[request_id])
        assert requests[request_id].output_token_ids == tokens
        assert reason == expected_reason
    assert set(finished) | aborted == set(requests), "a request neither finished nor was aborted"
    assert_nothing_leaks(engine.scheduler)
    event(f"preemptions: {min(engine.scheduler.num_preemptions, 3)}")
    event(f"prefix hits: {engine.scheduler.kv_cache_manager.prefix_cache_hits > 0}")
    event(f"async scheduling: {async_scheduling}")
