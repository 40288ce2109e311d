"""Load a Llama model onto a device and allocate its paged KV cache."""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import numpy as np
from pathlib import Path

from ..kernels import get_kernels
from ..kernels.quant_reference import GGML_TYPE_NAMES, QuantizedWeight
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


ACTIVATION_QUANTIZATIONS = ("auto", "int8", "none")
"""``--activation-quantization`` values (``resolve_activation_quantization``)."""

_FLOAT_TYPES = ("F32", "F16", "BF16")


def _refuse_activation_quantization(value, dtype="auto"):
    why = (" (--dtype float32 dequantizes a .gguf file's weights: drop one of the two flags)" if dtype == "float32"
           else "")
    raise ValueError(f"--activation-quantization {value}: int8 activations apply to weights served in quantized "
                     f"GGUF types: a .gguf file of quantized tensors with --dtype auto, or --quantization{why}")


def on_cpu_integer_products() -> bool:
    """Whether the CPU kernels have integer dot products here (the CPU table's ``integer_products``:
    AVX2 or AVX512-VNNI; elsewhere every product keeps float32 activations and the model reports
    ``"none"``)."""
    return bool(get_kernels("cpu").integer_products)


def _check_activation_quantization(value) -> None:
    if value not in ACTIVATION_QUANTIZATIONS:
        raise ValueError(f"activation_quantization must be one of {', '.join(ACTIVATION_QUANTIZATIONS)}, "
                         f"got {value!r} (float32 activations are \"none\")")


def _activations(requested: str, quantized: bool, stored_gguf) -> str:
    """The rule of ``resolve_activation_quantization``: ``quantized``, whether weights in quantized
    GGUF types are served; ``stored_gguf``, the GGUF file whose weights are served as stored (not
    quantized at load), or None."""
    from .registry import packaged_model_name
    if not quantized or requested == "none" or not on_cpu_integer_products():
        return "none"
    if requested == "int8" or stored_gguf is None:
        return "int8"
    return "none" if packaged_model_name(stored_gguf) is not None else "int8"


def resolve_activation_quantization(requested: str, name_or_path: str, dtype: str = "auto",
                                    quantization: str | None = None, load_format: str = "auto") -> str:
    """What the CPU products of a model's quantized weights take as activations: ``"int8"`` or
    ``"none"`` (float32). Reads only the model's import folder and GGUF / safetensors headers.

    ``"none"`` wherever no weights in quantized GGUF types are served (float weights) or the CPU has
    no integer dot products (``on_cpu_integer_products``: every product then keeps float32
    activations). Otherwise:

    - ``"int8"`` / ``"none"``: as given (``load_model`` refuses int8 for weights that are not in
      quantized GGUF types).
    - ``"auto"`` (the default): ``"int8"`` for weights served in quantized GGUF types (a ``.gguf``
      file of Q4_K, Q8_0, ... tensors with ``--dtype auto``, or ``--quantization``), as llama.cpp
      computes them (every product of a quantized type quantizes its activations to 8 bits) and as
      vLLM's GGUF kernels do; ``"none"`` for the weights of a known model's packaged file served as
      stored (the embedded default model's, recognised by content wherever the file lies:
      ``registry.packaged_model_name``): its golden greedy outputs are the float32 products of its
      exactly dequantized weights, and int8 activations change them (docs/kernels.md, "Quantized
      weights").

    Raises:
        ValueError: a value not in ``ACTIVATION_QUANTIZATIONS``; what ``registry.resolve_model``
            raises.
    """
    from .gguf_header import read_tensor_infos
    from .gguf_weights import gguf_source
    from .registry import resolve_model

    _check_activation_quantization(requested)
    if requested == "none":
        return "none"
    if quantization is not None:
        return _activations(requested, True, None)
    if dtype != "auto" or load_format == "dummy":
        return "none"
    source = gguf_source(Path(resolve_model(name_or_path)))
    if source is None:
        return "none"
    _, infos = read_tensor_infos(source)
    quantized = any(GGML_TYPE_NAMES.get(info.type_id) not in _FLOAT_TYPES for info in infos.values())
    return _activations(requested, quantized, source)


