#!/usr/bin/env bash
# GPU check of the VQ CUDA kernels (docs/cuda.md), sized for 10 minutes on a fresh H200 machine without network.
#
#   tools/gpu_check.sh pack [VQ_FILE]   here, after `python -m native.build`: writes .gpu/ (ignored by git, at most
#                                       64 MiB with the repo): the patched llama.cpp tree without what the build
#                                       does not need, the default model's 2-bit VQ file, a slice of the eval text
#   tools/gpu_check.sh run              on the GPU machine, in the repo root with .gpu/ carried: builds the CUDA
#                                       backend (sm_90, only the needed targets), then
#     1. kernels: test-vq-matmul --backend CUDA0 on random weights in every VQ configuration (1..9, 16, 33, 512
#        tokens: the decode-and-dot kernel and the F16 + cuBLAS path) and on the VQ file's tensors (1, 7, 8, 9, 512)
#     2. perplexity of the VQ file on the slice: all layers on the GPU, half of them, and the CPU alone must agree
#     3. llama-bench pp512 / tg128 with -ngl 99 for the VQ presets (3bit and 4bit: the 2bit file plus a synthetic
#        residual codebook, same geometry and speed), Q2_K, IQ2_XXS and Q4_K_M (quantized there from the VQ file
#        decoded to F16: their speed does not depend on the values)
#   Results in $OUT (or .gpu/out): gpu_check.md, the logs; the last line says how many checks passed and failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PAYLOAD=.gpu
PPL_CHUNKS=10
PPL_REL_TOL=0.01   # |ppl - ppl_cpu| / ppl_cpu: F16 weights in the prompt path, other kernels' own rounding

