#!/usr/bin/env python3
"""Peer: kazoo's Lock recipe on ZooKeeper, uncontended cycles.

Usage: kazoo_lock.py HOST:PORT CYCLES   → one JSON line on stdout.
"""
import logging
import os
import sys

from kazoo.client import KazooClient

from peer_common import measure, report

logging.basicConfig(level=logging.ERROR)
hosts, cycles = sys.argv[1], int(sys.argv[2])
client = KazooClient(hosts=hosts)
client.start(timeout=10)
lock = client.Lock(f"/peer/kazoo-{os.getpid()}", "bench")
try:
    report("kazoo Lock", measure(lock.acquire, lock.release, cycles))
finally:
    client.stop()
