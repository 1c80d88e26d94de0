"""The planner: fitting a profile, workloads, the simulator over the real Scheduler, bounds and search."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pdserve.planner.profile import EngineShape, Profile, StepPoint, StepTimeModel, TransferModel, step_features
from pdserve.planner.report import compressed
from pdserve.planner.search import bounds, cost, plan_colocated, plan_disaggregated
from pdserve.planner.simulator import SLO, Deployment, simulate
from pdserve.planner.workload import Arrival, Lengths, WorkloadSpec, read_trace

SHAPE = EngineShape(
    num_blocks=1024,
    block_size=16,
    max_model_len=2048,
    max_num_seqs=64,
    max_num_batched_tokens=512,
    kv_bytes_per_token=16384,
)
# 4 ms a step, 20 us a token, 0.2 ms a sequence, 10 ns per token-of-context attended.
STEP = StepTimeModel([0.004, 2e-5, 2e-4, 1e-8])


def profile(**changes) -> Profile:
    base = Profile("demo", "test", SHAPE, STEP, TransferModel(0.002, 1e9), gpus_per_pod=1)
    return dataclasses.replace(base, **changes)


def workload(rate: float, duration: float = 30.0, seed: int = 1, **changes) -> list[Arrival]:
    spec = WorkloadSpec(rate, Lengths(256, 0.5, 16, 1024), Lengths(48, 0.5, 2, 256), duration, seed=seed)
    return dataclasses.replace(spec, **changes).arrivals()


def test_the_step_model_recovers_known_costs_and_never_goes_negative():
    rng = random.Random(0)
    # A concave per-row cost as well as the linear ones: 3 ms, then 2 ms for the second row.
    truth = StepTimeModel([0.003, 1e-5, 3e-4, 4e-8, 2e-8, 2e-3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    points = []
    for _ in range(60):
        batch = rng.randint(1, 16)
        news = [rng.choice([1, 1, 1, rng.randint(2, 300)]) for _ in range(batch)]
        starts = [rng.randint(0, 1500) for _ in range(batch)]
        points.append(StepPoint(news, starts, truth.seconds(news, starts) * rng.uniform(0.98, 1.02)))
    fitted = StepTimeModel.fit(points)
    for news, starts in (([512], [0]), ([1] * 32, [700] * 32), ([200, 1, 1], [0, 50, 900])):
        assert fitted.seconds(news, starts) == pytest.approx(truth.seconds(news, starts), rel=0.05)
    # Data that a free fit would explain with a negative term: the term is held at zero instead.
    flat = [StepPoint([n], [0], 0.01) for n in (1, 2, 4, 8, 16, 32)]
    assert min(StepTimeModel.fit(flat).coefficients) >= 0
    features = step_features([3, 1], [10, 99])
    assert features[:5] == [1.0, 4.0, 2.0, 100, 3 * 13]  # decode attention: the context read; prefill: n(c+n)
    assert features[5:] == [2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 4]  # min(sequences, k), min(tokens, k)
    # A profile of the first, four-term model reads as the same costs.
    first = StepTimeModel([0.003, 1e-5, 3e-4, 2e-8])
    assert first.seconds([3, 1], [10, 99]) == pytest.approx(0.003 + 4e-5 + 6e-4 + 2e-8 * (100 + 39))
    with pytest.raises(ValueError):
        StepTimeModel([1.0, 2.0])


def test_transfer_model_fit():
    fitted = TransferModel.fit([(1 << 20, 0.001 + (1 << 20) / 2e9), (64 << 20, 0.001 + (64 << 20) / 2e9)])
    assert fitted.latency_s == pytest.approx(0.001, rel=1e-6)
    assert fitted.bytes_per_s == pytest.approx(2e9, rel=1e-6)


def test_a_profile_survives_json(tmp_path):
    original = profile(step_points=[StepPoint([5], [0], 0.01)], transfer_points=[(100, 0.5)], tier_bytes_per_s=2e9)
    original.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == original
    (tmp_path / "bad.json").write_text('{"model": "x"}')
    with pytest.raises(ValueError, match="not a pdserve profile"):
        Profile.load(tmp_path / "bad.json")


def test_workloads_are_seeded_and_have_the_rate_and_prefix_sharing_asked():
    first, again = workload(10, seed=3), workload(10, seed=3)
    assert first == again
    assert workload(10, seed=4) != first
    assert 10 * 30 * 0.85 < len(first) < 10 * 30 * 1.15
    shared = workload(10, prefix_hit_rate=0.5)
    prefixes = {tuple(a.prompt[:8]) for a in shared if len(a.prompt) >= 32}
    assert len(prefixes) <= 4  # the shared prefixes are few
    regular = WorkloadSpec(5, Lengths(10), Lengths(10), 10, burstiness=0).arrivals()
    assert [round(a.time, 6) for a in regular[:3]] == [0.2, 0.4, 0.6]


def test_a_trace_is_read_and_a_bad_line_named(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"t": 1.5, "prompt_tokens": 20, "output_tokens": 5}\n\n{"t": 0.5, "prompt_tokens": 3, "output_tokens": 1}\n'
    )
    arrivals = read_trace(trace)
    assert [(a.time, len(a.prompt), a.output_tokens) for a in arrivals] == [(0.5, 3, 1), (1.5, 20, 5)]
    trace.write_text('{"t": 1.5}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:1"):
        read_trace(trace)


def test_simulation_is_deterministic_and_serves_everything_under_light_load():
    arrivals = workload(4)
    first = simulate(Deployment(prefill=1, decode=1), arrivals, profile())
    second = simulate(Deployment(prefill=1, decode=1), arrivals, profile())
    assert [(r.first_token, r.finish) for r in first.requests] == [(r.first_token, r.finish) for r in second.requests]
    assert all(r.finish is not None for r in first.requests)
    # Light load: TTFT is about one prefill step + the pull + one decode step; TPOT about one decode step.
    single = profile().step.seconds([256], [0]) + 0.002 + 256 * 16384 / 1e9 + profile().step.seconds([1], [256])
    assert first.percentile("ttft", 0.5) == pytest.approx(single, rel=0.5)
    assert first.percentile("tpot", 0.5) < 3 * profile().step.seconds([1] * 4, [300] * 4)
    for r in first.requests:
        assert r.first_token >= r.arrival and r.finish >= r.first_token


def test_more_engines_never_serve_worse_and_overload_shows():
    arrivals = workload(40, duration=20)
    slo = SLO(ttft_s=0.3, tpot_s=0.03)
    one = simulate(Deployment(colocated=1), arrivals, profile(), drain_limit_s=20)
    four = simulate(Deployment(colocated=4), arrivals, profile(), drain_limit_s=20)
    assert four.attained(slo) >= one.attained(slo)
    assert four.percentile("ttft", 0.9) < one.percentile("ttft", 0.9)
    assert one.utilisation["colocated"] > four.utilisation["colocated"]
    # A KV cache too small for the batch preempts (the real scheduler's doing).
    tight = profile(engine=dataclasses.replace(SHAPE, num_blocks=140))
    squeezed = simulate(Deployment(colocated=1), workload(20, duration=10), tight, drain_limit_s=60)
    assert squeezed.preemptions > 0


def test_bounds_grow_with_load():
    slo = SLO(ttft_s=0.5, tpot_s=0.02)
    light, heavy = bounds(workload(2), profile(), slo), bounds(workload(80), profile(), slo)
    assert (light.prefill, light.decode) == (1, 1)
    assert heavy.decode > light.decode and heavy.colocated >= max(heavy.prefill, heavy.decode)


def test_the_search_finds_the_cheapest_pair_that_meets_the_slo():
    arrivals = workload(30, duration=20)
    slo = SLO(ttft_s=0.2, tpot_s=0.015, attainment=0.9)
    plan = plan_disaggregated(arrivals, slo, profile(), max_prefill=6, max_decode=8)
    assert plan.deployment is not None and plan.result is not None and plan.result.meets(slo)
    assert plan.steps_per_s > 0
    found = plan.deployment
    # Nothing one step cheaper meets it: the plan is minimal in each pool.
    for smaller in ((found.prefill - 1, found.decode), (found.prefill, found.decode - 1)):
        if min(smaller) >= 1:
            assert not simulate(Deployment(prefill=smaller[0], decode=smaller[1]), arrivals, profile()).meets(slo)
    colocated = plan_colocated(arrivals, slo, profile(), max_replicas=12)
    assert colocated.deployment is not None
    # Impossible SLOs: no plan, and it says so rather than returning the biggest one tried.
    hopeless = plan_disaggregated(arrivals, SLO(ttft_s=1e-4, tpot_s=1e-4), profile(), max_prefill=2, max_decode=2)
    assert hopeless.deployment is None and hopeless.tried


def test_cost_counts_gpus_then_pods_and_cpus_for_cpu_pods():
    gpu = profile(gpus_per_pod=2)
    assert cost(Deployment(prefill=2, decode=3), gpu) == (10.0, 5)
    cpu = profile(gpus_per_pod=0, cpus_per_pod=4)
    assert cost(Deployment(colocated=3), cpu) == (12.0, 3)
    with pytest.raises(ValueError):
        Deployment(prefill=1, decode=1, colocated=1)


def test_a_run_that_certainly_misses_stops_early_and_a_good_one_runs_to_the_end():
    slo = SLO(ttft_s=0.2, tpot_s=0.02, attainment=0.9)
    overloaded, light = workload(80, duration=20), workload(2, duration=20)
    full = simulate(Deployment(colocated=1), overloaded, profile(), drain_limit_s=20)
    cut = simulate(Deployment(colocated=1), overloaded, profile(), drain_limit_s=20, give_up=slo)
    assert cut.stopped_early and not full.stopped_early
    assert cut.steps < full.steps / 2
    assert not cut.meets(slo) and not full.meets(slo)
    whole = simulate(Deployment(prefill=1, decode=1), light, profile())
    watched = simulate(Deployment(prefill=1, decode=1), light, profile(), give_up=slo)
    assert not watched.stopped_early and watched.meets(slo)
    assert [(r.first_token, r.finish) for r in watched.requests] == [(r.first_token, r.finish) for r in whole.requests]


def test_tier_hits_are_a_prefix_past_the_shared_one():
    arrivals = workload(10, prefix_hit_rate=0.25, tier_hit_rate=0.5)
    for a in arrivals:
        assert a.tier_tokens == int(len(a.prompt) * 0.25) + int(len(a.prompt) * 0.5) < len(a.prompt)
    assert [a.prompt for a in arrivals] == [a.prompt for a in workload(10, prefix_hit_rate=0.25)]  # same traffic
    assert all(a.tier_tokens == 0 for a in workload(10))
    assert [a.tier_tokens for a in compressed(arrivals, 2.0)] == [a.tier_tokens for a in arrivals]
    for rates in ((0.5, 0.5), (0.0, 1.0), (0.0, -0.1)):
        with pytest.raises(ValueError, match="tier-hit rate"):
            workload(10, prefix_hit_rate=rates[0], tier_hit_rate=rates[1])
    # Loading needs a bandwidth: none given is refused rather than simulated as free.
    with pytest.raises(ValueError, match="--tier-bandwidth"):
        simulate(Deployment(colocated=1), arrivals, profile())
    assert profile(tier_bytes_per_s=2e9).tier_load_seconds(1000) == pytest.approx(1000 * 16384 / 2e9)


def test_kv_tier_hits_change_the_plan():
    """Prompt tokens the KV tiers hold are loaded, not computed: tiers faster than the compute they replace
    need fewer prefill engines, slower ones more (the load holds the engine's step)."""
    slo = SLO(ttft_s=0.3, tpot_s=0.03)
    prompts, outputs = Lengths(1024, 0.3, 256, 1800), Lengths(16, 0.5, 2, 64)

    def planned(tier_hit_rate: float, bandwidth: float) -> Deployment | None:
        arrivals = workload(40, duration=10, prompt=prompts, output=outputs, tier_hit_rate=tier_hit_rate)
        found = plan_disaggregated(arrivals, slo, profile(tier_bytes_per_s=bandwidth), max_prefill=8, max_decode=4)
        return found.deployment

    without, fast, slow = planned(0.0, 0.0), planned(0.75, 20e9), planned(0.75, 0.2e9)
    assert without is not None and fast is not None and slow is not None
    assert fast.prefill < without.prefill < slow.prefill, (fast, without, slow)
