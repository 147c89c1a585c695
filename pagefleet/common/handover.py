"""A request's ownership moving between workers with its KV: one script, exactly once.

A migration's handover (``pagefleet.worker.migration_rpc``) is the one moment a running
request changes workers without the scheduler fencing it: the target takes it over in
Redis (``MOVE_OWNER``: a new epoch, its name and steps stream in the owner record, what the
source wrote appended to the request's own record in it) only while the record still names
the source under the source's epoch. From then on the source's final write is refused (its
epoch is stale) and the source, which stopped the request before the handover, writes
nothing more of it; a gateway relaying the request reads the target's steps stream (it reads
every worker's) and places each message by its index, so the client sees every token once.

The source takes the request back with the same script (``to == from``) when the handover's
answer never came: whichever of the two runs first wins, and the other finds the record
changed. Who owns the request afterwards is whatever the owner record names.
"""

from __future__ import annotations

import secrets

from .fencing import REQUEST_TTL_S
from .redis import Keys, retry
from .scripts import MOVE_OWNER


async def move_owner(redis, keys: Keys, request_id: str, epoch: int, from_worker: str, to_worker: str,
                     to_steps: str, record: bytes = b"") -> int:
    """Move ``request_id`` from ``from_worker`` (owning it under ``epoch``) to ``to_worker``
    (writing to steps stream ``to_steps``), recording ``record`` (a ``StepOutputs`` piece of
    what ``from_worker`` wrote; empty: nothing) in its own record (the owner record's ``out``). The new epoch, or 0 when
    the owner record no longer names ``from_worker`` under ``epoch`` (nothing changed)."""
    script = redis.register_script(MOVE_OWNER)  # once a migration: EVALSHA, EVAL after a restart
    # Named, so that a retry after a lost reply finds its own move landed (not refused).
    args = [epoch, from_worker, to_worker, to_steps, REQUEST_TTL_S, record, secrets.token_hex(8)]
    return int(await retry(lambda: script(keys=[keys.owner(request_id)], args=args),
                           what="move_owner"))


async def owner_of(redis, keys: Keys, request_id: str) -> tuple[str, int]:
    """The worker the owner record names and its epoch (``("", 0)`` for none)."""
    worker, epoch = await retry(lambda: redis.hmget(keys.owner(request_id), "worker", "epoch"), what="hmget_own")
    return (worker.decode() if worker else ""), int(epoch or 0)
