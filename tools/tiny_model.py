"""Write a tiny random-weight mlx-lm model folder (llama, 2 layers, byte-level tokenizer).

For checks that need a whole model folder as mlx-lm loads it (``mlx_lm.load``, mlx-lm's
and our command lines) but no network and no download: the wheel smoke test
(``tools/wheel_smoke.py``) and the prompt-cache file test (``tests/commands/test_mlx_lm_reads_our_files.py``).
The weights are seeded, so two folders written with one seed are identical.

Usage: ``python tools/tiny_model.py FOLDER``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIAL = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(folder: Path) -> int:
    """A byte-level BPE without merges (every byte one token) plus the chat tokens; its vocab size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[0], "eos_token": SPECIAL[1],
        "pad_token": SPECIAL[1], "add_bos_token": False, "chat_template": CHAT_TEMPLATE}, indent=2))
    return tok.get_vocab_size()


def write_tiny_model(folder, seed: int = 0) -> Path:
    """Write the folder (created if missing) and return it: ``config.json``, ``model.safetensors``
    (float32), ``tokenizer.json``, ``tokenizer_config.json``. 2 layers, 4 query heads, 2 KV heads
    (GQA), head_dim 16."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "vocab_size": vocab, "tie_word_embeddings": True, "max_position_embeddings": 4096,
              "eos_token_id": vocab - 1, "torch_dtype": "float32"}
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


if __name__ == "__main__":
    print(write_tiny_model(sys.argv[1]))
