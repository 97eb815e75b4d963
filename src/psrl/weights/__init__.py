"""psrl.weights: the one owner of a published version -- its format (:mod:`~psrl.weights.format`), publishing it from
the trainer's shards (:mod:`~psrl.weights.publish`) and where engines read it (:mod:`~psrl.weights.store`).

Below both ``rollout`` (the engines read versions) and ``train`` (the ranks publish them): neither imports the other.
"""

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
    version_digest,
    versions,
)
from psrl.weights.publish import MB, export_state, iter_buckets, publish_model, state_digest
from psrl.weights.store import FileVersions, ParameterStore, VersionDirectories

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
    "version_digest",
    "versions",
    "export_state",
    "iter_buckets",
    "publish_model",
    "state_digest",
    "FileVersions",
    "ParameterStore",
    "VersionDirectories",
]
