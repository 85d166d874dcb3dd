#!/usr/bin/env bash
# One-time (idempotent) set-up on a fresh machine: a venv with the pinned CPU torch,
# flexcomm installed editable with its test extras, and the Fashion-MNIST data set.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'

data_dir=/usr/share/datasets/fashion-mnist
if [ ! -f "$data_dir/train-images-idx3-ubyte.gz" ]; then
    sudo_cmd=""
    if [ "$(id -u)" != 0 ]; then sudo_cmd="sudo"; fi
    if ! $sudo_cmd apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1; then
        $sudo_cmd apt-get update -qq >/dev/null 2>&1 || true
        $sudo_cmd apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 \
            || echo "setup: could not install dataset-fashion-mnist; training will need --data-dir" >&2
    fi
fi
