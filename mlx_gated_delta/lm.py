"""``python -m mlx_gated_delta lm COMMAND [ARGS]``: mlx-lm's own command line
(``mlx_lm COMMAND [ARGS]``: generate, chat, server, lora, evaluate, benchmark,
cache_prompt, ...) with every model it loads patched by `patch_mlx_lm`.

Every command of mlx-lm builds its models through `mlx_lm.utils.load_model`
(`load`, `sharded_load` and the server's models loaded on demand call it by
its module name), so wrapping that one function for the run reaches the
model, the draft model and any model the server loads later. The patch comes
right after the weights are loaded, before mlx-lm applies LoRA adapters or
shards the model, the order in which both are known to work on our layers.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections import Counter

from .layers import FAMILIES
from .patch import NoGatedDeltaLayer, patch_mlx_lm

PREFIX = "mlx_gated_delta"


def _replaced_classes(model) -> Counter:
    """How many layers of each of mlx-lm's gated-delta classes the model holds."""
    classes = {family.mlx_lm_layer(): family for family in FAMILIES}
    return Counter(
        f"{family.name}.{family.mlx_lm_class} -> {family.layer.__name__}"
        for module in model.modules()
        if (family := classes.get(type(module))) is not None
    )


def patch_loaded_model(model, name: str, log=sys.stderr) -> int:
    """Patches a model mlx-lm has just loaded and says so in one line on
    `log`: which layers were replaced, or that the model has no gated-delta
    layer and runs unpatched. A gated-delta layer of a class `patch_mlx_lm`
    does not know is refused as it refuses it (`ValueError`)."""
    replaced = _replaced_classes(model)
    try:
        count = patch_mlx_lm(model)
    except NoGatedDeltaLayer:
        print(
            f"{PREFIX}: {name} has no gated-delta layer; it runs unpatched (mlx-lm's own layers)",
            file=log,
            flush=True,
        )
        return 0
    listed = ", ".join(f"{n} x {what}" for what, n in sorted(replaced.items()))
    print(
        f"{PREFIX}: {name}: replaced {count} gated-delta layer(s): {listed or 'none'}",
        file=log,
        flush=True,
    )
    return count


@contextlib.contextmanager
def patched_loading(log=sys.stderr):
    """While in the block, every model mlx-lm loads (`mlx_lm.utils.load_model`)
    is patched by `patch_loaded_model`."""
    from mlx_lm import utils

    load_model = utils.load_model

    @functools.wraps(load_model)
    def load_and_patch(model_path, *args, **kwargs):
        model, config = load_model(model_path, *args, **kwargs)
        patch_loaded_model(model, str(model_path), log)
        return model, config

    utils.load_model = load_and_patch
    try:
        yield
    finally:
        utils.load_model = load_model


USAGE = """\
usage: python -m mlx_gated_delta lm COMMAND [ARGS]

Runs mlx-lm's command COMMAND (generate, chat, server, lora, evaluate,
benchmark, cache_prompt, perplexity, ...) with mlx-lm's own arguments, exactly
as `mlx_lm COMMAND [ARGS]` would, with every model it loads (the model, the
draft model, the models the server loads on demand) patched by
mlx_gated_delta.patch_mlx_lm; the server's prompt cache reuses their caches
exactly (mlx_gated_delta.prompt_cache). `python -m mlx_gated_delta lm COMMAND --help`
shows mlx-lm's help for COMMAND."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    from mlx_lm import cli

    # mlx-lm's dispatcher reads the command and its arguments from sys.argv.
    saved = sys.argv
    sys.argv = ["mlx_lm", *argv]
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched_loading())
            if argv[0] == "server":
                # Its prompt cache reuses our caches exactly, with a draft
                # model too.
                from .prompt_cache import snapshot_prompt_cache

                stack.enter_context(snapshot_prompt_cache())
            cli.main()
    finally:
        sys.argv = saved
    return 0
