# Call 1 on the GPU machine (carry .gpu/tools .gpu/part00): install the gguf wheel, keep the first model part and the
# benchmark files outside the repository copy (a later call that does not carry them removes them from it), report the
# software, and run scripts/train_gpu.sh on CUDA with a tiny target: a CUDA fault shows here, before the model is in.
# TINY=0 skips that run (up to 150 s): a 15-minute lease cannot spare it (docs/TRAINING.md "A 15-minute lease").
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/tools/gguf-*.whl
mkdir -p /root/data && cp .gpu/tools/*.jsonl /root/data/
bash scripts/lease/join.sh  # keeps part00
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
[ "${TINY:-1}" = 0 ] && { echo "tiny CUDA run skipped (TINY=0)"; exit 0; }
mkdir -p /root/tiny && for i in 0 1 2 3 4 5; do echo "{\"id\": $i, \"prompt\": \"w$i w$((i+2)) w$((i+5))\"}"; done \
  > /root/tiny/mine.jsonl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
DFLASH_DATA_DIR=/root/tiny DEVICE=cuda DTYPE=bfloat16 PY=python3 INPUTS=mine.jsonl SHAREGPT=0 SAMPLES=2 MAX_NEW=8 \
  BATCH=4 LAYERS=1 EPOCHS=1 ANCHORS=8 GRAD_ACCUM=2 SAVE_MINUTES=0.001 LOSS=kl KV_HEADS=4 \
  timeout 150 bash scripts/train_gpu.sh tiny-qwen3 /root/tiny/run > /root/tiny.log 2>&1
echo "tiny CUDA run: rc=$?"; tail -3 /root/tiny.log
