#!/usr/bin/env bash
# The GPU runs of the multi-GPU work, one step per call of a lent two-GPU machine
# (each step ends within 10 minutes; logs and results go to $OUT):
#
#   bash bench/gpu_session.sh probe            # versions, NCCL unit costs, leasing on the GPUs
#   bash bench/gpu_session.sh profile [PATHS]  # where a suite's time goes on NCCL (--rank-profile)
#   bash bench/gpu_session.sh torchrun         # --launcher torchrun on the two GPUs
#   bash bench/gpu_session.sh suites local [N [SLOTS]]  # suites -n N (2) --gpu-slots SLOTS (auto),
#                                              # this FSDP (SPY_AT="400 480": every rank's
#                                              # stacks at those seconds, in $OUT/spy.log)
#   bash bench/gpu_session.sh suites torch     # the same against torch.distributed.fsdp
#   bash bench/gpu_session.sh tests [N]        # the harness's own tests -n N (4; inner sessions on GPUs)
#   bash bench/gpu_session.sh scaling [PATHS]  # PATHS at -n 1, 2, 4: wall time, GPU use, leases
#   bash bench/gpu_session.sh weak 1           # bench/fsdp_step.py at world size 1 (then: weak 2)
#   bash bench/gpu_session.sh wide             # 4+ GPUs: the 3- and 4-rank suite tests, both
#                                              # implementations at once (one lease dir)
#   bash bench/gpu_session.sh whole IMPL [PATHS]  # PATHS (default: the whole suite) -n 8, any GPUs
#   bash bench/gpu_session.sh pair SLOTS N PATHS  # 4 GPUs as two 2-GPU machines: PATHS -n N with
#                                              # --gpu-slots SLOTS, this FSDP on GPUs 0,1 and
#                                              # torch's on 2,3 at once
#   bash bench/gpu_session.sh ones             # 2 GPUs as two 1-GPU machines: the whole suite -n 8
#                                              # with this FSDP on GPU 0, the suites under torch's
#                                              # on GPU 1, at once
#   bash bench/gpu_session.sh steptime         # world size 1 on GPU 0: the latency-bound preset in
#                                              # 6 interleaved rounds (twice) and the 937M model
#   bash bench/gpu_session.sh conformance [N]  # the conformance survey at world size 2 on NCCL,
#                                              # N scenarios, every report in $OUT
#   bash bench/gpu_session.sh fsdp2steps      # 2+ GPUs: fully_shard, this project's against torch's:
#                                              # the 937M model at world sizes 1, 2 and 4 (those the
#                                              # GPUs allow), the latency-bound preset at 1 and 2
#   bash bench/gpu_session.sh deep WS [N]      # the deep conformance search at world size WS on
#                                              # NCCL, N (700) scenarios, stats in $OUT
#   bash bench/gpu_session.sh replays FILE     # each scenario of FILE ("NAME REPLAY_ID" a line)
#                                              # replayed on the GPUs, a log each in $OUT
#
# Needs the expecttest wheel in .whl/ (carried: it is not installed there).
set -uo pipefail
STEP=${1:?"usage: bench/gpu_session.sh STEP [ARGS]"}
shift
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HARNESS_TEST_INNER_DEVICE=auto
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
PYTEST="python3 -m pytest -p no:cacheprovider"

prelude() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1
    git log -1 --format='commit %h %s' 2>/dev/null || true
    python3 -c 'import torch, pytest, xdist; print("torch", torch.__version__, "nccl",
        torch.cuda.nccl.version(), "gpus", torch.cuda.device_count(), "pytest", pytest.__version__,
        "xdist", xdist.__version__)'
    nvidia-smi -L
}

sampled() {  # sampled NAME COMMAND...: runs it under bench/gpu_sampler.py, log in $OUT/NAME.log
    local name=$1
    shift
    python3 bench/gpu_sampler.py --csv "$OUT/$name.csv" -- "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 40
}

