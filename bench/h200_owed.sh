#!/usr/bin/env bash
# The H200 runs issues 19 and 20 owe (bench/results/README.md, "Not yet measured on the
# H200"), in two parts that each fit one device call (under 600 s with the machine's
# start). Each step's files are kept under /tmp/h200_owed_PART and packed after every
# step into one archive, $OUT/h200_owed_PART.tgz (the device tool's folder brings back at most
# eight files; ./h200_out elsewhere), so a step that runs out of time keeps the ones before.
#
#   part 1: the CUDA tests, the demo at its defaults, the idle runs, encoded images, omni-u8
#   part 2: the diffusers serving bench, DiT-XL/2; part 3: the same, Wan2.1-1.3B shapes
#           (since its last run, part 3 also runs Wan with decode="device": engine-decode)
#   part 4: omni-u8 against the ideal with the output in hand (no client bytes), and the
#           encoded-images bench with its forward-bound rate from before, after and in serving,
#           and the engine's ceiling with a no-op model on the host's 16 cores
#   part 5: with the device stage run one output ahead of the copy: the CUDA tests,
#           omni-u8 against the ideal (more requests, concurrency 2 and 4), encoded images
#           (host PNG with the encoder pool started at once), the idle at a 15 ms forward
#   part 6: (at 99f58dd, the fused finalize taking rows of 16: slower, reverted since) its
#           CUDA tests, the stage's cost beside a forward (bench/stage_cost.py), omni-u8
#           against the ideal again (c=2 and 4)
#   part 7: a second sample of part 5's borderline figures at the final code: omni-u8 on the
#           video (c=2 and 4) and the idle at a 15 ms synchronizing forward (twice)
#   part 8: two copies in flight (WorkerOptions.copies_in_flight): the CUDA tests, then
#           omni-u8 on the video with two copies in flight, one, and two again
#   part 9: with two copies in flight, the demo at its defaults, the idle at a 15 ms
#           synchronizing forward and encoded images (a check that nothing regressed)
#   part video: issue 31's encoded-video bench (480p, 720p); part serve: issue 32's HTTP
#           load against the engine's own rate (DiT, then video jobs)
#   part 10, 11: issue 30's PixArt-Sigma and CogVideoX-2B shapes through the engine
#           (bench/diffusers_serving.py --rounds 3: sync and async alternating)
#   part host: issue 31's host path (helper E): bench/host_path.py before (fresh memory per
#           request) against after (HostBuffers, ClientBytes) in alternating order, the
#           stages and the engine, then the loop's stall while 16 PNG encodes run (16 and 8
#           encoder processes; target max stall < 20 ms); part host-bench: omni-async bench
#           itself, --client-path fresh against pooled, and its event-loop line
#   part serve-video: part serve's video model alone; part dit-rounds: DiT-XL/2 direct, sync
#           and async in alternating order (issue 31); part client-c1: omni-async bench with
#           the client's bytes at one request in flight (issue 31's latency target), then
#           encoded images behind a 30 ms forward
#   part affinity: bench/probes/launch_affinity.py, PixArt's launch-bound forward in processes
#           pinned to the GPU's local CPUs against the others, and beside a thread spin-waiting
#           on CUDA events (issue 30's engine < direct: run it first next time), then the CUDA
#           tests of WorkerOptions.cpu_affinity; part 10-pinned: part 10 with the direct loop
#           also in a fresh process each round, and the engine's async path with its worker
#           pinned to the GPU's CPUs (cpu_affinity="gpu-local"), in the same rounds
#   part 10-im: part 10 with the worker's forwards in inference mode (the default
#           since dc94620) and the async path without it (engine-async-nograd) in the same
#           rounds; part im-check: the CUDA tests in inference mode, then the direct
#           forward under no_grad against inference mode (bench/probes/inference_mode.py)
#   part 10-graphs: the CUDA tests of the denoiser as CUDA graphs, then part 10's rounds with
#           engine-sync-graphs and engine-async-graphs (DiffusersPipelineWorker(cuda_graphs=True));
#           part cuda-tests: every CUDA test
# Run on 2026-12-05 (bench/results/h200_issues30_32/README.md): 10, 11, video, serve (its
# video run then used the tiny model's 64x64 default); then (bench/results/h200_2026-12-05b/)
# 10 again, client-c1, serve-video, dit-rounds, host; then (bench/results/h200_2026-12-05c/) 10-im,
# 10-graphs and cuda-tests.  Still owed: cuda-tests (after the graph tests' fixes), im-check,
# affinity, 10-pinned, host-bench (the next device session: in that order).
# (bench/last_mile.py ran in an earlier part 1: bench/results/h200_issue19_20/)
#
# Run from the repo root with the wheels in .whl/ (bash bench/h200_wheels.sh fetches them):
#   bash bench/h200_owed.sh PART
set -uo pipefail
part="${1:?part 1 to 11, 10-pinned, 10-im, 10-graphs, cuda-tests, im-check, host, host-bench, video, serve, serve-video, dit-rounds, client-c1 or affinity}"
dest="${OUT:-./h200_out}"
out="/tmp/h200_owed_$part"
mkdir -p "$out" "$dest"
save() { tar czf "$dest/h200_owed_$part.tgz" -C /tmp "h200_owed_$part"; }
# omni and omni-u8 on the 1.5 GB video, output in hand, at 2 and 4 requests in flight
# (bench_u8_video SUFFIX COPIES: with --copies-in-flight COPIES, files named *SUFFIX)
bench_u8_video() {
    for c in 2 4; do
        timeout 100 python3 -m omni_async.cli bench --device cuda --modes omni,omni-u8 --no-client-bytes \
            --sizes video-121x1080p-bf16 --forward-ms 30 --concurrency $c --requests 40 --copies-in-flight "${2:-2}" \
            --json "$out/bench_u8_c$c${1:-}.json" 2>&1 | grep -v "budget of held" | tee "$out/bench_u8_c$c${1:-}.log" | tail -9
        save
    done
}
# Issue 32's video model: the DiT pipeline's clips (32 frames of 512x512 a job, each frame
# the DiT-XL/2-shaped forward), 96 MP4 jobs at once after 192 images at concurrency 32, over
# HTTP and straight through the engine.  (The first video run used the tiny model at its
# 64x64 default, forwards under a millisecond; a second one, 32 images and 16 two-second
# clips, ended within 3 s a mode: too short for a rate.  bench/results/h200_2026-12-05b/)
serve_video() {
    timeout 330 python3 bench/serve_load.py --model dit --device cuda --size 512x512 --requests 192 --warmup 16 \
        --videos 96 --seconds 4 --max-s 120 --json "$out/serve_load_video.json" 2>&1 | tee "$out/serve_load_video.log" | tail -8
    save
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD/src:$PWD/tests" PYTHONUNBUFFERED=1
case "$part" in
1)
    timeout 170 python3 -m pytest -o addopts="" -q -rs -p no:cacheprovider -m cuda tests 2>&1 | tee "$out/cuda_tests.log" | tail -8
    save
    timeout 150 python3 -m omni_async.cli demo --device cuda --out "$out/demo_cuda" --json "$out/demo_cuda.json" 2>&1 | tee "$out/demo_cuda.log" | tail -16
    rm -rf "$out/demo_cuda/images"
    save
    timeout 100 python3 bench/engine_ceiling.py --device cuda --forward-ms 15 --post u8-client --shape 3,1024,1024 \
        --dtype bfloat16 --requests 400 --consumer-ms 5 --settings before,after --out "$out/idle_cuda.json" 2>&1 \
        | tee "$out/idle_cuda.log" | tail -10
    timeout 60 python3 bench/engine_ceiling.py --device cuda --forward-ms 15 --post u8-client --shape 3,1024,1024 \
        --dtype bfloat16 --requests 400 --consumer-ms 5 --settings after --queued --out "$out/idle_cuda_queued.json" 2>&1 \
        | tee "$out/idle_cuda_queued.log" | tail -10
    save
    timeout 100 python3 bench/encoded_images.py --device cuda --json "$out/encoded_images.json" 2>&1 \
        | tee "$out/encoded_images.log" | tail -6
    save
    timeout 120 python3 -m omni_async.cli bench --device cuda --modes omni,omni-u8 \
        --sizes image-1k-fp32,video-121x1080p-bf16 --forward-ms 30 --concurrency 2 --requests 12 \
        --json "$out/bench_u8.json" 2>&1 | tee "$out/bench_u8.log" | tail -12
    save
    ;;
