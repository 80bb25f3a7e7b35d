"""Qwen3-MoE (`Qwen3MoeForCausalLM`): config, loader, decoder, family, tiny model."""
