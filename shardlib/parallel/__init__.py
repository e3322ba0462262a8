"""Layer-level strategies: the pieces that act inside a layer (FSDP's per-layer gathers,
Megatron TP/SP, context parallelism, expert dispatch). The model never imports them: it
calls ``shardlib.hooks``, and importing this package installs them there."""

from shardlib import hooks
from shardlib.parallel import context, moe, moe_manual, tensor

hooks.install_layer_hooks(
    enter_region=tensor.enter_region, exit_region=tensor.exit_region,
    sequence_rows=tensor.sequence_rows, vocab_lookup=tensor.vocab_lookup,
    attention=context.attend, expert_ffn=moe.expert_ffn,
    dropless_ffn=moe.dropless_ffn, row_mean=moe_manual.row_mean,
    cross_entropy=tensor.cross_entropy, manual_split=tensor.manual_split)
