"""LoadOrRecompute: whether loading a prompt's blocks from the KV tiers beats computing them, by measurement.

Loading n blocks costs their bytes over the tier's measured read bandwidth, plus one step of waiting (a
request whose blocks load asynchronously runs a step later). Recomputing costs their tokens over the
measured prefill rate (tokens per second of forwards that computed at least ``MIN_TIMED_TOKENS``; small
steps are mostly fixed overhead). Both are moving averages of the worker side's reports. Until both are
known the tiers load (that is how their bandwidth gets measured), and a tier that was judged slower still
gets one load in ``EXPLORE_EVERY`` so its figure follows the disk's (a cold page cache warms up).

Recomputing is underestimated (attention's cost grows with the context, the rate is an average over
prompts), which errs toward recomputing: the rule never loads when recomputing is measured faster.
"""

from __future__ import annotations

MIN_TIMED_TOKENS = 32
EXPLORE_EVERY = 32
_WEIGHT = 0.2  # of a new sample in the moving averages


def _average(old: float | None, sample: float) -> float:
    return sample if old is None else old + _WEIGHT * (sample - old)


class LoadOrRecompute:
    def __init__(self, rank_block_bytes: int) -> None:
        """``rank_block_bytes``: one rank's share of a block (the ranks load their shares in parallel)."""
        self.rank_block_bytes = rank_block_bytes
        self.seconds_per_token: float | None = None
        self.step_seconds: float | None = None
        self.seconds_per_byte: dict[str, float] = {}
        self._declined = 0

    def note_step(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self.step_seconds = _average(self.step_seconds, seconds)
        if tokens >= MIN_TIMED_TOKENS:
            self.seconds_per_token = _average(self.seconds_per_token, seconds / tokens)

    def note_load(self, medium: str, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.seconds_per_byte[medium] = _average(self.seconds_per_byte.get(medium), seconds / num_bytes)

    def estimate(self, blocks_by_medium: dict[str, int], tokens: int) -> tuple[float, float] | None:
        """(seconds to load, seconds to recompute), or None while a figure is unknown."""
        if self.seconds_per_token is None or self.step_seconds is None:
            return None
        load = self.step_seconds
        for medium, blocks in blocks_by_medium.items():
            per_byte = self.seconds_per_byte.get(medium)
            if per_byte is None:
                return None
            load += blocks * self.rank_block_bytes * per_byte
        return load, tokens * self.seconds_per_token

    def worth_loading(self, blocks_by_medium: dict[str, int], tokens: int) -> bool:
        estimate = self.estimate(blocks_by_medium, tokens)
        if estimate is None or estimate[0] < estimate[1]:
            return True
        self._declined += 1
        return self._declined % EXPLORE_EVERY == 0
