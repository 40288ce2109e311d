"""The Llama decoder forward pass over a flattened varlen batch and a paged KV cache.

Written against a kernel table (``folio.kernels.table.KernelTable``, from
``folio.kernels.get_kernels``) and its array module ``kernels.xp`` only: NumPy + Numba kernels on
the CPU, CuPy + CUDA kernels on the GPU. The per-layer loop of ``forward`` is what the CUDA table
runs, one kernel launch per operation (captured as CUDA graphs for decode steps by
``runtime/worker/device_step.py``); a table with ``stacked_layers`` (the CPU's) runs every layer
of a step in one compiled call (``decoder_layers``, ``kernels/cpu/forward.py``) over weights
stacked per kind (``layer_stacks``), the same kernels in the same order. Weights in GGUF block types or 16-bit
floats (``QuantizedWeight``) are served by the CPU table only.

Architecture: Llama (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language
Models"; Hugging Face ``modeling_llama.py`` naming): pre-norm decoder layers of RMSNorm ->
grouped-query attention with RoPE -> residual -> RMSNorm -> SwiGLU MLP -> residual, a final
RMSNorm and an ``lm_head`` (tied to the embedding table when ``tie_word_embeddings``).
As in vLLM, q/k/v projections are fused into one ``[q + 2 kv, hidden]`` weight and gate/up into
one ``[2 * intermediate, hidden]`` weight at load time (weights kept in their stored types: segments
that the products write side by side into one output), so a layer runs four matrix products; RoPE
and the KV-cache append run as one operation on the fused projection (``rope_and_cache``), and the
residual add is fused with the next RMSNorm. Activations live in a ``Workspace`` of buffers sized
once (grown only when a step has more tokens than any before): nothing is allocated per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels import reference
from ..kernels.quant_reference import BF16, F16, F32, QuantizedWeight
from ..kernels.table import KernelTable
from .attention_metadata import AttentionMetadata
from .config import ModelConfig


class Workspace:
    """The forward pass's activation buffers for up to ``tokens`` tokens and ``rows`` logits rows.

    ``x``, ``q``, ``attn`` and ``act`` (the inputs of matrix products and of attention) have the
    table's ``matmul_input_dtype`` (float32 on CPU, bf16 bits on CUDA); the residual stream and the
    matrix products' outputs are float32. ``view(T, R)`` returns the first rows of each buffer.
    """

    def __init__(self, config: ModelConfig, kernels, tokens: int, rows: int):
        c = config
        xp = kernels.xp
        mm = kernels.matmul_input_dtype
        f32 = np.float32
        H, Hkv, D, hid, inter = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size,
                                 c.intermediate_size)
        self.tokens, self.rows = int(tokens), int(rows)
        self.buffers = {
            "residual": xp.empty((tokens, hid), dtype=f32),
            "hidden": xp.empty((tokens, hid), dtype=f32),
            "x": xp.empty((tokens, hid), dtype=mm),
            "qkv": xp.empty((tokens, (H + 2 * Hkv) * D), dtype=f32),
            "q": xp.empty((tokens, H, D), dtype=mm),
            "attn": xp.empty((tokens, H, D), dtype=mm),
            "gate_up": xp.empty((tokens, 2 * inter), dtype=f32),
            "act": xp.empty((tokens, inter), dtype=mm),
            "final": xp.empty((rows, hid), dtype=mm),
        }

    def view(self, T: int, R: int) -> dict:
        return {name: (b[:R] if name == "final" else b[:T]) for name, b in self.buffers.items()}


@dataclass
class _Layer:
    input_layernorm: Any   # [hidden]
    qkv_proj: Any          # [(H + 2 Hkv) * D, hidden]
    o_proj: Any            # [hidden, H * D]
    post_attention_layernorm: Any  # [hidden]
    gate_up_proj: Any      # [2 * intermediate, hidden]
    down_proj: Any         # [hidden, intermediate]


def _matrix_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight"] + ([] if config.tie_word_embeddings else ["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"] + [p + f"mlp.{n}_proj.weight"
                                                                       for n in ("gate", "up", "down")]
    return names


def as_quantized(w) -> QuantizedWeight:
    """A matrix as a ``QuantizedWeight``: itself, or a float32 / float16 / bfloat16-bits (uint16)
    NumPy ``[N, K]`` array viewed as GGUF F32 / F16 / BF16 rows (no copy when C-contiguous).

    Raises:
        ValueError: another dtype or not 2-D.
    """
    if isinstance(w, QuantizedWeight):
        return w
    w = np.ascontiguousarray(w)
    qtype = {np.dtype(np.float32): F32, np.dtype(np.float16): F16, np.dtype(np.uint16): BF16}.get(w.dtype)
    if qtype is None or w.ndim != 2:
        raise ValueError(f"cannot serve a {w.dtype} array of shape {w.shape} as a matrix")
    return QuantizedWeight(w.reshape(w.shape[0], -1).view(np.uint8), qtype, w.shape)


def required_weight_names(config: ModelConfig) -> list[str]:
    """The Hugging Face tensor names a Llama checkpoint of ``config`` must provide."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    return names


