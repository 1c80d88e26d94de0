"""The admission core on its own (pdserve/router/admission.py): a fake saturation signal stands in for the pods', so
that order, fairness, bounds, deadlines and limits can be driven exactly. The pods' real signals are used in
tests/router/test_flow_control.py (stubs publishing KV events) and bench/tenants.py (real engines)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from pdserve.router.admission import Admission, FlowMetrics, FlowSettings, Overloaded, Saturation
from pdserve.router.tenants import Tenant, TenantSpec


class Gate:
    """A saturation signal the test opens one request at a time: ``allowed`` admissions in all."""

    def __init__(self, allowed: int = 0) -> None:
        self.allowed = allowed

    def __call__(self, pending) -> Saturation:
        left = self.allowed - pending(0.0)  # every admission so far
        return Saturation(None, left) if left > 0 else Saturation("decode", 0)


def _tenant(name: str, **spec) -> Tenant:
    return Tenant(name, name, TenantSpec(**spec))


def _admission(gate, **settings) -> Admission:
    return Admission(FlowSettings(**settings), gate, FlowMetrics(CollectorRegistry()))


async def _let_through(admission: Admission, gate: Gate, count: int) -> None:
    for _ in range(count):
        gate.allowed += 1
        admission.dispatch()
        await asyncio.sleep(0)


def test_an_unsaturated_fleet_admits_at_once():
    async def scenario():
        gate = Gate(10)
        admission = _admission(gate)
        ticket = await asyncio.wait_for(admission.admit(_tenant("a"), 0, 10, 10, None), 1)
        admission.done(ticket, 5, 10)
        assert admission.queued == 0

    asyncio.run(scenario())


def test_a_light_tenant_is_not_starved_by_a_heavy_one():
    async def scenario():
        gate = Gate()
        admission = _admission(gate)
        order: list[str] = []

        async def one(tenant: Tenant) -> None:
            await admission.admit(tenant, 0, 100, 100, None)
            order.append(tenant.name)

        heavy, light = _tenant("heavy"), _tenant("light")
        tasks = [asyncio.create_task(one(heavy)) for _ in range(10)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(one(light)) for _ in range(2)]
        await asyncio.sleep(0)
        assert admission.queued == 12
        await _let_through(admission, gate, 12)
        await asyncio.gather(*tasks)
        # Both light requests go within the first four, not after the heavy tenant's ten.
        assert order[:4].count("light") == 2 and order[4:] == ["heavy"] * 8

    asyncio.run(scenario())


def test_weights_share_the_fleet_in_proportion():
    async def scenario():
        gate = Gate()
        admission = _admission(gate)
        order: list[str] = []

        async def one(tenant: Tenant) -> None:
            await admission.admit(tenant, 0, 10, 10, None)
            order.append(tenant.name)

        big, small = _tenant("big", weight=3.0), _tenant("small")
        tasks = [asyncio.create_task(one(tenant)) for tenant in (big, small) for _ in range(12)]
        await asyncio.sleep(0)
        await _let_through(admission, gate, 16)
        assert order.count("big") == 12 and order.count("small") == 4
        await _let_through(admission, gate, 8)
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_a_better_band_goes_first_whatever_its_arrival():
    async def scenario():
        gate = Gate()
        admission = _admission(gate)
        order: list[int] = []

        async def one(priority: int) -> None:
            await admission.admit(_tenant("a"), priority, 10, 10, None)
            order.append(priority)

        tasks = [asyncio.create_task(one(p)) for p in (5, 5, 0, -3, 5, 0)]
        await asyncio.sleep(0)
        await _let_through(admission, gate, 6)
        await asyncio.gather(*tasks)
        assert order == [-3, 0, 0, 5, 5, 5]

    asyncio.run(scenario())


def test_a_newcomer_waits_behind_requests_of_its_band_even_when_the_fleet_has_room():
    async def scenario():
        gate = Gate()
        admission = _admission(gate)
        first = asyncio.create_task(admission.admit(_tenant("a"), 0, 10, 10, None))
        await asyncio.sleep(0)
        second = asyncio.create_task(admission.admit(_tenant("b"), 0, 10, 10, None))
        await asyncio.sleep(0)
        assert admission.queued == 2  # the newcomer queued behind the first
        gate.allowed = 1  # room for one: the dispatcher serves them in order
        await asyncio.wait_for(first, 1)
        await asyncio.sleep(0.05)
        assert not second.done()
        gate.allowed = 2
        await asyncio.wait_for(second, 1)

    asyncio.run(scenario())


def test_bounded_queues_answer_429_with_retry_after():
    async def scenario():
        gate = Gate()
        admission = _admission(gate, max_queued=3)
        tenant = _tenant("a", max_queued=2)
        waiting = [asyncio.create_task(admission.admit(tenant, 0, 1, 1, None)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as refused:
            await admission.admit(tenant, 0, 1, 1, None)
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
        assert refused.value.cause == "queue_full"
        waiting.append(asyncio.create_task(admission.admit(_tenant("b"), 0, 1, 1, None)))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):  # the band is full: 3 wait
            await admission.admit(_tenant("c"), 0, 1, 1, None)
        await _let_through(admission, gate, 3)
        await asyncio.gather(*waiting)

    asyncio.run(scenario())


def test_a_request_past_its_queue_deadline_is_refused_and_leaves_the_queue():
    async def scenario():
        gate = Gate()
        admission = _admission(gate)
        with pytest.raises(Overloaded) as refused:
            await admission.admit(_tenant("a", queue_timeout=5.0), 0, 1, 1, 0.05)  # the shorter wins
        assert refused.value.cause == "deadline" and admission.queued == 0

    asyncio.run(scenario())


def test_a_client_leaving_while_queued_leaves_nothing_behind():
    async def scenario():
        gate = Gate()
        admission = _admission(gate)
        task = asyncio.create_task(admission.admit(_tenant("a"), 0, 1, 1, None))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert admission.queued == 0 and not any(band.queued for band in admission.bands.values())

    asyncio.run(scenario())


def test_requests_per_minute_are_a_replicas_share():
    async def scenario():
        gate = Gate(100)
        admission = _admission(gate, replicas=2)
        tenant = _tenant("a", requests_per_minute=4)
        for _ in range(2):
            await admission.admit(tenant, 0, 1, 1, None)
        with pytest.raises(Overloaded) as refused:
            await admission.admit(tenant, 0, 1, 1, None)
        # 2 a minute in this replica: the next one in about 30 s.
        assert refused.value.cause == "requests_per_minute" and 25 <= int(refused.value.headers["Retry-After"]) <= 30

    asyncio.run(scenario())


def test_tokens_spent_after_the_fact_are_a_debt_paid_before_the_next_request():
    async def scenario():
        gate = Gate(100)
        admission = _admission(gate)
        tenant = _tenant("a", tokens_per_minute=600)  # 10 a second
        ticket = await admission.admit(tenant, 0, 100, 10, None)
        admission.done(ticket, 1000, 100)  # 1000 output tokens: 500 past the minute's budget
        with pytest.raises(Overloaded) as refused:
            await admission.admit(tenant, 0, 100, 10, None)
        assert refused.value.cause == "tokens_per_minute" and int(refused.value.headers["Retry-After"]) >= 50

    asyncio.run(scenario())


def test_a_request_refused_for_a_full_queue_or_its_deadline_costs_its_tenant_nothing():
    async def scenario():
        gate = Gate()
        admission = _admission(gate)
        tenant = _tenant("a", requests_per_minute=2, tokens_per_minute=600, max_queued=0)
        for _ in range(3):
            with pytest.raises(Overloaded) as refused:
                await admission.admit(tenant, 0, 100, 10, None)
            assert refused.value.cause == "queue_full"
        patient = _tenant("a", requests_per_minute=2, tokens_per_minute=600)
        with pytest.raises(Overloaded) as refused:
            await admission.admit(patient, 0, 100, 10, 0.02)
        assert refused.value.cause == "deadline"
        gate.allowed = 10
        for _ in range(2):  # the minute's two requests are still there
            await admission.admit(patient, 0, 100, 10, None)

    asyncio.run(scenario())


def test_requests_more_urgent_than_all_in_flight_go_to_a_saturated_fleet_up_to_a_bound():
    async def scenario():
        gate = Gate(1)
        admission = _admission(gate, max_ahead=2)
        low = await asyncio.wait_for(admission.admit(_tenant("a"), 5, 10, 10, None), 1)  # the fleet is now full
        urgent = [admission.enter(_tenant("b"), 0, 10, 10, None) for _ in range(2)]
        assert all(ticket.admitted for ticket in urgent)  # the engines run them before the priority-5 one
        third = admission.enter(_tenant("b"), 0, 10, 10, None)
        assert not third.admitted and admission.queued == 1  # two of its band are in flight: it queues
        more_urgent = admission.enter(_tenant("c"), -1, 10, 10, None)
        assert more_urgent.admitted
        preempting = admission.metrics.preempting
        assert preempting.labels("b", "0").value == 2 and preempting.labels("c", "-1").value == 1
        for ticket in (*urgent, more_urgent, low):
            admission.done(ticket)
            admission.done(ticket)  # a second call changes nothing
        assert not admission._flows
        gate.allowed = 10  # room again: the queued one goes
        await asyncio.wait_for(admission.wait(third), 1)
        admission.done(third)
        assert not admission._flows and admission.queued == 0

    asyncio.run(scenario())


def test_a_tenant_with_nothing_in_flight_goes_ahead_of_its_band():
    async def scenario():
        gate = Gate(2)
        admission = _admission(gate)
        heavy, light = _tenant("heavy"), _tenant("light")
        flood = [await asyncio.wait_for(admission.admit(heavy, 0, 10, 10, None), 1) for _ in range(2)]
        assert not any(ticket.ahead for ticket in flood)  # nobody else in flight: nothing to be ahead of
        queued = admission.enter(heavy, 0, 10, 10, None)
        assert not queued.admitted  # saturated, and the heavy tenant has requests in flight
        first = admission.enter(light, 0, 10, 10, None)
        assert first.admitted and first.ahead  # at once, past the heavy tenant's queued request
        second = admission.enter(light, 0, 10, 10, None)
        assert not second.admitted and not second.ahead  # its first is in flight: it waits its turn
        other_band = admission.enter(_tenant("other"), 3, 10, 10, None)
        assert not other_band.admitted  # nobody of priority 3 in flight: nothing to be ahead of
        assert admission.metrics.ahead.labels("light", "0").value == 1
        admission.done(first)
        assert not admission._ahead
        for ticket in flood:
            admission.done(ticket)
        gate.allowed = 10
        for ticket in (queued, second, other_band):
            await asyncio.wait_for(admission.wait(ticket), 1)
            admission.done(ticket)
        assert not admission._flows and admission.queued == 0

    asyncio.run(scenario())


def test_a_tenant_under_half_the_others_share_in_flight_goes_ahead_by_weight():
    async def scenario():
        gate = Gate(4)
        admission = _admission(gate, max_ahead=10)
        heavy, light, weighty = _tenant("heavy"), _tenant("light"), _tenant("weighty", weight=4)
        flood = [admission.enter(heavy, 0, 10, 10, None) for _ in range(4)]
        assert all(ticket.admitted and not ticket.ahead for ticket in flood)  # the fleet is now saturated
        # Ahead while under half of every other tenant's share in flight: 0 of 4, then 1 of 4; 2 of 4 is not.
        assert [admission.enter(light, 0, 10, 10, None).ahead for _ in range(3)] == [True, True, False]
        # Per weight: at weight 4, up to 3 in flight (0.75 a weight) is under half of light's 2.
        assert [admission.enter(weighty, 0, 10, 10, None).ahead for _ in range(5)] == [True] * 4 + [False]
        # Tenants near their shares never go ahead of each other (no preempting by turns).
        assert not admission.enter(heavy, 0, 10, 10, None).ahead
        assert admission.metrics.ahead.labels("weighty", "0").value == 4

    asyncio.run(scenario())


def test_requests_sent_ahead_are_bounded_per_band_and_yield_to_a_more_urgent_queue():
    async def scenario():
        gate = Gate(1)
        admission = _admission(gate, max_ahead=2)
        await asyncio.wait_for(admission.admit(_tenant("heavy"), 0, 10, 10, None), 1)
        tickets = [admission.enter(_tenant(f"light-{n}"), 0, 10, 10, None) for n in range(3)]
        assert [ticket.ahead for ticket in tickets] == [True, True, False]
        assert not tickets[2].admitted  # two in flight ahead already: it queues
        admission.done(tickets[0])
        admission.done(tickets[0])  # a second call changes nothing
        assert admission.enter(_tenant("light-3"), 0, 10, 10, None).ahead  # a place ahead came free
        # A more urgent request waiting in the router goes first: nobody of a worse band passes it.
        urgent_heavy = [admission.enter(_tenant("heavy"), -1, 10, 10, None) for _ in range(3)]
        assert [ticket.admitted for ticket in urgent_heavy] == [True, True, False]  # the third queued at -1
        assert not admission.enter(_tenant("light-4"), 0, 10, 10, None).admitted
        assert admission.enter(_tenant("light-5"), -1, 10, 10, None).ahead  # its own band's queue it may pass

    asyncio.run(scenario())


def test_no_request_goes_ahead_without_places_for_them():
    async def scenario():
        gate = Gate(1)
        admission = _admission(gate, max_ahead=0)  # what --no-flow-control sets
        await asyncio.wait_for(admission.admit(_tenant("heavy"), 0, 10, 10, None), 1)
        ticket = admission.enter(_tenant("light"), 0, 10, 10, None)
        assert not ticket.admitted and not ticket.ahead

    asyncio.run(scenario())
