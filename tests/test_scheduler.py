"""Scheduler: token budget, chunked prefill, decode-first batches, preemption, forks and abort.

No model: each test drives `schedule()` and `update()` directly and invents the sampled tokens
(token 0 is EOS). Block size 4 unless a test says otherwise.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from quire.engine.kv_manager import KVCacheManager
from quire.engine.request import Request, RequestStatus
from quire.engine.scheduler import Scheduler
from quire.messages import ModelRunnerOutput, SchedulerOutput
from quire.sampling_params import SamplingParams
from quire.worker.input_batch import InputBatch

EOS = 0
BS = 4


def make_request(
    group_id: str, prompt: list[int], max_tokens: int = 16, n: int = 1, **params
) -> Request:
    """A request as LLMEngine builds it: EOS among the stop ids, `#0` suffix when n > 1."""
    sampling_params = SamplingParams(n=n, max_tokens=max_tokens, **params)
    sampling_params.all_stop_token_ids.add(EOS)
    request_id = group_id if n == 1 else f"{group_id}#0"
    return Request(request_id, list(prompt), sampling_params, max_tokens, group_id=group_id)


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len)


def samples(scheduler: Scheduler, request_id: str, num_new: int) -> bool:
    """Whether the request samples this step (read before `update`): its known tokens are all
    computed once this step's are."""
    request = scheduler.requests[request_id]
    return request.num_computed_tokens + num_new >= request.num_tokens


def sampling_ids(scheduler: Scheduler, output: SchedulerOutput) -> list[str]:
    """The requests the model runner samples for: those whose known tokens are all computed
    after this step, and every fork (from its parent's logits)."""
    ids = [i for i, n in output.num_scheduled_tokens.items() if samples(scheduler, i, n)]
    return ids + [fork.req_id for fork in output.forked_reqs]


def sampled(request_ids, token_id: int = 7) -> ModelRunnerOutput:
    return ModelRunnerOutput({request_id: [token_id] for request_id in request_ids})


def step(scheduler: Scheduler, token_id: int = 7) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update(output, sampled(sampling_ids(scheduler, output), token_id))
    return output


def batch(output: SchedulerOutput) -> list[tuple[str, int]]:
    return list(output.num_scheduled_tokens.items())


def forks(output: SchedulerOutput) -> list[tuple[str, str]]:
    return [(fork.req_id, fork.parent_req_id) for fork in output.forked_reqs]


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    assert all(block.ref_count == 0 for block in kv.blocks)


# ---- budget, chunking and order ------------------------------------------------------------


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request("a", prompt(100, 20))
    scheduler.add_request(request)
    batches = [batch(step(scheduler)) for _ in range(4)]
    assert batches == [[("a", 8)], [("a", 8)], [("a", 4)], [("a", 1)]]
    assert request.num_output_tokens == 2


def test_only_the_last_chunk_of_a_prompt_samples():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", prompt(100, 20)))
    samples_per_step = []
    for _ in range(3):
        output = scheduler.schedule()
        samples_per_step.append(samples(scheduler, "a", output.num_scheduled_tokens["a"]))
        scheduler.update(output, sampled(sampling_ids(scheduler, output)))
    assert samples_per_step == [False, False, True]


def test_waiting_requests_share_what_is_left_of_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for i, name in enumerate("abc"):
        scheduler.add_request(make_request(name, prompt(100 * (i + 1), 6)))
    output = step(scheduler)
    assert batch(output) == [("a", 6), ("b", 4)]
    assert output.total_num_scheduled_tokens == 10
    assert ids(scheduler.waiting) == ["c"]


def test_running_requests_are_served_before_waiting_ones():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", prompt(100, 6)))
    step(scheduler)
    scheduler.add_request(make_request("b", prompt(200, 6)))
    assert batch(step(scheduler)) == [("a", 2), ("b", 2)]


def test_a_running_request_that_takes_the_whole_budget_leaves_waiting_ones_waiting():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", prompt(100, 12)))
    step(scheduler)
    scheduler.add_request(make_request("b", prompt(200, 2)))
    assert batch(step(scheduler)) == [("a", 4)]
    assert ids(scheduler.waiting) == ["b"]


