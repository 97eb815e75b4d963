"""psrl.viz."""
