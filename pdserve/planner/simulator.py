"""A discrete-event simulation of a deployment, run by the engine's real `Scheduler`.

Each simulated engine is a real `Scheduler` (same configuration as the profiled engine: KV
blocks, block size, batch limits, prefix caching), so queueing, chunked prefill, batching, KV
capacity, prefix hits and preemption are the real code's. Only the forward pass is simulated: a
step takes the time the profile's step model gives for what the scheduler put in it, and
samples one placeholder token per request that reached the end of its known tokens.

Deployments: `colocated` engines (each request prefilled and decoded on one engine), or
`prefill` + `decode` pools. For P/D, as the router does: the decode engine is chosen when the
request arrives (fewest requests in flight), the prefill engine by fewest prompt tokens queued;
the prefill engine runs the prompt with max_tokens 1 and holds its blocks; the pull takes the
profile's transfer time for the prompt's KV bytes; then the decode engine gets the request with
all but the last prompt token loaded (it recomputes that one for its logits), and the prefill
engine's hold ends. TTFT is arrival to the first token of the decode (or colocated) engine;
TPOT is the mean gap between the rest.

KV tiers: the part of a prompt a tier holds (`Arrival.tier_tokens`) that the prefill (or colocated)
engine's own prefix cache lacks is loaded, not computed. The load is synchronous: the step that first
schedules the request also lasts `Profile.tier_load_seconds` of it, so the engine's other requests wait
too (an asynchronous load would cost them less; the plan errs large).

What it does not see: the router's prefix-aware choice (routing here is by load only), network
contention between concurrent pulls, async scheduling's overlap, and CPU contention in the
API processes.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.kvtransfer.base import ConnectorRequest, KVConnectorOutput, KVConnectorScheduler, NoKVConnector
from pdserve.planner.profile import Profile
from pdserve.planner.workload import Arrival
from pdserve.worker.interface import NO_TOKEN, ModelRunnerOutput

TOKEN = 7  # what every simulated step samples (no EOS: lengths come from the workload)


@dataclass(frozen=True)
class Deployment:
    """Replica counts: a colocated pool, or prefill and decode pools."""

    prefill: int = 0
    decode: int = 0
    colocated: int = 0

    def __post_init__(self) -> None:
        disaggregated = self.prefill > 0 and self.decode > 0
        if disaggregated == (self.colocated > 0) or min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("a deployment is colocated engines, or prefill and decode engines (all counts >= 0)")

    def __str__(self) -> str:
        return f"{self.colocated} colocated" if self.colocated else f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9  # the share of requests that must meet both


@dataclass
class RequestTimes:
    arrival: float
    output_tokens: int
    first_token: float | None = None
    finish: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.finish is None:
            return None
        return (self.finish - self.first_token) / max(1, self.output_tokens - 1)


@dataclass
class SimulationResult:
    deployment: Deployment
    requests: list[RequestTimes]
    horizon_s: float
    utilisation: dict[str, float]  # pool -> mean share of time its engines were computing
    steps: int
    wall_s: float
    preemptions: int
    stopped_early: bool = False  # it ended once the SLO was certainly missed (the figures are partial)

    def attained(self, slo: SLO) -> float:
        """The share of requests that finished within both SLOs."""
        met = sum(
            1
            for r in self.requests
            if r.finish is not None and r.ttft is not None and r.ttft <= slo.ttft_s and (r.tpot or 0.0) <= slo.tpot_s
        )
        return met / len(self.requests) if self.requests else 1.0

    def meets(self, slo: SLO) -> bool:
        return self.attained(slo) >= slo.attainment

    def percentile(self, metric: str, q: float) -> float:
        """The q-quantile (0..1) of "ttft" or "tpot"; unanswered or unfinished requests count as infinitely late."""
        # TPOT: of the requests that got a first token and have more to come.
        counted = [r for r in self.requests if metric == "ttft" or (r.output_tokens > 1 and r.first_token is not None)]
        values = sorted(float("inf") if getattr(r, metric) is None else getattr(r, metric) for r in counted)
        if not values:
            return 0.0
        return values[min(len(values) - 1, int(q * len(values)))]

    def summary(self) -> dict[str, Any]:
        return {
            "deployment": str(self.deployment),
            "requests": len(self.requests),
            "finished": sum(r.finish is not None for r in self.requests),
            **{f"{m}_p{int(q * 100)}_s": self.percentile(m, q) for m in ("ttft", "tpot") for q in (0.5, 0.9, 0.99)},
            "utilisation": self.utilisation,
            "preemptions": self.preemptions,
            "steps": self.steps,
            "steps_per_s": self.steps / self.wall_s if self.wall_s else 0.0,
            "stopped_early": self.stopped_early,
        }


class _Tiers(NoKVConnector):
    """Prefill and colocated engines: a prompt's prefix that the KV tiers hold loads where the engine's
    own cache lacks it; the loads of the requests admitted by a step are counted for its duration."""

    def __init__(self, arrivals: Sequence[Arrival]) -> None:
        self.arrivals = arrivals
        self.loaded = 0  # tokens loaded for the requests admitted since `take_loaded`

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        return max(0, self.arrivals[int(request.request_id)].tier_tokens - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.loaded += num_external_tokens

    def take_loaded(self) -> int:
        loaded, self.loaded = self.loaded, 0
        return loaded


class _HoldForDecode(_Tiers):
    """Prefill side: a finished prompt's blocks are held until the simulated pull has read them."""

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int], finish_reason: str
    ) -> tuple[bool, dict[str, Any] | None]:
        return bool(block_ids), None


