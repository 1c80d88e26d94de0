"""The autoscaler's decisions (pure: windows of synthetic traffic in, replicas out) and its reading of
the routers' metrics: load rising then falling gives the planner's pairs, in bounded steps, shrinking
only after the stabilisation, never in cooldown or mid-rollout; corrections follow measured latency."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.operator.autoscaler import Memory, Settings, decide, settled
from pdserve.operator.load import Counts, Window, summed, window_of
from pdserve.operator.spec import with_defaults
from pdserve.planner.search import plan_disaggregated
from pdserve.planner.simulator import SLO
from pdserve.planner.workload import Buckets, WorkloadSpec
from tests.operator.helpers import spec
from tests.planner.test_planner import profile

# An engine 4x slower than the planner tests' (fewer requests to simulate for the same sizes).
ENGINE = profile().scaled(4)
PROFILES = {"prefill": ENGINE, "decode": ENGINE}
SLO_FIELDS = {"ttftSeconds": 0.8, "tpotSeconds": 0.06, "attainment": 0.9}
PROMPT, OUTPUT = 1024, 64


def settings(**changes) -> Settings:
    autoscaling = {
        "enabled": True,
        "slo": SLO_FIELDS,
        "profile": {"configMap": "profile"},
        "horizonSeconds": 10,
        "prefill": {"maxReplicas": 6},
        "decode": {"maxReplicas": 8},
        **changes,
    }
    return Settings.of(with_defaults(spec(autoscaling=autoscaling))["autoscaling"])


def lengths(value: float, count: float) -> Buckets:
    """`count` observations, all `value`, in the 1.33x buckets the routers use."""
    return Buckets.from_cumulative({value / 1.2: 0.0, value * 1.2: count, float("inf"): count})


def window(rate: float, seconds: float = 60.0, ttft: float | None = None, tpot: float | None = None) -> Window:
    count = rate * seconds
    timing = count if ttft is not None else 0.0
    return Window(
        seconds,
        count,
        lengths(PROMPT, count),
        lengths(OUTPUT, count),
        lengths(ttft or 1.0, timing),
        lengths(tpot or 1.0, timing),
    )


def planned(rate: float, current_settings: Settings) -> tuple[int, int]:
    """The planner's own answer for the traffic `window(rate)` describes."""
    traffic = window(rate)
    arrivals = WorkloadSpec(
        rate, traffic.prompt, traffic.generation, current_settings.horizon_s, max_model_len=2048
    ).arrivals()
    plan = plan_disaggregated(arrivals, current_settings.slo, ENGINE, ENGINE, max_prefill=6, max_decode=8)
    assert plan.deployment is not None
    return plan.deployment.prefill, plan.deployment.decode


def test_load_rising_then_falling_follows_the_plan_in_bounded_steps():
    chosen = settings(maxStep=1, scaleDownDecisions=2)
    memory = Memory()
    current = {"prefill": 1, "decode": 1}
    high = planned(15, chosen)
    assert high[0] + high[1] >= 4  # enough to need several steps
    history = []
    for rate in (15, 15, 15, 15, 15, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5):
        decision = decide(chosen, memory, current, window(rate), PROFILES, rolling=False, cooling=False)
        for role in ("prefill", "decode"):
            assert abs(decision.replicas[role] - current[role]) <= 1  # one replica per pool per decision
        history.append((rate, decision.target, decision.replicas, decision.reason))
        current = decision.replicas
        if rate == 15 and decision.target is not None:
            assert (decision.target["prefill"], decision.target["decode"]) == high
    # Rising: it reached the plan for 15 req/s.
    at_peak = [replicas for rate, _, replicas, _ in history if rate == 15][-1]
    assert (at_peak["prefill"], at_peak["decode"]) == high, history
    # Falling: nothing shrank on the first low decision (the last two plans must both allow it) ...
    first_low = next(i for i, (rate, *_) in enumerate(history) if rate < 1)
    assert history[first_low][2] == at_peak
    # ... then down one step at a time to the plan for 0.5 req/s.
    low = planned(0.5, chosen)
    assert (current["prefill"], current["decode"]) == low, history


