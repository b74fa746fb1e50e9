"""A small byte-level BPE tokenizer trained offline on text that ships with Python.

Byte-level BPE splits multi-byte characters across tokens, which is what the incremental
detokenizer has to cope with, so tests get that case for free.
"""

from __future__ import annotations

import pydoc_data.topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with `<unk>`=0, `<s>`=1, `</s>`=2 and a chat template."""
    text = "\n".join(pydoc_data.topics.topics.values())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((text[i : i + 10000] for i in range(0, len(text), 10000)), trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf
