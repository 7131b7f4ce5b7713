#!/usr/bin/env bash
# The environment matrix: the README's gate (`dpfsdp-verify run --expect opacus-1.6.0`) under each
# torch named here, each in a fresh virtual environment of its own, so the shipped expectations
# (dpfsdp_verify/properties/known_failures/opacus-1.6.0.toml, whose entries may carry `when`
# conditions) are shown to hold on every torch CI can install. .ci/run calls it after the tests;
# anyone can run it: `bash .ci/torch_matrix.sh [CONSTRAINTS_FILE...]` (default: constraints/torch214.txt,
# the CUDA build of torch 2.14.1, which runs on a CPU machine; torch 2.13.0 is the tests' own env).
# Each gate's JSON report is left in .ci-matrix/<name>.json. Exit: the first non-zero gate's code.
set -euo pipefail
cd "$(dirname "$0")/.."
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(constraints/torch214.txt)
mkdir -p .ci-matrix
status=0
for constraints in "${files[@]}"; do
  name=$(basename "$constraints" .txt)
  venv=".ci-matrix/venv-$name"
  t0=$(date +%s)
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q -c "$constraints" -e ".[opacus,fuzz]"
  t1=$(date +%s)
  echo "+ [$name] dpfsdp-verify run --expect opacus-1.6.0 (torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'))"
  code=0
  "$venv/bin/dpfsdp-verify" run --expect opacus-1.6.0 -q --json ".ci-matrix/$name.json" || code=$?
  t2=$(date +%s)
  echo "[$name] exit $code; install $((t1 - t0)) s, gate $((t2 - t1)) s"
  rm -rf "$venv"
  if [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then status=$code; fi
done
exit "$status"
