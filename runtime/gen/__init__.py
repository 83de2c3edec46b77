"""Generation for decoder stores (hGPT): the PLOT path with per-sequence KV caches."""
