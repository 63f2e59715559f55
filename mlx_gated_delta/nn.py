"""Drop-in Gated DeltaNet layers for mlx-lm's Qwen3-Next and Qwen3.5 models.

Both layers keep mlx-lm's parameter names, shapes and row orders, so mlx-lm
checkpoints (and `model.load_weights`, `nn.quantize`, mlx-lm's `shard`) see the
same module tree as mlx-lm's own layer. The forward pass is one projection
into the packed `[q | k | v | z | b | a]` layout, one `gated_delta_segment`
(conv, gates, norms and the recurrence), and the output projection.

The packed projection is derived from the mlx-lm parameters: their rows are
permuted and concatenated once into a single weight (dense or quantized alike),
and that weight is reused by every call until one of the source parameters is
replaced (loading, quantizing, sharding or an optimizer step replace the
arrays; the layer compares them by identity, which costs nothing per call).
This is simpler than renaming parameters and translating checkpoints, and it
keeps every mlx-lm tool working; the price is a second copy of the input
projections' weights (about 1% of a Qwen3-Next model).

On the CPU the dense projections (the packed input projection and
`out_proj`) run through our blocked kernel instead of MLX's CPU matmul, which
is 10-100x slower on the machines measured; quantized projections use MLX's
`quantized_matmul`. On a Mac's GPU the segment runs our Metal kernels. There
is no gradient through the segment yet: these layers are for inference
(mlx-lm's own layers train).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import _ext
from .segment import gated_delta_segment


class GatedRMSNormWeight(nn.Module):
    """The weight of the gated RMSNorm (mlx-lm's `norm`); the math is in the
    segment: `rms_norm(y, eps) * weight * silu(z)`."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(dims)


class _PackedProjection:
    """One matmul producing the segment's packed input from several projections.

    `sources` are `(module, rows)` pairs in packed order: the output rows of
    each module (`None` for all, in order) that go next into the packed layout.
    """

    def __init__(self, sources: Sequence[Tuple[nn.Module, Optional[np.ndarray]]]):
        modules = [m for m, _ in sources]
        # Holding the source arrays keeps their ids from being reused.
        self._source_arrays = _source_arrays(modules)
        self.key = _source_key(modules)
        quantized = all(isinstance(m, nn.QuantizedLinear) for m in modules) and (
            len({(m.group_size, m.bits, m.mode) for m in modules}) == 1
        )
        self.quantization = None
        if quantized:
            first = modules[0]
            self.quantization = dict(
                group_size=first.group_size, bits=first.bits, mode=first.mode
            )
            names = ["weight", "scales"] + (
                ["biases"] if first.get("biases") is not None else []
            )
            self.arrays = {
                name: _take_rows([(m[name], rows) for m, rows in sources])
                for name in names
            }
        else:
            # Plain layers, or a mix of kinds: one dense weight.
            self.arrays = {
                "weight": _take_rows([(_dense_weight(m), rows) for m, rows in sources])
            }
        if any("bias" in m for m in modules):
            self.arrays["bias"] = _take_rows(
                [
                    (m["bias"] if "bias" in m else mx.zeros(_out_rows(m)), rows)
                    for m, rows in sources
                ]
            )

    def __call__(self, x: mx.array) -> mx.array:
        a = self.arrays
        if self.quantization is not None:
            y = mx.quantized_matmul(
                x,
                a["weight"],
                scales=a["scales"],
                biases=a.get("biases"),
                transpose=True,
                **self.quantization,
            )
        else:
            y = dense_projection(x, a["weight"])
        if "bias" in a:
            y = y + a["bias"]
        return y


def dense_projection(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T` (nn.Linear's product, weight `[out, in]`): on the CPU
    through our blocked kernel (MLX's CPU matmul is 10-100x slower on the
    machines measured), elsewhere MLX's matmul."""
    if mx.default_device() == mx.cpu and x.dtype == weight.dtype and x.dtype in (
        mx.float32,
        mx.float16,
        mx.bfloat16,
    ):
        return _ext.linear_projection(x, weight, None)
    return x @ weight.T


def _source_arrays(modules) -> List[mx.array]:
    return [v for m in modules for _, v in sorted(m.items()) if isinstance(v, mx.array)]


def _source_key(modules) -> Tuple[int, ...]:
    """Identifies the parameter arrays a packed projection was built from."""
    return tuple(id(a) for a in _source_arrays(modules))


def _out_rows(module: nn.Module) -> int:
    return module["weight"].shape[0]


def _dense_weight(module: nn.Module) -> mx.array:
    if isinstance(module, nn.QuantizedLinear):
        return mx.dequantize(
            module["weight"],
            module["scales"],
            module.get("biases"),
            group_size=module.group_size,
            bits=module.bits,
            mode=module.mode,
        )
    return module["weight"]


def _take_rows(parts) -> mx.array:
    taken = [a if rows is None else mx.take(a, mx.array(rows), axis=0) for a, rows in parts]
    return mx.contiguous(mx.concatenate(taken, axis=0))


class _GatedDeltaNetBase(nn.Module):
    """What both layers share: head layout, conv, gates, norm, cache handling."""

    def __init__(self, config: Any):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        if self.num_v_heads % self.num_k_heads != 0:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple "
                f"of linear_num_key_heads ({self.num_k_heads})"
            )
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.layer_norm_epsilon = config.rms_norm_eps
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(
            in_channels=self.conv_dim,
            out_channels=self.conv_dim,
            bias=False,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            padding=0,
        )
        self.dt_bias = mx.ones(self.num_v_heads)
        self.A_log = mx.log(mx.random.uniform(low=0, high=16, shape=(self.num_v_heads,)))
        self.norm = GatedRMSNormWeight(self.head_v_dim, eps=self.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)
        # Not a parameter: a derived weight (see the module docstring).
        object.__setattr__(self, "_packed", None)

    def _projection_modules(self) -> List[nn.Module]:
        """The projections whose outputs make the packed layout, in order."""
        raise NotImplementedError

    def _projection_rows(self) -> List[Optional[np.ndarray]]:
        """Per projection, its output rows in packed order (None: as they are)."""
        raise NotImplementedError

    def packed_projection(self) -> _PackedProjection:
        """The one projection into the segment's packed layout, derived from
        the current parameters and rebuilt only when one was replaced."""
        modules = self._projection_modules()
        if self._packed is None or self._packed.key != _source_key(modules):
            sources = list(zip(modules, self._projection_rows()))
            object.__setattr__(self, "_packed", _PackedProjection(sources))
        return self._packed

    def __call__(
        self,
        inputs: mx.array,
        mask: Optional[mx.array] = None,
        cache: Optional[Any] = None,
    ) -> mx.array:
        B, S, _ = inputs.shape
        sharding_group = getattr(self, "sharding_group", None)
        if sharding_group is not None:
            inputs = nn.layers.distributed.sum_gradients(sharding_group)(inputs)

        mixed = self.packed_projection()(inputs)
        conv_state = state = None
        if cache is not None:
            conv_state, state = cache[0], cache[1]
            # A cache filled by another implementation may hold other dtypes.
            if conv_state is not None and conv_state.dtype != mixed.dtype:
                conv_state = conv_state.astype(mixed.dtype)
            if state is not None and state.dtype != mx.float32:
                state = state.astype(mx.float32)

        # A trimmable cache (mlx_gated_delta.cache) keeps the states after the
        # call's last tokens: the segment returns them as checkpoints.
        checkpoints = None
        if cache is not None and hasattr(cache, "checkpoints_for"):
            checkpoints = cache.checkpoints_for(S)

        # mlx-lm's mask (left padding, lengths) marks the tokens that are not
        # in a row's sequence; the segment skips them, so each row's conv and
        # recurrent states are those of its own tokens only.
        out, conv_state, state, *kept = gated_delta_segment(
            mixed,
            self.conv1d.weight,
            self.A_log,
            self.dt_bias,
            self.norm.weight,
            conv_state,
            state,
            key_heads=self.num_k_heads,
            value_heads=self.num_v_heads,
            key_dim=self.head_k_dim,
            value_dim=self.head_v_dim,
            norm_eps=self.norm.eps,
            mask=mask,
            checkpoints=checkpoints,
        )
        if cache is not None:
            if hasattr(cache, "checkpoints_for"):
                cache.update(conv_state, state, S, *kept)
            else:
                cache[0] = conv_state
                cache[1] = state
            cache.advance(S)

        out = out.reshape(B, S, -1)
        if type(self.out_proj) is nn.Linear and "bias" not in self.out_proj:
            out = dense_projection(out, self.out_proj.weight)
        else:  # quantized (or otherwise replaced) output projection
            out = self.out_proj(out)
        if sharding_group is not None:
            out = mx.distributed.all_sum(out, group=sharding_group)
        return out


class GatedDeltaNet(_GatedDeltaNetBase):
    """mlx-lm's `Qwen3NextGatedDeltaNet`, with the same parameters
    (`in_proj_qkvz`, `in_proj_ba`, `conv1d`, `dt_bias`, `A_log`, `norm`,
    `out_proj`) and cache (`ArraysCache`: `[conv_state, state]`).

    `in_proj_qkvz` and `in_proj_ba` are packed per key-head group, as in the
    checkpoints: `[q | k | v_group | z_group]` and `[b_group | a_group]` for
    each key head; the packed projection reorders their rows once.
    """

    def __init__(self, config: Any):
        super().__init__(config)
        self.in_proj_qkvz = nn.Linear(
            self.hidden_size, self.key_dim * 2 + self.value_dim * 2, bias=False
        )
        self.in_proj_ba = nn.Linear(self.hidden_size, self.num_v_heads * 2, bias=False)

    def _projection_modules(self):
        return [self.in_proj_qkvz, self.in_proj_ba]

    def _projection_rows(self):
        nk, dk = self.num_k_heads, self.head_k_dim
        group_v = self.num_v_heads // nk * self.head_v_dim  # v (or z) per group
        group_heads = self.num_v_heads // nk  # b (or a) per group
        qkvz_group = 2 * dk + 2 * group_v
        groups = np.arange(nk)[:, None]

        def rows(group_size, start, length):
            return (groups * group_size + start + np.arange(length)).reshape(-1)

        qkvz_rows = np.concatenate(
            [
                rows(qkvz_group, 0, dk),  # q
                rows(qkvz_group, dk, dk),  # k
                rows(qkvz_group, 2 * dk, group_v),  # v
                rows(qkvz_group, 2 * dk + group_v, group_v),  # z
            ]
        )
        ba_rows = np.concatenate(
            [
                rows(2 * group_heads, 0, group_heads),  # b
                rows(2 * group_heads, group_heads, group_heads),  # a
            ]
        )
        return [qkvz_rows, ba_rows]


class Qwen35GatedDeltaNet(_GatedDeltaNetBase):
    """mlx-lm's `qwen3_5.GatedDeltaNet`, with the same parameters
    (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `conv1d`,
    `dt_bias`, `A_log`, `norm`, `out_proj`), cache and `sharding_group`
    (mlx-lm's `shard` splits heads across ranks and works on this layer).
    The projections are already in packed order: they are concatenated once.
    """

    def __init__(self, config: Any):
        super().__init__(config)
        self.in_proj_qkv = nn.Linear(
            self.hidden_size, self.key_dim * 2 + self.value_dim, bias=False
        )
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.sharding_group = None

    def _projection_modules(self):
        return [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]

    def _projection_rows(self):
        return [None, None, None, None]
