"""Incremental detokenization (runtime/detokenize.py) against decoding the whole list: the real
SmolLM2 tokenizer (byte-level BPE) and a Llama-style SentencePiece one (Metaspace, byte
fallback) built here; stop strings found across deltas, in the engine and from a callback."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from deepfuse.runtime.detokenize import IncrementalText, find_stop
from deepfuse.runtime.engine import Engine, SamplingParams

TEXTS = ["Grüße aus Köln — naïve café, 東京タワー and 🚀🌕 (rockets), ½ + ¼ = ¾.",
         "  leading spaces, tabs\tand\nnewlines\n\n", "emoji 👩‍👩‍👧 family, flags 🇫🇷🇯🇵, κόσμε"]


def check_against_full_decode(decode, ids: list[int], prefix: bool = True) -> None:
    """Feeds ids one at a time: the text equals the whole decode whenever that does not end in
    an incomplete character, and the deltas add up to it. prefix: the text is also always a
    prefix of the whole decode (not so with byte fallback, which turns a whole run of byte
    tokens into U+FFFD while its last character is incomplete)."""
    inc, deltas = IncrementalText(decode), []
    for n in range(1, len(ids) + 1):
        deltas.append(inc.add(ids[:n]))
        full = decode(ids[:n])
        if prefix:
            assert full.startswith(inc.text), (n, full, inc.text)
        if not full.endswith("\ufffd"):
            assert inc.text == full, (n, full, inc.text)
    assert "".join(deltas) == inc.text


@pytest.fixture(scope="module")
def smol_tok(smollm2):
    return smollm2[1]


def test_byte_level_bpe_text_is_exact(smol_tok):
    for text in TEXTS:
        ids = smol_tok.encode(text)
        assert any("\ufffd" in smol_tok.decode(ids[:n]) for n in range(len(ids))) or text == TEXTS[1]
        check_against_full_decode(smol_tok.decode, ids)


def test_byte_level_bpe_random_ids(smol_tok):
    """Random ids include lone UTF-8 pieces: replacement characters that never complete."""
    rng = random.Random(0)
    pieces = smol_tok.encode("".join(TEXTS))
    for _ in range(20):
        ids = [rng.choice(pieces) if rng.random() < 0.7 else rng.randrange(49152) for _ in range(40)]
        check_against_full_decode(smol_tok.decode, ids)


def sentencepiece_like() -> Tokenizer:
    """Llama 2's tokenizer.json layout on a small vocabulary: ▁ for spaces, <0xNN> byte tokens
    for what the vocabulary lacks, a decoder that strips the text's leading space."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for w in ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁", "s", "é", "▁café", "."]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], byte_fallback=True, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def test_sentencepiece_decoder_leading_space_and_byte_fallback():
    tok = sentencepiece_like()
    decode = tok.decode
    ids = tok.encode("the cat sat on the mat. café 東京 🚀 cats").ids
    assert decode(ids) == "the cat sat on the mat. café 東京 🚀 cats"
    assert any(decode(ids[:n]).endswith("\ufffd") for n in range(len(ids)))  # byte tokens split characters
    check_against_full_decode(decode, ids, prefix=False)
    rng = random.Random(1)
    words = ["the", "cat", "sat", "on", "mat.", "café", "東京", "🚀", "cats", "ñ", "  ", "\n"]
    for _ in range(20):  # random texts: leading spaces and byte runs land at every window start
        text = "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(12))
        check_against_full_decode(decode, tok.encode(text).ids, prefix=False)


def test_find_stop_only_looks_past_the_searched_text():
    assert find_stop("abc STOP def", ["STOP"], 0) == 4
    assert find_stop("abc STOP def", ["STOP"], 6) == 4  # ends past 6: "STOP" spans the old end
    assert find_stop("abc STOP def", ["STOP"], 9) == -1  # searched already
    assert find_stop("xx, yy", ["yy", ","], 0) == 2  # the earliest of several


def test_engine_stop_strings_cut_the_text_of_a_free_run(smollm2, smollm2_compiled):
    """Each stop string taken from a free run's text (at token joins and inside tokens) ends a
    second run right there: the text is the free text up to it, the tokens the free tokens up to
    the one that completed it."""
    tok = smollm2[1]
    eng = Engine(smollm2_compiled)
    prompt = tok.encode("A short story about a robot who learns to paint:")
    free = eng.generate([prompt], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)])[0]
    text = free.outputs[0].text
    for start in (3, 17, 40, len(text) - 9):
        stop = text[start:start + 5]
        first = text.find(stop)
        out = eng.generate([prompt], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])])[0]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text == text[:first], stop
        n = next(n for n in range(1, 41) if stop in tok.decode(free.outputs[0].token_ids[:n]))
        assert out.outputs[0].token_ids == free.outputs[0].token_ids[:n]
    # kept in the text on request: the first listed of the stops found where the match starts
    stop = text[17:22]
    out = eng.generate([prompt], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop[:3], stop],
                                                 include_stop_str_in_output=True)])[0]
    assert out.outputs[0].text == text[:text.find(stop[:3]) + 3]
    out = eng.generate([prompt], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["zzz", stop],
                                                 include_stop_str_in_output=True)])[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text == text[:text.find(stop) + 5]
    unmatched = eng.generate([prompt], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                       stop=["no such text anywhere"])])[0]
    assert unmatched.outputs[0].finish_reason == "length" and unmatched.outputs[0].text == text


def test_abort_from_the_streaming_callback(smollm2, smollm2_compiled):
    """on_token may abort its own request or another; generate returns every request once."""
    tok = smollm2[1]
    eng = Engine(smollm2_compiled)
    prompts = [tok.encode(f"Count to ten in {lang}:") for lang in ("French", "German", "Italian")]
    seen: dict[int, int] = {}

    def on_token(i: int, _tok: int) -> None:
        seen[i] = seen.get(i, 0) + 1
        if i == 0 and seen[i] == 3:
            eng.abort("0")  # itself, mid-step
        if i == 1 and seen[i] == 2:
            eng.abort("2")  # another request

    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = eng.generate(prompts, [p] * 3, on_token)
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "length", "abort"]
    assert len(outs[0].outputs[0].token_ids) == 3 and len(outs[1].outputs[0].token_ids) == 12
    assert not eng.has_unfinished() and eng.kv.pool.num_used() == 0
