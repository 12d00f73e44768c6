#!/usr/bin/env bash
# The NeMo Gym virtualenv (`make gym-venv`): nemo-gym 0.7.0 in its own Python 3.13 venv, apart from
# reinforge's (nemo-gym needs Python 3.13 and pins openai, ray and others; reinforge reaches its
# servers over HTTP only: the tests start them from this venv with tests/e2e/_gym.py, users with
# `.gym-venv/bin/gym env start`, docs/agents.md).
#
# nemo-gym 0.5+ declares Requires-Python >=3.13.14; it installs and runs on earlier 3.13 releases
# (pip refuses it there without the flag), hence --ignore-requires-python.
# Usage: scripts/setup_gym_venv.sh [VENV_DIR]   (default .gym-venv); writes VENV_DIR/.installed when done.
set -euo pipefail

NEMO_GYM="nemo-gym==0.7.0"
VENV="${1:-.gym-venv}"

is_python_313() {  # the command runs and is a Python 3.13
    "$@" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 13))' >/dev/null 2>&1
}

find_python_313() {
    if is_python_313 python3.13; then
        echo python3.13; return
    fi
    local root="${PYENV_ROOT:-$HOME/.pyenv}" candidate version
    for candidate in "$root"/versions/3.13*/bin/python3.13; do
        [ -x "$candidate" ] || continue
        version="$(basename "$(dirname "$(dirname "$candidate")")")"
        # the pyenv shim runs once told which version to use
        if is_python_313 env PYENV_VERSION="$version" python3.13; then
            echo "env PYENV_VERSION=$version python3.13"; return
        fi
        if is_python_313 "$candidate"; then
            echo "$candidate"; return
        fi
    done
    if command -v uv >/dev/null 2>&1 && candidate="$(uv python find 3.13 2>/dev/null)" && is_python_313 "$candidate"; then
        echo "$candidate"; return
    fi
    return 1
}

if [ -x "$VENV/bin/python" ] && ! is_python_313 "$VENV/bin/python"; then
    rm -rf "$VENV"  # a venv of another Python (or a broken one): start again
fi
if [ ! -x "$VENV/bin/python" ]; then
    if ! python="$(find_python_313)"; then
        echo "setup_gym_venv: no working Python 3.13 found (tried python3.13, pyenv's 3.13.x, uv python find 3.13); install one, e.g. 'pyenv install 3.13'" >&2
        exit 1
    fi
    echo "setup_gym_venv: creating $VENV with $python"
    $python -m venv "$VENV"
fi
rm -f "$VENV/.installed"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --ignore-requires-python "$NEMO_GYM"
"$VENV/bin/python" -c 'import nemo_gym, resources_servers.example_single_tool_call'  # the install is usable
touch "$VENV/.installed"
echo "setup_gym_venv: $NEMO_GYM ready in $VENV"
