"""Sampler: greedy and its equivalents, seeded draws independent of the batch, penalties exactly
as defined, filters that never let excluded tokens through, and logprob entries."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.worker.sampler import Sampler, apply_penalties, logprob_entries

VOCAB = 64


def _request(request_id: str, prompt=(1, 2, 3), output=(), **params) -> Request:
    request = Request(request_id, list(prompt), SamplingParams(**params))
    for token in output:
        request.append_output_token(token)
    return request


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_pick_the_argmax():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = _logits(16)
    greedy, _ = sampler.sample(logits, [_request(f"g{i}", temperature=0.0) for i in range(16)])
    top1, _ = sampler.sample(logits, [_request(f"k{i}", temperature=1.3, top_k=1) for i in range(16)])
    assert greedy == top1 == logits.argmax(dim=-1).tolist()


def test_seeded_draws_do_not_depend_on_the_rest_of_the_batch():
    def run(batch_extra: int) -> list[int]:
        sampler = Sampler(VOCAB, torch.device("cpu"))
        tokens = []
        for step in range(5):
            logits = torch.cat([_logits(1, seed=100 + step), _logits(batch_extra, seed=step)])
            requests = [_request("seeded", temperature=1.0, seed=42)]
            requests += [_request(f"other{i}", temperature=0.9) for i in range(batch_extra)]
            tokens.append(sampler.sample(logits, requests)[0][0])
        return tokens

    alone = run(0)
    assert run(3) == alone and run(7) == alone
    # A different seed gives a different stream (with 5 draws from 64 tokens, surely).
    sampler = Sampler(VOCAB, torch.device("cpu"))
    other = [sampler.sample(_logits(1, seed=100 + s), [_request("x", seed=43)])[0][0] for s in range(5)]
    assert other != alone


def test_a_seeded_draw_depends_on_its_seed_and_output_position_only():
    # Another engine continuing a request at output position 3 (its three tokens given) draws what the engine that
    # ran it from the start draws there, step after step; another position draws otherwise.
    first, second = Sampler(VOCAB, torch.device("cpu")), Sampler(VOCAB, torch.device("cpu"))
    ran = _request("ran", output=(9, 8, 7), temperature=1.0, seed=5)
    continued = _request("continued", output=(9, 8, 7), temperature=1.0, seed=5)
    elsewhere = _request("elsewhere", output=(9, 8), temperature=1.0, seed=5)
    draws = {"ran": [], "continued": [], "elsewhere": []}
    for step in range(20):
        logits = _logits(1, seed=200 + step)
        draws["ran"] += first.sample(logits.clone(), [ran])[0]
        draws["continued"] += second.sample(logits.clone(), [continued])[0]
        draws["elsewhere"] += second.sample(logits.clone(), [elsewhere])[0]
    assert draws["ran"] == draws["continued"]
    assert draws["elsewhere"] != draws["ran"]


def test_penalties_change_logits_exactly_as_defined():
    logits = _logits(1)[0]
    request = _request(
        "p", prompt=[5, 6], output=[6, 7, 7], repetition_penalty=1.5, frequency_penalty=0.25, presence_penalty=0.5
    )
    expected = logits.clone()
    for token in (5, 6, 7):  # repetition: prompt and output tokens
        expected[token] = expected[token] / 1.5 if expected[token] > 0 else expected[token] * 1.5
    expected[6] -= 0.25 * 1 + 0.5  # frequency (count 1) and presence, output tokens only
    expected[7] -= 0.25 * 2 + 0.5
    penalised = logits.clone()
    apply_penalties(penalised, request, VOCAB)
    torch.testing.assert_close(penalised, expected)


def test_filters_never_let_excluded_tokens_through():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, :4] = torch.tensor([4.0, 3.0, 2.5, 0.0])  # probabilities roughly .58 .21 .13 .02 ...
    cases = {
        "top_k": ({"top_k": 2}, {0, 1}),
        "top_p": ({"top_p": 0.7}, {0, 1}),  # .58 < .7, .58+.21 reaches it
        "min_p": ({"min_p": 0.3}, {0, 1}),  # .21 > .3 * .58, .13 is not
    }
    for name, (params, allowed) in cases.items():
        sampler = Sampler(VOCAB, torch.device("cpu"))
        seen = set()
        for i in range(300):
            seen.update(sampler.sample(logits, [_request(f"{name}{i}", **params)])[0])
        assert seen == allowed, name


def test_temperature_sharpens_and_flattens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 2.0
    sampler = Sampler(VOCAB, torch.device("cpu"))
    cold = sum(sampler.sample(logits, [_request(f"c{i}", temperature=0.05)])[0][0] == 0 for i in range(200))
    hot = sum(sampler.sample(logits, [_request(f"h{i}", temperature=5.0)])[0][0] == 0 for i in range(200))
    assert cold == 200 and hot < 50


def test_logprobs_are_of_the_raw_logits_with_ranks_and_top_n():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = _logits(2)
    tokens, logprobs = sampler.sample(
        logits, [_request("a", temperature=0.0, logprobs=3, repetition_penalty=2.0), _request("b", temperature=0.0)]
    )
    assert logprobs[1] is None
    raw = torch.log_softmax(logits[0], dim=-1)
    entry = logprobs[0]
    assert entry.token_id == tokens[0]
    assert abs(entry.logprob - raw[tokens[0]].item()) < 1e-6
    assert entry.rank == int((raw > raw[tokens[0]]).sum()) + 1
    assert entry.top_token_ids == raw.topk(3).indices.tolist()
    (forced,) = logprob_entries(raw[None], [int(raw.argmin())], [0])
    assert forced.rank == VOCAB and forced.top_token_ids == []


def _bitmask(allowed_per_row: list[set[int]]) -> np.ndarray:
    packed = np.zeros((len(allowed_per_row), (VOCAB + 31) // 32), dtype=np.int64)
    for row, allowed in enumerate(allowed_per_row):
        for token in allowed:
            packed[row, token // 32] |= 1 << (token % 32)
    return packed.astype(np.uint32).view(np.int32)  # xgrammar's int32 words, bit 31 included


def test_the_grammar_bitmask_lets_only_allowed_tokens_through():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    allowed = [{3, 31, 32, 63}, {0}, {17, 40}]
    requests = [
        _request("greedy", temperature=0.0),
        _request("free", temperature=1.0, seed=1),  # not constrained: row 1 of the bitmask is not its
        _request("drawn", temperature=2.0, top_k=50, seed=2, logprobs=1),
    ]
    for seed in range(20):
        logits = _logits(3, seed)
        raw = torch.log_softmax(logits, dim=-1)
        tokens, logprobs = sampler.sample(logits.clone(), requests, ([0, 2], _bitmask([allowed[0], allowed[2]])))
        assert tokens[0] == max(allowed[0], key=lambda t: logits[0, t].item())
        assert tokens[2] in allowed[2]
        # Logprobs are the raw model's, before the mask.
        assert abs(logprobs[2].logprob - raw[2, tokens[2]].item()) < 1e-5


def test_a_penalty_or_temperature_beyond_float32_cannot_unmask_a_token():
    # 2.2e-308 is 0 in float32: a masked -inf scaled by it would be NaN, and NaN rows sample token 0.
    sampler = Sampler(VOCAB, torch.device("cpu"))
    request = _request(
        "p", prompt=list(range(VOCAB)), temperature=1.0, seed=3, repetition_penalty=2.2250738585072014e-308
    )
    # 3.9e307 is inf in float32: a masked -inf divided by it would be NaN too.
    hot = _request("t", temperature=3.892187498351313e307, seed=4, repetition_penalty=2.5e307)
    for seed in range(10):
        for constrained in (request, hot):
            tokens, _ = sampler.sample(_logits(1, seed), [constrained], ([0], _bitmask([{5, 9}])))
            assert tokens[0] in (5, 9)
