#!/usr/bin/env bash
# guidellm and aiperf, unchanged and in their defaults, against `serve run` of a checkpoint:
# each runs a short benchmark; rayinfer's completion-token counter (GET /metrics on the API
# port) before and after each says how many tokens the server generated for it.
#
#   python -m loadtest.make_checkpoint /tmp/tiny-ckpt --arch tiny
#   bench/real_clients.sh /tmp/tiny-ckpt /work/.venvs OUTDIR
#
# Each client lives in its own virtual environment under VENVS (guidellm/, aiperf/).
set -euo pipefail
CKPT=$(realpath "$1"); VENVS=$2; OUT=$(realpath -m "$3"); PORT=8012
mkdir -p "$OUT"
cat > "$OUT/serve.yaml" <<EOF
http_options: {host: 127.0.0.1, port: $PORT}
applications:
  - name: rayinfer
    route_prefix: /
    import_path: deployments.app:build_app
    args:
      model: $CKPT
      served_model_name: tiny
      weights: pretrained
      dtype: float32
      engine: {max_num_seqs: 16, max_num_batched_tokens: 512, num_kv_blocks: 256}
EOF
HF_HUB_OFFLINE=1 serve run --address local "$OUT/serve.yaml" > "$OUT/serve.log" 2>&1 &
SERVE=$!
trap 'kill -INT $SERVE; wait $SERVE || true' EXIT
for _ in $(seq 240); do curl -sf "127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done

completion_tokens() {
  curl -s "127.0.0.1:$PORT/metrics" | awk '/^ray_rayinfer_completion_tokens_total/ {s += $NF} END {print s + 0}'
}
settle() { sleep 15; }  # Ray exports each replica's metrics every 10 s by default

before=$(completion_tokens)
HF_HUB_OFFLINE=1 "$VENVS/guidellm/bin/guidellm" run \
  --backend kind=openai_http,target=http://127.0.0.1:$PORT \
  --profile kind=synchronous --constraint kind=max_requests,count=8 \
  --data kind=synthetic_text,prompt_tokens=32,output_tokens=16 \
  --tokenizer kind=hf_auto,model="$CKPT" \
  --output kind=json,path="$OUT/guidellm.json" --disable-progress > "$OUT/guidellm.log" 2>&1
settle; after=$(completion_tokens)
echo "guidellm: server completion tokens $((after - before))"

before=$after
# No HF_HUB_OFFLINE here: aiperf 0.13 offline resolves even a local path as a hub snapshot.
"$VENVS/aiperf/bin/aiperf" profile -m tiny -u http://127.0.0.1:$PORT \
  --endpoint-type completions --tokenizer "$CKPT" --request-count 8 --concurrency 2 \
  --isl 32 --osl 16 --artifact-dir "$OUT/aiperf" > "$OUT/aiperf.log" 2>&1
settle; after=$(completion_tokens)
echo "aiperf: server completion tokens $((after - before))"
