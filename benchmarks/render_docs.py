"""The docs' tables of measured numbers, rendered from the stored results (``docs/results/*.json``).

A table in ``docs/*.md`` sits between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``; NAME is a
renderer of ``RENDERERS``, a function of the stored results only. ``python benchmarks/render_docs.py`` rewrites
what lies between the markers; ``--check`` changes nothing and exits 1 naming every block that differs
(``tests/benchmarks/test_render_docs.py`` does the same in the default suite).
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as stored  # noqa: E402
from learning_report import (  # noqa: E402
    DIVERGENCE,
    METRICS,
    certify,
    paired_lower_bound,
    signed,
    spread,
    summarise,
    verdict,
)

DOCS = stored.ROOT / "docs"
BLOCK = re.compile(r"<!-- results:(?P<name>[\w-]+) -->(?P<body>.*?)<!-- /results:(?P=name) -->", re.S)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n" + "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


def _command(name: str) -> str:
    return f"\n```\n{stored.read(name)['command']}\n```\n"


def _sci(x: float) -> str:
    """``4.5e-8``: one decimal, no zero-padded exponent."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _spread(s: dict, digits: int = 3) -> str:
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def _summaries(data: dict) -> dict[tuple[str, int], dict]:
    """``summarise`` per (correction, staleness), in the order the runs were stored (sync first)."""
    runs = data["runs"]
    sync = [r for r in runs if r["correction"] == "default" and r["staleness"] == 0]
    sync_final = sum(r["vals"][-1]["val/accuracy"] for r in sync) / len(sync)
    sync_sps = {r["seed"]: r["s_per_step"] for r in sync}
    cells: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        cells.setdefault((r["correction"], r["staleness"]), []).append(r)
    return {cell: summarise(rs, sync_final, sync_sps) for cell, rs in cells.items()}


def learning_table(name: str) -> str:
    """Per (correction, staleness): runs counted (reached their bound), final accuracy, speed, divergence."""
    rows = []
    for (corr, eta), s in _summaries(stored.read(name)).items():
        acc, sps, up, mx = s["val_accuracy"], s["seconds_per_step"], s["speedup_over_sync"], s["realised_staleness_max"]
        div = " / ".join(f"{s[k]['mean']:.3g}" for k in ("ess", "m2", "kl"))
        rows.append(
            [corr, f"{eta}{' (sync)' if eta == 0 else ''}", s["counted"], _spread(acc) if acc["n"] else "-"]
            + [f"{sps['mean']:.2f} ± {sps['std']:.2f}", f"{up['mean']:.2f}", div, f"{mx['min']:.0f}–{mx['max']:.0f}"]
        )
    header = ["correction", "staleness", "counted", "val/accuracy mean ± std [min–max], counted runs"]
    header += ["s/step", "speedup over sync", "divergence ess / m2 / kl", "realised staleness/max"]
    return _table(header, rows)


def learning_certificate(name: str) -> str:
    """Per correction and staleness: the paired differences with sync, their lower bounds, the verdict; the rule."""
    data = stored.read(name)
    out, rows = [], []
    corrections = list(dict.fromkeys(r["correction"] for r in data["runs"]))
    for corr in corrections:
        cert = certify(data["runs"], corr, data["delta"], data["alpha"], data["min_seeds"])
        out.append(f"`{corr}`: {verdict(cert)}.")
        for row in cert["rows"]:
            figures = [f"{signed(row[m]['mean'])} (lower {signed(row[m]['lower'])})" for m in METRICS]
            passes = "passes" if row["passes"] else "fails"
            rows.append(
                [corr, str(row["staleness"]), str(len(row["seeds"])), str(row["below_bound"]), *figures, passes]
            )
    header = ["correction", "staleness", "seeds paired with sync", "runs below their bound"]
    header += ["final accuracy - sync's (lower bound)", "last quarter - sync's (lower bound)", "verdict"]
    seeds = ", ".join(map(str, cert["sync_seeds"]))
    rule = f"Rule: {cert['rule']}. Here delta = {data['delta']:g}, alpha = {data['alpha']:g}; sync's seeds: {seeds}."
    return _table(header, rows) + "\n" + "\n".join([*out, "", rule]) + "\n"


