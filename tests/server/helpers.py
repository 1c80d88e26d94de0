"""A real engine server for tests, run on its own event loop in a thread (as a separate process
would be), on a free port of 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading

from pdserve.engine.engine_args import EngineArgs
from pdserve.models.demo import ensure_demo_model
from pdserve.server.app import ServerLimits, start_engine_server


def demo_engine_args(cache_dir, kv_cache_memory: int = 32 << 20, max_model_len: int = 256) -> EngineArgs:
    """The demo model (fetched into ``cache_dir``) on CPU with a small KV cache."""
    model = str(ensure_demo_model(cache_dir))
    return EngineArgs(model=model, kv_cache_memory=kv_cache_memory, max_model_len=max_model_len, device="cpu")


class ServerThread:
    """Runs the asyncio server in its own thread, as a separate process would."""

    def __init__(
        self,
        args: EngineArgs,
        api_key: str | None = None,
        limits: ServerLimits | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = self.call(
            start_engine_server(
                args, served_model_name="demo", api_key=api_key, limits=limits, tool_call_parser=tool_call_parser
            )
        )

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=300)

    def close(self) -> None:
        self.call(self.running.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
