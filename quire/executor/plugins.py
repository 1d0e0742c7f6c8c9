"""The worker's plug-ins, built here and handed in (worker/protocols.py): the proposer of
speculative tokens (spec_decode/) and the KV connector (kv_transfer/). The worker imports
neither package; each rank builds its own."""

from __future__ import annotations

import torch

from quire.config import EngineConfig
from quire.kv_transfer.worker_connector import KVConnectorWorker
from quire.spec_decode.draft_model import DraftModelProposer
from quire.spec_decode.ngram import NgramProposer
from quire.worker.protocols import KVConnector, Proposer


def make_proposer(config: EngineConfig, dtype: torch.dtype, max_model_len: int) -> Proposer | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "draft_model":
        return DraftModelProposer(config, dtype, max_model_len)
    return NgramProposer(
        spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens
    )


def make_kv_connector(config: EngineConfig) -> KVConnector | None:
    if config.disaggregation_mode is None:
        return None
    return KVConnectorWorker(
        config.kv_host, config.kv_port, config.tensor_parallel_size, config.kv_transfer_timeout
    )