def test_decodes_come_first_in_the_batch():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("p", prompt(100, 3), n=2))
    scheduler.add_request(make_request("x", prompt(200, 10)))
    assert batch(step(scheduler)) == [("p#0", 3), ("x", 5)]
    assert ids(scheduler.running) == ["p#0", "x", "p#1"]
    assert batch(step(scheduler)) == [("p#0", 1), ("p#1", 1), ("x", 5)]


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    scheduler.add_request(make_request("a", prompt(100, 3), max_tokens=2))
    scheduler.add_request(make_request("b", prompt(200, 3), max_tokens=3))
    scheduler.add_request(make_request("c", prompt(300, 3)))
    batches = [batch(step(scheduler)) for _ in range(3)]
    assert batches == [
        [("a", 3), ("b", 3)],
        [("a", 1), ("b", 1)],
        [("b", 1), ("c", 3)],
    ]


def test_a_request_waits_until_all_its_n_sequences_fit_in_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=3)
    scheduler.add_request(make_request("a", prompt(100, 3), max_tokens=2))
    scheduler.add_request(make_request("g", prompt(200, 3), n=3))
    batches = [batch(step(scheduler)) for _ in range(3)]
    assert batches == [[("a", 3)], [("a", 1)], [("g#0", 3)]]
    assert ids(scheduler.running) == ["g#0", "g#1", "g#2"]


# ---- preemption ------------------------------------------------------------------------------


def run_into_preemption(enable_prefix_caching: bool = True) -> tuple[Scheduler, list]:
    """4 blocks of 4 tokens. "a" and "b" (7-token prompts) fill the pool; the third step's decode
    of "a" needs a fifth block. "c" arrives after the first step."""
    scheduler = make_scheduler(
        num_blocks=4, max_model_len=16, enable_prefix_caching=enable_prefix_caching
    )
    a = make_request("a", prompt(100, 7), max_tokens=5)
    b = make_request("b", prompt(200, 7), max_tokens=8)
    c = make_request("c", prompt(300, 3))
    scheduler.add_request(a)
    scheduler.add_request(b)
    outputs = [step(scheduler)]
    scheduler.add_request(c)
    outputs += [step(scheduler), step(scheduler)]
    return scheduler, outputs


def test_the_newest_running_request_is_preempted_when_blocks_run_out():
    scheduler, outputs = run_into_preemption()
    assert [batch(o) for o in outputs] == [[("a", 7), ("b", 7)], [("a", 1), ("b", 1)], [("a", 1)]]
    assert outputs[2].preempted_req_ids == ["b"]
    assert ids(scheduler.running) == ["a"]


def test_a_preempted_request_gives_back_its_blocks_and_progress():
    scheduler, _ = run_into_preemption()
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.output_token_ids == [7, 7]
    assert b.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert scheduler.kv_manager.get_block_ids("b") == []
    assert scheduler.kv_manager.get_block_ids("a") == [0, 1, 3]  # b's last block, reused first


def test_a_preempted_request_goes_back_to_the_front_of_the_waiting_queue():
    scheduler, _ = run_into_preemption()
    assert ids(scheduler.waiting) == ["b", "c"]


def test_a_preempted_request_resumes_from_its_cached_prefix_and_replays_its_outputs():
    scheduler, _ = run_into_preemption()
    b = scheduler.requests["b"]
    step(scheduler)
    step(scheduler)  # "a" reaches max_tokens and frees its blocks
    resumed = step(scheduler)
    # 9 known tokens (7 prompt, 2 generated); its first block (tokens 0-3) stayed cached, the
    # second was reused by "a". The rest of the prompt is one chunk, sampling nothing.
    assert batch(resumed) == [("b", 3), ("c", 3)]
    assert scheduler.kv_manager.get_block_ids("b") == [2, 3]
    assert b.status == RequestStatus.RUNNING
    assert b.num_computed_tokens == 7 and b.output_token_ids == [7, 7]
    # Then its generated tokens, in a chunk of their own (the runner runs each as a decode),
    # the last known one sampling.
    replay = scheduler.schedule()
    assert batch(replay) == [("b", 2), ("c", 1)]
    assert [samples(scheduler, i, n) for i, n in batch(replay)] == [True, True]
    assert b.num_computed_tokens >= b.num_prompt_tokens  # generated tokens: decodes
    scheduler.update(replay, sampled(["b", "c"]))
    assert b.num_computed_tokens == 9 and b.output_token_ids == [7, 7, 7]


