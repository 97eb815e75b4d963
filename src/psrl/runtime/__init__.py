"""psrl.runtime."""
