"""How a version's weights scale (issue #33, acceptance): what the driver holds, what a rank holds above its shard while
it publishes, and how long a sync takes against a plain copy of the same bytes -- at two model sizes, side by side.

Models: Llama architectures built from ``transformers`` configs with random weights (nothing is downloaded) --
``small``: SmolLM2-135M's shape (hidden 576, 30 layers, 9 / 3 heads, intermediate 1536, vocabulary 49152, tied);
``large``: hidden 1024, 32 layers, 16 / 4 heads, intermediate 2816, the same vocabulary (~411M parameters).
Each configuration (size x world size x transport) runs in a fresh process (its own peak RSS): the real
:class:`psrl.train.Trainer` (rank processes at 2 ranks) publishes into where an ``hf`` engine of the driver's
process reads (``files``: the ranks' ``weights/v{N}``; ``memory``: the in-process rank's tensors, world size 1
only; ``collective``: the ranks send the buckets over the run's transfer group to the driver's receiver,
``weights.transport=collective``), after one training step on a small batch. It measures:

* ``driver_ratio`` -- the driver's peak RSS (``VmHWM``) above its RSS once the config is loaded, over the model's
  fp32 bytes. At one rank the driver is the rank: the model it trains, its gradients and AdamW's two moments (4),
  and one ``hf`` engine replica (1), so ~5 is the floor there (``memory``: + the version held); at 2 ranks it builds what ``psrl train`` builds (:func:`psrl.runtime.local.driver_holds_weights`): a
  weightless policy and the engine from the recipe, so the engine's model (1) is the floor and the allowance is
  n_rollout_instances + 0.5 = 1.5;
* ``rank_publish_excess`` -- each rank's peak RSS during the publish above its RSS before it, over its allowance
  (one bucket -- the largest written: a tensor larger than ``weights.bucket_mb`` is a bucket of its own -- + 10 %
  of its shard of parameters): <= 1 meets it (2 ranks);
* ``sync_over_copy`` -- seconds from the optimiser step's end until the engine serves the version (``load_s`` of
  it the engine's own load, after the publish), over the seconds of ``torch`` copying the same bytes (one
  ``copy_`` between two flat tensors whose pages were written first) in the same process.

Then ``floors``, on the headline's bytes in a fresh process: the plain copy, the CRC-32 bucket digest (computed on
both sides of a sync; ``sha256_s`` for the digest psrl had before), and gloo over loopback between two processes
(``gloo_s``), with ``floor_over_copy`` = (gloo + one CRC + one copy) / copy: what a collective sync cannot go below
on this machine.

With ``--engines vllm`` (or ``hf,vllm``) it also runs, at 2 ranks (``--vllm-worlds``), the driver ``psrl train`` builds
for vLLM engines without a warm start (:func:`one_vllm`): its policy on ``meta``, the ranks building the weights
themselves, one vLLM server starting from version 0's files and loading version 1 through each transport
(``--vllm-transports``: files, collective). Ends with one JSON line: per configuration the figures, per figure its
slope per GB of model from small to large, and the headline keys ``driver_weight_ratio_vllm`` (the larger of the
two vLLM transports' at 2 ranks on the larger size; null: not run), ``rank_publish_excess_ratio``,
``sync_over_copy`` -- of the better ``hf`` transport (the smaller ``sync_over_copy``) at 2 ranks on the larger size,
named in ``headline`` -- and ``sync_over_copy_vllm`` (the better vLLM transport's).

    python benchmarks/weights_scale.py --results docs/results/weights_scale.json   # both sizes (~10 min, 2 cores)
    python benchmarks/weights_scale.py --sizes small     # the small size only
    unshare -rn sh -c 'ip link set lo up && exec python benchmarks/weights_scale.py --engines vllm \
        --results docs/results/weights_scale_driver.json'  # vLLM runs: loopback only, .venv-vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

SIZES = {
    "small": dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536
    ),
    "large": dict(
        hidden_size=1024, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, intermediate_size=2816
    ),
}


def llama_config(size: str, layers: int | None = None) -> Any:
    """The ``size`` architecture's ``transformers`` config; ``layers`` overrides the depth (smoke tests)."""
    from transformers import LlamaConfig

    shape = dict(SIZES[size])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    return LlamaConfig(
        vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=2, **shape
    )


def build_llama(size: str, layers: int | None = None) -> torch.nn.Module:
    """The ``size`` architecture with random weights (seed 0); ``layers`` overrides the depth (smoke tests)."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(size, layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg)


def _batch(version: int, seqs: int = 4, prompt: int = 16, response: int = 16) -> Any:
    from psrl.staleness import Batch
    from psrl.types import Trajectory

    g = torch.Generator().manual_seed(version)
    groups = []
    for k in range(seqs // 2):
        group = []
        for j in range(2):
            p = torch.randint(3, 49152, (prompt,), generator=g).tolist()
            r = torch.randint(3, 49152, (response,), generator=g).tolist()
            lp = (-10.0 - torch.rand(response, generator=g)).tolist()
            group.append(
                Trajectory(f"{k}-{j}", f"g{k}", version, p, r, lp, [1] * response, [version] * response, float(j))
            )
        groups.append(group)
    return Batch(version, groups, [f"b{k}" for k in range(len(groups))], [version] * len(groups))


def _rss() -> dict[str, int]:
    from psrl.train.worker import memory_status

    return memory_status()


def one(size: str, world: int, transport: str, bucket_mb: float, layers: int | None) -> dict[str, Any]:
    """One configuration, in this (fresh) process."""
    torch.set_num_threads(1)
    from psrl.config import AlgorithmConfig, TrainerConfig
    from psrl.models import Policy
    from psrl.models.builder import ModelRecipe
    from psrl.rollout.engines.hf import HFEngine
    from psrl.train import Trainer
    from psrl.weights import MB, FileVersions, read_manifest
    from psrl.weights.collective import layout

    base = _rss()["rss_bytes"]
    if world == 1:  # the rank trains the driver's own policy
        policy = Policy(build_llama(size, layers), SimpleNamespace(pad_id=2), seed=0)
    else:  # as psrl train builds it (runtime/local.py driver_holds_weights): weightless, the ranks build the model
        config = llama_config(size, layers)
        recipe = ModelRecipe(config, None, None, config.vocab_size, 0, "float32")
        policy = Policy(recipe("meta"), SimpleNamespace(pad_id=2), seed=0, recipe=recipe)
    model_bytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())  # tied tensors once
    engine = HFEngine(policy.replica(seed=1))  # a weightless policy's: built from the recipe
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            policy, AlgorithmConfig(), TrainerConfig(lr=1e-5), world, tmp, in_memory=transport == "memory",
            keep=2, bucket_mb=bucket_mb, transport="collective" if transport == "collective" else "files",
        )  # fmt: skip
        try:
            ranks = trainer.start()
            trainer.publish(0)
            asyncio.run(engine.update_weights(0, trainer.out))
            trainer.step(_batch(0))
            step_end = time.perf_counter()
            before = ranks.call("usage", True)  # steady RSS, then a new high-water mark from here
            pub = trainer.publish(1)
            loading = time.perf_counter()
            asyncio.run(engine.update_weights(1, trainer.out))
            sync_s = time.perf_counter() - step_end
            pub["load_s"] = time.perf_counter() - loading
            after = ranks.call("usage")
            out_dir = trainer.out.directory(1) if isinstance(trainer.out, FileVersions) else None
            if out_dir is not None:
                biggest = max(b["bytes"] for b in read_manifest(out_dir)["buckets"])
            else:  # the same buckets, as the ranks send them
                biggest = max(b.nbytes for b in layout(policy.model, int(bucket_mb * MB)))
        finally:
            trainer.close()
    return _figures(
        size, world, transport, "hf", model_bytes, base, pub, sync_s, biggest, before, after, world > 1, False
    )


def one_vllm(
    size: str, world: int, bucket_mb: float, layers: int | None, python: str, transport: str = "files"
) -> dict[str, Any]:
    """One configuration with a vLLM server as the engine, in this (fresh) process, as ``psrl train`` builds it at
    world size > 1 without a warm start (issue #33, item 5): the driver's policy on ``meta`` (config and tokenizer
    only), the ranks building the weights from the recipe, the server starting from version 0's files and
    loading version 1 -- ``files``: reloading it from the ranks' directory; ``collective``: the ranks send it over
    the transfer group to the server's worker (``weights.transport=collective``, as ``psrl train`` wires it). The
    driver's figure is all this process holds above its start."""
    torch.set_num_threads(1)
    from psrl.config import AlgorithmConfig, TrainerConfig
    from psrl.models import CharTokenizer, Policy
    from psrl.models.builder import ModelRecipe
    from psrl.rollout.engines.vllm import VLLMEngine
    from psrl.rollout.engines.vllm_receive import VLLMReceiver
    from psrl.rollout.engines.vllm_server import VLLMServer
    from psrl.train import Trainer
    from psrl.weights import MB, FileVersions, read_manifest, write_model_directory
    from psrl.weights.collective import layout
    from psrl.weights.receivers import SentVersions

    base = _rss()["rss_bytes"]
    config = llama_config(size, layers)
    recipe = ModelRecipe(config, None, None, config.vocab_size, 0, "float32")  # build_llama's weights, on the ranks
    policy = Policy(recipe("meta"), CharTokenizer(), seed=0, recipe=recipe)
    model_bytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())

    async def run(trainer: Trainer, tmp: Path) -> tuple[dict, float, list, list]:
        ranks = trainer.start()
        if transport == "collective":
            trainer.sends_elsewhere()  # the first version as files: the server starts from it
        trainer.publish(0)
        assert isinstance(trainer.out, FileVersions | SentVersions)
        model_dir = write_model_directory(trainer.out.directory(0), tmp / "model", policy.model, policy.tokenizer)
        server = VLLMServer(
            python, model_dir, tmp / "server.log", max_model_len=256, kv_cache_gb=1, receiver=transport == "collective"
        )
        engine = VLLMEngine(server=server)
        try:
            await engine.start()
            if transport == "collective":
                trainer.send_to([VLLMReceiver(engine, 600.0)])
            trainer.step(_batch(0))
            step_end = time.perf_counter()
            before = ranks.call("usage", True)
            pub = await asyncio.to_thread(trainer.publish, 1)  # the receiver's calls run on this loop
            await engine.update_weights(1, trainer.out)
            sync_s = time.perf_counter() - step_end
            after = ranks.call("usage")
        finally:
            await engine.close()
        return pub, sync_s, before, after

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            policy, AlgorithmConfig(), TrainerConfig(lr=1e-5), world, tmp, in_memory=False, keep=2,
            bucket_mb=bucket_mb, transport=transport,
        )  # fmt: skip
        try:
            pub, sync_s, before, after = asyncio.run(run(trainer, Path(tmp)))
            if isinstance(trainer.out, FileVersions):
                biggest = max(b["bytes"] for b in read_manifest(trainer.out.directory(1))["buckets"])
            else:  # the same buckets, as the ranks send them
                biggest = max(b.nbytes for b in layout(policy.model, int(bucket_mb * MB)))
        finally:
            trainer.close()
    assert policy.weightless, "the driver's policy was given weights"
    return _figures(size, world, transport, "vllm", model_bytes, base, pub, sync_s, biggest, before, after, True, True)


