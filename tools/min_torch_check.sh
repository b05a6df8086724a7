#!/usr/bin/env bash
# The oldest torch accumnorm claims (pyproject's torch>=...), in a fresh virtual environment: the core smoke test and
# the engine's tests on CPU. Not part of CI (it downloads another torch); its output goes with a release's notes.
#
#   tools/min_torch_check.sh 2.8.0 0.23.0
set -euo pipefail
version=${1:?usage: tools/min_torch_check.sh TORCH_VERSION TORCHVISION_VERSION}
vision=${2:?usage: tools/min_torch_check.sh TORCH_VERSION TORCHVISION_VERSION}
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==$version" "greenlet>=3.0" numpy
"$venv/bin/python" -m pip install -q --no-deps .
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
"$venv/bin/python" tools/core_smoke.py  # the core alone, before the tests' extras arrive
"$venv/bin/python" -m pip install -q "torchvision==$vision" pytest hypothesis tqdm timm
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" tests/engine/test_accumulation.py \
    tests/engine/test_schedules.py tests/engine/test_layerwise.py tests/engine/test_side_effects.py \
    tests/engine/test_checkpoint.py tests/engine/test_batch_loss.py tests/engine/test_functional.py \
    tests/engine/test_process_state.py tests/engine/test_segments.py tests/engine/test_recompute.py \
    tests/engine/test_failed_steps.py tests/engine/test_user_functions.py tests/engine/test_shared_state.py
# Compiled models: the refusals. torch 2.8 itself cannot train through while_loop (no autograd), a compiled scan
# recompiled for a shorter batch, or a nested_compile_region that updates a buffer: the rest of test_compile.py
# is for newer torch.
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/engine/test_compile.py \
    -k "fullgraph or higher_order_ops_body_is_refused or cond_branch or dynamo_has_only"