2)
    timeout 200 python3 bench/diffusers_serving.py --preset h200 --workloads dit --json "$out/diffusers_dit.json" 2>&1 \
        | grep -v -i warn | tee "$out/diffusers_dit.log" | tail -8
    save
    ;;
3)
    timeout 360 python3 bench/diffusers_serving.py --preset h200 --workloads wan --requests 4 --json "$out/diffusers_wan.json" 2>&1 \
        | grep -v -i warn | tee "$out/diffusers_wan.log" | tail -6
    save
    ;;
4)
    timeout 120 python3 -m omni_async.cli bench --device cuda --modes omni,omni-u8 --no-client-bytes \
        --sizes image-1k-fp32,video-121x1080p-bf16 --forward-ms 30 --concurrency 2 --requests 12 \
        --json "$out/bench_u8_in_hand.json" 2>&1 | grep -v "budget of held" | tee "$out/bench_u8_in_hand.log" | tail -12
    save
    timeout 100 python3 bench/encoded_images.py --device cuda --requests 150 --json "$out/encoded_images.json" 2>&1 \
        | tee "$out/encoded_images.log" | tail -6
    save
    timeout 45 python3 bench/engine_ceiling.py --requests 2000 --settings before,after \
        --out "$out/ceiling_16core.json" 2>&1 | tee "$out/ceiling_16core.log" | tail -4
    save
    ;;
