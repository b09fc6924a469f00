#!/usr/bin/env bash
# The wheels the H200 machine lacks (no network there), fetched here into ./.whl for the
# device tool to carry: bench/h200_owed.sh installs them with pip --target. The versions
# are those of 2026-12-05's runs (bench/results/h200_issues30_32/README.md); its image
# already holds torch, numpy, pillow, httpx, anyio, click, tokenizers and transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .gitignore
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    transitions==0.9.3 diffusers==0.42.1 importlib_metadata==10.2.0 av==18.1.0 \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 python-multipart==0.0.34 opentelemetry-api==1.45.3 \
    pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
    openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 jiter==0.19.0 distro==1.9.0 \
    anyio==4.16.0 h11==0.16.0 idna==3.20 sniffio==1.3.1 typing_extensions==4.16.0
du -sh .whl
