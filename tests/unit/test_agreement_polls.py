"""HookScope.agree polls the store at most 1 ms apart while ranks are still expected within milliseconds of each
other, and backs off afterwards (one poll per 20 ms at most)."""

from __future__ import annotations

import torch.distributed as dist

from accelerate_memsafe.distributed import collectives
from accelerate_memsafe.distributed.collectives import HookScope


class Clock:
    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append((self.now, s))
        self.now += s


def _agree_with_peer_arriving_at(monkeypatch, arrives_s: float) -> Clock:
    clock = Clock()
    monkeypatch.setattr(collectives.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(collectives.time, "sleep", clock.sleep)
    store = dist.HashStore()
    real_add = store.add

    class Store:  # the peer's arrival is a counter increment at `arrives_s` on the fake clock
        def __getattr__(self, name):
            return getattr(store, name)

        def add(self, key, n):
            if n == 0 and clock.now >= arrives_s and not getattr(self, "peer", False):
                self.peer = True
                real_add(key, 1)
            return real_add(key, n)

    HookScope("prepare", 0, store=Store(), rank=0, world_size=2).agree("before `accelerate.prepare`", timeout_s=60)
    return clock


def test_a_peer_a_few_milliseconds_late_is_seen_within_a_millisecond(monkeypatch):
    for arrives in (0.002, 0.0045, 0.03):
        clock = _agree_with_peer_arriving_at(monkeypatch, arrives)
        assert arrives <= clock.now < arrives + 1.1e-3, (arrives, clock.now)
        assert max(s for _, s in clock.sleeps) <= 1e-3


def test_a_long_wait_backs_off_to_one_poll_per_20_ms(monkeypatch):
    clock = _agree_with_peer_arriving_at(monkeypatch, 2.0)
    late = [s for t, s in clock.sleeps if t > 0.1]
    assert max(late) == 20e-3 and len(clock.sleeps) < 200
