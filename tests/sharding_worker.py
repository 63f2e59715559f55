"""One rank of tests/test_sharding.py (run as a script, not collected).

Builds a tiny random mlx-lm Qwen3.5 model, computes its logits unsharded, then
patches it, shards it with mlx-lm's own `Model.shard(group)` (heads split
across ranks) and runs a prefill and a decode step with the cache. Saves both
logits to <out_dir>/rank<R>.npz.
"""

import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models import qwen3_5

from mlx_gated_delta import patch_mlx_lm


def main(out_dir):
    group = mx.distributed.init(backend="ring", strict=True)
    text = dict(
        model_type="qwen3_5_text",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=512,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    )
    mx.random.seed(0)  # every rank builds the same model
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))
    mx.eval(model.parameters())
    prompt = mx.random.randint(0, 128, (1, 12), key=mx.random.key(1))
    expected = model(prompt)
    mx.eval(expected)

    patch_mlx_lm(model)
    model.shard(group)
    cache = model.make_cache()
    prefill = model(prompt[:, :9], cache=cache)
    decode = model(prompt[:, 9:], cache=cache)
    got = mx.concatenate([prefill, decode], axis=1)
    np.savez(
        f"{out_dir}/rank{group.rank()}.npz",
        expected=np.array(expected),
        got=np.array(got),
        local_value_heads=model.layers[0].linear_attn.num_v_heads,
    )


if __name__ == "__main__":
    main(sys.argv[1])
