"""Checkpoints the tests make themselves, as a user's would be: a tiny byte-level BPE tokenizer
trained here with a chat template in ChatML form (Qwen's), and a tiny random ``transformers`` model
sized to it, each written by the libraries' own ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A chat template of the ChatML form Qwen's checkpoints ship (without their tool-call parts)."""

CORPUS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
          "How many clips did Natalia sell altogether? The answer is 72. #### 72",
          "Please reason step by step, and put your final answer within \\boxed{}.",
          "What is 12 + 30? 12 + 30 = 42 so the answer is \\boxed{42}. 0123456789 +-*/=()"]


def chat_tokenizer(directory: Path, *, vocab_size: int = 400, chat: bool = True) -> Path:
    """A byte-level BPE tokenizer in ``directory`` (``tokenizer.json``, ``tokenizer_config.json``,
    the chat template when ``chat``), with ``<|endoftext|>`` as padding and ``<|im_end|>`` as the
    end of a turn, as Qwen's instruct checkpoints have them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat:
        fast.chat_template = CHATML
    fast.save_pretrained(str(directory))
    return Path(directory)


def tiny_model(directory: Path, vocab_size: int, *, model_type: str = "qwen2", eos_token_id=None,
               seed: int = 0, **shape) -> Path:
    """A tiny random ``transformers`` causal LM of ``model_type`` in ``directory`` (float32)."""
    import torch
    import transformers

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, **shape)
    config = transformers.AutoConfig.for_model(model_type, vocab_size=vocab_size, eos_token_id=eos_token_id, **sizes)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(directory))
    return Path(directory)
