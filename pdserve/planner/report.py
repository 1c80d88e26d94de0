"""What `pdserve plan` prints: the chosen deployment with its predicted SLOs, the colocated
alternative, the bounds, the sensitivity to the arrival rate, and optionally a PDService."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.planner.profile import Profile
from pdserve.planner.search import Plan, cost, plan_colocated, plan_disaggregated
from pdserve.planner.simulator import SLO, simulate
from pdserve.planner.workload import Arrival

SENSITIVITY = (0.5, 0.75, 1.25, 1.5, 2.0)


def compressed(arrivals: Sequence[Arrival], factor: float) -> list[Arrival]:
    """The same requests arriving `factor` times as fast (a trace replayed at another rate)."""
    return [dataclasses.replace(a, time=a.time / factor) for a in arrivals]


def make_report(
    arrivals: Sequence[Arrival],
    slo: SLO,
    profile: Profile,
    decode_profile: Profile | None = None,
    max_prefill: int = 16,
    max_decode: int = 32,
    at_rate: Callable[[float], Sequence[Arrival]] | None = None,
) -> dict[str, Any]:
    """Plan both ways and measure the chosen plan's sensitivity; `at_rate(factor)` gives the
    workload at another rate (default: the same arrivals, time-compressed)."""
    started = time.perf_counter()
    at_rate = at_rate or (lambda factor: compressed(arrivals, factor))
    disaggregated = plan_disaggregated(arrivals, slo, profile, decode_profile, max_prefill, max_decode)
    colocated = plan_colocated(arrivals, slo, profile, max_replicas=max_prefill + max_decode)
    options = [p for p in (disaggregated, colocated) if p.deployment is not None]
    best = min(options, key=lambda p: cost(p.deployment, profile, decode_profile)) if options else None  # type: ignore[arg-type]
    sensitivity = []
    if best is not None and best.deployment is not None:
        for factor in SENSITIVITY:
            result = simulate(best.deployment, at_rate(factor), profile, decode_profile, give_up=slo)
            sensitivity.append({"rate_factor": factor, "attained": result.attained(slo), **result.summary()})
    steps = disaggregated.steps + colocated.steps
    simulated_s = disaggregated.wall_s + colocated.wall_s
    return {
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
        "requests": len(arrivals),
        "best": _describe(best, profile, decode_profile, slo),
        "disaggregated": _describe(disaggregated, profile, decode_profile, slo),
        "colocated": _describe(colocated, profile, None, slo),
        "sensitivity": sensitivity,
        "simulated_steps": steps,
        "steps_per_s": steps / simulated_s if simulated_s else 0.0,
        "wall_s": time.perf_counter() - started,
    }


def _describe(plan: Plan | None, profile: Profile, decode_profile: Profile | None, slo: SLO) -> dict[str, Any] | None:
    if plan is None:
        return None
    found: dict[str, Any] = {"bounds": vars(plan.bounds), "candidates": len(plan.tried)}
    if plan.deployment is None or plan.result is None:
        return {**found, "deployment": None}
    gpus, pods = cost(plan.deployment, profile, decode_profile)
    return {
        **found,
        "deployment": {
            "prefill": plan.deployment.prefill,
            "decode": plan.deployment.decode,
            "colocated": plan.deployment.colocated,
        },
        "cost": gpus,
        "pods": pods,
        "attained": plan.result.attained(slo),
        "predicted": plan.result.summary(),
    }


def format_report(report: dict[str, Any]) -> str:
    slo = report["slo"]
    lines = [
        f"SLO: TTFT <= {slo['ttft_s'] * 1000:g} ms and TPOT <= {slo['tpot_s'] * 1000:g} ms "
        f"for {slo['attainment']:.0%} of {report['requests']} requests",
    ]
    for name in ("disaggregated", "colocated"):
        plan = report[name]
        if plan["deployment"] is None:
            lines.append(f"{name}: nothing within the limits meets it ({plan['candidates']} tried)")
            continue
        p = plan["predicted"]
        lines.append(
            f"{name}: {p['deployment']}, cost {plan['cost']:g} ({plan['pods']} pods), attained {plan['attained']:.1%}; "
            f"TTFT p50/p90/p99 {_ms(p['ttft_p50_s'])}/{_ms(p['ttft_p90_s'])}/{_ms(p['ttft_p99_s'])} ms, "
            f"TPOT p50/p90/p99 {_ms(p['tpot_p50_s'])}/{_ms(p['tpot_p90_s'])}/{_ms(p['tpot_p99_s'])} ms, "
            f"busy {', '.join(f'{k} {v:.0%}' for k, v in p['utilisation'].items())} "
            f"(bounds {plan['bounds']}, {plan['candidates']} simulated)"
        )
    best = report["best"]
    lines.append(f"best: {best['predicted']['deployment'] if best else 'none'}")
    for row in report["sensitivity"]:
        if row["stopped_early"]:  # stopped once the SLO was certainly missed: its percentiles are partial
            lines.append(f"  rate x{row['rate_factor']:g}: misses the SLO")
            continue
        lines.append(
            f"  rate x{row['rate_factor']:g}: attained {row['attained']:.1%}, TTFT p90 {_ms(row['ttft_p90_s'])} ms, "
            f"TPOT p90 {_ms(row['tpot_p90_s'])} ms"
        )
    lines.append(
        f"simulated {report['simulated_steps']} engine steps at {report['steps_per_s']:.0f} steps/s; "
        f"{report['wall_s']:.1f} s in all"
    )
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return "inf" if seconds == float("inf") else f"{seconds * 1000:.0f}"


def sized_pdservice(base: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """`base` (a PDService manifest) with the disaggregated plan's pool sizes (a PDService always has
    prefill and decode pools, so a cheaper colocated plan has no PDService form). The sizes seed
    new PDPools only: for a PDService that runs, scale its PDPools to them."""
    plan = report["disaggregated"]
    if plan["deployment"] is None:
        raise ValueError("no prefill/decode deployment meets the SLOs within the limits: nothing to write")
    if base.get("kind") != "PDService":
        raise ValueError("the base manifest is not a PDService")
    manifest = copy.deepcopy(base)
    spec = manifest.setdefault("spec", {})
    for role in ("prefill", "decode"):
        spec.setdefault(role, {})["replicas"] = plan["deployment"][role]
    return manifest
