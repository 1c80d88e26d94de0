"""The prefill leg of a request: a prefill pod whose KV the chosen decode pod can use, the leg's body as the
prefill-leg field contract makes it (``pdserve.api.prefill_leg``), a deadline from the prompt's size and the
pod's measured speed, a peer to read the prompt's leading blocks from when one holds more of them than the pod
(``peer_holds``), and what its answer means (``PrefillResult``: params, a failure to fall back from, or a
4xx for the client). Held blocks that no decode leg will pull (the client left between the legs) are
released from here, best effort: the lease frees them otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.api.prefill_leg import leg_body, prefill_timeout_s
from pdserve.router.config import RouterConfig
from pdserve.router.deadlines import Deadlines
from pdserve.router.exchange import REQUEST_ID, Exchange
from pdserve.router.http_server import Response
from pdserve.router.leg_client import LegConnectError, LegError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.peer_holds import PeerHolds
from pdserve.router.pods import Pod, PodSet
from pdserve.router.policy import Chooser
from pdserve.router.upstream import Upstream, Usage

logger = logging.getLogger(__name__)

# Where a prefill engine frees a leg's held blocks that no decode will pull (pdserve/server/app.py).
RELEASE_PATH = "/v1/kv_transfer/release"
RELEASE_TIMEOUT_S = 5.0


def prefill_timeout(config: RouterConfig, pod: Pod, prompt_tokens: int) -> float:
    """How long a prefill leg may take on ``pod``: ``--prefill-timeout``, else a floor plus a margin
    over what the pod's measured speed says the prompt needs (an assumed speed until measured), so a
    short prompt on a hung pod costs a few seconds, not the request timeout."""
    if config.prefill_timeout is not None:
        return config.prefill_timeout
    return min(prefill_timeout_s(prompt_tokens, pod.prefill_speed), config.request_timeout)


class _PrefillAnswer(msgspec.Struct):
    # Only the params are read; the dict keeps every field, known or not, to pass on unchanged.
    kv_transfer_params: dict[str, Any] | None = None
    usage: Usage | None = None


@dataclass
class PrefillResult:
    params: dict[str, Any] | None = None
    pod: Pod | None = None  # the prefill pod holding the blocks the params name
    failed: bool = False
    rejection: Response | None = None  # a prefill 4xx, returned to the client as is


class PrefillLegs:
    def __init__(
        self,
        upstream: Upstream,
        config: RouterConfig,
        pods: PodSet,
        chooser: Chooser,
        metrics: RouterMetrics,
        deadlines: Deadlines,
        peer_holds: PeerHolds | None = None,
        holders: PodSet | None = None,
    ) -> None:
        """``peer_holds``, ``holders``: the turns the ``holders`` pods hold for peer reads (None: no peer reads)."""
        self.deadlines = deadlines
        self.peer_holds = peer_holds
        self.holders = holders
        self.upstream = upstream
        self.config = config
        self.pods = pods
        self.chooser = chooser
        self.metrics = metrics
        self._background: set[asyncio.Task[None]] = set()  # releases sent after their request ended
        self._warned_dtypes: set[tuple[str, str]] = set()  # (decode url, prefill KV dtypes) said once in the log

    def _warn_kv_dtypes(self, decode: Pod) -> None:
        """Say once per decode pod when the prefill pool stores KV in another dtype: a configuration mistake
        (P/D between KV cache dtypes is refused, not converted) that otherwise shows only as every prompt
        prefilled on the decode pool."""
        others = sorted({pod.kv_cache_dtype for pod in self.pods.pods if pod.kv_cache_dtype} - {decode.kv_cache_dtype})
        key = (decode.url, ",".join(others))
        if not others or decode.kv_cache_dtype is None or key in self._warned_dtypes:
            return
        self._warned_dtypes.add(key)
        logger.warning(
            "decode pod %s stores KV as %s but the prefill pods as %s: engines of different --kv-cache-dtype do "
            "not pair, so its prompts are prefilled on the decode pod; give both pools the same --kv-cache-dtype",
            decode.url,
            decode.kv_cache_dtype,
            " or ".join(others),
        )

    async def run(self, exchange: Exchange, body: dict[str, Any], chat: bool) -> PrefillResult:
        """Send ``body``'s prefill leg and read its answer."""
        # No healthy prefill pod: decode can prefill at once, which beats waiting on a pod known to be down.
        # Only a prefill engine whose KV the chosen decode engine can use: same compatibility hash.
        decode_hash = exchange.decode.pod.compat_hash if exchange.decode is not None else None
        incompatible = [pod for pod in self.pods.pods if pod.compat_hash != decode_hash]
        choice = self.chooser.choose(
            self.pods, exchange.prompt, exchange.session, exclude=incompatible, healthy_only=True
        )
        if choice is None and len(incompatible) == len(self.pods.pods):
            # Nothing failed: no prefill engine runs this decode engine's model (mid-rollout, say).
            self.metrics.errors["no_compatible_prefill"].inc()
            if exchange.decode is not None:
                self._warn_kv_dtypes(exchange.decode.pod)
            return PrefillResult()
        if choice is None:
            self.metrics.errors["no_prefill"].inc()
            return PrefillResult(failed=True)
        pod = choice.pod
        self.metrics.chose("prefill", pod.url, choice.policy)
        leg = leg_body(body, chat)
        if self.peer_holds is not None and self.holders is not None and exchange.prompt is not None:
            source = self.peer_holds.source_for(exchange.prompt, pod, self.holders.pods, self.upstream.capability)
            if source is not None:
                leg["kv_transfer_params"] = {**leg["kv_transfer_params"], "kv_prefix_source": source}
                self.metrics.prefix_sources.inc()
        encoded = msgspec.json.encode(leg)
        # Without the tokens (no tokenizer), the body's size bounds the prompt's token count from above.
        prompt_tokens = len(exchange.prompt.token_ids) if exchange.prompt is not None else len(encoded) // 2
        timeout = prefill_timeout(self.config, pod, prompt_tokens)
        started = time.perf_counter()
        pod.take()
        try:
            # One statement, as nested ones: the leg is sent inside the timeout.
            async with (
                self.deadlines.timeout(timeout),
                await self.upstream.post(pod, exchange.request.path, encoded, exchange.headers) as answer,
            ):
                payload = await answer.read()
                status = answer.status
                content_type = answer.headers.get("Content-Type", "application/json")
        except TimeoutError:
            # A hung pod (stopped, wedged) answers nothing: decode computes the prompt, and the pod
            # stays out of rotation until its health probe answers again. Leaving the leg closes its
            # connection, so the engine (if it ever runs again) aborts it and frees its blocks.
            logger.warning(
                "request %s: prefill pod %s took over %.1f s; decode prefills", exchange.request_id, pod.url, timeout
            )
            self.metrics.errors["prefill_timeout"].inc()
            self.upstream.eject(self.pods, pod, f"a prefill leg took over {timeout:.1f} s")
            return PrefillResult(failed=True)
        except LegError as error:
            logger.debug("request %s: prefill pod %s failed (%r); decode prefills", exchange.request_id, pod.url, error)
            self.metrics.errors["prefill_unreachable"].inc()
            if isinstance(error, LegConnectError):  # nothing listens there: out at once
                self.upstream.eject(self.pods, pod, f"connection failed: {error}")
            else:
                self.upstream.failed(self.pods, pod, f"{type(error).__name__}: {error}")
            return PrefillResult(failed=True)
        finally:
            pod.in_flight -= 1
        if 400 <= status < 500:
            pod.failures = 0
            return PrefillResult(
                rejection=Response(payload, status, {"Content-Type": content_type, REQUEST_ID: exchange.request_id})
            )
        if status != 200:
            self.metrics.errors["prefill_5xx"].inc()
            if status != 503:  # 503: busy or draining, which its health check tells
                self.upstream.failed(self.pods, pod, f"answered {status}")
            return PrefillResult(failed=True)
        pod.failures = 0
        try:
            answer_body = msgspec.json.decode(payload, type=_PrefillAnswer)
        except msgspec.MsgspecError:
            self.metrics.errors["prefill_bad_answer"].inc()
            return PrefillResult(failed=True)
        self.upstream.observe("prefill", choice, answer_body.usage)
        usage = answer_body.usage
        if usage is not None and usage.prompt_tokens:
            computed = usage.prompt_tokens - (
                usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            )
            speed = max(computed, 1) / max(time.perf_counter() - started, 1e-3)
            pod.prefill_speed = speed if pod.prefill_speed is None else 0.8 * pod.prefill_speed + 0.2 * speed
        return PrefillResult(params=answer_body.kv_transfer_params, pod=pod)

    def release_later(self, pod: Pod, params: dict[str, Any], headers: dict[str, str]) -> None:
        """Tell ``pod`` to free the blocks ``params`` name, in the background."""
        task = asyncio.get_running_loop().create_task(self._release(pod, params, headers))
        self._background.add(task)  # referenced until done: the loop keeps only weak references
        task.add_done_callback(self._background.discard)

    async def _release(self, pod: Pod, params: dict[str, Any], headers: dict[str, str]) -> None:
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                body = msgspec.json.encode({"kv_transfer_params": params})
                async with await self.upstream.post(pod, RELEASE_PATH, body, headers) as answer:
                    await answer.read()
                    released = answer.status == 200
        except (LegError, TimeoutError, RuntimeError):  # RuntimeError: the router is closing
            released = False
        self.metrics.prefill_releases.labels("sent" if released else "failed").inc()
