"""What the chaos tests share: an engine's processes, one request through the router, and two waves of 16
requests with processes stopped (SIGSTOP) between them."""

from __future__ import annotations

import os
import signal
import threading
import time

from tests.pd.cluster import post

Results = dict[int, tuple[float, int, dict]]  # request number -> (seconds, status, answer)


def processes_of(pid: int) -> list[int]:
    """The process and its descendants (an engine's API process and its EngineCore)."""
    found = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as handle:
            for child in handle.read().split():
                found += processes_of(int(child))
    return found


def request(router: str, number: int, results: Results) -> None:
    started = time.monotonic()
    prompt = f"request {number}: " + " ".join(f"w{number}x{i}" for i in range(80))
    body = {"model": "demo", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    try:
        status, answer = post(f"{router}/v1/completions", body, timeout=60)
    except Exception as error:  # a non-JSON answer or a broken connection: a failure of the test
        status, answer = -1, {"exception": repr(error)}
    results[number] = (time.monotonic() - started, status, answer)


def two_waves_around_a_stop(router: str, stopped_pid: int) -> Results:
    """16 requests; 0.5-0.8 s in, SIGSTOP ``stopped_pid`` and its descendants; 16 more; every request ends
    (70 s bound) before SIGCONT. Then each must have ended within 60 s with 200 or a JSON error."""
    results: Results = {}
    first = [threading.Thread(target=request, args=(router, n, results)) for n in range(16)]
    for thread in first:
        thread.start()
    time.sleep(0.6)  # the first legs are under way
    stopped = processes_of(stopped_pid)
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        second = [threading.Thread(target=request, args=(router, n, results)) for n in range(16, 32)]
        for thread in second:
            thread.start()
        for thread in first + second:
            thread.join(70)
        assert not any(thread.is_alive() for thread in first + second), "a request hung"
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert len(results) == 32
    for number, (seconds, status, answer) in results.items():
        assert seconds <= 60, (number, seconds)
        assert status == 200 or (status >= 400 and "error" in answer), (number, status, answer)
    return results
