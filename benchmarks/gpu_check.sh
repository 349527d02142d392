#!/usr/bin/env bash
# The GPU check, as ONE call on a lent NVIDIA GPU (made for an H200):
#   (1) the compiled Pallas ragged kernel vs the jnp reference and a float64 oracle;
#   (2) decode-attention HBM bandwidth as a fraction of the H200 datasheet's 4.8 TB/s;
#   (3) engine tok/s on a random 1B-class Llama (Llama-3.2-1B's shape, bf16) through the CLI;
#   (4) the step's time against the KV page pool, the Pallas kernel compiled (it should not
#       grow: no cache copies; the last line of each log reads `pages 64 -> 4096: X.XXx`).
# Results: $OUT/gpu_check.md (+ gpu_check.json, logs, engine_summary.json). Each part is
# guarded: one failing still lets the others report. With no GPU it says so and exits 0.
#
# The lent machine reaches no package registry. Its image has JAX with CUDA, flax, optax,
# numpy, safetensors, tokenizers, tqdm, matplotlib and pytest, but not Hydra, which the
# `cbjax` CLI needs for (3). Before the device call, on the host, once:
#     bash benchmarks/gpu_check.sh --fetch-wheels     # pure-Python wheels into .whl/ (git-ignored)
# then run `bash benchmarks/gpu_check.sh` there with `.whl` carried. Elsewhere (a GPU box with
# a registry) the script installs what is missing with pip instead.
# Knobs: GPU_CHECK_ENGINE_TIMEOUT_S (default 210), GPU_CHECK_ENGINE_ARGS (extra overrides).
# Parts are capped at 200 + 90 + 2 x 45 + 210 s so the whole call ends inside the device's 10-minute
# command limit (give the call timeout_s 600).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p .whl
    exclude="$(git rev-parse --git-path info/exclude)"  # a worktree's .git is a file
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    # antlr4-python3-runtime 4.9.3 (omegaconf's pin) is published as a source archive only: build its wheel.
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "hydra-core==1.3.2" "omegaconf==2.3.0" &&
        "$PY" -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==4.9.3" &&
        ls .whl
    exit
fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU available (nvidia-smi finds none); no device, nothing run."
    exit 0
fi

OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/nvidia-smi.txt"

# Dependencies: carried wheels first, then the working tree itself on the path.
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site .whl/*.whl &&
        export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
    # Not ".[test]": its CPU torch pin would replace a CUDA torch.
    echo "gpu_check: JAX sees no GPU; trying pip install -e . 'jax[cuda12]' (needs a registry)"
    "$PY" -m pip install -q -e . "jax[cuda12]" || echo "gpu_check: pip install failed"
elif ! "$PY" -c 'import hydra, omegaconf' 2>/dev/null; then
    echo "gpu_check: no Hydra here (see --fetch-wheels); trying pip install hydra-core (needs a registry)"
    "$PY" -m pip install -q "hydra-core>=1.3" || echo "gpu_check: no Hydra: part (3) will fail"
fi
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tee -a "$OUT/nvidia-smi.txt"

# (1) and (2): one process. Then the compiled kernel tests, then (3) in fresh processes
# (JAX preallocates most of the GPU's memory per process).
timeout 200 "$PY" benchmarks/gpu_check.py kernel --out "$OUT" 2>&1 | tee "$OUT/kernel.log"
timeout 90 "$PY" -m pytest tests/test_pallas_ragged.py -k compiled -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
# (4): the tiny model and SmolLM-135M's shape (2 layers), compiled Pallas, 64 and 4096 pages
timeout 45 "$PY" benchmarks/step_vs_pages.py --attention pallas --rounds 30 2>&1 | tee "$OUT/step_vs_pages.log"
timeout 45 "$PY" benchmarks/step_vs_pages.py --attention pallas --rounds 30 --smollm 2>&1 |
    tee "$OUT/step_vs_pages_smollm.log"

ENGINE_ARGS=(
    executor=jax hardware=h200 progress=false seed=0
    model=tiny model.name=llama-1b-random model.vocab_size=128256 model.d_model=2048 model.num_layers=16
    model.num_heads=32 model.num_kv_heads=8 model.head_dim=64 model.ffn_dim=8192 model.rope_theta=500000.0
    model.max_model_len=4096 model.tie_embeddings=true model.dtype=bfloat16
    scheduler.max_num_seqs=64 cache.num_pages=8192
    workload.num_requests=256 workload.prompt_len.high=512 workload.output_len.max=512
)
# shellcheck disable=SC2206  # word splitting of the extra overrides is intended
ENGINE_ARGS+=(${GPU_CHECK_ENGINE_ARGS:-})
ENGINE_DIR=/tmp/gpu_check_engine
rm -rf "$ENGINE_DIR"
timeout "${GPU_CHECK_ENGINE_TIMEOUT_S:-210}" "$PY" -m cbjax "${ENGINE_ARGS[@]}" hydra.run.dir="$ENGINE_DIR" \
    >"$OUT/engine.log" 2>&1
echo "gpu_check: engine exit status $?" | tee -a "$OUT/engine.log"
tail -n 30 "$OUT/engine.log"
cp "$ENGINE_DIR/summary.json" "$OUT/engine_summary.json" 2>/dev/null
"$PY" benchmarks/gpu_check.py engine --out "$OUT" --summary "$OUT/engine_summary.json" --overrides "${ENGINE_ARGS[@]}"
echo "gpu_check: results in $OUT/gpu_check.md"
exit 0
