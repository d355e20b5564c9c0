#!/usr/bin/env bash
# The test set-up in one command, from a fresh checkout: what the suite needs and nothing else.
# CI runs it (.ci/run); README.md's "Running the tests" and docs/index.md say why each part is there.
#
#   Debian / Ubuntu: the system packages (apt-get; as root, or through sudo), the two coding agents
#                    (npm), .venv with the package and its `test` extra, .olah-venv with olah.
#   macOS:           no system packages: the tests that need one skip, naming it (docs/index.md,
#                    "On a Mac"); the agents when npm is there; the same two virtual environments.
#
# Then: . .venv/bin/activate && python -m pytest -q
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}

if command -v apt-get > /dev/null; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update
    $sudo apt-get install -y openmpi-bin libopenmpi-dev openssl iproute2 openssh-server openssh-client python3-venv \
        git chromium chromium-driver libopenblas0
    command -v npm > /dev/null || $sudo apt-get install -y nodejs npm
fi

if command -v npm > /dev/null; then
    npm install --prefix .agents @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.197
else
    echo "setup-dev: no npm, so no coding agents: tests/serving/test_agents.py will skip" >&2
fi

"$PYTHON" -m venv .venv
.venv/bin/python -m pip install '.[test]'
"$PYTHON" -m venv .olah-venv
.olah-venv/bin/pip install 'olah==0.5.4'
