"""Shared by the peer scripts: time acquire+release cycles, print one JSON line."""
import json
import time

WARMUP = 20


def measure(acquire, release, cycles):
    """Run WARMUP then `cycles` acquire+release cycles; returns (cycles/s, samples µs)."""
    for _ in range(WARMUP):
        acquire()
        release()
    samples = []
    start = time.perf_counter()
    for _ in range(cycles):
        t = time.perf_counter()
        acquire()
        release()
        samples.append((time.perf_counter() - t) * 1e6)
    return cycles / (time.perf_counter() - start), samples


def report(peer, result):
    rate, samples = result
    samples.sort()
    pick = lambda q: round(samples[min(len(samples) - 1, int(q * len(samples)))])
    print(json.dumps({"peer": peer, "ops_per_sec": rate, "p50_us": pick(0.50), "p99_us": pick(0.99)}))