def test_a_preempted_request_without_prefix_caching_recomputes_everything():
    scheduler, _ = run_into_preemption(enable_prefix_caching=False)
    step(scheduler)
    step(scheduler)
    assert batch(step(scheduler))[0] == ("b", 7)  # the whole prompt, then the replay
    assert batch(step(scheduler))[0] == ("b", 2)


def test_the_request_that_cannot_grow_is_itself_preempted_when_it_is_the_newest():
    scheduler, _ = run_into_preemption()
    for _ in range(5):
        output = step(scheduler)
    # "b" holds 3 blocks, "c" 1; "c" needs a second block and is the newest.
    assert batch(output) == [("b", 1)]
    assert output.preempted_req_ids == ["c"]
    assert ids(scheduler.waiting) == ["c"]


def test_no_waiting_request_is_admitted_in_a_step_that_preempts():
    scheduler = make_scheduler(
        num_blocks=4, max_num_batched_tokens=2, max_model_len=16, enable_prefix_caching=False
    )
    scheduler.add_request(make_request("a", prompt(100, 2), max_tokens=12))
    scheduler.add_request(make_request("b", prompt(200, 6), max_tokens=8))
    for _ in range(7):
        step(scheduler)
    output = step(scheduler)
    # "b" gave back 2 blocks and "a" took 1: "b"'s next 1-token chunk would fit, but waits.
    assert batch(output) == [("a", 1)]
    assert output.preempted_req_ids == ["b"]
    assert ids(scheduler.waiting) == ["b"]
    # And it keeps waiting while its 7 known tokens (2 blocks, one of them generated) do not fit:
    # admitted on its prompt alone, its replay would preempt it again as "a" grows. It resumes
    # when "a" ends, its prompt first.
    for _ in range(4):
        assert batch(step(scheduler)) == [("a", 1)]
    assert "a" not in scheduler.requests
    assert batch(step(scheduler)) == [("b", 2)]


# ---- forks -----------------------------------------------------------------------------------


def test_n_sequences_fork_at_the_end_of_the_prefill_and_share_its_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("g", prompt(100, 6), n=3))
    output = step(scheduler)
    assert forks(output) == [
        ("g#1", "g#0"),
        ("g#2", "g#0"),
    ]
    kv = scheduler.kv_manager
    assert kv.get_block_ids("g#0") == kv.get_block_ids("g#1") == kv.get_block_ids("g#2") == [0, 1]
    assert [b.ref_count for b in kv.blocks[:3]] == [3, 3, 0]
    assert [r.num_computed_tokens for r in scheduler.running] == [6, 6, 6]


def test_no_fork_happens_before_the_prompt_is_computed():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("g", prompt(100, 6), n=3))
    assert forks(step(scheduler)) == []
    assert ids(scheduler.running) == ["g#0"]


def test_forks_copy_the_shared_partial_block_on_their_first_decode():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("g", prompt(100, 6), n=3))
    step(scheduler)
    output = step(scheduler)
    assert output.block_copies == [(1, 2), (1, 3)]
    kv = scheduler.kv_manager
    assert [kv.get_block_ids(f"g#{i}") for i in range(3)] == [[0, 2], [0, 3], [0, 1]]


def test_forks_of_a_block_aligned_prompt_copy_nothing():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("g", prompt(100, 8), n=2))
    step(scheduler)
    assert step(scheduler).block_copies == []
    kv = scheduler.kv_manager
    assert [kv.get_block_ids(f"g#{i}") for i in range(2)] == [[0, 1, 2], [0, 1, 3]]


# ---- stop rules ------------------------------------------------------------------------------