def check_quantization(name_or_path: str, quantization: str | None, dtype: str = "auto",
                       load_format: str = "auto") -> None:
    """Refuse ``quantization`` of weights that are already in quantized GGUF types, from the GGUF
    header alone (milliseconds), before any weight is read or kernel compiled: on the CPU with
    ``dtype="auto"`` a ``.gguf`` file's tensors are served as stored, and ``quantize_weights``
    takes float matrices only.

    Raises:
        ValueError: naming the flag, the file's quantized type and a tensor, and the ways out.
        what ``registry.resolve_model`` raises.
    """
    from .gguf_header import read_tensor_infos
    from .gguf_weights import gguf_source
    from .registry import resolve_model

    if quantization is None or dtype != "auto" or load_format == "dummy":
        return
    source = gguf_source(Path(resolve_model(name_or_path)))
    if source is None:
        return
    _, infos = read_tensor_infos(source)
    quantized = [(name, GGML_TYPE_NAMES.get(info.type_id, str(info.type_id))) for name, info in infos.items()
                 if GGML_TYPE_NAMES.get(info.type_id) not in _FLOAT_TYPES]
    if quantized:
        name, type_name = quantized[0]
        raise ValueError(f"--quantization {quantization}: {source.name} is already quantized ({type_name}, e.g. "
                         f"{name}); --quantization applies to float weights (serve the file as it is, add "
                         f"--dtype float32 to quantize its dequantized weights, or re-quantize it with "
                         f"llama.cpp's llama-quantize)")


def load_model(name_or_path: str, device: str = "cpu", load_format: str = "auto", dtype: str = "auto",
               quantization: str | None = None, activation_quantization: str = "auto"):
    """Resolve, read and place a model.

    Which weights the kernels read (``dtype``):

    - ``"auto"`` on the CPU: the types the weights are stored in. A GGUF file's tensors are served
      from the file, memory-mapped (Q4_K, Q8_0, ... as stored: ``gguf_weights.py``); 16-bit
      safetensors stay 16-bit; float32 stays float32. On the GPU: bfloat16 (a GGUF file through its
      float32 import).
    - ``"float32"``: everything float32 (a GGUF file dequantized once into ``models/<name>-float32``).
    - ``"bfloat16"``: the GPU's own type (refused on the CPU by the model runner).

    Args:
        name_or_path: a folio model name (e.g. ``smollm2-135m-instruct``), a ``.gguf`` file or a
            Hugging Face Llama folder (config.json + safetensors).
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        load_format: ``"auto"`` (weights from the files) or ``"dummy"`` (random weights of the
            config's shapes; only config.json is read).
        dtype: see above.
        quantization: ``None``, or a name of ``quantize.QUANTIZATIONS`` (``"q8_0"``, ``"q4_k"``):
            float matrices quantized as they load (CPU only; not for weights already in GGUF types).
        activation_quantization: ``"auto"``, ``"int8"`` or ``"none"``
            (``resolve_activation_quantization``): with int8 the products of weights in quantized GGUF
            types take activations quantized per 32 values (integer dot products;
            ``QuantizedWeight``'s ``activations``). ``"int8"`` needs such weights (a ``.gguf`` file or
            ``quantization``).
    Returns:
        ``(model: LlamaForCausalLM, config: ModelConfig, model_dir: pathlib.Path)``; the model's
        ``activation_quantization`` is the resolved value (``"int8"`` or ``"none"``).
    Raises:
        ValueError: unknown load_format/device/dtype/quantization/activation_quantization, int8
            activations of float weights, unsupported architecture, missing
            tensors, a GGUF file that is truncated or of another architecture, quantization of
            already-quantized weights or on the GPU.
        UnsupportedQuantType: a GGUF tensor type folio does not read (named, with the ways out).
        FileNotFoundError: the model cannot be found.
        RuntimeError: ``cuda`` without a usable GPU.
    """
    from .gguf_weights import gguf_source
    from .quantize import quantize_weights
    from .registry import resolve_model

    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {dtype!r}")
    _check_activation_quantization(activation_quantization)
    kernels = get_kernels(resolve_device(device))
    on_cpu = kernels.stacked_layers   # the table that serves weights in GGUF types (the CPU's)
    if quantization is not None and not on_cpu:
        raise ValueError(f"--quantization {quantization} runs on the CPU only (the {kernels.name} kernels read "
                         f"float weights)")
    if on_cpu:
        check_quantization(name_or_path, quantization, dtype, load_format)
    model_dir = Path(resolve_model(name_or_path))
    config = ModelConfig.from_pretrained(model_dir)
    source = gguf_source(model_dir)
    stored = dtype == "auto" and on_cpu   # serve the weights in the types they are stored in
    if activation_quantization == "int8" and quantization is None and load_format != "dummy" and \
            (source is None or not stored):
        # float weights for sure (an import, or safetensors): refused before anything is loaded
        _refuse_activation_quantization(activation_quantization, dtype)
    weights = _read_weights(model_dir, config, kernels, load_format, source, stored)
    if quantization is not None:
        weights = quantize_weights(weights, quantization)
    activations = "none"
    if activation_quantization != "none":
        # (only weights quantized at load, or a GGUF file's as stored: the GPU's dummy weights are
        # made on the device as they are read)
        in_gguf_types = quantization is not None or (source is not None and stored and load_format != "dummy")
        activations = _set_activations(weights if in_gguf_types else {}, activation_quantization, dtype,
                                       source if quantization is None else None)
    model = LlamaForCausalLM(config, weights, kernels)
    model.activation_quantization = activations
    return model, config, model_dir


