"""Perplexity of a model over a fixed English text, from `prompt_logprobs`: the accuracy figure
`quire bench latency` prints next to its speeds, so that a quantized model's speed is never
read without what its quantization costs (on random-weight models it is only a number)."""

from __future__ import annotations

import math

from quire.sampling_params import SamplingParams

PROSE = (
    "The town sits where two rivers meet, and for most of its history it lived from the water. "
    "Boats carried grain and timber down to the coast, and the merchants who owned them built "
    "tall houses along the quay, with storerooms on the ground floor and living rooms above. "
    "When the railway arrived in the middle of the nineteenth century, the river trade declined "
    "within a few decades. The warehouses were turned into workshops, then into flats, and the "
    "quay became a promenade where families walk on Sunday afternoons. Today the town is known "
    "mostly for its market, which is held every Saturday in the square in front of the old "
    "church. Farmers from the surrounding villages sell vegetables, cheese, honey and bread, and "
    "in the autumn the stalls are full of apples and pears. Visitors often come for a day and "
    "stay for a week, because the countryside around the town is quiet and green, and the paths "
    "along the rivers lead to small villages with good inns."
)


def perplexity(engine, token_ids: list[int]) -> float:
    """exp of the mean negative log-probability of each token after the first, given the ones
    before it, as the engine computes it (`engine`: an LLMEngine with no other request)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    engine.add_request("perplexity", token_ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    final = None
    while engine.has_unfinished_requests():
        final = next((out for out in engine.step() if out.finished), final)
    logprobs = [
        position[token].logprob
        for position, token in zip(final.prompt_logprobs[1:], token_ids[1:], strict=True)
    ]
    return math.exp(-sum(logprobs) / len(logprobs))


def prose_perplexity(engine) -> tuple[float, int]:
    """The perplexity over PROSE, and how many tokens that is in the engine's tokenizer."""
    token_ids = engine.tokenizer(PROSE)["input_ids"]
    return perplexity(engine, token_ids), len(token_ids)
