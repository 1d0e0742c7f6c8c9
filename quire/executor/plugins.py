"""The worker's plug-ins, built here and handed in (worker/protocols.py): the proposer of
speculative tokens (spec_decode/) and the KV connector (kv_transfer/). The worker imports
neither package; each rank builds its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quire.config import QuireConfig
    from quire.worker.protocols import KVConnector, Proposer


def make_proposer(config: QuireConfig) -> Proposer | None:
    spec = config.speculative
    if spec is None:
        return None
    # Imported when asked for: the KV transport needs pyzmq, the drafter a second model loader.
    if spec.method == "draft_model":
        from quire.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config)
    from quire.spec_decode.ngram import NgramProposer

    return NgramProposer(
        spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens
    )


def make_kv_connector(config: QuireConfig) -> KVConnector | None:
    kv = config.kv_transfer
    if kv is None:
        return None
    from quire.kv_transfer.worker_connector import KVConnectorWorker

    return KVConnectorWorker(
        kv.host, kv.port, config.parallel.tensor_parallel_size, kv.transfer_timeout
    )
