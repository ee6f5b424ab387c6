#!/usr/bin/env bash
# GPU check of the VQ CUDA kernels (docs/cuda.md), sized for 10 minutes on a fresh H200 machine without network.
#
#   tools/gpu_check.sh pack [VQ_FILE]   here, after `python -m vq_gguf.native.build`: writes .gpu/ (ignored by git, at most
#                                       64 MiB with the repo): the patched llama.cpp tree without what the build
#                                       does not need, the default model's 2-bit VQ file (default: the one `vq-gguf
#                                       compare` made), a slice of the eval text; prints the file's CPU perplexity
#   tools/gpu_check.sh run              on the GPU machine, in the repo root with .gpu/ carried: builds the CUDA
#                                       backend (sm_90, only the needed targets), then
#     1. kernels: test-vq-matmul --backend CUDA0 on random weights in every VQ configuration (1..9, 16, 33, 512
#        tokens: the decode-and-dot kernel and the F16 + cuBLAS path) and on the VQ file's tensors (1, 7, 8, 9, 512)
#     2. perplexity of the VQ file on the slice: all layers on the GPU, half of them, and the CPU alone must agree
#     3. llama-bench pp512 / tg128 with -ngl 99 for the VQ presets (3bit and 4bit: the 2bit file plus a synthetic
#        residual codebook, same geometry and speed), Q2_K, IQ2_XXS and Q4_K_M (quantized there from the VQ file
#        decoded to F16: their speed does not depend on the values)
#     4. tuning: tg128 of the VQ files for each GGML_VQ_CUDA_SPLIT (warps per vector row of the one-token kernel)
#     5. (not in the default steps: GPU_CHECK_STEPS=5, a call of its own on the warm machine) Llama-3-8B's shapes:
#        `tools/bench.py --shape llama3-8b --blocks $SYN_BLOCKS --ngl 99`, a synthetic model (random weights, written
#        there), the presets' layouts with random codes, llama.cpp's types quantized from it, llama-bench of each
#        with the GPU's bandwidth fraction. Presets with a tail (v6, v3 at these widths) stay on the CPU: not run.
#     6. (not in the default steps: GPU_CHECK_STEPS=6, a call of its own) the quantizer on the GPU: `tools/quant_cost.py
#        --shapes llama3-8b --device cuda` (one Llama-3-8B block's cost at the 2bit preset: each linear by VPTQ,
#        the Hessian and forward products; GPU peak memory) and `--agree cuda` (one weight on the CPU with two
#        seeds and on the GPU: relative proxy losses and the codes in common)
#   Results in $OUT (or .gpu/out): gpu_check.md, gpu_check.log (the console) and logs.tar.gz; the last line says how
#   many checks passed and failed. A second run on the same machine reuses the build (ninja).
#
#   Fine-tuning on the GPU while the check runs (the device tool carries 64 MiB a call, so in two calls):
#   tools/gpu_check.sh pack-finetune TEACHER   here: .gpu-ft/ with the teacher states (`vq-gguf teacher --windows 96`,
#                                       59 MB: the default 320 windows do not fit a call) and
#                                       the gguf wheel (the GPU machine has torch but not gguf)
#   tools/gpu_check.sh start            GPU machine, call 1 (.gpu carried): `run` in the background, returns at once
#   tools/gpu_check.sh finetune         GPU machine, call 2 (.gpu-ft carried, .gpu still there from call 1):
#                                       `vq-gguf finetune` of .gpu/vq-2bit.gguf for each "LR STEPS" in $FT_RUNS, side
#                                       by side, checkpoints to $OUT (turn them into files here with the same
#                                       command and --checkpoint); then waits for the check and copies its results
set -uo pipefail
cd "$(dirname "$0")/.."
PAYLOAD=.gpu
PPL_CHUNKS=10
PPL_REL_TOL=0.01   # |ppl - ppl_cpu| / ppl_cpu: F16 weights in the prompt path, other kernels' own rounding

pack() {
    local home=${VQ_GGUF_HOME:-$HOME/.cache/vq-gguf}
    local vq=${1:-$home/compare/SmolLM2-135M-Instruct/vq-2bit.gguf}
    local eval=vq_export/data/eval/wikitext-2-raw-test.txt
    [ -f "$home/llama.cpp/.vq-stamp" ] || { echo "no patched tree in $home: run python -m vq_gguf.native.build"; exit 1; }
    [ -f "$vq" ] || { echo "no VQ file $vq: vq-gguf compare (or give one)"; exit 1; }
    python3 -c "from vq_gguf.native import build; build.prepare_tree(build.fetch_sdist())"   # current patch and own files
    mkdir -p $PAYLOAD   # ignored by .gitignore: it travels as `carry`
    tar -C "$home/llama.cpp" -cf - --exclude=./docs --exclude=./models --exclude=./media --exclude=./tests \
        --exclude=./benches --exclude=./examples --exclude=./tools/ui --exclude=./tools/server --exclude=./gguf-py \
        --exclude=./conversion --exclude=./.vq-stamp --exclude='./ggml/src/ggml-metal' --exclude='./ggml/src/ggml-sycl' \
        --exclude='./ggml/src/ggml-vulkan' --exclude='./ggml/src/ggml-opencl' --exclude='./ggml/src/ggml-hexagon' \
        --exclude='./ggml/src/ggml-et' --exclude='./ggml/src/ggml-cann' --exclude='./ggml/src/ggml-webgpu' \
        --exclude='./ggml/src/ggml-zdnn' . | xz -6 > $PAYLOAD/llama.cpp.tar.xz
    cp "$vq" $PAYLOAD/vq-2bit.gguf
    python3 -m vq_gguf.tools.synthetic_model --tokenizer-only --out $PAYLOAD/tokenizer.gguf   # step 5's model's
    gguf_wheel $PAYLOAD
    head -c 120000 "$eval" > $PAYLOAD/eval.txt   # ~28k tokens: more than PPL_CHUNKS x 512
    "$home/build/bin/llama-perplexity" -m $PAYLOAD/vq-2bit.gguf -f $PAYLOAD/eval.txt -c 512 -b 512 --chunks 2 2>&1 |
        grep -o 'Final estimate: PPL = [0-9.]*' | sed 's/^/CPU, 2 chunks: /'   # a broken file would pass the check too
    du -ch $PAYLOAD/* | tail -1
    echo "carry $PAYLOAD to the GPU machine and run: bash tools/gpu_check.sh run"
}

gguf_wheel() {  # the gguf package as a wheel in folder $1 (the GPU machine has torch and numpy but not gguf)
    rm -f "$1"/gguf-*.whl
    python3 -m pip download -q --no-deps -d "$1" "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"
}

install_gguf() {  # gguf from the wheel in folder $1 onto PYTHONPATH, unless importable
    python3 -c "import gguf" 2>/dev/null && return
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$1"/gguf-*.whl || return 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

link_package() {  # vq_gguf importable without pip (the GPU machine reaches no index): a tree of links to the checkout,
                  # laid out as the installed package is (pyproject.toml's package-dir)
    local site=/tmp/vq-site
    rm -rf $site && mkdir -p $site/vq_gguf
    ln -s "$PWD"/vq_export/* $site/vq_gguf/ && ln -s "$PWD"/native "$PWD"/runtime "$PWD"/tools $site/vq_gguf/
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
}

run() {
    local out=${OUT:-$PAYLOAD/out}   # the device tool returns at most 8 files from $OUT
    local work=/tmp/vq-gpu-check
    local logs=$work/logs
    rm -rf $logs && mkdir -p "$out" $logs
    export VQ_GGUF_HOME=$work
    link_package
    install_gguf $PAYLOAD || echo "gguf not installed: step 5 will fail"
    local report=$out/gpu_check.md passed=0 failed=0
    exec > >(tee "$out/gpu_check.log") 2>&1
    check() { # check LOG CMD...: runs CMD with its output in LOG, counts and prints PASS or FAIL (with the log's end)
        local to=$1; shift
        if "$@" > "$to" 2>&1; then passed=$((passed + 1)); echo "PASS $*"; else failed=$((failed + 1)); echo "FAIL $*"; tail -20 "$to"; fi
    }
    step() { echo "== $(date +%T) $*"; }

    step "machine"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    nvcc --version | tail -1 || true

    step "build (CUDA backend for sm_90, no flash-attention kernels)"
    local sha; sha=$(sha256sum $PAYLOAD/llama.cpp.tar.xz | cut -c1-64)
    if [ "$(cat $work/llama.cpp/.payload 2>/dev/null)" != "$sha" ]; then
        rm -rf $work/llama.cpp && mkdir -p $work/llama.cpp && xz -dc $PAYLOAD/llama.cpp.tar.xz | tar -C $work/llama.cpp -xf -
        echo "$sha" > $work/llama.cpp/.payload
    fi
    local defines=(--define GGML_CUDA_FA:BOOL=OFF)
    # without a libcuda.so to link (driver stubs), use ggml's pool that needs no driver API
    if ! ldconfig -p | grep -q 'libcuda.so ' && ! ls /usr/local/cuda/lib64/stubs/libcuda.so >/dev/null 2>&1; then
        defines+=(--define GGML_CUDA_NO_VMM:BOOL=ON)
    fi
    local t0=$SECONDS
    python3 -m vq_gguf.native.build --tree $work/llama.cpp --cuda --cuda-arch 90 --no-runtime -j "$(nproc)" "${defines[@]}" \
        > $logs/build.log 2>&1 || { tail -40 $logs/build.log; cp $logs/build.log "$out/"; echo "0 passed, 1 failed"; exit 1; }
    echo "built in $((SECONDS - t0)) s"
    local bin=$work/build/bin vq=$PAYLOAD/vq-2bit.gguf

    want() { [[ " ${GPU_CHECK_STEPS:-1 2 3 4} " == *" $1 "* ]]; }   # GPU_CHECK_STEPS="2 3": a rerun after a fix
    local p_cpu p_gpu p_half
    if want 1; then
    step "1. kernels against the C reference decoder"
    check $logs/kernels-random.log "$bin/test-vq-matmul" --backend CUDA0 random 7
    tail -1 $logs/kernels-random.log
    for s in 1 2; do   # the other splits of a vector row over warps than the one the rows' length picks
        check $logs/kernels-split$s.log env GGML_VQ_CUDA_SPLIT=$s "$bin/test-vq-matmul" --backend CUDA0 random 7 quick
        tail -1 $logs/kernels-split$s.log
    done
    check $logs/kernels-file.log "$bin/test-vq-matmul" --backend CUDA0 file $vq 14
    tail -1 $logs/kernels-file.log
    fi

    if want 2; then
    step "2. perplexity on the slice ($PPL_CHUNKS chunks of 512)"
    ppl() { # args: label, then llama-perplexity options; prints the final estimate
        "$bin/llama-perplexity" -m $vq -f $PAYLOAD/eval.txt -c 512 -b 512 --chunks $PPL_CHUNKS -t "$(nproc)" "${@:2}" \
            > "$logs/ppl-$1.log" 2>&1
        grep -o 'Final estimate: PPL = [0-9.]*' "$logs/ppl-$1.log" | awk '{print $5}'
    }
    p_cpu=$(CUDA_VISIBLE_DEVICES= ppl cpu -ngl 0)
    p_gpu=$(ppl gpu -ngl 99)
    p_half=$(ppl half -ngl 15)   # partial offload: codebooks travel with their weights (and op offload of CPU layers)
    echo "PPL cpu $p_cpu, gpu $p_gpu, 15 layers on the gpu $p_half"
    close() { python3 -c "import sys; a, b = map(float, sys.argv[1:]); sys.exit(not abs(a - b) <= $PPL_REL_TOL * b)" "$1" "$2"; }
    check /dev/null close "${p_gpu:-nan}" "${p_cpu:-0}"
    check /dev/null close "${p_half:-nan}" "${p_cpu:-0}"
    fi

    if want 3; then
    step "3. llama-bench, all layers on the GPU"
    "$bin/test-vq-matmul" decode $vq $work/f16.gguf > $logs/decode.log 2>&1
    "$bin/test-vq-matmul" residual $vq $work/vq-3bit.gguf 16 > $logs/residual.log 2>&1
    "$bin/test-vq-matmul" residual $vq $work/vq-4bit.gguf 256 >> $logs/residual.log 2>&1
    "$bin/llama-imatrix" -m $work/f16.gguf -f $PAYLOAD/eval.txt -c 512 --chunks 20 -ngl 99 -o $work/imatrix.gguf \
        > $logs/imatrix.log 2>&1
    local models=($vq $work/vq-3bit.gguf $work/vq-4bit.gguf) f
    for q in Q2_K IQ2_XXS Q4_K_M; do
        "$bin/llama-quantize" --allow-requantize --imatrix $work/imatrix.gguf --token-embedding-type q8_0 \
            --output-tensor-type q8_0 $work/f16.gguf $work/$q.gguf $q "$(nproc)" > $logs/quantize-$q.log 2>&1 \
            && models+=($work/$q.gguf)
    done
    bench() { "$bin/llama-bench" -m "$1" -ngl 99 -p 512 -n 128 -r 5 -o json > "$logs/bench-$(basename "$1" .gguf).json"; }
    for f in "${models[@]}"; do   # one run per file: a file that does not load loses only its own row
        check $logs/bench-$(basename "$f" .gguf).log bench "$f"
    done
    python3 - $logs/bench-*.json > $logs/bench.md <<'PY'
import json, os, sys
runs = []
for f in sys.argv[1:]:
    try:
        runs += json.load(open(f))
    except ValueError:   # the file did not load: its check failed above
        pass
ts = {}
for r in runs:
    name = os.path.basename(r["model_filename"]).removesuffix(".gguf")
    ts.setdefault(name, {})["pp512" if r["n_prompt"] else "tg128"] = (r["avg_ts"], r["stddev_ts"])
print("| file | pp512 t/s | tg128 t/s | tg128 / Q2_K | tg128 / IQ2_XXS |\n| --- | ---: | ---: | ---: | ---: |")
ref = {k: ts.get(k, {}).get("tg128", (float("nan"),))[0] for k in ("Q2_K", "IQ2_XXS")}
for name, t in ts.items():
    pp, tg = t.get("pp512", (float("nan"), 0)), t.get("tg128", (float("nan"), 0))
    print(f"| {name} | {pp[0]:.0f} ± {pp[1]:.0f} | {tg[0]:.1f} ± {tg[1]:.1f} | {tg[0] / ref['Q2_K']:.2f} | {tg[0] / ref['IQ2_XXS']:.2f} |")
vq = ts.get("vq-2bit", {}).get("tg128", (float("nan"),))[0]
met = vq >= ref["IQ2_XXS"] and vq >= 0.8 * ref["Q2_K"]
print(f"\nBar (2bit tg128 >= IQ2_XXS and >= 0.8 x Q2_K): {'met' if met else 'NOT met'}")
PY
    cat $logs/bench.md
    fi

    if want 4; then
    step "4. tuning: tg128 for each split of a vector row over warps (GGML_VQ_CUDA_SPLIT)"
    {
        echo "| file | default | 1 | 2 | 4 | 8 |"; echo "| --- | ---: | ---: | ---: | ---: | ---: |"
        for f in $vq $work/vq-3bit.gguf $work/vq-4bit.gguf; do
            [ -f "$f" ] || continue
            row="| $(basename "$f" .gguf)"
            for s in "" 1 2 4 8; do
                t=$(GGML_VQ_CUDA_SPLIT=$s "$bin/llama-bench" -m "$f" -ngl 99 -p 0 -n 128 -r 3 -o json 2>/dev/null |
                    python3 -c "import json, sys; r = json.load(sys.stdin)[0]; print(f\"{r['avg_ts']:.1f}\")")
                row="$row | ${t:-fail}"
            done
            echo "$row |"
        done
    } > $logs/split.md
    cat $logs/split.md
    fi

    if want 5; then
    step "5. Llama-3-8B's shapes, ${SYN_BLOCKS:-4} blocks of random weights: llama-bench, all layers on the GPU"
    check $logs/bench-8b.log python3 -m vq_gguf.tools.bench --shape llama3-8b --blocks "${SYN_BLOCKS:-4}" --ngl 99 \
        --tokenizer $PAYLOAD/tokenizer.gguf --threads "$(nproc)" --presets 2bit 3bit-shared 4bit \
        --llama-types IQ2_XXS Q2_K IQ4_XS Q4_K_M --no-ffn-down --imatrix-chunks 4 --reps 3 --md $logs/bench-8b.md
    cat $logs/bench-8b.md 2>/dev/null
    fi

    if want 6; then
    step "6. the quantizer on the GPU: a Llama-3-8B block at the 2bit preset, and one weight against the CPU"
    check $logs/quant-cost.log python3 -m vq_gguf.tools.quant_cost --shapes llama3-8b --preset 2bit --device cuda
    check $logs/quant-agree.log python3 -m vq_gguf.tools.quant_cost --agree cuda --preset 2bit
    { sed -n '/^| shape/,$p' $logs/quant-cost.log; echo; sed -n '/^| run/,$p' $logs/quant-agree.log; } > $logs/quant.md
    cat $logs/quant.md
    fi

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
        cat $logs/bench.md
        echo
        tail -1 $logs/kernels-random.log
        tail -1 $logs/kernels-file.log
        echo
        cat $logs/split.md 2>/dev/null
        echo
        cat $logs/bench-8b.md 2>/dev/null
        echo
        cat $logs/quant.md 2>/dev/null
    } > "$report"
    tar -czf "$out/logs.tar.gz" -C $work logs
    echo "$passed passed, $failed failed"
    [ "$failed" = 0 ]
}

pack_finetune() {
    local teacher=${1:?teacher .npz of vq-gguf teacher}
    mkdir -p .gpu-ft && rm -f .gpu-ft/*
    cp "$teacher" .gpu-ft/teacher.npz
    gguf_wheel .gpu-ft
    du -ch .gpu-ft/* | tail -1
}

CHECK_WORK=/tmp/vq-gpu-check
start() {
    mkdir -p $CHECK_WORK
    OUT=$CHECK_WORK/out setsid nohup bash "$0" run > $CHECK_WORK/console.log 2>&1 < /dev/null &
    echo $! > $CHECK_WORK/check.pid
    sleep 2; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; echo "check started (pid $(cat $CHECK_WORK/check.pid))"
}

finetune() {
    local out=${OUT:-.gpu-ft/out} deadline=$((SECONDS + ${FT_WAIT:-480}))
    mkdir -p "$out"
    [ -f $PAYLOAD/vq-2bit.gguf ] || { echo "no $PAYLOAD/vq-2bit.gguf: call 1 (start) did not run on this machine"; exit 1; }
    link_package
    install_gguf .gpu-ft || exit 1
    export PYTHONUNBUFFERED=1
    local pids=() lr steps
    while read -r lr steps; do
        timeout "${FT_SECONDS:-360}" python3 -c "from vq_gguf.cli import main; main()" finetune $PAYLOAD/vq-2bit.gguf \
            --teacher .gpu-ft/teacher.npz --out /tmp/ft-$lr.gguf --steps "$steps" --lr "$lr" --batch "${FT_BATCH:-8}" \
            --eval-every 100 --checkpoint "$out/ft-$lr.pt" > "$out/ft-$lr.log" 2>&1 &
        pids+=($!)
    done <<< "${FT_RUNS:-1e-4 1500}"
    for p in "${pids[@]}"; do wait "$p"; echo "fine-tuning exit $?"; done
    grep -h "held-out KL" "$out"/ft-*.log | tail -20
    while kill -0 "$(cat $CHECK_WORK/check.pid 2>/dev/null)" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 5; done
    cp $CHECK_WORK/out/* "$out/" 2>/dev/null; tail -30 $CHECK_WORK/console.log
}

case "${1:-}" in
    pack) shift; pack "$@" ;;
    pack-finetune) shift; pack_finetune "$@" ;;
    run) run ;;
    start) start ;;
    finetune) finetune ;;
    *) sed -n 2,30p "$0"; exit 2 ;;
esac
