"""An engine's measured costs on its hardware, as the planner's simulator reads them.

A `Profile` holds the engine's configuration (KV blocks, block size, batch limits), a step-time
model fitted to measured steps, and a KV-transfer model (fixed latency plus bytes over bandwidth),
with the raw points kept beside the fits. `pdserve profile` measures one (pdserve/bench/profile.py);
`pdserve plan` reads it. How fast the engine's KV tiers load blocks (`tier_bytes_per_s`) is not
measured: `pdserve plan --tier-bandwidth` gives it.

The step-time model is linear in features of a scheduled step, each a cost the forward pass pays
(fitted with non-negative coefficients):
  tokens               tokens computed (the linear layers' work),
  sequences            requests in the batch (per-row overheads, sampling),
  decode attention     the context read by the batch's one-token (decode) requests: memory-bound,
  prefill attention    the sum over prompt chunks of new tokens x the context they attend to
                       (a chunk of n tokens after c cached ones: n * (c + n)): compute-bound,
  min(sequences, k)    for k = 2, 4, ... 64, and min(tokens, k) for k = 32, 128, ... 8192: a
                       concave piecewise-linear part, because a row or a token costs less as the
                       batch grows (a CPU's GEMV-to-GEMM switch, a GPU's memory-bound small
                       batches); with only the linear terms, the 2-core CPU's decode steps of 2-8
                       requests were under-predicted by 20-30% (median error 14%, now 2%),
and a constant per step. Profiles written with the first, four-term model (constant, tokens,
sequences, attention) are read with that attention term for both kinds and no concave part.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.engine.scheduler_config import SchedulerConfig

SEQUENCE_KNOTS = (2, 4, 8, 16, 32, 64)
TOKEN_KNOTS = (32, 128, 512, 2048, 8192)
FEATURES = (
    "constant",
    "tokens",
    "sequences",
    "decode_attention",
    "prefill_attention",
    *(f"min_sequences_{k}" for k in SEQUENCE_KNOTS),
    *(f"min_tokens_{k}" for k in TOKEN_KNOTS),
)
# The first model's coefficients: constant, tokens, sequences, attention (one term for both kinds).
FIRST_MODEL_TERMS = 4


@dataclass
class StepPoint:
    """One measured step: its composition (per scheduled request: new tokens, tokens before them)
    and how long it took."""

    new_tokens: list[int]
    start_positions: list[int]
    seconds: float


def step_features(new_tokens: Sequence[int], start_positions: Sequence[int]) -> list[float]:
    """The model's features of a step (in `FEATURES` order)."""
    decode_attention = prefill_attention = 0
    for n, start in zip(new_tokens, start_positions, strict=True):
        if n == 1:
            decode_attention += start + 1
        else:
            prefill_attention += n * (start + n)
    sequences, tokens = len(new_tokens), sum(new_tokens)
    return [
        1.0,
        float(tokens),
        float(sequences),
        float(decode_attention),
        float(prefill_attention),
        *(float(min(sequences, k)) for k in SEQUENCE_KNOTS),
        *(float(min(tokens, k)) for k in TOKEN_KNOTS),
    ]


