"""Generation for decoder stores (hGPT): the PLOT path replaces the lower layers.

    plot_decode   PlotDecoder: prefill by lookups, per-sequence KV caches for the upper layers
    batched_step  one decode step for many sequences (a GEMM per PET group)
    batcher       continuous batching: join/leave between steps, KV budget, cancellation
    sampling      greedy, temperature, top-k, top-p, seeds, stop sequences, logprobs
    commands      hkstore generate
"""
