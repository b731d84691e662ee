#!/usr/bin/env bash
# Trains the example GPT with FULL_SHARD on 2 CPU ranks over gloo, after
# installing what is missing and building. Extra arguments go to the example
# (e.g. --nproc 4, --steps 100, --impl torch).
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
echo "== examples/train_gpt.py $*"
"$PY" examples/train_gpt.py "$@"
