"""benchmarks/gpu_check.py (prepared for a lent GPU) smoke-tested on CPU: it runs, ends with one JSON line holding
each part's figures, and says why the collective-into-vLLM part is skipped here; world size 1 in bf16 (fp32 masters)
and the mixed-precision policy it checks on CUDA, forced onto CPU (FSDP2 over one gloo rank), both keep the fp32
update's direction."""

import json
import os
import subprocess
import sys

import pytest

from tests.benchmarks.run import ROOT, run_benchmark

TINY = ["--device", "cpu", "--tiny", "--steps", "2", "--seqs", "2", "--prompt", "8", "--response", "8"]
SMALL = TINY + ["--requests", "2", "--new-tokens", "8", "--versions", "2"]


def test_gpu_check_runs_on_cpu_and_ends_with_one_json_line():
    last = run_benchmark("gpu_check.py", *SMALL, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert last["ok"] is True and last["device"] == "cpu" and last["gpu"] is None
    assert last["fsdp"]["weights_max_abs_diff_vs_fp32"] <= 1e-6  # CPU: no policy, fp32 FSDP = the fp32 trainer
    assert last["in_process"]["ok"] is True  # bf16 over fp32 masters at world size 1
    for transport in ("memory", "files"):
        sync = last["sync"][transport]
        assert len(sync["sync_s_per_gb"]) == 2 and sync["bytes"] > 0 and min(sync["sync_s_per_gb"]) > 0
    assert last["collective_vllm"] == {"skipped": "the collective transport over NCCL needs a GPU (--device cuda)"}
    assert len(last["publish_s"]) == len(last["publish_gb_per_s"]) == 2 and last["publish_bytes"] > 0
    assert last["gen_tokens"] == 2 * 8 and last["gen_tokens_per_s"] > 0
    assert last["fsdp_vs_in_process_tokens_per_s_ratio"] > 0


FORCED = """
import sys, torch
from torch.distributed.fsdp import MixedPrecisionPolicy
import psrl.train.worker as worker
worker.mixed_precision = lambda device, dtype: (
    None if dtype == "float32" else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
)
sys.path.insert(0, "benchmarks")
import gpu_check
gpu_check.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_the_mixed_precision_policy_forced_on_cpu_keeps_the_fp32_update():
    """Measured: update cosine to fp32 0.999 (FSDP2, bf16 compute, fp32 masters), the same at world size 1 (bf16
    over fp32 masters; pure bf16 weights, before them: 0.37); published versions in bf16 (half the fp32 bytes)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    args = TINY[:6] + ["3"] + TINY[7:] + ["--requests", "1", "--new-tokens", "2", "--versions", "1"]
    out = subprocess.run(
        [sys.executable, "-c", FORCED, *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    fsdp, one = last["fsdp"], last["in_process"]
    assert fsdp["ok"] and fsdp["update_cosine_vs_fp32"] >= 0.99 and one["ok"] and one["update_cosine_vs_fp32"] >= 0.99
    assert 0 < fsdp["weights_max_abs_diff_vs_fp32"] <= 1e-4
