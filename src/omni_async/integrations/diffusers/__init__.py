"""Serve any Hugging Face ``diffusers`` ``DiffusionPipeline`` as an omni_async worker model.

::

    from omni_async import MultiprocDiffusionExecutor
    from omni_async.integrations.diffusers import DiffusersPipelineWorker

    spec = DiffusersPipelineWorker.spec(builder="omni_async.integrations.diffusers.tiny:tiny_dit")
    with MultiprocDiffusionExecutor(spec) as executor:
        ...

The names (docs/diffusers.md shows them at work):

* ``DiffusersPipelineWorker``: the worker model (``worker``).
* ``PipelineSource``, ``random_pipeline``: where the pipeline comes from (``source``).
* ``PipelineProfile``, ``batch_key``: what it takes, read from its ``__call__`` and its
  config (``profile``); ``DiffusersPipelineWorker.parameter_schema(...)`` as data.
* ``decode_of``: each family's own decode, for previews and ``decode="device"`` (``decode``).
* ``tiny_family``: tiny random pipelines of eleven families, with tiny text encoders on request (``tiny``).
* ``PIPELINE``, ``host_stage``, ``device_stage``, ``to_uint8``: its post-process to uint8
  pixels, registered as ``"diffusers"`` (``pixels``).

``diffusers`` itself is imported when a pipeline is built or its config read, not when
this package is imported; nothing else in ``omni_async`` imports this package.
"""

from __future__ import annotations

from omni_async.integrations.diffusers.decode import decode_of
from omni_async.integrations.diffusers.pixels import (
    PIPELINE,
    device_stage,
    host_stage,
    to_uint8,
)
from omni_async.integrations.diffusers.profile import PipelineProfile, batch_key
from omni_async.integrations.diffusers.source import PipelineSource, random_pipeline
from omni_async.integrations.diffusers.tiny import tiny_family
from omni_async.integrations.diffusers.worker import DiffusersPipelineWorker

__all__ = [
    "PIPELINE",
    "DiffusersPipelineWorker",
    "PipelineProfile",
    "PipelineSource",
    "batch_key",
    "decode_of",
    "device_stage",
    "host_stage",
    "random_pipeline",
    "tiny_family",
    "to_uint8",
]
