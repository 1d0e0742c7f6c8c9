"""The engine core's structured-output state: one grammar matcher per request, and each step's
bitmask of allowed tokens.

A request with `structured_outputs` gets a `RequestGrammar` when the core takes it (compiled
through the `GrammarCompiler` cache; the front end compiled it already to validate it, so this
is a lookup). Its matcher advances only with accepted tokens (`Scheduler.update` calls
`accept_token` for each token it keeps), so a preempted request, whose generated tokens are
recomputed but not re-sampled, keeps its matcher as it was.

Each step, `bitmask` gives the scheduler one row per sampled position of the scheduled requests
that have a grammar, for `SchedulerOutput.grammar_bitmask` (the worker masks the logits rows
with it). A request verifying k speculative tokens gets k + 1 rows: the row for its next token,
then the matcher is advanced through the proposals, a row after each, and rolled back. Before
that the scheduler cuts a request's proposals at the first one its grammar rejects (or that
would end it: `RequestGrammar.num_valid_tokens`), so every row is filled from a state the
matcher reached.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from quire.messages import SchedulerOutput
from quire.sampling_params import SamplingParams
from quire.structured_output.compiler import GrammarCompiler

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)


class RequestGrammar:
    """One sequence's grammar matcher."""

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar

        self._compiled = compiled
        self.matcher = xgrammar.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        """Advances past an accepted token; False if the grammar forbids it (the matcher then
        stays where it was)."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """Whether the output is complete and its stop token accepted."""
        return self.matcher.is_terminated()

    def fork(self) -> RequestGrammar:
        """A fresh matcher for a sibling sequence (n > 1) that has generated nothing yet."""
        return RequestGrammar(self._compiled)

    def num_valid_tokens(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, from the start, the grammar takes without ending; the
        matcher is left as it was."""
        num_accepted = 0
        for token_id in token_ids:
            if not self.matcher.accept_token(token_id):
                break
            num_accepted += 1
            if self.matcher.is_terminated():
                break
        # A stop token is never a proposal: nothing could be verified after it.
        num_valid = num_accepted - int(self.matcher.is_terminated())
        if num_accepted:
            self.matcher.rollback(num_accepted)
        return num_valid

    def fill_rows(self, bitmask: np.ndarray, first_row: int, spec_token_ids: list[int]) -> int:
        """Writes the allowed tokens of the next 1 + len(spec_token_ids) positions into rows
        `first_row`...; returns how many rows it wrote."""
        self.matcher.fill_next_token_bitmask(bitmask, first_row)
        for j, token_id in enumerate(spec_token_ids, start=1):
            accepted = self.matcher.accept_token(token_id)
            assert accepted, "proposals are trimmed to what the grammar takes"
            self.matcher.fill_next_token_bitmask(bitmask, first_row + j)
        if spec_token_ids:
            self.matcher.rollback(len(spec_token_ids))
        return 1 + len(spec_token_ids)


class StructuredOutputManager:
    """Creates requests' grammars and fills each step's bitmask rows."""

    def __init__(self, compiler: GrammarCompiler, max_rows: int) -> None:
        self.compiler = compiler
        self.num_words = (compiler.vocab_size + 31) // 32
        # One row per sampled position: max_num_seqs decodes, each verifying up to k proposals.
        self._bitmask = np.zeros((max_rows, self.num_words), dtype=np.int32)

    def grammar_for(self, params: SamplingParams) -> RequestGrammar | None:
        if params.structured_outputs is None:
            return None
        return RequestGrammar(self.compiler.compile(params.structured_outputs))

    def bitmask(
        self, output: SchedulerOutput, requests: dict
    ) -> tuple[np.ndarray | None, dict[str, int]]:
        """The step's `grammar_bitmask` and `structured_output_request_ids`: a row per sampled
        position of the scheduled requests with a grammar that sample this step (in the layout
        order, forks last); (None, {}) when none does."""
        first_rows: dict[str, int] = {}
        num_rows = 0
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = requests[req_id]
            if (
                request.grammar is None
                or request.num_computed_tokens + num_new < request.num_tokens
            ):
                continue  # unconstrained, or a prompt chunk that samples nothing
            spec_token_ids = output.scheduled_spec_decode_tokens.get(req_id, [])
            first_rows[req_id] = num_rows
            num_rows += request.grammar.fill_rows(self._bitmask, num_rows, spec_token_ids)
        for fork in output.forked_reqs:
            child = requests[fork.req_id]
            if child.grammar is not None:
                first_rows[fork.req_id] = num_rows
                num_rows += child.grammar.fill_rows(self._bitmask, num_rows, [])
        if not first_rows:
            return None, {}
        return self._bitmask[:num_rows].copy(), first_rows  # the buffer is reused
