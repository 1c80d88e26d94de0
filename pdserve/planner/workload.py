"""The traffic the planner sizes for: arrivals, prompt and output lengths, prefix sharing, KV-tier hits.

A `Workload` is either generated from a description (`WorkloadSpec`: a rate with burstiness,
length distributions - lognormal, or `Buckets` read back from a running service's histograms -
a prefix-hit rate, a tier-hit rate, a duration; seeded, so a plan is reproducible) or read
from a recorded trace (JSON lines of `{"t": seconds, "prompt_tokens": n, "output_tokens": m}`).
Prompts are token ids: a share `prefix_hit_rate` of each prompt is one of a few shared prefixes
(system prompts), the rest unique, so the real prefix cache in the simulator hits as often as
the workload says. A further share `tier_hit_rate`, after the shared prefix, is held by the
engines' KV tiers (host memory, disk, a shared volume: earlier turns of a conversation, a
document another engine read): the simulator loads that part instead of computing it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

VOCAB = 32000
NUM_SHARED_PREFIXES = 4


@dataclass(frozen=True)
class Arrival:
    time: float
    prompt: list[int]
    output_tokens: int
    # The length of the prompt's prefix that a KV tier holds: loaded rather than computed where the
    # engine's own prefix cache lacks it.
    tier_tokens: int = 0


@dataclass(frozen=True)
class Lengths:
    """A length distribution: lognormal around `mean` with coefficient of variation `cv` (0: fixed),
    clipped to [minimum, maximum]."""

    mean: float
    cv: float = 0.0
    minimum: int = 1
    maximum: int = 1 << 20

    def sample(self, rng: random.Random) -> int:
        if self.cv <= 0:
            value = self.mean
        else:
            sigma = math.sqrt(math.log(1 + self.cv**2))
            value = rng.lognormvariate(math.log(self.mean) - sigma**2 / 2, sigma)
        return max(self.minimum, min(self.maximum, round(value)))


@dataclass(frozen=True)
class Buckets:
    """A distribution read back from a Prometheus histogram: `counts[i]` observations at most
    `bounds[i]` and above the bound before it; `counts[-1]`, above the last bound. Sampled
    uniformly within a bucket (the open last bucket at its lower bound), as histogram_quantile
    interpolates."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @classmethod
    def from_cumulative(cls, cumulative: dict[float, float]) -> Buckets:
        """From Prometheus' cumulative `le` buckets (+Inf included), by upper bound."""
        bounds = sorted(cumulative)
        running = [max(0.0, cumulative[bound]) for bound in bounds]
        counts = [float(max(0.0, c - p)) for c, p in zip(running, [0.0, *running][:-1], strict=True)]
        finite = [b for b in bounds if math.isfinite(b)]
        return cls(tuple(finite), tuple(counts[: len(finite)]) + (sum(counts[len(finite) :]),))

    @property
    def total(self) -> float:
        return sum(self.counts)

    def _edges(self, index: int) -> tuple[float, float]:
        lower = self.bounds[index - 1] if index > 0 else 0.0
        upper = self.bounds[index] if index < len(self.bounds) else lower
        return lower, upper

    def mean(self) -> float:
        if not self.total:
            return 0.0
        return sum(count * sum(self._edges(i)) / 2 for i, count in enumerate(self.counts)) / self.total

    def quantile(self, q: float) -> float:
        """The value below which a share q of the observations lie (interpolated within its bucket)."""
        wanted = q * self.total
        seen = 0.0
        for index, count in enumerate(self.counts):
            if count and seen + count >= wanted:
                lower, upper = self._edges(index)
                return lower + (upper - lower) * (wanted - seen) / count
            seen += count
        return self.bounds[-1] if self.bounds else 0.0

    def sample(self, rng: random.Random) -> int:
        index = rng.choices(range(len(self.counts)), weights=self.counts)[0]
        lower, upper = self._edges(index)
        return max(1, round(rng.uniform(lower, upper)))


@dataclass(frozen=True)
class WorkloadSpec:
    rate: float  # requests per second, on average
    prompt: Lengths | Buckets
    output: Lengths | Buckets
    duration_s: float = 600.0
    burstiness: float = 1.0  # coefficient of variation of the gaps: 1 Poisson, above 1 bursty, 0 regular
    prefix_hit_rate: float = 0.0  # share of each prompt that is a shared prefix
    tier_hit_rate: float = 0.0  # share of each prompt, after its shared prefix, that KV tiers hold
    seed: int = 0
    # The engines' context length: prompts are kept below it, outputs capped to what fits after them
    # (as the engine caps max_tokens).
    max_model_len: int = 1 << 30

    def scaled(self, factor: float) -> WorkloadSpec:
        """The same traffic at `factor` times the rate."""
        return dataclasses.replace(self, rate=self.rate * factor)

    def arrivals(self) -> list[Arrival]:
        if self.rate <= 0:
            raise ValueError("the arrival rate must be above 0")
        if not 0 <= self.prefix_hit_rate < 1:
            raise ValueError("the prefix-hit rate must be at least 0 and below 1")
        if not 0 <= self.tier_hit_rate < 1 - self.prefix_hit_rate:
            raise ValueError("the tier-hit rate must be at least 0, and below 1 with the prefix-hit rate")
        rng = random.Random(self.seed)
        prefixes = [[rng.randrange(VOCAB) for _ in range(1 << 16)] for _ in range(NUM_SHARED_PREFIXES)]
        found: list[Arrival] = []
        now = 0.0
        while True:
            now += _gap(rng, self.rate, self.burstiness)
            if now >= self.duration_s:
                return found
            length = min(self.prompt.sample(rng), self.max_model_len - 1)
            shared = min(int(length * self.prefix_hit_rate), len(prefixes[0]))
            prompt = rng.choice(prefixes)[:shared] + [rng.randrange(VOCAB) for _ in range(length - shared)]
            # Below the whole prompt: int(a) + int(b) <= a + b < length.
            tier = shared + int(length * self.tier_hit_rate) if self.tier_hit_rate else 0
            found.append(Arrival(now, prompt, min(self.output.sample(rng), self.max_model_len - length), tier))


def _gap(rng: random.Random, rate: float, burstiness: float) -> float:
    """A gap between arrivals: gamma-distributed with mean 1/rate and coefficient of variation `burstiness`."""
    if burstiness <= 0:
        return 1.0 / rate
    shape = 1.0 / burstiness**2
    return rng.gammavariate(shape, 1.0 / (rate * shape))


def read_trace(path: str | Path, seed: int = 0) -> list[Arrival]:
    """A recorded trace: one JSON object per line with t (seconds), prompt_tokens and output_tokens."""
    rng = random.Random(seed)
    found = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            found.append(
                Arrival(
                    float(entry["t"]),
                    [rng.randrange(VOCAB) for _ in range(int(entry["prompt_tokens"]))],
                    int(entry["output_tokens"]),
                )
            )
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a trace entry ({error})") from None
    return sorted(found, key=lambda arrival: arrival.time)
