"""Shared by the peer scripts: time acquire+release cycles or a contended hand-off,
print one JSON line."""
import json
import threading
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


def handoff(make_worker, waiters, seconds):
    """Contended hand-off: `waiters` threads loop on one lock for `seconds`.

    `make_worker(i)` returns (acquire, release) for thread i (its own lock object, and
    its own connection where the client needs one). A hand-off is real when the lock
    passes to a different thread; its latency runs from the moment the previous holder
    starts releasing to the next grant. Returns the figures as a dict.
    """
    events = []  # (granted, releasing, thread); list.append is atomic under the GIL
    workers = [make_worker(i) for i in range(waiters)]
    start = time.perf_counter()
    stop = start + seconds

    def loop(i):
        acquire, release = workers[i]
        while time.perf_counter() < stop:
            if not acquire():
                continue
            granted = time.perf_counter()
            releasing = time.perf_counter()
            events.append((granted, releasing, i))
            release()

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(waiters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    events = sorted(e for e in events if e[0] <= stop)
    latencies, taken_back = [], 0
    for prev, cur in zip(events, events[1:]):
        if prev[2] == cur[2]:
            taken_back += 1
        else:
            latencies.append((cur[0] - prev[1]) * 1e6)
    latencies.sort()
    pick = lambda q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))]) if latencies else None
    counts = [0] * waiters
    for e in events:
        counts[e[2]] += 1
    squares = sum(c * c for c in counts)
    return {
        "waiters": waiters,
        "acquisitions": len(events),
        "real_handoffs": len(latencies),
        "handoffs_per_sec": len(latencies) / seconds,
        "handoff": {"p50_us": pick(0.50), "p99_us": pick(0.99), "p999_us": pick(0.999)},
        "reacquired_pct": 100.0 * taken_back / max(1, len(events) - 1),
        "jain_fairness": sum(counts) ** 2 / (waiters * squares) if squares else 0.0,
    }
