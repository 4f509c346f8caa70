"""A tiny randomly initialised Llama with a word-level tokenizer and a ChatML template, built offline.

Small enough to load in a second, big enough for vLLM's CPU attention (head_dim 32 is its minimum). The
vocabulary is a few dozen words so that a random model ends an utterance (``<|im_end|>``) often enough for
multi-turn conversations within a small ``max_tokens``. Used by the serving, generation and training tests:

    from tests.tiny_model import build_tiny_model
    path = build_tiny_model(tmp_path / "tiny")
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>", "<pad>"]
WORDS = (
    "Alice Bob system user assistant : < > / A boxed { } \\ answer is the a of and to 0 1 2 3 4 5 6 7 8 9 + = ."
).split()
# ChatML, as SmolLM2-135M-Instruct: every message is "<|im_start|>role\ncontent<|im_end|>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over ``SPECIAL_TOKENS + WORDS`` with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        model_max_length=4096,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(path: Path, seed: int = 0, eos_probability: float = 0.15) -> Path:
    """Save a random Llama (hidden 64, 2 layers, head_dim 32) with its tokenizer to ``path``; return ``path``.

    Args:
        path: Folder to write (created).
        seed: Seed of the random weights.
        eos_probability: About how likely ``<|im_end|>`` is at each step (see ``_bias_towards_eos``).
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)  # test helper: a reproducible random model
    model = LlamaForCausalLM(config)
    _bias_towards_eos(model, config.eos_token_id, eos_probability)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _bias_towards_eos(model, eos_id: int, probability: float) -> None:
    """Make ``eos_id`` about ``probability`` likely at every step, whatever the input.

    A random model's next-token distribution is close to uniform, so it rarely ends a message. Every embedding gets
    a constant 1.0 in dimension 0, which dominates the (small, random) residual stream, so the final RMSNorm output
    has a nearly constant dimension 0 of about ``sqrt(hidden_size)``. Only the EOS row of the (untied) LM head reads
    that dimension, which adds a constant logit to EOS and leaves the other tokens near uniform.
    """
    import math

    import torch

    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    target_logit = math.log(probability * (vocab - 1) / (1 - probability))  # softmax against vocab-1 logits ~0
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos_id, 0] = target_logit / math.sqrt(hidden)
