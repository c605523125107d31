#!/usr/bin/env bash
# The flagship demo, on a laptop, in a few minutes:
#   1. plan GPT-3 175B for 1,024 H100s (fake tensors: no GPU, no memory) and print the plan
#      and its time/memory frontier;
#   2. measure this machine (matmul and gloo collectives on 2 local CPU ranks), and fit the
#      profile's op times to the GPT's own step (`pxform check-profile --model`);
#   3. train a small GPT on those 2 ranks under torchrun with a plan searched for them,
#      printing the loss beside a single-process run's and the predicted vs measured step
#      time and memory.
# Under CI=true the training part is shorter. Outputs go to $PXFORM_DEMO_OUT (demo_out/).
set -euo pipefail
source "$(dirname "$0")/scripts/setup.sh" ""
OUT="${PXFORM_DEMO_OUT:-demo_out}"
mkdir -p "$OUT"
if [ "${CI:-}" = "true" ]; then SIZE=tiny; STEPS=8; else SIZE=small; STEPS=30; fi
export OMP_NUM_THREADS=1  # 2 ranks share the machine's cores

echo "== 1/3  GPT-3 175B on 1,024 H100-80GB: the plan pxform searches (no GPU needed) =="
pxform plan examples/factories.py:gpt3_175b --devices 1024 --hardware h100-80gb \
    --batch 1536 --out "$OUT/gpt3-175b-1024xh100.json"

echo
echo "== 2/3  Measuring this machine: 2 CPU ranks, gloo =="
python -m torch.distributed.run --standalone --nproc-per-node 2 -m pxform calibrate \
    --out "$OUT/cpu-profile.json" --name cpu-x2

# the profile's op times fitted on a small reference transformer, then rescaled to this
# GPT's own step on one rank's share of the batch (16 / 2): its op mix is not the reference's
python -m torch.distributed.run --standalone --nproc-per-node 2 -m pxform check-profile \
    "$OUT/cpu-profile.json" --model "examples/factories.py:gpt_$SIZE" --batch 8 \
    --refresh "$OUT/cpu-profile-gpt.json"

echo
echo "== 3/3  Training GPT '$SIZE' on 2 CPU ranks with a searched plan =="
python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_gpt.py \
    --size "$SIZE" --steps "$STEPS" --hardware "$OUT/cpu-profile-gpt.json" --report-at 3 \
    --log-every 5 --check "$@"
