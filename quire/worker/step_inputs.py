"""A step's model inputs: the flattened token ids and positions, and the attention metadata
(slot mapping, block tables, query offsets, sequence lengths), built from the InputBatch.

Every scheduled token of the step is one row, decodes first. Attention sees one sequence per
prefill chunk and one per generated token: a decode is one token, and a request computing several
generated tokens (a replay after preemption, or speculative tokens to verify) has each of them
attend as a decode of its own, over the context up to it, so that it gets the bits the decode
kernels give a plain decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from quire.attention.backend import AttentionMetadata
from quire.worker.input_batch import TABLE_WIDTH_STEP, InputBatch, RequestState

Step = list[tuple[RequestState, int]]  # the step's requests and tokens to compute, in order


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    first_rows: list[int]  # each scheduled request's first row, then num_tokens

    @property
    def decode_only(self) -> bool:
        return self.metadata.num_decodes == self.metadata.num_seqs


class _DecodeBuffers:
    """The host arrays of a decode-only step of `num_seqs` requests, and tensors that share their
    memory (`tensors`: token ids, positions, slots, seq_lens, block tables, query_start_loc).
    Kept while the batch keeps its shape, each step's values written into it: on a CPU, making
    the six tensors anew costs ~0.1 ms a step, the caches cold from the weights. The tensors are
    read within the step only (a GPU gets copies)."""

    def __init__(self, num_seqs: int, table_width: int):
        self.ints = np.zeros((3, num_seqs), np.int64)  # token ids, positions, slots
        self.seq_lens = np.zeros(num_seqs, np.int32)
        self.block_tables = np.zeros((num_seqs, table_width), np.int32)
        ints = torch.from_numpy(self.ints)
        self.tensors = (
            ints[0],
            ints[1],
            ints[2],
            torch.from_numpy(self.seq_lens),
            torch.from_numpy(self.block_tables),
            torch.arange(num_seqs + 1, dtype=torch.int32),
        )


class StepInputBuilder:
    def __init__(self, input_batch: InputBatch, block_size: int, device: torch.device):
        self.input_batch = input_batch
        self.block_size = block_size
        self.device = device
        self._decode_buffers: _DecodeBuffers | None = None

    def build(self, step: Step) -> StepInputs:
        if all(n == 1 and s.is_decode for s, n in step):
            return self._build_decodes(step)
        num_entries = len(step)
        starts = np.fromiter((s.num_computed_tokens for s, _ in step), np.int64, num_entries)
        new_tokens = np.fromiter((n for _, n in step), np.int64, num_entries)
        decode = np.fromiter((s.is_decode for s, _ in step), bool, num_entries)
        first_rows = np.zeros(num_entries + 1, np.int64)
        np.cumsum(new_tokens, out=first_rows[1:])
        num_tokens = int(first_rows[-1])

        input_ids: list[int] = []
        for s, n in step:
            input_ids.extend(s.input_token_ids(n))
        # Attention sequences: entry i gives new_tokens[i] of them when it decodes (several
        # when more than one), else one. In the usual step they are the entries.
        entry_of_seq = None
        seq_starts, query_lens, cu_query = starts, new_tokens, first_rows
        if (decode & (new_tokens > 1)).any():
            seqs_per_entry = np.where(decode, new_tokens, 1)
            entry_of_seq = np.repeat(np.arange(num_entries), seqs_per_entry)
            first_seq = np.zeros(num_entries + 1, np.int64)
            np.cumsum(seqs_per_entry, out=first_seq[1:])
            offset = np.arange(len(entry_of_seq)) - first_seq[:-1][entry_of_seq]  # 0: prefills
            seq_starts = starts[entry_of_seq] + offset
            query_lens = np.where(decode[entry_of_seq], 1, new_tokens[entry_of_seq])
            cu_query = np.zeros(len(entry_of_seq) + 1, np.int64)
            np.cumsum(query_lens, out=cu_query[1:])
        seq_lens = seq_starts + query_lens
        num_seqs = len(seq_starts)
        num_decodes = num_seqs - int((~decode).sum())  # the scheduler puts decodes first

        # positions[t] = start of its sequence + offset inside the chunk
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens) - cu_query[:-1][seq_index] + seq_starts[seq_index]

        batch = self.input_batch
        rows = np.fromiter((s.row for s, _ in step), np.int64, num_entries)
        max_blocks = int(batch.num_blocks[rows].max())
        block_tables = batch.block_table[rows, :max_blocks]
        if entry_of_seq is not None:
            block_tables = block_tables[entry_of_seq]
        slot_mapping = (
            block_tables[seq_index, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )

        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(cu_query.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=cu_query.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        return StepInputs(ids, torch.from_numpy(positions).to(dev), metadata, first_rows.tolist())

    def _build_decodes(self, step: Step) -> StepInputs:
        """`build` for the usual step of a running batch, every entry one decode token: the same
        inputs, written into host arrays kept from step to step (`_DecodeBuffers`), the block
        tables taken from the InputBatch's rows."""
        block_size, n = self.block_size, len(step)
        batch = self.input_batch
        rows = [s.row for s, _ in step]
        positions = [s.num_computed_tokens for s, _ in step]
        width = -(-int(batch.num_blocks[rows].max()) // TABLE_WIDTH_STEP) * TABLE_WIDTH_STEP
        buffers = self._decode_buffers
        if buffers is None or buffers.block_tables.shape != (n, width):
            buffers = self._decode_buffers = _DecodeBuffers(n, width)
        tables = buffers.block_tables
        np.take(batch.block_table[:, :width], rows, axis=0, out=tables)
        buffers.ints[0] = [s.token_ids[p] for (s, _), p in zip(step, positions)]
        buffers.ints[1] = positions
        pos = buffers.ints[1]
        buffers.ints[2] = tables[np.arange(n), pos // block_size] * block_size + pos % block_size
        np.add(pos, 1, out=buffers.seq_lens, casting="unsafe")
        ids, positions_t, slots_t, seq_lens_t, tables_t, query_start_loc = (
            t.to(self.device) for t in buffers.tensors
        )
        first_rows = list(range(n + 1))
        seq_lens = [p + 1 for p in positions]
        metadata = AttentionMetadata(
            slot_mapping=slots_t,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_t,
            block_tables=tables_t,
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=first_rows,
            seq_lens_cpu=seq_lens,
            num_decodes=n,
            num_decode_tokens=n,
        )
        return StepInputs(ids, positions_t, metadata, first_rows)


def decode_metadata(
    block_tables: np.ndarray,  # [R, width] int32
    positions: np.ndarray,  # [R] int64
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """The attention metadata of one decode token per row at `positions`, in the rows' blocks
    (a draft model's proposing steps)."""
    n = len(positions)
    slots = block_tables[np.arange(n), positions // block_size] * block_size
    slots = slots.astype(np.int64) + positions % block_size
    seq_lens = (positions + 1).astype(np.int32)
    width = int(-(-seq_lens.max() // block_size))
    query_start_loc = list(range(n + 1))
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        block_tables=torch.from_numpy(np.ascontiguousarray(block_tables[:, :width])).to(device),
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens.tolist(),
        num_decodes=n,
        num_decode_tokens=n,
    )