class _RemotePrompt(NoKVConnector):
    """Decode side: a request is queued once its pull has landed, so all of its prompt but the last
    token (which the decode recomputes for its logits) loads synchronously."""

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        return max(0, len(request.prompt_token_ids) - 1 - num_computed_tokens), False


class _Engine:
    def __init__(self, pool: str, index: int, profile: Profile, connector: KVConnectorScheduler) -> None:
        self.pool, self.index, self.profile = pool, index, profile
        self.scheduler = Scheduler(profile.engine.scheduler_config(), connector)
        self.tiers = connector if isinstance(connector, _Tiers) else None
        self.busy = False
        self.busy_s = 0.0
        self.in_flight = 0  # requests assigned here and not finished (decode choice, as the router counts)
        self.sent: set[str] = set()  # holds whose pull ended, reported to the scheduler with the next step
        self.current: Any = None

    def queued_prompt_tokens(self) -> int:
        waiting = sum(r.num_prompt_tokens - r.num_computed_tokens for r in self.scheduler.waiting)
        running = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.scheduler.running)
        return waiting + running


@dataclass(order=True)
class _Event:
    time: float
    order: int
    kind: str = field(compare=False)
    engine: _Engine | None = field(compare=False, default=None)
    index: int = field(compare=False, default=-1)