5)
    timeout 150 python3 -m pytest -o addopts="" -q -rs -p no:cacheprovider -m cuda tests 2>&1 | tee "$out/cuda_tests.log" | tail -8
    save
    bench_u8_video
    timeout 100 python3 bench/encoded_images.py --device cuda --requests 150 --json "$out/encoded_images.json" 2>&1 \
        | tee "$out/encoded_images.log" | tail -6
    save
    timeout 50 python3 bench/engine_ceiling.py --device cuda --forward-ms 15 --post u8-client --shape 3,1024,1024 \
        --dtype bfloat16 --requests 400 --consumer-ms 5 --settings after --out "$out/idle_cuda.json" 2>&1 \
        | tee "$out/idle_cuda.log" | tail -6
    save
    ;;
6)
    timeout 120 python3 -m pytest -o addopts="" -q -rs -p no:cacheprovider -m cuda tests/worker 2>&1 | tee "$out/cuda_tests_worker.log" | tail -4
    timeout 90 python3 bench/stage_cost.py --json "$out/stage_cost.json" 2>&1 | tee "$out/stage_cost.log" | tail -16
    save
    bench_u8_video
    ;;
7)
    bench_u8_video
    for i in 1 2; do
        timeout 50 python3 bench/engine_ceiling.py --device cuda --forward-ms 15 --post u8-client --shape 3,1024,1024 \
            --dtype bfloat16 --requests 400 --consumer-ms 5 --settings after --out "$out/idle_cuda_$i.json" 2>&1 \
            | tee "$out/idle_cuda_$i.log" | tail -3
        save
    done
    ;;
8)
    timeout 200 python3 -m pytest -o addopts="" -q -rs -p no:cacheprovider -m cuda tests 2>&1 | tee "$out/cuda_tests.log" | tail -8
    save
    # Two copies in flight against one, in one run: A, B, A, B.
    bench_u8_video _two 2
    bench_u8_video _one 1
    bench_u8_video _two_again 2
    ;;
9)
    # The serving figures again with two copies in flight: the demo at its defaults,
    # the idle at a 15 ms synchronizing forward, encoded images behind a 30 ms forward.
    timeout 150 python3 -m omni_async.cli demo --device cuda --out "$out/demo_cuda" --json "$out/demo_cuda.json" 2>&1 | tee "$out/demo_cuda.log" | tail -16
    rm -rf "$out/demo_cuda/images"
    save
    timeout 50 python3 bench/engine_ceiling.py --device cuda --forward-ms 15 --post u8-client --shape 3,1024,1024 \
        --dtype bfloat16 --requests 400 --consumer-ms 5 --settings after --out "$out/idle_cuda.json" 2>&1 \
        | tee "$out/idle_cuda.log" | tail -3
    save
    timeout 100 python3 bench/encoded_images.py --device cuda --requests 150 --json "$out/encoded_images.json" 2>&1 \
        | tee "$out/encoded_images.log" | tail -6
    save
    ;;
