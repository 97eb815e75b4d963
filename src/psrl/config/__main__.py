"""``python -m psrl.config > docs/configuration.md``: print the configuration reference."""

from psrl.config.reference import reference_markdown

print(reference_markdown())
