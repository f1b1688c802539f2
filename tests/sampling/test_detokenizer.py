"""Incremental detokenization (multi-byte characters split across tokens) and stop strings."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.errors import SamplingError
from pagedkv.sampling import IncrementalDetokenizer, SamplingParams
from pagedkv.sampling.detokenizer import find_stop_string

TEXTS = [
    "café 中文 😀🚀 déjà",
    "Le café est très bon. Où est l'élève?",
    "新しい単語 😀 x",  # characters the tokenizer never merged: raw byte tokens
    "family 👨‍👩‍👧 and 👍🏽!",
    "Ångström — “quotes” … résumé",
    "plain ascii only, hello world.",
]


def stream(tok, ids, params=None, prompt=(), chunks=None, **kw):
    """Feed ``ids`` in chunks (default one token each), then finish. Returns (deltas, detok)."""
    detok = IncrementalDetokenizer(tok, params, prompt_token_ids=prompt)
    deltas = []
    sizes = chunks or [1] * len(ids)
    i = 0
    for size in sizes:
        step = detok.update(ids[i:i + size], **kw)
        i += size
        deltas.append(step.delta)
        if step.finished:
            return deltas, detok
    deltas.append(detok.update([], finished=True).delta)
    return deltas, detok


# ----- text -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_stream_reproduces_decode_promptly_without_partial_characters(byte_bpe, text):
    ids = byte_bpe.encode(text).ids
    assert any("\ufffd" in byte_bpe.decode([i]) for i in ids) or text.isascii()
    detok = IncrementalDetokenizer(byte_bpe)
    emitted = ""
    for k, t in enumerate(ids, 1):
        delta = detok.update([t]).delta
        assert "\ufffd" not in delta
        emitted += delta
        full = byte_bpe.decode(ids[:k])
        if not full.endswith("\ufffd"):
            assert emitted == full  # emitted as soon as the characters are complete
        else:
            assert full.startswith(emitted)
    emitted += detok.update([], finished=True).delta
    assert emitted == text == detok.output_text
    assert detok.num_output_tokens == len(ids)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_random_token_streams_concatenate_to_decode(byte_bpe, data, skip):
    vocab = byte_bpe.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=40))
    chunks = []
    left = len(ids)
    while left:
        chunks.append(min(left, data.draw(st.integers(1, 4))))
        left -= chunks[-1]
    params = SamplingParams(skip_special_tokens=skip)
    deltas, _ = stream(byte_bpe, ids, params, chunks=chunks)
    assert "".join(deltas) == byte_bpe.decode(ids, skip_special_tokens=skip)


def test_prompt_context_continues_the_text(byte_bpe):
    prompt = byte_bpe.encode("Le café est très").ids
    out = byte_bpe.encode(" bon 中文 😀 déjà").ids
    deltas, _ = stream(byte_bpe, out, prompt=prompt)
    whole = byte_bpe.decode(prompt + out)
    assert "".join(deltas) == whole[len(byte_bpe.decode(prompt)):] == " bon 中文 😀 déjà"


def test_metaspace_leading_spaces(metaspace_bpe):
    text = "Hello world déjà vu 中文"
    ids = metaspace_bpe.encode(text).ids
    deltas, _ = stream(metaspace_bpe, ids)
    assert "".join(deltas) == metaspace_bpe.decode(ids) == text
    # After a prompt, the first output word keeps its space.
    prompt = metaspace_bpe.encode("The quick").ids
    out = metaspace_bpe.encode("brown fox").ids  # starts with "▁brown"
    deltas, _ = stream(metaspace_bpe, out, prompt=prompt)
    assert "".join(deltas) == " brown fox"


def test_transformers_and_pagedkv_tokenizer_wrappers_agree(byte_bpe):
    from transformers import PreTrainedTokenizerFast

    from pagedkv.models.tokenizer import Tokenizer

    hf = PreTrainedTokenizerFast(tokenizer_object=byte_bpe, eos_token="<eos>")
    ours = Tokenizer(byte_bpe, eos_token="<eos>")
    ids = byte_bpe.encode(TEXTS[0] + " " + TEXTS[3]).ids + [ours.eos_token_id]
    ref, _ = stream(byte_bpe, ids)
    for tok in (hf, ours):
        got, _ = stream(tok, ids)
        assert got == ref
    assert "".join(ref) == TEXTS[0] + " " + TEXTS[3]


def test_special_tokens_skipped_or_kept(byte_bpe):
    eos = byte_bpe.token_to_id("<eos>")
    ids = byte_bpe.encode("hello").ids + [eos] + byte_bpe.encode(" world").ids
    assert "".join(stream(byte_bpe, ids)[0]) == "hello world"
    kept = stream(byte_bpe, ids, SamplingParams(skip_special_tokens=False))[0]
    assert "".join(kept) == "hello<eos> world"


# ----- stop strings ------------------------------------------------------------------------------
def boundary_stop(tok, text):
    """A stop string made of the last 2 characters of one token and the first 2 of the next,
    first occurring at that boundary. Returns (stop, index of the completing token, char idx)."""
    ids = tok.encode(text).ids
    pos = 0
    for i in range(len(ids) - 1):
        a, b = tok.decode(ids[:i + 1]), tok.decode(ids[:i + 2])
        piece_a, piece_b = a[pos:], b[len(a):]
        if len(piece_a) >= 2 and len(piece_b) >= 2 and "\ufffd" not in b:
            stop = piece_a[-2:] + piece_b[:2]
            if text.find(stop) == len(a) - 2:
                return ids, stop, i + 1, len(a) - 2
        pos = len(a)
    raise AssertionError("no suitable boundary")


def test_stop_string_spanning_tokens_truncates_and_stops(byte_bpe):
    text = "The quick brown fox jumps over the lazy dog."
    ids, stop, complete_at, start = boundary_stop(byte_bpe, text)
    detok = IncrementalDetokenizer(byte_bpe, SamplingParams(stop=["zzz", stop]))
    out = ""
    for k, t in enumerate(ids):
        step = detok.update([t])
        out += step.delta
        if k < complete_at:
            assert not step.finished and step.stop_string is None
        else:
            assert step.stopped and step.finished and step.stop_string == stop
            break
    assert k == complete_at
    assert out == detok.output_text == text[:start]
    with pytest.raises(SamplingError, match="after the request finished"):
        detok.update([ids[0]])


def test_stop_string_of_multibyte_characters(byte_bpe):
    ids = byte_bpe.encode("我们学习中文和日本語").ids
    deltas, detok = stream(byte_bpe, ids, SamplingParams(stop="中文"))
    assert "".join(deltas) == detok.output_text == "我们学习"
    assert detok.stop_string == "中文"
    included = SamplingParams(stop="中文", include_stop_str_in_output=True)
    deltas, detok = stream(byte_bpe, ids, included)
    assert "".join(deltas) == detok.output_text == "我们学习中文"


def test_streamed_text_is_never_retracted(byte_bpe):
    text = "the fox jumps; the lazy dog. hello world"
    ids = byte_bpe.encode(text).ids
    for stops in (["lazy"], ["dog.", "x"], ["world"], ["zzz"], ["jumps;", "he"]):
        deltas, detok = stream(byte_bpe, ids, SamplingParams(stop=stops))
        final = detok.output_text
        assert "".join(deltas) == final
        if detok.stop_string is None:
            assert final == text
        else:
            assert final == text[:text.find(detok.stop_string)]
            assert not any(s in final for s in stops)


def test_held_back_text_is_released_when_no_stop_completes(byte_bpe):
    ids = byte_bpe.encode("hello wor").ids
    detok = IncrementalDetokenizer(byte_bpe, SamplingParams(stop=["world"]))
    shown = "".join(detok.update([t]).delta for t in ids)
    assert "hello wor".startswith(shown) and len(shown) <= len("hello wor") - 4  # 4 held back
    assert detok.update([], finished=True).delta == "hello wor"[len(shown):]


def test_min_tokens_suppresses_early_stop_strings(byte_bpe):
    text = "hello, world. hello, world."
    ids = byte_bpe.encode(text).ids
    first = byte_bpe.encode("hello, world.").ids
    deltas, detok = stream(byte_bpe, ids, SamplingParams(stop="world", min_tokens=len(first)))
    assert detok.stop_string == "world"
    assert "".join(deltas) == detok.output_text == "hello, world. hello, "
    _, detok = stream(byte_bpe, ids, SamplingParams(stop="world"))
    assert detok.output_text == "hello, "


def test_first_completed_stop_string_wins(byte_bpe):
    ids = byte_bpe.encode("hello world").ids
    cases = ((["world", "llo"], "he"), (["lo w", "llo w"], "he"), (["rld", "o"], "hell"))
    for stops, expected in cases:
        detok = IncrementalDetokenizer(byte_bpe, SamplingParams(stop=stops))
        step = detok.update(ids)  # all at once: several stop strings complete in one update
        assert step.stopped and step.delta == expected, stops


def test_stop_token_is_not_detokenized_unless_included(byte_bpe):
    eos = byte_bpe.token_to_id("<eos>")
    ids = byte_bpe.encode("hello world").ids
    dot = byte_bpe.token_to_id(".")
    detok = IncrementalDetokenizer(byte_bpe, SamplingParams(skip_special_tokens=False))
    step = detok.update(ids + [eos], stop_terminated=True)
    assert step.finished and not step.stopped and detok.output_text == "hello world"
    assert detok.num_output_tokens == len(ids) + 1
    detok = IncrementalDetokenizer(byte_bpe, SamplingParams(skip_special_tokens=False,
                                                            include_stop_str_in_output=True))
    assert detok.update(ids + [eos], stop_terminated=True).delta == "hello world<eos>"
    detok = IncrementalDetokenizer(byte_bpe, SamplingParams(stop_token_ids=[dot]))
    assert detok.update(ids + [dot], stop_terminated=True).delta == "hello world"


def test_finish_flushes_the_stop_buffer(byte_bpe):
    ids = byte_bpe.encode("abc hello").ids
    detok = IncrementalDetokenizer(byte_bpe, SamplingParams(stop=["a-very-long-stop"]))
    shown = detok.update(ids).delta
    assert shown == ""  # everything is within the 15-character hold-back
    assert detok.update([], finished=True).delta == "abc hello"


def test_find_stop_string_unit():
    assert find_stop_string("abcdef", 0, ["def", "bc"]) == ("bc", 1)
    assert find_stop_string("abcdef", 0, ["cd", "bcd"]) == ("bcd", 1)
    assert find_stop_string("abcdef", 4, ["bc"]) is None  # lies wholly in already-checked text
    assert find_stop_string("abcdef", 4, ["de"]) == ("de", 3)  # overlaps the new text
    assert find_stop_string("abc", 3, ["c"]) is None
    assert find_stop_string("abab", 2, ["ab"]) == ("ab", 2)
