"""Preemption by recompute replays a request's generated tokens as decodes.

A resumed request computes the rest of its prompt in prompt chunks, then its generated tokens in
chunks of their own, which the runner expands into one attention sequence per token (a decode
over the context up to it). These tests check that the outputs (tokens, logprobs, prompt
logprobs, n > 1 forks with a seed) equal a run without preemption, that the pool is empty after,
and, for each of them, that the run really replayed several generated tokens in one step (old
behaviour: a resumed request's generated tokens went through the prefill kernel as part of a
prompt chunk, `is_decode` was never true for more than one token).

In bfloat16 the comparison is bit for bit (the CPU kernels are batch invariant); in float32 the
matmuls are not, so float32 compares tokens exactly and logprobs to a tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from conftest import assert_idle, make_llm, token_prompts

from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.engine.kv_manager import KVCacheManager
from quire.engine.llm_engine import LLMEngine
from quire.engine.request import Request
from quire.engine.scheduler import Scheduler
from quire.kernels import cpu as cpu_kernels
from quire.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from quire.worker.input_batch import InputBatch
from quire.worker.step_inputs import StepInputBuilder

LENGTHS = [20, 35, 9, 50, 27, 41]  # around the block size (16): partial and full last blocks
MAX_TOKENS = 40


# ---- recording what the scheduler did ------------------------------------------------------


@dataclass
class Log:
    # (request id, computed tokens when preempted, prompt tokens, output tokens)
    preempted: list[tuple[str, int, int, int]] = field(default_factory=list)
    # per step: [(request id, start, prompt tokens, new tokens, is_decode, samples, computes
    # prompt logprobs not returned before)], in the order the runner lays them out
    steps: list[list[tuple[str, int, int, int, bool, bool, bool]]] = field(default_factory=list)
    # the prompt logprobs computed so far of each request (a request preempted mid-prompt
    # recomputes them; the engine returns each position once)
    prompt_logprobs_high: dict[str, int] = field(default_factory=dict)
    # prefix-cache hits (tokens) of a request that was preempted before: (id, hit, prompt)
    resumed_hits: list[tuple[str, int, int]] = field(default_factory=list)

    def clear(self) -> None:
        self.preempted.clear(), self.steps.clear(), self.resumed_hits.clear()
        self.prompt_logprobs_high.clear()

    def replays(self) -> list[tuple[str, int, int, int]]:
        """Chunks of several generated tokens: (id, start, prompt tokens, new tokens)."""
        return [
            (rid, start, prompt, new)
            for step in self.steps
            for rid, start, prompt, new, decode, _, _ in step
            if decode and new > 1
        ]

    def preempted_after_generating(self) -> set[str]:
        """Requests preempted with two generated tokens or more (a replay of several)."""
        return {rid for rid, _, _, out in self.preempted if out > 1}

    def max_decode_sequences(self) -> int:
        """The most attention sequences the decodes of one step expanded into."""
        return max(sum(new for _, _, _, new, decode, _, _ in step if decode) for step in self.steps)


@pytest.fixture
def log(monkeypatch) -> Log:
    log = Log()
    preempt, schedule = Scheduler._preempt, Scheduler.schedule
    get_computed_blocks = KVCacheManager.get_computed_blocks

    def record_preempt(self, request):
        log.preempted.append(
            (
                request.request_id,
                request.num_computed_tokens,
                request.num_prompt_tokens,
                request.num_output_tokens,
            )
        )
        preempt(self, request)

    def new_prompt_logprobs(request: Request, num_new: int) -> bool:
        # Returned by the request's worker row: asked for, not a fork, not resumed after its
        # prompt was done.
        if (
            request.sampling_params.prompt_logprobs is None
            or request.index > 0
            or request.num_output_tokens > 0
        ):
            return False
        end = min(request.num_computed_tokens + num_new, request.num_prompt_tokens - 1)
        high = log.prompt_logprobs_high.get(request.request_id, 0)
        log.prompt_logprobs_high[request.request_id] = max(high, end)
        return end > max(high, request.num_computed_tokens)

    def record_schedule(self):
        output = schedule(self)
        entries = [(self.requests[i], n) for i, n in output.num_scheduled_tokens.items()]
        log.steps.append(
            [
                (
                    r.request_id,
                    r.num_computed_tokens,
                    r.num_prompt_tokens,
                    n,
                    r.num_computed_tokens >= r.num_prompt_tokens,
                    r.num_computed_tokens + n >= r.num_tokens,
                    new_prompt_logprobs(r, n),
                )
                for r, n in entries
            ]
        )
        return output

    def record_hits(self, request):
        hits = get_computed_blocks(self, request)
        if request.num_preemptions:
            log.resumed_hits.append(
                (request.request_id, len(hits) * self.block_size, request.num_prompt_tokens)
            )
        return hits

    monkeypatch.setattr(Scheduler, "_preempt", record_preempt)
    monkeypatch.setattr(Scheduler, "schedule", record_schedule)
    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", record_hits)
    return log


def assert_replayed(log: Log, min_requests: int = 2) -> None:
    """Several requests were preempted after generating, and a resumed one computed several of
    its generated tokens in one step (the old code never made a decode of more than one)."""
    assert len(log.preempted_after_generating()) >= min_requests, log.preempted
    replays = log.replays()
    assert replays and max(new for *_, new in replays) > 1, replays
    for rid, start, prompt, _ in replays:  # a replay holds generated tokens only
        assert start >= prompt, (rid, start, prompt)
    for step in log.steps:  # decodes (replays included) come before prompt chunks
        decodes = [e[4] for e in step]
        assert decodes == sorted(decodes, reverse=True), step


# ---- outputs -------------------------------------------------------------------------------


def completion(output) -> tuple:
    """Tokens, each position's logprob dict and the prompt logprobs of a one-sequence output."""
    (seq,) = output.outputs
    logprobs = None
    if seq.logprobs is not None:
        logprobs = [{t: lp.logprob for t, lp in d.items()} for d in seq.logprobs]
    prompt_logprobs = None
    if output.prompt_logprobs is not None:
        prompt_logprobs = [
            None if d is None else {t: lp.logprob for t, lp in d.items()}
            for d in output.prompt_logprobs
        ]
    return seq.token_ids, logprobs, prompt_logprobs, seq.cumulative_logprob


