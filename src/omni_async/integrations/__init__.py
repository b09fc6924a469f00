"""Adapters that serve third-party pipelines as omni_async worker models.

An integration is a model for workers: it may import the worker, transport and core
layers, and nothing in ``omni_async`` imports it (the import contract in
``pyproject.toml`` says so), so ``import omni_async`` never pulls a framework in.  Each
sub-package imports its framework only when it is used:

* ``omni_async.integrations.diffusers``: any Hugging Face ``diffusers``
  ``DiffusionPipeline`` as a worker model (the ``diffusers`` extra).
"""
