"""The files a vLLM server reads for a LoRA version (issue #36, :mod:`psrl.rollout.engines.vllm_lora`), without a
server: a version that carries the base splits into a base-only Hugging Face directory (what ``reload_weights``
reads) and a peft adapter at the server's one path; peft applies that adapter as psrl's own merge does; a load the
server refused puts the previous files back; a damaged version changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from psrl.rollout.engines.vllm_lora import ServedAdapter, max_lora_rank
from psrl.train.lora import LoraSpec, add_adapter
from psrl.weights import VersionDamaged, publish_model, read_version
from psrl.weights.adapter import MergedAdapter, adapter_meta, is_adapter, published_names
from tests.train.test_train_worker import build_tiny_gpt2

SPEC = LoraSpec(rank=4, alpha=8)


def _publish(model, root, version: int, with_base: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    names = published_names(model.state_dict(), SPEC.alpha / SPEC.rank, with_base)
    meta = adapter_meta("built-in", SPEC.rank, SPEC.alpha, SPEC.target_modules, with_base)
    return Path(publish_model(model, root, version, bucket_mb=0.01, select=names, meta=meta)["path"])


def _peft_merged(adapter_dir) -> dict[str, torch.Tensor]:
    """What peft (vLLM's format) makes of the adapter files on the base: the merged weights."""
    from peft import PeftModel

    torch.manual_seed(0)
    base = build_tiny_gpt2("cpu")
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().state_dict()


def test_a_version_becomes_a_base_directory_and_an_adapter_at_one_path(tmp_path):
    torch.manual_seed(0)
    model = add_adapter(build_tiny_gpt2("cpu"), SPEC)
    v0 = _publish(model, tmp_path / "w", 0, with_base=True, seed=1)
    v1 = _publish(model, tmp_path / "w", 1, with_base=False, seed=2)
    served = ServedAdapter(tmp_path / "server-0")

    base_dir = served.stage(v0)
    assert base_dir is not None
    _, whole = read_version(v0)
    base = {}
    for f in base_dir.glob("*.safetensors"):
        base.update(load_file(str(f)))
    assert set(base) == {n for n in whole if not is_adapter(n)}  # the base alone, every tensor of it
    assert all(torch.equal(base[n], whole[n]) for n in base)
    first = (served.path / "adapter_model.safetensors").read_bytes()
    served.done()
    assert not base_dir.exists()

    assert served.stage(v1) is None  # adapter-only: nothing to reload
    torch.manual_seed(0)
    want = build_tiny_gpt2("cpu")
    _, v1_state = read_version(v1)
    MergedAdapter(want).load(v1_state)
    got = _peft_merged(served.path)
    assert max((got[n] - t).abs().max().item() for n, t in want.state_dict().items()) < 1e-6

    served.restore()  # the server refused v1: v0's adapter is back at the path it reads
    assert (served.path / "adapter_model.safetensors").read_bytes() == first
    served.done()


def test_a_base_a_server_may_still_read_stays_until_a_later_load_is_answered(tmp_path):
    """A load psrl stopped waiting for (cancelled, or no answer) may go on in the server: its base directory is not
    removed by the next stage, only once a later load is answered (the server runs its calls one after another)."""
    torch.manual_seed(0)
    model = add_adapter(build_tiny_gpt2("cpu"), SPEC)
    served = ServedAdapter(tmp_path / "server-0")
    first = served.stage(_publish(model, tmp_path / "w", 0, with_base=True, seed=1))  # never answered
    second = served.stage(_publish(model, tmp_path / "w", 1, with_base=True, seed=2))
    assert first is not None and second is not None and first != second
    assert (first / "model.safetensors.index.json").exists()  # still whole for the reload that may read it
    served.done()  # the second load was answered
    assert not first.exists() and not second.exists()


def test_a_damaged_version_leaves_the_served_files_as_they_were(tmp_path):
    torch.manual_seed(0)
    model = add_adapter(build_tiny_gpt2("cpu"), SPEC)
    served = ServedAdapter(tmp_path / "server-0")
    served.stage(_publish(model, tmp_path / "w", 0, with_base=True, seed=1))
    served.done()
    before = (served.path / "adapter_model.safetensors").read_bytes()
    v1 = _publish(model, tmp_path / "w", 1, with_base=False, seed=2)
    shard = sorted(v1.glob("model-*.safetensors"))[0]
    tensors = load_file(str(shard))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1.0
    from safetensors.torch import save_file

    save_file(tensors, str(shard))
    with pytest.raises(VersionDamaged):
        served.stage(v1)
    assert (served.path / "adapter_model.safetensors").read_bytes() == before


@pytest.mark.parametrize("rank, want", [(1, 1), (4, 8), (8, 8), (9, 16), (512, 512)])
def test_the_server_is_started_for_the_smallest_rank_vllm_accepts(rank, want):
    assert max_lora_rank(rank) == want
    with pytest.raises(ValueError):
        max_lora_rank(513)
