"""The global queue against a reference: the list scan it replaced, key for key.

``Reference`` is the former queue: a dict scanned per pick with the policy's key at
``now``. Random operations (seeded ``random``, and ``hypothesis`` where it is installed)
must leave both with the same requests in the same order. ``aging_s`` is a power of two
and the times whole numbers, so both keys are computed exactly and ties stay ties.
"""

from __future__ import annotations

import math
import random

import pytest

from pagefleet.protos import cluster_pb2
from pagefleet.scheduler.queue import POLICIES, GlobalQueue, Pending

AGING_S = 4.0
NUM_IDS = 30


class Reference:
    """The former queue: a dict, and ``min`` / ``sorted`` by the key at ``now``."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.items: dict[str, Pending] = {}

    def key(self, p: Pending, now: float) -> tuple:
        if self.policy == "priority":
            return (-(p.priority + (now - p.enqueued_at) / AGING_S), p.seq)
        if self.policy == "deadline":
            return (p.deadline_unix_ms or math.inf, p.seq)
        return (p.seq,)

    def ordered(self, now: float) -> list[Pending]:
        return sorted(self.items.values(), key=lambda p: self.key(p, now))

    def pop(self, now: float) -> Pending | None:
        if not self.items:
            return None
        p = min(self.items.values(), key=lambda p: self.key(p, now))
        del self.items[p.request_id]
        return p

    def pop_expired(self, now_ms: int) -> list[Pending]:
        gone = [p for p in self.items.values() if p.deadline_unix_ms and p.deadline_unix_ms <= now_ms]
        for p in gone:
            del self.items[p.request_id]
        return gone


def make_pending(i: int, priority: int, deadline_ms: int, enqueued_at: int, seq: int) -> Pending:
    rid = f"r{i}"
    msg = cluster_pb2.AssignRequest(request_id=rid, priority=priority, deadline_unix_ms=deadline_ms)
    return Pending(rid, f"{rid}-entry", msg, seq, enqueued_at=float(enqueued_at))


def check(policy: str, ops: list[tuple]) -> None:
    """Apply ``ops`` to a ``GlobalQueue`` and the reference; they must agree at every step.

    Ops: ``("push", i, priority, deadline_ms, enqueued_at, seq)`` (a request pushed again
    is the same ``Pending``: a re-queue, or a replacement while queued), ``("remove", i)``,
    ``("pop", now)``, ``("expire", now_ms)``.
    """
    q, ref = GlobalQueue(policy, AGING_S), Reference(policy)
    known: dict[int, Pending] = {}
    removed: set[str] = set()  # removed and not pushed since: must never come out
    for op in ops:
        if op[0] == "push":
            p = known.setdefault(op[1], make_pending(*op[1:]))
            q.push(p)
            ref.items[p.request_id] = p
            removed.discard(p.request_id)
        elif op[0] == "remove":
            rid = f"r{op[1]}"
            assert q.remove(rid) is ref.items.pop(rid, None)
            removed.add(rid)
        elif op[0] == "pop":
            assert q.peek() is (ref.ordered(op[1]) or [None])[0]
            p = q.pop()
            assert p is ref.pop(op[1])
            assert p is None or p.request_id not in removed
        else:
            gone = q.pop_expired(op[1])
            assert gone == ref.pop_expired(op[1])
            assert all(p.deadline_unix_ms and p.deadline_unix_ms <= op[1] for p in gone)
            assert not {p.request_id for p in gone} & removed
        assert len(q) == len(ref.items)
        assert all((f"r{i}" in q) == (f"r{i}" in ref.items) for i in range(NUM_IDS))
    for now in (0, 10_000):
        assert q.ordered() == ref.ordered(now)
    drained = [q.pop() for _ in range(len(q))]
    assert drained == ref.ordered(0) and q.pop() is None and len(q) == 0


def random_ops(rng: random.Random, n: int) -> list[tuple]:
    ops: list[tuple] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.5:
            deadline = rng.choice([0, 0, 100, 200, 300])
            ops.append(("push", rng.randrange(NUM_IDS), rng.randrange(4), deadline, rng.randrange(41),
                        rng.randrange(11)))
        elif r < 0.7:
            ops.append(("remove", rng.randrange(NUM_IDS)))
        elif r < 0.9:
            ops.append(("pop", rng.randrange(40, 10_001)))
        else:
            ops.append(("expire", rng.randrange(401)))
    return ops


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(40))
def test_same_order_as_the_list_it_replaced(policy: str, seed: int):
    check(policy, random_ops(random.Random(seed), 200))


@pytest.mark.parametrize("policy", POLICIES)
def test_same_order_as_the_list_it_replaced_hypothesis(policy: str):
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    op = st.one_of(
        st.tuples(st.just("push"), st.integers(0, NUM_IDS - 1), st.integers(0, 3),
                  st.sampled_from([0, 100, 200, 300]), st.integers(0, 40), st.integers(0, 10)),
        st.tuples(st.just("remove"), st.integers(0, NUM_IDS - 1)),
        st.tuples(st.just("pop"), st.integers(40, 10_000)),
        st.tuples(st.just("expire"), st.integers(0, 400)),
    )

    @hypothesis.settings(max_examples=150, deadline=None, database=None)
    @hypothesis.given(st.lists(op, max_size=120))
    def run(ops):
        check(policy, ops)

    run()


def test_priority_ages_a_long_waiter_past_a_newer_higher_one():
    q = GlobalQueue("priority", aging_s=AGING_S)
    old = make_pending(0, priority=0, deadline_ms=0, enqueued_at=0, seq=0)
    new = make_pending(1, priority=2, deadline_ms=0, enqueued_at=12, seq=1)  # 3 levels of aging later
    q.push(new)
    q.push(old)
    assert q.ordered() == [old, new]


def test_dead_entries_do_not_pile_up():
    q = GlobalQueue("deadline")
    ps = [make_pending(i, 0, 1000 + i, 0, i) for i in range(1000)]
    for p in ps:
        q.push(p)
    for p in ps[:990]:
        assert q.remove(p.request_id) is p
    assert len(q._heap) <= 2 * len(q) + 64 and len(q._by_deadline) <= 2 * len(q) + 64
    assert q.remove("r0") is None and "r0" not in q
    assert q.pop_expired(1994) == ps[990:995]
    assert q.ordered() == ps[995:] and len(q) == 5
