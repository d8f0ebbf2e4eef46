#!/usr/bin/env node
// Peer: node `redlock` (4.x, the npm `latest`) on one Redis node through ioredis:
// SET NX PX + a Lua compare-and-delete, uncontended cycles.
//
// Usage: node node_redlock.js REDIS_URL CYCLES   → one JSON line on stdout, the same
// fields as the Python peers (peer_common.py).
"use strict";

const Redis = require("ioredis");
const Redlock = require("redlock");

const WARMUP = 20;

async function main() {
  const [url, cyclesArg] = process.argv.slice(2);
  const cycles = Number.parseInt(cyclesArg, 10);
  if (!url || !Number.isInteger(cycles) || cycles <= 0) {
    console.error("usage: node_redlock.js REDIS_URL CYCLES");
    process.exit(2);
  }
  const client = new Redis(url);
  const redlock = new Redlock([client], { retryCount: 0 });
  const name = `peer:node-redlock:${process.pid}`;
  const cycle = async () => {
    const lock = await redlock.lock(name, 30000);
    await lock.unlock();
  };
  for (let i = 0; i < WARMUP; i++) await cycle();
  const samples = [];
  const start = process.hrtime.bigint();
  for (let i = 0; i < cycles; i++) {
    const t = process.hrtime.bigint();
    await cycle();
    samples.push(Number(process.hrtime.bigint() - t) / 1000);
  }
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  samples.sort((a, b) => a - b);
  const pick = (q) => Math.round(samples[Math.min(samples.length - 1, Math.floor(q * samples.length))]);
  console.log(JSON.stringify({
    peer: "node redlock",
    ops_per_sec: cycles / seconds,
    p50_us: pick(0.5),
    p99_us: pick(0.99),
  }));
  client.disconnect();
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
