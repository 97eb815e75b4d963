"""psrl.sim."""
