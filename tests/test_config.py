"""Config: YAML + dotted overrides, typed validation naming the key and the fix, generated reference."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from psrl.config import ConfigError, config_from_dict, config_to_dict, load_config, reference_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_validate_and_derive_sizes():
    """Derived B, B', N, N' fall back to the plain keys when redundancy is unset."""
    cfg = load_config()
    p = cfg.psrl
    assert (p.batch_size, p.redundant_batch_size) == (p.staleness_buffer_entries,) * 2
    assert (p.group_size, p.redundant_group_size) == (p.rollout_n,) * 2


def test_yaml_then_overrides(tmp_path):
    """Overrides win over the file; values are parsed as YAML scalars."""
    f = tmp_path / "c.yaml"
    f.write_text(
        "psrl:\n  staleness: 1\n  staleness_buffer_entries: 8\n  redundant_rollout:\n    enable: true\n    redundant_global_batch_size: 12\n"
    )
    cfg = load_config(f, ["psrl.staleness=3", "algorithm.rollout_correction.is=token"])
    assert cfg.psrl.staleness == 3
    assert cfg.psrl.redundant_batch_size == 12
    assert cfg.algorithm.rollout_correction.is_ == "token"


@pytest.mark.parametrize(
    "overrides, key, fix",
    [
        (["psrl.stalenes=1"], "psrl.stalenes", "did you mean 'psrl.staleness'"),
        (["psrl.staleness=-1"], "psrl.staleness", "synchronous"),
        (["psrl.staleness=two"], "psrl.staleness", ""),
        (["rollout.vllm.kv_cache_gb=0.5"], "rollout.vllm.kv_cache_gb", "whole number of GiB"),
        (
            ["psrl.redundant_rollout.enable=true", "psrl.redundant_rollout.redundant_rollout_n=2", "psrl.rollout_n=4"],
            "psrl.redundant_rollout.redundant_rollout_n",
            "alg_rollout_n",
        ),
        (
            ["psrl.redundant_rollout.enable=true", "psrl.redundant_rollout.redundant_global_batch_size=2"],
            "psrl.redundant_rollout.redundant_global_batch_size",
            "alg_global_batch_size",
        ),
        (
            ["psrl.group_post_process.enable=true", "psrl.group_post_process.name=dynamic_sampling_filtr"],
            "psrl.group_post_process.name",
            "did you mean 'dynamic_sampling_filter'",
        ),
        (
            ["psrl.group_post_process.enable=true", "psrl.group_post_process.name=dynamic_sampling_filter"],
            "algorithm.filter_groups.metric",
            "score",
        ),
        (["psrl.proactive_filter_strategy.method=retri"], "psrl.proactive_filter_strategy.method", "retry"),
        (["psrl.proactive_filter_strategy.scope=tail"], "psrl.proactive_filter_strategy.scope", "head"),
        (["psrl.proactive_filter_strategy.grace=-1"], "psrl.proactive_filter_strategy.grace", "seconds >= 0"),
        (["psrl.proactive_filter_strategy.grace=2"], "psrl.proactive_filter_strategy.grace", "scope=head"),
        (["sim.proactive.scope=head"], "sim.proactive", "psrl.proactive_filter_strategy.scope"),
        (["sim.proactive.grace=1"], "sim.proactive", "psrl.proactive_filter_strategy.grace"),
        (["algorithm.loss_agg_mode=mean"], "algorithm.loss_agg_mode", "token-mean"),
        (["trainer.warm_start_steps=-1"], "trainer.warm_start_steps", "use 0 to skip"),
        (["weights.transport=nccl"], "weights.transport", "collective"),
        (
            ["weights.transport=collective", "rollout.engine=vllm", "rollout.vllm.urls=[http://a:1,http://b:1]"],
            "weights.transport",
            "weights.transport=files",
        ),
        (["weights.transport=collective", "runtime.backend=ray"], "weights.transport", "runtime.backend=local"),
    ],
)
def test_errors_name_the_key_and_the_fix(overrides, key, fix):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key
    assert fix in str(err.value)


def test_round_trip_through_yaml_dict():
    """config.yaml written by a run loads back to the same config (YAML key names, e.g. 'is')."""
    import yaml

    cfg = load_config(None, ["algorithm.rollout_correction.is=sequence", "psrl.staleness=4"])
    data = yaml.safe_load(yaml.safe_dump(config_to_dict(cfg)))
    assert data["algorithm"]["rollout_correction"]["is"] == "sequence"
    assert config_from_dict(data) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_reference_doc_is_current():
    """docs/configuration.md is generated from the dataclasses; regenerate with `python -m psrl.config`."""
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc.strip() == reference_markdown().strip(), "run: python -m psrl.config > docs/configuration.md"


def test_every_key_is_documented():
    """Each key has help text, so the reference never shows an empty meaning."""
    for line in reference_markdown().splitlines():
        if line.startswith("| `"):
            assert not line.rstrip().endswith("|  |"), line


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "psrl.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for cmd in ("train", "simulate", "viz"):
        assert f"  {cmd}" in out.stdout


def test_cli_config_error_exit_code():
    out = subprocess.run(
        [sys.executable, "-m", "psrl.cli", "config", "psrl.stalenes=1"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "psrl.staleness" in out.stderr


def test_reference_rows_have_five_cells():
    """A '|' in a type (str | null) or a help text is escaped, so no row grows extra columns."""
    import re

    doc = reference_markdown()
    keys, fates = doc.split("## PSRL's keys and their fate")
    rows = [line for line in keys.splitlines() if line.startswith("| `")]
    assert any("str \\| null" in r for r in rows)
    for row in rows:
        assert len(re.split(r"(?<!\\)\|", row.strip())) - 2 == 5, row
    for row in [line for line in fates.splitlines() if line.startswith("| `")]:
        assert len(re.split(r"(?<!\\)\|", row.strip())) - 2 == 3, row


def test_psrl_use_dcp_save_is_accepted_and_says_checkpoints_are_always_dcp():
    """PSRL's ``psrl.checkpoint.use_dcp_save`` (Megatron's switch there) loads either way: the trainer writes DCP at
    every world size, and the fate table says so; another key of the section is unknown."""
    for value in ("true", "false"):
        assert load_config(None, [f"psrl.checkpoint.use_dcp_save={value}"]).psrl.checkpoint.use_dcp_save == (
            value == "true"
        )
    assert "| `psrl.checkpoint.use_dcp_save` | accepted, no effect | the trainer always writes" in reference_markdown()
    with pytest.raises(ConfigError, match="psrl.checkpoint.format"):
        load_config(None, ["psrl.checkpoint.format=dcp"])
