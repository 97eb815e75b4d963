"""Data that crosses layers: one trajectory, as the rollout side hands it to the trainer.

Standard library only. Every field is plain data (picklable, JSON-able), so trajectories
cross Ray processes and land in ``trajectories.jsonl`` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trajectory:
    """One episode of one prompt, generated (possibly in segments) under versions >= ``v_traj``."""

    uid: str
    """Unique id of this trajectory."""
    group: str
    """Id of the group (prompt) it belongs to; all members of a group share it."""
    v_traj: int
    """Policy version when its generation started (V_traj); staleness is measured from it."""
    prompt_ids: list[int]
    """Token ids of the prompt (not trained on)."""
    response_ids: list[int] = field(default_factory=list)
    """Every token after the prompt: model tokens and tool-output tokens, in order."""
    logprobs: list[float] = field(default_factory=list)
    """Behaviour log-probability of each response token under the weights that produced it (0.0 for tool tokens)."""
    loss_mask: list[int] = field(default_factory=list)
    """1 for tokens the model generated (trained on), 0 for tool output."""
    token_versions: list[int] = field(default_factory=list)
    """Policy version that produced each response token (-1 for tool tokens)."""
    reward: float = 0.0
    """Scalar reward the advantage uses."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Reward metrics the dynamic sampling filter reads: score, acc, seq_reward, seq_final_reward."""
    instances: list[int] = field(default_factory=list)
    """Rollout instance of each generation segment (more than one after migration)."""
    truncated: bool = False
    """Force-completed with its partial output (proactive ``truncate``, or max length)."""
    gen_seconds: float = 0.0
    """Wall (or injected-clock) time from dispatch to completion."""

    @property
    def segment_versions(self) -> list[int]:
        """Versions of the consecutive generation segments (a new segment starts where the version changes)."""
        out: list[int] = []
        for v in self.token_versions:
            if v >= 0 and (not out or out[-1] != v):
                out.append(v)
        return out
