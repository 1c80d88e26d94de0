"""`pdserve operator` as the chart's Deployment runs it: a real process against the API emulator,
liveness on /healthz, a PDService turned into its Deployments, a clean stop on SIGTERM."""

import os
import signal
import subprocess
import sys
import time
import urllib.request

from pdserve.launcher import free_port
from tests.operator.helpers import DEPLOYMENTS, PDSERVICES, pdservice
from tests.operator.kmock_cluster import wait_for


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def test_the_operator_command_serves_a_namespace(kube_cluster, kube_namespace):
    port = free_port()
    # The fixture pointed KUBECONFIG at the emulator; the child inherits it.
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "operator", "--namespace", kube_namespace, "--liveness-port", str(port)],
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _healthy(port):
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "no /healthz"
            time.sleep(0.2)
        kube_cluster.create(PDSERVICES, pdservice("cli"), kube_namespace)
        names = wait_for(
            lambda: (
                sorted(d["metadata"]["name"] for d in kube_cluster.list(DEPLOYMENTS, kube_namespace))
                if len(kube_cluster.list(DEPLOYMENTS, kube_namespace)) == 3
                else None
            ),
            timeout=30,
        )
        assert names == ["cli-decode", "cli-prefill", "cli-router"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
