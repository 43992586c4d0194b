"""Model configs the planner knows without a download: the architecture fields of each model's Hugging Face
``config.json`` (copied from https://huggingface.co/<id>/blob/main/config.json). Any other model: pass its
``config.json`` path."""

_QWEN2 = {"model_type": "qwen2", "hidden_act": "silu", "torch_dtype": "bfloat16"}

_QWEN25_7B = {**_QWEN2, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
              "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}

PRESETS: dict[str, dict] = {
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    "Qwen/Qwen2.5-7B": {**_QWEN25_7B, "max_position_embeddings": 131072},
    # https://huggingface.co/Qwen/Qwen2.5-Math-7B/blob/main/config.json (LUFFY's base model): the 7B shape, a 4k context
    "Qwen/Qwen2.5-Math-7B": {**_QWEN25_7B, "max_position_embeddings": 4096},
    # https://huggingface.co/Qwen/Qwen2.5-1.5B/blob/main/config.json
    "Qwen/Qwen2.5-1.5B": {**_QWEN2, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                          "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                          "max_position_embeddings": 131072, "tie_word_embeddings": True},
    # https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/blob/main/config.json (the GPU smoke test's default model)
    "Qwen/Qwen2.5-0.5B-Instruct": {**_QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                                   "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                                   "max_position_embeddings": 32768, "tie_word_embeddings": True},
}
