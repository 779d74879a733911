#!/usr/bin/env bash
# The Go client's checks, as CI runs them: go vet, gofmt, the tests under
# the race detector against the real ticketd under target/ (TICKETD_BIN=
# to choose another binary), a build of the contention worker and a short
# run of the benchmark. Standard library only: nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")"
export GOPROXY=off
go vet ./...
unformatted=$(gofmt -l .)
if [ -n "$unformatted" ]; then
    echo "gofmt would change: $unformatted" >&2
    exit 1
fi
# Bounded: a hung test fails the run instead of holding CI.
timeout 600 go test -race -count=1 -timeout 300s ./...
go build -o /dev/null ./cmd/contention-worker
# A smoke run: against a debug ticketd (as in CI) its figures say nothing;
# README.md gives them with a release build.
echo "bench smoke run (0.2 s cells):"
timeout 120 go run ./bench -seconds 0.2 -rounds 1 ${TICKETD_BIN:+-ticketd-bin "$TICKETD_BIN"}
