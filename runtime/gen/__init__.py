"""Generation for decoder stores (hGPT): the PLOT path replaces the lower layers.

    plot_decode      PlotDecoder: prefill by lookups (one sequence, or many at once), a step's lookups
    batched_step     one decode step for many sequences (base GEMMs once + BGMV / SGMV, or a GEMM per PET group)
    batched_prefill  the prompts a step admits in one upper-layer pass, each with its own LoRA
    lora_batch       every row's own LoRA in batched ops (BGMV: gathered A/B + bmm; SGMV: per segment)
    kv_pool          the upper layers' keys and values in one preallocated pool bounded by the budget
    batcher          continuous batching: join/leave between steps, KV budget, cancellation
    engine           the one loop every caller submits to (generate, hkstore generate, the OpenAI routes)
    sampling         greedy, temperature, top-k, top-p, seeds, stop sequences, logprobs
    api              DecoderRuntime: what runtime.open returns for a decoder store
    commands         hkstore generate
"""
