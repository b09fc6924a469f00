"""The engine side: an asyncio engine over any executor (``AsyncDiffusionEngine``), its
scheduler, post-processing off the event loop, metrics, and a synchronous facade
(``DiffusionEngine``)."""
