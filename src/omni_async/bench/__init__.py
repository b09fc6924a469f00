"""What ``omni-async bench`` brings besides the runtime: the output paths it measures ours against.

``omni_async.bench.paths`` holds the seed's and the reference implementation's output
paths (``WorkerOptions.output_path="sync"`` and ``"reference"``).  They reach the worker
through the runtime's extension point, ``omni_async.worker.output_path``; nothing in the
runtime (core, transport, worker, executor, engine) imports this package (a contract in
pyproject.toml), and this package sees only the worker interface, the transport and the
core.
"""