def test_eos_stops_a_request_and_frees_its_blocks():
    scheduler = make_scheduler()
    request = make_request("a", prompt(100, 6))
    scheduler.add_request(request)
    step(scheduler, token_id=EOS)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [EOS]
    assert scheduler.num_unfinished == 0
    assert_all_blocks_free(scheduler)


def test_eos_before_min_tokens_does_not_stop():
    scheduler = make_scheduler()
    request = make_request("a", prompt(100, 6), min_tokens=2)
    scheduler.add_request(request)
    step(scheduler, token_id=EOS)
    assert request.status == RequestStatus.RUNNING
    step(scheduler, token_id=EOS)
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_keeps_generating_until_max_tokens():
    scheduler = make_scheduler()
    request = make_request("a", prompt(100, 6), max_tokens=3, ignore_eos=True)
    scheduler.add_request(request)
    for _ in range(3):
        step(scheduler, token_id=EOS)
    assert request.output_token_ids == [EOS, EOS, EOS]
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_a_stop_token_id_stops_and_is_the_stop_reason():
    scheduler = make_scheduler()
    request = make_request("a", prompt(100, 6), stop_token_ids=[9])
    scheduler.add_request(request)
    step(scheduler, token_id=9)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 9


def test_max_model_len_ends_a_request_with_length():
    scheduler = make_scheduler(max_model_len=8)
    request = make_request("a", prompt(100, 6))
    scheduler.add_request(request)
    step(scheduler)
    step(scheduler)
    assert request.num_tokens == 8
    assert request.status == RequestStatus.FINISHED_LENGTH


# ---- abort -----------------------------------------------------------------------------------


def test_abort_of_a_waiting_request_removes_it():
    scheduler = make_scheduler()
    request = make_request("a", prompt(100, 6))
    scheduler.add_request(request)
    assert scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == [request]
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert not scheduler.waiting and scheduler.num_unfinished == 0
    assert scheduler.schedule().is_empty


def test_abort_of_a_running_request_frees_its_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt(100, 6)))
    step(scheduler)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.running and scheduler.num_unfinished == 0
    assert_all_blocks_free(scheduler)


def test_abort_of_a_preempted_request_removes_it_from_the_waiting_queue():
    scheduler, _ = run_into_preemption()
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert ids(scheduler.waiting) == ["c"]
    scheduler.finish_requests(["a", "c"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_unfinished == 0
    assert_all_blocks_free(scheduler)


def test_abort_of_all_forks_frees_their_shared_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("g", prompt(100, 6), n=3))
    step(scheduler)
    step(scheduler)
    scheduler.finish_requests(["g#0", "g#1", "g#2"], RequestStatus.FINISHED_ABORTED)
    assert_all_blocks_free(scheduler)


def test_abort_of_an_unknown_id_does_nothing():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt(100, 6)))
    assert scheduler.finish_requests(["nope"], RequestStatus.FINISHED_ABORTED) == []
    assert ids(scheduler.waiting) == ["a"]


# ---- property test: random traffic on tiny pools ---------------------------------------------


