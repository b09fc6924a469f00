"""Tiny pipelines of ten diffusers families with random weights: tests, docs, a first try.

Built from configs under a fixed seed (``random_pipeline``): nothing is downloaded, and
each takes a fraction of a second on the CPU.  Their shapes are those of the real
pipelines at toy scale:

* ``tiny_dit``: ``DiTTransformer2DModel`` (1000 classes, as DiT's guidance needs) +
  ``AutoencoderKL`` + ``DPMSolverMultistepScheduler``; 16x16 RGB images.
* ``tiny_wan``: ``WanTransformer3DModel`` (text dimension 32) + ``AutoencoderKLWan`` +
  ``UniPCMultistepScheduler``, no text encoder: requests send ``prompt_embeds``
  (``tiny_prompt_embeds``); videos of ``4k + 1`` frames, sides multiples of 16.

* ``tiny_family(name)``: the other families of ``FAMILIES`` -- ``"sd"`` (Stable
  Diffusion), ``"sdxl"``, ``"sd3"``, ``"flux"``, ``"pixart"`` (PixArt-Sigma), ``"sana"``,
  ``"ddim"``, ``"cogvideox"``, ``"ltx"`` -- without text encoders (text dimension
  ``TEXT_DIM``, pooled ``POOLED_DIM``): requests send embeddings.  With ``text=True``
  (every family that has a text encoder, Wan too) the pipeline gets tiny random text
  encoders and a word-level tokenizer made in memory (``TEXT_ENCODERS``): requests may
  send a ``prompt``.

As builders: ``DiffusersPipelineWorker(builder="omni_async.integrations.diffusers.tiny:tiny_dit")``,
``DiffusersPipelineWorker(builder="omni_async.integrations.diffusers.tiny:tiny_family",
builder_kwargs={"name": "flux"})``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, cast

import torch

from omni_async.integrations.diffusers.source import ComponentConfig, random_pipeline

__all__ = [
    "FAMILIES",
    "POOLED_DIM",
    "TEXT_DIM",
    "TEXT_ENCODERS",
    "TINY_DIT",
    "TINY_WAN",
    "TINY_WORDS",
    "TOKENS",
    "WAN_TEXT_DIM",
    "tiny_dit",
    "tiny_family",
    "tiny_prompt_embeds",
    "tiny_sd_with_text",
    "tiny_tokenizer",
    "tiny_wan",
    "with_text_encoders",
]

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


_VAE_4 = {
    "block_out_channels": [8, 16],
    "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
    "latent_channels": 4,
    "norm_num_groups": 8,
    "layers_per_block": 1,
}
#: The text dimension of every tiny family below, and SDXL's (and SD3's, Flux's) pooled one.
TEXT_DIM = 16
POOLED_DIM = 8

#: Tiny configs of the other families, built by ``tiny_family(name)`` (no text encoder:
#: requests send embeddings).  Each entry: the pipeline class, its components, and
#: keyword arguments of its ``__init__`` that are not components.
FAMILIES: Mapping[str, tuple[str, Mapping[str, ComponentConfig], Mapping[str, object]]] = {
    "sd": (
        "StableDiffusionPipeline",
        {
            "vae": ("AutoencoderKL", _VAE_4),
            "text_encoder": None,
            "tokenizer": None,
            "unet": (
                "UNet2DConditionModel",
                {
                    "block_out_channels": [8, 16],
                    "layers_per_block": 1,
                    "sample_size": 8,
                    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
                    "cross_attention_dim": TEXT_DIM,
                    "norm_num_groups": 8,
                    "attention_head_dim": 2,
                },
            ),
            "scheduler": ("DDIMScheduler", {"clip_sample": False, "set_alpha_to_one": False}),
            "safety_checker": None,
            "feature_extractor": None,
        },
        {"requires_safety_checker": False},
    ),
    "sdxl": (
        "StableDiffusionXLPipeline",
        {
            "vae": ("AutoencoderKL", _VAE_4),
            "text_encoder": None,
            "text_encoder_2": None,
            "tokenizer": None,
            "tokenizer_2": None,
            "unet": (
                "UNet2DConditionModel",
                {
                    "block_out_channels": [8, 16],
                    "layers_per_block": 1,
                    "sample_size": 8,
                    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
                    "cross_attention_dim": TEXT_DIM,
                    "norm_num_groups": 8,
                    "attention_head_dim": 2,
                    "addition_embed_type": "text_time",
                    "addition_time_embed_dim": 4,
                    "projection_class_embeddings_input_dim": POOLED_DIM + 6 * 4,
                    "transformer_layers_per_block": 1,
                },
            ),
            "scheduler": ("EulerDiscreteScheduler", {}),
        },
        {},
    ),
    "sd3": (
        "StableDiffusion3Pipeline",
        {
            "transformer": (
                "SD3Transformer2DModel",
                {
                    "sample_size": 8,
                    "patch_size": 2,
                    "in_channels": 4,
                    "num_layers": 1,
                    "attention_head_dim": 8,
                    "num_attention_heads": 2,
                    "joint_attention_dim": TEXT_DIM,
                    "caption_projection_dim": 16,
                    "pooled_projection_dim": POOLED_DIM,
                    "out_channels": 4,
                    "pos_embed_max_size": 16,
                },
            ),
            "scheduler": ("FlowMatchEulerDiscreteScheduler", {}),
            "vae": ("AutoencoderKL", {**_VAE_4, "shift_factor": 0.0609, "scaling_factor": 1.5035}),
            "text_encoder": None,
            "tokenizer": None,
            "text_encoder_2": None,
            "tokenizer_2": None,
            "text_encoder_3": None,
            "tokenizer_3": None,
        },
        {},
    ),
    "flux": (
        "FluxPipeline",
        {
            "scheduler": ("FlowMatchEulerDiscreteScheduler", {}),
            "vae": ("AutoencoderKL", {**_VAE_4, "shift_factor": 0.1159, "scaling_factor": 0.3611}),
            "text_encoder": None,
            "tokenizer": None,
            "text_encoder_2": None,
            "tokenizer_2": None,
            "transformer": (
                "FluxTransformer2DModel",
                {
                    "patch_size": 1,
                    "in_channels": 16,
                    "num_layers": 1,
                    "num_single_layers": 1,
                    "attention_head_dim": 16,
                    "num_attention_heads": 2,
                    "joint_attention_dim": TEXT_DIM,
                    "pooled_projection_dim": POOLED_DIM,
                    "axes_dims_rope": [4, 6, 6],
                },
            ),
        },
        {},
    ),
    "pixart": (
        "PixArtSigmaPipeline",
        {
            "tokenizer": None,
            "text_encoder": None,
            "vae": (
                "AutoencoderKL",
                {
                    **_VAE_4,
                    "block_out_channels": [8, 8, 8, 8],
                    "down_block_types": ["DownEncoderBlock2D"] * 4,
                    "up_block_types": ["UpDecoderBlock2D"] * 4,
                },
            ),
            "transformer": (
                "PixArtTransformer2DModel",
                {
                    # 32: PixArt's resolution binning knows sample sizes 32 (256 px), 64, 128, 256 only.
                    "sample_size": 32,
                    "num_layers": 1,
                    "patch_size": 2,
                    # A hidden size (24) other than the text dimension (16): the check reads the right one.
                    "attention_head_dim": 12,
                    "num_attention_heads": 2,
                    "caption_channels": TEXT_DIM,
                    "in_channels": 4,
                    "cross_attention_dim": 24,
                    "out_channels": 8,
                    "attention_bias": True,
                    "activation_fn": "gelu-approximate",
                    "num_embeds_ada_norm": 1000,
                    "norm_type": "ada_norm_single",
                    "norm_elementwise_affine": False,
                    "norm_eps": 1e-6,
                },
            ),
            "scheduler": ("DPMSolverMultistepScheduler", {}),
        },
        {},
    ),
    "sana": (
        "SanaPipeline",
        {
            "tokenizer": None,
            "text_encoder": None,
            # A deep-compression VAE of two blocks (scale factor 2), as diffusers' own tests build it.
            "vae": (
                "AutoencoderDC",
                {
                    "in_channels": 3,
                    "latent_channels": 4,
                    "attention_head_dim": 2,
                    "encoder_block_types": ["ResBlock", "EfficientViTBlock"],
                    "decoder_block_types": ["ResBlock", "EfficientViTBlock"],
                    "encoder_block_out_channels": [8, 8],
                    "decoder_block_out_channels": [8, 8],
                    "encoder_qkv_multiscales": [[], [5]],
                    "decoder_qkv_multiscales": [[], [5]],
                    "encoder_layers_per_block": [1, 1],
                    "decoder_layers_per_block": [1, 1],
                    "downsample_block_type": "conv",
                    "upsample_block_type": "interpolate",
                    "decoder_norm_types": "rms_norm",
                    "decoder_act_fns": "silu",
                    "scaling_factor": 0.41407,
                },
            ),
            "transformer": (
                "SanaTransformer2DModel",
                {
                    # 16: Sana's resolution binning knows sample sizes 16 (512 px), 32, 64, 128 only.
                    "sample_size": 16,
                    "patch_size": 1,
                    "in_channels": 4,
                    "out_channels": 4,
                    "num_layers": 1,
                    "num_attention_heads": 2,
                    "attention_head_dim": 4,
                    "num_cross_attention_heads": 2,
                    "cross_attention_head_dim": 4,
                    "cross_attention_dim": 8,
                    "caption_channels": TEXT_DIM,
                },
            ),
            "scheduler": ("DPMSolverMultistepScheduler", {}),
        },
        {},
    ),
    "ddim": (
        "DDIMPipeline",
        {
            "unet": (
                "UNet2DModel",
                {
                    "block_out_channels": [8, 16],
                    "layers_per_block": 1,
                    "sample_size": 8,
                    "in_channels": 3,
                    "out_channels": 3,
                    "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
                    "up_block_types": ["AttnUpBlock2D", "UpBlock2D"],
                    "norm_num_groups": 8,
                    "attention_head_dim": 4,
                },
            ),
            "scheduler": ("DDIMScheduler", {}),
        },
        {},
    ),
    "cogvideox": (
        "CogVideoXPipeline",
        {
            "tokenizer": None,
            "text_encoder": None,
            "vae": (
                "AutoencoderKLCogVideoX",
                {
                    "down_block_types": ["CogVideoXDownBlock3D"] * 4,
                    "up_block_types": ["CogVideoXUpBlock3D"] * 4,
                    "block_out_channels": [8, 8, 8, 8],
                    "latent_channels": 4,
                    "layers_per_block": 1,
                    "norm_num_groups": 2,
                    "temporal_compression_ratio": 4,
                },
            ),
            "transformer": (
                "CogVideoXTransformer3DModel",
                {
                    "num_attention_heads": 2,
                    "attention_head_dim": 8,
                    "in_channels": 4,
                    "out_channels": 4,
                    "time_embed_dim": 2,
                    "text_embed_dim": TEXT_DIM,
                    "num_layers": 1,
                    "sample_width": 2,
                    "sample_height": 2,
                    "sample_frames": 9,
                    "patch_size": 2,
                    "temporal_compression_ratio": 4,
                    "max_text_seq_length": 8,
                },
            ),
            "scheduler": ("CogVideoXDDIMScheduler", {}),
        },
        {},
    ),
    "ltx": (
        "LTXPipeline",
        {
            "scheduler": ("FlowMatchEulerDiscreteScheduler", {}),
            "vae": (
                "AutoencoderKLLTXVideo",
                {
                    "latent_channels": 8,
                    "block_out_channels": [8, 8, 8, 8],
                    "decoder_block_out_channels": [8, 8, 8, 8],
                    "layers_per_block": [1, 1, 1, 1, 1],
                    "decoder_layers_per_block": [1, 1, 1, 1, 1],
                    "spatio_temporal_scaling": [True, True, False, False],
                    "decoder_spatio_temporal_scaling": [True, True, False, False],
                    "decoder_inject_noise": [False, False, False, False, False],
                    "upsample_residual": [False, False, False, False],
                    "upsample_factor": [1, 1, 1, 1],
                    "timestep_conditioning": False,
                    "patch_size": 1,
                    "patch_size_t": 1,
                    "encoder_causal": True,
                    "decoder_causal": False,
                },
            ),
            "text_encoder": None,
            "tokenizer": None,
            "transformer": (
                "LTXVideoTransformer3DModel",
                {
                    "in_channels": 8,
                    "out_channels": 8,
                    "patch_size": 1,
                    "patch_size_t": 1,
                    "num_attention_heads": 2,
                    "attention_head_dim": 8,
                    "cross_attention_dim": 16,
                    "num_layers": 1,
                    "caption_channels": TEXT_DIM,
                },
            ),
        },
        {},
    ),
}


#: The words the tiny tokenizer knows (any other is ``<unk>``).
TINY_WORDS = ("<pad>", "<unk>", "<s>", "</s>", "a", "red", "blue", "cat", "dog", "blurry", "photo", "of")
#: The tokenizer's length: the CLIP encoders' positions, and the sequence every T5/Gemma
#: encoder is asked for (requests send ``max_sequence_length=TOKENS``: ``text_params``).
TOKENS = 8

#: Per family: the text encoders ``tiny_family(name, text=True)`` adds, as (encoder's
#: component, tokenizer's component, transformers class, its config).  Their widths add
#: up to the denoiser's text dimension as the pipeline's own encode_prompt combines them
#: (SDXL and SD3 concatenate two CLIPs' hidden states and their pooled projections).
_CLIP = {"intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": TOKENS}
_T5 = {"d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2, "relative_attention_num_buckets": 8}
TEXT_ENCODERS: Mapping[str, tuple[tuple[str, str, str, Mapping[str, object]], ...]] = {
    "sd": (("text_encoder", "tokenizer", "CLIPTextModel", {**_CLIP, "hidden_size": TEXT_DIM}),),
    "sdxl": (
        ("text_encoder", "tokenizer", "CLIPTextModel", {**_CLIP, "hidden_size": TEXT_DIM // 2}),
        (
            "text_encoder_2",
            "tokenizer_2",
            "CLIPTextModelWithProjection",
            {**_CLIP, "hidden_size": TEXT_DIM // 2, "projection_dim": POOLED_DIM},
        ),
    ),
    "sd3": (
        (
            "text_encoder",
            "tokenizer",
            "CLIPTextModelWithProjection",
            {**_CLIP, "hidden_size": TEXT_DIM // 2, "projection_dim": POOLED_DIM // 2},
        ),
        (
            "text_encoder_2",
            "tokenizer_2",
            "CLIPTextModelWithProjection",
            {**_CLIP, "hidden_size": TEXT_DIM // 2, "projection_dim": POOLED_DIM // 2},
        ),
        ("text_encoder_3", "tokenizer_3", "T5EncoderModel", {**_T5, "d_model": TEXT_DIM}),
    ),
    "flux": (
        ("text_encoder", "tokenizer", "CLIPTextModel", {**_CLIP, "hidden_size": POOLED_DIM}),
        ("text_encoder_2", "tokenizer_2", "T5EncoderModel", {**_T5, "d_model": TEXT_DIM}),
    ),
    "pixart": (("text_encoder", "tokenizer", "T5EncoderModel", {**_T5, "d_model": TEXT_DIM}),),
    "sana": (
        (
            "text_encoder",
            "tokenizer",
            "Gemma2Model",
            {
                "hidden_size": TEXT_DIM,
                "head_dim": 8,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
            },
        ),
    ),
    "cogvideox": (("text_encoder", "tokenizer", "T5EncoderModel", {**_T5, "d_model": TEXT_DIM}),),
    "ltx": (("text_encoder", "tokenizer", "T5EncoderModel", {**_T5, "d_model": TEXT_DIM}),),
    "wan": (("text_encoder", "tokenizer", "UMT5EncoderModel", {**_T5, "d_model": WAN_TEXT_DIM}),),
}


def tiny_tokenizer() -> object:
    """A word-level tokenizer over ``TINY_WORDS``, made in memory (nothing downloaded)."""
    tokenizers = importlib.import_module("tokenizers")
    transformers = importlib.import_module("transformers")
    vocab = {word: i for i, word in enumerate(TINY_WORDS)}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words,
        model_max_length=TOKENS,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


def with_text_encoders(pipe: object, name: str, seed: int = 0) -> object:
    """``pipe`` (family ``name``) made again with tiny random text encoders and in-memory
    tokenizers (``TEXT_ENCODERS``): requests may then send a ``prompt``.  Made again
    rather than given the modules afterwards: a pipeline's ``__init__`` reads its
    tokenizers' lengths (Flux's and SD3's ``tokenizer_max_length``)."""
    transformers = importlib.import_module("transformers")
    parts: dict[str, object] = dict(cast("Any", pipe).components)
    ids = {"vocab_size": len(TINY_WORDS), "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        for encoder, tokenizer, class_name, config in TEXT_ENCODERS[name]:
            model_class = getattr(transformers, class_name)
            made = model_class(model_class.config_class(**ids, **config)).eval()
            parts[encoder], parts[tokenizer] = made, tiny_tokenizer()
    options = dict(FAMILIES[name][2]) if name in FAMILIES else {}
    return type(pipe)(**parts, **options)


def tiny_family(name: str, seed: int = 0, text: bool = False) -> object:
    """A tiny pipeline of family ``name`` (a key of ``FAMILIES``, or ``"wan"``), random
    weights under ``seed``; ``text``: with text encoders (``with_text_encoders``)."""
    if name == "wan":
        pipe = tiny_wan(seed)
    else:
        pipeline, components, options = FAMILIES[name]
        pipe = random_pipeline(pipeline, components, seed=seed, options=options)
    return with_text_encoders(pipe, name, seed) if text else pipe


def tiny_sd_with_text(seed: int = 0) -> object:
    """``tiny_family("sd", text=True)``: requests send a ``prompt``."""
    return tiny_family("sd", seed, text=True)


def tiny_dit(seed: int = 0) -> object:
    """A tiny ``DiTPipeline`` (random weights under ``seed``)."""
    return random_pipeline("DiTPipeline", TINY_DIT, seed=seed)


def tiny_wan(seed: int = 0) -> object:
    """A tiny ``WanPipeline`` without a text encoder (random weights under ``seed``)."""
    return random_pipeline("WanPipeline", TINY_WAN, seed=seed)


def tiny_prompt_embeds(seed: int, seq: int = 8) -> torch.Tensor:
    """Stand-in text embeddings ``[1, seq, WAN_TEXT_DIM]`` for ``tiny_wan`` (a seeded draw)."""
    return torch.randn(1, seq, WAN_TEXT_DIM, generator=torch.Generator().manual_seed(seed))
