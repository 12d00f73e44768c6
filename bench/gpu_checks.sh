#!/usr/bin/env bash
# Everything reinforge checks on a lent GPU, in one call of a few minutes (the device time is short), most wanted
# first:
#   0. bench/gpu_grpo_recipe.py: configs/grpo_gsm8k.yaml (the README's one-GPU recipe) run as `reinforge grpo` for 3
#      steps on Qwen2.5-1.5B's architecture (random, the demo vocabulary: the machine reaches no hub), the HF engine
#      and the torch backend on the GPU (training.device / generation.device = auto): its `devices:` line, step
#      time, tokens/s and peak memory; again without torch.compile if the compiled run fails. With vLLM in the image
#      also generation.backend=vllm (colocated, sleep mode);
#   1. tests/unit/test_fsdp2_cuda.py and test_memory.py: FSDP2 over NCCL on the GPU against the CPU
#      backend (fp32 to 1e-5, eager and compiled; bf16 within its rounding; packed = padded) and the GPU
#      peak-memory metric;
#   2. bench/moe_replay.py on the MoE demo (models/moe_demo) in bfloat16: router replay off and on with the HF
#      engine, and with vLLM where the image has it (vLLM records routes on a GPU only: Model Runner V2);
#   3. where the image has vLLM: tests/e2e/test_refit_verify_vllm.py (the refit verification against vLLM's GPU
#      parameters), tests/e2e/test_in_flight_engine.py (weights updated between two decoding steps) and
#      bench/refit_gpu.py (the refit's wire into a 1.5B bf16 engine on the GPU: seconds, GB/s, the sampled check;
#      must pass the check every time and take <= 5 s);
#   --- `gpu_checks.sh quick` stops here ---
#   4. bench/gpu_training_mfu.py on the 1.5B Qwen2.5-architecture model: compiled layers (with a kernel
#      profile), eager; bench/lora_memory.py: full fine-tuning against LoRA rank 16;
#   5. bench/pipeline_mfu.py: one long-context run (4 sequences of 32K tokens, checkpointed) and, on 2+ GPUs, the
#      1.5B at pp=1 and pp=2 (one GPU per stage), each at the largest micro-batch the planner fits: MFU, peak
#      against the planner, the runtime term apart (CUDA context and NCCL, the allocator's slack);
#   6. on a machine of 4+ GPUs, bench/parallel_layouts.py: per-step time and MFU of dp, tp, cp and dp x tp (NCCL).
# Results go to $OUT (default /tmp/gpu_checks). The GPU image has torch and transformers but not all of
# reinforge's light dependencies: put their wheels in .whl/ and they are installed to /tmp/site first.
# For a Python 3.12 image, on a machine with PyPI (`pip wheel --no-deps -w .whl langdetect==1.0.9` for the last):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
#     typing-inspection typing-extensions math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
set -uo pipefail
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout 300 python3 bench/gpu_grpo_recipe.py --json "$OUT/grpo_recipe.json" >"$OUT/grpo_recipe.log" 2>&1 || {
  echo "grpo_gsm8k.yaml compiled: failed, see grpo_recipe.log; again without torch.compile"
  timeout 200 python3 bench/gpu_grpo_recipe.py --set training.compile=false --json "$OUT/grpo_recipe_eager.json" \
    >"$OUT/grpo_recipe_eager.log" 2>&1
}
tail -c 1500 "$OUT"/grpo_recipe*.log | grep -vE '^\s+"perf/gpu|^\s+\{|^\s+\},?$'
if python3 -c "import vllm" 2>/dev/null; then
  timeout 300 python3 bench/gpu_grpo_recipe.py --set generation.backend=vllm --json "$OUT/grpo_recipe_vllm.json" \
    >"$OUT/grpo_recipe_vllm.log" 2>&1
  tail -c 600 "$OUT/grpo_recipe_vllm.log"
