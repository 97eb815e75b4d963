"""Bad input never ends in a traceback: one line naming the key (or file), nothing written first.

The cases of issue #15 run through the real command line (``psrl.cli.main``) from an empty working
directory, so "nothing written" covers the default ``runs/<time>`` too. ``psrl --debug`` and
``PSRL_DEBUG=1`` bring the traceback back for developers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from psrl.cli import main as psrl
from psrl.errors import ConfigError, RunError


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    """An empty working directory; the test fails if anything was written into it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("PSRL_DEBUG", "0")  # recorded, so `psrl --debug` setting it is undone after the test
    yield cwd
    assert list(cwd.iterdir()) == [], "something was written before the error"


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def _model_dir(tmp_path: Path, files: list[str]) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    for f in files:
        (d / f).write_text("{}")
    return d


@pytest.mark.parametrize(
    "overrides, key, says",
    [
        (["model.path=/nonexistent"], "model.path", "no such directory"),
        (["model.path=HuggingFaceTB/SmolLM2-135M"], "model.path", "hub id"),
        (["model.path={tmp}/model"], "model.path", "no config.json"),
        (["model.path={tmp}/model", "model.gguf_file=m.gguf"], "model.gguf_file", "no file 'm.gguf'"),
        (["model.gguf_file=m.gguf"], "model.gguf_file", "model.path is null"),
        (["trainer.lr=-1"], "trainer.lr", "e.g. 3e-4"),
        (["trainer.lr=nan"], "trainer.lr", "finite"),
        (["trainer.run_dir=/proc/nope"], "trainer.run_dir", "cannot write"),
        (["trainer.run_dir={tmp}/afile/run"], "trainer.run_dir", "not a directory"),
        (["task.name=nosuch", "trainer.run_dir={tmp}/run"], "task.name", "arith, dataset, tool_arith"),
        (["task.name=no_such_module_xyz:Task"], "task.name", "cannot import"),
        (["task.kwargs={nope: 1}"], "task.kwargs", "max_value"),
        (["psrl.rollout_n=0"], "psrl.rollout_n", "set psrl.rollout_n to"),
        (["psrl.staleness=-1"], "psrl.staleness", "psrl.staleness=0"),
        (
            [
                "psrl.routing_strategy.max_concurrent_seqs_per_instance=1",
                "psrl.rollout_n=4",
                "psrl.deployment.n_rollout_instances=2",
            ],
            "psrl.routing_strategy.max_concurrent_seqs_per_instance",
            "set psrl.routing_strategy.max_concurrent_seqs_per_instance >= 2",
        ),
        (["runtime.ray_address=127.0.0.1:6379"], "runtime.ray_address", "runtime.backend=ray"),
        (["psrl.nixl.enable=true"], "psrl.nixl", "out of scope"),
        (["model.n_embd=65"], "model.n_embd", "multiple of 2"),
        (["model.n_positions=16"], "model.n_positions", "set model.n_positions >= 64"),
        (["model.dtype=float8"], "model.dtype", "use one of"),
        (["trainer.top_p=0"], "trainer.top_p", "(0, 1]"),
        (["trainer.seed=99999999999999999999999"], "trainer.seed", "too large"),
        (["trainer.total_steps=null"], "trainer.total_steps", "needs a value"),
        (["sim.gen_time.trace={tmp}/t.jsonl"], "sim.gen_time.trace", "file not found"),
        (
            ["algorithm.rollout_correction.rs_threshold_lower=3"],
            "algorithm.rollout_correction.rs_threshold_lower",
            "<= algorithm.rollout_correction.rs_threshold",
        ),
        (
            ["algorithm.rollout_correction.rs_threshold=0.5"],
            "algorithm.rollout_correction.rs_threshold",
            "rs_threshold_lower <= rs_threshold",
        ),
    ],
)
def test_train_reports_bad_values_in_one_line_before_writing(overrides, key, says, tmp_path, empty_cwd, capsys):
    """Each case exits 2 with one line naming the key and saying what to do; the run dir is never created."""
    (tmp_path / "model").mkdir()
    (tmp_path / "afile").write_text("")
    args = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    assert psrl(["train", *args]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"psrl train: config key '{key}'") and says in line, line
    assert not (tmp_path / "run").exists()


def test_model_dir_without_weights_names_what_is_missing(tmp_path, empty_cwd, capsys):
    _model_dir(tmp_path, ["config.json", "tokenizer.json"])
    assert psrl(["train", f"model.path={tmp_path / 'model'}"]) == 2
    assert "no weights" in _one_line(capsys)


def test_model_dir_with_a_gguf_file_suggests_it(tmp_path, empty_cwd, capsys):
    _model_dir(tmp_path, ["SmolLM2.Q8_0.gguf"])
    assert psrl(["train", f"model.path={tmp_path / 'model'}"]) == 2
    assert "model.gguf_file=SmolLM2.Q8_0.gguf" in _one_line(capsys)


