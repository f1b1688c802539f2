"""Tokenizers trained offline in the test session (byte-level BPE and a Metaspace BPE), on a small
corpus with multi-byte characters, so UTF-8 sequences split across tokens occur."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "Le café est très bon. Où est l'élève? déjà vu, à bientôt.",
    "中文分词很有趣。我们学习中文和日本語。",
    "Emoji time 😀🎉🚀 and 👍🏽 thumbs; family 👨‍👩‍👧.",
    "The quick brown fox jumps over the lazy dog. Hello world! hello, world.",
    "naïve façade coöperate Ångström résumé — “quotes” and ‘single’ … ellipsis",
] * 20

SPECIALS = ["<eos>", "<bos>"]


@pytest.fixture(scope="session")
def byte_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="session")
def metaspace_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", *SPECIALS], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok
