"""The embedded default's tokenizer: byte-level BPE trained locally on the environment's text
(`Environment.corpus_text`, ops/envs; the calculator world by default).

Two choices make token-in/token-out episodes exact: the newline is always a token of its own
(every model turn and tool result is one line, and generation stops on it), and digits are
split one per token (numbers are copied digit by digit). Because every turn ends in a newline,
tokenizing a whole episode gives the same ids as tokenizing its turns one by one.
"""

from __future__ import annotations

from pathlib import Path

from ops.envs import Environment, get_environment

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]


def train_tokenizer(vocab_size: int = 512, seed: int = 0, env: Environment | None = None):
    """A `tokenizers.Tokenizer` trained on the environment's corpus (every family, solved)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((env or get_environment()).corpus_text(seed=seed), trainer=trainer)
    # Reserved tokens fill the vocabulary to the model's size, so every id the policy can sample
    # decodes to something (and an episode that samples one is simply wrong, not a crash).
    reserved = [f"<reserved_{i}>" for i in range(vocab_size - tok.get_vocab_size())]
    tok.add_tokens(reserved)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])
    return tok


def save_hf_tokenizer(tok, out_dir: Path, model_max_length: int = 256) -> None:
    """Save in HF format (tokenizer.json + tokenizer_config.json) for transformers and vLLM."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        model_max_length=model_max_length,
    )
    hf.save_pretrained(str(out_dir))


def load_hf_tokenizer(model_dir: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def newline_id(tokenizer) -> int:
    ids = tokenizer.encode("\n", add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError("tokenizer does not keep the newline as a single token")
    return ids[0]
