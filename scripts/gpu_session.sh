#!/usr/bin/env bash
# One device call: GPU correctness (kernels at real sizes, graph runner, speculative decoding), then the kernel
# and whole-step benchmarks. Results land in $OUT (scripts/results/ when unset). Usage: bash scripts/gpu_session.sh [parts]
set -u
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  sed -n '2,3p;/^parts=/,/^# CPU-only/p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
export PYTHONPATH=$PWD
python -m pip install -q --no-deps .whl/*.whl 2>/dev/null; python -c "import fla.ops.gated_delta_rule" && echo "fla-core present"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
parts=${1:-tests,qmatmul,decode}  # or any of: qtest, qchosen (qmatmul without the sweep), qwide (launch-shape grids
# beyond the shipped lists), ncu (the matmuls' hardware counters), qsteps (decode, quantized weights only), full,
# runner (graph runner tests), lanes (bench_concurrency),
# profile, spec, sampled, kernels, norms or mixer (the norm or the conv/GDN launch shapes alone), host (per-token host
# time and prefill wall vs kernel time: profile_host.py), pqmm (prefill matmuls on quantized weights), pint8 (the
# int8 tensor-core prefill matmuls: their GPU tests, then bench_prefill_qmatmul.py --sweep), pattn
# (prefill attention over a long prefix), lattn (decode attention's launch shapes at 258K keys), round
# (profile_round.py), splitk (experiments/splitk_ticket.py), rgrid
# (experiments/rows_grid.py: the tiled matmuls at 16/32/64 rows with a grid of blocks over the rows), abstep
# (experiments/ab_step.py: T=1 step variants), core (the engine core: graph runner tests, one request through the
# core against the loop it replaced), conc (bench_concurrency: multi-user, DFlash K=7 at 59.6% fixed and adaptive),
# verdict (bench_sampled_verdict.py), grammar (bench_grammar_step.py: a JSON-schema mask's share of the step at 1 and
# 8 requests, DFlash K=7 at 59.6% under a schema), bdraft (the drafter's batch: its GPU tests, DFlash K=7 at
# 59.6% at 1/2/4/8 requests, and at 1/8 with a drafter call per request), persist
# (experiments/persistent_read.py), pending (below), long (the 64K long-context oracle),
# vision (bench_vision.py --ttft), vcheck (images in the graph lanes, the warm-up), start (bench_start.py: cold and warm starts to the first token, first vs second
# prompt; 27B), lprefill (bench_long.py: prefill rate and decode step against its bytes floor at 8K, 64K and 258K;
# 27B), lresume (bench_long.py: a 200K conversation's next turn, held and after a restart from disk; 27B), kquant
# (GGUF blocks on the GPU: tests/test_gguf_gpu_kernels.py, then bench_gguf_matmul.py: the few-row kernel against its
# bytes floor on the 27B's shapes in Q4_K/Q5_K/Q6_K/Q8_0, and a 512-row prefill beside bf16 cuBLAS), servemix
# (bench_serve.py: a 32K prompt while 4 requests decode, at two step budgets), adapt (adaptive DFlash K=7 at 59.6% at
# 1 and 8 requests, on the synthetic target and on a confident one), loadtime (bench_load.py: a converted 27B-shape
# folder of 12 layers against its disk read), pfkern (the prefill conv and norm paths' GPU tests, then a 2048-token
# chunk's kernels by group)
# CPU-only tests (the interpreter, the reference path on the downloaded SmolLM2: the device has no network) are left out
# (the device image's Triton interpreter is older than CI's and cannot run loops bounded by tl.minimum)
if [[ $parts == *tests* ]]; then
  NINFER_TEST_DEVICE=cuda timeout 540 python -m pytest -x -q -k "not interpreter and not reference_path" tests/test_attention_kernel.py tests/test_gdn_kernel.py tests/test_norm_kernel.py tests/test_conv_act_kernels.py tests/test_kvwrite_kernel.py tests/test_quant.py::test_every_kernel_candidate_on_the_gpu tests/test_quant.py::test_tiled_kernels_on_the_gpu tests/test_quant.py::test_tiled_weights_in_a_model_on_the_gpu tests/test_quant.py::test_tiled_kernels_compile_for_the_users_gpus tests/test_quant.py::test_prefill_dequant_kernel_on_the_gpu tests/test_runner.py tests/test_batch_step.py \
    tests/test_spec.py tests/test_kv_pool.py tests/test_argmax_kernel.py tests/test_topk_kernel.py tests/test_sampled_verdict_kernel.py > "${OUT:-/tmp}/gpu_tests.log" 2>&1; tail -15 "${OUT:-/tmp}/gpu_tests.log"
fi
if [[ $parts == *runner* ]]; then  # the graph runner: lanes, batch buckets, concurrent requests
  NINFER_TEST_DEVICE=cuda timeout 400 python -m pytest -x -q tests/test_runner.py tests/test_lanes.py \
    tests/test_batch_step.py tests/test_spec.py -k "not interpreter and not reference_path" 2>&1 | tail -15
fi
if [[ $parts == *core* ]]; then
  NINFER_TEST_DEVICE=cuda timeout 300 python -m pytest -x -q -p no:xdist -o addopts="" tests/test_runner.py \
    tests/test_lanes.py tests/test_batch_step.py tests/test_adaptive_drafts.py tests/test_prefill_pieces.py \
    -k "not interpreter and not reference_path" > "${OUT:-/tmp}/core_tests.log" 2>&1; tail -12 "${OUT:-/tmp}/core_tests.log"
  timeout 270 python scripts/experiments/ab_loop.py --runs 3 2>&1 | grep -v Warn | tail -12
fi
if [[ $parts == *verify* ]]; then  # several requests' verify rows in one step: the streamed kernel, the graph
  NINFER_TEST_DEVICE=cuda timeout 330 python -m pytest -x -q -p no:xdist -o addopts="" \
    "tests/test_quant.py::test_tiled_kernels_on_the_gpu" "tests/test_quant.py::test_tiled_weights_in_a_model_on_the_gpu" \
    tests/test_runner.py tests/test_lanes.py tests/test_batch_step.py tests/test_adaptive_drafts.py \
    -k "not interpreter and not reference_path" > "${OUT:-/tmp}/verify_tests.log" 2>&1; tail -12 "${OUT:-/tmp}/verify_tests.log"
  timeout 240 python scripts/bench_qmatmul.py --rows 8 16 32 64 --decode-format > "${OUT:-/tmp}/qmatmul_rows.log" 2>&1
  grep -v Warn "${OUT:-/tmp}/qmatmul_rows.log" | tail -40 | cut -c1-160
fi
if [[ $parts == *pconc* ]]; then  # DFlash K=7 at 59.6%, 1/2/4/8 requests: each size's kernels; adaptive at 1 and 4
  m="--model synthetic:qwen3.6-27b --device cuda --weights q5/q4 --kv int8 --tokens 96"
  d="--spec dflash --drafter synthetic:dflash-qwen3.6-27b --draft-tokens 7 --draft-acceptance 0.596"
  timeout 300 python scripts/bench_concurrency.py $m $d --sizes 1,2,4,8 --fixed-drafts --profile \
    > "${OUT:-/tmp}/pconc.log" 2>&1; grep -v Warn "${OUT:-/tmp}/pconc.log" | grep -E "requests|^ +[0-9.]+ us" | cut -c1-150
  [[ $parts == *pconc+* ]] && timeout 150 python scripts/bench_concurrency.py $m $d --sizes 1,4 2>&1 | grep -v Warn | tail -3
elif [[ $parts == *bdraft* ]]; then  # the drafter's batch: its GPU tests, DFlash K=7 at 59.6% batched vs alone
  NINFER_TEST_DEVICE=cuda timeout 200 python -m pytest -x -q -p no:xdist -o addopts="" tests/test_runner.py -k \
    "dflash_guesses or verify_in_one_graph or run_at_once or graph_steps_match" > "${OUT:-/tmp}/bdraft_tests.log" 2>&1
  tail -8 "${OUT:-/tmp}/bdraft_tests.log"
  m="--model synthetic:qwen3.6-27b --device cuda --weights q5/q4 --kv int8 --tokens 96"
  d="--spec dflash --drafter synthetic:dflash-qwen3.6-27b --draft-tokens 7 --draft-acceptance 0.596 --fixed-drafts"
  timeout 230 python scripts/bench_concurrency.py $m $d --sizes 1,2,4,8 2>&1 | grep -v Warn | tail -5
  mkdir -p "${OUT:-/tmp}/alone"
  OUT="${OUT:-/tmp}/alone" timeout 150 python scripts/experiments/drafts_alone.py $m $d --sizes 1,8 2>&1 | grep -v Warn | tail -3
elif [[ $parts == *dconc* ]]; then  # DFlash K=7 at 59.6%: fixed drafts at 1/2/4/8 requests, adaptive at 1/2/4
  m="--model synthetic:qwen3.6-27b --device cuda --weights q5/q4 --kv int8 --tokens 96"
  d="--spec dflash --drafter synthetic:dflash-qwen3.6-27b --draft-tokens 7 --draft-acceptance 0.596"
  timeout 290 python scripts/bench_concurrency.py $m $d --sizes 1,2,4,8 --fixed-drafts 2>&1 | grep -v Warn | tail -5
  timeout 230 python scripts/bench_concurrency.py $m $d --sizes 1,2,4 2>&1 | grep -v Warn | tail -4
elif [[ $parts == *vconc* ]]; then  # one call: the batched verify's GPU tests, then the concurrency targets
  NINFER_TEST_DEVICE=cuda timeout 200 python -m pytest -x -q -p no:xdist -o addopts="" \
    "tests/test_quant.py::test_tiled_kernels_on_the_gpu" tests/test_runner.py -k "verify_in_one_graph or \
    run_at_once or step_together" > "${OUT:-/tmp}/vconc_tests.log" 2>&1; tail -8 "${OUT:-/tmp}/vconc_tests.log"
  m="--model synthetic:qwen3.6-27b --device cuda --weights q5/q4 --kv int8 --tokens 96"
  d="--spec dflash --drafter synthetic:dflash-qwen3.6-27b --draft-tokens 7 --draft-acceptance 0.596 --sizes 1,2,4"
  timeout 200 python scripts/bench_concurrency.py $m $d --fixed-drafts 2>&1 | grep -v Warn | tail -4
  timeout 170 python scripts/bench_concurrency.py $m --sizes 1,2,4,8 2>&1 | grep -v Warn | tail -5
elif [[ $parts == *conc* ]]; then  # 27B shape, 8k-speed formats; the drafter's acceptance set (random weights)
  m="--model synthetic:qwen3.6-27b --device cuda --weights q5/q4 --kv int8 --tokens 96"
  d="--spec dflash --drafter synthetic:dflash-qwen3.6-27b --draft-tokens 7 --draft-acceptance 0.596 --sizes 1,2,4"
  timeout 170 python scripts/bench_concurrency.py $m --sizes 1,2,4,8 2>&1 | grep -v Warn | tail -5
  timeout 200 python scripts/bench_concurrency.py $m $d --fixed-drafts 2>&1 | grep -v Warn | tail -4
  timeout 200 python scripts/bench_concurrency.py $m $d 2>&1 | grep -v Warn | tail -4
fi
# rgrid: the tiled matmuls at 16/32/64 rows with a grid of blocks over the rows, against the product's candidates
[[ $parts == *rgrid* ]] && timeout 240 python scripts/experiments/rows_grid.py 2>&1 | grep -v Warn | tail -18 | cut -c1-230
if [[ $parts == *qtest* ]]; then  # every matmul candidate against the reference at the 27B's widths, alone
  NINFER_TEST_DEVICE=cuda timeout 200 python -m pytest -x -q tests/test_quant.py -k "on_the_gpu or compile" 2>&1 | tail -5
fi
# the sweep prints every candidate (kept in $OUT/qmatmul.log); the call's output shows the chosen ones
if [[ $parts == *qmatmul* ]]; then
  timeout 450 python scripts/bench_qmatmul.py --sweep > "${OUT:-/tmp}/qmatmul.log" 2>&1
  grep -E "chosen|cuBLAS|Error|error" "${OUT:-/tmp}/qmatmul.log" | cut -c1-150
fi
if [[ $parts == *qchosen* ]]; then
  timeout 300 python scripts/bench_qmatmul.py > "${OUT:-/tmp}/qmatmul.log" 2>&1; tail -20 "${OUT:-/tmp}/qmatmul.log" | cut -c1-170
fi
if [[ $parts == *qwide* ]]; then  # qwide8 / qwide1: one row count only
  rows=$([[ $parts == *qwide8* ]] && echo 8 || { [[ $parts == *qwide1* ]] && echo 1; } || echo "1 8")
  timeout 420 python scripts/bench_qmatmul.py --wide --rows $rows > "${OUT:-/tmp}/qwide.log" 2>&1
  grep -E "chosen|best" "${OUT:-/tmp}/qwide.log" | cut -c1-150
fi
if [[ $parts == *ncu* ]]; then  # kernels chosen by timing outside ncu, whose interception skews timing
  m=${OUT:-/tmp}/ncu_manifest.json
  timeout 150 python scripts/ncu_qmatmul.py --plan "$m" && timeout 200 ncu --clock-control none \
    --profile-from-start off --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section LaunchStats --section Occupancy --page raw --csv --log-file "${OUT:-/tmp}/ncu_qmatmul.csv" \
    python scripts/ncu_qmatmul.py "$m" > "${OUT:-/tmp}/ncu_run.log" 2>&1
  python scripts/ncu_qmatmul.py --summarize "${OUT:-/tmp}/ncu_qmatmul.csv" "$m" | cut -c1-200
fi
if [[ $parts == *kernels* || $parts == *norms* || $parts == *mixer* ]]; then  # the small kernels' launch shapes
  only=$([[ $parts == *kernels* ]] || { [[ $parts == *norms* ]] && echo "--only norm"; } || echo "--only mixer")
  timeout 200 python scripts/bench_step_kernels.py $only > "${OUT:-/tmp}/step_kernels.log" 2>&1
  tail -3 "${OUT:-/tmp}/step_kernels.log"
fi
[[ $parts == *decode* ]] && timeout 300 python scripts/bench_decode.py --quick --no-baseline --reps 30 2>&1 | tail -20
# qsteps: q4/q5 row-major (Triton matmuls) and tiled (the CUDA matmuls), in one run
[[ $parts == *qsteps* ]] && timeout 420 python scripts/bench_decode.py --quick --no-baseline --reps 30 --weights "q5/q4 mix" "q5/q4 tiles" 2>&1 | grep -v Warn | tail -22
[[ $parts == *full* ]] && timeout 500 python scripts/bench_decode.py --reps 50 2>&1 | tail -30
[[ $parts == *profile* ]] && (cd scripts && timeout 200 python profile_step.py 2>&1 | grep -v Warn | tail -75)
# concurrency: the multi-user profile's settings, N requests at once (lanes, batch buckets) vs one after another
[[ $parts == *lanes* ]] && timeout 400 python scripts/bench_concurrency.py --model synthetic:qwen3.6-27b \
  --device cuda --weights q5/q4 --kv int8 --tokens 128 2>&1 | grep -v Warn | tail -8
[[ $parts == *host* ]] && (cd scripts && timeout 300 python profile_host.py --requests 1,8 --tokens 64 \
  --prefill 10,40,128,1024 2>&1 | grep -v Warn | tail -30)
[[ $parts == *pqmm* ]] && timeout 300 python scripts/bench_prefill_qmatmul.py 2>&1 | grep -v Warn | tail -52 | cut -c1-280
if [[ $parts == *pint8* ]]; then  # prefill matmuls on int8 tensor cores: GPU tests, then every tile against cuBLAS
  NINFER_TEST_DEVICE=cuda timeout 300 python -m pytest -x -q -p no:xdist -o addopts="" tests/test_prefill_int8.py \
    -k "not interpreter" > "${OUT:-/tmp}/pint8_tests.log" 2>&1; tail -6 "${OUT:-/tmp}/pint8_tests.log"
  timeout 280 python scripts/bench_prefill_qmatmul.py --sweep > "${OUT:-/tmp}/pint8.log" 2>&1
  grep -v Warn "${OUT:-/tmp}/pint8.log" | grep -v "^    " | tail -56 | cut -c1-280
fi
if [[ $parts == *kquant* ]]; then
  NINFER_TEST_DEVICE=cuda timeout 360 python -m pytest -x -q -p no:xdist -o addopts="" tests/test_gguf_gpu_kernels.py \
    -k "not interpreter" --durations=8 > "${OUT:-/tmp}/kquant_tests.log" 2>&1; tail -16 "${OUT:-/tmp}/kquant_tests.log"
  timeout 200 python scripts/bench_gguf_matmul.py --rows 1 8 512 2>&1 | grep -v Warn | tail -80 | cut -c1-200
fi
[[ $parts == *pattn* ]] && timeout 200 python scripts/bench_prefill_attention.py 2>&1 | grep -v Warn | tail -14
# lattn: decode attention's launch shapes over 258K keys of fp8 KV (the 256k-long profile's decode step)
[[ $parts == *lattn* ]] && timeout 200 python scripts/bench_step_kernels.py --only attention --context 258048 \
  --kv fp8 --tokens 1 2>&1 | grep -v Warn | tail -26 | cut -c1-150
[[ $parts == *spec* ]] && timeout 330 python scripts/bench_spec.py --runs 3 --t1-rows --draft-vocab 0 32768 65536 2>&1 | tail -25
# splitk: the tiled matmuls' K-slices summed in the kernel (an experiment waiting for a GPU), against kernel + sum
[[ $parts == *splitk* ]] && timeout 450 python scripts/experiments/splitk_ticket.py 2>&1 | grep -E "best|False|Error|error" | head -40
# round: a greedy speculative round's device timeline (propose, verify, accept, commit, observe), and each
# piece's kernels
[[ $parts == *round* ]] && (cd scripts && timeout 330 python profile_round.py --drafters dflash,mtp --kernels \
  2>&1 | grep -v Warn | tail -150)
# abstep: the T=1 step's variants (the GDN gate's launch), A/B in one process, each variant captured 3 times
[[ $parts == *abstep* ]] && timeout 420 python scripts/experiments/ab_step.py 2>&1 | grep -v Warn | tail -16
# pending: the top-k kernels on the GPU, and the sampled verdict's and the sampler's tests that read their
# candidates, each test's time, unbuffered so a timeout keeps what ran
if [[ $parts == *pending* ]]; then
  NINFER_TEST_DEVICE=cuda timeout 300 python -u -m pytest -q -rA --durations=10 -k "not interpreter" \
    tests/test_topk_kernel.py tests/test_sampled_verdict_kernel.py 2>&1 \
    | grep -v Warn | tail -30
fi
# persist: whether one persistent kernel with grid barriers reads the step's weights nearer the floor than a launch
# per matmul (experiments/persistent_read.py)
[[ $parts == *persist* ]] && timeout 300 python scripts/experiments/persistent_read.py 2>&1 | grep -v Warn | tail -20
# verdict: the sampled verdict's device time, untied and tied rows (bench_sampled_verdict.py)
# grammar: a JSON-schema mask's step time against unconstrained rows at 1 and 8 requests (target <= 5%), then the
# acceptance of DFlash K=7 rounds under the schema against without
if [[ $parts == *grammar* ]]; then
  m="--model synthetic:qwen3.6-27b --device cuda --weights q5/q4 --kv int8 --tokens 96"
  timeout 150 python scripts/bench_grammar_step.py $m 2>&1 | grep -v Warn | tail -3
  timeout 140 python scripts/bench_grammar_step.py $m --spec dflash --drafter synthetic:dflash-qwen3.6-27b \
    --draft-tokens 7 --draft-acceptance 0.596 2>&1 | grep -v Warn | tail -3
fi
# vision: the tower's encode times (images, a 10 s clip) and a screenshot chat turn's time to first token (27B-VL)
[[ $parts == *vision* ]] && timeout 280 python scripts/bench_vision.py --ttft 2>&1 | grep -v Warn | tail -16
# vcheck (a name without "tests", which the tests part matches): images through the graph lanes (the vision oracle
# on the GPU) and the prefill warm-up at load
if [[ $parts == *vcheck* ]]; then
  NINFER_TEST_DEVICE=cuda timeout 110 python -m pytest -x -q -p no:xdist -o addopts="" tests/test_vision_oracle.py \
    tests/test_warmup.py > "${OUT:-/tmp}/vtests.log" 2>&1; tail -4 "${OUT:-/tmp}/vtests.log"
fi
# long: the long-context oracle at 64K (the engine on the GPU against transformers' fp32 forward on the host)
[[ $parts == *long* ]] && NINFER_TEST_DEVICE=cuda timeout 280 python -m pytest -x -q -p no:xdist -o addopts="" \
  -rA tests/test_long_context_oracle.py -k "64k" -s 2>&1 | grep -E "tokens|passed|failed|Error" | tail -20
# lprefill: random prompts of 8K, 64K and 258K tokens through the engine (256k-long's formats on the synthetic 27B,
# no drafter): each one's prefill rate, then its greedy reply's decode step against the step's bytes floor
[[ $parts == *lprefill* ]] && timeout 540 python scripts/bench_long.py --model synthetic:qwen3.6-27b --device cuda \
  --weights q5/q4 --kv fp8 --scenarios prefill,decode --contexts 8192,65536,258048 --chunk 2048 2>&1 | grep -v Warn | tail -8
# lresume: a 200K-token conversation's next turn, still held and after a restart from the disk tier, beside its
# re-prefill (same settings)
[[ $parts == *lresume* ]] && timeout 540 python scripts/bench_long.py --model synthetic:qwen3.6-27b --device cuda \
  --weights q5/q4 --kv fp8 --scenarios resume-held,resume-disk --context 200000 --chunk 2048 2>&1 | grep -v Warn | tail -4
# servemix: a 32K prompt arriving while 4 requests decode (bench_serve.py prefill-during-decode; multi-user on the
# synthetic 27B), at the profile's step budget (prefill_chunk 2048), and at 256 (the chunk then runs in the step, eagerly)
if [[ $parts == *servemix* ]]; then
  for c in 2048 256; do
    timeout 295 python scripts/bench_serve.py --profile multi-user --model synthetic:qwen3.6-27b --timeout 240 \
      --scenario prefill-during-decode --set prefill_chunk=$c --keep-log 2>&1 | grep -v Warn | tail -6
  done
fi
if [[ $parts == *adapt* ]]; then  # adaptive drafts: what the load choice saw at each size (draft_choice)
  m="--model synthetic:qwen3.6-27b --device cuda --weights q5/q4 --kv int8 --tokens 96 --sizes 1,8"
  d="--spec dflash --drafter synthetic:dflash-qwen3.6-27b --draft-tokens 7 --draft-acceptance 0.596"
  timeout 240 python scripts/bench_concurrency.py $m $d --step-times 2>&1 | grep -v Warn | tail -7
  timeout 200 python scripts/bench_concurrency.py $m $d --confident-target 2>&1 | grep -v Warn | tail -5
  timeout 200 python scripts/bench_concurrency.py $m $d --confident-target --fixed-drafts 2>&1 | grep -v Warn | tail -5
  timeout 150 python scripts/bench_concurrency.py $m --confident-target 2>&1 | grep -v Warn | tail -3
fi
if [[ $parts == *pfkern* ]]; then
  NINFER_TEST_DEVICE=cuda timeout 150 python -m pytest -q -p no:xdist -o addopts="" tests/test_conv_act_kernels.py \
    tests/test_norm_kernel.py tests/test_runner.py -k "gpu or with_the_taps" 2>&1 | tail -3
  (cd scripts && timeout 200 python profile_host.py --requests 1 --tokens 4 --prefill 2048,4096 --prefill-chunk 2048 \
    2>&1 | grep -v Warn | grep -A1 "prefill of" | cut -c1-420)
fi
[[ $parts == *loadtime* ]] && timeout 400 python scripts/bench_load.py --preset qwen3.6-27b --layers 12 --device cuda \
  2>&1 | grep -v Warn | tail -12
# start: `ninfer generate` from a cold start (every cache empty, in a temporary folder) and a warm one to its first
# token, then a first and a second 2K-token prompt in one process (8k-speed's settings on the synthetic 27B, no drafter)
[[ $parts == *start* ]] && timeout 240 python scripts/bench_start.py --timeout 150 -- -P 8k-speed \
  --model synthetic:qwen3.6-27b --spec none 2>&1 | grep -v Warn | tail -8
[[ $parts == *verdict* ]] && timeout 200 python scripts/bench_sampled_verdict.py 2>&1 | grep -v Warn | tail -8
[[ $parts == *sampled* ]] && timeout 250 python scripts/bench_spec.py --runs 3 --temperature 0.6 --drafters dflash 2>&1 | tail -12
true
