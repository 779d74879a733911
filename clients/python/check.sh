#!/usr/bin/env bash
# The Python client's checks, as CI runs them: a venv with the package
# installed the way users install it (pip install ./clients/python), ruff,
# mypy --strict, the tests against the real ticketd under target/
# (TICKETD_BIN= to choose another binary; built with cargo if absent), and
# a short run of bench.py. redis-py is installed for bench.py only. ruff
# and mypy are pinned: a new release may format or judge the same code
# differently, and CI must not fail for that.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check . \
    'pytest>=7' 'mypy==2.4.1' 'ruff==0.17.6' 'redis>=4'
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy" --strict src tests bench.py
# Bounded: a hung test fails the run instead of holding CI.
timeout 900 "$VENV/bin/python" -m pytest -q -rs "$@"
# The benchmark still runs (a fraction of a second per cell; redis-py
# beside it where redis-server is installed). This is a smoke run: against
# a debug ticketd (as in CI) its ratios say nothing; README.md gives the
# figures, taken with a release build.
echo "bench.py smoke run (0.2 s cells; ratios are meaningful only with a release ticketd):"
timeout 120 "$VENV/bin/python" bench.py --seconds 0.2 --rounds 1 ${TICKETD_BIN:+--ticketd-bin "$TICKETD_BIN"}
