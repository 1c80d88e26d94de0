"""EngineCoreClient: the API process's handle on an EngineCore process (asyncio).

It starts the core process, sends requests and aborts, and routes each output to the queue of
the request it belongs to. The core's process sentinel is watched by the event loop itself, so a
core that dies is noticed at once: every request in flight gets :class:`EngineDeadError`, and so
does every later call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from pdserve.api.peer_kv import PeerKV
from pdserve.engine.core_process import (
    AbortRequests,
    AddRequest,
    CachedBlocks,
    CoreError,
    CoreMessage,
    CoreOutputs,
    CoreReady,
    DumpCachedBlocks,
    ReleaseRemoteBlocks,
    Shutdown,
    run_engine_core,
)
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stats import SchedulerStats
from pdserve.kvtransfer.params import RemotePrefill


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing sent to it will be answered."""


class RequestRejectedError(ValueError):
    """The core refused a request (for example a prompt longer than the context)."""


class EngineCoreClient:
    def __init__(
        self,
        process: multiprocessing.process.BaseProcess,
        context: zmq.asyncio.Context,
        inputs: zmq.asyncio.Socket,
        outputs: zmq.asyncio.Socket,
        ready: CoreReady,
        socket_dir: str,
    ) -> None:
        self.process = process
        self.ready = ready
        self.stats: SchedulerStats | None = None
        self.on_stats: Callable[[SchedulerStats], None] | None = None  # called with every snapshot
        self._context = context
        self._inputs = inputs
        self._outputs = outputs
        self._socket_dir = socket_dir
        self._encode = msgspec.msgpack.Encoder().encode
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput | Exception]] = {}
        self._dead: EngineDeadError | None = None
        self.died = asyncio.Event()  # set when the core process exits without being asked to
        self._dumps: dict[int, asyncio.Future[list[bytes]]] = {}
        self._next_dump = itertools.count()
        self._receiver = asyncio.get_running_loop().create_task(self._receive())
        asyncio.get_running_loop().add_reader(process.sentinel, self._on_process_exit)

    @classmethod
    async def start(cls, args: EngineArgs, startup_timeout: float = 600.0) -> EngineCoreClient:
        """Start the core process and wait until its model is loaded (or it fails)."""
        socket_dir = tempfile.mkdtemp(prefix="pdserve-core-")
        input_address = f"ipc://{os.path.join(socket_dir, 'in')}"
        output_address = f"ipc://{os.path.join(socket_dir, 'out')}"
        context = zmq.asyncio.Context()
        inputs = context.socket(zmq.PUSH)
        inputs.bind(input_address)
        outputs = context.socket(zmq.PULL)
        outputs.bind(output_address)
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(args, input_address, output_address, os.getpid()),
            name="pdserve-engine-core",
            daemon=True,
        )
        process.start()
        decode = msgspec.msgpack.Decoder(CoreMessage).decode
        deadline = time.monotonic() + startup_timeout
        try:
            while True:
                if not process.is_alive():
                    raise EngineDeadError(f"the engine core exited during start-up (exit code {process.exitcode})")
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"the engine core was not ready within {startup_timeout:.0f} s")
                if await outputs.poll(200):
                    message = decode(await outputs.recv())
                    if isinstance(message, CoreReady):
                        return cls(process, context, inputs, outputs, message, socket_dir)
        except BaseException:
            process.kill()
            inputs.close(linger=0)
            outputs.close(linger=0)
            context.term()
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise

    @property
    def num_in_flight(self) -> int:
        """Core requests sent and not finished (running or queued in the core)."""
        return len(self._queues)

    @property
    def alive(self) -> bool:
        return self._dead is None

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        cache_salt: str | None = None,
        remote_prefill: RemotePrefill | None = None,
        remote_decode: bool = False,
        peer: PeerKV | None = None,
        output_token_ids: list[int] | None = None,
        priority: int = 0,
        ahead: bool = False,
    ) -> asyncio.Queue[EngineCoreOutput | Exception]:
        """Send a request; its outputs (then possibly an exception) arrive on the returned queue.
        ``remote_prefill``, ``remote_decode``, ``peer``: its P/D leg, as the P/D gate parsed and screened it;
        ``output_token_ids``: a continued stream's output so far; ``priority``: lower first (priority policy);
        ``ahead``: before the others of its priority (that policy)."""
        if self._dead is not None:
            raise self._dead
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[EngineCoreOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        await self._inputs.send(
            self._encode(
                AddRequest(
                    request_id,
                    prompt_token_ids,
                    sampling_params,
                    eos_token_id,
                    time.monotonic(),
                    cache_salt,
                    remote_prefill,
                    remote_decode,
                    peer,
                    output_token_ids or [],
                    priority,
                    ahead,
                )
            )
        )
        return queue

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests (their blocks are freed by the core); their queues get nothing more."""
        for request_id in request_ids:
            self._queues.pop(request_id, None)
        if self._dead is None and request_ids:
            await self._inputs.send(self._encode(AbortRequests(list(request_ids))))

    async def release_remote_blocks(self, remote: RemotePrefill) -> None:
        """Tell the prefill engine holding ``remote`` to free the blocks (the decode leg they belong to was
        refused before reaching the core)."""
        if self._dead is None:
            await self._inputs.send(self._encode(ReleaseRemoteBlocks(remote)))

    async def cached_blocks(self, timeout: float = 10.0) -> list[bytes]:
        """Every block hash in the core's prefix cache, now."""
        if self._dead is not None:
            raise self._dead
        token = next(self._next_dump)
        future = self._dumps[token] = asyncio.get_running_loop().create_future()
        try:
            await self._inputs.send(self._encode(DumpCachedBlocks(token)))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._dumps.pop(token, None)

    async def _receive(self) -> None:
        decode = msgspec.msgpack.Decoder(CoreMessage).decode
        while True:
            message = decode(await self._outputs.recv())
            if isinstance(message, CoreOutputs):
                self.stats = message.stats
                if self.on_stats is not None:
                    self.on_stats(message.stats)
                for output in message.outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                        if output.finish_reason is not None:
                            del self._queues[output.request_id]
            elif isinstance(message, CachedBlocks):
                future = self._dumps.get(message.token)
                if future is not None and not future.done():
                    future.set_result(message.block_hashes)
            elif isinstance(message, CoreError):
                queue = self._queues.pop(message.request_id, None)
                if queue is not None:
                    queue.put_nowait(RequestRejectedError(message.message))

    def _on_process_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.process.sentinel)
        self.process.join(0)
        self._dead = EngineDeadError(f"the engine core process exited (exit code {self.process.exitcode})")
        for queue in self._queues.values():
            queue.put_nowait(self._dead)
        self._queues.clear()
        self.died.set()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait for it (kill it after ``timeout``), release the sockets."""
        if self._dead is None and self.process.is_alive():
            # Bounded: a core that died a moment ago (its sentinel not seen yet) reads nothing, and
            # an unbounded send to it would hang the shutdown for ever.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._inputs.send(self._encode(Shutdown())), timeout)
            deadline = time.monotonic() + timeout
            while self.process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self._receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._receiver
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
