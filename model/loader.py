"""Load a Llama model onto a device and allocate its paged KV cache."""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import numpy as np
from pathlib import Path

from ..kernels import get_kernels
from .config import ModelConfig
from .llama import LlamaForCausalLM
from .weights import weight_shapes


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
    if load_format == "auto":
        weights = load_weights(model_dir, config, keep_bf16=kernels.kv_cache_dtype == np.uint16)
    elif hasattr(kernels, "random_weight"):  # made on the device: no host copy of an 8B model
        weights = _DeviceDummyWeights(config, kernels)
    else:
        weights = dummy_weights(config, seed=0)
    model = LlamaForCausalLM(config, weights, kernels)
    return model, config, model_dir


class _DeviceDummyWeights(Mapping):
    """``dummy_weights``' names, shapes and distribution, each tensor made on the kernel table's
    device when first read (``kernels.random_weight``), with a seed derived from its name."""

    def __init__(self, config: ModelConfig, kernels):
        self._shapes = weight_shapes(config)
        self._kernels = kernels

    def __contains__(self, name):  # without generating the tensor (Mapping's default calls __getitem__)
        return name in self._shapes

    def __getitem__(self, name):
        shape = self._shapes[name]
        seed = zlib.crc32(name.encode())
        return self._kernels.random_weight(shape, seed=seed, std=0.02, mean=1.0 if len(shape) == 1 else 0.0)

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self):
        return len(self._shapes)


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, kernels, dtype=None) -> list:
    """One zeroed ``(key_cache, value_cache)`` pair per layer, each ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` of ``dtype`` (default ``kernels.kv_cache_dtype``; one of
    ``kernels.kv_cache_dtypes``) on the table's device.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` < 1.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
    zeros = getattr(kernels, "zeros", None) or kernels.xp.zeros   # the CPU's: on huge pages (kernels/cpu/memory.py)
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    dtype = kernels.kv_cache_dtype if dtype is None else dtype
    return [(zeros(shape, dtype=dtype), zeros(shape, dtype=dtype)) for _ in range(config.num_hidden_layers)]
