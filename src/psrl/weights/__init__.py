"""psrl.weights: the one owner of a published version -- its format (:mod:`~psrl.weights.format`), publishing it from
the trainer's shards (:mod:`~psrl.weights.publish`), where engines read it (:mod:`~psrl.weights.store`) and a version as a Hugging
Face directory (:mod:`~psrl.weights.export`: ``final/``, a vLLM server's start).

Below both ``rollout`` (the engines read versions) and ``train`` (the ranks publish them): neither imports the other.
"""

from psrl.weights.export import VERSION_FILE, write_model_directory, write_streamed_directory
from psrl.weights.format import (
    INDEX,
    MANIFEST,
    BucketInfo,
    VersionDamaged,
    bucket_digest,
    check_version,
    plan_buckets,
    prune,
    read_buckets,
    read_manifest,
    read_version,
    state_bytes,
    tied_names,
    untie,
    version_digest,
    versions,
    with_tied,
)
from psrl.weights.publish import MB, export_state, iter_buckets, publish_model, state_digest
from psrl.weights.store import FileVersions, ParameterStore, StreamedVersions, VersionDirectories

__all__ = [
    "INDEX",
    "MANIFEST",
    "MB",
    "BucketInfo",
    "VersionDamaged",
    "bucket_digest",
    "check_version",
    "plan_buckets",
    "prune",
    "read_buckets",
    "read_manifest",
    "read_version",
    "state_bytes",
    "tied_names",
    "untie",
    "version_digest",
    "versions",
    "with_tied",
    "export_state",
    "iter_buckets",
    "publish_model",
    "state_digest",
    "VERSION_FILE",
    "write_model_directory",
    "write_streamed_directory",
    "FileVersions",
    "ParameterStore",
    "VersionDirectories",
    "StreamedVersions",
]