def test_a_gguf_file_given_as_model_path_says_how_to_split_it(tmp_path, empty_cwd, capsys):
    d = _model_dir(tmp_path, ["m.gguf"])
    assert psrl(["train", f"model.path={d / 'm.gguf'}"]) == 2
    assert f"model.path={d} model.gguf_file=m.gguf" in _one_line(capsys)


@pytest.mark.parametrize(
    "content, says",
    [("psrl: [1\n", "not valid YAML at line"), ("- 1\n", "must be a mapping"), (b"\xff\xfe", "not UTF-8")],
)
def test_a_broken_config_file_is_one_line_naming_the_file(content, says, tmp_path, empty_cwd, capsys):
    f = tmp_path / "c.yaml"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert psrl(["train", str(f)]) == 2
    line = _one_line(capsys)
    assert str(f) in line and says in line


def test_a_directory_given_as_config_file(tmp_path, empty_cwd, capsys):
    assert psrl(["simulate", str(tmp_path)]) == 2
    assert "is not a file" in _one_line(capsys)


def test_simulate_reports_a_damaged_trace_with_its_line(tmp_path, empty_cwd, capsys):
    trace = tmp_path / "trajectories.jsonl"
    trace.write_text('{"gen_seconds": 1.0}\n{"gen_sec')
    assert psrl(["simulate", "sim.gen_time.dist=trace", f"sim.gen_time.trace={trace}", "sim.steps=2"]) == 2
    assert f"{trace}:2 is not a JSON line" in _one_line(capsys)


@pytest.mark.parametrize("plot, says", [("/proc/nope/x.png", "cannot write"), (".", "is a directory")])
def test_simulate_checks_its_plot_path_first(plot, says, empty_cwd, capsys):
    assert psrl(["simulate", "sim.steps=2", "--plot", plot]) == 2
    line = _one_line(capsys)
    assert "config key '--plot'" in line and says in line


def test_debug_flag_and_env_show_the_traceback(empty_cwd, monkeypatch):
    """``psrl --debug`` and PSRL_DEBUG=1 let the exception through (its traceback), for developers."""
    with pytest.raises(ConfigError) as e:
        psrl(["--debug", "train", "trainer.lr=-1"])
    assert e.value.key == "trainer.lr"
    monkeypatch.setenv("PSRL_DEBUG", "1")
    with pytest.raises(ConfigError):
        psrl(["simulate", "sim.slots=0"])
    monkeypatch.setenv("PSRL_DEBUG", "0")
    assert psrl(["simulate", "sim.slots=0"]) == 2


def test_an_unexpected_error_is_one_line_naming_where_it_was_raised(empty_cwd, monkeypatch, capsys):
    """An exception psrl did not anticipate still prints one line, with the file and function it came from."""
    import psrl.train_cli as train_cli

    def boom(cfg, run_dir, log):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr("psrl.runtime.local.run", boom)
    assert train_cli.main(["trainer.total_steps=1", f"trainer.run_dir={empty_cwd.parent / 'r'}"]) == 1
    line = _one_line(capsys)
    assert "ZeroDivisionError: division by zero" in line and "test_bad_input.py" in line and "in boom" in line
    assert "--debug" in line


def test_run_errors_pickle_with_their_source():
    """Errors cross Ray processes: they keep key / source and message."""
    import pickle

    e = pickle.loads(pickle.dumps(RunError("trajectory g1-0", "reward failed", "fix it")))
    assert (e.source, str(e)) == ("trajectory g1-0", "trajectory g1-0: reward failed -- fix: fix it")
    c = pickle.loads(pickle.dumps(ConfigError("psrl.staleness", "bad", "x")))
    assert c.key == "psrl.staleness" and isinstance(c, ValueError)
    from psrl.rollout.engines.vllm_server import EngineSetupError  # raised in Ray engine actors

    sent = EngineSetupError("the vLLM server on port 1 exited with code 1", "see its log")
    s = pickle.loads(pickle.dumps(sent))
    assert (type(s), str(s), s.source) == (EngineSetupError, str(sent), "rollout.engine=vllm"), str(s)


def test_nothing_is_written_when_config_loads_fine(tmp_path, empty_cwd):
    """Loading (train's prepare) only checks the run directory can be made; it stays unmade until the run."""
    from psrl.train_cli import prepare

    cfg, run_dir = prepare([f"trainer.run_dir={tmp_path / 'a' / 'b'}"])
    assert run_dir == tmp_path / "a" / "b" and not (tmp_path / "a").exists()
    cfg, run_dir = prepare([])  # default runs/<time> under the empty cwd: checked, not created
    assert run_dir.parent.name == "runs"