def assert_close_logprobs(got, want, atol=1e-4) -> None:
    assert (got is None) == (want is None)
    if got is None:
        return
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is None:
            continue
        assert g.keys() == w.keys()
        for token in g:
            assert abs(g[token] - w[token]) <= atol, (token, g[token], w[token])


GREEDY_F32 = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def f32_reference(tiny_llama) -> list[tuple]:
    """All prompts in one batch in a pool that holds them all: no preemption."""
    llm = make_llm(tiny_llama, dtype="float32", enable_prefix_caching=False)
    outputs = llm.generate(token_prompts(LENGTHS), GREEDY_F32, use_tqdm=False)
    assert llm.stats().num_preemptions == 0
    return [completion(o) for o in outputs]


def assert_matches_unpreempted_f32(llm: LLM, f32_reference, log) -> None:
    """Greedy float32 tokens equal the unpreempted run's, logprobs close, with replays."""
    outputs = [completion(o) for o in llm.generate(token_prompts(LENGTHS), GREEDY_F32, False)]
    assert [o[0] for o in outputs] == [r[0] for r in f32_reference]
    for got, want in zip(outputs, f32_reference):
        assert_close_logprobs(got[1], want[1])
    assert_replayed(log)


@pytest.mark.parametrize(
    "blocks, budget, caching",
    [(10, 32, True), (8, 8, False), (9, 64, False)],
    ids=["cached-budget-32", "uncached-budget-8", "uncached-budget-64"],
)
def test_float32_greedy_under_heavy_preemption_equals_the_unpreempted_run(
    tiny_llama, f32_reference, log, blocks, budget, caching
):
    llm = LLM(
        tiny_llama,
        dtype="float32",
        num_kv_blocks=blocks,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
    )
    assert_matches_unpreempted_f32(llm, f32_reference, log)
    assert_idle(llm)


def test_a_prefix_cache_hit_inside_the_generated_tokens_starts_the_replay_midway(
    tiny_llama, f32_reference, log
):
    """Preempted, a request's prompt and first generated blocks stay cached: it resumes with a
    hit that ends among its generated tokens, and replays only the rest of them."""
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=10, max_num_batched_tokens=32)
    outputs = [completion(o) for o in llm.generate(token_prompts(LENGTHS), GREEDY_F32, False)]
    assert [o[0] for o in outputs] == [r[0] for r in f32_reference]
    midway = [(rid, hit, prompt) for rid, hit, prompt in log.resumed_hits if hit > prompt]
    assert midway, log.resumed_hits
    # Its first step after the hit is a replay from the end of the hit, not from the prompt's end.
    replays = log.replays()
    assert any((rid, hit) == (r[0], r[1]) for rid, hit, _ in midway for r in replays), replays
    assert_idle(llm)


