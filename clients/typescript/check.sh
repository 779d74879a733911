#!/usr/bin/env bash
# The TypeScript client's checks, as CI runs them: npm ci (the TypeScript
# compiler, @types/node, and the redis client for bench.mjs), the build
# (tsc --strict), the tests against the real ticketd (TICKETD_BIN= to
# choose the binary, else the newest under target/), which also pack the
# package and install it offline into a fresh directory, and a short run of
# bench.mjs. Each step is bounded: a hang fails the run instead of holding CI.
set -euo pipefail
cd "$(dirname "$0")"
timeout 300 npm ci --no-audit --no-fund
timeout 120 npx tsc -p tsconfig.json
timeout 600 node --test --test-concurrency=1 test/*.test.mjs
# A smoke run: against a debug ticketd (as in CI) its ratios say nothing;
# README.md gives the figures, taken with a release build.
echo "bench.mjs smoke run (0.2 s cells; ratios are meaningful only with a release ticketd):"
timeout 120 node bench.mjs --seconds 0.2 --rounds 1
