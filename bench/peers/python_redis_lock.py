#!/usr/bin/env python3
"""Peer: python-redis-lock (lock:NAME + signal list), uncontended cycles.

Usage: python_redis_lock.py REDIS_URL CYCLES   → one JSON line on stdout.
"""
import os
import sys

import redis
import redis_lock

from peer_common import measure, report

url, cycles = sys.argv[1], int(sys.argv[2])
conn = redis.Redis.from_url(url)
lock = redis_lock.Lock(conn, f"peer:python-redis-lock:{os.getpid()}", expire=30)
report("python-redis-lock", measure(lambda: lock.acquire(blocking=True), lock.release, cycles))
