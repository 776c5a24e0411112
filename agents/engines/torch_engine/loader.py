"""Building a model: from a Hugging Face checkpoint folder (config.json + safetensors) or a random preset.

``load_model(spec, ...)`` takes the same spec string everywhere (engine,
tokenizer, CLI): a preset name (``tiny``, ``small``, ``kv-heavy``) or the path
of a local folder. Nothing is ever downloaded. Tensors are read one at a time
with ``safetensors.safe_open`` and cast on the way in, so peak memory stays
near the model's size in the target dtype.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from agents.engines.torch_engine.config import PRESETS, ModelConfig, model_config_from_hf, preset
from agents.engines.torch_engine.kv_cache import torch_dtype
from agents.engines.torch_engine.model import LlamaForCausalLM, build_random_model

__all__ = ["CheckpointError", "LoadedModel", "default_dtype", "load_checkpoint", "load_model"]

#: Checkpoint keys that hold no weights of ours (older exports saved rotary buffers).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint folder that is missing files or whose tensors do not fit the config."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    model_id: str  # stable identity: two instances can exchange KV only when these match
    revision: str


def default_dtype(device: torch.device, checkpoint_dtype: str | None = None) -> str:
    """float32 on CPU; on CUDA the checkpoint's half type, else bfloat16."""
    if device.type == "cpu":
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16") else "bfloat16"


def _check_dtype(dtype: str, device: torch.device) -> None:
    torch_dtype(dtype)  # raises for unknown names
    if device.type == "cpu" and dtype == "float16":
        raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")


def load_model(
    spec: str, *, device: str | torch.device = "cpu", dtype: str | None = None, seed: int = 0
) -> LoadedModel:
    """A preset name builds a seeded random model; anything else must be a checkpoint folder."""
    device = torch.device(device)
    if spec in PRESETS:
        chosen = dtype or default_dtype(device)
        _check_dtype(chosen, device)
        config = preset(spec)
        model = build_random_model(config, seed=seed, dtype=torch_dtype(chosen), device=device)
        return LoadedModel(model, config, f"shoal/{spec}", f"seed={seed}")
    path = Path(spec)
    if not path.is_dir():
        raise ValueError(f"{spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a folder")
    return load_checkpoint(path, device=device, dtype=dtype)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors files")
    return files


def load_checkpoint(
    folder: str | Path, *, device: str | torch.device = "cpu", dtype: str | None = None
) -> LoadedModel:
    """Load a Llama / Mistral / Qwen2 checkpoint folder onto ``device``."""
    from safetensors import safe_open

    folder = Path(folder)
    device = torch.device(device)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    config_bytes = config_path.read_bytes()
    raw = json.loads(config_bytes)
    config = model_config_from_hf(raw, name=folder.name)
    checkpoint_dtype = raw.get("torch_dtype") or raw.get("dtype")
    chosen = dtype or default_dtype(device, checkpoint_dtype)
    _check_dtype(chosen, device)
    target = torch_dtype(chosen)

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(target)
    if config.tie_word_embeddings:  # to_empty unties; tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    with torch.no_grad():
        for file in _safetensors_files(folder):
            with safe_open(str(file), framework="pt", device="cpu") as tensors:
                for key in tensors.keys():
                    if key.endswith(_IGNORED_SUFFIXES):
                        continue
                    param = params.get(key)
                    if param is None:
                        raise CheckpointError(f"{file.name}: unexpected tensor {key!r}")
                    tensor = tensors.get_tensor(key)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise CheckpointError(
                            f"{key}: checkpoint shape {tuple(tensor.shape)}, config says {tuple(param.shape)}"
                        )
                    param.copy_(tensor.to(target))
                    loaded.add(key)
    missing = set(params) - loaded
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
        if "lm_head.weight" in loaded and "model.embed_tokens.weight" not in loaded:
            missing.discard("model.embed_tokens.weight")
    if missing:
        raise CheckpointError(f"{folder}: tensors missing from the checkpoint: {sorted(missing)[:5]}")
    revision = hashlib.sha256(config_bytes).hexdigest()[:16]
    return LoadedModel(model.eval(), config, folder.name, revision)

