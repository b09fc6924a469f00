"""``omni-async demo``, README's main job, run as a user runs it: a real subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from omni_async.models.tiny import image_digest


@pytest.mark.parametrize("executor", ["multiproc", "inproc"])
def test_demo_checks_every_output_and_leaves_nothing_behind(executor: str) -> None:
    cmd = [sys.executable, "-m", "omni_async.cli", "demo", "--executor", executor, "--requests", "6", "--batch", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 requests:" in done.stdout and "; 0 mismatched" in done.stdout
    assert "delivered=6," in done.stdout and "pending_outputs=0," in done.stdout
    if executor == "multiproc":
        assert "0 still leased" in done.stdout


def test_demo_refuses_cuda_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = subprocess.run(
        [sys.executable, "-m", "omni_async.cli", "demo", "--device", "cuda"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "CUDA requested but not available" in done.stderr


def test_the_demo_digest_sees_one_flipped_bit_and_one_swap() -> None:
    img = torch.rand(64, 64, generator=torch.Generator().manual_seed(3)) * 255
    d = int(image_digest(img))
    assert int(image_digest(img.clone())) == d
    flipped = img.clone()
    flipped.view(torch.int32)[7, 9] ^= 1  # the lowest mantissa bit
    assert int(image_digest(flipped)) != d
    swapped = img.clone()
    swapped[0, 0], swapped[0, 1] = img[0, 1], img[0, 0]
    assert int(image_digest(swapped)) != d
