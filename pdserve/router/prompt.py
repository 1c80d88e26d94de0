"""A request's prompt as the engines will see it: its token ids (tokenized exactly as the engine's API server
does, with the same helpers from pdserve/api/tokenizer.py), its cache salt, and its block hashes (the block
pool's own, pdserve/engine/block_hash.py), computed only as far as a prefix match looks.

Tokenizing costs about 0.25 µs per character of text on this machine (0.4 ms for 1.5 KB, 12 ms for 35 KB),
hashing about 1 µs per 16-token block. Short texts are tokenized inline; long ones in a worker thread, so the
event loop keeps relaying other requests' streams meanwhile (the tokenizer releases the GIL).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, overload

from pdserve.api.chat import conversation
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.api.tenancy import request_cache_salt
from pdserve.engine.block_hash import first_block_extra_keys, hash_block_tokens

logger = logging.getLogger(__name__)

INLINE_CHARS = 4096  # longer texts are tokenized off the event loop (about 1 ms and up)


class BlockHashes(Sequence[bytes]):
    """The hashes of a prompt's blocks that an engine could serve from its prefix cache, made on first access.

    The length is what the engine's own lookup allows: whole blocks, and never the last prompt token (it is
    always computed, for its logits), so a pod's predicted hit equals what its engine will report."""

    __slots__ = ("_block_size", "_hashes", "_length", "_salt", "_token_ids")

    def __init__(self, token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> None:
        self._token_ids = token_ids
        self._block_size = block_size
        self._salt = cache_salt
        self._hashes: list[bytes] = []
        self._length = max(0, (len(token_ids) - 1) // block_size)

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._length))]
        if not 0 <= index < self._length:
            raise IndexError(index)
        hashes = self._hashes
        size = self._block_size
        while len(hashes) <= index:  # chained: each block's hash needs its parent's
            block = len(hashes)
            parent = hashes[-1] if hashes else None
            extra = first_block_extra_keys(self._salt) if block == 0 else None
            hashes.append(hash_block_tokens(parent, self._token_ids[block * size : (block + 1) * size], extra))
        return hashes[index]

    @property
    def num_computed(self) -> int:
        """How many hashes were actually made (for tests: matching must stay lazy)."""
        return len(self._hashes)


class Prompt:
    __slots__ = ("_by_block_size", "cache_salt", "token_ids")

    def __init__(self, token_ids: Sequence[int], cache_salt: str | None = None) -> None:
        self.token_ids = token_ids
        self.cache_salt = cache_salt
        self._by_block_size: dict[int, BlockHashes] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def hashes(self, block_size: int) -> BlockHashes:
        """The prompt's block hashes for pods with this block size (shared by every such pod's match)."""
        hashes = self._by_block_size.get(block_size)
        if hashes is None:
            hashes = self._by_block_size[block_size] = BlockHashes(self.token_ids, block_size, self.cache_salt)
        return hashes


class PromptReader:
    """Turns a parsed request into a :class:`Prompt`, with the model's tokenizer (``--tokenizer``)."""

    def __init__(self, tokenizer_path: str) -> None:
        # Imported here: transformers (and torch under it) cost a router without a tokenizer 1.5 s and memory.
        from pdserve.api.tokenizer import apply_chat_template, encode_prompt, load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_path)
        self._encode = encode_prompt
        self._template = apply_chat_template
        # One thread: the tokenizer object is not meant for concurrent calls from several threads.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pdserve-tokenize")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def read(
        self,
        parsed: CompletionRequest | ChatCompletionRequest,
        chat: bool,
        authorization: str | None = None,
        tenant: str | None = None,
    ) -> Prompt | None:
        """The request's single prompt, salted as the engines salt it (``api.tenancy``: by the ``authorization``
        and ``tenant`` headers its legs carry, and its cache_salt); None when there is none to route by (several
        prompts) or it cannot be tokenized here (the engine will say why)."""
        salt = request_cache_salt(authorization, parsed.cache_salt, tenant)
        try:
            if chat:
                return Prompt(await self._chat_ids(parsed), salt)  # type: ignore[arg-type]
            ids = await self._completion_ids(parsed.prompt)  # type: ignore[union-attr]
        except Exception as error:  # a bad template argument, an odd prompt: route without the prompt
            logger.debug("prompt not tokenized for routing: %s: %s", type(error).__name__, error)
            return None
        return None if not ids else Prompt(ids, salt)

    async def _completion_ids(self, prompt: Any) -> Sequence[int] | None:
        if isinstance(prompt, str):
            return await self._run(len(prompt), self._encode, self.tokenizer, prompt)
        if len(prompt) != 1 and not isinstance(prompt[0], int):
            return None  # several prompts: no single place suits them all
        first = prompt[0]
        if isinstance(first, int):
            return prompt  # token ids, as the engine takes them
        if isinstance(first, str):
            return await self._run(len(first), self._encode, self.tokenizer, first)
        return first

    async def _chat_ids(self, parsed: ChatCompletionRequest) -> list[int]:
        messages, template_kwargs = conversation(parsed)  # as the engine renders it (tools included)
        size = sum(len(message["content"]) for message in messages)
        return await self._run(
            size, self._render_chat, messages, parsed.add_generation_prompt is not False, template_kwargs
        )

    def _render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, template_kwargs: dict[str, Any]
    ) -> list[int]:
        return self._template(self.tokenizer, messages, add_generation_prompt, template_kwargs)

    async def _run(self, size: int, function: Any, *args: Any) -> Any:
        if size <= INLINE_CHARS:
            return function(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)
