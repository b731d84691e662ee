"""flatshard benchmarks: flatshard against torch FSDP2, FSDP1, DDP and local training.

Standalone on purpose (nothing from ``tests/``). One module per concern:

- ``models``      the workloads' models and data (GPT, many small units, one blob unit)
- ``peers``       how each peer wraps a model, steps it, and reports its gradients
- ``dist_env``    process launch, backend/device choice, rank agreement helpers
- ``timing``      interleaved timed rounds and statistics
- ``guard``       the correctness guard run before any timing
- ``workloads``   the ``gpt``, ``many-small-units`` and ``collectives`` workloads
- ``memory``      per-rank memory of every peer (allocator events / CUDA peak)
- ``report``      JSON, Markdown table, plots, RESULTS.md
- ``trace``       ``--profile``: a Chrome trace of one flatshard step
"""
