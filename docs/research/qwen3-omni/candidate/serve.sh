#!/bin/bash
# usage: serve.sh OVERLAY PORT LOG [extra env...]
OV=$1; PORT=$2; LOG=$3; shift 3
exec env "$@" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 \
  VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_ENABLE_V1_MULTIPROCESSING=0 \
  nice -n 10 /work/main/.venv-vllm-omni/bin/python -m vllm.entrypoints.cli.main serve /tmp/omni-cand/tiny-omni --omni \
  --deploy-config $OV --host 127.0.0.1 --port $PORT --stage-init-timeout 900 > $LOG 2>&1