def _read_weights(model_dir: Path, config: ModelConfig, kernels, load_format: str, source, stored: bool):
    """The weights ``load_model`` serves, by name: random ones of the config's shapes (``"dummy"``;
    made on the device where the table can), a GGUF file's tensors as stored (``source`` with
    ``stored``), else the safetensors of ``model_dir`` or of a GGUF file's float32 import (16-bit
    kept with ``stored``, bfloat16 where the table's KV cache is bfloat16)."""
    from .gguf_weights import load_gguf_weights
    from .registry import float32_import
    from .weights import dummy_weights, load_weights

    if load_format == "dummy":
        if hasattr(kernels, "random_weight"):  # made on the device: no host copy of an 8B model
            return _DeviceDummyWeights(config, kernels)
        return dummy_weights(config, seed=0)
    if source is not None and stored:
        # (--quantization of a file of quantized types was refused before: check_quantization)
        return load_gguf_weights(source, config)
    folder = float32_import(model_dir) if source is not None else model_dir
    return load_weights(folder, config, keep_bf16=kernels.kv_cache_dtype == np.uint16, keep_16bit=stored)


def _set_activations(weights: Mapping, requested: str, dtype: str, stored_gguf) -> str:
    """Resolve ``requested`` (``"auto"`` or ``"int8"``) for the weights in quantized GGUF types among
    ``weights`` (``_activations``' rule; ``stored_gguf`` the file they are served from as stored,
    or None) and mark each of them ``activations = "int8"`` where that is the answer; returns it.

    Raises:
        ValueError: ``"int8"`` with no weight in a quantized GGUF type.
    """
    quantized = [w for w in weights.values() if isinstance(w, QuantizedWeight) and w.type_name not in _FLOAT_TYPES]
    if requested == "int8" and not quantized:
        _refuse_activation_quantization(requested, dtype)
    # (weights quantized at load are not the file's: the default model's rule does not apply)
    activations = _activations(requested, bool(quantized), stored_gguf)
    for w in quantized if activations == "int8" else ():
        w.activations = "int8"
    return activations


def serves_quantized(name_or_path: str, dtype: str = "auto", quantization: str | None = None,
                     load_format: str = "auto") -> bool:
    """Whether ``load_model`` on the CPU serves this model's matrices in GGUF / 16-bit types (its
    kernels then differ from a float32 model's): with ``quantization``, or ``dtype="auto"`` and a
    GGUF file's weights or 16-bit safetensors. Reads only the import folder and safetensors headers.

    Raises:
        what ``registry.resolve_model`` raises.
    """
    from .gguf_weights import gguf_source
    from .registry import resolve_model
    from .weights import stored_16bit

    if quantization is not None:
        return True
    if dtype != "auto" or load_format == "dummy":
        return False
    model_dir = Path(resolve_model(name_or_path))
    return gguf_source(model_dir) is not None or stored_16bit(model_dir)


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
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    dtype = kernels.kv_cache_dtype if dtype is None else dtype
    # the table's zeros: the CPU's on huge pages (kernels/cpu/memory.py)
    zeros = kernels.zeros
    return [(zeros(shape, dtype=dtype), zeros(shape, dtype=dtype)) for _ in range(config.num_hidden_layers)]
