"""psrl.algo."""
