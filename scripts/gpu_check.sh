#!/usr/bin/env sh
# The GPU check from a checkout, with whichever Python has torch: the checkout's .venv if there is one, else
# $PYTHON, else python3, with this checkout's src/ first on the path (installed or not). Arguments pass through
# (--dry-run, --out FILE, --only STEPS; see python -m pipeline.gpu_check --help).
#   sh scripts/gpu_check.sh                 # on a machine with an NVIDIA GPU: about 6 minutes, no network
#   PYTHON=/opt/conda/bin/python sh scripts/gpu_check.sh --out gpu_check.json
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$here/../.venv/bin/python" ]; then python="$here/../.venv/bin/python"; else python=python3; fi
fi
PYTHONPATH="$here/../src${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m pipeline.gpu_check "$@"
