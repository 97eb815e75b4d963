"""A published version (issue #33, items 2-4): buckets planned from names and sizes only, a round trip that is
exact, a digest every reader checks, a version that appears (and is replaced) in one rename, and an engine that
keeps serving its old version when the new one is damaged."""

from __future__ import annotations

import asyncio
import copy
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from psrl.weights import (
    INDEX,
    MANIFEST,
    VERSION_FILE,
    FileVersions,
    VersionDamaged,
    bucket_digest,
    export_state,
    plan_buckets,
    publish_model,
    read_buckets,
    read_manifest,
    read_version,
    state_digest,
    tied_names,
    version_digest,
    versions,
    write_model_directory,
    write_streamed_directory,
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=100), min_size=1, max_size=40), st.integers(min_value=1, max_value=150)
)
def test_buckets_keep_the_order_and_the_bound(sizes, bound):
    """Every name once, in order; a bucket over the bound holds exactly one (too large) tensor."""
    named = [(f"t{i}", n) for i, n in enumerate(sizes)]
    buckets = plan_buckets(named, bound)
    assert [n for b in buckets for n in b] == [n for n, _ in named]
    size = dict(named)
    for b in buckets:
        assert sum(size[n] for n in b) <= bound or len(b) == 1


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def test_a_published_version_reads_back_exactly_in_several_buckets(tmp_path):
    """Small buckets: several files, the manifest's digest is that of the in-memory export's tensors, the tensors exact."""
    model = _model()
    info = publish_model(model, tmp_path, 3, bucket_mb=0.001)
    manifest = read_manifest(tmp_path / "v3")
    assert len(manifest["buckets"]) >= 3 and info["digest"] == manifest["digest"]
    state = export_state(model, bucket_mb=0.001)
    digest = state_digest(state, bucket_mb=0.001)
    assert digest == manifest["digest"]
    version, got = read_version(tmp_path / "v3")
    assert version == 3 and all(torch.equal(got[k], v) for k, v in model.state_dict().items())