def _figures(
    size: str,
    world: int,
    transport: str,
    engine: str,
    model_bytes: int,
    base: int,
    pub: dict[str, float],
    sync_s: float,
    biggest: int,
    before: list[dict[str, int]],
    after: list[dict[str, int]],
    ranks: bool,
    above_start: bool,
) -> dict[str, Any]:
    """One configuration's figures, measured now in this process (the driver's peak RSS, then a plain copy of the
    model's bytes); with ``above_start`` also the driver's peak above ``base`` in bytes, and with ``ranks`` each
    rank's publish peak over its allowance: the largest bucket written (a tensor larger than weights.bucket_mb is a
    bucket of its own) + 10 % of its shard."""
    driver = _rss()  # before the copy below, which holds two more model-sized buffers
    copy_s = _copy_seconds(model_bytes)
    out: dict[str, Any] = {
        "size": size,
        "world": world,
        "transport": transport,
        "engine": engine,
        "model_bytes": model_bytes,
        "weights_bytes": pub["weights/bytes"],
        "publish_s": pub["time/publish_s"],
        "load_s": pub.get("load_s"),
        "sync_s": sync_s,
        "copy_s": copy_s,
        "sync_over_copy": sync_s / copy_s,
        "driver_ratio": (driver["peak_rss_bytes"] - base) / model_bytes,
    }
    if above_start:
        out["driver_peak_above_start_bytes"] = driver["peak_rss_bytes"] - base
    if ranks:
        allowance = [biggest + 0.1 * b["param_bytes"] for b in before]
        excess = [a["peak_rss_bytes"] - b["rss_bytes"] for a, b in zip(after, before)]
        out["rank_publish_excess_bytes"] = excess
        out["rank_publish_excess"] = max(e / w for e, w in zip(excess, allowance))
    return out


