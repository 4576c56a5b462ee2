#!/usr/bin/env bash
# The CUDA checks, as one script for a lent GPU machine (whose python3 already has torch with CUDA, pytest and
# hypothesis): the test suite with the GPU visible (all but the Hugging Face integration tests, see below),
# failing on any skipped test (CUDA or not), then
# benchmarks/step.py on CUDA with the ~125M-parameter GPT-shaped set. Logs and JSON go to $OUT (default
# /tmp/gpu_check). Exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
status=0
# tests/integrations and gefen.integrations' doctests need the hf and gates extras (transformers, accelerate and
# the MiniLM weights, too large to carry to an offline GPU machine); they hold nothing CUDA-specific and run in
# CI on the CPU. Everything else runs here, and any skip fails the check.
python3 -m pytest -q -p no:cacheprovider -rs tests src/gefen --ignore=tests/integrations \
  --ignore=src/gefen/integrations 2>&1 | tee "$out/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
skipped=$(grep -E "^SKIPPED \[[0-9]+\]" "$out/pytest.log" | sed -E 's/^SKIPPED \[([0-9]+)\].*/\1/' | awk '{n += $1} END {print n + 0}')
echo "gpu_check: $skipped skipped tests"
if [ "$skipped" -ne 0 ] || grep -qE "^SKIPPED" "$out/pytest.log"; then
  echo "gpu_check: every test must run on a GPU machine, but some were skipped:" >&2
  grep -E "^SKIPPED" "$out/pytest.log" >&2
  status=1
fi
python3 benchmarks/step.py --device cuda --size 125m 2>&1 | tee "$out/step_cuda_125m.json" || status=1
python3 benchmarks/step.py --device cuda --size 25m 2>&1 | tee "$out/step_cuda_25m.json" || status=1
echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
