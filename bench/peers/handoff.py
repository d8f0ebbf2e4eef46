#!/usr/bin/env python3
"""Peers under contention: WAITERS threads of one process loop on one lock.

Usage: handoff.py PEER TARGET WAITERS SECONDS   → one JSON line on stdout, with
`peer`, `handoffs_per_sec`, `handoff.p50_us`, `handoff.p99_us`, `handoff.p999_us`,
`reacquired_pct` and `jain_fairness` (see peer_common.handoff).

PEER and TARGET:
  redis-py            redis://HOST:PORT  redis-py's Lock, waiting as it does by default
                                         (sleep 100 ms between tries)
  python-redis-lock   redis://HOST:PORT  python-redis-lock (waiters BLPOP a signal list)
  kazoo               HOST:PORT          kazoo's Lock recipe (each waiter watches the
                                         node before its own)
  etcd3gw             HOST:PORT          etcd3gw's Lock (one try per call; waiters try
                                         again after 10 ms, as dlock's polling scenario)
"""
import json
import logging
import os
import sys
import time

from peer_common import handoff

logging.basicConfig(level=logging.ERROR)
peer, target, waiters, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
name = f"peer-handoff-{os.getpid()}"
# Every blocking wait is bounded so the run ends even if a peer stalls.
bound = seconds + 10
cleanup = []

if peer == "redis-py":
    import redis

    client = redis.Redis.from_url(target)

    def make(_i):
        lock = client.lock(name, timeout=30, blocking_timeout=bound)
        return lock.acquire, lock.release

elif peer == "python-redis-lock":
    import redis
    import redis_lock

    client = redis.Redis.from_url(target)

    def make(_i):
        lock = redis_lock.Lock(client, name, expire=30)
        return (lambda: lock.acquire(blocking=True, timeout=bound)), lock.release

elif peer == "kazoo":
    from kazoo.client import KazooClient

    client = KazooClient(hosts=target)
    client.start(timeout=10)
    cleanup.append(client.stop)

    def make(i):
        lock = client.Lock(f"/peer/{name}", f"waiter-{i}")
        return (lambda: lock.acquire(blocking=True, timeout=bound)), lock.release

elif peer == "etcd3gw":
    import etcd3gw

    host, port = target.rsplit(":", 1)

    def make(_i):
        lock = etcd3gw.client(host=host, port=int(port)).lock(name, ttl=30)

        def acquire():
            deadline = time.perf_counter() + bound
            while not lock.acquire():
                if time.perf_counter() > deadline:
                    return False
                time.sleep(0.01)
            return True

        return acquire, lock.release

else:
    sys.exit(f"handoff.py: unknown peer {peer!r}")

try:
    result = handoff(make, waiters, seconds)
    print(json.dumps({"peer": peer, **result}))
finally:
    for stop in cleanup:
        stop()