def fit_non_negative(features: np.ndarray, targets: np.ndarray, usable: np.ndarray | None = None) -> np.ndarray:
    """Least squares with every coefficient >= 0: a negative one is fixed at zero and the rest refitted
    (a cost cannot shrink as work grows; small samples would otherwise produce negative terms).
    Features not `usable` (a boolean mask) are held at zero from the start."""
    active = np.ones(features.shape[1], dtype=bool) if usable is None else usable.copy()
    coefficients = np.zeros(features.shape[1])
    while active.any():
        solution, *_ = np.linalg.lstsq(features[:, active], targets, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        worst = np.flatnonzero(active)[int(np.argmin(solution))]
        active[worst] = False
    return coefficients


@dataclass
class StepTimeModel:
    coefficients: list[float]  # seconds per unit of each feature, in FEATURES order

    def __post_init__(self) -> None:
        if len(self.coefficients) == FIRST_MODEL_TERMS:  # the first model's: attention for both kinds
            constant, tokens, sequences, attention = self.coefficients
            rest = [0.0] * (len(FEATURES) - 5)
            self.coefficients = [constant, tokens, sequences, attention, attention, *rest]
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"a step model has {len(FEATURES)} coefficients, not {len(self.coefficients)}")
        # The concave terms that have a coefficient, as (coefficient, knot): what `seconds` adds up.
        bends = self.coefficients[len(FEATURES) - len(SEQUENCE_KNOTS) - len(TOKEN_KNOTS) :]
        self._sequence_bends = [(c, k) for c, k in zip(bends, SEQUENCE_KNOTS, strict=False) if c]
        self._token_bends = [(c, k) for c, k in zip(bends[len(SEQUENCE_KNOTS) :], TOKEN_KNOTS, strict=True) if c]

    @classmethod
    def fit(cls, points: Sequence[StepPoint]) -> StepTimeModel:
        if not points:
            raise ValueError("no measured steps to fit")
        features = np.array([step_features(p.new_tokens, p.start_positions) for p in points])
        # Relative error matters as much on a 5 ms decode step as on a 500 ms prefill: weight by 1/time.
        seconds = np.array([p.seconds for p in points])
        weights = 1.0 / np.maximum(seconds, 1e-6)
        # A bend at or past the largest batch measured would be a guess (over the data it equals the
        # linear term): beyond the measured range the model goes on with its last slope.
        most_sequences = max(len(p.new_tokens) for p in points)
        most_tokens = max(sum(p.new_tokens) for p in points)
        usable = np.array(
            [True] * (len(FEATURES) - len(SEQUENCE_KNOTS) - len(TOKEN_KNOTS))
            + [k < most_sequences for k in SEQUENCE_KNOTS]
            + [k < most_tokens for k in TOKEN_KNOTS]
        )
        if len(points) < usable.sum():
            raise ValueError(f"need at least {usable.sum()} measured steps to fit, got {len(points)}")
        coefficients = fit_non_negative(features * weights[:, None], seconds * weights, usable)
        return cls([float(c) for c in coefficients])

    def seconds(self, new_tokens: Sequence[int], start_positions: Sequence[int]) -> float:
        """The step's predicted time: `step_features` dotted with the coefficients, in one pass (the
        simulator asks once per simulated step)."""
        c = self.coefficients
        tokens = decode_attention = prefill_attention = 0
        for n, start in zip(new_tokens, start_positions, strict=True):
            tokens += n
            if n == 1:
                decode_attention += start + 1
            else:
                prefill_attention += n * (start + n)
        sequences = len(new_tokens)
        total = c[0] + c[1] * tokens + c[2] * sequences + c[3] * decode_attention + c[4] * prefill_attention
        for coefficient, knot in self._sequence_bends:
            total += coefficient * min(sequences, knot)
        for coefficient, knot in self._token_bends:
            total += coefficient * min(tokens, knot)
        return total

    def describe(self) -> str:
        """The fitted terms, e.g. "0.008 + 0.0019 x tokens + 3.7e-06 x decode_attention"."""
        terms = [
            f"{c:.3g}" if name == "constant" else f"{c:.3g} x {name}"
            for name, c in zip(FEATURES, self.coefficients, strict=True)
            if c
        ]
        return " + ".join(terms) or "0"

    def median_error(self, points: Sequence[StepPoint]) -> float:
        """The median relative error of the model on measured steps."""
        errors = sorted(abs(self.seconds(p.new_tokens, p.start_positions) - p.seconds) / p.seconds for p in points)
        return errors[len(errors) // 2] if errors else 0.0


@dataclass
class TransferModel:
    latency_s: float  # per request's pull, whatever its size
    bytes_per_s: float

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> TransferModel:
        """From (bytes, seconds) pulls."""
        if len(points) < 2:
            raise ValueError("need at least two measured transfers of different sizes")
        features = np.array([[1.0, float(size)] for size, _ in points])
        latency, per_byte = fit_non_negative(features, np.array([seconds for _, seconds in points]))
        return cls(float(latency), 1.0 / per_byte if per_byte > 0 else float("inf"))


@dataclass
class EngineShape:
    """The engine configuration the profile was measured with (the simulator runs the same): its scheduler's
    configuration, field for field (``of`` and ``scheduler_config`` copy every ``SchedulerConfig`` field, and
    a test holds the two classes to the same fields), and its KV bytes per token."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_bytes_per_token: int  # the KV cache's bytes for one token of context (all layers)
    enable_prefix_caching: bool = True
    num_state_slots: int = 0  # hybrid models: linear-attention state slots, a cap on running requests
    rows_per_state_slot: int = 0
    scheduling_policy: str = "fcfs"

    @classmethod
    def of(cls, config: SchedulerConfig, kv_bytes_per_token: int) -> EngineShape:
        """The shape of an engine whose scheduler has this configuration."""
        return cls(**asdict(config), kv_bytes_per_token=kv_bytes_per_token)

    def scheduler_config(self) -> SchedulerConfig:
        """The configuration of a scheduler like the profiled engine's."""
        return SchedulerConfig(**{item.name: getattr(self, item.name) for item in fields(SchedulerConfig)})


@dataclass
class Profile:
    model: str
    hardware: str  # what ran it, e.g. "cpu: AMD EPYC 9B14 (2 cores)" or "gpu: NVIDIA H200"
    engine: EngineShape
    step: StepTimeModel
    transfer: TransferModel
    gpus_per_pod: int = 1  # 0: a CPU pod (cost counts cpus_per_pod instead)
    cpus_per_pod: float = 1.0
    step_points: list[StepPoint] = field(default_factory=list)
    transfer_points: list[tuple[int, float]] = field(default_factory=list)
    tier_bytes_per_s: float = 0.0  # KV tiers' load bandwidth into one engine (0: not given)

    def tier_load_seconds(self, tokens: int) -> float:
        """How long loading `tokens` tokens' KV from the tiers takes."""
        if not tokens:
            return 0.0
        if self.tier_bytes_per_s <= 0:
            raise ValueError("KV-tier hits need the tiers' load bandwidth (pdserve plan --tier-bandwidth)")
        return tokens * self.engine.kv_bytes_per_token / self.tier_bytes_per_s

    def scaled(self, factor: float) -> Profile:
        """The same engine with every step `factor` times as long (a correction from measured serving);
        the raw points are left out of the copy."""
        step = StepTimeModel([c * factor for c in self.step.coefficients])
        return replace(self, step=step, step_points=[], transfer_points=[])

    def pod_cost(self) -> float:
        """What one pod costs: its GPUs, or for a CPU pod its CPUs."""
        return float(self.gpus_per_pod) if self.gpus_per_pod > 0 else self.cpus_per_pod

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        try:
            return cls(
                model=data["model"],
                hardware=data["hardware"],
                engine=EngineShape(**data["engine"]),
                step=StepTimeModel(**data["step"]),
                transfer=TransferModel(**data["transfer"]),
                gpus_per_pod=data.get("gpus_per_pod", 1),
                cpus_per_pod=data.get("cpus_per_pod", 1.0),
                step_points=[StepPoint(**p) for p in data.get("step_points", [])],
                transfer_points=[(int(b), float(s)) for b, s in data.get("transfer_points", [])],
                tier_bytes_per_s=float(data.get("tier_bytes_per_s", 0.0)),
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a pdserve profile: {error}") from None
