#!/usr/bin/env bash
# vLLM samples the rollouts and evaluations, the learner trains a LoRA adapter: the tiny model,
# a two-step run in about a minute on a CPU, in the venv .ci/vllm builds (vLLM's CPU build has
# its own torch and transformers pins). On a CUDA machine: pip install 'keelrl[vllm]' and drop
# rollout.eager=true (vLLM then compiles its model once, about a minute, and decodes faster).
#
#   bash .ci/vllm -k nothing        # builds .venv-vllm once (minutes), runs no test
#   bash examples/vllm_lora/train.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${KEEL_VLLM_VENV:-.venv-vllm}/bin
"$PY/keel" model fetch tiny >/dev/null
"$PY/keel" train model.path=tiny env.max_turns=2 warm_start.demos=8 warm_start.epochs=1 \
  rollout.tasks_per_step=2 rollout.group_size=2 rollout.max_new_tokens=16 train.steps=2 \
  eval.tasks=4 eval.every=2 eval.dtype=float32 \
  rollout.decoder=vllm rollout.eager=true \
  model.lora.rank=8 model.lora.alpha=16 optim.lr=2e-4 \
  run_dir=runs/vllm_lora "$@"
# runs/vllm_lora: metrics.jsonl logs mismatch/* (vLLM's log-probs against the learner's) and
# correction/* (algo.rollout_correction=token_tis, chosen because the decoder is vllm); the
# checkpoints' model/ folders hold the adapter alone.
echo "adapter: $(ls runs/vllm_lora/checkpoints/*/model/adapter_model.safetensors | tail -1)"
