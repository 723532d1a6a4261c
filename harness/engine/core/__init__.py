"""The engine core: model, tokenizer, sampling, paged KV cache and its offload tiers, scheduler,
speculative decoding, the step loop (``engine_core.EngineCore``), the oracle, and the
``EngineClient`` types and implementations. Nothing here knows about processes or sockets."""