def test_no_change_in_cooldown_or_mid_rollout_and_no_traffic_goes_to_the_minimum():
    chosen = settings(prefill={"minReplicas": 2, "maxReplicas": 6}, scaleDownDecisions=1)
    current = {"prefill": 3, "decode": 3}
    for rolling, cooling, reason in ((True, False, "RolloutInProgress"), (False, True, "Cooldown")):
        decision = decide(chosen, Memory(), current, window(15), PROFILES, rolling=rolling, cooling=cooling)
        assert (decision.replicas, decision.reason) == (current, reason)
    assert decide(chosen, Memory(), current, None, PROFILES, False, False).reason == "CollectingBaseline"
    idle = decide(chosen, Memory(), current, window(0), PROFILES, rolling=False, cooling=False)
    assert idle.replicas == {"prefill": 2, "decode": 1} and idle.reason == "Scaled"  # maxStep 2 allows it
    assert idle.target == {"prefill": 2, "decode": 1}


def test_slos_nothing_in_bounds_meets_ask_for_the_most_allowed():
    chosen = settings(slo={**SLO_FIELDS, "ttftSeconds": 1e-4, "tpotSeconds": 1e-4}, maxStep=100)
    decision = decide(chosen, Memory(), {"prefill": 1, "decode": 1}, window(15), PROFILES, False, False)
    assert decision.replicas == {"prefill": 6, "decode": 8}


def test_measured_latency_corrects_the_profile_within_its_bounds():
    chosen = settings(correction={"min": 0.5, "max": 2.0})
    memory = Memory()
    current = {"prefill": 2, "decode": 2}
    # Latencies far above anything the profile predicts: both factors rise, and stop at the bound.
    for _ in range(3):
        decide(chosen, memory, current, window(5, ttft=5.0, tpot=1.0), PROFILES, False, True)
    assert memory.correction == {"prefill": 2.0, "decode": 2.0}
    # A slower engine needs more of them than the profile alone says.
    slower = decide(chosen, memory, current, window(15, ttft=5.0, tpot=1.0), PROFILES, False, False)
    plain = decide(chosen, Memory(), current, window(15), PROFILES, False, False)
    assert slower.target["prefill"] + slower.target["decode"] > plain.target["prefill"] + plain.target["decode"]
    # Too few measured requests correct nothing.
    quiet = Memory()
    decide(chosen, quiet, current, window(0.1, ttft=5.0, tpot=1.0), PROFILES, False, True)
    assert quiet.correction == {"prefill": 1.0, "decode": 1.0}


def test_a_deployment_is_settled_only_when_every_pod_runs_the_current_template():
    deployment = {
        "metadata": {"generation": 3},
        "spec": {"replicas": 2},
        "status": {"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 2},
    }
    assert settled(deployment, 2)
    assert not settled(deployment, 3)  # its pool asks for more than it was told
    for key, value in (("observedGeneration", 2), ("updatedReplicas", 1), ("availableReplicas", 1), ("replicas", 3)):
        assert not settled({**deployment, "status": {**deployment["status"], key: value}}, 2)
    assert not settled(None, 1)


def counts(received: float, prompt: dict[float, float]) -> Counts:
    return Counts(received, {"prompt": prompt, "generation": {}, "ttft": {}, "tpot": {}})


def test_counter_windows_survive_a_router_restart_and_sum_over_routers():
    earlier = counts(100, {10.0: 40, float("inf"): 100})
    later = counts(130, {10.0: 50, float("inf"): 130})
    assert later.minus(earlier) == counts(30, {10.0: 10, float("inf"): 30})
    restarted = counts(7, {10.0: 2, float("inf"): 7})  # below the earlier counts: all of it is new
    assert restarted.minus(earlier) == restarted
    total = window_of(summed([later.minus(earlier), restarted]), 10.0)
    assert total.arrivals == 37 and total.rate == pytest.approx(3.7)
    assert total.prompt.counts == (12.0, 25.0)


def test_settings_read_the_spec():
    chosen = settings()
    assert chosen.slo == SLO(0.8, 0.06, 0.9)
    assert chosen.bounds == {"prefill": (1, 6), "decode": (1, 8)}
    assert (chosen.interval_s, chosen.cooldown_s, chosen.max_step) == (60, 180, 2)
    assert dataclasses.replace(chosen, max_step=1).max_step == 1
