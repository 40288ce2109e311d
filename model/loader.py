"""Load a Llama model onto a device and allocate its paged KV cache."""

from __future__ import annotations

from pathlib import Path

from ..kernels import get_kernels
from .config import ModelConfig
from .llama import LlamaForCausalLM


def resolve_device(device: str) -> str:
    """``"cpu"`` / ``"cuda"`` as given; ``"auto"`` -> ``"cuda"`` when a GPU table loads, else ``"cpu"``.

    Raises:
        ValueError: an unknown device name.
    """
    if device in ("cpu", "cuda"):
        return device
    if device != "auto":
        raise ValueError(f"unknown device {device!r} (expected cpu, cuda or auto)")
    try:
        get_kernels("cuda")
        return "cuda"
    except (RuntimeError, ImportError):
        return "cpu"


def load_model(name_or_path: str, device: str = "cpu", load_format: str = "auto"):
    """Resolve, read and place a model.

    Args:
        name_or_path: a folio model name (e.g. ``smollm2-135m-instruct``) or a Hugging Face Llama
            folder (config.json + safetensors).
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        load_format: ``"auto"`` (weights from the folder's safetensors) or ``"dummy"`` (random
            weights of the config's shapes; only config.json is read).
    Returns:
        ``(model: LlamaForCausalLM, config: ModelConfig, model_dir: pathlib.Path)``.
    Raises:
        ValueError: unknown load_format/device, unsupported architecture, missing tensors.
        FileNotFoundError: the model cannot be found.
        RuntimeError: ``cuda`` without a usable GPU.
    """
    from .registry import resolve_model
    from .weights import dummy_weights, load_weights

    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    kernels = get_kernels(resolve_device(device))
    model_dir = Path(resolve_model(name_or_path))
    config = ModelConfig.from_pretrained(model_dir)
    weights = load_weights(model_dir, config) if load_format == "auto" else dummy_weights(config, seed=0)
    model = LlamaForCausalLM(config, weights, kernels)
    return model, config, model_dir


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, kernels) -> list:
    """One zeroed ``(key_cache, value_cache)`` pair per layer, each ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` of ``kernels.kv_cache_dtype`` on the table's device.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` < 1.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
    xp = kernels.xp
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [(xp.zeros(shape, dtype=kernels.kv_cache_dtype), xp.zeros(shape, dtype=kernels.kv_cache_dtype))
            for _ in range(config.num_hidden_layers)]
