"""The one place a worker's state (``EngineStats``) becomes its ``OccupancyReport``."""

from __future__ import annotations

from pagefleet.protos import cluster_pb2

from .outputs import EngineStats

# pagefleet worker --role, as the report carries it.
ROLES = {"both": cluster_pb2.WORKER_ROLE_BOTH, "prefill": cluster_pb2.WORKER_ROLE_PREFILL,
         "decode": cluster_pb2.WORKER_ROLE_DECODE}


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
    holdings: Holdings | None = None,
    role: str = "both",
) -> cluster_pb2.OccupancyReport:
    """``stats`` and what this stream has not reported yet: the requests finished and the
    prefix cache's keys stored and evicted since its previous report (see ``kv_events``).
    ``holdings``: the stream asked for deltas; the requests held are what changed since."""
    held = holdings.take(stats) if holdings is not None else {
        "request_ids": stats.request_ids, "blocks_per_request": stats.blocks_per_request}
    return cluster_pb2.OccupancyReport(
        worker_id=worker_id,
        role=ROLES[role],
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
        **held,
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


class Holdings:
    """What one report stream last sent of the requests a worker holds, so that each report
    carries only what changed (``OccupancyRequest.deltas``): a report of a worker holding 256
    requests, a few of them new, then costs the few. The first report, and every
    ``full_every``-th, has everything (``holdings_delta`` false): a reader that went wrong
    is put right, and orphans are listed again."""

    __slots__ = ("full_every", "num_reports", "sent")

    def __init__(self, full_every: int = 100) -> None:
        self.full_every = full_every
        self.num_reports = 0
        self.sent: dict[str, int] = {}  # request id -> its device blocks, as last sent

    def take(self, stats: EngineStats) -> dict:
        """The report's fields for ``stats``' holdings (and remember them as sent)."""
        blocks = stats.blocks_per_request
        now = {rid: blocks.get(rid, 0) for rid in stats.request_ids}
        sent, self.sent = self.sent, now
        whole = self.num_reports % self.full_every == 0
        self.num_reports += 1
        if whole:
            return {"request_ids": stats.request_ids, "blocks_per_request": blocks}
        return {
            "holdings_delta": True,
            "request_ids": [rid for rid in now if rid not in sent],
            "blocks_per_request": {rid: n for rid, n in now.items() if sent.get(rid, 0) != n},
            "released_request_ids": [rid for rid in sent if rid not in now],
        }
