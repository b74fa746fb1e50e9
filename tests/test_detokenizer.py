"""Tests for fastgen.engine.detokenizer: incremental decoding, stop strings and their combination."""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from kit_tokenizer import build_tokenizer  # noqa: E402

from fastgen.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher, TextStream  # noqa: E402

EOS = 2
ENGLISH = (
    "The quick brown fox jumps over the lazy dog. Built-in functions such as len() and "
    "isinstance() are always available;\n  indentation matters in Python!"
)
NON_ASCII = "héllo wörld 日本語 😀 — ç'est «déjà» vu: Ωμέγα, Москва, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧 ok"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def stream(tok, prompt, ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.append(i) for i in ids]
    tail = detok.flush()
    return detok, deltas, tail


@pytest.mark.parametrize(
    "text", [ENGLISH, NON_ASCII, "日本語", "😀😀😀", "ab\u00e9\u0800\U00010000"]
)
@pytest.mark.parametrize("prompt_text", ["", "Question: ", "préfixe 日"])
def test_stream_matches_decode_for_valid_text(tok, text, prompt_text):
    ids = tok.encode(text)
    prompt = tok.encode(prompt_text)
    detok, deltas, tail = stream(tok, prompt, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == text
    assert detok.text == text
    assert tail == ""  # valid text completes before flush
    assert all("\ufffd" not in d for d in deltas)


def test_split_characters_are_held_then_released(tok):
    ids = tok.encode("日本")
    assert len(ids) > 2  # byte-level BPE splits these 3-byte characters
    detok = IncrementalDetokenizer(tok, [])
    released = []
    for n, i in enumerate(ids, 1):
        released.append(detok.append(i))
        # Whatever was released is exactly the completed characters of the prefix so far.
        assert "".join(released) == tok.decode(ids[:n]).rstrip("\ufffd")
    assert "".join(released) == "日本"


class _ByteTokenizer:
    """Tokens are arbitrary byte strings, decoded like byte-level BPE (lossy UTF-8)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=False):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_stable_prefix_released_before_split_character():
    # A token holding "ab" plus the first byte of 日 releases "ab" at once and 日 with the next.
    raw = "ab日c".encode()
    bt = _ByteTokenizer([raw[:3], raw[3:5], raw[5:]])
    detok = IncrementalDetokenizer(bt, [])
    assert [detok.append(i) for i in range(3)] == ["ab", "日", "c"]
    assert detok.text == "ab日c"


def test_random_byte_splits_match_decode():
    rng = random.Random(5)
    raw = (NON_ASCII + ENGLISH).encode()
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(raw)), rng.randint(1, 60)))
        pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
        pieces.append(b"\xf0\x9f")  # an invalid (truncated) tail
        bt = _ByteTokenizer(pieces)
        detok, deltas, tail = stream(bt, [], list(range(len(pieces))))
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == NON_ASCII + ENGLISH and tail == "\ufffd"
        assert detok.text == bt.decode(range(len(pieces)))


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_ids_match_decode(tok, skip):
    rng = random.Random(1234 + skip)
    vocab = len(tok)
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.5:  # sprinkle special tokens in
            for _ in range(3):
                ids.insert(rng.randrange(len(ids) + 1), rng.choice([0, 1, EOS]))
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(0, 8))]
        detok, deltas, tail = stream(tok, prompt, ids, skip_special_tokens=skip)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == expected, ids
        assert detok.text == expected


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi there") + [EOS]
    _, deltas, _ = stream(tok, [], ids, skip_special_tokens=True)
    assert "".join(deltas) == "hi there"
    _, deltas, _ = stream(tok, [], ids, skip_special_tokens=False)
    assert "".join(deltas) == "hi there</s>"


def test_invalid_tail_comes_out_as_replacement_on_flush(tok):
    lead_byte = tok.encode("日")[0]  # first piece of a 3-byte character
    assert tok.decode([lead_byte]).endswith("\ufffd")
    ids = tok.encode("ok ") + [lead_byte]
    detok = IncrementalDetokenizer(tok, [])
    released = "".join(detok.append(i) for i in ids)
    assert released == "ok "
    assert detok.flush() == tok.decode(ids)[len("ok ") :]
    assert detok.text == tok.decode(ids)
    assert detok.flush() == ""


class _CountingTokenizer:
    """Proxy recording the longest id list passed to decode."""

    def __init__(self, tok):
        self._tok = tok
        self.max_ids = 0

    def decode(self, ids, skip_special_tokens=False):
        self.max_ids = max(self.max_ids, len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_window_is_bounded(tok):
    counting = _CountingTokenizer(tok)
    ids = tok.encode(ENGLISH * 5)
    prompt = tok.encode(ENGLISH)
    detok, deltas, tail = stream(counting, prompt, ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    assert len(ids) > 100 and counting.max_ids <= 8


def test_leading_space_context_with_metaspace_tokenizer():
    # SentencePiece-style decoders drop the leading space of a decode; the prompt context keeps it.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    corpus = [ENGLISH, "hello world the quick fox", "over the lazy dog again"] * 5
    sp.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    prompt = sp.encode("hello world").ids
    out = sp.encode(" the quick fox", add_special_tokens=False).ids
    detok, deltas, tail = stream(sp, prompt, out)
    full = sp.decode(prompt + out)
    assert full == sp.decode(prompt) + detok.text
    assert detok.text.startswith(" ")


def test_detokenizer_rejects_bad_input(tok):
    with pytest.raises(TypeError, match="decode"):
        IncrementalDetokenizer(object(), [])
    with pytest.raises(TypeError, match="prompt_token_ids"):
        IncrementalDetokenizer(tok, "abc")
    with pytest.raises(TypeError, match="skip_special_tokens"):
        IncrementalDetokenizer(tok, [], skip_special_tokens="yes")
    detok = IncrementalDetokenizer(tok, [1, 2])
    with pytest.raises(TypeError, match="token_id"):
        detok.append("a")
    with pytest.raises(TypeError, match="token_id"):
        detok.append(1.0)
    with pytest.raises(ValueError, match="token_id"):
        detok.append(-1)
    with pytest.raises(ValueError, match="prompt token id"):
        IncrementalDetokenizer(tok, [3, -4])


# ---- stop strings ----


def feed_all(matcher, deltas):
    out = []
    for d in deltas:
        emit, stopped = matcher.feed(d)
        out.append(emit)
        if stopped:
            return out, True
    out.append(matcher.finish())
    return out, False


def reference_stop(deltas, stops):
    """Non-streaming answer: the text at the first delta where any stop occurs, cut before it."""
    text = ""
    for d in deltas:
        text += d
        hits = [(text.find(s), k) for k, s in enumerate(stops) if s in text]
        if hits:
            i, k = min(hits)
            return text[:i], stops[k]
    return text, None


def test_stop_across_deltas_is_cut_and_held_back():
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello S") == ("hello ", False)  # "S" could start STOP
    assert m.feed("T") == ("", False)
    assert m.feed("OP and more") == ("", True)
    assert m.text == "hello " and m.stop_string == "STOP"
    with pytest.raises(RuntimeError):
        m.feed("x")
    assert m.finish() == ""


def test_held_back_partial_match_released_when_it_fails():
    m = StopStringMatcher(["</end>"])
    assert m.feed("a </e") == ("a ", False)
    assert m.feed("n") == ("", False)
    assert m.feed("x") == ("</enx", False)
    assert m.feed("<") == ("", False)
    assert m.finish() == "<"
    assert m.text == "a </enx<" and not m.stopped


def test_hold_back_is_at_most_max_len_minus_one():
    m = StopStringMatcher(["aaaa", "b"])
    assert m.feed("aaa") == ("", False)
    assert m.feed("aaa") == ("", True)  # "aaaa" found at index 0 of "aaaaaa"
    m = StopStringMatcher(["xyz"])
    emit, _ = m.feed("xyxyxyxy")
    assert emit == "xyxyxy"  # only "xy" held back


def test_earliest_stop_wins():
    m = StopStringMatcher(["world", "o", "lo w"])
    emit, stopped = m.feed("hello world")
    assert (emit, stopped, m.stop_string) == ("hel", True, "lo w")
    m = StopStringMatcher(["ab", "abc"])  # same start: the first listed is reported
    assert m.feed("xabc") == ("x", True) and m.stop_string == "ab"
    m = StopStringMatcher(["bc", "abcd"])
    out, stopped = feed_all(m, ["xa", "bcd"])  # both present once "bcd" arrives; abcd starts first
    assert "".join(out) == "x" and m.stop_string == "abcd"


def test_streamed_equals_non_streamed_on_random_text():
    rng = random.Random(7)
    alphabet = "ab日 c"
    for _ in range(400):
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        ]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        m = StopStringMatcher(stops)
        out, stopped = feed_all(m, deltas)
        expected, which = reference_stop(deltas, stops)
        assert "".join(out) == m.text == expected, (stops, deltas)
        assert m.stop_string == which and stopped == (which is not None)
        # Nothing emitted is ever inside or after a stop string, at any point.
        streamed = ""
        for piece in out:
            streamed += piece
            assert not any(s in streamed for s in stops)


def test_no_stops_passes_through():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.finish() == "" and m.text == "abc"


def test_matcher_rejects_bad_input():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])
    with pytest.raises(TypeError, match="stop string"):
        StopStringMatcher(["ok", 3])
    with pytest.raises(TypeError, match="stop"):
        StopStringMatcher(5)
    with pytest.raises(TypeError, match="delta"):
        StopStringMatcher(["a"]).feed(b"a")
    assert StopStringMatcher("ab").feed("xaby") == ("x", True)  # bare str = one stop string


# ---- detokenizer + stop strings ----


def run_stream(tok, prompt_ids, ids, stop):
    ts = TextStream(tok, prompt_ids, stop=stop)
    out, stopped = [], False
    for i in ids:
        emit, stopped = ts.append(i)
        out.append(emit)
        if stopped:
            break
    if not stopped:
        emit, stopped = ts.finish()
        out.append(emit)
    return ts, out, stopped


def test_stop_spanning_tokens_is_cut(tok):
    ids = tok.encode("Answer: 42 ###END### trailing words")
    stop = "###END###"
    starts = [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    i = "Answer: 42 ###END###".index(stop)
    spanned = sum(1 for s in starts if i < s < i + len(stop))
    assert spanned >= 1  # the stop string covers at least two tokens
    ts, out, stopped = run_stream(tok, [], ids, [stop])
    assert stopped and ts.stop_string == stop
    assert "".join(out) == ts.text == "Answer: 42 "


def test_stop_string_in_prompt_does_not_stop(tok):
    prompt = tok.encode("Write until STOP appears. STOP")
    ids = tok.encode(" fine text here") + tok.encode(" then STOP now")
    ts, out, stopped = run_stream(tok, prompt, ids, ["STOP"])
    assert stopped and "".join(out) == " fine text here then "


def test_multibyte_stop_and_earliest_of_several(tok):
    text = "日本語 text 😀 more ωx end"
    ids = tok.encode(text)
    ts, out, stopped = run_stream(tok, [], ids, ["ωx", "😀 m", "end"])
    assert stopped and ts.stop_string == "😀 m"
    assert "".join(out) == "日本語 text "
    assert all("\ufffd" not in d for d in out)


def test_streamed_equals_non_streamed_with_tokens(tok):
    rng = random.Random(11)
    words = ENGLISH.split() + NON_ASCII.split()
    for _ in range(40):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 15)))
        ids = tok.encode(text)
        stops = [text[a : a + rng.randint(1, 6)] for a in rng.sample(range(len(text)), 2)] + ["ZZZ"]
        ts, out, stopped = run_stream(tok, [], ids, stops)
        # Non-streaming reference: decode after every token, stop at the first token with a hit.
        for k in range(1, len(ids) + 1):
            full = tok.decode(ids[:k])
            hits = [(full.find(s), n) for n, s in enumerate(stops) if s in full]
            if hits:
                break
        i, n = min(hits)
        assert "".join(out) == ts.text == full[:i]
        assert ts.stop_string == stops[n] and stopped


def test_text_stream_without_stop_matches_decode(tok):
    ids = tok.encode(NON_ASCII) + [EOS]
    ts, out, stopped = run_stream(tok, tok.encode("prompt"), ids, [])
    assert not stopped and "".join(out) == ts.text == NON_ASCII
    ts = TextStream(tok, [], stop=["é"])
    ids = tok.encode("héllo")
    steps = [ts.append(i) for i in ids[:3]]
    assert steps[-1] == ("", True) and ts.text == "h" and ts.finish() == ("", True)
    with pytest.raises(RuntimeError, match="after a stop"):
        ts.append(ids[3])


def test_prompt_cut_inside_a_character_does_not_leak_into_output(tok):
    prompt = tok.encode("say 日")[:-1]
    assert tok.decode(prompt).endswith("\ufffd")
    ids = tok.encode("ok 語")
    detok, deltas, tail = stream(tok, prompt, ids)
    assert "".join(deltas) + tail == detok.text == tok.decode(ids) == "ok 語"
