"""A tiny random llama saved as an mlx-lm model folder (weights, config, a byte-level tokenizer),
so that tests can run code written for ``mlx_lm.load(path)`` unchanged."""

from __future__ import annotations

from pathlib import Path

VOCAB = 257  # 256 bytes + an end-of-sequence token


def byte_tokenizer():
    """A Hugging Face fast tokenizer over the 256 byte-level symbols (no merges) and ``<eos>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_model_folder(path: Path, head_dim: int = 128, seed: int = 0) -> Path:
    """Write a 2-layer float32 llama (2 query heads over 1 KV head of ``head_dim``; weights
    scaled by 3 so that greedy tokens vary) with :func:`byte_tokenizer` into ``path``."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, rms_norm_eps=1e-5,
                  vocab_size=VOCAB, rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p * 3, model.parameters()))
    mx.eval(model.parameters())
    path = Path(path)
    save_model(path, model)
    save_config(config, path / "config.json")
    byte_tokenizer().save_pretrained(path)
    return path
