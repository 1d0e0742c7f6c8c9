"""The sampler: one engine step's logits -> one token per sequence, plus the logprobs asked for.

Rows of a batch have independent SamplingParams; every step is batched over rows. Per row, in order:
banned tokens -> logit bias -> repetition penalty -> frequency and presence penalties -> greedy rows take the
argmax; random rows divide by their temperature, then apply top-k, top-p and min-p, and draw by
inverting the distribution's running sum with one uniform (`categorical`). A seeded row draws it
from a generator seeded with a key of (seed, completion index, position of the token): the draw
does not depend on what else shares the batch, on how many tokens earlier steps computed, or on
whether the token is sampled in a plain decode, after a preemption, or in a speculative
verification (`noise_seed`).

Returned logprobs follow vLLM v1: they are of the raw model distribution (log_softmax of the
unmodified logits), not of the penalized or filtered one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quire.kernels.cpu import pointwise
from quire.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """The sampling parameters of one step's sampled sequences, one row each.

    Greedy rows have temperature 0 and their filters switched off (top_k 0, top_p 1, min_p 0), so
    the flags below only report work that some random row needs. The per-row tensors are built on
    the device when first read: a step whose rows are all greedy and unpenalized reads none of
    them, and on a CPU each tensor built costs more than the argmax it would feed.
    """

    temperatures: list[float]  # 0 for greedy rows
    top_ps: list[float]  # 1 = off
    top_ks: list[int]  # 0 = off
    min_ps: list[float]  # 0 = off
    presence_penalties: list[float]
    frequency_penalties: list[float]
    repetition_penalties: list[float]
    # Per row: the key of its noise (`noise_seed`), or None to draw from torch's default RNG.
    noise_seeds: list[int | None]
    output_token_ids: list[list[int]]  # generated so far, per row (all penalties)
    prompt_token_ids: list[list[int]]  # per row (repetition penalty, with the output)
    banned_token_ids: list[list[int]]  # per row, never sampled (e.g. EOS below min_tokens)
    logit_biases: list[dict[int, float] | None]  # per row: token id -> bias added to its logit
    max_num_logprobs: int | None  # max over rows of params.logprobs; None if no row wants them
    all_greedy: bool
    all_random: bool
    max_top_k: int  # max over rows of top_k; 0 if no row uses top-k
    any_top_p: bool
    any_min_p: bool
    any_repetition_penalty: bool
    any_presence_frequency_penalty: bool
    any_banned: bool
    any_logit_bias: bool
    device: torch.device | str = "cpu"

    def _tensor(self, values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    @functools.cached_property
    def temperature(self) -> torch.Tensor:  # [S] float32, 0 for greedy rows
        return self._tensor(self.temperatures)

    @functools.cached_property
    def top_p(self) -> torch.Tensor:  # [S] float32, 1 = off
        return self._tensor(self.top_ps)

    @functools.cached_property
    def top_k(self) -> torch.Tensor:  # [S] int64, 0 = off
        return self._tensor(self.top_ks, torch.int64)

    @functools.cached_property
    def min_p(self) -> torch.Tensor:  # [S] float32, 0 = off
        return self._tensor(self.min_ps)

    @functools.cached_property
    def presence_penalty(self) -> torch.Tensor:  # [S] float32
        return self._tensor(self.presence_penalties)

    @functools.cached_property
    def frequency_penalty(self) -> torch.Tensor:  # [S] float32
        return self._tensor(self.frequency_penalties)

    @functools.cached_property
    def repetition_penalty(self) -> torch.Tensor:  # [S] float32
        return self._tensor(self.repetition_penalties)

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        noise_seeds: list[int | None],
        banned_token_ids: list[list[int]],
        device: torch.device | str,
    ) -> SamplingBatch:
        greedy = [p.is_greedy for p in params]
        temperature = [0.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [0 if g else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        repetition = [p.repetition_penalty for p in params]
        logit_biases = [p.logit_bias for p in params]
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        return cls(
            temperatures=temperature,
            top_ps=top_p,
            top_ks=top_k,
            min_ps=min_p,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            noise_seeds=noise_seeds,
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_token_ids,
            banned_token_ids=banned_token_ids,
            logit_biases=logit_biases,
            max_num_logprobs=max(num_logprobs, default=None),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            max_top_k=max(top_k, default=0),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(p > 0.0 for p in min_p),
            any_repetition_penalty=any(p != 1.0 for p in repetition),
            any_presence_frequency_penalty=any(
                p != 0.0 or f != 0.0 for p, f in zip(presence, frequency)
            ),
            any_banned=any(banned_token_ids),
            any_logit_bias=any(b is not None for b in logit_biases),
            device=device,
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [S] int64
    # [S] float32 under log_softmax of the raw logits; None when no row asked for logprobs (the
    # normalizer over a [S, vocab] float32 tensor costs ~20 ms per step at S = 256 on a CPU).
    sampled_logprobs: torch.Tensor | None
    # When some row asked for logprobs (k = max_num_logprobs): column 0 is the sampled token,
    # then the k most likely tokens, best first.
    logprob_token_ids: torch.Tensor | None  # [S, 1 + k] int64
    logprobs: torch.Tensor | None  # [S, 1 + k] float32
    sampled_ranks: torch.Tensor | None  # [S] int64, 1 = most likely


class Sampler(torch.nn.Module):
    def forward(
        self,
        logits: torch.Tensor,  # [S, V] float32, left unmodified
        batch: SamplingBatch,
    ) -> SamplerOutput:
        raw_logprobs = None if batch.max_num_logprobs is None else logits.log_softmax(dim=-1)
        sampled = sample(penalize(logits, batch), batch)  # [S]

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None, None)
        ids, lps, ranks = compute_topk_logprobs(raw_logprobs, sampled, batch.max_num_logprobs)
        return SamplerOutput(sampled, lps[:, 0], ids, lps, ranks)


def banned_token_ids(params: SamplingParams, num_output_tokens: int) -> list[int]:
    """The tokens a row cannot sample after `num_output_tokens` generated ones: below
    min_tokens, EOS and the stop token ids."""
    if num_output_tokens >= params.min_tokens:
        return []
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned |= params.all_stop_token_ids
    return sorted(banned)


def penalize(
    logits: torch.Tensor,  # [S, V]
    batch: SamplingBatch,
) -> torch.Tensor:  # [S, V]: banned tokens at -inf, then the logit biases and the penalties
    if batch.any_banned:
        logits = apply_banned_tokens(logits, batch.banned_token_ids)
    if batch.any_logit_bias:
        logits = apply_logit_bias(logits, batch.logit_biases)
    return apply_penalties(logits, batch)


def apply_logit_bias(
    logits: torch.Tensor,  # [S, V]
    logit_biases: list[dict[int, float] | None],
) -> torch.Tensor:  # [S, V]: each row's biases added to their tokens' logits
    entries = [
        (row, token_id, bias)
        for row, biases in enumerate(logit_biases)
        if biases is not None
        for token_id, bias in biases.items()
    ]
    rows, token_ids, biases = zip(*entries)
    index = (
        torch.tensor(rows, device=logits.device),
        torch.tensor(token_ids, device=logits.device),
    )
    values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    return logits.index_put(index, values, accumulate=True)


def token_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:  # [S, V] float32: how often each token occurs in each row's list
    max_len = max(map(len, token_ids), default=0)
    # Pad with the out-of-vocabulary id V, counted in an extra column that is then dropped.
    padded = torch.tensor(
        [ids + [vocab_size] * (max_len - len(ids)) for ids in token_ids],
        dtype=torch.int64,
        device=device,
    )  # [S, max_len]
    counts = torch.zeros(len(token_ids), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]


def apply_banned_tokens(
    logits: torch.Tensor,  # [S, V]
    banned_token_ids: list[list[int]],
) -> torch.Tensor:  # [S, V], banned tokens at -inf
    banned = token_counts(banned_token_ids, logits.shape[-1], logits.device) > 0
    return logits.masked_fill(banned, float("-inf"))


def apply_penalties(
    logits: torch.Tensor,  # [S, V]
    batch: SamplingBatch,
) -> torch.Tensor:  # [S, V]
    """Repetition penalty, then frequency and presence penalties, as in vLLM.

    Repetition: a token seen in the prompt or the output has its logit divided by the penalty if
    positive, multiplied if not (a quotient past the float range stays the largest float, so a
    tiny penalty favours the token as much as can be, and softmax stays a distribution).
    Frequency subtracts penalty * (times the token was generated); presence subtracts penalty
    once if it was generated at all.
    """
    if not (batch.any_repetition_penalty or batch.any_presence_frequency_penalty):
        return logits
    vocab_size = logits.shape[-1]
    output_counts = token_counts(batch.output_token_ids, vocab_size, logits.device)  # [S, V]
    in_output = output_counts > 0
    if batch.any_repetition_penalty:
        in_prompt = token_counts(batch.prompt_token_ids, vocab_size, logits.device) > 0
        penalty = torch.where(in_prompt | in_output, batch.repetition_penalty[:, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = logits.clamp_max(torch.finfo(logits.dtype).max)
    if batch.any_presence_frequency_penalty:
        logits = (
            logits
            - batch.frequency_penalty[:, None] * output_counts
            - batch.presence_penalty[:, None] * in_output
        )
    return logits


def sample(
    logits: torch.Tensor,  # [S, V], penalized
    batch: SamplingBatch,
) -> torch.Tensor:  # [S] int64
    if batch.all_greedy:
        return greedy(logits)
    random = sample_random(logits, batch)
    if batch.all_random:
        return random
    return torch.where(batch.temperature == 0, greedy(logits), random)


def greedy(logits: torch.Tensor) -> torch.Tensor:  # [S, V] -> [S] int64, torch.argmax's ties
    """The C argmax where it runs (float32 rows on a CPU), torch's elsewhere."""
    return pointwise.argmax(logits) if logits.dim() == 2 else logits.argmax(dim=-1)


