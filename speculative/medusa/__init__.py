"""Medusa draft heads (Cai et al. 2024): K small heads on the model's last hidden state.

Head k (1-based) reads the final normed hidden state ``h_t`` at the last verified position
and predicts the token k steps after the one the model's own head predicts there: the root
(pending token) comes from ``lm_head(h_t)``, so head 1 drafts the token after the root, head
2 the one after that, and so on. The verifier decides, so decoding stays lossless.

Trained heads may carry a vocabulary subset (the tokens of their training data): the heads
then score only those rows of the output layer, which makes drafting and training several
times cheaper on a CPU; other tokens are never drafted (the verifier still emits them).

One concern a file:

- :mod:`.heads` -- the heads as ``nn.Module`` s (what training runs) and the residual-block
  arithmetic every form of the heads shares;
- :mod:`.formats` -- files: accel's ``medusa_heads.safetensors`` + ``medusa_config.json``
  and the official Medusa format; the shipped heads (``"default"``);
- :mod:`.packed` -- the weights packed for drafting, loaded and cached per folder, dtype
  and device;
- :mod:`.drafter` -- the ``medusa`` drafter strategy (:class:`Medusa`);
- :mod:`.trees` -- static draft trees (index paths, the paper's tree builder);
- :mod:`.dynamic_tree` -- the tree chosen anew each step from the heads' path probabilities.
"""

from .drafter import DEFAULT_MAX_NODES, Medusa
from .formats import CONFIG_NAME, DEFAULT_HEADS_DIR, WEIGHTS_NAME, resolve_heads_dir
from .heads import MedusaHead, MedusaHeads, PathBlock, ResBlock
from .packed import LoadedHeads, PackedHeads, PackedPathHeads, load_heads

__all__ = [
    "Medusa",
    "MedusaHeads",
    "MedusaHead",
    "ResBlock",
    "PathBlock",
    "PackedHeads",
    "PackedPathHeads",
    "LoadedHeads",
    "DEFAULT_HEADS_DIR",
    "DEFAULT_MAX_NODES",
    "WEIGHTS_NAME",
    "CONFIG_NAME",
    "resolve_heads_dir",
    "load_heads",
]
