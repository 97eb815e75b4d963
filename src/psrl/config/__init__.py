"""Typed configuration: one YAML file, dotted command-line overrides, validation that names the key.

Every key is a field of a frozen dataclass with its help text and the :class:`~psrl.config.fields.Rule`
of the values it accepts; ``docs/configuration.md`` is generated from them (``python -m psrl.config``)
and a test checks it is current. Derived values (``B``, ``B'``, ``N``, ``N'``) are properties, never
written back; a changed setting is a new config (``dataclasses.replace``, or ``load_config`` with overrides).

The modules, bottom up: ``rules`` (the checks every rule uses), ``fields`` (what a key is), the schema
(``psrl``: the ``psrl.*`` sections, ``sim``: the simulator's, ``task``: ``task.*`` and ``data.*``, ``schema``:
the rest and :class:`Config`), ``compat`` (keys PSRL has that psrl rejects, and renamed keys), ``load`` and
``reference``. Code outside this package imports only the names below (``tests/test_layers.py`` checks it).
"""

from psrl.config.adaptive import AdaptiveStalenessConfig
from psrl.config.compat import MOVED, NOT_BUILT, OUT_OF_SCOPE, PSRL_DEFAULT_DIFFERS, PSRL_OWN
from psrl.config.deployment import DeploymentConfig
from psrl.config.load import PRESET, apply_overrides, config_from_dict, config_to_dict, leaf_keys, load_config
from psrl.config.psrl import (
    GroupPostProcessConfig,
    MigConfig,
    PartialRolloutConfig,
    ProactiveFilterConfig,
    PsrlConfig,
    RedundantRolloutConfig,
    RoutingConfig,
    SyncAndMigConfig,
    SyncConfig,
)
from psrl.config.reference import allowed, reference_markdown
from psrl.config.rules import check_out_dir
from psrl.config.schema import (
    AlgorithmConfig,
    Config,
    DataConfig,
    FilterGroupsConfig,
    ModelConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    RuntimeConfig,
    TaskConfig,
    TrainerConfig,
    VllmConfig,
    WeightsConfig,
)
from psrl.config.sim import (
    ArealSimConfig,
    GenTimeConfig,
    SimConfig,
    SimDecodeConfig,
    SimDivergenceConfig,
    TinkerSimConfig,
    VerlSimConfig,
)
from psrl.errors import ConfigError

__all__ = [
    # loading and writing a config
    "Config",
    "ConfigError",
    "load_config",
    "apply_overrides",
    "config_to_dict",
    "config_from_dict",
    "check_out_dir",
    "PRESET",
    # the reference page and the key list it (and the key tests) walk
    "reference_markdown",
    "allowed",
    "leaf_keys",
    # keys PSRL has that psrl rejects or renamed
    "MOVED",
    "PSRL_OWN",
    "OUT_OF_SCOPE",
    "NOT_BUILT",
    "PSRL_DEFAULT_DIFFERS",
    # the sections
    "PsrlConfig",
    "AdaptiveStalenessConfig",
    "PartialRolloutConfig",
    "RedundantRolloutConfig",
    "RoutingConfig",
    "SyncAndMigConfig",
    "SyncConfig",
    "MigConfig",
    "ProactiveFilterConfig",
    "GroupPostProcessConfig",
    "DeploymentConfig",
    "AlgorithmConfig",
    "RolloutCorrectionConfig",
    "FilterGroupsConfig",
    "ModelConfig",
    "TaskConfig",
    "TrainerConfig",
    "DataConfig",
    "RolloutConfig",
    "VllmConfig",
    "WeightsConfig",
    "RuntimeConfig",
    "SimConfig",
    "SimDivergenceConfig",
    "GenTimeConfig",
    "SimDecodeConfig",
    "ArealSimConfig",
    "TinkerSimConfig",
    "VerlSimConfig",
]
