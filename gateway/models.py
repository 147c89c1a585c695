"""The models one gateway serves, and the shards each one's requests go to.

A gateway serves every shard: ``--model`` names each model (``[NAME=]PATH``, repeatable: its
tokenizer, chat template and context come from PATH), ``--shards NAME=S1,S2`` the shards its
workers and scheduler serve (default: model i -> shard ``s<i>``; one model -> ``s0``). A
request's ``model`` picks the model (``Router.core_for``); within a model a request goes to
the shard its id hashes to (``GatewayCore.shard_of``), so requests spread over the model's
shards and any gateway finds the shard of an id it was told without asking Redis.

``Cancel`` carries only a request id. The shard is found from the id: each model's shard for
that id (one per model) is a candidate; with one candidate the cancel entry goes there; with
several (several models), the one whose ``req:<id>`` claim exists (every queued request has
one) gets it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pagefleet.common.redis import check_shard, retry

from .core import GatewayCore

CANCEL_LOOKUP_ATTEMPTS = 5  # a Redis that does not answer: the Cancel is UNAVAILABLE, not held


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model of the gateway: its name in requests, its checkpoint (or ``tiny``), its shards."""

    name: str
    path: str
    shards: tuple[str, ...]


MAX_ECHOED_NAME = 256  # characters of an unknown model's name an error repeats


class UnknownModel(LookupError):
    """A request named a model this gateway does not serve (HTTP 404, gRPC NOT_FOUND)."""

    def __init__(self, requested: str | None, served: Sequence[str]) -> None:
        self.requested = requested
        self.served = list(served)
        listed = ", ".join(f"`{n}`" for n in self.served)
        if requested is None:
            text = f"a model is required: this server serves {listed}"
        else:
            # Named as sent, cut short: a name of megabytes echoed whole overflowed the client's
            # bound on a status's metadata (RESOURCE_EXHAUSTED instead of NOT_FOUND).
            name = requested if len(requested) <= MAX_ECHOED_NAME else requested[:MAX_ECHOED_NAME] + "..."
            text = f"The model `{name}` does not exist (this server serves {listed})."
        super().__init__(text)


def served_models(models: Sequence[str] | str | None, served_names: Sequence[str] | str | None = None,
                  shards: Sequence[str] | None = None) -> list[ServedModel]:
    """The gateway's models from its flags; ``ValueError`` naming what is wrong.

    ``models``: ``--model`` values, each ``PATH`` or ``NAME=PATH``; ``served_names``:
    ``--served-model-name`` values, one per model in order (a ``NAME=`` wins);
    ``shards``: ``--shards`` values, each ``NAME=S1[,S2...]``."""
    paths = [models] if isinstance(models, str) else list(models or ["tiny"])
    names = [served_names] if isinstance(served_names, str) else list(served_names or [])
    if len(names) > len(paths):
        raise ValueError(f"--served-model-name given {len(names)} times for {len(paths)} --model")
    entries: list[tuple[str, str]] = []
    for i, spec in enumerate(paths):
        name, sep, path = spec.partition("=")
        if sep and not name:
            raise ValueError(f"--model {spec!r}: no name before '=' (NAME=PATH, or PATH alone)")
        # NAME=PATH, a NAME such as Hugging Face's "org/model" too; a path with a "=" in it
        # (one that starts as paths do, or a folder that is there) is a PATH.
        if not sep or not name or name.startswith(("/", ".", "~")) or Path(spec).exists():
            name, path = (names[i] if i < len(names) else spec), spec
        if not path:
            raise ValueError(f"--model {spec!r}: no checkpoint after '='")
        entries.append((name, path))
    seen = [n for n, _ in entries]
    dup = next((n for n in seen if seen.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"model name {dup!r} is served twice (name them: --model NAME=PATH)")
    table: dict[str, tuple[str, ...]] = {}
    for spec in shards or ():
        name, sep, rest = spec.partition("=")
        if not sep or name not in seen:
            raise ValueError(f"--shards {spec!r}: expected MODEL=SHARD[,SHARD...] with MODEL one of {seen}")
        if name in table:
            raise ValueError(f"--shards {spec!r}: {name!r}'s shards are given twice (list them in one --shards)")
        table[name] = tuple(check_shard(s.strip()) for s in rest.split(",") if s.strip())
        if not table[name]:
            raise ValueError(f"--shards {spec!r}: no shard")
        if len(set(table[name])) != len(table[name]):
            raise ValueError(f"--shards {spec!r}: a shard is named twice")
    out = [ServedModel(n, p, table.get(n) or (f"s{i}",)) for i, (n, p) in enumerate(entries)]
    owners: dict[str, str] = {}
    for m in out:
        for s in m.shards:
            if owners.setdefault(s, m.name) != m.name:
                raise ValueError(f"shard {s!r} serves both {owners[s]!r} and {m.name!r} (prefix keys never cross models)")
    return out


class Router:
    """Each served model's ``GatewayCore``; the first is the default while one model is served."""

    def __init__(self, cores: Sequence[GatewayCore]) -> None:
        if not cores:
            raise ValueError("a gateway serves at least one model")
        self.cores = {c.name: c for c in cores}
        self.default = cores[0]
        if len(cores) > 1:
            for c in cores:
                c.siblings = [o for o in cores if o is not c]  # a client's id is one model's at a time

    @property
    def names(self) -> list[str]:
        return list(self.cores)

    def core_for(self, model: str | None) -> GatewayCore:
        """The core of ``model``; ``None`` or ``""``: the only one (``UnknownModel`` when several
        are served, or the name is not served)."""
        if not model:
            if len(self.cores) == 1:
                return self.default
            raise UnknownModel(None, self.names)
        core = self.cores.get(model)
        if core is None:
            raise UnknownModel(model, self.names)
        return core

    async def cancel(self, request_id: str) -> bool:
        """Queue a cancel entry in the shard that holds ``request_id``; False when no shard has
        it (with one model it is always queued: in its shard by the id, when none holds it).

        Every shard of a model is looked in, not only the one the id maps to now: a shard added
        to a model changes that map, and a gateway started since would queue the cancel of a
        request in flight where no scheduler knows it (and answer True)."""
        if len(self.cores) == 1 and len(self.default.shards) == 1:
            await self.default.cancel(request_id)
            return True
        if len(self.cores) == 1 and self.default.relaying(request_id):  # relayed here: its shard is known
            await self.default.cancel(request_id)
            return True
        # Several models: an id is claimed per model, so two models may each hold a request of
        # it (through different gateways, or this one); the cancel stops every one.
        found = False
        for core in self.cores.values():
            hit = False
            for keys in core.shards:
                if await retry(lambda k=keys, c=core: c.redis.exists(k.idempotency(request_id)),
                               what="cancel_lookup", attempts=CANCEL_LOOKUP_ATTEMPTS):  # then UNAVAILABLE
                    await core.cancel(request_id, keys=keys)
                    hit = True
            if not hit and core.relaying(request_id):  # its claim gone (past its TTL): its shard by the id
                await core.cancel(request_id)
                hit = True
            found = found or hit
        if not found and len(self.cores) == 1:
            await self.default.cancel(request_id)  # not queued yet: where it will be
            return True
        return found

    async def stop(self) -> None:
        for c in self.cores.values():
            await c.stop()