fi
timeout 150 python3 -m pytest -q -p no:cacheprovider -rA -s tests/unit/test_fsdp2_cuda.py tests/unit/test_memory.py \
  >"$OUT/pytest.log" 2>&1
echo "pytest exit $?"; grep -E "logprobs|passed|failed|PASSED|FAILED|Error" "$OUT/pytest.log" | tail -15
timeout 120 python3 bench/moe_replay.py --engine hf --dtype bfloat16 --steps 4 --json "$OUT/moe_replay_hf.json" 2>&1 | tail -3
if python3 -c "import vllm" 2>/dev/null; then
  timeout 300 python3 bench/moe_replay.py --engine vllm --dtype bfloat16 --steps 4 --json "$OUT/moe_replay_vllm.json" 2>&1 | tail -3
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rA tests/e2e/test_refit_verify_vllm.py >"$OUT/refit_verify.log" 2>&1
  echo "refit verify exit $?"; grep -E "passed|failed|PASSED|FAILED" "$OUT/refit_verify.log" | tail -6
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rA tests/e2e/test_in_flight_engine.py >"$OUT/in_flight.log" 2>&1
  echo "in-flight engine exit $?"; grep -E "passed|failed|PASSED|FAILED" "$OUT/in_flight.log" | tail -6
  timeout 300 python3 bench/refit_gpu.py --json "$OUT/refit_gpu.json" >"$OUT/refit_gpu.log" 2>&1
  echo "refit wire exit $?"; tail -c 600 "$OUT/refit_gpu.log"
else
  echo "vLLM checks: no vllm in this image, skipped"
fi
[ "${1:-all}" = quick ] && exit 0  # `gpu_checks.sh quick`: without the benchmarks below
timeout 240 python3 bench/gpu_training_mfu.py --compile --profile --json "$OUT/mfu_compiled.json" 2>&1 | grep -v Loading >"$OUT/mfu_compiled.log"
tail -20 "$OUT/mfu_compiled.log"
timeout 120 python3 bench/gpu_training_mfu.py --profile --json "$OUT/mfu_packed.json" 2>&1 | grep -v Loading >"$OUT/mfu_packed.log"
tail -20 "$OUT/mfu_packed.log"
timeout 240 python3 bench/lora_memory.py --model qwen1.5b --json "$OUT/lora_memory.json" 2>&1 | grep -v Loading >"$OUT/lora_memory.log"
tail -8 "$OUT/lora_memory.log"
timeout 120 python3 bench/gpu_training_mfu.py --activation-checkpointing --json "$OUT/mfu_ac.json" 2>&1 | grep -v Loading | tail -25
timeout 120 python3 bench/gpu_training_mfu.py --no-packing --json "$OUT/mfu_unpacked.json" 2>&1 | grep -v Loading | tail -25
# A long context on one GPU (~1.5 minutes); pipeline stages at their largest fitting batch where there are 2+ GPUs
# (NCCL gives each stage a GPU: on one GPU pp=1 alone would repeat mfu_packed above).
timeout 100 python3 bench/pipeline_mfu.py --pp 1 --long-context --steps 2 --json "$OUT/long_context.json" 2>&1 \
  | grep -v Loading | tail -14
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  for pp in 1 2; do
    timeout 120 python3 bench/pipeline_mfu.py --pp $pp --json "$OUT/pipeline_pp$pp.json" 2>&1 | grep -v Loading | tail -16
  done
else
  echo "pipeline pp=1 vs pp=2: 1 GPU; pp=2 needs one GPU per stage, skipped"
fi
# Tensor and context parallelism over NCCL (training/parallel/tensor.py, training/parallel/context.py) need 2+ GPUs: one rank each.
if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
  timeout 300 python3 bench/parallel_layouts.py --hidden 2048 --layers 8 --peak-tflops 989 --json "$OUT/parallel_layouts.json" \
    2>&1 | grep -v Loading | tail -8
else
  echo "parallel layouts: $(nvidia-smi -L | wc -l) GPU(s); tp, cp and dp x tp need one GPU per rank (4), skipped"
fi