class LlamaForCausalLM:
    """A Llama causal LM whose weights live on the kernel table's device.

    Args:
        config: the model's ``ModelConfig``.
        weights: a mapping of Hugging Face names to tensors (``model/weights.py``,
            ``model/gguf_weights.py``): float32 NumPy arrays, bfloat16 bits as uint16 (for the
            GPU), ``QuantizedWeight`` matrices in GGUF or 16-bit types (CPU only; the norms stay
            float32), or arrays already on the table's device (e.g. ``--load-format dummy`` on a
            GPU); not modified.
        kernels: a kernel table (``get_kernels("cpu")`` or ``get_kernels("cuda")``).
    Raises:
        ValueError: a tensor is missing or has the wrong shape (the message names it).
    """

    def __init__(self, config: ModelConfig, weights: dict, kernels: KernelTable):
        self.config = config
        self.kernels: KernelTable = kernels
        self.xp = kernels.xp
        missing = [n for n in required_weight_names(config) if n not in weights]
        if missing:
            shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
        c = config
        H, Hkv, D, hid, inter = (c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                 c.hidden_size, c.intermediate_size)
        self._check(weights, "model.embed_tokens.weight", (c.vocab_size, hid))
        prep, xp = kernels.prepare_weight, kernels.xp
        embed = weights["model.embed_tokens.weight"]
        # an untied table in a GGUF type is only looked up (a few rows per step), so it stays as
        # stored (a mapped file's rows paged in on demand); a tied one is lm_head's too: prepared
        # as the products read it (the CPU table's prepare_weight may copy it)
        self.embed_tokens = embed if isinstance(embed, QuantizedWeight) and not c.tie_word_embeddings else prep(embed)
        self.lm_head = self.embed_tokens if c.tie_word_embeddings else prep(
            self._check(weights, "lm_head.weight", (c.vocab_size, hid)))
        self.norm = prep(self._check(weights, "model.norm.weight", (hid,)))
        if any(isinstance(weights[n], QuantizedWeight) for n in _matrix_names(c)):
            self._init_quantized_layers(weights)
            return
        self.layers = []
        # A table that runs all layers in one call (``stacked_layers``: the CPU's ``decoder_layers``)
        # takes each kind of layer weight stacked [num_layers, ...]; the layers are then views of the
        # stacks, allocated by the table (the CPU's on huge pages: kernels/cpu/memory.py).
        self.layer_stacks: dict | None = {} if kernels.stacked_layers else None
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            q = self._check(weights, p + "self_attn.q_proj.weight", (H * D, hid))
            k = self._check(weights, p + "self_attn.k_proj.weight", (Hkv * D, hid))
            v = self._check(weights, p + "self_attn.v_proj.weight", (Hkv * D, hid))
            gate = self._check(weights, p + "mlp.gate_proj.weight", (inter, hid))
            up = self._check(weights, p + "mlp.up_proj.weight", (inter, hid))
            layer = dict(
                input_layernorm=prep(self._check(weights, p + "input_layernorm.weight", (hid,))),
                qkv_proj=xp.concatenate([prep(q), prep(k), prep(v)], axis=0),
                o_proj=prep(self._check(weights, p + "self_attn.o_proj.weight", (hid, H * D))),
                post_attention_layernorm=prep(self._check(weights, p + "post_attention_layernorm.weight", (hid,))),
                gate_up_proj=xp.concatenate([prep(gate), prep(up)], axis=0),
                down_proj=prep(self._check(weights, p + "mlp.down_proj.weight", (hid, inter))),
            )
            if self.layer_stacks is not None:
                for name, w in layer.items():
                    if i == 0:
                        self.layer_stacks[name] = kernels.zeros((c.num_hidden_layers,) + tuple(w.shape), dtype=w.dtype)
                    self.layer_stacks[name][i] = w
                    layer[name] = self.layer_stacks[name][i]
            self.layers.append(_Layer(**layer))
        self._init_rope()

    def _init_rope(self):
        c = self.config
        D = c.head_dim
        # RoPE table built once on the host (float64 math, float32 result) and moved to the device
        inv_freq = reference.rope_inv_freq(D, c.rope_theta, c.rope_scaling)
        self.cos_sin_cache = self.xp.asarray(reference.rope_cos_sin_cache(inv_freq, c.max_position_embeddings))
        self.scale = float(D ** -0.5)
        self.workspace: Workspace | None = None
        self.workspace_generation = 0  # bumped on every reallocation (CUDA graphs hold its addresses)

    def _init_quantized_layers(self, weights):
        # Weights kept in their stored types (GGUF blocks, 16-bit floats): the products of each
        # layer are segments (q, k and v; gate and up) that the table's fused forward writes side
        # by side into one output, instead of concatenated copies; the norms are float32 stacks
        c, kernels = self.config, self.kernels
        if not kernels.stacked_layers:
            raise ValueError(f"weights in GGUF / 16-bit types are served by the CPU kernels only (this is the "
                             f"{kernels.name} table); serve with --device cpu, or load them as float32 "
                             f"(--dtype float32)")
        H, Hkv, D, hid, inter = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size,
                                 c.intermediate_size)
        prep = kernels.prepare_weight
        segments = {name: [] for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
        norms = {"input_layernorm": [], "post_attention_layernorm": []}
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."

            def get(name, shape):
                return as_quantized(self._check(weights, p + name, shape))

            layer = dict(
                input_layernorm=prep(self._check(weights, p + "input_layernorm.weight", (hid,))),
                qkv_proj=(get("self_attn.q_proj.weight", (H * D, hid)), get("self_attn.k_proj.weight", (Hkv * D, hid)),
                          get("self_attn.v_proj.weight", (Hkv * D, hid))),
                o_proj=(get("self_attn.o_proj.weight", (hid, H * D)),),
                post_attention_layernorm=prep(self._check(weights, p + "post_attention_layernorm.weight", (hid,))),
                gate_up_proj=(get("mlp.gate_proj.weight", (inter, hid)), get("mlp.up_proj.weight", (inter, hid))),
                down_proj=(get("mlp.down_proj.weight", (hid, inter)),),
            )
            for name in segments:
                segments[name].append(layer[name])
            for name in norms:
                norms[name].append(layer[name])
            self.layers.append(_Layer(**layer))
        self.layer_stacks = {name: np.ascontiguousarray(np.stack(v), dtype=np.float32) for name, v in norms.items()}
        self.layer_stacks.update({name: kernels.stack_quantized(v) for name, v in segments.items()})
        self._init_rope()

    def weight_bytes(self) -> int:
        """Bytes of the weights as the kernels read them (quantized ones at their stored size)."""
        seen, total = set(), 0
        arrays = [self.embed_tokens, self.lm_head, self.norm]
        for layer in self.layers:
            for w in vars(layer).values():
                arrays += list(w) if isinstance(w, tuple) else [w]
        for w in arrays:
            if id(w) not in seen:
                seen.add(id(w))
                total += int(w.nbytes)
        return total

    def workspace_for(self, num_tokens: int, num_rows: int) -> Workspace:
        """The workspace, reallocated (larger) only when a step needs more than any before."""
        ws = self.workspace
        if ws is None or ws.tokens < num_tokens or ws.rows < num_rows:
            tokens = max(num_tokens, ws.tokens if ws else 0)
            rows = max(num_rows, ws.rows if ws else 0)
            self.workspace = ws = None  # free the old buffers first
            self.workspace = ws = Workspace(self.config, self.kernels, tokens, rows)
            self.workspace_generation += 1
        return ws

    @staticmethod
    def _check(weights, name: str, shape: tuple):
        w = weights[name]
        if tuple(w.shape) != tuple(shape):
            raise ValueError(f"tensor {name} has shape {tuple(w.shape)}, expected {tuple(shape)}")
        return w

    def forward(self, input_ids, positions, attn_metadata: AttentionMetadata, kv_caches: list,
                logits_indices, out=None):
        """Run one step and return the logits of the requested rows.

        Args:
            input_ids: ``[T]`` int64 token ids (xp array), sequences laid end to end.
            positions: ``[T]`` int64 position of each token in its sequence
                (< ``max_position_embeddings``).
            attn_metadata: slot mapping, query_start_loc, seq_lens, block tables of the step.
            kv_caches: one ``(key_cache, value_cache)`` per layer, each ``[num_blocks,
                block_size, num_kv_heads, head_dim]`` of one of ``kernels.kv_cache_dtypes``
                (``--kv-cache-dtype``); this step's K/V are appended in place.
            logits_indices: ``[R]`` int64 rows of the batch whose logits are wanted.
            out: optional ``[R, vocab_size]`` float32 buffer for the logits.
        Returns:
            ``[R, vocab_size]`` float32 xp array (``out`` when given, else a new array).
        """
        k = self.kernels
        c = self.config
        md = attn_metadata
        H, Hkv, D, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        T = int(input_ids.shape[0])
        R = int(logits_indices.shape[0])
        ws = self.workspace_for(T, R).view(T, R)
        residual = k.embedding(input_ids, self.embed_tokens, out=ws["residual"])
        hidden = None
        if self.layer_stacks is not None:
            # the same layers in one compiled call (kernels/cpu/forward.py)
            hidden, residual = k.decoder_layers(self.layer_stacks, ws, positions, md, kv_caches, self.cos_sin_cache,
                                                self.scale, H, Hkv, eps)
            return self._logits(hidden, residual, logits_indices, ws, out)
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
            # attention
            if hidden is None:
                x = k.rms_norm(residual, layer.input_layernorm, eps, out=ws["x"])
            else:
                x, residual = k.fused_add_rms_norm(hidden, residual, layer.input_layernorm, eps,
                                                   out=ws["x"], residual_out=residual)
            qkv = k.linear(x, layer.qkv_proj, out=ws["qkv"])
            q = k.rope_and_cache(positions, qkv, self.cos_sin_cache, key_cache, value_cache, md.slot_mapping,
                                 H, Hkv, out=ws["q"])
            attn = k.paged_attention(q, key_cache, value_cache, md.block_tables, md.seq_lens,
                                     md.query_start_loc, self.scale, max_query_len=md.max_query_len,
                                     max_seq_len=md.max_seq_len, out=ws["attn"])
            hidden = k.linear(attn.reshape(T, H * D), layer.o_proj, out=ws["hidden"])
            # MLP
            x, residual = k.fused_add_rms_norm(hidden, residual, layer.post_attention_layernorm, eps,
                                               out=ws["x"], residual_out=residual)
            act = k.silu_and_mul(k.linear(x, layer.gate_up_proj, out=ws["gate_up"]), out=ws["act"])
            hidden = k.linear(act, layer.down_proj, out=ws["hidden"])
        return self._logits(hidden, residual, logits_indices, ws, out)

    def _logits(self, hidden, residual, logits_indices, ws, out):
        # final norm and lm_head on the sampled rows only (RMSNorm is per row)
        x, _ = self.kernels.fused_add_rms_norm(hidden, residual, self.norm, self.config.rms_norm_eps,
                                               rows=logits_indices, out=ws["final"])
        return self.kernels.linear(x, self.lm_head, out=out)

    __call__ = forward