10 | 11)
    # Issue 30: PixArt-Sigma-shaped (part 10) and CogVideoX-2B-shaped (part 11) pipelines
    # through the engine against the direct loop, sync and async in alternating order,
    # every output compared with the direct loop's bit for bit.  PixArt: 8 requests, four
    # rounds (its runs spread more than its paths differ); CogVideoX (3.7 s forwards): 6, three.
    work=$([ "$part" = 10 ] && echo pixart || echo cogvideox)
    size=$([ "$part" = 10 ] && echo "--requests 8 --rounds 4" || echo "--requests 6 --rounds 3")
    # shellcheck disable=SC2086  # $size is two options
    timeout 560 python3 bench/diffusers_serving.py --preset h200 --workloads "$work" $size \
        --json "$out/diffusers_serving_$work.json" 2>&1 | tee "$out/diffusers_serving_$work.log" | tail -14
    save
    ;;
video)
    # Issue 31: MP4 through the engine, the seed's path against whole-video and chunked
    # encodes, 81x480x832 (2 s forward) then 121x720x1280 (4 s forward).
    for preset in 480p 720p; do
        timeout 270 python3 bench/encoded_video.py --device cuda --preset $preset \
            --json "$out/encoded_video_$preset.json" 2>&1 | tee "$out/encoded_video_$preset.log" | tail -6
        save
    done
    ;;
serve)
    # Issue 32: requests/s through HTTP against the engine's own rate, /health p99 under
    # load: the DiT pipeline, then a video model (the tiny model's clips at 720p sizes).
    # (2026-12-05: the DiT run took 100 s with 192 requests; the video run below replaces one
    # of the tiny model at its 64x64 default with forwards under a millisecond.)
    timeout 200 python3 bench/serve_load.py --model dit --device cuda --size 512x512 --requests 192 --max-s 90 \
        --json "$out/serve_load_dit.json" 2>&1 | tee "$out/serve_load_dit.log" | tail -8
    save
    serve_video
    ;;
serve-video)
    serve_video
    ;;
host)
    timeout 300 python3 bench/host_path.py --device cuda --rounds 3 --parts stages,engine \
        --stage-sizes image-2k-bf16,video-81x720p-bf16,video-121x1080p-bf16 --engine-sizes image-2k-bf16,video-81x720p-bf16 \
        --json "$out/host_path_h200.json" 2>&1 | tee "$out/host_path.log" | tail -16
    save
    timeout 90 python3 bench/loop_stall.py --device cuda --runs 2 --workers 16,8 --json "$out/loop_stall_h200.json" 2>&1 \
        | tee "$out/loop_stall.log" | tail -4
    save
    ;;
dit-rounds)
    # Issue 31: DiT-XL/2 sync against async (and the direct loop) in alternating order. Three
    # rounds with 8 requests passed 200 s on 2026-12-05: 4 requests a run, 500 s.
    timeout 500 python3 bench/diffusers_serving.py --preset h200 --workloads dit --requests 4 --rounds 3 \
        --json "$out/diffusers_serving_dit.json" 2>&1 | tee "$out/diffusers_serving_dit.log" | tail -16
    save
    ;;
client-c1)
    # Issue 31's latency target is for one request at a time: client_ms_p50 <= 1.5 x (forward
    # alone + copy alone). The 2026-12-05 run had two in flight.
    timeout 150 python3 -m omni_async.cli bench --device cuda --modes omni-u8 \
        --sizes image-2k-bf16,video-81x720p-bf16,video-121x1080p-bf16 --forward-ms 30 --concurrency 1 --requests 12 \
        --json "$out/bench_client_bytes_c1.json" 2>&1 | grep -v "budget of held" | tee "$out/bench_client_bytes_c1.log" | tail -14
    save
    # Encoded images behind a 30 ms forward (>= 0.95), since the encoders read the segment.
    timeout 100 python3 bench/encoded_images.py --device cuda --requests 150 --json "$out/encoded_images.json" 2>&1 \
        | tee "$out/encoded_images.log" | tail -6
    save
    ;;
affinity)
    timeout 450 python3 bench/probes/launch_affinity.py --rounds 3 --json "$out/launch_affinity.json" 2>&1 \
        | grep -v -i "float32\|warn" | tee "$out/launch_affinity.log" | tail -16
    save
    # The CUDA tests of WorkerOptions.cpu_affinity (a gpu-local worker's threads on its GPU's CPUs).
    timeout 100 python3 -m pytest -o addopts="" -q -rs -p no:cacheprovider -m cuda tests/worker/test_affinity.py 2>&1 \
        | tee "$out/affinity_tests.log" | tail -4
    save
    ;;