class SchedulerMachine(RuleBasedStateMachine):
    """Requests arrive, steps run, requests are aborted, on pools small enough to force
    preemption, with 0 to 3 lookahead slots. Every step is checked against the scheduling
    rules; every state against the bookkeeping invariants; and stepping without arrivals must
    finish every request."""

    @initialize(
        num_blocks=st.integers(2, 8),
        block_size=st.sampled_from([2, 4]),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(1, 12),
        caching=st.booleans(),
        lookahead=st.integers(0, 3),
        data=st.data(),
    )
    def make_scheduler(
        self, num_blocks, block_size, max_num_seqs, budget, caching, lookahead, data
    ) -> None:
        # As LLMEngine guarantees: max_model_len fits in the pool.
        max_model_len = data.draw(st.integers(2, num_blocks * block_size), label="max_model_len")
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.scheduler = Scheduler(
            self.kv, max_num_seqs, budget, max_model_len, num_lookahead_tokens=lookahead
        )
        self.worker_view = InputBatch(max_num_seqs, 1)  # grows as needed
        self.ended: list[Request] = []
        self.ids = itertools.count()

    def _step(self, draw_token) -> None:
        scheduler, kv = self.scheduler, self.kv
        running_before = list(scheduler.running)
        waiting_before = list(scheduler.waiting)
        output = scheduler.schedule()
        entries = [(scheduler.requests[i], n) for i, n in output.num_scheduled_tokens.items()]
        spec = output.scheduled_spec_decode_tokens

        assert output.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        assert all(n >= 1 for _, n in entries)
        decodes = [r.num_computed_tokens >= r.num_prompt_tokens for r, _ in entries]
        assert decodes == sorted(decodes, reverse=True), "decodes first"
        for request, n in entries:  # a chunk is all prompt tokens or all generated ones
            generated = request.num_computed_tokens >= request.num_prompt_tokens
            proposals = spec.get(request.request_id, [])
            if not generated:
                assert request.num_computed_tokens + n <= request.num_prompt_tokens
                assert not proposals
            if proposals:  # the last known token, then the proposals after it
                assert request.num_computed_tokens == request.num_tokens - 1
                assert n == 1 + len(proposals)
                assert request.num_tokens + len(proposals) <= scheduler.max_model_len
            elif generated and n > 1:  # only a resumed request replays
                assert request.num_preemptions > 0
        for request, n in entries:
            covered = len(kv.get_block_ids(request.request_id)) * kv.block_size
            assert covered >= request.num_computed_tokens + n
        # Victims are the newest running requests, newest first.
        victims = running_before[::-1][: len(output.preempted_req_ids)]
        assert output.preempted_req_ids == [r.request_id for r in victims]
        admitted = [r for r, _ in entries if any(r is w for w in waiting_before)]
        if admitted:
            assert not output.preempted_req_ids
            scheduled = {id(r) for r, _ in entries}
            assert all(id(r) in scheduled for r in running_before)
        assert len(scheduler.running) <= scheduler.max_num_seqs
        for child, parent in forks(output):
            assert kv.get_block_ids(child) == kv.get_block_ids(parent)

        # The worker's copy, built from the messages alone, matches the scheduler's state.
        self.worker_view.update(output)
        for request_id in [*output.num_scheduled_tokens, *(c for c, _ in forks(output))]:
            request = scheduler.requests[request_id]
            state = self.worker_view.requests[request_id]
            assert state.token_ids == request.token_ids
            assert state.prompt_token_ids == request.prompt_token_ids
            assert state.num_computed_tokens == request.num_computed_tokens
            assert self.worker_view.block_ids(state) == kv.get_block_ids(request_id)
            assert state.spec_token_ids == spec.get(request_id, [])

        # The runner's answer: one token, or for a verification the accepted proposals and
        # one token more (an invented accept count).
        sampled = {}
        for request_id in sampling_ids(scheduler, output):
            proposals = spec.get(request_id, [])
            num_accepted = draw_token() % (len(proposals) + 1)
            sampled[request_id] = [*proposals[:num_accepted], draw_token()]
        updated = scheduler.update(output, ModelRunnerOutput(sampled))
        assert sorted(r.request_id for r, _ in updated) == sorted(sampled)
        for request, kept in updated:
            tokens = sampled[request.request_id]
            assert kept == tokens[: len(kept)] and kept
            assert len(kept) == len(tokens) or request.is_finished  # cut only at a stop
            assert request.token_ids[-len(kept) :] == kept
        self.ended += [r for r, _ in updated if r.is_finished]

    @rule(data=st.data())
    def propose(self, data) -> None:
        """A proposer offers up to 3 speculative tokens to each running decode."""
        for request in self.scheduler.running:
            if request.num_prompt_tokens <= request.num_computed_tokens == request.num_tokens - 1:
                request.spec_token_ids = data.draw(
                    st.lists(st.integers(1, 3), max_size=3), label="proposals"
                )

    @rule(data=st.data())
    def add(self, data) -> None:
        max_model_len = self.scheduler.max_model_len
        tokens = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=max_model_len - 1))
        n = data.draw(st.integers(1, min(3, self.scheduler.max_num_seqs)), label="n")
        max_tokens = data.draw(st.integers(1, 16), label="max_tokens")
        ignore_eos = data.draw(st.booleans(), label="ignore_eos")
        # As LLMEngine resolves it: never past max_model_len.
        max_tokens = min(max_tokens, max_model_len - len(tokens))
        request = make_request(f"r{next(self.ids)}", tokens, max_tokens, n=n, ignore_eos=ignore_eos)
        self.scheduler.add_request(request)

    @rule(num_steps=st.integers(1, 4), tokens=st.lists(st.integers(EOS, 3), min_size=1))
    def step(self, num_steps: int, tokens: list[int]) -> None:
        stream = itertools.cycle(tokens)
        for _ in range(num_steps):
            self._step(lambda: next(stream))

    @rule(data=st.data())
    def abort(self, data) -> None:
        if not self.scheduler.requests:
            return
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)), label="abort")
        (request,) = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        assert request.status == RequestStatus.FINISHED_ABORTED
        self.ended.append(request)

    @rule(with_eos=st.booleans())
    def run_until_idle(self, with_eos: bool) -> None:
        """With no new arrivals every request finishes: each step brings the first running
        request (never a victim) at least one token closer to its end."""
        tokens = itertools.cycle([1, 2, 3, EOS] if with_eos else [1, 2, 3])
        bound = 3 * len(self.scheduler.requests) * self.scheduler.max_model_len + 1
        for _ in range(bound):
            if not self.scheduler.num_unfinished:
                break
            self._step(lambda: next(tokens))
        assert self.scheduler.num_unfinished == 0
        assert not self.scheduler.running and not self.scheduler.waiting
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert all(block.ref_count == 0 for block in self.kv.blocks)

    @invariant()
    def books_balance(self) -> None:
        self.kv.check_invariants()

    @invariant()
    def every_unfinished_request_is_either_waiting_or_running(self) -> None:
        running = [id(r) for r in self.scheduler.running]
        waiting = [id(r) for r in self.scheduler.waiting]
        assert len(set(running)) == len(running) and len(set(waiting)) == len(waiting)
        assert not set(running) & set(waiting)
        assert set(running) | set(waiting) == {id(r) for r in self.scheduler.requests.values()}
        assert all(r.status == RequestStatus.RUNNING for r in self.scheduler.running)
        assert all(
            r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            for r in self.scheduler.waiting
        )

    @invariant()
    def running_requests_hold_their_computed_tokens_blocks_and_lookahead_within_the_context(
        self,
    ) -> None:
        scheduler = self.scheduler
        for request in scheduler.running:
            num_blocks = len(self.kv.get_block_ids(request.request_id))
            computed = request.num_computed_tokens
            reach = min(computed + scheduler.num_lookahead_tokens, scheduler.max_model_len)
            assert self.kv.blocks_needed(computed) <= num_blocks <= self.kv.blocks_needed(reach)
            assert computed < request.num_tokens <= scheduler.max_model_len

    @invariant()
    def waiting_and_ended_requests_hold_no_blocks(self) -> None:
        for request in [*self.scheduler.waiting, *self.ended]:
            assert self.kv.get_block_ids(request.request_id) == []
            assert request.num_computed_tokens == 0 or request.is_finished
        assert all(request.is_finished for request in self.ended)

    def teardown(self) -> None:
        self.run_until_idle(with_eos=False)


SchedulerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_random_traffic = SchedulerMachine.TestCase


# ---- several tokens per step: speculative verification ---------------------------------------


def decoding(scheduler: Scheduler, request: Request) -> None:
    """Steps until the request decodes (its prompt computed, one token sampled)."""
    while request.num_computed_tokens < request.num_prompt_tokens:
        step(scheduler)


def test_a_decode_with_proposals_computes_its_last_token_and_each_proposal():
    scheduler = make_scheduler()
    a = make_request("a", prompt(100, 5))
    scheduler.add_request(a)
    decoding(scheduler, a)
    a.spec_token_ids = [11, 12, 13]
    output = scheduler.schedule()
    assert batch(output) == [("a", 4)]
    assert output.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}


def test_accepted_proposals_are_appended_and_rejected_slots_given_back():
    scheduler = make_scheduler()
    a = make_request("a", prompt(100, 7))
    scheduler.add_request(a)
    decoding(scheduler, a)  # 8 known tokens, 7 computed: two blocks
    a.spec_token_ids = [11, 12, 13]
    output = scheduler.schedule()
    assert len(scheduler.kv_manager.get_block_ids("a")) == 3  # slots 7..10
    (updated,) = scheduler.update(output, ModelRunnerOutput({"a": [11, 5]}))
    assert updated == (a, [11, 5])
    assert a.output_token_ids == [7, 11, 5]
    assert a.num_computed_tokens == 9  # the last known token and the accepted proposal
    assert len(scheduler.kv_manager.get_block_ids("a")) == 3  # covers 9 computed tokens
    assert a.spec_token_ids == []