def learning_arms(name: str, arms: list[tuple[str, int]]) -> str:
    """Chosen arms side by side over every run (none left out): final accuracy, paired with sync, per seed, speed,
    divergence and the mean ``staleness/bound`` per seed (the adaptive arm's bound moves; a fixed one's does not)."""
    runs = stored.read(name)["runs"]
    sync = {
        r["seed"]: r["vals"][-1]["val/accuracy"] for r in runs if r["correction"] == "default" and r["staleness"] == 0
    }
    rows = []
    for corr, eta in arms:
        arm = sorted((r for r in runs if r["correction"] == corr and r["staleness"] == eta), key=lambda r: r["seed"])
        final = [r["vals"][-1]["val/accuracy"] for r in arm]
        paired = spread([f - sync[r["seed"]] for f, r in zip(final, arm)])
        div = " / ".join(f"{round(statistics.fmean(r['divergence'][k] for r in arm), 4):.3g}" for k in DIVERGENCE)
        label = "fixed 0 (sync)" if eta == 0 else f"fixed {eta}" if corr == "default" else f"{corr}, ceiling {eta}"
        rows.append(
            [label, _spread(spread(final)), f"{paired['mean']:+.3f} ± {paired['std']:.3f}"]
            + [" / ".join(f"{f:.2f}" for f in final), _spread(spread([r["s_per_step"] for r in arm]), 2), div]
            + [", ".join(f"{r['bound_mean']:.1f}" for r in arm)]
        )
    seeds = " / ".join(str(r["seed"]) for r in arm)
    header = ["arm", "val/accuracy mean ± std [min–max]", "paired with sync, mean ± std", f"per seed {seeds}"]
    header += ["s/step", "divergence ess / m2 / kl", "mean `staleness/bound` per seed"]
    return _table(header, rows)


def _agent_endpoint(name: str) -> str:
    r = stored.read(name)
    parts = []
    for engine, f in r["engines"].items():
        pairs = f["pairs"]
        rates = [p[k]["tokens_per_s"] for p in pairs for k in ("direct", "endpoint")]
        ratios = ", ".join(f"{p['ratio']:.2f}" for p in pairs)
        same = all(p["direct"]["tokens"] == p["endpoint"]["tokens"] for p in pairs)
        parts.append(
            f"on `{engine}` the endpoint gave {f['endpoint_tokens_per_s']:.2f} sampled tokens/s against "
            f"{f['direct_tokens_per_s']:.2f} directly (medians), `endpoint_over_direct` "
            f"{f['endpoint_over_direct']:.3f} (the median of the pairs' ratios {ratios}; single rounds "
            f"{min(rates):.1f} to {max(rates):.1f} tokens/s; both rounds of "
            f"{'every pair' if same else 'not every pair'} sampled the same number of tokens); the endpoint's path "
            f"cost the driver {f['endpoint_cpu_ms_per_turn']:.1f} ms of CPU per turn, the agents' `openai` SDK included"
        )
    return (
        f"with {r['model']}, {r['agents']} agents at once x {r['turns']} turns x at most {r['tokens']} tokens, "
        f"{r['pairs']} pairs of rounds: {'; '.join(parts)} (`{r['command']}`, {r['measured']})"
    )


def agent_endpoint() -> str:
    """docs/agents.md's endpoint cost (``benchmarks/agent_endpoint.py``): the vLLM headline, then ``hf``."""
    return f"{_agent_endpoint('agent_endpoint')}; and {_agent_endpoint('agent_endpoint_hf')}"