def simulate(
    deployment: Deployment,
    arrivals: Sequence[Arrival],
    profile: Profile,
    decode_profile: Profile | None = None,
    drain_limit_s: float | None = None,
    give_up: SLO | None = None,
) -> SimulationResult:
    """Run `arrivals` through `deployment`; engines of the decode pool use `decode_profile` when given.

    Requests still unfinished `drain_limit_s` after the last arrival (default: as long as the trace,
    at least 60 s) are left unfinished: an overloaded deployment ends, and its requests miss the SLO.
    With `give_up`, the run stops as soon as more requests have certainly missed that SLO than its
    attainment allows (the result then says `stopped_early`): a search needs no more than that.
    """
    started = time.perf_counter()
    decode_profile = decode_profile or profile
    if any(a.tier_tokens for a in arrivals):
        profile.tier_load_seconds(1)  # refuses tier hits without a bandwidth before anything runs
    if deployment.colocated:
        front = [_Engine("colocated", i, profile, _Tiers(arrivals)) for i in range(deployment.colocated)]
        back: list[_Engine] = []
    else:
        front = [_Engine("prefill", i, profile, _HoldForDecode(arrivals)) for i in range(deployment.prefill)]
        back = [_Engine("decode", i, decode_profile, _RemotePrompt()) for i in range(deployment.decode)]
    times = [RequestTimes(a.time, a.output_tokens) for a in arrivals]
    decode_of: dict[int, _Engine] = {}
    order = itertools.count()
    events: list[_Event] = [_Event(a.time, next(order), "arrive", index=i) for i, a in enumerate(arrivals)]
    heapq.heapify(events)
    last_arrival = arrivals[-1].time if arrivals else 0.0
    limit = last_arrival + (drain_limit_s if drain_limit_s is not None else max(60.0, last_arrival))
    steps = preemptions = 0
    now = 0.0
    # Misses so far, for give_up: finished requests over a target, and (counted at each arrival)
    # requests still without a first token past the TTFT target. `unanswered` holds request indices
    # in arrival order; answered ones are dropped from its front as the checks pass them.
    allowed_misses = len(arrivals) if give_up is None else int((1 - give_up.attainment) * len(arrivals))
    finished_late = 0
    unanswered: collections.deque[int] = collections.deque()
    stopped_early = False

    def certainly_missed(now: float) -> int:
        assert give_up is not None
        while unanswered and times[unanswered[0]].first_token is not None:
            unanswered.popleft()
        late = 0
        for index in unanswered:  # in arrival order: stop at the first one still within the target
            if now - times[index].arrival <= give_up.ttft_s or finished_late + late > allowed_misses:
                break
            if times[index].first_token is None:
                late += 1
        return finished_late + late

    def kick(engine: _Engine) -> None:
        nonlocal steps
        if engine.busy or not (engine.scheduler.has_work() or engine.sent):
            return
        output = engine.scheduler.schedule()
        if not output.requests and not engine.sent:
            return  # nothing it can run now (its queue waits for blocks that a finishing step frees)
        news, starts = output.num_scheduled_tokens, output.start_positions
        duration = engine.profile.step.seconds(news, starts) if output.requests else 0.0
        if engine.tiers is not None:
            duration += engine.profile.tier_load_seconds(engine.tiers.take_loaded())
        engine.busy, engine.current = True, output
        engine.busy_s += duration
        steps += 1
        heapq.heappush(events, _Event(now + duration, next(order), "step", engine))

    def finish_step(engine: _Engine) -> None:
        output = engine.current
        sampled = [
            TOKEN if start + new >= request.num_tokens else NO_TOKEN
            for request, new, start in zip(
                output.requests, output.num_scheduled_tokens, output.start_positions, strict=True
            )
        ]
        connector_output = KVConnectorOutput(finished_sending=engine.sent) if engine.sent else None
        engine.sent = set()
        engine.busy, engine.current = False, None
        for result in engine.scheduler.update_from_output(output, ModelRunnerOutput(sampled, connector_output)):
            index = int(result.request_id)
            if engine.pool == "prefill":
                if result.finish_reason is not None:
                    pull = engine.profile.transfer.seconds(
                        len(arrivals[index].prompt) * engine.profile.engine.kv_bytes_per_token
                    )
                    heapq.heappush(events, _Event(now + pull, next(order), "pulled", engine, index))
                continue
            record = times[index]
            if record.first_token is None:
                record.first_token = now
            if result.finish_reason is not None:
                record.finish = now
                if engine.pool == "decode":
                    engine.in_flight -= 1
                if give_up is not None and not (
                    (record.ttft or 0.0) <= give_up.ttft_s and (record.tpot or 0.0) <= give_up.tpot_s
                ):
                    nonlocal finished_late
                    finished_late += 1

    while events:
        event = heapq.heappop(events)
        now = event.time
        if now > limit:
            break
        if event.kind == "arrive":
            if give_up is not None:
                unanswered.append(event.index)
                if certainly_missed(now) > allowed_misses:
                    stopped_early = True
                    break
            arrival = arrivals[event.index]
            if deployment.colocated:
                engine = min(front, key=lambda e: (len(e.scheduler.running) + len(e.scheduler.waiting), e.index))
                params = SamplingParams(max_tokens=arrival.output_tokens, ignore_eos=True)
            else:
                decode = min(back, key=lambda e: (e.in_flight, e.index))
                decode.in_flight += 1
                decode_of[event.index] = decode
                engine = min(front, key=lambda e: (e.queued_prompt_tokens(), e.index))
                params = SamplingParams(max_tokens=1, ignore_eos=True)
            engine.scheduler.add_request(Request(str(event.index), arrival.prompt, params, arrival_time=now))
            kick(engine)
        elif event.kind == "step":
            assert event.engine is not None
            finish_step(event.engine)
            preemptions = sum(e.scheduler.num_preemptions for e in front + back)
            kick(event.engine)
        else:  # "pulled": the decode engine has the prompt's KV; the prefill engine may free it
            assert event.engine is not None
            event.engine.sent.add(str(event.index))
            kick(event.engine)
            arrival = arrivals[event.index]
            decode = decode_of.pop(event.index)
            params = SamplingParams(max_tokens=arrival.output_tokens, ignore_eos=True)
            decode.scheduler.add_request(Request(str(event.index), arrival.prompt, params, arrival_time=now))
            kick(decode)
    horizon = max(now, last_arrival, 1e-9)
    utilisation = {
        pool: statistics.fmean(e.busy_s for e in engines) / horizon
        for pool, engines in (("colocated" if deployment.colocated else "prefill", front), ("decode", back))
        if engines
    }
    wall = time.perf_counter() - started
    return SimulationResult(deployment, times, horizon, utilisation, steps, wall, preemptions, stopped_early)