def sample_random(
    logits: torch.Tensor,  # [S, V], penalized
    batch: SamplingBatch,
) -> torch.Tensor:  # [S] int64; meaningless for greedy rows
    return categorical(filtered_probs(logits, batch), batch.noise_seeds)


def filtered_probs(
    logits: torch.Tensor,  # [S, V], penalized
    batch: SamplingBatch,
) -> torch.Tensor:  # [S, V], not renormalized after min-p; meaningless for greedy rows
    """The distribution a random row samples from: temperature, top-k, top-p, softmax, min-p."""
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    logits = logits / temperature[:, None]
    if batch.max_top_k > 0:
        logits = apply_top_k(logits, batch.top_k, batch.max_top_k)
    if batch.any_top_p:
        logits = apply_top_p(logits, batch.top_p)
    probs = logits.softmax(dim=-1)
    if batch.any_min_p:
        probs = apply_min_p(probs, batch.min_p)
    return probs


def sampling_probs(
    logits: torch.Tensor,  # [S, V], raw
    batch: SamplingBatch,
) -> torch.Tensor:  # [S, V] float32, rows sum to 1
    """Each row's processed distribution, the one `Sampler` draws from: penalties and filters
    for a random row, a point mass on the argmax for a greedy row."""
    processed = penalize(logits, batch)
    if not batch.all_greedy:
        probs = filtered_probs(processed, batch)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        if batch.all_random:
            return probs
    one_hot = torch.zeros_like(processed).scatter_(-1, greedy(processed)[:, None], 1.0)
    if batch.all_greedy:
        return one_hot
    return torch.where((batch.temperature == 0)[:, None], one_hot, probs)


