"""The shapes the benchmarks run: each model's heads written once, the op's rows
built from them, and what one call of a row must compute and move."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import mlx.core as mx

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
SHORT_DTYPE = {"float32": "f32", "bfloat16": "bf16"}
STATE_BYTES_PER_ELEMENT = 4  # the recurrent state is always float32


@dataclasses.dataclass(frozen=True)
class Heads:
    """A linear-attention layer's heads: key and value heads, and their sizes."""

    Hk: int
    Hv: int
    Dk: int
    Dv: int

    def text(self, separator: str = " ") -> str:
        """``Hk=16 Hv=32 Dk=Dv=128``, the sizes as the reports write them."""
        sizes = f"Dk=Dv={self.Dk}" if self.Dk == self.Dv else f"Dk={self.Dk}{separator}Dv={self.Dv}"
        return separator.join([f"Hk={self.Hk}", f"Hv={self.Hv}", sizes])


QWEN3_NEXT = Heads(Hk=16, Hv=32, Dk=128, Dv=128)
KIMI_LINEAR = Heads(Hk=32, Hv=32, Dk=128, Dv=128)

# Qwen3-Next's whole Gated DeltaNet layer, in the names of mlx-lm's model arguments.
QWEN3_NEXT_LAYER = SimpleNamespace(
    hidden_size=2048,
    linear_num_key_heads=QWEN3_NEXT.Hk,
    linear_num_value_heads=QWEN3_NEXT.Hv,
    linear_key_head_dim=QWEN3_NEXT.Dk,
    linear_value_head_dim=QWEN3_NEXT.Dv,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
)

# The layers with separate q, k and v projections and convolutions, at
# Kimi-Linear's heads and hidden size: Kimi-Linear's
# (per-key-channel gates) and OLMo-Hybrid's (the same layout with scalar
# gates), in the names of mlx-lm's model arguments.
KIMI_LINEAR_LAYER = SimpleNamespace(
    hidden_size=2048,
    linear_attn_config=dict(
        num_heads=KIMI_LINEAR.Hv, head_dim=KIMI_LINEAR.Dk, short_conv_kernel_size=4
    ),
    rms_norm_eps=1e-6,
)
OLMO_HYBRID_LAYER = SimpleNamespace(
    hidden_size=2048,
    linear_num_key_heads=KIMI_LINEAR.Hk,
    linear_num_value_heads=KIMI_LINEAR.Hv,
    linear_key_head_dim=KIMI_LINEAR.Dk,
    linear_value_head_dim=KIMI_LINEAR.Dv,
    linear_conv_kernel_dim=4,
    linear_allow_neg_eigval=True,
    layer_norm_epsilon=1e-6,
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark row: the problem size and the activation dtype."""

    family: str  # "qwen3-next", or what a generic shape changes from it ("Dk=96")
    B: int
    T: int
    Hk: int
    Hv: int
    Dk: int
    Dv: int
    dtype: str  # a key of DTYPES; the state is float32 whatever this is
    per_key: bool = False  # a decay per key channel (Kimi Delta Attention), g [B, T, Hv, Dk]

    @property
    def is_decode(self) -> bool:
        return self.T == 1

    @property
    def short_label(self) -> str:
        return f"{self.family} {SHORT_DTYPE[self.dtype]} B={self.B} T={self.T}"

    @property
    def label(self) -> str:
        return f"{self.short_label} Hk={self.Hk} Hv={self.Hv} Dk={self.Dk} Dv={self.Dv}"


def work_flop(s: Shape) -> int:
    """FLOP of one call: decay, prediction S@k, rank-1 update and readout S@q, 2 per MAC."""
    return 8 * s.B * s.T * s.Hv * s.Dk * s.Dv


def state_bytes(s: Shape) -> int:
    """Bytes of one float32 state [B, Hv, Dv, Dk]."""
    return s.B * s.Hv * s.Dv * s.Dk * STATE_BYTES_PER_ELEMENT


def state_traffic_bytes(s: Shape) -> int:
    """Bytes of state one call must move at least: read once and written once."""
    return 2 * state_bytes(s)


def io_bytes(s: Shape) -> int:
    """Inputs read once plus outputs written once (the floor for any implementation)."""
    act = DTYPES[s.dtype].size
    qk = 2 * s.B * s.T * s.Hk * s.Dk * act
    v_and_y = 2 * s.B * s.T * s.Hv * s.Dv * act
    gate_values = s.Dk if s.per_key else 1
    g_and_beta = s.B * s.T * s.Hv * (gate_values + 1) * 4  # read in float32
    return qk + v_and_y + g_and_beta + state_traffic_bytes(s)


def qwen3_next(B: int, T: int, dtype: str) -> Shape:
    return Shape("qwen3-next", B, T, **dataclasses.asdict(QWEN3_NEXT), dtype=dtype)


def kimi_linear(B: int, T: int, dtype: str, per_key: bool) -> Shape:
    family = "kimi-linear-kda" if per_key else "kimi-linear-scalar"
    return Shape(family, B, T, **dataclasses.asdict(KIMI_LINEAR), dtype=dtype, per_key=per_key)


def kda_shapes(quick: bool) -> list[Shape]:
    """The KDA rows (``--kda``): decode at B=1 and prefill, f32 and bf16, each with per-key
    gates and, measured in the same run, with scalar gates on the same shape (what the
    per-key decay costs); ``quick`` keeps T in {1, 512}."""
    lengths = (1, 512) if quick else (1, 64, 512, 2048, 8192)
    return [
        kimi_linear(1, T, d, per_key) for d in DTYPES for T in lengths for per_key in (True, False)
    ]


def benchmark_shapes(quick: bool) -> list[Shape]:
    """The benchmark shapes (benchmarks/RESULTS.md); ``quick`` keeps the Qwen3-Next B=1 rows up to T=2048."""
    dtypes = list(DTYPES)
    if quick:
        return [qwen3_next(1, T, d) for d in dtypes for T in (1, 64, 512, 2048)]
    shapes = [qwen3_next(B, 1, d) for d in dtypes for B in (1, 8)]
    shapes += [qwen3_next(1, T, d) for d in dtypes for T in (64, 512, 2048, 8192)]
    shapes += [qwen3_next(4, 512, d) for d in dtypes]
    # One size changed at a time from the Qwen3-Next row at T=2048; the family names it.
    base = qwen3_next(1, 2048, "float32")
    shapes += [
        dataclasses.replace(base, family="Dk=Dv=64", Dk=64, Dv=64),
        dataclasses.replace(base, family="Dk=96", Dk=96),
        dataclasses.replace(base, family="Hk=Hv", Hk=base.Hv),
    ]
    return shapes
