"""The one metric-name table: every key ``psrl train`` writes to ``metrics.jsonl``.

Each metric has one name, used alike by the code that computes it, ``metrics.jsonl``, the
progress line, the trackers and the plot labels. ``docs/metrics.md`` is generated from this
table (``python -m psrl.metrics > docs/metrics.md``; a test fails when the page is stale). Every
writer of ``metrics.jsonl`` rows (the run recorder, the memory sink) passes each row through
:func:`checked`, which refuses a key this table does not list, so no code path can emit one.
A name ending in ``/*`` stands for a family whose members are listed (``counts/*``: one key per
counter); a name ending in ``@s<k>`` for one key per staleness level ``k`` present in the batch
(``divergence/ess@s<k>``: ``divergence/ess@s0``, ``divergence/ess@s2`` ...). A family never matches a
per-level key: those are listed one by one. ``step``, ``version`` and ``time`` are the rows' index
keys (:data:`INDEX`).

Standard library only: the simulator and the viewer read these names too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Metric", "METRICS", "INDEX", "LEVEL", "known", "levels", "unknown", "checked", "markdown"]

LEVEL = "@s<k>"
"""The suffix of a per-staleness-level name in the table; a key carries ``@s`` and the level's digits instead."""


@dataclass(frozen=True)
class Metric:
    name: str
    """The key in ``metrics.jsonl`` (``prefix/*`` for a family)."""
    unit: str
    """Unit of the value: ``s``, ``count``, ``fraction``, ``nats``, ``steps``, ``tokens``, ... or ``-``."""
    meaning: str
    """What it measures, and over what (a step's batch, the run so far, ...)."""
    owner: str
    """The one module that computes it."""
    members: tuple[str, ...] = ()
    """For a family ``prefix/*``: the names after ``prefix/`` it writes (each one a key)."""


def _m(name: str, unit: str, meaning: str, owner: str, members: str = "") -> Metric:
    return Metric(name, unit, meaning, owner, tuple(members.split()))


_C = "psrl.runtime.coordinator"
_T = "psrl.train.trainer"
_W = "psrl.train.worker"
_L = "psrl.algo.losses"
_X = "psrl.algo.corrections"
_A = "psrl.rollout.client.records"
_P = "psrl.rollout.serving.pool"
_E = "psrl.rollout.serving.pool"
_V = "psrl.runtime.validate"
_D = "psrl.algo.divergence"