def test_every_proposal_rejected_keeps_only_the_known_tokens_blocks():
    scheduler = make_scheduler()
    a = make_request("a", prompt(100, 7))
    scheduler.add_request(a)
    decoding(scheduler, a)
    a.spec_token_ids = [11, 12, 13, 14, 15]
    output = scheduler.schedule()
    assert len(scheduler.kv_manager.get_block_ids("a")) == 4  # slots 7..12
    scheduler.update(output, ModelRunnerOutput({"a": [9]}))
    assert a.num_computed_tokens == 8 and a.output_token_ids == [7, 9]
    assert len(scheduler.kv_manager.get_block_ids("a")) == 2
    scheduler.kv_manager.check_invariants()
    assert scheduler.kv_manager.num_free_blocks == scheduler.kv_manager.num_blocks - 2


def test_a_stop_token_inside_an_accepted_run_drops_the_tokens_after_it():
    scheduler = make_scheduler()
    a = make_request("a", prompt(100, 5))
    scheduler.add_request(a)
    decoding(scheduler, a)
    a.spec_token_ids = [11, EOS, 13]
    output = scheduler.schedule()
    (updated,) = scheduler.update(output, ModelRunnerOutput({"a": [11, EOS, 13, 14]}))
    assert updated == (a, [11, EOS])
    assert a.output_token_ids == [7, 11, EOS]
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert_all_blocks_free(scheduler)


def test_max_tokens_inside_an_accepted_run_ends_the_request_there():
    scheduler = make_scheduler()
    a = make_request("a", prompt(100, 5), max_tokens=3)
    scheduler.add_request(a)
    decoding(scheduler, a)
    a.spec_token_ids = [11, 12, 13]
    output = scheduler.schedule()
    # Room for two more tokens: one proposal is verified, the next token is the last.
    assert output.scheduled_spec_decode_tokens == {"a": [11]}
    (updated,) = scheduler.update(output, ModelRunnerOutput({"a": [11, 12]}))
    assert updated == (a, [11, 12])
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(scheduler)


def test_min_tokens_holds_back_a_stop_token_inside_an_accepted_run():
    scheduler = make_scheduler()
    a = make_request("a", prompt(100, 5), min_tokens=3)
    scheduler.add_request(a)
    decoding(scheduler, a)  # one output token
    a.spec_token_ids = [EOS, 12]
    output = scheduler.schedule()
    scheduler.update(output, ModelRunnerOutput({"a": [EOS, 12, EOS]}))
    # EOS as the second output token is below min_tokens; as the fourth, it stops.
    assert a.output_token_ids == [7, EOS, 12, EOS]
    assert a.status == RequestStatus.FINISHED_STOPPED


def test_lookahead_slots_are_reserved_past_a_decode_and_never_hashed():
    kv = KVCacheManager(64, BS, enable_prefix_caching=True)
    scheduler = Scheduler(kv, 8, 64, 64, num_lookahead_tokens=4)
    a = make_request("a", prompt(100, 7))
    scheduler.add_request(a)
    decoding(scheduler, a)  # 8 known tokens: blocks for 8, the prompt's first block hashed
    scheduler.schedule()  # the decode of token 7, plus 4 slots
    assert len(kv.get_block_ids("a")) == 3  # slots 0..11
    hashed = [b.block_hash is not None for b in (kv.blocks[i] for i in kv.get_block_ids("a"))]
    assert hashed == [True, True, False]


