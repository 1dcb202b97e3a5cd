"""The native inference runtime: the ``native`` rollout engine (``native.NativeEngine``: continuous
batching over a slot KV cache, prefix cache, CUDA graphs, sleep/wake; its step planned by
``scheduler``, executed by ``runner``, its weights kept by ``weight_store``), its compact forward
(``compact``, ``families``), sampling, the CPU rollout dtype rule (``precision``) and tensor
parallelism across processes (``tensor_parallel``).

Nothing is re-exported: importing this package stays cheap; ``rollout.factory`` builds the engine.
"""
