#!/usr/bin/env bash
# What this project checks on one CUDA GPU, for a session that is lent one (issue 14, item 6): one command of the
# `device` tool, about 5 minutes, each step under its own deadline and the next one run whatever the last one did:
#
#   run(command="bash benchmarks/gpu_checks.sh", timeout_s=590)   # the deadlines below add up to 570 s
#
# 1. the versions there (python3, torch, CUDA, accelerate, transformers, peft): the GPU image's torch is not the one
#    CI tests with, so a failure may be a version's; torchdata (the dataloader stage) is imported only where used;
# 2. the GPU-marked tests (`pytest -m gpu tests/unit`);
# 3. `peft_reload.py --device cuda` (the device peak of peft's load_adapter against the plugin's reload);
# 4. `resume.py --device cuda --offload` (load_state of a CPU-offloaded optimizer: device bytes allocated and
#    reserved-minus-allocated);
# 5. `overhead.py --device cuda --settings 1proc` (the default plugin's prepare / save_state / load_state against
#    stock on one process, the model moved to the GPU by prepare; the probes synchronize the device at each stage).
#
# Each step's output goes to "$OUT/<step>.log" and every table to "$OUT/gpu.md", to paste into docs/benchmarks.md
# beside the CPU tables (overhead.py names its regions overhead-100m-cuda and overhead-paired-100m-cuda). The device
# tool brings back 8 files at most: this writes 6. Without $OUT (on any other machine) they go to /tmp/memsafe-gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/memsafe-gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
py="${PYTHON:-python3}"
failed=()

step() {  # step NAME SECONDS COMMAND...: COMMAND under a deadline, its output in $out/NAME.log; goes on after a failure
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS rc
    echo "== $name (at most ${secs} s): $*"
    timeout "$secs" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    tail -n 8 "$out/$name.log"
    [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

step versions 60 "$py" -c '
import sys, torch, accelerate, transformers, peft
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "accelerate", accelerate.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none: torch sees no CUDA device")
import accelerate_memsafe
print("accelerate_memsafe imports")
sys.exit(0 if torch.cuda.is_available() else 3)'
step gpu_tests 120 "$py" -m pytest -q -p no:cacheprovider -m gpu -rs tests/unit
step peft_reload 90 "$py" benchmarks/peft_reload.py --device cuda --size 100m --markdown "$out/gpu.md"
step resume 120 "$py" benchmarks/resume.py --device cuda --offload --size 250m --markdown "$out/gpu.md"
step overhead 180 "$py" benchmarks/overhead.py --device cuda --settings 1proc --launches 3 --repeats 2 \
    --markdown "$out/gpu.md"

if [ "${#failed[@]}" -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "every step passed; the tables are in $out/gpu.md"
