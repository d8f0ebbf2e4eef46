#!/usr/bin/env python3
"""Peer: redis-py's Lock (SET NX PX + a Lua compare-and-delete), uncontended cycles.

Usage: redis_py_lock.py REDIS_URL CYCLES   → one JSON line on stdout.
"""
import os
import sys

import redis

from peer_common import measure, report

url, cycles = sys.argv[1], int(sys.argv[2])
conn = redis.Redis.from_url(url)
lock = conn.lock(f"peer:redis-py:{os.getpid()}", timeout=30)
report("redis-py Lock", measure(lambda: lock.acquire(blocking=True), lock.release, cycles))
