"""psrl.train."""
