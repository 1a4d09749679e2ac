"""PaSS look-ahead embeddings: the ``pass`` drafter (:mod:`.drafter`) and its training
(:mod:`.train`, ``accel train-pass``)."""

from .drafter import DEFAULT_PASS_DIR, PaSS, PassEmbeddings, load_pass, model_probe, save_pass

__all__ = ["PaSS", "PassEmbeddings", "DEFAULT_PASS_DIR", "load_pass", "save_pass", "model_probe"]