pack() {
    local home=${VQ_GGUF_HOME:-$HOME/.cache/vq-gguf}
    local vq=${1:-$home/out/SmolLM2-135M-Instruct.vq-2bit.gguf}
    local eval=../shared/data/eval/wikitext-2-raw-test.txt
    [ -f "$home/llama.cpp/.vq-stamp" ] || { echo "no patched tree in $home: run python -m native.build"; exit 1; }
    [ -f "$vq" ] || { echo "no VQ file $vq: vq-gguf quantize --preset 2bit"; exit 1; }
    python3 -m native.build --no-runtime >/dev/null   # the tree holds the current patch and own files
    mkdir -p $PAYLOAD   # ignored by .gitignore: it travels as `carry`
    tar -C "$home/llama.cpp" -cf - --exclude=./docs --exclude=./models --exclude=./media --exclude=./tests \
        --exclude=./benches --exclude=./examples --exclude=./tools/ui --exclude=./tools/server --exclude=./gguf-py \
        --exclude=./conversion --exclude=./.vq-stamp --exclude='./ggml/src/ggml-metal' --exclude='./ggml/src/ggml-sycl' \
        --exclude='./ggml/src/ggml-vulkan' --exclude='./ggml/src/ggml-opencl' --exclude='./ggml/src/ggml-hexagon' \
        --exclude='./ggml/src/ggml-et' --exclude='./ggml/src/ggml-cann' --exclude='./ggml/src/ggml-webgpu' \
        --exclude='./ggml/src/ggml-zdnn' . | xz -6 > $PAYLOAD/llama.cpp.tar.xz
    cp "$vq" $PAYLOAD/vq-2bit.gguf
    head -c 120000 "$eval" > $PAYLOAD/eval.txt   # ~28k tokens: more than PPL_CHUNKS x 512
    du -ch $PAYLOAD/* | tail -1
    echo "carry $PAYLOAD to the GPU machine and run: bash tools/gpu_check.sh run"
}

run() {
    local out=${OUT:-$PAYLOAD/out}
    local work=/tmp/vq-gpu-check
    mkdir -p "$out" $work
    export VQ_GGUF_HOME=$work
    local log=$out/gpu_check.log report=$out/gpu_check.md passed=0 failed=0
    exec > >(tee -a "$log") 2>&1
    check() { # check LOG CMD...: runs CMD with its output in LOG, counts and prints PASS or FAIL (with the log's end)
        local to=$1; shift
        if "$@" > "$to" 2>&1; then passed=$((passed + 1)); echo "PASS $*"; else failed=$((failed + 1)); echo "FAIL $*"; tail -20 "$to"; fi
    }
    step() { echo "== $(date +%T) $*"; }

    step "machine"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    nvcc --version | tail -1 || true

    step "build (CUDA backend for sm_90, no flash-attention kernels)"
    rm -rf $work/llama.cpp && mkdir -p $work/llama.cpp && xz -dc $PAYLOAD/llama.cpp.tar.xz | tar -C $work/llama.cpp -xf -
    local defines=(--define GGML_CUDA_FA:BOOL=OFF)
    # without a libcuda.so to link (driver stubs), use ggml's pool that needs no driver API
    if ! ldconfig -p | grep -q 'libcuda.so ' && ! ls /usr/local/cuda/lib64/stubs/libcuda.so >/dev/null 2>&1; then
        defines+=(--define GGML_CUDA_NO_VMM:BOOL=ON)
    fi
    local t0=$SECONDS
    python3 -m native.build --tree $work/llama.cpp --cuda --cuda-arch 90 --no-runtime -j "$(nproc)" "${defines[@]}" \
        > $out/build.log 2>&1 || { tail -40 $out/build.log; echo "0 passed, 1 failed"; exit 1; }
    echo "built in $((SECONDS - t0)) s"
    local bin=$work/build/bin vq=$PAYLOAD/vq-2bit.gguf

    step "1. kernels against the C reference decoder"
    check $out/kernels-random.log "$bin/test-vq-matmul" --backend CUDA0 random 7
    tail -1 $out/kernels-random.log
    check $out/kernels-file.log "$bin/test-vq-matmul" --backend CUDA0 file $vq 14
    tail -1 $out/kernels-file.log

    step "2. perplexity on the slice ($PPL_CHUNKS chunks of 512)"
    ppl() { # args: label, then llama-perplexity options; prints the final estimate
        "$bin/llama-perplexity" -m $vq -f $PAYLOAD/eval.txt -c 512 -b 512 --chunks $PPL_CHUNKS -t "$(nproc)" "${@:2}" \
            > "$out/ppl-$1.log" 2>&1
        grep -o 'Final estimate: PPL = [0-9.]*' "$out/ppl-$1.log" | awk '{print $5}'
    }
    local p_cpu p_gpu p_half
    p_cpu=$(CUDA_VISIBLE_DEVICES= ppl cpu -ngl 0)
    p_gpu=$(ppl gpu -ngl 99)
    p_half=$(ppl half -ngl 15)   # partial offload: codebooks travel with their weights (and op offload of CPU layers)
    echo "PPL cpu $p_cpu, gpu $p_gpu, 15 layers on the gpu $p_half"
    close() { python3 -c "import sys; a, b = map(float, sys.argv[1:]); sys.exit(not abs(a - b) <= $PPL_REL_TOL * b)" "$1" "$2"; }
    check /dev/null close "${p_gpu:-nan}" "${p_cpu:-0}"
    check /dev/null close "${p_half:-nan}" "${p_cpu:-0}"

    step "3. llama-bench, all layers on the GPU"
    "$bin/test-vq-matmul" decode $vq $work/f16.gguf > $out/decode.log 2>&1
    "$bin/test-vq-matmul" residual $vq $work/vq-3bit.gguf 16 > $out/residual.log 2>&1
    "$bin/test-vq-matmul" residual $vq $work/vq-4bit.gguf 256 >> $out/residual.log 2>&1
    "$bin/llama-imatrix" -m $work/f16.gguf -f $PAYLOAD/eval.txt -c 512 --chunks 20 -ngl 99 -o $work/imatrix.gguf \
        > $out/imatrix.log 2>&1
    local models=(-m $vq -m $work/vq-3bit.gguf -m $work/vq-4bit.gguf)
    for q in Q2_K IQ2_XXS Q4_K_M; do
        "$bin/llama-quantize" --allow-requantize --imatrix $work/imatrix.gguf --token-embedding-type q8_0 \
            --output-tensor-type q8_0 $work/f16.gguf $work/$q.gguf $q "$(nproc)" > $out/quantize-$q.log 2>&1 \
            && models+=(-m $work/$q.gguf)
    done
    check $out/bench.log "$bin/llama-bench" "${models[@]}" -ngl 99 -p 512 -n 128 -r 5 -o md
    grep '^|' $out/bench.log > $out/bench.md
    cat $out/bench.md

    {
        echo "# GPU check $(date -u '+%F %T') UTC"
        echo
        echo "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null), $(nvcc --version | tail -1)"
        echo
        echo "Perplexity ($PPL_CHUNKS chunks of 512, $vq): CPU $p_cpu, all layers on the GPU $p_gpu, 15 layers $p_half"
        echo
        echo "Files: $vq (2bit), vq-3bit / vq-4bit (2bit + synthetic residual 16 / 256), Q2_K / IQ2_XXS / Q4_K_M"
        echo "quantized from the VQ file decoded to F16 (imatrix: 20 chunks of the slice), token embedding and output Q8_0."
        echo
        cat $out/bench.md
        echo
        tail -1 $out/kernels-random.log
        tail -1 $out/kernels-file.log
    } > "$report"
    echo "$passed passed, $failed failed"
    [ "$failed" = 0 ]
}

case "${1:-}" in
    pack) shift; pack "$@" ;;
    run) run ;;
    *) sed -n 2,20p "$0"; exit 2 ;;
esac
