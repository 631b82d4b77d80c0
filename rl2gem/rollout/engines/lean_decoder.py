"""A lean forward pass of Llama-family decoders over the embedded engine's KV store.

The embedded engine spends most of a decode step outside the matmuls when it goes through
``model(...)`` (measured on the 2-core CPU with SmolLM2-135M at 64 rows and a 300-column window:
202 ms per step, of which the 211 linear layers are about 100 ms): transformers builds a 4-D
mask every step, runs SDPA's CPU flash kernel (tuned for long queries, not one query per row),
reads every row's keys over the whole shared window, and multiplies the hidden states with the
49k-row LM head in one GEMM that runs at about 100 GFLOP/s where 2,048-row slices run near 180.

:class:`LeanDecoder` runs the same modules (the model's own ``nn.Linear``, norms, MLP and rotary
embedding, so weight updates in place and biases are picked up) with four changes:

* **attention per row chunk**: rows are attended in chunks of ``chunk_rows``, each over only the
  columns its longest row needs (rows sit right-aligned in the shared window, so a chunk of
  short rows skips the window's left part). The additive mask of each chunk is built once per
  step and shared by all layers. Grouped-query attention multiplies the ``group`` queries of a
  key/value head with that head's keys directly (no ``repeat_kv`` copy).
* **one query per row**: scores are a batched ``[group, d] x [d, w]`` matmul, softmax with
  float32 accumulation.
* **LM head in vocabulary slices** of ``vocab_chunk`` rows.
* **fewer kernels per layer**, the same arithmetic: a GPU decode step of a small model is some
  hundreds of tiny kernels whose latencies, not their work, set its time (on the H200 of
  2026-11-27 a captured step of a 1024 x 8 Llama took about 3 ms, of which its kernels ran about
  1.1 ms: ``benchmarks/RESULTS.md``). RMSNorm is torch's fused ``rms_norm`` then the weight (2
  kernels on CUDA, 8 for the module), the rotary embedding a roll and a sign-flipped sin (4, not
  5), the attention's scaling and mask one add and its softmax in the scores' dtype (4, not 6),
  the residual added by the GEMMs of ``o_proj`` and ``down_proj`` (in-place ``addmm_``), the
  q/k/v projections one GEMM and the gate and up projections another (:class:`FusedLinears`).
  With the projections fused, the queries and keys are rotated together, in place in the GEMM's
  output (4 kernels for both, where there were 8; the rotated queries are then a strided view,
  which the attention's batched matmul copies once), and the new keys and values written to the
  store together (the store keeps each layer's keys and values in one buffer): about 21 kernels
  per Llama layer where there were 45 (bf16 on CUDA, counted from the operations). The rotary
  embedding's cos and sin are read from a table built once (:data:`STATIC_ROPE_TYPES`; the
  module computes them with about ten kernels per step).

Packed prefill is also lean: one ``[tokens, hidden]`` matrix without padding goes through the
linear layers; attention runs per group of requests (similar lengths, padded to the group's
longest: one batched call per group and layer instead of one per request, which on a GPU was a
few thousand Python-launched kernels for a 64-row turn), each request over its cached prefix and
its new tokens.

Supported: ``model_type`` in :data:`SUPPORTED_MODEL_TYPES` with full (not sliding-window)
attention; :func:`unsupported_reason` says why another model takes the transformers path.
Equality with ``model(...)`` is tested in ``tests/rollout/test_lean_decoder.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from rl2gem.devices import indexes_to_device
from rl2gem.models import not_full_causal_attention

__all__ = ["SUPPORTED_MODEL_TYPES", "LeanDecoder", "unsupported_reason"]

#: the most attention scores (rows x heads x queries x keys) one eager prefill attention call makes
#: at once: a longer prefill attends in blocks of queries (a 6,000-token prompt made 1.3 GB of
#: float32 scores per layer)
ATTENTION_BLOCK_SCORES = 1 << 26

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# rotary embeddings whose cos and sin at a position depend on that position only (transformers'
# "dynamic" and "longrope" change their frequencies with the longest position seen): read from a
# table of every position (:meth:`LeanDecoder.rotation_table`)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
ROPE_TABLE_ELEMENTS = 1 << 24  # the largest table built (64 MiB in float32); longer contexts compute per step


def unsupported_reason(model, context_length: int) -> str | None:
    """Why :class:`LeanDecoder` cannot run ``model`` (``None`` when it can)."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    other = not_full_causal_attention(config, context_length)
    if other is not None:
        return other
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "not a *ForCausalLM with model.embed_tokens/layers/norm/rotary_emb"
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return "lm_head is not a bias-free nn.Linear"
    for layer in inner.layers:
        attention = getattr(layer, "self_attn", None)
        if attention is None or not all(
            isinstance(getattr(attention, a, None), torch.nn.Linear) for a in ("q_proj", "k_proj", "v_proj", "o_proj")
        ):
            return "attention without q_proj/k_proj/v_proj/o_proj linears"
        if getattr(attention, "sliding_window", None):
            return "sliding-window attention layer"
    return None