10-pinned)
    # Issue 30's PixArt rounds with two more paths: the direct loop in a fresh process
    # each round (as the engine's worker is), and the engine's async path with its worker
    # pinned to its GPU's CPUs (WorkerOptions.cpu_affinity="gpu-local"), in the same
    # alternating rounds; rows are written as they are made (a cut-short run keeps them).
    timeout 570 python3 bench/diffusers_serving.py --preset h200 --workloads pixart --requests 8 --rounds 3 \
        --fresh-direct --cpu-affinity gpu-local --json "$out/diffusers_serving_pixart_pinned.json" 2>&1 \
        | tee "$out/diffusers_serving_pixart_pinned.log" | tail -16
    save
    ;;
10-im)
    # Part 10 with the worker's forwards under torch.inference_mode (now the default,
    # WorkerOptions.inference_mode) and, in the same rounds, the async path without it
    # (engine-async-nograd: the pipeline's own no_grad only, as the direct loop's).
    # Written straight into $dest, row by row: a run cut short by the device's time keeps its rows.
    timeout "${IM_TIMEOUT:-450}" python3 bench/diffusers_serving.py --preset h200 --workloads pixart --requests 6 --rounds 3 \
        --nograd --json "$dest/diffusers_serving_pixart_im.json" 2>&1 \
        | grep -v -i warn | tee "$dest/diffusers_serving_pixart_im.log" | tail -18
    save
    ;;
10-graphs)
    # Issue 30: the CUDA tests of the denoiser as CUDA graphs (DiffusersPipelineWorker(cuda_graphs=True),
    # omni_async.worker.graphs), then PixArt's rounds with the graphs paths beside the default ones
    # (engine-sync-graphs, engine-async-graphs), every output against the direct loop's.
    timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -o addopts="" -q -rs -p no:cacheprovider -m cuda \
        tests/worker/test_graphs.py tests/integrations/test_diffusers_graphs.py 2>&1 | tee "$dest/graphs_tests.log" | tail -8
    timeout "${IM_TIMEOUT:-420}" python3 bench/diffusers_serving.py --preset h200 --workloads pixart --requests 6 --rounds 3 \
        --graphs --json "$dest/diffusers_serving_pixart_graphs.json" 2>&1 \
        | grep -v -i "warn\|kept in float32" | tee "$dest/diffusers_serving_pixart_graphs.log" | tail -24
    ;;
cuda-tests)
    # Every CUDA test (the graphs' among them), into the out folder as they run.
    timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -o addopts="" -q -rs -p no:cacheprovider -m cuda tests 2>&1 \
        | tee "$dest/cuda_tests.log" | tail -12
    ;;
im-check)
    # PixArt-Sigma-512's forward called directly under its own no_grad against inside
    # torch.inference_mode, alternating, in one process; then the CUDA tests with forwards
    # and the packer in inference mode (WorkerOptions.inference_mode, on by default since
    # dc94620).  Both written straight into $dest (a call cut short keeps what ran).
    timeout "${PROBE_TIMEOUT:-200}" python3 bench/probes/inference_mode.py --preset h200 --rounds 4 --calls 3 \
        --json "$dest/inference_mode_h200.json" 2>&1 | grep -v -i warn | tee "$dest/inference_mode_h200.log" | tail -4
    timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -o addopts="" -q -rs -p no:cacheprovider -m cuda tests 2>&1 \
        | tee "$dest/cuda_tests.log" | tail -8
    ;;
host-bench)
    timeout 420 python3 bench/host_path.py --device cuda --rounds 2 --parts bench --bench-requests 12 \
        --bench-runs "omni-u8@image-2k-bf16,video-81x720p-bf16,video-121x1080p-bf16" \
        --json "$out/host_path_bench_h200.json" 2>&1 | tee "$out/host_path_bench.log" | tail -6
    save
    timeout 90 python3 -m omni_async.cli bench --device cuda --modes omni-u8 --sizes image-2k-bf16 --forward-ms 30 \
        --concurrency 1 --requests 8 --no-copy-bound --json "$out/bench_loop_stall.json" 2>&1 \
        | tee "$out/bench_loop_stall.log" | tail -4
    save
    ;;
*)
    echo "part must be 1 to 11, host, host-bench, video, serve, serve-video, dit-rounds, client-c1 or affinity" >&2
    exit 2
    ;;
esac