def test_a_damaged_bucket_is_refused_by_every_reader(tmp_path):
    publish_model(_model(), tmp_path, 1, bucket_mb=0.001)
    victim = tmp_path / "v1" / read_manifest(tmp_path / "v1")["buckets"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF  # a flipped byte in the tensor data
    victim.write_bytes(bytes(data))
    with pytest.raises(VersionDamaged, match="damaged"):
        read_version(tmp_path / "v1")


def test_a_version_appears_whole_and_a_republish_replaces_it_in_one_rename(tmp_path):
    """``v{N}`` is a link made by one ``os.replace``: before it there is no ``v{N}``, after it a complete one; a
    second publish of the same version swaps the link (the old data pruned later), pruning keeps ``keep``."""
    a, b = _model(0), _model(1)
    publish_model(a, tmp_path, 5, keep=2)
    first = os.readlink(tmp_path / "v5")
    publish_model(b, tmp_path, 5, keep=2)
    assert os.readlink(tmp_path / "v5") != first and (tmp_path / "v5" / MANIFEST).exists()
    _, got = read_version(tmp_path / "v5")
    assert all(torch.equal(got[k], v) for k, v in b.state_dict().items())
    for v in (6, 7):
        publish_model(a, tmp_path, v, keep=2)
    assert versions(tmp_path) == [6, 7] and not list(tmp_path.glob("v5*")) and not list(tmp_path.glob("*.tmp"))


def test_an_hf_engine_keeps_serving_its_version_when_the_next_is_damaged(tiny, tmp_path):
    """The engine loads v1 from the directory (streamed, checked), then v2 with a damaged last bucket: the load
    fails before any weight changes, the engine still holds v1's weights and says version 1, and still generates."""
    from psrl.rollout.engines.hf import HFEngine
    from psrl.types import GenRequest

    policy = copy.deepcopy(tiny[2])
    engine = HFEngine(policy.replica(seed=1))
    source = FileVersions(tmp_path)
    publish_model(policy.model, tmp_path, 1, bucket_mb=0.01)
    with torch.no_grad():
        for w in policy.model.parameters():
            w.add_(0.1)
    publish_model(policy.model, tmp_path, 2, bucket_mb=0.01)
    last = tmp_path / "v2" / read_manifest(tmp_path / "v2")["buckets"][-1]["file"]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF
    last.write_bytes(bytes(data))

    async def go() -> GenRequest:
        await engine.update_weights(1, source)
        held = {k: v.clone() for k, v in engine.policy.model.state_dict().items()}
        with pytest.raises(VersionDamaged):
            await engine.update_weights(2, source)
        assert engine.version == 1
        assert all(torch.equal(held[k], v) for k, v in engine.policy.model.state_dict().items())
        try:
            return await engine.generate(GenRequest([1, 2, 3], 4))
        finally:
            await engine.close()

    req = asyncio.run(go())
    assert req.tokens and req.versions == [1] * len(req.tokens)


def test_a_version_written_with_sha256_digests_still_reads_and_is_still_checked(tmp_path):
    """Digests are CRC-32 now (``crc32:`` prefix); a version whose manifest carries the sha256 digests psrl wrote
    before reads back exactly, checked with sha256: a flipped byte in it is still refused."""
    model = _model()
    publish_model(model, tmp_path, 1, bucket_mb=0.001)
    manifest = read_manifest(tmp_path / "v1")
    assert all(b["digest"].startswith("crc32:") for b in manifest["buckets"])
    _, state = read_version(tmp_path / "v1")
    for b in manifest["buckets"]:
        b["digest"] = bucket_digest({n: state[n] for n in b["names"]}, like="sha256")
        assert len(b["digest"]) == 64
    manifest["digest"] = version_digest([b["digest"] for b in manifest["buckets"]])
    (tmp_path / "v1" / MANIFEST).write_text(json.dumps(manifest))
    version, got = read_version(tmp_path / "v1")
    assert version == 1 and all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    victim = tmp_path / "v1" / manifest["buckets"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(VersionDamaged, match="damaged"):
        read_version(tmp_path / "v1")


def _llama(tied: bool, seed: int = 0) -> torch.nn.Module:
    """A tiny Llama, its head tied to its embedding or not (``tie_word_embeddings``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).eval()


HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def test_tied_names_are_the_tensors_that_share_memory_with_an_earlier_name():
    """The tied head is an alias of the embedding (``state_dict`` gives two tensor objects over one storage); an
    untied model has none; a copy, a view of other shape or offset, and an empty tensor are never aliases; the
    same tensor object under two names is."""
    assert tied_names(_llama(True).state_dict()) == {HEAD: EMBED}
    assert tied_names(_llama(False).state_dict()) == {}
    w = torch.arange(12.0).reshape(3, 4)
    empty = torch.empty(0)
    state = {"w": w, "copy": w.clone(), "flat": w.view(12), "rows": w[1:], "same": w.view(3, 4), "again": w}
    state.update({"e1": empty, "e2": empty})
    assert tied_names(state) == {"same": "w", "again": "w"}


def test_a_tied_version_holds_the_tensor_once_and_reads_back_whole(tmp_path):
    """Tied: the files and the manifest's bytes hold the embedding once, the manifest names the alias, and
    ``read_version`` (and the in-memory export) give every ``state_dict`` name, the head the embedding's very
    tensor, with the files' digest. Untied: both, no ``tied``."""
    tied, untied = _llama(True), _llama(False)
    publish_model(tied, tmp_path / "t", 1, bucket_mb=0.001)
    publish_model(untied, tmp_path / "u", 1, bucket_mb=0.001)
    m_t, m_u = read_manifest(tmp_path / "t" / "v1"), read_manifest(tmp_path / "u" / "v1")
    in_files = [n for p in sorted((tmp_path / "t" / "v1").glob("*.safetensors")) for n in load_file(str(p))]
    assert HEAD not in in_files and EMBED in in_files and m_t["tied"] == {HEAD: EMBED} and "tied" not in m_u
    index = json.loads((tmp_path / "t" / "v1" / INDEX).read_text())
    assert HEAD not in index["weight_map"] and len(index["weight_map"]) == m_t["tensors"]
    nbytes = sum(t.numel() * t.element_size() for t in tied.state_dict().values())
    assert m_t["bytes"] == nbytes - tied.state_dict()[HEAD].numel() * 4 and m_u["bytes"] == nbytes
    assert HEAD in [n for b in m_u["buckets"] for n in b["names"]]
    _, got = read_version(tmp_path / "t" / "v1")
    assert got.keys() == tied.state_dict().keys() and got[HEAD] is got[EMBED]
    assert all(torch.equal(got[k], v) for k, v in tied.state_dict().items())
    exported = export_state(tied, bucket_mb=0.001)
    assert exported.keys() == got.keys() and exported[HEAD] is exported[EMBED]
    assert state_digest(exported, bucket_mb=0.001) == m_t["digest"]


class _Streamed:
    """A source that streams a published version's buckets (as the driver's collective receiver does)."""

    name = "streamed"

    def __init__(self, directory):
        self.directory = directory

    def buckets(self, version):
        return (tensors for _, tensors in read_buckets(self.directory))


@pytest.mark.parametrize("source", ["files", "streamed"])
def test_a_tied_final_directory_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, source):
    """``final/`` of a tied version (no head in its files or index), made from a version's files or from a source
    that streams its buckets (the collective receiver's): ``from_pretrained`` ties the head itself and the logits
    equal the model's."""
    from transformers import AutoModelForCausalLM

    model = _llama(True, seed=3)
    publish_model(model, tmp_path / "w", 2, bucket_mb=0.001)
    tok = type("Tok", (), {"save_pretrained": lambda self, d: None})()
    if source == "files":
        out = write_model_directory(tmp_path / "w" / "v2", tmp_path / "final", model, tok)
    else:
        out = write_streamed_directory(_Streamed(tmp_path / "w" / "v2"), 2, tmp_path / "final", model, tok)  # type: ignore[arg-type]
        assert (out / VERSION_FILE).read_text() == "2\n" and len(list(out.glob("*.safetensors"))) >= 3
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([[1, 5, 7, 2, 9]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_an_hf_engine_streams_a_tied_version_into_a_tied_and_an_untied_model(tmp_path):
    """The engine checks names + tied against its model's and loads the embedding once: a tied model's head
    follows it, and a model that does not tie them gets the embedding in its head too."""
    from psrl.models import Policy
    from psrl.rollout.engines.hf import HFEngine

    source = _llama(True, seed=4)
    publish_model(source, tmp_path, 1, bucket_mb=0.001)
    tok = type("Tok", (), {"pad_id": 0})()
    untied = _llama(True, seed=5)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    for model in (_llama(True, seed=5), untied):
        engine = HFEngine(Policy(model, tok))
        asyncio.run(engine.update_weights(1, FileVersions(tmp_path)))
        assert engine.version == 1
        assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())


def test_an_untied_directory_adds_each_alias_as_a_file_of_its_own_for_vllm(tmp_path):
    """vLLM's reload on CPU loads a tied head only under its own name: the directory made for it links the version's
    files and adds the alias (the embedding's values) in one more file its index names; an untied version needs
    none. It is the version's own: made once, shared by every later caller, pruned with the version."""
    from psrl.weights.export import TIED_FILE, UNTIED_DIR, untied_directory

    model = _llama(True, seed=6)
    publish_model(model, tmp_path / "t", 1, bucket_mb=0.001)
    publish_model(_llama(False), tmp_path / "u", 1, bucket_mb=0.001)
    assert untied_directory(tmp_path / "u" / "v1") is None
    out = untied_directory(tmp_path / "t" / "v1")
    assert out is not None and out == (tmp_path / "t" / "v1").resolve() / UNTIED_DIR
    made = (out / TIED_FILE).stat().st_mtime_ns
    assert untied_directory(tmp_path / "t" / "v1") == out and (out / TIED_FILE).stat().st_mtime_ns == made
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no builder's leftovers
    weight_map = json.loads((out / INDEX).read_text())["weight_map"]
    assert weight_map.keys() == model.state_dict().keys() and weight_map[HEAD] == TIED_FILE
    got = {n: t for f in set(weight_map.values()) for n, t in load_file(str(out / f)).items()}
    assert got.keys() == model.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    assert versions(tmp_path / "t") == [1]
    for v in (2, 3):
        publish_model(model, tmp_path / "t", v, bucket_mb=0.001, keep=2)
    assert versions(tmp_path / "t") == [2, 3] and not out.exists()  # pruned with its version