def _copy_seconds(nbytes: int) -> float:
    """Seconds of one ``copy_`` of ``nbytes`` between two flat tensors, both written first (a source never written
    reads the kernel's one zero page: a copy of nothing, faster than this machine's memory)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the destination: not measured
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def floors(nbytes: int, bucket_mb: float) -> dict[str, float]:
    """What a sync of ``nbytes`` cannot go below here, each measured in seconds on the same bytes: a plain copy
    (``copy_s``), the bucket digest psrl computes on both sides (``crc32_s``; ``sha256_s`` for the digest it had),
    and gloo over loopback into buffers written before (``gloo_s``: a child process sends ``nbytes`` in messages
    of ``bucket_mb``, as the transfer group does)."""
    import hashlib
    import zlib

    from psrl.weights.collective import GroupAddress, TransferGroup, host_store

    out = {"copy_s": _copy_seconds(nbytes)}
    buf = torch.ones(nbytes, dtype=torch.uint8)
    for name, fn in (("crc32_s", zlib.crc32), ("sha256_s", lambda b: hashlib.sha256(b).digest())):
        t0 = time.perf_counter()
        fn(buf.numpy().data)
        out[name] = time.perf_counter() - t0
    store, port = host_store()
    address = GroupAddress("127.0.0.1", port, 2, "floor", 300.0)
    peer = subprocess.Popen([sys.executable, __file__, "--gloo-peer", str(port), str(nbytes), str(bucket_mb)])
    group = TransferGroup(address, 1)
    step = int(bucket_mb * (1 << 20))
    for _ in range(2):  # the first pass warms the connection; the second is measured
        t0 = time.perf_counter()
        works = [group.irecv(buf[i : i + step], 0, tag) for tag, i in enumerate(range(0, nbytes, step))]
        for w in works:
            group.wait(w)
        out["gloo_s"] = time.perf_counter() - t0
    peer.wait()
    group.close()
    del store
    return out


def _gloo_peer(port: int, nbytes: int, bucket_mb: float) -> None:
    from psrl.weights.collective import GroupAddress, TransferGroup

    group = TransferGroup(GroupAddress("127.0.0.1", port, 2, "floor", 300.0), 0)
    buf, step = torch.ones(nbytes, dtype=torch.uint8), int(bucket_mb * (1 << 20))
    for _ in range(2):
        for w in [group.isend(buf[i : i + step], 1, tag) for tag, i in enumerate(range(0, nbytes, step))]:
            group.wait(w)
    group.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,large")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--layers", type=int, default=None, help="override the depth of both sizes (smoke tests)")
    p.add_argument("--results", type=Path, default=None, help="store the runs and the command here (docs/results)")
    p.add_argument("--engines", default="hf", help="hf, vllm or hf,vllm (vLLM: in a loopback-only namespace)")
    p.add_argument("--vllm-worlds", default="2", help="world sizes of the vLLM runs")
    p.add_argument("--vllm-transports", default="files,collective", help="transports of the vLLM runs")
    p.add_argument("--vllm-python", default=None, help="the vLLM environment's python (default: .venv-vllm)")
    p.add_argument("--one", nargs=3, metavar=("SIZE", "WORLD", "TRANSPORT"), help=argparse.SUPPRESS)
    p.add_argument("--gloo-peer", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--floors", type=int, metavar="BYTES", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.gloo_peer:
        _gloo_peer(int(ns.gloo_peer[0]), int(ns.gloo_peer[1]), float(ns.gloo_peer[2]))
        return 0
    if ns.floors:
        torch.set_num_threads(1)
        print(json.dumps(floors(ns.floors, ns.bucket_mb)))
        return 0
    if ns.one:
        size, world, transport = ns.one
        if transport.startswith("vllm:"):
            from psrl.rollout.engines.vllm_server import find_vllm_python

            python = find_vllm_python(ns.vllm_python)
            print(json.dumps(one_vllm(size, int(world), ns.bucket_mb, ns.layers, python, transport.split(":")[1])))
        else:
            print(json.dumps(one(size, int(world), transport, ns.bucket_mb, ns.layers)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import results as stored

    engines = ns.engines.split(",")
    plan = []
    for size in ns.sizes.split(","):
        if "hf" in engines:
            for world in (int(w) for w in ns.worlds.split(",")):
                kinds = ("memory", "files", "collective") if world == 1 else ("files", "collective")
                plan += [(size, world, t) for t in kinds]
        if "vllm" in engines:
            plan += [
                (size, int(w), f"vllm:{t}") for w in ns.vllm_worlds.split(",") for t in ns.vllm_transports.split(",")
            ]
    runs = []
    for size, world, transport in plan:
        cmd = [sys.executable, __file__, "--one", size, str(world), transport, "--bucket-mb", str(ns.bucket_mb)]
        if ns.layers is not None:
            cmd += ["--layers", str(ns.layers)]
        if ns.vllm_python is not None:
            cmd += ["--vllm-python", ns.vllm_python]
        run = stored.child_run(cmd, f"{size} at {world} rank(s), {transport}")
        print(f"  {run}", file=sys.stderr, flush=True)
        runs.append(run)

    def pick(size: str, world: int, transport: str, engine: str = "hf") -> dict[str, Any] | None:
        key = (size, world, transport, engine)
        return next((r for r in runs if (r["size"], r["world"], r["transport"], r.get("engine", "hf")) == key), None)

    slopes: dict[str, Any] = {}
    for world, transport, engine in (
        (1, "memory", "hf"),
        (1, "files", "hf"),
        (1, "collective", "hf"),
        (2, "files", "hf"),
        (2, "collective", "hf"),
        (2, "files", "vllm"),
        (2, "collective", "vllm"),
    ):
        a, b = pick("small", world, transport, engine), pick("large", world, transport, engine)
        if a and b:
            gb = (b["model_bytes"] - a["model_bytes"]) / 2**30
            slopes[f"{world}/{transport}" + ("/vllm" if engine == "vllm" else "")] = {
                "driver_peak_gb_per_gb": (b["driver_ratio"] * b["model_bytes"] - a["driver_ratio"] * a["model_bytes"])
                / 2**30
                / gb,
                "sync_s_per_gb": (b["sync_s"] - a["sync_s"]) / gb,
            }

    def at(size: str, engine: str) -> list[dict[str, Any]]:
        return [r for r in (pick(size, 2, "files", engine), pick(size, 2, "collective", engine)) if r is not None]

    vllm_runs = at("large", "vllm") or at("small", "vllm")
    vllm_head = max(vllm_runs, key=lambda r: r["driver_ratio"]) if vllm_runs else None  # the worse transport's
    vllm_fast = min(vllm_runs, key=lambda r: r["sync_over_copy"]) if vllm_runs else None
    at_two = at("large", "hf") or at("small", "hf")
    head = min(at_two, key=lambda r: r["sync_over_copy"]) if at_two else (vllm_fast or runs[-1])
    cmd = [sys.executable, __file__, "--floors", str(int(head["weights_bytes"])), "--bucket-mb", str(ns.bucket_mb)]
    floor = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    floor["floor_over_copy"] = (floor["gloo_s"] + floor["crc32_s"] + floor["copy_s"]) / floor["copy_s"]
    summary = {
        "runs": runs,
        "floors": {"bytes": head["weights_bytes"], **floor},
        "slopes": slopes,
        "driver_weight_ratio_vllm": vllm_head["driver_ratio"] if vllm_head else None,
        "driver_weight_ratio_vllm_at": (
            f"{vllm_head['size']} at {vllm_head['world']} ranks, {vllm_head['transport']} (the larger of the transports)"
            if vllm_head
            else None
        ),
        "driver_weight_ratio_hf": head["driver_ratio"] if head.get("engine", "hf") == "hf" else None,
        "rank_publish_excess_ratio": head.get("rank_publish_excess"),
        "sync_over_copy": head["sync_over_copy"],
        "sync_over_copy_vllm": vllm_fast["sync_over_copy"] if vllm_fast else None,
        "sync_over_copy_vllm_at": f"{vllm_fast['size']}, {vllm_fast['transport']}" if vllm_fast else None,
        "headline": f"{head['size']} at {head['world']} ranks, {head['transport']}, {head.get('engine', 'hf')}",
        "bucket_mb": ns.bucket_mb,
        "not_run": None if vllm_runs else "vLLM engines (--engines)",
    }
    if ns.results is not None:
        stored.write(ns.results, summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
