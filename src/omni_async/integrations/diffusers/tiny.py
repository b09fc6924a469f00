"""Tiny ``DiTPipeline`` and ``WanPipeline`` with random weights: tests, docs, a first try.

Built from configs under a fixed seed (``random_pipeline``): nothing is downloaded, and
each takes a fraction of a second on the CPU.  Their shapes are those of the real
pipelines at toy scale:

* ``tiny_dit``: ``DiTTransformer2DModel`` (1000 classes, as DiT's guidance needs) +
  ``AutoencoderKL`` + ``DPMSolverMultistepScheduler``; 16x16 RGB images.
* ``tiny_wan``: ``WanTransformer3DModel`` (text dimension 32) + ``AutoencoderKLWan`` +
  ``UniPCMultistepScheduler``, no text encoder: requests send ``prompt_embeds``
  (``tiny_prompt_embeds``); videos of ``4k + 1`` frames, sides multiples of 16.

As builders: ``DiffusersPipelineWorker(builder="omni_async.integrations.diffusers.tiny:tiny_dit")``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from omni_async.integrations.diffusers.source import ComponentConfig, random_pipeline

__all__ = ["TINY_DIT", "TINY_WAN", "WAN_TEXT_DIM", "tiny_dit", "tiny_prompt_embeds", "tiny_wan"]

TINY_DIT: Mapping[str, ComponentConfig] = {
    "transformer": (
        "DiTTransformer2DModel",
        {
            "sample_size": 8,
            "num_layers": 2,
            "patch_size": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "in_channels": 4,
            "out_channels": 8,
            "attention_bias": True,
            "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": 1000,
            "norm_type": "ada_norm_zero",
            "norm_elementwise_affine": False,
        },
    ),
    "vae": (
        "AutoencoderKL",
        {
            "block_out_channels": [8, 16],
            "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
            "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
            "latent_channels": 4,
            "norm_num_groups": 8,
            "layers_per_block": 1,
        },
    ),
    "scheduler": ("DPMSolverMultistepScheduler", {}),
}

WAN_TEXT_DIM = 32
TINY_WAN: Mapping[str, ComponentConfig] = {
    "tokenizer": None,
    "text_encoder": None,
    "transformer": (
        "WanTransformer3DModel",
        {
            "patch_size": [1, 2, 2],
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": WAN_TEXT_DIM,
            "freq_dim": 256,
            "ffn_dim": 32,
            "num_layers": 2,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "rope_max_seq_len": 32,
        },
    ),
    "vae": (
        "AutoencoderKLWan",
        {
            "base_dim": 3,
            "z_dim": 16,
            "dim_mult": [1, 1, 1, 1],
            "num_res_blocks": 1,
            "temperal_downsample": [False, True, True],
        },
    ),
    "scheduler": (
        "UniPCMultistepScheduler",
        {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0},
    ),
}


def tiny_dit(seed: int = 0) -> object:
    """A tiny ``DiTPipeline`` (random weights under ``seed``)."""
    return random_pipeline("DiTPipeline", TINY_DIT, seed=seed)


def tiny_wan(seed: int = 0) -> object:
    """A tiny ``WanPipeline`` without a text encoder (random weights under ``seed``)."""
    return random_pipeline("WanPipeline", TINY_WAN, seed=seed)


def tiny_prompt_embeds(seed: int, seq: int = 8) -> torch.Tensor:
    """Stand-in text embeddings ``[1, seq, WAN_TEXT_DIM]`` for ``tiny_wan`` (a seeded draw)."""
    return torch.randn(1, seq, WAN_TEXT_DIM, generator=torch.Generator().manual_seed(seed))