two_agents() {  # two torchrun agents ("nodes") on this machine, one GPU each
    local port=$1
    shift
    for gpu in 0 1; do
        CUDA_VISIBLE_DEVICES=$gpu timeout 280 python3 -m torch.distributed.run --nnodes 2 \
            --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "localhost:$port" \
            --rdzv-id "gpu-$port" -m pytest -p no:cacheprovider --launcher torchrun "$@" \
            >"$OUT/agent$gpu-$port.log" 2>&1 &
    done
    wait
    grep -h "passed\|failed\|torchrun:" "$OUT"/agent*-"$port".log | grep -v "^\[" | sort | uniq -c
}

spy_at() {  # spy_at SECONDS...: at those times after the call, every rank's native and Python
    # stacks (py-spy, if its wheel is in .whl/), the GPUs' processes and /dev/shm, into $OUT/spy.log
    local start=$SECONDS at
    for at in "$@"; do
        sleep $((at - (SECONDS - start)))
        {
            echo "=== ${at} s"
            nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
            df -h /dev/shm | tail -n 1
            echo "/dev/shm entries: $(ls /dev/shm | wc -l)"
            for pid in $(pgrep -f spawn_main); do
                echo "--- pid $pid wchan $(cat /proc/$pid/wchan 2>/dev/null)"
                timeout 20 /tmp/site/bin/py-spy dump --native --pid "$pid" 2>&1 | head -n 150
            done
        } >>"$OUT/spy.log" 2>&1
    done
}

# Set here, not in prelude: a function piped into tee runs in a subshell, and an export
# there would not reach the steps (the ranks would not find expecttest).
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
prelude | tee "$OUT/prelude.log"
case "$STEP" in
probe)
    for bind in "" --no-device-id; do
        timeout 120 python3 bench/nccl_test_cost.py micro --backend nccl --iters 10 $bind
    done 2>&1 | tee "$OUT/micro.log"
    rm -rf /tmp/leases-probe
    sampled trivial-n2 timeout 200 $PYTEST bench/trivial_tests.py -n 2 -q --gpu-lease-dir /tmp/leases-probe
    python3 bench/lease_cost.py --journal /tmp/leases-probe | tee -a "$OUT/trivial-n2.log"
    ;;
profile)
    paths=${*:-"suites/test_core.py suites/test_fsdp_hybrid_shard.py suites/test_hybrid_replicas.py"}
    timeout 560 python3 bench/nccl_test_cost.py suite /tmp/nccl-profile $paths 2>&1 |
        tee "$OUT/profile.log" | tail -n 80
    tar czf "$OUT/profile.tgz" -C /tmp nccl-profile
    ;;
torchrun)
    timeout 250 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m pytest \
        -p no:cacheprovider --launcher torchrun suites/test_core.py -rs >"$OUT/standalone.log" 2>&1
    tail -n 5 "$OUT/standalone.log"
    two_agents 29511 tests/harness/torchrun_cases.py suites/test_core.py::TestHooks -rs
    ;;
suites)
    impl=${1:-local}
    rm -rf "/tmp/leases-$impl"
    spy=""
    if [ -n "${SPY_AT:-}" ]; then spy_at $SPY_AT & spy=$!; fi
    sampled "suites-$impl" timeout -s INT 570 $PYTEST suites -n "${2:-2}" --gpu-slots "${3:-auto}" -q -rfEs --dist-timeout 150 \
        --tb=short --fsdp-impl "$impl" --gpu-lease-dir "/tmp/leases-$impl" --junitxml="$OUT/suites-$impl.xml"
    [ -n "$spy" ] && { pkill -P "$spy"; kill "$spy"; } 2>/dev/null
    python3 bench/lease_cost.py --journal "/tmp/leases-$impl" | tee -a "$OUT/suites-$impl.log"
    ;;
tests)
    rm -rf /tmp/leases-tests
    sampled tests timeout -s INT "${TESTS_TIMEOUT:-570}" $PYTEST tests -n "${1:-4}" -q -rfEs \
        --dist-timeout 150 --tb=short --gpu-lease-dir /tmp/leases-tests --junitxml="$OUT/tests.xml"
    python3 bench/lease_cost.py --journal /tmp/leases-tests | tee -a "$OUT/tests.log"
    ;;