# RMSNorm classes whose forward is Llama's: the input normalised in float32, rounded to its dtype,
# then times the weight (:func:`_norm` computes the same with torch's rms_norm)
LLAMA_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def _norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an RMSNorm of :data:`LLAMA_NORMS` as ``weight * rms_norm(x)``: on CUDA two
    kernels (torch's fused ``rms_norm``, in float32 and rounded to ``x``'s dtype once, then the
    weight) where the module's forward launches eight, the same arithmetic (on the CPU ``rms_norm``
    runs the module's own operations). Any other norm is called as it is."""
    if type(module).__name__ in LLAMA_NORMS:
        return module.weight * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=module.variance_epsilon)
    return module(x)


# MLP classes whose forward is Llama's: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
LLAMA_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


def _onto(residual: torch.Tensor, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``residual + linear(x)`` for ``x`` [t, in] and ``residual`` [t, out], written into
    ``residual`` (the caller's residual stream, which nothing else reads): one in-place ``addmm_``,
    a GEMM that reads and writes the residual as its C with beta 1 (one kernel, rounded once; an
    out-of-place ``addmm`` with a 2-D input copies it into the output first), when ``linear`` is a
    plain bias-free ``nn.Linear``; else the module (an adapter, a quantized or biased layer) and an
    add."""
    plain = type(linear) is torch.nn.Linear and linear.bias is None
    if not plain or not residual.dtype == x.dtype == linear.weight.dtype:
        return residual + linear(x)
    return residual.addmm_(x, linear.weight.t())


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) in Llama's ``rotate_half`` layout,
    ``x * cos + rotate_half(x) * sin``, as ``x * cos + roll(x) * signed_sin`` where
    ``signed_sin`` is ``sin`` with its first half negated (:meth:`LeanDecoder._embed`):
    ``rotate_half(x) = cat(-x2, x1)`` and ``roll(x) = cat(x2, x1)``, and ``(-a) * b == a * (-b)``
    exactly, so the result is the same bit for bit in four kernels instead of five."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _rope_(x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`_rope` of the first ``heads`` heads of ``x`` ``[t, all heads, d]`` (one fused GEMM's
    queries, keys and values) written into them, with the same roundings: ``roll(x) * signed_sin``
    is computed first, then ``x * cos`` in place and the sum. The roll is of all of ``x`` (on CUDA
    a roll of a strided view copies it first: one kernel more than rolling the values too)."""
    rolled = x.roll(x.shape[-1] // 2, -1)[:, :heads].mul_(signed_sin)
    return x[:, :heads].mul_(cos).add_(rolled)


class _Held(torch.nn.Module):
    """Tensors of the decoder (a fused weight, the rotary table) held as a module's buffers (not
    saved, moved by nothing): a compiled step (``decode_compile``, dynamic shapes) reads a
    module's tensors with static shapes, where a plain attribute's sizes would be symbols that
    dynamo ties to any equal size (the store's rows and ``head_dim``, say) with a guard that a
    later store breaks, compiling the step again."""

    def __init__(self, **tensors: torch.Tensor | None):
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor, persistent=False)


class FusedLinears:
    """Linear layers that read one input (a layer's q/k/v projections, its gate and up
    projections) made one GEMM: their weights, and biases, become row blocks (views) of one
    buffer, so the model's own forward, weight updates copied in place and the fused GEMM all read
    the same memory and nothing is copied per step. :meth:`intact` says whether that still holds
    (a layer, its attention or MLP, a projection or a parameter replaced, or ``model.to(...)``
    moving each parameter on its own, breaks it; the caller then runs the modules one by one).

    Build with :meth:`make`, which returns None for layers it leaves alone: other than plain
    ``nn.Linear``, on the meta device, of differing dtypes, devices or input sizes, or with biases
    on some only."""

    def __init__(self, layers, index: int, part: str, names: tuple[str, ...], weight, bias):
        self.layers, self.index, self.part, self.names = layers, index, part, names
        self.layer = layers[index]
        self.owner = getattr(self.layer, part)
        self.modules = tuple(getattr(self.owner, name) for name in names)
        self.held = _Held(weight=weight, bias=bias)
        self.sizes = [module.out_features for module in self.modules]
        self._state = self._current_state()

    @classmethod
    @torch.no_grad()
    def make(cls, layers, index: int, part: str, names: tuple[str, ...]) -> FusedLinears | None:
        """Fuse ``layers[index].<part>.<name>`` for ``names`` (``part``: ``self_attn`` or ``mlp``)."""
        owner = getattr(layers[index], part)
        modules = [getattr(owner, name, None) for name in names]
        if any(type(module) is not torch.nn.Linear for module in modules):
            return None
        weights = [module.weight for module in modules]
        biases = [module.bias for module in modules]
        if len({(t.dtype, t.device) for t in weights + [b for b in biases if b is not None]}) != 1:
            return None
        if len({w.shape[1] for w in weights}) != 1 or weights[0].device.type == "meta":
            return None
        if any(b is None for b in biases) != all(b is None for b in biases):
            return None
        weight = torch.cat([w.detach() for w in weights])
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        start = 0
        for module in modules:
            rows = slice(start, start + module.out_features)
            module.weight.data = weight[rows]
            if bias is not None:
                module.bias.data = bias[rows]
            start = rows.stop
        return cls(layers, index, part, names, weight, bias)

    def _current_state(self) -> tuple:
        """Each module still in place under the same layer, and where and what shape its
        parameters are."""
        layer = self.layers[self.index]
        owner = getattr(layer, self.part)
        return (layer is self.layer, owner is self.owner) + tuple(
            (getattr(owner, name) is module, module.weight.data_ptr(), tuple(module.weight.shape))
            + ((module.bias.data_ptr(), tuple(module.bias.shape)) if module.bias is not None else ())
            for name, module in zip(self.names, self.modules, strict=True)
        )

    def intact(self) -> bool:
        """Whether every module is still in place and reads its block of the fused buffers."""
        return self._current_state() == self._state

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [t, in] -> the modules' outputs side by side, ``[t, sum(out)]``, one GEMM."""
        return torch.nn.functional.linear(x, self.held.weight, self.held.bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each module's output for ``x`` [t, in]: views of one ``[t, sum(out)]`` product."""
        return self.product(x).split(self.sizes, dim=-1)


class LeanDecoder:
    """Decode and prefill forwards of a Llama-family model over a ``_KVStore`` (module docstring).

    Args:
        model: a transformers ``LlamaForCausalLM``-shaped model (see :func:`unsupported_reason`).
        chunk_rows: rows per attention chunk in a decode step.
        vocab_chunk: rows of the LM head multiplied at once.
        prefill_scores: most attention scores (elements) of one batched prefill group.
        prefill_padding: how many times its requests' own attention scores a prefill group may
            compute once padded; ``None``: 2 on CUDA (a launch costs more than the padding), 1 on
            the CPU (only requests of equal lengths share a call: padding's large temporaries
            cost more there than the calls they save, measured on the 2-core machine).
        fuse_projections: run each layer's q/k/v projections as one GEMM and its gate and up
            projections as another (:class:`FusedLinears`: 3 kernels fewer per layer). This makes
            those parameters of ``model`` views of one buffer per layer (their values unchanged;
            ``save_pretrained`` and in-place weight updates work as before). A layer whose modules
            or parameters are replaced later runs them one by one (:meth:`check_fused`).
        max_positions: positions the rotary table covers (the engine's context length; ``None``:
            the config's ``max_position_embeddings``). Positions must stay below it: :meth:`prefill`
            raises ``ValueError`` otherwise; a decode step reads the last entry for a larger one
            (no host check per step), which only the padding rows of a captured step reach (their
            staged positions are stale, their outputs dropped).
    """

    def __init__(
        self,
        model,
        *,
        chunk_rows: int = 16,
        vocab_chunk: int = 2048,
        prefill_scores: int = 1 << 26,
        prefill_padding: float | None = None,
        fuse_projections: bool = True,
        max_positions: int | None = None,
    ):
        self.model = model
        config = model.config
        self.num_heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.group = self.num_heads // self.kv_heads
        self.chunk_rows = int(chunk_rows)
        self.vocab_chunk = int(vocab_chunk)
        self.prefill_scores = int(prefill_scores)
        if prefill_padding is None:
            prefill_padding = 2.0 if next(model.parameters()).device.type == "cuda" else 1.0
        self.prefill_padding = float(prefill_padding)
        self.max_positions = int(max_positions or getattr(config, "max_position_embeddings", None) or 4096)
        # [positions, 2, d]: cos, signed sin (:meth:`rotation_table`)
        self._rotations = _Held(table=None)
        layers = model.model.layers
        self._qkv: list[FusedLinears | None] = [None] * len(layers)  # per layer, None: the modules
        self._gate_up: list[FusedLinears | None] = [None] * len(layers)
        if fuse_projections:
            for index, layer in enumerate(layers):
                self._qkv[index] = FusedLinears.make(layers, index, "self_attn", ("q_proj", "k_proj", "v_proj"))
                if type(layer.mlp).__name__ in LLAMA_MLPS:
                    self._gate_up[index] = FusedLinears.make(layers, index, "mlp", ("gate_proj", "up_proj"))

    def check_fused(self) -> None:
        """Stop fusing the projections of layers whose modules or parameters were replaced since
        (:meth:`FusedLinears.intact`): they run one by one from then on. Called at each eager
        forward; a captured or compiled step reads the fused buffers as they were when it was
        built, so :class:`~rl2gem.rollout.engines.cuda_graphs.DecodeGraphs` calls it before it
        builds one (a replaced parameter changes its key)."""
        for table in (self._qkv, self._gate_up):
            for index, fused in enumerate(table):
                if fused is not None and not fused.intact():
                    table[index] = None

    # ------------------------------------------------------------------ shared pieces
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [n, H] (after the final norm) -> logits [n, V] float32, the head in slices."""
        weight = self.model.lm_head.weight
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, weight.shape[0], self.vocab_chunk):
            piece = weight[start : start + self.vocab_chunk]
            out[:, start : start + piece.shape[0]] = torch.nn.functional.linear(hidden, piece)
        return out

    def _project(self, index: int, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        """``x`` [t, H] of layer ``index`` -> rotated queries [t, heads, d], rotated keys and values
        [t, kv_heads, d], and the keys and values side by side, ``[t, 2, kv_heads, d]`` (one write
        to the store's pair buffer), or None when they are not adjacent. With fused projections
        (and no per-head norm) these are strided views of the GEMM's output, the queries and keys
        rotated in place together."""
        t, attention, fused = x.shape[0], self.model.model.layers[index].self_attn, self._qkv[index]
        qk_norm = getattr(attention, "q_norm", None) is not None  # Qwen3: RMSNorm over each head
        if fused is not None and not qk_norm:
            heads, kv_heads = self.num_heads, self.kv_heads
            out = fused.product(x).view(t, heads + 2 * kv_heads, self.head_dim)
            _rope_(out, heads + kv_heads, cos, signed_sin)
            pair = out[:, heads:].view(t, 2, kv_heads, self.head_dim)
            return out[:, :heads], pair[:, 0], pair[:, 1], pair
        if fused is not None:
            query, key, value = fused(x)
        else:
            query, key, value = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        query = query.view(t, self.num_heads, self.head_dim)
        key = key.view(t, self.kv_heads, self.head_dim)
        value = value.view(t, self.kv_heads, self.head_dim)
        if qk_norm:
            query, key = _norm(attention.q_norm, query), _norm(attention.k_norm, key)
        return _rope(query, cos, signed_sin), _rope(key, cos, signed_sin), value, None

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor):
        """``tokens``, ``positions`` [t] int64 -> (hidden [t, H], cos and the signed sin [t, 1, d]
        of :func:`_rope`) for :meth:`_project`, built once per forward for every layer."""
        hidden = self.model.model.embed_tokens(tokens)
        table = self.rotation_table(hidden.dtype, hidden.device)
        if table is None:
            cos, signed_sin = self._rotate(hidden, positions[None])  # [1, t, d]
            return hidden, cos[0, :, None], signed_sin[0, :, None]
        rows = table[positions.clamp(max=table.shape[0] - 1)]  # [t, 2, d]
        return hidden, rows[:, 0, None], rows[:, 1, None]

    def _rotate(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary embedding at ``positions`` [1, t] -> cos and the signed sin of
        :func:`_rope` [1, t, d] in ``hidden``'s dtype."""
        cos, sin = self.model.model.rotary_emb(hidden, positions)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), -1)

    def rotation_table(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The table ``[max_positions, 2, d]`` of cos and signed sin at every position in
        ``dtype`` on ``device`` (built on first use and again when they change: a compiled or
        captured step must find it built, :class:`~rl2gem.rollout.engines.cuda_graphs.DecodeGraphs`
        builds it first), or None when the rotary embedding is not of :data:`STATIC_ROPE_TYPES` or
        the table would exceed :data:`ROPE_TABLE_ELEMENTS`. Built by the module itself, whose
        values at a position do not depend on the other positions: read from it, they are the
        module's bit for bit."""
        table = self._rotations.table
        if table is not None and table.dtype == dtype and table.device == device:
            return table
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as a tensor's device reads
        if table is not None and table.dtype == dtype and table.device == device:
            return table
        rope_type = getattr(self.model.model.rotary_emb, "rope_type", None)
        if rope_type not in STATIC_ROPE_TYPES or self.max_positions * 2 * self.head_dim > ROPE_TABLE_ELEMENTS:
            return None
        positions = torch.arange(self.max_positions, device=device)[None]
        cos, signed_sin = self._rotate(torch.empty(0, dtype=dtype, device=device), positions)
        self._rotations.table = torch.stack((cos[0], signed_sin[0]), dim=1)
        return self._rotations.table

    def _residual(self, index: int, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of decoder layer ``index`` after attention: ``attended`` [t, heads * d] through
        ``o_proj`` onto the residual stream ``hidden`` [t, H], then the MLP block, each onto the
        stream in the projection's own kernel (:func:`_onto`) when the MLP is Llama's (its gate and
        up projections one GEMM when fused)."""
        layer = self.model.model.layers[index]
        hidden = _onto(hidden, layer.self_attn.o_proj, attended)
        mlp, x = layer.mlp, _norm(layer.post_attention_layernorm, hidden)
        if type(mlp).__name__ not in LLAMA_MLPS:
            return hidden + mlp(x)
        fused = self._gate_up[index]
        gate, up = fused(x) if fused is not None else (mlp.gate_proj(x), mlp.up_proj(x))
        return _onto(hidden, mlp.down_proj, mlp.act_fn(gate) * up)

    def _attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scaling):
        """Grouped-query attention of ``q`` queries per row.

        ``query`` [m, q, heads, d]; ``keys``/``values`` [m, kv_heads, w, d]; ``bias`` [m, q, w]
        (0 or -inf, in the queries' dtype: :meth:`_bias`) -> [m, q, heads * d]. The scaling and
        the mask are one kernel (``bias + scaling * scores``, rounded once) and the softmax runs
        in the scores' dtype (float32 inside torch's kernel, rounded once on output).
        """
        m, q = query.shape[0], query.shape[1]
        grouped = query.view(m, q, self.kv_heads, self.group, self.head_dim).permute(0, 2, 3, 1, 4)
        grouped = grouped.reshape(m, self.kv_heads, self.group * q, self.head_dim)
        scores = torch.matmul(grouped, keys.transpose(-1, -2))  # [m, kv, group*q, w]
        scores = torch.add(bias[:, None, None], scores.view(m, self.kv_heads, self.group, q, -1), alpha=scaling)
        probs = torch.softmax(scores, dim=-1).to(values.dtype)  # .to: no kernel when the dtypes agree
        out = torch.matmul(probs.view(m, self.kv_heads, self.group * q, -1), values)  # [m, kv, group*q, d]
        out = out.view(m, self.kv_heads, self.group, q, self.head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(m, q, self.num_heads * self.head_dim)

    def _attend_prefill(self, query, keys, values, bias, scaling, fused: bool | None = None) -> torch.Tensor:
        """:meth:`_attend` of a prefill group (same arguments and result). ``fused`` (default: on
        the CPU) runs torch's ``scaled_dot_product_attention`` with ``bias`` as its mask: no
        ``[q, w]`` scores in memory, 2.8x the eager path's speed at 2,000 tokens on one CPU thread
        (the results agree to float rounding, 5e-7 in float32). Otherwise (CUDA, where the eager
        path is what the GPU runs measured) the eager path, in blocks of queries of at most
        :data:`ATTENTION_BLOCK_SCORES` scores."""
        m, q = query.shape[0], query.shape[1]
        if fused if fused is not None else query.device.type == "cpu":
            out = torch.nn.functional.scaled_dot_product_attention(
                query.transpose(1, 2), keys, values, attn_mask=bias[:, None], scale=scaling, enable_gqa=True
            )
            return out.transpose(1, 2).reshape(m, q, self.num_heads * self.head_dim)
        block = max(1, ATTENTION_BLOCK_SCORES // (m * self.num_heads * keys.shape[-2]))
        if q <= block:
            return self._attend(query, keys, values, bias, scaling)
        parts = [
            self._attend(query[:, a : a + block], keys, values, bias[:, a : a + block], scaling)
            for a in range(0, q, block)
        ]
        return torch.cat(parts, dim=1)

    @staticmethod
    def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The additive attention mask of ``allowed`` (bool): 0 where a query reads a column, -inf
        elsewhere, in ``dtype`` (the queries': 0 and -inf are exact in any float dtype)."""
        return torch.full(allowed.shape, float("-inf"), dtype=dtype, device=allowed.device).masked_fill_(allowed, 0)

    # ------------------------------------------------------------------ decode
    def plan_chunks(self, spans: list[int]) -> list[tuple[int, int, int]]:
        """``spans[i]``: columns row ``i`` reads (its cached tokens plus the new one, holes
        included) -> ``[(first_row, end_row, columns)]``, one chunk for all rows unless chunking
        reads at least a quarter fewer columns."""
        n = len(spans)
        whole = [(0, n, max(spans))]
        chunks = [
            (a, min(a + self.chunk_rows, n), max(spans[a : a + self.chunk_rows])) for a in range(0, n, self.chunk_rows)
        ]
        if sum((b - a) * w for a, b, w in chunks) > 0.75 * n * whole[0][2]:
            return whole
        return chunks

    @torch.no_grad()
    def decode(self, store, tokens: torch.Tensor, positions: torch.Tensor, spans: list[int]) -> torch.Tensor:
        """One decode step of ``n = store.slots`` rows.

        Args:
            store: the engine's KV store; the new keys and values go to column ``store.hi``, whose
                mask entry the caller has set; row ``i`` reads columns ``[store.hi + 1 - spans[i],
                store.hi + 1)``.
            tokens: [n] int64, the last sampled token of each row.
            positions: [n] int64, its position id, below ``max_positions``.
            spans: columns each row reads, the new one included.

        Returns:
            logits [n, V] float32 of the next token.
        """
        n, column = store.slots, store.hi
        inner = self.model.model
        self.check_fused()
        hidden, cos, signed_sin = self._embed(tokens, positions)  # [n, H], [n, 1, d]
        chunks = []
        for a, b, width in self.plan_chunks(spans):
            start = column + 1 - width
            chunks.append((a, b, start, self._bias(store.mask[a:b, None, start : column + 1], hidden.dtype)))
        for index, layer in enumerate(inner.layers):
            attention = layer.self_attn
            query, key, value, pair = self._project(index, _norm(layer.input_layernorm, hidden), cos, signed_sin)
            if pair is not None:
                store.pairs[index][:, :n, :, column] = pair.transpose(0, 1)
            else:
                store.keys[index][:n, :, column] = key
                store.values[index][:n, :, column] = value
            parts = [
                self._attend(
                    query[a:b, None],
                    store.keys[index][a:b, :, start : column + 1],
                    store.values[index][a:b, :, start : column + 1],
                    bias,
                    attention.scaling,
                )
                for a, b, start, bias in chunks
            ]
            attended = parts[0] if len(parts) == 1 else torch.cat(parts)
            hidden = self._residual(index, hidden, attended.view(n, -1))
        return self._logits(_norm(inner.norm, hidden))

    @torch.no_grad()
    def decode_all_columns(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        mask: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        column: torch.Tensor,
        pairs: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One decode step of ``b`` rows over every column of the buffers, with no host data and
        no shape that changes from step to step: the step a CUDA graph captures
        (:class:`~rl2gem.rollout.engines.cuda_graphs.DecodeGraphs`).

        Args:
            keys, values: per layer ``[b, kv_heads, C, head_dim]`` (the store's first ``b`` rows).
            mask: ``[b, C]`` bool, the columns each row reads, the new column included (a row
                with none would give NaN: the caller marks the new column of every row).
            tokens: ``[b]`` int64, the last sampled token of each row.
            positions: ``[b]`` int64, its position id.
            column: ``[1]`` int64, the column the new keys and values go to.
            pairs: per layer the ``[2, b, kv_heads, C, head_dim]`` buffer whose halves are
                ``keys`` and ``values`` (the store's ``pairs``), or None: with it a fused layer
                writes its keys and values with one ``index_copy_`` instead of two. A compiled
                step is given none: Inductor fuses both writes into the rotation's kernel, and
                a view of fewer rows than the store holds is strided where one of all rows is
                not, which would be a second compiled variant.

        Returns:
            logits ``[b, V]`` float32, all on the buffers' device. Equal to :meth:`decode` on the
            rows whose masked-in columns lie in its window (masked columns weigh exactly 0).
        """
        rows = tokens.shape[0]
        inner = self.model.model
        hidden, cos, signed_sin = self._embed(tokens, positions)  # [b, H], [b, 1, d]
        bias = self._bias(mask, hidden.dtype)[:, None]  # [b, 1, C]
        for index, layer in enumerate(inner.layers):
            attention = layer.self_attn
            query, key, value, pair = self._project(index, _norm(layer.input_layernorm, hidden), cos, signed_sin)
            if pair is not None and pairs is not None:  # [2, b, kv_heads, 1, d]: one write
                pairs[index].index_copy_(3, column, pair.transpose(0, 1)[:, :, :, None])
            else:
                keys[index].index_copy_(2, column, key[:, :, None])
                values[index].index_copy_(2, column, value[:, :, None])
            attended = self._attend(query[:, None], keys[index], values[index], bias, attention.scaling)
            hidden = self._residual(index, hidden, attended.view(rows, -1))
        return self._logits(_norm(inner.norm, hidden))

    # ------------------------------------------------------------------ prefill
    def plan_prefill_groups(self, queries: list[int], widths: list[int]) -> list[list[int]]:
        """Requests attended together in a prefill: ``queries[i]`` new tokens of request ``i``
        reading ``widths[i]`` columns (its cached prefix and its new tokens) -> groups of request
        indices. A group is padded to its most queries and widest columns, so requests join one
        (longest first) only while the padded scores stay within ``prefill_padding`` times the
        group's own and within ``prefill_scores`` elements (2**26: 256 MB in float32)."""
        order = sorted(range(len(queries)), key=lambda i: (-queries[i], -widths[i]))
        groups: list[list[int]] = []
        for index in order:
            if groups:
                group = groups[-1] + [index]
                most_queries = max(queries[i] for i in group)
                widest = max(widths[i] for i in group)
                padded = len(group) * most_queries * widest
                own = sum(queries[i] * widths[i] for i in group)
                if padded <= self.prefill_padding * own and padded * self.num_heads <= self.prefill_scores:
                    groups[-1] = group
                    continue
            groups.append([index])
        return groups

    @torch.no_grad()
    def prefill(
        self, store, rows: list[tuple[int, list[int], int]], end: int, firsts: list[int] | None = None
    ) -> torch.Tensor:
        """Extend rows of ``store`` with new tokens in one packed forward (no padding through the
        linear layers); attention per group of requests (:meth:`plan_prefill_groups`), each a
        batched call over the group's queries padded to its longest.

        Args:
            store: a KV store; row ``r`` of a request with ``q`` new tokens gets them at columns
                ``[end - q, end)``, and its cached prefix, if any, is the masked-in columns
                before ``end - q`` (the caller sets their mask; the new columns' mask too).
            rows: ``(row, new token ids, position id of the first)`` per request.
            end: the column after every row's last token.
            firsts: each request's first masked-in column, where the caller knows it; None: read
                from the store's mask (a wait for the device). With it the forward is queued
                without any host read or wait (its indexes copied from pinned memory), so it can
                be queued behind a decode round still running.

        Returns:
            logits [len(rows), V] float32 after each row's last new token.

        Raises:
            ValueError: a position at or past ``max_positions`` when the rotary table is used.
        """
        inner = self.model.model
        self.check_fused()
        device = store.mask.device
        queries = [len(ids) for _, ids, _ in rows]
        offsets = np.cumsum([0, *queries]).tolist()
        last = max(p + len(ids) for _, ids, p in rows) - 1
        if last >= self.max_positions and self.rotation_table(inner.embed_tokens.weight.dtype, device) is not None:
            raise ValueError(f"position {last} is past the rotary table's {self.max_positions} (max_positions)")
        if firsts is None:  # each request's first column: its cached prefix's first, else its first new one
            masked = store.mask[torch.tensor([row for row, _, _ in rows], device=device), :end]
            firsts = torch.where(masked.any(-1), masked.float().argmax(-1), end).tolist()
        firsts = [min(first, end - q) for first, q in zip(firsts, queries, strict=True)]
        # the tokens, their positions, their (row, column) in the store (the new keys and values
        # of every token go there in one write per layer) and each request's last token: one copy
        arrays = [
            np.fromiter((t for _, ids, _ in rows for t in ids), dtype=np.int64, count=offsets[-1]),
            np.concatenate([np.arange(p, p + len(ids)) for _, ids, p in rows]),
            np.repeat([row for row, _, _ in rows], queries),
            np.concatenate([np.arange(end - q, end) for q in queries]),
            np.asarray(offsets[1:]) - 1,
        ]
        tokens, positions, token_rows, token_columns, last = indexes_to_device(arrays, device)
        groups = [
            self._prefill_group(store, [rows[i][0] for i in group], [queries[i] for i in group],
                                [offsets[i] for i in group], min(firsts[i] for i in group), end,
                                inner.embed_tokens.weight.dtype)
            for group in self.plan_prefill_groups(queries, [end - first for first in firsts])
        ]  # fmt: skip
        hidden, cos, signed_sin = self._embed(tokens, positions)  # [T, H], [T, 1, d]
        for index, layer in enumerate(inner.layers):
            attention = layer.self_attn
            query, key, value, pair = self._project(index, _norm(layer.input_layernorm, hidden), cos, signed_sin)
            keys, values = store.keys[index], store.values[index]
            if pair is not None:  # two index tensors apart: the indexed dimensions first, [T, 2, kv_heads, d]
                store.pairs[index][:, token_rows, :, token_columns] = pair
            else:
                keys[token_rows, :, token_columns] = key
                values[token_rows, :, token_columns] = value
            attended = torch.empty(hidden.shape[0], self.num_heads * self.head_dim, dtype=query.dtype, device=device)
            for group_rows, gather, scatter, first, bias in groups:
                out = self._attend_prefill(
                    query[gather],  # [g, q, heads, d]: padding slots read token 0, their output is dropped
                    keys[group_rows, :, first:end],  # a view when the group's rows are consecutive
                    values[group_rows, :, first:end],
                    bias,
                    attention.scaling,
                )
                attended[scatter[1]] = out.flatten(0, 1)[scatter[0]]
            hidden = self._residual(index, hidden, attended)
        return self._logits(_norm(inner.norm, hidden[last]))

    @staticmethod
    def _prefill_group(
        store, group_rows: list[int], queries: list[int], offsets: list[int], first: int, end: int, dtype: torch.dtype
    ):
        """One group's index tensors and additive mask, built once for all layers, with no host
        read (the indexes built on the host, copied once from pinned memory): its store rows (a
        slice when consecutive: the engine orders its prefill rows as groups are planned), where
        each padded query slot reads its token (``[g, most]``), which slots hold real tokens and
        where they go in the packed output, and ``bias`` ``[g, most, end - first]`` in ``dtype``.
        Queries are right-aligned at ``end``: slot ``j`` is column ``end - most + j``."""
        device = store.mask.device
        most = max(queries)
        slots = np.arange(most)
        real = slots[None] >= most - np.asarray(queries)[:, None]  # [g, most]
        gather = np.where(real, np.asarray(offsets)[:, None] + slots[None] - most + np.asarray(queries)[:, None], 0)
        flat = np.flatnonzero(real)  # the real slots, in packed order
        consecutive = group_rows == list(range(group_rows[0], group_rows[0] + len(group_rows)))
        arrays = [gather.ravel(), real.ravel(), flat, gather.ravel()[flat], [] if consecutive else group_rows]
        gather, real, flat, sources, listed = indexes_to_device(arrays, device)
        gather, real = gather.view(len(queries), most), real.view(len(queries), most).bool()
        rows = slice(group_rows[0], group_rows[-1] + 1) if consecutive else listed
        columns = torch.arange(first, end, device=device)
        causal = columns[None] <= torch.arange(end - most, end, device=device)[:, None]  # [most, width]
        allowed = store.mask[rows, first:end][:, None] & causal[None]  # [g, most, width]
        allowed |= ~real[..., None]  # a padding slot reads every column: finite, dropped
        bias = LeanDecoder._bias(allowed, dtype)
        return rows, gather, (flat, sources), first, bias
