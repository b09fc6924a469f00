#!/usr/bin/env bash
# The H200 runs issues 19 and 20 owe (bench/results/README.md, "Not yet measured on the
# H200"), in two parts that each fit one device call (under 600 s with the machine's
# start). Each step's files are kept under /tmp/h200_owed_PART and packed after every
# step into one archive, $OUT/h200_owed_PART.tgz (the device tool's folder brings back at most
# eight files; ./h200_out elsewhere), so a step that runs out of time keeps the ones before.
#
#   part 1: the CUDA tests, the demo at its defaults, the last-mile bench, the idle run
#   part 2: the diffusers serving bench (DiT-XL/2 and Wan2.1-1.3B shapes)
#
# Run from the repo root with the wheels in .whl/ (transitions, attrs, diffusers,
# importlib_metadata, zipp, regex):  bash bench/h200_owed.sh 1   (then 2)
set -uo pipefail
part="${1:?part 1 or 2}"
dest="${OUT:-./h200_out}"
out="/tmp/h200_owed_$part"
mkdir -p "$out" "$dest"
save() { tar czf "$dest/h200_owed_$part.tgz" -C /tmp "h200_owed_$part"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD/src:$PWD/tests" PYTHONUNBUFFERED=1
case "$part" in
1)
    timeout 120 python3 -m pytest -o addopts="" -q -rs -p no:cacheprovider -m cuda tests 2>&1 | tee "$out/cuda_tests.log" | tail -8
    save
    timeout 150 python3 -m omni_async.cli demo --device cuda --out "$out/demo_cuda" --json "$out/demo_cuda.json" 2>&1 | tee "$out/demo_cuda.log" | tail -16
    rm -rf "$out/demo_cuda/images"
    save
    timeout 60 python3 bench/last_mile.py --device cuda --repeat 3 --json "$out/last_mile.json" 2>&1 | tee "$out/last_mile.log" | tail -14
    save
    timeout 90 python3 bench/engine_ceiling.py --device cuda --forward-ms 15 --post u8-client --shape 3,1024,1024 \
        --dtype bfloat16 --requests 400 --consumer-ms 5 --settings before,mr2,after --out "$out/idle_cuda.json" 2>&1 \
        | tee "$out/idle_cuda.log" | tail -10
    save
    ;;
2)
    timeout 200 python3 bench/diffusers_serving.py --preset h200 --workloads dit --json "$out/diffusers_dit.json" 2>&1 \
        | grep -v -i warn | tee "$out/diffusers_dit.log" | tail -8
    save
    timeout 260 python3 bench/diffusers_serving.py --preset h200 --workloads wan --requests 4 --json "$out/diffusers_wan.json" 2>&1 \
        | grep -v -i warn | tee "$out/diffusers_wan.log" | tail -6
    save
    ;;
*)
    echo "part must be 1 or 2" >&2
    exit 2
    ;;
esac
