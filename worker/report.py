"""The one place a worker's state (``EngineStats``) becomes its ``OccupancyReport``."""

from __future__ import annotations

from pagefleet.protos import cluster_pb2

from .outputs import EngineStats


def occupancy_report(
    stats: EngineStats,
    *,
    worker_id: str,
    seq: int,
    finished_request_ids: list[str],
    max_num_seqs: int,
    max_model_len: int,
    draining: bool,
    stored_block_hashes: list[bytes] = (),
    evicted_block_hashes: list[bytes] = (),
    block_hashes_reset: bool = False,
) -> cluster_pb2.OccupancyReport:
    """``stats`` and what this stream has not reported yet: the requests finished and the
    prefix cache's keys stored and evicted since its previous report (see ``kv_events``)."""
    return cluster_pb2.OccupancyReport(
        worker_id=worker_id,
        seq=seq,
        num_blocks=stats.num_blocks,
        num_free_blocks=stats.num_free_blocks,
        block_size=stats.block_size,
        num_swap_blocks=stats.num_swap_blocks,
        num_free_swap_blocks=stats.num_free_swap_blocks,
        num_swapped_blocks=stats.num_swapped_blocks,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_swapped=stats.num_swapped,
        blocks_per_request=stats.blocks_per_request,
        request_ids=stats.request_ids,
        finished_request_ids=finished_request_ids,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        draining=draining,
        num_preemptions=stats.num_preemptions_total,
        stored_block_hashes=stored_block_hashes,
        evicted_block_hashes=evicted_block_hashes,
        block_hashes_reset=block_hashes_reset,
        prefix_cache_queries_total=stats.prefix_cache_queries_total,
        prefix_cache_hits_total=stats.prefix_cache_hits_total,
    )