scaling)
    paths=${*:-"suites/test_core.py"}
    for n in 1 2 4; do
        rm -rf "/tmp/leases-n$n"
        sampled "scaling-n$n" timeout 180 $PYTEST $paths -n $n -q --gpu-lease-dir "/tmp/leases-n$n"
        python3 bench/lease_cost.py --journal "/tmp/leases-n$n" | tee -a "$OUT/scaling-n$n.log"
    done
    rm -f "$OUT"/scaling-n*.csv  # the summaries are in the logs; 8 files come back at most
    ;;
weak)
    ws=${1:-1}
    timeout 240 python3 bench/fsdp_step.py --preset gpt-937m --world-size "$ws" --warmup 3 \
        --steps 30 --json "$OUT/weak-937m-ws$ws.json" 2>&1 | tee "$OUT/weak-937m-ws$ws.log" |
        grep -v Warning | tail -n 12
    timeout 300 python3 bench/fsdp_step.py --preset latency --world-size "$ws" --warmup 5 \
        --steps 60 --json "$OUT/weak-latency-ws$ws.json" 2>&1 | tee "$OUT/weak-latency-ws$ws.log" |
        grep -v Warning | tail -n 12
    ;;
wide)
    rm -rf /tmp/leases-wide
    for impl in local torch; do
        python3 bench/gpu_sampler.py --csv "$OUT/wide-$impl.csv" -- timeout -s INT 480 $PYTEST \
            -p bench.wide_tests --wide-tests 3 suites -n 2 -rfEs --tb=short --fsdp-impl "$impl" \
            --gpu-lease-dir /tmp/leases-wide --junitxml="$OUT/wide-$impl.xml" >"$OUT/wide-$impl.log" 2>&1 &
    done
    wait
    for impl in local torch; do
        echo "== $impl"
        grep -A30 "distributed tests ==" "$OUT/wide-$impl.log" | grep -v "^SKIPPED" | tail -n 30
    done
    python3 bench/lease_cost.py --journal /tmp/leases-wide | tail -n 12
    ;;
whole)
    impl=${1:-local}
    shift || true
    rm -rf "/tmp/leases-whole-$impl"
    sampled "whole-$impl" timeout -s INT 570 $PYTEST "$@" -n 8 -q -rfE --tb=line \
        --fsdp-impl "$impl" --gpu-lease-dir "/tmp/leases-whole-$impl" \
        --junitxml="$OUT/whole-$impl.xml"
    ;;
pair)
    slots=${1:?SLOTS}
    n=${2:?N}
    shift 2
    for impl in local torch; do
        gpus=0,1
        [ "$impl" = torch ] && gpus=2,3
        rm -rf "/tmp/leases-pair-$impl"
        CUDA_VISIBLE_DEVICES=$gpus python3 bench/gpu_sampler.py --csv "$OUT/pair-$impl.csv" -- \
            timeout -s INT "${PAIR_TIMEOUT:-550}" $PYTEST "$@" -n "$n" -q -rfE --tb=short --fsdp-impl "$impl" \
            --gpu-slots "$slots" --gpu-lease-dir "/tmp/leases-pair-$impl" \
            --junitxml="$OUT/pair-$impl.xml" >"$OUT/pair-$impl.log" 2>&1 &
    done
    wait
    for impl in local torch; do
        echo "== $impl"
        grep "rank tests: \|^FAILED\|^ERROR\|passed\|failed\|wall\|GPU" "$OUT/pair-$impl.log" | tail -n 30
        python3 bench/lease_cost.py --journal "/tmp/leases-pair-$impl" | tail -n 5
    done
    ;;
