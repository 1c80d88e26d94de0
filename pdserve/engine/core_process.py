"""The EngineCore process: owns the scheduler and the model executor (the model and its KV cache in this
process, or, with ``--distributed-executor-backend mp``, in worker processes it drives), and runs the step
loop where nothing else can block it. The API process talks to it over two ZMQ sockets with msgpack
(msgspec) messages; only token ids, parameters and statistics cross, never tensors.

    API process --(AddRequest | AbortRequests | ReleaseRemoteBlocks | DumpCachedBlocks | Shutdown)--> core
    API process <--(CoreReady | CoreOutputs | CoreError | CachedBlocks)------------------------- core
    (both PUSH -> PULL)

The loop blocks on its input socket only when it has no work; otherwise it drains whatever
arrived and steps. Any exception ends the process (the client notices through the process
sentinel at once and fails what was in flight).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
import uuid

import msgspec
import zmq

from pdserve.api.keys import EVENTS_KEY, load_secret
from pdserve.api.peer_kv import PeerKV
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.kv_events import KVEventPublisher
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stats import SchedulerStats
from pdserve.kvtransfer.params import RemotePrefill

logger = logging.getLogger(__name__)

# Stats go out at least this often while idle, so /metrics never reads stale numbers for long.
IDLE_STATS_INTERVAL_S = 1.0
# While the core only waits on KV transfers (held blocks, loads in flight) it polls this often.
TRANSFER_POLL_MS = 2
_PR_SET_PDEATHSIG = 1


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    cache_salt: str | None = None
    # P/D, as the API process's gate (pdserve/server/pd_gate.py) parsed and screened the request's
    # kv_transfer_params: a decode leg's remote blocks, or a prefill leg whose KV is held for a decode engine.
    remote_prefill: RemotePrefill | None = None
    remote_decode: bool = False
    peer: PeerKV | None = None  # peer reads: hold its blocks for peers when it ends, or read its prefix from one
    output_token_ids: list[int] = []  # a continued stream's output so far (another engine's)
    priority: int = 0  # lower first, under the priority scheduling policy
    ahead: bool = False  # before the others of its priority, under that policy (the router's fairness mark)


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class DumpCachedBlocks(msgspec.Struct, tag="dump_cached_blocks"):
    """Ask for every hash in the prefix cache (a debugging and testing aid)."""

    token: int


class ReleaseRemoteBlocks(msgspec.Struct, tag="release_remote"):
    """A decode leg naming these remote blocks was refused: their prefill engine may free them."""

    remote: RemotePrefill


CoreInput = AddRequest | AbortRequests | Shutdown | DumpCachedBlocks | ReleaseRemoteBlocks


class CpuShare(msgspec.Struct):
    """What a CPU engine runs on (``worker.cpu_budget``), for its start log and /metrics."""

    threads: int  # compute threads per rank
    reason: str
    cpu_quota: float  # CPUs of the cgroup's quota; 0: none
    memory_limit: int  # bytes of the cgroup's memory limit; 0: none


class CoreReady(msgspec.Struct, tag="ready"):
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    kv_events_port: int | None = None  # where the core publishes KV-cache events (None: it does not)
    enable_prefix_caching: bool = True
    kv_compat_hash: str | None = None  # P/D engines pair only with engines of the same hash
    engine_id: str = ""  # this run's identity (routers sign P/D legs for it and match its KV events to it)
    # Where and how long this engine serves peer reads of finished turns' blocks: its side channel's host, each
    # rank's port and the hold time (None: it serves none).
    kv_peer_source: tuple[str, list[int], float] | None = None
    scheduling_policy: str = "fcfs"  # the API process refuses priorities the policy would ignore
    cpu: CpuShare | None = None  # None: the model runs on a GPU
    # What the KV cache stores ("bfloat16"): engines of different KV dtypes never pair (their hashes differ);
    # routers name it when they refuse such a pair.
    kv_cache_dtype: str = ""
    # How the start went: the worker's phases (``worker.startup``), and the whole build of the engine.
    startup_phases: list[tuple[str, float]] = []
    startup_seconds: float = 0.0


class CoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


class CoreError(msgspec.Struct, tag="error"):
    """A request the core refused (it never entered the scheduler)."""

    request_id: str
    message: str


class CachedBlocks(msgspec.Struct, tag="cached_blocks"):
    token: int
    block_hashes: list[bytes]


CoreMessage = CoreReady | CoreOutputs | CoreError | CachedBlocks


def _die_with_parent(parent_pid: int) -> None:
    """A core outliving its API process (killed with SIGKILL, say) would keep its KV memory, its
    NIXL agent and its side-channel port alive, serving blocks nobody owns: die with the parent."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux/glibc: the loop's parent check still works
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def run_engine_core(args: EngineArgs, input_address: str, output_address: str, parent_pid: int) -> None:
    """Process entry point: build the core, announce readiness, serve until Shutdown or SIGTERM."""
    _die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    from pdserve.engine.build import build_engine_core  # torch and the model: this process's, not its parent's

    core, _, cpu_budget = build_engine_core(args)
    scheduler_config = core.config
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(CoreInput).decode
    publisher = None
    # The engine's id for one run: its peers' (side channel), its KV events' and its /health's.
    engine_id = args.kv_transfer.engine_id if args.kv_transfer is not None else uuid.uuid4().hex
    if args.kv_events_port is not None:
        keys_dir = args.kv_transfer.keys_dir if args.kv_transfer is not None else None
        keys = load_secret(keys_dir, EVENTS_KEY) if keys_dir else None
        publisher = KVEventPublisher(context, core, engine_id, args.kv_events_host, args.kv_events_port, keys)
    outputs.send(
        encode(
            CoreReady(
                scheduler_config.num_blocks,
                scheduler_config.block_size,
                scheduler_config.max_model_len,
                publisher.port if publisher else None,
                scheduler_config.enable_prefix_caching,
                core.kv_compat_hash,
                engine_id,
                core.scheduler.connector.peer_source(),
                scheduler_config.scheduling_policy,
                CpuShare(
                    cpu_budget.threads,
                    cpu_budget.reason,
                    cpu_budget.limits.cpu_quota or 0.0,
                    cpu_budget.limits.memory_limit or 0,
                )
                if cpu_budget is not None
                else None,
                core.kv_cache_dtype,
                core.startup_phases,
                core.startup_seconds,
            )
        )
    )
    last_stats = 0.0
    try:
        while not stopping:
            if not core.has_work():
                timeout_ms = int(IDLE_STATS_INTERVAL_S * 1000)
            else:
                timeout_ms = TRANSFER_POLL_MS if core.last_step_idle else 0
            while inputs.poll(timeout_ms):
                message = decode(inputs.recv())
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, AbortRequests):
                    core.abort_requests(message.request_ids)
                elif isinstance(message, ReleaseRemoteBlocks):
                    core.release_remote(message.remote)
                elif isinstance(message, DumpCachedBlocks):
                    outputs.send(encode(CachedBlocks(message.token, core.cached_block_hashes())))
                else:
                    try:
                        core.add_request(
                            Request(
                                message.request_id,
                                message.prompt_token_ids,
                                message.sampling_params,
                                message.eos_token_id,
                                message.arrival_time,
                                message.cache_salt,
                                message.remote_prefill,
                                message.remote_decode,
                                message.peer,
                                message.output_token_ids,
                                message.priority,
                                message.ahead,
                            )
                        )
                    except ValueError as error:
                        core.release_remote(message.remote_prefill)
                        outputs.send(encode(CoreError(message.request_id, str(error))))
                timeout_ms = 0
            results = core.step() if core.has_work() else []
            now = time.monotonic()
            if publisher is not None:
                publisher.publish(now)
            if results or now - last_stats >= IDLE_STATS_INTERVAL_S:
                if os.getppid() != parent_pid:
                    logger.error("the API process is gone: stopping the engine core")
                    return
                outputs.send(encode(CoreOutputs(results, core.make_stats())))
                last_stats = now
    finally:
        core.close()
        if publisher is not None:
            publisher.close()
        inputs.close(linger=0)
        outputs.close(linger=1000)
        context.term()
