#!/usr/bin/env bash
# The CUDA checks, as one script for a lent GPU machine (whose python3 already has torch with CUDA, pytest and
# hypothesis): the CUDA tests (the Triton backend against the CPU native one, its self-check, CUDA-graph capture of a
# skip step, no host sync), then benchmarks/step.py on CUDA with the ~125M- and ~25M-parameter GPT-shaped sets, then
# the rest of the suite with the GPU visible (all but the Hugging Face integration tests, see below; the Triton
# interpreter tests in a process of their own), failing on any skipped test (CUDA or not). Logs and JSON go to $OUT
# (default /tmp/gpu_check). Exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
status=0
# tests/integrations and gefen.integrations' doctests need the hf and gates extras (transformers, accelerate and
# the MiniLM weights, too large to carry to an offline GPU machine); they hold nothing CUDA-specific and run in
# CI on the CPU. Everything else runs here, and any skip fails the check. The CUDA tests run first (one minute),
# then the rest, spread over the machine's cores when pytest-xdist is there (a device command may run 10 minutes
# at most), each failure named in the summary (-rfE).
python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_cuda.py 2>&1 | tee "$out/pytest_cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# the numbers next (the acceptance figures), before the long CPU-side rest of the suite
python3 benchmarks/step.py --device cuda --size 125m > "$out/step_cuda_125m.json" 2> "$out/step_cuda_125m.err" || status=1
python3 benchmarks/step.py --device cuda --size 25m > "$out/step_cuda_25m.json" 2> "$out/step_cuda_25m.err" || status=1
# how much bigger a model trains on this GPU: one 16 GiB budget keeps it to a few minutes
python3 -m gefen.cli.main capacity --device cuda --budget-gib 16 --json "$out/capacity_cuda_16g.json" \
  --plot "$out/capacity_cuda_16g.png" > "$out/capacity_cuda.txt" 2> "$out/capacity_cuda.err" || status=1
# the tests that run the Triton kernels under Triton's interpreter (CPU tensors), as in CI
interpreted=(tests/kernels/test_triton_plan.py tests/kernels/test_triton_check.py tests/optim/test_triton_backend.py
  tests/optim/test_triton_capturable.py)
ignored=()
for f in "${interpreted[@]}"; do ignored+=(--ignore="$f"); done
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n "$(( $(nproc) > 16 ? 16 : $(nproc) ))" -p no:benchmark)
python3 -m pytest -q -p no:cacheprovider -rfEs "${parallel[@]}" tests src/gefen --ignore=tests/test_cuda.py \
  --ignore=tests/integrations --ignore=src/gefen/integrations "${ignored[@]}" 2>&1 | tee "$out/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# the Triton kernels under Triton's interpreter (CPU tensors), as in CI: a process of their own, since the
# interpreter is chosen when triton is first imported and the CUDA tests above compiled the kernels for the GPU
TRITON_INTERPRET=1 python3 -m pytest -q -p no:cacheprovider -rfEs "${interpreted[@]}" 2>&1 \
  | tee "$out/pytest_triton_interpreter.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cat "$out/pytest_triton_interpreter.log" >> "$out/pytest.log"
cat "$out/pytest_cuda.log" >> "$out/pytest.log"
skipped=$(grep -E "^SKIPPED \[[0-9]+\]" "$out/pytest.log" | sed -E 's/^SKIPPED \[([0-9]+)\].*/\1/' | awk '{n += $1} END {print n + 0}')
echo "gpu_check: $skipped skipped tests"
if [ "$skipped" -ne 0 ] || grep -qE "^SKIPPED" "$out/pytest.log"; then
  echo "gpu_check: every test must run on a GPU machine, but some were skipped:" >&2
  grep -E "^SKIPPED" "$out/pytest.log" >&2
  status=1
fi
echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