def test_a_verified_step_keeps_the_lookahead_slots_past_its_new_last_token():
    """A draft model wrote its next proposals' K/V into them: they stay the request's blocks, so
    the draft can reuse that K/V when the proposals are accepted."""
    kv = KVCacheManager(64, BS, enable_prefix_caching=True)
    scheduler = Scheduler(kv, 8, 64, 64, num_lookahead_tokens=3)
    a = make_request("a", prompt(100, 7))
    scheduler.add_request(a)
    decoding(scheduler, a)  # 8 known tokens, 7 computed
    a.spec_token_ids = [11, 12, 13]
    output = scheduler.schedule()  # slots 7..10 verified, 11..13 lookahead: 4 blocks
    assert len(kv.get_block_ids("a")) == 4
    scheduler.update(output, ModelRunnerOutput({"a": [9]}))  # every proposal rejected
    assert a.num_computed_tokens == 8  # the new last token at 8, lookahead 8..10: 3 blocks
    assert len(kv.get_block_ids("a")) == 3
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks - 3


def test_a_request_that_forks_reserves_no_lookahead():
    """Forks share the blocks up to the partial one, which copy-on-write replaces next step."""
    kv = KVCacheManager(64, BS, enable_prefix_caching=True)
    scheduler = Scheduler(kv, 8, 64, 64, num_lookahead_tokens=3)
    scheduler.add_request(make_request("g", prompt(100, 6), n=2))
    step(scheduler)  # 6 prompt tokens: blocks 0 and 1, block 1 partial
    assert kv.get_block_ids("g#0") == kv.get_block_ids("g#1") == [0, 1]
    output = step(scheduler)  # each writes its token into its own copy of block 1
    parent, child = kv.get_block_ids("g#0"), kv.get_block_ids("g#1")
    assert parent[0] == child[0] == 0 and len({parent[1], child[1], 1}) == 2
    assert [src for src, _ in output.block_copies] == [1]


# ---- lookahead at the end of the context -----------------------------------------------------


def decode_to_the_end(scheduler: Scheduler, request: Request, proposer: str) -> list[int]:
    """Steps the request until it finishes (at most max_model_len steps), a proposer offering
    [11, 12, 13] to each decode: 'accepted' (the model agrees, then adds 7), 'rejected' (7
    instead) or 'none' (no proposals). Returns the blocks it holds in each step."""
    held = []
    for _ in range(scheduler.max_model_len):
        if request.is_finished:
            break
        decodes = request.num_computed_tokens >= request.num_prompt_tokens
        if decodes and proposer != "none":
            request.spec_token_ids = [11, 12, 13]
        output = scheduler.schedule()
        held.append(len(scheduler.kv_manager.get_block_ids(request.request_id)))
        proposals = output.scheduled_spec_decode_tokens.get(request.request_id, [])
        tokens = [*proposals, 7] if proposer == "accepted" else [7]
        scheduler.update(output, ModelRunnerOutput({request.request_id: tokens}))
    return held


@pytest.mark.parametrize(
    ("proposer", "blocks_held"),
    [
        ("accepted", [3, 4, 4]),
        ("rejected", [3, 4, 4, 4, 4, 4, 4]),
        ("none", [3, 4, 4, 4, 4, 4, 4]),
    ],
)
@pytest.mark.parametrize("num_blocks", [4, 64])
def test_lookahead_stops_at_max_model_len(proposer, blocks_held, num_blocks):
    """With 3 lookahead slots, a request decodes to max_model_len (16 tokens: 4 blocks) and
    ends with `length`, never holding a fifth block: not in a pool of 64, and not preempted in
    a pool of exactly 4 (what the engine clamps max_model_len to when the pool is small)."""
    max_model_len = 4 * BS
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    scheduler = Scheduler(kv, 8, 64, max_model_len, num_lookahead_tokens=3)
    a = make_request("a", prompt(100, 9), max_tokens=max_model_len - 9, ignore_eos=True)
    scheduler.add_request(a)
    assert decode_to_the_end(scheduler, a, proposer) == blocks_held
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.num_tokens == max_model_len
    assert scheduler.num_preemptions == 0
    assert_all_blocks_free(scheduler)
