"""Model configuration of a Hugging Face Llama checkpoint (``config.json``).

Field names follow Hugging Face ``transformers``' ``LlamaConfig``
(https://huggingface.co/docs/transformers/model_doc/llama#transformers.LlamaConfig).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_MODEL_TYPES = ("llama",)
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass
class ModelConfig:
    """The shapes and constants of a Llama-architecture decoder.

    Attributes:
        vocab_size: rows of the embedding table (and of ``lm_head``).
        hidden_size: model width.
        intermediate_size: SwiGLU MLP width.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: K/V heads (GQA: ``num_attention_heads % num_key_value_heads == 0``).
        head_dim: width of one head (default ``hidden_size // num_attention_heads``).
        rope_theta: RoPE base.
        rope_scaling: ``None`` or the config's dict as is (e.g. ``{"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}``).
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: ``lm_head`` shares ``model.embed_tokens.weight`` (HF Llama default False).
        max_position_embeddings: longest context the model was trained for, in tokens.
        bos_token_id: BOS id or ``None``.
        eos_token_ids: all end-of-sequence ids (``eos_token_id`` may be an int or a list in json).
        pad_token_id: padding id or ``None``.
        architectures: the ``architectures`` list of config.json.
        model_type: ``"llama"``.
        hidden_act: ``"silu"``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    architectures: list[str] = field(default_factory=lambda: ["LlamaForCausalLM"])
    model_type: str = "llama"
    hidden_act: str = "silu"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"config: unsupported rope_scaling type {rope_type!r} "
                                 f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
            if rope_type == "llama3" and "factor" not in self.rope_scaling:
                raise ValueError("config: rope_scaling of type llama3 needs 'factor'")

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Build from a config.json dict (Hugging Face ``LlamaConfig`` keys).

        Raises:
            ValueError: an architecture other than ``LlamaForCausalLM`` / model_type ``llama``, an
                activation other than silu, attention/MLP biases, a rope_scaling type other than
                llama3, a required key missing, or inconsistent head counts.
        """
        archs = list(d.get("architectures") or [])
        model_type = d.get("model_type", "llama")
        if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(f"unsupported architecture {archs} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (Llama uses silu)")
        for bias in ("attention_bias", "mlp_bias"):
            if d.get(bias):
                raise ValueError(f"unsupported {bias}=true (folio's Llama has no biases)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ValueError(f"config.json is missing {', '.join(missing)}")
        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        rope_scaling = d.get("rope_scaling")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
            eos_token_ids=eos_ids,
            pad_token_id=None if d.get("pad_token_id") is None else int(d["pad_token_id"]),
            architectures=archs or ["LlamaForCausalLM"],
            model_type=model_type,
            hidden_act=act,
        )

    @classmethod
    def from_pretrained(cls, model_dir) -> "ModelConfig":
        """Read ``model_dir/config.json``.

        Raises:
            FileNotFoundError: no config.json in ``model_dir``.
            ValueError: see ``from_dict``.
        """
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        """The config as a Hugging Face config.json dict (inverse of ``from_dict``)."""
        eos = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids) or None
        return {
            "architectures": list(self.architectures),
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "attention_bias": False,
            "mlp_bias": False,
        }

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """Bytes of K and V cache one token takes over all layers: 2 x layers x kv_heads x head_dim x bytes.

        Llama 3.1 8B (32 layers, 8 KV heads, head_dim 128) at 2 bytes (bf16) gives 131072 (128 KiB).
        """
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * int(bytes_per_value)

    @property
    def num_parameters(self) -> int:
        """Number of weights (embedding, layers, final norm, and lm_head when untied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        layer = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * i
        n = self.vocab_size * h + self.num_hidden_layers * layer + h
        return n if self.tie_word_embeddings else n + self.vocab_size * h
