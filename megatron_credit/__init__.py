"""megatron-credit: RL post-training on megatron-core with token-level credit assignment."""
__version__ = "0.1.0"