def agent_learning(name: str) -> str:
    """docs/agents.md's learning of the calculator example over seeds (``benchmarks/agent_learning.py``): the
    command, the shared warm start, per step window (quarters of the run) the mean ± spread over seeds of each
    seed's window mean, and per seed its first and last quarter."""
    r = stored.read(name)
    runs, w = r["runs"], r["warm_start"]
    steps = min(len(x["curves"]["reward/mean"]) for x in runs)
    q = max(1, steps // 4)
    windows = [(a, min(a + q, steps)) for a in range(0, steps, q)]
    rows = []
    for a, b in windows:
        cells = [f"{a + 1}–{b}" if b > a + 1 else str(b)]
        for key in ("reward/mean", "batch/tool_call_frac"):
            s = spread([statistics.fmean(x["curves"][key][a:b]) for x in runs])
            cells.append(_spread(s, 2))
        rows.append(cells)
    per_seed = "; ".join(
        f"seed {x['seed']}: {x['reward_first_quarter']:.3f} -> {x['reward_last_quarter']:.3f} "
        f"({'rose' if x['reward_last_quarter'] > x['reward_first_quarter'] else 'did not rise'}; "
        f"{x['audit']['trained']} trajectories trained, {x['audit']['violations']} outside the bound, "
        f"{x['seconds'] / max(1, x['steps']):.0f} s/step)"
        for x in runs
    )
    rose = sum(x["reward_last_quarter"] > x["reward_first_quarter"] for x in runs)
    return (
        _command(name)
        + f"\n{r['measured']}, `{r['config']}`"
        + (f" with {' '.join(r['overrides'])}" if r["overrides"] else "")
        + f": one warm start of {w['steps']} steps x {w['batch']} demonstrations at lr {w['lr']:g} (loss "
        + f"{w['loss_first']:.3f} -> {w['loss_last']:.3f}, {w['seconds']:.0f} s), shared by the seeds, then "
        + f"{steps} RL steps per seed. Per step window, mean ± std [min–max] over {len(runs)} seeds of each "
        + "seed's window mean:\n"
        + _table(["steps", "reward/mean", "batch/tool_call_frac"], rows)
        + f"\nFirst vs last quarter of the training reward, per seed -- {per_seed}. The reward rose in {rose} of "
        + f"{len(runs)} seeds.\n"
    )


HEAP_SETTINGS = {"none": "none (glibc's defaults)", "threshold": "1 MiB threshold (before)", "psrl": "psrl (now)"}


def heap_cost() -> str:
    """docs/learning.md's heap settings (``benchmarks/heap_cost.py``): per job and setting, every run's figures and
    its ratios to the run of the reference setting it was paired with (the default job: ``none``'s wall and CPU
    seconds, user + system; SmolLM2: ``threshold``'s peak RSS), and where a SmolLM2 run peaked."""
    out = []
    stores = [("heap_cost_default", "default", "none")]
    stores += [(p.stem, "smollm2", "threshold") for p in sorted(stored.RESULTS.glob("heap_cost_smollm2*.json"))]
    for name, job, over in stores:  # SmolLM2: one store per invocation (each run takes ~8 GB for minutes)
        r = stored.read(name)
        runs, rows = r["runs"][job], []
        figures = {
            "wall s": lambda x: x["wall_s"],
            "CPU s": lambda x: x["user_s"] + x["sys_s"],
            "system s": lambda x: x["sys_s"],
            "peak RSS GB": lambda x: x["peak_rss_bytes"] / 1e9,
            "trims": lambda x: x.get("trims", float("nan")),  # psrl's watcher's (psrl.heap.FreedPages)
        }
        ratios = ("wall s", "CPU s") if job == "default" else ("peak RSS GB",)
        for setting, label in HEAP_SETTINGS.items():
            each, ref = runs.get(setting, []), runs.get(over, []) if setting != over else []
            cells = [
                " / ".join(f"{f(x):.{1 if name == 'system s' else 2 if 'GB' in name else 0}f}" for x in each)
                if name != "trims" or setting == "psrl"
                else ""
                for name, f in figures.items()
            ]
            cells += [" / ".join(f"{figures[n](a) / figures[n](b):.2f}" for a, b in zip(each, ref)) for n in ratios]
            if job == "smollm2":  # where each run peaked, and the peak of the no-grad log-prob forwards alone
                phases = [x.get("phase_peak_bytes", {"?": 0}) for x in each]
                cells.append(" / ".join(max(p.items(), key=lambda kv: kv[1])[0] for p in phases))
                cells.append(" / ".join(f"{p['logprobs'] / 1e9:.2f}" if "logprobs" in p else "?" for p in phases))
            rows += [[label, *cells]] if each else []
        header = ["setting", *figures, *(f"{n.split()[0]} / {over}'s" for n in ratios)]
        out.append(
            f"\n`{r['command']}` ({r['measured']}, commit {r['commit']}; run by run):\n"
            + _table(header + (["peak while", "log-prob forwards' peak GB"] if job == "smollm2" else []), rows)
        )
        medians = [(k, r["summary"].get(f"default_{k}_psrl_over_none")) for k in ("wall", "cpu")]
        if job == "default" and all(v is not None for _, v in medians):
            out.append(
                f"\nMedian of the pairs' ratios, psrl / none: {', '.join(f'{k} {v:.3f}' for k, v in medians)}.\n"
            )
    return "".join(out)


def trainer_scale() -> str:
    """docs/trainer.md's 1-vs-2-rank figures (``benchmarks/trainer_scale.py``), as one sentence."""
    r = stored.read("trainer_scale")
    gb = 1e9
    return (
        f"`state_bytes_ratio` {r['state_bytes_ratio']:.2f} (parameters + AdamW of one rank over the single process's), "
        f"`step_time_ratio` {r['step_time_ratio']:.2f} ({r['step_s_1rank']:.1f} s -> {r['step_s_2ranks']:.1f} s), "
        f"`publish_s` {r['publish_s']:.1f} (1 rank: {r['publish_s_1rank']:.1f}), peak RSS "
        f"{r['peak_rss_bytes_1rank'] / gb:.1f} GB at 1 rank vs {r['peak_rss_bytes_per_rank_2ranks'] / gb:.1f} GB per "
        f"rank, loss {r['loss_1rank']:.4f} at 1 rank and {r['loss_2ranks']:.4f} at 2"
    )


def trainer_resume(part: str) -> str:
    """The resume figures of docs/trainer.md (``benchmarks/resume_world_size.py``): the text's and the table's."""
    r = stored.read("trainer_resume")["resume"]
    if part == "text":
        return (
            f"measured {_sci(r['1_to_2'])} (1 -> 2) and {_sci(r['2_to_1'])} (2 -> 1) from the uninterrupted run after "
            f"the next step, where restarting AdamW would differ by {_sci(r['adamw_restarted'])}"
        )
    return (
        f"{_sci(r['1_to_2'])} / {_sci(r['2_to_1'])} (1 -> 2 / 2 -> 1; AdamW restarted: {_sci(r['adamw_restarted'])}), "
        f"{r['1_to_2_s']:.0f} s / {r['2_to_1_s']:.0f} s with the ranks' start"
    )


def simulate_reference() -> str:
    """docs/simulate.md's reference comparison (``benchmarks/policies.py``): the capacity- and sync-balanced rows,
    in the script's own format."""
    from policies import HEADER, Result, row

    data = stored.read("simulate_reference")
    lines = [HEADER]
    for r in data["reference"]:
        if r["setting"] in ("balanced", "sync-balanced"):
            fields = {k: v for k, v in r.items() if k not in ("sigma", "setting", "label")}
            lines.append(row(r["sigma"], r["setting"], r["label"], Result(**fields)))
    return "\n```\n" + "\n".join(lines) + "\n```\n"


def simulate_model_vs_real() -> str:
    """psrl's model against ``psrl train``'s coordinator in virtual time: ratio to ideal, per case and setting."""
    pairs = stored.read("simulate_reference")["model_vs_real"]
    cells = {
        (p["case"], p["setting"]): f"{p['model']['ratio_to_ideal']:.3f} / {p['real']['ratio_to_ideal']:.3f}"
        for p in pairs
    }
    cases = list(dict.fromkeys(p["case"] for p in pairs))
    header = ["case", "sync-balanced (model / real)", "capacity-balanced (model / real)"]
    return _table(header, [[c, cells[(c, "sync-balanced")], cells[(c, "balanced")]] for c in cases])


def simulate_frontier(sigma: float, min_length_bias: float) -> str:
    """One frontier table of docs/simulate.md (``benchmarks/policies.py --markdown``), from its stored runs."""
    from policies import Result, frontier_table

    part = next(f for f in stored.read("simulate_frontier")["frontier"] if f["sigma"] == sigma)
    return "\n" + frontier_table([Result(**r) for r in part["runs"]], part["family"], min_length_bias) + "\n"


def simulate_adaptive() -> str:
    """docs/simulate.md's controller-against-fixed-bounds table (``benchmarks/adaptive_sim.py``), its own format."""
    from adaptive_sim import FOOTER, format_row, header

    data = stored.read("simulate_adaptive")
    lines = [header(data["ceiling"]), *map(format_row, data["rows"]), FOOTER]
    return "\n```\n" + "\n".join(lines) + "\n```\n"


def simulate_adaptive_result() -> str:
    """The controller's ratios over the workloads of that table, in one sentence."""
    data = stored.read("simulate_adaptive")
    rows = data["rows"]
    ratios = [r["ratio"] for r in rows]
    agree = max(abs(r["coordinator_ratio"] - r["ratio"]) / r["ratio"] for r in rows)
    return (
        f"{sum(x >= 0.95 for x in ratios)} of {len(rows)} workloads at >= 0.95 (mean {statistics.fmean(ratios):.3f}, "
        f"min {min(ratios):.3f}), the controller's run-mean divergence inside the limits on "
        f"{data['adaptive_inside_limits']} of {len(rows)}, both policies agreeing within {100 * agree:.1f} %"
    )


def simulate_routing() -> str:
    """docs/simulate.md's routing table (``benchmarks/routing.py``): per method and queue, means over the seeds;
    the ratio to ``round_robin`` without the queue is taken per seed, then averaged (the largest in bold)."""
    runs = stored.read("simulate_routing")["runs"]
    base = {r["seed"]: r["steps_per_hour"] for r in runs if r["method"] == "round_robin" and not r["mlq"]}
    cells: dict[tuple[str, bool], list[dict]] = {}
    for r in runs:
        cells.setdefault((r["method"], r["mlq"]), []).append(r)
    ratio = {k: statistics.fmean(r["steps_per_hour"] / base[r["seed"]] for r in rs) for k, rs in cells.items()}
    rows = []
    for (method, mlq), rs in cells.items():
        x = f"{ratio[(method, mlq)]:.3f}x"
        rows.append(
            [method, "on" if mlq else "off", f"{statistics.fmean(r['steps_per_hour'] for r in rs):.1f}"]
            + [f"**{x}**" if ratio[(method, mlq)] == max(ratio.values()) else x]
            + [f"{statistics.fmean(r['staleness_mean'] for r in rs):.2f} / {max(r['staleness_max'] for r in rs)}"]
        )
    header = ["routing method", "multi-level queue", "steps/hour", "vs round_robin", "staleness mean / max"]
    return _table(header, rows)


def simulate_head_scope() -> str:
    """docs/simulate.md's head-scope runs (``benchmarks/head_scope_real.py``): measured against both replays, the
    audit, then the errors' spread in one sentence."""
    data = stored.read("simulate_head_scope")
    rows = []
    for r in data["runs"]:
        rows.append(
            [str(r["seed"]), f"{r['measured_s_per_step']:.3f}"]
            + [f"{r[k + 'predicted_s_per_step']:.3f} ({100 * r[k + 'error']:+.1f} %)" for k in ("", "coordinator_")]
            + [str(r["trained"]), str(r["truncated"]), str(r["max_staleness"]), str(r["violations"])]
        )
    eta = data["runs"][0]["eta"]
    header = ["seed", "measured s/step", "`psrl` model", "real coordinator", "trained", "truncated"]
    header += [f"max staleness (bound {eta})", "violations"]
    err = data["error"]
    sentence = (
        f"Error of the `psrl` model {100 * err['mean']:+.1f} % +- {100 * err['std']:.1f} % (worst of both "
        f"{100 * data['worst_abs_error']:.1f} %, the acceptance allows {100 * data['tolerance']:.0f} %), audit "
        f"{'clean' if data['audit_clean'] else 'NOT clean'}; {data['seconds'] / 60:.0f} min for the "
        f"{len(data['runs'])} runs on the shared 2-core CPU."
    )
    return _table(header, rows) + "\n" + sentence + "\n"


def weights_scale() -> str:
    """docs/trainer.md's weight-path figures (``benchmarks/weights_scale.py``): one row per configuration."""
    rows = []
    data = stored.read("weights_scale")
    for r in data["runs"]:
        excess = f"{r['rank_publish_excess']:.2f}" if "rank_publish_excess" in r else "--"
        load = f"{r['load_s']:.2f}" if r.get("load_s") is not None else "--"
        rows.append(
            [f"{r['size']} ({r['model_bytes'] / 2**30:.2f} GiB)", str(r["world"]), r["transport"]]
            + [f"{r['publish_s']:.2f}", load, f"{r['sync_s']:.2f}", f"{r['copy_s']:.3f}", f"{r['sync_over_copy']:.0f}"]
            + [f"{r['driver_ratio']:.2f}", excess]
        )
    header = ["model", "ranks", "versions go", "publish s", "engine load s", "sync s", "plain copy s"]
    header += ["sync / plain copy", "driver peak / model bytes", "rank publish peak / allowance"]
    out = _table(header, rows)
    f = data.get("floors")
    if f:
        out += (
            f"\nFloors on the headline's {f['bytes'] / 1e9:.2f} GB ({data['headline']}), each alone in a fresh "
            f"process: a plain copy {f['copy_s']:.3f} s, CRC-32 {f['crc32_s']:.2f} s (sha256 {f['sha256_s']:.2f} s), "
            f"gloo over loopback {f['gloo_s']:.2f} s; (gloo + one CRC + one copy) / copy = "
            f"{f['floor_over_copy']:.0f}.\n"
        )
    return out


def weights_scale_driver() -> str:
    """docs/trainer.md's driver figures with vLLM engines (``benchmarks/weights_scale.py --engines vllm``)."""
    r = stored.read("weights_scale_driver")
    rows = [
        [f"{x['size']} ({x['model_bytes'] / 2**30:.2f} GiB)", str(x["world"]), x["transport"]]
        + [f"{x['driver_peak_above_start_bytes'] / 2**20:.0f}", f"{x['driver_ratio']:.3f}"]
        + [
            f"{x['publish_s']:.2f}",
            f"{x['sync_s']:.2f}",
            f"{x['sync_over_copy']:.0f}",
            f"{x['rank_publish_excess']:.2f}",
        ]
        for x in r["runs"]
    ]
    header = ["model", "ranks", "versions go", "driver peak above its start, MiB", "/ model bytes", "publish s"]
    header += ["sync s", "sync / plain copy", "rank publish peak / allowance"]
    sentence = f"`driver_weight_ratio_vllm` = {r['driver_weight_ratio_vllm']:.3f} ({r['driver_weight_ratio_vllm_at']})"
    for transport in ("files", "collective"):
        slope = r["slopes"].get(f"2/{transport}/vllm", {}).get("driver_peak_gb_per_gb")
        if slope is not None:
            sentence += f"; with {transport} the driver's peak grows {slope:.3f} GB per GB of model from small to large"
    return _command("weights_scale_driver") + "\n" + _table(header, rows) + "\n" + sentence + ".\n"


def lora() -> str:
    """docs/lora.md's LoRA vs full fine-tuning figures (``benchmarks/lora.py``): the command, one row per run, the
    ratios."""
    r = stored.read("lora")
    mb = 1e6  # the arithmetic in docs/lora.md counts MB
    rows = [
        [x["mode"], str(x["world"]), f"{x['version_bytes'] / mb:.2f}", f"{x['first_version_bytes'] / mb:.1f}"]
        + [f"{x['optim_bytes'] / mb:.2f}", f"{x['sync_s']:.2f}"]
        for x in r["runs"]
    ]
    header = ["trains", "ranks", "MB per version", "MB first version", "AdamW MB per rank", "sync s"]
    ratios = "; ".join(
        f"{w} rank{'s' if w != '1' else ''}: bytes {q['bytes_ratio']:.2%}, AdamW {q['optim_ratio']:.2%}"
        for w, q in r["ratios"].items()
    )
    return (
        _command("lora")
        + f"\n{r['measured']}: {r['model']}, lora_rank {r['lora']['lora_rank']}, "
        + f"lora_alpha {r['lora']['lora_alpha']}, {', '.join(r['lora']['target_modules'])}:\n"
        + _table(header, rows)
        + f"\nLoRA over full fine-tuning -- {ratios}.\n"
    )


def lora_learning() -> str:
    """docs/lora.md's LoRA vs full fine-tuning learning comparison (``benchmarks/learning.py`` with the ``lora-*``
    arms): the learning rate chosen on seed 0, then per seed the paired difference, and the evidence rule's bounds."""
    r, lr = stored.read("lora_learning"), stored.read("lora_learning_lr")
    pick = {x["correction"]: x for x in lr["runs"] if x["correction"].startswith("lora-")}
    by_lr = sorted(pick, key=lambda c: float(c.removeprefix("lora-")))
    # the final validation accuracy; a tie by the training reward over the run's last third
    chosen = max(by_lr, key=lambda c: (pick[c]["vals"][-1]["val/accuracy"], pick[c]["reward_last_third"]))
    arms = {(x["correction"], x["seed"]): x for x in r["runs"]}
    seeds = sorted({s for c, s in arms if c == "default"} & {s for c, s in arms if c == chosen})
    rows = []
    diffs: dict[str, list[float]] = {m: [] for m in METRICS}
    for seed in seeds:
        full, lora = arms[("default", seed)], arms[(chosen, seed)]
        cells = []
        for m, f in METRICS.items():
            diffs[m].append(f(lora) - f(full))
            cells += [f"{f(full):.3f}", f"{f(lora):.3f}", signed(f(lora) - f(full))]
        rows.append([str(seed), *cells])
    header = ["seed"] + [f"{m} {arm}" for m in METRICS for arm in ("full", "LoRA", "LoRA - full")]
    bounds = "; ".join(
        f"{m}: mean {signed(statistics.fmean(d))}, {1 - r['alpha']:.0%} lower bound "
        + (signed(lb) if (lb := paired_lower_bound(d, r["alpha"])) is not None else "none")
        for m, d in diffs.items()
    )
    enough = len(seeds) >= r["min_seeds"]
    ok = enough and all(
        (lb := paired_lower_bound(d, r["alpha"])) is not None and lb > -r["delta"] for d in diffs.values()
    )
    lrs = ", ".join(
        f"{c.removeprefix('lora-')}: {pick[c]['vals'][-1]['val/accuracy']:.3f} / {pick[c]['reward_last_third']:.3f}"
        for c in by_lr
    )
    return (
        _command("lora_learning_lr")
        + _command("lora_learning")
        + f"\n{r['measured']}: {r['workload']} workload, {r['steps']} steps, staleness 0, validation every "
        + f"{r['val_every']} steps. Learning rate on seed 0 (final val/accuracy / training reward over the last "
        + f"third): {lrs}; chosen "
        + f"`{chosen.removeprefix('lora-')}`; full fine-tuning at the preset's `trainer.lr`.\n"
        + _table(header, rows)
        + f"\n{bounds}. Evidence rule (`learning_report.certify`: >= {r['min_seeds']} seeds, lower bounds above "
        + f"-{r['delta']:g}): "
        + ("LoRA learns as well as full fine-tuning." if ok else f"not met ({len(seeds)} seeds paired).")
        + "\n"
    )


ENGINE_NOTES = {
    "nocache": "first {nocache_tokens} tokens of each request only (O(L^2): slower still at {new_tokens})",
    "hf_shared": "`hf` with unseeded requests, one shared generator (before issue 34)",
    "hf": "KV cache, continuous batching, 2 torch threads, a seed per request",
    "vllm": "psrl's streaming client, one server, KV cache 2 GiB",
    "vllm_raw": "same server and endpoint, a plain concurrent HTTP client (no psrl), non-streamed",
}


def engines() -> str:
    """docs/engines.md's tokens/s per engine (``benchmarks/engines.py``): the command, the table, the ratios."""
    r = stored.read("engines")
    setting = _command("engines") + (
        f"\n{r['measured']}: {r['model']}, {r['requests']} requests x {r['new_tokens']} new tokens, temperature 1,\n"
        f"prompts of {r['prompt_tokens'][0]}-{r['prompt_tokens'][1]} tokens (chat template), each engine given both "
        f"cores in turn,\n`hf` and `hf_shared` alternating {r['repeats']} times (medians):\n"
    )
    rows = [[f"`{name}`", f"{tps:.1f}", ENGINE_NOTES[name].format(**r)] for name, tps in r["tokens_per_s"].items()]
    ratios = ",\n".join(
        f"`{k}` {v:.2f} (target >= {r['targets'][k]}{'' if v >= r['targets'][k] else ': not met'})"
        for k, v in r["ratios"].items()
    )
    return setting + _table(["engine", "tokens/s", "note"], rows) + f"\nRatios: {ratios}.\n"


def smollm2_repro(name: str) -> str:
    """docs/coordinator.md's SmolLM2 reproducibility (``benchmarks/smollm2_repro.py``): identical trajectories."""
    r = stored.read(name)
    rows = []
    for engine, e in r["engines"].items():
        first = e["first_reward_row_difference"]
        rows.append(
            [
                f"`{engine}`",
                f"{e['identical']} / {e['trajectories']}",
                f"{e['fraction_identical']:.3f}",
                str(e["tokens"]),
            ]
            + ["identical" if e["reward_rows_identical"] else f"differ from step {first}"]
            + [f"{e['seconds'][0]:.0f} / {e['seconds'][1]:.0f}"]
        )
    header = ["engine", "identical trajectories", "fraction", "response tokens (first run)", "`reward/*` rows"]
    header += ["s alone / beside the hog"]
    return (
        _command(name)
        + f"\n{r['measured']}: {r['model']}, `{r['config']}` with\n"
        + f"{', '.join(f'`{s}`' for s in r['settings'])}, `trainer.total_steps={r['total_steps']}`, "
        + f"`trainer.seed={r['seed']}`;\nthe second run of each pair {r['second_run']}:\n"
        + _table(header, rows)
    )


RENDERERS: dict[str, Callable[[], str]] = {
    "engines": engines,
    "heap-cost": heap_cost,
    "smollm2-repro": lambda: smollm2_repro("smollm2_repro"),
    "smollm2-repro-long": lambda: smollm2_repro("smollm2_repro_long"),
    "weights_scale": weights_scale,
    "weights_scale_driver": weights_scale_driver,
    "lora": lora,
    "lora-learning": lora_learning,
    "simulate-reference": simulate_reference,
    "simulate-model-vs-real": simulate_model_vs_real,
    "simulate-adaptive": simulate_adaptive,
    "simulate-routing": simulate_routing,
    "simulate-head-scope": simulate_head_scope,
    "simulate-adaptive-result": simulate_adaptive_result,
    **{
        f"simulate-frontier-{str(sigma).replace('.', '')}-{tag}": functools.partial(simulate_frontier, sigma, mlb)
        for sigma in (0.5, 1.0)
        for tag, mlb in (("any", 0.0), ("lb95", 0.95))
    },
    "trainer-resume-text": lambda: trainer_resume("text"),
    "trainer-resume-cells": lambda: trainer_resume("cells"),
    "trainer-scale": trainer_scale,
    "agent-endpoint": agent_endpoint,
    "agent-learning": lambda: agent_learning("agent_learning"),
    "agent-learning-vllm": lambda: agent_learning("agent_learning_vllm"),
    "learning-agentic-command": lambda: _command("learning_agentic"),
    "learning-agentic-table": lambda: learning_table("learning_agentic"),
    "learning-agentic-certificate": lambda: learning_certificate("learning_agentic"),
    "learning-adaptive": lambda: learning_arms(
        "learning_agentic", [("default", 0), ("default", 2), ("default", 8), ("adaptive", 8)]
    ),
}


def render(text: str) -> str:
    """``text`` with every marked block replaced by what its renderer makes of the stored results now."""
    return BLOCK.sub(
        lambda m: f"<!-- results:{m['name']} -->{RENDERERS[m['name']]()}<!-- /results:{m['name']} -->", text
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    args = ap.parse_args(argv)
    stale = []
    for doc in sorted(DOCS.glob("*.md")):
        text = doc.read_text()
        new = render(text)
        if new != text:
            stale.append(doc.relative_to(stored.ROOT))
            if not args.check:
                doc.write_text(new)
    for doc in stale:
        print(f"{doc}: {'differs from' if args.check else 'rendered from'} docs/results/")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
