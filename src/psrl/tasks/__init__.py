"""psrl.tasks."""