def test_float32_gathered_decode_with_replays_sharing_a_block_table(
    tiny_llama, f32_reference, log, monkeypatch
):
    """Without the C decode kernel, decodes gather each sequence's blocks and mask them: the
    sequences of one replay share a block table and differ only in their lengths."""
    from quire.attention import torch_backend

    monkeypatch.setattr(cpu_kernels, "supports_paged_decode", lambda *args: False)
    gathered, shared = torch_backend.gathered_decode, []

    def record(query, k_cache, v_cache, metadata, scale):
        n = metadata.num_decodes
        rows = [tuple(r) for r in metadata.block_tables[:n].tolist()]
        shared.append(len(set(rows)) < n)
        return gathered(query, k_cache, v_cache, metadata, scale)

    monkeypatch.setattr(torch_backend, "gathered_decode", record)
    llm = LLM(
        tiny_llama,
        dtype="float32",
        num_kv_blocks=8,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    assert_matches_unpreempted_f32(llm, f32_reference, log)
    assert any(shared)  # some step's decodes had sequences over one block table
    assert_idle(llm)


def test_max_num_seqs_bounds_the_requests_and_each_replay(tiny_llama, f32_reference, log):
    """max_num_seqs running requests, each replay at most max_num_seqs tokens: a step's decode
    sequences are at most 2 x max_num_seqs, whatever the token budget."""
    llm = LLM(
        tiny_llama,
        dtype="float32",
        num_kv_blocks=8,
        max_num_batched_tokens=64,
        max_num_seqs=2,
        enable_prefix_caching=False,
    )
    outputs = [completion(o) for o in llm.generate(token_prompts(LENGTHS), GREEDY_F32, False)]
    assert [o[0] for o in outputs] == [r[0] for r in f32_reference]
    assert all(len(step) <= 2 for step in log.steps)
    assert all(new <= 2 for _, _, _, new in log.replays())
    assert 2 < log.max_decode_sequences() <= 4  # a replay beside another decode
    assert_replayed(log, min_requests=1)
    assert_idle(llm)


# ---- bfloat16: bit for bit -----------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_llm(tiny_llama):
    """The unpreempted run: a pool that holds every request (checked by each test)."""
    return make_llm(tiny_llama, dtype="bfloat16", enable_prefix_caching=False)


def test_bfloat16_logprobs_and_prompt_logprobs_under_preemption_are_the_same_bits(
    tiny_llama, bf16_llm, log
):
    """Requests asking for logprobs and prompt logprobs (so no prefix-cache hits), some
    preempted mid-prompt (their prompt logprobs are recomputed and returned once), some after
    generating (their generated tokens replayed)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2
    )
    prompts = token_prompts(LENGTHS)
    want = [completion(o) for o in bf16_llm.generate(prompts, params, use_tqdm=False)]
    assert not log.preempted
    log.clear()  # the reference run does not count

    llm = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=10, max_num_batched_tokens=32)
    got = [completion(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert_replayed(log)
    mid_prompt = [p for p in log.preempted if 0 < p[1] < p[2] and p[3] == 0]
    assert mid_prompt, log.preempted
    # A replay and a chunk computing prompt logprobs shared a step, the replay first: the
    # chunk's rows start after the replay's tokens, not after its one attention sequence.
    assert any(
        any(decode and new > 1 for _, _, _, new, decode, _, _ in step)
        and any(not decode and needs for *_, decode, _, needs in step)
        for step in log.steps
    ), log.steps
    assert_idle(llm)


def test_bfloat16_n2_seeded_sampling_under_preemption_is_the_same_bits(tiny_llama, bf16_llm, log):
    """n = 2 with a seed: the fork made at the end of the prefill, and its parent, preempted after
    generating and resumed (each from its own prompt), sample what they did without
    preemption; the plain greedy requests around them too."""
    sampled = SamplingParams(
        n=2, temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = token_prompts([23, 30, 12, 44])
    params = [sampled, greedy, sampled, greedy]

    def run(llm):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [[(c.index, c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in outputs]

    want = run(bf16_llm)
    assert want[0][0][1] != want[0][1][1]  # the two samples differ
    assert not log.preempted
    log.clear()

    llm = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=9, max_num_batched_tokens=16)
    assert run(llm) == want
    assert_replayed(log)
    forks_preempted = {rid for rid in log.preempted_after_generating() if "#" in rid}
    assert any(rid.endswith("#1") for rid in forks_preempted), log.preempted  # a fork
    assert any(rid.endswith("#0") for rid in forks_preempted), log.preempted  # a parent
    assert_idle(llm)


# ---- abort ---------------------------------------------------------------------------------


def test_abort_mid_replay_frees_its_blocks_and_the_others_keep_their_bits(
    tiny_llama, bf16_llm, log
):
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    prompts = token_prompts(LENGTHS)
    want = {
        str(i): completion(o)
        for i, o in enumerate(bf16_llm.generate(prompts, greedy, use_tqdm=False))
    }
    assert not log.preempted
    log.clear()

    # A budget of 4 tokens a step: a replay of more than 4 tokens spans several steps.
    eng = LLMEngine(
        EngineConfig(
            model=tiny_llama,
            dtype="bfloat16",
            num_kv_blocks=8,
            max_num_batched_tokens=4,
            enable_prefix_caching=False,
        )
    )
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, greedy)
    aborted, aborted_at = None, None
    got = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = completion(out)
        if aborted is None:
            # The step just run replayed generated tokens of a request without reaching its
            # last one: it is mid-replay now. Abort it.
            for rid, _, _, new, decode, samples, _ in log.steps[-1]:
                if decode and new > 1 and not samples:
                    aborted, aborted_at = rid, len(log.steps)
                    eng.abort_request(rid)
                    break
    assert aborted is not None, log.replays()
    assert aborted not in got
    assert got == {rid: c for rid, c in want.items() if rid != aborted}
    # The aborted request was never scheduled again.
    assert all(e[0] != aborted for step in log.steps[aborted_at:] for e in step)
    assert_idle(eng)


# ---- the runner's expansion, and the kernels it relies on ----------------------------------


def _runner_and_step(*entries: tuple[str, int, int, int, int, list[int]]):
    """A runner stand-in (block size 8) whose InputBatch holds these requests, each given as
    (id, prompt length, generated tokens, computed tokens, tokens to compute, block ids), and
    the step that computes them."""
    batch = InputBatch(max_num_reqs=4, max_blocks_per_req=4)
    new_reqs = [
        NewRequestData(
            req_id=rid,
            prompt_token_ids=list(range(100, 100 + prompt_len)),
            output_token_ids=[500 + t for t in range(generated)],
            sampling_params=SamplingParams(),
            index=0,
            block_ids=block_ids,
            num_computed_tokens=computed,
        )
        for rid, prompt_len, generated, computed, _, block_ids in entries
    ]
    num_scheduled = {rid: n for rid, _, _, _, n, _ in entries}
    step = batch.update(SchedulerOutput(new_reqs, [], num_scheduled, sum(num_scheduled.values())))
    return StepInputBuilder(batch, 8, torch.device("cpu")), step


def test_prepare_expands_a_replay_into_one_decode_sequence_per_token():
    """A decode, a replay of 3 tokens from position 14 (crossing a block boundary at 16) and a
    prompt chunk, block size 8: each replayed token is a sequence of its own over the same
    block table; positions, slots and first rows are the entries' (flattened) ones."""
    runner, step = _runner_and_step(
        ("d", 5, 2, 6, 1, [7]), ("r", 10, 7, 14, 3, [3, 9, 4]), ("p", 12, 0, 4, 6, [5, 6])
    )
    assert [s.is_decode for s, _ in step] == [True, True, False]
    inputs = runner.build(step)
    ids, positions, meta, first_rows = (
        inputs.input_ids,
        inputs.positions,
        inputs.metadata,
        inputs.first_rows,
    )

    assert ids.tolist() == [501, 504, 505, 506, *range(104, 110)]
    assert positions.tolist() == [6, 14, 15, 16, 4, 5, 6, 7, 8, 9]
    assert first_rows == [0, 1, 4, 10]
    assert meta.num_seqs == 5 and meta.num_decodes == 4 and meta.num_decode_tokens == 4
    assert meta.query_start_loc_cpu == [0, 1, 2, 3, 4, 10]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4, 10]
    assert meta.seq_lens_cpu == [7, 15, 16, 17, 10]
    assert meta.seq_lens.tolist() == [7, 15, 16, 17, 10]
    assert meta.max_query_len == 6 and meta.max_seq_len == 17
    assert meta.block_tables.tolist() == [
        [7, 0, 0],
        [3, 9, 4],
        [3, 9, 4],
        [3, 9, 4],
        [5, 6, 0],
    ]
    assert meta.slot_mapping.tolist() == [
        7 * 8 + 6,
        9 * 8 + 6,
        9 * 8 + 7,
        4 * 8 + 0,
        *(5 * 8 + p for p in range(4, 8)),
        6 * 8 + 0,
        6 * 8 + 1,
    ]
    tables, starts, lens = meta.prefill_tables()
    assert tables.tolist() == [[5, 6, 0]] and starts.tolist() == [0, 6] and lens.tolist() == [10]