ones)
    for impl in local torch; do
        gpu=0 paths=""
        [ "$impl" = torch ] && gpu=1 paths=suites
        rm -rf "/tmp/leases-one-$impl"
        CUDA_VISIBLE_DEVICES=$gpu python3 bench/gpu_sampler.py --csv "$OUT/one-$impl.csv" -- \
            timeout -s INT "${ONES_TIMEOUT:-560}" $PYTEST $paths -n 8 -q -rfE --tb=short --fsdp-impl "$impl" \
            --gpu-lease-dir "/tmp/leases-one-$impl" --junitxml="$OUT/one-$impl.xml" >"$OUT/one-$impl.log" 2>&1 &
    done
    wait
    for impl in local torch; do
        echo "== $impl"
        grep "rank tests: \|^FAILED\|^ERROR\|passed\|failed\|wall\|GPU" "$OUT/one-$impl.log" | tail -n 30
    done
    ;;
steptime)
    export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
    for round in 1 2; do
        timeout 200 python3 bench/fsdp_step.py --preset latency --world-size 1 --warmup 5 --steps 60 \
            --rounds 6 --modes ddp,torch-fsdp1,torch-fsdp2,local,local-flat \
            --json "$OUT/latency-$round.json" 2>&1 | tee "$OUT/latency-$round.log" | grep -v Warning | tail -n 12
    done
    timeout 200 python3 bench/fsdp_step.py --preset gpt-937m --world-size 1 --warmup 3 --steps 30 \
        --modes ddp,torch-fsdp2,local,local-flat --json "$OUT/gpt-937m.json" 2>&1 |
        tee "$OUT/gpt-937m.log" | grep -v Warning | tail -n 12
    ;;
conformance)
    rm -rf /tmp/leases-conformance "$OUT/conformance-stats.jsonl"
    timeout 500 $PYTEST -p no:randomly "suites/test_conformance.py::test_fsdp_conforms_to_the_reference[2]" \
        --device cuda --conformance-survey --conformance-scenarios "${1:-200}" -q -rfE --tb=short \
        --conformance-stats "$OUT/conformance-stats.jsonl" --gpu-lease-dir /tmp/leases-conformance \
        >"$OUT/conformance.log" 2>&1
    grep -h "^conformance:\|passed\|failed" "$OUT/conformance.log" | tail -n 30
    ;;
replays)
    n=0
    while read -r name id; do
        n=$((n + 1))
        timeout 120 $PYTEST -p no:randomly -q "suites/test_conformance.py::test_replay_scenario" \
            --device cuda --replay-example "$id" >"$OUT/replay-$n.log" 2>&1
        echo "$n $name: $(tail -n 1 "$OUT/replay-$n.log")"
    done <"${1:?usage: bench/gpu_session.sh replays FILE}"
    ;;
fsdp2steps)
    gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    for ws in 1 2 4; do
        [ "$ws" -gt "$gpus" ] && continue
        timeout 150 python3 bench/fsdp_step.py --preset gpt-937m --world-size "$ws" --warmup 3 --steps 30 \
            --modes torch-fsdp2,local-fsdp2 --json "$OUT/fsdp2-937m-ws$ws.json" 2>&1 |
            tee "$OUT/fsdp2-937m-ws$ws.log" | grep -v Warning | tail -n 8
    done
    for ws in 1 2; do
        [ "$ws" -gt "$gpus" ] && continue
        timeout 100 python3 bench/fsdp_step.py --preset latency --world-size "$ws" --warmup 5 --steps 60 \
            --rounds 6 --modes torch-fsdp2,local-fsdp2 --json "$OUT/fsdp2-latency-ws$ws.json" 2>&1 |
            tee "$OUT/fsdp2-latency-ws$ws.log" | grep -v Warning | tail -n 8
    done
    ;;
deep)
    ws=${1:?WS}
    timeout "${DEEP_TIMEOUT:-540}" $PYTEST -p no:randomly \
        "suites/test_conformance.py::test_fsdp_conforms_to_the_reference[$ws]" --device cuda \
        --hypothesis-profile deep --conformance-survey --conformance-scenarios "${2:-700}" -q -rfE \
        --tb=short --conformance-stats "$OUT/deep-ws$ws.jsonl" >"$OUT/deep-ws$ws.log" 2>&1
    grep -h "^conformance:\|passed\|failed" "$OUT/deep-ws$ws.log" | tail -n 30
    ;;
*)
    echo "unknown step $STEP" >&2
    exit 2
    ;;
esac
