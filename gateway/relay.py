"""Relay a request's output stream (``<ns>:out:<id>``) to the client, in index order.

Messages are placed by the index of their first token: a message whose tokens were
already relayed is dropped (a request resumed elsewhere, or a write retried, may repeat
them), and one that starts past the next index waits until the gap is filled (the old
worker's last writes can land after the new worker's first). So the client sees every
token exactly once, in order. A message's logprobs (one per token) are cut with its tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagefleet.common.logprobs import TokenLogprobs
from pagefleet.common.redis import Keys, OutEntry, retry
from pagefleet.protos import generation_pb2 as pb

FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
BLOCK_MS = 5000


class Reorder:
    """Turn messages in any order, with repeats, into one contiguous sequence."""

    def __init__(self) -> None:
        self.next_index = 0
        self._pending: dict[int, OutEntry] = {}

    def add(self, e: OutEntry) -> list[OutEntry]:
        """The messages now ready, in order; the last one may carry the finish reason."""
        end = e.index + len(e.token_ids)
        if e.finish_reason in ("abort", "error") and not e.token_ids and e.index >= self.next_index:
            self._pending.clear()  # the end: nothing more will be generated
            return [OutEntry(self.next_index, [], e.text, e.finish_reason, e.error)]
        if end <= self.next_index and not e.finish_reason:
            return []
        old = self._pending.get(e.index)
        if old is None or (e.finish_reason and not old.finish_reason):
            self._pending[e.index] = e
        ready = []
        while True:
            start = next((i for i in sorted(self._pending) if i <= self.next_index), None)
            if start is None:
                return ready
            m = self._pending.pop(start)
            skip = self.next_index - m.index
            if skip >= len(m.token_ids) and not m.finish_reason:
                continue
            out = OutEntry(self.next_index, m.token_ids[skip:], m.text if skip == 0 else "",
                           m.finish_reason, m.error, None if m.logprobs is None else m.logprobs[skip:])
            self.next_index += len(out.token_ids)
            ready.append(out)
            if out.finish_reason:
                self._pending.clear()
                return ready


async def relay(redis, keys: Keys, request_id: str, num_prompt_tokens: int) -> AsyncIterator[pb.GenerateResponse]:
    """Yield the request's messages until (and including) its last one."""
    key = keys.out(request_id)
    last_id = "0-0"
    order = Reorder()
    while True:
        resp = await retry(lambda s=last_id: redis.xread({key: s}, count=256, block=BLOCK_MS), what="xread")
        for _, entries in resp or ():
            for entry_id, fields in entries:
                last_id = entry_id
                for m in order.add(OutEntry.decode(fields)):
                    msg = pb.GenerateResponse(request_id=request_id, token_ids=m.token_ids, text=m.text,
                                              index=m.index, logprobs=logprobs_to_proto(m.logprobs or ()))
                    if m.finish_reason:
                        msg.finish_reason = FINISH.get(m.finish_reason, pb.FINISH_REASON_ERROR)
                        msg.error = m.error
                        msg.usage.prompt_tokens = num_prompt_tokens
                        msg.usage.completion_tokens = order.next_index
                        yield msg
                        return
                    yield msg


def logprobs_to_proto(entries: list[TokenLogprobs]) -> list[pb.TokenLogprobs]:
    """``TokenLogprobs`` (one per token) as the response's messages."""
    return [
        pb.TokenLogprobs(
            logprob=e.logprob,
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v)
                          for t, v in zip(e.top_token_ids, e.top_logprobs, strict=True)],
        )
        for e in entries
    ]
