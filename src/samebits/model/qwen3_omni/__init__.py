"""The Qwen3-Omni thinker: config, loader, model, prompt inputs, family, tiny model."""
