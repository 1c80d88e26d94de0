"""`pdserve serve --mode colocated` as a user runs it: a real process, a real port, SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from pdserve.api.flags import parse_size
from pdserve.launcher import free_port
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.processes import wait_healthy


def _serve(port: int, *flags: str) -> subprocess.Popen:
    """`pdserve serve --port PORT FLAGS` on CPU with a small KV cache, its output in a pipe."""
    argv = ["serve", "--port", str(port), "--kv-cache-memory", "32MiB", "--device", "cpu", *flags]
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait_healthy(process: subprocess.Popen, port: int, timeout: float) -> None:
    # The output is read once the process has exited (before, reading would wait for it to exit).
    wait_healthy(
        f"http://127.0.0.1:{port}",
        process,
        timeout,
        log=lambda: "" if process.poll() is None else process.stdout.read(),
    )


def _wait_for_line(process: subprocess.Popen, text: str, timeout: float) -> tuple[list[str], threading.Thread]:
    """Read the output until a line holding ``text`` (what a user waits for) and on to its end (a full pipe
    would stop the children): the lines read, and the thread reading them. The router answering /health is
    not enough: the launcher may not have seen it yet (seen in CI: a SIGTERM sent right after one request
    found the launcher still waiting for its router, so it never printed its URL)."""
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if text in line:
                found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not found.wait(timeout):
        process.kill()
        reader.join(10)
        raise AssertionError(f"no line with {text!r} within {timeout:g} s:\n{''.join(lines)[-5000:]}")
    return lines, reader


def _complete(port: int, prompt: str, timeout: float) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": prompt, "max_tokens": 3}).encode(),
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_serve_colocated_answers_and_stops_cleanly_on_sigterm():
    ensure_demo_model()  # the user's cache, as `pdserve serve` with no --model uses it
    port = free_port()
    process = _serve(port, "--mode", "colocated", "--max-model-len", "256")
    try:
        _wait_healthy(process, port, 120)
        assert _complete(port, "hello", timeout=30)["model"] == "pdserve-demo-qwen3-v2"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    output = process.stdout.read()
    assert f"at http://127.0.0.1:{port}/v1" in output and "KV cache" in output


def test_serve_disaggregated_runs_router_prefill_and_decode_and_stops_them_all():
    ensure_demo_model()
    port = free_port()
    # The decode engine splits the model over two worker processes: it pulls each rank's KV heads.
    process = _serve(port, "--max-model-len", "512", "--kv-transfer", "tcp", "--decode-tp", "2")
    try:
        lines, reader = _wait_for_line(process, f"decode at TP 2) serving at http://127.0.0.1:{port}/v1", 180)
        # > 256 tokens: worth a prefill leg
        assert len(_complete(port, "word " * 100, timeout=60)["choices"]) == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert 'pdserve_router_requests_total{path="disagg"} 1.0' in response.read().decode()
        children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 3  # router, prefill, decode (whose workers are its own children)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert 'pdserve_router_requests_total{path="fallback"} 0.0' in response.read().decode()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        for pid in children:  # every child (and its engine core) is gone
            assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(10)
    assert not any("not authenticated" in line for line in lines)  # the children share serve's secret


def test_serve_rejects_empty_pools():
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--decode", "0"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "--decode" in result.stderr


@pytest.mark.parametrize(
    ("text", "size"), [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1.5G", 3 << 29), ("1000", 1000)]
)
def test_sizes(text, size):
    assert parse_size(text) == size


def _descendants_running(pid: int, command: str) -> list[int]:
    """The processes below ``pid`` whose command line holds ``command`` (not other tests' processes)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        for child in frontier:
            try:
                if command in Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                    found.append(child)
            except OSError:
                continue
    return found


def test_serve_colocated_splits_the_model_over_two_worker_processes():
    port = free_port()
    process = _serve(port, "--mode", "colocated", "--max-model-len", "256", "-tp", "2")
    try:
        _wait_healthy(process, port, 180)
        assert _complete(port, "hello", timeout=60)["choices"][0]["text"]
        assert len(_descendants_running(process.pid, "pdserve.worker.process")) == 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    output = process.stdout.read()
    assert "tensor parallel 2" in output  # the start-up log says the layout


def test_serve_refuses_pool_tp_sizes_in_colocated_mode():
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--mode", "colocated", "--decode-tp", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--decode-tp" in result.stderr


def test_free_port_never_hands_out_a_port_twice():
    # A released probe's port is free again at once; the kernel picks it again about once in 20,000
    # pairs of calls, enough for two engines of one test cluster to be told the same port.
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


@pytest.mark.slow
def test_serve_kv_insecure_gives_its_children_no_keys_so_no_oracle_seals_anything():
    # dbd1dc4 gave `pdserve serve --kv-insecure`'s children a fresh secret and the flag: its decode engine took P/D
    # params from any HTTP client and sealed, with the secret, a handshake for the client's own socket, which the
    # client replayed to a prefill (full KV read and write from one HTTP request). Now --kv-insecure means no
    # keys at all: what a client can make the decode engine send is unsealed, worth nothing against any engine
    # with keys (and an engine without keys answers anyone anyway, as the flag says).
    import msgspec
    import zmq

    from pdserve.kvtransfer import messages
    from pdserve.kvtransfer.params import prompt_hash

    ensure_demo_model()
    port = free_port()
    process = _serve(
        port, "--kv-insecure", "--max-model-len", "512", "--kv-transfer", "tcp", "--kv-transfer-timeout", "2"
    )
    context = zmq.Context()
    try:
        _wait_healthy(process, port, 180)
        (decode,) = _descendants_running(process.pid, "pdserve.cli decode")
        argv = Path(f"/proc/{decode}/cmdline").read_bytes().decode().split("\0")
        assert "--kv-keys" not in argv and "--kv-insecure" in argv
        decode_url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        listener = context.socket(zmq.ROUTER)
        listener.setsockopt(zmq.LINGER, 0)
        listener_port = listener.bind_to_random_port("tcp://127.0.0.1")
        prompt = [(7 * i) % 500 + 10 for i in range(40)]  # token ids: no tokenizer in between
        with urllib.request.urlopen(f"{decode_url}/health", timeout=10) as response:
            compat_hash = json.loads(response.read())["kv_compat_hash"]
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "a-prefill",
            "remote_request_id": "r",
            "remote_host": "127.0.0.1",
            "remote_port": listener_port,
            "remote_block_ids": [0, 1, 2],
            "remote_block_generations": [0, 0, 0],
            "remote_num_tokens": len(prompt),
            "remote_prompt_hash": prompt_hash(prompt),
            "kv_compat_hash": compat_hash,
            "remote_lease_seconds": 30,
            "remote_hold_token": "t",
        }
        request = urllib.request.Request(
            f"{decode_url}/v1/completions",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}).encode(),
        )
        with urllib.request.urlopen(request, timeout=60) as response:  # taken: no keys, as the flag says
            assert response.status == 200  # computed by decode after the handshake went unanswered
        assert listener.poll(5000), "the decode engine did not dial the address the params name"
        _, frame = listener.recv_multipart()
        envelope = msgspec.msgpack.decode(frame, type=messages.Envelope)
        assert envelope.mac == b"" and envelope.nonce == b""  # unsealed: nothing to replay against a keyed engine
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        context.destroy(linger=0)
        if process.poll() is None:
            process.kill()
    assert "not authenticated" in process.stdout.read()
