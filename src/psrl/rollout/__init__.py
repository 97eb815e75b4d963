"""psrl.rollout."""