def apply_top_k(
    logits: torch.Tensor,  # [S, V]
    top_k: torch.Tensor,  # [S] int64, 0 = off
    max_top_k: int,
) -> torch.Tensor:  # [S, V]: logits below each row's k-th largest at -inf (ties kept)
    max_k = min(max_top_k, logits.shape[-1])
    top_values = logits.topk(max_k, dim=-1).values  # [S, max_k], descending
    k = top_k.clamp(max=max_k)
    kth_value = top_values.gather(-1, (k - 1).clamp(min=0)[:, None])  # [S, 1]
    kth_value = kth_value.masked_fill(k[:, None] == 0, float("-inf"))
    return logits.masked_fill(logits < kth_value, float("-inf"))


def apply_top_p(
    logits: torch.Tensor,  # [S, V]
    top_p: torch.Tensor,  # [S] float32, 1 = off
) -> torch.Tensor:  # [S, V]
    """Keeps the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [S, V]
    sorted_probs = sorted_logits.softmax(dim=-1)
    prob_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # 0 for the top token: always kept
    # Rows at top_p 1 keep everything, even where rounding pushes the cumulative sum to 1 early.
    drop_sorted = (prob_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop = torch.empty_like(drop_sorted).scatter_(-1, sorted_ids, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(
    probs: torch.Tensor,  # [S, V]
    min_p: torch.Tensor,  # [S] float32, 0 = off
) -> torch.Tensor:  # [S, V], not renormalized
    """Zeroes the tokens less likely than min_p times the most likely one."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [S, 1]
    return probs.masked_fill(probs < threshold, 0.0)


