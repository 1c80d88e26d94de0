"""The cheapest deployment that meets the SLOs: analytic bounds first, then simulation.

Bounds (lower bounds on replicas, from the profile alone):
- prefill, as a queue: each request's prompt but what the KV tiers hold must be computed, and that
  part loaded (the tiers' load seconds); an engine computes at most `max_num_batched_tokens` per
  step of `step(max_num_batched_tokens tokens)` seconds, so
  P >= rate x (mean computed prompt / that throughput + mean load seconds).
- decode, by Little's law: requests in decode = rate x (mean output tokens x TPOT target); one
  engine holds at most min(max_num_seqs, KV blocks / blocks per request) of them, and a step
  with b requests must fit the TPOT target, so D >= in-decode / per-engine capacity.
- colocated: both loads on one engine: N >= prefill share + decode share.

Search: from the bounds upward, in order of cost (GPUs, or CPUs for CPU pods; then fewer pods),
each candidate simulated (`simulator.simulate`) until one meets the SLOs. A candidate whose
prefill pool misses TTFT with more decode engines than the best so far is not worth growing
in decode, and vice versa: the search grows the pool that misses.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.planner.profile import Profile
from pdserve.planner.simulator import SLO, Deployment, SimulationResult, simulate
from pdserve.planner.workload import Arrival


@dataclass
class Bounds:
    prefill: int
    decode: int
    colocated: int


def bounds(arrivals: Sequence[Arrival], profile: Profile, slo: SLO, decode_profile: Profile | None = None) -> Bounds:
    decode_profile = decode_profile or profile
    if not arrivals:
        return Bounds(1, 1, 1)
    span = max(arrivals[-1].time, 1e-9)
    rate = len(arrivals) / span
    prompt = statistics.fmean(len(a.prompt) for a in arrivals)
    computed = statistics.fmean(len(a.prompt) - a.tier_tokens for a in arrivals)
    loading = statistics.fmean(profile.tier_load_seconds(a.tier_tokens) for a in arrivals)
    output = statistics.fmean(a.output_tokens for a in arrivals)
    shape = profile.engine
    budget = shape.max_num_batched_tokens
    prefill_tokens_per_s = budget / profile.step.seconds([budget], [0])
    prefill_load = rate * (computed / prefill_tokens_per_s + loading)  # engines busy with prompts
    # Decode: what one engine can hold at once, and the largest batch whose step meets the TPOT target.
    d_shape = decode_profile.engine
    blocks_per_request = math.ceil((prompt + output) / d_shape.block_size)
    held = min(d_shape.max_num_seqs, d_shape.num_blocks // max(1, blocks_per_request))
    context = int(prompt + output / 2)
    batch = 1
    while batch < held and decode_profile.step.seconds([1] * (batch + 1), [context] * (batch + 1)) <= slo.tpot_s:
        batch += 1
    in_decode = rate * output * min(slo.tpot_s, decode_profile.step.seconds([1] * batch, [context] * batch))
    decode_load = in_decode / max(1, batch)
    return Bounds(
        prefill=max(1, math.ceil(prefill_load)),
        decode=max(1, math.ceil(decode_load)),
        colocated=max(1, math.ceil(prefill_load + decode_load)),
    )


@dataclass
class Plan:
    deployment: Deployment | None  # None: nothing within the limits met the SLOs
    result: SimulationResult | None
    bounds: Bounds
    tried: list[dict[str, Any]] = field(default_factory=list)  # each candidate's summary, in order
    steps: int = 0
    wall_s: float = 0.0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s else 0.0


def cost(deployment: Deployment, profile: Profile, decode_profile: Profile | None = None) -> tuple[float, int]:
    """(GPUs, or CPUs for CPU pods; pods): what the search minimises, in that order."""
    decode_profile = decode_profile or profile
    if deployment.colocated:
        return deployment.colocated * profile.pod_cost(), deployment.colocated
    pods = deployment.prefill + deployment.decode
    return deployment.prefill * profile.pod_cost() + deployment.decode * decode_profile.pod_cost(), pods


def _evaluate(
    plan: Plan,
    deployment: Deployment,
    arrivals: Sequence[Arrival],
    slo: SLO,
    profile: Profile,
    decode_profile: Profile | None,
) -> SimulationResult:
    """Simulate a candidate, stopping once it certainly misses `slo`."""
    result = simulate(deployment, arrivals, profile, decode_profile, give_up=slo)
    plan.steps += result.steps
    plan.wall_s += result.wall_s
    return result


def plan_disaggregated(
    arrivals: Sequence[Arrival],
    slo: SLO,
    profile: Profile,
    decode_profile: Profile | None = None,
    max_prefill: int = 16,
    max_decode: int = 32,
) -> Plan:
    """The cheapest (prefill, decode) pair within the limits that meets `slo` on `arrivals`."""
    lower = bounds(arrivals, profile, slo, decode_profile)
    plan = Plan(None, None, lower)
    prefill, decode = min(lower.prefill, max_prefill), min(lower.decode, max_decode)
    while prefill <= max_prefill and decode <= max_decode:
        deployment = Deployment(prefill=prefill, decode=decode)
        result = _evaluate(plan, deployment, arrivals, slo, profile, decode_profile)
        plan.tried.append(result.summary())
        if result.meets(slo):
            plan.deployment, plan.result = deployment, result
            break
        # Grow the pool that misses: TTFT waits on prefill engines (queueing for a prompt slot),
        # TPOT on decode engines (bigger batches, preemption). When both miss, grow the one whose
        # engines are busier.
        ttft_ok = result.percentile("ttft", slo.attainment) <= slo.ttft_s
        tpot_ok = result.percentile("tpot", slo.attainment) <= slo.tpot_s
        if ttft_ok == tpot_ok:
            grow_prefill = result.utilisation.get("prefill", 0) >= result.utilisation.get("decode", 0)
        else:
            grow_prefill = not ttft_ok
        if grow_prefill and prefill < max_prefill:
            prefill += 1
        elif decode < max_decode:
            decode += 1
        else:
            prefill += 1
    _shrink(plan, arrivals, slo, profile, decode_profile)
    return plan


def _shrink(
    plan: Plan, arrivals: Sequence[Arrival], slo: SLO, profile: Profile, decode_profile: Profile | None
) -> None:
    """Growing one pool at a time can overshoot the other: try one fewer of each while it still meets."""
    while plan.deployment is not None:
        better = None
        prefill, decode = plan.deployment.prefill, plan.deployment.decode
        for smaller in [
            Deployment(prefill=p, decode=d) for p, d in ((prefill - 1, decode), (prefill, decode - 1)) if p and d
        ]:
            result = _evaluate(plan, smaller, arrivals, slo, profile, decode_profile)
            plan.tried.append(result.summary())
            if result.meets(slo):
                better = (smaller, result)
                break
        if better is None:
            return
        plan.deployment, plan.result = better


def plan_colocated(arrivals: Sequence[Arrival], slo: SLO, profile: Profile, max_replicas: int = 48) -> Plan:
    """The fewest colocated engines within the limit that meet `slo` on `arrivals`."""
    lower = bounds(arrivals, profile, slo)
    plan = Plan(None, None, lower)
    for replicas in range(min(lower.colocated, max_replicas), max_replicas + 1):
        deployment = Deployment(colocated=replicas)
        result = _evaluate(plan, deployment, arrivals, slo, profile, None)
        plan.tried.append(result.summary())
        if result.meets(slo):
            plan.deployment, plan.result = deployment, result
            break
    return plan
