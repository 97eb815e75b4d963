"""Group filters: the dynamic sampling rule, member formats, pickling, and building from config."""

import pickle

import pytest

from psrl.algo import DynamicSamplingFilter, build_group_filter
from psrl.config import AlgorithmConfig, ConfigError, FilterGroupsConfig, GroupPostProcessConfig, PsrlConfig
from psrl.types import Trajectory


def _traj(i: int, score: float) -> Trajectory:
    return Trajectory(uid=f"t{i}", group="g", v_traj=0, prompt_ids=[1], metrics={"score": score, "acc": 1.0})


@pytest.mark.parametrize(
    "scores, keep",
    [
        ([1.0, 1.0, 1.0, 1.0], False),  # all right: zero advantage everywhere
        ([0.0, 0.0], False),  # all wrong
        ([0.0, 1.0, 0.0, 0.0], True),
        ([0.5, 0.5 + 1e-12], True),  # any spread at all is signal
        ([0.3], False),  # one member: std 0
        ([], False),
        ([float("nan"), float("nan")], True),  # NaN is never 'equal': kept, surfaces downstream
    ],
)
def test_dynamic_sampling_rule(scores, keep):
    """Keep a group iff its metric has non-zero std over the members (exactly: not all equal)."""
    f = DynamicSamplingFilter("score")
    assert f([_traj(i, s) for i, s in enumerate(scores)]) is keep


def test_reads_the_configured_metric_only():
    """The filter looks at its own metric: 'acc' is constant here although 'score' varies."""
    group = [_traj(0, 0.0), _traj(1, 1.0)]
    assert DynamicSamplingFilter("score")(group) is True
    assert DynamicSamplingFilter("acc")(group) is False


def test_accepts_plain_and_nested_dicts():
    """Members may be dicts holding the metric, or dicts with a 'metrics' dict (JSON rows)."""
    f = DynamicSamplingFilter("score")
    assert f([{"score": 1}, {"score": 1}]) is False
    assert f([{"metrics": {"score": 0}}, {"metrics": {"score": 1}}]) is True


def test_missing_metric_is_an_error_naming_it():
    """A member without the metric is a KeyError naming the metric and the config key."""
    with pytest.raises(KeyError, match="seq_reward.*filter_groups.metric"):
        DynamicSamplingFilter("seq_reward")([_traj(0, 1.0), _traj(1, 0.0)])


def test_pickle_round_trip():
    """The filter crosses Ray processes: a pickled copy is equal and decides identically."""
    f = DynamicSamplingFilter("score")
    g = pickle.loads(pickle.dumps(f))
    assert g == f and g.metric == "score"
    for group in ([_traj(0, 1.0), _traj(1, 1.0)], [_traj(0, 1.0), _traj(1, 0.0)]):
        assert g(group) is f(group)


# ------------------------------------------------------------------ build_group_filter


def _cfgs(enable=True, name="dynamic_sampling_filter", metric="score"):
    p = PsrlConfig(group_post_process=GroupPostProcessConfig(enable=enable, name=name))
    return p, AlgorithmConfig(filter_groups=FilterGroupsConfig(metric=metric))


def keep_long_groups(group):
    """A module-level filter for the module:callable path."""
    return len(group) > 2


class KeepEverything:
    """A filter class: build_group_filter instantiates it with no arguments."""

    def __call__(self, group):
        return True


def test_disabled_gives_none():
    """enable: false -> no filter, whatever the name says."""
    assert build_group_filter(*_cfgs(enable=False, name="nonsense")) is None


def test_dynamic_sampling_from_config():
    """name dynamic_sampling_filter -> DynamicSamplingFilter on algorithm.filter_groups.metric."""
    f = build_group_filter(*_cfgs(metric="acc"))
    assert f == DynamicSamplingFilter("acc")
    assert pickle.loads(pickle.dumps(f)) == f


def test_module_callable_function_and_class():
    """module:function imports the function; module:Class returns an instance."""
    f = build_group_filter(*_cfgs(name=f"{__name__}:keep_long_groups"))
    assert f is keep_long_groups
    c = build_group_filter(*_cfgs(name=f"{__name__}:KeepEverything"))
    assert isinstance(c, KeepEverything) and c([]) is True


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(name=None), "psrl.group_post_process.name"),
        (dict(metric=None), "algorithm.filter_groups.metric"),
        (dict(name="no_such_filter"), "psrl.group_post_process.name"),
        (dict(name="no_such_module_xyz:f"), "psrl.group_post_process.name"),
        (dict(name="psrl.algo.filters:missing"), "psrl.group_post_process.name"),
        (dict(name="psrl.algo.filters:__doc__"), "psrl.group_post_process.name"),
    ],
)
def test_errors_name_the_key(kw, key):
    """Every way of misconfiguring the filter is a ConfigError naming the key to fix."""
    with pytest.raises(ConfigError) as e:
        build_group_filter(*_cfgs(**kw))
    assert e.value.key == key and key in str(e.value)
