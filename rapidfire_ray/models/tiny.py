"""`tiny-random`: a small, randomly initialised Llama-style model with a byte-level tokenizer.

Everything is built locally and offline, in well under a second, and nothing is cached on disk.
The weights are deterministic (seeded init) so tests can compare runs.
"""

from __future__ import annotations

import torch

NAME = "tiny-random"

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# SmolLM2-135M-Instruct's ChatML template (the same one its tokenizer_config.json carries).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Model shape (see the design brief).
HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POSITIONS = 1024
SEED = 0


def build_tokenizer():
    """A byte-level BPE with no merges: the 256 byte tokens plus the ChatML special tokens.

    Token ids: 0-255 are bytes (in ByteLevel's alphabet order), then `<|endoftext|>` (256),
    `<|im_start|>` (257), `<|im_end|>` (258). Any UTF-8 text round-trips exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(SPECIAL_TOKENS))

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=vocab_size - 1,  # <|im_end|>
        pad_token_id=vocab_size - 3,  # <|endoftext|>
    )


def _vocab_size() -> int:
    return 256 + len(SPECIAL_TOKENS)


def _seeded(model_cls, config):
    """`model_cls(config)` with its weights drawn from SEED (the caller's RNG is kept)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return model_cls(config)


def build_model(dtype: torch.dtype = torch.float32):
    """The tiny model, seeded so two builds give identical weights (the caller's RNG is kept)."""
    from transformers import LlamaForCausalLM

    model = _seeded(LlamaForCausalLM, build_config(_vocab_size()))
    model = model.to(dtype)
    model.eval()  # the same state from_pretrained leaves a model in
    return model


def build_reward_model(dtype: torch.dtype = torch.float32):
    """The tiny model's decoder (the same seeded weights as `build_model`) under a one-output
    sequence-classification head (`score`, seeded too): a reward model to train."""
    from transformers import LlamaForSequenceClassification

    config = build_config(_vocab_size())
    config.num_labels = 1
    model = _seeded(LlamaForSequenceClassification, config)
    model.model.load_state_dict(build_model(torch.float32).model.state_dict())
    model = model.to(dtype)
    model.eval()
    return model


def num_parameters() -> int:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(build_config(_vocab_size()))
    return sum(p.numel() for p in model.parameters())