METRICS: tuple[Metric, ...] = (
    # progress and time
    _m("step", "steps", "Training steps done (the trainer's version after this step).", _C),
    _m("version", "version", "Policy version published by this step.", _C),
    _m("time", "s", "Seconds since the run (or this resumed invocation) started.", _C),
    _m("time/step_s", "s", "Seconds between the previous step's end and this one's.", _C),
    _m("time/train_s", "s", "Seconds the trainer spent on this step's batch.", _C),
    _m(
        "time/publish_s",
        "s",
        "Seconds publishing this step's version (psrl.weights, off the event loop): the ranks writing "
        "weights/v{N} bucket by bucket from their shards, or, at one rank with hf engines in the driver, its "
        "tensors handed to the in-memory store.",
        _T,
    ),
    _m(
        "time/sync_s",
        "s",
        "Seconds from the end of a step's optimiser step until every live engine serves its version (publish + "
        "load, as the sync strategy times it); measured after that step's row is written, so reported in a later "
        "row with weights/synced_version naming the version.",
        _C,
    ),
    _m("weights/synced_version", "", "The version time/sync_s of this row measures.", _C),
    _m("weights/bytes", "B", "Bytes of weights this step's version moved (the published tensors, all ranks).", _T),
    _m("throughput/trajectories_per_s", "1/s", "Trajectories completed per second, over the run so far.", _C),
    # the batch
    _m("reward/mean", "reward", "Mean reward of the trajectories of this step's batch.", _C),
    _m("reward/std", "reward", "Standard deviation of the batch's rewards.", _C),
    _m("reward/acc", "fraction", "Mean accuracy (the reward's 'acc', else the reward) of the batch.", _C),
    _m("staleness/mean", "versions", "Mean consumed_version - V_traj over the batch (the measured lag).", _C),
    _m("staleness/max", "versions", "Max consumed_version - V_traj over the batch; never above psrl.staleness.", _C),
    _m(
        "staleness/bound",
        "versions",
        "The bound new reservations use after this step: psrl.staleness, or where psrl.adaptive_staleness moved it "
        "(within psrl.staleness; docs/staleness.md).",
        _C,
    ),
    _m(
        "staleness/*",
        "count",
        "The staleness manager's own counters (psrl.staleness.Stats), run so far. They count "
        "protocol calls and group entries (staleness/filtered: groups; counts/filtered: their trajectories).",
        "psrl.staleness.manager",
        "reserves refusals stale_refusals completes occupies surplus filtered rejected aborts passive_aborts consumes",
    ),
    _m("batch/trajectories", "count", "Trajectories in this step's batch (B x N).", _C),
    _m(
        "batch/sequences",
        "count",
        "Training sequences in this step's batch: the trainer's rows; only in a batch with an agent episode split "
        "under task.agent_history=split (one sequence per rewritten history plus one), else it is "
        "batch/trajectories.",
        _C,
    ),
    _m(
        "batch/response_len_mean",
        "tokens",
        "Mean response length (model and tool tokens, over all of a trajectory's sequences) in the batch.",
        _C,
    ),
    _m("batch/masked_frac", "fraction", "Fraction of response tokens masked out of the loss (tool output).", _C),
    _m("batch/truncated_frac", "fraction", "Fraction of the batch force-completed (truncate filter, max length).", _C),
    _m(
        "batch/tool_call_frac",
        "fraction",
        "Fraction of the batch with at least one tool call (the reward's tool_calls: parsed calls of task.name=agent, "
        "the calculator calls of tool_arith); only for tasks whose reward counts tool_calls.",
        _C,
    ),
    _m("buffers", "-", "State of every live buffer after the consume: {version: PENDING|STUCK|READY|...}.", _C),
    # the engines (docs/engines.md)
    _m(
        "engine/logprob_mismatch_mean",
        "nats",
        "Mean |behaviour - trainer-recomputed log-prob| over the batch's "
        "generated tokens produced at the trainer's version (train-inference mismatch; ~0 for hf).",
        _T,
    ),
    _m("engine/logprob_mismatch_max", "nats", "Max of the same; jumps when an engine missed a weight update.", _T),
    _m(
        "engine/mismatch_tokens",
        "tokens",
        "Tokens the mismatch was measured on (generated at the trainer's version).",
        _T,
    ),
    _m(
        "engine/failed_requests",
        "count",
        "Requests an engine failed (died, timed out) and handed back to be re-run "
        "elsewhere with their tokens; run so far.",
        _E,
    ),
    _m(
        "engine/restarts",
        "count",
        "Engine restarts after failures, run so far (at most rollout.max_restarts each).",
        _E,
    ),
    _m("engine/dead", "count", "Rollout instances given up on now (restarted rollout.max_restarts times).", _E),
    _m(
        "engine/rejoins",
        "count",
        "Times a rollout instance given up on served again with a new engine (Ray: a new engine actor on a rollout "
        "node with room, runtime.ray_rejoin_attempts), run so far.",
        _E,
    ),
    _m("engine/tokens_per_s", "1/s", "Generated tokens per second summed over the engines' recent windows.", _E),
    _m("engine/running", "count", "Requests generating in the engines now, summed.", _E),
    _m("engine/queued", "count", "Requests accepted but waiting, summed over instances and engines.", _E),
    _m("engine/kv_usage", "fraction", "Mean KV-cache use of the engines that report one (vllm); absent otherwise.", _E),
    _m("instance_versions", "versions", "Weight version of each rollout instance at the end of the step.", _C),
    # the optimiser and the loss
    _m("train/loss", "nats", "Total loss of the step (mean over minibatches).", _T),
    _m("train/grad_norm", "-", "Gradient norm before clipping (mean over minibatches).", _T),
    _m("train/adv_abs_mean", "-", "Mean |advantage| over the batch.", _T),
    _m(
        "train/empty_minibatches",
        "count",
        "Minibatches of this step with no token in the loss (all masked: loss mask, rejection sampling, M2PO): "
        "not stepped, as AdamW's momentum and weight decay would still move the weights.",
        _W,
    ),
    _m(
        "train/skipped_steps",
        "count",
        "Steps skipped for a NaN / infinite loss or gradient norm, run so far (weights "
        "unchanged, batch recorded 'skipped'; trainer.max_skipped_steps in a row stop the run).",
        _C,
    ),
    _m("loss/policy", "nats", "Policy-gradient loss (PPO / GSPO, after aggregation).", _L),
    _m("actor/ratio_mean", "-", "Mean importance ratio pi_theta / pi_old over loss tokens.", _L),
    _m("actor/clip_frac_low", "fraction", "Loss tokens clipped below (ratio < 1 - clip_ratio_low).", _L),
    _m("actor/clip_frac_high", "fraction", "Loss tokens clipped above (ratio > 1 + clip_ratio_high).", _L),
    _m("actor/approx_kl", "nats", "Approximate KL(pi_old || pi_theta) over loss tokens.", _L),
    _m("correction/rho_mean", "-", "Mean ratio pi_old / pi_behaviour (the off-policy gap the corrections see).", _X),
    _m("correction/is_weight_mean", "-", "Mean truncated importance weight.", _X),
    _m("correction/is_weight_max", "-", "Max truncated importance weight.", _X),
    _m("correction/is_truncated_frac", "fraction", "Tokens whose IS weight hit the truncation C.", _X),
    _m("correction/rs_masked_frac", "fraction", "Tokens masked by rejection sampling.", _X),
    _m(
        "correction/m2po_masked_frac",
        "fraction",
        "Valid tokens M2PO masked out of the batch (largest squared "
        "log-ratio first, until the rest's second moment is <= m2po_threshold); only with "
        "algorithm.rollout_correction.m2po.",
        _X,
    ),
    _m(
        "correction/ess_lr_scale",
        "-",
        "The factor on this step's learning rate: max(ess_lr_min, sqrt(ESS)) of the "
        "batch's sequence importance weights (VCPO); only with algorithm.rollout_correction.ess_lr.",
        _X,
    ),
    # divergence of the batch: behaviour policy vs the trainer's pre-update policy (section below the table)
    _m(
        "divergence/ess",
        "fraction",
        "Normalised effective sample size (sum w)^2 / (n sum w^2) of the batch's token "
        "weights w = exp(old_logp - behav_logp) (pre-update over behaviour policy) over its n valid tokens.",
        _D,
    ),
    _m(
        "divergence/m2",
        "nats^2",
        "Second moment of the token log-ratio, mean (old_logp - behav_logp)^2 over the "
        "batch's valid tokens (M2PO's statistic).",
        _D,
    ),
    _m(
        "divergence/kl",
        "nats",
        "k3 estimate of KL(pi_behaviour || pi_old): mean (w - 1 - log w) over the batch's valid tokens.",
        _D,
    ),
    _m(
        "divergence/ess@s<k>",
        "fraction",
        "divergence/ess over the tokens of the batch's trajectories of staleness "
        "k (version - V_traj); only for levels with valid tokens.",
        _D,
    ),
    _m("divergence/m2@s<k>", "nats^2", "divergence/m2 over the tokens of staleness k.", _D),
    _m("divergence/kl@s<k>", "nats", "divergence/kl over the tokens of staleness k.", _D),
    _m(
        "staleness/tokens@s<k>",
        "fraction",
        "Token-weighted staleness histogram: the fraction of the batch's valid "
        "tokens whose trajectory has staleness k (version - V_traj).",
        _D,
    ),
    # the rollout side (cumulative)
    _m(
        "counts/*",
        "count",
        "Cumulative trajectory / group counters of the agent manager (see Counts).",
        _A,
        "groups generated trained skipped cancelled aborted filtered surplus rejected retried truncated failed "
        "error_retries",
    ),
    _m(
        "rollout/*",
        "count",
        "Cumulative counters of the rollout instances, summed (decode steps, tokens, weight "
        "loads, requests interrupted, continued, migrated).",
        _P,
        "steps tokens loads interrupted continued migrated",
    ),
    # validation rows (trainer.val_every; their own rows, with step and version, no 'time')
    _m("val/accuracy", "fraction", "Greedy answers' mean 'acc' on the validation set, weights of this version.", _V),
    _m("val/reward", "reward", "Greedy answers' mean score on the validation set.", _V),
    _m("val/pass@k", "fraction", "Validation prompts with a correct answer among k = trainer.val_n samples.", _V),
    _m("val/k", "count", "k of val/pass@k (trainer.val_n).", _V),
    _m("val/prompts", "count", "Validation prompts scored.", _V),
    _m("val/failed", "count", "Validation answers whose reward raised (scored 0).", _V),
    _m("val/seconds", "s", "Seconds the validation took (the run is paused meanwhile).", _V),
    _m(
        "val/time",
        "s",
        "The step's 'time' (seconds since start) of the weights validated: the wall-clock axis.",
        "psrl.runtime.watch",
    ),
)

INDEX: tuple[str, ...] = ("step", "version", "time")
"""The rows' index keys (benchmarks, ``benchmarks/sim_vs_real.py`` and outside checks read them): a step's row has
all three; a validation row ``step`` and ``version`` (the step's ``time`` is its ``val/time``)."""

_BY_NAME = {m.name: m for m in METRICS}


def known(name: str) -> bool:
    """Is ``name`` a key the table lists: a metric, a level of a listed ``...@s<k>`` name, or a listed member of a
    ``prefix/*`` family (which never covers a per-level name)?"""
    if name in _BY_NAME:
        return not name.endswith(("/*", LEVEL))  # a family or a per-level template is no key itself
    base, at, level = name.rpartition("@s")
    if at:
        return level.isdigit() and level.isascii() and f"{base}{LEVEL}" in _BY_NAME
    head, _, tail = name.partition("/")
    family = _BY_NAME.get(f"{head}/*")
    return family is not None and tail in family.members


def levels(row: Mapping[str, object], name: str) -> dict[int, object]:
    """``{k: row[name@s<k>]}`` for every staleness level ``k`` the row holds of the per-level metric ``name``
    (e.g. ``divergence/ess``)."""
    head = f"{name}@s"
    return {int(k[len(head) :]): v for k, v in row.items() if k.startswith(head) and k[len(head) :].isdigit()}


def unknown(keys: Iterable[str]) -> list[str]:
    """The keys of a row that the table (and so ``docs/metrics.md``) does not list."""
    return [k for k in keys if not known(k)]


def checked(row: dict) -> dict:
    """``row`` itself when it may be written: every key listed here, ``step`` and ``version`` present; else
    ValueError naming what is wrong and the fix."""
    bad = unknown(row)
    if bad:
        raise ValueError(
            f"metrics row keys {bad} are not in the metric table: add each to psrl.metrics.METRICS "
            "(one name per metric) and regenerate docs/metrics.md (python -m psrl.metrics)"
        )
    missing = [k for k in INDEX[:2] if k not in row]
    if missing:
        raise ValueError(f"metrics row without its index key(s) {missing}: every row has step and version")
    return row


def markdown() -> str:
    """``docs/metrics.md``."""
    lines = [
        "# Metric names",
        "",
        "Generated from `src/psrl/metrics.py` by `python -m psrl.metrics > docs/metrics.md`; a test fails",
        "when this page is stale. A run cannot write a key missing here: the run recorder refuses the row.",
        "`prefix/*` is a family of keys, one per member listed; `name@s<k>` is one key per staleness level `k`",
        "present in the batch (`divergence/ess@s0`, ...).",
        "",
        "Index keys: " + ", ".join(f"`{k}`" for k in INDEX) + ". A step's row has all three, a validation row",
        "`step` and `version`; benchmarks, `benchmarks/sim_vs_real.py` and outside checks read them.",
        "",
        "| name | unit | meaning | computed in |",
        "|---|---|---|---|",
    ]
    for m in METRICS:
        meaning = m.meaning + (f" Members: {', '.join(m.members)}." if m.members else "")
        cells = [f"`{m.name}`", m.unit, meaning, f"`{m.owner}`"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n" + DIVERGENCE_NOTES


DIVERGENCE_NOTES = """
## Divergence: what to watch as staleness grows, and its neighbours

On every valid (loss) token, `d = old_logp - behav_logp` and `w = exp(d)`: the trainer's pre-update
policy over the behaviour policy that sampled the token, so staleness and engine mismatch together
(`d` clamped to +-20). `divergence/ess`, `divergence/m2` and `divergence/kl` are taken over the whole
batch before the update (ratios of sums, so a batch split over minibatches or trainer ranks gives the
same figures). On-policy they are 1, 0 and 0. A falling ESS (a few tokens hold the weight), an `m2`
above M2PO's 0.04 or a rising `kl` say the data is staler than the corrections in use absorb; the
`@s<k>` figures say at which staleness it happens. The level is the trajectory's staleness
`version - V_traj`, as for `staleness/mean` and the bound of `psrl.staleness` (a trajectory's later
segments may come from newer weights, so it is the largest lag of its tokens).
`staleness/tokens@s<k>` weighs the levels by valid tokens; `staleness/mean` by trajectories.

The neighbours, one name per figure:

| name | compares | over | relation |
|---|---|---|---|
| `correction/rho_mean` | the same weights `w` | valid tokens, per minibatch, mean over minibatches | first moment of `w`: with one minibatch, `m2po` off and no clamped token, `divergence/ess = rho_mean^2 / mean(w^2)` |
| `engine/logprob_mismatch_*` | the same pair, as `abs(d)` | tokens generated at the trainer's own version | engine mismatch without staleness; the staleness-0 trajectories' tokens are among them, so `divergence/m2@s0` is the squared twin of `logprob_mismatch_mean` on those |
| `actor/approx_kl` | current weights vs pre-update policy, `KL(pi_old \\|\\| pi_theta)` (k3) | loss tokens during the update | how far the update moved the policy, not how far the data is from it |
| `divergence/kl` | pre-update vs behaviour, `KL(pi_behaviour \\|\\| pi_old)` (k3) | all valid tokens, before the update | how far the data is from the policy being trained |

The corrections for high staleness act on the same `d`: `algorithm.rollout_correction.m2po` masks
tokens until the kept tokens' `m2` is at most `m2po_threshold` (`correction/m2po_masked_frac`), and
`ess_lr` scales the step's learning rate by `sqrt` of the ESS of the sequence weights
`exp(sum_t d_t)` (`correction/ess_lr_scale`; the sequence ESS, not the token ESS of `divergence/ess`).
"""


if __name__ == "__main__":  # pragma: no cover
    print(markdown(), end="")
