"""Sampler: turns a batch of logits into next tokens, one row per request, with vLLM's semantics.

Order: penalties (repetition over prompt and output tokens, frequency and presence over output
tokens) → the grammar's token bitmask (structured outputs: disallowed tokens get -inf) → greedy
argmax, or temperature → min-p → top-k → top-p → a draw. Each draw is an
exponential race (argmax of probs / Exp(1) noise). A request with a seed draws its noise from a generator seeded
by (its seed, the output position being sampled) — counter-based, not a stream consumed step by step — so its
token at a position depends on nothing else: not on what shares the batch, not on how it got there (a
preemption's recompute, or a continuation on another engine from that position, draws the same). Logprobs are
those of the raw logits (before any processing).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from pdserve.worker.interface import SamplingOptions, ScheduledRequest, TokenLogprobs


def draw_seed(seed: int, position: int) -> int:
    """The noise seed of a seeded request's draw of its output token ``position`` (0: the first)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch seeds are below 2**63


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # Re-seeded for each seeded row's draw (draw_seed): no state is kept per request.
        self._generator = torch.Generator(device=device)

    def sample(
        self,
        logits: torch.Tensor,
        requests: Sequence[ScheduledRequest],
        grammar: tuple[list[int], np.ndarray] | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """Next token of each row of ``logits [rows, vocab]`` (float32, modified in place), and
        logprobs where asked; ``grammar``: (rows, their packed token bitmask) to constrain."""
        params = [request.sampling_params for request in requests]
        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        penalised = [
            i for i, p in enumerate(params) if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        ]
        if penalised:
            logits = logits.clone()
            for i in penalised:
                apply_penalties(logits[i], requests[i], self.vocab_size)
        if grammar is not None:
            # After the penalties: a penalty scales logits, and a masked -inf scaled by a penalty that
            # rounds to 0 would become NaN.
            apply_token_bitmask(logits, *grammar)

        sampled = torch.empty(len(params), dtype=torch.int64, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        if greedy:
            sampled[greedy] = logits[greedy].argmax(dim=-1)
        drawn = [i for i, p in enumerate(params) if not p.is_greedy]
        if drawn:
            sampled[drawn] = self._draw(logits[drawn], [requests[i] for i in drawn])
        token_ids = sampled.tolist()

        if raw_logprobs is None:
            return token_ids, None
        entries = logprob_entries(
            raw_logprobs[want_logprobs],
            [token_ids[i] for i in want_logprobs],
            [params[i].logprobs or 0 for i in want_logprobs],
        )
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        for i, entry in zip(want_logprobs, entries, strict=True):
            logprobs[i] = entry
        return token_ids, logprobs

    def _draw(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> torch.Tensor:
        params = [request.sampling_params for request in requests]
        # A temperature beyond the dtype's range would be inf, and a masked -inf / inf is NaN.
        limit = torch.finfo(logits.dtype).max
        temperatures = torch.tensor(
            [min(p.temperature, limit) for p in params], dtype=logits.dtype, device=logits.device
        )
        logits = filter_logits(logits / temperatures[:, None], params)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        seeded = [(row, p.seed) for row, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):  # the unseeded rows' noise in one draw (seeded rows' drawn again below)
            noise.exponential_()
        generator = self._generator
        for row, seed in seeded:
            request = requests[row]
            # The token being sampled is the output's next: its position is the output's length now.
            generator.manual_seed(draw_seed(seed, request.num_tokens - request.num_prompt_tokens))
            noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """Set to -inf, in place, each token of ``logits[rows[i]]`` whose bit in ``bitmask[i]`` is clear
    (packed int32 words, little-endian bit order: token t is bit t % 32 of word t // 32)."""
    vocab = logits.shape[-1]
    packed = torch.from_numpy(bitmask).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, request: ScheduledRequest, vocab_size: int) -> None:
    """vLLM's penalties on one row, in place: repetition over prompt and output tokens (divide a
    positive logit, multiply a negative one), frequency and presence over output tokens."""
    params = request.sampling_params
    device = logits.device
    output_counts = torch.bincount(
        torch.tensor(request.output_token_ids, dtype=torch.int64, device=device), minlength=vocab_size
    )[:vocab_size].to(logits.dtype)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        seen[torch.tensor(request.prompt_token_ids, dtype=torch.int64, device=device)] = True
        seen |= output_counts > 0
        penalty = params.repetition_penalty
        penalised = torch.where(seen & (logits > 0), logits / penalty, torch.where(seen, logits * penalty, logits))
        # An extreme penalty overflows to ±inf (then NaN in softmax): keep the result finite.
        limit = torch.finfo(logits.dtype).max
        logits.copy_(penalised.clamp(-limit, limit))
    if params.frequency_penalty:
        logits -= params.frequency_penalty * output_counts
    if params.presence_penalty:
        logits -= params.presence_penalty * (output_counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingOptions]) -> torch.Tensor:
    """min-p, top-k and top-p over rows with per-row settings; filtered entries become -inf."""
    neg_inf = float("-inf")
    min_p = [p.min_p for p in params]
    if any(min_p):
        probs = torch.softmax(logits, dim=-1)
        threshold = (
            probs.max(dim=-1, keepdim=True).values
            * torch.tensor(min_p, dtype=logits.dtype, device=logits.device)[:, None]
        )
        logits = logits.masked_fill(probs < threshold, neg_inf)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    if any(top_k):
        k = torch.tensor([k or logits.shape[-1] for k in top_k], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], neg_inf)
    if any(p < 1.0 for p in top_p):
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Rows without top-p get a threshold no cumulative sum reaches, rounding included.
        p = torch.tensor([p if p < 1.0 else 2.0 for p in top_p], dtype=logits.dtype, device=logits.device)
        # Keep the smallest prefix whose mass reaches p, and always the top token (a p that rounds
        # to 0 in the logits' dtype would otherwise mask every token).
        sorted_logits = sorted_logits.masked_fill((mass_before >= p[:, None]) & (ranks > 0), neg_inf)
    return torch.full_like(logits, neg_inf).scatter(-1, order, sorted_logits)


def logprob_entries(logprobs: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """For each row of ``logprobs [rows, vocab]``: the given token's logprob and rank, and the top-n."""
    rows = torch.arange(len(token_ids), device=logprobs.device)
    chosen = logprobs[rows, torch.tensor(token_ids, device=logprobs.device)]
    ranks = ((logprobs > chosen[:, None]).sum(dim=-1) + 1).tolist()
    max_top = max(num_top)
    top_values, top_ids = logprobs.topk(max_top, dim=-1)  # empty columns when no row wants alternatives
    chosen_list = chosen.tolist()
    entries = []
    for row, (token_id, n) in enumerate(zip(token_ids, num_top, strict=True)):
        entries.append(
            TokenLogprobs(
                token_id,
                chosen_list[row],
                ranks[row],
                top_ids[row, :n].tolist(),
                top_values[row, :n].tolist(),
            )
        )
    return entries