def test_prepare_without_a_replay_keeps_one_sequence_per_entry():
    runner, step = _runner_and_step(("d", 5, 2, 6, 1, [7]), ("p", 12, 0, 4, 6, [5, 6]))
    inputs = runner.build(step)
    positions, meta, first_rows = inputs.positions, inputs.metadata, inputs.first_rows
    assert positions.tolist() == [6, 4, 5, 6, 7, 8, 9]
    assert first_rows == meta.query_start_loc_cpu == [0, 1, 7]
    assert meta.num_decodes == 1 and meta.seq_lens_cpu == [7, 10]


@pytest.mark.skipif(
    not cpu_kernels.supports_paged_decode(torch.bfloat16, 4, 2, 64), reason="no C decode kernel"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_of_sequences_sharing_a_block_table_is_each_alone_bit_for_bit(dtype):
    """The premise of the replay: a decode's bits do not depend on what else is in the batch,
    even sequences over the same blocks with other lengths (a replay), nor on the batch size."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, heads, dim = 40, 16, 2, 4, 64
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:36].int()
    lens = [1, 15, 16, 17, 300, 511, 512, 513, 570]  # one table; one and two partitions
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    tables = table.expand(len(lens), -1).contiguous()
    batch = cpu_kernels.paged_decode(q, k, v, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    for i, n in enumerate(lens):
        alone = cpu_kernels.paged_decode(
            q[i : i + 1], k, v, tables[i : i + 1], torch.tensor([n], dtype=torch.int32), 0.125
        )
        assert torch.equal(batch[i], alone[0]), (i, n)


# ---- admission of a resumed request --------------------------------------------------------


def test_a_resumed_request_is_not_admitted_on_its_prompt_alone_to_preempt_itself_again():
    """Block size 4, 4 blocks. "b" is preempted with 9 known tokens (3 blocks) while "a" holds
    the other blocks. Before the replay change its resume chunk (prompt + generated tokens)
    needed 3 free blocks to be admitted, so it waited for "a" to finish. Now its first chunk is
    the prompt alone (1 block): it is admitted as soon as one block is free, recomputes its
    prompt, and at the next step its replay finds no room and it preempts itself again (twice
    here, recomputing its prompt each time) until "a" finishes. In an engine run (6 prompts,
    9 blocks, budget 64, no prefix caching) that is 12 preemptions instead of 3 and 717 tokens
    computed instead of 528."""
    kv = KVCacheManager(4, 4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=16)
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    a = Request("a", [100, 101, 102], params, 13)
    b = Request("b", [200, 201, 202], params, 13)
    scheduler.add_request(a)
    scheduler.add_request(b)
    preempted, b_tokens = [], 0
    while scheduler.requests:
        output = scheduler.schedule()
        preempted += output.preempted_req_ids
        b_tokens += output.num_scheduled_tokens.get("b", 0)
        sampled = {
            i: [7]
            for i, n in output.num_scheduled_tokens.items()
            if scheduler.requests[i].num_computed_tokens + n >= scheduler.requests[i].num_tokens
        }
        scheduler.update(output, ModelRunnerOutput(sampled))
        kv.check_invariants()
    assert preempted == ["b"]
    # 3 + 5 tokens before the preemption (6 sampled); then its 9 known ones, and 6 more.
    assert b_tokens == 3 + 5 + 9 + 6
    assert kv.num_free_blocks == kv.num_blocks
