#!/usr/bin/env bash
# What a GPU session runs (each part fits one 10-minute device call):
#   bash bench/run_gpu.sh check [TESTS]  # GPU tests (kernels at real sizes, HF agreement, model on pallas) + demo;
#                                 # the whole suite no longer fits one call: `check tests/pallas tests/models
#                                 # tests/adapters tests/paging`, then `check tests/server`, then
#                                 # `check tests/test_[a-d]*.py`, `check tests/test_[e-n]*.py`, `check tests/test_[o-z]*.py`
#                                 # (on an H100: 442, 188 and 264 s a call; test_[a-l] alone outran 560 s)
#   bash bench/run_gpu.sh kernels # kernel table (bench/kernels.py --quick)
#   bash bench/run_gpu.sh full    # the full kernel table (bench/kernels.py --resume): run it again until it says
#                                 # "done"; copy each call's kernels_full.json into bench/results in between
#   bash bench/run_gpu.sh model [BATCHES [FILE]]  # end-to-end 8B-shaped benchmark (bench/model.py); one table can
#                                 # take two calls: `model 1,8,32`, then with that call's model.json copied into the
#                                 # tree `model 64 bench/results/model.json` adds batch 64 to it (on an H100: 155 + 44 s)
#   bash bench/run_gpu.sh profile [ARGS]  # where decode steps spend their time (bench/model.py --profile ARGS,
#                                 # e.g. --batches 64, or --batches 8,32,64 --rank 64)
#   bash bench/run_gpu.sh features  # 32 DoRA / bias / added-token adapters against 32 plain ones (bench/model.py)
#   bash bench/run_gpu.sh engine  # Engine.generate on the 8B shape against the bare step (bench/model.py --engine)
#   bash bench/run_gpu.sh serve   # jlora serve under Poisson arrivals (bench/serve.py; needs the serving packages)
#   bash bench/run_gpu.sh limits  # what bounds the prefill expand and the decode down shrink (bench/studies/*_limits.py)
#   bash bench/run_gpu.sh gather [ARGS]  # forms of the gather backend's expand (bench/studies/gather_forms.py ARGS,
#                                 # e.g. --model-only --forms gather,gather_inline)
#   bash bench/run_gpu.sh attention [ARGS]  # the decode attention kernel's key block, warps and stages
#                                 # (bench/studies/attention_tiles.py ARGS, e.g. --cases rows, then --cases paged,split)
#   bash bench/run_gpu.sh delta [ARGS]  # the decode expand's delta in a buffer of its own against in place
#                                 # (bench/studies/expand_delta.py ARGS, e.g. --batches 32,64 --ranks 64)
#   bash bench/run_gpu.sh norm [ARGS]  # the model's norms in the Pallas kernel against XLA's (bench/studies/norm_kernel.py ARGS)
#   bash bench/run_gpu.sh scheduling  # decode under XLA's default and CONCURRENT graphs (bench/studies/scheduling.py)
#   bash bench/run_gpu.sh chunk   # prompt throughput and decode stalls per prefill_chunk (bench/studies/prefill_chunk.py)
#   bash bench/run_gpu.sh tp      # bench/model.py --tp 1,2 (two GPUs) under XLA's default scheduling, then jlora's
#   bash bench/run_gpu.sh tiers   # one adapter's cost per tier on the 8B shape (bench/studies/adapter_tiers.py)
#   bash bench/run_gpu.sh scoring [ARGS]  # Engine.score, multiple choice, base / 1 / 32 adapters (bench/scoring.py ARGS)
#   bash bench/run_gpu.sh paging [ARGS]   # the paged KV cache: rows per memory, shared prefixes, prompt rate (bench/paging.py ARGS)
#   bash bench/run_gpu.sh tenancy [ARGS]  # N adapters over 32 slots (bench/tenancy.py ARGS; needs the serving packages)
#   bash bench/run_gpu.sh copies  # adapter copies beside an engine-shaped loop, PjRt's staging on, then off
#                                 # (bench/studies/copy_forms.py: per layer, packed, 4 MB pieces, gated, DMA-mapped, host to host)
#   bash bench/run_gpu.sh epilogue  # the LoRA expand in a Pallas GEMM's epilogue (bench/studies/epilogue_expand.py)
#   bash bench/run_gpu.sh capped [ARGS]  # LoRA kernels on capped grids, or with --caps '' gather against pallas, in the
#                                 # 8B decode step (bench/studies/capped_grid.py ARGS, e.g. --cases 32x16x1,32x16x32)
#   bash bench/run_gpu.sh projections [ARGS]  # the gather forms on some projections' LoRA, Pallas on the rest
#                                 # (bench/studies/backend_by_projection.py ARGS)
#   bash bench/run_gpu.sh tile [BATCHES]  # the projections' kernels with their rows in a tile of at least 64, then
#                                 # 16, against XLA's pair (bench/studies/add_in_gemm.py --min-rows; BATCHES 32,16)
# Results go to $OUT (the device tool's output folder) or bench/results.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
out="${OUT:-bench/results}"
case "${1:-}" in
  check)
    # 4 workers share the GPU (no preallocation). The log goes to $OUT (or /tmp), a line per finished test, so a
    # call cut short still shows how far it got and which tests had not finished.
    # A quoted glob (`"tests/test_[a-d]*.py"`) is expanded here, as pytest would take it for one missing path;
    # other arguments (`-k "a and b"`) pass as given.
    shift
    paths=(); for p in "${@:-tests/}"; do
      if [[ $p == *[*?[]* ]] && compgen -G "$p" > /dev/null; then paths+=($p); else paths+=("$p"); fi; done
    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -v -n 4 -p no:cacheprovider \
      -W ignore::DeprecationWarning "${paths[@]}" > "${OUT:-/tmp}/check.log" 2>&1
    tail -15 "${OUT:-/tmp}/check.log"
    python3 -m jlora demo 2>&1 | grep -v "loading model" | tail -16 ;;
  kernels) python3 bench/kernels.py --quick --out "$out" 2>&1 | grep -E "^\||^Device" ;;
  full)
    [ "$out" != bench/results ] && [ -f bench/results/kernels_full.json ] && cp bench/results/kernels_full.json "$out"/
    # stop short of the device tool's 10 minutes so the rows saved so far come back
    timeout 540 python3 bench/kernels.py --resume --out "$out" 2>&1 | grep -E "^#|µs wall|Error" \
      && [ -f "$out/kernels_full.md" ] && echo done ;;
  model) python3 bench/model.py --out "$out" ${2:+--batches "$2"} ${3:+--add "$3"} 2>&1 | grep -vE "^W1|bfc_alloc" ;;
  profile) python3 bench/model.py --profile --out "$out" "${@:2}" 2>&1 | grep -vE "^W1|bfc_alloc" ;;
  features) python3 bench/model.py --features --out "$out" 2>&1 | grep -E "^#|^decode|^prefill" ;;
  engine) python3 bench/model.py --engine --out "$out" 2>&1 | grep -E "^#|^engine" ;;
  serve) python3 bench/serve.py --out "$out" 2>&1 | grep -E "^#|^rate|^\|" ;;
  limits)
    python3 bench/studies/expand_limits.py 2>&1 | grep -E "^#|µs"
    python3 bench/studies/shrink_limits.py 2>&1 | grep -E "^#|^[a-z]" ;;
  gather) python3 bench/studies/gather_forms.py "${@:2}" 2>&1 | grep -E "µs|ms|Error" ;;
  attention) python3 bench/studies/attention_tiles.py --out "$out" "${@:2}" 2>&1 | grep -E "^#|µs|^model|Error" ;;
  delta) python3 bench/studies/expand_delta.py --out "$out" "${@:2}" 2>&1 | grep -E "^#|^decode|^prefill|Error" ;;
  norm) python3 bench/studies/norm_kernel.py --out "$out" "${@:2}" 2>&1 | grep -E "^#|^decode|^prefill|Error" ;;
  scheduling) python3 bench/studies/scheduling.py --out "$out" 2>&1 | grep -E "^#|^\|" ;;
  chunk) python3 bench/studies/prefill_chunk.py --out "$out" 2>&1 | grep -E "^#|^chunk" ;;
  tp)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # multicast off (KINDS.md)
    for flags in "--xla_gpu_command_buffer_scheduling_mode=LHS" ""; do
      echo "# XLA_FLAGS='$flags'"
      XLA_FLAGS="$flags" python3 bench/model.py --tp 1,2 --out "$out${flags:+/default_graphs}" 2>&1 \
        | grep -E "^#|^TP"
    done ;;
  tiers) python3 bench/studies/adapter_tiers.py --out "$out" "${@:2}" 2>&1 | grep -E "^#|^rank" ;;
  scoring) python3 bench/scoring.py --out "$out" "${@:2}" 2>&1 | grep -E "^#|^\||^One|Error" ;;
  paging) python3 bench/paging.py --out "$out" "${@:2}" 2>&1 | grep -E "^scale|^prefix|^prompt|Error" ;;
  tenancy) python3 bench/tenancy.py --out "$out" "${@:2}" 2>&1 | grep -E "^#|^alpha|^pooled|Error" ;;
  copies)
    for staging in "" --no-staging; do
      echo "# copy_forms.py $staging"
      (cd bench/studies && python3 copy_forms.py $staging 2>&1 | grep -vE "^W1|bfc_alloc")
    done ;;
  epilogue) python3 bench/studies/epilogue_expand.py --out "$out" 2>&1 | grep -E "^#|µs|Error" ;;
  capped) python3 bench/studies/capped_grid.py --out "$out" "${@:2}" 2>&1 | grep -E "^#|^decode|Error" ;;
  projections) python3 bench/studies/backend_by_projection.py --out "$out" "${@:2}" 2>&1 | grep -E "^#|^decode|Error" ;;
  tile)
    for rows in 64 16; do
      mkdir -p "$out/min_rows_$rows"
      python3 bench/studies/add_in_gemm.py --batches "${2:-32,16}" --lora-batches '' --min-rows "$rows" \
        --out "$out/min_rows_$rows" 2>&1 | grep -E "^#|^decode|Error"
    done ;;
  *) echo "usage: $0 check|kernels|full|model|profile|features|engine|serve|limits|gather|attention|delta|norm|scheduling|chunk|tp|tiers|scoring|paging|tenancy|copies|epilogue|capped|projections|tile" >&2; exit 2 ;;
esac
