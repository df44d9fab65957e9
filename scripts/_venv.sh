# Sourced by the scripts here: activate .venv (creating it if needed) unless a
# virtualenv is already active, so every command works for a non-root user.
if ! python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
    if [ ! -x .venv/bin/python ]; then
        python3 -m venv .venv
    fi
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
