#!/usr/bin/env bash
# The tensor-core grids under bench/data/, recorded in one H200 device call (issue 18).
#
#   bash bench/record_h200_grids.sh OUT_DIR CUBIN_CACHE [RECORD_SECONDS [SCRIPT_SECONDS]]
#
# Records the whole feasible grid of mma_f16 (bf16 prefill), decode_f16 and
# mma_f16 (bf16 decode against a KV cache) and mma_tf32 (float32, tf32x3 then
# tf32) at each shape below, most important first, into OUT_DIR/recordings.json
# (rewritten after every shape, so a cut-off run keeps the shapes done; one
# file, since a device call returns few). The recorder gets RECORD_SECONDS
# (default 430), then SIGINT. If at least 95 s of SCRIPT_SECONDS (default 505:
# a 540 s call less its set-up) are left, it also times the tuner at default settings
# on 4x16x4096x128 bf16 from a cold cubin cache, next to FlexAttention's
# max-autotune (bench/evidence_f16.py).
# Here: `python bench/record_replay.py --split OUT_DIR/recordings.json --out-dir bench/data`.
set -u
out=$1
cache=$2
record_s=${3:-430}
script_s=${4:-505}
began=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv \
    > "$out/record.log" 2>&1
timeout -s INT -k 20 "$record_s" python3 bench/record_replay.py --backend pycuda \
    --repetitions 10 --timeout 30 --cache-dir "$cache" \
    --family mma_f16 --family decode_f16 --family mma_tf32 \
    --shape 4x16x4096x128:bf16 --shape 2x32/8x4096x128c:bf16 \
    --shape 1x16x1000x128:bf16 --shape 8x32x1024x64:bf16 \
    --shape 16x32/8x1:8192x128:bf16 --shape 1x32/8x1:32768x128:bf16 \
    --shape 64x32/8x1:2048x128:bf16 --shape 16x32/1x1:8192x128:bf16 \
    --shape 4x32/8x1:5000x128:bf16 \
    --shape 1x16x1000x128:fp32 --shape 1x1x4096x128:fp32 \
    --shape 2x16/4x2048x128c:fp32 --shape 4x16x4096x128:fp32 \
    --shape 1x16x1000x128:tf32 --shape 1x1x4096x128:tf32 \
    --shape 2x16/4x2048x128c:tf32 --shape 4x16x4096x128:tf32 \
    --out "$out/recordings.json" >> "$out/record.log" 2>&1
echo "recorder exit $? after $((SECONDS - began)) s" >> "$out/record.log"
left=$((script_s - (SECONDS - began)))
if [ "$left" -ge 95 ]; then
    timeout -s INT -k 10 $((left - 5)) python3 bench/evidence_f16.py --out "$out/evidence_f16.json" \
        --work-dir /tmp/ev16 --shapes 4x16x4096x128:bf16 --tune-timeout-s 75 \
        > "$out/evidence_f16.log" 2>&1
    echo "evidence exit $? after $((SECONDS - began)) s" >> "$out/evidence_f16.log"
    cp /tmp/ev16/*/tune.log "$out/tune.log" 2>/dev/null
fi
