"""psrl.models."""