_MASK64 = (1 << 64) - 1


# Noise streams of one token position: the target's sample (and a speculative bonus token),
# then speculative decoding's draft sample, acceptance test and residual sample.
STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = range(4)


def _splitmix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, index: int, position: int, stream: int = STREAM_SAMPLE) -> int:
    """The key of a seeded request's sampling noise for the token at `position` of completion
    `index`: splitmix64 over (seed + index, position), so nearby keys give unrelated streams.
    Completion i of a request with seed s draws the noise of a lone request with seed s + i
    (vLLM's convention for n > 1). Other `stream`s of the same position are mixed once more."""
    key = _splitmix64(((seed + index) * 0x9E3779B97F4A7C15 + position) & _MASK64)
    if stream == STREAM_SAMPLE:
        return key
    return _splitmix64((key + stream * 0xD1B54A32D192ED03) & _MASK64)


@functools.cache
def _noise_generator(device: torch.device) -> torch.Generator:
    """One generator per device, reseeded for every seeded row."""
    return torch.Generator(device=device)


def categorical(
    probs: torch.Tensor,  # [S, V] >= 0, need not be normalized; a positive entry in each row
    noise_seeds: list[int | None],
) -> torch.Tensor:  # [S] int64
    """Draws token i with probability probs[i] / sum(probs): the first token whose running sum
    (float64, in token order) exceeds u times the row's sum, u one uniform draw per row
    (`uniform_noise`: torch's default RNG, or the row's key). A token of probability 0 is never
    drawn (the running sum does not rise there). One draw and one scan a row: an exponential a
    token (the race argmax(probs / q), q ~ Exp(1), drawn before) cost 0.75 ms a row of a 49k
    vocabulary on CPU, as much as a sixth of a batch-1 decode step."""
    u = uniform_noise(noise_seeds, probs.device).to(torch.float64)
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)  # < the sum: u < 1
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_max_(probs.shape[-1] - 1)


def uniform_noise(
    noise_seeds: list[int | None], device: torch.device | str
) -> torch.Tensor:  # [S] float32 in [0, 1)
    """One uniform draw per row: from torch's default RNG, or from the row's key."""
    u = torch.rand(len(noise_seeds), device=device)
    generator = _noise_generator(torch.device(device))
    for row, key in enumerate(noise_seeds):
        if key is not None:
            generator.manual_seed(key)
            u[row] = torch.rand(1, generator=generator, device=device)[0]
    return u


def apply_token_bitmask(
    logits: torch.Tensor,  # [S, V]
    bitmask: torch.Tensor,  # [R, ceil(V / 32)] int32: bit j of word w allows token 32 w + j
    rows: list[int],  # the R rows of logits the masks apply to
) -> torch.Tensor:  # [S, V], forbidden tokens of those rows at -inf
    """Structured outputs: each masked row keeps only the tokens its grammar allows. In place:
    quire's C kernel on a CPU (one parallel pass; xgrammar's CPU kernel is single-threaded),
    xgrammar's CUDA or Triton kernel on a GPU."""
    if pointwise.apply_token_bitmask(logits, bitmask, rows):
        return logits
    import xgrammar

    if bitmask.shape[0] != logits.shape[0] or rows != list(range(len(rows))):
        # xgrammar masks logits row i with bitmask row i: spread the rows, all allowed between.
        spread = bitmask.new_full((logits.shape[0], bitmask.shape[1]), -1)
        spread[torch.tensor(rows, device=bitmask.device)] = bitmask
        bitmask = spread
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    return logits


def compute_topk_logprobs(
    logprobs: torch.Tensor,  # [N, V], already log_softmax'ed
    token_ids: torch.Tensor,  # [N] int64
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The given tokens' logprobs and ranks, with the k most likely tokens' logprobs.

    Returns ids [N, 1 + k] int64 and lps [N, 1 + k] float32 (column 0 the given token, then the
    top k, best first) and ranks [N] int64 (1 + the number of strictly more likely tokens).
    Serves sampled tokens and prompt logprobs alike.
    """
    token_logprobs = logprobs.gather(-1, token_ids[:, None])  # [N, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # [N, k]
    ids = torch.cat([token_ids[:, None], top_ids], dim=-1)
    lps = torch.cat([token_logprobs, top_logprobs], dim=-1)
    return ids, lps, ranks
